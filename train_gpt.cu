// train_gpt.cu — GPT-2 training on one GPU, in bf16 mixed precision.
//
// The same model, flags, files, initialisation, data order and schedule as train_gpt_cpu.cpp (all in
// llmc/), computed by the kernels in llmc/*.cuh. Read it next to the CPU reference: the forward and
// backward passes call the kernels in the same order the CPU code calls its loops.
//
// Precision: parameters, activations and gradients are bf16 (2 bytes: half the memory traffic of
// fp32, and the tensor cores' fast input type); every matmul and reduction accumulates in fp32;
// AdamW keeps m and v in fp32 and, with --master-weights 1, an fp32 copy of the weights, from which
// the bf16 weights are written with stochastic rounding (llmc/adamw.cuh). `make train_gpt_fp32`
// builds the same code with fp32 everywhere, to debug against the CPU reference.
//
// Memory: every buffer comes from one table (llmc/gpu_buffers.h), sized before anything is
// allocated and printed at start; a batch that does not fit fails before training with the largest
// that would. --recompute trades compute for activation memory, exactly (bit-identical results).
//
// Determinism: no float atomics anywhere, cuBLASLt algorithms fixed per shape, cuDNN engines
// filtered for determinism, stochastic rounding seeded by (seed, step, index): two runs with the same
// flags are bit-identical, and so is a resumed run.
//
// Many GPUs: `mpirun -np N ./train_gpt` (or srun) runs one copy per GPU, each on its own slice of
// every batch, exactly as the CPU trainer does over MPI; its DataParallel section is the reference
// and this file's (below the model) reads the same, plus what GPUs add: the gradients of each bucket
// of layers are summed across ranks on a second CUDA stream while the backward pass goes on with the
// layers below (docs/parallelism.md). Rank 0 alone prints, evaluates, samples and writes model.bin.
// Buffers are sized from the optimizer slice this rank holds (ZeRO-1: 1/N of master, m and v).
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/cli.h"
#include "llmc/comm_nccl.cuh"
#include "llmc/dataloader.h"
#include "llmc/estimate.h"
#include "llmc/formats.h"
#include "llmc/gpu_buffers.h"
#include "llmc/hellaswag.h"
#include "llmc/metrics.h"
#include "llmc/model.h"
#include "llmc/sampler.h"
#include "llmc/sharding.h"
#include "llmc/training.h"
#include "llmc/utils.h"

#include "llmc/cuda_common.cuh"
#include "llmc/adamw.cuh"
#include "llmc/attention.cuh"
#include "llmc/encoder.cuh"
#include "llmc/fused_classifier.cuh"
#include "llmc/gelu.cuh"
#include "llmc/global_norm.cuh"
#include "llmc/layernorm.cuh"
#include "llmc/matmul.cuh"

// ==============================================================================================
// Host <-> device copies of parameter-like arrays (fp32 on the host, floatX on the device)

static void upload_rounded(floatX* dst, const float* src, size_t n) {
    if constexpr (FLOATX_IS_FP32) {
        CUDA_CHECK(cudaMemcpy(dst, src, n * sizeof(float), cudaMemcpyHostToDevice));
    } else {
        std::vector<uint16_t> half(n);
        for (size_t i = 0; i < n; i++) half[i] = float_to_bf16_round_nearest(src[i]);
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
        for (size_t i = 0; i < n; i++) out[i] = bf16_to_float(half[i]);
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

struct GPT2 {
    GPT2Config config;
    ParamLayout layout;
    GPURunShape shape;                  // what the buffers were sized for
    std::vector<BufferSpec> table;   // ... and the sizes
    void* buf[GB_COUNT] = {};
    ParamTensors<floatX> p, g;          // each tensor inside params / grads
    int B = 0, T = 0;
    cudaStream_t stream = nullptr;
    MatmulContext matmul;
    AttentionContext attention;
    // host side of a micro-batch, in pinned memory so the copies are true DMA
    int* host_inputs = nullptr;
    int* host_targets = nullptr;
    int* host_buckets = nullptr;
    float* host_losses = nullptr;
    std::vector<int> bucket_count;
    int buckets = 0;
};

template <class T> static T* B_(GPT2* m, GPUBuffer b) { return (T*)m->buf[b]; }

// The shape of one layer's slice of a stacked activation.
static floatX* layer_x(GPT2* m, GPUBuffer b, int l, size_t per_layer) { return B_<floatX>(m, b) + (size_t)l * per_layer; }
static float* layer_f(GPT2* m, GPUBuffer b, int l, size_t per_layer) { return B_<float>(m, b) + (size_t)l * per_layer; }

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
    for (int i = 0; i < GB_COUNT; i++)
        if (m->buf[i]) CUDA_CHECK(cudaFree(m->buf[i]));
    CUDA_CHECK(cudaFreeHost(m->host_inputs));
    CUDA_CHECK(cudaFreeHost(m->host_targets));
    CUDA_CHECK(cudaFreeHost(m->host_buckets));
    CUDA_CHECK(cudaFreeHost(m->host_losses));
    CUDA_CHECK(cudaStreamDestroy(m->stream));
}

// Copies a micro-batch to the GPU. targets may be null (sampling). Synchronous with respect to the
// host buffers: the next call may overwrite them.
static void gpt2_upload_batch(GPT2* m, const int* inputs, const int* targets) {
    size_t BT = (size_t)m->B * m->T;
    memcpy(m->host_inputs, inputs, BT * sizeof(int));
    CUDA_CHECK(cudaMemcpyAsync(B_<int>(m, GB_INPUTS), m->host_inputs, BT * sizeof(int), cudaMemcpyHostToDevice, m->stream));
    if (targets) {
        memcpy(m->host_targets, targets, BT * sizeof(int));
        CUDA_CHECK(cudaMemcpyAsync(B_<int>(m, GB_TARGETS), m->host_targets, BT * sizeof(int), cudaMemcpyHostToDevice, m->stream));
        // the encoder backward's buckets: positions grouped by token (see encoder.cuh)
        m->buckets = encoder_buckets_build(inputs, (int)BT, m->config.vocab_size, &m->bucket_count, m->host_buckets);
        CUDA_CHECK(cudaMemcpyAsync(B_<int>(m, GB_ENCODER_BUCKETS), m->host_buckets, (2 * BT + 1 + m->buckets) * sizeof(int),
                                   cudaMemcpyHostToDevice, m->stream));
    }
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
}

// Forward pass of the uploaded micro-batch, up to the logits (B, T, Vp).
static void gpt2_forward(GPT2* m) {
    const GPT2Config& c = m->config;
    int L = c.num_layers, C = c.channels, NH = c.num_heads, Vp = c.padded_vocab_size, B = m->B, T = m->T;
    int BT = B * T;
    size_t btc = (size_t)BT * C;
    bool keep_ln = m->shape.recompute < 2, keep_gelu = m->shape.recompute < 1;
    bool simple = !m->attention.use_cudnn;
    cudaStream_t s = m->stream;
    const ParamTensors<floatX>& p = m->p;
    floatX* scratch = B_<floatX>(m, GB_SCRATCH_C);  // each projection's output, before the residual add

    encoder_forward(layer_x(m, GB_RESIDUAL, 0, btc), B_<int>(m, GB_INPUTS), p[WTE], p[WPE], B, T, C, s);
    for (int l = 0; l < L; l++) {
        floatX* residual = layer_x(m, GB_RESIDUAL, l, btc);
        floatX* ln1 = keep_ln ? layer_x(m, GB_LN1, l, btc) : B_<floatX>(m, GB_LN_RECOMPUTE);
        floatX* qkv = layer_x(m, GB_QKV, l, btc * 3);
        floatX* atty = layer_x(m, GB_ATTY, l, btc);
        floatX* residual2 = layer_x(m, GB_RESIDUAL2, l, btc);
        floatX* ln2 = keep_ln ? layer_x(m, GB_LN2, l, btc) : B_<floatX>(m, GB_LN_RECOMPUTE);
        floatX* fch = layer_x(m, GB_FCH, l, btc * 4);
        floatX* fch_gelu = keep_gelu ? layer_x(m, GB_FCH_GELU, l, btc * 4) : B_<floatX>(m, GB_GELU_RECOMPUTE);
        float* stats = simple ? nullptr : layer_f(m, GB_ATT, l, (size_t)B * NH * T);
        floatX* att = simple ? layer_x(m, GB_ATT, l, (size_t)B * NH * T * T) : nullptr;

        // ln1: layer 0 normalises the embeddings; every later layer's ln1 was fused into the
        // residual add that ended the previous layer (below)
        if (l == 0) {
            fused_residual_layernorm_forward(nullptr, ln1, layer_f(m, GB_LN1_MEAN, 0, BT), layer_f(m, GB_LN1_RSTD, 0, BT),
                                             residual, nullptr, p[LN1W], p[LN1B], BT, C, s);
        }
        matmul_forward(&m->matmul, qkv, ln1, p[QKVW] + (size_t)l * 3 * C * C, p[QKVB] + (size_t)l * 3 * C, BT, C, 3 * C, s);
        attention_forward(&m->attention, atty, stats, att, qkv, B, T, C, NH, s);
        matmul_forward(&m->matmul, scratch, atty, p[ATTPROJW] + (size_t)l * C * C, p[ATTPROJB] + (size_t)l * C, BT, C, C, s);
        fused_residual_layernorm_forward(residual2, ln2, layer_f(m, GB_LN2_MEAN, l, BT), layer_f(m, GB_LN2_RSTD, l, BT),
                                         residual, scratch, p[LN2W] + (size_t)l * C, p[LN2B] + (size_t)l * C, BT, C, s);
        matmul_forward(&m->matmul, fch, ln2, p[FCW] + (size_t)l * 4 * C * C, p[FCB] + (size_t)l * 4 * C, BT, C, 4 * C, s);
        gelu_forward(fch_gelu, fch, btc * 4, s);
        matmul_forward(&m->matmul, scratch, fch_gelu, p[FCPROJW] + (size_t)l * 4 * C * C, p[FCPROJB] + (size_t)l * C, BT,
                       4 * C, C, s);
        // residual[l+1] = residual2 + MLP output, fused with the next LayerNorm (ln1 of l+1, or lnf)
        floatX* next_residual = layer_x(m, GB_RESIDUAL, l + 1, btc);
        if (l + 1 < L) {
            floatX* next_ln1 = keep_ln ? layer_x(m, GB_LN1, l + 1, btc) : B_<floatX>(m, GB_LN_RECOMPUTE);
            fused_residual_layernorm_forward(next_residual, next_ln1, layer_f(m, GB_LN1_MEAN, l + 1, BT),
                                             layer_f(m, GB_LN1_RSTD, l + 1, BT), residual2, scratch,
                                             p[LN1W] + (size_t)(l + 1) * C, p[LN1B] + (size_t)(l + 1) * C, BT, C, s);
        } else {
            fused_residual_layernorm_forward(next_residual, B_<floatX>(m, GB_LNF), B_<float>(m, GB_LNF_MEAN),
                                             B_<float>(m, GB_LNF_RSTD), residual2, scratch, p[LNFW], p[LNFB], BT, C, s);
        }
    }
    if (L == 0) {
        fused_residual_layernorm_forward(nullptr, B_<floatX>(m, GB_LNF), B_<float>(m, GB_LNF_MEAN), B_<float>(m, GB_LNF_RSTD),
                                         layer_x(m, GB_RESIDUAL, 0, btc), nullptr, p[LNFW], p[LNFB], BT, C, s);
    }
    matmul_forward(&m->matmul, B_<floatX>(m, GB_LOGITS), B_<floatX>(m, GB_LNF), p[WTE], nullptr, BT, C, Vp, s);  // tied
}

// Loss of the forward just run, per token into GB_LOSSES, and the mean returned (summed on the host in
// double, as the CPU does). With write_grad, the logits become d(loss)/d(logits) * dloss, in place.
static float gpt2_classifier(GPT2* m, float dloss, bool write_grad) {
    const GPT2Config& c = m->config;
    int BT = m->B * m->T;
    fused_classifier(B_<floatX>(m, GB_LOGITS), B_<float>(m, GB_LOSSES), B_<int>(m, GB_TARGETS), dloss, BT, c.vocab_size,
                     c.padded_vocab_size, write_grad, m->stream);
    CUDA_CHECK(cudaMemcpyAsync(m->host_losses, B_<float>(m, GB_LOSSES), BT * sizeof(float), cudaMemcpyDeviceToHost, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    double total = 0.0;
    for (int i = 0; i < BT; i++) total += m->host_losses[i];
    return (float)(total / BT);
}

// Data parallelism (defined below, with the rest of it): hands a bucket of finished gradients to the
// communication stream.
struct DataParallel;
static void reduce_bucket_async(DataParallel* dp, GPT2* m, int bucket);

// Backward pass of the last forward + classifier(write_grad). Gradients are ADDED to GB_GRADS. With
// `dp` (the last micro-batch of a step, several ranks), each layer's gradients start their trip across
// the ranks as soon as that layer is done: bucket 0 is the last layer, bucket L the embeddings.
static void gpt2_backward(GPT2* m, DataParallel* dp) {
    const GPT2Config& c = m->config;
    int L = c.num_layers, C = c.channels, NH = c.num_heads, Vp = c.padded_vocab_size, B = m->B, T = m->T;
    int BT = B * T;
    size_t btc = (size_t)BT * C;
    bool keep_ln = m->shape.recompute < 2, keep_gelu = m->shape.recompute < 1;
    bool simple = !m->attention.use_cudnn;
    cudaStream_t s = m->stream;
    const ParamTensors<floatX>& p = m->p;
    const ParamTensors<floatX>& g = m->g;
    floatX* dresidual = B_<floatX>(m, GB_DRESIDUAL);
    floatX* dbuf_c = B_<floatX>(m, GB_SCRATCH_C);
    floatX* dbuf_3c = B_<floatX>(m, GB_SCRATCH_3C);
    floatX* dbuf_4c = B_<floatX>(m, GB_SCRATCH_4C);
    float* partials = B_<float>(m, GB_REDUCE_PARTIALS);
    floatX* dlogits = B_<floatX>(m, GB_LOGITS);

    // classifier (the tied LM head) and final LayerNorm
    matmul_backward_data(&m->matmul, dbuf_c, dlogits, p[WTE], BT, C, Vp, s);
    matmul_backward_weight(&m->matmul, g[WTE], dlogits, B_<floatX>(m, GB_LNF), BT, C, Vp, s);
    CUDA_CHECK(cudaMemsetAsync(dresidual, 0, btc * sizeof(floatX), s));
    layernorm_backward(dresidual, g[LNFW], g[LNFB], partials, dbuf_c, layer_x(m, GB_RESIDUAL, L, btc), p[LNFW],
                       B_<float>(m, GB_LNF_MEAN), B_<float>(m, GB_LNF_RSTD), BT, C, s);

    for (int l = L - 1; l >= 0; l--) {
        floatX* residual = layer_x(m, GB_RESIDUAL, l, btc);
        floatX* residual2 = layer_x(m, GB_RESIDUAL2, l, btc);
        floatX* qkv = layer_x(m, GB_QKV, l, btc * 3);
        floatX* atty = layer_x(m, GB_ATTY, l, btc);
        floatX* fch = layer_x(m, GB_FCH, l, btc * 4);
        float* ln1_mean = layer_f(m, GB_LN1_MEAN, l, BT), *ln1_rstd = layer_f(m, GB_LN1_RSTD, l, BT);
        float* ln2_mean = layer_f(m, GB_LN2_MEAN, l, BT), *ln2_rstd = layer_f(m, GB_LN2_RSTD, l, BT);
        const floatX* ln1w = p[LN1W] + (size_t)l * C, *ln1b = p[LN1B] + (size_t)l * C;
        const floatX* ln2w = p[LN2W] + (size_t)l * C, *ln2b = p[LN2B] + (size_t)l * C;
        const floatX* qkvw = p[QKVW] + (size_t)l * 3 * C * C;
        const floatX* attprojw = p[ATTPROJW] + (size_t)l * C * C;
        const floatX* fcw = p[FCW] + (size_t)l * 4 * C * C;
        const floatX* fcprojw = p[FCPROJW] + (size_t)l * 4 * C * C;

        // recompute what was not kept, with the forward's own kernels (so, bit-identically)
        floatX* fch_gelu = layer_x(m, GB_FCH_GELU, l, btc * 4);
        if (!keep_gelu) {
            fch_gelu = B_<floatX>(m, GB_GELU_RECOMPUTE);
            gelu_forward(fch_gelu, fch, btc * 4, s);
        }
        floatX* ln2 = layer_x(m, GB_LN2, l, btc);
        if (!keep_ln) {
            ln2 = B_<floatX>(m, GB_LN_RECOMPUTE);
            layernorm_recompute(ln2, residual2, ln2_mean, ln2_rstd, ln2w, ln2b, BT, C, s);
        }

        // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
        matmul_backward_data(&m->matmul, dbuf_4c, dresidual, fcprojw, BT, 4 * C, C, s);
        matmul_backward_weight(&m->matmul, g[FCPROJW] + (size_t)l * 4 * C * C, dresidual, fch_gelu, BT, 4 * C, C, s);
        bias_backward(g[FCPROJB] + (size_t)l * C, partials, dresidual, BT, C, s);
        gelu_backward_inplace(dbuf_4c, fch, btc * 4, s);
        matmul_backward_data(&m->matmul, dbuf_c, dbuf_4c, fcw, BT, C, 4 * C, s);
        matmul_backward_weight(&m->matmul, g[FCW] + (size_t)l * 4 * C * C, dbuf_4c, ln2, BT, C, 4 * C, s);
        bias_backward(g[FCB] + (size_t)l * 4 * C, partials, dbuf_4c, BT, 4 * C, s);
        layernorm_backward(dresidual, g[LN2W] + (size_t)l * C, g[LN2B] + (size_t)l * C, partials, dbuf_c, residual2,
                           ln2w, ln2_mean, ln2_rstd, BT, C, s);

        // attention: residual2 = residual + attproj(attention(qkv(ln1(residual))))
        matmul_backward_data(&m->matmul, dbuf_c, dresidual, attprojw, BT, C, C, s);
        matmul_backward_weight(&m->matmul, g[ATTPROJW] + (size_t)l * C * C, dresidual, atty, BT, C, C, s);
        bias_backward(g[ATTPROJB] + (size_t)l * C, partials, dresidual, BT, C, s);
        float* stats = simple ? nullptr : layer_f(m, GB_ATT, l, (size_t)B * NH * T);
        floatX* att = simple ? layer_x(m, GB_ATT, l, (size_t)B * NH * T * T) : nullptr;
        attention_backward(&m->attention, dbuf_3c, dbuf_c, qkv, atty, stats, att, B, T, C, NH, s);
        floatX* ln1 = layer_x(m, GB_LN1, l, btc);
        if (!keep_ln) {
            ln1 = B_<floatX>(m, GB_LN_RECOMPUTE);
            layernorm_recompute(ln1, residual, ln1_mean, ln1_rstd, ln1w, ln1b, BT, C, s);
        }
        matmul_backward_data(&m->matmul, dbuf_c, dbuf_3c, qkvw, BT, C, 3 * C, s);
        matmul_backward_weight(&m->matmul, g[QKVW] + (size_t)l * 3 * C * C, dbuf_3c, ln1, BT, C, 3 * C, s);
        bias_backward(g[QKVB] + (size_t)l * 3 * C, partials, dbuf_3c, BT, 3 * C, s);
        layernorm_backward(dresidual, g[LN1W] + (size_t)l * C, g[LN1B] + (size_t)l * C, partials, dbuf_c, residual,
                           ln1w, ln1_mean, ln1_rstd, BT, C, s);
        if (dp) reduce_bucket_async(dp, m, L - 1 - l);  // layer l's gradients are final
    }
    encoder_backward(g[WTE], g[WPE], dresidual, B_<int>(m, GB_ENCODER_BUCKETS), m->buckets, B, T, C, s);
    if (dp) reduce_bucket_async(dp, m, L);  // wte (LM head + embedding), wpe, lnf
}

// ==============================================================================================
// Data parallelism and ZeRO-1 (docs/parallelism.md; llmc/comm_nccl.cuh moves the bytes)
//
// The same design as the CPU trainer's DataParallel, read that first: N ranks, each on its own slice
// of every batch, each seeding its backward with 1/(tokens of the whole step) so that the step's
// gradient is the plain SUM over ranks; ZeRO-0 and ZeRO-1 sum identically and differ only in what is
// gathered afterwards (gradients, or updated parameters), so they give bit-identical weights.
// What the GPU adds is overlap, on two CUDA streams:
//
//   compute stream:  backward layer L-1 | layer L-2 | layer L-3 | ... | layer 0 | embeddings | norm, AdamW
//   comm stream:          (event) -> sum bucket 0 | sum bucket 1 | ...          | bucket L   |
//                                                                   host waits here ^ (gpu_comm_wait)
//
// After each layer's backward (on the last micro-batch only: the earlier ones just accumulate into
// the gradient buffer) an event is recorded on the compute stream; the communication stream waits for
// that event, then sums the layer's gradients across ranks while the compute stream goes on with the
// layers below. The embeddings come last: wte is also the LM head, so its gradient is final only
// after the encoder's backward. The host blocks once, before the gradient norm, in gpu_comm_wait,
// which polls against --comm-timeout: the compute stream never waits for the communication stream on
// the GPU, so a collective stuck on a dead rank can only ever stall a wait that has a deadline.
//
// Each bucket is 12 ranges of the flat gradient array (one per stacked per-layer tensor), cut by the
// shard boundaries into uneven pieces; each piece is summed onto the rank whose shard holds it
// ("reduce to owners", llmc/sharding.h): a reduce-scatter with pieces of any size, with the same
// bytes. Then, like the CPU trainer: norm = sqrt(sum over ranks of each shard's sum of squares);
// ZeRO-0 all-gathers the summed gradient and every rank runs AdamW on everything, ZeRO-1 runs AdamW
// on its shard (its master weights, m and v are that shard only) and all-gathers the bf16 parameters.
//
// The gradients are summed in bf16 (NCCL adds in fp32 and rounds each partial sum to bf16): 2 bytes
// per parameter instead of 4. One GPU accumulating N micro-batches also rounds its bf16 gradient
// once per micro-batch, so N ranks add no more rounding than N accumulation steps already do.

constexpr ncclDataType_t NCCL_FLOATX = FLOATX_IS_FP32 ? ncclFloat32 : ncclBfloat16;

struct DataParallel {
    Comm comm;
    GpuComm gpu;                    // NCCL (or host staging) and the communication stream
    int zero_stage = 0;
    ShardLayout shards;             // the flat parameter array, padded and cut into world_size equal shards
    ShardRange shard;               // this rank's shard, padding included: what the collectives move
    ShardRange updated;             // the parameters this rank's AdamW updates and keeps master, m, v for
    std::vector<std::vector<ShardRange>> buckets;  // the ranges of each gradient bucket, in backward order
    std::vector<cudaEvent_t> bucket_done;          // recorded on the compute stream after each bucket's backward
    cudaEvent_t update_done = nullptr;             // after AdamW: ZeRO-1's all-gather waits for it
};

// After comm_init and gpu_comm_init (the events belong to this rank's GPU).
static void data_parallel_setup(DataParallel* dp, const GPT2Config& cfg, int zero_stage) {
    ParamLayout layout = param_layout(cfg);
    dp->zero_stage = zero_stage;
    dp->shards = shard_layout(layout.total, dp->comm.world_size);
    dp->shard = shard_range(dp->shards, dp->comm.rank);
    dp->updated = zero_stage == 1 ? owned_range(dp->shards, dp->comm.rank) : ShardRange{0, layout.total};
    for (int b = 0; b < gradient_bucket_count(cfg.num_layers); b++) {
        dp->buckets.push_back(gradient_bucket(layout, cfg.num_layers, b));
        cudaEvent_t done;
        CUDA_CHECK(cudaEventCreateWithFlags(&done, cudaEventDisableTiming));
        dp->bucket_done.push_back(done);
    }
    CUDA_CHECK(cudaEventCreateWithFlags(&dp->update_done, cudaEventDisableTiming));
}

static void data_parallel_finish(DataParallel* dp) {
    for (cudaEvent_t e : dp->bucket_done) CUDA_CHECK(cudaEventDestroy(e));
    CUDA_CHECK(cudaEventDestroy(dp->update_done));
    gpu_comm_finalize(&dp->gpu);
    comm_finalize(&dp->comm);
}

// What this rank's buffers hold: params and grads padded to equal shards, its slice of the optimizer.
static void shape_for_rank(GPURunShape* s, const DataParallel& dp) {
    s->world_size = dp.comm.world_size;
    s->opt_begin = dp.updated.begin;
    s->opt_count = dp.updated.size();
}

// Starts summing bucket `bucket` across ranks as soon as the compute stream has written it, and
// returns at once: the host goes on enqueueing the backward of the layers below.
static void reduce_bucket_async(DataParallel* dp, GPT2* m, int bucket) {
    if (dp->comm.world_size == 1) return;
    CUDA_CHECK(cudaEventRecord(dp->bucket_done[bucket], m->stream));
    CUDA_CHECK(cudaStreamWaitEvent(dp->gpu.stream, dp->bucket_done[bucket], 0));
    gpu_reduce_to_owners(&dp->gpu, m->buf[GB_GRADS], NCCL_FLOATX, dp->shards, dp->buckets[bucket],
                         "reduction of the gradients");
}

// The sum of squares of grads[range]: GLOBAL_NORM_BLOCKS partial sums on the GPU (a fixed grid, so a
// fixed order), added here in block order, in fp64.
static double gradient_sum_of_squares(GPT2* m, ShardRange range) {
    float* partials = B_<float>(m, GB_NORM_PARTIALS);
    global_norm_partials(partials, B_<floatX>(m, GB_GRADS) + range.begin, range.size(), m->stream);
    std::vector<float> host(GLOBAL_NORM_BLOCKS);
    CUDA_CHECK(cudaMemcpyAsync(host.data(), partials, GLOBAL_NORM_BLOCKS * sizeof(float), cudaMemcpyDeviceToHost, m->stream));
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
    double total = 0.0;
    for (float p : host) total += p;
    return total;
}

// Waits for the buckets' sums, then returns the global gradient norm (of the summed gradient, as one
// rank would compute it): each rank's shard's sum of squares, added over ranks in rank order, so every
// rank gets the same bits. With `gather_all`, every rank then also holds the whole summed gradient
// (ZeRO-0; or to dump it).
static float reduce_gradients(GPT2* m, DataParallel* dp, bool gather_all) {
    gpu_comm_wait(&dp->gpu, "reduction of the gradients");
    double squares = gradient_sum_of_squares(m, dp->shard);
    float norm = (float)std::sqrt(gpu_comm_sum(&dp->gpu, squares, "sum of the gradient norms"));
    if (gather_all) {
        gpu_all_gather(&dp->gpu, m->buf[GB_GRADS], dp->shards.shard_size, NCCL_FLOATX, "all-gather of the gradients");
        gpu_comm_wait(&dp->gpu, "all-gather of the gradients");
    }
    return norm;
}

// Clipping and AdamW over the parameters this rank updates (all of them, or its ZeRO-1 shard), in one
// launch (llmc/adamw.cuh); ZeRO-1 then all-gathers the updated bf16 parameters. Returns when the new
// parameters are in place on every rank.
static void optimizer_step(GPT2* m, DataParallel* dp, const TrainOptions& o, float lr, int step, float norm) {
    float* norm_on_gpu = B_<float>(m, GB_NORM_PARTIALS) + GLOBAL_NORM_BLOCKS;  // the kernel reads it for the clip factor
    CUDA_CHECK(cudaMemcpyAsync(norm_on_gpu, &norm, sizeof(float), cudaMemcpyHostToDevice, m->stream));  // copied out at once
    AdamWParams a;
    a.lr = lr;
    a.beta1 = o.beta1;
    a.beta2 = o.beta2;
    a.eps = o.adam_eps;
    a.weight_decay = o.weight_decay;
    a.bias_correction1 = 1.0f - powf(o.beta1, (float)step);
    a.bias_correction2_sqrt = sqrtf(1.0f - powf(o.beta2, (float)step));
    a.max_norm = o.grad_clip;
    a.seed = o.seed;
    a.step = step;
    a.decay_mask = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        a.tensor_offset[t] = m->layout.offset[t];
        if (param_tensor_decays(t)) a.decay_mask |= 1u << t;
    }
    if (dp->updated.size() > 0) {  // with more ranks than shards of parameters, a rank may own none
        adamw_update(B_<floatX>(m, GB_PARAMS), m->shape.master_weights ? B_<float>(m, GB_MASTER) : nullptr,
                     B_<floatX>(m, GB_GRADS), B_<float>(m, GB_ADAM_M), B_<float>(m, GB_ADAM_V), dp->updated.begin,
                     dp->updated.size(), norm_on_gpu, a, m->stream);
    }
    if (dp->zero_stage == 1 && dp->comm.world_size > 1) {
        CUDA_CHECK(cudaEventRecord(dp->update_done, m->stream));
        CUDA_CHECK(cudaStreamWaitEvent(dp->gpu.stream, dp->update_done, 0));
        gpu_all_gather(&dp->gpu, m->buf[GB_PARAMS], dp->shards.shard_size, NCCL_FLOATX, "all-gather of the parameters");
        gpu_comm_wait(&dp->gpu, "all-gather of the parameters");
    }
    CUDA_CHECK(cudaStreamSynchronize(m->stream));
}

// The whole model's fp32 master weights, on every rank (for --dump-state): ZeRO-1's shards are
// gathered through a temporary buffer (a test feature, outside the buffer table). Without master
// weights, the bf16 parameters widened.
static std::vector<float> full_master_weights(GPT2* m, DataParallel* dp) {
    size_t P = m->layout.total;
    if (!m->shape.master_weights) return download_as_float(B_<floatX>(m, GB_PARAMS), P);
    if (dp->updated.begin == 0 && dp->updated.size() == P) return download_floats(B_<float>(m, GB_MASTER), P);
    float* all = nullptr;
    cudaStream_t s = dp->gpu.stream;  // the copies and the all-gather in one stream: in order
    CUDA_CHECK(cudaMalloc(&all, dp->shards.padded_total * sizeof(float)));
    CUDA_CHECK(cudaMemsetAsync(all, 0, dp->shards.padded_total * sizeof(float), s));
    if (dp->updated.size() > 0) {
        CUDA_CHECK(cudaMemcpyAsync(all + dp->updated.begin, m->buf[GB_MASTER], dp->updated.size() * sizeof(float),
                                   cudaMemcpyDeviceToDevice, s));
    }
    gpu_all_gather(&dp->gpu, all, dp->shards.shard_size, ncclFloat32, "all-gather of the master weights");
    gpu_comm_wait(&dp->gpu, "all-gather of the master weights");
    std::vector<float> out = download_floats(all, P);
    CUDA_CHECK(cudaFree(all));
    return out;
}

// Every rank must start from the same weights. Each builds them the same way (the same file, or the
// same seeded initialisation), so instead of sending 4P bytes from rank 0 (the CPU trainer's
// broadcast, which needs MPI) the ranks compare a 53-bit hash of them: different files behind the
// same path on different nodes fail here, not as replicas that silently drift apart.
static void check_same_weights(DataParallel* dp, const std::vector<float>& params) {
    if (dp->comm.world_size == 1) return;
    uint64_t h = 0xcbf29ce484222325ull;
    const uint32_t* words = (const uint32_t*)params.data();
    for (size_t i = 0; i < params.size(); i++) h = (h ^ words[i]) * 0x100000001b3ull;
    std::vector<double> all = gpu_comm_gather(&dp->gpu, (double)(h >> 11), "comparing the initial weights");
    for (int r = 0; r < dp->comm.world_size; r++) {
        if (all[r] != all[0]) {
            fail("rank %d loaded different initial weights from rank 0's (the model file or checkpoint differs between "
                 "nodes?): every rank must see the same --model and --out-dir", r);
        }
    }
}

// ==============================================================================================
// The training loop

static float evaluate(GPT2* m, DataLoader* val, int batches) {
    dataloader_reset(val);
    double total = 0.0;
    for (int i = 0; i < batches; i++) {
        dataloader_next_batch(val);
        gpt2_upload_batch(m, val->inputs.data(), val->targets.data());
        gpt2_forward(m);
        total += gpt2_classifier(m, 0.0f, false);
    }
    return (float)(total / batches);
}

// Generates tokens after <|endoftext|>. The model runs on the full (B, T) it was sized for (one
// cuDNN plan, no new shapes); the prefix sits at the start of row 0 and, attention being causal,
// what follows it cannot change the logits we read.
static void print_sample(GPT2* m, const TrainOptions& o, const SampleDecoder& decoder, uint64_t* rng) {
    const GPT2Config& c = m->config;
    int T = m->T;
    std::vector<int> tokens = {50256 < c.vocab_size ? 50256 : 0};
    std::vector<int> batch((size_t)m->B * T, 0);
    std::vector<float> logits(c.padded_vocab_size);
    for (int i = 0; i < o.sample_tokens; i++) {
        int len = std::min((int)tokens.size(), T);
        std::copy(tokens.end() - len, tokens.end(), batch.begin());
        gpt2_upload_batch(m, batch.data(), nullptr);
        gpt2_forward(m);
        logits = download_as_float(B_<floatX>(m, GB_LOGITS) + (size_t)(len - 1) * c.padded_vocab_size, c.padded_vocab_size);
        int next = sample_token(logits.data(), c.vocab_size, o.temperature, o.top_k, rng);
        tokens.push_back(next);
    }
    print_sample_text(decoder, std::vector<int>(tokens.begin() + 1, tokens.end()));
}

// A checkpoint of N ranks, as the CPU trainer writes it: rank 0 makes "<ckpt>.tmp" and writes
// model.bin (the bf16 weights, bit for bit: a resumed run continues from exactly these); the optimizer
// state with the fp32 master weights goes to state.bin (ZeRO-0: rank 0 holds all of it) or to one
// state_rank<r>.bin per rank (ZeRO-1: each its shard); when every rank has written, rank 0 renames
// the directory into place.
static void save_checkpoint(GPT2* m, DataParallel* dp, const RunPlan& plan, const TrainOptions& o, int step,
                            const DataLoader& train, uint64_t sampler_rng) {
    bool leader = dp->comm.rank == 0;
    auto barrier = [&](const char* what) { gpu_comm_barrier(&dp->gpu, what); };
    std::string tmp = open_checkpoint_together(o.out_dir, step, dp->comm.rank, barrier);
    size_t P = m->layout.total, count = dp->updated.size();
    if (leader) {
        if constexpr (FLOATX_IS_FP32) {
            std::vector<float> params = download_floats((const float*)m->buf[GB_PARAMS], P);
            write_model_file(tmp + "/model.bin", m->config, params.data(), false);
        } else {
            std::vector<uint16_t> params(P);
            CUDA_CHECK(cudaMemcpy(params.data(), m->buf[GB_PARAMS], P * 2, cudaMemcpyDeviceToHost));
            write_model_file_bf16(tmp + "/model.bin", m->config, params.data());
        }
    }
    if (leader || dp->zero_stage == 1) {
        TrainState s;
        s.header = train_state_header(step, P, dp->updated, dp->comm.rank, dp->comm.world_size, dp->zero_stage, plan,
                                      sampler_rng, train.pos);
        s.header.has_master_weights = m->shape.master_weights ? 1 : 0;
        s.m = download_floats(B_<float>(m, GB_ADAM_M), count);
        s.v = download_floats(B_<float>(m, GB_ADAM_V), count);
        if (m->shape.master_weights) s.master = download_floats(B_<float>(m, GB_MASTER), count);
        write_train_state(tmp + "/" + state_file_name(dp->zero_stage, dp->comm.rank), s);
    }
    publish_checkpoint_together(o.out_dir, step, dp->comm.rank, barrier);
}

static void check_gpu_shape(const GPT2Config& cfg) {
    if (cfg.channels % 8 != 0 || (cfg.channels / cfg.num_heads) % 8 != 0) {
        fail("the GPU trainer needs channels and head size divisible by 8 (16-byte vector loads); this model has "
             "C=%d, head size %d. Use the CPU trainer for this shape", cfg.channels, cfg.channels / cfg.num_heads);
    }
}

int main(int argc, char** argv) {
    TrainOptions o;
    parse_command_line(argc, argv, Trainer::GPU, &o);
    validate_options(o);
    bool simple_attention = o.attention == "simple";
    if (FLOATX_IS_FP32 && !simple_attention) {
        printf("fp32 build: cuDNN's fused attention is bf16-only, using --attention simple\n");
        simple_attention = true;
    }
    bool master_weights = o.master_weights == 1 && !FLOATX_IS_FP32;  // fp32 parameters are their own master

    if (o.estimate) {  // no GPU needed: the table is arithmetic (llmc/estimate.h)
        print_estimate(estimate_setup(o, Trainer::GPU, (int)sizeof(floatX), master_weights, simple_attention));
        return 0;
    }

    // ---- the ranks: who am I, which GPU is mine, and how the ranks talk (NCCL, or host staging when
    // several share one GPU). With one process all of this is a no-op.
    DataParallel dp;
    comm_init(&dp.comm, o.comm_timeout);
    const Comm& comm = dp.comm;
    bool leader = comm.rank == 0;  // rank 0 alone prints, evaluates, samples and writes the model
    int devices = 0;
    cudaError_t probe = cudaGetDeviceCount(&devices);
    if (probe != cudaSuccess || devices == 0) {
        fail("no CUDA GPU is available (%s). Use ./train_gpt_cpu, which takes the same flags",
             probe != cudaSuccess ? cudaGetErrorString(probe) : "cudaGetDeviceCount found none");
    }
    gpu_comm_init(&dp.gpu, &dp.comm);  // also makes this rank's GPU the current device
    cudaDeviceProp props;
    CUDA_CHECK(cudaGetDeviceProperties(&props, dp.gpu.device));

    // ---- the model: from a checkpoint, a model file, or a descriptor (fp32 on the host)
    std::string resume_dir = resolve_resume_dir(o);
    GPT2Config cfg;
    std::vector<float> host_params;
    std::string model_source = load_initial_model(o, resume_dir, &cfg, &host_params);
    check_gpu_shape(cfg);
    check_same_weights(&dp, host_params);
    data_parallel_setup(&dp, cfg, o.zero_stage);
    {   // a batch that cannot fit stops here, before the data is read or anything allocated
        int T_early = o.seq_len > 0 ? std::min(o.seq_len, cfg.max_seq_len) : cfg.max_seq_len;
        GPURunShape early = gpu_run_shape(cfg, o.batch_size, T_early, o.recompute, master_weights, simple_attention,
                                          (int)sizeof(floatX));
        shape_for_rank(&early, dp);
        fail_unless_fits(early);
    }

    // ---- data and the shape of the run: each rank reads its own slice of every step
    DataLoader train, val;
    int T_data = o.seq_len > 0 ? std::min(o.seq_len, cfg.max_seq_len) : cfg.max_seq_len;
    if (!o.eval_only) {  // --eval-only needs no training data
        dataloader_init(&train, o.train_data, o.batch_size, T_data, comm.rank, comm.world_size, cfg.vocab_size,
                        "training data", "--train-data");
    }
    RunPlan plan = plan_run(o, cfg, comm.world_size, train.tokens_per_epoch);
    int B = plan.B, T = plan.T;
    bool have_val = leader && o.val_data != "none" && (o.val_every > 0 || o.eval_only);
    if (have_val) dataloader_init(&val, o.val_data, B, T, 0, 1, cfg.vocab_size, "validation data", "--val-data");

    // ---- the buffers: sized from the table, checked against free memory, then allocated
    GPT2 model;
    GPT2* m = &model;
    m->config = cfg;
    m->layout = param_layout(cfg);
    m->B = B;
    m->T = T;
    CUDA_CHECK(cudaStreamCreate(&m->stream));
    m->attention.use_cudnn = !simple_attention;
    GPURunShape& shape = m->shape;
    shape = gpu_run_shape(cfg, B, T, o.recompute, master_weights, simple_attention, (int)sizeof(floatX));
    shape_for_rank(&shape, dp);
    if (!simple_attention) {
        // cuDNN's workspace is known only once its plans exist: build them first (needs no buffers)
        cudnn_attention_init(&m->attention.cudnn);
        shape.cudnn_workspace_bytes = cudnn_attention_workspace(&m->attention.cudnn, B, T, cfg.channels, cfg.num_heads);
    }
    m->table = gpu_buffer_table(shape);
    size_t free_before = 0, total_memory = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_before, &total_memory));
    gpt2_allocate(m);
    matmul_init(&m->matmul, m->buf[GB_CUBLASLT_WORKSPACE], CUBLASLT_WORKSPACE_BYTES);
    if (simple_attention) {
        attention_init(&m->attention, false, m->buf[GB_CUBLASLT_WORKSPACE], CUBLASLT_WORKSPACE_BYTES);
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
    CUDA_CHECK(cudaMallocHost(&m->host_losses, BT * sizeof(float)));

    // ---- the state: bf16 parameters (rounded from fp32; the padding past the last tensor stays zero),
    // and for the parameters this rank updates, fp32 master weights and AdamW's moments
    size_t P = m->layout.total, count = dp.updated.size();
    CUDA_CHECK(cudaMemset(m->buf[GB_PARAMS], 0, m->table[GB_PARAMS].bytes()));
    upload_rounded(B_<floatX>(m, GB_PARAMS), host_params.data(), P);
    std::vector<float> adam_m(count, 0.0f), adam_v(count, 0.0f);
    // the master weights start as the fp32 values loaded (a v3 file's or a fresh init's full precision)
    std::vector<float> master(host_params.begin() + dp.updated.begin, host_params.begin() + dp.updated.end);
    uint64_t sampler_rng = o.seed ^ 0x5DEECE66Dull;
    int first_step = 0;
    TrainStateHeader resumed;
    if (!resume_dir.empty()) {
        // each rank reads the state of the parameters it updates, from whichever files hold it (any
        // world size, any ZeRO stage: resharding), master weights included when the checkpoint has them
        resumed = read_optimizer_state(resume_dir, P, dp.updated, adam_m.data(), adam_v.data(),
                                       master_weights ? master.data() : nullptr);
        check_resume_state(resumed, resume_dir, P, plan, true);
        if (master_weights && !resumed.has_master_weights && leader) {
            printf("note: the checkpoint has no fp32 master weights; starting them from model.bin's weights\n");
        }
        first_step = (int)resumed.step;
        sampler_rng = resumed.sampler_rng;
        if (!o.eval_only) dataloader_seek(&train, resumed.train_loader);
    }
    if (o.eval_only) plan.steps = first_step;  // evaluating is a run of zero steps
    if (count > 0) {  // (with more ranks than shards of parameters, a ZeRO-1 rank may own none)
        CUDA_CHECK(cudaMemcpy(m->buf[GB_ADAM_M], adam_m.data(), count * sizeof(float), cudaMemcpyHostToDevice));
        CUDA_CHECK(cudaMemcpy(m->buf[GB_ADAM_V], adam_v.data(), count * sizeof(float), cudaMemcpyHostToDevice));
        if (master_weights) CUDA_CHECK(cudaMemcpy(m->buf[GB_MASTER], master.data(), count * sizeof(float), cudaMemcpyHostToDevice));
    }
    host_params = std::vector<float>();
    adam_m = adam_v = master = std::vector<float>();

    double peak_tflops = gpu_peak_bf16_tflops(props.name);
    if (leader) {
        printf("device: %s, %s, compute capability %d.%d; %s\n", props.name, format_bytes((double)total_memory).c_str(),
               props.major, props.minor, peak_tflops > 0 ? strprintf("%.0f TFLOP/s dense bf16 peak", peak_tflops).c_str()
                                                         : "unknown GPU: no MFU reported");
        printf("model: %s (%s), %zu parameters\n", model_source.c_str(), describe_config(cfg).c_str(), P);
        printf("precision: %s, master weights %s; attention: %s; recompute %d\n", FLOATX_IS_FP32 ? "fp32" : "bf16",
               master_weights ? "fp32" : "off", simple_attention ? "simple" : "cudnn", o.recompute);
        printf("batch: B=%d T=%d, %d rank%s, %d accumulation step%s -> %lld tokens per step; %d steps\n", B, T,
               comm.world_size, comm.world_size == 1 ? "" : "s", plan.accumulation_steps,
               plan.accumulation_steps == 1 ? "" : "s", (long long)plan.total_batch_tokens, plan.steps);
        if (comm.world_size > 1) {
            printf("ranks: %d (%s, %d on this node; %s), ZeRO-%d: each rank updates %zu of %zu parameters%s\n",
                   comm.world_size, comm.launcher.c_str(), comm.local_size,
                   dp.gpu.host_staged ? "host-staged: ranks share a GPU, collectives go through MPI" : "NCCL",
                   dp.zero_stage, dp.updated.size(), P,
                   dp.zero_stage == 1 ? strprintf(" (shards of %zu, padded total %zu)", dp.shards.shard_size,
                                                  dp.shards.padded_total).c_str() : "");
        }
        if (!o.eval_only) printf("data: %zu training shard%s (%lld tokens)", train.files.size(), train.files.size() == 1 ? "" : "s",
               (long long)train.tokens_per_epoch);
        if (have_val) printf("%s%zu validation shard%s", o.eval_only ? "data: " : ", ", val.files.size(), val.files.size() == 1 ? "" : "s");
        printf("\n");
        print_gpu_buffer_table(m->table);
        if (first_step > 0) printf("resumed from %s at step %d\n", resume_dir.c_str(), first_step);
        if (first_step > 0 && (resumed.world_size != comm.world_size || resumed.zero_stage != dp.zero_stage)) {
            printf("resharded: the checkpoint was written by %d rank%s with ZeRO-%d, this run has %d with ZeRO-%d\n",
                   resumed.world_size, resumed.world_size == 1 ? "" : "s", resumed.zero_stage, comm.world_size, dp.zero_stage);
        }
    }

    size_t peak_used = 0;
    auto track_memory = [&]() {
        size_t free_now = 0, total_now = 0;
        CUDA_CHECK(cudaMemGetInfo(&free_now, &total_now));
        peak_used = std::max(peak_used, total_now - free_now);
    };
    track_memory();

    SampleDecoder decoder;
    if (leader) sample_decoder_init(&decoder, o, cfg);
    HellaSwagSet hellaswag = hellaswag_open(o, cfg, T, leader);
    MetricsLog mlog;
    metrics_open(&mlog, o, leader, "gpu", cfg, B, T, comm.world_size, plan.accumulation_steps, plan.total_batch_tokens,
                 plan.steps, first_step, model_source);
    auto run_hellaswag = [&](int step) {  // every rank scores its share at the model's one (B, T) shape; rank 0 reports
        HellaSwagResult r = hellaswag_evaluate(hellaswag, B, T, true, comm.rank, comm.world_size, [&](const int* in, const int* tg, int, int) {
            gpt2_upload_batch(m, in, tg);
            gpt2_forward(m);
            gpt2_classifier(m, 0.0f, false);
            return (const float*)m->host_losses;
        });
        for (int64_t* count : {&r.examples, &r.correct, &r.correct_sum}) *count = (int64_t)gpu_comm_sum(&dp.gpu, (double)*count, "sum of the hellaswag counts");
        if (leader) report_hellaswag(&mlog, step, r);
    };
    bool dumping = !o.dump_state.empty();
    DumpState dump;
    double flops_per_step = flops_per_token(cfg, T) * (double)plan.total_batch_tokens;
    for (int step = first_step; step < plan.steps; step++) {
        bool last_step = step == plan.steps - 1;
        comm_inject_fault(&comm, step + 1);
        if (have_val && step % o.val_every == 0) report_val_loss(&mlog, step, evaluate(m, &val, o.val_batches));
        if (hellaswag_due(o, hellaswag, step)) run_hellaswag(step);
        if (leader && is_sample_step(o, step)) print_sample(m, o, decoder, &sampler_rng);

        auto start = std::chrono::steady_clock::now();
        CUDA_CHECK(cudaMemsetAsync(m->buf[GB_GRADS], 0, m->table[GB_GRADS].bytes(), m->stream));
        double step_loss = 0.0;  // this rank's mean loss over its micro-batches
        for (int micro = 0; micro < plan.accumulation_steps; micro++) {
            dataloader_next_batch(&train);
            gpt2_upload_batch(m, train.inputs.data(), train.targets.data());
            gpt2_forward(m);
            bool dump_now = dumping && leader && step == first_step && micro == 0;
            if (dump_now) {
                size_t V = cfg.vocab_size, Vp = cfg.padded_vocab_size;
                std::vector<float> logits = download_as_float(B_<floatX>(m, GB_LOGITS), BT * Vp);
                dump.logits.resize(BT * V);
                for (size_t n = 0; n < BT; n++) memcpy(&dump.logits[n * V], &logits[n * Vp], V * sizeof(float));
            }
            // the optimised loss is the mean over all tokens of the step, all ranks together:
            // d/d(one token's loss) = 1/total, and the ranks' gradients simply add up
            float loss = gpt2_classifier(m, 1.0f / (float)plan.total_batch_tokens, true);
            if (dump_now) dump.loss = loss;
            bool last_micro = micro == plan.accumulation_steps - 1;
            gpt2_backward(m, last_micro ? &dp : nullptr);  // the last one also starts the reduction
            step_loss += loss / plan.accumulation_steps;
            if (leader) print_micro_step(step + 1, micro, plan.accumulation_steps, loss, seconds_since(start));
        }
        // every rank saw as many tokens, so the step's mean loss is the mean of the ranks' means
        step_loss = gpu_comm_sum(&dp.gpu, step_loss, "sum of the losses") / comm.world_size;
        if (!std::isfinite(step_loss)) {
            fail("the loss became %f at step %d: training diverged. Lower --lr, raise --warmup-steps, or check --grad-clip",
                 step_loss, step + 1);
        }
        bool dump_grads = dumping && step == first_step;
        float norm = reduce_gradients(m, &dp, dp.zero_stage == 0 || dump_grads);
        if (dump_grads && leader) dump.grads = download_as_float(B_<floatX>(m, GB_GRADS), P);
        float lr = learning_rate(plan.schedule, step);
        optimizer_step(m, &dp, o, lr, step + 1, norm);
        double seconds = seconds_since(start);
        if (step == first_step) track_memory();  // after the first step every library has what it wants
        if (dumping) dump.losses.push_back((float)step_loss);
        double mfu = peak_tflops > 0 ? 100.0 * flops_per_step / seconds / (peak_tflops * comm.world_size * 1e12) : -1.0;
        if (leader) {
            print_step_line(step + 1, plan.steps, step_loss, lr, norm, seconds, plan.total_batch_tokens, mfu,
                            seconds * (plan.steps - step - 1));
            metrics_step(&mlog, step + 1, step_loss, lr, norm, seconds, mfu, (double)peak_used);
        }

        if (o.checkpoint_every > 0 && ((step + 1) % o.checkpoint_every == 0 || last_step)) {
            save_checkpoint(m, &dp, plan, o, step + 1, train, sampler_rng);
        }
    }
    if (have_val) report_val_loss(&mlog, plan.steps, evaluate(m, &val, o.val_batches));
    if (!hellaswag.examples.empty()) run_hellaswag(plan.steps);
    if (leader && o.sample_every > 0) print_sample(m, o, decoder, &sampler_rng);
    track_memory();
    if (leader) {
        printf("GPU memory: peak %s in use on the device (the buffer table: %s; %s was in use before allocation)\n",
               format_bytes((double)peak_used).c_str(), format_bytes((double)gpu_buffer_total(m->table)).c_str(),
               format_bytes((double)(total_memory - free_before)).c_str());
        // the same in bytes, for scripts/measure_memory.py: the prediction is the table (--estimate), the
        // measurement what the device says was taken from before allocation to the peak
        printf("GPU memory bytes: table %zu, in use before allocation %zu, peak in use %zu, peak minus before %zu\n",
               gpu_buffer_total(m->table), total_memory - free_before, peak_used, peak_used - (total_memory - free_before));
    }

    if (dumping) {
        dump.params = full_master_weights(m, &dp);  // every rank takes part in the gather; rank 0 writes
        if (leader) {
            write_dump_state(o.dump_state, dump, cfg, B, T, "gpu");
            printf("dumped state to %s\n", o.dump_state.c_str());
        }
    }
    if (leader) print_run_summary(mlog);
    metrics_close(&mlog);
    gpt2_free(m);
    data_parallel_finish(&dp);
    return 0;
}
