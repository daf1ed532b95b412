// grad_compression.cuh — PowerSGD's compressed data-parallel sum on GPUs.
//
// Read llmc/parallel/grad_compression.h first: the method (Vogels et al. 2019, error feedback and
// warm start), which matrices are compressed and where each one's e, P and Q live (powersgd_plan),
// the start step, the checkpoint file. All of that is used here as it is; the host struct
// GradCompression is reused whole, with its e, e_next, q and q_next pointing into GPU memory (its
// vectors stay empty) so that committing a sound step (grad_compression_commit) is the same swap.
// What a GPU adds:
//
//   - the gradient is bf16 (GB_GRADS) but M = G + e, P, Q and e are fp32 on the device: e holds what
//     earlier steps left out, often far below the gradient's bf16 ulp, and would be lost in bf16.
//     So M is formed in fp32 in e_next (it becomes the new e in place, element by element, at the
//     end), and only S, the sum every rank applies, is rounded to bf16, once, into the gradient.
//   - P = M Q and Q' = M^T P^ are cuBLASLt fp32 matmuls (llmc/kernels/matmul.cuh's matmul_fp32):
//     thin products (r columns), bound by reading M, 4 n m bytes each. S = P^ Q'^T and e = M - S/N
//     are one kernel (powersgd_finish_kernel): each element's r-term dot product in registers, M read
//     once, e and S written once, so the n x m product is never stored.
//   - the orthonormalisation runs ON THE HOST, with the CPU trainer's function (orthonormalise_
//     columns: modified Gram-Schmidt twice, in double): P is thin, r n floats per matrix (537,088
//     floats, 2.0 MiB, at d12 and r = 4: by arithmetic ~0.1 ms each way at PCIe's ~25 GB/s, a
//     sliver of a step's matmuls), Gram-Schmidt is r^2 / 2 dependent dot products that a GPU would
//     run one block at a time anyway, and both trainers then orthonormalise by the same code. Every rank downloads the same P bits (the identical
//     all-reduce) and runs the same function, so every rank gets the same P^.
//   - the two sums are gpu_all_reduce_identical (a reduce-scatter and an all-gather: the same bits
//     on every rank, so the replicas stay identical), fp32, with the exactly summed vectors packed
//     behind P as on the CPU. Buffers: the size table's compression_state and compression_work rows
//     (grad_compression_gpu_sizes), padded to N shards.
//
// --grad-compression bf16 takes the exact path here: the GPU trainer's sum already sends bf16
// (llmc/parallel/zero.cuh), half of the CPU's fp32, which is all bf16 compression buys.
//
// Hook points (train_gpt.cu), the dense gradient group's: unit_grads_done starts no sum on a PowerSGD step
// (dense_unit_final: powersgd_replaces_sum); its sum (dense_grads_sum) calls powersgd_sum_gpu in place of
// ZeRO's sum; optimizer_step's share_updated_weights commits e
// and Q (a skipped step leaves them); checkpoints download e and Q into grad_compression_rank<r>.bin,
// the CPU trainer's file: either trainer resumes the other's.
#pragma once

#include <vector>
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/kernels/matmul.cuh"
#include "llmc/parallel/comm_nccl.cuh"
#include "llmc/parallel/grad_compression.h"

struct GradCompressionGpu {
    GradCompression c;                // the plan, settings, steps; e, e_next, q, q_next point into `state` (device)
    GpuComm* comm = nullptr;          // the data-parallel group on the GPU
    float* work = nullptr;            // P, then the exactly summed values (device, padded to N shards)
    std::vector<float> host_p;        // P downloaded for the orthonormalisation
};

// Points into the two rows (allocated from the size table before this); Q from the seed, e at zero.
inline void grad_compression_gpu_setup(GradCompressionGpu* g, const GradCompressionSettings& s, Comm* dp, GpuComm* comm,
                                       const GPT2Config& cfg, uint64_t seed, float* state, float* work) {
    GradCompression* c = &g->c;
    c->settings = s;
    c->dp = dp;
    g->comm = comm;
    if (s.kind != GradCompressionKind::PowerSGD || dp->world_size == 1) return;
    c->plan = powersgd_plan(cfg, s);
    int N = dp->world_size;
    size_t q_pad = powersgd_gpu_q_floats(c->plan, N);
    c->e = state;
    c->e_next = c->e + c->plan.e_floats;
    c->q = c->e_next + c->plan.e_floats;
    c->q_next = c->q + q_pad;
    g->work = work;
    GradCompressionSizes z = grad_compression_gpu_sizes(s, cfg, N);
    CUDA_CHECK(cudaMemset(state, 0, z.state * sizeof(float)));  // e = 0, and the pads stay 0 (they are summed)
    CUDA_CHECK(cudaMemset(work, 0, z.work * sizeof(float)));
    std::vector<float> q(c->plan.q_floats);
    powersgd_first_q(seed, q.data(), q.size());
    CUDA_CHECK(cudaMemcpy(c->q, q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice));
    g->host_p.resize(c->plan.p_floats);
}

// M = G + e, into e_next (fp32): the gradient with what earlier steps' compression left out.
__global__ void powersgd_error_feedback_kernel(float* M, const floatX* G, const float* e, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) M[i] = (float)G[i] + e[i];
}

// The exactly summed ranges, bf16 <-> fp32, packed one after another.
__global__ void floatx_to_float_kernel(float* dst, const floatX* src, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = (float)src[i];
}
__global__ void float_to_floatx_kernel(floatX* dst, const float* src, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = (floatX)src[i];
}

// Per element (i, k) of an n x m matrix: S = sum_col P^[i][col] Q'[k][col] (in column order, fp32, as
// the CPU trainer adds it), then e = M - S / N in place of M, and the gradient = S rounded to floatX.
__global__ void powersgd_finish_kernel(float* M_then_e, floatX* grad, const float* P, const float* Qn, size_t n, size_t m,
                                       int r, float inv_N) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= n * m) return;
    size_t i = idx / m, k = idx % m;
    float s = 0.0f;
    for (int col = 0; col < r; col++) s += P[i * r + col] * Qn[k * r + col];
    M_then_e[idx] = M_then_e[idx] - s * inv_N;
    grad[idx] = (floatX)s;
}

constexpr int POWERSGD_THREADS = 256;
inline int powersgd_blocks(size_t n) { return (int)((n + POWERSGD_THREADS - 1) / POWERSGD_THREADS); }

// PowerSGD over the data-parallel ranks, on the compute stream: grads (this rank's bf16 G, the flat
// array of ZeRO-0) becomes S rounded to bf16 on every rank; e_next and q_next get this step's e and Q.
// The host waits for each sum (it needs P for the orthonormalisation anyway).
inline void powersgd_sum_gpu(GradCompressionGpu* g, MatmulContext* mm, floatX* grads, cudaStream_t stream) {
    GradCompression* c = &g->c;
    const PowerSGDPlan& p = c->plan;
    int r = c->settings.rank, N = c->dp->world_size;
    float* P = g->work;
    float* exact = P + p.p_floats;
    // M = G + e; P = M Q. Row-major M (n x m) is column-major (m x n), so P^T (r x n) = Q^T M^T is
    // matmul_fp32(m = r, n = n, k = m) on Q (column-major r x m: row-major m x r) and M, no transposes.
    for (const PowerSGDMatrix& mat : p.matrices) {
        float* M = c->e_next + mat.e_at;
        size_t nm = mat.n * mat.m;
        powersgd_error_feedback_kernel<<<powersgd_blocks(nm), POWERSGD_THREADS, 0, stream>>>(M, grads + mat.offset,
                                                                                           c->e + mat.e_at, nm);
        CUDA_CHECK(cudaGetLastError());
        matmul_fp32(mm, P + mat.p_at, c->q + mat.q_at, M, r, (int)mat.n, (int)mat.m, false, false, stream);
    }
    size_t at = 0;  // the exactly summed values travel behind P, in the same all-reduce
    for (const ShardRange& x : p.exact) {
        floatx_to_float_kernel<<<powersgd_blocks(x.size()), POWERSGD_THREADS, 0, stream>>>(exact + at, grads + x.begin, x.size());
        CUDA_CHECK(cudaGetLastError());
        at += x.size();
    }
    CUDA_CHECK(cudaStreamSynchronize(stream));  // (the communication stream never waits on the compute stream)
    gpu_all_reduce_identical(g->comm, P, powersgd_gpu_work_floats(p, N), ncclFloat32, "all-reduce of PowerSGD's P");
    gpu_comm_wait(g->comm, "all-reduce of PowerSGD's P");
    at = 0;
    for (const ShardRange& x : p.exact) {
        float_to_floatx_kernel<<<powersgd_blocks(x.size()), POWERSGD_THREADS, 0, stream>>>(grads + x.begin, exact + at, x.size());
        CUDA_CHECK(cudaGetLastError());
        at += x.size();
    }
    // P^ = orthonormalise(P), on the host (see the top of the file)
    CUDA_CHECK(cudaMemcpyAsync(g->host_p.data(), P, p.p_floats * sizeof(float), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    for (const PowerSGDMatrix& mat : p.matrices) orthonormalise_columns(g->host_p.data() + mat.p_at, mat.n, (size_t)r);
    CUDA_CHECK(cudaMemcpyAsync(P, g->host_p.data(), p.p_floats * sizeof(float), cudaMemcpyHostToDevice, stream));
    // Q' = M^T P^: Q'^T (r x m) = P^T (r x n) M (n x m), i.e. matmul_fp32(m = r, n = m, k = n) on P
    // (column-major r x n) and M transposed (column-major m x n, read as its transpose)
    for (const PowerSGDMatrix& mat : p.matrices)
        matmul_fp32(mm, c->q_next + mat.q_at, P + mat.p_at, c->e_next + mat.e_at, r, (int)mat.m, (int)mat.n, false, true, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    gpu_all_reduce_identical(g->comm, c->q_next, powersgd_gpu_q_floats(p, N), ncclFloat32, "all-reduce of PowerSGD's Q");
    gpu_comm_wait(g->comm, "all-reduce of PowerSGD's Q");
    // S = P^ Q'^T, the same on every rank, into the gradient; e_next = M - S / N
    for (const PowerSGDMatrix& mat : p.matrices) {
        size_t nm = mat.n * mat.m;
        powersgd_finish_kernel<<<powersgd_blocks(nm), POWERSGD_THREADS, 0, stream>>>(
            c->e_next + mat.e_at, grads + mat.offset, P + mat.p_at, c->q_next + mat.q_at, mat.n, mat.m, r, 1.0f / (float)N);
        CUDA_CHECK(cudaGetLastError());
    }
    c->pending = true;
}

// Checkpoints: the committed e and Q, downloaded, in the CPU trainer's file (grad_compression.h).
inline void grad_compression_gpu_save(const GradCompressionGpu& g, const std::string& dir, int step) {
    const GradCompression& c = g.c;
    if (!grad_compression_on(c)) return;
    std::vector<float> e(c.plan.e_floats), q(c.plan.q_floats);
    CUDA_CHECK(cudaMemcpy(e.data(), c.e, e.size() * sizeof(float), cudaMemcpyDeviceToHost));
    CUDA_CHECK(cudaMemcpy(q.data(), c.q, q.size() * sizeof(float), cudaMemcpyDeviceToHost));
    grad_compression_save(c, dir, step, e.data(), q.data());
}

// Resuming: the checkpoint's settings checked and e and Q read (or a one-line refusal), then uploaded.
inline void grad_compression_gpu_load(GradCompressionGpu* g, const std::string& dir, int64_t step) {
    GradCompression* c = &g->c;
    std::vector<float> e(c->plan.e_floats), q(c->plan.q_floats);
    grad_compression_load(c, dir, step, e.data(), q.data());
    c->steps_done = step;
    if (c->settings.kind != GradCompressionKind::PowerSGD || !grad_compression_on(*c)) return;
    CUDA_CHECK(cudaMemcpy(c->e, e.data(), e.size() * sizeof(float), cudaMemcpyHostToDevice));
    CUDA_CHECK(cudaMemcpy(c->q, q.data(), q.size() * sizeof(float), cudaMemcpyHostToDevice));
}
