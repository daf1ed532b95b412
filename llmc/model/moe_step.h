// moe_step.h — the MoE table in the CPU trainer's step (--moe-experts, docs/moe.md): its gradient
// group (the sum over the ranks that share each part of it, and its share of the gradient norm) and
// its AdamW, the two places train_gpt_cpu.cpp's step hooks call for it.
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

namespace cpu {

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
