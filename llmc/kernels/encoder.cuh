// encoder.cuh — token + position embedding, forward and a deterministic backward.
//
// Forward: x[b,t,:] = wte[token[b,t],:] + wpe[t,:]. Pure memory traffic: read 2 rows, write 1, in
// 16-byte vectors (one thread per 8 channels).
//
// Backward: dwpe[t,:] += sum over b of dx[b,t,:], and dwte[v,:] += sum over the positions holding
// token v of dx[pos,:]. The natural kernel (every position adds its row into dwte with atomics) is
// fast but not deterministic: a frequent token ("the", ",") gets hundreds of adds in a racing order.
// Instead the host, which has the tokens anyway, sorts the positions of the micro-batch by token
// (a counting sort, O(BT + V)) into buckets; one block owns one bucket, sums its rows in position
// order and adds the sum to that token's row. No two blocks touch the same row, and the order of
// every sum is fixed. Traffic: dx read once by each kernel (the second time mostly from L2), each
// touched dwte row read and written once. Floor at d12, B=8: ~35 MB, ~8 us at 4.2 TB/s.
#pragma once

#include <algorithm>
#include <vector>
#include "llmc/kernels/cuda_common.cuh"

__global__ void encoder_forward_kernel(floatX* out, const int* tokens, const floatX* wte, const floatX* wpe, int BT,
                                       int T, int C) {
    int chunks = C / x128::size;
    size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= (size_t)BT * chunks) return;
    int bt = (int)(idx / chunks), c = (int)(idx % chunks) * x128::size;
    x128 tok = load128(wte + (size_t)tokens[bt] * C + c);
    x128 pos = load128(wpe + (size_t)(bt % T) * C + c);
    x128 o;
    for (int k = 0; k < x128::size; k++) o[k] = from_float<floatX>(to_float(tok[k]) + to_float(pos[k]));
    store128(out + (size_t)bt * C + c, o);
}

inline void encoder_forward(floatX* out, const int* tokens, const floatX* wte, const floatX* wpe, int B, int T, int C,
                            cudaStream_t stream) {
    size_t threads = (size_t)B * T * (C / x128::size);
    encoder_forward_kernel<<<ceil_div(threads, 256), 256, 0, stream>>>(out, tokens, wte, wpe, B * T, T, C);
    CUDA_CHECK_LAUNCH();
}

// dwpe: one thread per (t, 8 channels), summing over b in order.
__global__ void encoder_backward_wpe_kernel(floatX* dwpe, const floatX* dout, int B, int T, int C) {
    int chunks = C / x128::size;
    int idx = blockIdx.x * blockDim.x + threadIdx.x;
    if (idx >= T * chunks) return;
    int t = idx / chunks, c = (idx % chunks) * x128::size;
    float sum[x128::size] = {};
    for (int b = 0; b < B; b++) {
        x128 d = load128(dout + ((size_t)b * T + t) * C + c);
        for (int k = 0; k < x128::size; k++) sum[k] += to_float(d[k]);
    }
    floatX* dst = dwpe + (size_t)t * C + c;
    x128 acc = load128(dst);
    for (int k = 0; k < x128::size; k++) acc[k] = from_float<floatX>(to_float(acc[k]) + sum[k]);
    store128(dst, acc);
}

// The buckets, as the host lays them out in one int array of 3*BT+1 (see encoder_buckets_build):
//   [0, BT)                 positions, sorted by token, ascending within a token
//   [BT, 2BT + 1)           bucket u holds positions [start[u], start[u+1]); past U, every start is
//                           the end, so a grid of more than U blocks (CUDA graphs: a grid fixed at
//                           capture, llmc/run/cuda_graphs.cuh) finds empty buckets there
//   [2BT + 1, 2BT + 1 + U)  the token of bucket u
// Bucket u read from that layout: its positions are positions[begin, end) (none past U), its token's row.
struct EncoderBucket {
    const int* positions;
    int begin, end, token;
};
__device__ __forceinline__ EncoderBucket encoder_bucket(const int* buckets, int BT, int u) {
    const int* start = buckets + BT;
    EncoderBucket b{buckets, start[u], start[u + 1], 0};
    if (b.begin < b.end) b.token = buckets[2 * BT + 1 + u];  // past U no token is stored
    return b;
}

// One block per bucket, one thread per 16 bytes of the row (C/8 threads, rounded up to whole warps).
// Most buckets hold one position, a few hold hundreds ("the", ","): a thread that loads a row, adds
// it, then loads the next, pays one DRAM latency per position, and the longest bucket's block is the
// kernel's tail (the lab measured 14% of copy on an H200). So the thread first loads the dwte row it
// will add to (its latency hides behind the sums), then ENCODER_ROWS_IN_FLIGHT positions' indices,
// then their rows, all before adding any: one latency per 8 positions. The additions are in
// position order, as before: the same bits as the one-row-at-a-time loop.
constexpr int ENCODER_ROWS_IN_FLIGHT = 8;
__global__ void encoder_backward_wte_kernel(floatX* dwte, const floatX* dout, const int* buckets, int BT, int C) {
    constexpr int R = ENCODER_ROWS_IN_FLIGHT;
    EncoderBucket b = encoder_bucket(buckets, BT, blockIdx.x);
    if (b.begin == b.end) return;  // past the last bucket (a grid sized for the most buckets a batch can have)
    floatX* row = dwte + (size_t)b.token * C;
    for (int c = threadIdx.x * x128::size; c < C; c += blockDim.x * x128::size) {
        x128 acc = load128(row + c);
        float sum[x128::size] = {};
        for (int first = b.begin; first < b.end; first += R) {
            int n = min(R, b.end - first);
            int pos[R];
            x128 d[R];
            for (int r = 0; r < R; r++) pos[r] = r < n ? b.positions[first + r] : 0;
            for (int r = 0; r < R; r++) d[r] = r < n ? load128cs(dout + (size_t)pos[r] * C + c) : x128::zeros();
            for (int r = 0; r < n; r++)
                for (int k = 0; k < x128::size; k++) sum[k] += to_float(d[r][k]);
        }
        for (int k = 0; k < x128::size; k++) acc[k] = from_float<floatX>(to_float(acc[k]) + sum[k]);
        store128(row + c, acc);
    }
}

// Host side: counting sort of the positions by token. Returns the number of buckets U; `out` gets
// the 3*BT+1 ints described above (only the first 2BT+1+U are meaningful).
//
// With tensor parallelism a rank holds only the rows [first_row, first_row + vocab) of wte
// (llmc/parallel/tensor_parallel.cuh): its buckets are those of its rows' tokens, numbered from its first row,
// and the other positions are in no bucket (their gradient flows into another rank's rows). On one
// rank first_row = 0 and vocab is the whole vocabulary: every position is in a bucket.
inline int encoder_buckets_build(const int* tokens, int BT, int vocab, std::vector<int>* count_scratch, int* out,
                                 int first_row = 0) {
    std::vector<int>& count = *count_scratch;
    count.assign((size_t)vocab + 1, 0);
    auto row_of = [&](int i) { return tokens[i] - first_row; };  // outside [0, vocab): another rank's row
    for (int i = 0; i < BT; i++)
        if (row_of(i) >= 0 && row_of(i) < vocab) count[row_of(i) + 1]++;
    for (int v = 0; v < vocab; v++) count[v + 1] += count[v];  // count[v] = first slot of token v
    int* positions = out;
    int* start = out + BT;
    int* token_of = out + 2 * BT + 1;
    int U = 0;
    for (int v = 0; v < vocab; v++) {
        if (count[v + 1] > count[v]) {
            start[U] = count[v];
            token_of[U] = v;
            U++;
        }
    }
    for (int u = U; u <= BT; u++) start[u] = count[vocab];  // the end (BT on one rank), and empty buckets past it
    for (int i = 0; i < BT; i++)  // ascending i: stable within a token
        if (row_of(i) >= 0 && row_of(i) < vocab) positions[count[row_of(i)]++] = i;
    return U;
}

inline void encoder_backward(floatX* dwte, floatX* dwpe, const floatX* dout, const int* buckets_device, int buckets,
                             int B, int T, int C, cudaStream_t stream) {
    encoder_backward_wpe_kernel<<<ceil_div(T * (C / x128::size), 256), 256, 0, stream>>>(dwpe, dout, B, T, C);
    CUDA_CHECK_LAUNCH();
    if (buckets > 0) {
        int threads = std::min(1024, ceil_div(C / x128::size, 32) * 32);
        encoder_backward_wte_kernel<<<buckets, threads, 0, stream>>>(dwte, dout, buckets_device, B * T, C);
        CUDA_CHECK_LAUNCH();
    }
}
