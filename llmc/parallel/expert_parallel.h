// expert_parallel.h — expert parallelism (--expert-parallel N): the experts of every MoE block split
// across N ranks of the data-parallel group, the tokens sent to their expert's rank and back.
//
// What it teaches: why mixture-of-experts layers are trained with an all-to-all. Data parallelism
// gives every rank the whole layer and its own tokens; with E experts the experts' matmuls are spread
// thin (each rank runs all E on few rows). Expert parallelism (GShard, Lepikhin et al. 2020; Switch,
// Fedus et al. 2021) gives each rank E/N experts and brings it every token that chose them: each rank
// routes its own tokens (llmc/model/moe.h), then
//   dispatch   a first all-to-all of the counts (how many rows for each of the receiver's experts),
//              then MPI_Alltoallv of the rows themselves (the LayerNorm's output, C floats each)
//   experts    the owner runs each of its experts over the rows it received, in a fixed order: by
//              expert, then source rank, then the source's own (token) order, so the result does not
//              depend on which message came first
//   combine    the reverse all-to-all returns the outputs to the token's rank, which adds them with
//              their gates as on one rank
// The backward is the transpose: the output gradients (gate x dy) go out along the dispatch's path,
// the input gradients come back along the combine's. An all-to-all, not an all-gather, because each
// row is wanted by one rank only: every rank sends k N rows and receives about as many, and no rank
// is a hub (the parameter server's lesson, llmc/parallel/parameter_server.h).
//
// Bytes per MoE block per micro-batch, this rank's N tokens, top-k, C channels, fp32, no dropping:
//   forward   k N C 4 out (dispatch) + k N C 4 back (combine), of which the share (N_ep - 1)/N_ep
//   backward  the same again            leaves the rank when the router spreads evenly
// so 2 x k x N x C x 4 bytes each way forward and backward, plus N_ep ints of counts per expert.
// Load imbalance: the router decides the rows, so an owner may receive anything from 0 to N_ep k N
// rows; the buffers below are sized for the worst (N_ep k N rows), and the step waits for the most
// loaded rank. The capacity factor (moe.h) bounds it: each rank drops its own overflow before the
// dispatch (per source rank, GShard's per-group capacity), so an owner receives at most N_ep x cap
// rows per expert.
//
// Choices, to keep it simple:
//   ownership  rank q of the expert group runs experts q E/N_ep .. (q+1) E/N_ep - 1. Expert 0 (the
//              block's dense MLP, in the dense table) is group 0's like any other: its gradient is
//              zero on the other ranks, so the dense table's all-reduce over every rank sums exactly
//              its owners' contributions.
//   weights    each rank holds only its experts (the memory half): the MoE table (llmc/model/model.h)
//              on rank q of a group is every block's router, whole, then experts
//              max(1, q E/N_ep) .. (q+1) E/N_ep - 1 of each block, each tensor stacked as in the
//              whole table, thinner: router (Lm, E, C) | fcw (Lm, held, 4C, C) | fcb (Lm, held, 4C) |
//              fcprojw (Lm, held, C, 4C) | fcprojb (Lm, held, C). Rank 0 holds one expert fewer (its
//              expert 0 is the dense table's). Its gradient and AdamW m and v have the same layout, so
//              per rank the experts' bytes fall by N_ep (weights, gradients, moments: 16 bytes a value);
//              the routers (E C a block) and the dense table stay whole on every rank.
//   sums       the dense table (expert 0 among it) and the routers: summed over all data-parallel
//              ranks, as without experts (every rank routes its own tokens). An expert's gradient:
//              summed over its replicas only, the ranks of the same place q in every expert group (an
//              all-reduce in a second group, `replicas`, built once beside `ep`). Summing it over every
//              rank would add other experts' gradients into it: each rank's table is a different
//              expert's now. Bytes per step and rank: the routers' all-reduce over D ranks, the held
//              experts' over D/N_ep (none at N_ep = D).
//   norm       each expert counted once: the ranks of expert group 0 add their experts' squares (rank
//              0 the routers' too); the other groups' replicas hold the same sums and add nothing.
//   files      one layout at any N_ep: the model file and moe_state.bin hold the whole table, gathered
//              on rank 0 from expert group 0 at each checkpoint (for a moment three whole tables
//              there: weights, m, v; the other ranks send their slice); loading reads the whole table
//              and keeps the held runs. So an EP 2 checkpoint resumes at EP 1 or 4, and one rank's at EP 2.
//   exchange   the buffers below are sized once for the worst case, N_ep k N rows of 17 C floats per
//              MoE block (llmc/memory/cpu_buffers.h's ep_exchange row): at a small C they can outweigh
//              the experts saved (docs/moe.md measures both).
//   groups     the N_ep consecutive data-parallel ranks dp_rank / N_ep form one expert group.
//
//   ZeRO      --zero 1 or 2 shards the MoE table's AdamW moments like the dense table's (llmc/parallel/
//              zero.h), each over the ranks that hold the same values: with --expert-parallel the
//              routers over every data-parallel rank and the held experts over their replicas; without
//              it the whole table over every rank. The table's all-reduce is a reduce-scatter and an
//              all-gather already (comm_allreduce_sum_identical); ZeRO runs AdamW between its halves,
//              each rank on its shard of the summed gradient, and all-gathers the updated weights
//              instead of the gradient: the same bytes, m and v divided by the group's size. The
//              gradient stays whole (also at --zero 2: the table is not in the units the backward
//              reduces), so only the moments shrink. Files keep one layout: the checkpoint gathers the
//              moments whole, a resume keeps its shard, so any degree resumes any other.
//   bf16      --grad-compression bf16 sums the table over the same groups with the dense table's
//              bf16 exchange (llmc/parallel/grad_compression.h): half the table's bytes.
//
// Hook points: around the experts of llmc/model/moe.h (moe_forward_route | experts | moe_forward_combine,
// and the backward's three parts), called from train_gpt_cpu.cpp's MoE block in place of the local loop.
// The GPU trainer's twin, expert_parallel.cuh, moves the rows with NCCL by the same ExpertParallelPlan.
#pragma once

#include <vector>
#include "llmc/model/model.h"  // the MoE table's layout: which experts a rank holds
#include "llmc/model/moe.h"
#include "llmc/parallel/comm.h"
#include "llmc/parallel/grad_compression.h"  // bf16_sum_over
#include "llmc/parallel/sharding.h"  // ShardRange
#include "llmc/probes/poison.h"  // tests only: fresh rows as NaN

namespace cpu {

// The exchange's plan, host-side and the same on both trainers (expert_parallel.cuh moves the rows
// with NCCL by it): how many rows go to and come from each rank, for which expert, and where they
// land. Rows received are stored expert-major (expert, source rank, token order).
struct ExpertParallelPlan {
    int local_experts = 0, rows = 0;     // E / N_ep; rows received this micro-batch
    std::vector<int> send_rows, recv_rows;   // (N_ep * local_experts): rows to / from each rank for each of ITS / MY experts
    std::vector<int> send_floats, recv_floats;  // (N_ep): values (rows x C) in each rank's block of the row all-to-all
    std::vector<int> expert_row;             // (N_ep * local_experts): where each received block starts, expert-major (ep_arrange)
};

inline void ep_plan_allocate(ExpertParallelPlan* p, int ranks, int experts) {
    p->local_experts = experts / ranks;
    for (std::vector<int>* v : {&p->send_rows, &p->recv_rows, &p->expert_row}) v->assign((size_t)ranks * p->local_experts, 0);
    for (std::vector<int>* v : {&p->send_floats, &p->recv_floats}) v->assign((size_t)ranks, 0);
}

// What this rank sends, from its routing: its rows grouped by expert (first_row, E + 1 entries), expert
// e's to its owner e / El (as that owner's local expert e % El). Owner q's block is contiguous.
inline void ep_plan_sends(ExpertParallelPlan* p, const int* first_row, int experts, int ranks, int C) {
    int El = p->local_experts;
    for (int e = 0; e < experts; e++) p->send_rows[(size_t)e] = first_row[e + 1] - first_row[e];
    for (int q = 0; q < ranks; q++) p->send_floats[(size_t)q] = (first_row[(q + 1) * El] - first_row[q * El]) * C;
}

// Rows of my local expert j received from rank s start at expert_row[s * El + j] in the expert-major
// order; in the staging (source-major) order they follow one another by source, then expert.
inline void ep_arrange(ExpertParallelPlan* p, int ranks, int C) {
    int El = p->local_experts, r = 0;
    for (int j = 0; j < El; j++)
        for (int s = 0; s < ranks; s++) {
            p->expert_row[(size_t)s * El + j] = r;
            r += p->recv_rows[(size_t)s * El + j];
        }
    p->rows = r;
    for (int s = 0; s < ranks; s++) {
        int n = 0;
        for (int j = 0; j < El; j++) n += p->recv_rows[(size_t)s * El + j];
        p->recv_floats[(size_t)s] = n * C;
    }
}

// The copies between the staging order (source, expert, token) and the expert-major one: for each
// received block, copy(staged value offset, expert-major value offset, values). The CPU copies with
// memcpy, the GPU with cudaMemcpyAsync.
template <class Copy>
inline void ep_for_each_block(const ExpertParallelPlan& p, int ranks, int C, Copy copy) {
    int El = p.local_experts;
    size_t staged = 0;
    for (int s = 0; s < ranks; s++)
        for (int j = 0; j < El; j++) {
            size_t n = (size_t)p.recv_rows[(size_t)s * El + j] * C;
            copy(staged, (size_t)p.expert_row[(size_t)s * El + j] * C, n);
            staged += n;
        }
}

// Owner's local expert j's rows: where they start in the expert-major order and how many.
inline void ep_local_expert_rows(const ExpertParallelPlan& p, int ranks, int j, size_t* first, size_t* count) {
    int El = p.local_experts;
    *first = (size_t)p.expert_row[(size_t)j];   // (source 0's rows of expert j come first)
    *count = 0;
    for (int q = 0; q < ranks; q++) *count += (size_t)p.recv_rows[(size_t)q * El + j];
}

// What one MoE block's expert-parallel forward keeps for its backward, and the exchange's scratch
// (the CPU's: fp32 rows in host vectors).
struct ExpertParallelBlock {
    ExpertParallelPlan plan;
    std::vector<float> staging;              // (N_ep k N, C): rows in the order the all-to-all delivers them
    std::vector<float> x, fch, fch_gelu, out, dout, dh, dx;  // expert-major rows: (R, C), (R, H), (R, H), (R, C), ...
};

// The rows' sizes are fixed once: N_ep k N rows at most (every rank's every choice to one owner).
inline void ep_allocate(ExpertParallelBlock* b, int ranks, int experts, int top_k, int N, int C, int H) {
    size_t R = (size_t)ranks * top_k * N;
    ep_plan_allocate(&b->plan, ranks, experts);
    for (std::vector<float>* v : {&b->staging, &b->x, &b->out, &b->dout, &b->dx}) v->assign(R * C, 0.0f);
    for (std::vector<float>* v : {&b->fch, &b->fch_gelu, &b->dh}) v->assign(R * H, 0.0f);
    poison_fresh(&b->staging, &b->x, &b->out, &b->dout, &b->dx, &b->fch, &b->fch_gelu, &b->dh);  // tests: NaN (llmc/probes/poison.h)
}

// Copies between the staging order and the expert-major one, either way.
inline void ep_reorder(ExpertParallelBlock* b, int ranks, int C, const float* from, float* to, bool to_expert_major) {
    ep_for_each_block(b->plan, ranks, C, [&](size_t staged, size_t at, size_t n) {
        if (to_expert_major) memcpy(to + at, from + staged, n * sizeof(float));
        else memcpy(to + staged, from + at, n * sizeof(float));
    });
}

// Forward of the experts with the rows on their owners: a->xg (this rank's rows, grouped by expert in
// expert order, moe_forward_route's) out, a->eout's rows back. `ep`: this rank's expert group.
inline void ep_experts_forward(ExpertParallelBlock* b, Comm* ep, MoEActivations* a, const MoEShape& s,
                               const MoEWeights<const float>& w) {
    ExpertParallelPlan& p = b->plan;
    int ranks = ep->world_size, El = p.local_experts, C = a->C, H = a->H;
    // the counts: my rows for each expert, sent to its owner; each owner learns its rows per source
    ep_plan_sends(&p, a->first_row.data(), s.experts, ranks, C);
    comm_all_to_all(ep, p.send_rows.data(), p.recv_rows.data(), (size_t)El * sizeof(int), "all-to-all of the MoE row counts");
    ep_arrange(&p, ranks, C);
    comm_all_to_all_v(ep, a->xg.data(), p.send_floats.data(), b->staging.data(), p.recv_floats.data(),
                      "all-to-all of the MoE rows to their experts");
    ep_reorder(b, ranks, C, b->staging.data(), b->x.data(), true);
    for (int j = 0; j < El; j++) {
        int e = ep->rank * El + j;
        size_t r0, n;
        ep_local_expert_rows(p, ranks, j, &r0, &n);
        moe_expert_forward(w, e, (int)n, C, H, &b->x[r0 * C], &b->fch[r0 * H], &b->fch_gelu[r0 * H], &b->out[r0 * C]);
    }
    // the outputs home: the reverse exchange, each block as many floats as came in
    ep_reorder(b, ranks, C, b->out.data(), b->staging.data(), false);
    comm_all_to_all_v(ep, b->staging.data(), p.recv_floats.data(), a->eout.data(), p.send_floats.data(),
                      "all-to-all of the MoE outputs to their tokens");
}

// Backward, the transpose: a->drow's rows (gate x dy) out to the owners, their input gradients back
// into a->dxg; the owned experts' weight gradients added to g.
inline void ep_experts_backward(ExpertParallelBlock* b, Comm* ep, MoEActivations* a, const MoEWeights<float>& g,
                                const MoEWeights<const float>& w) {
    const ExpertParallelPlan& p = b->plan;
    int ranks = ep->world_size, El = p.local_experts, C = a->C, H = a->H;
    comm_all_to_all_v(ep, a->drow.data(), p.send_floats.data(), b->staging.data(), p.recv_floats.data(),
                      "all-to-all of the MoE output gradients to their experts");
    ep_reorder(b, ranks, C, b->staging.data(), b->dout.data(), true);
    for (int j = 0; j < El; j++) {
        int e = ep->rank * El + j;
        size_t r0, n;
        ep_local_expert_rows(p, ranks, j, &r0, &n);
        moe_expert_backward(g, w, e, (int)n, C, H, &b->dout[r0 * C], &b->x[r0 * C], &b->fch[r0 * H], &b->fch_gelu[r0 * H],
                            &b->dh[r0 * H], &b->dx[r0 * C]);
    }
    ep_reorder(b, ranks, C, b->dx.data(), b->staging.data(), false);
    comm_all_to_all_v(ep, b->staging.data(), p.recv_floats.data(), a->dxg.data(), p.send_floats.data(),
                      "all-to-all of the MoE input gradients to their tokens");
}

// The MoE table's gradient summed over what shares it: the routers (the table's first
// `router` floats) over every data-parallel rank, the held experts over their replicas.
inline void ep_sum_gradients(Comm* dp, Comm* replicas, float* grads, size_t router, size_t total, std::vector<float>* scratch) {
    comm_allreduce_sum_identical(dp, grads, router, scratch, "all-reduce of the MoE routers' gradients");
    comm_allreduce_sum_identical(replicas, grads + router, total - router, scratch,
                                 "all-reduce of the experts' gradients over their replicas");
}

// The whole table (params, a gradient, m or v) on rank 0 of expert group `ep` from every member's
// held slice: rank q sends its table, rank 0 puts its runs in place. Called by every rank of the
// group; `whole` is filled on its rank 0 only.
inline void ep_gather_table(Comm* ep, const GPT2Config& cfg, const MoEConfig& m, const float* held, size_t held_count,
                            std::vector<float>* whole) {
    MoELayout all = moe_layout(cfg, m);
    if (ep->rank != 0) {
        std::vector<CommSend> pending;
        comm_send(ep, held, held_count, 0, 0, &pending, "sending an expert slice to the checkpoint");
        comm_wait_sends(ep, &pending);
        return;
    }
    whole->assign(all.total, 0.0f);
    std::vector<float> slice;
    for (int q = 0; q < ep->world_size; q++) {
        MoELayout theirs = moe_layout(cfg, m, moe_held_experts(m, ep->world_size, q));
        const float* from = held;
        if (q > 0) {
            slice.resize(theirs.total);
            comm_recv(ep, slice.data(), slice.size(), q, 0, "receiving an expert slice for the checkpoint");
            from = slice.data();
        }
        for (const MoETableRun& r : moe_table_runs(all, theirs)) memcpy(whole->data() + r.whole, from + r.held, r.count * sizeof(float));
    }
}

// ----------------------------------------------------------------------------------------------
// Which ranks share which part of the MoE table: what --zero 1|2 shards the moments over, and what
// --grad-compression bf16 sums over. A segment of the (held) table [begin, begin + count) is the
// same on every rank of `group`; each of its N ranks owns ceil(count / N) values of it (the last
// fewer: the shards are padded, as comm_allreduce_sum_identical's, so the bytes are that all-reduce's).
struct MoESharedPart {
    Comm* group;
    size_t begin, count, shard;
    size_t stored;   // where this rank's shard starts in the moment arrays (the segments' shards in turn)
};
struct MoESharing {
    std::vector<MoESharedPart> segments;   // (GPT2::moe_zero's empty: --zero 0, every rank updates its whole held table)
};

// The segments: the whole table over `dp`, or with expert parallelism (replicas != null) the
// routers (the table's first `router` floats) over `dp` and the held experts over `replicas`.
inline MoESharing moe_sharing(Comm* dp, Comm* replicas, size_t router, size_t total) {
    MoESharing z;
    auto add = [&](Comm* g, size_t begin, size_t count) {
        size_t N = (size_t)g->world_size, stored = z.segments.empty() ? 0 : z.segments.back().stored + z.segments.back().shard;
        z.segments.push_back({g, begin, count, (count + N - 1) / N, stored});
    };
    if (replicas) add(dp, 0, router), add(replicas, router, total - router);
    else add(dp, 0, total);
    return z;
}

// This rank's part of a segment, in table positions (empty for a rank past a short segment's end).
inline ShardRange moe_zero_owned(const MoESharedPart& g) {
    size_t lo = std::min(g.count, g.shard * (size_t)g.group->rank), hi = std::min(g.count, lo + g.shard);
    return {g.begin + lo, g.begin + hi};
}

// The first half of the table's all-reduce: each rank's shard of the summed gradient, written back
// into its own place of `grads` (the rest of `grads` is left unsummed: only the owner reads a value).
inline void moe_zero_reduce(MoESharing* z, float* grads, std::vector<float>* scratch) {
    for (MoESharedPart& g : z->segments) {
        size_t N = (size_t)g.group->world_size;
        if (N == 1) continue;
        scratch->assign(g.shard * N + g.shard, 0.0f);   // (sized by the table: moe_sum_scratch)
        memcpy(scratch->data(), grads + g.begin, g.count * sizeof(float));
        float* mine = scratch->data() + g.shard * N;
        comm_reduce_scatter_sum(g.group, scratch->data(), mine, g.shard, "reduce-scatter of the MoE table's gradients");
        ShardRange o = moe_zero_owned(g);
        memcpy(grads + o.begin, mine, (o.end - o.begin) * sizeof(float));
    }
}

// The second half: every rank of each segment's group gets every owner's part of `table` (the
// updated weights; for a dump, the summed gradient).
inline void moe_zero_share(MoESharing* z, float* table, std::vector<float>* scratch) {
    for (MoESharedPart& g : z->segments) {
        size_t N = (size_t)g.group->world_size;
        if (N == 1) continue;
        scratch->assign(g.shard * N, 0.0f);
        ShardRange o = moe_zero_owned(g);
        memcpy(scratch->data() + (o.begin - g.begin), table + o.begin, (o.end - o.begin) * sizeof(float));
        comm_all_gather(g.group, scratch->data(), g.shard * sizeof(float), "all-gather of the MoE table's weights");
        memcpy(table + g.begin, scratch->data(), g.count * sizeof(float));
    }
}

// A checkpoint's moments: the held table's `whole` from every rank's shards (every rank calls).
inline void moe_zero_unshard(MoESharing* z, const float* shards, std::vector<float>* held, size_t held_count,
                             std::vector<float>* scratch) {
    held->assign(held_count, 0.0f);
    for (const MoESharedPart& g : z->segments) {
        ShardRange o = moe_zero_owned(g);
        memcpy(held->data() + o.begin, shards + g.stored, (o.end - o.begin) * sizeof(float));
    }
    moe_zero_share(z, held->data(), scratch);
}

// --grad-compression bf16 with MoE: the table's gradient summed in bf16 (grad_compression.h's
// bf16_sum_over: bf16 on the wire, fp32 sums in rank order, the sums rounded to bf16), each segment
// over the ranks that share it: the routers over every rank, the experts over their replicas only
// (an expert's gradient summed with another rank's different expert would be wrong, compressed or
// not). Half the table's bytes of the exact sum.
inline void moe_bf16_sum(const MoESharing& parts, float* grads, std::vector<float>* scratch) {
    for (const MoESharedPart& g : parts.segments) {
        size_t N = (size_t)g.group->world_size, padded = g.shard * N;
        if (N == 1) continue;
        scratch->assign(2 * padded, 0.0f);   // the padded fp32 copy, then bf16 send and receive (moe_sum_scratch)
        memcpy(scratch->data(), grads + g.begin, g.count * sizeof(float));
        bf16_sum_over(g.group, (uint16_t*)(scratch->data() + padded), scratch->data(), padded);
        memcpy(grads + g.begin, scratch->data(), g.count * sizeof(float));
    }
}

// A resume's moments: this rank's shards of the held table's.
inline void moe_zero_keep(const MoESharing& z, const float* held, float* shards) {
    for (const MoESharedPart& g : z.segments) {
        ShardRange o = moe_zero_owned(g);
        memcpy(shards + g.stored, held + o.begin, (o.end - o.begin) * sizeof(float));
    }
}

}  // namespace cpu
