// comm_bench.cu — ./comm_bench_gpu: the collectives of llmc/parallel/comm_nccl.cuh (NCCL between GPUs,
// or host-staged MPI when ranks share a GPU: what the GPU trainer uses) timed and checked. Read
// dev/comm/comm_bench.h first: the lesson, the flags and the harness are there; this file only says
// how each operation runs on GPUs. One GPU per rank (local rank % GPUs), as the trainer picks them.
//
//     mpirun -np 8 ./comm_bench_gpu                 8 GPUs over NCCL
//     mpirun -np 2 ./comm_bench_gpu                 one GPU shared: the host-staged path
//
// NCCL only enqueues: run() returns at once and wait() is where the time is spent. The inputs are
// written on the host and copied to the GPU once per size, outside the timed calls.
#include "dev/comm/comm_bench.h"
#include "llmc/parallel/comm_nccl.cuh"

struct NcclBackend {
    GpuComm gpu_comm;
    GpuComm* g = &gpu_comm;
    int rank, ranks;
    const char* transport = "";
    float *send = nullptr, *recv = nullptr;  // device buffers
    std::vector<float> host_in, host_out;    // the harness's inputs and results on the host
    std::vector<GpuStagedSend> staged;       // host-staged sends in flight

    // Picks this rank's GPU, builds the communicator, and allocates `most` floats per buffer.
    NcclBackend(Comm* host, size_t most) : rank(host->rank), ranks(host->world_size) {
        gpu_comm_init(g, host);
        transport = ranks == 1 ? "one GPU" : g->host_staged ? "host-staged MPI (ranks share a GPU)" : "NCCL";
        GPU_COMM_CUDA(g, cudaMalloc(&send, most * sizeof(float)), "allocating the buffers");
        GPU_COMM_CUDA(g, cudaMalloc(&recv, most * sizeof(float)), "allocating the buffers");
        host_in.assign(most, 0.0f);
        host_out.assign(most, 0.0f);
    }
    ~NcclBackend() {
        GPU_COMM_CUDA(g, cudaFree(send), "freeing the buffers");
        GPU_COMM_CUDA(g, cudaFree(recv), "freeing the buffers");
        gpu_comm_finalize(g);
    }

    float* host_send() { return host_in.data(); }
    float* host_recv() { return host_out.data(); }
    void upload(size_t count) {
        GPU_COMM_CUDA(g, cudaMemcpy(send, host_in.data(), count * sizeof(float), cudaMemcpyHostToDevice), "uploading the inputs");
        GPU_COMM_CUDA(g, cudaMemcpy(recv, host_out.data(), count * sizeof(float), cudaMemcpyHostToDevice), "uploading the inputs");
    }
    void download(size_t count) {
        GPU_COMM_CUDA(g, cudaMemcpy(host_out.data(), recv, count * sizeof(float), cudaMemcpyDeviceToHost), "downloading the results");
    }
    void wait() { gpu_comm_wait(g, "waiting for the timed calls"); }
    std::vector<double> gather(double x) { return gpu_comm_gather(g, x, "gathering the results"); }
    void run(int op, size_t count) {
        size_t block = count / (size_t)ranks;
        switch (op) {
            case OP_ALL_REDUCE: gpu_all_reduce_sum(g, recv, count, ncclFloat32, "all-reduce"); break;
            case OP_REDUCE_SCATTER: gpu_reduce_scatter_sum(g, send, recv, block, ncclFloat32, "reduce-scatter"); break;
            case OP_ALL_GATHER: gpu_all_gather(g, recv, block, ncclFloat32, "all-gather"); break;
            case OP_ALL_TO_ALL: gpu_all_to_all(g, send, recv, block * sizeof(float), "all-to-all"); break;
            case OP_BROADCAST: gpu_broadcast(g, recv, count * sizeof(float), 0, "broadcast"); break;
            case OP_SEND_RECV:
                if (ranks == 1) {  // NCCL has no communicator for one rank: the "next rank" is this one
                    GPU_COMM_CUDA(g, cudaMemcpyAsync(recv, send, count * sizeof(float), cudaMemcpyDeviceToDevice, g->stream), "send-recv");
                    break;
                }
                // the ring shift of pipeline stages; grouped, so that neighbours that both send first
                // do not wait for each other (see gpu_send in comm_nccl.cuh)
                gpu_group_begin(g, "send-recv");
                gpu_send(g, send, count * sizeof(float), (rank + 1) % ranks, 0, &staged, "send-recv (send)");
                gpu_recv(g, recv, count * sizeof(float), (rank - 1 + ranks) % ranks, 0, "send-recv (receive)");
                gpu_group_end(g, "send-recv");
                gpu_wait_sends(g, &staged);
                break;
        }
    }
};

int main(int argc, char** argv) { return bench_program<NcclBackend>(argc, argv, "./comm_bench_gpu"); }
