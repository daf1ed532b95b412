// nccl_capture_check.cu — NCCL operations captured into a CUDA graph, under the emulation: the NCCL
// stand-in (nccl_standin.cpp, "CUDA graphs") with the runtime's stream capture (cuda_emu_runtime.cpp),
// checked against what the NCCL user guide ("Using NCCL with CUDA Graphs", NCCL >= 2.9) and the CUDA
// programming guide say: a collective, or a group of sends and receives, issued on a capturing
// stream is recorded, not run; every replay of the graph runs it again, in the graph's order, on the
// buffers it was given at the capture, reading their contents as they are at the replay; and a
// group is one launch, at its ncclGroupEnd, so a group left open across cudaStreamEndCapture, or
// mixing captured and eager operations, is refused with one line. Run on 2 ranks by
// test/test_emu_nccl_graphs.py; PASS/FAIL lines as test/checks.h prints them (rank 0 reports, a
// check passing only if it passed on every rank).
//
// Modes (argv[1]), the test's negative controls, each a bug the checks must catch:
//   stale   the all-reduce is captured with a stale pointer: another buffer than the one the fill
//           kernel writes (the bug of a graph captured before its buffers moved): the sums are
//           wrong and the value checks say so.
//   skip    rank 1's graph lacks the all-reduce (a replay without the NCCL node): rank 0's replay
//           waits for a collective rank 1 never joins, and the stand-in reports the stall.
#define OMPI_SKIP_MPICXX 1
#include <mpi.h>
#include <nccl.h>
#include <cuda_runtime.h>
#include <cstring>
#include <string>
#include <vector>
#include "test/checks.h"

static const int N = 256;

__global__ void fill(float* x, const float* a, float rank_factor, int n) {  // x = a * (rank + 1) * (i % 7): a from memory
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) x[i] = *a * rank_factor * (float)(i % 7);
}

__global__ void add_one(float* y, int n) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += 1.0f;
}

static std::vector<float> download(const float* d) {
    std::vector<float> h(N);
    cudaMemcpy(h.data(), d, N * sizeof(float), cudaMemcpyDeviceToHost);
    return h;
}

// A check passes only where it passed on every rank; rank 0 prints it.
static void check_all(bool ok_here, const std::string& name, const std::string& why, int rank) {
    int bad = ok_here ? 0 : 1, total = 0;
    MPI_Allreduce(&bad, &total, 1, MPI_INT, MPI_SUM, MPI_COMM_WORLD);
    if (rank == 0) check(total == 0, name, why + " (wrong on " + std::to_string(total) + " rank(s))");
    else if (total != 0) check_failures++;
}

int main(int argc, char** argv) {
    MPI_Init(&argc, &argv);
    std::string mode = argc > 1 ? argv[1] : "check";
    int rank = 0, world = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &world);
    ncclUniqueId id;
    if (rank == 0) ncclGetUniqueId(&id);
    MPI_Bcast(&id, sizeof(id), MPI_BYTE, 0, MPI_COMM_WORLD);
    ncclComm_t comm;
    ncclCommInitRank(&comm, world, id, rank);
    cudaStream_t s;
    cudaStreamCreate(&s);
    float *x, *stale, *y, *z, *w, *a_dev;
    for (float** p : {&x, &stale, &y, &z, &w}) cudaMalloc(p, N * sizeof(float));
    cudaMalloc(&a_dev, sizeof(float));
    cudaMemset(y, 0, N * sizeof(float));
    int next = (rank + 1) % world, prev = (rank + world - 1) % world;

    // ---- the capture: x = a (rank+1) (i%7); y = sum over ranks of x; y += 1; z = the previous rank's y
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    fill<<<N / 64, 64, 0, s>>>(x, a_dev, (float)(rank + 1), N);
    ncclResult_t r1 = ncclSuccess;
    if (!(mode == "skip" && rank == 1)) r1 = ncclAllReduce(mode == "stale" ? stale : x, y, N, ncclFloat32, ncclSum, comm, s);
    add_one<<<N / 64, 64, 0, s>>>(y, N);
    ncclGroupStart();
    ncclSend(y, N, ncclFloat32, next, comm, s);
    ncclRecv(z, N, ncclFloat32, prev, comm, s);
    ncclResult_t r2 = ncclGroupEnd();
    cudaGraph_t graph = nullptr;
    cudaError_t end = cudaStreamEndCapture(s, &graph);
    check_all(r1 == ncclSuccess && r2 == ncclSuccess && end == cudaSuccess && graph != nullptr,
              "a captured ncclAllReduce and a captured group of ncclSend/ncclRecv are accepted, and the capture ends",
              std::string(ncclGetErrorString(r1)) + ", " + ncclGetErrorString(r2) + ", " + cudaGetErrorName(end), rank);
    size_t count = 0;
    cudaGraphGetNodes(graph, nullptr, &count);
    std::vector<cudaGraphNode_t> nodes(count);
    cudaGraphGetNodes(graph, nodes.data(), &count);
    bool kernels = true;
    for (cudaGraphNode_t n : nodes) {
        cudaGraphNodeType t;
        cudaGraphNodeGetType(n, &t);
        kernels = kernels && t == cudaGraphNodeTypeKernel;
    }
    if (mode != "skip")
        check_all(count == 4 && kernels, "the graph holds 4 kernel nodes in order: fill, the all-reduce, add_one, the group",
                  std::to_string(count) + " nodes", rank);
    std::vector<float> y_host = download(y);
    bool untouched = true;
    for (float v : y_host) untouched = untouched && v == 0.0f;
    check_all(untouched, "captured collectives are recorded, not run (y is still 0)", "y[1] = " + std::to_string(y_host[1]), rank);

    // ---- replays: a changes in device memory before each; an eager all-reduce between replays keeps its place
    cudaGraphExec_t exec;
    cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphDestroy(graph);
    float rank_sum = (float)(world * (world + 1) / 2);  // sum over ranks of (rank + 1)
    bool replays_ok = true, ring_ok = true, eager_ok = true;
    std::string why;
    for (int replay = 1; replay <= 3; replay++) {
        float a = (float)replay;
        cudaMemcpyAsync(a_dev, &a, sizeof(float), cudaMemcpyHostToDevice, s);
        cudaGraphLaunch(exec, s);
        cudaStreamSynchronize(s);
        std::vector<float> yy = download(y), zz = download(z);
        for (int i = 0; i < N; i++) {
            float want = a * rank_sum * (float)(i % 7) + 1.0f;
            if (yy[i] != want && replays_ok) {
                replays_ok = false;
                why = "replay " + std::to_string(replay) + ": y[" + std::to_string(i) + "] = " + std::to_string(yy[i]) +
                      ", want " + std::to_string(want);
            }
            ring_ok = ring_ok && zz[i] == yy[i];  // every rank has the same sums, so the previous rank's y is ours
        }
        float one = 1.0f;  // an eager all-reduce on the same communicator, between two replays
        cudaMemcpy(w, &one, sizeof(float), cudaMemcpyHostToDevice);
        ncclResult_t re = ncclAllReduce(w, w, 1, ncclFloat32, ncclSum, comm, s);
        float back = 0;
        cudaMemcpy(&back, w, sizeof(float), cudaMemcpyDeviceToHost);
        eager_ok = eager_ok && re == ncclSuccess && back == (float)world;
    }
    check_all(replays_ok, "3 replays: y = a * sum(rank+1) * (i%7) + 1 with each replay's a (read from device memory)", why, rank);
    check_all(ring_ok, "3 replays: the captured group of sends and receives gives each rank the previous rank's y", "", rank);
    check_all(eager_ok, "an eager ncclAllReduce between replays, on the same communicator, gives the world's sum", "", rank);
    ncclResult_t async = ncclSuccess;
    ncclCommGetAsyncError(comm, &async);
    check_all(async == ncclSuccess, "no asynchronous error on the communicator after the replays", ncclGetErrorString(async), rank);
    cudaGraphExecDestroy(exec);
    if (mode != "check") {  // a negative control: its failures are above
        MPI_Finalize();
        return check_exit_code();
    }

    // ---- the rules: a group is one launch, at ncclGroupEnd
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    ncclGroupStart();
    ncclAllReduce(x, y, N, ncclFloat32, ncclSum, comm, s);
    end = cudaStreamEndCapture(s, &graph);
    ncclResult_t open_end = ncclGroupEnd();
    cudaGraphDestroy(graph);
    check_all(open_end == ncclInvalidUsage, "a group left open across cudaStreamEndCapture: ncclGroupEnd refuses it (ncclInvalidUsage)",
              ncclGetErrorString(open_end), rank);
    ncclGroupStart();
    ncclAllReduce(x, y, N, ncclFloat32, ncclSum, comm, s);  // eager
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    ncclAllReduce(x, y, N, ncclFloat32, ncclSum, comm, s);  // captured
    ncclResult_t mixed = ncclGroupEnd();
    end = cudaStreamEndCapture(s, &graph);
    cudaGraphDestroy(graph);
    check_all(mixed == ncclInvalidUsage, "a group mixing eager and captured operations: ncclGroupEnd refuses it (ncclInvalidUsage)",
              ncclGetErrorString(mixed), rank);
    // after both refusals the communicator still works
    float one = 1.0f, back = 0.0f;
    cudaMemcpy(w, &one, sizeof(float), cudaMemcpyHostToDevice);
    ncclResult_t after = ncclAllReduce(w, w, 1, ncclFloat32, ncclSum, comm, s);
    cudaMemcpy(&back, w, sizeof(float), cudaMemcpyDeviceToHost);
    check_all(after == ncclSuccess && back == (float)world, "after the refusals the communicator still sums", "", rank);

    ncclCommDestroy(comm);
    int code = check_exit_code();
    MPI_Finalize();
    return code;
}
