// cudnn_standin.cpp — cuDNN under the CPU emulation: present, but it refuses every graph.
//
// cuDNN's fused attention is a closed engine we cannot reproduce on the CPU, so emulated runs use
// `--attention simple` (our own kernels plus cuBLAS). What this stand-in does test is the
// trainer's behaviour when cuDNN is there but cannot build the attention graph (an old version,
// an unsupported GPU or shape): every descriptor can be created and given attributes, and every
// finalize answers CUDNN_STATUS_NOT_SUPPORTED, as a real cuDNN does for a graph it has no engine
// for. The trainer must then say so in one line and fall back to the simple attention.
#include <cudnn.h>
#include <cstdio>

namespace {
struct Descriptor { cudnnBackendDescriptorType_t type; };
struct Handle { int unused; };
const char* last_error = "";
}

extern "C" {

size_t cudnnGetVersion() { return CUDNN_VERSION; }
const char* cudnnGetErrorString(cudnnStatus_t status) {
    switch (status) {
        case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
        case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
        case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
        default: return "CUDNN_STATUS (emulated cuDNN)";
    }
}
void cudnnGetLastErrorString(char* message, size_t max_size) {
    if (max_size) snprintf(message, max_size, "%s", last_error);
}
cudnnStatus_t cudnnCreate(cudnnHandle_t* handle) {
    *handle = (cudnnHandle_t) new Handle();
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
    delete (Handle*)handle;
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnSetStream(cudnnHandle_t, cudaStream_t) { return CUDNN_STATUS_SUCCESS; }
cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t type, cudnnBackendDescriptor_t* d) {
    *d = (cudnnBackendDescriptor_t) new Descriptor{type};
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t d) {
    delete (Descriptor*)d;
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t,
                                       int64_t, const void*) {
    return CUDNN_STATUS_SUCCESS;
}
cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t) {
    last_error = "the CPU emulation of CUDA has no cuDNN engines";
    return CUDNN_STATUS_NOT_SUPPORTED;
}
cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t, cudnnBackendAttributeName_t, cudnnBackendAttributeType_t,
                                       int64_t, int64_t* count, void*) {
    if (count) *count = 0;
    return CUDNN_STATUS_NOT_SUPPORTED;
}
cudnnStatus_t cudnnBackendExecute(cudnnHandle_t, cudnnBackendDescriptor_t, cudnnBackendDescriptor_t) {
    return CUDNN_STATUS_NOT_SUPPORTED;
}

}  // extern "C"
