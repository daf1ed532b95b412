// utils.h — failing well: checked file I/O, atomic writes, one clear message per error.
//
// A trainer runs for days; when it stops it must say exactly why, and it must never leave a
// half-written file where a good one used to be. Three habits, used by every file in llmc/:
//   1. every error is one line, "error: <what went wrong>. <how to fix it>", then a non-zero exit
//      (1 for bad input or a failed operation, 2 for a bad command line);
//   2. every read checks that the bytes were really there (a truncated file is named as such);
//   3. every file we write goes to "<path>.tmp" first and is renamed over <path> only when complete
//      and flushed: rename() is atomic on POSIX filesystems, so a crash leaves the old file intact.
#pragma once

#include <cerrno>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include <algorithm>
#include <glob.h>
#include <sys/stat.h>
#include <unistd.h>

// Exit codes: 1 = bad input or failed operation, 2 = bad command line (as most Unix tools do).
constexpr int EXIT_BAD_INPUT = 1;
constexpr int EXIT_BAD_USAGE = 2;

// Set by llmc/parallel/comm.h in a run of several ranks: called after the message is printed, so that one
// rank's error stops every rank instead of leaving the others waiting in a collective forever.
inline void (*on_fail)(int code) = nullptr;

// Set while a progress bar is drawn on stderr without its newline: an error then starts on a fresh line.
inline bool stderr_line_open = false;

[[noreturn]] inline void fail_with_code(int code, const char* fmt, va_list args) {
    fflush(stdout);
    fprintf(stderr, "%serror: ", stderr_line_open ? "\n" : "");
    vfprintf(stderr, fmt, args);
    fprintf(stderr, "\n");
    if (on_fail) on_fail(code);
    exit(code);
}

// fail("model file '%s' is truncated ...") prints "error: ..." and exits 1.
[[noreturn]] inline void fail(const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fail_with_code(EXIT_BAD_INPUT, fmt, args);
}

// fail(std::string) for messages built by concatenation.
[[noreturn]] inline void fail(const std::string& message) { fail("%s", message.c_str()); }

// usage_fail(...) is for command-line mistakes: exit code 2.
[[noreturn]] inline void usage_fail(const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    fail_with_code(EXIT_BAD_USAGE, fmt, args);
}

// usage_fail(std::string) for messages built by concatenation.
[[noreturn]] inline void usage_fail(const std::string& message) { usage_fail("%s", message.c_str()); }

// ----------------------------------------------------------------------------------------------
// Reading files

inline bool file_exists(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISREG(st.st_mode);
}

inline bool dir_exists(const std::string& path) {
    struct stat st;
    return stat(path.c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

// `what` names the file's role ("model file", "token shard") so the message says which input is bad.
inline FILE* open_for_reading(const std::string& path, const char* what) {
    FILE* f = fopen(path.c_str(), "rb");
    if (!f) fail("cannot open %s '%s': %s", what, path.c_str(), strerror(errno));
    return f;
}

inline int64_t file_size(FILE* f) {
    long here = ftell(f);
    fseek(f, 0, SEEK_END);
    int64_t size = ftell(f);
    fseek(f, here, SEEK_SET);
    return size;
}

// Reads exactly `bytes` bytes or fails naming the file as truncated.
inline void read_exactly(FILE* f, void* dst, size_t bytes, const std::string& path, const char* what) {
    size_t got = fread(dst, 1, bytes, f);
    if (got != bytes) {
        fail("%s '%s' is truncated: wanted %zu more bytes, found %zu. Re-create or re-download it",
             what, path.c_str(), bytes, got);
    }
}

inline std::vector<char> read_whole_file(const std::string& path, const char* what) {
    FILE* f = open_for_reading(path, what);
    int64_t size = file_size(f);
    std::vector<char> data((size_t)size);
    if (size > 0) read_exactly(f, data.data(), (size_t)size, path, what);
    fclose(f);
    return data;
}

// Expands a shell-style pattern ("data/x_train_*.bin") into a sorted list of files.
// Sorted, so every rank and every run sees the shards in the same order.
inline std::vector<std::string> expand_glob(const std::string& pattern) {
    std::vector<std::string> paths;
    glob_t g;
    memset(&g, 0, sizeof(g));
    if (glob(pattern.c_str(), 0, nullptr, &g) == 0) {
        for (size_t i = 0; i < g.gl_pathc; i++) paths.emplace_back(g.gl_pathv[i]);
    }
    globfree(&g);
    std::sort(paths.begin(), paths.end());
    return paths;
}

// ----------------------------------------------------------------------------------------------
// Writing files atomically

// Usage:  AtomicFile out(path, "checkpoint");  out.write(data, n); ...  out.commit();
// Until commit() the bytes live in "<path>.tmp"; if the program dies or fails first, the
// destructor (or the next run) removes the temporary and the previous <path> is untouched.
struct AtomicFile {
    std::string path, tmp_path;
    const char* what;
    FILE* f = nullptr;

    AtomicFile(const std::string& final_path, const char* role) : path(final_path), tmp_path(final_path + ".tmp"), what(role) {
        f = fopen(tmp_path.c_str(), "wb");
        if (!f) fail("cannot create %s '%s': %s", what, tmp_path.c_str(), strerror(errno));
    }
    void write(const void* src, size_t bytes) {
        if (bytes && fwrite(src, 1, bytes, f) != bytes) {
            int err = errno;
            fclose(f);
            f = nullptr;
            remove(tmp_path.c_str());
            fail("writing %s '%s' failed: %s (is the disk full?); the previous file is untouched",
                 what, path.c_str(), strerror(err));
        }
    }
    void commit() {
        bool ok = fflush(f) == 0 && fsync(fileno(f)) == 0;
        ok = (fclose(f) == 0) && ok;
        f = nullptr;
        if (!ok || rename(tmp_path.c_str(), path.c_str()) != 0) {
            int err = errno;
            remove(tmp_path.c_str());
            fail("could not finish writing %s '%s': %s; the previous file is untouched", what, path.c_str(), strerror(err));
        }
    }
    ~AtomicFile() {
        if (f) {  // never committed: drop the partial file
            fclose(f);
            remove(tmp_path.c_str());
        }
    }
    AtomicFile(const AtomicFile&) = delete;
    AtomicFile& operator=(const AtomicFile&) = delete;
};

inline void make_dirs(const std::string& path) {
    std::string partial;
    for (size_t i = 0; i <= path.size(); i++) {
        if (i == path.size() || path[i] == '/') {
            if (!partial.empty() && !dir_exists(partial) && mkdir(partial.c_str(), 0755) != 0 && errno != EEXIST) {
                fail("cannot create directory '%s': %s", partial.c_str(), strerror(errno));
            }
        }
        if (i < path.size()) partial += path[i];
    }
}

// ----------------------------------------------------------------------------------------------
// bf16: the top 16 bits of an fp32 (same exponent range, 8 bits of mantissa instead of 24).

inline uint16_t float_to_bf16_round_nearest(float x) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return (uint16_t)((bits >> 16) | 0x40);  // keep NaN a NaN
    uint32_t rounding = 0x7fffu + ((bits >> 16) & 1u);  // round half to even
    return (uint16_t)((bits + rounding) >> 16);
}

// Stochastic rounding to bf16: add 16 random bits below the kept ones, then cut them off, so the
// magnitude rounds up with probability (dropped bits) / 2^16 = (x - down) / (up - down) and
// E[round(x)] = x. Inf and NaN are left as they are. One definition for the CPU's bf16 moments
// (optim/adamw_bf16.h), the GPU's bf16 weights (kernels/cuda_common.cuh's stochastic_round) and the
// offloaded update that must round as the GPU does (optim/offload.cuh): same bits in, same bits out.
#ifdef __CUDACC__
__host__ __device__
#endif
inline uint16_t bf16_round_stochastic(float x, uint32_t random) {
    uint32_t bits;
    memcpy(&bits, &x, 4);
    if ((bits & 0x7f800000u) != 0x7f800000u) bits += random & 0xffffu;
    return (uint16_t)(bits >> 16);
}

#ifdef __CUDACC__
__host__ __device__  // (also the GPU's bf16 moments: llmc/optim/adamw_bf16.cuh)
#endif
inline float bf16_to_float(uint16_t h) {
    uint32_t bits = (uint32_t)h << 16;
    float x;
    memcpy(&x, &bits, 4);
    return x;
}

inline std::string strprintf(const char* fmt, ...) {
    va_list args;
    va_start(args, fmt);
    char buf[1024];
    vsnprintf(buf, sizeof(buf), fmt, args);
    va_end(args);
    return buf;
}
