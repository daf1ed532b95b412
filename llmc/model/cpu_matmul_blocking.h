// cpu_matmul_blocking.h — the CPU matmul's blocking (llmc/model/cpu_matmul.h explains it), and the
// size of the packed panels it decides.
//
// Two files read these numbers: the matmul, which tiles and packs by them, and the CPU trainer's
// size table (llmc/memory/cpu_buffers.h), which reserves the panels up front. The table is also
// compiled into the GPU trainer (llmc/memory/estimate.h, for --estimate) by nvcc, which should not
// have to parse the SGEMM and its `#pragma GCC unroll`s; so the numbers sit in this file of their
// own, plain C++, as the GPU kernels' are in llmc/kernels/scratch_sizes.h.
#pragma once

#include <algorithm>
#include <cstddef>

// An MR x NR register tile (NR a multiple of 16: whole vectors), K taken KC at a time, N at most NC
// at a time (NC a multiple of NR), and NB columns of packed B swept against each panel of A (NB x KC
// floats, 576 KiB, stay in L2).
constexpr int MATMUL_MR = 8, MATMUL_NR = 48, MATMUL_KC = 384, MATMUL_NC = 4608, MATMUL_NB = 384;

// Floats in the packed panels of A for a matmul with M rows: ceil(M / MR) panels of MR x KC.
inline size_t matmul_pack_a_floats(size_t M) { return (M + MATMUL_MR - 1) / MATMUL_MR * MATMUL_MR * MATMUL_KC; }
// ... and of B for a matmul with N columns: at most NC columns (NC / NR panels of NR x KC) at a time.
inline size_t matmul_pack_b_floats(size_t N) {
    size_t columns = std::min((size_t)MATMUL_NC, (N + MATMUL_NR - 1) / MATMUL_NR * MATMUL_NR);
    return columns * MATMUL_KC;
}
