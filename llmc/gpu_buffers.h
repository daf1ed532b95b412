// gpu_buffers.h — every buffer the GPU trainer allocates, as a function of the run's shape.
//
// Host-only (no CUDA): the GPU trainer allocates FROM this table, buffer by buffer, and prints it;
// `--estimate` prints the same table on a machine without a GPU. So the memory a run needs is known
// before a byte is allocated, a batch that does not fit fails up front with the largest one that
// would, and the numbers in the docs are the numbers the trainer really uses.
//
// Where the memory goes, for GPT-2 small (d12) at B=16, T=1024 in bf16, recompute 1 (--estimate
// prints this for any shape; docs/memory.md is the lesson):
//   parameters + gradients (bf16)       2 x 2 bytes x N          0.46 GiB
//   AdamW m, v and fp32 master weights  3 x 4 bytes x N          1.39 GiB
//   activations kept for the backward   ~L x B x T x 12C x 2     3.4 GiB  (recompute shrinks this)
//   logits (B, T, Vp) in bf16, overwritten in place by their gradient   1.54 GiB
//   workspaces (one layer of scratch, cuBLASLt, cuDNN)                  0.78 GiB
// The activations dominate as B*T grows: that is what --recompute trades compute for.
//
// Recompute levels (--recompute), all exact: the backward recomputes with the same kernels from the
// same stored inputs, so the gradients are bit-identical at every level.
//   0  keep everything: per layer ln1, qkv, attention output, ln2, fch (pre-GELU) and fch_gelu
//   1  do not keep fch_gelu (4C per token per layer, the largest): recompute GELU(fch) in the backward
//   2  also do not keep the LayerNorm outputs ln1, ln2: recompute them from the residual stream and
//      the saved mean and 1/std (two floats per row)
//
// Parallelism: with data parallelism over world_size ranks, params and grads are padded with zeros
// to world_size equal shards (llmc/sharding.h: the collectives move equal pieces); with ZeRO-1 a
// rank holds only its shard [opt_begin, opt_begin + opt_count) of the optimizer state (master, m, v).
// Later, pipeline parallelism holds only the blocks [layer_begin, layer_end). Every per-layer and
// optimizer size below is computed from those ranges, not from "the whole model".
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>
#include "llmc/buffers.h"
#include "llmc/model.h"
#include "llmc/sharding.h"
#include "llmc/utils.h"

// Kernel geometry that decides buffer sizes: the kernels use these very constants.
constexpr int LN_BACKWARD_ROWS_PER_BLOCK = 64;     // rows of one LayerNorm-backward block -> one partial
constexpr int BIAS_BACKWARD_ROWS_PER_BLOCK = 256;  // rows of one bias-gradient block -> one partial
constexpr int GLOBAL_NORM_BLOCKS = 512;            // fixed grid: the sum's order never depends on the GPU
constexpr size_t CUBLASLT_WORKSPACE_BYTES = 32u << 20;

// What decides the sizes.
struct GPURunShape {
    GPT2Config cfg;
    int B = 0, T = 0;                  // micro-batch
    int recompute = 1;                 // 0, 1, 2 (see above)
    bool master_weights = true;        // fp32 copy of the parameters
    bool simple_attention = false;     // materialised (B, NH, T, T) attention instead of cuDNN
    int dtype_bytes = 2;               // 2: bf16 build, 4: the fp32 debugging build
    int world_size = 1;                // data-parallel ranks: params and grads padded to equal shards
    int layer_begin = 0, layer_end = -1;        // blocks held by this rank (-1: up to the last)
    size_t opt_begin = 0, opt_count = SIZE_MAX; // optimizer-state slice (SIZE_MAX: all of it)
    size_t cudnn_workspace_bytes = 0;  // as the cuDNN plans report it (see cudnn_workspace_estimate)
};

// The shape of a run as its flags describe it, with cuDNN's workspace at the bound used before any
// plan exists (the trainer replaces it by the plans' own figure before it allocates). The early
// memory check, the allocation and --estimate all start from here.
inline size_t cudnn_workspace_estimate(const GPT2Config& cfg, int B, int T);
inline GPURunShape gpu_run_shape(const GPT2Config& cfg, int B, int T, int recompute, bool master_weights,
                                 bool simple_attention, int dtype_bytes) {
    GPURunShape s;
    s.cfg = cfg;
    s.B = B, s.T = T;
    s.recompute = recompute;
    s.master_weights = master_weights;
    s.simple_attention = simple_attention;
    s.dtype_bytes = dtype_bytes;
    s.cudnn_workspace_bytes = simple_attention ? 0 : cudnn_workspace_estimate(cfg, B, T);
    return s;
}

// One buffer per row; the trainer indexes the table by this enum.
enum GPUBuffer {
    // the model and its optimizer
    GB_PARAMS, GB_GRADS, GB_MASTER, GB_ADAM_M, GB_ADAM_V,
    // activations kept from the forward for the backward (stacked over the layers held)
    GB_RESIDUAL, GB_RESIDUAL2, GB_LN1, GB_LN1_MEAN, GB_LN1_RSTD, GB_QKV, GB_ATTY, GB_ATT,
    GB_LN2, GB_LN2_MEAN, GB_LN2_RSTD, GB_FCH, GB_FCH_GELU,
    GB_LNF, GB_LNF_MEAN, GB_LNF_RSTD, GB_LOGITS, GB_LOSSES,
    // scratch: one layer's worth, reused by every layer, forward and backward
    GB_LN_RECOMPUTE, GB_GELU_RECOMPUTE, GB_SCRATCH_C, GB_DRESIDUAL, GB_SCRATCH_3C, GB_SCRATCH_4C,
    GB_REDUCE_PARTIALS, GB_NORM_PARTIALS, GB_INPUTS, GB_TARGETS, GB_ENCODER_BUCKETS,
    GB_CUBLASLT_WORKSPACE,
    // attention: simple path
    GB_ATT_QKV, GB_ATT_DQKV, GB_ATT_O, GB_ATT_SCORES,
    // attention: cuDNN path
    GB_CUDNN_WORKSPACE, GB_ATT_SOFTMAX_SUM,
    GB_COUNT
};

inline int held_layers(const GPURunShape& s) {
    int end = s.layer_end < 0 ? s.cfg.num_layers : s.layer_end;
    return end - s.layer_begin;
}

inline size_t optimizer_count(const GPURunShape& s) {
    size_t total = param_layout(s.cfg).total;
    return s.opt_count == SIZE_MAX ? total - s.opt_begin : s.opt_count;
}

// A bound on cuDNN's attention workspace, used before any plan exists (--estimate, and when looking
// for the largest batch that fits): the backward may keep dP, (B, NH, T, T) rounded up to tiles of
// 64, in bf16, plus room for the engines' own scratch. The trainer replaces it by the true size.
inline size_t cudnn_workspace_estimate(const GPT2Config& cfg, int B, int T) {
    size_t t64 = ((size_t)T + 63) / 64 * 64;
    return (size_t)B * cfg.num_heads * t64 * t64 * 2 + (64u << 20);
}

inline std::vector<BufferSpec> gpu_buffer_table(const GPURunShape& s) {
    const GPT2Config& c = s.cfg;
    size_t X = (size_t)s.dtype_bytes, F = 4, I = 4;
    size_t nl = (size_t)held_layers(s), C = c.channels, NH = c.num_heads, Vp = c.padded_vocab_size;
    size_t B = s.B, T = s.T, BT = B * T;
    size_t P = param_layout(c).total, opt = optimizer_count(s);
    size_t padded = shard_layout(P, s.world_size).padded_total;  // P, rounded up to world_size equal shards
    bool keep_gelu = s.recompute < 1, keep_ln = s.recompute < 2;
    bool simple = s.simple_attention;
    auto sh = [](const char* fmt, auto... v) { return strprintf(fmt, v...); };
    size_t ln_partials = (BT + LN_BACKWARD_ROWS_PER_BLOCK - 1) / LN_BACKWARD_ROWS_PER_BLOCK * 2 * C;
    size_t bias_partials = (BT + BIAS_BACKWARD_ROWS_PER_BLOCK - 1) / BIAS_BACKWARD_ROWS_PER_BLOCK * 4 * C;

    std::vector<BufferSpec> t(GB_COUNT);
    t[GB_PARAMS] = {"params", MEM_PARAMS, sh("(%zu)", padded), padded, X};
    t[GB_GRADS] = {"grads", MEM_GRADS, sh("(%zu)", padded), padded, X};
    t[GB_MASTER] = {"master_weights", MEM_MASTER, sh("(%zu) fp32", opt), s.master_weights ? opt : 0, F};
    t[GB_ADAM_M] = {"adam_m", MEM_OPTIMIZER, sh("(%zu) fp32", opt), opt, F};
    t[GB_ADAM_V] = {"adam_v", MEM_OPTIMIZER, sh("(%zu) fp32", opt), opt, F};

    t[GB_RESIDUAL] = {"residual", MEM_ACTIVATIONS, sh("(%zu+1, B, T, C)", nl), (nl + 1) * BT * C, X};
    t[GB_RESIDUAL2] = {"residual2", MEM_ACTIVATIONS, sh("(%zu, B, T, C)", nl), nl * BT * C, X};
    t[GB_LN1] = {"ln1", MEM_ACTIVATIONS, sh("(%zu, B, T, C)", nl), keep_ln ? nl * BT * C : 0, X};
    t[GB_LN1_MEAN] = {"ln1_mean", MEM_ACTIVATIONS, sh("(%zu, B, T) fp32", nl), nl * BT, F};
    t[GB_LN1_RSTD] = {"ln1_rstd", MEM_ACTIVATIONS, sh("(%zu, B, T) fp32", nl), nl * BT, F};
    t[GB_QKV] = {"qkv", MEM_ACTIVATIONS, sh("(%zu, B, T, 3C)", nl), nl * BT * 3 * C, X};
    t[GB_ATTY] = {"atty", MEM_ACTIVATIONS, sh("(%zu, B, T, C)", nl), nl * BT * C, X};
    if (simple) t[GB_ATT] = {"att", MEM_ACTIVATIONS, sh("(%zu, B, NH, T, T)", nl), nl * B * NH * T * T, X};
    else t[GB_ATT] = {"att_stats", MEM_ACTIVATIONS, sh("(%zu, B, NH, T) fp32", nl), nl * B * NH * T, F};
    t[GB_LN2] = {"ln2", MEM_ACTIVATIONS, sh("(%zu, B, T, C)", nl), keep_ln ? nl * BT * C : 0, X};
    t[GB_LN2_MEAN] = {"ln2_mean", MEM_ACTIVATIONS, sh("(%zu, B, T) fp32", nl), nl * BT, F};
    t[GB_LN2_RSTD] = {"ln2_rstd", MEM_ACTIVATIONS, sh("(%zu, B, T) fp32", nl), nl * BT, F};
    t[GB_FCH] = {"fch", MEM_ACTIVATIONS, sh("(%zu, B, T, 4C)", nl), nl * BT * 4 * C, X};
    t[GB_FCH_GELU] = {"fch_gelu", MEM_ACTIVATIONS, sh("(%zu, B, T, 4C)", nl), keep_gelu ? nl * BT * 4 * C : 0, X};
    t[GB_LNF] = {"lnf", MEM_ACTIVATIONS, "(B, T, C)", BT * C, X};
    t[GB_LNF_MEAN] = {"lnf_mean", MEM_ACTIVATIONS, "(B, T) fp32", BT, F};
    t[GB_LNF_RSTD] = {"lnf_rstd", MEM_ACTIVATIONS, "(B, T) fp32", BT, F};
    t[GB_LOGITS] = {"logits", MEM_ACTIVATIONS, "(B, T, Vp)", BT * Vp, X};
    t[GB_LOSSES] = {"losses", MEM_ACTIVATIONS, "(B, T) fp32", BT, F};

    t[GB_LN_RECOMPUTE] = {"ln_recompute", MEM_WORKSPACE, "(B, T, C)", keep_ln ? 0 : BT * C, X};
    t[GB_GELU_RECOMPUTE] = {"gelu_recompute", MEM_WORKSPACE, "(B, T, 4C)", keep_gelu ? 0 : BT * 4 * C, X};
    t[GB_SCRATCH_C] = {"scratch_c", MEM_WORKSPACE, "(B, T, C)", BT * C, X};
    t[GB_DRESIDUAL] = {"dresidual", MEM_WORKSPACE, "(B, T, C)", BT * C, X};
    t[GB_SCRATCH_3C] = {"scratch_3c", MEM_WORKSPACE, "(B, T, 3C)", BT * 3 * C, X};
    t[GB_SCRATCH_4C] = {"scratch_4c", MEM_WORKSPACE, "(B, T, 4C)", BT * 4 * C, X};
    t[GB_REDUCE_PARTIALS] = {"reduce_partials", MEM_WORKSPACE, "column sums per row block, fp32",
                             std::max(ln_partials, bias_partials), F};
    t[GB_NORM_PARTIALS] = {"norm_partials", MEM_WORKSPACE, sh("(%d+1) fp32", GLOBAL_NORM_BLOCKS), GLOBAL_NORM_BLOCKS + 1, F};
    t[GB_INPUTS] = {"inputs", MEM_WORKSPACE, "(B, T) int32", BT, I};
    t[GB_TARGETS] = {"targets", MEM_WORKSPACE, "(B, T) int32", BT, I};
    t[GB_ENCODER_BUCKETS] = {"encoder_buckets", MEM_WORKSPACE, "(3BT+1) int32", 3 * BT + 1, I};
    t[GB_CUBLASLT_WORKSPACE] = {"cublaslt_workspace", MEM_WORKSPACE, "bytes", CUBLASLT_WORKSPACE_BYTES, 1};

    t[GB_ATT_QKV] = {"att_qkv", MEM_WORKSPACE, "(3, B, NH, T, hs)", simple ? 3 * BT * C : 0, X};
    t[GB_ATT_DQKV] = {"att_dqkv", MEM_WORKSPACE, "(3, B, NH, T, hs)", simple ? 3 * BT * C : 0, X};
    t[GB_ATT_O] = {"att_o", MEM_WORKSPACE, "(B, NH, T, hs)", simple ? BT * C : 0, X};
    t[GB_ATT_SCORES] = {"att_scores", MEM_WORKSPACE, "(B, NH, T, T)", simple ? B * NH * T * T : 0, X};
    t[GB_CUDNN_WORKSPACE] = {"cudnn_workspace", MEM_WORKSPACE, "bytes", simple ? 0 : s.cudnn_workspace_bytes, 1};
    t[GB_ATT_SOFTMAX_SUM] = {"att_softmax_sum", MEM_WORKSPACE, "(B, NH, T) fp32", simple ? 0 : B * NH * T, F};
    return t;
}

// Each buffer is its own cudaMalloc, rounded up to 256 bytes as the allocator does.
constexpr size_t GPU_ALLOCATION_GRANULE = 256;
inline size_t gpu_buffer_allocated_bytes(const BufferSpec& b) { return allocated_bytes(b, GPU_ALLOCATION_GRANULE); }

inline size_t gpu_buffer_total(const std::vector<BufferSpec>& table) {
    size_t total = 0;
    for (const BufferSpec& b : table) total += gpu_buffer_allocated_bytes(b);
    return total;
}

// Room for what is not in the table: the CUDA context's own allocations after cudaMemGetInfo was
// read, cuBLAS/cuDNN handles and the kernels' images. A margin, not a measurement.
constexpr size_t GPU_MEMORY_MARGIN_BYTES = 512u << 20;

// Whether the table of `s` with micro-batch B fits in `free_bytes`, margin included. Before the cuDNN
// plans exist its workspace is the bound cudnn_workspace_estimate(), which grows with B like the rest.
inline bool gpu_batch_fits(GPURunShape s, int B, size_t free_bytes) {
    s.B = B;
    if (!s.simple_attention) s.cudnn_workspace_bytes = cudnn_workspace_estimate(s.cfg, B, s.T);
    return gpu_buffer_total(gpu_buffer_table(s)) + GPU_MEMORY_MARGIN_BYTES <= free_bytes;
}

// The largest micro-batch B' <= s.B whose table fits in `free_bytes` (0 if not even B'=1 fits).
inline int largest_batch_that_fits(const GPURunShape& s, size_t free_bytes) {
    return largest_fitting_batch([&](int b) { return gpu_batch_fits(s, b, free_bytes); }, s.B);
}

// The table as the trainer prints it at start-up and --estimate prints it.
inline void print_gpu_buffer_table(const std::vector<BufferSpec>& table) { print_buffer_table(table, GPU_ALLOCATION_GRANULE); }
