// moe.h — a mixture-of-experts MLP: E copies of GPT-2's MLP ("experts") and a router that sends
// each token to k of them. The layer's math only, on the CPU in fp32; no communication (expert
// parallelism's all-to-all will hook in around it, llmc/parallel/, see docs/moe.md).
//
// What it teaches: how to grow a model's parameters without growing its compute per token. A dense
// MLP runs every token through all its weights; an MoE layer holds E MLPs and runs each token
// through k of them (k = 1 or 2), so it has E times the MLP's parameters at k times its FLOPs. The
// price is a routing decision (discrete, learned only through the gate), uneven loads (an expert
// can be flooded while another starves), and on many ranks an all-to-all to bring tokens to their
// experts.
//
// The math, for the N = B*T tokens of one micro-batch (rows x_t of the LayerNorm's output, C wide):
//   router     logits_t = x_t W_r^T          W_r (E, C), no bias (Switch's router has none), fp32
//              p_t = softmax(logits_t)
//   top-1      (Switch Transformers, Fedus et al. 2021): e = argmax p_t,   y_t = p_t,e E_e(x_t)
//   top-2      (GShard, Lepikhin et al. 2020): e1, e2 the two largest p_t,e, gates renormalised,
//              g_i = p_t,ei / (p_t,e1 + p_t,e2),   y_t = g_1 E_e1(x_t) + g_2 E_e2(x_t)
//              (GShard's random dispatch of the second expert is left out: deterministic top-2)
//   expert     E_e(x) = gelu(x W_fc,e^T + b_fc,e) W_proj,e^T + b_proj,e   (GPT-2's MLP, 4C hidden)
//   ties       the lowest expert index wins (a strict > scanning e = 0, 1, ...), so the routing is
//              a function of the logits alone, the same on every machine that computes the same floats
//   capacity   each expert takes at most cap = ceil(k N f / E) assignments (f the capacity factor,
//              over the N tokens this rank routes in one micro-batch; f = 0: no limit). Assignments
//              are accepted in a fixed order, the rest dropped: all first choices in token order
//              (position in the micro-batch, as Switch), then all second choices in token order (so a
//              token's first choice never loses its place to another token's second, as GShard).
//              A dropped assignment contributes nothing: a token with all its choices dropped gets
//              y_t = 0, and the residual stream carries it past the layer unchanged. The gates are
//              computed before dropping (a dropped second choice still renormalises the first).
//   load balance  (Switch eq. 4) L_aux = alpha E sum_i f_i P_i, with
//              f_i = (assignments routed to i, before dropping) / (k N)   no gradient (a count)
//              P_i = (1/N) sum_t p_t,i                                     the gradient's path
//              = alpha under uniform routing; its gradient pushes probability away from loaded
//              experts: d L_aux / d p_t,i = alpha E f_i / N. alpha default 1e-2.
//   z-loss     (ST-MoE, Zoph et al. 2022) L_z = c_z (1/N) sum_t logsumexp(logits_t)^2: keeps the
//              router's logits small, so fp32 softmax stays accurate. c_z default 1e-3.
// Both are added to the optimised loss (the caller says with what weight: moe_backward's aux_scale
// is d(optimised loss)/d(L_aux + L_z) of this micro-batch) and reported apart from the LM loss.
//
// Backward, given dy = d loss / d y:
//   expert rows     d out_row = g dy_t, then the MLP's backward (the dense layer's own functions)
//   gate            d g = dy_t . E_e(x_t)   (this is how the router learns from the LM loss: only
//                   through the gate's value; the choice itself has no gradient)
//   top-2 renorm    s = p1 + p2:  d p1 = p2 (dg1 - dg2) / s^2,  d p2 = p1 (dg2 - dg1) / s^2
//   aux, z          d p_t,i += aux_scale alpha E f_i / N;   d logits_t += aux_scale 2 c_z lse_t p_t / N
//   softmax         d logits_t = p_t * (d p_t - p_t . d p_t)
//   input           d x_t = sum over kept choices of (expert's d x rows) + d logits_t W_r
//
// E = 1, top-1, no dropping is the dense MLP exactly: softmax of one logit is exp(0)/exp(0) = 1, the
// gate multiplies by 1, the rows are gathered in token order (the same matrix the dense layer
// multiplies), and d logits = 1 * (dp - 1 * dp) = 0, so the router adds zeros to dx. Bit for bit,
// when the z-loss is off: with it, a single logit still has a gradient (it pulls it toward 0).
//
// Trade-off: parameters E x the MLP's, FLOPs per token k x the MLP's (plus the router's 2 C E), and
// activations per MoE layer k x the MLP's (the rows gathered per expert, their hidden units before
// and after GELU, and their outputs, k N (2C + 8C) floats) plus N (2E + 3k) small ones. The gather
// and scatter are memory copies a dense layer does not need; the matmuls are per expert, on fewer
// rows each, so less efficient than one big one.
//
// Recompute (--recompute 1|2, llmc/model/recompute.h): the layer is never run again in the backward;
// MoEActivations is kept at every level, so the routing (and its drops) is the forward's and the
// auxiliary losses are added once (a re-run forward added them twice in Megatron-LM, issue 1330).
//
// Hook points: none yet. train_gpt_cpu.cpp calls it in place of the dense MLP's two matmuls and GELU
// (between the second LayerNorm and the residual add) of every MoE block; expert parallelism's
// dispatch and combine will be a pair of hooks around the experts' matmuls (docs/adding-a-technique.md
// section 2).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/model/cpu_layers.h"  // matmul_forward/backward, gelu_forward/backward: the dense MLP's own
#include "llmc/probes/poison.h"   // tests only: fresh rows as NaN
#include "llmc/utils.h"               // usage_fail: one line, exit 2

namespace cpu {

struct MoEShape {
    int experts = 1;               // E
    int top_k = 1;                 // k: 1 (Switch) or 2 (GShard)
    float capacity_factor = 0.0f;  // f; 0 = no dropping
    float aux_alpha = 1e-2f;       // alpha of the load-balancing loss
    float z_loss = 1e-3f;          // c_z of the router z-loss
};

// The weights of one MoE layer: the router, expert 0's four tensors, and experts 1 .. E-1's stacked
// (expert e >= 1 at (e - 1) * (its size)). Two places, not one array of E, because in the trainer
// expert 0 is the dense table's MLP of the block (llmc/model/model.h) and the others are in the MoE
// table; moe_weights_stacked points at E experts that lie one after another.
template <typename T>
struct MoEWeights {
    T* router;                           // (E, C)
    T* fcw; T* fcb; T* projw; T* projb;  // expert 0: (H, C), (H), (C, H), (C)   H = 4C hidden units
    T* more_fcw; T* more_fcb; T* more_projw; T* more_projb;  // experts 1 .. E-1: (E-1, H, C), ...
    int more_first = 1;   // the expert more_*[0] is: 1, or with expert parallelism the first this rank holds
};

template <typename T>
inline MoEWeights<T> moe_weights_stacked(T* router, T* fcw, T* fcb, T* projw, T* projb, size_t C, size_t H) {
    return {router, fcw, fcb, projw, projb, fcw + H * C, fcb + H, projw + C * H, projb + C};
}

// Expert e's four tensors: expert 0's, or its place among the stacked others (which start at expert
// more_first: a rank that holds only its own experts never asks for another's).
template <typename T>
struct Expert { T* fcw; T* fcb; T* projw; T* projb; };
template <typename T>
inline Expert<T> expert_of(const MoEWeights<T>& w, int e, size_t C, size_t H) {
    if (e == 0) return {w.fcw, w.fcb, w.projw, w.projb};
    size_t i = (size_t)(e - w.more_first);
    return {w.more_fcw + i * H * C, w.more_fcb + i * H, w.more_projw + i * C * H, w.more_projb + i * C};
}

// What one micro-batch's forward leaves for its backward (sized once by moe_allocate for N tokens:
// nothing grows while training), and the backward's scratch.
struct MoEActivations {
    int N = 0, C = 0, H = 0, capacity = 0;
    std::vector<float> logits, probs;     // (N, E)
    std::vector<float> lse;               // (N)     logsumexp of the logits, for the z-loss
    std::vector<int> choice;              // (N, k)  expert of each choice, best first
    std::vector<float> gate;              // (N, k)  its gate (p, or renormalised for top-2)
    std::vector<int> row;                 // (N, k)  its row among the gathered rows, -1 if dropped
    std::vector<int> routed, kept;        // (E)     assignments before / after dropping
    std::vector<int> first_row;           // (E+1)   expert e's rows are first_row[e] .. first_row[e+1]-1
    std::vector<int> token_of_row;        // (kN)
    std::vector<float> xg, fch, fch_gelu, eout;   // (kN, C), (kN, H), (kN, H), (kN, C)
    // backward scratch
    std::vector<float> drow, dh, dxg;     // (kN, C), (kN, H), (kN, C)
    std::vector<float> dgate;             // (N, k)
    std::vector<float> dprobs, dlogits, dx_router;  // (N, E), (N, E), (N, C)
};

// What the step reports about one layer's routing (and the two losses the optimiser also sees).
struct MoEStats {
    double aux_loss = 0.0, z_loss = 0.0;   // alpha E sum f_i P_i,  c_z mean lse^2
    int dropped = 0;                       // assignments over capacity
    int min_load = 0, max_load = 0;        // kept assignments of the least and the most loaded expert
};

// What is wrong with a shape, in one line naming the flag that sets it and the fix; empty if nothing.
// (The CPU trainer checks its --moe-* flags with it before anything is allocated; moe_allocate refuses
// a bad shape too, so no caller reaches the routing with, say, a second choice among one expert.)
inline std::string moe_shape_problem(const MoEShape& s) {
    if (s.experts < 1) return "--moe-experts " + std::to_string(s.experts) + ": an MoE layer needs at least 1 expert";
    if (s.top_k != 1 && s.top_k != 2)
        return "--moe-top-k " + std::to_string(s.top_k) + ": top-1 (Switch) and top-2 (GShard) are the routings here; use 1 or 2";
    if (s.top_k > s.experts)
        return "--moe-top-k 2 needs at least 2 experts (--moe-experts " + std::to_string(s.experts) + "); use --moe-top-k 1";
    if (!(s.capacity_factor >= 0.0f) || !std::isfinite(s.capacity_factor))
        return strprintf("--moe-capacity-factor %g: must be 0 (or none: no dropping) or positive", s.capacity_factor);
    if (!(s.aux_alpha >= 0.0f) || !std::isfinite(s.aux_alpha)) return "--moe-aux-alpha must be 0 or positive";
    if (!(s.z_loss >= 0.0f) || !std::isfinite(s.z_loss)) return "--moe-z-loss must be 0 or positive";
    return "";
}

// Assignments an expert may take: ceil(k N f / E), computed in double in that order; f <= 0 means
// no limit (N: a token never chooses one expert twice, so no expert can receive more).
inline int moe_capacity(int N, int k, int E, float f) {
    if (f <= 0.0f) return N;
    return (int)std::ceil((double)k * N * (double)f / E);
}

inline void moe_allocate(MoEActivations* a, const MoEShape& s, int N, int C, int H) {
    std::string why = moe_shape_problem(s);
    if (!why.empty()) usage_fail(why);
    size_t E = s.experts, k = s.top_k, rows = k * N;
    a->N = N; a->C = C; a->H = H;
    a->logits.assign(N * E, 0.0f); a->probs.assign(N * E, 0.0f); a->lse.assign(N, 0.0f);
    a->choice.assign(rows, 0); a->gate.assign(rows, 0.0f); a->row.assign(rows, -1);
    a->routed.assign(E, 0); a->kept.assign(E, 0); a->first_row.assign(E + 1, 0); a->token_of_row.assign(rows, 0);
    a->xg.assign(rows * C, 0.0f); a->fch.assign(rows * H, 0.0f); a->fch_gelu.assign(rows * H, 0.0f);
    a->eout.assign(rows * C, 0.0f);
    a->drow.assign(rows * C, 0.0f); a->dh.assign(rows * H, 0.0f); a->dxg.assign(rows * C, 0.0f);
    a->dgate.assign(rows, 0.0f); a->dprobs.assign(N * E, 0.0f); a->dlogits.assign(N * E, 0.0f); a->dx_router.assign((size_t)N * C, 0.0f);
    poison_fresh(&a->logits, &a->probs, &a->lse, &a->gate, &a->xg, &a->fch, &a->fch_gelu, &a->eout, &a->drow, &a->dh, &a->dxg,
                 &a->dgate, &a->dprobs, &a->dlogits, &a->dx_router);  // tests: NaN (llmc/probes/poison.h)
}

// The router: logits, softmax (fp32, max-subtracted), the top-k choices and their gates.
inline void moe_route(MoEActivations* a, const MoEShape& s, const float* x, const float* router) {
    int N = a->N, C = a->C, E = s.experts, k = s.top_k;
    matmul_forward(a->logits.data(), x, router, nullptr, N, C, E);
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        const float* z = a->logits.data() + (size_t)t * E;
        float* p = a->probs.data() + (size_t)t * E;
        float zmax = z[0];
        for (int e = 1; e < E; e++) zmax = std::max(zmax, z[e]);
        float sum = 0.0f;
        for (int e = 0; e < E; e++) { p[e] = std::exp(z[e] - zmax); sum += p[e]; }
        for (int e = 0; e < E; e++) p[e] /= sum;
        a->lse[t] = zmax + std::log(sum);
        int best = 0, second = -1;
        for (int e = 1; e < E; e++) if (p[e] > p[best]) best = e;   // strict >: the lowest index wins a tie
        if (k == 2) {
            for (int e = 0; e < E; e++) if (e != best && (second < 0 || p[e] > p[second])) second = e;
        }
        a->choice[(size_t)t * k] = best;
        if (k == 1) {
            a->gate[t] = p[best];   // Switch: the probability itself, so the LM loss trains the router
        } else {
            a->choice[(size_t)t * k + 1] = second;
            float s2 = p[best] + p[second];
            a->gate[(size_t)t * k] = p[best] / s2;
            a->gate[(size_t)t * k + 1] = p[second] / s2;
        }
    }
}

// Capacity: accept choices in the stated order (choice 0 of every token by position, then choice
// 1), give each accepted one its row, grouped by expert in the order accepted.
inline void moe_dispatch(MoEActivations* a, const MoEShape& s) {
    int N = a->N, E = s.experts, k = s.top_k;
    a->capacity = moe_capacity(N, k, E, s.capacity_factor);
    std::fill(a->routed.begin(), a->routed.end(), 0);
    std::fill(a->kept.begin(), a->kept.end(), 0);
    // first pass: which assignments fit, and each one's place within its expert
    for (int j = 0; j < k; j++)
        for (int t = 0; t < N; t++) {
            size_t c = (size_t)t * k + j;
            int e = a->choice[c];
            a->routed[e]++;
            a->row[c] = a->kept[e] < a->capacity ? a->kept[e]++ : -1;
        }
    a->first_row[0] = 0;
    for (int e = 0; e < E; e++) a->first_row[e + 1] = a->first_row[e] + a->kept[e];
    for (size_t c = 0; c < (size_t)N * k; c++) {
        if (a->row[c] < 0) continue;
        a->row[c] += a->first_row[a->choice[c]];   // place within expert -> row among all
        a->token_of_row[a->row[c]] = (int)(c / k);
    }
}

// One expert's MLP over n rows x (n, C): its hidden units before and after GELU (n, H), kept for
// the backward, and its output (n, C). The rows may be this rank's own (moe_forward) or, with expert
// parallelism, those other ranks sent to the expert's owner (llmc/parallel/expert_parallel.h).
inline void moe_expert_forward(const MoEWeights<const float>& w, int e, int n, int C, int H, const float* x, float* fch,
                               float* fch_gelu, float* out) {
    if (n == 0) return;   // an expert no token reached: no work, and its gradient stays zero
    Expert<const float> p = expert_of(w, e, C, H);
    matmul_forward(fch, x, p.fcw, p.fcb, n, C, H);
    gelu_forward(fch_gelu, fch, (size_t)n * H);
    matmul_forward(out, fch_gelu, p.projw, p.projb, n, H, C);
}

// Its backward: dx (n, C) from the rows' output gradients dout (n, C); the weights' gradients added
// to g's expert e; dh (n, H) scratch.
inline void moe_expert_backward(const MoEWeights<float>& g, const MoEWeights<const float>& w, int e, int n, int C, int H,
                                const float* dout, const float* x, const float* fch, const float* fch_gelu, float* dh, float* dx) {
    if (n == 0) return;
    Expert<const float> p = expert_of(w, e, C, H);
    Expert<float> d = expert_of(g, e, C, H);
    matmul_backward(dh, d.projw, d.projb, dout, fch_gelu, p.projw, n, H, C);
    gelu_backward(dh, fch, dh, (size_t)n * H);
    matmul_backward(dx, d.fcw, d.fcb, dh, x, p.fcw, n, C, H);
}

// The forward in three parts, so expert parallelism can run the middle one on other ranks:
//   moe_forward_route    route x, drop over capacity, gather each expert's rows into a->xg
//   (the experts)        a->eout's rows = each expert's MLP of a->xg's
//   moe_forward_combine  y = the gated sum of the outputs; the step's statistics
inline void moe_forward_route(MoEActivations* a, const MoEShape& s, const MoEWeights<const float>& w, const float* x) {
    int C = a->C;
    moe_route(a, s, x, w.router);
    moe_dispatch(a, s);
    int rows = a->first_row[s.experts];
    // gather: each expert's tokens into contiguous rows, so it runs as one matmul
    #pragma omp parallel for schedule(static)
    for (int r = 0; r < rows; r++) memcpy(&a->xg[(size_t)r * C], x + (size_t)a->token_of_row[r] * C, C * sizeof(float));
}

inline MoEStats moe_forward_combine(float* y, MoEActivations* a, const MoEShape& s) {
    int N = a->N, C = a->C, E = s.experts, k = s.top_k;
    int rows = a->first_row[E];
    // combine: y_t = sum of gate * expert output over the kept choices (0 for a token all dropped)
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        float* yt = y + (size_t)t * C;
        bool first = true;
        for (int j = 0; j < k; j++) {
            int r = a->row[(size_t)t * k + j];
            if (r < 0) continue;
            float g = a->gate[(size_t)t * k + j];
            const float* o = &a->eout[(size_t)r * C];
            for (int i = 0; i < C; i++) yt[i] = first ? g * o[i] : yt[i] + g * o[i];
            first = false;
        }
        if (first) memset(yt, 0, C * sizeof(float));
    }
    MoEStats st;
    double balance = 0.0, z = 0.0;
    for (int e = 0; e < E; e++) {
        double P = 0.0;
        for (int t = 0; t < N; t++) P += a->probs[(size_t)t * E + e];
        balance += (double)a->routed[e] / ((double)k * N) * (P / N);
    }
    for (int t = 0; t < N; t++) z += (double)a->lse[t] * a->lse[t];
    st.aux_loss = (double)s.aux_alpha * E * balance;
    st.z_loss = (double)s.z_loss * z / N;
    st.min_load = *std::min_element(a->kept.begin(), a->kept.end());
    st.max_load = *std::max_element(a->kept.begin(), a->kept.end());
    st.dropped = N * k - rows;
    return st;
}


// Forward: y (N, C) = the MoE MLP of x (N, C), the layer's input (kept by the caller for the
// backward, as the dense MLP's ln2). Returns the routing's statistics and the two auxiliary losses.
inline MoEStats moe_forward(float* y, MoEActivations* a, const MoEShape& s, const MoEWeights<const float>& w,
                            const float* x) {
    int C = a->C, H = a->H;
    moe_forward_route(a, s, w, x);
    for (int e = 0; e < s.experts; e++) {
        size_t r0 = a->first_row[e];
        moe_expert_forward(w, e, a->kept[e], C, H, &a->xg[r0 * C], &a->fch[r0 * H], &a->fch_gelu[r0 * H], &a->eout[r0 * C]);
    }
    return moe_forward_combine(y, a, s);
}

// Generation (--generate, llmc/run/generate.h): the n new tokens of a step (a prompt's prefill, or
// one token while decoding) through the layer, with `a` allocated for up to the context's N rows.
// Routing as in training (the same router, the same top-k gates), but nothing is dropped: capacity
// is a training device that bounds each expert's rows per batch so the work splits evenly, and it
// makes a token's output depend on the other tokens routed with it. Here that would be wrong twice:
// the same prompt would route differently fed as one prefill or token by token (so the KV cache
// would no longer match the full forward), and since all first choices are accepted before any
// second choice, a later token could push out an earlier token's second expert, letting the
// future change the past in a causal model. With no dropping every token's output is a function of
// its own row alone. (One token decoding alone could never be dropped anyway: ceil(k f / E) >= 1.)
// So `s` has capacity_factor 0 (llmc/run/moe_run.h's moe_generation_shape, which the recomputing
// path --kv-cache 0 uses too, so that both route alike).
inline MoEStats moe_forward_new_rows(float* y, MoEActivations* a, const MoEShape& s, const MoEWeights<const float>& w,
                                     const float* x, int n) {
    a->N = n;  // the buffers hold the context's rows; this step uses the first n (all the routing reads)
    return moe_forward(y, a, s, w, x);
}

// The backward in three parts, as the forward:
//   moe_backward_rows   each kept row's output gradient a->drow, and the gates' gradients
//   (the experts)       a->dxg's rows = each expert's backward of a->drow's
//   moe_backward_input  the router's gradient, dx = the rows scattered back plus the router's
inline void moe_backward_rows(MoEActivations* a, const MoEShape& s, const float* dy) {
    int N = a->N, C = a->C, k = s.top_k;
    // each kept row's output gradient, gate times dy; and the gate's gradient, dy . expert output
    std::vector<float>& dgate = a->dgate;
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        for (int j = 0; j < k; j++) {
            size_t c = (size_t)t * k + j;
            int r = a->row[c];
            float dg = 0.0f;   // a dropped choice had no output: no gradient through its gate
            if (r >= 0) {
                const float* dyt = dy + (size_t)t * C;
                const float* o = &a->eout[(size_t)r * C];
                float* d = &a->drow[(size_t)r * C];
                for (int i = 0; i < C; i++) { d[i] = a->gate[c] * dyt[i]; dg += dyt[i] * o[i]; }
            }
            dgate[c] = dg;
        }
    }
}

// One token's router gradient, the formulas above in this order: dz (E) = d loss / d logits from
// its probabilities p (E), its k choices ch and their gates' gradients dg, and the experts' routed
// counts; dp (E) is scratch. The GPU's moe_router_backward_kernel (llmc/kernels/moe.cuh) calls this
// same function, so both trainers compute the same floats from the same inputs.
#ifdef __CUDACC__
__host__ __device__
#endif
inline void moe_router_grad_token(float* dz, float* dp, const float* p, const int* ch, const float* dg, const int* routed,
                                  float lse, int N, int E, int k, float alpha, float z_coef, float aux_scale) {
    for (int e = 0; e < E; e++) dp[e] = aux_scale * alpha * E * ((float)routed[e] / ((float)k * N)) / N;
    if (k == 1) {
        dp[ch[0]] += dg[0];
    } else {
        float p1 = p[ch[0]], p2 = p[ch[1]], s2 = p1 + p2, inv = 1.0f / (s2 * s2);
        dp[ch[0]] += p2 * (dg[0] - dg[1]) * inv;
        dp[ch[1]] += p1 * (dg[1] - dg[0]) * inv;
    }
    float dot = 0.0f;
    for (int e = 0; e < E; e++) dot += p[e] * dp[e];
    float zg = aux_scale * 2.0f * z_coef * lse / N;
    for (int e = 0; e < E; e++) dz[e] = p[e] * (dp[e] - dot) + zg * p[e];
}

inline void moe_backward_input(float* dx, const MoEWeights<float>& g, MoEActivations* a, const MoEShape& s,
                               const MoEWeights<const float>& w, const float* x, float aux_scale) {
    int N = a->N, C = a->C, E = s.experts, k = s.top_k;
    const std::vector<float>& dgate = a->dgate;
    // the probabilities' gradient: through the gates, the load-balancing loss, then the softmax and
    // the z-loss onto the logits
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        const float* p = &a->probs[(size_t)t * E];
        float* dp = &a->dprobs[(size_t)t * E];
        float* dz = &a->dlogits[(size_t)t * E];
        moe_router_grad_token(dz, dp, p, &a->choice[(size_t)t * k], &dgate[(size_t)t * k], a->routed.data(), a->lse[t], N, E, k,
                              s.aux_alpha, s.z_loss, aux_scale);
    }
    // the input: the experts' dx rows scattered back to their tokens, plus the router's
    matmul_backward(a->dx_router.data(), g.router, nullptr, a->dlogits.data(), x, w.router, N, C, E);
    #pragma omp parallel for schedule(static)
    for (int t = 0; t < N; t++) {
        float* dxt = dx + (size_t)t * C;
        const float* dr = &a->dx_router[(size_t)t * C];
        bool first = true;
        for (int j = 0; j < k; j++) {
            int r = a->row[(size_t)t * k + j];
            if (r < 0) continue;
            const float* d = &a->dxg[(size_t)r * C];
            for (int i = 0; i < C; i++) dxt[i] = first ? d[i] : dxt[i] + d[i];
            first = false;
        }
        for (int i = 0; i < C; i++) dxt[i] = first ? dr[i] : dxt[i] + dr[i];
    }
}


// Backward: dx (N, C) = d loss / d x (overwritten); the weights' gradients ADDED to g (micro-batches
// accumulate). dy = d loss / d y; aux_scale = d(optimised loss) / d(L_aux + L_z) of this micro-batch.
inline void moe_backward(float* dx, const MoEWeights<float>& g, MoEActivations* a, const MoEShape& s,
                         const MoEWeights<const float>& w, const float* x, const float* dy, float aux_scale) {
    int C = a->C, H = a->H;
    moe_backward_rows(a, s, dy);
    for (int e = 0; e < s.experts; e++) {
        size_t r0 = a->first_row[e];
        moe_expert_backward(g, w, e, a->kept[e], C, H, &a->drow[r0 * C], &a->xg[r0 * C], &a->fch[r0 * H], &a->fch_gelu[r0 * H],
                            &a->dh[r0 * H], &a->dxg[r0 * C]);
    }
    moe_backward_input(dx, g, a, s, w, x, aux_scale);
}

}  // namespace cpu
