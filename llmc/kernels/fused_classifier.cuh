// fused_classifier.cuh — softmax, cross-entropy loss and its gradient in one kernel.
//
// For one position with logits z over the V real tokens (the Vp - V padded ones never enter):
//   loss = logsumexp(z) - z[target]
//   dz_v = (softmax(z)_v - [v == target]) * dloss        (dloss = 1 / tokens in the step)
// Why fused: the unfused path materialises the probabilities, (B, T, Vp) floats, 12.9 GB for
// B=64, T=1024 - more than the model, its optimizer and most activations together - and then reads
// them again for the loss and again for the gradient. Here one block owns one row: pass 1 reads the
// row once, keeping a running max and a running sum of exp (the "online softmax": when a larger max
// appears, the sum so far is rescaled by exp(old - new)); pass 2 reads the row again (from L2) and
// overwrites the logits with their gradient, in place. Traffic per row: read Vp twice, write Vp once,
// in 16-byte vectors; nothing else is stored but one float of loss.
#pragma once

#include "llmc/kernels/cuda_common.cuh"

constexpr int CLASSIFIER_THREADS = 512;

// One row's dloss * (softmax - onehot), in place over its logits z: the V real columns from the row's
// maximum and 1 / (its sum of exp(z - max)); the padding's gradient is zero. The block's threads
// share the row, 8 columns at a time. (The vocabulary-parallel classifier, llmc/parallel/tensor_parallel.cuh,
// calls it with its rank's columns and the target as numbered there.)
__device__ __forceinline__ void classifier_row_grad(floatX* z, int V, int Vp, float row_max, float inv_sum, int target,
                                                    float dloss) {
    for (int c = threadIdx.x * x128::size; c < Vp; c += blockDim.x * x128::size) {
        x128 z8 = load128(z + c), d8;
        for (int k = 0; k < x128::size; k++) {
            int v = c + k;
            float p = v < V ? expf(to_float(z8[k]) - row_max) * inv_sum : 0.0f;
            float d = (v < V) ? (p - (v == target ? 1.0f : 0.0f)) * dloss : 0.0f;
            d8[k] = from_float<floatX>(d);
        }
        store128(z + c, d8);
    }
}

// logits (N, Vp) -> losses (N); if write_grad, logits are replaced by dloss * d(loss)/d(logits), times
// *loss_scale where given: fp16's loss scale S (llmc/optim/loss_scaler.h), read from device memory
// because it changes from step to step and a captured graph (--cuda-graphs) would bake in a value.
__global__ void __launch_bounds__(CLASSIFIER_THREADS) fused_classifier_kernel(floatX* logits, float* losses,
                                                                              const int* targets, float dloss, int V,
                                                                              int Vp, bool write_grad,
                                                                              const float* loss_scale) {
    __shared__ float shared[32];
    int row = blockIdx.x;
    floatX* z = logits + (size_t)row * Vp;
    // pass 1: this thread's running max and sum of exp(z - max) over its share of the row
    float m = -INFINITY, s = 0.0f;
    for (int c = threadIdx.x * x128::size; c < V; c += blockDim.x * x128::size) {
        x128 z8 = load128(z + c);
        for (int k = 0; k < x128::size && c + k < V; k++) {
            float x = to_float(z8[k]);
            if (x > m) {
                s = s * expf(m - x) + 1.0f;
                m = x;
            } else {
                s += expf(x - m);
            }
        }
    }
    float row_max = block_max(m, shared);
    float row_sum = block_sum(m == -INFINITY ? 0.0f : s * expf(m - row_max), shared);
    int target = targets[row];
    if (threadIdx.x == 0) losses[row] = logf(row_sum) + row_max - to_float(z[target]);
    if (!write_grad) return;
    __syncthreads();  // thread 0 read z[target] above; it is about to be overwritten
    // pass 2: the gradient, in place (S a power of two: dloss S is S / tokens to the bit)
    classifier_row_grad(z, V, Vp, row_max, 1.0f / row_sum, target, loss_scale ? dloss * *loss_scale : dloss);
}

inline void fused_classifier(floatX* logits, float* losses, const int* targets, float dloss, int N, int V, int Vp,
                             bool write_grad, cudaStream_t stream, const float* loss_scale = nullptr) {
    fused_classifier_kernel<<<N, CLASSIFIER_THREADS, 0, stream>>>(logits, losses, targets, dloss, V, Vp, write_grad,
                                                                  loss_scale);
    CUDA_CHECK_LAUNCH();
}
