// optimizer_state.h — which optimizer a run uses (--optimizer), and the shape of its state: the
// model's parameters seen as the matrices and vectors that a factored optimizer keeps statistics of.
//
// AdamW keeps two numbers per parameter (m, v: 8 bytes/parameter in fp32, llmc/optim/adamw.h).
// Adafactor (llmc/optim/adafactor.h) and SM3 (llmc/optim/sm3.h) keep, for an n x m weight matrix,
// one number per row and one per column: n + m numbers instead of 2nm. A vector (a bias, a
// LayerNorm gain) has no rows and columns to factor, so it keeps one number per element, which
// costs little: GPT-2 124M has 38,400 of them per layer against 7.1M matrix entries.
//
// The blocks, for this project's layout (llmc/model/model.h): a weight is stored (out, in),
// row-major, as llm.c does, so ROW i of a matrix is output feature i and COLUMN j input feature j:
//   wte (V, C)   rows = tokens. Only the V real rows: the padded rows Vp - V are storage, never in
//                the loss, their gradient is always zero; they get no state and are never touched.
//                wte is ALSO the classifier (tied embedding): one parameter, one block, one state;
//                its gradient already holds both uses' sum (finish_gradients) when the step runs.
//   wpe (maxT, C) rows = positions
//   per layer l: qkvw (3C, C), attprojw (C, C), fcw (4C, C), fcprojw (C, 4C): one block each per
//                layer (a layer's matrix is a matrix; the stack of L of them is not)
//   vectors: per layer ln1w, ln1b, qkvb (3C), attprojb, ln2w, ln2b, fcb (4C), fcprojb; lnfw, lnfb
// The state is one flat float array: the blocks in this order, a matrix's n row numbers then its m
// column numbers, a vector's n numbers. That order is also the one the checkpoint stores
// (docs/formats.md, state.bin version 3).
//
// The whole model's layout. ZeRO-1 gives each rank a run of whole blocks of it
// (llmc/optim/factored_sharding.h); tensor parallelism cuts some blocks over the tensor group, and
// their row or column statistics are then combined over it (llmc/optim/factored_tensor_parallel.h).
#pragma once

#include <algorithm>
#include <cstddef>
#include <functional>
#include <string>
#include <vector>
#include "llmc/model/model.h"

// The value is what state.bin stores (TrainStateHeader::optimizer): 0 is AdamW, so older files,
// whose field was reserved and zero, read as AdamW.
enum class Optimizer { AdamW = 0, Adafactor = 1, SM3 = 2 };

inline bool parse_optimizer(const std::string& name, Optimizer* out) {
    if (name == "adamw") *out = Optimizer::AdamW;
    else if (name == "adafactor") *out = Optimizer::Adafactor;
    else if (name == "sm3") *out = Optimizer::SM3;
    else return false;
    return true;
}

inline const char* optimizer_name(int optimizer) {
    switch (optimizer) {
        case (int)Optimizer::AdamW: return "adamw";
        case (int)Optimizer::Adafactor: return "adafactor";
        case (int)Optimizer::SM3: return "sm3";
        default: return "unknown";
    }
}

// One matrix or vector of the parameters: `rows` x `cols` elements from params[offset] (cols == 0:
// a vector of `rows` elements), with its statistics from state[state].
// Tensor parallelism cuts a block over the ranks of the tensor group (factored_tensor_parallel.h):
// by its rows (wte's vocabulary, the column-parallel qkvw and fcw; a cut vector: qkvb, fcb) or by its
// columns (the row-parallel attprojw and fcprojw). Whole: every rank holds all of it.
enum class BlockCut { Whole, Rows, Cols };

struct ParamBlock {
    int tensor;
    size_t offset, rows, cols, state;   // rows and cols: this rank's part of a cut block
    BlockCut cut = BlockCut::Whole;
    bool is_matrix() const { return cols > 0; }
    size_t elements() const { return is_matrix() ? rows * cols : rows; }
    size_t state_floats() const { return rows + cols; }
};

inline std::vector<ParamBlock> param_blocks(const GPT2Config& cfg) {
    ParamLayout layout = param_layout(cfg);
    size_t C = cfg.channels, L = cfg.num_layers, state = 0;
    std::vector<ParamBlock> blocks;
    auto add = [&](int t, size_t offset, size_t rows, size_t cols) {
        blocks.push_back({t, offset, rows, cols, state});
        state += rows + cols;
    };
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        bool per_layer = t != WTE && t != WPE && t != LNFW && t != LNFB;
        size_t layers = per_layer ? L : 1, each = layout.count[t] / layers;
        // the matrices are exactly the tensors that take weight decay (model.h): the 2-D weights
        size_t cols = !param_tensor_decays(t) ? 0 : t == FCPROJW ? 4 * C : C;
        size_t rows = cols == 0 ? each : t == WTE ? (size_t)cfg.vocab_size : each / cols;
        for (size_t l = 0; l < layers; l++) add(t, layout.offset[t] + l * each, rows, cols);
    }
    return blocks;
}

// What a cut block's update asks of the ranks that hold its other parts (factored_tensor_parallel.h
// builds it over the tensor group): `sum` adds an array over the group, `max` takes its elementwise
// maximum, both giving every rank the same bits. Null, or a Whole block: the one-rank update.
struct FactoredGroup {
    std::function<void(double* data, size_t n)> sum;
    std::function<void(float* data, size_t n)> max;
};

// Floats of state a factored optimizer (Adafactor, SM3) keeps for the whole model.
inline size_t factored_state_floats(const GPT2Config& cfg) {
    size_t n = 0;
    for (const ParamBlock& b : param_blocks(cfg)) n += b.state_floats();
    return n;
}

// --moe-experts: the blocks of the MoE table this rank holds (llmc/model/model.h's MoELayout): per
// MoE block its router (E, C), and per held expert its fcw (4C, C), fcb (4C), fcprojw (C, 4C) and
// fcprojb (C), each a matrix or vector of its own, as a dense layer's: an expert's statistics are
// its own, never pooled with another expert's (nor with the router's). Offsets are into the MoE
// table; `tensor` is the dense tensor whose weight-decay rule it follows (the router decays, as a
// matrix: moe_tensor_decays), so the optimizers' param_tensor_decays needs no MoE case. The state
// follows the blocks in the table's order, as the dense model's does.
inline std::vector<ParamBlock> moe_param_blocks(const GPT2Config& cfg, const MoELayout& held) {
    size_t C = cfg.channels, H = 4 * C, state = 0;
    const int as_dense[NUM_MOE_TENSORS] = {FCW, FCW, FCB, FCPROJW, FCPROJB};
    const size_t rows[NUM_MOE_TENSORS] = {held.per_block[MOE_ROUTER] / C, H, H, C, C};   // the router: E rows
    const size_t cols[NUM_MOE_TENSORS] = {C, C, 0, H, 0};
    std::vector<ParamBlock> blocks;
    for (int t = 0; t < NUM_MOE_TENSORS; t++) {
        size_t each = cols[t] ? rows[t] * cols[t] : rows[t];
        for (size_t at = 0; each > 0 && at < held.count[t]; at += each) {
            blocks.push_back({as_dense[t], held.offset[t] + at, rows[t], cols[t], state});
            state += rows[t] + cols[t];
        }
    }
    return blocks;
}

// The widest matrix's columns: SM3 computes the new column statistics there before it overwrites
// the old ones (llmc/optim/sm3.h).
inline size_t factored_scratch_floats(const GPT2Config& cfg) {
    size_t n = 0;
    for (const ParamBlock& b : param_blocks(cfg)) n = std::max(n, b.cols);
    return n;
}
