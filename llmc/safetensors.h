// safetensors.h — writing named tensors in the safetensors format.
//
// The format is deliberately simple, which is why the whole ecosystem adopted it:
//   8 bytes      little-endian uint64: length N of the JSON header
//   N bytes      JSON: {"name": {"dtype": "F32", "shape": [2, 3], "data_offsets": [begin, end]}, ...,
//                       "__metadata__": {"key": "value", ...}}   (offsets relative to the data)
//   the rest     the tensors' raw little-endian bytes, back to back
// No pickles, no code execution on load, and a reader can memory-map any one tensor directly.
// The trainers use it to dump debugging state for the tests (--dump-state); Hugging Face
// import/export reads and writes GPT-2 weights in it.
#pragma once

#include <cstdint>
#include <map>
#include <string>
#include <vector>
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
