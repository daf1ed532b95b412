// capture_check.cu — the CUDA emulation's stream capture and graph replay (cuda_emu_runtime.cpp,
// "Stream capture"), checked against what the real runtime documents: work issued on a capturing
// stream is recorded, not run; cudaGraphLaunch replays it in order, as often as asked; a kernel's
// arguments are kept as they were at the launch (by value), while memory (device, or the pinned
// host source of a captured copy) is read when the graph runs; and the calls a global-mode capture
// forbids return cudaErrorStreamCaptureUnsupported and invalidate it, so that cudaStreamEndCapture
// returns cudaErrorStreamCaptureInvalidated and no graph. Built by emu.mk as build/emu/capture_check
// and run by test/test_cuda_graphs.py; PASS/FAIL lines as test/checks.h prints them.
#include <cuda_runtime.h>
#include <cstdio>
#include <string>
#include <vector>
#include "test/checks.h"

__global__ void axpy(float* y, const float* x, float a, int n) {  // y += a x, a passed by value
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += a * x[i];
}

__global__ void axpy_from_device(float* y, const float* x, const float* a, int n) {  // a read from device memory
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i < n) y[i] += *a * x[i];
}

static const int N = 64;

static std::vector<float> download(const float* d) {
    std::vector<float> h(N);
    cudaMemcpy(h.data(), d, N * sizeof(float), cudaMemcpyDeviceToHost);
    return h;
}

static bool all_equal(const std::vector<float>& v, float want) {
    for (float x : v)
        if (x != want) return false;
    return true;
}

// Begins a capture, makes one forbidden call, and checks how the runtime reports it.
static void check_refused(cudaStream_t s, const char* name, cudaError_t (*forbidden)(cudaStream_t)) {
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    cudaError_t e = forbidden(s);
    cudaStreamCaptureStatus status;
    cudaStreamIsCapturing(s, &status);
    cudaGraph_t g = (cudaGraph_t)1;
    cudaError_t end = cudaStreamEndCapture(s, &g);
    cudaGetLastError();
    check(e == cudaErrorStreamCaptureUnsupported && status == cudaStreamCaptureStatusInvalidated &&
              end == cudaErrorStreamCaptureInvalidated && g == nullptr,
          std::string(name) + " during a capture: cudaErrorStreamCaptureUnsupported, the capture invalidated",
          std::string("the call returned ") + cudaGetErrorName(e) + ", cudaStreamEndCapture " + cudaGetErrorName(end));
}

int main() {
    cudaStream_t s;
    cudaStreamCreate(&s);
    float *x, *y, *a_dev, *host_x;
    cudaMalloc(&x, N * sizeof(float));
    cudaMalloc(&y, N * sizeof(float));
    cudaMalloc(&a_dev, sizeof(float));
    cudaMallocHost(&host_x, N * sizeof(float));
    for (int i = 0; i < N; i++) host_x[i] = 1.0f;
    cudaMemset(y, 0, N * sizeof(float));

    // ---- capture: y = 0; x <- host_x; y += a x (a = 2 at the launch, 5 afterwards); y += a_dev x
    float a = 2.0f;
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    cudaStreamCaptureStatus status;
    cudaStreamIsCapturing(s, &status);
    check(status == cudaStreamCaptureStatusActive, "cudaStreamIsCapturing: active after cudaStreamBeginCapture");
    cudaMemsetAsync(y, 0, N * sizeof(float), s);
    cudaMemcpyAsync(x, host_x, N * sizeof(float), cudaMemcpyHostToDevice, s);
    axpy<<<2, 32, 0, s>>>(y, x, a, N);
    a = 5.0f;  // after the launch: the graph keeps 2
    axpy_from_device<<<2, 32, 0, s>>>(y, x, a_dev, N);
    cudaGraph_t graph = nullptr;
    cudaError_t end = cudaStreamEndCapture(s, &graph);
    check(end == cudaSuccess && graph != nullptr, "cudaStreamEndCapture returns the graph", cudaGetErrorName(end));
    cudaStreamIsCapturing(s, &status);
    check(status == cudaStreamCaptureStatusNone, "cudaStreamIsCapturing: none after cudaStreamEndCapture");
    // The nodes, by type, as the real runtime lists them: a memset, a copy, two kernels.
    size_t count = 0;
    cudaGraphGetNodes(graph, nullptr, &count);
    std::vector<cudaGraphNode_t> nodes(count);
    cudaGraphGetNodes(graph, nodes.data(), &count);
    std::vector<cudaGraphNodeType> types(count);
    for (size_t i = 0; i < count; i++) cudaGraphNodeGetType(nodes[i], &types[i]);
    check(count == 4 && types[0] == cudaGraphNodeTypeMemset && types[1] == cudaGraphNodeTypeMemcpy &&
              types[2] == cudaGraphNodeTypeKernel && types[3] == cudaGraphNodeTypeKernel,
          "the graph holds the captured work in order: memset, copy, kernel, kernel", std::to_string(count) + " nodes");
    check(all_equal(download(y), 0.0f), "captured work is recorded, not run (y is still 0)");

    cudaGraphExec_t exec;
    cudaGraphInstantiate(&exec, graph, 0);
    // replay 1: a_dev = 10, updated by a copy before the launch, as a trainer updates its learning rate
    float a_host = 10.0f;
    cudaMemcpyAsync(a_dev, &a_host, sizeof(float), cudaMemcpyHostToDevice, s);
    cudaGraphLaunch(exec, s);
    cudaStreamSynchronize(s);
    std::vector<float> first = download(y);
    check(all_equal(first, 12.0f), "replay 1: y = 2 x + a_dev x = 12 (the argument as captured, 2, not 5)",
          "y[0] = " + std::to_string(first[0]));
    // replay 2: the host source of the captured copy and the device scalar changed; the graph reads both anew
    for (int i = 0; i < N; i++) host_x[i] = 3.0f;
    a_host = 100.0f;
    cudaMemcpyAsync(a_dev, &a_host, sizeof(float), cudaMemcpyHostToDevice, s);
    cudaGraphLaunch(exec, s);
    cudaStreamSynchronize(s);
    std::vector<float> second = download(y);
    check(all_equal(second, 306.0f), "replay 2: y = 2 x + a_dev x = 306 (memory read at the replay, the argument still 2)",
          "y[0] = " + std::to_string(second[0]));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);

    // ---- a second stream joins the capture (fork: it waits on an event recorded in the capture) and
    // must be joined back (the origin waits on an event recorded on it) before the capture ends, as
    // the trainer's communication stream is in a data-parallel graphed step
    cudaStream_t side;
    cudaStreamCreate(&side);
    cudaEvent_t fork_ev, join_ev;
    cudaEventCreate(&fork_ev);
    cudaEventCreate(&join_ev);
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    cudaMemsetAsync(y, 0, N * sizeof(float), s);
    cudaEventRecord(fork_ev, s);
    cudaStreamWaitEvent(side, fork_ev, 0);
    axpy<<<2, 32, 0, side>>>(y, x, 1.0f, N);  // on the forked stream: recorded, y += x
    cudaStreamIsCapturing(side, &status);
    check(status == cudaStreamCaptureStatusActive, "a stream that waits on a captured event joins the capture (fork)");
    cudaEventRecord(join_ev, side);
    cudaStreamWaitEvent(s, join_ev, 0);
    axpy<<<2, 32, 0, s>>>(y, x, 1.0f, N);  // after the join, on the origin: y += x
    end = cudaStreamEndCapture(s, &graph);
    check(end == cudaSuccess && graph != nullptr, "fork and join: the capture ends with the forked stream's work in the graph",
          cudaGetErrorName(end));
    count = 0;
    if (graph) cudaGraphGetNodes(graph, nullptr, &count);
    cudaGraphInstantiate(&exec, graph, 0);
    cudaGraphLaunch(exec, s);
    cudaStreamSynchronize(s);
    std::vector<float> forked = download(y);  // x holds 3 (replay 2's copy)
    check(count == 3 && all_equal(forked, 6.0f), "fork and join: 3 nodes; the replay runs both streams' work (y = 2 x = 6)",
          std::to_string(count) + " nodes, y[0] = " + std::to_string(forked[0]));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    cudaEventRecord(fork_ev, s);
    cudaStreamWaitEvent(side, fork_ev, 0);
    axpy<<<2, 32, 0, side>>>(y, x, 1.0f, N);  // never joined back
    end = cudaStreamEndCapture(s, &graph);
    cudaGetLastError();
    check(end == cudaErrorStreamCaptureUnjoined && graph == nullptr,
          "a forked stream not joined back: cudaStreamEndCapture returns cudaErrorStreamCaptureUnjoined and no graph",
          cudaGetErrorName(end));
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    cudaEventRecord(fork_ev, s);
    cudaStreamWaitEvent(side, fork_ev, 0);
    cudaError_t side_sync = cudaStreamSynchronize(side);
    end = cudaStreamEndCapture(s, &graph);
    cudaGetLastError();
    check(side_sync == cudaErrorStreamCaptureUnsupported && end == cudaErrorStreamCaptureInvalidated,
          "cudaStreamSynchronize on a forked stream during a capture: refused, the capture invalidated", cudaGetErrorName(side_sync));

    // ---- the calls a global-mode capture forbids
    check_refused(s, "cudaMalloc", [](cudaStream_t) { void* p; return cudaMalloc(&p, 256); });
    check_refused(s, "cudaMemcpy (synchronous)", [](cudaStream_t) {
        static float h[4];
        return cudaMemcpy(h, (const void*)h, sizeof(h), cudaMemcpyHostToHost);
    });
    check_refused(s, "cudaStreamSynchronize", [](cudaStream_t st) { return cudaStreamSynchronize(st); });
    check_refused(s, "cudaDeviceSynchronize", [](cudaStream_t) { return cudaDeviceSynchronize(); });
    // and after them, the stream captures and replays again
    cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal);
    cudaMemsetAsync(y, 0, N * sizeof(float), s);
    end = cudaStreamEndCapture(s, &graph);
    check(end == cudaSuccess && graph != nullptr, "a capture after an invalidated one succeeds", cudaGetErrorName(end));
    cudaGraphDestroy(graph);
    return check_exit_code();
}
