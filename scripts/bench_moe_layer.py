#!/usr/bin/env python3
"""Time the mixture-of-experts layer (llmc/model/moe.h) against the dense MLP it replaces, on the CPU.

What it teaches: what routing costs before any communication. An E-expert top-1 layer does the
dense MLP's FLOPs per token (each token meets one expert of the same shape), plus the router's
2 C E, but it splits one (N x C) x (C x 4C) matmul into E matmuls of about N/E rows each, and adds a
softmax, a top-k, a gather and a scatter. At small widths the split is what costs: a matmul on
fewer rows runs further from the machine's peak.

Each configuration runs `build/test_moe_layer --bench N C E k f REPS` (forward + backward of the
layer and of the dense MLP on the same N tokens, alternating, so a shared machine's load falls on
both alike) and prints the medians and their same-run ratio. The default shapes are the main job's
(scripts/run.sh: C=64, B*T = 8*64 = 512 tokens per micro-batch) and a 4x wider layer.

    OMP_NUM_THREADS=1 python3 scripts/bench_moe_layer.py [--reps 30]

On a shared machine one thread gives the steadier ratio (two threads share the cores with whatever
else runs, and the small matmuls here suffer most from a stalled thread); the thread count is printed.
"""
import argparse, os, platform, statistics, subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "build", "test_moe_layer")
CONFIGS = [  # N, C, E, k, f
    (512, 64, 1, 1, 0.0), (512, 64, 8, 1, 1.25), (512, 64, 8, 1, 0.0), (512, 64, 8, 2, 1.25),
    (512, 256, 8, 1, 1.25), (512, 256, 8, 2, 1.25),
]


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    subprocess.run(["make", "-s", "build/test_moe_layer"], cwd=ROOT, check=True)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    cpu = platform.machine()
    if os.path.exists("/proc/cpuinfo"):
        cpu = next((l.split(":", 1)[1].strip() for l in open("/proc/cpuinfo") if l.startswith("model name")), cpu)
    threads = os.environ.get("OMP_NUM_THREADS", f"all {os.cpu_count()}")
    print(f"machine: {cpu}, {os.cpu_count()} cores, threads {threads}, load average {os.getloadavg()[0]:.1f}; "
          f"commit {commit}; python3 scripts/bench_moe_layer.py --reps {args.reps}")
    print(f"{'N':>5} {'C':>4} {'E':>3} {'k':>2} {'f':>5} | {'dense ms':>9} {'MoE ms':>9} {'MoE/dense':>9} | dropped")
    for N, C, E, k, f in CONFIGS:
        out = subprocess.run([HARNESS, "--bench", str(N), str(C), str(E), str(k), str(f), str(args.reps)],
                             cwd=ROOT, check=True, capture_output=True, text=True).stdout.split("\n")
        rows = [list(map(float, line.split())) for line in out if line.strip()]
        dense = statistics.median(r[0] for r in rows)
        moe = statistics.median(r[1] for r in rows)
        ratio = statistics.median(r[1] / r[0] for r in rows)
        print(f"{N:>5} {C:>4} {E:>3} {k:>2} {f:>5} | {dense:>9.3f} {moe:>9.3f} {ratio:>9.2f} | {int(rows[0][2])}")


if __name__ == "__main__":
    main()
