// adamw.h — the CPU trainer's optimizer step: the global gradient norm, clipping, and AdamW, in fp32.
// The CPU twin of llmc/optim/adamw.cuh (which reads this file's formulas as its reference), and the
// kernel lab's reference for the GPU's AdamW and global-norm kernels (dev/cuda/adamw.cu, global_norm.cu).
//
// A step's update, per parameter p with gradient g, after the gradient of the whole step is summed:
//   norm = sqrt(sum of g^2 over every parameter, every rank)     (the norm before clipping)
//   g    <- g * min(1, max_norm / (norm + 1e-6))                 (global-norm clipping, as PyTorch)
//   then AdamW (below). Each element's update depends only on its own p, g, m, v, which is why the
//   trainer can run it piece by piece on the shards a rank owns (llmc/parallel/zero.h) and get the
//   weights of updating the model whole.
// Memory: AdamW keeps two fp32 moments per parameter, 8 bytes (docs/memory.md); traffic per
// parameter: p, g, m, v read and p, m, v written.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>

// --profile: a no-op unless the program defined it first (llmc/probes/cpu_profile.h does; see
// llmc/model/cpu_layers.h).
#ifndef LAYER_PROFILE
#define LAYER_PROFILE(...)
#endif

namespace cpu {

// The sum over i < n of f(i), in fixed-size chunks summed in parallel and the chunk sums added in
// order, so the result does not depend on the number of threads. (Also Adafactor's RMS of weights
// and updates, llmc/optim/adafactor.h.)
template <class F>
inline double ordered_sum(size_t n, F f) {
    const size_t chunk = 1 << 16;
    size_t chunks = (n + chunk - 1) / chunk;
    std::vector<double> partial(chunks);
    #pragma omp parallel for schedule(static)
    for (size_t c = 0; c < chunks; c++) {
        double s = 0.0;
        size_t end = std::min(n, (c + 1) * chunk);
        #pragma omp simd reduction(+ : s)
        for (size_t i = c * chunk; i < end; i++) s += f(i);
        partial[c] = s;
    }
    double total = 0.0;
    for (double s : partial) total += s;
    return total;
}

// The sum of squares of n gradients, in double, in the same fixed chunks as ordered_sum (the same for
// any thread count). With several ranks each sums its shard and the shards' sums are added in rank
// order (comm_sum).
// It reads every gradient once, so it should run at memory bandwidth; ordered_sum's loop did not
// (the compiler kept one running double sum: one add at a time, 4 cycles each; 3 GB/s). Here each
// chunk is summed in 32 lanes (4 x 8 doubles, each lane its own elements in order, the lanes added
// in order at the end): measured on d12's 124M gradients, one thread of an AVX-512 Xeon, CPU time,
// 171 -> 61 ms (2.9 -> 8.1 GB/s: the memory's). The
// order of the sum changed with this: the norm may differ in its last bits.
typedef double vec8d __attribute__((vector_size(64)));
typedef float vec8f_unaligned __attribute__((vector_size(32), aligned(4)));
inline double sum_of_squares_chunk(const float* g, size_t n) {
    vec8d acc[4] = {};
    size_t i = 0;
    for (; i + 32 <= n; i += 32)
        for (int a = 0; a < 4; a++) {
            vec8d x = __builtin_convertvector(*(const vec8f_unaligned*)(g + i + 8 * a), vec8d);
            acc[a] += x * x;
        }
    double s = 0.0;
    for (int a = 0; a < 4; a++)
        for (int l = 0; l < 8; l++) s += acc[a][l];
    for (; i < n; i++) s += (double)g[i] * g[i];
    return s;
}

inline double sum_of_squares(const float* grads, size_t n) {
    LAYER_PROFILE("gradient norm", 0, 1.0 * n * sizeof(float));
    const size_t chunk = 1 << 16;  // ordered_sum's
    size_t chunks = (n + chunk - 1) / chunk;
    std::vector<double> partial(chunks);
    #pragma omp parallel for schedule(static)
    for (size_t c = 0; c < chunks; c++) partial[c] = sum_of_squares_chunk(grads + c * chunk, std::min(chunk, n - c * chunk));
    double total = 0.0;
    for (double s : partial) total += s;
    return total;
}

// sqrt(sum of squares) over all gradients of one rank.
inline float global_grad_norm(const float* grads, size_t n) { return (float)std::sqrt(sum_of_squares(grads, n)); }

// The clip coefficient, as torch.nn.utils.clip_grad_norm_ computes it.
inline float clip_coefficient(float norm, float max_norm) {
    if (max_norm <= 0.0f) return 1.0f;
    return std::min(1.0f, max_norm / (norm + 1e-6f));
}

// AdamW (Loshchilov & Hutter), with grad_scale applied to the gradients (for clipping):
//   p <- p * (1 - lr*wd)                                  decoupled decay, 2-D weights only
//   m <- b1 m + (1-b1) g;   v <- b2 v + (1-b2) g^2        moment estimates
//   p <- p - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)   bias-corrected step
// written in the same order of operations as PyTorch's implementation, so the two agree closely.
inline void adamw_update(float* params, const float* grads, float* m, float* v, size_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int t, float grad_scale) {
    LAYER_PROFILE("AdamW", 0, 7.0 * n * sizeof(float));  // reads p, g, m, v; writes p, m, v
    float bias_correction1 = 1.0f - powf(beta1, (float)t);
    float bias_correction2_sqrt = sqrtf(1.0f - powf(beta2, (float)t));
    float step_size = lr / bias_correction1;
    float decay = 1.0f - lr * weight_decay;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float grad = grads[i] * grad_scale;
        m[i] = beta1 * m[i] + (1.0f - beta1) * grad;
        v[i] = beta2 * v[i] + (1.0f - beta2) * grad * grad;
        float denom = sqrtf(v[i]) / bias_correction2_sqrt + eps;
        params[i] = params[i] * decay - step_size * m[i] / denom;
    }
}

}  // namespace cpu
