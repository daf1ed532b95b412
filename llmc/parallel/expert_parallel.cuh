// expert_parallel.cuh — --expert-parallel N on the GPU trainer: each MoE block's experts split over N
// GPUs of the data-parallel group, the tokens' rows sent to their expert's GPU and back over NCCL.
// Read llmc/parallel/expert_parallel.h first: the lesson (why an all-to-all, the bytes, who owns
// which expert, the sums, the norm, the files) and the host-side plan (ExpertParallelPlan: the
// counts, where each received block lands) are there, shared. This file adds only what a GPU adds.
//
// What it teaches: an all-to-all on NCCL, which has none. NCCL has point-to-point sends and receives
// (ncclSend / ncclRecv, since 2.7); an all-to-all is N-1 sends and N-1 receives issued between
// ncclGroupStart and ncclGroupEnd, so that NCCL launches them together as one kernel and every pair
// progresses at once (issued one by one, a rank's first send would wait for a peer that is itself
// waiting to send). An uneven all-to-all (MPI's Alltoallv) is the same with a count per peer, so the
// counts must be known on both sides first:
//   counts    each rank's rows per expert (from its routing, on the host after moe_read_rows' wait)
//             go to the experts' owners: an all-to-all of E / N ints a pair (gpu_all_to_all)
//   rows      the grouped sends and receives, a block per peer, bf16 rows of C values; a pair with
//             nothing to send posts nothing, on both sides (both know the count: no NCCL call with
//             count 0); this rank's own block is a device-to-device copy
//   order     the received blocks are in source order; cudaMemcpyAsync copies put them expert-major
//             (ep_for_each_block, the CPU's reorder), so each owned expert's rows are contiguous and
//             one matmul call runs it (moe.cuh's moe_experts_forward with a row range per expert:
//             empty for the experts this rank does not own)
// The combine is the same exchange with the counts transposed (what came in goes back), and the
// backward is the transpose of the forward: the output gradients out along the dispatch's path, the
// input gradients back along the combine's.
//
// Streams: the exchanges run on the expert group's communication stream; the compute stream's rows
// must be written before NCCL reads them, so the host synchronises the compute stream first, and
// waits for the exchange before the compute stream reads what arrived (two host waits an exchange,
// four a block and pass: the MoE block already waits once for its row counts, moe_gpu.cuh).
// Overlapping the exchange with the experts' matmuls is what a faster version would do next.
//
// Memory (llmc/memory/gpu_buffers.h's ep_* rows): an owner may receive N k B T rows (every rank's
// every choice for its experts), so per MoE block N k B T x (2C + 2 x 4C) rows kept for the backward
// (x, fc, GELU, out), the staging and the backward's rows (3C + 4C) once: at a small C these outweigh
// the experts saved, as on the CPU (docs/moe.md).
// Sums: the routers over the whole data group, each rank's held experts over their replicas only
// (ep_gpu_sum_gradients), as expert_parallel.h says; the norm counts each expert once (train_gpt.cu's
// finish_gradients). Files: the whole table gathered on rank 0 on the host (expert_parallel.h's
// ep_gather_table over the expert group's MPI communicator), so a checkpoint is the same at any degree.
//
// Needs one GPU per rank (NCCL: host-staged ranks sharing a GPU are refused) and --zero 0; the other
// combinations are refused by rows of llmc/run/compatibility.h, one line each.
//
// Hook points: the MLP hook of train_gpt.cu (mlp_forward / mlp_backward) at an MoE layer, through
// llmc/model/moe_gpu.cuh's moe_mlp_forward / moe_mlp_backward: between moe_gpu_block_route and
// moe_gpu_block_combine (forward) and between moe_gpu_block_backward_rows and
// moe_gpu_block_backward_input (backward), in place of the local experts; the MoE gradient group of
// finish_gradients (ep_gpu_sum_gradients).
#pragma once

#include <vector>
#include "llmc/kernels/moe.cuh"
#include "llmc/parallel/comm_nccl.cuh"
#include "llmc/parallel/expert_parallel.h"

struct ExpertParallelGpu {
    bool on = false;
    int ranks = 1, rank = 0, El = 0;          // N_ep, this rank's place in its expert group, E / N_ep
    int E = 0, C = 0, H = 0;
    size_t R = 0;                             // rows an owner may receive: N_ep k N
    Comm group_host, replicas_host;           // the expert group and the replicas of this rank's experts (MPI)
    GpuComm group, replicas;                  // ... on the GPU (NCCL communicators split from the world's)
    std::vector<cpu::ExpertParallelPlan> plans;     // per MoE block: the micro-batch's exchange
    std::vector<std::vector<int>> owned_rows;       // per MoE block: (E + 1) row ranges of the received rows by expert
    std::vector<floatX*> rows;                      // per MoE block: x, fch, fch_gelu, out (R rows of C, H, H, C)
    floatX *staging = nullptr, *dout = nullptr, *dh = nullptr, *dx = nullptr;  // (R, C), (R, C), (R, H), (R, C)
    int* counts = nullptr;                          // (2E): the count exchange's send and receive halves
};

// The groups: N consecutive data-parallel ranks form an expert group; the ranks at the same place of
// every group hold the same experts (their replicas). The data group is the world (MoE trains with
// data parallelism only). Collective over the world: every rank calls it.
inline void ep_gpu_connect(ExpertParallelGpu* x, Comm* world, GpuComm* world_gpu, int dp_rank, int ranks) {
    x->on = true;
    x->ranks = ranks;
    x->rank = dp_rank % ranks;
    comm_split(world, dp_rank / ranks, x->rank, &x->group_host, "creating the expert groups");
    comm_split(world, x->rank, dp_rank / ranks, &x->replicas_host, "creating the groups of expert replicas");
    gpu_comm_init_group(&x->group, world_gpu, &x->group_host, dp_rank / ranks, x->rank, "creating the expert groups on the GPU");
    gpu_comm_init_group(&x->replicas, world_gpu, &x->replicas_host, x->rank, dp_rank / ranks,
                        "creating the groups of expert replicas on the GPU");
}

// Points the exchange into its rows of the buffer table (ep_rows: Lm blocks of R (2C + 2H); ep_scratch:
// R (3C + H); ep_counts: 2E ints).
inline void ep_gpu_init(ExpertParallelGpu* x, int blocks, int experts, int top_k, int N, int C, floatX* rows, floatX* scratch,
                        int* counts) {
    x->E = experts, x->C = C, x->H = 4 * C, x->El = experts / x->ranks;
    x->R = (size_t)x->ranks * top_k * N;
    x->plans.assign((size_t)blocks, cpu::ExpertParallelPlan{});
    for (cpu::ExpertParallelPlan& p : x->plans) cpu::ep_plan_allocate(&p, x->ranks, experts);
    x->owned_rows.assign((size_t)blocks, std::vector<int>((size_t)experts + 1, 0));
    x->rows.assign((size_t)blocks, nullptr);
    for (int b = 0; b < blocks; b++) x->rows[(size_t)b] = rows + (size_t)b * x->R * (2 * C + 2 * x->H);
    x->staging = scratch;
    x->dout = scratch + x->R * C;
    x->dx = scratch + 2 * x->R * C;
    x->dh = scratch + 3 * x->R * C;
    x->counts = counts;
}

// The uneven all-to-all of rows (comm.h's comm_all_to_all_v): block q of `send` (send_counts[q]
// values, the blocks back to back) to rank q, block s of `recv` from rank s. Waits for it.
inline void ep_gpu_all_to_all_v(GpuComm* g, const floatX* send, const std::vector<int>& send_counts, floatX* recv,
                                const std::vector<int>& recv_counts, const char* what) {
    int N = g->host->world_size, me = g->host->rank;
    std::vector<size_t> sat((size_t)N + 1, 0), rat((size_t)N + 1, 0);
    for (int q = 0; q < N; q++) {
        sat[(size_t)q + 1] = sat[(size_t)q] + (size_t)send_counts[(size_t)q];
        rat[(size_t)q + 1] = rat[(size_t)q] + (size_t)recv_counts[(size_t)q];
    }
    if (send_counts[(size_t)me] > 0)  // my own block: a copy (before the group: a group holds NCCL calls only)
        GPU_COMM_CUDA(g, cudaMemcpyAsync(recv + rat[(size_t)me], send + sat[(size_t)me], (size_t)send_counts[(size_t)me] * sizeof(floatX),
                                         cudaMemcpyDeviceToDevice, g->stream), what);
    uint64_t out = 0;
    gpu_group_begin(g, what);
    for (int q = 0; q < N; q++) {
        if (q == me) continue;
        if (send_counts[(size_t)q] > 0) {
            GPU_COMM_NCCL(g, ncclSend(send + sat[(size_t)q], (size_t)send_counts[(size_t)q], NCCL_FLOATX, q, g->nccl, g->stream), what);
            out += (uint64_t)send_counts[(size_t)q] * sizeof(floatX);
        }
        if (recv_counts[(size_t)q] > 0)
            GPU_COMM_NCCL(g, ncclRecv(recv + rat[(size_t)q], (size_t)recv_counts[(size_t)q], NCCL_FLOATX, q, g->nccl, g->stream), what);
    }
    gpu_group_end(g, what);
    gpu_count(g, COMM_ALL_TO_ALL, out);
    gpu_comm_wait(g, what);
}

// Staging (source order) <-> expert-major, on the compute stream.
inline void ep_gpu_reorder(const ExpertParallelGpu& x, const cpu::ExpertParallelPlan& p, const floatX* from, floatX* to,
                           bool to_expert_major, cudaStream_t s) {
    cpu::ep_for_each_block(p, x.ranks, x.C, [&](size_t staged, size_t at, size_t n) {
        if (n == 0) return;
        size_t src = to_expert_major ? staged : at, dst = to_expert_major ? at : staged;
        CUDA_CHECK(cudaMemcpyAsync(to + dst, from + src, n * sizeof(floatX), cudaMemcpyDeviceToDevice, s));
    });
}

// Forward of MoE block b's experts on their owners: xg (this rank's rows grouped by expert, first_row:
// moe_gpu_block_route's) out to the owners, the owned experts run on what came in, eout's rows back.
inline void ep_gpu_experts_forward(ExpertParallelGpu* x, MatmulContext* ctx, int b, const cpu::MoEWeights<const floatX>& w,
                                   const std::vector<int>& first_row, const floatX* xg, floatX* eout, cudaStream_t s) {
    cpu::ExpertParallelPlan& p = x->plans[(size_t)b];
    int C = x->C, H = x->H, El = x->El;
    size_t n = (size_t)x->ranks * El;
    // the counts first: my rows for each expert to its owner; the owner learns its rows per source
    cpu::ep_plan_sends(&p, first_row.data(), x->E, x->ranks, C);
    GpuComm* g = &x->group;
    GPU_COMM_CUDA(g, cudaMemcpyAsync(x->counts, p.send_rows.data(), n * sizeof(int), cudaMemcpyHostToDevice, g->stream),
                  "the MoE row counts");
    gpu_all_to_all(g, x->counts, x->counts + n, (size_t)El * sizeof(int), "all-to-all of the MoE row counts");
    GPU_COMM_CUDA(g, cudaMemcpyAsync(p.recv_rows.data(), x->counts + n, n * sizeof(int), cudaMemcpyDeviceToHost, g->stream),
                  "the MoE row counts");
    gpu_comm_wait(g, "all-to-all of the MoE row counts");
    cpu::ep_arrange(&p, x->ranks, C);
    // the rows (xg is written: moe_read_rows synchronised the compute stream)
    ep_gpu_all_to_all_v(g, xg, p.send_floats, x->staging, p.recv_floats, "all-to-all of the MoE rows to their experts");
    floatX *xr = x->rows[(size_t)b], *fch = xr + x->R * C, *fch_gelu = fch + x->R * H, *out = fch_gelu + x->R * H;
    ep_gpu_reorder(*x, p, x->staging, xr, true, s);
    // my experts' row ranges among the received rows; the others' are empty (no launch for them)
    std::vector<int>& owned = x->owned_rows[(size_t)b];
    for (int e = 0; e <= x->E; e++) {
        int j = e - x->rank * El;
        owned[(size_t)e] = j <= 0 ? 0 : j >= El ? p.rows : p.expert_row[(size_t)j];
    }
    moe_experts_forward(ctx, w, owned, C, H, xr, fch, fch_gelu, out, s);
    // the outputs home: the reverse exchange, each block as many rows as came in
    ep_gpu_reorder(*x, p, out, x->staging, false, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    ep_gpu_all_to_all_v(g, x->staging, p.recv_floats, eout, p.send_floats, "all-to-all of the MoE outputs to their tokens");
}

// Backward, the transpose: drow's rows (gate x dy, moe_gpu_block_backward_rows') out to the owners,
// their input gradients back into dxg; the owned experts' weight gradients added to gw. partials:
// bias_backward's scratch (sized for N_ep B T rows: gpu_buffers.h).
inline void ep_gpu_experts_backward(ExpertParallelGpu* x, MatmulContext* ctx, int b, const cpu::MoEWeights<floatX>& gw,
                                    const cpu::MoEWeights<const floatX>& w, const floatX* drow, floatX* dxg, float* partials,
                                    cudaStream_t s) {
    const cpu::ExpertParallelPlan& p = x->plans[(size_t)b];
    int C = x->C, H = x->H;
    GpuComm* g = &x->group;
    CUDA_CHECK(cudaStreamSynchronize(s));  // (drow written on the compute stream)
    ep_gpu_all_to_all_v(g, drow, p.send_floats, x->staging, p.recv_floats, "all-to-all of the MoE output gradients to their experts");
    ep_gpu_reorder(*x, p, x->staging, x->dout, true, s);
    floatX *xr = x->rows[(size_t)b], *fch = xr + x->R * C, *fch_gelu = fch + x->R * H;
    moe_experts_backward(ctx, gw, w, x->owned_rows[(size_t)b], C, H, x->dout, xr, fch, fch_gelu, x->dh, x->dx, partials, s);
    ep_gpu_reorder(*x, p, x->dx, x->staging, false, s);
    CUDA_CHECK(cudaStreamSynchronize(s));
    ep_gpu_all_to_all_v(g, x->staging, p.recv_floats, dxg, p.send_floats, "all-to-all of the MoE input gradients to their tokens");
}

// The MoE table's gradient summed over what shares it (expert_parallel.h's ep_sum_gradients): the
// routers (the table's first `router` values) over every data-parallel rank, the held experts over
// their replicas (`experts`: their count padded to a multiple of the replicas, gpu_buffers.h's
// moe_grads row). With N_ep = the data group each expert has one holder: nothing to sum. Summing the
// experts over the whole group would add other experts' gradients into them (each rank's table is
// different experts now).
inline void ep_gpu_sum_gradients(ExpertParallelGpu* x, GpuComm* data, floatX* grads, size_t router, size_t experts, cudaStream_t s) {
    CUDA_CHECK(cudaStreamSynchronize(s));  // (the last backward wrote them on the compute stream)
    gpu_all_reduce_identical(data, grads, router, NCCL_FLOATX, "all-reduce of the MoE routers' gradients");
    gpu_all_reduce_identical(&x->replicas, grads + router, experts, NCCL_FLOATX,
                             "all-reduce of the experts' gradients over their replicas");
    gpu_comm_wait(data, "all-reduce of the MoE routers' gradients");
    gpu_comm_wait(&x->replicas, "all-reduce of the experts' gradients over their replicas");
}

inline void ep_gpu_finalize(ExpertParallelGpu* x) {
    if (!x->on) return;
    gpu_comm_finalize(&x->replicas);
    gpu_comm_finalize(&x->group);
}
