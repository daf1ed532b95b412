#!/usr/bin/env python3
# The "Side by side" table of docs/parallelism.md, measured: one model that does not fit a memory
# budget on one rank, trained for two steps on each grid (mpirun, CPU trainer), and for each grid its
# largest rank's memory by kind and the bytes that rank sent in the last step, as the trainer itself
# measures and reports them (and checks against --estimate: the "= --estimate" mark).
#
#   scripts/parallelism_table.py [--budget-mib 512] [--steps 2] [--trainer ./train_gpt_cpu]
#
# Prints a markdown table, the losses of every run (they must agree), and whether every rank of every
# run matched --estimate. Needs Open MPI and the Moby Dick shards (./scripts/run.sh or
# scripts/get_corpus.sh prepare them). Takes a few minutes on 2 cores.
import argparse
import os
import re
import shutil
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "L=8,C=512,H=8,T=64"  # 51M parameters, half of them in wte (V=50257); B=1, T=64, 256 tokens a step

# (label, ranks, extra flags)
GRIDS = [
    ("1 rank", 1, []),
    ("dp 4, ZeRO-1", 4, ["--zero", "1"]),
    ("dp 4, ZeRO-2", 4, ["--zero", "2"]),
    ("dp 4, ZeRO-3", 4, ["--zero", "3"]),
    ("tp 4", 4, ["--tensor-parallel", "4"]),
    ("tp 4, sequence parallel", 4, ["--tensor-parallel", "4", "--sequence-parallel", "1"]),
    ("pp 4, 1F1B", 4, ["--pipeline-parallel", "4", "--pipeline-schedule", "1f1b"]),
    ("dp 2 × tp 2, ZeRO-1", 4, ["--tensor-parallel", "2", "--zero", "1"]),
    ("dp 2 × tp 2, ZeRO-3", 4, ["--tensor-parallel", "2", "--zero", "3"]),
    ("tp 2 × pp 2", 4, ["--tensor-parallel", "2", "--pipeline-parallel", "2"]),
]

ROW = re.compile(r"^\s+(\d+) \((\d+),(\d+),(\d+)\)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+) \| "
                 r"(.+?) / (.+?) / (.+?) / (.+?)\s+(=|!=) --estimate")
KIND = re.compile(r"(params|grads|master|optimizer|activations|workspace) ([\d.]+) (B|KiB|MiB|GiB)")


def mib(value, unit):
    return float(value) * {"B": 1 / 1048576, "KiB": 1 / 1024, "MiB": 1.0, "GiB": 1024.0}[unit]


def main():
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--budget-mib", type=float, default=512)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--trainer", default=os.path.join(ROOT, "train_gpt_cpu"))
    args = ap.parse_args()
    mpirun = shutil.which("mpirun")
    if not mpirun:
        sys.exit("error: mpirun not found: apt-get install openmpi-bin libopenmpi-dev (or scripts/setup.sh)")
    data = os.path.join(ROOT, "data", "moby-dick")
    if not os.path.isdir(data):
        sys.exit("error: data/moby-dick is missing: run scripts/get_corpus.sh moby-dick first")

    head = "| grid | rank (dp,tp,pp) | weights | grads | AdamW | activations | workspace | total | ≤ %g? | sent per step |" % args.budget_mib
    print(head)
    print("|---|---|---|---|---|---|---|---|---|---|")
    losses, all_match = {}, True
    for label, ranks, flags in GRIDS:
        cmd = [mpirun, "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), args.trainer, "--model", MODEL,
               "--batch-size", "1", "--seq-len", "64", "--total-batch-tokens", "256", "--steps", str(args.steps), "--threads", "1",
               "--train-data", os.path.join(data, "moby-dick_train_*.bin"), "--val-data", "none", "--metrics", "none",
               "--sample-every", "0"] + flags
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            sys.exit(f"error: {label} failed (exit {p.returncode}): {' '.join(cmd)}\n{p.stdout[-2000:]}{p.stderr[-2000:]}")
        losses[label] = re.findall(r"\| loss ([\d.]+) \|", p.stdout)
        rows = []
        for m in map(ROW.match, p.stdout.splitlines()):
            if m:
                kinds = [float(m.group(i)) for i in range(5, 11)]
                sent = [m.group(i) for i in range(11, 15)]
                rows.append((kinds[-1], f"{m.group(2)},{m.group(3)},{m.group(4)}", kinds, sent))
                all_match &= m.group(15) == "="
        if not rows:  # one rank prints its memory by kind at start-up
            text = p.stdout[p.stdout.index("memory: rank 0 holds"):]
            text = text[:text.index("step ")]
            by = {k: mib(v, u) for k, v, u in KIND.findall(text)}
            kinds = [by.get(k, 0.0) for k in ("params", "grads", "optimizer", "activations", "workspace")]
            rows.append((sum(kinds), "0,0,0", kinds + [sum(kinds)], ["0 B"] * 4))
        total, who, kinds, sent = max(rows, key=lambda r: r[0])
        groups = [f"{name} {s}" for name, s in zip(("data", "tensor", "pipeline"), sent) if s not in ("0 B", "0")]
        print(f"| {label} | {who} | " + " | ".join(f"{k:.1f}" for k in kinds[:5]) + f" | **{total:.1f}** | "
              f"{'yes' if total <= args.budget_mib else 'no'} | {' + '.join(groups) or '-'} |", flush=True)
    print()
    for label, l in losses.items():
        print(f"losses {label}: {' '.join(l)}")
    print("every rank of every multi-rank run = --estimate:", "yes" if all_match else "NO")


if __name__ == "__main__":
    main()
