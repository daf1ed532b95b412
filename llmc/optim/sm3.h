// sm3.h — SM3-II (Anil, Gupta, Koren & Singer, "Memory-Efficient Adaptive Optimization", NeurIPS
// 2019): Adagrad's per-parameter sum of squared gradients replaced by one accumulator per "cover
// set"; for a matrix, its rows and its columns. --optimizer sm3 on the CPU trainer.
//
// What it teaches: Adagrad divides by sqrt(sum over past steps of g_ij^2), one sum per parameter.
// SM3 keeps, for each set S_r of a cover of the parameters, mu(r) >= every parameter's sum in it,
// and bounds a parameter's sum by the smallest accumulator of the sets that contain it. With rows
// and columns as the cover, an n x m matrix keeps n + m numbers instead of nm, and the bound is
// tight where the squared gradients have row-and-column structure (embeddings, attention) — which
// is what the paper measures.
//
// SM3-II, the tighter of the paper's two variants, per step t and parameter (i, j):
//   nu_ij  = min(r_i, c_j) + g_ij^2        the smallest cover accumulator, plus this step's square
//   w_ij  <- w_ij - lr * g_ij / sqrt(nu_ij)
//   r_i    = max_j nu_ij;  c_j = max_i nu_ij   each accumulator: the largest nu of its set
// Accumulators start at 0 and never decay (it is Adagrad's sum, not Adam's average), so the
// effective step shrinks over the run; the learning rate is the run's schedule, warm-up included
// (--lr, --lr-schedule, --warmup-steps): with lr ~ 0.1 as Adagrad takes, not AdamW's 6e-4.
// A vector's cover is its single elements: nu_i = acc_i + g_i^2, Adagrad exactly.
//
// Our choices: where nu is 0 (a parameter whose gradient and every accumulator covering it were
// always 0, as wpe's positions beyond --seq-len) the update is 0, not 0/0 (the paper's code does the
// same, in place of an epsilon). No momentum (the paper's experiments add beta1 = 0.9; it would cost
// nm numbers per matrix). A parameter whose true gradient is exactly 0 but whose computed one is
// rounding noise (the key biases: softmax ignores a constant added to a row of scores) is moved by a
// full lr per step in a random direction, harmlessly (the loss cannot see it): with no epsilon,
// g / sqrt(nu) is +-1 whatever g's size. Weight decay decoupled, as the trainer's AdamW: w <- w (1 - lr wd) on the
// 2-D weights. --grad-clip scales g first. The tied embedding wte is one parameter with one state.
//
// Memory: (n + m) floats per matrix, n per vector (llmc/optim/optimizer_state.h), plus one row of
// scratch as wide as the widest matrix: the new column accumulators are computed before the
// parameters move, and the old ones are still needed by every row. Speed: two passes over g per
// matrix (columns, then rows with the update); AdamW makes one.
// Hook point: optimizer_step (llmc/run/step.h), through gpt2_update in train_gpt_cpu.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>
#include "llmc/optim/optimizer_state.h"

#ifndef LAYER_PROFILE
#define LAYER_PROFILE(...)
#endif

namespace cpu {

// The step for one parameter: 0 where nu = 0 (its gradient is 0 there too). (Both trainers': the
// GPU's kernels, llmc/optim/sm3.cuh, call it too.)
#ifdef __CUDACC__
__host__ __device__
#endif
inline float sm3_scaled_gradient(float g, float nu) { return nu > 0.0f ? g / sqrtf(nu) : 0.0f; }

// One block (optimizer_state.h): `w` its weights, `grad` its gradient (times grad_scale), `state`
// its row accumulators then column accumulators (matrix) or one per element (vector); `scratch`
// holds at least b.cols floats. `group` (tensor parallelism): a matrix cut over ranks takes the
// maximum over them of the accumulators of the dimension it is cut along, at the points marked
// "group" (llmc/optim/factored_tensor_parallel.h); null, the one-rank update.
inline void sm3_update(float* w, const float* grad, float* state, float* scratch, const ParamBlock& b, float lr,
                       float weight_decay, float grad_scale, const FactoredGroup* group = nullptr) {
    size_t n = b.rows, m = b.cols;
    float decay = 1.0f - lr * weight_decay;
    if (!b.is_matrix()) {
        #pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) {
            float g = grad[i] * grad_scale;
            float nu = state[i] + g * g;
            state[i] = nu;
            w[i] = w[i] * decay - lr * sm3_scaled_gradient(g, nu);
        }
        return;
    }
    float *r = state, *c = state + n;
    // 1. the new column accumulators, from the old r and c, into scratch: c_j = max_i nu_ij
    const size_t band = 64;
    #pragma omp parallel for schedule(static)
    for (size_t j0 = 0; j0 < m; j0 += band) {
        size_t j1 = std::min(m, j0 + band);
        for (size_t j = j0; j < j1; j++) scratch[j] = 0.0f;
        for (size_t i = 0; i < n; i++)
            for (size_t j = j0; j < j1; j++) {
                float g = grad[i * m + j] * grad_scale;
                scratch[j] = std::max(scratch[j], std::min(r[i], c[j]) + g * g);
            }
    }
    bool cut = group && b.cut != BlockCut::Whole;
    if (cut && b.cut == BlockCut::Rows) group->max(scratch, m);  // group: a column runs through every rank's rows
    // 2. each row: the update with the same nu, and the row's new accumulator (row i alone reads r_i);
    // with the columns cut, the row's maximum over this rank's part, kept aside until the others' arrive
    std::vector<float> row_part(cut && b.cut == BlockCut::Cols ? n : 0);
    float* new_r = row_part.empty() ? r : row_part.data();
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float row_max = 0.0f;
        for (size_t j = 0; j < m; j++) {
            float g = grad[i * m + j] * grad_scale;
            float nu = std::min(r[i], c[j]) + g * g;
            row_max = std::max(row_max, nu);
            w[i * m + j] = w[i * m + j] * decay - lr * sm3_scaled_gradient(g, nu);
        }
        new_r[i] = row_max;
    }
    if (!row_part.empty()) {
        group->max(row_part.data(), n);  // group: a row runs through every rank's columns
        std::copy(row_part.begin(), row_part.end(), r);
    }
    std::copy(scratch, scratch + m, c);
}

// SM3-II over the whole model (every block of optimizer_state.h), at the schedule's lr.
inline void sm3_step_all(float* params, const float* grads, float* state, float* scratch, const std::vector<ParamBlock>& blocks,
                         float lr, float weight_decay, float grad_scale, const FactoredGroup* group = nullptr) {
    size_t n = 0;
    for (const ParamBlock& b : blocks) n += b.elements();
    LAYER_PROFILE("SM3", 0, 4.0 * n * sizeof(float));  // reads g twice, w once; writes w
    for (const ParamBlock& b : blocks) {
        float wd = param_tensor_decays(b.tensor) ? weight_decay : 0.0f;
        sm3_update(params + b.offset, grads + b.offset, state + b.state, scratch, b, lr, wd, grad_scale, group);
    }
}

}  // namespace cpu
