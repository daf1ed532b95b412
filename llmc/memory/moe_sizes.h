// moe_sizes.h — the size tables' MoE and expert-parallel rows: how big, and why padded.
//
// Host-only arithmetic for the rows --moe-experts (llmc/model/moe.h, llmc/model/moe_gpu.cuh) and
// --expert-parallel (llmc/parallel/expert_parallel.h, .cuh) add to llmc/memory/cpu_buffers.h and
// llmc/memory/gpu_buffers.h, so that those tables stay one row per buffer, as PowerSGD's rows come
// from grad_compression_sizes (llmc/parallel/grad_compression.h).
//
// The MoE table (routers and experts 1..E-1; expert 0 is the dense MLP) is summed over the
// data-parallel ranks so that every rank holds the same bits afterwards. A sum that cuts a table of
// n values into N equal shards (a reduce-scatter and an all-gather) needs the table padded to a
// multiple of N, or a padded copy of it as scratch:
//   GPU  the table and its gradient themselves are padded (the sum works in place), in SHARD_GRANULE
//        pieces so that every shard starts 128 bytes aligned (llmc/parallel/moe_zero.cuh);
//        --zero 1|2 keeps m and v of one shard only
//   CPU  the table is exactly n values; the sum's scratch holds the padded copy and one shard
//        (identical_scratch_floats), or with --grad-compression bf16 the padded copy, send and receive
// With --expert-parallel a rank holds every router and its own experts; the routers are summed over
// all data-parallel ranks, the experts over their replicas (dp / N_ep ranks), so each part is padded
// for its own group. An owner's experts may receive every rank's every choice: N_ep k B T rows, which
// sizes its exchange buffers for the worst case.
#pragma once

#include <algorithm>
#include <cstddef>
#include <string>
#include "llmc/kernels/scratch_sizes.h"  // bias_backward_partials_floats
#include "llmc/model/model.h"
#include "llmc/optim/optimizer_state.h"  // moe_param_blocks: the factored optimizers' MoE state
#include "llmc/parallel/grad_compression.h"  // identical_scratch_floats: the exact sum's scratch
#include "llmc/parallel/sharding.h"
#include "llmc/utils.h"

// What the MoE rows depend on, for one rank of either trainer.
struct MoESizing {
    MoEConfig moe;              // --moe-experts, --moe-every
    int top_k = 1;              // --moe-top-k: rows each MoE block gathers per token
    int expert_parallel = 1;    // --expert-parallel: the expert group's size N_ep
    int expert_rank = 0;        // ... and this rank's place in it
    int dp = 1, zero_stage = 0; // data-parallel ranks, ZeRO stage
    size_t BT = 0;              // tokens of a micro-batch
};

// The MoE table this rank holds: the whole (routers, experts 1..E-1), or with --expert-parallel the
// routers and its own experts (llmc/parallel/expert_parallel.h says which).
inline MoELayout moe_held_layout(const GPT2Config& c, const MoESizing& m) {
    return moe_layout(c, m.moe, moe_held_experts(m.moe, m.expert_parallel, m.expert_rank));
}

// --moe-experts over data-parallel GPUs: the MoE table's shards, which its rows are padded to and
// --zero 1|2 keeps m and v of (llmc/parallel/moe_zero.cuh). In SHARD_GRANULE pieces, as the dense
// table's: each shard starts 128 bytes aligned, as the norm's 16-byte loads need (with 3 ranks and a
// granule of 1 rank 2's shard started at an odd element and its squares came out NaN)
inline ShardLayout moe_table_shards(size_t n, int dp) { return shard_layout(n, dp); }

// ==============================================================================================
// The GPU trainer's rows (llmc/model/moe_gpu.cuh, llmc/parallel/expert_parallel.cuh), in elements

struct GPUMoESizes {
    size_t params = 0, grads = 0, moments = 0;  // moe_params, moe_grads, each of moe_adam_m and _v
    std::string params_shape, grads_shape, moments_shape;
    size_t routing = 0, activations = 0, scratch = 0;  // per MoE block, and the backward's rows once
    size_t ep_rows = 0, ep_scratch = 0, ep_counts = 0;  // --expert-parallel's exchange
    size_t ep_bias_partials = 0;  // the bias gradient's partials of an owner's N_ep B T rows
};

inline GPUMoESizes gpu_moe_sizes(const GPT2Config& c, const MoESizing& m) {
    GPUMoESizes z;
    MoELayout held = moe_held_layout(c, m);
    size_t BT = m.BT, C = c.channels;
    size_t moe = held.total, Lm = moe_block_count(m.moe, c.num_layers), kN = (size_t)m.top_k * BT;
    size_t E = (size_t)m.moe.experts, H = 4 * C, ep = (size_t)m.expert_parallel;
    // The table and its gradient padded so that their sums work in place, every rank the same bits: to
    // a multiple of the data-parallel ranks (llmc/parallel/moe_zero.cuh); with --expert-parallel only the
    // gradient, its experts' part to a multiple of their replicas, dp / N_ep (ep_gpu_sum_gradients
    // sums the routers over the data group, the experts over their replicas; no ZeRO there)
    z.params = z.grads = z.moments = moe;
    z.params_shape = "router (Lm, E, C) + experts 1..E-1", z.grads_shape = "as moe_params";
    z.moments_shape = "as moe_params, fp32";
    if (moe > 0 && ep > 1) {
        size_t router = held.count[MOE_ROUTER], replicas = (size_t)m.dp / ep;
        z.grads = router + (moe - router + replicas - 1) / replicas * replicas;
        z.params_shape = "router (Lm, E, C) + this rank's experts";
        z.grads_shape = "as moe_params, the experts padded to a multiple of dp/N_ep";
    } else if (moe > 0) {
        ShardLayout moe_shards = moe_table_shards(moe, m.dp);
        z.params = z.grads = moe_shards.padded_total;
        if (m.dp > 1) z.params_shape += ", padded to a multiple of dp", z.grads_shape += ", padded to a multiple of dp";
        if (m.dp > 1 && m.zero_stage >= 1) z.moments = moe_shards.shard_size, z.moments_shape = "a 1/dp shard of moe_params, fp32";
    }
    // per MoE block the routing (fp32 and int32) and the k B T rows its experts gather (xg, fc, GELU,
    // out); the backward's rows (drow, dh, dxg) once
    z.routing = Lm * (E > 0 ? moe_gpu_routing_values(BT, E, m.top_k) : 0);
    z.activations = Lm * kN * (2 * C + 2 * H);
    z.scratch = Lm > 0 ? kN * (2 * C + H) : 0;
    // --expert-parallel: an owner receives at most N_ep k B T rows (every rank's every choice to its
    // experts), kept per MoE block for the backward (x, fc, GELU, out); the exchange's staging and the
    // backward's rows (dout, dh, dx) once; the count exchange's ints
    size_t ep_R = ep > 1 && Lm > 0 ? ep * kN : 0;
    z.ep_rows = Lm * ep_R * (2 * C + 2 * H);
    z.ep_scratch = ep_R * (3 * C + H);
    z.ep_counts = ep_R > 0 ? 2 * E : 0;
    // (an owner's expert sees up to N_ep B T rows: expert_parallel.cuh)
    if (ep > 1) z.ep_bias_partials = bias_backward_partials_floats(ep * BT, 4 * C);
    return z;
}

// ==============================================================================================
// The CPU trainer's rows (llmc/model/moe.h, llmc/parallel/expert_parallel.h), in floats
// (MoE runs on one slice: cli.h refuses it with tensor and pipeline parallelism and ZeRO-3)

struct CPUMoESizes {
    size_t params = 0, moments = 0;  // moe_params and moe_grads; each of moe_adam_m and _v
    std::string params_shape;
    const char* moments_shape = "";
    size_t factored = 0;             // --optimizer adafactor|sm3 instead of m and v
    size_t activations = 0;          // what every MoE block keeps for its backward
    size_t sum_scratch = 0;          // the data-parallel sum of moe_grads
    const char* sum_scratch_shape = "";
    size_t ep_exchange = 0;          // --expert-parallel's buffers, every MoE block's
};

// `adamw`: m and v (else a factored optimizer's statistics); `bf16_sum`: --grad-compression bf16.
inline CPUMoESizes cpu_moe_sizes(const GPT2Config& c, const MoESizing& m, bool adamw, bool bf16_sum) {
    CPUMoESizes z;
    MoELayout held = moe_held_layout(c, m);
    size_t BT = m.BT, C = c.channels;
    size_t moe = held.total, router = held.count[MOE_ROUTER], Lm = moe_block_count(m.moe, c.num_layers);
    std::string experts = m.expert_parallel == 1 ? std::string("experts 1..E-1")
                        : held.held_experts == 0 ? std::string("no expert (its one is the dense MLP)")
                                                 : strprintf("its experts %d..%d", held.first_expert, held.first_expert + held.held_experts - 1);
    z.params = moe;
    z.params_shape = "router (Lm, E, C) + " + experts;
    // --zero 1|2: each rank ceil(n / N) of the n values N ranks share (llmc/parallel/expert_parallel.h's
    // moe_sharing): the routers over all data-parallel ranks, the held experts over their replicas
    auto shard = [](size_t n, int N) { return (n + (size_t)N - 1) / (size_t)N; };
    z.moments = !adamw ? 0 : m.zero_stage == 0 || moe == 0 ? moe
              : m.expert_parallel == 1 ? shard(moe, m.dp)
                                       : shard(router, m.dp) + shard(moe - router, m.dp / m.expert_parallel);
    z.moments_shape = m.zero_stage >= 1 ? "its shard of moe_params" : "as moe_params";
    // --optimizer adafactor|sm3: rows + cols per expert matrix and router, n per vector (optimizer_state.h)
    if (!adamw)
        for (const ParamBlock& b : moe_param_blocks(c, held)) z.factored += b.state_floats();
    z.activations = Lm * (m.moe.experts > 0 ? moe_activation_values(BT, C, m.moe.experts, m.top_k) : 0);
    // the data-parallel sum of moe_grads gives every rank the same bits (each rank then updates the table itself);
    // with --expert-parallel two sums share it: the routers' over all ranks, the experts' over their replicas
    int replicas = m.dp / m.expert_parallel;
    z.sum_scratch = m.expert_parallel == 1 ? (moe > 0 && m.dp > 1 ? identical_scratch_floats(moe, m.dp) : 0)
                  : std::max(identical_scratch_floats(router, m.dp),
                             replicas > 1 ? identical_scratch_floats(moe - router, replicas) : 0);
    if (bf16_sum && moe > 0 && m.dp > 1) {  // the padded copy + bf16 send and receive
        auto padded = [](size_t n, int N) { return (n + (size_t)N - 1) / (size_t)N * (size_t)N; };
        z.sum_scratch = m.expert_parallel == 1 ? 2 * padded(moe, m.dp)
                      : std::max(2 * padded(router, m.dp), replicas > 1 ? 2 * padded(moe - router, replicas) : 0);
    }
    z.sum_scratch_shape = bf16_sum ? "the bf16 sum's padded copy, send and receive" : "the all-reduce's padded copy + a shard";
    // per MoE block, sized for the worst case (every rank's k B T rows to one owner): R = N_ep k B T rows
    // of staging, x, out, dout, dx (C) and fch, fch_gelu, dh (4C); the counts: 3 E + 2 N_ep ints
    size_t ep_rows = (size_t)m.expert_parallel * m.top_k * BT;
    z.ep_exchange = m.expert_parallel > 1 ? Lm * (ep_rows * 17 * C + 3 * (size_t)m.moe.experts + 2 * (size_t)m.expert_parallel) : 0;
    return z;
}
