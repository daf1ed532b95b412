#!/usr/bin/python3
"""Time GPT-2 training steps in PyTorch (eager, fp32, CPU) and, optionally, in ./train_gpt_cpu.

What it teaches: how to compare two trainers fairly. Both get the same model shape, batch shape
and thread count; a step means the same work in both (forward, backward, gradient-norm clip,
AdamW update); the first steps are dropped (allocation, page faults, cache and thread-pool
warm-up) and the median of the rest is reported, since the median ignores the odd step that
the OS interrupts. Throughput is tokens per second = B*T / step time. One training step costs
about 6 * N * B * T flops for N parameters (2 for the forward matmuls, 4 for the backward),
plus the attention's T^2 terms, small at T = 64. speedup = pytorch ms / trainer ms: above 1,
the trainer is faster.

How close each comes to the machine: the step's flops (6 N + 6 L C T per token, N parameters, the
classifier's matmul included) over its time, as a share of an SGEMM ceiling measured in the same
run (torch.mm at 2048^3, the BLAS PyTorch links, median of 5), once before the first shape and
once after the last: a shared machine changes speed from minute to minute, so only rates measured
side by side compare, and the two ceilings and the load averages printed before and after say how
much the machine moved during the run. The shares are against the first ceiling. A BLAS's SGEMM is
not always the machine's peak (OpenBLAS's kernels leave a Zen 5's 512-bit FMA units half used), so
the script also measures the FMA peak itself: independent fused multiply-adds on registers only, one
stream per thread, compiled here with -march=native (g++); the trainer's share of it is printed too.

The PyTorch side is what a PyTorch user would run: torch's fused layer norm, GELU and
cross-entropy kernels (--ops explicit uses the reference's formulas instead), SDPA attention when
this torch has it, torch.nn.utils.clip_grad_norm_ and torch.optim.AdamW.

    python3 scripts/bench_cpu_vs_pytorch.py                         PyTorch only
    python3 scripts/bench_cpu_vs_pytorch.py --trainer ./train_gpt_cpu   both, side by side
    python3 scripts/bench_cpu_vs_pytorch.py --shapes tiny,small --steps 20 --warmup 3
    python3 scripts/bench_cpu_vs_pytorch.py --trainer ./train_gpt_cpu --llmc ~/llm.c --shapes d12,d12_b8t256

--llmc DIR adds a third column: llm.c's CPU trainer (train_gpt2.c in a checkout of
karpathy/llm.c), copied to a temporary folder with its batch shape, step count and file names
patched in, its validation and sampling switched off, and built as its Makefile does (-Ofast
-march=native, OpenMP). It does no gradient clipping and no weight decay: a little less work.

The trainer prints one line per step containing "<number> ms"; this script parses that.
"""
import argparse
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time


def _pin_blas_threads():
    """OpenBLAS sizes its own thread pool when it loads, from OPENBLAS_NUM_THREADS, and
    torch.set_num_threads does not reach it: without this a 1-thread PyTorch run (and the SGEMM
    ceiling) would still multiply on every core. So --threads is read before torch is imported."""
    for i, a in enumerate(sys.argv):
        value = a.split("=", 1)[1] if a.startswith("--threads=") else sys.argv[i + 1] if a == "--threads" and i + 1 < len(sys.argv) else None
        if value:
            os.environ["OPENBLAS_NUM_THREADS"] = value


_pin_blas_threads()
import torch  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
import gpt2_reference as ref  # noqa: E402

SHAPES = {
    "tiny": dict(layers=2, channels=64, heads=4, max_seq_len=64, vocab=512, batch=4, seq_len=32),
    "small": dict(layers=4, channels=256, heads=4, max_seq_len=256, vocab=50257, batch=4,
                  seq_len=64),
    "gpt2_124m": dict(layers=12, channels=768, heads=12, max_seq_len=1024, vocab=50257,
                      batch=4, seq_len=64),
    "d12_b8t256": dict(layers=12, channels=768, heads=12, max_seq_len=1024, vocab=50257,
                       batch=8, seq_len=256),
}
SHAPES["d12"] = SHAPES["gpt2_124m"]
# the model scripts/run.sh trains on a CPU (the main job): 8 layers of 64 channels, GPT-2's vocabulary
SHAPES["main_job"] = dict(layers=8, channels=64, heads=4, max_seq_len=64, vocab=50257, batch=8, seq_len=64)
LR, WEIGHT_DECAY, GRAD_CLIP = 1e-4, 0.1, 1.0
STEP_TIME = re.compile(r"(\d+\.?\d*) ms")


def config_of(shape):
    return ref.GPT2Config(max_seq_len=shape["max_seq_len"], vocab_size=shape["vocab"],
                          num_layers=shape["layers"], num_heads=shape["heads"],
                          channels=shape["channels"])


def time_pytorch(shape, warmup, steps, ops):
    """Median ms per training step of the reference model in eager fp32."""
    config = config_of(shape)
    fused = ops == "fused"
    model = ref.GPT2(config, use_sdpa=fused and hasattr(torch.nn.functional,
                                                        "scaled_dot_product_attention"),
                     use_fused_ops=fused)
    ref.init_fixture_weights(model, seed=1)
    generator = torch.Generator().manual_seed(2)
    B, T = shape["batch"], shape["seq_len"]
    tokens = torch.randint(0, config.vocab_size, (B * T + 1,), generator=generator).numpy()
    inputs, targets = ref.batch_from_tokens(tokens, B, T)
    optimizer = ref.make_optimizer(model, LR, WEIGHT_DECAY)
    times = []
    for _ in range(warmup + steps):
        start = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        _, loss = model(inputs, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        loss.item()                      # a real loop reads the loss; it also syncs
        times.append(1000 * (time.perf_counter() - start))
    return statistics.median(times[warmup:])


def time_trainer(trainer, shape, warmup, steps, threads, work_dir):
    """Median of the trainer's own per-step 'N ms', on a random model of the same shape."""
    config = config_of(shape)
    model = ref.GPT2(config)
    ref.init_fixture_weights(model, seed=1)
    model_path = os.path.join(work_dir, "model.bin")
    data_path = os.path.join(work_dir, "train.bin")
    ref.save_model(model_path, model)
    del model
    B, T = shape["batch"], shape["seq_len"]
    generator = torch.Generator().manual_seed(2)
    total = warmup + steps
    ref.write_token_shard(data_path, torch.randint(0, config.vocab_size, (total * B * T + 1,),
                                                   generator=generator).numpy())
    command = [trainer, "--model", model_path, "--train-data", data_path, "--val-data", "none",
               "--batch-size", str(B), "--seq-len", str(T), "--total-batch-tokens", str(B * T),
               "--steps", str(total), "--lr", repr(LR), "--lr-schedule", "constant",
               "--warmup-steps", "0", "--weight-decay", repr(WEIGHT_DECAY),
               "--grad-clip", repr(GRAD_CLIP), "--val-every", "0", "--sample-every", "0",
               "--checkpoint-every", "0", "--out-dir", os.path.join(work_dir, "out")]
    proc = subprocess.run(command, env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                          errors="replace")
    times = []
    for line in proc.stdout.splitlines():
        match = STEP_TIME.search(line)
        if line.lstrip().startswith("step") and match:
            times.append(float(match.group(1)))
    if proc.returncode != 0 or len(times) <= warmup:
        tail = "\n".join(proc.stdout.strip().splitlines()[-10:])
        raise RuntimeError(f"{' '.join(command)}\nexit code {proc.returncode}, "
                           f"{len(times)} step times parsed:\n{tail}")
    return statistics.median(times[warmup:])


def step_gflop(shape):
    """6 N + 6 L C T flops per token, times the tokens of a step."""
    n = ref.num_parameters(config_of(shape), padded=False)
    per_token = 6 * n + 6 * shape["layers"] * shape["channels"] * shape["seq_len"]
    return per_token * shape["batch"] * shape["seq_len"] / 1e9


def sgemm_ceiling(size=2048, repeats=5):
    """GFLOP/s of torch.mm on size^3 fp32, the median of `repeats` after a warm-up."""
    a, b = torch.rand(size, size), torch.rand(size, size)
    torch.mm(a, b)
    rates = []
    for _ in range(repeats):
        start = time.perf_counter()
        torch.mm(a, b)
        rates.append(2 * size ** 3 / (time.perf_counter() - start) / 1e9)
    return statistics.median(rates)


FMA_PEAK_SOURCE = r"""
// Independent FMAs on registers: 12 chains of 16 floats per thread (enough to cover the FMA units'
// latency), compiled with -march=native so the vector width is the machine's own.
#include <omp.h>
#include <cstdio>
#include <cstdlib>
typedef float v16 __attribute__((vector_size(64)));
int main(int argc, char** argv) {
    long iters = atol(argv[1]);
    double best = 0, sink = 0;
    for (int rep = 0; rep < 5; rep++) {
        double start = omp_get_wtime();
        #pragma omp parallel reduction(+ : sink)
        {
            v16 a[12], b = {}, c = {};
            for (int k = 0; k < 12; k++) for (int j = 0; j < 16; j++) a[k][j] = 1.0f + k + j;
            for (int j = 0; j < 16; j++) { b[j] = 1e-7f; c[j] = 0.9999999f; }
            for (long i = 0; i < iters; i++) {
                #pragma GCC unroll 12
                for (int k = 0; k < 12; k++) a[k] = a[k] * c + b;
            }
            for (int k = 0; k < 12; k++) for (int j = 0; j < 16; j++) sink += a[k][j];
        }
        double rate = 2.0 * 16 * 12 * iters * omp_get_max_threads() / (omp_get_wtime() - start) / 1e9;
        if (rate > best) best = rate;
    }
    printf("%.1f %g\n", best, sink);
}
"""


def fma_peak(threads):
    """GFLOP/s of FMAs on registers with `threads` threads (the best of 5), or None without g++."""
    compiler = shutil.which("g++")
    if not compiler:
        return None
    with tempfile.TemporaryDirectory() as work:
        src, exe = os.path.join(work, "fma.cpp"), os.path.join(work, "fma")
        with open(src, "w") as f:
            f.write(FMA_PEAK_SOURCE)
        subprocess.run([compiler, "-O2", "-march=native", "-ffp-contract=fast", "-fopenmp", src, "-o", exe], check=True)
        out = subprocess.run([exe, "20000000"], capture_output=True, text=True, check=True,
                             env=dict(os.environ, OMP_NUM_THREADS=str(threads))).stdout
    return float(out.split()[0])



def machine_line():
    """The CPU's model name (lscpu's field, from /proc/cpuinfo) and the load average now."""
    model = "unknown CPU"
    try:
        with open("/proc/cpuinfo") as f:
            model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), model)
        with open("/proc/loadavg") as f:
            load = " ".join(f.read().split()[:3])
    except OSError:
        load = "unknown"
    return f"{model}, {os.cpu_count()} logical CPUs, load average {load}"


def build_llmc(checkout, shape, total_steps, work_dir):
    """llm.c's train_gpt2.c, patched to this shape and built in work_dir; returns the binary's path."""
    source = open(os.path.join(checkout, "train_gpt2.c")).read()
    patches = [(r"int B = \d+;", f"int B = {shape['batch']};"),
               (r"int T = \d+;", f"int T = {shape['seq_len']};"),
               (r"step <= \d+;", f"step < {total_steps};"),
               (r"if \(step % 10 == 0\)", "if (0)"),                     # no validation
               (r"if \(step > 0 && step % 20 == 0\)", "if (0)")]         # no sampling
    for pattern, replacement in patches:
        source, count = re.subn(pattern, replacement, source)
        if count != 1:
            raise RuntimeError(f"{checkout}/train_gpt2.c: expected one match of {pattern!r}, found {count}: "
                               "a different llm.c version; patch it by hand")
    shutil.copytree(os.path.join(checkout, "llmc"), os.path.join(work_dir, "llmc"))
    with open(os.path.join(work_dir, "train_gpt2.c"), "w") as f:
        f.write(source)
    binary = os.path.join(work_dir, "train_gpt2")
    subprocess.run(["gcc", "-Ofast", "-march=native", "-fopenmp", "-DOMP", "-Wno-unused-result",
                    "train_gpt2.c", "-lm", "-o", binary], cwd=work_dir, check=True)
    return binary


def time_llmc(checkout, shape, warmup, steps, threads, work_dir):
    """Median of llm.c's own per-step 'took N ms', on a random model of the same shape."""
    config = config_of(shape)
    model = ref.GPT2(config)
    ref.init_fixture_weights(model, seed=1)
    ref.save_model(os.path.join(work_dir, "gpt2_124M.bin"), model)  # the name train_gpt2.c opens
    del model
    B, T = shape["batch"], shape["seq_len"]
    total = warmup + steps
    data = os.path.join(work_dir, "dev", "data", "tinyshakespeare")
    os.makedirs(data)
    generator = torch.Generator().manual_seed(2)
    for split in ("train", "val"):
        ref.write_token_shard(os.path.join(data, f"tiny_shakespeare_{split}.bin"),
                              torch.randint(0, config.vocab_size, ((total + 1) * B * T + 1,),
                                            generator=generator).numpy())
    binary = build_llmc(checkout, shape, total, work_dir)
    proc = subprocess.run([binary], cwd=work_dir, env=dict(os.environ, OMP_NUM_THREADS=str(threads)),
                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace")
    times = [float(m.group(1)) for m in re.finditer(r"took (\d+\.?\d*) ms", proc.stdout)]
    if proc.returncode != 0 or len(times) <= warmup:
        tail = "\n".join(proc.stdout.strip().splitlines()[-10:])
        raise RuntimeError(f"llm.c: exit code {proc.returncode}, {len(times)} step times parsed:\n{tail}")
    return statistics.median(times[warmup:])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--shapes", default="small,gpt2_124m",
                        help="comma-separated: " + ", ".join(SHAPES))
    parser.add_argument("--steps", type=int, default=10, help="timed steps")
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps first")
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--ops", choices=("fused", "explicit"), default="fused",
                        help="PyTorch's fused kernels or the reference's explicit formulas")
    parser.add_argument("--trainer", help="also time this trainer, e.g. ./train_gpt_cpu")
    parser.add_argument("--llmc", metavar="DIR", help="also time llm.c's CPU trainer from this checkout of karpathy/llm.c")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    print(f"before: {machine_line()}", flush=True)
    ceiling = sgemm_ceiling()
    fma = fma_peak(args.threads)

    print(f"torch {torch.__version__}, {args.threads} threads, fp32, {args.ops} ops, "
          f"median of {args.steps} steps after {args.warmup} warm-up")
    print(f"SGEMM ceiling: {ceiling:.1f} GFLOP/s (torch.mm 2048^3, median of 5); '% peak' = step GFLOP/s "
          "as a share of it; 'x' = PyTorch ms / this ms")
    if fma:
        print(f"FMA peak: {fma:.1f} GFLOP/s (registers only, {args.threads} threads); '% fma' = step GFLOP/s as a share of it")
    header = f"{'shape':10s} {'params':>11s} {'B x T':>7s} {'GFLOP':>6s} | {'pytorch ms':>10s} {'tok/s':>7s} {'% peak':>6s}"
    for name, wanted in (("trainer", args.trainer), ("llm.c", args.llmc)):
        if wanted:
            header += f" | {name + ' ms':>10s} {'tok/s':>7s} {'% peak':>6s} {'x':>5s}" + (f" {'% fma':>5s}" if fma else "")
    print(header)
    for name in [n.strip() for n in args.shapes.split(",") if n.strip()]:
        shape = SHAPES[name]
        tokens = shape["batch"] * shape["seq_len"]
        gflop = step_gflop(shape)
        peak = lambda ms: f"{100 * gflop / (ms / 1000) / ceiling:5.0f}%"
        torch_ms = time_pytorch(shape, args.warmup, args.steps, args.ops)
        line = (f"{name:10s} {ref.num_parameters(config_of(shape), padded=False):11d} "
                f"{shape['batch']:>3d}x{shape['seq_len']:<3d} {gflop:6.1f} | {torch_ms:10.1f} "
                f"{tokens / torch_ms * 1000:7.0f} {peak(torch_ms)}")
        for timer, wanted in ((time_trainer, args.trainer), (time_llmc, args.llmc)):
            if not wanted:
                continue
            with tempfile.TemporaryDirectory() as work_dir:
                ms = timer(wanted, shape, args.warmup, args.steps, args.threads, work_dir)
            line += f" | {ms:10.1f} {tokens / ms * 1000:7.0f} {peak(ms)} {torch_ms / ms:5.2f}"
            if fma:
                line += f" {100 * gflop / (ms / 1000) / fma:4.0f}%"
        print(line, flush=True)
    print(f"after: {machine_line()}; SGEMM ceiling now {sgemm_ceiling():.1f} GFLOP/s")


if __name__ == "__main__":
    main()
