// zero_bubble_backward.h — the backward pass cut in two for ZB-H1: B, the input gradients, now; W,
// the block matmuls' weight gradients, later. W reads the matmul's input where the forward left it,
// in the micro-batch's activation slot, and the output gradient B kept for it in a "weight stash".
//
// What it teaches. The schedule (llmc/parallel/pipeline_schedule.h, Qi et al., 2024, "Zero Bubble
// Pipeline Parallelism", ICLR, section 2) runs B on the critical path and W in the holes. For one
// linear layer y = x W^T + b with output gradient dy (cpu_layers.h's matmul_backward, split there):
//     B:  dx  = dy W                 the previous layer (and stage) waits for this
//     W:  dW += dy^T x,  db += sum over rows of dy            only the optimizer waits for these
// W needs dy, which B computes and then overwrites at the next layer down (the whole backward keeps
// no gradient), and x, which the forward kept in the micro-batch's slot. So B copies dy into the
// stash, and x stays where it is. The LM head's weight gradient stays in B (its dy, dlogits, is
// B x T x Vp floats: more than the rest of the slot), and so do the LayerNorms' (dgamma += sum dy
// xhat, dbeta += sum dy: C values from a pass over N x C, a dx's cost, nothing to fill a bubble with,
// while their dy, x and statistics would cost 2C + 2 floats a token to keep) and the embedding's.
// Per micro-batch and token, per layer (Cf = 4C, Ca = C on one tensor rank):
//     the stash (dy)    MLP projection C, fc Cf, attention projection C, qkv 3Ca        = 9C
//     the slot (x)      ln1 C, atty C, ln2 C, fch_gelu Cf                                = 7C
//     at --recompute 1  fch instead of fch_gelu (W rebuilds GELU(fch), as B does)        = 7C
//     at --recompute 2  atty, fch, and ln1's and ln2's inputs (the residual stream) and
//                       statistics, from which W rebuilds them as B does                  = 7C + 4
//                       (+ the stage's input, C, once)
// (llmc/memory/cpu_buffers.h's cpu_buffer_read_by_weight_pass names the slot's rows.)
//
// The slot's lifetime. Stage s of p runs F(k) ... B(k) ... W(k), W(k) right after B(k + s). 1F1B
// frees micro-batch k's slot at B(k): p - s slots, the forward's, reused as k mod (p - s). Here the
// rows W reads live until W(k): from F(k) to W(k) there are p micro-batches on every stage (at
// F(j) the stage has run W up to j - p: the steady state is F(j) B(j - p + s + 1) W(j - p + 1)), so
// the stage holds p copies of those rows: its p - s forward slots, and s "parked" ones. When a
// forward (or the receive of its input) takes slot j mod (p - s) while micro-batch j - (p - s) still
// waits for its W, the trainer swaps that slot's W rows with a free parked set (vector swaps: no
// copy; park_weight_inputs in train_gpt_cpu.cpp), and W(k) finds its rows by the micro-batch they
// belong to. Output gradients: B(k) to W(k) spans B(k) ... B(k + s), s + 1 stashes, micro-batch k
// in stash k mod (s + 1). The first stage runs W(k) right after B(k) with no send in between: there
// it runs the whole backward at B (the same additions in the same order), and needs no stash.
// test_pipeline_schedule walks the lists and checks all three counts.
//
// The memory per stage (activations, per token and layer, S = a whole slot: 16C + NH T + 4 floats
// at --recompute 0, 12C + NH T + 4 at 1, 10C + NH T + 4 at 2, NH T the attention probabilities):
//     1F1B    stage s:  (p - s) S                        the first stage's p S is the peak
//     ZB-H1   stage 0:  p S                              the same as 1F1B's
//             stage s:  (p - s) S + s W + (s + 1) D      W = 7C (7C + 4), D = 9C
// So ZB-H1's peak is 1F1B's when s W + (s + 1) D <= s S on every stage s >= 1, worst at s = 1:
// W + 2 D <= S, that is NH T >= 9C - 4 at --recompute 0, 13C - 4 at 1, 15C at 2 (plus what the stages
// hold besides their layers: the last its logits, B T Vp, in its one slot; the first its inputs).
// The paper's claim, that ZB-H1 keeps 1F1B's peak, counts every micro-batch between F and W as one
// micro-batch of activations, at most p on every stage as on 1F1B's first stage, and dy inside
// them; here the parked part is smaller than a slot (W reads 7C of it), and that saving pays for the
// output gradients, which the unsplit backward never keeps, when the attention's probabilities are
// large (long sequences). At d12 (NH T = 16C at T = 1024), B = 4, 4 stages, m = 8, --estimate:
// ZB-H1's largest stage holds exactly 1F1B's 4.88 GB at --recompute 0 (the other stages 4.61, 3.99,
// 4.21 GB) and 4.28 GB at 1; at --recompute 2 the last stage, with the logits, holds 4.02 GB against
// 1F1B's 3.98 GB peak (+1.1%). For short sequences (the tests' T = 32: NH T = 2C) it is more than
// 1F1B's, and the tests check the composition above instead. (This file's first version kept
// whole slots until W, 9.94 GB on the last stage; its second copied dy and x into the stash,
// (20C + 4) a token and layer, 5.64 GB on the first stage; docs/parallelism.md has the table.)
//
// Bit for bit with 1F1B. Each weight gradient collects one addition per micro-batch (matmul's
// accumulate), and each addition depends only on the gradient's value before it and that
// micro-batch's dy and x. W runs in micro-batch order on every stage (W0 W1 ... as B0 B1 ...), so
// every gradient sees the same additions in the same order as with the whole backward: the same
// bits (test_pipeline_zb_h1.py checks losses and weights against 1F1B's). (The zero-bubble authors'
// deferral can reorder the accumulation, sail-sg/zero-bubble issue 17; here it cannot.)
//
// Hook points: none new. gpt2_backward takes the micro-batch's stash (null: the whole backward, as
// before) and B's matmuls call cpu_layers.h's matmul_backward_or_defer; the trainer's
// schedule passes (llmc/run/schedule_run.h's take_slot) park a slot's W rows before a new micro-batch takes it and runs
// gpt2_backward_weights at PipeOp::Weight. This file is arithmetic only (the sizes, the layout), so
// the size table (llmc/memory/cpu_buffers.h), which the GPU trainer's --estimate compiles too, can
// use it.
#pragma once

#include <algorithm>
#include <cstddef>

// A stash holds, per layer of the stage, the output gradient dy of each matmul, in the order the
// backward computes them (Ca, Cf: the local widths of the attention and the MLP): the MLP's
// projection N x C, its fc N x Cf, the attention's projection N x C, its qkv N x 3Ca. B fills it
// (matmul_backward_or_defer in llmc/model/cpu_layers.h); W reads it (gpt2_backward_weights in
// train_gpt_cpu.cpp), with the matmuls' inputs from the micro-batch's slot.
// (float on the CPU; the GPU trainer's stash holds floatX, llmc/model/zero_bubble_backward.cuh.)
template <class T> struct WeightStashOf {
    T *fcproj, *fc, *attproj, *qkv;
};
using LayerWeightStash = WeightStashOf<float>;
inline size_t weight_stash_layer_floats(size_t N, size_t C, size_t Ca, size_t Cf) { return N * (C + Cf + C + 3 * Ca); }
inline size_t weight_stash_floats(size_t L, size_t N, size_t C, size_t Ca, size_t Cf) {
    return L * weight_stash_layer_floats(N, C, Ca, Cf);
}
template <class T> inline WeightStashOf<T> layer_weight_stash(T* stash, int l, size_t N, size_t C, size_t Ca, size_t Cf) {
    T* p = stash + (size_t)l * weight_stash_layer_floats(N, C, Ca, Cf);
    WeightStashOf<T> s;
    s.fcproj = p, p += N * C;
    s.fc = p, p += N * Cf;
    s.attproj = p, p += N * C;
    s.qkv = p;
    return s;
}

// Stage s of p under ZB-H1, m >= p micro-batches (grid_problem's rule for the pipelines):
// how many micro-batches' slots hold the rows W reads at once: F(k) to W(k), p on every stage
// (the lesson above), or m if fewer;
inline int zero_bubble_weight_input_slots(int stages, int m) { return std::min(m, stages); }
// how many stashes of output gradients: B(k) to W(k), s + 1; none on the first stage, whose W(k)
// comes right after its B(k) (it runs the whole backward at B: the same additions, in the same order).
inline int zero_bubble_stashes(int stage, int m) { return stage == 0 ? 0 : std::min(m, stage + 1); }

// What ZB-H1 does not combine with (tensor parallelism: W reads whole rows) is a row of llmc/run/compatibility.h.
