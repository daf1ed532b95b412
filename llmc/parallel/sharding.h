// sharding.h — who owns which parameters: the arithmetic of ZeRO, with no communication in it.
//
// ZeRO ("Zero Redundancy Optimizer", Rajbhandari et al. 2019) notices that with plain data
// parallelism every one of N ranks keeps the same AdamW state: m, v (and fp32 master weights when
// the parameters are bf16). That is 8 to 12 bytes per parameter copied N times for nothing. Stage 1
// cuts the flat parameter array into N equal shards; rank r keeps the optimizer state of shard r
// only and updates only those parameters. Stage 2 would also keep only shard r of the reduced
// gradients, stage 3 only shard r of the parameters themselves; all three cut along the same lines,
// which is why the lines are drawn here, once, with no MPI or CUDA in sight.
//
// The cut. The collectives that move shards (NCCL's and MPI's reduce-scatter and all-gather) want
// every rank's piece to have the SAME length, so the array of P parameters is padded with zeros to
//
//     padded = round_up(P, N * granule),    shard = padded / N,    rank r owns [r*shard, (r+1)*shard)
//
// The granule (64 elements: 256 bytes of fp32, 128 of bf16) keeps each shard's start aligned for
// vector loads and GPU cache lines. The cost is at most N*granule - 1 padding elements, nothing
// next to a model's millions. The padding belongs to no tensor; the last rank's shard holds it
// (all of it, or when N*granule > P, whole shards are padding and some ranks own no parameter).
//
// Tensors cross shard boundaries (a 38M-element wte does not care where shard 3 ends), so anything
// that differs per tensor, such as weight decay (matrices only), is applied piece by piece:
// shard_pieces() lists the parts of each tensor that fall inside a range.
//
// Buckets. A data-parallel GPU trainer does not wait for the whole backward pass before it starts
// summing gradients across ranks: the backward runs from the last layer to the first, so layer
// L-1's gradients are final long before layer 0's, and summing them can overlap the rest of the
// backward. gradient_bucket() says which parameters each "bucket" holds, in the order they become
// final: bucket b < L is layer L-1-b (its slice of the 12 stacked per-layer tensors: 12 ranges of
// the flat array, since each tensor stacks its layers); bucket L is the rest, wte, wpe and the final
// LayerNorm (wte is the LM head AND the token embedding, so its gradient is final only after the
// encoder's backward, at the very end). Together the buckets cover every parameter exactly once.
//
// A bucket's ranges cut across shards in uneven pieces (layer 5's fcw slice may lie in shard 2,
// its qkvw slice in shard 1), so a bucket cannot go through one reduce-scatter, which needs equal
// pieces for every rank. shard_owners() cuts each range at shard boundaries instead, naming the rank
// that owns each piece: summing every piece onto its owner ("reduce to owners") IS a reduce-scatter,
// only with pieces of any size, and each rank sends the same (N-1)/N of the bytes.
#pragma once

#include <cstddef>
#include <vector>
#include "llmc/model/model.h"

constexpr size_t SHARD_GRANULE = 64;

struct ShardLayout {
    size_t total = 0;         // P: real elements
    size_t padded_total = 0;  // P rounded up to a multiple of world * granule
    size_t shard_size = 0;    // padded_total / world: every rank's shard has this length
    int world_size = 1;
};

// [begin, end) of the flat array. `end` may run past the real elements into the padding.
struct ShardRange {
    size_t begin = 0, end = 0;
    size_t size() const { return end - begin; }
};

inline ShardLayout shard_layout(size_t total, int world_size, size_t granule = SHARD_GRANULE) {
    if (world_size < 1 || granule < 1) fail("internal: shard_layout needs world_size >= 1 and granule >= 1");
    ShardLayout s;
    s.total = total;
    s.world_size = world_size;
    size_t unit = (size_t)world_size * granule;
    s.padded_total = (total + unit - 1) / unit * unit;
    if (s.padded_total == 0) s.padded_total = unit;  // an empty array still gets one granule per rank
    s.shard_size = s.padded_total / world_size;
    return s;
}

// Rank r's shard, padding included: what it sends and receives in reduce-scatter and all-gather.
inline ShardRange shard_range(const ShardLayout& s, int rank) {
    return {(size_t)rank * s.shard_size, (size_t)(rank + 1) * s.shard_size};
}

// The same shard with the padding cut off: the real parameters rank r owns (possibly none).
inline ShardRange owned_range(const ShardLayout& s, int rank) {
    ShardRange r = shard_range(s, rank);
    r.begin = std::min(r.begin, s.total);
    r.end = std::min(r.end, s.total);
    return r;
}

// The common part of two ranges (empty when they do not meet). Also answers, on resume, which
// slice of an old shard file (written by another world size) lands in this rank's new shard.
inline ShardRange range_overlap(ShardRange a, ShardRange b) {
    ShardRange r{std::max(a.begin, b.begin), std::min(a.end, b.end)};
    if (r.end < r.begin) r.end = r.begin;
    return r;
}

// The part of one parameter tensor inside a range of the flat array.
struct TensorPiece {
    int tensor;          // index into the ParamLayout (WTE, WPE, ...)
    size_t begin, end;   // flat-array indices, within both the tensor and the range
};

// Cuts [range.begin, range.end) of the flat array at tensor boundaries. Empty tensors and the
// padding past the last tensor produce no piece; the pieces are in flat-array order.
inline std::vector<TensorPiece> shard_pieces(const ParamLayout& layout, ShardRange range) {
    std::vector<TensorPiece> pieces;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        ShardRange part = range_overlap(range, {layout.offset[t], layout.offset[t] + layout.count[t]});
        if (part.size() > 0) pieces.push_back({t, part.begin, part.end});
    }
    return pieces;
}

// The part of [range) inside one rank's shard (padding included, so a range that runs into the
// padding still has an owner).
struct OwnedPiece {
    int rank;
    size_t begin, end;
};

// Cuts [range.begin, range.end) at shard boundaries: the pieces, in order, each with its owner.
inline std::vector<OwnedPiece> shard_owners(const ShardLayout& s, ShardRange range) {
    std::vector<OwnedPiece> pieces;
    if (range.size() == 0) return pieces;
    int first = (int)(range.begin / s.shard_size), last = (int)((range.end - 1) / s.shard_size);
    for (int r = first; r <= last && r < s.world_size; r++) {
        ShardRange part = range_overlap(range, shard_range(s, r));
        if (part.size() > 0) pieces.push_back({r, part.begin, part.end});
    }
    return pieces;
}

// The ranges of the flat array in gradient bucket `bucket` (0 .. num_layers; see "Buckets" above):
// bucket b < L holds layer L-1-b of every per-layer tensor, bucket L the embeddings and lnf.
inline int gradient_bucket_count(int num_layers) { return num_layers + 1; }

inline std::vector<ShardRange> gradient_bucket(const ParamLayout& layout, int num_layers, int bucket) {
    std::vector<ShardRange> ranges;
    if (bucket == num_layers) {
        for (int t : {WTE, WPE, LNFW, LNFB}) ranges.push_back({layout.offset[t], layout.offset[t] + layout.count[t]});
        return ranges;
    }
    size_t layer = (size_t)(num_layers - 1 - bucket);
    for (int t = LN1W; t <= FCPROJB; t++) {  // the 12 stacked per-layer tensors
        size_t per_layer = layout.count[t] / num_layers;
        size_t begin = layout.offset[t] + layer * per_layer;
        ranges.push_back({begin, begin + per_layer});
    }
    return ranges;
}
