#!/usr/bin/env python3
"""code_shape.py: the figures issue 15 asks to track, for the two trainers.

Prints each trainer's main length, its longest functions, and the functions defined in both trainer
files (twins by name). Uses Universal Ctags (apt-get install universal-ctags) for function extents.
Measurement only; nothing in the build or tests depends on it.

    scripts/code_shape.py [--top N] [FILE ...]   (default: train_gpt.cu train_gpt_cpu.cpp)
"""
import argparse, json, subprocess, sys


def functions(path):
    out = subprocess.run(["ctags", "--language-force=C++", "--kinds-C++=f", "--fields=+ne",
                          "--output-format=json", "-o", "-", path], capture_output=True, text=True, check=True)
    found = {}
    for line in out.stdout.splitlines():
        tag = json.loads(line)
        if tag.get("kind") != "function" or "end" not in tag or tag["name"].startswith("__anon"):
            continue
        found[tag["name"]] = tag["end"] - tag["line"] + 1
    return found


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="*", default=["train_gpt.cu", "train_gpt_cpu.cpp"])
    ap.add_argument("--top", type=int, default=5)
    a = ap.parse_args()
    per_file = {}
    for path in a.files:
        fns = functions(path)
        per_file[path] = fns
        total = sum(1 for _ in open(path))
        longest = sorted(fns.items(), key=lambda kv: -kv[1])[: a.top]
        over = sum(1 for k, n in fns.items() if n > 100 and k != "main")
        print(f"{path}: {total} lines, main {fns.get('main', 0)} lines, {over} functions besides main over 100 lines; longest: "
              + ", ".join(f"{k} {v}" for k, v in longest))
    if len(a.files) == 2:
        f1, f2 = (per_file[p] for p in a.files)
        twins = sorted(set(f1) & set(f2))
        print(f"twins (defined in both): {len(twins)}, {sum(f1[t] for t in twins)} + {sum(f2[t] for t in twins)} lines: "
              + ", ".join(twins))


if __name__ == "__main__":
    sys.exit(main())
