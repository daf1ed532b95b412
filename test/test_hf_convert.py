#!/usr/bin/env python3
"""test_hf_convert.py — Hugging Face GPT-2 weights in and out of our model file (./hf_convert).

An independent reference, written here in PyTorch in Hugging Face's own conventions (the names of
GPT2LMHeadModel's state dict, Conv1D weights stored (in, out) and applied as x @ W + b, the head
tied to wte), builds a random GPT-2 and writes it as model.safetensors + config.json. Then:

  import      ./hf_convert import gives a model file whose parameters are exactly the reference's,
              rearranged by the layout of docs/formats.md (the rearrangement is re-implemented
              here, not taken from the C++), for F32, F16 and BF16 files, with and without the
              "transformer." prefix, with the attention-mask buffers and a tied lm_head present
  logits      the CPU trainer's logits on that model (--dump-state) equal the reference's, to
              fp32 rounding
  round trip  export then import gives a byte-identical model file; the exported tensors are the
              reference's own (F32: bitwise; BF16: the reference rounded to bf16); config.json
              has the fields transformers reads; a checkpoint directory exports too; an existing
              target folder is refused without --force (exit 2, untouched), an empty one is taken
  errors      malformed files (bad header, offsets that do not match, truncated data, gaps,
              missing tensors, wrong shapes, unknown tensors, an untied head, a config.json that
              disagrees) exit 1 with one line naming the tensor or the problem; bad usage exits 2

transformers itself is not a Debian package, so it is not used: the reference below is the
independent implementation of its layout. (test/safetensors_io.py, the PyTorch reference's
reader/writer, handles F32 and integer dtypes; this test needs F16, BF16 and deliberately broken
files, so it writes its own few lines.)
"""
import json, math, os, shutil, struct, subprocess, sys, tempfile
from checks import report, exit_code
import numpy as np
import torch
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_shards import write_shard  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONVERT = os.path.join(ROOT, "hf_convert")
TRAINER = os.path.join(ROOT, "train_gpt_cpu")
L, C, NH, MAXT, V = 2, 64, 4, 64, 300       # V = 300 is padded to Vp = 384 in our file


# ---- safetensors, written by hand (numpy), including broken variants

def st_bytes(tensors, metadata=None, header_override=None):
    """tensors: list of (name, dtype_name, shape, raw bytes). Returns the file's bytes."""
    header, offset = {}, 0
    for name, dtype, shape, raw in tensors:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [offset, offset + len(raw)]}
        offset += len(raw)
    if metadata:
        header["__metadata__"] = metadata
    if header_override:
        header_override(header)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + b"".join(raw for _, _, _, raw in tensors)


def as_raw(t, dtype):
    t = t.detach().contiguous()
    if dtype == "F32":
        return t.float().numpy().astype("<f4").tobytes()
    if dtype == "F16":
        return t.half().numpy().astype("<f2").tobytes()
    if dtype == "BF16":
        return t.bfloat16().view(torch.int16).numpy().astype("<i2").tobytes()
    if dtype == "I64":
        return t.long().numpy().astype("<i8").tobytes()
    raise ValueError(dtype)


def read_st(path):
    raw = open(path, "rb").read()
    n = struct.unpack("<Q", raw[:8])[0]
    header = json.loads(raw[8:8 + n])
    meta = header.pop("__metadata__", {})
    out = {}
    for name, info in header.items():
        b, e = info["data_offsets"]
        data = raw[8 + n + b:8 + n + e]
        if info["dtype"] == "F32":
            arr = torch.from_numpy(np.frombuffer(data, dtype="<f4").copy())
        elif info["dtype"] == "BF16":
            arr = torch.from_numpy(np.frombuffer(data, dtype="<i2").copy()).view(torch.bfloat16).float()
        else:
            raise ValueError(info["dtype"])
        out[name] = arr.reshape(info["shape"])
    return out, meta


# ---- the reference: GPT-2 in Hugging Face's layout and conventions

def random_hf_state_dict(seed):
    g = torch.Generator().manual_seed(seed)
    r = lambda *shape, scale=0.1: torch.randn(*shape, generator=g) * scale
    sd = {"transformer.wte.weight": r(V, C, scale=0.3), "transformer.wpe.weight": r(MAXT, C, scale=0.1)}
    for l in range(L):
        h = f"transformer.h.{l}."
        sd[h + "ln_1.weight"] = 1 + r(C)
        sd[h + "ln_1.bias"] = r(C)
        sd[h + "attn.c_attn.weight"] = r(C, 3 * C, scale=0.15)     # Conv1D: (in, out)
        sd[h + "attn.c_attn.bias"] = r(3 * C)
        sd[h + "attn.c_proj.weight"] = r(C, C)
        sd[h + "attn.c_proj.bias"] = r(C)
        sd[h + "ln_2.weight"] = 1 + r(C)
        sd[h + "ln_2.bias"] = r(C)
        sd[h + "mlp.c_fc.weight"] = r(C, 4 * C)
        sd[h + "mlp.c_fc.bias"] = r(4 * C)
        sd[h + "mlp.c_proj.weight"] = r(4 * C, C)
        sd[h + "mlp.c_proj.bias"] = r(C)
    sd["transformer.ln_f.weight"] = 1 + r(C)
    sd["transformer.ln_f.bias"] = r(C)
    return sd


def hf_logits(sd, tokens):
    """GPT2LMHeadModel's forward, in float64 from the given (already rounded) weights."""
    w = {k: v.double() for k, v in sd.items()}
    B, T = tokens.shape
    x = w["transformer.wte.weight"][tokens] + w["transformer.wpe.weight"][:T]
    ln = lambda x, p: torch.nn.functional.layer_norm(x, (C,), w[p + ".weight"], w[p + ".bias"], 1e-5)
    conv1d = lambda x, p: x @ w[p + ".weight"] + w[p + ".bias"]
    hs = C // NH
    mask = torch.triu(torch.ones(T, T, dtype=torch.bool), 1)
    for l in range(L):
        h = f"transformer.h.{l}."
        q, k, v = conv1d(ln(x, h + "ln_1"), h + "attn.c_attn").split(C, dim=-1)
        q, k, v = (t.view(B, T, NH, hs).transpose(1, 2) for t in (q, k, v))
        att = (q @ k.transpose(-1, -2)) / math.sqrt(hs)
        y = torch.softmax(att.masked_fill(mask, float("-inf")), dim=-1) @ v
        x = x + conv1d(y.transpose(1, 2).reshape(B, T, C), h + "attn.c_proj")
        u = conv1d(ln(x, h + "ln_2"), h + "mlp.c_fc")
        u = 0.5 * u * (1 + torch.tanh(math.sqrt(2 / math.pi) * (u + 0.044715 * u ** 3)))
        x = x + conv1d(u, h + "mlp.c_proj")
    return ln(x, "transformer.ln_f") @ w["transformer.wte.weight"].T


def our_layout(sd):
    """The flat parameter array of our model file (docs/formats.md), built from the HF dict."""
    g = lambda name: sd[name].float()
    Vp = (V + 127) // 128 * 128
    wte = torch.zeros(Vp, C)
    wte[:V] = g("transformer.wte.weight")
    per_layer = lambda suffix, transpose=False: torch.stack(
        [(g(f"transformer.h.{l}.{suffix}").T if transpose else g(f"transformer.h.{l}.{suffix}")) for l in range(L)])
    parts = [wte, g("transformer.wpe.weight"), per_layer("ln_1.weight"), per_layer("ln_1.bias"),
             per_layer("attn.c_attn.weight", True), per_layer("attn.c_attn.bias"),
             per_layer("attn.c_proj.weight", True), per_layer("attn.c_proj.bias"),
             per_layer("ln_2.weight"), per_layer("ln_2.bias"),
             per_layer("mlp.c_fc.weight", True), per_layer("mlp.c_fc.bias"),
             per_layer("mlp.c_proj.weight", True), per_layer("mlp.c_proj.bias"),
             g("transformer.ln_f.weight"), g("transformer.ln_f.bias")]
    return torch.cat([p.reshape(-1) for p in parts]).numpy()


def read_model(path):
    raw = open(path, "rb").read()
    header = np.frombuffer(raw[:1024], dtype="<i4")
    return header, np.frombuffer(raw[1024:], dtype="<f4")


def rounded(sd, dtype):
    if dtype == "F16":
        return {k: v.half().float() for k, v in sd.items()}
    if dtype == "BF16":
        return {k: v.bfloat16().float() for k, v in sd.items()}
    return sd


def write_hf(dirname, sd, dtype="F32", prefix=True, buffers=False, lm_head=False, config=None):
    os.makedirs(dirname, exist_ok=True)
    tensors = []
    for name, t in sd.items():
        tensors.append((name if prefix else name[len("transformer."):], dtype, t.shape, as_raw(t, dtype)))
        if buffers and name.endswith("ln_1.weight"):  # the causal mask buffers some files carry
            layer = name[:-len("ln_1.weight")]
            if not prefix:
                layer = layer[len("transformer."):]
            tensors.append((layer + "attn.bias", "F32", (1, 1, MAXT, MAXT), as_raw(torch.ones(1, 1, MAXT, MAXT).tril(), "F32")))
            tensors.append((layer + "attn.masked_bias", "F32", (), as_raw(torch.tensor(-1e4), "F32")))
    if lm_head:
        tensors.append(("lm_head.weight", dtype, (V, C), as_raw(sd["transformer.wte.weight"], dtype)))
    with open(os.path.join(dirname, "model.safetensors"), "wb") as f:
        f.write(st_bytes(tensors, {"format": "pt"}))
    cfg = {"model_type": "gpt2", "n_embd": C, "n_layer": L, "n_head": NH, "n_positions": MAXT, "vocab_size": V,
           "activation_function": "gelu_new", "layer_norm_epsilon": 1e-5}
    cfg.update(config or {})
    with open(os.path.join(dirname, "config.json"), "w") as f:
        json.dump(cfg, f)
    return tensors


def run(args, **kw):
    return subprocess.run(args, capture_output=True, text=True, **kw)


def trainer_logits(model, shard, tmp, B=2, T=16):
    dump = os.path.join(tmp, "dump.st")
    p = run([TRAINER, "--model", model, "--train-data", shard, "--val-data", "none", "--batch-size", str(B), "--seq-len",
             str(T), "--steps", "1", "--lr", "0", "--metrics", "none", "--dump-state", dump, "--threads", "2"])
    if p.returncode != 0:
        raise RuntimeError(p.stderr)
    return read_st(dump)[0]["logits"]


def expect_error(args, needle, name, code=1):
    p = run(args)
    lines = p.stderr.strip().splitlines()
    report(p.returncode == code and len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], name,
           f"exit {p.returncode}, stderr {p.stderr.strip()!r} (wanted '{needle}')")


def main():
    if not os.path.exists(CONVERT) or not os.path.exists(TRAINER):
        print("SKIP: hf_convert (./hf_convert or ./train_gpt_cpu not built)")
        return 0
    torch.manual_seed(0)
    tmp = tempfile.mkdtemp(prefix="llmc_hf_")
    sd = random_hf_state_dict(1)
    rng = np.random.default_rng(0)
    shard = os.path.join(tmp, "tokens.bin")
    tokens = rng.integers(0, V, 2 * 16 + 1)
    write_shard(shard, tokens)
    inputs = torch.from_numpy(tokens[:32].reshape(2, 16).astype(np.int64))

    # ---- import: F32 with prefix, buffers and a tied head; F16 without prefix; BF16
    variants = [("F32", dict(prefix=True, buffers=True, lm_head=True)), ("F16", dict(prefix=False, buffers=True)),
                ("BF16", dict(prefix=True, lm_head=True))]
    for dtype, opts in variants:
        d = os.path.join(tmp, "hf_" + dtype)
        write_hf(d, sd, dtype, **opts)
        out = os.path.join(tmp, f"ours_{dtype}.bin")
        p = run([CONVERT, "import", os.path.join(d, "model.safetensors"), out])
        if p.returncode != 0:
            report(False, f"import {dtype}", p.stderr)
            continue
        header, params = read_model(out)
        expected = our_layout(rounded(sd, dtype))
        report(list(header[:8]) == [20240326, 3, MAXT, V, L, NH, C, 384] and np.array_equal(params, expected),
               f"import {dtype} ({'prefix' if opts['prefix'] else 'no prefix'}{', mask buffers' if opts.get('buffers') else ''}"
               f"{', tied lm_head' if opts.get('lm_head') else ''}): the model file holds exactly the reference's weights",
               f"header {list(header[:8])}, max diff {np.abs(params - expected).max() if params.shape == expected.shape else params.shape}")
        ours = trainer_logits(out, shard, tmp)
        ref = hf_logits(rounded(sd, dtype), inputs).float()
        diff = (ours - ref).abs().max().item()
        report(diff < 2e-4 * max(1.0, ref.abs().max().item()), f"import {dtype}: the CPU trainer's logits equal the reference's",
               f"max abs diff {diff:.3e}, logits up to {ref.abs().max().item():.2f}")
        if dtype == "F32":
            print(f"     (F32 logits: max abs diff {diff:.2e}, logits span +-{ref.abs().max().item():.2f})")

    # ---- export -> import round trip, exported tensors and config.json
    ours = os.path.join(tmp, "ours_F32.bin")
    exp = os.path.join(tmp, "export")
    p = run([CONVERT, "export", ours, exp, "--tokenizer", os.path.join(tmp, "nowhere")])
    report(p.returncode == 0, "export runs", p.stderr)
    back = os.path.join(tmp, "back.bin")
    p = run([CONVERT, "import", os.path.join(exp, "model.safetensors"), back])
    report(p.returncode == 0 and open(ours, "rb").read() == open(back, "rb").read(),
           "export then import gives a byte-identical model file", p.stderr)
    exported, meta = read_st(os.path.join(exp, "model.safetensors"))
    same = set(exported) == set(sd) and all(torch.equal(exported[k], sd[k]) for k in sd)
    report(same and meta.get("format") == "pt", "export: the HF tensors (names, Conv1D shapes, no padding, no lm_head) "
           "equal the reference's bitwise; metadata format=pt", f"{sorted(set(exported) ^ set(sd))} {meta}")
    cfg = json.load(open(os.path.join(exp, "config.json")))
    want = {"model_type": "gpt2", "n_embd": C, "n_layer": L, "n_head": NH, "n_positions": MAXT, "vocab_size": V,
            "activation_function": "gelu_new", "tie_word_embeddings": True, "architectures": ["GPT2LMHeadModel"]}
    report(all(cfg.get(k) == v for k, v in want.items()), "export: config.json has GPT2LMHeadModel's fields",
           json.dumps(cfg))
    p = run([CONVERT, "export", ours, os.path.join(tmp, "export_bf16"), "--dtype", "bf16"])
    exported16, _ = read_st(os.path.join(tmp, "export_bf16", "model.safetensors"))
    report(p.returncode == 0 and all(torch.equal(exported16[k], sd[k].bfloat16().float()) for k in sd),
           "export --dtype bf16 writes the weights rounded to nearest bf16", p.stderr)
    # a checkpoint directory exports its model
    out_dir = os.path.join(tmp, "run")
    p = run([TRAINER, "--model", ours, "--train-data", shard, "--val-data", "none", "--batch-size", "2", "--seq-len", "8",
             "--steps", "2", "--checkpoint-every", "2", "--out-dir", out_dir, "--metrics", "none", "--threads", "2"])
    ckpt = os.path.join(out_dir, "ckpt_00000002")
    p2 = run([CONVERT, "export", ckpt, os.path.join(tmp, "export_ckpt")])
    p3 = run([CONVERT, "import", os.path.join(tmp, "export_ckpt", "model.safetensors"), os.path.join(tmp, "ckpt_back.bin")])
    ok = all(x.returncode == 0 for x in (p, p2, p3)) and \
        open(os.path.join(ckpt, "model.bin"), "rb").read() == open(os.path.join(tmp, "ckpt_back.bin"), "rb").read()
    report(ok, "a checkpoint directory exports, and imports back to its model.bin byte for byte", p.stderr + p2.stderr + p3.stderr)
    # an existing target is refused without --force (an earlier export was overwritten silently); an empty folder is taken
    before = open(os.path.join(exp, "model.safetensors"), "rb").read()
    expect_error([CONVERT, "export", ckpt, exp], "already exists", "usage: export into an existing folder without --force -> exit 2",
                 code=2)
    report(open(os.path.join(exp, "model.safetensors"), "rb").read() == before, "the refused export left the folder untouched")
    p = run([CONVERT, "export", ckpt, exp, "--force"])
    report(p.returncode == 0 and open(os.path.join(exp, "model.safetensors"), "rb").read() ==
           open(os.path.join(tmp, "export_ckpt", "model.safetensors"), "rb").read(), "export --force writes into it", p.stderr)
    os.makedirs(os.path.join(tmp, "empty"))
    p = run([CONVERT, "export", ckpt, os.path.join(tmp, "empty")])
    report(p.returncode == 0 and os.path.exists(os.path.join(tmp, "empty", "config.json")), "export into an empty folder needs no --force",
           p.stderr)

    # ---- malformed files: one clear line, exit 1
    bad = os.path.join(tmp, "bad")
    os.makedirs(bad, exist_ok=True)
    good_tensors = write_hf(os.path.join(tmp, "hf_ok"), sd, "F32")
    bad_file = os.path.join(bad, "model.safetensors")

    def case(content, needle, name, config=None):
        with open(bad_file, "wb") as f:
            f.write(content)
        with open(os.path.join(bad, "config.json"), "w") as f:
            json.dump(dict({"n_head": NH}, **(config or {})), f)
        expect_error([CONVERT, "import", bad_file, os.path.join(tmp, "x.bin")], needle, "bad input: " + name)

    good = st_bytes(good_tensors)
    case(good[:4], "too short", "a 4-byte file")
    case(struct.pack("<Q", 10**12) + good[8:], "not a valid safetensors file", "a header length beyond the file")
    case(good[:8] + b"x" + good[9:], "not valid JSON", "a header that is not JSON")
    case(good[:-100], "truncated", "data cut short")
    case(good + b"\0" * 8, "after its last tensor", "trailing bytes after the last tensor")

    def shift(header):
        header["transformer.ln_f.bias"]["data_offsets"][0] += 4
    case(st_bytes(good_tensors, header_override=shift), "transformer.ln_f.bias", "offsets that do not match the shape")

    def gap(header):  # every tensor 4 bytes later, and 4 more bytes in the file: a hole at the start
        for info in header.values():
            info["data_offsets"] = [x + 4 for x in info["data_offsets"]]
    case(st_bytes(good_tensors, header_override=gap) + b"\0" * 4, "without gaps", "offsets with a gap")

    def overlap(header):
        header["transformer.wpe.weight"]["data_offsets"] = [x - 4 for x in header["transformer.wpe.weight"]["data_offsets"]]
    case(st_bytes(good_tensors, header_override=overlap), "without gaps", "two tensors that overlap")
    dropped = [t for t in good_tensors if t[0] != "transformer.h.1.mlp.c_fc.bias"]
    case(st_bytes(dropped), "missing tensor 'transformer.h.1.mlp.c_fc.bias'", "a missing tensor")
    linear = [(n, d, (s[1], s[0]) if n.endswith("c_attn.weight") else s, r) for n, d, s, r in good_tensors]
    case(st_bytes(linear), "'transformer.h.0.attn.c_attn.weight' has shape [192, 64], expected [64, 192]",
         "a weight in nn.Linear's (out, in) shape")
    ints = [(n, "I64", s, as_raw(sd[n], "I64")) if n == "transformer.h.0.ln_2.bias" else (n, d, s, r) for n, d, s, r in good_tensors]
    case(st_bytes(ints), "dtype I64", "an integer tensor")
    case(st_bytes(good_tensors + [("lm_head.weight", "F32", (V, C), as_raw(sd["transformer.wte.weight"] * 2, "F32"))]),
         "untied", "an lm_head that is not the embedding")
    case(st_bytes(good_tensors + [("transformer.h.0.attn.rotary.weight", "F32", (4,), as_raw(torch.zeros(4), "F32"))]),
         "'transformer.h.0.attn.rotary.weight'", "a tensor GPT-2 does not have")
    case(good, "not from the same model", "config.json disagreeing with the weights", {"n_embd": 128})
    case(good, "activation_function", "config.json with another activation", {"activation_function": "relu"})
    expect_error([CONVERT, "import", os.path.join(tmp, "missing.safetensors"), os.path.join(tmp, "x.bin")],
                 "cannot open", "bad input: a missing file")
    expect_error([CONVERT, "export", os.path.join(tmp, "nothing"), os.path.join(tmp, "y")], "neither a model file",
                 "bad input: export of a missing model")
    expect_error([CONVERT, "import", bad_file], "expected 'import", "usage: a missing argument -> exit 2", code=2)
    expect_error([CONVERT, "import", bad_file, "x.bin", "--dtype", "f8"], "--dtype must be", "usage: a bad --dtype -> exit 2", code=2)
    report(not os.path.exists(os.path.join(tmp, "x.bin")) and not os.path.exists(os.path.join(tmp, "x.bin.tmp")),
           "a failed import leaves no output file behind")

    shutil.rmtree(tmp)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
