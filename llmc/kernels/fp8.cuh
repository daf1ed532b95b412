// fp8.cuh — fp8 matmuls for the linear layers (--precision fp8, the bf16 build, Hopper or Ada):
// quantize bf16 to 8 bits with a per-tensor scale, multiply in cuBLASLt's fp8 tensor-core kernels,
// get bf16 back. Read matmul.cuh first: the three matmuls of a linear layer are the same here.
//
// What it teaches. Two 8-bit float formats (the OCP "OFP8" spec, Micikevicius et al. 2022, "FP8
// Formats for Deep Learning"):
//   e4m3  sign, 4 exponent bits (bias 7), 3 mantissa bits: max 448, smallest subnormal 2^-9, NO inf;
//         0x7f / 0xff are NaN (the top exponent is spent on finite values but for that one code).
//         Unit roundoff u = 2^-4 (a 6% step between neighbours).
//   e5m2  sign, 5 exponent bits (bias 15), 2 mantissa bits: max 57344, smallest subnormal 2^-16,
//         inf and NaN as in IEEE. Unit roundoff u = 2^-3, but 2^32 of range instead of 2^18.
// The forward's operands (activations, weights) have a narrow, stable spread of magnitudes and want
// precision: e4m3. The gradients spread over many more binades and change from step to step: e5m2.
// (The paper's recipe, and Transformer Engine's "HYBRID" format.)
//
// Neither format has the range of a tensor as it comes, so each tensor X gets a scale s (a power of
// two, so that scaling is exact): q = saturate(round(X s)), and X ~ q / s. The matmul dequantizes
// for free: cuBLASLt computes D = (1/s_a)(1/s_b) op(A) op(B) in fp32 and writes bf16, given the
// device floats 1/s_a, 1/s_b through CUBLASLT_MATMUL_DESC_A_SCALE_POINTER / B_SCALE_POINTER.
//
// Delayed scaling (the paper's Sec. 4, Transformer Engine's DelayedScaling): knowing amax = max |X|
// before quantizing X costs a pass over X. Instead each tensor keeps the amax of its last N steps
// (--fp8-amax-history N, default 16), and this step's scale comes from them:
//     s = 2^floor(log2(fmax / max(history)))       (fmax = 448 or 57344; margin 0)
// The quantize kernel records the amax of what it quantizes as it goes (an atomicMax on the float's
// bits: for floats >= 0 the bit patterns order as the values do), and once per step, after the
// backward, fp8_end_step rolls every history and computes the next scales, on the device. A value
// that outgrew the history saturates at +-fmax (never inf) for one step, then the scale follows.
// Step 1 has no history: its quantizations take one extra pass to measure their own amax first
// ("calibrating", a host flag that a resumed run does not set).
//
// The layout rule. On Hopper cuBLASLt's fp8 kernels take only "TN": A transposed, B not, i.e. both
// operands stored with k contiguous (row-major (m x k) and (n x k)); the dimensions multiples of 16;
// A and B may not both be e5m2. The forward (out = inp W^T) is TN as it is. The backward's two
// matmuls are not, so their operands are quantized TRANSPOSED (the quantize kernel writes q^T):
//   data    dinp (N x IC) = dout W:      A = W^T (IC x OC) e4m3,  B = dout (N x OC) e5m2
//   weight  dW (OC x IC) += dout^T inp:  A = inp^T (IC x N) e4m3, B = dout^T (OC x N) e5m2
// A tensor and its transpose share one scale and one amax (the same values).
//
// What stays in bf16/fp32: master weights, LayerNorm, softmax and attention (q k^T, att v), GELU,
// the classifier (logits feed the loss directly; the tied embedding is the largest, most sensitive
// matrix) and the loss. The output of every fp8 matmul is bf16, accumulated in fp32.
//
// Several ranks: one scale per tensor of the model, the same on every rank. Each rank measures the
// amax of what it quantized; train_gpt.cu's fp8_share_amax max-reduces amax_now before fp8_end_step,
// over the data-parallel group (each rank saw its own micro-batches) and then over the tensor group
// (each rank saw its own slice), so every rank rolls the whole tensor's amax over the whole batch into
// its histories and all choose the same scales from step 2 on.
//   Tensor parallelism (Megatron-LM: column-parallel qkv and fc, row-parallel projections), which of a
//   linear layer's three tensors a rank holds only a slice of:
//     qkv, fc (column-parallel, out = x W_r^T on W's rows r):  weight SPLIT, output gradient SPLIT,
//        input (ln1 / ln2 of all B*T rows, all-gathered with sequence parallelism) the same on every rank
//     attention and fc projection (row-parallel, partial = x_r W_r^T on W's columns r, then summed):
//        weight SPLIT, input (its heads' / its columns' activations) SPLIT, output gradient (d residual,
//        all-gathered with sequence parallelism) the same on every rank
//   A split tensor's slice has a smaller amax than the whole, and its own scale would differ from the
//   other ranks' wherever the two amax fall in different binades of fmax / amax. The matmuls would
//   still be right (each rank dequantizes before the sums), but the run would no longer be a partition
//   of the one-rank model's quantization (each value the code one rank gives it), the ranks' histories
//   would drift apart, and fp8_state.bin, written once for the grid by rank 0, would resume rank 1 on
//   rank 0's slices; and quantizing a slice before gathering it in fp8 (Transformer Engine's fp8
//   all-gather, not done here: we gather bf16 and quantize whole) needs one scale to make sense. The
//   replicated tensors have the same amax on every rank already; one all-reduce of all 12 per layer
//   is simpler than picking the 6 split ones, and exact (a max).
//   ZeRO-2 changes where the gradients go (a reduce-scatter into shards), not a matmul or a scale.
//   Pipeline stages hold other layers, whose slots are theirs alone (not proven with fp8 yet).
// Step 1's calibration measures each rank's own micro-batches and slices: the one step whose scales
// may differ between ranks (only where a slice's amax is under half the whole's: the scale is a power
// of two); each rank dequantizes before any sum, so the step is still right, and the state after
// step 1 is the shared one.
//
// Trade-off. Memory: two fp8 operand buffers (one matmul's largest input, weight or gradient, 1 byte
// an element) and 12 x (N + 3) floats of state per layer, rows of the size table (fp8_scaling,
// fp8_operand_a, fp8_operand_b in llmc/memory/gpu_buffers.h; --estimate prints them); no fp8 copy of
// the weights or activations is kept: the activations kept for the backward stay bf16 (the backward
// quantizes them again). Speed: Hopper's fp8 tensor cores do twice the dense
// FLOP/s of its bf16 ones (NVIDIA's H100 datasheet), paid for with the quantize passes (a read of
// bf16 and a write of 1 byte per element, 6 per linear layer per micro-batch; the transposed ones
// write uncoalesced here: the readable version). Not measured on a GPU yet.
//
// Hook points: train_gpt.cu's linear hook (linear_forward, linear_backward_data / _weight) calls
// fp8_linear_forward / _backward_data / _backward_weight instead of matmul.cuh's functions for the
// four linear layers, and its step_end calls fp8_end_step once per step (or the graphed passes, --cuda-graphs: everything
// here is device memory but step 1's calibration, and a run's first step is eager). The checkpoint:
// fp8_download_state / fp8_upload_state (fp8_state.bin, llmc/io/formats.h).
#pragma once

#include <cuda_fp8.h>
#include <cmath>
#include <vector>
#include "llmc/kernels/matmul.cuh"  // MatmulContext, CUBLAS_CHECK
#include "llmc/kernels/scratch_sizes.h"  // FP8_AMAX_HISTORY, fp8_state_floats, fp8_operand_bytes: the size table's

constexpr float FP8_E4M3_MAX = 448.0f, FP8_E5M2_MAX = 57344.0f;

// The quantized tensors of one linear layer, and the layers of a block.
enum Fp8Role { FP8_INPUT, FP8_WEIGHT, FP8_GRAD, FP8_ROLES };
enum Fp8Linear { FP8_QKV, FP8_ATTPROJ, FP8_FC, FP8_FCPROJ, FP8_LINEARS };

// slot of (layer, linear): its three tensors are slots s + FP8_INPUT, s + FP8_WEIGHT, s + FP8_GRAD
inline int fp8_slot(int layer, Fp8Linear linear) { return (layer * FP8_LINEARS + linear) * FP8_ROLES; }
static_assert(FP8_LINEARS * FP8_ROLES == FP8_TENSORS_PER_LAYER, "scratch_sizes.h sizes the fp8 state for 12 tensors a layer");

struct Fp8Matmuls {
    bool on = false;
    bool calibrating = true;      // no history yet: step 1 of a run that did not resume
    int tensors = 0, history = 0;  // 12 per layer; --fp8-amax-history
    // device: one allocation, in this order
    float* amax_history = nullptr;  // tensors x history, [t * history + 0] the newest
    float* scale = nullptr;         // tensors: q = x * scale
    float* scale_inv = nullptr;     // tensors: what cuBLASLt multiplies back
    unsigned int* amax_now = nullptr;  // tensors: this step's amax so far, as float bits
    uint8_t *a8 = nullptr, *b8 = nullptr;  // the two operands of one matmul, quantized
};

// ---- the kernels

inline __host__ __device__ bool fp8_is_e5m2(int slot) { return slot % FP8_ROLES == FP8_GRAD; }
inline __host__ __device__ float fp8_max(int slot) { return fp8_is_e5m2(slot) ? FP8_E5M2_MAX : FP8_E4M3_MAX; }

// s = 2^floor(log2(fmax / amax)); amax 0 (a tensor of zeros) or not finite: keep the old scale.
// (The quotient is rounded before the floor: if it rounds up onto a power of two, s is 2x too large
// and values within one fp32 ulp of amax saturate to fmax: an error of < 2^-23.)
inline __host__ __device__ float fp8_scale_for(float amax, float fmax, float old_scale) {
    if (!(amax > 0.0f) || !isfinite(amax)) return old_scale;
    int e = ilogbf(fmax / amax);
    e = e > 126 ? 126 : e < -126 ? -126 : e;
    return ldexpf(1.0f, e);
}

// q = saturate(round-to-nearest-even(x * scale)) in e4m3 or e5m2 (cuda_fp8.h's conversion: a cvt
// instruction on sm_89+; __NV_SATFINITE: beyond +-fmax, inf included, gives +-fmax, NaN stays NaN).
// Element (r, c) of the (rows x cols) input goes to q[r * cols + c], or with `transpose` to
// q[c * rows + r]. Each warp's largest |x| goes into amax_now[slot] (NaNs skipped).
__global__ void fp8_quantize_kernel(uint8_t* q, const floatX* x, int rows, int cols, bool transpose,
                                    const float* scale, unsigned int* amax_now, int slot) {
    size_t n = (size_t)rows * cols;
    float s = scale[slot];
    __nv_fp8_interpretation_t kind = fp8_is_e5m2(slot) ? __NV_E5M2 : __NV_E4M3;
    float amax = 0.0f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
        float v = to_float(x[i]);
        amax = fmaxf(amax, fabsf(v));  // fmaxf(a, NaN) = a
        if (!q) continue;              // the calibrating pass measures only
        size_t r = i / cols, c = i % cols;
        q[transpose ? c * rows + r : i] = __nv_cvt_float_to_fp8(v * s, __NV_SATFINITE, kind);
    }
    for (int offset = 16; offset > 0; offset /= 2) amax = fmaxf(amax, __shfl_xor_sync(0xffffffff, amax, offset));
    if (threadIdx.x % 32 == 0) atomicMax(&amax_now[slot], __float_as_uint(amax));
}

// Step 1: the scale from the amax just measured (one thread).
__global__ void fp8_calibrate_kernel(float* scale, float* scale_inv, const unsigned int* amax_now, int slot) {
    float s = fp8_scale_for(__uint_as_float(amax_now[slot]), fp8_max(slot), scale[slot]);
    scale[slot] = s;
    scale_inv[slot] = 1.0f / s;  // exact: s is a power of two
}

// Once per step: push this step's amax into every history (dropping the oldest) and take the next
// scale from the history's max. One thread per tensor.
__global__ void fp8_roll_kernel(float* amax_history, float* scale, float* scale_inv, unsigned int* amax_now,
                                int tensors, int history) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tensors) return;
    float* h = amax_history + (size_t)t * history;
    for (int i = history - 1; i > 0; i--) h[i] = h[i - 1];
    h[0] = __uint_as_float(amax_now[t]);
    amax_now[t] = 0;
    float amax = 0.0f;
    for (int i = 0; i < history; i++) amax = fmaxf(amax, h[i]);
    float s = fp8_scale_for(amax, fp8_max(t), scale[t]);
    scale[t] = s;
    scale_inv[t] = 1.0f / s;
}

// ---- the host side

// state: fp8_state_floats(...) floats; a8, b8: the largest operands (bytes). Scales start at 1.
inline void fp8_init(Fp8Matmuls* f, int layers, int history, float* state, uint8_t* a8, uint8_t* b8,
                     cudaStream_t stream) {
    f->on = true;
    f->tensors = layers * FP8_LINEARS * FP8_ROLES;
    f->history = history;
    f->amax_history = state;
    f->scale = state + (size_t)f->tensors * history;
    f->scale_inv = f->scale + f->tensors;
    f->amax_now = (unsigned int*)(f->scale_inv + f->tensors);
    f->a8 = a8, f->b8 = b8;
    std::vector<float> init(fp8_state_floats(f->tensors, history), 0.0f);
    for (int t = 0; t < 2 * f->tensors; t++) init[(size_t)f->tensors * history + t] = 1.0f;  // scale, scale_inv
    CUDA_CHECK(cudaMemcpyAsync(state, init.data(), init.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
}

inline void fp8_quantize(Fp8Matmuls* f, uint8_t* q, const floatX* x, int rows, int cols, bool transpose, int slot,
                         cudaStream_t stream) {
    const int block = 256;
    int grid = (int)std::min<size_t>(ceil_div((size_t)rows * cols, (size_t)block), 1024);
    if (f->calibrating) {  // measure first, then quantize with the tensor's own scale
        fp8_quantize_kernel<<<grid, block, 0, stream>>>(nullptr, x, rows, cols, transpose, f->scale, f->amax_now, slot);
        CUDA_CHECK_LAUNCH();
        fp8_calibrate_kernel<<<1, 1, 0, stream>>>(f->scale, f->scale_inv, f->amax_now, slot);
        CUDA_CHECK_LAUNCH();
    }
    fp8_quantize_kernel<<<grid, block, 0, stream>>>(q, x, rows, cols, transpose, f->scale, f->amax_now, slot);
    CUDA_CHECK_LAUNCH();
}

// After the step's last backward: roll the histories, next scales. Calibration is over.
inline void fp8_end_step(Fp8Matmuls* f, cudaStream_t stream) {
    fp8_roll_kernel<<<ceil_div(f->tensors, 128), 128, 0, stream>>>(f->amax_history, f->scale, f->scale_inv, f->amax_now,
                                                                   f->tensors, f->history);
    CUDA_CHECK_LAUNCH();
    f->calibrating = false;
}

// D (m x n col-major, bf16) = sa sb A^T B [+ bias] [+ D]: A stored (k x m) col-major = row-major (m x k),
// B stored (k x n) col-major; sa, sb the device floats 1/scale of A's and B's slots. A is e4m3.
// The fp8 matmul's descriptor: fp32 accumulation and scale type, the transposes, the dequantizing
// scales as device pointers (read when the matmul runs, so a new scale needs no new descriptor).
inline cublasLtMatmulDesc_t fp8_matmul_desc(bool trans_a, bool trans_b, const float* sa, const float* sb) {
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulDesc_t desc;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_A_SCALE_POINTER, &sa, sizeof(sa)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_B_SCALE_POINTER, &sb, sizeof(sb)));
    return desc;
}

inline void fp8_matmul_tn(MatmulContext* ctx, Fp8Matmuls* f, floatX* d, const uint8_t* a, int a_slot, const uint8_t* b,
                          int b_slot, const floatX* bias, int m, int n, int k, bool accumulate, cudaStream_t stream) {
    cudaDataType_t a_type = CUDA_R_8F_E4M3, b_type = fp8_is_e5m2(b_slot) ? CUDA_R_8F_E5M2 : CUDA_R_8F_E4M3;
    cublasLtMatmulDesc_t desc = fp8_matmul_desc(true, false, f->scale_inv + a_slot, f->scale_inv + b_slot);
    if (bias) {
        cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_BIAS;
        cudaDataType_t bias_type = CUDA_FLOATX;  // bf16 bias with a bf16 output
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
        // the heuristic sees a stand-in 16-byte-aligned address, the matmul the real one (matmul.cuh's
        // cublaslt_matmul says why: the algorithm is cached for every layer's bias)
        const void* promised = (const void*)(uintptr_t)16;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &promised, sizeof(promised)));
    }
    cublasLtMatrixLayout_t la, lb, ld;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, a_type, k, m, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, b_type, k, n, k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, CUDA_FLOATX, m, n, m));
    // asked once per shape, in matmul.cuh's cache (same algorithm every step: reproducible); an fp8
    // matmul is always A^T B, and its key's type is B's (e4m3 or e5m2), which no bf16 matmul has
    MatmulAlgo key{b_type, m, n, k, true, false, accumulate, bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT, {}};
    const cublasLtMatmulAlgo_t* algo = matmul_algo(ctx, key, [&] {
        cublasLtMatmulPreference_t pref;
        CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &ctx->workspace_bytes, sizeof(ctx->workspace_bytes)));
        // fp8 matmuls need 16-byte-aligned matrices (cuBLASLt's fp8 requirements), which the fp8 copies (their
        // own allocations) and the bf16 outputs (activations at offsets of whole 16-byte vectors) are; promise
        // no more: with the default 256 the --tensor-parallel 2 slices of C = 64 failed (an output 16, not 256, aligned)
        matmul_promise_alignment(pref, 16);
        cublasLtMatmulHeuristicResult_t result;
        int found = 0;
        CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx->handle, desc, la, lb, ld, ld, pref, 1, &result, &found));
        CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
        if (found == 0)
            fail("cuBLASLt has no fp8 algorithm for m=%d n=%d k=%d (%s x %s): this GPU or shape has no fp8 matmul", m, n, k,
                 "e4m3", b_type == CUDA_R_8F_E5M2 ? "e5m2" : "e4m3");
        return result.algo;
    });
    if (bias) CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    cublaslt_run(ctx, desc, la, lb, ld, a, b, d, algo, accumulate, stream);
}

// The three matmuls of a linear layer (matmul.cuh's, same arguments, plus the layer's slot).
// out (N x OC) = inp (N x IC) W^T + bias
inline void fp8_linear_forward(MatmulContext* ctx, Fp8Matmuls* f, int slot, floatX* out, const floatX* inp,
                               const floatX* weight, const floatX* bias, int N, int IC, int OC, cudaStream_t stream) {
    fp8_quantize(f, f->a8, weight, OC, IC, false, slot + FP8_WEIGHT, stream);
    fp8_quantize(f, f->b8, inp, N, IC, false, slot + FP8_INPUT, stream);
    fp8_matmul_tn(ctx, f, out, f->a8, slot + FP8_WEIGHT, f->b8, slot + FP8_INPUT, bias, OC, N, IC, false, stream);
}

// dinp (N x IC) = dout (N x OC) W: A = W^T (IC x OC), B = dout
inline void fp8_linear_backward_data(MatmulContext* ctx, Fp8Matmuls* f, int slot, floatX* dinp, const floatX* dout,
                                     const floatX* weight, int N, int IC, int OC, cudaStream_t stream) {
    fp8_quantize(f, f->a8, weight, OC, IC, true, slot + FP8_WEIGHT, stream);
    fp8_quantize(f, f->b8, dout, N, OC, false, slot + FP8_GRAD, stream);
    fp8_matmul_tn(ctx, f, dinp, f->a8, slot + FP8_WEIGHT, f->b8, slot + FP8_GRAD, nullptr, IC, N, OC, false, stream);
}

// dW (OC x IC) += dout^T inp: A = inp^T (IC x N), B = dout^T (OC x N)
inline void fp8_linear_backward_weight(MatmulContext* ctx, Fp8Matmuls* f, int slot, floatX* dweight, const floatX* dout,
                                       const floatX* inp, int N, int IC, int OC, cudaStream_t stream) {
    fp8_quantize(f, f->a8, inp, N, IC, true, slot + FP8_INPUT, stream);
    fp8_quantize(f, f->b8, dout, N, OC, true, slot + FP8_GRAD, stream);
    fp8_matmul_tn(ctx, f, dweight, f->a8, slot + FP8_INPUT, f->b8, slot + FP8_GRAD, nullptr, IC, OC, N, true, stream);
}

// ---- an evaluation's forward (validation, HellaSwag, a sample) between two steps
// It quantizes as any forward does: it records its amax into amax_now, and before step 1 (calibrating)
// sets the scales from it. Left there, that amax would be rolled into the histories at the next step's
// end and step 1's calibration would start from it, so the training's scales, hence its weights, would
// depend on when and what it evaluated (test/test_between_steps.py caught it: --precision fp8 with
// validation every 2 steps trained to other weights from step 3 on). So an evaluation keeps the scales,
// inverse scales and amax_now (contiguous, 3 floats a tensor) and puts them back when it is done.
// (In the stream's order: after the step's roll, and after the evaluation's last quantization.)
inline std::vector<float> fp8_evaluation_begin(const Fp8Matmuls* f, cudaStream_t stream) {
    if (!f->on) return {};
    std::vector<float> kept((size_t)3 * f->tensors);
    CUDA_CHECK(cudaMemcpyAsync(kept.data(), f->scale, kept.size() * sizeof(float), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return kept;
}

inline void fp8_evaluation_end(Fp8Matmuls* f, const std::vector<float>& kept, cudaStream_t stream) {
    if (!f->on) return;
    CUDA_CHECK(cudaMemcpyAsync(f->scale, kept.data(), kept.size() * sizeof(float), cudaMemcpyHostToDevice, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));  // (kept is freed on return)
}

// ---- the checkpoint's share (fp8_state.bin, llmc/io/formats.h): the histories, scales and inverse
// scales, tensors x (history + 2) floats. At a step's end this step's amax is already in the history
// (fp8_end_step zeroed amax_now), so nothing else is needed to go on bit for bit.
inline size_t fp8_saved_floats(const Fp8Matmuls* f) { return (size_t)f->tensors * (f->history + 2); }

inline std::vector<float> fp8_download_state(const Fp8Matmuls* f) {
    std::vector<float> values(fp8_saved_floats(f));
    CUDA_CHECK(cudaMemcpy(values.data(), f->amax_history, values.size() * sizeof(float), cudaMemcpyDeviceToHost));
    return values;
}

inline void fp8_upload_state(Fp8Matmuls* f, const std::vector<float>& values) {
    CUDA_CHECK(cudaMemcpy(f->amax_history, values.data(), values.size() * sizeof(float), cudaMemcpyHostToDevice));
    f->calibrating = false;  // the histories hold the steps before: no calibration pass
}
