#!/usr/bin/env python3
"""Differential test: our trainers against the independent PyTorch GPT-2 in gpt2_reference.py.

What it teaches: how to test a numerical program whose exact output no one can write down. Two
implementations written independently (C++ loops vs torch ops) are run on the same weights and
batch; they may differ only by floating-point rounding, so the test needs an error metric and a
threshold that rounding stays under and real bugs do not.

Fixture (written by gpt2_reference.py into test/fixtures/<config>/, reused while complete):
    model.bin             initial weights, llm.c's fp32 model file (wte padded to Vp, zero rows)
    batch.bin             token shard of exactly B*T+1 tokens: every step trains on the same batch
    expected.safetensors  the reference's results, F32, with the config in __metadata__
The trainer under test runs the config's steps on it (10 tiny, 3 at 124M) and must dump
(--dump-state) a safetensors file with:
    logits  [B, T, V]  first forward, the V real columns only (not Vp)
    loss    [1]        first forward's mean cross-entropy
    grads   [P]        first step's gradient of the mean loss, BEFORE clipping, flat in model-file
                       order including wte's padded rows (which must be exactly 0)
    losses  [steps]    loss of each step; losses[0] is the loss before the first update
    params  [P]        all parameters after the last update, flat in model-file order
expected.safetensors also holds norms [steps] (the pre-clip global gradient norm of each step),
checked against the `norm X` the trainer prints per step, when it prints one.

Error metrics, per tensor (gradients and parameters split into the 16 model tensors):
    logits, grads:  max|ours - ref| / max|ref|               relative to the tensor's own scale
    loss, losses:   |ours - ref|                             absolute, in nats
    params:         max|ours - ref| / max|update|  and  rms(ours - ref) / rms(update),
                    update = ref - initial                   relative to how far training moved it
    wpe rows >= T:  max|ours - ref| / max|update| on the positions the batch never uses
Why relative to the tensor's maximum: fp32 rounding error in a sum is proportional to the size of
the terms summed, not to the result, so an element near zero (a cancelling sum) has a large
relative error that means nothing; the tensor's largest value is the scale the computation works
at, and it keeps the metric meaningful for tensors that are tiny in absolute terms.
Why parameters against the update: after 10 steps at lr 1e-4 a weight has moved ~1e-3 while its
value is 0.02-1.5; relative to the value, a wrong update would vanish. Why two metrics there:
Adam divides the gradient by its own running magnitude, m / (sqrt(v) + 1e-8), so an element whose
gradient is near 1e-8 (noise level for a cancelling sum) gets an update that rounding can change
by several % of lr: the max metric carries that noise (seen up to 5.2e-3) and is kept loose, for
bugs that hit some elements hard (a wrong row, a skipped tail); the rms metric sees through it and
is kept tight, for small errors everywhere. Weight decay moves a weight by lr*wd*|w| = 1e-5 |w|
per step, ~2e-7 for a typical |w| = 0.02: 0.2% of its ~1e-4 update, under the rms threshold
(whose floor the LayerNorm gains set, below), so decay is checked where it acts alone: wpe rows
T..maxT-1 get no gradient, Adam leaves them, and only decay moves them.

Thresholds (fp32), and why:
    logits 1e-4, grads 1e-4, loss 1e-5, losses 2e-5 nats, params max 0.1, params rms 3e-3,
    wpe rows >= T 0.05, printed grad norm 1e-4 relative
fp32 has unit roundoff u = 6e-8. A sum of n terms taken in a different order differs by about
sqrt(n) u relative to the sum of |terms| (n u at worst). The long sums here are C=768 and 4C=3072
(matmuls), B*T=256 (weight gradients) and V=50257 (softmax, and dlnf = dlogits @ wte):
sqrt(50257) u = 1.3e-5, compounded through 12 layers, so 1e-4 leaves room for plain sequential
C++ loops against torch's blocked BLAS. Measured, the fp32 reference against the same training
in float64 (one fp32 code's own rounding noise; two fp32 codes differ by up to about twice that):
                 logits   grads    loss     losses   params max  params rms  wpe>=T   norm
    tiny         3.2e-7   6.1e-7   4.8e-7   4.8e-7   3.3e-3      1.2e-4      4.9e-3   <1e-6
    GPT-2 124M   9.8e-7   1.4e-6   0        2.9e-6   5.2e-3      2.5e-4      4.4e-3   ~1e-6
(both over 10 steps; the 124M fixture now trains 3: the PASS lines print its errors)
The params rms floor is set by LayerNorm gains near 1.5, whose fp32 ulp (1.2e-7) is 1e-3 of a
step's update; the losses floor by the fp32 spacing at loss 11 (9.5e-7): 2e-5 is 20 ulps.
The self-checks verify both directions on the tiny model: fp32 vs float64 passes at 1/5 of every
threshold, and planted bugs fail (GELU with erf, LayerNorm eps 1e-6, no weight decay, decay on
every tensor, beta2 0.999, no clipping).
If grads pass but losses/params fail, look at the gradient-norm sum first: summed in float32 over
124M squares it is ~0.3% off, which alone moved the losses by 1.4e-3 (the printed-norm check
points at it directly).
The key bias (the middle third of qkvb) is compared on its own: its exact gradient is zero (softmax
ignores a constant added to a row of scores), so its reference update is noise that Adam inflates
to up to lr a step; the check bounds that walk, and the q and v biases join the rms comparison.
bf16 thresholds are provisional (not yet calibrated on a GPU; on the CPU emulation of CUDA, which
rounds as the GPU trainer does but not with cuBLASLt's order, the largest errors were 1.1e-2 for
logits and 2e-2 for gradients at 124M, and params rms 4e-2): bf16 keeps 8 mantissa bits
(u = 3.9e-3), so logits/grads 5e-2, loss/losses 5e-2 nats; the params max metric and the decay
check are off (a near-zero gradient whose sign flips moves a weight 2 lr the wrong way; a
decay step of 1e-5 of the weight is far below bf16's resolution) and params rms gets 0.2.

Self-checks of the reference (they can fail): model-file header and layout; save/load round
trip; analytic vs finite-difference gradients in float64; the attention math against a
per-position loop and SDPA (when torch has it); explicit vs torch's fused ops; a hand-written
AdamW + clipping loop against torch.optim.AdamW; the two calibration checks; and the harness
itself, end to end, on a stand-in trainer (test/fake_trainer.py) that must pass every check.

Usage:
    python3 test/test_vs_pytorch.py                       all configs (env LLMC_REFERENCE_CONFIGS=tiny)
    python3 test/test_vs_pytorch.py --configs tiny
    python3 test/test_vs_pytorch.py --compare test/fixtures/tiny DUMP.safetensors [--precision bf16]
"""
import argparse
import contextlib
import functools
import math
import os
import re
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import gpt2_reference as ref  # noqa: E402
from safetensors_io import read_safetensors  # noqa: E402
import checks  # noqa: E402

FIXTURES = os.path.join(HERE, "fixtures")
# steps: the tiny model trains 10 steps (the trajectory: AdamW's moments, bias correction,
# decay and clipping compounding, the calibration's planted bugs); GPT-2 124M proves the same code
# at the real size (V=50257 padded to 50304, C=768, 12 layers, the norm summed over 124M squares)
# in 3 steps: at 10 steps its three runs took about 313 of this file's 324 s in CI (CI's time,
# docs/benchmarks.md)
CONFIGS = {
    "tiny": dict(layers=2, channels=64, heads=4, max_seq_len=64, vocab=512, batch=4, seq_len=32,
                 steps=10),
    "gpt2_124m": dict(layers=12, channels=768, heads=12, max_seq_len=1024, vocab=50257,
                      batch=4, seq_len=64, steps=3),
}
HPARAMS = dict(lr=1e-4, weight_decay=0.1, grad_clip=1.0, seed=1337)
# torch threads for the 124M fixture and the trainers; the tiny model runs 3x faster on one
# thread (its ops are too small to amortise waking a second one)
THREADS = 2


@dataclass
class Tolerances:
    logits: float         # max|d| / max|ref|
    loss: float           # |d|, nats
    grads: float          # per tensor max|d| / max|ref|
    losses: float         # max over steps of |d|, nats
    params_max: float     # per tensor max|d| / max|update|, update = ref - initial (inf: off)
    params_rms: float     # per tensor rms(d) / rms(update)
    decay_only: float     # wpe rows >= T (no gradient, moved by weight decay alone), max/update
    norm_rel: float       # printed grad norm vs reference, relative (plus print rounding)


FP32 = Tolerances(logits=1e-4, loss=1e-5, grads=1e-4, losses=2e-5, params_max=0.1,
                  params_rms=3e-3, decay_only=0.05, norm_rel=1e-4)
BF16 = Tolerances(logits=5e-2, loss=5e-2, grads=5e-2, losses=5e-2, params_max=math.inf,
                  params_rms=0.2, decay_only=math.inf, norm_rel=5e-2)
PRECISIONS = {"fp32": FP32, "bf16": BF16}


def report(name, ok, detail=""):
    """One PASS/FAIL line; detail (the measured error) goes on both."""
    checks.report(ok, name, why=detail, measured=detail)


def skip(name, why):
    print(f"SKIP: {name} ({why})", flush=True)


# ----------------------------------------------------------------------------------------------
# The comparison, shared by the CPU and GPU trainers and by the self-checks.

def max_abs(a):
    return float(np.max(np.abs(a))) if a.size else 0.0


def ratio(error, scale):
    return error / scale if scale > 0 else (0.0 if error == 0 else math.inf)


def relative_error(got, want, scale):
    """max|got - want| / scale, computed in float64; NaN anywhere gives NaN (which fails)."""
    return ratio(max_abs(got.astype(np.float64) - want.astype(np.float64)), scale)


def rms(a):
    return float(np.sqrt(np.mean(np.square(a.astype(np.float64))))) if a.size else 0.0


def compare_states(want, got, config, tol, initial_params):
    """Compare a trainer's state dump with the reference's. want/got: {name: array}.
    Returns [(check name, ok, detail)] without printing, so callers can also expect failures."""
    results = []
    P = ref.num_parameters(config)
    B, T = want["logits"].shape[:2]
    steps = want["losses"].shape[0]
    shapes = {"logits": (B, T, config.vocab_size), "loss": (1,), "grads": (P,),
              "losses": (steps,), "params": (P,)}
    present = {}
    for name, shape in shapes.items():
        if name not in got:
            results.append((f"{name} present", False, f"no tensor '{name}' in the dump"))
        elif tuple(got[name].shape) != shape:
            results.append((f"{name} shape", False,
                            f"shape {list(got[name].shape)}, expected {list(shape)}"))
        else:
            present[name] = got[name]

    def add(name, err, limit, unit="rel"):
        results.append((name, bool(err <= limit), f"{unit} err {err:.2e}, tol {limit:.0e}"))

    if "logits" in present:
        add("logits", relative_error(present["logits"], want["logits"], max_abs(want["logits"])),
            tol.logits)
    if "loss" in present:
        add("loss", max_abs(present["loss"].astype(np.float64) - want["loss"]), tol.loss, "abs")
    if "losses" in present:
        add(f"losses ({steps} steps)",
            max_abs(present["losses"].astype(np.float64) - want["losses"]), tol.losses, "abs")

    padded_rows = config.padded_vocab_size - config.vocab_size
    if "grads" in present:
        got_grads = ref.split_file_order(present["grads"], config)
        want_grads = ref.split_file_order(want["grads"], config)
        for name, _ in ref.parameter_table(config):
            add(f"grad {name}", relative_error(got_grads[name], want_grads[name],
                                               max_abs(want_grads[name])), tol.grads)
        if padded_rows:
            nonzero = int(np.count_nonzero(got_grads["wte"][config.vocab_size:]))
            results.append(("grad wte padded rows are 0", nonzero == 0, f"{nonzero} nonzero"))

    if "params" in present:
        got_params = ref.split_file_order(present["params"], config)
        want_params = ref.split_file_order(want["params"], config)
        start = ref.split_file_order(initial_params, config)
        for name, _ in ref.parameter_table(config):
            update = want_params[name].astype(np.float64) - start[name]
            diff = got_params[name].astype(np.float64) - want_params[name]
            if name == "qkvb":
                # The key bias's exact gradient is zero (softmax ignores a constant added to every
                # score of a row, and q.b_k is one), so its reference "update" is rounding noise that
                # Adam's normalisation blows up to a random walk of up to lr a step: compared alone,
                # it is bounded by that walk, and the query and value biases are compared as the rest.
                C = config.channels
                per_layer = lambda a: a.reshape(-1, 3, C)  # noqa: E731
                moved = got_params[name].astype(np.float64) - start[name]
                key_walk = max_abs(per_layer(moved)[:, 1])
                bound = steps * HPARAMS["lr"] * 1.5
                results.append((f"params {name} key part moves at most ~lr a step (its gradient is 0)",
                                key_walk <= bound, f"max |change| {key_walk:.2e}, bound {bound:.1e}"))
                update = np.delete(per_layer(update), 1, axis=1)
                diff = np.delete(per_layer(diff), 1, axis=1)
            if tol.params_max < math.inf:
                add(f"params {name} max", ratio(max_abs(diff), max_abs(update)), tol.params_max,
                    "max/update")
            add(f"params {name} rms", ratio(rms(diff), rms(update)), tol.params_rms, "rms/update")
        # positions T..maxT-1 never get a gradient, so Adam leaves them alone and only the
        # decoupled weight decay moves them: this isolates decay, which is ~0.3% of an update
        # elsewhere and would hide under the rms threshold
        if T < config.max_seq_len and tol.decay_only < math.inf:
            update = want_params["wpe"][T:].astype(np.float64) - start["wpe"][T:]
            diff = got_params["wpe"][T:].astype(np.float64) - want_params["wpe"][T:]
            add(f"params wpe rows >= T (weight decay only)", ratio(max_abs(diff), max_abs(update)),
                tol.decay_only, "max/update")
        if padded_rows:
            nonzero = int(np.count_nonzero(got_params["wte"][config.vocab_size:]))
            results.append(("params wte padded rows are 0", nonzero == 0, f"{nonzero} nonzero"))
    return results


def read_initial_params(model_path):
    """The flat parameter vector of a model file, file order, padded wte rows included."""
    with open(model_path, "rb") as f:
        f.seek(4 * ref.HEADER_INTS)
        return np.fromfile(f, dtype="<f4")


def config_from_metadata(meta):
    return ref.GPT2Config(max_seq_len=int(meta["max_seq_len"]), vocab_size=int(meta["vocab_size"]),
                          num_layers=int(meta["layers"]), num_heads=int(meta["heads"]),
                          channels=int(meta["channels"]),
                          padded_vocab_size=int(meta["padded_vocab_size"]))


@functools.lru_cache(maxsize=1)
def fixture_expectations(fixture_dir):
    """(expected tensors, metadata, initial parameters) of a fixture, read once: at 124M they are
    1.5 GB, and the CPU and GPU trainers' comparisons share them (nothing here writes to them)."""
    want, meta = read_safetensors(os.path.join(fixture_dir, "expected.safetensors"))
    return want, meta, read_initial_params(os.path.join(fixture_dir, "model.bin"))


def compare_dump_with_fixture(fixture_dir, dump_path, tol):
    """compare_states for a dump file against fixture_dir/expected.safetensors.
    Returns (results, the expected tensors)."""
    want, meta, initial = fixture_expectations(fixture_dir)
    config = config_from_metadata(meta)
    try:
        got, _ = read_safetensors(dump_path)
    except (ValueError, OSError) as e:
        return [("dump readable", False, str(e))], want
    return compare_states(want, got, config, tol, initial), want


def report_results(label, results):
    for name, ok, detail in results:
        report(f"{label} {name}", ok, detail)


STEP_LINE = re.compile(r"step\s+(\d+)\s*/\s*\d+.*?\bnorm\s+([-+0-9.eEnaif]+)")


def compare_printed_norms(stdout, want_norms, tol):
    """The trainer's per-step `norm X` against the reference's pre-clip norms.
    Returns a result, or None if the output has no such lines."""
    printed = {}
    for line in stdout.splitlines():
        match = STEP_LINE.search(line)
        if match:
            printed[int(match.group(1))] = match.group(2)
    if not printed:
        return None
    worst, worst_step = 0.0, None
    for step, text in sorted(printed.items()):
        if not 1 <= step <= want_norms.size:
            continue
        decimals = len(text.split(".")[1]) if "." in text and "e" not in text.lower() else 6
        want = float(want_norms[step - 1])
        allowed = tol.norm_rel * abs(want) + 0.6 * 10.0 ** -decimals   # + the print's rounding
        excess = abs(float(text) - want) / allowed     # NaN printed -> NaN -> fails below
        if not excess <= worst:
            worst, worst_step = excess, step
    return (f"printed grad norms ({len(printed)} steps)", worst <= 1.0,
            f"worst step {worst_step}: error/allowed {worst:.2f}" if worst_step else "all equal")


def run_trainer_and_compare(command_prefix, tag, config_name, fixture_dir, tol, extra_args=(),
                            timeout=None):
    """Run a trainer (command_prefix: [binary] or [python, script]) on a fixture with the
    trainer flags of this project, and compare its dump. tag ('cpu', 'gpu') names the dump
    and output paths; extra_args go after the flags. Returns [(check, ok, detail)]."""
    cfg = CONFIGS[config_name]
    B, T = cfg["batch"], cfg["seq_len"]
    dump = os.path.join(fixture_dir, f"{tag}_state.safetensors")
    out_dir = os.path.join(fixture_dir, f"{tag}_out")
    if os.path.exists(dump):
        os.remove(dump)
    command = [*command_prefix, "--model", os.path.join(fixture_dir, "model.bin"),
               "--train-data", os.path.join(fixture_dir, "batch.bin"), "--val-data", "none",
               "--batch-size", str(B), "--seq-len", str(T), "--total-batch-tokens", str(B * T),
               "--steps", str(cfg["steps"]), "--lr", repr(HPARAMS["lr"]),
               "--lr-schedule", "constant", "--warmup-steps", "0",
               "--weight-decay", repr(HPARAMS["weight_decay"]),
               "--grad-clip", repr(HPARAMS["grad_clip"]), "--val-every", "0",
               "--sample-every", "0", "--checkpoint-every", "0", "--out-dir", out_dir,
               "--dump-state", dump, *extra_args]
    threads = "1" if config_name == "tiny" else str(THREADS)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", threads))
    try:
        proc = subprocess.run(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, errors="replace",
                              timeout=timeout)
    except subprocess.TimeoutExpired:
        return [("trainer runs", False, f"timed out after {timeout} s")]
    if proc.returncode != 0 or not os.path.exists(dump):
        tail = "\n    ".join(proc.stdout.strip().splitlines()[-15:])
        return [("trainer runs", False,
                 f"exit code {proc.returncode}, dump {'present' if os.path.exists(dump) else 'missing'}"
                 f"; command: {' '.join(command)}\n    {tail}")]
    results, want = compare_dump_with_fixture(fixture_dir, dump, tol)
    norms = compare_printed_norms(proc.stdout, want["norms"], tol)
    if norms is None:
        skip(f"{tag}/{config_name} printed grad norms", "no 'step N/M ... norm X' lines in its output")
    return [("trainer runs", True, "")] + results + ([norms] if norms else [])


# ----------------------------------------------------------------------------------------------
# Fixtures.

def ensure_fixture(config_name):
    """Create test/fixtures/<name> with the reference's command line unless already complete."""
    cfg = CONFIGS[config_name]
    out = os.path.join(FIXTURES, config_name)
    command = [sys.executable, os.path.join(HERE, "gpt2_reference.py"), "--out", out,
               "--layers", str(cfg["layers"]), "--channels", str(cfg["channels"]),
               "--heads", str(cfg["heads"]), "--max-seq-len", str(cfg["max_seq_len"]),
               "--vocab", str(cfg["vocab"]), "--batch", str(cfg["batch"]),
               "--seq-len", str(cfg["seq_len"]), "--steps", str(cfg["steps"]),
               "--lr", repr(HPARAMS["lr"]), "--weight-decay", repr(HPARAMS["weight_decay"]),
               "--grad-clip", repr(HPARAMS["grad_clip"]), "--seed", str(HPARAMS["seed"]),
               "--threads", "1" if config_name == "tiny" else str(THREADS)]
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    report(f"fixture {config_name}", proc.returncode == 0,
           proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else proc.stdout[-2000:])
    return out if proc.returncode == 0 else None


def tiny_config(vocab=None):
    cfg = CONFIGS["tiny"]
    return ref.GPT2Config(max_seq_len=cfg["max_seq_len"], vocab_size=vocab or cfg["vocab"],
                          num_layers=cfg["layers"], num_heads=cfg["heads"], channels=cfg["channels"])


def random_model(config, seed=1, dtype=torch.float64, **options):
    model = ref.GPT2(config, **options)
    ref.init_fixture_weights(model, seed)
    return model.to(dtype)


def random_batch(config, B, T, seed=2):
    generator = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, config.vocab_size, (B, T + 1), generator=generator)
    return tokens[:, :-1], tokens[:, 1:]


# ----------------------------------------------------------------------------------------------
# Self-checks of the reference.

def check_save_load_round_trip(tmp_dir):
    # V = 500 pads to Vp = 512, so the padded rows are exercised
    config = tiny_config(vocab=500)
    model = random_model(config, dtype=torch.float32)
    path = os.path.join(tmp_dir, "roundtrip.bin")
    ref.save_model(path, model)
    raw = np.fromfile(path, dtype="<i4", count=ref.HEADER_INTS)
    header_ok = (list(raw[:8]) == [20240326, 3, 64, 500, 2, 4, 64, 512] and not raw[8:].any())
    report("reference: model file header", header_ok, f"header[:8] = {list(raw[:8])}")
    floats = read_initial_params(path)
    C, Vp = config.channels, config.padded_vocab_size
    layout_ok = (floats.size == ref.num_parameters(config)
                 and not floats[500 * C:Vp * C].any()                                # padded rows
                 and np.array_equal(floats[:500 * C], model.wte.detach().numpy().ravel())
                 and np.array_equal(floats[-C:], model.lnfb.detach().numpy()))      # last tensor
    report("reference: model file layout (size, wte padding, lnfb last)", layout_ok)
    loaded = ref.load_model(path)
    tokens, _ = random_batch(config, 2, 16)
    with torch.no_grad():
        same = torch.equal(model(tokens)[0], loaded(tokens)[0])
    report("reference: load(save(model)) gives identical logits", same)


def check_finite_differences():
    """Autograd's gradient vs central differences, float64, two elements of every tensor."""
    torch.manual_seed(0)
    config = tiny_config()
    model = random_model(config)
    inputs, targets = random_batch(config, 2, 16)
    model.zero_grad()
    model(inputs, targets)[1].backward()
    step = 1e-5
    worst, worst_at = 0.0, ""
    generator = torch.Generator().manual_seed(3)
    for name, param in model.named_parameters():
        grad = param.grad.reshape(-1)
        flat = param.data.view(-1)
        picks = [int(grad.abs().argmax()), int(torch.randint(flat.numel(), (1,), generator=generator))]
        for index in picks:
            original = float(flat[index])
            with torch.no_grad():
                flat[index] = original + step
                up = model(inputs, targets)[1].item()
                flat[index] = original - step
                down = model(inputs, targets)[1].item()
                flat[index] = original
            numeric = (up - down) / (2 * step)
            # error relative to the tensor's largest gradient, as the trainer comparison does
            err = abs(numeric - float(grad[index])) / float(grad.abs().max())
            if err > worst:
                worst, worst_at = err, f"{name}[{index}]"
    report("reference: gradients vs finite differences (float64, 32 elements)", worst < 1e-6,
           f"worst rel err {worst:.1e} at {worst_at}, tol 1e-06")


def check_attention():
    generator = torch.Generator().manual_seed(4)
    B, NH, T, hs = 2, 3, 9, 8
    q, k, v = (torch.randn(B, NH, T, hs, generator=generator, dtype=torch.float64) for _ in range(3))
    manual = ref.causal_attention(q, k, v)
    loop = torch.empty_like(manual)
    for t in range(T):                 # position t: softmax over keys 0..t, nothing after
        weights = torch.softmax((q[:, :, t:t + 1] @ k[:, :, :t + 1].transpose(-2, -1)) / math.sqrt(hs), -1)
        loop[:, :, t] = (weights @ v[:, :, :t + 1])[:, :, 0]
    err = float((manual - loop).abs().max())
    report("reference: attention equals a per-position loop (float64)", err < 1e-12, f"err {err:.1e}")
    if not hasattr(F, "scaled_dot_product_attention"):
        skip("reference: attention equals F.scaled_dot_product_attention (float64)",
             f"torch {torch.__version__} has no SDPA")
    else:
        err = float((manual - F.scaled_dot_product_attention(q, k, v, is_causal=True)).abs().max())
        report("reference: attention equals F.scaled_dot_product_attention (float64)", err < 1e-12,
               f"err {err:.1e}")


def check_fused_ops():
    """The explicit layer norm / GELU / cross-entropy against torch's own kernels, whole model."""
    config = tiny_config()
    inputs, targets = random_batch(config, 2, 16)
    explicit = random_model(config)
    fused = random_model(config, use_fused_ops=True)
    with torch.no_grad():
        logits_a, loss_a = explicit(inputs, targets)
        logits_b, loss_b = fused(inputs, targets)
    err = max(float((logits_a - logits_b).abs().max()), abs(loss_a.item() - loss_b.item()))
    report("reference: explicit ops equal torch's fused ops (float64 logits, loss)", err < 1e-12,
           f"err {err:.1e}")


def check_adamw_by_hand():
    """torch.optim.AdamW + clip_grad_norm_ against the update written out, 3 steps, float64.
    lr 1e-2 and a clip that binds make decay, clipping and bias correction all visible."""
    config = tiny_config()
    inputs, targets = random_batch(config, 2, 16)
    lr, weight_decay, clip, steps = 1e-2, 0.1, 0.05, 3
    (beta1, beta2), eps = ref.ADAM_BETAS, ref.ADAM_EPS

    by_torch = random_model(config)
    ref.train(by_torch, inputs, targets, steps, lr, weight_decay, clip)

    by_hand = random_model(config)
    params = dict(by_hand.named_parameters())
    m = {n: torch.zeros_like(p) for n, p in params.items()}
    v = {n: torch.zeros_like(p) for n, p in params.items()}
    clipped_steps = 0
    for t in range(1, steps + 1):
        by_hand.zero_grad()
        by_hand(inputs, targets)[1].backward()
        norm = math.sqrt(sum(float((p.grad ** 2).sum()) for p in params.values()))
        scale = min(1.0, clip / (norm + 1e-6))
        clipped_steps += scale < 1.0
        with torch.no_grad():
            for n, p in params.items():
                g = p.grad * scale
                m[n] = beta1 * m[n] + (1 - beta1) * g
                v[n] = beta2 * v[n] + (1 - beta2) * g * g
                if n in ref.WEIGHT_DECAY_PARAMS:
                    p -= lr * weight_decay * p
                p -= lr / (1 - beta1 ** t) * m[n] / (v[n].sqrt() / math.sqrt(1 - beta2 ** t) + eps)
    torch_params = dict(by_torch.named_parameters())
    err = max(float((torch_params[n] - p).abs().max()) for n, p in params.items())
    report("reference: torch AdamW + clipping equals the update by hand (float64, 3 steps)",
           err < 1e-12 and clipped_steps == steps, f"max abs err {err:.1e}, clip bound on "
           f"{clipped_steps}/{steps} steps")


@contextlib.contextmanager
def patched(name, value):
    """Temporarily replace gpt2_reference.<name> (the module reads these at call time)."""
    original = getattr(ref, name)
    setattr(ref, name, value)
    try:
        yield
    finally:
        setattr(ref, name, original)


def train_on_fixture(fixture_dir, dtype):
    want, meta = read_safetensors(os.path.join(fixture_dir, "expected.safetensors"))
    model = ref.load_model(os.path.join(fixture_dir, "model.bin")).to(dtype)
    tokens = ref.read_token_shard(os.path.join(fixture_dir, "batch.bin"))
    inputs, targets = ref.batch_from_tokens(tokens, int(meta["batch_size"]), int(meta["seq_len"]))
    got = ref.train(model, inputs, targets, int(meta["steps"]), float(meta["lr"]),
                    float(meta["weight_decay"]), float(meta["grad_clip"]))
    return want, got, config_from_metadata(meta)


def check_tolerance_calibration(fixture_dir):
    """The fp32 thresholds must (a) pass fp32 rounding noise with room to spare and (b) fail
    small real bugs. (a): the fixture (fp32) against the same run in float64, at 1/5 of every
    threshold. (b): the fixture against runs of the reference with a planted bug."""
    initial = read_initial_params(os.path.join(fixture_dir, "model.bin"))
    want, got, config = train_on_fixture(fixture_dir, torch.float64)
    fifth = Tolerances(**{k: (v / 5 if isinstance(v, float) else v) for k, v in vars(FP32).items()})
    failed = [f"{n} ({d})" for n, ok, d in compare_states(want, got, config, fifth, initial) if not ok]
    report("calibration: fp32 vs float64 passes at 1/5 of the fp32 thresholds", not failed,
           "; ".join(failed))

    def gelu_erf(x):
        return 0.5 * x * (1.0 + torch.erf(x / math.sqrt(2.0)))

    def measure_norm_only(params, max_norm):
        return clip_by_global_norm(params, 0.0)

    clip_by_global_norm = ref.clip_by_global_norm
    every_tensor = tuple(name for name, _ in ref.parameter_table(config))
    bugs = [("GELU with erf instead of tanh", "gelu_tanh", gelu_erf),
            ("LayerNorm eps 1e-6", "LAYERNORM_EPS", 1e-6),
            ("no weight decay", "WEIGHT_DECAY_PARAMS", ()),
            ("weight decay on every tensor", "WEIGHT_DECAY_PARAMS", every_tensor),
            ("beta2 0.999 instead of 0.95", "ADAM_BETAS", (0.9, 0.999)),
            ("no gradient clipping", "clip_by_global_norm", measure_norm_only)]
    for description, name, value in bugs:
        with patched(name, value):
            _, buggy, _ = train_on_fixture(fixture_dir, torch.float32)
        caught = [n for n, ok, _ in compare_states(want, buggy, config, FP32, initial) if not ok]
        report(f"calibration: planted bug '{description}' is detected", bool(caught),
               f"failing checks: {', '.join(caught[:4])}{' ...' if len(caught) > 4 else ''}"
               if caught else "no check failed")


def check_harness_with_fake_trainer(fixture_dir):
    """The whole trainer path (flags, dump, printed norms) on a stand-in trainer that is right:
    the reference in float64. Every check must pass, or the harness is what is broken."""
    command = [sys.executable, os.path.join(HERE, "fake_trainer.py")]
    results = run_trainer_and_compare(command, "fake", "tiny", fixture_dir, FP32, timeout=300)
    failed = [f"{n}: {d}" for n, ok, d in results if not ok]
    checked_norms = any(n.startswith("printed grad norms") for n, _, _ in results)
    report(f"harness: a correct stand-in trainer passes all {len(results)} checks",
           not failed and checked_norms and len(results) > 30,
           "; ".join(failed) if failed else f"{len(results)} checks, norms checked: {checked_norms}")


# ----------------------------------------------------------------------------------------------

def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--configs", default=os.environ.get("LLMC_REFERENCE_CONFIGS",
                                                            ",".join(CONFIGS)),
                        help="comma-separated subset of: " + ", ".join(CONFIGS))
    parser.add_argument("--compare", nargs=2, metavar=("FIXTURE_DIR", "DUMP"),
                        help="only compare an existing state dump with a fixture")
    parser.add_argument("--precision", choices=PRECISIONS, default="fp32",
                        help="tolerances for --compare")
    parser.add_argument("--timeout", type=int,
                        default=int(os.environ.get("LLMC_TRAINER_TIMEOUT", "1800")),
                        help="seconds a trainer run may take")
    args = parser.parse_args()
    torch.set_num_threads(1)       # in-process work is on the tiny model, or numpy

    if args.compare:
        results, _ = compare_dump_with_fixture(args.compare[0], args.compare[1],
                                               PRECISIONS[args.precision])
        report_results("compare", results)
        sys.exit(checks.exit_code())

    names = [n.strip() for n in args.configs.split(",") if n.strip()]
    unknown = [n for n in names if n not in CONFIGS]
    if unknown:
        parser.error(f"unknown config(s) {unknown}")

    os.makedirs(FIXTURES, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp_dir:
        check_save_load_round_trip(tmp_dir)
    check_finite_differences()
    check_attention()
    check_fused_ops()
    check_adamw_by_hand()

    cpu_trainer = os.path.join(ROOT, "train_gpt_cpu")
    # the GPU trainer on the GPU, or without one on the CPU emulation of CUDA (test/emu/), where
    # cuDNN's attention is not emulated and the simple attention stands in
    sys.path.insert(0, HERE)
    from test_gpu import gpu_target  # noqa: E402
    mode, gpu_trainer, _ = gpu_target()
    gpu_flags = ["--attention", "simple"] if mode == "emulated" else []
    has_cpu = os.access(cpu_trainer, os.X_OK)
    has_gpu = mode is not None
    if mode == "emulated":
        print(f"the gpu/ checks run on the CPU emulation of CUDA: {gpu_trainer}", flush=True)
    for name in names:
        # the tiny fixture is always made (it calibrates the tolerances); a big one only when a
        # trainer is there to use it, since it costs minutes and 1.5 GB
        if name != "tiny" and not (has_cpu or has_gpu):
            skip(f"fixture {name}", "no trainer built to compare")
            skip(f"cpu/{name}", "train_gpt_cpu not built")
            skip(f"gpu/{name}", "train_gpt not built or no GPU")
            continue
        fixture_dir = ensure_fixture(name)
        if fixture_dir is None:
            continue
        if name == "tiny":
            check_tolerance_calibration(fixture_dir)
            check_harness_with_fake_trainer(fixture_dir)
        if has_cpu:
            report_results(f"cpu/{name}", run_trainer_and_compare(
                [cpu_trainer], "cpu", name, fixture_dir, FP32, timeout=args.timeout))
        else:
            skip(f"cpu/{name}", "train_gpt_cpu not built")
        if has_gpu:
            report_results(f"gpu/{name}", run_trainer_and_compare(
                [gpu_trainer], "gpu", name, fixture_dir, BF16, gpu_flags, timeout=args.timeout))
        else:
            skip(f"gpu/{name}", gpu_trainer)
    sys.exit(checks.exit_code())


if __name__ == "__main__":
    main()
