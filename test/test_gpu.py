#!/usr/bin/env python3
"""The GPU trainer against the CPU reference, against itself, and across its options.

Without a GPU (nvidia-smi missing or listing none) every GPU check prints SKIP; the checks that need
no GPU (flags, --estimate, the no-GPU error) run everywhere. With one:

  gpu vs cpu       ./train_gpt (bf16) and ./train_gpt_cpu (fp32) on the same model file and batches:
                   logits, loss, every gradient tensor, and 10 AdamW steps (tiny and d12 shapes)
  fp32 vs cpu      ./train_gpt_fp32 (the same kernels in fp32) against the CPU, tightly
  determinism      two runs with the same flags: bit-identical dumps
  resume           20 steps == 10 steps + resume + 10 steps, bit for bit (weights and losses)
  recompute        --recompute 0, 1, 2: bit-identical (recompute is exact)
  attention        --attention cudnn vs simple agree within bf16 tolerance
  memory           a batch that cannot fit fails before training, naming the largest that would

Tolerances (bf16 run vs fp32 reference). bf16 keeps 8 significant bits: every stored activation or
gradient carries a relative rounding error up to 2^-9 = 0.2%. A forward pass rounds each value ~10
times per layer; independent errors grow like sqrt(count), so after a few layers and the LM head
relative errors of ~1% of a tensor's typical magnitude are expected, ~2-3% for gradients, which
pass through twice as many rounded tensors (and the bf16 accumulation of the residual gradient).
We therefore compare with relative L2 errors, ||gpu - cpu|| / ||cpu||: logits <= 3%, each gradient
tensor <= 8% (and cosine >= 0.99), the loss within 0.02 (it averages errors over B*T tokens), and
after 10 steps the weight CHANGE (params - initial) within 15% and each step's loss within 0.05
(stochastic rounding of the bf16 weights adds noise every step). fp32 build vs CPU: the same
formulas in a different order of summation: 1e-4 relative (logits) and 1e-3 (gradients).
"""
import json, os, shutil, struct, subprocess, sys, tempfile
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GPU, GPU32, CPU = [os.path.join(ROOT, x) for x in ("train_gpt", "train_gpt_fp32", "train_gpt_cpu")]
failures = 0


def report(ok, name, why=""):
    global failures
    print(f"PASS: {name}" if ok else f"FAIL: {name}: {why}", flush=True)
    failures += 0 if ok else 1


def skip(name, why):
    print(f"SKIP: {name} ({why})", flush=True)


def have_gpu():
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.returncode == 0 and "GPU" in out.stdout


def run(cmd, expect_ok=True):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if expect_ok and p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({p.returncode}):\n{p.stdout[-3000:]}\n{p.stderr[-3000:]}")
    return p


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


def write_model(path, L, C, H, T, V, seed):
    Vp = (V + 127) // 128 * 128
    names, off = layout(L, C, T, Vp)
    rng = np.random.default_rng(seed)
    params = np.zeros(off[-1], np.float32)
    for i, n in enumerate(names):
        size = off[i + 1] - off[i]
        if n in ("ln1w", "ln2w", "lnfw"):
            params[off[i]:off[i + 1]] = 1.0 + 0.1 * rng.standard_normal(size)
        elif n.endswith("b"):
            params[off[i]:off[i + 1]] = 0.02 * rng.standard_normal(size)
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


def write_shard(path, tokens):
    header = np.zeros(256, np.int32)
    header[:3] = [20240520, 1, len(tokens)]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(np.asarray(tokens, np.uint16).tobytes())


def read_safetensors(path):
    with open(path, "rb") as f:
        n = struct.unpack("<Q", f.read(8))[0]
        header = json.loads(f.read(n))
        data = f.read()
    out = {}
    for k, v in header.items():
        if k == "__metadata__":
            continue
        a, b = v["data_offsets"]
        out[k] = np.frombuffer(data[a:b], np.float32).reshape(v["shape"])
    return out


# ---------------------------------------------------------------------------------------------
# comparisons

def rel(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return np.linalg.norm(a - b) / max(np.linalg.norm(b), 1e-30)


def cosine(a, b):
    a, b = np.asarray(a, np.float64).ravel(), np.asarray(b, np.float64).ravel()
    return float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))


def compare_dumps(tag, got, ref, init, names, off, tol):
    report(rel(got["logits"], ref["logits"]) <= tol["logits"], f"{tag}: logits",
           f"relative L2 error {rel(got['logits'], ref['logits']):.2e} > {tol['logits']}")
    dl = abs(float(got["loss"][0]) - float(ref["loss"][0]))
    report(dl <= tol["loss"], f"{tag}: loss", f"|{got['loss'][0]} - {ref['loss'][0]}| = {dl:.3g} > {tol['loss']}")
    bad = []
    for i, n in enumerate(names):
        g, r = got["grads"][off[i]:off[i + 1]], ref["grads"][off[i]:off[i + 1]]
        if np.linalg.norm(r) == 0:
            continue
        e, c = rel(g, r), cosine(g, r)
        if e > tol["grads"] or c < tol["cosine"]:
            bad.append(f"{n} rel {e:.2e} cos {c:.4f}")
    report(not bad, f"{tag}: every gradient tensor", "; ".join(bad))
    dlosses = np.max(np.abs(got["losses"] - ref["losses"]))
    report(dlosses <= tol["losses"], f"{tag}: losses of {len(ref['losses'])} AdamW steps", f"max diff {dlosses:.3g}")
    e = rel(got["params"] - init, ref["params"] - init)
    report(e <= tol["update"], f"{tag}: weights after {len(ref['losses'])} AdamW steps",
           f"relative L2 error of the weight change {e:.2e} > {tol['update']}")


BF16_TOL = dict(logits=0.03, loss=0.02, grads=0.08, cosine=0.99, losses=0.05, update=0.15)
FP32_TOL = dict(logits=1e-4, loss=1e-4, grads=1e-3, cosine=0.99999, losses=1e-3, update=1e-2)


def same_bytes(a, b):
    with open(a, "rb") as fa, open(b, "rb") as fb:
        return fa.read() == fb.read()


# ---------------------------------------------------------------------------------------------

def checks_without_gpu():
    if not os.path.exists(GPU):
        skip("train_gpt flags", "train_gpt not built: no nvcc")
        return
    p = run([GPU, "--help"])
    report("--attention" in p.stdout and "--recompute" in p.stdout and "--threads" not in p.stdout,
           "train_gpt --help lists the GPU flags only", p.stdout[-500:])
    p = run([GPU, "--attention", "flash"], expect_ok=False)
    report(p.returncode == 2 and "--attention" in p.stderr, "a bad --attention is a usage error", p.stderr)
    p = run([GPU, "--model", "d12", "--batch-size", "4", "--seq-len", "1024", "--estimate"], expect_ok=False)
    report(p.returncode == 0 and "237.4 MiB" in p.stdout and "total" in p.stdout,
           "--estimate prints the buffer table without a GPU", p.stdout[-800:] + p.stderr)


def main():
    checks_without_gpu()
    names_gpu = ["gpu vs cpu (tiny)", "gpu vs cpu (d12)", "fp32 vs cpu", "determinism", "resume",
                 "recompute 0/1/2", "attention cudnn vs simple", "master weights off", "memory check"]
    if not have_gpu():
        if os.path.exists(GPU):
            p = run([GPU, "--model", "L=2,C=64,H=4,T=64"], expect_ok=False)
            report(p.returncode == 1 and "no CUDA GPU" in p.stderr, "without a GPU train_gpt says so", p.stderr)
        for n in names_gpu:
            skip(n, "no GPU")
        sys.exit(1 if failures else 0)
    for exe in (GPU, CPU):
        if not os.path.exists(exe):
            report(False, "binaries", f"{exe} is missing: run make")
            sys.exit(1)

    tmp = tempfile.mkdtemp(prefix="llmc_gpu_test_")
    try:
        rng = np.random.default_rng(0)
        V = 512
        # a small "language": a repeating random sequence, so the loss can fall
        base = rng.integers(0, V, 997)
        write_shard(f"{tmp}/train_000000.bin", np.tile(base, 60))
        data = ["--train-data", f"{tmp}/train_*.bin", "--val-data", "none", "--sample-every", "0"]

        def dump(exe, model, out, extra):
            cmd = [exe, "--model", model, "--dump-state", out] + data + extra
            return run(cmd)

        # ---- tiny shape: GPU (bf16) and fp32 build against the CPU
        init, names, off = write_model(f"{tmp}/tiny.bin", 2, 128, 2, 64, V, 1)
        steps = ["--batch-size", "4", "--seq-len", "64", "--steps", "10", "--lr", "1e-3", "--warmup-steps", "2"]
        dump(CPU, f"{tmp}/tiny.bin", f"{tmp}/cpu.st", steps + ["--threads", "0"])
        ref = read_safetensors(f"{tmp}/cpu.st")
        dump(GPU, f"{tmp}/tiny.bin", f"{tmp}/gpu.st", steps)
        got = read_safetensors(f"{tmp}/gpu.st")
        compare_dumps("gpu vs cpu (tiny)", got, ref, init, names, off, BF16_TOL)
        if os.path.exists(GPU32):
            dump(GPU32, f"{tmp}/tiny.bin", f"{tmp}/gpu32.st", steps)
            compare_dumps("fp32 vs cpu", read_safetensors(f"{tmp}/gpu32.st"), ref, init, names, off, FP32_TOL)
        else:
            skip("fp32 vs cpu", "train_gpt_fp32 not built")

        # ---- determinism: the same run twice
        dump(GPU, f"{tmp}/tiny.bin", f"{tmp}/gpu_again.st", steps)
        report(same_bytes(f"{tmp}/gpu.st", f"{tmp}/gpu_again.st"), "determinism: two runs are bit-identical",
               "the dumps differ")

        # ---- recompute levels: bit-identical
        for level in ("0", "2"):
            dump(GPU, f"{tmp}/tiny.bin", f"{tmp}/gpu_r{level}.st", steps + ["--recompute", level])
        same = all(same_bytes(f"{tmp}/gpu.st", f"{tmp}/gpu_r{lv}.st") for lv in ("0", "2"))
        report(same, "recompute 0/1/2 give bit-identical results", "the dumps differ")

        # ---- attention paths agree
        dump(GPU, f"{tmp}/tiny.bin", f"{tmp}/gpu_simple.st", steps + ["--attention", "simple"])
        compare_dumps("attention cudnn vs simple", got, read_safetensors(f"{tmp}/gpu_simple.st"), init, names, off,
                      BF16_TOL)

        # ---- master weights off still trains, and stays close
        dump(GPU, f"{tmp}/tiny.bin", f"{tmp}/gpu_nomaster.st", steps + ["--master-weights", "0"])
        nm = read_safetensors(f"{tmp}/gpu_nomaster.st")
        report(np.all(np.isfinite(nm["losses"])) and nm["losses"][-1] < nm["losses"][0] and
               np.max(np.abs(nm["losses"] - ref["losses"])) <= 0.1,
               "master weights off trains and tracks the reference", f"losses {nm['losses']}")

        # ---- resume: 20 steps == 10 + resume + 10, bit for bit
        long = ["--batch-size", "4", "--seq-len", "64", "--steps", "20", "--lr", "1e-3", "--checkpoint-every", "10"]
        dump(GPU, f"{tmp}/tiny.bin", f"{tmp}/full.st", long + ["--out-dir", f"{tmp}/run_a"])
        # the second run stops at 10 by crashing nowhere: train 10 of the 20 scheduled steps = resume from ckpt 10
        run([GPU, "--model", f"{tmp}/tiny.bin"] + data + long + ["--out-dir", f"{tmp}/run_b"])
        shutil.rmtree(f"{tmp}/run_b/ckpt_00000020")
        dump(GPU, f"{tmp}/tiny.bin", f"{tmp}/resumed.st", long + ["--out-dir", f"{tmp}/run_b", "--resume", "latest"])
        full, resumed = read_safetensors(f"{tmp}/full.st"), read_safetensors(f"{tmp}/resumed.st")
        ok = (np.array_equal(full["params"], resumed["params"]) and np.array_equal(full["losses"][10:], resumed["losses"])
              and same_bytes(f"{tmp}/run_a/ckpt_00000020/model.bin", f"{tmp}/run_b/ckpt_00000020/model.bin")
              and same_bytes(f"{tmp}/run_a/ckpt_00000020/state.bin", f"{tmp}/run_b/ckpt_00000020/state.bin"))
        report(ok, "resume is bit-exact (20 steps == 10 + resume + 10)",
               f"losses {full['losses'][10:]} vs {resumed['losses']}")
        # and the CPU trainer continues from the GPU checkpoint
        p = run([CPU, "--model", f"{tmp}/tiny.bin"] + data + long + ["--out-dir", f"{tmp}/run_a", "--steps", "21",
                                                                      "--resume", "latest", "--checkpoint-every", "0"],
                expect_ok=False)
        report(p.returncode == 0 and "step    21/21" in p.stdout, "the CPU trainer resumes a GPU checkpoint",
               p.stderr[-500:])

        # ---- d12 shape, one step, against the CPU (slow on the CPU: B=1, T=64)
        init12, names12, off12 = write_model(f"{tmp}/d12.bin", 12, 768, 12, 1024, 50257, 2)
        shard = rng.integers(0, 50257, 20000)
        write_shard(f"{tmp}/d12_000000.bin", shard)
        d12data = ["--train-data", f"{tmp}/d12_*.bin", "--val-data", "none", "--sample-every", "0"]
        s12 = ["--batch-size", "1", "--seq-len", "64", "--steps", "2", "--lr", "1e-4"]
        run([CPU, "--model", f"{tmp}/d12.bin", "--dump-state", f"{tmp}/cpu12.st"] + d12data + s12)
        p = run([GPU, "--model", f"{tmp}/d12.bin", "--dump-state", f"{tmp}/gpu12.st"] + d12data + s12)
        compare_dumps("gpu vs cpu (d12)", read_safetensors(f"{tmp}/gpu12.st"), read_safetensors(f"{tmp}/cpu12.st"),
                      init12, names12, off12, BF16_TOL)
        report("tok/s" in p.stdout and ("MFU" in p.stdout or "unknown GPU" in p.stdout) and "total" in p.stdout
               and "GPU memory: peak" in p.stdout, "the run prints the buffer table, MFU and peak memory", p.stdout[-1500:])

        # ---- a batch that cannot fit fails before training, with the largest that would
        p = run([GPU, "--model", "d12", "--batch-size", "100000", "--seq-len", "1024"] + d12data, expect_ok=False)
        report(p.returncode == 1 and "largest micro-batch that fits" in p.stderr and "step" not in p.stdout,
               "memory check: a batch that does not fit fails up front", p.stderr[-500:])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(1 if failures else 0)


if __name__ == "__main__":
    try:
        main()
    except RuntimeError as e:
        report(False, "gpu test run", str(e))
        sys.exit(1)
