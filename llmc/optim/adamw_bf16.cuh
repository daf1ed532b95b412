// adamw_bf16.cuh — AdamW with its moments m and v stored in bf16 on the GPU (--optimizer-state bf16).
// Read llmc/optim/adamw_bf16.h first (why a bf16 moving average needs stochastic rounding: with
// beta2 = 0.999 a round-to-nearest v never decays), then llmc/optim/adamw.cuh (the fp32 kernel):
// this file adds only the kernel whose m and v rest in 2 bytes each.
//
// Per element, as adamw_bf16.h's loop: m and v widened to fp32 (exact), updated and used in fp32 by
// adamw.cuh's adamw_element (the same arithmetic as the fp32-state kernel), then rounded back to bf16
// stochastically with adamw_bf16_store, the CPU trainer's function: the random bits are the CPU's
// exact stream, keyed by (t, the element's index in the whole model's flat parameter array: on a
// tensor- or pipeline-parallel rank the kernel maps its local index there with slice_global_index,
// llmc/parallel/process_grid.h, a map passed by value). So the same run gives
// the same moments on either trainer and on any grid wherever the fp32 values before rounding agree, a resumed run
// rounds as the straight one did (bit-exact resume), and the checkpoint is the CPU's: m and v widened
// to fp32 in state.bin (a bf16 value widens without rounding), which either trainer resumes.
// The weights keep their own rounding stream (adamw.cuh's adamw_weight_stream), as with fp32 moments.
//
// Memory: m and v 2 + 2 bytes per parameter instead of 4 + 4 (GB_ADAM_M, GB_ADAM_V in
// llmc/memory/gpu_buffers.h): 16 -> 12 bytes per parameter of model state with fp32 master weights.
// Speed: the update is memory-bound, and its traffic per parameter falls from 12 (16 with master)
// bytes read and 10 (14) written to 8 (12) read and 6 (10) written, plus a splitmix64 per element.
// Hook point: optimizer_step in train_gpt.cu, through zero_adamw (llmc/parallel/zero.cuh), over what
// this rank updates: all of the flat arrays, or with ZeRO-1 its shard, in one launch; with ZeRO-2 its
// pieces of the units' shards, one launch each. Every element's moments round with its index in the
// whole model (slice_global_index), so ZeRO-1 and ZeRO-2 give ZeRO-0's bits, and a tensor- or
// pipeline-parallel rank's elements the one-rank run's. With --cuda-graphs the kernel is captured
// once: t (its rounding key's step) and the learning rate are read from device memory at each replay
// (AdamWStep), the slice's map is the run's constant. With --offload optimizer the host runs
// adamw_bf16.h's loop instead, with the same key (llmc/optim/offload.cuh). (rows of
// llmc/run/compatibility.h refuse what is not proven yet.)
#pragma once

#include "llmc/optim/adamw.cuh"
#include "llmc/optim/adamw_bf16.h"  // adamw_bf16_step_key, adamw_bf16_store: the CPU's rounding

// Four consecutive bf16 moments, one 8-byte load or store.
struct alignas(8) BF16x4 {
    uint16_t v[4];
};

// AdamW on 4 consecutive parameters (adamw.cuh's adamw_update4 with bf16 moments): params[at..at+4)
// with gradients grads[at..], their state at master[local..], m[local..], v[local..]; `index` is the
// first one's index in this rank's flat array, the key of the weights' rounding; the moments' key is
// its index in the whole model (keys: the rank's slice's map, slice_index_map).
__device__ __forceinline__ void adamw_bf16_update4(floatX* params, float* master, const floatX* grads, uint16_t* m,
                                                   uint16_t* v, size_t local, size_t at, size_t index, float decay,
                                                   const AdamWStep& now, const AdamWParams& a, const SliceIndexMap& keys) {
    FloatX4 p4 = *reinterpret_cast<const FloatX4*>(params + at);
    FloatX4 g4 = *reinterpret_cast<const FloatX4*>(grads + at);
    BF16x4 m4 = *reinterpret_cast<const BF16x4*>(m + local), v4 = *reinterpret_cast<const BF16x4*>(v + local);
    f128 w4;
    if (master != nullptr) w4 = load128(master + local);
    else
        for (int k = 0; k < 4; k++) w4[k] = to_float(p4.v[k]);

    float clip = adamw_clip(now, a), step_size = now.lr / now.bias_correction1;
    uint64_t step_key = adamw_bf16_step_key(now.step), stream = adamw_weight_stream(now, a);
    for (int k = 0; k < 4; k++) {
        float mk = bf16_to_float(m4.v[k]), vk = bf16_to_float(v4.v[k]);
        adamw_element(to_float(g4.v[k]) * clip, &mk, &vk, &w4[k], decay, step_size, now, a);
        adamw_bf16_store(&m4.v[k], &v4.v[k], mk, vk, step_key, slice_global_index(keys, index + k));  // (used unrounded)
        stochastic_round(&p4.v[k], w4[k], hash_u32(stream ^ (uint64_t)(index + k)));
    }
    *reinterpret_cast<BF16x4*>(m + local) = m4;
    *reinterpret_cast<BF16x4*>(v + local) = v4;
    if (master != nullptr) store128(master + local, w4);
    *reinterpret_cast<FloatX4*>(params + at) = p4;
}

// AdamW on params[begin + local .. + 4) for one thread; master, m and v hold the range from `begin`.
__global__ void adamw_bf16_kernel(floatX* params, float* master, const floatX* grads, uint16_t* m, uint16_t* v,
                                  size_t begin, size_t count, const AdamWStep* step_values, AdamWParams a,
                                  SliceIndexMap keys) {
    size_t local = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (local >= count) return;
    AdamWStep now = *step_values;  // (from device memory: a captured graph would replay this step's values)
    size_t i = begin + local;      // the element's index in this rank's flat arrays
    adamw_bf16_update4(params, master, grads, m, v, local, i, i, adamw_decay(i, now, a), now, a, keys);
}

// One piece of ZeRO-2's shards (adamw.cuh's adamw_piece_kernel with bf16 moments): params, master,
// grads, m, v all start at the piece; `index` is its first element's index in the flat array.
__global__ void adamw_bf16_piece_kernel(floatX* params, float* master, const floatX* grads, uint16_t* m, uint16_t* v,
                                        size_t count, size_t index, bool decays, const AdamWStep* step_values, AdamWParams a,
                                        SliceIndexMap keys) {
    size_t k = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 4;
    if (k >= count) return;
    AdamWStep now = *step_values;
    float decay = decays ? 1.0f - now.lr * a.weight_decay : 1.0f;
    adamw_bf16_update4(params, master, grads, m, v, k, k, index + k, decay, now, a, keys);
}

// adamw.cuh's adamw_update with bf16 m and v: params/grads the whole flat arrays, master/m/v the
// range [begin, begin + count) only; count a multiple of 4 (the flat array's padding makes it one);
// keys: the rank's slice's map to the whole model's indexes (slice_index_map).
inline void adamw_bf16_update(floatX* params, float* master, const floatX* grads, uint16_t* m, uint16_t* v, size_t begin,
                              size_t count, const AdamWStep* step_values, const AdamWParams& a, const SliceIndexMap& keys,
                              cudaStream_t stream) {
    adamw_bf16_kernel<<<ceil_div(count / 4, 256), 256, 0, stream>>>(params, master, grads, m, v, begin, count,
                                                                     step_values, a, keys);
    CUDA_CHECK_LAUNCH();
}

// adamw.cuh's adamw_update_piece with bf16 m and v (count a multiple of 8, as there).
inline void adamw_bf16_update_piece(floatX* params, float* master, const floatX* grads, uint16_t* m, uint16_t* v, size_t count,
                                    size_t index, bool decays, const AdamWStep* step_values, const AdamWParams& a,
                                    const SliceIndexMap& keys, cudaStream_t stream) {
    adamw_bf16_piece_kernel<<<ceil_div(count / 4, 256), 256, 0, stream>>>(params, master, grads, m, v, count, index, decays,
                                                                           step_values, a, keys);
    CUDA_CHECK_LAUNCH();
}
