// moe_zero.cuh — the MoE table over data-parallel GPUs: its gradient summed over the data group, and
// with --zero 1|2 its AdamW moments sharded as the dense table's are.
//
// Read llmc/model/moe_gpu.cuh (the MoE table on one GPU) and llmc/parallel/zero.cuh (ZeRO on GPUs)
// first; the CPU trainer's twin is llmc/parallel/expert_parallel.h's MoESharing (moe_zero_reduce,
// moe_zero_share), which this follows without expert parallelism: one segment, the whole table,
// over every data-parallel rank.
//
// What it teaches: the MoE table is a second flat parameter table beside the dense one (its own
// gradient, m and v: moe_gpu.cuh), so ZeRO-1 for it is ZeRO-1's recipe again, on one array:
//
//   ZeRO-0   sum  reduce-scatter + all-gather (gpu_all_reduce_identical: every rank the same bits)
//            update  every rank runs AdamW on the whole table, m and v whole
//   ZeRO-1   sum  the reduce-scatter only: rank r's shard of the table holds the summed gradient
//            update  rank r runs AdamW on its shard (m and v are that shard only), then an
//                    all-gather of the updated bf16 weights
//
// The same bytes on the wire (a reduce-scatter and an all-gather of the table, bf16), the same sums
// (the reduce-scatter is the all-reduce's first half), the same per-element update (AdamW seeds each
// element's stochastic rounding by its index, moe_gpu_adamw): ZeRO-1's weights are ZeRO-0's bit for
// bit. What it saves: m and v, 8 bytes a value, divided by the data group's size. The gradient stays
// whole on every rank, also at --zero 2 (the table is not among the units the backward reduce-scatters,
// llmc/parallel/zero.h): ZeRO-2's bucket arithmetic for it would be a second copy of zero.cuh's, and
// the MoE blocks' backward adds into the table in place, block after block. So --zero 2 shards the
// same thing for the MoE table as --zero 1 does, as on the CPU.
//
// The norm: each rank counts the squares of its own shard of the summed table (every value once in
// the world, zero.h's rule), at both stages, so ZeRO-0 and ZeRO-1 add the same partial sums.
//
// Shards: moe_table_shards (llmc/memory/moe_sizes.h: shard_layout in 64-value granules, so that every
// shard is aligned for the kernels' 16-byte loads), the last rank's cut short by the padding; the
// table's rows in the size table (moe_params, moe_grads) are padded to N shards so that the
// collectives work in place. (The CPU's shards are ceil(n / N) values: the bytes differ by the padding.)
//
// Streams: everything here runs on ZeRO's communication stream (the same GpuComm as the dense sums,
// so the host's one zero_wait_reduction waits for both). It starts after an event on the compute
// stream (the compute stream's work so far is done), and ends with an event the compute stream
// waits for on the device: no host synchronisation of its own.
//
// Checkpoints: moe_state.bin keeps one layout, the whole table's m and v (formats.h): at a checkpoint
// the ranks all-gather their shards on the host and rank 0 writes them; on resume every rank reads
// the whole file and keeps its shard. So any data-parallel size and stage resumes any other.
//
// Hook points (train_gpt.cu): finish_gradients calls moe_zero_sum before ZeRO's wait and counts
// moe_zero_norm_piece; optimizer_step runs moe_gpu_adamw on moe_zero_updated, then moe_zero_share_weights.
#pragma once

#include <utility>
#include <vector>
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/memory/gpu_buffers.h"
#include "llmc/parallel/comm.h"
#include "llmc/parallel/comm_nccl.cuh"
#include "llmc/parallel/sharding.h"

struct MoEZeroGpu {
    GpuComm* comm = nullptr;      // the data-parallel group on the GPU (ZeRO's: the same stream)
    int stage = 0;                // 0: every rank updates the whole table; 1 or 2: its shard (m, v that shard)
    ShardLayout shards;           // the table over the group: the padding of the moe_* rows
    ShardRange owned;             // this rank's real values of the table
    cudaEvent_t ready = nullptr;  // compute stream -> communication stream
    cudaEvent_t done = nullptr;   // communication stream -> compute stream
};

inline void moe_zero_gpu_init(MoEZeroGpu* z, int zero_stage, GpuComm* comm, size_t n) {
    z->comm = comm;
    z->stage = comm->host->world_size > 1 ? zero_stage : 0;
    z->shards = moe_table_shards(n, comm->host->world_size);  // (the moe_* rows' padding: moe_sizes.h)
    z->owned = owned_range(z->shards, comm->host->rank);
    CUDA_CHECK(cudaEventCreateWithFlags(&z->ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&z->done, cudaEventDisableTiming));
}

inline void moe_zero_gpu_destroy(MoEZeroGpu* z) {
    if (z->ready) CUDA_CHECK(cudaEventDestroy(z->ready));
    if (z->done) CUDA_CHECK(cudaEventDestroy(z->done));
}

// Runs `collective` on the communication stream between the compute stream's work so far and its
// work to come: the two events, no host wait.
template <class F>
inline void moe_zero_on_comm_stream(MoEZeroGpu* z, cudaStream_t compute, F collective) {
    CUDA_CHECK(cudaEventRecord(z->ready, compute));
    CUDA_CHECK(cudaStreamWaitEvent(z->comm->stream, z->ready, 0));
    collective();
    CUDA_CHECK(cudaEventRecord(z->done, z->comm->stream));
    CUDA_CHECK(cudaStreamWaitEvent(compute, z->done, 0));
}

// After the last backward: the table's gradient summed over the group. ZeRO-0: on every rank, the
// same bits; ZeRO-1/2: each rank's shard only (the rest of the table keeps this rank's own values,
// which nothing reads: the update and the norm read the shard).
inline void moe_zero_sum(MoEZeroGpu* z, floatX* grads, cudaStream_t compute) {
    int N = z->comm->host->world_size;
    if (N == 1) return;
    size_t shard = z->shards.shard_size;
    moe_zero_on_comm_stream(z, compute, [&] {
        if (z->stage == 0)
            gpu_all_reduce_identical(z->comm, grads, z->shards.padded_total, NCCL_FLOATX, "all-reduce of the MoE table's gradients");
        else  // (in place: NCCL allows the output to be the input's own shard)
            gpu_reduce_scatter_sum(z->comm, grads, grads + (size_t)z->comm->host->rank * shard, shard, NCCL_FLOATX,
                                   "reduce-scatter of the MoE table's gradients (ZeRO-1/2)");
    });
}

// The part of the summed gradient this rank adds to the squared norm: its shard, at every stage.
inline std::pair<const floatX*, size_t> moe_zero_norm_piece(const MoEZeroGpu& z, const floatX* grads) {
    return {grads + z.owned.begin, z.owned.size()};
}

// What this rank's AdamW updates: the whole table (ZeRO-0), or its shard. m and v start at its begin.
inline ShardRange moe_zero_updated(const MoEZeroGpu& z) {
    return z.stage == 0 ? ShardRange{0, z.shards.total} : z.owned;
}

// ZeRO-1/2, after the update: every rank gets every shard of the updated weights.
inline void moe_zero_share_weights(MoEZeroGpu* z, floatX* params, cudaStream_t compute) {
    if (z->stage == 0) return;
    moe_zero_on_comm_stream(z, compute, [&] {
        gpu_all_gather(z->comm, params, z->shards.shard_size, NCCL_FLOATX, "all-gather of the MoE table's weights (ZeRO-1/2)");
    });
}

// ZeRO-1/2, for --dump-state only: the whole summed gradient on every rank (the shards all-gathered).
inline void moe_zero_gather_gradient(MoEZeroGpu* z, floatX* grads, cudaStream_t compute) {
    if (z->stage == 0) return;
    moe_zero_on_comm_stream(z, compute, [&] {
        gpu_all_gather(z->comm, grads, z->shards.shard_size, NCCL_FLOATX, "all-gather of the MoE table's gradients (a dump)");
    });
}

// A checkpoint's moments: the whole table's from every rank's shard (`mine`: this rank's values,
// moe_zero_updated's length), all-gathered on the host over `dp` (every rank calls).
inline std::vector<float> moe_zero_whole_moments(const MoEZeroGpu& z, Comm* dp, const std::vector<float>& mine) {
    if (z.stage == 0) return mine;
    std::vector<float> all(z.shards.padded_total, 0.0f);
    std::copy(mine.begin(), mine.end(), all.begin() + (ptrdiff_t)z.owned.begin);
    comm_all_gather(dp, all.data(), z.shards.shard_size * sizeof(float), "all-gather of the MoE table's moments (a checkpoint)");
    all.resize(z.shards.total);
    return all;
}
