#!/usr/bin/python3
"""The CPU trainer's optimizers, measured (issue 25, item 4): the AdamW step's speed against
torch.optim.AdamW in the same run, and the loss of AdamW fp32 / AdamW bf16 state / Adafactor / SM3
at equal steps on the main job's shape.

  speed   The trainer's own update functions (llmc/optim/adamw.h's adamw_update, adamw_bf16.h's
          adamw_update_bf16, adafactor.h's adafactor_step, sm3.h's sm3_step_all) in a small harness
          this script compiles with the Makefile's flags (-O3 -march=native, OpenMP), on GPT-2's
          parameter table (--model d12: 124,475,904 parameters with the vocabulary padded to 50304 rows;
          llmc/model/model.h's layout), called
          as the trainer's optimizer_step calls them (AdamW once per tensor kind, 2-D weights
          decayed), against torch.optim.AdamW on the same 148 tensors (every layer's its own), same
          hyperparameters, same thread count (torch 1.13 on the CPU has no fused AdamW: its
          foreach=True (multi-tensor) and foreach=False (a loop over tensors) are both timed).
          Gradients are fixed random values; every step is timed alone, the first --warmup dropped,
          the median of --steps kept. The rounds alternate ours and torch's (--rounds): the ratio
          printed is the median of the rounds' ratios, as the machine's load changes between them.
          Bytes of state touched per parameter, counted as the algorithm needs them (each once):
            AdamW fp32 state: p, g, m, v read, p, m, v written = 7 x 4 = 28 bytes
            AdamW bf16 state: p, g (4) and m, v (2) read, p (4), m, v (2) written = 20 bytes
            Adafactor, SM3: the passes they make (their --profile rows): Adafactor reads the weights
            twice and the gradient four times and writes the weights (28), SM3 reads the gradient
            twice and the weights once and writes them (16); their row and column state is
            negligible.
          (write-allocate, where the CPU reads a line before writing it, is not counted: neither in
          the optimizer's GB/s nor in the bandwidth below). The machine's memory bandwidth in the
          same run, same threads, same harness: a copy (memcpy, each thread its slice) of a
          4 x N-byte array, counted as read + written, and "7 streams": a loop reading p, g, m, v and
          writing p, m, v with one add each, the AdamW's traffic without its arithmetic.
  loss    The main job (scripts/run.sh's model and batch on the CPU: L=8 C=64 H=4, B=8, T=64, lr 1e-2
          cosine, 150 warm-up steps) for --loss-steps steps on Moby Dick with --optimizer adamw,
          --optimizer-state bf16, --optimizer adafactor (with --lr given, its step is the schedule's
          lr x max(1e-3, RMS(W))) and --optimizer sm3; validation every --val-every steps on
          the whole validation split; one plot of the four metrics logs through scripts/plot_metrics.py, and a table
          of the final train (mean of the last 20 steps) and validation losses.

The machine is shared: the load average before and after each part is printed; only numbers of the
same run compare.

    /usr/bin/python3 scripts/bench_optimizers.py --threads 2 --plot docs/optimizers_loss.png
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from main_job import MAIN_JOB, ROOT, header, load, plot, run_or_reuse  # noqa: E402 (also sets GOMP_SPINCOUNT before torch loads)

LR, BETA1, BETA2, EPS, WD = 6e-4, 0.9, 0.95, 1e-8, 0.1  # the trainer's defaults (--help)

HARNESS_SOURCE = r"""
// The trainer's optimizer updates, timed on GPT-2's parameter table (llmc/model/model.h's layout,
// llmc/optim/optimizer_state.h's blocks), and the memory bandwidth. argv: threads warmup steps L C V T.
// Prints one line per timed step: the measurement's name and its milliseconds.
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>
#include <omp.h>
#include "llmc/optim/adafactor.h"
#include "llmc/optim/adamw.h"
#include "llmc/optim/adamw_bf16.h"
#include "llmc/optim/sm3.h"

static double now_ms() {
    return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

int main(int argc, char** argv) {
    int threads = atoi(argv[1]), warmup = atoi(argv[2]), steps = atoi(argv[3]);
    GPT2Config cfg;
    cfg.num_layers = atoi(argv[4]); cfg.channels = atoi(argv[5]); cfg.vocab_size = atoi(argv[6]); cfg.max_seq_len = atoi(argv[7]);
    cfg.padded_vocab_size = pad_vocab(cfg.vocab_size);
    omp_set_num_threads(threads);
    ParamLayout layout = param_layout(cfg);
    std::vector<ParamBlock> blocks = param_blocks(cfg);
    size_t n = layout.total;
    printf("parameters %zu\n", n);
    // first touch in parallel, as the trainer's arrays are
    std::vector<float> p(n), g(n), m(n), v(n), state(factored_state_floats(cfg)), scratch(factored_scratch_floats(cfg));
    std::vector<uint16_t> m16(n), v16(n);
    #pragma omp parallel for schedule(static)
    for (size_t i = 0; i < n; i++) {
        uint32_t h = (uint32_t)(i * 2654435761u);
        p[i] = ((h >> 8) * (1.0f / 16777216.0f) - 0.5f) * 0.04f;
        g[i] = (((h * 747796405u) >> 8) * (1.0f / 16777216.0f) - 0.5f) * 0.01f;
        m[i] = 0.0f; v[i] = 0.0f; m16[i] = 0; v16[i] = 0;
    }
    auto report = [&](const char* name, auto body) {
        for (int s = 1; s <= warmup + steps; s++) {
            double t0 = now_ms();
            body(s);
            double t1 = now_ms();
            if (s > warmup) printf("%s %.3f\n", name, t1 - t0);
        }
        fflush(stdout);
    };
    report("memcpy", [&](int) {  // m <- p: 4n bytes read, 4n written
        #pragma omp parallel
        {
            int t = omp_get_thread_num(), T = omp_get_num_threads();
            size_t lo = n * t / T, hi = n * (t + 1) / T;
            memcpy(m.data() + lo, p.data() + lo, (hi - lo) * sizeof(float));
        }
    });
    report("streams7", [&](int) {  // AdamW's streams, one add each: 16n bytes read, 12n written
        float* P = p.data(); const float* G = g.data(); float* M = m.data(); float* V = v.data();
        #pragma omp parallel for schedule(static)
        for (size_t i = 0; i < n; i++) { M[i] += G[i]; V[i] += P[i]; P[i] += G[i]; }
    });
    memset(m.data(), 0, n * sizeof(float));
    memset(v.data(), 0, n * sizeof(float));
    // as train_gpt_cpu.cpp's optimizer_step calls them with ZeRO-0: AdamW once per tensor, 2-D weights decayed
    report("adamw_fp32", [&](int t) {
        for (int k = 0; k < NUM_PARAM_TENSORS; k++) {
            size_t at = layout.offset[k];
            cpu::adamw_update(p.data() + at, g.data() + at, m.data() + at, v.data() + at, layout.count[k], 6e-4f, 0.9f, 0.95f,
                              1e-8f, param_tensor_decays(k) ? 0.1f : 0.0f, t, 1.0f);
        }
    });
    report("adamw_bf16", [&](int t) {
        for (int k = 0; k < NUM_PARAM_TENSORS; k++) {
            size_t at = layout.offset[k];
            cpu::adamw_update_bf16(p.data() + at, g.data() + at, m16.data() + at, v16.data() + at, layout.count[k], 6e-4f, 0.9f,
                                   0.95f, 1e-8f, param_tensor_decays(k) ? 0.1f : 0.0f, t, 1.0f, at);
        }
    });
    report("adafactor", [&](int t) {
        cpu::adafactor_step(p.data(), g.data(), state.data(), blocks, cpu::adafactor_relative_step(t), t, 0.1f, 1.0f);
    });
    std::fill(state.begin(), state.end(), 0.0f);
    report("sm3", [&](int) { cpu::sm3_step_all(p.data(), g.data(), state.data(), scratch.data(), blocks, 6e-4f, 0.1f, 1.0f); });
    return 0;
}
"""

# bytes per parameter each measurement touches (see the docstring)
BYTES_PER_PARAM = {"memcpy": 8, "streams7": 28, "adamw_fp32": 28, "adamw_bf16": 20, "adafactor": 28, "sm3": 16,
                   "torch_foreach": 28, "torch_loop": 28}


def gpt2_tensors(L, C, V, T):
    """GPT-2's parameter tensors as (shape, decays), in the trainer's order (llmc/model/model.h):
    the 2-D weights decay, biases and LayerNorm parameters do not. The token embedding has the padded
    vocabulary's rows (a multiple of 128), as the trainer allocates and updates them."""
    Vp = (V + 127) // 128 * 128
    t = [((Vp, C), True), ((T, C), True)]
    for _ in range(L):
        t += [((C,), False), ((C,), False), ((3 * C, C), True), ((3 * C,), False), ((C, C), True), ((C,), False),
              ((C,), False), ((C,), False), ((4 * C, C), True), ((4 * C,), False), ((C, 4 * C), True), ((C,), False)]
    return t + [((C,), False), ((C,), False)]


MODELS = {"d12": (12, 768, 50257, 1024), "d6": (6, 768, 50257, 1024), "tiny": (2, 64, 512, 64)}


def build_harness(workdir):
    src, exe = os.path.join(workdir, "adamw_harness.cpp"), os.path.join(workdir, "adamw_harness")
    with open(src, "w") as f:
        f.write(HARNESS_SOURCE)
    flags = ["-O3", "-march=native", "-ffp-contract=fast", "-fno-math-errno", "-std=c++17", "-fopenmp", "-I", ROOT]
    subprocess.run(["g++", *flags, src, "-o", exe], check=True)
    return exe


def run_harness(exe, model, threads, warmup, steps):
    env = dict(os.environ, OMP_NUM_THREADS=str(threads))
    out = subprocess.run([exe, str(threads), str(warmup), str(steps), *map(str, MODELS[model])], capture_output=True, text=True,
                         check=True, env=env).stdout
    times = {}
    for name, ms in re.findall(r"^(\w+) (\d+\.\d+)$", out, re.M):
        times.setdefault(name, []).append(float(ms))
    return {k: statistics.median(v) for k, v in times.items()}, int(re.search(r"^parameters (\d+)", out, re.M).group(1))


def _numel(shape):
    n = 1
    for s in shape:
        n *= s
    return n


class TorchAdamW:
    """torch.optim.AdamW on tensors of the given shapes, two parameter groups (decay / no decay)."""

    def __init__(self, torch, tensors, foreach):
        self.torch = torch
        gen = torch.Generator().manual_seed(0)
        self.params = []
        for shape, _ in tensors:
            p = torch.nn.Parameter((torch.rand(shape, generator=gen) - 0.5) * 0.04)
            p.grad = (torch.rand(shape, generator=gen) - 0.5) * 0.01
            self.params.append(p)
        decay = [p for p, (_, d) in zip(self.params, tensors) if d]
        rest = [p for p, (_, d) in zip(self.params, tensors) if not d]
        self.opt = torch.optim.AdamW([{"params": decay, "weight_decay": WD}, {"params": rest, "weight_decay": 0.0}], lr=LR,
                                     betas=(BETA1, BETA2), eps=EPS, foreach=foreach)

    def time_steps(self, warmup, steps):
        times = []
        with self.torch.no_grad():
            for s in range(warmup + steps):
                t0 = time.perf_counter()
                self.opt.step()
                t1 = time.perf_counter()
                if s >= warmup:
                    times.append((t1 - t0) * 1e3)
        return statistics.median(times)


def speed(a):
    import torch  # only the speed part needs it
    torch.set_num_threads(a.threads)
    tensors = gpt2_tensors(*MODELS[a.model])
    n = sum(_numel(s) for s, _ in tensors)
    with tempfile.TemporaryDirectory() as workdir:
        exe = build_harness(workdir)
        print(f"\nspeed: {a.model}, {len(tensors)} tensors, {n:,d} parameters, {a.threads} threads, torch {torch.__version__} "
              f"(CPU AdamW: no fused kernel; foreach=True and foreach=False timed), median of {a.steps} steps after "
              f"{a.warmup}, {a.rounds} rounds; load average {load()} before")
        opts = {"torch_foreach": TorchAdamW(torch, tensors, True), "torch_loop": TorchAdamW(torch, tensors, False)}
        rounds = []
        for r in range(a.rounds):
            row, ours_n = run_harness(exe, a.model, a.threads, a.warmup, a.steps)
            assert ours_n == n, f"the harness's parameter table has {ours_n} parameters, torch's {n}"
            for name, opt in opts.items():
                row[name] = opt.time_steps(a.warmup, a.steps)
            rounds.append(row)
            print(f"  round {r + 1}: " + ", ".join(f"{k} {v:.1f} ms" for k, v in row.items()) + f" (load {load()})")
    names = ["memcpy", "streams7", "adamw_fp32", "adamw_bf16", "adafactor", "sm3", "torch_foreach", "torch_loop"]
    what = {"memcpy": "memory bandwidth: memcpy (read + written)", "streams7": "memory bandwidth: AdamW's 7 streams, adds only",
            "adamw_fp32": "ours: AdamW, fp32 m and v (adamw.h)", "adamw_bf16": "ours: AdamW, bf16 m and v (adamw_bf16.h)",
            "adafactor": "ours: Adafactor (adafactor.h)", "sm3": "ours: SM3 (sm3.h)",
            "torch_foreach": "torch.optim.AdamW, foreach=True", "torch_loop": "torch.optim.AdamW, foreach=False"}
    bw = statistics.median(n * BYTES_PER_PARAM["streams7"] / (r["streams7"] * 1e-3) / 1e9 for r in rounds)
    print(f"\n  {'':48s} {'ms/step':>9s} {'B/param':>8s} {'GB/s':>7s} {'% of 7-stream bw':>17s} {'ours fp32 speed-up':>19s}")
    for k in names:
        ms = statistics.median(r[k] for r in rounds)
        gbs = n * BYTES_PER_PARAM[k] / (ms * 1e-3) / 1e9
        ratio = statistics.median(r[k] / r["adamw_fp32"] for r in rounds) if k.startswith("torch") else None
        print(f"  {what[k]:48s} {ms:9.1f} {BYTES_PER_PARAM[k]:8d} {gbs:7.1f} {100 * gbs / bw:16.0f}% "
              f"{(f'{ratio:.2f}x' if ratio else ''):>19s}")
    print("  (speed-up: the median over rounds of torch's time / ours in the same round; the goal is >= 3x)")
    print(f"  load average {load()} after")


LOSS_RUNS = [("AdamW fp32", "adamw_fp32", []), ("AdamW bf16 m and v", "adamw_bf16", ["--optimizer-state", "bf16"]),
             ("Adafactor", "adafactor", ["--optimizer", "adafactor"]), ("SM3", "sm3", ["--optimizer", "sm3"])]


def loss(a):
    print(f"\nloss: the main job's shape ({' '.join(MAIN_JOB)}), {a.loss_steps} steps each, validation every {a.val_every} "
          f"steps on the whole validation split; load average {load()} before")
    results = []
    runs = [run for run in LOSS_RUNS if run[1] in a.optimizers.split(",")]
    for label, name, flags in runs:
        out = os.path.join(a.out, name)
        r = run_or_reuse(a.reuse, flags, out, a.loss_steps, a.val_every, a.threads)
        losses, val, wall = r["loss"], r["val"][a.loss_steps], r["wall"]
        results.append((label, out, losses, val, wall))
        print(f"  {label:18s} first loss {losses[0]:.4f}, mean of the last 20 {statistics.mean(losses[-20:]):.4f}, "
              f"val {val:.4f} ({f'{wall:.0f} s wall' if wall else 'read from ' + out}, load {load()})")
    print(f"\n  | optimizer | state bytes/param | train loss (mean of steps {a.loss_steps - 19}-{a.loss_steps}) | val loss at step {a.loss_steps} |")
    state = {"adamw_fp32": "8", "adamw_bf16": "4", "adafactor": "rows + cols", "sm3": "rows + cols"}
    for (label, out, losses, val, _), (_, name, _) in zip(results, runs):
        print(f"  | {label} | {state[name]} | {statistics.mean(losses[-20:]):.4f} | {val:.4f} |")
    if a.plot:
        plot([r[1] for r in results], [r[0] for r in results], a.plot,
             f"main job (L=8 C=64, B=8 T=64), {a.loss_steps} steps: four optimizers")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="speed,loss", help="speed, loss or both (comma-separated)")
    ap.add_argument("--model", default="d12", choices=sorted(MODELS), help="the parameter table of the speed part")
    ap.add_argument("--threads", type=int, default=2, help="threads of the speed part and of each loss run")
    ap.add_argument("--warmup", type=int, default=2, help="speed: steps dropped at the start of each measurement")
    ap.add_argument("--steps", type=int, default=5, help="speed: steps timed per measurement and round")
    ap.add_argument("--rounds", type=int, default=3, help="speed: rounds, ours and torch's alternating")
    ap.add_argument("--loss-steps", type=int, default=300)
    ap.add_argument("--val-every", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_optimizers"), help="loss: the runs' out dirs")
    ap.add_argument("--plot", default="", help="loss: write the plot here (e.g. docs/optimizers_loss.png)")
    ap.add_argument("--optimizers", default=",".join(r[1] for r in LOSS_RUNS), help="loss: which runs (comma-separated)")
    ap.add_argument("--reuse", action="store_true", help="loss: read a run already in --out that reached --loss-steps "
                    "instead of training it again (to train the runs side by side in separate processes)")
    a = ap.parse_args()
    header("bench_optimizers", f"the main job: {' '.join(MAIN_JOB)}")
    parts = a.parts.split(",")
    if "speed" in parts:
        speed(a)
    if "loss" in parts:
        loss(a)


if __name__ == "__main__":
    main()
