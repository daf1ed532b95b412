// test_gpu_buffers.cpp — the GPU trainer's buffer table (llmc/memory/gpu_buffers.h) and MFU peak table,
// checked on the CPU: the trainer allocates exactly these sizes, so they must be right without a GPU.
#include <cstdio>
#include <string>
#include "llmc/memory/gpu_buffers.h"
#include "llmc/parallel/process_grid.h"
#include "llmc/run/step.h"
#include "test/checks.h"

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

    // data parallelism: params and grads padded to world_size equal shards (134,912 on 3 ranks ->
    // 134,976 = 3 x 44,992), the optimizer state only for the rank's ZeRO-1 shard
    GPURunShape dp;
    parse_model_descriptor("L=2,C=64,H=4,T=32,V=512", &dp.cfg);
    dp.B = 1, dp.T = 32;
    make_grid(3, 1, 1, 1, 0, 1, false, &dp.grid);
    auto three = gpu_buffer_table(dp);
    check(three[GB_PARAMS].bytes() == 134976 * 2 && three[GB_GRADS].bytes() == 134976 * 2 &&
              three[GB_ADAM_V].bytes() == 44992 * 4 && three[GB_MASTER].bytes() == 44992 * 4,
          "3 ranks: params and grads padded to 3 equal shards, master/m/v for one shard (ZeRO-1)",
          strprintf("params %zu, adam_v %zu", three[GB_PARAMS].bytes(), three[GB_ADAM_V].bytes()));
    bool no_grid_rows = true;
    for (int b : {GB_TP_GATHERED, GB_TP_LOCAL, GB_TP_LOSS_EXCHANGE, GB_ZERO_GATHERED, GB_ZERO_BUCKETS, GB_ZERO_REDUCED,
                  GB_LENT_WTE, GB_LENT_WTE_GRAD, GB_TIED_RECEIVED})
        no_grid_rows = no_grid_rows && t[b].bytes() == 0 && three[b].bytes() == 0;
    check(no_grid_rows, "one rank and data parallelism allocate none of the grid's rows", "");

    // a process grid: every row for the rank's slice (llmc/parallel/process_grid.h), as llmc/memory/cpu_buffers.h does
    GPT2Config g4;
    parse_model_descriptor("L=4,C=128,H=4,T=32,V=501", &g4);
    auto grid_table = [&](int world, int rank, int tp, int pp, int zero, bool sp, int in_flight) {
        GPURunShape s;
        s.cfg = g4;
        s.B = 1, s.T = 32, s.recompute = 0, s.cudnn_workspace_bytes = 1 << 20;
        std::string why = make_grid(world, rank, tp, pp, 0, zero, sp, &s.grid);
        if (!why.empty()) printf("FAIL: grid: %s\n", why.c_str());
        s.micro_batches_in_flight = in_flight;
        return gpu_buffer_table(s);
    };
    {   // tp 2: heads, MLP units and vocabulary rows halved; the residual stream whole; the loss's exchange
        auto t2 = grid_table(2, 1, 2, 1, 0, false, 1);
        ProcessGrid g;
        make_grid(2, 1, 2, 1, 0, 0, false, &g);
        ModelSlice sl = model_slice(g4, g);
        size_t P2 = slice_layout(g4, sl).total, BT = 32, C = 128;
        check(t2[GB_PARAMS].elements == P2 && t2[GB_QKV].elements == 4 * BT * 3 * 64 && t2[GB_FCH].elements == 4 * BT * 256 &&
                  t2[GB_RESIDUAL].elements == 5 * BT * C && t2[GB_LOGITS].elements == BT * 256 &&
                  t2[GB_TP_LOSS_EXCHANGE].elements == BT + 2 * BT && t2[GB_TP_GATHERED].elements == 0,
              "tp 2: params of the slice, qkv (B,T,3C/2), fch (B,T,4C/2), logits (B,T,Vp/2), residual whole, the loss's exchange",
              strprintf("params %zu of %zu, qkv %zu, logits %zu", t2[GB_PARAMS].elements, P2, t2[GB_QKV].elements,
                        t2[GB_LOGITS].elements));
        auto t4 = grid_table(4, 3, 4, 1, 0, true, 1);  // sequence parallel: R = B*T/4 rows of the residual stream
        check(t4[GB_RESIDUAL].elements == 5 * (BT / 4) * C && t4[GB_LN1_MEAN].elements == 4 * (BT / 4) &&
                  t4[GB_TP_GATHERED].elements == BT * C && t4[GB_TP_LOCAL].elements == (BT / 4) * C &&
                  t4[GB_QKV].elements == 4 * BT * 3 * 32,
              "tp 4 + sequence parallel: the residual stream and LayerNorms on B*T/4 rows, gathered rows as workspace", "");
    }
    {   // pp 2, 1F1B, 4 micro-batches: stage 0 keeps 2 in flight, the embedding; stage 1 one, the head and wte's copy
        auto s0 = grid_table(2, 0, 1, 2, 0, false, 2), s1 = grid_table(2, 1, 1, 2, 0, false, 1);
        size_t BT = 32, C = 128;
        check(s0[GB_RESIDUAL].elements == 2 * ((3 * BT * C + 63) / 64 * 64) && s0[GB_LOGITS].elements == 0 &&
                  s0[GB_TIED_RECEIVED].elements == 512 * C && s0[GB_LENT_WTE].elements == 0 && s0[GB_INPUTS].elements == 2 * 64 &&
                  s1[GB_RESIDUAL].elements == 3 * BT * C && s1[GB_LOGITS].elements == BT * 512 &&
                  s1[GB_LENT_WTE].elements == 512 * C && s1[GB_LENT_WTE_GRAD].elements == 512 * C,
              "pp 2: 2 layers per stage, stage 0 two micro-batches in flight (each from a 128-byte boundary), the last stage "
              "the LM head with its copy of wte",
              strprintf("stage 0 residual %zu inputs %zu; stage 1 logits %zu lent %zu", s0[GB_RESIDUAL].elements,
                        s0[GB_INPUTS].elements, s1[GB_LOGITS].elements, s1[GB_LENT_WTE].elements));
    }
    {   // ZeRO-2/3 on 2 data-parallel ranks: gradient (and weight) shards of every unit, the slots
        auto z2 = grid_table(2, 0, 1, 1, 2, false, 1), z3 = grid_table(2, 0, 1, 1, 3, false, 1);
        ParamLayout full = param_layout(g4);
        std::vector<ZeroUnit> units = model_units(full, 4);
        ZeroSlots slots = zero_slots(units, 2);
        size_t shards = 0;
        for (const ZeroUnit& u : units) shards += shard_layout(u.size, 2).shard_size;
        check(z2[GB_PARAMS].elements == full.total && z2[GB_GRADS].elements == shards && z2[GB_ADAM_M].elements == shards &&
                  z2[GB_ZERO_BUCKETS].elements == slots.ends + 2 * slots.layer && z2[GB_ZERO_GATHERED].elements == 0 &&
                  z3[GB_PARAMS].elements == shards && z3[GB_ZERO_GATHERED].elements == slots.ends + 2 * slots.layer &&
                  z3[GB_ZERO_REDUCED].elements == slots.largest_shard,
              "ZeRO-2: whole weights, the gradient shards, two layer slots and the ends' for buckets; ZeRO-3 also the "
              "weight shards and as many slots for gathered units",
              strprintf("shards %zu, slots ends %zu layer %zu", shards, slots.ends, slots.layer));
        check(slots.ends == shard_layout(units[4].size, 2).padded_total && slots.layer == shard_layout(units[0].size, 2).padded_total,
              "ZeRO slots: the ends' unit padded, the largest layer padded", "");
    }

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
    return check_exit_code();
}
