// test_estimate.cpp — the estimator's arithmetic (llmc/memory/estimate.h), checked on the CPU against numbers
// worked out by hand (each derivation is in the comment next to it) and against the size tables.
//   worked example   a 12-layer, 768-wide, 512-context, 12-head GPT with a 40,512-token vocabulary and an
//                    untied output layer (~147M parameters): its parameter count, 16N/18N/12N bytes, the
//                    activation bytes of Korthikanti et al. at b = 8; and the ZeRO paper's own example
//   line by line     the literature and our tables reconcile exactly: every activation row is one term,
//                    the paper's column sums to the formula, ours to the table, the model-state
//                    differences are all explained (padding, the CPU's gradient shard)
//   largest batch    monotone in the budget, exactly at the table's boundary, the trainer's own answer
//   FLOPs and MFU    6N + 6LCT, tokens per step with accumulation and ranks, the step time at an MFU
// test_estimate.py checks the other half: the CPU trainer allocates what its estimate says, to the byte.
#include <cmath>
#include <cstdio>
#include <string>
#include "llmc/memory/estimate.h"
#include "test/checks.h"

static bool near(double a, double b, double rel = 1e-12) { return std::fabs(a - b) <= rel * std::fabs(b); }

static EstimateSetup gpu_setup(const char* model, int B, int T, int recompute) {
    EstimateSetup e;
    e.trainer = Trainer::GPU;
    parse_model_descriptor(model, &e.cfg);
    e.B = B, e.T = T, e.recompute = recompute;
    e.tokens_per_step = (int64_t)B * T;
    return e;
}

static EstimateSetup cpu_setup(const char* model, int B, int T, int ranks, int zero) {
    EstimateSetup e;
    e.trainer = Trainer::CPU;
    parse_model_descriptor(model, &e.cfg);
    e.B = B, e.T = T, e.ranks = ranks, e.zero_stage = zero, e.dtype_bytes = 4, e.recompute = 0;
    e.tokens_per_step = (int64_t)B * T * ranks;
    return e;
}

static void worked_example() {
    // GPT-1's shape with its 40,478-token vocabulary padded to 40,512 and an untied output layer:
    //   token embedding   V h          = 40512 * 768            = 31,113,216
    //   positions         s h          =   512 * 768            =    393,216
    //   12 blocks         L(12h^2+13h) = 12 * (7,077,888 + 9,984) = 85,054,464
    //   final LayerNorm   2h                                     =      1,536
    //   output layer      V h                                    = 31,113,216
    //   N                                                        = 147,675,648
    double N = literature_param_count(40512, 512, 12, 768, false);
    check(N == 147675648.0, "worked example: N = 147,675,648 (untied head; 116,562,432 tied)",
          strprintf("%.0f", N));
    check(literature_param_count(40512, 512, 12, 768, true) == 116562432.0, "worked example: tied N = 116,562,432");
    // model states: 16N = 2,362,810,368 (either accounting), 18N = 2,658,161,664, 12N = 1,772,107,776
    std::vector<StateBytes> v = literature_state_variants();
    check(v[0].total() * N == 2362810368.0 && v[1].total() * N == 2362810368.0,
          "worked example: fp32 AdamW 4+4+8 and mixed 2+2+12 are both 16N = 2,362,810,368 bytes");
    check(v[2].total() * N == 2658161664.0 && v[2].grads == 4 && v[2].master == 4,
          "worked example: 18N = 2,658,161,664 bytes counts fp32 gradients and an fp32 master");
    check(v[3].total() * N == 1772107776.0 && v[3].master == 0, "worked example: 12N = 1,772,107,776 bytes, no master copy");
    // activations at b = 8: sbhL = 512*8*768*12 = 37,748,736; 5as/h = 5*12*512/768 = 40
    //   none       37,748,736 * 74 = 2,793,406,464
    //   selective  37,748,736 * 34 = 1,283,457,024
    //   full       37,748,736 *  2 =    75,497,472
    check(korthikanti_activation_bytes(512, 8, 768, 12, 12, PaperRecompute::None) == 2793406464.0,
          "worked example: activations sbhL(34 + 5as/h) at b=8 = 2,793,406,464 bytes");
    check(korthikanti_activation_bytes(512, 8, 768, 12, 12, PaperRecompute::Selective) == 1283457024.0 &&
              korthikanti_activation_bytes(512, 8, 768, 12, 12, PaperRecompute::Full) == 75497472.0,
          "worked example: selective 34sbhL = 1,283,457,024, full 2sbhL = 75,497,472 bytes");
    // The ZeRO paper's own figure: 7.5B parameters, K = 12, 64 ranks: 120 GB, 31.4 GB, 16.6 GB, 1.9 GB
    //   stage 1: 4 * 7.5e9 + 12 * 7.5e9 / 64 = 30e9 + 1.40625e9 = 31.40625e9
    //   stage 2: 2 * 7.5e9 + 14 * 7.5e9 / 64 = 15e9 + 1.640625e9 = 16.640625e9
    //   stage 3: 16 * 7.5e9 / 64 = 1.875e9
    StateBytes mixed = v[1];
    check(zero_state_bytes(mixed, 7.5e9, 0, 64) == 120e9 && zero_state_bytes(mixed, 7.5e9, 1, 64) == 31.40625e9 &&
              zero_state_bytes(mixed, 7.5e9, 2, 64) == 16.640625e9 && zero_state_bytes(mixed, 7.5e9, 3, 64) == 1.875e9,
          "ZeRO paper: 7.5B params on 64 ranks: 120, 31.4, 16.6, 1.9 GB for stages 0-3");
    // GPT-2 small as we count it: N = 124,475,904 = ours with the padded vocab; the paper's N uses V
    GPT2Config d12;
    parse_model_descriptor("d12", &d12);
    check(literature_param_count(d12.padded_vocab_size, 1024, 12, 768, true) == (double)param_layout(d12).total &&
              literature_param_count(50257, 1024, 12, 768, true) == 124439808.0,
          "d12: the closed form with Vp is our table's N (124,475,904); with V it is 124,439,808");
}

static void line_by_line() {
    std::vector<std::pair<std::string, EstimateSetup>> setups;
    for (int r = 0; r <= 2; r++) setups.push_back({strprintf("gpu d12 recompute %d", r), gpu_setup("d12", 4, 1024, r)});
    EstimateSetup simple = gpu_setup("d24", 2, 512, 1);
    simple.simple_attention = true;
    setups.push_back({"gpu d24 simple attention", simple});
    EstimateSetup fp32 = gpu_setup("d12", 2, 256, 0);
    fp32.dtype_bytes = 4, fp32.master_weights = false, fp32.simple_attention = true;
    setups.push_back({"gpu fp32 build", fp32});
    EstimateSetup zero = gpu_setup("d12", 4, 1024, 1);
    zero.ranks = 8, zero.zero_stage = 1;
    setups.push_back({"gpu d12 ZeRO-1 on 8 ranks", zero});
    setups.push_back({"cpu tiny", cpu_setup("L=2,C=64,H=4,T=32,V=512", 4, 32, 1, 0)});
    setups.push_back({"cpu tiny ZeRO-1 on 3 ranks", cpu_setup("L=2,C=64,H=4,T=32,V=500", 4, 32, 3, 1)});
    setups.push_back({"cpu d12 ZeRO-1 on 2 ranks", cpu_setup("d12", 1, 64, 2, 1)});
    for (int r = 1; r <= 2; r++) {
        EstimateSetup c = cpu_setup("L=2,C=64,H=4,T=32,V=512", 4, 32, 1, 0);
        c.recompute = r;
        setups.push_back({strprintf("cpu tiny recompute %d", r), c});
    }

    for (auto& [name, e] : setups) {
        std::vector<BufferSpec> table = estimate_table(e, e.B, 0);
        MemoryByKind mem = memory_by_kind(table, estimate_granule(e));
        bool every_row_once = true;
        for (const BufferSpec& b : table)
            if (b.kind == MEM_ACTIVATIONS && activation_term_of(b.name) < 0) every_row_once = false;
        double paper = 0;
        size_t ours = 0;
        for (const ActivationLine& l : activation_lines(e, table)) paper += l.paper, ours += l.ours;
        double formula = korthikanti_activation_bytes(e.T, e.B, e.cfg.channels, e.cfg.num_heads, e.cfg.num_layers,
                                                      PaperRecompute::None);
        check(every_row_once && near(paper, formula) && ours == mem.bytes[MEM_ACTIVATIONS],
              name + ": activation lines: every row in one term, paper column = formula, ours = table",
              strprintf("rows %d, paper %.0f vs %.0f, ours %zu vs %zu", every_row_once, paper, formula, ours,
                        mem.bytes[MEM_ACTIVATIONS]));
        bool explained = true;
        std::string detail;
        for (const StateLine& l : state_lines(e, table)) {
            double rest = (double)l.ours - l.literature - l.vocab_padding - l.shard_padding - l.extra;
            if (std::fabs(rest) > 1e-6 * std::max(1.0, l.literature)) explained = false;
            detail += strprintf("%s: rest %.1f; ", l.kind, rest);
        }
        check(explained, name + ": model-state differences are fully explained (padding, gradient shard)", detail);
    }

    // the differences are the ones the docs name: d12 at recompute 1 against the paper's 34sbh + 5as^2b
    EstimateSetup e = gpu_setup("d12", 4, 1024, 1);
    std::vector<ActivationLine> lines = activation_lines(e, estimate_table(e, 4, 0));
    double sbhL = 1024.0 * 4 * 768 * 12;
    check(lines[3].ours == 12ull * 4 * 12 * 1024 * 4 && lines[3].paper == 5.0 * 12 * 1024 * 1024 * 4 * 12,
          "cuDNN keeps 4asb of softmax statistics per layer where the paper keeps 5as^2b", "");
    check(lines[5].ours == 0 && lines[5].paper == 2 * sbhL && lines[9].ours == 0 && lines[9].paper == 8 * sbhL,
          "no dropout masks; recompute 1 keeps no GELU output", "");
    check(lines[0].ours == (size_t)(13.0 / 12 * 2 * sbhL), "the residual stream keeps L+1 slices", "");
}

static void largest_batch() {
    // GPU d12 T=1024: for budgets from 1 to 100 GiB the answer fits, one more does not, it never
    // decreases as the budget grows, and it is the trainer's own answer (largest_batch_that_fits)
    for (int r = 0; r <= 2; r++) {
        EstimateSetup e = gpu_setup("d12", 1, 1024, r);
        bool exact = true, monotone = true, agrees = true;
        int previous = 0;
        std::string why;
        for (double gib = 1; gib <= 100; gib += 0.75) {
            double budget = gib * (1ull << 30);
            int b = estimate_largest_batch(e, budget);
            auto need = [&](int B) {
                return (double)(gpu_buffer_total(estimate_table(e, B, 0)) + GPU_MEMORY_MARGIN_BYTES);
            };
            if ((b > 0 && need(b) > budget) || need(b + 1) <= budget) exact = false, why = strprintf("%.2f GiB: B=%d", gib, b);
            if (b < previous) monotone = false;
            previous = b;
            GPURunShape big = estimate_gpu_shape(e, 100000, 0);
            if (largest_batch_that_fits(big, (size_t)budget) != b) agrees = false;
        }
        check(exact, strprintf("recompute %d: largest batch fits and the next does not, 1-100 GiB", r), why);
        check(monotone && agrees, strprintf("recompute %d: monotone in the budget, same as the trainer's check", r));
    }
    // more recompute, more batch; and the boundary is exact to the byte
    EstimateSetup e0 = gpu_setup("d12", 1, 1024, 0), e2 = gpu_setup("d12", 1, 1024, 2);
    double gib80 = 80.0 * (1ull << 30);
    int b0 = estimate_largest_batch(e0, gib80), b2 = estimate_largest_batch(e2, gib80);
    check(b2 > b0 && b0 > 0, "recompute 2 fits a larger micro-batch than recompute 0 in 80 GiB", strprintf("%d vs %d", b2, b0));
    double at = (double)(gpu_buffer_total(estimate_table(e0, 7, 0)) + GPU_MEMORY_MARGIN_BYTES);
    check(estimate_largest_batch(e0, at) == 7 && estimate_largest_batch(e0, at - 1) == 6,
          "the boundary is exact to the byte (B=7 at its own total, 6 one byte below)");
    check(estimate_largest_batch(e0, 1 << 20) == 0, "nothing fits in 1 MiB");
    EstimateSetup cpu = cpu_setup("L=2,C=64,H=4,T=32,V=512", 1, 32, 1, 0);
    double cpu_need = (double)memory_by_kind(estimate_table(cpu, 9, 0), 1).total;
    check(estimate_largest_batch(cpu, cpu_need) == 9 && estimate_largest_batch(cpu, cpu_need - 1) == 8,
          "CPU: the largest batch is exact at its table's total (no margin)");
    // the generic search agrees with a linear scan on a made-up monotone predicate
    bool search_ok = true;
    for (int limit = 1; limit < 70; limit++)
        for (int boundary = 0; boundary < 80; boundary++) {
            int want = std::min(boundary, limit);
            if (largest_fitting_batch([&](int b) { return b <= boundary; }, limit) != want) search_ok = false;
        }
    check(search_ok, "largest_fitting_batch = a linear scan, for every boundary and limit");
}

static void flops_and_mfu() {
    // d12, T = 1024: 6N + 6LCT = 6 * 124,475,904 + 6 * 12 * 768 * 1024 = 746,855,424 + 56,623,104 = 803,478,528
    EstimateSetup e = gpu_setup("d12", 4, 1024, 1);
    e.peak_flops = 989e12, e.mfu = 0.4;
    ComputeEstimate c = estimate_compute(e);
    check(c.flops_per_token == 803478528.0, "FLOPs per token 6N + 6LCT = 803,478,528 (d12, T=1024)",
          strprintf("%.0f", c.flops_per_token));
    // B*T = 4096 tokens: 3,291,048,050,688 FLOPs; at 0.4 * 989e12 = 395.6e12 FLOP/s: 8.3191 ms, 492,359 tokens/s
    check(c.flops_per_step == 3291048050688.0 && near(c.step_seconds, 0.008319130562912032, 1e-9) &&
              near(c.tokens_per_second, 492359.1436658778, 1e-9),
          "4096 tokens at 40% of 989 TFLOP/s: 8.319 ms per step, 492,359 tokens/s",
          strprintf("%.0f %.9f %.3f", c.flops_per_step, c.step_seconds, c.tokens_per_second));
    // 8 ranks each with B=4: 8x the tokens per step in the same time
    e.ranks = 8, e.tokens_per_step = 8 * 4096;
    ComputeEstimate c8 = estimate_compute(e);
    check(near(c8.step_seconds, c.step_seconds) && near(c8.tokens_per_second, 8 * c.tokens_per_second),
          "8 ranks: the same step time, 8x the tokens per second");
    // from the flags: --total-batch-tokens 524288 at B=16, T=1024 is 32 micro-batches; the GPU's peak by default
    TrainOptions o;
    o.model = "d12", o.batch_size = 16, o.total_batch_tokens = 524288;
    EstimateSetup f = estimate_setup(o, Trainer::GPU, 2, true, false);
    ComputeEstimate cf = estimate_compute(f);
    check(f.tokens_per_step == 524288 && cf.flops_per_step == 803478528.0 * 524288 && f.peak_flops == 989e12 &&
              f.mfu == (double)0.4f && f.memory_budget_bytes == 80.0 * (1ull << 30),
          "from the flags: 524,288 tokens per step, 4.2125e14 FLOPs, H100 SXM peak and 80 GiB by default",
          strprintf("%lld %.4g %.4g", (long long)f.tokens_per_step, cf.flops_per_step, f.peak_flops));
    TrainOptions oc;
    oc.model = "d12";
    EstimateSetup fc = estimate_setup(oc, Trainer::CPU, 4, false, false);
    check(fc.peak_flops == 0 && estimate_compute(fc).step_seconds == 0, "the CPU trainer predicts no time without a peak");
}

static void tables() {
    // the estimate's GPU table is the trainer's: bytes per kind for d12, B=4, T=1024, recompute 1, bf16
    EstimateSetup e = gpu_setup("d12", 4, 1024, 1);
    MemoryByKind m = memory_by_kind(estimate_table(e, 4, 0), GPU_ALLOCATION_GRANULE);
    const size_t P = 124475904;
    check(m.bytes[MEM_PARAMS] == 2 * P && m.bytes[MEM_GRADS] == 2 * P && m.bytes[MEM_MASTER] == 4 * P &&
              m.bytes[MEM_OPTIMIZER] == 8 * P,
          "GPU d12 bf16 with master weights: 2 + 2 + 4 + 8 = 16 bytes per parameter");
    check(m.total == gpu_buffer_total(gpu_buffer_table(gpu_run_shape(e.cfg, 4, 1024, 1, true, false, 2))),
          "the estimate's GPU total is the trainer's gpu_buffer_total");
    // ZeRO-1 over 8 ranks: master, m and v shrink to 1/8 (d12 needs no padding: 15,559,488 each)
    EstimateSetup z = e;
    z.ranks = 8, z.zero_stage = 1;
    MemoryByKind mz = memory_by_kind(estimate_table(z, 4, 0), GPU_ALLOCATION_GRANULE);
    check(mz.bytes[MEM_MASTER] == 4 * 15559488ull && mz.bytes[MEM_OPTIMIZER] == 8 * 15559488ull &&
              mz.bytes[MEM_PARAMS] == 2 * P,
          "GPU ZeRO-1 on 8 ranks: master, m, v are the rank's shard of 15,559,488");
    // CPU, 2 ranks, ZeRO-1, a model whose N is not a multiple of 2 * 64: L=2, C=48, T=32, Vp=512
    //   N = 512*48 + 32*48 + 2*(12*48^2 + 13*48) + 2*48 = 24,576 + 1,536 + 56,544 + 96 = 82,752
    //   padded to 82,816 = 2 shards of 41,408; rank 0 owns 41,408, rank 1 the remaining 41,344
    EstimateSetup c = cpu_setup("L=2,C=48,H=4,T=32,V=500", 4, 32, 2, 1);
    std::vector<BufferSpec> r0 = estimate_table(c, 4, 0), r1 = estimate_table(c, 4, 1);
    check(param_layout(c.cfg).total == 82752 && r0[CB_PARAMS].elements == 82816 && r0[CB_GRAD_SHARD].elements == 41408 &&
              r0[CB_ADAM_M].elements == 41408 && r1[CB_ADAM_M].elements == 41344 && r1[CB_ADAM_V].elements == 41344,
          "CPU ZeRO-1 on 2 ranks: params, grads padded to 82,816; m, v = each rank's owned 41,408 / 41,344",
          strprintf("%zu %zu %zu", r0[CB_PARAMS].elements, r0[CB_ADAM_M].elements, r1[CB_ADAM_M].elements));
    // CPU recompute in a 1F1B pipeline: tp2 with sequence parallelism x pp2, L=4, B=1, T=32, 4 micro-batches, so
    // stage 0 keeps 2 in flight (M=2). Level 2 keeps no ln1, ln2, fch_gelu; its scratch is ONE layer, not M:
    //   ln_recompute (R, C) = 16 x 64 = 1,024 values; gelu_recompute (B, T, 4C/t) = 32 x 128 = 4,096
    EstimateSetup p = cpu_setup("L=4,C=64,H=4,T=32,V=501", 1, 32, 1, 0);
    p.tp = 2, p.pp = 2, p.sequence_parallel = true, p.tokens_per_step = 4 * 32;
    std::vector<BufferSpec> k0 = estimate_table(p, 1, 0);
    p.recompute = 2;
    std::vector<BufferSpec> k2 = estimate_table(p, 1, 0);
    check(k0[CB_LN1].elements == 2 * 2 * 16 * 64 && k0[CB_FCH_GELU].elements == 2 * 2 * 32 * 128 &&
              k0[CB_LN_RECOMPUTE].elements == 0 && k0[CB_GELU_RECOMPUTE].elements == 0 && k2[CB_LN1].elements == 0 &&
              k2[CB_LN2].elements == 0 && k2[CB_FCH_GELU].elements == 0 && k2[CB_LN_RECOMPUTE].elements == 1024 &&
              k2[CB_GELU_RECOMPUTE].elements == 4096 && k2[CB_QKV].elements == k0[CB_QKV].elements,
          "CPU recompute 2 on a tp2+SP x pp2 1F1B stage (2 micro-batches in flight): no per-layer ln1, ln2, fch_gelu; "
          "one layer of scratch, not one per micro-batch",
          strprintf("%zu %zu %zu %zu", k0[CB_LN1].elements, k0[CB_FCH_GELU].elements, k2[CB_LN_RECOMPUTE].elements,
                    k2[CB_GELU_RECOMPUTE].elements));
}

int main() {
    worked_example();
    line_by_line();
    largest_batch();
    flops_and_mfu();
    tables();
    return check_exit_code();
}
