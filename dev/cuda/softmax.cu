// softmax.cu — the causal softmax of the materialised attention (the trainer's simple path), forward
// and backward: how to reduce a row, and how many times to read it.
//
//   forward   P[t, u] = exp(S[t, u] - max) / sum_{u' <= t} exp(S[t, u'] - max)  for u <= t, 0 above
//   backward  dS[t, u] = P[t, u] (dP[t, u] - sum_{u' <= t} P[t, u'] dP[t, u']) scale, in place over dP
// Rows: B * NH * T of T scores (bf16, the scale already applied); row t has t + 1 live entries.
// Memory-bound: the forward reads the live half of S and writes all of P (the zeros too); the
// backward reads the live halves of P and dP and writes all of dS. ~300 MB forward at B=8.
//
// Forward versions:
//   1. one thread per row, three loops (max, sum, write): lanes read 32 different rows, uncoalesced.
//   2. one block of 256 threads per row, block-wide reductions through shared memory: coalesced, but
//      two barriers per reduction, and most threads idle on the short rows near t = 0.
//   3. trainer's (llmc/kernels/attention.cuh, causal_softmax_forward_kernel, launched as the trainer does):
//      one warp per row, reductions by warp shuffles, no barriers. Three passes over the row (max,
//      sum, write); the second and third are served by L1.
//   4. online softmax with 16-byte loads: one warp per row, ONE pass for max and sum together (the
//      running sum is rescaled when the max grows, as in flash attention), a second to write.
//      Fewer instructions per byte; the DRAM traffic is the same as 3.
// Prediction: 1 ~5%, 2 ~40-60%, 3 ~60-80%, 4 ~80-90% of the copy ceiling.
//
// Backward versions: 1 one thread per row; 2 one block per row (shared-memory reduction); 3 the
// trainer's until version 4: one warp per row. Prediction: 1 ~5%, 2 ~50%, 3 ~70-80%.
// Measured on an H200: 4.0%, 40.3%, 30.4%: the warp lost to the block. What it wastes: 32 lanes
// walk a row of up to 1024 entries with 2-byte loads, 64 bytes per load instruction: too few bytes
// in flight per SM; and every entry past t is read although it is only overwritten with zero.
//   4. trainer's (llmc/kernels/attention.cuh, causal_softmax_backward_kernel): a block per row, one
//      thread per 8 columns (128 threads at T = 1024), 16-byte loads of the live part only (2-byte
//      where T % 8 leaves rows unaligned), the write's second read from L1 (the thread's own chunk),
//      the chunks past t written as zeros without being read.
// Floor: the live halves of P and dP read, dS written in full: 4 bytes per live entry + 2 per
// entry, 403 MB at B=8, ~96 us at 4.2 TB/s. Prediction for 4: 70-85%.
#include "dev/cuda/common.h"
#include "llmc/kernels/attention.cuh"

static const std::vector<Version> VERSIONS = {
    {"softmax_forward", 1, "thread per row", "one thread per row, three loops (uncoalesced)", false},
    {"softmax_forward", 2, "block per row", "one 256-thread block per row, shared-memory reductions", false},
    {"softmax_forward", 3, "trainer: warp per row", "llmc/kernels/attention.cuh: one warp per row, shuffle reductions, 3 passes", true},
    {"softmax_forward", 4, "warp, online, 16B", "one warp per row, max and sum in one pass (online), 16-byte loads", false},
    {"softmax_backward", 1, "thread per row", "in place, one thread per row (uncoalesced)", false},
    {"softmax_backward", 2, "block per row", "in place, one 256-thread block per row, shared-memory reduction", false},
    {"softmax_backward", 3, "warp per row", "the trainer's until version 4: in place, one warp per row, 2-byte loads", false},
    {"softmax_backward", 4, "trainer: block per row, 16B", "llmc/kernels/attention.cuh: in place, a block of T/8 threads per row, 16-byte loads of the live part, zeros past t unread", true},
};

// ---- forward 1
__global__ void softmax_forward_rows(floatX* att, const floatX* scores, int rows, int T) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    int t = row % T;
    const floatX* s = scores + (size_t)row * T;
    floatX* a = att + (size_t)row * T;
    float m = -INFINITY, sum = 0.0f;
    for (int u = 0; u <= t; u++) m = fmaxf(m, __bfloat162float(s[u]));
    for (int u = 0; u <= t; u++) sum += expf(__bfloat162float(s[u]) - m);
    for (int u = 0; u < T; u++) a[u] = __float2bfloat16(u <= t ? expf(__bfloat162float(s[u]) - m) / sum : 0.0f);
}

// ---- forward 2: a block per row, with the trainer's block_max / block_sum (llmc/kernels/cuda_common.cuh)
__global__ void softmax_forward_block(floatX* att, const floatX* scores, int rows, int T) {
    __shared__ float shared[32];
    int row = blockIdx.x, t = row % T;
    const floatX* s = scores + (size_t)row * T;
    floatX* a = att + (size_t)row * T;
    float m = -INFINITY, sum = 0.0f;
    for (int u = threadIdx.x; u <= t; u += blockDim.x) m = fmaxf(m, __bfloat162float(s[u]));
    m = block_max(m, shared);
    for (int u = threadIdx.x; u <= t; u += blockDim.x) sum += expf(__bfloat162float(s[u]) - m);
    float inv = 1.0f / block_sum(sum, shared);
    for (int u = threadIdx.x; u < T; u += blockDim.x)
        a[u] = __float2bfloat16(u <= t ? expf(__bfloat162float(s[u]) - m) * inv : 0.0f);
}

// ---- forward 4: a warp per row, online max and sum, 16-byte loads (T a multiple of 8).
// A vector straddling t is read whole; its entries past t are masked to -inf.
__global__ void softmax_forward_online(floatX* att, const floatX* scores, int rows, int T) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = row % T;
    const floatX* s = scores + (size_t)row * T;
    floatX* a = att + (size_t)row * T;
    float m = -INFINITY, sum = 0.0f;
    for (int u = lane * 8; u <= t; u += 32 * 8) {
        x128 s8 = load128cs(s + u);
        float v[8], vmax = -INFINITY;
        for (int k = 0; k < 8; k++) {
            v[k] = u + k <= t ? __bfloat162float(s8[k]) : -INFINITY;
            vmax = fmaxf(vmax, v[k]);
        }
        float m_new = fmaxf(m, vmax);  // finite: u <= t, so v[0] is
        sum *= expf(m - m_new);
        for (int k = 0; k < 8; k++) sum += expf(v[k] - m_new);
        m = m_new;
    }
    float row_max = warp_max(m);
    float inv = 1.0f / warp_sum(m == -INFINITY ? 0.0f : sum * expf(m - row_max));  // lanes with no entry add 0
    for (int u = lane * 8; u < T; u += 32 * 8) {
        x128 s8 = load128cs(s + u), p8;
        for (int k = 0; k < 8; k++)
            p8[k] = __float2bfloat16(u + k <= t ? expf(__bfloat162float(s8[k]) - row_max) * inv : 0.0f);
        store128(a + u, p8);
    }
}

// ---- backward 1: in place over datt
__global__ void softmax_backward_rows(floatX* datt, const floatX* att, int rows, int T, float scale) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= rows) return;
    int t = row % T;
    floatX* d = datt + (size_t)row * T;
    const floatX* a = att + (size_t)row * T;
    float dot = 0.0f;
    for (int u = 0; u <= t; u++) dot += __bfloat162float(a[u]) * __bfloat162float(d[u]);
    for (int u = 0; u < T; u++)
        d[u] = __float2bfloat16(u <= t ? __bfloat162float(a[u]) * (__bfloat162float(d[u]) - dot) * scale : 0.0f);
}

// ---- backward 2: a block per row
__global__ void softmax_backward_block(floatX* datt, const floatX* att, int rows, int T, float scale) {
    __shared__ float shared[32];
    int row = blockIdx.x, t = row % T;
    floatX* d = datt + (size_t)row * T;
    const floatX* a = att + (size_t)row * T;
    float dot = 0.0f;
    for (int u = threadIdx.x; u <= t; u += blockDim.x) dot += __bfloat162float(a[u]) * __bfloat162float(d[u]);
    dot = block_sum(dot, shared);
    for (int u = threadIdx.x; u < T; u += blockDim.x)
        d[u] = __float2bfloat16(u <= t ? __bfloat162float(a[u]) * (__bfloat162float(d[u]) - dot) * scale : 0.0f);
}

// ---- backward 3: the trainer's until version 4 (llmc/kernels/attention.cuh at 31fc5de).
// dscores[row] = att * (datt - sum(att * datt)) * scale, in place over datt. One warp per row.
__global__ void softmax_backward_warp(floatX* datt, const floatX* att, int rows, int T, float scale) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= rows) return;
    int t = row % T;
    floatX* d = datt + (size_t)row * T;
    const floatX* a = att + (size_t)row * T;
    float dot = 0.0f;
    for (int u = lane; u <= t; u += 32) dot += to_float(a[u]) * to_float(d[u]);
    dot = warp_sum(dot);
    for (int u = lane; u < T; u += 32)
        d[u] = from_float<floatX>(u <= t ? to_float(a[u]) * (to_float(d[u]) - dot) * scale : 0.0f);
}

int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "softmax", VERSIONS);
    int T = lab.T, rows = lab.B * lab.NH * T;
    size_t n = (size_t)rows * T;
    float scale = 1.0f / sqrtf((float)(lab.C / lab.NH));

    // every entry is random, the masked ones too: a kernel that reads past t gets a wrong answer
    std::vector<float> scores = random_normal(n, next_seed(&lab), 0.0f, 1.5f);
    std::vector<float> dp = random_normal(n, next_seed(&lab), 0.0f, 4.0f);
    round_to_bf16(&scores);
    round_to_bf16(&dp);
    // references in double (the CPU trainer computes this softmax inside its attention_forward)
    std::vector<float> att_ref(n), ds_ref(n);
    #pragma omp parallel for schedule(dynamic, 64)
    for (int r = 0; r < rows; r++) {
        int t = r % T;
        const float* s = scores.data() + (size_t)r * T;
        double m = -INFINITY, sum = 0;
        for (int u = 0; u <= t; u++) m = std::max(m, (double)s[u]);
        for (int u = 0; u <= t; u++) sum += std::exp(s[u] - m);
        for (int u = 0; u < T; u++) att_ref[(size_t)r * T + u] = u <= t ? (float)(std::exp(s[u] - m) / sum) : 0.0f;
    }
    std::vector<float> att_in = att_ref;  // the backward's input: P as the forward stores it, in bf16
    round_to_bf16(&att_in);
    #pragma omp parallel for schedule(dynamic, 64)
    for (int r = 0; r < rows; r++) {
        int t = r % T;
        const float* a = att_in.data() + (size_t)r * T;
        const float* d = dp.data() + (size_t)r * T;
        double dot = 0;
        for (int u = 0; u <= t; u++) dot += (double)a[u] * d[u];
        for (int u = 0; u < T; u++) ds_ref[(size_t)r * T + u] = u <= t ? (float)(a[u] * (d[u] - dot) * scale) : 0.0f;
    }

    double live = (double)lab.B * lab.NH * T * (T + 1) / 2;  // entries with u <= t
    double fwd_bytes = 2.0 * live + 2.0 * n;
    int slots = lab_slots(lab, fwd_bytes);
    std::vector<floatX*> d_scores = to_device<floatX>(scores, slots), d_att = device_slots<floatX>(n, slots);
    Case fwd;
    fwd.kernel = "softmax_forward";
    fwd.bytes = fwd_bytes;
    fwd.slots = slots;
    fwd.checks = {bf16_output("att", d_att[0], att_ref)};
    Case c = fwd;
    c.version = 1;
    c.run = [&](int s) {
        softmax_forward_rows<<<ceil_div(rows, 128), 128, 0, lab.stream>>>(d_att[s], d_scores[s], rows, T);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        softmax_forward_block<<<rows, 256, 0, lab.stream>>>(d_att[s], d_scores[s], rows, T);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) {  // as attention_forward launches it (llmc/kernels/attention.cuh)
        causal_softmax_forward_kernel<<<ceil_div(rows, 8), 256, 0, lab.stream>>>(d_att[s], d_scores[s], rows, T);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 4;
    c.run = [&](int s) {
        softmax_forward_online<<<ceil_div(rows, 8), 256, 0, lab.stream>>>(d_att[s], d_scores[s], rows, T);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);

    // backward, in place over dP
    double bwd_bytes = 4.0 * live + 2.0 * n;
    slots = lab_slots(lab, bwd_bytes);
    std::vector<floatX*> d_attin = to_device<floatX>(att_in, slots), d_d = to_device<floatX>(dp, slots);
    floatX* dp_start = to_device<floatX>(dp, 1)[0];
    Case bwd;
    bwd.kernel = "softmax_backward";
    bwd.bytes = bwd_bytes;
    bwd.slots = slots;
    bwd.checks = {bf16_output("dS", d_d[0], ds_ref, false)};
    bwd.prepare = [&](int s) { CUDA_CHECK(cudaMemcpyAsync(d_d[s], dp_start, n * 2, cudaMemcpyDeviceToDevice, lab.stream)); };
    c = bwd;
    c.version = 1;
    c.run = [&](int s) {
        softmax_backward_rows<<<ceil_div(rows, 128), 128, 0, lab.stream>>>(d_d[s], d_attin[s], rows, T, scale);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        softmax_backward_block<<<rows, 256, 0, lab.stream>>>(d_d[s], d_attin[s], rows, T, scale);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) {
        softmax_backward_warp<<<ceil_div(rows, 8), 256, 0, lab.stream>>>(d_d[s], d_attin[s], rows, T, scale);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 4;
    c.run = [&](int s) {  // as attention_backward launches it
        causal_softmax_backward(d_d[s], d_attin[s], rows, T, scale, lab.stream);
    };
    lab_case(&lab, c);
    return lab_end(&lab);
}
