// cpu_profile.h — `--profile` for the CPU trainer: where a training step's time goes, and how close
// each kind of work comes to what this machine can do.
//
// Every kernel of llmc/model/cpu_layers.h opens with one line,
//     LAYER_PROFILE("kind", flops, bytes, m, n, k);
// which this file (included before the layers) turns into a ProfileScope; without it the macro is
// empty, so the layers include nothing of the profiler. A scope costs one branch when profiling is
// off. When it is on, it times the call and adds it to the step's row for that kind and shape (each
// matmul shape is its own row: the LM head's (BT x Vp x C) behaves nothing like a layer's). After
// each step the trainer prints the table:
//     time (ms), share of the step, calls, and the achieved rate: GFLOP/s for matmuls and attention
//     (2 flops per multiply-add, causal attention counted over the T(T+1)/2 scores it computes),
//     GB/s for the memory-bound rest (bytes read + written once, what a perfect cache would move)
// next to a ceiling measured right before each step: our own matmul on a large square product (the
// best the register tile, packing and blocking reach here, best of 3), since a machine shared with
// other jobs changes speed from second to second and a ceiling from another moment would flatter or
// insult the step. At the end the median of each row over the steps after the first.
//
// Timing needs nothing from the kernels but that they are called from the serial part of the
// program (each opens its own parallel region), which is how the trainer is written.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <functional>
#include <map>
#include <string>
#include <vector>

struct ProfileRow {
    double seconds = 0, flops = 0, bytes = 0;
    int calls = 0;
};

struct Profiler {
    bool on = false;
    int vocab_rows = 0;                               // a matmul with this many outputs is the LM head
    double ceiling_gflops = 0;                        // our matmul on a large square product, before this step
    std::vector<double> ceilings;                     // ... before every step
    std::function<double()> measure_ceiling;
    std::map<std::string, ProfileRow> step;           // this step's rows, by name
    std::map<std::string, std::vector<ProfileRow>> history;  // every step's row of each name
    std::vector<double> step_seconds;
    std::chrono::steady_clock::time_point step_start;
};
inline Profiler profiler;

// Times one call of a kernel. flops = 0 marks memory-bound work, reported in GB/s of `bytes`.
struct ProfileScope {
    const char* kind;
    double flops, bytes;
    int m, n, k;
    std::chrono::steady_clock::time_point start;
    ProfileScope(const char* kind_, double flops_, double bytes_ = 0, int m_ = 0, int n_ = 0, int k_ = 0)
        : kind(kind_), flops(flops_), bytes(bytes_), m(m_), n(n_), k(k_) {
        if (profiler.on) start = std::chrono::steady_clock::now();
    }
    ~ProfileScope() {
        if (!profiler.on) return;
        double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        std::string name = kind;
        if (m > 0) {  // matmuls: the shape, and which layer it is when the shape says so
            char shape[96];
            snprintf(shape, sizeof shape, " %dx%dx%d", m, n, k);
            bool head = profiler.vocab_rows > 0 && (m == profiler.vocab_rows || n == profiler.vocab_rows || k == profiler.vocab_rows);
            name = (head ? std::string("classifier ") : std::string("matmul ")) + kind + shape;
        }
        ProfileRow& r = profiler.step[name];
        r.seconds += s;
        r.flops += flops;
        r.bytes += bytes;
        r.calls++;
    }
};

// The layers' hook (llmc/model/cpu_layers.h, which leaves it empty when nothing defined it first):
// one ProfileScope for the rest of the kernel's body.
#ifdef LAYER_PROFILE
#error "include llmc/probes/cpu_profile.h before llmc/model/cpu_layers.h and llmc/optim/adamw.h: their LAYER_PROFILE is already empty"
#endif
#define LAYER_PROFILE(...) ProfileScope layer_profile_scope(__VA_ARGS__)

// Before the first step: switch on, with `matmul` (the trainer's, passed in so this file needs nothing
// from it) as the ceiling's yardstick: C = A B at n^3, the best of 3 (a loaded machine only slows it).
template <typename Matmul>
void profile_start(bool on, int vocab_rows, Matmul matmul, int n = 1536) {
    if (!on) return;
    profiler.on = true;
    profiler.vocab_rows = vocab_rows;
    profiler.measure_ceiling = [matmul, n]() {
        static std::vector<float> a((size_t)n * n, 0.01f), b((size_t)n * n, 0.02f), c((size_t)n * n);
        double best = 0;
        for (int rep = 0; rep < 3; rep++) {
            auto t0 = std::chrono::steady_clock::now();
            matmul(n, n, n, a.data(), (size_t)n, (size_t)1, b.data(), (size_t)n, (size_t)1, c.data(), (size_t)n, false);
            double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
            best = std::max(best, 2.0 * n * n * n / s / 1e9);
        }
        return best;
    };
    printf("profile: the SGEMM ceiling is our matmul at %d^3, best of 3, measured before each step\n", n);
}

inline void profile_step_begin() {
    if (!profiler.on) return;
    profiler.ceiling_gflops = profiler.measure_ceiling();
    profiler.ceilings.push_back(profiler.ceiling_gflops);
    profiler.step.clear();
    profiler.step_start = std::chrono::steady_clock::now();
}

inline void profile_print_table(const char* title, const std::map<std::string, ProfileRow>& rows, double step_s) {
    printf("profile: %s, %.1f ms; SGEMM ceiling %.1f GFLOP/s\n", title, 1e3 * step_s, profiler.ceiling_gflops);
    printf("  %-40s %9s %6s %6s %12s %8s\n", "work", "ms", "share", "calls", "rate", "of SGEMM");
    std::vector<std::pair<std::string, ProfileRow>> sorted(rows.begin(), rows.end());
    std::sort(sorted.begin(), sorted.end(), [](auto& x, auto& y) { return x.second.seconds > y.second.seconds; });
    double accounted = 0, flops = 0;
    for (auto& [name, r] : sorted) {
        accounted += r.seconds;
        flops += r.flops;
        char rate[32] = "", of_peak[16] = "";
        if (r.flops > 0) {
            snprintf(rate, sizeof rate, "%.1f GFLOP/s", r.flops / r.seconds / 1e9);
            snprintf(of_peak, sizeof of_peak, "%.0f%%", 100 * r.flops / r.seconds / 1e9 / profiler.ceiling_gflops);
        } else if (r.bytes > 0) {
            snprintf(rate, sizeof rate, "%.1f GB/s", r.bytes / r.seconds / 1e9);
        }
        printf("  %-40s %9.2f %5.1f%% %6d %12s %8s\n", name.c_str(), 1e3 * r.seconds, 100 * r.seconds / step_s, r.calls,
               rate, of_peak);
    }
    printf("  %-40s %9.2f %5.1f%%\n", "other (zeroing grads, data, bookkeeping)", 1e3 * (step_s - accounted),
           100 * (step_s - accounted) / step_s);
    printf("  step: %.1f GFLOP, %.1f GFLOP/s = %.0f%% of the SGEMM ceiling\n", flops / 1e9, flops / step_s / 1e9,
           100 * flops / step_s / 1e9 / profiler.ceiling_gflops);
}

inline void profile_step_end(int step) {
    if (!profiler.on) return;
    double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - profiler.step_start).count();
    profiler.step_seconds.push_back(s);
    for (auto& [name, r] : profiler.step) profiler.history[name].push_back(r);
    char title[64];
    snprintf(title, sizeof title, "step %d", step);
    profile_print_table(title, profiler.step, s);
}

// The median of each row (and of the step) over the steps after the first, which pays for page
// faults and cold caches.
inline void profile_finish() {
    if (!profiler.on || profiler.step_seconds.size() < 2) return;
    auto median = [](std::vector<double> v) { std::sort(v.begin(), v.end()); return v[v.size() / 2]; };
    std::map<std::string, ProfileRow> rows;
    for (auto& [name, steps] : profiler.history) {
        std::vector<double> s;
        for (size_t i = 1; i < steps.size(); i++) s.push_back(steps[i].seconds);
        if (s.empty()) continue;
        ProfileRow r = steps.back();
        r.seconds = median(s);
        rows[name] = r;
    }
    std::vector<double> steps(profiler.step_seconds.begin() + 1, profiler.step_seconds.end());
    profiler.ceiling_gflops = median(std::vector<double>(profiler.ceilings.begin() + 1, profiler.ceilings.end()));
    char title[96];
    snprintf(title, sizeof title, "median of steps 2-%zu (each row its own median: they need not add up)",
             profiler.step_seconds.size());
    profile_print_table(title, rows, median(steps));
}
