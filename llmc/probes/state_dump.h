// state_dump.h — --dump-state: the first step's logits, loss and gradient, every step's loss and
// the final weights, written by rank 0 as one file (write_dump_state, below) that the
// tests compare with PyTorch and with the one-rank run. Test machinery, not part of training: the
// CPU trainer calls it from one line in its step and one at the end; llmc/probes/gpu_test_hooks.cuh uses
// its gathers for the GPU trainer's dump.
//
// On a grid, rank 0 collects every rank's elements in global coordinates (gather_to_rank0, which
// also checks that every copy of an element, on every rank that holds one, is the same to the bit).
// What a rank holds is described by runs of the full model (llmc/parallel/process_grid.h, llmc/parallel/zero.h): its
// slice's runs, narrowed by ZeRO to its shards.
#pragma once

#include <cstring>
#include <string>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/model/model.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/io/safetensors.h"
#include "llmc/parallel/zero.h"

// The --dump-state file (safetensors), identical for both trainers; test/test_vs_pytorch.py reads it:
//   logits [B, T, V]  first micro-batch's logits, padding dropped     loss [1]  its mean loss
//   grads  [P]        the first step's gradient, before clipping      losses [steps]  each step's loss
//   params [P]        the weights after the last step
// (--moe-experts: grads and params go on with the MoE table's, llmc/model/model.h, after the P dense ones)
struct DumpState {
    std::vector<float> logits, grads, losses, params;
    float loss = 0.0f;
};

inline void write_dump_state(const std::string& path, const DumpState& d, const GPT2Config& cfg, int B, int T,
                             const char* trainer) {
    std::vector<SafetensorsTensor> tensors = {
        {"logits", "F32", {B, T, cfg.vocab_size}, d.logits.data(), d.logits.size() * 4},
        {"loss", "F32", {1}, &d.loss, 4},
        {"grads", "F32", {(int64_t)d.grads.size()}, d.grads.data(), d.grads.size() * 4},
        {"losses", "F32", {(int64_t)d.losses.size()}, d.losses.data(), d.losses.size() * 4},
        {"params", "F32", {(int64_t)d.params.size()}, d.params.data(), d.params.size() * 4},
    };
    write_safetensors(path, tensors, {{"trainer", trainer}, {"config", describe_config(cfg)}});
}

// What a dump collects as the run goes. Both trainers keep it in `dump_probe`, set up once in main,
// so that their steps' signatures carry no test machinery: the step reads it at two named points.
struct StateDump {
    bool on = false;                 // --dump-state was given
    bool first_step = false;         // the step being taken is the run's first: keep its logits, loss, gradient
    DumpState state;
    std::vector<float> first_logits; // the first micro-batch's logits, this rank's real vocabulary columns
    float first_loss = 0.0f;         // ... and its mean loss (on the last stage)
};
inline StateDump dump_probe;

// The first step's first micro-batch, after its loss: keeps this rank's real vocabulary columns of
// the logits (rows x Vp, row-major), dropping the padding, and the loss.
inline void dump_keep_logits(StateDump* d, const float* logits, size_t rows, const ModelSlice& s, float loss) {
    size_t V = s.vocab_real, Vp = s.vocab_rows;
    d->first_logits.resize(rows * V);
    for (size_t i = 0; i < rows; i++) memcpy(&d->first_logits[i * V], &logits[i * Vp], V * sizeof(float));
    d->first_loss = loss;
}

inline void dump_step_loss(StateDump* d, double loss) {
    if (d->on) d->state.losses.push_back((float)loss);
}

// The weights, from where this rank stores them (its slice, or with ZeRO-3 its shard), and the last
// pipeline stage's copy of the tied wte, which must equal the first stage's.
inline void dump_gather_weights(Comm* world, const Zero& zero, const GPT2Config& cfg, const ModelSlice& slice,
                                const float* weights, const std::vector<float>& lent_wte, std::vector<float>* out) {
    std::vector<GlobalRun> runs;
    std::vector<float> values;
    for (const StateRun& r : zero_weight_runs(zero, slice_runs(cfg, slice))) {
        runs.push_back({r.global, r.count});
        values.insert(values.end(), weights + r.weight_at, weights + r.weight_at + r.count);
    }
    if (!lent_wte.empty()) {
        ModelSlice s = slice;
        s.first_stage = true;  // where the first stage's wte lives in its slice: local [0, count[WTE])
        for (const SliceRun& r : runs_in_local_range(slice_runs(cfg, s), 0, slice_layout(cfg, s).count[WTE])) {
            runs.push_back({r.global, r.count});
            values.insert(values.end(), lent_wte.begin() + r.local, lent_wte.begin() + r.local + r.count);
        }
    }
    gather_to_rank0(world, runs, values, out, param_layout(cfg).total, "collecting the weights");
}

// Rank 0 collects the elements `runs` name from every rank, each read from `source` at the run's
// state position (`at_state`) or its weight position.
inline void dump_gather_runs(Comm* world, const std::vector<StateRun>& runs, const float* source, bool at_state,
                             size_t total, std::vector<float>* out, const char* what) {
    std::vector<GlobalRun> global;
    std::vector<float> values;
    for (const StateRun& r : runs) {
        size_t at = at_state ? r.state_at : r.weight_at;
        global.push_back({r.global, r.count});
        values.insert(values.end(), source + at, source + at + r.count);
    }
    gather_to_rank0(world, global, values, out, total, what);
}

// The summed gradient, which sits where the optimizer state does: this rank's shard (ZeRO-0: `grads`, whole).
// A rank whose `grads` are not the sum (a parameter server's worker: holds_sum false) sends nothing.
inline void dump_gather_gradients(Comm* world, Zero& zero, const GPT2Config& cfg, const ModelSlice& slice,
                                  std::vector<float>& grads, std::vector<float>* out, bool holds_sum = true) {
    const float* grad = zero.stage == 0 ? grads.data() : zero.stage == 1 ? zero_summed_shard(zero, grads) : zero.grad_shard.data();
    std::vector<StateRun> runs = holds_sum ? zero_state_runs(zero, slice_runs(cfg, slice), false) : std::vector<StateRun>{};
    dump_gather_runs(world, runs, grad, true, param_layout(cfg).total, out, "collecting the gradients");
}

// The first micro-batch's logits [rows, V]: the last stage's tensor ranks of data-parallel rank 0
// hold its columns.
inline void dump_gather_logits(Comm* world, const GPT2Config& cfg, const ModelSlice& s, int dp_rank,
                               const std::vector<float>& mine, size_t rows, std::vector<float>* out) {
    std::vector<GlobalRun> runs;
    size_t V = cfg.vocab_size;
    bool holder = s.last_stage && dp_rank == 0;
    if (holder)
        for (size_t n = 0; n < rows; n++) runs.push_back({n * V + s.vocab_begin, (size_t)s.vocab_real});
    gather_to_rank0(world, runs, holder ? mine : std::vector<float>(), out, rows * V, "collecting the logits");
}
