// scratch_sizes.h — the launch constants that decide how much scratch a kernel needs, and that
// scratch's size: what the GPU trainer's size table (llmc/memory/gpu_buffers.h) reserves for them.
//
// Each entry belongs to the kernel named above it, which includes this file and launches with these
// very numbers. They are here, not in the kernel's .cuh, because the size table must read them too
// and is host-only: g++ compiles it without CUDA for --estimate (llmc/memory/estimate.h, in both
// trainers), so it cannot include a kernel file. This file is plain C++ for that reason, and holds
// nothing else: a constant that sizes no buffer (threads per block, warps) stays in its kernel.
#pragma once

#include <cstddef>

// llmc/kernels/layernorm.cuh, layernorm_backward: a fixed grid of up to 256 blocks takes the rows in
// a fixed stride; each block writes one partial of 2C floats (the weight's and the bias's column
// sums); add_column_partials then sums the partials in order. A partial costs as much traffic as two
// rows (written, then read back), so a block takes at least 32 rows (partials <= 6% of the traffic).
// The grid depends on the rows alone, never on the GPU: the same sums in the same order everywhere.
constexpr int LN_BACKWARD_BLOCKS = 256, LN_BACKWARD_MIN_ROWS = 32;
inline int layernorm_backward_blocks(size_t rows) {
    size_t blocks = (rows + LN_BACKWARD_MIN_ROWS - 1) / LN_BACKWARD_MIN_ROWS;
    return (int)(blocks < LN_BACKWARD_BLOCKS ? blocks : LN_BACKWARD_BLOCKS);
}
inline size_t layernorm_backward_partials_floats(size_t rows, size_t C) {
    return (size_t)layernorm_backward_blocks(rows) * 2 * C;
}

// llmc/kernels/matmul.cuh, bias_backward: a block sums 256 rows of dout into one partial of OC floats.
constexpr int BIAS_BACKWARD_ROWS_PER_BLOCK = 256;
inline size_t bias_backward_partials_floats(size_t rows, size_t OC) {
    return (rows + BIAS_BACKWARD_ROWS_PER_BLOCK - 1) / BIAS_BACKWARD_ROWS_PER_BLOCK * OC;
}

// llmc/kernels/matmul.cuh, matmul_init: the workspace cuBLASLt's heuristic may plan with (the simple
// attention's cuBLAS calls, llmc/kernels/attention.cuh, share it on the same stream).
constexpr size_t CUBLASLT_WORKSPACE_BYTES = 32u << 20;

// llmc/kernels/global_norm.cuh: a fixed grid, so the sum's order never depends on the GPU; one
// partial per block, and the norm after them (GLOBAL_NORM_BLOCKS + 1 floats).
constexpr int GLOBAL_NORM_BLOCKS = 512;

// llmc/optim/adamw.cuh: the step's values AdamW reads from device memory (AdamWStep, 24 bytes), and
// llmc/kernels/fused_classifier.cuh's loss scale (a float at GPU_STEP_LOSS_SCALE_AT), in a buffer of
// their own (GB_STEP_VALUES).
constexpr size_t GPU_STEP_VALUES_BYTES = 32;
constexpr size_t GPU_STEP_LOSS_SCALE_AT = 24;
constexpr size_t GPU_STEP_POISON_AT = 28;  // tests only: the graphed step's injected overflow (train_gpt.cu)

// llmc/kernels/fp8.cuh (--precision fp8): per layer 12 quantized tensors (4 linear layers x input,
// weight, gradient), each with an amax history of N steps, a scale, its inverse and this step's amax
// (N + 3 floats); and two operand buffers of 1 byte an element, each as large as the largest operand
// of one matmul: the MLP's (4C x C) weights or its (B*T x 4C) input and gradient. With tensor
// parallelism the MLP's width is this rank's 4C/tp columns, but qkv's and fc's inputs are still
// (B*T x C), all of C: from tp 8 on (4C/8 < C) they are the largest.
constexpr int FP8_AMAX_HISTORY = 16;  // --fp8-amax-history's default
constexpr int FP8_TENSORS_PER_LAYER = 12;
inline size_t fp8_state_floats(int tensors, int history) { return (size_t)tensors * (history + 3); }
inline size_t fp8_operand_bytes(size_t fc_channels, size_t C, size_t BT) {
    size_t weight = fc_channels * C, activation = BT * (fc_channels > C ? fc_channels : C);
    return weight > activation ? weight : activation;
}
