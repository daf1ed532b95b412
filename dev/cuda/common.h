// common.h — the kernel lab's harness: what every file in dev/cuda/ shares, so that each file holds
// only its kernels, their inputs and their reference.
//
// A file lists its versions (a table of Version rows), builds random inputs on the host, computes
// the CPU reference, copies the inputs to the GPU, and hands each version to lab_case(), which:
//   1. restores what the kernel overwrites, poisons the outputs (harness.h says why), runs the
//      version once and compares every output with the reference (harness.h: compare_output);
//   2. warms up, then times launches with CUDA events, rotating through `slots` copies of the inputs
//      and outputs when one copy would fit in the L2 cache (a copy met again is cold again), and
//      keeps the median;
//   3. adds a row to the table: time, achieved GB/s or TFLOP/s, % of the roofline floor computed from
//      the two ceilings measured at start (a large device-to-device copy and a large cuBLAS bf16
//      GEMM), relative and max error, PASS/FAIL.
// lab_end() prints the file's table and returns the exit code: 0 all passed, 3 a check failed (any
// other code is a crash: a CUDA error exits with 1). scripts/kernel_lab.sh runs every file and joins
// the tables.
//
// Shapes: GPT-2 small (d12) training, B=8 (--batch) x T=1024, C=768, 12 heads, vocab 50257 padded
// to 50304; --small: B=2, T=256, for a quick check; --tiny, for the CPU emulation of CUDA
// (test/emu/): B=2, T=64, d48's width C=1600 (25 heads of 64: not a multiple of 256 or of a warp's
// 16-byte loads) and a vocabulary of 1001 padded to 1024 (as odd as GPT-2's). T and B*T stay
// multiples of 64 and 128, which the flash attention and the tiled matmuls need, so every version
// runs and is checked.
// --check-only: the checks without the ceilings and the timing. Under the emulator it is always on:
// an emulated time says nothing about a GPU (and its 8192^3 GEMM ceiling would take an hour).
#pragma once

#ifdef LLMC_FP32
#error "the kernel lab measures the bf16 trainer: build it without LLMC_FP32"
#endif

#include <cublas_v2.h>
#include <functional>
#include "dev/cuda/harness.h"
#include "llmc/model/cpu_layers.h"  // the reference: the CPU trainer's own layers, named cpu::
#include "llmc/optim/adamw.h"       // ... and its optimizer step (cpu::adamw_update, cpu::global_grad_norm)
#include "llmc/kernels/cuda_common.cuh"
#include "llmc/kernels/matmul.cuh"  // CUBLAS_CHECK (and cuBLAS, for the GEMM ceiling)

// ----------------------------------------------------------------------------------------------
// Device memory: every buffer is freed by lab_end()

inline std::vector<void*>& lab_allocations() {
    static std::vector<void*> all;
    return all;
}

template <class T> T* device_alloc(size_t n) {
    void* p = nullptr;
    CUDA_CHECK(cudaMalloc(&p, std::max<size_t>(n, 1) * sizeof(T)));
    lab_allocations().push_back(p);
    return (T*)p;
}

inline void copy_to_device(floatX* dst, const std::vector<float>& src) {
    std::vector<uint16_t> bits(src.size());
    for (size_t i = 0; i < src.size(); i++) bits[i] = float_to_bf16_round_nearest(src[i]);
    CUDA_CHECK(cudaMemcpy(dst, bits.data(), bits.size() * 2, cudaMemcpyHostToDevice));
}
inline void copy_to_device(float* dst, const std::vector<float>& src) {
    CUDA_CHECK(cudaMemcpy(dst, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
}
inline void copy_to_device(int* dst, const std::vector<int>& src) {
    CUDA_CHECK(cudaMemcpy(dst, src.data(), src.size() * 4, cudaMemcpyHostToDevice));
}

// `slots` device copies of a host array (bf16, fp32 or int, by the type asked for).
template <class T, class H> std::vector<T*> to_device(const std::vector<H>& host, int slots) {
    std::vector<T*> d(slots);
    for (int s = 0; s < slots; s++) {
        d[s] = device_alloc<T>(host.size());
        copy_to_device(d[s], host);
    }
    return d;
}

// `slots` uninitialised device buffers of n elements
template <class T> std::vector<T*> device_slots(size_t n, int slots) {
    std::vector<T*> d(slots);
    for (int s = 0; s < slots; s++) d[s] = device_alloc<T>(n);
    return d;
}

// ----------------------------------------------------------------------------------------------
// What a version is checked on, and how it is run

// One output compared with its reference after the checked launch (slot 0's buffer).
struct Check {
    const char* name;
    const void* device;
    Dtype dtype;
    const std::vector<float>* ref;
    bool poison;  // false for outputs the kernel adds to: prepare() gives them their start values
};

inline Check bf16_output(const char* name, const void* device, const std::vector<float>& ref, bool poison = true) {
    return Check{name, device, DT_BF16, &ref, poison};
}
inline Check f32_output(const char* name, const void* device, const std::vector<float>& ref, bool poison = true) {
    return Check{name, device, DT_F32, &ref, poison};
}

// One version of one kernel. A file fills the fields its versions share once, then copies and sets
// `version` and `run` for each.
struct Case {
    const char* kernel = "";
    int version = 0;
    double bytes = 0;  // the least the operation must move, in bytes (the same for every version)
    double flops = 0;  // its useful floating-point operations (0 for memory-bound kernels)
    int slots = 1;     // input/output copies to rotate through while timing
    std::vector<Check> checks;
    std::function<void(int slot)> run;      // launches the version on lab.stream, on slot's buffers
    std::function<void(int slot)> prepare;  // restores what run() overwrites (before the check)
    bool prepare_before_timing = false;     // ... and before every timed round (data-dependent speed)
};

// ----------------------------------------------------------------------------------------------
// The lab: shapes, stream, ceilings, the rows so far

struct Lab {
    LabArgs args;
    const char* program = "";
    std::vector<Version> versions;
    int B = 8, T = 1024, C = 768, NH = 12, V = 50257, Vp = 50304;
    uint64_t seed = 0;
    int seeds_used = 0;
    cudaStream_t stream = nullptr;
    cudaDeviceProp prop{};
    Ceilings ceilings;
    std::vector<Row> rows;
    bool failed = false;
};

// A new seed for each input array: independent streams from the one printed seed.
inline uint64_t next_seed(Lab* lab) { return splitmix64(lab->seed + 0x1000 * (uint64_t)++lab->seeds_used); }

inline int lab_slots(const Lab& lab, double bytes_per_slot) {
    if (lab.args.check_only) return 1;  // nothing is timed: one copy of the inputs is enough
    return rotation_slots(bytes_per_slot, (double)lab.prop.l2CacheSize);
}

// The model whose parameters adamw.cu and global_norm.cu stream through: GPT-2 small (d12); one
// layer of it with --small; with --tiny, 2 layers of C=160 over the tiny vocabulary (0.8M
// parameters: a thread per parameter stays affordable under emulation).
inline GPT2Config lab_model(const Lab& lab) {
    GPT2Config cfg;
    if (lab.args.small) cfg.num_layers = 1;
    if (lab.args.tiny) {
        cfg.num_layers = 2;
        cfg.channels = 160;
        cfg.num_heads = 2;
        cfg.max_seq_len = lab.T;
        cfg.vocab_size = lab.V;
        cfg.padded_vocab_size = lab.Vp;
    }
    return cfg;
}

// Random bf16 in [-1, 1) from a hash of the index (the ceilings' operands: a GEMM on zeros would
// draw less power and could clock higher than on real data).
__global__ void lab_fill_random_kernel(floatX* p, size_t n, uint64_t seed) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) p[i] = __float2bfloat16((float)(hash_u32(seed ^ (i * 0x9E3779B97F4A7C15ull)) >> 8) * (2.0f / 16777216.0f) - 1.0f);
}

// dst (bf16) += src (fp32): the last pass of the versions that accumulate a gradient with fp32
// atomics (bf16 atomics would round at every add), in encoder.cu, layernorm.cu and matmul.cu.
__global__ void add_f32_to_bf16(floatX* dst, const float* src, size_t n) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) dst[i] = __float2bfloat16(__bfloat162float(dst[i]) + src[i]);
}

// The two ceilings, measured in this process: the bandwidth of a 1 GiB device-to-device copy
// (bytes read + bytes written per second: what a memory-bound kernel can hope for) and the rate of a
// cuBLAS bf16 GEMM with fp32 accumulation at 8192^3 (what a tensor-core kernel can hope for).
inline Ceilings measure_ceilings(cudaStream_t stream) {
    Ceilings c;
    size_t free_bytes = 0, total_bytes = 0;
    CUDA_CHECK(cudaMemGetInfo(&free_bytes, &total_bytes));
    cudaEvent_t e0, e1;
    CUDA_CHECK(cudaEventCreate(&e0));
    CUDA_CHECK(cudaEventCreate(&e1));
    auto time_ms = [&](const std::function<void()>& f) {
        std::vector<double> t;
        for (int i = 0; i < 12; i++) {
            CUDA_CHECK(cudaEventRecord(e0, stream));
            f();
            CUDA_CHECK(cudaEventRecord(e1, stream));
            CUDA_CHECK(cudaEventSynchronize(e1));
            float ms = 0;
            CUDA_CHECK(cudaEventElapsedTime(&ms, e0, e1));
            if (i >= 2) t.push_back(ms);  // the first two are warm-up
        }
        return median(t);
    };

    size_t copy_bytes = std::min<size_t>(1ull << 30, free_bytes / 4) / 256 * 256;
    char *src = nullptr, *dst = nullptr;
    CUDA_CHECK(cudaMalloc(&src, copy_bytes));
    CUDA_CHECK(cudaMalloc(&dst, copy_bytes));
    lab_fill_random_kernel<<<ceil_div(copy_bytes / 2, 256), 256, 0, stream>>>((floatX*)src, copy_bytes / 2, 1);
    CUDA_CHECK_LAUNCH();
    double ms = time_ms([&] { CUDA_CHECK(cudaMemcpyAsync(dst, src, copy_bytes, cudaMemcpyDeviceToDevice, stream)); });
    c.copy_gbs = 2.0 * copy_bytes / (ms * 1e-3) / 1e9;
    CUDA_CHECK(cudaFree(src));
    CUDA_CHECK(cudaFree(dst));

    const int n = 8192;
    size_t elems = (size_t)n * n;
    floatX *a = nullptr, *b = nullptr, *d = nullptr;
    CUDA_CHECK(cudaMalloc(&a, elems * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc(&b, elems * sizeof(floatX)));
    CUDA_CHECK(cudaMalloc(&d, elems * sizeof(floatX)));
    lab_fill_random_kernel<<<ceil_div(elems, 256), 256, 0, stream>>>(a, elems, 2);
    CUDA_CHECK_LAUNCH();
    lab_fill_random_kernel<<<ceil_div(elems, 256), 256, 0, stream>>>(b, elems, 3);
    CUDA_CHECK_LAUNCH();
    cublasHandle_t handle;
    CUBLAS_CHECK(cublasCreate(&handle));
    CUBLAS_CHECK(cublasSetStream(handle, stream));
    float alpha = 1.0f, beta = 0.0f;
    ms = time_ms([&] {
        CUBLAS_CHECK(cublasGemmEx(handle, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &alpha, a, CUDA_R_16BF, n, b, CUDA_R_16BF, n,
                                  &beta, d, CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    });
    c.gemm_tflops = 2.0 * n * (double)n * n / (ms * 1e-3) / 1e12;
    CUBLAS_CHECK(cublasDestroy(handle));
    CUDA_CHECK(cudaFree(a));
    CUDA_CHECK(cudaFree(b));
    CUDA_CHECK(cudaFree(d));
    CUDA_CHECK(cudaEventDestroy(e0));
    CUDA_CHECK(cudaEventDestroy(e1));
    return c;
}

inline const char* lab_untimed_why() {
#ifdef CUDA_EMU
    return "the CPU emulation of CUDA: its times say nothing about a GPU";
#else
    return "--check-only";
#endif
}

// Parses the command line, prints the versions and exits for --list (no GPU needed), otherwise
// picks the shapes and the seed, opens the GPU and measures the ceilings.
inline void lab_begin(Lab* lab, int argc, char** argv, const char* program, const std::vector<Version>& versions) {
    setvbuf(stdout, nullptr, _IOLBF, 0);  // line-buffered even into a pipe: a crash keeps what was printed
    lab->program = program;
    lab->versions = versions;
    std::string err;
    if (!parse_lab_args(argc, argv, &lab->args, &err)) {
        fprintf(stderr, "error: %s\n", err.c_str());
        exit(2);
    }
    if (lab->args.list) {
        for (const Version& v : versions)  // tab-separated: scripts/kernel_lab.sh reads it
            printf("%s %d\t%s\t%s%s\n", v.kernel, v.id, v.name, v.what, v.trainers ? " [the trainer's]" : "");
        exit(0);
    }
    lab->B = lab->args.batch ? lab->args.batch : (lab->args.small || lab->args.tiny ? 2 : 8);
    lab->T = lab->args.tiny ? 64 : lab->args.small ? 256 : 1024;
    if (lab->args.tiny) {  // odd where every version allows it (T: the flash kernels' 64-row blocks)
        lab->C = 1600;
        lab->NH = 25;
        lab->V = 1001;
        lab->Vp = pad_vocab(lab->V);
    }
#ifdef CUDA_EMU
    lab->args.check_only = true;
#endif
    lab->seed = lab->args.seed ? lab->args.seed : fresh_seed();
    int devices = 0;
    cudaError_t e = cudaGetDeviceCount(&devices);
    if (e != cudaSuccess || devices == 0) {
        fprintf(stderr, "error: %s needs a CUDA GPU (%s)\n", program,
                e != cudaSuccess ? cudaGetErrorString(e) : "no device found");
        exit(1);
    }
    CUDA_CHECK(cudaGetDeviceProperties(&lab->prop, 0));
    CUDA_CHECK(cudaStreamCreate(&lab->stream));
    printf("%s on %s (sm_%d%d, %d SMs, L2 %.0f MB, %.0f GB)\n", program, lab->prop.name, lab->prop.major,
           lab->prop.minor, lab->prop.multiProcessorCount, lab->prop.l2CacheSize / 1e6, lab->prop.totalGlobalMem / 1e9);
    printf("shapes: B=%d T=%d C=%d NH=%d V=%d (padded %d); seed %llu (replay: --seed %llu)\n", lab->B, lab->T, lab->C,
           lab->NH, lab->V, lab->Vp, (unsigned long long)lab->seed, (unsigned long long)lab->seed);
    if (lab->args.check_only) {
        printf("timing: not measured (%s)\n", lab_untimed_why());
        return;
    }
    lab->ceilings = measure_ceilings(lab->stream);
    printf("ceilings: copy %.0f GB/s (read + write), bf16 GEMM %.1f TFLOP/s\n", lab->ceilings.copy_gbs,
           lab->ceilings.gemm_tflops);
}

inline const Version* lab_version(const Lab& lab, const char* kernel, int version) {
    for (const Version& v : lab.versions)
        if (v.id == version && strcmp(v.kernel, kernel) == 0) return &v;
    fprintf(stderr, "error: %s: %s version %d is missing from the file's table of versions\n", lab.program, kernel, version);
    exit(1);
}

// A version that cannot run on this shape or GPU: a SKIP row saying why.
inline void lab_skip(Lab* lab, const char* kernel, int version, const char* why) {
    if (!lab_selected(lab->args, kernel, version)) return;
    const Version* v = lab_version(*lab, kernel, version);
    printf("\n== %s %d %s: SKIP (%s)\n", kernel, version, v->name, why);
    Row row;
    row.kernel = kernel;
    row.version = version;
    row.name = v->name;
    row.status = "SKIP";
    printf("row: %s", table_row(row).c_str());
    lab->rows.push_back(row);
}

inline void lab_case(Lab* lab, const Case& c) {
    if (!lab_selected(lab->args, c.kernel, c.version)) return;
    const Version* v = lab_version(*lab, c.kernel, c.version);
    printf("\n== %s %d %s%s: %s\n", c.kernel, c.version, v->name, v->trainers ? " (the trainer's)" : "", v->what);
    Row row;
    row.kernel = c.kernel;
    row.version = c.version;
    row.name = v->name;
    row.bytes = c.bytes;
    row.flops = c.flops;
    row.ceilings = lab->ceilings;

    // 1. the checked launch, on freshly poisoned outputs
    if (c.prepare) c.prepare(0);
    for (const Check& k : c.checks) {
        if (k.poison) {
            size_t bytes = k.ref->size() * (k.dtype == DT_BF16 ? 2 : 4);
            CUDA_CHECK(cudaMemsetAsync((void*)k.device, POISON_BYTE, bytes, lab->stream));
        }
    }
    c.run(0);
    CUDA_CHECK(cudaGetLastError());
    CUDA_CHECK(cudaStreamSynchronize(lab->stream));
    bool pass = true;
    double worst_ratio = -1;
    for (const Check& k : c.checks) {
        size_t n = k.ref->size(), bytes = n * (k.dtype == DT_BF16 ? 2 : 4);
        std::vector<unsigned char> raw(bytes);
        CUDA_CHECK(cudaMemcpy(raw.data(), k.device, bytes, cudaMemcpyDeviceToHost));
        ErrorStats s = compare_output(raw.data(), k.dtype, k.ref->data(), n);
        printf("   check %-10s %s x %zu: rel err %.2e (bound %.0e), max abs %.2e (max|ref| %.2e), bits %016llx -> %s%s%s\n",
               k.name, dtype_name(k.dtype), n, s.rel_l2, s.bound, s.max_abs, s.ref_max_abs,
               (unsigned long long)bits_digest(raw.data(), bytes), s.pass ? "PASS" : "FAIL", s.pass ? "" : ": ",
               s.why.c_str());
        pass &= s.pass;
        double ratio = s.pass ? s.rel_l2 / s.bound : INFINITY;
        if (ratio > worst_ratio) {
            worst_ratio = ratio;
            row.rel_l2 = s.rel_l2;
            row.max_abs = s.max_abs;
        }
    }
    if (c.checks.empty()) {
        printf("   no output checked: FAIL\n");
        pass = false;
    }
    row.status = pass ? "PASS" : "FAIL";
    lab->failed |= !pass;
    if (lab->args.check_only) {
        printf("row: %s", table_row(row).c_str());
        lab->rows.push_back(row);
        return;
    }

    // 2. timing: warm-up round(s), then enough rounds over the slots for the repeats asked for
    int slots = std::max(1, c.slots);
    std::vector<cudaEvent_t> start(slots), stop(slots);
    for (int s = 0; s < slots; s++) {
        CUDA_CHECK(cudaEventCreate(&start[s]));
        CUDA_CHECK(cudaEventCreate(&stop[s]));
    }
    auto round = [&](std::vector<double>* times) {
        if (c.prepare && c.prepare_before_timing)
            for (int s = 0; s < slots; s++) c.prepare(s);  // all restored first: each is cold when it runs
        for (int s = 0; s < slots; s++) {
            CUDA_CHECK(cudaEventRecord(start[s], lab->stream));
            c.run(s);
            CUDA_CHECK(cudaEventRecord(stop[s], lab->stream));
        }
        CUDA_CHECK(cudaStreamSynchronize(lab->stream));
        for (int s = 0; s < slots; s++) {
            float ms = 0;
            CUDA_CHECK(cudaEventElapsedTime(&ms, start[s], stop[s]));
            times->push_back(ms);
        }
    };
    std::vector<double> warm, times;
    do round(&warm); while (warm.size() < 2);
    int repeats = lab->args.repeats ? lab->args.repeats : timed_repeats(median(warm));
    while ((int)times.size() < repeats) round(&times);
    for (int s = 0; s < slots; s++) {
        CUDA_CHECK(cudaEventDestroy(start[s]));
        CUDA_CHECK(cudaEventDestroy(stop[s]));
    }
    row.ms = median(times);
    printf("   time: median %s of %zu launches (min %s, max %s; %d slot%s); %s, %s of the roofline floor\n",
           format_time(row.ms).c_str(), times.size(), format_time(*std::min_element(times.begin(), times.end())).c_str(),
           format_time(*std::max_element(times.begin(), times.end())).c_str(), slots, slots == 1 ? "" : "s",
           format_achieved(row).c_str(), format_percent(row).c_str());
    printf("row: %s", table_row(row).c_str());  // at once: a later crash cannot lose it
    lab->rows.push_back(row);
}

// Prints the file's table; frees the device memory. Returns the exit code: 0, or 3 if a check failed.
inline int lab_end(Lab* lab) {
    printf("\n%s", table_header().c_str());
    for (const Row& r : lab->rows) printf("%s", table_row(r).c_str());
    if (lab->args.check_only)
        printf("\ntiming: not measured (%s; %s, %s)\n", lab_untimed_why(), lab->prop.name, lab->program);
    else
        printf("\nceilings: copy %.0f GB/s, bf16 GEMM %.1f TFLOP/s (%s, %s)\n", lab->ceilings.copy_gbs,
               lab->ceilings.gemm_tflops, lab->prop.name, lab->program);
    CUDA_CHECK(cudaDeviceSynchronize());
    for (void* p : lab_allocations()) CUDA_CHECK(cudaFree(p));
    lab_allocations().clear();
    CUDA_CHECK(cudaStreamDestroy(lab->stream));
    return lab->failed ? 3 : 0;
}
