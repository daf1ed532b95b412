// pipedream_2bw.cuh — PipeDream-2BW on the GPU: the two weight versions of a stage in device memory.
//
// Read llmc/parallel/pipedream_2bw.h first: the rule W(t+1) = W(t) - lr * grad f(W(t-1)) (Narayanan
// et al., ICML 2021, section 3.1), why two versions are enough, W(-1) = W(0), and the swap that
// keeps the layers reading only `params`. This file adds what the GPU does differently:
//
//   - The versions are the half-precision weights the passes read (bf16; fp32 in the fp32 build),
//     GB_PARAMS and, on a pipeline's last stage, its copy of the tied embedding (GB_LENT_WTE). The
//     older one is the size table's older_weights row (llmc/memory/gpu_buffers.h), 2 bytes a
//     parameter in bf16: against AdamW's 16 (weights and gradients 2 each, master, m and v 4 each),
//     an eighth more. The fp32 master weights are not versioned: only the optimizer reads them, and it
//     updates the newer version, W(t-1) into W(t), as the .h says.
//   - The swap is one kernel over the stage's elements on the compute stream, so it is ordered
//     with the passes around it; the copy after the passes one device-to-device copy.
//   - Without the flush (--pipeline-schedule 2bw) run_schedule walks the CPU's lists
//     (pipeline_2bw_steps, with the trainer's pipe_filled and pipe_drains): stage s runs the first
//     p-1-s forwards of step t+1 inside step t's list. Their activations stay in their slots across
//     the optimizer step (the slot map is not reset at a filled step), and so does the input of the
//     next forward, received in the same NCCL group as the last backward's gradient send (the
//     cut comes after that group). So no send or receive is in flight across the cut: pipe_finish
//     completes the list's sends before the gradient sums, as the CPU's group end does over MPI,
//     and the update's collectives on the world never interleave with the pipeline's. The swaps
//     are the CPU's: a forward of step t+1 reads the newer version, so stage s swaps at most
//     2(p-s) times a step. 2bw-flush runs each step's list to its end (1F1B's): the same bits.
//     Not with --precision fp8 (the forwards run ahead would record their amax in the previous
//     step's history), CUDA graphs or optimizer offload (refused in main, one line each).
//   - The checkpoint's pipedream_2bw_rank<r>.bin is the CPU's file (the .h writes and reads it; the
//     trainer downloads the older version widened to fp32, exact, and rounds it back to the same bits).
//
// Hook points: the schedule interpreter (llmc/run/schedule_run.h) calls pipedream_2bw_gpu_read
// before each compute action (the version its label names, the read_version pass), step_end
// pipedream_2bw_gpu_after_passes before the gradient sums;
// main decides step by step whether the list drains (run.h's pipeline_drains_after, as the CPU's).
#pragma once

#include "llmc/parallel/pipedream_2bw.h"

struct PipeDream2BWGpu {
    bool on = false;
    floatX* params = nullptr;  // the stage's weights (GB_PARAMS), `params_n` elements
    floatX* lent = nullptr;    // the last stage's copy of wte (GB_LENT_WTE), `lent_n`; nullptr elsewhere
    floatX* older = nullptr;   // GB_OLDER_WEIGHTS: params_n + lent_n elements, the other version
    size_t params_n = 0, lent_n = 0;
    bool swapped = false;      // during the passes: params (and lent) hold the older version
};

__global__ void swap_versions_kernel(floatX* a, floatX* b, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    floatX t = a[i];
    a[i] = b[i];
    b[i] = t;
}

inline void swap_versions(floatX* a, floatX* b, size_t n, cudaStream_t s) {
    if (n == 0) return;
    const int block = 256;
    swap_versions_kernel<<<(unsigned)((n + block - 1) / block), block, 0, s>>>(a, b, n);
    CUDA_CHECK(cudaGetLastError());
}

// Step 1 has no older version: both are W(0) (after the weights were loaded and shared). Also after
// the passes: older takes the newer version, W(t-1), which the optimizer is about to move on.
inline void pipedream_2bw_gpu_copy_newer(PipeDream2BWGpu* v, cudaStream_t s) {
    if (!v->on) return;
    CUDA_CHECK(cudaMemcpyAsync(v->older, v->params, v->params_n * sizeof(floatX), cudaMemcpyDeviceToDevice, s));
    if (v->lent_n > 0)
        CUDA_CHECK(cudaMemcpyAsync(v->older + v->params_n, v->lent, v->lent_n * sizeof(floatX), cudaMemcpyDeviceToDevice, s));
}

// Before a compute action: the version it reads in params (older_one: W(t-2) in step t).
inline void pipedream_2bw_gpu_read(PipeDream2BWGpu* v, bool older_one, cudaStream_t s) {
    if (!v->on || older_one == v->swapped) return;
    swap_versions(v->params, v->older, v->params_n, s);
    swap_versions(v->lent, v->older + v->params_n, v->lent_n, s);
    v->swapped = older_one;
}

// After the step's passes: params holds W(t-1) again, for the optimizer, and older a copy of it.
inline void pipedream_2bw_gpu_after_passes(PipeDream2BWGpu* v, cudaStream_t s) {
    if (!v->on) return;
    pipedream_2bw_gpu_read(v, false, s);
    pipedream_2bw_gpu_copy_newer(v, s);
}
