// train_gpt.cu — GPT-2 training on GPUs, in bf16 mixed precision: one GPU, or a grid of them
// (data, tensor, sequence and pipeline parallelism, ZeRO-0 to 3).
//
// The same model, flags, files, initialisation, data order and schedule as train_gpt_cpu.cpp (all in
// llmc/), computed by the kernels in llmc/kernels/. Read it next to the CPU reference: the forward and
// backward passes call the kernels in the same order the CPU code calls its loops.
//
// Precision: parameters, activations and gradients are bf16 (2 bytes: half the memory traffic of
// fp32, and the tensor cores' fast input type); every matmul and reduction accumulates in fp32;
// AdamW keeps m and v in fp32 (or in bf16, stochastically rounded, with --optimizer-state bf16:
// llmc/optim/adamw_bf16.cuh) and, with --master-weights 1, an fp32 copy of the weights, from which the
// bf16 weights are written with stochastic rounding (llmc/optim/adamw.cuh). `make train_gpt_fp32`
// builds the same code with fp32 everywhere, to debug against the CPU reference; `make train_gpt_fp16`
// with fp16, whose narrow range needs dynamic loss scaling (llmc/optim/loss_scaler.h, train_step).
//
// Memory: every buffer comes from one table (llmc/memory/gpu_buffers.h), sized before anything is
// allocated and printed at start; a batch that does not fit fails before training with the largest
// that would. --recompute trades compute for activation memory, exactly: levels 1 and 2 give
// bit-identical results; level 0 runs the MLP's GELU in cuBLASLt's epilogues (llmc/kernels/gelu.cuh).
//
// Determinism: no float atomics anywhere, cuBLASLt algorithms fixed per shape, cuDNN engines
// filtered for determinism, stochastic rounding seeded by (seed, step, index): two runs with the same
// flags are bit-identical, and so is a resumed run.
//
// Many GPUs: `mpirun -np N ./train_gpt` (or srun) runs one copy per GPU on a process grid (llmc/parallel/
// process_grid.h; docs/parallelism.md), as the CPU trainer does: dp data-parallel x tp tensor-parallel
// x pp pipeline ranks. A rank holds a SLICE of the model and runs the passes below on it, in local
// shapes, with one-line hooks where ranks meet: the tensor group's collectives (llmc/parallel/
// tensor_parallel.cuh), the data group's ZeRO (llmc/parallel/zero.cuh: every stage, 0 to 3, its gradient sums
// overlapped with the backward pass on a second CUDA stream), and the pipeline's sends (llmc/parallel/
// pipeline_parallel.cuh), walked by the "Parallelism on a grid" section. One GPU is the grid 1 x 1 x 1
// and plain data parallelism dp x 1 x 1: the same path, whose hooks do nothing where a group has one
// rank. Rank 0 prints, samples and writes the checkpoints' model.bin.
#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/run/checkpoint.h"
#include "llmc/run/cli.h"
#include "llmc/run/compatibility.h"
#include "llmc/parallel/comm_nccl.cuh"
#include "llmc/io/dataloader.h"
#include "llmc/memory/estimate.h"
#include "llmc/parallel/grid_planner.h"
#include "llmc/probes/fault_injection.h"
#include "llmc/probes/trace.h"
#include "llmc/io/formats.h"
#include "llmc/run/generate.h"
#include "llmc/memory/gpu_buffers.h"
#include "llmc/run/hellaswag.h"
#include "llmc/run/metrics.h"
#include "llmc/model/model.h"
#include "llmc/parallel/pipeline_parallel.h"
#include "llmc/run/plan.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/model/recompute.h"
#include "llmc/run/run.h"
#include "llmc/run/sampler.h"
#include "llmc/run/schedule_run.h"
#include "llmc/run/train_loop.h"
#include "llmc/parallel/sharding.h"
#include "llmc/utils.h"
#include "llmc/parallel/zero.h"

#include "llmc/kernels/cuda_common.cuh"
#include "llmc/optim/adamw.cuh"
#include "llmc/optim/adamw_bf16.cuh"
#include "llmc/optim/adafactor.cuh"
#include "llmc/optim/sm3.cuh"
#include "llmc/optim/loss_scaler.h"
#include "llmc/optim/offload.cuh"
#include "llmc/run/cuda_graphs.cuh"
#include "llmc/kernels/attention.cuh"
#include "llmc/kernels/encoder.cuh"
#include "llmc/kernels/fused_classifier.cuh"
#include "llmc/kernels/gelu.cuh"
#include "llmc/kernels/global_norm.cuh"
#include "llmc/probes/gpu_test_hooks.cuh"
#include "llmc/kernels/kv_attention.cuh"
#include "llmc/kernels/layernorm.cuh"
#include "llmc/kernels/matmul.cuh"
#include "llmc/kernels/fp8.cuh"
#include "llmc/memory/stash_precision.cuh"  // --stash-precision fp8
#include "llmc/model/moe_gpu.cuh"
#include "llmc/parallel/expert_parallel.cuh"
#include "llmc/parallel/pipeline_parallel.cuh"
#include "llmc/model/zero_bubble_backward.cuh"
#include "llmc/parallel/pipedream_2bw.cuh"
#include "llmc/parallel/tensor_parallel.cuh"
#include "llmc/parallel/zero.cuh"
#include "llmc/parallel/moe_zero.cuh"
#include "llmc/parallel/grad_compression.cuh"
#include "llmc/probes/grad_compression_probe.h"

// ==============================================================================================
// Host <-> device copies of parameter-like arrays (fp32 on the host, floatX on the device)

static void upload_rounded(floatX* dst, const float* src, size_t n) {
    if constexpr (FLOATX_IS_FP32) {
        CUDA_CHECK(cudaMemcpy(dst, src, n * sizeof(float), cudaMemcpyHostToDevice));
    } else {
        std::vector<uint16_t> half(n);
        for (size_t i = 0; i < n; i++)
            half[i] = FLOATX_IS_FP16 ? __half_as_ushort(__float2half_rn(src[i])) : float_to_bf16_round_nearest(src[i]);
        CUDA_CHECK(cudaMemcpy(dst, half.data(), n * 2, cudaMemcpyHostToDevice));
    }
}

static std::vector<float> download_as_float(const floatX* src, size_t n) {
    std::vector<float> out(n);
    if constexpr (FLOATX_IS_FP32) {
        CUDA_CHECK(cudaMemcpy(out.data(), src, n * sizeof(float), cudaMemcpyDeviceToHost));
    } else {
        std::vector<uint16_t> half(n);
        CUDA_CHECK(cudaMemcpy(half.data(), src, n * 2, cudaMemcpyDeviceToHost));
        for (size_t i = 0; i < n; i++) out[i] = FLOATX_IS_FP16 ? __half2float(__ushort_as_half(half[i])) : bf16_to_float(half[i]);
    }
    return out;
}

static std::vector<float> download_floats(const float* src, size_t n) {
    std::vector<float> out(n);
    if (n) CUDA_CHECK(cudaMemcpy(out.data(), src, n * sizeof(float), cudaMemcpyDeviceToHost));
    return out;
}

// ==============================================================================================
// The model on the GPU
//
// On a process grid the model is this rank's SLICE (llmc/parallel/process_grid.h), and the code below is
// written for it, in local shapes, as the CPU trainer's model section is:
//     L   layers of the slice              Ca  attention channels: heads * head size (C / tp)
//     C   channels of the residual stream  Cf  MLP hidden units (4C / tp)
//     NH  heads of the slice               Vp  vocabulary rows of the slice (padded)
//     R   rows of the residual stream this rank holds: B*T, or B*T / tp with sequence parallelism
// which on one rank are the model's own. Where ranks meet there are one-line hooks, each a no-op on
// one rank (plain data parallelism has only the gradient sum, started in unit_grads_done); they are
// listed with the passes' other hooks in "The hooks" below:
//     gather_rows / sum_rows / bias_once   tensor and sequence parallelism (llmc/parallel/tensor_parallel.cuh)
//     unit_weights / release_unit_weights  ZeRO-3: a unit's weights all-gathered, and let go (llmc/parallel/zero.cuh)
//     unit_grads / unit_grads_done         ZeRO-2/3: a unit's gradient bucket, reduce-scattered when done;
//                                          ZeRO-0/1: its part of the flat gradient, summed on the last micro-batch
// and a pipeline stage without the embedding or the head skips them: its input arrives in the
// residual stream's layer 0, its output gradient in dresidual (llmc/parallel/pipeline_parallel.cuh).

struct GPT2 {
    GPT2Config config;
    ModelSlice slice;                   // the part of the model this rank holds: all of it on one rank
    ParamLayout layout;                 // the slice's flat arrays (on one rank, the model's layout)
    GPURunShape shape;                  // what the buffers were sized for
    std::vector<BufferSpec> table;   // ... and the sizes
    void* buf[GB_COUNT] = {};
    ParamTensors<floatX> p, g;          // each tensor inside params / grads (the flat arrays of ZeRO-0..2)
    int B = 0, T = 0;
    int slot = 0, slots = 1;            // which micro-batch's activations the passes use, of how many (pipelines)
    int stash = -1;                     // ZB-H1: the stash B fills and W reads; -1: the whole backward at once
    int chunk = 0;                      // interleaved 1F1B: the model chunk the passes run (pass_layers), its slot's layers
    cudaStream_t stream = nullptr;
    MatmulContext matmul;
    Fp8Matmuls fp8;                     // --precision fp8: the linear layers' matmuls in fp8 (llmc/kernels/fp8.cuh)
    AttentionContext attention;
    // host side of a micro-batch, in pinned memory so the copies are true DMA
    int* host_inputs = nullptr;
    int* host_targets = nullptr;
    int* host_buckets = nullptr;
    float* host_losses = nullptr;
    std::vector<int> bucket_count;
    std::vector<int> buckets;           // per slot: the number of the encoder backward's token buckets
    TensorParallelGpu tp;               // degree 1 on one rank: every tensor-parallel hook is a no-op
    OptimizerOffload offload;           // --offload optimizer: master, m, v on the host (llmc/optim/offload.cuh)
    ZeroGpu zero;                       // the data group's ZeRO, stages 0-3 (llmc/parallel/zero.cuh); one rank: nothing to send
    GradCompressionGpu compression;     // --grad-compression powersgd: the sum compressed (llmc/parallel/grad_compression.cuh)
    LossScaler scaler;                  // fp16: dynamic loss scaling (llmc/optim/loss_scaler.h); bf16, fp32: S = 1 always
    StepGraphs graphs;                  // --cuda-graphs: the step's captured graphs (llmc/run/cuda_graphs.cuh)
    bool pipelined = false;             // a pipeline: the ends' gradients wait for the tied embedding's
    MoEGpu moe;                         // --moe-experts: the MoE table and blocks, one GPU (llmc/model/moe_gpu.cuh)
    ExpertParallelGpu ep;               // --expert-parallel: the experts on their owners (llmc/parallel/expert_parallel.cuh)
    MoEZeroGpu moe_zero;                // ... over data-parallel GPUs: its sum, ZeRO-1/2's shard (llmc/parallel/moe_zero.cuh)
    PipeDream2BWGpu versions;           // --pipeline-schedule 2bw: W(t-1) beside params' W(t) (llmc/parallel/pipedream_2bw.cuh)
    std::vector<ParamBlock> blocks;     // --optimizer adafactor | sm3: the matrices and vectors it keeps statistics of (optimizer_state.h)
    size_t memory_total = 0, memory_used_before = 0;  // the device's, measured just before allocation
};

template <class T> static T* B_(GPT2* m, GPUBuffer b) { return (T*)m->buf[b]; }

// The current micro-batch's part of a row: the row itself, or in a pipeline (which keeps the
// activations of several micro-batches) the slot's part of the rows that have one per micro-batch.
template <class T> static T* A_(GPT2* m, GPUBuffer b) {
    if (m->slot == 0 || !gpu_buffer_per_micro_batch(b)) return B_<T>(m, b);
    return (T*)((char*)m->buf[b] + (size_t)m->slot * (m->table[b].bytes() / m->slots));
}

// The shape of one layer's slice of a stacked activation: local layer l of the slice, in a slot that
// holds the layers of the chunk being run (interleaved 1F1B: chunk c's slot layer 0 is local layer
// c * L/v; every other schedule has one chunk, and slot layer l is local layer l).
static size_t slot_layer(GPT2* m, int l) { return (size_t)(l - pass_layers(m->slice, m->chunk).first); }
static floatX* layer_x(GPT2* m, GPUBuffer b, int l, size_t per_layer) { return A_<floatX>(m, b) + slot_layer(m, l) * per_layer; }
static float* layer_f(GPT2* m, GPUBuffer b, int l, size_t per_layer) { return A_<float>(m, b) + slot_layer(m, l) * per_layer; }

// A stashed activation of layer l (ln1, ln2, qkv, atty, att, fch, fch_gelu) where the passes compute and
// read it: its row, or with --stash-precision fp8 the one layer in the build's type that the forward
// computes into and the backward dequantizes into (llmc/memory/stash_precision.cuh).
static int stash_index(GPUBuffer b) {
    for (int i = 0; i < GPU_STASHED; i++)
        if (GPU_STASH_ROWS[i] == b) return i;
    return -1;
}
static floatX* kept_x(GPT2* m, GPUBuffer b, int l, size_t per_layer) {
    if (!m->shape.fp8_stash) return layer_x(m, b, l, per_layer);
    return B_<floatX>(m, GB_STASH_WORK) + gpu_stash_work_offset(m->shape, stash_index(b));
}
// --stash-precision fp8: layer l's stashed tensors, kept in e4m3 once the forward is done with them
// (keep) or back in the build's type before the backward reads them (restore).
static void stash_layer(GPT2* m, int l, bool keep) {
    if (!m->shape.fp8_stash) return;
    for (int i = 0; i < GPU_STASHED; i++) {
        size_t n = gpu_stash_layer_values(m->shape, i);
        StashedTensor t{kept_x(m, GPU_STASH_ROWS[i], l, n), A_<uint8_t>(m, GPU_STASH_ROWS[i]) + slot_layer(m, l) * n,
                        A_<unsigned int>(m, GB_STASH_AMAX) + slot_layer(m, l) * GPU_STASHED + i, n};
        if (keep) stash_fp8_keep(t, m->stream);
        else stash_fp8_restore(t, m->stream);
    }
}

// Fails, before anything is allocated, if the buffers of `shape` do not fit in the GPU's free
// memory, saying which micro-batch would.
static void fail_unless_fits(const GPURunShape& shape) {
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    size_t need = gpu_buffer_total(gpu_buffer_table(shape));
    if (need + GPU_MEMORY_MARGIN_BYTES <= free_bytes) return;
    int fits = largest_batch_that_fits(shape, free_bytes);
    std::string advice = fits > 0 ? strprintf("the largest micro-batch that fits is --batch-size %d (use "
                                              "--total-batch-tokens to keep the tokens per step)", fits)
                                  : std::string("not even --batch-size 1 fits");
    if (shape.recompute < 2) advice += "; --recompute 2 needs less memory";
    fail("B=%d, T=%d needs %s of GPU memory (+%s margin), but only %s of %s is free: %s", shape.B, shape.T,
         format_bytes((double)need).c_str(), format_bytes((double)GPU_MEMORY_MARGIN_BYTES).c_str(),
         format_bytes((double)free_bytes).c_str(), format_bytes((double)total_bytes).c_str(), advice.c_str());
}

// Allocates every buffer of the table, after checking the total fits.
static void gpt2_allocate(GPT2* m) {
    fail_unless_fits(m->shape);
    size_t free_before = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_before, &m->memory_total));
    m->memory_used_before = m->memory_total - free_before;
    for (int i = 0; i < GB_COUNT; i++) {
        size_t bytes = m->table[i].bytes();
        if (bytes == 0) continue;
        cudaError_t err = cudaMalloc(&m->buf[i], bytes);
        if (err == cudaErrorMemoryAllocation) {
            fail("out of GPU memory allocating '%s' (%s, %s). Lower --batch-size or raise --recompute (see the "
                 "table above)", m->table[i].name, m->table[i].shape.c_str(), format_bytes((double)bytes).c_str());
        }
        CUDA_CHECK(err);
    }
    m->p = point_into(B_<floatX>(m, GB_PARAMS), m->layout);
    m->g = point_into(B_<floatX>(m, GB_GRADS), m->layout);
}

static void gpt2_free(GPT2* m) {
    attention_destroy(&m->attention);
    matmul_destroy(&m->matmul);
    tp_gpu_destroy(&m->tp);
    zero_gpu_destroy(&m->zero);
    moe_zero_gpu_destroy(&m->moe_zero);
    offload_free(&m->offload);
    graphs_free(&m->graphs);
    for (int i = 0; i < GB_COUNT; i++)
        if (m->buf[i]) CUDA_CHECK(cudaFree(m->buf[i]));
    CUDA_CHECK(cudaFreeHost(m->host_inputs));
    CUDA_CHECK(cudaFreeHost(m->host_targets));
    CUDA_CHECK(cudaFreeHost(m->host_buckets));
    CUDA_CHECK(cudaFreeHost(m->host_losses));
    CUDA_CHECK(cudaStreamDestroy(m->stream));
}

// Copies a micro-batch to the GPU (into the current slot). targets may be null (sampling).
// Synchronous with respect to the host buffers: the next call may overwrite them.
static void gpt2_upload_batch(GPT2* m, const int* inputs, const int* targets) {
    size_t BT = (size_t)m->B * m->T;
    memcpy(m->host_inputs, inputs, BT * sizeof(int));
    CUDA_CHECK(cudaMemcpyAsync(A_<int>(m, GB_INPUTS), m->host_inputs, BT * sizeof(int), cudaMemcpyHostToDevice, m->stream));
    if (targets) {
        memcpy(m->host_targets, targets, BT * sizeof(int));
        CUDA_CHECK(cudaMemcpyAsync(A_<int>(m, GB_TARGETS), m->host_targets, BT * sizeof(int), cudaMemcpyHostToDevice, m->stream));
    }
    if (targets && m->slice.first_stage) {
        // the encoder backward's buckets: positions grouped by token (see encoder.cuh), of this
        // rank's vocabulary rows (all of them on one rank)
        int& U = m->buckets[(size_t)m->slot];
        U = encoder_buckets_build(inputs, (int)BT, m->slice.vocab_real, &m->bucket_count, m->host_buckets, m->slice.vocab_begin);
        CUDA_CHECK(cudaMemcpyAsync(A_<int>(m, GB_ENCODER_BUCKETS), m->host_buckets, (2 * BT + 1 + U) * sizeof(int),
                                   cudaMemcpyHostToDevice, m->stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
}

// ==============================================================================================
// The hooks: where every other technique enters the passes and the step
//
// The core below (gpt2_forward, gpt2_loss, gpt2_backward, finish_gradients, optimizer_step,
// train_step) is the math of one GPU. Each other technique fills one of these named points, chosen
// once from the run's flags (a switch here, the work in the technique's own file); on one GPU with
// the defaults each is the plain operation or nothing.
//   forward, per layer   layer_rows, keep_for_backward  --recompute, --stash-precision fp8, pipeline slots
//                        linear_forward                 bf16, or --precision fp8
//                        mlp_forward                    dense GELU MLP, --moe-experts, --expert-parallel
//   backward, per layer  recall_for_backward, recall_ln1  what layer_rows kept, restored or rebuilt
//                        mlp_backward                   as mlp_forward
//                        linear_backward                bf16, fp8; ZB-H1's deferred weight gradient
//                        (linear_output_grad)           (ZB-H1: dy straight into W's stash)
//   ranks meeting        gather_rows, sum_rows, bias_once  tensor and sequence parallelism
//                        unit_weights, release_unit_weights, unit_grads, unit_grads_done  ZeRO 0-3 only
//   the step             step_begin, step_end           fp16 loss scale, fp8 amax, 2BW versions, MoE statistics
//                        gradient_groups                each group's sum and norm share: ZeRO, PowerSGD, a
//                                                       pipeline's tied embedding, the MoE table, expert parallel
//                        param_groups                   the optimizer per group: AdamW fp32/bf16 moments,
//                                                       Adafactor, SM3, offload; the MoE table's AdamW
// The GELU in fc's matmul epilogue (gelu_fused) is one path across two hooks: linear (fp8 has no such
// epilogue) and what is kept (--recompute 0 keeps GELU's output).

// ---- what a layer keeps for the backward (--recompute, --stash-precision fp8, pipeline slots)

// Where layer l's activations are: its rows in the current slot (pipelines keep several micro-batches),
// through `at` (kept_x: with --stash-precision fp8 the working layer the passes read; layer_x: the rows).
struct LayerRows {
    floatX *residual, *ln1, *qkv, *atty, *residual2, *ln2, *fch, *fch_gelu, *att;
    float *ln1_mean, *ln1_rstd, *ln2_mean, *ln2_rstd, *stats;
};
static LayerRows layer_rows_at(GPT2* m, int l, floatX* (*at)(GPT2*, GPUBuffer, int, size_t)) {
    const ModelSlice& sl = m->slice;
    size_t BT = (size_t)m->B * m->T, R = tp_local_rows(m->tp.host, BT), rc = R * m->config.channels;
    size_t Ca = sl.attn_channels, Cf = sl.fc_channels, heads = (size_t)m->B * sl.heads * m->T;
    bool simple = !m->attention.use_cudnn;  // the simple attention keeps att (B, NH, T, T); cuDNN its stats (B, NH, T)
    LayerRows r;
    r.residual = layer_x(m, GB_RESIDUAL, l, rc);
    r.residual2 = layer_x(m, GB_RESIDUAL2, l, rc);
    r.ln1 = at(m, GB_LN1, l, rc);
    r.ln2 = at(m, GB_LN2, l, rc);
    r.qkv = at(m, GB_QKV, l, BT * 3 * Ca);
    r.atty = at(m, GB_ATTY, l, BT * Ca);
    r.fch = at(m, GB_FCH, l, BT * Cf);
    r.fch_gelu = at(m, GB_FCH_GELU, l, BT * Cf);
    r.att = simple ? at(m, GB_ATT, l, heads * m->T) : nullptr;
    r.stats = simple ? nullptr : layer_f(m, GB_ATT, l, heads);
    r.ln1_mean = layer_f(m, GB_LN1_MEAN, l, R);
    r.ln1_rstd = layer_f(m, GB_LN1_RSTD, l, R);
    r.ln2_mean = layer_f(m, GB_LN2_MEAN, l, R);
    r.ln2_rstd = layer_f(m, GB_LN2_RSTD, l, R);
    return r;
}
// The forward's: what --recompute does not keep goes to a scratch the backward rebuilds it into.
static LayerRows layer_rows(GPT2* m, int l) {
    LayerRows r = layer_rows_at(m, l, kept_x);
    RecomputePlan keep = recompute_plan(m->shape.recompute);  // (llmc/model/recompute.h)
    if (!keep.ln) r.ln1 = r.ln2 = B_<floatX>(m, GB_LN_RECOMPUTE);
    if (!keep.gelu) r.fch_gelu = B_<floatX>(m, GB_GELU_RECOMPUTE);
    return r;
}
// The forward is done with layer l: --stash-precision fp8 keeps its stashed tensors in e4m3.
static void keep_for_backward(GPT2* m, int l) { stash_layer(m, l, true); }

// What --recompute dropped, rebuilt with the forward's own kernels (so, bit-identically).
static void recompute_gelu(GPT2* m, LayerRows* r) {
    if (recompute_plan(m->shape.recompute).gelu) return;
    size_t n = (size_t)m->B * m->T * m->slice.fc_channels;
    r->fch_gelu = B_<floatX>(m, GB_GELU_RECOMPUTE);
    gelu_forward(r->fch_gelu, r->fch, n, m->stream);
}
static floatX* recompute_ln(GPT2* m, floatX* kept, const floatX* inp, const float* mean, const float* rstd, const floatX* w,
                            const floatX* b) {
    if (recompute_plan(m->shape.recompute).ln) return kept;
    int R = (int)tp_local_rows(m->tp.host, (size_t)m->B * m->T);
    floatX* ln = B_<floatX>(m, GB_LN_RECOMPUTE);  // one scratch for ln1 and ln2: ln2 is done with before ln1 is rebuilt
    layernorm_recompute(ln, inp, mean, rstd, w, b, R, m->config.channels, m->stream);
    return ln;
}
// Layer l's activations back for its backward: --stash-precision fp8's in the build's type again, and
// --recompute's GELU and ln2 rebuilt (ln1 later, by recall_ln1: it shares ln2's scratch). ZB-H1's W
// (rows_only) reads the rows as they are.
static LayerRows recall_for_backward(GPT2* m, int l, const ParamTensors<floatX>& w, bool rows_only = false) {
    if (!rows_only) stash_layer(m, l, false);
    LayerRows r = layer_rows_at(m, l, rows_only ? layer_x : kept_x);
    recompute_gelu(m, &r);
    r.ln2 = recompute_ln(m, r.ln2, r.residual2, r.ln2_mean, r.ln2_rstd, w[LN2W], w[LN2B]);
    return r;
}
static floatX* recall_ln1(GPT2* m, const LayerRows& r, const ParamTensors<floatX>& w) {
    return recompute_ln(m, r.ln1, r.residual, r.ln1_mean, r.ln1_rstd, w[LN1W], w[LN1B]);
}

// ---- where ranks meet (see above); without ZeRO-2/3 or tensor parallelism each is a view into the
// flat arrays, or nothing at all

// Tensor and sequence parallelism (llmc/parallel/tensor_parallel.cuh): a (B*T, C) row block gathered
// from the ranks' rows before a matmul that needs all of them (sequence parallelism; else as it is),
// a matmul's partial output summed over the tensor group after it, and a bias that only one tensor
// rank adds to a partial sum. One rank: the input itself, or nothing.
static const floatX* gather_rows(GPT2* m, const floatX* x, const char* what) {
    return tp_all_rows(&m->tp, x, (size_t)m->B * m->T, (size_t)m->config.channels, m->stream, what);
}
static floatX* sum_rows(GPT2* m, floatX* partial, const char* what) {
    return tp_sum_rows(&m->tp, partial, B_<floatX>(m, GB_TP_LOCAL), (size_t)m->B * m->T, (size_t)m->config.channels,
                       m->stream, what);
}
static const floatX* bias_once(GPT2* m, const floatX* bias) { return tp_bias(&m->tp, bias); }
// The rows of the residual stream this rank holds: B*T, or B*T / tp with sequence parallelism.
static int local_rows(GPT2* m) { return (int)tp_local_rows(m->tp.host, (size_t)m->B * m->T); }
// The token and position embeddings; tensor parallelism: each rank its rows of wte's vocabulary.
static void embedding_forward(GPT2* m, floatX* out, const ParamTensors<floatX>& w) {
    const int* tokens = A_<int>(m, GB_INPUTS);
    if (m->tp.host.degree == 1) encoder_forward(out, tokens, w[WTE], w[WPE], m->B, m->T, m->config.channels, m->stream);
    else tp_embedding_forward(&m->tp, out, B_<floatX>(m, GB_SCRATCH_C), tokens, w[WTE], w[WPE], m->slice, m->B, m->T,
                              m->config.channels, m->stream);
}
// The number of the uploaded micro-batch's encoder buckets (gpt2_upload_batch; a pipeline keeps one per slot).
static int encoder_buckets(GPT2* m) { return m->buckets[(size_t)m->slot]; }
// The layers this pass runs: the slice's, or with interleaved 1F1B one model chunk's.
static PassLayers this_pass(GPT2* m) { return pass_layers(m->slice, m->chunk); }

// The weights of one unit (unit_of_layer(L, l), or ends_unit(L): wte, wpe and the final LayerNorm;
// llmc/parallel/zero.h) as the kernels address them; with ZeRO-3 all-gathered just now, the unit `next`
// (or -1) already on its way.
static ParamTensors<floatX> unit_weights(GPT2* m, int unit, int next) {
    if (m->zero.plan.stage == 3) return zero_weights(&m->zero, unit, next);
    return flat_unit_view(B_<floatX>(m, GB_PARAMS), m->layout, m->slice.num_layers, unit);
}
static void release_unit_weights(GPT2* m, int unit) {
    if (m->zero.plan.stage == 3) zero_release(&m->zero, unit, m->stream);
}
// Where the backward pass adds a unit's gradients: the flat array, or with ZeRO-2/3 a bucket.
static ParamTensors<floatX> unit_grads(GPT2* m, int unit) {
    if (m->zero.plan.stage >= 2) return zero_open_bucket(&m->zero, unit, m->stream);
    return flat_unit_view(B_<floatX>(m, GB_GRADS), m->layout, m->slice.num_layers, unit);
}
// The dense gradient group's part when one of its units is final (finish_gradients' groups, below):
// PowerSGD, past its start step, sums the whole gradient itself in finish_gradients, so ZeRO sums
// nothing; otherwise --offload optimizer starts the unit's bucket down to the host
// (llmc/optim/offload.cuh), and sequence parallelism sums its LayerNorm gradients, partial over this
// rank's rows, over the tensor group (llmc/parallel/tensor_parallel.cuh). Returns whether ZeRO sums it.
static bool dense_unit_final(GPT2* m, int unit) {
    if (powersgd_replaces_sum(m->compression.c, (int)m->compression.c.steps_done + 1)) return false;
    offload_unit_grads_final(&m->offload, unit, m->zero.grads, m->stream);
    tp_sum_layernorm_grads(&m->tp, unit_grads(m, unit), (size_t)m->config.channels, m->stream);
    return true;
}
// A unit's gradient is complete for this micro-batch: its sum over the data-parallel ranks starts
// (llmc/parallel/zero.cuh: ZeRO-2/3 on every micro-batch, ZeRO-0/1 on the step's last, `step_ends`).
static void unit_grads_done(GPT2* m, bool step_ends, int unit) {
    if (!zero_unit_final(m->zero, step_ends)) return;  // ZeRO-0/1: the micro-batches accumulate
    if (dense_unit_final(m, unit)) zero_grads_done(&m->zero, unit, step_ends, m->stream);
}
// The LM head is the tied wte: the ends unit's, or on the last stage of a pipeline its copy.
static const floatX* lm_head_weights(GPT2* m, const ParamTensors<floatX>& ends) {
    return m->slice.first_stage ? ends[WTE] : B_<floatX>(m, GB_LENT_WTE);
}
static floatX* lm_head_grads(GPT2* m, const ParamTensors<floatX>& ends) {
    return m->slice.first_stage ? ends[WTE] : B_<floatX>(m, GB_LENT_WTE_GRAD);
}

// ---- the linear layers (qkv, attention projection, fc, fc projection; `tensor`: the weight's
// QKVW, ATTPROJW, FCW or FCPROJW): bf16 through matmul.cuh, or with --precision fp8 through fp8.cuh
// (each layer's three quantized tensors in their slots); in the backward ZB-H1 leaves the weight
// gradient to its W (llmc/model/zero_bubble_backward.cuh).

static int fp8_slot_of(int l, int tensor) {
    Fp8Linear which = tensor == QKVW ? FP8_QKV : tensor == ATTPROJW ? FP8_ATTPROJ : tensor == FCW ? FP8_FC : FP8_FCPROJ;
    return fp8_slot(l, which);
}
static void linear_forward(GPT2* m, int l, int tensor, floatX* out, const floatX* inp, const floatX* w, const floatX* b,
                           int N, int IC, int OC) {
    if (m->fp8.on) fp8_linear_forward(&m->matmul, &m->fp8, fp8_slot_of(l, tensor), out, inp, w, b, N, IC, OC, m->stream);
    else matmul_forward(&m->matmul, out, inp, w, b, N, IC, OC, m->stream);
}
// Whether this backward computes the weight gradients (ZB-H1's B, m->stash >= 0, leaves them to its W).
static bool weight_grads_now(GPT2* m) { return m->stash < 0; }
// Where layer l's linear `tensor` takes its output gradient: `scratch`, or under ZB-H1's B (m->stash)
// the stash its W will read, so that fc's and qkv's dy are computed there at once.
static floatX* linear_output_grad(GPT2* m, int l, int tensor, floatX* scratch) {
    if (m->stash < 0) return scratch;
    const ModelSlice& sl = m->slice;
    return zb_output_grad_slot(B_<floatX>(m, GB_WEIGHT_STASH), m->stash, sl.num_layers, l, (size_t)m->B * m->T,
                               m->config.channels, sl.attn_channels, sl.fc_channels, tensor);
}
static void linear_backward_data(GPT2* m, int l, int tensor, floatX* dinp, const floatX* dout, const floatX* w, int N,
                                 int IC, int OC) {
    if (m->fp8.on) fp8_linear_backward_data(&m->matmul, &m->fp8, fp8_slot_of(l, tensor), dinp, dout, w, N, IC, OC, m->stream);
    else matmul_backward_data(&m->matmul, dinp, dout, w, N, IC, OC, m->stream);
}
static void linear_backward_weight(GPT2* m, int l, int tensor, floatX* dw, const floatX* dout, const floatX* inp, int N,
                                   int IC, int OC) {
    if (m->stash >= 0) zb_keep_output_grad(linear_output_grad(m, l, tensor, nullptr), dout, (size_t)N * OC, m->stream);
    else if (m->fp8.on) fp8_linear_backward_weight(&m->matmul, &m->fp8, fp8_slot_of(l, tensor), dw, dout, inp, N, IC, OC, m->stream);
    else matmul_backward_weight(&m->matmul, dw, dout, inp, N, IC, OC, m->stream);
}
static void linear_backward(GPT2* m, int l, int tensor, floatX* dinp, floatX* dw, const floatX* dout, const floatX* inp,
                            const floatX* w, int N, int IC, int OC) {
    linear_backward_data(m, l, tensor, dinp, dout, w, N, IC, OC);
    linear_backward_weight(m, l, tensor, dw, dout, inp, N, IC, OC);
}

// ---- the MLP block: dense (fc, GELU, fc projection), or an MoE layer's experts (llmc/model/moe_gpu.cuh),
// here or on their owners (--expert-parallel). The dense one's GELU runs in fc's cuBLASLt epilogue
// where gelu_in_matmul_epilogue says (llmc/kernels/gelu.cuh): a fused path that crosses two hooks, as
// it depends on --precision fp8 (linear) and --recompute (what is kept).

static bool gelu_fused(GPT2* m) {
    return gelu_in_matmul_epilogue(recompute_plan(m->shape.recompute).gelu, m->fp8.on, m->slice.fc_channels);
}
static void dense_mlp_forward(GPT2* m, int l, const ParamTensors<floatX>& w, const LayerRows& a, const floatX* x, floatX* out) {
    int BT = m->B * m->T, C = m->config.channels, Cf = m->slice.fc_channels;
    if (gelu_fused(m)) {
        matmul_forward_gelu(&m->matmul, a.fch_gelu, a.fch, x, w[FCW], w[FCB], BT, C, Cf, m->stream);  // fch: the aux
    } else {
        linear_forward(m, l, FCW, a.fch, x, w[FCW], w[FCB], BT, C, Cf);
        gelu_forward(a.fch_gelu, a.fch, (size_t)BT * Cf, m->stream);
    }
    linear_forward(m, l, FCPROJW, out, a.fch_gelu, w[FCPROJW], bias_once(m, w[FCPROJB]), BT, Cf, C);  // tp: partial
}
// dx (overwritten, the MLP's input gradient) from dout; the weights' gradients added to g.
static void dense_mlp_backward(GPT2* m, int l, const ParamTensors<floatX>& w, const ParamTensors<floatX>& g, const LayerRows& a,
                               const floatX* dout, floatX* dx) {
    int BT = m->B * m->T, C = m->config.channels, Cf = m->slice.fc_channels;
    cudaStream_t s = m->stream;
    float* partials = B_<float>(m, GB_REDUCE_PARTIALS);
    floatX* dfch = linear_output_grad(m, l, FCW, B_<floatX>(m, GB_SCRATCH_4C));
    bool fused = gelu_fused(m);  // as the forward chose
    if (fused) {
        // dfch = d(fch): GELU's backward in the epilogue, which also writes fc's bias gradient
        // (overwriting: into a scratch, the partials, free until bias_backward below; added here)
        floatX* dfcb = (floatX*)partials;
        matmul_backward_data_dgelu(&m->matmul, dfch, dfcb, dout, w[FCPROJW], a.fch, BT, Cf, C, s);
        add_into(g[FCB], dfcb, Cf, s);
    } else {
        linear_backward_data(m, l, FCPROJW, dfch, dout, w[FCPROJW], BT, Cf, C);
    }
    linear_backward_weight(m, l, FCPROJW, g[FCPROJW], dout, a.fch_gelu, BT, Cf, C);
    bias_backward(g[FCPROJB], partials, dout, BT, C, s);
    if (!fused) gelu_backward_inplace(dfch, a.fch, (size_t)BT * Cf, s);
    const floatX* x = gather_rows(m, a.ln2, "all-gather before the MLP");
    linear_backward(m, l, FCW, dx, g[FCW], dfch, x, w[FCW], BT, C, Cf);
    if (!fused) bias_backward(g[FCB], partials, dfch, BT, Cf, s);
}
static void mlp_forward(GPT2* m, int l, const ParamTensors<floatX>& w, const LayerRows& a, const floatX* x, floatX* out) {
    if (is_moe_block(m->moe.moe, l)) moe_mlp_forward(&m->moe, &m->ep, &m->matmul, l, w, x, out, m->stream);
    else dense_mlp_forward(m, l, w, a, x, out);
}
static void mlp_backward(GPT2* m, int l, const ParamTensors<floatX>& w, const ParamTensors<floatX>& g, const LayerRows& a,
                         const floatX* dout, floatX* dx) {
    if (is_moe_block(m->moe.moe, l))
        moe_mlp_backward(&m->moe, &m->ep, &m->matmul, l, w, g, a.ln2, dout, dx, B_<float>(m, GB_REDUCE_PARTIALS), m->stream);
    else dense_mlp_backward(m, l, w, g, a, dout, dx);
}

// Forward pass of the uploaded micro-batch, up to the logits (B, T, Vp). A pipeline stage without
// the embedding finds its input in the residual stream's layer 0; one without the head leaves its
// output in layer L.
static void gpt2_forward(GPT2* m) {
    const GPT2Config& c = m->config;
    const ModelSlice& sl = m->slice;
    int L = sl.num_layers, C = c.channels, Ca = sl.attn_channels, NH = sl.heads, Vp = sl.vocab_rows;
    int B = m->B, T = m->T;
    int BT = B * T, R = local_rows(m);
    size_t rc = (size_t)R * C;  // the residual stream's values per layer
    cudaStream_t s = m->stream;
    floatX* scratch = B_<floatX>(m, GB_SCRATCH_C);  // each projection's output, before the residual add
    int ends = ends_unit(L);  // wte, wpe, lnf: the embedding and the head share a unit (llmc/parallel/zero.h)
    PassLayers pass = this_pass(m);
    int first = pass.first, end = pass.first + pass.count;

    if (pass.embeds) {
        ParamTensors<floatX> w = unit_weights(m, ends, unit_of_layer(L, 0));  // ZeRO-3: all-gathered
        embedding_forward(m, layer_x(m, GB_RESIDUAL, first, rc), w);  // tensor parallelism: its vocabulary rows
        release_unit_weights(m, ends);
    }
    for (int l = first; l < end; l++) {
        ParamTensors<floatX> w = unit_weights(m, unit_of_layer(L, l), l + 1 < end ? unit_of_layer(L, l + 1) : -1);
        LayerRows a = layer_rows(m, l);  // where the layer's activations go (--recompute, --stash-precision, pipeline slots)

        // ln1: layer 0 normalises the embeddings (or what the previous stage sent); every later
        // layer's ln1 was fused into the residual add that ended the previous layer (below)
        if (l == first)
            fused_residual_layernorm_forward(nullptr, a.ln1, a.ln1_mean, a.ln1_rstd, a.residual, nullptr, w[LN1W], w[LN1B], R, C, s);
        const floatX* ln1_all = gather_rows(m, a.ln1, "all-gather before the qkv matmul");  // sequence parallelism
        linear_forward(m, l, QKVW, a.qkv, ln1_all, w[QKVW], w[QKVB], BT, C, 3 * Ca);  // bf16, or fp8
        attention_forward(&m->attention, a.atty, a.stats, a.att, a.qkv, B, T, Ca, NH, s);
        linear_forward(m, l, ATTPROJW, scratch, a.atty, w[ATTPROJW], bias_once(m, w[ATTPROJB]), BT, Ca, C);
        floatX* proj = sum_rows(m, scratch, "all-reduce after the attention projection");  // tensor parallelism
        fused_residual_layernorm_forward(a.residual2, a.ln2, a.ln2_mean, a.ln2_rstd, a.residual, proj, w[LN2W], w[LN2B], R, C, s);
        const floatX* ln2_all = gather_rows(m, a.ln2, "all-gather before the MLP");
        mlp_forward(m, l, w, a, ln2_all, scratch);  // dense GELU MLP, MoE, expert parallel
        keep_for_backward(m, l);  // --stash-precision fp8: the layer's last read of its activations is done
        proj = sum_rows(m, scratch, "all-reduce after the MLP");
        // residual[l+1] = residual2 + MLP output, fused with the next LayerNorm (ln1 of l+1, or lnf)
        floatX* next_residual = layer_x(m, GB_RESIDUAL, l + 1, rc);
        if (l + 1 < end) {
            ParamTensors<floatX> next = unit_weights(m, unit_of_layer(L, l + 1), -1);  // (ZeRO-3: prefetched)
            LayerRows n = layer_rows(m, l + 1);
            fused_residual_layernorm_forward(next_residual, n.ln1, n.ln1_mean, n.ln1_rstd, a.residual2, proj, next[LN1W],
                                             next[LN1B], R, C, s);
        } else if (pass.head) {
            ParamTensors<floatX> e = unit_weights(m, ends, -1);
            fused_residual_layernorm_forward(next_residual, A_<floatX>(m, GB_LNF), A_<float>(m, GB_LNF_MEAN),
                                             A_<float>(m, GB_LNF_RSTD), a.residual2, proj, e[LNFW], e[LNFB], R, C, s);
        } else {
            residual_forward(next_residual, a.residual2, proj, rc, s);  // the next stage normalises it
        }
        release_unit_weights(m, unit_of_layer(L, l));
    }
    if (!pass.head) return;  // the last layer's output goes to the next stage

    ParamTensors<floatX> e = unit_weights(m, ends, -1);
    if (pass.count == 0) {
        fused_residual_layernorm_forward(nullptr, A_<floatX>(m, GB_LNF), A_<float>(m, GB_LNF_MEAN), A_<float>(m, GB_LNF_RSTD),
                                         layer_x(m, GB_RESIDUAL, first, rc), nullptr, e[LNFW], e[LNFB], R, C, s);
    }
    const floatX* lnf_all = gather_rows(m, A_<floatX>(m, GB_LNF), "all-gather before the LM head");
    matmul_forward(&m->matmul, A_<floatX>(m, GB_LOGITS), lnf_all, lm_head_weights(m, e), nullptr, BT, C, Vp, s);  // tied
    release_unit_weights(m, ends);
}

// fp16's loss scale S in device memory, where the loss kernel reads it (GB_STEP_VALUES, llmc/kernels/
// scratch_sizes.h): S changes when a step overflows, so a captured graph (--cuda-graphs) must not bake it
// in. The host writes it before each step's passes (upload_loss_scale).
static float* loss_scale_on_gpu(GPT2* m) { return (float*)((char*)m->buf[GB_STEP_VALUES] + GPU_STEP_LOSS_SCALE_AT); }
static void upload_loss_scale(GPT2* m) {
    CUDA_CHECK(cudaMemcpyAsync(loss_scale_on_gpu(m), &m->scaler.scale, sizeof(float), cudaMemcpyHostToDevice, m->stream));
}

// Loss of the forward just run (the last stage's), per token into GB_LOSSES, and the mean returned
// (summed on the host in double, as the CPU does). With write_grad, the logits become
// d(loss)/d(logits) * dloss (times fp16's S), in place: the first step of gpt2_backward, fused into the
// loss's kernel. With tensor parallelism every tensor rank of the last stage takes part (its logits are
// its rows).
static void gpt2_loss_kernels(GPT2* m, float dloss, bool write_grad) {
    const GPT2Config& c = m->config;
    int BT = m->B * m->T;
    if (m->tp.host.degree == 1) {
        fused_classifier(A_<floatX>(m, GB_LOGITS), A_<float>(m, GB_LOSSES), A_<int>(m, GB_TARGETS), dloss, BT, c.vocab_size,
                         c.padded_vocab_size, write_grad, m->stream, FLOATX_IS_FP16 ? loss_scale_on_gpu(m) : nullptr);
    } else {  // (tensor parallelism is never graphed: S by value)
        tp_classifier(&m->tp, A_<floatX>(m, GB_LOGITS), A_<float>(m, GB_LOSSES), A_<int>(m, GB_TARGETS),
                      dloss * m->scaler.scale, BT, m->slice, write_grad, m->stream);
    }
}

// A micro-batch's mean loss from its per-token losses, summed in double as the CPU does.
static float mean_loss(const float* losses, int BT) {
    double total = 0.0;
    for (int i = 0; i < BT; i++) total += losses[i];
    return (float)(total / BT);
}

// The mean of the losses gpt2_loss_kernels wrote.
static float gpt2_read_loss(GPT2* m) {
    int BT = m->B * m->T;
    CUDA_CHECK(cudaMemcpyAsync(m->host_losses, A_<float>(m, GB_LOSSES), BT * sizeof(float), cudaMemcpyDeviceToHost, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    return mean_loss(m->host_losses, BT);
}

static float gpt2_loss(GPT2* m, float dloss, bool write_grad) {
    gpt2_loss_kernels(m, dloss, write_grad);
    return gpt2_read_loss(m);
}

// Backward pass of the last forward + gpt2_loss(write_grad). Gradients are ADDED to GB_GRADS (or
// ZeRO-2/3's buckets). Each layer's gradients start their trip across the data-parallel ranks as
// soon as that layer is done (ZeRO-0/1: on the step's last micro-batch, `step_ends`): unit 0 is the
// last layer, unit L the embeddings. A pipeline stage without the head finds d(its output) in
// dresidual; one without the embedding leaves d(its input) there, for the previous stage.
static void gpt2_backward(GPT2* m, bool step_ends) {
    const GPT2Config& c = m->config;
    const ModelSlice& sl = m->slice;
    int L = sl.num_layers, C = c.channels, Ca = sl.attn_channels, NH = sl.heads, Vp = sl.vocab_rows;
    int B = m->B, T = m->T;
    int BT = B * T, R = local_rows(m);
    size_t rc = (size_t)R * C;
    cudaStream_t s = m->stream;
    floatX* dresidual = A_<floatX>(m, GB_DRESIDUAL);
    floatX* dbuf_c = B_<floatX>(m, GB_SCRATCH_C);
    float* partials = B_<float>(m, GB_REDUCE_PARTIALS);
    floatX* dlogits = A_<floatX>(m, GB_LOGITS);
    int ends = ends_unit(L);
    bool grads_final = step_ends && weight_grads_now(m);  // ZB-H1's B: its W finishes the block matmuls' gradients
    PassLayers pass = this_pass(m);
    int first = pass.first, end = pass.first + pass.count;

    // classifier (the tied LM head) and final LayerNorm
    if (pass.head) {
        ParamTensors<floatX> e = unit_weights(m, ends, end > first ? unit_of_layer(L, end - 1) : -1), ge = unit_grads(m, ends);
        matmul_backward_data(&m->matmul, dbuf_c, dlogits, lm_head_weights(m, e), BT, C, Vp, s);
        const floatX* lnf_all = gather_rows(m, A_<floatX>(m, GB_LNF), "all-gather before the LM head");
        matmul_backward_weight(&m->matmul, lm_head_grads(m, ge), dlogits, lnf_all, BT, C, Vp, s);
        floatX* dlnf = sum_rows(m, dbuf_c, "all-reduce of the LM head's input gradient");
        CUDA_CHECK(cudaMemsetAsync(dresidual, 0, rc * sizeof(floatX), s));
        layernorm_backward(dresidual, ge[LNFW], ge[LNFB], partials, dlnf, layer_x(m, GB_RESIDUAL, end, rc), e[LNFW],
                           A_<float>(m, GB_LNF_MEAN), A_<float>(m, GB_LNF_RSTD), R, C, s);
        release_unit_weights(m, ends);  // (its gradient bucket stays open until the embedding's backward)
    }

    for (int l = end - 1; l >= first; l--) {
        int u = unit_of_layer(L, l);  // (ZeRO's unit: layer l's tensors)
        ParamTensors<floatX> w = unit_weights(m, u, l > first ? unit_of_layer(L, l - 1) : -1), g = unit_grads(m, u);
        LayerRows a = recall_for_backward(m, l, w);  // --stash-precision fp8 restored, --recompute's rows rebuilt

        // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
        const floatX* dout = gather_rows(m, dresidual, "all-gather of the MLP's output gradient");
        mlp_backward(m, l, w, g, a, dout, dbuf_c);  // dense GELU MLP, MoE, expert parallel: d ln2 into dbuf_c
        floatX* dln2 = sum_rows(m, dbuf_c, "all-reduce of the MLP's input gradient");
        layernorm_backward(dresidual, g[LN2W], g[LN2B], partials, dln2, a.residual2, w[LN2W], a.ln2_mean, a.ln2_rstd, R, C, s);

        // attention: residual2 = residual + attproj(attention(qkv(ln1(residual))))
        dout = gather_rows(m, dresidual, "all-gather of the attention's output gradient");
        linear_backward(m, l, ATTPROJW, dbuf_c, g[ATTPROJW], dout, a.atty, w[ATTPROJW], BT, Ca, C);  // bf16, fp8; ZB-H1 defers dW
        bias_backward(g[ATTPROJB], partials, dout, BT, C, s);
        floatX* dqkv = linear_output_grad(m, l, QKVW, B_<floatX>(m, GB_SCRATCH_3C));
        attention_backward(&m->attention, dqkv, dbuf_c, a.qkv, a.atty, a.stats, a.att, B, T, Ca, NH, s);
        const floatX* ln1_all = gather_rows(m, recall_ln1(m, a, w), "all-gather before the qkv matmul");
        linear_backward(m, l, QKVW, dbuf_c, g[QKVW], dqkv, ln1_all, w[QKVW], BT, C, 3 * Ca);
        bias_backward(g[QKVB], partials, dqkv, BT, 3 * Ca, s);
        floatX* dln1 = sum_rows(m, dbuf_c, "all-reduce of the attention's input gradient");
        layernorm_backward(dresidual, g[LN1W], g[LN1B], partials, dln1, a.residual, w[LN1W], a.ln1_mean, a.ln1_rstd, R, C, s);
        unit_grads_done(m, grads_final, u);  // layer l's gradients are final: ZeRO's sums start
        release_unit_weights(m, u);
    }
    if (!pass.embeds) return;  // dresidual, d(loss)/d(this stage's input), goes to the previous stage

    ParamTensors<floatX> ge = unit_grads(m, ends);
    const floatX* dout = gather_rows(m, dresidual, "all-gather of the embeddings' gradient");
    encoder_backward(ge[WTE], ge[WPE], dout, A_<int>(m, GB_ENCODER_BUCKETS), encoder_buckets(m), B, T, C, s);
    // wte (LM head + embedding), wpe, lnf; in a pipeline only once the tied embedding's gradient has
    // joined wte's (the step does it, below)
    if (!m->pipelined) unit_grads_done(m, step_ends, ends);
}

// ZB-H1's W (llmc/model/zero_bubble_backward.cuh): the block matmuls' weight gradients of the micro-
// batch whose B filled stash m->stash, from its output gradients there and its inputs in slot m->slot
// (rebuilt as B rebuilt them where --recompute dropped them). The step's last W starts ZeRO-0/1's sums.
// (No sequence parallelism here: zero_bubble_problem refuses tensor ranks.)
static void gpt2_backward_weights(GPT2* m, bool step_ends) {
    const ModelSlice& sl = m->slice;
    int L = sl.num_layers, C = m->config.channels, Ca = sl.attn_channels, Cf = sl.fc_channels;
    int BT = m->B * m->T;
    for (int l = L - 1; l >= 0; l--) {
        int u = unit_of_layer(L, l);
        ParamTensors<floatX> w = unit_weights(m, u, -1), g = unit_grads(m, u);
        LayerRows a = recall_for_backward(m, l, w, true);
        matmul_backward_weight(&m->matmul, g[FCPROJW], linear_output_grad(m, l, FCPROJW, nullptr), a.fch_gelu, BT, Cf, C, m->stream);
        matmul_backward_weight(&m->matmul, g[FCW], linear_output_grad(m, l, FCW, nullptr), a.ln2, BT, C, Cf, m->stream);
        matmul_backward_weight(&m->matmul, g[ATTPROJW], linear_output_grad(m, l, ATTPROJW, nullptr), a.atty, BT, Ca, C, m->stream);
        floatX* ln1 = recall_ln1(m, a, w);
        matmul_backward_weight(&m->matmul, g[QKVW], linear_output_grad(m, l, QKVW, nullptr), ln1, BT, C, 3 * Ca, m->stream);
        unit_grads_done(m, step_ends, u);
        release_unit_weights(m, u);
    }
}

// ==============================================================================================
// Parallelism on a grid (docs/parallelism.md; llmc/ holds one file per technique)
//
// `mpirun -np N ./train_gpt --tensor-parallel t --pipeline-parallel p --zero z` runs N ranks on a grid
// of dp = N/(t p) data-parallel x t tensor-parallel x p pipeline ranks, as the CPU trainer does. A
// step, on every rank:
//   1. forward and backward of the step's micro-batches, in the order of the pipeline schedule
//      (without a pipeline: F0 B0 F1 B1 ..., gradient accumulation), receiving activations from the
//      previous stage and gradients from the next; tensor-parallel collectives inside each pass;
//      ZeRO-2/3 reduce-scatter unit by unit, ZeRO-0/1 start on the last micro-batch's units;
//   2. in a pipeline, the tied embedding's gradient joins the first stage's, then the ends' bucket;
//   3. the gradient norm: each rank adds the squares of what it owns, the world adds them up;
//   4. AdamW on what this rank owns, the data-parallel ranks share the result, and the first stage
//      sends the updated tied embedding to the last.
// One rank is the grid 1 x 1 x 1, plain data parallelism dp x 1 x 1: the same code, whose hooks do
// nothing where a group has one rank. Grids beyond data parallelism need MPI (the groups are MPI
// communicators; checkpoints and dumps collect every rank's elements on rank 0).

struct Parallel {
    ProcessGrid grid;
    Comm world;                                // every rank
    GridComms comms;                           // the host groups, when the grid has more than data parallelism
    GpuComm world_gpu;                         // every rank, on the GPU: the step's numbers, barriers
    GpuComm data_gpu, tensor_gpu, pipe_gpu;    // each group on the GPU (beyond data parallelism)
    Comm* data = nullptr;                      // the data-parallel group: the world, or comms.dp
    GpuComm* data_on_gpu = nullptr;            // ... on the GPU: world_gpu, or data_gpu
    PipelineGpu pipe;                          // the pipeline group's sends and receives
    PipelineSchedule schedule = PipelineSchedule::OneFOneB;
    int chunks = 1;                            // interleaved 1F1B: model chunks per stage (--virtual-stages)
    bool groups = false;                       // tensor or pipeline parallelism: groups of their own
    bool model_parallel = false;               // a forward pass needs other ranks (tp, pp or ZeRO-3)
    double predicted_bubble = 0;               // (p-1)/(m+p-1)
    // --pipeline-schedule 2bw, no flush (pipeline_2bw_steps): this step's first forwards ran in the
    // previous step's list / this step's list ends with nothing in flight (main decides, step by step)
    bool pipe_filled = false, pipe_drains = true;
};

// ==============================================================================================
// The step's gradient and update, on any grid (docs/parallelism.md; llmc/parallel/zero.cuh, read it first)
//
// N data-parallel ranks, each on its own slice of every batch, each seeding its backward with
// 1/(tokens of the whole step), so that the step's gradient is the plain SUM over ranks, as in the
// CPU trainer. The sums started during the backward pass (unit_grads_done) are awaited here; the
// norm is added up over the world; AdamW runs on what this rank owns, and the data-parallel ranks
// share the result. One rank is the same path with nothing to send.

// The sum of squares of grads[0, n): GLOBAL_NORM_BLOCKS partial sums on the GPU (a fixed grid, so a
// fixed order), added here in block order, in fp64.
static double read_sum_of_squares(GPT2* m) {  // (--cuda-graphs reads them after the graph ran)
    float* partials = B_<float>(m, GB_NORM_PARTIALS);
    std::vector<float> host(GLOBAL_NORM_BLOCKS);
    CUDA_CHECK(cudaMemcpyAsync(host.data(), partials, GLOBAL_NORM_BLOCKS * sizeof(float), cudaMemcpyDeviceToHost, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    double total = 0.0;
    for (float p : host) total += p;
    return total;
}
static double gradient_sum_of_squares(GPT2* m, const floatX* grads, size_t n) {
    global_norm_partials(B_<float>(m, GB_NORM_PARTIALS), grads, n, m->stream);
    return read_sum_of_squares(m);
}
// A number summed over every rank of the world, in rank order (the same bits on every rank).
static double world_sum(Parallel* par, double x, const char* what) { return gpu_comm_sum(&par->world_gpu, x, what); }

// ---- the step's gradient groups (the hook of finish_gradients): each group of gradients has its own
// sum over the ranks that share it, started in turn; then its share of the norm (it waits for its sum
// and adds the squares of the elements this rank counts: every element counted by one rank of the
// world); then what it does with the summed gradient once the norm is known.
//   the dense gradient   ZeRO 0-3 (llmc/parallel/zero.cuh), PowerSGD in place of its sum
//                        (llmc/parallel/grad_compression.cuh), a pipeline's tied embedding first
//   the MoE table        summed over the data group, ZeRO-1/2's shard counted (llmc/parallel/moe_zero.cuh),
//                        or with --expert-parallel the routers over the data group and the experts
//                        over their replicas (llmc/parallel/expert_parallel.cuh)
struct GradientGroup {
    void (*sum)(GPT2* m, Parallel* par);           // its sums start (null: none before the norm)
    void (*norm_share)(GPT2* m, Parallel* par, double* squares);  // its summed gradient's squares this rank counts, added
    void (*share)(GPT2* m);                        // after the norm (null: nothing)
};

// LLMC_TEST_COMPRESSION_DUMP: this rank's flat gradient, widened to fp32, before or after PowerSGD's sum.
static void compression_dump(GPT2* m, Parallel* par, int step, const char* what) {
    if (!grad_compression_test_dumps()) return;
    grad_compression_test_dump(&par->world, step, what, download_as_float(m->zero.grads, m->layout.total));
}

// In a pipeline, the last stage's LM-head gradient first joins the first stage's wte gradient, and then
// every stage's ends bucket (wte, wpe, lnf: what the stage has of them) is reduced over the
// data-parallel ranks, as the other buckets were during the last backward. PowerSGD, past its start
// step: every rank ends with the whole compressed sum, so the norm needs no all-gather after it.
static void dense_grads_sum(GPT2* m, Parallel* par) {
    const ModelSlice& sl = m->slice;
    if (par->grid.pp > 1) {
        size_t n = (size_t)sl.vocab_rows * m->config.channels;
        pipe_tied_gradient(&par->pipe, sl.first_stage, sl.last_stage, m->g[WTE], B_<floatX>(m, GB_LENT_WTE_GRAD),
                           B_<floatX>(m, GB_TIED_RECEIVED), n, m->stream);
        unit_grads_done(m, true, ends_unit(sl.num_layers));
    }
    int step = (int)++m->compression.c.steps_done;
    if (!powersgd_replaces_sum(m->compression.c, step)) return;
    compression_dump(m, par, step, "local");  // (tests: llmc/probes/grad_compression_probe.h)
    powersgd_sum_gpu(&m->compression, &m->matmul, m->zero.grads, m->stream);
    compression_dump(m, par, step, "sum");
}
static void dense_grads_norm_share(GPT2* m, Parallel*, double* squares) {
    zero_wait_reduction(&m->zero);
    for (const auto& piece : zero_norm_pieces(m->zero)) *squares += gradient_sum_of_squares(m, piece.first, piece.second);
}
static void dense_grads_share(GPT2* m) {  // ZeRO-0: every rank the whole summed gradient (PowerSGD's already is)
    if (!powersgd_replaces_sum(m->compression.c, (int)m->compression.c.steps_done)) zero_share_gradients(&m->zero, m->stream, false);
}
// The MoE table, on the same stream behind the dense sums.
static void moe_grads_sum(GPT2* m, Parallel*) { moe_zero_sum(&m->moe_zero, m->moe.grads, m->stream); }
static void moe_grads_norm_share(GPT2* m, Parallel*, double* squares) {
    auto piece = moe_zero_norm_piece(m->moe_zero, m->moe.grads);
    if (piece.second > 0) *squares += gradient_sum_of_squares(m, piece.first, piece.second);
}
// --expert-parallel: each expert counted once, by expert group 0's ranks; the routers by data rank 0.
static void ep_grads_norm_share(GPT2* m, Parallel* par, double* squares) {
    size_t router = m->moe.layout.count[MOE_ROUTER];
    ep_gpu_sum_gradients(&m->ep, par->data_on_gpu, m->moe.grads, router, m->table[GB_MOE_GRADS].elements - router, m->stream);
    if (par->grid.dp_rank == 0) *squares += gradient_sum_of_squares(m, m->moe.grads, router);
    if (par->grid.dp_rank < m->ep.ranks) *squares += gradient_sum_of_squares(m, m->moe.grads + router, m->moe.layout.total - router);
}
// The dense table, then the MoE table (all null without --moe-experts): a fixed array, so that the
// step chooses them without allocating.
static std::array<GradientGroup, 2> gradient_groups(const GPT2* m) {
    GradientGroup moe{};
    if (m->moe.moe.experts > 0 && m->ep.on) moe = {nullptr, ep_grads_norm_share, nullptr};
    else if (m->moe.moe.experts > 0) moe = {moe_grads_sum, moe_grads_norm_share, nullptr};
    return {GradientGroup{dense_grads_sum, dense_grads_norm_share, dense_grads_share}, moe};
}

// The gradient of the step, summed over everything that shares it; returns the global norm of the
// summed gradient, as one rank would compute it: each group's share of the squares, added over the
// world in rank order, so every rank gets the same bits.
static float finish_gradients(GPT2* m, Parallel* par) {
    TraceSpan span("gradient sums");  // --trace (llmc/probes/trace.h; it returns the norm: the GPU work is done)
    std::array<GradientGroup, 2> groups = gradient_groups(m);
    for (const GradientGroup& g : groups)
        if (g.sum) g.sum(m, par);  // ZeRO's, PowerSGD's, the MoE table's sums
    double squares = 0.0;
    for (const GradientGroup& g : groups)
        if (g.norm_share) g.norm_share(m, par, &squares);
    float norm = (float)std::sqrt(world_sum(par, squares, "sum of the gradient norms"));
    for (const GradientGroup& g : groups)
        if (g.share) g.share(m);  // ZeRO-0: the summed gradient on every rank
    return norm;
}

// --offload-delay 1 (llmc/optim/offload.cuh): the pending step's weights onto the GPU now, outside an
// optimizer step (the run's last step, or a step skipped as unsound), and then shared as an optimizer
// step shares them: with ZeRO-1/2 each data-parallel rank uploaded only its shard, so without the
// all-gather the ranks would go on with different weights. Every rank calls it (the all-gather is
// collective, even for a rank whose shard is empty). Without the delay nothing is pending: a no-op.
static void flush_offloaded_weights(GPT2* m) {
    if (!m->shape.offload_optimizer || !m->offload.delay) return;
    offload_flush(&m->offload, B_<floatX>(m, GB_PARAMS), m->stream);
    zero_after_update(&m->zero, B_<floatX>(m, GB_PARAMS), m->stream, false);
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
}

// A pipeline, after the optimizer step: the first stage's updated wte replaces the last stage's copy.
static void share_tied_weights(GPT2* m, Parallel* par) {
    const ModelSlice& sl = m->slice;
    pipe_tied_weights(&par->pipe, sl.first_stage, sl.last_stage, m->p[WTE], B_<floatX>(m, GB_LENT_WTE),
                      (size_t)sl.vocab_rows * m->config.channels, m->stream);
}

// ---- the optimizer per parameter group (the hook of optimizer_step): the dense table's AdamW (fp32
// or --optimizer-state bf16 moments, llmc/optim/adamw.cuh and adamw_bf16.cuh, through ZeRO's shard),
// or --optimizer adafactor | sm3 (adafactor.cuh, sm3.cuh), or --offload optimizer's AdamW on the host
// (offload.cuh); then the MoE table's AdamW (llmc/model/moe_gpu.cuh). Chosen once from the flags.

// One step's values, for every group's update.
struct OptimizerStep {
    AdamWParams a;
    AdamWStep now;            // the step's values (AdamW's t, bias corrections, clip, 1/S) ...
    AdamWStep* now_on_gpu;    // ... where the kernels read them: never baked into a captured graph
    float* master;            // --master-weights 1: the fp32 copy, or null
    float lr, clip;           // (the factored optimizers' own clip: cpu::clip_coefficient over S)
    int t;                    // AdamW's t: the steps it has taken
    bool graphed;             // --cuda-graphs: the update replays a captured graph
};
// t: AdamW's, the updates applied with this one (llmc/run/step.h's optimizer_t: skipped steps, fp16's
// overflows among them, do not count, as PyTorch's GradScaler skips optimizer.step()).
static OptimizerStep optimizer_step_values(GPT2* m, const TrainOptions& o, int t, float lr, float norm) {
    OptimizerStep u;
    u.t = t;
    u.lr = lr;
    AdamWParams& a = u.a;
    a.beta1 = o.beta1;
    a.beta2 = o.beta2;
    a.eps = o.adam_eps;
    a.weight_decay = o.weight_decay;
    a.max_norm = o.grad_clip;
    a.seed = o.seed;
    a.decay_mask = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        a.tensor_offset[t] = m->layout.offset[t];
        if (param_tensor_decays(t)) a.decay_mask |= 1u << t;
    }
    // fp16: the gradients are S times the true ones: AdamW multiplies by 1/S (exact: S is a power of two)
    u.now = adamw_step_values(a, u.t, lr, norm, 1.0f / m->scaler.scale);
    static_assert(sizeof(AdamWStep) <= GPU_STEP_VALUES_BYTES, "GB_STEP_VALUES must hold AdamWStep");
    u.now_on_gpu = B_<AdamWStep>(m, GB_STEP_VALUES);
    CUDA_CHECK(cudaMemcpyAsync(u.now_on_gpu, &u.now, sizeof(u.now), cudaMemcpyHostToDevice, m->stream));
    u.master = m->shape.master_weights ? B_<float>(m, GB_MASTER) : nullptr;
    u.graphed = m->graphs.replay;
    u.clip = cpu::clip_coefficient(norm, o.grad_clip) / m->scaler.scale;  // (the CPU trainer's; adamw_clip's on the device)
    return u;
}

// The dense table's AdamW on the GPU, over what this rank updates (zero_adamw). --cuda-graphs over
// data-parallel ranks: the update's graph holds ZeRO-0's all-gather of the summed gradient (eager,
// finish_gradients ran it) and ZeRO-1's all-gather of the updated weights, each waited for on the
// device (zero_wait); the host checks NCCL's errors after the replay.
static void update_adamw(GPT2* m, const OptimizerStep& u) {
    floatX* params = B_<floatX>(m, GB_PARAMS);
    graph_run(m->graphs, &m->graphs.update, m->stream, [&] {
        if (u.graphed) zero_share_gradients(&m->zero, m->stream, true);
        if (m->shape.bf16_moments) {  // --optimizer-state bf16 (where: llmc/run/compatibility.h), its own kernels, keyed in the whole model
            SliceIndexMap keys = slice_index_map(m->config, m->slice);
            zero_adamw(&m->zero, params, u.master, B_<uint16_t>(m, GB_ADAM_M), B_<uint16_t>(m, GB_ADAM_V), u.now_on_gpu, u.a,
                       m->stream, &keys);
        } else
            zero_adamw(&m->zero, params, u.master, B_<float>(m, GB_ADAM_M), B_<float>(m, GB_ADAM_V), u.now_on_gpu, u.a, m->stream);
        if (u.graphed) zero_after_update(&m->zero, params, m->stream, true);
    });
}
// --optimizer adafactor | sm3: every replica the whole update (ZeRO-0 only: llmc/run/compatibility.h).
static void update_adafactor(GPT2* m, const OptimizerStep& u) {
    adafactor_update_gpu(B_<floatX>(m, GB_PARAMS), u.master, m->zero.grads, B_<float>(m, GB_OPTIMIZER_STATE),
                         B_<double>(m, GB_OPTIMIZER_SCRATCH), m->blocks, u.lr, u.t, u.a.weight_decay, u.clip,
                         adamw_weight_stream(u.now, u.a), m->stream);
}
static void update_sm3(GPT2* m, const OptimizerStep& u) {
    sm3_update_gpu(B_<floatX>(m, GB_PARAMS), u.master, m->zero.grads, B_<float>(m, GB_OPTIMIZER_STATE),
                   B_<float>(m, GB_OPTIMIZER_SCRATCH), m->blocks, u.lr, u.a.weight_decay, u.clip, adamw_weight_stream(u.now, u.a),
                   m->stream);
}
static void update_offloaded(GPT2* m, const OptimizerStep& u) {
    offload_adamw(&m->offload, B_<floatX>(m, GB_PARAMS), m->zero.grads, u.now, u.a, m->stream);
}
// --moe-experts: its table, or its shard then the all-gather (llmc/parallel/moe_zero.cuh).
static void update_moe_table(GPT2* m, const OptimizerStep& u) {
    ShardRange mine = moe_zero_updated(m->moe_zero);
    moe_gpu_adamw(&m->moe, m->layout.total, mine.begin, mine.end, u.now_on_gpu, u.a, m->stream);
    moe_zero_share_weights(&m->moe_zero, m->moe.params, m->stream);
}
using ParamGroupUpdate = void (*)(GPT2* m, const OptimizerStep& u);
// The dense table's update, then the MoE table's (null without --moe-experts).
static std::array<ParamGroupUpdate, 2> param_groups(const GPT2* m) {
    ParamGroupUpdate dense = m->shape.optimizer == Optimizer::Adafactor ? update_adafactor
                           : m->shape.optimizer == Optimizer::SM3       ? update_sm3
                           : m->shape.offload_optimizer                  ? update_offloaded
                                                                         : update_adamw;
    return {dense, m->moe.moe.experts > 0 ? update_moe_table : nullptr};
}
// After every group's update: the data-parallel ranks share the updated weights (ZeRO-1/2's all-gather;
// graphed, the graph did, and the host checks NCCL's errors), the first pipeline stage sends its wte to
// the last (the tied LM head), and PowerSGD keeps this sound step's error feedback and Q.
static void share_updated_weights(GPT2* m, Parallel* par, const OptimizerStep& u) {
    if (u.graphed) zero_wait_reduction(&m->zero);  // (NCCL's asynchronous errors; nothing is left to wait for)
    else zero_after_update(&m->zero, B_<floatX>(m, GB_PARAMS), m->stream, false);
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    if (par->grid.pp > 1) share_tied_weights(m, par);
    grad_compression_commit(&m->compression.c);
}

// Clipping and the update of every parameter group this rank updates, then the ranks that share
// weights get them. Returns when they are in place on every rank.
static void optimizer_step(GPT2* m, Parallel* par, const TrainOptions& o, int t, float lr, float norm) {
    TraceSpan span("optimizer");  // --trace (llmc/probes/trace.h; it ends with a synchronize)
    OptimizerStep u = optimizer_step_values(m, o, t, lr, norm);  // AdamW's t and the step's values, on the GPU
    for (ParamGroupUpdate update : param_groups(m))
        if (update) update(m, u);  // AdamW fp32/bf16 moments, Adafactor, SM3, offload; MoE table
    share_updated_weights(m, par, u);  // ZeRO's all-gather, the pipeline's tied wte, PowerSGD's commit
}

// Every data-parallel rank must start from the same weights. Each builds them the same way (the same
// file, or the same seeded initialisation), so instead of sending them from one rank the ranks of a
// data group compare a 53-bit hash of theirs: different files behind the same path on different
// nodes fail here, not as replicas that silently drift apart.
static void check_same_weights(GpuComm* data, const std::vector<float>& weights) {
    if (data->host->world_size == 1) return;
    uint64_t h = 0xcbf29ce484222325ull;
    const uint32_t* words = (const uint32_t*)weights.data();
    for (size_t i = 0; i < weights.size(); i++) h = (h ^ words[i]) * 0x100000001b3ull;
    std::vector<double> all = gpu_comm_gather(data, (double)(h >> 11), "comparing the initial weights");
    for (int r = 0; r < data->host->world_size; r++) {
        if (all[r] != all[0]) {
            fail("data-parallel rank %d loaded different initial weights from rank 0's (the model file or checkpoint "
                 "differs between nodes?): every rank must see the same --model and --out-dir", r);
        }
    }
}

// LLMC_TEST_GRAD_INF=<rank>:<step> (llmc/probes/fault_injection.h): an inf in that rank's first
// gradient element, as an fp16 overflow there would leave, put in before the step's last backward
// adds to it (inf + g = inf), so it is there before any sum over ranks. (GB_GRADS: ZeRO-0/1.)
static void inject_gradient_overflow(GPT2* m, Parallel* par, int step) {
    float first = 0.0f;
    inject_grad_inf(&par->world, step, &first);
    if (std::isfinite(first)) return;
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    upload_rounded(B_<floatX>(m, GB_GRADS), &first, 1);
}

// The same for a graphed step (--cuda-graphs, one rank), whose zeroing and backward are one captured
// graph: the graph copies a device value, the poison slot of GB_STEP_VALUES, into the first gradient
// element right after zeroing it, and the host writes that slot before each launch: 0 (which changes
// no bit of a gradient just zeroed) or, at the step LLMC_TEST_GRAD_INF names, inf. Without the
// variable the graph has no such node.
static bool graph_injects_overflow() { return getenv("LLMC_TEST_GRAD_INF") != nullptr; }
static floatX* poison_on_gpu(GPT2* m) { return (floatX*)((char*)m->buf[GB_STEP_VALUES] + GPU_STEP_POISON_AT); }
static void set_graph_poison(GPT2* m, Parallel* par, int step) {
    if (!graph_injects_overflow()) return;
    float first = 0.0f;
    inject_grad_inf(&par->world, step, &first);
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    upload_rounded(poison_on_gpu(m), &first, 1);
}
static void graph_poison_gradient(GPT2* m) {  // (inside the capture)
    if (!graph_injects_overflow()) return;
    CUDA_CHECK(cudaMemcpyAsync(B_<floatX>(m, GB_GRADS), poison_on_gpu(m), sizeof(floatX), cudaMemcpyDeviceToDevice, m->stream));
}

// The GPU's passes for the schedule (llmc/run/schedule_run.h). The pair (micro-batch, chunk) keeps its
// activations in slot m->slot, taken at its first action (pipeline_parallel.h); interleaved: each action
// names the model chunk it runs (pass_layers: which layers), and chunk c > 0 reads the tokens its chunk 0
// kept. ZB-H1: micro-batch k's output gradients wait in stash k mod weight_stashes for its W, and a slot
// lives until that W.
static SchedulePasses gpu_compute_passes(GPT2* m, Parallel* par, DataLoader* train, const RunPlan& plan, int step) {
    PipelineGpu* pipe = &par->pipe;
    int stage = par->grid.pp_rank, mb = plan.accumulation_steps, v = m->slice.chunks, stashes = m->shape.weight_stashes;
    size_t BT = (size_t)m->B * m->T;
    bool zb = par->schedule == PipelineSchedule::ZeroBubbleH1 && par->grid.pp > 1;  // a slot lives until W
    SchedulePasses p;
    p.before_compute = [=](const PipeAction& act) {
        int* tokens = v > 1 ? pipe->tokens.data() + (size_t)act.micro * 2 * BT : nullptr;  // interleaved: inputs, targets
        if (act.op == PipeOp::Forward && act.chunk == 0) {
            if (tokens) std::copy(train->inputs.begin(), train->inputs.end(), tokens);
            if (tokens) std::copy(train->targets.begin(), train->targets.end(), tokens + BT);
            gpt2_upload_batch(m, train->inputs.data(), train->targets.data());
        } else if (act.op == PipeOp::Forward) {  // interleaved: chunk c > 0 of a micro-batch read at its chunk 0
            gpt2_upload_batch(m, tokens, tokens + BT);
        }
        if (act.op == PipeOp::Backward && act.micro == mb - 1 && act.chunk == 0) inject_gradient_overflow(m, par, step);  // tests only
        if (act.op != PipeOp::Weight) pipe_wait_slot(pipe, m->slot);  // the slot's earlier sends are done before it is overwritten
    };
    p.forward = [=](const PipeAction& act, float* micro_loss) {
        gpt2_forward(m);
        if (!pass_layers(m->slice, act.chunk).head) return false;
        // --dump-state (llmc/probes/state_dump.h): the first step's first logits, downloaded before the
        // loss's kernel turns them into their gradient
        std::vector<float> first_logits;
        if (dump_probe.first_step && act.micro == 0) first_logits = download_as_float(A_<floatX>(m, GB_LOGITS), BT * m->slice.vocab_rows);
        // the optimised loss is the mean over all tokens of the step, all ranks together: d/d(one token's
        // loss) = 1/total, and the ranks' gradients simply add up. fp16: times the loss scale S
        // (gpt2_loss_kernels), so every gradient of the backward is S times larger (exactly: a power of
        // two), lifted above fp16's underflow; train_step divides it out again.
        *micro_loss = gpt2_loss(m, 1.0f / (float)plan.total_batch_tokens, true);
        if (!first_logits.empty()) dump_keep_logits(&dump_probe, first_logits.data(), BT, m->slice, *micro_loss);
        return true;
    };
    p.backward = [=](const PipeAction& act) {
        m->stash = stashes > 0 ? act.micro % stashes : -1;  // ZB-H1: B only, dy kept for W
        gpt2_backward(m, act.micro == mb - 1);  // the last micro-batch (of each chunk) also starts the reduction (ZeRO-0/1)
        m->stash = -1;
        PipeAction send;
        if (!zb && !pipe_send_of(act, stage, par->grid.pp, v, &send)) pipe_slot_release(&pipe->slots, act.micro, act.chunk);
    };
    p.weight = [=](const PipeAction& act) {  // ZB-H1's W; on the first stage (no stash) its B was the whole backward
        m->stash = stashes > 0 ? act.micro % stashes : -1;
        if (m->stash >= 0) gpt2_backward_weights(m, act.micro == mb - 1);
        m->stash = -1;
        pipe_slot_release(&pipe->slots, act.micro, act.chunk);  // what W read is free now
    };
    p.compute_done = [=]() {  // the stage's compute time, for the bubble (the compute stream never waits on another stream)
        if (par->grid.pp > 1 || tracer.file) CUDA_CHECK(cudaStreamSynchronize(m->stream));
    };
    p.backward_delay = 2;
    return p;
}

// The slots, the weight versions and the sends and receives between stages: a run's sends and receives
// go together at its end (llmc/parallel/pipeline_parallel.cuh: pipe_flush).
static SchedulePasses gpu_schedule_passes(GPT2* m, Parallel* par, DataLoader* train, const RunPlan& plan, int step) {
    SchedulePasses p = gpu_compute_passes(m, par, train, plan, step);
    PipelineGpu* pipe = &par->pipe;
    int mb = plan.accumulation_steps, v = m->slice.chunks;
    size_t BT = (size_t)m->B * m->T, n = tp_local_rows(m->tp.host, BT) * m->config.channels;  // values crossing a stage boundary
    size_t bytes = n * sizeof(floatX);
    bool zb = par->schedule == PipelineSchedule::ZeroBubbleH1 && par->grid.pp > 1;
    p.begin = [=]() {
        if (!par->pipe_filled)  // (a filled 2BW step's first micro-batches hold their slots since the last step's list)
            pipe_slots_reset(&pipe->slots, m->slots, mb, v);
        if (v > 1) pipe->tokens.resize((size_t)mb * 2 * BT);  // (the same size every step: allocated once)
        // --moe-experts: d(optimised loss)/d(a micro-batch's L_aux + L_z), the step's being their mean over
        // its micro-batches: S / m = (the loss's seed S / tokens) x the micro-batch's tokens
        m->moe.aux_scale = (float)((double)m->scaler.scale / (double)plan.total_batch_tokens * ((double)m->B * m->T));
    };
    p.take_slot = [=](const PipeAction& act) {
        m->slot = pipe_slot(&pipe->slots, act.micro, act.chunk);
        m->chunk = act.chunk;
    };
    p.read_version = [=](bool older) { pipedream_2bw_gpu_read(&m->versions, older, m->stream); };
    p.recv_activation = [=](const PipeAction& act) {  // (received with the rest of its run: pipe_flush)
        pipe_recv_later(pipe, layer_x(m, GB_RESIDUAL, pass_layers(m->slice, act.chunk).first, n), bytes, act.peer, act.tag);
    };
    p.recv_gradient = [=](const PipeAction& act) { pipe_recv_later(pipe, A_<floatX>(m, GB_DRESIDUAL), bytes, act.peer, act.tag); };
    p.send_activation = [=](const PipeAction& act) {
        PassLayers pass = pass_layers(m->slice, act.chunk);
        pipe_send(pipe, layer_x(m, GB_RESIDUAL, pass.first + pass.count, n), bytes, act.peer, act.tag, m->slot, m->stream);
    };
    p.send_gradient = [=](const PipeAction& act) {
        pipe_send(pipe, A_<floatX>(m, GB_DRESIDUAL), bytes, act.peer, act.tag, m->slot, m->stream);
        // the pair is done with its slot: the send leaves at the end of this run, before any compute
        // action writes the slot again (pipe_wait_slot), and a receive in the run writes only layer 0
        if (!zb) pipe_slot_release(&pipe->slots, act.micro, act.chunk);
    };
    p.end_group = [=]() { pipe_flush(pipe, m->stream); };  // the trace's "send/recv": the group issued, its receives waited for
    p.end = [=]() {
        m->chunk = 0;
        if (par->grid.pp > 1) pipe_finish(pipe, m->stream);
    };
    p.group_span = "send/recv";
    p.busy_seconds = &pipe->busy_seconds;
    p.schedule_seconds = &pipe->schedule_seconds;
    return p;
}

// Step `step`'s forward and backward passes on this rank's stage, in the order of the pipeline
// schedule. Returns this stage's mean loss over the step's micro-batches (the last stage's; 0
// elsewhere). The last backward hands the data group its units (ZeRO-0/1).
// (llmc/run/schedule_run.h runs the list, with the passes above.)
static double forward_backward(GPT2* m, Parallel* par, DataLoader* train, const RunPlan& plan, int step) {
    ScheduleStep s{par->schedule, par->grid.pp_rank, par->grid.pp, plan.accumulation_steps, m->slice.chunks, step,
                   par->pipe_filled, par->pipe_drains, par->grid.rank == 0};
    return run_schedule(gpu_schedule_passes(m, par, train, plan, step), s, train);
}

// ==============================================================================================
// Evaluation and samples. On a grid whose forward pass spans several ranks (tensor or pipeline
// parallelism, ZeRO-3) every rank takes part; otherwise rank 0 alone evaluates.

// One forward pass of the full (B, T) through the pipeline, in slot 0. Returns the mean loss on the
// last stage with targets (0 elsewhere, and without targets: sampling reads the logits).
// Interleaved: around the ring of stages once per model chunk (rank p-1's chunk c feeds rank 0's
// chunk c+1), one chunk at a time.
static float pipeline_forward_chunks(GPT2* m, Parallel* par, const int* inputs, const int* targets) {
    const ModelSlice& sl = m->slice;
    int p = par->grid.pp, r = par->grid.pp_rank;
    size_t n = tp_local_rows(m->tp.host, (size_t)m->B * m->T) * m->config.channels, bytes = n * sizeof(floatX);
    m->slot = 0;
    gpt2_upload_batch(m, inputs, targets);
    for (int c = 0; c < sl.chunks; c++) {
        m->chunk = c;
        PassLayers pass = pass_layers(sl, c);
        if (!pass.embeds) pipe_recv(&par->pipe, layer_x(m, GB_RESIDUAL, pass.first, n), bytes, (r + p - 1) % p, 0, m->stream);
        pipe_wait_slot(&par->pipe, 0);
        gpt2_forward(m);
        if (pass.head) {
            m->chunk = 0;
            return targets ? gpt2_loss(m, 0.0f, false) : 0.0f;
        }
        pipe_send(&par->pipe, layer_x(m, GB_RESIDUAL, pass.first + pass.count, n), bytes, (r + 1) % p, 0, 0, m->stream);
        pipe_finish(&par->pipe, m->stream);
    }
    m->chunk = 0;
    return 0.0f;
}

static float pipeline_forward(GPT2* m, Parallel* par, const int* inputs, const int* targets) {
    // --precision fp8: an evaluation leaves the training's delayed scaling as it found it (llmc/kernels/fp8.cuh)
    std::vector<float> fp8_kept = fp8_evaluation_begin(&m->fp8, m->stream);
    float loss = pipeline_forward_chunks(m, par, inputs, targets);
    fp8_evaluation_end(&m->fp8, fp8_kept, m->stream);
    return loss;
}

// ==============================================================================================
// Checkpoints

// --moe-experts: this rank's part of the whole MoE table (all of it, or with --expert-parallel the
// routers and its experts: llmc/parallel/expert_parallel.h), and back: the whole table on rank 0 from
// every rank's part, gathered over its expert group on the host (on other ranks: empty).
static std::vector<float> moe_held_part(GPT2* m, const std::vector<float>& whole) {
    std::vector<float> held(m->moe.layout.total, 0.0f);
    for (const MoETableRun& r : moe_table_runs(moe_layout(m->config, m->moe.moe), m->moe.layout))
        memcpy(held.data() + r.held, whole.data() + r.whole, r.count * sizeof(float));
    return held;
}
static std::vector<float> moe_whole_table(GPT2* m, std::vector<float> held) {
    if (!m->ep.on) return held;
    std::vector<float> whole;
    cpu::ep_gather_table(&m->ep.group_host, m->config, m->moe.moe, held.data(), held.size(), &whole);
    return whole;
}

// model.bin from this rank's weights, when it holds them all: the bf16 weights bit for bit (fp32 in
// the fp32 build; the fp16 weights widened to fp32, exactly, in the fp16 build).
// moe_table: the whole MoE table (moe_whole_table's).
static void write_params_file(GPT2* m, const std::string& path, const std::vector<float>& moe_table) {
    size_t P = m->layout.total;
    if (m->moe.moe.experts > 0) {  // --moe-experts: version 7 (fp32, the MoE table after the dense one), as the CPU trainer
        std::vector<float> params = download_as_float(B_<floatX>(m, GB_PARAMS), P);   // writes it (bf16 widened: exact)
        const std::vector<float>& table = moe_table;
        write_moe_model_file(path, m->config, m->moe.moe, m->moe.shape.top_k, params.data(), table.data());
        return;
    }
    if constexpr (FLOATX_IS_FP32 || FLOATX_IS_FP16) {  // fp16 widened to fp32 (exact): model.bin has no fp16 format
        std::vector<float> params = download_as_float(B_<floatX>(m, GB_PARAMS), P);
        write_model_file(path, m->config, params.data(), false);
    } else {
        std::vector<uint16_t> params(P);
        CUDA_CHECK(cudaMemcpy(params.data(), m->buf[GB_PARAMS], P * 2, cudaMemcpyDeviceToHost));
        write_model_file_bf16(path, m->config, params.data());
    }
}

// The bf16 weights this rank holds, widened, as runs of the model in global coordinates (its slice,
// or at ZeRO-3 its shards; in a pipeline's last stage also its copy of wte): what model.bin and the
// dumps collect, and what lets rank 0 check that every copy of an element is the same.
static void held_weights(GPT2* m, bool with_lent_copy, std::vector<GlobalRun>* runs, std::vector<float>* values) {
    std::vector<float> weights = download_as_float(B_<floatX>(m, GB_PARAMS), m->table[GB_PARAMS].elements);
    for (const StateRun& r : zero_weight_runs(m->zero.plan, slice_runs(m->config, m->slice))) {
        runs->push_back({r.global, r.count});
        values->insert(values->end(), weights.begin() + r.weight_at, weights.begin() + r.weight_at + r.count);
    }
    if (with_lent_copy && m->buf[GB_LENT_WTE]) {  // the last stage's copy of wte must equal the first stage's
        std::vector<float> lent = download_as_float(B_<floatX>(m, GB_LENT_WTE), m->table[GB_LENT_WTE].elements);
        ModelSlice s = m->slice;
        s.first_stage = true;  // where the first stage's wte lives in its slice: local [0, count[WTE])
        for (const SliceRun& r : runs_in_local_range(slice_runs(m->config, s), 0, slice_layout(m->config, s).count[WTE])) {
            runs->push_back({r.global, r.count});
            values->insert(values->end(), lent.begin() + r.local, lent.begin() + r.local + r.count);
        }
    }
}

// The whole model's bf16 weights on rank 0 (widened; exact), collected from every rank's runs.
static std::vector<float> gather_bf16_weights(GPT2* m, Parallel* par, bool with_lent_copy) {
    std::vector<GlobalRun> runs;
    std::vector<float> values, all;
    held_weights(m, with_lent_copy, &runs, &values);
    gather_to_rank0(&par->world, runs, values, &all, param_layout(m->config).total, "collecting the weights");
    return all;
}

// The optimizer's arrays (GB_MASTER, GB_ADAM_M, GB_ADAM_V): on the GPU, or on the host with --offload
// optimizer. A checkpoint holds the same values either way, so either kind of run resumes the other.
static size_t optimizer_elements(const GPT2* m) {
    if (m->shape.optimizer != Optimizer::AdamW) return m->table[GB_MASTER].elements;  // (Adafactor: no m and v)
    return m->shape.offload_optimizer ? m->offload.n : m->table[GB_ADAM_M].elements;
}
static float* host_optimizer_array(GPT2* m, GPUBuffer row) {
    return row == GB_MASTER ? m->offload.master : row == GB_ADAM_M ? m->offload.m : m->offload.v;
}
// --optimizer-state bf16: m and v are bf16 (on the GPU, or on the host with --offload optimizer) and fp32
// in the file, as the CPU trainer's (widened exactly; read back by rounding to nearest, exact for a
// bf16 run's values: bit-exact resume).
static bool bf16_row(const GPT2* m, GPUBuffer row) { return m->shape.bf16_moments && row != GB_MASTER; }
static uint16_t* host_bf16_moment(GPT2* m, GPUBuffer row) { return row == GB_ADAM_M ? m->offload.m16 : m->offload.v16; }
static std::vector<float> read_optimizer_array(GPT2* m, GPUBuffer row) {
    size_t n = optimizer_elements(m);
    bool host = m->shape.offload_optimizer;
    if (host) offload_wait(&m->offload);  // --offload-delay 1: the CPU step still running finishes first
    if (bf16_row(m, row)) {
        std::vector<uint16_t> half(n);
        if (host) memcpy(half.data(), host_bf16_moment(m, row), n * 2);
        else CUDA_CHECK(cudaMemcpy(half.data(), m->buf[row], n * 2, cudaMemcpyDeviceToHost));
        std::vector<float> out(n);
        for (size_t i = 0; i < n; i++) out[i] = bf16_to_float(half[i]);
        return out;
    }
    if (!host) return download_floats(B_<float>(m, row), n);
    const float* h = host_optimizer_array(m, row);
    return std::vector<float>(h, h + n);
}
static void write_optimizer_array(GPT2* m, GPUBuffer row, const std::vector<float>& values) {
    bool host = m->shape.offload_optimizer;
    if (bf16_row(m, row)) {
        std::vector<uint16_t> half(values.size());
        for (size_t i = 0; i < values.size(); i++) half[i] = float_to_bf16_round_nearest(values[i]);
        if (host) memcpy(host_bf16_moment(m, row), half.data(), half.size() * 2);
        else CUDA_CHECK(cudaMemcpy(m->buf[row], half.data(), half.size() * 2, cudaMemcpyHostToDevice));
    } else if (host) memcpy(host_optimizer_array(m, row), values.data(), values.size() * sizeof(float));
    else CUDA_CHECK(cudaMemcpy(m->buf[row], values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice));
}

// --optimizer adafactor's state.bin, as the CPU trainer writes it: the blocks' statistics
// (optimizer_state.h's order), and after them, in the bf16 build, the fp32 master weights (the format's
// room for weights beside a factored state), so a resumed run continues from the same fp32 values.
static void fill_factored_state(GPT2* m, Parallel* par, TrainState* s) {
    s->header.optimizer = (int)m->shape.optimizer;
    s->factored = download_floats(B_<float>(m, GB_OPTIMIZER_STATE), m->table[GB_OPTIMIZER_STATE].elements);
    s->header.optimizer_state_floats = (int64_t)s->factored.size();
    if (!s->header.has_master_weights) return;
    std::vector<float> master = read_optimizer_array(m, GB_MASTER);
    zero_fill_state(s, par->grid, zero_state_runs(m->zero.plan, slice_runs(m->config, m->slice), true), nullptr, nullptr,
                    master.data(), true);
}

// A checkpoint (llmc/run/checkpoint.h: write_checkpoint says which rank writes which file), from the GPU's
// buffers: model.bin the bf16 weights bit for bit (fp32 in the fp32 build); the state files the
// fp32 master weights beside m and v, or without them the bf16 weights widened. Without a rank
// holding every weight, every rank sends its slice to rank 0. On the same grid a resumed run reads
// back exactly these: bit-exact.
static void save_checkpoint(GPT2* m, Parallel* par, const RunPlan& plan, const TrainOptions& o, int step,
                            const DataLoader& train, uint64_t sampler_rng, int updates_skipped) {
    const GPT2Config& cfg = m->config;
    size_t P = param_layout(cfg).total;
    CheckpointParts parts;
    parts.updates_skipped = updates_skipped;
    parts.master_weights = m->shape.master_weights;
    // --moe-experts: the whole table and moments on rank 0 (with --expert-parallel gathered from its expert group)
    std::vector<float> moe_table, moe_m, moe_v;
    if (m->moe.moe.experts > 0) {
        size_t n = m->moe.layout.total, mine = moe_zero_updated(m->moe_zero).size();  // (--zero 1|2: m and v a shard)
        moe_table = moe_whole_table(m, download_as_float(m->moe.params, n));
        moe_m = moe_whole_table(m, moe_zero_whole_moments(m->moe_zero, par->data, download_floats(m->moe.m, mine)));
        moe_v = moe_whole_table(m, moe_zero_whole_moments(m->moe_zero, par->data, download_floats(m->moe.v, mine)));
    }
    parts.write_model_bin = [&](const std::string& path) { write_params_file(m, path, moe_table); };
    parts.fill_state = [&](TrainState* s) {
        if (m->shape.optimizer != Optimizer::AdamW) {  // the CPU trainer's format (docs/formats.md, version 3)
            fill_factored_state(m, par, s);
            return;
        }
        std::vector<float> adam_m = read_optimizer_array(m, GB_ADAM_M), adam_v = read_optimizer_array(m, GB_ADAM_V);
        std::vector<float> weights = m->shape.master_weights ? read_optimizer_array(m, GB_MASTER)
                                                             : download_as_float(B_<floatX>(m, GB_PARAMS), m->table[GB_PARAMS].elements);
        zero_fill_state(s, par->grid, zero_state_runs(m->zero.plan, slice_runs(cfg, m->slice), true), adam_m.data(),
                        adam_v.data(), weights.data(), m->shape.master_weights);
        if (FLOATX_IS_FP16) {  // the loss scaler's state (docs/formats.md; 0 in bf16 and fp32 files)
            s->header.loss_scale = m->scaler.scale;
            s->header.loss_scale_clean_steps = m->scaler.clean_steps;
            s->header.loss_scale_overflows = m->scaler.overflows;
        }
    };
    parts.write_rank_files = [&](const std::string& dir) {
        // --precision fp8: the delayed scaling's histories and scales, the same on every rank (fp8_share_amax): rank 0's
        if (m->fp8.on && par->grid.rank == 0)
            write_fp8_state(dir + "/fp8_state.bin", m->fp8.tensors, m->fp8.history, fp8_download_state(&m->fp8));
        grad_compression_gpu_save(m->compression, dir, step);  // PowerSGD: every data-parallel rank its e and Q
        if (m->versions.on) {  // 2BW: every rank its stage's W(t-1), widened to fp32 (exact) in the CPU trainer's file
            PipeDream2BW host;
            host.on = true;
            host.older = download_as_float(m->versions.older, m->versions.params_n + m->versions.lent_n);
            pipedream_2bw_save(host, dir, par->grid.rank, par->grid.world, step);
        }
        if (m->moe.moe.experts > 0 && par->grid.rank == 0)  // --moe-experts (main refuses it with fp8): the MoE table's m and v
            write_moe_state(dir + "/moe_state.bin", m->moe.moe, m->moe.shape.top_k, (int)Optimizer::AdamW, moe_m.data(), moe_v.data(),
                            moe_m.size());
    };
    parts.assemble_model_bin = [&](const std::string& dir) {
        std::vector<float> all = gather_bf16_weights(m, par, false);
        if (par->grid.rank != 0) return;
        if constexpr (FLOATX_IS_FP32 || FLOATX_IS_FP16) {  // (fp16: widened, exact)
            write_model_file(dir + "/model.bin", cfg, all.data(), false);
        } else {
            std::vector<uint16_t> half(P);
            for (size_t i = 0; i < P; i++) half[i] = float_to_bf16_round_nearest(all[i]);  // exact: they were bf16
            write_model_file_bf16(dir + "/model.bin", cfg, half.data());
        }
    };
    write_checkpoint(par->grid, o.out_dir, step, P, plan, sampler_rng, train.pos, parts,
                     [&](const char* what) { gpu_comm_barrier(&par->world_gpu, what); }, recorded_options(o, plan.steps),
                     o.keep_checkpoints);
}

// Where read_state_runs() puts what it reads: at the runs' state positions.
static std::vector<WantedRun> wanted_state(const std::vector<StateRun>& runs) {
    std::vector<WantedRun> out;
    for (const StateRun& r : runs) out.push_back({r.global, r.count, r.state_at});
    return out;
}

// This rank's weights, master weights and AdamW state, each element at its place (zero_weight_runs,
// zero_state_runs), from the counter-based initialisation (every grid starts from the one-rank
// weights), a model file, or a checkpoint written by any grid (model.bin's bf16 weights, the state
// files' master weights and moments: resharding). Returns the checkpoint's header (step 0 when not
// resuming).
static TrainStateHeader load_state(GPT2* m, const TrainOptions& o, const std::string& resume_dir, bool new_model) {
    const GPT2Config& cfg = m->config;
    std::vector<SliceRun> slice = slice_runs(cfg, m->slice);
    std::vector<float> weights(m->table[GB_PARAMS].elements, 0.0f);  // in GB_PARAMS's order; padding stays zero
    std::vector<StateRun> weight_runs = zero_weight_runs(m->zero.plan, slice);
    MoEGpu& moe = m->moe;
    std::vector<float> moe_table(moe.layout.total, 0.0f);  // --moe-experts: this rank's MoE table (empty for a dense model)
    std::vector<float> moe_whole;                          // ... the file's whole table
    if (new_model) {
        for (const StateRun& r : weight_runs) init_gpt2_params(cfg, o.seed, weights.data() + r.weight_at, r.global, r.global + r.count);
        if (moe.moe.experts > 0) init_moe_params(cfg, moe.moe, moe.layout, o.seed, moe_table.data());
    } else {  // a model file holds the full model: read it whole, keep this rank's runs (main checked its MoE settings)
        GPT2Config file_cfg;
        std::vector<float> full;
        read_model_file(resume_dir.empty() ? o.model : resume_dir + "/model.bin", &file_cfg, &full,
                        moe.moe.experts > 0 ? &moe_whole : nullptr);
        for (const StateRun& r : weight_runs) memcpy(weights.data() + r.weight_at, full.data() + r.global, r.count * sizeof(float));
        if (moe.moe.experts > 0) moe_table = moe_held_part(m, moe_whole);  // (--expert-parallel: its experts only)
    }
    if (moe.moe.experts > 0) {  // its weights, and when resuming its moments (moe_state.bin; no master copy: moe_gpu.cuh)
        upload_rounded(moe.params, moe_table.data(), moe_table.size());
        std::vector<float> moe_m(moe_table.size(), 0.0f), moe_v(moe_table.size(), 0.0f);
        if (!resume_dir.empty()) {  // (the file holds the whole table's: any --expert-parallel degree resumes it)
            std::vector<float> whole_m, whole_v;
            read_moe_state(resume_dir + "/moe_state.bin", moe.moe, moe.shape.top_k, (int)Optimizer::AdamW,
                           moe_layout(cfg, moe.moe).total, &whole_m, &whole_v);
            moe_m = moe_held_part(m, whole_m), moe_v = moe_held_part(m, whole_v);
        }
        ShardRange mine = moe_zero_updated(m->moe_zero);  // (--zero 1|2 on several GPUs: its shard)
        CUDA_CHECK(cudaMemcpy(moe.m, moe_m.data() + mine.begin, mine.size() * sizeof(float), cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(moe.v, moe_v.data() + mine.begin, mine.size() * sizeof(float), cudaMemcpyHostToDevice));
    }
    if (m->zero.plan.stage <= 2) check_same_weights(m->zero.comm, weights);  // (ZeRO-3: each rank its own shards)
    if (moe.moe.experts > 0)  // --moe-experts: the MoE table, whole on every rank (--expert-parallel: the same on its replicas)
        check_same_weights(m->ep.on ? &m->ep.replicas : m->zero.comm, moe_table);
    upload_rounded(B_<floatX>(m, GB_PARAMS), weights.data(), weights.size());

    size_t opt = optimizer_elements(m);
    bool adamw = m->shape.optimizer == Optimizer::AdamW;
    std::vector<float> adam_m(adamw ? opt : 0, 0.0f), adam_v(adamw ? opt : 0, 0.0f), master(opt, 0.0f);
    std::vector<StateRun> state_runs = zero_state_runs(m->zero.plan, slice, false);
    for (const StateRun& r : state_runs)  // the master weights start as the fp32 values loaded
        if (opt > 0) memcpy(master.data() + r.state_at, weights.data() + r.weight_at, r.count * sizeof(float));
    // --optimizer adafactor: its statistics start at 0 (the paper's R_0, C_0, V_0), or the checkpoint's
    std::vector<float> factored(m->table[GB_OPTIMIZER_STATE].elements, 0.0f);
    TrainStateHeader resumed;
    resumed.step = 0;
    if (!resume_dir.empty()) {
        bool master_weights = m->shape.master_weights;
        if (!adamw) read_factored_state(resume_dir, param_layout(cfg).total, m->shape.optimizer, factored.size(), 0, factored.size(),
                                        factored.data(), m->zero.plan.grid.world);
        resumed = read_state_runs(resume_dir, param_layout(cfg).total, wanted_state(state_runs), adamw ? adam_m.data() : nullptr,
                                  adamw ? adam_v.data() : nullptr, master_weights ? master.data() : nullptr);
        if (master_weights && !resumed.has_master_weights && m->slice.first_stage && m->zero.plan.grid.rank == 0) {
            printf("note: the checkpoint has no fp32 master weights; starting them from model.bin's weights\n");
        }
    }
    if (opt > 0) {
        if (adamw) write_optimizer_array(m, GB_ADAM_M, adam_m);
        if (adamw) write_optimizer_array(m, GB_ADAM_V, adam_v);
        if (m->shape.master_weights) write_optimizer_array(m, GB_MASTER, master);
    }
    if (!factored.empty())
        CUDA_CHECK(cudaMemcpy(m->buf[GB_OPTIMIZER_STATE], factored.data(), factored.size() * sizeof(float), cudaMemcpyHostToDevice));
    return resumed;
}

// ==============================================================================================
// One step

// The step's gradient starts from zero: every row that holds gradients, the flat array (ZeRO-2/3's
// buckets are zeroed as each opens), a pipeline's last-stage copy of wte's, the MoE table's.
static const GPUBuffer GRADIENT_ROWS[] = {GB_GRADS, GB_LENT_WTE_GRAD, GB_MOE_GRADS};
static void zero_gradients(GPT2* m) {
    for (GPUBuffer b : GRADIENT_ROWS)
        if (m->buf[b]) CUDA_CHECK(cudaMemsetAsync(m->buf[b], 0, m->table[b].bytes(), m->stream));
}

// --dump-state (llmc/probes/gpu_test_hooks.cuh): after the first step's gradient sum, its first
// logits and loss and its (summed, unclipped) gradient, on rank 0. `reports`: this rank holds the
// loss (the last stage, tensor rank 0 of data-parallel rank 0).
static void dump_first_step(GPT2* m, Parallel* par, bool reports) {
    if (!dump_probe.first_step) return;
    std::vector<float> grads = download_as_float(B_<floatX>(m, GB_GRADS), m->table[GB_GRADS].elements);
    for (float& g : grads) g /= m->scaler.scale;  // fp16: the true gradient (exact); S = 1 otherwise
    dump_collect_first_step(&dump_probe, &par->world, &par->world_gpu, m->zero.plan, m->config, m->slice, (size_t)m->B * m->T,
                            reports, std::move(grads));
    if (m->moe.moe.experts > 0) {  // --moe-experts: the MoE table's gradient after the dense one's (summed: whole on every rank)
        moe_zero_gather_gradient(&m->moe_zero, m->moe.grads, m->stream);  // (--zero 1|2: each rank had its shard)
        std::vector<float> moe = moe_whole_table(m, download_as_float(m->moe.grads, m->moe.layout.total));  // (rank 0: whole)
        dump_probe.state.grads.insert(dump_probe.state.grads.end(), moe.begin(), moe.end());
    }
}

// --precision fp8 over several ranks (llmc/kernels/fp8.cuh): each rank has measured the amax of what it
// quantized: its own micro-batches (data parallelism), its own slice of a split tensor (tensor
// parallelism). Their maximum is the amax of the whole tensor over the whole step's batch, so every
// rank takes it into its histories and all choose the same scales: one scale per tensor of the model,
// as one rank would (fp8.cuh's lesson says which tensors are split, and why a slice's own scale is
// wrong). The two groups' maxima in turn: the maximum over the grid. Exact: a maximum of floats >= 0
// compares their bits as unsigned integers do, which is how amax_now holds them. One rank: nothing.
static void fp8_share_amax(GPT2* m, Parallel* par) {
    if (par->grid.dp == 1 && par->grid.tp == 1) return;
    CUDA_CHECK(cudaStreamSynchronize(m->stream));  // the backward's quantize kernels have written amax_now
    float* amax = (float*)m->fp8.amax_now;
    size_t n = (size_t)m->fp8.tensors;
    if (par->grid.dp > 1) {
        gpu_all_reduce_max(par->data_on_gpu, amax, n, "all-reduce of the fp8 amax");
        gpu_comm_wait(par->data_on_gpu, "all-reduce of the fp8 amax");
    }
    if (par->grid.tp > 1) {  // (never over a pipeline group: each stage's slots are its own layers')
        gpu_all_reduce_max(&par->tensor_gpu, amax, n, "all-reduce of the fp8 amax over the tensor group");
        gpu_comm_wait(&par->tensor_gpu, "all-reduce of the fp8 amax over the tensor group");
    }
}

// The same inside a captured graph (--cuda-graphs, llmc/run/cuda_graphs.cuh), where the host cannot wait:
// the all-reduce is captured on the communication stream, forked from the compute stream after the
// backward and joined back before the histories roll (the same collective, after the same sums).
static void fp8_share_amax_graphed(GPT2* m, Parallel* par) {
    if (par->grid.dp == 1) return;
    zero_follow(&m->zero, m->stream);
    gpu_all_reduce_max(par->data_on_gpu, (float*)m->fp8.amax_now, (size_t)m->fp8.tensors, "all-reduce of the fp8 amax");
    zero_wait(&m->zero, m->stream, true, "all-reduce of the fp8 amax");
}

// Whether step `step`'s update is applied, once its loss and (unscaled) norm are known on every rank.
// fp16's overflow flag is the norm: all-reduced over every rank that holds gradients, so an inf
// anywhere is an inf everywhere, and every rank skips together. A non-finite loss is no overflow
// of the scaled backward (S does not touch the forward): step_is_sound judges it, as in bf16.
static bool step_applies(GPT2* m, const StepResult& r, const TrainOptions& o, int step, BadSteps* bad_steps, bool leader) {
    if (!FLOATX_IS_FP16 || !std::isfinite(r.loss)) return step_is_sound(bad_steps, step, r.loss, r.norm, o.max_bad_steps, leader);
    bool overflow = !std::isfinite(r.norm);
    bool applied = loss_scaler_update(&m->scaler, overflow, step);
    if (overflow && leader)
        printf("step %d: the fp16 gradients overflowed at loss scale %.0f: update skipped, the scale halved to %.0f\n", step,
               (double)r.loss_scale, (double)m->scaler.scale);
    return applied;
}

// The step's hooks before and after its passes, chosen by the run's flags (each a no-op without them):
// fp16's loss scale S where the loss kernel reads it (llmc/optim/loss_scaler.h), and the MoE routing
// statistics restarted (an evaluation's forward between steps added to them); after the passes,
// PipeDream-2BW's weight versions (llmc/parallel/pipedream_2bw.cuh), the MoE statistics over the
// micro-batches and ranks (llmc/run/moe_run.h, as the CPU's) and fp8's amax (llmc/kernels/fp8.cuh).
static void step_begin(GPT2* m, StepResult* r) {
    if (FLOATX_IS_FP16) upload_loss_scale(m);
    r->loss_scale = m->scaler.scale;  // fp16: the S of this step's backward; bf16, fp32: 1
    m->moe.stats = MoEStepStats{};
}
static void step_end(GPT2* m, Parallel* par, const RunPlan& plan) {
    par->pipe_filled = par->schedule == PipelineSchedule::PipeDream2BW && !par->pipe_drains;
    // --pipeline-schedule 2bw: the passes read W(t-2) (and the next step's first forwards W(t-1)); the
    // optimizer updates W(t-1) into W(t)
    pipedream_2bw_gpu_after_passes(&m->versions, m->stream);
    if (m->moe.moe.experts > 0) moe_step_stats(&m->moe.stats, &par->world, plan.accumulation_steps, par->grid.dp);
    if (m->fp8.on) {  // --precision fp8: the step's amax, the same on every rank, rolled into the histories; next scales
        fp8_share_amax(m, par);
        fp8_end_step(&m->fp8, m->stream);
    }
}
// Whether this rank holds the step's loss: the last stage's, one tensor rank of each data-parallel replica.
static bool reports_loss(GPT2* m, Parallel* par) { return m->slice.last_stage && par->grid.tp_rank == 0; }

// Optimizer step `step` (from 1; llmc/run/step.h: the same shape as train_gpt_cpu.cpp's) on every
// rank: the passes of its micro-batches, the gradient sums and norm, and AdamW unless step_is_sound
// finds the step bad.
static StepResult train_step(GPT2* m, Parallel* par, DataLoader* train, const RunPlan& plan, const TrainOptions& o,
                             int step, BadSteps* bad_steps) {
    const ProcessGrid& grid = par->grid;
    StepResult r;
    r.lr = step_learning_rate(plan, o, step);  // (adafactor without --lr: its relative step)
    step_begin(m, &r);  // fp16 loss scale, MoE statistics
    zero_gradients(m);
    double loss = forward_backward(m, par, train, plan, step);
    step_end(m, par, plan);  // 2BW versions, MoE statistics, fp8 amax
    // the mean loss over every token of the step (every replica saw as many tokens, so it is the mean
    // of the replicas' means)
    bool reports = reports_loss(m, par);
    r.loss = world_sum(par, reports ? loss : 0.0, "sum of the losses") / grid.dp;
    // fp16: the norm of the scaled gradient over S is the true gradient's norm, bit for bit (S is a
    // power of two), so clipping compares the true norm with --grad-clip; AdamW divides the gradients
    // by S in the same pass (AdamWStep::grad_scale). bf16, fp32: S = 1.
    r.norm = finish_gradients(m, par) / r.loss_scale;
    dump_first_step(m, par, reports && grid.dp_rank == 0);  // --dump-state (llmc/probes/gpu_test_hooks.cuh)
    r.applied = step_applies(m, r, o, step, bad_steps, grid.rank == 0);
    if (r.applied) optimizer_step(m, par, o, optimizer_t(step, *bad_steps, m->scaler.overflows), r.lr, r.norm);
    else flush_offloaded_weights(m);  // (--offload-delay 1: the pending weights)
    return r;
}

// ---- train_step with --cuda-graphs (llmc/run/cuda_graphs.cuh), on one GPU or data-parallel ranks
// (ZeRO-0/1/2): the same kernels and collectives in the same order, each micro-batch's passes from a
// graph (captured at the run's second step: one graph for a step of one micro-batch, three with
// accumulation), the host's reads of the losses and the norm after the last; optimizer_step replays
// the update's graph.

// What the graphed micro-batches share within a step.
struct GraphedStep {
    // this rank's part of the norm: ZeRO-0/1's shard of the flat gradient, one piece, its partial sums
    // in the last graph; ZeRO-2's owned pieces may be several (a unit's padding between them): each is
    // summed after the graph, as finish_gradients does (the partials buffer holds one piece's)
    std::vector<std::pair<const floatX*, size_t>> pieces;
    bool norm_in_graph = false;
    // the communication stream has work in a micro-batch's graph, which must join it back before the
    // graph ends: ZeRO-2 reduce-scatters every micro-batch's buckets, ZeRO-0/1 sum the last one's
    bool every_micro_batch_sums = false;
    // The traffic counters (comm_nccl.cuh) count at the host's calls, so only while a graph is captured;
    // the main loop takes the capture step's count for every replayed step. The middle micro-batches'
    // graph is captured once but replayed m - 2 times a step: in the capture step each replay after
    // the first adds again what its capture counted (ZeRO-2's reduce-scatters).
    CommCounters middle;
    bool middle_captured = false;
};

// Before the graphed step's first micro-batch: the device values its graphs read, written by the host.
static GraphedStep graphed_step_begin(GPT2* m, Parallel* par, int step, StepResult* r) {
    GraphedStep gs;
    gs.pieces = zero_norm_pieces(m->zero);
    gs.norm_in_graph = gs.pieces.size() == 1;
    gs.every_micro_batch_sums = m->zero.plan.stage >= 2;
    if (FLOATX_IS_FP16) upload_loss_scale(m);  // S in device memory: the graph's loss kernel reads it there
    r->loss_scale = m->scaler.scale;
    set_graph_poison(m, par, step);              // tests only (LLMC_TEST_GRAD_INF)
    // fp8 (llmc/kernels/fp8.cuh): its scales, histories and amax are device memory, read and rolled by
    // kernels, so the graph replays them as they change. Only the calibration of a run's first step is
    // a host-side branch, and that step is always eager.
    if (m->fp8.on && m->fp8.calibrating) fail("internal: --precision fp8's calibration in a graphed step");
    return gs;
}

// One micro-batch's passes, captured into (or replayed from) its graph.
static void graphed_passes(GPT2* m, Parallel* par, const RunPlan& plan, const GraphedStep& gs, bool first, bool last) {
    if (first) {
        zero_gradients(m);
        graph_poison_gradient(m);  // (an inf there stays inf as the later micro-batches add to it)
    }
    gpt2_forward(m);
    gpt2_loss_kernels(m, 1.0f / (float)plan.total_batch_tokens, true);
    gpt2_backward(m, last);  // its unit_grads_done start the sums over the data-parallel ranks (NCCL, captured)
    if (gs.every_micro_batch_sums || (last && par->grid.dp > 1))
        zero_wait(&m->zero, m->stream, true, "reduction of the gradients");  // the norm reads the sums
    if (!last) return;
    if (m->fp8.on) {  // --precision fp8: the step's amax, max-reduced over the ranks; the histories roll on the device
        fp8_share_amax_graphed(m, par);
        fp8_end_step(&m->fp8, m->stream);
    }
    if (gs.norm_in_graph)
        global_norm_partials(B_<float>(m, GB_NORM_PARTIALS), gs.pieces[0].first, gs.pieces[0].second, m->stream);
}

// Micro-batch k of the graphed step: its data into the graphs' fixed input buffers, its graph run, and
// its losses on their way to the host.
static void graphed_micro_batch(GPT2* m, Parallel* par, DataLoader* train, const RunPlan& plan, GraphedStep* gs, int k) {
    int mb = plan.accumulation_steps, BT = m->B * m->T;
    bool first = k == 0, last = k == mb - 1;
    StepGraph* g = step_graph_of(&m->graphs, first, last);
    bool capture = !g->exec;
    CommCounters* sent = &par->data_on_gpu->sent;
    CommCounters before = *sent;
    dataloader_next_batch(train);
    // into the graphs' fixed input buffers (slot 0); it waits for its copies, and so for the
    // previous micro-batch's replay, which read them
    gpt2_upload_batch(m, train->inputs.data(), train->targets.data());
    // The encoder backward's grid is one block per distinct token of the batch: a launch shape that
    // changes with the data, which a graph would bake in. Graphed, it has a block for every position
    // (the most a batch can have); the blocks past this batch's buckets find them empty (encoder.cuh).
    m->buckets[0] = BT;
    graph_run(m->graphs, g, m->stream, [&] { graphed_passes(m, par, plan, *gs, first, last); });
    if (g == &m->graphs.micro) {  // (the counters, GraphedStep)
        for (int op = 0; op < COMM_NUM_OPS; op++) {
            if (capture) {
                gs->middle.calls[op] = sent->calls[op] - before.calls[op];
                gs->middle.bytes[op] = sent->bytes[op] - before.bytes[op];
            } else if (gs->middle_captured) {
                sent->calls[op] += gs->middle.calls[op];
                sent->bytes[op] += gs->middle.bytes[op];
            }
        }
        gs->middle_captured = gs->middle_captured || capture;
    }
    // this micro-batch's losses into its own slot of pinned host memory, not read yet: the copy is
    // asynchronous, so the host goes on to the next micro-batch's data while the replay runs
    CUDA_CHECK(cudaMemcpyAsync(m->host_losses + (size_t)k * BT, B_<float>(m, GB_LOSSES), BT * sizeof(float),
                               cudaMemcpyDeviceToHost, m->stream));
}

// The host waits for the step's passes: NCCL's errors and the deadline checked (the graph has joined the
// data-parallel sums, llmc/parallel/zero.cuh), the losses' copies done.
static void wait_for_passes(GPT2* m) {
    zero_wait_reduction(&m->zero);
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
}
// The squares of this rank's part of the summed gradient: the last graph's partial sums, or each piece's.
static double graphed_norm_squares(GPT2* m, const GraphedStep& gs) {
    if (gs.norm_in_graph) return read_sum_of_squares(m);
    double squares = 0.0;
    for (const auto& piece : gs.pieces) squares += gradient_sum_of_squares(m, piece.first, piece.second);
    return squares;
}

static StepResult train_step_graphed(GPT2* m, Parallel* par, DataLoader* train, const RunPlan& plan, const TrainOptions& o,
                                     int step, BadSteps* bad_steps) {
    const ProcessGrid& grid = par->grid;
    StepResult r;
    r.lr = step_learning_rate(plan, o, step);
    int mb = plan.accumulation_steps, BT = m->B * m->T;
    auto start = std::chrono::steady_clock::now();
    GraphedStep gs = graphed_step_begin(m, par, step, &r);  // fp16 loss scale, tests' poison, this rank's norm pieces
    for (int k = 0; k < mb; k++) graphed_micro_batch(m, par, train, plan, &gs, k);
    wait_for_passes(m);
    double loss = 0.0;  // the mean over the micro-batches, added in the order forward_backward adds them
    for (int k = 0; k < mb; k++) {
        float micro_loss = mean_loss(m->host_losses + (size_t)k * BT, BT);
        loss += micro_loss / mb;
        if (grid.rank == 0) print_micro_step(step, k, mb, micro_loss, seconds_since(start));
    }
    r.loss = world_sum(par, loss, "sum of the losses") / grid.dp;  // the mean of the replicas' means
    // fp16: the norm of the scaled gradient over S, as train_step; the same decision (step_applies)
    r.norm = (float)std::sqrt(world_sum(par, graphed_norm_squares(m, gs), "sum of the gradient norms")) / r.loss_scale;
    r.applied = step_applies(m, r, o, step, bad_steps, grid.rank == 0);
    if (r.applied) optimizer_step(m, par, o, optimizer_t(step, *bad_steps, m->scaler.overflows), r.lr, r.norm);
    return r;
}

// ==============================================================================================
// The training loop

static void check_gpu_shape(const GPT2Config& cfg) {
    if (cfg.channels % 8 != 0 || (cfg.channels / cfg.num_heads) % 8 != 0) {
        fail("the GPU trainer needs channels and head size divisible by 8 (16-byte vector loads); this model has "
             "C=%d, head size %d. Use the CPU trainer for this shape", cfg.channels, cfg.channels / cfg.num_heads);
    }
    if (cfg.channels / x128::size > 1024) {  // llmc/kernels/layernorm.cuh: a row's threads are one block's
        fail("the GPU trainer's LayerNorm backward spreads a row over at most 1024 threads of %d channels: C=%d is "
             "wider than %d. Use the CPU trainer for this shape", x128::size, cfg.channels, 1024 * x128::size);
    }
}

// --grad-compression (llmc/parallel/grad_compression.cuh): the settings (with the tests' every-matrix
// switch), and the size table's two rows for them.
static GradCompressionSettings gpu_grad_compression_settings(const TrainOptions& o) {
    GradCompressionSettings s = grad_compression_settings(o);
    s.every_matrix = grad_compression_test_every_matrix();
    return s;
}
static void take_grad_compression(const TrainOptions& o, const GPT2Config& cfg, int dp, GPURunShape* s) {
    GradCompressionSizes z = grad_compression_gpu_sizes(gpu_grad_compression_settings(o), cfg, dp);
    s->compression_state = z.state;
    s->compression_work = z.work;
}

// The ranks: who am I, and the grid of data x tensor x pipeline ranks (llmc/parallel/process_grid.h). A grid
// this model or batch cannot use was refused in main, on every rank, before any GPU is touched (the Shape
// rows of llmc/run/compatibility.h: grid_problem, gradient compression and the rest).
static void start_grid(const TrainOptions& o, const GPT2Config& cfg, Parallel* par) {
    if (par->model_parallel) comm_require_mpi(&par->world, "tensor parallelism, pipelines and ZeRO-3 on the GPU");
    if (!o.dump_state.empty()) comm_require_mpi(&par->world, "--dump-state");
}

// Which GPU is mine, and how the ranks talk (NCCL, or host staging when several share one GPU): the
// world and, beyond data parallelism, each group. With one process all of this is a no-op.
static void connect_gpus(Parallel* par) {
    int devices = 0;
    cudaError_t probe = cudaGetDeviceCount(&devices);
    if (probe != cudaSuccess || devices == 0) {
        fail("no CUDA GPU is available (%s). Use ./train_gpt_cpu, which takes the same flags",
             probe != cudaSuccess ? cudaGetErrorString(probe) : "cudaGetDeviceCount found none");
    }
    gpu_comm_init(&par->world_gpu, &par->world);  // also makes this rank's GPU the current device
    const ProcessGrid& grid = par->grid;
    par->data = &par->world;  // data parallelism alone: the data group is the world (the tensor group, comms.tp, one rank)
    par->data_on_gpu = &par->world_gpu;
    if (!par->groups) return;
    // each group: an MPI communicator and its NCCL (or host-staged) twin
    grid_comms_init(&par->comms, par->world, grid);
    gpu_comm_init_group(&par->data_gpu, &par->world_gpu, &par->comms.dp, grid_group_color(grid, DATA_GROUP), grid.dp_rank,
                        "creating the data-parallel groups on the GPU");
    gpu_comm_init_group(&par->tensor_gpu, &par->world_gpu, &par->comms.tp, grid_group_color(grid, TENSOR_GROUP), grid.tp_rank,
                        "creating the tensor-parallel groups on the GPU");
    gpu_comm_init_group(&par->pipe_gpu, &par->world_gpu, &par->comms.pp, grid_group_color(grid, PIPELINE_GROUP), grid.pp_rank,
                        "creating the pipeline groups on the GPU");
    par->data = &par->comms.dp;
    par->data_on_gpu = &par->data_gpu;
}

// The buffer table's shape of this run: the flags' and the grid's (--offload, --moe-experts) on top of
// gpu_run_shape's, and the pipeline's slots, stashes and chunks from the schedule and the step's
// micro_batches (gpu_pipeline_shape: the same translation --estimate makes).
static GPURunShape run_shape(const TrainOptions& o, const GPT2Config& cfg, int B, int T, bool master_weights, bool simple_attention,
                             const Parallel& par, int micro_batches) {
    GPURunShape s = gpu_run_shape(cfg, B, T, o.recompute, master_weights, simple_attention, (int)sizeof(floatX), par.grid);
    gpu_pipeline_shape(&s, par.schedule, micro_batches, par.chunks);
    s.offload_optimizer = o.offload == "optimizer";
    s.bf16_moments = o.optimizer_state == "bf16";
    parse_optimizer(o.optimizer, &s.optimizer);  // (validate_options checked the name)
    s.moe = MoEConfig{o.moe_experts, o.moe_every};
    s.moe_top_k = o.moe_top_k;
    s.expert_parallel = o.expert_parallel;  // (consecutive data-parallel ranks form an expert group)
    s.expert_rank = par.grid.dp_rank % o.expert_parallel;
    take_grad_compression(o, cfg, par.grid.dp, &s);
    s.fp8_history = fp8_history_of(o);
    s.fp8_stash = o.stash_precision == "fp8";  // (cli.h refused it where it does not compose)
    return s;
}

// The step's micro-batches (1 for --eval-only, which runs no backward), after checking that a batch
// of that shape fits: a batch that cannot stops here, before the data is read or anything allocated.
static int check_batch_fits(const TrainOptions& o, const GPT2Config& cfg, const Parallel& par, bool master_weights,
                            bool simple_attention) {
    int T = o.seq_len > 0 ? std::min(o.seq_len, cfg.max_seq_len) : cfg.max_seq_len;
    int micro_batches = o.eval_only ? 1 : plan_run(o, cfg, par.grid.dp, 0).accumulation_steps;
    fail_unless_fits(run_shape(o, cfg, o.batch_size, T, master_weights, simple_attention, par, micro_batches));
    return micro_batches;
}

// The hooks' state, on the buffers gpt2_build allocated: the tensor group, ZeRO's plan and slots,
// the offloaded optimizer, the pipeline's sends, gradient compression and the MoE table's ZeRO.
static void gpt2_hooks_init(GPT2* m, Parallel* par, const TrainOptions& o) {
    const ProcessGrid& grid = par->grid;
    const GPT2Config& cfg = m->config;
    tp_gpu_init(&m->tp, &par->comms.tp, par->groups ? &par->tensor_gpu : nullptr, grid.sequence_parallel,
                B_<floatX>(m, GB_TP_GATHERED), B_<float>(m, GB_TP_LOSS_EXCHANGE));
    if (m->buf[GB_TP_LOSS_EXCHANGE]) CUDA_CHECK(cudaMemset(m->buf[GB_TP_LOSS_EXCHANGE], 0, m->table[GB_TP_LOSS_EXCHANGE].bytes()));
    zero_gpu_init(&m->zero, grid.zero_stage, par->data, par->data_on_gpu, grid, m->slice, m->layout, B_<floatX>(m, GB_PARAMS),
                  B_<floatX>(m, GB_GRADS), B_<floatX>(m, GB_ZERO_GATHERED), B_<floatX>(m, GB_ZERO_BUCKETS),
                  B_<floatX>(m, GB_ZERO_REDUCED));
    if (m->shape.offload_optimizer) {  // the same elements the table would have put on the GPU
        size_t n = gpu_offloaded_elements(m->shape);
        if (grid.zero_stage <= 1 && m->zero.plan.updated.size() != n)
            fail("internal: --offload optimizer's range disagrees with the size table");
        // one data-parallel rank streams each bucket as the backward finishes it; several sum it first
        offload_allocate(&m->offload, m->zero.plan, n, m->layout, m->slice.num_layers, o.offload_bucket_layers,
                         grid.dp == 1, o.offload_delay == 1, m->shape.bf16_moments);
    }
    if (grid.pp > 1) pipe_gpu_init(&par->pipe, &par->pipe_gpu, grid.pp_rank, grid.pp, par->schedule, m->slots);
    grad_compression_gpu_setup(&m->compression, gpu_grad_compression_settings(o), par->data, par->data_on_gpu, cfg, o.seed,
                               B_<float>(m, GB_COMPRESSION_STATE), B_<float>(m, GB_COMPRESSION_WORK));
    if (o.moe_experts > 0) moe_zero_gpu_init(&m->moe_zero, grid.zero_stage, par->data_on_gpu, m->moe.layout.total);
}

// The model's buffers and the state of every hook, for micro-batches of (B, T), `micro_batches` a
// step (the schedule decides how many of them this stage holds at once: run_shape).
// cuDNN's workspace is known only once its plans exist, so they are built first (they need no
// buffers); a cuDNN that is missing or has no engine for this GPU or shape costs speed, not the run.
static void gpt2_build(GPT2* m, Parallel* par, const GPT2Config& cfg, int B, int T, int micro_batches, const TrainOptions& o,
                       bool master_weights, bool* simple_attention) {
    const ProcessGrid& grid = par->grid;
    m->config = cfg;
    m->slice = model_slice(cfg, grid, par->chunks);  // interleaved: v chunks of layers (slice_layer)
    m->layout = slice_layout(cfg, m->slice);
    m->B = B;
    m->T = T;
    m->pipelined = grid.pp > 1;
    CUDA_CHECK(cudaStreamCreate(&m->stream));
    size_t cudnn_workspace_bytes = 0;
    std::string cudnn_refused;
    if (!*simple_attention && !cudnn_attention_setup(&m->attention.cudnn, B, T, m->slice.attn_channels, m->slice.heads,
                                                     &cudnn_workspace_bytes, &cudnn_refused)) {
        if (grid.rank == 0) printf("cuDNN attention unavailable (%s): using --attention simple\n", cudnn_refused.c_str());
        *simple_attention = true;
    }
    m->attention.use_cudnn = !*simple_attention;
    m->shape = run_shape(o, cfg, B, T, master_weights, *simple_attention, *par, micro_batches);
    m->shape.cudnn_workspace_bytes = cudnn_workspace_bytes;
    m->slots = m->shape.micro_batches_in_flight;
    m->buckets.assign((size_t)m->slots, 0);
    m->table = gpu_buffer_table(m->shape);
    gpt2_allocate(m);
    if (m->shape.optimizer != Optimizer::AdamW) m->blocks = param_blocks(cfg);  // (one replica holds the whole model)
    if (m->shape.two_weight_versions) {  // 2BW's older version: the stage's weights and its wte copy (pipedream_2bw.cuh)
        PipeDream2BWGpu& v = m->versions;
        v.on = true;
        v.params = B_<floatX>(m, GB_PARAMS), v.params_n = m->table[GB_PARAMS].elements;
        v.lent = B_<floatX>(m, GB_LENT_WTE), v.lent_n = m->table[GB_LENT_WTE].elements;
        v.older = B_<floatX>(m, GB_OLDER_WEIGHTS);
    }
    if (o.moe_experts > 0)  // --moe-experts: the MoE state in its rows of the table (llmc/model/moe_gpu.cuh)
        moe_gpu_init(&m->moe, m->shape.moe, moe_run_shape(o), cfg, gpu_moe_layout(cfg, m->shape), B * T, B_<floatX>(m, GB_MOE_PARAMS),
                     B_<floatX>(m, GB_MOE_GRADS), B_<float>(m, GB_MOE_ADAM_M), B_<float>(m, GB_MOE_ADAM_V),
                     B_<float>(m, GB_MOE_ROUTING), B_<floatX>(m, GB_MOE_ACTIVATIONS), B_<floatX>(m, GB_MOE_SCRATCH));
    if (o.expert_parallel > 1) {  // --expert-parallel: its groups and its rows of the table (llmc/parallel/expert_parallel.cuh)
        ep_gpu_connect(&m->ep, &par->world, &par->world_gpu, grid.dp_rank, o.expert_parallel);
        ep_gpu_init(&m->ep, moe_block_count(m->shape.moe, cfg.num_layers), o.moe_experts, o.moe_top_k, B * T, cfg.channels,
                    B_<floatX>(m, GB_EP_ROWS), B_<floatX>(m, GB_EP_SCRATCH), B_<int>(m, GB_EP_COUNTS));
    }
    matmul_init(&m->matmul, m->buf[GB_CUBLASLT_WORKSPACE], CUBLASLT_WORKSPACE_BYTES);
    if (m->shape.fp8_history)  // --precision fp8: the scaling state and the two operand buffers, rows of the table
        fp8_init(&m->fp8, m->slice.num_layers, m->shape.fp8_history, B_<float>(m, GB_FP8_SCALING), B_<uint8_t>(m, GB_FP8_A),
                 B_<uint8_t>(m, GB_FP8_B), m->stream);
    if (*simple_attention) {
        attention_init(&m->attention, m->buf[GB_CUBLASLT_WORKSPACE], CUBLASLT_WORKSPACE_BYTES);
        m->attention.qkv_scratch = B_<floatX>(m, GB_ATT_QKV);
        m->attention.dqkv_scratch = B_<floatX>(m, GB_ATT_DQKV);
        m->attention.o_scratch = B_<floatX>(m, GB_ATT_O);
        m->attention.scores = B_<floatX>(m, GB_ATT_SCORES);
    } else {
        m->attention.cudnn.workspace = m->buf[GB_CUDNN_WORKSPACE];
        m->attention.cudnn.workspace_bytes = m->table[GB_CUDNN_WORKSPACE].bytes();
        m->attention.cudnn.softmax_sum = B_<float>(m, GB_ATT_SOFTMAX_SUM);
    }
    size_t BT = (size_t)B * T;
    CUDA_CHECK(cudaMallocHost(&m->host_inputs, BT * sizeof(int)));
    CUDA_CHECK(cudaMallocHost(&m->host_targets, BT * sizeof(int)));
    CUDA_CHECK(cudaMallocHost(&m->host_buckets, (3 * BT + 1) * sizeof(int)));
    // --cuda-graphs with accumulation: a slot per micro-batch, read once after the step (train_step_graphed)
    CUDA_CHECK(cudaMallocHost(&m->host_losses, BT * (o.cuda_graphs ? micro_batches : 1) * sizeof(float)));
    gpt2_hooks_init(m, par, o);
}

// --attention simple, or the fp32 and fp16 builds, where cuDNN's fused attention (our graph is
// bf16-only) does not serve; the simple attention's kernels and matmuls run in any floatX.
static bool wants_simple_attention(const TrainOptions& o) {
    if (o.attention == "simple") return true;
    if (!std::is_same<floatX, __nv_bfloat16>::value)
        printf("%s build: cuDNN's fused attention is bf16-only here, using --attention simple\n", FLOATX_NAME);
    return !std::is_same<floatX, __nv_bfloat16>::value;
}

// The device memory in use (by us and every library), for the run's peak.
static size_t gpu_memory_used() {
    size_t free_now = 0, total_now = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_now, &total_now));
    return total_now - free_now;
}

static double device_peak_tflops(int device) {
    cudaDeviceProp props;
    CUDA_CHECK(cudaGetDeviceProperties(&props, device));
    return gpu_peak_bf16_tflops(props.name);
}


// HellaSwag (llmc/run/run.h); the GPU runs its full (B, T) only (one cuDNN plan).
// --dump-state's end (llmc/probes/gpu_test_hooks.cuh): the final weights, gathered, and the master weights.
static void dump_at_end(GPT2* m, Parallel* par, const std::string& path, int B, int T) {
    if (!dump_probe.on) return;
    std::vector<float> master = m->shape.master_weights ? read_optimizer_array(m, GB_MASTER) : std::vector<float>();
    dump_finish(&dump_probe, &par->world, m->zero.plan, m->config, m->slice, gather_bf16_weights(m, par, true),
                m->shape.master_weights ? &master : nullptr, path, B, T,
                m->moe.moe.experts > 0 ? moe_whole_table(m, download_as_float(m->moe.params, m->moe.layout.total)) : std::vector<float>());
}

// What rank 0 says before the first step: the device, the model, precision, batch, ranks, data,
// the buffer table, and the checkpoint a resumed run starts from.
static void print_run_header(GPT2* m, const Parallel& par, const TrainOptions& o, const RunPlan& plan, const DataLoader& train,
                             const DataLoader* val, const RunModel& rm, const TrainStateHeader& resumed, bool simple_attention,
                             double peak_tflops) {
    const std::string& model_source = rm.source;
    const ProcessGrid& grid = par.grid;
    const Comm& comm = par.world;
    const GPT2Config& cfg = m->config;
    size_t P = param_layout(cfg).total;
    cudaDeviceProp props;
    CUDA_CHECK(cudaGetDeviceProperties(&props, par.world_gpu.device));
    printf("device: %s, %s, compute capability %d.%d; %s\n", props.name, format_bytes((double)m->memory_total).c_str(),
           props.major, props.minor, peak_tflops > 0 ? strprintf("%.0f TFLOP/s dense bf16 peak", peak_tflops).c_str()
                                                     : "unknown GPU: no MFU reported");
    printf("model: %s (%s), %zu parameters\n", model_source.c_str(), describe_config(cfg).c_str(), P);
    if (m->moe.moe.experts > 0)
        printf("mixture of experts: %d of %d blocks, %d experts, top-%d: %zu + %zu (the MoE table, bf16 without master weights) = "
               "%zu parameters, %zu active per token\n", moe_block_count(m->moe.moe, cfg.num_layers), cfg.num_layers,
               m->moe.shape.experts, m->moe.shape.top_k, P, m->moe.layout.total, P + m->moe.layout.total,
               moe_active_params(cfg, m->moe.moe, m->moe.shape.top_k));
    printf("precision: %s, master weights %s; attention: %s; recompute %d\n", FLOATX_NAME,
           m->shape.master_weights ? "fp32" : "off", simple_attention ? "simple" : "cudnn", o.recompute);
    if (m->fp8.on)
        printf("fp8: the linear layers' matmuls in fp8 (forward e4m3, gradients e5m2), delayed scaling over %d steps' amax\n",
               m->fp8.history);
    if (m->shape.offload_optimizer)
        printf("offload: master weights and AdamW m, v (%s) of %zu parameters in pinned host memory (%s), the step on the CPU%s; "
               "the gradient streamed down %s\n", m->offload.bf16_moments ? "bf16" : "fp32", m->offload.n,
               format_bytes((double)m->offload.n * offload_host_bytes_per_param(m->offload.delay, m->offload.bf16_moments)).c_str(),
               m->offload.delay ? ", overlapping the next step (--offload-delay 1: one step stale)" : "",
               m->offload.bucket_layers > 0 ? strprintf("in buckets of %d layer(s) during the backward", m->offload.bucket_layers).c_str()
                                            : "after the backward");
    printf("batch: B=%d T=%d, %d rank%s, %d accumulation step%s -> %lld tokens per step; %d steps\n", plan.B, plan.T,
           grid.dp, grid.dp == 1 ? "" : "s", plan.accumulation_steps,
           plan.accumulation_steps == 1 ? "" : "s", (long long)plan.total_batch_tokens, plan.steps);
    const char* link = par.world_gpu.host_staged ? "host-staged: ranks share a GPU, collectives go through MPI" : "NCCL";
    const Zero& z = m->zero.plan;
    if (comm.world_size > 1 && !par.groups && grid.zero_stage <= 1) {
        printf("ranks: %d (%s, %d on this node; %s), ZeRO-%d: each rank updates %zu of %zu parameters%s\n",
               comm.world_size, comm.launcher.c_str(), comm.local_size, link, z.stage, z.updated.size(), P,
               z.stage == 1 ? strprintf(" (shards of %zu, padded total %zu)", z.shards.shard_size, z.shards.padded_total).c_str()
                            : "");
    } else if (comm.world_size > 1) {
        printf("ranks: %d (%s, %d on this node; %s), grid %s: rank 0's slice has %zu of %zu parameters%s, updates %zu\n",
               comm.world_size, comm.launcher.c_str(), comm.local_size, link, describe_grid(grid).c_str(), m->layout.total, P,
               grid.zero_stage == 3 ? " (stored sharded: ZeRO-3)" : "", optimizer_elements(m));
    }
    const GradCompression& gc = m->compression.c;
    if (gc.settings.kind == GradCompressionKind::BF16 && grid.dp > 1)
        printf("gradient sum: bf16 on the wire, which the GPU trainer's exact sum already is (--grad-compression bf16 changes nothing here)\n");
    if (grad_compression_on(gc) && gc.settings.kind == GradCompressionKind::PowerSGD)
        printf("gradient sum: PowerSGD rank %d from step %d on (exact before): %zu matrices compressed, %zu values summed exactly\n",
               gc.settings.rank, gc.settings.start_step + 1, gc.plan.matrices.size(), gc.plan.exact_floats);
    if (grid.pp > 1) {
        printf("%s", describe_pipeline(par.schedule, grid.pp, cfg.num_layers, plan.accumulation_steps, par.chunks).c_str());
    }
    printf("%s", describe_data(train, val, o).c_str());
    print_gpu_buffer_table(m->table);
    print_resumed(o, rm, resumed, grid);
}

// The pipeline's bubble, predicted and measured over the run (the first stage's schedule, which
// starts first and finishes last, is the step's pipeline time).
static void report_bubble(Parallel* par, int steps) {
    const ProcessGrid& grid = par->grid;
    std::vector<double> busy = gpu_comm_gather(&par->world_gpu, par->pipe.busy_seconds, "collecting the busy times");
    std::vector<double> span = gpu_comm_gather(&par->world_gpu, par->pipe.schedule_seconds, "collecting the schedule times");
    if (grid.rank != 0) return;
    printf("pipeline bubble: predicted %s = %.1f%%; measured over %d steps, the part of the first stage's "
           "schedule in which each stage was not computing:", pipeline_bubble_formula(par->schedule),
           100.0 * par->predicted_bubble, steps);
    for (int stage = 0; stage < grid.pp; stage++) printf(" %.1f%%", 100.0 * (1.0 - busy[(size_t)grid_rank(grid, 0, 0, stage)] / span[0]));
    printf("\n");
}

// The memory the run took: the peak against the buffer table (what --estimate predicts), and the
// same in bytes for scripts/measure_memory.py.
static void report_memory(GPT2* m, size_t peak_used) {
    size_t table = gpu_buffer_total(m->table), used_before = m->memory_used_before;
    printf("GPU memory: peak %s in use (buffer table %s; %s in use before allocation)\n", format_bytes((double)peak_used).c_str(),
           format_bytes((double)table).c_str(), format_bytes((double)used_before).c_str());
    printf("GPU memory bytes: table %zu, in use before allocation %zu, peak in use %zu, peak minus before %zu\n", table,
           used_before, peak_used, peak_used - used_before);
}

static void release_all(GPT2* m, Parallel* par) {
    gpt2_free(m);
    if (par->grid.pp > 1) pipe_gpu_destroy(&par->pipe);
    if (par->groups) {
        for (GpuComm* g : {&par->pipe_gpu, &par->tensor_gpu, &par->data_gpu}) gpu_comm_finalize(g);
    }
    ep_gpu_finalize(&m->ep);
    gpu_comm_finalize(&par->world_gpu);
    comm_finalize(&par->world);
}

// ==============================================================================================
// Generation (--generate, llmc/run/generate.h) on one GPU: no grids (a model that needs several
// GPUs to hold it is refused). With the KV cache (llmc/kernels/kv_attention.cuh) only the new
// tokens' rows go through the layers; --kv-cache 0 runs the training forward over the window for
// every token, as the samples during training do. The cache and its row buffers are allocated here,
// outside the training size table (--estimate does not count them: 2 L T C bf16 values, plus T rows).

struct KVCacheGpu {
    floatX *k = nullptr, *v = nullptr;                   // (L, T, C) each
    floatX *x = nullptr, *x2 = nullptr, *ln = nullptr;   // (T, C): the residual stream, after attention, LayerNorm out
    floatX *qkv = nullptr, *atty = nullptr, *proj = nullptr, *fch = nullptr, *fch_gelu = nullptr;  // (T, 3C), (T, C) x2, (T, 4C) x2
    float *mean = nullptr, *rstd = nullptr;              // (T)
    floatX* logits = nullptr;                            // (Vp): the last new token's
    int* tokens = nullptr;                               // (T)
    std::vector<float> host_logits;
};

static std::vector<void**> kv_cache_buffers(KVCacheGpu* c) {
    return {(void**)&c->k, (void**)&c->v, (void**)&c->x, (void**)&c->x2, (void**)&c->ln, (void**)&c->qkv, (void**)&c->atty,
            (void**)&c->proj, (void**)&c->fch, (void**)&c->fch_gelu, (void**)&c->mean, (void**)&c->rstd, (void**)&c->logits,
            (void**)&c->tokens};
}

static void kv_cache_allocate(KVCacheGpu* c, const GPT2Config& cfg) {
    size_t T = cfg.max_seq_len, C = cfg.channels, X = sizeof(floatX);
    size_t bytes[] = {cfg.num_layers * T * C * X, cfg.num_layers * T * C * X, T * C * X, T * C * X, T * C * X, T * 3 * C * X,
                      T * C * X, T * C * X, T * 4 * C * X, T * 4 * C * X, T * sizeof(float), T * sizeof(float),
                      cfg.padded_vocab_size * X, T * sizeof(int)};
    std::vector<void**> buffers = kv_cache_buffers(c);
    for (size_t i = 0; i < buffers.size(); i++) CUDA_CHECK(cudaMalloc(buffers[i], bytes[i]));
}

static void kv_cache_free(KVCacheGpu* c) {
    for (void** b : kv_cache_buffers(c)) CUDA_CHECK(cudaFree(*b));
}

// The forward pass of n new tokens at positions pos .. pos+n-1, the earlier ones' keys and values in
// the cache: gpt2_forward's kernels on n rows (the residual add and the next LayerNorm fused as
// there). Returns the last new token's logits, on the host.
static const float* gpt2_forward_cached(GPT2* m, KVCacheGpu* c, const int* tokens, int n, int pos) {
    const GPT2Config& cfg = m->config;
    int L = cfg.num_layers, C = cfg.channels, NH = cfg.num_heads, T = cfg.max_seq_len, Vp = cfg.padded_vocab_size;
    cudaStream_t s = m->stream;
    ParamTensors<floatX> e = unit_weights(m, ends_unit(L), -1);
    CUDA_CHECK(cudaMemcpyAsync(c->tokens, tokens, n * sizeof(int), cudaMemcpyHostToDevice, s));
    encoder_forward(c->x, c->tokens, e[WTE], e[WPE] + (size_t)pos * C, 1, n, C, s);  // wpe from row pos on
    for (int l = 0; l < L; l++) {
        ParamTensors<floatX> w = unit_weights(m, unit_of_layer(L, l), -1);
        floatX* k_cache = c->k + (size_t)l * T * C;
        floatX* v_cache = c->v + (size_t)l * T * C;
        fused_residual_layernorm_forward(nullptr, c->ln, c->mean, c->rstd, c->x, nullptr, w[LN1W], w[LN1B], n, C, s);
        matmul_forward(&m->matmul, c->qkv, c->ln, w[QKVW], w[QKVB], n, C, 3 * C, s);
        kv_cache_store(k_cache, v_cache, c->qkv, pos, n, C, s);
        attention_cached(c->atty, c->qkv, k_cache, v_cache, pos, n, C, NH, s);
        matmul_forward(&m->matmul, c->proj, c->atty, w[ATTPROJW], w[ATTPROJB], n, C, C, s);
        fused_residual_layernorm_forward(c->x2, c->ln, c->mean, c->rstd, c->x, c->proj, w[LN2W], w[LN2B], n, C, s);
        if (is_moe_block(m->moe.moe, l)) {  // --moe-experts: the router sends each new row to its top-k experts
            int b = moe_block_index(m->moe.moe, l);
            moe_gpu_block_forward_new_rows(&m->moe, &m->matmul, b, moe_gpu_weights<const floatX>(m->moe, m->moe.params, b, w[FCW],
                                           w[FCB], w[FCPROJW], w[FCPROJB]), c->ln, c->proj, n, s);
        } else {
            matmul_forward(&m->matmul, c->fch, c->ln, w[FCW], w[FCB], n, C, 4 * C, s);
            gelu_forward(c->fch_gelu, c->fch, (size_t)n * 4 * C, s);
            matmul_forward(&m->matmul, c->proj, c->fch_gelu, w[FCPROJW], w[FCPROJB], n, 4 * C, C, s);
        }
        residual_forward(c->x, c->x2, c->proj, (size_t)n * C, s);
    }
    // only the last row's logits are wanted: one row through the final LayerNorm and the LM head
    fused_residual_layernorm_forward(nullptr, c->ln, c->mean, c->rstd, c->x + (size_t)(n - 1) * C, nullptr, e[LNFW], e[LNFB],
                                     1, C, s);
    matmul_forward(&m->matmul, c->logits, c->ln, e[WTE], nullptr, 1, C, Vp, s);
    c->host_logits = download_as_float(c->logits, cfg.vocab_size);  // (synchronises the stream)
    return c->host_logits.data();
}

// --generate: one process, one GPU, the weights of --model FILE or --resume CKPT, then llmc/run/generate.h.
static int generate_main(const TrainOptions& o) {
    Parallel par;
    comm_init(&par.world, o.comm_timeout);
    std::string resume_dir;
    GPT2Config cfg = generation_model(o, par.world.world_size, "one GPU", &resume_dir);
    std::string why = o.moe_experts > 0 ? moe_gpu_shape_problem(moe_run_shape(o), cfg.channels) : "";  // (the kernels' limits)
    if (!why.empty()) usage_fail(why);
    connect_gpus(&par);
    check_gpu_shape(cfg);
    // the training buffers for one sequence: the weights, and (--kv-cache 0) the window's activations;
    // the cached path runs no training forward, so a short T will do (and the simple attention: no cuDNN
    // plan), but for an MoE model's routing state and rows, which a prompt's prefill of T rows needs
    bool simple_attention = o.kv_cache ? true : wants_simple_attention(o);
    int T = o.kv_cache && o.moe_experts == 0 ? std::min(64, cfg.max_seq_len) : cfg.max_seq_len;
    GPT2 model;
    GPT2* m = &model;
    gpt2_build(m, &par, cfg, 1, T, 1, o, false, &simple_attention);
    if (o.moe_experts > 0) m->moe.shape = moe_generation_shape(o);  // both paths route without dropping (moe.h says why)
    load_state(m, o, resume_dir, false);
    if (o.kv_cache) {
        KVCacheGpu cache;
        kv_cache_allocate(&cache, cfg);
        run_generation(o, cfg, "KV cache", [&](const std::vector<int>& tokens, int first, int cached) {
            int n = (int)tokens.size() - first - cached;
            return gpt2_forward_cached(m, &cache, tokens.data() + first + cached, n, cached);
        });
        kv_cache_free(&cache);
    } else {
        // the window at the start of the (1, T) batch; attention being causal, what follows it cannot
        // change the logits read (as a sample does: gpu_evaluation_passes)
        std::vector<int> batch((size_t)T, 0);
        std::vector<float> logits;
        run_generation(o, cfg, "recomputing the window", [&](const std::vector<int>& tokens, int first, int) {
            int len = (int)tokens.size() - first;
            std::copy(tokens.begin() + first, tokens.end(), batch.begin());
            pipeline_forward(m, &par, batch.data(), nullptr);
            logits = download_as_float(A_<floatX>(m, GB_LOGITS) + (size_t)(len - 1) * m->slice.vocab_rows, cfg.vocab_size);
            return (const float*)logits.data();
        });
    }
    release_all(m, &par);
    return 0;
}

// fp16's loss scaler (llmc/optim/loss_scaler.h): S and its window from the flags (0: PyTorch's
// defaults), or where a checkpoint left them (a file without them, bf16's or an older one, starts
// afresh). bf16 and fp32 need none: S = 1, never changes.
// ==============================================================================================
// The run around the step (llmc/run/train_loop.h): the GPU's passes, and what it counts around a step
// for its end reports.

struct GpuRunCounts {
    int first_step = 0;
    uint64_t sent_before = 0;
    uint64_t first_sent = 0, last_sent = 0;  // bytes this rank sent to its data group in the run's first and last step
    uint64_t graph_sent = 0;  // --cuda-graphs: the bytes the capture step counted (the counters run on the host, at the calls)
    size_t peak_used = 0;
    double peak_tflops = 0, flops_per_step = 0;
    BadSteps bad_steps;  // the steps in a row whose update was skipped (llmc/run/step.h)
};

static void gpu_before_step(GPT2* m, Parallel* par, const TrainOptions& o, GpuRunCounts* c, int step) {
    int i = step - 1;  // (the loop's index)
    c->sent_before = par->data_on_gpu->sent.total_bytes();  // (the data group's counters: llmc/parallel/comm_nccl.cuh)
    if (m->graphs.replay && i > c->first_step + 1) c->sent_before -= c->graph_sent;  // (a replay sends what its capture counted)
    m->graphs.replay = o.cuda_graphs && i > c->first_step;  // the run's first step is eager (llmc/run/cuda_graphs.cuh)
}

static StepReport gpu_after_step(GPT2* m, Parallel* par, const RunPlan& plan, GpuRunCounts* c, int step, const StepResult& r,
                                 double seconds) {
    int i = step - 1, first = c->first_step;
    (i == first ? c->first_sent : c->last_sent) = par->data_on_gpu->sent.total_bytes() - c->sent_before;
    if (m->graphs.replay && i == first + 1) c->graph_sent = c->last_sent;
    if (par->grid.rank == 0 && m->graphs.replay && i == first + 1) print_graphs_captured(m->graphs, step, plan.accumulation_steps);
    if (i == first) c->peak_used = std::max(c->peak_used, gpu_memory_used());  // every library has what it wants now
    // the bubble is measured from the second step on: the first also plans cuBLAS's and cuDNN's
    // kernels (an H200, 2 stages of sleeps, 3 steps: 27% measured with it, where the 2nd and
    // 3rd steps' times alone give 23%; 20% predicted)
    if (i == first && plan.steps - first > 1) par->pipe.busy_seconds = par->pipe.schedule_seconds = 0;
    fp8_test_dump_state(&par->world, step, &m->fp8);  // LLMC_TEST_FP8_STATE (llmc/probes/gpu_test_hooks.cuh)
    StepReport rep;
    rep.mfu = c->peak_tflops > 0 ? 100.0 * c->flops_per_step / seconds / (c->peak_tflops * par->world.world_size * 1e12) : -1.0;
    rep.loss_scale = FLOATX_IS_FP16 ? r.loss_scale : 0.0f;
    rep.memory_bytes = (double)c->peak_used;
    bool moe = m->moe.moe.experts > 0;  // --moe-experts: the auxiliary losses and the routing beside the LM loss
    rep.moe_line = moe_step_line(m->moe.stats, moe);
    rep.moe_fields = moe_metrics_fields(m->moe.stats, moe);
    return rep;
}

// Evaluation and samples: on a grid whose forward pass spans several ranks (tensor or pipeline
// parallelism, ZeRO-3) every rank takes part; otherwise rank 0 alone evaluates. A sample runs the
// model on the full (B, T) it was sized for (one cuDNN plan, no new shapes); the window sits at the
// start of row 0 and, attention being causal, what follows it cannot change the logits we read. On a
// model-parallel grid the last stage's tensor ranks send their vocabulary rows of the logits to rank 0.
static void gpu_evaluation_passes(GPT2* m, Parallel* par, RunPasses* p) {
    p->forward = [=](const int* inputs, const int* targets, int, int) { return (double)pipeline_forward(m, par, inputs, targets); };
    p->row_losses = [=]() { return (const float*)(m->slice.last_stage ? m->host_losses : nullptr); };
    p->world_sum = [=](double x, const char* what) { return gpu_comm_sum(&par->world_gpu, x, what); };
    std::vector<int> batch((size_t)m->B * m->T, 0);
    p->sample_logits = [=, mine = std::vector<float>(), logits = std::vector<float>()](const std::vector<int>& tokens, int len) mutable {
        const ModelSlice& sl = m->slice;
        if (tokens.size() == 1) std::fill(batch.begin(), batch.end(), 0);  // (a new sample)
        std::copy(tokens.end() - len, tokens.end(), batch.begin());
        pipeline_forward(m, par, batch.data(), nullptr);
        bool holds = sl.last_stage && par->grid.dp_rank == 0;  // this rank has some of the logits we want
        if (holds) mine = download_as_float(A_<floatX>(m, GB_LOGITS) + (size_t)(len - 1) * sl.vocab_rows, sl.vocab_rows);
        if (!par->model_parallel) return (const float*)mine.data();
        collect_logits_row(&par->world, holds, sl, mine.data(), m->config.vocab_size, &logits);
        return (const float*)logits.data();
    };
    p->sample_window = m->T;
    p->fixed_shape = true;
    p->sample_world = &par->world;
}

static RunPasses gpu_run_passes(GPT2* m, Parallel* par, DataLoader* train, const RunPlan* plan, const TrainOptions* o,
                                GpuRunCounts* c, const uint64_t* sampler_rng) {
    RunPasses p;
    gpu_evaluation_passes(m, par, &p);
    p.step_begins = [](int) {};
    p.before_step = [=](int step) { gpu_before_step(m, par, *o, c, step); };
    p.step = [=](int step) {
        StepResult r = m->graphs.replay ? train_step_graphed(m, par, train, *plan, *o, step, &c->bad_steps)
                                        : train_step(m, par, train, *plan, *o, step, &c->bad_steps);
        if (step == plan->steps) flush_offloaded_weights(m);  // --offload-delay 1: the last step's weights reach the GPU
        return r;
    };
    p.after_step = [=](int step, const StepResult& r, double seconds) { return gpu_after_step(m, par, *plan, c, step, r, seconds); };
    p.checkpoint = [=](int step) { save_checkpoint(m, par, *plan, *o, step, *train, *sampler_rng, c->bad_steps.skipped); };
    return p;
}

static LossScaler start_loss_scaler(const TrainOptions& o, const TrainStateHeader& resumed) {
    LossScaler s;
    if (!FLOATX_IS_FP16) return s;
    s.scale = o.loss_scale_init > 0 ? o.loss_scale_init : LOSS_SCALE_INIT;
    s.window = o.loss_scale_window > 0 ? o.loss_scale_window : LOSS_SCALE_WINDOW;
    if (resumed.loss_scale > 0) {
        s.scale = resumed.loss_scale;
        s.clean_steps = resumed.loss_scale_clean_steps;
        s.overflows = (int)resumed.loss_scale_overflows;
    }
    return s;
}

// --precision fp8 (llmc/kernels/fp8.cuh) needs fp8 tensor cores, refused in one line before any allocation (what it
// does not combine with, grids and shapes, is rows of llmc/run/compatibility.h).
static void check_fp8_run(Parallel& par) {
    cudaDeviceProp props;
    CUDA_CHECK(cudaGetDeviceProperties(&props, par.world_gpu.device));
    std::string why;
    if (props.major * 10 + props.minor < 89)
        why = strprintf("--precision fp8 needs fp8 tensor cores (compute capability 8.9 or newer: Ada, Hopper); this GPU "
                        "(%s) is %d.%d: drop --precision fp8", props.name, props.major, props.minor);
    if (!why.empty()) grid_usage_fail(&par.world, why);
}

// ==============================================================================================
// Start-up and the end of the run: main's steps.

// The flags the GPU trainer refuses before anything starts: the pairs of techniques that do not combine
// (llmc/run/compatibility.h), the precision of this build, and fp16's loss scale.
static void refuse_gpu_flags(const TrainOptions& o) {
    refuse_incompatible_flags(o, Trainer::GPU, FLOATX_NAME);  // which techniques combine: llmc/run/compatibility.h
    validate_precision(o, Trainer::GPU, FLOATX_NAME);
    if (FLOATX_IS_FP16) {  // (0: the default)
        std::string bad = loss_scale_problem(o.loss_scale_init == 0 ? LOSS_SCALE_INIT : o.loss_scale_init,
                                             o.loss_scale_window == 0 ? LOSS_SCALE_WINDOW : o.loss_scale_window);
        if (!bad.empty()) usage_fail("%s (--loss-scale-init, --loss-scale-window)", bad.c_str());
    }
}

// --estimate and --plan: no GPU needed, arithmetic (llmc/memory/estimate.h, llmc/parallel/grid_planner.h).
static int print_arithmetic(const TrainOptions& o, bool master_weights, bool simple_attention) {
    EstimateSetup setup = estimate_setup(o, Trainer::GPU, (int)sizeof(floatX), master_weights, simple_attention);
    setup.half_name = FLOATX_IS_FP16 ? "fp16" : "bf16";
    if (o.plan > 0) print_plan(o, setup);
    else print_estimate(setup);
    return 0;
}

// The ranks and the grid (one rank: the grid 1 x 1 x 1). Returns whether this is rank 0, which alone
// prints, evaluates, samples and writes the model.
static bool start_ranks(const TrainOptions& o, Parallel* par) {
    comm_init(&par->world, o.comm_timeout);
    std::string why = make_grid(par->world.world_size, par->world.rank, o.tensor_parallel, o.pipeline_parallel, 0, o.zero_stage,
                                o.sequence_parallel, &par->grid);
    if (!why.empty()) grid_usage_fail(&par->world, why);
    const ProcessGrid& grid = par->grid;
    parse_pipeline_schedule(o.pipeline_schedule, &par->schedule);
    par->chunks = o.virtual_stages;  // (validate_options: more than 1 only with interleaved)
    par->groups = grid.tp > 1 || grid.pp > 1;
    par->model_parallel = par->groups || grid.zero_stage == 3 || o.expert_parallel > 1;  // (--expert-parallel: the experts' owners)
    return par->world.rank == 0;
}

// The grid's groups and the GPUs, and what the GPUs refuse once connected: expert parallelism's
// exchange with ranks sharing a GPU.
static void start_gpus(const TrainOptions& o, const GPT2Config& cfg, Parallel* par) {
    start_grid(o, cfg, par);
    connect_gpus(par);
    if (o.expert_parallel > 1 && par->world_gpu.host_staged)  // (llmc/parallel/expert_parallel.cuh: grouped ncclSend/ncclRecv)
        grid_usage_fail(&par->world, strprintf("--expert-parallel %d with %d ranks sharing a GPU: the exchange runs on NCCL, one GPU "
                                               "a rank; give each rank its own GPU, or use --expert-parallel 1", o.expert_parallel,
                                               par->world.world_size));
}

// --cuda-graphs on this grid (llmc/run/cuda_graphs.cuh), before any allocation.
static void refuse_gpu_graphs(const TrainOptions& o, Parallel* par) {
    std::string graphs_problem = cuda_graphs_problem(o, par->grid, par->world_gpu.host_staged);
    if (!graphs_problem.empty()) grid_usage_fail(&par->world, graphs_problem);
}

// --precision fp8 resumed: the scales' history from fp8_state.bin (a checkpoint of a bf16 run has
// none: step 1 after it calibrates).
static void load_fp8_state(GPT2* m, const std::string& resume_dir, bool leader) {
    if (!m->fp8.on || resume_dir.empty()) return;
    std::string path = resume_dir + "/fp8_state.bin";
    if (file_exists(path)) {
        std::vector<float> values(fp8_saved_floats(&m->fp8));
        read_fp8_state(path, m->fp8.tensors, m->fp8.history, &values);
        fp8_upload_state(&m->fp8, values);
    } else if (leader) {
        printf("note: the checkpoint has no fp8_state.bin (not an fp8 run): the first step measures its own scales\n");
    }
}

// 2BW: W(-1) = W(0), or a resumed run's W(t-1) from its checkpoint (rounded back to the same bits).
static void load_2bw_versions(GPT2* m, const ProcessGrid& grid, const std::string& resume_dir, int64_t step) {
    pipedream_2bw_gpu_copy_newer(&m->versions, m->stream);
    if (!m->versions.on || resume_dir.empty()) return;
    PipeDream2BW host;
    host.on = true;
    host.older.assign(m->versions.params_n + m->versions.lent_n, 0.0f);
    pipedream_2bw_load(&host, resume_dir, grid.rank, grid.world, step);
    upload_rounded(m->versions.older, host.older.data(), host.older.size());
}

// The state: this rank's weights, master weights and optimizer state, from a checkpoint, a model
// file or the seed, and a resumed run's loss scale, fp8 scales, compression state, sampler and data
// position (--eval-only: a run of zero steps). Returns the checkpoint's header (step 0 for a new run).
static TrainStateHeader gpu_resume(GPT2* m, Parallel* par, const TrainOptions& o, const RunModel& rm, RunPlan* plan,
                                   DataLoader* train, uint64_t* sampler_rng) {
    bool leader = par->world.rank == 0;
    const std::string& resume_dir = rm.resume_dir;
    TrainStateHeader resumed = load_state(m, o, resume_dir, rm.new_model);
    m->scaler = start_loss_scaler(o, resumed);
    offload_resume_pending(&m->offload, (int)resumed.step, o.seed);  // --offload-delay 1: model.bin is a step behind
    load_fp8_state(m, resume_dir, leader);
    if (!resume_dir.empty()) {
        check_resume_state(resumed, resume_dir, param_layout(rm.cfg).total, *plan, true);
        grad_compression_gpu_load(&m->compression, resume_dir, resumed.step);  // its error feedback and Q, or a refusal
        *sampler_rng = resumed.sampler_rng;
        if (!o.eval_only) dataloader_seek(train, resumed.train_loader, leader);
    }
    if (par->grid.pp > 1) share_tied_weights(m, par);  // the last stage's copy of wte for its LM head
    load_2bw_versions(m, par->grid, resume_dir, resumed.step);
    if (o.eval_only) plan->steps = (int)resumed.step;  // evaluating is a run of zero steps
    return resumed;
}

// After the last step: the pipeline's bubble, the memory, the data group's traffic, expert
// parallelism's all-to-alls and the offloaded gradients; then --dump-state's file.
static void gpu_end_reports(GPT2* m, Parallel* par, const TrainOptions& o, const RunPlan& plan, GpuRunCounts* c) {
    bool leader = par->world.rank == 0;
    int first_step = c->first_step, steps = plan.steps;
    c->peak_used = std::max(c->peak_used, gpu_memory_used());
    if (par->grid.pp > 1 && steps > first_step) report_bubble(par, std::max(1, steps - first_step - 1));
    if (leader) report_memory(m, c->peak_used);
    if (leader && par->grid.dp > 1 && steps - first_step > 1)  // (test/test_gpu_grad_compression.py reads them)
        printf("data-parallel traffic from rank 0 (its counters): step %d %s, step %d %s\n", first_step + 1,
               format_bytes((double)c->first_sent).c_str(), steps, format_bytes((double)c->last_sent).c_str());
    if (m->ep.on && steps > first_step) {  // --expert-parallel: what its all-to-alls moved (as train_gpt_cpu reports it)
        const CommCounters& ec = m->ep.group.sent;
        double bytes = gpu_comm_sum(&par->world_gpu, (double)ec.bytes[COMM_ALL_TO_ALL], "sum of the expert-parallel bytes");
        if (leader)
            printf("expert parallel: the all-to-alls sent %.0f bytes from all ranks over %d steps, %.0f a step (%llu calls a rank: "
                   "counts and rows, forward and backward, %zu bytes a value)\n", bytes, steps - first_step,
                   bytes / (steps - first_step), (unsigned long long)ec.calls[COMM_ALL_TO_ALL], sizeof(floatX));
    }
    if (leader && m->shape.offload_optimizer)
        printf("offload: the last step's backward sent %d of %zu gradient buckets to the host as it finished them\n",
               m->offload.streamed_last_step, m->offload.buckets.size());
    dump_at_end(m, par, o.dump_state, plan.B, plan.T);
}

int main(int argc, char** argv) {
    TrainOptions o;
    parse_command_line(argc, argv, Trainer::GPU, &o);
    resume_options(&o);  // --resume: the run's recorded options, its folder, its step count (llmc/run/resume.h)
    validate_options(o);
    refuse_gpu_flags(o);  // the techniques that do not combine, the precision, fp16's loss scale
    if (generation_mode(o)) return generate_main(o);  // --generate: no data, no training (llmc/run/generate.h)
    bool simple_attention = wants_simple_attention(o);
    bool master_weights = o.master_weights == 1 && !FLOATX_IS_FP32;  // fp32 parameters are their own master
    if (o.pipeline_print_schedule) return print_pipeline_schedule(o);  // arithmetic only (llmc/memory/estimate.h)
    if (o.estimate) refuse_incompatible_estimate(o, Trainer::GPU, FLOATX_NAME, estimate_config(o));  // as training would
    if (o.estimate || o.plan > 0) return print_arithmetic(o, master_weights, simple_attention);

    // ---- the ranks and the grid, the model's shape, then the GPUs
    Parallel par;
    bool leader = start_ranks(o, &par);
    const Comm& comm = par.world;
    const ProcessGrid& grid = par.grid;
    RunModel rm;
    std::string why = choose_model(o, leader, &rm);
    const GPT2Config& cfg = rm.cfg;
    if (why.empty()) why = compatibility_grid_problem(o, Trainer::GPU, FLOATX_NAME, cfg, grid);  // llmc/run/compatibility.h
    if (!why.empty()) grid_usage_fail(&par.world, why);
    start_gpus(o, cfg, &par);
    check_gpu_shape(cfg);
    int micro_batches = check_batch_fits(o, cfg, par, master_weights, simple_attention);
    trace_open(o.trace, comm.rank, comm.world_size, grid.pp_rank);  // --trace: a path it cannot write stops the run now

    // ---- data and the shape of the run: each data-parallel rank reads its own slice of every step
    DataLoader train;
    open_training_data(&train, o, cfg, grid);  // before the model is allocated: a shard too short is refused now
    RunPlan plan = plan_run(o, cfg, grid.dp, train.tokens_per_epoch);
    if (o.precision == "fp8") check_fp8_run(par);  // before any allocation
    refuse_gpu_graphs(o, &par);
    RunEvents ev;
    open_validation(&ev, o, cfg, plan, leader, par.model_parallel);
    par.predicted_bubble = pipeline_predicted_bubble(par.schedule, grid.pp, plan.accumulation_steps, par.chunks);

    // ---- the buffers, sized from the table and checked against free memory; then the state
    GPT2 model;
    GPT2* m = &model;
    gpt2_build(m, &par, cfg, plan.B, plan.T, micro_batches, o, master_weights, &simple_attention);
    uint64_t sampler_rng = o.seed ^ 0x5DEECE66Dull;
    TrainStateHeader resumed = gpu_resume(m, &par, o, rm, &plan, &train, &sampler_rng);
    GpuRunCounts counts{(int)resumed.step, 0, 0, 0, 0, 0, device_peak_tflops(par.world_gpu.device),  // 0 for a GPU we do not know: no MFU
                        flops_per_token(cfg, plan.T) * (double)plan.total_batch_tokens, {}};
    counts.bad_steps.skipped = resumed.updates_skipped;  // (AdamW's t leaves them out: llmc/run/step.h)
    if (run_is_complete(o, counts.first_step, plan.steps, leader)) {  // nothing to train: nothing written
        trace_close();
        release_all(m, &par);
        return 0;
    }
    if (leader) print_run_header(m, par, o, plan, train, ev.have_val ? &ev.val : nullptr, rm, resumed, simple_attention, counts.peak_tflops);
    counts.peak_used = gpu_memory_used();

    open_reports(&ev, o, cfg, plan, leader, "gpu", comm.world_size, counts.first_step, rm);
    run_training(RunLoop{&o, &plan, counts.first_step, cfg.vocab_size, leader, par.model_parallel, grid, &par.world, &par.pipe_drains,
                         &sampler_rng, &ev},
                 gpu_run_passes(m, &par, &train, &plan, &o, &counts, &sampler_rng));
    gpu_end_reports(m, &par, o, plan, &counts);
    close_reports(&ev, leader);
    release_all(m, &par);
    return 0;
}
