#!/usr/bin/env python3
"""test_parallelism.py — ZeRO-2/3, tensor, sequence and pipeline parallelism on the CPU trainer, against one rank.

Every technique changes who computes and what each rank holds, never what is computed: the same
10 steps on a grid of ranks must give the losses, the step-1 gradient and the final weights of
one rank accumulating the same micro-batches. The model, L=4 C=64 H=4 T=32 V=501 (pipelines of
2 and 4 stages; V odd, so no tensor degree divides it), trains on 128 tokens per step: one rank
runs 4 micro-batches of B=1; a grid runs them as dp ranks x m micro-batches of a pipeline.

  dp2 ZeRO-2, dp2 ZeRO-3, tp2, tp4 + sequence parallel, pp2 GPipe, pp4 1F1B,
  dp2 x tp2, dp2 x pp2, tp2 x pp2 (+ sequence parallel), dp2 x tp2 ZeRO-3,
  tp3 on L=2 C=48 H=6: Vp=512 rows over 3 ranks, so the last holds 16 rows of padding.

Tolerances (the same as test_data_parallel.py, and for the same reason): the arithmetic is the
same, the order of additions is not. Tensor parallelism sums each row-parallel matmul as t partial
sums over C/t (or 4C/t) terms and the softmax's normaliser as t partial sums; sequence parallelism
sums LayerNorm gradients over row blocks; pipelines add the tied embedding's two gradients in
another order; data parallelism sums over ranks. fp32 keeps 24 bits, so each reordered sum of k
terms moves by about k * 2^-24 of the terms' magnitude:
    losses           |d| <= 1e-5 * |loss|
    step-1 gradient  max |d| <= 1e-5 * max |g|
    final weights    max |d| <= 5e-5 = lr / 20   (AdamW moves a weight by about lr * m / sqrt(v) per step:
                                                   a gradient off in its last bits moves it by a sliver of lr)
    first logits     max |d| <= 1e-5 * max |z|
A negative control (one rank with half of each step's batch) must fail them. Where the arithmetic
IS the same, the test demands the same bits: ZeRO-3 == ZeRO-2 (same reduce-scatters, same AdamW),
GPipe == 1F1B == 2 or 4 stages (each layer computes the same, backwards in micro-batch order), a
resumed run == the straight run. Every dump also proves that every copy of every element (tensor
ranks' replicated LayerNorms, data-parallel replicas, the last stage's copy of wte) is identical
on every rank to the bit: the trainer refuses to write the dump otherwise.

--recompute 2 (ln1, ln2 and GELU recomputed in the backward) must give the same bits as level 0
on a grid too: tp2 with sequence parallelism (the recomputed rows are all-gathered, as at level 0)
and a pp2 1F1B pipeline (another micro-batch's forward runs between two backwards through the same
one-layer scratch), each with every rank's memory and traffic as --estimate predicts.

Also: the bubble (p-1)/(m+p-1) printed and measured (with LLMC_TEST_PIPE_DELAY_MS making compute
time independent of this machine's load), 1F1B holding fewer activations than GPipe, every rank's
memory and traffic equal to what --estimate predicts, checkpoints resumed on the same grid bit for
bit and on another grid within tolerance, a model that fits --max-memory only when split, and one
clear error (exit 2) for each impossible grid.
"""
import json, os, re, shutil, subprocess, sys, tempfile, time
from checks import report, exit_code
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from safetensors_io import read_safetensors  # noqa: E402
from test_data_parallel import write_shard  # noqa: E402
TRAINER = os.path.join(ROOT, "train_gpt_cpu")
MODEL = "L=4,C=64,H=4,T=32,V=501"
MODEL3 = "L=2,C=48,H=6,T=32,V=501"
T = 32
LR = 1e-3
TOL_LOSS_REL, TOL_GRAD_REL, TOL_PARAM_ABS, TOL_LOGIT_REL = 1e-5, 1e-5, 5e-5, 1e-5


# Grids the model (4 heads, 4 layers) or the batch (4 micro-batches of 32 tokens) cannot have: the
# ranks, the flags, and what the one line of the error must say (test_gpu_parallelism.py uses them too).
IMPOSSIBLE_GRIDS = [
    (2, ["--tensor-parallel", "3"], "must be a multiple of tp x pp = 3"),
    (3, ["--tensor-parallel", "3"], "does not divide the 4 attention heads"),
    (2, ["--pipeline-parallel", "2", "--total-batch-tokens", str(T)], "cannot fill a pipeline of 2 stages"),
    (4, ["--pipeline-parallel", "4", "--model", "L=2,C=64,H=4,T=32,V=501"], "exceeds the 2 layers"),
    (4, ["--pipeline-parallel", "2", "--zero", "3"], "use --zero 1 with pipelines"),
    (1, ["--sequence-parallel", "1"], "needs --tensor-parallel 2 or more"),
    (2, ["--tensor-parallel", "2", "--sequence-parallel", "1", "--seq-len", "31", "--total-batch-tokens", "124"],
     "2 does not divide it"),
]


class Runner:
    def __init__(self, work):
        self.work = work
        self.mpirun = shutil.which("mpirun")
        self.seconds = 0.0

    def run(self, ranks, *flags, model=MODEL, steps=10, env=None, guard=180):
        common = ["--model", model, "--train-data", os.path.join(self.work, "train_*.bin"), "--val-data", "none",
                  "--seq-len", str(T), "--steps", str(steps), "--lr", str(LR), "--threads", "1", "--batch-size", "1",
                  "--total-batch-tokens", str(4 * T if model == MODEL else 3 * T), "--out-dir", os.path.join(self.work, "out")]
        cmd = ["timeout", str(guard), self.mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks),
               TRAINER] + common + [str(f) for f in flags]
        start = time.time()
        p = subprocess.run(cmd, cwd=self.work, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
        self.seconds += time.time() - start
        return p.returncode, p.stdout, p.stderr

    def dump(self, name, ranks, *flags, **kw):
        path = os.path.join(self.work, name + ".st")
        code, out, err = self.run(ranks, *flags, "--dump-state", path, **kw)
        if code != 0 or not os.path.exists(path):
            report(False, name, f"the trainer exited with {code}:\n{(out + err)[-3000:]}")
            return None, out
        return read_safetensors(path)[0], out


def mpi_trainer_missing(what):
    """The pipeline tests' skip: True (after a SKIP line) without mpirun or an MPI build of train_gpt_cpu."""
    if not shutil.which("mpirun") or not os.path.exists(TRAINER):
        print(f"SKIP: {what} (needs mpirun and a built train_gpt_cpu)")
        return True
    if "libmpi" not in subprocess.run(["ldd", TRAINER], capture_output=True, text=True).stdout:
        print(f"SKIP: {what} (train_gpt_cpu was built without MPI)")
        return True
    return False


def write_pattern_shard(work):
    """The grid tests' data: 16384 tokens of V=501, 80% a repeating 97-token pattern (so the loss falls)."""
    rng = np.random.default_rng(0)
    pattern = rng.integers(0, 501, size=97)
    tokens = np.where(rng.random(16384) < 0.8, pattern[np.arange(16384) % 97], rng.integers(0, 501, size=16384))
    write_shard(os.path.join(work, "train_000.bin"), tokens)


def differences(a, b):
    loss = float(np.max(np.abs(a["losses"].astype(np.float64) - b["losses"]) / np.abs(b["losses"])))
    grad = float(np.max(np.abs(a["grads"].astype(np.float64) - b["grads"])) / np.max(np.abs(b["grads"])))
    param = float(np.max(np.abs(a["params"].astype(np.float64) - b["params"])))
    logit = float(np.max(np.abs(a["logits"].astype(np.float64) - b["logits"])) / np.max(np.abs(b["logits"])))
    return loss, grad, param, logit


def check_close(name, a, b):
    if a is None or b is None:
        return
    loss, grad, param, logit = differences(a, b)
    ok = loss <= TOL_LOSS_REL and grad <= TOL_GRAD_REL and param <= TOL_PARAM_ABS and logit <= TOL_LOGIT_REL
    report(ok, f"{name} == one rank (losses {loss:.1e}, step-1 grads {grad:.1e} of max, weights {param:.1e}, "
               f"logits {logit:.1e})",
           f"beyond tolerance (losses {TOL_LOSS_REL}, grads {TOL_GRAD_REL}, weights {TOL_PARAM_ABS}, logits {TOL_LOGIT_REL})")


def check_bitwise(name, a, b, keys=("losses", "params", "grads", "logits")):
    if a is None or b is None:
        return
    bad = [k for k in keys if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]
    report(not bad, name, "not bit-identical: " + ", ".join(bad))


def check_predictions(name, out, ranks):
    """Every rank's measured memory and traffic must be what --estimate predicts."""
    same = len(re.findall(r"^  \d+ \(\d+,\d+,\d+\) .*  = --estimate$", out, re.M))
    report(same == ranks, f"{name}: memory and bytes sent on all {ranks} ranks exactly as --estimate predicts",
           f"{same} of {ranks} ranks match:\n" + out[out.find("\nmemory per rank"):][:1500])


# Open MPI's shared-memory transport without its single-copy mechanism (vader in Open MPI 4, sm in 5)
SENDER_DRIVEN_MPI = {"OMPI_MCA_btl_vader_single_copy_mechanism": "none", "OMPI_MCA_btl_sm_single_copy_mechanism": "none"}


def bubble(out):
    m = re.search(r"pipeline bubble: predicted \(p-1\)/\(m\+p-1\) = ([\d.]+)%.*?not computing: ([\d.% ]+)", out)
    return (float(m.group(1)), [float(x) for x in m.group(2).replace("%", "").split()]) if m else (None, [])


def traced_against_printed(work, trace, flags, pattern, stages, step=2):
    """Each stage's compute spans of step `step` in the --trace files written for `trace` (trace.json
    -> trace.rank<k>.json), in time order, and the same actions in the --pipeline-print-schedule
    printout of `flags`, both filtered by the regex `pattern` (as "[FB]\\d+"): [(traced, printed)]
    per stage. (The trace's names are the printout's, llmc/probes/trace.h.)"""
    printed = subprocess.run([TRAINER, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--pipeline-print-schedule"] +
                             [str(f) for f in flags], capture_output=True, text=True, cwd=work).stdout
    pairs = []
    for k in range(stages):
        want = [a for line in printed.splitlines() if line.startswith(f"stage {k}:") for a in line.split()[2:]
                if re.fullmatch(pattern, a)]
        try:
            with open(trace[:-len(".json")] + f".rank{k}.json") as f:
                events = json.load(f)["traceEvents"]
            got = [e["name"] for e in sorted(events, key=lambda e: e.get("ts", 0))
                   if e.get("ph") == "X" and e["args"].get("step") == step and re.fullmatch(pattern, e["name"])]
        except (OSError, ValueError, KeyError) as e:
            got = [str(e)]
        pairs.append((got, want))
    return pairs


def activations_mib(out, rank):
    m = re.search(rf"^  {rank} \(\d+,\d+,\d+\)\s+\S+\s+\S+\s+\S+\s+(\S+)", out, re.M)
    return float(m.group(1)) if m else None


def main():
    if not shutil.which("mpirun"):
        print("SKIP: parallelism (mpirun is not installed: apt-get install openmpi-bin libopenmpi-dev)")
        return 0
    if not os.path.exists(TRAINER):
        print("FAIL: parallelism: train_gpt_cpu is not built (run make)")
        return 1
    if "libmpi" not in subprocess.run(["ldd", TRAINER], capture_output=True, text=True).stdout:
        print("SKIP: parallelism (train_gpt_cpu was built without MPI: install libopenmpi-dev and rebuild)")
        return 0

    work = tempfile.mkdtemp(prefix="llmc_par_")
    try:
        write_pattern_shard(work)
        r = Runner(work)

        one, _ = r.dump("one", 1)
        half, _ = r.dump("half", 1, "--total-batch-tokens", 2 * T)   # negative control: half of each step's batch

        # ---- ZeRO-2 and ZeRO-3 (and a memory budget that only the sharded model fits)
        z2, out = r.dump("zero2", 2, "--zero", 2)
        check_close("dp2 ZeRO-2", z2, one)
        check_predictions("dp2 ZeRO-2", out, 2)
        z3, out = r.dump("zero3", 2, "--zero", 3, "--max-memory", 5)
        check_close("dp2 ZeRO-3", z3, one)
        check_bitwise("ZeRO-3 == ZeRO-2 bit for bit (same reduce-scatters, same AdamW on the same shards)", z3, z2)
        check_predictions("dp2 ZeRO-3", out, 2)
        code, _, err = r.run(1, "--max-memory", 5, steps=1)
        code1, _, err1 = r.run(2, "--max-memory", 5, "--zero", 1, steps=1)
        report(code == 2 and err.count("error:") == 1 and "more than --max-memory 5 MiB" in err and code1 == 2 and
               "more than --max-memory 5 MiB" in err1,
               "--max-memory 5 MiB: one rank (5.8 MiB) and dp2 ZeRO-1 (5.4) are refused with one message (exit 2); "
               "dp2 ZeRO-3 (4.5) fits and trains", f"exit {code}: {err[-400:]}; exit {code1}: {err1[-300:]}")
        if half is not None and one is not None:
            loss, grad, param, _ = differences(half, one)
            report(param > 10 * TOL_PARAM_ABS and grad > 10 * TOL_GRAD_REL,
                   f"negative control: half the batch differs far beyond tolerance (weights {param:.1e}, grads {grad:.1e})",
                   "the tolerances cannot tell a missing micro-batch from rounding")

        # ---- tensor and sequence parallelism (V = 501: no tensor degree divides the vocabulary)
        tp2, out = r.dump("tp2", 2, "--tensor-parallel", 2)
        check_close("tp2 (vocab 501 over 2 ranks)", tp2, one)
        check_predictions("tp2", out, 2)
        tp4, out = r.dump("tp4sp", 4, "--tensor-parallel", 4, "--sequence-parallel", 1)
        check_close("tp4 + sequence parallel", tp4, one)
        check_predictions("tp4 + sequence parallel", out, 4)
        # --recompute 2 with sequence parallelism: each rank recomputes its rows of ln1/ln2, and the backward's
        # all-gather (done at every level) assembles them: the same bits as level 0, no extra traffic
        tp2sp, out = r.dump("tp2sp", 2, "--tensor-parallel", 2, "--sequence-parallel", 1)
        check_close("tp2 + sequence parallel", tp2sp, one)
        tp2sp_rc, out = r.dump("tp2sp_recompute2", 2, "--tensor-parallel", 2, "--sequence-parallel", 1, "--recompute", 2)
        check_bitwise("tp2 + sequence parallel, --recompute 2 == --recompute 0 bit for bit", tp2sp_rc, tp2sp)
        check_predictions("tp2 + sequence parallel, --recompute 2", out, 2)
        one3, _ = r.dump("one3", 1, model=MODEL3)
        tp3, out = r.dump("tp3", 3, "--tensor-parallel", 3, model=MODEL3)
        check_close("tp3 (Vp=512 over 3 ranks: 176 rows each, 16 of padding)", tp3, one3)

        # ---- pipelines: the same bits whatever the schedule and the number of stages
        ppg, out = r.dump("pp2_gpipe", 2, "--pipeline-parallel", 2, "--pipeline-schedule", "gpipe")
        check_close("pp2 GPipe", ppg, one)
        check_predictions("pp2 GPipe", out, 2)
        pp4, out = r.dump("pp4_1f1b", 4, "--pipeline-parallel", 4, "--pipeline-schedule", "1f1b")
        check_close("pp4 1F1B", pp4, one)
        check_bitwise("pp4 1F1B == pp2 GPipe bit for bit (schedules change when a layer computes, not what)", pp4, ppg)
        # --recompute 2 in 1F1B: stage 0 runs F0 F1 B0 F2 B1 ..., so micro-batch 2's forward overwrites the
        # one-layer scratch between micro-batch 0's and 1's backwards; each backward refills it before use
        pprc, out = r.dump("pp2_1f1b_recompute2", 2, "--pipeline-parallel", 2, "--pipeline-schedule", "1f1b", "--recompute", 2)
        check_close("pp2 1F1B --recompute 2", pprc, one)
        check_bitwise("pp2 1F1B --recompute 2 == pp2 GPipe --recompute 0 bit for bit", pprc, ppg)
        check_predictions("pp2 1F1B --recompute 2", out, 2)

        # ---- combinations
        dptp, out = r.dump("dp2tp2", 4, "--tensor-parallel", 2, "--zero", 1)
        check_close("dp2 x tp2, ZeRO-1", dptp, one)
        dppp, out = r.dump("dp2pp2", 4, "--pipeline-parallel", 2, "--zero", 1)
        check_close("dp2 x pp2, ZeRO-1", dppp, one)
        check_predictions("dp2 x pp2", out, 4)
        # tp2 x pp2 with sequence parallelism: checkpoints at 5 and 10, then resumed from 5
        tppp, out = r.dump("tp2pp2", 4, "--tensor-parallel", 2, "--pipeline-parallel", 2, "--sequence-parallel", 1,
                           "--checkpoint-every", 5)
        check_close("tp2 x pp2 + sequence parallel", tppp, one)
        check_predictions("tp2 x pp2 + sequence parallel", out, 4)
        ckpt = os.path.join(work, "out", "ckpt_00000005")
        files = sorted(os.listdir(ckpt)) if os.path.isdir(ckpt) else []
        report(files == ["checksums.txt", "model.bin"] + [f"state_rank{i}.bin" for i in range(4)],
               "a tp2 x pp2 checkpoint: model.bin (assembled by rank 0) and one state file per rank", str(files))
        resumed, out = r.dump("tp2pp2_resumed", 4, "--tensor-parallel", 2, "--pipeline-parallel", 2, "--sequence-parallel", 1,
                              "--resume", ckpt)
        if resumed is not None and tppp is not None:
            report("resumed from" in out and "resharded" not in out and np.array_equal(resumed["params"], tppp["params"]) and
                   np.array_equal(resumed["losses"], tppp["losses"][5:]),
                   "tp2 x pp2: 5 steps + checkpoint + resume + 5 steps == 10 straight, bit for bit", out[-800:])
        one_r, out = r.dump("tp2pp2_to_one", 1, "--resume", ckpt)
        if one_r is not None and tppp is not None:
            d = float(np.max(np.abs(one_r["params"] - tppp["params"])))
            report("resharded: the checkpoint was written by 4 ranks with ZeRO-0 (tp 2 x pp 2)" in out and d <= TOL_PARAM_ABS and
                   np.allclose(one_r["losses"], tppp["losses"][5:], rtol=TOL_LOSS_REL, atol=0),
                   f"the tp2 x pp2 checkpoint resumed by one rank continues like the grid (weights {d:.1e})", out[-600:])
        # dp2 x tp2 with ZeRO-3: the weights live only as shards; resume bit for bit
        dz3, out = r.dump("dp2tp2_zero3", 4, "--tensor-parallel", 2, "--zero", 3, "--checkpoint-every", 5)
        check_close("dp2 x tp2, ZeRO-3", dz3, one)
        check_predictions("dp2 x tp2, ZeRO-3", out, 4)
        dz3r, out = r.dump("dp2tp2_zero3_resumed", 4, "--tensor-parallel", 2, "--zero", 3, "--resume", ckpt)
        if dz3 is not None and dz3r is not None:
            report(np.array_equal(dz3r["params"], dz3["params"]) and np.array_equal(dz3r["losses"], dz3["losses"][5:]),
                   "dp2 x tp2 ZeRO-3: resume on the same grid == straight, bit for bit", out[-600:])

        # ---- the bubble, with compute made of sleeps (50 ms forward, 100 ms backward per micro-batch:
        # long enough that the tiny model's real compute and a loaded machine's jitter stay small beside them).
        # Open MPI's single-copy transport is turned off: then a message moves only while its sender is
        # inside MPI, as on machines without it, so a send left in flight while its stage computes
        # arrives late. Trainers that did that (6a8e6eb and before) measured 50.1% / 50.0% here for both
        # schedules (and GPipe 50.1% on an H200 machine); with the copy on they measured 20%.
        delay = {"LLMC_TEST_PIPE_DELAY_MS": "50", **SENDER_DRIVEN_MPI}
        _, out_g, err = r.run(2, "--pipeline-parallel", 2, "--pipeline-schedule", "gpipe", steps=3, env=delay)
        _, out_1, err = r.run(2, "--pipeline-parallel", 2, "--pipeline-schedule", "1f1b", steps=3, env=delay)
        for name, out in [("GPipe", out_g), ("1F1B", out_1)]:
            predicted, measured = bubble(out)
            report(predicted == 20.0 and "bubble (p-1)/(m+p-1) = 1/5 = 20.0%" in out,
                   f"{name}, p=2, m=4: the bubble printed is (p-1)/(m+p-1) = 1/5 = 20.0%", out[-600:] + err[-300:])
            report(len(measured) == 2 and all(abs(x - 20.0) <= 8.0 for x in measured),
                   f"{name}: the measured idle time of both stages is 20% +- 8 points ({measured})", out[-400:])
        ag, a1 = activations_mib(out_g, 0), activations_mib(out_1, 0)
        report(ag is not None and a1 is not None and abs(ag / a1 - 2.0) < 0.02,
               f"stage 0 holds activations of 4 micro-batches with GPipe, 2 with 1F1B ({ag} vs {a1} MiB)", f"{ag} {a1}")

        # ---- --estimate: one process describes the grid without launching it
        est = subprocess.run([TRAINER, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--total-batch-tokens",
                              str(4 * T), "--tensor-parallel", "2", "--pipeline-parallel", "2", "--sequence-parallel", "1",
                              "--estimate"], capture_output=True, text=True, cwd=work)
        comm_rows = re.findall(r"^  rank (\d) sends: data=(\d+) tensor=(\d+) pipeline=(\d+) world=(\d+)", est.stdout, re.M)
        report(est.returncode == 0 and len(comm_rows) == 4 and "bubble (p-1)/(m+p-1) = 1/5 = 20.0%" in est.stdout,
               "--estimate prints every rank of tp2 x pp2, its traffic and the bubble, without launching them",
               est.stdout[-1200:] + est.stderr)

        # ---- --pipeline-print-schedule: the lists the trainers run, without MPI or data. 1F1B on 2 stages with
        # 4 micro-batches, as the paper draws it: stage 0 warms up with one forward, then alternates; each
        # send followed by the receive it is paired with
        base = ["--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--total-batch-tokens", str(4 * T),
                "--train-data", "no_such_file.bin", "--pipeline-parallel", "2", "--pipeline-print-schedule"]
        pr = subprocess.run([TRAINER] + base, capture_output=True, text=True, cwd=work)
        want = ["stage 0: F0 a0>1 F1 a1>1 g0<1 B0 F2 a2>1 g1<1 B1 F3 a3>1 g2<1 B2 g3<1 B3",
                "stage 1: a0<0 F0 B0 g0>0 a1<0 F1 B1 g1>0 a2<0 F2 B2 g2>0 a3<0 F3 B3 g3>0"]
        stages = [line for line in pr.stdout.splitlines() if line.startswith("stage ")]
        report(pr.returncode == 0 and stages == want and "bubble 1/5 = 20.0%" in pr.stdout,
               "--pipeline-print-schedule: pp2 1F1B, m=4, one line per stage as drawn by hand, no data needed",
               pr.stdout[-800:] + pr.stderr)
        pr = subprocess.run([TRAINER] + base + ["--pipeline-schedule", "interleaved", "--virtual-stages", "2"],
                            capture_output=True, text=True, cwd=work)
        stages = [line.split()[2:] for line in pr.stdout.splitlines() if line.startswith("stage ")]
        computes = [sorted(a for a in s if a[0] in "FB") for s in stages]
        every = sorted(f"{k}{i}c{c}" for k in "FB" for i in range(4) for c in range(2))
        report(pr.returncode == 0 and len(stages) == 2 and computes == [every, every] and
               stages[0][:4] == ["F0c0", "a0c0>1", "F1c0", "a1c0>1"] and "bubble 1/9 = 11.1%" in pr.stdout,
               "--pipeline-print-schedule: interleaved, v=2: both stages forward and backward all 4 micro-batches on both "
               "chunks; bubble (p-1)/(vm+p-1) = 1/9", pr.stdout[-1200:] + pr.stderr)
        # ZB-H1 (pipeline_schedule.h derives it): stage 1 runs W(i) after B(i+1), its gradient send waits
        # for that W and goes with the next receive; 1 idle slot of 3m + p - 1 = 13
        pr = subprocess.run([TRAINER] + base + ["--pipeline-schedule", "zb-h1"], capture_output=True, text=True, cwd=work)
        want = ["stage 0: F0 a0>1 F1 a1>1 g0<1 B0 W0 F2 a2>1 g1<1 B1 W1 F3 a3>1 g2<1 B2 W2 g3<1 B3 W3",
                "stage 1: a0<0 F0 B0 g0>0 a1<0 F1 B1 W0 g1>0 a2<0 F2 B2 W1 g2>0 a3<0 F3 B3 g3>0 W2 W3"]
        stages = [line for line in pr.stdout.splitlines() if line.startswith("stage ")]
        report(pr.returncode == 0 and stages == want and "bubble 1/13 = 7.7%" in pr.stdout and "1F1B's there: 3/15" in pr.stdout,
               "--pipeline-print-schedule: pp2 ZB-H1, m=4, as derived by hand; bubble 1/13 against 1F1B's 3/15 at F = B = W",
               pr.stdout[-1200:] + pr.stderr)

        # ---- impossible grids: one line, exit 2
        for ranks, flags, expect in IMPOSSIBLE_GRIDS:
            code, out, err = r.run(ranks, *flags, steps=1)
            report(code == 2 and err.count("error:") == 1 and expect in err,
                   f"{ranks} rank{'s' if ranks > 1 else ''} {' '.join(flags)}: exit 2, one line: '{expect}'",
                   f"exit {code}: {err[-500:]}")
        print(f"({r.seconds:.0f} s in the trainer)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
