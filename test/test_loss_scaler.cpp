// test_loss_scaler.cpp — the dynamic loss scaler (llmc/optim/loss_scaler.h) against PyTorch's
// GradScaler rules (torch/csrc's _amp_update_scale_: on inf, scale *= backoff and the tracker goes
// to 0; else the tracker counts up, and at the growth interval the scale doubles and the tracker
// goes to 0) and against arithmetic:
//
//   schedule       a hand-worked sequence of clean and overflowing steps with window 3: every S,
//                  every skip and every tracker value (an overflow must reset the count of clean
//                  steps, so two clean steps before and one after do not double S), and the count of
//                  skipped steps (the checkpoint's loss_scale_overflows), with AdamW's t = step - skipped
//                  equal to the number of updates applied.
//   exact          g * S then unscaled, for S = 2^0 .. 2^24, equals g bit for bit (the claim that
//                  any power-of-two S trains the same weights); S = 3 does not (the control that
//                  shows the comparison can fail), which is why non-powers of two are refused.
//   clip after     the clipping coefficient from the unscaled gradients equals the one of S = 1;
//                  from the scaled ones it would be S times smaller.
//   overflow       one inf, one nan among finite values is found; all finite is not.
//   minimum        an overflow at S = 1 stops the process (exit 1) instead of skipping forever.
//   settings       non-powers of two, S < 1, window < 1 refused with a line naming the value.
#include <sys/wait.h>
#include <unistd.h>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <limits>
#include <random>
#include <vector>
#include "llmc/optim/loss_scaler.h"
#include "test/checks.h"

static double norm_of(const std::vector<float>& g) {
    double s = 0;
    for (float x : g) s += (double)x * x;
    return std::sqrt(s);
}

int main() {
    // ---- the schedule, worked by hand from GradScaler's rules (growth x2, backoff x0.5)
    {
        LossScaler s;
        s.scale = 65536.0f;
        s.window = 3;
        // skipped: the steps skipped so far, the counter the checkpoint saves (loss_scale_overflows) and AdamW's t
        // is the step minus (t must count the applied updates only: 1, 2, ..., with no gap and no repeat)
        struct Event { bool overflow; bool applied; float scale; int clean; int skipped; };
        const Event events[] = {
            {false, true, 65536, 1, 0}, {false, true, 65536, 2, 0}, {false, true, 131072, 0, 0},  // 3 clean: doubles
            {false, true, 131072, 1, 0}, {false, true, 131072, 2, 0},
            {true, false, 65536, 0, 1},                                                     // overflow: halves, resets
            {false, true, 65536, 1, 1},                                                     // 2 + 1 clean is not 3
            {true, false, 32768, 0, 2}, {true, false, 16384, 0, 3},                         // two in a row: two halvings
            {false, true, 16384, 1, 3}, {false, true, 16384, 2, 3}, {false, true, 32768, 0, 3},
        };
        bool ok = true, t_ok = true;
        std::string why;
        int step = 1, applied_so_far = 0;
        for (const Event& e : events) {
            bool applied = loss_scaler_update(&s, e.overflow, step);
            if (applied != e.applied || s.scale != e.scale || s.clean_steps != e.clean || s.overflows != e.skipped) {
                ok = false;
                why += strprintf("step %d: applied %d scale %g clean %d skipped %d, expected %d %g %d %d; ", step, applied, s.scale,
                                 s.clean_steps, s.overflows, e.applied, e.scale, e.clean, e.skipped);
            }
            applied_so_far += applied;
            if (applied && step - s.overflows != applied_so_far) t_ok = false;  // the t the update of this step gets
            step++;
        }
        check(ok, "schedule: GradScaler's halving, growth after 3 clean steps, tracker reset and the count of skipped steps", why);
        check(t_ok && s.overflows == 3 && step - 1 - s.overflows == 9,
              "schedule: AdamW's t = step - skipped counts the applied updates (9 of 12 steps; 3 skipped)",
              strprintf("skipped %d", s.overflows));
    }

    // ---- scaling by a power of two and unscaling is exact
    std::mt19937 rng(7);
    std::normal_distribution<float> normal(0.0f, 1e-3f);
    std::vector<float> g(4096);
    for (float& x : g) x = normal(rng);
    auto roundtrip = [&](float S) {
        std::vector<float> h(g);
        for (float& x : h) x *= S;  // what the backward pass seeded with S produces, in fp32
        unscale_gradients(h.data(), h.size(), S);
        return h;
    };
    {
        bool ok = true;
        for (int e = 0; e <= 24; e++) ok = ok && memcmp(roundtrip(std::ldexp(1.0f, e)).data(), g.data(), g.size() * 4) == 0;
        check(ok, "exact: g * 2^e / 2^e == g bit for bit, e = 0..24");
        check(memcmp(roundtrip(3.0f).data(), g.data(), g.size() * 4) != 0,
              "exact (control): S = 3 changes some bits, so the comparison above can fail");
    }

    // ---- unscale before clipping: the clip coefficient of the true gradient
    {
        const float clip = 1e-3f, S = 65536.0f;
        std::vector<float> h(g);
        for (float& x : h) x *= S;
        double scaled_norm = norm_of(h);
        unscale_gradients(h.data(), h.size(), S);
        double coef_true = std::min(1.0, clip / norm_of(g)), coef = std::min(1.0, clip / norm_of(h));
        check(coef == coef_true && scaled_norm > 1000 * norm_of(g),
              "clip after unscale: the coefficient equals S = 1's (scaled, the norm would be S times larger)",
              strprintf("coef %g vs %g", coef, coef_true));
    }

    // ---- the per-rank flag
    {
        std::vector<float> h(g);
        bool clean = !has_overflow(h.data(), h.size());
        h[1234] = std::numeric_limits<float>::infinity();
        bool inf = has_overflow(h.data(), h.size());
        h[1234] = 0.0f;
        h[4095] = std::numeric_limits<float>::quiet_NaN();
        bool nan = has_overflow(h.data(), h.size());
        check(clean && inf && nan, "overflow: an inf or a nan anywhere is found, finite values are not");
    }

    // ---- an overflow at the minimum scale stops the run
    {
        fflush(stdout);
        pid_t pid = fork();
        if (pid == 0) {
            freopen("/dev/null", "w", stderr);
            LossScaler s;  // S = 1
            loss_scaler_update(&s, true, 17);
            _exit(0);      // reached only if it did not stop
        }
        int status = 0;
        waitpid(pid, &status, 0);
        check(WIFEXITED(status) && WEXITSTATUS(status) != 0, "minimum: an overflow at S = 1 stops the run",
              strprintf("status %d", status));
    }

    // ---- settings
    check(loss_scale_problem(65536.0f, 2000).empty() && loss_scale_problem(1.0f, 1).empty(), "settings: 2^16, 1 accepted");
    check(!loss_scale_problem(1000.0f, 2000).empty() && !loss_scale_problem(0.5f, 2000).empty() &&
              !loss_scale_problem(65536.0f, 0).empty() && !loss_scale_problem(INFINITY, 10).empty(),
          "settings: 1000, 0.5, inf and a window of 0 refused");
    return check_exit_code();
}
