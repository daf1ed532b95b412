// cpu_buffers.h — every buffer the CPU trainer allocates, as a function of the run's shape.
//
// Host-only, the twin of gpu_buffers.h: train_gpt_cpu.cpp allocates FROM this table, each buffer
// exactly as large as its row says, and `--estimate` prints the same table. So the estimate is what
// the trainer holds, to the byte: `--print-allocations` makes every rank report the capacity of each
// vector it really holds, and test/test_estimate.py compares the two.
//
// Everything is fp32 (4 bytes per value). Per rank:
//   params, grads       the flat arrays (llmc/model/model.h), padded to the shard layout (llmc/parallel/sharding.h) so
//                       the collectives move equal pieces: round_up(N, ranks * 64) values each
//   older_weights       --pipeline-schedule 2bw: the weights one version older, W(t-1), as params (and the last
//                       stage's wte copy) are W(t) (llmc/parallel/pipedream_2bw.h)
//   grad_shard          the reduce-scatter's output, the summed gradient of this rank's shard
//                       (one full copy of the gradient with one rank: the price of one code path)
//   adam_m, adam_v      AdamW's moments for the parameters this rank updates: all N (ZeRO-0) or its
//                       shard (ZeRO-1, about N / ranks). No master copy: fp32 weights are their own master
//                       (--optimizer-state bf16: 2 bytes each, llmc/optim/adamw_bf16.h)
//                       (--offload-dir: two chunks each, the moments themselves on disk, llmc/optim/disk_offload.h)
//   optimizer_state     instead of m and v, with --optimizer adafactor or sm3: rows + columns per weight
//                       matrix, one per element of a vector (llmc/optim/optimizer_state.h), on every rank
//                       (ZeRO-1: of this rank's whole blocks, llmc/optim/factored_sharding.h)
//   optimizer_scratch   SM3's new column accumulators: the widest matrix's columns
//   activations         what the backward pass reads, stacked over the L layers; the attention
//                       probabilities are materialised, (L, B, NH, T, T)
//   workspace           one layer's backward scratch, reused by every layer, and the matmul's packed panels
//
// Recompute (--recompute, llmc/model/recompute.h says what each level keeps and why it is exact) swaps a
// per-layer activation for ONE layer of scratch: level 1 drops fch_gelu for gelu_recompute
// (B, T, 4C), level 2 also ln1 and ln2 for ln_recompute (R, C), one buffer for both. The scratch
// rows are not per micro-batch (the backward refills them before every use).
//
// --stash-precision bf16 (llmc/memory/stash_precision.h) stores ln1, ln2, qkv, att, atty, fch and
// fch_gelu in 2 bytes a value (their rows' element size), and adds ONE layer of each in fp32 as
// scratch: the forward computes into it, the backward widens into it (ln1 and ln2 share
// ln_recompute, fch_gelu uses gelu_recompute, the others the stash_* rows).
//
// On a process grid (llmc/parallel/process_grid.h) every row is for this rank's slice: its pipeline stage's
// layers (activations of as many micro-batches as its schedule keeps in flight, llmc/parallel/pipeline_parallel.h),
// its tensor rank's heads, hidden units and vocabulary rows (B*T/t rows of the residual stream with
// sequence parallelism, llmc/parallel/tensor_parallel.h), and its ZeRO share (llmc/parallel/zero.h: stage 2 keeps
// only a gradient shard, stage 3 only a weight shard, plus the units gathered and the buckets open
// at the peak). A pipeline's last stage also holds a copy of the tied embedding and its gradient.
//
// The MoE and expert-parallel rows take their sizes, and the padding their sums need, from
// llmc/memory/moe_sizes.h, as PowerSGD's take theirs from llmc/parallel/grad_compression.h.
//
// Not in the table: the data loader's tokens (the current shard, 2 bytes per token) and per-call
// scratch that lives for one function call (per thread, one head's q, k, v, dO and its T x T score
// gradient in the attention: 5.3 MiB at T = 1024, C = 768, H = 12; the gradient-norm partials),
// and the copies made while writing a checkpoint. None of it grows with the number of layers or
// the batch size.
#pragma once

#include <cstddef>
#include <vector>
#include "llmc/memory/moe_sizes.h"  // the MoE and expert-parallel rows
#include "llmc/memory/size_table.h"
#include "llmc/model/cpu_matmul_blocking.h"  // MATMUL_KC, _NC, matmul_pack_a/b_floats: the matmul's panels
#include "llmc/model/model.h"
#include "llmc/optim/disk_offload.h"
#include "llmc/optim/factored_sharding.h"
#include "llmc/optim/factored_tensor_parallel.h"
#include "llmc/optim/optimizer_state.h"
#include "llmc/parallel/grad_compression.h"
#include "llmc/parallel/pipeline_parallel.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/model/recompute.h"
#include "llmc/model/zero_bubble_backward.h"
#include "llmc/parallel/sharding.h"
#include "llmc/parallel/zero.h"
#include "llmc/utils.h"

// What decides the sizes.
struct CPURunShape {
    GPT2Config cfg;
    int B = 0, T = 0;                  // micro-batch
    int world_size = 1, rank = 0;      // data-parallel ranks, and which one this is
    int zero_stage = 0;                // 0: every rank keeps all of m and v; 1: its shard only; 2, 3: llmc/parallel/zero.h
    // tensor and pipeline parallelism (llmc/parallel/process_grid.h): which slice of the model this rank holds
    int tensor_parallel = 1, tensor_rank = 0;
    int pipeline_parallel = 1, pipeline_rank = 0;
    bool sequence_parallel = false;
    int micro_batches_in_flight = 1;   // activations kept at once: more than one only in a pipeline
    int virtual_stages = 1;            // interleaved 1F1B: model chunks per stage; each slot above holds one chunk's layers
    // ZB-H1 (llmc/model/zero_bubble_backward.h): the stashes of output gradients (micro-batches between
    // B and W that need one), and the micro-batches whose rows W reads are held (F to W)
    int pending_weight_passes = 0;
    int weight_input_slots = 0;
    bool two_weight_versions = false;  // PipeDream-2BW: W(t-1) beside W(t) (llmc/parallel/pipedream_2bw.h)
    int recompute = 0;                 // 0, 1, 2 (see above)
    Optimizer optimizer = Optimizer::AdamW;
    bool bf16_moments = false;         // --optimizer-state bf16: AdamW's m and v in 2 bytes (llmc/optim/adamw_bf16.h)
    GradCompressionSettings compression;  // --grad-compression (llmc/parallel/grad_compression.h)
    MoEConfig moe;                     // --moe-experts, --moe-every (llmc/model/model.h's MoE table)
    int moe_top_k = 1;                 // --moe-top-k: rows each MoE block gathers per token
    int expert_parallel = 1, expert_rank = 0;  // --expert-parallel: the expert group's size, this rank's place in it
    bool bf16_stash = false;           // --stash-precision bf16 (llmc/memory/stash_precision.h)
    int offload_chunk_kib = 0;         // --offload-dir: m and v on disk, streamed in chunks of this (0: in RAM)
};

// The shape of rank g.rank of a grid (micro-batches: the step's, m; the schedule decides how many
// of them this rank's stage holds at once) at a recompute level.
inline CPURunShape cpu_run_shape(const GPT2Config& cfg, int B, int T, const ProcessGrid& g, PipelineSchedule schedule, int m,
                                 int recompute, int chunks = 1) {
    CPURunShape s;
    s.cfg = cfg;
    s.B = B, s.T = T;
    s.world_size = g.dp, s.rank = g.dp_rank;
    s.zero_stage = g.zero_stage;
    s.tensor_parallel = g.tp, s.tensor_rank = g.tp_rank;
    s.pipeline_parallel = g.pp, s.pipeline_rank = g.pp_rank;
    s.sequence_parallel = g.sequence_parallel;
    s.virtual_stages = schedule == PipelineSchedule::Interleaved ? chunks : 1;
    s.micro_batches_in_flight = pipeline_live_micro_batches(schedule, g.pp_rank, g.pp, m, s.virtual_stages);
    bool zb = schedule == PipelineSchedule::ZeroBubbleH1 && g.pp > 1;
    s.pending_weight_passes = zb ? zero_bubble_stashes(g.pp_rank, m) : 0;
    s.weight_input_slots = zb ? zero_bubble_weight_input_slots(g.pp, m) : 0;
    s.two_weight_versions = schedule == PipelineSchedule::PipeDream2BW;
    s.recompute = recompute;
    return s;
}

inline ProcessGrid cpu_shape_grid(const CPURunShape& s) {
    ProcessGrid g;
    int world = s.world_size * s.tensor_parallel * s.pipeline_parallel;
    make_grid(world, (s.pipeline_rank * s.world_size + s.rank) * s.tensor_parallel + s.tensor_rank, s.tensor_parallel,
              s.pipeline_parallel, s.world_size, s.zero_stage, s.sequence_parallel, &g);
    return g;
}

// One buffer per row; the trainer finds each row's vector by this enum.
enum CPUBuffer {
    // the model, its gradient and its optimizer
    CB_PARAMS, CB_GRADS, CB_GRAD_SHARD, CB_ADAM_M, CB_ADAM_V, CB_OPTIMIZER_STATE,
    // PipeDream-2BW's older weight version (llmc/parallel/pipedream_2bw.h)
    CB_OLDER_WEIGHTS,
    // activations kept from the forward for the backward
    CB_ENCODED, CB_LN1, CB_LN1_MEAN, CB_LN1_RSTD, CB_QKV, CB_ATT, CB_ATTY, CB_RESIDUAL2,
    CB_LN2, CB_LN2_MEAN, CB_LN2_RSTD, CB_FCH, CB_FCH_GELU, CB_RESIDUAL3,
    CB_LNF, CB_LNF_MEAN, CB_LNF_RSTD, CB_LOGITS, CB_LOSSES, CB_LOGSUMEXP,
    // ZB-H1: what B keeps for the deferred W, its output gradients (llmc/model/zero_bubble_backward.h)
    CB_WEIGHT_STASH,
    // scratch: one layer's worth, reused by every layer; the matmul's packed panels
    CB_DRESIDUAL, CB_DBUF_C, CB_DBUF_3C, CB_DBUF_4C, CB_MATMUL_PACK_A, CB_MATMUL_PACK_B, CB_OPTIMIZER_SCRATCH,
    // recompute: one layer of what the levels above 0 do not keep per layer
    CB_LN_RECOMPUTE, CB_GELU_RECOMPUTE,
    // --stash-precision bf16: one layer in fp32 of the other stashed tensors (llmc/memory/stash_precision.h)
    CB_STASH_QKV, CB_STASH_ATT, CB_STASH_ATTY, CB_STASH_FCH,
    // parallelism: sequence-parallel rows; ZeRO-2/3's gathered units and open buckets at the peak;
    // a pipeline's last stage: its copy of the tied embedding
    CB_GATHERED, CB_DLOCAL, CB_ZERO_UNITS, CB_LENT_WTE, CB_LENT_WTE_GRAD,
    // gradient compression: PowerSGD's error feedback and Q (each twice: this step's wait for its
    // verdict), P and the exactly summed values, or bf16's send and receive arrays; the all-reduce's scratch
    CB_COMPRESSION_STATE, CB_COMPRESSION_WORK, CB_COMPRESSION_SCRATCH,
    // mixture of experts: the MoE table (router, experts 1 .. E-1), its gradient and AdamW moments;
    // what each MoE block keeps for its backward (llmc/model/moe.h's MoEActivations, one per block)
    // (or, --optimizer adafactor|sm3, its blocks' factored statistics)
    CB_MOE_PARAMS, CB_MOE_GRADS, CB_MOE_ADAM_M, CB_MOE_ADAM_V, CB_MOE_FACTORED_STATE, CB_MOE_ACTIVATIONS, CB_MOE_SUM_SCRATCH,
    // --expert-parallel: each MoE block's exchange buffers (llmc/parallel/expert_parallel.h's ExpertParallelBlock)
    CB_EP_EXCHANGE,
    CB_COUNT
};

// The rows that every micro-batch in flight has its own of (a pipeline stage keeps several): what the
// forward keeps for the backward, and the residual gradient that travels between stages.
inline bool cpu_buffer_per_micro_batch(int row) { return (row >= CB_ENCODED && row <= CB_LOGSUMEXP) || row == CB_DRESIDUAL; }

// How many of the slots hold row `row`: every one of the micro-batches in flight for the rows above,
// but the head's (the final LayerNorm, the logits, the losses) once under interleaved 1F1B. There a
// slot holds one chunk, and only the last stage's last chunk has the head; its forward and backward
// of a micro-batch are one unit of the steady state (the last stage warms up with (v-1)p forwards of
// the other chunks: llmc/parallel/pipeline_schedule.h), so one micro-batch's head is in flight at a
// time, not warm-up + 1 (at d12, 4 stages, m = 8: 1 set of (B, T, Vp) logits on the last stage, not 5).
inline int cpu_buffer_slots(const CPURunShape& s, int row) {
    if (!cpu_buffer_per_micro_batch(row)) return 1;
    bool head = row >= CB_LNF && row <= CB_LOGSUMEXP;
    return head && s.virtual_stages > 1 ? 1 : s.micro_batches_in_flight;
}

// ZB-H1's W reads these rows of its micro-batch's slot in place, so they outlive the slot's other
// rows, freed at B (llmc/model/zero_bubble_backward.h): the four matmuls' inputs ln1, atty, ln2 and
// fch_gelu, or at a recompute level what B rebuilds them from (fch for GELU(fch); for ln1 and ln2
// the LayerNorms' inputs, the residual stream, and their statistics). Not the logits nor lnf: the
// LM head's weight gradient stays in B, as do the LayerNorms'.
inline bool cpu_buffer_read_by_weight_pass(int row, int recompute) {
    RecomputePlan keep = recompute_plan(recompute);
    switch (row) {
        case CB_ATTY: return true;
        case CB_LN1: case CB_LN2: return keep.ln;
        case CB_ENCODED: case CB_RESIDUAL2: case CB_RESIDUAL3:
        case CB_LN1_MEAN: case CB_LN1_RSTD: case CB_LN2_MEAN: case CB_LN2_RSTD: return !keep.ln;
        case CB_FCH_GELU: return keep.gelu;
        case CB_FCH: return !keep.gelu;
        default: return false;
    }
}

// How many micro-batches' copies of row `row` a rank holds: 1, the micro-batches in flight (F to B),
// or for ZB-H1's rows that W reads, the micro-batches from F to W (the extra ones "parked": the
// trainer moves a slot's W rows aside when a forward takes the slot before W ran).
inline size_t cpu_buffer_copies(const CPURunShape& s, int row) {
    if (!cpu_buffer_per_micro_batch(row)) return 1;
    size_t M = (size_t)cpu_buffer_slots(s, row);
    return cpu_buffer_read_by_weight_pass(row, s.recompute) ? std::max(M, (size_t)s.weight_input_slots) : M;
}

// ZB-H1: the rows W reads, held from F to W by more micro-batches than the rest (F to B): a table's
// per-micro-batch rows grown from M copies to cpu_buffer_copies.
inline void cpu_park_weight_pass_rows(const CPURunShape& s, std::vector<BufferSpec>* t) {
    size_t M = s.micro_batches_in_flight;
    for (int b = 0; b < CB_COUNT; b++) {
        size_t copies = cpu_buffer_copies(s, b);
        if (!cpu_buffer_per_micro_batch(b) || !cpu_buffer_read_by_weight_pass(b, s.recompute) || copies == M) continue;
        (*t)[b].elements = (*t)[b].elements / M * copies;
        (*t)[b].shape += strprintf(" + %zu parked for W", copies - M);
    }
}

// The parameters whose AdamW state this rank keeps: all of them, or (ZeRO-1) those of its shard.
inline ShardRange cpu_updated_range(const CPURunShape& s) {
    ShardLayout shards = shard_layout(param_layout(s.cfg).total, s.world_size);
    return s.zero_stage == 1 ? owned_range(shards, s.rank) : ShardRange{0, shards.total};
}

inline std::vector<BufferSpec> cpu_buffer_table(const CPURunShape& s) {
    const GPT2Config& c = s.cfg;
    ModelSlice slice = model_slice(c, cpu_shape_grid(s), s.virtual_stages);
    ParamLayout layout = slice_layout(c, slice);
    ZeroMemory z = zero_memory(s.zero_stage, model_units(layout, slice.num_layers), layout.total, s.world_size, s.rank);
    // local shapes: on one rank these are the model's own (see the model section of train_gpt_cpu.cpp)
    // L: the layers of one activation slot, the stage's (interleaved: one chunk's, L/(p v), per (micro-batch, chunk) in flight)
    size_t L = slice.num_layers / slice.chunks, C = c.channels, Ca = slice.attn_channels, NH = slice.heads, Cf = slice.fc_channels;
    size_t Vp = slice.vocab_rows, head = slice.last_stage ? 1 : 0, sp = s.sequence_parallel ? s.tensor_parallel : 1;
    size_t B = s.B, T = s.T, BT = B * T, R = BT / sp, F = 4, M = s.micro_batches_in_flight;
    RecomputePlan keep = recompute_plan(s.recompute);
    size_t A = s.bf16_stash ? 2 : F;  // the stashed activations' bytes per value
    std::string a16 = s.bf16_stash ? " bf16" : "";
    size_t one_layer = s.bf16_stash ? 1 : 0;  // the stash's fp32 scratch rows
    // the largest matmul: M is B*T rows in the forward and the data gradient, the output width
    // (3Ca, C, Cf, and Vp where the slice has the LM head) in the weight gradient
    size_t head_rows = head * Vp;  // a pipeline stage without the head never multiplies by wte
    size_t max_rows = std::max({BT, head_rows, Cf, 3 * Ca, C});
    // ... and N, the columns, is an output width in the forward, an input width in the backward, or
    // B*T where a narrow product runs as its transpose (cpu_matmul.h's matmul)
    size_t max_columns = std::max({head_rows, Cf, 3 * Ca, C, BT});
    bool lent = s.pipeline_parallel > 1 && slice.last_stage;
    auto sh = [](const char* fmt, auto... v) { return strprintf(fmt, v...); };
    std::string x = M > 1 ? sh(" x %zu", M) : std::string();   // per micro-batch in flight
    size_t Mh = (size_t)cpu_buffer_slots(s, CB_LOGITS);        // ... of the head's rows
    std::string xh = Mh > 1 ? sh(" x %zu", Mh) : std::string();
    std::string rows = sp > 1 ? "R" : "B, T";                 // sequence parallelism: R = B*T/t rows
    std::string tp = s.tensor_parallel > 1 ? "/t" : "";

    std::vector<BufferSpec> t(CB_COUNT);
    t[CB_PARAMS] = {"params", MEM_PARAMS, s.zero_stage == 3 ? sh("(%zu) shards", z.params) : sh("(%zu) padded", z.params), z.params, F};
    t[CB_GRADS] = {"grads", MEM_GRADS, sh("(%zu) padded", z.grads), z.grads, F};
    t[CB_GRAD_SHARD] = {"grad_shard", MEM_GRADS, sh("(%zu) this rank's shard", z.grad_shard), z.grad_shard, F};
    bool adamw = s.optimizer == Optimizer::AdamW;
    size_t moments = adamw ? z.optimizer / 2 : 0;
    size_t moment_bytes = s.bf16_moments ? 2 : F;
    const char* moment_type = s.bf16_moments ? " bf16" : "";
    if (s.offload_chunk_kib > 0) {  // the moments are in files; RAM holds two chunks of each
        size_t slots = disk_offload_buffer_elements(moments, s.offload_chunk_kib, moment_bytes);
        std::string where = sh("2 chunks; the (%zu)%s on disk", moments, moment_type);
        t[CB_ADAM_M] = {"adam_m", MEM_OPTIMIZER, where, slots, moment_bytes};
        t[CB_ADAM_V] = {"adam_v", MEM_OPTIMIZER, where, slots, moment_bytes};
    } else {
        t[CB_ADAM_M] = {"adam_m", MEM_OPTIMIZER, sh("(%zu)%s", moments, moment_type), moments, moment_bytes};
        t[CB_ADAM_V] = {"adam_v", MEM_OPTIMIZER, sh("(%zu)%s", moments, moment_type), moments, moment_bytes};
    }
    // (ZeRO-1: the rows and columns of this rank's whole blocks only, llmc/optim/factored_sharding.h)
    // (--tensor-parallel: the rows and columns of this rank's part of each block, factored_tensor_parallel.h)
    size_t factored = adamw ? 0 : s.zero_stage == 1 ? factored_state_floats_of(c, s.world_size, s.rank)
                                : slice_factored_state_floats(c, slice);
    t[CB_OPTIMIZER_STATE] = {"optimizer_state", MEM_OPTIMIZER,
                             sh("%s: rows + cols per matrix, n per vector%s", optimizer_name((int)s.optimizer),
                                s.zero_stage == 1 ? ", this rank's blocks" : ""), factored, F};

    t[CB_ENCODED] = {"encoded", MEM_ACTIVATIONS, "(" + rows + ", C)" + x, M * R * C, F};
    t[CB_LN1] = {"ln1", MEM_ACTIVATIONS, "(L, " + rows + ", C)" + x + a16, keep.ln ? M * L * R * C : 0, A};
    t[CB_LN1_MEAN] = {"ln1_mean", MEM_ACTIVATIONS, "(L, " + rows + ")" + x, M * L * R, F};
    t[CB_LN1_RSTD] = {"ln1_rstd", MEM_ACTIVATIONS, "(L, " + rows + ")" + x, M * L * R, F};
    t[CB_QKV] = {"qkv", MEM_ACTIVATIONS, "(L, B, T, 3C" + tp + ")" + x + a16, M * L * BT * 3 * Ca, A};
    t[CB_ATT] = {"att", MEM_ACTIVATIONS, "(L, B, NH" + tp + ", T, T)" + x + a16, M * L * B * NH * T * T, A};
    t[CB_ATTY] = {"atty", MEM_ACTIVATIONS, "(L, B, T, C" + tp + ")" + x + a16, M * L * BT * Ca, A};
    t[CB_RESIDUAL2] = {"residual2", MEM_ACTIVATIONS, "(L, " + rows + ", C)" + x, M * L * R * C, F};
    t[CB_LN2] = {"ln2", MEM_ACTIVATIONS, "(L, " + rows + ", C)" + x + a16, keep.ln ? M * L * R * C : 0, A};
    t[CB_LN2_MEAN] = {"ln2_mean", MEM_ACTIVATIONS, "(L, " + rows + ")" + x, M * L * R, F};
    t[CB_LN2_RSTD] = {"ln2_rstd", MEM_ACTIVATIONS, "(L, " + rows + ")" + x, M * L * R, F};
    t[CB_FCH] = {"fch", MEM_ACTIVATIONS, "(L, B, T, 4C" + tp + ")" + x + a16, M * L * BT * Cf, A};
    t[CB_FCH_GELU] = {"fch_gelu", MEM_ACTIVATIONS, "(L, B, T, 4C" + tp + ")" + x + a16, keep.gelu ? M * L * BT * Cf : 0, A};
    t[CB_RESIDUAL3] = {"residual3", MEM_ACTIVATIONS, "(L, " + rows + ", C)" + x, M * L * R * C, F};
    t[CB_LNF] = {"lnf", MEM_ACTIVATIONS, "(" + rows + ", C)" + xh, Mh * head * R * C, F};
    t[CB_LNF_MEAN] = {"lnf_mean", MEM_ACTIVATIONS, "(" + rows + ")" + xh, Mh * head * R, F};
    t[CB_LNF_RSTD] = {"lnf_rstd", MEM_ACTIVATIONS, "(" + rows + ")" + xh, Mh * head * R, F};
    t[CB_LOGITS] = {"logits", MEM_ACTIVATIONS, "(B, T, Vp" + tp + ")" + xh, Mh * head * BT * Vp, F};
    t[CB_LOSSES] = {"losses", MEM_ACTIVATIONS, "(B, T)" + xh, Mh * head * BT, F};
    t[CB_LOGSUMEXP] = {"logsumexp", MEM_ACTIVATIONS, "(B, T)" + xh, Mh * head * BT, F};
    size_t stashes = s.pending_weight_passes;
    t[CB_WEIGHT_STASH] = {"weight_stash", MEM_ACTIVATIONS, sh("ZB-H1, W's dy: (C+4C+C+3C) x B x T per layer x %zu", stashes),
                          stashes * weight_stash_floats(L, BT, C, Ca, Cf), F};

    t[CB_DRESIDUAL] = {"dresidual", MEM_WORKSPACE, "(" + rows + ", C)" + x, M * R * C, F};
    t[CB_DBUF_C] = {"dbuf_c", MEM_WORKSPACE, "(B, T, C)", BT * C, F};
    t[CB_DBUF_3C] = {"dbuf_3c", MEM_WORKSPACE, "(B, T, 3C" + tp + ")", BT * 3 * Ca, F};
    t[CB_DBUF_4C] = {"dbuf_4c", MEM_WORKSPACE, "(B, T, 4C" + tp + ")", BT * Cf, F};
    t[CB_MATMUL_PACK_A] = {"matmul_pack_a", MEM_WORKSPACE, sh("%zu rows x KC=%d", max_rows, MATMUL_KC),
                           matmul_pack_a_floats(max_rows), F};
    t[CB_MATMUL_PACK_B] = {"matmul_pack_b", MEM_WORKSPACE, sh("min(NC=%d, %zu) columns x KC=%d", MATMUL_NC, max_columns, MATMUL_KC),
                           matmul_pack_b_floats(max_columns), F};
    t[CB_OPTIMIZER_SCRATCH] = {"optimizer_scratch", MEM_WORKSPACE, "SM3: the widest matrix's columns",
                               s.optimizer == Optimizer::SM3 ? factored_scratch_floats(c) : 0, F};
    // (ln1, ln2 or fch_gelu: recomputed, or widened from the bf16 stash)
    t[CB_LN_RECOMPUTE] = {"ln_recompute", MEM_WORKSPACE, "(" + rows + ", C) ln1 or ln2", keep.ln && !s.bf16_stash ? 0 : R * C, F};
    t[CB_GELU_RECOMPUTE] = {"gelu_recompute", MEM_WORKSPACE, "(B, T, 4C" + tp + ")", keep.gelu && !s.bf16_stash ? 0 : BT * Cf, F};
    t[CB_STASH_QKV] = {"stash_qkv", MEM_WORKSPACE, "(B, T, 3C" + tp + ") one layer", one_layer * BT * 3 * Ca, F};
    t[CB_STASH_ATT] = {"stash_att", MEM_WORKSPACE, "(B, NH" + tp + ", T, T) one layer", one_layer * B * NH * T * T, F};
    t[CB_STASH_ATTY] = {"stash_atty", MEM_WORKSPACE, "(B, T, C" + tp + ") one layer", one_layer * BT * Ca, F};
    t[CB_STASH_FCH] = {"stash_fch", MEM_WORKSPACE, "(B, T, 4C" + tp + ") one layer", one_layer * BT * Cf, F};

    t[CB_GATHERED] = {"sp_gathered", MEM_WORKSPACE, "(B, T, C) all ranks' rows", sp > 1 ? BT * C : 0, F};
    t[CB_DLOCAL] = {"sp_dlocal", MEM_WORKSPACE, "(R, C) reduce-scattered", sp > 1 ? R * C : 0, F};
    t[CB_ZERO_UNITS] = {"zero_units", MEM_WORKSPACE, "gathered units + open buckets, peak", z.transient, F};
    t[CB_LENT_WTE] = {"lent_wte", MEM_PARAMS, "(Vp" + tp + ", C) copy", lent ? Vp * C : 0, F};
    t[CB_LENT_WTE_GRAD] = {"lent_wte_grad", MEM_GRADS, "(Vp" + tp + ", C)", lent ? Vp * C : 0, F};
    // (2BW refuses ZeRO-3: params is the whole stage's, z.params)
    t[CB_OLDER_WEIGHTS] = {"older_weights", MEM_PARAMS, sh("2BW's W(t-1): params%s", lent ? " + lent_wte" : ""),
                           s.two_weight_versions ? z.params + (lent ? Vp * C : 0) : 0, F};
    GradCompressionSizes gc = grad_compression_sizes(s.compression, c, s.world_size);
    t[CB_COMPRESSION_STATE] = {"compression_state", MEM_OPTIMIZER, "e, next e, Q, next Q", gc.state, F};
    t[CB_COMPRESSION_WORK] = {"compression_work", MEM_WORKSPACE, "P + exact sums, or bf16 send + receive", gc.work, F};
    t[CB_COMPRESSION_SCRATCH] = {"compression_scratch", MEM_WORKSPACE, "the all-reduce's padded copy + a shard", gc.scratch, F};
    // --moe-experts (llmc/model/moe.h): the MoE table (router, experts 1 .. E-1), its gradient and AdamW
    // moments, or the factored optimizers' statistics; what each MoE block keeps for its backward; the
    // data-parallel sum's scratch; --expert-parallel's exchange (llmc/parallel/expert_parallel.h).
    // Sizes and padding: llmc/memory/moe_sizes.h
    CPUMoESizes moe = cpu_moe_sizes(c, {s.moe, s.moe_top_k, s.expert_parallel, s.expert_rank, s.world_size, s.zero_stage, BT},
                                    adamw, s.compression.kind == GradCompressionKind::BF16);
    t[CB_MOE_PARAMS] = {"moe_params", MEM_PARAMS, moe.params_shape, moe.params, F};
    t[CB_MOE_GRADS] = {"moe_grads", MEM_GRADS, "as moe_params", moe.params, F};
    t[CB_MOE_ADAM_M] = {"moe_adam_m", MEM_OPTIMIZER, moe.moments_shape, moe.moments, F};
    t[CB_MOE_ADAM_V] = {"moe_adam_v", MEM_OPTIMIZER, moe.moments_shape, moe.moments, F};
    t[CB_MOE_FACTORED_STATE] = {"moe_optimizer_state", MEM_OPTIMIZER, sh("%s: per router and expert tensor", optimizer_name((int)s.optimizer)),
                                moe.factored, F};
    t[CB_MOE_ACTIVATIONS] = {"moe_activations", MEM_ACTIVATIONS, "Lm x (routing + k B T (4C + 3 x 4C) rows)", moe.activations, F};
    t[CB_MOE_SUM_SCRATCH] = {"moe_sum_scratch", MEM_WORKSPACE, moe.sum_scratch_shape, moe.sum_scratch, F};
    t[CB_EP_EXCHANGE] = {"ep_exchange", MEM_WORKSPACE, "Lm x (N_ep k B T rows x 17C + 3E + 2N_ep ints)", moe.ep_exchange, F};
    cpu_park_weight_pass_rows(s, &t);  // ZB-H1: the rows W reads, more copies
    return t;
}

// --offload-dir: the floats of m (and of v) this rank keeps on disk (0 without it).
inline size_t cpu_offloaded_moments(const CPURunShape& s) {
    bool adamw = s.optimizer == Optimizer::AdamW;
    return s.offload_chunk_kib > 0 && adamw ? cpu_updated_range(s).size() : 0;
}

// The CPU allocator is asked for exactly each row's bytes (std::vector of that many floats).
constexpr size_t CPU_ALLOCATION_GRANULE = 1;
