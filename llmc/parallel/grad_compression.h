// grad_compression.h — sending less: the data-parallel gradient sum, compressed.
//
// Data parallelism sums every gradient over the ranks once a step: with P parameters in fp32 a ring
// all-reduce sends 2 (N-1)/N * 4P bytes from each rank (llmc/parallel/comm.h), 1 GB a step for
// GPT-2 124M. Over a slow network that sum, not the arithmetic, sets the step time. Two ways to
// send fewer bytes, both here (--grad-compression bf16 | powersgd):
//
// bf16: half the bytes. Each rank rounds its gradient to bf16 (round to nearest even) and the sum
//   is a reduce-scatter and an all-gather done by hand, so that only bf16 crosses the wire: an
//   all-to-all gives the owner of each shard (llmc/parallel/sharding.h) every rank's bf16 values
//   of it, the owner adds them IN FP32, in rank order (so every rank's copy of the sum has the same
//   bits), rounds the sum to bf16, and an all-gather hands the bf16 sums to everyone. Two roundings:
//   a gradient loses its bits below 2^-8 of its size, and so does the sum. No state, no error
//   feedback: what rounding drops is lost.
//
// PowerSGD (Vogels, Karimireddy & Jaggi, NeurIPS 2019, Algorithm 1 with error feedback, Algorithm
//   2): a gradient MATRIX is close to low rank, so send a rank-r approximation: for an n x m matrix
//   r (n + m) numbers instead of n m (768 x 3072 at r = 4: 15,360 instead of 2,359,296). Per matrix
//   and step, on every data-parallel rank i, with its local gradient G_i (this trainer scales each
//   rank's gradient by 1 / (tokens of the whole step), so the ranks' gradients ADD UP to the step's
//   gradient; the paper averages, the scaling is the only difference):
//       M_i = G_i + e_i                     error feedback: what earlier steps' compression left out
//       P   = sum_i M_i Q                   (n x r) all-reduced; Q (m x r) is the same on every rank
//       P^  = orthonormalise(P)             Gram-Schmidt on the r columns
//       Q'  = sum_i M_i^T P^                (m x r) all-reduced
//       S   = P^ Q'^T                       ~ sum_i M_i: the step's gradient, the same on every rank
//       e_i = M_i - S / N                   the rank's share of what S missed (sum_i e_i = 0 when
//                                           S is exact, at r >= min(n, m))
//       Q   = Q'                            kept for the next step: the warm start. One step of
//                                           power iteration per training step tracks the gradient's
//                                           top subspace as it drifts
//   The first Q is drawn from --seed, the same on every rank (a counter-based normal per element:
//   llmc/model/model.h's normal_from_counter), so P's all-reduce adds products in the same basis.
//   Vectors (biases, LayerNorms) and matrices where r (n + m) is not at most half of n m go
//   through the exact all-reduce with P: they are few bytes, and compressing them saves little.
//   Steps 1 .. --powersgd-start-step use the exact all-reduce for everything (the first steps'
//   gradients change fast, and the error feedback would carry stale mistakes).
//   Orthonormalisation: modified Gram-Schmidt in fp32, dot products accumulated in double, run
//   twice ("twice is enough": the second pass restores orthogonality lost to rounding). A column
//   that is zero, or that the projections reduce to rounding noise (P has rank below r: a zero
//   gradient, or wpe's rows past --seq-len that never get one), is set to zero, so it adds nothing
//   to S: normalised, the noise would be a false direction and S would count part of M twice.
//   Every collective here is comm_allreduce_sum_identical (a reduce-scatter and an all-gather), so
//   every rank orthonormalises the same bits and ends with the same S: the replicas' weights stay
//   identical, as with the exact sum.
//
// The trade-off. Bytes each rank sends per step at d12 (124M parameters) on 2 ranks, r = 4:
//   3.5 MiB against 474.8 MiB for the exact sum, 136x less (docs/parallelism.md, the counters).
//   Memory: e_i and the next step's e_i (4 + 4 bytes per compressed parameter: the new e is kept
//   apart until the step is known to be sound, see below), Q twice, P: about 2x the gradient.
//   Compute: three thin matrix products per matrix (M Q, M^T P^, P^ Q'^T), 6 r n m FLOPs, a few
//   percent of a step at r = 4. Convergence: the update is no longer the exact gradient; error
//   feedback makes every dropped component arrive later instead of never: on 2 ranks, r = 4, val loss
//   within 0.005 of the exact sum's after 150 steps (docs/benchmarks.md, "PowerSGD against the exact sum").
//
// Hook points (llmc/run/step.h): finish_gradients does the data-parallel sum here instead of
//   llmc/parallel/zero.h's, and optimizer_step (reached only when step_is_sound accepted the step)
//   commits the step's e and Q. A step whose loss or norm is not finite is skipped and leaves e and
//   Q as they were: a NaN in one rank's gradient reaches every rank's P, and would otherwise sit in
//   e forever (PyTorch's PowerSGD hook had that bug, pytorch#49374). The error buffers and Q are
//   saved in every checkpoint, one file per rank (grad_compression_rank<r>.bin, docs/formats.md):
//   without them a resumed run would restart the error feedback from zero and differ from the
//   straight run (pytorch#48670: DDP lost them when it rebuilt its buckets).
// The GPU trainer's twin, llmc/parallel/grad_compression.cuh, uses this plan, sizes and file as they are.
// Only plain data parallelism, ZeRO-0: stages 1-3 reduce-scatter the gradient (each rank would
//   need the whole S to form its e), and tensor and pipeline ranks hold slices, not matrices.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/model/model.h"
#include "llmc/parallel/comm.h"
#include "llmc/run/cli.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/parallel/sharding.h"
#include "llmc/parallel/zero.h"
#include "llmc/utils.h"

enum class GradCompressionKind { None, BF16, PowerSGD };

inline bool parse_grad_compression(const std::string& s, GradCompressionKind* k) {
    if (s == "none") *k = GradCompressionKind::None;
    else if (s == "bf16") *k = GradCompressionKind::BF16;
    else if (s == "powersgd") *k = GradCompressionKind::PowerSGD;
    else return false;
    return true;
}
inline const char* grad_compression_name(GradCompressionKind k) {
    return k == GradCompressionKind::BF16 ? "bf16" : k == GradCompressionKind::PowerSGD ? "powersgd" : "none";
}

// What the run asked for (the flags), and what the model and grid make of it.
struct GradCompressionSettings {
    GradCompressionKind kind = GradCompressionKind::None;
    int rank = 4;               // --powersgd-rank r
    int start_step = 0;         // --powersgd-start-step: steps 1 .. start_step sum exactly
    bool every_matrix = false;  // tests: compress every 2-D matrix, whatever r (llmc/probes/grad_compression_probe.h)
};

inline GradCompressionSettings grad_compression_settings(const TrainOptions& o) {
    GradCompressionSettings s;
    parse_grad_compression(o.grad_compression, &s.kind);   // (validate_options checked the name)
    s.rank = o.powersgd_rank;
    s.start_step = o.powersgd_start_step;
    return s;
}

// One compressed matrix: n x m, row-major at `offset` of the flat array; its e at e_at, its P at
// p_at (n x r), its Q at q_at (m x r).
struct PowerSGDMatrix {
    size_t offset;
    size_t n, m;
    size_t e_at, p_at, q_at;
};

// Which matrices PowerSGD compresses, where each one's state lives, and the ranges summed exactly.
struct PowerSGDPlan {
    std::vector<PowerSGDMatrix> matrices;
    std::vector<ShardRange> exact;     // ranges of the flat array summed exactly (vectors, small matrices)
    size_t e_floats = 0, p_floats = 0, q_floats = 0, exact_floats = 0;
};

// The 2-D tensors of GPT-2 as matrices: wte (Vp x C), wpe (maxT x C), and per layer qkvw (3C x C),
// attprojw (C x C), fcw (4C x C), fcprojw (C x 4C). A matrix is compressed when r (n + m) <= n m / 2.
inline PowerSGDPlan powersgd_plan(const GPT2Config& cfg, const GradCompressionSettings& s) {
    ParamLayout layout = param_layout(cfg);
    size_t C = cfg.channels, L = cfg.num_layers, r = (size_t)std::max(1, s.rank);
    struct Shape { int tensor; size_t n, m, copies; };
    const Shape shapes[] = {{WTE, (size_t)cfg.padded_vocab_size, C, 1}, {WPE, (size_t)cfg.max_seq_len, C, 1},
                            {QKVW, 3 * C, C, L}, {ATTPROJW, C, C, L}, {FCW, 4 * C, C, L}, {FCPROJW, C, 4 * C, L}};
    PowerSGDPlan p;
    std::vector<ShardRange> compressed;
    for (const Shape& sh : shapes) {
        bool worth = s.every_matrix ? r <= std::min(sh.n, sh.m) : 2 * r * (sh.n + sh.m) <= sh.n * sh.m;
        if (!worth) continue;
        for (size_t l = 0; l < sh.copies; l++) {
            PowerSGDMatrix mat{layout.offset[sh.tensor] + l * sh.n * sh.m, sh.n, sh.m, p.e_floats, p.p_floats, p.q_floats};
            p.matrices.push_back(mat);
            compressed.push_back({mat.offset, mat.offset + sh.n * sh.m});
            p.e_floats += sh.n * sh.m;
            p.p_floats += sh.n * r;
            p.q_floats += sh.m * r;
        }
    }
    std::sort(compressed.begin(), compressed.end(), [](const ShardRange& a, const ShardRange& b) { return a.begin < b.begin; });
    size_t at = 0;
    for (const ShardRange& c : compressed) {
        if (c.begin > at) p.exact.push_back({at, c.begin});
        at = c.end;
    }
    if (at < layout.total) p.exact.push_back({at, layout.total});
    for (const ShardRange& e : p.exact) p.exact_floats += e.size();
    return p;
}

// Why these settings cannot run on this grid and model ("" when they can): the run refuses them
// before anything is allocated (exit 2).
inline std::string grad_compression_problem(const GradCompressionSettings& s, const ProcessGrid& g, const GPT2Config& cfg) {
    if (s.kind == GradCompressionKind::None) return "";
    const char* name = grad_compression_name(s.kind);
    if (g.tp > 1 || g.pp > 1) {
        return strprintf("--grad-compression %s compresses whole gradient matrices over data-parallel ranks; tensor and "
                         "pipeline ranks hold slices of them: drop --tensor-parallel/--pipeline-parallel or use "
                         "--grad-compression none", name);
    }
    if (g.zero_stage != 0) {
        return strprintf("--grad-compression %s with --zero %d: ZeRO-1/2/3 reduce-scatter the gradient, so no rank holds the "
                         "whole compressed sum it needs; use --zero 0 or --grad-compression none", name, g.zero_stage);
    }
    if (g.dp == 1) return strprintf("--grad-compression %s needs 2 or more data-parallel ranks: one rank sends nothing", name);
    if (s.kind != GradCompressionKind::PowerSGD) return "";
    PowerSGDPlan p = powersgd_plan(cfg, s);
    size_t C = cfg.channels, smallest = std::min((size_t)cfg.max_seq_len, C);
    if (s.every_matrix && (size_t)s.rank > smallest) {
        return strprintf("--powersgd-rank %d exceeds min(n, m) = %zu of this model's smallest matrix (wpe, %d x %zu): a rank-r "
                         "approximation needs r <= min(n, m)", s.rank, smallest, cfg.max_seq_len, C);
    }
    if (p.matrices.empty()) {
        // the largest useful r for the largest matrix, wte: 2 r (Vp + C) <= Vp C
        size_t Vp = cfg.padded_vocab_size, largest = Vp * C / (2 * (Vp + C));
        return strprintf("--powersgd-rank %d compresses none of this model's matrices (a matrix is compressed when "
                         "r (n + m) <= n m / 2): use --powersgd-rank %zu or less", s.rank, largest);
    }
    return "";
}

// Floats each data-parallel rank keeps for the compression (the size table's two rows,
// llmc/memory/cpu_buffers.h): the state (e, the next e, Q, the next Q) and the workspace (P with
// the exactly summed values packed behind it; bf16: the send and receive arrays), and the scratch of
// comm_allreduce_sum_identical (its padded copy plus one shard).
struct GradCompressionSizes {
    size_t state = 0, work = 0, scratch = 0;
};

inline size_t identical_scratch_floats(size_t n, int N) {
    size_t shard = (n + (size_t)N - 1) / (size_t)N;
    return shard * (size_t)N + shard;
}

inline GradCompressionSizes grad_compression_sizes(const GradCompressionSettings& s, const GPT2Config& cfg, int N) {
    GradCompressionSizes z;
    if (s.kind == GradCompressionKind::None || N == 1) return z;
    if (s.kind == GradCompressionKind::BF16) {
        z.work = shard_layout(param_layout(cfg).total, N).padded_total;   // 2 x padded bf16 = padded floats
        return z;
    }
    PowerSGDPlan p = powersgd_plan(cfg, s);
    z.state = 2 * p.e_floats + 2 * p.q_floats;
    z.work = p.p_floats + p.exact_floats;
    z.scratch = std::max(identical_scratch_floats(z.work, N), identical_scratch_floats(p.q_floats, N));
    return z;
}

// The GPU trainer's two rows (llmc/memory/gpu_buffers.h, fp32 on the device; read
// llmc/parallel/grad_compression.cuh): the state e, next e, Q, next Q, and the workspace P with the
// exact values behind it. No scratch: NCCL sums in place. Q and P + exact are padded to a multiple
// of N floats, the even shards gpu_all_reduce_identical cuts them into. bf16 needs nothing there:
// the GPU's exact sum already sends bf16.
inline size_t powersgd_gpu_q_floats(const PowerSGDPlan& p, int N) { return (p.q_floats + N - 1) / N * N; }
inline size_t powersgd_gpu_work_floats(const PowerSGDPlan& p, int N) { return (p.p_floats + p.exact_floats + N - 1) / N * N; }
inline GradCompressionSizes grad_compression_gpu_sizes(const GradCompressionSettings& s, const GPT2Config& cfg, int N) {
    GradCompressionSizes z;
    if (s.kind != GradCompressionKind::PowerSGD || N == 1) return z;
    PowerSGDPlan p = powersgd_plan(cfg, s);
    z.state = 2 * p.e_floats + 2 * powersgd_gpu_q_floats(p, N);
    z.work = powersgd_gpu_work_floats(p, N);
    return z;
}

// Bytes one rank sends per step (llmc/parallel/comm.h's ring convention), after the start step.
inline uint64_t grad_compression_bytes(const GradCompressionSettings& s, const GPT2Config& cfg, int N) {
    if (N == 1) return 0;
    uint64_t n1 = (uint64_t)(N - 1);
    if (s.kind == GradCompressionKind::BF16) {  // all-to-all and all-gather of bf16 shards
        return 2 * n1 * shard_layout(param_layout(cfg).total, N).shard_size * sizeof(uint16_t);
    }
    PowerSGDPlan p = powersgd_plan(cfg, s);
    auto identical = [&](size_t n) { return 2 * n1 * ((n + (size_t)N - 1) / (size_t)N) * sizeof(float); };
    return identical(p.p_floats + p.exact_floats) + identical(p.q_floats);
}

// ----------------------------------------------------------------------------------------------
// The run's state

struct GradCompression {
    GradCompressionSettings settings;
    Comm* dp = nullptr;
    PowerSGDPlan plan;
    std::vector<float> state, work, scratch;  // sized by grad_compression_sizes (the size table's rows)
    float *e = nullptr, *e_next = nullptr, *q = nullptr, *q_next = nullptr;
    bool pending = false;                     // this step made an e_next and q_next to commit
    int64_t steps_done = 0;                   // the steps summed so far (a resumed run: the checkpoint's step)
};

inline bool grad_compression_on(const GradCompression& c) {
    return c.settings.kind != GradCompressionKind::None && c.dp && c.dp->world_size > 1;
}

// The first Q: normal(hash(seed', element)) with a seed of its own, so it is not the weights' draw;
// the same on every rank (and on both trainers: the GPU's is drawn here and uploaded).
inline void powersgd_first_q(uint64_t seed, float* q, size_t n) {
    uint64_t q_seed = seed ^ 0x9D5A3C1B2E4F6071ull;
    for (size_t i = 0; i < n; i++) q[i] = normal_from_counter(q_seed, i);
}

// Whether this step's data-parallel sum is PowerSGD's (past the start step) rather than the exact one.
inline bool powersgd_replaces_sum(const GradCompression& c, int step) {
    return grad_compression_on(c) && c.settings.kind == GradCompressionKind::PowerSGD && step > c.settings.start_step;
}

// Sets up the plan and points into the buffers (allocated from the size table's rows before this:
// state, work and scratch, zeroed); Q from the seed, e at zero. Before the training loop.
inline void grad_compression_setup(GradCompression* c, const GradCompressionSettings& s, Comm* dp, const GPT2Config& cfg,
                                   uint64_t seed) {
    c->settings = s;
    c->dp = dp;
    if (s.kind != GradCompressionKind::PowerSGD || dp->world_size == 1) return;
    c->plan = powersgd_plan(cfg, s);
    c->e = c->state.data();
    c->e_next = c->e + c->plan.e_floats;
    c->q = c->e_next + c->plan.e_floats;
    c->q_next = c->q + c->plan.q_floats;
    std::fill(c->e, c->e + c->plan.e_floats, 0.0f);  // the first step's error feedback: nothing carried (poison found it)
    powersgd_first_q(seed, c->q, c->plan.q_floats);
}

// bf16: see the top of the file. grads holds `padded` floats, a multiple of the group's size;
// work 2 x padded bf16 (send, receive). Also the MoE table's (llmc/parallel/expert_parallel.h).
inline void bf16_sum_over(Comm* group, uint16_t* work, float* grads, size_t padded) {
    int N = group->world_size, me = group->rank;
    size_t s = padded / (size_t)N;
    uint16_t* send = work;
    uint16_t* recv = send + padded;
    for (size_t i = 0; i < padded; i++) send[i] = float_to_bf16_round_nearest(grads[i]);
    comm_all_to_all(group, send, recv, s * sizeof(uint16_t), "all-to-all of the bf16 gradients");
    uint16_t* mine = send + (size_t)me * s;  // this rank's block of the send array is free again: the sums go there
    for (size_t i = 0; i < s; i++) {
        float sum = 0.0f;
        for (int j = 0; j < N; j++) sum += bf16_to_float(recv[(size_t)j * s + i]);  // fp32, rank order
        mine[i] = float_to_bf16_round_nearest(sum);
    }
    comm_all_gather(group, send, s * sizeof(uint16_t), "all-gather of the bf16 gradient sums");
    for (size_t i = 0; i < padded; i++) grads[i] = bf16_to_float(send[i]);
}
// grads holds the padded flat gradient (shard_layout(total, N)).
inline void bf16_sum(GradCompression* c, float* grads, size_t padded) {
    bf16_sum_over(c->dp, (uint16_t*)c->work.data(), grads, padded);
}

// The columns of P (n x r, row-major) made orthonormal: modified Gram-Schmidt, twice. A column that
// the projections leave with almost nothing (its norm shrank below 2^-20 sqrt(n) of what it was:
// rounding noise, because P has rank below r) is set to zero: normalised, the noise would be a
// false direction inside the span of the columns before it, and S would count that part twice.
inline void orthonormalise_columns(float* P, size_t n, size_t r) {
    const double keep = std::ldexp(1.0, -20) * std::sqrt((double)n);
    for (size_t j = 0; j < r; j++) {
        double before = 0.0;
        for (size_t i = 0; i < n; i++) before += (double)P[i * r + j] * P[i * r + j];
        for (int pass = 0; pass < 2; pass++) {
            for (size_t k = 0; k < j; k++) {
                double dot = 0.0;
                for (size_t i = 0; i < n; i++) dot += (double)P[i * r + j] * P[i * r + k];
                for (size_t i = 0; i < n; i++) P[i * r + j] -= (float)dot * P[i * r + k];
            }
        }
        double sq = 0.0;
        for (size_t i = 0; i < n; i++) sq += (double)P[i * r + j] * P[i * r + j];
        float scale = sq > 0.0 && std::sqrt(sq) > keep * std::sqrt(before) ? (float)(1.0 / std::sqrt(sq)) : 0.0f;
        for (size_t i = 0; i < n; i++) P[i * r + j] *= scale;
    }
}

// PowerSGD over the data-parallel ranks: grads (this rank's G) becomes S on every rank; e_next and
// q_next get this step's error and Q, committed by grad_compression_commit.
inline void powersgd_sum(GradCompression* c, float* grads) {
    PowerSGDPlan& p = c->plan;
    size_t r = (size_t)c->settings.rank;
    int N = c->dp->world_size;
    float* P = c->work.data();
    float* exact = P + p.p_floats;
    // M = G + e, in place in grads (e itself is kept until the step is committed); P = M Q
    for (const PowerSGDMatrix& mat : p.matrices) {
        float* M = grads + mat.offset;
        const float* e = c->e + mat.e_at;
        const float* Q = c->q + mat.q_at;
        float* Pm = P + mat.p_at;
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < mat.n; i++) {
            float* row = M + i * mat.m;
            for (size_t k = 0; k < mat.m; k++) row[k] += e[i * mat.m + k];
            for (size_t col = 0; col < r; col++) {
                float sum = 0.0f;
                for (size_t k = 0; k < mat.m; k++) sum += row[k] * Q[k * r + col];
                Pm[i * r + col] = sum;
            }
        }
    }
    size_t at = 0;  // the exactly summed values travel behind P, in the same all-reduce
    for (const ShardRange& x : p.exact) {
        memcpy(exact + at, grads + x.begin, x.size() * sizeof(float));
        at += x.size();
    }
    comm_allreduce_sum_identical(c->dp, P, p.p_floats + p.exact_floats, &c->scratch, "all-reduce of PowerSGD's P");
    at = 0;
    for (const ShardRange& x : p.exact) {
        memcpy(grads + x.begin, exact + at, x.size() * sizeof(float));
        at += x.size();
    }
    // P^ = orthonormalise(P); Q' = M^T P^ (blocks of columns of M per thread: each Q' element is
    // summed over the rows in order by one thread)
    for (const PowerSGDMatrix& mat : p.matrices) {
        float* Pm = P + mat.p_at;
        orthonormalise_columns(Pm, mat.n, r);
        const float* M = grads + mat.offset;
        float* Qn = c->q_next + mat.q_at;
        const size_t block = 16;
#pragma omp parallel for schedule(static)
        for (size_t k0 = 0; k0 < mat.m; k0 += block) {
            size_t k1 = std::min(mat.m, k0 + block);
            for (size_t k = k0; k < k1; k++)
                for (size_t col = 0; col < r; col++) Qn[k * r + col] = 0.0f;
            for (size_t i = 0; i < mat.n; i++)
                for (size_t k = k0; k < k1; k++)
                    for (size_t col = 0; col < r; col++) Qn[k * r + col] += M[i * mat.m + k] * Pm[i * r + col];
        }
    }
    comm_allreduce_sum_identical(c->dp, c->q_next, p.q_floats, &c->scratch, "all-reduce of PowerSGD's Q");
    // S = P^ Q'^T, the same on every rank; e_next = M - S / N, this rank's share of what S missed
    float inv_N = 1.0f / (float)N;
    for (const PowerSGDMatrix& mat : p.matrices) {
        float* M = grads + mat.offset;
        float* e = c->e_next + mat.e_at;
        const float* Pm = P + mat.p_at;
        const float* Qn = c->q_next + mat.q_at;
#pragma omp parallel for schedule(static)
        for (size_t i = 0; i < mat.n; i++) {
            for (size_t k = 0; k < mat.m; k++) {
                float s = 0.0f;
                for (size_t col = 0; col < r; col++) s += Pm[i * r + col] * Qn[k * r + col];
                e[i * mat.m + k] = M[i * mat.m + k] - s * inv_N;
                M[i * mat.m + k] = s;
            }
        }
    }
    c->pending = true;
}

// finish_gradients' data-parallel sum: compressed once the step is past the start step, else
// llmc/parallel/zero.h's exact one. Either way `grads` ends as the sum on every rank and grad_shard
// as this rank's shard of it (what the gradient norm adds up).
inline void grad_compression_reduce(GradCompression* c, Zero* z, std::vector<float>* grads) {
    int step = (int)++c->steps_done;
    if (!grad_compression_on(*c) || (c->settings.kind == GradCompressionKind::PowerSGD && !powersgd_replaces_sum(*c, step))) {
        zero_reduce_gradients(z, grads);
        return;
    }
    if (c->settings.kind == GradCompressionKind::BF16) bf16_sum(c, grads->data(), grads->size());
    else powersgd_sum(c, grads->data());
    memcpy(z->grad_shard.data(), grads->data() + z->shard.begin, z->shard.size() * sizeof(float));
}

// The step was sound and its update is applied: so are its error feedback and warm start.
// (A skipped step never gets here: its e_next and q_next are overwritten by the next step's.)
inline void grad_compression_commit(GradCompression* c) {
    if (!c->pending) return;
    std::swap(c->e, c->e_next);
    std::swap(c->q, c->q_next);
    c->pending = false;
}

// ----------------------------------------------------------------------------------------------
// In checkpoints: grad_compression_rank<r>.bin, one per data-parallel rank (docs/formats.md)

constexpr int32_t GRAD_COMPRESSION_MAGIC = 20261127;
constexpr int32_t GRAD_COMPRESSION_VERSION = 1;

struct GradCompressionHeader {
    int32_t magic = GRAD_COMPRESSION_MAGIC;
    int32_t version = GRAD_COMPRESSION_VERSION;
    int32_t kind = 0;             // 0 none, 1 bf16, 2 powersgd
    int32_t rank = 0;             // r
    int32_t start_step = 0;
    int32_t every_matrix = 0;
    int32_t dp_rank = 0, dp_world = 1;
    int64_t step = 0;
    int64_t e_floats = 0, q_floats = 0;
    int32_t reserved[64 - 14] = {0};
};
static_assert(sizeof(GradCompressionHeader) == 256, "the compression header must stay 256 bytes");

inline std::string grad_compression_file(const std::string& dir, int dp_rank) {
    return dir + strprintf("/grad_compression_rank%d.bin", dp_rank);
}

inline GradCompressionHeader grad_compression_header(const GradCompression& c, int step) {
    GradCompressionHeader h;
    h.kind = (int32_t)c.settings.kind;
    h.rank = c.settings.kind == GradCompressionKind::PowerSGD ? c.settings.rank : 0;
    h.start_step = c.settings.kind == GradCompressionKind::PowerSGD ? c.settings.start_step : 0;
    h.every_matrix = c.settings.kind == GradCompressionKind::PowerSGD && c.settings.every_matrix;
    h.dp_rank = c.dp->rank;
    h.dp_world = c.dp->world_size;
    h.step = step;
    h.e_floats = (int64_t)c.plan.e_floats;
    h.q_floats = (int64_t)c.plan.q_floats;
    return h;
}

// Every data-parallel rank writes its e and Q (the committed ones, in host memory: the CPU trainer's
// own, the GPU trainer's downloaded) into the checkpoint directory.
inline void grad_compression_save(const GradCompression& c, const std::string& dir, int step, const float* e, const float* q) {
    if (!grad_compression_on(c)) return;
    GradCompressionHeader h = grad_compression_header(c, step);
    AtomicFile out(grad_compression_file(dir, c.dp->rank), "gradient-compression file");
    out.write(&h, sizeof(h));
    out.write(e, c.plan.e_floats * sizeof(float));
    out.write(q, c.plan.q_floats * sizeof(float));
    out.commit();
}
inline void grad_compression_save(const GradCompression& c, const std::string& dir, int step) {
    grad_compression_save(c, dir, step, c.e, c.q);
}

inline std::string describe_compression(int32_t kind, int32_t r, int32_t start, int32_t world) {
    if (kind == (int32_t)GradCompressionKind::None) return "--grad-compression none";
    if (kind == (int32_t)GradCompressionKind::PowerSGD) {
        return strprintf("--grad-compression powersgd --powersgd-rank %d --powersgd-start-step %d on %d ranks", r, start, world);
    }
    return strprintf("--grad-compression %s on %d ranks", grad_compression_name((GradCompressionKind)kind), world);
}

// Resuming: the checkpoint's compression must be this run's (the same method, rank, start step and
// data-parallel ranks; a checkpoint without the files was written without compression), and then
// e and Q are read back, so the resumed run continues bit for bit. Anything else is refused with
// one line: restarting e at zero would silently change the run.
// e and q: where e and Q go (host memory of e_floats and q_floats; the CPU trainer's own arrays).
inline void grad_compression_load(GradCompression* c, const std::string& dir, int64_t step, float* e, float* q) {
    std::string path = grad_compression_file(dir, c->dp->rank);
    GradCompressionHeader h, want = grad_compression_header(*c, (int)step);
    h.kind = (int32_t)GradCompressionKind::None;
    h.dp_world = want.dp_world;
    FILE* f = file_exists(path) ? open_for_reading(path, "gradient-compression file") : nullptr;
    if (f) {
        read_exactly(f, &h, sizeof(h), path, "gradient-compression file");
        if (h.magic != GRAD_COMPRESSION_MAGIC || h.version != GRAD_COMPRESSION_VERSION) {
            fail("'%s' is not a gradient-compression file of version %d: resume from a checkpoint written by this program",
                 path.c_str(), GRAD_COMPRESSION_VERSION);
        }
    }
    bool none = want.kind == (int32_t)GradCompressionKind::None;
    if (h.kind != want.kind || h.rank != want.rank || h.start_step != want.start_step || h.every_matrix != want.every_matrix ||
        (!none && h.dp_world != want.dp_world)) {
        fail("checkpoint '%s' was written with %s, this run has %s: the error feedback and Q belong to those settings; "
             "resume with the same gradient compression and data-parallel ranks", dir.c_str(),
             describe_compression(h.kind, h.rank, h.start_step, h.dp_world).c_str(),
             describe_compression(want.kind, want.rank, want.start_step, want.dp_world).c_str());
    }
    if (c->settings.kind == GradCompressionKind::PowerSGD) {
        if (h.step != step || h.e_floats != want.e_floats || h.q_floats != want.q_floats || h.dp_rank != want.dp_rank) {
            fail("'%s' does not belong with this checkpoint (step %lld of rank %d, %lld + %lld floats; expected step %lld of "
                 "rank %d, %lld + %lld): it is mixed up", path.c_str(), (long long)h.step, h.dp_rank, (long long)h.e_floats,
                 (long long)h.q_floats, (long long)step, want.dp_rank, (long long)want.e_floats, (long long)want.q_floats);
        }
        read_exactly(f, e, c->plan.e_floats * sizeof(float), path, "gradient-compression file");
        read_exactly(f, q, c->plan.q_floats * sizeof(float), path, "gradient-compression file");
    }
    if (f) fclose(f);
}
inline void grad_compression_load(GradCompression* c, const std::string& dir, int64_t step) {
    grad_compression_load(c, dir, step, c->e, c->q);
}
