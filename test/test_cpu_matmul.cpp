// test_cpu_matmul.cpp — the CPU trainer's SGEMM (llmc/model/cpu_matmul.h) against a double-precision
// product, on shapes chosen to reach every path of its blocking: tiles cut by the edge of C in M and
// in N, K not a multiple of KC (two blocks, the last one not a multiple of the packing's 8 x 8
// transposes), N wider than NC (two passes over B), the four stride combinations (each operand read
// as stored or transposed: the packing's copy and transpose paths), overwrite and accumulate.
// Each entry must be within 1e-5 of the sum of |terms| of the exact dot product (fp32 sums of up
// to ~400 terms: ~1e-6 seen). Then the same products with 1 and 2 threads must agree bit for bit
// (each tile of C belongs to one thread, k in a fixed order), for a C split by columns and by rows.
// A narrow C (N = 64 and the like) runs as its transpose: both orientations, bit for bit the same.
#include <omp.h>
#include <cmath>
#include <cstdio>
#include <random>
#include <string>
#include <vector>
#include "llmc/model/cpu_matmul.h"
#include "test/checks.h"

struct Case {
    int M, N, K;
};

static std::vector<float> random_floats(size_t n, std::mt19937& rng) {
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    std::vector<float> v(n);
    for (auto& x : v) x = dist(rng);
    return v;
}

// C (M x N, ldc = N + 3) for A stored M x K or K x M (a_t) and B stored K x N or N x K (b_t).
static std::vector<float> run(const Case& c, bool a_t, bool b_t, bool accumulate, const std::vector<float>& A,
                              const std::vector<float>& B, const std::vector<float>& C0) {
    std::vector<float> C = C0;
    size_t ldc = c.N + 3;
    cpu::matmul(c.M, c.N, c.K, A.data(), a_t ? 1 : c.K, a_t ? c.M : 1, B.data(), b_t ? 1 : c.N, b_t ? c.K : 1, C.data(),
                ldc, accumulate);
    return C;
}

int main() {
    std::mt19937 rng(7);
    const int KC = MATMUL_KC, NC = MATMUL_NC, MR = MATMUL_MR, NR = MATMUL_NR;
    Case cases[] = {{1, 1, 1}, {MR - 1, NR + 5, 9}, {2 * MR + 3, 3 * NR - 7, KC + 13}, {MR + 1, NC + NR + 2, 20},
                    {4 * MR, 4 * NR, 2 * KC}, {6 * NR + 5, 2 * MR + 3, KC + 13}};
    for (const Case& c : cases) {
        auto A = random_floats((size_t)c.M * c.K, rng), B = random_floats((size_t)c.K * c.N, rng);
        auto C0 = random_floats((size_t)c.M * (c.N + 3), rng);
        for (int a_t = 0; a_t < 2; a_t++) {
            for (int b_t = 0; b_t < 2; b_t++) {
                for (int acc = 0; acc < 2; acc++) {
                    auto C = run(c, a_t, b_t, acc, A, B, C0);
                    double worst = 0;
                    bool padding_kept = true;
                    for (int i = 0; i < c.M; i++) {
                        for (int j = 0; j < c.N; j++) {
                            double exact = acc ? C0[(size_t)i * (c.N + 3) + j] : 0.0, size = fabs(exact);
                            for (int k = 0; k < c.K; k++) {
                                double a = a_t ? A[(size_t)k * c.M + i] : A[(size_t)i * c.K + k];
                                double b = b_t ? B[(size_t)j * c.K + k] : B[(size_t)k * c.N + j];
                                exact += a * b;
                                size += fabs(a * b);
                            }
                            worst = std::max(worst, fabs(C[(size_t)i * (c.N + 3) + j] - exact) / size);
                        }
                        for (int j = c.N; j < c.N + 3; j++)  // past N, within ldc: not C's, never written
                            padding_kept &= C[(size_t)i * (c.N + 3) + j] == C0[(size_t)i * (c.N + 3) + j];
                    }
                    char name[160];
                    snprintf(name, sizeof name, "M=%d N=%d K=%d, A%s B%s, %s: worst error %.1e of sum |terms|", c.M,
                             c.N, c.K, a_t ? "^T" : "", b_t ? "^T" : "", acc ? "accumulate" : "overwrite", worst);
                    check(worst < 1e-5 && padding_kept, name, padding_kept ? "over 1e-5" : "wrote past column N");
                }
            }
        }
    }
    // 1 thread vs 2: a C wide enough to be split by columns, and one split by rows
    for (Case c : {Case{3 * MR + 1, 16 * NR + 5, KC + 7}, Case{16 * MR + 3, NR + 1, KC + 7}}) {
        auto A = random_floats((size_t)c.M * c.K, rng), B = random_floats((size_t)c.K * c.N, rng);
        auto C0 = random_floats((size_t)c.M * (c.N + 3), rng);
        omp_set_num_threads(1);
        auto one = run(c, false, true, true, A, B, C0);
        omp_set_num_threads(2);
        auto two = run(c, false, true, true, A, B, C0);
        check(one == two, "M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + ": 1 and 2 threads bitwise identical",
              "they differ");
    }
    // the two orientations of a narrow product: the same bits
    {
        Case c{6 * NR + 5, 2 * MR + 3, KC + 13};
        auto A = random_floats((size_t)c.M * c.K, rng), B = random_floats((size_t)c.K * c.N, rng);
        auto C0 = random_floats((size_t)c.M * c.N, rng), as_is = C0, transposed = C0;
        cpu::matmul_oriented(c.M, c.N, c.K, A.data(), c.K, 1, B.data(), 1, c.K, as_is.data(), c.N, false, true);
        cpu::matmul_oriented(c.N, c.M, c.K, B.data(), c.K, 1, A.data(), 1, c.K, transposed.data(), c.N, true, true);
        check(as_is == transposed, "M=" + std::to_string(c.M) + " N=" + std::to_string(c.N) + ": C and C^T = B^T A^T bitwise identical",
              "they differ");
    }
    return check_exit_code();
}
