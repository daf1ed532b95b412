// moe.cuh — the mixture-of-experts MLP on the GPU: routing, the permutation of tokens into
// per-expert contiguous rows and back, and their backward. The math is llmc/model/moe.h's (the CPU
// trainer's, which these kernels are tested against: test/test_gpu_moe.py); read its lesson first.
//
// What it teaches: how to run E small MLPs over a batch whose tokens each chose their own, without a
// launch per token. A GPU is fast at one big matmul and slow at many tiny ones, so the layer is four
// steps, each a handful of launches whatever the number of tokens:
//   1. route     one warp per token: logits = x W_r^T in fp32, softmax, top-k, the gates
//   2. dispatch  one block: each assignment's row. Rows are grouped by expert, and within an expert in
//                the CPU's order (all first choices by token position, then all second choices), and
//                an expert takes at most `capacity` of them: the rest are dropped in that same order.
//   3. permute   gather x's rows into that order (xg), so expert e's tokens are rows first_row[e] ..
//                first_row[e+1]-1: ONE matmul per expert over its rows (llmc/kernels/matmul.cuh), not
//                one per token, and the dense MLP's own functions (matmul_forward, gelu_forward)
//   4. combine   y_t = sum over t's kept choices of gate * the expert's output row (0 if all dropped)
// Backward: the rows' gradients (gate * dy) and the gates' (dy . expert output), the experts' MLP
// backward per expert, the router's gradient (gates, top-2 renormalisation, load-balancing and z
// losses, softmax), then the un-permute: dx_t = sum of t's rows' dx + the router's dlogits W_r.
//
// Determinism. Why step 2 is a scan and not atomics: with `pos = atomicAdd(&count[e], 1)` per
// assignment (dev/cuda/moe_dispatch.cu's naive version) the order of rows within an expert is the
// order the threads happened to run, and when capacity binds, WHICH tokens are dropped is too: a
// run could not be repeated, nor compared with the CPU. Here one block counts each thread's slice of
// the assignments per expert, scans the counts across threads (an exclusive prefix sum, in thread
// order), then every thread places its slice: the CPU's sequential order, exactly, on any schedule.
// No kernel here adds floats with atomics; every sum is in a fixed order (warp butterflies, loops).
//
// Precision (bf16 build): x, the experts' weights and activations are floatX as everywhere in the
// trainer. The router's weights W_r are floatX too (they are parameters like the others; their fp32
// master copy, if any, is the optimizer's), WIDENED to fp32 for the logits: the dot products, the
// softmax, the gates, the auxiliary losses and the router's whole backward are fp32, as Switch
// Transformers requires (bf16 logits would round near-ties and the exponentials). The gates are
// applied in fp32 and each output rounded once.
//
// The experts' matmuls: one cuBLASLt call per expert over its contiguous rows (not a batched call
// padded to capacity: with no dropping the capacity is N, and padding would multiply the FLOPs by E).
// The price: the host must know each expert's row count, so moe_read_rows copies E+1 ints back
// after the dispatch — one synchronisation per MoE layer per micro-batch (and so no CUDA graph
// capture). A grouped GEMM that reads the counts on the device (megablocks, CUTLASS's grouped
// kernels) removes it; that is the next step, not this file's.
//
// Memory: per layer, for N tokens and k choices: kN rows of xg, fch, fch_gelu and eout (k times the
// dense MLP's activations, plus drow, dh and dxg for the backward), plus N (3E + 5k + 1) fp32 and
// ints for the routing state (logits, probabilities and their gradient; choices, gates, rows, gate
// gradients, tokens of rows; logsumexp).
//
// Hook points: none; the GPU trainer calls these through llmc/model/moe_gpu.cuh, at the MoE blocks of
// its passes (one GPU). dev/cuda/moe_dispatch.cu times step 2-4 against the naive scatter;
// test/emu_moe_check.cu checks every kernel against llmc/model/moe.h.
#pragma once

#include <vector>
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/kernels/gelu.cuh"
#include "llmc/kernels/matmul.cuh"
// moe.h brings the CPU's layers with it, whose `#pragma GCC unroll`s nvcc does not know (a warning
// for each, in every file that includes this one): quiet that one warning for this include only
#ifdef __NVCC__
#pragma nv_diag_suppress 1675
#endif
#include "llmc/model/moe.h"  // MoEShape, MoEWeights, expert_of, moe_capacity: the one definition of each
#include "llmc/run/compatibility.h"  // moe_gpu_kernels_problem, MOE_GPU_MAX_EXPERTS
#ifdef __NVCC__
#pragma nv_diag_default 1675
#endif

constexpr int MOE_MAX_EXPERTS = 64;      // the router's per-token arrays live in registers
static_assert(MOE_MAX_EXPERTS == MOE_GPU_MAX_EXPERTS, "llmc/run/compatibility.h refuses more experts than the router holds");
constexpr int MOE_SCAN_THREADS = 128;    // the dispatch block: 128 x 64 counts = 32 KiB of shared memory
constexpr int MOE_ROUTE_WARPS = 4;       // tokens per block of the router

// The routing state of one MoE layer for one micro-batch of N tokens (device pointers), and what the
// backward needs of it. Mirrors cpu::MoEActivations' routing fields.
struct MoERouting {
    float* logits;      // (N, E)
    float* probs;       // (N, E)
    float* lse;         // (N)     logsumexp of each token's logits (the z-loss)
    int* choice;        // (N, k)  experts, best first
    float* gate;        // (N, k)
    int* row;           // (N, k)  the assignment's row among the gathered rows, -1 if dropped
    int* routed;        // (E)     assignments before dropping
    int* kept;          // (E)     after
    int* first_row;     // (E+1)
    int* token_of_row;  // (kN)    only the first first_row[E] are written
    float* losses;      // (2)     the load-balancing and z losses, as cpu::MoEStats
    float* dgate;       // (N, k)  backward
    float* dlogits;     // (N, E)  backward
};

// ---------------------------------------------------------------------------------------------
// 1. route: one warp per token. Each lane sums a strided slice of each of the E dot products; the
// warp's butterfly adds the slices (the same order for every run); lane 0 then does the softmax and
// top-k exactly as cpu::moe_route does (strict >, scanning e upwards: the lowest index wins a tie).

__global__ void moe_route_kernel(MoERouting r, const floatX* x, const floatX* router, int N, int C, int E, int k) {
    int t = blockIdx.x * MOE_ROUTE_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (t >= N) return;   // the whole warp leaves together: no shuffle is left waiting
    const floatX* xt = x + (size_t)t * C;
    float z[MOE_MAX_EXPERTS];
    for (int e = 0; e < E; e++) {
        const floatX* w = router + (size_t)e * C;
        float s = 0.0f;
        for (int i = lane; i < C; i += 32) s += to_float(xt[i]) * to_float(w[i]);
        z[e] = warp_sum(s);
    }
    if (lane != 0) return;
    float zmax = z[0];
    for (int e = 1; e < E; e++) zmax = fmaxf(zmax, z[e]);
    float p[MOE_MAX_EXPERTS], sum = 0.0f;
    for (int e = 0; e < E; e++) { p[e] = expf(z[e] - zmax); sum += p[e]; }
    for (int e = 0; e < E; e++) {
        p[e] /= sum;
        r.logits[(size_t)t * E + e] = z[e];
        r.probs[(size_t)t * E + e] = p[e];
    }
    r.lse[t] = zmax + logf(sum);
    int best = 0, second = -1;
    for (int e = 1; e < E; e++) if (p[e] > p[best]) best = e;
    r.choice[(size_t)t * k] = best;
    if (k == 1) {
        r.gate[t] = p[best];
    } else {
        for (int e = 0; e < E; e++) if (e != best && (second < 0 || p[e] > p[second])) second = e;
        float s2 = p[best] + p[second];
        r.choice[(size_t)t * k + 1] = second;
        r.gate[(size_t)t * k] = p[best] / s2;
        r.gate[(size_t)t * k + 1] = p[second] / s2;
    }
}

// ---------------------------------------------------------------------------------------------
// 2. dispatch: one block. The assignments in the CPU's acceptance order a = j N + t (choice j of
// token t) are cut into MOE_SCAN_THREADS contiguous slices, one per thread. Three phases:
//   count   count[i][e] = assignments to e in thread i's slice
//   scan    for each e, an exclusive prefix sum over i: count[i][e] = assignments to e before slice i
//           (so routed[e] = the total, kept[e] = min(total, capacity), first_row = their prefix sum)
//   place   each thread walks its slice in order: the assignment's place within e is count[i][e]++;
//           kept if under capacity (row = first_row[e] + place), dropped otherwise
// The work is O(kN) with no float arithmetic: one block is plenty (a few microseconds at N = 8192).

// The a-th assignment in the acceptance order (choice a / N of token a % N), as its index in the
// (N, k) arrays: first choices of every token before any second choice (GShard's priority).
__device__ __forceinline__ int moe_assignment(int a, int N, int k) { return (a % N) * k + a / N; }

__global__ void __launch_bounds__(MOE_SCAN_THREADS) moe_dispatch_kernel(MoERouting r, int N, int E, int k, int capacity) {
    __shared__ int count[MOE_SCAN_THREADS][MOE_MAX_EXPERTS];
    __shared__ int first[MOE_MAX_EXPERTS + 1];
    int i = threadIdx.x, total = k * N;
    int per = (total + MOE_SCAN_THREADS - 1) / MOE_SCAN_THREADS;
    int begin = min(total, i * per), end = min(total, begin + per);
    for (int e = 0; e < E; e++) count[i][e] = 0;
    for (int a = begin; a < end; a++) count[i][r.choice[moe_assignment(a, N, k)]]++;
    __syncthreads();
    for (int e = i; e < E; e += MOE_SCAN_THREADS) {
        int before = 0;
        for (int j = 0; j < MOE_SCAN_THREADS; j++) { int c = count[j][e]; count[j][e] = before; before += c; }
        r.routed[e] = before;
        r.kept[e] = min(before, capacity);
    }
    __syncthreads();
    if (i == 0) {
        first[0] = 0;
        for (int e = 0; e < E; e++) first[e + 1] = first[e] + r.kept[e];
        for (int e = 0; e <= E; e++) r.first_row[e] = first[e];
    }
    __syncthreads();
    for (int a = begin; a < end; a++) {
        int c = moe_assignment(a, N, k), t = c / k, e = r.choice[c];
        int place = count[i][e]++;
        if (place < capacity) {
            r.row[c] = first[e] + place;
            r.token_of_row[first[e] + place] = t;
        } else {
            r.row[c] = -1;
        }
    }
}

// The load-balancing loss alpha E sum_e f_e P_e and the z-loss c_z mean(lse^2): one block, each a
// block sum in a fixed order (fp32; the CPU sums in double, ~1e-7 apart).
__global__ void moe_losses_kernel(MoERouting r, int N, int E, int k, float alpha, float z_coef) {
    __shared__ float scratch[32];
    float balance = 0.0f;
    for (int e = 0; e < E; e++) {
        float s = 0.0f;
        for (int t = threadIdx.x; t < N; t += blockDim.x) s += r.probs[(size_t)t * E + e];
        float P = block_sum(s, scratch) / N;
        balance += (float)r.routed[e] / ((float)k * N) * P;
    }
    float s = 0.0f;
    for (int t = threadIdx.x; t < N; t += blockDim.x) s += r.lse[t] * r.lse[t];
    float z = block_sum(s, scratch);
    if (threadIdx.x == 0) {
        r.losses[0] = alpha * E * balance;
        r.losses[1] = z_coef * z / N;
    }
}

// ---------------------------------------------------------------------------------------------
// 3. permute: xg's row j = x's row token_of_row[j], 16 bytes per thread (C % 8 == 0). Launched for
// all kN possible rows; those past first_row[E] (dropped assignments) are left alone.

__global__ void moe_gather_kernel(floatX* xg, const floatX* x, const int* token_of_row, const int* first_row, int E,
                                  int max_rows, int C) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    int row = (int)(i / C), c = (int)(i % C);
    if (row >= max_rows || row >= first_row[E]) return;
    store128(xg + i, load128(x + (size_t)token_of_row[row] * C + c));
}

// Token t's kept rows of `rows` (columns c .. c+7), first choice first, each times its gate (or 1
// where gate is null: the un-permute), summed in fp32 into acc: the combine and its transpose.
__device__ __forceinline__ void moe_sum_rows(float* acc, const floatX* rows, const int* row, const float* gate, int t, int k,
                                             int C, int c) {
    for (int v = 0; v < x128::size; v++) acc[v] = 0.0f;
    for (int j = 0; j < k; j++) {
        int rj = row[(size_t)t * k + j];
        if (rj < 0) continue;
        float g = gate ? gate[(size_t)t * k + j] : 1.0f;   // x 1 is exact: the un-permute's plain sum
        x128 o = load128(rows + (size_t)rj * C + c);
        for (int v = 0; v < x128::size; v++) acc[v] += g * to_float(o[v]);
    }
}

// 4. combine: y_t = sum over t's kept choices, first choice first, of gate * eout's row; 0 when all
// were dropped (the residual carries the token). fp32 sum, one rounding.
__global__ void moe_combine_kernel(floatX* y, const floatX* eout, const int* row, const float* gate, int N, int C, int k) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    int t = (int)(i / C), c = (int)(i % C);
    if (t >= N) return;
    float acc[x128::size];
    moe_sum_rows(acc, eout, row, gate, t, k, C, c);
    x128 out;
    for (int v = 0; v < x128::size; v++) out[v] = from_float<floatX>(acc[v]);
    store128(y + i, out);
}

// ---------------------------------------------------------------------------------------------
// Backward, step 4's transpose: one warp per assignment. A kept one's row gradient drow = gate dy_t
// (what the expert's backward starts from) and its gate's gradient dy_t . eout_row (how the LM loss
// reaches the router); a dropped one's gate gradient is 0 (its output was never added).
__global__ void moe_backward_rows_kernel(floatX* drow, float* dgate, const floatX* dy, const floatX* eout, const int* row,
                                         const float* gate, int N, int C, int k) {
    int c = blockIdx.x * MOE_ROUTE_WARPS + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (c >= N * k) return;
    int rc = row[c];
    if (rc < 0) {
        if (lane == 0) dgate[c] = 0.0f;
        return;
    }
    const floatX* dyt = dy + (size_t)(c / k) * C;
    const floatX* o = eout + (size_t)rc * C;
    floatX* d = drow + (size_t)rc * C;
    float g = gate[c], s = 0.0f;
    for (int i = lane; i < C; i += 32) {
        float dv = to_float(dyt[i]);
        d[i] = from_float<floatX>(g * dv);
        s += dv * to_float(o[i]);
    }
    s = warp_sum(s);
    if (lane == 0) dgate[c] = s;
}

// The router's backward, one thread per token: the CPU's own per-token function (llmc/model/moe.h's
// moe_router_grad_token, __host__ __device__), so the formulas are written once:
//   d p_e   = aux_scale alpha E f_e / N   (+ the gates' gradients: top-1 dg on the choice; top-2
//             through the renormalisation g_i = p_i / (p1 + p2))
//   d z_e   = p_e (d p_e - p . d p) + aux_scale 2 c_z lse p_e / N   (softmax, then the z-loss)
__global__ void moe_router_backward_kernel(MoERouting r, int N, int E, int k, float alpha, float z_coef, float aux_scale) {
    int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= N) return;
    float dp[MOE_MAX_EXPERTS];
    cpu::moe_router_grad_token(r.dlogits + (size_t)t * E, dp, r.probs + (size_t)t * E, r.choice + (size_t)t * k,
                               r.dgate + (size_t)t * k, r.routed, r.lse[t], N, E, k, alpha, z_coef, aux_scale);
}

// dW_r (E, C) += dlogits^T x: one thread per weight, summing over the tokens in order (fp32, one
// rounding into the floatX gradient). E C threads of N multiply-adds: small next to the experts'.
__global__ void moe_router_weight_grad_kernel(floatX* drouter, const float* dlogits, const floatX* x, int N, int C, int E) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= E * C) return;
    int e = i / C, c = i % C;
    float s = 0.0f;
    for (int t = 0; t < N; t++) s += dlogits[(size_t)t * E + e] * to_float(x[(size_t)t * C + c]);
    drouter[i] = from_float<floatX>(to_float(drouter[i]) + s);
}

// Step 3's transpose, the un-permute: dx_t = the dx rows of t's kept choices (first choice first)
// + sum_e dlogits_t,e W_r,e (the router's path to its input), overwritten. Gather, not scatter: each
// token reads its own k rows, so no two threads write one place and no atomics are needed.
__global__ void moe_unpermute_kernel(floatX* dx, const floatX* dxg, const int* row, const float* dlogits, const floatX* router,
                                     int N, int C, int E, int k) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    int t = (int)(i / C), c = (int)(i % C);
    if (t >= N) return;
    float acc[x128::size];
    moe_sum_rows(acc, dxg, row, nullptr, t, k, C, c);
    float router_dx[x128::size] = {};
    for (int e = 0; e < E; e++) {
        float dz = dlogits[(size_t)t * E + e];
        x128 w = load128(router + (size_t)e * C + c);
        for (int v = 0; v < x128::size; v++) router_dx[v] += dz * to_float(w[v]);
    }
    x128 out;
    for (int v = 0; v < x128::size; v++) out[v] = from_float<floatX>(acc[v] + router_dx[v]);
    store128(dx + i, out);
}

// ---------------------------------------------------------------------------------------------
// Host side. What the shape allows: the table's row (llmc/run/compatibility.h), with these kernels' limits.
inline std::string moe_gpu_shape_problem(const cpu::MoEShape& s, int C) { return moe_gpu_kernels_problem(s, C); }

// Steps 1 and 2 and the auxiliary losses: route x (N, C), assign rows, drop over capacity.
inline void moe_route_dispatch(MoERouting r, const cpu::MoEShape& s, const floatX* x, const floatX* router, int N, int C,
                               cudaStream_t stream) {
    int E = s.experts, k = s.top_k;
    moe_route_kernel<<<ceil_div(N, MOE_ROUTE_WARPS), 32 * MOE_ROUTE_WARPS, 0, stream>>>(r, x, router, N, C, E, k);
    CUDA_CHECK_LAUNCH();
    moe_dispatch_kernel<<<1, MOE_SCAN_THREADS, 0, stream>>>(r, N, E, k, cpu::moe_capacity(N, k, E, s.capacity_factor));
    CUDA_CHECK_LAUNCH();
    moe_losses_kernel<<<1, 256, 0, stream>>>(r, N, E, k, s.aux_alpha, s.z_loss);
    CUDA_CHECK_LAUNCH();
}

// The experts' row ranges, for the host to launch one matmul per expert: first_row (E+1), copied
// back. The one synchronisation of the layer (see the lesson).
inline std::vector<int> moe_read_rows(const MoERouting& r, int E, cudaStream_t stream) {
    std::vector<int> first_row(E + 1);
    CUDA_CHECK(cudaMemcpyAsync(first_row.data(), r.first_row, (E + 1) * sizeof(int), cudaMemcpyDeviceToHost, stream));
    CUDA_CHECK(cudaStreamSynchronize(stream));
    return first_row;
}

inline void moe_gather(floatX* xg, const floatX* x, const MoERouting& r, int E, int N, int k, int C, cudaStream_t stream) {
    size_t vectors = (size_t)k * N * C / x128::size;
    moe_gather_kernel<<<ceil_div(vectors, 256), 256, 0, stream>>>(xg, x, r.token_of_row, r.first_row, E, k * N, C);
    CUDA_CHECK_LAUNCH();
}

inline void moe_combine(floatX* y, const floatX* eout, const MoERouting& r, int N, int k, int C, cudaStream_t stream) {
    moe_combine_kernel<<<ceil_div((size_t)N * C / x128::size, 256), 256, 0, stream>>>(y, eout, r.row, r.gate, N, C, k);
    CUDA_CHECK_LAUNCH();
}

// The experts' forward over their rows: per expert with rows, the dense MLP's three calls.
inline void moe_experts_forward(MatmulContext* ctx, const cpu::MoEWeights<const floatX>& w, const std::vector<int>& first_row,
                                int C, int H, const floatX* xg, floatX* fch, floatX* fch_gelu, floatX* eout, cudaStream_t stream) {
    for (int e = 0; e + 1 < (int)first_row.size(); e++) {
        size_t r0 = first_row[e];
        int n = first_row[e + 1] - first_row[e];
        if (n == 0) continue;   // no token reached this expert: no launch, and its gradient stays as it was
        cpu::Expert<const floatX> p = cpu::expert_of(w, e, C, H);
        matmul_forward(ctx, fch + r0 * H, xg + r0 * C, p.fcw, p.fcb, n, C, H, stream);
        gelu_forward(fch_gelu + r0 * H, fch + r0 * H, (size_t)n * H, stream);
        matmul_forward(ctx, eout + r0 * C, fch_gelu + r0 * H, p.projw, p.projb, n, H, C, stream);
    }
}

// Their backward: dxg's rows from drow's; the weights' gradients added to g's experts. dh (kN, H)
// scratch; partials: bias_backward's (llmc/kernels/scratch_sizes.h, for kN rows of H).
inline void moe_experts_backward(MatmulContext* ctx, const cpu::MoEWeights<floatX>& g, const cpu::MoEWeights<const floatX>& w,
                                 const std::vector<int>& first_row, int C, int H, const floatX* drow, const floatX* xg,
                                 const floatX* fch, const floatX* fch_gelu, floatX* dh, floatX* dxg, float* partials,
                                 cudaStream_t stream) {
    for (int e = 0; e + 1 < (int)first_row.size(); e++) {
        size_t r0 = first_row[e];
        int n = first_row[e + 1] - first_row[e];
        if (n == 0) continue;
        cpu::Expert<const floatX> p = cpu::expert_of(w, e, C, H);
        cpu::Expert<floatX> dp = cpu::expert_of(g, e, C, H);
        const floatX* d = drow + r0 * C;
        floatX* dhe = dh + r0 * H;
        matmul_backward_data(ctx, dhe, d, p.projw, n, H, C, stream);
        matmul_backward_weight(ctx, dp.projw, d, fch_gelu + r0 * H, n, H, C, stream);
        bias_backward(dp.projb, partials, d, n, C, stream);
        gelu_backward_inplace(dhe, fch + r0 * H, (size_t)n * H, stream);
        matmul_backward_data(ctx, dxg + r0 * C, dhe, p.fcw, n, C, H, stream);
        matmul_backward_weight(ctx, dp.fcw, dhe, xg + r0 * C, n, C, H, stream);
        bias_backward(dp.fcb, partials, dhe, n, H, stream);
    }
}

inline void moe_backward_rows(floatX* drow, const floatX* dy, const floatX* eout, const MoERouting& r, int N, int k, int C,
                              cudaStream_t stream) {
    moe_backward_rows_kernel<<<ceil_div((size_t)N * k, MOE_ROUTE_WARPS), 32 * MOE_ROUTE_WARPS, 0, stream>>>(
        drow, r.dgate, dy, eout, r.row, r.gate, N, C, k);
    CUDA_CHECK_LAUNCH();
}

// The router's backward and the un-permute: dx (N, C) overwritten, drouter (E, C) added to.
// aux_scale = d(optimised loss) / d(L_aux + L_z), as cpu::moe_backward's.
inline void moe_backward_input(floatX* dx, floatX* drouter, const MoERouting& r, const cpu::MoEShape& s, const floatX* x,
                               const floatX* router, const floatX* dxg, int N, int C, float aux_scale, cudaStream_t stream) {
    int E = s.experts, k = s.top_k;
    moe_router_backward_kernel<<<ceil_div(N, 128), 128, 0, stream>>>(r, N, E, k, s.aux_alpha, s.z_loss, aux_scale);
    CUDA_CHECK_LAUNCH();
    moe_router_weight_grad_kernel<<<ceil_div((size_t)E * C, 256), 256, 0, stream>>>(drouter, r.dlogits, x, N, C, E);
    CUDA_CHECK_LAUNCH();
    moe_unpermute_kernel<<<ceil_div((size_t)N * C / x128::size, 256), 256, 0, stream>>>(dx, dxg, r.row, r.dlogits, router, N, C, E, k);
    CUDA_CHECK_LAUNCH();
}
