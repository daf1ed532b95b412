// pipeline_schedule.h — a pipeline schedule as data: each stage's ordered list of actions, which the
// trainers execute one by one and a test can check without running a model.
//
// What it teaches. A pipeline schedule (llmc/parallel/pipeline_parallel.h: why stages, why micro-
// batches, the bubble) is usually code: a warm-up loop, a steady-state loop, a cool-down loop, each
// with its own sends and receives. Two bugs follow from that shape again and again: a warm-up count
// off by one, and two neighbours that each send before they receive, waiting for each other
// (Megatron-LM issues 169, 675 and 750; PyTorch fixed its interleaved schedule, PR 127332, by
// computing one explicit list per rank ahead of time). Here every schedule is such a list:
//
//     stage 0: F0 a0>1 F1 a1>1 g0<1 B0 F2 a2>1 g1<1 B1 g2<1 B2      (1F1B, p = 2, m = 3: the
//     stage 1: a0<0 F0 B0 g0>0 a1<0 F1 B1 g1>0 a2<0 F2 B2 g2>0       printout of --pipeline-print-schedule)
//
// F3 / B3: the forward / backward of micro-batch 3 (on model chunk c: F3c1); a3>1 / a3<0: send
// micro-batch 3's activation to stage 1 / receive it from stage 0; g3: its gradient, the other way.
// A compute action's receive comes before it and its send after it. The schedule interpreter
// (llmc/run/schedule_run.h, for both trainers) walks the list and do exactly that; the one rule they add
// is when a send completes: a run of sends and receives between two compute actions is one group,
// and its sends complete with its receives, or at its end when it has none (pipeline_parallel.h
// says why; pipe_group_ends). test/test_pipeline_schedule.cpp runs all stages' lists on a clock
// with blocking sends and finds no deadlock, every send paired with its receive in the same order,
// the activations in flight at the bound below, and the idle time equal to the bubble formula.
//
// The schedules (p stages, m micro-batches, v model chunks per stage):
//
//   GPipe (Huang et al., 2019): all m forwards, then all m backwards. Holds m micro-batches.
//   1F1B (PipeDream-Flush, Narayanan et al., 2021): stage s runs p-1-s forwards (warm-up), then one
//     forward and one backward alternately, then the remaining backwards. Holds min(m, p - s).
//     Both: idle (p-1)(F+B) per stage of a step of (m+p-1)(F+B): bubble (p-1)/(m+p-1) of the step.
//   Interleaved 1F1B (Narayanan et al., SC'21, "Efficient Large-Scale Language Model Training on
//     GPU Clusters Using Megatron-LM", section 2.2.2): the layers are cut into p*v blocks and rank r
//     holds blocks r, p + r, ..., (v-1)p + r ("model chunk" c = block c*p + r). A micro-batch goes
//     around the ring of ranks v times. Each chunk's F and B take 1/v of a stage's, so the fill and
//     drain shrink v-fold: idle (p-1)(F+B)/v per stage, bubble (p-1)/(v m) of the ideal time, which
//     is (p-1)/(v m + p - 1) of the step (the second is what the trainers measure and the test
//     asserts; with F = B = 1 per chunk: 2(p-1) idle slots in a step of 2(vm + p - 1)). The price:
//     v times the point-to-point messages, and more activations in flight on the first stages.
//     The order is Megatron-LM's (megatron/core/pipeline_parallel/schedules.py, forward_backward_
//     pipelining_with_interleaving): forwards and backwards go through the chunks in groups of p
//     micro-batches (forward k: chunk (k mod pv) div p, micro-batch (k div pv) p + k mod p; backward
//     k: chunk v-1-(k mod pv) div p), so m must be a multiple of p. Warm-up on rank r:
//         warm-up = min(v m, 2 (p - r - 1) + (v - 1) p)
//     forwards, then 1F1B over the (micro-batch, chunk) pairs, then the remaining backwards. The
//     (v - 1) p: the first p micro-batches go through every chunk but the last before the first
//     backward can start. The 2 (p - r - 1), twice 1F1B's: in the steady state a forward's output
//     leaves only after the backward paired with it (pipeline_schedule() below), two slots per hop
//     instead of one, so rank r needs twice the head start (with p - r - 1: a deadlock at p = 3,
//     m = 6, and a larger bubble, test_pipeline_schedule). Older Megatron ran everything as warm-up
//     when m = p; the cap at v m is enough (the test finds no deadlock and the exact bubble at m = p).
//     In flight on rank r: min(v m, warm-up + 1) (micro-batch, chunk) activations, each 1/v of a
//     stage's: on rank 0 with v = 2, (3p - 1)/2 stages' worth against 1F1B's p. Both trainers
//     train it (which layers a chunk is: process_grid.h's slice_layer and pass_layers; which slot a
//     pair's activations use: pipeline_parallel.h's PipeSlots).
//   ZB-H1 (Qi et al., 2023, "Zero Bubble Pipeline Parallelism", section 2): a layer's backward is
//     two jobs. B, the input gradient dx = dy W^T, is what the previous stage waits for; W, the
//     weight gradient dW = x^T dy, nobody waits for. So B alone travels the critical path and W
//     fills the holes. The order here: 1F1B's warm-up (p-1-s forwards on stage s) and its F/B
//     alternation, and stage s runs W(k) after B(k + s): a lag of s micro-batches, the last W's at
//     the very end. With unit costs F = B = W = 1 (1F1B's backward is then B + W = 2) derive the
//     step: stage s starts its first forward at s and, holding p - s forwards, waits for B0, which
//     starts there at 2p - 1 - s: p - 1 idle slots in all, the same p - 1 as at the start of 1F1B
//     but with one-slot backwards. After that nothing waits: the lag makes stage s end with s + 1
//     W's while B(m-1) walks back one slot per stage, so every stage ends at 3m + p - 1. Idle:
//         ZB-H1  (p-1)(F + B - W) = p - 1      of a step of 3m + p - 1    (the paper's Table 2)
//         1F1B   (p-1)(F + B + W) = 3(p - 1)   of a step of 3m + 3(p - 1)
//     (test_pipeline_schedule checks both on the simulated clock, p = 2..4.) The price: a stage
//     keeps what W needs (each matmul's input and output gradient) until W(k): the output
//     gradients from B(k), s + 1 micro-batches' worth at once on stage s
//     (pipeline_pending_weight_passes below), the inputs from F(k), p micro-batches on every stage,
//     the paper's "same peak memory as 1F1B" count (1F1B's first stage holds p micro-batches). The
//     rest of the forward's activations is free after B as in 1F1B (p - s micro-batches from F
//     to B). llmc/model/zero_bubble_backward.h: the passes, the sizes, when that is 1F1B's peak in
//     bytes (at d12, T = 1024: yes). The GPU trainer
//     trains it keeping whole slots until W instead (llmc/model/zero_bubble_backward.cuh).
//   PipeDream-2BW (Narayanan et al., ICML 2021, "Memory-Efficient Pipeline-Parallel DNN Training"):
//     1F1B's order with no flush between steps (pipeline_2bw_steps below): step t+1's first forwards
//     run on the newer weight version while step t's last backwards drain on the older, two weight
//     versions per stage (llmc/parallel/pipedream_2bw.h: the rule, why two suffice, what it costs).
//     What the trainers' update still costs: it meets every stage (the loss and the global gradient
//     norm), so each step after the first idles (p-1)B per stage instead of 1F1B's (p-1)(F+B).
//     2bw-flush runs one step's list to its end, 1F1B's list; so does the step before a checkpoint.
//
// Messages: an activation leaves (micro, chunk c) on rank r for rank r+1, chunk c; from the last
// rank it wraps to rank 0, chunk c+1. Gradients go the reverse way. With p = 2 a rank's "next" and
// "previous" are the same rank, so activations and gradients share one pair of ranks in both
// directions: their sends and receives must still pair in the same order (issue 750), which the
// test checks. Tags name the message (micro-batch, the receiving chunk, the direction): MPI matches
// by tag, NCCL by order, and the lists are right for both.
#pragma once

#include <algorithm>
#include <string>
#include <vector>
#include "llmc/utils.h"

enum class PipelineSchedule { GPipe, OneFOneB, Interleaved, ZeroBubbleH1, PipeDream2BW };

inline bool parse_pipeline_schedule(const std::string& s, PipelineSchedule* out) {
    if (s == "gpipe") *out = PipelineSchedule::GPipe;
    else if (s == "1f1b") *out = PipelineSchedule::OneFOneB;
    else if (s == "interleaved") *out = PipelineSchedule::Interleaved;
    else if (s == "zb-h1") *out = PipelineSchedule::ZeroBubbleH1;
    else if (s == "2bw" || s == "2bw-flush") *out = PipelineSchedule::PipeDream2BW;  // (2bw-flush: each step drained)
    else return false;
    return true;
}

inline const char* pipeline_schedule_name(PipelineSchedule s) {
    return s == PipelineSchedule::GPipe ? "GPipe" : s == PipelineSchedule::OneFOneB ? "1F1B"
         : s == PipelineSchedule::ZeroBubbleH1 ? "ZB-H1" : s == PipelineSchedule::PipeDream2BW ? "PipeDream-2BW"
         : "interleaved 1F1B";
}

enum class PipeOp {
    Forward, Backward,              // compute: the stage's (chunk's) layers on one micro-batch
    Weight,                         // ZB-H1 only: the weight gradients of a micro-batch whose Backward
                                    // computed only the input gradients (there: B, not B + W)
    SendActivation, RecvActivation, // the forward's output to the next stage / the input from the previous
    SendGradient, RecvGradient,     // the backward's input gradient to the previous stage / from the next
};

struct PipeAction {
    PipeOp op;
    int micro;      // which micro-batch of the step
    int chunk = 0;  // which of this rank's model chunks (0 without interleaving)
    int peer = -1;  // sends and receives: the other stage
    int tag = -1;   // sends and receives: the message's tag, unique within a step
    // PipeDream-2BW without the flush (pipeline_2bw_steps): the optimizer step the micro-batch
    // belongs to (from 1), and the weight version its forward and backward read, W(version)
    int step = 0;
    int version = 0;
};

inline bool pipe_is_compute(PipeOp op) { return op == PipeOp::Forward || op == PipeOp::Backward || op == PipeOp::Weight; }
inline bool pipe_is_send(PipeOp op) { return op == PipeOp::SendActivation || op == PipeOp::SendGradient; }
inline bool pipe_is_receive(PipeOp op) { return op == PipeOp::RecvActivation || op == PipeOp::RecvGradient; }

// Message tags: micro-batch i's activation into chunk c, and the gradient out of it, v chunks.
// (Without chunks: 2i and 2i+1.) The tied embedding's two messages after the schedule use 0 and 1:
// MPI keeps the order between two ranks, so tags need only be unique within the schedule.
inline int pipe_tag(int micro, int chunk, int chunks, bool gradient) { return 2 * (micro * chunks + chunk) + (gradient ? 1 : 0); }

// How many forwards stage `stage` runs before its first backward.
inline int pipeline_warmup(PipelineSchedule kind, int stage, int stages, int m, int chunks) {
    if (stages == 1) return 0;
    if (kind == PipelineSchedule::GPipe) return m;
    if (kind == PipelineSchedule::OneFOneB || kind == PipelineSchedule::ZeroBubbleH1 ||
        kind == PipelineSchedule::PipeDream2BW) return std::min(m, stages - 1 - stage);
    return std::min(chunks * m, 2 * (stages - 1 - stage) + (chunks - 1) * stages);
}

// The order of compute actions (Forward/Backward with micro and chunk) on `stage`: the warm-up's
// forwards, then one forward and one backward alternately, then the remaining backwards. With one
// stage every schedule is F0 B0 F1 B1 ...: plain gradient accumulation.
inline std::vector<PipeAction> pipeline_compute_order(PipelineSchedule kind, int stage, int stages, int m, int chunks) {
    int v = kind == PipelineSchedule::Interleaved ? chunks : 1;
    int total = m * v;  // (micro-batch, chunk) pairs, each forwarded and backwarded once
    // the k-th forward / backward of the stage: in groups of p micro-batches per chunk (Megatron's)
    auto nth = [&](int k, bool forward) {
        if (v == 1) return PipeAction{forward ? PipeOp::Forward : PipeOp::Backward, k, 0};
        int in_group = k % (stages * v), chunk = in_group / stages;
        int micro = (k / (stages * v)) * stages + in_group % stages;
        return PipeAction{forward ? PipeOp::Forward : PipeOp::Backward, micro, forward ? chunk : v - 1 - chunk};
    };
    std::vector<PipeAction> order;
    int warmup = pipeline_warmup(kind, stage, stages, m, v);
    int forwards = 0, backwards = 0;
    for (int i = 0; i < warmup; i++) order.push_back(nth(forwards++, true));
    while (forwards < total) {  // steady state
        order.push_back(nth(forwards++, true));
        order.push_back(nth(backwards++, false));
    }
    while (backwards < total) order.push_back(nth(backwards++, false));  // cool-down
    if (kind == PipelineSchedule::ZeroBubbleH1 && stages > 1) {
        // W(k) right after B(k + stage), the rest at the end (the lesson above derives the lag)
        std::vector<PipeAction> split;
        int weights = 0;
        for (const PipeAction& a : order) {
            split.push_back(a);
            if (a.op == PipeOp::Backward && a.micro - stage >= 0) split.push_back({PipeOp::Weight, weights++, 0});
        }
        while (weights < m) split.push_back({PipeOp::Weight, weights++, 0});
        return split;
    }
    return order;
}

// The receive of compute action a's input on `stage` (false if it has none: the first virtual
// stage's forward, the last one's backward), and the send of its output (false at the other ends).
inline bool pipe_receive_of(const PipeAction& a, int stage, int stages, int v, PipeAction* out) {
    if (a.op == PipeOp::Weight) return false;  // local: its inputs were kept by F and B on this stage
    int at = a.chunk * stages + stage;  // virtual stage
    bool forward = a.op == PipeOp::Forward;
    int from = forward ? at - 1 : at + 1;
    if (from < 0 || from >= stages * v) return false;
    // the tag names the message by the virtual stage it enters forward / leaves backward
    *out = {forward ? PipeOp::RecvActivation : PipeOp::RecvGradient, a.micro, a.chunk, from % stages,
            pipe_tag(a.micro, forward ? at : from, stages * v, !forward)};
    return true;
}
inline bool pipe_send_of(const PipeAction& a, int stage, int stages, int v, PipeAction* out) {
    if (a.op == PipeOp::Weight) return false;  // its output, dW, stays on the stage
    int at = a.chunk * stages + stage;
    bool forward = a.op == PipeOp::Forward;
    int to = forward ? at + 1 : at - 1;
    if (to < 0 || to >= stages * v) return false;
    *out = {forward ? PipeOp::SendActivation : PipeOp::SendGradient, a.micro, a.chunk, to % stages,
            pipe_tag(a.micro, forward ? to : at, stages * v, !forward)};
    return true;
}

// The full list of `stage`: the compute actions with the receives of their inputs and the sends of
// their outputs. Virtual stage c*p + r is rank r's chunk c.
//
// Where they go. GPipe and 1F1B: each receive right before its compute action, each send right
// after it. Interleaved, Megatron's arrangement: a steady-state forward and backward are one unit,
// the receives of both inputs before the pair, the sends of both outputs after it, so that the
// sends of one unit and the receives of the next are one group, issued together (the forward's
// output waits for the backward). Placed one by one instead, with p = 2, m = 4 stage 0 blocks
// sending B0c1's gradient while stage 1 blocks sending B1c1's, each before the receive the other
// waits for (test_pipeline_schedule's simulator found it).
inline std::vector<PipeAction> pipeline_schedule(PipelineSchedule kind, int stage, int stages, int m, int chunks = 1) {
    int v = kind == PipelineSchedule::Interleaved ? chunks : 1;
    std::vector<PipeAction> compute = pipeline_compute_order(kind, stage, stages, m, v), list;
    int warmup = pipeline_warmup(kind, stage, stages, m, v), total = m * v;
    size_t steady_end = (size_t)(warmup + 2 * (total - warmup));
    PipeAction x;
    for (size_t i = 0; i < compute.size();) {
        size_t unit = kind == PipelineSchedule::Interleaved && i >= (size_t)warmup && i < steady_end ? 2 : 1;
        // ZB-H1's steady state: B then W, then the next forward's receive. B's gradient leaves after
        // the W, with that receive, in one group: sent alone it would block the stage until the
        // previous stage, busy with a forward, posts its receive (one idle slot per step, the simulator)
        if (kind == PipelineSchedule::ZeroBubbleH1 && compute[i].op == PipeOp::Backward && i + 2 < compute.size() &&
            compute[i + 1].op == PipeOp::Weight && compute[i + 2].op == PipeOp::Forward)
            unit = 2;
        for (size_t j = i; j < i + unit; j++)
            if (pipe_receive_of(compute[j], stage, stages, v, &x)) list.push_back(x);
        for (size_t j = i; j < i + unit; j++) list.push_back(compute[j]);
        for (size_t j = i; j < i + unit; j++)
            if (pipe_send_of(compute[j], stage, stages, v, &x)) list.push_back(x);
        i += unit;
    }
    return list;
}

// The trainers' rule for sends and receives: a run of them between two compute actions is one
// group. The sends are issued, the receives waited for, and the sends complete at the end of the
// run: with the receives that follow them, or at once when none does (why: pipeline_parallel.h).
// (GPipe's and 1F1B's runs hold at most one receive. Interleaved's hold two: a trainer must post
// both before waiting for either, as the simulator's group does; one blocking receive after the
// other could wait for a peer that waits for the second.) Whether action k is the last of its run:
inline bool pipe_group_ends(const std::vector<PipeAction>& list, size_t k) {
    return k + 1 >= list.size() || pipe_is_compute(list[k + 1].op);
}

// PipeDream-2BW without the flush (Narayanan et al., ICML 2021, section 3.1; the rule and the
// versions: llmc/parallel/pipedream_2bw.h). 1F1B's steady state never stops: stage s keeps its
// w = p-1-s forwards ahead across the step boundary, so while the last backwards of step t drain
// towards stage 0 the stages below it already run the first forwards of step t+1. Numbering the
// step's micro-batches on after one another (k = (t-1) m + i), stage s runs
//     F0 .. F(w-1), then F(k+w) B(k) for k = 0, 1, 2, ...         (1F1B's list, never cut)
// and takes the optimizer step of step t right after B(t m - 1), its last backward of step t.
// Which weights each reads: step t's micro-batches read W(t-2) (W(-1) = W(0)), forward and backward
// alike (weight stashing: a backward on other weights than its forward's is the gradient of no
// function). On stage s, after the update of step t, step t+1's w forwards already ran, on W(t-1);
// the next forward of step t+1 and the backwards of all of them still read W(t-1), and step t+2's
// first forward, on W(t), comes after stage s's update of step t+1 made W(t+1) and dropped
// W(t-1). So at any time a stage holds the two versions the update rule needs, W(t-1) and W(t)
// (test_pipeline_schedule walks every list and counts).
//
// The lists, one per step (a step's list ends where the stage's update goes): where step t's ends.
// After B(t m - 1) comes its gradient's send and, in the same group, the receive of the next
// forward's input (1F1B's steady-state pair), and only then the cut: the trainers' optimizer step
// sums the loss and the gradient norm over every stage (blocking collectives), so no message may be
// left half-way across the cut: the previous stage's send of that activation waits, in its group,
// for this receive (left to the next list, the trainer hung there, and so does the simulator).
// Step t+1's list then starts with that forward, its input already in its slot.
// `filled`: the previous step's list left this step's first forwards done (and the next one's input
// received); false: the step starts with 1F1B's warm-up. `drain`: the last step ends with 1F1B's
// cool-down instead (no forward of the next step): at a checkpoint, an evaluation, the end of the
// run, or every step (--pipeline-schedule 2bw-flush), so that nothing is in flight there.
// One list with filled = false and drain = true is 1F1B's list, action for action.
inline std::vector<std::vector<PipeAction>> pipeline_2bw_steps(int stage, int stages, int m, int first_step, int steps, bool filled,
                                                               bool drain) {
    int w = pipeline_warmup(PipelineSchedule::OneFOneB, stage, stages, m, 1), total = steps * m;
    int forwards_end = total + (drain ? 0 : w);  // (micro-batch k of the lists: step first_step + k / m)
    auto compute = [&](int k, bool forward) {
        PipeAction a{forward ? PipeOp::Forward : PipeOp::Backward, k % m, 0};
        a.step = first_step + k / m;
        a.version = std::max(a.step - 2, 0);
        return a;
    };
    std::vector<PipeAction> order;  // compute actions; a cut after each step's last backward
    std::vector<size_t> cuts;
    int next_forward = filled ? w : 0;
    if (!filled)
        while (next_forward < std::min(w, forwards_end)) order.push_back(compute(next_forward++, true));
    for (int k = 0; k < total; k++) {
        if (next_forward < forwards_end) order.push_back(compute(next_forward++, true));
        order.push_back(compute(k, false));
        if (k % m == m - 1) cuts.push_back(order.size());
    }
    std::vector<std::vector<PipeAction>> lists(1);
    PipeAction x;
    auto message = [&](const PipeAction& a, bool send) {  // (a message names its micro-batch's step and version)
        if (!(send ? pipe_send_of(a, stage, stages, 1, &x) : pipe_receive_of(a, stage, stages, 1, &x))) return false;
        x.step = a.step, x.version = a.version;
        lists.back().push_back(x);
        return true;
    };
    bool received = filled;  // the first forward's input came with the previous step's list
    for (size_t i = 0, cut = 0; i < order.size(); i++) {
        const PipeAction& a = order[i];
        if (!(a.op == PipeOp::Forward && received)) message(a, false);
        received = false;
        lists.back().push_back(a);
        message(a, true);
        if (i + 1 == cuts[cut]) {  // the step's update: the next forward's input is received before it
            // (the last step's list that does not drain: the next forward is the next list's first)
            PipeAction next = i + 1 < order.size() ? order[i + 1] : compute(forwards_end, true);
            if ((i + 1 < order.size() || !drain) && next.op == PipeOp::Forward) received = message(next, false);
            if (++cut < cuts.size()) lists.emplace_back();
        }
    }
    return lists;
}

// How many (micro-batch, chunk) activations a stage holds at once: the peak of forwards not yet
// backwarded in its list (ZB-H1's W's part: pipeline_pending_weight_passes). m for GPipe, min(m, p - stage)
// for 1F1B and ZB-H1, min(v m, warm-up + 1) for interleaved, 1 without pipelining. In closed form, not by walking the list: a memory check asks
// for every micro-batch count up to the step's, and a step of 2^30 micro-batches must not build a
// list of 2^31 actions to answer (test_pipeline_schedule checks it against the walk's peak).
inline int pipeline_live_micro_batches(PipelineSchedule kind, int stage, int stages, int m, int chunks = 1) {
    if (m <= 0) return 0;
    if (stages == 1) return 1;
    if (kind == PipelineSchedule::GPipe) return m;
    if (kind == PipelineSchedule::OneFOneB || kind == PipelineSchedule::ZeroBubbleH1 ||
        kind == PipelineSchedule::PipeDream2BW) return std::min(m, stages - stage);
    return std::min(chunks * m, 2 * (stages - 1 - stage) + (chunks - 1) * stages + 1);
}

// ZB-H1: how many micro-batches' W a stage has pending at once (B done, W not yet), each keeping
// the output gradients W needs: stage s runs W(k) right after B(k + s), so s + 1 of them (and never
// more than m); 0 for the schedules whose backward is whole. test_pipeline_schedule checks it
// against the lists' walk.
inline int pipeline_pending_weight_passes(PipelineSchedule kind, int stage, int stages, int m) {
    if (kind != PipelineSchedule::ZeroBubbleH1 || stages == 1 || m <= 0) return 0;
    return std::min(m, stage + 1);
}

// The part of the step each stage idles, F and B of equal cost ratio on every stage:
// (p-1)/(m+p-1); interleaved (p-1)/(v m + p - 1), the paper's (p-1)/(v m) of the ideal time.
inline double pipeline_bubble_fraction(int stages, int m, int chunks = 1) {
    return (double)(stages - 1) / (double)(chunks * m + stages - 1);
}
// ZB-H1's with F = B = W (the lesson above): (p-1)/(3m+p-1). 1F1B's at the same costs is the one
// above, (p-1)/(m+p-1): three times the idle slots in a step of 3m + 3(p-1).
inline double pipeline_zb_h1_bubble_fraction(int stages, int m) {
    return (double)(stages - 1) / (double)(3 * m + stages - 1);
}

// The bubble the trainers and --estimate print: its formula, the fraction and the percentage,
// "(p-1)/(m+p-1) = 1/5 = 20.0%" (ZB-H1: "(p-1)/(3m+p-1) at F = B = W = 1/13 = 7.7%"; interleaved
// over v chunks: "(p-1)/(vm+p-1) = 1/9 = 11.1%").
inline double pipeline_predicted_bubble(PipelineSchedule kind, int stages, int m, int chunks = 1) {
    if (kind == PipelineSchedule::ZeroBubbleH1) return pipeline_zb_h1_bubble_fraction(stages, m);
    return pipeline_bubble_fraction(stages, m, kind == PipelineSchedule::Interleaved ? chunks : 1);
}
inline const char* pipeline_bubble_formula(PipelineSchedule kind) {
    return kind == PipelineSchedule::ZeroBubbleH1 ? "(p-1)/(3m+p-1) at F = B = W"
         : kind == PipelineSchedule::Interleaved  ? "(p-1)/(vm+p-1)"
                                                  : "(p-1)/(m+p-1)";
}
inline std::string pipeline_bubble_text(PipelineSchedule kind, int stages, int m, int chunks = 1) {
    int slots = kind == PipelineSchedule::ZeroBubbleH1 ? 3 * m : kind == PipelineSchedule::Interleaved ? chunks * m : m;
    return strprintf("%s = %d/%d = %.1f%%", pipeline_bubble_formula(kind), stages - 1, slots + stages - 1,
                     100.0 * pipeline_predicted_bubble(kind, stages, m, chunks));
}

// Why `kind` cannot run p stages, m micro-batches, v chunks over L layers ("" if it can), with the
// nearest values that would. GPipe and 1F1B run any m >= p (process_grid.h checks that);
// interleaving cuts the layers into p*v equal blocks and runs micro-batches in groups of p.
inline std::string pipeline_schedule_problem(PipelineSchedule kind, int p, int m, int v, int layers) {
    if (kind != PipelineSchedule::Interleaved) return "";
    if (p < 2) return "--pipeline-schedule interleaved needs --pipeline-parallel 2 or more";
    if (layers % (p * v) != 0) {
        int below = layers / (p * v) * (p * v), above = below + p * v;
        return strprintf("--pipeline-schedule interleaved cuts the %d layers into p x v = %d x %d = %d equal chunks: %d is not a "
                         "multiple of %d; use a model of %s%d layers, or other --pipeline-parallel / --virtual-stages",
                         layers, p, v, p * v, layers, p * v, below > 0 ? strprintf("%d or ", below).c_str() : "", above);
    }
    if (m % p != 0) {
        int below = m / p * p, above = below + p;
        return strprintf("--pipeline-schedule interleaved runs the micro-batches in groups of p = %d: %d micro-batches per step "
                         "is not a multiple of %d; make it %s%d (--total-batch-tokens = micro-batches x B x T x data-parallel ranks)",
                         p, m, p, below > 0 ? strprintf("%d or ", below).c_str() : "", above);
    }
    return "";
}

// One action as the printout writes it: F3, B3 (F3c1 on chunk 1), a3>1, a3<0, g3>0, g3<1.
inline std::string pipe_action_text(const PipeAction& a, int chunks) {
    std::string chunk = chunks > 1 ? strprintf("c%d", a.chunk) : std::string();
    switch (a.op) {
        case PipeOp::Forward: return strprintf("F%d", a.micro) + chunk;
        case PipeOp::Backward: return strprintf("B%d", a.micro) + chunk;
        case PipeOp::Weight: return strprintf("W%d", a.micro) + chunk;
        case PipeOp::SendActivation: return strprintf("a%d%s>%d", a.micro, chunk.c_str(), a.peer);
        case PipeOp::RecvActivation: return strprintf("a%d%s<%d", a.micro, chunk.c_str(), a.peer);
        case PipeOp::SendGradient: return strprintf("g%d%s>%d", a.micro, chunk.c_str(), a.peer);
        case PipeOp::RecvGradient: return strprintf("g%d%s<%d", a.micro, chunk.c_str(), a.peer);
    }
    return "?";
}

// PipeDream-2BW without the flush, three steps from the start (the third drains, as at the end of a
// run): F2.1:W0, the forward of step 2's micro-batch 1 on weights W0; a2.1>1 its activation's send;
// "| update -> W1 |": the stage's optimizer step of step 1.
inline std::string pipeline_2bw_text(int stages, int m) {
    const int steps = 3;
    std::string out = strprintf("# PipeDream-2BW without the flush, %d stages, %d micro-batches a step, steps 1-%d (the last drains): "
                                "step t's micro-batches read W(t-2) (W(-1) = W(0)); at most two versions per stage\n", stages, m, steps);
    out += "# F2.1:W0 / B2.1:W0: forward / backward of step 2's micro-batch 1 on weights W0; a2.1>1 / a2.1<0: send its "
           "activation to stage 1 / receive it from stage 0; g2.1: its gradient; | update -> W1 |: the stage's optimizer step\n";
    for (int s = 0; s < stages; s++) {
        out += strprintf("stage %d:", s);
        auto lists = pipeline_2bw_steps(s, stages, m, 1, steps, false, true);
        for (size_t t = 0; t < lists.size(); t++) {
            for (const PipeAction& a : lists[t]) {
                std::string text = pipe_action_text(a, 1);  // F3, a3>1: the step goes before the micro-batch
                text.insert(1, strprintf("%d.", a.step));
                out += " " + text + (pipe_is_compute(a.op) ? strprintf(":W%d", a.version) : "");
            }
            out += strprintf(" | update -> W%zu |", t + 1);
        }
        out += "\n";
    }
    return out;
}

// --pipeline-print-schedule: every stage's list, one line each, with a legend.
inline std::string pipeline_schedule_text(PipelineSchedule kind, int stages, int m, int chunks) {
    int v = kind == PipelineSchedule::Interleaved ? chunks : 1;
    bool zb = kind == PipelineSchedule::ZeroBubbleH1;
    std::string costs = zb ? strprintf(" with F = B = W (1F1B's there: %d/%d)", 3 * (stages - 1), 3 * (m + stages - 1)) : "";
    std::string out = strprintf("# %s, %d stages, %d micro-batches%s: bubble %d/%d = %.1f%% of the step%s\n",
                                pipeline_schedule_name(kind), stages, m,
                                v > 1 ? strprintf(", %d model chunks per stage", v).c_str() : "", stages - 1,
                                (zb ? 3 : v) * m + stages - 1,
                                100.0 * (zb ? pipeline_zb_h1_bubble_fraction(stages, m) : pipeline_bubble_fraction(stages, m, v)),
                                costs.c_str());
    out += zb ? "# F3 / B3 / W3: forward / input gradient / weight gradient of micro-batch 3"
              : "# F3 / B3: forward / backward of micro-batch 3";
    out += v > 1 ? " (F3c1: on this stage's model chunk 1)" : "";
    out += "; a3>1 / a3<0: send its activation to stage 1 / receive it from stage 0; g3: its gradient\n";
    for (int s = 0; s < stages; s++) {
        out += strprintf("stage %d:", s);
        for (const PipeAction& a : pipeline_schedule(kind, s, stages, m, v)) out += " " + pipe_action_text(a, v);
        out += "\n";
    }
    return out;
}
