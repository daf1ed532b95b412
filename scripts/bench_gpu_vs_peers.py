#!/usr/bin/python3
"""Time GPT-2 training steps on one GPU: ./train_gpt beside PyTorch and llm.c, in one run.

What it teaches: how to compare GPU trainers fairly. Every trainer gets the same model shape, the
same batch (B sequences of T tokens, random tokens), the same step (forward, backward, global-norm
clip at 1.0, AdamW with weight decay 0.1, bf16 matmuls with fp32 master weights) on the same GPU,
one after another in one process tree, so clocks and neighbours are the same for all. The first
steps are dropped (cuDNN/cuBLAS planning, torch.compile, allocator warm-up) and the median of the
rest is reported. Throughput is B*T / step time; MFU is the step's flops (6 N + 6 L C T per token,
N parameters with the classifier) over the time, as a share of the GPU's dense bf16 peak (989
TFLOP/s for H100/H200 SXM, the datasheet figure every trainer here prints).

The peers:
  pytorch         what a PyTorch user runs: the reference GPT-2 (test/gpt2_reference.py) on the GPU
                  under bf16 autocast, flash attention through F.scaled_dot_product_attention, torch's
                  fused LayerNorm/GELU/cross-entropy, fused AdamW, the vocabulary padded to 50304
                  (as nanoGPT does), TF32 on
  pytorch+compile the same model through torch.compile (its warm-up steps include the compile)
  llm.c           karpathy/llm.c's train_gpt2cu, given as a built binary (--llmc PATH, repeatable,
                  PATH[:label]); it starts from its own random init (-e d12), clips at 1.0, weight
                  decay 0.1, recompute 1 (GELU), as ours

    python3 scripts/bench_gpu_vs_peers.py                                  ours and PyTorch, d12 B=16 T=1024
    python3 scripts/bench_gpu_vs_peers.py --llmc ~/llm.c/train_gpt2cu --compile --batch 32
    python3 scripts/bench_gpu_vs_peers.py --model d24 --batch 8 --peers ours   (our trainer alone)
    python3 scripts/bench_gpu_vs_peers.py --peers ours --ours-variant "recompute 0=--recompute 0"

A trainer prints one line per step containing "<number> ms"; this script parses that.
"""
import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
import gpt2_reference as ref  # noqa: E402  (the PyTorch model, and the parameter count)
from token_shards import write_shard  # noqa: E402

MODELS = {"d12": (12, 768, 12), "d24": (24, 1024, 16), "d36": (36, 1280, 20), "d48": (48, 1600, 25)}
VOCAB, PADDED_VOCAB, MAX_T = 50257, 50304, 1024
LR, WEIGHT_DECAY, GRAD_CLIP = 6e-4, 0.1, 1.0
PEAK_TFLOPS = 989.0
STEP_MS = re.compile(r"\| *(\d+\.?\d*) ms")


def config(model, vocab=VOCAB):
    L, C, H = MODELS[model]
    return ref.GPT2Config(max_seq_len=MAX_T, vocab_size=vocab, num_layers=L, num_heads=H, channels=C)


def step_tflop(model, B, T):
    L, C, _ = MODELS[model]
    return (6 * ref.num_parameters(config(model), padded=False) + 6 * L * C * T) * B * T / 1e12


def run_and_parse(command, warmup, label, cwd=None):
    """Median of the per-step 'N ms' a trainer prints, after `warmup` steps; (ms, output)."""
    proc = subprocess.run(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, errors="replace",
                          cwd=cwd)
    times = [float(m.group(1)) for line in proc.stdout.splitlines() if line.lstrip().startswith("step")
             for m in [STEP_MS.search(line)] if m]
    if proc.returncode != 0 or len(times) <= warmup:
        tail = "\n".join(proc.stdout.strip().splitlines()[-12:])
        raise RuntimeError(f"{label}: exit code {proc.returncode}, {len(times)} step times parsed\n"
                           f"command: {' '.join(command)}\n{tail}")
    return statistics.median(times[warmup:]), proc.stdout


def time_ours(binary, args, shard, work_dir, extra_flags=""):
    # --precision is fixed when the trainer is built (llmc/run/cli.h): a variant asking for fp16 or
    # fp32 runs that build, train_gpt_fp16 / train_gpt_fp32 beside train_gpt
    precision = re.search(r"--precision (fp16|fp32)\b", extra_flags)
    if precision:
        binary = os.path.join(os.path.dirname(binary), f"train_gpt_{precision.group(1)}")
    command = [binary, "--model", args.model, "--train-data", shard, "--val-data", "none",
               "--batch-size", str(args.batch), "--seq-len", str(args.seq_len),
               "--steps", str(args.warmup + args.steps), "--lr", repr(LR), "--lr-schedule", "constant",
               "--warmup-steps", "0", "--weight-decay", repr(WEIGHT_DECAY), "--grad-clip", repr(GRAD_CLIP),
               "--sample-every", "0", "--checkpoint-every", "0", "--out-dir", os.path.join(work_dir, "ours")]
    command += args.ours_flags.split() + extra_flags.split()
    ms, out = run_and_parse(command, args.warmup, "train_gpt")
    peak = re.search(r"GPU memory: peak ([\d.]+ [GM]iB)", out)
    return ms, peak.group(1) if peak else "?"


def time_llmc(binary, args, shard, work_dir):
    L = MODELS[args.model][0]
    command = [binary, "-i", shard, "-j", shard, "-e", f"d{L}", "-b", str(args.batch), "-t", str(args.seq_len),
               "-x", str(args.warmup + args.steps), "-l", repr(LR), "-c", repr(WEIGHT_DECAY), "-u", "0",
               "-v", "1000000", "-m", "1", "-s", "0", "-r", "1", "-y", "0"]  # -v 0 would divide by zero
    ms, out = run_and_parse(command, args.warmup, "llm.c", cwd=work_dir)
    peak = re.search(r"device memory usage: (\d+ MiB)", out)
    return ms, peak.group(1) if peak else "?"


def time_pytorch(args, tokens, compiled):
    import torch
    torch.backends.cuda.matmul.allow_tf32 = True
    torch.backends.cudnn.allow_tf32 = True
    device = "cuda"
    model = ref.GPT2(config(args.model, PADDED_VOCAB), use_sdpa=True, use_fused_ops=True)
    ref.init_fixture_weights(model, seed=1)
    model.to(device)
    groups = ref.make_optimizer(model, LR, WEIGHT_DECAY).param_groups
    optimizer = torch.optim.AdamW([{"params": g["params"], "weight_decay": g["weight_decay"]} for g in groups],
                                  lr=LR, betas=ref.ADAM_BETAS, eps=ref.ADAM_EPS, fused=True)
    forward = torch.compile(model) if compiled else model
    B, T = args.batch, args.seq_len
    data = torch.from_numpy(tokens.astype(np.int64)).to(device)
    times = []
    torch.cuda.reset_peak_memory_stats()
    for step in range(args.warmup + args.steps):
        start = (step * B * T) % (len(tokens) - B * T - 1)
        x = data[start:start + B * T].view(B, T)
        y = data[start + 1:start + B * T + 1].view(B, T)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            _, loss = forward(x, y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP)
        optimizer.step()
        loss.item()  # a real loop reads the loss; it also waits for the GPU
        times.append(1000 * (time.perf_counter() - t0))
    peak = f"{torch.cuda.max_memory_allocated() / 2**30:.2f} GiB"
    del model, optimizer, forward
    torch.cuda.empty_cache()
    return statistics.median(times[args.warmup:]), peak


def gpu_line():
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.sm,clocks.max.sm,"
                              "temperature.gpu,power.draw", "--format=csv,noheader"], capture_output=True, text=True)
        return out.stdout.strip()
    except OSError:
        return "no nvidia-smi"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="d12", choices=MODELS)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=20, help="timed steps")
    parser.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    parser.add_argument("--train-gpt", default=os.path.join(ROOT, "train_gpt"))
    parser.add_argument("--ours-flags", default="", help="extra flags for ./train_gpt, e.g. '--recompute 0'")
    parser.add_argument("--ours-variant", action="append", default=[], metavar="LABEL=FLAGS",
                        help="one more train_gpt row with these flags added (repeatable), e.g. 'graphs=--cuda-graphs'; "
                             "the speed-up column stays relative to the plain train_gpt row")
    parser.add_argument("--llmc", action="append", default=[], metavar="PATH[:label]",
                        help="llm.c's built train_gpt2cu (repeatable)")
    parser.add_argument("--peers", default="ours,pytorch,llmc",
                        help="which to run, of: ours, pytorch, compile, llmc")
    parser.add_argument("--compile", action="store_true", help="also PyTorch through torch.compile")
    args = parser.parse_args()
    peers = set(args.peers.split(",")) | ({"compile"} if args.compile else set())
    L, C, H = MODELS[args.model]
    B, T = args.batch, args.seq_len
    tflop = step_tflop(args.model, B, T)
    print(f"GPU: {gpu_line()}")
    print(f"{args.model} (L={L} C={C} H={H}, {ref.num_parameters(config(args.model), padded=False) / 1e6:.1f}M parameters), B={B} T={T}, "
          f"{tflop:.3f} TFLOP per step; median of {args.steps} steps after {args.warmup} warm-up; "
          f"MFU against {PEAK_TFLOPS:.0f} TFLOP/s dense bf16", flush=True)
    tokens = np.random.default_rng(0).integers(0, VOCAB, (args.warmup + args.steps + 2) * B * T + 1).astype(np.uint16)
    rows = []
    with tempfile.TemporaryDirectory() as work_dir:
        shard = os.path.join(work_dir, "synthetic_train_000000.bin")
        write_shard(shard, tokens)
        jobs = []
        if "ours" in peers:
            jobs.append(("train_gpt (this project)", lambda: time_ours(args.train_gpt, args, shard, work_dir)))
            for spec in args.ours_variant:
                label, _, flags = spec.partition("=")
                jobs.append((f"train_gpt {label}", lambda flags=flags: time_ours(args.train_gpt, args, shard, work_dir, flags)))
        if "pytorch" in peers:
            jobs.append(("PyTorch eager", lambda: time_pytorch(args, tokens, compiled=False)))
        if "compile" in peers:
            jobs.append(("PyTorch + torch.compile", lambda: time_pytorch(args, tokens, compiled=True)))
        if "llmc" in peers:
            for spec in args.llmc:
                path, _, label = spec.partition(":")
                jobs.append((f"llm.c {label or os.path.basename(path)}",
                             lambda path=path: time_llmc(os.path.abspath(path), args, shard, work_dir)))
        for name, job in jobs:
            try:
                ms, peak = job()
                rows.append((name, ms, peak))
                print(f"  {name}: {ms:.1f} ms/step, peak {peak}", flush=True)
            except Exception as e:  # noqa: BLE001 - one peer failing must not lose the others' numbers
                print(f"  {name}: FAILED: {type(e).__name__}: {e}"[-3000:], flush=True)
    ours = next((ms for name, ms, _ in rows if name == "train_gpt (this project)"), None)
    print(f"\n| trainer | ms/step | tokens/s | MFU | peak memory | train_gpt's speed-up |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, ms, peak in rows:
        ratio = f"{ms / ours:.2f}x" if ours else "-"
        print(f"| {name} | {ms:.1f} | {B * T / ms * 1000:,.0f} | {100 * tflop / (ms / 1000) / PEAK_TFLOPS:.1f}% "
              f"| {peak} | {ratio} |")
    print(f"GPU after: {gpu_line()}")


if __name__ == "__main__":
    main()
