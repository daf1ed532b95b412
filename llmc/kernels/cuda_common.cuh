// cuda_common.cuh — what every kernel file uses: error checks, the element type, 16-byte vectors,
// stochastic rounding, block reductions, and the deterministic column-sum used by every bias and
// LayerNorm-parameter gradient.
//
// Three habits run through all the kernels:
//   1. Every CUDA/cuBLAS/cuDNN call is checked; a failure prints file:line, the call and the error,
//      and exits. After each kernel launch, CUDA_CHECK_LAUNCH() catches launch errors at the launch,
//      not at some later unrelated call.
//   2. Memory-bound kernels move data in 16-byte vectors (Packed128: 8 bf16 or 4 floats per load):
//      one instruction per 16 bytes instead of 8, and full 128-byte lines per warp.
//   3. No floating-point atomics. A float sum depends on the order of its terms; atomics make that
//      order a race, and two runs with the same seed would differ. Every reduction here has a fixed
//      order: per-block partial sums in a fixed grid, then a second pass that adds them in order.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <cstdint>
#include <type_traits>
#include <cstdio>
#include <cstdlib>

#include "llmc/utils.h"  // bf16_round_stochastic

// ----------------------------------------------------------------------------------------------
// Checks

inline void cuda_check(cudaError_t err, const char* call, const char* file, int line) {
    if (err == cudaSuccess) return;
    fflush(stdout);
    fprintf(stderr, "error: CUDA call failed at %s:%d\n  %s\n  %s: %s\n", file, line, call, cudaGetErrorName(err),
            cudaGetErrorString(err));
    exit(EXIT_FAILURE);
}
#define CUDA_CHECK(call) cuda_check((call), #call, __FILE__, __LINE__)
// After every <<<...>>>: a bad launch configuration is reported at the launch that made it.
#define CUDA_CHECK_LAUNCH() cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

inline int ceil_div(long long a, long long b) { return (int)((a + b - 1) / b); }

// ----------------------------------------------------------------------------------------------
// The element type of parameters, activations and gradients: bf16; fp16 in the loss-scaled build
// (make train_gpt_fp16: 3 more mantissa bits than bf16, a range of 2^-24..65504 that the loss scaler
// of llmc/optim/loss_scaler.h keeps the gradients inside); or fp32 in the debugging build (make
// train_gpt_fp32), which is slower but agrees with the CPU reference to ~1e-5. Every kernel is
// written for floatX, through to_float / from_float / stochastic_round below: these and the
// libraries' type tags (CUDA_FLOATX in matmul.cuh, NCCL_FLOATX in comm_nccl.cuh) are all that differ.

#if defined(LLMC_FP32)
typedef float floatX;
#elif defined(LLMC_FP16)
typedef __half floatX;
#else
typedef __nv_bfloat16 floatX;
#endif
constexpr bool FLOATX_IS_FP32 = sizeof(floatX) == 4;
constexpr bool FLOATX_IS_FP16 = std::is_same<floatX, __half>::value;
constexpr const char* FLOATX_NAME = FLOATX_IS_FP32 ? "fp32" : FLOATX_IS_FP16 ? "fp16" : "bf16";

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(__nv_bfloat16 x) { return __bfloat162float(x); }
__device__ __forceinline__ float to_float(__half x) { return __half2float(x); }
// Round to nearest even: used everywhere except the optimizer's parameter write. fp16: above 65504
// it gives inf, the overflow the loss scaler looks for.
template <class T> __device__ __forceinline__ T from_float(float x);
template <> __device__ __forceinline__ float from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __nv_bfloat16 from_float<__nv_bfloat16>(float x) { return __float2bfloat16_rn(x); }
template <> __device__ __forceinline__ __half from_float<__half>(float x) { return __float2half_rn(x); }

// ----------------------------------------------------------------------------------------------
// 16-byte vectors. Pointers must be 16-byte aligned: every buffer is a cudaMalloc (256-byte aligned)
// and the trainer requires C % 8 == 0, so every row and every layer slice starts on 16 bytes.

template <class T>
struct alignas(16) Packed128 {
    static constexpr int size = 16 / sizeof(T);
    T payload[size];
    __device__ __forceinline__ T& operator[](int i) { return payload[i]; }
    __device__ __forceinline__ const T& operator[](int i) const { return payload[i]; }
    __device__ static __forceinline__ Packed128 zeros() {
        Packed128 p;
        *reinterpret_cast<int4*>(&p) = make_int4(0, 0, 0, 0);
        return p;
    }
};
typedef Packed128<floatX> x128;
typedef Packed128<float> f128;

template <class T> __device__ __forceinline__ Packed128<T> load128(const T* p) {
    return *reinterpret_cast<const Packed128<T>*>(p);
}
// "cache streaming": for data read once, so it does not push reused data out of L2
template <class T> __device__ __forceinline__ Packed128<T> load128cs(const T* p) {
    Packed128<T> r;
    *reinterpret_cast<int4*>(&r) = __ldcs(reinterpret_cast<const int4*>(p));
    return r;
}
template <class T> __device__ __forceinline__ void store128(T* p, const Packed128<T>& v) {
    *reinterpret_cast<Packed128<T>*>(p) = v;
}
template <class T> __device__ __forceinline__ void store128cs(T* p, const Packed128<T>& v) {
    __stcs(reinterpret_cast<int4*>(p), *reinterpret_cast<const int4*>(&v));
}

// ----------------------------------------------------------------------------------------------
// Stochastic rounding. bf16 keeps 8 bits of mantissa; an AdamW update is often smaller than half a
// bf16 ulp of the weight, so round-to-nearest would drop it every time and the weight would never
// move. Rounding up with probability (dropped bits / ulp) makes the rounding unbiased: small
// updates survive on average. The random bits come from a hash of (seed, step, element index), so
// a run is reproducible and a resumed run rounds exactly as the uninterrupted one would.

__host__ __device__ __forceinline__ uint32_t hash_u32(uint64_t x) {  // host too: llmc/optim/offload.cuh
    x ^= x >> 33;
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    x ^= x >> 33;
    return (uint32_t)x;
}

__device__ __forceinline__ void stochastic_round(float* out, float x, uint32_t random) { *out = x; }
__device__ __forceinline__ void stochastic_round(__nv_bfloat16* out, float x, uint32_t random) {
    *out = __ushort_as_bfloat16(bf16_round_stochastic(x, random));  // llmc/utils.h: the host's too
}
// fp16 drops 13 bits of fp32's mantissa where it is normal and more below 2^-14 (subnormal), so the
// bf16 trick of adding random low bits does not carry over; instead: the value toward zero, and
// the next one away from zero with probability (distance / the gap between them).
__device__ __forceinline__ void stochastic_round(__half* out, float x, uint32_t random) {
    __half low = __float2half_rz(x);
    float rest = fabsf(x - __half2float(low));  // exact: low is x with its low bits cut
    if ((__float_as_uint(x) & 0x7f800000u) == 0x7f800000u || rest == 0.0f) {  // inf/nan, or exactly representable
        *out = __float2half_rn(x);
        return;
    }
    __half high = __ushort_as_half((unsigned short)(__half_as_ushort(low) + 1));  // one ulp further from zero
    float gap = fabsf(__half2float(high) - __half2float(low));
    *out = (float)(random >> 8) * 0x1p-24f * gap < rest ? high : low;
}

// ----------------------------------------------------------------------------------------------
// Reductions within a warp and a block: a fixed butterfly, so the order of the sum is fixed too.

// (templates: float here, double for the factored optimizers' sums, llmc/optim/adafactor.cuh)
template <class T> __device__ __forceinline__ T warp_sum(T v) {
    for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int offset = 16; offset > 0; offset >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, offset));
    return v;
}

// Sum over the block (blockDim.x a multiple of 32, at most 1024); every thread gets the result.
// `shared` holds 32 values. Ends with a barrier, so it can be called again right away.
template <class T> __device__ __forceinline__ T block_sum(T v, T* shared) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_sum(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : T(0);
    v = warp_sum(v);
    __syncthreads();
    return v;
}
__device__ __forceinline__ float block_max(float v, float* shared) {
    int lane = threadIdx.x % 32, warp = threadIdx.x / 32, warps = blockDim.x / 32;
    v = warp_max(v);
    if (lane == 0) shared[warp] = v;
    __syncthreads();
    v = lane < warps ? shared[lane] : -INFINITY;
    v = warp_max(v);
    __syncthreads();
    return v;
}

// ----------------------------------------------------------------------------------------------
// The second pass of every deterministic column sum (bias gradients, LayerNorm weight and bias
// gradients): out[c] += sum over p of partials[p * stride + c], p in order. One thread per column;
// consecutive threads read consecutive columns, so each partial row is read coalesced.
// Traffic: parts x n floats read, n values read and written.

__global__ void add_column_partials_kernel(floatX* out, const float* partials, int parts, size_t stride, int n) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= n) return;
    float sum = 0.0f;
    for (int p = 0; p < parts; p++) sum += partials[(size_t)p * stride + c];
    out[c] = from_float<floatX>(to_float(out[c]) + sum);
}

inline void add_column_partials(floatX* out, const float* partials, int parts, size_t stride, int n, cudaStream_t stream) {
    add_column_partials_kernel<<<ceil_div(n, 256), 256, 0, stream>>>(out, partials, parts, stride, n);
    CUDA_CHECK_LAUNCH();
}

// ----------------------------------------------------------------------------------------------
// dst[i] += src[i], rounded once: a gradient that arrived from elsewhere joins the one accumulated
// here (a pipeline's tied embedding, ZeRO-2/3's reduced shard of each micro-batch). n % 8 == 0.

__global__ void add_into_kernel(floatX* dst, const floatX* src, size_t n) {
    size_t i = ((size_t)blockIdx.x * blockDim.x + threadIdx.x) * x128::size;
    if (i >= n) return;
    x128 d8 = load128(dst + i), s8 = load128cs(src + i);
    for (int k = 0; k < x128::size; k++) d8[k] = from_float<floatX>(to_float(d8[k]) + to_float(s8[k]));
    store128(dst + i, d8);
}

inline void add_into(floatX* dst, const floatX* src, size_t n, cudaStream_t stream) {
    if (n == 0) return;
    add_into_kernel<<<ceil_div(n / x128::size, 256), 256, 0, stream>>>(dst, src, n);
    CUDA_CHECK_LAUNCH();
}
