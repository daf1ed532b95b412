// stash_precision.h — the activations saved for the backward pass, stored in bf16 (--stash-precision
// bf16, CPU trainer): Gist's "delayed precision reduction", half the bytes of most of what a layer keeps.
//
// What it teaches. A layer's forward pass uses each activation twice, at two different times: now, to
// compute the next activation, and much later, in the backward pass, to compute gradients. Gist
// (Jain et al. 2018, "Gist: Efficient Data Encoding for Deep Neural Network Training", section 3.3)
// observes that only the first use decides the forward's results: so the forward computes and reads
// every value in full precision (fp32 here), and only the copy STASHED for the backward is rounded to
// a narrower type, once the forward has read the fp32 value for the last time. The forward's logits
// and loss are therefore unchanged bit for bit; only the gradients see the rounding.
//
// The math. bf16 is fp32's upper 16 bits: 8 significant bits, so rounding to nearest (ties to even,
// llmc/utils.h's float_to_bf16_round_nearest) gives x~ = x (1 + d) with |d| <= u = 2^-8. A weight
// gradient is a sum of products with the stashed values, dW = sum_rows dout x~ = dW + sum dout x d:
// each term's error is at most 2^-8 of the term, signs of d independent of each other, so the error of
// dW is at most 2^-8 of sum |dout x| and typically far less (a random walk), and unbiased (round to
// nearest: E[d] = 0; truncation would shrink every stashed value, a bias of about -2^-8 in every
// weight gradient). The errors reach the earlier layers through dresidual, each layer adding its own.
// test/test_stash_precision.py checks both: the gradients' relative error within a few u, their bias
// (the error's projection on the gradient) far below u.
//
// Which tensors (per layer, train_gpt_cpu.cpp's Activations) and why:
//   stashed in bf16     ln1, ln2     LayerNorm outputs, read by the qkv and fc matmuls' weight gradients
//                       qkv          the attention's inputs, read by its backward
//                       att          the softmax probabilities (B, NH, T, T): at T = 1024 the bulk of all
//                                    (values in [0, 1], a relative error of 2^-8 is what bf16 training runs
//                                    with anyway)
//                       atty         the attention output, read by the projection's weight gradient
//                       fch          the GELU input, read by GELU's backward
//                       fch_gelu     the GELU output, read by the fc projection's weight gradient
//   kept in fp32        encoded, residual2, residual3: the residual stream. The forward itself reads it
//                       again (layer l's output is layer l+1's input, and a pipeline sends it), and the
//                       LayerNorm backward computes (x - mean) * rstd from it: the residual stream
//                       carries a large common part that the subtraction cancels, so a 2^-8 error of x
//                       becomes a much larger error of the normalised value.
//                       ln*_mean, ln*_rstd: two values per row, tiny, and what the normalisation's
//                       backward divides by. lnf and the logits (the logits are overwritten by their
//                       gradient in place), losses, logsumexp: one layer's worth, not per layer.
//
// Memory. With Ca = C/tp attention channels, Cf = 4C/tp MLP units, NH heads of the slice, R rows of
// the residual stream (B*T, or B*T/tp with sequence parallelism), the stashed values of one layer are
//     S = 2 R C [ln1, ln2] + B T 3Ca [qkv] + B NH T^2 [att] + B T Ca [atty] + 2 B T Cf [fch, fch_gelu]
// (ln1, ln2 only at --recompute 0 and 1; fch_gelu only at --recompute 0). fp32 keeps 4 L S bytes; the
// bf16 stash keeps 2 L S bytes plus ONE layer of fp32 scratch that the forward computes into and the
// backward widens into, 4 (S - R C) bytes (ln1 and ln2 share theirs: ln1 is dead when ln2 is made,
// as recompute's scratch). So it saves 2 (L - 2) S + 4 R C bytes per micro-batch: at L = 12 about
// 5/12 of those tensors' bytes (the recompute scratch rows it reuses may exist already: then more).
// Measured numbers: docs/memory.md.
//
// The cost: one rounding pass over S values per layer in the forward and one widening pass in the
// backward, both memory-bound and cheap next to the matmuls that read the same values (docs/benchmarks.md).
//
// How it composes.
//   --recompute 1, 2 (llmc/model/recompute.h): what recompute does not keep is not stashed either; it is
//     recomputed, as at fp32, but from what IS stashed: level 1's GELU(fch) from the widened bf16 fch
//     (so it is GELU(fch~), not the forward's GELU(fch): within the same 2^-8), level 2's ln1, ln2
//     exactly, from the fp32 residual stream and statistics.
//   gradient accumulation, data parallelism: each micro-batch's forward stashes, its backward widens;
//     every rank has its own stash, no communication changes.
//   tensor, pipeline parallelism: each rank stashes its own slice, with the sizes above (its heads and MLP
//     units, its R rows with sequence parallelism, its stage's layers, one stash per micro-batch in
//     flight: the stacks live in each activation slot); the one layer of scratch is live only within
//     one layer's pass, so a pipeline's interleaved micro-batches share it. ZB-H1's W widens what it
//     reads again. No communication changes: what crosses ranks (the residual stream, the gathered
//     LayerNorm outputs, gradients) is fp32 as before. test_stash_precision.py: tp2 with sequence
//     parallelism, pp2 with 1F1B and ZB-H1 == one rank.
//   the checkpoint: the stash is not training state (it lives from a forward to its backward, within
//     a step), so checkpoints are unchanged and a run resumes bit for bit (tested).
//   the GPU trainer: its activations are bf16 already; its stash is fp8 e4m3 with each tensor's own
//     scale (--stash-precision fp8, stash_precision.cuh), which refuses bf16.
//
// Hook points (llmc/run/step.h): keep_for_backward, after each half of a layer's forward, calls
// stash_round on the tensors the half will not read again; recall_for_backward, before each half's
// backward, stash_widen on them; layer_rows points what is stashed at one layer of fp32 scratch. The
// size table's rows (llmc/memory/cpu_buffers.h) say which bytes exist.
#pragma once

#include <cstddef>
#include <cstdint>
#include "llmc/utils.h"  // float_to_bf16_round_nearest, bf16_to_float

#ifndef LAYER_PROFILE  // --profile's timer (llmc/probes/cpu_profile.h), when the trainer included it first
#define LAYER_PROFILE(...)
#endif

// The forward's last read of n fp32 values is done: keep them for the backward, rounded to nearest bf16.
inline void stash_round(uint16_t* stash, const float* x, size_t n) {
    LAYER_PROFILE("stash: round to bf16", 0, 6.0 * n);  // reads 4 bytes, writes 2
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) stash[i] = float_to_bf16_round_nearest(x[i]);
}

// The backward is about to read them: widen to fp32 (exact: a bf16 is an fp32 with 16 zero bits).
inline void stash_widen(float* x, const uint16_t* stash, size_t n) {
    LAYER_PROFILE("stash: widen from bf16", 0, 6.0 * n);
#pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) x[i] = bf16_to_float(stash[i]);
}
