// parameter_server.h — data parallelism through one rank: the parameter server, and why the ring won.
//
// What it teaches. Data parallelism needs every rank to step with the sum of all ranks' gradients.
// The first large systems (DistBelief, Dean et al. 2012; Li et al., "Scaling Distributed Machine
// Learning with the Parameter Server", OSDI 2014) did it with a server: the workers push their
// gradients to it, it adds them and steps the optimizer, and it sends the new weights back. It is
// the simplest picture of data parallelism, and this file runs it (--data-parallel server) so that
// its traffic can be measured beside the all-reduce (--data-parallel allreduce, llmc/parallel/zero.h).
//
// The math is the same as the all-reduce's: with N ranks and P weights, g = g_0 + g_1 + ... + g_{N-1},
// then clip and AdamW on g. Here rank 0 is the server AND a worker (it computes its own g_0, as in
// every rank of the all-reduce), so the run's batch, gradient and weights are the all-reduce's.
//
// Bit for bit. The all-reduce of ZeRO-0 here is MPI's reduce-scatter (each shard summed by one rank)
// then an all-gather. MPI promises the sum but not the order of the additions. The server adds in
// rank order, ((g_0 + g_1) + g_2) + ..., the order Open MPI's reduce-scatter used in the runs we
// checked (test/test_parameter_server.py compares the two bit for bit at 2 and 3 ranks on this
// machine's Open MPI; with 2 ranks any order gives the same bits, as a + b == b + a exactly). The
// gradient norm is the all-reduce's too: the sum of squares of each rank's shard of the sum, added
// in rank order (comm_sum's order), so clipping and the bad-step test see the same number.
//
// The traffic (the lecture's slide), bytes b = 4 per fp32 value, per step:
//     server (rank 0)   receives (N-1) P b of gradients, sends (N-1) P b of weights: 2 (N-1) P b
//     a worker          sends P b, receives P b
//     ring all-reduce   every rank sends 2 (N-1)/N P b and receives as much, over its own links
// The server's load grows with N while the ring's stays below 2 P b per direction: at N = 2 the
// server sends what a ring rank sends (P b), at N = 3 twice the weights against 4/3, at N = 64 sixty-
// three times against under 2. The run's end prints the server's bytes (llmc/probes/
// cpu_memory_report.h's table counts what each rank sent; the server counts what it received).
//
// Memory: no new buffer. The server receives each worker's gradient in pieces the size of its
// reduce-scatter shard, into zero.grad_shard (which the all-reduce would have used), and adds each
// piece into its own gradient; the workers keep AdamW's m and v allocated but never touch them (a
// real server would keep the optimizer state on the server alone: the saving is (N-1) x 8P bytes).
//
// Hooks: finish_gradients (the data-parallel sum: parameter_server_gather on every rank, the norm
// on the server) and optimizer_step (AdamW on the server, then parameter_server_send_weights).
// With ZeRO, tensor or pipeline parallelism, or gradient compression it is refused (--data-parallel
// server teaches the traffic of plain data parallelism; those shard or shrink what is sent).
#pragma once

#include <cmath>
#include <cstring>
#include <string>
#include <vector>
#include "llmc/parallel/comm.h"
#include "llmc/parallel/process_grid.h"

struct ParameterServer {
    bool on = false;              // --data-parallel server
    Comm* dp = nullptr;           // the data-parallel group; its rank 0 is the server
    uint64_t received_bytes = 0;  // gradients the server received in the last step (what it sent is in dp's counters)
    std::vector<CommSend> sends;  // a worker's pieces in flight
};

inline bool parameter_server_is_server(const ParameterServer& ps) { return ps.dp->rank == 0; }

// The refusals, before anything is allocated (one line each; the trainer exits 2).
inline std::string parameter_server_problem(bool on, const ProcessGrid& g, bool compressed) {
    if (!on) return "";
    if (g.zero_stage != 0)
        return strprintf("--data-parallel server with --zero %d: ZeRO shards what the server would hold whole; use --zero 0 "
                         "or --data-parallel allreduce", g.zero_stage);
    if (g.tp > 1 || g.pp > 1)
        return "--data-parallel server teaches plain data parallelism: tensor and pipeline ranks hold slices of the model; "
               "drop --tensor-parallel/--pipeline-parallel or use --data-parallel allreduce";
    if (compressed)
        return "--data-parallel server sends the exact fp32 gradients: use --grad-compression none, or --data-parallel allreduce";
    return "";
}

// The pieces the gradient travels in: the reduce-scatter's shard size (the server's one buffer).
template <class Piece>
inline void parameter_server_pieces(size_t total, size_t piece, Piece fn) {
    for (size_t off = 0, k = 0; off < total; off += piece, k++) fn(off, std::min(piece, total - off), (int)k);
}

// Every rank's gradient to the server, which adds them in rank order into its own `grads`.
// `inbox` (piece floats) is where a worker's piece lands on the server. The workers' grads are left
// as they were (their own): only the server's is the sum.
inline void parameter_server_gather(ParameterServer* ps, float* grads, size_t total, float* inbox, size_t piece) {
    Comm* dp = ps->dp;
    ps->received_bytes = 0;
    if (dp->world_size == 1) return;
    if (!parameter_server_is_server(*ps)) {
        parameter_server_pieces(total, piece, [&](size_t off, size_t n, int k) {
            comm_send(dp, grads + off, n, 0, k, &ps->sends, "sending the gradients to the parameter server");
        });
        comm_wait_sends(dp, &ps->sends);
        return;
    }
    for (int r = 1; r < dp->world_size; r++) {   // rank order: the order of the additions
        parameter_server_pieces(total, piece, [&](size_t off, size_t n, int k) {
            comm_recv(dp, inbox, n, r, k, "the parameter server receiving gradients");
            ps->received_bytes += n * sizeof(float);
            float* g = grads + off;
            for (size_t i = 0; i < n; i++) g[i] += inbox[i];
        });
    }
}

// The server's updated weights to every worker (MPI_Bcast: the counters charge (N-1) P b to the root).
inline void parameter_server_send_weights(ParameterServer* ps, float* params, size_t total) {
    comm_broadcast(ps->dp, params, total * sizeof(float), 0, "the parameter server sending the weights");
}

// What --estimate predicts each rank of the data-parallel group sends per step (rank 0 the weights to
// N-1 workers; a worker its gradient once).
inline uint64_t parameter_server_bytes(size_t total, int N, int dp_rank) {
    if (N == 1) return 0;
    return dp_rank == 0 ? (uint64_t)(N - 1) * total * sizeof(float) : (uint64_t)total * sizeof(float);
}

// The slide's comparison, from the run's counters (printed by rank 0 after the last step): the bytes
// through the busiest data-parallel rank. The server is rank 0; with the all-reduce every rank is as
// busy, and a ring rank receives what it sends (each piece it sends, its neighbour receives).
inline void parameter_server_report(const ParameterServer& ps, const CommCounters& rank0_sent, size_t total) {
    int N = ps.dp->world_size;
    uint64_t weights = (uint64_t)total * sizeof(float), sent = rank0_sent.total_bytes();
    if (ps.on) {
        printf("data-parallel traffic of the last step through the busiest rank, the server (rank 0): received %llu bytes "
               "of gradients + sent %llu bytes of weights = %llu bytes, 2 (N-1) = %d x the %llu bytes of weights, all through one rank\n",
               (unsigned long long)ps.received_bytes, (unsigned long long)sent,
               (unsigned long long)(ps.received_bytes + sent), 2 * (N - 1), (unsigned long long)weights);
    } else {
        printf("data-parallel traffic of the last step through the busiest rank (each rank alike): sent %llu bytes + received "
               "as many = %llu bytes, %.3f x the %llu bytes of weights (a ring: 4 (N-1)/N)\n", (unsigned long long)sent,
               (unsigned long long)(2 * sent), 2.0 * (double)sent / (double)weights, (unsigned long long)weights);
    }
}
