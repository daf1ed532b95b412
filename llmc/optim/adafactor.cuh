// adafactor.cuh — Adafactor on the GPU (--optimizer adafactor in train_gpt.cu). Read
// llmc/optim/adafactor.h first: the paper (Shazeer & Stern 2018, Algorithm 4), our choices (beta1 = 0,
// rho_t, weight decay, the tied embedding as one block) and why the sums are in double. This file adds
// only what a GPU adds: the passes as kernels, and the block's scalars reduced on the device.
//
// What it teaches: a factored second moment turns AdamW's one elementwise pass into reductions. A
// matrix block (n x m, stored (out, in): optimizer_state.h) takes, per step:
//   1. rows     one warp per row: R_i = beta2 R_i + (1 - beta2) sum_j (G_ij^2 + eps1), and the
//               row's sum of X^2 (for RMS(X)) into a partial
//   2. columns  one thread per column, walking the rows (consecutive threads read consecutive
//               columns: each row's read is coalesced): C_j likewise
//   3. sums     one thread block: sum(R) and sum(X^2) from the partials, into the block's scalars
//   4. RMS(U)   one warp per row: sum_j U_ij^2 with U_ij = G_ij / sqrt(R_i C_j / sum(R)); then
//               one thread block sums the rows' partials
//   5. update   one thread per element: X <- X (1 - rho wd) - alpha_t / max(1, RMS(U)) U, the step
//               formed by every thread from the scalars (adafactor_step_size, the CPU's function)
// A vector block (a bias, a LayerNorm gain) keeps a full V: one elementwise kernel updates V and forms
// U at once (U_i needs only V_i), with the thread blocks' partial sums of X^2 and U^2; then the sums
// and the update as for a matrix.
// Every reduction is a fixed butterfly (warp_sum, block_sum in double) over a fixed partition, so a step's bits do not
// depend on the scheduling: a resumed run is bit-exact, and there are no atomics. The scalars (sum(R),
// sum(X^2), sum(U^2)) never leave the device: the host launches the blocks' kernels one after another
// on the stream and synchronises once, after the whole update (train_gpt.cu's optimizer_step). What
// the host does per block is launch 4 (vector) or 7 (matrix) kernels: GPT-2 124M has 50 matrices and
// 98 vectors, ~740 launches a step. The elementwise arithmetic is adafactor.h's (adafactor_matrix_u,
// adafactor_step_size), in double as there: the GPU's result differs from the CPU's only by the order
// of the sums (test/test_gpu_factored.py states the tolerance).
//
// Mixed precision, as adamw.cuh: with master weights X is the fp32 master copy, and the bf16 parameter
// is written from it with stochastic rounding keyed by (seed, step, the element's index in the flat
// array): adamw.cuh's stream, so a resumed run rounds as the straight one.
// Memory: the state, (n + m) floats per matrix and n per vector (GB_OPTIMIZER_STATE, 1.3 MB for GPT-2
// 124M against AdamW's 995 MB), and the partials, two doubles per row of the tallest block
// (GB_OPTIMIZER_SCRATCH: wte's 50257 rows, 0.8 MB). Speed: G is read four times (rows, columns, RMS(U),
// update) and X twice, against AdamW's once each.
// Hook point: optimizer_step (llmc/run/step.h), on one GPU or data-parallel ranks with ZeRO-0 (every
// rank the whole update of the summed gradient, as one rank); the rest is refused by rows of
// llmc/run/compatibility.h.
#pragma once

#include "llmc/kernels/cuda_common.cuh"
#include "llmc/optim/adafactor.h"  // the host math both trainers share
#include "llmc/optim/optimizer_state.h"

constexpr int ADAFACTOR_THREADS = 256;  // a thread block: 8 warps, a row each in the row kernels
constexpr int ADAFACTOR_ROWS = ADAFACTOR_THREADS / 32;

// X's element k: the master copy, or the parameter itself widened.
__device__ __forceinline__ float adafactor_weight(const floatX* p, const float* master, size_t k) {
    return master ? master[k] : to_float(p[k]);
}
// G's element k as the CPU forms it: times the clip factor in fp32, then widened.
__device__ __forceinline__ double adafactor_grad(const floatX* g, size_t k, float scale) { return (double)(to_float(g[k]) * scale); }

// 1. One warp per row i (its lanes read consecutive elements): R_i, and the row's sum of X^2 into parts_x[i].
__global__ void adafactor_rows_kernel(const floatX* p, const float* master, const floatX* g, float* R, double* parts_x,
                                      size_t n, size_t m, float scale, double keep, double fresh) {
    size_t i = (size_t)blockIdx.x * ADAFACTOR_ROWS + threadIdx.x / 32, row = i * m;
    if (i >= n) return;  // (the whole warp leaves together: no shuffle is left waiting)
    double g2 = 0.0, x2 = 0.0;
    for (size_t j = threadIdx.x % 32; j < m; j += 32) {
        double gj = adafactor_grad(g, row + j, scale), xj = adafactor_weight(p, master, row + j);
        g2 += gj * gj + cpu::ADAFACTOR_EPS1;
        x2 += xj * xj;
    }
    g2 = warp_sum(g2);
    x2 = warp_sum(x2);
    if (threadIdx.x % 32 == 0) {
        R[i] = (float)(keep * R[i] + fresh * g2);
        parts_x[i] = x2;
    }
}

// 2. One thread per column j: C_j.
__global__ void adafactor_cols_kernel(const floatX* g, float* C, size_t n, size_t m, float scale, double keep, double fresh) {
    size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= m) return;
    double g2 = 0.0;
    for (size_t i = 0; i < n; i++) {
        double gij = adafactor_grad(g, i * m + j, scale);
        g2 += gij * gij + cpu::ADAFACTOR_EPS1;
    }
    C[j] = (float)(keep * C[j] + fresh * g2);
}

// 3. One thread block: *out = the sum of values[0..n) (floats or doubles), in double.
template <class T> __global__ void adafactor_sum_kernel(const T* values, size_t n, double* out) {
    __shared__ double shared[32];
    double s = 0.0;
    for (size_t i = threadIdx.x; i < n; i += blockDim.x) s += (double)values[i];
    s = block_sum(s, shared);
    if (threadIdx.x == 0) *out = s;
}

// 4. One warp per row i: sum_j U_ij^2 into parts_u[i], with sum(R) from the scalars.
__global__ void adafactor_rms_rows_kernel(const floatX* g, const float* R, const float* C, const double* scalars,
                                          double* parts_u, size_t n, size_t m, float scale) {
    size_t i = (size_t)blockIdx.x * ADAFACTOR_ROWS + threadIdx.x / 32, row = i * m;
    if (i >= n) return;
    double inv_sum_r = 1.0 / scalars[AF_SUM_R], r_i = (double)R[i], u2 = 0.0;
    for (size_t j = threadIdx.x % 32; j < m; j += 32) {
        double u = cpu::adafactor_matrix_u(adafactor_grad(g, row + j, scale), r_i, 1.0 / (double)C[j], inv_sum_r);
        u2 += u * u;
    }
    u2 = warp_sum(u2);
    if (threadIdx.x % 32 == 0) parts_u[i] = u2;
}

// A vector's pass: V_i, and the thread block's sums of X^2 and U^2 = (G / sqrt(V))^2 into the partials.
__global__ void adafactor_vector_kernel(const floatX* p, const float* master, const floatX* g, float* V, double* parts_x,
                                        double* parts_u, size_t n, float scale, double keep, double fresh) {
    __shared__ double shared[32];
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    double x2 = 0.0, u2 = 0.0;
    if (i < n) {
        double gi = adafactor_grad(g, i, scale), xi = adafactor_weight(p, master, i);
        V[i] = (float)(keep * V[i] + fresh * (gi * gi + cpu::ADAFACTOR_EPS1));
        double u = gi / sqrt((double)V[i]);
        x2 = xi * xi, u2 = u * u;
    }
    x2 = block_sum(x2, shared);
    u2 = block_sum(u2, shared);
    if (threadIdx.x == 0) parts_x[blockIdx.x] = x2, parts_u[blockIdx.x] = u2;
}

// 5. One thread per element k of the block: X <- X decay - step U (m == 0: a vector, state = V;
// else state = R then C). `index`: the block's first element in the flat array (its rounding's key).
__global__ void adafactor_update_kernel(floatX* p, float* master, const floatX* g, const float* state, const double* scalars,
                                        size_t n, size_t m, size_t index, float scale, float rho, float decay, uint64_t stream) {
    size_t count = m ? n * m : n, k = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (k >= count) return;
    double step = cpu::adafactor_step_size(scalars[AF_SUM_X2], scalars[AF_SUM_U2], (double)count, rho);
    double gk = adafactor_grad(g, k, scale);
    double u = m == 0 ? gk / sqrt((double)state[k])
                      : cpu::adafactor_matrix_u(gk, (double)state[k / m], 1.0 / (double)state[n + k % m], 1.0 / scalars[AF_SUM_R]);
    float w = (float)(adafactor_weight(p, master, k) * decay - step * u);  // (X decay in fp32, as the CPU's x[k] * decay)
    if (master) master[k] = w;
    stochastic_round(&p[k], w, hash_u32(stream ^ (uint64_t)(index + k)));
}

// Adafactor over every block of the whole model (one GPU, or a ZeRO-0 replica): params, master (or
// null), grads the flat arrays; state the blocks' statistics (optimizer_state.h's order); scratch
// adafactor_scratch_doubles(). rho: the step's relative step size, grad_scale: the clip factor (and
// fp16's 1/S), stream: the weights' rounding stream (adamw_weight_stream).
inline void adafactor_update_gpu(floatX* params, float* master, const floatX* grads, float* state, double* scratch,
                                 const std::vector<ParamBlock>& blocks, float rho, int t, float weight_decay, float grad_scale,
                                 uint64_t stream, cudaStream_t cuda) {
    const int T = ADAFACTOR_THREADS;
    double keep = cpu::adafactor_beta2(t), fresh = 1.0 - keep;  // (the CPU's: beta2_t in fp32, then widened)
    double *scalars = scratch, *parts_x = scratch + AF_SCALARS;
    for (const ParamBlock& b : blocks) {
        float decay = 1.0f - rho * (param_tensor_decays(b.tensor) ? weight_decay : 0.0f);
        floatX* p = params + b.offset;
        const floatX* g = grads + b.offset;
        float *x = master ? master + b.offset : nullptr, *s = state + b.state;
        size_t n = b.rows, m = b.cols, count = b.elements();
        double* parts_u = parts_x + (m ? n : (size_t)ceil_div(n, T));
        if (b.is_matrix()) {
            int rows = ceil_div(n, ADAFACTOR_ROWS);
            adafactor_rows_kernel<<<rows, T, 0, cuda>>>(p, x, g, s, parts_x, n, m, grad_scale, keep, fresh);
            adafactor_cols_kernel<<<ceil_div(m, T), T, 0, cuda>>>(g, s + n, n, m, grad_scale, keep, fresh);
            adafactor_sum_kernel<float><<<1, T, 0, cuda>>>(s, n, scalars + AF_SUM_R);
            adafactor_sum_kernel<double><<<1, T, 0, cuda>>>(parts_x, n, scalars + AF_SUM_X2);
            adafactor_rms_rows_kernel<<<rows, T, 0, cuda>>>(g, s, s + n, scalars, parts_u, n, m, grad_scale);
            adafactor_sum_kernel<double><<<1, T, 0, cuda>>>(parts_u, n, scalars + AF_SUM_U2);
        } else {
            size_t parts = (size_t)ceil_div(n, T);
            adafactor_vector_kernel<<<parts, T, 0, cuda>>>(p, x, g, s, parts_x, parts_u, n, grad_scale, keep, fresh);
            adafactor_sum_kernel<double><<<1, T, 0, cuda>>>(parts_x, parts, scalars + AF_SUM_X2);
            adafactor_sum_kernel<double><<<1, T, 0, cuda>>>(parts_u, parts, scalars + AF_SUM_U2);
        }
        adafactor_update_kernel<<<ceil_div(count, T), T, 0, cuda>>>(p, x, g, s, scalars, n, m, b.offset, grad_scale, rho,
                                                                           decay, stream);
        CUDA_CHECK_LAUNCH();
    }
}
