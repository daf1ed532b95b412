// zero_bubble_backward.h — the backward pass cut in two for ZB-H1: B, the input gradients, now; W,
// the weight gradients, later. What W needs from B is kept in between, in a "weight stash".
//
// What it teaches. The schedule (llmc/parallel/pipeline_schedule.h, Qi et al., 2023, "Zero Bubble
// Pipeline Parallelism", section 2) runs B on the critical path and W in the holes. For one linear
// layer y = x W^T + b with output gradient dy (cpu_layers.h's matmul_backward, split there):
//     B:  dx  = dy W                 the previous layer (and stage) waits for this
//     W:  dW += dy^T x,  db += sum over rows of dy            only the optimizer waits for these
// and for a LayerNorm: B is dx, W is dw += sum dy * xhat, db += sum dy. W reads x, which the forward
// kept for the backward anyway, and dy, which B computes and then overwrites at the next layer
// down: a deferred W needs dy kept. Per micro-batch, per layer of a stage (N = B*T rows):
//     qkv's dy     N x 3C      the attention projection's dy   N x C
//     fc's dy      N x 4C      the MLP projection's dy         N x C
//     ln1's dy     N x C       ln2's dy                        N x C      = 11 N C floats per layer
// plus the final LayerNorm's dy (N x C) on the last stage. The LM head's dy, dlogits, is already
// kept: the loss's backward writes it over the logits, which live until the slot's next forward.
// The embedding's scatter-add stays in B on the first stage (its dy is the stage's dresidual,
// cheap to apply, and nothing else on the stage waits for it). At d12 (C = 768, N = 4 x 1024):
// 12 x 11 x 4096 x 768 x 4 bytes = 1.66 GB per pending micro-batch: the price of ZB-H1 in memory
// (--estimate prints it beside the activations, docs/parallelism.md compares them).
//
// The memory it costs here. W reads the forward's inputs (ln1, atty, ln2, GELU's output, the
// residuals) from micro-batch k's activation slot, so the slot lives from F(k) to W(k): p slots on
// every stage (pipeline_live_micro_batches), not 1F1B's p - s, and the last stage's slots carry the
// logits. At d12 on 4 stages (m = 8, B = 4, T = 1024, --estimate) the last stage holds 9.94 GB of
// activations against 1F1B's peak of 4.88 GB (stage 0). The paper's accounting (its "same peak
// memory as 1F1B") keeps, between B and W, only what W reads: a stash holding W's inputs as well as
// dy (about 20 N C floats per layer), the slots back at p - s, and the LM head's W in B (so no stage
// keeps more than one slot of logits). Not written yet.
//
// How many. Stage s runs W(k) right after B(k + s), so s + 1 stashes at once
// (pipeline_pending_weight_passes): one on the first stage, which holds the most activations, p on
// the last, which holds the fewest. Micro-batch k uses stash k mod (s + 1): B(k + s + 1), the next
// user of that stash, comes after W(k). The rows are CB_WEIGHT_STASH in llmc/memory/cpu_buffers.h,
// so --estimate prints them.
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

#include <cstddef>

// The floats of one stash for a stage of L layers (N rows of C channels, 3Ca and Cf the local
// widths of qkv and the MLP; `head`: the stage has the final LayerNorm).
inline size_t weight_stash_layer_floats(size_t N, size_t C, size_t Ca, size_t Cf) { return N * (3 * Ca + C + Cf + C + C + C); }
inline size_t weight_stash_floats(size_t L, size_t N, size_t C, size_t Ca, size_t Cf, bool head) {
    return L * weight_stash_layer_floats(N, C, Ca, Cf) + (head ? N * C : 0);
}

// Layer l's output gradients inside one stash, in the order the backward computes them.
struct LayerWeightStash {
    float *dfcproj, *dfc, *dln2, *dattproj, *dqkv, *dln1;
};
inline LayerWeightStash layer_weight_stash(float* stash, int l, size_t N, size_t C, size_t Ca, size_t Cf) {
    float* p = stash + (size_t)l * weight_stash_layer_floats(N, C, Ca, Cf);
    LayerWeightStash s;
    s.dfcproj = p, p += N * C;
    s.dfc = p, p += N * Cf;
    s.dln2 = p, p += N * C;
    s.dattproj = p, p += N * C;
    s.dqkv = p, p += N * 3 * Ca;
    s.dln1 = p;
    return s;
}
// The final LayerNorm's dy, after the L layers' stashes.
inline float* final_norm_weight_stash(float* stash, size_t L, size_t N, size_t C, size_t Ca, size_t Cf) {
    return stash + L * weight_stash_layer_floats(N, C, Ca, Cf);
}

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
