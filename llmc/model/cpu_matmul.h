// cpu_matmul.h — the CPU trainer's matmul, where ~90% of a step's time goes: a blocked SGEMM in
// plain C++ and OpenMP.
//
// One routine computes C[M x N] (+)= A[M x K] * B[K x N] for the three products training needs:
//   forward          out  = inp  * W^T    (BT x OC) = (BT x IC)(IC x OC)
//   backward, data   dinp = dout * W      (BT x IC) = (BT x OC)(OC x IC)
//   backward, weight dW  += dout^T * inp  (OC x IC) = (OC x BT)(BT x IC)
// A and B are addressed through (row stride, column stride), so a transpose is just a swap of
// strides. The speed comes from the ideas every BLAS uses. Each is measured below on one core of an
// Intel Xeon (AVX-512, two FMA units: 226-240 GFLOP/s of FMAs on registers), single-threaded, in
// CPU seconds (dev/cpu/matmul_bench.cpp; the machine was shared, so the spread is a few points):
//   1. a register tile: an MR x NR = 8 x 48 block of C is accumulated in 24 of the 32 vector
//      registers while k runs; per k, 3 vector loads of B and 8 broadcasts of A feed 24 FMAs. With
//      both panels in L1 the tile runs at 88-90% of the FMA peak: the ceiling of everything below.
//   2. the tile's shape decides what must stay in which cache. Per k the kernel reads NR floats of
//      B but only MR of A, so A's panel (MR x KC: 12 KiB) is the one kept in L1 and B's panels
//      stream from L2, 192 bytes per 12 cycles. With B streaming from L2: 8 x 48 and 12 x 32 keep
//      88%; 6 x 64 (this file's tile before, 24 registers too) drops to 75% and 4 x 96 to 42%: the
//      wider the B row, the more bytes per FMA come from L2. 8 x 48 also divides every d12
//      shape (B*T = 256 or 2048, the widths 768, 2304, 3072, 50304), so no tile is cut by an edge;
//   3. packing: the slices of A and B the tiles need are first copied into contiguous panels (MR
//      rows or NR columns wide, k-major), so the kernel reads memory in order whatever the strides;
//      an operand read across its rows (the weight in the forward, the activation as A) is
//      transposed 8 x 8 in registers on the way. ~0.3 ns a float, the memory's pace: ~2% of a
//      product at M = 2048 rows, ~14% at M = 256 (each float of B packed feeds 2M FLOPs);
//   4. blocking: K is taken KC = 384 at a time (A's panel fits L1, and C is read and written once
//      per 384 FMAs of each entry), and NB = 384 columns of B (576 KiB: in L2 on every CPU seen,
//      1-2 MiB), packed just before, are swept against every panel of A before the next NB; NC =
//      4608 columns at most per pass (the size of the scratch);
//   5. prefetching: each kernel fetches its tile of C before its k loop (rows ldc apart would all
//      miss at the end, with no work left to hide them) and the next panel of A during it.
//   6. orientation: a C only 64 columns wide (the main job's model, C = 64: a third of its FLOPs in
//      such products) fills two tiles of 48, a third of them padding; its transpose C^T = B^T A^T
//      has 64 rows, eight tiles of 8, none wasted. matmul() computes whichever wastes less, writing
//      C^T's tiles transposed (8 x 8 at a time). Measured on the main job's products (M = 512,
//      dev/cpu/matmul_bench.cpp --rows 512 --channels 64, one thread): the classifier's weight
//      gradient 26 -> 36% of the FMA peak, its data gradient 35 -> 45%, the layers' 64-wide products
//      41-45 -> 47-60%; a training step of the main job 92 -> 80 ms (2 threads).
// On the 30 d12 products (M = 256 and 2048 rows; one run, the machine shared with ~30 busy jobs):
// 67% of the FMA peak FLOP-weighted, 65-76% at M = 2048, 52-77% at M = 256, where the products
// with N >= 2304 are the lowest (packing, 3. above). The previous tile, 6 x 64 with its 96 KiB
// panel of B in L1's place: 56% (40-63%) in the same run.
// Each entry of C sums its K terms in the same order as with the previous tile (k ascending within
// a block of KC, the blocks added to C in order): the results are the same bits.
// Threads: each owns one block of C, all its tiles: a range of columns when C is wide enough (then
// it packs and reads only its own panels of B, which stay in its own core's L2; at M = 256 two
// threads take half the columns each), else a range of rows. k runs in a fixed order, so results
// do not depend on the number of threads; the threads meet twice per block of K (panels packed;
// panels done with).
//
// The blocking constants (MR, NR, KC, NC, NB) are in llmc/model/cpu_matmul_blocking.h, which the
// CPU trainer's size table reads too, to reserve the packed panels up front. The layers
// (llmc/model/cpu_layers.h) run every linear layer on matmul(), and the attention's register tiles
// use its vec16.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstring>
#include <vector>
#ifdef _OPENMP
#include <omp.h>
#endif
#include "llmc/model/cpu_matmul_blocking.h"  // MATMUL_MR, _NR, _KC, _NC, _MC and the panels' sizes

namespace cpu {

// 16 floats: one AVX-512 register (the compiler splits it into two on AVX2 machines).
typedef float vec16 __attribute__((vector_size(64)));
typedef float vec16_unaligned __attribute__((vector_size(64), aligned(4)));

// 8 floats: half an AVX-512 register, the unit of the packing's transposes.
typedef float vec8 __attribute__((vector_size(32)));
typedef float vec8_unaligned __attribute__((vector_size(32), aligned(4)));

// out[k][j] = in[j][k] for an 8 x 8 block: rows of `in` ld floats apart, rows of `out` W floats apart.
// Three rounds of shuffles (pairs of floats, of pairs, of halves): 24 shuffles for 64 floats, where
// 64 single-float loads and stores would take 64 cycles or more.
template <int W>
inline void transpose8x8(float* out, const float* in, size_t ld) {
    vec8 r[8], t[8], u[8];
    for (int j = 0; j < 8; j++) r[j] = *(const vec8_unaligned*)(in + j * ld);
    for (int j = 0; j < 8; j += 2) {
        t[j] = __builtin_shufflevector(r[j], r[j + 1], 0, 8, 1, 9, 4, 12, 5, 13);
        t[j + 1] = __builtin_shufflevector(r[j], r[j + 1], 2, 10, 3, 11, 6, 14, 7, 15);
    }
    for (int j = 0; j < 8; j += 4) {
        for (int h = 0; h < 2; h++) {
            u[j + 2 * h] = __builtin_shufflevector(t[j + h], t[j + h + 2], 0, 1, 8, 9, 4, 5, 12, 13);
            u[j + 2 * h + 1] = __builtin_shufflevector(t[j + h], t[j + h + 2], 2, 3, 10, 11, 6, 7, 14, 15);
        }
    }
    for (int k = 0; k < 4; k++) {
        *(vec8_unaligned*)(out + k * W) = __builtin_shufflevector(u[k], u[k + 4], 0, 1, 2, 3, 8, 9, 10, 11);
        *(vec8_unaligned*)(out + (k + 4) * W) = __builtin_shufflevector(u[k], u[k + 4], 4, 5, 6, 7, 12, 13, 14, 15);
    }
}

// C[m_valid x n_valid] (+)= Ap (kc x MR panel)^T * Bp (kc x NR panel); C(i, j) at C[i * ldc + j], or
// with c_transposed at C[j * ldc + i].
inline void matmul_micro_kernel(int kc, const float* __restrict Ap, const float* __restrict Bp, float* C,
                                size_t ldc, bool c_transposed, int m_valid, int n_valid, bool accumulate,
                                const float* A_next) {
    constexpr int MR = MATMUL_MR, NR = MATMUL_NR, NV = NR / 16;  // NV vector registers per row of the tile
    // Fetch the tile of C now: it is needed only after the k loop, and MR rows far apart in memory
    // would otherwise each miss the cache then, with no other work left to hide the wait behind.
    if (!c_transposed) {
        for (int i = 0; i < std::min(MR, m_valid); i++)
            for (int v = 0; v < NR; v += 16) __builtin_prefetch(C + i * ldc + v, 1, 3);
    } else {
        for (int j = 0; j < std::min(NR, n_valid); j++) __builtin_prefetch(C + j * ldc, 1, 3);
    }
    vec16 acc[MR][NV] = {};
    #pragma GCC unroll 4
    for (int k = 0; k < kc; k++) {
        vec16 b[NV];
        __builtin_prefetch(A_next + k * MR, 0, 2);  // the next panel of A into L2, a line per 16 / MR k
        #pragma GCC unroll 8
        for (int v = 0; v < NV; v++) b[v] = *(const vec16*)(Bp + k * NR + 16 * v);
        #pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            float a = Ap[k * MR + i];  // broadcast one element of A against NR of B
            #pragma GCC unroll 8
            for (int v = 0; v < NV; v++) acc[i][v] += a * b[v];
        }
    }
    if (c_transposed) {  // C^T's rows are the tile's columns: 8 x 8 transposes, then MR floats a row
        static_assert(MR == 8 && NR % 8 == 0, "the transposed store assumes 8-row tiles");
        float tile[MR][NR], tile_t[NR][MR];
        #pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            #pragma GCC unroll 8
            for (int v = 0; v < NV; v++) *(vec16_unaligned*)&tile[i][16 * v] = acc[i][v];
        }
        for (int j = 0; j < NR; j += 8) transpose8x8<MR>(&tile_t[j][0], &tile[0][j], NR);
        for (int j = 0; j < n_valid; j++) {
            float* c = C + j * ldc;
            if (m_valid == MR) {
                vec8 t = *(const vec8_unaligned*)&tile_t[j][0];
                *(vec8_unaligned*)c = accumulate ? *(const vec8_unaligned*)c + t : t;
            } else if (accumulate) {
                for (int i = 0; i < m_valid; i++) c[i] += tile_t[j][i];
            } else {
                for (int i = 0; i < m_valid; i++) c[i] = tile_t[j][i];
            }
        }
        return;
    }
    if (m_valid == MR && n_valid == NR) {  // a whole tile: straight from the registers into C
        #pragma GCC unroll 16
        for (int i = 0; i < MR; i++) {
            #pragma GCC unroll 8
            for (int v = 0; v < NV; v++) {
                vec16_unaligned* c = (vec16_unaligned*)(C + i * ldc + 16 * v);
                *c = accumulate ? *c + acc[i][v] : acc[i][v];
            }
        }
        return;
    }
    float tile[MR][NR];  // a tile on the edge of C: only its valid part is stored
    #pragma GCC unroll 16
    for (int i = 0; i < MR; i++) {
        #pragma GCC unroll 8
        for (int v = 0; v < NV; v++) *(vec16_unaligned*)&tile[i][16 * v] = acc[i][v];
    }
    for (int i = 0; i < m_valid; i++) {
        float* c = C + i * ldc;
        if (accumulate) for (int j = 0; j < n_valid; j++) c[j] += tile[i][j];
        else for (int j = 0; j < n_valid; j++) c[j] = tile[i][j];
    }
}

// Pack one W-wide panel: dst[k * W + j] = X(k0 + k, j0 + j) for k < kc, j < W, zero past `valid`
// columns, where X(k, j) = X[k * rs + j * cs]. Three cases: a row of the panel contiguous in X
// (cs = 1: copies), a column contiguous (rs = 1: 8 x 8 transposes), anything else one by one.
template <int W>
inline void matmul_pack_panel(float* __restrict dst, const float* X, size_t rs, size_t cs, int k0, int kc, int j0,
                              int valid) {
    if (valid == W && cs == 1) {
        for (int k = 0; k < kc; k++) {
            const float* src = X + (size_t)(k0 + k) * rs + j0;
            #pragma GCC unroll 4
            for (int j = 0; j < W; j++) dst[k * W + j] = src[j];
        }
        return;
    }
    if (valid == W && rs == 1 && W % 8 == 0) {
        int k8 = kc / 8 * 8;
        for (int j = 0; j < W; j += 8) {
            const float* src = X + (size_t)(j0 + j) * cs + k0;
            for (int k = 0; k < k8; k += 8) transpose8x8<W>(dst + k * W + j, src + k, cs);
            for (int k = k8; k < kc; k++)
                for (int jj = j; jj < j + 8; jj++) dst[k * W + jj] = src[(size_t)(jj - j) * cs + k];
        }
        return;
    }
    for (int k = 0; k < kc; k++)
        for (int j = 0; j < W; j++) dst[k * W + j] = j < valid ? X[(size_t)(k0 + k) * rs + (size_t)(j0 + j) * cs] : 0.0f;
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

// The share [begin, end) of n items that thread `t` of `threads` takes: contiguous, sizes differing by at most one.
inline void matmul_share(int n, int t, int threads, int* begin, int* end) {
    *begin = (int)((long)n * t / threads);
    *end = (int)((long)n * (t + 1) / threads);
}

// A(i,k) = A[i*a_rs + k*a_cs]; B(k,j) = B[k*b_rs + j*b_cs]; C(i,j) = C[i*ldc + j], or with c_transposed
// C[j*ldc + i].
inline void matmul_oriented(int M, int N, int K, const float* A, size_t a_rs, size_t a_cs, const float* B, size_t b_rs,
                            size_t b_cs, float* C, size_t ldc, bool c_transposed, bool accumulate) {
    constexpr int MR = MATMUL_MR, NR = MATMUL_NR, KC = MATMUL_KC, NC = MATMUL_NC, NB = MATMUL_NB / MATMUL_NR;
    int m_panels = (M + MR - 1) / MR;
    matmul_scratch_reserve(matmul_pack_a_floats(M), matmul_pack_b_floats(N));  // no-op once the trainer sized them
    float* Ap = (float*)matmul_scratch.a_pack.data();
    float* Bp = (float*)matmul_scratch.b_pack.data();
    if (K == 0 && !accumulate) {
        for (int i = 0; i < (c_transposed ? N : M); i++) memset(C + (size_t)i * ldc, 0, (size_t)(c_transposed ? M : N) * sizeof(float));
        return;
    }
    // One parallel region for the whole product; per block of K, the threads pack the panels, meet
    // at one barrier, compute their tiles, and meet again before the panels are overwritten.
    #pragma omp parallel
    {
#ifdef _OPENMP
        int t = omp_get_thread_num(), threads = omp_get_num_threads();
#else
        int t = 0, threads = 1;
#endif
        for (int jc = 0; jc < N; jc += NC) {
            int nc = std::min(NC, N - jc);
            int n_panels = (nc + NR - 1) / NR;
            // Each thread owns a block of C: a range of columns (then it reads only its own panels of
            // B, from its own core's L2) or, when C is too narrow to share that way, a range of rows.
            bool split_columns = n_panels >= 4 * threads;
            int jp_begin = 0, jp_end = n_panels, ip_begin = 0, ip_end = m_panels;
            if (split_columns) matmul_share(n_panels, t, threads, &jp_begin, &jp_end);
            else matmul_share(m_panels, t, threads, &ip_begin, &ip_end);
            for (int pc = 0; pc < K; pc += KC) {
                int kc = std::min(KC, K - pc);
                bool add = accumulate || pc > 0;
                auto pack_b = [&](int begin, int end) {
                    int full_end = std::min(end, (N - jc) / NR);  // panels [begin, full_end) are NR columns wide
                    if (b_cs == 1 && full_end > begin) {
                        // rows of B contiguous: each row's run across all these panels at once (a panel at a
                        // time read NR floats a row, rows far apart: runs too short for the prefetchers; the
                        // main job's weight gradient packs its 512 x 50,304 d(logits) this way)
                        for (int k = 0; k < kc; k++) {
                            const float* src = B + (size_t)(pc + k) * b_rs + jc + (size_t)begin * NR;
                            for (int jp = begin; jp < full_end; jp++)
                                memcpy(Bp + (size_t)jp * NR * kc + (size_t)k * NR, src + (size_t)(jp - begin) * NR, NR * sizeof(float));
                        }
                        begin = full_end;
                    }
                    for (int jp = begin; jp < end; jp++)
                        matmul_pack_panel<NR>(Bp + (size_t)jp * NR * kc, B, b_rs, b_cs, pc, kc, jc + jp * NR,
                                              std::min(NR, N - jc - jp * NR));
                };
                int begin, end;
                if (!split_columns) {  // every thread reads every panel of B: pack them together
                    matmul_share(n_panels, t, threads, &begin, &end);
                    pack_b(begin, end);
                }
                matmul_share(m_panels, t, threads, &begin, &end);
                for (int ip = begin; ip < end; ip++)  // A(i, k) is the panel's X(k, i): strides swapped
                    matmul_pack_panel<MR>(Ap + (size_t)ip * MR * kc, A, a_cs, a_rs, pc, kc, ip * MR, std::min(MR, M - ip * MR));
                #pragma omp barrier  // every panel is packed
                for (int jb = jp_begin; jb < jp_end; jb += NB) {  // NB panels of B: they stay in L2
                    int jb_end = std::min(jp_end, jb + NB);
                    // A thread's own panels of B are packed just before their use: they are still in
                    // L2 when the tiles read them (packed all at once, they were not, at NC x KC floats).
                    if (split_columns) pack_b(jb, jb_end);
                    for (int ip = ip_begin; ip < ip_end; ip++) {  // one panel of A: it stays in L1
                        for (int jp = jb; jp < jb_end; jp++) {
                            int row = ip * MR, col = jc + jp * NR;
                            float* tile = c_transposed ? C + (size_t)col * ldc + row : C + (size_t)row * ldc + col;
                            matmul_micro_kernel(kc, Ap + (size_t)ip * MR * kc, Bp + (size_t)jp * NR * kc, tile, ldc,
                                                c_transposed, std::min(MR, M - row), std::min(NR, N - col), add,
                                                Ap + (size_t)(ip + 1) * MR * kc);
                        }
                    }
                }
                #pragma omp barrier  // every tile is done with these panels
            }
        }
    }
}

// C = A B (or C += A B). The tiles cover C in MR x NR blocks: a C that is narrow (N = 64 cuts two tiles
// of 48, a third of them padding) is computed as its transpose, C^T = B^T A^T, when that wastes less.
// Every entry sums its K terms in the same order either way: the same bits.
inline void matmul(int M, int N, int K, const float* A, size_t a_rs, size_t a_cs, const float* B, size_t b_rs,
                   size_t b_cs, float* C, size_t ldc, bool accumulate) {
    constexpr int MR = MATMUL_MR, NR = MATMUL_NR;
    auto padded = [](long rows, long columns) { return (rows + MR - 1) / MR * MR * ((columns + NR - 1) / NR * NR); };
    if (padded(N, M) < padded(M, N)) matmul_oriented(N, M, K, B, b_cs, b_rs, A, a_cs, a_rs, C, ldc, true, accumulate);
    else matmul_oriented(M, N, K, A, a_rs, a_cs, B, b_rs, b_cs, C, ldc, false, accumulate);
}

}  // namespace cpu
