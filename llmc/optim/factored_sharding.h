// factored_sharding.h — ZeRO-1 for the factored optimizers (Adafactor, SM3): each weight matrix is
// owned whole by one data-parallel rank, instead of the flat equal shards AdamW's ZeRO-1 cuts.
//
// What it teaches: ZeRO-1 (llmc/parallel/zero.h) can cut AdamW's state anywhere, because AdamW's
// update of one element reads only that element's m, v and gradient. A factored optimizer's update
// of one element reads its WHOLE matrix: Adafactor's row sums R and column sums C (Shazeer & Stern
// 2018, Algorithm 4) are sums over the full matrix, its update clipping needs RMS(U) over the full
// update and its relative step RMS(X) over the full weights; SM3-II's row and column accumulators
// (Anil et al. 2019) are maxima over full rows and columns. A flat shard that cuts a 768 x 3072
// matrix in the middle of a row holds none of these. Two ways out:
//   (a) give each matrix (and vector) to ONE rank, whole: its state, its update, its arithmetic
//       exactly one rank's, so N ranks give one rank's weights for the same summed gradient;
//   (b) keep the flat shards and all-reduce each block's partial row and column sums (sum for
//       Adafactor, max for SM3) and its partial RMS terms, (n + m) floats per matrix over the
//       data-parallel group: less imbalance, but a second kind of collective and sums in another
//       order, so only close to one rank, not equal.
// We build (a). The blocks (llmc/optim/optimizer_state.h) tile the flat parameter array in order,
// so giving each rank a run of CONSECUTIVE blocks gives it one contiguous range of the weights and
// one contiguous range of the state, in the same order the checkpoint stores it: rank r's state is
// the slice [state_begin_r, state_end_r) of the whole model's. The cut is greedy: rank r takes
// blocks until it holds about (r + 1) / N of the elements. Blocks cannot be split, so the load is
// uneven by up to one block: wte (50257 x 768 = 38.6M of GPT-2 124M's elements, 31%) alone is rank
// 0's whole share at 4 ranks. (The state, which is what ZeRO-1 shards, is tiny either way: 0.32M
// floats for the whole of GPT-2 124M against AdamW's 248M.)
//
// The step on N ranks (the hooks of llmc/run/step.h):
//   finish_gradients  the gradient sum is ZeRO-0's: reduce-scatter then all-gather (an all-reduce,
//                     2 (N-1)/N P*4 bytes per rank), so that every rank has every block's summed
//                     gradient. AdamW's ZeRO-1 keeps only its flat shard of the sum; a block-aligned
//                     reduce (uneven pieces, comm_reduce_sum per owner) would do the same here and
//                     is the next step, not built.
//   optimizer_step    each rank updates its own blocks (adafactor_step / sm3_step_all on them, the
//                     one-rank code), then rank r broadcasts its weight range to the others: an
//                     all-gather with uneven pieces, (N-1) * (its range) * 4 bytes sent by rank r.
// So a step moves 3 (N-1)/N P*4 bytes on average per rank against AdamW ZeRO-1's 2 (N-1)/N P*4.
// Memory per rank: the state of its own blocks (what --estimate prints as optimizer_state).
// Checkpoints: each rank writes its state slice to state_rank<r>.bin; resuming reads every file in
// rank order, which concatenated is the whole model's state, and takes its own slice: any number
// of ranks resumes any other's checkpoint (and a one-rank state.bin).
#pragma once

#include <algorithm>
#include <cstddef>
#include <vector>
#include "llmc/optim/optimizer_state.h"
#include "llmc/parallel/comm.h"
#include "llmc/parallel/sharding.h"

// Rank r owns blocks [first[r], first[r + 1]) of param_blocks(): weights [weights[r]) of the flat
// array and state [state[r]) of the whole model's factored state.
struct FactoredShard {
    std::vector<size_t> first;        // N + 1 entries
    std::vector<ShardRange> weights;  // N ranges, consecutive, together [0, total)
    std::vector<ShardRange> state;    // N ranges, consecutive, together [0, factored_state_floats)
};

// The greedy cut of `blocks` (in order, tiling [0, total) of the flat array) over N ranks.
inline FactoredShard factored_shard(const std::vector<ParamBlock>& blocks, size_t total, int N) {
    FactoredShard s;
    size_t elements = 0, k = 0, state_total = 0;
    for (const ParamBlock& b : blocks) elements += b.elements(), state_total += b.state_floats();
    s.first.push_back(0);
    size_t held = 0;
    for (int r = 0; r < N; r++) {
        size_t goal = elements * (size_t)(r + 1) / (size_t)N;  // exact for the last rank: it takes the rest
        while (k < blocks.size() && (held < goal || r == N - 1)) held += blocks[k++].elements();
        s.first.push_back(k);
    }
    for (int r = 0; r < N; r++) {
        size_t a = s.first[r], b = s.first[r + 1];
        // a range runs to the next rank's first block, so that wte's padded rows (no block: they never
        // train) and the flat array's end travel with the rank before them
        size_t w0 = a < blocks.size() ? blocks[a].offset : total, w1 = b < blocks.size() ? blocks[b].offset : total;
        size_t s0 = a < blocks.size() ? blocks[a].state : state_total, s1 = b < blocks.size() ? blocks[b].state : state_total;
        if (r == 0) w0 = 0;
        s.weights.push_back({w0, w1});
        s.state.push_back({s0, s1});
    }
    return s;
}

// Rank r's blocks, their state offsets made relative to its own state slice.
inline std::vector<ParamBlock> factored_owned_blocks(const std::vector<ParamBlock>& blocks, const FactoredShard& s, int r) {
    std::vector<ParamBlock> mine(blocks.begin() + (long)s.first[r], blocks.begin() + (long)s.first[r + 1]);
    for (ParamBlock& b : mine) b.state -= s.state[r].begin;
    return mine;
}

// Floats of factored state rank r of N keeps under ZeRO-1 (the size table's optimizer_state row).
inline size_t factored_state_floats_of(const GPT2Config& cfg, int N, int r) {
    return factored_shard(param_blocks(cfg), param_layout(cfg).total, N).state[r].size();
}

// Bytes rank r of N sends per step (llmc/parallel/comm.h's convention): ZeRO-0's all-reduce of the
// padded gradient, and the broadcast of its own weights to the N - 1 others.
inline uint64_t factored_zero1_comm_bytes(const GPT2Config& cfg, int N, int r) {
    if (N == 1) return 0;
    size_t total = param_layout(cfg).total;
    uint64_t reduce = 2 * (uint64_t)(N - 1) * shard_layout(total, N).shard_size * sizeof(float);
    return reduce + (uint64_t)(N - 1) * factored_shard(param_blocks(cfg), total, N).weights[r].size() * sizeof(float);
}

// After each rank updated its blocks: every rank gets every rank's weights (an all-gather of uneven
// ranges, as one broadcast from each owner).
inline void factored_share_weights(Comm* dp, float* params, const FactoredShard& s) {
    for (int r = 0; r < dp->world_size; r++) {
        const ShardRange& w = s.weights[(size_t)r];
        comm_broadcast(dp, params + w.begin, w.size() * sizeof(float), r, "broadcast of a rank's updated blocks (factored ZeRO-1)");
    }
}
