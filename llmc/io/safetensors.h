// safetensors.h — reading and writing named tensors in the safetensors format.
//
// The format is deliberately simple, which is why the whole ecosystem adopted it:
//   8 bytes      little-endian uint64: length N of the JSON header
//   N bytes      JSON: {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//                       "__metadata__": {"key": "value", ...}}   (offsets relative to the data)
//   the rest     the tensors' raw little-endian bytes, back to back
// No pickles, no code execution on load, and a reader can memory-map any one tensor directly.
// The trainers use it to dump debugging state for the tests (--dump-state); Hugging Face
// import/export (hf_convert.cpp, llmc/io/hf_gpt2.h) reads and writes GPT-2 weights in it.
//
// The reader trusts nothing: a file from the internet may be truncated, hand-edited or hostile.
// Before any tensor is read, read_safetensors_header() checks what the format promises:
//   - the header length fits the file (and is below 100 MB, the format's own limit, so a damaged
//     length cannot make us allocate gigabytes);
//   - the header is a JSON object; each tensor has a known dtype, a shape of non-negative integers
//     and data_offsets [begin, end] with end - begin = (product of the shape) * (dtype size);
//   - the tensors tile the data region exactly: sorted by offset, each starts where the previous
//     ended, the first at 0 and the last at the end of the file (no gaps, no overlaps, no
//     trailing bytes), which is also what the reference implementation requires.
// Every error names the file and the tensor.
#pragma once

#include <algorithm>
#include <cstdint>
#include <map>
#include <string>
#include <vector>
#include "llmc/io/json.h"
#include "llmc/utils.h"

struct SafetensorsTensor {
    std::string name;
    std::string dtype;           // "F32", "I32", "BF16", ...
    std::vector<int64_t> shape;
    const void* data;
    size_t bytes;
};

inline void write_safetensors(const std::string& path, const std::vector<SafetensorsTensor>& tensors,
                              const std::map<std::string, std::string>& metadata) {
    std::string header = "{";
    size_t offset = 0;
    for (const SafetensorsTensor& t : tensors) {
        header += "\"" + t.name + "\":{\"dtype\":\"" + t.dtype + "\",\"shape\":[";
        for (size_t i = 0; i < t.shape.size(); i++) header += (i ? "," : "") + std::to_string(t.shape[i]);
        header += "],\"data_offsets\":[" + std::to_string(offset) + "," + std::to_string(offset + t.bytes) + "]},";
        offset += t.bytes;
    }
    header += "\"__metadata__\":{";
    bool first = true;
    for (const auto& kv : metadata) {
        header += (first ? "\"" : ",\"") + kv.first + "\":\"" + kv.second + "\"";
        first = false;
    }
    header += "}}";
    while (header.size() % 8) header += ' ';  // the data then starts 8-byte aligned
    uint64_t header_len = header.size();
    AtomicFile out(path, "safetensors file");
    out.write(&header_len, 8);
    out.write(header.data(), header.size());
    for (const SafetensorsTensor& t : tensors) out.write(t.data, t.bytes);
    out.commit();
}

// ----------------------------------------------------------------------------------------------
// Reading

struct SafetensorsEntry {
    std::string name;
    std::string dtype;
    std::vector<int64_t> shape;
    uint64_t begin = 0, end = 0;   // byte offsets within the data region
};

struct SafetensorsFile {
    std::string path;
    uint64_t data_start = 0;       // 8 + header length
    std::vector<SafetensorsEntry> tensors;               // in header order
    std::vector<std::pair<std::string, std::string>> metadata;

    const SafetensorsEntry* find(const std::string& name) const {
        for (const SafetensorsEntry& t : tensors)
            if (t.name == name) return &t;
        return nullptr;
    }
};

// Bytes per element of a safetensors dtype, 0 for a name the format does not define.
inline size_t safetensors_dtype_size(const std::string& dtype) {
    if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
    if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
    if (dtype == "F16" || dtype == "BF16" || dtype == "I16" || dtype == "U16") return 2;
    if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
    return 0;
}

inline std::string shape_string(const std::vector<int64_t>& shape) {
    std::string s = "[";
    for (size_t i = 0; i < shape.size(); i++) s += (i ? ", " : "") + std::to_string(shape[i]);
    return s + "]";
}

// The header's JSON text, after the 8 bytes that give its length; st->data_start and the data
// region's bytes (*data_bytes) from them.
inline std::string read_safetensors_header_text(const std::string& path, SafetensorsFile* st, uint64_t* data_bytes) {
    const char* what = "safetensors file";
    FILE* f = open_for_reading(path, what);
    int64_t file_bytes = file_size(f);
    if (file_bytes < 8) fail("'%s' has %lld bytes: too short to be a safetensors file", path.c_str(), (long long)file_bytes);
    uint64_t header_len = 0;
    read_exactly(f, &header_len, 8, path, what);
    if (header_len == 0 || header_len > 100000000ull || header_len > (uint64_t)file_bytes - 8) {
        fail("'%s' is not a valid safetensors file: its first 8 bytes give a header of %llu bytes, and the file has %lld "
             "(is it truncated, or another format?)", path.c_str(), (unsigned long long)header_len, (long long)file_bytes);
    }
    std::string header(header_len, '\0');
    read_exactly(f, header.data(), header_len, path, what);
    fclose(f);
    st->data_start = 8 + header_len;
    *data_bytes = (uint64_t)file_bytes - st->data_start;
    return header;
}

// One tensor's entry of the header, checked: a known dtype, a shape, and data_offsets that hold
// exactly its bytes inside the data region.
inline SafetensorsEntry safetensors_entry(const SafetensorsFile& st, const std::string& name, const JsonValue& info,
                                          uint64_t data_bytes) {
    const std::string& path = st.path;
    auto bad = [&](const std::string& why) { fail("safetensors file '%s', tensor '%s': %s", path.c_str(), name.c_str(), why.c_str()); };
    if (st.find(name)) bad("appears twice in the header");
    if (!info.is_object()) bad("its entry is not an object with dtype, shape and data_offsets");
    const JsonValue* dtype = info.find("dtype");
    const JsonValue* shape = info.find("shape");
    const JsonValue* offsets = info.find("data_offsets");
    if (!dtype || !dtype->is_string()) bad("no \"dtype\" string");
    if (!shape || !shape->is_array()) bad("no \"shape\" array");
    if (!offsets || !offsets->is_array() || offsets->array.size() != 2) bad("no \"data_offsets\" pair [begin, end]");
    SafetensorsEntry t;
    t.name = name;
    t.dtype = dtype->string;
    size_t element = safetensors_dtype_size(t.dtype);
    if (element == 0) bad("unknown dtype '" + t.dtype + "'");
    uint64_t elements = 1;
    for (const JsonValue& d : shape->array) {
        if (!d.is_integer || d.integer < 0) bad("the shape must be a list of non-negative integers");
        if (d.integer > 0 && elements > UINT64_MAX / 16 / (uint64_t)d.integer) bad("the shape is impossibly large");
        t.shape.push_back(d.integer);
        elements *= (uint64_t)d.integer;
    }
    for (const JsonValue& o : offsets->array)
        if (!o.is_integer || o.integer < 0) bad("data_offsets must be non-negative integers");
    t.begin = (uint64_t)offsets->array[0].integer;
    t.end = (uint64_t)offsets->array[1].integer;
    if (t.end < t.begin) bad("data_offsets end before they begin");
    if (t.end - t.begin != elements * element) {
        bad(strprintf("data_offsets [%llu, %llu] hold %llu bytes, but shape %s of %s needs %llu",
                      (unsigned long long)t.begin, (unsigned long long)t.end, (unsigned long long)(t.end - t.begin),
                      shape_string(t.shape).c_str(), t.dtype.c_str(), (unsigned long long)(elements * element)));
    }
    if (t.end > data_bytes) {
        bad(strprintf("its data ends at byte %llu of the data region, which has only %llu bytes: the file is truncated",
                      (unsigned long long)t.end, (unsigned long long)data_bytes));
    }
    return t;
}

// The tensors must tile the data region: no gaps, no overlaps, nothing after the last.
inline void check_safetensors_tiling(const SafetensorsFile& st, uint64_t data_bytes) {
    const std::string& path = st.path;
    std::vector<const SafetensorsEntry*> by_offset;
    for (const SafetensorsEntry& t : st.tensors) by_offset.push_back(&t);
    std::sort(by_offset.begin(), by_offset.end(), [](const SafetensorsEntry* a, const SafetensorsEntry* b) {
        return a->begin != b->begin ? a->begin < b->begin : a->end < b->end;
    });
    uint64_t expected = 0;
    for (const SafetensorsEntry* t : by_offset) {
        if (t->begin != expected) {
            fail("safetensors file '%s', tensor '%s': its data starts at byte %llu, but the previous tensor ends at %llu "
                 "(tensors must follow each other without gaps or overlaps)", path.c_str(), t->name.c_str(),
                 (unsigned long long)t->begin, (unsigned long long)expected);
        }
        expected = t->end;
    }
    if (expected != data_bytes) {
        fail("safetensors file '%s' has %llu bytes after its last tensor: the header does not describe the whole file",
             path.c_str(), (unsigned long long)(data_bytes - expected));
    }
}

// Reads and validates the header (see the top of this file); the tensors' bytes are read later,
// one tensor at a time, by safetensors_read_floats().
inline SafetensorsFile read_safetensors_header(const std::string& path) {
    SafetensorsFile st;
    st.path = path;
    uint64_t data_bytes = 0;
    std::string header = read_safetensors_header_text(path, &st, &data_bytes);
    JsonValue root;
    std::string error;
    if (!json_parse(header, &root, &error)) fail("the header of safetensors file '%s' is not valid JSON: %s", path.c_str(), error.c_str());
    if (!root.is_object()) fail("the header of safetensors file '%s' is %s, not a JSON object", path.c_str(), json_type_name(root.type));
    for (const auto& member : root.object) {
        const std::string& name = member.first;
        const JsonValue& info = member.second;
        if (name == "__metadata__") {
            if (!info.is_object()) fail("safetensors file '%s': __metadata__ must be an object of strings", path.c_str());
            for (const auto& kv : info.object) {
                if (!kv.second.is_string()) fail("safetensors file '%s': metadata '%s' is not a string", path.c_str(), kv.first.c_str());
                st.metadata.emplace_back(kv.first, kv.second.string);
            }
            continue;
        }
        st.tensors.push_back(safetensors_entry(st, name, info, data_bytes));
    }
    check_safetensors_tiling(st, data_bytes);
    return st;
}

// IEEE half precision to float: 1 sign, 5 exponent (bias 15), 10 mantissa bits. Subnormals
// (exponent 0) are renormalised into float's wider exponent range; infinities and NaNs are kept.
inline float f16_to_float(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000) << 16;
    int exponent = (h >> 10) & 0x1f;
    uint32_t mantissa = h & 0x3ff, bits;
    if (exponent == 0 && mantissa == 0) {
        bits = sign;
    } else if (exponent == 0) {  // subnormal: 0.m * 2^-14 = 1.m' * 2^(e-15) after shifting m left
        exponent = 1;
        while (!(mantissa & 0x400)) { mantissa <<= 1; exponent--; }
        bits = sign | (uint32_t)(exponent - 15 + 127) << 23 | (mantissa & 0x3ff) << 13;
    } else if (exponent == 31) {
        bits = sign | 0x7f800000u | mantissa << 13;
    } else {
        bits = sign | (uint32_t)(exponent - 15 + 127) << 23 | mantissa << 13;
    }
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

// Reads one tensor as fp32: F32 as is, F16 and BF16 widened exactly. Other dtypes are refused.
inline std::vector<float> safetensors_read_floats(const SafetensorsFile& st, const SafetensorsEntry& t) {
    size_t element = safetensors_dtype_size(t.dtype);
    if (t.dtype != "F32" && t.dtype != "F16" && t.dtype != "BF16") {
        fail("safetensors file '%s', tensor '%s': dtype %s; weights must be F32, F16 or BF16", st.path.c_str(),
             t.name.c_str(), t.dtype.c_str());
    }
    size_t n = (size_t)((t.end - t.begin) / element);
    std::vector<float> out(n);
    FILE* f = open_for_reading(st.path, "safetensors file");
    if (fseeko(f, (off_t)(st.data_start + t.begin), SEEK_SET) != 0) fail("cannot seek in '%s'", st.path.c_str());
    if (t.dtype == "F32") {
        read_exactly(f, out.data(), n * 4, st.path, "safetensors file");
    } else {
        std::vector<uint16_t> half(n);
        read_exactly(f, half.data(), n * 2, st.path, "safetensors file");
        for (size_t i = 0; i < n; i++) out[i] = t.dtype == "F16" ? f16_to_float(half[i]) : bf16_to_float(half[i]);
    }
    fclose(f);
    return out;
}
