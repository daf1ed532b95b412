// comm_nccl.cuh — the gradient exchange between GPUs: NCCL communicators, stall detection, and a
// host-staged fallback for several ranks on one GPU. The host side (ranks, MPI, rendezvous,
// failing together) is llmc/comm.h; read that first.
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
// MPI it is broadcast; without (plain srun) it goes through LLMC_RENDEZVOUS (comm.h). Then each rank
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
// Beyond comm.h's collectives there are two more here:
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
#include "llmc/comm.h"
#include "llmc/sharding.h"

struct GpuComm {
    Comm* host = nullptr;
    int device = 0;
    bool host_staged = false;       // several ranks share this GPU: MPI through host memory, no NCCL
    ncclComm_t nccl = nullptr;
    cudaStream_t stream = nullptr;  // where the collectives run: created here, non-blocking (see above)
    std::vector<float> staging;     // host copies for the host-staged mode
    double* numbers = nullptr;      // NCCL mode: world_size doubles on the device, for gpu_comm_gather
    double* host_numbers = nullptr; // ... and their pinned host copy
};

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

// Waits until everything enqueued on the communication stream has finished: call it where the
// host needs the result (before the optimizer reads the gradient norm, before a checkpoint), not
// after every collective, or the overlap with the backward pass is lost.
inline void gpu_comm_wait(GpuComm* g, const char* what) {
    auto start = std::chrono::steady_clock::now();
    for (long polls = 0;; polls++) {
        cudaError_t done = cudaStreamQuery(g->stream);
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

// Every rank calls this at the end, before comm_finalize.
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
// Collectives on device arrays: fp32 or bf16 (ncclFloat32 / ncclBfloat16). Host staging sums in
// fp32: bf16 values are widened on the host, summed, and rounded back to bf16 (round to nearest).

inline size_t gpu_dtype_bytes(ncclDataType_t t) { return t == ncclBfloat16 ? 2 : 4; }

// Device -> host fp32 (widening bf16), for host staging. Waits for the copy.
inline void gpu_stage_to_host(GpuComm* g, const void* src, size_t n, ncclDataType_t t, float* dst, const char* what) {
    if (t == ncclFloat32) {
        GPU_COMM_CUDA(g, cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyDeviceToHost, g->stream), what);
        gpu_comm_wait(g, what);
        return;
    }
    std::vector<uint16_t> half(n);
    GPU_COMM_CUDA(g, cudaMemcpyAsync(half.data(), src, n * 2, cudaMemcpyDeviceToHost, g->stream), what);
    gpu_comm_wait(g, what);
    for (size_t i = 0; i < n; i++) dst[i] = bf16_to_float(half[i]);
}

inline void gpu_stage_to_device(GpuComm* g, const float* src, size_t n, ncclDataType_t t, void* dst, const char* what) {
    if (t == ncclFloat32) {
        GPU_COMM_CUDA(g, cudaMemcpyAsync(dst, src, n * 4, cudaMemcpyHostToDevice, g->stream), what);
    } else {
        std::vector<uint16_t> half(n);
        for (size_t i = 0; i < n; i++) half[i] = float_to_bf16_round_nearest(src[i]);
        GPU_COMM_CUDA(g, cudaMemcpyAsync(dst, half.data(), n * 2, cudaMemcpyHostToDevice, g->stream), what);
    }
    gpu_comm_wait(g, what);  // the host buffer must outlive the copy
}

// full: world_size * shard_count elements; rank r's shard receives the sum over ranks of its part.
inline void gpu_reduce_scatter_sum(GpuComm* g, const void* full, void* shard, size_t shard_count, ncclDataType_t t,
                                   const char* what) {
    int world = g->host->world_size;
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
