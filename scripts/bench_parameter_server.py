#!/usr/bin/python3
"""The parameter server against the all-reduce (--data-parallel server | allreduce, llmc/parallel/
parameter_server.h) on the CPU trainer: median step time and the bytes through the busiest rank, at 2
and 3 ranks, in one run on one machine.

The bytes are the trainer's own counters (its last line on data-parallel traffic: the server counts
what it received, every rank what it sent); the time is the median of each run's steps after the
first, over --rounds rounds (server and all-reduce alternate, so a shared machine's load falls on both).
The model is "small": L=4 C=256 H=4, GPT-2's vocabulary (50257, padded 50304), one micro-batch of
--seq-len tokens per rank and step, one thread per rank.

    python3 scripts/bench_parameter_server.py                  2 and 3 ranks, 2 rounds of 6 steps
    python3 scripts/bench_parameter_server.py --ranks 2 3 4 --rounds 3
"""
import argparse, json, os, platform, re, shutil, statistics, subprocess, sys, tempfile
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from token_shards import write_shard  # noqa: E402

TRAINER = os.path.join(ROOT, "train_gpt_cpu")
MODEL = "L=4,C=256,H=4,T=256,V=50257"


def run(work, ranks, how, steps, seq_len):
    out_dir = os.path.join(work, f"out_{how}_{ranks}")
    shutil.rmtree(out_dir, ignore_errors=True)
    cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(ranks), TRAINER,
           "--model", MODEL, "--train-data", os.path.join(work, "train_*.bin"), "--val-data", "none",
           "--seq-len", str(seq_len), "--batch-size", "1", "--total-batch-tokens", str(seq_len * ranks),
           "--steps", str(steps), "--threads", "1", "--data-parallel", how, "--out-dir", out_dir]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{(p.stdout + p.stderr)[-2000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        ms = [json.loads(line)["ms"] for line in f if '"type":"step"' in line][1:]
    m = re.search(r"received (\d+) bytes of gradients \+ sent (\d+) bytes", p.stdout)
    if m:
        through = int(m.group(1)) + int(m.group(2))
    else:
        m = re.search(r"each rank alike\): sent (\d+) bytes", p.stdout)
        through = 2 * int(m.group(1))
    weights = int(re.search(r"the (\d+) bytes of weights", p.stdout).group(1))
    return ms, through, weights


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", type=int, nargs="+", default=[2, 3])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--seq-len", type=int, default=64)
    a = ap.parse_args()
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.processor() or platform.machine()}, {os.cpu_count()} cores; commit {commit}; "
          f"command: {' '.join(sys.argv)}")
    work = tempfile.mkdtemp(prefix="llmc_bench_ps_")
    try:
        write_shard(os.path.join(work, "train_000.bin"), np.random.default_rng(0).integers(0, 50257, size=1 << 16))
        print(f"model {MODEL}, {a.seq_len} tokens per rank and step, one thread per rank, median of steps 2..{a.steps} "
              f"over {a.rounds} rounds")
        print(f"{'ranks':>5} {'how':>9} {'median ms':>10} {'bytes through the busiest rank':>31} {'x weights':>10}")
        for N in a.ranks:
            times = {"allreduce": [], "server": []}
            through = {}
            for _ in range(a.rounds):
                for how in ("allreduce", "server"):
                    ms, through[how], weights = run(work, N, how, a.steps, a.seq_len)
                    times[how] += ms
            for how in ("allreduce", "server"):
                print(f"{N:>5} {how:>9} {statistics.median(times[how]):>10.1f} {through[how]:>31,} "
                      f"{through[how] / weights:>10.3f}")
            print(f"{N:>5} server / allreduce: time x{statistics.median(times['server']) / statistics.median(times['allreduce']):.2f}, "
                  f"bytes through the busiest rank x{through['server'] / through['allreduce']:.2f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
