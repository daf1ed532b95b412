// comm.h — many processes, one model: how ranks find each other, exchange numbers, and fail together.
//
// Data parallelism runs one copy of the trainer per device. Each copy, a "rank" (0 .. N-1 of a
// "world" of N), trains on its own slice of the data; after the backward pass the ranks combine
// their gradients so that every rank takes the same optimizer step. This file is the host side of
// that, in four parts (the third in a file of its own):
//
// 1. Who am I. The launcher tells each process its rank, the world size and its local rank (its
//    index on this node, which picks its GPU), through the environment:
//        mpirun -np N        OMPI_COMM_WORLD_RANK / _SIZE / _LOCAL_RANK   (Open MPI)
//        srun -n N           SLURM_PROCID / SLURM_STEP_NUM_TASKS / SLURM_LOCALID   (no MPI needed)
//        by hand             LLMC_RANK / LLMC_WORLD_SIZE / LLMC_LOCAL_RANK   (like torchrun's RANK)
//    Built with MPI (-DUSE_MPI), MPI_Init is the source of truth and the environment is a check.
//
// 2. Collectives: operations every rank enters together. With N ranks, P values of b bytes each:
//        all-reduce      everyone ends with the elementwise sum of everyone's array
//                        (a ring sends 2 (N-1)/N * P*b bytes per rank)
//        reduce-scatter  rank r ends with the sum of shard r only          ((N-1)/N * P*b)
//        all-gather      everyone ends with every rank's shard, in order    ((N-1)/N * P*b)
//        reduce          one rank (the root) ends with the sum              (P*b from each other rank)
//        broadcast       everyone ends with rank 0's array
//    An all-reduce IS a reduce-scatter followed by an all-gather; that is how ring all-reduce works
//    inside, and it is why ZeRO-1 (reduce-scatter the gradients, update one shard, all-gather the
//    parameters) moves no more bytes than plain data parallelism. Here they run over MPI, for the
//    CPU trainer and for GPUs that must stage through host memory; comm_nccl.cuh runs them on GPUs.
//
//    Groups: a process grid (llmc/parallel/process_grid.h) runs these inside subsets of the ranks (the ranks
//    of one tensor-, data- or pipeline-parallel group): each group is a Comm of its own (comm_split),
//    with its own rank numbers and byte counters (CommCounters: what --estimate's predictions are
//    checked against). Pipelines also send point to point (comm_send / comm_recv).
//
// 3. Rendezvous without MPI: how NCCL's ranks meet under plain srun (LLMC_RENDEZVOUS, a shared file
//    or a TCP connection) is llmc/parallel/rendezvous.h.
//
// 4. Failing together. A collective waits for every rank, so one rank that crashed, hung or was
//    killed would leave the others waiting forever, burning a whole allocation. So: every MPI call
//    is checked (errors are returned to us, not handled by MPI, so the message can say what we were
//    doing); every collective is started non-blocking and polled against a deadline (--comm-timeout)
//    and, when the deadline passes, the rank prints which operation stalled and calls MPI_Abort,
//    which makes the launcher kill every rank; and any error that calls fail() on one rank does the
//    same. comm_nccl.cuh applies the same deadline to NCCL with ncclCommGetAsyncError.
//    The tests make a rank fail on purpose with llmc/probes/fault_injection.h (LLMC_TEST_FAULT).
#pragma once

#include <chrono>
#include <climits>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <thread>
#include <vector>
#include "llmc/utils.h"
#ifdef USE_MPI
#define OMPI_SKIP_MPICXX 1  // the C API only: MPI's deprecated C++ bindings do not compile cleanly
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#endif

// What a rank sent, per kind of operation: the bytes the textbook algorithm sends from this rank.
// With N ranks in the group and n bytes of data:
//     all-reduce      2 (N-1)/N n     (a ring: reduce-scatter, then all-gather)
//     reduce-scatter  (N-1)/N n       (n = the whole array; each rank keeps n/N)
//     all-gather      (N-1)/N n       (n = the whole array; each rank contributes n/N)
//     reduce          n from every rank but the root
//     broadcast       (N-1) n on the root, 0 elsewhere
//     send            n               (point to point, pipeline parallelism)
//     all-to-all      (N-1)/N n       (n = the whole send array; block j goes to rank j, one stays)
// MPI may pick other algorithms inside; these counts are what a ring on a fast network moves, the
// convention of the cost tables in docs/parallelism.md, so --estimate's predictions can be checked
// against the collectives a run really made.
enum CommOp { COMM_ALL_REDUCE, COMM_REDUCE_SCATTER, COMM_ALL_GATHER, COMM_REDUCE, COMM_BROADCAST, COMM_SEND,
              COMM_ALL_TO_ALL, COMM_NUM_OPS };
inline const char* comm_op_name(int op) {
    static const char* names[COMM_NUM_OPS] = {"all-reduce", "reduce-scatter", "all-gather", "reduce", "broadcast", "send",
                                              "all-to-all"};
    return names[op];
}
struct CommCounters {
    uint64_t calls[COMM_NUM_OPS] = {};
    uint64_t bytes[COMM_NUM_OPS] = {};
    uint64_t total_bytes() const {
        uint64_t t = 0;
        for (uint64_t b : bytes) t += b;
        return t;
    }
};

// A group of ranks that communicate: the whole world, or (llmc/parallel/process_grid.h) the ranks of one
// data-, tensor- or pipeline-parallel group. `rank` and `world_size` are within the group.
struct Comm {
    int rank = 0, world_size = 1;
    int local_rank = 0, local_size = 1;    // on this node
    std::string launcher = "single process";
    bool mpi = false;                      // collectives go through MPI
    double timeout_s = 0;                  // a collective slower than this aborts every rank (0 = wait forever)
    CommCounters counters;                 // what this rank sent through this group
#ifdef USE_MPI
    MPI_Comm handle = MPI_COMM_WORLD;      // the group's MPI communicator
#endif
};

inline void comm_count(Comm* c, CommOp op, uint64_t bytes) {
    c->counters.calls[op]++;
    c->counters.bytes[op] += bytes;
}

// ----------------------------------------------------------------------------------------------
// Failing together

inline double comm_seconds_since(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

// The Comm of this process, for the hook below (there is only ever one).
inline Comm* g_comm = nullptr;

// Stops every rank: MPI_Abort asks the launcher to kill them all. Without MPI each process can only
// exit; srun (--kill-on-bad-exit) or the NCCL timeouts take the others down.
[[noreturn]] inline void comm_abort(int code) {
    fflush(stdout);
    fflush(stderr);
#ifdef USE_MPI
    int initialized = 0, finalized = 0;  // unchecked: we are already failing, and there is no one to tell
    MPI_Initialized(&initialized);
    MPI_Finalized(&finalized);
    if (g_comm && g_comm->mpi && initialized && !finalized) MPI_Abort(MPI_COMM_WORLD, code);
#endif
    exit(code);
}

// Called by fail() (llmc/utils.h) after it printed its message.
inline void comm_on_fail(int code) {
    if (g_comm && g_comm->world_size > 1) {
        fprintf(stderr, "error: rank %d of %d stopped on the error above; stopping all ranks\n", g_comm->rank,
                g_comm->world_size);
        comm_abort(code);
    }
}

#ifdef USE_MPI
[[noreturn]] inline void comm_mpi_failed(const char* call, int err, const char* what) {
    char text[MPI_MAX_ERROR_STRING];
    int len = 0;
    if (MPI_Error_string(err, text, &len) != MPI_SUCCESS) snprintf(text, sizeof(text), "MPI error %d", err);
    fprintf(stderr, "error: rank %d: %s failed during %s: %s. If another rank reported an error, that is the cause\n",
            g_comm ? g_comm->rank : -1, call, what, text);
    comm_abort(EXIT_BAD_INPUT);
}
#define MPI_CHECK(call, what)                                  \
    do {                                                       \
        int mpi_err_ = (call);                                 \
        if (mpi_err_ != MPI_SUCCESS) comm_mpi_failed(#call, mpi_err_, what); \
    } while (0)

// Waits for a non-blocking collective, polling so that a stall becomes an error instead of a hang.
// Polling spins briefly (collectives are usually quick), then sleeps so that ranks waiting for a
// slow one leave the CPU to it.
inline void comm_wait(Comm* c, MPI_Request* request, const char* what) {
    auto start = std::chrono::steady_clock::now();
    for (long polls = 0;; polls++) {
        int done = 0;
        MPI_CHECK(MPI_Test(request, &done, MPI_STATUS_IGNORE), what);
        if (done) return;
        double waited = comm_seconds_since(start);
        if (c->timeout_s > 0 && waited > c->timeout_s) {
            fprintf(stderr, "error: rank %d of %d: %s did not complete within %g s (--comm-timeout): another rank "
                    "has crashed, hung, or fallen far behind. Stopping all ranks. If a rank is just slow (evaluation, "
                    "checkpoints on a slow disk), raise --comm-timeout\n", c->rank, c->world_size, what, c->timeout_s);
            comm_abort(EXIT_BAD_INPUT);
        }
        if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(waited < 1.0 ? 20 : 1000));
    }
}
#endif

// ----------------------------------------------------------------------------------------------
// Who am I

inline int env_int(const char* name, int fallback) {
    const char* v = getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    long x = strtol(v, &end, 10);
    if (*end || x < 0 || x > INT_MAX) fail("environment variable %s='%s' is not a non-negative integer", name, v);
    return (int)x;
}

// What the launcher's environment says. Explicit LLMC_* settings win, then Open MPI's, then the
// Hydra/PMI variables of MPICH-based MPIs, then Slurm's (only inside an srun step: a batch script
// also sees SLURM_NTASKS, but it is one process, not N).
inline void comm_from_environment(Comm* c) {
    struct Source { const char *rank, *size, *local_rank, *launcher; };
    const Source sources[] = {
        {"LLMC_RANK", "LLMC_WORLD_SIZE", "LLMC_LOCAL_RANK", "LLMC_RANK/LLMC_WORLD_SIZE"},
        {"OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_RANK", "mpirun (Open MPI)"},
        {"PMI_RANK", "PMI_SIZE", "MPI_LOCALRANKID", "mpiexec (PMI)"},
        {"SLURM_PROCID", "SLURM_STEP_NUM_TASKS", "SLURM_LOCALID", "srun (Slurm)"},
    };
    for (const Source& s : sources) {
        if (!getenv(s.rank) || !getenv(s.size)) continue;
        c->rank = env_int(s.rank, 0);
        c->world_size = env_int(s.size, 1);
        c->local_rank = env_int(s.local_rank, c->rank);
        c->launcher = s.launcher;
        if (c->world_size < 1 || c->rank >= c->world_size) {
            fail("the launcher says rank %d of %d (%s, %s): that is not a valid rank", c->rank, c->world_size, s.rank, s.size);
        }
        return;
    }
}

// Sets up this process's place in the world. Call once, after parsing the command line (so that
// a typo fails on every rank alike before any rank waits for another) and before any collective.
inline void comm_init(Comm* c, double timeout_s) {
    c->timeout_s = timeout_s;
    comm_from_environment(c);
    g_comm = c;
    on_fail = comm_on_fail;
#ifdef USE_MPI
    int env_world = c->world_size;
    std::string env_launcher = c->launcher;
    // FUNNELED: OpenMP threads compute, only the main thread talks to MPI.
    int provided = 0;
    int err = MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided);
    if (err != MPI_SUCCESS) fail("MPI_Init failed (error %d): check the MPI installation and the launcher", err);
    c->mpi = true;
    // Errors come back to us, so that each message can say which operation failed.
    MPI_CHECK(MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN), "MPI setup");
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &c->rank), "MPI setup");
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &c->world_size), "MPI setup");
    if (c->world_size == 1 && env_world > 1) {
        fail("%s started %d processes but MPI sees each as alone (a world of 1): the launcher and this MPI do not "
             "talk. Under Slurm use 'srun --mpi=pmix' (see 'srun --mpi=list') or mpirun inside the allocation; "
             "otherwise launch with this MPI's own mpirun", env_launcher.c_str(), env_world);
    }
    // The ranks on this node: those that can share memory with us.
    MPI_Comm node;
    MPI_CHECK(MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, c->rank, MPI_INFO_NULL, &node), "MPI setup");
    MPI_CHECK(MPI_Comm_rank(node, &c->local_rank), "MPI setup");
    MPI_CHECK(MPI_Comm_size(node, &c->local_size), "MPI setup");
    MPI_CHECK(MPI_Comm_free(&node), "MPI setup");
    c->launcher = env_world > 1 ? env_launcher + ", MPI" : std::string("MPI");
#else
    // Without MPI the local size is not discoverable in general; Slurm and Open MPI say it.
    c->local_size = env_int("SLURM_NTASKS_PER_NODE", env_int("OMPI_COMM_WORLD_LOCAL_SIZE", c->world_size));
#endif
}

// Every rank calls this at the end; after it no collective may run.
inline void comm_finalize(Comm* c) {
#ifdef USE_MPI
    if (c->mpi) MPI_CHECK(MPI_Finalize(), "MPI shutdown");
    c->mpi = false;
#endif
    on_fail = nullptr;
    g_comm = nullptr;
}

// ----------------------------------------------------------------------------------------------
// Host collectives. `what` names the operation in error messages ("all-reduce of the gradients").
// With one rank each is a no-op (or a copy); with several it needs MPI.

inline void comm_require_mpi(const Comm* c, const char* what) {
    if (c->world_size > 1 && !c->mpi) {
        fail("%s across %d ranks needs MPI, and this program was built without it. Install Open MPI "
             "(Debian: apt-get install libopenmpi-dev openmpi-bin) and rebuild; `make` picks it up", what, c->world_size);
    }
}

// MPI counts are ints: larger arrays go in pieces of at most this many elements. comm_in_pieces
// runs start(offset, count, &request) for each piece, a non-blocking collective, and waits for it
// under the deadline.
constexpr size_t COMM_MAX_COUNT = (size_t)1 << 30;

#ifdef USE_MPI
template <class Start>
inline void comm_in_pieces(Comm* c, size_t n, const char* what, Start start) {
    for (size_t off = 0; off < n; off += COMM_MAX_COUNT) {
        MPI_Request r;
        start(off, (int)std::min(COMM_MAX_COUNT, n - off), &r);
        comm_wait(c, &r, what);
    }
}
#endif

inline void comm_barrier(Comm* c, const char* what) {
    if (c->world_size == 1) return;
    comm_require_mpi(c, what);
#ifdef USE_MPI
    MPI_Request r;
    MPI_CHECK(MPI_Ibarrier(c->handle, &r), what);
    comm_wait(c, &r, what);
#endif
}

inline void comm_broadcast(Comm* c, void* data, size_t bytes, int root, const char* what) {
    if (c->world_size == 1) return;
    comm_require_mpi(c, what);
    if (c->rank == root) comm_count(c, COMM_BROADCAST, (uint64_t)bytes * (c->world_size - 1));
#ifdef USE_MPI
    comm_in_pieces(c, bytes, what, [&](size_t off, int n, MPI_Request* r) {
        MPI_CHECK(MPI_Ibcast((char*)data + off, n, MPI_BYTE, root, c->handle, r), what);
    });
#endif
}

// data[i] <- sum over ranks of data[i], on every rank.
inline void comm_allreduce_sum(Comm* c, float* data, size_t n, const char* what) {
    if (c->world_size == 1) return;
    comm_require_mpi(c, what);
    comm_count(c, COMM_ALL_REDUCE, 2 * (uint64_t)(c->world_size - 1) * n * sizeof(float) / c->world_size);
#ifdef USE_MPI
    comm_in_pieces(c, n, what, [&](size_t off, int count, MPI_Request* r) {
        MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data + off, count, MPI_FLOAT, MPI_SUM, c->handle, r), what);
    });
#endif
}

// data[i] <- sum over ranks of data[i], on rank `root` only; the other ranks' arrays are only read.
// (Reduce to one owner: ZeRO's gradient exchange when pieces are uneven, see llmc/sharding.h.)
inline void comm_reduce_sum(Comm* c, float* data, size_t n, int root, const char* what) {
    if (c->world_size == 1) return;
    comm_require_mpi(c, what);
    if (c->rank != root) comm_count(c, COMM_REDUCE, (uint64_t)n * sizeof(float));
#ifdef USE_MPI
    comm_in_pieces(c, n, what, [&](size_t off, int count, MPI_Request* r) {
        const void* send = c->rank == root ? MPI_IN_PLACE : (const void*)(data + off);
        MPI_CHECK(MPI_Ireduce(send, data + off, count, MPI_FLOAT, MPI_SUM, root, c->handle, r), what);
    });
#endif
}

// full holds world_size * shard_count values on every rank; afterwards shard[i] on rank r is the
// sum over ranks of full[r * shard_count + i].
inline void comm_reduce_scatter_sum(Comm* c, const float* full, float* shard, size_t shard_count, const char* what) {
    if (c->world_size == 1) {
        memcpy(shard, full, shard_count * sizeof(float));
        return;
    }
    comm_require_mpi(c, what);
    comm_count(c, COMM_REDUCE_SCATTER, (uint64_t)(c->world_size - 1) * shard_count * sizeof(float));
#ifdef USE_MPI
    if (shard_count > (size_t)INT_MAX) fail("%s: a shard of %zu elements is more than MPI can count; use more ranks", what, shard_count);
    MPI_Request r;
    MPI_CHECK(MPI_Ireduce_scatter_block(full, shard, (int)shard_count, MPI_FLOAT, MPI_SUM, c->handle, &r), what);
    comm_wait(c, &r, what);
#endif
}

// In place: rank r's shard is already at full + r * shard_bytes; afterwards every rank has every
// shard. Bytes, not floats, so the same call gathers fp32 and bf16 arrays.
inline void comm_all_gather(Comm* c, void* full, size_t shard_bytes, const char* what) {
    if (c->world_size == 1) return;
    comm_require_mpi(c, what);
    comm_count(c, COMM_ALL_GATHER, (uint64_t)(c->world_size - 1) * shard_bytes);
#ifdef USE_MPI
    if (shard_bytes > (size_t)INT_MAX) fail("%s: a shard of %zu bytes is more than MPI can count; use more ranks", what, shard_bytes);
    MPI_Request r;
    MPI_CHECK(MPI_Iallgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, full, (int)shard_bytes, MPI_BYTE, c->handle, &r), what);
    comm_wait(c, &r, what);
#endif
}

// All-to-all: send holds world_size blocks of block_bytes; block j goes to rank j, and recv's block
// j comes from rank j (send and recv must not overlap). Every rank keeps one block and exchanges the
// other N-1, so nothing is reduced and no rank is a hub: the exchange of expert parallelism (tokens to
// the rank of their expert and back) and of a transpose of a sharded matrix. Bytes, as all-gather.
inline void comm_all_to_all(Comm* c, const void* send, void* recv, size_t block_bytes, const char* what) {
    if (c->world_size == 1) {
        memcpy(recv, send, block_bytes);
        return;
    }
    comm_require_mpi(c, what);
    comm_count(c, COMM_ALL_TO_ALL, (uint64_t)(c->world_size - 1) * block_bytes);
#ifdef USE_MPI
    if (block_bytes > (size_t)INT_MAX) fail("%s: a block of %zu bytes is more than MPI can count; use more ranks", what, block_bytes);
    MPI_Request r;
    MPI_CHECK(MPI_Ialltoall(send, (int)block_bytes, MPI_BYTE, recv, (int)block_bytes, MPI_BYTE, c->handle, &r), what);
    comm_wait(c, &r, what);
#endif
}

// All-to-all of unequal blocks (expert parallelism's rows: as many as the router sent each expert):
// send_counts[j] floats of `send` go to rank j, recv_counts[j] floats from rank j land in `recv`, each
// side's blocks one after another in rank order. Both sides must agree on the counts (the caller
// exchanged them first with comm_all_to_all). Bytes: what leaves this rank for the others.
inline void comm_all_to_all_v(Comm* c, const float* send, const int* send_counts, float* recv, const int* recv_counts,
                              const char* what) {
    int N = c->world_size;
    std::vector<int> sdispl((size_t)N + 1, 0), rdispl((size_t)N + 1, 0);
    for (int j = 0; j < N; j++) {
        sdispl[(size_t)j + 1] = sdispl[(size_t)j] + send_counts[j];
        rdispl[(size_t)j + 1] = rdispl[(size_t)j] + recv_counts[j];
    }
    if (N == 1) {
        memcpy(recv, send, (size_t)send_counts[0] * sizeof(float));
        return;
    }
    comm_require_mpi(c, what);
    uint64_t out = (uint64_t)(sdispl[(size_t)N] - send_counts[c->rank]) * sizeof(float);
    comm_count(c, COMM_ALL_TO_ALL, out);
#ifdef USE_MPI
    MPI_Request r;
    MPI_CHECK(MPI_Ialltoallv(send, send_counts, sdispl.data(), MPI_FLOAT, recv, recv_counts, rdispl.data(), MPI_FLOAT, c->handle, &r),
              what);
    comm_wait(c, &r, what);
#endif
}

// The sum over ranks of one number, bit-identical on every rank: the values are gathered and added
// in rank order. (An MPI all-reduce may add them in a different order on different ranks, and a
// gradient norm that differs in its last bit between ranks would make their weights drift apart.)
inline double comm_sum(Comm* c, double x, const char* what) {
    if (c->world_size == 1) return x;
    std::vector<double> all((size_t)c->world_size);
    all[(size_t)c->rank] = x;
    comm_all_gather(c, all.data(), sizeof(double), what);
    double total = 0.0;
    for (double v : all) total += v;
    return total;
}

// The elementwise maximum over ranks, on every rank. A maximum is exact in any order, so every rank
// gets the same bits whatever algorithm MPI uses.
inline void comm_allreduce_max(Comm* c, float* data, size_t n, const char* what) {
    if (c->world_size == 1) return;
    comm_require_mpi(c, what);
    comm_count(c, COMM_ALL_REDUCE, 2 * (uint64_t)(c->world_size - 1) * n * sizeof(float) / c->world_size);
#ifdef USE_MPI
    for (size_t off = 0; off < n; off += COMM_MAX_COUNT) {
        MPI_Request r;
        int count = (int)std::min(COMM_MAX_COUNT, n - off);
        MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, data + off, count, MPI_FLOAT, MPI_MAX, c->handle, &r), what);
        comm_wait(c, &r, what);
    }
#endif
}

// An all-reduce that gives every rank the same bits: a reduce-scatter (each element is summed once,
// by one rank) and an all-gather of the sums. MPI_Allreduce promises the sum, not that every rank
// adds in the same order; replicas that must stay identical (tensor-parallel ranks computing the
// same LayerNorm from an all-reduced activation) use this one. `scratch` is reused between calls.
// It is also exactly what a ring all-reduce does inside, so it costs the same bytes.
inline void comm_allreduce_sum_identical(Comm* c, float* data, size_t n, std::vector<float>* scratch, const char* what) {
    if (c->world_size == 1) return;
    size_t N = (size_t)c->world_size, shard = (n + N - 1) / N;
    scratch->resize(shard * N + shard);
    float* full = scratch->data();
    float* mine = full + shard * N;
    memcpy(full, data, n * sizeof(float));
    memset(full + n, 0, (shard * N - n) * sizeof(float));  // padding, so the shards are equal
    comm_reduce_scatter_sum(c, full, mine, shard, what);
    memcpy(full + shard * c->rank, mine, shard * sizeof(float));
    comm_all_gather(c, full, shard * sizeof(float), what);
    memcpy(data, full, n * sizeof(float));
}

// ----------------------------------------------------------------------------------------------
// Groups. A process grid (llmc/parallel/process_grid.h) cuts the world into groups: every rank with the same
// `color` lands in one group, ordered by `key`. Each group is a Comm of its own, with its own ranks
// and byte counters; its collectives involve only its members.
inline void comm_split(Comm* parent, int color, int key, Comm* group, const char* what) {
    group->local_rank = parent->local_rank;
    group->local_size = parent->local_size;
    group->launcher = parent->launcher;
    group->mpi = parent->mpi;
    group->timeout_s = parent->timeout_s;
    group->rank = 0;
    group->world_size = 1;
    if (parent->world_size == 1) return;
    comm_require_mpi(parent, what);
#ifdef USE_MPI
    MPI_CHECK(MPI_Comm_split(parent->handle, color, key, &group->handle), what);
    MPI_CHECK(MPI_Comm_set_errhandler(group->handle, MPI_ERRORS_RETURN), what);
    MPI_CHECK(MPI_Comm_rank(group->handle, &group->rank), what);
    MPI_CHECK(MPI_Comm_size(group->handle, &group->world_size), what);
#endif
}

// ----------------------------------------------------------------------------------------------
// Point to point: one rank's buffer to one other rank of the group (pipeline parallelism).
//
// Sends are non-blocking and completed later, by comm_wait_sends: a rank that sends and then
// receives never waits for its peer to take the data first, so two neighbours that both send
// before they receive cannot wait for each other forever. The buffer must not change until its
// send is complete. Receives wait (against the deadline) and return the seconds they waited: in a
// pipeline that is the time the stage sat idle.
struct CommSend {
#ifdef USE_MPI
    MPI_Request request;
#endif
    const char* what;
};

inline void comm_send(Comm* c, const float* data, size_t n, int dest, int tag, std::vector<CommSend>* pending,
                      const char* what) {
    comm_require_mpi(c, what);
    comm_count(c, COMM_SEND, n * sizeof(float));
#ifdef USE_MPI
    if (n > (size_t)INT_MAX) fail("%s: %zu floats are more than one MPI message can count", what, n);
    CommSend s;
    s.what = what;
    MPI_CHECK(MPI_Isend(data, (int)n, MPI_FLOAT, dest, tag, c->handle, &s.request), what);
    pending->push_back(s);
#endif
}

inline double comm_recv(Comm* c, float* data, size_t n, int source, int tag, const char* what) {
    comm_require_mpi(c, what);
    auto start = std::chrono::steady_clock::now();
#ifdef USE_MPI
    if (n > (size_t)INT_MAX) fail("%s: %zu floats are more than one MPI message can count", what, n);
    MPI_Request r;
    MPI_CHECK(MPI_Irecv(data, (int)n, MPI_FLOAT, source, tag, c->handle, &r), what);
    comm_wait(c, &r, what);
#endif
    return comm_seconds_since(start);
}

inline void comm_wait_sends(Comm* c, std::vector<CommSend>* pending) {
#ifdef USE_MPI
    for (CommSend& s : *pending) comm_wait(c, &s.request, s.what);
#endif
    pending->clear();
}
