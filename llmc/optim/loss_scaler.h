// loss_scaler.h — dynamic loss scaling, the half of fp16 mixed precision that bf16 does without
// (Micikevicius et al. 2018, "Mixed Precision Training", section 3.2). Host logic only: the scale,
// when a step is skipped, when the scale grows. Tested on its own by test/test_loss_scaler.cpp.
//
// Why fp16 needs it and bf16 does not. fp16 has 5 exponent bits and 10 mantissa bits: its normal
// range is 2^-14 (6.1e-5) to 65504, and subnormals reach down to 2^-24 (6.0e-8). bf16 has fp32's
// 8 exponent bits (1.2e-38 to 3.4e38) and 7 mantissa bits. Activation gradients of a language model
// are small (the paper's Figure 3: most of them below 2^-24 for its SSD model, lost to zero in fp16);
// bf16 holds them, fp16 flushes them. Multiplying the loss by S multiplies every gradient of the
// backward pass by S (the chain rule is linear), moving them up into fp16's range; the optimizer
// divides by S again before it uses them.
//
// The math, as PyTorch's torch.cuda.amp.GradScaler does it (its defaults, ours):
//   backward seeds dL/dlogits * S instead of dL/dlogits            S = 2^16 at the start
//   g = (gradients) / S                                            before the norm and the clipping
//   overflow = any gradient of any rank is inf or nan              a flag max-reduced over every
//                                                                  data, tensor and pipeline rank
//   overflow:  skip the step (weights, moments, step count untouched); S *= 0.5; clean = 0
//   else:      the step as usual; clean += 1; clean == 2000: S *= 2, clean = 0
// S stays a power of two, so multiplying and dividing by it only moves the exponent: without
// overflow or underflow, the unscaled gradients are bit for bit those of S = 1, and so are the
// weights (test/test_loss_scaler.cpp checks it). PyTorch has no minimum scale; we stop at S < 1
// (Megatron's min_loss_scale = 1): a model that overflows at S = 1 overflows unscaled, and the
// run stops naming the step rather than skipping forever. No hysteresis (Megatron's and DeepSpeed's
// option to halve only after 2 overflows in a row): one overflow halves, as in PyTorch.
//
// Why unscale before clipping: the clipping threshold (--grad-clip 1.0) is a norm of the true
// gradient. Clipping the scaled gradient would compare S * |g| with 1.0 and clip almost every step.
//
// Why every rank must see the same flag: ranks that disagree take different branches, and the ones
// that step wait for a collective the skipping ones never join. ColossalAI once reduced the flag
// over the data-parallel group only (its PR 80): with tensor parallelism the ranks of a layer
// disagreed and the run hung. Our trainers already all-reduce the squared gradient norm over every
// rank that holds gradients (finish_gradients), and an inf or nan anywhere makes that sum inf or
// nan on every rank: the norm is the flag, and step_is_sound (llmc/run/step.h) reads it.
// test/test_overflow_skip.py shows it: an inf on rank 1 of 2 (data- or tensor-parallel) leaves rank
// 0's weights bit for bit those before the step.
//
// Memory: two numbers. Speed: one multiply per gradient (folded into the norm pass on a GPU).
// Hook points (train_gpt.cu, the fp16 build ./train_gpt_fp16): the loss seed (gpt2_loss_kernels: the
// classifier reads S from device memory and writes dlogits times S / tokens); train_step and its
// graphed twin (the all-reduced norm divided by S, then step_applies: loss_scaler_update instead of
// step_is_sound when the loss is finite); optimizer_step (AdamW's t = step - overflows, its clip
// factor times 1/S, read from device memory as AdamWStep::grad_scale). S lives in device memory
// so that --cuda-graphs can replay the step while S changes (llmc/run/cuda_graphs.cuh). With bf16 and fp32 the scaler is off: S = 1,
// never changes. The CPU trainer computes in fp32 and has none; test/test_loss_scaler.cpp checks
// this file on its own, test/test_fp16.py the fp16 build. See docs/memory.md "fp16 or bf16".
#pragma once

#include <cmath>
#include <cstddef>
#include <string>
#include "llmc/utils.h"

// PyTorch's GradScaler defaults.
constexpr float LOSS_SCALE_INIT = 65536.0f;    // 2^16
constexpr int LOSS_SCALE_WINDOW = 2000;        // clean steps before S doubles
constexpr float LOSS_SCALE_MIN = 1.0f;         // Megatron's minimum; below it the run stops

struct LossScaler {
    float scale = 1.0f;     // S; 1 = off (bf16, fp32)
    int clean_steps = 0;    // steps since the last overflow or growth
    int window = LOSS_SCALE_WINDOW;
    int overflows = 0;      // steps skipped for an overflow: AdamW's t is the step minus these
};

inline bool is_power_of_two(float s) {
    int e;
    return s > 0 && std::isfinite(s) && std::frexp(s, &e) == 0.5f;  // mantissa exactly 1/2: s = 2^(e-1)
}

// "" if the settings are usable, else the one line saying why and what to pass instead.
inline std::string loss_scale_problem(float init, int window) {
    if (!is_power_of_two(init) || init < LOSS_SCALE_MIN)
        return strprintf("the initial loss scale must be a power of two of at least 1 (so that scaling is exact), "
                         "got %g; try 65536", init);
    if (window < 1) return strprintf("the loss-scale window must be at least 1 step, got %d; try 2000", window);
    return "";
}

// Any inf or nan: the flag one rank contributes before the reduction.
inline bool has_overflow(const float* g, size_t n) {
    for (size_t i = 0; i < n; i++)
        if (!std::isfinite(g[i])) return true;
    return false;
}

// g /= S, as a multiply by 1/S: exact for a power of two (the exponent moves, the mantissa stays).
inline void unscale_gradients(float* g, size_t n, float scale) {
    const float inv = 1.0f / scale;
    for (size_t i = 0; i < n; i++) g[i] *= inv;
}

// After the flag is known on every rank: whether to apply the step. An overflow at the minimum
// scale stops the run, naming the step.
inline bool loss_scaler_update(LossScaler* s, bool overflow, int step) {
    if (overflow) {
        if (s->scale <= LOSS_SCALE_MIN)
            fail("step %d: the gradients overflow fp16 even at loss scale %g: the model's gradients do not fit fp16; "
                 "train in bf16 (--precision bf16, ./train_gpt)", step, (double)s->scale);
        s->scale *= 0.5f;  // exact: still a power of two
        s->clean_steps = 0;
        s->overflows++;
        return false;
    }
    if (++s->clean_steps == s->window) {
        s->scale *= 2.0f;
        s->clean_steps = 0;
    }
    return true;
}
