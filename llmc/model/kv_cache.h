// kv_cache.h — attention for new tokens against cached keys and values: the CPU layer that makes
// generation cost one position per token (why, and the loop that uses it: llmc/run/generate.h).
//
// One layer's cache holds the key and value rows of every position so far, (T, C) each, heads side
// by side as in qkv's rows. For n new tokens at positions pos .. pos+n-1:
//     kv_cache_store      copies their k and v rows (the middle and last thirds of qkv's rows) into
//                         rows pos .. pos+n-1 of the cache;
//     attention_cached    for each new row t (position p = pos + t) and head h:
//                             s_u = q_t . k_u / sqrt(hs)              u = 0 .. p (causal: not beyond p)
//                             out_t = sum_u softmax(s)_u v_u
// The prompt arrives as n rows at once (prefill, pos = 0), each later token as one row (decode).
// Nothing is kept for a backward pass: generation has none.
//
// Cost per new row: 2 x (p+1) x C multiply-adds, against the full forward's 2 x (T^2/2) x C for
// the whole window. Threads split the (row, head) pairs; each writes its own slice of out, and the
// sums run in a fixed order, so the result does not depend on the thread count.
//
// The linear layers of a decode step have one row, and there the blocked SGEMM
// (llmc/model/cpu_matmul.h) is the wrong tool: it packs the whole weight matrix into panels before
// using it, so that many rows can reuse each panel; with one row, packing reads and writes every
// weight once more for nothing (measured: 3x slower than PyTorch's one-row product). So
// matmul_forward_few_rows takes each output as a dot product of the row with a weight row, which
// streams the weights once, in the order they lie in memory: decode is memory-bound, and that is
// all it can do.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>
#include "llmc/model/cpu_layers.h"  // vexpf, the same exp the training attention uses

namespace cpu {

constexpr int FEW_ROWS = 4;  // up to this many rows, matmul_forward_few_rows; beyond, the blocked SGEMM

// out (N x OC) = inp (N x IC) * weight^T + bias, for N <= FEW_ROWS: one dot product per output,
// threads splitting the outputs. 16 partial sums (one per lane of a vector register) let the
// compiler vectorise the sum without reordering it; they are added in a fixed order at the end.
inline void matmul_forward_few_rows(float* out, const float* inp, const float* weight, const float* bias, int N, int IC,
                                    int OC) {
    #pragma omp parallel for schedule(static)
    for (int o = 0; o < OC; o++) {
        const float* w = weight + (size_t)o * IC;
        for (int n = 0; n < N; n++) {
            const float* x = inp + (size_t)n * IC;
            float lanes[16] = {};
            int i = 0;
            for (; i + 16 <= IC; i += 16)
                for (int j = 0; j < 16; j++) lanes[j] += x[i + j] * w[i + j];
            float sum = 0.0f;
            for (int j = 0; j < 16; j++) sum += lanes[j];
            for (; i < IC; i++) sum += x[i] * w[i];
            out[(size_t)n * OC + o] = bias ? sum + bias[o] : sum;
        }
    }
}

// The linear layer for the new rows of a generation step: a few rows (decode) or many (a prompt).
inline void matmul_forward_new_rows(float* out, const float* inp, const float* weight, const float* bias, int N, int IC,
                                    int OC) {
    if (N <= FEW_ROWS) matmul_forward_few_rows(out, inp, weight, bias, N, IC, OC);
    else matmul_forward(out, inp, weight, bias, N, IC, OC);
}

// k_cache, v_cache: (T, C) for one layer; qkv: n rows of 3C (q, k, v).
inline void kv_cache_store(float* k_cache, float* v_cache, const float* qkv, int pos, int n, int C) {
    for (int t = 0; t < n; t++) {
        memcpy(k_cache + (size_t)(pos + t) * C, qkv + (size_t)t * 3 * C + C, C * sizeof(float));
        memcpy(v_cache + (size_t)(pos + t) * C, qkv + (size_t)t * 3 * C + 2 * C, C * sizeof(float));
    }
}

// out: n rows of C. The caches must already hold positions 0 .. pos+n-1 (kv_cache_store first).
inline void attention_cached(float* out, const float* qkv, const float* k_cache, const float* v_cache, int pos, int n,
                             int C, int NH) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    #pragma omp parallel
    {
        std::vector<float> scores((size_t)(pos + n));
        #pragma omp for collapse(2) schedule(static)
        for (int t = 0; t < n; t++) {
            for (int h = 0; h < NH; h++) {
                const float* q = qkv + (size_t)t * 3 * C + h * hs;
                int last = pos + t;  // causal: this row sees positions 0 .. last
                float max_score = -INFINITY;
                for (int u = 0; u <= last; u++) {
                    const float* k = k_cache + (size_t)u * C + h * hs;
                    float dot = 0.0f;
                    for (int i = 0; i < hs; i++) dot += q[i] * k[i];
                    scores[u] = dot * scale;
                    max_score = std::max(max_score, scores[u]);
                }
                float sum = 0.0f;
                for (int u = 0; u <= last; u++) {
                    scores[u] = vexpf(scores[u] - max_score);  // subtract the max: exp never overflows
                    sum += scores[u];
                }
                float* o = out + (size_t)t * C + h * hs;
                for (int i = 0; i < hs; i++) o[i] = 0.0f;
                for (int u = 0; u <= last; u++) {
                    const float* v = v_cache + (size_t)u * C + h * hs;
                    float p = scores[u] / sum;
                    for (int i = 0; i < hs; i++) o[i] += p * v[i];
                }
            }
        }
    }
}

}  // namespace cpu
