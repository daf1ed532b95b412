// matmul.cu — the linear layer, from one thread per output to the tensor cores; its bias/GELU
// epilogue; and the bias gradient.
//
//   forward   out (N x OC) = inp (N x IC) W^T + b,  W (OC x IC) as in nn.Linear, bf16 in and out,
//             fp32 accumulation. Shape: the MLP's fc layer, N = B*T, IC = 768, OC = 3072.
// FLOPs: 2 N IC OC (38.7 GFLOP at B=8). Bytes, at least: inp, W, out once each (~70 MB). That is
// ~570 FLOPs per byte, above the ~250 an H100's tensor cores do per byte of DRAM bandwidth: compute-bound,
// IF each value fetched from memory is reused enough times on chip. The versions are the steps of
// that reuse:
//   1. naive: one thread per output, a loop over k. Each multiply-add loads two values (a
//      warp's W loads are 2*IC bytes apart: uncoalesced), so the kernel runs at the speed of the
//      L1/L2 caches, not of the arithmetic.
//   2. shared-memory tiles: a 32x32 block loads 32x32 tiles of inp and W into shared memory once
//      (coalesced) and every thread reads 32 values of each from there: each global load now feeds
//      32 multiply-adds.
//   3. register tiles: a block computes 128x128 outputs, each thread an 8x8 patch: per k it reads 8
//      values of inp and 8 of W from shared memory and does 64 FMAs with them in registers. Shared
//      memory traffic drops 8x; the kernel approaches the fp32 CUDA-core peak (~60 TFLOP/s on H100),
//      which is a small fraction of the bf16 tensor-core peak.
//   4. tensor cores (WMMA): the same 128x128 block tile, but each warp issues 16x16x16 bf16
//      matrix-multiply-accumulate instructions (nvcuda::wmma) on fragments loaded from shared
//      memory: 4096 FMAs per instruction. What it lacks against cuBLAS: asynchronous copies that
//      overlap loading the next tile with computing this one (cp.async/TMA), a multi-stage pipeline,
//      Hopper's warpgroup instructions (wgmma), swizzled shared memory.
//   5. trainer's (llmc/kernels/matmul.cuh): cuBLASLt, with the bias added in its epilogue.
// Prediction: 1 ~1-3 TFLOP/s, 2 ~3-6, 3 ~15-30, 4 ~60-150, 5 ~500-650 (80-95% of the GEMM ceiling;
// IC = 768 is a short k loop, so somewhat under the 8192^3 ceiling).
//
//   matmul_bias_gelu: y = gelu(inp W^T + b), the fc layer and its activation. Versions: 1 naive, fused
//   in the loop; 2 the trainer's two kernels at --recompute >= 1 (matmul with bias, write the
//   pre-activation, GELU kernel: llmc/kernels/gelu.cuh says why those levels need that kernel); 3
//   cuBLASLt's GELU_BIAS epilogue (no pre-activation kept: inference's); 4 the trainer's at
//   --recompute 0, GELU_AUX_BIAS (llmc/kernels/matmul.cuh, matmul_forward_gelu): GELU in the
//   epilogue, the pre-activation written beside it as the aux, checked too. Prediction (before any
//   GPU ran it): 3 beats 2 by the GELU kernel's time (~35 us at B=8); measured on an H200, by 21%.
//   4 writes the pre-activation as 2 does but skips the GELU kernel's read of it and its launch: between 3 and 2.
//
//   matmul_dgelu_bgrad: the same layer's backward, from the gradient of y: dpre = (dy2 Wp) * gelu'(pre)
//   (dy2 (N x C) the gradient of the next matmul's output, Wp (C x 4C) its weight, as fcproj's in the
//   trainer) and dbias += the column sums of dpre. 1 the trainer's at --recompute >= 1: the matmul,
//   the GELU backward kernel in place, the bias-gradient kernel (llmc/kernels/matmul.cuh, gelu.cuh);
//   2 the trainer's at --recompute 0, DGELU_BGRAD: dgelu and the bias gradient in the matmul's
//   epilogue (matmul_backward_data_dgelu), the bias gradient added by add_into. Prediction: 2 saves the
//   GELU backward's 3 passes over N x 4C and the bias kernel's read of it, ~4 x 50 MB at B=8, ~70 us.
//   3 naive, fused: one thread per element of dpre, gelu' in the loop's epilogue, then bias_backward 1
//   (the floor to beat, as matmul_forward 1).
//
//   bias_backward: db += column sums of dout (N x OC), memory-bound (reads dout once). 1 one thread
//   per column over all rows (only OC threads); 2 blocks of 256 rows x 256 columns, fp32 atomics (not
//   reproducible); 3 trainer's: per-block partials in a fixed grid, summed in order (deterministic).
#include <mma.h>
#include "dev/cuda/common.h"
#include "llmc/kernels/gelu.cuh"

static const std::vector<Version> VERSIONS = {
    {"matmul_forward", 1, "naive", "one thread per output, a loop over k (uncoalesced W loads)", false},
    {"matmul_forward", 2, "smem tiles 32x32", "32x32 tiles of inp and W in shared memory, one output per thread", false},
    {"matmul_forward", 3, "register tiles 8x8", "128x128 block tile, 8x8 outputs per thread in registers (fp32 FMA)", false},
    {"matmul_forward", 4, "tensor cores (WMMA)", "128x128 block tile, bf16 16x16x16 WMMA fragments, fp32 accumulators", false},
    {"matmul_forward", 5, "trainer: cuBLASLt", "llmc/kernels/matmul.cuh: cuBLASLt, bias in the epilogue", true},
    {"matmul_bias_gelu", 1, "naive, fused", "version 1 of matmul_forward with GELU applied in the loop's epilogue", false},
    {"matmul_bias_gelu", 2, "trainer rc>=1: Lt + GELU kernel", "llmc/kernels/matmul.cuh then llmc/kernels/gelu.cuh: matmul with bias, then GELU", true},
    {"matmul_bias_gelu", 3, "cuBLASLt GELU_BIAS", "one cuBLASLt call, bias and GELU in its epilogue", false},
    {"matmul_bias_gelu", 4, "trainer rc 0: GELU_AUX_BIAS", "llmc/kernels/matmul.cuh, matmul_forward_gelu: GELU in the epilogue, the pre-activation as its aux", true},
    {"matmul_dgelu_bgrad", 1, "trainer rc>=1: Lt + 2 kernels", "matmul, then gelu_backward_inplace, then bias_backward", true},
    {"matmul_dgelu_bgrad", 2, "trainer rc 0: DGELU_BGRAD", "llmc/kernels/matmul.cuh, matmul_backward_data_dgelu: dgelu and the bias gradient in the epilogue", true},
    {"matmul_dgelu_bgrad", 3, "naive, fused", "one thread per element of dpre, a loop over k, gelu' in the loop's epilogue; then bias_backward 1", false},
    {"bias_backward", 1, "thread per column", "one thread per column, looping over all rows", false},
    {"bias_backward", 2, "block sums + atomics", "256x256 blocks sum their rows, fp32 atomics, then a pass to bf16", false},
    {"bias_backward", 3, "trainer: partials", "llmc/kernels/matmul.cuh: per-block partials summed in order (deterministic)", true},
};


// ---- 1: one thread per output. Consecutive threads take consecutive output columns o.
template <bool GELU>
__global__ void matmul_naive(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int N, int IC, int OC) {
    int n = blockIdx.x, o = blockIdx.y * blockDim.x + threadIdx.x;  // rows on x: up to 2^31 - 1 blocks
    if (o >= OC) return;
    const floatX* a = inp + (size_t)n * IC;
    const floatX* w = weight + (size_t)o * IC;
    float acc = __bfloat162float(bias[o]);
    for (int k = 0; k < IC; k++) acc += __bfloat162float(a[k]) * __bfloat162float(w[k]);
    out[(size_t)n * OC + o] = __float2bfloat16(GELU ? gelu_value(acc) : acc);  // llmc/kernels/gelu.cuh's formula
}

// ---- 2: 32x32 shared-memory tiles (N, OC, IC multiples of 32). Block (32, 32): threadIdx.x runs
// over output columns, threadIdx.y over rows.
constexpr int TILE = 32;
__global__ void matmul_smem_tiles(floatX* out, const floatX* inp, const floatX* weight, const floatX* bias, int N, int IC,
                                  int OC) {
    __shared__ float a_tile[TILE][TILE];      // [row][k]
    __shared__ float w_tile[TILE][TILE + 1];  // [column][k], padded: lanes read w_tile[lane][k], 33 apart: no bank conflicts
    int tx = threadIdx.x, ty = threadIdx.y;
    int n = blockIdx.y * TILE + ty, o = blockIdx.x * TILE + tx;
    float acc = 0.0f;
    for (int k0 = 0; k0 < IC; k0 += TILE) {
        a_tile[ty][tx] = __bfloat162float(inp[(size_t)n * IC + k0 + tx]);  // lanes along k: coalesced
        w_tile[ty][tx] = __bfloat162float(weight[(size_t)(blockIdx.x * TILE + ty) * IC + k0 + tx]);
        __syncthreads();
        for (int k = 0; k < TILE; k++) acc += a_tile[ty][k] * w_tile[tx][k];
        __syncthreads();
    }
    out[(size_t)n * OC + o] = __float2bfloat16(acc + __bfloat162float(bias[o]));
}

// ---- 3: register tiles. A block of 256 threads computes a 128x128 tile of out; thread (tx, ty)
// of a 16x16 grid owns rows 8ty..8ty+7 and columns 8tx..8tx+7. Shared memory holds the k-slice of
// both operands transposed (k-major), so a thread's 8 values at one k are contiguous.
// N, OC multiples of 128, IC a multiple of 16.
constexpr int RT_BM = 128, RT_BN = 128, RT_BK = 16;
__global__ void __launch_bounds__(256) matmul_register_tiles(floatX* out, const floatX* inp, const floatX* weight,
                                                             const floatX* bias, int N, int IC, int OC) {
    __shared__ float a_tile[RT_BK][RT_BM];
    __shared__ float w_tile[RT_BK][RT_BN];
    int tx = threadIdx.x % 16, ty = threadIdx.x / 16;
    int n0 = blockIdx.y * RT_BM, o0 = blockIdx.x * RT_BN;
    int load_row = threadIdx.x / 2, load_k = (threadIdx.x % 2) * 8;  // each thread loads 8 k of one row of each tile
    float acc[8][8] = {};
    for (int k0 = 0; k0 < IC; k0 += RT_BK) {
        x128 a8 = load128(inp + (size_t)(n0 + load_row) * IC + k0 + load_k);
        x128 w8 = load128(weight + (size_t)(o0 + load_row) * IC + k0 + load_k);
        for (int k = 0; k < 8; k++) {
            a_tile[load_k + k][load_row] = __bfloat162float(a8[k]);
            w_tile[load_k + k][load_row] = __bfloat162float(w8[k]);
        }
        __syncthreads();
        #pragma unroll
        for (int k = 0; k < RT_BK; k++) {
            float a[8], w[8];
            #pragma unroll
            for (int i = 0; i < 8; i++) a[i] = a_tile[k][ty * 8 + i];
            #pragma unroll
            for (int j = 0; j < 8; j++) w[j] = w_tile[k][tx * 8 + j];
            #pragma unroll
            for (int i = 0; i < 8; i++)
                #pragma unroll
                for (int j = 0; j < 8; j++) acc[i][j] += a[i] * w[j];
        }
        __syncthreads();
    }
    for (int i = 0; i < 8; i++) {
        int n = n0 + ty * 8 + i, o = o0 + tx * 8;
        x128 b8 = load128(bias + o), o8;
        for (int j = 0; j < 8; j++) o8[j] = __float2bfloat16(acc[i][j] + __bfloat162float(b8[j]));
        store128(out + (size_t)n * OC + o, o8);
    }
}

// ---- 4: tensor cores through WMMA. 256 threads = 8 warps in a 4x2 grid over the 128x128 tile;
// each warp owns 32x64 outputs = 2x4 accumulator fragments of 16x16 (fp32). Per 32-wide k-slice
// the block copies both tiles to shared memory as bf16 (16-byte copies), then each warp loads its
// fragments and issues 2x4x2 mma_sync. Rows are padded by 8 elements (16 bytes) so consecutive rows
// do not start in the same bank. Fragment pointers must be 32-byte aligned: 16 rows x 80 bytes and
// 16 k x 2 bytes both are. The epilogue goes through a 16x16 fp32 scratch per warp (adding the bias,
// rounding to bf16, 16-byte stores). N, OC multiples of 128, IC a multiple of 32.
constexpr int WM_BM = 128, WM_BN = 128, WM_BK = 32, WM_LD = WM_BK + 8;
__global__ void __launch_bounds__(256) matmul_wmma(floatX* out, const floatX* inp, const floatX* weight,
                                                   const floatX* bias, int N, int IC, int OC) {
    using namespace nvcuda;
    __shared__ __align__(32) floatX a_tile[WM_BM * WM_LD];  // [row][k]: matrix_a, row-major
    __shared__ __align__(32) floatX w_tile[WM_BN * WM_LD];  // [column][k]: W^T as matrix_b, column-major
    __shared__ __align__(32) float scratch[8 * 16 * 16];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    int warp_m = warp / 2, warp_n = warp % 2;
    int n0 = blockIdx.y * WM_BM, o0 = blockIdx.x * WM_BN;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];
    for (int i = 0; i < 2; i++)
        for (int j = 0; j < 4; j++) wmma::fill_fragment(acc[i][j], 0.0f);
    for (int k0 = 0; k0 < IC; k0 += WM_BK) {
        for (int v = threadIdx.x; v < WM_BM * WM_BK / 8; v += blockDim.x) {  // 16-byte copies
            int r = v / (WM_BK / 8), k = (v % (WM_BK / 8)) * 8;
            *(int4*)&a_tile[r * WM_LD + k] = *(const int4*)&inp[(size_t)(n0 + r) * IC + k0 + k];
            *(int4*)&w_tile[r * WM_LD + k] = *(const int4*)&weight[(size_t)(o0 + r) * IC + k0 + k];
        }
        __syncthreads();
        for (int k = 0; k < WM_BK; k += 16) {
            wmma::fragment<wmma::matrix_a, 16, 16, 16, __nv_bfloat16, wmma::row_major> a[2];
            wmma::fragment<wmma::matrix_b, 16, 16, 16, __nv_bfloat16, wmma::col_major> b[4];
            for (int i = 0; i < 2; i++) wmma::load_matrix_sync(a[i], a_tile + (warp_m * 32 + i * 16) * WM_LD + k, WM_LD);
            for (int j = 0; j < 4; j++) wmma::load_matrix_sync(b[j], w_tile + (warp_n * 64 + j * 16) * WM_LD + k, WM_LD);
            for (int i = 0; i < 2; i++)
                for (int j = 0; j < 4; j++) wmma::mma_sync(acc[i][j], a[i], b[j], acc[i][j]);
        }
        __syncthreads();
    }
    float* s = scratch + warp * 256;
    int r = lane / 2, cc = (lane % 2) * 8;  // each lane writes 8 outputs of the 16x16 fragment
    for (int i = 0; i < 2; i++) {
        for (int j = 0; j < 4; j++) {
            wmma::store_matrix_sync(s, acc[i][j], 16, wmma::mem_row_major);
            __syncwarp();
            int n = n0 + warp_m * 32 + i * 16 + r, o = o0 + warp_n * 64 + j * 16 + cc;
            x128 b8 = load128(bias + o), o8;
            for (int k = 0; k < 8; k++) o8[k] = __float2bfloat16(s[r * 16 + cc + k] + __bfloat162float(b8[k]));
            store128(out + (size_t)n * OC + o, o8);
            __syncwarp();  // before the next store_matrix_sync overwrites s
        }
    }
}

// ---- matmul_bias_gelu 3: a cuBLASLt matmul with GELU_BIAS in its epilogue, planned once.
struct LtGeluBias {
    cublasLtMatmulDesc_t desc;
    cublasLtMatrixLayout_t w_layout, inp_layout, out_layout;
    cublasLtMatmulAlgo_t algo;
};

static LtGeluBias lt_gelu_bias_plan(cublasLtHandle_t handle, const floatX* bias, int N, int IC, int OC,
                                    size_t workspace_bytes) {
    // the trainer's mapping (llmc/kernels/matmul.cuh): out^T (OC x N, column-major) = W (IC x OC col-major)^T inp^T
    LtGeluBias p;
    cublasOperation_t transa = CUBLAS_OP_T, transb = CUBLAS_OP_N;
    cublasLtEpilogue_t epilogue = CUBLASLT_EPILOGUE_GELU_BIAS;
    cudaDataType_t bias_type = CUDA_R_16BF;
    CUBLAS_CHECK(cublasLtMatmulDescCreate(&p.desc, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSA, &transa, sizeof(transa)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_TRANSB, &transb, sizeof(transb)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type)));
    CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(p.desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias)));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.w_layout, CUDA_R_16BF, IC, OC, IC));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.inp_layout, CUDA_R_16BF, IC, N, IC));
    CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&p.out_layout, CUDA_R_16BF, OC, N, OC));
    cublasLtMatmulPreference_t pref;
    CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&pref));
    CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace_bytes,
                                                      sizeof(workspace_bytes)));
    cublasLtMatmulHeuristicResult_t result;
    int found = 0;
    CUBLAS_CHECK(cublasLtMatmulAlgoGetHeuristic(handle, p.desc, p.w_layout, p.inp_layout, p.out_layout, p.out_layout, pref,
                                                1, &result, &found));
    CUBLAS_CHECK(cublasLtMatmulPreferenceDestroy(pref));
    if (found == 0) fail("cuBLASLt has no algorithm for a GELU_BIAS matmul of this shape on this GPU");
    p.algo = result.algo;
    return p;
}

// ---- matmul_dgelu_bgrad 3: one thread per element of dpre (N x H) = (dy2 (N x C) Wp (C x H)) * gelu'(pre),
// a loop over k with gelu' in its epilogue (matmul_naive's shape, for the backward's operands)
__global__ void matmul_dgelu_naive(floatX* dpre, const floatX* dy2, const floatX* wp, const floatX* pre, int N, int C, int H) {
    int n = blockIdx.x, j = blockIdx.y * blockDim.x + threadIdx.x;
    if (j >= H) return;
    const floatX* a = dy2 + (size_t)n * C;
    float acc = 0.0f;
    for (int i = 0; i < C; i++) acc += __bfloat162float(a[i]) * __bfloat162float(wp[(size_t)i * H + j]);
    size_t at = (size_t)n * H + j;
    dpre[at] = __float2bfloat16(acc * gelu_derivative(__bfloat162float(pre[at])));  // llmc/kernels/gelu.cuh's formula
}

// ---- bias_backward 1: one thread per column
__global__ void bias_backward_columns(floatX* dbias, const floatX* dout, int N, int OC) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= OC) return;
    float sum = 0.0f;
    for (int n = 0; n < N; n++) sum += __bfloat162float(dout[(size_t)n * OC + o]);
    dbias[o] = __float2bfloat16(__bfloat162float(dbias[o]) + sum);
}

// ---- bias_backward 2: block (x: 256 columns, y: 256 rows), one thread per column; fp32 atomics
__global__ void bias_backward_atomic(float* dbias32, const floatX* dout, int N, int OC) {
    int o = blockIdx.x * blockDim.x + threadIdx.x;
    if (o >= OC) return;
    int row_end = min(N, (blockIdx.y + 1) * 256);
    float sum = 0.0f;
    for (int n = blockIdx.y * 256; n < row_end; n++) sum += __bfloat162float(dout[(size_t)n * OC + o]);
    atomicAdd(&dbias32[o], sum);
}

int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "matmul", VERSIONS);
    int N = lab.B * lab.T, IC = lab.C, OC = 4 * lab.C;

    // activations ~ N(0, 1) as a LayerNorm leaves them; weights at GPT-2's init scale, times 2
    std::vector<float> inp = random_normal((size_t)N * IC, next_seed(&lab), 0.0f, 1.0f);
    std::vector<float> w = random_normal((size_t)OC * IC, next_seed(&lab), 0.0f, 0.04f);
    std::vector<float> bias = random_normal(OC, next_seed(&lab), 0.0f, 0.5f);
    std::vector<float> dout = random_normal((size_t)N * OC, next_seed(&lab), 0.0f, 1.0f);
    std::vector<float> dbias0 = random_normal(OC, next_seed(&lab), 0.0f, 1.0f);
    for (auto* v : {&inp, &w, &bias, &dout, &dbias0}) round_to_bf16(v);
    std::vector<float> out_ref((size_t)N * OC), gelu_ref((size_t)N * OC);
    cpu::matmul_forward(out_ref.data(), inp.data(), w.data(), bias.data(), N, IC, OC);
    cpu::gelu_forward(gelu_ref.data(), out_ref.data(), gelu_ref.size());
    // the backward of the GELU'd layer: dy2 (N x C) through Wp (C x OC), times gelu'(pre), pre = the
    // forward's output rounded to bf16 as the trainer keeps it; dbias += its column sums
    std::vector<float> dy2 = random_normal((size_t)N * IC, next_seed(&lab), 0.0f, 1.0f);
    std::vector<float> wp = random_normal((size_t)IC * OC, next_seed(&lab), 0.0f, 0.04f);
    round_to_bf16(&dy2), round_to_bf16(&wp);
    std::vector<float> pre = out_ref;
    round_to_bf16(&pre);
    std::vector<float> dact((size_t)N * OC), dpre_ref((size_t)N * OC), dfcb_ref(OC);
    cpu::matmul_backward_input(dact.data(), dy2.data(), wp.data(), N, OC, IC);
    cpu::gelu_backward(dpre_ref.data(), pre.data(), dact.data(), dpre_ref.size());
    for (int o = 0; o < OC; o++) {
        double sum = dbias0[o];
        for (int n = 0; n < N; n++) sum += dpre_ref[(size_t)n * OC + o];
        dfcb_ref[o] = (float)sum;
    }
    std::vector<float> dbias_ref(OC);
    for (int o = 0; o < OC; o++) {  // the CPU trainer sums bias gradients inside matmul_backward; the same loop, in double
        double sum = dbias0[o];
        for (int n = 0; n < N; n++) sum += dout[(size_t)n * OC + o];
        dbias_ref[o] = (float)sum;
    }

    MatmulContext ctx;
    void* workspace = device_alloc<char>(CUBLASLT_WORKSPACE_BYTES);
    matmul_init(&ctx, workspace, CUBLASLT_WORKSPACE_BYTES);

    // ---- matmul_forward
    double bytes = 2.0 * ((double)N * IC + (double)OC * IC + (double)N * OC + OC);
    int slots = lab_slots(lab, bytes);
    std::vector<floatX*> d_inp = to_device<floatX>(inp, slots), d_w = to_device<floatX>(w, slots);
    std::vector<floatX*> d_out = device_slots<floatX>((size_t)N * OC, slots);
    floatX* d_bias = to_device<floatX>(bias, 1)[0];
    floatX* d_pre = device_alloc<floatX>((size_t)N * OC);  // the trainer's pre-activation (fch)
    Case base;
    base.kernel = "matmul_forward";
    base.bytes = bytes;
    base.flops = 2.0 * N * (double)IC * OC;
    base.slots = slots;
    base.checks = {bf16_output("out", d_out[0], out_ref)};
    Case c = base;
    c.version = 1;
    c.run = [&](int s) {
        matmul_naive<false><<<dim3(N, ceil_div(OC, 256)), 256, 0, lab.stream>>>(d_out[s], d_inp[s], d_w[s], d_bias, N, IC, OC);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    if (N % TILE || OC % TILE || IC % TILE) {
        lab_skip(&lab, "matmul_forward", 2, "N, IC, OC must be multiples of 32");
    } else {
        c.version = 2;
        c.run = [&](int s) {
            matmul_smem_tiles<<<dim3(OC / TILE, N / TILE), dim3(TILE, TILE), 0, lab.stream>>>(d_out[s], d_inp[s], d_w[s],
                                                                                              d_bias, N, IC, OC);
            CUDA_CHECK_LAUNCH();
        };
        lab_case(&lab, c);
    }
    if (N % 128 || OC % 128 || IC % 32) {
        lab_skip(&lab, "matmul_forward", 3, "N, OC must be multiples of 128 and IC of 32");
        lab_skip(&lab, "matmul_forward", 4, "N, OC must be multiples of 128 and IC of 32");
    } else {
        c.version = 3;
        c.run = [&](int s) {
            matmul_register_tiles<<<dim3(OC / RT_BN, N / RT_BM), 256, 0, lab.stream>>>(d_out[s], d_inp[s], d_w[s], d_bias, N,
                                                                                     IC, OC);
            CUDA_CHECK_LAUNCH();
        };
        lab_case(&lab, c);
        c.version = 4;
        c.run = [&](int s) {
            matmul_wmma<<<dim3(OC / WM_BN, N / WM_BM), 256, 0, lab.stream>>>(d_out[s], d_inp[s], d_w[s], d_bias, N, IC, OC);
            CUDA_CHECK_LAUNCH();
        };
        lab_case(&lab, c);
    }
    c.version = 5;
    c.run = [&](int s) { matmul_forward(&ctx, d_out[s], d_inp[s], d_w[s], d_bias, N, IC, OC, lab.stream); };
    lab_case(&lab, c);

    // ---- matmul_bias_gelu: the same bytes and FLOPs (GELU's are negligible)
    base.kernel = "matmul_bias_gelu";
    base.checks = {bf16_output("gelu(out)", d_out[0], gelu_ref)};
    c = base;
    c.version = 1;
    c.run = [&](int s) {
        matmul_naive<true><<<dim3(N, ceil_div(OC, 256)), 256, 0, lab.stream>>>(d_out[s], d_inp[s], d_w[s], d_bias, N, IC, OC);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        matmul_forward(&ctx, d_pre, d_inp[s], d_w[s], d_bias, N, IC, OC, lab.stream);
        gelu_forward(d_out[s], d_pre, (size_t)N * OC, lab.stream);
    };
    lab_case(&lab, c);
    LtGeluBias plan = lt_gelu_bias_plan(ctx.handle, d_bias, N, IC, OC, CUBLASLT_WORKSPACE_BYTES);
    c.version = 3;
    c.run = [&](int s) {
        float alpha = 1.0f, beta = 0.0f;
        CUBLAS_CHECK(cublasLtMatmul(ctx.handle, plan.desc, &alpha, d_w[s], plan.w_layout, d_inp[s], plan.inp_layout, &beta,
                                    d_out[s], plan.out_layout, d_out[s], plan.out_layout, &plan.algo, workspace,
                                    CUBLASLT_WORKSPACE_BYTES, lab.stream));
    };
    lab_case(&lab, c);
    c.version = 4;
    c.checks = {bf16_output("gelu(out)", d_out[0], gelu_ref), bf16_output("pre (aux)", d_pre, out_ref)};
    c.run = [&](int s) { matmul_forward_gelu(&ctx, d_out[s], d_pre, d_inp[s], d_w[s], d_bias, N, IC, OC, lab.stream); };
    lab_case(&lab, c);

    // ---- matmul_dgelu_bgrad: dy2, Wp, pre read, dpre written, dbias read and written; 2 N IC OC FLOPs
    double dg_bytes = 2.0 * ((double)N * IC + (double)IC * OC + 2.0 * N * OC + 2.0 * OC);
    int dg_slots = lab_slots(lab, dg_bytes);
    std::vector<floatX*> d_dy2 = to_device<floatX>(dy2, dg_slots), d_wp = to_device<floatX>(wp, dg_slots);
    std::vector<floatX*> d_dpre = device_slots<floatX>((size_t)N * OC, dg_slots), d_dfcb = to_device<floatX>(dbias0, dg_slots);
    floatX* d_pre_in = to_device<floatX>(pre, 1)[0];
    floatX* dfcb_start = to_device<floatX>(dbias0, 1)[0];
    floatX* dfcb_scratch = device_alloc<floatX>(OC);
    float* dg_partials = device_alloc<float>((size_t)ceil_div(N, BIAS_BACKWARD_ROWS_PER_BLOCK) * OC);
    Case dg;
    dg.kernel = "matmul_dgelu_bgrad";
    dg.bytes = dg_bytes;
    dg.flops = 2.0 * N * (double)IC * OC;
    dg.slots = dg_slots;
    dg.checks = {bf16_output("dpre", d_dpre[0], dpre_ref), bf16_output("dbias", d_dfcb[0], dfcb_ref, false)};
    dg.prepare = [&](int s) {
        CUDA_CHECK(cudaMemcpyAsync(d_dfcb[s], dfcb_start, (size_t)OC * sizeof(floatX), cudaMemcpyDeviceToDevice, lab.stream));
    };
    c = dg;
    c.version = 1;
    c.run = [&](int s) {
        matmul_backward_data(&ctx, d_dpre[s], d_dy2[s], d_wp[s], N, OC, IC, lab.stream);
        gelu_backward_inplace(d_dpre[s], d_pre_in, (size_t)N * OC, lab.stream);
        bias_backward(d_dfcb[s], dg_partials, d_dpre[s], N, OC, lab.stream);
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        matmul_backward_data_dgelu(&ctx, d_dpre[s], dfcb_scratch, d_dy2[s], d_wp[s], d_pre_in, N, OC, IC, lab.stream);
        add_into(d_dfcb[s], dfcb_scratch, OC, lab.stream);
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) {
        matmul_dgelu_naive<<<dim3(N, ceil_div(OC, 256)), 256, 0, lab.stream>>>(d_dpre[s], d_dy2[s], d_wp[s], d_pre_in, N, IC, OC);
        CUDA_CHECK_LAUNCH();
        bias_backward_columns<<<ceil_div(OC, 128), 128, 0, lab.stream>>>(d_dfcb[s], d_dpre[s], N, OC);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);

    // ---- bias_backward: dout read once, dbias read and written
    double bb_bytes = 2.0 * N * (double)OC + 4.0 * OC;
    slots = lab_slots(lab, bb_bytes);
    std::vector<floatX*> d_dout = to_device<floatX>(dout, slots), d_dbias = to_device<floatX>(dbias0, slots);
    floatX* dbias_start = to_device<floatX>(dbias0, 1)[0];
    float* dbias32 = device_alloc<float>(OC);
    float* partials = device_alloc<float>((size_t)ceil_div(N, BIAS_BACKWARD_ROWS_PER_BLOCK) * OC);
    Case bb;
    bb.kernel = "bias_backward";
    bb.bytes = bb_bytes;
    bb.slots = slots;
    bb.checks = {bf16_output("dbias", d_dbias[0], dbias_ref, false)};
    bb.prepare = [&](int s) {
        CUDA_CHECK(cudaMemcpyAsync(d_dbias[s], dbias_start, (size_t)OC * 2, cudaMemcpyDeviceToDevice, lab.stream));
    };
    c = bb;
    c.version = 1;
    c.run = [&](int s) {
        bias_backward_columns<<<ceil_div(OC, 128), 128, 0, lab.stream>>>(d_dbias[s], d_dout[s], N, OC);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        CUDA_CHECK(cudaMemsetAsync(dbias32, 0, (size_t)OC * 4, lab.stream));
        bias_backward_atomic<<<dim3(ceil_div(OC, 256), ceil_div(N, 256)), 256, 0, lab.stream>>>(dbias32, d_dout[s], N, OC);
        CUDA_CHECK_LAUNCH();
        add_f32_to_bf16<<<ceil_div(OC, 256), 256, 0, lab.stream>>>(d_dbias[s], dbias32, OC);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) { bias_backward(d_dbias[s], partials, d_dout[s], N, OC, lab.stream); };
    lab_case(&lab, c);

    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(plan.w_layout));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(plan.inp_layout));
    CUBLAS_CHECK(cublasLtMatrixLayoutDestroy(plan.out_layout));
    CUBLAS_CHECK(cublasLtMatmulDescDestroy(plan.desc));
    int code = lab_end(&lab);
    matmul_destroy(&ctx);
    return code;
}
