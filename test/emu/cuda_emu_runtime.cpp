// cuda_emu_runtime.cpp — the host side of the CUDA emulator: the CUDA runtime calls our code makes
// (memory, copies, streams, events, properties, launch checks) and the scheduler that runs a grid's
// threads as fibers. Linked instead of libcudart into the emulated builds (see README.md here).
//
// Device memory: each cudaMalloc is its own mapping, placed so that the allocation ends (rounded
// up to 256 bytes, so that it starts 256-byte aligned as a real one does) right at a page the
// emulator keeps unreadable: a kernel that reads or writes past the end faults there, and the fault
// handler names the kernel, block, thread and the allocation. New allocations are filled with 0xff
// bytes: NaN as float and bf16, so reading memory nobody wrote shows up in the results. The padding
// between the requested size and the 256-byte rounding is filled too, and checked after every
// launch (check_padding): an access just past the end that stops short of the guard page shows up
// as a NaN read or a named write. cudaFree unmaps, so a use after free faults too. cudaMemGetInfo
// reports CUDA_EMU_DEVICE_MEMORY (default 80 GiB, an H100). CUDA_EMU_COMPUTE_CAPABILITY (default
// 9.0, an H100; e.g. 8.0 for an A100) is what cudaGetDeviceProperties reports, so a refusal of an
// older GPU (fp8 needs 8.9) can be tested.
//
// Streams and events: every operation runs when it is issued, in issue order. That is one legal
// order of a real GPU's work, so results are right, but a missing cudaStreamWaitEvent between
// two streams cannot show up here: only a real GPU can test concurrency. A stream being captured
// into a CUDA graph records its operations instead ("Stream capture" below).
//
// Schedules: CUDA_EMU_THREADS = forward | reverse | random:SEED orders the threads of a block;
// CUDA_EMU_BLOCKS the same for the blocks of a grid. A kernel whose output depends on either is
// racy; the tests run each check under two schedules and compare.
#include "test/emu/cuda_emu.h"

#include <algorithm>
#include <cstdarg>
#include <csignal>
#include <chrono>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>
#include <sys/mman.h>
#include <unistd.h>

namespace emu {

Thread* current = nullptr;
uint3 block_idx;
dim3 block_dim, grid_dim;

// ---------------------------------------------------------------------------------------------
// Failures. An emulated run stops at the first error it finds, with one message saying where:
// a real GPU would report most of these later as a sticky "unspecified launch failure".

static const char* running_kernel = nullptr;  // name, file, line of the launch being run
static const char* running_file = nullptr;
static int running_line = 0;

static void where(char* out, size_t n) {
    if (!running_kernel) {
        snprintf(out, n, "host code");
        return;
    }
    if (current)
        snprintf(out, n, "kernel %s (launched at %s:%d), block (%u,%u,%u), thread (%u,%u,%u)", running_kernel,
                 running_file, running_line, block_idx.x, block_idx.y, block_idx.z, current->idx.x, current->idx.y,
                 current->idx.z);
    else
        snprintf(out, n, "kernel %s (launched at %s:%d)", running_kernel, running_file, running_line);
}

void fail(const char* fmt, ...) {
    char msg[1024], at[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof(msg), fmt, ap);
    va_end(ap);
    where(at, sizeof(at));
    fflush(stdout);
    fprintf(stderr, "CUDA emulator: %s\n  in %s\n", msg, at);
    _exit(1);
}

// ---------------------------------------------------------------------------------------------
// Fibers: a context switch is saving the callee-saved registers and the stack pointer of one
// stack and restoring those of another (System V x86-64). Much cheaper than swapcontext, which
// makes a system call for the signal mask on every switch.

extern "C" void emu_switch(void** save_sp, void* load_sp);
extern "C" void emu_fiber_start();
asm(R"(
.text
.globl emu_switch
.type emu_switch,@function
emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
.size emu_switch,.-emu_switch
.globl emu_fiber_start
.type emu_fiber_start,@function
emu_fiber_start:
    movq %r12, %rdi
    callq *%r13
    ud2
.size emu_fiber_start,.-emu_fiber_start
)");

static void* scheduler_sp = nullptr;
// All 1024 stacks in one region backed by huge pages: a block's scheduling pass touches the top of
// every stack, and with 4 KiB pages those 1024 pages would thrash the TLB (measured: half the run
// time in the first instructions after a switch). The price is no guard page between stacks; a
// kernel's frames are small (CUDA threads have little stack), and a canary at the bottom of each
// stack catches an overflow at the end of the block.
static constexpr size_t FIBER_STACK_BYTES = 64 * 1024, MAX_FIBERS = 1024;
static constexpr uint64_t STACK_CANARY = 0x5354414b43414e59ull;
static char* fiber_stacks = nullptr;

static char* fiber_stack(int i) {
    if (!fiber_stacks) {
        size_t bytes = FIBER_STACK_BYTES * MAX_FIBERS;
        fiber_stacks = (char*)mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
        if (fiber_stacks == MAP_FAILED) fail("cannot map the fiber stacks");
        madvise(fiber_stacks, bytes, MADV_HUGEPAGE);
        for (size_t f = 0; f < MAX_FIBERS; f++) memcpy(fiber_stacks + f * FIBER_STACK_BYTES, &STACK_CANARY, 8);
    }
    return fiber_stacks + (size_t)i * FIBER_STACK_BYTES;
}

static void check_stack_canaries(int n) {
    for (int i = 0; i < n; i++)
        if (memcmp(fiber_stacks + (size_t)i * FIBER_STACK_BYTES, &STACK_CANARY, 8) != 0)
            fail("thread %d overflowed its %zu KiB emulated stack (large local arrays?)", i, FIBER_STACK_BYTES / 1024);
}

// ---------------------------------------------------------------------------------------------
// The block being run

enum { RUNNABLE, AT_BARRIER, AT_WARP, EXITED };

struct Warp {
    unsigned exists = 0;     // lanes the block has (the last warp may be partial)
    unsigned live = 0;       // lanes that have not exited
    unsigned arrived = 0;    // lanes waiting in the current collective
    unsigned mask = 0;       // the mask the current collective was called with
    unsigned generation = 0; // collectives completed
    const char* what = nullptr;
    const char* file = nullptr;
    int line = 0;
    uint64_t values[2][32];  // double-buffered by generation parity
    unsigned result_of = 0;  // 1 + the generation whose result `result` holds (warp_result)
    std::vector<char> result;
};

static std::vector<Thread> threads;
static std::vector<Warp> warps;
static int block_threads = 0, live_threads = 0, at_barrier = 0;
static ThreadEntry thread_entry;
static void* thread_closure;
static std::vector<char> dynamic_smem;
static std::vector<void*> touched_shared;  // static __shared__ arrays poisoned for this block
static std::vector<void*> launch_shared;   // ... and those this launch has used (for its size)
static size_t static_smem_bytes = 0;       // of this launch's kernel, as first touched
static size_t launch_dynamic_smem = 0;

static void yield_to_scheduler() { emu_switch(&current->sp, scheduler_sp); }

static void fiber_main(void*) {
    thread_entry(thread_closure);
    Thread* t = current;
    t->state = EXITED;
    live_threads--;
    Warp& w = warps[t->linear / 32];
    unsigned bit = 1u << (t->linear % 32);
    w.live &= ~bit;
    // Lanes already waiting in a collective whose mask names this lane would wait forever (on a GPU:
    // undefined behaviour, a hang or garbage). Say so at the exit, naming the collective, rather than
    // as a "deadlock" later (a lane that exits BEFORE the others call it is caught in warp_arrive).
    if (w.arrived && (w.mask & bit))
        fail("a lane exited while lanes 0x%08x of its warp wait for it in %s at %s:%d: the mask 0x%08x names "
             "lanes that exit", w.arrived, w.what, w.file, w.line, w.mask);
    emu_switch(&t->sp, scheduler_sp);
    __builtin_unreachable();
}

static void start_fiber(Thread* t) {
    // The first switch into a fiber "returns" into emu_fiber_start with r12 = argument, r13 = function.
    // Stacks 64 KiB apart would put every thread's hot frames in the same few cache sets: stagger the
    // tops by a few cache lines each (up to 16 KiB).
    char* top = fiber_stack(t->linear) + FIBER_STACK_BYTES - (size_t)(t->linear * 13 % 256) * 64;
    void** sp = (void**)(top - 24);  // emu_fiber_start runs with rsp 16-byte aligned
    *sp = (void*)&emu_fiber_start;
    sp -= 6;
    sp[0] = nullptr;              // r15
    sp[1] = nullptr;              // r14
    sp[2] = (void*)&fiber_main;   // r13
    sp[3] = nullptr;              // r12
    sp[4] = nullptr;              // rbx
    sp[5] = nullptr;              // rbp
    t->sp = sp;
}

void syncthreads(const char* file, int line) {
    Thread* t = current;
    t->state = AT_BARRIER;
    t->site_file = file;
    t->site_line = line;
    at_barrier++;
    yield_to_scheduler();
}

// Every lane of `mask` deposits a value; when the last one arrives the collective completes and
// each reads the value of its source lane. Lanes of one warp call the same collective, with the
// same mask, and every lane named must be alive: anything else is undefined on a GPU and an
// error here.
static Warp* warp_arrive(unsigned mask, uint64_t value, const char* what, const char* file, int line) {
    Thread* t = current;
    int lane = t->linear % 32;
    Warp* w = &warps[t->linear / 32];
    if (!(mask & (1u << lane))) fail("%s at %s:%d: the mask 0x%08x does not include the calling lane %d", what, file, line, mask, lane);
    if (mask & ~w->live) {
        if (mask & ~w->exists)
            fail("%s at %s:%d: the mask 0x%08x names lanes that do not exist (the block has %d threads)", what, file,
                 line, mask, block_threads);
        fail("%s at %s:%d: the mask 0x%08x names lanes that have exited (live lanes 0x%08x)", what, file, line, mask,
             w->live);
    }
    if (w->arrived == 0) {
        w->mask = mask;
        w->what = what;
        w->file = file;
        w->line = line;
    } else if (w->mask != mask || w->what != what || w->line != line || (w->file != file && strcmp(w->file, file) != 0)) {
        fail("lanes of one warp in different collectives: %s at %s:%d (mask 0x%08x) and %s at %s:%d (mask 0x%08x)",
             w->what, w->file, w->line, w->mask, what, file, line, mask);
    }
    w->values[w->generation & 1][lane] = value;
    w->arrived |= 1u << lane;
    t->ticket = w->generation;
    if (w->arrived == mask) {  // the last one: complete it
        w->arrived = 0;
        w->generation++;
    } else {
        t->state = AT_WARP;
        yield_to_scheduler();
    }
    return w;
}

uint64_t warp_exchange(unsigned mask, uint64_t value, int source_lane, const char* what, const char* file, int line) {
    Warp* w = warp_arrive(mask, value, what, file, line);
    unsigned parity = current->ticket & 1;
    if (!(mask & (1u << source_lane)))
        fail("%s at %s:%d: lane %d reads lane %d, which the mask 0x%08x leaves out", what, file, line,
             current->linear % 32, source_lane, mask);
    return w->values[parity][source_lane];
}

unsigned warp_ballot(unsigned mask, bool predicate, const char* file, int line) {
    Warp* w = warp_arrive(mask, predicate, "__ballot_sync", file, line);
    unsigned parity = current->ticket & 1, bits = 0;
    for (int l = 0; l < 32; l++)
        if ((mask & (1u << l)) && w->values[parity][l]) bits |= 1u << l;
    return bits;
}

void syncwarp(unsigned mask, const char* file, int line) { warp_arrive(mask, 0, "__syncwarp", file, line); }

// Generations count on through the blocks of a launch and the Warps are new at each launch, so
// `result_of` can only match the collective the calling lane has just completed.
bool warp_result(size_t bytes, void** buffer) {
    Warp* w = &warps[current->linear / 32];
    bool first = w->result_of != current->ticket + 1;
    if (first) {
        w->result.resize(bytes);
        w->result_of = current->ticket + 1;
    }
    *buffer = w->result.data();
    return first;
}

void check_launch_bounds(int max_threads, const char* file, int line) {
    if (block_threads > max_threads)
        fail("too many resources requested for launch: %d threads per block, over the kernel's __launch_bounds__(%d) "
             "at %s:%d", block_threads, max_threads, file, line);
}

// ---------------------------------------------------------------------------------------------
// Shared memory

void shared_first_touch(void* p, size_t bytes, const char* file, int line) {
    if (std::find(touched_shared.begin(), touched_shared.end(), p) != touched_shared.end()) return;
    touched_shared.push_back(p);
    memset(p, 0xff, bytes);
    if (std::find(launch_shared.begin(), launch_shared.end(), p) != launch_shared.end()) return;
    launch_shared.push_back(p);
    static_smem_bytes += bytes;
    if (static_smem_bytes + launch_dynamic_smem > 48 * 1024)
        fail("%zu bytes of static and %zu of dynamic shared memory: static shared memory is limited to 48 KiB",
             static_smem_bytes, launch_dynamic_smem);
}

void* dynamic_shared_memory() {
    if (launch_dynamic_smem == 0) fail("the kernel uses extern __shared__ memory but was launched with 0 bytes of it");
    return dynamic_smem.data();
}

// ---------------------------------------------------------------------------------------------
// Schedules

struct Order {
    int kind = 0;  // 0 forward, 1 reverse, 2 random
    std::mt19937_64 rng;
};
static Order thread_order, block_order;
static bool orders_read = false;

static void read_order(const char* var, Order* o) {
    const char* s = getenv(var);
    if (!s || !*s || !strcmp(s, "forward")) return;
    if (!strcmp(s, "reverse")) {
        o->kind = 1;
        return;
    }
    if (!strncmp(s, "random", 6)) {
        o->kind = 2;
        o->rng.seed(s[6] == ':' ? strtoull(s + 7, nullptr, 10) : 1);
        return;
    }
    fprintf(stderr, "CUDA emulator: %s=%s: expected forward, reverse or random:SEED\n", var, s);
    exit(2);
}

static void arrange(Order* o, std::vector<int>* v) {
    for (int i = 0; i < (int)v->size(); i++) (*v)[i] = i;
    if (o->kind == 1) std::reverse(v->begin(), v->end());
    if (o->kind == 2) std::shuffle(v->begin(), v->end(), o->rng);
}

// ---------------------------------------------------------------------------------------------
// Launch

static cudaError_t last_error = cudaSuccess;  // what cudaGetLastError returns (and clears)
static std::map<const void*, int> max_dynamic_smem;  // cudaFuncSetAttribute's opt-ins
static constexpr size_t SMEM_DEFAULT = 48 * 1024, SMEM_OPTIN_MAX = 227 * 1024;

static void run_block(std::vector<int>& order) {
    for (int i = 0; i < block_threads; i++) {
        Thread& t = threads[i];
        t.state = RUNNABLE;
        start_fiber(&t);
    }
    for (int w = 0; w < (int)warps.size(); w++) {
        int lanes = std::min(32, block_threads - w * 32);
        warps[w].live = warps[w].exists = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
        warps[w].arrived = 0;
    }
    live_threads = block_threads;
    at_barrier = 0;
    touched_shared.clear();
    if (launch_dynamic_smem) memset(dynamic_smem.data(), 0xff, launch_dynamic_smem);
    while (live_threads > 0) {
        bool progress = false;
        if (thread_order.kind == 2) arrange(&thread_order, &order);
        for (int i : order) {
            Thread* t = &threads[i];
            if (t->state == AT_WARP && warps[t->linear / 32].generation != t->ticket) t->state = RUNNABLE;
            if (t->state != RUNNABLE) continue;
            current = t;
            emu_switch(&scheduler_sp, t->sp);
            current = nullptr;
            progress = true;
        }
        if (live_threads > 0 && at_barrier == live_threads) {  // every live thread waits: open the barrier
            const Thread* first = nullptr;
            for (Thread& t : threads) {
                if (t.state != AT_BARRIER) continue;
                if (!first) first = &t;
                else if (t.site_line != first->site_line || strcmp(t.site_file, first->site_file) != 0)
                    fail("threads wait at different __syncthreads: thread %d at %s:%d, thread %d at %s:%d", first->linear,
                         first->site_file, first->site_line, t.linear, t.site_file, t.site_line);
                t.state = RUNNABLE;
            }
            at_barrier = 0;
            progress = true;
        }
        if (!progress) {
            for (Thread& t : threads)
                if (t.state == AT_WARP)
                    fail("deadlock: thread %d waits in %s at %s:%d for lanes that never arrive", t.linear,
                         warps[t.linear / 32].what, warps[t.linear / 32].file, warps[t.linear / 32].line);
            for (Thread& t : threads)
                if (t.state == AT_BARRIER)
                    fail("deadlock: thread %d waits at __syncthreads (%s:%d) while others wait in a warp collective",
                         t.linear, t.site_file, t.site_line);
            fail("deadlock");
        }
    }
}

static void check_padding(const char* found);  // (Device memory, below)

// The launch checks the real runtime makes at the launch (also when the launch is captured into a
// graph); it reports them through cudaGetLastError.
bool launch_config_ok(const void* kernel, const char* name, const char* file, int line, dim3 grid, dim3 block,
                      size_t dynamic_smem_bytes) {
    if (current) fail("a kernel launch from device code (%s): dynamic parallelism is not used here", name);
    unsigned long long nthreads = (unsigned long long)block.x * block.y * block.z;
    if (block.x == 0 || block.y == 0 || block.z == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0 || block.x > 1024 ||
        block.y > 1024 || block.z > 64 || nthreads > 1024 || grid.y > 65535 || grid.z > 65535 || grid.x > 2147483647u) {
        fprintf(stderr, "CUDA emulator: %s at %s:%d: invalid configuration grid (%u,%u,%u) block (%u,%u,%u)\n", name, file,
                line, grid.x, grid.y, grid.z, block.x, block.y, block.z);
        last_error = cudaErrorInvalidConfiguration;
        return false;
    }
    size_t allowed = SMEM_DEFAULT;
    auto it = max_dynamic_smem.find(kernel);
    if (it != max_dynamic_smem.end()) allowed = (size_t)it->second;
    if (dynamic_smem_bytes > allowed) {
        fprintf(stderr,
                "CUDA emulator: %s at %s:%d: %zu bytes of dynamic shared memory, over the %zu allowed (above 48 KiB "
                "needs cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes))\n",
                name, file, line, dynamic_smem_bytes, allowed);
        last_error = cudaErrorInvalidValue;
        return false;
    }
    return true;
}

void launch_grid(const void* kernel, const char* name, const char* file, int line, ThreadEntry entry, void* closure,
                 dim3 grid, dim3 block, size_t dynamic_smem_bytes, cudaStream_t stream) {
    if (!orders_read) {
        read_order("CUDA_EMU_THREADS", &thread_order);
        read_order("CUDA_EMU_BLOCKS", &block_order);
        orders_read = true;
    }
    if (!launch_config_ok(kernel, name, file, line, grid, block, dynamic_smem_bytes)) return;
    unsigned long long nthreads = (unsigned long long)block.x * block.y * block.z;
    char before[256];  // a library stand-in or host code wrote it, not this kernel: say so
    snprintf(before, sizeof(before), "before %s was launched (by host code or a library call)", name);
    check_padding(before);
    running_kernel = name;
    running_file = file;
    running_line = line;
    thread_entry = entry;
    thread_closure = closure;
    block_threads = (int)nthreads;
    block_dim = block;
    grid_dim = grid;
    threads.assign(block_threads, Thread());
    warps.assign((block_threads + 31) / 32, Warp());
    for (int i = 0; i < block_threads; i++) {
        threads[i].linear = i;
        threads[i].idx = make_uint3(i % block.x, (i / block.x) % block.y, i / (block.x * block.y));
    }
    launch_dynamic_smem = dynamic_smem_bytes;
    static_smem_bytes = 0;
    launch_shared.clear();
    dynamic_smem.assign(dynamic_smem_bytes, 0);
    std::vector<int> order(block_threads);
    arrange(&thread_order, &order);
    size_t nblocks = (size_t)grid.x * grid.y * grid.z;
    std::vector<int> blocks_in_order;
    if (block_order.kind != 0) {  // a permutation of the grid (grids here are small enough to list)
        blocks_in_order.resize(nblocks);
        arrange(&block_order, &blocks_in_order);
    }
    for (size_t b = 0; b < nblocks; b++) {
        size_t id = block_order.kind != 0 ? (size_t)blocks_in_order[b] : b;
        block_idx = make_uint3(id % grid.x, (id / grid.x) % grid.y, id / ((size_t)grid.x * grid.y));
        run_block(order);
    }
    check_stack_canaries(block_threads);
    check_padding("when the kernel had run");
    running_kernel = nullptr;
}

// ---------------------------------------------------------------------------------------------
// Device memory

struct Allocation {
    char* map;          // the mapping (with its guard page at the end)
    size_t map_bytes;
    size_t bytes;       // what was asked for
    bool device;
};
static std::map<uintptr_t, Allocation> allocations;  // by user pointer
static size_t device_used = 0, device_total = 0;
static int device_count = 1, device_current = 0;

static size_t parse_bytes(const char* s) {
    char* end;
    double v = strtod(s, &end);
    switch (*end) {
        case 'K': case 'k': v *= 1024.0; break;
        case 'M': case 'm': v *= 1024.0 * 1024; break;
        case 'G': case 'g': v *= 1024.0 * 1024 * 1024; break;
        default: break;
    }
    return (size_t)v;
}

static void segv_handler(int sig, siginfo_t* info, void*);

static void init_device() {
    if (device_total) return;
    const char* mem = getenv("CUDA_EMU_DEVICE_MEMORY");
    device_total = mem && *mem ? parse_bytes(mem) : (size_t)80 << 30;
    const char* n = getenv("CUDA_EMU_DEVICES");
    if (n && *n) device_count = atoi(n);
    // The fault handler runs on its own stack: a fiber stack that overflowed has no room left.
    static char alt_stack[64 * 1024];
    stack_t ss{};
    ss.ss_sp = alt_stack;
    ss.ss_size = sizeof(alt_stack);
    sigaltstack(&ss, nullptr);
    struct sigaction sa{};
    sa.sa_sigaction = segv_handler;
    sa.sa_flags = SA_SIGINFO | SA_ONSTACK;
    sigaction(SIGSEGV, &sa, nullptr);
    sigaction(SIGBUS, &sa, nullptr);
}

static const Allocation* find_allocation(const void* p, uintptr_t* base) {
    uintptr_t a = (uintptr_t)p;
    auto it = allocations.upper_bound(a);
    if (it == allocations.begin()) return nullptr;
    --it;
    if (a >= (uintptr_t)it->second.map + it->second.map_bytes) return nullptr;
    *base = it->first;
    return &it->second;
}

static void segv_handler(int sig, siginfo_t* info, void*) {
    char at[512], msg[1024];
    where(at, sizeof(at));
    uintptr_t base = 0;
    const Allocation* a = find_allocation(info->si_addr, &base);
    if (a)
        snprintf(msg, sizeof(msg), "an access at %p, %lld bytes past the start of a %zu-byte %s allocation", info->si_addr,
                 (long long)((uintptr_t)info->si_addr - base), a->bytes, a->device ? "cudaMalloc" : "host");
    else
        snprintf(msg, sizeof(msg), "an invalid memory access at %p (not in any live allocation: freed, or never one)",
                 info->si_addr);
    // async-signal-safe enough: we exit right after
    fprintf(stderr, "CUDA emulator: %s\n  in %s\n", msg, at);
    _exit(1);
}

static cudaError_t allocate(void** out, size_t bytes, bool device) {
    init_device();
    if (!out) return cudaErrorInvalidValue;
    if (device && device_used + bytes > device_total) {
        *out = nullptr;
        return last_error = cudaErrorMemoryAllocation;
    }
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t rounded = (std::max<size_t>(bytes, 1) + 255) / 256 * 256;  // cudaMalloc's alignment
    size_t data_pages = (rounded + page - 1) / page * page;
    size_t map_bytes = data_pages + page;
    char* map = (char*)mmap(nullptr, map_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (map == MAP_FAILED) {
        *out = nullptr;
        return last_error = cudaErrorMemoryAllocation;
    }
    mprotect(map + data_pages, page, PROT_NONE);
    char* user = map + data_pages - rounded;
    memset(user, 0xff, rounded);  // the padding up to 256 bytes too: see check_padding
    allocations[(uintptr_t)user] = Allocation{map, map_bytes, bytes, device};
    if (device) device_used += bytes;
    *out = user;
    return cudaSuccess;
}

static cudaError_t release(void* p, bool device) {
    if (!p) return cudaSuccess;
    auto it = allocations.find((uintptr_t)p);
    if (it == allocations.end() || it->second.device != device) {
        fprintf(stderr, "CUDA emulator: %s(%p): not a pointer %s returned\n", device ? "cudaFree" : "cudaFreeHost", p,
                device ? "cudaMalloc" : "cudaMallocHost");
        return cudaErrorInvalidValue;
    }
    if (device) device_used -= it->second.bytes;
    munmap(it->second.map, it->second.map_bytes);
    allocations.erase(it);
    return cudaSuccess;
}

// The guard page sits after the allocation's rounding to 256 bytes, so an access just past the
// requested size (an off-by-one on a buffer whose size is not a multiple of 256 bytes) lands in the
// padding, where nothing faults. The padding is filled with NaN bytes like the allocation, so such
// a read shows up as NaN; and after every launch it must still hold them, so such a write is named.
static void check_padding(const char* found) {
    for (const auto& [user, a] : allocations) {
        if (!a.device) continue;
        const unsigned char* p = (const unsigned char*)user;
        size_t rounded = (std::max<size_t>(a.bytes, 1) + 255) / 256 * 256;
        for (size_t i = a.bytes; i < rounded; i++)
            if (p[i] != 0xff)
                fail("a write at byte %zu of a %zu-byte cudaMalloc allocation: past its end, inside its padding to "
                     "256 bytes, where the guard page cannot see it; found %s", i, a.bytes, found);
    }
}

// Device ranges must lie inside one live cudaMalloc; host ranges must not touch device memory.
static bool check_range(const void* p, size_t bytes, bool device, const char* call, const char* which) {
    uintptr_t base = 0;
    const Allocation* a = find_allocation(p, &base);
    bool is_device = a && a->device && (uintptr_t)p >= base;
    if (device) {
        if (!is_device) {
            fprintf(stderr, "CUDA emulator: %s: the %s %p is not device memory\n", call, which, p);
            return false;
        }
        if ((uintptr_t)p + bytes > base + a->bytes) {
            fprintf(stderr, "CUDA emulator: %s: %zu bytes at offset %zu overrun the %zu-byte allocation (%s)\n", call,
                    bytes, (size_t)((uintptr_t)p - base), a->bytes, which);
            return false;
        }
    } else if (is_device) {
        fprintf(stderr, "CUDA emulator: %s: the %s %p is device memory, but the copy's kind says host\n", call, which, p);
        return false;
    }
    return true;
}

// ---------------------------------------------------------------------------------------------
// Stream capture: CUDA graphs (README.md, "Stream capture")
//
// One capture at a time, in cudaStreamCaptureModeGlobal (what our code asks for). While it is on,
// the captured stream's work (stream_work: kernels, async copies and sets, the library stand-ins'
// calls) is appended to the graph instead of run. The calls the real runtime forbids during a
// global-mode capture (anything that would wait for the captured work, or allocate) return
// cudaErrorStreamCaptureUnsupported, as there, and invalidate the capture: cudaStreamEndCapture then
// returns cudaErrorStreamCaptureInvalidated and no graph. A graph replays its nodes in capture order.
// Other streams fork into the capture and join back through events (Forked, below).

struct GraphNode {
    std::string what;  // the kernel's or the call's name
    int type;          // cudaGraphNodeType, for cudaGraphNodeGetType
    std::function<void()> run;
};

static cudaStream_t capture_stream = nullptr;  // the stream being captured (the capture's origin), or none
static bool capture_valid = false;
static std::vector<GraphNode> captured;         // the nodes recorded so far

// Other streams join a capture as on a GPU: a stream that waits on an event recorded inside the
// capture (cudaStreamWaitEvent) is forked into it, and its work from then on is recorded too. Every
// stream here runs in issue order, so the nodes of all of them, recorded in the order issued, replay
// in an order the graph's edges allow. Before cudaStreamEndCapture each forked stream must be joined
// back: the origin waits on an event recorded on it after its last work; one that is not makes the
// end fail with cudaErrorStreamCaptureUnjoined, as the real runtime does.
struct Forked {
    uint64_t work = 0;    // nodes recorded on the stream so far
    uint64_t joined = 0;  // how many of them the origin stream has waited for
};
static std::map<cudaStream_t, Forked> forked;

static bool in_capture(cudaStream_t stream) {
    return capture_stream && (stream == capture_stream || forked.count(stream) > 0);
}

bool stream_capturing(cudaStream_t stream) { return capture_valid && in_capture(stream); }

void stream_work(cudaStream_t stream, const char* what, int node_type, std::function<void()> work) {
    if (in_capture(stream)) {
        if (capture_valid) captured.push_back(GraphNode{what, node_type, std::move(work)});
        if (stream != capture_stream) forked[stream].work++;
        return;  // an invalidated capture records nothing more; its end reports it
    }
    work();
}

// A call the real runtime refuses while a global-mode capture is on: says which, and invalidates it.
static bool refused_in_capture(const char* call) {
    if (!capture_stream) return false;
    fprintf(stderr, "CUDA emulator: %s during stream capture: cudaErrorStreamCaptureUnsupported (a graph cannot wait "
            "for its own work, allocate or copy synchronously); the capture is invalidated\n", call);
    capture_valid = false;
    last_error = cudaErrorStreamCaptureUnsupported;
    return true;
}

}  // namespace emu

// cudaGraph_t and cudaGraphExec_t are pointers to these (the headers leave them incomplete); a
// cudaGraphNode_t points at one of a graph's nodes.
struct CUgraph_st { std::vector<emu::GraphNode> nodes; };
struct CUgraphExec_st { std::vector<emu::GraphNode> nodes; };

using namespace emu;

// ---------------------------------------------------------------------------------------------
// The CUDA runtime API, as far as our code calls it

extern "C" {

cudaError_t cudaMalloc(void** p, size_t bytes) {
    if (refused_in_capture("cudaMalloc")) return cudaErrorStreamCaptureUnsupported;
    return allocate(p, bytes, true);
}
cudaError_t cudaFree(void* p) {
    if (refused_in_capture("cudaFree")) return cudaErrorStreamCaptureUnsupported;
    return release(p, true);
}
cudaError_t cudaMallocHost(void** p, size_t bytes) {
    if (refused_in_capture("cudaMallocHost")) return cudaErrorStreamCaptureUnsupported;
    return allocate(p, bytes, false);
}
cudaError_t cudaFreeHost(void* p) {
    if (refused_in_capture("cudaFreeHost")) return cudaErrorStreamCaptureUnsupported;
    return release(p, false);
}
cudaError_t cudaHostAlloc(void** p, size_t bytes, unsigned) { return cudaMallocHost(p, bytes); }

// The checks and the copy, done now or when a graph replays it.
static cudaError_t copy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream,
                        const char* call) {
    if (bytes == 0) return cudaSuccess;
    bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
    bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
    if (kind == cudaMemcpyDefault) {
        uintptr_t b;
        const Allocation* d = find_allocation(dst, &b);
        const Allocation* s = find_allocation(src, &b);
        dst_device = d && d->device;
        src_device = s && s->device;
    } else if (kind == cudaMemcpyHostToHost) {
        dst_device = src_device = false;
    }
    if (!check_range(dst, bytes, dst_device, call, "destination") || !check_range(src, bytes, src_device, call, "source"))
        return last_error = cudaErrorInvalidValue;
    // captured: the bytes at `src` when the graph runs, not now (a host source is read at each replay)
    stream_work(stream, call, cudaGraphNodeTypeMemcpy, [=]() { memmove(dst, src, bytes); });
    return cudaSuccess;
}
static cudaError_t set(void* p, int value, size_t bytes, cudaStream_t stream, const char* call) {
    if (bytes == 0) return cudaSuccess;
    if (!check_range(p, bytes, true, call, "pointer")) return last_error = cudaErrorInvalidValue;
    stream_work(stream, call, cudaGraphNodeTypeMemset, [=]() { memset(p, value, bytes); });
    return cudaSuccess;
}

// The synchronous ones wait for the device: refused during a capture.
cudaError_t cudaMemcpy(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind) {
    if (refused_in_capture("cudaMemcpy")) return cudaErrorStreamCaptureUnsupported;
    return copy(dst, src, bytes, kind, nullptr, "cudaMemcpy");
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t bytes, cudaMemcpyKind kind, cudaStream_t stream) {
    return copy(dst, src, bytes, kind, stream, "cudaMemcpyAsync");
}
cudaError_t cudaMemset(void* p, int value, size_t bytes) {
    if (refused_in_capture("cudaMemset")) return cudaErrorStreamCaptureUnsupported;
    return set(p, value, bytes, nullptr, "cudaMemset");
}
cudaError_t cudaMemsetAsync(void* p, int value, size_t bytes, cudaStream_t stream) {
    return set(p, value, bytes, stream, "cudaMemsetAsync");
}

cudaError_t cudaMemGetInfo(size_t* free_bytes, size_t* total_bytes) {
    init_device();
    *free_bytes = device_total - device_used;
    *total_bytes = device_total;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceCount(int* count) {
    init_device();
    *count = device_count;
    return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
    init_device();
    if (device < 0 || device >= device_count) return last_error = cudaErrorInvalidDevice;
    device_current = device;
    return cudaSuccess;
}
cudaError_t cudaGetDevice(int* device) {
    *device = device_current;
    return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
    if (refused_in_capture("cudaDeviceSynchronize")) return cudaErrorStreamCaptureUnsupported;
    return cudaSuccess;
}
cudaError_t cudaDeviceReset() { return cudaSuccess; }

// An H100 SXM's properties, the ones our code reads.
cudaError_t cudaGetDeviceProperties(cudaDeviceProp* p, int device) {
    init_device();
    if (device < 0 || device >= device_count) return cudaErrorInvalidDevice;
    memset(p, 0, sizeof(*p));
    snprintf(p->name, sizeof(p->name), "NVIDIA H100 80GB HBM3 (CPU emulation)");
    p->major = 9;
    p->minor = 0;
    const char* cc = getenv("CUDA_EMU_COMPUTE_CAPABILITY");  // "MAJOR.MINOR"
    if (cc && *cc && sscanf(cc, "%d.%d", &p->major, &p->minor) != 2) {
        fprintf(stderr, "CUDA emulator: CUDA_EMU_COMPUTE_CAPABILITY must be MAJOR.MINOR, e.g. 8.0, got '%s'\n", cc);
        exit(2);
    }
    p->totalGlobalMem = device_total;
    p->multiProcessorCount = 132;
    p->warpSize = 32;
    p->maxThreadsPerBlock = 1024;
    p->maxThreadsDim[0] = 1024;
    p->maxThreadsDim[1] = 1024;
    p->maxThreadsDim[2] = 64;
    p->maxGridSize[0] = 2147483647;
    p->maxGridSize[1] = 65535;
    p->maxGridSize[2] = 65535;
    p->sharedMemPerBlock = SMEM_DEFAULT;
    p->sharedMemPerBlockOptin = SMEM_OPTIN_MAX;
    p->sharedMemPerMultiprocessor = 228 * 1024;
    p->regsPerBlock = 65536;
    p->l2CacheSize = 50 * 1024 * 1024;
    p->maxThreadsPerMultiProcessor = 2048;
    p->memoryBusWidth = 5120;
    p->unifiedAddressing = 1;
    p->pciBusID = device;
    return cudaSuccess;
}
cudaError_t cudaDeviceGetAttribute(int* value, cudaDeviceAttr attr, int device) {
    cudaDeviceProp p;
    cudaGetDeviceProperties(&p, device);
    switch (attr) {
        case cudaDevAttrMultiProcessorCount: *value = p.multiProcessorCount; return cudaSuccess;
        case cudaDevAttrMaxSharedMemoryPerBlockOptin: *value = (int)p.sharedMemPerBlockOptin; return cudaSuccess;
        case cudaDevAttrComputeCapabilityMajor: *value = p.major; return cudaSuccess;
        case cudaDevAttrComputeCapabilityMinor: *value = p.minor; return cudaSuccess;
        case cudaDevAttrL2CacheSize: *value = p.l2CacheSize; return cudaSuccess;
        default:
            fprintf(stderr, "CUDA emulator: cudaDeviceGetAttribute(%d) is not emulated\n", (int)attr);
            return cudaErrorInvalidValue;
    }
}

cudaError_t cudaFuncSetAttribute(const void* func, cudaFuncAttribute attr, int value) {
    if (attr != cudaFuncAttributeMaxDynamicSharedMemorySize) {
        fprintf(stderr, "CUDA emulator: cudaFuncSetAttribute(%d) is not emulated\n", (int)attr);
        return cudaErrorInvalidValue;
    }
    if (value < 0 || (size_t)value > SMEM_OPTIN_MAX) return last_error = cudaErrorInvalidValue;
    max_dynamic_smem[func] = value;
    return cudaSuccess;
}

cudaError_t cudaGetLastError() {
    cudaError_t e = last_error;
    last_error = cudaSuccess;
    return e;
}
cudaError_t cudaPeekAtLastError() { return last_error; }

const char* cudaGetErrorName(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "cudaSuccess";
        case cudaErrorInvalidValue: return "cudaErrorInvalidValue";
        case cudaErrorMemoryAllocation: return "cudaErrorMemoryAllocation";
        case cudaErrorInvalidConfiguration: return "cudaErrorInvalidConfiguration";
        case cudaErrorInvalidDevice: return "cudaErrorInvalidDevice";
        case cudaErrorNotReady: return "cudaErrorNotReady";
        case cudaErrorNoDevice: return "cudaErrorNoDevice";
        case cudaErrorIllegalState: return "cudaErrorIllegalState";
        case cudaErrorStreamCaptureUnsupported: return "cudaErrorStreamCaptureUnsupported";
        case cudaErrorStreamCaptureInvalidated: return "cudaErrorStreamCaptureInvalidated";
        case cudaErrorStreamCaptureUnmatched: return "cudaErrorStreamCaptureUnmatched";
        case cudaErrorStreamCaptureUnjoined: return "cudaErrorStreamCaptureUnjoined";
        case cudaErrorCapturedEvent: return "cudaErrorCapturedEvent";
        default: return "cudaError (emulated)";
    }
}
const char* cudaGetErrorString(cudaError_t e) {
    switch (e) {
        case cudaSuccess: return "no error";
        case cudaErrorInvalidValue: return "invalid argument";
        case cudaErrorMemoryAllocation: return "out of memory";
        case cudaErrorInvalidConfiguration: return "invalid configuration argument";
        case cudaErrorInvalidDevice: return "invalid device ordinal";
        case cudaErrorNotReady: return "device not ready";
        case cudaErrorNoDevice: return "no CUDA-capable device is detected";
        case cudaErrorIllegalState: return "the resource is not valid in its current state";
        case cudaErrorStreamCaptureUnsupported: return "operation not permitted when stream is capturing";
        case cudaErrorStreamCaptureInvalidated: return "operation failed due to a previous error during capture";
        case cudaErrorStreamCaptureUnmatched: return "capture was not initiated in this stream";
        case cudaErrorStreamCaptureUnjoined: return "capturing stream has unjoined work";
        case cudaErrorCapturedEvent: return "operation not permitted on an event last recorded in a capturing stream";
        default: return "emulated error";
    }
}

// Streams and events: handles with nothing behind them but a time stamp.
struct CUevent_st {
    std::chrono::steady_clock::time_point when;
    bool recorded, in_capture;
    cudaStream_t stream;  // in a capture: the stream it was recorded on, and how much of that stream's work it follows
    uint64_t mark;
};
struct CUstream_st { int unused; };

cudaError_t cudaStreamCreate(cudaStream_t* s) {
    *s = (cudaStream_t) new CUstream_st();
    return cudaSuccess;
}
cudaError_t cudaStreamCreateWithFlags(cudaStream_t* s, unsigned) { return cudaStreamCreate(s); }
cudaError_t cudaStreamCreateWithPriority(cudaStream_t* s, unsigned, int) { return cudaStreamCreate(s); }
cudaError_t cudaStreamDestroy(cudaStream_t s) {
    delete (CUstream_st*)s;
    return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
    if ((in_capture(s) || s == nullptr) && refused_in_capture("cudaStreamSynchronize")) return cudaErrorStreamCaptureUnsupported;
    return cudaSuccess;
}
cudaError_t cudaStreamQuery(cudaStream_t s) {
    if ((in_capture(s) || s == nullptr) && refused_in_capture("cudaStreamQuery")) return cudaErrorStreamCaptureUnsupported;
    return cudaSuccess;
}
// The fork and the join of a capture ("Stream capture" above): waiting on an event recorded inside
// the capture pulls the waiting stream into it; the origin waiting on a forked stream's event joins
// that stream's work up to the event.
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned) {
    if (!e) return cudaErrorInvalidResourceHandle;
    auto* ev = (CUevent_st*)e;
    if (!ev->in_capture || !capture_stream) return cudaSuccess;
    if (!in_capture(s)) forked[s] = Forked{};
    if (s == capture_stream && ev->stream != capture_stream && forked.count(ev->stream)) {
        Forked& f = forked[ev->stream];
        f.joined = std::max(f.joined, ev->mark);
    }
    return cudaSuccess;
}

cudaError_t cudaEventCreate(cudaEvent_t* e) {
    *e = (cudaEvent_t) new CUevent_st{std::chrono::steady_clock::now(), false, false, nullptr, 0};
    return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned) { return cudaEventCreate(e); }
cudaError_t cudaEventDestroy(cudaEvent_t e) {
    delete (CUevent_st*)e;
    return cudaSuccess;
}
// Recorded into a capture, an event only orders the graph's nodes (every stream here runs in issue
// order: nothing to record); until recorded outside one again, the host may not wait on it.
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
    if (!e) return cudaErrorInvalidResourceHandle;
    auto* ev = (CUevent_st*)e;
    ev->in_capture = in_capture(s);
    if (ev->in_capture) {
        ev->stream = s;
        ev->mark = s == capture_stream ? 0 : forked[s].work;
        return cudaSuccess;
    }
    ev->when = std::chrono::steady_clock::now();
    ev->recorded = true;
    return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
    if (e && ((CUevent_st*)e)->in_capture) return last_error = cudaErrorCapturedEvent;
    return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) { return cudaEventSynchronize(e); }
cudaError_t cudaEventElapsedTime(float* ms, cudaEvent_t a, cudaEvent_t b) {
    auto* x = (CUevent_st*)a;
    auto* y = (CUevent_st*)b;
    if (!x->recorded || !y->recorded) return cudaErrorInvalidResourceHandle;
    *ms = std::chrono::duration<float, std::milli>(y->when - x->when).count();
    return cudaSuccess;
}

// ---- CUDA graphs: capture, instantiate, launch (see "Stream capture" above)

cudaError_t cudaStreamBeginCapture(cudaStream_t s, cudaStreamCaptureMode mode) {
    if (mode != cudaStreamCaptureModeGlobal) fail("cudaStreamBeginCapture: only cudaStreamCaptureModeGlobal is emulated");
    if (s == nullptr) return last_error = cudaErrorStreamCaptureUnsupported;  // the legacy stream cannot be captured
    if (capture_stream) return last_error = cudaErrorIllegalState;            // one capture at a time here
    capture_stream = s;
    capture_valid = true;
    captured.clear();
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t s, cudaGraph_t* graph) {
    if (!graph) return cudaErrorInvalidValue;
    *graph = nullptr;
    if (!capture_stream || s != capture_stream) return last_error = cudaErrorStreamCaptureUnmatched;
    bool valid = capture_valid;
    bool unjoined = false;
    for (const auto& f : forked) unjoined = unjoined || f.second.work > f.second.joined;
    capture_stream = nullptr;
    capture_valid = false;
    forked.clear();
    if (!valid) {
        captured.clear();
        return last_error = cudaErrorStreamCaptureInvalidated;
    }
    if (unjoined) {
        fprintf(stderr, "CUDA emulator: cudaStreamEndCapture with a forked stream's work not joined back into the "
                "origin stream (record an event on it after its last work, and make the origin wait on it): "
                "cudaErrorStreamCaptureUnjoined\n");
        captured.clear();
        return last_error = cudaErrorStreamCaptureUnjoined;
    }
    *graph = new CUgraph_st{std::move(captured)};
    captured.clear();
    return cudaSuccess;
}

cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* status) {
    if (!status) return cudaErrorInvalidValue;
    *status = !in_capture(s) ? cudaStreamCaptureStatusNone
              : capture_valid                        ? cudaStreamCaptureStatusActive
                                                     : cudaStreamCaptureStatusInvalidated;
    return cudaSuccess;
}

cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t* nodes, size_t* count) {
    if (!graph || !count) return cudaErrorInvalidValue;
    if (nodes) {
        for (size_t i = 0; i < *count && i < graph->nodes.size(); i++) nodes[i] = (cudaGraphNode_t)&graph->nodes[i];
        *count = std::min(*count, graph->nodes.size());
    } else {
        *count = graph->nodes.size();
    }
    return cudaSuccess;
}
cudaError_t cudaGraphNodeGetType(cudaGraphNode_t node, cudaGraphNodeType* type) {
    if (!node || !type) return cudaErrorInvalidValue;
    *type = (cudaGraphNodeType)((GraphNode*)node)->type;
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
    if (!exec || !graph) return cudaErrorInvalidValue;
    if (refused_in_capture("cudaGraphInstantiate")) return cudaErrorStreamCaptureUnsupported;
    *exec = new CUgraphExec_st{graph->nodes};
    return cudaSuccess;
}

// Replays the graph's nodes in capture order (into a capture, as one node: a child graph).
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t s) {
    if (!exec) return cudaErrorInvalidValue;
    stream_work(s, "cudaGraphLaunch", cudaGraphNodeTypeGraph, [exec]() {
        for (const GraphNode& n : exec->nodes) n.run();
    });
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
    delete exec;
    return cudaSuccess;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    delete graph;
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int* v) { *v = 13000; return cudaSuccess; }
cudaError_t cudaRuntimeGetVersion(int* v) { *v = 13000; return cudaSuccess; }

}  // extern "C"
