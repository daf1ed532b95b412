#!/usr/bin/env python3
"""bench_pipeline_memory.py — each pipeline stage's memory under each schedule: --estimate's table
against the peak RSS each rank really reaches (docs/parallelism.md, ZB-H1's memory).

The CPU trainer zero-fills every row of its size table when it allocates (gpt2_allocate), so the
table is resident before the first forward and a step adds only per-call scratch. So a short look is
enough: each rank's VmHWM (peak RSS, /proc/PID/status) is read --seconds into the first step, then
the run is stopped. Prints, per schedule and rank, --estimate's total and activations and the
measured peak RSS, in MB (10^6 bytes).

    python3 scripts/bench_pipeline_memory.py --model d12 --seq-len 1024 --batch-size 1 \\
        --micro-batches 8 --stages 4 --schedules 1f1b zb-h1 [--trainer OTHER_BINARY]
"""
import argparse, os, re, shutil, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from test_parallelism import write_pattern_shard  # noqa: E402  (tokens below 501: any vocabulary takes them)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default=os.path.join(ROOT, "train_gpt_cpu"))
    ap.add_argument("--model", default="d12")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--batch-size", type=int, default=1)
    ap.add_argument("--micro-batches", type=int, default=8)
    ap.add_argument("--stages", type=int, default=4)
    ap.add_argument("--schedules", nargs="+", default=["1f1b", "zb-h1"])
    ap.add_argument("--seconds", type=float, default=60.0, help="how long into the run to read the peaks")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="llmc_pipemem_")
    try:
        write_pattern_shard(work)
        shape = ["--model", a.model, "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size),
                 "--total-batch-tokens", str(a.micro_batches * a.batch_size * a.seq_len), "--pipeline-parallel", str(a.stages)]
        print(f"# {a.trainer}; {' '.join(shape)}; peaks read {a.seconds:.0f} s into the first step; "
              f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        print(f"{'schedule':9s} {'rank':>4s} {'est. total':>11s} {'est. act.':>10s} {'peak RSS':>9s}   (MB)")
        for sched in a.schedules:
            est = subprocess.run([a.trainer, *shape, "--pipeline-schedule", sched, "--estimate"], capture_output=True,
                                 text=True, cwd=work).stdout
            rows = {int(r): (int(act), int(tot)) for r, act, tot in
                    re.findall(r"^  rank (\d+): .*?activations=(\d+) .*?total=(\d+)", est, re.M)}
            cmd = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", str(a.stages), a.trainer, *shape,
                   "--pipeline-schedule", sched, "--steps", "1", "--threads", "1", "--val-data", "none",
                   "--train-data", os.path.join(work, "train_*.bin"), "--out-dir", os.path.join(work, "out")]
            run = subprocess.Popen(cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            time.sleep(a.seconds)
            peaks = {}
            for pid in subprocess.run(["pgrep", "-P", str(run.pid)], capture_output=True, text=True).stdout.split():
                try:
                    env = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
                    rank = int(next(e.split("=")[1] for e in env if e.startswith("OMPI_COMM_WORLD_RANK=")))
                    hwm = re.search(r"VmHWM:\s+(\d+) kB", open(f"/proc/{pid}/status").read())
                    peaks[rank] = int(hwm.group(1)) * 1024
                except (OSError, StopIteration, AttributeError, ValueError):
                    pass
            run.terminate()
            run.wait()
            for r in range(a.stages):
                act, tot = rows.get(r, (0, 0))
                print(f"{sched:9s} {r:4d} {tot / 1e6:11.0f} {act / 1e6:10.0f} {peaks.get(r, 0) / 1e6:9.0f}")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
