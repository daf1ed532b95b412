#!/usr/bin/python3
"""The optimizer step with AdamW's m and v in RAM against --offload-dir (m and v in files, streamed
in chunks: llmc/optim/disk_offload.h), in one run of this script on the same machine.

What it measures: the "optimizer" span of --trace (clipping and the AdamW update; one rank, so no
communication), median over the steps after --warmup, for the trainer run three times: in RAM, with
--offload-dir, in RAM again (the two in-RAM runs bracket the offloaded one, so a machine that changed
speed in between shows as two different baselines). The offloaded step moves 16 bytes per parameter
through the files (m and v read, m and v written): bytes/s = 16 N / step time.

What it does not control: the page cache. The files are written and read through it (no O_DIRECT),
so with enough free RAM they stay there and the step runs at memory speed plus the system calls;
the disk's own speed shows only when RAM is short. The script prints the free memory before, and
the size of the files, so the reader can tell which case the numbers are.

    python3 scripts/bench_disk_offload.py                        d12, B=1 T=64, 6 steps (2 warm-up)
    python3 scripts/bench_disk_offload.py --model d12 --steps 8 --chunk-kib 1024 --dir /mnt/nvme
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from token_shards import write_shard  # noqa: E402


def optimizer_ms(trace_path, warmup):
    with open(trace_path) as f:
        text = f.read()
    if not text.rstrip().endswith("]}"):
        text = text.rstrip().rstrip(",") + "]}"
    events = json.loads(text)["traceEvents"]
    spans = [(e["args"]["step"], e["dur"] / 1000.0) for e in events if e.get("name") == "optimizer"]
    return [ms for step, ms in sorted(spans) if step > warmup]


def meminfo_gib(field):
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) / 2**20
    return float("nan")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default=os.path.join(ROOT, "train_gpt_cpu"))
    ap.add_argument("--model", default="d12")
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--chunk-kib", type=int, default=4096)
    ap.add_argument("--dir", default=None, help="where the files go (default: a new folder under $TMPDIR)")
    a = ap.parse_args()

    work = tempfile.mkdtemp(prefix="bench_disk_offload_")
    disk = a.dir or os.path.join(work, "disk")
    os.makedirs(disk, exist_ok=True)
    import numpy as np
    write_shard(os.path.join(work, "train_000.bin"), np.random.default_rng(0).integers(0, 50257, size=200000))
    commit = subprocess.run(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    print(f"machine: {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}, MemAvailable {meminfo_gib('MemAvailable'):.1f} GiB; "
          f"commit {commit}; --threads {a.threads}")
    base = [a.trainer, "--model", a.model, "--train-data", os.path.join(work, "train_*.bin"), "--val-data", "none",
            "--batch-size", "1", "--seq-len", str(a.seq_len), "--steps", str(a.steps), "--threads", str(a.threads),
            "--lr", "1e-4", "--out-dir", os.path.join(work, "out"), "--metrics", "none"]
    results = {}
    params = 0
    for label, extra in (("in RAM", []), ("--offload-dir", ["--offload-dir", disk, "--offload-chunk-kib", str(a.chunk_kib)]),
                         ("in RAM, again", [])):
        trace = os.path.join(work, "trace.json")
        cmd = base + extra + ["--trace", trace]
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr[-2000:]}")
        for line in p.stdout.splitlines():
            if line.startswith("model:") and "parameters" in line:
                params = int(line.split(",")[-1].split()[0])
        ms = optimizer_ms(trace, a.warmup)
        results[label] = statistics.median(ms)
        print(f"  {label:14s} optimizer step median {results[label]:8.1f} ms over steps {a.warmup + 1}..{a.steps} "
              f"({', '.join(f'{x:.0f}' for x in ms)})")
    ram = min(results["in RAM"], results["in RAM, again"])
    off = results["--offload-dir"]
    moved = 16.0 * params
    print(f"model {a.model}: {params:,} parameters; files {8 * params / 2**30:.2f} GiB (m and v), chunk {a.chunk_kib} KiB")
    print(f"--offload-dir / in RAM (the faster in-RAM run): {off / ram:.2f}x; through the files {moved / 2**30:.2f} GiB per step "
          f"= {moved / (off / 1000) / 1e9:.2f} GB/s (read + written); in RAM AdamW touches 28 bytes per parameter: "
          f"{28.0 * params / (ram / 1000) / 1e9:.2f} GB/s")
    print(f"MemAvailable after: {meminfo_gib('MemAvailable'):.1f} GiB (the page cache can hold the files: see the docstring)")
    subprocess.run(["rm", "-rf", work])


if __name__ == "__main__":
    main()
