// test_adamw_bf16.cpp — AdamW with bf16 moments (llmc/optim/adamw_bf16.h), the function the trainer
// runs for --optimizer-state bf16, against fp32 AdamW (llmc/optim/adamw.h) and against arithmetic:
//
//   stuck v        g = 0 for 2000 steps with beta2 = 0.999: v must decay like 0.999^t (0.135 at the
//                  end). Round-to-nearest bf16 leaves every v at exactly 1.0: each step's 0.1% change
//                  is less than half a bf16 gap (at least 0.195% of the value). Stochastic rounding
//                  decays: the mean over 4096 elements within 1% of 0.999^2000, and every element
//                  below 0.25 (each is a random walk around the mean: 10% RMS).
//                  fp32 AdamW, the baseline, within 1e-4.
//   unbiased       over all 65536 values of the random bits, the mean of the stochastic rounding of
//                  x is x exactly (x = 1 + 2^-10 + 2^-20: between two bf16 values, not halfway).
//   keyed bits     updating [0, n) at once, or as two pieces with their own first_index (as ZeRO-1's
//                  shards do), or with 1 thread instead of all, gives the same bits.
//   tracks fp32    100 steps on random gradients (beta2 = 0.95): the weights stay within 2% of the
//                  distance fp32 AdamW moved them.
#include <cmath>
#include <cstdio>
#include <string>
#include <vector>
#include <omp.h>
#include "llmc/optim/adamw.h"
#include "llmc/optim/adamw_bf16.h"
#include "test/checks.h"

int main() {
    using namespace cpu;
    const size_t n = 4096;
    const int steps = 2000;
    const float beta1 = 0.9f, beta2 = 0.999f, lr = 1e-3f;

    // ---- v with g = 0 for many steps
    {
        std::vector<float> g(n, 0.0f), p_rn(n, 0.5f), p_sr(n, 0.5f), p32(n, 0.5f), m32(n, 0.0f), v32(n, 1.0f);
        std::vector<uint16_t> m_rn(n, 0), v_rn(n, float_to_bf16_round_nearest(1.0f)), m_sr = m_rn, v_sr = v_rn;
        for (int t = 1; t <= steps; t++) {
            adamw_update_bf16(p_rn.data(), g.data(), m_rn.data(), v_rn.data(), n, lr, beta1, beta2, 1e-8f, 0.0f, t, 1.0f, 0, nullptr,
                              BF16Rounding::Nearest);
            adamw_update_bf16(p_sr.data(), g.data(), m_sr.data(), v_sr.data(), n, lr, beta1, beta2, 1e-8f, 0.0f, t, 1.0f, 0, nullptr,
                              BF16Rounding::Stochastic);
            adamw_update(p32.data(), g.data(), m32.data(), v32.data(), n, lr, beta1, beta2, 1e-8f, 0.0f, t, 1.0f);
        }
        double want = std::pow(0.999, steps);
        double rn_max_change = 0, sr_mean = 0, sr_largest = 0, sr_spread = 0, fp32_worst = 0;
        for (size_t i = 0; i < n; i++) {
            rn_max_change = std::max(rn_max_change, std::fabs(bf16_to_float(v_rn[i]) - 1.0));
            sr_mean += bf16_to_float(v_sr[i]) / n;
            sr_largest = std::max(sr_largest, (double)bf16_to_float(v_sr[i]));
            sr_spread += std::pow(bf16_to_float(v_sr[i]) / want - 1, 2) / n;
            fp32_worst = std::max(fp32_worst, std::fabs(v32[i] / want - 1));
        }
        check(rn_max_change == 0.0, strprintf("round-to-nearest bf16: v stuck at 1.0 after %d steps of g = 0 where 0.999^%d = %.4f",
                                              steps, steps, want),
              strprintf("v moved by up to %.3g", rn_max_change));
        // each element's v is a random walk around 0.999^t (each step's rounding moves it by up to a bf16 gap,
        // up or down): the mean is tight, an element only roughly (measured: 10% RMS, the largest +43%)
        check(std::fabs(sr_mean / want - 1) < 0.01 && sr_largest < 0.25,
              strprintf("stochastic rounding: v decays like 0.999^t (mean %.4f against %.4f; elements spread %.0f%% RMS, the "
                        "largest %.3f: none stuck)", sr_mean, want, 100 * std::sqrt(sr_spread), sr_largest),
              strprintf("mean %.5f, largest element %.3f", sr_mean, sr_largest));
        check(fp32_worst < 1e-4, strprintf("fp32 AdamW, the baseline: v = 0.999^t (%.1e relative)", fp32_worst),
              strprintf("%.2e", fp32_worst));
    }

    // ---- the stochastic rounding is unbiased: its mean over every value of the random bits is x
    {
        float x = 1.0f + 0x1p-10f + 0x1p-20f;
        double sum = 0;
        for (uint32_t r = 0; r < 65536; r++) sum += bf16_to_float(bf16_round_stochastic(x, r));
        check(sum / 65536 == (double)x, strprintf("stochastic rounding of %.9g: mean over all random bits == x", x),
              strprintf("mean %.9g", sum / 65536));
        check(bf16_round_stochastic(-x, 0xFFFF) == (uint16_t)(float_to_bf16_round_nearest(-1.0078125f)) &&
                  bf16_round_stochastic(-x, 0) == float_to_bf16_round_nearest(-1.0f),
              "stochastic rounding of a negative value rounds its magnitude (down with bits 0, up with bits 0xFFFF)", "wrong");
    }

    // ---- the random bits are keyed by (step, element index): pieces and thread counts agree
    {
        std::vector<float> g(n), p0(n);
        for (size_t i = 0; i < n; i++) g[i] = std::sin(0.37 * i) * 1e-2f, p0[i] = std::cos(0.11 * i);
        std::vector<float> p_whole = p0, p_pieces = p0, p_one_thread = p0;
        std::vector<uint16_t> mw(n, 0), vw(n, 0), mp = mw, vp = vw, m1 = mw, v1 = vw;
        int threads = omp_get_max_threads();
        for (int t = 1; t <= 5; t++) {
            adamw_update_bf16(p_whole.data(), g.data(), mw.data(), vw.data(), n, lr, beta1, 0.95f, 1e-8f, 0.1f, t, 1.0f, 0);
            size_t half = 1000;
            adamw_update_bf16(p_pieces.data(), g.data(), mp.data(), vp.data(), half, lr, beta1, 0.95f, 1e-8f, 0.1f, t, 1.0f, 0);
            adamw_update_bf16(p_pieces.data() + half, g.data() + half, mp.data() + half, vp.data() + half, n - half, lr, beta1,
                              0.95f, 1e-8f, 0.1f, t, 1.0f, half);
            omp_set_num_threads(1);
            adamw_update_bf16(p_one_thread.data(), g.data(), m1.data(), v1.data(), n, lr, beta1, 0.95f, 1e-8f, 0.1f, t, 1.0f, 0);
            omp_set_num_threads(threads);
        }
        check(p_whole == p_pieces && mw == mp && vw == vp, "two pieces with their first_index == the whole array, bit for bit",
              "differ");
        check(p_whole == p_one_thread && mw == m1 && vw == v1, strprintf("1 thread == %d threads, bit for bit", threads), "differ");
    }

    // ---- bf16 moments track fp32 AdamW on random gradients
    {
        std::vector<float> p32(n), p16(n), m32(n, 0.0f), v32(n, 0.0f), g(n);
        std::vector<uint16_t> m16(n, 0), v16(n, 0);
        for (size_t i = 0; i < n; i++) p32[i] = p16[i] = 0.02f * std::sin(1.3 * i);
        std::vector<float> start = p32;
        uint64_t state = 1;
        for (int t = 1; t <= 100; t++) {
            for (size_t i = 0; i < n; i++) g[i] = 0.01f * normal_from_counter(7, state++) + 0.001f * std::cos(0.05 * i);
            adamw_update(p32.data(), g.data(), m32.data(), v32.data(), n, lr, beta1, 0.95f, 1e-8f, 0.1f, t, 1.0f);
            adamw_update_bf16(p16.data(), g.data(), m16.data(), v16.data(), n, lr, beta1, 0.95f, 1e-8f, 0.1f, t, 1.0f, 0);
        }
        double moved = 0, apart = 0;
        for (size_t i = 0; i < n; i++) moved = std::max(moved, (double)std::fabs(p32[i] - start[i])), apart = std::max(apart, (double)std::fabs(p16[i] - p32[i]));
        check(apart < 0.02 * moved, strprintf("100 steps on random gradients: bf16 moments within %.2f%% of fp32 AdamW's movement",
                                              100 * apart / moved),
              strprintf("%.3g apart, %.3g moved", apart, moved));
    }
    return check_exit_code();
}
