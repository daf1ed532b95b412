// moe_dispatch.cu — a mixture-of-experts layer's permutation: every token's k rows sent to their
// experts' contiguous blocks of rows, and back (llmc/kernels/moe.cuh: the lesson is there).
//
//   dispatch   from each token's k choices (N, k) and the capacity: each assignment's row, grouped by
//              expert, and the row's token
//   gather     xg (kN, C) = the tokens' rows of x in that order (what each expert's matmul reads)
//   combine    y_t = sum_j gate_t,j xg[row_t,j]   (here the experts are the identity, so the
//              round trip is checked alone: y_t = (sum of t's gates) x_t when nothing is dropped)
// Traffic: x read once into xg and xg read once into y: 2 (x, y) + 2 k (xg written, read) rows of C
// bf16 values per token; the routing state is a few ints per token. No FLOPs to speak of.
//
// Three versions:
//   1. naive scatter: a histogram of the choices with integer atomics, a prefix sum on one thread,
//      then one thread per (token, slot) takes its place in its expert with atomicAdd and copies its
//      row of C values itself. Simple, and as fast as the atomics on one counter per expert allow,
//      but the place each assignment gets (so the order of rows within an expert, and with a binding
//      capacity WHICH assignments are dropped) is the order in which the threads reached the
//      counter: not reproducible from run to run, and not the CPU's order. Checked here with no
//      dropping, where y does not depend on the order (each token's rows come back to it).
//   2. atomics + gather: the same places by atomics, but the rows copied by the trainer's gather
//      (one 16-byte vector per thread, a warp reading 512 contiguous bytes of one row): the copy
//      fixed, the order still a race.
//   3. trainer's: one block scans the per-thread counts (the CPU's order, on any schedule:
//      moe_dispatch_kernel), then a gather with one 16-byte vector per thread, coalesced along C.
// Prediction: both far under the copy ceiling at d12 (N = 8192, k = 2, C = 768: ~75 MB moved, ~25 us
// at 3 TB/s); version 1's row copies are uncoalesced (32 lanes, 32 different rows) and its atomics
// on E = 8 counters serialise; version 2 fixes the copy; version 3's single-block scan is O(kN / 128) steps per thread, a few
// microseconds. Measured: not yet (no GPU since this file was written).
#include "dev/cuda/common.h"
#include "llmc/kernels/moe.cuh"

static const std::vector<Version> VERSIONS = {
    {"moe_dispatch", 1, "naive scatter: atomics", "one thread per (token, slot): atomicAdd for its place, copies its own row", false},
    {"moe_dispatch", 2, "atomics + gather", "the places by atomicAdd, the rows copied 16 bytes per thread (coalesced)", false},
    {"moe_dispatch", 3, "trainer: scan + gather", "llmc/kernels/moe.cuh: a one-block scan in the CPU's order, 16-byte gather", true},
};

// ---- version 1: atomics
__global__ void moe_naive_count(int* routed, const int* choice, int assignments) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c < assignments) atomicAdd(&routed[choice[c]], 1);
}
__global__ void moe_naive_offsets(int* first_row, int* cursor, const int* routed, int E) {
    if (threadIdx.x != 0) return;
    first_row[0] = 0;
    for (int e = 0; e < E; e++) {
        first_row[e + 1] = first_row[e] + routed[e];   // no capacity: every assignment is kept
        cursor[e] = 0;
    }
}
__global__ void moe_naive_scatter(floatX* xg, int* row, const floatX* x, const int* choice, const int* first_row, int* cursor,
                                  int assignments, int k, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= assignments) return;
    int e = choice[c];
    int r = first_row[e] + atomicAdd(&cursor[e], 1);   // the place: whichever thread got here first
    row[c] = r;
    const floatX* src = x + (size_t)(c / k) * C;
    for (int i = 0; i < C; i++) xg[(size_t)r * C + i] = src[i];
}

// ---- version 2: the places by atomics, the copy left to the trainer's gather (moe_gather_kernel)
__global__ void moe_naive_place(int* row, int* token_of_row, const int* choice, const int* first_row, int* cursor,
                                int assignments, int k) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= assignments) return;
    int e = choice[c];
    int r = first_row[e] + atomicAdd(&cursor[e], 1);
    row[c] = r;
    token_of_row[r] = c / k;
}

int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "moe_dispatch", VERSIONS);
    const int E = 8, k = 2, N = lab.B * lab.T, C = lab.C;
    size_t rows = (size_t)k * N;

    // inputs: x, each token's two distinct experts, drawn uniformly, and gates in (0, 1)
    std::vector<float> x = random_normal((size_t)N * C, next_seed(&lab), 0.0f, 1.0f);
    round_to_bf16(&x);
    std::mt19937_64 rng(next_seed(&lab));
    std::vector<int> choice(rows);
    std::vector<float> gate(rows);
    for (int t = 0; t < N; t++) {
        choice[(size_t)t * k] = (int)(rng() % E);
        choice[(size_t)t * k + 1] = (choice[(size_t)t * k] + 1 + (int)(rng() % (E - 1))) % E;
        for (int j = 0; j < k; j++) gate[(size_t)t * k + j] = (float)((rng() % 1000) + 1) / 1001.0f;
    }

    // the reference: the CPU trainer's dispatch (llmc/model/moe.h), then the combine of the identity experts
    cpu::MoEShape shape;
    shape.experts = E;
    shape.top_k = k;
    cpu::MoEActivations a;
    a.N = N;
    a.choice = choice;
    a.row.assign(rows, -1);
    a.routed.assign(E, 0);
    a.kept.assign(E, 0);
    a.first_row.assign(E + 1, 0);
    a.token_of_row.assign(rows, 0);
    cpu::moe_dispatch(&a, shape);
    std::vector<float> y_ref((size_t)N * C, 0.0f);
    for (int t = 0; t < N; t++)
        for (int j = 0; j < k; j++) {
            int r = a.row[(size_t)t * k + j], src = a.token_of_row[r];
            for (int i = 0; i < C; i++) y_ref[(size_t)t * C + i] += gate[(size_t)t * k + j] * x[(size_t)src * C + i];
        }

    MoERouting rt{};
    rt.choice = to_device<int>(choice, 1)[0];
    rt.gate = to_device<float>(gate, 1)[0];
    rt.row = device_alloc<int>(rows);
    rt.routed = device_alloc<int>(E);
    rt.kept = device_alloc<int>(E);
    rt.first_row = device_alloc<int>(E + 1);
    rt.token_of_row = device_alloc<int>(rows);
    int* cursor = device_alloc<int>(E);
    floatX* d_x = to_device<floatX>(x, 1)[0];
    floatX* xg = device_alloc<floatX>(rows * C);
    floatX* y = device_alloc<floatX>((size_t)N * C);

    // versions 1 and 2: each expert's count by atomics, its first row by one thread's prefix sum
    auto naive_offsets = [&]() {
        CUDA_CHECK(cudaMemsetAsync(rt.routed, 0, E * sizeof(int), lab.stream));
        moe_naive_count<<<ceil_div(rows, 256), 256, 0, lab.stream>>>(rt.routed, rt.choice, (int)rows);
        CUDA_CHECK_LAUNCH();
        moe_naive_offsets<<<1, 32, 0, lab.stream>>>(rt.first_row, cursor, rt.routed, E);
        CUDA_CHECK_LAUNCH();
    };
    Case c;
    c.kernel = "moe_dispatch";
    c.bytes = 2.0 * (2 + 2 * k) * (double)N * C;
    c.checks = {bf16_output("y", y, y_ref)};
    c.version = 1;
    c.run = [&](int) {
        naive_offsets();
        moe_naive_scatter<<<ceil_div(rows, 256), 256, 0, lab.stream>>>(xg, rt.row, d_x, rt.choice, rt.first_row, cursor,
                                                                        (int)rows, k, C);
        CUDA_CHECK_LAUNCH();
        moe_combine(y, xg, rt, N, k, C, lab.stream);
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int) {
        naive_offsets();
        moe_naive_place<<<ceil_div(rows, 256), 256, 0, lab.stream>>>(rt.row, rt.token_of_row, rt.choice, rt.first_row, cursor,
                                                                      (int)rows, k);
        CUDA_CHECK_LAUNCH();
        moe_gather(xg, d_x, rt, E, N, k, C, lab.stream);
        moe_combine(y, xg, rt, N, k, C, lab.stream);
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int) {
        moe_dispatch_kernel<<<1, MOE_SCAN_THREADS, 0, lab.stream>>>(rt, N, E, k, cpu::moe_capacity(N, k, E, 0.0f));
        CUDA_CHECK_LAUNCH();
        moe_gather(xg, d_x, rt, E, N, k, C, lab.stream);
        moe_combine(y, xg, rt, N, k, C, lab.stream);
    };
    lab_case(&lab, c);
    return lab_end(&lab);
}
