// test_pipeline_schedule.cpp — the pipeline schedules of llmc/parallel/pipeline_schedule.h run
// without a model: every stage's list of actions executed on a clock, with blocking sends, by a
// simulator that knows nothing of how the lists were made. For GPipe, 1F1B and 2BW's one drained
// step (v = 1; it must be 1F1B's list, action for action) and
// interleaved 1F1B (v = 2), p = 2, 3, 4 stages and m = p, 2p, 3p micro-batches (and m = p + 1 where
// the schedule allows it: interleaving needs m a multiple of p), it checks
//   - every (micro-batch, chunk) is forwarded once, then backwarded once, and each chunk's backwards
//     run in micro-batch order (the accumulation order of one rank, so the sum is the same);
//   - across stages: the forward of micro-batch i on virtual stage u + 1 (chunk c of rank r is
//     virtual stage c p + r) starts after it ended on u, its backward on u after it ended on u + 1;
//   - the k-th send from stage a to stage b and the k-th receive at b from a are the same message
//     (tag and kind), for every pair: NCCL matches by order, and with p = 2 a rank's two neighbours
//     are one rank (Megatron-LM issue 750);
//   - with the trainers' rule for sends (one completes with the receive that follows it in the list,
//     or at once; a send and a receive complete only when both sides have posted them, the worst
//     case) every stage reaches the end of its list: no deadlock;
//   - the activations in flight on each stage peak at pipeline_live_micro_batches: m (GPipe),
//     min(m, p - s) (1F1B), min(v m, 2 (p - s - 1) + (v - 1) p + 1) (interleaved), and under
//     interleaving the last stage's last chunk (the one with the head) holds one micro-batch at a
//     time (its forward and backward are one steady-state unit: the CPU trainer keeps one set of
//     logits there, llmc/memory/cpu_buffers.h's cpu_buffer_slots);
//   - with unit costs (F = B = 1 per chunk) every stage idles exactly pipeline_bubble_fraction of the
//     step: (p-1)/(m+p-1), interleaved (p-1)/(v m + p - 1), which is the paper's (p-1)/(v m) of the
//     ideal time; also with B = 2 F for GPipe and 1F1B.
//   ZB-H1 (p = 2, 3, 4; m = p, 2p, 3p, p + 1), the same checks, and: each W(i) after B(i) on its
//   stage, W's in micro-batch order (the accumulation order), activations held from F to B with
//   1F1B's peak, min(m, p - s), and W's part from B to W with the peak at pipeline_pending_weight_
//   passes, min(m, s + 1); the CPU trainer's sizes (llmc/model/zero_bubble_backward.h): its stashes
//   of output gradients, zero_bubble_stashes (none on stage 0, where every W(i) comes right after
//   B(i): the trainer runs the whole backward there), and the slots holding what W reads, from F to
//   W, zero_bubble_weight_input_slots, min(m, p), of which the ones past 1F1B's p - s forward slots
//   are "parked" (a forward reusing slot i mod (p - s) before W(i - (p - s)) ran); with F = B = W = 1 every stage idles exactly p - 1 slots of
//   a step of 3m + p - 1 (Qi et al.'s (p-1)(F+B-W)), where 1F1B with B + W = 2 idles 3(p - 1).
//   PipeDream-2BW without the flush (pipeline_2bw_steps), p = 2, 3, 4, m = p, 2p, p + 1, three
//   steps: every micro-batch of every step forwarded once then backwarded once, backwards in order
//   over the steps; each compute action reads W(step - 2), a version its stage has already made,
//   forward and backward of a micro-batch the same (weight stashing); at most two versions alive per
//   stage, and two somewhere on every stage (the steps do overlap); in flight min(m, p - s) across
//   the boundaries; sends and receives paired; no deadlock with the trainers' send rule and every
//   step's update a meeting of all stages (the loss and norm sums); dependencies on the clock; the
//   idle slots: (p-1)(F+B) in the first step, (p-1)B in each later one, against 1F1B's (p-1)(F+B)
//   every step (F = 1, B = 1 and 2); the trainer's one-step lists chain into the three-step list.
//   Planted by hand and caught: a backward labelled with the newer version (B0 of step 2 reads W1:
//   the version check); the next forward's receive left to the next step's list, after the update
//   (a deadlock at the meeting, stage 0 blocked sending a0; the trainer hung the same way).
#include <cmath>
#include <cstdio>
#include <map>
#include <string>
#include <vector>
#include "llmc/model/zero_bubble_backward.h"
#include "llmc/parallel/pipeline_schedule.h"
#include "test/checks.h"

struct Case {
    PipelineSchedule kind;
    int p, m, v;
    std::string name() const { return strprintf("%s p=%d m=%d v=%d", pipeline_schedule_name(kind), p, m, v); }
};

typedef std::vector<std::vector<PipeAction>> Lists;  // one per stage

static Lists lists_of(const Case& c) {
    Lists lists;
    for (int s = 0; s < c.p; s++) lists.push_back(pipeline_schedule(c.kind, s, c.p, c.m, c.v));
    return lists;
}

// Each stage: every (micro, chunk) forwarded once then backwarded once, each chunk's backwards in
// micro-batch order; and the peak of activations in flight, against the closed form.
static std::string order_problem(const Case& c, const Lists& lists) {
    for (int s = 0; s < c.p; s++) {
        std::vector<int> state((size_t)(c.m * c.v), 0), next_backward((size_t)c.v, 0);
        int held = 0, peak = 0, next_weight = 0, pending = 0, pending_peak = 0;  // pending: B done, W not yet
        int head_held = 0, head_peak = 0;  // interleaved, the last stage: pairs of the last chunk (the head's)
        bool zb = c.kind == PipelineSchedule::ZeroBubbleH1;
        // ZB-H1 in the CPU trainer: micro-batches from F to W, those parked past the forward slots,
        // and whether every W(i) follows B(i) directly (stage 0's whole backward at B)
        int until_w = 0, until_w_peak = 0, parked = 0, parked_peak = 0, forward_slots = pipeline_live_micro_batches(c.kind, s, c.p, c.m, c.v);
        std::vector<bool> is_parked((size_t)c.m, false);
        bool w_follows_b = true;
        const PipeAction* previous = nullptr;
        for (const PipeAction& a : lists[(size_t)s]) {
            if (!pipe_is_compute(a.op)) continue;
            if (a.op == PipeOp::Weight && !(previous && previous->op == PipeOp::Backward && previous->micro == a.micro))
                w_follows_b = false;
            previous = &a;
            if (zb && a.op == PipeOp::Forward) {
                until_w_peak = std::max(until_w_peak, ++until_w);
                int before = a.micro - forward_slots;  // the slot's last occupant, if its W has not run
                if (before >= 0 && state[(size_t)before] == 2) is_parked[(size_t)before] = true, parked_peak = std::max(parked_peak, ++parked);
            }
            if (a.op == PipeOp::Weight) {
                until_w--;
                if (is_parked[(size_t)a.micro]) parked--;
            }
            if (a.micro < 0 || a.micro >= c.m || a.chunk < 0 || a.chunk >= c.v)
                return strprintf("stage %d: micro-batch %d chunk %d out of range", s, a.micro, a.chunk);
            int& st = state[(size_t)(a.micro * c.v + a.chunk)];
            if (a.op == PipeOp::Weight) {  // ZB-H1: after its B, in micro-batch order; frees what W reads
                if (!zb) return strprintf("stage %d: a W in a schedule without split backwards", s);
                if (st != 2) return strprintf("stage %d: W%d before its B (or twice)", s, a.micro);
                if (a.micro != next_weight++) return strprintf("stage %d: W%d not in micro-batch order", s, a.micro);
                st++;
                pending--;
                continue;
            }
            bool forward = a.op == PipeOp::Forward;
            if (st != (forward ? 0 : 1)) return strprintf("stage %d: %s out of order", s, pipe_action_text(a, c.v).c_str());
            if (!forward && a.micro != next_backward[(size_t)a.chunk]++)
                return strprintf("stage %d: chunk %d's backwards not in micro-batch order (%s)", s, a.chunk, pipe_action_text(a, c.v).c_str());
            st++;
            held += forward ? 1 : -1;  // (ZB-H1's B frees the activations too: W's part is in `pending`)
            peak = std::max(peak, held);
            if (c.v > 1 && s == c.p - 1 && a.chunk == c.v - 1) head_peak = std::max(head_peak, head_held += forward ? 1 : -1);
            if (zb && !forward && c.p > 1) pending_peak = std::max(pending_peak, ++pending);
        }
        for (int st : state)
            if (st != (zb ? 3 : 2)) return strprintf("stage %d: a micro-batch misses its forward, backward%s", s, zb ? " or W" : "");
        int closed = pipeline_live_micro_batches(c.kind, s, c.p, c.m, c.v);
        if (peak != closed) return strprintf("stage %d holds %d activations at its peak, the closed form says %d", s, peak, closed);
        if (c.v > 1 && s == c.p - 1 && head_peak != 1)
            return strprintf("the last stage holds %d micro-batches of its last chunk (the head's) at once, not 1", head_peak);
        // ZB-H1's output-gradient stashes (the trainer allocates this many): B done, W not yet
        int stashes = pipeline_pending_weight_passes(c.kind, s, c.p, c.m);
        if (pending_peak != stashes)
            return strprintf("stage %d has %d W passes pending at its peak, pipeline_pending_weight_passes says %d", s, pending_peak, stashes);
        if (zb && c.p > 1) {
            int trainer_stashes = zero_bubble_stashes(s, c.m), slots = zero_bubble_weight_input_slots(c.p, c.m);
            if (trainer_stashes != (s == 0 && w_follows_b ? 0 : pending_peak))
                return strprintf("stage %d: zero_bubble_stashes says %d, the walk %d (W right after B: %d)", s, trainer_stashes,
                                 pending_peak, (int)w_follows_b);
            if (until_w_peak != slots || parked_peak != slots - forward_slots)
                return strprintf("stage %d: %d micro-batches from F to W at the peak, %d parked; zero_bubble_weight_input_slots "
                                 "says %d, of which %d past the %d forward slots", s, until_w_peak, parked_peak, slots,
                                 slots - forward_slots, forward_slots);
        }
    }
    return "";
}

// For every ordered pair of stages: the sequence of sends a -> b equals the sequence of receives at
// b from a, message by message (tag and kind).
static std::string pairing_problem(const Case& c, const Lists& lists) {
    for (int a = 0; a < c.p; a++)
        for (int b = 0; b < c.p; b++) {
            std::vector<std::pair<int, bool>> sent, received;  // (tag, gradient?)
            for (const PipeAction& x : lists[(size_t)a])
                if (pipe_is_send(x.op) && x.peer == b) sent.push_back({x.tag, x.op == PipeOp::SendGradient});
            for (const PipeAction& x : lists[(size_t)b])
                if (pipe_is_receive(x.op) && x.peer == a) received.push_back({x.tag, x.op == PipeOp::RecvGradient});
            if (sent.size() != received.size())
                return strprintf("stage %d sends %zu messages to stage %d, which receives %zu", a, sent.size(), b, received.size());
            for (size_t k = 0; k < sent.size(); k++)
                if (sent[k] != received[k])
                    return strprintf("message %zu from stage %d to %d: sent tag %d (%s), received tag %d (%s)", k, a, b,
                                     sent[k].first, sent[k].second ? "gradient" : "activation", received[k].first,
                                     received[k].second ? "gradient" : "activation");
        }
    return "";
}

// The lists on a clock. Compute takes f (forward) or b (backward). Communication is a rendezvous: a
// "group" (a run of sends and receives between two compute actions, pipe_group_ends) is posted when its stage reaches it and completes once the matching operation of
// each of its messages has been posted (the k-th send a -> b matches the k-th receive at b from a),
// at the latest post time. Messages take no time. Returns "" or the deadlock; fills each stage's
// busy time, the step's length, and each compute action's start and end (by stage, micro, chunk).
struct Timing {
    std::vector<double> busy;
    double total = 0;
    std::map<std::tuple<int, int, int, bool>, std::pair<double, double>> when;  // (virtual stage, micro, forward?) -> start, end
};

// cuts (PipeDream-2BW without the flush): per stage, the list positions where a step's update goes;
// the k-th cut of every stage is one meeting (the trainers' loss and norm sums over all stages): each
// stage leaves it when the last one arrives.
static std::string simulate(const Case& c, const Lists& lists, double f, double b, Timing* t, bool grouped = true, double w = 1.0,
                            const std::vector<std::vector<size_t>>* cuts = nullptr) {
    int p = c.p;
    const size_t MEETING = (size_t)-1;  // a group of one Op{MEETING, k}: the k-th cut
    // the groups of each stage, in list order; a compute action is a group of its own
    struct Op { size_t index; int ordinal; };  // into the list; which send a->b / receive at b from a
    std::vector<std::vector<std::vector<Op>>> groups((size_t)p);
    std::vector<std::vector<int>> sends((size_t)p, std::vector<int>((size_t)p, 0)), recvs = sends;
    for (int s = 0; s < p; s++) {
        const std::vector<PipeAction>& list = lists[(size_t)s];
        std::vector<Op> pending;
        size_t cut = 0;
        for (size_t k = 0; k <= list.size(); k++) {
            if (cuts && cut < (*cuts)[(size_t)s].size() && (*cuts)[(size_t)s][cut] == k) {  // (the group before it has ended)
                groups[(size_t)s].push_back({{MEETING, (int)cut}});
                cut++;
            }
            if (k == list.size()) break;
            const PipeAction& a = list[k];
            if (pipe_is_compute(a.op)) {
                groups[(size_t)s].push_back({{k, -1}});
                continue;
            }
            int ordinal = pipe_is_send(a.op) ? sends[(size_t)s][(size_t)a.peer]++ : recvs[(size_t)s][(size_t)a.peer]++;
            pending.push_back({k, ordinal});
            if (pipe_group_ends(list, k) || !grouped) {  // (the control: every send and receive alone)
                groups[(size_t)s].push_back(pending);
                pending.clear();
            }
        }
        if (!pending.empty()) groups[(size_t)s].push_back(pending);
    }
    // where each posted operation's partner is: posted[(stage, send?, peer, ordinal)] = post time
    std::map<std::tuple<int, bool, int, int>, double> posted;
    std::map<int, std::vector<double>> met;  // the k-th meeting: each stage's arrival
    std::vector<size_t> at((size_t)p, 0);
    std::vector<double> clock((size_t)p, 0.0);
    t->busy.assign((size_t)p, 0.0);
    t->when.clear();
    for (bool progress = true; progress;) {
        progress = false;
        for (int s = 0; s < p; s++) {
            while (at[(size_t)s] < groups[(size_t)s].size()) {
                const std::vector<Op>& g = groups[(size_t)s][at[(size_t)s]];
                if (g[0].index == MEETING) {
                    std::vector<double>& arrived = met[g[0].ordinal];
                    if (arrived.size() < (size_t)p) arrived.resize((size_t)p, -1.0);
                    if (arrived[(size_t)s] < 0) arrived[(size_t)s] = clock[(size_t)s];
                    if (*std::min_element(arrived.begin(), arrived.end()) < 0) break;  // blocked: the others have not arrived
                    clock[(size_t)s] = *std::max_element(arrived.begin(), arrived.end());
                    at[(size_t)s]++;
                    progress = true;
                    continue;
                }
                const PipeAction& first = lists[(size_t)s][g[0].index];
                if (pipe_is_compute(first.op)) {
                    double cost = first.op == PipeOp::Forward ? f : first.op == PipeOp::Backward ? b : w;
                    int u = first.chunk * p + s;
                    int micro = first.step > 0 ? (first.step - 1) * c.m + first.micro : first.micro;  // (2BW: over its steps)
                    if (first.op != PipeOp::Weight)  // (W's order on its stage: order_problem)
                        t->when[{u, micro, 0, first.op == PipeOp::Forward}] = {clock[(size_t)s], clock[(size_t)s] + cost};
                    clock[(size_t)s] += cost;
                    t->busy[(size_t)s] += cost;
                    at[(size_t)s]++;
                    progress = true;
                    continue;
                }
                double done = clock[(size_t)s];
                bool complete = true;
                for (const Op& op : g) {
                    const PipeAction& a = lists[(size_t)s][op.index];
                    bool send = pipe_is_send(a.op);
                    posted.emplace(std::make_tuple(s, send, a.peer, op.ordinal), clock[(size_t)s]);  // (keeps the first post)
                    auto partner = posted.find(std::make_tuple(a.peer, !send, s, op.ordinal));
                    if (partner == posted.end()) complete = false;
                    else done = std::max(done, partner->second);
                }
                if (!complete) break;  // blocked: wait for the peers
                clock[(size_t)s] = done;
                at[(size_t)s]++;
                progress = true;
            }
        }
    }
    for (int s = 0; s < p; s++)
        if (at[(size_t)s] < groups[(size_t)s].size()) {
            size_t index = groups[(size_t)s][at[(size_t)s]][0].index;
            return strprintf("deadlock: stage %d blocks at %s (group %zu of %zu)", s,
                             index == MEETING ? "a step's update" : pipe_action_text(lists[(size_t)s][index], c.v).c_str(),
                             at[(size_t)s], groups[(size_t)s].size());
        }
    t->total = *std::max_element(clock.begin(), clock.end());
    return "";
}

// On the simulated clock: the forward of (micro, u + 1) starts after that of (micro, u) ended, the
// backward of (micro, u) after that of (micro, u + 1), and the last virtual stage's backward after
// its forward. From the times alone, not from the lists' sends and receives.
static std::string dependency_problem(const Case& c, const Timing& t) {
    int last = c.p * c.v - 1;
    auto at = [&](int u, int micro, bool forward) { return t.when.at(std::make_tuple(u, micro, 0, forward)); };
    for (int i = 0; i < c.m; i++)
        for (int u = 0; u <= last; u++) {
            if (u < last && at(u + 1, i, true).first < at(u, i, true).second)
                return strprintf("F%d on virtual stage %d starts before it ends on %d", i, u + 1, u);
            if (u < last && at(u, i, false).first < at(u + 1, i, false).second)
                return strprintf("B%d on virtual stage %d starts before it ends on %d", i, u, u + 1);
        }
    for (int i = 0; i < c.m; i++)
        if (at(last, i, false).first < at(last, i, true).second) return strprintf("B%d on the last stage before its forward", i);
    return "";
}

// PipeDream-2BW without the flush, `steps` steps from the start: each stage's lists of
// pipeline_2bw_steps concatenated (the last step drains, as at the end of a run), and where each
// step's update goes (the end of its list).
static Lists two_bw_lists(int p, int m, int steps, std::vector<std::vector<size_t>>* cuts) {
    Lists lists((size_t)p);
    cuts->assign((size_t)p, {});
    for (int s = 0; s < p; s++)
        for (const std::vector<PipeAction>& step : pipeline_2bw_steps(s, p, m, 1, steps, false, true)) {
            lists[(size_t)s].insert(lists[(size_t)s].end(), step.begin(), step.end());
            (*cuts)[(size_t)s].push_back(lists[(size_t)s].size());
        }
    return lists;
}

// Each stage of a 2BW run: every micro-batch of every step forwarded once, then backwarded once,
// backwards in order over the steps (the one-rank accumulation order); each compute action reads
// W(step - 2) (W(-1) = W(0)), a version the stage has made already (the update of step t makes
// W(t)), forward and backward of a micro-batch the same one (weight stashing); the versions alive
// (the newest, and those of the micro-batches between their forward and backward) at most two;
// the activations in flight at 1F1B's peak, min(m, p - s), across the step boundaries too.
// *two_alive: whether every stage held two versions at once somewhere (the overlap happens).
static std::string two_bw_order_problem(int p, int m, int steps, const Lists& lists, const std::vector<std::vector<size_t>>& cuts,
                                        bool* two_alive) {
    *two_alive = true;
    for (int s = 0; s < p; s++) {
        std::map<int, int> version_of;  // micro-batch (over the steps) between its F and B -> the version its F read
        int updates = 0, next_backward = 0, forwarded = 0, peak = 0, alive_peak = 0;
        size_t cut = 0;
        const std::vector<PipeAction>& list = lists[(size_t)s];
        for (size_t k = 0; k < list.size(); k++) {
            const PipeAction& a = list[k];
            if (!pipe_is_compute(a.op)) continue;
            int micro = (a.step - 1) * m + a.micro;
            if (a.version != std::max(a.step - 2, 0))
                return strprintf("stage %d: %s of step %d reads W%d, the rule says W%d", s, pipe_action_text(a, 1).c_str(), a.step,
                                 a.version, std::max(a.step - 2, 0));
            if (a.version > updates)
                return strprintf("stage %d: %s of step %d reads W%d before the stage made it", s, pipe_action_text(a, 1).c_str(), a.step,
                                 a.version);
            if (a.op == PipeOp::Forward) {
                if (micro != forwarded++) return strprintf("stage %d: forwards out of order at step %d's F%d", s, a.step, a.micro);
                version_of[micro] = a.version;
            } else {
                if (micro != next_backward++ || !version_of.count(micro))
                    return strprintf("stage %d: step %d's B%d out of order or before its forward", s, a.step, a.micro);
                if (version_of[micro] != a.version)
                    return strprintf("stage %d: step %d's B%d reads W%d, its forward read W%d", s, a.step, a.micro, a.version,
                                     version_of[micro]);
                version_of.erase(micro);
            }
            peak = std::max(peak, (int)version_of.size() + (a.op == PipeOp::Backward ? 1 : 0));
            std::map<int, bool> alive = {{updates, true}};
            for (auto& held : version_of) alive[held.second] = true;
            alive[a.version] = true;
            alive_peak = std::max(alive_peak, (int)alive.size());
            while (cut < cuts[(size_t)s].size() && cuts[(size_t)s][cut] <= k + 1) cut++, updates++;  // (updates after this action)
        }
        if (forwarded != steps * m || next_backward != steps * m || !version_of.empty())
            return strprintf("stage %d: %d forwards and %d backwards of %d micro-batches", s, forwarded, next_backward, steps * m);
        if (peak != pipeline_live_micro_batches(PipelineSchedule::PipeDream2BW, s, p, m))
            return strprintf("stage %d holds %d activations at its peak, the closed form says %d", s, peak,
                             pipeline_live_micro_batches(PipelineSchedule::PipeDream2BW, s, p, m));
        if (alive_peak > 2) return strprintf("stage %d holds %d weight versions at once", s, alive_peak);
        if (alive_peak < 2) *two_alive = false;
    }
    return "";
}

int main() {
    std::vector<Case> cases;
    for (int p : {2, 3, 4}) {
        for (PipelineSchedule kind : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB, PipelineSchedule::PipeDream2BW})
            for (int m : {p, 2 * p, 3 * p, p + 1}) cases.push_back({kind, p, m, 1});
        for (int m : {p, 2 * p, 3 * p}) cases.push_back({PipelineSchedule::Interleaved, p, m, 2});
        for (int m : {p, 2 * p, 3 * p, p + 1}) cases.push_back({PipelineSchedule::ZeroBubbleH1, p, m, 1});
    }
    std::string order, pairing, deadlock, deps, bubble, bubble_b2, zb_slots;
    for (const Case& c : cases) {
        Lists lists = lists_of(c);
        std::string why = order_problem(c, lists);
        if (!why.empty() && order.empty()) order = c.name() + ": " + why;
        why = pairing_problem(c, lists);
        if (!why.empty() && pairing.empty()) pairing = c.name() + ": " + why;
        Timing t;
        why = simulate(c, lists, 1.0, 1.0, &t);
        if (!why.empty()) {
            if (deadlock.empty()) deadlock = c.name() + ": " + why;
            continue;
        }
        why = dependency_problem(c, t);
        if (!why.empty() && deps.empty()) deps = c.name() + ": " + why;
        bool zb = c.kind == PipelineSchedule::ZeroBubbleH1;
        double want = zb ? pipeline_zb_h1_bubble_fraction(c.p, c.m) : pipeline_bubble_fraction(c.p, c.m, c.v);
        for (int s = 0; s < c.p && bubble.empty(); s++) {
            double idle = 1.0 - t.busy[(size_t)s] / t.total;
            if (std::fabs(idle - want) > 1e-12)
                bubble = c.name() + strprintf(": stage %d idles %.4f of the step (%g of %g slots), the formula says %.4f", s, idle,
                                              t.total - t.busy[(size_t)s], t.total, want);
        }
        if (zb) {  // by slot count, not only the ratio: p - 1 idle slots in 3m + p - 1, and 1F1B's 3(p-1) with B + W = 2
            Case one = {PipelineSchedule::OneFOneB, c.p, c.m, 1};
            Timing t1;
            bool ran = simulate(one, lists_of(one), 1.0, 2.0, &t1).empty();
            for (int s = 0; s < c.p && zb_slots.empty(); s++)
                if (t.total != 3 * c.m + c.p - 1 || t.total - t.busy[(size_t)s] != c.p - 1 || !ran ||
                    t1.total - t1.busy[(size_t)s] != 3 * (c.p - 1))
                    zb_slots = c.name() + strprintf(": stage %d idles %g of %g slots, 1F1B %g of %g", s, t.total - t.busy[(size_t)s],
                                                    t.total, t1.total - t1.busy[(size_t)s], t1.total);
        }
        if (c.v == 1 && !zb && simulate(c, lists, 1.0, 2.0, &t).empty())  // B twice F: the same fraction
            for (int s = 0; s < c.p && bubble_b2.empty(); s++)
                if (std::fabs(1.0 - t.busy[(size_t)s] / t.total - want) > 1e-12)
                    bubble_b2 = c.name() + strprintf(": stage %d idles %.4f with B = 2F", s, 1.0 - t.busy[(size_t)s] / t.total);
    }
    std::string n = strprintf(" (%zu schedules: GPipe, 1F1B, 2BW, interleaved v=2, ZB-H1; p = 2, 3, 4)", cases.size());
    check(order.empty(), "every (micro-batch, chunk) forward then backward, backwards in micro-batch order, peak in flight = "
                         "pipeline_live_micro_batches" + n, order);
    check(pairing.empty(), "the k-th send from a to b is the k-th receive at b from a, same tag and kind, every pair" + n, pairing);
    check(deadlock.empty(), "blocking sends completing with the next receive (the trainers' rule): every stage finishes" + n, deadlock);
    check(deps.empty(), "forward of (i, u+1) after (i, u), backward of (i, u) after (i, u+1), on the simulated clock" + n, deps);
    check(bubble.empty(), "F = B = 1: every stage idles exactly (p-1)/(vm+p-1) of the step" + n, bubble);
    check(zb_slots.empty(), "ZB-H1, F = B = W = 1: every stage idles p - 1 slots of 3m + p - 1 = (p-1)(F+B-W); 1F1B with "
                            "B + W = 2 idles 3(p - 1) = (p-1)(F+B+W)", zb_slots);
    check(bubble_b2.empty(), "B = 2F, GPipe and 1F1B: every stage idles exactly (p-1)/(m+p-1) of the step", bubble_b2);
    // PipeDream-2BW without the flush: 3 steps (the overlap at two boundaries), p = 2, 3, 4
    std::string bw_order, bw_pairing, bw_deadlock, bw_deps, bw_chained, bw_idle, bw_same;
    bool bw_two = true;
    const int STEPS = 3;
    for (int p : {2, 3, 4})
        for (int m : {p, 2 * p, p + 1}) {
            Case c = {PipelineSchedule::PipeDream2BW, p, m, 1};
            std::vector<std::vector<size_t>> cuts;
            Lists lists = two_bw_lists(p, m, STEPS, &cuts);
            bool two = true;
            std::string why = two_bw_order_problem(p, m, STEPS, lists, cuts, &two);
            bw_two = bw_two && two;
            if (!why.empty() && bw_order.empty()) bw_order = c.name() + ": " + why;
            why = pairing_problem(c, lists);
            if (!why.empty() && bw_pairing.empty()) bw_pairing = c.name() + ": " + why;
            // the trainer asks for one step's list at a time (filled after a step that did not drain)
            for (int s = 0; s < p && bw_chained.empty(); s++) {
                std::vector<PipeAction> chained;
                for (int t = 1; t <= STEPS; t++) {
                    std::vector<PipeAction> one = pipeline_2bw_steps(s, p, m, t, 1, t > 1, t == STEPS)[0];
                    chained.insert(chained.end(), one.begin(), one.end());
                }
                bool same = chained.size() == lists[(size_t)s].size();
                for (size_t k = 0; same && k < chained.size(); k++) {
                    const PipeAction &x = chained[k], &y = lists[(size_t)s][k];
                    same = x.op == y.op && x.micro == y.micro && x.step == y.step && x.version == y.version && x.tag == y.tag;
                }
                if (!same) bw_chained = c.name() + strprintf(": stage %d's step-by-step lists are not the %d-step list", s, STEPS);
            }
            // one step, drained: 1F1B's list (2bw-flush), action for action
            for (int s = 0; s < p && bw_same.empty(); s++) {
                std::vector<PipeAction> a = pipeline_2bw_steps(s, p, m, 1, 1, false, true)[0];
                std::vector<PipeAction> b = pipeline_schedule(PipelineSchedule::OneFOneB, s, p, m);
                bool same = a.size() == b.size();
                for (size_t k = 0; same && k < a.size(); k++)
                    same = a[k].op == b[k].op && a[k].micro == b[k].micro && a[k].peer == b[k].peer && a[k].tag == b[k].tag;
                if (!same) bw_same = c.name() + strprintf(": stage %d's drained step is not 1F1B's list", s);
            }
            for (double b : {1.0, 2.0}) {
                Timing t, t1;
                Case all = c;
                all.m = STEPS * m;  // (dependencies over every micro-batch of the steps)
                why = simulate(c, lists, 1.0, b, &t, true, 1.0, &cuts);
                if (!why.empty()) {
                    if (bw_deadlock.empty()) bw_deadlock = c.name() + ": " + why;
                    continue;
                }
                why = dependency_problem(all, t);
                if (!why.empty() && bw_deps.empty()) bw_deps = c.name() + ": " + why;
                // the idle slots: the first step's fill, (p-1)(F+B) as 1F1B's, then (p-1)B a step: the last stages
                // wait at the update for the first stage's last backwards, the first stage for the restart's first
                // gradient; 1F1B's flush costs (p-1)(F+B) every step
                double want = (p - 1) * (1.0 + b) + (STEPS - 1) * (p - 1) * b;
                for (int s = 0; s < p && bw_idle.empty(); s++)
                    if (t.total - t.busy[(size_t)s] != want || t.total != STEPS * m * (1.0 + b) + want)
                        bw_idle = c.name() + strprintf(", B = %g: stage %d idles %g of %g, the formula says %g", b, s,
                                                       t.total - t.busy[(size_t)s], t.total, want);
            }
        }
    check(bw_order.empty(), "PipeDream-2BW without the flush, 3 steps: each micro-batch forwarded then backwarded once, backwards in "
                            "order over the steps; every action reads W(step-2), made already, F and B of a micro-batch the same; "
                            "at most two versions alive per stage; in flight min(m, p-s) across the boundaries (p = 2, 3, 4; m = p, 2p, p+1)",
          bw_order);
    check(bw_two, "PipeDream-2BW without the flush: every stage holds two weight versions at once somewhere (the steps overlap)", "");
    check(bw_pairing.empty(), "PipeDream-2BW without the flush: the k-th send from a to b is the k-th receive at b from a, over 3 steps",
          bw_pairing);
    check(bw_deadlock.empty(), "PipeDream-2BW without the flush: the trainers' send rule and a meeting of all stages at each update: "
                               "every stage finishes (F = 1, B = 1 and 2)", bw_deadlock);
    check(bw_deps.empty(), "PipeDream-2BW without the flush: forward of (i, s+1) after (i, s), backward of (i, s) after (i, s+1)", bw_deps);
    check(bw_idle.empty(), "PipeDream-2BW without the flush, F = 1, B = 1 and 2, 3 steps: every stage idles (p-1)(F+B) + 2(p-1)B: "
                           "(p-1)B a step after the first, where 1F1B's flush idles (p-1)(F+B) every step", bw_idle);
    check(bw_chained.empty(), "PipeDream-2BW: the trainer's step-by-step lists (filled after a step that did not drain) chain into "
                              "the 3-step list, action for action", bw_chained);
    check(bw_same.empty(), "PipeDream-2BW, one step drained (2bw-flush): 1F1B's list, action for action", bw_same);
    // the control: the same simulator, every send blocking on its own (a send not paired with the
    // receive after it), deadlocks 1F1B on 2 stages: each stage's forward sends, the other waits to
    // send its gradient. The rule the trainers follow is what the lists rely on.
    Case control = {PipelineSchedule::OneFOneB, 2, 4, 1};
    Timing t;
    std::string why = simulate(control, lists_of(control), 1.0, 1.0, &t, false);
    check(why.rfind("deadlock", 0) == 0, "the control deadlocks: 1F1B, 2 stages, each send blocking alone", why.empty() ? "it ran" : why);
    check(std::fabs(pipeline_bubble_fraction(4, 4) - 3.0 / 7.0) < 1e-15 && pipeline_bubble_fraction(1, 8) == 0.0 &&
              std::fabs(pipeline_bubble_fraction(4, 8, 2) - 3.0 / 19.0) < 1e-15,
          "bubble: p=4, m=4 -> 3/7; one stage -> 0; interleaved p=4, m=8, v=2 -> 3/19", "");
    // ZB-H1 on 2 stages, 3 micro-batches, derived by hand on the unit clock: stage 1 lags its W's by one
    std::string zb;
    for (const PipeAction& a : pipeline_schedule(PipelineSchedule::ZeroBubbleH1, 1, 2, 3))
        if (pipe_is_compute(a.op)) zb += pipe_action_text(a, 1) + " ";
    check(zb == "F0 B0 F1 B1 W0 F2 B2 W1 W2 ", "ZB-H1 p=2 m=3, stage 1: F0 B0 F1 B1 W0 F2 B2 W1 W2 (by hand)", zb);
    return check_exit_code();
}
