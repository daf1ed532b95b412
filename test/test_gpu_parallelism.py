#!/usr/bin/env python3
"""test_gpu_parallelism.py — ZeRO-2/3, tensor, sequence and pipeline parallelism on the GPU trainer,
against one rank: test_parallelism.py's grids, with several ranks sharing one GPU.

Ranks that share a GPU cannot use NCCL (it refuses two ranks on one device), so they exchange
everything through host memory and MPI (llmc/parallel/comm_nccl.cuh's host staging): the same buckets,
shards, tensor-parallel sums, pipeline sends and checkpoints, only slower. What this proves on one
GPU is the trainer's logic on a grid; NCCL's own collectives are build/gpu_comm_check's business.

The model is test_parallelism.py's with the GPU's shapes (channels and head size multiples of 8):
L=4 C=128 H=4 T=32 V=501 (hs 32; V odd, so no tensor degree divides it), 128 tokens a step, 6 steps,
lr 1e-3. One rank accumulates 4 micro-batches of B=1; a grid runs them as dp ranks x m micro-batches
of a pipeline. The grids:

  dp2 ZeRO-2, dp2 ZeRO-3, tp2, tp4 + sequence parallel, tp2 + sequence parallel at --recompute 0 (the
  GELU in cuBLASLt's epilogues, on each rank's columns), pp2 GPipe, pp2 1F1B, pp4 1F1B, pp2 and pp4 ZB-H1,
  pp2 interleaved 1F1B over 2 chunks (checkpointed at 5, resumed on its grid and by one rank),
  PipeDream-2BW (2bw-flush) on one rank and on pp2 (4 steps, checkpointed at 2 and resumed),
  dp2 x tp2 (ZeRO-1), dp2 x pp2 (ZeRO-1, 1F1B and ZB-H1), tp2 x pp2 + sequence parallel, dp2 x tp2 ZeRO-3,
  tp3 on L=2 C=192 H=6: Vp=512 rows over 3 ranks, 176 each, the last with 16 rows of padding.

Tolerances (grid vs one rank, both bf16). The arithmetic is the same; what a grid changes is where
some sums are ROUNDED to bf16: a row-parallel matmul's t partial sums are each rounded, then summed
and rounded; so is the gradient flowing into a column-parallel matmul's input; data-parallel ranks
(ZeRO-2/3) round their own micro-batches' accumulated gradient before the sum; a pipeline adds the
tied embedding's two gradients in another order. test/bf16_grid_error_model.py simulates exactly
these roundings on this model (PyTorch, fp32 with bf16 rounding where the trainer stores bf16) and
measures, against one rank:
                         step-1 grads rel L2  cosine     first logits  step losses  weight change
    tp 2, tp 4           7.8e-3 .. 8.0e-3     0.99997    7.9e-3        <= 1.0e-3    2.8e-2
    dp 2, dp 4           2.8e-3 .. 3.1e-3     0.999995   0 (same)      5.4e-4       1.7e-2
    dp 2 x tp 2          7.9e-3               0.99997    7.9e-3        1.1e-3       2.7e-2
    control (half batch) 0.74                 0.80       0 (same)      0.19         0.62
(over 10 steps; the test runs 6 (CI's time), where the model measures the weight change 3.1e-2 .. 3.2e-2
for tp, 1.6e-2 for dp, 3.0e-2 for dp x tp and 0.64 for the control, the losses <= 3.0e-4 and 0.19)
What the model leaves out (cuBLASLt's and cuDNN's accumulation orders, which change with the local
shapes) adds fp32-level noise that bf16 rounding turns into the odd flipped last bit; so the limits
are 3-4 times the simulated errors, and still an order of magnitude from the control:
    step-1 gradient   relative L2 <= 3e-2 and cosine >= 0.9995         (control: 0.74, 0.80)
    first logits      relative L2 <= 3e-2
    losses            |loss_grid - loss_one| <= 0.01 every step         (control: 0.19)
    weight change     ||dW_grid - dW_one|| / ||dW_one|| <= 0.10 after 6 steps    (control: 0.64)
Where the arithmetic IS the same the test demands the same bits: ZeRO-3 == ZeRO-2 (the same reduce-
scatters, the same AdamW on the same shards, the same stochastic rounding), pp2 1F1B == pp2 GPipe
(schedules change when a layer computes, not what), a resumed run == the straight run on the same
grid, and ZB-H1 == 1F1B on 2 and 4 stages and on dp2 x pp2 (W runs in micro-batch order: each weight gradient gets
the same accumulations in the same order; --recompute 2's rebuilt rows are exact). PipeDream-2BW is not synchronous
by design: its step 1 is one rank's 1F1B step bit for bit, its step 2 loss far from 1F1B's (taken on W(0)), and pp2
equals the GPU's own one-rank run of the rule W(t+1) = W(t) - lr AdamW(grad f(W(t-1))) within the grid tolerances;
its memory is --estimate's to the byte (the older_weights row: params twice 1F1B's).
Planted bugs caught (by hand, then reverted): the interleaved state files written in contiguous-block order (both
interleaved resume checks); the data-parallel sum started at ZB-H1's last B, not its last W (both dp2 x pp2 ZB-H1
checks); 2BW's swap never done (the step-2 check); 2BW's older version not read back on resuming (its resume check). Every dump also proves that every copy of every element (tensor ranks' replicated LayerNorms,
data-parallel replicas, the last stage's copy of wte) is identical on every rank, in the bf16 weights
and in the master weights: the trainer refuses to write the dump otherwise.

Also: the bubble (p-1)/(m+p-1) printed and measured (LLMC_TEST_PIPE_DELAY_MS makes the compute
sleeps), checkpoints (files, bit-exact resume on the same grid, resumed by one rank on another), and,
without a GPU too, one clear error (exit 2) for each impossible grid and --estimate on a grid.

Without a GPU the grids run on the CPU emulation of CUDA (test/emu/, see test_gpu.py) with the simple
attention, and the second run of each bit-for-bit comparison (ZeRO-3, 1F1B, the resumed runs) takes
its threads and blocks in another order (reverse, or random), so a race would show as a difference;
the bubble, a timing, stays a real GPU's check (SKIP).
"""
import os, re, shutil, subprocess, sys, tempfile, time
from checks import report, exit_code
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_gpu import (DEFAULT_ATTENTION, EMULATED, GPU, MODE, NATIVE_GPU, RANDOM, REVERSED, cosine,  # noqa: E402
                      read_safetensors, rel)
from test_parallelism import IMPOSSIBLE_GRIDS, SENDER_DRIVEN_MPI, bubble, write_pattern_shard  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "L=4,C=128,H=4,T=32,V=501"
MODEL3 = "L=2,C=192,H=6,T=32,V=501"
T, LR = 32, 1e-3
# 6 steps, a checkpoint after 3: each emulated step costs more than a run's start (CI's time, docs/benchmarks.md)
STEPS, CKPT = 6, 3
TOL_GRAD, TOL_COS, TOL_LOGITS, TOL_LOSS, TOL_UPDATE = 3e-2, 0.9995, 3e-2, 0.01, 0.10
CHECKS = ["dp2 ZeRO-2 == one rank", "dp2 ZeRO-3 == one rank", "ZeRO-3 == ZeRO-2 bit for bit", "tp2 == one rank",
          "tp4 + sequence parallel == one rank", "tp3 (vocabulary padding) == one rank", "pp2 GPipe == one rank",
          "pp2 1F1B == pp2 GPipe bit for bit", "pp4 1F1B == one rank",
          "pp2 ZB-H1 == pp2 1F1B bit for bit", "pp2 ZB-H1 == one rank", "pp4 ZB-H1 == pp4 1F1B bit for bit",
          "pp2 v2 interleaved == pp2 GPipe in step 1 bit for bit", "pp2 v2 interleaved == one rank",
          "pp2 v2 interleaved resume bit-exact", "pp2 v2 interleaved checkpoint resumed by one rank", "dp2 x tp2 == one rank",
          "dp2 x pp2 == one rank", "dp2 x pp2 ZB-H1 == dp2 x pp2 1F1B bit for bit", "dp2 x pp2 ZB-H1 == one rank",
          "tp2 x pp2 + sequence parallel == one rank", "tp2 x pp2 checkpoint files", "tp2 x pp2 resume bit-exact",
          "tp2 x pp2 checkpoint resumed by one rank", "dp2 x tp2 ZeRO-3 == one rank", "dp2 x tp2 ZeRO-3 resume bit-exact",
          "negative control", "the bubble printed and measured"]


class Runner:
    def __init__(self, work):
        self.work = work
        self.mpirun = shutil.which("mpirun")
        self.seconds = 0.0

    def run(self, ranks, *flags, model=MODEL, steps=STEPS, env=None, guard=300, exe=GPU):
        common = ["--model", model, "--train-data", os.path.join(self.work, "train_*.bin"), "--val-data", "none",
                  "--sample-every", "0", "--seq-len", str(T), "--steps", str(steps), "--lr", str(LR), "--batch-size", "1",
                  "--total-batch-tokens", str(4 * T if model == MODEL else 3 * T), "--out-dir", os.path.join(self.work, "out")]
        cmd = ["timeout", str(guard), self.mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np",
               str(ranks), exe] + common + DEFAULT_ATTENTION + [str(f) for f in flags]
        start = time.time()
        p = subprocess.run(cmd, cwd=self.work, capture_output=True, text=True,
                           env=dict(os.environ, **{"LLMC_HOST_STAGED": "1", **(env or {})}))  # (env may take NCCL's path)
        self.seconds += time.time() - start
        return p.returncode, p.stdout, p.stderr

    def dump(self, name, ranks, *flags, **kw):
        path = os.path.join(self.work, name + ".st")
        code, out, err = self.run(ranks, *flags, "--dump-state", path, **kw)
        if code != 0 or not os.path.exists(path):
            report(False, f"{name} runs", f"the trainer exited with {code}:\n{(out + err)[-3000:]}")
            return None, out
        return read_safetensors(path)[0], out


def differences(a, b, init):
    """(step-1 gradient rel L2, its cosine, first logits rel L2, max loss difference, weight change rel L2)."""
    return (rel(a["grads"], b["grads"]), cosine(a["grads"], b["grads"]), rel(a["logits"], b["logits"]),
            float(np.max(np.abs(a["losses"].astype(np.float64) - b["losses"]))), rel(a["params"] - init, b["params"] - init))


def check_close(name, a, b, init):
    if a is None or b is None or init is None:
        return
    grad, cos, logits, loss, update = differences(a, b, init)
    ok = grad <= TOL_GRAD and cos >= TOL_COS and logits <= TOL_LOGITS and loss <= TOL_LOSS and update <= TOL_UPDATE
    report(ok, f"{name} (step-1 grads rel {grad:.1e} cos {cos:.6f}, logits {logits:.1e}, losses {loss:.1e}, "
               f"weight change rel {update:.1e})",
           f"beyond tolerance (grads {TOL_GRAD}, cosine {TOL_COS}, logits {TOL_LOGITS}, losses {TOL_LOSS}, "
           f"weight change {TOL_UPDATE})")


def check_bitwise(name, a, b, keys=("losses", "params", "grads", "logits")):
    if a is None or b is None:
        return
    bad = [k for k in keys if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]
    report(not bad, name, "not bit-identical: " + ", ".join(bad))


def estimate_totals(work, flags, exe=None, model=MODEL):
    """--estimate's (params, total) bytes of each rank of a grid on the test model (or `model`, with
    Runner's batch for it), without a GPU."""
    exe = exe or (NATIVE_GPU if os.path.exists(NATIVE_GPU) else GPU)
    tokens = 4 * T if model == MODEL else 3 * T
    p = subprocess.run([exe, "--model", model, "--seq-len", str(T), "--batch-size", "1", "--total-batch-tokens", str(tokens),
                        "--estimate"] + DEFAULT_ATTENTION + flags, capture_output=True, text=True, cwd=work)
    return [(int(a), int(b)) for a, b in re.findall(r"^  rank \d+: params=(\d+) .* total=(\d+)", p.stdout, re.M)]


def checks_without_gpu(work):
    """Impossible grids stop before any GPU is touched; --estimate needs none."""
    mpirun = shutil.which("mpirun")
    exe = NATIVE_GPU if os.path.exists(NATIVE_GPU) else GPU  # the nvcc build where there is one
    for ranks, flags, expect in IMPOSSIBLE_GRIDS:
        cmd = ["timeout", "120", mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), exe, "--model", MODEL,
               "--train-data", os.path.join(work, "train_*.bin"), "--val-data", "none", "--seq-len", str(T), "--steps", "1",
               "--batch-size", "1", "--total-batch-tokens", str(4 * T)] + flags
        p = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
        report(p.returncode == 2 and p.stderr.count("error:") == 1 and expect in p.stderr,
               f"train_gpt on {ranks} rank{'s' if ranks > 1 else ''} {' '.join(flags)}: exit 2, one line: '{expect}'",
               f"exit {p.returncode}: {p.stderr[-500:]}")
    # --pipeline-print-schedule: the lists forward_backward walks, the CPU trainer's (test_parallelism.py)
    pr = subprocess.run([exe, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--total-batch-tokens", str(4 * T),
                         "--pipeline-parallel", "2", "--pipeline-print-schedule"], capture_output=True, text=True, cwd=work)
    stages = [line for line in pr.stdout.splitlines() if line.startswith("stage ")]
    report(pr.returncode == 0 and stages == ["stage 0: F0 a0>1 F1 a1>1 g0<1 B0 F2 a2>1 g1<1 B1 F3 a3>1 g2<1 B2 g3<1 B3",
                                             "stage 1: a0<0 F0 B0 g0>0 a1<0 F1 B1 g1>0 a2<0 F2 B2 g2>0 a3<0 F3 B3 g3>0"],
           "train_gpt --pipeline-print-schedule: pp2 1F1B, m=4, as drawn by hand, without a GPU", pr.stdout[-800:] + pr.stderr)
    # ZB-H1: printed; with tensor parallelism refused with one line (its W reads whole rows, as on the CPU)
    zb = [exe, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--total-batch-tokens", str(4 * T),
          "--pipeline-parallel", "2", "--pipeline-schedule", "zb-h1"]
    pr = subprocess.run(zb + ["--pipeline-print-schedule"], capture_output=True, text=True, cwd=work)
    refused = subprocess.run(zb + ["--tensor-parallel", "2"], capture_output=True, text=True, cwd=work)
    report(pr.returncode == 0 and "stage 1: a0<0 F0 B0 g0>0 a1<0 F1 B1 W0 g1>0" in pr.stdout and refused.returncode == 2 and
           len(refused.stderr.strip().splitlines()) == 1 and "zb-h1 with --tensor-parallel is not supported" in refused.stderr,
           "train_gpt --pipeline-schedule zb-h1: printed (stage 1 lags its W's by one); with --tensor-parallel 2 refused, "
           "one line, exit 2", pr.stdout[-800:] + pr.stderr + refused.stderr)
    # interleaved 1F1B: printed; 3 micro-batches (not a multiple of p = 2) refused with one line, before any GPU work
    il = zb[:-1] + ["interleaved", "--virtual-stages", "2"]
    pr = subprocess.run(il + ["--pipeline-print-schedule"], capture_output=True, text=True, cwd=work)
    refused = subprocess.run(["timeout", "120", mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2", exe, "--model", MODEL,
                              "--train-data", os.path.join(work, "train_*.bin"), "--seq-len", str(T), "--batch-size", "1",
                              "--total-batch-tokens", str(3 * T), "--pipeline-parallel", "2", "--pipeline-schedule",
                              "interleaved", "--virtual-stages", "2"], capture_output=True, text=True, cwd=work)
    report(pr.returncode == 0 and "stage 0: F0c0 a0c0>1 F1c0" in pr.stdout and refused.returncode == 2 and
           refused.stderr.count("error:") == 1 and "runs the micro-batches in groups of p = 2" in refused.stderr,
           "train_gpt --pipeline-schedule interleaved --virtual-stages 2: printed; m = 3 on 2 stages refused, one line, exit 2",
           pr.stdout[-800:] + pr.stderr + refused.stderr)
    # PipeDream-2BW (both, test_gpu_pipeline_2bw.py): with what it cannot serve refused (2bw: fp8's amax, run ahead)
    for flags, expect in ((["--pipeline-schedule", "2bw", "--precision", "fp8"], "2bw with --precision fp8 is not supported"),
                          (["--pipeline-schedule", "2bw-flush", "--tensor-parallel", "2"], "2bw with --tensor-parallel is not supported"),
                          (["--pipeline-schedule", "2bw-flush", "--cuda-graphs"], "2bw-flush with --cuda-graphs")):
        refused = subprocess.run(zb[:-2] + flags, capture_output=True, text=True, cwd=work)
        report(refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1 and expect in refused.stderr,
               f"train_gpt {' '.join(flags)}: refused, one line, exit 2: '{expect}'", refused.stdout[-300:] + refused.stderr)
    est = subprocess.run([exe, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--total-batch-tokens", str(4 * T),
                          "--tensor-parallel", "2", "--pipeline-parallel", "2", "--sequence-parallel", "1", "--estimate"],
                         capture_output=True, text=True, cwd=work)
    totals = {int(r): int(t) for r, t in re.findall(r"^  ranks? (\d)[-\d]*:.* total=(\d+)", est.stdout, re.M)}
    report(est.returncode == 0 and "memory per rank (dp, tp, pp" in est.stdout and "x tp 2 x pp 2 sequence parallel" in est.stdout
           and "bubble (p-1)/(m+p-1) = 1/5 = 20.0%" in est.stdout and len(totals) >= 2 and totals.get(0) != totals.get(2),
           "train_gpt --estimate on tp2 x pp2 + sequence parallel: each stage's memory from its own slice, the bubble, "
           "without a GPU", est.stdout[-1500:] + est.stderr)


def main():
    if MODE is None:
        print(f"SKIP: GPU parallelism ({GPU})")
        return 0
    if not shutil.which("mpirun") or "libmpi" not in subprocess.run(["ldd", GPU], capture_output=True, text=True).stdout:
        print("SKIP: GPU parallelism (no mpirun, or train_gpt was built without MPI)")
        return 0
    work = tempfile.mkdtemp(prefix="llmc_gpu_par_")
    try:
        write_pattern_shard(work)
        checks_without_gpu(work)
        r = Runner(work)

        start, _ = r.dump("init", 1, "--lr", "0", steps=1)   # lr 0: the weights stay the initial ones
        init = start["params"] if start is not None else None
        one, _ = r.dump("one", 1)
        half, _ = r.dump("half", 1, "--total-batch-tokens", 2 * T)  # negative control: half of each step's batch
        if half is not None and one is not None and init is not None:
            grad, cos, _, loss, update = differences(half, one, init)
            report(grad > TOL_GRAD and update > TOL_UPDATE and loss > TOL_LOSS,
                   f"negative control: half the batch differs far beyond tolerance (grads {grad:.1e}, cos {cos:.4f}, "
                   f"losses {loss:.1e}, weight change {update:.1e})", "the tolerances cannot tell a missing micro-batch from rounding")

        # ---- ZeRO-2 and ZeRO-3
        z2, out = r.dump("zero2", 2, "--zero", 2)
        report("host-staged" in out and "ZeRO-2" in out, "dp2 ZeRO-2 runs on 2 host-staged ranks", out[:1200])
        check_close("dp2 ZeRO-2 == one rank", z2, one, init)
        # emulated: the runs compared bit for bit take other schedules, so a race between threads shows up
        z3, _ = r.dump("zero3", 2, "--zero", 3, env=REVERSED if EMULATED else None)
        check_close("dp2 ZeRO-3 == one rank", z3, one, init)
        check_bitwise("ZeRO-3 == ZeRO-2 bit for bit (same reduce-scatters, same AdamW on the same shards)", z3, z2)

        # ---- tensor and sequence parallelism (V = 501: no tensor degree divides the vocabulary)
        tp2, _ = r.dump("tp2", 2, "--tensor-parallel", 2)
        check_close("tp2 == one rank (vocabulary 501 over 2 ranks)", tp2, one, init)
        tp4, _ = r.dump("tp4sp", 4, "--tensor-parallel", 4, "--sequence-parallel", 1)
        check_close("tp4 + sequence parallel == one rank", tp4, one, init)
        # --recompute 0: each rank's fc columns (4C/2) through GELU_AUX_BIAS, its fc bias gradient from DGELU_BGRAD
        tp2rc0, _ = r.dump("tp2sp_recompute0", 2, "--tensor-parallel", 2, "--sequence-parallel", 1, "--recompute", 0)
        check_close("tp2 + sequence parallel, --recompute 0 (GELU in cuBLASLt's epilogues) == one rank", tp2rc0, one, init)
        start3, _ = r.dump("init3", 1, "--lr", "0", model=MODEL3, steps=1)
        one3, _ = r.dump("one3", 1, model=MODEL3)
        tp3, _ = r.dump("tp3", 3, "--tensor-parallel", 3, model=MODEL3)
        check_close("tp3 == one rank (Vp=512 over 3 ranks: 176 rows each, 16 of padding)", tp3, one3,
                    start3["params"] if start3 is not None else None)

        # ---- pipelines
        ppg, out = r.dump("pp2_gpipe", 2, "--pipeline-parallel", 2, "--pipeline-schedule", "gpipe")
        check_close("pp2 GPipe == one rank", ppg, one, init)
        pp1, _ = r.dump("pp2_1f1b", 2, "--pipeline-parallel", 2, "--pipeline-schedule", "1f1b", env=RANDOM if EMULATED else None)
        check_bitwise("pp2 1F1B == pp2 GPipe bit for bit (schedules change when a layer computes, not what)", pp1, ppg)
        pp4, _ = r.dump("pp4_1f1b", 4, "--pipeline-parallel", 4, "--pipeline-schedule", "1f1b")
        check_close("pp4 1F1B == one rank", pp4, one, init)
        # interleaved 1F1B, p = 2, v = 2 on L = 4: rank 0 runs layers 0 and 2, rank 1 layers 1 and 3, activations per
        # (micro-batch, chunk), two receives in some runs. The same arithmetic as GPipe: the step-1 gradient and the first
        # logits bit for bit; later steps only close, since AdamW's stochastic rounding draws by the element's LOCAL
        # index (adamw.cuh), and rank 0's local layer 1 is global layer 2 here, global layer 1 under GPipe.
        interleaved = ["--pipeline-parallel", 2, "--pipeline-schedule", "interleaved", "--virtual-stages", 2]
        il2, out = r.dump("pp2_interleaved", 2, *interleaved, "--checkpoint-every", 5, env=REVERSED if EMULATED else None)
        report("(p-1)/(vm+p-1) = 1/9 = 11.1%" in out, "pp2 v2 interleaved prints its bubble, 1/9", out[:1500])
        check_bitwise("pp2 v2 interleaved == pp2 GPipe bit for bit in step 1 (gradient, logits, loss)", il2, ppg,
                      keys=("grads", "logits", "loss"))
        check_close("pp2 v2 interleaved == one rank", il2, one, init)
        # its checkpoint is in global layer order (slice_layer), so it resumes on its own grid bit for bit and, resharded,
        # on one rank within the tolerances (a chunk's layers written to another chunk's place would be far off)
        ckpt = os.path.join(work, "out", "ckpt_00000005")
        il2r, out = r.dump("pp2_interleaved_resumed", 2, *interleaved, "--resume", ckpt, env=RANDOM if EMULATED else None)
        if il2 is not None and il2r is not None:
            report("resumed from" in out and np.array_equal(il2r["params"], il2["params"]) and
                   np.array_equal(il2r["losses"], il2["losses"][5:]),
                   "pp2 v2 interleaved: 5 steps + checkpoint + resume + 5 steps == 10 straight, bit for bit", out[-800:])
        il2one, out = r.dump("pp2_interleaved_to_one", 1, "--resume", ckpt)
        if il2one is not None and il2 is not None and init is not None:
            update = rel(il2one["params"] - init, il2["params"] - init)
            loss = float(np.max(np.abs(il2one["losses"] - il2["losses"][5:])))
            report("resharded: the checkpoint was written by 2 ranks" in out and update <= TOL_UPDATE and loss <= TOL_LOSS,
                   f"the pp2 v2 interleaved checkpoint resumed by one rank continues like the grid (weight change rel "
                   f"{update:.1e}, losses {loss:.1e})", out[-600:])
        # ZB-H1 (llmc/model/zero_bubble_backward.cuh): B without the block matmuls' dW, W later from the stash and the
        # slot. W runs in micro-batch order, so every gradient gets 1F1B's accumulations in 1F1B's order: the same bits.
        # --recompute 2: W rebuilds ln1 and ln2 from the slot as B did (recompute is exact: 1F1B's bits at level 1).
        zb2, out = r.dump("pp2_zb_h1", 2, "--pipeline-parallel", 2, "--pipeline-schedule", "zb-h1", "--recompute", 2,
                          env=REVERSED if EMULATED else None)
        report("bubble (p-1)/(3m+p-1) at F = B = W = 1/13 = 7.7%" in out, "pp2 ZB-H1 prints its bubble, 1/13", out[:1500])
        check_bitwise("pp2 ZB-H1 (--recompute 2) == pp2 1F1B bit for bit (W in micro-batch order)", zb2, pp1)
        check_close("pp2 ZB-H1 == one rank", zb2, one, init)
        # four stages: W lags B by s micro-batches, s + 1 stashes on stage s (0, 2, 3, 4 at m = 4)
        zb4, _ = r.dump("pp4_zb_h1", 4, "--pipeline-parallel", 4, "--pipeline-schedule", "zb-h1")
        check_bitwise("pp4 ZB-H1 == pp4 1F1B bit for bit", zb4, pp4)

        # PipeDream-2BW, each step drained (llmc/parallel/pipedream_2bw.cuh): W(t+1) = W(t) - lr AdamW(grad f(W(t-1))).
        # Step 1 is the synchronous step (W(-1) = W(0)): one rank's 1F1B bits; from step 2 on it is not synchronous, and
        # step 2's loss is f(W(0), batch 2), far from 1F1B's f(W(1), batch 2). The reference is the GPU's own one-rank run
        # of the rule (no pipeline code, no message); the 2-stage run is checkpointed at 2 (files from every rank) and
        # resumed bit for bit.
        two = ["--pipeline-schedule", "2bw-flush"]
        bw1, _ = r.dump("2bw_one", 1, *two, steps=4)
        bw2, out = r.dump("2bw_pp2", 2, "--pipeline-parallel", 2, *two, "--checkpoint-every", 2, steps=4,
                          env=REVERSED if EMULATED else None)
        if bw1 is not None and one is not None:
            report(bw1["losses"][0] == one["losses"][0] and abs(float(bw1["losses"][1] - one["losses"][1])) > 10 * TOL_LOSS,
                   f"2bw-flush on one rank: step 1 is 1F1B's bit for bit, step 2 is not (losses {bw1['losses'][:2]} against "
                   f"1F1B's {one['losses'][:2]})", "the delayed rule does not show")
        check_close("pp2 2bw-flush == one rank's 2bw-flush", bw2, bw1, init)
        table = re.search(r"GPU memory bytes: table (\d+)", out)
        estimated = [estimate_totals(work, ["--pipeline-parallel", "2", "--pipeline-schedule", sched]) for sched in ("2bw-flush", "1f1b")]
        report(table is not None and estimated[0] and estimated[1] and int(table.group(1)) == estimated[0][0][1] and
               all(a[0] == 2 * b[0] for a, b in zip(estimated[0], estimated[1])),
               f"pp2 2bw-flush: rank 0 allocates what --estimate predicts ({table.group(1) if table else '?'} bytes), and "
               f"each rank's params twice 1F1B's (the older_weights row: {[a[0] for a in estimated[0]]} bytes)",
               f"{estimated} {out[-300:]}")
        ckpt = os.path.join(work, "out", "ckpt_00000002")
        files = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
        bw2r, out = r.dump("2bw_pp2_resumed", 2, "--pipeline-parallel", 2, *two, "--resume", ckpt, steps=4,
                           env=RANDOM if EMULATED else None)
        if bw2 is not None and bw2r is not None:
            report("pipedream_2bw_rank0.bin" in files and "pipedream_2bw_rank1.bin" in files and
                   np.array_equal(bw2r["params"], bw2["params"]) and np.array_equal(bw2r["losses"], bw2["losses"][2:]),
                   "pp2 2bw-flush: 2 steps + checkpoint (each rank's older version) + resume + 2 steps == 4 straight, "
                   "bit for bit", f"{files} {out[-600:]}")

        # ---- combinations
        dptp, _ = r.dump("dp2tp2", 4, "--tensor-parallel", 2, "--zero", 1)
        check_close("dp2 x tp2 (ZeRO-1) == one rank", dptp, one, init)
        dppp, _ = r.dump("dp2pp2", 4, "--pipeline-parallel", 2, "--zero", 1)
        check_close("dp2 x pp2 (ZeRO-1) == one rank", dppp, one, init)
        # ZB-H1 over data-parallel ranks: each stage's last W (not its last B) completes the gradients the data group
        # sums (gpt2_backward_weights' step_ends); W in micro-batch order, so 1F1B's bits on the same grid
        dpzb, _ = r.dump("dp2pp2_zb_h1", 4, "--pipeline-parallel", 2, "--zero", 1, "--pipeline-schedule", "zb-h1",
                         env=RANDOM if EMULATED else None)
        check_bitwise("dp2 x pp2 ZB-H1 (ZeRO-1) == dp2 x pp2 1F1B bit for bit", dpzb, dppp)
        check_close("dp2 x pp2 ZB-H1 (ZeRO-1) == one rank", dpzb, one, init)
        # tp2 x pp2 with sequence parallelism: checkpoints every CKPT steps, then resumed from the first
        tppp, _ = r.dump("tp2pp2", 4, "--tensor-parallel", 2, "--pipeline-parallel", 2, "--sequence-parallel", 1,
                         "--checkpoint-every", CKPT)
        check_close("tp2 x pp2 + sequence parallel == one rank", tppp, one, init)
        ckpt = os.path.join(work, "out", f"ckpt_{CKPT:08d}")
        files = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
        report(files == ["checksums.txt", "model.bin"] + [f"state_rank{i}.bin" for i in range(4)],
               "a tp2 x pp2 checkpoint: model.bin (bf16, collected by rank 0) and one state file per rank", str(files))
        resumed, out = r.dump("tp2pp2_resumed", 4, "--tensor-parallel", 2, "--pipeline-parallel", 2, "--sequence-parallel",
                              1, "--resume", ckpt, env=REVERSED if EMULATED else None)
        if resumed is not None and tppp is not None:
            report("resumed from" in out and "resharded" not in out and np.array_equal(resumed["params"], tppp["params"]) and
                   np.array_equal(resumed["losses"], tppp["losses"][CKPT:]),
                   f"tp2 x pp2: {CKPT} steps + checkpoint + resume + {STEPS - CKPT} steps == {STEPS} straight, bit for bit", out[-800:])
        one_r, out = r.dump("tp2pp2_to_one", 1, "--resume", ckpt)
        if one_r is not None and tppp is not None and init is not None:
            update = rel(one_r["params"] - init, tppp["params"] - init)
            loss = float(np.max(np.abs(one_r["losses"] - tppp["losses"][CKPT:])))
            report("resharded: the checkpoint was written by 4 ranks with ZeRO-0 (tp 2 x pp 2)" in out and
                   update <= TOL_UPDATE and loss <= TOL_LOSS,
                   f"the tp2 x pp2 checkpoint resumed by one rank continues like the grid (weight change rel {update:.1e}, "
                   f"losses {loss:.1e})", out[-600:])
        # dp2 x tp2 with ZeRO-3: the weights live only as shards; resume bit for bit
        dz3, _ = r.dump("dp2tp2_zero3", 4, "--tensor-parallel", 2, "--zero", 3, "--checkpoint-every", CKPT)
        check_close("dp2 x tp2 ZeRO-3 == one rank", dz3, one, init)
        dz3r, out = r.dump("dp2tp2_zero3_resumed", 4, "--tensor-parallel", 2, "--zero", 3, "--resume", ckpt,
                           env=RANDOM if EMULATED else None)
        if dz3 is not None and dz3r is not None:
            report(np.array_equal(dz3r["params"], dz3["params"]) and np.array_equal(dz3r["losses"], dz3["losses"][CKPT:]),
                   "dp2 x tp2 ZeRO-3: resume on the same grid == straight, bit for bit", out[-600:])

        # ---- the bubble, with compute made of sleeps (20 ms forward, 40 ms backward per micro-batch)
        delay = {"LLMC_TEST_PIPE_DELAY_MS": "20", **SENDER_DRIVEN_MPI}  # (see test_parallelism.py)
        for schedule in ("gpipe", "1f1b") if EMULATED else ():
            print(f"SKIP: {schedule}, p=2, m=4: the bubble (a timing: emulated kernels are far slower than the sleeps)")
        for schedule in ("gpipe", "1f1b") if not EMULATED else ():
            code, out, err = r.run(2, "--pipeline-parallel", 2, "--pipeline-schedule", schedule, steps=3, env=delay)
            predicted, measured = bubble(out)
            report(code == 0 and predicted == 20.0 and "bubble (p-1)/(m+p-1) = 1/5 = 20.0%" in out and len(measured) == 2 and
                   all(abs(x - 20.0) <= 8.0 for x in measured),
                   f"{schedule}, p=2, m=4: the bubble printed is 20.0%, measured {measured} (20 +- 8 points)",
                   out[-600:] + err[-300:])
        print(f"({r.seconds:.0f} s in the trainer)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
