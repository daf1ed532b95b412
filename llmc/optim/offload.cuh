// offload.cuh — ZeRO-Offload's optimizer offload (--offload optimizer): the fp32 master weights and
// AdamW's m and v live in pinned host memory, and the optimizer step runs on the CPU.
//
// What it teaches (Ren et al., "ZeRO-Offload: Democratizing Billion-Scale Model Training", 2021):
// mixed-precision AdamW keeps 16 bytes per parameter, but only 4 of them (bf16 weights and
// gradients) are needed by the forward and backward. The other 12 (fp32 master, m, v) are touched
// once per step, by an update that is memory-bound and element-wise: the CPU can do it. So they move
// to host memory, and each step pays PCIe traffic instead of GPU memory:
//   GPU -> host   2 bytes/param   the bf16 gradient, once the step's gradient is complete
//   CPU           AdamW in fp32 on the master weights (llmc/optim/adamw.h, the CPU trainer's own code;
//                 --optimizer-state bf16: adamw_bf16.h's, m and v resting in bf16 on the host)
//   host -> GPU   2 bytes/param   the updated weights, rounded to bf16
// GPU memory per parameter drops from 16 to 4 bytes (plus activations); host memory gains 18:
// master, m, v (12), the gradient widened to fp32 for adamw.h (4), one bf16 staging array (2) that
// carries the gradient down and the weights back up.
//
// With --optimizer-state bf16 the host's m and v are bf16 (2 + 2 bytes instead of 4 + 4: 14 host bytes per
// parameter, 16 with the delay): the step is the CPU trainer's cpu::adamw_update_bf16, whose rounding of
// m and v draws the random bits adamw_bf16.cuh's kernel draws (adamw_bf16_store, keyed by t and the
// element's index in the flat array: each piece passes its `local` place), so the offloaded bf16 run
// equals the on-device one bit for bit under the emulation, as the fp32 one does.
//
// Same arithmetic as on the GPU: adamw_update (adamw.h) writes the formulas of adamw.cuh's kernel in
// the same order, per tensor with the same decay, and the new master weights are rounded to bf16
// with the same stochastic rounding, seeded by (seed, step, element index). Under the CUDA emulation
// (both compiled by the same host compiler) offloaded and on-device runs are bit-identical
// (test/test_offload.py); on a real GPU nvcc's fused multiply-adds may round the last bit differently.
//
// Streaming the gradient down, bucket by bucket (--offload-bucket-layers K, 1 by default). The GPU
// -> host copy of the whole gradient would otherwise sit between the backward and the CPU step, the
// PCIe link idle during the backward and the GPU idle during the copy. But layer l's gradient is final
// as soon as the backward has passed layer l (on the step's last micro-batch), while the layers below
// are still being computed: so, as ZeRO-Offload does, each bucket of K layers goes down as soon as it
// is final, on a side stream, behind an event recorded on the compute stream:
//   compute stream:  backward layer L-1 | layer L-2 | ...          | layer 0 | embeddings | norm
//   copy stream:        (event) -> copy bucket 0 | copy bucket 1 | ...       | copy ends  |
//   host:                                        waits for each bucket's copy, widens it, then AdamW
// and only the last bucket's copy is left after the backward. The bucket size trades the copy's start
// against its count: one layer per bucket starts earliest and leaves the least behind the backward,
// but issues 12 copies and two events per layer (d12: 13 buckets, 148 copies a step, each a call the
// host makes and the copy engine starts); K = L is one bucket, started only once the backward's layers are
// all done. K = 0 streams nothing: every copy after the backward (the unstreamed offload, which tests
// compare with). The copies land in the one bf16 staging array at the gradient's own offsets, so
// streaming costs no host memory; the events, two per bucket, cost nothing measurable.
//
// Accumulation: the micro-batches' gradients are summed on the GPU (the backward accumulates into the
// gradient buffer), and a bucket goes down only on the step's LAST micro-batch (unit_grads_done's
// `step_ends`): every micro-batch is in what reaches the host (DeepSpeed PR 7967 lost the micro-batches
// after the first by copying per micro-batch into a buffer it then overwrote). With ZeRO-1 on several
// ranks a bucket is final only once its data-parallel sum is, which the host awaits after the backward
// (zero_wait_reduction): there the buckets go down after it, unstreamed.
//
// Delayed parameter update (--offload-delay 1; the ZeRO-Offload paper's one-step "delayed parameter
// update", DPU, which DeepSpeed switches on after a warm-up; here from step 1): the CPU step of step t runs on a host thread while the GPU computes step t+1's
// forward and backward, which therefore use the weights of step t-1:
//     W_{t+1} = W_t - lr * u(g_{t+1}(W_{t-1}))        a staleness of exactly one step
// The step's CPU time hides behind the GPU's instead of adding to it. The order, per optimizer step t:
// wait for step t-1's CPU step, upload its bf16 weights (the GPU has finished step t's backward with
// the older ones), receive step t's gradient, start step t's CPU step and return. Step 1 uploads
// nothing, so steps 1 and 2 both use the initial weights. The weights going up need their own bf16 array
// (2 bytes/param more on the host): the staging array is receiving the next step's gradient meanwhile.
// A checkpoint first waits for the CPU step (its master, m, v are complete) but does not upload: model.bin
// holds the GPU's weights, one step behind the master weights, and a resumed run rounds the master
// weights again to get the pending upload (the rounding is a function of the master weights, the seed and
// the step: the same bits). The run's last step uploads, so the trained weights are never stale.
// Over data-parallel ranks (ZeRO-1/2) each rank uploads its step-late shard at the start of optimizer
// step t, and the all-gather that follows (zero_after_update, as without the delay) shares the shards of
// step t-1: every rank holds the same stale weights. An upload outside an optimizer step (the last
// step, a skipped step) is followed by the same all-gather (train_gpt.cu's flush_offloaded_weights).
//
// ZeRO-0/1/2: each rank offloads what its AdamW updates (zero_owned_pieces: everything, or its
// shard); the updated bf16 pieces are copied back to their places in the flat parameter array and
// ZeRO-1's or ZeRO-2's all-gather shares them as usual. ZeRO-2's gradient is already a shard, packed
// unit by unit and summed over the ranks on every micro-batch: it goes down in one piece after the
// backward (the last reduce-scatter awaited), not streamed.
//
// Hook points (train_gpt.cu): the dense gradient group's part of unit_grads_done (dense_unit_final: a
// bucket starts down) and the optimizer per parameter group (update_offloaded, in place of zero_adamw).
#pragma once

#include <cstdint>
#include <cstring>
#include <thread>
#include <vector>
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/memory/gpu_buffers.h"  // offload_host_bytes_per_param: what offload_allocate allocates
#include "llmc/model/model.h"
#include "llmc/optim/adamw.cuh"
#include "llmc/optim/adamw.h"
#include "llmc/optim/adamw_bf16.h"  // --optimizer-state bf16: the CPU trainer's bf16-moment AdamW
#include "llmc/parallel/sharding.h"   // gradient_bucket: which ranges of the flat array each layer's gradient is
#include "llmc/parallel/zero.h"       // zero_owned_pieces: which parameters this rank updates, where it stores them

struct OffloadBucket {
    std::vector<ShardRange> ranges;    // of the staging array (the gradient's at grad_offset + the same index)
    cudaEvent_t final_ev = nullptr;    // recorded on the compute stream: the bucket's gradient is final
    cudaEvent_t copied_ev = nullptr;   // recorded on the copy stream: it is in the staging array
    bool sent = false;                 // its copy was issued this step
};

struct OptimizerOffload {
    size_t n = 0;                      // the elements this rank updates, as its AdamW state stores them
    std::vector<ZeroPiece> pieces;     // ... each piece's tensor, place in the flat array and in the state
    bool flat = true;                  // ZeRO-0/1: state element i is the flat array's begin + i (ZeRO-2: the
    size_t begin = 0;                  //   shards' packed order, as the pieces say)
    size_t grad_offset = 0;            // the gradient of state element i is grads[grad_offset + i]
    float* master = nullptr;           // pinned host memory, n each
    float* m = nullptr;                // (fp32 moments)
    float* v = nullptr;
    bool bf16_moments = false;         // --optimizer-state bf16: m and v in bf16 instead (m16, v16)
    uint16_t* m16 = nullptr;
    uint16_t* v16 = nullptr;
    float* grads = nullptr;            // the bf16 gradient widened (exact), for adamw.h
    uint16_t* staging = nullptr;       // bf16: the gradient on its way down (and, without the delay, the weights up)
    uint16_t* weights_up = nullptr;    // --offload-delay 1: the bf16 weights on their way up (else = staging)
    // streaming (--offload-bucket-layers)
    int bucket_layers = 0;             // layers per bucket; 0: no streaming
    std::vector<int> bucket_of_unit;   // unit (llmc/parallel/zero.h: 0 the last layer ... L the ends) -> bucket
    std::vector<OffloadBucket> buckets;
    cudaStream_t copy_stream = nullptr;
    int streamed_last_step = 0;        // buckets the last step's backward had sent before the step waited (printed)
    // --offload-delay 1
    bool delay = false;
    std::thread cpu_step;              // step t's CPU step, running while the GPU does step t+1
    bool weights_pending = false;      // weights_up holds a step's weights the GPU does not have yet
};

// The buckets of a model of L layers, K layers each (the last layers first, as the backward finishes
// them; the ends, wte, wpe and lnf, alone, last), cut to [begin, begin + n) of the flat array. ZeRO-1's
// padding past the model rides with the ends. ZeRO-2's shards (not `flat`): one bucket, sent late.
inline void offload_plan_buckets(OptimizerOffload* o, const ParamLayout& layout, int L, int K) {
    o->bucket_layers = o->flat ? K : 0;
    o->bucket_of_unit.assign((size_t)gradient_bucket_count(L), 0);
    if (!o->flat) {
        o->buckets.resize(1);
        o->buckets[0].ranges.push_back({0, o->n});
        return;
    }
    int units = gradient_bucket_count(L), per = K > 0 ? K : L;  // K = 0: buckets of the whole model, sent late
    size_t lo = o->begin, hi = o->begin + o->n;
    for (int u = 0; u < units; u++) {
        int b = u == L ? (L + per - 1) / per : u / per;
        o->bucket_of_unit[(size_t)u] = b;
        if ((size_t)b >= o->buckets.size()) o->buckets.resize((size_t)b + 1);
        for (const ShardRange& r : gradient_bucket(layout, L, u)) {
            size_t a = std::max(lo, r.begin), e = std::min(hi, r.end);
            if (a < e) o->buckets[(size_t)b].ranges.push_back({a - lo, e - lo});
        }
    }
    size_t model_end = layout.offset[NUM_PARAM_TENSORS - 1] + layout.count[NUM_PARAM_TENSORS - 1];
    if (hi > std::max(lo, model_end)) o->buckets.back().ranges.push_back({std::max(lo, model_end) - lo, hi - lo});
}

// The n elements of this rank's AdamW state (zero.plan's owned pieces) in pinned host memory.
// `streamed`: the backward hands each bucket over as it completes (one data-parallel rank; see above).
inline void offload_allocate(OptimizerOffload* o, const Zero& zero, size_t n, const ParamLayout& layout, int L,
                             int bucket_layers, bool streamed, bool delay, bool bf16_moments) {
    o->n = n;
    o->pieces = zero_owned_pieces(zero);
    o->flat = zero.stage <= 1;
    o->begin = o->flat ? zero.updated.begin : 0;
    o->grad_offset = o->begin;  // ZeRO-0/1: the flat gradient from begin; ZeRO-2: the shard array from 0
    o->bf16_moments = bf16_moments;
    float** arrays[] = {&o->master, &o->grads, bf16_moments ? nullptr : &o->m, bf16_moments ? nullptr : &o->v};
    for (float** a : arrays) {
        if (!a) continue;
        CUDA_CHECK(cudaMallocHost((void**)a, n * sizeof(float)));
        memset(*a, 0, n * sizeof(float));
    }
    uint16_t** halves[] = {&o->staging, bf16_moments ? &o->m16 : nullptr, bf16_moments ? &o->v16 : nullptr};
    for (uint16_t** a : halves) {
        if (!a) continue;
        CUDA_CHECK(cudaMallocHost((void**)a, n * sizeof(uint16_t)));
        memset(*a, 0, n * sizeof(uint16_t));
    }
    o->delay = delay;
    o->weights_up = o->staging;
    if (delay) CUDA_CHECK(cudaMallocHost((void**)&o->weights_up, n * sizeof(uint16_t)));
    offload_plan_buckets(o, layout, L, streamed ? bucket_layers : 0);
    CUDA_CHECK(cudaStreamCreateWithFlags(&o->copy_stream, cudaStreamNonBlocking));
    for (OffloadBucket& b : o->buckets) {
        CUDA_CHECK(cudaEventCreateWithFlags(&b.final_ev, cudaEventDisableTiming));
        CUDA_CHECK(cudaEventCreateWithFlags(&b.copied_ev, cudaEventDisableTiming));
    }
}

inline void offload_free(OptimizerOffload* o) {
    if (o->cpu_step.joinable()) o->cpu_step.join();
    void* arrays[] = {o->master, o->m, o->v, o->m16, o->v16, o->grads, o->staging,
                      o->weights_up != o->staging ? o->weights_up : nullptr};
    for (void* a : arrays)
        if (a) CUDA_CHECK(cudaFreeHost(a));
    for (OffloadBucket& b : o->buckets) {
        CUDA_CHECK(cudaEventDestroy(b.final_ev));
        CUDA_CHECK(cudaEventDestroy(b.copied_ev));
    }
    if (o->copy_stream) CUDA_CHECK(cudaStreamDestroy(o->copy_stream));
    o->buckets.clear();
    o->bucket_of_unit.clear();
    *o = OptimizerOffload{};
}

// Bucket b's gradient down to the staging array, on the copy stream once the compute stream is here.
inline void offload_send_bucket(OptimizerOffload* o, OffloadBucket* b, const floatX* grads, cudaStream_t compute) {
    CUDA_CHECK(cudaEventRecord(b->final_ev, compute));
    CUDA_CHECK(cudaStreamWaitEvent(o->copy_stream, b->final_ev, 0));
    for (const ShardRange& r : b->ranges)
        CUDA_CHECK(cudaMemcpyAsync(o->staging + r.begin, grads + o->grad_offset + r.begin, r.size() * sizeof(uint16_t),
                                   cudaMemcpyDeviceToHost, o->copy_stream));
    CUDA_CHECK(cudaEventRecord(b->copied_ev, o->copy_stream));
    b->sent = true;
}

// Hook (unit_grads_done, on the step's last micro-batch): the backward has finished `unit`'s gradient.
// If that closes a bucket (its lowest layer, or the ends), the bucket starts down.
inline void offload_unit_grads_final(OptimizerOffload* o, int unit, const floatX* grads, cudaStream_t compute) {
    if (o->bucket_layers == 0 || o->n == 0) return;
    int b = o->bucket_of_unit[(size_t)unit];
    bool closes = unit + 1 == (int)o->bucket_of_unit.size() || o->bucket_of_unit[(size_t)unit + 1] != b;
    if (closes) offload_send_bucket(o, &o->buckets[(size_t)b], grads, compute);
}

// The step's gradient on the host, in fp32: the buckets not streamed yet go down now; then, bucket by
// bucket in the order they were sent, wait for its copy (only it) and widen it.
inline void offload_receive_gradients(OptimizerOffload* o, const floatX* grads, cudaStream_t compute) {
    o->streamed_last_step = 0;
    for (OffloadBucket& b : o->buckets) {
        if (b.sent) o->streamed_last_step++;
        else offload_send_bucket(o, &b, grads, compute);
    }
    for (OffloadBucket& b : o->buckets) {
        CUDA_CHECK(cudaEventSynchronize(b.copied_ev));
        b.sent = false;
        for (const ShardRange& r : b.ranges) {
            #pragma omp parallel for schedule(static)
            for (size_t k = r.begin; k < r.end; k++) {
                uint32_t bits = (uint32_t)o->staging[k] << 16;  // bf16 -> fp32 is exact
                memcpy(&o->grads[k], &bits, sizeof(float));
            }
        }
    }
}

// The master weights rounded to bf16 for step `step` (as adamw_update8 rounds: the same bits), into
// weights_up: a function of the master weights, the seed and the step, so a resumed run recomputes it.
inline void offload_round_weights(OptimizerOffload* o, int step, uint32_t seed) {
    uint64_t seed_stream = (uint64_t)seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)step << 40);  // as adamw_update8
    for (const ZeroPiece& p : o->pieces) {
        // the random bits of the element's place in the flat array, as the kernel's `index`
        #pragma omp parallel for schedule(static)
        for (size_t k = 0; k < p.count; k++)
            o->weights_up[p.stored + k] = bf16_round_stochastic(o->master[p.stored + k], hash_u32(seed_stream ^ (uint64_t)(p.local + k)));
    }
}

// AdamW on the CPU, piece by piece (a tensor's part; adamw.h, the CPU trainer's own code), then the
// bf16 weights. (ZeRO-1's padding past the model, which the GPU kernel updates as part of the last
// tensor, stays as it is here: its gradient is zero and its master weight 0, so the kernel leaves it 0 too.)
inline void offload_cpu_step(OptimizerOffload* o, const AdamWStep& now, const AdamWParams& a) {
    float clip = cpu::clip_coefficient(now.grad_norm, a.max_norm);
    for (const ZeroPiece& p : o->pieces) {
        size_t k = p.stored;
        float wd = param_tensor_decays(p.tensor) ? a.weight_decay : 0.0f;  // 1 - lr * 0 = 1: the kernel's "no decay"
        if (o->bf16_moments)  // the rounding's key: the element's place in the flat array, as the kernel's
            cpu::adamw_update_bf16(o->master + k, o->grads + k, o->m16 + k, o->v16 + k, p.count, now.lr, a.beta1, a.beta2,
                                   a.eps, wd, now.step, clip, p.local);
        else
            cpu::adamw_update(o->master + k, o->grads + k, o->m + k, o->v + k, p.count, now.lr, a.beta1, a.beta2, a.eps, wd,
                              now.step, clip);
    }
    offload_round_weights(o, now.step, a.seed);
}

// weights_up to the GPU's parameters (the compute stream: after the passes that used the old ones),
// each piece to its place in the flat array (ZeRO-2's all-gather then shares them as usual).
inline void offload_upload_weights(OptimizerOffload* o, floatX* params, cudaStream_t compute) {
    for (const ZeroPiece& p : o->pieces)
        CUDA_CHECK(cudaMemcpyAsync(params + p.local, o->weights_up + p.stored, p.count * sizeof(uint16_t), cudaMemcpyHostToDevice,
                                   compute));
    CUDA_CHECK(cudaStreamSynchronize(compute));  // weights_up is rewritten by the next CPU step
    o->weights_pending = false;
}

// --offload-delay 1: the CPU step running now is done (its master, m, v complete: before a checkpoint
// reads them). No-op without the delay.
inline void offload_wait(OptimizerOffload* o) {
    if (o->cpu_step.joinable()) o->cpu_step.join();
}

// --offload-delay 1: the pending step's weights onto the GPU now (the run's last step, or a step
// skipped as unsound, which starts no CPU step of its own).
inline void offload_flush(OptimizerOffload* o, floatX* params, cudaStream_t compute) {
    offload_wait(o);
    if (o->weights_pending) offload_upload_weights(o, params, compute);
}

// --offload-delay 1, resuming after step `step` (AdamW's t): model.bin held the GPU's weights, a step
// behind; the pending upload is the master weights rounded as that step rounded them.
inline void offload_resume_pending(OptimizerOffload* o, int step, uint32_t seed) {
    if (!o->delay || step == 0 || o->n == 0) return;
    offload_round_weights(o, step, seed);
    o->weights_pending = true;
}

// One AdamW step on the host: gradient down, AdamW on the CPU, weights up; with the delay, the
// previous step's weights up and this step's CPU step started, not awaited.
// `params` is the GPU's flat array, `grads` ZeroGpu's: the flat gradient (ZeRO-0/1) or the shards (ZeRO-2).
inline void offload_adamw(OptimizerOffload* o, floatX* params, const floatX* grads, const AdamWStep& now, const AdamWParams& a,
                          cudaStream_t stream) {
    // The fp32 and fp16 builds compile this too, but refuse --offload at start-up (llmc/run/compatibility.h).
    if (!std::is_same<floatX, __nv_bfloat16>::value) fail("internal: --offload optimizer needs the bf16 build");
    if (o->n == 0) return;
    offload_flush(o, params, stream);  // (the delay: step t-1's weights, now that step t's passes are done)
    offload_receive_gradients(o, grads, stream);
    if (o->delay) {
        o->cpu_step = std::thread([o, now, a] { offload_cpu_step(o, now, a); });
        o->weights_pending = true;
        return;
    }
    offload_cpu_step(o, now, a);
    offload_upload_weights(o, params, stream);
}
