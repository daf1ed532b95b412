#!/usr/bin/env python3
"""test_pipeline_zb_h1.py — ZB-H1 trained by the CPU trainer: the same bits as 1F1B, its memory, its bubble.

ZB-H1 (llmc/parallel/pipeline_schedule.h) splits each backward into B (input gradients, on the
critical path) and W (the block matmuls' weight gradients, deferred: stage s runs W(k) after
B(k + s)); B keeps each block matmul's output gradient for W in a weight stash, and W reads the
matmul's input in place, in the micro-batch's slot, parked past the forward's slots when a later
forward takes the slot first (llmc/model/zero_bubble_backward.h). The model and data are
test_parallelism.py's (L=4 C=64 H=4 T=32 V=501, B=1, 4 AdamW steps).

The reference is 1F1B on the same grid, and the demand is the same bits: W runs in micro-batch
order on every stage, so every weight gradient collects its micro-batches' additions in 1F1B's
order (the whole backward adds them in the same order), and nothing else changes.
  - zb-h1 == 1f1b bit for bit (losses, the step-1 gradient, the final weights, the first logits):
    2 stages with m = p = 2 and m = 2p = 4; 4 stages with m = 4 and 8; dp2 x pp2 with ZeRO-1 (the
    data-parallel sum after the schedule); at --recompute 1 and 2 as well as the default 0 (W
    rebuilds the GELU and LayerNorm outputs --recompute dropped, as B does);
  - every rank holds exactly what its size table says, weight stash and parked rows included, and
    sends the bytes --estimate predicts (check_predictions); on stage s the table holds 1F1B's
    activations (p - s slots) plus s slots of the rows W reads (parked: 7C floats per token and layer,
    ln1 atty ln2 and fch_gelu or fch; at --recompute 2 7C + 4 and the stage's input C: atty, fch and
    what ln1, ln2 are rebuilt from) plus s + 1 stashes of the matmuls' output gradients, 9C per token
    and layer, none on stage 0 (its W comes right after its B: the whole backward at B);
  - at GPT-2 small (d12, B=4, T=1024, 4 stages, m=8), --estimate: ZB-H1's largest stage holds
    exactly 1F1B's largest (its first stage's) activations at --recompute 0 and 1;
  - resume: 3 steps + checkpoint + 2 resumed == 5 straight, bit for bit;
  - compute made of sleeps (F = B = W = 50 ms; 1F1B's whole backward 100 ms), pp2 m=4: the measured
    bubble of both stages is ZB-H1's (p-1)/(3m+p-1) = 1/13 = 7.7% +- 6 points, below 1F1B's in the same
    conditions (whose own 1/5 test_parallelism.py checks); the --trace of the ZB-H1 run lists each
    stage's F, B and W in the printed order.
Planted bugs caught (by hand, then reverted): W skipped for micro-batch 1 (forward_backward's
PipeOp::Weight case calling gpt2_backward_weights only when act.micro != 1): all 7 bitwise checks
failed; W reading micro-batch k+1's stash (index (act.micro + 1) mod pending_weights): 5 of 7 failed,
all but the two runs with m = 2, where the swap only adds the same two terms the other way round
(a + b == b + a exactly in IEEE arithmetic; with three or more the grouping changes and the bits do).
W reading its inputs from slot k mod (p - s), which micro-batch k + p - s had taken (parking
ignored): all 7 bitwise checks failed. A first version that parked the rows at the forward, after
the forward's receive had already written the stage input (encoded) into the slot: all 7 failed.
"""
import os, re, shutil, subprocess, sys, tempfile
from checks import report, exit_code
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from test_parallelism import (Runner, mpi_trainer_missing, MODEL, T, TRAINER, SENDER_DRIVEN_MPI, check_bitwise,  # noqa: E402
                              check_predictions, traced_against_printed, write_pattern_shard)

STEPS = 4


def pipe(p, m, schedule):
    return ["--pipeline-parallel", p, "--pipeline-schedule", schedule, "--total-batch-tokens", m * T]


def measured_bubble(out):
    """(predicted %, [measured % per stage]) from the trainer's report."""
    m = re.search(r"pipeline bubble: predicted .*? = ([\d.]+)%.*?not computing: ([\d.% ]+)", out)
    return (float(m.group(1)), [float(x) for x in m.group(2).replace("%", "").split()]) if m else (None, [])


def estimate(work, schedule, p, m, *flags, model=MODEL, seq=T, batch=1):
    """Each rank's activation bytes as --estimate predicts them (the size table the trainer allocates)."""
    out = subprocess.run([TRAINER, "--model", model, "--seq-len", str(seq), "--batch-size", str(batch), "--estimate"] +
                         [str(f) for f in pipe(p, m * batch * seq // T, schedule)] + [str(f) for f in flags],
                         capture_output=True, text=True, cwd=work).stdout
    return [int(x) for x in re.findall(r"^  rank \d+: .*? activations=(\d+)", out, re.M)]


def main():
    if mpi_trainer_missing("ZB-H1"):
        return 0
    work = tempfile.mkdtemp(prefix="llmc_zb_")
    try:
        write_pattern_shard(work)
        r = Runner(work)

        # ---- the same bits as 1F1B on 2 and 4 stages, m = p and 2p
        for p, m in [(2, 2), (2, 4), (4, 4), (4, 8)]:
            ref, _ = r.dump(f"pp{p}_m{m}_1f1b", p, *pipe(p, m, "1f1b"), steps=STEPS)
            zb, out = r.dump(f"pp{p}_m{m}_zb", p, *pipe(p, m, "zb-h1"), steps=STEPS)
            check_bitwise(f"pp{p}, m={m}: ZB-H1 == 1F1B bit for bit over {STEPS} AdamW steps (W in micro-batch order)", zb, ref)
            if m == 2 * p:
                check_predictions(f"pp{p} ZB-H1, m={m} (weight stash included)", out, p)
            if p == 2 and m == 4:
                for level in (1, 2):  # the default is --recompute 0; the levels give 1F1B's bits (test_parallelism.py)
                    rc, _ = r.dump(f"pp2_zb_recompute{level}", 2, *pipe(2, 4, "zb-h1"), "--recompute", level, steps=STEPS)
                    check_bitwise(f"pp2, m=4: ZB-H1 --recompute {level} == 1F1B --recompute 0 bit for bit", rc, ref)

        # ---- data parallelism around the pipeline: dp2 x pp2, ZeRO-1, 2 micro-batches per data-parallel rank
        flags = ["--pipeline-parallel", 2, "--zero", 1]
        ref, _ = r.dump("dp2pp2_1f1b", 4, *flags, "--pipeline-schedule", "1f1b", steps=STEPS)
        zb, out = r.dump("dp2pp2_zb", 4, *flags, "--pipeline-schedule", "zb-h1", steps=STEPS)
        check_bitwise("dp2 x pp2, ZeRO-1: ZB-H1 == 1F1B bit for bit", zb, ref)
        check_predictions("dp2 x pp2 ZB-H1", out, 4)

        # ---- memory: stage s holds 1F1B's activations (p - s slots), s parked slots of the rows W reads and
        # s + 1 stashes of output gradients (none on stage 0), per token (zero_bubble_backward.h's lesson)
        N, C, layers = T, 64, 2  # pp2: 2 layers a stage
        for level in (0, 2):
            parked = layers * (7 * C + (4 if level == 2 else 0)) + (C if level == 2 else 0)  # + the stage input at level 2
            stash = layers * 9 * C
            want = [4 * N * (s * parked + (s + 1 if s else 0) * stash) for s in range(2)]  # bytes
            est = {k: estimate(work, k, 2, 4, "--recompute", level) for k in ("1f1b", "zb-h1")}
            extra = [z - o for z, o in zip(est["zb-h1"], est["1f1b"])] if all(len(v) == 2 for v in est.values()) else []
            report(extra == want, f"--estimate, pp2, m=4, --recompute {level}: ZB-H1's activations per stage = 1F1B's + s parked "
                   f"slots + (s + 1 if s else 0) stashes ({est['zb-h1']} = {est['1f1b']} + {want} bytes)", f"{est} {extra}")

        # ---- GPT-2 small, the configuration (arithmetic only): the peak stage holds 1F1B's peak
        for level in (0, 1):
            d12 = {k: estimate(work, k, 4, 8, "--recompute", level, model="d12", seq=1024, batch=4) for k in ("1f1b", "zb-h1")}
            ok = all(len(v) == 4 for v in d12.values()) and max(d12["zb-h1"]) == max(d12["1f1b"]) == d12["1f1b"][0]
            report(ok, f"--estimate, d12, B=4, T=1024, pp4, m=8, --recompute {level}: ZB-H1's largest stage = 1F1B's largest "
                   f"(stage 0's) activations: {d12['zb-h1']} vs {d12['1f1b']}", str(d12))

        # ---- resume: 3 steps, checkpoint, 2 more == 5 straight
        straight, _ = r.dump("pp2_zb_ckpt", 2, *pipe(2, 4, "zb-h1"), "--checkpoint-every", 3, steps=5)
        ckpt = os.path.join(work, "out", "ckpt_00000003")
        resumed, out = r.dump("pp2_zb_resumed", 2, *pipe(2, 4, "zb-h1"), "--resume", ckpt, steps=5)
        if straight is not None and resumed is not None:
            report("resumed from" in out and np.array_equal(resumed["params"], straight["params"]) and
                   np.array_equal(resumed["losses"], straight["losses"][3:]),
                   "pp2 ZB-H1: 3 steps + checkpoint + resume + 2 steps == 5 straight, bit for bit", out[-800:])

        # ---- the bubble with compute made of sleeps (the transport of test_parallelism.py's bubble check)
        delay = {"LLMC_TEST_PIPE_DELAY_MS": "50", **SENDER_DRIVEN_MPI}
        trace = os.path.join(work, "zb.json")
        _, out_zb, err = r.run(2, *pipe(2, 4, "zb-h1"), "--trace", trace, steps=3, env=delay)
        _, out_1, err1 = r.run(2, *pipe(2, 4, "1f1b"), steps=3, env=delay)
        pz, mz = measured_bubble(out_zb)
        p1, m1 = measured_bubble(out_1)
        report(pz == 7.7 and len(mz) == 2 and all(abs(x - 7.7) <= 6.0 for x in mz),
               f"ZB-H1, p=2, m=4, F = B = W = 50 ms: measured bubble {mz} = (p-1)/(3m+p-1) = 7.7% +- 6 points",
               out_zb[-600:] + err[-300:])
        # (1F1B's own 20% is test_parallelism.py's check; a loaded machine only lengthens its idle time)
        report(p1 == 20.0 and len(m1) == 2 and mz and max(mz) < min(m1),
               f"1F1B in the same conditions (B + W = 100 ms) idles more: {m1} against ZB-H1's {mz}",
               out_1[-600:] + err1[-300:])
        for k, (got, want) in enumerate(traced_against_printed(work, trace, pipe(2, 4, "zb-h1"), r"[FBW]\d+", 2)):
            report(want and got == want, f"stage {k}: the trace's F, B and W of step 2 in the printed order", f"{got} vs {want}")
        print(f"({r.seconds:.0f} s in the trainer)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
