// tensor_parallel.cuh — tensor and sequence parallelism on GPUs: the hooks of llmc/parallel/tensor_parallel.h
// with NCCL (or host-staged MPI) collectives, the vocabulary-parallel embedding, and a classifier
// whose softmax spans the tensor group without ever gathering the logits.
//
// Read llmc/parallel/tensor_parallel.h first: it is the lesson (which matmuls split by columns and which by
// rows, where the one all-reduce per half-block goes, why sequence parallelism moves the row-wise
// region between a reduce-scatter and an all-gather), and the CPU trainer calls the same hooks at
// the same places. What a GPU adds:
//
//   Where the collectives run. On the tensor group's own communication stream (llmc/parallel/comm_nccl.cuh),
//   after an event from the compute stream; then the HOST waits, under --comm-timeout, before it
//   enqueues the kernel that needs the result. The compute stream never waits on the GPU for a
//   collective (a collective stuck on a dead rank would hang it with no deadline), the rule the data-
//   parallel code follows too. The price is that the host stops enqueueing for the length of each
//   collective, 4 per layer and micro-batch: tensor parallelism sits on the critical path anyway.
//
//   Identical replicas. The LayerNorms and the residual stream are computed by every tensor rank
//   from the summed activation, so the sum must have the same BITS on every rank:
//   gpu_all_reduce_identical is a reduce-scatter (each sum computed once, by one rank) and an all-
//   gather, as comm_allreduce_sum_identical is on the CPU. Same bytes as a ring all-reduce.
//
//   The bias of a row-parallel matmul is added once: rank 0's partial sum carries it (in cuBLASLt's
//   epilogue, as on one rank); the others add none. The sum then holds it exactly once.
//
//   The vocabulary-parallel embedding: each rank writes its rows' embeddings and zeros elsewhere; the
//   sum over ranks has one non-zero term per element, so it is EXACT in bf16, and adding wpe then
//   rounds once, as the one-rank encoder does: the embeddings are bit-identical to one rank's.
//
//   The vocabulary-parallel classifier, three kernels and two exchanges of B*T numbers (never the
//   (B*T, Vp) logits):   pass 1  each row's maximum over this rank's columns -> all-reduce of maxima
//                        pass 2  sum of exp(z - max) and the target's logit (0 where another rank
//                                holds the target) -> all-reduce of the (sum, logit) pairs
//                        pass 3  loss = max + log(sum) - logit; the gradient softmax - onehot, in place
//   fused_classifier.cuh does it in one pass with an online max; split, the global max must be known
//   before the sum, hence one more read of the logits (from L2, mostly).
//
// Cost per micro-batch (B*T tokens, C channels, L layers of this rank, t ranks), bf16: each all-
// reduce of B*T*C values sends 2 (t-1)/t * B*T*C*2 bytes per rank; there are 2L + 1 in the forward
// (and the loss's B*T maxima and 2 B*T sums in fp32) and 2L + 1 in the backward. Half of
// tensor_parallel.h's fp32 counts. Sequence parallelism: the same bytes forward, 1.5 times backward.
#pragma once

#include <initializer_list>
#include "llmc/parallel/comm_nccl.cuh"
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/kernels/fused_classifier.cuh"
#include "llmc/model/model.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/parallel/tensor_parallel.h"

struct TensorParallelGpu {
    TensorParallel host;          // degree, rank, sequence_parallel (llmc/parallel/tensor_parallel.h); degree 1: no-ops
    GpuComm* comm = nullptr;      // the tensor group on the GPU (its stream and NCCL communicator)
    floatX* gathered = nullptr;   // (B*T, C) sequence parallelism: every rank's rows (GB_TP_GATHERED)
    float* exchange = nullptr;    // the loss: (B*T) row maxima, then (B*T, 2) sums padded to t shards
    cudaEvent_t ready = nullptr;  // recorded on the compute stream; the tensor stream waits for it
};

inline void tp_gpu_init(TensorParallelGpu* tp, Comm* group, GpuComm* comm, bool sequence_parallel, floatX* gathered,
                        float* exchange) {
    tensor_parallel_init(&tp->host, group, sequence_parallel);
    tp->comm = comm;
    tp->gathered = gathered;
    tp->exchange = exchange;
    CUDA_CHECK(cudaEventCreateWithFlags(&tp->ready, cudaEventDisableTiming));
}

inline void tp_gpu_destroy(TensorParallelGpu* tp) {
    if (tp->ready) CUDA_CHECK(cudaEventDestroy(tp->ready));
    tp->ready = nullptr;
}

// The tensor stream takes over from the compute stream: everything the compute stream has been
// given so far comes first.
inline void tp_follow(TensorParallelGpu* tp, cudaStream_t compute) {
    CUDA_CHECK(cudaEventRecord(tp->ready, compute));
    CUDA_CHECK(cudaStreamWaitEvent(tp->comm->stream, tp->ready, 0));
}

// Before a column-parallel matmul ("f"): the (rows x width) input with every row. `mine` itself, or
// with sequence parallelism every rank's rows/t rows all-gathered into tp->gathered.
inline const floatX* tp_all_rows(TensorParallelGpu* tp, const floatX* mine, size_t rows, size_t width, cudaStream_t compute,
                                 const char* what) {
    if (!tp->host.sequence_parallel) return mine;
    size_t n = rows / tp->host.degree * width;
    tp_follow(tp, compute);
    CUDA_CHECK(cudaMemcpyAsync(tp->gathered + tp->host.rank * n, mine, n * sizeof(floatX), cudaMemcpyDeviceToDevice,
                               tp->comm->stream));
    gpu_all_gather(tp->comm, tp->gathered, n, NCCL_FLOATX, what);
    gpu_comm_wait(tp->comm, what);
    return tp->gathered;
}

// After a row-parallel matmul ("g"; and in the backward pass for the gradient of a column-parallel
// matmul's input): the sum over ranks of the partial (rows x width) arrays. Returns where it is:
// `partial` itself (identical all-reduce in place; untouched on one rank), or with sequence
// parallelism `mine`, which receives this rank's rows of the sum (a reduce-scatter).
inline floatX* tp_sum_rows(TensorParallelGpu* tp, floatX* partial, floatX* mine, size_t rows, size_t width,
                           cudaStream_t compute, const char* what) {
    if (tp->host.degree == 1) return partial;
    tp_follow(tp, compute);
    if (!tp->host.sequence_parallel) {
        gpu_all_reduce_identical(tp->comm, partial, rows * width, NCCL_FLOATX, what);
        gpu_comm_wait(tp->comm, what);
        return partial;
    }
    gpu_reduce_scatter_sum(tp->comm, partial, mine, rows / tp->host.degree * width, NCCL_FLOATX, what);
    gpu_comm_wait(tp->comm, what);
    return mine;
}

// Where a row-parallel matmul writes its partial sums: into `mine` (rows x width) itself, or with
// sequence parallelism (where `mine` holds only rows/t rows) into the full-size `scratch`.
inline floatX* tp_partial_buffer(const TensorParallelGpu* tp, floatX* mine, floatX* scratch) {
    return tp->host.sequence_parallel ? scratch : mine;
}

// The bias of a row-parallel matmul: rank 0's partial sum carries it, so the sum holds it once.
inline const floatX* tp_bias(const TensorParallelGpu* tp, const floatX* bias) { return tp->host.rank == 0 ? bias : nullptr; }

// Sequence parallelism: a unit's LayerNorm weight gradients are partial sums over this rank's rows;
// sums them over the tensor group (identically), each of the C values of the tensors present.
inline void tp_sum_layernorm_grads(TensorParallelGpu* tp, const ParamTensors<floatX>& grads, size_t C, cudaStream_t compute) {
    if (!tp->host.sequence_parallel) return;
    const char* what = "all-reduce of the sequence-parallel LayerNorm gradients";
    tp_follow(tp, compute);
    for (int t : {LN1W, LN1B, LN2W, LN2B, LNFW, LNFB})
        if (grads[t]) gpu_all_reduce_identical(tp->comm, grads[t], C, NCCL_FLOATX, what);
    gpu_comm_wait(tp->comm, what);
}

// ----------------------------------------------------------------------------------------------
// The vocabulary-parallel embedding

// out[bt] = this rank's row of the token, or zeros when another rank holds it. One thread per 8 channels.
__global__ void tp_embedding_lookup_kernel(floatX* out, const int* tokens, const floatX* wte, int BT, int C, int first_row,
                                           int rows) {
    int chunks = C / x128::size;
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)BT * chunks) return;
    int bt = (int)(idx / chunks), c = (int)(idx % chunks) * x128::size;
    int row = tokens[bt] - first_row;
    x128 o = row >= 0 && row < rows ? load128(wte + (size_t)row * C + c) : x128::zeros();
    store128(out + (size_t)bt * C + c, o);
}

// x[n] += wpe[(first_row + n) % T] for the `rows` rows this rank holds (all B*T, or its 1/t).
__global__ void tp_add_positions_kernel(floatX* x, const floatX* wpe, size_t first_row, size_t rows, int T, int C) {
    int chunks = C / x128::size;
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= rows * chunks) return;
    size_t n = idx / chunks;
    int c = (int)(idx % chunks) * x128::size;
    x128 x8 = load128(x + n * C + c), p8 = load128(wpe + ((first_row + n) % T) * C + c);
    for (int k = 0; k < x128::size; k++) x8[k] = from_float<floatX>(to_float(x8[k]) + to_float(p8[k]));
    store128(x + n * C + c, x8);
}

// encoded (this rank's R rows of the residual stream) = the embeddings of B*T tokens; `scratch`
// holds (B*T, C) for the lookups before they are reduce-scattered (sequence parallelism).
inline void tp_embedding_forward(TensorParallelGpu* tp, floatX* encoded, floatX* scratch, const int* tokens, const floatX* wte,
                                 const floatX* wpe, const ModelSlice& s, int B, int T, int C, cudaStream_t compute) {
    size_t BT = (size_t)B * T;
    floatX* x = tp_partial_buffer(tp, encoded, scratch);
    size_t threads = BT * (C / x128::size);
    tp_embedding_lookup_kernel<<<ceil_div(threads, 256), 256, 0, compute>>>(x, tokens, wte, (int)BT, C, s.vocab_begin,
                                                                           s.vocab_real);
    CUDA_CHECK_LAUNCH();
    x = tp_sum_rows(tp, x, encoded, BT, C, compute, "all-reduce of the embeddings");  // exact: one term is not zero
    size_t rows = tp_local_rows(tp->host, BT);
    tp_add_positions_kernel<<<ceil_div(rows * (C / x128::size), 256), 256, 0, compute>>>(x, wpe, tp_first_row(tp->host, BT),
                                                                                        rows, T, C);
    CUDA_CHECK_LAUNCH();
}

// ----------------------------------------------------------------------------------------------
// The vocabulary-parallel classifier. A rank's logits are (N, Vp) for its vocabulary rows: columns
// [0, V) are the real tokens first_row + v, the rest padding (never in the loss, gradient zero).

constexpr int TP_CLASSIFIER_THREADS = 512;

// pass 1: row_max[row] = the maximum of this rank's real logits of the row
__global__ void __launch_bounds__(TP_CLASSIFIER_THREADS) tp_logits_max_kernel(float* row_max, const floatX* logits, int V,
                                                                              int Vp) {
    __shared__ float shared[32];
    const floatX* z = logits + (size_t)blockIdx.x * Vp;
    float m = -INFINITY;
    for (int c = threadIdx.x * x128::size; c < V; c += blockDim.x * x128::size) {
        x128 z8 = load128(z + c);
        for (int k = 0; k < x128::size && c + k < V; k++) m = fmaxf(m, to_float(z8[k]));
    }
    m = block_max(m, shared);
    if (threadIdx.x == 0) row_max[blockIdx.x] = m;
}

// pass 2, with the maximum over every rank: sums[2 row] = sum of exp(z - max) over this rank's real
// columns, sums[2 row + 1] = the target's logit if this rank holds the target, else 0
__global__ void __launch_bounds__(TP_CLASSIFIER_THREADS) tp_logits_sums_kernel(float* sums, const floatX* logits,
                                                                               const float* row_max, const int* targets,
                                                                               int V, int Vp, int first_row) {
    __shared__ float shared[32];
    int row = blockIdx.x;
    const floatX* z = logits + (size_t)row * Vp;
    float m = row_max[row], s = 0.0f;
    for (int c = threadIdx.x * x128::size; c < V; c += blockDim.x * x128::size) {
        x128 z8 = load128(z + c);
        for (int k = 0; k < x128::size && c + k < V; k++) s += expf(to_float(z8[k]) - m);
    }
    s = block_sum(s, shared);
    if (threadIdx.x == 0) {
        int target = targets[row] - first_row;
        sums[2 * row] = s;
        sums[2 * row + 1] = target >= 0 && target < V ? to_float(z[target]) : 0.0f;
    }
}

// pass 3: losses[row] = max + log(sum) - target logit; with write_grad the logits become
// dloss * (softmax - onehot) in place (fused_classifier.cuh's second pass, on this rank's columns)
__global__ void __launch_bounds__(TP_CLASSIFIER_THREADS) tp_logits_loss_kernel(floatX* logits, float* losses,
                                                                               const float* row_max, const float* sums,
                                                                               const int* targets, float dloss, int V,
                                                                               int Vp, int first_row, bool write_grad) {
    int row = blockIdx.x;
    floatX* z = logits + (size_t)row * Vp;
    float m = row_max[row], row_sum = sums[2 * row];
    if (threadIdx.x == 0) losses[row] = logf(row_sum) + m - sums[2 * row + 1];
    if (!write_grad) return;
    classifier_row_grad(z, V, Vp, m, 1.0f / row_sum, targets[row] - first_row, dloss);
}

// The loss of every row into `losses` (the same on every tensor rank); with write_grad, the logits
// (this rank's columns) become their gradient, as fused_classifier() does on one rank.
inline void tp_classifier(TensorParallelGpu* tp, floatX* logits, float* losses, const int* targets, float dloss, int N,
                          const ModelSlice& s, bool write_grad, cudaStream_t compute) {
    float* row_max = tp->exchange;
    float* sums = tp->exchange + N;
    size_t padded = (2 * (size_t)N + tp->host.degree - 1) / tp->host.degree * tp->host.degree;  // zeros past 2N
    tp_logits_max_kernel<<<N, TP_CLASSIFIER_THREADS, 0, compute>>>(row_max, logits, s.vocab_real, s.vocab_rows);
    CUDA_CHECK_LAUNCH();
    tp_follow(tp, compute);
    gpu_all_reduce_max(tp->comm, row_max, N, "all-reduce of the logits' maxima");
    gpu_comm_wait(tp->comm, "all-reduce of the logits' maxima");
    tp_logits_sums_kernel<<<N, TP_CLASSIFIER_THREADS, 0, compute>>>(sums, logits, row_max, targets, s.vocab_real,
                                                                    s.vocab_rows, s.vocab_begin);
    CUDA_CHECK_LAUNCH();
    tp_follow(tp, compute);
    gpu_all_reduce_identical(tp->comm, sums, padded, ncclFloat32, "all-reduce of the softmax sums and target logits");
    gpu_comm_wait(tp->comm, "all-reduce of the softmax sums and target logits");
    tp_logits_loss_kernel<<<N, TP_CLASSIFIER_THREADS, 0, compute>>>(logits, losses, row_max, sums, targets, dloss,
                                                                    s.vocab_real, s.vocab_rows, s.vocab_begin, write_grad);
    CUDA_CHECK_LAUNCH();
}
