// sm3.cuh — SM3-II on the GPU (--optimizer sm3 in train_gpt.cu). Read llmc/optim/sm3.h first: the
// paper (Anil, Gupta, Koren & Singer 2019), the cover of a matrix by its rows and its columns, and our
// choices (no momentum, 0 where nu = 0, decoupled weight decay, the tied embedding as one block). This
// file adds only what a GPU adds: the two passes as kernels.
//
// What it teaches: SM3's statistics are maxima, not sums, and each pass needs the OLD accumulators of
// both covers. A matrix block (n x m) takes, per step:
//   1. columns  one thread per column j, walking the rows (consecutive threads, consecutive columns:
//               coalesced): c'_j = max_i (min(r_i, c_j) + G_ij^2), into scratch, because every row
//               still reads the old c_j in pass 2
//   2. rows     one warp per row i: nu_ij = min(r_i, c_j) + G_ij^2 (the same nu as pass 1),
//               W_ij <- W_ij (1 - lr wd) - lr G_ij / sqrt(nu_ij), and r_i = max_j nu_ij (warp_max):
//               only row i reads r_i, so it is overwritten in place
//   3. c <- c'  one copy
// A vector block (a bias, a LayerNorm gain) is Adagrad exactly: one elementwise kernel.
// The maxima are exact in any order, and every other operation is elementwise in fp32 as in sm3.h, so
// the GPU's SM3 differs from the CPU's only where the gradients do; a resumed run is bit-exact. No
// scalar of a block is reduced (unlike Adafactor's RMS, llmc/optim/adafactor.cuh): nothing waits.
//
// Mixed precision, as adamw.cuh: with master weights W is the fp32 master copy, and the bf16 parameter
// is written from it with stochastic rounding keyed by (seed, step, index): adamw.cuh's stream.
// Memory: the state, (n + m) floats per matrix and n per vector (GB_OPTIMIZER_STATE), and the widest
// matrix's columns of scratch (GB_OPTIMIZER_SCRATCH, optimizer_state.h's factored_scratch_floats).
// Speed: G is read twice (columns, rows) and W once, against AdamW's once each; 3 launches per matrix
// and 1 per vector (GPT-2 124M: ~250 a step).
// Hook point: optimizer_step (llmc/run/step.h), on one GPU or ZeRO-0 data-parallel replicas (each the
// whole update of the summed gradient); llmc/run/compatibility.h refuses the rest.
#pragma once

#include "llmc/kernels/cuda_common.cuh"
#include "llmc/optim/optimizer_state.h"
#include "llmc/optim/sm3.h"  // sm3_scaled_gradient: the CPU's arithmetic

constexpr int SM3_THREADS = 256, SM3_ROWS = SM3_THREADS / 32;

// One parameter's new weight, from W (the master copy, or the parameter widened), written back with
// the rounding of its index.
__device__ __forceinline__ void sm3_write(floatX* p, float* master, size_t k, float scaled, float lr, float decay,
                                          uint64_t stream, size_t index) {
    float w = (master ? master[k] : to_float(p[k])) * decay - lr * scaled;
    if (master) master[k] = w;
    stochastic_round(&p[k], w, hash_u32(stream ^ (uint64_t)index));
}

// 1. One thread per column j: the new column accumulator, from the old r and c, into new_c.
__global__ void sm3_cols_kernel(const floatX* g, const float* r, const float* c, float* new_c, size_t n, size_t m, float scale) {
    size_t j = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= m) return;
    float top = 0.0f;
    for (size_t i = 0; i < n; i++) {
        float gij = to_float(g[i * m + j]) * scale;
        top = fmaxf(top, fminf(r[i], c[j]) + gij * gij);
    }
    new_c[j] = top;
}

// 2. One warp per row i: the update with the old accumulators, then r_i = the row's largest nu.
__global__ void sm3_rows_kernel(floatX* p, float* master, const floatX* g, float* r, const float* c, size_t n, size_t m,
                                float scale, float lr, float decay, uint64_t stream, size_t index) {
    size_t i = (size_t)blockIdx.x * SM3_ROWS + threadIdx.x / 32;
    if (i >= n) return;  // (the whole warp leaves together: no shuffle is left waiting)
    float r_i = r[i], top = 0.0f;
    for (size_t j = threadIdx.x % 32; j < m; j += 32) {
        size_t k = i * m + j;
        float gij = to_float(g[k]) * scale, nu = fminf(r_i, c[j]) + gij * gij;
        top = fmaxf(top, nu);
        sm3_write(p, master, k, cpu::sm3_scaled_gradient(gij, nu), lr, decay, stream, index + k);
    }
    top = warp_max(top);
    if (threadIdx.x % 32 == 0) r[i] = top;
}

// A vector: Adagrad, nu_i = acc_i + G_i^2.
__global__ void sm3_vector_kernel(floatX* p, float* master, const floatX* g, float* acc, size_t n, float scale, float lr,
                                  float decay, uint64_t stream, size_t index) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float gi = to_float(g[i]) * scale, nu = acc[i] + gi * gi;
    acc[i] = nu;
    sm3_write(p, master, i, cpu::sm3_scaled_gradient(gi, nu), lr, decay, stream, index + i);
}

// SM3-II over every block of the whole model (one GPU, or a ZeRO-0 replica): params, master (or null),
// grads the flat arrays; state the blocks' accumulators (optimizer_state.h's order); scratch the widest
// matrix's columns. lr: the schedule's; grad_scale: the clip factor; stream: adamw_weight_stream.
inline void sm3_update_gpu(floatX* params, float* master, const floatX* grads, float* state, float* scratch,
                           const std::vector<ParamBlock>& blocks, float lr, float weight_decay, float grad_scale, uint64_t stream,
                           cudaStream_t cuda) {
    const int T = SM3_THREADS;
    for (const ParamBlock& b : blocks) {
        float decay = 1.0f - lr * (param_tensor_decays(b.tensor) ? weight_decay : 0.0f);
        floatX* p = params + b.offset;
        const floatX* g = grads + b.offset;
        float *x = master ? master + b.offset : nullptr, *s = state + b.state;
        size_t n = b.rows, m = b.cols;
        if (b.is_matrix()) {
            sm3_cols_kernel<<<ceil_div(m, T), T, 0, cuda>>>(g, s, s + n, scratch, n, m, grad_scale);
            sm3_rows_kernel<<<ceil_div(n, SM3_ROWS), T, 0, cuda>>>(p, x, g, s, s + n, n, m, grad_scale, lr, decay, stream, b.offset);
            CUDA_CHECK(cudaMemcpyAsync(s + n, scratch, m * sizeof(float), cudaMemcpyDeviceToDevice, cuda));
        } else {
            sm3_vector_kernel<<<ceil_div(n, T), T, 0, cuda>>>(p, x, g, s, n, grad_scale, lr, decay, stream, b.offset);
        }
        CUDA_CHECK_LAUNCH();
    }
}
