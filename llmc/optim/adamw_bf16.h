// adamw_bf16.h — AdamW with its moments m and v stored in bf16, rounded stochastically: 12 bytes per
// parameter on the CPU trainer (fp32 weights 4, fp32 gradients 4, m 2, v 2) against 16.
// --optimizer-state bf16. Read llmc/optim/adamw.h first: the arithmetic is the same, in fp32; only
// where m and v rest between steps changes.
//
// What it teaches: why a moving average cannot simply be stored in 16 bits. v moves by (1 - beta2)
// of itself per step: with beta2 = 0.999 and g = 0, v_t = 0.999 v_{t-1}, a relative change of 1e-3.
// bf16 keeps 8 significant bits, so neighbouring values are 2^-8 to 2^-7 of the value apart, and
// half of that gap, at least 2^-9 = 0.00195 of v, is more than the step's 0.001: round-to-nearest
// maps 0.999 v back to v. v never decays, however many steps pass,
// and the step size g / sqrt(v) stays too small long after the gradients that made v large are gone.
// Stochastic rounding rounds up with probability (x - down) / (up - down), so E[round(x)] = x: each
// step's 1e-3 survives on average, and v decays like beta2^t (test/test_adamw_bf16.cpp shows both).
//
// The random bits: a counter-based hash of (step, element index) (llmc/model/model.h's splitmix64),
// not a generator's state, so the rounding is the same for any number of threads, the same on every
// data-parallel replica (ZeRO-1's shards use the element's index in the flat array, so ZeRO-1 equals
// ZeRO-0), and a resumed run rounds as the straight run did: resume stays bit-exact. The index is
// the element's in the WHOLE model's flat array, also on a tensor- or pipeline-parallel rank whose
// slice holds it elsewhere (llmc/parallel/process_grid.h's slice_global_index): each element rounds
// with the bits it gets on one rank, so a grid's moments are the one-rank run's wherever the values
// before rounding agree (test_gpu_optimizers.py compares them), not a stream of the rank's own.
//
// Memory: m and v 2 bytes each instead of 4 (4 bytes per parameter saved). Speed: the same passes as
// AdamW plus a hash per element; traffic per parameter 4 + 4 + 2 + 2 read, 4 + 2 + 2 written.
// The checkpoint stores m and v as fp32 (exactly: a bf16 widens without rounding), so its format does
// not change: a bf16 run resumes bit for bit, and a checkpoint of the other precision converts
// (fp32 -> bf16 rounds to nearest once, at the resume). Hook point: optimizer_step, through
// gpt2_update in train_gpt_cpu.cpp; the GPU trainer's --offload optimizer runs this same loop on the
// host (llmc/optim/offload.cuh).
#pragma once

#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include "llmc/model/model.h"  // splitmix64
#include "llmc/parallel/process_grid.h"  // SliceIndexMap: a grid rank's element -> its index in the model
#include "llmc/utils.h"        // bf16_to_float, float_to_bf16_round_nearest

#ifndef LAYER_PROFILE
#define LAYER_PROFILE(...)
#endif

// The random bits of one element's rounding, written once for both trainers: the GPU's kernel
// (llmc/optim/adamw_bf16.cuh) calls these same functions, so the same seed, step and element give
// the same bits on either trainer, and a GPU run's moments can be compared bit for bit with the CPU's.
// A step's key mixes t alone (not --seed): the rounding is a property of the update, as AdamW's
// arithmetic is, and a resumed run only needs t to round as the straight run did.
#ifdef __CUDACC__
__host__ __device__
#endif
inline uint64_t adamw_bf16_step_key(int t) { return splitmix64(0x5eed0000ull + (uint64_t)t); }

// m and v widened to fp32 (mi, vi, already updated), rounded back for storage: 16 random bits for
// m, the next 16 for v, from the element's index in the flat parameter array.
#ifdef __CUDACC__
__host__ __device__
#endif
inline void adamw_bf16_store(uint16_t* m, uint16_t* v, float mi, float vi, uint64_t step_key, size_t index) {
    uint64_t bits = splitmix64(step_key ^ (uint64_t)index);
    *m = bf16_round_stochastic(mi, (uint32_t)bits);
    *v = bf16_round_stochastic(vi, (uint32_t)(bits >> 16));
}

namespace cpu {

// (bf16 is fp32's upper 16 bits: llmc/utils.h widens it, rounds to nearest, and rounds
// stochastically: bf16_round_stochastic, the GPU's rounding too.)

enum class BF16Rounding { Nearest, Stochastic };

// AdamW on n elements whose moments are bf16 (adamw.h's adamw_update, line for line): m and v are
// widened, updated and used in fp32, and rounded back to bf16 for storage. `first_index` is the
// first element's index in the rank's flat parameter array; `keys` maps it to the whole model's
// (null: the slice is the whole model): with t, the random bits' counter.
inline void adamw_update_bf16(float* params, const float* grads, uint16_t* m, uint16_t* v, size_t n, float lr, float beta1,
                              float beta2, float eps, float weight_decay, int t, float grad_scale, size_t first_index,
                              const SliceIndexMap* keys = nullptr, BF16Rounding rounding = BF16Rounding::Stochastic) {
    LAYER_PROFILE("AdamW (bf16 m, v)", 0, 5.0 * n * sizeof(float));  // reads p, g (4 B) and m, v (2 B); writes p, m, v
    float bias_correction1 = 1.0f - powf(beta1, (float)t);
    float bias_correction2_sqrt = sqrtf(1.0f - powf(beta2, (float)t));
    float step_size = lr / bias_correction1;
    float decay = 1.0f - lr * weight_decay;
    uint64_t step_key = adamw_bf16_step_key(t);
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float grad = grads[i] * grad_scale;
        float mi = beta1 * bf16_to_float(m[i]) + (1.0f - beta1) * grad;
        float vi = beta2 * bf16_to_float(v[i]) + (1.0f - beta2) * grad * grad;
        if (rounding == BF16Rounding::Stochastic) {
            size_t index = keys ? slice_global_index(*keys, first_index + i) : first_index + i;
            adamw_bf16_store(&m[i], &v[i], mi, vi, step_key, index);
        } else {
            m[i] = float_to_bf16_round_nearest(mi);
            v[i] = float_to_bf16_round_nearest(vi);
        }
        float denom = sqrtf(vi) / bias_correction2_sqrt + eps;
        params[i] = params[i] * decay - step_size * mi / denom;
    }
}

}  // namespace cpu
