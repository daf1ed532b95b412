// resume.h — a resumed run continues the run it resumes: with its options, to its end or further.
//
// A checkpoint (llmc/run/checkpoint.h) holds the weights, the optimizer state, the step and the data
// position: enough to compute the next step bit for bit, given the same options. Those options
// used to live only on the command line, so a resume without them silently took the defaults (a
// learning rate of 6e-4 where the run used 0.01, B=4 where it used 8). So every state file's
// header also records the options that shape training (RECORDED_FLAGS: the batch, the step count,
// the optimizer and its hyperparameters, the schedule, the seed, the precision), as text, a flag a
// line, each marked "set" (on the command line) or "default" (the build's default then, kept so a
// later build with other defaults continues the same run):
//     set lr 0.00999999978
//     default beta1 0.899999976
// A resumed run takes each recorded value unless the command line gives the flag; an override that
// changes a value is printed in one line. Floats are written with 9 significant digits: they read
// back as the same float, bit for bit. "set" also restores the flag's given-ness (Adafactor
// without --lr uses the paper's relative step, with it the schedule: llmc/run/plan.h).
//
// The record has its own version (TrainStateHeader::options_version, llmc/io/formats.h): 0 in
// checkpoints written before it (they resume as before, on the command line's options alone), 1
// now; a newer one is refused in one line rather than half understood.
//
// The step count: --steps N names the run's last step, so with N at or below the checkpoint's step
// there is nothing to train; it is refused (exit 2), naming --more-steps K, which trains K steps
// past the checkpoint with the schedule stretched to the new end (what scripts/run.sh --resume
// does). A resume whose recorded end is already reached trains nothing and writes nothing: the
// run's metrics log is left as it was (run_is_complete).
#pragma once

#include <cstdio>
#include <string>
#include <vector>
#include "llmc/run/checkpoint.h"
#include "llmc/run/cli.h"
#include "llmc/run/plan.h"
#include "llmc/utils.h"

// The flags that shape training. Not the data, the model (the checkpoint is the model), the grid
// (a checkpoint resumes on any grid), evaluation, output or memory-saving flags (the same results).
inline const std::vector<std::string>& recorded_flags() {
    static const std::vector<std::string> names = {
        "batch-size", "seq-len", "total-batch-tokens", "steps", "optimizer", "optimizer-state", "lr", "lr-schedule",
        "warmup-steps", "final-lr-fraction", "decay-fraction", "weight-decay", "beta1", "beta2", "adam-eps", "grad-clip",
        "seed", "precision"};
    return names;
}

// A flag's value as recorded: floats with 9 significant digits (they read back as the same float).
inline std::string recorded_value(const FlagSpec& f) {
    return f.kind == FlagSpec::Float ? strprintf("%.9g", *(float*)f.target) : flag_value_string(f);
}

// The record of `o` for a checkpoint's state header. `steps`: the run's last step (plan.steps: the
// number even when --steps 0 asked for one pass over the data).
inline std::string recorded_options(const TrainOptions& o, int steps) {
    TrainOptions copy = o;
    copy.steps = steps;
    std::string text;
    for (const FlagSpec& f : flag_table(copy)) {
        if (std::find(recorded_flags().begin(), recorded_flags().end(), f.name) == recorded_flags().end()) continue;
        bool set = flag_given(o, f.name) || (!strcmp(f.name, "steps") && steps > 0);
        text += strprintf("%s %s %s\n", set ? "set" : "default", f.name, recorded_value(f).c_str());
    }
    return text;
}

// The state header of a checkpoint's first file (state.bin or state_rank0.bin).
inline TrainStateHeader checkpoint_header(const std::string& dir) {
    std::string path = checkpoint_state_files(dir)[0];
    FILE* f = open_for_reading(path, "training-state file");
    TrainStateHeader h = read_train_state_header(f, path);
    fclose(f);
    return h;
}

// Applies a checkpoint's recorded options to `o`: each flag the command line did not give takes the
// recorded value; one the command line gave with another value is noted in o->resume_notes.
inline void apply_recorded_options(TrainOptions* o, const TrainStateHeader& h, const std::string& dir) {
    if (h.options_version == 0) return;  // written before the options were recorded: the command line's, as before
    if (h.options_version > OPTIONS_VERSION) {
        fail("checkpoint '%s' records its options in version %d of the format, this build reads version %d at most: "
             "resume it with the newer build that wrote it", dir.c_str(), h.options_version, OPTIONS_VERSION);
    }
    std::string text(h.options, strnlen(h.options, sizeof(h.options)));
    std::vector<FlagSpec> table = flag_table(*o);
    TrainOptions recorded = *o;  // the recorded values, parsed here to compare them with the command line's
    std::vector<FlagSpec> recorded_table = flag_table(recorded);
    for (size_t at = 0; at < text.size();) {
        size_t end = text.find('\n', at);
        if (end == std::string::npos) end = text.size();
        std::string line = text.substr(at, end - at);
        at = end + 1;
        size_t a = line.find(' '), b = a == std::string::npos ? a : line.find(' ', a + 1);
        std::string mark = line.substr(0, a), name = b == std::string::npos ? "" : line.substr(a + 1, b - a - 1);
        std::string value = b == std::string::npos ? "" : line.substr(b + 1);
        size_t i = 0;
        while (i < table.size() && name != table[i].name) i++;
        if ((mark != "set" && mark != "default") || i == table.size() || table[i].kind == FlagSpec::Switch)
            fail("checkpoint '%s': its recorded options have a line this build cannot read ('%s'): the checkpoint is damaged",
                 dir.c_str(), line.c_str());
        parse_flag_value(recorded_table[i], value);
        std::string now = recorded_value(table[i]), then = recorded_value(recorded_table[i]);
        if (flag_given(*o, table[i].name)) {
            if (now != then)
                o->resume_notes.push_back(strprintf("resume: --%s %s overrides the checkpoint's %s", table[i].name,
                                                    flag_value_string(table[i]).c_str(), flag_value_string(recorded_table[i]).c_str()));
            continue;
        }
        parse_flag_value(table[i], value);
        if (mark == "set") o->given.push_back(table[i].name);
    }
}

// What --resume brings to the options of a training run, before they are checked: the checkpoint's
// folder as --out-dir (unless given), its recorded options, and the step count (--more-steps K, or
// the refusal of a --steps that ends before the checkpoint). Every rank does the same, from the files.
// Only a training run: --eval-only, --generate and --estimate take the checkpoint's weights on the
// flags given, as before (a recorded seed or batch would change their samples and batches).
inline void resume_options(TrainOptions* o) {
    bool training = !o->eval_only && !generation_mode(*o) && !o->estimate && o->plan == 0 && !o->pipeline_print_schedule;
    if (o->resume.empty()) {
        if (flag_given(*o, "more-steps")) usage_fail("--more-steps K continues a run: give --resume CKPT (or latest, or the run's folder) too");
        return;
    }
    if (flag_given(*o, "more-steps") && flag_given(*o, "steps"))
        usage_fail("--steps %d and --more-steps %d both set the run's end: pass one of them", o->steps, o->more_steps);
    if (!training) return;  // --eval-only, --generate and --estimate read the checkpoint's weights on today's flags
    std::string dir = resolve_resume_dir(*o);  // "" for --resume auto without a checkpoint: a fresh start
    if (dir.empty()) {
        if (flag_given(*o, "more-steps")) usage_fail("--more-steps: there is no checkpoint in '%s' to continue", o->out_dir.c_str());
        return;
    }
    if (!flag_given(*o, "out-dir")) {  // the run goes on in its own folder
        size_t slash = dir.find_last_of('/');
        o->out_dir = slash == std::string::npos ? "." : slash == 0 ? "/" : dir.substr(0, slash);
    }
    bool steps_given = flag_given(*o, "steps");  // on the command line (the record may add it)
    TrainStateHeader h = checkpoint_header(dir);
    apply_recorded_options(o, h, dir);
    long long at = (long long)h.step;
    if (flag_given(*o, "more-steps")) {
        if (o->more_steps < 1) usage_fail("--more-steps must be at least 1, got %d", o->more_steps);
        int recorded = o->steps;
        o->steps = (int)(at + o->more_steps);
        o->given.push_back("steps");
        o->resume_notes.push_back(strprintf("resume: --more-steps %d: steps %lld to %d%s", o->more_steps, at + 1, o->steps,
                                            recorded > 0 ? strprintf(", the schedule stretched from the run's %d", recorded).c_str() : ""));
    } else if (steps_given && o->steps > 0 && o->steps <= at) {
        usage_fail("--steps %d: the checkpoint '%s' is at step %lld already, and --steps is the run's last step; to train K more "
                   "steps give --more-steps K instead", o->steps, dir.c_str(), at);
    }
}

// A resumed run whose last step is the checkpoint's has nothing to train: it says so and leaves the
// run's files (its metrics log) as they are. True when the caller should stop (exit 0).
inline bool run_is_complete(const TrainOptions& o, int first_step, int last_step, bool leader) {
    if (o.eval_only || first_step == 0 || first_step < last_step) return false;
    if (leader)
        printf("nothing to train: the checkpoint is at step %d, the run's last; --more-steps K trains K more (nothing written)\n",
               first_step);
    return true;
}
