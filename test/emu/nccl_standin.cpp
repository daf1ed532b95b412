// nccl_standin.cpp — NCCL over MPI: the library's calls that this repo makes, for running the GPU
// trainer under test/emu's CPU emulation of CUDA, where there is no GPU and no real NCCL.
//
// Model. Each rank is an MPI process with its own emulated device, whose "device memory" is host
// memory, so the buffers NCCL is handed are plain pointers. Every call runs to completion before it
// returns (the stream argument is ignored): that is the emulator's rule for every stream operation.
// An NCCL communicator is an MPI communicator of its own (duplicated, so its traffic never meets the
// caller's MPI messages), with MPI_ERRORS_RETURN so that every failure becomes a message here.
//   - ncclCommInitRank(Config): the processes that pass the same 128-byte unique id form one
//     communicator (MPI_Comm_split of MPI_COMM_WORLD, coloured by the lowest world rank holding that
//     id, keyed by the NCCL rank). Every process of MPI_COMM_WORLD must make this call at the same
//     point, even if their ids differ. MPI is initialised here if the caller has not (srun with
//     LLMC_RENDEZVOUS), and then finalised at exit.
//   - ncclCommSplit: MPI_Comm_split with the same colour and key; NCCL_SPLIT_NOCOLOR gives NULL.
//   - non-blocking communicators (config.blocking = 0): init, split and finalize answer
//     ncclInProgress, as NCCL's do while connecting, and ncclCommGetAsyncError answers ncclSuccess
//     once asked; so the caller's polling loop runs, as it must on a GPU.
//
// Arithmetic. A reduction moves every rank's input to where it is reduced (an all-gather for
// ncclAllReduce, an all-to-all of the blocks for ncclReduceScatter, a gather for ncclReduce) and
// combines the values in rank order 0, 1, ..., N-1. Sums of fp32 and fp64 are added in their own
// type; bf16 is widened to fp32, summed, and rounded to bf16 (nearest, ties to even) ONCE. So every
// rank gets identical bits, and the same bits on every run. Real NCCL does not promise this: a ring
// rounds each partial sum to bf16 at every hop, in an order that depends on the rank's place in the
// ring, and a tree adds in yet another order. So a test that compares N ranks with one rank must use
// tolerances (or, like gpu_comm_check, inputs whose sums are exact), never bit-equality, unless the
// code guarantees the bits itself: comm_nccl.cuh's gpu_all_reduce_identical (a reduce-scatter, each
// sum computed by one rank, then an all-gather) does, on NCCL as here. Maxima are exact in any
// order (a NaN anywhere gives NaN). Reductions exist for float32, float64, bfloat16 and float16 (as bf16) with sum and
// max, the ones the repo uses; any other type or operation is refused with a message naming it.
// Copies (all-gather, broadcast, send, receive) take every type. Large arrays go in chunks of
// LLMC_EMU_NCCL_CHUNK_BYTES per rank (default 4 MiB), which bounds the scratch memory at N chunks.
//
// In place, as NCCL defines it: all-reduce and reduce when sendbuff == recvbuff; reduce-scatter
// when recvbuff == sendbuff + rank * recvcount; all-gather when sendbuff == recvbuff + rank *
// sendcount. Buffers that overlap in any other way are refused (NCCL's result would be undefined).
//
// NCCL's rules, enforced, so that a bug that would hang or scramble a real run fails here at once:
//   - every rank of a communicator issues the same collectives in the same order, with the same
//     count, type, operation and root: before each collective (and split and finalize) the ranks
//     exchange a 24-byte description of it; on a difference, rank 0 of the communicator prints one
//     line naming both calls and ranks, and every rank returns ncclInvalidUsage;
//   - a send and its receive have the same count and type (each send is preceded by a small header
//     that the receiver checks); sends and receives between two ranks pair up in the order issued
//     (NCCL has no tags: MPI's ordering of messages on one communicator and tag gives the same);
//   - a send completes only once its receive is posted (MPI_Issend), as NCCL's does: an ungrouped
//     send followed by a receive, on two neighbours that both send first, stalls here as it would
//     deadlock there. Inside ncclGroupStart/End the sends and receives are queued and started
//     together at ncclGroupEnd (non-blocking MPI), so grouped pairs progress without deadlock;
//     collectives queued in a group run after its sends and receives, in the order issued;
//   - nothing waits forever: every wait polls against a deadline, LLMC_EMU_NCCL_TIMEOUT seconds
//     (default 60). A send that no rank receives, a receive that nothing arrives for, a collective
//     that some rank never joins: each is reported with the rank, the peer, the bytes and the call,
//     and the call returns ncclRemoteError (the communicator's async error says the same), which
//     the trainer turns into gpu_comm_fail and a stop of every rank.
//
// CUDA graphs (NCCL >= 2.9). A call issued on a stream being captured (the emulated runtime's
// stream capture, stream_capture.h), or a group whose ncclGroupEnd comes while its streams are
// captured, is checked at the call and recorded as one kernel node of the graph, with its pointers
// and counts as they were; each replay of the graph runs it over MPI, in the graph's order, with the
// same agreement check as an eager call (so a rank whose graph lacks the collective, or replays
// another, fails by the deadline or the mismatch). A group left open across cudaStreamEndCapture,
// and a group mixing captured and eager operations, are refused with one line (group_capture_problem).
//
// What it cannot show. The host blocks where NCCL would block only the stream: a program that is
// correct only because its host runs ahead of a send still in flight would stall here (and be
// reported by the deadline). No overlap of communication with computation, no timing, no transport
// (NVLink, InfiniBand), no bf16 rounding per ring hop. ncclCommAbort never hangs: it drops the
// communicator without freeing its MPI communicator (a peer may still be talking to it).
#define OMPI_SKIP_MPICXX 1  // the C API only
#define MPICH_SKIP_MPICXX 1
#include <mpi.h>
#include <nccl.h>
#include <cuda_fp16.h>
#include <chrono>
#include <cmath>
#include <memory>
#include <thread>
#include "llmc/utils.h"
#include "stream_capture.h"

struct ncclComm {
    MPI_Comm mpi = MPI_COMM_NULL;
    int rank = 0, nranks = 1;
    int world_rank = 0;                 // for messages: the process, not only its place here
    bool blocking = true;
    uint64_t calls = 0;                 // collectives issued so far: numbers them in messages
    ncclResult_t async = ncclSuccess;   // what ncclCommGetAsyncError answers
};

// ----------------------------------------------------------------------------------------------
// Errors: ncclGetLastError's text, printed where it is detected (one line), and the deadline.

static thread_local std::string last_error;

static ncclResult_t failure(ncclComm* comm, ncclResult_t code, bool print, const std::string& message) {
    last_error = message;
    if (print) {
        fprintf(stderr, "nccl stand-in: %s\n", message.c_str());
        fflush(stderr);
    }
    if (comm && code != ncclInvalidArgument) comm->async = code;  // the communicator is now unusable
    return code;
}

static std::string where(const ncclComm* c) {
    if (c) return strprintf("rank %d of %d (world rank %d)", c->rank, c->nranks, c->world_rank);
    int world_rank = -1;
    MPI_Comm_rank(MPI_COMM_WORLD, &world_rank);  // unchecked: only for the message
    return strprintf("world rank %d", world_rank);
}

static ncclResult_t mpi_failure(ncclComm* comm, const char* call, int err) {
    char text[MPI_MAX_ERROR_STRING] = "unknown MPI error";
    int len = 0;
    MPI_Error_string(err, text, &len);  // unchecked: already failing
    return failure(comm, ncclSystemError, true, strprintf("%s failed: %s", call, text));
}
#define TRY_MPI(comm, call)                                           \
    do {                                                              \
        int mpi_err_ = (call);                                        \
        if (mpi_err_ != MPI_SUCCESS) return mpi_failure(comm, #call, mpi_err_); \
    } while (0)

static double env_number(const char* name, double fallback) {
    const char* v = getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    double x = strtod(v, &end);
    if (*end || !(x > 0)) {
        fprintf(stderr, "error: %s='%s' is not a positive number (unset it for the default %g)\n", name, v, fallback);
        MPI_Abort(MPI_COMM_WORLD, EXIT_BAD_USAGE);
    }
    return x;
}
static double timeout_s() { return env_number("LLMC_EMU_NCCL_TIMEOUT", 60); }
static size_t chunk_bytes() { return (size_t)std::min(env_number("LLMC_EMU_NCCL_CHUNK_BYTES", 4 << 20), 1e9); }
// LLMC_EMU_NCCL_POLL=reverse: a group's sends and receives are polled last first (an order lever, as
// CUDA_EMU_BLOCKS is the kernels': test_emu_nccl.py runs its checks under it too)
static bool poll_reversed() {
    const char* v = getenv("LLMC_EMU_NCCL_POLL");
    return v && std::string(v) == "reverse";
}

// Calls `step` (which answers "done?") until it says yes or the deadline passes (returns false).
// Spins briefly, then sleeps, so that ranks waiting for a slow one leave the CPU to it.
template <class Step>
static bool poll_until(Step step, ncclResult_t* error) {
    auto start = std::chrono::steady_clock::now();
    double limit = timeout_s();
    for (long polls = 0;; polls++) {
        bool done = false;
        *error = step(&done);
        if (*error != ncclSuccess || done) return true;
        double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
        if (waited > limit) return false;
        if (polls > 1000) std::this_thread::sleep_for(std::chrono::microseconds(waited < 1.0 ? 20 : 1000));
    }
}

// Waits for one MPI request under the deadline; `stall` is the message if it never completes.
static ncclResult_t wait_request(ncclComm* c, MPI_Request* request, const std::string& stall) {
    ncclResult_t error = ncclSuccess;
    bool finished = poll_until([&](bool* done) {
        int flag = 0;
        TRY_MPI(c, MPI_Test(request, &flag, MPI_STATUS_IGNORE));
        *done = flag != 0;
        return ncclSuccess;
    }, &error);
    if (!finished) {
        return failure(c, ncclRemoteError, true, strprintf("%s: %s did not complete within %g s (LLMC_EMU_NCCL_TIMEOUT)",
                                                           where(c).c_str(), stall.c_str(), timeout_s()));
    }
    return error;
}

// ----------------------------------------------------------------------------------------------
// Types and reductions

static size_t type_bytes(ncclDataType_t t) {
    switch (t) {
        case ncclInt8: case ncclUint8: case ncclFloat8e4m3: case ncclFloat8e5m2: return 1;
        case ncclFloat16: case ncclBfloat16: return 2;
        case ncclInt32: case ncclUint32: case ncclFloat32: return 4;
        case ncclInt64: case ncclUint64: case ncclFloat64: return 8;
        default: return 0;
    }
}

static const char* type_name(int t) {
    static const char* names[] = {"int8", "uint8", "int32", "uint32", "int64", "uint64", "float16",
                                  "float32", "float64", "bfloat16", "float8e4m3", "float8e5m2"};
    return t >= 0 && t < ncclNumTypes ? names[t] : "unknown type";
}

static const char* op_name(int op) {
    static const char* names[] = {"sum", "prod", "max", "min", "avg"};
    return op >= 0 && op < ncclNumOps ? names[op] : "custom op";
}

template <class T>
static T combine(T acc, T x, ncclRedOp_t op) {
    if (op == ncclSum) return acc + x;
    return (x > acc || std::isnan(x)) ? x : acc;  // max; a NaN, once in, stays
}

// out[i] <- the reduction over ranks r = 0..N-1, in that order, of in[r * stride + i].
template <class Stored, class Acc, class Load, class Store>
static void reduce_ranks(const Stored* in, size_t n, int nranks, size_t stride, ncclRedOp_t op, Stored* out, Load load,
                         Store store) {
    for (size_t i = 0; i < n; i++) {
        Acc acc = load(in[i]);
        for (int r = 1; r < nranks; r++) acc = combine<Acc>(acc, load(in[(size_t)r * stride + i]), op);
        out[i] = store(acc);
    }
}

static void reduce_buffers(const void* in, size_t n, int nranks, ncclDataType_t t, ncclRedOp_t op, void* out) {
    auto same_f = [](float x) { return x; };
    auto same_d = [](double x) { return x; };
    if (t == ncclFloat32) reduce_ranks<float, float>((const float*)in, n, nranks, n, op, (float*)out, same_f, same_f);
    if (t == ncclFloat64) reduce_ranks<double, double>((const double*)in, n, nranks, n, op, (double*)out, same_d, same_d);
    if (t == ncclBfloat16) {
        reduce_ranks<uint16_t, float>((const uint16_t*)in, n, nranks, n, op, (uint16_t*)out, bf16_to_float,
                                      float_to_bf16_round_nearest);
    }
    if (t == ncclFloat16) {  // (train_gpt_fp16) as bf16: widened, summed in fp32, rounded once
        auto widen = [](uint16_t h) { return __half2float(__ushort_as_half(h)); };
        auto narrow = [](float x) { return __half_as_ushort(__float2half_rn(x)); };
        reduce_ranks<uint16_t, float>((const uint16_t*)in, n, nranks, n, op, (uint16_t*)out, widen, narrow);
    }
}

// ----------------------------------------------------------------------------------------------
// Operations: what a call asks for, kept until its group ends.

enum Kind : int32_t { KIND_ALL_REDUCE, KIND_REDUCE, KIND_REDUCE_SCATTER, KIND_ALL_GATHER, KIND_SPLIT, KIND_FINALIZE,
                      KIND_SEND, KIND_RECV, KIND_BROADCAST };

// What every rank must agree on, exchanged before each collective (24 bytes, no padding).
struct CallDescription {
    int32_t kind = 0, type = 0, op = 0, root = 0;
    uint64_t count = 0;
};

static std::string describe(const CallDescription& d) {
    switch (d.kind) {
        case KIND_ALL_REDUCE: return strprintf("ncclAllReduce(count %llu, %s, %s)", (unsigned long long)d.count, type_name(d.type), op_name(d.op));
        case KIND_REDUCE: return strprintf("ncclReduce(count %llu, %s, %s, root %d)", (unsigned long long)d.count, type_name(d.type), op_name(d.op), d.root);
        case KIND_REDUCE_SCATTER: return strprintf("ncclReduceScatter(recvcount %llu, %s, %s)", (unsigned long long)d.count, type_name(d.type), op_name(d.op));
        case KIND_ALL_GATHER: return strprintf("ncclAllGather(sendcount %llu, %s)", (unsigned long long)d.count, type_name(d.type));
        case KIND_BROADCAST: return strprintf("ncclBroadcast(count %llu, %s, root %d)", (unsigned long long)d.count, type_name(d.type), d.root);
        case KIND_SPLIT: return "ncclCommSplit";
        case KIND_FINALIZE: return "ncclCommFinalize";
        case KIND_SEND: return strprintf("ncclSend(count %llu, %s) to rank %d", (unsigned long long)d.count, type_name(d.type), d.root);
        case KIND_RECV: return strprintf("ncclRecv(count %llu, %s) from rank %d", (unsigned long long)d.count, type_name(d.type), d.root);
        default: return "an unknown call";
    }
}

struct Op {
    CallDescription call;   // root is the peer for sends and receives
    ncclComm* comm = nullptr;
    const void* send = nullptr;
    void* recv = nullptr;
    cudaStream_t stream = nullptr;
    bool captured = false;  // issued on a stream being captured into a CUDA graph
};

static int group_depth = 0;
static std::vector<Op> queued;  // inside a group: every operation, in the order issued

// Every rank of the communicator has issued the same call as its next collective?
static ncclResult_t agree(ncclComm* c, const CallDescription& mine) {
    uint64_t number = ++c->calls;
    if (c->nranks == 1) return ncclSuccess;
    std::vector<CallDescription> all((size_t)c->nranks);
    MPI_Request request;
    TRY_MPI(c, MPI_Iallgather(&mine, sizeof(mine), MPI_BYTE, all.data(), sizeof(mine), MPI_BYTE, c->mpi, &request));
    std::string what = strprintf("%s (collective #%llu of this communicator) waited for the other ranks to issue it: one "
                                 "issued fewer collectives, crashed, or is stuck elsewhere (real NCCL would hang here)",
                                 describe(mine).c_str(), (unsigned long long)number);
    ncclResult_t r = wait_request(c, &request, what);
    if (r != ncclSuccess) {
        new std::vector<CallDescription>(std::move(all));  // MPI may still write into it: leak it, do not free it
        return r;
    }
    for (int j = 1; j < c->nranks; j++) {
        if (memcmp(&all[(size_t)j], &all[0], sizeof(mine)) != 0) {
            return failure(c, ncclInvalidUsage, c->rank == 0,
                           strprintf("collective #%llu differs between the ranks of a %d-rank communicator: rank 0 called "
                                     "%s, rank %d called %s. Every rank must issue the same collectives in the same "
                                     "order, with the same count, type, operation and root (real NCCL would hang or "
                                     "mix up the data)", (unsigned long long)number, c->nranks, describe(all[0]).c_str(),
                                     j, describe(all[(size_t)j]).c_str()));
        }
    }
    return ncclSuccess;
}

// Scratch memory for MPI to read and write. If a wait timed out, MPI may still write into it later,
// so it is then leaked instead of freed.
struct Scratch {
    std::vector<char>* bytes = new std::vector<char>();
    bool abandoned = false;
    ~Scratch() {
        if (!abandoned) delete bytes;
    }
};

// One collective, all ranks agreed: move the inputs, chunk by chunk, and reduce in rank order.
static ncclResult_t run_collective(const Op& o) {
    ncclComm* c = o.comm;
    const CallDescription& d = o.call;
    ncclResult_t r = agree(c, d);
    if (r != ncclSuccess) return r;
    ncclDataType_t type = (ncclDataType_t)d.type;
    size_t es = type_bytes(type), n = d.count;
    int ranks = c->nranks;
    size_t chunk = std::max<size_t>(1, chunk_bytes() / es);
    std::string stall = describe(d) + "'s exchange of data";
    Scratch gathered, packed;
    const char* in = (const char*)o.send;
    char* out = (char*)o.recv;
    for (size_t off = 0; off < n; off += chunk) {
        size_t m = std::min(chunk, n - off);
        int bytes = (int)(m * es);
        gathered.bytes->resize((size_t)ranks * m * es);
        char* g = gathered.bytes->data();
        MPI_Request request;
        if (d.kind == KIND_BROADCAST) {  // a copy: the root's bytes straight into everyone's recvbuff
            if (c->rank == d.root && in != out) memcpy(out + off * es, in + off * es, m * es);
            TRY_MPI(c, MPI_Ibcast(out + off * es, bytes, MPI_BYTE, d.root, c->mpi, &request));
            r = wait_request(c, &request, stall);
            if (r != ncclSuccess) return r;
            continue;
        }
        if (d.kind == KIND_ALL_REDUCE || d.kind == KIND_ALL_GATHER) {
            TRY_MPI(c, MPI_Iallgather(in + off * es, bytes, MPI_BYTE, g, bytes, MPI_BYTE, c->mpi, &request));
        } else if (d.kind == KIND_REDUCE) {
            TRY_MPI(c, MPI_Igather(in + off * es, bytes, MPI_BYTE, g, bytes, MPI_BYTE, d.root, c->mpi, &request));
        } else {  // reduce-scatter: to rank j goes block j of this chunk
            packed.bytes->resize((size_t)ranks * m * es);
            char* p = packed.bytes->data();
            for (int j = 0; j < ranks; j++) memcpy(p + (size_t)j * m * es, in + ((size_t)j * n + off) * es, m * es);
            TRY_MPI(c, MPI_Ialltoall(p, bytes, MPI_BYTE, g, bytes, MPI_BYTE, c->mpi, &request));
        }
        r = wait_request(c, &request, stall);
        if (r != ncclSuccess) {
            gathered.abandoned = packed.abandoned = true;
            return r;
        }
        if (d.kind == KIND_ALL_GATHER) {
            for (int j = 0; j < ranks; j++) memcpy(out + ((size_t)j * n + off) * es, g + (size_t)j * m * es, m * es);
        } else if (d.kind != KIND_REDUCE || c->rank == d.root) {
            reduce_buffers(g, m, ranks, type, (ncclRedOp_t)d.op, out + off * es);
        }
    }
    return ncclSuccess;
}

// ----------------------------------------------------------------------------------------------
// Sends and receives. Each send is a header (count and type), sent plainly, then the data, sent
// synchronously (it completes only once the receiver has posted its receive, as NCCL's send does).
// A receive waits for the header, checks it against its own count and type, then posts the data's.
// NCCL matches a group's sends and receives between two ranks in the order they were issued; MPI
// matches its messages in the order their receives are posted, so the data's receives must be posted
// in issue order too. A group with two receives from one peer (interleaved 1F1B on 2 stages: an
// activation and a gradient, the same size) whose second header is seen first would otherwise take
// the first send's data: the trainer's activation and gradient swapped, now and then, under load.

struct SendHeader {
    uint64_t count = 0;
    int32_t type = 0, unused = 0;
};
constexpr int TAG_HEADER = 1, TAG_DATA = 2;

struct Transfer {
    Op op;
    SendHeader header;
    MPI_Request header_request = MPI_REQUEST_NULL, data_request = MPI_REQUEST_NULL;
    bool data_posted = false, done = false;
};

static std::string describe_stall(const Transfer& x) {
    const CallDescription& d = x.op.call;
    std::string call = where(x.op.comm) + ": " + describe(d);
    if (d.kind == KIND_SEND) {
        return strprintf("%s was not received within %g s (LLMC_EMU_NCCL_TIMEOUT): rank %d posted no matching ncclRecv, or "
                         "is stuck elsewhere. A send completes only once its receive is posted: two ranks that both send "
                         "before they receive must group each send with the receive (ncclGroupStart/End). Real NCCL "
                         "would hang here", call.c_str(), timeout_s(), d.root);
    }
    return strprintf("%s: %s within %g s (LLMC_EMU_NCCL_TIMEOUT): rank %d issued no matching ncclSend, or is stuck "
                     "elsewhere. Real NCCL would hang here", call.c_str(),
                     x.data_posted ? "the data did not arrive" : "no send arrived", timeout_s(), d.root);
}

// The sends and receives among `ops`, all started together and waited for together.
static ncclResult_t run_point_to_point(const std::vector<Op>& ops) {
    // On the heap, and leaked on failure: MPI may still write into the headers and requests.
    auto* transfers = new std::vector<Transfer>();
    for (const Op& o : ops)
        if (o.call.kind == KIND_SEND || o.call.kind == KIND_RECV) {
            transfers->emplace_back();
            transfers->back().op = o;
        }
    for (Transfer& x : *transfers) {
        ncclComm* c = x.op.comm;
        int peer = x.op.call.root, bytes = (int)(x.op.call.count * type_bytes((ncclDataType_t)x.op.call.type));
        if (x.op.call.kind == KIND_SEND) {
            x.header.count = x.op.call.count;
            x.header.type = x.op.call.type;
            TRY_MPI(c, MPI_Isend(&x.header, sizeof(SendHeader), MPI_BYTE, peer, TAG_HEADER, c->mpi, &x.header_request));
            TRY_MPI(c, MPI_Issend(x.op.send, bytes, MPI_BYTE, peer, TAG_DATA, c->mpi, &x.data_request));
            x.data_posted = true;
        } else {
            TRY_MPI(c, MPI_Irecv(&x.header, sizeof(SendHeader), MPI_BYTE, peer, TAG_HEADER, c->mpi, &x.header_request));
        }
    }
    // an earlier receive of the group from x's peer, on x's communicator, has not posted its data's yet
    auto behind = [&](const Transfer& x) {
        for (const Transfer& e : *transfers) {
            if (&e == &x) return false;
            if (e.op.call.kind == KIND_RECV && !e.data_posted && e.op.comm == x.op.comm && e.op.call.root == x.op.call.root)
                return true;
        }
        return false;
    };
    bool reversed = poll_reversed();
    auto progress = [&](bool* all_done) -> ncclResult_t {
        *all_done = true;
        for (size_t k = 0; k < transfers->size(); k++) {
            Transfer& x = (*transfers)[reversed ? transfers->size() - 1 - k : k];
            if (x.done) continue;
            ncclComm* c = x.op.comm;
            const CallDescription& d = x.op.call;
            int flag = 0;
            TRY_MPI(c, MPI_Test(&x.header_request, &flag, MPI_STATUS_IGNORE));  // completed: MPI_REQUEST_NULL
            if (x.header_request == MPI_REQUEST_NULL && !x.data_posted && !behind(x)) {  // a receive's header is here
                if (x.header.count != d.count || x.header.type != d.type) {
                    CallDescription theirs{KIND_SEND, x.header.type, 0, c->rank, x.header.count};
                    return failure(c, ncclInvalidUsage, true,
                                   strprintf("%s: its %s met rank %d's %s: a send and its receive must have the same "
                                             "count and type (real NCCL would hang or cut the data short)",
                                             where(c).c_str(), describe(d).c_str(), d.root, describe(theirs).c_str()));
                }
                int bytes = (int)(d.count * type_bytes((ncclDataType_t)d.type));
                TRY_MPI(c, MPI_Irecv(x.op.recv, bytes, MPI_BYTE, d.root, TAG_DATA, c->mpi, &x.data_request));
                x.data_posted = true;
            }
            if (x.data_posted) TRY_MPI(c, MPI_Test(&x.data_request, &flag, MPI_STATUS_IGNORE));
            x.done = x.header_request == MPI_REQUEST_NULL && x.data_posted && x.data_request == MPI_REQUEST_NULL;
            if (!x.done) *all_done = false;
        }
        return ncclSuccess;
    };
    ncclResult_t r = ncclSuccess;
    if (!poll_until(progress, &r)) {
        for (const Transfer& x : *transfers) {
            if (x.done) continue;
            ncclResult_t e = failure(x.op.comm, ncclRemoteError, true, describe_stall(x));  // one line for each
            if (r == ncclSuccess) r = e;
        }
    }
    if (r == ncclSuccess) delete transfers;
    return r;
}

// A group's operations (or one call's): the sends and receives first, all together, then the
// collectives in the order issued.
static ncclResult_t run_ops(const std::vector<Op>& ops) {
    ncclResult_t r = run_point_to_point(ops);
    for (const Op& o : ops)
        if (r == ncclSuccess && o.call.kind != KIND_SEND && o.call.kind != KIND_RECV) r = run_collective(o);
    return r;
}

// A launch recorded into a CUDA graph (NCCL >= 2.9; the NCCL user guide, "Using NCCL with CUDA
// Graphs"): the operations, with their buffers' pointers and counts as they were at the call, become
// one kernel node of the graph (a real NCCL launch is one kernel), run over MPI each time the graph
// is replayed, in the graph's order. The ranks' agreement (agree) is then checked at every replay:
// a rank whose graph lacks the node, or holds another collective, fails as an eager one would. A
// replay cannot return an error to the host: as on a GPU, a failure is the communicator's async
// error (ncclCommGetAsyncError), which the next call on it, or the trainer's wait, reports.
static ncclResult_t check_comm(ncclComm* c, const char* call);

static void record(const std::vector<Op>& ops) {
    const Op& first = ops.front();
    emu::stream_work(first.stream, ops.size() > 1 ? "ncclGroup" : describe(first.call).c_str(), cudaGraphNodeTypeKernel,
                     [ops]() {
                         for (const Op& o : ops)  // a communicator that failed (at an earlier replay) is not waited on again
                             if (check_comm(o.comm, "a CUDA graph's replay of a captured NCCL launch") != ncclSuccess) return;
                         run_ops(ops);
                     });
}

static ncclResult_t issue(Op o) {
    o.captured = emu::stream_capturing(o.stream);
    if (group_depth > 0) {
        queued.push_back(o);
        return ncclSuccess;
    }
    if (o.captured) {
        record({o});
        return ncclSuccess;
    }
    return run_ops({o});
}

// A group is one launch, at its ncclGroupEnd (NCCL's "group semantics"), so whether it is captured
// is decided there, for all its operations at once. The stand-in refuses the two ways this goes
// silently wrong on a GPU: an operation issued inside a capture whose capture ended before the
// group did (the group left open across cudaStreamEndCapture: NCCL would launch it eagerly, and the
// graph would replay without it), and a group mixing operations issued inside and outside a capture.
// Nothing of the group has been launched, so the communicator stays usable (no async error).
static ncclResult_t group_capture_problem(const std::vector<Op>& ops) {
    for (const Op& o : ops) {
        if (o.captured != ops.front().captured)
            return failure(nullptr, ncclInvalidUsage, true,
                           strprintf("%s: a group mixes operations issued on a stream being captured into a CUDA graph "
                                     "with operations issued outside the capture (%s): a group is one launch, captured "
                                     "or not; close the group before the capture begins, or open it inside",
                                     where(o.comm).c_str(), describe(o.call).c_str()));
        if (o.captured && !emu::stream_capturing(o.stream))
            return failure(nullptr, ncclInvalidUsage, true,
                           strprintf("%s: %s was issued inside a CUDA graph capture, but its group ended after the "
                                     "capture did: NCCL launches a group at ncclGroupEnd, so the graph would replay "
                                     "without it; call ncclGroupEnd before cudaStreamEndCapture",
                                     where(o.comm).c_str(), describe(o.call).c_str()));
    }
    return ncclSuccess;
}

// ----------------------------------------------------------------------------------------------
// Checking a call's arguments, as it is issued (one line naming the call and the problem).

static ncclResult_t bad_argument(ncclComm* c, const CallDescription& d, const std::string& problem) {
    return failure(c, ncclInvalidArgument, true,
                   strprintf("%s: %s: %s", where(c).c_str(), describe(d).c_str(), problem.c_str()));
}

static ncclResult_t check_comm(ncclComm* c, const char* call) {
    if (!c) return failure(nullptr, ncclInvalidArgument, true, strprintf("%s: the communicator is NULL", call));
    if (c->async != ncclSuccess && c->async != ncclInProgress) {
        return failure(c, c->async, true, strprintf("%s: %s on a communicator that has already failed (%s)", where(c).c_str(),
                                                    call, ncclGetErrorString(c->async)));
    }
    return ncclSuccess;
}

static bool overlap(const void* a, size_t a_bytes, const void* b, size_t b_bytes) {
    uintptr_t x = (uintptr_t)a, y = (uintptr_t)b;
    return a_bytes && b_bytes && x < y + b_bytes && y < x + a_bytes;
}

// The common checks: communicator, type, operation, buffers, in-place placement. `send_count` and
// `recv_count` are the elements each buffer holds; `in_place` is where recvbuff's in-place
// sendbuff would be (nullptr: in place means sendbuff == recvbuff).
static ncclResult_t check_op(const Op& o, bool reduces, size_t send_count, size_t recv_count, const char* in_place_at) {
    ncclComm* c = o.comm;
    const CallDescription& d = o.call;
    size_t es = type_bytes((ncclDataType_t)d.type);
    if (es == 0) return bad_argument(c, d, strprintf("data type %d is not one of NCCL's", d.type));
    if (reduces && d.type != ncclFloat32 && d.type != ncclFloat64 && d.type != ncclBfloat16 && d.type != ncclFloat16) {
        return bad_argument(c, d, "the stand-in reduces float32, float64, bfloat16 and float16 only (add the type to test/emu/nccl_standin.cpp)");
    }
    if (reduces && d.op != ncclSum && d.op != ncclMax) {
        return bad_argument(c, d, "the stand-in implements ncclSum and ncclMax only (add the operation to test/emu/nccl_standin.cpp)");
    }
    if (send_count && !o.send) return bad_argument(c, d, "sendbuff is NULL");
    if (recv_count && !o.recv) return bad_argument(c, d, "recvbuff is NULL");
    size_t send_bytes = send_count * es, recv_bytes = recv_count * es;
    const char* at = in_place_at ? in_place_at : (const char*)o.recv;
    if (o.send != at && overlap(o.send, send_bytes, o.recv, recv_bytes)) {
        return bad_argument(c, d, "sendbuff overlaps recvbuff but is not at its in-place position (NCCL's result "
                                  "would be undefined)");
    }
    if ((d.kind == KIND_SEND || d.kind == KIND_RECV) && std::max(send_bytes, recv_bytes) > (size_t)INT_MAX) {
        return bad_argument(c, d, "more than 2 GiB in one message: beyond the stand-in");
    }
    return ncclSuccess;
}

// ----------------------------------------------------------------------------------------------
// Communicators

static MPI_Comm world = MPI_COMM_NULL;  // a duplicate of MPI_COMM_WORLD: init's exchanges meet no one else's

static void finalize_mpi_at_exit() {
    int finalized = 1;
    MPI_Finalized(&finalized);  // unchecked: exiting
    if (!finalized) MPI_Finalize();
}

static ncclResult_t start_mpi() {
    int initialized = 0;
    TRY_MPI(nullptr, MPI_Initialized(&initialized));
    if (!initialized) {  // launched without the trainer's MPI (srun and LLMC_RENDEZVOUS): the stand-in needs it
        int provided = 0;
        TRY_MPI(nullptr, MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided));
        atexit(finalize_mpi_at_exit);
    }
    if (world != MPI_COMM_NULL) return ncclSuccess;
    MPI_Comm dup;
    MPI_Request request;
    TRY_MPI(nullptr, MPI_Comm_idup(MPI_COMM_WORLD, &dup, &request));
    ncclResult_t r = wait_request(nullptr, &request, "ncclCommInitRank's set-up, which every process of MPI_COMM_WORLD "
                                                     "must join (the stand-in builds communicators over the MPI world)");
    if (r != ncclSuccess) return r;
    TRY_MPI(nullptr, MPI_Comm_set_errhandler(dup, MPI_ERRORS_RETURN));
    world = dup;
    return ncclSuccess;
}

static ncclResult_t check_config(ncclComm* c, const ncclConfig_t* config, const char* call) {
    const ncclConfig_t initialized = NCCL_CONFIG_INITIALIZER;
    if (config && config->magic != initialized.magic) {
        return failure(c, ncclInvalidArgument, true, strprintf("%s: the config was not set up with NCCL_CONFIG_INITIALIZER", call));
    }
    return ncclSuccess;
}

// A communicator over `mpi` (already made, errors returned). Blocking unless the config says not,
// or, with no word from the config, as its parent was.
static ncclComm* make_comm(MPI_Comm mpi, const ncclConfig_t* config, bool parent_blocking) {
    ncclComm* c = new ncclComm();
    c->mpi = mpi;
    MPI_Comm_rank(mpi, &c->rank);  // unchecked: a communicator MPI has just made answers these
    MPI_Comm_size(mpi, &c->nranks);
    MPI_Comm_rank(MPI_COMM_WORLD, &c->world_rank);
    c->blocking = config && config->blocking != NCCL_CONFIG_UNDEF_INT ? config->blocking != 0 : parent_blocking;
    return c;
}

// What a non-blocking communicator's set-up answers: NCCL's answer while it is still connecting.
static ncclResult_t settled(const ncclComm* c) { return c->blocking ? ncclSuccess : ncclInProgress; }

// Linked without the emulated CUDA runtime, as test/emu/nccl_standin_check.cpp is, no stream is
// ever captured; the runtime's definition replaces this one.
__attribute__((weak)) bool emu::stream_capturing(cudaStream_t) { return false; }
__attribute__((weak)) void emu::stream_work(cudaStream_t, const char*, int, std::function<void()> work) { work(); }

extern "C" {

ncclResult_t ncclGetUniqueId(ncclUniqueId* id) {
    if (!id) return failure(nullptr, ncclInvalidArgument, true, "ncclGetUniqueId: the id pointer is NULL");
    memset(id, 0, sizeof(*id));
    // Unique across processes and calls: the host, the process, the time and a counter.
    static uint64_t counter = 0;
    uint64_t parts[4] = {(uint64_t)gethostid(), (uint64_t)getpid(),
                         (uint64_t)std::chrono::steady_clock::now().time_since_epoch().count(), ++counter};
    memcpy(id->internal, "nccl stand-in", 13);
    memcpy(id->internal + 16, parts, sizeof(parts));
    return ncclSuccess;
}

ncclResult_t ncclCommInitRankConfig(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank, ncclConfig_t* config) {
    const char* call = "ncclCommInitRankConfig";
    if (!comm) return failure(nullptr, ncclInvalidArgument, true, strprintf("%s: the communicator pointer is NULL", call));
    *comm = nullptr;
    if (group_depth > 0) return failure(nullptr, ncclInvalidUsage, true, strprintf("%s inside a group: beyond the stand-in", call));
    ncclResult_t r = start_mpi();
    if (r == ncclSuccess) r = check_config(nullptr, config, call);
    if (r != ncclSuccess) return r;
    if (nranks < 1 || rank < 0 || rank >= nranks) {
        return failure(nullptr, ncclInvalidArgument, true, strprintf("%s: rank %d of %d is not a rank", call, rank, nranks));
    }
    // Every process tells every other its id and rank; the processes with the same id make one
    // communicator. Every process sees all of it, so all of them agree whether it is valid.
    struct Joining {
        ncclUniqueId id;
        int32_t rank, nranks;
    } mine{id, rank, nranks};
    int world_rank = 0, world_size = 1;
    TRY_MPI(nullptr, MPI_Comm_rank(world, &world_rank));
    TRY_MPI(nullptr, MPI_Comm_size(world, &world_size));
    std::vector<Joining> all((size_t)world_size);
    MPI_Request request;
    TRY_MPI(nullptr, MPI_Iallgather(&mine, sizeof(Joining), MPI_BYTE, all.data(), sizeof(Joining), MPI_BYTE, world, &request));
    r = wait_request(nullptr, &request, strprintf("%s, which every process of MPI_COMM_WORLD must call at the same point "
                                                  "(the stand-in builds communicators over the MPI world)", call));
    if (r != ncclSuccess) {
        new std::vector<Joining>(std::move(all));  // MPI may still write into it
        return r;
    }
    auto same_id = [&](int p, int q) { return memcmp(&all[(size_t)p].id, &all[(size_t)q].id, sizeof(ncclUniqueId)) == 0; };
    int colour = -1;  // the lowest world rank with my id
    for (int p = 0; p < world_size && colour < 0; p++)
        if (same_id(p, world_rank)) colour = p;
    for (int leader = 0; leader < world_size; leader++) {  // every group, checked by every process
        int first = 0;
        while (!same_id(first, leader)) first++;
        if (first != leader) continue;  // not the group's lowest world rank: checked already
        int members = 0;
        std::vector<int> claimed((size_t)all[(size_t)leader].nranks, -1);
        std::string problem;
        for (int p = 0; p < world_size && problem.empty(); p++) {
            if (!same_id(p, leader)) continue;
            members++;
            const Joining& j = all[(size_t)p];
            if (j.nranks != all[(size_t)leader].nranks) {
                problem = strprintf("world ranks %d and %d share a unique id but say nranks %d and %d", leader, p,
                                    all[(size_t)leader].nranks, j.nranks);
            } else if (claimed[(size_t)j.rank] >= 0) {
                problem = strprintf("world ranks %d and %d both say they are rank %d", claimed[(size_t)j.rank], p, j.rank);
            } else {
                claimed[(size_t)j.rank] = p;
            }
        }
        if (problem.empty() && members != all[(size_t)leader].nranks) {
            problem = strprintf("%d process(es) share world rank %d's unique id, but nranks is %d: every rank 0..nranks-1 "
                                "must call it with the same id", members, leader, all[(size_t)leader].nranks);
        }
        if (!problem.empty()) return failure(nullptr, ncclInvalidUsage, world_rank == leader, strprintf("%s: %s", call, problem.c_str()));
    }
    MPI_Comm mpi;
    TRY_MPI(nullptr, MPI_Comm_split(world, colour, rank, &mpi));
    TRY_MPI(nullptr, MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN));
    *comm = make_comm(mpi, config, true);
    return settled(*comm);
}

ncclResult_t ncclCommInitRank(ncclComm_t* comm, int nranks, ncclUniqueId id, int rank) {
    return ncclCommInitRankConfig(comm, nranks, id, rank, nullptr);
}

ncclResult_t ncclCommSplit(ncclComm_t comm, int color, int key, ncclComm_t* newcomm, ncclConfig_t* config) {
    const char* call = "ncclCommSplit";
    ncclResult_t r = check_comm(comm, call);
    if (r != ncclSuccess) return r;
    if (!newcomm) return failure(comm, ncclInvalidArgument, true, strprintf("%s: the new communicator pointer is NULL", call));
    *newcomm = nullptr;
    if (group_depth > 0) return failure(comm, ncclInvalidUsage, true, strprintf("%s inside a group: beyond the stand-in", call));
    if (color < 0 && color != NCCL_SPLIT_NOCOLOR) {
        return failure(comm, ncclInvalidArgument, true, strprintf("%s: color %d is neither >= 0 nor NCCL_SPLIT_NOCOLOR", call, color));
    }
    r = check_config(comm, config, call);
    CallDescription d;
    d.kind = KIND_SPLIT;
    if (r == ncclSuccess) r = agree(comm, d);
    if (r != ncclSuccess) return r;
    MPI_Comm mpi;
    TRY_MPI(comm, MPI_Comm_split(comm->mpi, color == NCCL_SPLIT_NOCOLOR ? MPI_UNDEFINED : color, key, &mpi));
    if (mpi == MPI_COMM_NULL) return ncclSuccess;  // this rank belongs to no new communicator
    TRY_MPI(comm, MPI_Comm_set_errhandler(mpi, MPI_ERRORS_RETURN));
    *newcomm = make_comm(mpi, config, comm->blocking);
    return settled(*newcomm);
}

// Collective, like NCCL's: every rank must have issued the same collectives before it.
ncclResult_t ncclCommFinalize(ncclComm_t comm) {
    ncclResult_t r = check_comm(comm, "ncclCommFinalize");
    if (r != ncclSuccess) return r;
    if (group_depth > 0) return failure(comm, ncclInvalidUsage, true, "ncclCommFinalize inside a group");
    CallDescription d;
    d.kind = KIND_FINALIZE;
    r = agree(comm, d);
    return r == ncclSuccess ? settled(comm) : r;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (!comm) return failure(nullptr, ncclInvalidArgument, true, "ncclCommDestroy: the communicator is NULL");
    TRY_MPI(comm, MPI_Comm_free(&comm->mpi));
    delete comm;
    return ncclSuccess;
}

// Never waits: the MPI communicator is left alone (a peer may still be talking to it).
ncclResult_t ncclCommAbort(ncclComm_t comm) {
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t* asyncError) {
    if (!comm || !asyncError) return failure(nullptr, ncclInvalidArgument, true, "ncclCommGetAsyncError: a NULL argument");
    *asyncError = comm->async;
    return ncclSuccess;
}

const char* ncclGetErrorString(ncclResult_t result) {
    switch (result) {
        case ncclSuccess: return "no error";
        case ncclUnhandledCudaError: return "unhandled cuda error (run with NCCL_DEBUG=INFO for details)";
        case ncclSystemError: return "unhandled system error (run with NCCL_DEBUG=INFO for details)";
        case ncclInternalError: return "internal error - please report this issue to the NCCL developers";
        case ncclInvalidArgument: return "invalid argument (run with NCCL_DEBUG=WARN for details)";
        case ncclInvalidUsage: return "invalid usage (run with NCCL_DEBUG=WARN for details)";
        case ncclRemoteError: return "remote process exited or there was a network error";
        case ncclInProgress: return "NCCL operation in progress";
        default: return "unknown result code";
    }
}

const char* ncclGetLastError(ncclComm_t) { return last_error.c_str(); }

// ----------------------------------------------------------------------------------------------
// Collectives and point to point

ncclResult_t ncclAllReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                           ncclComm_t comm, cudaStream_t stream) {
    Op o{{KIND_ALL_REDUCE, datatype, op, 0, count}, comm, sendbuff, recvbuff, stream};
    ncclResult_t r = check_comm(comm, "ncclAllReduce");
    if (r == ncclSuccess) r = check_op(o, true, count, count, nullptr);
    return r == ncclSuccess ? issue(o) : r;
}

ncclResult_t ncclReduce(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, ncclRedOp_t op,
                        int root, ncclComm_t comm, cudaStream_t stream) {
    Op o{{KIND_REDUCE, datatype, op, root, count}, comm, sendbuff, recvbuff, stream};
    ncclResult_t r = check_comm(comm, "ncclReduce");
    if (r != ncclSuccess) return r;
    if (root < 0 || root >= comm->nranks) return bad_argument(comm, o.call, "the root is not a rank of the communicator");
    bool is_root = comm->rank == root;  // recvbuff matters (and may be NULL elsewhere) only at the root
    r = check_op(o, true, count, is_root ? count : 0, nullptr);
    return r == ncclSuccess ? issue(o) : r;
}

ncclResult_t ncclReduceScatter(const void* sendbuff, void* recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    Op o{{KIND_REDUCE_SCATTER, datatype, op, 0, recvcount}, comm, sendbuff, recvbuff, stream};
    ncclResult_t r = check_comm(comm, "ncclReduceScatter");
    if (r != ncclSuccess) return r;
    const char* in_place = (const char*)recvbuff - (size_t)comm->rank * recvcount * type_bytes(datatype);
    r = check_op(o, true, (size_t)comm->nranks * recvcount, recvcount, in_place);
    return r == ncclSuccess ? issue(o) : r;
}

ncclResult_t ncclAllGather(const void* sendbuff, void* recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
    Op o{{KIND_ALL_GATHER, datatype, 0, 0, sendcount}, comm, sendbuff, recvbuff, stream};
    ncclResult_t r = check_comm(comm, "ncclAllGather");
    if (r != ncclSuccess) return r;
    const char* in_place = (const char*)recvbuff + (size_t)comm->rank * sendcount * type_bytes(datatype);
    r = check_op(o, false, sendcount, (size_t)comm->nranks * sendcount, in_place);
    return r == ncclSuccess ? issue(o) : r;
}

ncclResult_t ncclBroadcast(const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    Op o{{KIND_BROADCAST, datatype, 0, root, count}, comm, sendbuff, recvbuff, stream};
    ncclResult_t r = check_comm(comm, "ncclBroadcast");
    if (r != ncclSuccess) return r;
    if (root < 0 || root >= comm->nranks) return bad_argument(comm, o.call, "the root is not a rank of the communicator");
    r = check_op(o, false, comm->rank == root ? count : 0, count, nullptr);  // sendbuff is read at the root only
    return r == ncclSuccess ? issue(o) : r;
}

static ncclResult_t point_to_point(Kind kind, const void* sendbuff, void* recvbuff, size_t count, ncclDataType_t datatype,
                                   int peer, ncclComm_t comm, cudaStream_t stream) {
    Op o{{kind, datatype, 0, peer, count}, comm, sendbuff, recvbuff, stream};
    ncclResult_t r = check_comm(comm, kind == KIND_SEND ? "ncclSend" : "ncclRecv");
    if (r != ncclSuccess) return r;
    if (peer < 0 || peer >= comm->nranks) return bad_argument(comm, o.call, "the peer is not a rank of the communicator");
    r = check_op(o, false, kind == KIND_SEND ? count : 0, kind == KIND_RECV ? count : 0, nullptr);
    return r == ncclSuccess ? issue(o) : r;
}

ncclResult_t ncclSend(const void* sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream) {
    return point_to_point(KIND_SEND, sendbuff, nullptr, count, datatype, peer, comm, stream);
}

ncclResult_t ncclRecv(void* recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm, cudaStream_t stream) {
    return point_to_point(KIND_RECV, nullptr, recvbuff, count, datatype, peer, comm, stream);
}

ncclResult_t ncclGroupStart() {
    group_depth++;
    return ncclSuccess;
}

// The outermost ncclGroupEnd runs everything queued since the outermost ncclGroupStart.
ncclResult_t ncclGroupEnd() {
    if (group_depth == 0) return failure(nullptr, ncclInvalidUsage, true, "ncclGroupEnd without ncclGroupStart");
    if (--group_depth > 0) return ncclSuccess;
    std::vector<Op> ops;
    ops.swap(queued);
    if (ops.empty()) return ncclSuccess;
    ncclResult_t r = group_capture_problem(ops);
    if (r != ncclSuccess) return r;
    if (ops.front().captured) {
        record(ops);
        return ncclSuccess;
    }
    return run_ops(ops);
}

}  // extern "C"
