// schedule_run.h — running one step's pipeline schedule, written once for both trainers.
//
// A pipeline schedule (llmc/parallel/pipeline_schedule.h) is a list of actions per stage: forward
// or backward micro-batch i (of model chunk c when interleaved), ZB-H1's deferred weight gradient W,
// and the sends and receives between neighbouring stages. On one rank the list is simply the
// gradient accumulation loop: F0 B0 F1 B1 ... The interpreter below walks the list in order, reads
// each forward's micro-batch from the data loader, adds up the loss on the stage that has the head,
// times the stage's compute (the bubble is the rest), and ends each run of sends and receives as
// one group. PipeDream-2BW's list also labels each compute action with the weight version it reads.
//
// What a pass does with the model's bytes is the trainer's: it hands in its passes (SchedulePasses),
// which own the activation slots (which micro-batch's activations live where), the copies and the
// device work. So the CPU reference and the GPU trainer share every decision of the schedule and
// differ only in where the numbers are computed.
#pragma once

#include <chrono>
#include <functional>
#include <vector>
#include "llmc/io/dataloader.h"
#include "llmc/parallel/pipeline_parallel.h"
#include "llmc/parallel/pipeline_schedule.h"
#include "llmc/probes/trace.h"
#include "llmc/run/metrics.h"
#include "llmc/run/step.h"

// Where this step's schedule runs: the stage, the schedule, the micro-batches and the step.
struct ScheduleStep {
    PipelineSchedule schedule;
    int stage, stages, micro_batches, chunks, step;
    bool filled, drains;  // 2BW: a step begins with the last step's list in flight; it ends drained
    bool leader;          // prints the verbose per-micro-batch lines
};

// A trainer's passes, each run for one action of the list (`act`: its micro-batch and chunk).
struct SchedulePasses {
    std::function<void()> begin;                         // the step's slots (and anything per step)
    std::function<void(const PipeAction&)> take_slot;    // before every action: the activations it uses
    std::function<void(bool older)> read_version;        // 2BW: the weight version a compute action reads
    std::function<void(const PipeAction&)> recv_activation, recv_gradient, send_activation, send_gradient;
    std::function<void(const PipeAction&)> before_compute;  // (outside the busy time: inputs, waits)
    std::function<bool(const PipeAction&, float*)> forward;  // true on the stage with the loss, and the loss
    std::function<void(const PipeAction&)> backward, weight;
    std::function<void()> compute_done;  // the compute finished (GPU: its stream synchronised), timed
    std::function<void()> end_group;     // a run of sends and receives complete
    std::function<void()> end;           // the step's schedule done
    const char* group_span;              // --trace's name of the group's end
    int backward_delay;                  // LLMC_TEST_PIPE_DELAY_MS multiples a backward sleeps
    double* busy_seconds;                // the stage's compute time, all steps
    double* schedule_seconds;            // the schedule's time, all steps
};

// This stage's list of actions: the schedule's, or with 2BW the step's part of its list across steps.
inline std::vector<PipeAction> schedule_actions(const ScheduleStep& s) {
    if (s.schedule == PipelineSchedule::PipeDream2BW)  // (2bw-flush: 1F1B's list, drained every step)
        return pipeline_2bw_steps(s.stage, s.stages, s.micro_batches, s.step, 1, s.filled, s.drains)[0];
    return pipeline_schedule(s.schedule, s.stage, s.stages, s.micro_batches, s.chunks);
}

// One compute action of the list, timed. Returns the micro-batch's loss on the stage with the head.
inline bool schedule_compute(const SchedulePasses& p, const PipeAction& act, float* micro_loss) {
    p.before_compute(act);
    auto busy = std::chrono::steady_clock::now();
    bool head = false;
    if (act.op == PipeOp::Forward) {
        pipeline_test_delay(1);  // (LLMC_TEST_PIPE_DELAY_MS: compute made of sleeps, to test the bubble)
        head = p.forward(act, micro_loss);
    } else if (act.op == PipeOp::Backward) {
        pipeline_test_delay(p.backward_delay);
        p.backward(act);
    } else {  // ZB-H1's W
        pipeline_test_delay(1);
        p.weight(act);
    }
    p.compute_done();
    *p.busy_seconds += seconds_since(busy);
    return head;
}

// Runs this stage's list for the step. Returns this rank's mean loss over its micro-batches (0 on a
// stage without the head).
inline double run_schedule(const SchedulePasses& p, const ScheduleStep& s, DataLoader* train) {
    std::vector<PipeAction> list = schedule_actions(s);
    bool two_versions = s.schedule == PipelineSchedule::PipeDream2BW;
    p.begin();
    double loss = 0.0;
    auto start = std::chrono::steady_clock::now();
    for (size_t k = 0; k < list.size(); k++) {
        const PipeAction& act = list[k];
        p.take_slot(act);
        TraceSpan span(trace_kind(act.op), act.micro, s.chunks > 1 ? act.chunk : -1);  // --trace (llmc/probes/trace.h)
        // 2BW: step `step` reads W(step-2), the older version, and the next step's forwards W(step-1), the newer
        if (two_versions && pipe_is_compute(act.op)) p.read_version(act.version < s.step - 1);
        float micro_loss = 0.0f;
        switch (act.op) {
        case PipeOp::RecvActivation: p.recv_activation(act); break;
        case PipeOp::RecvGradient: p.recv_gradient(act); break;
        case PipeOp::SendActivation: p.send_activation(act); break;
        case PipeOp::SendGradient: p.send_gradient(act); break;
        case PipeOp::Forward:  // every stage reads the micro-batches of its data-parallel rank, in order
            if (act.chunk == 0) dataloader_next_batch(train);  // (interleaved: chunk c > 0 reads chunk 0's)
            if (schedule_compute(p, act, &micro_loss)) {
                loss += micro_loss / s.micro_batches;
                if (s.leader) print_micro_step(s.step, act.micro, s.micro_batches, micro_loss, seconds_since(start));
            }
            break;
        case PipeOp::Backward:
        case PipeOp::Weight: schedule_compute(p, act, &micro_loss); break;
        }
        span.finish();
        // a run's sends and receives go together at its end (llmc/parallel/pipeline_parallel.h: a send
        // left in flight while the stage computes arrives late)
        if (!pipe_is_compute(act.op) && pipe_group_ends(list, k)) {
            TraceSpan exchange(p.group_span);
            p.end_group();
        }
    }
    p.end();
    *p.schedule_seconds += seconds_since(start);
    return loss;
}
