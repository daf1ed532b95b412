// nccl_standin_check.cpp — drives the NCCL stand-in (test/emu/nccl_standin.cpp) under mpirun, for
// test/test_emu_nccl.py, which builds it into build/emu/ and judges what it writes.
//
//     mpirun -np N build/emu/nccl_standin_check collectives DIR
//         runs every collective the repo uses (all-reduce sum and max, reduce, reduce-scatter,
//         all-gather, broadcast; bf16, fp32, fp64; in place and out of place; counts that divide nothing),
//         grouped reduces, a ring of grouped sends and receives, two grouped pairs with one peer, on the world's communicator, on
//         split ones and on ones made from separate unique ids. Each rank writes, per case, its
//         input and its output (raw bytes) and a manifest line; the Python test computes the
//         reference with numpy. This program only moves bytes: it checks nothing itself, so a
//         wrong reference here cannot hide a wrong stand-in.
//     mpirun -np 2 build/emu/nccl_standin_check NEGATIVE-CONTROL
//         breaks one of NCCL's rules (the modes are listed in usage()); the stand-in must stop the
//         run with a message saying which, instead of hanging or returning wrong data.
//
// Any NCCL error prints its message and stops every rank (MPI_Abort): exit code non-zero.
#define OMPI_SKIP_MPICXX 1
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <nccl.h>
#include <cmath>
#include <thread>
#include "llmc/utils.h"

static int world_rank = 0, world_size = 1;

[[noreturn]] static void stop(const char* call, ncclResult_t r) {
    fprintf(stderr, "check: world rank %d: %s failed: %s. NCCL says: %s\n", world_rank, call, ncclGetErrorString(r),
            ncclGetLastError(nullptr));
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
    exit(1);
}

// A non-blocking communicator answers ncclInProgress until it has settled: poll, as the trainer does.
static void settle(ncclComm_t comm, ncclResult_t r, const char* call) {
    while (r == ncclInProgress) {
        std::this_thread::sleep_for(std::chrono::microseconds(100));
        if (ncclCommGetAsyncError(comm, &r) != ncclSuccess) stop("ncclCommGetAsyncError", ncclInvalidArgument);
    }
    if (r != ncclSuccess) stop(call, r);
}
#define NCCL_CHECK(call) settle(nullptr, (call), #call)
#define MPI_CHECK(call) \
    do { if ((call) != MPI_SUCCESS) { fprintf(stderr, "check: %s failed\n", #call); MPI_Abort(MPI_COMM_WORLD, 1); } } while (0)

// ---- inputs: a fixed pseudo-random sequence per case and rank, of many magnitudes (so that the
// order of a sum and its rounding matter)

static uint64_t rng = 1;
static double next_uniform() {  // [-1, 1)
    rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
    return (double)(rng >> 11) / (double)(1ull << 52) - 1.0;
}
static double next_value() { return next_uniform() * std::ldexp(1.0, (int)(rng % 13) - 6); }

static size_t type_size(ncclDataType_t t) { return t == ncclFloat64 ? 8 : t == ncclFloat32 ? 4 : t == ncclBfloat16 ? 2 : 1; }

static void fill(char* p, size_t n, ncclDataType_t t) {
    for (size_t i = 0; i < n; i++) {
        double x = next_value();
        if (t == ncclFloat64) memcpy(p + i * 8, &x, 8);
        if (t == ncclFloat32) {
            float f = (float)x;
            memcpy(p + i * 4, &f, 4);
        }
        if (t == ncclBfloat16) {
            uint16_t h = float_to_bf16_round_nearest((float)x);
            memcpy(p + i * 2, &h, 2);
        }
        if (t == ncclUint8) p[i] = (char)(rng >> 24);
    }
}

// ---- cases

enum Kind { ALL_REDUCE, REDUCE, REDUCE_SCATTER, ALL_GATHER, SHIFT, BROADCAST };
static const char* kind_names[] = {"all_reduce", "reduce", "reduce_scatter", "all_gather", "shift", "broadcast"};

struct Case {
    const char* name;
    Kind kind;
    ncclDataType_t type;
    ncclRedOp_t op;
    size_t count;      // NCCL's count argument (recvcount for reduce-scatter, sendcount for all-gather)
    int root;          // reduce, broadcast: the root; shift: send to rank + root, receive from rank - root
    bool in_place;
};

// A communicator, and where this rank is in it (what the stand-in's caller knows when it makes one).
struct Group {
    ncclComm_t comm;
    std::string name;  // for the manifest: the ranks of one group are compared with each other
    int rank, ranks;
};

// A case's buffers on one rank, between its issue and its end.
struct Prepared {
    Case c;
    ncclComm_t comm;
    std::string group;
    int rank, ranks;
    std::vector<char> a, b;  // the buffers (b unused in place)
    const char* send = nullptr;
    char* recv = nullptr;
    size_t send_bytes = 0, recv_bytes = 0;
};

static std::string out_dir;

static void write_file(const std::string& path, const void* data, size_t bytes) {
    FILE* f = fopen(path.c_str(), "wb");
    if (!f || fwrite(data, 1, bytes, f) != bytes || fclose(f) != 0) {
        fprintf(stderr, "check: cannot write %s\n", path.c_str());
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
}

static Prepared prepare(const Case& c, const Group& g) {
    Prepared p{c, g.comm, g.name, g.rank, g.ranks, {}, {}};
    size_t es = type_size(c.type), n = c.count, N = (size_t)p.ranks;
    size_t send_n = c.kind == REDUCE_SCATTER ? N * n : n;
    size_t recv_n = c.kind == ALL_GATHER ? N * n : n;
    bool no_recv = c.kind == REDUCE && p.rank != c.root && !c.in_place;  // NCCL allows NULL there
    p.send_bytes = send_n * es;
    p.recv_bytes = no_recv ? 0 : recv_n * es;
    rng = 0x9e3779b97f4a7c15ull ^ ((uint64_t)std::hash<std::string>()(c.name) + 7919u * (uint64_t)p.rank + 1);
    if (c.in_place) {
        p.a.assign(std::max(send_n, recv_n) * es, (char)0x5a);
        if (c.kind == ALL_GATHER) {
            p.recv = p.a.data();
            p.send = p.recv + (size_t)p.rank * n * es;
        } else {
            p.send = p.a.data();
            p.recv = p.a.data() + (c.kind == REDUCE_SCATTER ? (size_t)p.rank * n * es : 0);
        }
    } else {
        p.a.assign(p.send_bytes, 0);
        p.b.assign(p.recv_bytes, (char)0x5a);  // what nobody wrote shows up
        p.send = p.a.data();
        p.recv = no_recv ? nullptr : p.b.data();
    }
    fill((char*)p.send, send_n, c.type);
    std::string stem = out_dir + "/" + c.name + "." + p.group + "." + std::to_string(p.rank);
    write_file(stem + ".in", p.send, p.send_bytes);
    return p;
}

static void issue(Prepared& p) {
    const Case& c = p.c;
    switch (c.kind) {
        case ALL_REDUCE: NCCL_CHECK(ncclAllReduce(p.send, p.recv, c.count, c.type, c.op, p.comm, nullptr)); break;
        case REDUCE: NCCL_CHECK(ncclReduce(p.send, p.recv, c.count, c.type, c.op, c.root, p.comm, nullptr)); break;
        case REDUCE_SCATTER: NCCL_CHECK(ncclReduceScatter(p.send, p.recv, c.count, c.type, c.op, p.comm, nullptr)); break;
        case ALL_GATHER: NCCL_CHECK(ncclAllGather(p.send, p.recv, c.count, c.type, p.comm, nullptr)); break;
        case BROADCAST: NCCL_CHECK(ncclBroadcast(p.send, p.recv, c.count, c.type, c.root, p.comm, nullptr)); break;
        case SHIFT: {
            int to = (p.rank + c.root + p.ranks) % p.ranks, from = (p.rank - c.root + p.ranks) % p.ranks;
            NCCL_CHECK(ncclSend(p.send, c.count, c.type, to, p.comm, nullptr));
            NCCL_CHECK(ncclRecv(p.recv, c.count, c.type, from, p.comm, nullptr));
            break;
        }
    }
}

// The output and the manifest line: name kind type op count root group rank ranks world_rank
static void finish(const Prepared& p) {
    const Case& c = p.c;
    std::string stem = out_dir + "/" + c.name + "." + p.group + "." + std::to_string(p.rank);
    write_file(stem + ".out", p.recv, p.recv_bytes);
    FILE* f = fopen((out_dir + "/manifest." + std::to_string(world_rank)).c_str(), "a");
    if (!f) MPI_Abort(MPI_COMM_WORLD, 1);
    fprintf(f, "%s %s %d %d %zu %d %s %d %d %d %d\n", c.name, kind_names[c.kind], (int)c.type, (int)c.op, c.count, c.root,
            p.group.c_str(), p.rank, p.ranks, world_rank, (int)c.in_place);
    fclose(f);
}

// `late`: this rank ends its group 0.2 s after the others, so that their messages are all waiting
// when it first looks for them.
static void run_cases(const std::vector<Case>& cases, const Group& g, bool grouped, bool late = false) {
    std::vector<Prepared> ps;
    for (const Case& c : cases) ps.push_back(prepare(c, g));
    if (grouped) NCCL_CHECK(ncclGroupStart());
    for (Prepared& p : ps) issue(p);
    if (late) std::this_thread::sleep_for(std::chrono::milliseconds(200));
    if (grouped) NCCL_CHECK(ncclGroupEnd());
    for (const Prepared& p : ps) finish(p);
}

static void close_comm(ncclComm_t comm) {
    settle(comm, ncclCommFinalize(comm), "ncclCommFinalize");
    NCCL_CHECK(ncclCommDestroy(comm));
}

static void collectives() {
    // The world: non-blocking, its unique id broadcast by MPI, as llmc/parallel/comm_nccl.cuh makes it.
    ncclUniqueId id;
    if (world_rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD));
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclComm_t world_comm = nullptr;
    ncclResult_t r = ncclCommInitRankConfig(&world_comm, world_size, id, world_rank, &config);
    if (world_rank == 0) printf("non-blocking init answered %s\n", r == ncclInProgress ? "ncclInProgress" : ncclGetErrorString(r));
    settle(world_comm, r, "ncclCommInitRankConfig");
    Group world{world_comm, "world", world_rank, world_size};

    int last = world_size - 1;
    const std::vector<Case> singles = {
        {"allreduce_sum_f32", ALL_REDUCE, ncclFloat32, ncclSum, 1001, 0, false},
        {"allreduce_sum_f32_inplace", ALL_REDUCE, ncclFloat32, ncclSum, 7, 0, true},
        {"allreduce_sum_bf16_inplace", ALL_REDUCE, ncclBfloat16, ncclSum, 1003, 0, true},
        {"allreduce_sum_bf16", ALL_REDUCE, ncclBfloat16, ncclSum, 65, 0, false},
        {"allreduce_sum_f64", ALL_REDUCE, ncclFloat64, ncclSum, 129, 0, false},
        {"allreduce_max_f32_inplace", ALL_REDUCE, ncclFloat32, ncclMax, 333, 0, true},
        {"allreduce_max_bf16", ALL_REDUCE, ncclBfloat16, ncclMax, 31, 0, false},
        {"allreduce_empty", ALL_REDUCE, ncclFloat32, ncclSum, 0, 0, true},
        {"reduce_sum_bf16_inplace_to_last", REDUCE, ncclBfloat16, ncclSum, 101, last, true},
        {"reduce_sum_f32_to_0", REDUCE, ncclFloat32, ncclSum, 77, 0, false},
        {"reducescatter_sum_bf16_inplace", REDUCE_SCATTER, ncclBfloat16, ncclSum, 37, 0, true},
        {"reducescatter_sum_f32", REDUCE_SCATTER, ncclFloat32, ncclSum, 5, 0, false},
        {"allgather_f64_inplace", ALL_GATHER, ncclFloat64, ncclSum, 1, 0, true},
        {"allgather_bf16", ALL_GATHER, ncclBfloat16, ncclSum, 13, 0, false},
        {"broadcast_f32_from_last", BROADCAST, ncclFloat32, ncclSum, 77, last, false},
        {"broadcast_u8_inplace", BROADCAST, ncclUint8, ncclSum, 1001, 0, true},
    };
    for (const Case& c : singles) run_cases({c}, world, false);
    // Reduce to owners (comm_nccl.cuh's gpu_reduce_to_owners): pieces to different roots, one group.
    run_cases({{"grouped_reduce_a", REDUCE, ncclBfloat16, ncclSum, 10, 0, true},
               {"grouped_reduce_b", REDUCE, ncclBfloat16, ncclSum, 23, 1 % world_size, true},
               {"grouped_reduce_c", REDUCE, ncclBfloat16, ncclSum, 3, last, true}},
              world, true);
    // A ring both ways in one group: every rank sends before it receives, which only grouping allows.
    run_cases({{"ring_forward", SHIFT, ncclUint8, ncclSum, 101, 1, false},
               {"ring_backward", SHIFT, ncclFloat32, ncclSum, 13, -1, false}},
              world, true);
    // Two sends to one peer and two receives from it in one group, the same size (interleaved 1F1B on
    // 2 stages: an activation and a gradient): NCCL pairs them in issue order. Rank 0 comes late, so
    // both headers wait for it; polled last first (LLMC_EMU_NCCL_POLL=reverse) it sees the second one
    // first, and must still give the first receive the first send's data.
    run_cases({{"pair_first", SHIFT, ncclBfloat16, ncclSum, 64, 1, false},
               {"pair_second", SHIFT, ncclBfloat16, ncclSum, 64, 1, false}},
              world, true, world_rank == 0);

    // Split by parity, ranks ordered by key = -world rank (the reverse of the world's order).
    int parity = world_rank % 2, same_parity = (world_size - parity + 1) / 2;
    ncclComm_t half_comm = nullptr;
    r = ncclCommSplit(world_comm, parity, -world_rank, &half_comm, nullptr);
    settle(half_comm, r, "ncclCommSplit");
    Group half{half_comm, "split" + std::to_string(parity), (world_size - 1 - world_rank) / 2, same_parity};
    run_cases({{"split_allreduce_sum_f32", ALL_REDUCE, ncclFloat32, ncclSum, 17, 0, false}}, half, false);
    run_cases({{"split_allgather_f32", ALL_GATHER, ncclFloat32, ncclSum, 3, 0, false}}, half, false);

    // NCCL_SPLIT_NOCOLOR: rank 0 is in no new communicator.
    ncclComm_t rest_comm = nullptr;
    r = ncclCommSplit(world_comm, world_rank == 0 ? NCCL_SPLIT_NOCOLOR : 0, 0, &rest_comm, nullptr);
    if (world_rank == 0 && (r != ncclSuccess || rest_comm != nullptr)) {
        fprintf(stderr, "check: ncclCommSplit with NCCL_SPLIT_NOCOLOR gave a communicator (or failed)\n");
        MPI_Abort(MPI_COMM_WORLD, 1);
    }
    if (world_rank != 0) {
        settle(rest_comm, r, "ncclCommSplit");
        run_cases({{"nocolor_allreduce_sum_bf16", ALL_REDUCE, ncclBfloat16, ncclSum, 9, 0, true}},
                  Group{rest_comm, "rest", world_rank - 1, world_size - 1}, false);
    }

    // Communicators from separate unique ids: even world ranks share one, odd ones another.
    ncclUniqueId ids[2];
    if (world_rank < 2) NCCL_CHECK(ncclGetUniqueId(&ids[world_rank]));
    for (int p = 0; p < std::min(2, world_size); p++) MPI_CHECK(MPI_Bcast(&ids[p], sizeof(ids[p]), MPI_BYTE, p, MPI_COMM_WORLD));
    ncclComm_t byid_comm = nullptr;
    NCCL_CHECK(ncclCommInitRank(&byid_comm, same_parity, ids[parity], world_rank / 2));
    run_cases({{"byid_allgather_f64_inplace", ALL_GATHER, ncclFloat64, ncclSum, 2, 0, true}},
              Group{byid_comm, "byid" + std::to_string(parity), world_rank / 2, same_parity}, false);

    close_comm(byid_comm);
    if (rest_comm) close_comm(rest_comm);
    close_comm(half_comm);
    close_comm(world_comm);
    if (world_rank == 0) printf("collectives done\n");
}

// Each breaks one of NCCL's rules; the stand-in must stop the run, saying which.
static const char* negative_controls[] = {"different-collectives", "different-counts", "unmatched-send", "size-mismatch",
                                          "send-before-recv", "overlap"};

static void negative_control(const std::string& mode) {
    ncclUniqueId id;
    if (world_rank == 0) NCCL_CHECK(ncclGetUniqueId(&id));
    MPI_CHECK(MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD));
    ncclComm_t comm = nullptr;
    NCCL_CHECK(ncclCommInitRank(&comm, world_size, id, world_rank));
    std::vector<float> a(64, 1.0f), b(256, 0.0f);
    int peer = (world_rank + 1) % world_size;
    if (mode == "different-collectives") {  // rank 0 reduces while the others gather
        if (world_rank == 0) NCCL_CHECK(ncclAllReduce(a.data(), a.data(), 8, ncclFloat32, ncclSum, comm, nullptr));
        else NCCL_CHECK(ncclAllGather(a.data(), b.data(), 8, ncclFloat32, comm, nullptr));
    } else if (mode == "different-counts") {
        NCCL_CHECK(ncclAllReduce(a.data(), a.data(), 8 + (size_t)world_rank, ncclFloat32, ncclSum, comm, nullptr));
    } else if (mode == "unmatched-send") {  // rank 0 sends; rank 1 never receives, it waits elsewhere
        if (world_rank == 0) {
            NCCL_CHECK(ncclGroupStart());
            NCCL_CHECK(ncclSend(a.data(), 64, ncclUint8, 1, comm, nullptr));
            NCCL_CHECK(ncclGroupEnd());
        } else {
            MPI_CHECK(MPI_Barrier(MPI_COMM_WORLD));
        }
    } else if (mode == "size-mismatch") {  // 64 bytes sent, 60 expected
        NCCL_CHECK(ncclGroupStart());
        if (world_rank == 0) NCCL_CHECK(ncclSend(a.data(), 64, ncclUint8, 1, comm, nullptr));
        if (world_rank == 1) NCCL_CHECK(ncclRecv(b.data(), 60, ncclUint8, 0, comm, nullptr));
        NCCL_CHECK(ncclGroupEnd());
    } else if (mode == "send-before-recv") {  // both send first, ungrouped: NCCL deadlocks
        NCCL_CHECK(ncclSend(a.data(), 64, ncclUint8, peer, comm, nullptr));
        NCCL_CHECK(ncclRecv(b.data(), 64, ncclUint8, peer, comm, nullptr));
    } else if (mode == "overlap") {  // all-gather from inside the receive buffer, but not from this rank's slot
        NCCL_CHECK(ncclAllGather(b.data() + 1, b.data(), 8, ncclFloat32, comm, nullptr));
    }
    close_comm(comm);
    if (world_rank == 0) printf("negative control %s was not caught\n", mode.c_str());
}

int main(int argc, char** argv) {
    MPI_CHECK(MPI_Init(&argc, &argv));
    MPI_CHECK(MPI_Comm_rank(MPI_COMM_WORLD, &world_rank));
    MPI_CHECK(MPI_Comm_size(MPI_COMM_WORLD, &world_size));
    std::string mode = argc > 1 ? argv[1] : "";
    bool known = false;
    for (const char* m : negative_controls) known |= mode == m;
    if (mode == "collectives" && argc == 3) {
        out_dir = argv[2];
        collectives();
    } else if (known && world_size >= 2) {
        negative_control(mode);
    } else {
        if (world_rank == 0) {
            fprintf(stderr, "usage: mpirun -np N %s collectives DIR | mpirun -np 2 %s NEGATIVE-CONTROL, one of:", argv[0], argv[0]);
            for (const char* m : negative_controls) fprintf(stderr, " %s", m);
            fprintf(stderr, "\n");
        }
        MPI_Finalize();
        return EXIT_BAD_USAGE;
    }
    MPI_CHECK(MPI_Finalize());
    return 0;
}
