// moe_step.h — MoE in the CPU trainer's passes and step (--moe-experts, docs/moe.md): an MoE block's
// forward and backward as train_gpt_cpu.cpp's mlp_forward / mlp_backward hooks run them (with
// --expert-parallel's exchange), the MoE table's gradient group (the sum over the ranks that share
// each part of it, and its share of the gradient norm) and its AdamW.
//
// What it teaches. The MoE table (llmc/model/model.h: the routers and experts 1 .. E-1; expert 0 of
// a block is its MLP in the flat array) is a parameter group of its own: each rank routed its own
// tokens, so its gradient is summed over the data-parallel ranks like the dense model's, except
// that with --expert-parallel (llmc/parallel/expert_parallel.h) a rank holds its experts only, whose
// gradient is summed over their replicas alone (the routers still over every rank). The norm must
// count each summed value once: rank 0 counts its table, the rest of expert group 0 adds its
// experts (the other groups hold replicas); with --zero 1|2 every rank counts its shards, which
// cover the table once over the ranks that share it. AdamW then updates the table whole, or with
// --zero 1|2 this rank's shard of each shared part (its moments stored at the part's `stored`).
//
// The order of the sums is the one the trainer had when this code lived in its step: the norm's
// squares are added after the dense part's, so that with one expert (whose router gradient is
// exactly 0) the norm is the dense model's bits. (CPU trainer only; the GPU's is moe_zero.cuh.)
#pragma once

#include <algorithm>
#include <vector>
#include "llmc/model/model.h"
#include "llmc/optim/adamw.h"
#include "llmc/parallel/comm.h"
#include "llmc/parallel/expert_parallel.h"
#include "llmc/run/moe_run.h"  // MoEStepStats

namespace cpu {

// The weights of MoE block b as llmc/model/moe.h takes them: expert 0 is the block's MLP in the flat
// array (w: its unit's view), the router and the other experts are in the MoE table. The same for
// their gradients (g, the MoE table's gradient).
template <typename T>
inline MoEWeights<T> moe_block_weights(const ParamTensors<float>& w, float* table, const MoELayout& layout, int b) {
    return {moe_tensor(table, layout, MOE_ROUTER, b), w[FCW], w[FCB], w[FCPROJW], w[FCPROJB],
            moe_tensor(table, layout, MOE_FCW, b), moe_tensor(table, layout, MOE_FCB, b),
            moe_tensor(table, layout, MOE_FCPROJW, b), moe_tensor(table, layout, MOE_FCPROJB, b),
            layout.first_expert};  // (--expert-parallel: the table holds this rank's experts only)
}

// An MoE block's forward in the MLP's place: y (N, C) = the experts' mixture of x, its statistics
// added to the step's. `ep` null: every rank runs every expert; else (--expert-parallel) route here,
// the experts on their owners (b: the block's exchange state), combine here.
inline void moe_block_forward(float* y, MoEActivations* a, const MoEShape& shape, const MoEWeights<const float>& mw,
                              const float* x, int N, Comm* ep, ExpertParallelBlock* b, MoEStepStats* stats) {
    a->N = N;  // sized for max_B x max_T; an evaluation or a sample may route fewer tokens
    MoEStats st;
    if (!ep) {
        st = moe_forward(y, a, shape, mw, x);
    } else {
        moe_forward_route(a, shape, mw, x);
        ep_experts_forward(b, ep, a, shape, mw);
        st = moe_forward_combine(y, a, shape);
    }
    moe_stats_add(stats, st.aux_loss, st.z_loss, st.dropped, st.min_load, st.max_load);
}

// Its backward: the experts' and the router's gradients added, d(x) into dx. aux_scale:
// d(optimised loss)/d(this micro-batch's L_aux + L_z). --expert-parallel: the transpose of the
// forward's exchange.
inline void moe_block_backward(float* dx, const MoEWeights<float>& mg, MoEActivations* a, const MoEShape& shape,
                               const MoEWeights<const float>& mw, const float* x, const float* dout, float aux_scale, Comm* ep,
                               ExpertParallelBlock* b) {
    if (!ep) {
        moe_backward(dx, mg, a, shape, mw, x, dout, aux_scale);
        return;
    }
    moe_backward_rows(a, shape, dout);
    ep_experts_backward(b, ep, a, mg, mw);
    moe_backward_input(dx, mg, a, shape, mw, x, aux_scale);
}

// The table's gradient summed over what shares it: in bf16 (--grad-compression bf16), each rank its
// shard of the sum (--zero 1|2: the update shares the weights after), the routers over every rank
// and the experts over their replicas (--expert-parallel), or whole over the data-parallel ranks.
inline void moe_table_sum(MoESharing* zero, const MoESharing& bf16, bool expert_parallel, Comm* dp, Comm* replicas, int dp_ranks,
                          std::vector<float>* grads, size_t router, std::vector<float>* scratch) {
    if (!bf16.segments.empty())
        moe_bf16_sum(bf16, grads->data(), scratch);
    else if (!zero->segments.empty())
        moe_zero_reduce(zero, grads->data(), scratch);
    else if (expert_parallel)
        ep_sum_gradients(dp, replicas, grads->data(), router, grads->size(), scratch);
    else if (!grads->empty() && dp_ranks > 1)
        comm_allreduce_sum_identical(dp, grads->data(), grads->size(), scratch, "all-reduce of the MoE table's gradients");
}

// The table's share of the squared gradient norm, added to `squares` (each summed value once over
// the world): --zero 1|2 every rank its shards; else rank 0 its whole table (`world_rank` 0), the
// other members of expert group 0 (`counts`: dp rank below the group's size) their experts only.
inline void moe_table_squares(const MoESharing& zero, const std::vector<float>& grads, size_t router, int world_rank,
                              bool counts, double* squares) {
    size_t counted_from = world_rank == 0 ? 0 : router;
    for (const MoESharedPart& g : zero.segments) {
        ShardRange own = moe_zero_owned(g);
        *squares += sum_of_squares(grads.data() + own.begin, own.size());
    }
    if (zero.segments.empty() && counts && !grads.empty())
        *squares += sum_of_squares(grads.data() + counted_from, grads.size() - counted_from);
}

// AdamW on the table (this rank's held experts), decayed as llmc/model/model.h says: whole, or with
// --zero 1|2 this rank's shard of each segment (its moments stored at the segment's `stored`).
inline void moe_table_adamw(const MoELayout& ml, const MoESharing& zero, float* params, const float* grads, float* m, float* v,
                            float lr, float beta1, float beta2, float eps, float weight_decay, int t, float grad_scale) {
    for (int t2 = 0; t2 < NUM_MOE_TENSORS; t2++) {
        float wd = moe_tensor_decays(t2) ? weight_decay : 0.0f;
        size_t at = ml.offset[t2], end = at + ml.count[t2];
        if (zero.segments.empty()) {
            adamw_update(params + at, grads + at, m + at, v + at, ml.count[t2], lr, beta1, beta2, eps, wd, t, grad_scale);
            continue;
        }
        for (const MoESharedPart& g : zero.segments) {
            ShardRange own = moe_zero_owned(g);
            size_t lo = std::max(at, own.begin), hi = std::min(end, own.end), state = g.stored + (lo - own.begin);
            if (lo < hi)
                adamw_update(params + lo, grads + lo, m + state, v + state, hi - lo, lr, beta1, beta2, eps, wd, t, grad_scale);
        }
    }
}

}  // namespace cpu
