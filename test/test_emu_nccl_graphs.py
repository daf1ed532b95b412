#!/usr/bin/env python3
"""test_emu_nccl_graphs.py — NCCL operations captured into a CUDA graph, under the CUDA emulation.

Real NCCL (>= 2.9) lets a collective or a group of sends and receives be captured into a CUDA graph
and replayed (the NCCL user guide, "Using NCCL with CUDA Graphs"); the emulation's NCCL stand-in
(test/emu/nccl_standin.cpp, "CUDA graphs") records such a launch as one kernel node and runs it over
MPI at every replay. build/emu/nccl_capture_check (test/emu/nccl_capture_check.cu) checks it on 2
ranks, against closed forms (small integers: every sum exact):

  check   a captured all-reduce and a captured group of sends and receives are recorded, not run;
          three replays give the exact sums with each replay's multiplier (read from device memory),
          the ring gives every rank its neighbour's sums; an eager all-reduce between replays keeps
          its place; a group left open across cudaStreamEndCapture and a group mixing eager and
          captured operations are refused (ncclInvalidUsage, one line each), the communicator intact.
Negative controls, each a bug the checks must catch (the program's own checks must FAIL):
  stale   the all-reduce captured with a stale buffer pointer: the sums are wrong;
  skip    rank 1's graph lacks the all-reduce (a replay skipping the NCCL node): rank 0's replay
          waits for it, and the stand-in reports the stall within its deadline (2 s here), no hang.
Cost: three 2-rank runs of a 256-element program, about 7 s in all on 2 shared cores (most of it
the skip control's deadline).
"""
import os, shutil, subprocess, sys
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROGRAM = os.path.join(ROOT, "build", "emu", "nccl_capture_check")


def run(mode):
    cmd = ["timeout", "60", "mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2", PROGRAM, mode]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, LLMC_EMU_NCCL_TIMEOUT="2"))
    lines = [line for line in p.stdout.splitlines() if line.startswith(("PASS:", "FAIL:"))]
    return p.returncode, lines, p.stdout + p.stderr


def main():
    if not shutil.which("mpirun"):
        print("SKIP: NCCL under stream capture: no mpirun")
        sys.exit(0)
    if not os.path.exists(PROGRAM):
        print("SKIP: NCCL under stream capture: build/emu/nccl_capture_check is not built (make emu)")
        sys.exit(0)
    code, lines, out = run("check")
    for line in lines:
        report(line.startswith("PASS:"), "nccl capture: " + line.split(": ", 1)[1], line)
    report(code == 0 and len(lines) == 10, "nccl capture: all 10 checks ran on 2 ranks and the program exited 0",
           f"exit {code}, {len(lines)} checks: {out[-800:]}")

    code, lines, out = run("stale")
    failed = [line for line in lines if line.startswith("FAIL:")]
    report(code != 0 and any("3 replays: y =" in line for line in failed),
           "negative control: an all-reduce captured with a stale buffer pointer fails the sums' check",
           f"exit {code}: {lines}")

    code, lines, out = run("skip")
    report(code != 0 and code != 124 and "did not complete within 2 s" in out and any(line.startswith("FAIL:") for line in lines),
           "negative control: a graph without the all-reduce on one rank is reported as a stall, not a hang",
           f"exit {code}: {out[-800:]}")
    sys.exit(exit_code())


if __name__ == "__main__":
    main()
