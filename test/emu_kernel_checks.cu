// emu_kernel_checks.cu — a few of llmc's real kernels, unmodified, against double-precision
// references computed here: the program the emulator's negative controls mutate
// (test/test_emu_negative_controls.py builds it against the CPU emulation of CUDA, test/emu/).
//
// Why a program of its own instead of the emulated train_gpt: a control needs one build per planted
// bug, and this one builds in a few seconds where train_gpt takes ~40; and a check of one kernel
// against a reference says which kernel broke, where a training run says only that the loss moved.
//
// The checks (all with the shapes the trainer's tests keep odd: C = 1600, N not a multiple of a
// block's rows, a vocabulary V that is not a multiple of 8):
//   layernorm_forward_768, _1600, _64   the residual add + LayerNorm: residual, y, mean, rstd
//   layernorm_backward_768, _1600, _320, _6400  dinp, dweight, dbias (accumulated), blocks that take
//                                       several rounds of rows; at C = 6400 with 50 KiB of opted-in
//                                       dynamic shared memory
//   classifier           the fused softmax / cross-entropy / gradient (block_max, block_sum, the warp
//                        reductions): losses and the gradient written over the logits
//   matmul               cuBLASLt forward with bias, backward data, backward weight (accumulated)
//                        through llmc/kernels/matmul.cuh, and the bias-gradient kernel
//   adamw_bf16           --optimizer-state bf16's kernel (llmc/optim/adamw_bf16.cuh), issue 25's case: g = 0
//                        for 300 steps at beta2 = 0.999, so v must decay like 0.999^t (0.741); stored in
//                        bf16 and rounded to nearest it would never move from 1 (each step's 1e-3 is less
//                        than half of bf16's spacing there); stochastic rounding is unbiased, so the mean of
//                        4096 elements tracks 0.999^t and each element stays near it
// Tolerances: every kernel computes in fp32 from bf16 inputs and rounds its output to bf16 once, so
// a bf16 output may be off by one bf16 ulp (2^-7 relative) plus a few fp32 roundings of the terms
// summed; the float outputs (mean, rstd, losses) by a few fp32 roundings of their terms.
//
//   emu_kernel_checks [CHECK...]     (default: all; "layernorm_forward" = all its widths) prints per check
//     ok CHECK (worst error X of its tolerance) bits HASH
//     wrong CHECK: what[i] = got, expected want +- tol
//   and exits 1 if any was wrong. HASH (of every output bit) lets a caller compare schedules.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <string>
#include <vector>
#include "llmc/kernels/fused_classifier.cuh"
#include "llmc/kernels/layernorm.cuh"
#include "llmc/kernels/matmul.cuh"
#include "llmc/optim/adamw_bf16.cuh"

static const double BF16_ULP = 1.0 / 128;  // one unit in the last place of bf16, relative
static const double FP32_EPS = 1.0 / (1 << 23);

// ---------------------------------------------------------------------------------------------
// Inputs, device buffers

struct Rng {
    uint64_t s;
    double uniform() {  // splitmix64
        uint64_t z = (s += 0x9e3779b97f4a7c15ull);
        z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return ((z ^ (z >> 31)) >> 11) * (1.0 / 9007199254740992.0);
    }
    double normal() { return std::sqrt(-2.0 * std::log(1.0 - uniform())) * std::cos(6.283185307179586 * uniform()); }
};

static float bf16_round(double x) { return __bfloat162float(__float2bfloat16_rn((float)x)); }

// n values drawn from N(mean, scale^2), already bf16, so the reference sees exactly what the kernel does
static std::vector<float> randn(Rng* rng, size_t n, double mean, double scale) {
    std::vector<float> v(n);
    for (float& x : v) x = bf16_round(mean + scale * rng->normal());
    return v;
}

template <class T> static T* device_alloc(size_t n) {
    T* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, n * sizeof(T)));
    return p;
}
static floatX* upload(const std::vector<float>& v) {
    std::vector<floatX> x(v.size());
    for (size_t i = 0; i < v.size(); i++) x[i] = __float2bfloat16_rn(v[i]);
    floatX* d = device_alloc<floatX>(v.size());
    CUDA_CHECK(cudaMemcpy(d, x.data(), x.size() * sizeof(floatX), cudaMemcpyHostToDevice));
    return d;
}
template <class T> static T* upload_raw(const std::vector<T>& v) {
    T* d = device_alloc<T>(v.size());
    CUDA_CHECK(cudaMemcpy(d, v.data(), v.size() * sizeof(T), cudaMemcpyHostToDevice));
    return d;
}
static std::vector<float> download(const floatX* d, size_t n) {
    std::vector<floatX> x(n);
    CUDA_CHECK(cudaMemcpy(x.data(), d, n * sizeof(floatX), cudaMemcpyDeviceToHost));
    std::vector<float> v(n);
    for (size_t i = 0; i < n; i++) v[i] = __bfloat162float(x[i]);
    return v;
}
static std::vector<float> download(const float* d, size_t n) {
    std::vector<float> v(n);
    CUDA_CHECK(cudaMemcpy(v.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost));
    return v;
}

// ---------------------------------------------------------------------------------------------
// Comparison: one Check per named check; the first element out of tolerance is reported.

struct Check {
    std::string name;
    bool wrong = false;
    double worst = 0.0;       // largest error / tolerance seen
    uint64_t hash = 1469598103934665603ull;
    std::string first_wrong;
};

static void compare(Check* ck, const char* what, const std::vector<float>& got, const std::vector<double>& want,
                    const std::vector<double>& tol) {
    for (size_t i = 0; i < got.size(); i++) {
        uint32_t bits;
        memcpy(&bits, &got[i], 4);
        ck->hash = (ck->hash ^ bits) * 1099511628211ull;
        double err = std::fabs((double)got[i] - want[i]);
        bool bad = !(err <= tol[i]);  // NaN fails
        if (!bad) {
            ck->worst = std::max(ck->worst, tol[i] > 0 ? err / tol[i] : 0.0);
            continue;
        }
        if (!ck->wrong) {
            char msg[256];
            snprintf(msg, sizeof(msg), "%s[%zu] = %.8g, expected %.8g +- %.3g", what, i, got[i], want[i], tol[i]);
            ck->first_wrong = msg;
        }
        ck->wrong = true;
    }
}

static bool report(const Check& ck) {
    if (ck.wrong) printf("wrong %s: %s\n", ck.name.c_str(), ck.first_wrong.c_str());
    else printf("ok %s (worst error %.2f of its tolerance) bits %016llx\n", ck.name.c_str(), ck.worst,
                (unsigned long long)ck.hash);
    fflush(stdout);
    return !ck.wrong;
}

// ---------------------------------------------------------------------------------------------
// LayerNorm forward: residual = a + b (rounded to bf16), y = (residual - mean) * rstd * w + bias

struct LnStats {
    std::vector<double> mean, rstd;
};

static LnStats ln_stats(const std::vector<float>& x, int N, int C) {
    LnStats s{std::vector<double>(N), std::vector<double>(N)};
    for (int r = 0; r < N; r++) {
        double m = 0, v = 0;
        for (int c = 0; c < C; c++) m += x[(size_t)r * C + c];
        m /= C;
        for (int c = 0; c < C; c++) v += (x[(size_t)r * C + c] - m) * (x[(size_t)r * C + c] - m);
        s.mean[r] = m;
        s.rstd[r] = 1.0 / std::sqrt(v / C + LN_EPS);
    }
    return s;
}

static bool check_layernorm_forward(int C) {
    const int N = 37;  // not a multiple of the 8 rows of a block
    Rng rng{1000u + (uint64_t)C};
    std::vector<float> a = randn(&rng, (size_t)N * C, 0.3, 1.0), b = randn(&rng, (size_t)N * C, 0.0, 0.5);
    std::vector<float> w = randn(&rng, C, 1.0, 0.2), bias = randn(&rng, C, 0.0, 0.2);
    floatX *da = upload(a), *db = upload(b), *dw = upload(w), *dbias = upload(bias);
    // the outputs are fresh allocations: whatever the kernel does not write reads back as NaN
    floatX *res = device_alloc<floatX>((size_t)N * C), *y = device_alloc<floatX>((size_t)N * C);
    float *mean = device_alloc<float>(N), *rstd = device_alloc<float>(N);
    fused_residual_layernorm_forward(res, y, mean, rstd, da, db, dw, dbias, N, C, 0);
    CUDA_CHECK(cudaDeviceSynchronize());

    Check ck{"layernorm_forward_" + std::to_string(C)};
    std::vector<float> r(a.size());
    std::vector<double> r_want(a.size()), r_tol(a.size());
    for (size_t i = 0; i < a.size(); i++) {
        r[i] = bf16_round((double)a[i] + b[i]);
        r_want[i] = (double)a[i] + b[i];
        r_tol[i] = BF16_ULP * std::fabs(r_want[i]);
    }
    compare(&ck, "residual", download(res, a.size()), r_want, r_tol);
    LnStats s = ln_stats(r, N, C);  // the statistics of the rounded residual, as the kernel promises
    std::vector<double> y_want(a.size()), y_tol(a.size()), m_tol(N), s_tol(N);
    for (int row = 0; row < N; row++) {
        double mean_abs = 0;
        for (int c = 0; c < C; c++) mean_abs += std::fabs(r[(size_t)row * C + c]);
        m_tol[row] = 8 * FP32_EPS * mean_abs / C * std::sqrt((double)C);
        s_tol[row] = 8 * FP32_EPS * s.rstd[row] * std::sqrt((double)C);
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)row * C + c;
            double xhat = (r[i] - s.mean[row]) * s.rstd[row];
            y_want[i] = xhat * w[c] + bias[c];
            y_tol[i] = BF16_ULP * std::fabs(y_want[i]) + 64 * FP32_EPS * (std::fabs(xhat * w[c]) + std::fabs(bias[c]) + 1);
        }
    }
    compare(&ck, "y", download(y, a.size()), y_want, y_tol);
    compare(&ck, "mean", download(mean, N), s.mean, m_tol);
    compare(&ck, "rstd", download(rstd, N), s.rstd, s_tol);
    for (void* p : {(void*)da, (void*)db, (void*)dw, (void*)dbias, (void*)res, (void*)y, (void*)mean, (void*)rstd})
        CUDA_CHECK(cudaFree(p));
    return report(ck);
}

// ---------------------------------------------------------------------------------------------
// LayerNorm backward, with xhat = (x - mean) * rstd and g = dy * w:
//   dx += rstd * (g - mean(g) - xhat * mean(g * xhat)),  dw += sum dy * xhat,  db += sum dy

// A block takes at least 32 rows, 8 at a time (4 groups of 2) at these widths, over a grid of at most
// 256 (llmc/kernels/scratch_sizes.h): N = 150 at C = 768 and 1600 is 5 blocks that come round 3 or 4
// times, the last round partial; N = 330 at C = 320 (two warps a row) 11 blocks, 42 rounds; C = 6400
// (one group of 800 threads) needs 50 KiB of shared memory (an opt-in).
static bool check_layernorm_backward(int C, int N) {
    Rng rng{2000u + (uint64_t)C};
    std::vector<float> x = randn(&rng, (size_t)N * C, 0.2, 1.0), dy = randn(&rng, (size_t)N * C, 0.0, 1.0);
    std::vector<float> w = randn(&rng, C, 1.0, 0.3), dx0 = randn(&rng, (size_t)N * C, 0.0, 0.5);
    std::vector<float> dw0 = randn(&rng, C, 0.0, 1.0), db0 = randn(&rng, C, 0.0, 1.0);
    LnStats s = ln_stats(x, N, C);
    // the kernel gets the statistics as the forward stores them: fp32
    std::vector<float> mean32(N), rstd32(N);
    for (int r = 0; r < N; r++) {
        mean32[r] = (float)s.mean[r];
        rstd32[r] = (float)s.rstd[r];
    }
    floatX *dinp = upload(dx0), *ddw = upload(dw0), *ddb = upload(db0), *ddy = upload(dy), *dx = upload(x), *dwt = upload(w);
    float *dmean = upload_raw(mean32), *drstd = upload_raw(rstd32);
    float* partials = device_alloc<float>(layernorm_backward_partials_floats(N, C));
    layernorm_backward(dinp, ddw, ddb, partials, ddy, dx, dwt, dmean, drstd, N, C, 0);
    CUDA_CHECK(cudaDeviceSynchronize());

    std::vector<double> dx_want((size_t)N * C), dx_tol((size_t)N * C), dw_want(C), dw_tol(C), db_want(C), db_tol(C);
    std::vector<double> dw_abs(C, 0.0), db_abs(C, 0.0);
    for (int c = 0; c < C; c++) {
        dw_want[c] = dw0[c];
        db_want[c] = db0[c];
    }
    for (int r = 0; r < N; r++) {
        double m = mean32[r], rs = rstd32[r], mg = 0, mgx = 0, mg_abs = 0;
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)r * C + c;
            double xhat = (x[i] - m) * rs, g = dy[i] * w[c];
            mg += g;
            mgx += g * xhat;
            mg_abs += std::fabs(g) + std::fabs(g * xhat);
            dw_want[c] += dy[i] * xhat;
            db_want[c] += dy[i];
            dw_abs[c] += std::fabs(dy[i] * xhat);
            db_abs[c] += std::fabs(dy[i]);
        }
        mg /= C;
        mgx /= C;
        for (int c = 0; c < C; c++) {
            size_t i = (size_t)r * C + c;
            double xhat = (x[i] - m) * rs, g = dy[i] * w[c];
            double term = rs * (g - mg - xhat * mgx);
            dx_want[i] = dx0[i] + term;
            dx_tol[i] = BF16_ULP * std::fabs(dx_want[i]) +
                        64 * FP32_EPS * (std::fabs(dx0[i]) + rs * (std::fabs(g) + mg_abs / C * (1 + std::fabs(xhat))));
        }
    }
    for (int c = 0; c < C; c++) {
        dw_tol[c] = BF16_ULP * std::fabs(dw_want[c]) + 16 * FP32_EPS * (dw_abs[c] + std::fabs(dw0[c])) * std::sqrt((double)N);
        db_tol[c] = BF16_ULP * std::fabs(db_want[c]) + 16 * FP32_EPS * (db_abs[c] + std::fabs(db0[c])) * std::sqrt((double)N);
    }
    Check ck{"layernorm_backward_" + std::to_string(C)};
    compare(&ck, "dinp", download(dinp, (size_t)N * C), dx_want, dx_tol);
    compare(&ck, "dweight", download(ddw, C), dw_want, dw_tol);
    compare(&ck, "dbias", download(ddb, C), db_want, db_tol);
    for (void* p : {(void*)dinp, (void*)ddw, (void*)ddb, (void*)ddy, (void*)dx, (void*)dwt, (void*)dmean, (void*)drstd,
                    (void*)partials})
        CUDA_CHECK(cudaFree(p));
    return report(ck);
}

// ---------------------------------------------------------------------------------------------
// Classifier: loss = logsumexp(z) - z[target] over the V real columns; dz = (softmax - onehot) * dloss,
// zero over the padding. The padding's logits are 0, as the trainer's (its rows of wte are zero).

static bool check_classifier() {
    const int N = 6, V = 1001, Vp = 1024;
    Rng rng{3000};
    std::vector<float> z = randn(&rng, (size_t)N * Vp, 0.0, 2.0);
    std::vector<int> targets(N);
    for (int r = 0; r < N; r++) {
        for (int v = V; v < Vp; v++) z[(size_t)r * Vp + v] = 0.0f;
        targets[r] = 300 + 97 * r;  // owned by threads other than 0
    }
    const float dloss = 1.0f / N;
    floatX* logits = upload(z);
    float* losses = device_alloc<float>(N);
    int* dtargets = upload_raw(targets);
    fused_classifier(logits, losses, dtargets, dloss, N, V, Vp, true, 0);
    CUDA_CHECK(cudaDeviceSynchronize());

    std::vector<double> loss_want(N), loss_tol(N), grad_want((size_t)N * Vp), grad_tol((size_t)N * Vp);
    for (int r = 0; r < N; r++) {
        const float* row = &z[(size_t)r * Vp];
        double mx = -INFINITY, sum = 0;
        for (int v = 0; v < V; v++) mx = std::max(mx, (double)row[v]);
        for (int v = 0; v < V; v++) sum += std::exp(row[v] - mx);
        loss_want[r] = std::log(sum) + mx - row[targets[r]];
        loss_tol[r] = 64 * FP32_EPS * (1 + std::fabs(mx) + std::fabs(row[targets[r]]) + std::log(sum));
        for (int v = 0; v < Vp; v++) {
            double p = v < V ? std::exp(row[v] - mx) / sum : 0.0;
            double d = v < V ? (p - (v == targets[r] ? 1.0 : 0.0)) * dloss : 0.0;
            grad_want[(size_t)r * Vp + v] = d;
            grad_tol[(size_t)r * Vp + v] = BF16_ULP * std::fabs(d) + 64 * FP32_EPS * (p + 1e-30) * dloss;
        }
    }
    Check ck{"classifier"};
    compare(&ck, "loss", download(losses, N), loss_want, loss_tol);
    compare(&ck, "dlogits", download(logits, (size_t)N * Vp), grad_want, grad_tol);
    for (void* p : {(void*)logits, (void*)losses, (void*)dtargets}) CUDA_CHECK(cudaFree(p));
    return report(ck);
}

// ---------------------------------------------------------------------------------------------
// Matmuls through cuBLASLt (the emulator's stand-in) and the bias-gradient kernel, row-major:
//   out = inp W^T + b,  dinp = dout W,  dW += dout^T inp,  db += column sums of dout

static void matmul_reference(std::vector<double>* out, std::vector<double>* tol, int rows, int cols, int k,
                             const std::function<double(int, int)>& a, const std::function<double(int, int)>& b,
                             const std::vector<float>* add) {
    out->assign((size_t)rows * cols, 0.0);
    tol->assign((size_t)rows * cols, 0.0);
    for (int i = 0; i < rows; i++)
        for (int j = 0; j < cols; j++) {
            double s = add ? (*add)[(size_t)i * cols + j] : 0.0, s_abs = std::fabs(s);
            for (int p = 0; p < k; p++) {
                double t = a(i, p) * b(p, j);
                s += t;
                s_abs += std::fabs(t);
            }
            (*out)[(size_t)i * cols + j] = s;
            (*tol)[(size_t)i * cols + j] = BF16_ULP * std::fabs(s) + 2 * k * FP32_EPS * s_abs;
        }
}

static bool check_matmul() {
    const int N = 300, IC = 40, OC = 72;  // N over one 256-row bias block; nothing square
    Rng rng{4000};
    std::vector<float> inp = randn(&rng, (size_t)N * IC, 0.0, 1.0), W = randn(&rng, (size_t)OC * IC, 0.0, 0.2);
    std::vector<float> bias = randn(&rng, OC, 0.0, 0.5), dout = randn(&rng, (size_t)N * OC, 0.0, 1.0);
    std::vector<float> dW0 = randn(&rng, (size_t)OC * IC, 0.0, 1.0), db0 = randn(&rng, OC, 0.0, 1.0);
    floatX *d_inp = upload(inp), *d_W = upload(W), *d_bias = upload(bias), *d_dout = upload(dout);
    floatX *d_dW = upload(dW0), *d_db = upload(db0);
    floatX *d_out = device_alloc<floatX>((size_t)N * OC), *d_dinp = device_alloc<floatX>((size_t)N * IC);
    float* partials = device_alloc<float>((size_t)ceil_div(N, BIAS_BACKWARD_ROWS_PER_BLOCK) * OC);
    void* workspace = device_alloc<char>(CUBLASLT_WORKSPACE_BYTES);
    MatmulContext ctx;
    matmul_init(&ctx, workspace, CUBLASLT_WORKSPACE_BYTES);
    matmul_forward(&ctx, d_out, d_inp, d_W, d_bias, N, IC, OC, 0);
    matmul_backward_data(&ctx, d_dinp, d_dout, d_W, N, IC, OC, 0);
    matmul_backward_weight(&ctx, d_dW, d_dout, d_inp, N, IC, OC, 0);
    bias_backward(d_db, partials, d_dout, N, OC, 0);
    CUDA_CHECK(cudaDeviceSynchronize());
    matmul_destroy(&ctx);

    Check ck{"matmul"};
    std::vector<double> want, tol;
    matmul_reference(&want, &tol, N, OC, IC, [&](int i, int p) { return (double)inp[(size_t)i * IC + p]; },
                     [&](int p, int j) { return (double)W[(size_t)j * IC + p]; }, nullptr);
    for (int i = 0; i < N; i++)
        for (int j = 0; j < OC; j++) {
            want[(size_t)i * OC + j] += bias[j];
            tol[(size_t)i * OC + j] += BF16_ULP * std::fabs(bias[j]);
        }
    compare(&ck, "out", download(d_out, (size_t)N * OC), want, tol);
    matmul_reference(&want, &tol, N, IC, OC, [&](int i, int p) { return (double)dout[(size_t)i * OC + p]; },
                     [&](int p, int j) { return (double)W[(size_t)p * IC + j]; }, nullptr);
    compare(&ck, "dinp", download(d_dinp, (size_t)N * IC), want, tol);
    matmul_reference(&want, &tol, OC, IC, N, [&](int i, int p) { return (double)dout[(size_t)p * OC + i]; },
                     [&](int p, int j) { return (double)inp[(size_t)p * IC + j]; }, &dW0);
    compare(&ck, "dweight", download(d_dW, (size_t)OC * IC), want, tol);
    matmul_reference(&want, &tol, 1, OC, N, [&](int, int) { return 1.0; },
                     [&](int p, int j) { return (double)dout[(size_t)p * OC + j]; }, &db0);
    compare(&ck, "dbias", download(d_db, OC), want, tol);
    for (void* p : {(void*)d_inp, (void*)d_W, (void*)d_bias, (void*)d_dout, (void*)d_dW, (void*)d_db, (void*)d_out,
                    (void*)d_dinp, (void*)partials, workspace})
        CUDA_CHECK(cudaFree(p));
    return report(ck);
}

// ---------------------------------------------------------------------------------------------

// ---------------------------------------------------------------------------------------------
// AdamW with bf16 moments: v's decay under g = 0 (issue 25; the CPU's twin is test/test_adamw_bf16.cpp)

static bool check_adamw_bf16() {
    const size_t n = 4096;
    const int steps = 300;
    AdamWParams a{};
    a.beta1 = 0.9f, a.beta2 = 0.999f, a.eps = 1e-8f, a.seed = 7;  // no decay, no clipping; every tensor_offset 0
    SliceIndexMap identity{};  // one rank's map for any n: global = 0 + 0 + (o / width) * 0 + 0 + o % width = o
    for (auto& t : identity.tensor) t.local_per_layer = t.width = (uint64_t)1 << 62;
    identity.per_chunk = 1;
    floatX* params = upload(std::vector<float>(n, 0.5f));
    floatX* grads = upload(std::vector<float>(n, 0.0f));
    uint16_t* m = upload_raw(std::vector<uint16_t>(n, 0));
    uint16_t* v = upload_raw(std::vector<uint16_t>(n, float_to_bf16_round_nearest(1.0f)));
    AdamWStep* now = device_alloc<AdamWStep>(1);
    for (int t = 1; t <= steps; t++) {
        AdamWStep values = adamw_step_values(a, t, 1e-3f, 0.0f);
        CUDA_CHECK(cudaMemcpy(now, &values, sizeof(values), cudaMemcpyHostToDevice));
        adamw_bf16_update(params, nullptr, grads, m, v, 0, n, now, a, identity, 0);
    }
    std::vector<uint16_t> v16(n);
    CUDA_CHECK(cudaMemcpy(v16.data(), v, n * sizeof(uint16_t), cudaMemcpyDeviceToHost));
    std::vector<float> got(n);
    double mean = 0.0;
    for (size_t i = 0; i < n; i++) mean += got[i] = bf16_to_float(v16[i]);
    mean /= n;
    // Each step's rounding error is under one spacing (2^-8 for v in [0.5, 1)), zero on average, its
    // variance at most spacing^2 / 4: summed over 300 steps, one sigma is at most 0.034 for an element's
    // v and 5e-4 for the mean of 4096. Limits: 0.2 per element, 0.005 for the mean (about 10 sigma);
    // round-to-nearest leaves v at 1, off by 0.26.
    double want = std::pow(0.999, steps);
    Check ck{"adamw_bf16"};
    compare(&ck, "mean v", {(float)mean}, {want}, {0.005});
    compare(&ck, "v", got, std::vector<double>(n, want), std::vector<double>(n, 0.2));
    for (void* p : {(void*)params, (void*)grads, (void*)m, (void*)v, (void*)now}) CUDA_CHECK(cudaFree(p));
    return report(ck);
}

int main(int argc, char** argv) {
    struct Named {
        const char* name;
        std::function<bool()> run;
    };
    const std::vector<Named> checks = {
        {"layernorm_forward_768", [] { return check_layernorm_forward(768); }},
        {"layernorm_forward_1600", [] { return check_layernorm_forward(1600); }},
        {"layernorm_forward_64", [] { return check_layernorm_forward(64); }},
        {"layernorm_backward_768", [] { return check_layernorm_backward(768, 150); }},
        {"layernorm_backward_1600", [] { return check_layernorm_backward(1600, 150); }},
        {"layernorm_backward_320", [] { return check_layernorm_backward(320, 330); }},
        {"layernorm_backward_6400", [] { return check_layernorm_backward(6400, 12); }},
        {"classifier", check_classifier},
        {"matmul", check_matmul},
        {"adamw_bf16", check_adamw_bf16},
    };
    // an argument names a check, or a family of them: "layernorm_forward" is every width
    auto selects = [](const std::string& arg, const std::string& name) {
        return name == arg || name.rfind(arg + "_", 0) == 0;
    };
    for (int i = 1; i < argc; i++) {
        bool known = false;
        for (const Named& c : checks) known |= selects(argv[i], c.name);
        if (!known) {
            fprintf(stderr, "emu_kernel_checks: unknown check '%s' (layernorm_forward[_768|_1600|_64], "
                            "layernorm_backward[_768|_1600|_320|_6400], classifier, matmul, adamw_bf16)\n", argv[i]);
            return 2;
        }
    }
    bool all_ok = true;
    for (const Named& c : checks) {
        bool wanted = argc == 1;
        for (int i = 1; i < argc; i++) wanted |= selects(argv[i], c.name);
        if (wanted) all_ok &= c.run();
    }
    return all_ok ? 0 : 1;
}
