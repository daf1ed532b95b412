// trace.h — `--trace FILE` for both trainers: every rank's timeline of a pipeline step, as Chrome
// trace-event JSON (open it in https://ui.perfetto.dev or chrome://tracing, or draw it with
// scripts/plot_pipeline.py).
//
// What it teaches: a pipeline schedule's bubble is idle time between a stage's actions. The
// schedule (llmc/parallel/pipeline_schedule.h) predicts it; a timeline shows where it really falls:
// the warm-up and cool-down gaps, a receive that waits for a late neighbour, a send that does not
// move until its stage enters MPI again.
//
// The format: one "X" (complete) event per span, {"name", "ph":"X", "ts", "dur", "pid", "tid"}, with
// ts and dur in microseconds, pid = the rank (Perfetto draws one row per pid), tid = 0. Names:
//     F3, B3                         forward / backward of micro-batch 3 on this stage
//     F3c1, B3c1                     interleaved 1F1B: of micro-batch 3 on this stage's model chunk 1
//     recv act 3, recv grad 3        waiting in a receive of micro-batch 3's activations / gradients
//     send act 3, send grad 3        posting the send (it is non-blocking)
//     wait sends                     the end of a run of sends and receives: its sends complete
//     send/recv                      the GPU trainer's end of a run: its sends and receives issued as one
//                                    NCCL group (pipeline_parallel.cuh), the receives waited for
//     gradient sums, optimizer       finish_gradients and the AdamW step
// args.step holds the optimizer step. ts is the monotonic clock (CLOCK_MONOTONIC, time since boot),
// which every process on one machine shares, so the ranks' files line up without a handshake; ranks
// on several machines would each have their own zero.
//
// One file per rank, with no gathering: with one rank FILE itself; with several, the rank inserted
// before the extension (trace.json -> trace.rank0.json, trace.rank1.json, ...; no extension:
// FILE.rank1). Each rank opens its file before the model is allocated, so a path that cannot be
// written stops the run at once. FILE's folder is created when missing (`--trace out/pp2/trace.json`
// before out/pp2 exists): every rank creates it, and make_dirs takes a folder that another rank made
// a moment earlier as made.
//
// Cost: off, a span is one branch on a global; on, two clock reads and one buffered fprintf. Events
// are written as they end, so a crashed run still leaves a file that Perfetto reads (it tolerates a
// missing "]}"); trace_close finishes the JSON.
// Hook points: the schedule interpreter's action loop (llmc/run/schedule_run.h), finish_gradients and
// optimizer_step in train_gpt_cpu.cpp and train_gpt.cu.
//
// On the GPU the spans are host timestamps too, each compute span ended after a cudaStreamSynchronize
// (which the pipeline does anyway to measure the bubble; with --trace one rank does it too), not CUDA
// events: events time the GPU between two points of ONE process, with no epoch that the other ranks'
// events share, while the ranks' timelines must line up on one clock; and the waits worth seeing
// (a receive, the gradient sums' norm, AdamW's end) are host waits already. The price: the host no
// longer runs ahead of the GPU, so a traced step shows launch gaps an untraced one hides.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <string>

#include "llmc/parallel/pipeline_schedule.h"
#include "llmc/utils.h"

struct Tracer {
    FILE* file = nullptr;   // null: --trace not given, every span does nothing
    int rank = 0;
    int step = 0;
};
inline Tracer tracer;

inline double trace_now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

// FILE for this rank: itself with one rank, else with ".rankR" before the extension.
inline std::string trace_path_for_rank(const std::string& path, int rank, int world) {
    if (world <= 1) return path;
    size_t slash = path.rfind('/'), dot = path.rfind('.');
    bool has_ext = dot != std::string::npos && (slash == std::string::npos || dot > slash + 1);
    std::string tag = ".rank" + std::to_string(rank);
    return has_ext ? path.substr(0, dot) + tag + path.substr(dot) : path + tag;
}

inline void trace_open(const std::string& path, int rank, int world, int stage) {
    if (path.empty()) return;
    std::string mine = trace_path_for_rank(path, rank, world);
    size_t slash = mine.rfind('/');
    if (slash != std::string::npos && slash > 0) make_dirs(mine.substr(0, slash));
    tracer.file = fopen(mine.c_str(), "w");
    if (!tracer.file) fail("cannot write the trace '%s': %s. Choose a writable path with --trace FILE", mine.c_str(), strerror(errno));
    tracer.rank = rank;
    // a metadata event names the row
    fprintf(tracer.file, "{\"traceEvents\":[\n{\"name\":\"process_name\",\"ph\":\"M\",\"pid\":%d,\"tid\":0,"
            "\"args\":{\"name\":\"rank %d (stage %d)\"}}", rank, rank, stage);
}

inline void trace_close() {
    if (!tracer.file) return;
    fprintf(tracer.file, "\n]}\n");
    fclose(tracer.file);
    tracer.file = nullptr;
}

// One span, from construction to finish() or destruction: `kind` followed by the micro-batch (none
// if micro < 0) and the model chunk (none if chunk < 0: every schedule but interleaved).
struct TraceSpan {
    const char* kind;
    int micro, chunk;
    double start = 0;
    bool done = false;
    TraceSpan(const char* kind_, int micro_ = -1, int chunk_ = -1) : kind(kind_), micro(micro_), chunk(chunk_) {
        if (tracer.file) start = trace_now_us();
    }
    void finish() {
        if (!tracer.file || done) return;
        done = true;
        double end = trace_now_us();
        char name[64];
        if (micro >= 0 && chunk >= 0) snprintf(name, sizeof(name), "%s%dc%d", kind, micro, chunk);
        else if (micro >= 0) snprintf(name, sizeof(name), "%s%d", kind, micro);
        else snprintf(name, sizeof(name), "%s", kind);
        fprintf(tracer.file, ",\n{\"name\":\"%s\",\"ph\":\"X\",\"ts\":%.3f,\"dur\":%.3f,\"pid\":%d,\"tid\":0,\"args\":{\"step\":%d}}",
                name, start, end - start, tracer.rank, tracer.step);
    }
    ~TraceSpan() { finish(); }
};

// A schedule action's span name, before its micro-batch number.
inline const char* trace_kind(PipeOp op) {
    switch (op) {
        case PipeOp::Forward: return "F";
        case PipeOp::Backward: return "B";
        case PipeOp::Weight: return "W";
        case PipeOp::SendActivation: return "send act ";
        case PipeOp::RecvActivation: return "recv act ";
        case PipeOp::SendGradient: return "send grad ";
        case PipeOp::RecvGradient: return "recv grad ";
    }
    return "?";
}
