// comm_bench.h — what a collective costs: time, algorithm bandwidth and bus bandwidth of every
// communication the trainers make, measured on this machine, each result checked.
//
// Two programs share this file: ./comm_bench (dev/comm/comm_bench.cpp: MPI on the host, through
// llmc/parallel/comm.h, what the CPU trainer uses) and ./comm_bench_gpu (dev/comm/comm_bench.cu: NCCL
// between GPUs, through llmc/parallel/comm_nccl.cuh, what the GPU trainer uses; host-staged when ranks
// share a GPU). They call the trainers' own functions, so the numbers are what a training step gets.
// It lives in dev/, beside the kernel lab (dev/cuda/): a measuring tool, not part of a trainer and not
// a test; the top-level Makefile builds it because, unlike the lab, it needs MPI and the host headers.
//
//     mpirun -np 4 ./comm_bench                              1 KiB to 1 GiB, every operation
//     mpirun -np 2 ./comm_bench --ops all-reduce,send-recv --min-bytes 1M --max-bytes 64M --iters 50
//     mpirun -np 8 ./comm_bench_gpu                          on 8 GPUs, over NCCL
//
// What each operation moves (N ranks, a message of S bytes; S is the size column of the table):
//     all-reduce      every rank holds S bytes and ends with their elementwise sum over ranks
//                     (data parallelism's gradients; tensor parallelism's activations)
//     reduce-scatter  every rank holds S bytes and ends with the sum of its own S/N of them (ZeRO-2/3)
//     all-gather      every rank holds S/N bytes and ends with all S (ZeRO-1/3's weights)
//     all-to-all      every rank holds N blocks of S/N, sends block j to rank j and ends with one block
//                     from each rank (expert parallelism's tokens; comm.h's comm_all_to_all)
//     broadcast       rank 0's S bytes end up on every rank (the initial weights)
//     send-recv       every rank sends S bytes to the next rank and receives S from the previous
//                     (pipeline parallelism's activations and gradients between stages)
//
// Algorithm bandwidth and bus bandwidth, as nccl-tests defines them. With t the time of one call:
//     algbw = S / t
//     busbw = algbw * factor:  all-reduce 2(N-1)/N;  reduce-scatter, all-gather, all-to-all (N-1)/N;
//                              broadcast, send-recv 1
// algbw is what the caller sees, but it is not comparable across N: an all-reduce on 8 ranks must
// move more than on 2. busbw is. The factor is how many bytes each rank must at least send (and
// receive) per byte of S: in a reduce-scatter every rank must receive the other N-1 ranks'
// contributions to its S/N, so (N-1)/N S; an all-gather is the same in reverse; an all-reduce is
// both (a reduce-scatter, then an all-gather of the sums: how a ring does it), so 2(N-1)/N S; an
// all-to-all keeps 1/N of its data and sends the rest. So busbw is the rate at which each rank's
// link carried bytes, and an algorithm that reaches the lower bound (a ring) runs at busbw = the
// link's bandwidth, whatever N is. Compare busbw with the hardware: NVLink, PCIe, InfiniBand, or
// here, between processes on one machine, the speed at which MPI copies through shared memory.
// It is also what comm.h's byte counters count per rank (--estimate's "bytes on the wire"), so
//     time of a collective  ~  latency + (bytes the counters predict) / busbw.
//
// Reading the table for a training run (docs/parallelism.md gives each technique's bytes):
//   - data parallelism: one all-reduce of the gradients per step, 2(N-1)/N * P * b bytes per rank
//     (P parameters, b bytes each): look up the row of S = P * b (GPT-2 small in bf16: 248 MB).
//     ZeRO-1 replaces it with a reduce-scatter and an all-gather: the same bytes, so the same time.
//   - tensor parallelism: an all-reduce of activations (B * T * C values) twice per layer in each
//     pass, inside the critical path: small messages, where the table's first rows (latency, not
//     bandwidth) decide. That is why tensor parallelism stays inside a node.
//   - pipeline parallelism: a send-recv of B * T * C values per micro-batch between neighbours:
//     factor 1, and only neighbours talk, so it crosses slow links best.
//   - at small sizes every operation is latency-bound (time flat in S, bandwidth rising with S);
//     at large sizes bandwidth-bound (time proportional to S, busbw flat). Where the knee is says
//     how big a bucket of gradients must be to use the link well.
//
// Time is the mean of --iters calls issued back to back after --warmup calls (for NCCL: enqueued
// back to back, then waited for), and of the ranks' means the largest: a collective is done when
// its slowest rank is. (nccl-tests reports the ranks' average by default; with ranks started
// together the two differ little.)
//
// Checking: before it is timed, each operation runs once on known inputs, and every element of
// every rank's result is compared with its closed form: small integers (rank-dependent, below
// 2^24), so every sum is exact in fp32 and the result is exact whatever order MPI or NCCL adds in.
// A wrong element anywhere prints FAIL and the program exits 1. (LLMC_COMM_BENCH_PLANT_BUG=1 makes
// the last rank change one element of each result before the check: the test's proof that the
// check can fail.) Bad flags: one line, exit 2.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/parallel/comm.h"

enum BenchOp { OP_ALL_REDUCE, OP_REDUCE_SCATTER, OP_ALL_GATHER, OP_ALL_TO_ALL, OP_BROADCAST, OP_SEND_RECV, NUM_BENCH_OPS };
inline const char* bench_op_name(int op) {
    static const char* names[NUM_BENCH_OPS] = {"all-reduce", "reduce-scatter", "all-gather", "all-to-all", "broadcast", "send-recv"};
    return names[op];
}

// busbw / algbw: the bytes each rank must send per byte of S (see the top of the file).
inline double bus_factor(int op, int ranks) {
    double n = ranks;
    if (op == OP_ALL_REDUCE) return 2 * (n - 1) / n;
    if (op == OP_REDUCE_SCATTER || op == OP_ALL_GATHER || op == OP_ALL_TO_ALL) return (n - 1) / n;
    return 1;
}

// The operations that cut S into N equal parts use the largest multiple of N floats that fits.
inline size_t bench_count(int op, size_t bytes, int ranks) {
    size_t n = bytes / sizeof(float);
    bool split = op == OP_REDUCE_SCATTER || op == OP_ALL_GATHER || op == OP_ALL_TO_ALL;
    return split ? n / (size_t)ranks * (size_t)ranks : n;
}

struct BenchOptions {
    size_t min_bytes = 1024, max_bytes = (size_t)1 << 30;
    int iters = 20, warmup = 5;
    std::vector<int> ops;  // in the order given
};

// ----------------------------------------------------------------------------------------------
// The command line. Every rank parses it before any communication, so a mistake stops every rank
// alike (one line, from rank 0 only: the launcher's environment says which rank this is).

inline bool bench_rank0_by_environment() {
    Comm c;
    comm_from_environment(&c);
    return c.rank == 0;
}

[[noreturn]] inline void bench_usage_fail(const std::string& message) {
    if (bench_rank0_by_environment()) fprintf(stderr, "error: %s (see --help)\n", message.c_str());
    exit(EXIT_BAD_USAGE);
}

// "4096", "64K", "1M", "1G" (binary: 1K = 1024 bytes)
inline size_t bench_parse_bytes(const char* flag, const char* v) {
    char* end = nullptr;
    errno = 0;
    unsigned long long x = strtoull(v, &end, 10);
    if (end == v || errno || v[0] == '-') bench_usage_fail(strprintf("%s '%s' is not a size in bytes (e.g. 4096, 64K, 1M, 1G)", flag, v));
    int shift = 0;
    if (*end == 'K' || *end == 'k') shift = 10;
    if (*end == 'M' || *end == 'm') shift = 20;
    if (*end == 'G' || *end == 'g') shift = 30;
    if (shift) end++;
    if (*end) bench_usage_fail(strprintf("%s '%s' is not a size in bytes (e.g. 4096, 64K, 1M, 1G)", flag, v));
    if (x == 0 || x > ((1ull << 40) >> shift)) bench_usage_fail(strprintf("%s '%s': the size must be 4 bytes to 1T", flag, v));
    x <<= shift;
    if (x % sizeof(float) != 0) bench_usage_fail(strprintf("%s '%s': the size must be a multiple of 4 bytes (fp32 values)", flag, v));
    return (size_t)x;
}

inline int bench_parse_int(const char* flag, const char* v, int lowest) {
    char* end = nullptr;
    errno = 0;
    long x = strtol(v, &end, 10);
    if (end == v || *end || errno || x < lowest || x > 1000000) {
        bench_usage_fail(strprintf("%s '%s' must be an integer from %d to 1000000", flag, v, lowest));
    }
    return (int)x;
}

inline std::vector<int> bench_parse_ops(const char* v) {
    std::vector<int> ops;
    std::string list = v;
    if (list == "all") {
        for (int op = 0; op < NUM_BENCH_OPS; op++) ops.push_back(op);
        return ops;
    }
    size_t start = 0;
    while (start <= list.size()) {
        size_t comma = list.find(',', start);
        std::string name = list.substr(start, comma == std::string::npos ? std::string::npos : comma - start);
        int found = -1;
        for (int op = 0; op < NUM_BENCH_OPS; op++)
            if (name == bench_op_name(op)) found = op;
        if (found < 0) {
            bench_usage_fail(strprintf("--ops: '%s' is not an operation; the operations are all-reduce, reduce-scatter, "
                                       "all-gather, all-to-all, broadcast, send-recv (or all)", name.c_str()));
        }
        ops.push_back(found);
        if (comma == std::string::npos) break;
        start = comma + 1;
    }
    return ops;
}

inline BenchOptions bench_parse(int argc, char** argv, const char* program) {
    BenchOptions o;
    bool ops_given = false;
    for (int i = 1; i < argc; i++) {
        std::string flag = argv[i];
        if (flag == "--help" || flag == "-h") {
            if (bench_rank0_by_environment()) {
                printf("usage: mpirun -np N %s [--min-bytes 1K] [--max-bytes 1G] [--iters 20] [--warmup 5] [--ops LIST]\n"
                       "  sizes double from --min-bytes to --max-bytes (K, M, G: binary); LIST is comma-separated from\n"
                       "  all-reduce, reduce-scatter, all-gather, all-to-all, broadcast, send-recv (default: all).\n"
                       "  Prints time, algbw and busbw (nccl-tests' definitions) per size; every result is checked.\n", program);
            }
            exit(0);
        }
        bool known = flag == "--min-bytes" || flag == "--max-bytes" || flag == "--iters" || flag == "--warmup" || flag == "--ops";
        if (!known) bench_usage_fail(strprintf("unknown flag '%s'", flag.c_str()));
        if (i + 1 >= argc) bench_usage_fail(strprintf("%s needs a value", flag.c_str()));
        const char* v = argv[++i];
        if (flag == "--min-bytes") o.min_bytes = bench_parse_bytes("--min-bytes", v);
        else if (flag == "--max-bytes") o.max_bytes = bench_parse_bytes("--max-bytes", v);
        else if (flag == "--iters") o.iters = bench_parse_int("--iters", v, 1);
        else if (flag == "--warmup") o.warmup = bench_parse_int("--warmup", v, 0);
        else o.ops = bench_parse_ops(v), ops_given = true;
    }
    if (o.min_bytes > o.max_bytes) {
        bench_usage_fail(strprintf("--min-bytes %zu is larger than --max-bytes %zu", o.min_bytes, o.max_bytes));
    }
    if (!ops_given) o.ops = bench_parse_ops("all");
    return o;
}

// ----------------------------------------------------------------------------------------------
// Known inputs and their results. Buffers: `send` and `recv`, count floats each at most. In place
// (all-reduce, all-gather, broadcast) the data is in recv; reduce-scatter, all-to-all and send-recv
// read send and write recv.

constexpr float BENCH_UNWRITTEN = -1.0f;  // in recv before the call: an element nobody wrote shows up

// Rank r's value at index i: an integer below 1024, so N ranks' sums are exact in fp32.
inline float bench_value(size_t i, int rank) { return (float)((i + 7 * (size_t)rank) % 1024); }
// all-to-all: what rank src puts at element k of its block for rank dst
inline float bench_block_value(int src, int dst, size_t k) { return (float)((k + 131 * (size_t)src + 17 * (size_t)dst) % 4096); }

// sums[i % 1024] = the sum over ranks of bench_value(i, r): the value depends on i % 1024 only
inline std::vector<float> bench_sums(int ranks) {
    std::vector<float> sums(1024, 0.0f);
    for (size_t k = 0; k < 1024; k++)
        for (int r = 0; r < ranks; r++) sums[k] += bench_value(k, r);
    return sums;
}

inline void bench_fill(int op, size_t count, int rank, int ranks, float* send, float* recv) {
    size_t block = count / (size_t)ranks;
    for (size_t i = 0; i < count; i++) {
        switch (op) {
            case OP_ALL_REDUCE: recv[i] = bench_value(i, rank); break;
            case OP_REDUCE_SCATTER: send[i] = bench_value(i, rank); break;
            case OP_ALL_GATHER: recv[i] = i / block == (size_t)rank ? bench_value(i, rank) : BENCH_UNWRITTEN; break;
            case OP_ALL_TO_ALL: send[i] = bench_block_value(rank, (int)(i / block), i % block); break;
            case OP_BROADCAST: recv[i] = rank == 0 ? bench_value(i, 0) : BENCH_UNWRITTEN; break;
            case OP_SEND_RECV: send[i] = bench_value(i, rank); break;
        }
        if (op == OP_REDUCE_SCATTER || op == OP_ALL_TO_ALL || op == OP_SEND_RECV) {
            if (op != OP_REDUCE_SCATTER || i < block) recv[i] = BENCH_UNWRITTEN;
        }
    }
}

// How many elements the operation writes into recv.
inline size_t bench_result_count(int op, size_t count, int ranks) {
    return op == OP_REDUCE_SCATTER ? count / (size_t)ranks : count;
}

// The number of wrong elements of this rank's result.
inline size_t bench_check(int op, size_t count, int rank, int ranks, const std::vector<float>& sums, const float* recv) {
    size_t block = count / (size_t)ranks, wrong = 0;
    int previous = (rank - 1 + ranks) % ranks;
    for (size_t i = 0; i < bench_result_count(op, count, ranks); i++) {
        float expect = 0;
        switch (op) {
            case OP_ALL_REDUCE: expect = sums[i % 1024]; break;
            case OP_REDUCE_SCATTER: expect = sums[((size_t)rank * block + i) % 1024]; break;
            case OP_ALL_GATHER: expect = bench_value(i, (int)(i / block)); break;
            case OP_ALL_TO_ALL: expect = bench_block_value((int)(i / block), rank, i % block); break;
            case OP_BROADCAST: expect = bench_value(i, 0); break;
            case OP_SEND_RECV: expect = bench_value(i, previous); break;
        }
        wrong += recv[i] != expect;
    }
    return wrong;
}

// ----------------------------------------------------------------------------------------------
// The run. A Backend (comm_bench.cpp: MPI; comm_bench.cu: NCCL) provides:
//     Backend(Comm* comm, size_t most)               buffers of `most` floats (on GPUs: the communicator)
//     int rank, ranks; const char* transport;
//     float* host_send(); float* host_recv();        host arrays of the harness's inputs and results
//     void upload(size_t count); void download(size_t count);  host <-> buffers (no-ops on the host)
//     void run(int op, size_t count);                one call of the operation on the buffers
//     void wait();                                   until every call issued has finished
//     std::vector<double> gather(double x);          every rank's x, on every rank

template <class Backend>
inline int bench_main(Backend& b, const BenchOptions& o) {
    bool plant_bug = getenv("LLMC_COMM_BENCH_PLANT_BUG") && !strcmp(getenv("LLMC_COMM_BENCH_PLANT_BUG"), "1");
    std::vector<float> sums = bench_sums(b.ranks);
    if (b.rank == 0) {
        printf("# comm_bench: %d rank%s, %s, fp32, sizes %zu to %zu bytes, %d iterations after %d warm-up\n", b.ranks,
               b.ranks == 1 ? "" : "s", b.transport, o.min_bytes, o.max_bytes, o.iters, o.warmup);
        printf("# time: the slowest rank's mean per call; algbw = size / time; busbw = algbw * factor (nccl-tests)\n");
        if (plant_bug) printf("# LLMC_COMM_BENCH_PLANT_BUG=1: rank %d changes one element of every result\n", b.ranks - 1);
    }
    size_t results = 0, failed_results = 0;
    for (int op : o.ops) {
        if (b.rank == 0) {
            printf("#\n# %s (factor %.4f)\n", bench_op_name(op), bus_factor(op, b.ranks));
            printf("# %12s %12s %6s %15s %11s %11s %11s  %s\n", "size(B)", "count", "type", "op", "time(us)", "algbw(GB/s)",
                   "busbw(GB/s)", "check");
        }
        for (size_t bytes = o.min_bytes; bytes <= o.max_bytes; bytes *= 2) {
            size_t count = bench_count(op, bytes, b.ranks);
            if (count == 0) continue;  // fewer floats than ranks
            // check: known inputs, one call, every element of every rank's result
            bench_fill(op, count, b.rank, b.ranks, b.host_send(), b.host_recv());
            b.upload(count);
            b.run(op, count);
            b.wait();
            size_t out = bench_result_count(op, count, b.ranks);
            b.download(out);
            if (plant_bug && b.rank == b.ranks - 1) b.host_recv()[out / 2] += 1.0f;
            size_t wrong = bench_check(op, count, b.rank, b.ranks, sums, b.host_recv());
            double wrong_total = 0;
            for (double w : b.gather((double)wrong)) wrong_total += w;
            // time: warm-up, then iters calls back to back
            for (int i = 0; i < o.warmup; i++) b.run(op, count);
            b.wait();
            b.gather(0.0);  // a barrier: every rank starts the clock together
            auto start = std::chrono::steady_clock::now();
            for (int i = 0; i < o.iters; i++) b.run(op, count);
            b.wait();
            double mine = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / o.iters;
            double seconds = 0;
            for (double t : b.gather(mine)) seconds = std::max(seconds, t);
            results++;
            failed_results += wrong_total != 0;
            if (b.rank == 0) {
                double size = (double)(count * sizeof(float)), algbw = size / seconds / 1e9;
                std::string check = wrong_total == 0 ? "ok" : strprintf("FAIL(%.0f wrong)", wrong_total);
                printf("  %12zu %12zu %6s %15s %11.2f %11.4g %11.4g  %s\n", count * sizeof(float), count, "float",
                       bench_op_name(op), seconds * 1e6, algbw, algbw * bus_factor(op, b.ranks), check.c_str());
                fflush(stdout);
            }
        }
    }
    if (b.rank == 0) {
        if (failed_results == 0) printf("PASS: %zu results checked, every element on every rank as expected\n", results);
        else printf("FAIL: %zu of %zu results had wrong elements (the check column says how many)\n", failed_results, results);
    }
    return failed_results == 0 ? 0 : 1;
}

// Both programs' main: the flags, then joining the other ranks (in that order, so that a typo stops
// every rank alike before any waits for another), the run, and leaving (the backend, and with it
// NCCL, closed before MPI).
template <class Backend>
inline int bench_program(int argc, char** argv, const char* program) {
    BenchOptions o = bench_parse(argc, argv, program);
    Comm comm;
    comm_init(&comm, 600);
    int code;
    {
        Backend b(&comm, o.max_bytes / sizeof(float));
        code = bench_main(b, o);
    }
    comm_finalize(&comm);
    return code;
}
