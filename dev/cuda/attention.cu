// attention.cu — causal self-attention, forward and backward: from the textbook to flash attention.
//
// Per batch b and head h (T rows, hs = C/NH = 64 channels, scale = 1/sqrt(hs)):
//   forward   S = scale Q K^T (masked to u <= t),  P = softmax(S),  O = P V,  lse[t] = log sum_u exp S[t,u]
//   backward  dV = P^T dO,  dP = dO V^T,  dS = P (dP - D) scale with D[t] = sum_u P dP = dO[t].O[t],
//             dQ = dS K,  dK = dS^T Q
// FLOPs (causal, counting only u <= t): 4 hs T(T+1)/2 per head forward, twice that backward: 12.9 and
// 25.8 GFLOP at B=8. Bytes, if nothing but Q, K, V, O (and dO, dQ, dK, dV) touch memory: ~51 MB
// forward, ~101 MB backward: at an H100's ~250 FLOPs per byte, the floors from the two ceilings are
// about equal (~18 us forward). Writing P out changes everything: (B, NH, T, T) is 200 MB in bf16
// at B=8, four times the rest, and the backward reads it again.
//
// Forward versions:
//   1. naive, materialised: one thread per query row computes its scores, softmax and output with
//      plain loops, and writes P (fp32) to memory. CUDA cores, uncoalesced P writes.
//   2. trainer's simple path (llmc/kernels/attention.cuh): permute Q, K, V to (B, NH, T, hs), S = Q K^T as
//      one cuBLAS batched GEMM, a softmax kernel writing P in bf16, O = P V as another GEMM, permute
//      back. Tensor cores, but the FULL T x T (twice the causal FLOPs) and P through memory twice.
//   3. flash attention, our own kernel: a block owns 64 query rows (a thread per row, q and the
//      output accumulator in registers) and streams K and V through shared memory in tiles of 32
//      keys, keeping a running max m and sum l per row ("online softmax"): when a tile raises the
//      max, the sum and accumulator so far are rescaled by exp(m_old - m_new). P never exists; the
//      only extra output is lse = m + log l, for the backward. Causal: tiles past the block's last
//      row are never loaded. CUDA cores (fp32 FMA), so it is bounded by ~60 TFLOP/s, not by memory.
//   4. trainer's fast path (llmc/kernels/attention_cudnn.cuh): cuDNN's fused flash attention on tensor cores.
// Prediction: 1 ~1-3 TFLOP/s; 2 ~50-150 (memory traffic of S and P, wasted half of the FLOPs);
// 3 ~10-25 (fp32 CUDA cores); 4 ~300-500 (60-80% of the GEMM ceiling).
//
// Backward versions:
//   1. naive: one thread per query row writes dS (fp32) from the saved P; then one thread per
//      output element of dQ (sum over keys) and of dK, dV (sums over queries). No atomics: every
//      output element has one owner, at the price of reading dS twice.
//   2. trainer's simple path: four cuBLAS batched GEMMs and a softmax-backward kernel, on the P
//      the simple forward saved.
//   3. flash backward, our own: nothing saved but O and lse. D = dO.O per row; then a kernel where
//      a thread owns a KEY row (dK and dV accumulate in its registers while query tiles stream by,
//      P rebuilt as exp(scale q.k - lse)), and a kernel where a thread owns a QUERY row (dQ). S is
//      recomputed twice instead of dQ being accumulated with atomics: deterministic, like the
//      cuDNN form the trainer selects.
//   4. trainer's fast path: cuDNN's fused backward (deterministic engines only).
// Prediction: like the forward; 3 ~10-20 TFLOP/s, 4 ~200-400.
// Each backward runs on the outputs of its own forward (computed once, not timed), as in training.
#include "dev/cuda/common.h"
#include "llmc/kernels/attention.cuh"

static const std::vector<Version> VERSIONS = {
    {"attention_forward", 1, "naive, materialised", "a thread per query row, plain loops, P written to memory (fp32)", false},
    {"attention_forward", 2, "trainer: simple (cuBLAS)", "llmc/kernels/attention.cuh: permute, batched GEMM, softmax kernel, GEMM", true},
    {"attention_forward", 3, "flash, own kernel", "64 query rows per block, K/V tiles in shared memory, online softmax", false},
    {"attention_forward", 4, "trainer: cuDNN flash", "llmc/kernels/attention_cudnn.cuh: cuDNN's fused SDPA forward", true},
    {"attention_backward", 1, "naive, materialised", "dS from the saved P, a thread per row; then a thread per dQ, dK, dV element", false},
    {"attention_backward", 2, "trainer: simple (cuBLAS)", "llmc/kernels/attention.cuh: four batched GEMMs and a softmax backward", true},
    {"attention_backward", 3, "flash, own kernels", "P rebuilt from lse; a thread per key row (dK, dV), per query row (dQ)", false},
    {"attention_backward", 4, "trainer: cuDNN flash", "llmc/kernels/attention_cudnn.cuh: cuDNN's fused SDPA backward", true},
};

constexpr int HS = 64;  // the head size our own kernels are written for (GPT-2: 768 / 12)

// Loads 8 bf16 as floats into dst[0..8).
__device__ __forceinline__ void load8(float* dst, const floatX* src) {
    x128 v = load128(src);
    for (int k = 0; k < 8; k++) dst[k] = __bfloat162float(v[k]);
}

// ---- forward 1: a thread per (b, h, t). P (B, NH, T, T) fp32; row t holds P[t, 0..t]. The thread
// keeps its q row and its output row in registers (64 floats each) and walks the keys twice.
__global__ void attention_forward_naive(floatX* out, float* P, const floatX* qkv, int B, int T, int C, int NH) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * NH * T) return;
    int t = idx % T, h = (idx / T) % NH, b = idx / (T * NH);
    float scale = rsqrtf((float)HS), q[HS], o[HS];
    const floatX* head = qkv + (size_t)b * T * 3 * C + h * HS;
    #pragma unroll
    for (int i = 0; i < HS; i++) {
        q[i] = __bfloat162float(head[(size_t)t * 3 * C + i]);
        o[i] = 0.0f;
    }
    float* p = P + (size_t)idx * T;
    float m = -INFINITY;
    for (int u = 0; u <= t; u++) {
        const floatX* k = head + (size_t)u * 3 * C + C;
        float s = 0.0f;
        #pragma unroll
        for (int i = 0; i < HS; i++) s += q[i] * __bfloat162float(k[i]);
        p[u] = s * scale;
        m = fmaxf(m, p[u]);
    }
    float sum = 0.0f;
    for (int u = 0; u <= t; u++) {
        p[u] = expf(p[u] - m);
        sum += p[u];
    }
    for (int u = 0; u <= t; u++) {
        p[u] /= sum;
        const floatX* v = head + (size_t)u * 3 * C + 2 * C;
        #pragma unroll
        for (int i = 0; i < HS; i++) o[i] += p[u] * __bfloat162float(v[i]);
    }
    #pragma unroll
    for (int i = 0; i < HS; i++) out[((size_t)b * T + t) * C + h * HS + i] = __float2bfloat16(o[i]);
}

// ---- forward 3: flash attention. Grid (T / 64, B * NH), 64 threads: thread = query row t.
constexpr int FA_ROWS = 64, FA_KEYS = 32;
__global__ void __launch_bounds__(FA_ROWS) attention_forward_flash(floatX* out, float* lse, const floatX* qkv, int B,
                                                                   int T, int C, int NH) {
    __shared__ float k_tile[FA_KEYS][HS];
    __shared__ float v_tile[FA_KEYS][HS];
    int b = blockIdx.y / NH, h = blockIdx.y % NH;
    int row0 = (gridDim.x - 1 - blockIdx.x) * FA_ROWS;  // the blocks with the most keys start first
    int t = row0 + threadIdx.x;
    const floatX* head = qkv + (size_t)b * T * 3 * C + h * HS;  // q of row r at head + r*3C, k at +C, v at +2C
    float scale = rsqrtf((float)HS), q[HS], o[HS];
    #pragma unroll
    for (int i = 0; i < HS; i += 8) load8(q + i, head + (size_t)t * 3 * C + i);
    #pragma unroll
    for (int i = 0; i < HS; i++) {
        q[i] *= scale;  // scale once here instead of on every score
        o[i] = 0.0f;
    }
    float m = -INFINITY, l = 0.0f;
    for (int u0 = 0; u0 < row0 + FA_ROWS; u0 += FA_KEYS) {
        __syncthreads();  // everyone is done with the previous tile
        for (int v = threadIdx.x; v < FA_KEYS * HS / 8; v += FA_ROWS) {
            int r = v / (HS / 8), c = (v % (HS / 8)) * 8;
            load8(&k_tile[r][c], head + (size_t)(u0 + r) * 3 * C + C + c);
            load8(&v_tile[r][c], head + (size_t)(u0 + r) * 3 * C + 2 * C + c);
        }
        __syncthreads();
        // scores of this tile (every thread reads the same k row: a shared-memory broadcast)
        float s[FA_KEYS], tile_max = -INFINITY;
        #pragma unroll
        for (int j = 0; j < FA_KEYS; j++) {
            float dot = 0.0f;
            #pragma unroll
            for (int i = 0; i < HS; i++) dot += q[i] * k_tile[j][i];
            s[j] = u0 + j <= t ? dot : -INFINITY;
            tile_max = fmaxf(tile_max, s[j]);
        }
        // online softmax: m stays finite from the first tile on (it holds key 0 <= t)
        float m_new = fmaxf(m, tile_max), correction = expf(m - m_new);
        l *= correction;
        #pragma unroll
        for (int i = 0; i < HS; i++) o[i] *= correction;
        #pragma unroll
        for (int j = 0; j < FA_KEYS; j++) {
            float p = expf(s[j] - m_new);
            l += p;
            #pragma unroll
            for (int i = 0; i < HS; i++) o[i] += p * v_tile[j][i];
        }
        m = m_new;
    }
    floatX* dst = out + ((size_t)b * T + t) * C + h * HS;
    #pragma unroll
    for (int i = 0; i < HS; i += 8) {
        x128 o8;
        for (int k = 0; k < 8; k++) o8[k] = __float2bfloat16(o[i + k] / l);
        store128(dst + i, o8);
    }
    lse[((size_t)b * NH + h) * T + t] = m + logf(l);
}

// ---- backward 1: dS (B, NH, T, T) fp32 from P, a thread per (b, h, t), its dO row in registers
__global__ void attention_backward_naive_ds(float* dS, const float* P, const floatX* dout, const floatX* qkv, int B, int T,
                                            int C, int NH) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * NH * T) return;
    int t = idx % T, h = (idx / T) % NH, b = idx / (T * NH);
    float d_o[HS];
    #pragma unroll
    for (int i = 0; i < HS; i++) d_o[i] = __bfloat162float(dout[((size_t)b * T + t) * C + h * HS + i]);
    const float* p = P + (size_t)idx * T;
    float* ds = dS + (size_t)idx * T;
    float dot = 0.0f;
    for (int u = 0; u <= t; u++) {
        const floatX* v = qkv + ((size_t)b * T + u) * 3 * C + 2 * C + h * HS;
        float dp = 0.0f;
        #pragma unroll
        for (int i = 0; i < HS; i++) dp += d_o[i] * __bfloat162float(v[i]);
        ds[u] = dp;
        dot += p[u] * dp;
    }
    float scale = rsqrtf((float)HS);
    for (int u = 0; u <= t; u++) ds[u] = p[u] * (ds[u] - dot) * scale;
}

// backward 1: dQ[t, i] = sum_{u <= t} dS[t, u] K[u, i], a thread per (b, h, t, i)
__global__ void attention_backward_naive_dq(floatX* dqkv, const float* dS, const floatX* qkv, int B, int T, int C, int NH) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * NH * T * HS) return;
    int i = (int)(idx % HS), t = (int)((idx / HS) % T), h = (int)((idx / HS / T) % NH), b = (int)(idx / HS / T / NH);
    const float* ds = dS + (((size_t)b * NH + h) * T + t) * T;
    float acc = 0.0f;
    for (int u = 0; u <= t; u++) acc += ds[u] * __bfloat162float(qkv[((size_t)b * T + u) * 3 * C + C + h * HS + i]);
    dqkv[((size_t)b * T + t) * 3 * C + h * HS + i] = __float2bfloat16(acc);
}

// backward 1: dK[u, i] = sum_{t >= u} dS[t, u] Q[t, i], dV[u, i] = sum_{t >= u} P[t, u] dO[t, i]
__global__ void attention_backward_naive_dkv(floatX* dqkv, const float* dS, const float* P, const floatX* dout,
                                             const floatX* qkv, int B, int T, int C, int NH) {
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)B * NH * T * HS) return;
    int i = (int)(idx % HS), u = (int)((idx / HS) % T), h = (int)((idx / HS / T) % NH), b = (int)(idx / HS / T / NH);
    size_t head_rows = ((size_t)b * NH + h) * T;
    float dk = 0.0f, dv = 0.0f;
    for (int t = u; t < T; t++) {
        size_t row = (size_t)b * T + t;
        dk += dS[(head_rows + t) * T + u] * __bfloat162float(qkv[row * 3 * C + h * HS + i]);
        dv += P[(head_rows + t) * T + u] * __bfloat162float(dout[row * C + h * HS + i]);
    }
    dqkv[((size_t)b * T + u) * 3 * C + C + h * HS + i] = __float2bfloat16(dk);
    dqkv[((size_t)b * T + u) * 3 * C + 2 * C + h * HS + i] = __float2bfloat16(dv);
}

// ---- backward 3: D[b, h, t] = dO[t] . O[t], a thread per (b, h, t)
__global__ void attention_backward_flash_d(float* D, const floatX* dout, const floatX* out, int B, int T, int C, int NH) {
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= B * NH * T) return;
    int t = idx % T, h = (idx / T) % NH, b = idx / (T * NH);
    size_t at = ((size_t)b * T + t) * C + h * HS;
    float sum = 0.0f;
    for (int i = 0; i < HS; i += 8) {
        float d8[8], o8[8];
        load8(d8, dout + at + i);
        load8(o8, out + at + i);
        for (int k = 0; k < 8; k++) sum += d8[k] * o8[k];
    }
    D[idx] = sum;
}

// backward 3: dK, dV. Grid (T / 64, B * NH), 64 threads: thread = key row u, with its k and v in
// shared memory (rows padded to 65 floats: lanes read different rows at the same column without
// bank conflicts) and dK, dV in registers. Query tiles of 16 rows stream through shared memory
// (every thread reads the same query row: broadcast). Only queries t >= u contribute.
constexpr int FB_ROWS = 64, FB_TILE = 16;
__global__ void __launch_bounds__(FB_ROWS) attention_backward_flash_dkv(floatX* dqkv, const floatX* qkv, const floatX* dout,
                                                                        const float* lse, const float* D, int B, int T,
                                                                        int C, int NH) {
    __shared__ float k_rows[FB_ROWS][HS + 1], v_rows[FB_ROWS][HS + 1];
    __shared__ float q_tile[FB_TILE][HS], do_tile[FB_TILE][HS], lse_tile[FB_TILE], d_tile[FB_TILE];
    int b = blockIdx.y / NH, h = blockIdx.y % NH;
    int u0 = blockIdx.x * FB_ROWS, u = u0 + threadIdx.x;
    const floatX* head = qkv + (size_t)b * T * 3 * C + h * HS;
    const float* head_lse = lse + ((size_t)b * NH + h) * T;
    const float* head_d = D + ((size_t)b * NH + h) * T;
    float scale = rsqrtf((float)HS);
    for (int i = 0; i < HS; i += 8) {
        load8(&k_rows[threadIdx.x][i], head + (size_t)u * 3 * C + C + i);
        load8(&v_rows[threadIdx.x][i], head + (size_t)u * 3 * C + 2 * C + i);
    }
    float dk[HS], dv[HS];
    #pragma unroll
    for (int i = 0; i < HS; i++) dk[i] = dv[i] = 0.0f;
    for (int t0 = u0; t0 < T; t0 += FB_TILE) {
        __syncthreads();  // (also publishes k_rows, v_rows on the first pass)
        for (int v = threadIdx.x; v < FB_TILE * HS / 8; v += FB_ROWS) {
            int r = v / (HS / 8), c = (v % (HS / 8)) * 8;
            load8(&q_tile[r][c], head + (size_t)(t0 + r) * 3 * C + c);
            load8(&do_tile[r][c], dout + ((size_t)b * T + t0 + r) * C + h * HS + c);
        }
        if (threadIdx.x < FB_TILE) {
            lse_tile[threadIdx.x] = head_lse[t0 + threadIdx.x];
            d_tile[threadIdx.x] = head_d[t0 + threadIdx.x];
        }
        __syncthreads();
        for (int r = 0; r < FB_TILE; r++) {
            if (t0 + r < u) continue;  // causal: query t sees key u only if u <= t
            float s = 0.0f, dp = 0.0f;
            #pragma unroll
            for (int i = 0; i < HS; i++) {
                s += q_tile[r][i] * k_rows[threadIdx.x][i];
                dp += do_tile[r][i] * v_rows[threadIdx.x][i];
            }
            float p = expf(s * scale - lse_tile[r]);
            float ds = p * (dp - d_tile[r]) * scale;
            #pragma unroll
            for (int i = 0; i < HS; i++) {
                dv[i] += p * do_tile[r][i];
                dk[i] += ds * q_tile[r][i];
            }
        }
    }
    floatX* dst = dqkv + ((size_t)b * T + u) * 3 * C + h * HS;
    #pragma unroll
    for (int i = 0; i < HS; i += 8) {
        x128 k8, v8;
        for (int k = 0; k < 8; k++) {
            k8[k] = __float2bfloat16(dk[i + k]);
            v8[k] = __float2bfloat16(dv[i + k]);
        }
        store128(dst + C + i, k8);
        store128(dst + 2 * C + i, v8);
    }
}

// backward 3: dQ. Grid (T / 64, B * NH), 64 threads: thread = query row t, with its q and dO in
// padded shared memory and dQ in registers; key tiles of 16 rows stream by, keys u <= t count.
__global__ void __launch_bounds__(FB_ROWS) attention_backward_flash_dq(floatX* dqkv, const floatX* qkv, const floatX* dout,
                                                                       const float* lse, const float* D, int B, int T,
                                                                       int C, int NH) {
    __shared__ float q_rows[FB_ROWS][HS + 1], do_rows[FB_ROWS][HS + 1];
    __shared__ float k_tile[FB_TILE][HS], v_tile[FB_TILE][HS];
    int b = blockIdx.y / NH, h = blockIdx.y % NH;
    int row0 = (gridDim.x - 1 - blockIdx.x) * FB_ROWS, t = row0 + threadIdx.x;
    const floatX* head = qkv + (size_t)b * T * 3 * C + h * HS;
    for (int i = 0; i < HS; i += 8) {
        load8(&q_rows[threadIdx.x][i], head + (size_t)t * 3 * C + i);
        load8(&do_rows[threadIdx.x][i], dout + ((size_t)b * T + t) * C + h * HS + i);
    }
    float scale = rsqrtf((float)HS);
    float my_lse = lse[((size_t)b * NH + h) * T + t], my_d = D[((size_t)b * NH + h) * T + t];
    float dq[HS];
    #pragma unroll
    for (int i = 0; i < HS; i++) dq[i] = 0.0f;
    for (int u0 = 0; u0 < row0 + FB_ROWS; u0 += FB_TILE) {
        __syncthreads();
        for (int v = threadIdx.x; v < FB_TILE * HS / 8; v += FB_ROWS) {
            int r = v / (HS / 8), c = (v % (HS / 8)) * 8;
            load8(&k_tile[r][c], head + (size_t)(u0 + r) * 3 * C + C + c);
            load8(&v_tile[r][c], head + (size_t)(u0 + r) * 3 * C + 2 * C + c);
        }
        __syncthreads();
        for (int j = 0; j < FB_TILE; j++) {
            if (u0 + j > t) continue;
            float s = 0.0f, dp = 0.0f;
            #pragma unroll
            for (int i = 0; i < HS; i++) {
                s += q_rows[threadIdx.x][i] * k_tile[j][i];
                dp += do_rows[threadIdx.x][i] * v_tile[j][i];
            }
            float p = expf(s * scale - my_lse);
            float ds = p * (dp - my_d) * scale;
            #pragma unroll
            for (int i = 0; i < HS; i++) dq[i] += ds * k_tile[j][i];
        }
    }
    floatX* dst = dqkv + ((size_t)b * T + t) * 3 * C + h * HS;
    #pragma unroll
    for (int i = 0; i < HS; i += 8) {
        x128 q8;
        for (int k = 0; k < 8; k++) q8[k] = __float2bfloat16(dq[i + k]);
        store128(dst + i, q8);
    }
}

int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "attention", VERSIONS);
    int B = lab.B, T = lab.T, C = lab.C, NH = lab.NH, hs = C / NH;
    size_t btc = (size_t)B * T * C, rows = (size_t)B * NH * T, scores = rows * T;
    if (hs != HS) fail("attention.cu is written for head size %d, not %d", HS, hs);

    // q, k, v ~ N(0, 1): scores ~ N(0, 1) after the 1/sqrt(hs) scale, softmax neither flat nor one-hot
    std::vector<float> qkv = random_normal(3 * btc, next_seed(&lab), 0.0f, 1.0f);
    std::vector<float> dout = random_normal(btc, next_seed(&lab), 0.0f, 1.0f);
    round_to_bf16(&qkv);
    round_to_bf16(&dout);
    std::vector<float> out_ref(btc), att_ref(scores), dqkv_ref(3 * btc), lse_ref(rows);
    cpu::attention_forward(out_ref.data(), att_ref.data(), qkv.data(), B, T, C, NH);
    cpu::attention_backward(dqkv_ref.data(), dout.data(), qkv.data(), att_ref.data(), B, T, C, NH);
    // lse: the CPU trainer does not keep it; the definition, in double
    #pragma omp parallel for schedule(dynamic, 16)
    for (size_t r = 0; r < rows; r++) {
        int t = (int)(r % T), h = (int)((r / T) % NH), b = (int)(r / T / NH);
        const float* q = qkv.data() + ((size_t)b * T + t) * 3 * C + h * hs;
        std::vector<double> s(t + 1);
        double m = -INFINITY, sum = 0;
        for (int u = 0; u <= t; u++) {
            const float* k = qkv.data() + ((size_t)b * T + u) * 3 * C + C + h * hs;
            double dot = 0;
            for (int i = 0; i < hs; i++) dot += (double)q[i] * k[i];
            s[u] = dot / std::sqrt((double)hs);
            m = std::max(m, s[u]);
        }
        for (int u = 0; u <= t; u++) sum += std::exp(s[u] - m);
        lse_ref[r] = (float)(m + std::log(sum));
    }
    std::vector<float>().swap(att_ref);

    // ---- the paths' state: the simple path's scratch and cuBLAS handle; cuDNN only if asked for
    void* workspace = device_alloc<char>(CUBLASLT_WORKSPACE_BYTES);
    AttentionContext simple;
    attention_init(&simple, workspace, CUBLASLT_WORKSPACE_BYTES);
    simple.qkv_scratch = device_alloc<floatX>(3 * btc);
    simple.dqkv_scratch = device_alloc<floatX>(3 * btc);
    simple.o_scratch = device_alloc<floatX>(btc);
    simple.scores = device_alloc<floatX>(scores);
    // A cuDNN that cannot build the graph (missing engines, an old version, the CPU emulation's
    // stand-in, which refuses every graph) costs the two cuDNN rows, not the run: they become SKIP
    // rows saying why, and the other versions still run.
    CudnnAttention cudnn;
    bool want_cudnn = lab_selected(lab.args, "attention_forward", 4) || lab_selected(lab.args, "attention_backward", 4);
    std::string cudnn_refused;
    bool have_cudnn = want_cudnn && cudnn_attention_setup(&cudnn, B, T, C, NH, &cudnn.workspace_bytes, &cudnn_refused);
    std::string cudnn_skip = "cuDNN refused the attention graph: " + cudnn_refused;
    if (want_cudnn && !have_cudnn) printf("%s\n", cudnn_skip.c_str());
    if (have_cudnn) {
        cudnn.workspace = device_alloc<char>(cudnn.workspace_bytes);
        cudnn.softmax_sum = device_alloc<float>(rows);
    }
    bool tiles_fit = T % FA_ROWS == 0;  // our flash kernels' row blocks (FB_ROWS = FA_ROWS)

    // ---- forward
    double fwd_flops = 2.0 * hs * (double)B * NH * T * (T + 1);
    double fwd_bytes = 2.0 * 3 * btc + 2.0 * btc + 4.0 * rows;
    int slots = lab_slots(lab, fwd_bytes);
    std::vector<floatX*> d_qkv = to_device<floatX>(qkv, slots), d_out = device_slots<floatX>(btc, slots);
    std::vector<float*> d_lse = device_slots<float>(rows, slots);
    float* P32 = device_alloc<float>(scores);   // the naive path's P (fp32)
    floatX* att = device_alloc<floatX>(scores);  // the simple path's P (bf16)
    Case fwd;
    fwd.kernel = "attention_forward";
    fwd.bytes = fwd_bytes;
    fwd.flops = fwd_flops;
    fwd.slots = slots;
    fwd.checks = {bf16_output("out", d_out[0], out_ref)};
    Case c = fwd;
    c.version = 1;
    c.run = [&](int s) {
        attention_forward_naive<<<ceil_div(rows, 128), 128, 0, lab.stream>>>(d_out[s], P32, d_qkv[s], B, T, C, NH);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) { attention_forward(&simple, d_out[s], nullptr, att, d_qkv[s], B, T, C, NH, lab.stream); };
    lab_case(&lab, c);
    fwd.checks.push_back(f32_output("lse", d_lse[0], lse_ref));
    c = fwd;
    if (!tiles_fit) {
        lab_skip(&lab, "attention_forward", 3, "T must be a multiple of 64");
    } else {
        c.version = 3;
        c.run = [&](int s) {
            attention_forward_flash<<<dim3(T / FA_ROWS, B * NH), FA_ROWS, 0, lab.stream>>>(d_out[s], d_lse[s], d_qkv[s], B, T,
                                                                                          C, NH);
            CUDA_CHECK_LAUNCH();
        };
        lab_case(&lab, c);
    }
    if (!have_cudnn) {
        lab_skip(&lab, "attention_forward", 4, cudnn_skip.c_str());
    } else {
        c.version = 4;
        c.run = [&](int s) { cudnn_attention_forward(&cudnn, d_out[s], d_lse[s], d_qkv[s], B, T, C, NH, lab.stream); };
        lab_case(&lab, c);
    }

    // ---- backward: each version on its own forward's saved tensors (computed here, once per slot)
    double bwd_flops = 2.0 * fwd_flops;
    double bwd_bytes = 2.0 * (3 * btc + btc + btc + 3 * btc) + 4.0 * rows;  // qkv, out, dout read; dqkv written
    slots = lab_slots(lab, bwd_bytes);
    std::vector<floatX*> b_qkv = to_device<floatX>(qkv, slots), b_dout = to_device<floatX>(dout, slots);
    std::vector<floatX*> b_out = device_slots<floatX>(btc, slots), b_dqkv = device_slots<floatX>(3 * btc, slots);
    std::vector<float*> b_lse = device_slots<float>(rows, slots);
    float* dS32 = device_alloc<float>(scores);
    float* Dbuf = device_alloc<float>(rows);
    std::vector<float*> b_P32(slots);  // naive: P per slot (fp32)
    std::vector<floatX*> b_att(slots);  // simple: P per slot (bf16)
    Case bwd;
    bwd.kernel = "attention_backward";
    bwd.bytes = bwd_bytes;
    bwd.flops = bwd_flops;
    bwd.slots = slots;
    bwd.checks = {bf16_output("dqkv", b_dqkv[0], dqkv_ref)};
    auto forward_done = [&] { CUDA_CHECK(cudaStreamSynchronize(lab.stream)); };

    if (lab_selected(lab.args, "attention_backward", 1)) {
        for (int s = 0; s < slots; s++) {
            b_P32[s] = s == 0 ? P32 : device_alloc<float>(scores);
            attention_forward_naive<<<ceil_div(rows, 128), 128, 0, lab.stream>>>(b_out[s], b_P32[s], b_qkv[s], B, T, C, NH);
            CUDA_CHECK_LAUNCH();
        }
        forward_done();
        c = bwd;
        c.version = 1;
        c.run = [&](int s) {
            attention_backward_naive_ds<<<ceil_div(rows, 128), 128, 0, lab.stream>>>(dS32, b_P32[s], b_dout[s], b_qkv[s], B,
                                                                                     T, C, NH);
            CUDA_CHECK_LAUNCH();
            attention_backward_naive_dq<<<ceil_div(rows * HS, 256), 256, 0, lab.stream>>>(b_dqkv[s], dS32, b_qkv[s], B, T, C,
                                                                                         NH);
            CUDA_CHECK_LAUNCH();
            attention_backward_naive_dkv<<<ceil_div(rows * HS, 256), 256, 0, lab.stream>>>(b_dqkv[s], dS32, b_P32[s],
                                                                                          b_dout[s], b_qkv[s], B, T, C, NH);
            CUDA_CHECK_LAUNCH();
        };
        lab_case(&lab, c);
    }
    if (lab_selected(lab.args, "attention_backward", 2)) {
        for (int s = 0; s < slots; s++) {
            b_att[s] = s == 0 ? att : device_alloc<floatX>(scores);
            attention_forward(&simple, b_out[s], nullptr, b_att[s], b_qkv[s], B, T, C, NH, lab.stream);
        }
        forward_done();
        c = bwd;
        c.version = 2;
        c.run = [&](int s) {
            attention_backward(&simple, b_dqkv[s], b_dout[s], b_qkv[s], b_out[s], nullptr, b_att[s], B, T, C, NH, lab.stream);
        };
        lab_case(&lab, c);
    }
    if (!tiles_fit) {
        lab_skip(&lab, "attention_backward", 3, "T must be a multiple of 64");
    } else if (lab_selected(lab.args, "attention_backward", 3)) {
        for (int s = 0; s < slots; s++) {
            attention_forward_flash<<<dim3(T / FA_ROWS, B * NH), FA_ROWS, 0, lab.stream>>>(b_out[s], b_lse[s], b_qkv[s], B, T,
                                                                                          C, NH);
            CUDA_CHECK_LAUNCH();
        }
        forward_done();
        c = bwd;
        c.version = 3;
        c.run = [&](int s) {
            attention_backward_flash_d<<<ceil_div(rows, 128), 128, 0, lab.stream>>>(Dbuf, b_dout[s], b_out[s], B, T, C, NH);
            CUDA_CHECK_LAUNCH();
            attention_backward_flash_dkv<<<dim3(T / FB_ROWS, B * NH), FB_ROWS, 0, lab.stream>>>(
                b_dqkv[s], b_qkv[s], b_dout[s], b_lse[s], Dbuf, B, T, C, NH);
            CUDA_CHECK_LAUNCH();
            attention_backward_flash_dq<<<dim3(T / FB_ROWS, B * NH), FB_ROWS, 0, lab.stream>>>(
                b_dqkv[s], b_qkv[s], b_dout[s], b_lse[s], Dbuf, B, T, C, NH);
            CUDA_CHECK_LAUNCH();
        };
        lab_case(&lab, c);
    }
    if (!have_cudnn) {
        lab_skip(&lab, "attention_backward", 4, cudnn_skip.c_str());
    } else if (lab_selected(lab.args, "attention_backward", 4)) {
        for (int s = 0; s < slots; s++) cudnn_attention_forward(&cudnn, b_out[s], b_lse[s], b_qkv[s], B, T, C, NH, lab.stream);
        forward_done();
        c = bwd;
        c.version = 4;
        c.run = [&](int s) {
            cudnn_attention_backward(&cudnn, b_dqkv[s], b_dout[s], b_qkv[s], b_out[s], b_lse[s], B, T, C, NH, lab.stream);
        };
        lab_case(&lab, c);
    }

    int code = lab_end(&lab);
    if (have_cudnn) cudnn_attention_destroy(&cudnn);
    attention_destroy(&simple);
    return code;
}
