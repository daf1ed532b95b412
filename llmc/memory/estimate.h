// estimate.h — will it fit, and how long will it take? The answer before anything is allocated.
//
// `--estimate` on either trainer prints, for a model shape, micro-batch, sequence length, precision,
// recompute level, ZeRO stage and number of ranks:
//   1. the bytes per rank of every buffer, from the trainer's OWN size table (llmc/memory/cpu_buffers.h,
//      llmc/memory/gpu_buffers.h: the tables the trainers allocate from), summed by kind: parameters,
//      gradients, master weights, optimizer state, activations, workspaces; and the total;
//   2. the largest micro-batch whose table fits a given memory;
//   (1 and 2 open the printout as its answer, three lines: fits or not, the bytes per rank, the largest
//   micro-batch; the tables after them are the why);
//   3. FLOPs per token and per step, and the step time and tokens/s they predict at a given MFU;
//   4. next to ours, the closed-form accounting of the literature, and the difference line by line:
//        model states (Rajbhandari et al. 2020, "ZeRO"): with N parameters, AdamW keeps per parameter
//          fp32 training         4 (weights) + 4 (grads) + 8 (m, v)                      = 16 N
//          mixed precision       2 (weights) + 2 (grads) + 12 (fp32 master, m, v: "K=12") = 16 N
//        and ZeRO stage 1 divides the K N term by the ranks Nd, stage 2 also the gradients, stage 3
//        also the weights;
//        activations (Korthikanti et al. 2022, "Reducing activation recomputation"): L transformer
//        layers keep s b h L (34 + 5 a s / h) bytes (s sequence, b micro-batch, h width, a heads;
//        16-bit values, 1-byte dropout masks), 34 s b h L with selective recompute (the attention
//        core recomputed), 2 s b h L with full recompute (only each layer's input kept).
//   5. on a process grid (--tensor-parallel, --pipeline-parallel, --zero 2|3), every rank's memory
//      from its own slice's table, and the pipeline bubble; for the CPU trainer also the bytes each
//      rank sends per step to each of its groups, from the lessons' arithmetic (llmc/parallel/zero.h,
//      llmc/parallel/tensor_parallel.h, llmc/parallel/pipeline_parallel.h): a CPU run on that grid reports what it
//      measured against exactly these numbers.
// docs/memory.md and docs/parallelism.md are the lessons; this file is the arithmetic. Everything
// here is a prediction: it runs no kernel and allocates nothing, and says so in what it prints.
#pragma once

#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/memory/size_table.h"
#include "llmc/run/cli.h"
#include "llmc/memory/cpu_buffers.h"
#include "llmc/io/formats.h"
#include "llmc/memory/gpu_buffers.h"
#include "llmc/model/model.h"
#include "llmc/parallel/grad_compression.h"
#include "llmc/parallel/parameter_server.h"
#include "llmc/parallel/pipeline_parallel.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/parallel/sharding.h"
#include "llmc/parallel/tensor_parallel.h"
#include "llmc/run/checkpoint.h"
#include "llmc/run/plan.h"
#include "llmc/run/step.h"
#include "llmc/parallel/zero.h"

// ==============================================================================================
// What the estimate is a function of

struct EstimateSetup {
    Trainer trainer = Trainer::GPU;     // whose size table
    GPT2Config cfg;
    int B = 1, T = 1024;                // micro-batch per rank
    int ranks = 1, zero_stage = 0;      // data parallelism
    // model parallelism: the grid is ranks x tp x pp
    int tp = 1, pp = 1;
    bool sequence_parallel = false;
    PipelineSchedule schedule = PipelineSchedule::OneFOneB;
    int virtual_stages = 1;             // interleaved: model chunks per stage (--virtual-stages)
    int dtype_bytes = 2;                // activations, weights, gradients: 2 (bf16) or 4 (fp32)
    std::string half_name = "bf16";     // the 2-byte type: bf16, or fp16 in ./train_gpt_fp16
    int recompute = 1;                  // --recompute: 0, 1, 2 (both trainers)
    Optimizer optimizer = Optimizer::AdamW;  // --optimizer (the CPU trainer's factored ones: optimizer_state.h)
    bool bf16_moments = false;               // --optimizer-state bf16 (AdamW: adamw_bf16.h, adamw_bf16.cuh)
    bool bf16_stash = false;                 // --stash-precision bf16 (CPU trainer, llmc/memory/stash_precision.h)
    bool fp8_stash = false;                  // --stash-precision fp8 (GPU trainer, llmc/memory/stash_precision.cuh)
    int offload_chunk_kib = 0;               // --offload-dir (CPU trainer): m and v on disk, in chunks of this
    GradCompressionSettings compression;  // --grad-compression (llmc/parallel/grad_compression.h)
    bool parameter_server = false;        // --data-parallel server (the CPU trainer's; llmc/parallel/parameter_server.h)
    MoEConfig moe;                        // --moe-experts, --moe-every (the CPU trainer's; llmc/model/model.h)
    int moe_top_k = 1;                    // --moe-top-k
    int expert_parallel = 1;              // --expert-parallel (the CPU trainer's; llmc/parallel/expert_parallel.h)
    // the GPU trainer's choices
    bool master_weights = true;
    bool offload_optimizer = false;     // --offload optimizer
    bool offload_delay = false;         // --offload-delay 1: a second bf16 array on the host
    int fp8_history = 0;                // --precision fp8: its amax history's steps (0: no fp8)
    bool simple_attention = false;
    // what to predict
    int64_t tokens_per_step = 0;        // all ranks together, accumulation included
    double memory_budget_bytes = 0;     // per rank, for the largest micro-batch
    std::string budget_source;
    double mfu = 0.4;                   // model FLOPs utilisation assumed for the step time
    double peak_flops = 0;              // per rank, FLOP/s (0: no step time)
    std::string peak_source;
};

// The grid: `ranks` data-parallel ranks of tp x pp; rank r of it (r < estimate_world(e)).
inline int estimate_world(const EstimateSetup& e) { return e.ranks * e.tp * e.pp; }
inline ProcessGrid estimate_grid(const EstimateSetup& e, int rank) {
    ProcessGrid g;
    make_grid(estimate_world(e), rank, e.tp, e.pp, e.ranks, e.zero_stage, e.sequence_parallel, &g);
    return g;
}
// Micro-batches per step of one data-parallel rank (a pipeline's m).
inline int estimate_micro_batches(const EstimateSetup& e, int B) {
    return (int)std::max<int64_t>(1, e.tokens_per_step / ((int64_t)B * e.T * e.ranks));
}

// The GPU trainer's shape for rank `rank` of the grid with micro-batch B: its slice, its ZeRO share
// (ZeRO-1: master, m, v of its shard only) and, in a pipeline, the micro-batches its stage keeps.
inline GPURunShape estimate_gpu_shape(const EstimateSetup& e, int B, int rank) {
    ProcessGrid g = estimate_grid(e, rank);
    GPURunShape s = gpu_run_shape(e.cfg, B, e.T, e.recompute, e.master_weights, e.simple_attention, e.dtype_bytes, g);
    gpu_pipeline_shape(&s, e.schedule, estimate_micro_batches(e, B), e.virtual_stages);
    s.offload_optimizer = e.offload_optimizer;
    s.bf16_moments = e.bf16_moments;
    s.optimizer = e.optimizer;  // --optimizer adafactor | sm3 (llmc/optim/adafactor.cuh, sm3.cuh)
    s.moe = e.moe;  // --moe-experts (llmc/model/moe_gpu.cuh)
    s.moe_top_k = e.moe_top_k;
    s.expert_parallel = e.expert_parallel;  // (llmc/parallel/expert_parallel.cuh)
    s.expert_rank = g.dp_rank % e.expert_parallel;  // (consecutive data-parallel ranks form an expert group)
    GradCompressionSizes z = grad_compression_gpu_sizes(e.compression, e.cfg, g.dp);  // (llmc/parallel/grad_compression.cuh)
    s.compression_state = z.state;
    s.compression_work = z.work;
    s.fp8_history = e.fp8_history;
    s.fp8_stash = e.fp8_stash;
    return s;
}

// The CPU trainer's shape for rank `rank` of the grid with micro-batch B: what build_model allocates
// from (its `predicted` setup) and what --estimate prints, so the two cannot drift apart.
inline CPURunShape estimate_cpu_shape(const EstimateSetup& e, int B, int rank) {
    CPURunShape s = cpu_run_shape(e.cfg, B, e.T, estimate_grid(e, rank), e.schedule, estimate_micro_batches(e, B), e.recompute,
                                  e.virtual_stages);
    s.optimizer = e.optimizer;
    s.bf16_moments = e.bf16_moments;
    s.bf16_stash = e.bf16_stash;
    s.compression = e.compression;
    s.moe = e.moe;
    s.moe_top_k = e.moe_top_k;
    s.expert_parallel = e.expert_parallel;
    s.expert_rank = s.rank % e.expert_parallel;  // (consecutive data-parallel ranks form an expert group)
    s.offload_chunk_kib = e.offload_chunk_kib;
    return s;
}

// The trainer's own size table for rank `rank` with micro-batch B. Rank 0 holds the most: ZeRO's
// shards are equal but the last, which also carries the padding that belongs to no parameter (and
// rank 0 is the first pipeline stage, which keeps the most micro-batches in flight).
inline std::vector<BufferSpec> estimate_table(const EstimateSetup& e, int B, int rank) {
    if (e.trainer == Trainer::GPU) return gpu_buffer_table(estimate_gpu_shape(e, B, rank));
    return cpu_buffer_table(estimate_cpu_shape(e, B, rank));
}

// Bytes rank `rank` sends per step to each of its groups: data, tensor, pipeline, and the world
// (the step's loss and gradient norm), by llmc/parallel/comm.h's ring convention. What the CPU trainer
// counts while it runs, and reports next to these.
struct CommEstimate {
    uint64_t bytes[4] = {0, 0, 0, 0};
};
inline const char* comm_group_name(int i) {
    static const char* names[4] = {"data", "tensor", "pipeline", "world"};
    return names[i];
}

inline CommEstimate estimate_comm(const EstimateSetup& e, int rank) {
    CommEstimate c;
    ProcessGrid g = estimate_grid(e, rank);
    ModelSlice s = model_slice(e.cfg, g);
    ParamLayout layout = slice_layout(e.cfg, s);
    int m = estimate_micro_batches(e, e.B);
    size_t rows = (size_t)e.B * e.T, sp = g.sequence_parallel ? g.tp : 1;
    c.bytes[0] = e.parameter_server ? parameter_server_bytes(layout.total, g.dp, g.dp_rank)
               : e.compression.kind != GradCompressionKind::None
                     ? grad_compression_bytes(e.compression, e.cfg, g.dp)    // (PowerSGD: after its start step)
               : e.optimizer != Optimizer::AdamW && g.zero_stage == 1      // whole blocks per rank
                     ? factored_zero1_comm_bytes(e.cfg, g.dp, g.dp_rank)
                     : zero_comm_bytes(g.zero_stage, model_units(layout, s.num_layers), layout.total, g.dp, m);
    c.bytes[1] = tp_comm_bytes(g.tp, g.sequence_parallel, rows, e.cfg.channels, s.num_layers, s.first_stage, s.last_stage, m,
                               g.zero_stage) +
                 factored_tp_comm_bytes(e.cfg, s, e.optimizer);  // a factored optimizer's cut blocks' statistics
    c.bytes[2] = pipe_comm_bytes(g.pp_rank, g.pp, m, rows / sp * e.cfg.channels, (size_t)s.vocab_rows * e.cfg.channels,
                                 e.virtual_stages);
    c.bytes[3] = g.world > 1 ? 2 * (uint64_t)(g.world - 1) * sizeof(double) : 0;  // two comm_sum's of one double
    MoELayout moe = moe_layout(e.cfg, e.moe, moe_held_experts(e.moe, e.expert_parallel, g.dp_rank % e.expert_parallel));
    // --grad-compression bf16: the same exchange of padded shards (an all-to-all for the reduce-scatter), 2 bytes a value
    uint64_t value_bytes = e.compression.kind == GradCompressionKind::BF16 ? sizeof(uint16_t) : sizeof(float);
    auto identical_sum = [value_bytes](size_t n, int N) {  // comm_allreduce_sum_identical: a reduce-scatter and an all-gather of padded shards
        return N > 1 && n > 0 ? 2 * (uint64_t)(N - 1) * ((n + N - 1) / N) * value_bytes : 0;
    };
    if (e.expert_parallel == 1) c.bytes[0] += identical_sum(moe.total, g.dp);  // the MoE table's gradient
    else  // --expert-parallel: the routers' over every rank, the held experts' over their replicas (counted as data)
        c.bytes[0] += identical_sum(moe.count[MOE_ROUTER], g.dp) + identical_sum(moe.total - moe.count[MOE_ROUTER], g.dp / e.expert_parallel);
    if (e.moe.experts > 0 && g.world > 1)  // the routing statistics: three comm_sum's, a maximum of two floats
        c.bytes[3] += 3 * (uint64_t)(g.world - 1) * sizeof(double) + 2 * (uint64_t)(g.world - 1) * 2 * sizeof(float) / g.world;
    return c;
}

// --expert-parallel: what one rank's all-to-alls send a step (llmc/parallel/expert_parallel.h's
// arithmetic). The counts are exact: per MoE block and micro-batch E/N_ep ints to each other rank of
// the group. The rows depend on the router: a row that leaves the rank leaves 4 times (dispatch,
// combine, the output gradient out, the input gradient back), C values each; at most all k B T of a
// micro-batch leave, (N_ep - 1)/N_ep of them when the router spreads evenly.
struct ExpertParallelBytes {
    uint64_t counts = 0, rows_at_most = 0, rows_even = 0, calls = 0;
};
inline ExpertParallelBytes estimate_expert_parallel_bytes(const EstimateSetup& e) {
    ExpertParallelBytes b;
    int N = e.expert_parallel;
    if (N <= 1 || e.moe.experts == 0) return b;
    uint64_t blocks = (uint64_t)moe_block_count(e.moe, e.cfg.num_layers) * estimate_micro_batches(e, e.B);
    // (a value: the CPU's fp32, the GPU's bf16, expert_parallel.cuh: 2 bytes)
    uint64_t row_bytes = 4 * (uint64_t)e.cfg.channels * (uint64_t)e.dtype_bytes, rows = (uint64_t)e.moe_top_k * e.B * e.T;
    b.counts = blocks * (uint64_t)(N - 1) * (e.moe.experts / N) * sizeof(int);
    b.rows_at_most = blocks * rows * row_bytes;
    b.rows_even = blocks * (rows * (N - 1) / N) * row_bytes;
    b.calls = blocks * 5;  // the counts, then the rows out and back, forward and backward
    return b;
}

inline size_t estimate_granule(const EstimateSetup& e) {
    return e.trainer == Trainer::CPU ? CPU_ALLOCATION_GRANULE : GPU_ALLOCATION_GRANULE;
}

// Memory a rank needs beyond its table: on the GPU, room for the CUDA context and libraries.
inline size_t estimate_overhead(const EstimateSetup& e) { return e.trainer == Trainer::CPU ? 0 : GPU_MEMORY_MARGIN_BYTES; }

struct MemoryByKind {
    size_t bytes[MEM_KINDS] = {};
    size_t total = 0;
};

inline MemoryByKind memory_by_kind(const std::vector<BufferSpec>& table, size_t granule) {
    MemoryByKind m;
    for (const BufferSpec& b : table) {
        size_t bytes = allocated_bytes(b, granule);
        m.bytes[b.kind] += bytes;
        m.total += bytes;
    }
    return m;
}

// Whether rank 0's table with micro-batch B fits in `budget` bytes. On the GPU this is the very test
// the trainer applies before it allocates (gpu_batch_fits), so the two cannot disagree.
inline bool estimate_fits(const EstimateSetup& e, int B, double budget) {
    if (budget <= 0) return false;
    size_t bytes = (size_t)std::min(budget, 1e19);  // (a budget beyond size_t is no budget at all)
    if (e.trainer == Trainer::GPU) return gpu_batch_fits(estimate_gpu_shape(e, B, 0), B, bytes);
    return memory_by_kind(estimate_table(e, B, 0), estimate_granule(e)).total <= bytes;
}

constexpr int ESTIMATE_MAX_BATCH = 1 << 20;

inline int estimate_largest_batch(const EstimateSetup& e, double budget) {
    return largest_fitting_batch([&](int b) { return estimate_fits(e, b, budget); }, ESTIMATE_MAX_BATCH);
}

// ==============================================================================================
// Will this run fit? The check both trainers make before their first large allocation, from the
// same tables: a run that cannot fit must be refused in one line, not die in std::bad_alloc or be
// killed by the kernel's OOM killer minutes later with no message.

// The most bytes any rank of the grid needs with micro-batch B (and which rank): every rank's table
// (the stages of a pipeline and the last ZeRO shard differ).
inline size_t estimate_busiest_rank(const EstimateSetup& e, int B, int* busiest) {
    size_t most = 0;
    for (int r = 0; r < estimate_world(e); r++) {
        size_t need = memory_by_kind(estimate_table(e, B, r), estimate_granule(e)).total + estimate_overhead(e);
        if (need > most) most = need, *busiest = r;
    }
    return most;
}

// The host's RAM, all of it (--estimate's and --plan's budget on the CPU trainer unless told another).
inline double host_ram_bytes() { return (double)sysconf(_SC_PHYS_PAGES) * (double)sysconf(_SC_PAGE_SIZE); }

// The host's MemAvailable (/proc/meminfo: free memory plus what the kernel can reclaim without
// swapping), in bytes; 0 where it cannot be read (then no limit is applied).
inline double host_memory_available_bytes() {
    FILE* f = fopen("/proc/meminfo", "r");
    if (!f) return 0;
    char line[256];
    double kib = 0;
    while (fgets(line, sizeof(line), f))
        if (sscanf(line, "MemAvailable: %lf kB", &kib) == 1) break;
    fclose(f);
    return kib * 1024.0;
}

// "" when every rank's table fits in `limit_bytes`, else the one line that refuses the run: the
// need, the limit (`limit_source` names it, with its size), and the largest micro-batch that fits.
inline std::string memory_refusal(const EstimateSetup& e, double limit_bytes, const std::string& limit_source) {
    int busiest = 0;
    size_t need = estimate_busiest_rank(e, e.B, &busiest);
    if (limit_bytes <= 0 || (double)need <= limit_bytes) return "";
    int ignored = 0;
    int fits = largest_fitting_batch([&](int b) { return (double)estimate_busiest_rank(e, b, &ignored) <= limit_bytes; }, e.B);
    std::string advice = fits > 0 ? strprintf("the largest micro-batch that fits is --batch-size %d (--total-batch-tokens keeps "
                                              "the tokens per step)", fits)
                                  : std::string("not even --batch-size 1 fits: use a smaller model or shard it "
                                                "(--zero 3, --tensor-parallel, --pipeline-parallel)");
    std::string where = estimate_world(e) > 1 ? strprintf(" on rank %d", busiest) : std::string();
    return strprintf("this run (B=%d, T=%d) needs %s%s, more than %s: %s; --estimate shows every buffer", e.B, e.T,
                     format_bytes((double)need).c_str(), where.c_str(), limit_source.c_str(), advice.c_str());
}

// ==============================================================================================
// Compute: FLOPs and the time they take at a given MFU

struct ComputeEstimate {
    double flops_per_token = 0;     // 6N + 6LCT (llmc/model/model.h): forward 2, backward 4 per parameter, plus attention
    double flops_per_step = 0;      // x tokens per step, all ranks together
    double step_seconds = 0;        // at mfu x peak on every rank (0 when no peak is known)
    double tokens_per_second = 0;
};

inline ComputeEstimate estimate_compute(const EstimateSetup& e) {
    ComputeEstimate c;
    c.flops_per_token = flops_per_token(e.cfg, e.T);
    c.flops_per_step = c.flops_per_token * (double)e.tokens_per_step;
    if (e.peak_flops > 0 && e.mfu > 0) {
        c.step_seconds = c.flops_per_step / (e.ranks * e.peak_flops * e.mfu);
        c.tokens_per_second = (double)e.tokens_per_step / c.step_seconds;
    }
    return c;
}

// ==============================================================================================
// The literature's closed forms

// Parameters of a GPT-2-style model as the papers count them: the REAL vocabulary V (ours pads it
// to Vp), learned positions, L blocks of 12h^2 + 13h (four h x h matrices' worth in attention, eight
// in the MLP, and their biases and LayerNorms), the final LayerNorm; an untied output layer adds V h.
inline double literature_param_count(double V, double max_T, double L, double h, bool tied_head) {
    return V * h + max_T * h + L * (12 * h * h + 13 * h) + 2 * h + (tied_head ? 0 : V * h);
}

// Bytes per parameter of the model states ("model states" in the ZeRO paper).
struct StateBytes {
    const char* name;
    double params, grads, master, optimizer;  // optimizer: AdamW's m and v
    double total() const { return params + grads + master + optimizer; }
};

// The accountings that circulate, term by term:
//   fp32 Adam        everything fp32: 4 + 4 + 0 + 8
//   mixed, ZeRO      Rajbhandari et al.: 16-bit weights and grads, fp32 master + m + v (K = 12)
//   mixed, fp32 grads  the "18N" variant: gradients kept (accumulated) in fp32: 2 + 4 + 4 + 8
//   no master        the "12N" variant: 16-bit weights updated in place, fp32 m and v: 2 + 2 + 0 + 8
//                    (our GPU trainer with --master-weights 0). "12N" is also quoted for the ZeRO
//                    paper's K term alone (master + m + v), the part stage 1 shards: the same number
//                    for different terms, which is why it says nothing without them.
inline std::vector<StateBytes> literature_state_variants() {
    return {{"fp32 AdamW (4+4+8)", 4, 4, 0, 8},
            {"mixed precision, ZeRO's 2+2+K, K=12", 2, 2, 4, 8},
            {"mixed precision, fp32 grads (18N)", 2, 4, 4, 8},
            {"16-bit weights, no master (12N)", 2, 2, 0, 8}};
}

// Per-rank bytes of the model states under ZeRO stage `stage` with Nd ranks (Rajbhandari et al.):
//   stage 0  (p + g + k) N          every rank keeps everything
//   stage 1  (p + g) N + k N / Nd   optimizer state (master, m, v) sharded
//   stage 2  p N + (g + k) N / Nd   ... and the reduced gradients
//   stage 3  (p + g + k) N / Nd     ... and the weights (gathered layer by layer when needed)
inline double zero_state_bytes(const StateBytes& b, double N, int stage, int Nd) {
    double k = b.master + b.optimizer;
    if (stage <= 0) return (b.params + b.grads + k) * N;
    if (stage == 1) return (b.params + b.grads) * N + k * N / Nd;
    if (stage == 2) return b.params * N + (b.grads + k) * N / Nd;
    return (b.params + b.grads + k) * N / Nd;
}

// Korthikanti et al.: activation bytes of L transformer layers, 16-bit values and 1-byte masks.
enum class PaperRecompute { None, Selective, Full };
inline double korthikanti_activation_bytes(double s, double b, double h, double a, double L, PaperRecompute r) {
    if (r == PaperRecompute::Full) return 2 * s * b * h * L;
    if (r == PaperRecompute::Selective) return 34 * s * b * h * L;
    return s * b * h * L * (34 + 5 * a * s / h);
}

// Numbers as people read them: 124,475,904.
inline std::string with_commas(double v) {
    std::string digits = strprintf("%.0f", std::fabs(v)), out;
    for (size_t i = 0; i < digits.size(); i++) {
        if (i > 0 && (digits.size() - i) % 3 == 0) out += ',';
        out += digits[i];
    }
    return (v < 0 ? "-" : "") + out;
}

inline std::string with_commas_signed(double v) { return (v >= 0 ? "+" : "") + with_commas(v); }

// ==============================================================================================
// Side by side: the paper's activation terms against the rows of our table, line by line.
//
// Per layer the paper keeps (bytes, 16-bit): LayerNorm 1 input 2sbh, its output 2sbh, Q K V 6sbh,
// softmax output 2as^2b + its dropout mask as^2b + dropout output 2as^2b, attention output 2sbh,
// two dropout masks sbh + sbh, LayerNorm 2 input 2sbh and output 2sbh, GELU input 8sbh and output
// 8sbh: 34sbh + 5as^2b. Each line below is one of those terms (or something the paper leaves out)
// next to the rows of our table that hold it. The "ours" column sums to our activations exactly,
// and the "paper" column to the formula: the differences are all accounted for.

struct ActivationLine {
    const char* term;
    double paper = 0;       // bytes the paper counts for this term (L layers)
    size_t ours = 0;        // bytes of our rows that hold it
    std::string rows;       // which rows
    std::string why;        // the difference, in words
};

// The rows of both tables, by the paper's term they hold (a row appears in exactly one line).
struct ActivationTerm {
    const char* term;
    double sbh, as2b;             // the paper's bytes per layer: sbh * s b h + as2b * a s^2 b
    std::vector<std::string> rows;
};

inline const std::vector<ActivationTerm>& activation_terms() {
    static const std::vector<ActivationTerm> terms = {
        {"block input (LayerNorm 1 input)", 2, 0, {"residual", "encoded", "residual3"}},
        {"LayerNorm 1 output (QKV input)", 2, 0, {"ln1"}},
        {"Q, K, V", 6, 0, {"qkv"}},
        {"softmax output + dropout mask + dropout output", 0, 5, {"att", "att_stats"}},
        {"attention output (projection input)", 2, 0, {"atty"}},
        {"dropout masks after attention and MLP", 2, 0, {}},
        {"LayerNorm 2 input (residual after attention)", 2, 0, {"residual2"}},
        {"LayerNorm 2 output (MLP input)", 2, 0, {"ln2"}},
        {"GELU input (fc output)", 8, 0, {"fch"}},
        {"GELU output (fc projection input)", 8, 0, {"fch_gelu"}},
        {"LayerNorm statistics (mean, 1/std)", 0, 0, {"ln1_mean", "ln1_rstd", "ln2_mean", "ln2_rstd"}},
        {"after the blocks: final LayerNorm, logits, loss", 0, 0,
         {"lnf", "lnf_mean", "lnf_rstd", "logits", "losses", "logsumexp"}},
        {"ZB-H1: what the deferred weight gradients read", 0, 0, {"weight_stash"}},
        {"MoE blocks: the router's and the experts' rows", 0, 0, {"moe_activations", "moe_routing"}},
        {"fp8 stash: each stashed tensor's amax", 0, 0, {"stash_amax"}},
    };
    return terms;
}

// Which line holds the row `name`, or -1 (tests check every activation row has exactly one).
inline int activation_term_of(const std::string& name) {
    const std::vector<ActivationTerm>& terms = activation_terms();
    for (size_t i = 0; i < terms.size(); i++)
        for (const std::string& r : terms[i].rows)
            if (r == name) return (int)i;
    return -1;
}

inline std::vector<ActivationLine> activation_lines(const EstimateSetup& e, const std::vector<BufferSpec>& table) {
    double s = e.T, b = e.B, h = e.cfg.channels, a = e.cfg.num_heads, L = e.cfg.num_layers;
    std::string width = e.dtype_bytes == 4 ? "fp32" : e.half_name;
    std::vector<ActivationLine> lines;
    for (const ActivationTerm& t : activation_terms()) {
        ActivationLine line;
        line.term = t.term;
        line.paper = (t.sbh * s * b * h + t.as2b * a * s * s * b) * L;
        for (const BufferSpec& row : table) {
            if (row.kind != MEM_ACTIVATIONS || activation_term_of(row.name) != (int)lines.size()) continue;
            line.ours += allocated_bytes(row, estimate_granule(e));
            if (row.bytes() > 0) line.rows += std::string(line.rows.empty() ? "" : " ") + row.name;
        }
        lines.push_back(line);
    }
    // the reasons, in the order of the lines
    bool cudnn = e.trainer == Trainer::GPU && !e.simple_attention;
    RecomputePlan keep = recompute_plan(e.recompute);
    std::string values = e.dtype_bytes == 2 ? "the same (" + e.half_name + ": 2 bytes per value)"
                                            : "fp32: 4 bytes per value, the paper's 2";
    lines[0].why = "L+1 slices: the last block's output is kept too, as the final LayerNorm's input; " + values;
    lines[1].why = keep.ln ? values : "--recompute 2: recomputed in the backward from the block input and the saved statistics";
    lines[2].why = values;
    lines[3].why = cudnn ? "flash attention (cuDNN) keeps only the softmax's log-sum-exp, fp32, one per row and head, "
                           "and recomputes the scores in the backward"
                         : strprintf("the probabilities, materialised (L, B, NH, T, T) in %s; no dropout, so no mask "
                                     "and no second copy", width.c_str());
    lines[4].why = values;
    lines[5].why = "GPT-2 here trains without dropout: no masks";
    lines[6].why = values;
    lines[7].why = keep.ln ? values : "--recompute 2: recomputed from the residual and the saved statistics";
    lines[8].why = values;
    lines[9].why = keep.gelu ? values : "--recompute >= 1: recomputed as GELU(fch), one layer at a time, in the backward";
    lines[10].why = "two fp32 per row and LayerNorm, so the backward needs no reduction to recover them; the paper "
                    "recomputes them";
    if (e.bf16_stash) {  // llmc/memory/stash_precision.h: their layer's fp32 scratch is in the workspace
        std::string stashed = "bf16 stash (--stash-precision bf16): 2 bytes per value, the paper's; one layer in fp32 in the workspace";
        for (int i : {1, 2, 4, 7, 8, 9})
            if (lines[(size_t)i].ours > 0) lines[(size_t)i].why = stashed;
        lines[3].why = "the probabilities, materialised (L, B, NH, T, T) in bf16 (the stash; one layer in fp32 in the "
                       "workspace); no dropout, so no mask and no second copy";
    }
    if (e.fp8_stash) {  // llmc/memory/stash_precision.cuh: their layer in the build's type is in the workspace
        std::string stashed = "fp8 stash (--stash-precision fp8): e4m3, 1 byte per value, half the paper's; one layer in "
                              "the build's type in the workspace";
        for (int i : {1, 2, 3, 4, 7, 8, 9})
            if (lines[(size_t)i].ours > 0 && !(i == 3 && cudnn)) lines[(size_t)i].why = stashed;
    }
    lines[11].why = strprintf("outside the per-layer formula (the paper counts fp32 logits there): our logits (B, T, Vp) "
                              "are %s and overwritten in place by their gradient; the probabilities are never stored%s",
                              width.c_str(), e.trainer == Trainer::GPU ? " (fused classifier)" : " (one log-sum-exp per row)");
    lines[12].why = "a pipeline schedule, not a layer's: each block matmul's output gradient from B to W, s + 1 "
                    "micro-batches on stage s > 0 (its inputs stay in the slot rows above, parked: llmc/model/"
                    "zero_bubble_backward.h); 0 with the other schedules";
    lines[13].why = "outside the dense formula: each MoE block's routing (logits, probabilities, choices) and the k B T "
                    "rows its experts gather, with their fc, GELU and gradient rows (llmc/model/moe.h); 0 without --moe-experts";
    lines[14].why = "the source of each stashed tensor's scale, 7 per layer (llmc/memory/stash_precision.cuh); 0 without "
                    "--stash-precision fp8";
    return lines;
}

// The same for the model states: the literature's bytes for OUR precision choices (so that what is
// left of the difference is structural), next to the table's, with the parts of the difference.
struct StateLine {
    const char* kind;
    double literature = 0;      // per rank: bytes per parameter x N (/ ranks where ZeRO shards it)
    size_t ours = 0;
    double vocab_padding = 0;   // our Vp - V padded vocabulary rows (zero weights, never in the loss)
    double shard_padding = 0;   // values that pad the flat array to equal shards (or rank 0's shard vs N/ranks)
    double extra = 0;           // rows the literature has no term for (the CPU's gradient shard, PowerSGD's state)
    std::string extra_why;      // what `extra` is
    std::string why;
    double moe_table = 0;       // --moe-experts: the MoE table's rows of this kind
};

inline std::vector<StateLine> state_lines(const EstimateSetup& e, const std::vector<BufferSpec>& table) {
    const GPT2Config& c = e.cfg;
    bool cpu = e.trainer == Trainer::CPU;
    double N = literature_param_count(c.vocab_size, c.max_seq_len, c.num_layers, c.channels, true);
    double P = (double)param_layout(c).total;  // = N + vocab_pad
    double vocab_pad = (double)(c.padded_vocab_size - c.vocab_size) * c.channels;
    ShardLayout shards = shard_layout(param_layout(c).total, e.ranks);
    // params and grads: padded to equal shards (llmc/parallel/sharding.h)
    double flat_pad = (double)(shards.padded_total - shards.total);
    // optimizer state: all P values, or (ZeRO-1) rank 0's shard, against the literature's N / ranks
    double Nd = e.zero_stage == 1 ? e.ranks : 1;
    double opt_values = e.zero_stage == 1 ? (double)owned_range(shards, 0).size() : P;
    double opt_pad = opt_values - P / Nd;
    double w = e.dtype_bytes;
    double master = !cpu && e.dtype_bytes == 2 && e.master_weights ? 4 : 0;
    MemoryByKind ours = memory_by_kind(table, estimate_granule(e));

    std::vector<StateLine> lines(4);
    lines[0] = {"params", w * N, ours.bytes[MEM_PARAMS], w * vocab_pad, w * flat_pad, 0, "", ""};
    // the CPU's grad_shard, the reduce-scatter's output (none with one rank: nothing to sum)
    double grad_shard = cpu && e.ranks > 1 ? 4.0 * shards.shard_size : 0;
    lines[1] = {"grads", w * N, ours.bytes[MEM_GRADS], w * vocab_pad, w * flat_pad, grad_shard,
                "grad_shard, the reduce-scatter's output (this rank's shard of the sum)", ""};
    lines[2] = {"master", master * N / Nd, ours.bytes[MEM_MASTER], master * vocab_pad / Nd, master * opt_pad, 0, "", ""};
    // --grad-compression powersgd's error feedback and Q are optimizer-like state the literature's 16N has no term for
    double compression_state = 0;
    for (const BufferSpec& b : table) {
        if (std::string(b.name) == "compression_state") compression_state += (double)allocated_bytes(b, estimate_granule(e));
    }
    lines[3] = {"optimizer", 8 * N / Nd, ours.bytes[MEM_OPTIMIZER], 8 * vocab_pad / Nd, 8 * opt_pad, compression_state,
                "compression_state, PowerSGD's error feedback and Q (llmc/parallel/grad_compression.h)", ""};
    if (e.zero_stage >= 2) {
        // ZeRO-2/3: each unit (llmc/parallel/zero.h) is cut into equal shards; rank 0's shards are full, the
        // padding falls on the last rank. The gradient (and at stage 3 the weights) is sharded too.
        double R = e.ranks;
        lines[0] = {"params", w * N / (e.zero_stage == 3 ? R : 1), ours.bytes[MEM_PARAMS], w * vocab_pad / (e.zero_stage == 3 ? R : 1), 0, 0, "", ""};
        lines[1] = {"grads", w * N / R, ours.bytes[MEM_GRADS], w * vocab_pad / R, 0, 0, "", ""};
        lines[2] = {"master", master * N / R, ours.bytes[MEM_MASTER], master * vocab_pad / R, 0, 0, "", ""};
        lines[3] = {"optimizer", 8 * N / R, ours.bytes[MEM_OPTIMIZER], 8 * vocab_pad / R, 0, 0, "", ""};
        for (int i : {0, 1, 2, 3}) {
            StateLine& l = lines[(size_t)i];
            l.shard_padding = (double)l.ours - l.literature - l.vocab_padding;  // all of the rest: the units' shards
        }
    }
    // --moe-experts: the MoE table's rows (moe_params, moe_grads, moe_adam_m/v) are parameters N does not count
    const MemoryKind line_kind[4] = {MEM_PARAMS, MEM_GRADS, MEM_MASTER, MEM_OPTIMIZER};
    for (int i = 0; i < 4; i++)
        for (const BufferSpec& b : table)
            if (std::string(b.name).rfind("moe_", 0) == 0 && b.kind == line_kind[i])
                lines[(size_t)i].moe_table += (double)allocated_bytes(b, estimate_granule(e));
    for (StateLine& l : lines) {
        std::vector<std::string> parts;
        if (l.moe_table != 0) parts.push_back(strprintf("%s the MoE table (routers, experts 1..E-1: not in N)",
                                                        with_commas_signed(l.moe_table).c_str()));
        if (l.vocab_padding != 0) parts.push_back(strprintf("%s padded vocabulary ((Vp-V)*C = %s values)",
                                                              with_commas_signed(l.vocab_padding).c_str(), with_commas(vocab_pad).c_str()));
        if (l.shard_padding != 0) parts.push_back(strprintf("%s padding to equal shards", with_commas_signed(l.shard_padding).c_str()));
        if (l.extra != 0) parts.push_back(strprintf("%s %s", with_commas_signed(l.extra).c_str(), l.extra_why.c_str()));
        double rest = (double)l.ours - l.literature - l.vocab_padding - l.shard_padding - l.extra - l.moe_table;
        if (std::fabs(rest) >= 0.5) parts.push_back(strprintf("%s other (allocator rounding)", with_commas_signed(rest).c_str()));
        for (size_t i = 0; i < parts.size(); i++) l.why += (i ? "; " : "") + parts[i];
        if (l.why.empty()) l.why = l.ours == 0 ? "none" : "the same";
    }
    if (e.bf16_moments) {
        lines[3].why = strprintf("m and v in bf16 (--optimizer-state bf16): %.4f bytes per parameter against 8",
                                 ours.bytes[MEM_OPTIMIZER] / N);
    }
    if (e.offload_chunk_kib > 0 && e.optimizer == Optimizer::AdamW) {
        lines[3].why = strprintf("m and v on disk (--offload-dir): two %d KiB chunks of each in RAM, %d bytes per parameter "
                                 "on disk", e.offload_chunk_kib, e.bf16_moments ? 4 : 8);
    }
    if (e.optimizer != Optimizer::AdamW) {
        lines[3].why = strprintf("%s instead of AdamW: rows + columns per matrix, one per element of a vector "
                                 "(%.4f bytes per parameter against AdamW's 8)", optimizer_name((int)e.optimizer),
                                 ours.bytes[MEM_OPTIMIZER] / N);
    }
    if (cpu || e.dtype_bytes == 4) lines[2].why = "none: fp32 weights are their own master copy";
    else if (!e.master_weights) lines[2].why = "none: --master-weights 0 updates the bf16 weights in place";
    return lines;
}

// ==============================================================================================
// From the command line

// The model's shape without loading its weights: a descriptor, or a model file's header.
inline GPT2Config estimate_config(const TrainOptions& o) {
    GPT2Config cfg;
    std::string resume_dir = resolve_resume_dir(o);
    if (resume_dir.empty() && parse_model_descriptor(o.model, &cfg)) {
        std::string why;
        if (!config_is_valid(cfg, &why)) usage_fail("--model %s: %s", o.model.c_str(), why.c_str());
        return cfg;
    }
    std::string path = resume_dir.empty() ? o.model : resume_dir + "/model.bin";
    if (!file_exists(path)) fail("--model '%s' is neither a model file nor a descriptor (d12, d24, L=2,C=64,H=4, ...)", path.c_str());
    return read_model_header(path, o.moe_experts > 0).config;  // (--moe-*: a version-7 file's shape; the flags size its table)
}

// --precision fp8's amax history (llmc/kernels/fp8.cuh), 0 without fp8: the GPU trainer's size table reads it
// from here, for --estimate and for its own run (train_gpt.cu's gpu_run_shape calls).
inline int fp8_history_of(const TrainOptions& o) {
    return o.precision != "fp8" ? 0 : o.fp8_amax_history ? o.fp8_amax_history : FP8_AMAX_HISTORY;
}

// The flags' techniques, as sizes see them: the one translation from TrainOptions, used by --estimate
// (estimate_setup below) and by the CPU trainer's own run (its `predicted` setup, which build_model
// allocates from). A technique that changes what is allocated adds its field here and in
// estimate_cpu_shape, and nowhere else.
inline void estimate_take_techniques(EstimateSetup* e, const TrainOptions& o) {
    e->recompute = o.recompute;
    parse_optimizer(o.optimizer, &e->optimizer);
    e->bf16_moments = o.optimizer_state == "bf16";
    e->bf16_stash = o.stash_precision == "bf16";
    e->fp8_stash = o.stash_precision == "fp8";
    e->offload_chunk_kib = o.offload_dir.empty() ? 0 : o.offload_chunk_kib;
    e->compression = grad_compression_settings(o);
    e->parameter_server = o.data_parallel == "server";
    e->moe = MoEConfig{o.moe_experts, o.moe_every};
    e->moe_top_k = o.moe_top_k;
    e->expert_parallel = o.expert_parallel;
    e->offload_optimizer = o.offload == "optimizer";
    e->offload_delay = o.offload_delay == 1;
    e->fp8_history = fp8_history_of(o);
}

// The setup the flags describe. The trainer passes what only it knows: its precision, whether it
// keeps master weights, its attention path.
inline EstimateSetup estimate_setup(const TrainOptions& o, Trainer trainer, int dtype_bytes, bool master_weights,
                                    bool simple_attention) {
    EstimateSetup e;
    e.trainer = trainer;
    e.cfg = estimate_config(o);
    e.ranks = o.estimate_ranks;
    e.zero_stage = o.zero_stage;
    e.tp = o.tensor_parallel;
    e.pp = o.pipeline_parallel;
    e.sequence_parallel = o.sequence_parallel;
    parse_pipeline_schedule(o.pipeline_schedule, &e.schedule);
    e.virtual_stages = o.virtual_stages;
    RunPlan plan = plan_run(o, e.cfg, e.ranks, 0);  // B, T and tokens per step, checked as the trainer checks them
    // interleaved: the layers cut into p x v chunks, the micro-batches in groups of p (the trainer's own check)
    std::string chunks = pipeline_schedule_problem(e.schedule, e.pp, plan.accumulation_steps, e.virtual_stages, e.cfg.num_layers);
    if (!chunks.empty()) usage_fail(chunks);
    e.B = plan.B, e.T = plan.T;
    e.tokens_per_step = plan.total_batch_tokens;
    e.dtype_bytes = dtype_bytes;
    estimate_take_techniques(&e, o);
    e.master_weights = master_weights;
    e.simple_attention = simple_attention;
    if (o.estimate_memory_gib > 0) {
        e.memory_budget_bytes = o.estimate_memory_gib * (double)(1ull << 30);
        e.budget_source = "--estimate-memory-gib";
    } else if (trainer == Trainer::GPU) {
        e.memory_budget_bytes = 80.0 * (1ull << 30);
        e.budget_source = "an 80 GiB GPU; --estimate-memory-gib for another";
    } else {
        e.memory_budget_bytes = host_ram_bytes();
        e.budget_source = "this machine's RAM; --estimate-memory-gib for another";
    }
    e.mfu = o.estimate_mfu;
    if (o.estimate_peak_tflops > 0) {
        e.peak_flops = o.estimate_peak_tflops * 1e12;
        e.peak_source = "--estimate-peak-tflops";
    } else if (trainer == Trainer::GPU) {
        e.peak_flops = gpu_peak_bf16_tflops("H100 SXM") * 1e12;
        e.peak_source = "H100 SXM, dense bf16 (llmc/run/step.h); --estimate-peak-tflops for another";
    }
    return e;
}

// --pipeline-print-schedule: every stage's list of actions (llmc/parallel/pipeline_schedule.h) for
// the step the flags describe. Arithmetic only, as --estimate: no MPI, no weights, no data. The
// micro-batches per step come from the batch flags and the launch's data-parallel degree (1
// outside mpirun); an impossible pipeline gets the trainer's one line and exit 2.
inline int print_pipeline_schedule(const TrainOptions& o) {
    Comm launched;
    comm_from_environment(&launched);
    GPT2Config cfg = estimate_config(o);
    int tp_pp = o.tensor_parallel * o.pipeline_parallel, dp = std::max(1, launched.world_size / tp_pp);
    RunPlan plan = plan_run(o, cfg, dp, 0);
    ProcessGrid g;
    std::string why = make_grid(dp * tp_pp, 0, o.tensor_parallel, o.pipeline_parallel, 0, o.zero_stage, o.sequence_parallel, &g);
    if (why.empty()) why = grid_problem(g, cfg, plan.B, plan.T, plan.accumulation_steps);
    PipelineSchedule kind = PipelineSchedule::OneFOneB;
    parse_pipeline_schedule(o.pipeline_schedule, &kind);
    if (why.empty()) why = pipeline_schedule_problem(kind, g.pp, plan.accumulation_steps, o.virtual_stages, cfg.num_layers);
    if (!why.empty()) usage_fail(why);
    if (launched.rank == 0)  // (2bw: its lists over three steps, across the boundaries; 2bw-flush: 1F1B's list)
        printf("%s", o.pipeline_schedule == "2bw" && g.pp > 1 ? pipeline_2bw_text(g.pp, plan.accumulation_steps).c_str()
                     : pipeline_schedule_text(kind, g.pp, plan.accumulation_steps, o.virtual_stages).c_str());
    return 0;
}

// ==============================================================================================
// The printout

inline std::string estimate_run_description(const EstimateSetup& e) {
    std::string what;
    if (e.trainer == Trainer::CPU) {
        what = e.recompute ? strprintf("CPU trainer, fp32, recompute %d", e.recompute) : "CPU trainer, fp32";
        if (e.bf16_stash) what += ", bf16 stash";
    } else {
        what = strprintf("GPU trainer, %s%s, recompute %d, %s attention", e.dtype_bytes == 2 ? e.half_name.c_str() : "fp32",
                         e.dtype_bytes == 2 ? (e.master_weights ? " with fp32 master weights" : " without master weights") : "",
                         e.recompute, e.simple_attention ? "simple" : "cuDNN");
        if (e.fp8_stash) what += ", fp8 stash";
    }
    std::string grid = e.tp > 1 || e.pp > 1 ? strprintf(" x tp %d x pp %d%s (%d ranks)", e.tp, e.pp,
                                                         e.sequence_parallel ? " sequence parallel" : "", estimate_world(e)) : "";
    std::string sum = e.compression.kind == GradCompressionKind::None ? ""
                      : e.compression.kind == GradCompressionKind::BF16 ? ", gradients summed in bf16"
                      : strprintf(", PowerSGD rank %d after step %d", e.compression.rank, e.compression.start_step);
    return strprintf("%s; B=%d T=%d; %d data-parallel rank%s%s, ZeRO-%d%s", what.c_str(), e.B, e.T, e.ranks,
                     e.ranks == 1 ? "" : "s", grid.c_str(), e.zero_stage, sum.c_str());
}

// The model and the run, in words: what the numbers below are for.
inline void print_estimate_model(const EstimateSetup& e) {
    const GPT2Config& c = e.cfg;
    size_t P = param_layout(c).total;
    printf("estimate: PREDICTED, not measured: arithmetic on the trainer's own size table; nothing was allocated or run\n");
    printf("model: %s; N = %s parameters (%s with the real vocabulary)\n", describe_config(c).c_str(),
           with_commas((double)P).c_str(),
           with_commas(literature_param_count(c.vocab_size, c.max_seq_len, c.num_layers, c.channels, true)).c_str());
    if (e.moe.experts > 0) {
        size_t total = P + moe_layout(c, e.moe).total;
        printf("mixture of experts: %d of %d blocks, %d experts, top-%d: %s parameters in all (the %s above + the MoE table's "
               "%s), %s active per token\n", moe_block_count(e.moe, c.num_layers), c.num_layers, e.moe.experts, e.moe_top_k,
               with_commas((double)total).c_str(), with_commas((double)P).c_str(), with_commas((double)(total - P)).c_str(),
               with_commas((double)moe_active_params(c, e.moe, e.moe_top_k)).c_str());
    }
    printf("run: %s\n", estimate_run_description(e).c_str());
}

// Rank 0's table, buffer by buffer, then summed by kind: model states per parameter, activations
// per token.
inline void print_estimate_memory(const EstimateSetup& e, const std::vector<BufferSpec>& table, const MemoryByKind& mem) {
    size_t P = param_layout(e.cfg).total;
    double tokens = (double)e.B * e.T;
    printf("\nmemory of rank 0, buffer by buffer (%s, the table the trainer allocates from)\n",
           e.trainer == Trainer::CPU ? "llmc/memory/cpu_buffers.h" : "llmc/memory/gpu_buffers.h");
    print_buffer_table(table, estimate_granule(e));

    printf("\nmemory of rank 0 by kind\n");
    for (int k = 0; k < MEM_KINDS; k++) {  // model states per parameter, activations per token
        std::string per = k == MEM_ACTIVATIONS ? strprintf("%10.1f bytes per token of the micro-batch", mem.bytes[k] / tokens)
                        : k == MEM_WORKSPACE   ? std::string()
                                               : strprintf("%10.2f bytes per parameter", (double)mem.bytes[k] / P);
        printf("  %-12s %16s  %10s  %s\n", memory_kind_name(k), with_commas((double)mem.bytes[k]).c_str(),
               format_bytes((double)mem.bytes[k]).c_str(), per.c_str());
    }
    printf("  %-12s %16s  %10s\n", "total", with_commas((double)mem.total).c_str(), format_bytes((double)mem.total).c_str());
}

// What left the device or RAM: --offload optimizer's pinned host memory (llmc/optim/offload.cuh),
// --offload-dir's files (llmc/optim/disk_offload.h).
inline void print_estimate_offloaded(const EstimateSetup& e, const MemoryByKind& mem) {
    size_t P = param_layout(e.cfg).total;
    if (e.offload_optimizer) {  // --offload optimizer: what left the GPU, in pinned host memory (llmc/optim/offload.cuh)
        size_t n = gpu_offloaded_elements(estimate_gpu_shape(e, e.B, 0));
        size_t per = offload_host_bytes_per_param(e.offload_delay, e.bf16_moments);
        printf("  host (pinned, --offload optimizer) %s  %s  %zu bytes per updated parameter: fp32 master, %s m, v, the gradient "
               "in fp32, a bf16 staging array the gradient's buckets stream into%s; per step %s down (bf16 gradients) and %s "
               "up (bf16 weights)\n", with_commas((double)(n * per)).c_str(), format_bytes((double)(n * per)).c_str(), per,
               e.bf16_moments ? "bf16" : "fp32", e.offload_delay ? ", a bf16 array for the delayed weights" : "", format_bytes(2.0 * n).c_str(),
               format_bytes(2.0 * n).c_str());
    }
    if (e.offload_chunk_kib > 0 && e.trainer == Trainer::CPU) {  // --offload-dir: what left RAM (llmc/optim/disk_offload.h)
        int per = e.bf16_moments ? 4 : 8;  // m and v: fp32, or bf16 (--optimizer-state bf16)
        double disk = (double)per * cpu_offloaded_moments(estimate_cpu_shape(e, e.B, 0));
        printf("  disk (--offload-dir)  %s  %s  m and v of rank 0, %d bytes per updated parameter (RAM: %.2f bytes per "
               "parameter in all); per step %s read and %s written\n", with_commas(disk).c_str(), format_bytes(disk).c_str(), per,
               (double)mem.total / P, format_bytes(disk).c_str(), format_bytes(disk).c_str());
    }
}

// The largest micro-batch, in words: none, B=..., or at least the search's limit.
inline std::string largest_batch_text(const EstimateSetup& e, int largest) {
    if (largest == 0) return "none, not even B=1";
    if (largest == ESTIMATE_MAX_BATCH) return strprintf("B >= %d", largest);
    return strprintf("B=%d at T=%d", largest, e.T);
}

// The answer, before the tables that explain it (a user asks "will it fit, in how much, how large a
// micro-batch?" first): three lines, from the same numbers as the fit section below (rank 0's table,
// estimate_fits: on the GPU the trainer's own test before it allocates).
inline void print_estimate_answer(const EstimateSetup& e, const MemoryByKind& mem, int largest) {
    bool fits = estimate_fits(e, e.B, e.memory_budget_bytes);
    printf("fits: %s: B=%d T=%d %s %s per rank (%s)\n", fits ? "yes" : "NO", e.B, e.T, fits ? "fits in" : "does not fit in",
           format_bytes(e.memory_budget_bytes).c_str(), e.budget_source.c_str());
    std::string why = estimate_overhead(e) > 0 ? strprintf(", with %s for the CUDA context", format_bytes((double)estimate_overhead(e)).c_str())
                                               : std::string();
    printf("memory per rank: %s (rank 0%s%s)\n", format_bytes((double)(mem.total + estimate_overhead(e))).c_str(), why.c_str(),
           estimate_world(e) > 1 ? strprintf("; every rank of the %d: 'memory per rank' below", estimate_world(e)).c_str() : "");
    printf("largest micro-batch that fits: %s\n\n", largest_batch_text(e, largest).c_str());
}

// What the trainer wants free (the GPU's margin included), and the largest micro-batch that fits the
// budget (`largest`: estimate_largest_batch's, found once for the answer and this section).
inline void print_estimate_fit(const EstimateSetup& e, const MemoryByKind& mem, int largest) {
    if (estimate_overhead(e) > 0) {
        printf("  + %s for the CUDA context and libraries (a margin, not a measurement): the trainer wants %s free\n",
               format_bytes((double)estimate_overhead(e)).c_str(), format_bytes((double)(mem.total + estimate_overhead(e))).c_str());
    }
    printf("  largest micro-batch that fits %s (%s): %s", format_bytes(e.memory_budget_bytes).c_str(), e.budget_source.c_str(),
           largest_batch_text(e, largest).c_str());
    if (largest > 0 && largest < ESTIMATE_MAX_BATCH)
        printf(" (B=%d would need %s)", largest + 1,
               format_bytes((double)(memory_by_kind(estimate_table(e, largest + 1, 0), estimate_granule(e)).total +
                                     estimate_overhead(e))).c_str());
    printf("\n");
}

// Every rank, grouped: ZeRO's shards make the last rank's optimizer state smaller; pipeline stages
// and tensor ranks hold different slices.
inline void print_estimate_ranks(const EstimateSetup& e) {
    size_t granule = estimate_granule(e);
    bool grid = estimate_world(e) > e.ranks;
    printf("\nmemory per rank%s\n", grid ? " (dp, tp, pp: the rank's place in the grid)" : "");
    for (int r = 0; r < estimate_world(e);) {
        MemoryByKind here = memory_by_kind(estimate_table(e, e.B, r), granule);
        int last = r;
        while (last + 1 < estimate_world(e)) {
            MemoryByKind next = memory_by_kind(estimate_table(e, e.B, last + 1), granule);
            if (memcmp(next.bytes, here.bytes, sizeof(here.bytes)) != 0) break;
            last++;
        }
        printf("  %s:", last == r ? strprintf("rank %d", r).c_str() : strprintf("ranks %d-%d", r, last).c_str());
        for (int k = 0; k < MEM_KINDS; k++) printf(" %s=%zu", memory_kind_name(k), here.bytes[k]);
        printf(" total=%zu", here.total);
        if (grid) {
            ProcessGrid g = estimate_grid(e, r);
            printf("  (%d,%d,%d)%s", g.dp_rank, g.tp_rank, g.pp_rank, last > r ? "..." : "");
        }
        printf("\n");
        r = last + 1;
    }
}

// What the ranks send each other a step (the CPU trainer's groups; expert parallelism's all-to-alls),
// and a pipeline's bubble.
inline void print_estimate_traffic(const EstimateSetup& e) {
    if (e.trainer == Trainer::CPU && estimate_world(e) > 1) {  // (the GPU trainer's bf16 traffic: docs/parallelism.md)
        printf("\ncommunication per step, bytes each rank sends to its groups (ring algorithms, llmc/parallel/comm.h)\n");
        for (int r = 0; r < estimate_world(e); r++) {
            CommEstimate c = estimate_comm(e, r);
            printf("  rank %d sends:", r);
            for (int i = 0; i < 4; i++) printf(" %s=%llu", comm_group_name(i), (unsigned long long)c.bytes[i]);
            printf("  (%s)\n", format_bytes((double)(c.bytes[0] + c.bytes[1] + c.bytes[2] + c.bytes[3])).c_str());
        }
    }
    if (e.expert_parallel > 1) {  // --expert-parallel (llmc/parallel/expert_parallel.h): in its own group, the router decides
        ExpertParallelBytes b = estimate_expert_parallel_bytes(e);
        printf("  expert parallel (all-to-all, each rank, a step): counts %llu bytes + rows at most %llu bytes (every assignment "
               "leaves the rank), %llu at even routing; %llu calls\n", (unsigned long long)b.counts,
               (unsigned long long)b.rows_at_most, (unsigned long long)b.rows_even, (unsigned long long)b.calls);
    }
    if (e.pp > 1) {
        int m = estimate_micro_batches(e, e.B);
        printf("%s  pipeline: %s, %d stages, %d micro-batches: bubble %s of each stage's step\n",
               e.trainer == Trainer::CPU ? "" : "\n", pipeline_schedule_name(e.schedule), e.pp, m,
               pipeline_bubble_text(e.schedule, e.pp, m, e.virtual_stages).c_str());
    }
}

// FLOPs per token and per step, and the step time they predict at the assumed MFU.
inline void print_estimate_compute(const EstimateSetup& e) {
    const GPT2Config& c = e.cfg;
    ComputeEstimate comp = estimate_compute(e);
    printf("\ncompute\n");
    printf("  FLOPs per token      6N + 6LCT = 6*%zu + 6*%d*%d*%d = %.4g\n", param_layout(c).total, c.num_layers, c.channels, e.T,
           comp.flops_per_token);
    printf("  tokens per step      %s (all ranks)\n", with_commas((double)e.tokens_per_step).c_str());
    printf("  FLOPs per step       %.4g\n", comp.flops_per_step);
    if (comp.step_seconds > 0) {
        printf("  at MFU %.0f%% of %.0f TFLOP/s per rank (%s): %.1f ms per step, %s tokens/s (PREDICTED)\n", 100 * e.mfu,
               e.peak_flops / 1e12, e.peak_source.c_str(), 1e3 * comp.step_seconds, with_commas(comp.tokens_per_second).c_str());
    } else {
        printf("  step time: give --estimate-peak-tflops (this machine's peak) to predict it\n");
    }
}

// The CPU trainer's optimizer state (rank 0) under each --optimizer, in bytes per parameter of the
// literature's N.
inline void print_estimate_optimizer_choices(const EstimateSetup& e, double N) {
    printf("  optimizer state by --optimizer (CPU trainer, rank 0, this ZeRO stage):");
    for (int choice = 0; choice < 5; choice++) {  // adamw, adamw with bf16 m and v, adafactor, sm3, adamw on disk
        EstimateSetup other = e;
        other.optimizer = choice <= 1 || choice == 4 ? Optimizer::AdamW : choice == 2 ? Optimizer::Adafactor : Optimizer::SM3;
        other.bf16_moments = choice == 1;
        other.offload_chunk_kib = choice < 4 ? 0 : e.offload_chunk_kib > 0 ? e.offload_chunk_kib : DISK_OFFLOAD_DEFAULT_CHUNK_KIB;
        if (choice == 4 && e.zero_stage > 1) continue;  // refused (validate_options)
        if (choice >= 2 && e.zero_stage > 1) continue;  // refused: the CLI says why (ZeRO-1: factored_sharding.h)
        size_t bytes = memory_by_kind(estimate_table(other, e.B, 0), estimate_granule(e)).bytes[MEM_OPTIMIZER];
        printf("%s %s%s %s (%.4f B/param)", choice == 0 ? "" : ";", optimizer_name((int)other.optimizer),
               choice == 1 ? " bf16" : choice == 4 ? " --offload-dir (in RAM; 8 B/param on disk)" : "", format_bytes((double)bytes).c_str(), bytes / N);
    }
    printf("\n");
}

// The model states against the ZeRO paper's accounting; on a grid (a rank holds a slice, not a
// replica) only the paper's side.
inline void print_literature_model_states(const EstimateSetup& e, const std::vector<BufferSpec>& table) {
    const GPT2Config& c = e.cfg;
    bool grid = estimate_world(e) > e.ranks;
    double N = literature_param_count(c.vocab_size, c.max_seq_len, c.num_layers, c.channels, true);
    printf("\nliterature: model states (Rajbhandari et al., ZeRO), N = %s, bytes per parameter\n", with_commas(N).c_str());
    printf("  %-38s %6s %6s %6s %6s %6s %12s\n", "accounting", "params", "grads", "master", "m+v", "total", "for N");
    for (const StateBytes& v : literature_state_variants()) {
        printf("  %-38s %6.0f %6.0f %6.0f %6.0f %5.0fN %12s\n", v.name, v.params, v.grads, v.master, v.optimizer, v.total(),
               format_bytes(v.total() * N).c_str());
    }
    StateBytes mixed = literature_state_variants()[1];
    printf("  ZeRO over %d rank%s, mixed precision (16N), per rank: stage 0 %s, stage 1 %s, stage 2 %s, stage 3 %s\n",
           e.ranks, e.ranks == 1 ? "" : "s", format_bytes(zero_state_bytes(mixed, N, 0, e.ranks)).c_str(),
           format_bytes(zero_state_bytes(mixed, N, 1, e.ranks)).c_str(), format_bytes(zero_state_bytes(mixed, N, 2, e.ranks)).c_str(),
           format_bytes(zero_state_bytes(mixed, N, 3, e.ranks)).c_str());
    printf("  (both trainers implement all four stages)\n");
    if (e.trainer == Trainer::CPU && !grid) print_estimate_optimizer_choices(e, N);
    if (grid) {
        printf("  (with tensor or pipeline parallelism a rank holds a slice, not a replica: the lines against the literature\n"
               "   below are for one whole replica and are left out; the per-rank table above is the answer)\n");
        return;
    }
    printf("  ours against the literature for the same precision and ZeRO-%d, rank 0:\n", e.zero_stage);
    for (const StateLine& l : state_lines(e, table)) {
        printf("    %-10s literature %14s  ours %14s  %s\n", l.kind, with_commas(l.literature).c_str(),
               with_commas((double)l.ours).c_str(), l.why.c_str());
    }
}

// The activations against Korthikanti et al.'s formulas, by recompute level and term by term.
inline void print_literature_activations(const EstimateSetup& e, const std::vector<BufferSpec>& table, const MemoryByKind& mem) {
    const GPT2Config& c = e.cfg;
    double s = e.T, b = e.B, h = c.channels, a = c.num_heads, L = c.num_layers;
    printf("\nliterature: activations (Korthikanti et al.), s=%d b=%d h=%d a=%d L=%d, 16-bit values\n", e.T, e.B, c.channels,
           c.num_heads, c.num_layers);
    printf("  no recompute         sbhL(34 + 5as/h) = %s (%s)\n",
           with_commas(korthikanti_activation_bytes(s, b, h, a, L, PaperRecompute::None)).c_str(),
           format_bytes(korthikanti_activation_bytes(s, b, h, a, L, PaperRecompute::None)).c_str());
    printf("  selective recompute  34 sbhL          = %s (%s)\n",
           with_commas(korthikanti_activation_bytes(s, b, h, a, L, PaperRecompute::Selective)).c_str(),
           format_bytes(korthikanti_activation_bytes(s, b, h, a, L, PaperRecompute::Selective)).c_str());
    printf("  full recompute       2 sbhL           = %s (%s)\n",
           with_commas(korthikanti_activation_bytes(s, b, h, a, L, PaperRecompute::Full)).c_str(),
           format_bytes(korthikanti_activation_bytes(s, b, h, a, L, PaperRecompute::Full)).c_str());
    printf("  ours, by --recompute level:");
    for (int level = 0; level <= 2; level++) {
        EstimateSetup other = e;
        other.recompute = level;
        MemoryByKind m = memory_by_kind(estimate_table(other, e.B, 0), estimate_granule(e));
        printf(" %d: %s activations + %s workspace%s", level, format_bytes((double)m.bytes[MEM_ACTIVATIONS]).c_str(),
               format_bytes((double)m.bytes[MEM_WORKSPACE]).c_str(), level < 2 ? ";" : "\n");
    }
    double values = (double)L * b * s * h;
    printf("  what recompute costs per micro-batch: level 1 evaluates GELU again on 4LBTC = %s values, level 2 also "
           "LayerNorm on 2LBTC = %s (elementwise: no matmul FLOPs)\n",
           with_commas(4 * values).c_str(), with_commas(2 * values).c_str());
    printf("  line by line, ours (rank 0) against the paper:\n");
    printf("    %-48s %14s %14s  %s\n", "term", "paper", "ours", "why they differ");
    double paper_sum = 0;
    size_t ours_sum = 0;
    for (const ActivationLine& l : activation_lines(e, table)) {
        printf("    %-48s %14s %14s  %s%s\n", l.term, with_commas(l.paper).c_str(), with_commas((double)l.ours).c_str(),
               l.why.c_str(), l.rows.empty() ? "" : strprintf(" [%s]", l.rows.c_str()).c_str());
        paper_sum += l.paper;
        ours_sum += l.ours;
    }
    printf("    %-48s %14s %14s\n", "total", with_commas(paper_sum).c_str(), with_commas((double)ours_sum).c_str());
    printf("  workspaces (%s) are outside both accountings: one layer of scratch reused by every layer, and library work "
           "areas\n", format_bytes((double)mem.bytes[MEM_WORKSPACE]).c_str());
}

// --estimate's printout, section by section (each predicted from rank 0's table unless it says so).
inline void print_estimate(const EstimateSetup& e) {
    std::vector<BufferSpec> table = estimate_table(e, e.B, 0);
    MemoryByKind mem = memory_by_kind(table, estimate_granule(e));
    int largest = estimate_largest_batch(e, e.memory_budget_bytes);
    print_estimate_answer(e, mem, largest);
    print_estimate_model(e);
    print_estimate_memory(e, table, mem);
    print_estimate_offloaded(e, mem);
    print_estimate_fit(e, mem, largest);
    print_estimate_ranks(e);
    print_estimate_traffic(e);
    print_estimate_compute(e);
    print_literature_model_states(e, table);
    if (estimate_world(e) > e.ranks) return;  // a rank holds a slice: the paper's activations are a whole replica's
    print_literature_activations(e, table, mem);
}
