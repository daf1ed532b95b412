// kv_attention.cuh — attention for new tokens against cached keys and values: the GPU twin of
// llmc/model/kv_cache.h (read it first: the cache's layout and the math are the same). Generation
// (llmc/run/generate.h) runs the prompt as n rows at once, then one row per token.
//
// kv_cache_store: one thread per element copies the new rows' k and v (the middle and last thirds
// of qkv's rows) into rows pos .. pos+n-1 of the layer's (T, C) caches.
// attention_cached: one block per (new row t, head h), 128 threads:
//   1. each thread takes keys u = tid, tid+128, ... <= pos+t: s_u = q . k_u / sqrt(hs), in fp32, into
//      shared memory (the row's scores: at most T floats, 4 KiB at T = 1024);
//   2. the block's max and sum of exp(s_u - max) (block_max, block_sum: a fixed order);
//   3. each thread takes output channels i = tid, tid+128, ... < hs: sum_u p_u v_u[i]. Neighbouring
//      threads read neighbouring channels of the same cached row: coalesced.
// Why not a matmul: for one new row the work is a matrix-vector product per head (2 (p+1) hs
// multiply-adds against (p+1) hs cached values read), memory-bound whatever it runs on, so the
// plain kernel is as fast as the cache can be read; the matmuls around it (qkv, projections, MLP)
// stay on cuBLASLt with one row. Unlike the training path's attention, the scores and
// probabilities stay fp32 (nothing is kept for a backward pass), so its results round differently
// from --kv-cache 0 in the last bf16 bit: the tests compare the two by log-probabilities, within a
// tolerance, and the tokens over a prefix.
#pragma once

#include "llmc/kernels/cuda_common.cuh"

constexpr int KV_ATTENTION_THREADS = 128;

__global__ void kv_cache_store_kernel(floatX* k_cache, floatX* v_cache, const floatX* qkv, int pos, int n, int C) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)n * C) return;
    int t = (int)(idx / C), c = (int)(idx % C);
    k_cache[(size_t)(pos + t) * C + c] = qkv[(size_t)t * 3 * C + C + c];
    v_cache[(size_t)(pos + t) * C + c] = qkv[(size_t)t * 3 * C + 2 * C + c];
}

inline void kv_cache_store(floatX* k_cache, floatX* v_cache, const floatX* qkv, int pos, int n, int C, cudaStream_t stream) {
    kv_cache_store_kernel<<<ceil_div((long long)n * C, 256), 256, 0, stream>>>(k_cache, v_cache, qkv, pos, n, C);
    CUDA_CHECK_LAUNCH();
}

// out: n rows of C; the caches hold positions 0 .. pos+n-1. Shared memory: 32 floats for the
// reductions, then pos+n scores.
__global__ void attention_cached_kernel(floatX* out, const floatX* qkv, const floatX* k_cache, const floatX* v_cache,
                                        int pos, int C, int NH) {
    extern __shared__ float shared[];
    float* reduce = shared;       // 32 floats
    float* scores = shared + 32;  // pos + n floats
    int t = blockIdx.x, h = blockIdx.y, hs = C / NH, last = pos + t;  // causal: this row sees 0 .. last
    const floatX* q = qkv + (size_t)t * 3 * C + h * hs;
    float scale = 1.0f / sqrtf((float)hs);
    float my_max = -INFINITY;
    for (int u = threadIdx.x; u <= last; u += blockDim.x) {
        const floatX* k = k_cache + (size_t)u * C + h * hs;
        float dot = 0.0f;
        for (int i = 0; i < hs; i++) dot += to_float(q[i]) * to_float(k[i]);
        scores[u] = dot * scale;
        my_max = fmaxf(my_max, scores[u]);
    }
    float max_score = block_max(my_max, reduce);  // (its barrier also makes every score visible)
    float my_sum = 0.0f;
    for (int u = threadIdx.x; u <= last; u += blockDim.x) {
        scores[u] = expf(scores[u] - max_score);  // subtract the max: exp never overflows
        my_sum += scores[u];
    }
    float sum = block_sum(my_sum, reduce);
    for (int i = threadIdx.x; i < hs; i += blockDim.x) {
        float acc = 0.0f;
        for (int u = 0; u <= last; u++) acc += scores[u] * to_float(v_cache[(size_t)u * C + h * hs + i]);
        out[(size_t)t * C + h * hs + i] = from_float<floatX>(acc / sum);
    }
}

inline void attention_cached(floatX* out, const floatX* qkv, const floatX* k_cache, const floatX* v_cache, int pos, int n,
                             int C, int NH, cudaStream_t stream) {
    size_t shared_bytes = (32 + (size_t)pos + n) * sizeof(float);
    attention_cached_kernel<<<dim3(n, NH), KV_ATTENTION_THREADS, shared_bytes, stream>>>(out, qkv, k_cache, v_cache, pos, C, NH);
    CUDA_CHECK_LAUNCH();
}
