// gelu.cuh — GELU (tanh approximation, GPT-2's) forward and backward.
//
//   gelu(x) = x/2 * (1 + tanh(u)),  u = sqrt(2/pi) * (x + 0.044715 x^3)
//   gelu'(x) = (1 + tanh u)/2 + x/2 * (1 - tanh^2 u) * sqrt(2/pi) * (1 + 3 * 0.044715 x^2)
//
// Why not fused into the matmul epilogue: cuBLASLt can apply GELU after the fc matmul, but its GELU
// is not this code, and with --recompute >= 1 the backward rebuilds gelu(fch) with THIS kernel. Only
// the same kernel on the same input guarantees that recompute levels give bit-identical results, so
// the forward uses it too. The price is one extra pass over (B, T, 4C): read fch, write fch_gelu.
// The backward multiplies the incoming gradient in place. Traffic: 16-byte vectors, one read and one
// write per element forward; two reads and one write backward.
#pragma once

#include "llmc/cuda_common.cuh"

constexpr float GELU_SCALE = 0.7978845608028654f;  // sqrt(2/pi)

__global__ void gelu_forward_kernel(floatX* out, const floatX* inp, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    x128 x8 = load128cs(inp + i), y8;
    for (int k = 0; k < x128::size; k++) {
        float x = to_float(x8[k]);
        y8[k] = from_float<floatX>(0.5f * x * (1.0f + tanhf(GELU_SCALE * (x + 0.044715f * x * x * x))));
    }
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
    for (int k = 0; k < x128::size; k++) {
        float x = to_float(x8[k]);
        float th = tanhf(GELU_SCALE * (x + 0.044715f * x * x * x));
        float du_dx = GELU_SCALE * (1.0f + 3.0f * 0.044715f * x * x);
        float grad = 0.5f * (1.0f + th) + 0.5f * x * (1.0f - th * th) * du_dx;
        d8[k] = from_float<floatX>(to_float(d8[k]) * grad);
    }
    store128(d + i, d8);
}

inline void gelu_backward_inplace(floatX* d, const floatX* inp, size_t n, cudaStream_t stream) {
    gelu_backward_inplace_kernel<<<ceil_div(n / x128::size, 256), 256, 0, stream>>>(d, inp, n);
    CUDA_CHECK_LAUNCH();
}
