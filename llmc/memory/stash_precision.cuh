// stash_precision.cuh — the GPU trainer's stash in fp8 (--stash-precision fp8): the activations kept
// for the backward pass stored in e4m3 with a per-tensor scale, 1 byte a value instead of bf16's 2.
// Read stash_precision.h first: the lesson (Gist's delayed precision reduction, Jain et al. 2018,
// section 3.3), which tensors are stashed and why the residual stream is not, are the same here.
// This file adds what a GPU and a format with 3 mantissa bits add.
//
// The format. e4m3 (llmc/kernels/fp8.cuh: the OCP FP8 spec) has 4 significant bits, so rounding to
// nearest gives q = x (1 + d) with |d| <= u = 2^-4, sixteen times bf16's 2^-8; but only 2^18 of range
// (max 448, smallest subnormal 2^-9). So each stashed tensor X gets a scale s, a power of two (scaling
// is then exact), chosen so that its largest value lands just below the top of the format:
//     s = 2^floor(log2(448 / amax)),   amax = max |X|,   q = round_e4m3(X s),   X~ = q / s.
// Then 448/2 < amax s <= 448: nothing saturates, and every value whose magnitude is within 2^-6
// of amax (above e4m3's subnormals, 2^-6 of 448 = 7) keeps the full 2^-4; smaller ones lose
// relative precision to the subnormals' fixed step, 2^-9 / s, an absolute error of at most
// 2^-10 / s <= 2^-10 amax / 224: small values' products add little to a gradient anyway.
//
// Current scaling, not fp8.cuh's delayed scaling. The matmuls' fp8 (--precision fp8) must pick a
// scale BEFORE the quantize, so it guesses from the amax of earlier steps (a history) and saturates
// when a tensor outgrows it. The stash has no hurry: the tensor is complete when it is stashed (the
// forward has read it for the last time), so one pass measures its amax and a second quantizes with
// the scale of the tensor itself. The price: one extra read of the tensor in the forward (2 bytes a
// value, memory-bound, next to the matmul that wrote it); the gain: no saturation ever, the bound
// above holds on every step, and no state between steps (the amax lives from a forward to its
// backward), so checkpoints are unchanged and a run resumes bit for bit.
//
// The error it gives the gradients. A weight gradient dW = sum_rows dout x~ is the fp32 gradient
// plus sum dout x d with |d| <= 2^-4 (the values near amax) and E[d] = 0 (round to nearest):
// relative errors of up to about 2^-4 of sum |dout x|, typically far smaller (a random walk), and
// unbiased; GELU's and the attention's backward read the stashed values through smooth functions, so
// their outputs err by the same order. test/test_stash_precision.py asserts the bound, with its margin.
//
// Memory. Each stashed row of llmc/memory/gpu_buffers.h (ln1, ln2, qkv, atty, att with the simple
// attention, fch, fch_gelu; as many as --recompute keeps) holds 1 byte a value instead of 2 (bf16
// build) or 4 (fp32 build), plus ONE layer of the same rows in the build's type (stash_work), which
// the forward computes into and the backward dequantizes into, and 7 floats a layer of amax
// (stash_amax). With S the stashed values of a layer (stash_precision.h's formula), bf16 keeps 2 L S
// bytes, fp8 L S + 2 S: at L = 12 it saves 5/12 of those rows. docs/memory.md has the numbers.
//
// How it composes. --recompute 1, 2: what recompute drops is not stashed; level 1's GELU is recomputed
// from the dequantized fch (as on the CPU). Tensor and pipeline parallelism: each rank stashes its own
// slice (gpu_stash_layer_values: its heads, MLP units and rows) with its own scales, one stash per
// micro-batch in flight (the rows are per micro-batch, as before); stash_work is live only within one
// layer's pass, so a stage's micro-batches share it. Refused for now (cli.h, one line each): ZB-H1,
// whose deferred W reads the layer's inputs in place; --moe-experts (its blocks keep their own rows);
// --precision fp8 (not checked together). The checkpoint: nothing (no state between steps).
//
// Hook points (llmc/run/step.h): train_gpt.cu's keep_for_backward calls stash_fp8_keep on a layer's
// stashed tensors once its last read (the fc projection's matmul) is done, and recall_for_backward
// calls stash_fp8_restore on them before the layer's backward reads any. The rows the trainer allocates
// and --estimate prints are gpu_buffers.h's (gpu_stash_layer_values says which and how many values).
#pragma once

#include "llmc/kernels/fp8.cuh"  // fp8_scale_for, FP8_E4M3_MAX, cuda_fp8.h's rounding conversion

// One stashed tensor of one layer: where the forward computed it (and the backward finds it), where
// its e4m3 copy lives between the two, and its amax (a float's bits: for floats >= 0 they order as the
// values do, so atomicMax on them is a max of the values).
struct StashedTensor {
    floatX* work;       // n values in the build's type: one layer's, shared by every layer
    uint8_t* kept;      // n e4m3 codes: this layer's
    unsigned int* amax; // one
    size_t n;
};

// e4m3's code to its value, exactly (the OCP spec; no infinities, 0x7f / 0xff are NaN). Written out
// rather than taken from cuda_fp8.h: the decoding IS the lesson, and it is 4 lines.
__device__ inline float stash_e4m3_value(uint8_t q) {
    int e = (q >> 3) & 0xf, mant = q & 0x7;
    if (e == 0xf && mant == 0x7) return __int_as_float(0x7fc00000);        // NaN
    float v = e == 0 ? ldexpf((float)mant, -9) : ldexpf(8.0f + mant, e - 10);  // subnormal: m 2^-9; normal: 1.m 2^(e-7)
    return (q & 0x80) ? -v : v;
}

// max |x| into *amax (NaNs skipped: fmaxf(a, NaN) = a)
__global__ void stash_amax_kernel(unsigned int* amax, const floatX* x, size_t n) {
    float m = 0.0f;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        m = fmaxf(m, fabsf(to_float(x[i])));
    for (int offset = 16; offset > 0; offset /= 2) m = fmaxf(m, __shfl_xor_sync(0xffffffff, m, offset));
    if (threadIdx.x % 32 == 0) atomicMax(amax, __float_as_uint(m));
}

// The tensor's own scale (a tensor of zeros keeps 1: its codes are zeros either way).
__device__ inline float stash_scale(const unsigned int* amax) {
    return fp8_scale_for(__uint_as_float(*amax), FP8_E4M3_MAX, 1.0f);
}

__global__ void stash_quantize_kernel(uint8_t* q, const floatX* x, size_t n, const unsigned int* amax) {
    float s = stash_scale(amax);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        q[i] = __nv_cvt_float_to_fp8(to_float(x[i]) * s, __NV_SATFINITE, __NV_E4M3);  // round to nearest even
}

// x~ = q / s: exact in bf16 and fp32 (4 significant bits times a power of two)
__global__ void stash_dequantize_kernel(floatX* x, const uint8_t* q, size_t n, const unsigned int* amax) {
    float inv = 1.0f / stash_scale(amax);  // exact: a power of two
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x)
        x[i] = from_float<floatX>(stash_e4m3_value(q[i]) * inv);
}

inline int stash_grid(size_t n) { return (int)std::min<size_t>(ceil_div(n, (size_t)256), 1024); }

// The forward has read t.work for the last time: keep it as e4m3 codes and their scale's amax.
inline void stash_fp8_keep(const StashedTensor& t, cudaStream_t stream) {
    if (t.n == 0) return;
    CUDA_CHECK(cudaMemsetAsync(t.amax, 0, sizeof(unsigned int), stream));
    stash_amax_kernel<<<stash_grid(t.n), 256, 0, stream>>>(t.amax, t.work, t.n);
    CUDA_CHECK_LAUNCH();
    stash_quantize_kernel<<<stash_grid(t.n), 256, 0, stream>>>(t.kept, t.work, t.n, t.amax);
    CUDA_CHECK_LAUNCH();
}

// The backward is about to read t.work: fill it from the codes.
inline void stash_fp8_restore(const StashedTensor& t, cudaStream_t stream) {
    if (t.n == 0) return;
    stash_dequantize_kernel<<<stash_grid(t.n), 256, 0, stream>>>(t.work, t.kept, t.n, t.amax);
    CUDA_CHECK_LAUNCH();
}
