// gelu.cu — GELU forward and backward: what "memory-bound" means, and how wide a load should be.
//
//   forward   y = x/2 (1 + tanh(u)) = x sigmoid(2u),  u = sqrt(2/pi) (x + 0.044715 x^3)   over (B, T, 4C)
//   backward  d = d * gelu'(x), in place (the trainer multiplies the incoming gradient where it lies)
//
// Arithmetic: ~20 FLOPs and one exponential per element. Traffic: the forward reads and writes 2 bytes per
// element (4 B), the backward reads 4 and writes 2 (6 B). For the 25M elements of B=8 at ~3 TB/s the
// bytes take ~35 us; the math, spread over 132 SMs, takes less than half that. So
// the only question is how close each version gets to the copy bandwidth. Three steps:
//   1. scalar: one thread per element, 2-byte loads. Already coalesced (a warp reads 64 contiguous
//      bytes per instruction), but that is half a 128-byte cache line per instruction, and the
//      memory system needs many bytes in flight per SM to hide ~600 ns of DRAM latency.
//   2. bf16x2: one thread per 2 elements, 4-byte loads: half the instructions, twice the bytes per
//      instruction in flight.
//   3. trainer's (llmc/kernels/gelu.cuh): one thread per 8 elements, 16-byte loads (Packed128), and the
//      input read with a "streaming" hint (__ldcs) so it does not evict reusable lines from L2.
// Prediction: 1 reaches ~60-80% of the copy ceiling, 2 and 3 ~85-95%; the gap is what "bytes in
// flight per instruction" buys. Measured: see README.md.
#include "dev/cuda/common.h"
#include "llmc/kernels/gelu.cuh"

static const std::vector<Version> VERSIONS = {
    {"gelu_forward", 1, "scalar", "one thread per element, 2-byte loads and stores", false},
    {"gelu_forward", 2, "bf16x2", "one thread per 2 elements, 4-byte __nv_bfloat162 loads and stores", false},
    {"gelu_forward", 3, "trainer: 16-byte vectors", "llmc/kernels/gelu.cuh: one thread per 8 elements, 16-byte loads (streaming hint)", true},
    {"gelu_backward", 1, "scalar", "in place, one thread per element, 2-byte loads and stores", false},
    {"gelu_backward", 2, "bf16x2", "in place, one thread per 2 elements, 4-byte loads and stores", false},
    {"gelu_backward", 3, "trainer: 16-byte vectors", "llmc/kernels/gelu.cuh: in place, one thread per 8 elements, 16-byte loads", true},
};

// Every version evaluates the trainer's own formulas for one float (llmc/kernels/gelu.cuh: gelu_value,
// gelu_derivative, written as x * sigmoid(2u): one exponential, no cancellation).
__device__ __forceinline__ float gelu(float x) { return gelu_value(x); }
__device__ __forceinline__ float gelu_grad(float x) { return gelu_derivative(x); }

// ---- version 1: one thread per element
__global__ void gelu_forward_scalar(floatX* out, const floatX* inp, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16(gelu(__bfloat162float(inp[i])));
}
__global__ void gelu_backward_scalar(floatX* d, const floatX* inp, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) d[i] = __float2bfloat16(__bfloat162float(d[i]) * gelu_grad(__bfloat162float(inp[i])));
}

// ---- version 2: one thread per pair, 4-byte loads (n even)
__global__ void gelu_forward_pairs(floatX* out, const floatX* inp, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (i >= n) return;
    float2 x = __bfloat1622float2(*(const __nv_bfloat162*)(inp + i));
    *(__nv_bfloat162*)(out + i) = __floats2bfloat162_rn(gelu(x.x), gelu(x.y));
}
__global__ void gelu_backward_pairs(floatX* d, const floatX* inp, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * 2;
    if (i >= n) return;
    float2 x = __bfloat1622float2(*(const __nv_bfloat162*)(inp + i));
    float2 g = __bfloat1622float2(*(const __nv_bfloat162*)(d + i));
    *(__nv_bfloat162*)(d + i) = __floats2bfloat162_rn(g.x * gelu_grad(x.x), g.y * gelu_grad(x.y));
}

int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "gelu", VERSIONS);
    size_t n = (size_t)lab.B * lab.T * 4 * lab.C;  // the MLP's hidden activations

    // inputs: pre-activations around the interesting region of GELU, gradients of either sign
    std::vector<float> x = random_normal(n, next_seed(&lab), 0.0f, 1.5f);
    std::vector<float> dy = random_normal(n, next_seed(&lab), 0.0f, 1.0f);
    round_to_bf16(&x);
    round_to_bf16(&dy);
    std::vector<float> y_ref(n), dx_ref(n);
    cpu::gelu_forward(y_ref.data(), x.data(), n);
    cpu::gelu_backward(dx_ref.data(), x.data(), dy.data(), n);

    // forward: reads x, writes y
    int slots = lab_slots(lab, 4.0 * n);
    std::vector<floatX*> d_x = to_device<floatX>(x, slots);
    std::vector<floatX*> d_y = device_slots<floatX>(n, slots);
    Case fwd;
    fwd.kernel = "gelu_forward";
    fwd.bytes = 4.0 * n;
    fwd.slots = slots;
    fwd.checks = {bf16_output("y", d_y[0], y_ref)};
    Case c = fwd;
    c.version = 1;
    c.run = [&](int s) {
        gelu_forward_scalar<<<ceil_div(n, 256), 256, 0, lab.stream>>>(d_y[s], d_x[s], n);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        gelu_forward_pairs<<<ceil_div(n / 2, 256), 256, 0, lab.stream>>>(d_y[s], d_x[s], n);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) { gelu_forward(d_y[s], d_x[s], n, lab.stream); };
    lab_case(&lab, c);

    // backward, in place on d: reads x and d, writes d. prepare() puts dy back before the check.
    std::vector<floatX*> d_d = to_device<floatX>(dy, slots);
    floatX* dy_pristine = to_device<floatX>(dy, 1)[0];
    Case bwd;
    bwd.kernel = "gelu_backward";
    bwd.bytes = 6.0 * n;
    bwd.slots = slots;
    bwd.checks = {bf16_output("dx", d_d[0], dx_ref, false)};
    bwd.prepare = [&](int s) {
        CUDA_CHECK(cudaMemcpyAsync(d_d[s], dy_pristine, n * sizeof(floatX), cudaMemcpyDeviceToDevice, lab.stream));
    };
    c = bwd;
    c.version = 1;
    c.run = [&](int s) {
        gelu_backward_scalar<<<ceil_div(n, 256), 256, 0, lab.stream>>>(d_d[s], d_x[s], n);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        gelu_backward_pairs<<<ceil_div(n / 2, 256), 256, 0, lab.stream>>>(d_d[s], d_x[s], n);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) { gelu_backward_inplace(d_d[s], d_x[s], n, lab.stream); };
    lab_case(&lab, c);
    return lab_end(&lab);
}
