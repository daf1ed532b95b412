// test_gpu_buffers.cpp — the GPU trainer's buffer table (llmc/gpu_buffers.h) and MFU peak table,
// checked on the CPU: the trainer allocates exactly these sizes, so they must be right without a GPU.
#include <cstdio>
#include <string>
#include "llmc/gpu_buffers.h"
#include "llmc/training.h"

static int failures = 0;
static void check(bool ok, const char* name, const std::string& why) {
    if (ok) printf("PASS: %s\n", name);
    else { printf("FAIL: %s: %s\n", name, why.c_str()); failures++; }
}

static GPURunShape d12(int B, int T, int recompute) {
    GPURunShape s;
    parse_model_descriptor("d12", &s.cfg);
    s.B = B, s.T = T, s.recompute = recompute;
    s.cudnn_workspace_bytes = 1 << 20;
    return s;
}

int main() {
    const size_t P = 124475904, BT = 4 * 1024, C = 768, L = 12, NH = 12;
    auto t = gpu_buffer_table(d12(4, 1024, 1));
    check(t[GB_PARAMS].bytes() == P * 2 && t[GB_GRADS].bytes() == P * 2, "bf16 params and grads are 2 bytes x N",
          strprintf("%zu %zu", t[GB_PARAMS].bytes(), t[GB_GRADS].bytes()));
    check(t[GB_MASTER].bytes() == P * 4 && t[GB_ADAM_M].bytes() == P * 4 && t[GB_ADAM_V].bytes() == P * 4,
          "fp32 master, m, v are 4 bytes x N", "");
    check(t[GB_QKV].bytes() == L * BT * 3 * C * 2 && t[GB_RESIDUAL].bytes() == (L + 1) * BT * C * 2,
          "per-layer activations are stacked over the layers", strprintf("qkv %zu", t[GB_QKV].bytes()));
    check(t[GB_LOGITS].bytes() == BT * 50304 * 2, "logits are (B, T, Vp) bf16", "");
    check(t[GB_ATT].bytes() == L * 4 * NH * 1024 * 4 && t[GB_ATT_SCORES].bytes() == 0 && t[GB_CUDNN_WORKSPACE].bytes() == (1 << 20),
          "cuDNN attention keeps only the (B, NH, T) stats", strprintf("att %zu", t[GB_ATT].bytes()));

    auto r0 = gpu_buffer_table(d12(4, 1024, 0)), r2 = gpu_buffer_table(d12(4, 1024, 2));
    check(r0[GB_FCH_GELU].bytes() == L * BT * 4 * C * 2 && r0[GB_GELU_RECOMPUTE].bytes() == 0 &&
          t[GB_FCH_GELU].bytes() == 0 && t[GB_GELU_RECOMPUTE].bytes() == BT * 4 * C * 2,
          "recompute 1 replaces the per-layer fch_gelu by one layer of scratch", "");
    check(r2[GB_LN1].bytes() == 0 && r2[GB_LN2].bytes() == 0 && r2[GB_LN_RECOMPUTE].bytes() == BT * C * 2 &&
          t[GB_LN1].bytes() == L * BT * C * 2, "recompute 2 replaces ln1/ln2 by one layer of scratch", "");
    size_t total0 = gpu_buffer_total(r0), total1 = gpu_buffer_total(t), total2 = gpu_buffer_total(r2);
    check(total0 > total1 && total1 > total2, "each recompute level needs less memory",
          strprintf("%zu %zu %zu", total0, total1, total2));

    GPURunShape s = d12(4, 1024, 1);
    s.master_weights = false;
    check(gpu_buffer_table(s)[GB_MASTER].bytes() == 0, "--master-weights 0 allocates no master copy", "");
    s = d12(4, 1024, 1);
    s.simple_attention = true;
    auto simple = gpu_buffer_table(s);
    check(simple[GB_ATT].bytes() == L * 4 * NH * 1024 * 1024 * 2 && simple[GB_CUDNN_WORKSPACE].bytes() == 0 &&
          simple[GB_ATT_QKV].bytes() == 3 * BT * C * 2,
          "simple attention keeps (B, NH, T, T) per layer and no cuDNN workspace", "");
    s = d12(4, 1024, 1);
    s.dtype_bytes = 4;
    check(gpu_buffer_table(s)[GB_PARAMS].bytes() == P * 4, "the fp32 build's parameters are 4 bytes", "");

    s = d12(4, 1024, 1);
    s.layer_begin = 3, s.layer_end = 9, s.opt_begin = 1000, s.opt_count = 5000;
    auto part = gpu_buffer_table(s);
    check(part[GB_QKV].bytes() == 6 * BT * 3 * C * 2 && part[GB_ADAM_M].bytes() == 5000 * 4 &&
          part[GB_MASTER].bytes() == 5000 * 4 && part[GB_PARAMS].bytes() == P * 2,
          "a rank's layer range and optimizer slice size its buffers", "");

    // data parallelism: params and grads padded to world_size equal shards (134,912 on 3 ranks ->
    // 134,976 = 3 x 44,992), the optimizer state only for the rank's ZeRO-1 shard
    GPURunShape dp;
    parse_model_descriptor("L=2,C=64,H=4,T=32,V=512", &dp.cfg);
    dp.B = 1, dp.T = 32, dp.world_size = 3, dp.opt_begin = 44992, dp.opt_count = 44992;
    auto three = gpu_buffer_table(dp);
    check(three[GB_PARAMS].bytes() == 134976 * 2 && three[GB_GRADS].bytes() == 134976 * 2 &&
              three[GB_ADAM_V].bytes() == 44992 * 4 && three[GB_MASTER].bytes() == 44992 * 4,
          "3 ranks: params and grads padded to 3 equal shards, master/m/v for one shard (ZeRO-1)",
          strprintf("params %zu, adam_v %zu", three[GB_PARAMS].bytes(), three[GB_ADAM_V].bytes()));

    size_t sum = 0;
    for (const BufferSpec& b : t) {
        sum += gpu_buffer_allocated_bytes(b);
        if (b.bytes() % 256 != 0 && gpu_buffer_allocated_bytes(b) <= b.bytes()) sum = 0;
    }
    check(sum == total1 && sum > 0, "the total is the sum of the 256-byte-rounded buffers", "");

    // the largest batch that fits: exact at the boundary, 0 when nothing fits
    GPURunShape want = d12(16, 1024, 1), b8 = d12(8, 1024, 1);
    b8.cudnn_workspace_bytes = cudnn_workspace_estimate(b8.cfg, 8, 1024);
    size_t free8 = gpu_buffer_total(gpu_buffer_table(b8)) + GPU_MEMORY_MARGIN_BYTES;
    check(largest_batch_that_fits(want, free8) == 8 && largest_batch_that_fits(want, free8 - 1) == 7,
          "largest_batch_that_fits is exact at the boundary",
          strprintf("%d %d", largest_batch_that_fits(want, free8), largest_batch_that_fits(want, free8 - 1)));
    check(largest_batch_that_fits(want, 1 << 20) == 0, "nothing fits in 1 MiB", "");

    // the MFU denominators
    check(gpu_peak_bf16_tflops("NVIDIA H100 80GB HBM3") == 989 && gpu_peak_bf16_tflops("NVIDIA H100 PCIe") == 756 &&
          gpu_peak_bf16_tflops("NVIDIA H200") == 989 && gpu_peak_bf16_tflops("NVIDIA A100-SXM4-80GB") == 312 &&
          gpu_peak_bf16_tflops("NVIDIA A100 80GB PCIe") == 312, "peak table knows H100 SXM/PCIe, H200, A100", "");
    check(gpu_peak_bf16_tflops("NVIDIA GeForce RTX 4090") == 0 && gpu_peak_bf16_tflops("NVIDIA H100 NVL") == 0,
          "other GPUs are unknown (no MFU)", "");
    return failures ? 1 : 0;
}
