// test_gpu_host.cu — the host-side parts of the GPU kernels' files, compiled by nvcc and run on the
// CPU (no GPU needed): the encoder backward's token buckets, which make its gradient deterministic
// (and a tensor rank's, of its vocabulary rows only); the GELU formula the kernels evaluate; cuDNN's
// version rules for the fused attention; and the pipeline's NCCL sends and receives, grouped as
// llmc/parallel/pipeline_parallel.cuh groups them, run against NCCL's rule for every schedule: no deadlock.
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>
#include "llmc/kernels/attention_cudnn.cuh"
#include "llmc/kernels/encoder.cuh"
#include "llmc/kernels/gelu.cuh"
#include "llmc/parallel/pipeline_parallel.cuh"

// ---- the pipeline's point-to-point traffic, simulated with NCCL's semantics: a stage's groups of
// sends and receives run in order on its stream; a group is posted when the one before it has
// completed, and completes once the peer of each of its operations has posted the matching one
// (the k-th send from a to b matches the k-th receive at b from a: NCCL has no tags). That is the
// worst case, a send that no buffer lets finish early.
struct P2P {
    bool send;
    int peer;
    bool activation;  // what it carries: an activation forward, or a gradient back
};
typedef std::vector<std::vector<P2P>> Groups;  // one stage's, in stream order

// The groups the trainer's forward_backward issues on `stage` (paired: sends wait for the next
// action's receive, llmc/parallel/pipeline_parallel.cuh; unpaired: every send issued at once, on its own).
static Groups stage_groups(PipelineSchedule kind, int stage, int stages, int m, bool paired) {
    bool first = stage == 0, last = stage == stages - 1;
    std::vector<PipeAction> order = pipeline_schedule(kind, stage, stages, m);
    Groups groups;
    std::vector<P2P> deferred;
    for (size_t k = 0; k < order.size(); k++) {
        const PipeAction& a = order[k];
        bool receives = a.forward ? !first : !last;
        if (receives) {  // the deferred sends and this receive, one group
            deferred.push_back({false, a.forward ? stage - 1 : stage + 1, a.forward});
            groups.push_back(deferred);
            deferred.clear();
        }
        bool sends = a.forward ? !last : !first;
        if (sends) {
            P2P send = {true, a.forward ? stage + 1 : stage - 1, a.forward};
            if (paired) deferred.push_back(send);
            else groups.push_back({send});
        }
        if (!deferred.empty() && !pipe_next_action_receives(order, k, first, last)) {
            groups.push_back(deferred);
            deferred.clear();
        }
    }
    return groups;
}

// Runs the stages' groups to the end; returns "" or what went wrong (a deadlock, a mismatch).
static std::string simulate_p2p(const std::vector<Groups>& stages) {
    int p = (int)stages.size();
    std::vector<size_t> at((size_t)p, 0);  // the group each stage's stream is at (posted)
    // ordinal[s][g][i]: which send from s to the peer (or receive at s from the peer) operation i is
    std::vector<std::vector<std::vector<int>>> ordinal((size_t)p);
    for (int s = 0; s < p; s++) {
        std::vector<int> sends((size_t)p, 0), recvs((size_t)p, 0);
        for (const std::vector<P2P>& g : stages[(size_t)s]) {
            std::vector<int> o;
            for (const P2P& op : g) o.push_back(op.send ? sends[(size_t)op.peer]++ : recvs[(size_t)op.peer]++);
            ordinal[(size_t)s].push_back(o);
        }
    }
    // where the matching operation is: (group) on the peer, or -1
    auto counterpart = [&](int s, size_t g, size_t i, bool* activation) -> long {
        const P2P& op = stages[(size_t)s][g][i];
        int want = ordinal[(size_t)s][g][i];
        for (size_t h = 0; h < stages[(size_t)op.peer].size(); h++)
            for (size_t j = 0; j < stages[(size_t)op.peer][h].size(); j++) {
                const P2P& other = stages[(size_t)op.peer][h][j];
                if (other.send != op.send && other.peer == s && ordinal[(size_t)op.peer][h][j] == want) {
                    *activation = other.activation;
                    return (long)h;
                }
            }
        return -1;
    };
    for (bool progress = true; progress;) {
        progress = false;
        for (int s = 0; s < p; s++) {
            if (at[(size_t)s] == stages[(size_t)s].size()) continue;
            bool complete = true;
            for (size_t i = 0; i < stages[(size_t)s][at[(size_t)s]].size(); i++) {
                bool activation = false;
                long h = counterpart(s, at[(size_t)s], i, &activation);
                if (h < 0) return strprintf("stage %d: an operation nobody matches", s);
                if (activation != stages[(size_t)s][at[(size_t)s]][i].activation) return strprintf("stage %d: an activation matched with a gradient", s);
                complete = complete && at[(size_t)stages[(size_t)s][at[(size_t)s]][i].peer] >= (size_t)h;
            }
            if (complete) at[(size_t)s]++, progress = true;
        }
    }
    for (int s = 0; s < p; s++)
        if (at[(size_t)s] < stages[(size_t)s].size()) return strprintf("deadlock: stage %d waits at group %zu of %zu", s, at[(size_t)s], stages[(size_t)s].size());
    return "";
}

int main() {
    int failures = 0;
    const int BT = 4096, V = 300;
    std::mt19937 rng(7);
    std::vector<int> tokens(BT);
    for (int& t : tokens) t = (int)(rng() % 64) * 4;  // repeated tokens, many absent ones
    std::vector<int> count, out(3 * BT + 1, -1);
    int U = encoder_buckets_build(tokens.data(), BT, V, &count, out.data());
    const int *positions = out.data(), *start = out.data() + BT, *token_of = out.data() + 2 * BT + 1;
    bool ok = start[0] == 0 && start[U] == BT;
    std::vector<int> seen(BT, 0);
    for (int u = 0; u < U && ok; u++) {
        ok &= start[u] < start[u + 1] && (u == 0 || token_of[u] > token_of[u - 1]);
        for (int i = start[u]; i < start[u + 1] && ok; i++) {
            ok &= tokens[positions[i]] == token_of[u];              // the bucket holds its token's positions
            ok &= i == start[u] || positions[i] > positions[i - 1];  // in ascending order: a fixed sum order
            seen[positions[i]]++;
        }
    }
    for (int s : seen) ok &= s == 1;  // every position exactly once
    printf(ok ? "PASS: encoder buckets group every position by token, in order\n"
              : "FAIL: encoder buckets group every position by token, in order: bad layout\n");
    failures += !ok;
    int distinct = 0;
    std::vector<int> present(V, 0);
    for (int t : tokens) distinct += present[t]++ == 0;
    bool count_ok = U == distinct;
    printf(count_ok ? "PASS: one bucket per distinct token\n" : "FAIL: one bucket per distinct token: %d vs %d\n", U, distinct);
    failures += !count_ok;

    // a tensor rank's buckets: only the tokens of its rows, numbered from its first row
    {
        const int first = 96, rows = 64;
        U = encoder_buckets_build(tokens.data(), BT, rows, &count, out.data(), first);
        bool rows_ok = true;
        int in_range = 0;
        for (int t : tokens) in_range += t >= first && t < first + rows;
        rows_ok = start[0] == 0 && start[U] == in_range;
        for (int u = 0; u < U && rows_ok; u++) {
            rows_ok &= token_of[u] >= 0 && token_of[u] < rows && (u == 0 || token_of[u] > token_of[u - 1]);
            for (int i = start[u]; i < start[u + 1] && rows_ok; i++) {
                rows_ok &= tokens[positions[i]] == first + token_of[u];
                rows_ok &= i == start[u] || positions[i] > positions[i - 1];
            }
        }
        printf(rows_ok ? "PASS: a tensor rank's encoder buckets hold its rows' tokens only (%d of %d positions)\n"
                       : "FAIL: a tensor rank's encoder buckets hold its rows' tokens only: bad layout (%d of %d)\n",
               in_range, BT);
        failures += !rows_ok;
    }

    // the pipeline's sends and receives: every schedule, 2 to 5 stages, p to 12 micro-batches
    {
        std::string bad;
        int runs = 0;
        for (PipelineSchedule kind : {PipelineSchedule::GPipe, PipelineSchedule::OneFOneB})
            for (int p = 2; p <= 5; p++)
                for (int m = p; m <= 12; m++) {
                    std::vector<Groups> stages;
                    for (int s = 0; s < p; s++) stages.push_back(stage_groups(kind, s, p, m, true));
                    std::string why = simulate_p2p(stages);
                    runs++;
                    if (!why.empty() && bad.empty()) bad = strprintf("%s p=%d m=%d: %s", pipeline_schedule_name(kind), p, m, why.c_str());
                }
        if (bad.empty()) printf("PASS: pipeline sends grouped with the next receive never deadlock under NCCL's rule (%d schedules)\n", runs);
        else printf("FAIL: pipeline sends grouped with the next receive never deadlock under NCCL's rule: %s\n", bad.c_str());
        failures += !bad.empty();
        std::vector<Groups> alone;  // the control: 1F1B with every send issued on its own
        for (int s = 0; s < 2; s++) alone.push_back(stage_groups(PipelineSchedule::OneFOneB, s, 2, 4, false));
        std::string why = simulate_p2p(alone);
        bool control = why.rfind("deadlock", 0) == 0;
        printf(control ? "PASS: the control deadlocks: 1F1B, 2 stages, sends not grouped (%s)\n"
                       : "FAIL: the control deadlocks: 1F1B, 2 stages, sends not grouped: %s\n", why.empty() ? "it ran" : why.c_str());
        failures += !control;
    }

    // GELU: the kernels' sigmoid form against GPT-2's tanh form, in double, value and derivative
    double worst_value = 0, worst_derivative = 0;
    for (int i = -4000; i <= 4000; i++) {
        double x = i / 400.0, u = std::sqrt(2.0 / M_PI) * (x + 0.044715 * x * x * x), th = std::tanh(u);
        double value = 0.5 * x * (1 + th);
        double derivative = 0.5 * (1 + th) + 0.5 * x * (1 - th * th) * std::sqrt(2.0 / M_PI) * (1 + 3 * 0.044715 * x * x);
        worst_value = std::max(worst_value, std::fabs(gelu_value((float)x) - value) / std::max(1.0, std::fabs(value)));
        worst_derivative = std::max(worst_derivative, std::fabs(gelu_derivative((float)x) - derivative));
    }
    bool gelu_ok = worst_value < 1e-6 && worst_derivative < 1e-5;  // fp32 evaluation: a few ulp
    printf(gelu_ok ? "PASS: the GELU kernels' formula is GPT-2's GELU and its derivative on [-10, 10]\n"
                   : "FAIL: the GELU kernels' formula is GPT-2's GELU and its derivative on [-10, 10]: errors %.2e %.2e\n",
           worst_value, worst_derivative);
    failures += !gelu_ok;
    bool tails_ok = gelu_value(-200.0f) == 0.0f && gelu_value(200.0f) == 200.0f && gelu_derivative(-200.0f) == 0.0f &&
                    gelu_derivative(200.0f) == 1.0f;
    printf(tails_ok ? "PASS: GELU far out: exp overflows to inf, no NaN\n" : "FAIL: GELU far out: exp overflows to inf, no NaN\n");
    failures += !tails_ok;

    // cuDNN: the versions whose attention this graph must not use, and the mask value
    bool versions_ok = cudnn_attention_version_problem(91900, 64).empty() &&
                       cudnn_attention_version_problem(91600, 50).empty() &&
                       cudnn_attention_version_problem(91500, 1024).empty() &&
                       !cudnn_attention_version_problem(91500, 64).empty() &&
                       !cudnn_attention_version_problem(91000, 1024).empty() &&
                       !cudnn_attention_version_problem(91001, 1024).empty() &&
                       !cudnn_attention_version_problem(8907, 1024).empty();
    printf(versions_ok ? "PASS: cuDNN versions with known attention bugs are refused\n"
                       : "FAIL: cuDNN versions with known attention bugs are refused\n");
    failures += !versions_ok;
    float mask = cudnn_mask_value();
    bool mask_ok = cudnnGetVersion() >= 91000 ? std::isinf(mask) && mask < 0 : mask == -3.402823466e38f;
    printf(mask_ok ? "PASS: the causal mask value follows the loaded cuDNN (%zu)\n"
                   : "FAIL: the causal mask value follows the loaded cuDNN (%zu)\n", cudnnGetVersion());
    failures += !mask_ok;
    return failures ? 1 : 0;
}
