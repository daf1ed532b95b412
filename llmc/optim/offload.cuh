// offload.cuh — ZeRO-Offload's optimizer offload (--offload optimizer): the fp32 master weights and
// AdamW's m and v live in pinned host memory, and the optimizer step runs on the CPU.
//
// What it teaches (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", 2021):
// mixed-precision AdamW keeps 16 bytes per parameter, but only 4 of them (bf16 weights and
// gradients) are needed by the forward and backward. The other 12 (fp32 master, m, v) are touched
// once per step, by an update that is memory-bound and element-wise: the CPU can do it. So they move
// to host memory, and each step pays PCIe traffic instead of GPU memory:
//   GPU -> host   2 bytes/param   the bf16 gradient, once the step's gradient is complete
//   CPU           AdamW in fp32 on the master weights (llmc/optim/adamw.h, the CPU trainer's own code)
//   host -> GPU   2 bytes/param   the updated weights, rounded to bf16
// GPU memory per parameter drops from 16 to 4 bytes (plus activations); host memory gains 18:
// master, m, v (12), the gradient widened to fp32 for adamw.h (4), one bf16 staging array (2) that
// carries the gradient down and the weights back up.
//
// Same arithmetic as on the GPU: adamw_update (adamw.h) writes the formulas of adamw.cuh's kernel in
// the same order, per tensor with the same decay, and the new master weights are rounded to bf16
// with the same stochastic rounding, seeded by (seed, step, element index). Under the CUDA emulation
// (both compiled by the same host compiler) offloaded and on-device runs are bit-identical
// (test/test_offload.py); on a real GPU nvcc's fused multiply-adds may round the last bit differently.
//
// Accumulation: the micro-batches' gradients are summed on the GPU (the backward accumulates into
// the gradient buffer), and the copy happens once, after finish_gradients: every micro-batch is in
// what reaches the host (DeepSpeed PR 7967 lost the micro-batches after the first by copying per
// micro-batch into a buffer it then overwrote). The copy is one synchronous copy on the compute
// stream, not per-bucket on a side stream overlapped with the backward: simpler, and slower.
//
// ZeRO-0/1: each rank offloads what its AdamW updates (plan.updated: everything, or its shard); the
// updated bf16 shard is copied back into the flat parameter array and ZeRO-1's all-gather shares it
// as usual. Hook point: optimizer_step (llmc/run/step.h), in place of zero_adamw.
#pragma once

#include <cstdint>
#include <cstring>
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/memory/gpu_buffers.h"  // OFFLOAD_HOST_BYTES_PER_PARAM: what offload_allocate allocates
#include "llmc/model/model.h"
#include "llmc/optim/adamw.cuh"
#include "llmc/optim/adamw.h"

struct OptimizerOffload {
    size_t begin = 0, n = 0;           // the range of the flat parameter array this rank updates
    float* master = nullptr;           // pinned host memory, n each
    float* m = nullptr;
    float* v = nullptr;
    float* grads = nullptr;            // the bf16 gradient widened (exact), for adamw.h
    uint16_t* staging = nullptr;       // bf16: the gradient on its way down, the weights on their way up
};

inline void offload_allocate(OptimizerOffload* o, size_t begin, size_t n) {
    o->begin = begin;
    o->n = n;
    float** arrays[] = {&o->master, &o->m, &o->v, &o->grads};
    for (float** a : arrays) {
        CUDA_CHECK(cudaMallocHost((void**)a, n * sizeof(float)));
        memset(*a, 0, n * sizeof(float));
    }
    CUDA_CHECK(cudaMallocHost((void**)&o->staging, n * sizeof(uint16_t)));
}

inline void offload_free(OptimizerOffload* o) {
    void* arrays[] = {o->master, o->m, o->v, o->grads, o->staging};
    for (void* a : arrays)
        if (a) CUDA_CHECK(cudaFreeHost(a));
    *o = OptimizerOffload{};
}

// One AdamW step on the host: gradient down, AdamW on the CPU tensor by tensor, weights up.
// `params` and `grads` are the GPU's flat arrays; `layout` gives each tensor's offset (its decay).
inline void offload_adamw(OptimizerOffload* o, floatX* params, const floatX* grads, const ParamLayout& layout,
                          const AdamWStep& now, const AdamWParams& a, cudaStream_t stream) {
    // The fp32 and fp16 builds compile this too, but refuse --offload at start-up (check_offload_options).
    if (!std::is_same<floatX, __nv_bfloat16>::value) fail("internal: --offload optimizer needs the bf16 build");
    size_t n = o->n, begin = o->begin;
    if (n == 0) return;
    CUDA_CHECK(cudaMemcpyAsync(o->staging, grads + begin, n * sizeof(uint16_t), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));  // the gradient must be on the host before the CPU reads it
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        uint32_t bits = (uint32_t)o->staging[i] << 16;  // bf16 -> fp32 is exact
        memcpy(&o->grads[i], &bits, sizeof(float));
    }
    float clip = cpu::clip_coefficient(now.grad_norm, a.max_norm);
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        // Tensor t's part of [begin, begin + n). The last tensor runs to the end: ZeRO's padding past
        // the model is updated as the GPU kernel updates it (as the last tensor; its gradient is zero).
        size_t lo = std::max(begin, layout.offset[t]);
        size_t hi = t + 1 < NUM_PARAM_TENSORS ? std::min(begin + n, layout.offset[t + 1]) : begin + n;
        if (lo >= hi) continue;
        size_t k = lo - begin;
        float wd = param_tensor_decays(t) ? a.weight_decay : 0.0f;  // 1 - lr * 0 = 1: the kernel's "no decay"
        cpu::adamw_update(o->master + k, o->grads + k, o->m + k, o->v + k, hi - lo, now.lr, a.beta1, a.beta2, a.eps, wd,
                          now.step, clip);
    }
    uint64_t seed_stream = (uint64_t)a.seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)now.step << 40);  // as adamw_update8
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) o->staging[i] = bf16_round_stochastic(o->master[i],  // as adamw_update8 rounds: the same bits
                                                                  hash_u32(seed_stream ^ (uint64_t)(begin + i)));
    CUDA_CHECK(cudaMemcpyAsync(params + begin, o->staging, n * sizeof(uint16_t), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));  // the staging array is reused by the next step's gradient
}
