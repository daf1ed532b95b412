// tensor_parallel_loss.h — the CPU trainer's classifier when the vocabulary is split over the
// tensor group: softmax + cross-entropy over all V tokens while each rank holds only its rows'
// logits (llmc/parallel/tensor_parallel.h, "LM head", is the lesson; tensor_parallel.cuh holds the
// GPU's version of the same three passes).
//
// Per position: the row maximum, then the sum of exponentials and the target's logit, cross the
// group (tp_max, tp_sum); the logits never do. The arithmetic is the one-rank classifier's
// (llmc/model/cpu_layers.h: crossentropy_forward, with its vexpf), split around the exchanges.
// The backward needs no communication (each rank's gradient is softmax - onehot over its own
// columns, from the logsumexp this pass left): it is the layer's own crossentropy_softmax_backward,
// given vocab_begin.
//
// Its own file, beside tensor_parallel.h rather than in it: tensor_parallel.h is also read by the GPU
// trainer (through tensor_parallel.cuh) and the estimator, which must not pull in the CPU layers and
// their OpenMP; and the layers themselves know nothing of communication.
#pragma once

#include <algorithm>
#include <cmath>
#include <vector>
#include "llmc/model/cpu_layers.h"            // vexpf
#include "llmc/parallel/tensor_parallel.h"    // TensorParallel, tp_max, tp_sum

namespace cpu {

// The forward pass. Columns [0, V) of each rank's (N x Vp) logits are real tokens vocab_begin + v;
// losses and logsumexp (N each) come out whole on every rank.
inline void crossentropy_forward_vocab_parallel(TensorParallel* tp, float* losses, float* logsumexp, const float* logits,
                                         const int* targets, int N, int V, int Vp, int vocab_begin) {
    std::vector<float> max_z((size_t)N), sums(2 * (size_t)N);
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* z = logits + (size_t)n * Vp;
        float m = -INFINITY;
        #pragma omp simd reduction(max : m)
        for (int v = 0; v < V; v++) m = std::max(m, z[v]);
        max_z[n] = m;
    }
    tp_max(tp, max_z.data(), N, "all-reduce of the logits' maxima");
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* z = logits + (size_t)n * Vp;
        float sum = 0.0f;
        #pragma omp simd reduction(+ : sum)
        for (int v = 0; v < V; v++) sum += vexpf(z[v] - max_z[n]);
        int target = targets[n] - vocab_begin;
        sums[2 * n] = sum;
        sums[2 * n + 1] = target >= 0 && target < V ? z[target] : 0.0f;   // one rank holds the target
    }
    tp_sum(tp, sums.data(), sums.size(), "all-reduce of the softmax sums and target logits");
    for (int n = 0; n < N; n++) {
        logsumexp[n] = max_z[n] + logf(sums[2 * n]);
        losses[n] = logsumexp[n] - sums[2 * n + 1];
    }
}

}  // namespace cpu
