// stream_capture.h — what the emulated runtime tells the library stand-ins and the launch template
// about CUDA graphs' stream capture (cuda_emu_runtime.cpp implements it; README.md, "Stream capture").
//
// Between cudaStreamBeginCapture and cudaStreamEndCapture a stream's work is recorded, not run: a
// kernel launch, an async copy or set, a cuBLAS(Lt) call, each becomes a node of the graph that
// cudaGraphLaunch replays in order. Every piece of stream work therefore goes through stream_work:
// it runs at once, or is recorded when its stream is being captured. `work` must hold by value
// everything it reads that the caller could change afterwards (descriptors, host scalars): the
// real runtime copies a kernel's arguments and a library call's host-side parameters at capture.
#pragma once

#include <cuda_runtime.h>
#include <functional>

namespace emu {

bool stream_capturing(cudaStream_t stream);  // is `stream` being captured (and the capture still valid)?
void stream_work(cudaStream_t stream, const char* what, int node_type, std::function<void()> work);

}  // namespace emu
