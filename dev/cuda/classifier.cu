// classifier.cu — softmax, cross-entropy and its gradient over the vocabulary: fusion, and the
// online softmax.
//
// For each of the N = B*T positions, logits z over V = 50257 real tokens (padded to Vp = 50304):
//   loss = logsumexp(z) - z[target],   dz_v = (softmax(z)_v - [v == target]) / N   (0 on the padding)
// The gradient overwrites the logits in place. Memory-bound and big: the logits are N x Vp bf16,
// 824 MB at B=8. The least traffic: read them once, write the gradient once (1.6 GB).
//   1. unfused and materialised (the textbook): a thread per row finds the max and the sum and
//      writes the probabilities (fp32, N x Vp: 1.6 GB more written, then read back) and the loss;
//      a second kernel, a thread per element, turns the probabilities into the gradient. The
//      first kernel has only N threads, each walking 50K values, with lanes 100 KB apart.
//   2. fused, a block per row, three passes (max, sum of exp, write the gradient), 2-byte loads and
//      block reductions: no probabilities in memory; the row (100 KB) is read three times, the
//      later passes mostly from L2.
//   3. trainer's (llmc/kernels/fused_classifier.cuh): a block per row, 16-byte loads, and the max and sum
//      in ONE pass (the online softmax: the running sum is rescaled when the max grows), then the
//      gradient pass: the row is read twice.
// Prediction: 1 well under 10% of the copy ceiling; 2 ~50-70%; 3 ~70-85%.
// The logits are restored (untimed) before every timed round: they are overwritten, and the online
// softmax's branch depends on the values.
#include "dev/cuda/common.h"
#include "llmc/kernels/fused_classifier.cuh"

static const std::vector<Version> VERSIONS = {
    {"fused_classifier", 1, "unfused, materialised", "a thread per row writes fp32 probabilities; a thread per element the gradient", false},
    {"fused_classifier", 2, "fused, block, 3 passes", "a block per row: max, sum, gradient passes, 2-byte loads", false},
    {"fused_classifier", 3, "trainer: fused, online, 16B", "llmc/kernels/fused_classifier.cuh: online max+sum, then the gradient, 16-byte loads", true},
};

// ---- 1: probabilities to memory, then the gradient
__global__ void classifier_probs_rows(float* probs, float* losses, const floatX* logits, const int* targets, int N, int V,
                                      int Vp) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const floatX* z = logits + (size_t)row * Vp;
    float m = -INFINITY, sum = 0.0f;
    for (int v = 0; v < V; v++) m = fmaxf(m, __bfloat162float(z[v]));
    for (int v = 0; v < V; v++) sum += expf(__bfloat162float(z[v]) - m);
    float* p = probs + (size_t)row * Vp;
    for (int v = 0; v < V; v++) p[v] = expf(__bfloat162float(z[v]) - m) / sum;
    losses[row] = logf(sum) + m - __bfloat162float(z[targets[row]]);
}
__global__ void classifier_grad_elements(floatX* logits, const float* probs, const int* targets, float dloss, int N, int V,
                                         int Vp) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)N * Vp) return;
    int row = (int)(i / Vp), v = (int)(i % Vp);
    logits[i] = __float2bfloat16(v < V ? (probs[i] - (v == targets[row] ? 1.0f : 0.0f)) * dloss : 0.0f);
}

// ---- 2: a block per row, three passes, with the trainer's block reductions (llmc/kernels/cuda_common.cuh)
__global__ void classifier_block_3pass(floatX* logits, float* losses, const int* targets, float dloss, int V, int Vp) {
    __shared__ float shared[32];
    floatX* z = logits + (size_t)blockIdx.x * Vp;
    float m = -INFINITY, sum = 0.0f;
    for (int v = threadIdx.x; v < V; v += blockDim.x) m = fmaxf(m, __bfloat162float(z[v]));
    m = block_max(m, shared);
    for (int v = threadIdx.x; v < V; v += blockDim.x) sum += expf(__bfloat162float(z[v]) - m);
    sum = block_sum(sum, shared);  // ends with a barrier: thread 0's read of z[target] below is safe
    int target = targets[blockIdx.x];
    if (threadIdx.x == 0) losses[blockIdx.x] = logf(sum) + m - __bfloat162float(z[target]);
    __syncthreads();  // z[target] is read before anyone overwrites it
    for (int v = threadIdx.x; v < Vp; v += blockDim.x) {
        float p = v < V ? expf(__bfloat162float(z[v]) - m) / sum : 0.0f;
        z[v] = __float2bfloat16(v < V ? (p - (v == target ? 1.0f : 0.0f)) * dloss : 0.0f);
    }
}

int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "classifier", VERSIONS);
    int N = lab.B * lab.T, V = lab.V, Vp = lab.Vp;
    size_t n = (size_t)N * Vp;
    float dloss = 1.0f / N;

    std::vector<float> logits = random_normal(n, next_seed(&lab), 0.0f, 3.0f);
    round_to_bf16(&logits);
    std::vector<float> pick = random_uniform(N, next_seed(&lab), 0.0f, 1.0f);
    std::vector<int> targets(N);
    for (int i = 0; i < N; i++) targets[i] = std::min(V - 1, (int)(pick[i] * V));
    std::vector<float> losses_ref(N), lse(N), dlogits_ref = logits;
    cpu::crossentropy_forward(losses_ref.data(), lse.data(), logits.data(), targets.data(), N, V, Vp);
    cpu::crossentropy_softmax_backward(dlogits_ref.data(), lse.data(), targets.data(), N, V, Vp, dloss);

    double bytes = 4.0 * n + 8.0 * N;  // logits read, gradient written; targets read, losses written
    floatX* pristine = to_device<floatX>(logits, 1)[0];
    floatX* d_logits = device_alloc<floatX>(n);
    int* d_targets = to_device<int>(targets, 1)[0];
    float* d_losses = device_alloc<float>(N);
    float* probs = device_alloc<float>(n);
    Case base;
    base.kernel = "fused_classifier";
    base.bytes = bytes;
    base.slots = 1;  // 824 MB: far larger than L2
    base.checks = {f32_output("losses", d_losses, losses_ref), bf16_output("dlogits", d_logits, dlogits_ref, false)};
    base.prepare = [&](int) {
        CUDA_CHECK(cudaMemcpyAsync(d_logits, pristine, n * sizeof(floatX), cudaMemcpyDeviceToDevice, lab.stream));
    };
    base.prepare_before_timing = true;
    Case c = base;
    c.version = 1;
    c.run = [&](int) {
        classifier_probs_rows<<<ceil_div(N, 64), 64, 0, lab.stream>>>(probs, d_losses, d_logits, d_targets, N, V, Vp);
        CUDA_CHECK_LAUNCH();
        classifier_grad_elements<<<ceil_div(n, 256), 256, 0, lab.stream>>>(d_logits, probs, d_targets, dloss, N, V, Vp);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int) {
        classifier_block_3pass<<<N, 512, 0, lab.stream>>>(d_logits, d_losses, d_targets, dloss, V, Vp);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int) { fused_classifier(d_logits, d_losses, d_targets, dloss, N, V, Vp, true, lab.stream); };
    lab_case(&lab, c);
    return lab_end(&lab);
}
