#!/usr/bin/env python3
"""test_expert_parallel.py — --expert-parallel N on the CPU trainer over MPI (issue 24 item 2;
llmc/parallel/expert_parallel.h, docs/moe.md).

The reference is the one-rank run of the same global batch (4 micro-batches of 32 tokens,
test_parallelism's Runner), which routes every token itself and runs every expert locally; the MoE
layer itself is proven against PyTorch in test_moe.py. Tolerances are test_parallelism's (fp32
rounding: the owner's matmuls see the rows of several ranks in one call).

  ep2          2 ranks, E = 4 top-2, experts split 2 + 2, no dropping == 1 rank: losses, step-1
               gradients (the whole table gathered on rank 0: each rank holds its experts only), final
               weights after 5 AdamW steps, logits; the printed gradient norms, step by step
  traffic      the all-to-alls' bytes (the trainer's counters) = counts + 4 crossings x C x 4 bytes per
               crossing row, at most every assignment; their calls = 5 per block and micro-batch; and
               --estimate's counts, bound and calls (printed beside them) are those
  ep2 x dp2    4 ranks, two expert groups of 2, E = 4 top-2 == 1 rank, norms included (each expert's
               gradient summed over its 2 replicas, counted once in the norm)
  memory       each rank's allocations = --estimate's, by kind, and the bytes each sends to its groups
               (the trainer's report) at EP 2, EP 2 x DP 2 and EP 4; the MoE table per rank = the hand
               count: the routers (Lm E C) + the experts it owns less expert 0 (Lm x held x (8C^2 + 5C))
  starved      4 ranks, E = 8 top-1, experts split 2 per rank: some step has an expert with no token
               on some rank (load 0..), and the run neither hangs nor differs from 1 rank
  capacity     capacity is per source rank (each rank drops its own overflow before the dispatch):
               EP 2 with --moe-capacity-factor 1.0 == plain data parallelism on the same 2 ranks
               (same drops, same losses and weights); the drops are logged (> 0)
  resume       EP 2: 3 steps, checkpoint, 2 more == 5 straight, bit for bit; the checkpoint is the same
               file at any EP degree (rank 0 gathers the experts), so resuming it with EP 1 == the EP 2
               run, within tolerance, and an EP 1 checkpoint resumed with EP 2 == the EP 1 run
  refusals     one line, exit 2: E not divisible by N, N not dividing the data-parallel degree (of a
               run, or of --estimate's --estimate-ranks),
               --expert-parallel without --moe-experts, with --zero 3 / --tensor-parallel /
               --pipeline-parallel, and on the GPU trainer (when built) N not dividing its ranks
  zero         --zero 1 with MoE (the MoE table's moments sharded: expert_parallel.h's MoESharing), 10
               AdamW steps == 1 rank: dp 2 (the whole table over 2 ranks) and EP 2 x DP 2 (the routers
               over 4 ranks, each expert over its 2 replicas), norms included; memory and bytes =
               --estimate's, and its moe_adam_m = the hand count; --zero 2 == --zero 1 bit for bit;
               a --zero 1 checkpoint resumed at the same degree bit for bit, and resharded to --zero 2
               without expert parallelism (the whole table over 4 ranks) within tolerance
  bf16         --grad-compression bf16 at EP 2 x DP 2: the summed MoE table all bf16 values, within
               bf16's rounding of the exact run's sum, losses close; bytes = --estimate's
Planted by hand and caught (docs/moe.md, its expert-parallel section): the owner running its local expert
index as the global one; the combine with the counts not transposed; the backward without the
reorder to expert-major; the experts' gradients summed over all ranks (not their replicas); the norm
counting every replica's experts.
"""
import os, re, shutil, subprocess, sys, tempfile
import numpy as np
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from token_shards import write_shard  # noqa: E402
from test_parallelism import Runner, check_close, check_bitwise, check_predictions, TOL_LOSS_REL, TOL_PARAM_ABS  # noqa: E402
from test_estimate import parse_estimate  # noqa: E402
from test_bad_inputs import one_line_error, gpu_trainer  # noqa: E402

BIN = os.path.join(ROOT, "train_gpt_cpu")
STEP = re.compile(r"^step +\d+/\d+ \| loss [\d.]+ .*\| dropped (\d+) \| load (\d+)\.\.(\d+)$", re.M)
NORM = re.compile(r"^step +\d+/\d+ \| loss [\d.]+ \| lr \S+ \| norm ([\d.]+) ", re.M)


def check_norms(name, out, reference):
    """The gradient norms the step lines print (4 decimals) against the one-rank run's, step by step."""
    a, b = [float(x) for x in NORM.findall(out)], [float(x) for x in NORM.findall(reference)]
    report(len(a) == len(b) > 0 and all(abs(x - y) <= 2e-4 for x, y in zip(a, b)),
           f"{name}: the gradient norms == one rank's, step by step ({a})", f"{a} vs one rank's {b}")


def check_memory(name, out, ranks, experts, ep):
    """The trainer's report: every rank's memory and bytes = --estimate's; and its MoE table (weights) =
    the hand count. L = 4 MoE blocks of C = 64; rank q of a group owns experts q E/ep .. (q+1) E/ep - 1,
    one of them (expert 0, on q = 0) in the dense table."""
    check_predictions(name, out, ranks)
    est = subprocess.run([BIN, "--model", "L=4,C=64,H=4,T=32,V=501", "--seq-len", "32", "--batch-size", "1",
                          "--total-batch-tokens", str(4 * 32), "--moe-experts", str(experts), "--moe-top-k", "2" if experts == 4 else "1",
                          "--expert-parallel", str(ep), "--estimate-ranks", str(ranks), "--estimate"], capture_output=True, text=True)
    rows = {}
    for m in re.finditer(r"^  ranks? (\d+)(?:-(\d+))?: params=(\d+)", est.stdout, re.M):
        for q in range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1):
            rows[q] = int(m.group(3))
    L, C, E = 4, 64, experts
    dense = rows.get(0, 0) - 4 * (L * E * C + L * (E // ep - 1) * (8 * C * C + 5 * C))
    want = {q: dense + 4 * (L * E * C + L * (E // ep - (1 if q % ep == 0 else 0)) * (8 * C * C + 5 * C)) for q in range(ranks)}
    whole = 4 * (L * E * C + L * (E - 1) * (8 * C * C + 5 * C))  # the MoE table on one rank
    mine = rows.get(1, 0) - dense
    report(rows == want and dense > 0, f"{name}: each rank's weights = the dense table + the routers + its own experts "
           f"(rank 1's MoE table {mine:,} bytes, one rank's {whole:,})", f"{rows} vs {want}\n{est.stderr[-300:]}")


def check_equivalence(r):
    top2 = ["--moe-experts", 4, "--moe-top-k", 2]
    one, _ = r.dump("one", 1, *top2, steps=5)
    two, _ = r.dump("ep2", 2, *top2, "--expert-parallel", 2, steps=5)
    check_close("ep2: E = 4 top-2, experts split over 2 ranks", two, one)
    _, out, err = r.run(2, *top2, "--expert-parallel", 2, steps=5)  # (without --dump-state: its extra passes move rows too)
    check_traffic(out + err)
    check_memory("memory: EP 2", out, 2, 4, 2)
    _, out_one, _ = r.run(1, *top2, steps=5)
    check_norms("ep2", out, out_one)
    four, out = r.dump("ep2dp2", 4, *top2, "--expert-parallel", 2, steps=5)
    check_close("ep2 x dp2: 4 ranks, two expert groups", four, one)
    check_norms("ep2 x dp2", out, out_one)
    check_memory("memory: EP 2 x DP 2", out, 4, 4, 2)

    top1 = ["--moe-experts", 8, "--moe-top-k", 1]
    one8, _ = r.dump("one8", 1, *top1, steps=4)
    four8, out = r.dump("ep4", 4, *top1, "--expert-parallel", 4, steps=4)
    loads = [int(lo) for (_, lo, _) in STEP.findall(out)]
    report(0 in loads, f"starved: an expert with no token on a rank happened (loads' minima per step {loads})",
           out[-1500:])
    check_close("starved: E = 8 top-1 over 4 ranks (EP 4)", four8, one8)
    check_memory("memory: EP 4, E = 8", out, 4, 8, 4)
    return four


def check_bf16(r, exact):
    """--grad-compression bf16 with MoE at EP 2 x DP 2 (llmc/parallel/expert_parallel.h's moe_bf16_sum):
    the routers' gradient summed in bf16 over the 4 ranks, each expert's over its 2 replicas. Against the
    exact run (check_equivalence's EP 2 x DP 2, the same 5 steps): every value of the summed step-1 MoE
    table is a bf16 (its low 16 bits zero: the sums were rounded), the table within bf16's rounding of the
    exact sum (0 < |dg|/|g| <= 2^-7: each rank's gradient and the sum rounded once, half an ulp = 2^-9
    each), the losses within 1e-3; memory and bytes = --estimate's (the table's sum at 2 bytes a value)."""
    bf16, out = r.dump("bf16_ep2dp2", 4, "--moe-experts", 4, "--moe-top-k", 2, "--expert-parallel", 2,
                       "--grad-compression", "bf16", steps=5)
    if bf16 is None or exact is None:
        return
    L, C, E = 4, 64, 4
    table = L * (E * C + (E - 1) * (8 * C * C + 5 * C))
    g, want = bf16["grads"][-table:], exact["grads"][-table:].astype(np.float64)
    rounded = bool(np.all((g.view(np.uint32) & 0xFFFF) == 0))
    rel = float(np.linalg.norm(g - want) / np.linalg.norm(want))
    loss = float(np.max(np.abs(bf16["losses"] - exact["losses"]) / np.abs(exact["losses"])))
    report(rounded and 0 < rel <= 2.0 ** -7 and loss <= 1e-3,
           f"bf16: EP 2 x DP 2 with --grad-compression bf16: the summed MoE table all bf16 values, within bf16's rounding "
           f"of the exact sum (|dg|/|g| = {rel:.1e}), losses over 5 steps within {loss:.1e} of the exact run's",
           f"all bf16: {rounded}; |dg|/|g| {rel:.2e}; losses {loss:.2e}")
    check_predictions("bf16: EP 2 x DP 2 with --grad-compression bf16", out, 4)


def check_traffic(out):
    """The bytes the all-to-alls sent (the trainer's counters, every rank summed, 5 steps) against the
    lesson's arithmetic: per MoE block (L = 4) and micro-batch (2 per rank) each rank sends its counts
    (E/N = 2 ints to the other rank: 8 bytes), and a row that crosses to the other rank crosses 4 times
    (dispatch, combine, the output gradient out, the input gradient back), C x 4 bytes each; at most
    all k x 128 assignments of a step cross. 5 all-to-alls a block and micro-batch (3 forward, 2 back)."""
    m = re.search(r"^expert parallel: the all-to-alls sent (\d+) bytes from all ranks over 5 steps, .*\((\d+) calls", out, re.M)
    if not m:
        report(False, "traffic: the expert-parallel line", out[-800:])
        return
    total, calls = int(m.group(1)), int(m.group(2))
    blocks, steps, counts, row = 4, 5, 4 * 2 * 2 * 8 * 5, 4 * 64 * 4
    crossing = (total - counts) / row  # rows that crossed to the other rank, all blocks and steps
    report(calls == 5 * blocks * 2 * steps and (total - counts) % row == 0 and 0 < crossing <= blocks * steps * 256,
           f"traffic: {total} bytes over 5 steps = counts {counts} + {crossing:.0f} crossing rows x 4 crossings x C x 4 "
           f"({100 * crossing / (blocks * steps * 256):.0f}% of the 4 x 5 x 256 assignments), {calls} all-to-alls a rank",
           f"{total} bytes, {calls} calls")
    e = re.search(r"--estimate a step and rank: counts (\d+) \+ rows at most (\d+) \((\d+) at even routing\), (\d+) calls", out)
    if not e:
        report(False, "traffic: --estimate's all-to-all line", out[-800:])
        return
    e_counts, e_most, e_even, e_calls = (int(x) for x in e.groups())
    ranks = 2  # (2 micro-batches of k B T = 64 assignments a rank and step, each row 4 crossings x C x 4 bytes)
    report(e_counts * steps * ranks == counts and e_calls * steps == calls and e_most == blocks * 2 * 64 * row
           and e_even == e_most // 2 and total - counts <= e_most * steps * ranks,
           f"traffic: --estimate's counts ({e_counts} a step and rank) and calls ({e_calls}) are the counters'; its rows "
           f"bound {e_most} (every assignment leaving) holds ({(total - counts) / (steps * ranks):.0f} measured, "
           f"{e_even} at even routing)", e.group(0))


def check_capacity(r):
    flags = ["--moe-experts", 4, "--moe-top-k", 2, "--moe-capacity-factor", 1.0]
    dp, out_dp = r.dump("cap_dp", 2, *flags, steps=5)
    ep, out_ep = r.dump("cap_ep", 2, *flags, "--expert-parallel", 2, steps=5)
    drops_dp = [int(d) for (d, _, _) in STEP.findall(out_dp)]
    drops_ep = [int(d) for (d, _, _) in STEP.findall(out_ep)]
    report(len(drops_ep) == 5 and drops_ep == drops_dp and sum(drops_ep) > 0,
           f"capacity: per source rank, drops logged and the same as plain data parallelism's ({drops_ep})",
           f"EP {drops_ep} vs DP {drops_dp}")
    check_close("capacity 1.0: EP 2 vs plain dp 2", ep, dp)


def check_resume(r):
    flags = ["--moe-experts", 4, "--moe-top-k", 2, "--expert-parallel", 2]
    out_dir = os.path.join(r.work, "out")
    straight, _ = r.dump("straight", 2, *flags, "--checkpoint-every", 3, steps=5)
    ckpt = os.path.join(out_dir, "ckpt_00000003")
    resumed, _ = r.dump("resumed", 2, *flags, "--resume", ckpt, steps=5)
    if straight is not None and resumed is not None:
        straight["losses"] = straight["losses"][3:]
        check_bitwise("resume: EP 2, 3 + 2 steps == 5, bit for bit (losses, weights)", resumed, straight, keys=("losses", "params"))
    at1, _ = r.dump("resumed_ep1", 2, *flags[:-2], "--resume", ckpt, steps=5)
    if straight is not None and at1 is not None:
        check_close("resume: an EP 2 checkpoint resumed with EP 1", at1, resumed)
    # the other direction: a plain data-parallel run's checkpoint (every rank held every expert) at EP 2
    out1 = os.path.join(r.work, "out_ep1")
    # (compared with the EP 2 checkpoint resumed with EP 2: both dump step 4's gradients, and the two
    # checkpoints, EP 1's and EP 2's after 3 steps, agree within tolerance)
    r.run(2, *flags[:-2], "--checkpoint-every", 3, "--out-dir", out1, steps=5)  # (5: the learning rate schedule's)
    at2, _ = r.dump("resumed_ep2", 2, *flags, "--resume", os.path.join(out1, "ckpt_00000003"), steps=5)
    check_close("resume: an EP 1 checkpoint resumed with EP 2", at2, resumed)


def check_zero(r):
    """--zero 1 and 2 with MoE: the MoE table's AdamW moments sharded over the ranks that hold the same
    values (llmc/parallel/expert_parallel.h: the routers over every rank, the experts over their replicas;
    without expert parallelism the whole table over every rank). 10 AdamW steps against one rank."""
    top2 = ["--moe-experts", 4, "--moe-top-k", 2]
    one, out_one = r.dump("zero_one", 1, *top2, steps=10)
    dp2, out = r.dump("zero1_dp2", 2, *top2, "--zero", 1, steps=10)
    check_close("zero 1, dp 2: the whole MoE table's moments over 2 ranks, 10 steps", dp2, one)
    check_predictions("zero 1, dp 2", out, 2)
    ep, out = r.dump("zero1_ep2dp2", 4, *top2, "--expert-parallel", 2, "--zero", 1, "--checkpoint-every", 5,
                     "--out-dir", os.path.join(r.work, "out_zero"), steps=10)
    check_close("zero 1, EP 2 x DP 2: the routers' moments over 4 ranks, each expert's over its 2 replicas, 10 steps", ep, one)
    check_norms("zero 1, EP 2 x DP 2", out, out_one)
    check_memory("memory: zero 1, EP 2 x DP 2", out, 4, 4, 2)
    # rank 0's moments by hand: L = 4 blocks of C = 64, E = 4 over EP 2: it holds the routers (L E C) and
    # one expert besides expert 0 (L x (8 C^2 + 5 C)); the routers cut in 4, the experts in 2 (its replica)
    est = subprocess.run([BIN, "--model", "L=4,C=64,H=4,T=32,V=501", "--seq-len", "32", "--batch-size", "1",
                          "--total-batch-tokens", "128", "--moe-experts", "4", "--moe-top-k", "2", "--expert-parallel", "2",
                          "--zero", "1", "--estimate-ranks", "4", "--estimate"], capture_output=True, text=True)
    rows, _ = parse_estimate(est.stdout)
    L, C, E = 4, 64, 4
    want = 4 * (-(-L * E * C // 4) + -(-L * (8 * C * C + 5 * C) // 2))
    got = [rows.get(k, (None, -1))[1] for k in ("moe_adam_m", "moe_adam_v")]
    report(got == [want, want], f"zero 1, EP 2 x DP 2: --estimate's moe_adam_m and moe_adam_v on rank 0 = {want:,} bytes each "
           "(a quarter of the routers' + half its expert's)", f"{got} vs {want}\n{est.stderr[-300:]}")
    z2, _ = r.dump("zero2_ep2dp2", 4, *top2, "--expert-parallel", 2, "--zero", 2, steps=10)
    check_bitwise("zero 2, EP 2 x DP 2 == zero 1 bit for bit (the same sums, the same per-element AdamW)", z2, ep)
    # checkpoints keep the whole table's moments: resumed at the same degree (bit for bit), and resharded
    # to --zero 2 without expert parallelism (the whole table's moments over all 4 ranks)
    ckpt = os.path.join(r.work, "out_zero", "ckpt_00000005")
    same, _ = r.dump("zero1_resumed", 4, *top2, "--expert-parallel", 2, "--zero", 1, "--resume", ckpt, steps=10)
    other, _ = r.dump("zero2_resumed_ep1", 4, *top2, "--zero", 2, "--resume", ckpt, steps=10)
    if ep is not None:
        ep = dict(ep, losses=ep["losses"][5:])
        check_bitwise("zero 1 resume: EP 2 x DP 2, 5 + 5 steps == 10, bit for bit (losses, weights)", same, ep,
                      keys=("losses", "params"))
        if other is not None:
            loss = float(np.max(np.abs(other["losses"] - ep["losses"]) / np.abs(ep["losses"])))
            param = float(np.max(np.abs(other["params"] - ep["params"])))
            report(loss <= TOL_LOSS_REL and param <= TOL_PARAM_ABS,
                   f"zero 1 resume resharded: the EP 2 x DP 2 --zero 1 checkpoint resumed with --zero 2 and no expert "
                   f"parallelism == the straight run (losses {loss:.1e}, weights {param:.1e})",
                   f"beyond tolerance (losses {TOL_LOSS_REL}, weights {TOL_PARAM_ABS})")


def check_refusals(tmp):
    base = ["--model", "L=2,C=64,H=4,T=32,V=501", "--train-data", os.path.join(tmp, "train_000.bin"), "--seq-len", "32",
            "--steps", "1", "--out-dir", os.path.join(tmp, "out")]
    moe = ["--moe-experts", "4"]
    one_line_error("--expert-parallel 3 with 4 experts", base + moe + ["--expert-parallel", "3"], 2,
                   "--expert-parallel 3", "divisor of --moe-experts", seconds=10)
    one_line_error("--expert-parallel 0", base + moe + ["--expert-parallel", "0"], 2, "--expert-parallel 0", seconds=10)
    one_line_error("--expert-parallel 2 on 1 rank", base + moe + ["--expert-parallel", "2"], 2,
                   "must divide the data-parallel degree 1", seconds=10)
    one_line_error("--estimate with --expert-parallel 2 on 1 rank", base + moe + ["--expert-parallel", "2", "--estimate"], 2,
                   "--expert-parallel 2 must divide", "--estimate-ranks", seconds=10)
    one_line_error("--expert-parallel without --moe-experts", base + ["--expert-parallel", "2"], 2,
                   "--expert-parallel", "add --moe-experts", seconds=10)
    for flag in (["--zero", "3"], ["--tensor-parallel", "2"], ["--pipeline-parallel", "2"]):
        one_line_error(f"--expert-parallel 2 with {' '.join(flag)}", base + moe + ["--expert-parallel", "2"] + flag, 2,
                       "--moe-experts with", " ".join(flag), seconds=10)
    gpu = gpu_trainer()
    if gpu is None:
        print("SKIP: the GPU trainer's --expert-parallel on 1 rank (neither build/emu/train_gpt nor train_gpt is built)")
    else:  # (its expert parallelism over 2 GPUs: test_gpu_expert_parallel.py)
        one_line_error(f"{os.path.relpath(gpu, ROOT)}: --expert-parallel 2 on 1 rank", base + moe + ["--expert-parallel", "2"], 2,
                       "--expert-parallel 2 on 1 GPUs", "multiple of 2 ranks", binary=gpu, seconds=60)


def main():
    if not os.path.exists(BIN):
        print("FAIL: expert parallel: train_gpt_cpu is not built (run make)")
        return 1
    tmp = tempfile.mkdtemp(prefix="llmc_expert_parallel_")
    try:
        write_shard(os.path.join(tmp, "train_000.bin"), np.random.default_rng(0).integers(0, 501, 16384))
        check_refusals(tmp)
        if not shutil.which("mpirun") or "libmpi" not in subprocess.run(["ldd", BIN], capture_output=True, text=True).stdout:
            print("SKIP: expert parallelism over ranks (no mpirun, or train_gpt_cpu built without MPI)")
            return exit_code()
        r = Runner(tmp)
        exact = check_equivalence(r)
        check_bf16(r, exact)
        check_capacity(r)
        check_resume(r)
        check_zero(r)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
