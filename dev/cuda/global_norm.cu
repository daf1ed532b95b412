// global_norm.cu — the L2 norm of all gradients (for clipping): a reduction of 124M values to one,
// and what atomics cost.
//
//   norm = sqrt(sum over every gradient g of g^2)       (GPT-2 small: 124,475,904 bf16 gradients)
// Memory-bound: 249 MB read, one float written. The versions are three ways to combine partial sums:
//   1. naive: one thread per element, atomicAdd of g^2 into ONE double. Every add is serialised on
//      one address in L2: ~124M atomics one after the other. (An fp32 accumulator would also lose
//      the late small terms once the sum is large: the double keeps the lesson about speed only.)
//   2. block sums: each 512-thread block sums 8192 elements (fp32 in registers, a shared-memory tree
//      through the trainer's block_sum) and adds its partial to a double with one atomicAdd: 15K
//      atomics instead of 124M. Fast, but the order of those adds is a race: not bit-reproducible.
//   3. trainer's (llmc/kernels/global_norm.cuh): a FIXED grid of 512 blocks strides over the array with
//      16-byte loads, each block writes its partial, one block adds the 512 partials in a fixed tree.
//      Deterministic, and the fixed grid means the same order on any GPU.
// Prediction: 1 far below 1% of the copy ceiling; 2 and 3 ~80-90%.
#include "dev/cuda/common.h"
#include "llmc/kernels/global_norm.cuh"

static const std::vector<Version> VERSIONS = {
    {"global_norm", 1, "atomics per element", "one thread per element, atomicAdd of g^2 into one double", false},
    {"global_norm", 2, "block sums + atomics", "512-thread blocks sum 8192 elements each, one double atomicAdd per block", false},
    {"global_norm", 3, "trainer: fixed grid", "llmc/kernels/global_norm.cuh: 512 blocks, 16-byte loads, partials summed in order", true},
};

__global__ void norm_atomic_per_element(double* sum, const floatX* grads, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    float g = __bfloat162float(grads[i]);
    atomicAdd(sum, (double)(g * g));
}

constexpr int NORM_PER_THREAD = 16;
__global__ void norm_block_sums(double* sum, const floatX* grads, size_t n) {
    __shared__ float shared[32];
    size_t base = (size_t)blockIdx.x * blockDim.x * NORM_PER_THREAD + threadIdx.x;
    float s = 0.0f;
    for (int k = 0; k < NORM_PER_THREAD; k++) {  // consecutive threads, consecutive elements: coalesced
        size_t i = base + (size_t)k * blockDim.x;
        if (i < n) {
            float g = __bfloat162float(grads[i]);
            s += g * g;
        }
    }
    s = block_sum(s, shared);
    if (threadIdx.x == 0) atomicAdd(sum, (double)s);
}

__global__ void norm_finish(float* norm, const double* sum) { *norm = (float)sqrt(*sum); }

int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "global_norm", VERSIONS);
    GPT2Config cfg = lab_model(lab);
    size_t n = param_layout(cfg).total;
    printf("%zu gradients (%s)\n", n, describe_config(cfg).c_str());

    std::vector<float> grads = random_normal(n, next_seed(&lab), 0.0f, 1e-3f);
    round_to_bf16(&grads);
    std::vector<float> norm_ref = {cpu::global_grad_norm(grads.data(), n)};

    floatX* d_grads = to_device<floatX>(grads, 1)[0];
    double* d_sum = device_alloc<double>(1);
    float* d_norm = device_alloc<float>(1);
    float* partials = device_alloc<float>(GLOBAL_NORM_BLOCKS + 1);
    Case base;
    base.kernel = "global_norm";
    base.bytes = 2.0 * n;
    base.slots = 1;  // 249 MB: larger than L2
    base.checks = {f32_output("norm", d_norm, norm_ref)};
    Case c = base;
    c.version = 1;
    c.run = [&](int) {
        CUDA_CHECK(cudaMemsetAsync(d_sum, 0, sizeof(double), lab.stream));
        norm_atomic_per_element<<<ceil_div(n, 256), 256, 0, lab.stream>>>(d_sum, d_grads, n);
        CUDA_CHECK_LAUNCH();
        norm_finish<<<1, 1, 0, lab.stream>>>(d_norm, d_sum);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int) {
        CUDA_CHECK(cudaMemsetAsync(d_sum, 0, sizeof(double), lab.stream));
        norm_block_sums<<<ceil_div(n, 512 * NORM_PER_THREAD), 512, 0, lab.stream>>>(d_sum, d_grads, n);
        CUDA_CHECK_LAUNCH();
        norm_finish<<<1, 1, 0, lab.stream>>>(d_norm, d_sum);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.checks = {f32_output("norm", partials + GLOBAL_NORM_BLOCKS, norm_ref)};  // where the trainer leaves it
    c.run = [&](int) { global_norm(partials, d_grads, n, lab.stream); };
    lab_case(&lab, c);
    return lab_end(&lab);
}
