// layernorm.cuh — the residual add fused with LayerNorm (forward), the LayerNorm recompute, and the
// LayerNorm backward with deterministic weight/bias gradients.
//
// Forward, one warp per row of C channels:
//   residual = a + b                  (the block's output added to the residual stream)
//   y = (residual - mean) * rstd * w + bias,   rstd = 1/sqrt(var + 1e-5)
// Why fused: unfused, the add writes the residual and the LayerNorm reads it straight back. Fused,
// the row is read from a and b, the residual written once, and the row re-read for the statistics
// and the output hits L1/L2 (it was just written by the same warp). Traffic per row: read 2C, write
// 2C elements, plus 2 floats (mean, rstd) kept for the backward.
//
// Recompute (--recompute 2): y is rebuilt from the stored residual, mean and rstd by ln_apply(), the
// very function the forward used, with explicitly rounded operations (no FMA contraction the compiler
// might choose differently in two places), so the recomputed y is bit-identical.
//
// Backward, with xhat = (x - mean) * rstd and g = dy * w:
//   dx += rstd * (g - mean(g) - xhat * mean(g * xhat))        (added: x is the residual stream)
//   dw += sum over rows of dy * xhat,  db += sum over rows of dy
// dx is per row (a warp per row). dw and db sum over all rows: each block of 4 warps takes 64 rows,
// each warp accumulates its rows' dy*xhat and dy per channel in its own shared-memory row, the block
// adds its 4 warp rows in order into one partial, and a second kernel adds the partials in order.
// Fixed grid, fixed order, no atomics: bit-identical every run. Traffic: dy and x read twice (the
// second time from cache), dx read and written, plus 2C floats per 64 rows of partials.
#pragma once

#include "llmc/kernels/cuda_common.cuh"
#include "llmc/kernels/scratch_sizes.h"  // LN_BACKWARD_ROWS_PER_BLOCK (the size table reads it too)

constexpr float LN_EPS = 1e-5f;

__device__ __forceinline__ float ln_apply(float x, float mean, float rstd, float w, float b) {
    return __fmaf_rn(__fmul_rn(__fsub_rn(x, mean), rstd), w, b);
}

// residual_out = a + b (if b is given; otherwise the input is a itself and residual_out unused),
// ln_out = LayerNorm(residual). One warp per row.
__global__ void fused_residual_layernorm_forward_kernel(floatX* residual_out, floatX* ln_out, float* mean_out,
                                                        float* rstd_out, const floatX* a, const floatX* b,
                                                        const floatX* weight, const floatX* bias, int N, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32;
    int lane = threadIdx.x % 32;
    if (row >= N) return;
    const floatX* x = a + (size_t)row * C;
    if (b != nullptr) {
        floatX* r = residual_out + (size_t)row * C;
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
            x128 a8 = load128cs(a + (size_t)row * C + c), b8 = load128cs(b + (size_t)row * C + c), r8;
            for (int k = 0; k < x128::size; k++) r8[k] = from_float<floatX>(to_float(a8[k]) + to_float(b8[k]));
            store128(r + c, r8);
        }
        x = r;  // statistics of the ROUNDED residual: exactly what the backward will read back
    }
    float sum = 0.0f;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 x8 = load128(x + c);
        for (int k = 0; k < x128::size; k++) sum += to_float(x8[k]);
    }
    float mean = warp_sum(sum) / C;
    float var = 0.0f;
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 x8 = load128(x + c);
        for (int k = 0; k < x128::size; k++) {
            float d = to_float(x8[k]) - mean;
            var += d * d;
        }
    }
    float rstd = 1.0f / sqrtf(warp_sum(var) / C + LN_EPS);
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        x128 x8 = load128(x + c), w8 = load128(weight + c), b8 = load128(bias + c), y8;
        for (int k = 0; k < x128::size; k++)
            y8[k] = from_float<floatX>(ln_apply(to_float(x8[k]), mean, rstd, to_float(w8[k]), to_float(b8[k])));
        store128(ln_out + (size_t)row * C + c, y8);
    }
    if (lane == 0) {
        mean_out[row] = mean;
        rstd_out[row] = rstd;
    }
}

inline void fused_residual_layernorm_forward(floatX* residual_out, floatX* ln_out, float* mean, float* rstd,
                                             const floatX* a, const floatX* b, const floatX* weight,
                                             const floatX* bias, int N, int C, cudaStream_t stream) {
    const int block = 256;  // 8 rows per block
    fused_residual_layernorm_forward_kernel<<<ceil_div(N, block / 32), block, 0, stream>>>(
        residual_out, ln_out, mean, rstd, a, b, weight, bias, N, C);
    CUDA_CHECK_LAUNCH();
}

// residual_out = a + b alone, without the LayerNorm that usually follows: the last layer of a
// pipeline stage other than the last, whose next LayerNorm belongs to the next stage (which computes
// it from these very bf16 values, as the fused kernel would have). One thread per 8 values.
__global__ void residual_forward_kernel(floatX* out, const floatX* a, const floatX* b, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    x128 a8 = load128cs(a + i), b8 = load128cs(b + i), o8;
    for (int k = 0; k < x128::size; k++) o8[k] = from_float<floatX>(to_float(a8[k]) + to_float(b8[k]));
    store128(out + i, o8);
}

inline void residual_forward(floatX* out, const floatX* a, const floatX* b, size_t n, cudaStream_t stream) {
    residual_forward_kernel<<<ceil_div(n / x128::size, 256), 256, 0, stream>>>(out, a, b, n);
    CUDA_CHECK_LAUNCH();
}

// y = ln_apply(x) from the saved statistics: one thread per 8 channels.
__global__ void layernorm_recompute_kernel(floatX* ln_out, const floatX* inp, const float* mean, const float* rstd,
                                           const floatX* weight, const floatX* bias, int N, int C) {
    int chunks = C / x128::size;
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)N * chunks) return;
    int row = (int)(idx / chunks), c = (int)(idx % chunks) * x128::size;
    float m = mean[row], s = rstd[row];
    x128 x8 = load128(inp + (size_t)row * C + c), w8 = load128(weight + c), b8 = load128(bias + c), y8;
    for (int k = 0; k < x128::size; k++)
        y8[k] = from_float<floatX>(ln_apply(to_float(x8[k]), m, s, to_float(w8[k]), to_float(b8[k])));
    store128(ln_out + (size_t)row * C + c, y8);
}

inline void layernorm_recompute(floatX* ln_out, const floatX* inp, const float* mean, const float* rstd,
                                const floatX* weight, const floatX* bias, int N, int C, cudaStream_t stream) {
    size_t threads = (size_t)N * (C / x128::size);
    layernorm_recompute_kernel<<<ceil_div(threads, 256), 256, 0, stream>>>(ln_out, inp, mean, rstd, weight, bias, N, C);
    CUDA_CHECK_LAUNCH();
}

constexpr int LN_BACKWARD_WARPS = 4;

// dinp += dx for rows [64*blockIdx.x, +64); partials[blockIdx.x] = (sum dy*xhat, sum dy) per channel.
// Dynamic shared memory: LN_BACKWARD_WARPS * 2 * C floats.
__global__ void layernorm_backward_kernel(floatX* dinp, float* partials, const floatX* dout, const floatX* inp,
                                          const floatX* weight, const float* mean, const float* rstd, int N, int C) {
    extern __shared__ float warp_acc[];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* dw_acc = warp_acc + (size_t)warp * 2 * C;
    float* db_acc = dw_acc + C;
    // each lane zeroes, and later updates, only its own channels: no synchronisation needed
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        for (int k = 0; k < x128::size; k++) dw_acc[c + k] = db_acc[c + k] = 0.0f;
    }
    int row_end = min(N, (blockIdx.x + 1) * LN_BACKWARD_ROWS_PER_BLOCK);
    for (int row = blockIdx.x * LN_BACKWARD_ROWS_PER_BLOCK + warp; row < row_end; row += LN_BACKWARD_WARPS) {
        const floatX* dy = dout + (size_t)row * C;
        const floatX* x = inp + (size_t)row * C;
        float m = mean[row], s = rstd[row];
        float sum_g = 0.0f, sum_g_xhat = 0.0f;
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
            x128 dy8 = load128(dy + c), x8 = load128(x + c), w8 = load128(weight + c);
            for (int k = 0; k < x128::size; k++) {
                float d = to_float(dy8[k]);
                float xhat = (to_float(x8[k]) - m) * s;
                float g = d * to_float(w8[k]);
                sum_g += g;
                sum_g_xhat += g * xhat;
                dw_acc[c + k] += d * xhat;
                db_acc[c + k] += d;
            }
        }
        float mean_g = warp_sum(sum_g) / C;
        float mean_g_xhat = warp_sum(sum_g_xhat) / C;
        floatX* dx = dinp + (size_t)row * C;
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
            x128 dy8 = load128(dy + c), x8 = load128(x + c), w8 = load128(weight + c), dx8 = load128(dx + c);
            for (int k = 0; k < x128::size; k++) {
                float xhat = (to_float(x8[k]) - m) * s;
                float g = to_float(dy8[k]) * to_float(w8[k]);
                dx8[k] = from_float<floatX>(to_float(dx8[k]) + s * (g - mean_g - xhat * mean_g_xhat));
            }
            store128(dx + c, dx8);
        }
    }
    __syncthreads();
    float* out = partials + (size_t)blockIdx.x * 2 * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float dw = 0.0f, db = 0.0f;
        for (int w = 0; w < LN_BACKWARD_WARPS; w++) {
            dw += warp_acc[(size_t)w * 2 * C + c];
            db += warp_acc[(size_t)w * 2 * C + C + c];
        }
        out[c] = dw;
        out[C + c] = db;
    }
}

// dinp += dx; dweight += sum dy*xhat; dbias += sum dy. `partials` holds ceil(N/64) * 2C floats
// (layernorm_backward_partials_floats, llmc/kernels/scratch_sizes.h).
inline void layernorm_backward(floatX* dinp, floatX* dweight, floatX* dbias, float* partials, const floatX* dout,
                               const floatX* inp, const floatX* weight, const float* mean, const float* rstd, int N,
                               int C, cudaStream_t stream) {
    int blocks = ceil_div(N, LN_BACKWARD_ROWS_PER_BLOCK);
    size_t shared = (size_t)LN_BACKWARD_WARPS * 2 * C * sizeof(float);
    if (shared > 48 * 1024) {  // above 48 KiB a kernel must opt in to more shared memory
        CUDA_CHECK(cudaFuncSetAttribute(layernorm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared));
    }
    layernorm_backward_kernel<<<blocks, LN_BACKWARD_WARPS * 32, shared, stream>>>(dinp, partials, dout, inp, weight,
                                                                                 mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
    add_column_partials(dweight, partials, blocks, 2 * (size_t)C, C, stream);
    add_column_partials(dbias, partials + C, blocks, 2 * (size_t)C, C, stream);
}
