// layernorm.cu — LayerNorm forward and backward: reductions along a row, and reductions down columns.
//
//   forward   mean = sum(x)/C, rstd = 1/sqrt(sum((x - mean)^2)/C + 1e-5), y = (x - mean) rstd w + b
//   backward  xhat = (x - mean) rstd, g = dy w
//             dx += rstd (g - mean(g) - xhat mean(g xhat))          (per row)
//             dw += sum over rows of dy xhat,  db += sum over rows of dy   (per column)
// N = B*T rows of C = 768 channels. Both are memory-bound: the forward reads a row and writes a
// row (4C bytes), the backward reads dy and x and reads and writes dx (8C bytes per row).
//
// Forward versions:
//   1. one thread per row, three loops over its C channels (sum, squared deviations, output). The
//      lanes of a warp read 32 rows at once: 32 cache lines per load instruction, uncoalesced.
//   2. one warp per row: lanes take every 32nd channel (coalesced), partial sums are combined
//      with warp shuffles (5 steps of __shfl_xor_sync, no shared memory), 2-byte loads.
//   3. trainer's (llmc/kernels/layernorm.cuh, fused_residual_layernorm_forward without the residual): a
//      warp per row with 16-byte loads; the row's second and third reads hit L1.
// Prediction: 1 at ~5-10% of the copy ceiling, 2 at ~50-70%, 3 at ~80-90%.
//
// Backward versions. The row part is like the forward; the column sums are the lesson:
//   1. one thread per row for dx, then one thread per channel for dw and db, each looping over all
//      N rows. Correct and deterministic, but the column kernel has only C = 768 threads: 6 blocks
//      on a 132-SM GPU, each thread walking 8192 rows one after the other.
//   2. one warp per row for dx; each block sums dw and db over its rows in shared memory and adds
//      its partial sums to an fp32 gradient with atomicAdd; a last pass adds that to the bf16 dw,
//      db. Parallel, but the order of the atomics is a race: not bit-reproducible.
//   3. the trainer's until version 4: each block of 4 warps takes 64 rows, each warp adds its rows'
//      dy*xhat and dy into its own shared-memory row, the block writes one partial, and a second
//      kernel adds the partials in order (llmc/kernels/cuda_common.cuh, add_column_partials):
//      parallel AND deterministic. But it wastes: 128 blocks of 4 warps at B=8 (4 warps an SM, too
//      few loads in flight to cover DRAM's latency), a row's loads in two rounds (dy and x, then dx
//      and dy, x again from L1) one row after another, and two shared-memory read-modify-writes per
//      element, with a lane's 8 channels 8 floats apart from its neighbour's: 8-way bank conflicts.
//      Measured on an H200: 13% of copy.
//   4. trainer's (llmc/kernels/layernorm.cuh): a row belongs to a group of C/8 threads, 8 channels
//      each; a thread loads dy, x and dx of two rows at once (six 16-byte loads in flight), keeps them
//      in registers through the row sums and writes dx from them: each byte read once, one latency
//      per two rows. The thread owns its channels for all the block's rows, so dw and db add up in
//      its registers: no shared memory per element, no atomics. A fixed grid of 256 blocks of 4
//      groups (12 warps at C = 768) strides over the rows; a block adds its groups in order into one
//      partial, add_column_partials adds the 256 partials in order: deterministic on any GPU.
// Floor: 8 bytes per element (dy, x read; dx read and written), 50 MB at B=8, ~12 us at 4.2 TB/s;
// version 4 adds 256 partials of 2C floats written and read (3 MB, 6%).
// Prediction: 1 far below 10% (the column loop), 2 and 3 at ~60-80% of the copy ceiling (measured:
// 4.5% and 13.4%: see above for 3), 4 at 70-85%.
#include "dev/cuda/common.h"
#include "llmc/kernels/layernorm.cuh"

static const std::vector<Version> VERSIONS = {
    {"layernorm_forward", 1, "thread per row", "one thread per row, three loops over the channels", false},
    {"layernorm_forward", 2, "warp per row", "one warp per row, lanes over channels, warp-shuffle sums, 2-byte loads", false},
    {"layernorm_forward", 3, "trainer: warp, 16B", "llmc/kernels/layernorm.cuh: a warp per row, 16-byte loads", true},
    {"layernorm_backward", 1, "thread per row/column", "dx: a thread per row; dw, db: a thread per channel over all rows", false},
    {"layernorm_backward", 2, "warp per row, atomics", "dx: a warp per row; dw, db: shared-memory block sums + fp32 atomics", false},
    {"layernorm_backward", 3, "warp per row, 64-row partials", "the trainer's until version 4: 64 rows a block, shared-memory accumulators, partials summed in order", false},
    {"layernorm_backward", 4, "trainer: rows in registers", "llmc/kernels/layernorm.cuh: each row read once into registers, dw/db in registers, 256 partials in order", true},
};

// ---- forward 1: one thread per row
__global__ void layernorm_forward_rows(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* weight,
                                       const floatX* bias, int N, int C) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const floatX* x = inp + (size_t)row * C;
    float m = 0.0f;
    for (int c = 0; c < C; c++) m += __bfloat162float(x[c]);
    m /= C;
    float v = 0.0f;
    for (int c = 0; c < C; c++) {
        float d = __bfloat162float(x[c]) - m;
        v += d * d;
    }
    float s = 1.0f / sqrtf(v / C + LN_EPS);
    for (int c = 0; c < C; c++)
        out[(size_t)row * C + c] = __float2bfloat16((__bfloat162float(x[c]) - m) * s * __bfloat162float(weight[c]) +
                                                    __bfloat162float(bias[c]));
    mean[row] = m;
    rstd[row] = s;
}

// ---- forward 2: one warp per row, scalar loads
__global__ void layernorm_forward_warp(floatX* out, float* mean, float* rstd, const floatX* inp, const floatX* weight,
                                       const floatX* bias, int N, int C) {
    int row = blockIdx.x * (blockDim.x / 32) + threadIdx.x / 32, lane = threadIdx.x % 32;
    if (row >= N) return;  // the whole warp leaves together: the shuffles below see all 32 lanes
    const floatX* x = inp + (size_t)row * C;
    float sum = 0.0f;
    for (int c = lane; c < C; c += 32) sum += __bfloat162float(x[c]);
    float m = warp_sum(sum) / C;
    float var = 0.0f;
    for (int c = lane; c < C; c += 32) {
        float d = __bfloat162float(x[c]) - m;
        var += d * d;
    }
    float s = 1.0f / sqrtf(warp_sum(var) / C + LN_EPS);
    for (int c = lane; c < C; c += 32)
        out[(size_t)row * C + c] = __float2bfloat16((__bfloat162float(x[c]) - m) * s * __bfloat162float(weight[c]) +
                                                    __bfloat162float(bias[c]));
    if (lane == 0) {
        mean[row] = m;
        rstd[row] = s;
    }
}

// ---- backward 1: a thread per row (dx), then a thread per channel (dw, db)
__global__ void layernorm_backward_dx_rows(floatX* dinp, const floatX* dout, const floatX* inp, const floatX* weight,
                                           const float* mean, const float* rstd, int N, int C) {
    int row = blockIdx.x * blockDim.x + threadIdx.x;
    if (row >= N) return;
    const floatX* dy = dout + (size_t)row * C;
    const floatX* x = inp + (size_t)row * C;
    float m = mean[row], s = rstd[row], mean_g = 0.0f, mean_g_xhat = 0.0f;
    for (int c = 0; c < C; c++) {
        float g = __bfloat162float(dy[c]) * __bfloat162float(weight[c]);
        mean_g += g;
        mean_g_xhat += g * (__bfloat162float(x[c]) - m) * s;
    }
    mean_g /= C;
    mean_g_xhat /= C;
    floatX* dx = dinp + (size_t)row * C;
    for (int c = 0; c < C; c++) {
        float xhat = (__bfloat162float(x[c]) - m) * s;
        float g = __bfloat162float(dy[c]) * __bfloat162float(weight[c]);
        dx[c] = __float2bfloat16(__bfloat162float(dx[c]) + s * (g - mean_g - xhat * mean_g_xhat));
    }
}
__global__ void layernorm_backward_dw_columns(floatX* dweight, floatX* dbias, const floatX* dout, const floatX* inp,
                                              const float* mean, const float* rstd, int N, int C) {
    int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    float dw = 0.0f, db = 0.0f;
    for (int row = 0; row < N; row++) {
        float dy = __bfloat162float(dout[(size_t)row * C + c]);
        dw += dy * (__bfloat162float(inp[(size_t)row * C + c]) - mean[row]) * rstd[row];
        db += dy;
    }
    dweight[c] = __float2bfloat16(__bfloat162float(dweight[c]) + dw);
    dbias[c] = __float2bfloat16(__bfloat162float(dbias[c]) + db);
}

// ---- backward 2: a warp per row; block sums in shared memory, then fp32 atomics.
// Dynamic shared memory: 2C floats. dw32, db32 must be zero on entry.
__global__ void layernorm_backward_atomic(floatX* dinp, float* dw32, float* db32, const floatX* dout, const floatX* inp,
                                          const floatX* weight, const float* mean, const float* rstd, int N, int C) {
    extern __shared__ float block_acc[];  // [0, C): dw, [C, 2C): db
    float* dw_acc = block_acc;
    float* db_acc = block_acc + C;
    for (int c = threadIdx.x; c < 2 * C; c += blockDim.x) block_acc[c] = 0.0f;
    __syncthreads();
    int warps = blockDim.x / 32, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    for (int row = blockIdx.x * warps + warp; row < N; row += gridDim.x * warps) {
        const floatX* dy = dout + (size_t)row * C;
        const floatX* x = inp + (size_t)row * C;
        float m = mean[row], s = rstd[row], sum_g = 0.0f, sum_g_xhat = 0.0f;
        for (int c = lane; c < C; c += 32) {
            float d = __bfloat162float(dy[c]), xhat = (__bfloat162float(x[c]) - m) * s;
            float g = d * __bfloat162float(weight[c]);
            sum_g += g;
            sum_g_xhat += g * xhat;
            atomicAdd(&dw_acc[c], d * xhat);  // shared-memory atomics: the warps of the block race here
            atomicAdd(&db_acc[c], d);
        }
        float mean_g = warp_sum(sum_g) / C, mean_g_xhat = warp_sum(sum_g_xhat) / C;
        floatX* dx = dinp + (size_t)row * C;
        for (int c = lane; c < C; c += 32) {
            float xhat = (__bfloat162float(x[c]) - m) * s;
            float g = __bfloat162float(dy[c]) * __bfloat162float(weight[c]);
            dx[c] = __float2bfloat16(__bfloat162float(dx[c]) + s * (g - mean_g - xhat * mean_g_xhat));
        }
    }
    __syncthreads();
    for (int c = threadIdx.x; c < C; c += blockDim.x) {  // ... and the blocks race here
        atomicAdd(&dw32[c], dw_acc[c]);
        atomicAdd(&db32[c], db_acc[c]);
    }
}

constexpr int OLD_WARPS = 4, OLD_ROWS_PER_BLOCK = 64;

// ---- backward 3: the trainer's until version 4 (llmc/kernels/layernorm.cuh at 31fc5de).
// dinp += dx for rows [64*blockIdx.x, +64); partials[blockIdx.x] = (sum dy*xhat, sum dy) per channel.
// Dynamic shared memory: OLD_WARPS * 2 * C floats.
__global__ void layernorm_backward_64rows(floatX* dinp, float* partials, const floatX* dout, const floatX* inp,
                                          const floatX* weight, const float* mean, const float* rstd, int N, int C) {
    extern __shared__ float warp_acc[];
    int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    float* dw_acc = warp_acc + (size_t)warp * 2 * C;
    float* db_acc = dw_acc + C;
    // each lane zeroes, and later updates, only its own channels: no synchronisation needed
    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
        for (int k = 0; k < x128::size; k++) dw_acc[c + k] = db_acc[c + k] = 0.0f;
    }
    int row_end = min(N, (blockIdx.x + 1) * OLD_ROWS_PER_BLOCK);
    for (int row = blockIdx.x * OLD_ROWS_PER_BLOCK + warp; row < row_end; row += OLD_WARPS) {
        const floatX* dy = dout + (size_t)row * C;
        const floatX* x = inp + (size_t)row * C;
        float m = mean[row], s = rstd[row];
        float sum_g = 0.0f, sum_g_xhat = 0.0f;
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
            x128 dy8 = load128(dy + c), x8 = load128(x + c), w8 = load128(weight + c);
            for (int k = 0; k < x128::size; k++) {
                float d = to_float(dy8[k]);
                float xhat = (to_float(x8[k]) - m) * s;
                float g = d * to_float(w8[k]);
                sum_g += g;
                sum_g_xhat += g * xhat;
                dw_acc[c + k] += d * xhat;
                db_acc[c + k] += d;
            }
        }
        float mean_g = warp_sum(sum_g) / C;
        float mean_g_xhat = warp_sum(sum_g_xhat) / C;
        floatX* dx = dinp + (size_t)row * C;
        for (int c = lane * x128::size; c < C; c += 32 * x128::size) {
            x128 dy8 = load128(dy + c), x8 = load128(x + c), w8 = load128(weight + c), dx8 = load128(dx + c);
            for (int k = 0; k < x128::size; k++) {
                float xhat = (to_float(x8[k]) - m) * s;
                float g = to_float(dy8[k]) * to_float(w8[k]);
                dx8[k] = from_float<floatX>(to_float(dx8[k]) + s * (g - mean_g - xhat * mean_g_xhat));
            }
            store128(dx + c, dx8);
        }
    }
    __syncthreads();
    float* out = partials + (size_t)blockIdx.x * 2 * C;
    for (int c = threadIdx.x; c < C; c += blockDim.x) {
        float dw = 0.0f, db = 0.0f;
        for (int w = 0; w < OLD_WARPS; w++) {
            dw += warp_acc[(size_t)w * 2 * C + c];
            db += warp_acc[(size_t)w * 2 * C + C + c];
        }
        out[c] = dw;
        out[C + c] = db;
    }
}


int main(int argc, char** argv) {
    Lab lab;
    lab_begin(&lab, argc, argv, "layernorm", VERSIONS);
    int N = lab.B * lab.T, C = lab.C;
    size_t nc = (size_t)N * C;

    // a residual stream with an offset, so the means are not all near zero
    std::vector<float> x = random_normal(nc, next_seed(&lab), 0.5f, 1.5f);
    std::vector<float> w = random_normal(C, next_seed(&lab), 1.0f, 0.2f);
    std::vector<float> b = random_normal(C, next_seed(&lab), 0.0f, 0.2f);
    std::vector<float> dy = random_normal(nc, next_seed(&lab), 0.0f, 1.0f);
    std::vector<float> dx0 = random_normal(nc, next_seed(&lab), 0.0f, 1.0f);
    std::vector<float> dw0 = random_normal(C, next_seed(&lab), 0.0f, 1.0f);
    std::vector<float> db0 = random_normal(C, next_seed(&lab), 0.0f, 1.0f);
    for (auto* v : {&x, &w, &b, &dy, &dx0, &dw0, &db0}) round_to_bf16(v);

    std::vector<float> y_ref(nc), mean_ref(N), rstd_ref(N);
    cpu::layernorm_forward(y_ref.data(), mean_ref.data(), rstd_ref.data(), x.data(), w.data(), b.data(), N, C);
    std::vector<float> dx_ref = dx0, dw_ref = dw0, db_ref = db0;
    cpu::layernorm_backward(dx_ref.data(), dw_ref.data(), db_ref.data(), dy.data(), x.data(), w.data(), mean_ref.data(),
                            rstd_ref.data(), N, C);

    // ---- forward: x read, y written, mean and rstd written
    double fwd_bytes = 4.0 * nc + 8.0 * N + 4.0 * C;
    int slots = lab_slots(lab, fwd_bytes);
    std::vector<floatX*> d_x = to_device<floatX>(x, slots), d_y = device_slots<floatX>(nc, slots);
    std::vector<float*> d_mean = device_slots<float>(N, slots), d_rstd = device_slots<float>(N, slots);
    floatX* d_w = to_device<floatX>(w, 1)[0];
    floatX* d_b = to_device<floatX>(b, 1)[0];
    Case fwd;
    fwd.kernel = "layernorm_forward";
    fwd.bytes = fwd_bytes;
    fwd.slots = slots;
    fwd.checks = {bf16_output("y", d_y[0], y_ref), f32_output("mean", d_mean[0], mean_ref),
                  f32_output("rstd", d_rstd[0], rstd_ref)};
    Case c = fwd;
    c.version = 1;
    c.run = [&](int s) {
        layernorm_forward_rows<<<ceil_div(N, 128), 128, 0, lab.stream>>>(d_y[s], d_mean[s], d_rstd[s], d_x[s], d_w, d_b, N, C);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        layernorm_forward_warp<<<ceil_div(N, 8), 256, 0, lab.stream>>>(d_y[s], d_mean[s], d_rstd[s], d_x[s], d_w, d_b, N, C);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) {
        fused_residual_layernorm_forward(nullptr, d_y[s], d_mean[s], d_rstd[s], d_x[s], nullptr, d_w, d_b, N, C, lab.stream);
    };
    lab_case(&lab, c);

    // ---- backward: dy, x read; dx read and written; mean, rstd read
    double bwd_bytes = 8.0 * nc + 8.0 * N + 10.0 * C;
    slots = lab_slots(lab, bwd_bytes);
    std::vector<floatX*> d_xb = to_device<floatX>(x, slots), d_dy = to_device<floatX>(dy, slots);
    std::vector<float*> d_meanb = to_device<float>(mean_ref, slots), d_rstdb = to_device<float>(rstd_ref, slots);
    std::vector<floatX*> d_dx = to_device<floatX>(dx0, slots), d_dw = to_device<floatX>(dw0, slots),
                         d_db = to_device<floatX>(db0, slots);
    floatX* dx_start = to_device<floatX>(dx0, 1)[0];
    floatX* dw_start = to_device<floatX>(dw0, 1)[0];
    floatX* db_start = to_device<floatX>(db0, 1)[0];
    float* dwdb32 = device_alloc<float>(2 * (size_t)C);
    float* partials_64rows = device_alloc<float>((size_t)ceil_div(N, OLD_ROWS_PER_BLOCK) * 2 * C);
    float* partials = device_alloc<float>(layernorm_backward_partials_floats(N, C));
    Case bwd;
    bwd.kernel = "layernorm_backward";
    bwd.bytes = bwd_bytes;
    bwd.slots = slots;
    bwd.checks = {bf16_output("dx", d_dx[0], dx_ref, false), bf16_output("dw", d_dw[0], dw_ref, false),
                  bf16_output("db", d_db[0], db_ref, false)};
    bwd.prepare = [&](int s) {  // the start values of what the backward adds to
        CUDA_CHECK(cudaMemcpyAsync(d_dx[s], dx_start, nc * 2, cudaMemcpyDeviceToDevice, lab.stream));
        CUDA_CHECK(cudaMemcpyAsync(d_dw[s], dw_start, (size_t)C * 2, cudaMemcpyDeviceToDevice, lab.stream));
        CUDA_CHECK(cudaMemcpyAsync(d_db[s], db_start, (size_t)C * 2, cudaMemcpyDeviceToDevice, lab.stream));
    };
    c = bwd;
    c.version = 1;
    c.run = [&](int s) {
        layernorm_backward_dx_rows<<<ceil_div(N, 128), 128, 0, lab.stream>>>(d_dx[s], d_dy[s], d_xb[s], d_w, d_meanb[s],
                                                                            d_rstdb[s], N, C);
        CUDA_CHECK_LAUNCH();
        layernorm_backward_dw_columns<<<ceil_div(C, 128), 128, 0, lab.stream>>>(d_dw[s], d_db[s], d_dy[s], d_xb[s],
                                                                               d_meanb[s], d_rstdb[s], N, C);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 2;
    c.run = [&](int s) {
        CUDA_CHECK(cudaMemsetAsync(dwdb32, 0, 2 * (size_t)C * 4, lab.stream));
        int blocks = std::min(ceil_div(N, 8), 2 * lab.prop.multiProcessorCount);
        layernorm_backward_atomic<<<blocks, 256, 2 * C * sizeof(float), lab.stream>>>(
            d_dx[s], dwdb32, dwdb32 + C, d_dy[s], d_xb[s], d_w, d_meanb[s], d_rstdb[s], N, C);
        CUDA_CHECK_LAUNCH();
        add_f32_to_bf16<<<ceil_div(C, 256), 256, 0, lab.stream>>>(d_dw[s], dwdb32, C);
        CUDA_CHECK_LAUNCH();
        add_f32_to_bf16<<<ceil_div(C, 256), 256, 0, lab.stream>>>(d_db[s], dwdb32 + C, C);
        CUDA_CHECK_LAUNCH();
    };
    lab_case(&lab, c);
    c.version = 3;
    c.run = [&](int s) {
        int blocks = ceil_div(N, OLD_ROWS_PER_BLOCK);
        size_t shared = (size_t)OLD_WARPS * 2 * C * sizeof(float);
        if (shared > 48 * 1024)
            CUDA_CHECK(cudaFuncSetAttribute(layernorm_backward_64rows, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared));
        layernorm_backward_64rows<<<blocks, OLD_WARPS * 32, shared, lab.stream>>>(d_dx[s], partials_64rows, d_dy[s], d_xb[s],
                                                                                  d_w, d_meanb[s], d_rstdb[s], N, C);
        CUDA_CHECK_LAUNCH();
        add_column_partials(d_dw[s], partials_64rows, blocks, 2 * (size_t)C, C, lab.stream);
        add_column_partials(d_db[s], partials_64rows + C, blocks, 2 * (size_t)C, C, lab.stream);
    };
    lab_case(&lab, c);
    c.version = 4;
    c.run = [&](int s) {
        layernorm_backward(d_dx[s], d_dw[s], d_db[s], partials, d_dy[s], d_xb[s], d_w, d_meanb[s], d_rstdb[s], N, C,
                           lab.stream);
    };
    lab_case(&lab, c);
    return lab_end(&lab);
}
