// plan.h — what a run is before its first step: the model it starts from (a checkpoint's weights, a
// model file, or a fresh initialisation), its batch geometry (micro-batch, accumulation, tokens per
// step) and learning-rate schedule, and the start-up line about its data. Shared by the CPU and the
// GPU trainer, and by --estimate (llmc/memory/estimate.h), which plans the same run without running
// it: the trainers differ in how they compute a step; they must not differ in any of this. Which
// checkpoint a run resumes from is llmc/run/checkpoint.h's (resolve_resume_dir).
#pragma once

#include <algorithm>
#include <string>
#include <vector>
#include "llmc/run/cli.h"
#include "llmc/io/dataloader.h"
#include "llmc/io/formats.h"
#include "llmc/model/model.h"
#include "llmc/optim/adafactor.h"  // the paper's relative step
#include "llmc/optim/schedule.h"
#include "llmc/utils.h"

// ----------------------------------------------------------------------------------------------
// The model to start from

// The model's shape, from the checkpoint (when resuming), a model file, or a descriptor, without
// reading any weights (a rank of a process grid reads only its slice of them). Sets *new_model when
// the weights are to be initialised. Returns a description of the source, for the log. A caller
// that can hold a mixture-of-experts model (the CPU trainer) passes `file`: the file's header, whose
// MoE settings it checks; without it an MoE model file is refused in one line (llmc/io/formats.h).
inline std::string load_model_config(const TrainOptions& o, const std::string& resume_dir, GPT2Config* cfg, bool* new_model,
                                     ModelHeader* file = nullptr) {
    *new_model = resume_dir.empty() && parse_model_descriptor(o.model, cfg);
    if (*new_model) {
        std::string why;
        if (!config_is_valid(*cfg, &why)) usage_fail("--model %s: %s", o.model.c_str(), why.c_str());
        return "new " + o.model + ", seed " + std::to_string(o.seed);
    }
    std::string path = resume_dir.empty() ? o.model : resume_dir + "/model.bin";
    if (!file_exists(path)) {
        fail("--model '%s' is neither a model file nor a descriptor (d12, d24, L=2,C=64,H=4, ...)", path.c_str());
    }
    ModelHeader mh = read_model_header(path, file != nullptr);
    *cfg = mh.config;
    if (file) *file = mh;
    return path;
}

// A model file's MoE settings (experts, top-k, every: its tables' shapes) against the run's flags, in
// one line naming both and the fix; empty if they agree (or the file is dense and so is the run).
inline std::string moe_file_problem(const ModelHeader& file, const TrainOptions& o, const std::string& source) {
    if (file.moe.experts == o.moe_experts &&
        (o.moe_experts == 0 || (file.moe.every == o.moe_every && file.moe_top_k == o.moe_top_k)))
        return "";
    return strprintf("%s holds %s, and this run asks for %s: pass the model's --moe-* flags (the capacity factor, aux alpha "
                     "and z-loss may change)", source.c_str(), describe_moe_flags(file.moe, file.moe_top_k).c_str(),
                     describe_moe_flags(MoEConfig{o.moe_experts, o.moe_every}, o.moe_top_k).c_str());
}

// ----------------------------------------------------------------------------------------------
// Batch geometry and schedule

struct RunPlan {
    int B = 0, T = 0;                   // micro-batch per rank
    int world_size = 1;                 // data-parallel ranks
    int64_t total_batch_tokens = 0;     // tokens per optimizer step, all ranks together
    int accumulation_steps = 1;         // micro-batches per rank per step
    int steps = 0;
    ScheduleConfig schedule;
};

inline RunPlan plan_run(const TrainOptions& o, const GPT2Config& cfg, int world_size, int64_t train_tokens_per_epoch) {
    RunPlan r;
    r.B = o.batch_size;
    r.T = o.seq_len > 0 ? o.seq_len : cfg.max_seq_len;
    r.world_size = world_size;
    if (r.T > cfg.max_seq_len) usage_fail("--seq-len %d exceeds the model's maximum sequence length %d", r.T, cfg.max_seq_len);
    int64_t tokens_per_micro_step = (int64_t)r.B * r.T * world_size;
    r.total_batch_tokens = o.total_batch_tokens > 0 ? o.total_batch_tokens : tokens_per_micro_step;
    if (r.total_batch_tokens % tokens_per_micro_step != 0) {
        usage_fail("--total-batch-tokens %lld is not a multiple of B*T*ranks = %d*%d*%d = %lld", (long long)r.total_batch_tokens,
                   r.B, r.T, world_size, (long long)tokens_per_micro_step);
    }
    r.accumulation_steps = (int)(r.total_batch_tokens / tokens_per_micro_step);
    r.steps = o.steps > 0 ? o.steps : (int)std::max<int64_t>(1, train_tokens_per_epoch / r.total_batch_tokens);
    if (!parse_lr_schedule(o.lr_schedule, &r.schedule.kind)) {
        usage_fail("--lr-schedule '%s' is not one of cosine, linear, constant, wsd", o.lr_schedule.c_str());
    }
    r.schedule.max_lr = o.lr;
    r.schedule.warmup_steps = o.warmup_steps;
    r.schedule.total_steps = r.steps;
    r.schedule.final_lr_fraction = o.final_lr_fraction;
    r.schedule.decay_fraction = o.decay_fraction;
    return r;
}

// The learning rate of step `step` (from 1), on both trainers: the schedule's (llmc/optim/schedule.h
// counts from 0), or with --optimizer adafactor and no --lr the paper's relative step min(1e-2, 1/sqrt(t)).
inline float step_learning_rate(const RunPlan& plan, const TrainOptions& o, int step) {
    if (o.optimizer == "adafactor" && !flag_given(o, "lr")) return cpu::adafactor_relative_step(step);
    return learning_rate(plan.schedule, step - 1);
}

// ----------------------------------------------------------------------------------------------
// The data

// The windows a validation scores (llmc/io/dataloader.h): --val-tokens' worth, or the older
// --val-batches N's N x B x T tokens.
inline int64_t validation_window_count(const TrainOptions& o, const DataLoader& val) {
    int64_t tokens = o.val_batches > 0 ? (int64_t)o.val_batches * val.B * val.T : (int64_t)o.val_tokens;
    return validation_windows(val, tokens);
}

// The start-up lines both trainers print about their data. `val` is null without validation data;
// `train` is unused with --eval-only.
inline std::string describe_data(const DataLoader& train, const DataLoader* val, const TrainOptions& o) {
    std::string out;
    if (!o.eval_only) out = strprintf("data: %zu training shard%s (%lld tokens)", train.files.size(),
                                      train.files.size() == 1 ? "" : "s", (long long)train.tokens_per_epoch);
    if (val) out += strprintf("%s%zu validation shard%s", o.eval_only ? "data: " : ", ", val->files.size(), val->files.size() == 1 ? "" : "s");
    if (val) out += strprintf("\nvalidation: %lld of its %lld tokens (%lld windows of T+1; --val-tokens)",
                              (long long)(validation_window_count(o, *val) * val->T), (long long)val->tokens_per_epoch,
                              (long long)validation_window_count(o, *val));
    return out + "\n";
}
