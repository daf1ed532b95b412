// global_norm.cuh — the L2 norm of all gradients, for clipping: sqrt(sum over every gradient of g^2).
//
// A reduction over N elements (124M for d12) in two deterministic passes: a FIXED grid of
// GLOBAL_NORM_BLOCKS blocks strides over the array (so the assignment of elements to threads, and
// therefore the order of the sum, is the same on every GPU and every run), each block writes one
// partial sum; one block then adds the partials in a fixed tree and writes the norm. The norm stays
// on the GPU: the AdamW kernel reads it there to compute the clip factor, so the step never waits
// for the host. Traffic: the gradients read once in 16-byte vectors, 4 KB of partials.
#pragma once

#include "llmc/kernels/cuda_common.cuh"
#include "llmc/kernels/scratch_sizes.h"  // GLOBAL_NORM_BLOCKS (the size table reads it too)

constexpr int GLOBAL_NORM_THREADS = 512;

__global__ void global_norm_partials_kernel(float* partials, const floatX* grads, size_t n) {
    __shared__ float shared[32];
    float sum = 0.0f;
    size_t stride = (size_t)gridDim.x * blockDim.x * x128::size;
    for (size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size; i < n; i += stride) {
        x128 g8 = load128cs(grads + i);
        for (int k = 0; k < x128::size; k++) sum += to_float(g8[k]) * to_float(g8[k]);
    }
    sum = block_sum(sum, shared);
    if (threadIdx.x == 0) partials[blockIdx.x] = sum;
}

// partials[GLOBAL_NORM_BLOCKS] <- sqrt(sum of partials[0 .. GLOBAL_NORM_BLOCKS))
__global__ void global_norm_finish_kernel(float* partials) {
    __shared__ float shared[32];
    float sum = 0.0f;
    for (int i = threadIdx.x; i < GLOBAL_NORM_BLOCKS; i += blockDim.x) sum += partials[i];
    sum = block_sum(sum, shared);
    if (threadIdx.x == 0) partials[GLOBAL_NORM_BLOCKS] = sqrtf(sum);
}

// The first pass alone: partials[0 .. GLOBAL_NORM_BLOCKS) <- each block's sum of squares. With data
// parallelism each rank runs it on its shard of the summed gradient; the host adds the partials in
// order, and the ranks' sums in rank order (train_gpt.cu), so every rank gets the same norm.
// n must be a multiple of 8 (every tensor size is a multiple of C, and C % 8 == 0; shards of 64).
inline void global_norm_partials(float* partials, const floatX* grads, size_t n, cudaStream_t stream) {
    global_norm_partials_kernel<<<GLOBAL_NORM_BLOCKS, GLOBAL_NORM_THREADS, 0, stream>>>(partials, grads, n);
    CUDA_CHECK_LAUNCH();
}

// Writes the norm to partials[GLOBAL_NORM_BLOCKS] (partials holds GLOBAL_NORM_BLOCKS + 1 floats).
inline void global_norm(float* partials, const floatX* grads, size_t n, cudaStream_t stream) {
    global_norm_partials(partials, grads, n, stream);
    global_norm_finish_kernel<<<1, GLOBAL_NORM_THREADS, 0, stream>>>(partials);
    CUDA_CHECK_LAUNCH();
}
