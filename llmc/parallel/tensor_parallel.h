// tensor_parallel.h — one layer, several ranks: Megatron's tensor parallelism, and sequence
// parallelism for the regions in between.
//
// A transformer block is two matmul pairs, each "expand, then contract":
//     attention:  qkv = x Wqkv^T  (C -> 3C)  ... attention per head ...  y = a Wo^T    (C -> C)
//     MLP:        h = x Wfc^T     (C -> 4C)  ... GELU, elementwise ...    y = g Wproj^T (4C -> C)
// Megatron (Shoeybi et al., 2019) splits the first matmul of each pair by OUTPUT columns and the
// second by INPUT columns, over the t ranks of a tensor group:
//
//   column-parallel Wqkv, Wfc   rank r computes its own columns: its heads (NH/t of them; attention
//                               is independent per head, so no communication), its 4C/t hidden
//                               units (GELU is elementwise, no communication either)
//   row-parallel Wo, Wproj      rank r multiplies its part of the input by the matching rows of W^T:
//                               a PARTIAL sum of the output; the sum over ranks is the output
//
// So each half-block needs exactly one all-reduce in the forward pass (after the row-parallel
// matmul: "g") and one in the backward pass (of the gradient flowing into the column-parallel
// matmul's input, which every rank used whole: "f"). Each rank holds 1/t of the block's weights,
// gradients and optimizer state, and 1/t of the big activations (qkv, attention, the 4C hidden
// units); LayerNorms, biases added after the sum, and the residual stream are REPLICATED: every
// rank computes them identically. That needs identical inputs, bit for bit, hence the all-reduce
// here is comm_allreduce_sum_identical (reduce-scatter + all-gather: each sum computed once).
//
// The vocabulary too is split by rows of wte (vocab-parallel embedding and LM head):
//   embedding   rank r looks up the tokens in its rows (zeros for the others); the all-reduce adds
//               the t lookups into the embedding; then the position embedding is added, once.
//   LM head     rank r computes the logits of its rows only: (B*T, V/t). The cross-entropy needs
//               logsumexp over ALL V and the logit of the target: three numbers per position,
//               combined across ranks, never the full logits:
//                   m   = max over ranks of the local max        (all-reduce max)
//                   s   = sum over ranks of sum_v exp(z_v - m)   (all-reduce sum, with ...)
//                   z_y = the target's logit, from the rank that holds it, 0 elsewhere (... this one)
//                   loss = m + log s - z_y;   dz_v = softmax_v - [v = y], computed locally
//   A vocabulary that t does not divide is padded: each rank holds ceil(Vp / t) rows, the last
//   rank's extra rows are zero, exist in no file, and are masked out of the loss like the
//   rows between V and Vp (llmc/parallel/process_grid.h).
//
// Cost per micro-batch of B*T tokens, C channels, L layers, t ranks, 4-byte values (ring):
//   forward   1 + 2L all-reduces of B*T*C (embedding, each half-block) + 2 small ones (the loss:
//             B*T maxima, then 2 B*T sums)
//   backward  1 + 2L all-reduces of B*T*C (LM head's input, each half-block); the embedding's
//             backward needs none (every rank has the whole gradient of the residual stream)
//   each all-reduce sends 2 (t-1)/t * B*T*C*4 bytes per rank. This is per micro-batch, on the
//   critical path, and grows with the batch, not the model: tensor groups stay within a node.
//
// Sequence parallelism (Korthikanti et al., 2022). In the regions between the matmul pairs
// (LayerNorm, bias, residual add, dropout) every tensor rank computes the same thing on all B*T
// rows: t copies of the work and of the activations. Split those regions by ROWS instead: each rank
// keeps B*T/t rows of the residual stream. An all-reduce is a reduce-scatter followed by an
// all-gather, and SP simply moves the row-wise region between the two halves:
//
//     TP:   ... row-parallel matmul -> [all-reduce] -> LN, residual on all rows -> column-parallel
//     SP:   ... row-parallel matmul -> [reduce-scatter] -> LN, residual on my rows -> [all-gather]
//            -> column-parallel ...
//
// The same bytes move in the forward pass (reduce-scatter + all-gather = all-reduce), the
// LayerNorm/residual work and activations shrink by t, and the backward pass mirrors it
// (all-gather <-> reduce-scatter). Consequences: LayerNorm weight gradients are now partial sums
// over each rank's rows and must be summed over the tensor group once per step
// (tp_sum_replicated_grads); the column-parallel matmul's input is gathered again in the backward
// pass rather than stored whole, so the backward moves 1.5x TP's bytes (per half-block two
// all-gathers and a reduce-scatter); the biases after the row-parallel matmuls get their gradient
// from the gathered output gradient, whole on every rank, so they need no extra sum; and a pipeline
// stage sends only its own rows to the next (1/t of the bytes).
#pragma once

#include <cstring>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/model/model.h"

struct TensorParallel {
    Comm* comm = nullptr;          // the tensor group (null on one rank)
    int degree = 1, rank = 0;
    bool sequence_parallel = false;
    std::vector<float> scratch;    // for the identical all-reduce
};

inline void tensor_parallel_init(TensorParallel* tp, Comm* group, bool sequence_parallel) {
    tp->comm = group;
    tp->degree = group->world_size;
    tp->rank = group->rank;
    tp->sequence_parallel = sequence_parallel && tp->degree > 1;
}

// Rows of the residual stream each rank holds: all B*T, or its 1/t with sequence parallelism.
inline size_t tp_local_rows(const TensorParallel& tp, size_t rows) { return tp.sequence_parallel ? rows / tp.degree : rows; }
// The first of them.
inline size_t tp_first_row(const TensorParallel& tp, size_t rows) { return tp.sequence_parallel ? tp.rank * (rows / tp.degree) : 0; }

// Before a column-parallel matmul ("f" in Megatron's paper; forward: every rank needs every row).
// Returns the (rows x width) input: `mine` itself, or with sequence parallelism all ranks' rows
// all-gathered into `all`.
inline const float* tp_all_rows(TensorParallel* tp, const float* mine, float* all, size_t rows, size_t width, const char* what) {
    if (!tp->sequence_parallel) return mine;
    size_t n = rows / tp->degree * width;
    memcpy(all + tp->rank * n, mine, n * sizeof(float));
    comm_all_gather(tp->comm, all, n * sizeof(float), what);
    return all;
}

// Where a row-parallel matmul writes its partial sums: into `mine` (rows x width) itself, or with
// sequence parallelism (where `mine` holds only rows/t rows) into the full-size `scratch`.
inline float* tp_partial_buffer(const TensorParallel& tp, float* mine, float* scratch) {
    return tp.sequence_parallel ? scratch : mine;
}

// After a row-parallel matmul ("g"; and, in the backward pass, for the gradient of a column-parallel
// matmul's input): sums the ranks' partial (rows x width) arrays. Returns where the sum is: `partial`
// itself (all-reduced in place; nothing to do on one rank), or with sequence parallelism `mine`,
// which receives this rank's rows of the sum (a reduce-scatter).
inline float* tp_sum_rows(TensorParallel* tp, float* partial, float* mine, size_t rows, size_t width, const char* what) {
    if (tp->degree == 1) return partial;
    if (!tp->sequence_parallel) {
        comm_allreduce_sum_identical(tp->comm, partial, rows * width, &tp->scratch, what);
        return partial;
    }
    comm_reduce_scatter_sum(tp->comm, partial, mine, rows / tp->degree * width, what);
    return mine;
}

// The vocabulary-parallel loss: per position, the max (exact in any order) and the sums.
inline void tp_max(TensorParallel* tp, float* data, size_t n, const char* what) {
    if (tp->degree > 1) comm_allreduce_max(tp->comm, data, n, what);
}
inline void tp_sum(TensorParallel* tp, float* data, size_t n, const char* what) {
    if (tp->degree > 1) comm_allreduce_sum_identical(tp->comm, data, n, &tp->scratch, what);
}

// Sequence parallelism: the gradients of the LayerNorm weights are partial sums over this rank's
// rows; sums them over the tensor group (the listed tensors, `count` elements each).
inline void tp_sum_replicated_grads(TensorParallel* tp, const std::vector<std::pair<float*, size_t>>& tensors) {
    if (!tp->sequence_parallel) return;
    size_t n = 0;
    for (auto& t : tensors) n += t.second;
    if (n == 0) return;
    std::vector<float> packed(n);
    size_t at = 0;
    for (auto& t : tensors) {
        memcpy(packed.data() + at, t.first, t.second * sizeof(float));
        at += t.second;
    }
    comm_allreduce_sum_identical(tp->comm, packed.data(), n, &tp->scratch, "all-reduce of the sequence-parallel LayerNorm gradients");
    at = 0;
    for (auto& t : tensors) {
        memcpy(t.first, packed.data() + at, t.second * sizeof(float));
        at += t.second;
    }
}

// ----------------------------------------------------------------------------------------------
// What it costs: bytes one rank sends to its tensor group per step (llmc/parallel/comm.h's ring convention),
// exactly as the trainers call the collectives above. rows = B*T of a micro-batch, C channels,
// L layers on this rank, m micro-batches, zero_stage (which decides when the sequence-parallel
// LayerNorm gradients are summed: once per step, or per micro-batch with each ZeRO-2/3 bucket).
inline uint64_t tp_comm_bytes(int t, bool sp, size_t rows, size_t C, int L, bool first_stage, bool last_stage, int m,
                              int zero_stage) {
    if (t == 1) return 0;
    auto all_reduce = [&](size_t n) { return 2 * (uint64_t)(t - 1) * ((n + t - 1) / t) * sizeof(float); };  // identical: RS + AG
    auto half = [&](size_t n) { return (uint64_t)(t - 1) * (n / t) * sizeof(float); };                      // RS or AG
    uint64_t max_all_reduce = 2 * (uint64_t)(t - 1) * rows * sizeof(float) / t;
    size_t n = rows * C;
    uint64_t fwd = 0, bwd = 0, per_step = 0;
    uint64_t loss = max_all_reduce + all_reduce(2 * rows);    // the vocabulary-parallel cross-entropy
    if (!sp) {
        fwd = (first_stage ? all_reduce(n) : 0) + 2 * (uint64_t)L * all_reduce(n) + (last_stage ? loss : 0);
        bwd = (last_stage ? all_reduce(n) : 0) + 2 * (uint64_t)L * all_reduce(n);
        return (uint64_t)m * (fwd + bwd);
    }
    fwd = (first_stage ? half(n) : 0) + 4 * (uint64_t)L * half(n) + (last_stage ? half(n) + loss : 0);
    bwd = (last_stage ? 2 * half(n) : 0) + 6 * (uint64_t)L * half(n) + (first_stage ? half(n) : 0);
    size_t layernorm_floats = 4 * (size_t)L * C + (last_stage ? 2 * C : 0);
    if (zero_stage <= 1) per_step = all_reduce(layernorm_floats);
    else fwd += L * all_reduce(4 * C) + (last_stage ? all_reduce(2 * C) : 0);  // with each bucket, every micro-batch
    return (uint64_t)m * (fwd + bwd) + per_step;
}
