// moe_run.h — what both trainers take from the --moe-* flags and say about their MoE blocks each step
// (the layer is llmc/model/moe.h): the layer's shape, and the auxiliary losses beside the LM loss, the
// assignments dropped over capacity and the loads of the least and most loaded experts, on the step
// line and in metrics.jsonl. One definition, so the CPU's and the GPU's lines and fields are the same
// text (test/test_moe_trainer.py and test/test_gpu_moe_trainer.py parse them).
#pragma once

#include <algorithm>
#include <climits>
#include <string>
#include "llmc/model/moe.h"    // MoEShape
#include "llmc/run/cli.h"      // TrainOptions, moe_capacity_factor_value
#include "llmc/run/metrics.h"  // json_number
#include "llmc/utils.h"        // strprintf

// --moe-experts: the layer's settings from the flags.
inline cpu::MoEShape moe_run_shape(const TrainOptions& o) {
    return cpu::MoEShape{o.moe_experts, o.moe_top_k, moe_capacity_factor_value(o), o.moe_aux_alpha, o.moe_z_loss};
}

// --generate: the same, with no dropping (llmc/model/moe.h's moe_forward_new_rows says why). The
// recomputing path (--kv-cache 0) runs the training forward with it, so both paths route alike.
inline cpu::MoEShape moe_generation_shape(const TrainOptions& o) {
    cpu::MoEShape s = moe_run_shape(o);
    s.capacity_factor = 0.0f;
    return s;
}

// What the MoE blocks report over one step: the auxiliary losses (summed over the blocks, averaged
// over the micro-batches and ranks as the optimised loss averages them), the dropped assignments
// (summed), and the least and most loaded expert of any block, micro-batch and rank.
struct MoEStepStats {
    double aux_loss = 0.0, z_loss = 0.0, dropped = 0.0;
    int min_load = INT_MAX, max_load = 0;
};

// One MoE block's routing of one micro-batch, into the step's.
inline void moe_stats_add(MoEStepStats* s, double aux_loss, double z_loss, int dropped, int min_load, int max_load) {
    s->aux_loss += aux_loss;
    s->z_loss += z_loss;
    s->dropped += dropped;
    s->min_load = std::min(s->min_load, min_load);
    s->max_load = std::max(s->max_load, max_load);
}

// The step's routing statistics over every micro-batch and rank (both trainers, after the passes):
// the auxiliary losses averaged (the optimised loss's weighting of them: each micro-batch's scaled by
// 1/(micro-batches x ranks)), the drops summed, the loads' extremes. Every rank calls it. A template
// over the host group (llmc/parallel/comm.h's Comm) only so that this file includes no communication
// header: llmc/model/moe_gpu.cuh includes it, and a model file includes none (docs/adding-a-technique.md).
template <typename Group>
inline void moe_step_stats(MoEStepStats* s, Group* world, int micro_batches, int dp) {
    s->aux_loss = comm_sum(world, s->aux_loss, "sum of the MoE load-balancing losses") / ((double)micro_batches * dp);
    s->z_loss = comm_sum(world, s->z_loss, "sum of the MoE z-losses") / ((double)micro_batches * dp);
    s->dropped = comm_sum(world, s->dropped, "sum of the MoE drops");
    float loads[2] = {(float)-s->min_load, (float)s->max_load};  // (counts below 2^24: exact in a float)
    comm_allreduce_max(world, loads, 2, "the MoE loads' extremes");
    s->min_load = (int)-loads[0];
    s->max_load = (int)loads[1];
}

// The step line's end, " | aux A | z Z | dropped D | load MIN..MAX" (empty for a dense model).
inline std::string moe_step_line(const MoEStepStats& s, bool moe) {
    if (!moe) return "";
    return strprintf(" | aux %.6f | z %.6f | dropped %.0f | load %d..%d", s.aux_loss, s.z_loss, s.dropped, s.min_load, s.max_load);
}

// The same numbers as metrics.jsonl's step fields (empty for a dense model).
inline std::string moe_metrics_fields(const MoEStepStats& s, bool moe) {
    if (!moe) return "";
    return strprintf(",\"moe_aux\":%s,\"moe_z\":%s,\"moe_dropped\":%.0f,\"moe_load_min\":%d,\"moe_load_max\":%d",
                     json_number(s.aux_loss).c_str(), json_number(s.z_loss).c_str(), s.dropped, s.min_load, s.max_load);
}
