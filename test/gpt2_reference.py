#!/usr/bin/env python3
"""An independent PyTorch GPT-2: the reference the C++/CUDA trainers are tested against.

What it teaches: the whole GPT-2 computation written out once in plain tensor math, small enough to
read in one sitting, and the exact file formats and optimizer step the trainers must reproduce.

The model (B = batch, T = sequence length, C = channels, NH = heads, hs = C/NH, V = vocabulary):

    x      = wte[tokens] + wpe[0:T]                                   (B, T, C)
    for each of the L layers:
      x    = x + attproj( causal_self_attention( qkv( layernorm1(x) ) ) )
      x    = x + fcproj( gelu_tanh( fc( layernorm2(x) ) ) )
    logits = layernorm_f(x) @ wte^T                                   (B, T, V)  tied LM head
    loss   = mean over the B*T positions of  logsumexp(logits) - logits[target]

    layernorm(x)  = (x - mean) / sqrt(var + 1e-5) * w + b        biased variance over C
    gelu_tanh(x)  = 0.5 x (1 + tanh( sqrt(2/pi) (x + 0.044715 x^3) ))
    attention     : q, k, v = split(qkv, C); per head  softmax(q k^T / sqrt(hs) + causal mask) v

The parameters are stored exactly as the model file lays them out: one tensor per kind with all
L layers stacked (qkvw is (L, 3C, C), nn.Linear's (out, in) layout), so saving, loading and
flattening the gradient in "file order" is a loop over one table, PARAMETER_TABLE below. The only
difference from the file: wte here has V rows; the file pads it to Vp rows (a multiple of 128,
50257 -> 50304, so the GPU's matmuls tile evenly) and those padded rows are zero.

Trade-offs: everything is fp32 (float64 for self-checks) and written for clarity, not speed:
layer norm, GELU and cross-entropy are explicit formulas, and attention materialises the (T, T)
score matrix, O(T^2) memory per head. For benchmarking, GPT2(config, use_sdpa=True,
use_fused_ops=True) swaps in torch's fused kernels (F.scaled_dot_product_attention needs
torch >= 2.0); the model stays a normal nn.Module, so bf16 autocast and torch.compile apply.

Command line: writes a test fixture directory (see make_fixture):
    python3 test/gpt2_reference.py --out DIR --layers 2 --channels 64 --heads 4 --max-seq-len 64 \\
        --vocab 512 --batch 4 --seq-len 32 --steps 10 --lr 1e-4 --weight-decay 0.1 \\
        --grad-clip 1.0 --seed 1337
"""
import argparse
import math
import os
import sys
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from safetensors_io import read_safetensors_header, write_safetensors  # noqa: E402

MODEL_MAGIC = 20240326
MODEL_VERSION_FP32 = 3       # version 5 is the bf16 file, which the reference does not handle
TOKENS_MAGIC = 20240520
TOKENS_VERSION = 1
HEADER_INTS = 256            # both file kinds start with 256 int32 = 1024 bytes
LAYERNORM_EPS = 1e-5
VOCAB_PAD_MULTIPLE = 128

# AdamW decays only the matrices; biases and LayerNorm gains/offsets are not decayed (decaying a
# LayerNorm gain towards 0 would fight the normalisation it exists to undo).
WEIGHT_DECAY_PARAMS = ("wte", "wpe", "qkvw", "attprojw", "fcw", "fcprojw")
ADAM_BETAS = (0.9, 0.95)
ADAM_EPS = 1e-8


@dataclass
class GPT2Config:
    max_seq_len: int
    vocab_size: int
    num_layers: int
    num_heads: int
    channels: int
    padded_vocab_size: int = 0   # 0: round vocab_size up to a multiple of 128

    def __post_init__(self):
        if self.padded_vocab_size == 0:
            multiple = VOCAB_PAD_MULTIPLE
            self.padded_vocab_size = (self.vocab_size + multiple - 1) // multiple * multiple
        if self.channels % self.num_heads != 0:
            raise ValueError(f"channels {self.channels} not divisible by heads {self.num_heads}")
        if self.padded_vocab_size < self.vocab_size:
            raise ValueError("padded_vocab_size < vocab_size")


def parameter_table(config, padded=True):
    """[(name, shape)] in model-file order. The single source of truth for the layout."""
    L, C, maxT = config.num_layers, config.channels, config.max_seq_len
    V = config.padded_vocab_size if padded else config.vocab_size
    return [
        ("wte", (V, C)), ("wpe", (maxT, C)),
        ("ln1w", (L, C)), ("ln1b", (L, C)),
        ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)),
        ("attprojw", (L, C, C)), ("attprojb", (L, C)),
        ("ln2w", (L, C)), ("ln2b", (L, C)),
        ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)),
        ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
        ("lnfw", (C,)), ("lnfb", (C,)),
    ]


def num_parameters(config, padded=True):
    return sum(math.prod(shape) for _, shape in parameter_table(config, padded))


# ----------------------------------------------------------------------------------------------
# The math, as free functions so each reads like its formula.

def layer_norm(x, weight, bias):
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)     # biased (divide by C), as GPT-2
    return (x - mean) * torch.rsqrt(var + LAYERNORM_EPS) * weight + bias


def gelu_tanh(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def causal_attention(q, k, v):
    """q, k, v: (B, NH, T, hs) -> (B, NH, T, hs). Position t attends to positions 0..t."""
    T, head_size = q.shape[-2], q.shape[-1]
    scores = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(head_size))     # (B, NH, T, T)
    future = torch.triu(torch.ones(T, T, dtype=torch.bool, device=q.device), diagonal=1)
    scores = scores.masked_fill(future, float("-inf"))    # exp(-inf) = 0: no weight on the future
    return torch.softmax(scores, dim=-1) @ v


def cross_entropy(logits, targets):
    """Mean over all positions of -log softmax(logits)[target]."""
    # logsumexp with the max subtracted so exp never overflows; the max is detached because the
    # result does not depend on it mathematically (it cancels), so no gradient should flow to it.
    row_max = logits.max(dim=-1, keepdim=True).values.detach()
    log_sum_exp = row_max.squeeze(-1) + torch.log(torch.exp(logits - row_max).sum(dim=-1))
    target_logit = logits.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return (log_sum_exp - target_logit).mean()


# ----------------------------------------------------------------------------------------------

class GPT2(nn.Module):
    def __init__(self, config, use_sdpa=False, use_fused_ops=False):
        """use_sdpa: attention by F.scaled_dot_product_attention; use_fused_ops: torch's layer
        norm, GELU and cross-entropy kernels. Both are for speed (benchmarks); tests use neither."""
        super().__init__()
        if use_sdpa and not hasattr(F, "scaled_dot_product_attention"):
            raise RuntimeError(f"use_sdpa needs torch >= 2.0 (this is {torch.__version__})")
        self.config = config
        self.use_sdpa = use_sdpa
        self.use_fused_ops = use_fused_ops
        for name, shape in parameter_table(config, padded=False):
            self.register_parameter(name, nn.Parameter(torch.zeros(shape)))

    def forward(self, tokens, targets=None):
        """tokens, targets: (B, T) int64. Returns (logits (B, T, V), mean loss or None)."""
        cfg = self.config
        B, T = tokens.shape
        C, NH = cfg.channels, cfg.num_heads
        if T > cfg.max_seq_len:
            raise ValueError(f"sequence length {T} > max_seq_len {cfg.max_seq_len}")
        norm = self._fused_layer_norm if self.use_fused_ops else layer_norm
        gelu = self._fused_gelu if self.use_fused_ops else gelu_tanh

        # unbind once per kind: indexing the stacked tensor per layer (qkvw[l]) would make
        # autograd allocate and add a full (L, ...) gradient for every layer, O(L^2) traffic.
        ln1w, ln1b, qkvw, qkvb = (p.unbind(0) for p in (self.ln1w, self.ln1b, self.qkvw, self.qkvb))
        attprojw, attprojb = self.attprojw.unbind(0), self.attprojb.unbind(0)
        ln2w, ln2b, fcw, fcb = (p.unbind(0) for p in (self.ln2w, self.ln2b, self.fcw, self.fcb))
        fcprojw, fcprojb = self.fcprojw.unbind(0), self.fcprojb.unbind(0)

        x = self.wte[tokens] + self.wpe[:T]
        for l in range(cfg.num_layers):
            # F.linear(h, w, b) = h @ w^T + b, with w in the file's (out, in) layout
            qkv = F.linear(norm(x, ln1w[l], ln1b[l]), qkvw[l], qkvb[l])          # (B, T, 3C)
            q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in qkv.split(C, dim=-1))
            if self.use_sdpa:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            else:
                y = causal_attention(q, k, v)
            y = y.transpose(1, 2).reshape(B, T, C)                                # heads side by side
            x = x + F.linear(y, attprojw[l], attprojb[l])
            h = gelu(F.linear(norm(x, ln2w[l], ln2b[l]), fcw[l], fcb[l]))          # (B, T, 4C)
            x = x + F.linear(h, fcprojw[l], fcprojb[l])
        logits = norm(x, self.lnfw, self.lnfb) @ self.wte.t()                       # (B, T, V)
        if targets is None:
            return logits, None
        if self.use_fused_ops:
            loss = F.cross_entropy(logits.view(B * T, -1), targets.reshape(-1))  # fp32 under autocast
        else:
            loss = cross_entropy(logits, targets)
        return logits, loss

    @staticmethod
    def _fused_layer_norm(x, weight, bias):
        return F.layer_norm(x, (x.shape[-1],), weight, bias, LAYERNORM_EPS)

    @staticmethod
    def _fused_gelu(x):
        return F.gelu(x, approximate="tanh")


def init_fixture_weights(model, seed):
    """Random weights chosen to make bugs visible, not to train well.

    GPT-2's own init (zero biases, unit LayerNorm gains) would hide a swapped, transposed or
    ignored bias or gain: a zero bias added to the wrong tensor changes nothing. So every
    parameter is random and distinct: matrices N(0, 0.02), residual projections (attprojw,
    fcprojw) N(0, 0.02/sqrt(2L)) as in GPT-2 (each of the 2L residual additions adds variance),
    biases N(0, 0.02), LayerNorm gains 1 + N(0, 0.1) and offsets N(0, 0.1).
    """
    generator = torch.Generator().manual_seed(seed)
    residual_std = 0.02 / math.sqrt(2 * model.config.num_layers)
    std = {"attprojw": residual_std, "fcprojw": residual_std,
           "ln1w": 0.1, "ln2w": 0.1, "lnfw": 0.1, "ln1b": 0.1, "ln2b": 0.1, "lnfb": 0.1}
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator, dtype=torch.float32)
            value = noise * std.get(name, 0.02)
            if name in ("ln1w", "ln2w", "lnfw"):
                value += 1.0
            param.copy_(value)
    return generator


# ----------------------------------------------------------------------------------------------
# Files: the model file and the token shard (llm.c's formats).

def save_model(path, model):
    cfg = model.config
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:8] = [MODEL_MAGIC, MODEL_VERSION_FP32, cfg.max_seq_len, cfg.vocab_size,
                  cfg.num_layers, cfg.num_heads, cfg.channels, cfg.padded_vocab_size]
    with open(path, "wb") as f:
        header.tofile(f)
        for name, _ in parameter_table(cfg, padded=False):
            values = getattr(model, name).detach().to(torch.float32).cpu().numpy()
            values.astype("<f4", copy=False).tofile(f)
            if name == "wte":
                padding_rows = cfg.padded_vocab_size - cfg.vocab_size
                np.zeros((padding_rows, cfg.channels), dtype="<f4").tofile(f)


def read_model_header(path):
    with open(path, "rb") as f:
        header = np.fromfile(f, dtype="<i4", count=HEADER_INTS)
    if header.size != HEADER_INTS or header[0] != MODEL_MAGIC:
        raise ValueError(f"{path}: not a model file (bad magic)")
    if header[1] != MODEL_VERSION_FP32:
        raise ValueError(f"{path}: model file version {header[1]}; the reference reads only "
                         f"version {MODEL_VERSION_FP32} (fp32)")
    return GPT2Config(max_seq_len=int(header[2]), vocab_size=int(header[3]),
                      num_layers=int(header[4]), num_heads=int(header[5]),
                      channels=int(header[6]), padded_vocab_size=int(header[7]))


def load_model(path, **model_options):
    """Read a version-3 model file; the padded wte rows are dropped."""
    config = read_model_header(path)
    expected_bytes = 4 * HEADER_INTS + 4 * num_parameters(config)
    if os.path.getsize(path) != expected_bytes:
        raise ValueError(f"{path}: {os.path.getsize(path)} bytes, expected {expected_bytes} "
                         "for the shape in its header")
    model = GPT2(config, **model_options)
    with open(path, "rb") as f:
        f.seek(4 * HEADER_INTS)
        with torch.no_grad():
            for name, shape in parameter_table(config, padded=True):
                values = np.fromfile(f, dtype="<f4", count=math.prod(shape)).reshape(shape)
                if name == "wte":
                    values = values[:config.vocab_size]
                getattr(model, name).copy_(torch.from_numpy(values.copy()))
    return model


def write_token_shard(path, tokens):
    tokens = np.asarray(tokens)
    if tokens.min() < 0 or tokens.max() > 65535:
        raise ValueError("token ids must fit in uint16")
    header = np.zeros(HEADER_INTS, dtype="<i4")
    header[:3] = [TOKENS_MAGIC, TOKENS_VERSION, tokens.size]
    with open(path, "wb") as f:
        header.tofile(f)
        tokens.astype("<u2").tofile(f)


def read_token_shard(path):
    with open(path, "rb") as f:
        header = np.fromfile(f, dtype="<i4", count=HEADER_INTS)
        if header.size != HEADER_INTS or header[0] != TOKENS_MAGIC or header[1] != TOKENS_VERSION:
            raise ValueError(f"{path}: not a token shard (bad magic or version)")
        tokens = np.fromfile(f, dtype="<u2")
    if tokens.size != header[2]:
        raise ValueError(f"{path}: header says {header[2]} tokens, file holds {tokens.size}")
    return tokens


def flatten_in_file_order(tensors_by_name, config):
    """Concatenate {name: tensor (unpadded wte)} in file order into one fp32 numpy vector,
    inserting the zero rows that pad wte to Vp, exactly as the model file stores them."""
    pieces = []
    for name, _ in parameter_table(config, padded=False):
        pieces.append(tensors_by_name[name].detach().to(torch.float32).cpu().reshape(-1))
        if name == "wte":
            pieces.append(torch.zeros((config.padded_vocab_size - config.vocab_size) * config.channels))
    return torch.cat(pieces).numpy()


def split_file_order(flat, config):
    """The inverse view: {name: array of the padded file shape} over a flat file-order vector."""
    tensors, offset = {}, 0
    for name, shape in parameter_table(config, padded=True):
        size = math.prod(shape)
        tensors[name] = flat[offset:offset + size].reshape(shape)
        offset += size
    if offset != flat.size:
        raise ValueError(f"flat vector has {flat.size} values, the model has {offset}")
    return tensors


# ----------------------------------------------------------------------------------------------
# Training, as the trainers implement it.

def make_optimizer(model, lr, weight_decay):
    """torch's AdamW with two groups. Per parameter p with gradient g, at step t (from 1):
         m = b1 m + (1 - b1) g          v = b2 v + (1 - b2) g^2
         p = p - lr * wd * p                                  (decoupled decay, decayed group only)
         p = p - lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)
    """
    named = dict(model.named_parameters())
    decayed = [named[n] for n in named if n in WEIGHT_DECAY_PARAMS]
    not_decayed = [named[n] for n in named if n not in WEIGHT_DECAY_PARAMS]
    groups = [{"params": decayed, "weight_decay": weight_decay},
              {"params": not_decayed, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=ADAM_BETAS, eps=ADAM_EPS)


def clip_by_global_norm(params, max_norm):
    """Scale all gradients by min(1, max_norm / (norm + 1e-6)), norm = sqrt(sum of all g^2) over
    every parameter: torch.nn.utils.clip_grad_norm_'s formula. Returns the pre-clip norm.
    max_norm <= 0 only measures.

    The squares are summed in float64. A float32 running sum over millions of squares loses
    bits: torch 1.13's own fp32 norm (CPU) was seen 0.3% off on the 124M model's gradient
    (14.869 vs 14.918). The clip factor scales every update, so that 0.3% moved the 124M
    training's losses by up to 1.4e-3 nats within 10 steps, against 3e-6 with this sum."""
    norm = math.sqrt(sum(float(torch.linalg.vector_norm(p.grad, dtype=torch.float64)) ** 2
                         for p in params))
    if max_norm > 0:
        scale = min(1.0, max_norm / (norm + 1e-6))
        for p in params:
            p.grad.mul_(scale)
    return norm


def train(model, inputs, targets, steps, lr, weight_decay, grad_clip):
    """Train on the same batch every step (the fixture's shard holds exactly one batch).

    Returns a dict of numpy arrays: logits (B, T, V) and loss (1,) of the first forward, grads
    (P,) the first step's gradient before clipping in file order, losses (steps,) and norms
    (steps,) the loss and pre-clip gradient norm of each step, params (P,) after the last update.
    """
    optimizer = make_optimizer(model, lr, weight_decay)
    params = list(model.parameters())
    losses, norms = [], []
    record = {}
    for step in range(steps):
        optimizer.zero_grad(set_to_none=True)
        logits, loss = model(inputs, targets)
        loss.backward()
        if step == 0:
            record["logits"] = logits.detach().to(torch.float32).numpy()
            record["loss"] = np.array([loss.item()], dtype=np.float32)
            record["grads"] = flatten_in_file_order({n: p.grad for n, p in model.named_parameters()},
                                                    model.config)
        norm = clip_by_global_norm(params, grad_clip)
        optimizer.step()
        losses.append(loss.item())
        norms.append(norm)
    record["losses"] = np.array(losses, dtype=np.float32)
    record["norms"] = np.array(norms, dtype=np.float32)
    record["params"] = flatten_in_file_order(dict(model.named_parameters()), model.config)
    return record


def batch_from_tokens(tokens, batch_size, seq_len):
    """The trainers' loader on a shard of exactly B*T+1 tokens: inputs are the first B*T tokens,
    targets the same shifted by one."""
    needed = batch_size * seq_len + 1
    if tokens.size < needed:
        raise ValueError(f"{tokens.size} tokens, a batch needs {needed}")
    window = torch.from_numpy(tokens[:needed].astype(np.int64))
    return window[:-1].view(batch_size, seq_len), window[1:].view(batch_size, seq_len)


# ----------------------------------------------------------------------------------------------
# Fixtures.

def fixture_metadata(config, batch_size, seq_len, steps, lr, weight_decay, grad_clip, seed, dtype):
    """Everything that determines a fixture, as strings; a fixture is reused only if they match."""
    return {
        "generator": "test/gpt2_reference.py", "format_version": "2",
        "layers": config.num_layers, "channels": config.channels, "heads": config.num_heads,
        "max_seq_len": config.max_seq_len, "vocab_size": config.vocab_size,
        "padded_vocab_size": config.padded_vocab_size, "num_parameters": num_parameters(config),
        "batch_size": batch_size, "seq_len": seq_len, "steps": steps, "lr": repr(lr),
        "lr_schedule": "constant", "warmup_steps": 0, "weight_decay": repr(weight_decay),
        "grad_clip": repr(grad_clip), "beta1": ADAM_BETAS[0], "beta2": ADAM_BETAS[1],
        "adam_eps": ADAM_EPS, "seed": seed, "dtype": dtype, "torch_version": torch.__version__,
    }


def fixture_is_complete(out_dir, metadata):
    """True if out_dir holds a finished fixture made with the same settings."""
    paths = {n: os.path.join(out_dir, n) for n in ("model.bin", "batch.bin", "expected.safetensors")}
    if not all(os.path.isfile(p) for p in paths.values()):
        return False
    try:
        _, found, _ = read_safetensors_header(paths["expected.safetensors"])
    except (ValueError, OSError):
        return False
    ignore = {"torch_version"}
    wanted = {k: str(v) for k, v in metadata.items() if k not in ignore}
    if any(found.get(k) != v for k, v in wanted.items()):
        return False
    params = int(metadata["num_parameters"])
    tokens = int(metadata["batch_size"]) * int(metadata["seq_len"]) + 1
    return (os.path.getsize(paths["model.bin"]) == 4 * HEADER_INTS + 4 * params and
            os.path.getsize(paths["batch.bin"]) == 4 * HEADER_INTS + 2 * tokens)


def make_fixture(out_dir, config, batch_size, seq_len, steps, lr, weight_decay, grad_clip, seed,
                 dtype=torch.float32):
    """Write out_dir/model.bin, batch.bin and expected.safetensors (see the module docstring of
    test/test_vs_pytorch.py for the tensor contract). expected.safetensors is written last and
    renamed into place, so its presence means the fixture is complete."""
    os.makedirs(out_dir, exist_ok=True)
    model = GPT2(config)
    generator = init_fixture_weights(model, seed)
    tokens = torch.randint(0, config.vocab_size, (batch_size * seq_len + 1,), generator=generator)
    model_path = os.path.join(out_dir, "model.bin")
    batch_path = os.path.join(out_dir, "batch.bin")
    save_model(model_path, model)
    write_token_shard(batch_path, tokens.numpy())
    del model

    # train from what was written, so the expectations are exactly those of the files
    model = load_model(model_path).to(dtype)
    inputs, targets = batch_from_tokens(read_token_shard(batch_path), batch_size, seq_len)
    record = train(model, inputs, targets, steps, lr, weight_decay, grad_clip)
    metadata = fixture_metadata(config, batch_size, seq_len, steps, lr, weight_decay, grad_clip,
                                seed, str(dtype).replace("torch.", ""))
    temp_path = os.path.join(out_dir, "expected.safetensors.tmp")
    write_safetensors(temp_path, record, metadata)
    os.replace(temp_path, os.path.join(out_dir, "expected.safetensors"))
    return record


def main():
    parser = argparse.ArgumentParser(description="Write a GPT-2 training test fixture.")
    parser.add_argument("--out", required=True, help="fixture directory to write")
    parser.add_argument("--layers", type=int, required=True)
    parser.add_argument("--channels", type=int, required=True)
    parser.add_argument("--heads", type=int, required=True)
    parser.add_argument("--max-seq-len", type=int, required=True)
    parser.add_argument("--vocab", type=int, required=True)
    parser.add_argument("--batch", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--lr", type=float, default=1e-4)
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float32",
                        help="compute precision (float64 measures fp32's own rounding noise)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--force", action="store_true", help="rewrite even if complete")
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    config = GPT2Config(max_seq_len=args.max_seq_len, vocab_size=args.vocab,
                        num_layers=args.layers, num_heads=args.heads, channels=args.channels)
    if args.seq_len > args.max_seq_len:
        parser.error("--seq-len exceeds --max-seq-len")
    metadata = fixture_metadata(config, args.batch, args.seq_len, args.steps, args.lr,
                                args.weight_decay, args.grad_clip, args.seed, args.dtype)
    if not args.force and fixture_is_complete(args.out, metadata):
        print(f"fixture {args.out} is complete; nothing to do")
        return
    record = make_fixture(args.out, config, args.batch, args.seq_len, args.steps, args.lr,
                          args.weight_decay, args.grad_clip, args.seed,
                          dtype=getattr(torch, args.dtype))
    print(f"wrote {args.out}: {num_parameters(config)} parameters, losses "
          + " ".join(f"{x:.6f}" for x in record["losses"]))


if __name__ == "__main__":
    main()
