#!/usr/bin/env python3
"""--stash-precision fp32 against bf16 on the CPU trainer (llmc/memory/stash_precision.h): the memory
it saves, predicted and measured, what it costs per step, and what it does to the loss.

  memory, predicted   --estimate at --memory-shape (default d12, B=4, T=1024): activations,
                      workspace and total bytes of rank 0's size table, fp32 and bf16.
  memory, measured    one training step at the same shape (--measure-steps; 0 skips it), each
                      precision in its own process: what the trainer says it holds ("memory: rank 0
                      holds N bytes", the capacities of its buffers) and the process's peak resident
                      set (/usr/bin/time's maximum RSS: also the data, the code, the allocator's slack).
  step time, loss     the main job's model and batch (scripts/run.sh: L=8 C=64 H=4, B=8, T=64, lr 1e-2,
                      150 warm-up steps) for --steps steps on --train-data, fp32 then bf16: the
                      median step time of each (the first 5 steps dropped) and their ratio, both runs
                      in this one invocation; every step's loss side by side (the largest relative
                      difference, the last 20 steps' means) and the final validation loss.

The machine is shared, so the load average before and after is printed: only times measured side
by side compare.

    python3 scripts/bench_stash_precision.py --train-data 'data/moby-dick/moby-dick_train_*.bin' \\
        --val-data 'data/moby-dick/moby-dick_val_*.bin' --steps 200
"""
import argparse
import os
import re
import statistics
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "train_gpt_cpu")
MAIN_JOB = ["--model", "L=8,C=64,H=4,T=64", "--batch-size", "8", "--seq-len", "64", "--lr", "1e-2", "--warmup-steps", "150"]


def load():
    return open("/proc/loadavg").read().split()[0]


def estimate(shape, precision):
    out = subprocess.run([TRAINER, *shape, "--estimate", "--stash-precision", precision], capture_output=True, text=True,
                         check=True).stdout
    m = re.search(r"^  rank 0: .*activations=(\d+) workspace=(\d+) total=(\d+)", out, re.M)
    return [int(x) for x in m.groups()]


def measure(shape, precision, data, steps, threads):
    cmd = ["/usr/bin/time", "-f", "maxrss_kib %M", TRAINER, *shape, *data, "--val-data", "none", "--steps", str(steps),
           "--stash-precision", precision, "--sample-every", "0", "--checkpoint-every", "0", "--metrics", "none",
           "--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    held = int(re.search(r"memory: rank 0 holds .*?\((\d+) bytes\)", p.stdout).group(1))
    rss = int(re.search(r"maxrss_kib (\d+)", p.stderr).group(1)) * 1024
    return held, rss


def train(precision, data, val, steps, threads):
    cmd = [TRAINER, *MAIN_JOB, *data, "--val-data", val, "--val-every", str(steps), "--steps", str(steps),
           "--stash-precision", precision, "--sample-every", "0", "--checkpoint-every", "0", "--metrics", "none",
           "--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    steps_seen = re.findall(r"^step\s+\d+/\d+ \| loss ([\d.]+) .*?\| ([\d.]+) ms", p.stdout, re.M)
    vals = re.findall(r"val loss ([\d.]+)", p.stdout)
    return [float(l) for l, _ in steps_seen], [float(ms) for _, ms in steps_seen], (float(vals[-1]) if vals else None)


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--memory-shape", default="d12,4,1024", help="MODEL,B,T for the memory rows")
    ap.add_argument("--measure-steps", type=int, default=1, help="steps of the measured memory runs (0: prediction only)")
    ap.add_argument("--train-data", default="data/moby-dick/moby-dick_train_*.bin")
    ap.add_argument("--val-data", default="data/moby-dick/moby-dick_val_*.bin")
    ap.add_argument("--steps", type=int, default=200, help="steps of the main job's shape per precision (0: skip)")
    ap.add_argument("--threads", type=int, default=0)
    a = ap.parse_args()
    model, B, T = a.memory_shape.split(",")
    shape = ["--model", model, "--batch-size", B, "--seq-len", T]
    data = ["--train-data", a.train_data]
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"bench_stash_precision: commit {commit}, {os.cpu_count()} cores, load average {load()} before")

    print(f"\nmemory of rank 0 at {model} B={B} T={T} (bytes)")
    print(f"  {'stash':6s} {'activations':>14s} {'workspace':>14s} {'predicted total':>16s} {'held (measured)':>16s} {'peak RSS':>14s}")
    rows = {}
    for precision in ("fp32", "bf16"):
        act, ws, total = estimate(shape, precision)
        held, rss = measure(shape, precision, data, a.measure_steps, a.threads) if a.measure_steps > 0 else (0, 0)
        rows[precision] = (act, ws, total, held, rss)
        print(f"  {precision:6s} {act:14,d} {ws:14,d} {total:16,d} {held:16,d} {rss:14,d}")
    f, b = rows["fp32"], rows["bf16"]
    print(f"  saved  {f[0] - b[0]:14,d} {f[1] - b[1]:14,d} {f[2] - b[2]:16,d} {f[3] - b[3]:16,d} {f[4] - b[4]:14,d}"
          f"   (total {100.0 * (f[2] - b[2]) / f[2]:.1f}% predicted, peak RSS {100.0 * (f[4] - b[4]) / max(f[4], 1):.1f}%)")

    if a.steps > 0:
        runs = {p: train(p, data, a.val_data, a.steps, a.threads) for p in ("fp32", "bf16")}
        (lf, tf, vf), (lb, tb, vb) = runs["fp32"], runs["bf16"]
        mf, mb = statistics.median(tf[5:]), statistics.median(tb[5:])
        worst = max(abs(x - y) / x for x, y in zip(lf, lb))
        print(f"\nthe main job's shape ({' '.join(MAIN_JOB)}), {a.steps} steps each")
        print(f"  median step: fp32 {mf:.1f} ms, bf16 {mb:.1f} ms, ratio bf16/fp32 {mb / mf:.3f}")
        print(f"  first loss: fp32 {lf[0]:.6f}, bf16 {lb[0]:.6f} ({'the same' if lf[0] == lb[0] else 'DIFFERENT'})")
        print(f"  largest relative loss difference over the steps: {worst:.2e}")
        every = max(1, a.steps // 8)
        print("  step  " + " ".join(f"{s:>7d}" for s in range(every, a.steps + 1, every)))
        print("  fp32  " + " ".join(f"{lf[s - 1]:7.4f}" for s in range(every, a.steps + 1, every)))
        print("  bf16  " + " ".join(f"{lb[s - 1]:7.4f}" for s in range(every, a.steps + 1, every)))
        print(f"  mean loss of the last 20 steps: fp32 {statistics.mean(lf[-20:]):.4f}, bf16 {statistics.mean(lb[-20:]):.4f}")
        print(f"  validation loss at step {a.steps}: fp32 {vf}, bf16 {vb}")
    print(f"\nload average {load()} after")


if __name__ == "__main__":
    main()
