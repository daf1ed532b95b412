// adamw.cuh — gradient clipping and the AdamW update of every parameter, in ONE launch.
//
// For each parameter p with gradient g (scaled by the clip factor min(1, max_norm / (norm + 1e-6)),
// computed here from the step's norm, which the kernel reads from device memory with the learning
// rate and the bias corrections: AdamWStep below):
//   m <- b1 m + (1 - b1) g;   v <- b2 v + (1 - b2) g^2                       (fp32 state)
//   p <- p (1 - lr wd) - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
// in PyTorch's order of operations, as the CPU reference writes it. Weight decay is per tensor
// (matrices decay, biases and LayerNorm gains do not): a thread finds its tensor from the layout's
// offsets, passed by value, instead of one launch per tensor (16 tensors, 16 launches, 16 tails).
//
// Mixed precision: with master weights, p is the fp32 master copy and the bf16 parameter is written
// from it with stochastic rounding (see cuda_common.cuh); without, p is the bf16 parameter itself,
// widened, updated, and stochastically rounded back. Either way the bf16 parameters the forward
// uses are exactly what is saved in model.bin, and the random bits depend only on (seed, step,
// index), so resumed runs round exactly as uninterrupted ones.
//
// The kernel updates the range [begin, begin + count) of the flat arrays: with ZeRO-1, each rank
// passes its own shard. ZeRO-2/3 keep gradients, state (and at stage 3 weights) in shards of units,
// piece by piece: adamw_update_piece runs the same per-element update on one such piece. Traffic per
// parameter: bf16 p and g read, p written; fp32 m, v (and master) read and written: 12 bytes (16 with
// master) read, 10 (14) written. A thread takes 4 parameters: 16-byte vectors of fp32 state, 8-byte
// ones of bf16 (adamw_update4 says why not 8).
#pragma once

#include "llmc/kernels/cuda_common.cuh"
#include "llmc/model/model.h"

// The settings of the run, the same at every step: passed to the kernels by value.
struct AdamWParams {
    float beta1, beta2, eps, weight_decay;
    float max_norm;       // clip to this global norm (0 = no clipping)
    uint64_t seed;        // stochastic-rounding seed; mixed with the step
    size_t tensor_offset[NUM_PARAM_TENSORS];
    unsigned decay_mask;  // bit t set: tensor t decays
};

// What changes from step to step. The kernels read it from device memory, which the host fills
// with one cudaMemcpyAsync before the update: a CUDA graph that captured the update once
// (--cuda-graphs, llmc/run/cuda_graphs.cuh) then applies each step's values. Passed by value, they
// would be baked into the graph: every replay would use the learning rate of the captured step.
struct AdamWStep {
    float grad_norm;      // the global norm of the gradient, before clipping
    float lr;
    float bias_correction1, bias_correction2_sqrt;  // 1 - beta1^t, sqrt(1 - beta2^t)
    int step;             // t, from 1
    float grad_scale;     // 1/S: fp16's loss scale divided out (llmc/optim/loss_scaler.h), which changes when
                          // a step overflows; 1 otherwise
};

inline AdamWStep adamw_step_values(const AdamWParams& a, int step, float lr, float norm, float grad_scale = 1.0f) {
    return AdamWStep{norm, lr, 1.0f - powf(a.beta1, (float)step), sqrtf(1.0f - powf(a.beta2, (float)step)), step, grad_scale};
}

// The step's factor on every gradient: the clip coefficient (torch's clip_grad_norm_) times 1/S.
__device__ __forceinline__ float adamw_clip(const AdamWStep& now, const AdamWParams& a) {
    float clip = 1.0f;
    if (a.max_norm > 0.0f) clip = fminf(1.0f, a.max_norm / (now.grad_norm + 1e-6f));
    return clip * now.grad_scale;  // (now.grad_norm is already the unscaled norm; times 1/S is exact, a power of two)
}

// The weights' decay factor of element i of the flat array: its tensor's, from the layout's offsets.
__device__ __forceinline__ float adamw_decay(size_t i, const AdamWStep& now, const AdamWParams& a) {
    int tensor = NUM_PARAM_TENSORS - 1;
    while (i < a.tensor_offset[tensor]) tensor--;
    return (a.decay_mask >> tensor) & 1u ? 1.0f - now.lr * a.weight_decay : 1.0f;
}

// The random stream of the weights' stochastic rounding at this step (hash_u32(stream ^ index)).
// (__host__ too: the factored optimizers' kernels take it by value, adafactor.cuh)
__host__ __device__ __forceinline__ uint64_t adamw_weight_stream(const AdamWStep& now, const AdamWParams& a) {
    return (uint64_t)a.seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)now.step << 40);
}

// One element's AdamW in fp32, its gradient already clipped: m, v and the weight w updated in place.
// (adamw_bf16.cuh calls it too: the bf16 moments change where m and v rest, not this arithmetic.)
__device__ __forceinline__ void adamw_element(float g, float* m, float* v, float* w, float decay, float step_size,
                                              const AdamWStep& now, const AdamWParams& a) {
    *m = a.beta1 * *m + (1.0f - a.beta1) * g;
    *v = a.beta2 * *v + (1.0f - a.beta2) * g * g;
    float denom = sqrtf(*v) / now.bias_correction2_sqrt + a.eps;
    *w = *w * decay - step_size * *m / denom;
}

// Four consecutive parameters of the floatX arrays, in one load or store (8 bytes in bf16).
struct alignas(4 * sizeof(floatX)) FloatX4 {
    floatX v[4];
};

// AdamW on 4 consecutive parameters: params[at..at+4) with gradients grads[at..], their fp32 state
// at master[local..], m[local..], v[local..]; `index` is the first one's index in the model, which
// seeds its stochastic rounding.
// Why 4 and this order (the kernel lab, dev/cuda/adamw.cu, measured the old shape at 76% of the copy
// rate on an H200, against 96% for one launch per tensor and one thread per element):
//   - a thread's fp32 state is ONE 16-byte vector per array, so a warp's load of m (or v, master)
//     covers 512 contiguous bytes: every 32-byte sector whole in one instruction. The old 8 per
//     thread took two 16-byte halves 32 bytes apart per thread: each instruction used half of every
//     sector it touched, the other half came with the next one.
//   - every load is issued before any store. The compiler cannot prove that m, v and master do not
//     overlap, so a load written after a store waits for it: the old loop stored the first half's
//     state before loading the second's, which halved the bytes each thread had in flight.
// The arithmetic per element is the same expression in the same order as before: the same bits.
__device__ __forceinline__ void adamw_update4(floatX* params, float* master, const floatX* grads, float* m, float* v,
                                              size_t local, size_t at, size_t index, float decay, const AdamWStep& now,
                                              const AdamWParams& a) {
    FloatX4 p4 = *reinterpret_cast<const FloatX4*>(params + at);
    FloatX4 g4 = *reinterpret_cast<const FloatX4*>(grads + at);
    f128 m4 = load128(m + local), v4 = load128(v + local), w4;
    if (master != nullptr) w4 = load128(master + local);
    else
        for (int k = 0; k < 4; k++) w4[k] = to_float(p4.v[k]);

    float clip = adamw_clip(now, a);
    float step_size = now.lr / now.bias_correction1;
    uint64_t stream = adamw_weight_stream(now, a);
    for (int k = 0; k < 4; k++) {
        adamw_element(to_float(g4.v[k]) * clip, &m4[k], &v4[k], &w4[k], decay, step_size, now, a);
        stochastic_round(&p4.v[k], w4[k], hash_u32(stream ^ (uint64_t)(index + k)));
    }
    store128(m + local, m4);
    store128(v + local, v4);
    if (master != nullptr) store128(master + local, w4);
    *reinterpret_cast<FloatX4*>(params + at) = p4;
}

__global__ void adamw_kernel(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t begin,
                             size_t count, const AdamWStep* step_values, AdamWParams a) {
    size_t local = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (local >= count) return;
    AdamWStep now = *step_values;
    size_t i = begin + local;  // index into the whole model's flat arrays
    adamw_update4(params, master, grads, m, v, local, i, i, adamw_decay(i, now, a), now, a);
}

// params/grads are the whole model's arrays; master/m/v hold only the slice [begin, begin + count).
// step_values: device memory holding this step's AdamWStep.
inline void adamw_update(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t begin,
                         size_t count, const AdamWStep* step_values, const AdamWParams& a, cudaStream_t stream) {
    adamw_kernel<<<ceil_div(count / 4, 256), 256, 0, stream>>>(params, master, grads, m, v, begin, count,
                                                                       step_values, a);
    CUDA_CHECK_LAUNCH();
}

// ZeRO-2/3 (llmc/parallel/zero.cuh): one PIECE of one tensor, whose parameters, gradients and state each lie
// contiguously somewhere else (the flat array or the weight shard; the gradient shard; the state
// arrays). `index` is the piece's first element in the rank's flat array, the same index the flat
// kernel above would use for it, so both give an element the same stochastic rounding.
__global__ void adamw_piece_kernel(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t count,
                                   size_t index, bool decays, const AdamWStep* step_values, AdamWParams a) {
    size_t k = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (k >= count) return;
    AdamWStep now = *step_values;
    float decay = decays ? 1.0f - now.lr * a.weight_decay : 1.0f;
    adamw_update4(params, master, grads, m, v, k, k, index + k, decay, now, a);
}

// count must be a multiple of 8 (every tensor's per-layer size is, and so are the shard boundaries).
inline void adamw_update_piece(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t count,
                               size_t index, bool decays, const AdamWStep* step_values, const AdamWParams& a,
                               cudaStream_t stream) {
    adamw_piece_kernel<<<ceil_div(count / 4, 256), 256, 0, stream>>>(params, master, grads, m, v, count, index,
                                                                             decays, step_values, a);
    CUDA_CHECK_LAUNCH();
}
