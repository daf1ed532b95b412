// train_loop.h — the training run around the step, written once for both trainers: the loop over
// the steps with its validation, HellaSwag and samples, the step line and metrics, the checkpoints,
// and the evaluations once more at the end.
//
// A trainer hands in its passes (RunPasses): a forward pass over the whole model (every stage of a
// pipeline, every tensor rank), the logits of a sample's last position, its step, and what it counts
// around a step (its traffic, memory and probes). The loop decides when each runs; the trainer, how.
#pragma once

#include <chrono>
#include <functional>
#include <string>
#include <vector>
#include "llmc/io/dataloader.h"
#include "llmc/probes/fault_injection.h"
#include "llmc/run/checkpoint.h"
#include "llmc/probes/state_dump.h"
#include "llmc/probes/trace.h"
#include "llmc/run/hellaswag.h"
#include "llmc/run/metrics.h"
#include "llmc/run/moe_run.h"
#include "llmc/run/plan.h"
#include "llmc/run/resume.h"
#include "llmc/run/run.h"
#include "llmc/run/sampler.h"
#include "llmc/run/step.h"

// What the step line and the metrics print beside the step's own numbers.
struct StepReport {
    double mfu = -1.0;         // percent of the GPUs' peak (-1: not known)
    float loss_scale = 0.0f;   // fp16's loss scale (0: none)
    double memory_bytes = 0;   // the run's peak memory so far
    std::string moe_line, moe_fields;  // --moe-experts: the auxiliary losses and the routing
};

// A trainer's passes for the run, filled once at set-up (train_gpt.cu's gpu_run_passes, train_gpt_cpu.cpp's
// cpu_run_passes).
struct RunPasses {
    // one forward pass of `rows` x `T` tokens through the whole model; the mean loss on the head's stage
    // (targets null: no loss, the logits kept)
    std::function<double(const int* inputs, const int* targets, int rows, int T)> forward;
    std::function<const float*()> row_losses;  // the last forward's per-position losses (null off the head's stage)
    std::function<const float*(const std::vector<int>& tokens, int len)> sample_logits;  // (sample_and_print's)
    std::function<double(double x, const char* what)> world_sum;  // over every rank
    int sample_window = 0;                 // the tokens a sample's forward sees
    bool fixed_shape = false;              // the trainer runs only its full (B, T) (validation's last rows, HellaSwag)
    Comm* sample_world = nullptr;          // the ranks a sample's token goes to
    // the step
    std::function<void(int step)> step_begins;  // (from 1) before the evaluations: test probes
    std::function<void(int step)> before_step;  // after them: the step's counters
    std::function<StepResult(int step)> step;
    std::function<StepReport(int step, const StepResult& r, double seconds)> after_step;
    std::function<void(int step)> checkpoint;
};

// The model the run starts from: a checkpoint's (--resume), a model file's, or a new one (--model).
struct RunModel {
    std::string resume_dir;  // the checkpoint resumed from ("" for none)
    std::string source;      // its description, for the log
    GPT2Config cfg;
    bool new_model = false;  // initialised from the seed
    ModelHeader file;        // a model file's or the checkpoint's model.bin header: its MoE settings must be the flags'
};

// Reads the model's shape (no weights yet). Returns why the file's MoE settings are not the flags' ("" if they are).
inline std::string choose_model(const TrainOptions& o, bool leader, RunModel* r) {
    r->resume_dir = resolve_resume_dir(o, leader);
    r->source = load_model_config(o, r->resume_dir, &r->cfg, &r->new_model, &r->file);
    return r->new_model ? "" : moe_file_problem(r->file, o, r->source);
}

// The header's last lines on a resumed run: the checkpoint, how its state is cut for this grid, and
// each option given now that overrides the checkpoint's (llmc/run/resume.h).
inline void print_resumed(const TrainOptions& o, const RunModel& rm, const TrainStateHeader& resumed, const ProcessGrid& grid) {
    if (resumed.step <= 0) return;
    printf("resumed from %s at step %lld%s\n", rm.resume_dir.c_str(), (long long)resumed.step,
           resumed.options_version > 0 ? ", with the run's recorded options" : " (a checkpoint without recorded options: the flags given now)");
    printf("%s", describe_reshard(resumed, grid.world, grid.zero_stage, grid.tp, grid.pp).c_str());
    for (const std::string& note : o.resume_notes) printf("%s\n", note.c_str());
}

// What the loop's evaluations read, and where the run reports.
struct RunEvents {
    bool evaluator = false;  // evaluates and samples (a forward pass spanning ranks needs them all)
    bool have_val = false;
    DataLoader val;
    TokenText decoder;  // the samples' text
    HellaSwagSet hellaswag;
    MetricsLog mlog;
    std::string last_checkpoint;  // the newest this run wrote, for the last line ("" for none)
};

// The validation data, before the model is allocated.
inline void open_validation(RunEvents* e, const TrainOptions& o, const GPT2Config& cfg, const RunPlan& plan, bool leader,
                            bool model_parallel) {
    e->evaluator = leader || model_parallel;
    e->have_val = e->evaluator && o.val_data != "none" && (o.val_every > 0 || o.eval_only);
    if (e->have_val) dataloader_init(&e->val, o.val_data, plan.B, plan.T, 0, 1, cfg.vocab_size, "validation data", "--val-data");
}

// After the run's header: the samples' decoder, HellaSwag's examples and the metrics log. --eval-only
// of a checkpoint logs into its run's folder, beside the run's own records (unless --out-dir or
// --metrics says where): the folder that holds ckpt_NNNNNNNN.
inline void open_reports(RunEvents* e, TrainOptions& o, const GPT2Config& cfg, const RunPlan& plan, bool leader,
                         const char* trainer, int world_size, int first_step, const RunModel& rm) {
    if (o.eval_only && !rm.resume_dir.empty() && !flag_given(o, "out-dir") && o.metrics.empty()) {
        std::string dir = rm.resume_dir;
        while (dir.size() > 1 && dir.back() == '/') dir.pop_back();
        size_t slash = dir.find_last_of('/');
        o.metrics = (slash == std::string::npos ? std::string(".") : dir.substr(0, slash + (slash == 0))) + "/metrics.jsonl";
    }
    if (leader) sample_decoder_init(&e->decoder, o, cfg);
    e->hellaswag = hellaswag_open(o, cfg, plan.T, leader);
    metrics_open(&e->mlog, o, leader, trainer, cfg, plan.B, plan.T, world_size, plan.accumulation_steps, plan.total_batch_tokens,
                 plan.steps, first_step, rm.source);
}

// The run's last line (with its checkpoint, or that there is none), and its log and trace closed.
inline void close_reports(RunEvents* e, bool leader) {
    std::string checkpoint = e->last_checkpoint.empty() ? "no checkpoint" : "checkpoint " + e->last_checkpoint;
    if (leader) print_run_summary(e->mlog, checkpoint);
    metrics_close(&e->mlog);
    trace_close();
}

// The run's shape and what the loop writes to.
struct RunLoop {
    const TrainOptions* o;
    const RunPlan* plan;
    int first_step, vocab_size;
    bool leader, model_parallel;
    ProcessGrid grid;
    const Comm* world;     // (LLMC_TEST_FAULT)
    bool* pipe_drains;     // 2BW without the flush: whether this step ends with nothing in flight
    uint64_t* sampler_rng;
    RunEvents* ev;
};

// The validation loss at `step` (llmc/run/run.h: every rank of a model-parallel grid takes part).
inline void run_validation(const RunLoop& r, const RunPasses& p, int step) {
    DataLoader* val = &r.ev->val;
    float loss = evaluate_loss(val, validation_window_count(*r.o, *val), p.fixed_shape, r.grid, r.model_parallel,
        [&](int rows) {
            p.forward(val->inputs.data(), val->targets.data(), rows, val->T);
            return p.row_losses();
        },
        [&](double x) { return p.world_sum(x, "collecting the validation loss"); });
    if (r.leader) report_val_loss(&r.ev->mlog, step, loss);
}

inline void run_hellaswag(const RunLoop& r, const RunPasses& p, int step) {
    hellaswag_report(r.ev->hellaswag, r.plan->B, r.plan->T, p.fixed_shape, r.grid, r.model_parallel, step, &r.ev->mlog,
        [&](const int* in, const int* tg, int rows, int Tp) {
            p.forward(in, tg, rows, Tp);
            return p.row_losses();
        },
        [&](double x) { return p.world_sum(x, "sum of the hellaswag counts"); });
}

inline void run_sample(const RunLoop& r, const RunPasses& p) {
    sample_and_print(*r.o, r.vocab_size, p.sample_window, r.model_parallel, p.sample_world, r.ev->decoder, r.sampler_rng,
                     p.sample_logits);
}

// One step of the loop: its evaluations before it, the step, its line, its checkpoint.
inline void run_one_step(const RunLoop& r, const RunPasses& p, int step) {
    const TrainOptions& o = *r.o;
    comm_inject_fault(r.world, step + 1);
    p.step_begins(step + 1);
    tracer.step = step + 1;
    if (r.ev->have_val && step % o.val_every == 0) run_validation(r, p, step);
    if (hellaswag_due(o, r.ev->hellaswag, step)) run_hellaswag(r, p, step);
    if (r.ev->evaluator && is_sample_step(o, step)) run_sample(r, p);

    p.before_step(step + 1);
    auto start = std::chrono::steady_clock::now();
    // 2BW without the flush: nothing in flight at a checkpoint, an evaluation, a sample or the end
    *r.pipe_drains = pipeline_drains_after(o, step + 1, r.plan->steps, r.ev->have_val, r.ev->hellaswag, r.ev->evaluator);
    StepResult s = p.step(step + 1);
    double seconds = seconds_since(start);
    StepReport rep = p.after_step(step + 1, s, seconds);
    dump_step_loss(&dump_probe, s.loss);
    if (r.leader) {
        print_step_line(step + 1, r.plan->steps, s.loss, s.lr, s.norm, seconds, r.plan->total_batch_tokens, rep.mfu,
                        seconds * (r.plan->steps - step - 1), rep.loss_scale, rep.moe_line);
        metrics_step(&r.ev->mlog, step + 1, s.loss, s.lr, s.norm, seconds, rep.mfu, rep.memory_bytes, rep.moe_fields);
    }
    bool last = step == r.plan->steps - 1;  // every run ends with a checkpoint unless told not to (cli.h's end_checkpoint)
    if ((o.checkpoint_every > 0 && (step + 1) % o.checkpoint_every == 0) || (last && end_checkpoint(o))) {
        p.checkpoint(step + 1);
        r.ev->last_checkpoint = checkpoint_dir(o.out_dir, step + 1);
    }
}

// The steps from the run's first (a resumed run's checkpoint step) to the last, then the evaluations
// once more at the end.
inline void run_training(const RunLoop& r, const RunPasses& p) {
    dump_probe.on = dump_probe.first_step = !r.o->dump_state.empty();
    for (int step = r.first_step; step < r.plan->steps; step++) run_one_step(r, p, step);
    if (r.ev->have_val) run_validation(r, p, r.plan->steps);
    if (!r.ev->hellaswag.examples.empty()) run_hellaswag(r, p, r.plan->steps);
    if (r.ev->evaluator && r.o->sample_every > 0) run_sample(r, p);
}
