#!/usr/bin/env python3
"""test_optimizers.py — --optimizer adafactor and sm3 on the CPU trainer, against fp64 references
written here from the papers (not from the C++), on the trainer's own parameters and gradients.

The model is L=2 C=64 H=4 T=64 V=501 (Vp = 512: 11 padded wte rows, which must get no state and stay
0) trained at T=32, so wpe's rows 32..63 never get a gradient (Adafactor's eps1 = 1e-30 and SM3's
0/0 live there).

  reference, 20 steps   The trainer is run one step at a time, each run resuming the last one's
                        checkpoint and dumping (--dump-state) the step's gradient and the weights after
                        it. The reference starts from the initial weights and applies its own update,
                        in fp64, to each step's gradient (global-norm clipped as the trainer clips):
                          Adafactor (Shazeer & Stern 2018, Algorithms 4 and 5): beta1 = 0,
                            beta2_t = 1 - t^-0.8, eps1 = 1e-30, eps2 = 1e-3, d = 1,
                            rho_t = min(1e-2, 1/sqrt(t)), alpha_t = max(eps2, RMS(W)) rho_t,
                            R, C = row and column sums of G^2 + eps1, V = R C^T / sum(R),
                            decoupled decay W (1 - rho_t wd) on the 2-D weights
                          SM3-II (Anil et al. 2019): nu = min(r_i, c_j) + g^2, r = max_j nu,
                            c = max_i nu, W -= lr g / sqrt(nu) (0 where nu = 0), lr from the schedule
                        Tolerance: the weights' distance from the reference, at every step, under 1e-4
                        of how far the reference moved them from the start (the gradients are the
                        trainer's, so only the update's fp32 rounding separates the two: measured
                        below 1e-6); the final optimizer state within 1e-4 relative.
  hand check, step 1    beta2_1 = 0, so Adafactor's state after step 1 is the step's own statistics:
                        a vector's V = g^2 + eps1, a matrix's R and C its row and column sums of g^2
                        + eps1 (rows = output features of the (out, in) weights), from state.bin.
  resume                the one-step-per-run chain == a straight 20-step run, bit for bit
                        (losses and weights): the state is saved and resumed exactly at every step.
  --lr given            Adafactor with --lr uses the schedule (warm-up here) in place of rho_t.
  data parallel         2 ranks (mpirun) == 1 rank accumulating the same micro-batches, to fp32
                        summation order; and --estimate's memory equals what each rank holds.
  ZeRO-1                each rank owns whole matrices (llmc/optim/factored_sharding.h): on 2 and 3
                        ranks, 10 steps, == ZeRO-0 on as many ranks bit for bit (the same summed
                        gradient, the same per-block arithmetic) and == 1 rank to 1e-5 (summation
                        order, as above); memory and bytes as --estimate predicts on every rank;
                        5 + resume + 5 == 10 bit for bit; the 2-rank checkpoint resumed on 3 ranks and
                        on 1 with ZeRO-1 == with ZeRO-0 bit for bit (each rank's slice of the state).
  memory                --estimate: the optimizer state is sum(rows + cols) + sum(vector sizes) floats,
                        counted here from the model's shapes; AdamW's 8 bytes per parameter; with
                        --zero 1 each rank's whole blocks, cut greedily (the rule recomputed here).
  AdamW's t             step 3's update (checkpoints 2 and 3: the weights, m and v) recomputed for t = 1..5:
                        only t = 3, the number of updates applied, gives the trainer's weights.
  bf16 m and v          --optimizer-state bf16 (AdamW, llmc/optim/adamw_bf16.h): 20 steps within 2% of
                        fp32 m and v's movement; 10 + resume + 10 == 20 bit for bit; dp2 ZeRO-1 == one
                        rank; 4 bytes per parameter in --estimate and in what every rank holds. (Why
                        plain bf16 would not do, and that stochastic rounding does: build/test_adamw_bf16.)
  tensor parallel       --tensor-parallel 2 (llmc/optim/factored_tensor_parallel.h), and dp2 x tp2 for
                        Adafactor: == 1 rank to 1e-5 (the key biases left out), memory and bytes as
                        --estimate predicts; a tp2 checkpoint resumes bit for bit on the same grid and
                        is refused in one line on another.
  refusals              resuming with another optimizer (exit 1, one line); unknown --optimizer or
                        --optimizer-state, a factored optimizer with --zero 2, --pipeline-parallel 2,
                        --tensor-parallel 2 with --zero 1,
                        --optimizer-state bf16 or AdamW's --beta1 (exit 2, one line); the GPU trainer (when
                        build/emu/train_gpt is built) refuses sm3 with --zero 1 (its factored optimizers:
                        test_gpu_factored.py), and --optimizer-state bf16 with --moe-experts (its bf16
                        moments: test_gpu_optimizers.py).

Planted bugs that these checks caught (by hand, once; see the commit): beta2_t's exponent -0.8 ->
-0.5, R and C swapped, update clipping removed, SM3's min(r_i, c_j) -> max; ZeRO-1: each rank's blocks
updated from its own unsummed gradient (no all-gather of the sum: 13 checks failed, 6e-2 off), every
rank resuming slice 0 of the state (the resume and reshard checks failed). AdamW given t = step + 1:
the t check failed (t = 4 fitted, 7e-5; t = 3 off by 0.11). Tensor parallelism:
Adafactor's column sums of a rows-cut matrix left local (tp2 and dp2 x tp2 3.1e-4 off), SM3's
column maxima left local (3.5e-3 off), every rank resuming rank 0's file (the resume check failed).
"""
import glob, os, re, shutil, subprocess, sys, tempfile
import numpy as np
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from safetensors_io import read_safetensors  # noqa: E402
from token_shards import write_shard  # noqa: E402
from test_parallelism import T as PAR_T, Runner, check_predictions  # noqa: E402

BIN = os.path.join(ROOT, "train_gpt_cpu")
GPU_EMU = os.path.join(ROOT, "build", "emu", "train_gpt")
L, C, MAXT, V, VP = 2, 64, 64, 501, 512
MODEL = f"L={L},C={C},H=4,T={MAXT},V={V}"
STEPS = 20
STATE_HEADER = 1024
OPT_FLOATS_AT = 136   # TrainStateHeader::optimizer_state_floats (llmc/io/formats.h)
OPTIMIZER_AT = 128    # TrainStateHeader::optimizer


# ---- the parameters as the papers see them: 2-D weight matrices (out, in) and vectors ----------
def blocks():
    """[(name, offset, shape, decays)] in the flat array's order (llmc/model/model.h's table)."""
    per_layer = [("ln1w", (C,)), ("ln1b", (C,)), ("qkvw", (3 * C, C)), ("qkvb", (3 * C,)), ("attprojw", (C, C)),
                 ("attprojb", (C,)), ("ln2w", (C,)), ("ln2b", (C,)), ("fcw", (4 * C, C)), ("fcb", (4 * C,)),
                 ("fcprojw", (C, 4 * C)), ("fcprojb", (C,))]
    out, at = [], 0
    out.append(("wte", at, (V, C), True))      # the real rows only: Vp - V rows of padding follow
    at += VP * C
    out.append(("wpe", at, (MAXT, C), True))
    at += MAXT * C
    for name, shape in per_layer:               # each stacked (L, ...) over the layers
        size = int(np.prod(shape))
        for layer in range(L):
            out.append((f"{name}[{layer}]", at + layer * size, shape, len(shape) == 2))
        at += L * size
    out.append(("lnfw", at, (C,), False))
    out.append(("lnfb", at + C, (C,), False))
    return out, at + 2 * C


BLOCKS, NUM_PARAMS = blocks()


def view(flat, b):
    name, offset, shape, _ = b
    return flat[offset:offset + int(np.prod(shape))].reshape(shape)


def rms(x):
    return np.sqrt(np.mean(x * x))


def clip_scale(grads, max_norm=1.0):
    return min(1.0, max_norm / (np.sqrt(np.sum(grads.astype(np.float64) ** 2)) + 1e-6))


def adafactor_ref(W, G, S, t, rho, wd, decays):
    """One step of Adafactor on one block, fp64. S: dict of the block's state (created at t = 1)."""
    beta2 = 1.0 - t ** -0.8
    alpha = max(1e-3, rms(W)) * rho
    G2 = G * G + 1e-30
    if G.ndim == 2:
        S["R"] = beta2 * S.get("R", 0.0) + (1 - beta2) * G2.sum(axis=1)
        S["C"] = beta2 * S.get("C", 0.0) + (1 - beta2) * G2.sum(axis=0)
        Vhat = np.outer(S["R"], S["C"]) / S["R"].sum()
    else:
        S["V"] = beta2 * S.get("V", 0.0) + (1 - beta2) * G2
        Vhat = S["V"]
    U = G / np.sqrt(Vhat)
    U = U / max(1.0, rms(U) / 1.0)
    return W * (1 - rho * wd * decays) - alpha * U


def sm3_ref(W, G, S, lr, wd, decays):
    """One step of SM3-II on one block, fp64: rows and columns cover a matrix, singletons a vector."""
    if G.ndim == 2:
        nu = np.minimum(S.get("r", np.zeros(G.shape[0]))[:, None], S.get("c", np.zeros(G.shape[1]))[None, :]) + G * G
        S["r"], S["c"] = nu.max(axis=1), nu.max(axis=0)
    else:
        nu = S.get("a", 0.0) + G * G
        S["a"] = nu
    step = np.where(nu > 0, G / np.sqrt(np.where(nu > 0, nu, 1.0)), 0.0)
    return W * (1 - lr * wd * decays) - lr * step


def state_of(S, G):
    """A block's reference state in the trainer's order: R then C, or V (Adafactor); r then c, or a (SM3)."""
    keys = [k for k in ("R", "C", "V", "r", "c", "a") if k in S]
    return np.concatenate([np.broadcast_to(S[k], (G.shape[0] if k in "RVra" else G.shape[1],)) for k in keys])


def read_state(path):
    raw = open(path, "rb").read()
    optimizer = int(np.frombuffer(raw[OPTIMIZER_AT:OPTIMIZER_AT + 4], np.int32)[0])
    count = int(np.frombuffer(raw[OPT_FLOATS_AT:OPT_FLOATS_AT + 8], np.int64)[0])
    return optimizer, np.frombuffer(raw[STATE_HEADER:STATE_HEADER + 4 * count], np.float32).astype(np.float64)


def grid_moments(ckpt):
    """m and v of a checkpoint in the whole model's order: state.bin, or every rank's state_rank<r>.bin
    (llmc/io/formats.h: after the 1024-byte header the run table, num_runs (global, count) pairs, when
    has_run_table, else the one run [shard_begin, + shard_count); then m, v). Unwritten elements: NaN."""
    files = [f"{ckpt}/state.bin"] if os.path.exists(f"{ckpt}/state.bin") else sorted(glob.glob(f"{ckpt}/state_rank*.bin"))
    m = v = None
    for path in files:
        raw = open(path, "rb").read()
        i64 = lambda at: int(np.frombuffer(raw[at:at + 8], np.int64)[0])  # noqa: E731
        total, begin, count = i64(16), i64(24), i64(32)
        if m is None:
            m, v = np.full(total, np.nan, np.float32), np.full(total, np.nan, np.float32)
        has_table = int(np.frombuffer(raw[104:108], np.int32)[0])
        runs = np.frombuffer(raw[1024:1024 + 16 * i64(120)], np.int64).reshape(-1, 2) if has_table else [(begin, count)]
        at = 1024 + (16 * i64(120) if has_table else 0)
        fm = np.frombuffer(raw[at:at + 4 * count], np.float32)
        fv = np.frombuffer(raw[at + 4 * count:at + 8 * count], np.float32)
        k = 0
        for g, n in runs:
            m[g:g + n], v[g:g + n] = fm[k:k + n], fv[k:k + n]
            k += n
    return m, v


class Trainer:
    def __init__(self, work):
        self.work = work
        rng = np.random.default_rng(0)
        self.train = os.path.join(work, "train.bin")
        write_shard(self.train, rng.integers(0, V, 40000))

    def base(self, out):
        return ["--model", MODEL, "--train-data", self.train, "--val-data", "none", "--batch-size", "4", "--seq-len", "32",
                "--threads", "2", "--out-dir", os.path.join(self.work, out)]

    def run(self, args, expect_ok=True):
        p = subprocess.run([BIN] + [str(a) for a in args], capture_output=True, text=True, timeout=300)
        if expect_ok and p.returncode != 0:
            raise RuntimeError(f"train_gpt_cpu {' '.join(map(str, args))} failed ({p.returncode}): {p.stderr}")
        return p

    def initial_weights(self):
        path = os.path.join(self.work, "init.st")
        val = os.path.join(self.work, "val.bin")
        write_shard(val, np.arange(2000) % V)
        self.run(self.base("init") + ["--val-data", val, "--val-tokens", "128", "--eval-only", "--dump-state", path])
        return read_safetensors(path, names=["params"])[0]["params"].astype(np.float64)

    def chain(self, name, flags, steps=STEPS):
        """Steps 1..steps, one per run, each resuming the last: [(grads, params, losses)], state at each step."""
        out = os.path.join(self.work, name)
        results = []
        for k in range(1, steps + 1):
            dump = os.path.join(self.work, f"{name}_{k}.st")
            resume = ["--resume", os.path.join(out, f"ckpt_{k - 1:08d}")] if k > 1 else []
            self.run(self.base(name) + flags + ["--steps", k, "--checkpoint-every", 1, "--dump-state", dump] + resume)
            d = read_safetensors(dump, names=["grads", "params", "losses"])[0]
            results.append(d)
        return results, out

    def straight(self, name, flags, steps=STEPS):
        dump = os.path.join(self.work, name + ".st")
        self.run(self.base(name) + flags + ["--steps", steps, "--dump-state", dump])
        return read_safetensors(dump, names=["params", "losses"])[0]


def compare_with_reference(label, tr, chain, ckpt_dir, W0, update):
    """The reference's weights, fed each step's gradient, against the trainer's after every step."""
    W = W0.copy()
    states = [dict() for _ in BLOCKS]
    worst = 0.0
    for t, d in enumerate(chain, start=1):
        g = d["grads"].astype(np.float64) * clip_scale(d["grads"])
        new = W.copy()
        for b, S in zip(BLOCKS, states):
            view(new, b)[...] = update(view(W, b), view(g, b), S, t, b[3])
        W = new
        moved = np.max(np.abs(W - W0))
        worst = max(worst, np.max(np.abs(d["params"].astype(np.float64) - W)) / moved)
    report(worst < 1e-4, f"{label}: {len(chain)} steps == the fp64 reference from the paper (weights within "
           f"{worst:.1e} of the distance moved, every step)", f"{worst:.2e} >= 1e-4")
    pad = chain[-1]["params"][V * C:VP * C]
    report(np.all(pad == 0), f"{label}: the padded wte rows stay 0 (no state, never touched)")
    optimizer, got = read_state(os.path.join(ckpt_dir, f"ckpt_{len(chain):08d}", "state.bin"))
    want = np.concatenate([state_of(S, view(W0, b)) for b, S in zip(BLOCKS, states)])
    close = got.shape == want.shape and np.allclose(got, want, rtol=1e-4, atol=1e-30)
    err = np.max(np.abs(got - want) / np.maximum(np.abs(want), 1e-30)) if got.shape == want.shape else float("inf")
    report(close, f"{label}: the optimizer state in state.bin after step {len(chain)} == the reference's "
           f"({want.size} floats, {err:.1e} relative)", f"shapes {got.shape} {want.shape}, {err:.2e}")
    return W


def check_adafactor_step1(chain, ckpt_dir):
    _, got = read_state(os.path.join(ckpt_dir, "ckpt_00000001", "state.bin"))
    g = chain[0]["grads"].astype(np.float64) * clip_scale(chain[0]["grads"])
    at, worst_vec, worst_mat = 0, 0.0, 0.0
    for b in BLOCKS:
        G2 = view(g, b) ** 2 + 1e-30
        if G2.ndim == 2:
            R, Cs = G2.sum(axis=1), G2.sum(axis=0)   # row i: output feature i of the (out, in) weight
            n, m = G2.shape
            worst_mat = max(worst_mat, np.max(np.abs(got[at:at + n] - R) / R), np.max(np.abs(got[at + n:at + n + m] - Cs) / Cs))
            at += n + m
        else:
            worst_vec = max(worst_vec, np.max(np.abs(got[at:at + G2.size] - G2) / G2))
            at += G2.size
    report(worst_vec < 1e-6 and at == got.size, f"adafactor by hand at step 1: every vector's V == g^2 + eps1 "
           f"(beta2_1 = 0; {worst_vec:.1e} relative, fp32 rounding)", f"{worst_vec:.2e}")
    report(worst_mat < 1e-5, f"adafactor by hand at step 1: every matrix's R == row sums and C == column sums of "
           f"g^2 + eps1 ({worst_mat:.1e} relative)", f"{worst_mat:.2e}")


def check_adamw_t(tr):
    """AdamW's step counter t against the math: 3 steps at a constant lr, no weight decay, checkpointed every
    step. Step 3's update is W3 = W2 - lr m3 / (1 - b1^t) / (sqrt(v3 / (1 - b2^t)) + eps) with checkpoint 3's
    m, v: recomputed here for t = 1..5, only t = 3 (the number of updates applied) may give checkpoint 3's
    weights (fp32 rounding: measured 6e-5 of the largest step; a t off by one: 0.1 to 0.2 of it)."""
    lr, b1, b2, eps = 1e-3, 0.9, 0.95, 1e-8  # (cli.h's defaults for beta1, beta2, eps)
    out = os.path.join(tr.work, "adamw_t")
    tr.run(tr.base("adamw_t") + ["--lr", lr, "--lr-schedule", "constant", "--weight-decay", 0, "--steps", 3,
                                 "--checkpoint-every", 1])
    w2, w3 = (np.fromfile(f"{out}/ckpt_{k:08d}/model.bin", np.float32, offset=1024).astype(np.float64) for k in (2, 3))
    m, v = (x.astype(np.float64) for x in grid_moments(f"{out}/ckpt_00000003"))
    moved = v > 0  # (wpe's rows past T = 32 never get a gradient)
    scale = np.max(np.abs(w3 - w2)[moved])
    errors = {t: np.max(np.abs(w2 - lr * m / (1 - b1**t) / (np.sqrt(v / (1 - b2**t)) + eps) - w3)[moved]) / scale
              for t in range(1, 6)}
    report(errors[3] < 1e-3 and all(errors[t] > 0.05 for t in errors if t != 3),
           f"AdamW's t: step 3's update is the one of t = 3 (relative error {errors[3]:.1e}; t = 2: {errors[2]:.1e}, "
           f"t = 4: {errors[4]:.1e})", f"errors by t: {errors}")


def check_resume(label, chain, straight):
    losses = np.concatenate([d["losses"][-1:] for d in chain])
    same = np.array_equal(losses, straight["losses"]) and np.array_equal(chain[-1]["params"], straight["params"])
    report(same, f"{label}: resumed after every step == a straight {len(chain)}-step run, bit for bit (losses, weights)",
           f"max weight difference {np.max(np.abs(chain[-1]['params'] - straight['params'])):.2e}")


def not_key_biases(size, layers=4, C=64, maxT=32, Vp=512):
    """True for every weight of test_parallelism's model (L=4 C=64 T=32 V=501) but the key biases."""
    qkvb = Vp * C + maxT * C + 2 * layers * C + layers * 3 * C * C
    keep = np.ones(size, bool)
    for layer in range(layers):
        keep[qkvb + layer * 3 * C + C:qkvb + layer * 3 * C + 2 * C] = False
    return keep


def check_factored_close(name, got, one):
    """A factored optimizer's run on ranks `got` == the one-rank run `one` to 1e-5 (fp32 summation order),
    the key biases left out (why: the data-parallel check in main). Returns the weights' distance."""
    mask = not_key_biases(one["params"].size)
    d = np.max(np.abs(got["params"].astype(np.float64) - one["params"])[mask])
    loss = np.max(np.abs(got["losses"].astype(np.float64) - one["losses"]) / np.abs(one["losses"]))
    report(d <= 1e-5 and loss <= 1e-5, f"{name} == 1 rank (weights {d:.1e} but the key biases, losses {loss:.1e})",
           f"weights {d:.2e}, losses {loss:.2e} beyond 1e-5")
    return d


def check_one_line(label, p, code, words):
    lines = p.stderr.strip().splitlines()
    ok = p.returncode == code and len(lines) == 1 and all(w in lines[0] for w in words)
    report(ok, f"{label}: exit {code}, one line", f"exit {p.returncode}, stderr: {p.stderr.strip()[:400]}")


def check_factored_zero1(r, par):
    """ZeRO-1 with a factored optimizer (llmc/optim/factored_sharding.h): each rank updates whole
    matrices with the one-rank code, after ZeRO-0's all-reduce of the gradient. So on N ranks it must
    equal ZeRO-0 on N ranks bit for bit (the same summed gradient, the same arithmetic per block), and
    one rank accumulating the same 6 micro-batches to fp32 summation order (the data-parallel sum adds
    in another order than one rank's accumulation; 1e-5 as above, the key biases left out)."""
    six = ["--lr", "0.01", "--total-batch-tokens", 6 * PAR_T]  # 6 micro-batches: 1, 2 and 3 ranks divide them
    for opt in ("adafactor", "sm3"):
        one, _ = r.dump(f"{opt}_one6", 1, "--optimizer", opt, *six)
        for n in (2, 3):
            z0, _ = r.dump(f"{opt}_z0_{n}", n, "--optimizer", opt, *six)
            z1, out = r.dump(f"{opt}_z1_{n}", n, "--optimizer", opt, "--zero", 1, *six)
            if one is None or z0 is None or z1 is None:
                continue
            report(np.array_equal(z1["params"], z0["params"]) and np.array_equal(z1["losses"], z0["losses"]),
                   f"{opt}: {n} ranks ZeRO-1 (whole matrices per rank) == ZeRO-0, 10 steps, bit for bit",
                   f"weights differ by {np.max(np.abs(z1['params'].astype(np.float64) - z0['params'])):.2e}")
            check_factored_close(f"{opt}: {n} ranks ZeRO-1", z1, one)
            check_predictions(f"{opt} dp{n} ZeRO-1", out, n)
    # checkpoints: 5 + resume + 5 == 10 on the same grid, bit for bit; resharded onto 3 ranks and 1
    # rank, each rank reads its slice of the concatenated state files: ZeRO-1 == ZeRO-0 resumed from
    # the same checkpoint, bit for bit (ZeRO-0 reads the whole state, with no slicing to get wrong)
    flags = ["--optimizer", "adafactor", "--zero", 1, *six]
    out_dir = os.path.join(par, "ckpt_z1")
    straight, _ = r.dump("adafactor_z1_ckpt", 2, *flags, "--checkpoint-every", 5, "--out-dir", out_dir)
    ckpt = os.path.join(out_dir, "ckpt_00000005")
    files = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
    report(files == ["checksums.txt", "model.bin", "state_rank0.bin", "state_rank1.bin"],
           "adafactor ZeRO-1 checkpoint: model.bin and each rank's slice of the state", str(files))
    resumed, out = r.dump("adafactor_z1_resumed", 2, *flags, "--resume", ckpt)
    if straight is not None and resumed is not None:
        report(np.array_equal(resumed["params"], straight["params"]) and np.array_equal(resumed["losses"], straight["losses"][5:]),
               "adafactor ZeRO-1, 2 ranks: 5 steps + checkpoint + resume + 5 == 10 straight, bit for bit", out[-600:])
    for n in (3, 1):
        a, out_a = r.dump(f"adafactor_z1_to{n}", n, *flags, "--resume", ckpt)
        b, _ = r.dump(f"adafactor_z0_to{n}", n, *flags[:2], *six, "--resume", ckpt)
        if a is not None and b is not None:
            report("resharded" in out_a and np.array_equal(a["params"], b["params"]),
                   f"adafactor: the 2-rank ZeRO-1 checkpoint resumed on {n} rank{'s' if n > 1 else ''} with ZeRO-1 == with "
                   "ZeRO-0, bit for bit (each rank's slice of the state is the right one)", out_a[-600:])


def check_factored_tensor_parallel(r, par, ones):
    """--tensor-parallel 2 (llmc/optim/factored_tensor_parallel.h): each rank keeps the statistics of
    its part of every cut matrix, the cut dimension's (and Adafactor's RMS(X), sum(R), RMS(U)) summed
    or max-reduced over the tensor group. So TP2, and dp2 x tp2, == one rank over 10 steps, to the
    summation order of the TP gradients and of those sums (1e-5, the key biases left out, as above);
    memory and bytes (the group's statistics included) as --estimate predicts. Adafactor's TP2
    checkpoint (each rank its cut statistics and its weights, model.bin assembled from them): 5 +
    resume + 5 == 10 bit for bit on the same grid, and one line (exit 1) on another grid."""
    lr = ["--lr", "0.01"]
    out_dir = os.path.join(par, "ckpt_tp2")
    for opt, ranks, grid in (("adafactor", 2, ["--tensor-parallel", 2, "--checkpoint-every", 5, "--out-dir", out_dir]),
                             ("sm3", 2, ["--tensor-parallel", 2]),
                             ("adafactor", 4, ["--tensor-parallel", 2])):
        name = f"{opt} {'dp2 x ' if ranks == 4 else ''}tp2"
        tp, out = r.dump(f"{opt}_tp2_{ranks}", ranks, "--optimizer", opt, *lr, *grid)
        one = ones.get(opt)
        if tp is None or one is None:
            continue
        check_factored_close(f"{name}, 10 steps,", tp, one)
        check_predictions(name, out, ranks)
        if "--checkpoint-every" in grid:
            straight, ckpt = tp, os.path.join(out_dir, "ckpt_00000005")
    files = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
    report(files == ["checksums.txt", "model.bin", "state_rank0.bin", "state_rank1.bin"],
           "adafactor tp2 checkpoint: model.bin (assembled) and each rank's cut statistics and weights", str(files))
    resumed, out = r.dump("adafactor_tp2_resumed", 2, "--optimizer", "adafactor", *lr, "--tensor-parallel", 2, "--resume", ckpt)
    if resumed is not None:
        report(np.array_equal(resumed["params"], straight["params"]) and np.array_equal(resumed["losses"], straight["losses"][5:]),
               "adafactor tp2: 5 steps + checkpoint + resume + 5 == 10 straight, bit for bit", out[-600:])
    code, _, err = r.run(1, "--optimizer", "adafactor", *lr, "--resume", ckpt, steps=6)
    lines = [ln for ln in err.splitlines() if ln.startswith("error:")]
    report(code == 1 and len(lines) == 1 and "same grid only" in lines[0],
           "adafactor: the tp2 checkpoint resumed on 1 rank is refused in one line (exit 1: its cut statistics are not resharded)",
           f"exit {code}: {err[-400:]}")


def main():
    if not os.path.exists(BIN):
        print("FAIL: optimizers: train_gpt_cpu is not built (run make)")
        return 1
    work = tempfile.mkdtemp(prefix="llmc_optim_")
    try:
        tr = Trainer(work)
        W0 = tr.initial_weights()
        report(W0.size == NUM_PARAMS, f"the model's layout as the test sees it: {NUM_PARAMS} parameters",
               f"the trainer has {W0.size}")

        # ---- Adafactor, the paper's defaults (no --lr: relative step), weight decay 0.1
        flags = ["--optimizer", "adafactor"]
        chain, ckpts = tr.chain("adafactor", flags)
        compare_with_reference("adafactor", tr, chain, ckpts, W0, lambda W, G, S, t, decays: adafactor_ref(
            W, G, S, t, min(1e-2, 1 / np.sqrt(t)), 0.1, decays))
        check_adafactor_step1(chain, ckpts)
        check_resume("adafactor", chain, tr.straight("adafactor_straight", flags))

        # ---- Adafactor with --lr: the schedule (5 warm-up steps to 3e-3) in place of rho_t
        flags_lr = ["--optimizer", "adafactor", "--lr", "3e-3", "--lr-schedule", "constant", "--warmup-steps", "5",
                    "--weight-decay", "0"]
        chain_lr, ckpts_lr = tr.chain("adafactor_lr", flags_lr, steps=6)
        compare_with_reference("adafactor --lr 3e-3, 5 warm-up steps", tr, chain_lr, ckpts_lr, W0,
                               lambda W, G, S, t, decays: adafactor_ref(W, G, S, t, 3e-3 * min(t, 5) / 5, 0.0, decays))

        # ---- SM3-II at a warmed-up constant schedule
        flags = ["--optimizer", "sm3", "--lr", "0.05", "--lr-schedule", "constant", "--warmup-steps", "5"]
        chain, ckpts = tr.chain("sm3", flags)
        compare_with_reference("sm3", tr, chain, ckpts, W0, lambda W, G, S, t, decays: sm3_ref(
            W, G, S, 0.05 * min(t, 5) / 5, 0.1, decays))
        check_resume("sm3", chain, tr.straight("sm3_straight", flags))

        # ---- AdamW's t, from the update it made
        check_adamw_t(tr)

        # ---- AdamW with bf16 m and v (--optimizer-state bf16; the rounding itself: build/test_adamw_bf16)
        fp32 = tr.straight("adamw32", ["--lr", "1e-3"])
        bf16 = tr.straight("adamw16", ["--lr", "1e-3", "--optimizer-state", "bf16", "--checkpoint-every", 10])
        moved = np.max(np.abs(fp32["params"].astype(np.float64) - W0))
        apart = np.max(np.abs(bf16["params"].astype(np.float64) - fp32["params"]))
        loss = np.max(np.abs(bf16["losses"].astype(np.float64) - fp32["losses"]) / fp32["losses"])
        report(apart < 0.02 * moved and loss < 1e-4, f"--optimizer-state bf16: 20 AdamW steps within {apart / moved:.1%} of "
               f"fp32 m and v's movement (losses {loss:.1e})", f"{apart / moved:.2%}, losses {loss:.2e}")
        resumed_dump = os.path.join(work, "adamw16_resumed.st")
        tr.run(tr.base("adamw16") + ["--lr", "1e-3", "--optimizer-state", "bf16", "--steps", STEPS, "--resume",
                                      os.path.join(work, "adamw16", "ckpt_00000010"), "--dump-state", resumed_dump])
        resumed = read_safetensors(resumed_dump, names=["params", "losses"])[0]
        report(np.array_equal(resumed["params"], bf16["params"]) and np.array_equal(resumed["losses"], bf16["losses"][10:]),
               "--optimizer-state bf16: 10 steps + resume + 10 == 20 straight, bit for bit (stochastic rounding keyed by "
               "step and element)")

        # ---- memory: --estimate counts the factored state from the shapes
        factored = sum(s[0] + s[1] if len(s) == 2 else s[0] for _, _, s, _ in BLOCKS)
        for opt, want in (("adamw", 8 * NUM_PARAMS), ("adamw --optimizer-state bf16", 4 * NUM_PARAMS),
                          ("adafactor", 4 * factored), ("sm3", 4 * factored)):
            p = tr.run(["--model", MODEL, "--estimate", "--optimizer"] + opt.split() + ["--seq-len", "32"])
            got = [ln for ln in p.stdout.splitlines() if ln.strip().startswith("rank 0:")]
            ok = len(got) == 1 and f"optimizer={want}" in got[0]
            report(ok, f"--estimate --optimizer {opt}: optimizer state {want} bytes "
                   f"({want / NUM_PARAMS:.3f} bytes per parameter)", got[0] if got else p.stdout[-800:])

        # ---- ZeRO-1's per-rank state: whole blocks, cut greedily at (r + 1)/N of the elements
        # (llmc/optim/factored_sharding.h's rule, recomputed here from the shapes)
        for n in (2, 3):
            sizes = [int(np.prod(s)) for _, _, s, _ in BLOCKS]
            want, k, held = [], 0, 0
            for rank in range(n):
                goal, start = sum(sizes) * (rank + 1) // n, k
                while k < len(sizes) and (held < goal or rank == n - 1):
                    held += sizes[k]
                    k += 1
                want.append(4 * sum(s[0] + s[1] if len(s) == 2 else s[0] for _, _, s, _ in BLOCKS[start:k]))
            p = tr.run(["--model", MODEL, "--estimate", "--estimate-ranks", n, "--zero", 1, "--optimizer", "adafactor",
                        "--seq-len", "32"])
            got = [int(x) for x in re.findall(r"^  rank \d+: .*optimizer=(\d+)", p.stdout, re.M)]
            report(got == want and sum(got) == 4 * factored, f"--estimate --zero 1 on {n} ranks: each rank's Adafactor state "
                   f"is its whole blocks' rows + columns {got} bytes, together the whole {4 * factored}", f"got {got}, want {want}")

        # ---- refusals
        p = tr.run(tr.base("sm3") + ["--optimizer", "adamw", "--steps", STEPS + 1, "--resume", "latest"], expect_ok=False)
        check_one_line("resuming an SM3 checkpoint with --optimizer adamw is refused", p, 1,
                       ["--optimizer sm3", "--optimizer adamw"])
        p = tr.run(tr.base("adafactor") + ["--optimizer", "sm3", "--steps", STEPS + 1, "--resume", "latest"], expect_ok=False)
        check_one_line("resuming an Adafactor checkpoint with --optimizer sm3 is refused", p, 1, ["--optimizer adafactor"])
        tr.run(tr.base("adamw") + ["--steps", 1, "--checkpoint-every", 1])
        p = tr.run(tr.base("adamw") + ["--optimizer", "adafactor", "--steps", 2, "--resume", "latest"], expect_ok=False)
        check_one_line("resuming an AdamW checkpoint with --optimizer adafactor is refused", p, 1, ["--optimizer adamw"])
        for flags, words in ((["--optimizer", "lion"], ["adamw, adafactor or sm3", "lion"]),
                             (["--optimizer", "sm3", "--zero", "2"], ["--zero 2", "use --zero 1"]),
                             (["--optimizer", "adafactor", "--pipeline-parallel", "2"], ["--pipeline-parallel 2"]),
                             (["--optimizer", "sm3", "--tensor-parallel", "2", "--zero", "1"], ["--zero 1", "use --zero 0"]),
                             (["--optimizer-state", "fp16"], ["fp32 or bf16", "fp16"]),
                             (["--optimizer", "adafactor", "--beta1", "0.9"], ["--beta1 is AdamW's", "beta1 = 0"]),
                             (["--optimizer", "sm3", "--optimizer-state", "bf16"], ["--optimizer-state bf16", "sm3"])):
            p = tr.run(tr.base("bad") + ["--steps", 1] + flags, expect_ok=False)
            check_one_line(f"{' '.join(flags)} is refused", p, 2, words)
        if os.path.exists(GPU_EMU):
            p = subprocess.run([GPU_EMU, "--optimizer", "sm3", "--zero", "1", "--model", MODEL], capture_output=True, text=True)
            check_one_line("the GPU trainer refuses --optimizer sm3 with --zero 1 (test_gpu_factored.py: the rest)", p, 2,
                           ["--zero 1", "--zero 0"])
            p = subprocess.run([GPU_EMU, "--optimizer-state", "bf16", "--moe-experts", "2", "--model", MODEL], capture_output=True, text=True)
            check_one_line("the GPU trainer refuses --optimizer-state bf16 with --moe-experts (test_gpu_optimizers.py: the rest)",
                           p, 2, ["--moe-experts"])
        else:
            print("SKIP: the GPU trainer's refusal (build/emu/train_gpt is not built: make emu)")

        # ---- data parallelism: 2 ranks == 1 rank accumulating the same micro-batches
        if not shutil.which("mpirun"):
            print("SKIP: data parallelism (mpirun is not installed)")
        else:
            par = os.path.join(work, "par")
            os.makedirs(par)
            rng = np.random.default_rng(0)
            write_shard(os.path.join(par, "train_000.bin"), rng.integers(0, 501, size=16384))
            r = Runner(par)
            # the key biases (qkvb's middle third) have a gradient of exactly 0 in exact arithmetic
            # (softmax ignores a constant added to every score of a row): what the trainer computes
            # there is rounding noise (1e-11 against 0.16 elsewhere), which both optimizers divide by its
            # own size, so it moves them by a full step in a direction set by the summation order.
            # AdamW's eps hides this; Adafactor's eps1 = 1e-30 and SM3's none do not. They are left out
            # of the comparison (and every other weight must agree).
            ones = {}
            for opt in ("adafactor", "sm3"):
                one, _ = r.dump(f"{opt}_one", 1, "--optimizer", opt, "--lr", "0.01")
                ones[opt] = one
                two, out = r.dump(f"{opt}_two", 2, "--optimizer", opt, "--lr", "0.01")
                half, _ = r.dump(f"{opt}_half", 1, "--optimizer", opt, "--lr", "0.01", "--total-batch-tokens", 64)
                if one is None or two is None or half is None:
                    continue
                d_two = check_factored_close(f"{opt}: 2 ranks, 10 steps,", two, one)
                d_half = np.max(np.abs(half["params"].astype(np.float64) - one["params"])[not_key_biases(one["params"].size)])
                report(d_half > 100 * max(d_two, 1e-7), f"{opt}: negative control, half of each step's batch, differs "
                       f"(weights {d_half:.1e})", f"{d_half:.2e}")
                check_predictions(f"{opt} dp2", out, 2)
            check_factored_zero1(r, par)
            check_factored_tensor_parallel(r, par, ones)
            # bf16 m and v on ZeRO-1's shards, and on tp2 and pp2 slices (each element's rounding keyed by its
            # index in the whole model: slice_global_index): the step-10 moments, in the model's order, are one
            # rank's bits wherever the fp32 values before rounding agree
            keep = lambda name: ["--checkpoint-every", 10, "--out-dir", os.path.join(par, name)]  # noqa: E731
            one, _ = r.dump("bf16_one", 1, "--optimizer-state", "bf16", *keep("bf16_one"))
            two, out = r.dump("bf16_zero1", 2, "--optimizer-state", "bf16", "--zero", 1)
            if one is not None and two is not None:
                d_two = np.max(np.abs(two["params"].astype(np.float64) - one["params"]))
                report(d_two <= 5e-5, f"--optimizer-state bf16: dp2 ZeRO-1 == 1 rank (weights {d_two:.1e})", f"{d_two:.2e}")
                check_predictions("bf16 dp2 ZeRO-1", out, 2)
            one_m, one_v = grid_moments(os.path.join(par, "bf16_one", "ckpt_00000010"))
            for name, flags in (("tp2", ["--tensor-parallel", 2]), ("pp2", ["--pipeline-parallel", 2])):
                grid, _ = r.dump(f"bf16_{name}", 2, "--optimizer-state", "bf16", *flags, *keep(f"bf16_{name}"))
                if grid is None or one is None:
                    continue
                d = np.max(np.abs(grid["params"].astype(np.float64) - one["params"]))
                gm, gv = grid_moments(os.path.join(par, f"bf16_{name}", "ckpt_00000010"))
                same = [float(np.mean(a.view(np.uint32) == b.view(np.uint32))) for a, b in ((gm, one_m), (gv, one_v))]
                report(d <= 5e-5 and min(same) >= 0.95, f"--optimizer-state bf16: {name} == 1 rank (weights {d:.1e}), its moments "
                       f"one rank's bits (m {same[0]:.1%}, v {same[1]:.1%} identical)", f"weights {d:.2e}, identical m {same[0]:.1%} v {same[1]:.1%}")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
