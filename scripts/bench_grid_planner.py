#!/usr/bin/python3
"""The grid planner (--plan, llmc/parallel/grid_planner.h) against measured step times: every grid of
--ranks CPU-trainer ranks, predicted and then run, side by side, in one run on one machine.

What it checks: whether the planner's model of a step (compute + pipeline bubble + each group's bytes
/ bandwidth) orders the grids as they really run, and by how much it is off. Not a test: the times
depend on the machine and its load; the numbers go into docs/parallelism.md ("Choosing a grid").

The planner is given what it needs, measured here first:
  FLOP rate   a one-rank, one-thread run of the same model and batch (micro-batches accumulated):
              FLOPs per step (6N + 6LCT per token) / its median step time, then times
              min(1, cores / ranks) (ranks that oversubscribe the cores share them)
  bandwidth   ./comm_bench's bus bandwidth of an all-reduce of the gradients' size (4N bytes) over
              --ranks ranks (the planner's one bandwidth for every group: one machine)
Then every grid the planner lists runs --steps steps under mpirun (one thread per rank, ranks
oversubscribing the cores as the tests do), in --rounds rounds (each grid once per round, so a shared
machine's changing load falls on all alike); a grid's time is the median of its steps after the
first, over all rounds. Printed: each grid's predicted and measured ms, their ratio, the two orders'
Spearman rank correlation, and whether the predicted winner is the measured one.

    python3 scripts/bench_grid_planner.py                       4 ranks, the default model
    python3 scripts/bench_grid_planner.py --ranks 2 --rounds 3
"""
import argparse, json, os, platform, re, shutil, statistics, subprocess, sys, tempfile, time
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from token_shards import write_shard  # noqa: E402
from test_grid_planner import parse_plan  # noqa: E402

TRAINER = os.path.join(ROOT, "train_gpt_cpu")
COMM_BENCH = os.path.join(ROOT, "comm_bench")
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]


def sh(cmd, timeout=900):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{(p.stdout + p.stderr)[-2000:]}")
    return p.stdout


def step_ms(metrics):
    """The step times after the first (which pays the start-up), from the trainer's metrics log."""
    with open(metrics) as f:
        ms = [json.loads(l)["ms"] for l in f if '"type":"step"' in l.replace(" ", "")]
    return ms[1:]


def spearman(a, b):
    rank = lambda v: {x: i for i, x in enumerate(sorted(range(len(v)), key=lambda k: v[k]))}
    ra, rb = rank(a), rank(b)
    n = len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1)) if n > 1 else 1.0


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, default=4)
    ap.add_argument("--model", default="L=4,C=128,H=4,T=64,V=2048")
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--micro-batches", type=int, default=8, help="micro-batches of B sequences per step, all ranks")
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    for path in (TRAINER, COMM_BENCH):
        if not os.path.exists(path):
            sys.exit(f"{path} is not built: make train_gpt_cpu comm_bench")
    cores = os.cpu_count()
    tokens = args.batch_size * args.seq_len * args.micro_batches
    work = tempfile.mkdtemp(prefix="llmc_bench_plan_")
    V = int(re.search(r"V=(\d+)", args.model)[1])
    write_shard(os.path.join(work, "train_0.bin"), np.random.default_rng(0).integers(0, V, 400_000))
    batch = ["--model", args.model, "--batch-size", str(args.batch_size), "--seq-len", str(args.seq_len),
             "--total-batch-tokens", str(tokens)]
    train = batch + ["--train-data", os.path.join(work, "train_*.bin"), "--val-data", "none", "--threads", "1",
                     "--steps", str(args.steps), "--out-dir", os.path.join(work, "out")]

    # ---- the FLOP rate: one rank, one thread, the same batch accumulated
    est = sh([TRAINER] + batch + ["--estimate"])
    flops_per_token = float(re.search(r"FLOPs per token .* = ([\d.e+]+)", est)[1])
    metrics = os.path.join(work, "one.jsonl")
    sh([TRAINER] + train + ["--metrics", metrics])
    one_ms = statistics.median(step_ms(metrics))
    rate = flops_per_token * tokens / (one_ms / 1e3) * min(1.0, cores / args.ranks)
    N = int(re.search(r"N = ([\d,]+) parameters", est)[1].replace(",", ""))
    # ---- the bandwidth: an all-reduce of the gradients' size
    size = 4 * N
    bench = sh(MPIRUN + ["-np", str(args.ranks), COMM_BENCH, "--ops", "all-reduce", "--min-bytes", str(size),
                         "--max-bytes", str(size), "--iters", "10", "--warmup", "2"])
    busbw = float([l.split() for l in bench.splitlines() if l.strip() and l.split()[0].isdigit()][0][6])

    plan_cmd = [TRAINER] + batch + ["--plan", str(args.ranks), "--plan-tflops", f"{rate / 1e12:.6g}",
                                    "--plan-bandwidth", f"{busbw:.4g}", "--verbose"]
    plan_out = sh(plan_cmd)
    grids = parse_plan(plan_out)
    measured = {i: [] for i in range(len(grids))}
    for rnd in range(args.rounds):
        for i, g in enumerate(grids):
            metrics = os.path.join(work, f"g{i}_{rnd}.jsonl")
            sh(["timeout", "600"] + MPIRUN + ["-np", str(args.ranks), TRAINER] + train +
               ["--tensor-parallel", str(g["tp"]), "--pipeline-parallel", str(g["pp"]), "--zero", str(g["zero"]),
                "--metrics", metrics])
            measured[i] += step_ms(metrics)
    got = [statistics.median(measured[i]) for i in range(len(grids))]
    want = [g["step"] for g in grids]

    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    load = os.getloadavg()
    print(f"machine: {platform.processor() or platform.machine()}, {cores} cores, load average {load[0]:.1f} {load[1]:.1f} "
          f"{load[2]:.1f} at the end; commit {commit}")
    print(f"model {args.model}, B={args.batch_size} T={args.seq_len}, {tokens} tokens per step, {args.ranks} ranks x 1 thread, "
          f"{args.steps} steps x {args.rounds} rounds (median of the steps after the first)")
    print(f"measured: one rank {one_ms:.1f} ms per step -> {rate / 1e9:.2f} GFLOP/s per rank at {args.ranks} ranks "
          f"(x {min(1.0, cores / args.ranks):.2f} for {cores} cores); all-reduce of {size} bytes: busbw {busbw:.3g} GB/s")
    print("plan: " + " ".join(os.path.relpath(c, ROOT) if c.startswith(ROOT) else c for c in plan_cmd))
    print(f"\n| grid (dp x tp x pp, ZeRO) | m | predicted ms | compute + bubble | tensor + pipe + data | measured ms | "
          f"measured / predicted |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for g, m in zip(grids, got):
        print(f"| {g['dp']} x {g['tp']} x {g['pp']}, ZeRO-{g['zero']} | {g['m']} | {g['step']:.1f} | "
              f"{g['compute'] + g['bubble']:.1f} | {g['tensor'] + g['pipe'] + g['data']:.1f} | {m:.1f} | {m / g['step']:.2f} |")
    best = min(range(len(grids)), key=lambda i: got[i])
    print(f"\nSpearman rank correlation, predicted against measured order: {spearman(want, got):.2f}")
    print(f"predicted winner: {grids[0]['dp']} x {grids[0]['tp']} x {grids[0]['pp']}, ZeRO-{grids[0]['zero']}; "
          f"measured fastest: {grids[best]['dp']} x {grids[best]['tp']} x {grids[best]['pp']}, ZeRO-{grids[best]['zero']} "
          f"({got[best]:.1f} ms; the predicted winner measured {got[0]:.1f} ms)")
    shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
