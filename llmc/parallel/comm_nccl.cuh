// comm_nccl.cuh — the gradient exchange between GPUs: NCCL communicators, stall detection, and a
// host-staged fallback for several ranks on one GPU. The host side (ranks, MPI, failing together)
// is llmc/parallel/comm.h, with the rendezvous in llmc/parallel/rendezvous.h; read those first.
//
// NCCL runs collectives as CUDA kernels that move data GPU to GPU over NVLink, PCIe or the network
// (InfiniBand, RoCE), choosing rings or trees by itself. The same collectives as comm.h, with the
// same costs (N ranks, P values of b bytes): all-reduce 2 (N-1)/N * P*b per rank, reduce-scatter and
// all-gather (N-1)/N * P*b each. A call only ENQUEUES the kernel on a CUDA stream and returns; the
// bytes move later, which is what lets the trainer overlap communication with the backward pass:
//
//     compute stream:  backward L-1 | backward L-2 | backward L-3 | ...
//     comm stream:                  | reduce layer L-1's grads | reduce L-2's | ...
//   (the comm stream waits on a cudaEvent recorded after each bucket's backward; the optimizer
//    waits on the comm stream)
//
// The communication stream belongs to this file: gpu_comm_init creates it NON-BLOCKING, i.e. not
// synchronised with CUDA's legacy default stream. A plain cudaMemcpy runs on that default stream and
// waits for every blocking stream; if an NCCL kernel waiting for a dead peer sat on a blocking
// stream, an innocent cudaMemcpy anywhere in the trainer would hang with no deadline to catch it.
// For the same reason the trainer never makes its compute stream wait for this stream on the GPU:
// where it needs a collective's result, the HOST waits, in gpu_comm_wait, against the deadline.
//
// Setup: every rank needs the same 128-byte ncclUniqueId, made by rank 0 (ncclGetUniqueId). With
// MPI it is broadcast; without (plain srun) it goes through LLMC_RENDEZVOUS (rendezvous.h). Then each rank
// calls ncclCommInitRankConfig(world, id, rank) on its own GPU: local_rank % (GPUs on the node).
//
// Failure: a kernel waiting for a peer that died waits forever, and the host never notices
// (enqueueing succeeded long ago). So the communicator is NON-BLOCKING (config.blocking = 0): no
// NCCL call ever blocks the host, and a call that is still connecting returns ncclInProgress.
// Wherever the host must know that communication finished, gpu_comm_wait() polls cudaStreamQuery
// (done?) and ncclCommGetAsyncError (failed?) against the same deadline as comm.h (--comm-timeout);
// on error or timeout it prints what stalled, ncclCommAbort()s (which frees the GPU from the stuck
// kernels) and stops every rank. ncclGetLastError adds NCCL's own explanation to the message.
//
// Several ranks on one GPU (to test 2 or 4 ranks on a machine with one GPU): NCCL refuses two ranks
// on one device. Then the communicator is replaced by HOST STAGING: copy to host memory, run comm.h's
// MPI collective, copy back. Slow, but the same arithmetic contract, so a test can compare
// 2 and 4 ranks on one GPU against one rank. LLMC_HOST_STAGED=1 forces it.
//
// On a process grid (llmc/parallel/process_grid.h) every group (tensor, data, pipeline) gets a GpuComm of its
// own: its host Comm (comm_split), its own communication stream, and an NCCL communicator split from
// the world's (gpu_comm_init_group). Three more operations serve the grid: an all-reduce that gives
// every rank the same bits (tensor parallelism's replicas), an all-reduce of maxima (the vocabulary-
// parallel loss), and point-to-point sends and receives (pipelines).
//
// Beyond comm.h's collectives (and broadcast and all-to-all, which dev/comm/comm_bench measures) there
// are two more here:
//   - reduce to owners (gpu_reduce_to_owners): every piece of some ranges of a flat array summed
//     onto the rank whose ZeRO shard holds it; one ncclReduce per piece, in one NCCL group. It is
//     a reduce-scatter with pieces of any size, which is what a bucket of layers needs (sharding.h);
//   - numbers (gpu_comm_sum, gpu_comm_barrier): the step's loss, the gradient norm's sum of squares,
//     and checkpoint barriers, over the same transport as the tensors, so that a run launched by
//     srun without MPI needs no MPI for anything but finding its peers (and not even that, with
//     LLMC_RENDEZVOUS).
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/parallel/rendezvous.h"
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/parallel/sharding.h"

// The trainer's element type (bf16, or fp32 in the debugging build), as NCCL names it.
constexpr ncclDataType_t NCCL_FLOATX = FLOATX_IS_FP32 ? ncclFloat32 : FLOATX_IS_FP16 ? ncclFloat16 : ncclBfloat16;

struct GpuComm {
    Comm* host = nullptr;
    int device = 0;
    bool host_staged = false;       // several ranks share this GPU: MPI through host memory, no NCCL
    ncclComm_t nccl = nullptr;
    cudaStream_t stream = nullptr;  // where the collectives run: created here, non-blocking (see above)
    std::vector<float> staging;     // host copies for the host-staged mode
    std::vector<float> staging_scratch;  // ... and comm_allreduce_sum_identical's
    double* numbers = nullptr;      // NCCL mode: world_size doubles on the device, for gpu_comm_gather
    double* host_numbers = nullptr; // ... and their pinned host copy
    CommCounters sent;              // the bytes this rank sent through the group's tensor collectives, in
                                    // their own type (bf16: 2 bytes), by comm.h's ring convention, either mode
};

inline void gpu_count(GpuComm* g, CommOp op, uint64_t bytes) {
    g->sent.calls[op]++;
    g->sent.bytes[op] += bytes;
}

[[noreturn]] inline void gpu_comm_fail(GpuComm* g, const char* what, const char* why) {
    const char* detail = g->nccl ? ncclGetLastError(g->nccl) : "";
    fprintf(stderr, "error: rank %d of %d: %s: %s%s%s. Stopping all ranks\n", g->host->rank, g->host->world_size, what, why,
            detail && *detail ? "; NCCL says: " : "", detail ? detail : "");
    if (g->nccl) ncclCommAbort(g->nccl);  // releases the GPU from kernels waiting on dead peers
    g->nccl = nullptr;
    comm_abort(EXIT_BAD_INPUT);
}

inline void gpu_cuda_check(GpuComm* g, cudaError_t err, const char* call, const char* what) {
    if (err != cudaSuccess) gpu_comm_fail(g, what, strprintf("%s failed: %s", call, cudaGetErrorString(err)).c_str());
}
#define GPU_COMM_CUDA(g, call, what) gpu_cuda_check(g, (call), #call, what)

inline void gpu_deadline_check(GpuComm* g, std::chrono::steady_clock::time_point start, const char* what) {
    if (g->host->timeout_s > 0 && comm_seconds_since(start) > g->host->timeout_s) {
        gpu_comm_fail(g, what, strprintf("did not complete within %g s (--comm-timeout): another rank has crashed, "
                                         "hung, or fallen far behind", g->host->timeout_s).c_str());
    }
}

// Checks an NCCL call's result. In non-blocking mode a call may answer ncclInProgress (it is still
// connecting to its peers): poll the communicator until it settles, under the deadline.
inline void gpu_nccl_check(GpuComm* g, ncclResult_t result, const char* call, const char* what) {
    auto start = std::chrono::steady_clock::now();
    while (result == ncclInProgress) {
        gpu_deadline_check(g, start, what);
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (ncclCommGetAsyncError(g->nccl, &result) != ncclSuccess) break;
    }
    if (result != ncclSuccess) gpu_comm_fail(g, what, strprintf("%s failed: %s", call, ncclGetErrorString(result)).c_str());
}
#define GPU_COMM_NCCL(g, call, what) gpu_nccl_check(g, (call), #call, what)

// Polls `done` (a cudaStreamQuery or cudaEventQuery) until it answers cudaSuccess, checking NCCL's
// asynchronous error and the deadline on the way: a peer that died turns into an error here.
template <class Query>
inline void gpu_comm_poll(GpuComm* g, const char* what, Query done_query) {
    auto start = std::chrono::steady_clock::now();
    for (long polls = 0;; polls++) {
        cudaError_t done = done_query();
        if (done == cudaSuccess) return;
        if (done != cudaErrorNotReady) gpu_cuda_check(g, done, "cudaStreamQuery", what);
        if (g->nccl) {
            ncclResult_t async = ncclSuccess;
            GPU_COMM_NCCL(g, ncclCommGetAsyncError(g->nccl, &async), what);
            if (async != ncclSuccess && async != ncclInProgress) {
                gpu_comm_fail(g, what, strprintf("NCCL reported %s", ncclGetErrorString(async)).c_str());
            }
        }
        gpu_deadline_check(g, start, what);
        if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
}

// Waits until everything enqueued on the communication stream has finished: call it where the
// host needs the result (before the optimizer reads the gradient norm, before a checkpoint), not
// after every collective, or the overlap with the backward pass is lost.
inline void gpu_comm_wait(GpuComm* g, const char* what) {
    gpu_comm_poll(g, what, [&] { return cudaStreamQuery(g->stream); });
}

// Waits for one operation only: `event`, recorded on the communication stream right after it. The
// operations queued behind it go on (ZeRO-3's prefetch of the next layer, say).
inline void gpu_comm_wait_event(GpuComm* g, cudaEvent_t event, const char* what) {
    gpu_comm_poll(g, what, [&] { return cudaEventQuery(event); });
}

// Picks this rank's GPU (and makes it current), creates the communication stream on it, and builds
// the communicator. `host` must have been set up by comm_init. Call before creating any other
// stream or buffer: they belong to the device current when they are made.
inline void gpu_comm_init(GpuComm* g, Comm* host) {
    g->host = host;
    int devices = 0;
    GPU_COMM_CUDA(g, cudaGetDeviceCount(&devices), "finding the GPUs");
    if (devices == 0) fail("rank %d sees no GPU: the GPU trainer needs one per rank (or LLMC_HOST_STAGED=1 to share)", host->rank);
    g->device = host->local_rank % devices;
    GPU_COMM_CUDA(g, cudaSetDevice(g->device), "selecting this rank's GPU");
    GPU_COMM_CUDA(g, cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking), "creating the communication stream");
    const char* forced = getenv("LLMC_HOST_STAGED");
    g->host_staged = host->world_size > 1 && (host->local_size > devices || (forced && !strcmp(forced, "1")));
    if (host->world_size == 1 || g->host_staged) {
        if (g->host_staged) comm_require_mpi(host, "sharing one GPU between ranks (host-staged collectives)");
        return;
    }
    GPU_COMM_CUDA(g, cudaMalloc(&g->numbers, host->world_size * sizeof(double)), "allocating the communication buffers");
    GPU_COMM_CUDA(g, cudaMallocHost(&g->host_numbers, host->world_size * sizeof(double)), "allocating the communication buffers");
    ncclUniqueId id;
    memset(&id, 0, sizeof(id));
    if (host->rank == 0) GPU_COMM_NCCL(g, ncclGetUniqueId(&id), "creating the NCCL unique id");
    if (host->mpi) {
        comm_broadcast(host, &id, sizeof(id), 0, "broadcast of the NCCL unique id");
    } else {
        rendezvous_share(&id, sizeof(id), host->rank, host->world_size, getenv("LLMC_RENDEZVOUS"), host->timeout_s);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommInitRankConfig(&g->nccl, host->world_size, id, host->rank, &config);
    GPU_COMM_NCCL(g, r, "creating the NCCL communicator");
}

// A group of a process grid (llmc/parallel/process_grid.h): `group` is its host Comm (from comm_split with
// this `color` and `key`), `world` the world's GpuComm, already set up. The group gets its own
// communication stream and an NCCL communicator split from the world's: ncclCommSplit is collective
// over the world, so every rank calls this for every kind of group, in the same order, and a rank
// alone in its group takes part too, with NCCL_SPLIT_NOCOLOR (skipping the call there would leave
// the other ranks waiting in theirs: groups of different sizes, e.g. 3 ranks split in 2 + 1).
inline void gpu_comm_init_group(GpuComm* g, GpuComm* world, Comm* group, int color, int key, const char* what) {
    g->host = group;
    g->device = world->device;
    g->host_staged = world->host_staged;
    GPU_COMM_CUDA(g, cudaStreamCreateWithFlags(&g->stream, cudaStreamNonBlocking), what);
    if (world->nccl == nullptr) return;
    bool alone = group->world_size == 1;
    if (!alone) {
        GPU_COMM_CUDA(g, cudaMalloc(&g->numbers, group->world_size * sizeof(double)), what);
        GPU_COMM_CUDA(g, cudaMallocHost(&g->host_numbers, group->world_size * sizeof(double)), what);
    }
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclResult_t r = ncclCommSplit(world->nccl, alone ? NCCL_SPLIT_NOCOLOR : color, key, &g->nccl, &config);
    GPU_COMM_NCCL(alone ? world : g, r, what);  // a rank left out has no new communicator: poll the world's
}

// Every rank calls this at the end, before comm_finalize (a grid's groups before the world).
inline void gpu_comm_finalize(GpuComm* g) {
    if (g->nccl) {
        gpu_comm_wait(g, "finishing communication");
        GPU_COMM_NCCL(g, ncclCommFinalize(g->nccl), "closing the NCCL communicator");
        gpu_comm_wait(g, "closing the NCCL communicator");
        GPU_COMM_NCCL(g, ncclCommDestroy(g->nccl), "destroying the NCCL communicator");
        g->nccl = nullptr;
    }
    if (g->numbers) GPU_COMM_CUDA(g, cudaFree(g->numbers), "freeing the communication buffers");
    if (g->host_numbers) GPU_COMM_CUDA(g, cudaFreeHost(g->host_numbers), "freeing the communication buffers");
    g->numbers = g->host_numbers = nullptr;
    if (g->stream) GPU_COMM_CUDA(g, cudaStreamDestroy(g->stream), "destroying the communication stream");
    g->stream = nullptr;
}

// ----------------------------------------------------------------------------------------------
// Collectives on device arrays: fp32, bf16 or fp16 (ncclFloat32 / ncclBfloat16 / ncclFloat16). Host
// staging sums in fp32: bf16 and fp16 values are widened on the host, summed, and rounded back (to nearest).

inline size_t gpu_dtype_bytes(ncclDataType_t t) { return t == ncclBfloat16 || t == ncclFloat16 ? 2 : 4; }

// Device -> host fp32 (widening bf16 or fp16), for host staging. Waits for the copy.
inline void gpu_stage_to_host(GpuComm* g, const void* src, size_t n, ncclDataType_t t, float* dst, const char* what) {
    if (t == ncclFloat32) {
        GPU_COMM_CUDA(g, cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToHost, g->stream), what);
        gpu_comm_wait(g, what);
        return;
    }
    std::vector<uint16_t> half(n);
    GPU_COMM_CUDA(g, cudaMemcpyAsync(half.data(), src, n * 2, cudaMemcpyDeviceToHost, g->stream), what);
    gpu_comm_wait(g, what);
    if (t == ncclFloat16)
        for (size_t i = 0; i < n; i++) dst[i] = __half2float(__ushort_as_half(half[i]));
    else
        for (size_t i = 0; i < n; i++) dst[i] = bf16_to_float(half[i]);
}

inline void gpu_stage_to_device(GpuComm* g, const float* src, size_t n, ncclDataType_t t, void* dst, const char* what) {
    if (t == ncclFloat32) {
        GPU_COMM_CUDA(g, cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyHostToDevice, g->stream), what);
    } else {
        std::vector<uint16_t> half(n);
        if (t == ncclFloat16)
            for (size_t i = 0; i < n; i++) half[i] = __half_as_ushort(__float2half_rn(src[i]));
        else
            for (size_t i = 0; i < n; i++) half[i] = float_to_bf16_round_nearest(src[i]);
        GPU_COMM_CUDA(g, cudaMemcpyAsync(dst, half.data(), n * 2, cudaMemcpyHostToDevice, g->stream), what);
    }
    gpu_comm_wait(g, what);  // the host buffer must outlive the copy
}

// full: world_size * shard_count elements; rank r's shard receives the sum over ranks of its part.
inline void gpu_reduce_scatter_sum(GpuComm* g, const void* full, void* shard, size_t shard_count, ncclDataType_t t,
                                   const char* what) {
    int world = g->host->world_size;
    if (world > 1) gpu_count(g, COMM_REDUCE_SCATTER, (uint64_t)(world - 1) * shard_count * gpu_dtype_bytes(t));
    if (world == 1) {
        GPU_COMM_CUDA(g, cudaMemcpyAsync(shard, full, shard_count * gpu_dtype_bytes(t), cudaMemcpyDeviceToDevice, g->stream), what);
    } else if (!g->host_staged) {
        GPU_COMM_NCCL(g, ncclReduceScatter(full, shard, shard_count, t, ncclSum, g->nccl, g->stream), what);
    } else {
        g->staging.resize((size_t)(world + 1) * shard_count);
        float* all = g->staging.data();
        float* mine = all + (size_t)world * shard_count;
        gpu_stage_to_host(g, full, (size_t)world * shard_count, t, all, what);
        comm_reduce_scatter_sum(g->host, all, mine, shard_count, what);
        gpu_stage_to_device(g, mine, shard_count, t, shard, what);
    }
}

// In place: rank r's shard is at full + r * shard_count elements; afterwards every rank has all.
inline void gpu_all_gather(GpuComm* g, void* full, size_t shard_count, ncclDataType_t t, const char* what) {
    int world = g->host->world_size, rank = g->host->rank;
    size_t bytes = shard_count * gpu_dtype_bytes(t);
    if (world == 1) return;
    gpu_count(g, COMM_ALL_GATHER, (uint64_t)(world - 1) * bytes);
    if (!g->host_staged) {
        GPU_COMM_NCCL(g, ncclAllGather((char*)full + rank * bytes, full, shard_count, t, g->nccl, g->stream), what);
        return;
    }
    // a gather only copies, so bytes are staged as they are, bf16 or fp32
    g->staging.resize(((size_t)world * bytes + 3) / 4);
    char* all = (char*)g->staging.data();
    GPU_COMM_CUDA(g, cudaMemcpyAsync(all + rank * bytes, (char*)full + rank * bytes, bytes, cudaMemcpyDeviceToHost, g->stream), what);
    gpu_comm_wait(g, what);
    comm_all_gather(g->host, all, bytes, what);
    GPU_COMM_CUDA(g, cudaMemcpyAsync(full, all, (size_t)world * bytes, cudaMemcpyHostToDevice, g->stream), what);
    gpu_comm_wait(g, what);
}

// In place: data[i] <- sum over ranks of data[i] (the per-bucket exchange of plain data parallelism).
inline void gpu_all_reduce_sum(GpuComm* g, void* data, size_t n, ncclDataType_t t, const char* what) {
    if (g->host->world_size == 1) return;
    gpu_count(g, COMM_ALL_REDUCE, 2 * (uint64_t)(g->host->world_size - 1) * n * gpu_dtype_bytes(t) / g->host->world_size);
    if (!g->host_staged) {
        GPU_COMM_NCCL(g, ncclAllReduce(data, data, n, t, ncclSum, g->nccl, g->stream), what);
        return;
    }
    g->staging.resize(n);
    gpu_stage_to_host(g, data, n, t, g->staging.data(), what);
    comm_allreduce_sum(g->host, g->staging.data(), n, what);
    gpu_stage_to_device(g, g->staging.data(), n, t, data, what);
}

// On rank `root` only: data[i] <- sum over ranks of data[i] (in place); the other ranks' data is
// only read. Host staging sums in fp32 on the host, like gpu_reduce_scatter_sum.
inline void gpu_reduce_sum(GpuComm* g, void* data, size_t n, ncclDataType_t t, int root, const char* what) {
    if (g->host->world_size == 1 || n == 0) return;
    if (g->host->rank != root) gpu_count(g, COMM_REDUCE, (uint64_t)n * gpu_dtype_bytes(t));
    if (!g->host_staged) {
        GPU_COMM_NCCL(g, ncclReduce(data, data, n, t, ncclSum, root, g->nccl, g->stream), what);
        return;
    }
    g->staging.resize(n);
    gpu_stage_to_host(g, data, n, t, g->staging.data(), what);
    comm_reduce_sum(g->host, g->staging.data(), n, root, what);
    if (g->host->rank == root) gpu_stage_to_device(g, g->staging.data(), n, t, data, what);
}

// The collectives between gpu_group_begin and gpu_group_end are launched together, as one NCCL
// kernel (NCCL's "aggregated operations"): a bucket's dozens of small reductions cost one launch.
// Host staging runs each one as it comes, so the two are no-ops there.
inline void gpu_group_begin(GpuComm* g, const char* what) {
    if (g->nccl) GPU_COMM_NCCL(g, ncclGroupStart(), what);
}
inline void gpu_group_end(GpuComm* g, const char* what) {
    if (g->nccl) GPU_COMM_NCCL(g, ncclGroupEnd(), what);
}

// In place: every rank ends with rank `root`'s `bytes` (a model's initial weights, a pipeline's
// tokens). Host staging copies through host memory and broadcasts over MPI.
inline void gpu_broadcast(GpuComm* g, void* data, size_t bytes, int root, const char* what) {
    if (g->host->world_size == 1 || bytes == 0) return;
    if (g->host->rank == root) gpu_count(g, COMM_BROADCAST, (uint64_t)(g->host->world_size - 1) * bytes);
    if (!g->host_staged) {
        GPU_COMM_NCCL(g, ncclBroadcast(data, data, bytes, ncclUint8, root, g->nccl, g->stream), what);
        return;
    }
    g->staging.resize((bytes + 3) / 4);
    char* host = (char*)g->staging.data();
    if (g->host->rank == root) {
        GPU_COMM_CUDA(g, cudaMemcpyAsync(host, data, bytes, cudaMemcpyDeviceToHost, g->stream), what);
        gpu_comm_wait(g, what);
    }
    comm_broadcast(g->host, host, bytes, root, what);
    if (g->host->rank != root) {
        GPU_COMM_CUDA(g, cudaMemcpyAsync(data, host, bytes, cudaMemcpyHostToDevice, g->stream), what);
        gpu_comm_wait(g, what);
    }
}

// All-to-all (comm.h's comm_all_to_all): block j of `send` goes to rank j, block j of `recv` comes
// from rank j. NCCL has no all-to-all call: it is N-1 sends and N-1 receives in one group (so that
// they all progress together, as a single kernel), and this rank's own block is a copy on the stream.
inline void gpu_all_to_all(GpuComm* g, const void* send, void* recv, size_t block_bytes, const char* what) {
    int world = g->host->world_size, rank = g->host->rank;
    const char* in = (const char*)send;
    char* out = (char*)recv;
    if (world == 1 || !g->host_staged) {
        GPU_COMM_CUDA(g, cudaMemcpyAsync(out + (size_t)rank * block_bytes, in + (size_t)rank * block_bytes, block_bytes,
                                         cudaMemcpyDeviceToDevice, g->stream), what);
    }
    if (world == 1) return;
    gpu_count(g, COMM_ALL_TO_ALL, (uint64_t)(world - 1) * block_bytes);
    if (!g->host_staged) {
        gpu_group_begin(g, what);
        for (int peer = 0; peer < world; peer++) {
            if (peer == rank) continue;
            GPU_COMM_NCCL(g, ncclSend(in + (size_t)peer * block_bytes, block_bytes, ncclUint8, peer, g->nccl, g->stream), what);
            GPU_COMM_NCCL(g, ncclRecv(out + (size_t)peer * block_bytes, block_bytes, ncclUint8, peer, g->nccl, g->stream), what);
        }
        gpu_group_end(g, what);
        return;
    }
    size_t total = (size_t)world * block_bytes;
    g->staging.resize((2 * total + 3) / 4);
    char* host_in = (char*)g->staging.data();
    char* host_out = host_in + total;
    GPU_COMM_CUDA(g, cudaMemcpyAsync(host_in, send, total, cudaMemcpyDeviceToHost, g->stream), what);
    gpu_comm_wait(g, what);
    comm_all_to_all(g->host, host_in, host_out, block_bytes, what);
    GPU_COMM_CUDA(g, cudaMemcpyAsync(recv, host_out, total, cudaMemcpyHostToDevice, g->stream), what);
    gpu_comm_wait(g, what);
}

// Reduce to owners: for every range, each of its pieces (cut at the shards of `layout`) is summed
// over ranks onto the rank that owns it, in place in `flat` (elements of type t). Afterwards each
// rank holds, inside its own shard, the sum of every element of the ranges; elsewhere its own
// values are left as they were. Bytes: each rank sends every piece it does not own once, so over a
// whole array (N-1)/N of it, exactly what a reduce-scatter sends.
inline void gpu_reduce_to_owners(GpuComm* g, void* flat, ncclDataType_t t, const ShardLayout& layout,
                                 const std::vector<ShardRange>& ranges, const char* what) {
    if (g->host->world_size == 1) return;
    size_t bytes = gpu_dtype_bytes(t);
    gpu_group_begin(g, what);
    for (ShardRange range : ranges)
        for (const OwnedPiece& piece : shard_owners(layout, range))
            gpu_reduce_sum(g, (char*)flat + piece.begin * bytes, piece.end - piece.begin, t, piece.rank, what);
    gpu_group_end(g, what);
}

// In place: every rank ends with the sum over ranks, the SAME bits on every rank (tensor-parallel
// replicas compute the same LayerNorm from it and must not drift apart). A reduce-scatter, in which
// each element's sum is computed once, by one rank, then an all-gather of the sums: what a ring
// all-reduce does inside, so it moves the same bytes, but a promise NCCL's all-reduce does not make
// for every algorithm it may choose. n must be a multiple of the group size.
inline void gpu_all_reduce_identical(GpuComm* g, void* data, size_t n, ncclDataType_t t, const char* what) {
    int world = g->host->world_size, rank = g->host->rank;
    if (world == 1 || n == 0) return;
    if (n % (size_t)world != 0) fail("internal: %s: %zu elements do not split over %d ranks", what, n, world);
    size_t shard = n / (size_t)world;
    char* mine = (char*)data + (size_t)rank * shard * gpu_dtype_bytes(t);
    gpu_count(g, COMM_REDUCE_SCATTER, (uint64_t)(world - 1) * shard * gpu_dtype_bytes(t));
    gpu_count(g, COMM_ALL_GATHER, (uint64_t)(world - 1) * shard * gpu_dtype_bytes(t));
    if (!g->host_staged) {
        GPU_COMM_NCCL(g, ncclReduceScatter(data, mine, shard, t, ncclSum, g->nccl, g->stream), what);
        GPU_COMM_NCCL(g, ncclAllGather(mine, data, shard, t, g->nccl, g->stream), what);
        return;
    }
    g->staging.resize(n);
    gpu_stage_to_host(g, data, n, t, g->staging.data(), what);
    comm_allreduce_sum_identical(g->host, g->staging.data(), n, &g->staging_scratch, what);
    gpu_stage_to_device(g, g->staging.data(), n, t, data, what);
}

// In place: data[i] <- the maximum over ranks (fp32). A maximum is exact in any order.
inline void gpu_all_reduce_max(GpuComm* g, float* data, size_t n, const char* what) {
    if (g->host->world_size == 1 || n == 0) return;
    gpu_count(g, COMM_ALL_REDUCE, 2 * (uint64_t)(g->host->world_size - 1) * n * 4 / g->host->world_size);
    if (!g->host_staged) {
        GPU_COMM_NCCL(g, ncclAllReduce(data, data, n, ncclFloat32, ncclMax, g->nccl, g->stream), what);
        return;
    }
    g->staging.resize(n);
    gpu_stage_to_host(g, data, n, ncclFloat32, g->staging.data(), what);
    comm_allreduce_max(g->host, g->staging.data(), n, what);
    gpu_stage_to_device(g, g->staging.data(), n, ncclFloat32, data, what);
}

// ----------------------------------------------------------------------------------------------
// Point to point (pipelines): `bytes` of one rank's device array to rank `peer` of the group.
//
// NCCL matches the sends and receives between two ranks in the order they were issued (it has no
// tags); each runs on the stream, and a send completes only once its peer receives. So a send
// followed by a receive on the same stream waits for the peer: two neighbours that both send
// first would wait for each other forever. llmc/parallel/pipeline_parallel.cuh therefore issues a send
// together with the receive that follows it, in one group (gpu_group_begin/end), as Megatron does.
// Host staging copies through host memory and uses MPI's non-blocking send (comm_send), which never
// waits for the receiver: the device array is free again as soon as gpu_send returns, and
// gpu_wait_sends completes the MPI requests (their host copies live in `staged` until then).
struct GpuStagedSend {
    std::vector<float> data;         // the host copy being sent (bytes, not necessarily floats)
    std::vector<CommSend> requests;
};

inline void gpu_send(GpuComm* g, const void* data, size_t bytes, int peer, int tag, std::vector<GpuStagedSend>* staged,
                     const char* what) {
    if (bytes % 4 != 0) fail("internal: %s: %zu bytes are not whole 4-byte words", what, bytes);
    gpu_count(g, COMM_SEND, bytes);
    if (!g->host_staged) {
        GPU_COMM_NCCL(g, ncclSend(data, bytes, ncclUint8, peer, g->nccl, g->stream), what);
        return;
    }
    staged->emplace_back();
    GpuStagedSend& s = staged->back();
    s.data.resize(bytes / 4);
    GPU_COMM_CUDA(g, cudaMemcpyAsync(s.data.data(), data, bytes, cudaMemcpyDeviceToHost, g->stream), what);
    gpu_comm_wait(g, what);
    comm_send(g->host, s.data.data(), s.data.size(), peer, tag, &s.requests, what);  // the bytes as they are
}

// NCCL: enqueued on the stream; the caller waits (gpu_comm_wait) where it needs the data. Host
// staging: received and copied to the device before it returns.
inline void gpu_recv(GpuComm* g, void* data, size_t bytes, int peer, int tag, const char* what) {
    if (bytes % 4 != 0) fail("internal: %s: %zu bytes are not whole 4-byte words", what, bytes);
    if (!g->host_staged) {
        GPU_COMM_NCCL(g, ncclRecv(data, bytes, ncclUint8, peer, g->nccl, g->stream), what);
        return;
    }
    g->staging.resize(bytes / 4);
    comm_recv(g->host, g->staging.data(), bytes / 4, peer, tag, what);
    GPU_COMM_CUDA(g, cudaMemcpyAsync(data, g->staging.data(), bytes, cudaMemcpyHostToDevice, g->stream), what);
    gpu_comm_wait(g, what);  // the host buffer must outlive the copy
}

// Host staging: waits until every staged send has been received (and frees its host copy).
inline void gpu_wait_sends(GpuComm* g, std::vector<GpuStagedSend>* staged) {
    for (GpuStagedSend& s : *staged) comm_wait_sends(g->host, &s.requests);
    staged->clear();
}

// Every rank's value of x, in rank order, on every rank. Staged ranks use MPI (comm.h); NCCL ranks
// gather the doubles on the GPU, so that they need no MPI. Waits for the result (and so for all
// communication enqueued before it), under the deadline.
inline std::vector<double> gpu_comm_gather(GpuComm* g, double x, const char* what) {
    int world = g->host->world_size, rank = g->host->rank;
    std::vector<double> all((size_t)world, 0.0);
    all[(size_t)rank] = x;
    if (world == 1) return all;
    if (g->host_staged) {
        comm_all_gather(g->host, all.data(), sizeof(double), what);
        return all;
    }
    g->host_numbers[rank] = x;
    GPU_COMM_CUDA(g, cudaMemcpyAsync(g->numbers + rank, g->host_numbers + rank, sizeof(double), cudaMemcpyHostToDevice,
                                     g->stream), what);
    GPU_COMM_NCCL(g, ncclAllGather(g->numbers + rank, g->numbers, 1, ncclFloat64, g->nccl, g->stream), what);
    GPU_COMM_CUDA(g, cudaMemcpyAsync(g->host_numbers, g->numbers, world * sizeof(double), cudaMemcpyDeviceToHost,
                                     g->stream), what);
    gpu_comm_wait(g, what);
    all.assign(g->host_numbers, g->host_numbers + world);
    return all;
}

// The sum over ranks of one number, bit-identical on every rank (added in rank order: comm_sum).
inline double gpu_comm_sum(GpuComm* g, double x, const char* what) {
    double total = 0.0;
    for (double v : gpu_comm_gather(g, x, what)) total += v;
    return total;
}

// No rank leaves until every rank has arrived (for checkpoints: the directory exists, the files
// are written).
inline void gpu_comm_barrier(GpuComm* g, const char* what) { gpu_comm_gather(g, 0.0, what); }
