// gelu.cuh — GELU (tanh approximation, GPT-2's) forward and backward.
//
//   gelu(x) = x/2 * (1 + tanh(u)),  u = sqrt(2/pi) * (x + 0.044715 x^3)
// computed, as the CPU reference computes it, through 1 + tanh(u) = 2 sigmoid(2u):
//   gelu(x)  = x * s,                               s = sigmoid(2u) = 1 / (1 + exp(-2u))
//   gelu'(x) = s + 2 x s (1 - s) du/dx,             du/dx = sqrt(2/pi) (1 + 3 * 0.044715 x^2)
// Why not tanhf: under --use_fast_math (our build) nvcc turns tanhf into the hardware tanh.approx,
// whose relative error is 2^-11. In the backward, 1 - tanh(u)^2 then loses digits where tanh(u) is
// near 1 (|x| around 2 and up): ~1e-3 relative error in gelu', the whole of the fp32 build's
// tolerance against the CPU. exp (ex2.approx, ~2 ulp) keeps fp32 accuracy, and the CPU's formula on
// both sides makes the comparison tight.
// Large |x| is safe: exp(-2u) overflows to inf for very negative x, and s = 1/inf = 0, gelu = -0.
//
// Where GELU runs: cuBLASLt can apply GELU in the fc matmul's epilogue (forward) and GELU's derivative
// in the epilogue of fcproj's input-gradient matmul (backward), which saves this file's two passes
// over (B, T, 4C) and the fc bias gradient's read of it (llmc/kernels/matmul.cuh: matmul_forward_gelu,
// matmul_backward_data_dgelu). gelu_in_matmul_epilogue() below chooses, in one place, and these
// kernels remain for what the library cannot do:
//   - --recompute >= 1: the backward rebuilds gelu(fch) from fch, and only THIS kernel can do that
//     (the library's GELU exists only inside a matmul). Recompute is exact only if the forward used
//     the same kernel on the same input, so those levels keep the separate path, forward and back.
//     Level 0 (nothing recomputed) takes the epilogues: its results differ from levels 1 and 2 by
//     bf16 roundings (the library's GELU is not this code, and it reads the unrounded fch).
//   - the fp32 build: it exists to compare with the CPU tightly (1e-4), and cuBLASLt does not
//     document how accurately its GELU is computed (see the tanh.approx note above).
//   - a width that is not a multiple of 8: the epilogue's aux matrix (fch) needs an ld divisible by 8.
// GELU's form in the library: cublasLt.h says only "GELU". The stand-in (test/emu/cublas_standin.cpp)
// takes the tanh approximation, GPT-2's, as llm.c relies on; on a GPU the kernel lab's
// matmul_bias_gelu 3 and 4 rows and test_gpu.py's --recompute 0 checks bound the library's against
// the CPU's tanh form only within bf16 tolerances, which the erf form (at most 5e-4 away) would pass:
// the form is an assumption until a GPU run compares them element by element.
// The backward multiplies the incoming gradient in place. Traffic: 16-byte vectors, one read and one
// write per element forward; two reads and one write backward.
#pragma once

#include "llmc/kernels/cuda_common.cuh"

constexpr float GELU_SCALE = 0.7978845608028654f;  // sqrt(2/pi)

// The one place that decides (see above): the fc layer's GELU in cuBLASLt's epilogues, or in these kernels;
// the forward and the backward both ask it, so they always agree.
// keep_gelu: the recompute level keeps fch_gelu per layer (llmc/model/recompute.h, level 0).
// fc_in_fp8: --precision fp8 runs fc in fp8 (llmc/kernels/fp8.cuh), whose output no epilogue of ours takes.
inline bool gelu_in_matmul_epilogue(bool keep_gelu, bool fc_in_fp8, int fc_channels) {
    return keep_gelu && !fc_in_fp8 && !FLOATX_IS_FP32 && fc_channels % 8 == 0;
}

// The math of one element, on the host too (test/test_gpu_host.cu checks it against the tanh form).
__host__ __device__ __forceinline__ float gelu_sigmoid_2u(float x) {
    float u = GELU_SCALE * (x + 0.044715f * x * x * x);
    return 1.0f / (1.0f + expf(-2.0f * u));
}
__host__ __device__ __forceinline__ float gelu_value(float x) { return x * gelu_sigmoid_2u(x); }
__host__ __device__ __forceinline__ float gelu_derivative(float x) {
    float s = gelu_sigmoid_2u(x);
    float du_dx = GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
    return s + 2.0f * x * s * (1.0f - s) * du_dx;
}

__global__ void gelu_forward_kernel(floatX* out, const floatX* inp, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    x128 x8 = load128cs(inp + i), y8;
    for (int k = 0; k < x128::size; k++) y8[k] = from_float<floatX>(gelu_value(to_float(x8[k])));
    store128(out + i, y8);
}

inline void gelu_forward(floatX* out, const floatX* inp, size_t n, cudaStream_t stream) {
    gelu_forward_kernel<<<ceil_div(n / x128::size, 256), 256, 0, stream>>>(out, inp, n);
    CUDA_CHECK_LAUNCH();
}

// d (in place): d = d * gelu'(inp)
__global__ void gelu_backward_inplace_kernel(floatX* d, const floatX* inp, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    x128 x8 = load128cs(inp + i), d8 = load128(d + i);
    for (int k = 0; k < x128::size; k++)
        d8[k] = from_float<floatX>(to_float(d8[k]) * gelu_derivative(to_float(x8[k])));
    store128(d + i, d8);
}

inline void gelu_backward_inplace(floatX* d, const floatX* inp, size_t n, cudaStream_t stream) {
    gelu_backward_inplace_kernel<<<ceil_div(n / x128::size, 256), 256, 0, stream>>>(d, inp, n);
    CUDA_CHECK_LAUNCH();
}
