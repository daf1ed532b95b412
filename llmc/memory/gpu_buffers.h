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
// Recompute (--recompute, llmc/model/recompute.h): a level keeps fewer activations per layer (fch_gelu at
// level 1, also ln1 and ln2 at level 2) and one layer of scratch for them instead; exact.
//
// The fp8 stash (--stash-precision fp8, llmc/memory/stash_precision.cuh): the stashed rows (GPU_STASH_ROWS,
// those the recompute level keeps) hold 1 byte a value, plus one layer of them in the build's type
// (stash_work) and 7 amax a layer (stash_amax); the same rows, so a pipeline's slots hold them as before.
//
// Parallelism: every row is for this rank's SLICE of the model (llmc/parallel/process_grid.h), exactly as in
// llmc/memory/cpu_buffers.h: its pipeline stage's layers, its tensor rank's heads (C/t attention channels),
// MLP units (4C/t) and vocabulary rows, B*T/t rows of the residual stream with sequence parallelism,
// and the activations of as many micro-batches as its pipeline schedule keeps in flight. ZeRO
// (llmc/parallel/zero.h) decides the model states: stages 0-1 pad params and grads to dp equal shards (the
// collectives move equal pieces) and stage 1 keeps master, m, v of the rank's shard only; stage 2
// keeps only the gradient shard of every unit, stage 3 also only the weight shard, plus fixed slots
// for the units gathered and the buckets being reduced (one for the ends of the model, two for
// layers: one in use while the other is gathered or reduced on the communication stream). On one
// rank the slice is the whole model and every parallel row is empty.
//
// The MoE and expert-parallel rows take their sizes, and the padding their sums need, from
// llmc/memory/moe_sizes.h, as PowerSGD's take theirs from llmc/parallel/grad_compression.h.
#pragma once

#include <cstdint>
#include <cstdio>
#include <string>
#include <vector>
#include "llmc/kernels/scratch_sizes.h"  // the kernels' launch constants that size their scratch
#include "llmc/memory/moe_sizes.h"  // the MoE and expert-parallel rows
#include "llmc/memory/size_table.h"
#include "llmc/model/model.h"
#include "llmc/model/zero_bubble_backward.h"
#include "llmc/optim/adafactor.h"  // the factored optimizers' state and scratch
#include "llmc/parallel/pipeline_schedule.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/model/recompute.h"
#include "llmc/parallel/sharding.h"
#include "llmc/utils.h"
#include "llmc/parallel/zero.h"

// What decides the sizes.
struct GPURunShape {
    GPT2Config cfg;
    int B = 0, T = 0;                  // micro-batch
    int recompute = 1;                 // 0, 1, 2 (see above)
    bool master_weights = true;        // fp32 copy of the parameters
    bool offload_optimizer = false;    // --offload optimizer: master, m, v in host memory (llmc/optim/offload.cuh)
    bool bf16_moments = false;         // --optimizer-state bf16: AdamW's m and v in 2 bytes (llmc/optim/adamw_bf16.cuh)
    Optimizer optimizer = Optimizer::AdamW;  // --optimizer: adafactor and sm3 keep GB_OPTIMIZER_STATE, not m and v
    bool simple_attention = false;     // materialised (B, NH, T, T) attention instead of cuDNN
    int dtype_bytes = 2;               // 2: bf16 build, 4: the fp32 debugging build
    ProcessGrid grid;                  // this rank's place: its slice, its ZeRO share (default: one rank)
    int micro_batches_in_flight = 1;   // activations kept at once: more than one only in a pipeline
    int weight_stashes = 0;            // ZB-H1: micro-batches whose deferred W waits (gpu_weight_stashes)
    int chunks = 1;                    // interleaved 1F1B: model chunks per stage; a slot holds one chunk's layers
    bool two_weight_versions = false;  // PipeDream-2BW: W(t-1) beside W(t) (llmc/parallel/pipedream_2bw.cuh)
    size_t cudnn_workspace_bytes = 0;  // as the cuDNN plans report it (see cudnn_workspace_estimate)
    MoEConfig moe;                     // --moe-experts, --moe-every: the MoE table and blocks (llmc/model/moe_gpu.cuh)
    int moe_top_k = 1;                 // --moe-top-k: rows each MoE block gathers per token
    int expert_parallel = 1;           // --expert-parallel: the experts split over this many data-parallel ranks
    int expert_rank = 0;               // ... this rank's place in its expert group (llmc/parallel/expert_parallel.cuh)
    size_t compression_state = 0;      // --grad-compression powersgd: fp32 e, next e, Q, next Q (grad_compression_gpu_sizes)
    size_t compression_work = 0;       // ... and P with the exactly summed values
    int fp8_history = 0;               // --precision fp8: the amax history's steps (0: no fp8; llmc/kernels/fp8.cuh)
    bool fp8_stash = false;            // --stash-precision fp8: the activations kept in e4m3 (llmc/memory/stash_precision.cuh)
};

// The shape of a run as its flags describe it, with cuDNN's workspace at the bound used before any
// plan exists (the trainer replaces it by the plans' own figure before it allocates). The early
// memory check, the allocation and --estimate all start from here.
inline size_t cudnn_workspace_estimate(const GPT2Config& cfg, int B, int T, int tp = 1);
inline GPURunShape gpu_run_shape(const GPT2Config& cfg, int B, int T, int recompute, bool master_weights,
                                 bool simple_attention, int dtype_bytes, const ProcessGrid& grid = ProcessGrid{},
                                 int micro_batches_in_flight = 1) {
    GPURunShape s;
    s.cfg = cfg;
    s.B = B, s.T = T;
    s.recompute = recompute;
    s.master_weights = master_weights;
    s.simple_attention = simple_attention;
    s.dtype_bytes = dtype_bytes;
    s.grid = grid;
    s.micro_batches_in_flight = micro_batches_in_flight;
    s.cudnn_workspace_bytes = simple_attention ? 0 : cudnn_workspace_estimate(cfg, B, T, grid.tp);
    return s;
}

// One buffer per row; the trainer indexes the table by this enum.
enum GPUBuffer {
    // the model and its optimizer
    GB_PARAMS, GB_GRADS, GB_MASTER, GB_ADAM_M, GB_ADAM_V,
    // --optimizer adafactor | sm3 (llmc/optim/adafactor.cuh, sm3.cuh): row and column statistics instead of m and v
    GB_OPTIMIZER_STATE, GB_OPTIMIZER_SCRATCH,
    // activations kept from the forward for the backward (stacked over the layers held)
    GB_RESIDUAL, GB_RESIDUAL2, GB_LN1, GB_LN1_MEAN, GB_LN1_RSTD, GB_QKV, GB_ATTY, GB_ATT,
    GB_LN2, GB_LN2_MEAN, GB_LN2_RSTD, GB_FCH, GB_FCH_GELU,
    GB_LNF, GB_LNF_MEAN, GB_LNF_RSTD, GB_LOGITS, GB_LOSSES,
    // scratch: one layer's worth, reused by every layer, forward and backward
    GB_LN_RECOMPUTE, GB_GELU_RECOMPUTE, GB_SCRATCH_C, GB_DRESIDUAL, GB_SCRATCH_3C, GB_SCRATCH_4C,
    GB_REDUCE_PARTIALS, GB_NORM_PARTIALS, GB_STEP_VALUES, GB_INPUTS, GB_TARGETS, GB_ENCODER_BUCKETS,
    GB_CUBLASLT_WORKSPACE,
    // attention: simple path
    GB_ATT_QKV, GB_ATT_DQKV, GB_ATT_O, GB_ATT_SCORES,
    // attention: cuDNN path
    GB_CUDNN_WORKSPACE, GB_ATT_SOFTMAX_SUM,
    // parallelism: sequence-parallel rows, the vocabulary-parallel loss's exchange, ZeRO-2/3's unit
    // slots, a pipeline's tied embedding (the last stage's copy; what the first stage receives)
    GB_TP_GATHERED, GB_TP_LOCAL, GB_TP_LOSS_EXCHANGE, GB_ZERO_GATHERED, GB_ZERO_BUCKETS, GB_ZERO_REDUCED,
    GB_LENT_WTE, GB_LENT_WTE_GRAD, GB_TIED_RECEIVED,
    // --moe-experts (llmc/model/moe_gpu.cuh): the MoE table, its gradient and moments (no master copy),
    // each MoE block's routing state and gathered rows, the backward's rows (shared by the blocks)
    GB_MOE_PARAMS, GB_MOE_GRADS, GB_MOE_ADAM_M, GB_MOE_ADAM_V, GB_MOE_ROUTING, GB_MOE_ACTIVATIONS, GB_MOE_SCRATCH,
    // --expert-parallel (llmc/parallel/expert_parallel.cuh): the rows an owner receives, the exchange's scratch and counts
    GB_EP_ROWS, GB_EP_SCRATCH, GB_EP_COUNTS,
    // PowerSGD's error feedback and factors (llmc/parallel/grad_compression.cuh)
    GB_COMPRESSION_STATE, GB_COMPRESSION_WORK,
    // --precision fp8 (llmc/kernels/fp8.cuh): the delayed scaling's state, one matmul's two quantized operands
    GB_FP8_SCALING, GB_FP8_A, GB_FP8_B,
    // ZB-H1: the output gradients B keeps for the deferred W (llmc/model/zero_bubble_backward.cuh)
    GB_WEIGHT_STASH,
    // --stash-precision fp8 (llmc/memory/stash_precision.cuh): one layer of the stashed tensors in the
    // build's type, which the forward computes into and the backward dequantizes into; each stashed
    // tensor's amax (its scale's source)
    GB_STASH_WORK, GB_STASH_AMAX,
    // PipeDream-2BW: the weights one version older, params (and the last stage's wte copy) again
    GB_OLDER_WEIGHTS,
    GB_COUNT
};

// The rows that every micro-batch in flight has its own of (a pipeline stage keeps several): what the
// forward keeps for the backward, the tokens, and the residual gradient that travels between stages.
inline bool gpu_buffer_per_micro_batch(int row) {
    return (row >= GB_RESIDUAL && row <= GB_LOSSES) || row == GB_DRESIDUAL || row == GB_INPUTS || row == GB_TARGETS ||
           row == GB_ENCODER_BUCKETS || row == GB_STASH_AMAX;
}

// --stash-precision fp8: the rows it stashes, in the order of their places in GB_STASH_WORK (one
// layer each) and of their amax in GB_STASH_AMAX (GPU_STASHED per layer), and each one's values per
// layer: 0 where the row is not kept (recompute dropped it; cuDNN keeps its statistics, fp32 and
// tiny, instead of att). The residual stream and the LayerNorm statistics stay as they are
// (llmc/memory/stash_precision.h says why).
constexpr GPUBuffer GPU_STASH_ROWS[] = {GB_LN1, GB_LN2, GB_QKV, GB_ATTY, GB_ATT, GB_FCH, GB_FCH_GELU};
constexpr int GPU_STASHED = sizeof(GPU_STASH_ROWS) / sizeof(GPU_STASH_ROWS[0]);
inline size_t gpu_stash_layer_values(const GPURunShape& s, int i) {
    ProcessGrid g = s.grid;
    ModelSlice slice = model_slice(s.cfg, g);
    size_t BT = (size_t)s.B * s.T, R = g.sequence_parallel ? BT / g.tp : BT, C = s.cfg.channels;
    size_t Ca = slice.attn_channels, Cf = slice.fc_channels, NH = slice.heads;
    RecomputePlan keep = recompute_plan(s.recompute);
    switch (GPU_STASH_ROWS[i]) {
        case GB_LN1: case GB_LN2: return keep.ln ? R * C : 0;
        case GB_QKV: return BT * 3 * Ca;
        case GB_ATTY: return BT * Ca;
        case GB_ATT: return s.simple_attention ? (size_t)s.B * NH * s.T * s.T : 0;
        case GB_FCH: return BT * Cf;
        case GB_FCH_GELU: return keep.gelu ? BT * Cf : 0;
        default: return 0;
    }
}
// where row i's layer starts in GB_STASH_WORK (values), and the whole of it
inline size_t gpu_stash_work_offset(const GPURunShape& s, int i) {
    size_t at = 0;
    for (int r = 0; r < i; r++) at += gpu_stash_layer_values(s, r);
    return at;
}

// A bound on cuDNN's attention workspace, used before any plan exists (--estimate, and when looking
// for the largest batch that fits): the backward may keep dP, (B, NH/t, T, T) rounded up to tiles of
// 64, in bf16, plus room for the engines' own scratch. The trainer replaces it by the true size.
inline size_t cudnn_workspace_estimate(const GPT2Config& cfg, int B, int T, int tp) {
    size_t t64 = ((size_t)T + 63) / 64 * 64;
    return (size_t)B * (cfg.num_heads / tp) * t64 * t64 * 2 + (64u << 20);
}

// ZeRO-2/3's slots (llmc/parallel/zero.cuh): the ends' unit (wte, wpe, lnf) has one of its own, the layers
// two. Sizes are the units' padded totals (dp equal shards), in elements.
struct ZeroSlots {
    size_t ends = 0, layer = 0;   // padded elements of the ends' unit, of the largest layer's
    size_t largest_shard = 0;     // one rank's shard of the largest unit: a reduce-scatter's output
};
inline ZeroSlots zero_slots(const std::vector<ZeroUnit>& units, int dp) {
    ZeroSlots z;
    for (size_t u = 0; u < units.size(); u++) {
        ShardLayout s = shard_layout(units[u].size, dp);
        if (u + 1 == units.size()) z.ends = s.padded_total;
        else z.layer = std::max(z.layer, s.padded_total);
        z.largest_shard = std::max(z.largest_shard, s.shard_size);
    }
    return z;
}

// What the MoE and expert-parallel rows depend on (llmc/memory/moe_sizes.h), and the MoE table this
// rank holds: the whole, or with --expert-parallel the routers and its own experts.
inline MoESizing gpu_moe_sizing(const GPURunShape& s) {
    return {s.moe, s.moe_top_k, s.expert_parallel, s.expert_rank, s.grid.dp, s.grid.zero_stage, (size_t)s.B * s.T};
}
inline MoELayout gpu_moe_layout(const GPT2Config& c, const GPURunShape& s) { return moe_held_layout(c, gpu_moe_sizing(s)); }

inline std::vector<BufferSpec> gpu_buffer_table(const GPURunShape& s) {
    const GPT2Config& c = s.cfg;
    const ProcessGrid& g = s.grid;
    ModelSlice slice = model_slice(c, g);
    ParamLayout layout = slice_layout(c, slice);
    std::vector<ZeroUnit> units = model_units(layout, slice.num_layers);
    ZeroMemory z = zero_memory(g.zero_stage, units, layout.total, g.dp, g.dp_rank);
    ZeroSlots slots = zero_slots(units, g.dp);
    size_t X = (size_t)s.dtype_bytes, F = 4, I = 4;
    // local shapes (on one rank, the model's own): Ca attention channels, Cf MLP units, Vp vocabulary rows
    size_t nl = slice.num_layers, C = c.channels, NH = slice.heads, Ca = slice.attn_channels, Cf = slice.fc_channels;
    size_t Vp = slice.vocab_rows, head = slice.last_stage ? 1 : 0, M = s.micro_batches_in_flight;
    // the layers a slot holds: the stage's, or with interleaving one chunk's (a slot per (micro-batch, chunk))
    size_t al = nl / (size_t)s.chunks;
    size_t B = s.B, T = s.T, BT = B * T, R = g.sequence_parallel ? BT / g.tp : BT;  // R: rows of the residual stream
    size_t opt = z.optimizer / 2;  // master, m, v: of everything, of the ZeRO-1 shard, or of every unit's shard
    RecomputePlan keep = recompute_plan(s.recompute);
    bool simple = s.simple_attention, sp = g.sequence_parallel, lent = g.pp > 1 && slice.last_stage;
    auto sh = [](const char* fmt, auto... v) { return strprintf(fmt, v...); };
    std::string x = M > 1 ? sh(" x %zu", M) : std::string();  // per micro-batch in flight
    std::string rows = sp ? "R" : "B, T";                     // sequence parallelism: R = B*T/t rows
    std::string tp = g.tp > 1 ? "/t" : "";
    size_t ln_partials = layernorm_backward_partials_floats(R, C);
    GPUMoESizes moe = gpu_moe_sizes(c, gpu_moe_sizing(s));
    size_t bias_partials = std::max(bias_backward_partials_floats(BT, std::max({C, 3 * Ca, Cf})), moe.ep_bias_partials);
    // the vocabulary-parallel loss's exchange: row maxima; (sum, target logit) pairs, padded to t shards
    size_t exchange = BT + (2 * BT + g.tp - 1) / g.tp * g.tp;
    // rows every micro-batch in flight has its own of: M copies, each from a 128-byte boundary
    auto per = [&](size_t n) { return M > 1 ? M * ((n + 63) / 64 * 64) : n; };

    std::vector<BufferSpec> t(GB_COUNT);
    size_t S = s.fp8_stash ? 1 : X;  // the stashed rows' bytes per value: e4m3, or the build's type
    std::string e4m3 = s.fp8_stash ? " e4m3" : "";
    size_t grads = g.zero_stage >= 2 ? z.grad_shard : z.grads;  // ZeRO-2/3: only this rank's shard of every unit
    t[GB_PARAMS] = {"params", MEM_PARAMS, sh(g.zero_stage == 3 ? "(%zu) shards" : "(%zu)", z.params), z.params, X};
    t[GB_GRADS] = {"grads", MEM_GRADS, sh(g.zero_stage >= 2 ? "(%zu) shards" : "(%zu)", grads), grads, X};
    size_t on_gpu = s.offload_optimizer ? 0 : opt;  // offloaded: the same arrays live in pinned host memory
    t[GB_MASTER] = {"master_weights", MEM_MASTER, sh("(%zu) fp32", opt), s.master_weights ? on_gpu : 0, F};
    // --optimizer-state bf16: m and v in 2 bytes each (llmc/optim/adamw_bf16.cuh)
    size_t moment_bytes = s.bf16_moments ? 2 : F;
    const char* moment_type = s.bf16_moments ? "bf16" : "fp32";
    size_t moments = s.optimizer == Optimizer::AdamW ? on_gpu : 0;
    t[GB_ADAM_M] = {"adam_m", MEM_OPTIMIZER, sh("(%zu) %s", opt, moment_type), moments, moment_bytes};
    t[GB_ADAM_V] = {"adam_v", MEM_OPTIMIZER, sh("(%zu) %s", opt, moment_type), moments, moment_bytes};
    // --optimizer adafactor | sm3: rows + columns per matrix, n per vector (optimizer_state.h), and scratch:
    // Adafactor's partial sums of the block being updated (adafactor.h's adafactor_gpu_scratch_doubles),
    // SM3's new column accumulators (the widest matrix's columns)
    bool factored = s.optimizer != Optimizer::AdamW, adafactor = s.optimizer == Optimizer::Adafactor;
    t[GB_OPTIMIZER_STATE] = {"optimizer_state", MEM_OPTIMIZER, "rows + columns per matrix, fp32",
                             factored ? factored_state_floats(c) : 0, F};
    if (adafactor)
        t[GB_OPTIMIZER_SCRATCH] = {"optimizer_scratch", MEM_WORKSPACE, "Adafactor: 3 + 2 x the tallest block's rows, fp64",
                                   adafactor_gpu_scratch_doubles(c), 8};
    else
        t[GB_OPTIMIZER_SCRATCH] = {"optimizer_scratch", MEM_WORKSPACE, "SM3: the widest matrix's columns, fp32",
                                   factored ? factored_scratch_floats(c) : 0, F};

    t[GB_RESIDUAL] = {"residual", MEM_ACTIVATIONS, sh("(%zu+1, ", al) + rows + ", C)" + x, per((al + 1) * R * C), X};
    t[GB_RESIDUAL2] = {"residual2", MEM_ACTIVATIONS, sh("(%zu, ", al) + rows + ", C)" + x, per(al * R * C), X};
    t[GB_LN1] = {"ln1", MEM_ACTIVATIONS, sh("(%zu, ", al) + rows + ", C)" + e4m3 + x, keep.ln ? per(al * R * C) : 0, S};
    t[GB_LN1_MEAN] = {"ln1_mean", MEM_ACTIVATIONS, sh("(%zu, ", al) + rows + ") fp32" + x, per(al * R), F};
    t[GB_LN1_RSTD] = {"ln1_rstd", MEM_ACTIVATIONS, sh("(%zu, ", al) + rows + ") fp32" + x, per(al * R), F};
    t[GB_QKV] = {"qkv", MEM_ACTIVATIONS, sh("(%zu, B, T, 3C", al) + tp + ")" + e4m3 + x, per(al * BT * 3 * Ca), S};
    t[GB_ATTY] = {"atty", MEM_ACTIVATIONS, sh("(%zu, B, T, C", al) + tp + ")" + e4m3 + x, per(al * BT * Ca), S};
    if (simple) t[GB_ATT] = {"att", MEM_ACTIVATIONS, sh("(%zu, B, NH", al) + tp + ", T, T)" + e4m3 + x, per(al * B * NH * T * T), S};
    else t[GB_ATT] = {"att_stats", MEM_ACTIVATIONS, sh("(%zu, B, NH", al) + tp + ", T) fp32" + x, per(al * B * NH * T), F};
    t[GB_LN2] = {"ln2", MEM_ACTIVATIONS, sh("(%zu, ", al) + rows + ", C)" + e4m3 + x, keep.ln ? per(al * R * C) : 0, S};
    t[GB_LN2_MEAN] = {"ln2_mean", MEM_ACTIVATIONS, sh("(%zu, ", al) + rows + ") fp32" + x, per(al * R), F};
    t[GB_LN2_RSTD] = {"ln2_rstd", MEM_ACTIVATIONS, sh("(%zu, ", al) + rows + ") fp32" + x, per(al * R), F};
    t[GB_FCH] = {"fch", MEM_ACTIVATIONS, sh("(%zu, B, T, 4C", al) + tp + ")" + e4m3 + x, per(al * BT * Cf), S};
    t[GB_FCH_GELU] = {"fch_gelu", MEM_ACTIVATIONS, sh("(%zu, B, T, 4C", al) + tp + ")" + e4m3 + x, keep.gelu ? per(al * BT * Cf) : 0, S};
    t[GB_LNF] = {"lnf", MEM_ACTIVATIONS, "(" + rows + ", C)" + x, per(head * R * C), X};
    t[GB_LNF_MEAN] = {"lnf_mean", MEM_ACTIVATIONS, "(" + rows + ") fp32" + x, per(head * R), F};
    t[GB_LNF_RSTD] = {"lnf_rstd", MEM_ACTIVATIONS, "(" + rows + ") fp32" + x, per(head * R), F};
    t[GB_LOGITS] = {"logits", MEM_ACTIVATIONS, "(B, T, Vp" + tp + ")" + x, per(head * BT * Vp), X};
    t[GB_LOSSES] = {"losses", MEM_ACTIVATIONS, "(B, T) fp32" + x, per(head * BT), F};

    t[GB_LN_RECOMPUTE] = {"ln_recompute", MEM_WORKSPACE, "(" + rows + ", C)", keep.ln ? 0 : R * C, X};
    t[GB_GELU_RECOMPUTE] = {"gelu_recompute", MEM_WORKSPACE, "(B, T, 4C" + tp + ")", keep.gelu ? 0 : BT * Cf, X};
    t[GB_SCRATCH_C] = {"scratch_c", MEM_WORKSPACE, "(B, T, C)", BT * C, X};
    t[GB_DRESIDUAL] = {"dresidual", MEM_WORKSPACE, "(" + rows + ", C)" + x, per(R * C), X};
    t[GB_SCRATCH_3C] = {"scratch_3c", MEM_WORKSPACE, "(B, T, 3C" + tp + ")", BT * 3 * Ca, X};
    t[GB_SCRATCH_4C] = {"scratch_4c", MEM_WORKSPACE, "(B, T, 4C" + tp + ")", BT * Cf, X};
    t[GB_REDUCE_PARTIALS] = {"reduce_partials", MEM_WORKSPACE, "column sums per row block, fp32",
                             std::max(ln_partials, bias_partials), F};
    t[GB_NORM_PARTIALS] = {"norm_partials", MEM_WORKSPACE, sh("(%d+1) fp32", GLOBAL_NORM_BLOCKS), GLOBAL_NORM_BLOCKS + 1, F};
    t[GB_STEP_VALUES] = {"step_values", MEM_WORKSPACE, "the step's lr, bias corrections, norm, t", GPU_STEP_VALUES_BYTES, 1};
    t[GB_INPUTS] = {"inputs", MEM_WORKSPACE, "(B, T) int32" + x, per(BT), I};
    t[GB_TARGETS] = {"targets", MEM_WORKSPACE, "(B, T) int32" + x, per(BT), I};
    t[GB_ENCODER_BUCKETS] = {"encoder_buckets", MEM_WORKSPACE, "(3BT+1) int32" + x, per((3 * BT + 1)), I};
    t[GB_CUBLASLT_WORKSPACE] = {"cublaslt_workspace", MEM_WORKSPACE, "bytes", CUBLASLT_WORKSPACE_BYTES, 1};

    t[GB_ATT_QKV] = {"att_qkv", MEM_WORKSPACE, "(3, B, NH" + tp + ", T, hs)", simple ? 3 * BT * Ca : 0, X};
    t[GB_ATT_DQKV] = {"att_dqkv", MEM_WORKSPACE, "(3, B, NH" + tp + ", T, hs)", simple ? 3 * BT * Ca : 0, X};
    t[GB_ATT_O] = {"att_o", MEM_WORKSPACE, "(B, NH" + tp + ", T, hs)", simple ? BT * Ca : 0, X};
    t[GB_ATT_SCORES] = {"att_scores", MEM_WORKSPACE, "(B, NH" + tp + ", T, T)", simple ? B * NH * T * T : 0, X};
    t[GB_CUDNN_WORKSPACE] = {"cudnn_workspace", MEM_WORKSPACE, "bytes", simple ? 0 : s.cudnn_workspace_bytes, 1};
    t[GB_ATT_SOFTMAX_SUM] = {"att_softmax_sum", MEM_WORKSPACE, "(B, NH" + tp + ", T) fp32", simple ? 0 : B * NH * T, F};

    t[GB_TP_GATHERED] = {"sp_gathered", MEM_WORKSPACE, "(B, T, C) all ranks' rows", sp ? BT * C : 0, X};
    t[GB_TP_LOCAL] = {"sp_local", MEM_WORKSPACE, "(R, C) reduce-scattered", sp ? R * C : 0, X};
    t[GB_TP_LOSS_EXCHANGE] = {"vocab_loss_exchange", MEM_WORKSPACE, "(B, T) maxima, (B, T, 2) sums, fp32",
                              g.tp > 1 && head ? exchange : 0, F};
    t[GB_ZERO_GATHERED] = {"zero_gathered", MEM_WORKSPACE, sh("ends %zu + 2 layers x %zu", slots.ends, slots.layer),
                           g.zero_stage == 3 ? slots.ends + 2 * slots.layer : 0, X};
    t[GB_ZERO_BUCKETS] = {"zero_buckets", MEM_WORKSPACE, sh("ends %zu + 2 layers x %zu", slots.ends, slots.layer),
                          g.zero_stage >= 2 ? slots.ends + 2 * slots.layer : 0, X};
    t[GB_ZERO_REDUCED] = {"zero_reduced", MEM_WORKSPACE, sh("(%zu) a unit's shard", slots.largest_shard),
                          g.zero_stage >= 2 ? slots.largest_shard : 0, X};
    t[GB_LENT_WTE] = {"lent_wte", MEM_PARAMS, "(Vp" + tp + ", C) copy", lent ? Vp * C : 0, X};
    t[GB_LENT_WTE_GRAD] = {"lent_wte_grad", MEM_GRADS, "(Vp" + tp + ", C)", lent ? Vp * C : 0, X};
    t[GB_TIED_RECEIVED] = {"tied_received", MEM_WORKSPACE, "(Vp" + tp + ", C)", g.pp > 1 && slice.first_stage ? Vp * C : 0, X};

    // --moe-experts (llmc/model/moe_gpu.cuh): the table in bf16 without an fp32 master copy (its AdamW
    // rounds the bf16 values stochastically, as --master-weights 0), its gradient, m and v; per MoE
    // block the routing and the rows its experts gather; --expert-parallel's exchange
    // (llmc/parallel/expert_parallel.cuh). Sizes and padding: llmc/memory/moe_sizes.h
    t[GB_MOE_PARAMS] = {"moe_params", MEM_PARAMS, moe.params_shape, moe.params, X};
    t[GB_MOE_GRADS] = {"moe_grads", MEM_GRADS, moe.grads_shape, moe.grads, X};
    t[GB_MOE_ADAM_M] = {"moe_adam_m", MEM_OPTIMIZER, moe.moments_shape, moe.moments, F};
    t[GB_MOE_ADAM_V] = {"moe_adam_v", MEM_OPTIMIZER, moe.moments_shape, moe.moments, F};
    t[GB_MOE_ROUTING] = {"moe_routing", MEM_ACTIVATIONS, "Lm x (N (3E + 5k + 1) + 3E + 3), fp32 and int32", moe.routing, F};
    t[GB_MOE_ACTIVATIONS] = {"moe_activations", MEM_ACTIVATIONS, "Lm x k B T (2C + 2 x 4C) rows", moe.activations, X};
    t[GB_MOE_SCRATCH] = {"moe_scratch", MEM_WORKSPACE, "k B T (2C + 4C) rows", moe.scratch, X};
    t[GB_EP_ROWS] = {"ep_rows", MEM_WORKSPACE, "Lm x N_ep k B T (2C + 2 x 4C) rows", moe.ep_rows, X};
    t[GB_EP_SCRATCH] = {"ep_scratch", MEM_WORKSPACE, "N_ep k B T (3C + 4C) rows", moe.ep_scratch, X};
    t[GB_EP_COUNTS] = {"ep_counts", MEM_WORKSPACE, "2E int32", moe.ep_counts, F};
    t[GB_COMPRESSION_STATE] = {"compression_state", MEM_OPTIMIZER, "e, next e, Q, next Q fp32", s.compression_state, F};
    t[GB_COMPRESSION_WORK] = {"compression_work", MEM_WORKSPACE, "P + exact sums fp32", s.compression_work, F};
    // fp8: no fp8 copy of the weights or activations is kept; each matmul quantizes its operands into
    // the same two buffers (the MLP's are the largest), so only the scaling state grows with the layers
    int hist = s.fp8_history;
    t[GB_FP8_SCALING] = {"fp8_scaling", MEM_WORKSPACE, sh("(%zu x 12, %d+3) fp32", nl, hist),
                         hist ? fp8_state_floats((int)nl * FP8_TENSORS_PER_LAYER, hist) : 0, F};
    t[GB_FP8_A] = {"fp8_operand_a", MEM_WORKSPACE, "max(4C x C, B*T x max(4C, C)) fp8", hist ? fp8_operand_bytes(Cf, C, BT) : 0, 1};
    t[GB_FP8_B] = {"fp8_operand_b", MEM_WORKSPACE, "max(4C x C, B*T x max(4C, C)) fp8", hist ? fp8_operand_bytes(Cf, C, BT) : 0, 1};
    size_t stashes = (size_t)s.weight_stashes;
    t[GB_WEIGHT_STASH] = {"weight_stash", MEM_ACTIVATIONS, sh("(%zu, %zu, B, T, 9C) matmuls' dy", stashes, nl),
                          stashes * weight_stash_floats(nl, BT, C, Ca, Cf), X};
    size_t work = s.fp8_stash ? gpu_stash_work_offset(s, GPU_STASHED) : 0;
    t[GB_STASH_WORK] = {"stash_work", MEM_WORKSPACE, "one layer of the stashed rows", work, X};
    t[GB_STASH_AMAX] = {"stash_amax", MEM_ACTIVATIONS, sh("(%zu, %d) fp32", al, GPU_STASHED) + x,
                        s.fp8_stash ? per(al * GPU_STASHED) : 0, F};
    t[GB_OLDER_WEIGHTS] = {"older_weights", MEM_PARAMS, sh("2BW's W(t-1): params%s", lent ? " + lent_wte" : ""),
                           s.two_weight_versions ? z.params + (lent ? Vp * C : 0) : 0, X};
    return t;
}

// A pipeline stage's micro-batches in flight (the activation slots; interleaved: (micro-batch, chunk)
// pairs, pipeline_live_micro_batches) and ZB-H1's stashes. The GPU
// trainer's ZB-H1 (llmc/model/zero_bubble_backward.cuh) keeps a micro-batch's whole slot from F(k)
// to W(k), p micro-batches on every stage (the CPU parks only the rows W reads, and keeps 1F1B's
// p - s slots), and the output gradients from B(k) to W(k) in s + 1 stashes (none on the first
// stage, whose W follows its B: there B is the whole backward). m: the step's micro-batches (1 for
// --eval-only, which runs no backward).
inline int gpu_micro_batches_in_flight(PipelineSchedule kind, const ProcessGrid& g, int m, int chunks = 1) {
    if (kind == PipelineSchedule::ZeroBubbleH1 && g.pp > 1) return zero_bubble_weight_input_slots(g.pp, m);
    return pipeline_live_micro_batches(kind, g.pp_rank, g.pp, m, chunks);
}
inline int gpu_weight_stashes(PipelineSchedule kind, const ProcessGrid& g, int m) {
    return kind == PipelineSchedule::ZeroBubbleH1 && g.pp > 1 && m > 1 ? zero_bubble_stashes(g.pp_rank, m) : 0;
}
// The pipeline's part of a run's shape, from the schedule and the step's micro-batches m, in one place
// (as cpu_run_shape on the CPU side): --estimate, the early memory check and the allocation all
// size the slots, ZB-H1's stashes and the interleaved chunks here, from the same m.
inline void gpu_pipeline_shape(GPURunShape* s, PipelineSchedule kind, int m, int chunks) {
    s->chunks = kind == PipelineSchedule::Interleaved ? chunks : 1;
    s->micro_batches_in_flight = gpu_micro_batches_in_flight(kind, s->grid, m, s->chunks);
    s->weight_stashes = gpu_weight_stashes(kind, s->grid, m);
    s->two_weight_versions = kind == PipelineSchedule::PipeDream2BW;
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
// --offload optimizer (llmc/optim/offload.cuh): the parameters whose master, m, v moved to pinned host
// memory (what the rows above would hold on the GPU), and the host bytes each of them costs: master,
// m, v (12), the gradient widened to fp32 for the CPU's AdamW (4), the bf16 staging array the
// gradient's buckets stream into (2); --offload-delay 1 adds a bf16 array for the weights going up (2),
// since the staging array receives the next step's gradient while the CPU step runs; --optimizer-state
// bf16 halves m and v (2 + 2): 14, or 16 with the delay.
constexpr size_t OFFLOAD_HOST_BYTES_PER_PARAM = 4 + 4 + 4 + 4 + 2;
inline size_t offload_host_bytes_per_param(bool delay, bool bf16_moments) {
    return OFFLOAD_HOST_BYTES_PER_PARAM + (delay ? 2 : 0) - (bf16_moments ? 4 : 0);
}
inline size_t gpu_offloaded_elements(GPURunShape s) {
    if (!s.offload_optimizer) return 0;
    s.offload_optimizer = false;
    return gpu_buffer_table(s)[GB_ADAM_M].elements;
}

constexpr size_t GPU_MEMORY_MARGIN_BYTES = 512u << 20;

// Whether the table of `s` with micro-batch B fits in `free_bytes`, margin included. Before the cuDNN
// plans exist its workspace is the bound cudnn_workspace_estimate(), which grows with B like the rest.
inline bool gpu_batch_fits(GPURunShape s, int B, size_t free_bytes) {
    s.B = B;
    if (!s.simple_attention) s.cudnn_workspace_bytes = cudnn_workspace_estimate(s.cfg, B, s.T, s.grid.tp);
    return gpu_buffer_total(gpu_buffer_table(s)) + GPU_MEMORY_MARGIN_BYTES <= free_bytes;
}

// The largest micro-batch B' <= s.B whose table fits in `free_bytes` (0 if not even B'=1 fits).
inline int largest_batch_that_fits(const GPURunShape& s, size_t free_bytes) {
    return largest_fitting_batch([&](int b) { return gpu_batch_fits(s, b, free_bytes); }, s.B);
}

// The table as the trainer prints it at start-up and --estimate prints it.
inline void print_gpu_buffer_table(const std::vector<BufferSpec>& table) { print_buffer_table(table, GPU_ALLOCATION_GRANULE); }
