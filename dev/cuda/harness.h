// harness.h — the host-only half of the kernel lab's harness: how an output is judged, how a time
// is summarised, how a row of the table looks, and the command line. No CUDA here, so
// test/test_kernel_lab_harness.cpp can check all of it on a machine without a GPU.
//
// Judging an output. A kernel's output is compared with a CPU reference computed in fp32 (or
// float64) from the very same inputs, already rounded to bf16 where the GPU sees bf16. Four things
// must hold, and the table shows the first two numbers:
//   1. relative L2 error  ||out - ref|| / ||ref||  <= the bound of the output's type
//        bf16: 1e-2. One rounding of the result costs ~1.6e-3 (half an ulp is 2^-9 relative, spread
//        uniformly); paths that round intermediates to bf16 (the materialised attention rounds its
//        scores, its probabilities and dS) reach ~4.5e-3 (simulated with torch for the backward at
//        T=1024). 1e-2 leaves a factor two of margin and still fails a wrong index or a wrong formula,
//        which cost O(1).
//        fp32: 1e-5. fp32 outputs (statistics, losses, optimizer state, norms) are computed in fp32
//        from exact inputs, so they differ from the reference only by summation order and fast-math
//        exp/rsqrt: ~1e-6 at the worst. 1e-5 is two orders under the 1e-3 that a real bug costs.
//   2. max abs error <= 10 x bound x max|ref|. The L2 error averages over millions of elements: a
//        kernel that skips one row of a gradient it accumulates into (where poison cannot be used,
//        see below) can hide under it; the max norm cannot.
//   3. no NaN or Inf. A NaN compares false with everything, so an error metric computed naively
//        (err > bound ? FAIL : PASS) would PASS it; here it is counted and fails on its own.
//   4. no unwritten element. Outputs are "poisoned" before each checked launch: every byte set to
//        0xFF, which is a NaN in both bf16 (0xFFFF) and fp32 (0xFFFFFFFF) with the sign bit set, a
//        pattern no arithmetic produces (CUDA's NaN is 0x7FFF / 0x7FFFFFFF). An element still holding
//        it was never written: a kernel that covers only part of its output fails, even if the
//        previous version had left the right answer in the buffer.
// Outputs a kernel ADDS to (dW += ...) cannot be poisoned: they start from random values, and the
// reference adds to the same values; rule 2 is what guards them.
//
// Timing (in common.h) gives a list of per-launch times; the table shows their median, robust to
// the odd launch delayed by the host or a clock change. "% of ceiling" is the roofline floor of the
// operation divided by the measured time: floor = max(bytes / copy bandwidth, FLOPs / GEMM rate),
// where bytes are the least the operation must move (every input read once, every output written
// once) and the two ceilings are measured in the same process. 100% means "as fast as this GPU can
// move these bytes or do these FLOPs"; every version of a kernel is charged the same bytes and FLOPs,
// so the column compares them directly.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>
#include "llmc/model/model.h"
#include "llmc/utils.h"

// ----------------------------------------------------------------------------------------------
// Element types and their bounds

enum Dtype { DT_F32, DT_BF16 };

inline const char* dtype_name(Dtype d) { return d == DT_BF16 ? "bf16" : "fp32"; }
inline double error_bound(Dtype d) { return d == DT_BF16 ? 1e-2 : 1e-5; }
constexpr double MAX_ERROR_FACTOR = 10.0;  // rule 2: max abs error <= 10 x bound x max|ref|
constexpr unsigned char POISON_BYTE = 0xFF;

// ----------------------------------------------------------------------------------------------
// The error metric

struct ErrorStats {
    size_t n = 0;
    size_t not_finite = 0;     // NaN or Inf computed by the kernel
    size_t unwritten = 0;      // still holding the poison pattern
    size_t bad_reference = 0;  // NaN/Inf in the reference: the test itself is broken
    double rel_l2 = 0;         // ||out - ref|| / ||ref|| over the finite, written elements
    double max_abs = 0;        // max |out - ref|
    double ref_max_abs = 0;    // max |ref|
    size_t worst = 0;          // index of max_abs
    double bound = 0;
    bool pass = false;
    std::string why;           // empty when pass
};

// out_raw: n elements of type dt exactly as the GPU left them (bits, not converted values).
inline ErrorStats compare_output(const void* out_raw, Dtype dt, const float* ref, size_t n) {
    ErrorStats s;
    s.n = n;
    s.bound = error_bound(dt);
    double diff2 = 0, ref2 = 0;
    for (size_t i = 0; i < n; i++) {
        float out;
        bool poisoned;
        if (dt == DT_BF16) {
            uint16_t bits = ((const uint16_t*)out_raw)[i];
            poisoned = bits == 0xFFFFu;
            out = bf16_to_float(bits);
        } else {
            uint32_t bits;
            memcpy(&bits, (const char*)out_raw + 4 * i, 4);
            poisoned = bits == 0xFFFFFFFFu;
            memcpy(&out, &bits, 4);
        }
        if (!std::isfinite(ref[i])) {
            s.bad_reference++;
            continue;
        }
        if (poisoned) {
            s.unwritten++;
            continue;
        }
        if (!std::isfinite(out)) {
            s.not_finite++;
            continue;
        }
        double d = (double)out - (double)ref[i];
        diff2 += d * d;
        ref2 += (double)ref[i] * ref[i];
        if (std::fabs(d) > s.max_abs) {
            s.max_abs = std::fabs(d);
            s.worst = i;
        }
        s.ref_max_abs = std::max(s.ref_max_abs, (double)std::fabs(ref[i]));
    }
    s.rel_l2 = ref2 > 0 ? std::sqrt(diff2 / ref2) : (diff2 > 0 ? INFINITY : 0.0);
    if (n == 0) s.why = "no elements to compare";
    else if (s.bad_reference) s.why = strprintf("the reference has %zu NaN/Inf values (a broken test)", s.bad_reference);
    else if (s.unwritten) s.why = strprintf("%zu of %zu elements never written (still poison)", s.unwritten, n);
    else if (s.not_finite) s.why = strprintf("%zu NaN/Inf elements", s.not_finite);
    else if (ref2 == 0) s.why = "the reference is all zeros: the comparison would prove nothing";
    else if (!(s.rel_l2 <= s.bound)) s.why = strprintf("relative error %.2e > bound %.0e", s.rel_l2, s.bound);
    else if (!(s.max_abs <= MAX_ERROR_FACTOR * s.bound * s.ref_max_abs))
        s.why = strprintf("max abs error %.2e at element %zu > %.0f x bound x max|ref| = %.2e", s.max_abs, s.worst,
                          MAX_ERROR_FACTOR, MAX_ERROR_FACTOR * s.bound * s.ref_max_abs);
    s.pass = s.why.empty();
    return s;
}

// A digest of an output's bits (64-bit FNV-1a), printed with each check: a kernel without atomics
// must give the same bits whatever the order of its threads and blocks, so two runs on the same
// seed that print different digests for it have found a race (test/test_emu_kernel_lab.py compares
// them across the CPU emulation's schedules).
inline uint64_t bits_digest(const void* p, size_t bytes) {
    uint64_t h = 0xcbf29ce484222325ull;
    for (size_t i = 0; i < bytes; i++) h = (h ^ ((const unsigned char*)p)[i]) * 0x100000001b3ull;
    return h;
}

// ----------------------------------------------------------------------------------------------
// Times

inline double median(std::vector<double> v) {
    if (v.empty()) return NAN;
    std::sort(v.begin(), v.end());
    size_t h = v.size() / 2;
    return v.size() % 2 ? v[h] : 0.5 * (v[h - 1] + v[h]);
}

// How many copies of a kernel's inputs and outputs to rotate through while timing, so that each
// launch finds its data in DRAM, not in the L2 cache: together the copies span at least three times
// the L2, so a copy's lines have been evicted by the time it comes round again. Capped at 8.
inline int rotation_slots(double bytes_per_slot, double l2_bytes) {
    if (bytes_per_slot <= 0) return 1;
    double need = std::ceil(3.0 * l2_bytes / bytes_per_slot);
    return (int)std::max(1.0, std::min(8.0, need));
}

// How many timed launches: about 300 ms worth, at least 5, at most 100.
inline int timed_repeats(double ms_per_launch) {
    if (!(ms_per_launch > 0)) return 100;
    return (int)std::max(5.0, std::min(100.0, std::round(300.0 / ms_per_launch)));
}

// ----------------------------------------------------------------------------------------------
// The table

struct Ceilings {
    double copy_gbs = 0;     // device-to-device copy, GB/s counting read + write
    double gemm_tflops = 0;  // cuBLAS bf16 GEMM (fp32 accumulation) at 8192^3
};

// The roofline floor of an operation (ms) and the share of it a measured time reaches (%).
inline double floor_ms(double bytes, double flops, const Ceilings& c) {
    double t_mem = c.copy_gbs > 0 ? bytes / (c.copy_gbs * 1e9) * 1e3 : 0;
    double t_flop = c.gemm_tflops > 0 ? flops / (c.gemm_tflops * 1e12) * 1e3 : 0;
    return std::max(t_mem, t_flop);
}

struct Row {
    std::string kernel;
    int version = 0;
    std::string name;        // short name of the version
    double ms = NAN;         // median time; NaN when not timed
    double bytes = 0, flops = 0;
    Ceilings ceilings;
    double rel_l2 = NAN, max_abs = NAN;
    std::string status;      // PASS, FAIL, SKIP, ERROR
};

inline std::string format_time(double ms) {
    if (!(ms >= 0)) return "-";
    if (ms >= 100) return strprintf("%.0f ms", ms);
    if (ms >= 1) return strprintf("%.2f ms", ms);
    return strprintf("%.1f us", ms * 1e3);
}

// What the kernel achieves, in the unit of the ceiling that bounds it (the larger floor).
inline std::string format_achieved(const Row& r) {
    if (!(r.ms > 0)) return "-";
    double t_mem = r.ceilings.copy_gbs > 0 ? r.bytes / (r.ceilings.copy_gbs * 1e9) : 0;
    double t_flop = r.ceilings.gemm_tflops > 0 ? r.flops / (r.ceilings.gemm_tflops * 1e12) : 0;
    if (r.flops > 0 && t_flop >= t_mem) return strprintf("%.1f TFLOP/s", r.flops / (r.ms * 1e-3) / 1e12);
    return strprintf("%.0f GB/s", r.bytes / (r.ms * 1e-3) / 1e9);
}

inline std::string format_percent(const Row& r) {
    if (!(r.ms > 0)) return "-";
    double f = floor_ms(r.bytes, r.flops, r.ceilings);
    return f > 0 ? strprintf("%.1f%%", 100.0 * f / r.ms) : "-";
}

inline std::string format_error(double e) { return std::isnan(e) ? "-" : strprintf("%.1e", e); }

// One markdown table row, padded so that the table also reads in a terminal.
inline std::string table_header() {
    return strprintf("| %-22s | %-28s | %9s | %14s | %10s | %8s | %8s | %-6s |\n", "kernel", "version", "time",
                     "achieved", "% of ceil.", "rel err", "max abs", "status") +
           "|------------------------|------------------------------|----------:|---------------:|-----------:|"
           "---------:|---------:|--------|\n";
}

inline std::string table_row(const Row& r) {
    std::string version = strprintf("%d %s", r.version, r.name.c_str());
    return strprintf("| %-22s | %-28s | %9s | %14s | %10s | %8s | %8s | %-6s |\n", r.kernel.c_str(), version.c_str(),
                     format_time(r.ms).c_str(), format_achieved(r).c_str(), format_percent(r).c_str(),
                     format_error(r.rel_l2).c_str(), format_error(r.max_abs).c_str(), r.status.c_str());
}

// ----------------------------------------------------------------------------------------------
// The versions of a file and its command line

// One line of a file's table of contents: which kernel, which step, what it changes.
struct Version {
    const char* kernel;
    int id;
    const char* name;    // short, for the table
    const char* what;    // one sentence: what this version changes
    bool trainers;       // the kernel train_gpt.cu runs, #included from llmc/
};

struct LabArgs {
    bool small = false;          // --small: B=2, T=256 (quick checks)
    bool tiny = false;           // --tiny: B=2, T=64, C=1600, V=1001 (for the CPU emulation of CUDA)
    bool check_only = false;     // --check-only: the correctness checks, no ceilings, no timing
    bool list = false;           // --list: print the versions and exit (no GPU needed)
    int batch = 0;               // --batch B (0: 8, or 2 with --small)
    uint64_t seed = 0;           // --seed S (0: a fresh one each run)
    int repeats = 0;             // --repeats N (0: about 300 ms worth)
    std::string kernel;          // --kernel NAME: only this kernel of the file
    std::vector<int> versions;   // --version N / bare numbers: only these versions
};

inline bool parse_lab_args(int argc, char** argv, LabArgs* a, std::string* err) {
    auto number = [&](const char* s, long long* v) {
        char* end = nullptr;
        *v = strtoll(s, &end, 10);
        return end != s && *end == '\0';
    };
    for (int i = 1; i < argc; i++) {
        std::string arg = argv[i];
        long long v = 0;
        auto value = [&](const char* what) -> const char* {
            if (i + 1 >= argc) {
                *err = strprintf("%s needs %s", arg.c_str(), what);
                return nullptr;
            }
            return argv[++i];
        };
        if (arg == "--small") a->small = true;
        else if (arg == "--tiny") a->tiny = true;
        else if (arg == "--check-only") a->check_only = true;
        else if (arg == "--list") a->list = true;
        else if (arg == "--batch" || arg == "--seed" || arg == "--repeats" || arg == "--version") {
            const char* s = value("a number");
            if (!s) return false;
            if (!number(s, &v) || v < (arg == "--seed" ? 0 : 1)) {
                *err = strprintf("%s: '%s' is not a valid number", arg.c_str(), s);
                return false;
            }
            if (arg == "--batch") a->batch = (int)v;
            else if (arg == "--seed") a->seed = (uint64_t)v;
            else if (arg == "--repeats") a->repeats = (int)v;
            else a->versions.push_back((int)v);
        } else if (arg == "--kernel") {
            const char* s = value("a kernel name");
            if (!s) return false;
            a->kernel = s;
        } else if (number(arg.c_str(), &v) && v >= 1) {
            a->versions.push_back((int)v);
        } else {
            *err = strprintf("unknown argument '%s' (usage: [--small | --tiny] [--check-only] [--batch B] [--seed S] [--repeats N] "
                             "[--kernel NAME] [--version N | N ...] [--list])", arg.c_str());
            return false;
        }
    }
    if (a->small && a->tiny) {
        *err = "--small and --tiny are two sizes: choose one";
        return false;
    }
    return true;
}

inline bool lab_selected(const LabArgs& a, const char* kernel, int version) {
    if (!a.kernel.empty() && a.kernel != kernel) return false;
    return a.versions.empty() || std::find(a.versions.begin(), a.versions.end(), version) != a.versions.end();
}

// A seed nobody chose: fresh inputs on every run (printed, so a failure can be replayed with --seed).
inline uint64_t fresh_seed() {
    std::random_device rd;
    uint64_t s = ((uint64_t)rd() << 32) ^ rd() ^ (uint64_t)std::chrono::steady_clock::now().time_since_epoch().count();
    return s % 1000000007ull + 1;  // short enough to type back
}

// ----------------------------------------------------------------------------------------------
// Random inputs, a pure function of (seed, index): reproducible whatever the thread count.

// uniform in (0, 1), never 0
inline double uniform01(uint64_t seed, uint64_t i) {
    return ((splitmix64(splitmix64(seed) ^ i) >> 11) + 0.5) * (1.0 / 9007199254740992.0);
}

// normal_from_counter is the one the trainers initialise weights with (llmc/model/model.h)
inline std::vector<float> random_normal(size_t n, uint64_t seed, float mean, float std) {
    std::vector<float> v(n);
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) v[i] = mean + std * normal_from_counter(seed, i);
    return v;
}

inline std::vector<float> random_uniform(size_t n, uint64_t seed, float lo, float hi) {
    std::vector<float> v(n);
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) v[i] = lo + (hi - lo) * (float)uniform01(seed, i);
    return v;
}

// Round every value to the nearest bf16, in place: the host copy then holds exactly what the GPU
// reads, and the reference is computed from the same numbers.
inline void round_to_bf16(std::vector<float>* v) {
    float* x = v->data();
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < v->size(); i++) x[i] = bf16_to_float(float_to_bf16_round_nearest(x[i]));
}
