// zero_bubble_backward.cuh — ZB-H1's split backward on the GPU: B, the input gradients, now; W, the
// four block matmuls' weight gradients, when the schedule's Weight action comes.
//
// Read llmc/model/zero_bubble_backward.h first: why B and W (Qi et al., 2024, "Zero Bubble Pipeline
// Parallelism", section 2: dx = dy W is what the previous stage waits for, dW += dy^T x is not), what
// W needs (each matmul's input x and output gradient dy), and why W in micro-batch order gives 1F1B's
// bits. This file adds what the GPU does differently:
//
//   - B writes dy straight into the stash. The backward (train_gpt.cu's gpt2_backward) computes the
//     fc's and the qkv's output gradients into one layer of scratch, reused by every layer; under
//     ZB-H1 it points those two scratches at the layer's stash rows instead (no copy), and copies the
//     two projections' dy, which is the residual gradient that the LayerNorm backward then adds into
//     (so it must be kept before that). dx, the attention, GELU and LayerNorm backwards, and every
//     bias gradient stay in B: the biases are a column sum over dy, a dx's cost and fused into some
//     of its kernels (the GELU epilogue writes fc's), nothing to fill a bubble with.
//   - The inputs x stay in the micro-batch's whole activation slot until W(k): no parking. So a
//     stage holds p slots (F(k) to W(k) spans p micro-batches on every stage, the .h derives it)
//     where 1F1B holds p - s, and slot k mod p is free again at F(k + p). --recompute's rebuilt
//     rows (GELU(fch), ln1, ln2) are rebuilt again in W from the slot, with the forward's kernels, so
//     bit for bit what B used. Memory: s more slots on stage s than 1F1B, plus the stashes below;
//     the CPU's parking keeps only 7C of those (--estimate prints both tables).
//   - Stashes: s + 1 on stage s (B(k) to W(k) spans B(k) ... B(k + s)), micro-batch k in stash
//     k mod (s + 1); none on the first stage, whose W(k) follows B(k) with no send between: its B
//     runs the whole backward, and its W does nothing.
//   - ZeRO-0/1's data-parallel sum of a layer's gradients starts when they are final: at the step's
//     last W, not its last B.
//
// Bit for bit with 1F1B: each weight gradient gets the same cuBLASLt accumulations (same inputs, same
// kernel, same order: W runs in micro-batch order), each bias gradient the same additions in B. The
// test (test/test_gpu_parallelism.py, 2 and 4 stages) demands equal bits: losses, gradients, weights.
//
// Hook points: forward_backward sets GPT2::stash before B (the micro-batch's stash, or -1 for the whole
// backward) and calls gpt2_backward_weights at PipeOp::Weight; in B, train_gpt.cu's linear_backward
// hook leaves each block matmul's weight gradient to W (zb_keep_output_grad below) and its
// linear_output_grad hook points fc's and qkv's dy straight into the stash.
#pragma once

#include "llmc/kernels/cuda_common.cuh"
#include "llmc/model/model.h"  // QKVW, ATTPROJW, FCW, FCPROJW
#include "llmc/model/zero_bubble_backward.h"

// Layer l's rows of stash `stash` in the stage's GB_WEIGHT_STASH (stashes x L layers x N rows).
inline WeightStashOf<floatX> weight_stash_gpu(floatX* base, int stash, int L, int l, size_t N, size_t C, size_t Ca, size_t Cf) {
    return layer_weight_stash(base + (size_t)stash * weight_stash_floats((size_t)L, N, C, Ca, Cf), l, N, C, Ca, Cf);
}

// Linear layer `tensor` (QKVW, ATTPROJW, FCW or FCPROJW) of layer l's rows in that stash: where W reads its dy.
inline floatX* zb_output_grad_slot(floatX* base, int stash, int L, int l, size_t N, size_t C, size_t Ca, size_t Cf, int tensor) {
    WeightStashOf<floatX> k = weight_stash_gpu(base, stash, L, l, N, C, Ca, Cf);
    return tensor == QKVW ? k.qkv : tensor == ATTPROJW ? k.attproj : tensor == FCW ? k.fc : k.fcproj;
}
// B's half of a linear layer's weight gradient: its dy kept for W, copied into the stash unless B
// computed it there (fc's and qkv's: the GELU and attention backwards write into the slot).
inline void zb_keep_output_grad(floatX* slot, const floatX* dout, size_t n, cudaStream_t s) {
    if (slot != dout) CUDA_CHECK(cudaMemcpyAsync(slot, dout, n * sizeof(floatX), cudaMemcpyDeviceToDevice, s));
}
