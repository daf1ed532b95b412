// factored_tensor_parallel.h — the factored optimizers (Adafactor, SM3) under tensor parallelism:
// which of a cut matrix's statistics a rank can keep to itself, and which need the tensor group.
//
// What it teaches: Megatron's tensor parallelism (llmc/parallel/tensor_parallel.h) cuts a weight
// stored (out, in) either by its ROWS (the column-parallel qkvw and fcw: each rank its output
// features; wte: each rank its vocabulary rows) or by its COLUMNS (the row-parallel attprojw and
// fcprojw: each rank its input features). A factored optimizer keeps one number per row and one per
// column of the WHOLE matrix (llmc/optim/optimizer_state.h). On a rank that holds rows [a, b) of W:
//   - a row statistic is a sum (Adafactor's R_i = sum_j G_ij^2, Shazeer & Stern 2018, Algorithm 4) or
//     a maximum (SM3-II's r_i = max_j nu_ij, Anil et al. 2019) over ONE row: all of it is here, so
//     it stays local, and the rank keeps only its own rows' numbers;
//   - a column statistic runs through EVERY row: the rank has a partial sum (a partial maximum), and
//     the whole one is the sum (the maximum) over the tensor group. Every rank then keeps all m
//     column numbers, the same bits on each.
// A column cut is the mirror image: the column statistics are local, the row statistics need the
// group. So each rank's state is exactly the statistics of its LOCAL shape (a rows-cut n/t x m block
// keeps n/t + m numbers, a columns-cut n x m/t block n + m/t), and the same update code runs on it;
// only the statistics of the cut dimension are completed first. Adafactor has three more numbers
// that span the whole matrix, and so the group:
//   - RMS(X), the scale of its relative step alpha_t = max(eps2, RMS(X)) rho_t: sum of X^2 and the
//     element count (wte's last rank holds fewer real rows than the others);
//   - sum_i R_i, the normaliser of V = R C^T / sum(R): over local rows when the rows are cut (the
//     column cut holds all of R, so its sum is local);
//   - RMS(U), the update clipping's U / max(1, RMS(U) / d): the whole update's.
// A cut vector (qkvb, fcb) keeps its V (Adafactor) or accumulators (SM3) elementwise, local; only
// Adafactor's RMS(X) and RMS(U) over it need the group. Replicated blocks (LayerNorms, wpe, the
// biases added after the sum) have the same gradient on every rank and are updated whole, alone.
//
// The collectives, per cut block and step (the points marked "group" in adafactor.h and sm3.h):
//   Adafactor  1. the sum of [sum X^2, elements, sum(R) (rows cut), the cut dimension's G^2 sums]
//              2. the sum of sum U^2
//   SM3        one elementwise maximum of the cut dimension's new accumulators (exact in any order)
// Sums are of doubles, all-gathered and added in rank order (as comm_sum does): every rank gets the
// same bits, which keeps the replicated column (or row) numbers identical across the group. The sums
// are in another order than one rank's, so a TP run is close to the one-rank run, not equal
// (test/test_parallelism.py checks it within the other TP checks' tolerance); SM3's maxima are exact.
// Cost: for GPT-2 124M at t = 2, Adafactor all-gathers about (4 x 768 + 2 x 768) doubles per layer
// and SM3 max-reduces about 4 x 768 floats per layer: kilobytes, against the megabytes of each
// micro-batch's activations all-reduce. The price is latency: 2 small collectives per cut block.
// Hook point: optimizer_step (llmc/run/step.h): gpt2_update passes the group to adafactor_step /
// sm3_step_all when the tensor group has more than one rank.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <vector>
#include "llmc/optim/optimizer_state.h"
#include "llmc/parallel/comm.h"
#include "llmc/parallel/process_grid.h"

// The blocks of this rank's slice (its local layout, slice_layout): param_blocks' order and shapes,
// each matrix or vector of the rank's part, marked with how tensor parallelism cuts it. On one rank
// (the full slice) these are exactly param_blocks(cfg).
inline std::vector<ParamBlock> slice_param_blocks(const GPT2Config& cfg, const ModelSlice& s) {
    ParamLayout layout = slice_layout(cfg, s);
    size_t C = cfg.channels, Ca = s.attn_channels, Cf = s.fc_channels, state = 0;
    bool split = s.tp > 1;
    std::vector<ParamBlock> blocks;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (layout.count[t] == 0) continue;
        size_t layers = tensor_is_per_layer(t) ? (size_t)s.num_layers : 1, each = layout.count[t] / layers, rows = each, cols = 0;
        BlockCut cut = split && !tensor_is_replicated(t) ? BlockCut::Rows : BlockCut::Whole;
        switch (t) {
            case WTE: rows = (size_t)s.vocab_real, cols = C; break;  // the real rows only (optimizer_state.h)
            case WPE: rows = each / C, cols = C; break;
            case QKVW: rows = 3 * Ca, cols = C; break;
            case FCW: rows = Cf, cols = C; break;
            case ATTPROJW: rows = C, cols = Ca, cut = split ? BlockCut::Cols : cut; break;
            case FCPROJW: rows = C, cols = Cf, cut = split ? BlockCut::Cols : cut; break;
        }
        for (size_t l = 0; l < layers; l++) {
            blocks.push_back({t, layout.offset[t] + l * each, rows, cols, state, cut});
            state += rows + cols;
        }
    }
    return blocks;
}

inline size_t slice_factored_state_floats(const GPT2Config& cfg, const ModelSlice& s) {
    size_t n = 0;
    for (const ParamBlock& b : slice_param_blocks(cfg, s)) n += b.state_floats();
    return n;
}

// The group over the tensor-parallel ranks: sums of doubles added in rank order, maxima by MPI.
inline FactoredGroup factored_tensor_group(Comm* tp) {
    FactoredGroup g;
    g.sum = [tp](double* data, size_t n) {
        size_t N = (size_t)tp->world_size;
        std::vector<double> all(N * n);
        std::copy(data, data + n, all.begin() + (long)(n * (size_t)tp->rank));
        comm_all_gather(tp, all.data(), n * sizeof(double), "all-gather of a cut block's statistics (factored optimizer, TP)");
        for (size_t i = 0; i < n; i++) {
            double total = 0.0;
            for (size_t r = 0; r < N; r++) total += all[r * n + i];
            data[i] = total;
        }
    };
    g.max = [tp](float* data, size_t n) {
        comm_allreduce_max(tp, data, n, "all-reduce max of a cut block's accumulators (SM3, TP)");
    };
    return g;
}

// Bytes one rank sends to its tensor group per step for the collectives above (comm.h's convention:
// an all-gather sends (t-1) x its part, an all-reduce 2 (t-1)/t x the array).
inline uint64_t factored_tp_comm_bytes(const GPT2Config& cfg, const ModelSlice& s, Optimizer optimizer) {
    if (s.tp == 1 || optimizer == Optimizer::AdamW) return 0;
    uint64_t t = (uint64_t)s.tp, bytes = 0;
    for (const ParamBlock& b : slice_param_blocks(cfg, s)) {
        if (b.cut == BlockCut::Whole) continue;
        size_t across = b.cut == BlockCut::Rows ? b.cols : b.rows;  // the statistics the group completes
        if (optimizer == Optimizer::Adafactor)
            bytes += (t - 1) * ((b.is_matrix() ? 3 + across : 2) + 1) * sizeof(double);
        else if (b.is_matrix())
            bytes += 2 * (t - 1) * across * sizeof(float) / t;
    }
    return bytes;
}
