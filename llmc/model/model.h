// model.h — the shape of GPT-2, its parameters, and how they are initialised.
//
// GPT-2 is fully described by six numbers: layers L, channels C, heads NH, maximum sequence length
// maxT, vocabulary V, and the vocabulary padded to a multiple of 128, Vp (50257 -> 50304), so the
// LM-head matmul has friendly shapes. The padded rows of the token embedding are zero and their
// logits never enter the loss.
//
// Parameters live in ONE flat array, as 16 tensors in a fixed order (llm.c's order, so its model
// files load unchanged). Every per-layer tensor is stacked over the L layers:
//
//   tensor    shape        role
//   wte       (Vp, C)      token embedding, also the LM head (tied)
//   wpe       (maxT, C)    position embedding
//   ln1w ln1b (L, C)       LayerNorm before attention
//   qkvw      (L, 3C, C)   fused query/key/value projection     y = x W^T + b  (nn.Linear layout)
//   qkvb      (L, 3C)
//   attprojw  (L, C, C)    attention output projection (a "residual projection")
//   attprojb  (L, C)
//   ln2w ln2b (L, C)       LayerNorm before the MLP
//   fcw       (L, 4C, C)   MLP up-projection
//   fcb       (L, 4C)
//   fcprojw   (L, C, 4C)   MLP down-projection (a "residual projection")
//   fcprojb   (L, C)
//   lnfw lnfb (C)          final LayerNorm
//
// N = Vp*C + maxT*C + L*(12*C*C + 13*C) + 2*C; for GPT-2 small (d12) N = 124,475,904.
// This table is the one source of truth for sizes: the trainers allocate from it, checkpoints are
// laid out by it, and --estimate counts bytes from it.
#pragma once

#include <algorithm>
#include <array>
#include <cmath>
#include <cstdint>
#include <string>
#include <vector>
#include "llmc/utils.h"

struct GPT2Config {
    int max_seq_len = 1024;   // maxT: rows of the position embedding
    int vocab_size = 50257;   // V: real tokens
    int padded_vocab_size = 50304;  // Vp: V rounded up to a multiple of 128
    int num_layers = 12;      // L
    int num_heads = 12;       // NH
    int channels = 768;       // C
};

inline int pad_vocab(int vocab_size, int multiple = 128) {
    return (vocab_size + multiple - 1) / multiple * multiple;
}

inline bool config_is_valid(const GPT2Config& c, std::string* why) {
    auto bad = [&](const char* msg) { if (why) *why = msg; return false; };
    if (c.num_layers <= 0 || c.num_heads <= 0 || c.channels <= 0 || c.max_seq_len <= 0 || c.vocab_size <= 0)
        return bad("every dimension must be positive");
    if (c.channels % c.num_heads != 0) return bad("channels must be divisible by the number of heads");
    if (c.padded_vocab_size < c.vocab_size) return bad("the padded vocab is smaller than the vocab");
    return true;
}

// Parses a model descriptor:
//   "d12", "d24", "d36", "d48"     GPT-2 124M / 350M / 774M / 1.5B
//   "dN" for other N               N layers, 64*N channels, N heads (the same width-per-depth rule)
//   "L=2,C=64,H=4[,T=256][,V=512]" any shape; T defaults to 1024, V to 50257
// Returns false if `spec` is not a descriptor (then it is taken as a model file path). A string that
// looks like a KEY=VALUE list (an '=', no '/', not a file) is a descriptor with a typo when an item
// does not parse (`T=64x`, `h=4`): that stops here with exit 2, naming the item and the keys, where
// the caller would only say "neither a model file nor a descriptor".
inline bool parse_model_descriptor(const std::string& spec, GPT2Config* out) {
    GPT2Config c;
    if (spec.size() >= 2 && spec[0] == 'd' && spec.find_first_not_of("0123456789", 1) == std::string::npos) {
        int depth = atoi(spec.c_str() + 1);
        c.num_layers = depth;
        switch (depth) {
            case 12: c.channels = 768;  c.num_heads = 12; break;
            case 24: c.channels = 1024; c.num_heads = 16; break;
            case 36: c.channels = 1280; c.num_heads = 20; break;
            case 48: c.channels = 1600; c.num_heads = 25; break;
            default: c.channels = 64 * depth; c.num_heads = depth; break;
        }
    } else if (spec.find('=') != std::string::npos) {
        if (spec.find('/') != std::string::npos || file_exists(spec)) return false;  // a path with an '=' in it
        auto bad_item = [&](const std::string& item, const char* why) {
            usage_fail("--model '%s': %s '%s'; a descriptor is KEY=VALUE items with the keys L (layers), C (channels), "
                       "H (heads), T (max sequence length), V (vocabulary), e.g. L=2,C=64,H=4,T=256", spec.c_str(), why, item.c_str());
        };
        size_t pos = 0;
        while (pos < spec.size()) {
            size_t comma = spec.find(',', pos);
            if (comma == std::string::npos) comma = spec.size();
            std::string item = spec.substr(pos, comma - pos);
            size_t eq = item.find('=');
            if (eq == std::string::npos || eq + 1 >= item.size()) bad_item(item, "no value in");
            std::string key = item.substr(0, eq);
            char* end = nullptr;
            long value = strtol(item.c_str() + eq + 1, &end, 10);
            if (*end != '\0') bad_item(item, "not a whole number in");
            if (key == "L") c.num_layers = (int)value;
            else if (key == "C") c.channels = (int)value;
            else if (key == "H") c.num_heads = (int)value;
            else if (key == "T") c.max_seq_len = (int)value;
            else if (key == "V") c.vocab_size = (int)value;
            else bad_item(key, "unknown key");
            pos = comma + 1;
        }
    } else {
        return false;
    }
    c.padded_vocab_size = pad_vocab(c.vocab_size);
    *out = c;
    return true;
}

inline std::string describe_config(const GPT2Config& c) {
    return strprintf("L=%d C=%d H=%d T=%d V=%d (padded %d)", c.num_layers, c.channels, c.num_heads,
                     c.max_seq_len, c.vocab_size, c.padded_vocab_size);
}

// ----------------------------------------------------------------------------------------------
// The parameter table

constexpr int NUM_PARAM_TENSORS = 16;
enum ParamTensor {
    WTE, WPE, LN1W, LN1B, QKVW, QKVB, ATTPROJW, ATTPROJB,
    LN2W, LN2B, FCW, FCB, FCPROJW, FCPROJB, LNFW, LNFB
};

inline const char* param_tensor_name(int t) {
    static const char* names[NUM_PARAM_TENSORS] = {
        "wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
        "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"};
    return names[t];
}

// Decoupled weight decay applies to the matrices (embeddings included), never to biases or
// LayerNorm gains: shrinking those toward zero has no regularising meaning.
inline bool param_tensor_decays(int t) {
    return t == WTE || t == WPE || t == QKVW || t == ATTPROJW || t == FCW || t == FCPROJW;
}

struct ParamLayout {
    std::array<size_t, NUM_PARAM_TENSORS> count{};   // elements in each tensor
    std::array<size_t, NUM_PARAM_TENSORS> offset{};  // element offset of each tensor in the flat array
    size_t total = 0;
};

inline ParamLayout param_layout(const GPT2Config& cfg) {
    size_t Vp = cfg.padded_vocab_size, C = cfg.channels, L = cfg.num_layers, maxT = cfg.max_seq_len;
    ParamLayout p;
    p.count = {Vp * C, maxT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C,
               L * C, L * C, L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C};
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        p.offset[t] = p.total;
        p.total += p.count[t];
    }
    return p;
}

// Pointers to each tensor inside a flat array (parameters, gradients, or optimizer moments).
template <typename T>
struct ParamTensors {
    std::array<T*, NUM_PARAM_TENSORS> ptr{};
    T* operator[](int t) const { return ptr[t]; }
};

template <typename T>
inline ParamTensors<T> point_into(T* flat, const ParamLayout& layout) {
    ParamTensors<T> p;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) p.ptr[t] = flat + layout.offset[t];
    return p;
}

// ----------------------------------------------------------------------------------------------
// Initialisation
//
// GPT-2's recipe: weights ~ N(0, 0.02); the two residual projections (attprojw, fcprojw) ~
// N(0, 0.02/sqrt(2L)) so the residual stream's variance does not grow with depth (each block adds
// two contributions); biases 0; LayerNorm gains 1 and shifts 0; padded vocab rows 0.
//
// The random numbers come from a COUNTER-based generator: element i of the flat array gets
// normal(hash(seed, i)). Nothing depends on the order of generation, so the result is identical
// for any thread count, and a rank that owns a slice of the model (tensor or pipeline parallel,
// ZeRO-3) can initialise exactly its slice. The GPU trainer calls this same function on the host.

#ifdef __CUDACC__
__host__ __device__  // (also the GPU's bf16 moments' rounding bits: llmc/optim/adamw_bf16.h)
#endif
inline uint64_t splitmix64(uint64_t x) {
    x += 0x9E3779B97F4A7C15ull;
    x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9ull;
    x = (x ^ (x >> 27)) * 0x94D049BB133111EBull;
    return x ^ (x >> 31);
}

// A standard normal from one 64-bit hash: two 24-bit uniforms, then Box-Muller (in double, so the
// value does not depend on the compiler's float contractions).
inline float normal_from_counter(uint64_t seed, uint64_t counter) {
    uint64_t h = splitmix64(splitmix64(seed) ^ counter);
    double u1 = ((double)(h >> 40) + 0.5) / 16777216.0;           // (0, 1): never log(0)
    double u2 = (double)((h >> 16) & 0xFFFFFF) / 16777216.0;      // [0, 1)
    return (float)(std::sqrt(-2.0 * std::log(u1)) * std::cos(6.283185307179586 * u2));
}

// Fills params[begin, end) of the flat parameter array (pass 0, layout.total for all of it).
inline void init_gpt2_params(const GPT2Config& cfg, uint64_t seed, float* params, size_t begin, size_t end) {
    ParamLayout layout = param_layout(cfg);
    const float std_default = 0.02f;
    const float std_residual = 0.02f / std::sqrt(2.0f * cfg.num_layers);
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        size_t lo = std::max(begin, layout.offset[t]);
        size_t hi = std::min(end, layout.offset[t] + layout.count[t]);
        if (lo >= hi) continue;
        float* dst = params + (lo - begin);
        bool is_matrix = param_tensor_decays(t);
        bool is_gain = (t == LN1W || t == LN2W || t == LNFW);
        float stddev = (t == ATTPROJW || t == FCPROJW) ? std_residual : std_default;
        // rows of wte at or beyond the real vocab are padding: keep them zero
        size_t wte_real = (size_t)cfg.vocab_size * cfg.channels;
        #pragma omp parallel for schedule(static)
        for (size_t i = lo; i < hi; i++) {
            float value = 0.0f;
            if (is_matrix) {
                bool padding = (t == WTE) && (i - layout.offset[t]) >= wte_real;
                value = padding ? 0.0f : stddev * normal_from_counter(seed, i);
            } else if (is_gain) {
                value = 1.0f;
            }
            dst[i - lo] = value;
        }
    }
}

// ----------------------------------------------------------------------------------------------
// Mixture of experts: the MoE blocks' own tensors (docs/moe.md; the layer is llmc/model/moe.h)
//
// With --moe-experts E, blocks every-1, 2 every-1, ... (counting from 0) are MoE blocks: their MLP is
// E experts and a router. Expert 0 of an MoE block IS that block's MLP in the table above (its
// fcw, fcb, fcprojw, fcprojb at layer l): same place, same counters, same initial values, so the
// dense model is the special case E = 1 (docs/moe.md proves it bit for bit over a run), and the
// model has no dead weights. (Sparse upcycling, Komatsuzaki et al. 2022, starts EVERY expert from a
// trained dense MLP; here only expert 0 is, the others are drawn fresh.) What a dense model has no
// place for goes to a second flat array, the MoE table, each tensor stacked over the Lm MoE blocks:
//
//   tensor          shape               role
//   router          (Lm, E, C)          logits = x W_r^T, no bias (Switch)
//   fcw, fcb        (Lm, E-1, 4C, C), (Lm, E-1, 4C)    experts 1 .. E-1: the MLP's up-projection
//   fcprojw, fcprojb (Lm, E-1, C, 4C), (Lm, E-1, C)    and down-projection
//
// Its initialisation continues the counter-based scheme: element i of the MoE table gets the
// counter (dense table's total) + i, a counter no dense element uses; the same standard deviations
// as the dense tensors (0.02, the projection 0.02/sqrt(2L), biases 0; the router 0.02).
struct MoEConfig {
    int experts = 0;  // E; 0 = dense, no MoE block
    int every = 1;    // blocks every-1, 2 every-1, ... are MoE blocks
};

inline bool is_moe_block(const MoEConfig& m, int l) { return m.experts > 0 && (l + 1) % m.every == 0; }
inline int moe_block_count(const MoEConfig& m, int L) { return m.experts > 0 ? L / m.every : 0; }
inline int moe_block_index(const MoEConfig& m, int l) { return (l + 1) / m.every - 1; }  // of an MoE block

constexpr int NUM_MOE_TENSORS = 5;
enum MoETensor { MOE_ROUTER, MOE_FCW, MOE_FCB, MOE_FCPROJW, MOE_FCPROJB };

// Weight decay as for the dense tensors: the matrices (the router among them), not the biases.
inline bool moe_tensor_decays(int t) { return t == MOE_ROUTER || t == MOE_FCW || t == MOE_FCPROJW; }

// The table one rank holds: every router, and experts first .. first + held - 1 of each block (all of
// 1 .. E-1, unless expert parallelism shards them: llmc/parallel/expert_parallel.h). Each tensor keeps
// the shape above with E-1 replaced by `held`, so a rank's table is the full table's layout, thinner.
struct MoELayout {
    std::array<size_t, NUM_MOE_TENSORS> per_block{};  // elements of each tensor in one MoE block
    std::array<size_t, NUM_MOE_TENSORS> count{};      // ... in all Lm of them
    std::array<size_t, NUM_MOE_TENSORS> offset{};     // element offset of each tensor in the MoE table
    size_t total = 0;
    int first_expert = 1, held_experts = 0;           // the experts of each block this table holds
};

// The experts of the MoE table rank q of an expert group of `ranks` holds: its own, q E/ranks ..
// (q+1) E/ranks - 1, less expert 0 (the dense table's). {first, count}; {1, E-1} on one rank.
struct HeldExperts { int first = 1, count = 0; };
inline HeldExperts moe_held_experts(const MoEConfig& m, int ranks, int q) {
    int per = m.experts / ranks, first = std::max(1, q * per);
    return {first, std::max(0, (q + 1) * per - first)};
}

inline MoELayout moe_layout(const GPT2Config& cfg, const MoEConfig& m, HeldExperts held) {
    size_t C = cfg.channels, E = m.experts, Lm = moe_block_count(m, cfg.num_layers), more = E > 0 ? (size_t)held.count : 0;
    MoELayout p;
    p.first_expert = held.first, p.held_experts = (int)more;
    p.per_block = {E * C, more * 4 * C * C, more * 4 * C, more * C * 4 * C, more * C};
    for (int t = 0; t < NUM_MOE_TENSORS; t++) {
        p.count[t] = Lm * p.per_block[t];
        p.offset[t] = p.total;
        p.total += p.count[t];
    }
    return p;
}
// The whole table: every expert of every block (one rank's, and the files' layout at any N)
inline MoELayout moe_layout(const GPT2Config& cfg, const MoEConfig& m) {
    return moe_layout(cfg, m, HeldExperts{1, m.experts > 0 ? m.experts - 1 : 0});
}

// Tensor t of MoE block b (its index among the MoE blocks) inside the MoE table.
template <typename T>
inline T* moe_tensor(T* table, const MoELayout& layout, int t, int b) {
    return table + layout.offset[t] + (size_t)b * layout.per_block[t];
}

// Where a rank's table lies in the whole one: runs of `count` elements at `whole` in the whole table and
// at `held` in the rank's (the routers whole, then each block's held experts, one run per tensor and
// block). Initialisation, loading and gathering a checkpoint walk these.
struct MoETableRun { int tensor; size_t whole, held, count; };
inline std::vector<MoETableRun> moe_table_runs(const MoELayout& whole, const MoELayout& held) {
    std::vector<MoETableRun> runs;
    size_t Lm = whole.per_block[0] ? whole.count[0] / whole.per_block[0] : 0;
    for (int t = 0; t < NUM_MOE_TENSORS; t++) {
        if (t == MOE_ROUTER) {
            if (held.count[t]) runs.push_back({t, whole.offset[t], held.offset[t], held.count[t]});
            continue;
        }
        size_t per_expert = whole.per_block[t] / (size_t)std::max(1, whole.held_experts);
        for (size_t b = 0; b < Lm && held.per_block[t]; b++)
            runs.push_back({t, whole.offset[t] + b * whole.per_block[t] + (size_t)(held.first_expert - 1) * per_expert,
                            held.offset[t] + b * held.per_block[t], held.per_block[t]});
    }
    return runs;
}

// Parameters a token passes through: the dense table (counting expert 0 of every MoE block as one
// of its k experts), each MoE block's router, and k-1 more experts: what its FLOPs scale with.
inline size_t moe_active_params(const GPT2Config& cfg, const MoEConfig& m, int top_k) {
    size_t C = cfg.channels, expert = 8 * C * C + 5 * C, Lm = moe_block_count(m, cfg.num_layers);
    return param_layout(cfg).total + Lm * ((size_t)m.experts * C + (size_t)(top_k - 1) * expert);
}

// What one MoE block keeps for one micro-batch of N tokens (its forward's routing and rows, its
// backward's scratch): the sizes moe_allocate (llmc/model/moe.h) gives its vectors, in 4-byte values
// (floats and ints), counted here so the size tables need no layer header. H = 4C, k = top-k.
inline size_t moe_activation_values(size_t N, size_t C, size_t E, size_t k) {
    size_t H = 4 * C, rows = k * N;
    size_t floats = 4 * N * E + N + 2 * rows + rows * (4 * C + 3 * H) + N * C;  // logits probs dprobs dlogits, lse,
                                                                                 // gate dgate, xg eout drow dxg + fch fch_gelu dh, dx_router
    size_t ints = 3 * rows + 3 * E + 1;                                          // choice row token_of_row, routed kept first_row
    return floats + ints;
}

// The GPU's routing state of one MoE block for N tokens (llmc/kernels/moe.cuh's MoERouting, carved by
// llmc/model/moe_gpu.cuh), in 4-byte values: logits, probabilities and their gradient (N E each), the
// logsumexps (N), gates and their gradients, choices and rows (N k each), the tokens of the rows (k N),
// the two auxiliary losses, and per expert the routed and kept counts and the row ranges (3 E + 1).
inline size_t moe_gpu_routing_values(size_t N, size_t E, size_t k) { return N * (3 * E + 5 * k + 1) + 3 * E + 3; }

// The table `held` lays out (the whole one, or a rank's experts): each element from the counter of
// its place in the whole table, so a sharded run starts from the very weights of a one-rank run.
inline void init_moe_params(const GPT2Config& cfg, const MoEConfig& m, const MoELayout& held, uint64_t seed, float* params) {
    MoELayout layout = moe_layout(cfg, m);
    size_t first_counter = param_layout(cfg).total;  // after every counter the dense table uses
    for (const MoETableRun& r : moe_table_runs(layout, held)) {
        int t = r.tensor;
        float stddev = t == MOE_FCPROJW ? 0.02f / std::sqrt(2.0f * cfg.num_layers) : 0.02f;
        bool is_matrix = moe_tensor_decays(t);
        #pragma omp parallel for schedule(static)
        for (size_t i = 0; i < r.count; i++)
            params[r.held + i] = is_matrix ? stddev * normal_from_counter(seed, first_counter + r.whole + i) : 0.0f;
    }
}

// FLOPs of one training step per token, the convention used to report MFU (model FLOPs
// utilisation): 6 per parameter (2 in the forward matmuls, 4 in the backward) plus attention's
// 6*L*C*T for QK^T and AV (counted in full, although causal masking skips half). N is the whole
// parameter count, padded vocab and position embedding included, as llm.c counts it, so MFUs
// compare across the two projects.
inline double flops_per_token(const GPT2Config& cfg, int seq_len) {
    double n = (double)param_layout(cfg).total;
    return 6.0 * n + 6.0 * cfg.num_layers * cfg.channels * (double)seq_len;
}
