#!/usr/bin/env python3
"""test_data_parallel.py — the CPU trainer on several MPI ranks, checked against one rank.

Data parallelism must change who computes, not what is computed: N ranks with micro-batch B see
the same tokens per step as one rank accumulating N micro-batches, so losses, gradients and
weights must agree. ZeRO-1 must agree with ZeRO-0 bit for bit (same reduce-scatter, same per-element
AdamW). A checkpoint must resume bit-exactly with the same ranks, and reshard to other rank counts.
A rank that hangs, crashes or fails must stop every rank, with a message, within a bounded time.

Tolerances, for the one-rank comparisons (a tiny model, 10 steps, lr 1e-3):
  The arithmetic is the same but the order of additions is not: one rank adds micro-batch 2's
  gradient into micro-batch 1's inside each kernel, N ranks sum finished gradients in MPI's order.
  fp32 keeps 24 bits, so a reordered sum of k terms moves by up to about k * 2^-24 of the sum of
  their magnitudes (the first matmul's 64-128 tokens per micro-batch: ~1e-5 relative at worst).
    losses           |d| <= 1e-5 * |loss|
    step-1 gradient  max |d| <= 1e-5 * max |g|        (scale: a factor 1/N error would be 0.5 * max |g|)
    final weights    max |d| <= 5e-5 = lr / 20        AdamW's step is ~lr * m / sqrt(v): a gradient that is
                                                      off in its last bits moves it by a sliver of lr
  A negative control (one rank with half the batch) must differ by more than these, so the
  comparison can tell a dropped rank from rounding.
"""
import json, os, shutil, struct, subprocess, sys, tempfile, time
from checks import report, exit_code
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_shards import write_shard  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "train_gpt_cpu")
MODEL = "L=2,C=64,H=4,T=32,V=512"
T = 32
LR = 1e-3
TOL_LOSS_REL, TOL_GRAD_REL, TOL_PARAM_ABS = 1e-5, 1e-5, 5e-5


def load_dump(path):
    """The --dump-state file (safetensors): {name: float32 array}."""
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    out = {}
    for name, t in header.items():
        if name == "__metadata__":
            continue
        a, b = t["data_offsets"]
        out[name] = np.frombuffer(raw[8 + n + a:8 + n + b], dtype=np.float32).reshape(t["shape"])
    return out


class Runner:
    def __init__(self, work):
        self.work = work
        self.mpirun = shutil.which("mpirun")

    def run(self, ranks, *flags, env=None, guard=120):
        """Runs the trainer on `ranks` ranks (mpirun even for one, so both paths are the real ones)."""
        common = ["--model", MODEL, "--train-data", os.path.join(self.work, "train_*.bin"), "--val-data", "none",
                  "--seq-len", str(T), "--steps", "10", "--lr", str(LR), "--threads", "1", "--out-dir",
                  os.path.join(self.work, "out")]
        cmd = ["timeout", str(guard), self.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks),
               TRAINER] + common + [str(f) for f in flags]
        start = time.time()
        p = subprocess.run(cmd, cwd=self.work, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
        return p.returncode, p.stdout, p.stderr, time.time() - start

    def dump(self, name, ranks, *flags):
        path = os.path.join(self.work, name + ".st")
        code, out, err, _ = self.run(ranks, *flags, "--dump-state", path)
        if code != 0:
            raise RuntimeError(f"{name}: the trainer exited with {code}:\n{err[-2000:]}")
        return load_dump(path), out


def differences(a, b):
    """(loss rel, grad rel-to-max, param abs) differences of two dumps; None where not comparable."""
    loss = float(np.max(np.abs(a["losses"].astype(np.float64) - b["losses"]) / np.abs(b["losses"])))
    grad = float(np.max(np.abs(a["grads"].astype(np.float64) - b["grads"])) / np.max(np.abs(b["grads"])))
    param = float(np.max(np.abs(a["params"].astype(np.float64) - b["params"])))
    return loss, grad, param


def check_close(name, a, b):
    loss, grad, param = differences(a, b)
    ok = loss <= TOL_LOSS_REL and grad <= TOL_GRAD_REL and param <= TOL_PARAM_ABS
    report(ok, f"{name} (losses rel {loss:.1e}, step-1 grads {grad:.1e} of max, weights {param:.1e} abs)",
           f"beyond tolerance (losses {TOL_LOSS_REL}, grads {TOL_GRAD_REL}, weights {TOL_PARAM_ABS})")


def check_bitwise(name, a, b, keys=("losses", "params", "grads")):
    bad = [k for k in keys if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]
    report(not bad, name, "not bit-identical: " + ", ".join(bad))


def main():
    if not shutil.which("mpirun"):
        print("SKIP: data parallelism (mpirun is not installed: apt-get install openmpi-bin libopenmpi-dev)")
        return 0
    if not os.path.exists(TRAINER):
        print("FAIL: data parallelism: train_gpt_cpu is not built (run make)")
        return 1
    libs = subprocess.run(["ldd", TRAINER], capture_output=True, text=True).stdout
    if "libmpi" not in libs:
        print("SKIP: data parallelism (train_gpt_cpu was built without MPI: install libopenmpi-dev and rebuild)")
        return 0

    work = tempfile.mkdtemp(prefix="llmc_dp_")
    try:
        # a learnable stream (a noisy repeating pattern), long enough that 10 steps never wrap
        rng = np.random.default_rng(0)
        pattern = rng.integers(0, 512, size=97)
        tokens = np.where(rng.random(16384) < 0.8, pattern[np.arange(16384) % 97], rng.integers(0, 512, size=16384))
        write_shard(os.path.join(work, "train_000.bin"), tokens)
        r = Runner(work)

        # (a) 2 ranks x B=2 against 1 rank x 2 accumulation steps of B=2: 128 tokens per step each
        one_a, _ = r.dump("one_accum2", 1, "--batch-size", 2, "--total-batch-tokens", 128)
        two, out = r.dump("two_ranks", 2, "--batch-size", 2)
        report("2 ranks" in out and "1 accumulation step" in out, "the 2-rank run reports 2 ranks, no accumulation",
               out[:300])
        check_close("2 ranks x B=2 == 1 rank x 2 accumulation steps", two, one_a)
        # negative control: the same run missing half of each step's batch must fail the comparison
        half, _ = r.dump("one_half", 1, "--batch-size", 2)
        loss, grad, param = differences(half, two)
        report(param > 10 * TOL_PARAM_ABS and grad > 10 * TOL_GRAD_REL,
               f"negative control: half the batch differs far beyond tolerance (weights {param:.1e}, grads {grad:.1e})",
               "the tolerances cannot tell a missing rank from rounding")

        # (b) 4 ranks x B=1 against 1 rank x 4 accumulation steps of B=1
        one_b, _ = r.dump("one_accum4", 1, "--batch-size", 1, "--total-batch-tokens", 128)
        four, _ = r.dump("four_ranks", 4, "--batch-size", 1)
        check_close("4 ranks x B=1 == 1 rank x 4 accumulation steps", four, one_b)

        # (c) ZeRO-1 against ZeRO-0 on 3 ranks (134,912 parameters do not split evenly: padding is used)
        z0, _ = r.dump("three_zero0", 3, "--batch-size", 1, "--total-batch-tokens", 96)
        z1, out = r.dump("three_zero1", 3, "--batch-size", 1, "--total-batch-tokens", 96, "--zero", 1)
        report("ZeRO-1" in out and "shards of 44992, padded total 134976" in out,
               "ZeRO-1 on 3 ranks pads 134,912 to 134,976 = 3 x 44,992 (a multiple of 3 x 64)",
               out[:400])
        check_bitwise("ZeRO-1 == ZeRO-0 bit for bit (3 ranks: losses, step-1 gradient, final weights)", z1, z0)
        one_c, _ = r.dump("one_accum3", 1, "--batch-size", 1, "--total-batch-tokens", 96)
        check_close("3 ranks ZeRO-1 == 1 rank x 3 accumulation steps", z1, one_c)

        # (d) resume: 2 ranks, ZeRO-1, 10 steps straight with checkpoints at 5 and 10, then from step 5
        straight, _ = r.dump("straight", 2, "--batch-size", 2, "--zero", 1, "--checkpoint-every", 5)
        ckpt = os.path.join(work, "out", "ckpt_00000005")
        files = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
        report(files == ["checksums.txt", "model.bin", "state_rank0.bin", "state_rank1.bin"] and
               not any(n.endswith(".tmp") for n in os.listdir(os.path.join(work, "out"))),
               "a ZeRO-1 checkpoint holds model.bin and one state file per rank, nothing half-written", str(files))
        resumed, out = r.dump("resumed", 2, "--batch-size", 2, "--zero", 1, "--resume", ckpt)
        report("resumed from" in out and "resharded" not in out, "resume with the same ranks reads each rank's own shard",
               out[:400])
        report(np.array_equal(resumed["params"], straight["params"]) and
               np.array_equal(resumed["losses"], straight["losses"][5:]),
               "2 ranks ZeRO-1: 5 steps + resume + 5 steps == 10 straight, bit for bit (weights and losses)",
               "resume is not bit-exact")

        # (e) resharding: the same checkpoint continued by 4 ranks (B=1), by 1 rank (2 accumulation
        # steps), and by the same 2 ranks as ZeRO-0 (full m and v assembled from both shards)
        four_r, out = r.dump("resumed_four", 4, "--batch-size", 1, "--zero", 1, "--resume", ckpt)
        report("resharded: the checkpoint was written by 2 ranks with ZeRO-1, this run has 4 with ZeRO-1" in out,
               "resuming on 4 ranks says it reshards", out[:500])
        report(np.allclose(four_r["losses"], straight["losses"][5:], rtol=TOL_LOSS_REL, atol=0) and
               np.max(np.abs(four_r["params"] - straight["params"])) <= TOL_PARAM_ABS,
               "2-rank ZeRO-1 checkpoint resharded to 4 ranks continues like the 2-rank run",
               f"weights differ by {np.max(np.abs(four_r['params'] - straight['params'])):.1e}")
        one_r, _ = r.dump("resumed_one", 1, "--batch-size", 2, "--total-batch-tokens", 128, "--resume", ckpt)
        report(np.allclose(one_r["losses"], straight["losses"][5:], rtol=TOL_LOSS_REL, atol=0) and
               np.max(np.abs(one_r["params"] - straight["params"])) <= TOL_PARAM_ABS,
               "2-rank ZeRO-1 checkpoint resumed by 1 rank (ZeRO-0) continues like the 2-rank run",
               f"weights differ by {np.max(np.abs(one_r['params'] - straight['params'])):.1e}")
        two_z0, _ = r.dump("resumed_zero0", 2, "--batch-size", 2, "--zero", 0, "--resume", ckpt, "--checkpoint-every", 5)
        report(np.array_equal(two_z0["params"], straight["params"]),
               "2-rank ZeRO-1 checkpoint resumed as 2-rank ZeRO-0: bit-identical to the straight run",
               "m and v were not reassembled exactly")
        ckpt0 = os.path.join(work, "out", "ckpt_00000010")
        report(sorted(os.listdir(ckpt0)) == ["checksums.txt", "model.bin", "state.bin"],
               "a ZeRO-0 checkpoint of 2 ranks holds one state.bin (rank 0's full m and v)", str(os.listdir(ckpt0)))
        broken = os.path.join(work, "broken_ckpt")
        shutil.copytree(ckpt, broken)
        os.remove(os.path.join(broken, "state_rank1.bin"))
        code, _, err, _ = r.run(2, "--batch-size", 2, "--zero", 1, "--resume", broken)
        report(code != 0 and "state_rank1.bin" in err and "error:" in err,
               "a checkpoint missing a rank's state file is refused, naming the file", f"exit {code}: {err[-300:]}")

        # the launch scripts: one node, and a hostfile naming this machine
        flags = ["--model", MODEL, "--train-data", os.path.join(work, "train_*.bin"), "--val-data", "none",
                 "--seq-len", str(T), "--steps", "2", "--batch-size", "2"]
        with open(os.path.join(work, "hosts"), "w") as f:
            f.write("localhost slots=2\n")
        for script, args in [("run_mpi_local.sh", ["2"]), ("run_mpi_hostfile.sh", [os.path.join(work, "hosts"), "2"])]:
            p = subprocess.run(["timeout", "120", "bash", os.path.join(ROOT, "scripts", script)] + args + flags,
                               cwd=work, capture_output=True, text=True, env=dict(os.environ, TRAINER=TRAINER))
            report(p.returncode == 0 and p.stdout.startswith("+ mpirun") and "2 ranks" in p.stdout and "step     2/2" in p.stdout,
                   f"scripts/{script} prints its mpirun command and trains on 2 ranks",
                   f"exit {p.returncode}: {(p.stdout + p.stderr)[-400:]}")

        # (f) failures: every rank must stop, non-zero, well before the 60 s guard, saying why
        for kind, expect in [("hang", "did not complete within 2 s"), ("exit", "LLMC_TEST_FAULT: exit"),
                             ("error", "stopping all ranks")]:
            code, _, err, seconds = r.run(2, "--batch-size", 2, "--comm-timeout", 2,
                                          env={"LLMC_TEST_FAULT": f"1:3:{kind}"}, guard=60)
            report(code not in (0, 124) and seconds < 30 and expect in err,
                   f"rank 1 {kind}s at step 3: all ranks stop with a message (exit {code}, {seconds:.1f} s)",
                   f"exit {code} after {seconds:.1f} s (124 = hung until the guard); stderr: {err[-400:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
