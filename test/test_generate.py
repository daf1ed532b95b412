#!/usr/bin/env python3
"""test_generate.py — --generate (llmc/run/generate.h) on both trainers: the KV cache against the full
recomputation, the samplers against greedy decoding, and greedy decoding against the independent PyTorch
GPT-2 (test/gpt2_reference.py).

The model: L=2, C=64, H=4, T=64, V=512, written here with random weights large enough (std 0.3) that
the logits are far from uniform, so greedy decoding wanders over many tokens instead of repeating one
(a repeated token would let a wrong cache pass). V=512 is not GPT-2's vocabulary, so prompts and
samples are token ids. Checks, each on the CPU trainer and (under the CUDA emulation, or on a GPU) the
GPU trainer:

  kv cache          --kv-cache 1 and 0 (the training forward over the whole window for every token) pick
                    the same tokens at temperature 0, and give each the same log-probability (--json's
                    logprobs) within 1e-4 (fp32; measured 4.4e-6; bf16: see Tolerance): a 5-token prompt and
                    150 tokens (the window slides twice: T = 64), and a prompt that fills the context
  pytorch           the greedy continuation equals, token for token, the reference's: argmax of its full
                    forward over the window, sliding as generate.h documents (needs torch: this Python's,
                    or python3 on PATH; else SKIP)
  samplers          the same seed gives the same tokens, another seed other tokens; top-k 1 and top-p
                    1e-6 (a nucleus of one token) give the greedy tokens at temperature 1
  json              --json: one line per sample with prompt, prompt_tokens, tokens, text
  threads           (CPU) 1, 2 and 3 threads print the same --json line, cache and recomputation alike (70
                    tokens: the window slides)
  context           a prompt longer than the context is refused: exit 2, one line naming its length
  bad input         an empty prompt, a negative temperature, top-p 0 or 1.5, a prompt that is not token
                    ids, a descriptor instead of weights: exit 2; a file that is not a model, a missing
                    prompt file: exit 1; each with one line on stderr
  tokenizer         (GPT-2's vocabulary in data/gpt2, a V=50257 model, CPU trainer) the prompt's tokens
                    decode back to the prompt, and the printed text is the decoded tokens
  moe               mixture-of-experts models (version 7; E = 4 top-1 in one block, top-2 in both): the KV
                    cache's MoE blocks == the training forward's (tokens, log-probabilities; bf16: see
                    MOE_BF16), a capacity factor changing nothing (generation never drops: moe.h's
                    moe_forward_new_rows says why), the GPU's fp32 tokens == the CPU's; the file without
                    its --moe-* flags, a dense file with them and --expert-parallel refused (exit 2, one line). Planted and
                    caught: the MoE block reading the residual instead of ln2 in the cached forward;
                    moe_generation_shape keeping the capacity factor
The GPU trainer runs them twice: its fp32 build (the same kernels in fp32) to the CPU trainer's
tolerances, against PyTorch and the CPU trainer too; its bf16 build on a prefix of the tokens and a loose
log-probability tolerance (Tolerance below says why), which catches gross errors only.
"""
import json, os, shutil, subprocess, sys, tempfile
from dataclasses import dataclass
from checks import report, exit_code
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CPU = os.path.join(ROOT, "train_gpt_cpu")
L, C, NH, T, V = 2, 64, 4, 64, 512


@dataclass
class Tolerance:
    agree: int       # greedy tokens the cached and recomputed paths must agree on (from the first)
    logprob: float   # max |difference| of the log-probabilities of the tokens they agree on


# fp32 (the CPU trainer, the GPU trainer's fp32 build): every token, log-probabilities within 1e-4
# (measured 4.4e-6 on the CPU: only the order of the attention's sums differs). bf16: at these large
# weights (std 0.3: logits of +-20, where bf16's spacing is 0.06-0.12) both GPU paths part from the
# fp32 CPU after 18-20 tokens, with log-probabilities off by 0.09 (cached) and 0.15 (recomputed), and
# from each other after 18 with 0.06: so 10 tokens and 0.25, a check for gross errors only; the fp32
# build is where the cache is checked closely.
FP32 = Tolerance(agree=10**9, logprob=1e-4)
BF16 = Tolerance(agree=10, logprob=0.25)


def skip(name, why):
    print(f"SKIP: {name} ({why})", flush=True)


def write_model(path, L, C, NH, T, V, seed, std=0.3, moe=None):
    """A model file (version 3, fp32) with random weights: LayerNorm gains 1 + N(0, 0.1), the rest N(0, std).
    At std 0.3 the greedy continuation of the test's prompt visits 33 distinct tokens in 150; at 0.1 (the
    embedding dominates the residual stream, and the tied head predicts the input token) only 10.
    moe = (E, top_k, every): a mixture-of-experts file (version 7, docs/formats.md), its MoE table N(0, std)
    too, so that the router's logits (std ~2.4 at C = 64) pick clearly among the experts."""
    Vp = (V + 127) // 128 * 128
    rng = np.random.default_rng(seed)
    shapes = [("wte", (Vp, C)), ("wpe", (T, C)), ("ln1w", (L, C)), ("ln1b", (L, C)), ("qkvw", (L, 3 * C, C)),
              ("qkvb", (L, 3 * C)), ("attprojw", (L, C, C)), ("attprojb", (L, C)), ("ln2w", (L, C)), ("ln2b", (L, C)),
              ("fcw", (L, 4 * C, C)), ("fcb", (L, 4 * C)), ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
              ("lnfw", (C,)), ("lnfb", (C,))]
    header = np.zeros(256, dtype="<i4")
    header[:8] = [20240326, 3, T, V, L, NH, C, Vp]
    if moe:
        E, top_k, every = moe
        header[1], header[8:11] = 7, [E, top_k, every]
        Lm = L // every  # the MoE table: router, then experts 1 .. E-1's MLPs (expert 0 is the block's fcw ...)
        shapes += [("router", (Lm, E, C)), ("moe_fcw", (Lm, E - 1, 4 * C, C)), ("moe_fcb", (Lm, E - 1, 4 * C)),
                   ("moe_fcprojw", (Lm, E - 1, C, 4 * C)), ("moe_fcprojb", (Lm, E - 1, C))]
    with open(path, "wb") as f:
        header.tofile(f)
        for name, shape in shapes:
            if name in ("ln1w", "ln2w", "lnfw"):
                w = (1.0 + rng.normal(0, 0.1, shape)).astype("<f4")
            else:
                w = rng.normal(0, std, shape).astype("<f4")
            if name == "wte":
                w[V:] = 0.0  # the padded rows are zero
            w.tofile(f)


def run(binary, args, env=None):
    return subprocess.run([binary] + args, capture_output=True, text=True, cwd=ROOT, env=dict(os.environ, **(env or {})))


def sample(binary, model, prompt, n, extra=(), env=None):
    """The first sample's JSON line from --generate --json, or None with the error."""
    p = run(binary, ["--model", model, "--generate", prompt, "--sample-tokens", str(n), "--json"] + list(extra), env)
    if p.returncode != 0:
        return None, p.stderr.strip()
    return json.loads(p.stdout.splitlines()[0]), ""


def generated(binary, model, prompt, n, extra=(), env=None):
    """The tokens --generate --json drew (first sample), or None with the error."""
    line, err = sample(binary, model, prompt, n, extra, env)
    return (line["tokens"] if line else None), err


def first_difference(a, b):
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


# ----------------------------------------------------------------------------------------------
# The reference: greedy decoding with test/gpt2_reference.py, the window sliding as in generate.h

def reference_greedy(model_path, prompt, n):
    import torch
    sys.path.insert(0, HERE)
    import gpt2_reference as ref
    model = ref.load_model(model_path)
    context = model.config.max_seq_len
    tokens, first = list(prompt), 0
    with torch.no_grad():
        for _ in range(n):
            if len(tokens) - first > context:
                first = len(tokens) - context // 2
            logits, _ = model(torch.tensor([tokens[first:]], dtype=torch.long))
            tokens.append(int(torch.argmax(logits[0, -1])))
    return tokens[len(prompt):]


def reference_tokens(model_path, prompt, n):
    """The reference's greedy tokens: in this Python if it has torch, else in python3 from PATH."""
    try:
        import torch  # noqa: F401
        return reference_greedy(model_path, prompt, n), ""
    except ImportError:
        pass
    other = shutil.which("python3")
    if not other or os.path.realpath(other) == os.path.realpath(sys.executable):
        return None, "no torch in this Python and no other python3"
    p = subprocess.run([other, os.path.abspath(__file__), "--reference", model_path, " ".join(map(str, prompt)), str(n)],
                       capture_output=True, text=True)
    if p.returncode != 0:
        return None, f"{other} has no torch either" if "torch" in p.stderr else p.stderr.strip()[-300:]
    return json.loads(p.stdout), ""


# ----------------------------------------------------------------------------------------------
# GPT-2's byte-level decoding, written out to check the trainer's tokenizer from the outside

def gpt2_decoder(vocab_dir):
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    byte_of_char, extra = {}, 0
    for b in range(256):
        if b in printable:
            byte_of_char[chr(b)] = b
        else:
            byte_of_char[chr(256 + extra)] = b
            extra += 1
    string_of_id = {i: s for s, i in json.load(open(os.path.join(vocab_dir, "encoder.json"))).items()}
    return lambda ids: bytes(byte_of_char[ch] for i in ids for ch in string_of_id[i]).decode("utf-8", errors="replace")


# ----------------------------------------------------------------------------------------------

def check_cache(label, binary, model, prompt, n, what, tol, env=None, extra=()):
    """--kv-cache 1 against 0 at temperature 0: the same tokens (tol.agree of the n: all, in fp32), and
    each token's log-probability within tol.logprob (the finer test: a small error in the cache moves
    log-probabilities long before it flips a token). Returns the cached path's tokens."""
    cached, err = sample(binary, model, prompt, n, ["--temperature", "0"] + list(extra), env)
    full, err0 = sample(binary, model, prompt, n, ["--temperature", "0", "--kv-cache", "0"] + list(extra), env)
    if cached is None or full is None:
        report(False, f"{label}: kv cache == full recomputation, {what}", err or err0)
        return None
    agree = first_difference(cached["tokens"], full["tokens"])
    need = min(n, tol.agree)
    report(agree >= need, f"{label}: kv cache == full recomputation, {what}: the same tokens"
           + ("" if need == n else f" for at least {need}"), f"first difference at token {agree} of {n}",
           f"{agree} of {n} agree, {len(set(cached['tokens']))} distinct tokens")
    error = float(np.max(np.abs(np.array(cached["logprobs"][:agree]) - np.array(full["logprobs"][:agree])))) if agree else 0.0
    report(error <= tol.logprob, f"{label}: kv cache == full recomputation, {what}: log-probabilities",
           f"max difference {error:.2e} > {tol.logprob:.0e}", f"max difference {error:.2e}, tol {tol.logprob:.0e}")
    return cached["tokens"]


def check_trainer(label, binary, model, reference, tol, env=None, extra=()):
    """The checks every trainer passes; returns its greedy tokens for the 5-token prompt."""
    extra = list(extra)
    prompt = "3 141 59 26 5"
    greedy = check_cache(label, binary, model, prompt, 150, "150 greedy tokens over 2 slides", tol, env, extra)
    long_prompt = " ".join(str((7 * i + 3) % V) for i in range(T))
    check_cache(label, binary, model, long_prompt, 20, "from a prompt filling the context", tol, env, extra)
    if reference is not None and greedy is not None:
        agree = first_difference(greedy, reference)
        report(greedy == reference, f"{label}: greedy continuation == PyTorch reference's, token for token",
               f"first difference at token {agree}: {greedy[agree:agree + 5]} vs {reference[agree:agree + 5]}",
               f"{len(reference)} tokens")

    sampled = ["--temperature", "1", "--top-k", "40", "--num-samples", "2"] + extra
    s1 = run(binary, ["--model", model, "--generate", prompt, "--sample-tokens", "30", "--json", "--seed", "7"] + sampled, env)
    s2 = run(binary, ["--model", model, "--generate", prompt, "--sample-tokens", "30", "--json", "--seed", "7"] + sampled, env)
    s3 = run(binary, ["--model", model, "--generate", prompt, "--sample-tokens", "30", "--json", "--seed", "8"] + sampled, env)
    ok = s1.returncode == 0 and s1.stdout == s2.stdout
    report(ok, f"{label}: the same seed gives the same samples", s1.stderr.strip() or "the samples differ")
    report(s1.returncode == 0 and s3.returncode == 0 and s1.stdout != s3.stdout, f"{label}: another seed gives other samples",
           s3.stderr.strip() or "identical")
    lines = [json.loads(l) for l in s1.stdout.splitlines()] if s1.returncode == 0 else []
    fields_ok = len(lines) == 2 and all(set(l) >= {"prompt", "tokens", "text", "prompt_tokens"} and len(l["tokens"]) == 30
                                        and l["text"] == " ".join(map(str, l["tokens"])) and l["prompt"] == prompt
                                        for l in lines) and lines[0]["tokens"] != lines[1]["tokens"]
    report(fields_ok, f"{label}: --json prints one line per sample with prompt, tokens and text", s1.stdout[:300])
    top1, err = generated(binary, model, prompt, 40, ["--temperature", "1", "--top-k", "1", "--seed", "3"] + extra, env)
    nucleus, err0 = generated(binary, model, prompt, 40, ["--temperature", "1", "--top-p", "1e-6", "--seed", "3"] + extra, env)
    report(top1 is not None and greedy is not None and top1 == greedy[:40], f"{label}: top-k 1 == greedy", err or str(top1))
    report(nucleus is not None and greedy is not None and nucleus == greedy[:40], f"{label}: top-p 1e-6 == greedy",
           err0 or str(nucleus))

    too_long = " ".join(["1"] * (T + 1))
    p = run(binary, ["--model", model, "--generate", too_long] + extra, env)
    report(p.returncode == 2 and "longer than the model's context" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
           f"{label}: a prompt of T+1 tokens is refused (exit 2, one line)", f"exit {p.returncode}: {p.stderr.strip()[:200]}")
    return greedy


# The mixture-of-experts models: (name, E, top-k, every). Top-1 in the second block only (a dense block
# before it), top-2 in both. Their prompt fills 40 of the 64 positions (a prefill routes 40 rows at once)
# and 40 tokens follow, so the window slides once (a second prefill of 32 rows) and 8 tokens decode after.
MOE_MODELS = (("top-1", 4, 1, 2), ("top-2", 4, 2, 1))
MOE_PROMPT = " ".join(str((11 * i + 5) % V) for i in range(40))
# bf16 and MoE: the routing is a discrete choice made on bf16 rows, so where two experts' probabilities
# are closer than bf16 resolves, the paths pick different experts, whose outputs differ by O(1) at these
# weights: the cached and recomputed bf16 paths (and the CPU) part after 1 to 10 tokens (measured). So
# the first token and its log-probability only, a check for gross errors; fp32 is where it is checked.
MOE_BF16 = Tolerance(agree=1, logprob=0.25)


def moe_flags(E, k, every):
    return ["--moe-experts", str(E), "--moe-top-k", str(k), "--moe-every", str(every)]


def check_moe(label, binary, tmp, tol, env=None, extra=()):
    """--generate with an MoE model (version 7): the KV cache's MoE blocks (new rows routed without dropping,
    llmc/model/moe.h's moe_forward_new_rows) == the training forward's, token for token at temperature 0 and
    in log-probability; in fp32 also: a capacity factor changes nothing on either path (there is no dropping
    in generation); the file without its --moe-* flags, and a dense file with them: exit 2, one line.
    Returns {name: the cached path's greedy tokens}."""
    greedy, fp32 = {}, tol is FP32
    tol = tol if fp32 else MOE_BF16
    for name, E, k, every in MOE_MODELS:
        model = os.path.join(tmp, f"moe_{name}.bin")
        if not os.path.exists(model):
            write_model(model, L, C, NH, T, V, seed=11, moe=(E, k, every))
        flags = list(extra) + moe_flags(E, k, every)
        greedy[name] = check_cache(label, binary, model, MOE_PROMPT, 40, f"MoE E = {E} {name} every {every}, 40 tokens over a "
                                   "slide", tol, env, flags)
        for kv in ("1", "0") if fp32 else ():  # (at 0.5 a 40-row prefill would overflow the capacity ceil(k 40 0.5 / 4))
            capped, err = generated(binary, model, MOE_PROMPT, 40, ["--temperature", "0", "--moe-capacity-factor", "0.5",
                                                                     "--kv-cache", kv] + flags, env)
            report(capped is not None and greedy[name] is not None and capped == greedy[name],
                   f"{label}: MoE {name}, --kv-cache {kv}: --moe-capacity-factor 0.5 drops nothing when generating (the same "
                   "tokens)", err or str(capped))
    model = os.path.join(tmp, "moe_top-2.bin")
    for what, args, needles in (
            ("an MoE file without its --moe-* flags", ["--model", model, "--generate", "1 2"],
             ["--moe-experts 4 --moe-top-k 2", "pass the model's --moe-* flags"]),
            ("a dense file with --moe-* flags", ["--model", os.path.join(tmp, "model.bin"), "--generate", "1 2"] + moe_flags(4, 2, 1),
             ["a dense model", "pass the model's --moe-* flags"]),
            ("--expert-parallel 2", ["--model", model, "--generate", "1 2", "--expert-parallel", "2"] + moe_flags(4, 2, 1),
             ["--expert-parallel"])) if fp32 else ():
        p = run(binary, args + list(extra), env)
        lines = p.stderr.strip().splitlines()
        report(p.returncode == 2 and len(lines) == 1 and all(n in lines[0] for n in needles),
               f"{label}: --generate with {what}: exit 2, one line naming it", f"exit {p.returncode}: {p.stderr.strip()[:300]}")
    return greedy


def check_bad_inputs(label, binary, model, tmp, env=None, extra=()):
    not_a_model = os.path.join(tmp, "not_a_model.bin")
    with open(not_a_model, "wb") as f:
        f.write(b"this is not a model file" * 100)
    cases = [
        ("an empty prompt", ["--model", model, "--generate", ""], 2),
        ("a negative temperature", ["--model", model, "--generate", "1 2", "--temperature", "-0.5"], 2),
        ("top-p 0", ["--model", model, "--generate", "1 2", "--top-p", "0"], 2),
        ("top-p 1.5", ["--model", model, "--generate", "1 2", "--top-p", "1.5"], 2),
        ("a prompt that is not token ids", ["--model", model, "--generate", "hello"], 2),
        ("a token id past the vocabulary", ["--model", model, "--generate", "1 512"], 2),
        ("a descriptor instead of weights", ["--model", "L=2,C=64,H=4", "--generate", "1 2"], 2),
        ("a file that is not a model", ["--model", not_a_model, "--generate", "1 2"], 1),
        ("a missing prompt file", ["--model", model, "--prompt-file", os.path.join(tmp, "missing.txt")], 1),
    ]
    for what, args, code in cases:
        p = run(binary, args + list(extra), env)
        lines = p.stderr.strip().splitlines()
        report(p.returncode == code and len(lines) == 1 and lines[0].startswith("error:"),
               f"{label}: {what}: exit {code}, one line", f"exit {p.returncode}: {p.stderr.strip()[:300]}")


def check_tokenizer(model_path):
    vocab = os.path.join(ROOT, "data", "gpt2")
    if not os.path.exists(os.path.join(vocab, "encoder.json")):
        skip("cpu: the prompt's tokens round-trip through GPT-2's tokenizer", "no data/gpt2: scripts/get_vocab.sh")
        return
    decode = gpt2_decoder(vocab)
    prompt = "Call me Ishmael. Some years ago\u2014never mind how long precisely\u2014having little money, caf\u00e9 \U0001F40B"
    p = run(CPU, ["--model", model_path, "--generate", prompt, "--sample-tokens", "12", "--json", "--temperature", "0"])
    if p.returncode != 0:
        report(False, "cpu: GPT-2 vocabulary: --generate runs", p.stderr.strip())
        return
    line = json.loads(p.stdout)
    report(decode(line["prompt_tokens"]) == prompt and line["prompt"] == prompt,
           "cpu: the prompt's tokens decode back to the prompt (GPT-2's tokenizer)", decode(line["prompt_tokens"]),
           f"{len(line['prompt_tokens'])} tokens")
    report(line["text"] == decode(line["tokens"]), "cpu: the printed text is the generated tokens decoded",
           f"{line['text']!r} vs {decode(line['tokens'])!r}")
    text = run(CPU, ["--model", model_path, "--generate", prompt, "--sample-tokens", "12", "--temperature", "0"])
    report(text.returncode == 0 and text.stdout.startswith(prompt + line["text"]),
           "cpu: the plain output is the prompt and its continuation", text.stdout[:200])
    missing = run(CPU, ["--model", model_path, "--generate", "hello", "--tokenizer", "/nonexistent"])
    report(missing.returncode == 1 and "tokenizer" in missing.stderr and len(missing.stderr.strip().splitlines()) == 1,
           "cpu: GPT-2's vocabulary without the tokenizer's files: exit 1, one line", missing.stderr.strip())


def gpu_binaries():
    """[(label, binary, extra flags, tolerance)] for the GPU trainer, bf16 and its fp32 build: on a GPU,
    else on the CUDA emulation (cuDNN is not emulated: --attention simple), else []."""
    have_gpu = False
    try:
        have_gpu = subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        pass
    if have_gpu:
        where, folder, extra = "gpu", ROOT, []
    else:
        where, folder, extra = "gpu (emulated)", os.path.join(ROOT, "build", "emu"), ["--attention", "simple"]
    found = []
    for name, precision, tol in (("train_gpt", "bf16", BF16), ("train_gpt_fp32", "fp32", FP32)):
        if os.path.exists(os.path.join(folder, name)):
            found.append((f"{where} {precision}", os.path.join(folder, name), extra, tol))
    return found


def main():
    if len(sys.argv) == 5 and sys.argv[1] == "--reference":  # the helper mode of reference_tokens
        print(json.dumps(reference_greedy(sys.argv[2], [int(t) for t in sys.argv[3].split()], int(sys.argv[4]))))
        return 0
    if not os.path.exists(CPU):
        skip("generate", "train_gpt_cpu not built")
        return 0
    tmp = tempfile.mkdtemp(prefix="llmc_generate_")
    try:
        model = os.path.join(tmp, "model.bin")
        write_model(model, L, C, NH, T, V, seed=5)
        reference, why = reference_tokens(model, [3, 141, 59, 26, 5], 150)
        if reference is None:
            skip("greedy continuation == PyTorch reference's", why)
        cpu_greedy = check_trainer("cpu", CPU, model, reference, FP32)
        check_bad_inputs("cpu", CPU, model, tmp)
        cpu_moe = check_moe("cpu", CPU, tmp, FP32)
        prompt_file = os.path.join(tmp, "prompt.txt")
        with open(prompt_file, "w") as f:
            f.write("3 141\n59 26 5\n")
        p = run(CPU, ["--model", model, "--prompt-file", prompt_file, "--sample-tokens", "20", "--temperature", "0", "--json"])
        from_file = json.loads(p.stdout)["tokens"] if p.returncode == 0 else None
        report(cpu_greedy is not None and from_file == cpu_greedy[:20], "cpu: --prompt-file gives what --generate gives",
               p.stderr.strip() or str(from_file))
        # the thread count changes nothing (llmc/run/cpu_threads.h may change it between any two tokens):
        # 1, 2 and 3 threads (3: uneven splits) print the same line, tokens and log-probabilities
        for kv in ("1", "0"):
            lines = [run(CPU, ["--model", model, "--generate", "3 141 59 26 5", "--sample-tokens", "70", "--json",
                               "--seed", "7", "--kv-cache", kv, "--threads", n]) for n in ("1", "2", "3")]
            report(all(l.returncode == 0 and l.stdout == lines[0].stdout for l in lines),
                   f"cpu: --kv-cache {kv}: 1, 2 and 3 threads generate the same tokens and log-probabilities",
                   " | ".join(l.stderr.strip() or l.stdout[:120] for l in lines))
        gpt2_vocab_model = os.path.join(tmp, "gpt2_vocab.bin")
        write_model(gpt2_vocab_model, 1, 32, 2, 64, 50257, seed=6)
        check_tokenizer(gpt2_vocab_model)

        gpus = gpu_binaries()
        if not gpus:
            skip("gpu generation", "no GPU, and build/emu/train_gpt is not built")
        for label, gpu, extra, tol in gpus:
            gpu_greedy = check_trainer(label, gpu, model, reference if tol is FP32 else None, tol, None, extra)
            check_bad_inputs(label, gpu, model, tmp, None, extra)
            for name, tokens in check_moe(label, gpu, tmp, tol, None, extra).items():
                if tokens is not None and cpu_moe[name] is not None:
                    agree = first_difference(tokens, cpu_moe[name])
                    need = min(len(tokens), (tol if tol is FP32 else MOE_BF16).agree)
                    report(agree >= need, f"{label}: MoE {name}: greedy tokens == the CPU trainer's" +
                           ("" if need == len(tokens) else f" for at least {need}"), f"they agree on {agree}",
                           f"agree on {agree} of {len(tokens)}")
            if gpu_greedy is not None and cpu_greedy is not None:
                agree = first_difference(gpu_greedy, cpu_greedy)
                need = min(len(cpu_greedy), tol.agree)
                report(agree >= need, f"{label}: greedy tokens == the CPU trainer's" + ("" if need == len(cpu_greedy) else f" for at least {need}"),
                       f"they agree on {agree}", f"agree on {agree} of {len(cpu_greedy)}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
