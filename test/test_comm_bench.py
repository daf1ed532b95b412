#!/usr/bin/env python3
"""test_comm_bench.py — the communication benchmark (dev/comm/comm_bench.h) measures what it says.

1. ./comm_bench (MPI, llmc/parallel/comm.h) alone and under mpirun with 2 and 4 ranks, at small sizes and a few
   iterations: every operation and every size has a row, every result's check passed on every rank,
   the sizes double from --min-bytes to --max-bytes, and the printed numbers obey nccl-tests'
   definitions: algbw = size / time and busbw / algbw = 2(N-1)/N (all-reduce), (N-1)/N
   (reduce-scatter, all-gather, all-to-all), 1 (broadcast, send-recv), to the printed rounding.
2. The check can fail: LLMC_COMM_BENCH_PLANT_BUG=1 makes one rank change one element of every
   result before the check; every row must then say FAIL and the program exit 1.
3. Bad flags: one line, exit 2 (alone and under mpirun, where only rank 0 speaks).
4. The GPU build on the CUDA emulation (build/emu/comm_bench_gpu: comm_nccl.cuh over the NCCL
   stand-in with 2 and 3 ranks, and the host-staged path with 2 ranks on one GPU), correctness only.
"""
import os, shutil, subprocess, sys
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = os.path.join(ROOT, "comm_bench")
EMU = os.path.join(ROOT, "build", "emu", "comm_bench_gpu")
OPS = ["all-reduce", "reduce-scatter", "all-gather", "all-to-all", "broadcast", "send-recv"]
SMALL = ["--min-bytes", "1K", "--max-bytes", "64K", "--iters", "3", "--warmup", "1"]


def factor(op, n):
    return {"all-reduce": 2 * (n - 1) / n, "reduce-scatter": (n - 1) / n, "all-gather": (n - 1) / n,
            "all-to-all": (n - 1) / n}.get(op, 1.0)


def run(exe, ranks, args, env=None, guard=120):
    extra = dict(env or {})
    cmd = [exe, *args]
    if ranks:
        forward = [a for k in extra for a in ("-x", k)]
        cmd = ["mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", *forward, "-np", str(ranks), *cmd]
    p = subprocess.run(["timeout", str(guard), *cmd], cwd=ROOT, capture_output=True, text=True,
                       env=dict(os.environ, **extra))
    return p.returncode, p.stdout, p.stderr


def rows(out):
    """The table's rows: (size, count, type, op, time_us, algbw, busbw, check)."""
    table = []
    for line in out.splitlines():
        f = line.split(None, 7)  # the check may be "FAIL(3 wrong)"
        if line.startswith("#") or len(f) != 8 or f[2] != "float":
            continue
        table.append((int(f[0]), int(f[1]), f[2], f[3], float(f[4]), float(f[5]), float(f[6]), f[7]))
    return table


def arithmetic_problem(row, n):
    """'' if the row's numbers obey the definitions to the printed rounding (time to 0.01 us, bandwidths
    to 4 significant digits: a relative error of at most 5e-4 each)."""
    size, count, _, op, t, algbw, busbw, _ = row
    if count * 4 != size:
        return f"count {count} is not size {size} / 4"
    f = factor(op, n)
    if algbw <= 0 or abs(busbw - f * algbw) > 5e-4 * (busbw + f * algbw) + 1e-12:
        return f"busbw {busbw} is not {f:.4f} * algbw {algbw}"
    low = size / ((t + 0.005) * 1e3) * (1 - 5e-4)
    high = size / ((t - 0.005) * 1e3) * (1 + 5e-4) if t > 0.005 else float("inf")
    if not low <= algbw <= high:
        return f"algbw {algbw} GB/s is not size {size} B / time {t} us"
    return ""


def check_cpu(n):
    label = f"comm_bench, {n} ranks (MPI)" if n > 1 else "comm_bench, 1 rank (no mpirun)"
    code, out, err = run(CPU, n if n > 1 else 0, SMALL)
    table = rows(out)
    sizes = [1024 << k for k in range(7)]
    want = [(op, s) for op in OPS for s in sizes]
    report(code == 0 and [(r[3], r[0]) for r in table] == want,
           f"{label}: exits 0 with a row for each of the 6 operations at each size, 1 KiB to 64 KiB",
           f"exit code {code}, rows {[(r[3], r[0]) for r in table]}\n{out[-1500:]}{err[-1500:]}")
    bad = [r for r in table if r[7] != "ok"]
    report(table and not bad and "PASS: 42 results checked" in out,
           f"{label}: every result checked correct on every rank", f"{bad[:3]}\n{out[-800:]}")
    problems = [f"{r[3]} {r[0]} B: {arithmetic_problem(r, n)}" for r in table if arithmetic_problem(r, n)]
    ratios = sorted({f"{op} {factor(op, n):.3g}" for op in OPS})
    report(table and not problems, f"{label}: algbw = size / time, busbw / algbw = nccl-tests' factor per operation",
           "; ".join(problems[:4]), measured=", ".join(ratios))
    if table and n == 4:  # the arithmetic check can fail: an all-reduce row with busbw = algbw (factor 1, not 1.5)
        r = next(r for r in table if r[3] == "all-reduce")
        planted = arithmetic_problem(r[:6] + (r[5], r[7]), n)
        report(planted != "", "negative control: a row whose busbw used the wrong factor is caught", "not caught",
               measured=planted)


def check_planted_bug():
    code, out, err = run(CPU, 2, ["--max-bytes", "2K", "--iters", "1", "--warmup", "0"],
                         env={"LLMC_COMM_BENCH_PLANT_BUG": "1"})
    table = rows(out)
    failing = [r for r in table if r[7] == "FAIL(1 wrong)"]
    report(code != 0 and len(table) == 12 and len(failing) == 12 and "FAIL: 12 of 12 results had wrong elements" in out,
           "negative control: one wrong element on one rank fails its row, and the run exits non-zero",
           f"exit code {code}, {len(failing)} failing rows\n{out[-1500:]}", measured=f"{len(failing)} of 12 rows failed")


BAD_FLAGS = [["--iters", "0"], ["--warmup", "-1"], ["--min-bytes", "0"], ["--min-bytes", "6"], ["--max-bytes", "1X"],
             ["--min-bytes", "2M", "--max-bytes", "1M"], ["--ops", "all-reduce,gossip"], ["--frobnicate", "1"],
             ["--iters"]]


def check_bad_flags():
    for args in BAD_FLAGS:
        code, out, err = run(CPU, 0, args)
        lines = err.strip().splitlines()
        report(code == 2 and len(lines) == 1 and lines[0].startswith("error: ") and not out,
               f"bad flags {' '.join(args)}: one line, exit 2", f"exit code {code}, stderr {err!r}, stdout {out[:200]!r}")
    code, out, err = run(CPU, 2, ["--ops", "gossip"])
    ours = [line for line in err.splitlines() if line.startswith("error: ")]
    report(code == 2 and len(ours) == 1, "bad flags under mpirun -np 2: one line (rank 0's), exit 2",
           f"exit code {code}, stderr {err[-600:]!r}")


def check_emulated():
    if not os.path.exists(EMU):
        print(f"SKIP: comm_bench_gpu on the CUDA emulation ({EMU} is not built: it needs CUDA's headers and MPI)")
        return
    # 3 ranks: sizes that do not split evenly (1 KiB = 256 floats: 255 of them in 3 shards)
    for devices, ranks, label in (("4", 2, "NCCL stand-in"), ("4", 3, "NCCL stand-in"), ("1", 2, "host-staged, one GPU shared")):
        code, out, err = run(EMU, ranks, ["--min-bytes", "1K", "--max-bytes", "8K", "--iters", "1", "--warmup", "0"],
                             env={"CUDA_EMU_DEVICES": devices})
        table = rows(out)
        first = out.splitlines()[0] if out else ""
        transport = ("host-staged" if devices == "1" else "NCCL") in first
        problems = [f"{r[3]} {r[0]} B: {arithmetic_problem(r, ranks)}" for r in table if arithmetic_problem(r, ranks)]
        report(code == 0 and len(table) == 24 and all(r[7] == "ok" for r in table) and transport and not problems,
               f"comm_bench_gpu (emulated, {ranks} ranks, {label}): all 6 operations at 4 sizes checked correct",
               f"exit code {code}, {len(table)} rows, {problems[:2]}\n{out[-1500:]}{err[-1500:]}")


def main():
    if not shutil.which("mpirun"):
        print("SKIP: comm_bench (mpirun is not installed: apt-get install openmpi-bin libopenmpi-dev)")
        return 0
    if not os.path.exists(CPU):
        report(False, "comm_bench is built", f"{CPU} is missing: run make")
        return exit_code()
    check_cpu(1)
    check_cpu(2)
    check_cpu(4)
    check_planted_bug()
    check_bad_flags()
    check_emulated()
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
