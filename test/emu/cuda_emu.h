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

// Code that must know it runs emulated tests this (the kernel lab: no timing, see dev/cuda/common.h).
#define CUDA_EMU 1

#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <tuple>
#include <type_traits>
#include "stream_capture.h"

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

// The launch's arguments, evaluated now and converted to the kernel's parameter types, as the real
// runtime copies them at the launch (cu2cpp.py writes `emu::bind_args(K, args)` for `K<<<...>>>(args)`).
// So a captured launch replays with the values its arguments had at capture, on a GPU and here.
template <class... P, class... A> auto bind_args(void (*kernel)(P...), A&&... args) {
    return [kernel, values = std::tuple<typename std::decay<P>::type...>(std::forward<A>(args)...)]() {
        std::apply(kernel, values);  // each CUDA thread gets its own copy of the parameters
    };
}

// The launch checks the real runtime makes at the launch (captured or not); false: reported
// through cudaGetLastError. A captured launch is recorded with its arguments (`body`, by value).
bool launch_config_ok(const void* kernel, const char* name, const char* file, int line, dim3 grid, dim3 block,
                      size_t dynamic_smem);

template <class F>
void launch(const void* kernel, const char* name, const char* file, int line, F&& body, dim3 grid, dim3 block,
            size_t dynamic_smem = 0, cudaStream_t stream = 0) {
    using Body = typename std::remove_reference<F>::type;
    if (stream_capturing(stream)) {
        if (!launch_config_ok(kernel, name, file, line, grid, block, dynamic_smem)) return;
        auto kept = std::make_shared<Body>(body);
        stream_work(stream, name, cudaGraphNodeTypeKernel, [=]() {
            launch_grid(kernel, name, file, line, &call_closure<Body>, (void*)kept.get(), grid, block, dynamic_smem, 0);
        });
        return;
    }
    launch_grid(kernel, name, file, line, &call_closure<Body>, (void*)&body, grid, block, dynamic_smem, stream);
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

// ---------------------------------------------------------------------------------------------
// WMMA (nvcuda::wmma, CUDA's <mma.h>, empty in host mode): the subset dev/cuda/matmul.cu uses, as
// CUDA documents it. Fragments are opaque on a GPU (each lane holds some elements, in a mapping
// nobody may rely on); here each lane holds the whole tile, row-major. load_matrix_sync,
// store_matrix_sync and mma_sync are warp collectives: all 32 lanes must call them, with the same
// pointer, stride and layout (checked: a lane that has exited, is in another collective or passes
// another pointer stops the run, which on a GPU is undefined behaviour). mptr must be 256-bit
// aligned and ldm a multiple of 16 bytes. mma_sync computes D = A B + C once per warp (fp32
// products and sums, k in order) and checks that every lane holds the same A, B and C. A store
// writes each element from one lane only (lane = element index % 32), so a lane that reads the
// stored tile before a __syncwarp sees what the other lanes have not written yet.
namespace emu {
// A per-warp buffer for the result of the collective that just completed; returns true for the
// one lane that must compute it (the first to run on), false for the others, which reuse it.
bool warp_result(size_t bytes, void** buffer);
}  // namespace emu

namespace nvcuda {
namespace wmma {
struct row_major;
struct col_major;
struct matrix_a;
struct matrix_b;
struct accumulator;
enum layout_t { mem_row_major, mem_col_major };

// rows x cols of the tile a fragment holds: A is M x K, B is K x N, C and D are M x N
template <class Use, int M, int N, int K> struct emu_tile;
template <int M, int N, int K> struct emu_tile<matrix_a, M, N, K> { enum { rows = M, cols = K }; };
template <int M, int N, int K> struct emu_tile<matrix_b, M, N, K> { enum { rows = K, cols = N }; };
template <int M, int N, int K> struct emu_tile<accumulator, M, N, K> { enum { rows = M, cols = N }; };

template <class Use, int M, int N, int K, class T, class Layout = void> struct fragment {
    static_assert((M == 16 && N == 16 && K == 16) || (M == 32 && N == 8 && K == 16) || (M == 8 && N == 32 && K == 16),
                  "the emulated WMMA has the 16-bit shapes only: m16n16k16, m32n8k16, m8n32k16");
    static_assert(std::is_same<Use, accumulator>::value ? std::is_same<T, float>::value
                                                        : std::is_same<T, __nv_bfloat16>::value ||
                                                              std::is_same<T, __half>::value,
                  "the emulated WMMA multiplies bf16 or half A and B into a float accumulator");
    static_assert(std::is_same<Use, accumulator>::value || !std::is_same<Layout, void>::value,
                  "a matrix_a or matrix_b fragment needs a row_major or col_major layout");
    enum { rows = emu_tile<Use, M, N, K>::rows, cols = emu_tile<Use, M, N, K>::cols, num_elements = rows * cols };
    T x[num_elements];
};

inline float emu_float(float v) { return v; }
inline float emu_float(__nv_bfloat16 v) { return __bfloat162float(v); }
inline float emu_float(__half v) { return __half2float(v); }

// The collective every load, store and mma starts with: all 32 lanes arrive (or the run stops),
// then each compares what it was given with lane 0's.
inline void emu_collective(const char* what, const void* p, unsigned ldm, int layout, size_t element_bytes,
                           const char* file, int line) {
    if (p && ((uintptr_t)p % 32 != 0 || ldm * element_bytes % 16 != 0))
        emu::fail("%s at %s:%d: the pointer %p must be 32-byte aligned and ldm (%u elements of %zu bytes) a multiple of "
                  "16 bytes", what, file, line, p, ldm, element_bytes);
    uint64_t key = (uint64_t)(uintptr_t)p ^ ((uint64_t)ldm << 48) ^ ((uint64_t)layout << 62);
    if (emu::warp_exchange(0xffffffffu, key, 0, what, file, line) != key)
        emu::fail("%s at %s:%d: lane %d passes another pointer, stride or layout than lane 0 (all must be the same)", what,
                  file, line, emu::lane_id());
}

template <class Use, int M, int N, int K, class T, class L>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, T v) {  // not a collective: each lane fills its own
    for (int i = 0; i < f.num_elements; i++) f.x[i] = v;
}
template <class Use, int M, int N, int K, class T, class L, class V>
inline void fill_fragment(fragment<Use, M, N, K, T, L>& f, V v) {
    fill_fragment(f, (T)v);
}

template <class F, class T> inline void emu_load(F& f, const T* p, unsigned ldm, bool row_major_memory) {
    for (int r = 0; r < F::rows; r++)
        for (int c = 0; c < F::cols; c++) f.x[r * F::cols + c] = row_major_memory ? p[(size_t)r * ldm + c] : p[(size_t)c * ldm + r];
}
template <class Use, int M, int N, int K, class T, class L>
inline void load_matrix_sync(fragment<Use, M, N, K, T, L>& f, const T* p, unsigned ldm, const char* file = __builtin_FILE(),
                             int line = __builtin_LINE()) {
    static_assert(!std::is_same<Use, accumulator>::value, "loading an accumulator needs a layout_t");
    bool rows = std::is_same<L, row_major>::value;
    emu_collective("wmma::load_matrix_sync", p, ldm, rows ? 0 : 1, sizeof(T), file, line);
    emu_load(f, p, ldm, rows);
}
template <int M, int N, int K, class T>
inline void load_matrix_sync(fragment<accumulator, M, N, K, T>& f, const T* p, unsigned ldm, layout_t layout,
                             const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    emu_collective("wmma::load_matrix_sync", p, ldm, layout, sizeof(T), file, line);
    emu_load(f, p, ldm, layout == mem_row_major);
}

template <int M, int N, int K, class T>
inline void store_matrix_sync(T* p, const fragment<accumulator, M, N, K, T>& f, unsigned ldm, layout_t layout,
                              const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    using F = fragment<accumulator, M, N, K, T>;
    emu_collective("wmma::store_matrix_sync", p, ldm, layout, sizeof(T), file, line);
    for (int i = emu::lane_id(); i < F::num_elements; i += 32) {  // this lane's share of the elements
        int r = i / F::cols, c = i % F::cols;
        p[layout == mem_row_major ? (size_t)r * ldm + c : (size_t)c * ldm + r] = f.x[i];
    }
}

template <int M, int N, int K, class TA, class LA, class LB, class TC>
inline void mma_sync(fragment<accumulator, M, N, K, TC>& d, const fragment<matrix_a, M, N, K, TA, LA>& a,
                     const fragment<matrix_b, M, N, K, TA, LB>& b, const fragment<accumulator, M, N, K, TC>& c,
                     const char* file = __builtin_FILE(), int line = __builtin_LINE()) {
    using A = fragment<matrix_a, M, N, K, TA, LA>;
    using B = fragment<matrix_b, M, N, K, TA, LB>;
    using C = fragment<accumulator, M, N, K, TC>;
    struct Shared { A a; B b; C c, d; };  // the inputs of the lane that computed, and D
    emu_collective("wmma::mma_sync", nullptr, 0, 0, 1, file, line);
    void* buffer;
    Shared* s;
    if (emu::warp_result(sizeof(Shared), &buffer)) {
        s = (Shared*)buffer;
        s->a = a;
        s->b = b;
        s->c = c;
        for (int i = 0; i < M; i++)
            for (int j = 0; j < N; j++) {
                float acc = s->c.x[i * N + j];
                for (int k = 0; k < K; k++) acc += emu_float(s->a.x[i * K + k]) * emu_float(s->b.x[k * N + j]);
                s->d.x[i * N + j] = acc;
            }
    } else {
        s = (Shared*)buffer;
        if (memcmp(&s->a, &a, sizeof(A)) || memcmp(&s->b, &b, sizeof(B)) || memcmp(&s->c, &c, sizeof(C)))
            emu::fail("wmma::mma_sync at %s:%d: lane %d holds other A, B or C fragments than its warp's other lanes "
                      "(fragments are loaded, filled and computed by the whole warp alike)", file, line, emu::lane_id());
    }
    d = s->d;
}

}  // namespace wmma
}  // namespace nvcuda
