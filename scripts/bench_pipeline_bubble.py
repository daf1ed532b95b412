#!/usr/bin/python3
"""The pipeline schedules' bubble, predicted against measured: GPipe, 1F1B, interleaved 1F1B (v = 2), ZB-H1
and PipeDream-2BW with and without the flush on 2 and 4 stages of the CPU trainer, with compute made
of sleeps, in one run on one machine.

Compute is made of sleeps (LLMC_TEST_PIPE_DELAY_MS, llmc/parallel/pipeline_parallel.h): a forward
sleeps D ms, a whole backward 2D (GPipe, 1F1B), ZB-H1's B and W D each, so F = B = W in ZB-H1's
units and the predictions are exact: (p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(3m+p-1) for ZB-H1
(llmc/parallel/pipeline_schedule.h derives both). Interleaved runs each model chunk's forward in
D/v ms and its backward in 2D/v (a chunk is 1/v of a stage), so its step time compares with 1F1B's
and its bubble is (p-1)/(vm+p-1). PipeDream-2BW without the flush (2bw) idles (p-1)B a step after the
first, where 2bw-flush (1F1B's list) idles (p-1)(F+B) (test_pipeline_schedule's unit clock): its
step is m(F+B) + (p-1)B = (3m + 2(p-1))D. The model has L = 8 layers, so that 4 stages hold 2 chunks. The tiny model's real compute comes on top. Open
MPI runs with its single-copy transport off (a message moves only while its sender is in MPI), as the
bubble checks of test/test_parallelism.py do. Measured: the trainer's own report, the part of the
first stage's schedule in which each stage was not computing, over --steps steps (the first step's
start-up included; for 2bw it misses the wait at each update, which is outside the schedule), and the
median step time over the steps between the first and the last (2bw drains at the last, as at a
checkpoint), against the predicted step, and the bubble that step time implies: 1 - m(F+B) / step,
each stage being busy m(F+B) a step (interleaved and ZB-H1 split the same work).

One run per configuration, --rounds rounds. The ZB-H1 run on 4 stages and the interleaved run on 2
also write --trace files, drawn by scripts/plot_pipeline.py into --png (W spans in their own colour)
and --png-interleaved (chunk 1's spans lighter). Not a test: times depend
on the machine's load, and ranks beyond its cores oversubscribe them (MPI's receives spin).

    python3 scripts/bench_pipeline_bubble.py      (writes docs/pipeline_zb-h1.png, docs/pipeline_interleaved.png)
    python3 scripts/bench_pipeline_bubble.py --delay-ms 100 --rounds 2 --png /tmp/zb.png
"""
import argparse, json, os, re, shutil, statistics, subprocess, sys, tempfile
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from token_shards import write_shard  # noqa: E402

TRAINER = os.path.join(ROOT, "train_gpt_cpu")
PLOT = os.path.join(ROOT, "scripts", "plot_pipeline.py")
MPIRUN = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
SENDER_DRIVEN = {"OMPI_MCA_btl_vader_single_copy_mechanism": "none", "OMPI_MCA_btl_sm_single_copy_mechanism": "none"}
MODEL, T = "L=8,C=64,H=4,T=32,V=501", 32
CHUNKS = 2  # interleaved's v


def run(cmd, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=ROOT, env=dict(os.environ, **(env or {})))
    if p.returncode != 0:
        sys.exit(f"failed ({p.returncode}): {' '.join(cmd)}\n{(p.stdout + p.stderr)[-2000:]}")
    return p.stdout


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--delay-ms", type=int, default=50)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--png", default=os.path.join(ROOT, "docs", "pipeline_zb-h1.png"))
    ap.add_argument("--png-interleaved", default=os.path.join(ROOT, "docs", "pipeline_interleaved.png"))
    args = ap.parse_args()
    if not os.path.exists(TRAINER) or not shutil.which("mpirun"):
        sys.exit("needs a built ./train_gpt_cpu (make train_gpt_cpu) and mpirun")
    work = tempfile.mkdtemp(prefix="bench_bubble_")
    try:
        write_shard(os.path.join(work, "train_000.bin"), np.random.default_rng(0).integers(0, 501, 16384))
        env = {"LLMC_TEST_PIPE_DELAY_MS": str(args.delay_ms), **SENDER_DRIVEN}
        rows = []
        for p in (2, 4):
            m = 2 * p
            for schedule in ("gpipe", "1f1b", "interleaved", "zb-h1", "2bw-flush", "2bw"):
                measured, ms = [], []
                chunks = ["--virtual-stages", str(CHUNKS)] if schedule == "interleaved" else []
                # a chunk is 1/v of a stage: its sleeps too
                delay = {"LLMC_TEST_PIPE_DELAY_MS": str(args.delay_ms // CHUNKS)} if chunks else {}
                for rnd in range(args.rounds):
                    metrics = os.path.join(work, f"{schedule}{p}_{rnd}.jsonl")
                    traced = rnd == 0 and ((schedule == "zb-h1" and p == 4) or (schedule == "interleaved" and p == 2))
                    trace = ["--trace", os.path.join(work, schedule + ".json")] if traced else []
                    out = run(["timeout", "600"] + MPIRUN + ["-np", str(p), TRAINER, "--model", MODEL, "--seq-len", str(T),
                               "--batch-size", "1", "--total-batch-tokens", str(m * T), "--train-data",
                               os.path.join(work, "train_*.bin"), "--val-data", "none", "--steps", str(args.steps),
                               "--threads", "1", "--pipeline-parallel", str(p), "--pipeline-schedule", schedule,
                               "--out-dir", os.path.join(work, "out"), "--metrics", metrics] + chunks + trace,
                              dict(env, **delay))
                    got = re.search(r"pipeline bubble: predicted (.*?) = ([\d.]+)%.*?not computing: ([\d.% ]+)", out)
                    if not got:
                        sys.exit(f"no bubble report in:\n{out[-1500:]}")
                    formula, predicted = got.group(1), float(got.group(2))
                    measured.append([float(x) for x in got.group(3).replace("%", "").split()])
                    with open(metrics) as f:
                        ms += [json.loads(line)["ms"] for line in f if '"type":"step"' in line.replace(" ", "")][1:-1]
                per_stage = [statistics.median(r[s] for r in measured) for s in range(p)]
                D = args.delay_ms  # the predicted step in units of D (F = D, B = 2D; interleaved's chunks D/v and 2D/v)
                units = {"gpipe": 3 * (m + p - 1), "1f1b": 3 * (m + p - 1), "2bw-flush": 3 * (m + p - 1),
                         "interleaved": 3 * (CHUNKS * m + p - 1) / CHUNKS, "zb-h1": 3 * m + p - 1, "2bw": 3 * m + 2 * (p - 1)}[schedule]
                if schedule == "2bw":
                    formula, predicted = "(2(p-1))/(3m+2(p-1)), steady", 100.0 * 2 * (p - 1) / (3 * m + 2 * (p - 1))
                step = statistics.median(ms) if ms else float("nan")
                rows.append((schedule, p, m, formula, predicted, per_stage, step, units * D, 100.0 * (1 - 3 * m * D / step)))

        plots = {}
        for schedule, png in (("zb-h1", args.png), ("interleaved", args.png_interleaved)):
            traces = sorted(os.path.join(work, f) for f in os.listdir(work) if f.startswith(schedule + ".rank"))
            plots[schedule] = run(["/usr/bin/python3", PLOT] + traces + ["-o", png])

        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
        load = os.getloadavg()
        print(f"machine: {os.cpu_count()} logical CPUs, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f} at the end; "
              f"commit {commit}; command: {' '.join(sys.argv)}")
        print(f"model {MODEL}, B=1 T={T}, m = 2p micro-batches, {args.steps} steps x {args.rounds} rounds, 1 thread per rank; "
              f"F = {args.delay_ms} ms, a whole backward {2 * args.delay_ms} ms, ZB-H1's B and W {args.delay_ms} ms each, "
              f"interleaved's per chunk {args.delay_ms // CHUNKS} and {2 * (args.delay_ms // CHUNKS)} ms, v = {CHUNKS} (sleeps)")
        print(f"{'schedule':11} {'p':>2} {'m':>2}  {'predicted bubble':>36}  {'not computing per stage (%)':>28}  "
              f"{'step ms':>8} {'predicted':>9}  {'bubble from step':>16}")
        for schedule, p, m, formula, predicted, per_stage, step, want_ms, from_step in rows:
            stages = " ".join(f"{x:.1f}" for x in per_stage)
            print(f"{schedule:11} {p:>2} {m:>2}  {formula + ' = ' + f'{predicted:.1f}%':>36}  {stages:>28}  {step:8.0f} "
                  f"{want_ms:9.0f}  {from_step:15.1f}%")
        if os.cpu_count() and os.cpu_count() < 4:
            print(f"(4 ranks on {os.cpu_count()} logical CPUs oversubscribe them: the 4-stage numbers include waiting for a core)")
        print(f"pictures (the last step of the first round): {args.png} (ZB-H1, 4 stages):")
        print(plots["zb-h1"].strip())
        print(f"{args.png_interleaved} (interleaved, 2 stages, v = {CHUNKS}):")
        print(plots["interleaved"].strip())
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
