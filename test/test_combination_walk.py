#!/usr/bin/env python3
"""test_combination_walk.py — every pair of techniques the compatibility table allows, trained, against its reference.

The table (llmc/run/compatibility.h) says which techniques go together; its compat_techniques() says what
each one must reproduce and how exactly. build/test_compatibility --pairs lists every allowed pair of the
28 techniques (the table's own verdicts) with the pair's reference: the pair with its most exact technique
replaced by its reference (bits first, then a number format's tolerance, then the grid's; "own" techniques,
another optimizer or model, stay in). This test trains both at the smallest shape (L=4 C=64 H=4 T=32 V=501,
4 micro-batches of 32 tokens: a pipeline of 2 stages and 2 data ranks both fit; 3 steps on the CPU trainer,
4 on the GPU's) and compares their --dump-state files (losses, the first step's logits and gradient, the
final weights):

  bits        every element of the four, to the bit
  grid        the grid tests' bounds: test_parallelism.py's on the CPU trainer (with test_optimizers.py's
              mask of the key biases for Adafactor and SM3), test_gpu_parallelism.py's on the bf16 GPU build,
              test_gpu.py's FP32_TOL and test_fp16.py's FP16_TOL on the fp32 and fp16 builds
  bf16, bf16-stash, bf16-sum   a bf16 rounding (master weights off, the stash, the compressed sum):
              test_gpu.py's BF16_TOL, which holds every value rounded to bf16
  fp8, fp8-stash, fp16, fp32   test_fp8.py's FP8_TOL, test_fp16.py's FP16_TOL, test_gpu.py's FP32_TOL
  a+b         the looser of the two, bound by bound

The GPU trainer runs on the CPU emulation (test/emu/, a GPU per rank: NCCL's path). Every CPU pair runs;
an emulated run costs ~10 CPU runs, so CI runs a fixed rotation of the GPU pairs (one in GPU_SHARE, chosen
by the commit's hash; the output names the share and the pairs), and WALK_ALL=1 runs all of them. A run is
made once and shared by every pair and reference with the same flags. The last lines count pairs allowed,
run and equal. Two own x own pairs the table lets through (MoE with Adafactor or SM3) have no reference
run here: test_moe_trainer.py checks them against its own statistics (a SKIP line each).

Cost (2026-12-06, this 2-core machine shared, load 2-6): CI's mode, 93 CPU pairs and 18 GPU pairs in 176
distinct runs, 181 s of CPU time, 195 s wall. Every GPU pair once (WALK_ALL=1, in batches under load):
143 of 143 equal after the fp8 fix, with two interleaved pairs refused then (below; lifted since).

Planted bugs that the walk caught and the techniques' own tests did not (by hand, one at a time, in a
copy of the tree, 2026-12-06): --recompute 2's LayerNorm rebuilt from the flat weights instead of the
layer's view (zero-3 x recompute crashed, interleaved x recompute not bit-identical; test_parallelism,
test_pipeline_interleaved, test_pipeline_zb_h1 and test_stash_precision passed every check of numbers,
failing only 4 bubble timings on a machine at load 38); the bf16-moments AdamW updating the flat weights
instead of the piece's home (zero-3 x bf16-moments crashed; test_optimizers, test_disk_offload and
test_data_parallel passed, 121 checks). And two real ones: --precision fp8 --tensor-parallel 2 at C = 64
(the cuBLASLt stand-in refused an output 16, not 256, bytes aligned; test_fp8.py's tensor-parallel check
runs C = 128: fixed, llmc/kernels/fp8.cuh), and the GPU's interleaved schedule with --tensor-parallel 2
(the tensor ranks' copies of wpe's gradient differed, so the dump refused) and in the fp16 build (losses
4.4e-2 off from step 2), now and then: one bug, of the NCCL stand-in, not the trainer. On 2 stages a group
holds two receives from one peer of the same size (an activation and a gradient), and the stand-in posted
their data's receives in the order it saw their headers, so under load it swapped them (fixed in
test/emu/nccl_standin.cpp; test_emu_nccl.py's 'pair' cases show it, polled last first). A third plant, bf16 moments rounded with a rank's shard offset as the key instead of the
element's index, the walk caught from step 3 on (zero-1 x bf16-moments; why the CPU runs 3 steps), and so
did test_optimizers (its dp2 ZeRO-1 == one rank check failed, the weights 5.0e-5 apart).
"""
import os, re, shutil, subprocess, sys, tempfile, time, resource
from concurrent.futures import ThreadPoolExecutor
import numpy as np
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from safetensors_io import read_safetensors  # noqa: E402
from test_data_parallel import write_shard  # noqa: E402
from test_gpu import write_model, rel, cosine, BF16_TOL, FP32_TOL  # noqa: E402
from test_fp16 import FP16_TOL  # noqa: E402
from test_fp8 import FP8_TOL  # noqa: E402
import test_parallelism as tpar  # noqa: E402
import test_gpu_parallelism as tgp  # noqa: E402
from test_optimizers import not_key_biases  # noqa: E402

LIST = os.path.join(ROOT, "build", "test_compatibility")
CPU = os.path.join(ROOT, "train_gpt_cpu")
GPU = {"bf16": os.path.join(ROOT, "build", "emu", "train_gpt"), "fp32": os.path.join(ROOT, "build", "emu", "train_gpt_fp32"),
       "fp16": os.path.join(ROOT, "build", "emu", "train_gpt_fp16")}
L, C, H, T, V = 4, 64, 4, 32, 501
STEPS = {"cpu": 3, "gpu": 4}  # (CPU 3: a planted bf16-moments rounding bug showed from step 3 only; GPU 4: its
# bounds on the weight change were measured over 6-10 steps, and at 2 AdamW's first updates, lr x sign(g), made
# fp8's rounding a 0.34 relative change of the weights against the CPU's, 0.25 at 4)
GPU_SHARE = 8  # CI runs one GPU pair in GPU_SHARE (chosen by the commit's hash)

# The CPU's bounds (test_parallelism.py's differences(): losses relative, gradient and logits relative to their
# max, weights absolute); the GPU's (test_gpu.py's compare: losses absolute, gradient, logits and the weight
# change relative L2, the gradient's cosine).
CPU_GRID = dict(loss=tpar.TOL_LOSS_REL, grad=tpar.TOL_GRAD_REL, param=tpar.TOL_PARAM_ABS, logit=tpar.TOL_LOGIT_REL)
GPU_GRID = dict(logits=tgp.TOL_LOGITS, grads=tgp.TOL_GRAD, cosine=tgp.TOL_COS, losses=tgp.TOL_LOSS, update=tgp.TOL_UPDATE)
GPU_TOL = {"grid": GPU_GRID, "bf16": BF16_TOL, "fp8": FP8_TOL, "fp16": FP16_TOL, "fp32": FP32_TOL, "fp8-stash": FP8_TOL,
           "bf16-sum": BF16_TOL, "bf16-stash": BF16_TOL}
GPU_GRID_OF_BUILD = {"bf16": GPU_GRID, "fp32": FP32_TOL, "fp16": FP16_TOL}


def loosest(tols):
    """Bound by bound, the loosest of several (cosine: the smallest)."""
    out = {}
    for t in tols:
        for k, v in t.items():
            out[k] = v if k not in out else (min(out[k], v) if k == "cosine" else max(out[k], v))
    return out


class Runs:
    """Each distinct run (trainer, build, flags) once; its dump read back, or the error it ended with."""

    def __init__(self, work):
        self.work, self.results, self.cpu_seconds = work, {}, 0.0
        self.model = write_model(os.path.join(work, "model.bin"), L, C, H, T, V, 7)
        rng = np.random.default_rng(7)
        write_shard(os.path.join(work, "train_000000.bin"), np.tile(rng.integers(0, V, 97), 40))

    def command(self, key, k):
        trainer, build, flags, steps = key
        words = flags.split()
        ranks = 1
        args = []
        i = 0
        while i < len(words):
            w = words[i]
            v = words[i + 1] if i + 1 < len(words) and not words[i + 1].startswith("--") else None
            if w == "--estimate-ranks":
                ranks *= int(v)
            else:
                if w in ("--tensor-parallel", "--pipeline-parallel"):
                    ranks *= int(v)
                if w == "--offload-dir":
                    v = os.path.join(self.work, f"offload{k}")
                    os.makedirs(v, exist_ok=True)
                args += [w] + ([v] if v is not None else [])
            i += 2 if v is not None else 1
        exe = CPU if trainer == "cpu" else GPU[build]
        # (a MoE run builds its model from the spec: the model file is dense)
        model = f"L={L},C={C},H={H},T={T},V={V}" if "--moe-experts" in flags else os.path.join(self.work, "model.bin")
        common = ["--model", model, "--train-data", os.path.join(self.work, "train_*.bin"),
                  "--val-data", "none", "--sample-every", "0", "--seq-len", str(T), "--batch-size", "1",
                  "--total-batch-tokens", str(4 * T), "--steps", str(steps), "--lr", "1e-3",
                  "--out-dir", os.path.join(self.work, f"out{k}"), "--dump-state", os.path.join(self.work, f"dump{k}.st")]
        if trainer == "cpu":
            common += ["--threads", "1"]
        return ["timeout", "300", shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", str(ranks),
                exe] + common + args

    def run_one(self, key, k):
        cmd = self.command(key, k)
        env = dict(os.environ, CUDA_EMU_DEVICES=cmd[6])  # (the emulated GPU trainer: one GPU a rank, NCCL's path)
        p = subprocess.run(cmd, cwd=self.work, capture_output=True, text=True, env=env)
        path = cmd[cmd.index("--dump-state") + 1]
        if p.returncode != 0 or not os.path.exists(path):
            return RuntimeError(f"exit {p.returncode}: {' '.join(cmd[6:])}\n{(p.stdout + p.stderr)[-1500:]}")
        result = read_safetensors(path)[0]
        os.remove(path)
        return result

    def start(self, keys, pool):
        """Every distinct run, 2 at a time (2 cores); returns key -> future."""
        futures = {}
        for key in keys:
            if key not in futures:
                futures[key] = pool.submit(self.run_one, key, len(futures))
        return futures


def bitwise(a, b):
    bad = [k for k in ("losses", "params", "grads", "logits") if a[k].shape != b[k].shape or not np.array_equal(a[k], b[k])]
    return not bad, ("not bit-identical: " + ", ".join(bad)) if bad else "bit for bit"


def within_cpu(a, b, tol, factored):
    if any(a[k].shape != b[k].shape for k in ("losses", "params", "grads", "logits")):
        return False, "the dumps' shapes differ"
    if factored:  # (the key biases' gradient is 0 up to rounding, which Adafactor and SM3 scale up: test_optimizers.py)
        keep = not_key_biases(a["params"].size, L, C, T)
        a, b = dict(a, params=a["params"][keep]), dict(b, params=b["params"][keep])
    loss, grad, param, logit = tpar.differences(a, b)
    ok = loss <= tol["loss"] and grad <= tol["grad"] and param <= tol["param"] and logit <= tol["logit"]
    return ok, f"losses {loss:.1e}, grads {grad:.1e}, weights {param:.1e}, logits {logit:.1e} (bounds {tol})"


def within_gpu(a, b, tol, init, factored=False):
    if any(a[k].shape != b[k].shape for k in ("losses", "params", "grads", "logits")):
        return False, "the dumps' shapes differ"
    P = min(len(init), len(a["params"]))
    if factored:  # (the key biases left out of the weight change, as test_gpu_factored.py does: see within_cpu)
        keep = not_key_biases(P, L, C, T)
        a, b, init = dict(a, params=a["params"][:P][keep]), dict(b, params=b["params"][:P][keep]), init[:P][keep]
        P = len(init)
    lo = rel(a["logits"], b["logits"])
    g, c = rel(a["grads"], b["grads"]), cosine(a["grads"], b["grads"])
    ls = float(np.max(np.abs(a["losses"].astype(np.float64) - b["losses"])))
    up = rel(a["params"][:P] - init, b["params"][:P] - init)
    ok = lo <= tol["logits"] and g <= tol["grads"] and c >= tol["cosine"] and ls <= tol["losses"] and up <= tol["update"]
    return ok, f"logits {lo:.1e}, grads {g:.1e} cos {c:.6f}, losses {ls:.1e}, weight change {up:.1e}"


def needs_start_weights(p):
    """A MoE pair compared by its weight change (test_gpu.py's bounds) builds its weights from the spec: a run
    of its reference at lr 0 reads them back."""
    trainer, exact, rflags = p[0], p[2], p[7]
    return "--moe-experts" in rflags and exact != "bits" and not (trainer == "cpu" and exact == "grid")


def commit_hash():
    p = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    return p.stdout.strip() if p.returncode == 0 else "0"


def main():
    missing = [p for p in [LIST, CPU] if not os.path.exists(p)]
    if missing or not shutil.which("mpirun"):
        print(f"SKIP: the combination walk (needs mpirun and {', '.join(missing) or 'mpirun'})")
        return 0
    no_gpu = [p for p in GPU.values() if not os.path.exists(p)]
    listing = subprocess.run([LIST, "--pairs"], capture_output=True, text=True, check=True).stdout
    pairs = [line.split("\t") for line in listing.splitlines() if line]
    # trainer, name, exact, build, flags, reference trainer, its build, its flags
    elsewhere = [p for p in pairs if p[2] == "elsewhere"]  # (own x own the table lets through: their own tests check them)
    for p in elsewhere:
        print(f"SKIP: {p[0]} {p[1]} (no reference run: test_moe_trainer.py checks it against its own statistics)")
    pairs = [p for p in pairs if p[2] != "elsewhere"]
    cpu_pairs = [p for p in pairs if p[0] == "cpu"]
    gpu_pairs = [p for p in pairs if p[0] == "gpu"]
    h = commit_hash()
    if os.environ.get("WALK_ONLY"):  # (a pattern of the pairs to run: for measuring and planted bugs)
        cpu_pairs = [p for p in cpu_pairs if re.search(os.environ["WALK_ONLY"], p[0] + " " + p[1])]
        gpu_pairs = [p for p in gpu_pairs if re.search(os.environ["WALK_ONLY"], p[0] + " " + p[1])]
    if os.environ.get("WALK_ALL"):
        chosen, share = gpu_pairs, "all"
    else:
        slot = int(h[:8], 16) % GPU_SHARE if h != "0" else 0
        chosen = [p for n, p in enumerate(gpu_pairs) if n % GPU_SHARE == slot]
        share = f"rotation {slot} of {GPU_SHARE} (commit {h[:10]})"
    if no_gpu:
        print(f"SKIP: the walk's GPU pairs (needs {', '.join(no_gpu)}: make emu)")
        chosen = []
    print(f"the walk: {len(cpu_pairs)} CPU pairs (all), {len(chosen)} of {len(gpu_pairs)} GPU pairs ({share}); "
          "WALK_ALL=1 runs every GPU pair", flush=True)
    for p in chosen:
        print(f"  gpu: {p[1]}", flush=True)
    work = tempfile.mkdtemp(prefix="combination_walk_")
    try:
        runs = Runs(work)
        start = time.time()
        todo = cpu_pairs + chosen
        keys = []
        for p in todo:
            n = STEPS[p[0]]
            keys += [(p[0], p[3], p[4], n), (p[5], p[6], p[7], n)]
            if needs_start_weights(p):
                keys.append((p[5], p[6], p[7] + " --lr 0", n))
        pool = ThreadPoolExecutor(2)
        futures = runs.start(keys, pool)
        init = runs.model[0]
        equal, failed_names = 0, []
        for p in todo:  # (each pair reported as soon as its two runs are done)
            for key in [(p[0], p[3], p[4], STEPS[p[0]]), (p[5], p[6], p[7], STEPS[p[0]])]:
                runs.results[key] = futures[key].result()
            if needs_start_weights(p):
                key = (p[5], p[6], p[7] + " --lr 0", STEPS[p[0]])
                runs.results[key] = futures[key].result()
            trainer, name, exact, build, flags, rtrainer, rbuild, rflags = p
            n = STEPS[trainer]
            got, ref = runs.results[(trainer, build, flags, n)], runs.results[(rtrainer, rbuild, rflags, n)]
            tag = f"{trainer} {name} == its reference ({rtrainer}{' ' + rbuild if rtrainer == 'gpu' else ''}: " \
                  f"{rflags or 'one rank, none of the two'}), {exact}"
            if isinstance(got, Exception) or isinstance(ref, Exception):
                why = str(got if isinstance(got, Exception) else ref)
                report(False, tag, why)
                failed_names.append(name)
                continue
            if exact == "bits":
                ok, what = bitwise(got, ref)
            elif trainer == "cpu" and exact == "grid":
                ok, what = within_cpu(got, ref, CPU_GRID, "--optimizer" in rflags)
            else:
                tols = [GPU_GRID_OF_BUILD[build] if e == "grid" else GPU_TOL[e] for e in exact.split("+")]
                start_weights = init
                if "--moe-experts" in rflags:  # (the weights the spec builds: a run at lr 0 keeps them)
                    start_weights = runs.results[(rtrainer, rbuild, rflags + " --lr 0", n)]
                    start_weights = None if isinstance(start_weights, Exception) else start_weights["params"]
                ok, what = within_gpu(got, ref, loosest(tols), start_weights, "--optimizer" in rflags) if start_weights is not None else \
                    (False, "no run at lr 0 to read the initial weights from")
            report(ok, tag, what, what)
            equal += ok
            if not ok:
                failed_names.append(name)
        pool.shutdown()
        ru = resource.getrusage(resource.RUSAGE_CHILDREN)
        runs.cpu_seconds = ru.ru_utime + ru.ru_stime
        allowed = len(pairs) + len(elsewhere)
        print(f"the walk: {allowed} pairs allowed, {len(todo)} run ({len(cpu_pairs)} CPU, {len(chosen)} GPU), {equal} equal "
              f"to their references; {len(runs.results)} distinct runs, {runs.cpu_seconds:.0f} s CPU time, "
              f"{time.time() - start:.0f} s wall", flush=True)
        report(equal == len(todo), f"the walk: {equal} of {len(todo)} pairs run equal their references",
               "not: " + ", ".join(failed_names))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
