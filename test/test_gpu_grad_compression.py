#!/usr/bin/env python3
"""test_gpu_grad_compression.py — --grad-compression powersgd on the GPU trainer (llmc/parallel/grad_compression.cuh).

Runs on a real GPU, or on the CPU emulation of CUDA (test/emu/) with a GPU per rank, so that the
ranks talk through NCCL (its stand-in over MPI) as on a machine with two GPUs. The model and data are
test_grad_compression.py's (L=2 C=64 H=4 T=64 V=501, 64 tokens per step: one micro-batch of 32 per
rank), 4 steps, 2 ranks, r = 2. Five GPU runs in all (~25 s emulated on 2 shared cores), two CPU ones.

1. The GPU's sums against the fp64 simulation of 2 workers (test_grad_compression.py's, from the
   paper's equations): each rank dumps its bf16 gradient G_i and the sum S it applied, every step;
   the simulation takes only the G_i and must reproduce S within 5e-3 of max |S| at every step, the
   same bits on both ranks. The GPU rounds S to bf16 once: half an ulp of 8 significant bits, at most
   2^-8 = 3.9e-3 of an element and so of max |S|; everything before is fp32 (measured 2.3e-3, all of
   it that rounding, worst on the exactly summed biases). Without the error feedback the steps after
   the first differ by what the previous steps left out: the planted bug (powersgd_error_feedback_kernel
   writing M = G, e dropped) failed this check at 2.2e-1 (and check 2 at 4.1e-3).
2. 2 GPU ranks == 2 CPU ranks (the CPU trainer's PowerSGD, fp32) over the same 4 steps: losses within
   2e-3 (the GPU's bf16 forward and backward against fp32: the exact sums differ by ~7e-4 here too).
   A negative control: the CPU trainer's EXACT sum is farther than 10x that from the GPU's PowerSGD.
3. r = min(n, m) = 64 for every matrix (LLMC_TEST_POWERSGD_EVERY_MATRIX=1) == the exact sum: the
   GPU run's losses within the same 2e-3 of the CPU trainer's exact run.
4. A checkpoint at step 2 resumed to step 4 == the straight run, bit for bit (losses, weights): e and
   Q are downloaded into the CPU trainer's file format and uploaded back; the start step is checked
   across it (--powersgd-start-step 1 here: step 1 is the exact bf16 sum, then PowerSGD). Planted:
   e not uploaded on resume (left at zero), caught.
   The same run's counters (the data group's bytes, llmc/parallel/comm_nccl.cuh): step 1, the exact sum
   in bf16, half the CPU trainer's fp32 exact sum; step 4, PowerSGD, the CPU trainer's PowerSGD bytes
   (the same two fp32 identical all-reduces): 267.5 KiB -> 28.5 KiB at this toy shape.
5. Refusals of the GPU build: one rank, ZeRO-1, one line and exit 2.
"""
import os, re, shutil, subprocess, sys, tempfile
import numpy as np
from checks import report, exit_code

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_gpu import CPU, DEFAULT_ATTENTION, EMULATED, GPU, MODE, read_safetensors  # noqa: E402
from test_grad_compression import MODEL, compression_bytes, replay  # noqa: E402
from test_parallelism import write_pattern_shard  # noqa: E402
from test_bad_inputs import one_line_error  # noqa: E402

STEPS, R = 4, 2
TOL_SIM, TOL_LOSS = 5e-3, 2e-3
CHECKS = ["the GPU's PowerSGD sums == the fp64 simulation", "2 GPU ranks == 2 CPU ranks, PowerSGD",
          "r = min(n, m) == the exact sum", "PowerSGD resume is bit-exact", "bytes on the wire", "refusals"]


def run(work, exe, ranks, *flags, steps=STEPS, env=None):
    """mpirun of either trainer on the shared data; GPU ranks each on an emulated GPU of their own (NCCL)."""
    gpu = exe != CPU
    cmd = ["timeout", "300", shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
           "-np", str(ranks), exe, "--model", MODEL, "--train-data", os.path.join(work, "train_*.bin"), "--val-data", "none",
           "--sample-every", "0", "--seq-len", "32", "--batch-size", "1", "--total-batch-tokens", "64", "--lr", "1e-3",
           "--steps", str(steps), "--out-dir", os.path.join(work, "out")]
    cmd += (DEFAULT_ATTENTION if gpu else ["--threads", "1"]) + [str(f) for f in flags]
    env = dict(os.environ, **(env or {}), **({"CUDA_EMU_DEVICES": "4"} if gpu and EMULATED else {}))
    p = subprocess.run(cmd, cwd=work, capture_output=True, text=True, env=env)
    return p.returncode, p.stdout, p.stderr


def dump(work, name, exe, *flags, env=None):
    path = os.path.join(work, name + ".st")
    code, out, err = run(work, exe, 2, *flags, "--dump-state", path, env=env)
    if code != 0:
        raise RuntimeError(f"{name}: exit {code}:\n{out[-1000:]}\n{err[-1500:]}")
    return read_safetensors(path)[0], out


def main():
    if MODE is None or not shutil.which("mpirun") or not os.path.exists(CPU):
        for name in CHECKS:
            print(f"SKIP: {name} ({GPU if MODE is None else 'needs mpirun and train_gpt_cpu'})")
        return exit_code()
    work = tempfile.mkdtemp(prefix="llmc_gpu_gc_")
    try:
        write_pattern_shard(work)
        psgd = ["--grad-compression", "powersgd", "--powersgd-rank", str(R)]

        # ---- 1. the sums against the simulation (start step 0: every step compressed, every step dumped)
        dumps = os.path.join(work, "dumps")
        os.makedirs(dumps)
        gpu, _ = dump(work, "gpu_psgd", GPU, *psgd, env={"LLMC_TEST_COMPRESSION_DUMP": dumps})
        replay("2 GPU ranks, r = 2", dumps, 2, STEPS, R, 0, tol=TOL_SIM)

        # ---- 2. against the CPU trainer's PowerSGD; the negative control, its exact sum
        cpu, cpu_out = dump(work, "cpu_psgd", CPU, *psgd)
        exact, exact_out = dump(work, "cpu_exact", CPU)
        worst = float(np.max(np.abs(gpu["losses"].astype(np.float64) - cpu["losses"])))
        control = float(np.max(np.abs(gpu["losses"].astype(np.float64) - exact["losses"])))
        report(worst <= TOL_LOSS, f"2 GPU ranks == 2 CPU ranks, PowerSGD r = 2 over {STEPS} steps (losses within {worst:.1e})",
               f"beyond {TOL_LOSS}: GPU {gpu['losses']}, CPU {cpu['losses']}")
        report(control > 10 * TOL_LOSS, f"negative control: the exact sum's losses are {control:.1e} away",
               f"the tolerance cannot tell PowerSGD r = 2 from the exact sum ({control:.1e})")

        # ---- 3. full rank == the exact sum
        full, _ = dump(work, "gpu_full", GPU, "--grad-compression", "powersgd", "--powersgd-rank", 64,
                       env={"LLMC_TEST_POWERSGD_EVERY_MATRIX": "1"})
        worst = float(np.max(np.abs(full["losses"].astype(np.float64) - exact["losses"])))
        report(worst <= TOL_LOSS, f"GPU PowerSGD at r = min(n, m) = 64 == the CPU trainer's exact sum (losses within {worst:.1e})",
               f"beyond {TOL_LOSS}: {full['losses']} against {exact['losses']}")

        # ---- 4. resume, across the start step
        start = psgd + ["--powersgd-start-step", "1"]
        straight, out = dump(work, "straight", GPU, *start, "--checkpoint-every", 2)
        traffic = re.search(r"traffic from rank 0 \(its counters\): step 1 ([\d.]+ \w+), step 4 ([\d.]+ \w+)", out)
        cpu_psgd_bytes, cpu_exact_bytes = compression_bytes(cpu_out)[0], compression_bytes(exact_out)[0]
        kib = lambda t: float(t.split()[0]) * {"B": 1 / 1024, "KiB": 1, "MiB": 1024}[t.split()[1]]  # noqa: E731
        report(traffic is not None and cpu_exact_bytes and abs(kib(traffic.group(1)) - kib(cpu_exact_bytes) / 2) <= 0.1 and
               traffic.group(2) == cpu_psgd_bytes,
               f"the GPU's counters: step 1 (exact, bf16) {traffic.group(1) if traffic else None} = half the CPU's fp32 "
               f"{cpu_exact_bytes}; step 4 (PowerSGD r = 2) {traffic.group(2) if traffic else None} = the CPU's {cpu_psgd_bytes}",
               out[-800:])
        ckpt = os.path.join(work, "out", "ckpt_00000002")
        files = sorted(f for f in os.listdir(ckpt) if f.startswith("grad_compression")) if os.path.isdir(ckpt) else []
        resumed, out = dump(work, "resumed", GPU, *start, "--resume", ckpt)
        report(files == ["grad_compression_rank0.bin", "grad_compression_rank1.bin"] and "resumed from" in out and
               np.array_equal(resumed["params"], straight["params"]) and
               np.array_equal(resumed["losses"], straight["losses"][2:]),
               "GPU PowerSGD: 2 steps + checkpoint (each rank's e and Q) + resume + 2 steps == 4 straight, bit for bit",
               f"files {files}; {out[-600:]}")

        # ---- 5. refusals (before any GPU is touched)
        base = ["--model", MODEL, "--train-data", os.path.join(work, "train_*.bin"), "--val-data", "none", "--seq-len", "32"]
        one_line_error("the GPU trainer: --grad-compression powersgd on one rank", base + psgd, 2,
                       "needs 2 or more data-parallel ranks", binary=GPU)
        code, out, err = run(work, GPU, 2, *psgd, "--zero", 1, steps=1)
        report(code == 2 and err.count("error:") == 1 and "ZeRO-1/2/3 reduce-scatter" in err,
               "the GPU trainer: powersgd with --zero 1 on 2 ranks -> one line, exit 2", f"exit {code}: {err[-500:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
