// residual.cu — the residual add, and what fusing it into the next LayerNorm buys.
//
//   r = a + b                 (the block's output added to the residual stream; r is kept)
//   y = LayerNorm(r)          (the next block's input; mean and rstd kept for the backward)
// Every transformer block ends with the add and the next begins with the LayerNorm, so the trainer
// never runs the add alone. Unfused, the add reads a and b and writes r (6 bytes per element), then
// the LayerNorm reads r back from DRAM and writes y (4): 10 bytes. Fused, one warp reads a and b,
// writes r, and computes the statistics and y from the row it just wrote (still in L1): 8 bytes.
// The floor drops by 20%; the fused kernel also saves a launch and a pass of DRAM latency.
//   1. a scalar add (one thread per element, 2-byte loads), then the trainer's LayerNorm on r
//   2. a 16-byte vector add, then the trainer's LayerNorm on r: the unfused path at its best
//   3. trainer's (llmc/kernels/layernorm.cuh, fused_residual_layernorm_forward): add and LayerNorm in one
//      pass. The statistics are taken over the ROUNDED residual (bf16 r), exactly what the
//      backward will read back; the reference rounds r too.
// Every version is charged the fused floor (8 bytes per element), so the unfused ones show at most
// ~80% of the ceiling. Prediction: 1 ~60%, 2 ~70-75%, 3 ~80-90%.
#include "dev/cuda/common.h"
#include "llmc/kernels/layernorm.cuh"

static const std::vector<Version> VERSIONS = {
    {"residual_layernorm", 1, "scalar add + LN", "a scalar add kernel (2-byte loads), then the trainer's LayerNorm", false},
    {"residual_layernorm", 2, "vector add + LN", "a 16-byte vector add kernel, then the trainer's LayerNorm: unfused", false},
    {"residual_layernorm", 3, "trainer: fused", "llmc/kernels/layernorm.cuh: the add fused into the LayerNorm, one pass", true},
};

__global__ void residual_scalar(floatX* out, const floatX* a, const floatX* b, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) out[i] = __float2bfloat16(__bfloat162float(a[i]) + __bfloat162float(b[i]));
}

__global__ void residual_vector(floatX* out, const floatX* a, const floatX* b, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    x128 a8 = load128cs(a + i), b8 = load128cs(b + i), o8;
    for (int k = 0; k < x128::size; k++) o8[k] = __float2bfloat16(__bfloat162float(a8[k]) + __bfloat162float(b8[k]));
    store128(out + i, o8);
}

int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "residual", VERSIONS);
    int N = lab.B * lab.T, C = lab.C;
    size_t nc = (size_t)N * C;

    std::vector<float> a = random_normal(nc, next_seed(&lab), 0.3f, 1.0f);
    std::vector<float> b = random_normal(nc, next_seed(&lab), 0.0f, 0.5f);
    std::vector<float> w = random_normal(C, next_seed(&lab), 1.0f, 0.2f);
    std::vector<float> bias = random_normal(C, next_seed(&lab), 0.0f, 0.2f);
    for (auto* v : {&a, &b, &w, &bias}) round_to_bf16(v);
    std::vector<float> r_ref(nc), y_ref(nc), mean_ref(N), rstd_ref(N);
    cpu::residual_forward(r_ref.data(), a.data(), b.data(), nc);
    round_to_bf16(&r_ref);  // the GPU stores r in bf16 and normalises what it stored
    cpu::layernorm_forward(y_ref.data(), mean_ref.data(), rstd_ref.data(), r_ref.data(), w.data(), bias.data(), N, C);

    double bytes = 8.0 * nc + 8.0 * N + 4.0 * C;
    int slots = lab_slots(lab, bytes);
    std::vector<floatX*> d_a = to_device<floatX>(a, slots), d_b = to_device<floatX>(b, slots);
    std::vector<floatX*> d_r = device_slots<floatX>(nc, slots), d_y = device_slots<floatX>(nc, slots);
    std::vector<float*> d_mean = device_slots<float>(N, slots), d_rstd = device_slots<float>(N, slots);
    floatX* d_w = to_device<floatX>(w, 1)[0];
    floatX* d_bias = to_device<floatX>(bias, 1)[0];
    Case base;
    base.kernel = "residual_layernorm";
    base.bytes = bytes;
    base.slots = slots;
    base.checks = {bf16_output("residual", d_r[0], r_ref), bf16_output("y", d_y[0], y_ref),
                   f32_output("mean", d_mean[0], mean_ref), f32_output("rstd", d_rstd[0], rstd_ref)};
    Case c = base;
    c.version = 1;
    c.run = [&](int s) {
        residual_scalar<<<ceil_div(nc, 256), 256, 0, lab.stream>>>(d_r[s], d_a[s], d_b[s], nc);
        CUDA_CHECK_LAUNCH();
        fused_residual_layernorm_forward(nullptr, d_y[s], d_mean[s], d_rstd[s], d_r[s], nullptr, d_w, d_bias, N, C, lab.stream);
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        residual_vector<<<ceil_div(nc / x128::size, 256), 256, 0, lab.stream>>>(d_r[s], d_a[s], d_b[s], nc);
        CUDA_CHECK_LAUNCH();
        fused_residual_layernorm_forward(nullptr, d_y[s], d_mean[s], d_rstd[s], d_r[s], nullptr, d_w, d_bias, N, C, lab.stream);
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) {
        fused_residual_layernorm_forward(d_r[s], d_y[s], d_mean[s], d_rstd[s], d_a[s], d_b[s], d_w, d_bias, N, C, lab.stream);
    };
    lab_case(&lab, c);
    return lab_end(&lab);
}
