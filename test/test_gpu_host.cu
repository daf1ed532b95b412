// test_gpu_host.cu — the host-side parts of the GPU kernels' files, compiled by nvcc and run on the
// CPU (no GPU needed): the encoder backward's token buckets, which make its gradient deterministic.
#include <cstdio>
#include <random>
#include <vector>
#include "llmc/encoder.cuh"

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
    return failures ? 1 : 0;
}
