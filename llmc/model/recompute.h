// recompute.h — activation recompute (--recompute): trading a little compute for activation memory,
// exactly. The one place that says what each level keeps; both trainers' passes and size tables
// ask recompute_plan() rather than testing the level themselves.
//
// The backward pass reads, for every layer, activations the forward computed. Keeping them all costs
// memory that grows with B*T*L and soon dominates (llmc/memory/estimate.h). Some are cheap to compute again
// from others that are kept anyway, so a level stops keeping them per layer and keeps ONE layer of
// scratch instead: the forward writes and reads it within the layer, and the backward fills it again,
// right before each use, with the forward's own function on the forward's own inputs.
//   level 0  keep everything.
//   level 1  no per-layer fch_gelu = GELU(fch), the MLP's hidden activation after the GELU: the
//            backward evaluates GELU(fch) again from fch, which it keeps anyway (GELU's backward needs it).
//            Saves (L - 1) x B*T x 4C values (4C: the MLP's width, Cf = 4C/tp per tensor rank), the
//            largest per-layer activation there is, for one elementwise pass per layer.
//   level 2  also no per-layer ln1, ln2 (the LayerNorm outputs): the backward rebuilds them from the
//            LayerNorm's input (the residual stream, kept) and the mean and 1/std the forward saved,
//            two floats per row, by the forward's last step alone (llmc/model/cpu_layers.h:
//            layernorm_recompute). One scratch serves both: a layer's ln1 is dead once its qkv matmul
//            has read it, ln2 once the MLP's first matmul has. Saves another (2L - 1) x R x C values
//            (R = B*T rows, or B*T/tp with sequence parallelism), for one pass over two rows per layer.
// At 4 bytes a value (the CPU trainer; 2 in bf16 on the GPU). Measured on the CPU trainer with
// --model L=2,C=128,H=4,T=64,V=512 --batch-size 4 --seq-len 64: it holds 15804416 bytes at level 0,
// 15280128 at level 1 (524288 less: 1 x 256 x 512 x 4) and 14886912 at level 2 (393216 less: 3 x
// 256 x 128 x 4), to the byte what the formulas say.
//
// Why exact: the recomputed values come from the same function on the same inputs, in the same
// order of operations, so they are the same floats, and so is every result downstream (the tests
// train with each level and compare the bits). The scratch is not per micro-batch: a pipeline's 1F1B
// runs another micro-batch's forward between two backwards, which overwrites it, but each backward
// refills it before every use.
#pragma once

// What the passes keep per layer at a recompute level (read `keep.ln`, `keep.gelu`); what they do
// not keep lives in one layer's scratch and is recomputed in the backward.
struct RecomputePlan {
    bool gelu;  // keep fch_gelu per layer (level 0)
    bool ln;    // keep ln1 and ln2 per layer (levels 0 and 1)
};

inline RecomputePlan recompute_plan(int level) { return {level < 1, level < 2}; }

// What the level recomputes, for the trainer's start-up line.
inline const char* recompute_what(int level) {
    return level <= 0 ? "nothing" : level == 1 ? "GELU(fch)" : "GELU(fch), ln1 and ln2";
}
