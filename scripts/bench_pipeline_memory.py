#!/usr/bin/python3
"""bench_pipeline_memory.py — each pipeline stage's memory under each schedule: --estimate's table
against the peak RSS each rank really reaches (docs/parallelism.md, ZB-H1's memory).

The CPU trainer zero-fills every row of its size table when it allocates (gpt2_allocate), so the
table is resident before the first forward and a step adds only per-call scratch. So a short look is
enough: each rank's VmHWM (peak RSS, /proc/PID/status) is read --seconds into the first step, then
the run is stopped. Prints, per schedule and rank, --estimate's total and activations and the
measured peak RSS, in MB (10^6 bytes).

With --steps N each run instead trains N steps to the end (the peaks polled every second until it
exits) and the median step time of steps 2..N (rank 0's metrics.jsonl) is printed beside each
schedule; --rounds R repeats every schedule R times, alternating, so each round's schedules share
the machine's load (issue 26 item 6: step time and peak memory per stage at d12 on 4 ranks).
A schedule name may carry its chunks: interleaved:2 runs --virtual-stages 2.

    python3 scripts/bench_pipeline_memory.py --model d12 --seq-len 1024 --batch-size 1 \\
        --micro-batches 8 --stages 4 --schedules 1f1b zb-h1 [--trainer OTHER_BINARY]
"""
import argparse, json, os, re, shutil, statistics, subprocess, sys, tempfile, time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from test_parallelism import write_pattern_shard  # noqa: E402  (tokens below 501: any vocabulary takes them)


def rank_peaks(mpirun_pid):
    """{rank: VmHWM bytes} of mpirun's children now (a rank that has exited is left out)."""
    peaks = {}
    for pid in subprocess.run(["pgrep", "-P", str(mpirun_pid)], capture_output=True, text=True).stdout.split():
        try:
            env = open(f"/proc/{pid}/environ", "rb").read().decode(errors="replace").split("\0")
            rank = int(next(e.split("=")[1] for e in env if e.startswith("OMPI_COMM_WORLD_RANK=")))
            hwm = re.search(r"VmHWM:\s+(\d+) kB", open(f"/proc/{pid}/status").read())
            peaks[rank] = int(hwm.group(1)) * 1024
        except (OSError, StopIteration, AttributeError, ValueError):
            pass
    return peaks


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
    ap.add_argument("--steps", type=int, default=0, help="train this many steps to the end and time them (0: stop at --seconds)")
    ap.add_argument("--rounds", type=int, default=1, help="with --steps: run every schedule this many times, alternating")
    a = ap.parse_args()
    work = tempfile.mkdtemp(prefix="llmc_pipemem_")
    try:
        write_pattern_shard(work)
        shape = ["--model", a.model, "--seq-len", str(a.seq_len), "--batch-size", str(a.batch_size),
                 "--total-batch-tokens", str(a.micro_batches * a.batch_size * a.seq_len), "--pipeline-parallel", str(a.stages)]
        print(f"# {a.trainer}; {' '.join(shape)}; "
              + (f"{a.steps} steps to the end, {a.rounds} round(s); " if a.steps else f"peaks read {a.seconds:.0f} s into the first step; ")
              + f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
        print(f"{'schedule':9s} {'rank':>4s} {'est. total':>11s} {'est. act.':>10s} {'peak RSS':>9s}   (MB)"
              + ("  step (ms)" if a.steps else ""))
        times = {}
        for rnd, sched in [(r, s) for r in range(a.rounds) for s in a.schedules]:
            name, _, chunks = sched.partition(":")
            flags = ["--pipeline-schedule", name] + (["--virtual-stages", chunks] if chunks else [])
            est = subprocess.run([a.trainer, *shape, *flags, "--estimate"], capture_output=True,
                                 text=True, cwd=work).stdout
            rows = {int(r): (int(act), int(tot)) for r, act, tot in
                    re.findall(r"^  rank (\d+): .*?activations=(\d+) .*?total=(\d+)", est, re.M)}
            out = os.path.join(work, "out")
            shutil.rmtree(out, ignore_errors=True)
            cmd = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", str(a.stages), a.trainer, *shape,
                   *flags, "--steps", str(max(a.steps, 1)), "--threads", "1", "--val-data", "none", "--checkpoint-every", "0",
                   "--train-data", os.path.join(work, "train_*.bin"), "--out-dir", out]
            run = subprocess.Popen(cmd, cwd=work, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            peaks = {}
            deadline = time.time() + a.seconds
            while run.poll() is None and (a.steps or time.time() < deadline):
                time.sleep(1.0)
                for rank, hwm in rank_peaks(run.pid).items():
                    peaks[rank] = max(peaks.get(rank, 0), hwm)
            if run.poll() is None:
                run.terminate()
            run.wait()
            step = ""
            if a.steps:
                ms = [json.loads(line)["ms"] for line in open(os.path.join(out, "metrics.jsonl"))
                      if '"type":"step"' in line][1:]
                times.setdefault(sched, []).append(statistics.median(ms))
                step = f" {statistics.median(ms):9.0f}   (round {rnd + 1}, load average {os.getloadavg()[0]:.1f})"
            for r in range(a.stages):
                act, tot = rows.get(r, (0, 0))
                print(f"{sched:9s} {r:4d} {tot / 1e6:11.0f} {act / 1e6:10.0f} {peaks.get(r, 0) / 1e6:9.0f}{step if r == 0 else ''}",
                      flush=True)
        for sched, ms in times.items():  # each round's median step, then the median over rounds
            print(f"{sched:12s} step {statistics.median(ms):8.0f} ms (rounds: {' '.join(f'{t:.0f}' for t in ms)})")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
