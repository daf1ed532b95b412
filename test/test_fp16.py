#!/usr/bin/env python3
"""test_fp16.py — the fp16 build of the GPU trainer (./train_gpt_fp16, or build/emu/train_gpt_fp16 on the
CPU emulation of CUDA) and its dynamic loss scaling (llmc/optim/loss_scaler.h; Micikevicius et al.
2018). Tiny model (L=2 C=128 H=2 T=64 V=500), a few steps, every run under mpirun:

  fp16 vs cpu      10 AdamW steps against the fp32 CPU reference: logits, loss, every gradient
                   tensor (the dump divides S out), the losses and the weight change, within the
                   fp16 error model below. Control: the bf16 build's logits error is above the fp16
                   limit (the limit tells fp16 from bf16). The same at --recompute 0, whose GELU
                   runs in cuBLASLt's epilogues (GELU_AUX_BIAS, DGELU_BGRAD).
  S invariance     no overflow: --loss-scale-init 2^18 and 2^19 give bit-identical step-1 gradients,
                   losses and master weights after 4 steps (S is a power of two: scaling the seed
                   moves exponents only, and the norm and AdamW divide it out exactly), as long as
                   no stored gradient falls below fp16's normal range (2^-14) in either run. All but
                   one tensor's: the key biases' gradient is zero in exact arithmetic (a key bias
                   adds the same q.b to every score of a row, which the softmax ignores) and
                   rounding noise of ~1e-9 here, subnormal at any S that does not overflow
                   elsewhere, and AdamW turns noise into +-lr steps: those may differ. Below 2^18
                   other gradients of this model underflow (at 2^16 vs 2^17, 6 elements of the step-1
                   gradient differ), above 2^19 some overflow. Control: S = 1 gives other weights
                   than the default 65536 (fp16 flushes the small gradients that S lifts).
  overflow skip    2 data-parallel ranks, and 2 tensor-parallel ranks; LLMC_TEST_GRAD_INF=1:2
                   (llmc/probes/fault_injection.h) makes rank 1's first gradient element inf at step
                   2, as an overflow in its backward would. With data parallelism the gradient sum
                   carries the inf to rank 0; with tensor parallelism that element (a row of rank 1's
                   vocabulary shard) is rank 1's alone, and only the all-reduced norm tells rank 0
                   (ColossalAI's bug: a flag reduced over too few ranks). Every batch is the same (a
                   shard with period B*T) and the learning rate constant, so: the 3-step run with the
                   overflow equals the clean 2-step run bit for bit but for the key biases (step 2
                   touched neither weights nor moments, and AdamW's t held at 1, so step 3 is the
                   clean run's step 2; S = 2^18, then 2^17); step 3's loss equals step 2's; the run
                   says it skipped and step 3 runs at S/2.
                   The bf16 build, where the inf is a bad step (llmc/run/step.h), holds t the same way
                   (2 data-parallel ranks; before, its t counted the skipped step).
  resume           --loss-scale-init 1024 --loss-scale-window 3, 12 steps (S doubles 4 times):
                   12 straight == 6 + resume + 6, bit for bit: weights, losses, the S of each step
                   line, and the step-12 state.bin (where S, its clean steps and the skipped steps
                   are kept: docs/formats.md).
  real overflow    --loss-scale-init 2^24: the backward overflows fp16 by itself; the first steps
                   are skipped, S halving each time, until it fits (2^19 here), then they apply.
  flags            --loss-scale-init 3 and --loss-scale-window 0 are refused in one line (exit 2);
                   the loss-scale flags are refused by the bf16 build and the CPU trainer.

The fp16 error model: test/bf16_error_model.py --fp16 runs the same model in PyTorch, once in fp32
and once rounding to fp16 wherever the trainer stores a tensor (the gradients S = 65536 times
larger, as the trainer stores them). For this model and 10 steps it gives: logits 6.8e-4, every
gradient tensor 3.3e-4 to 8.3e-4 (cosine 1.000000), the loss 5e-6, the steps' losses 5e-5, the
weight change 0.009 -- 8x (2^3: fp16's 3 more mantissa bits) below bf16's 5.4e-3 / 5.7e-3 / 0.023.
The limits leave 5-8x for what the model leaves out (the libraries' summation orders, stochastic
rounding of the weights): logits 4e-3, gradients 6e-3 with cosine >= 0.99995, loss 2e-3, losses
5e-3, weight change 0.06.

Planted bugs, each caught (by hand, once; see the commit): the gradients unscaled after the
clipping (the clip compares S |g| with 1.0) fails "S invariance" and "fp16 vs cpu"; the overflow
flag taken from the rank's own norm instead of the all-reduced one fails "overflow skip"; S not
saved in the checkpoint fails "resume".
"""
import os, re, shutil, subprocess, sys, tempfile
from checks import report, exit_code
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_gpu import MODE, GPU, ROOT, compare_dumps, tiny_precision_fixture, write_shard  # noqa: E402
from test_gpu_data_parallel import CPU, Runner  # noqa: E402

FP16 = os.path.join(ROOT, "train_gpt_fp16") if MODE == "gpu" else os.path.join(ROOT, "build", "emu", "train_gpt_fp16")
FP16_TOL = dict(logits=4e-3, loss=2e-3, grads=6e-3, cosine=0.99995, losses=5e-3, update=0.06)
CHECKS = ["fp16 vs cpu", "S invariance", "overflow skip", "resume", "real overflow", "flags"]


def scales(out):
    """The S of each step line, in order ("| scale 1024 |")."""
    return re.findall(r"^step +\d+/\d+ .*\| scale (\S+) \|", out, re.M)


def fp16_vs_cpu(r, model):
    flags = ("--batch-size", 4)
    got, out = r.dump("fp16", 1, *flags, exe=FP16)
    ref, _ = r.dump("cpu", 1, *flags, exe=CPU)
    report("precision: fp16" in out and "attention: simple" in out and scales(out) == ["65536"] * 10,
           "the fp16 build says so, uses the simple attention and shows S = 65536 on every step line", out[-1500:])
    compare_dumps("fp16 vs cpu (tiny, 10 steps)", got, ref, model, FP16_TOL)
    # --recompute 0: the MLP's GELU in cuBLASLt's epilogues (llmc/kernels/gelu.cuh), on fp16 values
    rc0, _ = r.dump("fp16_rc0", 1, *flags, "--recompute", 0, exe=FP16)
    compare_dumps("fp16 --recompute 0 (GELU in cuBLASLt's epilogues) vs cpu (tiny, 10 steps)", rc0, ref, model, FP16_TOL)
    if os.path.exists(GPU):  # control: bf16's rounding is 8x coarser, beyond the fp16 limits
        bf16, _ = r.dump("bf16", 1, *flags, exe=GPU)
        a, b = np.asarray(bf16["logits"], np.float64).ravel(), np.asarray(ref["logits"], np.float64).ravel()
        e = np.linalg.norm(a - b) / np.linalg.norm(b)
        report(e > FP16_TOL["logits"], f"control: the bf16 build's logits error {e:.2e} is beyond the fp16 limit "
               f"{FP16_TOL['logits']}", "the fp16 limit would not tell fp16 from bf16")
    return got


def key_bias_mask(model):
    """The key biases (qkvb's middle third in each layer): their gradient is rounding noise (see above)."""
    _, names, off = model
    C, L, q = 128, 2, off[names.index("qkvb")]
    mask = np.zeros(off[-1], bool)
    for layer in range(L):
        mask[q + layer * 3 * C + C: q + layer * 3 * C + 2 * C] = True
    return mask


def s_invariance(r, model, default):
    flags = ("--batch-size", 4, "--steps", 4)
    small, _ = r.dump("s2e18", 1, *flags, "--loss-scale-init", 2 ** 18, exe=FP16)
    large, _ = r.dump("s2e19", 1, *flags, "--loss-scale-init", 2 ** 19, exe=FP16)
    key_bias = key_bias_mask(model)
    differ = small["params"] != large["params"]
    report(np.array_equal(small["grads"], large["grads"]) and np.array_equal(small["losses"], large["losses"]) and
           not np.any(differ & ~key_bias), "no overflow: S = 2^18 and 2^19 give bit-identical step-1 gradients, losses and "
           f"master weights (all but the key biases: {int(np.sum(differ & key_bias))} of {int(key_bias.sum())} differ)",
           f"{int(np.sum(differ & ~key_bias))} other weights differ; losses {small['losses']} vs {large['losses']}")
    one, _ = r.dump("s1", 1, "--batch-size", 4, "--loss-scale-init", 1, exe=FP16)
    report(not np.array_equal(one["params"], default["params"]),
           "control: S = 1 gives other weights than S = 65536 (fp16 flushes the small gradients that S lifts)")


def overflow_skip(r, model, work):
    # every micro-batch the same: a shard whose period is one rank's micro-batch (B*T = 2*64 tokens)
    base = np.random.default_rng(7).integers(0, 500, 128)
    write_shard(os.path.join(work, "same_000000.bin"), np.tile(base, 64))
    # S = 2^18, halved to 2^17 by the overflow (2^19 overflows at step 2 in this run)
    flags = ("--train-data", os.path.join(work, "same_*.bin"), "--batch-size", 2, "--lr-schedule", "constant",
             "--warmup-steps", 0, "--loss-scale-init", 2 ** 18)
    for name, grid in [("2 data-parallel ranks", ()), ("2 tensor-parallel ranks", ("--tensor-parallel", 2))]:
        clean, _ = r.dump("clean2", 2, *flags, *grid, "--steps", 2, exe=FP16)
        skipped, out = r.dump("inf3", 2, *flags, *grid, "--steps", 3, exe=FP16, env={"LLMC_TEST_GRAD_INF": "1:2"})
        report("step 2: the fp16 gradients overflowed at loss scale 262144: update skipped, the scale halved to 131072" in out
               and scales(out) == ["262144", "262144", "131072"],
               f"{name}: an inf on rank 1 at step 2: the run says it skipped, S halves", out[-1200:])
        # step n's loss is the forward of the weights after step n-1
        report(skipped["losses"][2] == skipped["losses"][1], f"{name}: the skipped step left the weights: step 3's loss "
               "== step 2's (the same batch)", f"losses {skipped['losses']}")
        differ = (skipped["params"] != clean["params"]) & ~key_bias_mask(model)
        report(not np.any(differ) and skipped["losses"][2] == clean["losses"][1],
               f"{name}: every rank skipped, and AdamW's t held: 3 steps with step 2 skipped == 2 clean steps, bit for "
               "bit (all but the key biases)", f"{int(differ.sum())} weights differ; losses {skipped['losses']} vs "
               f"{clean['losses']}")
    # the bf16 build: there an inf makes a bad step (llmc/run/step.h's step_is_sound), and AdamW's t holds the same way
    bf16_flags = flags[:-2]  # (no loss scaler)
    clean, _ = r.dump("bf16_clean2", 2, *bf16_flags, "--steps", 2, exe=GPU)
    skipped, out = r.dump("bf16_inf3", 2, *bf16_flags, "--steps", 3, exe=GPU, env={"LLMC_TEST_GRAD_INF": "1:2"})
    differ = (skipped["params"] != clean["params"]) & ~key_bias_mask(model)
    report("update skipped" in out and not np.any(differ) and skipped["losses"][2] == clean["losses"][1],
           "bf16 build, 2 data-parallel ranks, an inf at step 2: skipped, and AdamW's t held: 3 steps == 2 clean steps, bit "
           "for bit (all but the key biases)", f"{int(differ.sum())} weights differ; losses {skipped['losses']} vs "
           f"{clean['losses']}\n{out[-600:]}")


def real_overflow(r):
    """Not injected: S = 2^24 overflows fp16 in this model's backward; S halves each step until it fits."""
    run, out = r.dump("s2e24", 1, "--batch-size", 4, "--steps", 8, "--loss-scale-init", 2 ** 24, exe=FP16)
    s = [int(x) for x in scales(out)]
    skips = out.count("fp16 gradients overflowed")
    report(skips >= 1 and s[skips] == 2 ** 24 >> skips and all(x == s[skips] for x in s[skips:]) and
           all(s[k] == 2 ** 24 >> k for k in range(skips)) and np.all(np.isfinite(run["params"])) and
           skips < len(s), f"a real overflow at S = 2^24: {skips} steps skipped, S halved each time to 2^{s[-1].bit_length() - 1}, "
           "then the steps apply", out[-1500:])


def resume(r, work):
    flags = ("--batch-size", 4, "--steps", 12, "--loss-scale-init", 1024, "--loss-scale-window", 3, "--checkpoint-every", 6)
    a, b = os.path.join(work, "run_a"), os.path.join(work, "run_b")
    straight, out_a = r.dump("straight", 1, *flags, "--out-dir", a, exe=FP16)
    shutil.copytree(os.path.join(a, "ckpt_00000006"), os.path.join(b, "ckpt_00000006"))
    resumed, out_b = r.dump("resumed", 1, *flags, "--out-dir", b, "--resume", "latest", exe=FP16)
    want = ["1024", "1024", "1024", "2048", "2048", "2048", "4096", "4096", "4096", "8192", "8192", "8192"]
    report(scales(out_a) == want, "S doubles every 3 clean steps (--loss-scale-window 3)", str(scales(out_a)))
    state = [os.path.join(d, "ckpt_00000012", "state.bin") for d in (a, b)]
    same = {"weights": np.array_equal(straight["params"], resumed["params"]),
            "losses": np.array_equal(straight["losses"][6:], resumed["losses"]),
            "S": scales(out_b) == scales(out_a)[6:],
            "state.bin": all(os.path.exists(s) for s in state) and open(state[0], "rb").read() == open(state[1], "rb").read()}
    report(all(same.values()), "resume with the loss scaler is bit-exact (12 steps == 6 + resume + 6)",
           f"differ: {[k for k, v in same.items() if not v]}; S {scales(out_b)} vs {scales(out_a)[6:]}")


def flags():
    model = ["--model", "L=2,C=64,H=4,T=64"]
    cases = [(FP16, ["--loss-scale-init", "3"], "power of two"), (FP16, ["--loss-scale-window", "-1"], "window"),
             (GPU, ["--loss-scale-init", "1024"], "./train_gpt_fp16"), (CPU, ["--loss-scale-window", "100"], "--loss-scale-window"),
             (GPU, ["--precision", "fp16"], "./train_gpt_fp16"), (CPU, ["--precision", "fp16"], "./train_gpt_fp16")]
    for exe, args, needle in cases:
        if not os.path.exists(exe):
            continue
        p = subprocess.run([exe] + model + args, capture_output=True, text=True)
        lines = p.stderr.strip().splitlines()
        report(p.returncode == 2 and len(lines) == 1 and needle in lines[0],
               f"{os.path.basename(exe)} {' '.join(args)}: one line, exit 2", p.stderr[-500:])
    p = subprocess.run([FP16] + model + ["--precision", "fp16", "--estimate"], capture_output=True, text=True)
    report(p.returncode == 0, "train_gpt_fp16 --precision fp16 (its own) is accepted", p.stderr[-500:])


def main():
    if MODE is None or not os.path.exists(FP16) or not shutil.which("mpirun"):
        for name in CHECKS:
            print(f"SKIP: {name} (needs mpirun and {FP16}: make {'train_gpt_fp16' if MODE == 'gpu' else 'emu'})")
        return exit_code()
    work = tempfile.mkdtemp(prefix="llmc_fp16_")
    try:
        init, names, off = tiny_precision_fixture(work)
        r = Runner(work)
        for name, fn, args in [("flags", flags, ())]:
            fn(*args)
        default = None
        try:
            default = fp16_vs_cpu(r, (init, names, off))
        except RuntimeError as e:
            report(False, "fp16 vs cpu", str(e)[-2000:])
        for name, fn, args in [("S invariance", s_invariance, (r, (init, names, off), default)), ("overflow skip", overflow_skip, (r, (init, names, off), work)),
                               ("resume", resume, (r, work)), ("real overflow", real_overflow, (r,))]:
            try:
                if default is None and name == "S invariance":
                    raise RuntimeError("the default-S run failed")
                fn(*args)
            except (RuntimeError, OSError) as e:
                report(False, name, f"{type(e).__name__}: {e}"[-2000:])
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
