// test_moe_layer.cpp — the mixture-of-experts layer (llmc/model/moe.h) on its own (test_moe_trainer.py tests it in the CPU trainer).
//
// Run with no arguments (as test/run_tests.py does), it checks what needs no other program:
//   dense     E = 1, top-1, no dropping, z-loss 0 is the dense MLP (the trainer's own calls:
//             matmul_forward, gelu, matmul_forward + bias) bit for bit: output, input gradient and
//             every weight gradient. The single expert is given the dense MLP's weights.
//   fd        the backward against central finite differences of the layer's loss
//             sum(y * r) + L_aux + L_z, along a random direction per tensor (x, router, fc, proj),
//             top-1 and top-2, with capacity drops; the routing must not change under the nudges
//             (checked: a discrete switch would make the difference meaningless)
//   counts    the routing's counters (routed, kept per expert, dropped, least and most load, each
//             expert's rows) against a recount from the choices and the capacity rule (planted
//             once: routed counting only the kept assignments; the other checks passed, this failed)
//   empty     an expert no token reaches (its router row pushed far down): no rows, gradients of its
//             MLP exactly zero, everything finite, and the finite differences still agree
// Run as `test_moe_layer --dump IN OUT`, it is the harness test/test_moe.py drives: one forward and
// backward on the tensors in IN, everything the reference compares written to OUT (formats in
// test_moe.py). `test_moe_layer --bench N C E k f REPS` times the layer's forward + backward against
// the dense MLP's, alternating (scripts/bench_moe_layer.py runs it; not a test).
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/model/model.h"  // normal_from_counter: the project's counter-based random numbers
#include "llmc/model/moe.h"

using namespace cpu;

static int failures = 0;
static void report(bool ok, const char* name, const char* detail) {
    if (ok) printf("PASS: %s (%s)\n", name, detail);
    else { printf("FAIL: %s: %s\n", name, detail); failures++; }
}

struct Layer {
    MoEShape s;
    int N, C, H;
    std::vector<float> router, fcw, fcb, projw, projb;
    std::vector<float> grouter, gfcw, gfcb, gprojw, gprojb;
    MoEWeights<const float> w() const {
        return moe_weights_stacked(router.data(), fcw.data(), fcb.data(), projw.data(), projb.data(), C, H);
    }
    MoEWeights<float> g() {
        return moe_weights_stacked(grouter.data(), gfcw.data(), gfcb.data(), gprojw.data(), gprojb.data(), C, H);
    }
    void zero_grads() {
        for (auto* v : {&grouter, &gfcw, &gfcb, &gprojw, &gprojb}) std::fill(v->begin(), v->end(), 0.0f);
    }
};

static void fill(std::vector<float>* v, size_t n, uint64_t seed, float scale) {
    v->resize(n);
    for (size_t i = 0; i < n; i++) (*v)[i] = scale * normal_from_counter(seed, i);
}

static Layer make_layer(MoEShape s, int N, int C, uint64_t seed) {
    Layer l;
    l.s = s; l.N = N; l.C = C; l.H = 4 * C;
    size_t E = s.experts, H = l.H;
    // larger than GPT-2's 0.02, so the tiny layer is clearly nonlinear and its gradients stand out of fp32 rounding
    fill(&l.router, E * C, seed + 1, 0.5f);
    fill(&l.fcw, E * H * C, seed + 2, 0.3f);
    fill(&l.fcb, E * H, seed + 3, 0.1f);
    fill(&l.projw, E * C * H, seed + 4, 0.2f);
    fill(&l.projb, E * C, seed + 5, 0.1f);
    l.grouter.assign(l.router.size(), 0.0f); l.gfcw.assign(l.fcw.size(), 0.0f); l.gfcb.assign(l.fcb.size(), 0.0f);
    l.gprojw.assign(l.projw.size(), 0.0f); l.gprojb.assign(l.projb.size(), 0.0f);
    return l;
}

// ---------------------------------------------------------------------------------------------
// dense: E = 1 against the trainer's dense MLP calls

static void check_dense() {
    int N = 24, C = 16, H = 64;
    MoEShape s;
    s.experts = 1; s.top_k = 1; s.capacity_factor = 0.0f; s.z_loss = 0.0f;   // alpha stays: its gradient is 0 at E = 1
    Layer l = make_layer(s, N, C, 100);
    std::vector<float> x, dy;
    fill(&x, (size_t)N * C, 7, 1.0f);
    fill(&dy, (size_t)N * C, 8, 1.0f);
    // the dense MLP, as train_gpt_cpu.cpp's gpt2_forward / gpt2_backward call it
    std::vector<float> fch(N * H), fch_gelu(N * H), y_dense(N * C), dh(N * H), dx_dense(N * C);
    std::vector<float> gfcw(H * C, 0.0f), gfcb(H, 0.0f), gprojw(C * H, 0.0f), gprojb(C, 0.0f);
    matmul_forward(fch.data(), x.data(), l.fcw.data(), l.fcb.data(), N, C, H);
    gelu_forward(fch_gelu.data(), fch.data(), (size_t)N * H);
    matmul_forward(y_dense.data(), fch_gelu.data(), l.projw.data(), nullptr, N, H, C);
    add_bias(y_dense.data(), l.projb.data(), N, C);
    matmul_backward(dh.data(), gprojw.data(), gprojb.data(), dy.data(), fch_gelu.data(), l.projw.data(), N, H, C);
    gelu_backward(dh.data(), fch.data(), dh.data(), (size_t)N * H);
    matmul_backward(dx_dense.data(), gfcw.data(), gfcb.data(), dh.data(), x.data(), l.fcw.data(), N, C, H);
    // the MoE layer with one expert holding the same weights
    MoEActivations a;
    moe_allocate(&a, s, N, C, H);
    std::vector<float> y(N * C), dx(N * C);
    moe_forward(y.data(), &a, s, l.w(), x.data());
    moe_backward(dx.data(), l.g(), &a, s, l.w(), x.data(), dy.data(), 1.0f);
    auto same = [](const std::vector<float>& p, const std::vector<float>& q) {
        for (size_t i = 0; i < p.size(); i++) if (!(p[i] == q[i])) return false;   // == : +0 and -0 are one value
        return true;
    };
    bool ok = same(y, y_dense) && same(dx, dx_dense) && same(l.gfcw, gfcw) && same(l.gfcb, gfcb) &&
              same(l.gprojw, gprojw) && same(l.gprojb, gprojb);
    bool router_zero = true;
    for (float v : l.grouter) router_zero = router_zero && v == 0.0f;
    report(ok, "E=1 top-1 no dropping equals the dense MLP bit for bit", ok ? "output, dx, fc and proj gradients" : "differs");
    report(router_zero, "E=1: the router's gradient is exactly zero (softmax of one logit is constant)", "z-loss 0");
}

// ---------------------------------------------------------------------------------------------
// counts: the routing's counters against a recount from the choices (the statistics the trainer
// reports and sums over blocks, micro-batches and ranks: llmc/run/moe_run.h)

static void check_counts(const char* name, const MoEActivations& a, const MoEStats& st, const MoEShape& s) {
    int E = s.experts, k = s.top_k, kN = a.N * k;
    std::vector<int> routed(E, 0), kept(E, 0);
    int dropped_rows = 0;
    for (int c = 0; c < kN; c++) {
        routed[a.choice[c]]++;
        if (a.row[c] < 0) dropped_rows++;
        else kept[a.choice[c]]++;
    }
    bool ok = a.routed == routed && a.kept == kept, rows_ok = true;
    int dropped = 0, lo = kN, hi = 0;
    for (int e = 0; e < E; e++) {
        ok = ok && kept[e] == std::min(routed[e], a.capacity);  // an expert fills up to its capacity, no further
        dropped += routed[e] - kept[e];
        lo = std::min(lo, kept[e]), hi = std::max(hi, kept[e]);
        ok = ok && a.first_row[e + 1] - a.first_row[e] == kept[e];
    }
    for (int c = 0; c < kN; c++)  // each kept assignment's row: within its expert's rows, holding its token
        if (a.row[c] >= 0)
            rows_ok = rows_ok && a.row[c] >= a.first_row[a.choice[c]] && a.row[c] < a.first_row[a.choice[c] + 1] &&
                      a.token_of_row[a.row[c]] == c / k;
    ok = ok && rows_ok && dropped == dropped_rows && st.dropped == dropped && st.min_load == lo && st.max_load == hi &&
         a.first_row[E] == kN - dropped;
    char detail[160];
    snprintf(detail, sizeof detail, "%d assignments, capacity %d: kept %d, dropped %d, load %d..%d", kN, a.capacity, kN - dropped,
             st.dropped, st.min_load, st.max_load);
    report(ok, (std::string(name) + ": routed, kept, dropped and the loads equal a recount from the choices").c_str(), detail);
}

// ---------------------------------------------------------------------------------------------
// fd: finite differences of loss = sum(y * r) + L_aux + L_z

static double layer_loss(Layer& l, MoEActivations* a, const std::vector<float>& x, const std::vector<float>& r,
                         std::vector<int>* routing) {
    std::vector<float> y((size_t)l.N * l.C);
    MoEStats st = moe_forward(y.data(), a, l.s, l.w(), x.data());
    double loss = st.aux_loss + st.z_loss;
    for (size_t i = 0; i < y.size(); i++) loss += (double)y[i] * r[i];
    if (routing) {
        routing->assign(a->choice.begin(), a->choice.end());
        routing->insert(routing->end(), a->row.begin(), a->row.end());
    }
    return loss;
}

static void check_fd(const char* name, MoEShape s, bool starve_last) {
    int N = 32, C = 8;
    // (the seeds leave no choice within a nudge of a tie: the routing check below says if one is)
    Layer l = make_layer(s, N, C, 200 + s.top_k + (starve_last ? 10 : 0));
    std::vector<float> x, r;
    fill(&x, (size_t)N * C, 11, 1.0f);
    fill(&r, (size_t)N * C, 12, 1.0f);
    if (starve_last) {   // channel 0 of every token is 1, and the last expert's router weight on it is -50
        for (int t = 0; t < N; t++) x[(size_t)t * C] = 1.0f;
        for (int e = 0; e < s.experts; e++) l.router[(size_t)e * C] = e == s.experts - 1 ? -50.0f : 0.0f;
    }
    MoEActivations a;
    moe_allocate(&a, s, N, l.C, l.H);
    std::vector<int> routing, nudged;
    layer_loss(l, &a, x, r, &routing);
    MoEStats st = moe_forward(std::vector<float>((size_t)N * C).data(), &a, s, l.w(), x.data());
    check_counts(name, a, st, s);
    std::vector<float> dx((size_t)N * C);
    l.zero_grads();
    moe_backward(dx.data(), l.g(), &a, s, l.w(), x.data(), r.data(), 1.0f);
    char detail[256];
    if (starve_last) {
        bool empty = a.kept[s.experts - 1] == 0;
        size_t E1 = s.experts - 1, H = l.H;
        bool zero = true, finite = true;
        for (size_t i = E1 * H * C; i < (E1 + 1) * H * C; i++) zero = zero && l.gfcw[i] == 0.0f && l.gprojw[i] == 0.0f;
        for (size_t i = E1 * H; i < (E1 + 1) * H; i++) zero = zero && l.gfcb[i] == 0.0f;
        for (size_t i = E1 * C; i < (E1 + 1) * C; i++) zero = zero && l.gprojb[i] == 0.0f;
        for (auto* v : {&dx, &l.grouter, &l.gfcw, &l.gfcb, &l.gprojw, &l.gprojb})
            for (float f : *v) finite = finite && std::isfinite(f);
        snprintf(detail, sizeof detail, "kept per expert: last %d, dropped %d", a.kept[s.experts - 1], st.dropped);
        report(empty && zero && finite, "an expert no token reaches: no rows, its MLP gradients exactly 0, all finite", detail);
    }
    // one random direction per tensor; Richardson extrapolation of two central differences (eps, eps/2)
    struct Target { const char* what; std::vector<float>* v; std::vector<float>* grad; };
    Target targets[] = {{"x", &x, &dx}, {"router", &l.router, &l.grouter}, {"fcw", &l.fcw, &l.gfcw},
                        {"fcb", &l.fcb, &l.gfcb}, {"projw", &l.projw, &l.gprojw}, {"projb", &l.projb, &l.gprojb}};
    double worst = 0.0;
    const char* worst_what = "";
    bool routing_stable = true;
    for (size_t ti = 0; ti < sizeof targets / sizeof targets[0]; ti++) {
        const Target& tg = targets[ti];
        std::vector<float> dir, saved = *tg.v;
        fill(&dir, saved.size(), 300 + ti, 1.0f);
        double analytic = 0.0;
        for (size_t i = 0; i < dir.size(); i++) analytic += (double)(*tg.grad)[i] * dir[i];
        auto diff = [&](float eps) {
            for (size_t i = 0; i < dir.size(); i++) (*tg.v)[i] = saved[i] + eps * dir[i];
            double plus = layer_loss(l, &a, x, r, &nudged);
            routing_stable = routing_stable && nudged == routing;
            for (size_t i = 0; i < dir.size(); i++) (*tg.v)[i] = saved[i] - eps * dir[i];
            double minus = layer_loss(l, &a, x, r, &nudged);
            routing_stable = routing_stable && nudged == routing;
            *tg.v = saved;
            return (plus - minus) / (2.0 * eps);
        };
        double d1 = diff(2e-3f), d2 = diff(1e-3f);
        double numeric = (4.0 * d2 - d1) / 3.0;
        double rel = std::fabs(numeric - analytic) / std::max(1e-6, std::fabs(analytic));
        if (rel > worst) { worst = rel; worst_what = tg.what; }
    }
    snprintf(detail, sizeof detail, "worst relative error %.2e (%s), tolerance 5e-3; dropped %d of %d", worst, worst_what,
             st.dropped, N * s.top_k);
    report(routing_stable, (std::string(name) + ": the routing is the same under every nudge").c_str(), "choices and rows");
    report(worst < 5e-3, (std::string(name) + ": gradients match finite differences").c_str(), detail);
}

// ---------------------------------------------------------------------------------------------
// --dump IN OUT: the harness of test/test_moe.py

static void read_floats(FILE* f, std::vector<float>* v, size_t n) {
    v->resize(n);
    if (fread(v->data(), sizeof(float), n, f) != n) { fprintf(stderr, "test_moe_layer: input file too short\n"); exit(2); }
}

static int dump(const char* in_path, const char* out_path) {
    FILE* f = fopen(in_path, "rb");
    if (!f) { fprintf(stderr, "test_moe_layer: cannot open %s\n", in_path); return 2; }
    int32_t dims[5];   // N, C, H, E, k
    float knobs[4];    // capacity factor, alpha, c_z, aux_scale
    if (fread(dims, sizeof dims, 1, f) != 1 || fread(knobs, sizeof knobs, 1, f) != 1) { fprintf(stderr, "test_moe_layer: bad header\n"); return 2; }
    int N = dims[0], C = dims[1], H = dims[2];
    MoEShape s;
    s.experts = dims[3]; s.top_k = dims[4]; s.capacity_factor = knobs[0]; s.aux_alpha = knobs[1]; s.z_loss = knobs[2];
    std::string why = moe_shape_problem(s);
    if (!why.empty()) usage_fail(why);   // before reading a tensor: one line, exit 2
    size_t E = s.experts;
    Layer l;
    l.s = s; l.N = N; l.C = C; l.H = H;
    std::vector<float> x, dy;
    read_floats(f, &x, (size_t)N * C);
    read_floats(f, &l.router, E * C);
    read_floats(f, &l.fcw, E * H * C);
    read_floats(f, &l.fcb, E * H);
    read_floats(f, &l.projw, E * C * H);
    read_floats(f, &l.projb, E * C);
    read_floats(f, &dy, (size_t)N * C);
    fclose(f);
    l.grouter.assign(l.router.size(), 0.0f); l.gfcw.assign(l.fcw.size(), 0.0f); l.gfcb.assign(l.fcb.size(), 0.0f);
    l.gprojw.assign(l.projw.size(), 0.0f); l.gprojb.assign(l.projb.size(), 0.0f);
    MoEActivations a;
    moe_allocate(&a, s, N, C, H);
    std::vector<float> y((size_t)N * C), dx((size_t)N * C);
    MoEStats st = moe_forward(y.data(), &a, s, l.w(), x.data());
    moe_backward(dx.data(), l.g(), &a, s, l.w(), x.data(), dy.data(), knobs[3]);
    FILE* o = fopen(out_path, "wb");
    auto put = [&](const std::vector<float>& v) { fwrite(v.data(), sizeof(float), v.size(), o); };
    std::vector<float> choice(a.choice.begin(), a.choice.end()), kept_mask(a.row.size());
    for (size_t c = 0; c < a.row.size(); c++) kept_mask[c] = a.row[c] >= 0 ? 1.0f : 0.0f;
    put(a.logits); put(a.probs); put(choice); put(a.gate); put(kept_mask); put(y);
    put({(float)st.aux_loss, (float)st.z_loss, (float)st.dropped, (float)st.min_load, (float)st.max_load, (float)a.capacity});
    put(dx); put(l.grouter); put(l.gfcw); put(l.gfcb); put(l.gprojw); put(l.gprojb);
    fclose(o);
    return 0;
}

// ---------------------------------------------------------------------------------------------
// --bench: one line per repetition, "dense_ms moe_ms dropped", the two alternating so that the
// machine's load falls on both alike

static int bench(int N, int C, int E, int k, float f, int reps) {
    MoEShape s;
    s.experts = E; s.top_k = k; s.capacity_factor = f;
    int H = 4 * C;
    Layer l = make_layer(s, N, C, 500);
    for (auto* v : {&l.router, &l.fcw, &l.projw}) for (float& w : *v) w *= 0.02f / 0.3f;   // about GPT-2's init scale
    std::vector<float> x, dy, y((size_t)N * C), dx((size_t)N * C);
    fill(&x, (size_t)N * C, 7, 1.0f);
    fill(&dy, (size_t)N * C, 8, 1e-3f);
    std::vector<float> fch((size_t)N * H), fch_gelu((size_t)N * H), dh((size_t)N * H);
    MoEActivations a;
    moe_allocate(&a, s, N, C, H);
    auto now = [] { return std::chrono::steady_clock::now(); };
    auto ms = [](auto t0, auto t1) { return std::chrono::duration<double, std::milli>(t1 - t0).count(); };
    for (int r = 0; r < reps + 1; r++) {   // the first repetition warms the caches and the packing scratch: not printed
        auto t0 = now();
        matmul_forward(fch.data(), x.data(), l.fcw.data(), l.fcb.data(), N, C, H);
        gelu_forward(fch_gelu.data(), fch.data(), (size_t)N * H);
        matmul_forward(y.data(), fch_gelu.data(), l.projw.data(), l.projb.data(), N, H, C);
        matmul_backward(dh.data(), l.gprojw.data(), l.gprojb.data(), dy.data(), fch_gelu.data(), l.projw.data(), N, H, C);
        gelu_backward(dh.data(), fch.data(), dh.data(), (size_t)N * H);
        matmul_backward(dx.data(), l.gfcw.data(), l.gfcb.data(), dh.data(), x.data(), l.fcw.data(), N, C, H);
        auto t1 = now();
        MoEStats st = moe_forward(y.data(), &a, s, l.w(), x.data());
        moe_backward(dx.data(), l.g(), &a, s, l.w(), x.data(), dy.data(), 1.0f);
        auto t2 = now();
        if (r > 0) printf("%.4f %.4f %d\n", ms(t0, t1), ms(t1, t2), st.dropped);
    }
    return 0;
}

int main(int argc, char** argv) {
    if (argc == 8 && strcmp(argv[1], "--bench") == 0)
        return bench(atoi(argv[2]), atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), (float)atof(argv[6]), atoi(argv[7]));
    if (argc == 4 && strcmp(argv[1], "--dump") == 0) return dump(argv[2], argv[3]);
    if (argc != 1) { fprintf(stderr, "usage: test_moe_layer [--dump IN OUT | --bench N C E k f REPS]\n"); return 2; }
    check_dense();
    MoEShape top1;
    top1.experts = 4; top1.top_k = 1; top1.capacity_factor = 1.0f;
    check_fd("top-1, E=4, capacity 1.0", top1, false);
    MoEShape top2;
    top2.experts = 4; top2.top_k = 2; top2.capacity_factor = 1.0f;
    check_fd("top-2, E=4, capacity 1.0", top2, false);
    MoEShape starve = top2;
    starve.capacity_factor = 0.0f;
    check_fd("top-2, E=4, an empty expert", starve, true);
    return failures ? 1 : 0;
}
