// zero.h — ZeRO stages 0 to 3: what the data-parallel ranks stop copying, and what it costs them.
//
// Data-parallel ranks hold the same slice of the model (all of it, without tensor or pipeline
// parallelism) and train it on different data. Per parameter, in fp32 on the CPU, a rank keeps
// 4 bytes of weight, 4 of gradient and 8 of AdamW state (m and v): 16 bytes, N times over for N
// ranks. ZeRO (Rajbhandari et al., 2019) shards more and more of it across the N ranks:
//
//   stage  shards                    each rank keeps (bytes/param)   communicates per step
//   0      nothing                   4 + 4 + 8        = 16           reduce-scatter + all-gather of gradients
//   1      optimizer state           4 + 4 + 8/N                     reduce-scatter grads, all-gather params
//   2      + gradients               4 + 4/N + 8/N                   reduce-scatter grads, per micro-batch;
//                                                                    all-gather params
//   3      + parameters              4/N + 4/N + 8/N = 16/N          all-gather every unit's params before
//                                                                    its forward AND before its backward;
//                                                                    reduce-scatter grads per micro-batch
//
// (plus, for stages 2-3, the one or two units gathered or being reduced at the moment). Stages 0
// and 1 move 2 (N-1)/N P*4 bytes per step, the cost of one all-reduce: ZeRO-1 is free. ZeRO-2
// moves the same with one micro-batch per step, but its reduce-scatter runs once per micro-batch
// (a rank cannot keep a full gradient to accumulate into, that is the point), so m micro-batches
// cost m reduce-scatters. ZeRO-3 adds two all-gathers of the parameters per micro-batch: 1.5x
// the bytes of data parallelism at m = 1, in exchange for holding 1/N of everything.
//
// Stages 0 and 1 cut the rank's flat parameter array into N equal shards (llmc/parallel/sharding.h): rank r
// owns shard r. Stages 2 and 3 need a finer cut, because they communicate one UNIT at a time while
// the forward and backward passes run. The units are the gradient buckets of llmc/parallel/sharding.h (the
// GPU trainer's, for its overlapped data-parallel reduction): each layer, and the two ends of the
// model together (wte, wpe and the final LayerNorm: wte is both the embedding and the LM head). A
// unit's parameters, packed one tensor after another, are cut into N equal shards by the same
// shard_layout(); rank r owns shard r of EVERY unit (as FSDP does with its flat parameters). A
// unit's life in a ZeRO-3 step:
//
//     forward:   all-gather unit -> compute -> free           (every layer once; the ends twice:
//     backward:  all-gather unit, open a gradient bucket       the embedding, then the head)
//                -> compute -> reduce-scatter the bucket into this rank's shard -> free both
//
// ZeRO-2 does the backward half with its parameters always whole. Both accumulate the reduced
// shards of all micro-batches of a step, then each rank runs AdamW on its shards: the same per-
// element arithmetic on the same sums, so ZeRO-2 and ZeRO-3 give bit-identical weights, as ZeRO-0
// and ZeRO-1 do (tested). The ends' gradient bucket stays open for the whole backward pass: the
// LM head and the final LayerNorm write into it first, the embedding lookup last.
//
// Nothing here is CPU-specific except that the buffers are host vectors: the GPU trainer can take
// the units, shards and the order of operations as they are, with its NCCL collectives.
#pragma once

#include <algorithm>
#include <cstring>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/io/formats.h"
#include "llmc/model/model.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/parallel/sharding.h"
#include "llmc/probes/poison.h"  // tests only: fresh units and buckets as NaN

// One tensor's part of a unit: local elements [local, local + count) of the slice's flat array.
struct ZeroUnitPiece {
    int tensor;
    size_t local, count;
};

struct ZeroUnit {
    std::vector<ZeroUnitPiece> pieces;   // packed in this order
    size_t size = 0;                     // elements, all pieces together
    ShardLayout shards;                  // stages 2-3: the packed unit cut into dp shards
    size_t stored_at = 0;                // stages 2-3: where this rank's shard starts in its shard arrays
};

// The units of a slice with L layers: gradient_bucket(layout, L, u) of llmc/parallel/sharding.h, cut into
// per-tensor pieces. Unit u < L is layer L-1-u (in the order the backward pass finishes them), unit
// L the ends of the model. A pipeline stage without the embedding or the head has that unit smaller
// or empty.
inline int unit_of_layer(int L, int l) { return L - 1 - l; }
inline int ends_unit(int L) { return L; }

inline std::vector<ZeroUnit> model_units(const ParamLayout& layout, int L) {
    std::vector<ZeroUnit> units((size_t)gradient_bucket_count(L));
    for (int u = 0; u < (int)units.size(); u++) {
        for (const ShardRange& r : gradient_bucket(layout, L, u)) {
            if (r.size() == 0) continue;
            units[(size_t)u].pieces.push_back({tensor_of(layout, r.begin), r.begin, r.size()});
            units[(size_t)u].size += r.size();
        }
    }
    return units;
}

// Pointers to a unit's tensors: inside the flat array (`packed` false), or inside a buffer that
// holds the unit packed (a gathered unit or a gradient bucket). Tensors not in the unit are null.
// (T: float on the CPU, the GPU's bf16 element type there.)
template <class T>
inline ParamTensors<T> unit_view(const ZeroUnit& u, T* base, bool packed) {
    ParamTensors<T> v;
    size_t at = 0;
    for (const ZeroUnitPiece& p : u.pieces) {
        v.ptr[p.tensor] = base + (packed ? at : p.local);
        at += p.count;
    }
    return v;
}

// The same tensors inside the flat array of a slice with L layers: layer l's part of each stacked
// tensor (unit_of_layer(L, l)), or wte, wpe and the final LayerNorm (ends_unit(L)). What the
// forward and backward passes address when the unit is not gathered into a buffer of its own.
// A tensor the slice does not hold (a pipeline stage's absent ends) is nullptr, as in unit_view:
// pointing it at the array's end would invite a read of C elements past it.
template <class T>
inline ParamTensors<T> flat_unit_view(T* flat, const ParamLayout& layout, int L, int unit) {
    ParamTensors<T> all = point_into(flat, layout), v;
    bool ends = unit == ends_unit(L);
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        if (layout.count[t] == 0) continue;
        if (!tensor_is_per_layer(t)) v.ptr[t] = ends ? all[t] : nullptr;
        else if (!ends) v.ptr[t] = all[t] + (size_t)(L - 1 - unit) * (layout.count[t] / L);
    }
    return v;
}

// The parts of a packed unit range [packed_begin, packed_end) that lie in each of its pieces:
// copy(local, packed, count) for each, with `local` an index of the flat array and `packed` one of the
// packed unit. The CPU copies with memcpy (below), the GPU with cudaMemcpyAsync (llmc/parallel/zero.cuh).
template <class Copy>
inline void unit_runs(const ZeroUnit& u, size_t packed_begin, size_t packed_end, Copy copy) {
    size_t at = 0;
    for (const ZeroUnitPiece& p : u.pieces) {
        size_t lo = std::max(packed_begin, at), hi = std::min(packed_end, at + p.count);
        if (lo < hi) copy(p.local + (lo - at), lo, hi - lo);
        at += p.count;
    }
}

// Copies between a packed unit range [packed_begin, packed_end) and the flat array.
inline void unit_pack(const ZeroUnit& u, const float* flat, float* packed, size_t packed_begin, size_t packed_end) {
    unit_runs(u, packed_begin, packed_end, [&](size_t local, size_t at, size_t n) {
        memcpy(packed + (at - packed_begin), flat + local, n * sizeof(float));
    });
}
inline void unit_unpack(const ZeroUnit& u, const float* packed, float* flat, size_t packed_begin, size_t packed_end) {
    unit_runs(u, packed_begin, packed_end, [&](size_t local, size_t at, size_t n) {
        memcpy(flat + local, packed + (at - packed_begin), n * sizeof(float));
    });
}

// ----------------------------------------------------------------------------------------------

struct Zero {
    int stage = 0;
    Comm* dp = nullptr;                 // the data-parallel group
    ProcessGrid grid;
    ParamLayout layout;                 // the slice's flat array
    std::vector<ZeroUnit> units;
    // stages 0-1: the whole flat array cut into dp shards (llmc/parallel/sharding.h)
    ShardLayout shards;
    ShardRange shard;                   // this rank's shard, padding included
    ShardRange updated;                 // what its AdamW updates: everything (stage 0) or its shard (1)
    // every stage: the gradient summed over the data-parallel ranks, this rank's part of it (stages
    // 0-1: its shard of the flat array; 2-3: its shard of every unit, unit after unit)
    std::vector<float> grad_shard;
    // stage 3: this rank's shard of every unit's parameters (the only copy of the weights it keeps)
    std::vector<float> param_shard;
    // stages 2-3: units gathered right now, gradient buckets open right now (empty otherwise)
    std::vector<std::vector<float>> gathered, buckets;
    size_t transient_floats = 0, transient_peak = 0;   // in gathered units and buckets: the measured peak
    std::vector<float> scratch;
    // stage 1 with a factored optimizer (llmc/optim/factored_sharding.h): each rank updates whole
    // matrices, so it needs the whole summed gradient (stage 0's sum) and shares its updated blocks
    // itself (zero_after_update leaves them alone)
    bool whole_gradient = false;
};

inline size_t zero_shard_floats(const Zero& z) {
    size_t n = 0;
    for (const ZeroUnit& u : z.units) n += u.shards.shard_size;
    return n;
}

// Stages 0-1 with a single data-parallel rank: there is nothing to sum, the gradient in `grads` already
// is this rank's shard of the sum, so no separate grad_shard is kept (zero_memory sizes it 0).
inline bool zero_sums_in_place(const Zero& z) { return z.stage <= 1 && z.dp->world_size == 1; }

// Stages 0-1: where this rank's shard of the summed gradient is.
inline float* zero_summed_shard(Zero& z, std::vector<float>& grads) {
    return zero_sums_in_place(z) ? grads.data() + z.shard.begin : z.grad_shard.data();
}

// Sets up the rank's share: which shards it owns, of the flat array or of every unit. Allocates
// nothing: the trainer allocates the buffers from its size table (llmc/memory/cpu_buffers.h), whose rows
// for the weights, gradients and AdamW state come from zero_memory() below, the same arithmetic.
inline void zero_setup(Zero* z, int stage, Comm* dp, const ProcessGrid& grid, const ModelSlice& slice, const ParamLayout& layout) {
    z->stage = stage;
    z->dp = dp;
    z->grid = grid;
    z->layout = layout;
    z->units = model_units(layout, slice.num_layers);
    int N = dp->world_size, r = dp->rank;
    z->shards = shard_layout(layout.total, N);
    z->shard = shard_range(z->shards, r);
    z->updated = stage == 1 ? owned_range(z->shards, r) : ShardRange{0, layout.total};
    size_t stored = 0;
    for (ZeroUnit& u : z->units) {
        u.shards = shard_layout(u.size, N);
        u.stored_at = stored;
        stored += u.shards.shard_size;
    }
    z->gathered.assign(z->units.size(), {});
    z->buckets.assign(z->units.size(), {});
}

inline void zero_track(Zero* z, std::vector<float>& buffer, size_t floats) {
    if (floats > buffer.size()) z->transient_floats += floats - buffer.size();
    buffer.assign(floats, 0.0f);
    poison_fresh(&buffer);  // tests: NaN (llmc/probes/poison.h)
    z->transient_peak = std::max(z->transient_peak, z->transient_floats);
}
inline void zero_free(Zero* z, std::vector<float>& buffer) {
    z->transient_floats -= buffer.size();
    std::vector<float>().swap(buffer);
}

// ZeRO-3: all-gathers unit u's parameters (before its forward or backward). Returns the packed unit.
inline float* zero_gather(Zero* z, int u, const char* what) {
    ZeroUnit& unit = z->units[u];
    std::vector<float>& buffer = z->gathered[u];
    if (!buffer.empty()) return buffer.data();   // already gathered (the embedding, for the LM head)
    zero_track(z, buffer, unit.shards.padded_total);
    size_t s = unit.shards.shard_size;
    memcpy(buffer.data() + (size_t)z->dp->rank * s, z->param_shard.data() + unit.stored_at, s * sizeof(float));
    comm_all_gather(z->dp, buffer.data(), s * sizeof(float), what);
    return buffer.data();
}

inline void zero_release(Zero* z, int u) {
    if (!z->gathered[u].empty()) zero_free(z, z->gathered[u]);
}

// ZeRO-2/3: a zeroed buffer for unit u's gradient of this micro-batch (the backward adds into it).
inline float* zero_open_bucket(Zero* z, int u) {
    std::vector<float>& bucket = z->buckets[u];
    if (bucket.empty()) {
        zero_track(z, bucket, z->units[u].shards.padded_total);
        std::fill(bucket.begin(), bucket.end(), 0.0f);  // the backward adds into it (poison found it: not the allocator's zeros)
    }
    return bucket.data();
}

// ZeRO-2/3: unit u's gradient is complete for this micro-batch: reduce-scatter it, add this rank's
// shard of the sum to its accumulated shard, free the bucket.
inline void zero_reduce_bucket(Zero* z, int u, const char* what) {
    ZeroUnit& unit = z->units[u];
    size_t s = unit.shards.shard_size;
    z->scratch.resize(s);
    comm_reduce_scatter_sum(z->dp, z->buckets[u].data(), z->scratch.data(), s, what);
    float* acc = z->grad_shard.data() + unit.stored_at;
    for (size_t i = 0; i < s; i++) acc[i] += z->scratch[i];
    zero_free(z, z->buckets[u]);
}

// Stages 0-1: after the backward pass of the whole step, sum the flat gradient over the data-parallel
// ranks: a reduce-scatter into grad_shard; stage 0 (and stage 1 for a factored optimizer: whole_gradient)
// then all-gathers the sums so that every rank holds the whole summed gradient in `grads` (stage 0's
// reduce-scatter + all-gather is an all-reduce).
inline void zero_reduce_gradients(Zero* z, std::vector<float>* grads) {
    if (z->stage >= 2) return;   // already reduced, unit by unit, during the backward pass
    if (zero_sums_in_place(*z)) return;
    comm_reduce_scatter_sum(z->dp, grads->data(), z->grad_shard.data(), z->shards.shard_size, "reduce-scatter of the gradients");
    if (z->stage == 0 || z->whole_gradient) {
        memcpy(grads->data() + z->shard.begin, z->grad_shard.data(), z->shard.size() * sizeof(float));
        comm_all_gather(z->dp, grads->data(), z->shard.size() * sizeof(float), "all-gather of the gradients");
    }
}

// The local elements whose optimizer state this rank keeps (and, at stage 3, whose parameters), cut
// at tensor boundaries, with `stored`: their index in m, v (and grad_shard, param_shard at stages
// 2-3). Stage 0: the whole slice; stage 1: its shard; stages 2-3: its shard of every unit.
struct ZeroPiece {
    int tensor;
    size_t local, count, stored;
};

inline std::vector<ZeroPiece> zero_owned_pieces(const Zero& z) {
    std::vector<ZeroPiece> out;
    if (z.stage <= 1) {
        for (const TensorPiece& p : shard_pieces(z.layout, z.updated))
            out.push_back({p.tensor, p.begin, p.end - p.begin, p.begin - z.updated.begin});
        return out;
    }
    for (const ZeroUnit& u : z.units) {
        ShardRange mine = shard_range(u.shards, z.dp->rank);
        size_t at = 0;
        for (const ZeroUnitPiece& p : u.pieces) {
            size_t lo = std::max(mine.begin, at), hi = std::min(mine.end, at + p.count);
            if (lo < hi) out.push_back({p.tensor, p.local + (lo - at), hi - lo, u.stored_at + (lo - mine.begin)});
            at += p.count;
        }
    }
    return out;
}

// Where a piece's reduced gradient and current weights are.
inline float* zero_grad_of(Zero& z, const ZeroPiece& p, std::vector<float>& grads) {
    if (z.stage == 0) return grads.data() + p.local;                      // all-gathered whole
    if (z.stage == 1) return zero_summed_shard(z, grads) + (p.local - z.shard.begin);
    return z.grad_shard.data() + p.stored;
}
inline float* zero_param_of(Zero& z, const ZeroPiece& p, std::vector<float>& params) {
    return z.stage == 3 ? z.param_shard.data() + p.stored : params.data() + p.local;
}

// The parts of the reduced gradient this rank adds to the squared gradient norm: its share of the
// data-parallel sum, less the tensors another tensor rank counts (each element is counted once in
// the whole world). Contiguous pieces are merged, so that without tensor parallelism the sum runs
// over the shard in one piece, exactly as it always has.
inline std::vector<std::pair<const float*, size_t>> zero_norm_ranges(Zero& z, std::vector<float>& grads) {
    std::vector<std::pair<const float*, size_t>> out;
    auto add = [&](const float* p, size_t n) {
        if (n == 0) return;
        if (!out.empty() && out.back().first + out.back().second == p) out.back().second += n;
        else out.push_back({p, n});
    };
    if (z.stage <= 1) {
        for (const TensorPiece& p : shard_pieces(z.layout, owned_range(z.shards, z.dp->rank)))
            if (counts_once(z.grid, p.tensor)) add(zero_summed_shard(z, grads) + (p.begin - z.shard.begin), p.end - p.begin);
        return out;
    }
    for (const ZeroPiece& p : zero_owned_pieces(z))
        if (counts_once(z.grid, p.tensor)) add(z.grad_shard.data() + p.stored, p.count);
    return out;
}

// After this rank's AdamW: every data-parallel rank gets every updated parameter back.
// Stage 1: all-gather the flat array's shards; stage 2: each unit's; stage 3: nothing (the
// parameters stay sharded until the next forward gathers them).
inline void zero_after_update(Zero* z, std::vector<float>* params) {
    if (z->stage == 1 && !z->whole_gradient) {
        comm_all_gather(z->dp, params->data(), z->shard.size() * sizeof(float), "all-gather of the parameters");
    } else if (z->stage == 2) {
        for (const ZeroUnit& u : z->units) {
            size_t s = u.shards.shard_size;
            ShardRange mine = shard_range(u.shards, z->dp->rank);
            z->scratch.assign(u.shards.padded_total, 0.0f);
            unit_pack(u, params->data(), z->scratch.data() + mine.begin, mine.begin, mine.end);
            comm_all_gather(z->dp, z->scratch.data(), s * sizeof(float), "all-gather of the parameters");
            unit_unpack(u, z->scratch.data(), params->data(), 0, u.size);
        }
    }
}

// ----------------------------------------------------------------------------------------------
// What it costs (what --estimate predicts; the trainers measure the same)

struct ZeroMemory {
    size_t params = 0, grads = 0, grad_shard = 0, optimizer = 0;  // floats one rank keeps for the whole run
    size_t transient = 0;     // floats in gathered units and open buckets, at the peak (stages 2-3)
};

// Rank `r` of `N` data-parallel ranks holding a slice with these units (`total` elements).
inline ZeroMemory zero_memory(int stage, const std::vector<ZeroUnit>& units, size_t total, int N, int r) {
    ZeroMemory z;
    if (stage <= 1) {
        ShardLayout s = shard_layout(total, N);
        z.params = z.grads = s.padded_total;          // padded so that the collectives move equal shards
        z.grad_shard = N == 1 ? 0 : s.shard_size;     // the reduce-scatter's output (none to sum with 1 rank)
        z.optimizer = 2 * (stage == 1 ? owned_range(s, r).size() : total);
        return z;
    }
    size_t shards = 0, ends = 0, largest_layer = 0;
    for (size_t u = 0; u < units.size(); u++) {
        ShardLayout s = shard_layout(units[u].size, N);
        shards += s.shard_size;
        if (u + 1 == units.size()) ends = s.padded_total;
        else largest_layer = std::max(largest_layer, s.padded_total);
    }
    z.params = stage == 2 ? total : shards;
    z.grad_shard = shards;
    z.optimizer = 2 * shards;
    // the backward pass opens the ends' bucket at the LM head and closes it after the embedding
    // lookup; in between, each layer's bucket in turn and, at stage 3, the weights being used:
    // the ends' at the start (with their bucket), then one layer's
    if (stage == 2) z.transient = ends + largest_layer;
    else z.transient = std::max(2 * ends, ends + 2 * largest_layer);
    return z;
}

// Bytes one rank sends to its data-parallel group per step, m micro-batches (llmc/parallel/comm.h's ring
// convention): stages 0-1 one reduce-scatter and one all-gather of the slice; stage 2 a
// reduce-scatter per micro-batch and an all-gather of the weights; stage 3 per micro-batch a
// reduce-scatter and every unit's all-gathers (the ends 3 times: the lookup, the head's forward
// and its backward; each layer twice).
inline uint64_t zero_comm_bytes(int stage, const std::vector<ZeroUnit>& units, size_t total, int N, int m) {
    if (N == 1) return 0;
    if (stage <= 1) return 2 * (uint64_t)(N - 1) * shard_layout(total, N).shard_size * sizeof(float);
    uint64_t bytes = 0;
    for (size_t u = 0; u < units.size(); u++) {
        uint64_t shard = (uint64_t)(N - 1) * shard_layout(units[u].size, N).shard_size * sizeof(float);
        int gathers = u + 1 == units.size() ? 3 : 2;   // the ends: embedding, LM head, its backward
        bytes += stage == 2 ? (uint64_t)(m + 1) * shard : (uint64_t)m * (1 + gathers) * shard;
    }
    return bytes;
}

// ----------------------------------------------------------------------------------------------
// In global coordinates (checkpoints, dumps)

// A run of elements this rank keeps: global elements [global, global + count) are at `state_at` in
// its m and v (and, at stages 2-3, its gradient shard) and at `weight_at` in its weights (the
// slice's flat array, or at stage 3 its weight shard).
struct StateRun {
    size_t global, count, state_at, weight_at;
};

// The elements whose optimizer state this rank keeps, as global runs (`slice` = slice_runs() of its
// slice). With `canonical`, only those it writes to a checkpoint: of the ranks that keep an
// element's state, exactly one writes it (tensor rank 0 for a replicated tensor, data-parallel
// rank 0 at stage 0, the shard's owner at stages 1-3).
inline std::vector<StateRun> zero_state_runs(const Zero& z, const std::vector<SliceRun>& slice, bool canonical) {
    std::vector<StateRun> out;
    for (const ZeroPiece& p : zero_owned_pieces(z)) {
        if (canonical && (!counts_once(z.grid, p.tensor) || (z.stage == 0 && z.grid.dp_rank != 0))) continue;
        for (const SliceRun& r : runs_in_local_range(slice, p.local, p.local + p.count)) {
            size_t state_at = p.stored + (r.local - p.local);
            out.push_back({r.global, r.count, state_at, z.stage == 3 ? state_at : r.local});
        }
    }
    return out;
}

// The elements whose weights this rank keeps: its whole slice (stages 0-2), or its shards (3).
inline std::vector<StateRun> zero_weight_runs(const Zero& z, const std::vector<SliceRun>& slice) {
    if (z.stage == 3) return zero_state_runs(z, slice, false);
    std::vector<StateRun> out;
    for (const SliceRun& r : slice) out.push_back({r.global, r.count, 0, r.local});
    return out;
}

// A grid's training-state file (llmc/io/formats.h, version 2): the elements `runs` (this rank's share,
// zero_state_runs(..., true)) in global order, with m and v read at each run's state position and,
// when the header says it has them, the weights at its weight position, or with weights_at_state at
// its state position (the GPU's fp32 master weights sit beside m and v). The header (from
// train_state_header) gets the grid. Runs that continue each other are one entry of the table, and
// one run or none (a ZeRO-0 or ZeRO-1 rank's whole range) is written as the plain slice of version 1.
inline void zero_fill_state(TrainState* s, const ProcessGrid& g, std::vector<StateRun> runs, const float* m, const float* v,
                            const float* weights, bool weights_at_state) {
    std::sort(runs.begin(), runs.end(), [](const StateRun& a, const StateRun& b) { return a.global < b.global; });
    s->header.tensor_parallel = g.tp;
    s->header.pipeline_parallel = g.pp;
    s->header.sequence_parallel = g.sequence_parallel;
    for (const StateRun& r : runs) {
        size_t n = s->runs.size();
        if (n > 0 && s->runs[n - 2] + s->runs[n - 1] == (int64_t)r.global) {
            s->runs[n - 1] += (int64_t)r.count;
        } else {
            s->runs.push_back((int64_t)r.global);
            s->runs.push_back((int64_t)r.count);
        }
        if (m) s->m.insert(s->m.end(), m + r.state_at, m + r.state_at + r.count);  // (null: streamed, TrainState::moments)
        if (v) s->v.insert(s->v.end(), v + r.state_at, v + r.state_at + r.count);
        s->header.shard_count += (int64_t)r.count;
        size_t at = weights_at_state ? r.state_at : r.weight_at;
        if (s->header.has_master_weights) s->master.insert(s->master.end(), weights + at, weights + at + r.count);
    }
    if (s->runs.size() <= 2) {  // one run (a ZeRO-1 shard) or none: the plain slice of version 1
        s->header.shard_begin = s->runs.empty() ? 0 : s->runs[0];
        s->runs.clear();
    } else {
        s->header.has_run_table = 1;
        s->header.num_runs = (int64_t)(s->runs.size() / 2);
    }
}

