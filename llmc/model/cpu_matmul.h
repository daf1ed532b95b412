// cpu_matmul.h — the CPU trainer's matmul, where ~90% of a step's time goes: a blocked SGEMM in
// plain C++ and OpenMP.
//
// One routine computes C[M x N] (+)= A[M x K] * B[K x N] for the three products training needs:
//   forward          out  = inp  * W^T    (BT x OC) = (BT x IC)(IC x OC)
//   backward, data   dinp = dout * W      (BT x IC) = (BT x OC)(OC x IC)
//   backward, weight dW  += dout^T * inp  (OC x IC) = (OC x BT)(BT x IC)
// A and B are addressed through (row stride, column stride), so a transpose is just a swap of
// strides. The speed comes from three ideas, the same ones every BLAS uses:
//   1. a register tile: an MR x NR block of C is accumulated in vector registers (6 rows x 64
//      columns = 24 of the 32 AVX-512 registers) while k runs, so each loaded value feeds MR or NR FMAs;
//   2. packing: the slices of A and B the tile loop needs are first copied into contiguous
//      "panels" (MR rows or NR columns wide, k-major), so the inner loop reads memory in order
//      whatever the original strides were, and transposes cost one copy instead of cache misses;
//   3. blocking: K is processed KC = 384 at a time so the panels being reused stay in cache.
// Each C tile belongs to one thread and k runs in a fixed order: results do not depend on the
// number of threads.
//
// The blocking constants (MR, NR, KC, NC, MC) are in llmc/model/cpu_matmul_blocking.h, which the CPU
// trainer's size table reads too, to reserve the packed panels up front. The layers
// (llmc/model/cpu_layers.h) run every linear layer on matmul(), and the attention's register tiles
// use its vec16.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>
#include "llmc/model/cpu_matmul_blocking.h"  // MATMUL_MR, _NR, _KC, _NC, _MC and the panels' sizes

namespace cpu {

// 16 floats: one AVX-512 register (the compiler splits it into two on AVX2 machines).
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16_unaligned __attribute__((vector_size(64), aligned(4)));

// C[m_valid x n_valid] (+)= Ap (kc x MR panel)^T * Bp (kc x NR panel)
inline void matmul_micro_kernel(int kc, const float* __restrict Ap, const float* __restrict Bp, float* C,
                                       size_t ldc, int m_valid, int n_valid, bool accumulate) {
    constexpr int MR = MATMUL_MR, NR = MATMUL_NR, NV = NR / 16;  // NV vector registers per row of the tile
    vec16 acc[MR][NV] = {};
    for (int k = 0; k < kc; k++) {
        vec16 b[NV];
        #pragma GCC unroll 4
        for (int v = 0; v < NV; v++) b[v] = *(const vec16*)(Bp + k * NR + 16 * v);
        #pragma GCC unroll 8
        for (int i = 0; i < MR; i++) {
            float a = Ap[k * MR + i];  // broadcast one element of A against NR of B
            #pragma GCC unroll 4
            for (int v = 0; v < NV; v++) acc[i][v] += a * b[v];
        }
    }
    float tile[MR][NR];
    #pragma GCC unroll 8
    for (int i = 0; i < MR; i++) {
        #pragma GCC unroll 4
        for (int v = 0; v < NV; v++) *(vec16_unaligned*)&tile[i][16 * v] = acc[i][v];
    }
    for (int i = 0; i < m_valid; i++) {
        float* c = C + i * ldc;
        if (accumulate) for (int j = 0; j < n_valid; j++) c[j] += tile[i][j];
        else for (int j = 0; j < n_valid; j++) c[j] = tile[i][j];
    }
}

// The packed panels, kept between calls (the sizes repeat every step). The trainer sizes them once,
// up front, from its table (llmc/memory/cpu_buffers.h: the largest M it will see); a call that needs more
// (a test's shapes) grows them. In units of 16 floats, which the allocator aligns to 64 bytes for
// the micro-kernel's vector loads (a struct, not vec16 itself: nvcc, compiling this file into the
// kernel lab, refuses a std::vector of vector types).
struct alignas(64) Floats16 {
    float f[16];
};
struct MatmulScratch {
    std::vector<Floats16> a_pack, b_pack;
};
inline MatmulScratch matmul_scratch;

inline void matmul_scratch_reserve(size_t a_floats, size_t b_floats) {
    // a fresh vector of exactly the size asked: growing one in place may reserve more than that
    if (matmul_scratch.a_pack.size() * 16 < a_floats) std::vector<Floats16>((a_floats + 15) / 16).swap(matmul_scratch.a_pack);
    if (matmul_scratch.b_pack.size() * 16 < b_floats) std::vector<Floats16>((b_floats + 15) / 16).swap(matmul_scratch.b_pack);
}

// A(i,k) = A[i*a_rs + k*a_cs]; B(k,j) = B[k*b_rs + j*b_cs]; C row-major with leading dimension ldc.
inline void matmul(int M, int N, int K, const float* A, size_t a_rs, size_t a_cs, const float* B, size_t b_rs,
            size_t b_cs, float* C, size_t ldc, bool accumulate) {
    constexpr int MR = MATMUL_MR, NR = MATMUL_NR, KC = MATMUL_KC, NC = MATMUL_NC, MC = MATMUL_MC;
    int m_panels = (M + MR - 1) / MR;
    matmul_scratch_reserve(matmul_pack_a_floats(M), matmul_pack_b_floats(N));  // no-op once the trainer sized them
    float* Ap = (float*)matmul_scratch.a_pack.data();
    float* Bp = (float*)matmul_scratch.b_pack.data();
    if (K == 0 && !accumulate) {
        for (int i = 0; i < M; i++) memset(C + (size_t)i * ldc, 0, (size_t)N * sizeof(float));
        return;
    }
    // One parallel region for the whole product; per block of K, the threads pack the panels, meet
    // at one barrier, compute their tiles, and meet again before the panels are overwritten.
    #pragma omp parallel
    for (int jc = 0; jc < N; jc += NC) {
        int nc = std::min(NC, N - jc);
        int n_panels = (nc + NR - 1) / NR;
        for (int pc = 0; pc < K; pc += KC) {
            int kc = std::min(KC, K - pc);
            bool add = accumulate || pc > 0;
            #pragma omp for schedule(static) nowait
            for (int jp = 0; jp < n_panels; jp++) {  // pack B[pc:pc+kc, jc:jc+nc] in NR-wide panels
                float* dst = Bp + (size_t)jp * NR * kc;
                // A column of B that is a row in memory (a weight read transposed: b_rs = 1) is read
                // 8 columns at a time: columns b_cs apart often fall in one L1 set (at 3072 floats
                // apart, all of them), and 8 fit its 8 ways where a panel's 64 would evict each other.
                int group = b_rs == 1 ? 8 : NR;
                for (int j0 = 0; j0 < NR; j0 += group) {
                    for (int k = 0; k < kc; k++) {
                        const float* src = B + (size_t)(pc + k) * b_rs;
                        for (int j = j0; j < j0 + group; j++) {
                            int col = jc + jp * NR + j;
                            dst[k * NR + j] = col < N ? src[(size_t)col * b_cs] : 0.0f;
                        }
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
            }  // (barrier: every panel is packed)
            for (int ic = 0; ic < m_panels; ic += MC / MR) {  // MC rows of A at a time: they stay in L2
                int ic_end = std::min(m_panels, ic + MC / MR);
                #pragma omp for schedule(static) collapse(2) nowait
                for (int jp = 0; jp < n_panels; jp++) {
                    for (int ip = ic; ip < ic_end; ip++) {
                        int row = ip * MR, col = jc + jp * NR;
                        matmul_micro_kernel(kc, Ap + (size_t)ip * MR * kc, Bp + (size_t)jp * NR * kc,
                                            C + (size_t)row * ldc + col, ldc, std::min(MR, M - row),
                                            std::min(NR, N - col), add);
                    }
                }
            }
            #pragma omp barrier  // every tile is done with these panels
        }
    }
}

}  // namespace cpu
