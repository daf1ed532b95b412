// cpu_memory_report.h — the CPU trainer's memory and communication, predicted and measured: test
// and measurement machinery, called from one line each in the trainer.
//
// The prediction is llmc/memory/estimate.h's: the size table every buffer is allocated from
// (llmc/memory/cpu_buffers.h) and the lessons' byte counts of each technique; --estimate prints it without
// running. The measurement: what a rank really holds for each row of its table (the trainer's
// held_bytes: the capacity of the vectors the row sized, and the peak of ZeRO's gathered units and
// buckets), and the bytes its groups' counters saw in the last training step. test/test_estimate.py
// compares the two, to the byte.
#pragma once

#include <cstdio>
#include <string>
#include <vector>
#include "llmc/memory/size_table.h"
#include "llmc/parallel/comm.h"
#include "llmc/memory/cpu_buffers.h"
#include "llmc/memory/estimate.h"
#include "llmc/parallel/pipeline_parallel.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/run/plan.h"
#include "llmc/utils.h"

// The prediction's setup for this run (what --estimate would be given for it): the grid and batch
// the trainer settled, the techniques from the flags (estimate.h's one translation).
inline EstimateSetup run_estimate(const TrainOptions& o, const GPT2Config& cfg, const RunPlan& plan, const ProcessGrid& g,
                                  PipelineSchedule schedule) {
    EstimateSetup e;
    e.trainer = Trainer::CPU;
    e.cfg = cfg;
    e.B = plan.B, e.T = plan.T;
    e.ranks = g.dp, e.zero_stage = g.zero_stage;
    e.tp = g.tp, e.pp = g.pp, e.sequence_parallel = g.sequence_parallel, e.schedule = schedule;
    e.virtual_stages = o.virtual_stages;  // (the trainer's par.chunks: more than 1 only with interleaved)
    e.tokens_per_step = plan.total_batch_tokens;
    e.dtype_bytes = 4;
    estimate_take_techniques(&e, o);
    return e;
}

// "rank 0 holds 1.23 GiB (N bytes):" then, on indented lines wrapped at 100 columns,
// "params ..., grads ..., ..." (by kind, from the bytes held for each row of the table).
inline std::string held_summary(const std::vector<size_t>& held, const std::vector<BufferSpec>& table, int rank) {
    size_t by_kind[MEM_KINDS] = {}, total = 0;
    for (size_t b = 0; b < held.size(); b++) by_kind[table[b].kind] += held[b], total += held[b];
    std::string out = strprintf("rank %d holds %s (%zu bytes):", rank, format_bytes((double)total).c_str(), total);
    const char* indent = "\n        ";
    std::string line;
    for (int k = 0; k < MEM_KINDS; k++) {
        if (!by_kind[k]) continue;
        std::string item = strprintf("%s %s", memory_kind_name(k), format_bytes((double)by_kind[k]).c_str());
        if (!line.empty() && 8 + line.size() + 2 + item.size() + 1 > 100) out += indent + line + ",", line.clear();
        line += (line.empty() ? "" : ", ") + item;
    }
    return out + indent + line + "\n";
}

// --print-allocations: every row, one line each, printed at once so that ranks' reports do not interleave.
inline void print_allocations(const std::vector<size_t>& held, const std::vector<BufferSpec>& table, int rank) {
    std::string out;
    size_t total = 0;
    for (size_t b = 0; b < held.size(); b++) {
        out += strprintf("allocation: rank %d %s %zu\n", rank, table[b].name, held[b]);
        total += held[b];
    }
    out += strprintf("allocation: rank %d total %zu\n", rank, total);
    fputs(out.c_str(), stdout);
    fflush(stdout);
}

// A pipeline's time over the run: computing, and running the schedule (the first stage's, which
// starts first and finishes last, is the step's pipeline time).
struct PipelineTimes {
    double busy_seconds = 0, schedule_seconds = 0;
    double predicted_bubble = 0;  // (p-1)/(m+p-1); ZB-H1's (p-1)/(3m+p-1) at F = B = W
    const char* bubble_formula = "(p-1)/(m+p-1)";
};

// Every rank's memory by kind and bytes sent in the last step, measured, and whether they are what
// --estimate predicts; the pipeline's bubble, predicted and measured. Printed by rank 0.
inline void report_costs(const std::vector<size_t>& held, const std::vector<BufferSpec>& table, const ProcessGrid& g,
                         Comm* world, const PipelineTimes& times, const EstimateSetup& e, const CommCounters step[4], int steps) {
    const int K = MEM_KINDS + 1 + 4 + 2;  // measured kinds, predicted total, measured groups, comm prediction holds, busy
    std::vector<double> all((size_t)g.world * K, 0.0);
    double* mine = all.data() + (size_t)g.rank * K;
    for (size_t b = 0; b < held.size(); b++) mine[table[b].kind] += (double)held[b];
    MemoryByKind predicted = memory_by_kind(estimate_table(e, e.B, g.rank), CPU_ALLOCATION_GRANULE);
    mine[MEM_KINDS] = (double)predicted.total;
    CommEstimate comm = estimate_comm(e, g.rank);
    bool comm_same = true;
    for (int i = 0; i < 4; i++) {
        mine[MEM_KINDS + 1 + i] = (double)step[i].total_bytes();
        comm_same = comm_same && step[i].total_bytes() == comm.bytes[i];
    }
    mine[MEM_KINDS + 5] = comm_same ? 1.0 : 0.0;
    mine[MEM_KINDS + 6] = times.busy_seconds;
    comm_all_gather(world, all.data(), K * sizeof(double), "collecting the costs");
    if (g.rank != 0) return;
    printf("memory per rank (MiB, measured) and bytes sent in the last step, per group (measured):\n");
    printf("  %-16s %8s %8s %9s %11s %9s %8s | %s\n", "rank (dp,tp,pp)", "params", "grads", "optimizer", "activations",
           "workspace", "total", "data / tensor / pipeline / world");
    auto mib = [](double bytes) { return strprintf("%.2f", bytes / 1048576.0); };
    for (int r = 0; r < g.world; r++) {
        const double* x = all.data() + (size_t)r * K;
        ProcessGrid rg = estimate_grid(e, r);
        double total = 0;
        for (int k = 0; k < MEM_KINDS; k++) total += x[k];
        std::string who = strprintf("%d (%d,%d,%d)", r, rg.dp_rank, rg.tp_rank, rg.pp_rank);
        printf("  %-16s %8s %8s %9s %11s %9s %8s | %s / %s / %s / %s", who.c_str(), mib(x[MEM_PARAMS]).c_str(),
               mib(x[MEM_GRADS]).c_str(), mib(x[MEM_OPTIMIZER]).c_str(), mib(x[MEM_ACTIVATIONS]).c_str(),
               mib(x[MEM_WORKSPACE]).c_str(), mib(total).c_str(), format_bytes(x[MEM_KINDS + 1]).c_str(),
               format_bytes(x[MEM_KINDS + 2]).c_str(), format_bytes(x[MEM_KINDS + 3]).c_str(), format_bytes(x[MEM_KINDS + 4]).c_str());
        if (total == x[MEM_KINDS] && x[MEM_KINDS + 5] == 1.0) {
            printf("  = --estimate\n");
        } else {
            CommEstimate c = estimate_comm(e, r);
            printf("  != --estimate: %s MiB | %s / %s / %s / %s\n", mib(x[MEM_KINDS]).c_str(), format_bytes((double)c.bytes[0]).c_str(),
                   format_bytes((double)c.bytes[1]).c_str(), format_bytes((double)c.bytes[2]).c_str(), format_bytes((double)c.bytes[3]).c_str());
        }
    }
    if (g.pp > 1) {
        // the step's pipeline time: the first stage's schedule, which starts first and finishes last
        printf("pipeline bubble: predicted %s = %.1f%%; measured over %d steps, the part of the first stage's "
               "schedule in which each stage was not computing:", times.bubble_formula, 100.0 * times.predicted_bubble, steps);
        for (int stage = 0; stage < g.pp; stage++) {
            printf(" %.1f%%", 100.0 * (1.0 - all[(size_t)grid_rank(g, 0, 0, stage) * K + MEM_KINDS + 6] / times.schedule_seconds));
        }
        printf("\n");
    }
}
