// zero_bubble_backward.h — the backward pass cut in two for ZB-H1: B, the input gradients, now; W,
// the weight gradients, later. What W needs from B is kept in between, in a "weight stash".
//
// What it teaches. The schedule (llmc/parallel/pipeline_schedule.h, Qi et al., 2023, "Zero Bubble
// Pipeline Parallelism", section 2) runs B on the critical path and W in the holes. For one linear
// layer y = x W^T + b with output gradient dy (cpu_layers.h's matmul_backward, split there):
//     B:  dx  = dy W                 the previous layer (and stage) waits for this
//     W:  dW += dy^T x,  db += sum over rows of dy            only the optimizer waits for these
// and for a LayerNorm: B is dx, W is dw += sum dy * xhat, db += sum dy. W reads dy, which B computes
// and then overwrites at the next layer down, and x, which the forward kept in the micro-batch's
// activation slot. Keeping the whole slot until W would keep it s micro-batches longer on stage s:
// p slots on every stage instead of 1F1B's p - s, and p slots of logits on the last (this file's
// first version did, commit 7cb5738: 9.94 GB of activations on the last of 4 stages at d12, twice
// 1F1B's peak of 4.88 GB, --estimate).
// So B copies exactly what W reads into a "weight stash", and the slot is free after B as in 1F1B.
// Per micro-batch, per layer of a stage (N = B*T rows, the dy first, then the input):
//     MLP projection   dy N x C,  input GELU(fch) N x 4C      fc    dy N x 4C, input ln2 N x C
//     attention proj.  dy N x C,  input atty N x C            qkv   dy N x 3C, input ln1 N x C
//     ln2, ln1         dy N x C,  input x N x C, mean and rstd N each
//   = 20 N C + 4 N floats per layer, plus the final LayerNorm's 2 N C + 2 N on the last stage,
// against 12 N C + NH T N + 4 N of a slot's layer at --recompute 1 (NH T: the attention probabilities).
// The LM head's W stays in B (its dy is dlogits, N x Vp: keeping it would cost more than the
// whole slot), and so does the embedding's scatter-add on the first stage (its dy is the stage's
// dresidual; nothing on the stage waits for it). With --recompute, what B rebuilt (GELU's output,
// ln1, ln2) is what it copies: W recomputes nothing.
//
// How many, and the memory. Stage s runs W(k) right after B(k + s), so s + 1 stashes at once
// (pipeline_pending_weight_passes): one on the first stage, p on the last. Micro-batch k uses stash
// k mod (s + 1): B(k + s + 1), the next user of that stash, comes after W(k). With 1F1B's p - s
// slots, stage s holds p - s slots and s + 1 stashes, a stash about 2/3 of a slot: the first stage,
// the peak of 1F1B, gains one stash (at d12 on 4 stages 720 MiB: 5.64 GB against 4.88, docs/
// parallelism.md), where the
// paper, counting a micro-batch between B and W as only what W reads, gains nothing (the copy is
// our price for slots of one size). The rows are CB_WEIGHT_STASH in llmc/memory/cpu_buffers.h, so
// --estimate prints them.
//
// Bit for bit with 1F1B. Each weight gradient collects one addition per micro-batch (matmul's
// accumulate, LayerNorm's dw += ...), and each addition depends only on the gradient's value before
// it and that micro-batch's dy and x. W runs in micro-batch order on every stage (W0 W1 ... as
// B0 B1 ...), so every gradient sees the same additions in the same order as with the whole
// backward: the same bits (test_pipeline_zb_h1.py checks losses and weights against 1F1B's).
// (The zero-bubble authors' deferral can reorder the accumulation, sail-sg/zero-bubble issue 17;
// here it cannot.)
//
// Hook points: none new. gpt2_backward takes the micro-batch's stash (null: the whole backward, as
// before) and B's matmuls and LayerNorms call cpu_layers.h's matmul_backward_or_defer and
// layernorm_backward_or_defer; the trainer's forward_backward runs gpt2_backward_weights at
// PipeOp::Weight. This file is arithmetic only (the sizes, the layout), so the size table
// (llmc/memory/cpu_buffers.h), which the GPU trainer's --estimate compiles too, can use it.
#pragma once

#include <algorithm>
#include <cstddef>

// A stash holds, per layer of the stage, the output gradient dy of each matmul, in the order the
// backward computes them (Ca, Cf: the local widths of the attention and the MLP): the MLP's
// projection N x C, its fc N x Cf, the attention's projection N x C, its qkv N x 3Ca. B fills it
// (matmul_backward_or_defer in llmc/model/cpu_layers.h); W reads it (gpt2_backward_weights in
// train_gpt_cpu.cpp), with the matmuls' inputs from the micro-batch's slot.
struct LayerWeightStash {
    float *fcproj, *fc, *attproj, *qkv;
};
inline size_t weight_stash_layer_floats(size_t N, size_t C, size_t Ca, size_t Cf) { return N * (C + Cf + C + 3 * Ca); }
inline size_t weight_stash_floats(size_t L, size_t N, size_t C, size_t Ca, size_t Cf) {
    return L * weight_stash_layer_floats(N, C, Ca, Cf);
}
inline LayerWeightStash layer_weight_stash(float* stash, int l, size_t N, size_t C, size_t Ca, size_t Cf) {
    float* p = stash + (size_t)l * weight_stash_layer_floats(N, C, Ca, Cf);
    LayerWeightStash s;
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

// What the CPU trainer's ZB-H1 cannot run yet ("" if it can), one line with the fix: W reads its
// rows locally, and tensor and sequence parallelism would gather them again (not written yet).
// (ZeRO-2/3 do not run with pipelines at all, process_grid.h; --recompute is fine: W rebuilds what
// it reads as B does. One stage has no W: zb-h1 there is gradient accumulation, any grid.)
inline const char* zero_bubble_problem(int pipeline_parallel, int tensor_parallel) {
    if (pipeline_parallel > 1 && tensor_parallel > 1)
        return "--pipeline-schedule zb-h1 with --tensor-parallel is not supported yet (its deferred weight gradients read "
               "whole rows): use --tensor-parallel 1, or --pipeline-schedule 1f1b";
    return "";
}
