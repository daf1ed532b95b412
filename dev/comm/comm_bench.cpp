// comm_bench.cpp — ./comm_bench: the collectives of llmc/parallel/comm.h (MPI, on the host: what the
// CPU trainer uses) timed and checked. Read dev/comm/comm_bench.h first: the lesson, the flags and
// the harness are there; this file only says how each operation runs over MPI.
//
//     mpirun -np 4 ./comm_bench --max-bytes 256M
#include "dev/comm/comm_bench.h"

struct MpiBackend {
    Comm* comm;
    int rank, ranks;
    const char* transport = "MPI (llmc/parallel/comm.h)";
    std::vector<float> send, recv;  // the buffers the collectives read and write: host memory
    std::vector<CommSend> pending;

    MpiBackend(Comm* c, size_t most) : comm(c), rank(c->rank), ranks(c->world_size), send(most), recv(most) {}

    float* host_send() { return send.data(); }
    float* host_recv() { return recv.data(); }
    void upload(size_t) {}
    void download(size_t) {}
    void wait() {}
    std::vector<double> gather(double x) {
        std::vector<double> all((size_t)ranks, 0.0);
        all[(size_t)rank] = x;
        comm_all_gather(comm, all.data(), sizeof(double), "gathering the results");
        return all;
    }
    void run(int op, size_t count) {
        size_t block = count / (size_t)ranks;
        float* out = recv.data();
        switch (op) {
            case OP_ALL_REDUCE: comm_allreduce_sum(comm, out, count, "all-reduce"); break;
            case OP_REDUCE_SCATTER: comm_reduce_scatter_sum(comm, send.data(), out, block, "reduce-scatter"); break;
            case OP_ALL_GATHER: comm_all_gather(comm, out, block * sizeof(float), "all-gather"); break;
            case OP_ALL_TO_ALL: comm_all_to_all(comm, send.data(), out, block * sizeof(float), "all-to-all"); break;
            case OP_BROADCAST: comm_broadcast(comm, out, count * sizeof(float), 0, "broadcast"); break;
            case OP_SEND_RECV:
                if (ranks == 1) {  // the "next rank" is this one (and a build without MPI cannot send)
                    memcpy(out, send.data(), count * sizeof(float));
                    break;
                }
                // the ring shift of pipeline stages: send on (non-blocking), receive, then finish the send
                comm_send(comm, send.data(), count, (rank + 1) % ranks, 0, &pending, "send-recv (send)");
                comm_recv(comm, out, count, (rank - 1 + ranks) % ranks, 0, "send-recv (receive)");
                comm_wait_sends(comm, &pending);
                break;
        }
    }
};

int main(int argc, char** argv) { return bench_program<MpiBackend>(argc, argv, "./comm_bench"); }
