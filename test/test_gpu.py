#!/usr/bin/env python3
"""The GPU trainer against the CPU reference, against itself, and across its options.

Without a GPU (nvidia-smi missing or listing none) every GPU check prints SKIP; the checks that need
no GPU (flags, --estimate, the no-GPU error) run everywhere. With one:

  gpu vs cpu       ./train_gpt (bf16) and ./train_gpt_cpu (fp32) on the same model file and batches:
                   logits, loss, every gradient tensor, and a few AdamW steps, for four shapes:
                     tiny   L=2 C=128 H=2 (hs 64) T=64, V=500 (padded to 512)
                     odd    L=2 C=160 H=2 (hs 80) T=50, B=3: nothing a multiple of 64 or of a block
                     wide   L=1 C=1600 H=25: d48's width (200 threads a LayerNorm row: 7 warps, one partial)
                     d12    GPT-2 small, V=50257, B=1 T=64
                   each with cuDNN attention and (tiny, odd) with the simple attention, so a cuDNN
                   failure does not hide whether the other kernels are right
  fp32 vs cpu      ./train_gpt_fp32 (the same kernels in fp32) against the CPU, tightly
  determinism      two runs with the same flags: bit-identical dumps
  resume           20 steps == 10 steps + resume + 10 steps, bit for bit (weights, losses, checkpoint
                   files, the sampler's state)
  recompute        --recompute 1, 2: bit-identical (recompute is exact); 0, whose GELU runs in
                   cuBLASLt's epilogues (GELU_AUX_BIAS, DGELU_BGRAD), against the CPU (tiny, odd)
  attention        --attention cudnn vs simple agree within bf16 tolerance
  memory           a batch that cannot fit fails before training, naming the largest that would
  precision        --precision other than the binary's build: one line naming the build to run, exit 2

Without a GPU, the same checks run on the CPU emulation of CUDA (test/emu/: build/emu/train_gpt,
every kernel executed thread by thread, cuBLAS and NCCL stood in for) with three differences:
cuDNN is not emulated, so every run uses --attention simple and the cuDNN checks are SKIP (one
check instead: a cuDNN that refuses the graph costs a line and the simple path, not the run); the
determinism check's second run uses another schedule (threads and blocks in reverse), so a race
between threads shows up as a difference; and the recompute levels run under random schedules.

Every check runs on its own: a trainer that crashes fails the checks that needed its output and
the others still run, so one GPU session sees everything that is wrong at once. PASS lines carry
the measured errors, to judge the margins.

Tolerances (bf16 run vs fp32 reference), relative L2 errors ||gpu - cpu|| / ||cpu||. bf16 keeps 8
significant bits: every stored activation or gradient carries a rounding error up to 2^-9 = 0.2%,
and errors from independent roundings add like a random walk. test/bf16_error_model.py measures
the expected discrepancy by running the same model in PyTorch twice, once rounding to bf16 exactly
where the GPU trainer stores bf16 tensors: logits 0.5% (tiny) to 1.0% (d12), gradients 0.6% to 1.1%
per tensor (cosine >= 0.9999), loss within 1e-3, and the weight change after the steps below 2-5%
(it is the noisiest: Adam's first step moves every weight by +-lr whatever the gradient's size, so a
near-zero gradient whose sign bf16 flips costs 2 lr). The limits leave 3-5x margin for what the
model leaves out (the libraries' own accumulation orders, cuDNN's internal rounding): logits <= 3%,
each gradient tensor <= 5% and cosine >= 0.999, the loss within 0.02, each step's loss within 0.05,
the weight change within 15%. fp32 build vs CPU: the same formulas in another order of summation
and --use_fast_math's exp and reciprocal (~2 ulp): 1e-4 (logits) and 1e-3 (gradients).
"""
import os, shutil, subprocess, sys, tempfile
from checks import report, exit_code
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_io import read_safetensors  # noqa: E402
from token_shards import write_shard  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = os.path.join(ROOT, "train_gpt_cpu")
NATIVE_GPU = os.path.join(ROOT, "train_gpt")  # built by nvcc: runs on a real GPU


def skip(name, why):
    print(f"SKIP: {name} ({why})", flush=True)


def check(name, fn, *args):
    """Runs one group of checks. An exception (a trainer that crashed, a file it did not write) fails
    this group only; the next one still runs."""
    try:
        return fn(*args)
    except Exception as e:  # noqa: BLE001 - any failure of one check is reported, not fatal
        report(False, name, f"{type(e).__name__}: {e}"[-3000:])
        return None


def have_gpu():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def gpu_target():
    """Where the GPU checks run: ('gpu', ./train_gpt, ./train_gpt_fp32) on a real GPU, ('emulated',
    build/emu/train_gpt, ...) on the CPU emulation of CUDA, or (None, why, None) on neither."""
    if have_gpu():
        return "gpu", NATIVE_GPU, os.path.join(ROOT, "train_gpt_fp32")
    emu = os.path.join(ROOT, "build", "emu", "train_gpt")
    if os.path.exists(emu):
        return "emulated", emu, os.path.join(ROOT, "build", "emu", "train_gpt_fp32")
    return None, "no GPU, and the CUDA emulation is not built (it needs CUDA's headers and MPI)", None


MODE, GPU, GPU32 = gpu_target()
EMULATED = MODE == "emulated"
# cuDNN is not emulated: emulated runs use the simple attention wherever a real GPU would use cuDNN
DEFAULT_ATTENTION = ["--attention", "simple"] if EMULATED else []
# another schedule of the emulated threads and blocks (set for the second run of a comparison)
REVERSED = {"CUDA_EMU_THREADS": "reverse", "CUDA_EMU_BLOCKS": "reverse"}
RANDOM = {"CUDA_EMU_THREADS": "random:11", "CUDA_EMU_BLOCKS": "random:12"}


def run(cmd, expect_ok=True, env=None):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, **(env or {})))
    if expect_ok and p.returncode != 0:
        # the error first (tables cut long lines), then the command and its output
        error = " | ".join(line for line in p.stderr.strip().splitlines()[-4:] if line.strip())
        raise RuntimeError(f"{os.path.basename(cmd[0])} exited with {p.returncode}: {error}\ncommand: {' '.join(cmd)}\n"
                           f"{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


def require_trainers(what):
    """A test that compares the GPU trainer's builds with the CPU trainer: SKIP (exit 0) without a GPU or
    the emulation; a FAIL naming what to build when a binary is missing."""
    if MODE is None:
        print(f"SKIP: {what} ({GPU})")
        sys.exit(exit_code())
    for exe in (GPU, GPU32, CPU):
        if not os.path.exists(exe):
            report(False, "binaries", f"{exe} is missing: run make (and make emu without a GPU)")
            sys.exit(exit_code())


def dump_on_ranks(exe, ranks, flags, path):
    """exe with flags on `ranks` MPI ranks (mpirun beyond one; host-staged, as the emulation's ranks share
    its one device) with --dump-state path; returns the dump."""
    launch = [shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)]
    run((launch if ranks > 1 else []) + [exe] + flags + ["--dump-state", path], env={"LLMC_HOST_STAGED": "1"})
    return read_safetensors(path)[0]


# ---------------------------------------------------------------------------------------------
# files

def layout(L, C, T, Vp):
    counts = [Vp * C, T * C, L * C, L * C, L * 3 * C * C, L * 3 * C, L * C * C, L * C,
              L * C, L * C, L * 4 * C * C, L * 4 * C, L * C * 4 * C, L * C, C, C]
    names = ["wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
             "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb"]
    offsets = np.concatenate([[0], np.cumsum(counts)])
    return names, offsets


def to_bf16_exact(x):
    """Rounds fp32 to the nearest bf16, returned as fp32 (so both trainers start from equal weights)."""
    u = x.astype(np.float32).view(np.uint32).astype(np.uint64)
    u = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    return u.astype(np.uint32).view(np.float32)


def tiny_precision_fixture(work):
    """The precision tests' model and data (test_fp16.py, test_fp8.py): L=2 C=128 H=2 T=64 V=500 in
    work/tiny.bin, a shard of 59,820 tokens; returns (init, names, offsets)."""
    model = write_model(os.path.join(work, "tiny.bin"), 2, 128, 2, 64, 500, 1)
    write_shard(os.path.join(work, "train_000000.bin"), np.tile(np.random.default_rng(1).integers(0, 500, 997), 60))
    return model


def write_model(path, L, C, H, T, V, seed):
    Vp = (V + 127) // 128 * 128
    names, off = layout(L, C, T, Vp)
    rng = np.random.default_rng(seed)
    params = np.zeros(off[-1], np.float32)
    for i, n in enumerate(names):
        size = off[i + 1] - off[i]
        if n in ("ln1w", "ln2w", "lnfw"):
            params[off[i]:off[i + 1]] = 1.0 + 0.1 * rng.standard_normal(size)
        else:
            params[off[i]:off[i + 1]] = 0.02 * rng.standard_normal(size)
    params[off[0] + V * C:off[1]] = 0.0  # padded vocab rows
    params = to_bf16_exact(params)
    header = np.zeros(256, np.int32)
    header[:8] = [20240326, 3, T, V, L, H, C, Vp]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(params.tobytes())
    return params, names, off


# ---------------------------------------------------------------------------------------------
# comparisons

def rel(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def compare_dumps(tag, got, ref, model, tol):
    init, names, off = model
    e = rel(got["logits"], ref["logits"])
    report(e <= tol["logits"], f"{tag}: logits", f"relative L2 error {e:.2e} > {tol['logits']}", f"{e:.2e}")
    dl = abs(float(got["loss"][0]) - float(ref["loss"][0]))
    report(dl <= tol["loss"], f"{tag}: loss", f"|{got['loss'][0]} - {ref['loss'][0]}| = {dl:.3g} > {tol['loss']}",
           f"{dl:.2e}")
    bad, worst = [], (0.0, "", 1.0)
    for i, n in enumerate(names):
        g, r = got["grads"][off[i]:off[i + 1]], ref["grads"][off[i]:off[i + 1]]
        if np.linalg.norm(r) == 0:
            if np.linalg.norm(g) != 0:
                bad.append(f"{n} should be zero, has norm {np.linalg.norm(g):.2e}")
            continue
        e, c = rel(g, r), cosine(g, r)
        worst = max(worst, (e, n, c))
        if e > tol["grads"] or c < tol["cosine"]:
            bad.append(f"{n} rel {e:.2e} cos {c:.5f}")
    report(not bad, f"{tag}: every gradient tensor", "; ".join(bad), f"worst {worst[1]} rel {worst[0]:.2e} cos {worst[2]:.5f}")
    dlosses = np.max(np.abs(got["losses"] - ref["losses"]))
    report(dlosses <= tol["losses"], f"{tag}: losses of {len(ref['losses'])} AdamW steps", f"max diff {dlosses:.3g}",
           f"max diff {dlosses:.2e}")
    e = rel(got["params"] - init, ref["params"] - init)
    report(e <= tol["update"], f"{tag}: weights after {len(ref['losses'])} AdamW steps",
           f"relative L2 error of the weight change {e:.2e} > {tol['update']}", f"{e:.2e}")


BF16_TOL = dict(logits=0.03, loss=0.02, grads=0.05, cosine=0.999, losses=0.05, update=0.15)
FP32_TOL = dict(logits=1e-4, loss=1e-4, grads=1e-3, cosine=0.99999, losses=1e-3, update=1e-2)


def same_bytes(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


OPTIONS_BYTES = slice(160, 964)  # state.bin's recorded options (llmc/io/formats.h: options_version, options)


def same_state_file(a, b):
    """Two state files the same but for the options they record (a reference run that stops at step
    t records --steps t; the state it saved, the header's counters, m, v and the weights, byte for byte)."""
    with open(a, "rb") as fa, open(b, "rb") as fb:
        x, y = bytearray(fa.read()), bytearray(fb.read())
    x[OPTIONS_BYTES] = y[OPTIONS_BYTES] = bytes(964 - 160)
    return x == y


# ---------------------------------------------------------------------------------------------

def checks_without_gpu():
    if not os.path.exists(NATIVE_GPU):
        skip("train_gpt flags", "train_gpt not built: no nvcc")
        return
    p = run([NATIVE_GPU, "--help-all"])  # (--help: the examples and the common flags only)
    report("--attention" in p.stdout and "--recompute" in p.stdout and "--threads" not in p.stdout,
           "train_gpt --help-all lists the GPU flags only", p.stdout[-500:])
    entry = p.stdout[p.stdout.find("  --recompute"):]
    entry = entry[:entry.find("\n  --")]
    report("[default: 1]" in entry, "train_gpt --help-all: --recompute's GPU default is 1 (the CPU trainer's is 0)", entry)
    p = run([NATIVE_GPU, "--attention", "flash"], expect_ok=False)
    report(p.returncode == 2 and "--attention" in p.stderr, "a bad --attention is a usage error", p.stderr)
    p = run([NATIVE_GPU, "--model", "d12", "--batch-size", "4", "--seq-len", "1024", "--estimate"], expect_ok=False)
    report(p.returncode == 0 and "237.4 MiB" in p.stdout and "total" in p.stdout,
           "--estimate prints the buffer table without a GPU", p.stdout[-800:] + p.stderr)


# The GPU checks. Each model is a file written here (both trainers start from the same bf16-exact
# weights) with a token shard of a small repeating "language", so the loss can fall. A run with the
# same program, model and flags is made once and its dump shared by the checks that need it.
class Setup:
    def __init__(self, tmp):
        self.tmp = tmp
        self.models, self.data, self.dumps = {}, {}, {}

    def shape(self, name, L, C, H, T, V, seed):
        rng = np.random.default_rng(seed)
        self.models[name] = write_model(f"{self.tmp}/{name}.bin", L, C, H, T, V, seed)
        base = rng.integers(0, V, 997)
        write_shard(f"{self.tmp}/{name}_train_000000.bin", np.tile(base, 60))
        self.data[name] = ["--train-data", f"{self.tmp}/{name}_train_*.bin", "--val-data", "none", "--sample-every", "0"]

    def dump_path(self, exe, name, extra, fresh=False, env=None):
        """Runs a trainer on model `name` with --dump-state (once, unless `fresh`); returns the file."""
        key = (exe, name, tuple(extra))
        if fresh or key not in self.dumps:
            path = f"{self.tmp}/dump{len(self.dumps)}{'_fresh' if fresh else ''}.st"
            try:
                # (no checkpoint unless the check asks for one: at d12 each would be 1.5 GB written and read back)
                saves = "--checkpoint-every" in extra or "--resume" in extra
                run([exe, "--model", f"{self.tmp}/{name}.bin", "--dump-state", path] + self.data[name] + extra +
                    ([] if saves else ["--no-checkpoint"]), env=env)
            except RuntimeError as e:
                path = e  # a failed run is not repeated: every check that needs it fails with its error
            if fresh:
                self.dumps[key + ("fresh",)] = path
            else:
                self.dumps[key] = path
        result = self.dumps[key + ("fresh",)] if fresh else self.dumps[key]
        if isinstance(result, Exception):
            raise result
        return result

    def dump(self, exe, name, extra):
        return read_safetensors(self.dump_path(exe, name, extra))[0]


def gpu_vs_cpu(S, tag, name, extra, gpu_flags=(), tol=BF16_TOL, exe=GPU):
    """`extra`: flags of both trainers; `gpu_flags`: the GPU trainer's own (the CPU refuses them)."""
    compare_dumps(tag, S.dump(exe, name, extra + list(gpu_flags)), S.dump(CPU, name, extra), S.models[name], tol)


def determinism(S, steps):
    steps = steps + DEFAULT_ATTENTION
    # emulated: the second run takes the threads of every block, and the blocks, in reverse order
    again = S.dump_path(GPU, "tiny", steps, fresh=True, env=REVERSED if EMULATED else None)
    name = "determinism: a run with threads and blocks in reverse order is bit-identical" if EMULATED else \
        "determinism: two runs are bit-identical"
    report(same_bytes(S.dump_path(GPU, "tiny", steps), again), name, "the dumps differ")


def recompute(S, steps):
    """Levels 1 and 2 rebuild GELU(fch) (and the LayerNorms) with the forward's own kernels: bit-identical.
    Level 0 rebuilds nothing, so its GELU runs in cuBLASLt's epilogues (llmc/kernels/gelu.cuh,
    gelu_in_matmul_epilogue): other roundings of the same math, so other bits, checked against the CPU
    reference like every bf16 run (recompute_epilogue)."""
    steps = steps + DEFAULT_ATTENTION
    level1 = S.dump_path(GPU, "tiny", steps)  # the default level
    same = same_bytes(level1, S.dump_path(GPU, "tiny", steps + ["--recompute", "2"], env=(
        {"CUDA_EMU_THREADS": "random:2", "CUDA_EMU_BLOCKS": "random:2"} if EMULATED else None)))
    report(same, "recompute 1/2 give bit-identical results" + (" (random schedules)" if EMULATED else ""),
           "the dumps differ")
    level0 = S.dump_path(GPU, "tiny", steps + ["--recompute", "0"], env=(
        {"CUDA_EMU_THREADS": "random:0", "CUDA_EMU_BLOCKS": "random:0"} if EMULATED else None))
    report(not same_bytes(level1, level0), "recompute 0 takes the GELU epilogues (its bits differ from level 1's)",
           "the dumps are identical: the epilogue path did not run")


def recompute_epilogue(S, name, steps):
    """--recompute 0: the fc matmul with GELU_AUX_BIAS, fcproj's input gradient with DGELU_BGRAD (fc's
    bias gradient from the epilogue), against the CPU reference within the bf16 tolerances."""
    gpu_vs_cpu(S, f"recompute 0, GELU in cuBLASLt's epilogues, vs cpu ({name})", name, steps,
               DEFAULT_ATTENTION + ["--recompute", "0"])


def cudnn_refused(S, steps):
    """Emulated: cuDNN is there but refuses every graph; the run goes on with the simple attention."""
    p = run([GPU, "--model", f"{S.tmp}/tiny.bin"] + S.data["tiny"] + steps[:4] + ["--steps", "1"])
    lines = [line for line in p.stdout.splitlines() if "cuDNN attention unavailable" in line]
    report(len(lines) == 1 and "using --attention simple" in lines[0] and "attention: simple" in p.stdout
           and "step     1/1" in p.stdout, "a cuDNN that refuses the attention graph: one line, then the simple path",
           p.stdout[-1500:] + p.stderr[-500:])


def cudnn_vs_simple(S, steps):
    compare_dumps("attention cudnn vs simple", S.dump(GPU, "tiny", steps),
                  S.dump(GPU, "tiny", steps + ["--attention", "simple"]), S.models["tiny"], BF16_TOL)


def master_weights_off(S, steps):
    nm = S.dump(GPU, "tiny", steps + DEFAULT_ATTENTION + ["--master-weights", "0"])
    ref = S.dump(CPU, "tiny", steps)
    d = np.max(np.abs(nm["losses"] - ref["losses"]))
    report(np.all(np.isfinite(nm["losses"])) and nm["losses"][-1] < nm["losses"][0] and d <= 0.1,
           "master weights off trains and tracks the reference", f"losses {nm['losses']}", f"max loss diff {d:.2e}")


def resume(S):
    tmp, data = S.tmp, S.data["tiny"]
    # sampling on: the sampler's random state is part of the checkpoint and must continue identically
    long = ["--batch-size", "4", "--seq-len", "64", "--steps", "20", "--lr", "1e-3", "--checkpoint-every", "10",
            "--sample-every", "5", "--sample-tokens", "4"]
    gpu_only = DEFAULT_ATTENTION
    full = S.dump(GPU, "tiny", long + gpu_only + ["--out-dir", f"{tmp}/run_a"])
    # run_b trains all 20 steps too; its step-20 checkpoint is then removed, and it resumes from step 10
    run([GPU, "--model", f"{tmp}/tiny.bin"] + data + long + gpu_only + ["--out-dir", f"{tmp}/run_b"])
    shutil.rmtree(f"{tmp}/run_b/ckpt_00000020")
    resumed = S.dump(GPU, "tiny", long + gpu_only + ["--out-dir", f"{tmp}/run_b", "--resume", "latest"])
    same = {"weights": np.array_equal(full["params"], resumed["params"]),
            "losses": np.array_equal(full["losses"][10:], resumed["losses"]),
            "model.bin": same_bytes(f"{tmp}/run_a/ckpt_00000020/model.bin", f"{tmp}/run_b/ckpt_00000020/model.bin"),
            "state.bin": same_bytes(f"{tmp}/run_a/ckpt_00000020/state.bin", f"{tmp}/run_b/ckpt_00000020/state.bin")}
    report(all(same.values()), "resume is bit-exact (20 steps == 10 + resume + 10)",
           f"differ: {[k for k, v in same.items() if not v]}; losses {full['losses'][10:]} vs {resumed['losses']}")
    # and the CPU trainer continues from the GPU checkpoint
    p = run([CPU, "--model", f"{tmp}/tiny.bin"] + data + long + ["--out-dir", f"{tmp}/run_a", "--steps", "21",
                                                                 "--resume", "latest", "--checkpoint-every", "0"],
            expect_ok=False)
    report(p.returncode == 0 and "step    21/21" in p.stdout, "the CPU trainer resumes a GPU checkpoint", p.stderr[-500:])


def d12(S):
    tmp = S.tmp
    S.models["d12"] = write_model(f"{tmp}/d12.bin", 12, 768, 12, 1024, 50257, 2)
    write_shard(f"{tmp}/d12_000000.bin", np.random.default_rng(3).integers(0, 50257, 20000))
    S.data["d12"] = ["--train-data", f"{tmp}/d12_*.bin", "--val-data", "none", "--sample-every", "0"]
    s12 = ["--batch-size", "1", "--seq-len", "64", "--steps", "2", "--lr", "1e-4"]
    ref = S.dump(CPU, "d12", s12)
    p = run([GPU, "--model", f"{tmp}/d12.bin", "--dump-state", f"{tmp}/gpu12.st"] + S.data["d12"] + s12 + DEFAULT_ATTENTION)
    compare_dumps("gpu vs cpu (d12)", read_safetensors(f"{tmp}/gpu12.st")[0], ref, S.models["d12"], BF16_TOL)
    report("tok/s" in p.stdout and ("MFU" in p.stdout or "unknown GPU" in p.stdout) and "total" in p.stdout
           and "GPU memory: peak" in p.stdout, "the run prints the buffer table, MFU and peak memory", p.stdout[-1500:])


def no_poisoned_checkpoint(S):
    """An LR that sends the gradient norm to NaN: the GPU trainer skips those updates, stops at the 3rd in a
    row, and every checkpoint it left holds finite weights (as the CPU trainer, test_bad_inputs.py)."""
    out_dir = f"{S.tmp}/nan"
    p = run([GPU, "--model", f"{S.tmp}/tiny.bin"] + S.data["tiny"] + DEFAULT_ATTENTION +
            ["--batch-size", "4", "--seq-len", "64", "--steps", "8", "--lr", "1e6", "--lr-schedule", "constant",
             "--checkpoint-every", "1", "--out-dir", out_dir], expect_ok=False)
    ckpts = sorted(d for d in os.listdir(out_dir) if d.startswith("ckpt_")) if os.path.isdir(out_dir) else []

    def finite(path):  # version 3: fp32 parameters, 5: bf16 (the upper half of fp32)
        version = int(np.fromfile(path, dtype="<i4", count=2)[1])
        raw = np.fromfile(path, dtype="<u2" if version == 5 else "<f4", offset=1024)
        values = (raw.astype(np.uint32) << 16).view(np.float32) if version == 5 else raw
        return raw.size > 0 and bool(np.all(np.isfinite(values)))

    report(p.returncode == 1 and "training diverged" in p.stderr and "update skipped" in p.stdout and ckpts and
           all(finite(f"{out_dir}/{d}/model.bin") for d in ckpts),
           f"--lr 1e6: non-finite steps skipped, the run stops, its {len(ckpts)} checkpoints hold finite weights",
           f"exit {p.returncode}, checkpoints {ckpts}: {p.stdout[-600:]} {p.stderr[-400:]}")


def memory_check(S):
    p = run([GPU, "--model", "d12", "--batch-size", "100000", "--seq-len", "1024"] + S.data["tiny"], expect_ok=False)
    report(p.returncode == 1 and "largest micro-batch that fits" in p.stderr and "step" not in p.stdout,
           "memory check: a batch that does not fit fails up front", p.stderr[-500:])


def precision_refused():
    """--precision must name the binary's build (llmc/run/cli.h, validate_precision): another value is
    one line naming the binary to run, exit 2, before anything is allocated (test_fp16.py: the fp16 build's)."""
    for exe, asked, needles in [(GPU, "fp16", ["built for bf16", "./train_gpt_fp16"]), (GPU, "fp32", ["built for bf16", "./train_gpt_fp32"]),
                                (GPU32, "bf16", ["built for fp32", "./train_gpt "]), (GPU, "fp4", ["bf16, fp16, fp32 or fp8"]),
                                (GPU32, "fp8", ["bf16 build", "./train_gpt --precision fp8"])]:
        p = run([exe, "--model", "L=2,C=64,H=4,T=64", "--precision", asked], expect_ok=False)
        lines = p.stderr.strip().splitlines()
        report(p.returncode == 2 and len(lines) == 1 and all(n in lines[0] for n in needles),
               f"{os.path.basename(exe)} --precision {asked}: one line naming what to run, exit 2", p.stderr[-500:])
    p = run([GPU, "--model", "L=2,C=64,H=4,T=64", "--precision", "bf16", "--estimate"], expect_ok=False)
    report(p.returncode == 0, f"{os.path.basename(GPU)} --precision bf16 (its own) is accepted", p.stderr[-500:])


def too_wide_refused():
    """The LayerNorm backward spreads a row over one block (llmc/kernels/layernorm.cuh): C/8 <= 1024
    threads. A wider model is one line naming the limit and the CPU trainer, before any allocation."""
    p = run([GPU, "--model", "L=1,C=8320,H=65,T=64"], expect_ok=False)
    lines = p.stderr.strip().splitlines()
    report(p.returncode != 0 and len(lines) == 1 and all(n in lines[0] for n in ["C=8320", "8192", "CPU trainer"]),
           "a model wider than the LayerNorm backward's block (C=8320): one line naming the limit", p.stderr[-500:])


def main():
    checks_without_gpu()
    if MODE != "gpu" and os.path.exists(NATIVE_GPU):
        p = run([NATIVE_GPU, "--model", "L=2,C=64,H=4,T=64"], expect_ok=False)
        report(p.returncode == 1 and "no CUDA GPU" in p.stderr, "without a GPU train_gpt says so", p.stderr)
    if MODE is None:
        skip("every GPU check", GPU)
        sys.exit(exit_code())
    print(f"running the GPU checks on {'the CPU emulation of CUDA: ' + GPU if EMULATED else 'the GPU'}", flush=True)
    for exe in (GPU, CPU):
        if not os.path.exists(exe):
            report(False, "binaries", f"{exe} is missing: run make")
            sys.exit(1)
    check("precision refused", precision_refused)
    check("too wide refused", too_wide_refused)

    tmp = tempfile.mkdtemp(prefix="llmc_gpu_test_")
    try:
        S = Setup(tmp)
        S.shape("tiny", 2, 128, 2, 64, 500, 1)
        S.shape("odd", 2, 160, 2, 50, 500, 4)
        S.shape("wide", 1, 1600, 25, 32, 500, 5)
        steps = ["--batch-size", "4", "--seq-len", "64", "--steps", "10", "--lr", "1e-3", "--warmup-steps", "2"]
        odd = ["--batch-size", "3", "--seq-len", "50", "--steps", "3", "--lr", "1e-3", "--warmup-steps", "2"]
        wide = ["--batch-size", "2", "--seq-len", "32", "--steps", "3", "--lr", "1e-3", "--warmup-steps", "2"]
        # the simple attention first: it checks every other kernel even if cuDNN's attention fails
        simple = ["--attention", "simple"]
        no_cudnn = "cuDNN is not emulated: the simple attention's checks stand in"
        check("gpu vs cpu (tiny, simple attention)", gpu_vs_cpu, S, "gpu vs cpu (tiny, simple attention)", "tiny",
              steps, simple)
        if EMULATED:
            skip("gpu vs cpu (tiny)", no_cudnn)
            check("cuDNN refusal", cudnn_refused, S, steps)
        else:
            check("gpu vs cpu (tiny)", gpu_vs_cpu, S, "gpu vs cpu (tiny)", "tiny", steps)
        if os.path.exists(GPU32):
            check("fp32 vs cpu", gpu_vs_cpu, S, "fp32 vs cpu", "tiny", steps, (), FP32_TOL, GPU32)
        else:
            skip("fp32 vs cpu", "train_gpt_fp32 not built")
        check("gpu vs cpu (odd, simple attention)", gpu_vs_cpu, S, "gpu vs cpu (odd, simple attention)", "odd", odd,
              simple)
        if EMULATED:
            skip("gpu vs cpu (odd)", no_cudnn)
        else:
            check("gpu vs cpu (odd)", gpu_vs_cpu, S, "gpu vs cpu (odd)", "odd", odd)
        check("gpu vs cpu (wide)", gpu_vs_cpu, S, "gpu vs cpu (wide)", "wide", wide, DEFAULT_ATTENTION)
        check("determinism", determinism, S, steps)
        check("recompute 0/1/2", recompute, S, steps)
        check("recompute 0 vs cpu (tiny)", recompute_epilogue, S, "tiny", steps)
        check("recompute 0 vs cpu (odd)", recompute_epilogue, S, "odd", odd)
        if EMULATED:
            skip("attention cudnn vs simple", no_cudnn)
        else:
            check("attention cudnn vs simple", cudnn_vs_simple, S, steps)
        check("master weights off", master_weights_off, S, steps)
        check("resume", resume, S)
        check("gpu vs cpu (d12)", d12, S)
        check("no poisoned checkpoint", no_poisoned_checkpoint, S)
        check("memory check", memory_check, S)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(exit_code())


if __name__ == "__main__":
    main()
