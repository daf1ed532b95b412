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
// The floor is the row traffic: dy and x read, dx read and written, 8 bytes per element in bf16
// (50 MB at d12, B=8: ~12 us at 4.2 TB/s). The kernel is shaped so that nothing else costs time:
//   - a row belongs to a group of C/8 threads, a thread to 8 channels: the thread loads its 16 bytes
//     of dy, x and dx for two rows at once (six loads in flight), keeps them in registers through the
//     row's two sums and writes dx from them: every byte read once, one DRAM latency per two rows;
//   - the thread owns its 8 channels for every row its block takes, so dw and db accumulate in its
//     registers (no shared-memory traffic per element, no atomics);
//   - a fixed grid (layernorm_backward_blocks: up to 256 blocks of up to 4 groups, at least 32 rows
//     a block) takes the rows in a fixed stride; at the end a block adds its groups in order into one
//     partial of 2C floats, and add_column_partials adds the partials in order.
// Fixed grid, fixed order, no atomics: bit-identical every run, on any GPU. Extra traffic: 256
// partials of 2C floats written and read (3 MB at C = 768, 6% of the floor's bytes). The kernel lab
// (dev/cuda/layernorm.cu) keeps the version this replaced (a warp per row, 64 rows a block, shared-
// memory accumulators), which ran at 13% of copy on an H200.
#pragma once

#include <algorithm>
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/kernels/scratch_sizes.h"  // layernorm_backward_blocks (the size table reads it too)

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

// Rows a thread holds at once: two rows' loads in flight per DRAM latency, 12 registers a row.
constexpr int LN_BACKWARD_ROWS_AT_ONCE = 2;
// Threads across a row: one per 16 bytes of it, rounded up to whole warps (the row sums are warp sums).
inline int layernorm_backward_lanes(int C) { return ceil_div(C / x128::size, 32) * 32; }

// Block (lanes, groups): thread (x, y) owns channels [x*8, x*8+8) of group y's rows. The block takes
// LN_BACKWARD_ROWS_AT_ONCE rows per group per iteration, rows first + y*ROWS_AT_ONCE + r, first
// striding by the grid; partials[blockIdx.x] = (sum dy*xhat, sum dy) over the block's rows.
// Dynamic shared memory: layernorm_backward_shared_floats.
__global__ void layernorm_backward_kernel(floatX* dinp, float* partials, const floatX* dout, const floatX* inp,
                                          const floatX* weight, const float* mean, const float* rstd, int N, int C) {
    constexpr int R = LN_BACKWARD_ROWS_AT_ONCE, K = x128::size;
    extern __shared__ float shared[];
    int x = threadIdx.x, y = threadIdx.y, groups = blockDim.y;
    int warps = blockDim.x / 32, warp = x / 32, lane = x % 32;
    int c = x * K;
    bool live = c < C;  // the lanes past C/8 (rounding up to a warp) only join the warp sums
    x128 w8 = live ? load128(weight + c) : x128::zeros();
    float dw[K] = {}, db[K] = {};
    // the row sums, two per row, one per warp: sums[parity][y][2R][warps], two buffers so that the
    // next iteration's writes never meet this one's reads (one barrier per iteration, not two)
    int sums_size = groups * 2 * R * warps;
    int rows_per_block = groups * R, it = 0;
    // every thread of the block runs the same iterations: the barriers inside are reached by all
    for (int first = blockIdx.x * rows_per_block; first < N; first += gridDim.x * rows_per_block, it++) {
        x128 dy8[R], x8[R], dx8[R];
        float m[R], s[R];
        int row0 = first + y * R;
        for (int r = 0; r < R; r++) {  // every load of the iteration issued before any is used
            int row = row0 + r;
            bool ok = live && row < N;
            dy8[r] = ok ? load128cs(dout + (size_t)row * C + c) : x128::zeros();
            x8[r] = ok ? load128cs(inp + (size_t)row * C + c) : x128::zeros();
            dx8[r] = ok ? load128(dinp + (size_t)row * C + c) : x128::zeros();
            m[r] = row < N ? mean[row] : 0.0f;
            s[r] = row < N ? rstd[row] : 0.0f;
        }
        float* sums = shared + (it & 1) * sums_size + y * 2 * R * warps;
        for (int r = 0; r < R; r++) {
            float sum_g = 0.0f, sum_g_xhat = 0.0f;
            for (int k = 0; k < K; k++) {  // zeros past the row's end and past C: they add nothing
                float d = to_float(dy8[r][k]);
                float xhat = (to_float(x8[r][k]) - m[r]) * s[r];
                float g = d * to_float(w8[k]);
                sum_g += g;
                sum_g_xhat += g * xhat;
                dw[k] += d * xhat;
                db[k] += d;
            }
            sum_g = warp_sum(sum_g);
            sum_g_xhat = warp_sum(sum_g_xhat);
            if (lane == 0) {
                sums[(2 * r) * warps + warp] = sum_g;
                sums[(2 * r + 1) * warps + warp] = sum_g_xhat;
            }
        }
        __syncthreads();
        for (int r = 0; r < R; r++) {
            int row = row0 + r;
            float sum_g = 0.0f, sum_g_xhat = 0.0f;
            for (int w = 0; w < warps; w++) {  // in warp order: every thread gets the same bits
                sum_g += sums[(2 * r) * warps + w];
                sum_g_xhat += sums[(2 * r + 1) * warps + w];
            }
            if (!live || row >= N) continue;
            float mean_g = sum_g / C, mean_g_xhat = sum_g_xhat / C;
            for (int k = 0; k < K; k++) {
                float xhat = (to_float(x8[r][k]) - m[r]) * s[r];
                float g = to_float(dy8[r][k]) * to_float(w8[k]);
                dx8[r][k] = from_float<floatX>(to_float(dx8[r][k]) + s[r] * (g - mean_g - xhat * mean_g_xhat));
            }
            store128(dinp + (size_t)row * C + c, dx8[r]);
        }
    }
    // the groups' column sums into one partial, group 0 first, then 1, ...: a fixed order
    __syncthreads();  // the last iteration's row sums have been read: the shared memory is free
    float* acc = shared;  // [0, C): dw, [C, 2C): db
    for (int g = 0; g < groups; g++) {
        if (y == g && live) {
            float* out = g == groups - 1 ? partials + (size_t)blockIdx.x * 2 * C : acc;  // the last writes the partial
            for (int k = 0; k < K; k++) {
                out[c + k] = g == 0 ? dw[k] : acc[c + k] + dw[k];
                out[C + c + k] = g == 0 ? db[k] : acc[C + c + k] + db[k];
            }
        }
        __syncthreads();
    }
}

inline size_t layernorm_backward_shared_floats(int C, int groups) {
    return std::max((size_t)2 * C, (size_t)2 * groups * 2 * LN_BACKWARD_ROWS_AT_ONCE * (layernorm_backward_lanes(C) / 32));
}

// dinp += dx; dweight += sum dy*xhat; dbias += sum dy. `partials` holds layernorm_backward_blocks(N)
// * 2C floats (layernorm_backward_partials_floats, llmc/kernels/scratch_sizes.h). C / 8 <= 1024
// (a row's threads fit one block): train_gpt.cu's check_gpu_shape refuses wider models.
inline void layernorm_backward(floatX* dinp, floatX* dweight, floatX* dbias, float* partials, const floatX* dout,
                               const floatX* inp, const floatX* weight, const float* mean, const float* rstd, int N,
                               int C, cudaStream_t stream) {
    int lanes = layernorm_backward_lanes(C);
    int groups = std::max(1, std::min(4, 1024 / lanes));  // up to 4 groups: more rows a block, fewer partials
    int blocks = layernorm_backward_blocks(N);
    size_t shared = layernorm_backward_shared_floats(C, groups) * sizeof(float);
    if (shared > 48 * 1024) {  // above 48 KiB (C > 6144) a kernel must opt in to more shared memory
        CUDA_CHECK(cudaFuncSetAttribute(layernorm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared));
    }
    layernorm_backward_kernel<<<blocks, dim3(lanes, groups), shared, stream>>>(dinp, partials, dout, inp, weight,
                                                                               mean, rstd, N, C);
    CUDA_CHECK_LAUNCH();
    add_column_partials(dweight, partials, blocks, 2 * (size_t)C, C, stream);
    add_column_partials(dbias, partials + C, blocks, 2 * (size_t)C, C, stream);
}
