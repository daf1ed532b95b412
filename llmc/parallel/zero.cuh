// zero.cuh — ZeRO stages 0 to 3 on GPUs: the data-parallel ranks' gradient sum, their optimizer
// step and their weights, overlapped with the backward pass on a second CUDA stream.
//
// Read llmc/parallel/zero.h first: the stages, the UNITS (each layer, and the ends of the model: wte, wpe,
// the final LayerNorm; unit u < L is layer L-1-u, in the order the backward pass finishes them), the
// shards (llmc/parallel/sharding.h), and the order of a unit's life in a step. All of that arithmetic is used
// here as it is (the host struct Zero; its vectors stay empty: the buffers are on the GPU). Every
// stage has the same three hooks in the trainer's passes (train_gpt.cu's, which call zero_weights,
// zero_open_bucket and zero_grads_done here), and the same step after them:
//
//   unit_weights(u)     the weights of unit u: a view into the flat array (stages 0-2), or gathered
//   unit_grads(u)       where the backward adds u's gradient: the flat array (0-1), or a bucket (2-3)
//   unit_grads_done(u)  u's gradient is complete for this micro-batch: start summing it over the
//                       data-parallel ranks on the communication stream, and go on with the layers below
//   then the step: zero_wait_reduction, zero_norm_pieces, zero_share_gradients, zero_adamw and
//   zero_after_update
//
// What a GPU adds to the host arithmetic is overlap on two streams, and buffers that do not move:
//
//   compute stream:  backward layer L-1 | layer L-2 | ... | layer 0 | embeddings | norm, AdamW
//   comm stream:          (event) -> sum unit 0 | unit 1 | ...       | unit L     |
//                                                         host waits here ^ (zero_wait_reduction)
//
// After each unit's backward an event is recorded on the compute stream; the communication stream
// waits for it, then sums the unit while the compute stream goes on. The compute stream never waits
// for the communication stream: the host blocks in gpu_comm_wait, which polls against --comm-timeout,
// so a collective stuck on a dead rank can only stall a wait that has a deadline.
//
// Stages 0 and 1 (the simplest case). The gradient is the flat array, accumulated over the step's
// micro-batches; only the LAST micro-batch's unit_grads_done sums each unit, as a "reduce to owners"
// (llmc/parallel/comm_nccl.cuh): the unit's 12 ranges of the flat array, cut by the shard boundaries into
// uneven pieces, each summed onto the rank whose shard holds it (a reduce-scatter with the same
// bytes). Then stage 0 all-gathers the summed gradient and every rank runs AdamW on everything;
// stage 1 runs AdamW on its shard (its master weights, m and v are that shard only) and all-gathers
// the updated bf16 weights. The same sums, the same per-element update: bit-identical weights.
// With one data-parallel rank nothing is sent, and every hook is a view or nothing at all.
//
// Stages 2 and 3 communicate on EVERY micro-batch (a rank no longer keeps a full gradient to
// accumulate into), in fixed SLOTS of the buffer table (llmc/memory/gpu_buffers.h): cudaMalloc in the
// middle of a step is slow and fragments memory. Slot 0 holds the ends' unit, slots 1 and 2 the
// layers, a layer unit u in slot 1 + u % 2: consecutive layers alternate, so one slot is in use on
// the compute stream while the other is gathered (ZeRO-3's prefetch) or reduce-scattered.
//
//   ZeRO-3, forward and backward: unit_weights(u, next) makes sure u is gathered (the host waits for
//   its event), then starts gathering `next`, the unit the pass needs after u, into the other slot:
//   its all-gather runs on the communication stream while u's kernels run. A slot remembers which
//   unit it holds; a unit still there is not gathered again (the last layer's weights between the
//   forward and the backward pass, the ends' weights all step long: they have a slot of their own)
//   until the optimizer step changes the weights. A slot is overwritten only after the compute
//   stream has passed the event recorded when its unit was released.
//
//   ZeRO-2/3, backward: unit_grads(u) opens a zeroed bucket for u in its slot (once the slot's
//   previous reduce-scatter has finished), the backward adds u's gradient into it, and
//   unit_grads_done(u) hands it to the communication stream: a reduce-scatter into `reduced`, then
//   this rank's shard is added into its gradient shard (rounded once per micro-batch, like one rank
//   accumulating micro-batches). The ends' bucket stays open from the LM head to the embedding.
//
//   The step: AdamW on the owned pieces (zero_owned_pieces: per tensor, for weight decay), each
//   with the same per-element update and stochastic rounding as stages 0-1 (adamw.cuh). ZeRO-2
//   then all-gathers every unit's updated weights back into the flat array; ZeRO-3 keeps only its
//   shard and marks the slots stale.
//
// Gradients are summed in bf16 (NCCL adds in fp32 and rounds each partial sum to bf16): 2 bytes per
// parameter instead of 4. One GPU accumulating N micro-batches also rounds its bf16 gradient once
// per micro-batch, so N ranks add no more rounding than N accumulation steps already do.
//
// Cost per step, m micro-batches, dp ranks, P values of this rank's slice in bf16: stages 0-1 one
// reduce-scatter and one all-gather, (dp-1)/dp * 2P bytes each (an all-reduce's worth); stage 2 m
// reduce-scatters and one all-gather of the weights; stage 3 at most two all-gathers per layer per
// micro-batch (forward and backward, fewer when a slot still holds the unit) and one of the ends per
// step. Memory: stage 1 keeps 1/dp of master, m and v; stages 2-3 1/dp of the gradient too (3: and
// of the weights), plus the slots: two layers and the ends, gathered (ZeRO-3) and as buckets.
#pragma once

#include <vector>
#include "llmc/optim/adamw.cuh"
#include "llmc/optim/adamw_bf16.cuh"  // --optimizer-state bf16: zero_adamw's uint16_t m and v
#include "llmc/parallel/comm_nccl.cuh"
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/memory/gpu_buffers.h"
#include "llmc/parallel/zero.h"

struct ZeroGpu {
    Zero plan;                        // llmc/parallel/zero.h: stage, units, shards, owned pieces (host arithmetic only)
    GpuComm* comm = nullptr;          // the data-parallel group on the GPU
    floatX* weights = nullptr;        // stage 3: this rank's shard of every unit's weights (GB_PARAMS)
    floatX* grads = nullptr;          // GB_GRADS: stages 0-1 the flat gradient, 2-3 this rank's shard of every unit's
    std::vector<std::vector<ShardRange>> flat_buckets;  // stages 0-1: each unit's ranges of the flat gradient
    floatX* gathered[3] = {};         // stage 3: the slots of gathered units (GB_ZERO_GATHERED)
    floatX* buckets[3] = {};          // stages 2-3: the slots of gradient buckets (GB_ZERO_BUCKETS)
    floatX* reduced = nullptr;        // a reduce-scatter's output (GB_ZERO_REDUCED)
    int holds[3] = {-1, -1, -1};      // stage 3: the unit each gather slot holds (-1: none, or stale)
    bool open[3] = {};                // stages 2-3: a bucket is open in the slot
    bool pending[3] = {};             // stages 2-3: the slot's reduce-scatter started since the host or the device last waited for all
    cudaEvent_t gathered_ev[3] = {}, released_ev[3] = {}, reduced_ev[3] = {}, ready = nullptr;
    cudaEvent_t joined = nullptr;     // --cuda-graphs: the compute stream waits here for the communication stream
};

inline int zero_slot(const ZeroGpu& z, int unit) {
    return unit == ends_unit((int)z.plan.units.size() - 1) ? 0 : 1 + unit % 2;
}

// Sets up the plan (llmc/parallel/zero.h) and points the slots into the buffers the trainer allocated from
// its table. After gpu_comm_init: the events belong to this rank's GPU.
inline void zero_gpu_init(ZeroGpu* z, int stage, Comm* dp, GpuComm* comm, const ProcessGrid& grid, const ModelSlice& slice,
                          const ParamLayout& layout, floatX* params, floatX* grads, floatX* gathered, floatX* buckets,
                          floatX* reduced) {
    zero_setup(&z->plan, stage, dp, grid, slice, layout);
    z->comm = comm;
    z->grads = grads;
    CUDA_CHECK(cudaEventCreateWithFlags(&z->ready, cudaEventDisableTiming));
    CUDA_CHECK(cudaEventCreateWithFlags(&z->joined, cudaEventDisableTiming));
    if (stage < 2) {
        for (int u = 0; u < (int)z->plan.units.size(); u++) z->flat_buckets.push_back(gradient_bucket(layout, slice.num_layers, u));
        return;
    }
    ZeroSlots sizes = zero_slots(z->plan.units, dp->world_size);
    size_t offset[3] = {0, sizes.ends, sizes.ends + sizes.layer};
    for (int i = 0; i < 3; i++) {
        if (stage == 3) z->gathered[i] = gathered + offset[i];
        z->buckets[i] = buckets + offset[i];
        CUDA_CHECK(cudaEventCreateWithFlags(&z->gathered_ev[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&z->released_ev[i], cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&z->reduced_ev[i], cudaEventDisableTiming));
    }
    z->weights = stage == 3 ? params : nullptr;
    z->reduced = reduced;
}

inline void zero_gpu_destroy(ZeroGpu* z) {
    for (cudaEvent_t* e : {z->gathered_ev, z->released_ev, z->reduced_ev})
        for (int i = 0; i < 3; i++)
            if (e[i]) CUDA_CHECK(cudaEventDestroy(e[i]));
    if (z->ready) CUDA_CHECK(cudaEventDestroy(z->ready));
    if (z->joined) CUDA_CHECK(cudaEventDestroy(z->joined));
}

// The communication stream goes on only once the compute stream has reached this point (the compute
// stream never waits for the communication stream).
inline void zero_follow(ZeroGpu* z, cudaStream_t compute) {
    CUDA_CHECK(cudaEventRecord(z->ready, compute));
    CUDA_CHECK(cudaStreamWaitEvent(z->comm->stream, z->ready, 0));
}

// Until the communication stream's work so far is done. Eager, the host waits (gpu_comm_wait, under
// the deadline). Inside a captured graph (--cuda-graphs, llmc/run/cuda_graphs.cuh) the host cannot
// wait: the compute stream waits on the device instead, which also joins the communication stream
// back into the capture (the real runtime, and the emulation, refuse to end a capture that a forked
// stream has not rejoined); the host checks NCCL's errors after the replay (zero_wait_reduction).
inline void zero_wait(ZeroGpu* z, cudaStream_t compute, bool graphed, const char* what) {
    for (bool& p : z->pending) p = false;
    if (!graphed) {
        gpu_comm_wait(z->comm, what);
        return;
    }
    CUDA_CHECK(cudaEventRecord(z->joined, z->comm->stream));
    CUDA_CHECK(cudaStreamWaitEvent(compute, z->joined, 0));
}

// ZeRO-3: starts gathering unit u into its slot on the communication stream (after the compute
// stream has released the slot's previous unit).
inline void zero_start_gather(ZeroGpu* z, int u) {
    const ZeroUnit& unit = z->plan.units[(size_t)u];
    int slot = zero_slot(*z, u);
    size_t shard = unit.shards.shard_size;
    cudaStream_t s = z->comm->stream;
    CUDA_CHECK(cudaStreamWaitEvent(s, z->released_ev[slot], 0));  // (an event never recorded is no wait)
    CUDA_CHECK(cudaMemcpyAsync(z->gathered[slot] + (size_t)z->plan.dp->rank * shard, z->weights + unit.stored_at,
                               shard * sizeof(floatX), cudaMemcpyDeviceToDevice, s));
    gpu_all_gather(z->comm, z->gathered[slot], shard, NCCL_FLOATX, "all-gather of a unit's weights (ZeRO-3)");
    CUDA_CHECK(cudaEventRecord(z->gathered_ev[slot], s));
    z->holds[slot] = u;
}

// ZeRO-3: unit u's weights, gathered; `next` (or -1) is the unit the pass needs after u: its
// gather starts now, behind u's.
inline ParamTensors<floatX> zero_weights(ZeroGpu* z, int u, int next) {
    int slot = zero_slot(*z, u);
    if (z->holds[slot] != u) zero_start_gather(z, u);
    if (next >= 0 && zero_slot(*z, next) != slot && z->holds[zero_slot(*z, next)] != next) zero_start_gather(z, next);
    gpu_comm_wait_event(z->comm, z->gathered_ev[slot], "all-gather of a unit's weights (ZeRO-3)");
    return unit_view(z->plan.units[(size_t)u], z->gathered[slot], true);
}

// ZeRO-3: the compute stream is done with unit u's weights once it passes this point.
inline void zero_release(ZeroGpu* z, int u, cudaStream_t compute) {
    CUDA_CHECK(cudaEventRecord(z->released_ev[zero_slot(*z, u)], compute));
}

// ZeRO-2/3: unit u's gradient bucket for this micro-batch, zeroed when it opens (once the slot's
// previous bucket has been reduce-scattered). The ends' bucket is opened by the LM head and found
// open again by the embedding.
//
// --cuda-graphs (ZeRO-2, llmc/run/cuda_graphs.cuh): inside a capture the host cannot wait for the
// slot's reduce-scatter (it is not running: it is being recorded), so the compute stream waits for it
// on the device instead, an edge of the graph. Only for a reduce-scatter recorded in the same capture
// (`pending`): one from before it was waited for when the previous graph joined its streams, and a
// graph may not wait on an event recorded outside it.
inline ParamTensors<floatX> zero_open_bucket(ZeroGpu* z, int u, cudaStream_t compute) {
    int slot = zero_slot(*z, u);
    const ZeroUnit& unit = z->plan.units[(size_t)u];
    if (!z->open[slot]) {
        cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
        CUDA_CHECK(cudaStreamIsCapturing(compute, &capture));
        if (capture != cudaStreamCaptureStatusActive)
            gpu_comm_wait_event(z->comm, z->reduced_ev[slot], "reduce-scatter of a gradient bucket (ZeRO-2/3)");
        else if (z->pending[slot]) CUDA_CHECK(cudaStreamWaitEvent(compute, z->reduced_ev[slot], 0));
        CUDA_CHECK(cudaMemsetAsync(z->buckets[slot], 0, unit.shards.padded_total * sizeof(floatX), compute));
        z->open[slot] = true;
    }
    return unit_view(unit, z->buckets[slot], true);
}

// ZeRO-2/3: unit u's gradient is complete for this micro-batch: reduce-scatter the bucket on the
// communication stream and add this rank's shard of the sum into its gradient shard.
inline void zero_reduce_bucket(ZeroGpu* z, int u, cudaStream_t compute) {
    int slot = zero_slot(*z, u);
    const ZeroUnit& unit = z->plan.units[(size_t)u];
    size_t shard = unit.shards.shard_size;
    zero_follow(z, compute);
    gpu_reduce_scatter_sum(z->comm, z->buckets[slot], z->reduced, shard, NCCL_FLOATX,
                           "reduce-scatter of a gradient bucket (ZeRO-2/3)");
    add_into(z->grads + unit.stored_at, z->reduced, shard, z->comm->stream);
    CUDA_CHECK(cudaEventRecord(z->reduced_ev[slot], z->comm->stream));
    z->open[slot] = false;
    z->pending[slot] = true;
}

// Whether a unit's gradient, complete for this micro-batch, is final for the step's sums: stages 2-3
// on every micro-batch (each bucket is summed as it fills), stages 0-1 on the step's last (`step_ends`;
// the earlier ones only accumulate into the flat gradient). What else waits for a final unit (the
// trainer's dense gradient group: offload, sequence parallelism) runs only then, before zero_grads_done.
inline bool zero_unit_final(const ZeroGpu& z, bool step_ends) { return z.plan.stage >= 2 || step_ends; }

// Unit u's gradient is complete for this micro-batch. Stages 2-3: reduce-scatter its bucket now.
// Stages 0-1: on the step's last micro-batch (`step_ends`; the earlier ones only accumulate into the
// flat gradient), start summing the unit's ranges onto the ranks that own them.
inline void zero_grads_done(ZeroGpu* z, int u, bool step_ends, cudaStream_t compute) {
    if (z->plan.stage >= 2) {
        zero_reduce_bucket(z, u, compute);
        return;
    }
    if (!step_ends || z->plan.dp->world_size == 1) return;
    zero_follow(z, compute);
    gpu_reduce_to_owners(z->comm, z->grads, NCCL_FLOATX, z->plan.shards, z->flat_buckets[(size_t)u],
                         "reduction of the gradients");
}

// After the backward pass: the host waits until every sum started above is done.
inline void zero_wait_reduction(ZeroGpu* z) {
    for (bool& p : z->pending) p = false;
    gpu_comm_wait(z->comm, "reduction of the gradients");
}

// Stage 0, after the norm: every rank takes the whole summed gradient (its AdamW updates everything;
// a reduce-scatter and this all-gather make an all-reduce). `graphed`: inside the update's graph.
inline void zero_share_gradients(ZeroGpu* z, cudaStream_t compute, bool graphed) {
    if (z->plan.stage != 0 || z->plan.dp->world_size == 1) return;
    zero_follow(z, compute);  // (eager, the host has already waited for the norm; a graph has no such wait)
    gpu_all_gather(z->comm, z->grads, z->plan.shards.shard_size, NCCL_FLOATX, "all-gather of the gradients");
    zero_wait(z, compute, graphed, "all-gather of the gradients");
}

// The parts of the summed gradient this rank adds to the squared norm (llmc/parallel/zero.h's rule: every
// element counted once in the world). Stages 0-1: its shard of the flat array in one piece, or with
// tensor parallelism its owned tensors that this tensor rank counts; stages 2-3: its owned pieces,
// contiguous ones merged.
inline std::vector<std::pair<const floatX*, size_t>> zero_norm_pieces(const ZeroGpu& z) {
    std::vector<std::pair<const floatX*, size_t>> out;
    if (z.plan.stage <= 1) {
        if (z.plan.grid.tp == 1) return {{z.grads + z.plan.shard.begin, z.plan.shard.size()}};
        for (const TensorPiece& p : shard_pieces(z.plan.layout, owned_range(z.plan.shards, z.plan.dp->rank)))
            if (counts_once(z.plan.grid, p.tensor)) out.push_back({z.grads + p.begin, p.end - p.begin});
        return out;
    }
    for (const ZeroPiece& p : zero_owned_pieces(z.plan)) {
        if (!counts_once(z.plan.grid, p.tensor)) continue;
        const floatX* at = z.grads + p.stored;
        if (!out.empty() && out.back().first + out.back().second == at) out.back().second += p.count;
        else out.push_back({at, p.count});
    }
    return out;
}

// AdamW on what this rank updates. Stages 0-1: the range `updated` of the flat arrays (everything,
// or the shard; with more ranks than shards a rank may own none), in one launch. Stages 2-3: every
// owned piece; the weights are in the flat array (`params`, stage 2) or in the weight shard (stage
// 3), gradients, master, m and v in the shards, and each piece's stochastic rounding is seeded by
// its index in the flat array, as the one launch would seed it. `Moment`: float, or uint16_t for
// --optimizer-state bf16's bf16 m and v (llmc/optim/adamw_bf16.cuh: the same launches, its kernels;
// `keys`, the rank's slice's map to the whole model's indexes, keys their moments' rounding).
template <class Moment>
inline void zero_adamw(ZeroGpu* z, floatX* params, float* master, Moment* m, Moment* v, const AdamWStep* step_values,
                       const AdamWParams& a, cudaStream_t compute, const SliceIndexMap* keys = nullptr) {
    constexpr bool bf16 = std::is_same<Moment, uint16_t>::value;
    if (z->plan.stage <= 1) {
        const ShardRange& r = z->plan.updated;
        if (r.size() == 0) return;
        if constexpr (bf16) adamw_bf16_update(params, master, z->grads, m, v, r.begin, r.size(), step_values, a, *keys, compute);
        else adamw_update(params, master, z->grads, m, v, r.begin, r.size(), step_values, a, compute);
        return;
    }
    for (const ZeroPiece& p : zero_owned_pieces(z->plan)) {
        floatX* w = z->plan.stage == 3 ? z->weights + p.stored : params + p.local;
        float* mw = master ? master + p.stored : nullptr;
        bool decays = param_tensor_decays(p.tensor);
        if constexpr (bf16)
            adamw_bf16_update_piece(w, mw, z->grads + p.stored, m + p.stored, v + p.stored, p.count, p.local, decays,
                                    step_values, a, *keys, compute);
        else
            adamw_update_piece(w, mw, z->grads + p.stored, m + p.stored, v + p.stored, p.count, p.local, decays, step_values,
                               a, compute);
    }
}

// After AdamW, every data-parallel rank gets the updated weights it uses. ZeRO-1: the shards of the
// flat array are all-gathered (`graphed`: inside the update's graph, waited for on the device). ZeRO-2:
// every unit's updated shards are all-gathered back into the flat array (packed into a bucket slot,
// gathered, unpacked; `graphed`: the same, waited for on the device). ZeRO-3: the slots' units are stale.
inline void zero_after_update(ZeroGpu* z, floatX* params, cudaStream_t compute, bool graphed) {
    if (z->plan.stage == 1 && z->plan.dp->world_size > 1) {
        zero_follow(z, compute);
        gpu_all_gather(z->comm, params, z->plan.shards.shard_size, NCCL_FLOATX, "all-gather of the parameters");
        zero_wait(z, compute, graphed, "all-gather of the parameters");
        return;
    }
    if (z->plan.stage == 3) {
        for (int& h : z->holds) h = -1;
        return;
    }
    if (z->plan.stage != 2) return;
    const char* what = "all-gather of the updated weights (ZeRO-2)";
    cudaStream_t s = z->comm->stream;
    zero_follow(z, compute);
    for (size_t u = 0; u < z->plan.units.size(); u++) {
        const ZeroUnit& unit = z->plan.units[u];
        floatX* packed = z->buckets[zero_slot(*z, (int)u)];
        ShardRange mine = shard_range(unit.shards, z->plan.dp->rank);
        unit_runs(unit, mine.begin, mine.end, [&](size_t local, size_t at, size_t n) {
            CUDA_CHECK(cudaMemcpyAsync(packed + at, params + local, n * sizeof(floatX), cudaMemcpyDeviceToDevice, s));
        });
        gpu_all_gather(z->comm, packed, unit.shards.shard_size, NCCL_FLOATX, what);
        unit_runs(unit, 0, unit.size, [&](size_t local, size_t at, size_t n) {
            CUDA_CHECK(cudaMemcpyAsync(params + local, packed + at, n * sizeof(floatX), cudaMemcpyDeviceToDevice, s));
        });
    }
    zero_wait(z, compute, graphed, what);
}
