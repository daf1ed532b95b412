// metrics.h — what a run reports besides its step lines: the metrics log, progress bars for long
// evaluations, the verbose micro-step lines and the final summary. Shared by both trainers.
//
// The metrics log is JSON Lines: one JSON object per line, appended to OUT_DIR/metrics.jsonl.
//   {"type":"run", "time":..., "trainer":"cpu", "start_step":0, "config":{...}, "plan":{...}, "flags":{...}}
//   {"type":"step", "step":12, "tokens":..., "loss":..., "lr":..., "norm":..., "ms":..., "tok_s":..., "mfu":..., "mem_mb":...}
//   {"type":"val", "step":100, "tokens":..., "val_loss":...}
//   {"type":"hellaswag", "step":100, "tokens":..., "acc":..., "acc_sum":..., "correct":..., "examples":...}
// Why JSONL: a line is a complete record, so a log is readable while the run writes it, a crash
// loses at most the line being written, and any tool (python, jq, a spreadsheet import) reads it
// without a schema. Why append (not AtomicFile): the log is a history, not a state. A resumed run
// adds a new "run" record and continues; steps it repeats (those after the checkpoint it resumed
// from) appear twice, and readers keep the last record of a step (scripts/plot_metrics.py does).
// Each line is written with one fputs and flushed, so `tail -f` and a plot show it at once.
// Only rank 0 writes. A value that is not a finite number (an MFU the CPU cannot know) is null.
#pragma once

#include <sys/resource.h>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <ctime>
#include <string>
#include "llmc/run/cli.h"
#include "llmc/model/model.h"
#include "llmc/utils.h"

// A JSON string literal: quotes, backslashes and control characters escaped (RFC 8259, section 7).
inline std::string json_quote(const std::string& s) {
    std::string out = "\"";
    for (unsigned char c : s) {
        if (c == '"') out += "\\\"";
        else if (c == '\\') out += "\\\\";
        else if (c == '\n') out += "\\n";
        else if (c == '\t') out += "\\t";
        else if (c < 0x20) out += strprintf("\\u%04x", c);
        else out += (char)c;
    }
    return out + "\"";
}

// A JSON number, or null when there is none (NaN and infinities have no JSON spelling).
inline std::string json_number(double x) {
    if (!std::isfinite(x)) return "null";
    return strprintf("%.7g", x);
}

// The most memory this process has held (peak resident set), in bytes: the CPU trainer's "memory".
inline double peak_rss_bytes() {
    struct rusage usage;
    getrusage(RUSAGE_SELF, &usage);
    return (double)usage.ru_maxrss * 1024.0;  // Linux reports kilobytes
}

inline std::string format_duration(double seconds) {
    int s = (int)seconds;
    if (s >= 3600) return strprintf("%dh%02dm", s / 3600, (s % 3600) / 60);
    if (s >= 60) return strprintf("%dm%02ds", s / 60, s % 60);
    return strprintf("%.1fs", seconds);
}

// ----------------------------------------------------------------------------------------------
// The log, and what the final summary needs

struct MetricsLog {
    FILE* file = nullptr;            // null: not rank 0, or --metrics none
    std::string path;
    int64_t tokens_per_step = 0;
    std::chrono::steady_clock::time_point start = std::chrono::steady_clock::now();
    // for the summary
    int first_step = 0, last_step = 0, steps_run = 0;
    double train_seconds = 0, last_loss = NAN, last_val_loss = NAN, last_hellaswag = NAN;
    int64_t hellaswag_examples = 0;
};

inline void metrics_write_line(MetricsLog* log, const std::string& line) {
    if (!log->file) return;
    if (fputs((line + "\n").c_str(), log->file) < 0 || fflush(log->file) != 0) {
        fail("cannot append to the metrics log '%s': %s (is the disk full?). Pass --metrics none to run without it",
             log->path.c_str(), strerror(errno));
    }
}

// Opens the log (rank 0 only: pass `leader`) and writes the "run" record: when, what, and every flag.
inline void metrics_open(MetricsLog* log, TrainOptions& o, bool leader, const char* trainer, const GPT2Config& cfg,
                         int B, int T, int world_size, int accumulation_steps, int64_t tokens_per_step, int steps,
                         int first_step, const std::string& model_source) {
    log->tokens_per_step = tokens_per_step;
    log->first_step = log->last_step = first_step;
    if (!leader || o.metrics == "none") return;
    log->path = o.metrics.empty() ? o.out_dir + "/metrics.jsonl" : o.metrics;
    size_t slash = log->path.rfind('/');
    if (slash != std::string::npos && slash > 0) make_dirs(log->path.substr(0, slash));
    log->file = fopen(log->path.c_str(), "a");
    if (!log->file) {
        fail("cannot open the metrics log '%s' for appending: %s. Choose another with --metrics FILE, or --metrics none",
             log->path.c_str(), strerror(errno));
    }
    char when[32];
    time_t now = time(nullptr);
    strftime(when, sizeof(when), "%Y-%m-%dT%H:%M:%SZ", gmtime(&now));
    std::string line = strprintf("{\"type\":\"run\",\"time\":\"%s\",\"version\":\"%s\",\"trainer\":\"%s\",\"start_step\":%d,"
                                 "\"model\":%s,", when, LLMC_VERSION, trainer, first_step, json_quote(model_source).c_str());
    line += strprintf("\"config\":{\"L\":%d,\"C\":%d,\"H\":%d,\"T\":%d,\"V\":%d,\"Vp\":%d,\"params\":%zu},",
                      cfg.num_layers, cfg.channels, cfg.num_heads, cfg.max_seq_len, cfg.vocab_size,
                      cfg.padded_vocab_size, param_layout(cfg).total);
    line += strprintf("\"plan\":{\"B\":%d,\"T\":%d,\"ranks\":%d,\"accumulation\":%d,\"tokens_per_step\":%lld,\"steps\":%d},",
                      B, T, world_size, accumulation_steps, (long long)tokens_per_step, steps);
    line += "\"flags\":{";
    bool first = true;
    for (const FlagSpec& f : flag_table(o)) {
        std::string value = flag_value_string(f);
        bool numeric = f.kind != FlagSpec::String && f.kind != FlagSpec::Switch;
        if (f.kind == FlagSpec::Switch) value = *(bool*)f.target ? "true" : "false";
        line += (first ? "" : ",") + json_quote(f.name) + ":" + (numeric || f.kind == FlagSpec::Switch ? value : json_quote(value));
        first = false;
    }
    metrics_write_line(log, line + "}}");
}

// One optimizer step. `mem_bytes`: the CPU's peak resident memory, or the GPU's memory in use.
inline void metrics_step(MetricsLog* log, int step, double loss, float lr, float norm, double seconds, double mfu_percent,
                         double mem_bytes, const std::string& extra_fields = "") {
    log->last_step = step;
    log->steps_run++;
    log->train_seconds += seconds;
    log->last_loss = loss;
    metrics_write_line(log, strprintf("{\"type\":\"step\",\"step\":%d,\"tokens\":%lld,\"loss\":%s,\"lr\":%s,\"norm\":%s,"
                                      "\"ms\":%s,\"tok_s\":%s,\"mfu\":%s,\"mem_mb\":%s%s}",
                                      step, (long long)(step * log->tokens_per_step), json_number(loss).c_str(),
                                      json_number(lr).c_str(), json_number(norm).c_str(), json_number(seconds * 1e3).c_str(),
                                      json_number(log->tokens_per_step / seconds).c_str(),
                                      json_number(mfu_percent >= 0 ? mfu_percent : NAN).c_str(),
                                      json_number(mem_bytes / (1 << 20)).c_str(), extra_fields.c_str()));
}

// The validation loss after `step` steps: printed as "step N | val loss X" and logged.
inline void report_val_loss(MetricsLog* log, int step, float val_loss) {
    printf("step %5d | val loss %.4f\n", step, val_loss);
    fflush(stdout);
    log->last_val_loss = val_loss;
    metrics_write_line(log, strprintf("{\"type\":\"val\",\"step\":%d,\"tokens\":%lld,\"val_loss\":%s}", step,
                                      (long long)(step * log->tokens_per_step), json_number(val_loss).c_str()));
}

// Verbose mode: one line per micro-batch of the accumulation, with the time since the step began.
inline void print_micro_step(int step, int micro, int micros, float loss, double seconds_into_step) {
    if (verbosity < 2) return;
    printf("      step %5d micro %d/%d | loss %.6f | %.1f ms elapsed\n", step, micro + 1, micros, loss,
           seconds_into_step * 1e3);
}

// The last line of every run, also in --quiet mode (it goes to the original stdout).
// `checkpoint`: the one it ended with, or why there is none.
inline void print_run_summary(const MetricsLog& log, const std::string& checkpoint) {
    std::string s = strprintf("done: step %d", log.last_step);
    if (log.steps_run > 0) {
        s += strprintf(" (%d this run, %s", log.steps_run, format_duration(log.train_seconds).c_str());
        s += strprintf(", %.0f tok/s)", log.steps_run * (double)log.tokens_per_step / log.train_seconds);
    }
    if (std::isfinite(log.last_loss)) s += strprintf(" | loss %.4f", log.last_loss);
    if (std::isfinite(log.last_val_loss)) s += strprintf(" | val loss %.4f", log.last_val_loss);
    if (std::isfinite(log.last_hellaswag)) s += strprintf(" | hellaswag %.2f%%", 100 * log.last_hellaswag);
    if (log.file) s += " | log " + log.path;
    s += " | " + checkpoint;
    fprintf(summary_stream, "%s\n", s.c_str());
    fflush(summary_stream);
}

inline void metrics_close(MetricsLog* log) {
    if (log->file) fclose(log->file);
    log->file = nullptr;
}

// ----------------------------------------------------------------------------------------------
// A progress bar on stderr, drawn only when stderr is a terminal (a log file would fill with
// carriage returns) and not in --quiet mode. It redraws at most 10 times a second, and erases
// itself when done so the result line that follows starts clean.
//   hellaswag [##########..........]  512/1024  50%  41.3/s  ETA 0:12

struct ProgressBar {
    const char* label = "";
    int64_t total = 0;
    bool live = false;
    std::chrono::steady_clock::time_point start, last_draw;
};

inline void progress_begin(ProgressBar* p, const char* label, int64_t total) {
    p->label = label;
    p->total = total;
    p->live = verbosity > 0 && isatty(fileno(stderr)) && total > 0;
    p->start = p->last_draw = std::chrono::steady_clock::now();
}

inline void progress_update(ProgressBar* p, int64_t done) {
    if (!p->live) return;
    auto now = std::chrono::steady_clock::now();
    if (done < p->total && std::chrono::duration<double>(now - p->last_draw).count() < 0.1) return;
    p->last_draw = now;
    double elapsed = std::chrono::duration<double>(now - p->start).count();
    double fraction = (double)done / p->total, rate = elapsed > 0 ? done / elapsed : 0;
    int eta = rate > 0 ? (int)((p->total - done) / rate) : 0;
    const int width = 30;
    int filled = (int)(fraction * width);
    fprintf(stderr, "\r%s [%s%s] %lld/%lld %3.0f%% %6.1f/s ETA %d:%02d ", p->label, std::string(filled, '#').c_str(),
            std::string(width - filled, '.').c_str(), (long long)done, (long long)p->total, 100 * fraction, rate,
            eta / 60, eta % 60);
    fflush(stderr);
    stderr_line_open = true;
}

inline void progress_end(ProgressBar* p) {
    if (!p->live || !stderr_line_open) return;
    fprintf(stderr, "\r%*s\r", HELP_WIDTH - 1, "");
    fflush(stderr);
    stderr_line_open = false;
}
