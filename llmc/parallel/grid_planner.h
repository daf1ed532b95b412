// grid_planner.h — which grid? Every data x tensor x pipeline split of N ranks, ranked by a model of
// its memory and its step time, before anything runs (`--plan N`).
//
// What it teaches. The three kinds of parallelism (llmc/parallel/process_grid.h) cost different
// things, and Narayanan et al. 2021 ("Efficient large-scale language model training on GPU clusters
// using Megatron-LM", the PTD-P paper) turn that into three rules of thumb:
//   1. tensor parallelism within a node: it all-reduces B*T*C activations twice per layer in each
//      pass, on the critical path, so it needs the fastest links (NVLink), and t <= GPUs per node;
//   2. pipeline parallelism across nodes: it sends only B*T*C values per micro-batch to one
//      neighbour, but costs the bubble, (p-1)/(m+p-1) of the step (m micro-batches), so m >> p;
//   3. data parallelism for the rest: one all-reduce of the gradients per step, 2(d-1)/d * P*b bytes
//      per rank (P parameters of b bytes), amortised over the whole batch; but every data-parallel
//      rank holds a whole slice of the model, so it is the last degree to raise once memory fits.
// The planner does not apply the rules: it prices every grid and the rules fall out of the prices
// (docs/parallelism.md, "Choosing a grid", shows them doing so for the paper's largest runs).
//
// The model of one step, for the busiest rank of a grid (d, t, p) with m micro-batches per step:
//     step = compute + bubble + tensor + pipeline + data
//     compute  = FLOPs per step / (d t p) / R           (6N + 6LCT per token, llmc/model/model.h;
//                                                       R the FLOP rate one rank achieves)
//     bubble   = compute * (p-1)/m                      (so it is (p-1)/(m+p-1) of compute + bubble:
//                                                       both schedules, llmc/parallel/pipeline_parallel.h)
//     tensor, pipeline, data = the bytes this rank sends per step to that group / the bandwidth of
//                              the group's links + its message hops x alpha (Hockney's alpha-beta
//                              model: a message of b bytes costs alpha + b / beta)
// The bytes are the estimator's (llmc/memory/estimate.h, estimate_comm): the lessons' own
// arithmetic (zero.h, tensor_parallel.h, pipeline_parallel.h) that the CPU trainer's counters match
// byte for byte; the GPU trainer sends bf16, half of it. A group's bandwidth is the in-node one when
// its ranks are consecutive enough to share a node (rank = (pp_rank*d + dp_rank)*t + tp_rank: a
// tensor group spans t ranks, a data group d*t, a pipeline group all of them), else the network's.
// Nothing overlaps in this model: the CPU trainer overlaps nothing, the GPU trainer hides part of
// the gradient all-reduce behind the backward (docs/parallelism.md, "On GPUs"), so for it the data
// term is an upper bound.
// The latency term: every message pays alpha before its first byte moves (a kernel launch, a
// handshake, a trip through the MPI progress engine), however small. A ring collective over n ranks
// is a chain of dependent hops, n-1 for a reduce-scatter, all-gather or all-to-all and 2(n-1) for an
// all-reduce, so it costs hops x alpha on top of its bytes / bandwidth; a send is one hop. For a
// large model's megabyte messages alpha is noise; for a small model on many ranks it decides:
// tensor parallelism all-reduces 4 times per layer and micro-batch (plan_hops counts each
// technique's collectives, as their *_comm_bytes functions count their bytes), where data
// parallelism sums once a step. alpha comes from ./comm_bench's smallest messages (--plan-latency).
// Memory per rank is the estimator's for the same grid (the busiest rank, what --estimate prints
// for it: both trainers refuse a run from the same numbers), compared with --estimate-memory-gib, or
// for the CPU trainer with a node's memory shared by its ranks (--plan-node-memory-gib over
// --plan-node-size; unless told, a node is this machine: its RAM over its cores).
//
// Trade-off: it is arithmetic, milliseconds to run, and as good as R and the bandwidths it is given:
// measure them (--profile's SGEMM ceiling or a one-rank step for R, ./comm_bench's bus bandwidth for
// the links) rather than trust the defaults. Hook points: none; it runs instead of the trainer, like
// --estimate, and allocates nothing but its table.
#pragma once

#include <unistd.h>
#include <algorithm>
#include <cstdio>
#include <string>
#include <vector>
#include "llmc/memory/estimate.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/run/cli.h"
#include "llmc/run/compatibility.h"

// The CPU trainer's defaults: what one rank of it achieved on the development machine, 2 cores
// shared with other jobs (scripts/bench_grid_planner.py: 30 to 59 GFLOP/s for a one-thread step of
// its small model, an all-reduce bus bandwidth of 0.52 to 0.87 GB/s in five runs, lower the busier;
// docs/parallelism.md, "Choosing a grid"), taken at the busy end. Yours differ: measure them.
constexpr double CPU_PLAN_DEFAULT_GFLOPS = 40.0;  // GFLOP/s of a whole training step, one thread
constexpr double CPU_PLAN_DEFAULT_GBPS = 0.6;     // GB/s, ./comm_bench's all-reduce bus bandwidth
// A hop of a collective between two ranks of this machine (MPI through shared memory, 2 cores shared
// with other jobs): ./comm_bench's all-reduce of 1 KiB..16 KiB over 2 ranks took 178 to 518 us in two
// runs at load 9 (docs/parallelism.md, "Choosing a grid"), 2(n-1) = 2 hops each; taken near the quiet end.
constexpr double CPU_PLAN_DEFAULT_LATENCY_US = 100.0;

// What the plan assumes about the machine.
struct PlanMachine {
    int ranks = 1;                    // --plan N
    double flops = 0;                 // FLOP/s one rank achieves on the model's matmuls
    double node_bandwidth = 0;        // bytes/s a rank sends to ranks of its own node (bus bandwidth)
    double network_bandwidth = 0;     // ... to ranks of other nodes
    int node_size = 1;                // ranks per node
    double memory_bytes = 0;          // per rank
    double comm_scale = 1;            // bytes on the wire per byte the estimator counts (fp32): 1/2 in bf16
    double latency = 0;               // seconds per message hop (alpha)
    std::string flops_source, bandwidth_source, memory_source;
};

// One candidate grid and its predicted cost.
struct GridPlan {
    int dp = 1, tp = 1, pp = 1, zero = 0, m = 1;
    size_t memory = 0;                // the busiest rank's bytes (the GPU trainer's margin included)
    int busiest = 0;
    bool fits = false;
    double compute = 0, bubble = 0, seconds[3] = {0, 0, 0};  // seconds; seconds[] by group: data, tensor, pipeline
    uint64_t bytes[3] = {0, 0, 0};    // the busiest sender's bytes per step to each group
    uint64_t hops[3] = {0, 0, 0};     // ... and its message hops (seconds[] includes hops x alpha)
    bool in_node[3] = {true, true, true};
    double step() const { return compute + bubble + seconds[0] + seconds[1] + seconds[2]; }
    double comm() const { return seconds[0] + seconds[1] + seconds[2]; }
};

inline std::string describe_plan(const GridPlan& g) {
    return strprintf("dp %d x tp %d x pp %d, ZeRO-%d", g.dp, g.tp, g.pp, g.zero);
}

// Whether a group of `span` consecutive ranks, starting at a multiple of `span`, lives on one node:
// when nodes hold a whole number of such groups. (Groups of 6 on nodes of 8 would straddle two.)
inline bool group_in_one_node(int span, int node_size) { return span <= node_size && node_size % span == 0; }

// The busiest rank's bytes, as estimate_busiest_rank finds them, without visiting every rank of a
// large grid: data-parallel ranks differ only in their ZeRO shard, and shards are equal but the last
// (which holds the padding), so the first and the last data rank of every (tensor, pipeline) place
// cover them all. (test_grid_planner.py checks the result against --estimate's every rank.)
inline size_t plan_busiest_rank(const EstimateSetup& e, int* busiest) {
    size_t most = 0;
    int world = estimate_world(e), per_stage = e.ranks * e.tp;
    for (int r = 0; r < world; r++) {
        int dp_rank = (r % per_stage) / e.tp;
        if (dp_rank != 0 && dp_rank != e.ranks - 1) {
            r += (e.ranks - 2) * e.tp - 1;  // skip the middle data ranks of this stage
            continue;
        }
        size_t need = memory_by_kind(estimate_table(e, e.B, r), estimate_granule(e)).total + estimate_overhead(e);
        if (need > most) most = need, *busiest = r;
    }
    return most;
}

// The message hops rank `rank` makes per step in each group (data, tensor, pipeline): the
// collectives its techniques call, each a ring of n-1 hops (2(n-1) for an all-reduce), counted as
// estimate_comm counts their bytes (zero_comm_bytes, tp_comm_bytes, pipe_comm_bytes: the same terms).
inline void plan_hops(const EstimateSetup& e, int rank, uint64_t hops[3]) {
    ProcessGrid g = estimate_grid(e, rank);
    ModelSlice s = model_slice(e.cfg, g);
    uint64_t m = (uint64_t)estimate_micro_batches(e, e.B), L = (uint64_t)s.num_layers;
    uint64_t d = (uint64_t)g.dp - 1, t = (uint64_t)g.tp - 1, first = s.first_stage, last = s.last_stage;
    // data: ZeRO-0/1 (and bf16, the server) a reduce-scatter and an all-gather a step; PowerSGD two
    // all-reduces (P, Q); ZeRO-2 a reduce-scatter per unit and micro-batch and one all-gather per unit;
    // ZeRO-3 per unit and micro-batch its reduce-scatter and its gathers (forward, backward; the ends' 3)
    uint64_t units = L + 1;
    if (e.compression.kind == GradCompressionKind::PowerSGD) hops[0] = 4 * d;
    else if (g.zero_stage <= 1 || e.parameter_server) hops[0] = 2 * d;
    else if (g.zero_stage == 2) hops[0] = units * (m + 1) * d;
    else hops[0] = (L * m * 3 + m * 4) * d;
    // tensor: as tp_comm_bytes. Without sequence parallelism all-reduces: per micro-batch 2 a layer
    // each way, the embedding's (first stage), the loss's 2 and the LM head's backward (last stage).
    // With it, halves (reduce-scatter or all-gather): 4 a layer forward and 6 backward, plus the ends';
    // the loss's 2 all-reduces; the LayerNorm gradients' all-reduce once a step (ZeRO-0/1) or with
    // every bucket (ZeRO-2/3)
    if (g.tp > 1 && !g.sequence_parallel) hops[1] = m * (first + 4 * L + 2 * last + last) * 2 * t;
    if (g.tp > 1 && g.sequence_parallel) {
        uint64_t halves = first + 4 * L + last + 2 * last + 6 * L + first, all_reduces = 2 * last;
        hops[1] = m * (halves * t + all_reduces * 2 * t);
        hops[1] += g.zero_stage <= 1 ? 2 * t : m * (L + last) * 2 * t;
    }
    // pipeline: as pipe_comm_bytes, one hop per send: activations forward and gradients back per
    // micro-batch (and virtual chunk), and the tied embedding between the first and the last stage
    if (g.pp > 1) {
        for (int c = 0; c < e.virtual_stages; c++) {
            int at = c * g.pp + g.pp_rank;
            hops[2] += m * ((at < g.pp * e.virtual_stages - 1 ? 1 : 0) + (at > 0 ? 1 : 0));
        }
        hops[2] += first || last ? 1 : 0;
    }
}

// Prices grid (dp, tp, pp, ZeRO) for `e` (the model, B, T, tokens per step, precision, recompute).
inline GridPlan price_grid(const EstimateSetup& base, const PlanMachine& mc, int dp, int tp, int pp, int zero) {
    EstimateSetup e = base;
    e.ranks = dp, e.tp = tp, e.pp = pp, e.zero_stage = zero;
    e.sequence_parallel = base.sequence_parallel && tp > 1;
    GridPlan g;
    g.dp = dp, g.tp = tp, g.pp = pp, g.zero = zero;
    g.m = estimate_micro_batches(e, e.B);
    g.memory = plan_busiest_rank(e, &g.busiest);
    g.fits = (double)g.memory <= mc.memory_bytes;
    g.compute = estimate_compute(e).flops_per_step / ((double)dp * tp * pp) / mc.flops;
    g.bubble = g.compute * (pp - 1) / g.m;
    int span[3] = {dp * tp, tp, dp * tp * pp};  // data, tensor, pipeline groups (process_grid.h's order)
    // Every stage sends different bytes (the first and last also move the embedding); the busiest
    // rank sets the pace. Within a stage the tensor and data ranks send the same (but for the few
    // bytes of padding in the last ZeRO shard), so the stage's first rank speaks for it.
    for (int stage = 0; stage < pp; stage++) {
        CommEstimate c = estimate_comm(e, stage * dp * tp);
        uint64_t hops[3] = {0, 0, 0};
        plan_hops(e, stage * dp * tp, hops);
        double seconds[3];
        for (int k = 0; k < 3; k++) {
            g.in_node[k] = group_in_one_node(span[k], mc.node_size);
            seconds[k] = c.bytes[k] * mc.comm_scale / (g.in_node[k] ? mc.node_bandwidth : mc.network_bandwidth) +
                         hops[k] * mc.latency;
        }
        if (stage == 0 || seconds[0] + seconds[1] + seconds[2] > g.comm()) {
            for (int k = 0; k < 3; k++)
                g.seconds[k] = seconds[k], g.bytes[k] = (uint64_t)(c.bytes[k] * mc.comm_scale), g.hops[k] = hops[k];
        }
    }
    return g;
}

// Every valid grid of mc.ranks ranks, ZeRO stages included, priced; degrees the user fixed with
// --tensor-parallel, --pipeline-parallel, --estimate-ranks (data) or --zero are kept. A grid is
// valid when the trainers would run it: the tokens per step split into whole micro-batches on every
// data-parallel rank, and no row of llmc/run/compatibility.h refuses it (grid_problem's heads divisible
// by t, p <= layers, m >= p, ZeRO-2/3 not with a pipeline; and every technique pair the flags name). ZeRO-1..3 need two data-parallel ranks to share anything.
inline std::vector<GridPlan> plan_grids(const EstimateSetup& base, const PlanMachine& mc, const TrainOptions& o) {
    std::vector<GridPlan> plans;
    int64_t sequences = base.tokens_per_step / base.T;  // sequences per step, all ranks together
    for (int tp = 1; tp <= mc.ranks; tp++) {
        if (mc.ranks % tp || (flag_given(o, "tensor-parallel") && tp != o.tensor_parallel)) continue;
        for (int pp = 1; pp <= mc.ranks / tp; pp++) {
            if ((mc.ranks / tp) % pp || (flag_given(o, "pipeline-parallel") && pp != o.pipeline_parallel)) continue;
            int dp = mc.ranks / (tp * pp);
            if (flag_given(o, "estimate-ranks") && dp != o.estimate_ranks) continue;
            if (sequences % ((int64_t)base.B * dp) != 0) continue;  // whole micro-batches on every data rank
            for (int zero = 0; zero <= 3; zero++) {
                if ((zero > 0 && dp == 1) || (flag_given(o, "zero") && zero != o.zero_stage)) continue;
                ProcessGrid g;
                make_grid(mc.ranks, 0, tp, pp, dp, zero, base.sequence_parallel && tp > 1, &g);
                int m = (int)(sequences / ((int64_t)base.B * dp));
                const char* build = base.dtype_bytes == 4 ? "fp32" : base.half_name.c_str();  // (training's refusals: compatibility.h)
                if (!compatibility_plan_problem(o, base.trainer, build, base.cfg, g, base.B, base.T, m).empty()) continue;
                plans.push_back(price_grid(base, mc, dp, tp, pp, zero));
            }
        }
    }
    // fitting grids first, then the fastest; among equal times the smaller memory (ZeRO-1 moves the
    // same bytes as ZeRO-0 in less memory, so it ranks above it)
    std::stable_sort(plans.begin(), plans.end(), [](const GridPlan& a, const GridPlan& b) {
        if (a.fits != b.fits) return a.fits;
        if (a.step() != b.step()) return a.step() < b.step();
        return a.memory < b.memory;
    });
    return plans;
}

// The one line for a rank count no grid can use: each degree's limit, so the user sees which to change.
inline std::string no_grid_reason(const EstimateSetup& e, int ranks) {
    int64_t micro = e.tokens_per_step / ((int64_t)e.B * e.T);
    return strprintf("--plan %d: no grid of %d ranks can train this model and batch: the tensor degree must divide the %d "
                     "heads, the pipeline degree be at most the %d layers (and at most the micro-batches per step), and the "
                     "data degree divide the %lld micro-batches of B=%d in a step of %lld tokens; plan fewer ranks or "
                     "raise --total-batch-tokens", ranks, ranks, e.cfg.num_heads, e.cfg.num_layers, (long long)micro, e.B,
                     (long long)e.tokens_per_step);
}

// The machine the flags describe, with each trainer's defaults (stated in --help and in the output).
inline PlanMachine plan_machine(const TrainOptions& o, const EstimateSetup& e) {
    PlanMachine mc;
    bool gpu = e.trainer == Trainer::GPU;
    mc.ranks = o.plan;
    mc.memory_bytes = e.memory_budget_bytes;
    mc.memory_source = e.budget_source;
    if (o.plan_tflops > 0) {
        mc.flops = o.plan_tflops * 1e12;
        mc.flops_source = "--plan-tflops";
    } else if (gpu) {  // the estimate's own assumption: MFU x peak (an H100 SXM's dense bf16 unless told)
        mc.flops = e.peak_flops * e.mfu;
        mc.flops_source = strprintf("--estimate-mfu %.2f x a %.0f TFLOP/s peak; or --plan-tflops", e.mfu,
                                    e.peak_flops / 1e12);
    } else {
        mc.flops = CPU_PLAN_DEFAULT_GFLOPS * 1e9;
        mc.flops_source = "the CPU default; measure yours: --plan-tflops";
    }
    double net = o.plan_bandwidth > 0 ? o.plan_bandwidth : gpu ? 50.0 : CPU_PLAN_DEFAULT_GBPS;
    mc.network_bandwidth = net * 1e9;
    mc.node_bandwidth = (o.plan_node_bandwidth > 0 ? o.plan_node_bandwidth : gpu ? 450.0 : net) * 1e9;
    // A node: 8 GPUs; for the CPU trainer this machine (a rank per core, its RAM shared by the ranks on
    // it), so 8 ranks on a 2-core machine are 4 such machines, not 8 ranks each with the whole RAM.
    int cores = (int)std::max(1L, sysconf(_SC_NPROCESSORS_ONLN));
    mc.node_size = o.plan_node_size > 0 ? o.plan_node_size : gpu ? 8 : cores;
    if (o.plan_node_memory_gib < 0) usage_fail("--plan-node-memory-gib must be positive (0 = this machine's RAM), got %g",
                                               o.plan_node_memory_gib);
    if (!gpu && o.estimate_memory_gib <= 0) {  // (--estimate-memory-gib: the memory per rank, as given)
        int sharing = std::min(mc.node_size, mc.ranks);
        double node = o.plan_node_memory_gib > 0 ? o.plan_node_memory_gib * (double)(1ull << 30) : host_ram_bytes();
        int nodes = (mc.ranks + mc.node_size - 1) / mc.node_size;
        mc.memory_bytes = node / sharing;
        mc.memory_source = strprintf("a node's %s, %s, over its %d rank%s, %s; %d rank%s = %d node%s",
                                     format_bytes(node).c_str(),
                                     o.plan_node_memory_gib > 0 ? "--plan-node-memory-gib" : "this machine's RAM: --plan-node-memory-gib",
                                     sharing, sharing == 1 ? "" : "s",
                                     o.plan_node_size > 0 ? "--plan-node-size"
                                                          : strprintf("one per core of this machine's %d: --plan-node-size", cores).c_str(),
                                     mc.ranks, mc.ranks == 1 ? "" : "s", nodes, nodes == 1 ? "" : "s");
    }
    mc.comm_scale = e.dtype_bytes / 4.0;
    mc.latency = (o.plan_latency >= 0 ? o.plan_latency : gpu ? 0.0 : CPU_PLAN_DEFAULT_LATENCY_US) * 1e-6;
    mc.bandwidth_source = strprintf("%d ranks per node, %.3g GB/s inside a node, %.3g GB/s between nodes%s", mc.node_size,
                                    mc.node_bandwidth / 1e9, mc.network_bandwidth / 1e9,
                                    flag_given(o, "plan-bandwidth") ? ""
                                    : gpu ? " (default: H100 nodes)" : " (CPU default: this machine's MPI, between nodes too)");
    mc.bandwidth_source += strprintf("; %.3g us a message hop (%s)", mc.latency * 1e6,
                                     o.plan_latency >= 0 ? "--plan-latency"
                                     : gpu ? "GPU default: none, not measured here; give --plan-latency"
                                           : "CPU default: ./comm_bench's small messages here");
    return mc;
}

inline std::string plan_row(const GridPlan& g, bool bytes_column) {
    auto group = [&](int k) {
        if (g.bytes[k] == 0) return std::string("-");
        return strprintf("%.1f%s", 1e3 * g.seconds[k], g.in_node[k] ? "" : "*");
    };
    std::string row = strprintf("%4d %4d %4d %4d %5d %11s %3s %9.1f %9.1f %9.1f %9s %8s %8s", g.dp, g.tp, g.pp, g.zero,
                                g.m, format_bytes((double)g.memory).c_str(), g.fits ? "yes" : "NO", 1e3 * g.step(),
                                1e3 * g.compute, 1e3 * g.bubble, group(1).c_str(), group(2).c_str(), group(0).c_str());
    if (bytes_column) row += strprintf(" %14zu %d", g.memory, g.busiest);
    return row;
}

// Why the winner won: its costs, and what the runner-up, the best pure data-parallel grid and the
// fastest grid that does not fit would have cost instead.
inline void explain_winner(const std::vector<GridPlan>& plans, const PlanMachine& mc) {
    const GridPlan& w = plans[0];
    printf("\nwinner: %s, %.1f ms per step predicted\n", describe_plan(w).c_str(), 1e3 * w.step());
    printf("  memory: %s on its busiest rank (rank %d) of %s\n", format_bytes((double)w.memory).c_str(), w.busiest,
           format_bytes(mc.memory_bytes).c_str());
    printf("  time: compute %.1f ms (%.0f%%), bubble %.1f ms ((p-1)/(m+p-1) = %d/%d),\n", 1e3 * w.compute,
           100 * w.compute / w.step(), 1e3 * w.bubble, w.pp - 1, w.m + w.pp - 1);
    printf("        communication %.1f ms (tensor %.1f, pipeline %.1f, data %.1f), of which latency %.1f ms (%llu hops)\n",
           1e3 * w.comm(), 1e3 * w.seconds[1], 1e3 * w.seconds[2], 1e3 * w.seconds[0],
           1e3 * mc.latency * (double)(w.hops[0] + w.hops[1] + w.hops[2]),
           (unsigned long long)(w.hops[0] + w.hops[1] + w.hops[2]));
    auto versus = [&](const char* what, const GridPlan& o) {
        const char* names[5] = {"compute", "bubble", "tensor traffic", "pipeline traffic", "data traffic"};
        double dw[5] = {w.compute, w.bubble, w.seconds[1], w.seconds[2], w.seconds[0]};
        double d_o[5] = {o.compute, o.bubble, o.seconds[1], o.seconds[2], o.seconds[0]};
        int most = 0;
        for (int k = 1; k < 5; k++)
            if (d_o[k] - dw[k] > d_o[most] - dw[most]) most = k;
        if (!o.fits) {
            printf("  %s: %s: %.1f ms, but %s per rank\n", what, describe_plan(o).c_str(), 1e3 * o.step(),
                   format_bytes((double)o.memory).c_str());
        } else if (o.step() - w.step() <= 1e-6 * w.step()) {
            printf("  %s: %s: the same time, but %s per rank\n", what, describe_plan(o).c_str(),
                   format_bytes((double)o.memory).c_str());
        } else {
            printf("  %s: %s: %.1f ms (%+.1f%%), its %s +%.1f ms\n", what, describe_plan(o).c_str(), 1e3 * o.step(),
                   100 * (o.step() / w.step() - 1), names[most], 1e3 * (d_o[most] - dw[most]));
        }
    };
    if (plans.size() > 1 && plans[1].fits) versus("runner-up", plans[1]);
    for (const GridPlan& g : plans)  // the grid of the rules' last resort, when the winner is another
        if (g.tp == 1 && g.pp == 1 && (w.tp > 1 || w.pp > 1) && (plans.size() < 2 || &g != &plans[1])) {
            versus("pure data parallelism", g);
            break;
        }
    for (const GridPlan& g : plans)
        if (!g.fits && g.step() < w.step()) {
            versus("faster but too big", g);
            break;
        }
}

// --plan N: prints the ranked table and the explanation. Refuses (one line, exit 2) a rank count
// below 1 or one no grid can use.
inline void print_plan(const TrainOptions& o, EstimateSetup base) {
    // one batch for every grid, so that they are compared on the same work: the tokens per step
    // given, else what pure data parallelism over all the ranks would take (B*T per rank)
    base.tokens_per_step = o.total_batch_tokens > 0 ? o.total_batch_tokens : (int64_t)base.B * base.T * o.plan;
    PlanMachine mc = plan_machine(o, base);
    std::vector<GridPlan> plans = plan_grids(base, mc, o);
    if (plans.empty()) usage_fail(no_grid_reason(base, mc.ranks));
    int fitting = 0;
    for (const GridPlan& g : plans) fitting += g.fits;
    printf("plan: PREDICTED, not measured: every grid of %d ranks\n", mc.ranks);
    printf("model: %s\n", describe_config(base.cfg).c_str());
    printf("batch: B=%d T=%d, %s tokens per step on every grid (%s)\n", base.B, base.T,
           with_commas((double)base.tokens_per_step).c_str(),
           flag_given(o, "total-batch-tokens") ? "--total-batch-tokens" : "B*T*ranks: --total-batch-tokens for another");
    printf("assumes: %.4g TFLOP/s per rank (%s)\n", mc.flops / 1e12, mc.flops_source.c_str());
    printf("         %s\n", mc.bandwidth_source.c_str());
    printf("         %s of memory per rank (%s)\n", format_bytes(mc.memory_bytes).c_str(), mc.memory_source.c_str());
    printf("step = compute + bubble + tensor + pipeline + data traffic (bytes / bandwidth + hops x latency), nothing "
           "overlapped (grid_planner.h)\n");
    printf("grids: %zu valid, %d fit\n\n", plans.size(), fitting);
    bool all = verbosity >= 2;
    printf("  dp   tp   pp zero     m    mem/rank fit   step ms   comp ms bubble ms tensor ms  pipe ms  data ms%s\n",
           all ? "    bytes/rank busiest" : "");
    size_t shown = all ? plans.size() : std::min<size_t>(plans.size(), 20);
    for (size_t i = 0; i < shown; i++) printf("%s\n", plan_row(plans[i], all).c_str());
    if (shown < plans.size()) printf("  ... %zu more (--verbose shows all)\n", plans.size() - shown);
    printf("  (* : the group spans nodes, at the network's bandwidth)\n");
    if (fitting == 0) {
        printf("\nno grid fits %s per rank: the smallest needs %s;\nshard more (--zero 3), use a smaller micro-batch, or "
               "plan more ranks\n", format_bytes(mc.memory_bytes).c_str(),
               format_bytes((double)std::min_element(plans.begin(), plans.end(), [](const GridPlan& a, const GridPlan& b) {
                   return a.memory < b.memory;
               })->memory).c_str());
        return;
    }
    explain_winner(plans, mc);
}
