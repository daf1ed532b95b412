// matmul_bench.cpp — the CPU trainer's matmul (llmc/model/cpu_matmul.h) on every d12 (GPT-2 124M)
// training shape, as a share of the machine's FMA peak, timed in CPU seconds so that a machine
// shared with other jobs still gives honest numbers.
//
//   make matmul_bench && OMP_NUM_THREADS=1 ./matmul_bench      all shapes, M = 256 and 2048 (~1 CPU-minute)
//   OMP_NUM_THREADS=1 ./matmul_bench --rows 256 --reps 5 --only forward        a subset
//   OMP_NUM_THREADS=1 ./matmul_bench --rows 512 --channels 64 --orientation stored   the main job's shapes, C as stored
//
// Each shape is the product one linear layer runs (cpu_layers.h: matmul_forward, _backward_input,
// _backward_weight), with the same strides (the weight read transposed in the forward, the output
// gradient read transposed for the weight gradient). Rows: M = B*T = 256 (B=4, T=64) and 2048
// (B=8, T=256). GFLOP/s = 2MNK / CPU seconds of this thread (CLOCK_THREAD_CPUTIME_ID) with one
// thread, or / (process CPU seconds / threads) with more: a thread that waits at a barrier spinning
// counts, one that is preempted does not. The FMA peak is measured the same way in the same run:
// 12 independent chains of vector FMAs on registers (scripts/bench_cpu_vs_pytorch.py's fma_peak).
// Every result is checked against a double-precision dot product at a few sampled entries.
#include <omp.h>
#include <time.h>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include "llmc/model/cpu_matmul.h"

static double cpu_seconds() {
    timespec ts;
    clock_gettime(omp_get_max_threads() == 1 ? CLOCK_THREAD_CPUTIME_ID : CLOCK_PROCESS_CPUTIME_ID, &ts);
    return (ts.tv_sec + 1e-9 * ts.tv_nsec) / omp_get_max_threads();
}
static double wall_seconds() { return omp_get_wtime(); }

typedef float v16 __attribute__((vector_size(64)));
static double fma_peak() {  // GFLOP/s per thread, best of 5
    long iters = 20000000;
    double best = 0, sink = 0;
    for (int rep = 0; rep < 5; rep++) {
        double t0 = cpu_seconds();
        #pragma omp parallel reduction(+ : sink)
        {
            v16 a[12], b = {}, c = {};
            for (int k = 0; k < 12; k++) for (int j = 0; j < 16; j++) a[k][j] = 1.0f + k + j;
            for (int j = 0; j < 16; j++) { b[j] = 1e-7f; c[j] = 0.9999999f; }
            for (long i = 0; i < iters; i++) {
                #pragma GCC unroll 12
                for (int k = 0; k < 12; k++) a[k] = a[k] * c + b;
            }
            for (int k = 0; k < 12; k++) for (int j = 0; j < 16; j++) sink += a[k][j];
        }
        best = std::max(best, 2.0 * 16 * 12 * iters / (cpu_seconds() - t0) / 1e9);
    }
    if (sink == 12345) printf(" ");
    return best;
}

struct Shape {
    const char* layer;
    const char* product;
    int M, N, K;
    bool a_t, b_t;  // A read transposed (a_rs = 1), B read transposed (b_rs = 1)
};

int main(int argc, char** argv) {
    int reps = 3, only_rows = 0, C = 768;
    std::string only, orientation = "auto";  // auto: matmul() chooses; stored, transposed: C or C^T forced
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--reps") && i + 1 < argc) reps = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--rows") && i + 1 < argc) only_rows = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--only") && i + 1 < argc) only = argv[++i];
        else if (!strcmp(argv[i], "--channels") && i + 1 < argc) C = atoi(argv[++i]);
        else if (!strcmp(argv[i], "--orientation") && i + 1 < argc) orientation = argv[++i];
        else {
            fprintf(stderr, "usage: %s [--reps N] [--rows M] [--channels C] [--only SUBSTRING] [--orientation auto|stored|transposed]\n", argv[0]);
            return 2;
        }
    }
    const int V = 50304;
    struct Layer { const char* name; int IC, OC; } layers[] = {
        {"qkv", C, 3 * C}, {"attproj", C, C}, {"fc", C, 4 * C}, {"fcproj", 4 * C, C}, {"classifier", C, V}};
    std::vector<Shape> shapes;
    std::vector<int> row_counts = {256, 2048};
    if (only_rows) row_counts = {only_rows};  // any M: the main job's is 512 (B=8, T=64)
    for (int rows : row_counts) {
        for (auto& l : layers) {
            shapes.push_back({l.name, "forward", rows, l.OC, l.IC, false, true});
            shapes.push_back({l.name, "backward, data", rows, l.IC, l.OC, false, false});
            shapes.push_back({l.name, "backward, weight", l.OC, l.IC, rows, true, false});
        }
    }
    int threads = omp_get_max_threads();
    double peak = fma_peak();
    printf("FMA peak %.1f GFLOP/s per thread (%d thread%s, CPU time)\n", peak, threads, threads > 1 ? "s" : "");
    printf("%-11s %-17s %6s %6s %6s | %8s %6s %7s\n", "layer", "product", "M", "N", "K", "GFLOP/s", "% FMA", "wall ms");
    double flops_all = 0, cpu_all = 0;
    std::mt19937 rng(1);
    std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
    for (auto& s : shapes) {
        if (!only.empty() && std::string(s.layer).find(only) == std::string::npos &&
            std::string(s.product).find(only) == std::string::npos) continue;
        std::vector<float> A((size_t)s.M * s.K), B((size_t)s.K * s.N), Cm((size_t)s.M * s.N);
        for (auto& x : A) x = dist(rng);
        for (auto& x : B) x = dist(rng);
        size_t a_rs = s.a_t ? 1 : s.K, a_cs = s.a_t ? s.M : 1;
        size_t b_rs = s.b_t ? 1 : s.N, b_cs = s.b_t ? s.K : 1;
        double best_cpu = 1e30, best_wall = 1e30;
        for (int r = 0; r < reps; r++) {
            double c0 = cpu_seconds(), w0 = wall_seconds();
            if (orientation == "stored")
                cpu::matmul_oriented(s.M, s.N, s.K, A.data(), a_rs, a_cs, B.data(), b_rs, b_cs, Cm.data(), s.N, false, false);
            else if (orientation == "transposed")
                cpu::matmul_oriented(s.N, s.M, s.K, B.data(), b_cs, b_rs, A.data(), a_cs, a_rs, Cm.data(), s.N, true, false);
            else
                cpu::matmul(s.M, s.N, s.K, A.data(), a_rs, a_cs, B.data(), b_rs, b_cs, Cm.data(), s.N, false);
            best_cpu = std::min(best_cpu, cpu_seconds() - c0);
            best_wall = std::min(best_wall, wall_seconds() - w0);
        }
        double worst = 0;
        for (int t = 0; t < 16; t++) {
            int i = rng() % s.M, j = rng() % s.N;
            double ref = 0, mag = 0;
            for (int k = 0; k < s.K; k++) {
                double p = (double)A[i * a_rs + k * a_cs] * B[k * b_rs + j * b_cs];
                ref += p;
                mag += fabs(p);
            }
            worst = std::max(worst, fabs(Cm[(size_t)i * s.N + j] - ref) / mag);
        }
        double flops = 2.0 * s.M * s.N * s.K;
        flops_all += flops;
        cpu_all += best_cpu;
        printf("%-11s %-17s %6d %6d %6d | %8.1f %5.1f%% %7.1f%s\n", s.layer, s.product, s.M, s.N, s.K,
               flops / best_cpu / 1e9, 100 * flops / best_cpu / 1e9 / peak, 1e3 * best_wall,
               worst > 1e-5 ? "  WRONG" : "");
        if (worst > 1e-5) return 1;
    }
    printf("all shapes: %.1f GFLOP/s per thread, %.1f%% of the FMA peak (FLOP-weighted)\n", flops_all / cpu_all / 1e9,
           100 * flops_all / cpu_all / 1e9 / peak);
}
