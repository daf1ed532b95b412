#!/usr/bin/env python3
"""How far may the bf16 GPU trainer be from the fp32 CPU reference? An error model, in PyTorch.

test/test_gpu.py compares ./train_gpt (bf16) with ./train_gpt_cpu (fp32) and needs limits that a
correct trainer always meets and a wrong one does not. This script measures what "correct" gives:
it runs GPT-2 twice on the CPU, in fp32, once exactly and once rounding to bf16 at every place the
GPU trainer stores a bf16 tensor (embeddings, LayerNorm outputs, qkv, attention probabilities before
P V and its output, every projection, the residual stream, GELU, logits; and each of their gradients
in the backward), with bf16 parameters stochastically rounded from fp32 master weights after each
AdamW step. It prints the same numbers test_gpu.py checks. Not a test (its name does not start with
test_): run it when a tolerance is in doubt, e.g. for the shapes test_gpu.py uses:

  python3 test/bf16_error_model.py 2 128 2 64 500 4 10          # tiny: L C H T V B steps [lr]
  python3 test/bf16_error_model.py 12 768 12 64 50257 1 2 1e-4   # d12 (a few minutes)
  python3 test/bf16_error_model.py 2 128 2 64 500 4 10 --fp16   # the fp16 build (test/test_fp16.py)

With --fp16 it rounds to fp16 instead (11 significant bits, 2^-24..65504), the gradients as the fp16
build stores them: S times larger (the loss scale, 65536), rounded, divided by S again; and the
parameters are rounded to the nearest fp16 after each step (the trainer rounds them stochastically:
the same size of error, in expectation).

What it leaves out (the libraries' summation orders, cuDNN's internal rounding, bf16 accumulation of
the parameter gradients across layers) is why test_gpu.py's limits are several times these numbers.
"""
import math, sys
import numpy as np
import torch


FP16 = "--fp16" in sys.argv
LOSS_SCALE = 65536.0 if FP16 else 1.0  # fp16's gradients are stored S times larger (llmc/optim/loss_scaler.h)


def bf16(x):
    """Round to the nearest bf16 (with --fp16: fp16), kept in an fp32 tensor."""
    return x.to(torch.float16 if FP16 else torch.bfloat16).to(torch.float32)


def stored_grad(g):
    """A gradient as the trainer stores it: times S, rounded, and (to compare) divided by S again."""
    return bf16(g * LOSS_SCALE) / LOSS_SCALE


class StoreBF16(torch.autograd.Function):
    """A tensor the GPU trainer stores in bf16: rounded in the forward, its gradient in the backward."""
    @staticmethod
    def forward(ctx, x):
        return bf16(x)

    @staticmethod
    def backward(ctx, g):
        return stored_grad(g)


def stochastic_bf16(x, gen):
    """Round to bf16 up or down with probability proportional to the distance (as llmc/optim/adamw.cuh)."""
    bits = x.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    bits = ((bits + torch.randint(0, 65536, x.shape, generator=gen, dtype=torch.int64)) >> 16) << 16
    return torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32).view(torch.float32)


def main():
    args = [a for a in sys.argv[1:] if a != "--fp16"]
    L, C, H, T, V, B, steps = [int(a) for a in args[:7]]
    max_lr = float(args[7]) if len(args) > 7 else 1e-3
    Vp, hs = (V + 127) // 128 * 128, C // H
    rng = np.random.default_rng(1)
    shapes = dict(wte=(Vp, C), wpe=(T, C), ln1w=(L, C), ln1b=(L, C), qkvw=(L, 3 * C, C), qkvb=(L, 3 * C),
                  attprojw=(L, C, C), attprojb=(L, C), ln2w=(L, C), ln2b=(L, C), fcw=(L, 4 * C, C), fcb=(L, 4 * C),
                  fcprojw=(L, C, 4 * C), fcprojb=(L, C), lnfw=(C,), lnfb=(C,))
    init = {}
    for n, shape in shapes.items():  # as test_gpu.py's write_model: bf16-exact starting weights
        gain = n in ("ln1w", "ln2w", "lnfw")
        w = torch.tensor((1.0 + 0.1 * rng.standard_normal(shape)) if gain else 0.02 * rng.standard_normal(shape),
                         dtype=torch.float32)
        if n == "wte":
            w[V:] = 0
        init[n] = bf16(w)
    decays = {"wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw"}
    tokens = np.tile(rng.integers(0, V, 997), 60)

    def forward(p, inp, tgt, s):
        def layernorm(x, w, b):
            m = x.mean(-1, keepdim=True)
            v = ((x - m) ** 2).mean(-1, keepdim=True)
            return s((x - m) / torch.sqrt(v + 1e-5) * w + b)
        x = s(p["wte"][inp] + p["wpe"][:T])
        causal = torch.ones(T, T).tril().bool()
        for l in range(L):
            q, k, v = s(layernorm(x, p["ln1w"][l], p["ln1b"][l]) @ p["qkvw"][l].T + p["qkvb"][l]).split(C, -1)
            q, k, v = [t.view(B, T, H, hs).transpose(1, 2) for t in (q, k, v)]
            att = s(torch.softmax(((q @ k.transpose(-1, -2)) / math.sqrt(hs)).masked_fill(~causal, float("-inf")), -1))
            y = s((att @ v).transpose(1, 2).reshape(B, T, C))
            x = s(x + s(y @ p["attprojw"][l].T + p["attprojb"][l]))
            f = s(layernorm(x, p["ln2w"][l], p["ln2b"][l]) @ p["fcw"][l].T + p["fcb"][l])
            g = s(0.5 * f * (1 + torch.tanh(math.sqrt(2 / math.pi) * (f + 0.044715 * f ** 3))))
            x = s(x + s(g @ p["fcprojw"][l].T + p["fcprojb"][l]))
        logits = s(layernorm(x, p["lnfw"], p["lnfb"]) @ p["wte"].T)[..., :V]
        return logits, torch.nn.functional.cross_entropy(logits.reshape(-1, V), tgt.reshape(-1))

    def train(low_precision):
        s = StoreBF16.apply if low_precision else (lambda t: t)
        master = {n: w.clone() for n, w in init.items()}
        params = {n: w.clone() for n, w in init.items()}
        m = {n: torch.zeros_like(w) for n, w in init.items()}
        v = {n: torch.zeros_like(w) for n, w in init.items()}
        gen = torch.Generator().manual_seed(5)
        out = dict(losses=[])
        for step in range(steps):
            p = {n: w.clone().requires_grad_(True) for n, w in params.items()}
            chunk = torch.tensor(tokens[step * B * T: (step + 1) * B * T + 1].astype(np.int64))
            logits, loss = forward(p, chunk[:-1].view(B, T), chunk[1:].view(B, T), s)
            loss.backward()
            grads = {n: stored_grad(p[n].grad) if low_precision else p[n].grad for n in p}
            if step == 0:
                out.update(logits=logits.detach(), loss=loss.item(), grads=grads)
            out["losses"].append(loss.item())
            norm = math.sqrt(sum(float((g.double() ** 2).sum()) for g in grads.values()))
            clip, lr, t = min(1.0, 1.0 / (norm + 1e-6)), max_lr * min(1.0, (step + 1) / 2), step + 1
            for n in params:  # AdamW as the trainers write it (lr schedule: 2 warmup steps, then constant)
                g = grads[n] * clip
                m[n] = 0.9 * m[n] + 0.1 * g
                v[n] = 0.95 * v[n] + 0.05 * g * g
                decay = 1 - lr * 0.1 if n in decays else 1.0
                master[n] = master[n] * decay - lr / (1 - 0.9 ** t) * m[n] / (v[n].sqrt() / math.sqrt(1 - 0.95 ** t) + 1e-8)
                if not low_precision:
                    params[n] = master[n].clone()
                else:
                    params[n] = bf16(master[n]) if FP16 else stochastic_bf16(master[n], gen)
        out["params"] = master
        return out

    def rel(a, b):
        a, b = a.double().flatten(), b.double().flatten()
        return float((a - b).norm() / b.norm())

    low, exact = train(True), train(False)
    print(f"{'fp16, loss scale 65536' if FP16 else 'bf16'}: L={L} C={C} H={H} T={T} V={V} B={B}, {steps} steps")
    print(f"logits: relative L2 error {rel(low['logits'], exact['logits']):.2e}; loss difference {abs(low['loss'] - exact['loss']):.2e}")
    for n in shapes:
        if exact["grads"][n].norm() > 0:
            cos = float(torch.nn.functional.cosine_similarity(low["grads"][n].flatten().double(), exact["grads"][n].flatten().double(), 0))
            print(f"  gradient {n:9s} relative L2 error {rel(low['grads'][n], exact['grads'][n]):.2e}, cosine {cos:.6f}")
    print(f"losses of the {steps} steps: max difference {max(abs(a - b) for a, b in zip(low['losses'], exact['losses'])):.2e}")
    change = lambda d: torch.cat([(d[n] - init[n]).flatten() for n in shapes])
    print(f"weight change after {steps} steps: relative L2 error {rel(change(low['params']), change(exact['params'])):.3f}")


if __name__ == "__main__":
    main()
