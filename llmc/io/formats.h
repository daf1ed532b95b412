// formats.h — the files a trainer reads and writes, byte for byte (see docs/formats.md).
//
//   model file    llm.c's format: 256 x int32 header (magic 20240326, version 3 = fp32 or 5 = bf16,
//                 maxT, V, L, NH, C, Vp), then every parameter in the order of model.h. So llm.c's
//                 gpt2_124M.bin loads here and our checkpoints load in llm.c.
//                 Version 7 (ours) is a mixture-of-experts model: version 3's header with E, top-k
//                 and every in h[8..10], the 16 tensors, then the MoE table (model.h). Only the CPU
//                 trainer's training reads it; every other reader refuses it in one line.
//   MoE state     ours (moe_state.bin in a checkpoint of an MoE model): AdamW's m and v of the MoE table.
//   fp8 state     ours (fp8_state.bin in a checkpoint of a --precision fp8 run): the amax histories and
//                 scales of delayed scaling (llmc/kernels/fp8.cuh).
//   token shard   llm.c's format: 256 x int32 header (magic 20240520, version 1, token count), then
//                 the tokens as uint16. Any shard llm.c's data scripts wrote loads unchanged.
//   train state   ours: what, beyond the weights, makes a resumed run continue bit-identically:
//                 AdamW's m and v (and fp32 master weights when parameters are bf16, or when no
//                 single rank holds all the weights), the step, the sampler's RNG and the data
//                 loader's position. One file per rank: with ZeRO each rank owns a slice
//                 [shard_begin, shard_begin + shard_count) of the optimizer state; with tensor or
//                 pipeline parallelism a list of runs of the global parameter array (a run table).
//
// Every reader validates before trusting: the magic number (and names the file it is if it is a
// different one of ours), the version, and that the size matches what the header promises.
// Every writer goes through AtomicFile: a crash mid-write leaves the previous file intact.
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <vector>
#include "llmc/model/model.h"
#include "llmc/optim/optimizer_state.h"  // optimizer_name: moe_state.bin names its optimizer
#include "llmc/utils.h"

constexpr int32_t MODEL_MAGIC = 20240326;
constexpr int32_t MODEL_VERSION_FP32 = 3;
constexpr int32_t MODEL_VERSION_BF16 = 5;
constexpr int32_t MODEL_VERSION_MOE = 7;  // fp32, + E, top-k, every and the MoE table (docs/formats.md)
constexpr int32_t MOE_STATE_MAGIC = 20261126;
constexpr int32_t MOE_STATE_VERSION = 2;  // 2: field 7 names the optimizer (1: AdamW's, still read)
constexpr int32_t FP8_STATE_MAGIC = 20261127;
constexpr int32_t FP8_STATE_VERSION = 1;
constexpr int32_t SHARD_MAGIC = 20240520;
constexpr int32_t SHARD_VERSION = 1;
constexpr int32_t STATE_MAGIC = 20241121;
// 2 added the run table and the grid; 3 the optimizer (a factored optimizer's state in place of m and
// v). AdamW's files are still written as version 2, byte for byte as before, so that readers that
// know only versions 1 and 2 keep reading them; a version 3 file they refuse in one line.
constexpr int32_t STATE_VERSION = 3;
constexpr int32_t STATE_VERSION_ADAMW = 2;
constexpr int32_t OPTIONS_VERSION = 1;  // the recorded options in the state header (llmc/run/resume.h)
constexpr size_t HEADER_INTS = 256;

// If a file has the wrong magic number, say what it looks like instead.
inline const char* describe_magic(int32_t magic) {
    switch (magic) {
        case MODEL_MAGIC: return "a model file";
        case SHARD_MAGIC: return "a token shard";
        case STATE_MAGIC: return "a training-state file";
        case MOE_STATE_MAGIC: return "an MoE training-state file";
        case FP8_STATE_MAGIC: return "an fp8 scaling-state file";
        default: return "not a file of this project";
    }
}

// ----------------------------------------------------------------------------------------------
// Model files

struct ModelHeader {
    GPT2Config config;
    int version = MODEL_VERSION_FP32;
    MoEConfig moe;        // version 7: experts and every (experts 0: a dense model)
    int moe_top_k = 0;    // version 7: experts per token
};

// What a model's MoE settings are called on the command line (for the messages that compare them).
inline std::string describe_moe_flags(const MoEConfig& m, int top_k) {
    if (m.experts == 0) return "a dense model (no --moe-experts)";
    return strprintf("--moe-experts %d --moe-top-k %d --moe-every %d", m.experts, top_k, m.every);
}

// `holds_moe`: the caller can hold a mixture-of-experts model (both trainers' training and --generate).
// Every other reader (hf_convert) refuses a version 7 file here, in one line.
inline ModelHeader parse_model_header(const int32_t* h, const std::string& path, bool holds_moe = false) {
    if (h[0] != MODEL_MAGIC) {
        fail("'%s' is not a model file (magic %d, expected %d; it looks like %s). "
             "Pass a model .bin written by this project or llm.c, or a descriptor such as d12",
             path.c_str(), h[0], MODEL_MAGIC, describe_magic(h[0]));
    }
    if (h[1] == MODEL_VERSION_MOE && !holds_moe) {
        fail("model file '%s' is a mixture-of-experts model (version %d: %d experts): this reader holds dense GPT-2 only "
             "(versions %d and %d); train it on with train_gpt_cpu --resume, which reads it", path.c_str(), h[1], h[8],
             MODEL_VERSION_FP32, MODEL_VERSION_BF16);
    }
    if (h[1] != MODEL_VERSION_FP32 && h[1] != MODEL_VERSION_BF16 && h[1] != MODEL_VERSION_MOE) {
        fail("model file '%s' has version %d; this program reads version %d (fp32) and %d (bf16)",
             path.c_str(), h[1], MODEL_VERSION_FP32, MODEL_VERSION_BF16);
    }
    ModelHeader mh;
    mh.version = h[1];
    mh.config.max_seq_len = h[2];
    mh.config.vocab_size = h[3];
    mh.config.num_layers = h[4];
    mh.config.num_heads = h[5];
    mh.config.channels = h[6];
    mh.config.padded_vocab_size = h[7];
    std::string why;
    if (!config_is_valid(mh.config, &why)) {
        fail("model file '%s' has an impossible shape (%s): %s", path.c_str(),
             describe_config(mh.config).c_str(), why.c_str());
    }
    if (mh.version == MODEL_VERSION_MOE) {
        mh.moe = MoEConfig{h[8], h[10]};
        mh.moe_top_k = h[9];
        if (h[8] < 1 || h[8] > (1 << 20) || (h[9] != 1 && h[9] != 2) || h[9] > h[8] || h[10] < 1) {
            fail("model file '%s' has an impossible mixture of experts (%d experts, top-%d, every %d): its header is damaged",
                 path.c_str(), h[8], h[9], h[10]);
        }
    }
    return mh;
}

// The bytes a model file with this header must have: the header, then every parameter. A header is
// 8 int32 anyone can write, so its products are counted first in double: a shape whose file would
// pass 2^62 bytes (V = 2^31-1 with C = 2^31-1, or L = 2^30) is reported as such instead of
// overflowing size_t into a small, plausible number. Returns -1 for such a shape.
inline int64_t model_file_bytes(const ModelHeader& mh) {
    const GPT2Config& c = mh.config;
    double C = c.channels, bytes_per = mh.version == MODEL_VERSION_BF16 ? 2 : 4;
    double n = ((double)c.padded_vocab_size + c.max_seq_len) * C + (double)c.num_layers * (12.0 * C * C + 13.0 * C) + 2.0 * C;
    if (mh.version == MODEL_VERSION_MOE) n += (double)c.num_layers * mh.moe.experts * (8.0 * C * C + 6.0 * C);  // (a bound)
    if (n * bytes_per > 4.0e18) return -1;
    size_t moe = mh.version == MODEL_VERSION_MOE ? moe_layout(c, mh.moe).total : 0;
    return (int64_t)(HEADER_INTS * sizeof(int32_t)) + (int64_t)((param_layout(c).total + moe) * (size_t)bytes_per);
}

// A model file's length must be what its header promises, checked before anything is allocated from
// the header: a damaged header must not make a trainer ask for terabytes (std::bad_alloc) or spend
// minutes allocating before it finds the file too short.
inline void check_model_file_size(FILE* f, const ModelHeader& mh, const std::string& path) {
    int64_t expected = model_file_bytes(mh), actual = file_size(f);
    if (expected < 0) {
        fail("model file '%s' has a header (%s) whose parameters would need more than 2^62 bytes: the header is "
             "damaged; re-create or re-download the file", path.c_str(), describe_config(mh.config).c_str());
    }
    if (actual != expected) {
        fail("model file '%s' has %lld bytes but its header (%s, %s) implies %lld: the file is %s",
             path.c_str(), (long long)actual, describe_config(mh.config).c_str(),
             mh.version == MODEL_VERSION_BF16 ? "bf16" : mh.version == MODEL_VERSION_MOE ? "fp32 MoE" : "fp32", (long long)expected,
             actual < expected ? "truncated or its header is damaged" : "followed by unexpected bytes");
    }
}

// The header of a model file whose length has been checked against it.
inline ModelHeader read_model_header(const std::string& path, bool holds_moe = false) {
    FILE* f = open_for_reading(path, "model file");
    int32_t h[HEADER_INTS];
    read_exactly(f, h, sizeof(h), path, "model file");
    ModelHeader mh = parse_model_header(h, path, holds_moe);
    check_model_file_size(f, mh, path);
    fclose(f);
    return mh;
}

// Reads all parameters as fp32 (bf16 files are widened exactly). With `moe_params` a version 7 file
// is read too: the 16 tensors into params, the MoE table into *moe_params (left empty for a dense file).
inline void read_model_file(const std::string& path, GPT2Config* config, std::vector<float>* params,
                            std::vector<float>* moe_params = nullptr) {
    FILE* f = open_for_reading(path, "model file");
    int32_t h[HEADER_INTS];
    read_exactly(f, h, sizeof(h), path, "model file");
    ModelHeader mh = parse_model_header(h, path, moe_params != nullptr);
    check_model_file_size(f, mh, path);
    size_t n = param_layout(mh.config).total;
    if (moe_params) {
        moe_params->resize(mh.version == MODEL_VERSION_MOE ? moe_layout(mh.config, mh.moe).total : 0);
    }
    size_t bytes_per = mh.version == MODEL_VERSION_BF16 ? 2 : 4;
    params->resize(n);
    if (bytes_per == 4) {
        read_exactly(f, params->data(), n * 4, path, "model file");
    } else {
        std::vector<uint16_t> half(n);
        read_exactly(f, half.data(), n * 2, path, "model file");
        for (size_t i = 0; i < n; i++) (*params)[i] = bf16_to_float(half[i]);
    }
    if (moe_params && !moe_params->empty()) read_exactly(f, moe_params->data(), moe_params->size() * 4, path, "model file");
    fclose(f);
    *config = mh.config;
}

inline void fill_model_header(int32_t* h, const GPT2Config& c, int version) {
    memset(h, 0, HEADER_INTS * sizeof(int32_t));
    h[0] = MODEL_MAGIC;
    h[1] = version;
    h[2] = c.max_seq_len;
    h[3] = c.vocab_size;
    h[4] = c.num_layers;
    h[5] = c.num_heads;
    h[6] = c.channels;
    h[7] = c.padded_vocab_size;
}

// Writes fp32 params as version 3, or rounded to nearest bf16 as version 5.
inline void write_model_file(const std::string& path, const GPT2Config& c, const float* params, bool as_bf16) {
    int32_t h[HEADER_INTS];
    fill_model_header(h, c, as_bf16 ? MODEL_VERSION_BF16 : MODEL_VERSION_FP32);
    size_t n = param_layout(c).total;
    AtomicFile out(path, "model file");
    out.write(h, sizeof(h));
    if (!as_bf16) {
        out.write(params, n * sizeof(float));
    } else {
        std::vector<uint16_t> chunk;
        for (size_t i = 0; i < n; i += (1 << 20)) {
            size_t m = std::min(n - i, (size_t)1 << 20);
            chunk.resize(m);
            for (size_t j = 0; j < m; j++) chunk[j] = float_to_bf16_round_nearest(params[i + j]);
            out.write(chunk.data(), m * 2);
        }
    }
    out.commit();
}

// Writes a mixture-of-experts model as version 7: fp32, the dense table, then the MoE table.
inline void write_moe_model_file(const std::string& path, const GPT2Config& c, const MoEConfig& moe, int top_k, const float* params,
                                 const float* moe_params) {
    int32_t h[HEADER_INTS];
    fill_model_header(h, c, MODEL_VERSION_MOE);
    h[8] = moe.experts;
    h[9] = top_k;
    h[10] = moe.every;
    AtomicFile out(path, "model file");
    out.write(h, sizeof(h));
    out.write(params, param_layout(c).total * sizeof(float));
    out.write(moe_params, moe_layout(c, moe).total * sizeof(float));
    out.commit();
}

// The MoE table's optimizer state (moe_state.bin): 256 int32 header (magic, version, E, top-k, every,
// then n as an int64 in h[5..6], then the optimizer in h[7]: llmc/optim/optimizer_state.h's numbers,
// 0 AdamW, 1 Adafactor, 2 SM3), then fp32: AdamW's m then v, the whole table's n values each,
// whatever the expert-parallel degree; or a factored optimizer's n statistics (`v` null: the MoE
// table's blocks' rows and columns, optimizer_state.h's moe_param_blocks order). Written by rank 0
// (which gathers the experts it does not hold). Version 1 had no field 7: AdamW's.
inline void write_moe_state(const std::string& path, const MoEConfig& moe, int top_k, int optimizer, const float* m, const float* v,
                            size_t n_values) {
    int32_t h[HEADER_INTS] = {};
    h[0] = MOE_STATE_MAGIC;
    h[1] = MOE_STATE_VERSION;
    h[2] = moe.experts, h[3] = top_k, h[4] = moe.every;
    int64_t n = (int64_t)n_values;
    memcpy(&h[5], &n, sizeof(n));
    h[7] = optimizer;
    AtomicFile out(path, "MoE training-state file");
    out.write(h, sizeof(h));
    out.write(m, n_values * sizeof(float));
    if (v) out.write(v, n_values * sizeof(float));
    out.commit();
}

// Reads them back into m and v (n_values each, the whole table; v left empty for a factored
// optimizer); the settings, the optimizer and the size must be this run's.
inline void read_moe_state(const std::string& path, const MoEConfig& moe, int top_k, int optimizer, size_t n_values,
                           std::vector<float>* m, std::vector<float>* v) {
    FILE* f = open_for_reading(path, "MoE training-state file");
    int32_t h[HEADER_INTS];
    read_exactly(f, h, sizeof(h), path, "MoE training-state file");
    int64_t n = 0;
    memcpy(&n, &h[5], sizeof(n));
    if (h[0] != MOE_STATE_MAGIC || h[1] < 1 || h[1] > MOE_STATE_VERSION) {
        fail("'%s' is not an MoE training-state file of versions 1 to %d (it looks like %s%s): resume from a checkpoint written "
             "by this program", path.c_str(), MOE_STATE_VERSION, describe_magic(h[0]),
             h[0] == MOE_STATE_MAGIC ? strprintf(", version %d", h[1]).c_str() : "");
    }
    int file_optimizer = h[1] == 1 ? 0 : h[7];
    if (file_optimizer != optimizer) {
        fail("'%s' holds the MoE table's %s state, and this run's --optimizer is %s: resume with --optimizer %s", path.c_str(),
             optimizer_name(file_optimizer), optimizer_name(optimizer), optimizer_name(file_optimizer));
    }
    int arrays = optimizer == 0 ? 2 : 1;
    if (h[2] != moe.experts || h[3] != top_k || h[4] != moe.every || n != (int64_t)n_values ||
        file_size(f) != (int64_t)sizeof(h) + 4 * arrays * n) {
        fail("'%s' holds the optimizer state of %s (%lld values), not this model's: it does not belong with this checkpoint",
             path.c_str(), describe_moe_flags(MoEConfig{h[2], h[4]}, h[3]).c_str(), (long long)n);
    }
    m->resize(n_values);
    read_exactly(f, m->data(), m->size() * sizeof(float), path, "MoE training-state file");
    if (arrays == 2) {
        v->resize(n_values);
        read_exactly(f, v->data(), v->size() * sizeof(float), path, "MoE training-state file");
    }
    fclose(f);
}

// Delayed scaling's state (fp8_state.bin, llmc/kernels/fp8.cuh): 256 int32 header (magic, version,
// tensors, history length), then fp32: the amax histories (tensors x history, newest first), the
// scales, the inverse scales. `values` is all three, in that order.
inline void write_fp8_state(const std::string& path, int tensors, int history, const std::vector<float>& values) {
    int32_t h[HEADER_INTS] = {};
    h[0] = FP8_STATE_MAGIC, h[1] = FP8_STATE_VERSION, h[2] = tensors, h[3] = history;
    AtomicFile out(path, "fp8 scaling-state file");
    out.write(h, sizeof(h));
    out.write(values.data(), values.size() * sizeof(float));
    out.commit();
}

// Reads it back into values (sized already, tensors x (history + 2)); the shape must be this run's.
inline void read_fp8_state(const std::string& path, int tensors, int history, std::vector<float>* values) {
    FILE* f = open_for_reading(path, "fp8 scaling-state file");
    int32_t h[HEADER_INTS];
    read_exactly(f, h, sizeof(h), path, "fp8 scaling-state file");
    if (h[0] != FP8_STATE_MAGIC || h[1] != FP8_STATE_VERSION)
        fail("'%s' is not an fp8 scaling-state file of version %d (it looks like %s): resume from a checkpoint written by "
             "this program", path.c_str(), FP8_STATE_VERSION, describe_magic(h[0]));
    if (h[2] != tensors || h[3] != history || file_size(f) != (int64_t)(sizeof(h) + values->size() * sizeof(float)))
        fail("'%s' holds %d tensors' scaling over %d steps; this run has %d tensors and --fp8-amax-history %d: resume with "
             "the checkpoint's model and --fp8-amax-history", path.c_str(), h[2], h[3], tensors, history);
    read_exactly(f, values->data(), values->size() * sizeof(float), path, "fp8 scaling-state file");
    fclose(f);
}

// Writes bf16 parameters (raw bf16 bits, as the GPU trainer holds them) as version 5, unchanged.
inline void write_model_file_bf16(const std::string& path, const GPT2Config& c, const uint16_t* params) {
    int32_t h[HEADER_INTS];
    fill_model_header(h, c, MODEL_VERSION_BF16);
    AtomicFile out(path, "model file");
    out.write(h, sizeof(h));
    out.write(params, param_layout(c).total * 2);
    out.commit();
}

// ----------------------------------------------------------------------------------------------
// Token shards

// Validates an open shard's header (magic, version, a token count its length agrees with) and returns
// the count; nothing is allocated from the header before this.
inline int64_t read_token_shard_header(FILE* f, const std::string& path) {
    int32_t h[HEADER_INTS];
    read_exactly(f, h, sizeof(h), path, "token shard");
    if (h[0] != SHARD_MAGIC) {
        fail("'%s' is not a token shard (magic %d, expected %d; it looks like %s). "
             "Make shards with ./prepare_data", path.c_str(), h[0], SHARD_MAGIC, describe_magic(h[0]));
    }
    if (h[1] != SHARD_VERSION) {
        fail("token shard '%s' has version %d; this program reads version %d (uint16 tokens)",
             path.c_str(), h[1], SHARD_VERSION);
    }
    int64_t count = h[2];
    int64_t expected = (int64_t)sizeof(h) + count * 2;
    int64_t actual = file_size(f);
    if (count < 0 || actual != expected) {
        fail("token shard '%s' has %lld bytes but its header promises %lld tokens (%lld bytes): the file is %s",
             path.c_str(), (long long)actual, (long long)count, (long long)expected,
             actual < expected ? "truncated; re-create it with ./prepare_data" : "followed by unexpected bytes");
    }
    return count;
}

inline std::vector<uint16_t> read_token_shard(const std::string& path) {
    FILE* f = open_for_reading(path, "token shard");
    int64_t count = read_token_shard_header(f, path);
    std::vector<uint16_t> tokens((size_t)count);
    read_exactly(f, tokens.data(), tokens.size() * 2, path, "token shard");
    fclose(f);
    return tokens;
}

inline void write_token_shard(const std::string& path, const std::vector<uint16_t>& tokens) {
    if (tokens.size() > (size_t)INT32_MAX) fail("shard '%s' would hold %zu tokens, more than its header can count", path.c_str(), tokens.size());
    int32_t h[HEADER_INTS] = {0};
    h[0] = SHARD_MAGIC;
    h[1] = SHARD_VERSION;
    h[2] = (int32_t)tokens.size();
    AtomicFile out(path, "token shard");
    out.write(h, sizeof(h));
    out.write(tokens.data(), tokens.size() * 2);
    out.commit();
}

// ----------------------------------------------------------------------------------------------
// Training state

// Where the data loader stands: enough to continue with exactly the next batch.
struct LoaderPosition {
    int64_t shard_index = 0;  // which file of the sorted shard list
    int64_t position = 0;     // token offset of the next batch within that shard
    int64_t epoch = 0;        // completed passes over all shards
};

// The fixed 1024-byte header of a training-state file (little-endian, no implicit padding).
// After it: the run table when has_run_table (num_runs pairs of int64: global index, count), then
// m, v and (has_master_weights) the weights, shard_count floats each, in the order of the runs.
// Without a run table the file holds the one run [shard_begin, shard_begin + shard_count).
// Version 3 with a factored optimizer (Adafactor, SM3): optimizer_state_floats floats instead of
// m and v (docs/formats.md).
struct TrainStateHeader {
    int32_t magic = STATE_MAGIC;
    int32_t version = STATE_VERSION;
    int64_t step = 0;                 // optimizer steps completed
    int64_t num_params = 0;           // of the whole model
    int64_t shard_begin = 0;          // this file's slice of the optimizer state
    int64_t shard_count = 0;
    int32_t rank = 0, world_size = 1; // who wrote it, out of how many
    int32_t zero_stage = 0;
    int32_t has_master_weights = 0;   // 1: fp32 master weights follow m and v
    int32_t batch_size = 0, seq_len = 0;  // B and T of the run, to warn about changed data order
    uint64_t sampler_rng = 0;         // state of the sampling RNG
    LoaderPosition train_loader;
    int64_t total_batch_tokens = 0;
    int32_t has_run_table = 0;        // 1: a run table follows the header (version 2)
    int32_t tensor_parallel = 0, pipeline_parallel = 0;  // the grid that wrote it (0 in version 1: both 1)
    int32_t sequence_parallel = 0;
    int64_t num_runs = 0;
    // version 3: which optimizer's state the file holds (llmc/optim/optimizer_state.h: 0 AdamW, whose
    // m and v follow as before; 1 Adafactor, 2 SM3, whose optimizer_state_floats follow instead, in
    // the order of param_blocks(), and shard_count is 0: no per-element state; or, with tensor
    // parallelism, the rank's slice_param_blocks() statistics, then its shard_count weights in the
    // order of the run table, has_master_weights 1, for model.bin's assembly; the GPU trainer's bf16
    // build: the statistics, then its fp32 master weights, has_master_weights 1)
    int32_t optimizer = 0, reserved_pad = 0;
    int64_t optimizer_state_floats = 0;
    // fp16's loss scaler (llmc/optim/loss_scaler.h), in the reserved space (readers of any version
    // take the zeros of older files as "no scaler state"): S (0 = none), the clean steps since the
    // last change of S, and the steps skipped for an overflow (AdamW's t = step - these)
    float loss_scale = 0;
    int32_t loss_scale_clean_steps = 0;
    int64_t loss_scale_overflows = 0;
    // the options that shape training (llmc/run/resume.h), for a resumed run to continue with: the
    // version of their record (0: none, a checkpoint written before they were recorded; a reader
    // refuses a newer one than it knows), and the record, text, one flag a line, NUL-padded:
    //   "set lr 0.01\n" (given on the command line) or "default beta1 0.899999976\n" (the build's default)
    int32_t options_version = 0;
    char options[800] = {0};
    // the steps whose update was skipped because their loss or gradient norm was not finite
    // (llmc/run/step.h), in the reserved space too (an older file's zero: none): AdamW's t = step - these
    // - loss_scale_overflows
    int32_t updates_skipped = 0;
    int32_t reserved[256 - 40 - 1 - 200 - 1] = {0};  // room to grow without changing the version
};
static_assert(sizeof(TrainStateHeader) == 1024, "the train-state header must stay 1024 bytes");
static_assert(offsetof(TrainStateHeader, updates_skipped) == 964, "docs/formats.md's byte 964");

struct TrainState {
    TrainStateHeader header;
    std::vector<int64_t> runs;        // with a run table: (global index, count) pairs
    std::vector<float> m, v, master;  // shard_count elements each (master may be empty)
    std::vector<float> factored;      // version 3, a factored optimizer: optimizer_state_floats values
    // instead of m and v in memory: writes m (which = 0) or v (1), shard_count floats, piece by piece
    // through `write` (--offload-dir streams them from its files: llmc/optim/disk_offload.h)
    std::function<void(int which, const std::function<void(const float*, size_t)>& write)> moments;
};

// The bytes after the header and the run table: m and v (and the master weights), or a factored
// optimizer's state.
inline int64_t state_payload_bytes(const TrainStateHeader& h) {
    if (h.optimizer != 0) return h.optimizer_state_floats * 4 + (h.has_master_weights ? h.shard_count * 4 : 0);
    return h.shard_count * 4 * (h.has_master_weights ? 3 : 2);
}

inline int64_t state_table_bytes(const TrainStateHeader& h) { return h.has_run_table ? h.num_runs * 16 : 0; }

inline void write_train_state(const std::string& path, const TrainState& s) {
    size_t n = (size_t)s.header.shard_count;
    bool factored = s.header.optimizer != 0;
    if ((factored ? s.factored.size() != (size_t)s.header.optimizer_state_floats || !s.m.empty() || !s.v.empty()
                  : !s.moments && (s.m.size() != n || s.v.size() != n)) ||
        (s.header.has_master_weights && s.master.size() != n) ||
        (s.header.has_run_table && s.runs.size() != 2 * (size_t)s.header.num_runs)) {
        fail("internal: train state for '%s' has inconsistent sizes", path.c_str());
    }
    TrainStateHeader h = s.header;
    h.version = factored ? STATE_VERSION : STATE_VERSION_ADAMW;
    AtomicFile out(path, "training-state file");
    out.write(&h, sizeof(h));
    if (s.header.has_run_table) out.write(s.runs.data(), s.runs.size() * sizeof(int64_t));
    if (factored) {
        out.write(s.factored.data(), s.factored.size() * 4);
    } else if (s.moments) {
        size_t written[2] = {0, 0};
        for (int which = 0; which < 2; which++)
            s.moments(which, [&](const float* p, size_t count) { out.write(p, count * 4), written[which] += count; });
        if (written[0] != n || written[1] != n) fail("internal: streamed %zu and %zu moments into '%s', not %zu", written[0], written[1], path.c_str(), n);
    } else {
        out.write(s.m.data(), n * 4);
        out.write(s.v.data(), n * 4);
    }
    if (s.header.has_master_weights) out.write(s.master.data(), n * 4);
    out.commit();
}

// What is impossible in a training-state header ("" when nothing is): the fields a resume trusts to
// index arrays and files. A step below 0 would train at "step -4" with a learning rate of -inf; a
// data position outside a shard would read past the token buffer; a world size of 2^31 would make a
// reader list two billion file names.
inline std::string train_state_header_problem(const TrainStateHeader& h) {
    const LoaderPosition& p = h.train_loader;
    int exponent = 0;
    if (h.step < 0 || h.step > INT32_MAX) return strprintf("step %lld is not a step count", (long long)h.step);
    if (h.num_params <= 0) return strprintf("it counts %lld parameters", (long long)h.num_params);
    if (h.shard_begin < 0 || h.shard_begin > h.num_params - h.shard_count)
        return strprintf("its slice [%lld, +%lld) is outside the %lld parameters", (long long)h.shard_begin,
                         (long long)h.shard_count, (long long)h.num_params);
    if (h.world_size < 1 || h.world_size > (1 << 20) || h.rank < 0 || h.rank >= h.world_size)
        return strprintf("rank %d of %d ranks", h.rank, h.world_size);
    if (h.zero_stage < 0 || h.zero_stage > 3) return strprintf("ZeRO stage %d", h.zero_stage);
    if (h.optimizer < 0 || h.optimizer > 2) return strprintf("optimizer %d (0 AdamW, 1 Adafactor, 2 SM3)", h.optimizer);
    if (h.optimizer != 0 && (h.version < 3 || (h.shard_count != 0 && !h.has_master_weights)))
        return "a factored optimizer's state in a version 2 file, or beside per-element state";
    if (h.batch_size < 0 || h.seq_len < 0 || h.total_batch_tokens < 0) return "a negative batch size, sequence length or token count";
    if (h.loss_scale != 0 && (!(h.loss_scale >= 1.0f && h.loss_scale <= 3e38f) || std::frexp(h.loss_scale, &exponent) != 0.5f))
        return strprintf("a loss scale of %g (0, or a power of two of at least 1)", (double)h.loss_scale);
    if (h.loss_scale_clean_steps < 0 || h.loss_scale_overflows < 0 || h.loss_scale_overflows > h.step)
        return strprintf("%d clean steps and %lld overflows of the loss scaler in %lld steps", h.loss_scale_clean_steps,
                         (long long)h.loss_scale_overflows, (long long)h.step);
    if (h.updates_skipped < 0 || h.updates_skipped > h.step - h.loss_scale_overflows)
        return strprintf("%d skipped updates in %lld steps with %lld loss-scaler overflows", h.updates_skipped, (long long)h.step,
                         (long long)h.loss_scale_overflows);
    if (p.shard_index < 0 || p.position < 0 || p.epoch < 0)
        return strprintf("the data position (shard %lld, token %lld, epoch %lld) is negative", (long long)p.shard_index,
                         (long long)p.position, (long long)p.epoch);
    return "";
}

// Reads and validates the header of an open training-state file (magic, version, and a size that
// matches what the header promises).
inline TrainStateHeader read_train_state_header(FILE* f, const std::string& path) {
    TrainStateHeader h;
    read_exactly(f, &h, sizeof(h), path, "training-state file");
    if (h.magic != STATE_MAGIC) {
        fail("'%s' is not a training-state file (magic %d, expected %d; it looks like %s)",
             path.c_str(), h.magic, STATE_MAGIC, describe_magic(h.magic));
    }
    if (h.version < 1 || h.version > STATE_VERSION) {
        fail("training-state file '%s' has version %d; this program reads versions 1 to %d", path.c_str(), h.version, STATE_VERSION);
    }
    if (h.version == 1) {  // before the grid existed
        h.has_run_table = 0;
        h.tensor_parallel = h.pipeline_parallel = 1;
    }
    // every count is bounded by the file's length before it enters a product, so nothing overflows
    int64_t actual = file_size(f);
    if (h.version < 3) h.optimizer = 0, h.optimizer_state_floats = 0;  // reserved, zero: AdamW
    if (h.shard_count < 0 || h.num_runs < 0 || h.shard_count > actual / (h.optimizer != 0 ? 4 : 8) ||  // (factored: weights only)
        h.num_runs > actual / 16 ||
        h.optimizer_state_floats < 0 || h.optimizer_state_floats > actual / 4) {
        fail("training-state file '%s' claims %lld elements in %lld runs (%lld of optimizer state), impossible in %lld bytes: "
             "it is damaged", path.c_str(), (long long)h.shard_count, (long long)h.num_runs,
             (long long)h.optimizer_state_floats, (long long)actual);
    }
    int64_t expected = (int64_t)sizeof(h) + state_table_bytes(h) + state_payload_bytes(h);
    if (actual != expected) {
        fail("training-state file '%s' has %lld bytes, its header implies %lld: it is damaged or truncated",
             path.c_str(), (long long)actual, (long long)expected);
    }
    std::string why = train_state_header_problem(h);
    if (!why.empty()) fail("training-state file '%s' is damaged: %s", path.c_str(), why.c_str());
    return h;
}

// The file's runs as (global index, count) pairs, read after its header: the run table, or the one
// run [shard_begin, shard_begin + shard_count) of a file without one. Each run must lie inside the
// model and together they must hold the file's shard_count elements: a reader seeks by them.
inline std::vector<int64_t> read_state_run_table(FILE* f, const TrainStateHeader& h, const std::string& path) {
    if (!h.has_run_table) return {h.shard_begin, h.shard_count};
    std::vector<int64_t> runs(2 * (size_t)h.num_runs);
    read_exactly(f, runs.data(), runs.size() * sizeof(int64_t), path, "training-state file");
    int64_t total = 0;
    for (size_t k = 0; k < runs.size(); k += 2) {
        if (runs[k] < 0 || runs[k + 1] < 0 || runs[k] > h.num_params - runs[k + 1] || (total += runs[k + 1]) > h.shard_count) {
            fail("training-state file '%s' is damaged: run %zu of its run table, [%lld, +%lld), is outside the %lld parameters or "
                 "past the %lld elements the file holds", path.c_str(), k / 2, (long long)runs[k], (long long)runs[k + 1],
                 (long long)h.num_params, (long long)h.shard_count);
        }
    }
    if (total != h.shard_count) {
        fail("training-state file '%s' is damaged: its run table covers %lld elements, its header says %lld", path.c_str(),
             (long long)total, (long long)h.shard_count);
    }
    return runs;
}

inline TrainState read_train_state(const std::string& path) {
    FILE* f = open_for_reading(path, "training-state file");
    TrainState s;
    s.header = read_train_state_header(f, path);
    size_t n = (size_t)s.header.shard_count;
    const TrainStateHeader& h = s.header;
    if (h.has_run_table) s.runs = read_state_run_table(f, h, path);
    if (h.optimizer != 0) {
        s.factored.resize((size_t)h.optimizer_state_floats);
        read_exactly(f, s.factored.data(), s.factored.size() * 4, path, "training-state file");
    } else {
        s.m.resize(n);
        s.v.resize(n);
        read_exactly(f, s.m.data(), n * 4, path, "training-state file");
        read_exactly(f, s.v.data(), n * 4, path, "training-state file");
    }
    if (h.has_master_weights) {
        s.master.resize(n);
        read_exactly(f, s.master.data(), n * 4, path, "training-state file");
    }
    fclose(f);
    return s;
}

// Reads elements [first, first + count) of the file's slice (m, v, and the master weights when the
// file has them and `master` is not null): what a rank needs when the checkpoint was cut into
// shards differently from its own (another world size or ZeRO stage).
inline TrainStateHeader read_train_state_part(const std::string& path, size_t first, size_t count, float* m, float* v,
                                              float* master) {
    FILE* f = open_for_reading(path, "training-state file");
    TrainStateHeader h = read_train_state_header(f, path);
    size_t n = (size_t)h.shard_count;
    if (h.optimizer != 0 && (m || v)) fail("internal: '%s' holds a factored optimizer's state, not AdamW's m and v", path.c_str());
    if (first + count > n) fail("internal: reading [%zu, %zu) of the %zu-element training state '%s'", first, first + count, n, path.c_str());
    float* dst[3] = {m, v, h.has_master_weights ? master : nullptr};
    for (int array = 0; array < 3; array++) {
        if (!dst[array] || count == 0) continue;
        long at = (long)(sizeof(h) + state_table_bytes(h) + (array * n + first) * 4);
        if (fseek(f, at, SEEK_SET) != 0) fail("cannot seek in '%s'", path.c_str());
        read_exactly(f, dst[array], count * 4, path, "training-state file");
    }
    fclose(f);
    return h;
}
