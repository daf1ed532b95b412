#!/usr/bin/env python3
"""How far may the bf16 GPU trainer on a grid of ranks be from the same trainer on one rank? An error
model, in PyTorch, for test/test_gpu_parallelism.py's tolerances.

Both runs are bf16 (test/bf16_error_model.py rounds exactly where the GPU trainer stores bf16: every
activation, every gradient, the weights stochastically rounded from fp32 master weights). What a
grid changes is WHERE some sums are rounded, never what is summed:

  tensor parallelism  a row-parallel matmul (attention and MLP output projections) produces t partial
                      sums over C/t or 4C/t inputs, each rounded to bf16 in cuBLASLt's epilogue, then
                      summed (in fp32 with host staging) and rounded again; likewise the gradient that
                      flows into a column-parallel matmul's input (qkv, fc, the LM head over its
                      vocabulary rows): t rounded partials, summed, rounded
  data parallelism,   each rank accumulates its micro-batches' gradients in bf16 (rounded after each),
  ZeRO-2/3            the ranks' gradients are summed and rounded once; one rank accumulates all m*N
                      micro-batches one after the other, rounding after each
  pipelines           the tied embedding: the first stage accumulates the embedding's gradient, the
                      last the LM head's, then the two are added; one rank adds them micro-batch by
                      micro-batch. A reordered bf16 accumulation of one tensor: less than data
                      parallelism's reordering of every tensor's, so not simulated separately

This script runs the test's model (L=4 C=128 H=4 T=32 V=501, B=1, 4 micro-batches a step, 6 steps,
lr 1e-3) once as one rank and once with each of these roundings, and prints what test_gpu_parallelism
checks: the step-1 gradient's relative L2 error and cosine, the first logits' relative L2 error, the
largest difference of a step's loss, and the weight change's relative L2 error after 6 steps; and
the same for the negative control (one rank with half of each step's batch). Not a test: run it when
a tolerance is in doubt (about a minute):

  python3 test/bf16_grid_error_model.py
"""
import math, os, sys
import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from bf16_error_model import StoreBF16 as Store, bf16, stochastic_bf16  # noqa: E402

L, C, H, T, V, B, M, STEPS, LR = 4, 128, 4, 32, 501, 1, 4, 6, 1e-3
VP, HS = (V + 127) // 128 * 128, C // H


class ColumnParallel(torch.autograd.Function):
    """y = x W^T with the input's gradient summed from t rounded partials (t ranks of W's rows)."""
    @staticmethod
    def forward(ctx, x, w, t):
        ctx.save_for_backward(x, w)
        ctx.t = t
        return x @ w.T

    @staticmethod
    def backward(ctx, g):
        x, w = ctx.saved_tensors
        rows = w.shape[0] // ctx.t
        dx = sum(bf16(g[..., r * rows:(r + 1) * rows] @ w[r * rows:(r + 1) * rows]) for r in range(ctx.t))
        return bf16(dx), g.reshape(-1, g.shape[-1]).T @ x.reshape(-1, x.shape[-1]), None


def row_parallel(x, w, b, t):
    """x W^T + b as t ranks compute it: partial sums over slices of the input, each rounded (rank 0's
    with the bias), summed and rounded."""
    cols = w.shape[1] // t
    parts = [bf16(x[..., r * cols:(r + 1) * cols] @ w[:, r * cols:(r + 1) * cols].T + (b if r == 0 else 0)) for r in range(t)]
    return bf16(sum(parts)) if t > 1 else x @ w.T + b


def setup():
    rng = np.random.default_rng(1)
    shapes = dict(wte=(VP, C), wpe=(T, C), ln1w=(L, C), ln1b=(L, C), qkvw=(L, 3 * C, C), qkvb=(L, 3 * C),
                  attprojw=(L, C, C), attprojb=(L, C), ln2w=(L, C), ln2b=(L, C), fcw=(L, 4 * C, C), fcb=(L, 4 * C),
                  fcprojw=(L, C, 4 * C), fcprojb=(L, C), lnfw=(C,), lnfb=(C,))
    init = {}
    for n, shape in shapes.items():
        gain = n in ("ln1w", "ln2w", "lnfw")
        w = torch.tensor((1.0 + 0.1 * rng.standard_normal(shape)) if gain else 0.02 * rng.standard_normal(shape),
                         dtype=torch.float32)
        if n == "wte":
            w[V:] = 0
        init[n] = bf16(w)
    pattern = rng.integers(0, V, 97)
    tokens = np.where(rng.random(16384) < 0.8, pattern[np.arange(16384) % 97], rng.integers(0, V, 16384))
    return init, tokens


def forward(p, inp, tgt, tp):
    s = Store.apply

    def layernorm(x, w, b):
        m = x.mean(-1, keepdim=True)
        v = ((x - m) ** 2).mean(-1, keepdim=True)
        return s((x - m) / torch.sqrt(v + 1e-5) * w + b)

    def column(x, w, b):
        return (ColumnParallel.apply(x, w, tp) if tp > 1 else x @ w.T) + b

    x = s(p["wte"][inp] + p["wpe"][:T])
    causal = torch.ones(T, T).tril().bool()
    for l in range(L):
        q, k, v = s(column(layernorm(x, p["ln1w"][l], p["ln1b"][l]), p["qkvw"][l], p["qkvb"][l])).split(C, -1)
        q, k, v = [t.view(B, T, H, HS).transpose(1, 2) for t in (q, k, v)]
        att = s(torch.softmax(((q @ k.transpose(-1, -2)) / math.sqrt(HS)).masked_fill(~causal, float("-inf")), -1))
        y = s((att @ v).transpose(1, 2).reshape(B, T, C))
        x = s(x + s(row_parallel(y, p["attprojw"][l], p["attprojb"][l], tp)))
        f = s(column(layernorm(x, p["ln2w"][l], p["ln2b"][l]), p["fcw"][l], p["fcb"][l]))
        g = s(0.5 * f * (1 + torch.tanh(math.sqrt(2 / math.pi) * (f + 0.044715 * f ** 3))))
        x = s(x + s(row_parallel(g, p["fcprojw"][l], p["fcprojb"][l], tp)))
    logits = s(column(layernorm(x, p["lnfw"], p["lnfb"]), p["wte"], 0))[..., :V]
    return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1), reduction="sum")


def train(init, tokens, tp=1, ranks=1, micro=M):
    """STEPS steps of `micro` micro-batches, spread over `ranks` data-parallel ranks."""
    master = {n: w.clone() for n, w in init.items()}
    params = {n: w.clone() for n, w in init.items()}
    m = {n: torch.zeros_like(w) for n, w in init.items()}
    v = {n: torch.zeros_like(w) for n, w in init.items()}
    gen = torch.Generator().manual_seed(5)
    out = dict(losses=[])
    decays = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}
    at = 0
    for step in range(STEPS):
        per_rank = [{n: torch.zeros_like(w) for n, w in init.items()} for _ in range(ranks)]
        total = 0.0
        for k in range(micro):
            chunk = torch.tensor(tokens[at: at + B * T + 1].astype(np.int64))
            at += B * T
            p = {n: w.clone().requires_grad_(True) for n, w in params.items()}
            logits, loss = forward(p, chunk[:-1].view(B, T), chunk[1:].view(B, T), tp)
            (loss / (micro * B * T)).backward()
            if step == 0 and k == 0:
                out["logits"] = logits.detach()
            total += loss.item() / (micro * B * T)
            acc = per_rank[k % ranks]
            for n in p:
                acc[n] = bf16(acc[n] + bf16(p[n].grad))
        grads = {n: bf16(sum(r[n] for r in per_rank)) if ranks > 1 else per_rank[0][n] for n in init}
        if step == 0:
            out["grads"] = grads
        out["losses"].append(total)
        norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
        clip, lr, t = min(1.0, 1.0 / (norm + 1e-6)), LR * min(1.0, (step + 1) / 2), step + 1
        for n in params:
            g = grads[n] * clip
            m[n] = 0.9 * m[n] + 0.1 * g
            v[n] = 0.95 * v[n] + 0.05 * g * g
            decay = 1 - lr * 0.1 if n in decays else 1.0
            master[n] = master[n] * decay - lr / (1 - 0.9 ** t) * m[n] / (v[n].sqrt() / math.sqrt(1 - 0.95 ** t) + 1e-8)
            params[n] = stochastic_bf16(master[n], gen)
    out["params"] = master
    return out


def rel(a, b):
    a, b = a.double().flatten(), b.double().flatten()
    return float((a - b).norm() / b.norm())


def main():
    torch.manual_seed(0)
    init, tokens = setup()
    one = train(init, tokens)
    flat = lambda d: torch.cat([d[n].flatten() for n in init])
    change = lambda d: torch.cat([(d[n] - init[n]).flatten() for n in init])
    print(f"L={L} C={C} H={H} T={T} V={V}, B={B} x {M} micro-batches a step, {STEPS} steps, lr {LR}; each against one rank:")
    print(f"  {'run':34s} {'grad rel':>9s} {'cosine':>9s} {'logits':>9s} {'losses':>9s} {'weights':>9s}")
    runs = [("tp 2", dict(tp=2)), ("tp 4", dict(tp=4)), ("dp 2 (ZeRO-2/3)", dict(ranks=2)), ("dp 4", dict(ranks=4)),
            ("dp 2 x tp 2", dict(ranks=2, tp=2)),
            ("control: half of each step's batch", dict(micro=M // 2))]
    for name, kw in runs:
        r = train(init, tokens, **kw)
        cos = float(torch.nn.functional.cosine_similarity(flat(r["grads"]).double(), flat(one["grads"]).double(), 0))
        losses = max(abs(a - b) for a, b in zip(r["losses"], one["losses"]))
        print(f"  {name:34s} {rel(flat(r['grads']), flat(one['grads'])):9.2e} {cos:9.6f} "
              f"{rel(r['logits'], one['logits']):9.2e} {losses:9.2e} {rel(change(r['params']), change(one['params'])):9.2e}")


if __name__ == "__main__":
    main()
