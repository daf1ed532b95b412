// adamw.cu — gradient clipping and the AdamW update of every parameter: a pure streaming kernel,
// and how many launches it takes.
//
// For each parameter, with g scaled by clip = min(1, max_norm / (norm + 1e-6)):
//   m <- b1 m + (1 - b1) g;  v <- b2 v + (1 - b2) g^2
//   w <- w (1 - lr wd) - lr / (1 - b1^t) m / (sqrt(v) / sqrt(1 - b2^t) + eps)   (wd = 0 for biases, gains)
// w is the fp32 master weight; the bf16 parameter is written from it with stochastic rounding.
// Per parameter: bf16 p, g read and p written, fp32 m, v, w read and written: 30 bytes, 3.7 GB for
// GPT-2 small. ~20 FLOPs per 30 bytes: memory-bound, the whole question is bandwidth.
//   1. one launch per parameter tensor (16, with its own weight decay), one thread per element,
//      scalar loads. The 16 tails and launch gaps cost little on big tensors and a lot on the 12
//      small bias/gain tensors.
//   2. one launch for everything: each thread finds its tensor (and so its decay) from the tensor
//      offsets passed by value, the trainer's trick; still scalar loads.
//   3. the trainer's until this version 4: one launch, 8 parameters per thread, each thread's fp32
//      state in two 16-byte halves (32 bytes apart per thread: every load instruction uses half of
//      each sector it touches), the second half loaded after the first half's state was stored.
//   4. trainer's (llmc/optim/adamw.cuh): one launch, 4 parameters per thread: one 16-byte vector of
//      each fp32 array (a warp's load covers 512 contiguous bytes), 8 bytes of bf16, every load
//      issued before any store.
// Prediction (before a GPU ran them): 1 ~70%, 2 ~75%, 3 ~85-90% of the copy ceiling. Measured on
// an H200 (docs/benchmarks.md): 1 96%, 2 91%, 3 76%, which is what version 4 answers; its
// prediction: within a few % of version 2 or better (the same accesses, vectorised). The clip factor is read from the
// norm on the GPU (here: the CPU reference's norm, uploaded), so the step never waits for the host.
// Reference: the CPU trainer's adamw_update, tensor by tensor; the bf16 parameters are compared
// with the fp32 reference weights, so the check includes the stochastic rounding (~2e-3).
#include "dev/cuda/common.h"
#include "llmc/optim/adamw.cuh"

static const std::vector<Version> VERSIONS = {
    {"adamw", 1, "launch per tensor", "16 launches (one per tensor, its own decay), one thread per element", false},
    {"adamw", 2, "one launch, scalar", "one launch, tensor found from the offsets, one thread per element", false},
    {"adamw", 3, "one launch, 8/thread (old)", "the trainer's until version 4: 8 parameters per thread, state in 16-byte halves", false},
    {"adamw", 4, "trainer: one launch, 4/thread", "llmc/optim/adamw.cuh: 4 parameters per thread, whole-sector loads, loads before stores", true},
};

// One parameter: the trainer's formulas (llmc/optim/adamw.cuh), scalar.
__device__ __forceinline__ void adamw_one(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t i,
                                          float decay, float clip, const AdamWStep& now, const AdamWParams& a) {
    float g = __bfloat162float(grads[i]) * clip;
    float mi = a.beta1 * m[i] + (1.0f - a.beta1) * g;
    float vi = a.beta2 * v[i] + (1.0f - a.beta2) * g * g;
    float w = master[i] * decay - now.lr / now.bias_correction1 * mi / (sqrtf(vi) / now.bias_correction2_sqrt + a.eps);
    m[i] = mi;
    v[i] = vi;
    master[i] = w;
    uint64_t stream = (uint64_t)a.seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)now.step << 40);
    stochastic_round(&params[i], w, hash_u32(stream ^ (uint64_t)i));
}

__device__ __forceinline__ float clip_factor(float grad_norm, float max_norm) {
    return max_norm > 0.0f ? fminf(1.0f, max_norm / (grad_norm + 1e-6f)) : 1.0f;
}

// ---- 1: the elements [begin, begin + count) of one tensor
__global__ void adamw_tensor(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t begin,
                             size_t count, float decay, const AdamWStep* step_values, AdamWParams a) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    AdamWStep now = *step_values;
    if (i < count) adamw_one(params, master, grads, m, v, begin + i, decay, clip_factor(now.grad_norm, a.max_norm), now, a);
}

// ---- 2: everything, tensor looked up per element
__global__ void adamw_all_scalar(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t n,
                                 const AdamWStep* step_values, AdamWParams a) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    AdamWStep now = *step_values;
    int tensor = NUM_PARAM_TENSORS - 1;
    while (i < a.tensor_offset[tensor]) tensor--;
    float decay = (a.decay_mask >> tensor) & 1u ? 1.0f - now.lr * a.weight_decay : 1.0f;
    adamw_one(params, master, grads, m, v, i, decay, clip_factor(now.grad_norm, a.max_norm), now, a);
}

// ---- 3: the trainer's kernel before version 4, kept to measure against
__global__ void adamw_old8(floatX* params, float* master, const floatX* grads, float* m, float* v, size_t count,
                           const AdamWStep* step_values, AdamWParams a) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= count) return;
    AdamWStep now = *step_values;
    int tensor = NUM_PARAM_TENSORS - 1;
    while (i < a.tensor_offset[tensor]) tensor--;
    float decay = (a.decay_mask >> tensor) & 1u ? 1.0f - now.lr * a.weight_decay : 1.0f;
    float clip = clip_factor(now.grad_norm, a.max_norm), step_size = now.lr / now.bias_correction1;
    x128 p8 = load128(params + i), g8 = load128cs(grads + i);
    float p[x128::size];
    for (int h = 0; h < x128::size; h += f128::size) {
        f128 w4 = load128(master + i + h);
        for (int k = 0; k < f128::size; k++) p[h + k] = w4[k];
    }
    uint64_t stream = (uint64_t)a.seed * 0x9E3779B97F4A7C15ull ^ ((uint64_t)now.step << 40);
    for (int h = 0; h < x128::size; h += f128::size) {
        f128 m4 = load128(m + i + h), v4 = load128(v + i + h), w4;
        for (int k = 0; k < f128::size; k++) {
            int j = h + k;
            float g = to_float(g8[j]) * clip;
            m4[k] = a.beta1 * m4[k] + (1.0f - a.beta1) * g;
            v4[k] = a.beta2 * v4[k] + (1.0f - a.beta2) * g * g;
            p[j] = p[j] * decay - step_size * m4[k] / (sqrtf(v4[k]) / now.bias_correction2_sqrt + a.eps);
            w4[k] = p[j];
            stochastic_round(&p8[j], p[j], hash_u32(stream ^ (uint64_t)(i + j)));
        }
        store128(m + i + h, m4);
        store128(v + i + h, v4);
        store128(master + i + h, w4);
    }
    store128(params + i, p8);
}

int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "adamw", VERSIONS);
    GPT2Config cfg = lab_model(lab);
    ParamLayout layout = param_layout(cfg);
    size_t n = layout.total;
    printf("%zu parameters (%s)\n", n, describe_config(cfg).c_str());

    std::vector<float> master = random_normal(n, next_seed(&lab), 0.0f, 0.02f);
    std::vector<float> params = master;
    round_to_bf16(&params);
    std::vector<float> grads = random_normal(n, next_seed(&lab), 0.0f, 1e-3f);  // norm ~11: clipping is active
    round_to_bf16(&grads);
    std::vector<float> m = random_normal(n, next_seed(&lab), 0.0f, 1e-3f);
    std::vector<float> v = random_normal(n, next_seed(&lab), 0.0f, 1e-3f);
    for (float& x : v) x = x * x;  // a second moment is positive

    AdamWParams a;
    a.beta1 = 0.9f;
    a.beta2 = 0.95f;
    a.eps = 1e-8f;
    a.weight_decay = 0.1f;
    a.max_norm = 1.0f;
    a.seed = lab.seed;
    a.decay_mask = 0;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        a.tensor_offset[t] = layout.offset[t];
        if (param_tensor_decays(t)) a.decay_mask |= 1u << t;
    }
    float norm = cpu::global_grad_norm(grads.data(), n);
    AdamWStep now = adamw_step_values(a, 10, 6e-4f, norm);  // step 10
    float clip = cpu::clip_coefficient(norm, a.max_norm);
    printf("gradient norm %.3f, clip factor %.4f\n", norm, clip);
    std::vector<float> master_ref = master, m_ref = m, v_ref = v;
    for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
        size_t off = layout.offset[t];
        cpu::adamw_update(master_ref.data() + off, grads.data() + off, m_ref.data() + off, v_ref.data() + off,
                          layout.count[t], now.lr, a.beta1, a.beta2, a.eps, param_tensor_decays(t) ? a.weight_decay : 0.0f,
                          now.step, clip);
    }

    // device state and its pristine copies (every output is updated in place)
    floatX* d_params = to_device<floatX>(params, 1)[0];
    float* d_master = to_device<float>(master, 1)[0];
    floatX* d_grads = to_device<floatX>(grads, 1)[0];
    float* d_m = to_device<float>(m, 1)[0];
    float* d_v = to_device<float>(v, 1)[0];
    floatX* params_start = to_device<floatX>(params, 1)[0];
    float* master_start = to_device<float>(master, 1)[0];
    float* m_start = to_device<float>(m, 1)[0];
    float* v_start = to_device<float>(v, 1)[0];
    AdamWStep* d_now;  // the step's values, in device memory as the trainer keeps them
    CUDA_CHECK(cudaMalloc(&d_now, sizeof(AdamWStep)));
    CUDA_CHECK(cudaMemcpy(d_now, &now, sizeof(AdamWStep), cudaMemcpyHostToDevice));
    Case base;
    base.kernel = "adamw";
    base.bytes = 30.0 * n;
    base.slots = 1;  // 3.7 GB
    base.checks = {bf16_output("params", d_params, master_ref, false), f32_output("master", d_master, master_ref, false),
                   f32_output("m", d_m, m_ref, false), f32_output("v", d_v, v_ref, false)};
    base.prepare = [&](int) {
        CUDA_CHECK(cudaMemcpyAsync(d_params, params_start, n * sizeof(floatX), cudaMemcpyDeviceToDevice, lab.stream));
        CUDA_CHECK(cudaMemcpyAsync(d_master, master_start, n * 4, cudaMemcpyDeviceToDevice, lab.stream));
        CUDA_CHECK(cudaMemcpyAsync(d_m, m_start, n * 4, cudaMemcpyDeviceToDevice, lab.stream));
        CUDA_CHECK(cudaMemcpyAsync(d_v, v_start, n * 4, cudaMemcpyDeviceToDevice, lab.stream));
    };
    Case c = base;
    c.version = 1;
    c.run = [&](int) {
        for (int t = 0; t < NUM_PARAM_TENSORS; t++) {
            float decay = param_tensor_decays(t) ? 1.0f - now.lr * a.weight_decay : 1.0f;
            adamw_tensor<<<ceil_div(layout.count[t], 256), 256, 0, lab.stream>>>(
                d_params, d_master, d_grads, d_m, d_v, layout.offset[t], layout.count[t], decay, d_now, a);
            CUDA_CHECK_LAUNCH();
        }
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int) {
        adamw_all_scalar<<<ceil_div(n, 256), 256, 0, lab.stream>>>(d_params, d_master, d_grads, d_m, d_v, n, d_now, a);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int) {
        adamw_old8<<<ceil_div(n / x128::size, 256), 256, 0, lab.stream>>>(d_params, d_master, d_grads, d_m, d_v, n, d_now, a);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 4;
    c.run = [&](int) { adamw_update(d_params, d_master, d_grads, d_m, d_v, 0, n, d_now, a, lab.stream); };
    lab_case(&lab, c);
    return lab_end(&lab);
}
