#!/usr/bin/python3
"""Time the CPU trainer on 1 thread, 2 threads and its default, with and without one competing busy
program per core: training and generation, in one run on one machine (llmc/run/cpu_threads.h).

What it teaches: why a thread count that is right on a quiet machine collapses on a busy one. Every
kernel ends at a barrier that waits for its slowest thread; when another program shares a thread's
core, the barrier waits for the scheduler to give that core back (a time slice, milliseconds), and
libgomp's spinning threads burn the slice meanwhile. The trainer's default (--threads 0) sleeps
after 10,000 spins and counts the cores other programs keep busy, running on the free ones.

The sides, each run --repeats times in rounds (every side once per round, so a shared machine's
changing load falls on all alike), median wall-clock seconds of the whole process reported, start-up
included:
  1 thread                 --threads 1
  2 threads                --threads 2 (the trainer's own GOMP_SPINCOUNT=10000)
  default                  no --threads: the free cores, chosen by the trainer
  2 threads, spinning      --threads 2 with GOMP_SPINCOUNT=300000, libgomp's default: the trainer
                           before llmc/run/cpu_threads.h (a run is cut off at --timeout seconds)
The workloads: training, the main job's model (L=8, C=64, H=4, T=64; B=8, T=64) for --steps steps on
Moby Dick; generation, --tokens tokens from that model's checkpoint (written once, first) after
"Call me Ishmael.", KV cache. The competitors: one `while True: pass` Python process per CPU this
process may use, started for the loaded half and stopped after it. The load average (1 min) is
printed before and after each half: on a machine others share, say so beside the numbers.

    python3 scripts/bench_threads_under_load.py                   defaults: 10 steps, 64 tokens, 3 repeats
    python3 scripts/bench_threads_under_load.py --repeats 5 --steps 20
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = ["--model", "L=8,C=64,H=4,T=64", "--batch-size", "8", "--seq-len", "64"]
DATA = ["--train-data", os.path.join(ROOT, "data/moby-dick/moby-dick_train_000000.bin"), "--val-data", "none"]
SIDES = [("1 thread", ["--threads", "1"], {}),
         ("2 threads", ["--threads", "2"], {}),
         ("default", [], {}),
         ("2 threads, spinning", ["--threads", "2"], {"GOMP_SPINCOUNT": "300000"})]


def environment(extra):
    env = {k: v for k, v in os.environ.items() if k not in ("GOMP_SPINCOUNT", "OMP_WAIT_POLICY", "OMP_NUM_THREADS")}
    env.update(extra)
    return env


def timed(cmd, extra_env, timeout):
    """(seconds, threads the run said it used or None, stderr) of one run; seconds None past the timeout."""
    start = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=environment(extra_env), capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, None, ""
    seconds = time.monotonic() - start
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{p.stderr[-2000:]}")
    m = re.search(r"running on (\d+) thread", p.stderr) or re.search(r"; (\d+) threads per rank", p.stdout)
    return seconds, (int(m.group(1)) if m else None), p.stderr


def workloads(args, tmp):
    train = [args.trainer] + DATA + MODEL + ["--steps", str(args.steps), "--lr", "1e-3", "--sample-every", "0",
                                             "--checkpoint-every", "0", "--out-dir", os.path.join(tmp, "run")]
    out = os.path.join(tmp, "model")
    subprocess.run([args.trainer] + DATA + MODEL + ["--steps", "1", "--checkpoint-every", "1", "--sample-every", "0",
                                                    "--out-dir", out, "--quiet", "--threads", "1"],
                   cwd=ROOT, check=True, capture_output=True)
    generate = [args.trainer, "--resume", os.path.join(out, "ckpt_00000001"), "--generate", "Call me Ishmael.",
                "--sample-tokens", str(args.tokens), "--kv-cache", "1", "--seed", "1"]
    return [("training", train), ("generation", generate)]


def measure(args, jobs):
    times = {(w, s): [] for w, _ in jobs for s, _, _ in SIDES}
    chosen = {w: [] for w, _ in jobs}
    for _ in range(args.repeats):
        for w, cmd in jobs:
            for side, flags, env in SIDES:
                seconds, threads, _ = timed(cmd + flags, env, args.timeout)
                times[(w, side)].append(seconds)
                if side == "default" and threads is not None:
                    chosen[w].append(threads)
    return times, chosen


def median(xs):
    done = [x for x in xs if x is not None]
    return statistics.median(done) if len(done) == len(xs) else None


def report(label, times, chosen, jobs, load_before, load_after):
    print(f"\n{label}: load average (1 min) {load_before:.2f} before, {load_after:.2f} after")
    print(f"  {'workload':<11} {'side':<22} {'median s':>9} {'/ 1 thread':>11}   runs (s)")
    for w, _ in jobs:
        one = median(times[(w, "1 thread")])
        for side, _, _ in SIDES:
            m = median(times[(w, side)])
            ratio = f"{m / one:.2f}" if m is not None and one else "-"
            runs = " ".join(f"{x:.2f}" if x is not None else ">timeout" for x in times[(w, side)])
            shown = f"{m:.2f}" if m is not None else "-"
            print(f"  {w:<11} {side:<22} {shown:>9} {ratio:>11}   {runs}")
        print(f"  {w:<11} the default ran on {chosen[w] or 'the threads OpenMP offers (no note)'} thread(s) a run")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trainer", default=os.path.join(ROOT, "train_gpt_cpu"))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--timeout", type=float, default=120.0, help="seconds before a run is cut off")
    args = ap.parse_args()
    if not os.path.exists(args.trainer):
        sys.exit(f"error: {args.trainer} is missing; build it with: make train_gpt_cpu")
    cores = len(os.sched_getaffinity(0))
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"bench_threads_under_load: {cores} CPUs, commit {commit}, {args.steps} steps / {args.tokens} tokens, "
          f"{args.repeats} repeats, median wall-clock seconds of the whole process")
    with tempfile.TemporaryDirectory(prefix="llmc_threads_") as tmp:
        jobs = workloads(args, tmp)
        before = os.getloadavg()[0]
        times, chosen = measure(args, jobs)
        report("no competitors", times, chosen, jobs, before, os.getloadavg()[0])
        competitors = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(cores)]
        try:
            time.sleep(2)  # (the competitors are running before the first run starts)
            before = os.getloadavg()[0]
            times, chosen = measure(args, jobs)
            after = os.getloadavg()[0]
        finally:
            for p in competitors:
                p.kill()
                p.wait()
        report(f"{cores} competitors (one busy process per CPU)", times, chosen, jobs, before, after)


if __name__ == "__main__":
    main()
