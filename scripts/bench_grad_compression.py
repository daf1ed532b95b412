#!/usr/bin/python3
"""PowerSGD against the exact gradient sum (issue 27, item 2's measurements): bytes on the wire,
step time on 2 and 4 ranks, and the loss over the main job's steps.

  bytes       GPT-2 124M (d12, B=1 T=64 per rank, 1 thread per rank) for --d12-steps steps on 2 and
              4 ranks (--bytes-ranks), --grad-compression none against powersgd --powersgd-rank 4: the bytes rank 0
              sent to its data-parallel group in the last step, from the trainer's own counters (its
              closing table, which says "= --estimate" when every rank's count is the prediction),
              and the step time (the median of the steps after the first).
  step time   the main job's shape (scripts/main_job.py; B=8 T=64 per rank) on 2 and 4 ranks of one
              thread each, none against powersgd r=4, --time-steps steps, alternating for --rounds
              rounds: the median step (the first 5 dropped) and the same round's ratio.
  loss        the main job on 2 ranks for --steps steps (validation every --val-every on 40
              batches), none against powersgd r=4 (no exact-sum start steps: --powersgd-start-step 0,
              the default): the losses side by side, one plot (scripts/plot_metrics.py).

Every rank of mpirun runs on this machine, so "the wire" is shared memory: the bytes are what a
network would carry, the step time is what this machine's cores do with them (2 cores: 4 ranks are
oversubscribed). The machine is shared with other jobs: the load average is printed beside every
timing; only times of the same round compare.

    /usr/bin/python3 scripts/bench_grad_compression.py --plot docs/grad_compression_loss.png
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from main_job import MAIN_JOB, ROOT, TRAINER, TRAIN_DATA, header, load, plot, run_main_job, run_or_reuse  # noqa: E402

POWERSGD = ["--grad-compression", "powersgd", "--powersgd-rank", "4"]
UNITS = {"B": 1, "KiB": 1024, "MiB": 1024 ** 2, "GiB": 1024 ** 3}


def data_bytes(stdout):
    """Rank 0's data-group bytes in the last step (the closing table) and whether all ranks were as predicted."""
    for line in stdout.splitlines():
        if line.startswith("  0 (0,0,0)"):
            number, unit = line.split("|")[1].split("/")[0].split()
            return float(number) * UNITS[unit], line.rstrip().endswith("= --estimate")
    sys.exit("error: the trainer printed no cost table (rank 0's row '  0 (0,0,0)')")


def d12_bytes(a):
    print(f"\nbytes: d12, B=1 T=64 per rank, {a.d12_steps} steps, 1 thread per rank; load average {load()} before")
    print("  | ranks | --grad-compression | bytes rank 0 sent a step | = --estimate | median step (s) | load after |")
    for ranks in a.bytes_ranks:
        row = {}
        for name, flags in (("none", []), ("powersgd r=4", POWERSGD)):
            cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(ranks), TRAINER,
                   "--model", "d12", "--batch-size", "1", "--seq-len", "64", "--train-data", TRAIN_DATA, "--val-data", "none",
                   "--steps", str(a.d12_steps), "--threads", "1", "--sample-every", "0", "--checkpoint-every", "0",
                   "--metrics", "none", *flags]
            p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
            if p.returncode != 0:
                sys.exit(f"error: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
            sent, as_predicted = data_bytes(p.stdout)
            ms = [float(x) for x in re.findall(r"^step\s+\d+/\d+ \|.*?\| ([\d.]+) ms", p.stdout, re.M)]
            row[name] = sent
            print(f"  | {ranks} | {name} | {sent / 2 ** 20:.1f} MiB | {'yes' if as_predicted else 'NO'} | "
                  f"{statistics.median(ms[1:] or ms) / 1e3:.2f} | {load()} |")
        print(f"  {ranks} ranks: powersgd sends {row['none'] / row['powersgd r=4']:.0f}x less than the exact sum")


def step_time(a):
    print(f"\nstep time: the main job's shape, {a.time_steps} steps, 1 thread per rank, {a.rounds} rounds; "
          f"load average {load()} before")
    for ranks in (2, 4):
        rounds = []
        for r in range(a.rounds):
            row = {}
            for name, flags in (("none", []), ("powersgd", POWERSGD)):
                run = run_main_job(flags, os.path.join(a.out, f"t{ranks}_{name}"), a.time_steps, 0, 1, ranks=ranks)
                row[name] = statistics.median(run["ms"][5:])
            rounds.append(row)
            print(f"  {ranks} ranks, round {r + 1}: none {row['none']:.1f} ms, powersgd {row['powersgd']:.1f} ms "
                  f"(load {load()})")
        ratio = statistics.median(r["powersgd"] / r["none"] for r in rounds)
        print(f"  {ranks} ranks: powersgd / none step time {ratio:.2f} (median of the rounds' ratios)")


def loss(a):
    print(f"\nloss: the main job on 2 ranks (B=8 T=64 each), {a.steps} steps, validation every {a.val_every}; "
          f"load average {load()} before")
    runs = {}
    for name, flags in (("none", []), ("powersgd", POWERSGD)):
        if name in a.compressions.split(","):
            runs[name] = run_or_reuse(a.reuse, flags, os.path.join(a.out, "loss_" + name), a.steps, a.val_every, 1, ranks=2)
            print(f"  {name} done (load {load()})")
    if len(runs) < 2:
        return
    n, p = runs["none"], runs["powersgd"]
    print("\n  | step | exact sum val loss | PowerSGD r=4 val loss | difference |")
    for s in sorted(n["val"]):
        print(f"  | {s} | {n['val'][s]:.4f} | {p['val'][s]:.4f} | {p['val'][s] - n['val'][s]:+.4f} |")
    print(f"  mean train loss of the last 20 steps: exact {statistics.mean(n['loss'][-20:]):.4f}, "
          f"powersgd {statistics.mean(p['loss'][-20:]):.4f}")
    if a.plot:
        plot([os.path.join(a.out, "loss_none"), os.path.join(a.out, "loss_powersgd")], ["exact sum (fp32)", "PowerSGD rank 4"],
             a.plot, f"main job on 2 ranks (L=8 C=64, B=8 T=64 each), {a.steps} steps")


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="bytes,time,loss", help="bytes, time, loss (comma-separated)")
    ap.add_argument("--d12-steps", type=int, default=3)
    ap.add_argument("--bytes-ranks", default="2,4", type=lambda s: [int(x) for x in s.split(",")],
                    help="bytes: the rank counts (each d12 rank holds about 3 GB with PowerSGD's buffers)")
    ap.add_argument("--time-steps", type=int, default=25)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--val-every", type=int, default=50)
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "bench_grad_compression"))
    ap.add_argument("--plot", default="", help="loss: write the plot here (e.g. docs/grad_compression_loss.png)")
    ap.add_argument("--compressions", default="none,powersgd", help="loss: which runs (the table needs both)")
    ap.add_argument("--reuse", action="store_true", help="loss: read a run already in --out that reached --steps instead "
                    "of training it again (to train the runs side by side in separate processes)")
    a = ap.parse_args()
    header("bench_grad_compression", f"the main job: {' '.join(MAIN_JOB)}; compression: {' '.join(POWERSGD)}")
    parts = a.parts.split(",")
    if "bytes" in parts:
        d12_bytes(a)
    if "time" in parts:
        step_time(a)
    if "loss" in parts:
        loss(a)


if __name__ == "__main__":
    main()
