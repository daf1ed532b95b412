#!/usr/bin/python3
"""Time generation (--generate, llmc/run/generate.h): the KV cache against recomputing the window, and
both against PyTorch generating from the same weights, in one run on one machine.

What it teaches: what a KV cache buys. Without one, token i of a sample costs a forward pass over
the whole window (prompt + i tokens), so a sample of n tokens costs O(n^2) rows through the model;
with one, each token is one row through every matmul plus one row of attention against the cache.
The gap grows with the sample's length: at 64 tokens after a 16-token prompt the window averages
48 positions, so the uncached path does about 48x the matmul work per token.

Each side generates --tokens tokens greedily (temperature 0) after the same prompt, --repeats times,
in rounds (every side once per round, so a shared machine's changing load falls on all alike); the
median time is reported as tokens per second, the prompt's prefill included on every side. The
sides:
  trainer --kv-cache 1 / 0     each --trainer given (./train_gpt_cpu, ./train_gpt); the trainer
                               times its own loop (the line it prints on stderr), not its start-up
  pytorch, kv cache            the same model in PyTorch (test/gpt2_reference.py's weights), with a
                               cache of each layer's keys and values written out below (this machine
                               has no Hugging Face transformers; the loop is what its generate() does
                               with use_cache=True): prefill the prompt, then one row per token,
                               attending to the cache (softmax(q k^T / sqrt(hs)) v, written out: the
                               torch here, 1.13, has no scaled_dot_product_attention)
  pytorch, no cache            the reference's full forward over the window per token
The model: random weights (the reference's fixture initialisation) of --shape, default GPT-2 small's
(d12: L=12, C=768, H=12, T=1024, V=50257), so the prompt is text and needs GPT-2's tokenizer in
data/gpt2 (scripts/get_vocab.sh). The greedy tokens of every side are compared with the first
trainer's (fp32 sides should agree; bf16 ones may part after a near tie): a speed is only worth
quoting for the same work.

    python3 scripts/bench_generate.py --trainer ./train_gpt_cpu                  the CPU, torch on the CPU
    python3 scripts/bench_generate.py --trainer ./train_gpt --torch-device cuda  a GPU
    python3 scripts/bench_generate.py --trainer ./train_gpt_cpu --shape L=6,C=384,H=6,T=256,V=50257 --tokens 128
"""
import argparse
import json
import math
import os
import platform
import re
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import gpt2_reference as ref  # noqa: E402

PROMPT = "Call me Ishmael. Some years ago, never mind how long precisely, having little or no money"


def parse_shape(text):
    kv = dict(part.split("=") for part in text.split(","))
    return ref.GPT2Config(max_seq_len=int(kv.get("T", 1024)), vocab_size=int(kv.get("V", 50257)),
                          num_layers=int(kv["L"]), num_heads=int(kv["H"]), channels=int(kv["C"]))


def run_trainer(trainer, model_path, prompt, tokens, kv_cache, threads):
    cmd = [trainer, "--model", model_path, "--generate", prompt, "--sample-tokens", str(tokens), "--temperature", "0",
           "--json", "--kv-cache", str(kv_cache)]
    if threads and "cpu" in os.path.basename(trainer):
        cmd += ["--threads", str(threads)]
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if p.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed: {p.stderr.strip()}")
    line = json.loads(p.stdout.splitlines()[0])
    seconds = float(re.search(r"in ([0-9.]+) s:", p.stderr).group(1))
    return line, seconds


# ----------------------------------------------------------------------------------------------
# PyTorch: the reference's weights, generated with and without a cache

def torch_greedy_no_cache(model, prompt, n):
    tokens = list(prompt)
    for _ in range(n):
        logits, _ = model(torch.tensor([tokens], device=model.wte.device))
        tokens.append(int(torch.argmax(logits[0, -1])))
    return tokens[len(prompt):]


def torch_forward_cached(model, tokens, cache):
    """Rows for `tokens` at positions len(cache) .. ; cache: per layer [k, v] of (NH, t, hs), grown here."""
    cfg = model.config
    C, NH = cfg.channels, cfg.num_heads
    pos = cache[0][0].shape[1] if cache[0] else 0
    n = len(tokens)
    x = model.wte[tokens] + model.wpe[pos:pos + n]                                   # (n, C)
    for l in range(cfg.num_layers):
        qkv = F.linear(F.layer_norm(x, (C,), model.ln1w[l], model.ln1b[l], ref.LAYERNORM_EPS), model.qkvw[l], model.qkvb[l])
        q, k, v = (t.view(n, NH, C // NH).transpose(0, 1) for t in qkv.split(C, dim=-1))
        if cache[l]:
            k, v = torch.cat([cache[l][0], k], 1), torch.cat([cache[l][1], v], 1)
        cache[l] = [k, v]
        # causal over the whole cache: row i (position pos + i) sees keys 0 .. pos + i
        mask = torch.ones(n, pos + n, dtype=torch.bool, device=x.device).tril(pos)
        scores = (q @ k.transpose(1, 2)) / math.sqrt(C // NH)                     # (NH, n, pos + n)
        y = (scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v).transpose(0, 1).reshape(n, C)
        x = x + F.linear(y, model.attprojw[l], model.attprojb[l])
        h = F.gelu(F.linear(F.layer_norm(x, (C,), model.ln2w[l], model.ln2b[l], ref.LAYERNORM_EPS), model.fcw[l], model.fcb[l]),
                   approximate="tanh")
        x = x + F.linear(h, model.fcprojw[l], model.fcprojb[l])
    last = F.layer_norm(x[-1], (C,), model.lnfw, model.lnfb, ref.LAYERNORM_EPS)
    return last @ model.wte.t()


def torch_greedy_cached(model, prompt, n):
    cache = [[] for _ in range(model.config.num_layers)]
    out, logits = [], torch_forward_cached(model, list(prompt), cache)
    for _ in range(n):
        out.append(int(torch.argmax(logits)))
        logits = torch_forward_cached(model, [out[-1]], cache)
    return out


def machine_line():
    cpu = platform.processor() or "unknown CPU"
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return f"{cpu}, {os.cpu_count()} cores, {gpu}; load {os.getloadavg()[0]:.2f}"


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", action="append", default=[], help="a trainer to time (repeatable)")
    ap.add_argument("--shape", default="L=12,C=768,H=12,T=1024,V=50257")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="CPU threads for the CPU trainer and torch (0 = all)")
    ap.add_argument("--torch-device", default="cpu")
    ap.add_argument("--no-torch-uncached", action="store_true", help="skip PyTorch without a cache (slow at long samples)")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    cfg = parse_shape(args.shape)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT).stdout.strip()
    print(f"machine: {machine_line()}")
    print(f"commit {commit}; torch {torch.__version__}; command: {' '.join(sys.argv)}")
    print(f"model {args.shape} (random weights), greedy, {args.tokens} tokens after a text prompt; median of {args.repeats}")

    work = tempfile.mkdtemp(prefix="llmc_bench_generate_")
    model_path = os.path.join(work, "model.bin")
    model = ref.GPT2(cfg)
    ref.init_fixture_weights(model, 1337)
    ref.save_model(model_path, model)
    model = model.to(args.torch_device)

    # the prompt's tokens, from the first trainer's tokenizer, for PyTorch
    if not args.trainer:
        raise SystemExit("give at least one --trainer (its tokenizer gives the prompt's tokens to PyTorch)")
    prompt_tokens = run_trainer(args.trainer[0], model_path, PROMPT, 1, 1, args.threads)[0]["prompt_tokens"]
    print(f"prompt: {len(prompt_tokens)} tokens", flush=True)

    def trainer_side(trainer, kv):
        def measure():
            line, seconds = run_trainer(trainer, model_path, PROMPT, args.tokens, kv, args.threads)
            return line["tokens"], seconds
        return f"{os.path.basename(trainer)} --kv-cache {kv}", measure

    def torch_side(name, fn):
        def measure():
            with torch.no_grad():
                if args.torch_device == "cuda":
                    torch.cuda.synchronize()
                start = time.perf_counter()
                tokens = fn(model, prompt_tokens, args.tokens)
                if args.torch_device == "cuda":
                    torch.cuda.synchronize()
                return tokens, time.perf_counter() - start
        return f"{name} ({args.torch_device})", measure

    sides = [trainer_side(t, kv) for t in args.trainer for kv in (1, 0)]
    sides.append(torch_side("pytorch, kv cache", torch_greedy_cached))
    if not args.no_torch_uncached:
        sides.append(torch_side("pytorch, no cache", torch_greedy_no_cache))
    with torch.no_grad():  # PyTorch's warm-up: allocations, thread pools
        torch_greedy_cached(model, prompt_tokens, 4)
    # in rounds, every side once per round: a shared machine's load changes minute to minute, and
    # this spreads it over all sides alike
    times = {name: [] for name, _ in sides}
    tokens_of = {}
    for r in range(args.repeats):
        for name, measure in sides:
            tokens_of[name], seconds = measure()
            times[name].append(seconds)
        print(f"round {r + 1}: " + ", ".join(f"{name} {times[name][-1]:.2f} s" for name, _ in sides), flush=True)

    first_name = sides[0][0]
    first_tokens, base = tokens_of[first_name], statistics.median(times[first_name])
    print(f"load average at the end: {os.getloadavg()[0]:.2f}")
    print(f"{'side':36s} {'seconds':>9s} {'tokens/s':>10s} {'speed/1st':>9s}  same tokens as the first")
    for name, _ in sides:
        seconds = statistics.median(times[name])
        agree = next((i for i, (a, b) in enumerate(zip(tokens_of[name], first_tokens)) if a != b), len(first_tokens))
        print(f"{name:36s} {seconds:9.3f} {args.tokens / seconds:10.1f} {base / seconds:8.2f}x  "
              f"{'all' if agree == len(first_tokens) else f'first {agree}'}")


if __name__ == "__main__":
    main()
