// attention.cuh — causal self-attention: the simple, materialised path, and the dispatch between it
// and cuDNN's fused flash attention (attention_cudnn.cuh), chosen with --attention cudnn|simple.
//
// Per batch b and head h (hs = C/NH): S = Q K^T / sqrt(hs), masked to u <= t, P = softmax(S),
// O = P V. The simple path does it the way a textbook writes it, so it is obviously right and
// serves as the check on the fast path:
//   1. permute qkv (B, T, 3, NH, hs) into q, k, v (B, NH, T, hs): contiguous per head for cuBLAS
//   2. S = scale * Q K^T       cuBLAS strided-batched GEMM over the B*NH heads, fp32 accumulation
//   3. P = causal softmax(S)   one warp per row; P (B, NH, T, T) is KEPT for the backward
//   4. O = P V                 batched GEMM, then permuted back to (B, T, C)
// Backward: dP = dO V^T, dV = P^T dO, dS = P * (dP - rowsum(P * dP)) * scale, dQ = dS K,
// dK = dS^T Q: four batched GEMMs and one softmax-backward kernel (a block per row).
// Not fused, on purpose: it stores P, (B, NH, T, T) per layer (the att buffer), and moves every
// intermediate through memory. Use it to debug, for shapes cuDNN refuses, or in the fp32 build.
#pragma once

#include <algorithm>
#include <cublas_v2.h>
#include "llmc/kernels/attention_cudnn.cuh"
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/kernels/matmul.cuh"

struct AttentionContext {
    bool use_cudnn = true;
    CudnnAttention cudnn;
    // simple path
    cublasHandle_t cublas = nullptr;
    void* cublas_workspace = nullptr;  // the trainer's cuBLASLt workspace, shared (same stream)
    size_t cublas_workspace_bytes = 0;
    floatX* qkv_scratch = nullptr;   // (3, B, NH, T, hs)
    floatX* dqkv_scratch = nullptr;  // (3, B, NH, T, hs)
    floatX* o_scratch = nullptr;     // (B, NH, T, hs)
    floatX* scores = nullptr;        // (B, NH, T, T)
};

// (B, T, 3, NH, hs) -> three (B, NH, T, hs) blocks, or back (inverse = true). One thread per 8 values.
__global__ void attention_permute_kernel(floatX* heads, floatX* qkv, int B, int T, int C, int NH, int parts,
                                         bool inverse) {
    int hs = C / NH;
    size_t idx = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    size_t total = (size_t)B * T * parts * C;
    if (idx >= total) return;
    // idx walks the (B, T, parts, NH, hs) layout
    int i = (int)(idx % hs);
    int h = (int)((idx / hs) % NH);
    int part = (int)((idx / C) % parts);
    int t = (int)((idx / ((size_t)parts * C)) % T);
    int b = (int)(idx / ((size_t)parts * C * T));
    size_t head_idx = (size_t)part * B * NH * T * hs + (((size_t)b * NH + h) * T + t) * hs + i;
    if (!inverse) store128(heads + head_idx, load128(qkv + idx));
    else store128(qkv + idx, load128(heads + head_idx));
}

static void attention_permute(floatX* heads, floatX* qkv, int B, int T, int C, int NH, int parts, bool inverse,
                              cudaStream_t stream) {
    size_t threads = (size_t)B * T * parts * C / x128::size;
    attention_permute_kernel<<<ceil_div(threads, 256), 256, 0, stream>>>(heads, qkv, B, T, C, NH, parts, inverse);
    CUDA_CHECK_LAUNCH();
}

// att[row] = softmax over u <= t of scores[row] (already scaled), 0 for u > t. One warp per row.
__global__ void causal_softmax_forward_kernel(floatX* att, const floatX* scores, int rows, int T) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = row % T;
    const floatX* s = scores + (size_t)row * T;
    floatX* a = att + (size_t)row * T;
    float m = -INFINITY;
    for (int u = lane; u <= t; u += 32) m = fmaxf(m, to_float(s[u]));
    m = warp_max(m);
    float sum = 0.0f;
    for (int u = lane; u <= t; u += 32) sum += expf(to_float(s[u]) - m);
    float inv = 1.0f / warp_sum(sum);
    for (int u = lane; u < T; u += 32) a[u] = from_float<floatX>(u <= t ? expf(to_float(s[u]) - m) * inv : 0.0f);
}

// dscores[row] = att * (datt - sum(att * datt)) * scale, in place over datt. One block per row, one
// thread per 8 columns (T/8 threads in whole warps, at most 1024: beyond T = 8192 a thread takes
// several chunks). Why not a warp per row, as the forward: the kernel lab measured it at 30% of copy
// on an H200, below a block per row (40%): 32 lanes with 2-byte loads keep too few bytes in flight.
// Here the live part (u <= t) is read in 16-byte vectors (2-byte loads where T % 8 leaves rows
// unaligned, as the tests' T = 50), the second read for the write hits L1 (the same thread's chunk),
// and the chunks past t, half the matrix, are written as zeros without being read.
__device__ __forceinline__ x128 softmax_chunk(const floatX* p, bool aligned, int n) {
    if (aligned) return load128(p);
    x128 v = x128::zeros();
    for (int k = 0; k < n; k++) v[k] = p[k];
    return v;
}
__global__ void causal_softmax_backward_kernel(floatX* datt, const floatX* att, int rows, int T, float scale) {
    __shared__ float shared[32];
    constexpr int K = x128::size;
    int row = blockIdx.x, t = row % T;
    floatX* d = datt + (size_t)row * T;
    const floatX* a = att + (size_t)row * T;
    bool aligned = T % K == 0;
    float dot = 0.0f;
    for (int u0 = threadIdx.x * K; u0 <= t; u0 += blockDim.x * K) {
        int n = min(K, T - u0);
        x128 a8 = softmax_chunk(a + u0, aligned, n), d8 = softmax_chunk(d + u0, aligned, n);
        for (int k = 0; k < n && u0 + k <= t; k++) dot += to_float(a8[k]) * to_float(d8[k]);
    }
    dot = block_sum(dot, shared);
    for (int u0 = threadIdx.x * K; u0 < T; u0 += blockDim.x * K) {
        int n = min(K, T - u0);
        x128 out = x128::zeros();  // past t: zeros, nothing read
        if (u0 <= t) {
            x128 a8 = softmax_chunk(a + u0, aligned, n), d8 = softmax_chunk(d + u0, aligned, n);
            for (int k = 0; k < n && u0 + k <= t; k++) out[k] = from_float<floatX>(to_float(a8[k]) * (to_float(d8[k]) - dot) * scale);
        }
        if (aligned) {
            store128(d + u0, out);
        } else {
            for (int k = 0; k < n; k++) d[u0 + k] = out[k];
        }
    }
}

inline void causal_softmax_backward(floatX* datt, const floatX* att, int rows, int T, float scale, cudaStream_t stream) {
    int threads = std::min(1024, ceil_div(ceil_div(T, x128::size), 32) * 32);
    causal_softmax_backward_kernel<<<rows, threads, 0, stream>>>(datt, att, rows, T, scale);
    CUDA_CHECK_LAUNCH();
}

// One batched GEMM over the B*NH heads, column-major as cuBLAS sees it: C = alpha op(A) op(B).
static void batched_gemm(cublasHandle_t h, bool ta, bool tb, int m, int n, int k, float alpha, const floatX* a, int lda,
                         long long stride_a, const floatX* b, int ldb, long long stride_b, floatX* c, int ldc,
                         long long stride_c, int batch) {
    float beta = 0.0f;
    cublasComputeType_t compute = FLOATX_IS_FP32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
    CUBLAS_CHECK(cublasGemmStridedBatchedEx(h, ta ? CUBLAS_OP_T : CUBLAS_OP_N, tb ? CUBLAS_OP_T : CUBLAS_OP_N, m, n, k,
                                            &alpha, a, CUDA_FLOATX, lda, stride_a, b, CUDA_FLOATX, ldb, stride_b, &beta,
                                            c, CUDA_FLOATX, ldc, stride_c, batch, compute, CUBLAS_GEMM_DEFAULT));
}

// The simple path's cuBLAS handle (the cuDNN path's is made by cudnn_attention_setup).
inline void attention_init(AttentionContext* ctx, void* cublas_workspace, size_t cublas_workspace_bytes) {
    ctx->use_cudnn = false;
    CUBLAS_CHECK(cublasCreate(&ctx->cublas));
    ctx->cublas_workspace = cublas_workspace;
    ctx->cublas_workspace_bytes = cublas_workspace_bytes;
}

// Points cuBLAS at our stream and our workspace. The GEMMs run on the trainer's stream, in order with
// the cuBLASLt calls, so they can share the one workspace, and cuBLAS allocates nothing behind the
// buffer table's back. The order matters: cublasSetStream() resets the workspace to cuBLAS's own
// pool (which it would then allocate), so the workspace is set after the stream, every time.
static void attention_cublas_bind(AttentionContext* ctx, cudaStream_t stream) {
    CUBLAS_CHECK(cublasSetStream(ctx->cublas, stream));
    CUBLAS_CHECK(cublasSetWorkspace(ctx->cublas, ctx->cublas_workspace, ctx->cublas_workspace_bytes));
}

inline void attention_destroy(AttentionContext* ctx) {
    if (ctx->use_cudnn) cudnn_attention_destroy(&ctx->cudnn);
    if (ctx->cublas) CUBLAS_CHECK(cublasDestroy(ctx->cublas));
    ctx->cublas = nullptr;
}

// out (B, T, C) from qkv (B, T, 3C). Keeps for the backward: stats (B, NH, T) on the cuDNN path,
// att (B, NH, T, T) on the simple path.
inline void attention_forward(AttentionContext* ctx, floatX* out, float* stats, floatX* att, const floatX* qkv, int B,
                              int T, int C, int NH, cudaStream_t stream) {
    if (ctx->use_cudnn) {
        cudnn_attention_forward(&ctx->cudnn, out, stats, qkv, B, T, C, NH, stream);
        return;
    }
    int hs = C / NH, heads = B * NH;
    long long head_size = (long long)T * hs, score_size = (long long)T * T;
    floatX *q = ctx->qkv_scratch, *k = q + (size_t)heads * head_size, *v = k + (size_t)heads * head_size;
    attention_cublas_bind(ctx, stream);
    attention_permute(ctx->qkv_scratch, (floatX*)qkv, B, T, C, NH, 3, false, stream);
    // scores (T x T, row-major: [t][u]) = scale * Q K^T; column-major that is K Q^T
    batched_gemm(ctx->cublas, true, false, T, T, hs, 1.0f / sqrtf((float)hs), k, hs, head_size, q, hs, head_size,
                 ctx->scores, T, score_size, heads);
    int rows = heads * T;
    causal_softmax_forward_kernel<<<ceil_div(rows, 8), 256, 0, stream>>>(att, ctx->scores, rows, T);
    CUDA_CHECK_LAUNCH();
    // O (T x hs) = P V; column-major O^T = V^T P^T
    batched_gemm(ctx->cublas, false, false, hs, T, T, 1.0f, v, hs, head_size, att, T, score_size, ctx->o_scratch, hs,
                 head_size, heads);
    attention_permute(ctx->o_scratch, out, B, T, C, NH, 1, true, stream);
}

// dqkv (B, T, 3C), overwritten, from dout (B, T, C).
inline void attention_backward(AttentionContext* ctx, floatX* dqkv, const floatX* dout, const floatX* qkv,
                               const floatX* out, const float* stats, const floatX* att, int B, int T, int C, int NH,
                               cudaStream_t stream) {
    if (ctx->use_cudnn) {
        cudnn_attention_backward(&ctx->cudnn, dqkv, dout, qkv, out, stats, B, T, C, NH, stream);
        return;
    }
    int hs = C / NH, heads = B * NH;
    long long head_size = (long long)T * hs, score_size = (long long)T * T;
    size_t part = (size_t)heads * head_size;
    floatX *q = ctx->qkv_scratch, *k = q + part, *v = k + part;
    floatX *dq = ctx->dqkv_scratch, *dk = dq + part, *dv = dk + part;
    floatX* d_o = ctx->o_scratch;
    floatX* dscores = ctx->scores;
    attention_cublas_bind(ctx, stream);
    attention_permute(ctx->qkv_scratch, (floatX*)qkv, B, T, C, NH, 3, false, stream);  // later layers overwrote it
    attention_permute(d_o, (floatX*)dout, B, T, C, NH, 1, false, stream);
    // dP (T x T) = dO V^T
    batched_gemm(ctx->cublas, true, false, T, T, hs, 1.0f, v, hs, head_size, d_o, hs, head_size, dscores, T, score_size,
                 heads);
    // dV (T x hs) = P^T dO; column-major dV^T = dO^T P
    batched_gemm(ctx->cublas, false, true, hs, T, T, 1.0f, d_o, hs, head_size, att, T, score_size, dv, hs, head_size,
                 heads);
    int rows = heads * T;
    causal_softmax_backward(dscores, att, rows, T, 1.0f / sqrtf((float)hs), stream);
    // dQ (T x hs) = dS K; column-major dQ^T = K^T dS^T
    batched_gemm(ctx->cublas, false, false, hs, T, T, 1.0f, k, hs, head_size, dscores, T, score_size, dq, hs, head_size,
                 heads);
    // dK (T x hs) = dS^T Q; column-major dK^T = Q^T dS
    batched_gemm(ctx->cublas, false, true, hs, T, T, 1.0f, q, hs, head_size, dscores, T, score_size, dk, hs, head_size,
                 heads);
    attention_permute(ctx->dqkv_scratch, dqkv, B, T, C, NH, 3, true, stream);
}
