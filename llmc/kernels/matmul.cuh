// matmul.cuh — the three matmuls of every linear layer, through cuBLASLt, and the bias gradient.
//
//   forward          out  = inp W^T + b      (N x OC) = (N x IC)(IC x OC), bias in the epilogue
//   backward, data   dinp = dout W           (N x IC) = (N x OC)(OC x IC)
//   backward, weight dW  += dout^T inp       (OC x IC) = (OC x N)(N x IC), accumulated (beta = 1)
//   bias gradient    db  += column sums of dout
// bf16 inputs and outputs, fp32 accumulation (CUBLAS_COMPUTE_32F). These are ~90% of the FLOPs of a
// step, and cuBLASLt's kernels for Hopper (wgmma, TMA) are the fastest there are, so we call them.
//
// Row-major to cuBLAS's column-major: a row-major (R x C) matrix IS a column-major (C x R) one. So
// out^T (OC x N, col-major) = W (viewed as IC x OC col-major, transposed) * inp^T (IC x N): that is
// cublasLt(transa = T, transb = N, m = OC, n = N, k = IC) on the same pointers, no copies.
//
// The bias is added in the epilogue: the output is written once, with the bias, instead of written,
// read, and written again. The MLP's GELU can go there too, forward and backward (matmul_forward_gelu,
// matmul_backward_data_dgelu below; gelu.cuh's gelu_in_matmul_epilogue says when).
//
// Determinism: cuBLASLt is bit-reproducible for a fixed algorithm on a fixed GPU. The heuristic is
// asked ONCE per shape and the answer cached, so every step of a run uses the same algorithm.
//
// The bias gradient is our kernel, deterministic like every reduction here: a block of 32 x 8
// threads owns 256 columns (8 per thread, 16-byte loads) of 256 rows and writes one partial per
// column; add_column_partials() sums the partials in order. Traffic: dout read once.
#pragma once

#include <cublasLt.h>
#include <cublas_v2.h>
#include <vector>
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/kernels/scratch_sizes.h"  // BIAS_BACKWARD_ROWS_PER_BLOCK, CUBLASLT_WORKSPACE_BYTES
#include "llmc/utils.h"  // fail

inline void cublas_check(cublasStatus_t status, const char* call, const char* file, int line) {
    if (status == CUBLAS_STATUS_SUCCESS) return;
    fflush(stdout);
    fprintf(stderr, "error: cuBLAS call failed at %s:%d\n  %s\n  %s\n", file, line, call, cublasGetStatusString(status));
    exit(EXIT_FAILURE);
}
#define CUBLAS_CHECK(call) cublas_check((call), #call, __FILE__, __LINE__)

constexpr cudaDataType_t CUDA_FLOATX = FLOATX_IS_FP32 ? CUDA_R_32F : FLOATX_IS_FP16 ? CUDA_R_16F : CUDA_R_16BF;

// One cached heuristic answer, and the key it answers for. `type`: the operands' type (fp8: B's,
// e4m3 or e5m2; A is always e4m3, llmc/kernels/fp8.cuh), so a shape asked in two types has two.
struct MatmulAlgo {
    cudaDataType_t type;
    int m, n, k;
    bool trans_a, trans_b, accumulate;
    cublasLtEpilogue_t epilogue;
    cublasLtMatmulAlgo_t algo;
};

inline bool same_matmul(const MatmulAlgo& x, const MatmulAlgo& y) {
    return x.type == y.type && x.m == y.m && x.n == y.n && x.k == y.k && x.trans_a == y.trans_a && x.trans_b == y.trans_b &&
           x.epilogue == y.epilogue && x.accumulate == y.accumulate;
}

struct MatmulContext {
    cublasLtHandle_t handle = nullptr;
    void* workspace = nullptr;
    size_t workspace_bytes = 0;
    std::vector<MatmulAlgo> algos;
};

// The algorithm for the matmul `key` describes: asked of cuBLASLt's heuristic once (`ask`, the
// caller's query with its own preferences), then cached, so every step runs the same algorithm
// (reproducible) and pays no query. Used by every cuBLASLt call here and by fp8.cuh's.
template <class Ask> const cublasLtMatmulAlgo_t* matmul_algo(MatmulContext* ctx, MatmulAlgo key, Ask ask) {
    for (const MatmulAlgo& x : ctx->algos)
        if (same_matmul(x, key)) return &x.algo;
    key.algo = ask();
    ctx->algos.push_back(key);
    return &ctx->algos.back().algo;
}

// What the heuristic may count on: every matrix pointer aligned to `bytes`. Left unset, it is 256 (the
// documented default), and an algorithm chosen on that may fail on a layer's activation at an offset
// that is only 16-byte aligned (fp8.cuh's outputs with --tensor-parallel 2 at C = 64, e.g.).
inline void matmul_promise_alignment(cublasLtMatmulPreference_t pref, uint32_t bytes) {
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &bytes, sizeof(bytes)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &bytes, sizeof(bytes)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &bytes, sizeof(bytes)));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &bytes, sizeof(bytes)));
}

inline void matmul_init(MatmulContext* ctx, void* workspace, size_t workspace_bytes) {
    CUBLAS_CHECK(cublasLtCreate(&ctx->handle));
    ctx->workspace = workspace;
    ctx->workspace_bytes = workspace_bytes;
}

inline void matmul_destroy(MatmulContext* ctx) {
    if (ctx->handle) CUBLAS_CHECK(cublasLtDestroy(ctx->handle));
    ctx->handle = nullptr;
}

// Runs D = op(A) op(B) (+ D if accumulate) with the algorithm chosen, then frees the descriptors
// (cublaslt_matmul's, and fp8.cuh's fp8 matmul's).
inline void cublaslt_run(MatmulContext* ctx, cublasLtMatmulDesc_t desc, cublasLtMatrixLayout_t la, cublasLtMatrixLayout_t lb,
                         cublasLtMatrixLayout_t ld, const void* a, const void* b, void* d, const cublasLtMatmulAlgo_t* algo,
                         bool accumulate, cudaStream_t stream) {
    float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    CUBLAS_CHECK(cublasLtMatmul(ctx->handle, desc, &alpha, a, la, b, lb, &beta, d, ld, d, ld, algo, ctx->workspace,
                                ctx->workspace_bytes, stream));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(la));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(lb));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(ld));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(desc));
}

// D (m x n, col-major, ld = m) = epilogue(op(A) op(B) [+ D if accumulate]). The epilogues we ask for:
//   CUBLASLT_EPILOGUE_DEFAULT        nothing
//   CUBLASLT_EPILOGUE_BIAS           + bias[i] on row i (bias: m values, D's type)
//   CUBLASLT_EPILOGUE_GELU_AUX_BIAS  + bias, aux = that sum (GELU's input), then D = gelu(it)
//   CUBLASLT_EPILOGUE_DGELU_BGRAD    D = result * gelu'(aux), and bias[i] = sum of row i of D (written)
// aux is an m x n matrix of D's type with ld = m: cuBLASLt requires its ld to be a multiple of 8 and
// at least D's rows (CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, cublasLt.h), so m % 8 == 0 there.
// `type` is every operand's: the trainer's floatX, or fp32 (matmul_fp32 below).
inline void cublaslt_matmul_typed(MatmulContext* ctx, cudaDataType_t type, void* d, const void* a, const void* b,
                                  cublasLtEpilogue_t epilogue, const void* bias, const void* aux, int m, int n, int k,
                                  bool trans_a, bool trans_b, bool accumulate, cudaStream_t stream) {
    cublasOperation_t op_a = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N, op_b = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;
    cublasLtMatmulDesc_t desc;
    cublasComputeType_t compute = type == CUDA_R_32F && FLOATX_IS_FP32 ? CUBLAS_COMPUTE_32F_PEDANTIC : CUBLAS_COMPUTE_32F;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc, compute, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    // The heuristic reads the bias and aux pointers' VALUES to learn their alignment (cublasLt.h, at
    // CUBLASLT_MATMUL_DESC_BIAS_POINTER and _EPILOGUE_AUX_POINTER): its answer is cached for every
    // layer, whose pointers are less aligned than the first one's may be. So it is asked with a stand-in
    // address aligned to exactly the 16 bytes every pointer here has, never dereferenced; the real
    // pointers go in before the matmul.
    const void* promised = (const void*)(uintptr_t)16;
    if (bias) {
        cudaDataType_t bias_type = type;  // "the same type as the output" (cublasLt.h), bias gradients too
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &promised, sizeof(promised)));
    }
    if (aux) {
        int64_t aux_ld = m;
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld, sizeof(aux_ld)));
        CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &promised, sizeof(promised)));
    }
    // stored shapes (before op): A is (m x k) or (k x m), B is (k x n) or (n x k)
    cublasLtMatrixLayout_t la, lb, ld;
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&la, type, trans_a ? k : m, trans_a ? m : k, trans_a ? k : m));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&lb, type, trans_b ? n : k, trans_b ? k : n, trans_b ? n : k));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&ld, type, m, n, m));

    MatmulAlgo key{type, m, n, k, trans_a, trans_b, accumulate, epilogue, {}};
    const cublasLtMatmulAlgo_t* algo = matmul_algo(ctx, key, [&] {
        cublasLtMatmulPreference_t pref;
        CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                          &ctx->workspace_bytes, sizeof(ctx->workspace_bytes)));
        // every floatX pointer we pass is 16-byte aligned: let the heuristic count on no more than that.
        // fp32 operands (PowerSGD's thin factors) start at any float: 4 bytes
        uint32_t align = type == CUDA_R_32F && !FLOATX_IS_FP32 ? 4 : 16;
        matmul_promise_alignment(pref, align);
        // Split-K (the k loop cut into parallel slices, summed afterwards) is allowed only when the
        // slices are summed in fp32 in the workspace. The other two schemes, INPLACE and OUTPUT_TYPE,
        // add the slices in the OUTPUT type: bf16 partial sums, exactly the precision loss fp32
        // accumulation is there to avoid (split-K pays for a long k: the weight gradients, k = B*T).
        // All three schemes are deterministic; this is about precision only.
        uint32_t reduction_schemes = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
        CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                          &reduction_schemes, sizeof(reduction_schemes)));
        cublasLtMatmulHeuristicResult_t result;
        int found = 0;
        CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(ctx->handle, desc, la, lb, ld, ld, pref, 1, &result, &found));
        CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
        if (found == 0) {
            fail("cuBLASLt has no algorithm for a %s matmul m=%d n=%d k=%d (transa=%d transb=%d epilogue=%d): the "
                 "shape or the GPU is not supported", type == CUDA_R_32F ? "fp32" : FLOATX_NAME, m, n, k, trans_a, trans_b, (int)epilogue);
        }
        return result.algo;
    });
    if (bias) CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    if (aux) CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux, sizeof(aux)));
    cublaslt_run(ctx, desc, la, lb, ld, a, b, d, algo, accumulate, stream);
}

inline void cublaslt_matmul(MatmulContext* ctx, floatX* d, const floatX* a, const floatX* b, cublasLtEpilogue_t epilogue,
                            const void* bias, const floatX* aux, int m, int n, int k, bool trans_a, bool trans_b,
                            bool accumulate, cudaStream_t stream) {
    cublaslt_matmul_typed(ctx, CUDA_FLOATX, d, a, b, epilogue, bias, aux, m, n, k, trans_a, trans_b, accumulate, stream);
}

// D (m x n, col-major) = op(A) op(B), all fp32 with fp32 accumulation (no TF32): PowerSGD's products
// of an fp32 gradient with its thin factors (llmc/parallel/grad_compression.cuh).
inline void matmul_fp32(MatmulContext* ctx, float* d, const float* a, const float* b, int m, int n, int k, bool trans_a,
                        bool trans_b, cudaStream_t stream) {
    cublaslt_matmul_typed(ctx, CUDA_R_32F, d, a, b, CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, m, n, k, trans_a, trans_b,
                          false, stream);
}

// out (N x OC) = inp (N x IC) W^T (+ bias); W is (OC x IC) row-major as in nn.Linear.
inline void matmul_forward(MatmulContext* ctx, floatX* out, const floatX* inp, const floatX* weight, const floatX* bias,
                           int N, int IC, int OC, cudaStream_t stream) {
    cublaslt_matmul(ctx, out, weight, inp, bias ? CUBLASLT_EPILOGUE_BIAS : CUBLASLT_EPILOGUE_DEFAULT, bias, nullptr, OC, N,
                    IC, true, false, false, stream);
}

// The MLP's fc layer and its GELU in one call (CUBLASLT_EPILOGUE_GELU_AUX_BIAS): pre (N x OC) =
// inp W^T + b, kept for the backward, and out = gelu(pre), both written by the matmul's epilogue
// while the tile is still in registers: one write of each and no GELU kernel reading pre back. The
// epilogue applies GELU to the fp32 sum, before pre is rounded to bf16 (our kernel reads the
// rounded pre), so out can differ from gelu_forward(pre) by an ulp. OC % 8 == 0 (pre is the aux).
inline void matmul_forward_gelu(MatmulContext* ctx, floatX* out, floatX* pre, const floatX* inp, const floatX* weight,
                                const floatX* bias, int N, int IC, int OC, cudaStream_t stream) {
    cublaslt_matmul(ctx, out, weight, inp, CUBLASLT_EPILOGUE_GELU_AUX_BIAS, bias, pre, OC, N, IC, true, false, false,
                    stream);
}

// dinp (N x IC) = dout (N x OC) W (OC x IC), overwritten.
inline void matmul_backward_data(MatmulContext* ctx, floatX* dinp, const floatX* dout, const floatX* weight, int N,
                                 int IC, int OC, cudaStream_t stream) {
    cublaslt_matmul(ctx, dinp, weight, dout, CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, IC, N, OC, false, false, false,
                    stream);
}

// The backward of matmul_forward_gelu's GELU, in the epilogue of the input-gradient matmul of the
// layer that read its output, fcproj (CUBLASLT_EPILOGUE_DGELU_BGRAD): dpre (N x IC) = (dout W) * gelu'(pre), and, from the same
// fp32 values before they are rounded, dbias (IC) = the column sums of dpre: the fc layer's bias
// gradient, OVERWRITTEN in D's type (cuBLASLt writes it; the caller adds it to the accumulated one).
// Saves the GELU backward's pass (read dpre and pre, write dpre) and the bias gradient's read of dpre.
// IC % 8 == 0 (pre is the aux).
inline void matmul_backward_data_dgelu(MatmulContext* ctx, floatX* dpre, floatX* dbias, const floatX* dout,
                                       const floatX* weight, const floatX* pre, int N, int IC, int OC, cudaStream_t stream) {
    cublaslt_matmul(ctx, dpre, weight, dout, CUBLASLT_EPILOGUE_DGELU_BGRAD, dbias, pre, IC, N, OC, false, false, false,
                    stream);
}

// dW (OC x IC) += dout^T (OC x N) inp (N x IC)
inline void matmul_backward_weight(MatmulContext* ctx, floatX* dweight, const floatX* dout, const floatX* inp, int N,
                                   int IC, int OC, cudaStream_t stream) {
    cublaslt_matmul(ctx, dweight, inp, dout, CUBLASLT_EPILOGUE_DEFAULT, nullptr, nullptr, IC, OC, N, false, true, true,
                    stream);
}

constexpr int BIAS_BACKWARD_ROW_THREADS = 8;

// partials[blockIdx.y][c] = sum of dout[r][c] over this block's 256 rows, for this block's 256 columns.
__global__ void bias_backward_partials_kernel(float* partials, const floatX* dout, int N, int OC) {
    __shared__ float acc[BIAS_BACKWARD_ROW_THREADS][32 * x128::size];
    int c = (blockIdx.x * 32 + threadIdx.x) * x128::size;
    int row_begin = blockIdx.y * BIAS_BACKWARD_ROWS_PER_BLOCK;
    int row_end = min(N, row_begin + BIAS_BACKWARD_ROWS_PER_BLOCK);
    float sum[x128::size] = {};
    if (c < OC) {
        for (int r = row_begin + threadIdx.y; r < row_end; r += BIAS_BACKWARD_ROW_THREADS) {
            x128 d8 = load128(dout + (size_t)r * OC + c);
            for (int k = 0; k < x128::size; k++) sum[k] += to_float(d8[k]);
        }
    }
    for (int k = 0; k < x128::size; k++) acc[threadIdx.y][threadIdx.x * x128::size + k] = sum[k];
    __syncthreads();
    if (threadIdx.y == 0 && c < OC) {
        for (int k = 0; k < x128::size; k++) {
            float total = 0.0f;
            for (int y = 0; y < BIAS_BACKWARD_ROW_THREADS; y++) total += acc[y][threadIdx.x * x128::size + k];
            partials[(size_t)blockIdx.y * OC + c + k] = total;
        }
    }
}

// dbias (OC) += column sums of dout (N x OC). partials: ceil(N / 256) * OC floats
// (bias_backward_partials_floats, llmc/kernels/scratch_sizes.h).
inline void bias_backward(floatX* dbias, float* partials, const floatX* dout, int N, int OC, cudaStream_t stream) {
    dim3 grid(ceil_div(OC, 32 * x128::size), ceil_div(N, BIAS_BACKWARD_ROWS_PER_BLOCK));
    dim3 block(32, BIAS_BACKWARD_ROW_THREADS);
    bias_backward_partials_kernel<<<grid, block, 0, stream>>>(partials, dout, N, OC);
    CUDA_CHECK_LAUNCH();
    add_column_partials(dbias, partials, (int)grid.y, OC, OC, stream);
}
