// encoder.cu — the token + position embedding: coalescing, and a scatter-add without atomics.
//
//   forward   x[b,t,:] = wte[token[b,t],:] + wpe[t,:]
//   backward  dwte[v,:] += sum over positions p holding token v of dx[p,:];  dwpe[t,:] += sum_b dx[b,t,:]
//
// Forward traffic: read a wte row and a wpe row, write an x row, per position: ~6C bytes; no math.
// The versions differ only in how threads map onto memory:
//   1. one thread per position, looping over its C channels. The obvious loop, and the slowest
//      layout there is: the 32 lanes of a warp read 32 different rows, so every load instruction
//      touches 32 cache lines and uses 2 bytes of each (the rest is fetched for a later iteration
//      of the same thread, by which time it may be gone).
//   2. one thread per element: lanes read consecutive channels, a warp reads 64 contiguous bytes
//      per instruction. Coalesced.
//   3. trainer's (llmc/kernels/encoder.cuh): one thread per 8 channels, 16-byte loads.
// Prediction: 1 at a few % of the copy ceiling, 2 at ~60-80%, 3 at ~85-95%.
//
// Backward: a scatter-add. Several positions hold the same token ("the", ","), so their rows add
// into the same dwte row:
//   1. one thread per (position, channel) with atomicAdd. Atomics make it correct but not
//      reproducible (the order of the adds is a race), and they need an fp32 gradient: bf16 atomics
//      round at every add (simulated on this file's inputs: 6.9e-3 relative error instead of the
//      1.6e-3 of one rounding). So: zero an fp32 copy, atomics into it, add it to the bf16 gradient
//      in a pass over all Vp rows. The fp32 detour moves ~6x the bytes of the gradient.
//   2. deterministic: the host sorts the positions by token (a counting sort, O(BT + V), the
//      trainer's encoder_buckets_build); one block per distinct token sums its positions' rows in
//      position order, so each dwte row has one owner and the sum a fixed order. dwpe: one thread
//      per (t, channel) sums over b. Scalar 2-byte loads.
//   3. the trainer's until version 4: the same buckets, 16-byte loads, a 128-thread block per bucket.
//      What it wastes: a thread loads a row, adds it, loads the next: one DRAM latency (~1 us with
//      the index load before it) per position, so the bucket of a frequent token (2% of 8192
//      positions: ~160 rows) takes ~100+ us alone and is the kernel's tail; and 32 of the 128
//      threads idle at C = 768. Measured on an H200: 14% of copy.
//   4. trainer's (llmc/kernels/encoder.cuh): the block as wide as the row (C/8 threads in whole
//      warps), the dwte row loaded first, then 8 positions' indices and their 8 rows before adding
//      any: one latency per 8 positions. Same additions in the same order: version 3's bits
//      (test_emu_kernel_lab.py checks).
// Floor: dout read once, the touched dwte rows and dwpe read and written: ~35 MB at B=8, ~8 us at
// 4.2 TB/s; the dwpe kernel reads dout a second time (12.6 MB, from L2 if it is still there).
// Prediction: 1 ~15%, 2 40-60%, 3 60-80% (measured 4.3%, 12.3%, 14.3%), 4 40-60%: bounded by
// the longest bucket's ~20 rounds of 8 and the dwpe kernel's second read.
// The bucket sort runs on the host while the GPU does the forward (it is not timed here).
// Inputs: 20% of positions draw one of 10 "frequent" tokens (~2% each, like "the" or ","), the rest
// are uniform over the vocabulary (on --tiny shapes 2 frequent tokens, ~10% each).
#include "dev/cuda/common.h"
#include "llmc/kernels/encoder.cuh"

static const std::vector<Version> VERSIONS = {
    {"encoder_forward", 1, "thread per row", "one thread per position, looping over its channels (uncoalesced)", false},
    {"encoder_forward", 2, "thread per element", "one thread per element: consecutive lanes, consecutive channels", false},
    {"encoder_forward", 3, "trainer: 16-byte vectors", "llmc/kernels/encoder.cuh: one thread per 8 channels, 16-byte loads", true},
    {"encoder_backward", 1, "fp32 atomics", "one thread per element, atomicAdd into an fp32 copy, then a pass adding it to bf16", false},
    {"encoder_backward", 2, "buckets, scalar", "positions sorted by token on the host; one block per token, 2-byte loads", false},
    {"encoder_backward", 3, "buckets, 16B", "the trainer's until version 4: the same buckets, 16-byte loads, a row at a time", false},
    {"encoder_backward", 4, "trainer: buckets, 8 rows in flight", "llmc/kernels/encoder.cuh: 8 positions' rows loaded before adding, the dwte row first", true},
};

// ---- forward 1: one thread per position
__global__ void encoder_forward_rows(floatX* out, const int* tokens, const floatX* wte, const floatX* wpe, int BT, int T,
                                     int C) {
    int bt = blockIdx.x * blockDim.x + threadIdx.x;
    if (bt >= BT) return;
    const floatX* tok = wte + (size_t)tokens[bt] * C;
    const floatX* pos = wpe + (size_t)(bt % T) * C;
    for (int c = 0; c < C; c++) out[(size_t)bt * C + c] = __float2bfloat16(__bfloat162float(tok[c]) + __bfloat162float(pos[c]));
}

// ---- forward 2: one thread per element
__global__ void encoder_forward_elements(floatX* out, const int* tokens, const floatX* wte, const floatX* wpe, int BT,
                                         int T, int C) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)BT * C) return;
    int bt = (int)(i / C), c = (int)(i % C);
    out[i] = __float2bfloat16(__bfloat162float(wte[(size_t)tokens[bt] * C + c]) + __bfloat162float(wpe[(size_t)(bt % T) * C + c]));
}

// ---- backward 1: fp32 atomics; then add_f32_to_bf16 (common.h) adds the fp32 gradient to the bf16 one
__global__ void encoder_backward_atomic(float* dwte32, float* dwpe32, const floatX* dout, const int* tokens, int BT, int T,
                                        int C) {
    size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (size_t)BT * C) return;
    int bt = (int)(i / C), c = (int)(i % C);
    float d = __bfloat162float(dout[i]);
    atomicAdd(dwte32 + (size_t)tokens[bt] * C + c, d);
    atomicAdd(dwpe32 + (size_t)(bt % T) * C + c, d);
}

// ---- backward 2: buckets (layout: llmc/kernels/encoder.cuh), one block per bucket, one thread per channel
__global__ void encoder_backward_wte_scalar(floatX* dwte, const floatX* dout, const int* buckets, int BT, int C) {
    EncoderBucket b = encoder_bucket(buckets, BT, blockIdx.x);
    floatX* row = dwte + (size_t)b.token * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float sum = 0.0f;
        for (int i = b.begin; i < b.end; i++) sum += __bfloat162float(dout[(size_t)b.positions[i] * C + c]);
        row[c] = __float2bfloat16(__bfloat162float(row[c]) + sum);
    }
}
__global__ void encoder_backward_wpe_scalar(floatX* dwpe, const floatX* dout, int B, int T, int C) {
    int i = blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= T * C) return;
    float sum = 0.0f;
    for (int b = 0; b < B; b++) sum += __bfloat162float(dout[(size_t)b * T * C + i]);
    dwpe[i] = __float2bfloat16(__bfloat162float(dwpe[i]) + sum);
}

// ---- backward 3: the trainer's wte kernel until version 4 (llmc/kernels/encoder.cuh at 31fc5de): a row
// loaded, then added, then the next, in 128-thread blocks
__global__ void encoder_backward_wte_one_row(floatX* dwte, const floatX* dout, const int* buckets, int BT, int C) {
    EncoderBucket b = encoder_bucket(buckets, BT, blockIdx.x);
    if (b.begin == b.end) return;
    floatX* row = dwte + (size_t)b.token * C;
    for (int c = threadIdx.x * x128::size; c < C; c += blockDim.x * x128::size) {
        float sum[x128::size] = {};
        for (int i = b.begin; i < b.end; i++) {
            x128 d = load128(dout + (size_t)b.positions[i] * C + c);
            for (int k = 0; k < x128::size; k++) sum[k] += to_float(d[k]);
        }
        x128 acc = load128(row + c);
        for (int k = 0; k < x128::size; k++) acc[k] = from_float<floatX>(to_float(acc[k]) + sum[k]);
        store128(row + c, acc);
    }
}

int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "encoder", VERSIONS);
    int B = lab.B, T = lab.T, C = lab.C, V = lab.V, Vp = lab.Vp, BT = B * T;
    size_t btc = (size_t)BT * C;

    std::vector<float> u = random_uniform(BT, next_seed(&lab), 0.0f, 1.0f);
    std::vector<float> pick = random_uniform(BT, next_seed(&lab), 0.0f, 1.0f);
    std::vector<int> tokens(BT);
    // 10 frequent tokens, fewer on the small shapes (BT / 64: 2 at --tiny's 128 positions) so that
    // there too a bucket holds more than ENCODER_ROWS_IN_FLIGHT positions (~13: two rounds, the
    // second partial)
    int frequent = std::max(1, std::min(10, BT / 64));
    for (int i = 0; i < BT; i++) tokens[i] = std::min(V - 1, (int)(pick[i] * (u[i] < 0.2f ? frequent : V)));
    std::vector<float> wte = random_normal((size_t)Vp * C, next_seed(&lab), 0.0f, 0.5f);
    std::vector<float> wpe = random_normal((size_t)T * C, next_seed(&lab), 0.0f, 0.5f);
    std::vector<float> dout = random_normal(btc, next_seed(&lab), 0.0f, 1.0f);
    // the gradients start non-zero (the backward adds to them), small enough that the rows the
    // backward touches dominate the error norm
    std::vector<float> dwte0 = random_normal((size_t)Vp * C, next_seed(&lab), 0.0f, 0.1f);
    std::vector<float> dwpe0 = random_normal((size_t)T * C, next_seed(&lab), 0.0f, 0.1f);
    for (auto* v : {&wte, &wpe, &dout, &dwte0, &dwpe0}) round_to_bf16(v);

    std::vector<float> x_ref(btc), dwte_ref = dwte0, dwpe_ref = dwpe0;
    cpu::encoder_forward(x_ref.data(), tokens.data(), wte.data(), wpe.data(), B, T, C);
    cpu::encoder_backward(dwte_ref.data(), dwpe_ref.data(), dout.data(), tokens.data(), B, T, C);
    std::vector<int> count, buckets(3 * (size_t)BT + 1);
    int U = encoder_buckets_build(tokens.data(), BT, V, &count, buckets.data());
    int longest = 0;
    for (int b = 0; b < U; b++) longest = std::max(longest, buckets[BT + b + 1] - buckets[BT + b]);
    printf("%d positions, %d distinct tokens, the longest bucket %d positions\n", BT, U, longest);

    // ---- forward: the touched wte rows, wpe and the tokens read, x written
    double fwd_bytes = 2.0 * btc + 2.0 * U * C + 2.0 * T * C + 4.0 * BT;
    int slots = lab_slots(lab, fwd_bytes);
    std::vector<int*> d_tokens = to_device<int>(tokens, slots);
    std::vector<floatX*> d_wte = to_device<floatX>(wte, slots), d_wpe = to_device<floatX>(wpe, slots);
    std::vector<floatX*> d_x = device_slots<floatX>(btc, slots);
    Case fwd;
    fwd.kernel = "encoder_forward";
    fwd.bytes = fwd_bytes;
    fwd.slots = slots;
    fwd.checks = {bf16_output("x", d_x[0], x_ref)};
    Case c = fwd;
    c.version = 1;
    c.run = [&](int s) {
        encoder_forward_rows<<<ceil_div(BT, 128), 128, 0, lab.stream>>>(d_x[s], d_tokens[s], d_wte[s], d_wpe[s], BT, T, C);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        encoder_forward_elements<<<ceil_div(btc, 256), 256, 0, lab.stream>>>(d_x[s], d_tokens[s], d_wte[s], d_wpe[s], BT, T, C);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) { encoder_forward(d_x[s], d_tokens[s], d_wte[s], d_wpe[s], B, T, C, lab.stream); };
    lab_case(&lab, c);

    // ---- backward: dout read; the touched dwte rows and dwpe read and written
    double bwd_bytes = 2.0 * btc + 4.0 * U * C + 4.0 * T * C + 4.0 * (2.0 * BT + U);
    slots = lab_slots(lab, bwd_bytes);
    std::vector<floatX*> d_dout = to_device<floatX>(dout, slots);
    std::vector<floatX*> d_dwte = to_device<floatX>(dwte0, slots), d_dwpe = to_device<floatX>(dwpe0, slots);
    std::vector<int*> d_buckets = to_device<int>(buckets, slots), d_tok = to_device<int>(tokens, slots);
    floatX* dwte_start = to_device<floatX>(dwte0, 1)[0];
    floatX* dwpe_start = to_device<floatX>(dwpe0, 1)[0];
    float* dwte32 = device_alloc<float>((size_t)Vp * C);
    float* dwpe32 = device_alloc<float>((size_t)T * C);
    Case bwd;
    bwd.kernel = "encoder_backward";
    bwd.bytes = bwd_bytes;
    bwd.slots = slots;
    bwd.checks = {bf16_output("dwte", d_dwte[0], dwte_ref, false), bf16_output("dwpe", d_dwpe[0], dwpe_ref, false)};
    bwd.prepare = [&](int s) {  // the gradients' start values (the backward adds to them)
        CUDA_CHECK(cudaMemcpyAsync(d_dwte[s], dwte_start, (size_t)Vp * C * 2, cudaMemcpyDeviceToDevice, lab.stream));
        CUDA_CHECK(cudaMemcpyAsync(d_dwpe[s], dwpe_start, (size_t)T * C * 2, cudaMemcpyDeviceToDevice, lab.stream));
    };
    c = bwd;
    c.version = 1;
    c.run = [&](int s) {
        CUDA_CHECK(cudaMemsetAsync(dwte32, 0, (size_t)Vp * C * 4, lab.stream));
        CUDA_CHECK(cudaMemsetAsync(dwpe32, 0, (size_t)T * C * 4, lab.stream));
        encoder_backward_atomic<<<ceil_div(btc, 256), 256, 0, lab.stream>>>(dwte32, dwpe32, d_dout[s], d_tok[s], BT, T, C);
        CUDA_CHECK_LAUNCH();
        add_f32_to_bf16<<<ceil_div((size_t)Vp * C, 256), 256, 0, lab.stream>>>(d_dwte[s], dwte32, (size_t)Vp * C);
        CUDA_CHECK_LAUNCH();
        add_f32_to_bf16<<<ceil_div((size_t)T * C, 256), 256, 0, lab.stream>>>(d_dwpe[s], dwpe32, (size_t)T * C);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        encoder_backward_wpe_scalar<<<ceil_div(T * C, 256), 256, 0, lab.stream>>>(d_dwpe[s], d_dout[s], B, T, C);
        CUDA_CHECK_LAUNCH();
        encoder_backward_wte_scalar<<<U, 256, 0, lab.stream>>>(d_dwte[s], d_dout[s], d_buckets[s], BT, C);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) {
        encoder_backward_wpe_kernel<<<ceil_div(T * (C / x128::size), 256), 256, 0, lab.stream>>>(d_dwpe[s], d_dout[s], B, T, C);
        CUDA_CHECK_LAUNCH();
        encoder_backward_wte_one_row<<<U, 128, 0, lab.stream>>>(d_dwte[s], d_dout[s], d_buckets[s], BT, C);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 4;
    c.run = [&](int s) { encoder_backward(d_dwte[s], d_dwpe[s], d_dout[s], d_buckets[s], U, B, T, C, lab.stream); };
    lab_case(&lab, c);
    return lab_end(&lab);
}
