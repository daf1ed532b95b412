// pipeline_parallel.h — layers split into stages, micro-batches flowing through them: GPipe and 1F1B.
//
// Pipeline parallelism gives each of p ranks a contiguous range of layers (a "stage"). Stage s
// receives the activations of a micro-batch from stage s-1, runs its layers, sends its output to
// s+1; in the backward pass the gradients flow back the same way. Each rank holds 1/p of the
// layers: their weights, gradients, optimizer state and activations. What crosses a stage boundary
// per micro-batch is one (B, T, C) activation forward and its gradient backward: B*T*C*4 bytes
// each way, far less than tensor parallelism's all-reduces, so stages can sit on different nodes.
// The first stage also embeds, the last also has the final LayerNorm, the LM head and the loss.
//
// The catch is idle time. With one batch, stage s waits for s before it can start, and the first
// stage waits for the whole pipeline before its backward pass can start. So the batch of a step
// is cut into m micro-batches (the accumulation steps of the step), and the stages work on
// different micro-batches at once. Two schedules (F = forward, B = backward of micro-batch i):
//
//   GPipe (Huang et al., 2019): all forwards, then all backwards.     p = 3, m = 4:
//       stage 0:  F0 F1 F2 F3 .  .  .  .  B0 B1 B2 B3               (time flows right; "." idle)
//       stage 1:  .  F0 F1 F2 F3 .  .  B0 B1 B2 B3 .
//       stage 2:  .  .  F0 F1 F2 F3 B0 B1 B2 B3 .  .      (schematic: a B takes about 2 F)
//     every stage keeps the activations of all m micro-batches until their backward.
//
//   1F1B (PipeDream-Flush, Narayanan et al., 2021): stage s runs p-1-s forwards ("warm-up"), then
//   alternates one forward and one backward, then drains the remaining backwards. Same order of
//   work on the critical path, so the same idle time, but a micro-batch's activations are freed as
//   soon as its backward is done: stage s holds at most p-s micro-batches, not m.
//
// Each schedule is a list of actions per stage (forwards, backwards, sends, receives), made and
// checked in llmc/parallel/pipeline_schedule.h, with interleaved 1F1B's (--pipeline-print-schedule
// prints them); this file is what a stage does around them.
//
// Bubble. With forward and backward times f and b per micro-batch per stage, each stage is busy
// m (f + b) and the step lasts (m + p - 1)(f + b): the pipeline needs p-1 slots to fill and
// p-1 to drain. The idle fraction, the same for every stage and both schedules, is
//
//     bubble = (p - 1) / (m + p - 1)        p = 4: m = 4 -> 43%, m = 16 -> 16%, m = 64 -> 4.5%
//
// so m >> p. The trainers print it, and measure it: the part of the step (the first stage's
// schedule, which starts first and ends last) in which each stage was not computing. Stages of
// unequal cost (the last one's LM head over a large vocabulary) idle more than the formula says.
//
// Sends. A stage's sends complete in its next action's receive, or at once when that action
// receives nothing (stage 0's forward passes, the last stage's backward passes): never later. MPI
// moves a message larger than its eager limit only while the SENDER is inside an MPI call (Open MPI
// has no progress thread; where it can, it lets the receiver copy the message itself, but not
// everywhere), so a send left in flight while its stage computes arrives an action late, and
// later at every stage: GPipe's bubble measured 50% instead of 20% (an H200 machine; here with
// that copy turned off, test_parallelism.py). Completing a send can wait for its receiver, so could
// two neighbours wait for each other? NCCL's sends have exactly that rule (a send completes only
// once its receive is posted), and the GPU trainer pairs each send with the next receive for the
// same reason: test_gpu_host runs every schedule's pairs under that rule and finds no deadlock.
//
// The micro-batches of a step accumulate gradients exactly as one rank accumulating m micro-
// batches: backward passes run in micro-batch order on every stage in both schedules, so
// pipelining changes when each layer computes, not what (tested against the one-rank run).
//
// The tied embedding: wte is the first stage's embedding and the last stage's LM head. The first
// stage owns it (its optimizer state, its checkpoint); the last stage holds a copy for its LM
// head. After the backward pass the last stage sends the copy's gradient to the first stage,
// which adds it to its own; after the optimizer step the first stage sends the updated wte back.
// Vp*C/t floats each way per step, and the two copies are equal by construction.
#pragma once

#include <string>
#include <algorithm>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/parallel/pipeline_schedule.h"
#include "llmc/utils.h"

// The start-up line both trainers print for a pipeline: schedule, stages, micro-batches, and the
// bubble (p-1)/(m+p-1) it predicts.
inline std::string describe_pipeline(PipelineSchedule s, int stages, int layers, int micro_batches, int chunks = 1) {
    if (s == PipelineSchedule::Interleaved)  // (layers is a multiple of stages x chunks: pipeline_schedule_problem)
        return strprintf("pipeline: %s, %d stages of %d chunks of %d layers (chunk c of stage r = layer block c*p + r), "
                         "%d micro-batches: bubble %s\n", pipeline_schedule_name(s), stages, chunks, layers / (stages * chunks),
                         micro_batches, pipeline_bubble_text(s, stages, micro_batches, chunks).c_str());
    return strprintf("pipeline: %s, %d stages of %d-%d layers, %d micro-batches: bubble %s\n",
                     pipeline_schedule_name(s), stages, layers / stages, (layers + stages - 1) / stages, micro_batches,
                     pipeline_bubble_text(s, stages, micro_batches).c_str());
}

// The tied embedding, after the backward pass: the last stage's LM-head gradient (n floats) is
// added to the first stage's wte gradient. Then, after the optimizer step, the first stage's
// updated wte replaces the last stage's copy. Nothing happens without a pipeline.
// The gradient travels in pieces of TIED_GRADIENT_PIECE floats, received into one piece-sized
// buffer and added: a whole Vp x C receive buffer (154 MB at d12) would sit on the first stage
// outside the size table, so beyond what --estimate promises (measured: peak RSS 171 MB over it).
// MPI keeps messages of one sender and tag in order, so the pieces arrive as they were sent.
constexpr size_t TIED_GRADIENT_PIECE = (size_t)1 << 14;  // 64 KiB of floats (the tests' models need 2 pieces)
inline void pipe_tied_gradient(Comm* pp, bool first, bool last, float* wte_grad, const float* lent_grad, size_t n) {
    if (pp->world_size == 1) return;
    if (last) {
        std::vector<CommSend> pending;
        for (size_t at = 0; at < n; at += TIED_GRADIENT_PIECE)
            comm_send(pp, lent_grad + at, std::min(TIED_GRADIENT_PIECE, n - at), 0, 0, &pending,
                      "sending the tied embedding's gradient to the first stage");
        comm_wait_sends(pp, &pending);
    }
    if (first) {
        std::vector<float> piece(std::min(n, TIED_GRADIENT_PIECE));
        for (size_t at = 0; at < n; at += TIED_GRADIENT_PIECE) {
            size_t k = std::min(TIED_GRADIENT_PIECE, n - at);
            comm_recv(pp, piece.data(), k, pp->world_size - 1, 0, "receiving the tied embedding's gradient from the last stage");
            for (size_t i = 0; i < k; i++) wte_grad[at + i] += piece[i];
        }
    }
}

inline void pipe_tied_weights(Comm* pp, bool first, bool last, const float* wte, float* lent, size_t n) {
    if (pp->world_size == 1) return;
    if (first) {
        std::vector<CommSend> pending;
        comm_send(pp, wte, n, pp->world_size - 1, 1, &pending, "sending the tied embedding to the last stage");
        comm_wait_sends(pp, &pending);
    }
    if (last) comm_recv(pp, lent, n, 0, 1, "receiving the tied embedding from the first stage");
}

// Which activation slot holds the forward of (micro-batch, chunk) until its backward. A stage has
// pipeline_live_micro_batches() slots. A pair takes a free one at its first action (the receive of
// its input, or its forward) and gives it back once its backward's gradient is posted to the previous
// stage (at the backward itself where none leaves); free slots are reused oldest first. GPipe, 1F1B and ZB-H1 run their backwards in micro-batch order, so this is micro % slots.
// Interleaved 1F1B is why it is a list: its backwards go through the chunks in the reverse order of
// its forwards (chunk v-1 first), so the pair that frees a slot is not the oldest one (with
// micro % slots or (micro v + chunk) % slots two live pairs would share a slot).
struct PipeSlots {
    std::vector<int> of;     // micro * chunks + chunk -> its slot, -1 while it holds none
    std::vector<int> free;   // the free slots, the next to take first
    int chunks = 1;
};
inline void pipe_slots_reset(PipeSlots* ps, int slots, int m, int chunks) {
    ps->chunks = chunks;
    ps->of.assign((size_t)m * chunks, -1);
    ps->free.clear();
    for (int i = 0; i < slots; i++) ps->free.push_back(i);
}
inline int pipe_slot(PipeSlots* ps, int micro, int chunk) {
    int& slot = ps->of[(size_t)(micro * ps->chunks + chunk)];
    if (slot < 0) {
        if (ps->free.empty()) fail("internal: the pipeline schedule holds more activations than its slots");
        slot = ps->free.front();
        ps->free.erase(ps->free.begin());
    }
    return slot;
}
inline void pipe_slot_release(PipeSlots* ps, int micro, int chunk) {
    int& slot = ps->of[(size_t)(micro * ps->chunks + chunk)];
    ps->free.push_back(slot);
    slot = -1;
}

// Testing the bubble measurement: LLMC_TEST_PIPE_DELAY_MS=<ms> makes every forward pass of every
// stage take that much longer (and every backward twice that), sleeping, so that the measured idle
// time follows the schedule's arithmetic even on a machine with fewer cores than ranks.
inline void pipeline_test_delay(int multiple) {
    static const int ms = env_int("LLMC_TEST_PIPE_DELAY_MS", 0);
    if (ms > 0) std::this_thread::sleep_for(std::chrono::milliseconds(ms * multiple));
}

// Bytes one stage sends to its pipeline neighbours per step: each micro-batch's activation forward
// and gradient backward (n floats each: the rows this rank holds x C) out of each of its chunks
// (virtual stage c*p + stage sends forward unless it is the very last, back unless the very first:
// interleaving's v-fold traffic), and the tied embedding's gradient (last stage) and weights (first
// stage), wte_floats each.
inline uint64_t pipe_comm_bytes(int stage, int stages, int m, size_t n, size_t wte_floats, int chunks = 1) {
    if (stages == 1) return 0;
    bool first = stage == 0, last = stage == stages - 1;
    uint64_t per_micro = 0;
    for (int c = 0; c < chunks; c++) {
        int at = c * stages + stage;
        per_micro += (at < stages * chunks - 1 ? n : 0) + (at > 0 ? n : 0);
    }
    return ((uint64_t)m * per_micro + (first || last ? wte_floats : 0)) * sizeof(float);
}
