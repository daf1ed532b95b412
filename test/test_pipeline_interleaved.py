#!/usr/bin/env python3
"""test_pipeline_interleaved.py — interleaved 1F1B trained by the CPU trainer: GPipe's bits, its memory, its bubble.

Interleaved 1F1B (llmc/parallel/pipeline_schedule.h) gives rank r of p the v model chunks c = layer
block c*p + r (llmc/parallel/process_grid.h's slice_layer): a micro-batch goes around the ring of
ranks v times. The model and data are test_parallelism.py's (L=4 C=64 H=4 T=32 V=501, B=1), the
same 10 AdamW steps; L=8 for 4 stages of 2 chunks.

The reference is GPipe on the same or another pipeline, and the demand is the same bits: each
layer computes what it computes in GPipe, and each layer's backwards run in micro-batch order
(chunk c's backwards go through the groups of p micro-batches in order), so every weight gradient
collects its micro-batches' additions in GPipe's order; the tied embedding's two halves meet on the
same ranks. Against one rank (the tied embedding's halves added in another order) within
test_parallelism.py's tolerances.
  - interleaved == GPipe bit for bit (losses, the step-1 gradient, the final weights, the first
    logits): p=2 v=2 (L=4) with m = p = 2 and m = 2p = 4; p=2 v=2 == GPipe on 4 stages (the same
    4 blocks, one per rank); p=4 v=2 (L=8) with m = 4; dp2 x pp2 with ZeRO-1;
  - every rank holds exactly what its size table says and sends the bytes --estimate predicts
    (check_predictions: activations of min(v m, 2(p - r - 1) + (v - 1)p + 1) (micro-batch, chunk)
    pairs of one chunk's layers each; v times 1F1B's point-to-point messages);
  - resume: 3 steps + checkpoint + 2 resumed == 5 straight, bit for bit; the interleaved checkpoint
    resumed by GPipe on 2 stages and by 1F1B on 4 gives GPipe's 5 straight steps bit for bit, and by
    one rank the one-rank run within tolerance (the checkpoint is in global layer order: nothing in
    it depends on p or v);
  - bad shapes: L not a multiple of p v, m not a multiple of p: one line, exit 2, before allocation;
  - compute made of sleeps (a chunk's F = 50 ms, B = 100 ms), p=2 v=2 m=4: the bubble printed is
    (p-1)/(vm+p-1) = 1/9 = 11.1%, measured on both stages within 6 points; the --trace of that run
    lists each stage's F and B (with their chunk, F3c1) in the printed order.
Planted bugs caught (by hand, then reverted): chunk c mapped to block c + r*v instead of c*p + r
(slice_layer): 10 checks failed (every bitwise one, one rank, the reshards); chunk c > 0's forward
reading the next micro-batch from the data loader instead of chunk 0's tokens: 9 failed; activation
slots chosen as (micro*v + chunk) mod slots instead of PipeSlots: 11 failed (two live pairs share a
slot on rank 1). The bubble check measures time: on a heavily loaded machine it reads high.
"""
import os, shutil, sys, tempfile
from checks import report, exit_code
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from test_parallelism import (Runner, mpi_trainer_missing, MODEL, T, SENDER_DRIVEN_MPI, check_bitwise, check_close,  # noqa: E402
                              check_predictions, traced_against_printed, write_pattern_shard)
from test_pipeline_zb_h1 import measured_bubble  # noqa: E402

MODEL8 = "L=8,C=64,H=4,T=32,V=501"


def pipe(p, m, schedule, v=1):
    chunks = ["--virtual-stages", v] if v > 1 else []
    return ["--pipeline-parallel", p, "--pipeline-schedule", schedule, "--total-batch-tokens", m * T] + chunks


def same_run(a, b, first=0):
    """a (resumed after `first` steps) ends with b's weights and continues b's losses, bit for bit."""
    return a is not None and b is not None and np.array_equal(a["params"], b["params"]) and \
        np.array_equal(a["losses"], b["losses"][first:])


def main():
    if mpi_trainer_missing("interleaved 1F1B"):
        return 0
    work = tempfile.mkdtemp(prefix="llmc_interleaved_")
    try:
        write_pattern_shard(work)
        r = Runner(work)

        # ---- GPipe's bits: p = 2, v = 2 (one layer a chunk), m = p and 2p
        gpipe = {}
        for m in (2, 4):
            gpipe[m], _ = r.dump(f"pp2_m{m}_gpipe", 2, *pipe(2, m, "gpipe"))
            il, out = r.dump(f"pp2_m{m}_il", 2, *pipe(2, m, "interleaved", 2))
            check_bitwise(f"pp2 v2, m={m}: interleaved == GPipe bit for bit over 10 AdamW steps (each layer's backwards in "
                          "micro-batch order)", il, gpipe[m])
            report("2 stages of 2 chunks of 1 layers (chunk c of stage r = layer block c*p + r)" in out,
                   f"pp2 v2, m={m}: the start-up line names the chunks", out[:1500])
            if m == 4:
                check_predictions("pp2 v2, m=4 interleaved", out, 2)
                one, _ = r.dump("one", 1)
                check_close("pp2 v2, m=4 interleaved", il, one)
        pp4, _ = r.dump("pp4_m4_gpipe", 4, *pipe(4, 4, "gpipe"))
        check_bitwise("pp2 v2 interleaved == GPipe on 4 stages (the same 4 blocks, one rank each), bit for bit",
                      r.dump("pp2_m4_il_again", 2, *pipe(2, 4, "interleaved", 2))[0], pp4)

        # ---- 4 stages of 2 chunks (L = 8)
        ref, _ = r.dump("pp4_L8_gpipe", 4, *pipe(4, 4, "gpipe"), model=MODEL8)
        il, out = r.dump("pp4_L8_il", 4, *pipe(4, 4, "interleaved", 2), model=MODEL8)
        check_bitwise("pp4 v2 (L=8), m=4: interleaved == GPipe bit for bit", il, ref)
        check_predictions("pp4 v2 (L=8), m=4 interleaved", out, 4)

        # ---- data parallelism around it: dp2 x pp2, ZeRO-1, 2 micro-batches per data-parallel rank
        flags = ["--pipeline-parallel", 2, "--zero", 1, "--total-batch-tokens", 4 * T]
        ref, _ = r.dump("dp2pp2_gpipe", 4, *flags, "--pipeline-schedule", "gpipe")
        il, out = r.dump("dp2pp2_il", 4, *flags, "--pipeline-schedule", "interleaved", "--virtual-stages", 2)
        check_bitwise("dp2 x pp2 v2, ZeRO-1: interleaved == GPipe bit for bit", il, ref)
        check_predictions("dp2 x pp2 v2 interleaved", out, 4)

        # ---- resume, and reshard into other pipelines and one rank
        straight, _ = r.dump("il_ckpt", 2, *pipe(2, 4, "interleaved", 2), "--checkpoint-every", 3, steps=5)
        ckpt = os.path.join(work, "out", "ckpt_00000003")
        resumed, out = r.dump("il_resumed", 2, *pipe(2, 4, "interleaved", 2), "--resume", ckpt, steps=5)
        report("resumed from" in out and same_run(resumed, straight, 3),
               "pp2 v2 interleaved: 3 steps + checkpoint + resume + 2 steps == 5 straight, bit for bit", out[-800:])
        g5, _ = r.dump("gpipe5", 2, *pipe(2, 4, "gpipe"), steps=5)
        for name, ranks, fl in [("GPipe on 2 stages", 2, pipe(2, 4, "gpipe")), ("1F1B on 4 stages", 4, pipe(4, 4, "1f1b"))]:
            other, out = r.dump("il_to_" + name.replace(" ", "_"), ranks, *fl, "--resume", ckpt, steps=5)
            report("resumed from" in out and same_run(other, g5, 3),
                   f"the pp2 v2 interleaved checkpoint resumed by {name}: GPipe's 5 straight steps, bit for bit", out[-800:])
        one5, _ = r.dump("one5", 1, steps=5)
        to_one, out = r.dump("il_to_one", 1, "--resume", ckpt, steps=5)
        if to_one is not None and one5 is not None:
            d = float(np.max(np.abs(to_one["params"].astype(np.float64) - one5["params"])))
            report("resumed from" in out and d <= 5e-5,
                   f"the pp2 v2 interleaved checkpoint resumed by one rank continues like one rank (weights {d:.1e})",
                   out[-600:])

        # ---- bad shapes: one line, exit 2, before anything is allocated
        for ranks, fl, model, needles in [
                (2, pipe(2, 4, "interleaved", 3), MODEL, ["4 layers", "2 x 3 = 6", "a model of 6 layers"]),
                (2, pipe(2, 3, "interleaved", 2), MODEL, ["groups of p = 2", "make it 2 or 4"])]:
            code, out, err = r.run(ranks, *fl, model=model, steps=1)
            report(code == 2 and err.count("error:") == 1 and all(n in err for n in needles) and "memory:" not in out,
                   f"{' '.join(map(str, fl))}: one line naming {needles}, exit 2, before allocation", f"exit {code}: {err[-500:]}")

        # ---- the bubble with compute made of sleeps (the transport of test_parallelism.py's bubble check)
        delay = {"LLMC_TEST_PIPE_DELAY_MS": "50", **SENDER_DRIVEN_MPI}
        trace = os.path.join(work, "il.json")
        _, out, err = r.run(2, *pipe(2, 4, "interleaved", 2), "--trace", trace, steps=3, env=delay)
        predicted, measured = measured_bubble(out)
        report(predicted == 11.1 and "(p-1)/(vm+p-1) = 1/9 = 11.1%" in out and len(measured) == 2 and
               all(abs(x - 11.1) <= 6.0 for x in measured),
               f"interleaved p=2 v=2 m=4, a chunk's F = 50 ms, B = 100 ms: measured bubble {measured} = (p-1)/(vm+p-1) "
               f"= 11.1% +- 6 points", out[-600:] + err[-300:])
        for k, (got, want) in enumerate(traced_against_printed(work, trace, pipe(2, 4, "interleaved", 2), r"[FB]\d+c\d+", 2)):
            report(len(want) == 16 and got == want, f"stage {k}: the trace's F and B (with chunks) of step 2 in the printed order",
                   f"{got} vs {want}")
        print(f"({r.seconds:.0f} s in the trainer)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
