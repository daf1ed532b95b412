// train_gpt_cpu.cpp — GPT-2 training on the CPU, in fp32: the reference for every GPU kernel.
//
// Read it top to bottom: the layers, each with its forward and backward pass written out by hand
// (no autograd), then the model that strings them together, the optimizer, and the training loop.
// Everything the GPU trainer shares with this one (shapes, files, flags, data, schedule, sampling)
// lives in llmc/; what is here is the math, as plain loops parallelised with OpenMP.
//
// Shapes: B sequences of T tokens, C channels, NH heads of hs = C/NH channels, vocab Vp (padded).
// Activations are row-major (B, T, X); weights are (out, in) as in nn.Linear, y = x W^T + b.
//
// Determinism: every output element is computed by exactly one thread, in a fixed order, and every
// reduction across rows runs in a fixed order too, so a run is bit-identical for a given thread
// count (and matmuls, the bulk of the work, are identical for any thread count).
//
// Tests and the dev/ kernel lab include this file with LLMC_CPU_NO_MAIN defined, to use these
// functions as their reference.
#include <omp.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/cli.h"
#include "llmc/comm.h"
#include "llmc/cpu_buffers.h"
#include "llmc/dataloader.h"
#include "llmc/estimate.h"
#include "llmc/formats.h"
#include "llmc/hellaswag.h"
#include "llmc/metrics.h"
#include "llmc/model.h"
#include "llmc/sampler.h"
#include "llmc/sharding.h"
#include "llmc/training.h"
#include "llmc/utils.h"

// ==============================================================================================
// exp for vector loops.
//
// libm's expf is an opaque function call, so a loop over it runs one element at a time (compilers
// only substitute vector versions under -ffast-math, which would also let them reorder our sums).
// Softmax and GELU evaluate tens of millions of exponentials per step, so we write exp as plain
// arithmetic the compiler can vectorize:
//   x = k ln2 + r, k = round(x / ln2), |r| <= ln2/2   (ln2 split in two parts so k ln2 is exact)
//   exp(x) = 2^k * exp(r)                               (2^k: k written into the float's exponent bits)
//   exp(r) = Taylor series to r^7                       (truncation < 1e-8 relative for |r| <= 0.35)
// Accurate to about 1 ulp on [-87, 88]; inputs outside are clamped (exp underflows/overflows there).
static inline float vexpf(float x) {
    x = x < -87.0f ? -87.0f : (x > 88.0f ? 88.0f : x);
    float k = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;  // round to nearest (1.5 * 2^23 trick)
    float r = x - k * 0.693145751953125f;                                  // ln2, high part (exact product)
    r = r - k * 1.42860682030941723e-06f;                                  // ln2, low part
    float p = 1.0f / 5040.0f;
    p = p * r + 1.0f / 720.0f;
    p = p * r + 1.0f / 120.0f;
    p = p * r + 1.0f / 24.0f;
    p = p * r + 1.0f / 6.0f;
    p = p * r + 0.5f;
    p = p * r + 1.0f;
    p = p * r + 1.0f;
    int32_t exponent_bits = ((int32_t)k + 127) << 23;
    float two_to_k;
    memcpy(&two_to_k, &exponent_bits, 4);
    return p * two_to_k;
}

// ==============================================================================================
// Matmul: where ~90% of the time goes.
//
// One routine computes C[M x N] (+)= A[M x K] * B[K x N] for the three products training needs:
//   forward          out  = inp  * W^T    (BT x OC) = (BT x IC)(IC x OC)
//   backward, data   dinp = dout * W      (BT x IC) = (BT x OC)(OC x IC)
//   backward, weight dW  += dout^T * inp  (OC x IC) = (OC x BT)(BT x IC)
// A and B are addressed through (row stride, column stride), so a transpose is just a swap of
// strides. The speed comes from three ideas, the same ones every BLAS uses:
//   1. a register tile: an MR x NR block of C is accumulated in vector registers (8 rows x 32
//      columns = 16 AVX-512 registers) while k runs, so each loaded value feeds MR or NR FMAs;
//   2. packing: the slices of A and B the tile loop needs are first copied into contiguous
//      "panels" (MR rows or NR columns wide, k-major), so the inner loop reads memory in order
//      whatever the original strides were, and transposes cost one copy instead of cache misses;
//   3. blocking: K is processed KC = 256 at a time so the panels being reused stay in cache.
// Each C tile belongs to one thread and k runs in a fixed order: results do not depend on the
// number of threads. (MATMUL_MR, _NR, _KC, _NC live in llmc/cpu_buffers.h: they size the panels.)

// 16 floats: one AVX-512 register (the compiler splits it into two on AVX2 machines).
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16_unaligned __attribute__((vector_size(64), aligned(4)));

// C[m_valid x n_valid] (+)= Ap (kc x MR panel)^T * Bp (kc x NR panel)
static inline void matmul_micro_kernel(int kc, const float* __restrict Ap, const float* __restrict Bp, float* C,
                                       size_t ldc, int m_valid, int n_valid, bool accumulate) {
    constexpr int MR = MATMUL_MR, NR = MATMUL_NR;
    vec16 acc[MR][2] = {};
    for (int k = 0; k < kc; k++) {
        vec16 b0 = *(const vec16*)(Bp + k * NR);
        vec16 b1 = *(const vec16*)(Bp + k * NR + 16);
        #pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            float a = Ap[k * MR + i];  // broadcast one element of A against 32 of B
            acc[i][0] += a * b0;
            acc[i][1] += a * b1;
        }
    }
    float tile[MR][NR];
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        *(vec16_unaligned*)&tile[i][0] = acc[i][0];
        *(vec16_unaligned*)&tile[i][16] = acc[i][1];
    }
    for (int i = 0; i < m_valid; i++) {
        float* c = C + i * ldc;
        if (accumulate) for (int j = 0; j < n_valid; j++) c[j] += tile[i][j];
        else for (int j = 0; j < n_valid; j++) c[j] = tile[i][j];
    }
}

// The packed panels, kept between calls (the sizes repeat every step). The trainer sizes them once,
// up front, from its table (llmc/cpu_buffers.h: the largest M it will see); a call that needs more
// (a test's shapes) grows them. In vec16 units, which the allocator aligns to 64 bytes for the
// micro-kernel's vector loads.
struct MatmulScratch {
    std::vector<vec16> a_pack, b_pack;
};
static MatmulScratch matmul_scratch;

static void matmul_scratch_reserve(size_t a_floats, size_t b_floats) {
    // a fresh vector of exactly the size asked: growing one in place may reserve more than that
    if (matmul_scratch.a_pack.size() * 16 < a_floats) std::vector<vec16>((a_floats + 15) / 16).swap(matmul_scratch.a_pack);
    if (matmul_scratch.b_pack.size() * 16 < b_floats) std::vector<vec16>((b_floats + 15) / 16).swap(matmul_scratch.b_pack);
}

// A(i,k) = A[i*a_rs + k*a_cs]; B(k,j) = B[k*b_rs + j*b_cs]; C row-major with leading dimension ldc.
void matmul(int M, int N, int K, const float* A, size_t a_rs, size_t a_cs, const float* B, size_t b_rs,
            size_t b_cs, float* C, size_t ldc, bool accumulate) {
    constexpr int MR = MATMUL_MR, NR = MATMUL_NR, KC = MATMUL_KC, NC = MATMUL_NC;
    int m_panels = (M + MR - 1) / MR;
    matmul_scratch_reserve(matmul_pack_a_floats(M), MATMUL_PACK_B_FLOATS);  // no-op once the trainer sized them
    float* Ap = (float*)matmul_scratch.a_pack.data();
    float* Bp = (float*)matmul_scratch.b_pack.data();
    if (K == 0 && !accumulate) {
        for (int i = 0; i < M; i++) memset(C + (size_t)i * ldc, 0, (size_t)N * sizeof(float));
        return;
    }
    for (int jc = 0; jc < N; jc += NC) {
        int nc = std::min(NC, N - jc);
        int n_panels = (nc + NR - 1) / NR;
        for (int pc = 0; pc < K; pc += KC) {
            int kc = std::min(KC, K - pc);
            bool add = accumulate || pc > 0;
            #pragma omp parallel
            {
                #pragma omp for schedule(static)
                for (int jp = 0; jp < n_panels; jp++) {  // pack B[pc:pc+kc, jc:jc+nc] in NR-wide panels
                    float* dst = Bp + (size_t)jp * NR * kc;
                    for (int k = 0; k < kc; k++) {
                        const float* src = B + (size_t)(pc + k) * b_rs;
                        for (int j = 0; j < NR; j++) {
                            int col = jc + jp * NR + j;
                            dst[k * NR + j] = col < N ? src[(size_t)col * b_cs] : 0.0f;
                        }
                    }
                }
                #pragma omp for schedule(static)
                for (int ip = 0; ip < m_panels; ip++) {  // pack A[0:M, pc:pc+kc] in MR-tall panels
                    float* dst = Ap + (size_t)ip * MR * kc;
                    for (int k = 0; k < kc; k++) {
                        for (int i = 0; i < MR; i++) {
                            int row = ip * MR + i;
                            dst[k * MR + i] = row < M ? A[(size_t)row * a_rs + (size_t)(pc + k) * a_cs] : 0.0f;
                        }
                    }
                }
                #pragma omp for schedule(static) collapse(2)
                for (int jp = 0; jp < n_panels; jp++) {
                    for (int ip = 0; ip < m_panels; ip++) {
                        int row = ip * MR, col = jc + jp * NR;
                        matmul_micro_kernel(kc, Ap + (size_t)ip * MR * kc, Bp + (size_t)jp * NR * kc,
                                            C + (size_t)row * ldc + col, ldc, std::min(MR, M - row),
                                            std::min(NR, N - col), add);
                    }
                }
            }
        }
    }
}

// out (N x OC) = inp (N x IC) * weight^T + bias
void matmul_forward(float* out, const float* inp, const float* weight, const float* bias, int N, int IC, int OC) {
    matmul(N, OC, IC, inp, IC, 1, weight, 1, IC, out, OC, false);
    if (bias) {
        #pragma omp parallel for schedule(static)
        for (int n = 0; n < N; n++)
            for (int o = 0; o < OC; o++) out[(size_t)n * OC + o] += bias[o];
    }
}

// dinp = dout * weight (overwritten); dweight += dout^T * inp; dbias += column sums of dout.
void matmul_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                     const float* weight, int N, int IC, int OC) {
    if (dinp) matmul(N, IC, OC, dout, OC, 1, weight, IC, 1, dinp, IC, false);
    matmul(OC, IC, N, dout, 1, OC, inp, IC, 1, dweight, IC, true);
    if (dbias) {
        #pragma omp parallel for schedule(static)
        for (int o = 0; o < OC; o++) {
            float sum = 0.0f;
            for (int n = 0; n < N; n++) sum += dout[(size_t)n * OC + o];
            dbias[o] += sum;
        }
    }
}

// ==============================================================================================
// Embeddings: x[b,t,:] = wte[token[b,t],:] + wpe[t,:]

void encoder_forward(float* out, const int* tokens, const float* wte, const float* wpe, int B, int T, int C) {
    #pragma omp parallel for schedule(static)
    for (int bt = 0; bt < B * T; bt++) {
        const float* tok = wte + (size_t)tokens[bt] * C;
        const float* pos = wpe + (size_t)(bt % T) * C;
        float* o = out + (size_t)bt * C;
        for (int c = 0; c < C; c++) o[c] = tok[c] + pos[c];
    }
}

// The gradient of a lookup is a scatter-add: each position adds its gradient to the row it read.
// Several positions may read the same token, so threads split the channels, not the positions:
// no two threads ever add to the same element, and the order of additions is fixed.
void encoder_backward(float* dwte, float* dwpe, const float* dout, const int* tokens, int B, int T, int C) {
    #pragma omp parallel for schedule(static)
    for (int c0 = 0; c0 < C; c0 += 16) {
        int c1 = std::min(C, c0 + 16);
        for (int bt = 0; bt < B * T; bt++) {
            const float* d = dout + (size_t)bt * C;
            float* tok = dwte + (size_t)tokens[bt] * C;
            float* pos = dwpe + (size_t)(bt % T) * C;
            for (int c = c0; c < c1; c++) {
                tok[c] += d[c];
                pos[c] += d[c];
            }
        }
    }
}

// ==============================================================================================
// LayerNorm: y = (x - mean) * rstd * w + b, with rstd = 1/sqrt(var + 1e-5), per row of C.
// mean and rstd are kept for the backward pass (2 floats per row instead of recomputing).

void layernorm_forward(float* out, float* mean, float* rstd, const float* inp, const float* weight,
                       const float* bias, int N, int C) {
    const float eps = 1e-5f;
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* x = inp + (size_t)n * C;
        float m = 0.0f;
        for (int c = 0; c < C; c++) m += x[c];
        m /= C;
        float v = 0.0f;
        for (int c = 0; c < C; c++) v += (x[c] - m) * (x[c] - m);
        v /= C;
        float s = 1.0f / sqrtf(v + eps);
        float* y = out + (size_t)n * C;
        for (int c = 0; c < C; c++) y[c] = (x[c] - m) * s * weight[c] + bias[c];
        mean[n] = m;
        rstd[n] = s;
    }
}

// With xhat = (x - mean) * rstd and g = dy * w:
//   dx = rstd * (g - mean(g) - xhat * mean(g * xhat))      (the two means come from d mean, d var)
//   dw += sum over rows of dy * xhat,   db += sum over rows of dy
// dx is ADDED to dinp: the input of a LayerNorm is the residual stream, whose gradient collects
// contributions from every block above.
void layernorm_backward(float* dinp, float* dweight, float* dbias, const float* dout, const float* inp,
                        const float* weight, const float* mean, const float* rstd, int N, int C) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* dy = dout + (size_t)n * C;
        const float* x = inp + (size_t)n * C;
        float m = mean[n], s = rstd[n];
        float mean_g = 0.0f, mean_g_xhat = 0.0f;
        for (int c = 0; c < C; c++) {
            float g = dy[c] * weight[c];
            mean_g += g;
            mean_g_xhat += g * (x[c] - m) * s;
        }
        mean_g /= C;
        mean_g_xhat /= C;
        float* dx = dinp + (size_t)n * C;
        for (int c = 0; c < C; c++) {
            float xhat = (x[c] - m) * s;
            dx[c] += s * (dy[c] * weight[c] - mean_g - xhat * mean_g_xhat);
        }
    }
    // parameter gradients: threads own channels, rows are summed in order
    #pragma omp parallel for schedule(static)
    for (int c = 0; c < C; c++) {
        float dw = 0.0f, db = 0.0f;
        for (int n = 0; n < N; n++) {
            float dy = dout[(size_t)n * C + c];
            dw += dy * (inp[(size_t)n * C + c] - mean[n]) * rstd[n];
            db += dy;
        }
        dweight[c] += dw;
        dbias[c] += db;
    }
}

// ==============================================================================================
// Causal self-attention, one (batch, head) at a time.
//   qkv (B, T, 3C) holds q | k | v; head h uses channels [h*hs, (h+1)*hs) of each.
//   att[b,h,t,u] = softmax_u( q_t . k_u / sqrt(hs) ) for u <= t, 0 for u > t (the causal mask)
//   out[b,t,h*hs:(h+1)*hs] = sum_u att[b,h,t,u] v_u
// The probabilities att (B, NH, T, T) are kept for the backward pass; the flash-attention kernels
// on the GPU avoid storing them by recomputing them block by block.

void attention_forward(float* out, float* att, const float* qkv, int B, int T, int C, int NH) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            for (int t = 0; t < T; t++) {
                const float* q = qkv + ((size_t)b * T + t) * 3 * C + h * hs;
                float* a = att + (((size_t)b * NH + h) * T + t) * T;
                float max_score = -INFINITY;
                for (int u = 0; u <= t; u++) {
                    const float* k = qkv + ((size_t)b * T + u) * 3 * C + C + h * hs;
                    float s = 0.0f;
                    for (int i = 0; i < hs; i++) s += q[i] * k[i];
                    a[u] = s * scale;
                    max_score = std::max(max_score, a[u]);
                }
                float sum = 0.0f;
                for (int u = 0; u <= t; u++) {
                    a[u] = vexpf(a[u] - max_score);  // subtract the max: exp never overflows
                    sum += a[u];
                }
                for (int u = 0; u <= t; u++) a[u] /= sum;
                for (int u = t + 1; u < T; u++) a[u] = 0.0f;
                float* o = out + ((size_t)b * T + t) * C + h * hs;
                for (int i = 0; i < hs; i++) o[i] = 0.0f;
                for (int u = 0; u <= t; u++) {
                    const float* v = qkv + ((size_t)b * T + u) * 3 * C + 2 * C + h * hs;
                    for (int i = 0; i < hs; i++) o[i] += a[u] * v[i];
                }
            }
        }
    }
}

// Backward, for one row t of one (b, h), with P = att[t, :], dO = dout[t]:
//   dP_u = dO . v_u                       dv_u += P_u dO
//   dS_u = P_u (dP_u - sum_w P_w dP_w)    (softmax backward)
//   dq_t += sum_u dS_u k_u / sqrt(hs)     dk_u += dS_u q_t / sqrt(hs)
// dqkv is overwritten. A thread owns a whole (b, h): it alone writes that head's slice of dqkv.
void attention_backward(float* dqkv, const float* dout, const float* qkv, const float* att, int B, int T, int C, int NH) {
    int hs = C / NH;
    float scale = 1.0f / sqrtf((float)hs);
    #pragma omp parallel for collapse(2) schedule(static)
    for (int b = 0; b < B; b++) {
        for (int h = 0; h < NH; h++) {
            std::vector<float> dscore(T);
            for (int t = 0; t < T; t++) {
                float* dq = dqkv + ((size_t)b * T + t) * 3 * C + h * hs;
                for (int part = 0; part < 3; part++)
                    for (int i = 0; i < hs; i++) dq[part * C + i] = 0.0f;
            }
            for (int t = 0; t < T; t++) {
                const float* p = att + (((size_t)b * NH + h) * T + t) * T;
                const float* dout_t = dout + ((size_t)b * T + t) * C + h * hs;
                float p_dot_dp = 0.0f;
                for (int u = 0; u <= t; u++) {
                    const float* v = qkv + ((size_t)b * T + u) * 3 * C + 2 * C + h * hs;
                    float* dv = dqkv + ((size_t)b * T + u) * 3 * C + 2 * C + h * hs;
                    float dp = 0.0f;
                    for (int i = 0; i < hs; i++) {
                        dp += dout_t[i] * v[i];
                        dv[i] += p[u] * dout_t[i];
                    }
                    dscore[u] = dp;
                    p_dot_dp += p[u] * dp;
                }
                const float* q = qkv + ((size_t)b * T + t) * 3 * C + h * hs;
                float* dq = dqkv + ((size_t)b * T + t) * 3 * C + h * hs;
                for (int u = 0; u <= t; u++) {
                    float ds = p[u] * (dscore[u] - p_dot_dp) * scale;
                    const float* k = qkv + ((size_t)b * T + u) * 3 * C + C + h * hs;
                    float* dk = dqkv + ((size_t)b * T + u) * 3 * C + C + h * hs;
                    for (int i = 0; i < hs; i++) {
                        dq[i] += ds * k[i];
                        dk[i] += ds * q[i];
                    }
                }
            }
        }
    }
}

// ==============================================================================================
// GELU, tanh approximation (GPT-2's): gelu(x) = x/2 * (1 + tanh(u)), u = sqrt(2/pi) (x + 0.044715 x^3).
// Since 1 + tanh(u) = 2 sigmoid(2u), gelu(x) = x * sigmoid(2u): one exponential, no cancellation.

constexpr float GELU_SCALE = 0.7978845608028654f;  // sqrt(2/pi)

void gelu_forward(float* out, const float* inp, size_t n) {
    #pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_SCALE * (x + 0.044715f * x * x * x);
        out[i] = x / (1.0f + vexpf(-2.0f * u));
    }
}

// With s = sigmoid(2u):  d gelu/dx = s + 2 x s (1 - s) du/dx,   du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// (the same as d/dx of x/2 (1 + tanh u), since 1 - tanh^2 u = 4 s (1 - s)). dinp is overwritten.
void gelu_backward(float* dinp, const float* inp, const float* dout, size_t n) {
    #pragma omp parallel for simd schedule(static)
    for (size_t i = 0; i < n; i++) {
        float x = inp[i];
        float u = GELU_SCALE * (x + 0.044715f * x * x * x);
        float s = 1.0f / (1.0f + vexpf(-2.0f * u));
        float du_dx = GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
        dinp[i] = dout[i] * (s + 2.0f * x * s * (1.0f - s) * du_dx);
    }
}

void residual_forward(float* out, const float* a, const float* b, size_t n) {
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) out[i] = a[i] + b[i];
}

// ==============================================================================================
// The classifier: softmax + cross-entropy, fused.
//   loss_bt = logsumexp(z) - z[target]      over the V real tokens (the padding never enters)
//   dz_v    = (softmax(z)_v - [v == target]) * dloss = (exp(z_v - logsumexp(z)) - [v == target]) * dloss
// The forward keeps one number per position, logsumexp(z); the backward turns the logits into their
// gradient in place with one more pass, so the (BT x Vp) probabilities never exist as a buffer.

void crossentropy_forward(float* losses, float* logsumexp, const float* logits, const int* targets, int N, int V, int Vp) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        const float* z = logits + (size_t)n * Vp;
        float max_z = -INFINITY;
        for (int v = 0; v < V; v++) max_z = std::max(max_z, z[v]);
        float sum = 0.0f;
        #pragma omp simd reduction(+ : sum)
        for (int v = 0; v < V; v++) sum += vexpf(z[v] - max_z);  // subtract the max: exp never overflows
        logsumexp[n] = max_z + logf(sum);
        losses[n] = logsumexp[n] - z[targets[n]];
    }
}

// logits (N x Vp) -> dlogits, in place. dloss is d(total loss)/d(loss of one position).
void crossentropy_softmax_backward(float* logits, const float* logsumexp, const int* targets, int N, int V, int Vp, float dloss) {
    #pragma omp parallel for schedule(static)
    for (int n = 0; n < N; n++) {
        float* z = logits + (size_t)n * Vp;
        float lse = logsumexp[n];
        #pragma omp simd
        for (int v = 0; v < V; v++) z[v] = vexpf(z[v] - lse) * dloss;
        z[targets[n]] -= dloss;
        for (int v = V; v < Vp; v++) z[v] = 0.0f;
    }
}

// ==============================================================================================
// The model: parameters, their gradients and AdamW moments (flat arrays, see llmc/model.h), and
// the activations of one micro-batch. Every one of them is a row of the size table in
// llmc/cpu_buffers.h, which says how large it is; --estimate prints that same table.

// Every activation the backward pass needs, for B x T tokens. Per-layer tensors are stacked over
// layers so the backward pass can find layer l's inputs.
struct Activations {
    std::vector<float> encoded;                       // (B,T,C)   embeddings = residual stream in
    std::vector<float> ln1, ln1_mean, ln1_rstd;       // (L,B,T,C), (L,B,T), (L,B,T)
    std::vector<float> qkv;                           // (L,B,T,3C)
    std::vector<float> att;                           // (L,B,NH,T,T) attention probabilities
    std::vector<float> atty;                          // (L,B,T,C)  attention output, before projection
    std::vector<float> residual2;                     // (L,B,T,C)  residual after attention
    std::vector<float> ln2, ln2_mean, ln2_rstd;       // (L,B,T,C), (L,B,T), (L,B,T)
    std::vector<float> fch, fch_gelu;                 // (L,B,T,4C) MLP hidden, before and after GELU
    std::vector<float> residual3;                     // (L,B,T,C)  residual after the MLP = block output
    std::vector<float> lnf, lnf_mean, lnf_rstd;       // (B,T,C), (B,T), (B,T)
    std::vector<float> logits;                        // (B,T,Vp), overwritten by dlogits in backward
    std::vector<float> losses, logsumexp;             // (B,T), (B,T): per-position loss, softmax normaliser
    // backward scratch, one layer's worth, reused by every layer
    std::vector<float> dresidual;                     // (B,T,C) gradient of the residual stream
    std::vector<float> dbuf_c, dbuf_3c, dbuf_4c;      // (B,T,C), (B,T,3C), (B,T,4C)
};

struct GPT2 {
    GPT2Config config;
    ParamLayout layout;
    std::vector<float> params, grads, adam_m, adam_v;
    ParamTensors<float> p, g;      // pointers to each tensor inside params / grads
    Activations acts;
    std::vector<BufferSpec> table; // the sizes everything was allocated with (llmc/cpu_buffers.h)
    int max_B = 0, max_T = 0;      // the activations were sized for this
};

// The vector that holds row `b` of the size table; null for the rows held elsewhere (the gradient
// shard of data parallelism, the matmul's packed panels).
static std::vector<float>* gpt2_buffer(GPT2* m, int b) {
    Activations& a = m->acts;
    switch (b) {
        case CB_PARAMS: return &m->params;        case CB_GRADS: return &m->grads;
        case CB_ADAM_M: return &m->adam_m;        case CB_ADAM_V: return &m->adam_v;
        case CB_ENCODED: return &a.encoded;       case CB_LN1: return &a.ln1;
        case CB_LN1_MEAN: return &a.ln1_mean;     case CB_LN1_RSTD: return &a.ln1_rstd;
        case CB_QKV: return &a.qkv;               case CB_ATT: return &a.att;
        case CB_ATTY: return &a.atty;             case CB_RESIDUAL2: return &a.residual2;
        case CB_LN2: return &a.ln2;               case CB_LN2_MEAN: return &a.ln2_mean;
        case CB_LN2_RSTD: return &a.ln2_rstd;     case CB_FCH: return &a.fch;
        case CB_FCH_GELU: return &a.fch_gelu;     case CB_RESIDUAL3: return &a.residual3;
        case CB_LNF: return &a.lnf;               case CB_LNF_MEAN: return &a.lnf_mean;
        case CB_LNF_RSTD: return &a.lnf_rstd;     case CB_LOGITS: return &a.logits;
        case CB_LOSSES: return &a.losses;         case CB_LOGSUMEXP: return &a.logsumexp;
        case CB_DRESIDUAL: return &a.dresidual;   case CB_DBUF_C: return &a.dbuf_c;
        case CB_DBUF_3C: return &a.dbuf_3c;       case CB_DBUF_4C: return &a.dbuf_4c;
        default: return nullptr;
    }
}

// The model's weights, from a file or an initialisation (N values; gpt2_allocate pads them).
void gpt2_build(GPT2* model, const GPT2Config& cfg, std::vector<float> params) {
    model->config = cfg;
    model->layout = param_layout(cfg);
    model->params = std::move(params);
    model->p = point_into(model->params.data(), model->layout);
}

// Allocates every buffer of the table for `shape`, each a vector of exactly the row's size: zeroed,
// except the parameters, which keep their values (their padding is zero). A fresh vector each time,
// because a vector that grows in place may reserve more than it was asked for.
void gpt2_allocate(GPT2* model, const CPURunShape& shape) {
    model->table = cpu_buffer_table(shape);
    for (int b = 0; b < CB_COUNT; b++) {
        std::vector<float>* v = gpt2_buffer(model, b);
        if (!v) continue;
        size_t n = model->table[b].elements;
        if (b == CB_PARAMS && v->size() == n && v->capacity() == n) continue;  // exact already: no copy
        std::vector<float> exact(n, 0.0f);
        if (b == CB_PARAMS) std::copy(v->begin(), v->begin() + std::min(v->size(), n), exact.begin());
        v->swap(exact);
    }
    matmul_scratch_reserve(model->table[CB_MATMUL_PACK_A].elements, model->table[CB_MATMUL_PACK_B].elements);
    model->p = point_into(model->params.data(), model->layout);
    model->g = point_into(model->grads.data(), model->layout);
    model->max_B = shape.B;
    model->max_T = shape.T;
}

// One block's slice of a stacked per-layer tensor.
static inline float* layer_slice(std::vector<float>& v, int l, size_t per_layer) { return v.data() + (size_t)l * per_layer; }

// Forward pass over B x T tokens (B <= max_B, T <= max_T). With targets, fills acts.losses and
// returns the mean loss; without, computes only the logits and returns 0.
float gpt2_forward(GPT2* model, const int* inputs, const int* targets, int B, int T) {
    const GPT2Config& cfg = model->config;
    int L = cfg.num_layers, C = cfg.channels, NH = cfg.num_heads, V = cfg.vocab_size, Vp = cfg.padded_vocab_size;
    size_t BT = (size_t)B * T;
    // layer l's slices are laid out for the allocated (max_B, max_T), so a smaller forward still
    // finds every layer where the backward pass expects it
    size_t BTmax = (size_t)model->max_B * model->max_T;
    size_t att_per_layer = (size_t)model->max_B * NH * model->max_T * model->max_T;
    Activations& a = model->acts;
    const ParamTensors<float>& p = model->p;

    encoder_forward(a.encoded.data(), inputs, p[WTE], p[WPE], B, T, C);
    for (int l = 0; l < L; l++) {
        const float* residual = l == 0 ? a.encoded.data() : layer_slice(a.residual3, l - 1, BTmax * C);
        float* ln1 = layer_slice(a.ln1, l, BTmax * C);
        float* qkv = layer_slice(a.qkv, l, BTmax * 3 * C);
        float* att = layer_slice(a.att, l, att_per_layer);
        float* atty = layer_slice(a.atty, l, BTmax * C);
        float* residual2 = layer_slice(a.residual2, l, BTmax * C);
        float* ln2 = layer_slice(a.ln2, l, BTmax * C);
        float* fch = layer_slice(a.fch, l, BTmax * 4 * C);
        float* fch_gelu = layer_slice(a.fch_gelu, l, BTmax * 4 * C);
        float* residual3 = layer_slice(a.residual3, l, BTmax * C);

        layernorm_forward(ln1, layer_slice(a.ln1_mean, l, BTmax), layer_slice(a.ln1_rstd, l, BTmax), residual,
                          p[LN1W] + l * C, p[LN1B] + l * C, (int)BT, C);
        matmul_forward(qkv, ln1, p[QKVW] + (size_t)l * 3 * C * C, p[QKVB] + l * 3 * C, (int)BT, C, 3 * C);
        attention_forward(atty, att, qkv, B, T, C, NH);
        matmul_forward(residual2, atty, p[ATTPROJW] + (size_t)l * C * C, p[ATTPROJB] + l * C, (int)BT, C, C);
        residual_forward(residual2, residual2, residual, BT * C);
        layernorm_forward(ln2, layer_slice(a.ln2_mean, l, BTmax), layer_slice(a.ln2_rstd, l, BTmax), residual2,
                          p[LN2W] + l * C, p[LN2B] + l * C, (int)BT, C);
        matmul_forward(fch, ln2, p[FCW] + (size_t)l * 4 * C * C, p[FCB] + l * 4 * C, (int)BT, C, 4 * C);
        gelu_forward(fch_gelu, fch, BT * 4 * C);
        matmul_forward(residual3, fch_gelu, p[FCPROJW] + (size_t)l * C * 4 * C, p[FCPROJB] + l * C, (int)BT, 4 * C, C);
        residual_forward(residual3, residual3, residual2, BT * C);
    }
    const float* last = L > 0 ? layer_slice(a.residual3, L - 1, BTmax * C) : a.encoded.data();
    layernorm_forward(a.lnf.data(), a.lnf_mean.data(), a.lnf_rstd.data(), last, p[LNFW], p[LNFB], (int)BT, C);
    matmul_forward(a.logits.data(), a.lnf.data(), p[WTE], nullptr, (int)BT, C, Vp);  // tied LM head
    if (!targets) return 0.0f;
    crossentropy_forward(a.losses.data(), a.logsumexp.data(), a.logits.data(), targets, (int)BT, V, Vp);
    double total = 0.0;
    for (size_t i = 0; i < BT; i++) total += a.losses[i];
    return (float)(total / BT);
}

// Backward pass for the last forward (which must have had targets). Gradients are ADDED to
// model->grads, so micro-batches accumulate; `loss_scale` is d(optimised loss)/d(this micro-batch's
// summed per-token losses), 1/(B*T*accumulation_steps) for a mean over the whole step.
void gpt2_backward(GPT2* model, const int* inputs, const int* targets, int B, int T, float loss_scale) {
    const GPT2Config& cfg = model->config;
    int L = cfg.num_layers, C = cfg.channels, NH = cfg.num_heads, V = cfg.vocab_size, Vp = cfg.padded_vocab_size;
    size_t BT = (size_t)B * T;
    size_t BTmax = (size_t)model->max_B * model->max_T;
    size_t att_per_layer = (size_t)model->max_B * NH * model->max_T * model->max_T;
    Activations& a = model->acts;
    const ParamTensors<float>& p = model->p;
    const ParamTensors<float>& g = model->g;
    float* dresidual = a.dresidual.data();

    // classifier and final LayerNorm
    crossentropy_softmax_backward(a.logits.data(), a.logsumexp.data(), targets, (int)BT, V, Vp, loss_scale);
    matmul_backward(a.dbuf_c.data(), g[WTE], nullptr, a.logits.data(), a.lnf.data(), p[WTE], (int)BT, C, Vp);
    memset(dresidual, 0, BT * C * sizeof(float));
    const float* last = L > 0 ? layer_slice(a.residual3, L - 1, BTmax * C) : a.encoded.data();
    layernorm_backward(dresidual, g[LNFW], g[LNFB], a.dbuf_c.data(), last, p[LNFW], a.lnf_mean.data(),
                       a.lnf_rstd.data(), (int)BT, C);

    // blocks, top to bottom; dresidual carries d(loss)/d(block output) down the residual stream
    for (int l = L - 1; l >= 0; l--) {
        const float* residual = l == 0 ? a.encoded.data() : layer_slice(a.residual3, l - 1, BTmax * C);
        const float* ln1 = layer_slice(a.ln1, l, BTmax * C);
        const float* qkv = layer_slice(a.qkv, l, BTmax * 3 * C);
        const float* att = layer_slice(a.att, l, att_per_layer);
        const float* atty = layer_slice(a.atty, l, BTmax * C);
        const float* residual2 = layer_slice(a.residual2, l, BTmax * C);
        const float* ln2 = layer_slice(a.ln2, l, BTmax * C);
        const float* fch = layer_slice(a.fch, l, BTmax * 4 * C);
        const float* fch_gelu = layer_slice(a.fch_gelu, l, BTmax * 4 * C);
        float* dbuf_c = a.dbuf_c.data();
        float* dbuf_3c = a.dbuf_3c.data();
        float* dbuf_4c = a.dbuf_4c.data();

        // MLP: residual3 = residual2 + fcproj(gelu(fc(ln2(residual2))))
        matmul_backward(dbuf_4c, g[FCPROJW] + (size_t)l * C * 4 * C, g[FCPROJB] + l * C, dresidual, fch_gelu,
                        p[FCPROJW] + (size_t)l * C * 4 * C, (int)BT, 4 * C, C);
        gelu_backward(dbuf_4c, fch, dbuf_4c, BT * 4 * C);
        matmul_backward(dbuf_c, g[FCW] + (size_t)l * 4 * C * C, g[FCB] + l * 4 * C, dbuf_4c, ln2,
                        p[FCW] + (size_t)l * 4 * C * C, (int)BT, C, 4 * C);
        layernorm_backward(dresidual, g[LN2W] + l * C, g[LN2B] + l * C, dbuf_c, residual2, p[LN2W] + l * C,
                           layer_slice(a.ln2_mean, l, BTmax), layer_slice(a.ln2_rstd, l, BTmax), (int)BT, C);
        // attention: residual2 = residual + attproj(attention(qkv(ln1(residual))))
        matmul_backward(dbuf_c, g[ATTPROJW] + (size_t)l * C * C, g[ATTPROJB] + l * C, dresidual, atty,
                        p[ATTPROJW] + (size_t)l * C * C, (int)BT, C, C);
        attention_backward(dbuf_3c, dbuf_c, qkv, att, B, T, C, NH);
        matmul_backward(dbuf_c, g[QKVW] + (size_t)l * 3 * C * C, g[QKVB] + l * 3 * C, dbuf_3c, ln1,
                        p[QKVW] + (size_t)l * 3 * C * C, (int)BT, C, 3 * C);
        layernorm_backward(dresidual, g[LN1W] + l * C, g[LN1B] + l * C, dbuf_c, residual, p[LN1W] + l * C,
                           layer_slice(a.ln1_mean, l, BTmax), layer_slice(a.ln1_rstd, l, BTmax), (int)BT, C);
    }
    encoder_backward(g[WTE], g[WPE], dresidual, inputs, B, T, C);
}

// ==============================================================================================
// The optimizer step: global-norm clipping, then AdamW.

// The sum of squares of n gradients. Fixed-size chunks are summed in parallel and the chunk sums
// added in order, so the result does not depend on the number of threads. With several ranks each
// sums its shard and the shards' sums are added in rank order (comm_sum).
double sum_of_squares(const float* grads, size_t n) {
    const size_t chunk = 1 << 16;
    size_t chunks = (n + chunk - 1) / chunk;
    std::vector<double> partial(chunks);
    #pragma omp parallel for schedule(static)
    for (size_t c = 0; c < chunks; c++) {
        double s = 0.0;
        size_t end = std::min(n, (c + 1) * chunk);
        #pragma omp simd reduction(+ : s)
        for (size_t i = c * chunk; i < end; i++) s += (double)grads[i] * grads[i];
        partial[c] = s;
    }
    double total = 0.0;
    for (double s : partial) total += s;
    return total;
}

// sqrt(sum of squares) over all gradients of one rank.
float global_grad_norm(const float* grads, size_t n) { return (float)std::sqrt(sum_of_squares(grads, n)); }

// The clip coefficient, as torch.nn.utils.clip_grad_norm_ computes it.
float clip_coefficient(float norm, float max_norm) {
    if (max_norm <= 0.0f) return 1.0f;
    return std::min(1.0f, max_norm / (norm + 1e-6f));
}

// AdamW (Loshchilov & Hutter), with grad_scale applied to the gradients (for clipping):
//   p <- p * (1 - lr*wd)                                  decoupled decay, 2-D weights only
//   m <- b1 m + (1-b1) g;   v <- b2 v + (1-b2) g^2        moment estimates
//   p <- p - lr/(1-b1^t) * m / (sqrt(v)/sqrt(1-b2^t) + eps)   bias-corrected step
// written in the same order of operations as PyTorch's implementation, so the two agree closely.
void adamw_update(float* params, const float* grads, float* m, float* v, size_t n, float lr, float beta1,
                  float beta2, float eps, float weight_decay, int t, float grad_scale) {
    float bias_correction1 = 1.0f - powf(beta1, (float)t);
    float bias_correction2_sqrt = sqrtf(1.0f - powf(beta2, (float)t));
    float step_size = lr / bias_correction1;
    float decay = 1.0f - lr * weight_decay;
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        float grad = grads[i] * grad_scale;
        m[i] = beta1 * m[i] + (1.0f - beta1) * grad;
        v[i] = beta2 * v[i] + (1.0f - beta2) * grad * grad;
        float denom = sqrtf(v[i]) / bias_correction2_sqrt + eps;
        params[i] = params[i] * decay - step_size * m[i] / denom;
    }
}

// AdamW on the parameters [range.begin, range.end) of the flat array: all of them, or with ZeRO-1
// this rank's shard. `grads`, model->adam_m and model->adam_v hold that range only (their element 0
// is parameter range.begin). Weight decay differs per tensor, so the range is cut at tensor
// boundaries; each element's update depends on nothing but its own values, which is why updating
// the model shard by shard gives exactly the weights of updating it whole.
void gpt2_update(GPT2* model, ShardRange range, const float* grads, float lr, const TrainOptions& o, int t, float grad_scale) {
    for (const TensorPiece& piece : shard_pieces(model->layout, range)) {
        size_t at = piece.begin - range.begin, n = piece.end - piece.begin;
        float wd = param_tensor_decays(piece.tensor) ? o.weight_decay : 0.0f;
        adamw_update(model->params.data() + piece.begin, grads + at, model->adam_m.data() + at, model->adam_v.data() + at, n,
                     lr, o.beta1, o.beta2, o.adam_eps, wd, t, grad_scale);
    }
}

#ifndef LLMC_CPU_NO_MAIN
// ==============================================================================================
// The training loop

// Mean loss over `batches` micro-batches of the validation data, from its beginning.
static float evaluate(GPT2* model, DataLoader* val, int batches) {
    dataloader_reset(val);
    double total = 0.0;
    for (int i = 0; i < batches; i++) {
        dataloader_next_batch(val);
        total += gpt2_forward(model, val->inputs.data(), val->targets.data(), val->B, val->T);
    }
    return (float)(total / batches);
}

// Generates `count` tokens after <|endoftext|>, one forward pass per token over the whole prefix
// (no key/value cache: simple, and cheap enough at these sizes).
static void print_sample(GPT2* model, const TrainOptions& o, const SampleDecoder& decoder, uint64_t* rng) {
    const GPT2Config& cfg = model->config;
    int T = model->max_T;
    std::vector<int> tokens = {50256 < cfg.vocab_size ? 50256 : 0};
    for (int i = 0; i < o.sample_tokens; i++) {
        int len = std::min((int)tokens.size(), T);
        const int* window = tokens.data() + tokens.size() - len;
        gpt2_forward(model, window, nullptr, 1, len);
        const float* logits = model->acts.logits.data() + (size_t)(len - 1) * cfg.padded_vocab_size;
        int next = sample_token(logits, cfg.vocab_size, o.temperature, o.top_k, rng);
        tokens.push_back(next);
    }
    print_sample_text(decoder, std::vector<int>(tokens.begin() + 1, tokens.end()));
}

// ==============================================================================================
// Data parallelism and ZeRO-1 (docs/parallelism.md tells the whole story; llmc/comm.h moves bytes)
//
// `mpirun -np N ./train_gpt_cpu` runs N copies ("ranks") of this program. They start from the same
// weights; each reads its own slice of every step's batch (llmc/dataloader.h), so N ranks with
// micro-batch B see exactly the tokens one rank would see in N accumulation steps. After the
// backward pass they combine their gradients:
//   1. each rank's gradient is already scaled by 1/(tokens of the whole step, all ranks together),
//      so the step's gradient is the plain SUM over ranks: no division by N anywhere;
//   2. reduce-scatter: rank r receives that sum for its shard r of the parameters (llmc/sharding.h);
//   3. ZeRO-0: all-gather the summed shards, so every rank holds the whole gradient, and every rank
//      runs AdamW on every parameter with its own full copy of m and v;
//      ZeRO-1: each rank runs AdamW on its shard only, keeping m and v for that shard only (1/N of
//      the memory), then all-gathers the updated parameters.
// ZeRO-0's steps 2 and 3 are an all-reduce written out; ZeRO-1 gathers parameters where ZeRO-0
// gathers gradients, so it moves exactly the same bytes. Both sum the gradients with the same
// reduce-scatter and update each parameter with the same arithmetic, so they give bit-identical
// weights. Every rank ends each step with bit-identical parameters (they are copies of one
// result), which is what keeps N replicas from drifting apart.
// Here the exchange runs after the whole backward pass; the GPU trainer overlaps it with the
// backward pass, sending a layer's gradients while the layers below it are still computing.

struct DataParallel {
    Comm comm;
    int zero_stage = 0;
    ShardLayout shards;             // the flat parameter array, padded and cut into world_size equal shards
    ShardRange shard;               // this rank's shard, padding included: what the collectives move
    ShardRange updated;             // the parameters this rank's AdamW updates and keeps m, v for:
                                    // all of them (ZeRO-0) or those of its shard (ZeRO-1)
    std::vector<float> grad_shard;  // the summed gradient of this rank's shard
};

// Cuts the flat parameter array into this rank's shard and allocates every buffer of the run from the
// size table (llmc/cpu_buffers.h): params and grads padded to the shard layout (the collectives move
// equal shards; no tensor uses the padding), AdamW's moments for the parameters this rank updates
// (all of them, or with ZeRO-1 its shard: this is where 1/N of the memory goes), the gradient shard.
static void data_parallel_setup(DataParallel* dp, GPT2* model, int zero_stage, int B, int T) {
    CPURunShape shape;
    shape.cfg = model->config;
    shape.B = B, shape.T = T;
    shape.world_size = dp->comm.world_size, shape.rank = dp->comm.rank;
    shape.zero_stage = zero_stage;
    dp->zero_stage = zero_stage;
    dp->shards = shard_layout(model->layout.total, dp->comm.world_size);
    dp->shard = shard_range(dp->shards, dp->comm.rank);
    dp->updated = cpu_updated_range(shape);
    gpt2_allocate(model, shape);
    std::vector<float>(model->table[CB_GRAD_SHARD].elements, 0.0f).swap(dp->grad_shard);
}

// What this rank really holds for each row of its table: the capacity of the vector the row sized,
// that is what the allocator was asked for, whatever the table's arithmetic says. The trainer
// reports it (--print-allocations: row by row, on every rank) and test/test_estimate.py compares it
// with --estimate, to the byte.
static std::vector<size_t> held_bytes(GPT2* model, const DataParallel& dp) {
    std::vector<size_t> held(CB_COUNT, 0);
    for (int b = 0; b < CB_COUNT; b++)
        if (std::vector<float>* v = gpt2_buffer(model, b)) held[b] = v->capacity() * sizeof(float);
    held[CB_GRAD_SHARD] = dp.grad_shard.capacity() * sizeof(float);
    held[CB_MATMUL_PACK_A] = matmul_scratch.a_pack.capacity() * sizeof(vec16);
    held[CB_MATMUL_PACK_B] = matmul_scratch.b_pack.capacity() * sizeof(vec16);
    return held;
}

// "memory: rank 0 holds 1.23 GiB (N bytes):" then, indented on a second line so that both fit 100
// columns, "params ..., grads ..., ..." (by kind, from held_bytes).
static std::string held_summary(GPT2* model, const DataParallel& dp) {
    std::vector<size_t> held = held_bytes(model, dp);
    size_t by_kind[MEM_KINDS] = {}, total = 0;
    for (int b = 0; b < CB_COUNT; b++) by_kind[model->table[b].kind] += held[b], total += held[b];
    std::string out = strprintf("rank %d holds %s (%zu bytes):\n       ", dp.comm.rank, format_bytes((double)total).c_str(), total);
    for (int k = 0; k < MEM_KINDS; k++)
        if (by_kind[k]) out += strprintf(" %s %s,", memory_kind_name(k), format_bytes((double)by_kind[k]).c_str());
    out.back() = '\n';
    return out;
}

// Every row, one line each, printed at once so that ranks' reports do not interleave.
static void print_allocations(GPT2* model, const DataParallel& dp) {
    std::vector<size_t> held = held_bytes(model, dp);
    std::string out;
    size_t total = 0;
    for (int b = 0; b < CB_COUNT; b++) {
        out += strprintf("allocation: rank %d %s %zu\n", dp.comm.rank, model->table[b].name, held[b]);
        total += held[b];
    }
    out += strprintf("allocation: rank %d total %zu\n", dp.comm.rank, total);
    fputs(out.c_str(), stdout);
    fflush(stdout);
}

// Sums the ranks' gradients into this rank's shard and returns the global gradient norm (the norm
// of the summed gradient, as one rank would compute it). With `gather_all`, every rank then also
// holds the whole summed gradient in model->grads (ZeRO-0; or to dump it).
static float reduce_gradients(GPT2* model, DataParallel* dp, bool gather_all) {
    comm_reduce_scatter_sum(&dp->comm, model->grads.data(), dp->grad_shard.data(), dp->shards.shard_size,
                            "reduce-scatter of the gradients");
    double squares = sum_of_squares(dp->grad_shard.data(), dp->grad_shard.size());
    float norm = (float)std::sqrt(comm_sum(&dp->comm, squares, "sum of the gradient norms"));
    if (gather_all) {
        memcpy(model->grads.data() + dp->shard.begin, dp->grad_shard.data(), dp->shard.size() * sizeof(float));
        comm_all_gather(&dp->comm, model->grads.data(), dp->shard.size() * sizeof(float), "all-gather of the gradients");
    }
    return norm;
}

static void optimizer_step(GPT2* model, DataParallel* dp, float lr, const TrainOptions& o, int t, float grad_scale) {
    if (dp->zero_stage == 0) {
        gpt2_update(model, dp->updated, model->grads.data(), lr, o, t, grad_scale);
        return;
    }
    if (dp->updated.size() > 0) {
        gpt2_update(model, dp->updated, dp->grad_shard.data() + (dp->updated.begin - dp->shard.begin), lr, o, t, grad_scale);
    }
    comm_all_gather(&dp->comm, model->params.data(), dp->shard.size() * sizeof(float), "all-gather of the parameters");
}

// A checkpoint of N ranks: rank 0 makes the directory "<ckpt>.tmp" and writes model.bin; the
// optimizer state goes to state.bin (ZeRO-0: rank 0 holds all of it) or to one state_rank<r>.bin per
// rank (ZeRO-1: each its shard); when every rank has written (a barrier), rank 0 renames the
// directory into place. A crash at any point leaves either no new checkpoint or a complete one.
static void save_checkpoint(GPT2* model, DataParallel* dp, const TrainOptions& o, const RunPlan& plan, int step,
                            const DataLoader& train, uint64_t sampler_rng) {
    bool leader = dp->comm.rank == 0;
    auto barrier = [&](const char* what) { comm_barrier(&dp->comm, what); };
    std::string tmp = open_checkpoint_together(o.out_dir, step, dp->comm.rank, barrier);
    if (leader) write_model_file(tmp + "/model.bin", model->config, model->params.data(), false);
    if (leader || dp->zero_stage == 1) {
        TrainState s;
        s.header = train_state_header(step, model->layout.total, dp->updated, dp->comm.rank, dp->comm.world_size,
                                      dp->zero_stage, plan, sampler_rng, train.pos);
        s.m = model->adam_m;
        s.v = model->adam_v;
        write_train_state(tmp + "/" + state_file_name(dp->zero_stage, dp->comm.rank), s);
    }
    publish_checkpoint_together(o.out_dir, step, dp->comm.rank, barrier);
}

int main(int argc, char** argv) {
    TrainOptions o;
    parse_command_line(argc, argv, Trainer::CPU, &o);
    validate_options(o);
    if (o.threads > 0) omp_set_num_threads(o.threads);
    if (o.estimate) {  // arithmetic only: no MPI, no weights, no data (llmc/estimate.h)
        Comm launched;
        comm_from_environment(&launched);  // under mpirun every copy would print it: rank 0 does
        if (launched.rank == 0) print_estimate(estimate_setup(o, Trainer::CPU, 4, false, false));
        return 0;
    }
    DataParallel dp;
    comm_init(&dp.comm, o.comm_timeout);
    comm_require_mpi(&dp.comm, "the CPU trainer's exchange of gradients");  // before any work, not at the first collective
    const Comm& comm = dp.comm;
    bool leader = comm.rank == 0;  // rank 0 alone prints, evaluates, samples and writes the model

    // ---- the model: from a checkpoint, a model file, or a descriptor; then rank 0's copy for all,
    // so every rank starts from bit-identical weights whatever its own filesystem holds
    std::string resume_dir = resolve_resume_dir(o);
    GPT2Config cfg;
    std::vector<float> params;
    std::string model_source = load_initial_model(o, resume_dir, &cfg, &params);
    GPT2 model;
    gpt2_build(&model, cfg, std::move(params));

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

    // ---- every buffer, from the size table (what --estimate prints); then rank 0's weights for all
    data_parallel_setup(&dp, &model, o.zero_stage, B, T);
    comm_broadcast(&dp.comm, model.params.data(), model.layout.total * sizeof(float), 0, "broadcast of the initial weights");

    uint64_t sampler_rng = o.seed ^ 0x5DEECE66Dull;
    int first_step = 0;
    TrainStateHeader resumed;
    if (!resume_dir.empty()) {
        // each rank reads the optimizer state of the parameters it updates, from whichever files hold it
        resumed = read_optimizer_state(resume_dir, model.layout.total, dp.updated, model.adam_m.data(), model.adam_v.data(), nullptr);
        check_resume_state(resumed, resume_dir, model.layout.total, plan, true);
        if (resumed.has_master_weights) {
            // a GPU checkpoint's exact weights are its fp32 master copy (model.bin holds them rounded to
            // bf16); every rank needs all of them before its first forward pass
            std::vector<float> m_unused(model.layout.total), v_unused(model.layout.total);
            read_optimizer_state(resume_dir, model.layout.total, ShardRange{0, model.layout.total}, m_unused.data(),
                                 v_unused.data(), model.params.data());
        }
        first_step = (int)resumed.step;
        sampler_rng = resumed.sampler_rng;
        if (!o.eval_only) dataloader_seek(&train, resumed.train_loader);
    }
    if (o.eval_only) plan.steps = first_step;  // evaluating is a run of zero steps

    if (leader) {
        printf("model: %s (%s), %zu parameters\n", model_source.c_str(), describe_config(cfg).c_str(), model.layout.total);
        printf("batch: B=%d T=%d, %d rank%s, %d accumulation step%s -> %lld tokens per step; %d steps; %d threads per rank\n",
               B, T, comm.world_size, comm.world_size == 1 ? "" : "s", plan.accumulation_steps,
               plan.accumulation_steps == 1 ? "" : "s", (long long)plan.total_batch_tokens, plan.steps, omp_get_max_threads());
        if (comm.world_size > 1) {
            printf("ranks: %d (%s, %d on this node), ZeRO-%d: each rank updates %zu of %zu parameters%s\n", comm.world_size,
                   comm.launcher.c_str(), comm.local_size, dp.zero_stage, dp.updated.size(), model.layout.total,
                   dp.zero_stage == 1 ? strprintf(" (shards of %zu, padded total %zu)", dp.shards.shard_size, dp.shards.padded_total).c_str() : "");
        }
        if (!o.eval_only) printf("data: %zu training shard%s (%lld tokens)", train.files.size(), train.files.size() == 1 ? "" : "s",
               (long long)train.tokens_per_epoch);
        if (have_val) printf("%s%zu validation shard%s", o.eval_only ? "data: " : ", ", val.files.size(), val.files.size() == 1 ? "" : "s");
        printf("\n");
        printf("memory: %s", held_summary(&model, dp).c_str());
        if (verbosity >= 2) print_buffer_table(model.table, CPU_ALLOCATION_GRANULE);  // --verbose: every buffer
        if (first_step > 0) printf("resumed from %s at step %d\n", resume_dir.c_str(), first_step);
        if (first_step > 0 && (resumed.world_size != comm.world_size || resumed.zero_stage != dp.zero_stage)) {
            printf("resharded: the checkpoint was written by %d rank%s with ZeRO-%d, this run has %d with ZeRO-%d\n",
                   resumed.world_size, resumed.world_size == 1 ? "" : "s", resumed.zero_stage, comm.world_size, dp.zero_stage);
        }
    }

    SampleDecoder decoder;
    if (leader) sample_decoder_init(&decoder, o, cfg);
    HellaSwagSet hellaswag = hellaswag_open(o, cfg, T, leader);
    MetricsLog mlog;
    metrics_open(&mlog, o, leader, "cpu", cfg, B, T, comm.world_size, plan.accumulation_steps, plan.total_batch_tokens,
                 plan.steps, first_step, model_source);
    auto run_hellaswag = [&](int step) {  // every rank scores its share of the examples; rank 0 reports the sum
        HellaSwagResult r = hellaswag_evaluate(hellaswag, B, T, false, comm.rank, comm.world_size,
            [&](const int* in, const int* tg, int rows, int Tp) { gpt2_forward(&model, in, tg, rows, Tp); return (const float*)model.acts.losses.data(); });
        for (int64_t* count : {&r.examples, &r.correct, &r.correct_sum}) *count = (int64_t)comm_sum(&dp.comm, (double)*count, "sum of the hellaswag counts");
        if (leader) report_hellaswag(&mlog, step, r);
    };
    bool dumping = !o.dump_state.empty();
    DumpState dump;
    for (int step = first_step; step < plan.steps; step++) {
        bool last_step = step == plan.steps - 1;
        comm_inject_fault(&comm, step + 1);
        if (have_val && step % o.val_every == 0) report_val_loss(&mlog, step, evaluate(&model, &val, o.val_batches));
        if (hellaswag_due(o, hellaswag, step)) run_hellaswag(step);
        if (leader && is_sample_step(o, step)) print_sample(&model, o, decoder, &sampler_rng);

        auto start = std::chrono::steady_clock::now();
        std::fill(model.grads.begin(), model.grads.end(), 0.0f);
        double step_loss = 0.0;  // this rank's mean loss over its micro-batches
        for (int micro = 0; micro < plan.accumulation_steps; micro++) {
            dataloader_next_batch(&train);
            float loss = gpt2_forward(&model, train.inputs.data(), train.targets.data(), B, T);
            if (dumping && step == first_step && micro == 0) {
                size_t V = cfg.vocab_size, Vp = cfg.padded_vocab_size;
                dump.logits.resize((size_t)B * T * V);
                for (size_t n = 0; n < (size_t)B * T; n++)
                    memcpy(&dump.logits[n * V], &model.acts.logits[n * Vp], V * sizeof(float));
                dump.loss = loss;
            }
            // the optimised loss is the mean over all tokens of the step, all ranks together:
            // d/d(one token's loss) = 1/total, and the ranks' gradients simply add up
            gpt2_backward(&model, train.inputs.data(), train.targets.data(), B, T, 1.0f / (float)plan.total_batch_tokens);
            step_loss += loss / plan.accumulation_steps;
            if (leader) print_micro_step(step + 1, micro, plan.accumulation_steps, loss, seconds_since(start));
        }
        // every rank saw as many tokens, so the step's mean loss is the mean of the ranks' means
        step_loss = comm_sum(&dp.comm, step_loss, "sum of the losses") / comm.world_size;
        if (!std::isfinite(step_loss)) {
            fail("the loss became %f at step %d: training diverged. Lower --lr, raise --warmup-steps, or check --grad-clip",
                 step_loss, step + 1);
        }
        bool dump_grads = dumping && step == first_step;
        float norm = reduce_gradients(&model, &dp, dp.zero_stage == 0 || dump_grads);
        if (dump_grads) dump.grads.assign(model.grads.begin(), model.grads.begin() + model.layout.total);
        float lr = learning_rate(plan.schedule, step);
        optimizer_step(&model, &dp, lr, o, step + 1, clip_coefficient(norm, o.grad_clip));
        double seconds = seconds_since(start);
        if (dumping) dump.losses.push_back((float)step_loss);
        if (leader) {
            print_step_line(step + 1, plan.steps, step_loss, lr, norm, seconds, plan.total_batch_tokens, -1,
                            seconds * (plan.steps - step - 1));
            metrics_step(&mlog, step + 1, step_loss, lr, norm, seconds, -1, peak_rss_bytes());
        }

        if (o.checkpoint_every > 0 && ((step + 1) % o.checkpoint_every == 0 || last_step)) {
            save_checkpoint(&model, &dp, o, plan, step + 1, train, sampler_rng);
        }
    }
    if (have_val) report_val_loss(&mlog, plan.steps, evaluate(&model, &val, o.val_batches));
    if (!hellaswag.examples.empty()) run_hellaswag(plan.steps);
    if (leader && o.sample_every > 0) print_sample(&model, o, decoder, &sampler_rng);

    if (o.print_allocations) print_allocations(&model, dp);  // after the run: nothing grew while it trained

    if (dumping && leader) {
        dump.params.assign(model.params.begin(), model.params.begin() + model.layout.total);
        write_dump_state(o.dump_state, dump, cfg, B, T, "cpu");
        printf("dumped state to %s\n", o.dump_state.c_str());
    }
    if (leader) print_run_summary(mlog);
    metrics_close(&mlog);
    comm_finalize(&dp.comm);
    return 0;
}
#endif  // LLMC_CPU_NO_MAIN
