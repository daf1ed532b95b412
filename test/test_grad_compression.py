#!/usr/bin/env python3
"""test_grad_compression.py — --grad-compression bf16 | powersgd on the CPU trainer over MPI.

The model is L=2 C=64 H=4 T=64 V=501 (wpe 64 x 64, so r = 64 is full rank for every matrix),
trained at --seq-len 32 on 128 tokens per step (one micro-batch of 32 per rank and step on 2 ranks,
accumulated to 128).

1. PowerSGD at r = min(n, m) = 64 for every matrix (LLMC_TEST_POWERSGD_EVERY_MATRIX=1: compress
   even where it saves nothing) is the exact sum up to rounding: S = P^ P^T sum M with P^ an
   orthonormal basis of M's columns. Margins, measured about 10x below them on x86-64 CPUs: the
   step-1 gradient within 1e-5 of its largest element (the factorisation adds a few fp32 roundings
   of sums over 64..512 terms: measured 1.1e-6), the losses of 10 steps within 1e-5 relative
   (measured 8e-8), the weights within 1e-3 = lr absolute (measured 1.5e-4): unlike a reordered
   sum, the factorisation's error is absolute, ~1e-6 of the LARGEST gradient, and AdamW divides
   each element by its own sqrt(v), so an element whose gradient is that small takes a step of
   up to lr in another direction. A negative control, r = 32, must differ beyond them (grads
   100x, weights 3x).
2. N = 3 ranks against an independent one-process fp64 simulation of 3 workers (below, from the
   paper's equations): each rank dumps its local gradient G_i and the sum S the trainer applied,
   every step (LLMC_TEST_COMPRESSION_DUMP); the simulation takes only the G_i, draws Q from --seed
   itself (llmc/model/model.h's counter-based normal, rewritten here), carries its own e_i and Q,
   and must reproduce S at every step within 1e-4 of max |S| (fp32 against fp64 over 6 steps of
   error feedback; measured ~1e-6). Steps 1-2 run before --powersgd-start-step 2 (exact sums).
3. The same with a NaN planted in rank 1's gradient at step 4 (LLMC_TEST_NAN_GRAD): the trainer
   skips the step, and the simulation, which does not commit e and Q on a skipped step, must still
   match steps 5-6: e and Q were not poisoned (and the checkpoint's e and Q are finite).
4. A checkpoint at step 3 resumed to step 6 equals the straight run bit for bit (losses, weights),
   with PowerSGD on; resuming with other compression settings, or with compression from a
   checkpoint written without it, is refused with one line.
5. bf16: the sum equals an fp64-free replay of its rule (round each G_i to bf16, add in fp32 in rank
   order, round to bf16) bit for bit, and the counters show half the exact sum's bytes; PowerSGD's
   bytes are what --estimate predicts.
6. Bad flags and unsupported combinations: one line, exit 2.
The GPU trainer's PowerSGD is test_gpu_grad_compression.py (it replays its sums with this simulation).

Planted bugs each check caught (by hand, once; see the commit): the error feedback not added to M
(2, 3), P not orthonormalised (1, 2), Q drawn from a rank-dependent seed (2), e not restored on
resume (4), e and Q committed on a skipped step (3).
"""
import os, shutil, subprocess, sys, tempfile
import numpy as np
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from test_parallelism import Runner, check_bitwise, differences  # noqa: E402
from test_bad_inputs import one_line_error  # noqa: E402
from token_shards import write_shard  # noqa: E402

MODEL = "L=2,C=64,H=4,T=64,V=501"
L, C, MAXT, V = 2, 64, 64, 501
VP = (V + 127) // 128 * 128
SEED = 42
TOL_LOSS_REL, TOL_GRAD_REL, TOL_PARAM_ABS = 1e-5, 1e-5, 1e-3
TOL_SIM = 1e-4


# ---- GPT-2's flat parameter array (llmc/model/model.h: param_layout) and its matrices
def layout():
    counts = [VP * C, MAXT * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C,
              L * C, L * C, L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C]
    offsets = np.concatenate([[0], np.cumsum(counts)[:-1]])
    return counts, offsets, int(sum(counts))


def matrices(r, every):
    """(offset, n, m) of each compressed matrix, in the trainer's order: wte, wpe, then per tensor its layers."""
    _, off, _ = layout()
    shapes = [(0, VP, C, 1), (1, MAXT, C, 1), (4, 3 * C, C, L), (6, C, C, L), (10, 4 * C, C, L), (12, C, 4 * C, L)]
    out = []
    for t, n, m, copies in shapes:
        if (r <= min(n, m)) if every else (2 * r * (n + m) <= n * m):
            out += [(int(off[t]) + l * n * m, n, m) for l in range(copies)]
    return out


# ---- the first Q: llmc/model/model.h's normal_from_counter, in numpy
M64 = (1 << 64) - 1


def splitmix64(x):
    x = (x + np.uint64(0x9E3779B97F4A7C15)) & np.uint64(M64)
    x = (x ^ (x >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    x = (x ^ (x >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return x ^ (x >> np.uint64(31))


def normal_from_counter(seed, counters):
    with np.errstate(over="ignore"):
        h = splitmix64(splitmix64(np.array([seed], dtype=np.uint64)) ^ counters.astype(np.uint64))
    u1 = ((h >> np.uint64(40)).astype(np.float64) + 0.5) / 16777216.0
    u2 = ((h >> np.uint64(16)) & np.uint64(0xFFFFFF)).astype(np.float64) / 16777216.0
    return (np.sqrt(-2.0 * np.log(u1)) * np.cos(6.283185307179586 * u2)).astype(np.float32).astype(np.float64)


def orthonormalise(P):
    """Gram-Schmidt on P's columns, in fp64; a column the projections reduce to nothing (rank below r) is zero."""
    P = P.copy()
    for j in range(P.shape[1]):
        before = np.linalg.norm(P[:, j])
        for k in range(j):
            P[:, j] -= (P[:, j] @ P[:, k]) * P[:, k]
        norm = np.linalg.norm(P[:, j])
        P[:, j] = P[:, j] / norm if norm > 2.0**-20 * np.sqrt(P.shape[0]) * before else 0.0
    return P


class PowerSGDSimulation:
    """N workers in one process, fp64, from Vogels et al. 2019 (Algorithm 1 with error feedback):
    M_i = G_i + e_i; P = sum M_i Q; P^ = orth(P); Q' = sum M_i^T P^; S = P^ Q'^T; e_i = M_i - S/N; Q = Q'."""

    def __init__(self, N, r, start_step, every=False):
        self.N, self.r, self.start = N, r, start_step
        self.mats = matrices(r, every)
        _, _, self.total = layout()
        self.e = [[np.zeros((n, m)) for (_, n, m) in self.mats] for _ in range(N)]
        q_seed = SEED ^ 0x9D5A3C1B2E4F6071
        self.q, at = [], 0
        for _, n, m in self.mats:
            self.q.append(normal_from_counter(q_seed, np.arange(at, at + m * r)).reshape(m, r))
            at += m * r

    def step(self, step, G):
        """The step's S from the workers' local gradients G (flat, fp64); returns S and the next (e, Q)."""
        S = np.sum(G, axis=0)
        if step <= self.start:
            return S, self.e, self.q
        e_next, q_next = [[None] * len(self.mats) for _ in range(self.N)], []
        for k, (off, n, m) in enumerate(self.mats):
            M = [G[i][off:off + n * m].reshape(n, m) + self.e[i][k] for i in range(self.N)]
            P = orthonormalise(sum(Mi @ self.q[k] for Mi in M))
            Q = sum(Mi.T @ P for Mi in M)
            Sk = P @ Q.T
            S[off:off + n * m] = Sk.reshape(-1)
            for i in range(self.N):
                e_next[i][k] = M[i] - Sk / self.N
            q_next.append(Q)
        return S, e_next, q_next

    def commit(self, e, q):
        self.e, self.q = e, q


def read_dumps(path, step, N, total):
    local = np.stack([np.fromfile(os.path.join(path, f"step{step}_rank{i}_local.f32"), dtype="<f4")[:total] for i in range(N)])
    sums = [np.fromfile(os.path.join(path, f"step{step}_rank{i}_sum.f32"), dtype="<f4")[:total] for i in range(N)]
    return local.astype(np.float64), sums


def replay(name, path, N, steps, r, start, nan_step=None, tol=TOL_SIM):
    """The trainer's sums against the simulation at every step, within tol of max |S| (the GPU trainer's
    test, test_gpu_grad_compression.py, replays its bf16 sums with a tolerance of its own)."""
    sim = PowerSGDSimulation(N, r, start)
    worst, same_on_ranks, skipped = 0.0, True, []
    for step in range(1, steps + 1):
        G, sums = read_dumps(path, step, N, sim.total)
        same_on_ranks &= all(np.array_equal(sums[0], s, equal_nan=True) for s in sums)
        S, e, q = sim.step(step, G)
        if not np.all(np.isfinite(sums[0])):
            skipped.append(step)   # the trainer skipped its update: the simulation keeps e and Q too
            continue
        worst = max(worst, float(np.max(np.abs(sums[0] - S)) / np.max(np.abs(S))))
        sim.commit(e, q)
    ok = worst <= tol and same_on_ranks and skipped == ([nan_step] if nan_step else [])
    report(ok, f"{name}: the trainer's sums == the fp64 simulation of {N} workers over {steps} steps "
               f"(worst {worst:.1e} of max |S|, every rank the same bits{', step %d skipped' % nan_step if nan_step else ''})",
           f"worst {worst:.1e} (tolerance {tol}), identical on ranks {same_on_ranks}, non-finite steps {skipped}")


def compression_bytes(out):
    """Rank 0's data-group bytes of the last step and whether every rank matched --estimate."""
    for line in out.splitlines():
        if line.startswith("  0 (0,0,0)"):
            return line.split("|")[1].split("/")[0].strip(), line.rstrip().endswith("= --estimate")
    return None, False


def main():
    runner = Runner(None)
    if not runner.mpirun:
        print("SKIP: grad compression (mpirun is not installed)")
        return 0
    work = tempfile.mkdtemp(prefix="llmc_gc_")
    try:
        rng = np.random.default_rng(0)
        pattern = rng.integers(0, V, size=97)
        tokens = np.where(rng.random(16384) < 0.8, pattern[np.arange(16384) % 97], rng.integers(0, V, size=16384))
        write_shard(os.path.join(work, "train_000.bin"), tokens)
        r = Runner(work)
        batch = ["--total-batch-tokens", "128"]
        every = {"LLMC_TEST_POWERSGD_EVERY_MATRIX": "1"}

        # ---- 1. full rank == the exact sum
        exact, out = r.dump("exact", 2, *batch, model=MODEL)
        full, out = r.dump("full", 2, *batch, "--grad-compression", "powersgd", "--powersgd-rank", 64, model=MODEL, env=every)
        low, _ = r.dump("rank32", 2, *batch, "--grad-compression", "powersgd", "--powersgd-rank", 32, model=MODEL, env=every)
        if exact is not None and full is not None and low is not None:
            loss, grad, param, _ = differences(full, exact)
            report(loss <= TOL_LOSS_REL and grad <= TOL_GRAD_REL and param <= TOL_PARAM_ABS,
                   f"PowerSGD at r = min(n, m) = 64 == the exact sum (losses {loss:.1e}, step-1 grads {grad:.1e} of max, "
                   f"weights {param:.1e})", f"beyond {TOL_LOSS_REL}, {TOL_GRAD_REL}, {TOL_PARAM_ABS}")
            loss, grad, param, _ = differences(low, exact)
            report(grad > 100 * TOL_GRAD_REL and param > 3 * TOL_PARAM_ABS,
                   f"negative control: r = 32 differs far beyond them (grads {grad:.1e}, weights {param:.1e})",
                   "the margins cannot tell a rank-32 approximation from the exact sum")

        # ---- 2. three ranks against the fp64 simulation; 3. a NaN at step 4
        for name, env, nan_step in [("3 ranks, r = 2", {}, None), ("3 ranks, r = 2, NaN on rank 1 at step 4",
                                                                    {"LLMC_TEST_NAN_GRAD": "1:4"}, 4)]:
            dumps = os.path.join(work, "dumps_" + str(nan_step))
            os.makedirs(dumps)
            code, out, err = r.run(3, "--total-batch-tokens", "96", "--grad-compression", "powersgd", "--powersgd-rank", 2,
                                   "--powersgd-start-step", 2, "--checkpoint-every", 6, "--out-dir", dumps, model=MODEL,
                                   steps=6, env=dict(env, LLMC_TEST_COMPRESSION_DUMP=dumps))
            if code != 0:
                report(False, name, f"exit {code}: {(out + err)[-1500:]}")
                continue
            replay(name, dumps, 3, 6, 2, 2, nan_step)
            if nan_step:
                state = [np.fromfile(os.path.join(dumps, "ckpt_00000006", f"grad_compression_rank{i}.bin"), dtype="<f4",
                                     offset=256) for i in range(3)]
                report("update skipped" in out and all(s.size > 0 and np.all(np.isfinite(s)) for s in state),
                       "the skipped step left every rank's saved e and Q finite", out[-600:])

        # ---- 4. checkpoint and resume, bit for bit
        psgd = ["--grad-compression", "powersgd", "--powersgd-rank", 2, "--powersgd-start-step", 1]
        straight, _ = r.dump("straight", 2, *batch, *psgd, "--checkpoint-every", 3, model=MODEL, steps=6)
        ckpt = os.path.join(work, "out", "ckpt_00000003")
        resumed, out = r.dump("resumed", 2, *batch, *psgd, "--resume", ckpt, model=MODEL, steps=6)
        if straight is not None and resumed is not None:
            report("resumed from" in out and np.array_equal(resumed["params"], straight["params"]) and
                   np.array_equal(resumed["losses"], straight["losses"][3:]),
                   "PowerSGD: 3 steps + checkpoint + resume + 3 steps == 6 straight, bit for bit", out[-800:])
        for what, flags in [("another rank", ["--grad-compression", "powersgd", "--powersgd-rank", 3, "--powersgd-start-step", 1]),
                            ("no compression", [])]:
            code, out, err = r.run(2, *batch, *flags, "--resume", ckpt, model=MODEL, steps=6)
            lines = [l for l in err.splitlines() if l.startswith("error:")]
            report(code != 0 and len(lines) >= 1 and all("was written with --grad-compression powersgd --powersgd-rank 2" in l
                                                         for l in lines[:1]),
                   f"resuming a PowerSGD checkpoint with {what} is refused with one line", f"exit {code}: {err[-600:]}")
        r.run(2, *batch, "--checkpoint-every", 3, "--out-dir", os.path.join(work, "plain"), model=MODEL, steps=3)
        code, out, err = r.run(2, *batch, *psgd, "--resume", os.path.join(work, "plain", "ckpt_00000003"), model=MODEL, steps=6)
        report(code != 0 and "was written with --grad-compression none" in err,
               "resuming a checkpoint without compression state with PowerSGD is refused with one line", f"exit {code}: {err[-600:]}")

        # ---- 5. bf16: the rule replayed bit for bit; bytes
        dumps = os.path.join(work, "dumps_bf16")
        os.makedirs(dumps)
        code, out, err = r.run(2, *batch, "--grad-compression", "bf16", model=MODEL, steps=2,
                               env={"LLMC_TEST_COMPRESSION_DUMP": dumps})
        bf16_bytes, bf16_est = compression_bytes(out)

        def to_bf16(x):  # round to nearest even, as llmc/utils.h
            b = np.asarray(x, dtype=np.float32).view(np.uint32).astype(np.uint64)
            return (((b + 0x7FFF + ((b >> 16) & 1)) >> 16) << 16).astype(np.uint32).view(np.float32)
        same = code == 0
        for step in (1, 2):
            if not same:
                break
            G = [np.fromfile(os.path.join(dumps, f"step{step}_rank{i}_local.f32"), dtype="<f4") for i in range(2)]
            S = np.fromfile(os.path.join(dumps, f"step{step}_rank0_sum.f32"), dtype="<f4")
            same = np.array_equal(S, to_bf16(to_bf16(G[0]) + to_bf16(G[1])))
        report(same, "bf16: the sum is round_bf16(round_bf16(G_0) + round_bf16(G_1)), added in fp32, bit for bit",
               f"exit {code}: {(out + err)[-600:]}")
        code, out, _ = r.run(2, *batch, model=MODEL, steps=2)
        exact_bytes, _ = compression_bytes(out)
        code, out, _ = r.run(2, *batch, *psgd, model=MODEL, steps=2)
        psgd_bytes, psgd_est = compression_bytes(out)
        report(bf16_est and psgd_est and bf16_bytes is not None,
               f"bytes each rank sent to its data group in a step, as --estimate predicts: exact {exact_bytes}, bf16 "
               f"{bf16_bytes}, PowerSGD r = 2 {psgd_bytes}", f"bf16 {bf16_bytes} {bf16_est}, powersgd {psgd_bytes} {psgd_est}")

        # ---- 6. bad flags (one rank: before MPI) and combinations it cannot serve (over MPI)
        base = ["--model", MODEL, "--train-data", os.path.join(work, "train_*.bin"), "--val-data", "none", "--seq-len", "32"]
        one_line_error("--grad-compression fp8", base + ["--grad-compression", "fp8"], 2, "must be none, bf16 or powersgd")
        one_line_error("--powersgd-rank 0", base + ["--powersgd-rank", "0"], 2, "--powersgd-rank must be at least 1")
        one_line_error("--powersgd-start-step -1", base + ["--powersgd-start-step", "-1"], 2, "--powersgd-start-step")
        one_line_error("--grad-compression bf16 on one rank", base + ["--grad-compression", "bf16"], 2,
                       "needs 2 or more data-parallel ranks")
        for ranks, flags, needle, env in [
                (2, ["--zero", "1"], "ZeRO-1/2/3 reduce-scatter", {}),
                (2, ["--tensor-parallel", "2"], "tensor and pipeline ranks hold slices", {}),
                (2, ["--powersgd-rank", "40"], "use --powersgd-rank 28 or less", {}),
                (2, ["--powersgd-rank", "65"], "exceeds min(n, m) = 64", every)]:
            code, out, err = r.run(ranks, *batch, "--grad-compression", "powersgd", *flags, model=MODEL, steps=1, env=env)
            report(code == 2 and err.count("error:") == 1 and needle in err,
                   f"powersgd with {' '.join(flags)} on {ranks} ranks -> one line, exit 2", f"exit {code}: {err[-500:]}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
