// adafactor.h — Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear
// Memory Cost", ICML 2018): Adam's per-parameter second moment replaced, for each weight matrix, by
// one number per row and one per column. --optimizer adafactor on the CPU trainer.
//
// What it teaches: an n x m matrix's second moment V (nm numbers) is estimated from its row sums R
// (n) and column sums C (m) as the rank-1 matrix R C^T / sum(R), the best rank-1 fit under the
// generalised KL divergence (the paper's section 3). Dropping the first moment (beta1 = 0) as the
// paper does, the optimizer keeps n + m numbers per matrix instead of AdamW's 2nm.
//
// The paper's Algorithm 4 (a matrix X, gradient G, step t = 1, 2, ...); Algorithm 5 for a vector
// is the same with a full V:
//   alpha_t = max(eps2, RMS(X_{t-1})) * rho_t              relative step size: a step is a fraction
//                                                         rho_t of the weights' own scale
//   beta2_t = 1 - t^-0.8                                  0 at t = 1: no bias correction needed
//   R_t = beta2_t R_{t-1} + (1 - beta2_t) (G^2 + eps1) 1_m         row sums
//   C_t = beta2_t C_{t-1} + (1 - beta2_t) 1_n^T (G^2 + eps1)       column sums
//   V_t = R_t C_t / (1_n^T R_t)                            (vector: V_t = beta2_t V_{t-1} + (1 - beta2_t)(G^2 + eps1))
//   U_t = G / sqrt(V_t)
//   U_t <- U_t / max(1, RMS(U_t) / d)                     update clipping: the paper's remedy for a
//                                                         slow-decaying V that under-estimates G^2
//   X_t = X_{t-1} - alpha_t U_t
// with eps1 = 1e-30, eps2 = 1e-3, d = 1, rho_t = min(1e-2, 1/sqrt(t)). At t = 1, beta2_1 = 0, so a
// vector's V_1 is G^2 + eps1 exactly (test/test_optimizers.py checks it by hand).
//
// Our choices, where the paper leaves them open:
//   - beta1 = 0 always: no first moment is offered (it would cost nm numbers per matrix, the very
//     memory Adafactor saves); --beta1, --beta2 and --adam-eps are AdamW's and are refused with it.
//   - rho_t: the paper's min(1e-2, 1/sqrt(t)) unless --lr is given; with --lr, rho_t is the run's
//     schedule (--lr-schedule, --warmup-steps) at that step, still scaled by max(eps2, RMS(X)).
//   - weight decay: decoupled, as the trainer's AdamW (Loshchilov & Hutter), on the same tensors
//     (the 2-D weights): X <- X (1 - rho_t wd) before the update. rho_t, not alpha_t: decay is a
//     relative shrink, as the relative step is. --weight-decay's default 0.1 therefore shrinks a
//     matrix by 1e-3 per step at rho = 1e-2; pass --weight-decay 0 for the paper's Adafactor.
//   - global-norm clipping (--grad-clip) still scales G first, as for every optimizer here.
//   - the sums R, C and RMS are accumulated in double, and V and U formed in double: R_i C_j for a
//     row that never had a gradient (a position beyond --seq-len in wpe: R_i = m eps1) is below
//     fp32's smallest number, and G / sqrt(0) would be a NaN where the answer is 0.
//   - eps1 = 1e-30 does not damp a gradient that is rounding noise around an exact 0 (the key
//     biases: softmax ignores a constant added to a row of scores): U = g / sqrt(g^2) = +-1 there,
//     a step of eps2 rho in a random direction, which the loss cannot see (docs/memory.md).
// Which dimension is which: a weight is stored (out, in) (llmc/optim/optimizer_state.h), so R has
// one number per output feature and C one per input feature.
//
// Memory: the state is (n + m) floats per matrix and n per vector (optimizer_state.h); GPT-2 124M:
// 0.32M floats, 1.3 MB, against AdamW's 8 bytes x 124M = 995 MB. No scratch. Speed: three passes
// over G (row sums, column sums, RMS of U) and one over X and G for the update; AdamW makes one.
// Hook point: optimizer_step (llmc/run/step.h), through gpt2_update in train_gpt_cpu.cpp.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <vector>
#include "llmc/optim/adamw.h"  // ordered_sum
#include "llmc/optim/optimizer_state.h"

#ifndef LAYER_PROFILE
#define LAYER_PROFILE(...)
#endif

namespace cpu {

constexpr float ADAFACTOR_EPS1 = 1e-30f, ADAFACTOR_EPS2 = 1e-3f, ADAFACTOR_CLIP_D = 1.0f;

inline float adafactor_beta2(int t) { return 1.0f - powf((float)t, -0.8f); }
inline float adafactor_relative_step(int t) { return std::min(1e-2f, 1.0f / sqrtf((float)t)); }

// The per-element and per-block arithmetic, written once for both trainers: the GPU's kernels
// (llmc/optim/adafactor.cuh) call these same functions, in double as here.
// U_ij of a matrix: G_ij / sqrt(R_i C_j / sum(R)), as G_ij sqrt((1/C_j) / (R_i / sum(R))).
#ifdef __CUDACC__
__host__ __device__
#endif
inline double adafactor_matrix_u(double g, double r_i, double inv_col_j, double inv_sum_r) {
    return g * sqrt(inv_col_j / (r_i * inv_sum_r));
}
// The step alpha_t / max(1, RMS(U) / d) from the block's sums of X^2 and U^2 over its `elements`.
#ifdef __CUDACC__
__host__ __device__
#endif
inline double adafactor_step_size(double sum_x2, double sum_u2, double elements, float rho) {
    double alpha = fmax((double)ADAFACTOR_EPS2, sqrt(sum_x2 / elements)) * rho;
    return alpha / fmax(1.0, sqrt(sum_u2 / elements) / ADAFACTOR_CLIP_D);
}

// One block (a matrix or a vector, optimizer_state.h) of step t: `x` its weights, `g` its gradient
// (times grad_scale, the global-norm clip), `state` its R then C (matrix) or V (vector). `group`
// (tensor parallelism): a block cut over ranks adds its partial sums over them at the points
// marked "group", as llmc/optim/factored_tensor_parallel.h explains; null, the one-rank update.
inline void adafactor_update(float* x, const float* g, float* state, const ParamBlock& b, float rho, float beta2,
                             float weight_decay, float grad_scale, const FactoredGroup* group = nullptr) {
    bool cut = group && b.cut != BlockCut::Whole;
    size_t n = b.rows, m = b.cols, count = b.elements();
    double sum_x2 = ordered_sum(count, [&](size_t i) { return (double)x[i] * x[i]; }), elements = (double)count;
    double keep = beta2, fresh = 1.0 - (double)beta2;
    auto grad = [&](size_t i) { return (double)(g[i] * grad_scale); };
    std::vector<double> inv_col;  // 1/C_j, so the passes below divide once per column, not per element
    float* R = state;
    double inv_sum_r = 0.0;
    if (b.is_matrix()) {
        float* C = state + n;
        std::vector<double> row_sums(n), col_sums(m);  // this step's sums of G^2 + eps1 over each row, each column
        #pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) {
            double s = 0.0;
            for (size_t j = 0; j < m; j++) s += grad(i * m + j) * grad(i * m + j) + ADAFACTOR_EPS1;
            row_sums[i] = s;
        }
        // column sums: each thread owns a band of columns and walks every row through it
        const size_t band = 64;
        #pragma omp parallel for schedule(static)
        for (size_t j0 = 0; j0 < m; j0 += band) {
            size_t j1 = std::min(m, j0 + band);
            double s[band] = {0.0};
            for (size_t i = 0; i < n; i++)
                for (size_t j = j0; j < j1; j++) s[j - j0] += grad(i * m + j) * grad(i * m + j) + ADAFACTOR_EPS1;
            for (size_t j = j0; j < j1; j++) col_sums[j] = s[j - j0];
        }
        double sum_r = 0.0;
        auto update_rows = [&] {
            for (size_t i = 0; i < n; i++) R[i] = (float)(keep * R[i] + fresh * row_sums[i]);
            for (size_t i = 0; i < n; i++) sum_r += R[i];
        };
        bool rows_here = !cut || b.cut == BlockCut::Rows;  // R is this rank's own (rows cut, or whole)
        if (rows_here) update_rows();
        if (cut) {  // group: RMS(X)'s sum and count, sum(R) (rows cut), and the other dimension's G^2 sums
            std::vector<double>& across = b.cut == BlockCut::Rows ? col_sums : row_sums;
            across.insert(across.begin(), {sum_x2, elements, sum_r});
            group->sum(across.data(), across.size());
            sum_x2 = across[0], elements = across[1], sum_r = across[2];
            across.erase(across.begin(), across.begin() + 3);
        }
        if (!rows_here) update_rows();  // columns cut: every rank holds all n rows' R, from the whole rows' sums
        for (size_t j = 0; j < m; j++) C[j] = (float)(keep * C[j] + fresh * col_sums[j]);
        inv_sum_r = 1.0 / sum_r;
        inv_col.resize(m);
        for (size_t j = 0; j < m; j++) inv_col[j] = 1.0 / C[j];
    } else {
        #pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) state[i] = (float)(keep * state[i] + fresh * (grad(i) * grad(i) + ADAFACTOR_EPS1));
        if (cut) {  // group: a cut vector's V is elementwise, only RMS(X) spans the ranks
            double sums[2] = {sum_x2, elements};
            group->sum(sums, 2);
            sum_x2 = sums[0], elements = sums[1];
        }
    }
    // U = G / sqrt(V), with V_ij = R_i C_j / sum(R) (matrix) or V_i (vector)
    auto update = [&](size_t k) {
        if (!b.is_matrix()) return grad(k) / std::sqrt((double)state[k]);
        return adafactor_matrix_u(grad(k), (double)R[k / m], inv_col[k % m], inv_sum_r);
    };
    double sum_u2 = ordered_sum(count, [&](size_t k) { double u = update(k); return u * u; });
    if (cut) group->sum(&sum_u2, 1);  // group: RMS(U) is over the whole update
    double step = adafactor_step_size(sum_x2, sum_u2, elements, rho);
    float decay = 1.0f - rho * weight_decay;
    #pragma omp parallel for schedule(static)
    for (size_t k = 0; k < count; k++) x[k] = (float)(x[k] * decay - step * update(k));
}

// Adafactor over the whole model (every block of optimizer_state.h), step t (from 1), at relative
// step rho (adafactor_relative_step(t), or the run's schedule when --lr was given).
inline void adafactor_step(float* params, const float* grads, float* state, const std::vector<ParamBlock>& blocks, float rho,
                           int t, float weight_decay, float grad_scale, const FactoredGroup* group = nullptr) {
    size_t n = 0;
    for (const ParamBlock& b : blocks) n += b.elements();
    LAYER_PROFILE("Adafactor", 0, 7.0 * n * sizeof(float));  // reads x twice, g four times; writes x
    float beta2 = adafactor_beta2(t);
    for (const ParamBlock& b : blocks) {
        float wd = param_tensor_decays(b.tensor) ? weight_decay : 0.0f;
        adafactor_update(params + b.offset, grads + b.offset, state + b.state, b, rho, beta2, wd, grad_scale, group);
    }
}

}  // namespace cpu

// The GPU's scratch (llmc/optim/adafactor.cuh; GB_OPTIMIZER_SCRATCH in llmc/memory/gpu_buffers.h), in
// doubles: the block being updated's three sums, then two partials (X^2, U^2) per row of the tallest
// block (a vector has one per thread block, fewer than its elements).
enum AdafactorScalar { AF_SUM_X2, AF_SUM_R, AF_SUM_U2, AF_SCALARS };
inline size_t adafactor_gpu_scratch_doubles(const GPT2Config& cfg) {
    size_t rows = 0;
    for (const ParamBlock& b : param_blocks(cfg)) rows = std::max(rows, b.rows);
    return AF_SCALARS + 2 * rows;
}
