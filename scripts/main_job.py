"""The main job's shape on the CPU, for the benchmark scripts that compare techniques on it
(bench_optimizers.py, bench_moe_corpus.py, bench_grad_compression.py): scripts/run.sh's model and
batch (L=8 C=64 H=4, B=8, T=64, lr 1e-2 cosine to 0, 150 warm-up steps) on Moby Dick
(scripts/get_corpus.sh moby-dick), one run of the CPU trainer, its metrics log read back.
"""
import json
import os
import re
import shutil
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "train_gpt_cpu")
MAIN_JOB = ["--model", "L=8,C=64,H=4,T=64", "--batch-size", "8", "--seq-len", "64", "--lr", "1e-2", "--warmup-steps", "150"]
TRAIN_DATA, VAL_DATA = "data/moby-dick/moby-dick_train_*.bin", "data/moby-dick/moby-dick_val_*.bin"

# OpenMP threads spin 300,000 times at a barrier before sleeping (libgomp's default): on cores shared
# with other jobs a spinning thread burns the slice its partner needs (scripts/run.sh sets the same).
os.environ.setdefault("GOMP_SPINCOUNT", "10000")


def load():
    return open("/proc/loadavg").read().split()[0]


def commit():
    return subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()


def run_main_job(flags, out_dir, steps, val_every=0, threads=1, ranks=1):
    """Trains `steps` steps of the main job with `flags` added (on `ranks` MPI ranks of `threads`
    threads each), validating every `val_every` steps (0: never) on the whole validation split. Returns a dict:
    loss and ms (one per step), val ({step: loss}), records (the metrics log's step records),
    wall (seconds, start-up included), stdout."""
    if not os.path.exists(os.path.join(ROOT, TRAIN_DATA.replace("*", "000000"))):
        sys.exit("error: no Moby Dick shards in data/moby-dick: run scripts/get_corpus.sh moby-dick first")
    shutil.rmtree(out_dir, ignore_errors=True)
    val = ["--val-data", VAL_DATA, "--val-every", str(val_every)] if val_every else ["--val-data", "none"]
    cmd = [TRAINER, *MAIN_JOB, "--train-data", TRAIN_DATA, *val, "--steps", str(steps), "--sample-every", "0",
           "--checkpoint-every", "0", "--out-dir", out_dir, "--threads", str(threads), *flags]
    if ranks > 1:
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(ranks), *cmd]
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    wall = time.time() - t0
    if p.returncode != 0:
        sys.exit(f"error: {' '.join(cmd)} failed:\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
    run = read_main_job(out_dir)
    run.update(wall=wall, stdout=p.stdout)
    return run


def read_main_job(out_dir):
    """A finished run's metrics log, as run_main_job returns it (without wall and stdout)."""
    records = [json.loads(line) for line in open(os.path.join(out_dir, "metrics.jsonl")) if line.strip()]
    steps_seen = [r for r in records if r.get("type") == "step"]
    return {"loss": [r["loss"] for r in steps_seen], "ms": [r["ms"] for r in steps_seen], "records": steps_seen,
            "val": {r["step"]: r["val_loss"] for r in records if r.get("type") == "val"}, "wall": None, "stdout": ""}


def run_or_reuse(reuse, flags, out_dir, steps, val_every=0, threads=1, ranks=1):
    """run_main_job, or with `reuse` the run already in out_dir when its log reached `steps` (a
    benchmark's runs can then be trained in separate processes, side by side, and tabled once)."""
    if reuse and os.path.exists(os.path.join(out_dir, "metrics.jsonl")):
        run = read_main_job(out_dir)
        if len(run["loss"]) >= steps and (not val_every or steps in run["val"]):
            return run
    return run_main_job(flags, out_dir, steps, val_every, threads, ranks)


def header(script, what):
    """The line each benchmark opens with: the script, the commit, the CPU, the cores and the load."""
    cpu = re.search(r"model name\s*: (.*)", open("/proc/cpuinfo").read())
    print(f"{script}: commit {commit()}, {cpu.group(1) if cpu else '?'}, {os.cpu_count()} cores, load average {load()}; {what}")


def plot(run_dirs, labels, output, title):
    """The runs' metrics logs in one picture (scripts/plot_metrics.py)."""
    subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "plot_metrics.py"), *run_dirs, "-o", output, "--labels",
                    ",".join(labels), "--title", title], check=True)
    print(f"  plot: {output}")
