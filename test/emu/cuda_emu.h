// cuda_emu.h — the device side of the CUDA emulator: what a kernel sees when our .cu files are
// compiled by g++ instead of nvcc and run on the CPU (see test/emu/README.md).
//
// Force-included (g++ -include) before every emulated .cu file, after test/emu/cu2cpp.py has turned
// each `K<<<grid, block, smem, stream>>>(args)` into `emu::launch(...)` and each `__shared__`
// declaration into storage this file manages. Execution model, in one paragraph:
//   every CUDA thread is a fiber with its own stack; the blocks of a grid run one after another;
//   within a block, the scheduler runs each thread until it blocks (at __syncthreads, at a warp
//   collective) or exits, then the next, in an order chosen by CUDA_EMU_THREADS (forward, reverse or
//   random:SEED). A barrier opens when every thread of the block that has not exited waits at it; a
//   warp collective completes when every lane its mask names has arrived. So code that is only
//   correct if threads run in lock step, or that reads shared memory another thread has not yet
//   written, gives different answers under different orders: the tests run every check under two.
// Nothing here is linked into a shipped binary: it is test infrastructure.
#pragma once

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <type_traits>

namespace emu {

// ---------------------------------------------------------------------------------------------
// The running thread and its block (defined in cuda_emu_runtime.cpp)

struct Thread {
    void* sp = nullptr;    // saved stack pointer while switched out
    uint3 idx;             // threadIdx
    int linear = 0;        // index within the block
    int state = 0;         // see runtime
    unsigned ticket = 0;   // the warp collective generation it waits for
    const char* site_file = nullptr;  // where it waits (for the divergent-barrier message)
    int site_line = 0;
};

struct Launch;  // the grid being run
extern Thread* current;  // the CUDA thread now running (nullptr on the host)
extern uint3 block_idx;
extern dim3 block_dim, grid_dim;

// Host code that dereferences a device pointer, or a kernel that runs off the end of an
// allocation, faults on a guard page; the runtime's handler names the kernel, block and thread.
[[noreturn]] void fail(const char* fmt, ...) __attribute__((format(printf, 1, 2)));

// Blocking points: each switches back to the scheduler.
void syncthreads(const char* file, int line);
uint64_t warp_exchange(unsigned mask, uint64_t value, int source_lane, const char* what, const char* file, int line);
unsigned warp_ballot(unsigned mask, bool predicate, const char* file, int line);
void syncwarp(unsigned mask, const char* file, int line);

// Shared memory: static __shared__ arrays are function-local statics (one copy, reused by the
// blocks one after another); each block's first touch fills them with NaN bytes, so a read of
// shared memory that no thread of this block wrote shows up as NaN instead of the last block's data.
void shared_first_touch(void* p, size_t bytes, const char* file, int line);
void* dynamic_shared_memory();

// A launch: `run_thread` is called once per CUDA thread, on that thread's fiber.
typedef void (*ThreadEntry)(void* closure);
void launch_grid(const void* kernel, const char* name, const char* file, int line, ThreadEntry entry, void* closure,
                 dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream);

template <class F> void call_closure(void* f) { (*(F*)f)(); }

template <class F>
void launch(const void* kernel, const char* name, const char* file, int line, F&& body, dim3 grid, dim3 block,
            size_t dynamic_smem = 0, cudaStream_t stream = 0) {
    launch_grid(kernel, name, file, line, &call_closure<typename std::remove_reference<F>::type>, (void*)&body, grid,
                block, dynamic_smem, stream);
}
template <class K> const void* kernel_address(K* k) { return (const void*)k; }

// __launch_bounds__(N): cu2cpp moves it into the kernel's body as this check. A launch with more
// threads per block than N fails on a GPU ("too many resources requested for launch").
void check_launch_bounds(int max_threads, const char* file, int line);

inline int lane_id() { return current->linear & 31; }

}  // namespace emu

// cuda_runtime.h's typed overload exists only under nvcc
template <class T> inline cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
    return cudaFuncSetAttribute((const void*)kernel, attr, value);
}

// ---------------------------------------------------------------------------------------------
// Built-in variables

#define threadIdx (emu::current->idx)
#define blockIdx (emu::block_idx)
#define blockDim (emu::block_dim)
#define gridDim (emu::grid_dim)
constexpr int warpSize = 32;

// ---------------------------------------------------------------------------------------------
// Barriers and warp collectives

#define __syncthreads() emu::syncthreads(__FILE__, __LINE__)
#define __syncwarp(...) emu::syncwarp(emu_mask_or_full(__VA_ARGS__), __FILE__, __LINE__)
inline unsigned emu_mask_or_full(unsigned mask = 0xffffffffu) { return mask; }
inline void __threadfence() {}
inline void __threadfence_block() {}

template <class T> inline uint64_t emu_bits(T v) {
    static_assert(sizeof(T) <= 8, "warp shuffles move at most 8 bytes");
    uint64_t b = 0;
    memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> inline T emu_from_bits(uint64_t b) {
    T v;
    memcpy(&v, &b, sizeof(T));
    return v;
}
// width: lanes form groups of `width`; a source outside the group wraps (shfl) or stays put (up/down)
template <class T> inline T emu_shfl(unsigned mask, T v, int src, const char* what, const char* file, int line) {
    return emu_from_bits<T>(emu::warp_exchange(mask, emu_bits(v), src, what, file, line));
}
#define __shfl_sync(mask, v, src, ...) emu_shfl_sync_at(mask, v, src, emu_width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_xor_sync(mask, v, m, ...) emu_shfl_xor_at(mask, v, m, emu_width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_down_sync(mask, v, d, ...) emu_shfl_down_at(mask, v, d, emu_width(__VA_ARGS__), __FILE__, __LINE__)
#define __shfl_up_sync(mask, v, d, ...) emu_shfl_up_at(mask, v, d, emu_width(__VA_ARGS__), __FILE__, __LINE__)
inline int emu_width(int w = 32) { return w; }
template <class T> inline T emu_shfl_sync_at(unsigned mask, T v, int src, int width, const char* f, int l) {
    int lane = emu::lane_id(), base = lane & ~(width - 1);
    return emu_shfl(mask, v, base + (src & (width - 1)), "__shfl_sync", f, l);
}
template <class T> inline T emu_shfl_xor_at(unsigned mask, T v, int lane_mask, int width, const char* f, int l) {
    int lane = emu::lane_id(), base = lane & ~(width - 1);
    int src = lane ^ lane_mask;
    if (src >= base + width) src = lane;
    return emu_shfl(mask, v, src, "__shfl_xor_sync", f, l);
}
template <class T> inline T emu_shfl_down_at(unsigned mask, T v, unsigned delta, int width, const char* f, int l) {
    int lane = emu::lane_id(), base = lane & ~(width - 1);
    int src = lane + (int)delta < base + width ? lane + (int)delta : lane;
    return emu_shfl(mask, v, src, "__shfl_down_sync", f, l);
}
template <class T> inline T emu_shfl_up_at(unsigned mask, T v, unsigned delta, int width, const char* f, int l) {
    int lane = emu::lane_id(), base = lane & ~(width - 1);
    int src = lane - (int)delta >= base ? lane - (int)delta : lane;
    return emu_shfl(mask, v, src, "__shfl_up_sync", f, l);
}
#define __ballot_sync(mask, pred) emu::warp_ballot(mask, (pred) != 0, __FILE__, __LINE__)
#define __any_sync(mask, pred) (emu::warp_ballot(mask, (pred) != 0, __FILE__, __LINE__) != 0u)
#define __all_sync(mask, pred) (emu::warp_ballot(mask, (pred) != 0, __FILE__, __LINE__) == (unsigned)(mask))

// ---------------------------------------------------------------------------------------------
// Atomics. Fibers switch only at barriers and collectives, so a read-modify-write is never
// interrupted: these are atomic as written.

template <class T> inline T atomicAdd(T* p, T v) { T old = *p; *p = old + v; return old; }
template <class T> inline T atomicSub(T* p, T v) { T old = *p; *p = old - v; return old; }
template <class T> inline T atomicMax(T* p, T v) { T old = *p; *p = old > v ? old : v; return old; }
template <class T> inline T atomicMin(T* p, T v) { T old = *p; *p = old < v ? old : v; return old; }
template <class T> inline T atomicExch(T* p, T v) { T old = *p; *p = v; return old; }
template <class T> inline T atomicCAS(T* p, T compare, T v) { T old = *p; if (old == compare) *p = v; return old; }
inline unsigned atomicInc(unsigned* p, unsigned limit) { unsigned old = *p; *p = old >= limit ? 0 : old + 1; return old; }

// ---------------------------------------------------------------------------------------------
// Intrinsics: bit casts, the fast-math forms (computed exactly here: the GPU's approximations
// differ in the last bits, which only a real GPU can show), cache-hinted loads and stores.

inline unsigned __float_as_uint(float x) { unsigned u; memcpy(&u, &x, 4); return u; }
inline float __uint_as_float(unsigned u) { float x; memcpy(&x, &u, 4); return x; }
inline int __float_as_int(float x) { int u; memcpy(&u, &x, 4); return u; }
inline float __int_as_float(int u) { float x; memcpy(&x, &u, 4); return x; }
inline long long __double_as_longlong(double x) { long long u; memcpy(&u, &x, 8); return u; }
inline double __longlong_as_double(long long u) { double x; memcpy(&x, &u, 8); return x; }
// The _rn forms round once and are never contracted into an FMA: volatile keeps g++ from fusing.
inline float __fmul_rn(float a, float b) { volatile float r = a * b; return r; }
inline float __fadd_rn(float a, float b) { volatile float r = a + b; return r; }
inline float __fsub_rn(float a, float b) { volatile float r = a - b; return r; }
inline float __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __frcp_rn(float a) { return 1.0f / a; }
inline float __expf(float x) { return std::exp(x); }
inline float __logf(float x) { return std::log(x); }
inline float __powf(float a, float b) { return std::pow(a, b); }
inline float __sinf(float x) { return std::sin(x); }
inline float __cosf(float x) { return std::cos(x); }
inline float __tanhf(float x) { return std::tanh(x); }
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz((unsigned)x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline long long clock64() { return (long long)__builtin_ia32_rdtsc(); }
inline void __nanosleep(unsigned) {}
inline int min(int a, int b) { return a < b ? a : b; }
inline int max(int a, int b) { return a > b ? a : b; }
inline unsigned min(unsigned a, unsigned b) { return a < b ? a : b; }
inline unsigned max(unsigned a, unsigned b) { return a > b ? a : b; }
inline long long min(long long a, long long b) { return a < b ? a : b; }
inline long long max(long long a, long long b) { return a > b ? a : b; }
inline size_t min(size_t a, size_t b) { return a < b ? a : b; }
inline size_t max(size_t a, size_t b) { return a > b ? a : b; }
// mixed signedness: CUDA's overloads convert to unsigned, as C's usual conversions do
inline unsigned min(int a, unsigned b) { return min((unsigned)a, b); }
inline unsigned min(unsigned a, int b) { return min(a, (unsigned)b); }
inline unsigned max(int a, unsigned b) { return max((unsigned)a, b); }
inline unsigned max(unsigned a, int b) { return max(a, (unsigned)b); }
inline float min(float a, float b) { return fminf(a, b); }
inline float max(float a, float b) { return fmaxf(a, b); }
template <class T> inline T __ldg(const T* p) { return *p; }
template <class T> inline T __ldcs(const T* p) { return *p; }
template <class T> inline T __ldcg(const T* p) { return *p; }
template <class T> inline T __ldlu(const T* p) { return *p; }
template <class T> inline void __stcs(T* p, T v) { *p = v; }
template <class T> inline void __stcg(T* p, T v) { *p = v; }
template <class T> inline void __stwt(T* p, T v) { *p = v; }
