#!/usr/bin/env python3
"""test_between_steps.py — what happens between two steps leaves the training alone, bit for bit.

Between two optimizer steps a run may validate, sample, score HellaSwag, write a checkpoint, and the
whole time it may record --trace and --profile. None of that may touch what the next step computes:
the training data loader's position, the weights, the optimizer's state, a schedule's weight versions
or activations in flight, the RNG of a stochastic rounding. A forward pass that shares the step's
buffers, a sample that leaves its KV state or its logits where the step reads, an evaluation that reads
one batch too many from the wrong loader: each is a small bug that every technique's own test misses,
since they train with `--val-data none` and no samples (issue 42, item 2).

So each configuration below trains 6 steps twice, from the same seed:
  plain    no validation, sample, HellaSwag, checkpoint, trace or profile;
  events   a sample (4 tokens) every 2 steps, a checkpoint every 3, HellaSwag (3 examples) every 4,
           validation every 5 (each also at the end; HellaSwag and validation also at step 0),
           --trace, and --profile on the CPU trainer (every step);
and then
  resumed  from the events run's step-3 checkpoint, with the same events, to step 6;
and demands, bit for bit: the events run's losses (--dump-state's; metrics.jsonl's step records with
the lr, gradient norm, loss scale and MoE routing, as printed), step-1 gradient,
first logits and final weights are the plain run's; the resumed run's losses are the plain run's
steps 4-6, its final weights the plain run's, and its step-6 checkpoint's model.bin the events run's.
The events run must also show that every event happened (its val and hellaswag records, the samples,
the checkpoints, the trace files, the profile), so that a flag that stops working cannot pass as
"changed nothing". The periods differ so that each kind of event is alone after one step (2, 3, 5;
HellaSwag with a sample after 4): a technique that must prepare for each kind (PipeDream-2BW drains its
pipeline: llmc/run/run.h, pipeline_drains_after) cannot pass because another kind came at the same
step; after step 1 nothing happens, so 2BW runs it undrained, the next step's forwards in flight.

One events run per value of each axis, not their product; plain runs are shared where the code
promises the same bits (test_parallelism.py, test_pipeline_zb_h1.py, test_pipeline_interleaved.py:
GPipe == 1F1B == ZB-H1 == interleaved; test_pipeline_2bw.py: 2bw-flush == 2bw):
  CPU trainer (fp32), one rank, 2 micro-batches:  AdamW; AdamW with bf16 moments; Adafactor; SM3;
                                                  AdamW on a top-2 MoE of 2 experts
  CPU trainer over MPI, 2 pipeline stages:        gpipe, 1f1b, interleaved (2 chunks), zb-h1, 2bw, 2bw-flush
  GPU trainer (emulated without a GPU, test/emu): bf16 AdamW; bf16 AdamW with bf16 moments; bf16 SM3;
                                                  fp32 Adafactor; fp16 AdamW (loss scaling); fp8 AdamW;
                                                  bf16 AdamW with --cuda-graphs; bf16 AdamW, top-2 MoE;
                                                  2 pipeline stages: 1f1b, 2bw
The model is byte-level (test_hellaswag.py's vocabulary, V=258), L=4 C=32 H=4 T=32 on the CPU
(4 layers: 2 stages of 2 chunks) and L=2 C=64 H=4 T=32 on the GPU (L=4 for its pipelines). Validation
is sized by an explicit flag (--val-tokens where the trainer has it, else --val-batches): no default
is relied on.
Cost: 59 trainer runs (21 configurations, each an events and a resumed run; 17 plain runs, the 11 CPU
configurations sharing 7), measured at 94 s of CPU time, user + system of the trainers and mpirun
(the machine was shared: its wall time, 5 to 9 min, says nothing); about 1.6 minutes on a
quiet 2-core machine.
Bugs caught:
  - a real one: --precision fp8's evaluations recorded their amax into the training's delayed scaling
    (and calibrated step 1's scales from it): the fp8 run's losses left the plain run's at step 3, and
    the resumed run's with them. Fixed in llmc/kernels/fp8.cuh (fp8_evaluation_begin, _end).
  - planted, in a scratch copy, then reverted: validation (and HellaSwag) reading one batch of the
    training data loader (a forward lambda in train_gpt_cpu.cpp's cpu_run_passes): all 20 CPU checks
    failed; pipeline_drains_after forgetting the sample (llmc/run/run.h): the 2bw checks failed (2bw
    runs the sample's forward with the next step's micro-batch in flight), every other configuration
    passed, as it should (with every event at the same steps this one passed: the periods above
    differ for it); Adafactor's and SM3's checkpoint moving the optimizer state out instead of copying
    it (s->factored = std::move(...)): the trainer crashed at the step after the mid-run checkpoint,
    which a test that checkpoints only at a run's end never reaches.
"""
import glob, json, os, shutil, subprocess, sys, tempfile, time
from checks import report, exit_code
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from safetensors_io import read_safetensors  # noqa: E402
from test_hellaswag import SENTENCES, examples, write_jsonl, write_vocab  # noqa: E402
from token_shards import write_shard  # noqa: E402

CPU = os.path.join(ROOT, "train_gpt_cpu")
STEPS, T = 6, 32
# Each event every N steps (and at the end), N chosen so that each is alone before one step: a
# technique that must prepare for one kind of event (2BW drains its pipeline for each) cannot pass
# because another kind came at the same step. Step 1 has none after it: 2BW runs it undrained.
#   after step:  1    2       3           4                  5
#                -    sample  checkpoint  sample, HellaSwag  validation
SAMPLE_EVERY, CHECKPOINT_EVERY, HELLASWAG_EVERY, VAL_EVERY = 2, 3, 4, 5
CPU_MODEL = "L=4,C=32,H=4,T=32,V=258"
GPU_MODEL, GPU_PIPE_MODEL = "L=2,C=64,H=4,T=32,V=258", "L=4,C=64,H=4,T=32,V=258"


def pipe(schedule, chunks=1):
    return ["--pipeline-parallel", 2, "--pipeline-schedule", schedule] + (["--virtual-stages", chunks] if chunks > 1 else [])


# (name, ranks, flags, the configuration whose plain run it is compared with)
CPU_CONFIGS = [
    ("cpu AdamW", 1, [], "cpu AdamW"),
    ("cpu AdamW bf16 moments", 1, ["--optimizer-state", "bf16"], "cpu AdamW bf16 moments"),
    ("cpu Adafactor", 1, ["--optimizer", "adafactor"], "cpu Adafactor"),
    ("cpu SM3", 1, ["--optimizer", "sm3"], "cpu SM3"),
    ("cpu MoE top-2", 1, ["--moe-experts", 2, "--moe-top-k", 2], "cpu MoE top-2"),  # (routing statistics per step)
    ("cpu pp2 gpipe", 2, pipe("gpipe"), "cpu pp2 1f1b"),
    ("cpu pp2 1f1b", 2, pipe("1f1b"), "cpu pp2 1f1b"),
    ("cpu pp2 interleaved", 2, pipe("interleaved", 2), "cpu pp2 1f1b"),
    ("cpu pp2 zb-h1", 2, pipe("zb-h1"), "cpu pp2 1f1b"),
    ("cpu pp2 2bw", 2, pipe("2bw"), "cpu pp2 2bw"),
    ("cpu pp2 2bw-flush", 2, pipe("2bw-flush"), "cpu pp2 2bw"),
]

# (name, build, ranks, flags): each compared with its own plain run
GPU_CONFIGS = [
    ("gpu bf16 AdamW", "bf16", 1, []),
    ("gpu bf16 AdamW bf16 moments", "bf16", 1, ["--optimizer-state", "bf16"]),
    ("gpu bf16 SM3", "bf16", 1, ["--optimizer", "sm3"]),
    ("gpu fp32 Adafactor", "fp32", 1, ["--optimizer", "adafactor"]),
    ("gpu fp16 AdamW", "fp16", 1, []),
    ("gpu fp8 AdamW", "bf16", 1, ["--precision", "fp8"]),
    ("gpu bf16 AdamW CUDA graphs", "bf16", 1, ["--cuda-graphs"]),  # (evaluations run eagerly between replays)
    ("gpu bf16 MoE top-2", "bf16", 1, ["--moe-experts", 2, "--moe-top-k", 2]),
    ("gpu pp2 1f1b", "bf16", 2, pipe("1f1b")),
    ("gpu pp2 2bw", "bf16", 2, pipe("2bw")),
]


def gpu_builds():
    """The GPU trainer's builds: the native ones on a machine with a GPU, the emulated ones otherwise."""
    from test_gpu import MODE
    if MODE == "gpu":
        return MODE, {"bf16": os.path.join(ROOT, "train_gpt"), "fp32": os.path.join(ROOT, "train_gpt_fp32"),
                      "fp16": os.path.join(ROOT, "train_gpt_fp16")}
    emu = os.path.join(ROOT, "build", "emu")
    return MODE, {"bf16": os.path.join(emu, "train_gpt"), "fp32": os.path.join(emu, "train_gpt_fp32"),
                  "fp16": os.path.join(emu, "train_gpt_fp16")}


class Fixture:
    """The data, vocabulary and HellaSwag file every run shares, and the flag that sizes validation."""

    def __init__(self, work):
        self.work = work
        write_vocab(os.path.join(work, "vocab"))
        text = (" ".join(SENTENCES) + " ") * 60
        write_shard(os.path.join(work, "train_000.bin"), list(text.encode()))
        write_shard(os.path.join(work, "val_000.bin"), list(text[::-1].encode()))  # other text than training's
        write_jsonl(os.path.join(work, "hellaswag.jsonl"), examples()[:3])
        self.cpu_seconds = 0.0  # the children's CPU time, user + system (the machine is shared: wall time says little)

    def val_size(self, exe):
        """Validation of 2 micro-batches, by whichever flag the trainer has (issue 42: --val-tokens may replace
        --val-batches' count)."""
        flags = subprocess.run([exe, "--help-all"], capture_output=True, text=True).stdout
        return ["--val-tokens", 2 * T] if "--val-tokens" in flags else ["--val-batches", 2]

    def run(self, exe, ranks, flags, name, events, gpu):
        """Trains STEPS steps into work/<name>/; returns (dump, metrics records, stdout) or None after a FAIL."""
        out = os.path.join(self.work, name.replace(" ", "_"))
        dump = out + ".st"
        common = ["--model", GPU_PIPE_MODEL if gpu and ranks > 1 else GPU_MODEL if gpu else CPU_MODEL,
                  "--train-data", os.path.join(self.work, "train_*.bin"), "--tokenizer", os.path.join(self.work, "vocab"),
                  "--batch-size", 1, "--seq-len", T, "--total-batch-tokens", 2 * T, "--steps", STEPS, "--lr", 1e-3,
                  "--out-dir", out, "--dump-state", dump]
        common += ["--attention", "simple"] if gpu else ["--threads", 1]
        if events:
            common += ["--val-data", os.path.join(self.work, "val_*.bin"), "--val-every", VAL_EVERY] + self.val_size(exe)
            common += ["--sample-every", SAMPLE_EVERY, "--sample-tokens", 4, "--hellaswag", os.path.join(self.work, "hellaswag.jsonl"),
                       "--hellaswag-every", HELLASWAG_EVERY, "--checkpoint-every", CHECKPOINT_EVERY,
                       "--trace", os.path.join(out, "trace.json")]
            common += [] if gpu else ["--profile"]
        else:
            common += ["--val-data", "none"]
        cmd = [exe] + [str(f) for f in common + flags]
        if ranks > 1:
            cmd = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)] + cmd
        before = os.times()
        p = subprocess.run(["timeout", "300"] + cmd, capture_output=True, text=True, cwd=self.work,
                           env=dict(os.environ, LLMC_HOST_STAGED="1"))
        after = os.times()
        self.cpu_seconds += (after.children_user - before.children_user) + (after.children_system - before.children_system)
        if p.returncode != 0 or not os.path.exists(dump):
            report(False, name, f"the trainer exited with {p.returncode}: {' '.join(cmd)}\n{(p.stdout + p.stderr)[-3000:]}")
            return None
        records = [json.loads(line) for line in open(os.path.join(out, "metrics.jsonl"))]
        return read_safetensors(dump)[0], records, p.stdout, out


def step_records(records):
    """metrics.jsonl's step records as the training made them: loss, lr, gradient norm, the loss scale
    and MoE's auxiliary losses and routing where there are any; not the times, rates and memory."""
    clock = ("ms", "tok_s", "mfu", "mem_mb")
    return [{k: v for k, v in r.items() if k not in clock} for r in records if r["type"] == "step"]


def differing(a, b, keys):
    return [k for k in keys if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]


def events_seen(records, stdout, out, gpu):
    """What the events run should have done; a list of what it did not."""
    missing = []
    for kind, every in (("val", VAL_EVERY), ("hellaswag", HELLASWAG_EVERY)):
        steps, want = [r["step"] for r in records if r["type"] == kind], list(range(0, STEPS, every)) + [STEPS]
        if steps != want:
            missing.append(f"{kind} records at steps {steps}, not {want}")
    samples = len(range(SAMPLE_EVERY, STEPS, SAMPLE_EVERY)) + 1  # (none at step 0: llmc/run/run.h's is_sample_step)
    if stdout.count("sample:") != samples:
        missing.append(f"{stdout.count('sample:')} samples, not {samples}")
    for step in (CHECKPOINT_EVERY, STEPS):
        if not os.path.exists(os.path.join(out, f"ckpt_{step:08d}", "model.bin")):
            missing.append(f"no checkpoint at step {step}")
    if not glob.glob(os.path.join(out, "trace*.json")):
        missing.append("no trace file")
    if not gpu and "profile: median of steps" not in stdout:
        missing.append("no profile table")
    return missing


def check_config(fx, name, exe, ranks, flags, plain, gpu):
    """The events run and the run resumed from its step-2 checkpoint against the plain run."""
    if plain is None:
        return
    ref, ref_records, _, _ = plain
    got = fx.run(exe, ranks, flags, name + " events", True, gpu)
    if got is None:
        return
    dump, records, stdout, out = got
    missing = events_seen(records, stdout, out, gpu)
    bad = differing(dump, ref, ("losses", "grads", "logits", "params"))
    if step_records(records) != step_records(ref_records):
        bad.append(f"metrics.jsonl's steps {step_records(records)} vs {step_records(ref_records)}")
    report(not bad and not missing, f"{name}: validation, samples, HellaSwag, checkpoints, --trace"
           f"{'' if gpu else ', --profile'} between steps leave the {STEPS} steps' losses, step-1 gradient, logits "
           "and final weights bit for bit", "; ".join((["not bit-identical: " + ", ".join(bad)] if bad else []) + missing))
    resumed = fx.run(exe, ranks, flags + ["--resume", os.path.join(out, f"ckpt_{CHECKPOINT_EVERY:08d}")], name + " resumed", True, gpu)
    if resumed is None:
        return
    rdump, rrecords, _, rout = resumed
    bad = differing(rdump, {"params": ref["params"], "losses": ref["losses"][CHECKPOINT_EVERY:]}, ("params", "losses"))
    if step_records(rrecords) != step_records(ref_records)[CHECKPOINT_EVERY:]:
        bad.append(f"metrics.jsonl's steps {step_records(rrecords)}")
    final = [open(os.path.join(d, f"ckpt_{STEPS:08d}", "model.bin"), "rb").read() for d in (out, rout)]
    if final[0] != final[1]:
        bad.append(f"step-{STEPS} checkpoint's model.bin")
    report(not bad, f"{name}: resumed from the step-{CHECKPOINT_EVERY} checkpoint (with the events) == the plain run bit for bit "
           f"(losses of steps {CHECKPOINT_EVERY + 1}-{STEPS}, final weights, the step-{STEPS} checkpoint)", "differ: " + ", ".join(bad))


def main():
    only = sys.argv[1:]  # (debugging: only the configurations whose name contains one of these)
    chosen = lambda name: not only or any(x in name for x in only)
    work = tempfile.mkdtemp(prefix="llmc_between_steps_")
    fx = Fixture(work)
    start = time.time()
    try:
        # ---- the CPU trainer
        if not os.path.exists(CPU):
            print("SKIP: cpu trainer's events (train_gpt_cpu not built)")
        else:
            have_mpi = shutil.which("mpirun") and "libmpi" in subprocess.run(["ldd", CPU], capture_output=True, text=True).stdout
            needed = {c[3] for c in CPU_CONFIGS if chosen(c[0]) and (c[1] == 1 or have_mpi)}
            plains = {name: fx.run(CPU, ranks, flags, name + " plain", False, False)
                      for name, ranks, flags, _ in CPU_CONFIGS if name in needed}
            for name, ranks, flags, key in filter(lambda c: chosen(c[0]), CPU_CONFIGS):
                if ranks > 1 and not have_mpi:
                    print(f"SKIP: {name} (needs mpirun and an MPI build of train_gpt_cpu)")
                    continue
                check_config(fx, name, CPU, ranks, flags, plains[key], False)
        # ---- the GPU trainer (its own builds, emulated without a GPU)
        mode, builds = gpu_builds()
        for name, build, ranks, flags in filter(lambda c: chosen(c[0]), GPU_CONFIGS):
            exe = builds[build]
            if mode is None or not os.path.exists(exe) or (ranks > 1 and not shutil.which("mpirun")):
                print(f"SKIP: {name} (needs {exe}: make emu without a GPU{', and mpirun' if ranks > 1 else ''})")
                continue
            check_config(fx, name, exe, ranks, flags, fx.run(exe, ranks, flags, name + " plain", False, True), True)
        print(f"(children's CPU time {fx.cpu_seconds:.1f} s, wall {time.time() - start:.1f} s)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
