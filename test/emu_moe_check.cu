// emu_moe_check.cu — the GPU's mixture-of-experts kernels (llmc/kernels/moe.cuh) against the CPU
// trainer's MoE layer (llmc/model/moe.h) on the same inputs: one forward and one backward of a whole
// layer, every intermediate compared, so a wrong value names the kernel that made it.
// test/test_gpu_moe.py builds it against the CPU emulation of CUDA (test/emu/) and plants bugs in it.
//
// The inputs are bf16 values (x, every weight, dy), given to the CPU in fp32: both sides start from
// the same numbers. What must agree, and how closely:
//   exactly      the routing and the drops: each token's choices, each assignment's row (or -1), the
//                per-expert counts before and after dropping, the row ranges, the token of each row.
//                The logits differ only by summation order (~1e-7 relative), so only a near-tie could
//                flip a choice; the inputs have EXACT ties instead (two identical router rows), which
//                must go to the lower index on both sides.
//   fp32 (1e-5 relative L2)   logits, probabilities, logsumexp, gates, both auxiliary losses: fp32 on
//                both sides from the same inputs
//   bf16 (1e-2 relative L2, the kernel lab's bound)   xg (a copy: exact), the experts' outputs, y,
//                the rows' and gates' gradients, the router's logit gradient, dx and every weight
//                gradient: the GPU rounds
//                fch, gelu(fch), the expert outputs and the gradients to bf16 on the way (each rounding
//                2^-9 relative, a few in a row), the CPU keeps fp32. Measured worst: see the ok lines.
// Scenarios: top-1 and top-2, without dropping and with a capacity factor that binds (a skewed router
// floods expert 0, and expert 1 is starved: an expert with no rows), N = 72 tokens (not a multiple of
// any block), C = 64, 4C hidden units, E = 4; and E = 1 (top-1, no dropping, no z-loss), which must
// also equal the GPU's own dense MLP (train_gpt.cu's calls) bit for bit: y, dx, the four gradients,
// and a router gradient of exactly 0.
//
//   emu_moe_check [SCENARIO...]   prints per scenario `ok NAME (...) bits HASH` or `wrong NAME: ...`,
//                                 exit 1 if any was wrong. HASH covers every GPU output's bits.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include "llmc/kernels/moe.cuh"

struct Scenario {
    const char* name;
    int experts, top_k;
    float capacity_factor;
};
static const Scenario SCENARIOS[] = {
    {"top1", 4, 1, 0.0f},
    {"top2", 4, 2, 0.0f},
    {"top1_capacity", 4, 1, 1.0f},
    {"top2_capacity", 4, 2, 1.25f},
    {"e1_dense", 1, 1, 0.0f},   // also against the GPU's dense MLP, bit for bit (z-loss off)
};
static const int N = 72, C = 64, H = 4 * C;

static std::vector<float> bf16_normal(std::mt19937_64* rng, size_t n, float scale) {
    std::normal_distribution<float> dist(0.0f, scale);
    std::vector<float> v(n);
    for (float& x : v) x = bf16_to_float(float_to_bf16_round_nearest(dist(*rng)));
    return v;
}

template <class T> static T* to_gpu(const std::vector<T>& v) {
    T* d = nullptr;
    CUDA_CHECK(cudaMalloc(&d, std::max<size_t>(v.size(), 1) * sizeof(T)));
    CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
static floatX* to_gpu_bf16(const std::vector<float>& v) {
    std::vector<floatX> b(v.size());
    for (size_t i = 0; i < v.size(); i++) b[i] = __float2bfloat16_rn(v[i]);
    return to_gpu(b);
}
template <class T> static std::vector<T> from_gpu(const T* d, size_t n) {
    std::vector<T> v(n);
    CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(T), cudaMemcpyDeviceToHost));
    return v;
}
static std::vector<float> from_gpu_bf16(const floatX* d, size_t n) {
    std::vector<floatX> b = from_gpu(d, n);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) v[i] = __bfloat162float(b[i]);
    return v;
}

// One scenario's verdict: the first mismatch, the worst relative error over its bound, a hash of bits.
struct Verdict {
    std::string wrong;
    double worst = 0.0;
    std::string worst_what;
    uint64_t hash = 1469598103934665603ull;
    void mix(const void* p, size_t bytes) {
        for (size_t i = 0; i < bytes; i++) hash = (hash ^ ((const unsigned char*)p)[i]) * 1099511628211ull;
    }
    void same_ints(const char* what, const std::vector<int>& got, const int* want, size_t n) {
        mix(got.data(), n * sizeof(int));
        for (size_t i = 0; i < n && wrong.empty(); i++)
            if (got[i] != want[i]) wrong = strprintf("%s[%zu] = %d, the CPU's is %d", what, i, got[i], want[i]);
    }
    void close(const char* what, const std::vector<float>& got, const float* want, size_t n, double bound) {
        mix(got.data(), n * sizeof(float));
        double err = 0.0, ref = 0.0;
        for (size_t i = 0; i < n; i++) {
            err += ((double)got[i] - want[i]) * ((double)got[i] - want[i]);
            ref += (double)want[i] * want[i];
        }
        double rel = std::sqrt(err) / std::max(std::sqrt(ref), 1e-30);
        if (!(rel <= bound)) {   // NaN fails too
            if (wrong.empty()) wrong = strprintf("%s: relative L2 error %.3g over its bound %.0e", what, rel, bound);
        } else if (rel / bound > worst) {
            worst = rel / bound;
            worst_what = what;
        }
    }
};

// E = 1, top-1, no dropping, no z-loss: the MoE kernels must give the dense MLP's bits (the gate is
// exactly 1, the one expert's rows are x's rows in token order, the router's logit gradient exactly
// 0). The dense MLP here is train_gpt.cu's calls for it, on the same device inputs.
static void dense_equivalence(Verdict* v, MatmulContext* ctx, cudaStream_t stream, const floatX* x, const floatX* dy,
                              const cpu::MoEWeights<const floatX>& w, const cpu::MoEWeights<floatX>& g_moe,
                              const std::vector<int>& first_row, floatX* fch, floatX* fch_gelu, const floatX* y_moe,
                              const floatX* dx_moe, float* partials) {
    if (first_row[1] != N) { v->wrong = "E = 1 without dropping must keep every token"; return; }
    std::vector<float> zeros((size_t)H * C);
    floatX *y, *dh, *dx, *g_fcw = to_gpu_bf16(zeros), *g_projw = to_gpu_bf16(zeros);
    floatX *g_fcb = to_gpu_bf16(std::vector<float>(H)), *g_projb = to_gpu_bf16(std::vector<float>(C));
    CUDA_CHECK(cudaMalloc(&y, (size_t)N * C * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc(&dx, (size_t)N * C * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc(&dh, (size_t)N * H * sizeof(floatX)));
    matmul_forward(ctx, fch, x, w.fcw, w.fcb, N, C, H, stream);
    gelu_forward(fch_gelu, fch, (size_t)N * H, stream);
    matmul_forward(ctx, y, fch_gelu, w.projw, w.projb, N, H, C, stream);
    matmul_backward_data(ctx, dh, dy, w.projw, N, H, C, stream);
    matmul_backward_weight(ctx, g_projw, dy, fch_gelu, N, H, C, stream);
    bias_backward(g_projb, partials, dy, N, C, stream);
    gelu_backward_inplace(dh, fch, (size_t)N * H, stream);
    matmul_backward_data(ctx, dx, dh, w.fcw, N, C, H, stream);
    matmul_backward_weight(ctx, g_fcw, dh, x, N, C, H, stream);
    bias_backward(g_fcb, partials, dh, N, H, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));
    auto same_bits = [&](const char* what, const floatX* got, const floatX* want, size_t n) {
        std::vector<floatX> a = from_gpu(got, n), b = from_gpu(want, n);
        if (v->wrong.empty() && memcmp(a.data(), b.data(), n * sizeof(floatX)) != 0)
            v->wrong = strprintf("E = 1: %s differs from the dense MLP's bits", what);
    };
    same_bits("y", y_moe, y, (size_t)N * C);
    same_bits("dx", dx_moe, dx, (size_t)N * C);
    same_bits("dfcw", g_moe.fcw, g_fcw, (size_t)H * C);
    same_bits("dfcb", g_moe.fcb, g_fcb, H);
    same_bits("dprojw", g_moe.projw, g_projw, (size_t)C * H);
    same_bits("dprojb", g_moe.projb, g_projb, C);
    std::vector<float> drouter = from_gpu_bf16(g_moe.router, C);
    for (float d : drouter)
        if (v->wrong.empty() && d != 0.0f) v->wrong = "E = 1: the router's gradient is not exactly 0";
    if (v->wrong.empty()) v->worst_what += "; = the dense MLP bit for bit";
}

static const double FP32_BOUND = 1e-5, BF16_BOUND = 1e-2;

static Verdict run_scenario(const Scenario& sc, MatmulContext* ctx, cudaStream_t stream) {
    cpu::MoEShape s;
    s.experts = sc.experts;
    s.top_k = sc.top_k;
    s.capacity_factor = sc.capacity_factor;
    if (sc.experts == 1) s.z_loss = 0.0f;   // with it, one logit still has a gradient (moe.h)
    int E = s.experts, k = s.top_k;
    std::mt19937_64 rng(20261127 + E * 10 + k);
    // x: noise around a shared direction u; the router's row 1 leans away from u (a starved expert),
    // with capacity row 0 towards it (a flooded one); rows 2 and 3 are equal (exact ties between them)
    std::vector<float> u = bf16_normal(&rng, C, 1.0f), x = bf16_normal(&rng, (size_t)N * C, 1.0f);
    for (int t = 0; t < N; t++)
        for (int i = 0; i < C; i++) x[(size_t)t * C + i] = bf16_to_float(float_to_bf16_round_nearest(x[(size_t)t * C + i] + 0.5f * u[i]));
    std::vector<float> router = bf16_normal(&rng, (size_t)E * C, 0.05f);
    float lean = s.capacity_factor > 0.0f ? 0.01f : 0.0f;   // flood expert 0 where capacity is to bind
    for (int i = 0; i < C && E >= 4; i++) {   // (E = 1's one row is left as drawn)
        router[i] = bf16_to_float(float_to_bf16_round_nearest(router[i] + lean * u[i]));
        router[C + i] = bf16_to_float(float_to_bf16_round_nearest(router[C + i] - 0.06f * u[i]));
        router[3 * C + i] = router[2 * C + i];
    }
    std::vector<float> fcw = bf16_normal(&rng, (size_t)E * H * C, 0.1f), fcb = bf16_normal(&rng, (size_t)E * H, 0.1f);
    std::vector<float> projw = bf16_normal(&rng, (size_t)E * C * H, 0.05f), projb = bf16_normal(&rng, (size_t)E * C, 0.1f);
    std::vector<float> dy = bf16_normal(&rng, (size_t)N * C, 1.0f);
    const float aux_scale = 0.5f;

    // the CPU: its layer, forward and backward (gradients start at zero)
    cpu::MoEWeights<const float> w = cpu::moe_weights_stacked<const float>(router.data(), fcw.data(), fcb.data(), projw.data(),
                                                                           projb.data(), C, H);
    std::vector<float> g_router(router.size()), g_fcw(fcw.size()), g_fcb(fcb.size()), g_projw(projw.size()), g_projb(projb.size());
    cpu::MoEWeights<float> g = cpu::moe_weights_stacked<float>(g_router.data(), g_fcw.data(), g_fcb.data(), g_projw.data(),
                                                               g_projb.data(), C, H);
    cpu::MoEActivations a;
    cpu::moe_allocate(&a, s, N, C, H);
    std::vector<float> y((size_t)N * C), dx((size_t)N * C);
    cpu::MoEStats st = cpu::moe_forward(y.data(), &a, s, w, x.data());
    cpu::moe_backward(dx.data(), g, &a, s, w, x.data(), dy.data(), aux_scale);

    // the GPU: the same layer through moe.cuh, gradients starting at zero
    size_t rows = (size_t)k * N;
    MoERouting r;
    CUDA_CHECK(cudaMalloc(&r.logits, N * E * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&r.probs, N * E * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&r.lse, N * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&r.choice, rows * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&r.gate, rows * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&r.row, rows * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&r.routed, E * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&r.kept, E * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&r.first_row, (E + 1) * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&r.token_of_row, rows * sizeof(int)));
    CUDA_CHECK(cudaMalloc(&r.losses, 2 * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&r.dgate, rows * sizeof(float)));
    CUDA_CHECK(cudaMalloc(&r.dlogits, N * E * sizeof(float)));
    floatX *d_x = to_gpu_bf16(x), *d_router = to_gpu_bf16(router), *d_fcw = to_gpu_bf16(fcw), *d_fcb = to_gpu_bf16(fcb);
    floatX *d_projw = to_gpu_bf16(projw), *d_projb = to_gpu_bf16(projb), *d_dy = to_gpu_bf16(dy);
    std::vector<float> zeros_router(router.size()), zeros_fcw(fcw.size()), zeros_fcb(fcb.size()), zeros_projw(projw.size()),
        zeros_projb(projb.size());
    floatX *dg_router = to_gpu_bf16(zeros_router), *dg_fcw = to_gpu_bf16(zeros_fcw), *dg_fcb = to_gpu_bf16(zeros_fcb);
    floatX *dg_projw = to_gpu_bf16(zeros_projw), *dg_projb = to_gpu_bf16(zeros_projb);
    floatX *xg, *fch, *fch_gelu, *eout, *d_y, *drow, *dh, *dxg, *d_dx;
    for (floatX** p : {&xg, &eout, &drow, &dxg}) CUDA_CHECK(cudaMalloc(p, rows * C * sizeof(floatX)));
    for (floatX** p : {&fch, &fch_gelu, &dh}) CUDA_CHECK(cudaMalloc(p, rows * H * sizeof(floatX)));
    for (floatX** p : {&d_y, &d_dx}) CUDA_CHECK(cudaMalloc(p, (size_t)N * C * sizeof(floatX)));
    float* partials;
    CUDA_CHECK(cudaMalloc(&partials, bias_backward_partials_floats(rows, H) * sizeof(float)));

    cpu::MoEWeights<const floatX> dw = cpu::moe_weights_stacked<const floatX>(d_router, d_fcw, d_fcb, d_projw, d_projb, C, H);
    cpu::MoEWeights<floatX> dg = cpu::moe_weights_stacked<floatX>(dg_router, dg_fcw, dg_fcb, dg_projw, dg_projb, C, H);
    moe_route_dispatch(r, s, d_x, d_router, N, C, stream);
    std::vector<int> first_row = moe_read_rows(r, E, stream);
    moe_gather(xg, d_x, r, E, N, k, C, stream);
    moe_experts_forward(ctx, dw, first_row, C, H, xg, fch, fch_gelu, eout, stream);
    moe_combine(d_y, eout, r, N, k, C, stream);
    moe_backward_rows(drow, d_dy, eout, r, N, k, C, stream);
    moe_experts_backward(ctx, dg, dw, first_row, C, H, drow, xg, fch, fch_gelu, dh, dxg, partials, stream);
    moe_backward_input(d_dx, dg_router, r, s, d_x, d_router, dxg, N, C, aux_scale, stream);
    CUDA_CHECK(cudaStreamSynchronize(stream));

    Verdict v;
    int used = first_row[E];
    v.same_ints("choice", from_gpu(r.choice, rows), a.choice.data(), rows);
    v.same_ints("row", from_gpu(r.row, rows), a.row.data(), rows);
    v.same_ints("routed", from_gpu(r.routed, E), a.routed.data(), E);
    v.same_ints("kept", from_gpu(r.kept, E), a.kept.data(), E);
    v.same_ints("first_row", first_row, a.first_row.data(), E + 1);
    v.same_ints("token_of_row", from_gpu(r.token_of_row, used), a.token_of_row.data(), used);
    if (!v.wrong.empty()) return v;   // the values below are compared row for row: meaningless if the rows differ
    v.close("logits", from_gpu(r.logits, N * E), a.logits.data(), N * E, FP32_BOUND);
    v.close("probs", from_gpu(r.probs, N * E), a.probs.data(), N * E, FP32_BOUND);
    v.close("lse", from_gpu(r.lse, N), a.lse.data(), N, FP32_BOUND);
    v.close("gate", from_gpu(r.gate, rows), a.gate.data(), rows, FP32_BOUND);
    std::vector<float> losses = from_gpu(r.losses, 2);
    float want_losses[2] = {(float)st.aux_loss, (float)st.z_loss};
    v.close("aux_loss", {losses[0]}, &want_losses[0], 1, FP32_BOUND);
    v.close("z_loss", {losses[1]}, &want_losses[1], 1, FP32_BOUND);
    v.close("xg", from_gpu_bf16(xg, (size_t)used * C), a.xg.data(), (size_t)used * C, BF16_BOUND);
    v.close("expert outputs", from_gpu_bf16(eout, (size_t)used * C), a.eout.data(), (size_t)used * C, BF16_BOUND);
    v.close("y", from_gpu_bf16(d_y, (size_t)N * C), y.data(), (size_t)N * C, BF16_BOUND);
    v.close("drow", from_gpu_bf16(drow, (size_t)used * C), a.drow.data(), (size_t)used * C, BF16_BOUND);
    v.close("dgate", from_gpu(r.dgate, rows), a.dgate.data(), rows, BF16_BOUND);
    v.close("dxg", from_gpu_bf16(dxg, (size_t)used * C), a.dxg.data(), (size_t)used * C, BF16_BOUND);
    v.close("dlogits", from_gpu(r.dlogits, N * E), a.dlogits.data(), N * E, BF16_BOUND);
    v.close("dx", from_gpu_bf16(d_dx, (size_t)N * C), dx.data(), (size_t)N * C, BF16_BOUND);
    v.close("drouter", from_gpu_bf16(dg_router, router.size()), g_router.data(), router.size(), BF16_BOUND);
    v.close("dfcw", from_gpu_bf16(dg_fcw, fcw.size()), g_fcw.data(), fcw.size(), BF16_BOUND);
    v.close("dfcb", from_gpu_bf16(dg_fcb, fcb.size()), g_fcb.data(), fcb.size(), BF16_BOUND);
    v.close("dprojw", from_gpu_bf16(dg_projw, projw.size()), g_projw.data(), projw.size(), BF16_BOUND);
    v.close("dprojb", from_gpu_bf16(dg_projb, projb.size()), g_projb.data(), projb.size(), BF16_BOUND);
    int ties = 0;   // choices of expert 2, each a tie with expert 3 (equal router rows) won by the lower index
    for (int c : a.choice) ties += c == 2;
    if (E == 1 && v.wrong.empty()) dense_equivalence(&v, ctx, stream, d_x, d_dy, dw, dg, first_row, fch, fch_gelu, d_y, d_dx, partials);
    v.worst_what += strprintf("; loads %d..%d, %d dropped, %d ties", st.min_load, st.max_load, st.dropped, ties);
    return v;   // the device buffers go with the process: this program runs each scenario once
}

int main(int argc, char** argv) {
    cudaStream_t stream;
    CUDA_CHECK(cudaStreamCreate(&stream));
    void* workspace;
    size_t workspace_bytes = 32 << 20;
    CUDA_CHECK(cudaMalloc(&workspace, workspace_bytes));
    MatmulContext ctx;
    matmul_init(&ctx, workspace, workspace_bytes);
    int wrong = 0, ran = 0;
    for (const Scenario& sc : SCENARIOS) {
        bool asked = argc < 2;
        for (int i = 1; i < argc; i++) asked |= std::string(argv[i]) == sc.name;
        if (!asked) continue;
        ran++;
        Verdict v = run_scenario(sc, &ctx, stream);
        if (v.wrong.empty()) {
            printf("ok %s (worst %.2f of its bound, %s) bits %016llx\n", sc.name, v.worst, v.worst_what.c_str(),
                   (unsigned long long)v.hash);
        } else {
            printf("wrong %s: %s\n", sc.name, v.wrong.c_str());
            wrong++;
        }
    }
    if (ran == 0) {
        fprintf(stderr, "emu_moe_check: no scenario named %s (top1, top2, top1_capacity, top2_capacity, e1_dense)\n", argv[1]);
        return 2;
    }
    return wrong ? 1 : 0;
}
