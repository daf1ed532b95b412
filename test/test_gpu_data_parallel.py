#!/usr/bin/env python3
"""test_gpu_data_parallel.py — the GPU trainer on several ranks (mpirun), checked against one rank.

A machine with one GPU cannot run NCCL with two ranks (NCCL refuses two ranks on one device), so
ranks that share the GPU exchange gradients through host memory and MPI (llmc/parallel/comm_nccl.cuh, "host
staging"): the same buckets, the same reduce-to-owners and all-gathers, the same step. What this
proves on one GPU is the trainer's data-parallel logic; NCCL's own sums are checked by
build/gpu_comm_check (make gpu-check).

Without a GPU every GPU check prints SKIP; the checks that need none (the build links MPI and NCCL;
ranks without a GPU all stop with a message) run everywhere. With one:

  ranks vs one     2 ranks x B=2 vs 1 rank x 2 accumulation steps; 4 ranks x B=1 vs 1 x 4; and a
                   negative control (one rank, half the batch) that the tolerances must reject
  ZeRO-1 == ZeRO-0 3 ranks (the tiny model does not split evenly: padding), bit for bit
  resume           2 ranks, ZeRO-1: 5 steps + resume + 5 == 10 straight, bit for bit; the same
                   checkpoint resharded to 1 rank, and continued by the CPU trainer
  failures         a rank that hangs, exits or fails at step 3: every rank stops, with a message,
                   within the --comm-timeout
  launcher         scripts/run_mpi_local.sh 2 with TRAINER=./train_gpt
  cuda graphs      (emulated NCCL) --cuda-graphs on the 2 NCCL ranks, ZeRO-0 and ZeRO-1: steps 2-10 replay
                   graphs holding the captured NCCL sums and all-gathers (llmc/run/cuda_graphs.cuh), the
                   learning rate changing at every step; losses, step-1 gradient, final weights and every
                   step's printed loss and norm (read by the host after the replay) == the eager run's, bit
                   for bit (the same collectives in the same order: the same bits)

Without a GPU these checks run on the CPU emulation of CUDA (test/emu/, see test_gpu.py): each rank
a process with its own emulated GPU, the simple attention instead of cuDNN's. The emulation also
runs the NCCL path, which a one-GPU machine cannot: with CUDA_EMU_DEVICES=4 every rank has a GPU of
its own and the ranks talk through NCCL (the stand-in over MPI, test/emu/nccl_standin.cpp). The
second run of each bit-for-bit comparison (ZeRO-1, the resumed run) takes its threads and blocks
in another order (reverse, or random), so a race between threads would show as a difference.

Tolerances (N ranks vs one rank, both bf16). Every micro-batch's forward and backward are the same
kernels on the same tokens, so they are bit-identical; only the SUM differs. One rank adds micro-
batch k's gradient into its bf16 gradient buffer inside each kernel, rounding to bf16 after every
micro-batch; N host-staged ranks each round their own micro-batch's gradient to bf16, and the sum
(in fp32) is rounded once. Elements differ by about one bf16 ulp (2^-8 relative) where the two
rounding sequences part ways. Simulating both sequences on the CPU reference's gradients of this very
model (fp32 gradients of each micro-batch, rounded as each path rounds them) gives:
    step-1 gradient, relative L2      2.5e-3 (2 ranks), 3.4e-3 (4 ranks); max 6e-3 of the largest
    step-1 AdamW update, relative L2  2.7e-2, 4.2e-2: AdamW's first step is lr * sign(g), and the
                                      0.08% of elements whose gradient is within an ulp of zero
                                      can flip sign, each moving by 2 lr
    negative control (half the batch) 0.98 (gradient), 0.97 (update)
  so we require:
    step-1 gradient    relative L2 <= 1e-2 and cosine >= 0.9999     (control: >= 0.1)
    weight change      ||dW_N - dW_1|| / ||dW_1|| <= 0.10 after 10 steps (each step flips a few
                       more signs; the control moves ~100%: >= 0.3)
    losses             |loss_N - loss_1| <= 0.01 per step (~0.2% of the loss: the loss averages
                       the tiny weight differences over every token)
ZeRO-1 vs ZeRO-0 and resume are exact by design (same sums, per-element AdamW with stochastic
rounding seeded by (seed, step, index)), so they are compared bit for bit.
"""
import os, shutil, subprocess, sys, tempfile, time
from checks import report, exit_code
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_gpu import (DEFAULT_ATTENTION, EMULATED, GPU, MODE, NATIVE_GPU, RANDOM, REVERSED, cosine,  # noqa: E402
                      read_safetensors, rel, write_model, write_shard)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = os.path.join(ROOT, "train_gpt_cpu")
T, V = 64, 512
STEPS, LR = 10, 1e-3
TOL_GRAD, TOL_COS, TOL_UPDATE, TOL_LOSS = 1e-2, 0.9999, 0.10, 0.01
CONTROL_GRAD, CONTROL_UPDATE = 0.1, 0.3
CHECKS = ["2 ranks == 1 rank x 2 accumulation steps", "4 ranks == 1 rank x 4 accumulation steps",
          "negative control", "ZeRO-1 == ZeRO-0 bit for bit (3 ranks)", "resume with 2 ranks is bit-exact",
          "reshard 2 ranks -> 1", "the CPU trainer resumes a 2-rank GPU checkpoint",
          "rank 1 hangs at step 3: all ranks stop", "rank 1 exits at step 3: all ranks stop",
          "rank 1 errors at step 3: all ranks stop",
          "scripts/run_mpi_local.sh runs train_gpt"]
NCCL_CHECKS = ["2 ranks over NCCL == 1 rank x 2 accumulation steps", "ZeRO-1 over NCCL == ZeRO-0 bit for bit (3 ranks)",
               "--cuda-graphs over 2 NCCL ranks == eager bit for bit (ZeRO-0)",
               "--cuda-graphs over 2 NCCL ranks == eager bit for bit (ZeRO-1)"]
EMULATED_NCCL = {"CUDA_EMU_DEVICES": "4"}  # a GPU per rank: the NCCL path instead of host staging


class Runner:
    def __init__(self, work):
        self.work = work
        self.mpirun = shutil.which("mpirun")
        self.data = ["--train-data", os.path.join(work, "train_*.bin"), "--val-data", "none", "--sample-every", "0",
                     "--seq-len", str(T)]
        self.schedule = ["--steps", str(STEPS), "--lr", str(LR), "--warmup-steps", "2"]

    def run(self, ranks, *flags, exe=GPU, env=None, guard=300):
        """mpirun even for one rank, so that both paths are the real ones."""
        own = DEFAULT_ATTENTION if exe == GPU else []
        cmd = ["timeout", str(guard), self.mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-np", str(ranks), exe, "--model", os.path.join(self.work, "tiny.bin")] + self.data + self.schedule + \
              ["--out-dir", os.path.join(self.work, "out")] + own + [str(f) for f in flags]
        start = time.time()
        p = subprocess.run(cmd, cwd=self.work, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
        return p.returncode, p.stdout, p.stderr, time.time() - start

    def dump(self, name, ranks, *flags, exe=GPU, env=None):
        path = os.path.join(self.work, name + ".st")
        code, out, err, _ = self.run(ranks, *flags, "--dump-state", path, exe=exe, env=env)
        if code != 0:
            raise RuntimeError(f"{name}: the trainer exited with {code}:\n{out[-1500:]}\n{err[-2000:]}")
        return read_safetensors(path)[0], out


def differences(a, b, init):
    """(step-1 gradient rel L2, its cosine, weight-change rel L2, max loss difference) of a against b."""
    return (rel(a["grads"], b["grads"]), cosine(a["grads"], b["grads"]),
            rel(a["params"] - init, b["params"] - init), float(np.max(np.abs(a["losses"] - b["losses"]))))


def check_close(name, a, b, init):
    grad, cos, update, loss = differences(a, b, init)
    ok = grad <= TOL_GRAD and cos >= TOL_COS and update <= TOL_UPDATE and loss <= TOL_LOSS
    report(ok, f"{name} (step-1 grads rel {grad:.1e} cos {cos:.6f}, weight change rel {update:.1e}, losses {loss:.1e})",
           f"beyond tolerance (grads {TOL_GRAD}, cosine {TOL_COS}, weight change {TOL_UPDATE}, losses {TOL_LOSS})")


def checks_without_gpu():
    """Checks of the nvcc build; returns whether it (or the emulated one) can run several ranks."""
    if not os.path.exists(NATIVE_GPU):
        print("SKIP: train_gpt links MPI and NCCL (train_gpt is not built: no nvcc or no NCCL)")
        return EMULATED and shutil.which("mpirun") is not None
    libs = subprocess.run(["ldd", NATIVE_GPU], capture_output=True, text=True).stdout
    if not shutil.which("mpicxx"):
        print("SKIP: train_gpt is built with MPI (mpicxx is not installed: apt-get install libopenmpi-dev)")
        return False
    report("libmpi" in libs and "libnccl" in libs, "train_gpt is built with MPI and NCCL (make found mpicxx)",
           "ldd shows " + " ".join(l.split()[0] for l in libs.splitlines() if "mpi" in l or "nccl" in l))
    return "libmpi" in libs and shutil.which("mpirun") is not None


def main():
    multi = checks_without_gpu()
    if MODE != "gpu" and multi and os.path.exists(NATIVE_GPU):
        # every rank must stop, with the reason, instead of waiting for the others
        start = time.time()
        p = subprocess.run(["timeout", "60", "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", "2", NATIVE_GPU,
                            "--model", "L=2,C=64,H=4,T=64"], capture_output=True, text=True)
        seconds = time.time() - start
        report(p.returncode not in (0, 124) and p.stderr.count("no CUDA GPU") >= 2 and seconds < 30,
               f"2 ranks without a GPU: both stop with the reason ({seconds:.1f} s)",
               f"exit {p.returncode} after {seconds:.1f} s: {p.stderr[-500:]}")
    if MODE is None:
        for name in CHECKS:
            print(f"SKIP: {name} ({GPU})")
        return exit_code()
    if not multi:
        for name in CHECKS:
            print(f"SKIP: {name} (train_gpt without MPI, or no mpirun)")
        return exit_code()
    for exe in (GPU, CPU):
        if not os.path.exists(exe):
            report(False, "binaries", f"{exe} is missing: run make")
            return 1

    work = tempfile.mkdtemp(prefix="llmc_gpu_dp_")
    try:
        rng = np.random.default_rng(0)
        base = rng.integers(0, V, 997)  # a repeating random sequence: a language the model can learn
        write_shard(os.path.join(work, "train_000000.bin"), np.tile(base, 60))
        init, _, _ = write_model(os.path.join(work, "tiny.bin"), 2, 128, 2, T, V, 1)  # 470,528 parameters
        r = Runner(work)

        # (a) 2 ranks x B=2 against 1 rank x 2 accumulation steps of B=2: 256 tokens per step each
        one_a, _ = r.dump("one_accum2", 1, "--batch-size", 2, "--total-batch-tokens", 256)
        two, out = r.dump("two_ranks", 2, "--batch-size", 2)
        report("2 ranks" in out and "host-staged" in out and "1 accumulation step" in out,
               "the 2-rank run on one GPU reports 2 host-staged ranks, no accumulation", out[:600])
        check_close("2 ranks == 1 rank x 2 accumulation steps", two, one_a, init)
        half, _ = r.dump("one_half", 1, "--batch-size", 2)
        grad, _, update, _ = differences(half, one_a, init)
        report(grad >= CONTROL_GRAD and update >= CONTROL_UPDATE,
               f"negative control: half the batch differs far beyond tolerance (grads {grad:.1e}, weight change {update:.1e})",
               "the tolerances cannot tell a missing rank from rounding")

        # (b) 4 ranks x B=1 against 1 rank x 4 accumulation steps of B=1
        one_b, _ = r.dump("one_accum4", 1, "--batch-size", 1, "--total-batch-tokens", 256)
        four, _ = r.dump("four_ranks", 4, "--batch-size", 1)
        check_close("4 ranks == 1 rank x 4 accumulation steps", four, one_b, init)

        # (c) ZeRO-1 against ZeRO-0 on 3 ranks: 470,528 = 3 x 156,842.67, padded to 470,592 = 3 x 156,864
        z0, _ = r.dump("three_zero0", 3, "--batch-size", 1)
        # emulated: the runs compared bit for bit take other schedules, so a race between threads shows up
        z1, out = r.dump("three_zero1", 3, "--batch-size", 1, "--zero", 1, env=REVERSED if EMULATED else None)
        report("ZeRO-1" in out and "shards of 156864, padded total 470592" in out,
               "ZeRO-1 on 3 ranks pads 470,528 parameters to 470,592 = 3 x 156,864", out[:800])
        differ = [k for k in ("losses", "grads", "params") if not np.array_equal(z1[k], z0[k])]
        report(not differ, "ZeRO-1 == ZeRO-0 bit for bit (3 ranks: losses, step-1 gradient, final weights)",
               "not bit-identical: " + ", ".join(differ))
        one_c, _ = r.dump("one_accum3", 1, "--batch-size", 1, "--total-batch-tokens", 192)
        check_close("3 ranks ZeRO-1 == 1 rank x 3 accumulation steps", z1, one_c, init)

        # (d) resume: 2 ranks, ZeRO-1, 10 steps with checkpoints at 5 and 10, then again from step 5
        straight, _ = r.dump("straight", 2, "--batch-size", 2, "--zero", 1, "--checkpoint-every", 5)
        ckpt = os.path.join(work, "out", "ckpt_00000005")
        files = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
        report(files == ["checksums.txt", "model.bin", "state_rank0.bin", "state_rank1.bin"],
               "a 2-rank ZeRO-1 checkpoint holds model.bin and one state file per rank", str(files))
        size = os.path.getsize(os.path.join(ckpt, "state_rank1.bin")) if files else 0
        report(size == 1024 + 3 * 4 * 235264, "each rank's state file holds m, v AND the fp32 master weights of its "
               "shard (1024 + 3 x 4 x 235,264 bytes)", f"{size} bytes")
        resumed, out = r.dump("resumed", 2, "--batch-size", 2, "--zero", 1, "--resume", ckpt,
                              env=RANDOM if EMULATED else None)
        report("resumed from" in out and "resharded" not in out, "resume with the same ranks reads each rank's own shard",
               out[-600:])
        report(np.array_equal(resumed["params"], straight["params"]) and
               np.array_equal(resumed["losses"], straight["losses"][5:]),
               "resume with 2 ranks is bit-exact: 5 steps + resume + 5 steps == 10 straight (weights and losses)",
               f"losses {resumed['losses']} vs {straight['losses'][5:]}")

        # (e) the same checkpoint on 1 rank (2 accumulation steps: the same tokens per step), and by the CPU
        one_r, out = r.dump("resumed_one", 1, "--batch-size", 2, "--total-batch-tokens", 256, "--resume", ckpt)
        update = rel(one_r["params"] - init, straight["params"] - init)
        loss = float(np.max(np.abs(one_r["losses"] - straight["losses"][5:])))
        report("resharded: the checkpoint was written by 2 ranks with ZeRO-1, this run has 1 with ZeRO-0" in out and
               update <= TOL_UPDATE and loss <= TOL_LOSS,
               f"reshard 2 ranks -> 1: continues like the 2-rank run (weight change rel {update:.1e}, losses {loss:.1e})",
               out[-600:])
        code, out, err, _ = r.run(1, "--batch-size", 2, "--total-batch-tokens", 256, "--resume", ckpt, "--threads", "0",
                                  "--checkpoint-every", "0", exe=CPU)
        report(code == 0 and "step    10/10" in out, "the CPU trainer resumes a 2-rank GPU checkpoint (ZeRO-1 shards "
               "with master weights)", f"exit {code}: {err[-500:]}")

        # (f) failures: every rank must stop, non-zero, within the timeout (10 s) plus start-up, saying why
        for kind, expect in [("hang", "did not complete within 10 s"), ("exit", "LLMC_TEST_FAULT: exit"),
                             ("error", "stopping all ranks")]:
            code, _, err, seconds = r.run(2, "--batch-size", 2, "--comm-timeout", 10,
                                          env={"LLMC_TEST_FAULT": f"1:3:{kind}"}, guard=120)
            report(code not in (0, 124) and seconds < 60 and expect in err,
                   f"rank 1 {kind}s at step 3: all ranks stop with a message (exit {code}, {seconds:.1f} s)",
                   f"exit {code} after {seconds:.1f} s (124 = hung until the guard); stderr: {err[-600:]}")

        # (h) emulated: the same data parallelism over NCCL (a GPU per rank), which one real GPU cannot run
        if EMULATED:
            nccl_two, out = r.dump("nccl_two", 2, "--batch-size", 2, env=EMULATED_NCCL)
            report("2 ranks" in out and "host-staged" not in out, "with a GPU per rank the 2 ranks use NCCL, not host "
                   "staging", out[:600])
            check_close(NCCL_CHECKS[0], nccl_two, one_a, init)
            nz0, _ = r.dump("nccl_zero0", 3, "--batch-size", 1, env=EMULATED_NCCL)
            nz1, _ = r.dump("nccl_zero1", 3, "--batch-size", 1, "--zero", 1, env=dict(EMULATED_NCCL, **REVERSED))
            differ = [k for k in ("losses", "grads", "params") if not np.array_equal(nz1[k], nz0[k])]
            report(not differ, NCCL_CHECKS[1] + " (losses, step-1 gradient, final weights)",
                   "not bit-identical: " + ", ".join(differ))
            def step_columns(text):  # each step's loss, lr and norm as printed (the time columns differ)
                return [line.split(" ms")[0].rsplit("|", 1)[0] for line in text.splitlines() if line.startswith("step ")]
            for zero in (0, 1):
                graphed, g_out = r.dump(f"nccl_graphs_zero{zero}", 2, "--batch-size", 2, "--zero", zero, "--cuda-graphs",
                                        env=EMULATED_NCCL)
                differ = [k for k in ("losses", "grads", "params") if not np.array_equal(graphed[k], nccl_two[k])]
                if step_columns(g_out) != step_columns(out) or len(step_columns(out)) != STEPS:
                    differ.append("the printed losses and norms")
                # the replayed steps (3-10) each at a learning rate of their own
                lrs = {line.split("| lr ")[1].split()[0] for line in g_out.splitlines()
                       if line.startswith("step ") and int(line.split()[1].split("/")[0]) >= 3}
                if "step 2 captured the passes" not in g_out or len(lrs) != STEPS - 2:
                    differ.append(f"the capture at step 2 and a learning rate per replayed step ({len(lrs)})")
                report(not differ, NCCL_CHECKS[2 + zero] + " (losses, norms, step-1 gradient, final weights; 10 steps, "
                       "the learning rate changing at each replay)", "differ: " + ", ".join(differ) + "\n" + g_out[-1200:])

        # (g) the one-node launcher, with the GPU trainer
        p = subprocess.run(["timeout", "300", "bash", os.path.join(ROOT, "scripts", "run_mpi_local.sh"), "2", "--model",
                            os.path.join(work, "tiny.bin")] + r.data + ["--steps", "2", "--batch-size", "2"],
                           cwd=work, capture_output=True, text=True, env=dict(os.environ, TRAINER=GPU))
        report(p.returncode == 0 and p.stdout.startswith("+ mpirun") and "2 ranks" in p.stdout and "step     2/2" in p.stdout,
               "scripts/run_mpi_local.sh runs train_gpt on 2 ranks", f"exit {p.returncode}: {(p.stdout + p.stderr)[-500:]}")
    except RuntimeError as e:
        report(False, "gpu data-parallel run", str(e))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
