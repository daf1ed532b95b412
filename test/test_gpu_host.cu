// test_gpu_host.cu — the host-side parts of the GPU kernels' files, compiled by nvcc and run on the
// CPU (no GPU needed): the encoder backward's token buckets, which make its gradient deterministic
// (and a tensor rank's, of its vocabulary rows only); the GELU formula the kernels evaluate; cuDNN's
// version rules for the fused attention. (The pipeline's sends and receives, grouped as
// llmc/parallel/pipeline_parallel.cuh groups them, are run against NCCL's rule by test_pipeline_schedule.cpp.)
#include <cmath>
#include <cstdio>
#include <random>
#include <vector>
#include "llmc/kernels/attention_cudnn.cuh"
#include "llmc/kernels/encoder.cuh"
#include "llmc/kernels/gelu.cuh"

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
