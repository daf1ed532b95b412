#!/usr/bin/python3
"""code_shape.py: the figures issues 15 and 39 ask to track, for the two trainers.

Prints each trainer's main length, its longest functions, the functions defined in both trainer files
(twins by name), and the core step's technique share: of the code lines (comments and blank lines
excluded) of the functions of the plain step, how many name another technique (TECHNIQUE below, a
keyword grep). llm.c's train_gpt2.cu scores 10% by the same count (gpt2_forward 5/72, gpt2_backward_and_reduce
6/120, gpt2_update 13/54: recompute and ZeRO); issue 39 asks for at most 15%.
Uses Universal Ctags (apt-get install universal-ctags) for function extents. Measurement only.

    scripts/code_shape.py [--top N] [--root DIR] [FILE ...]   (default: train_gpt.cu train_gpt_cpu.cpp)
"""
import argparse, json, os, re, subprocess, sys

# The functions of the plain step, in either trainer (those a file defines are measured).
CORE_STEP = ["train_step", "forward_backward", "gpt2_forward", "gpt2_loss", "gpt2_backward", "gpt2_backward_weights",
             "finish_gradients", "optimizer_step", "gpt2_update", "zero_gradients",
             "gpt2_backward_and_reduce"]  # (the last: llm.c's, to score it the same way)

# Words that name a technique other than the plain one-device step.
TECHNIQUE = re.compile(r"moe|expert|\bep_|\bep\b|router|routing|fp8|amax|defer|zb_?h1|\bzb\b|2bw|version|stash|recompute|"
                       r"offload|disk|adafactor|sm3|factored|graph|captur|compress|powersgd|pipeline|\bpp\b|\bslot|"
                       r"chunk|stage|\bzero(?!_grad)|zero[0-9]|\bunit|shard|probe|dump|trace|profile|tensor_parallel|"
                       r"\btp_|\btp\b|\bsp_|\bsp\b|sequence_parallel|loss_scal|scaler|overflow|fp16|bf16_moment|"
                       r"server|inject|poison|\bpar->|tied|lent|microbatch|micro_batch", re.IGNORECASE)


def functions(path):
    out = subprocess.run(["ctags", "--language-force=C++", "--kinds-C++=f", "--fields=+ne",
                          "--output-format=json", "-o", "-", path], capture_output=True, text=True, check=True)
    found = {}
    for line in out.stdout.splitlines():
        tag = json.loads(line)
        if tag.get("kind") != "function" or "end" not in tag or tag["name"].startswith("__anon"):
            continue
        found[tag["name"]] = (tag["line"], tag["end"])
    return found


def code_lines(lines):
    """The lines that hold code: comments (// and /* */) and blank lines dropped."""
    out, in_block = [], False
    for line in lines:
        s = line
        if in_block:
            if "*/" not in s:
                continue
            s, in_block = s[s.index("*/") + 2:], False
        s = re.sub(r"/\*.*?\*/", "", s)
        if "/*" in s:
            s, in_block = s[:s.index("/*")], True
        s = re.sub(r'"(\\.|[^"\\])*"', '""', s)  # a message's words are not code
        s = s.split("//")[0].strip()
        if s and s not in ("{", "}", "};"):
            out.append(s)
    return out


def core_share(path, fns):
    text = open(path).read().splitlines()
    rows, total, named = [], 0, 0
    for name in CORE_STEP:
        if name not in fns:
            continue
        first, last = fns[name]
        code = code_lines(text[first - 1:last])
        hits = [c for c in code if TECHNIQUE.search(c)]
        rows.append((name, len(code), len(hits)))
        total += len(code)
        named += len(hits)
    return rows, total, named


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", default=["train_gpt.cu", "train_gpt_cpu.cpp"])
    ap.add_argument("--top", type=int, default=5)
    ap.add_argument("--root", default=".", help="the checkout to measure")
    ap.add_argument("--verbose", action="store_true", help="print the core lines that name a technique")
    a = ap.parse_args()
    per_file = {}
    for name in a.files:
        path = os.path.join(a.root, name)
        fns = functions(path)
        per_file[name] = fns
        total = sum(1 for _ in open(path))
        sizes = {k: e - s + 1 for k, (s, e) in fns.items()}
        longest = sorted(sizes.items(), key=lambda kv: -kv[1])[: a.top]
        over = sum(1 for k, n in sizes.items() if n > 80 and k != "main")
        print(f"{name}: {total} lines, main {sizes.get('main', 0)} lines, {over} functions besides main over 80 lines; "
              "longest: " + ", ".join(f"{k} {v}" for k, v in longest))
        rows, code, named = core_share(path, fns)
        share = 100.0 * named / code if code else 0.0
        print(f"  core step: {named} of {code} code lines name another technique ({share:.0f}%): "
              + ", ".join(f"{n} {h}/{c}" for n, c, h in rows))
        if a.verbose:
            text = open(path).read().splitlines()
            for n, _, _ in rows:
                s, e = fns[n]
                for c in code_lines(text[s - 1:e]):
                    if TECHNIQUE.search(c):
                        print(f"    {n}: {c}")
    if len(a.files) == 2:
        f1, f2 = (per_file[p] for p in a.files)
        twins = sorted(set(f1) & set(f2))
        size = lambda f, t: f[t][1] - f[t][0] + 1
        print(f"twins (defined in both): {len(twins)}, {sum(size(f1, t) for t in twins)} + "
              f"{sum(size(f2, t) for t in twins)} lines: " + ", ".join(twins))


if __name__ == "__main__":
    sys.exit(main())
