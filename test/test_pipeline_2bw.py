#!/usr/bin/env python3
"""test_pipeline_2bw.py — PipeDream-2BW trained by the CPU trainer: the one-step-delayed rule, its memory, its resume.

PipeDream-2BW (llmc/parallel/pipedream_2bw.h) keeps two weight versions per stage and takes the
gradient of step t+1 on the older one: W(t+1) = W(t) - lr * AdamW(grad f(W(t-1))), W(-1) = W(0).
It runs 1F1B's list (the no-flush overlap across steps is not built). The model and data are
test_parallelism.py's (L=4 C=64 H=4 T=32 V=501, B=1, lr 1e-3 cosine to 0 at the last step).

It is not a synchronous run, by design, so the references are:
  - the rule itself, from runs that share no 2BW code (the synchronous 1F1B trainer): step 1 is the
    synchronous step (both versions W(0)); step 2's loss is f(W(0), batch 2), which a 1F1B run at
    --lr 0 computes; step 3's is f(W(1), batch 3), W(1) being the synchronous W(1): a 1F1B run of one
    step, checkpointed, resumed at --lr 0, computes it. All bit for bit (same grid, same arithmetic).
    And 2BW must differ from 1F1B from step 2 on (losses and weights): it is not synchronous;
  - the one-rank run of the same rule (--pipeline-schedule 2bw on one rank: no pipeline code runs,
    no message is sent), against 2 and 4 stages with m = p and 2p, and dp2 x pp2 with ZeRO-1 (each
    data-parallel rank updates its shard of W(t), then shares it), over 6 AdamW steps: the same bits
    as 1F1B's pipelines give against one rank (test_parallelism compares them within its tolerances,
    check_close, the tied embedding's gradient being added in another order), and the 4-stage run
    equals the 2-stage one bit for bit (the schedule changes when a layer computes, not what);
  - memory: every rank holds what its size table says (older_weights included, check_predictions),
    and --estimate's params per rank are exactly 1F1B's twice (the stage's weights and, on the last
    stage, its copy of the tied embedding);
  - resume: 3 steps + checkpoint + 3 resumed == 6 straight bit for bit (the older version is in
    each rank's pipedream_2bw_rank<r>.bin); a 2BW resume from a 1F1B checkpoint is refused.
Bad input (one line, exit 2, before anything is allocated): 2BW with ZeRO-2/3, with tensor
parallelism, with m < p, and on the GPU trainer (the emulated build, when it is built).
Planted bugs caught (by hand, then reverted):
  - the gradient on W(t) instead of W(t-1) (pipedream_2bw_before_passes returning at once): the rule's
    checks of steps 2 and 3 and "differs from 1F1B" failed (the one-rank comparisons still passed:
    they share that code, which is why the rule is checked against 1F1B runs);
  - the resume losing the older version (pipedream_2bw_load returning before reading, so both
    versions restart at W(3)): the resume check failed.
"""
import os, re, shutil, subprocess, sys, tempfile
from checks import report, exit_code
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from test_parallelism import (Runner, mpi_trainer_missing, MODEL, T, TRAINER, check_bitwise, check_close,  # noqa: E402
                              check_predictions, write_pattern_shard)

STEPS = 6
GPU_TRAINER = os.path.join(ROOT, "build", "emu", "train_gpt")


def pipe(p, m, schedule="2bw"):
    return ["--pipeline-parallel", p, "--pipeline-schedule", schedule, "--total-batch-tokens", m * T]


def params_per_rank(work, schedule, p, m):
    """Each rank's bytes of kind params as --estimate predicts them."""
    out = subprocess.run([TRAINER, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--estimate"] +
                         [str(f) for f in pipe(p, m, schedule)], capture_output=True, text=True, cwd=work).stdout
    return [int(x) for x in re.findall(r"^  rank \d+: params=(\d+)", out, re.M)]


def refused(cmd, needle, name, work):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.strip()]
    report(p.returncode == 2 and len(lines) == 1 and needle in lines[0], f"{name}: exit 2, one line naming it",
           f"exit {p.returncode}: {lines[:3]}")


def main():
    if mpi_trainer_missing("PipeDream-2BW"):
        return 0
    work = tempfile.mkdtemp(prefix="llmc_2bw_")
    try:
        write_pattern_shard(work)
        r = Runner(work)

        # ---- the rule, against runs of the synchronous trainer (no 2BW code in them)
        two, _ = r.dump("pp2_m4_2bw", 2, *pipe(2, 4), steps=STEPS)
        sync, _ = r.dump("pp2_m4_1f1b", 2, *pipe(2, 4, "1f1b"), steps=STEPS)
        frozen, _ = r.dump("pp2_m4_1f1b_lr0", 2, *pipe(2, 4, "1f1b"), "--lr", 0, steps=3)
        # (the 6-step run's W(1): the cosine schedule's lr at step 1 depends on --steps)
        r.run(2, *pipe(2, 4, "1f1b"), "--checkpoint-every", 1, steps=STEPS)
        one_step = os.path.join(work, "out", "ckpt_00000001")
        at_w1, out_w1 = r.dump("pp2_m4_1f1b_from_w1_lr0", 2, *pipe(2, 4, "1f1b"), "--resume", one_step, "--lr", 0, steps=3)
        if all(x is not None for x in (two, sync, frozen, at_w1)):
            L = two["losses"]
            report(L[0] == sync["losses"][0] and np.array_equal(two["grads"], sync["grads"]),
                   "2BW step 1 == 1F1B step 1 bit for bit (loss and gradient: W(-1) = W(0))", f"{L[0]} vs {sync['losses'][0]}")
            report(L[1] == frozen["losses"][1], f"2BW step 2's loss is f(W(0), batch 2): {L[1]:.6f} == 1F1B at --lr 0 bit for bit",
                   f"{L[1]} vs {frozen['losses'][1]}")
            report("resumed from" in out_w1 and L[2] == at_w1["losses"][1],  # (its losses: steps 2 and 3)
                   f"2BW step 3's loss is f(W(1), batch 3): {L[2]:.6f} == 1F1B's W(1) resumed at --lr 0 bit for bit",
                   f"{L[2]} vs {at_w1['losses']}")
            differ = [k for k in range(1, STEPS) if L[k] != sync["losses"][k]]
            report(differ == list(range(1, STEPS)) and not np.array_equal(two["params"], sync["params"]),
                   f"2BW is not synchronous: its losses differ from 1F1B's at steps 2..{STEPS} "
                   f"({L[1]:.6f} vs {sync['losses'][1]:.6f} at step 2), and so do the weights", f"differ at {differ}")

        # ---- the one-rank run of the same rule, against 2 and 4 stages, m = p and 2p
        ones = {}
        for p, m in [(2, 2), (2, 4), (4, 4), (4, 8)]:
            if m not in ones:
                ones[m], _ = r.dump(f"one_m{m}_2bw", 1, *pipe(1, m), steps=STEPS)
            run = two if (p, m) == (2, 4) else r.dump(f"pp{p}_m{m}_2bw", p, *pipe(p, m), steps=STEPS)[0]
            check_close(f"pp{p}, m={m}: 2BW over {STEPS} AdamW steps", run, ones[m])
            if (p, m) == (4, 4):
                check_bitwise("pp4 2BW == pp2 2BW bit for bit (m = 4)", run, two)
        # data parallelism around it: dp2 x pp2, ZeRO-1, 2 micro-batches per data-parallel rank (4 in all)
        dppp, _ = r.dump("dp2pp2_2bw", 4, "--pipeline-parallel", 2, "--pipeline-schedule", "2bw", "--zero", 1, steps=STEPS)
        check_close(f"dp2 x pp2, ZeRO-1: 2BW over {STEPS} AdamW steps", dppp, ones[4])

        # ---- memory: what each rank holds, and the second version in --estimate
        _, out, _ = r.run(2, *pipe(2, 4), steps=2)
        check_predictions("pp2 2BW, m=4 (older_weights included)", out, 2)
        est = {k: params_per_rank(work, k, 2, 4) for k in ("1f1b", "2bw")}
        report(len(est["2bw"]) == 2 and est["2bw"] == [2 * b for b in est["1f1b"]],
               f"--estimate, pp2: 2BW's params per rank = twice 1F1B's ({est['2bw']} = 2 x {est['1f1b']} bytes: "
               f"W(t) and W(t-1), the last stage's wte copy included)", str(est))

        # ---- resume: 3 steps, checkpoint, 3 more == 6 straight
        straight, _ = r.dump("pp2_2bw_ckpt", 2, *pipe(2, 4), "--checkpoint-every", 3, steps=STEPS)
        ckpt = os.path.join(work, "out", "ckpt_00000003")
        files = sorted(f for f in os.listdir(ckpt) if f.startswith("pipedream_2bw")) if os.path.isdir(ckpt) else []
        report(files == ["pipedream_2bw_rank0.bin", "pipedream_2bw_rank1.bin"], "the checkpoint holds each rank's older version",
               str(files))
        resumed, out = r.dump("pp2_2bw_resumed", 2, *pipe(2, 4), "--resume", ckpt, steps=STEPS)
        if straight is not None and resumed is not None:
            report("resumed from" in out and np.array_equal(resumed["params"], straight["params"]) and
                   np.array_equal(resumed["losses"], straight["losses"][3:]),
                   "pp2 2BW: 3 steps + checkpoint + resume + 3 steps == 6 straight, bit for bit", out[-800:])
        code, out, err = r.run(2, *pipe(2, 4), "--resume", one_step, steps=3)
        report(code != 0 and "has no older weight version" in out + err,
               "2BW resuming a 1F1B checkpoint is refused (its older version is missing)", (out + err)[-500:])

        # ---- bad input: one line, exit 2, before anything is allocated (no MPI needed)
        base = [TRAINER, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--train-data",
                os.path.join(work, "train_000.bin"), "--val-data", "none"]
        refused(base + [str(f) for f in pipe(2, 4)] + ["--zero", "2"], "2bw with --zero 2", "2BW with ZeRO-2", work)
        refused(base + [str(f) for f in pipe(2, 4)] + ["--zero", "3"], "2bw with --zero 3", "2BW with ZeRO-3", work)
        refused(base + [str(f) for f in pipe(2, 4)] + ["--tensor-parallel", "2"], "2bw with --tensor-parallel",
                "2BW with tensor parallelism", work)
        code, out, err = r.run(2, *pipe(2, 1))
        report(code == 2 and "cannot fill a pipeline of 2 stages" in out + err, "2BW with m = 1 < p = 2: refused, exit 2",
               f"exit {code}: {(out + err)[-400:]}")
        if os.path.exists(GPU_TRAINER):
            refused([GPU_TRAINER] + base[1:] + [str(f) for f in pipe(2, 4)], "not trained by the GPU trainer",
                    "the GPU trainer with 2BW", work)
        else:
            print("SKIP: the GPU trainer's refusal of 2BW (build/emu/train_gpt is not built: make emu)")
        print(f"({r.seconds:.0f} s in the trainer)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
