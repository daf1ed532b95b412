#!/usr/bin/env python3
"""test_grid_planner.py — `--plan N` (llmc/parallel/grid_planner.h) against hand counts, --estimate and
the closed forms. Arithmetic only: no data, no MPI, a second at most.

  complete     4 ranks, L=4 H=4, 8 micro-batches of B=4 per step: the 13 grids counted by hand below
               (tensor | 4 heads, pipeline <= 4 layers and <= the micro-batches, data | 8 micro-batches,
               ZeRO-1..3 only with 2+ data ranks, ZeRO-2/3 never with a pipeline), no more, no fewer;
               and with --tensor-parallel 2 fixed, only its 6
  memory       every grid's bytes per rank = the most any rank needs in `--estimate` for the same grid
               (every rank's table, to the byte); the GPU trainer (the emulated build, if built) adds
               exactly its 512 MiB CUDA margin, which --estimate prints apart
  time         compute = (6N + 6LCT) x tokens / ranks / FLOP rate, bubble = compute (p-1)/m, and pure
               data parallelism's traffic = the ring all-reduce's 2(d-1)/d x 4N bytes / bandwidth; the
               step is their sum; the table is sorted by it
  rules        on an 8-GPU node with slow links between nodes, the winner keeps its tensor group inside
               a node (Narayanan et al.'s first rule), and a tiny memory per rank flags grids as not fitting;
               a tensor group of 6 on nodes of 8 is priced at the network's bandwidth (it straddles two)
  latency      a small model on 8 ranks: bytes alone and 100 us a hop pick different winners, each
               with its message hops counted by hand (the latency term of the alpha-beta model)
  nodes        the CPU trainer's node is this machine unless told (a rank per core, its RAM shared by
               them), in one line; --plan-node-size and --plan-node-memory-gib describe another
  bad input    --plan-node-memory-gib -1 (a GPU rank has its own memory: the GPU trainer refuses the flag), --plan-latency -2, --plan 0, --plan -3, --plan with --estimate or --eval-only, a negative bandwidth, and 13 ranks for a
               model of 12 heads and layers with 8 micro-batches a step (no degree can take a 13): one
               line, exit 2, on both trainers (the shared CLI)
Planted bugs this caught (by hand, reverted): the bubble as (p-1)/(m+p-1) of the compute instead of
(p-1)/m ("time"); ZeRO-3 left out of the enumeration ("complete"); rank 0's memory instead of the
busiest rank's ("memory": the last pipeline stage holds more); the no-grid refusal removed ("bad input");
a group counted inside a node whenever it is no larger than one ("rules": 6 ranks on nodes of 8); an
all-reduce counted as n-1 hops instead of 2(n-1) ("latency").
"""
import os, re, subprocess, sys
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CPU = os.path.join(ROOT, "train_gpt_cpu")
GPU = os.path.join(ROOT, "build", "emu", "train_gpt")
MODEL = "L=4,C=64,H=4,T=64,V=2048"  # a vocabulary large enough that the last stage holds the most
B, T, TOKENS = 4, 32, 1024  # 1024 / (4 * 32) = 8 micro-batches per step
LATENCY_MS = 0.1  # the CPU trainer's default --plan-latency (100 us a hop, grid_planner.h)
BASE = ["--model", MODEL, "--batch-size", str(B), "--seq-len", str(T), "--total-batch-tokens", str(TOKENS)]

# (dp, tp, pp, zero), counted by hand for 4 ranks: tp in {1, 2, 4} (divides 4 heads), pp <= 4 layers,
# dp = 4 / (tp pp) must divide the 8 micro-batches, m = 8 / dp >= pp
HAND = {
    (4, 1, 1, 0), (4, 1, 1, 1), (4, 1, 1, 2), (4, 1, 1, 3),   # pure data parallelism, every ZeRO stage
    (2, 2, 1, 0), (2, 2, 1, 1), (2, 2, 1, 2), (2, 2, 1, 3),   # data x tensor
    (2, 1, 2, 0), (2, 1, 2, 1),                               # data x pipeline: ZeRO-2/3 refused with pipelines
    (1, 4, 1, 0), (1, 2, 2, 0), (1, 1, 4, 0),                 # one replica: nothing to shard with ZeRO
}

ROW = re.compile(r"^\s*(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+(\d+)\s+[\d.]+ \S+\s+(yes|NO)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)"
                 r"\s+(\S+)\s+(\S+)\s+(\S+)(?:\s+(\d+)\s+(\d+))?$")


def run(binary, args):
    p = subprocess.run([binary] + args, capture_output=True, text=True, timeout=120)
    return p.returncode, p.stdout, p.stderr


def parse_plan(out):
    """[{dp, tp, pp, zero, m, fits, step, compute, bubble, tensor, pipe, data, bytes}] in printed order."""
    rows = []
    for line in out.splitlines():
        m = ROW.match(line)
        if not m:
            continue
        ms = lambda s: 0.0 if s == "-" else float(s.rstrip("*"))
        rows.append(dict(dp=int(m[1]), tp=int(m[2]), pp=int(m[3]), zero=int(m[4]), m=int(m[5]), fits=m[6] == "yes",
                         step=float(m[7]), compute=float(m[8]), bubble=float(m[9]), tensor=ms(m[10]), pipe=ms(m[11]),
                         data=ms(m[12]), bytes=int(m[13]) if m[13] else None, busiest=int(m[14]) if m[14] else None))
    return rows


def estimate_max_total(binary, dp, tp, pp, zero):
    code, out, err = run(binary, BASE + ["--estimate", "--estimate-ranks", str(dp), "--tensor-parallel", str(tp),
                                         "--pipeline-parallel", str(pp), "--zero", str(zero)])
    totals = [int(t) for t in re.findall(r"^  ranks? [\d-]+:.* total=(\d+)", out, re.M)]
    params = re.search(r"N = ([\d,]+) parameters", out)
    return (max(totals) if code == 0 and totals else None), (int(params[1].replace(",", "")) if params else None)


def one_line_error(binary, name, args, needle):
    code, out, err = run(binary, args)
    lines = err.strip().splitlines()
    ok = code == 2 and len(lines) == 1 and needle in err
    report(ok, f"bad input: {name}", f"exit {code}, stderr: {err.strip()[:400]}", err.strip()[:160])


def main():
    if not os.path.exists(CPU):
        print("SKIP: grid planner (train_gpt_cpu not built)")
        return 0
    flops, bw = 1e9, 1e8  # 0.001 TFLOP/s and 0.1 GB/s: times of tens of ms, read to 0.1 ms
    plan_args = BASE + ["--plan", "4", "--plan-tflops", "0.001", "--plan-bandwidth", "0.1", "--verbose"]
    code, out, err = run(CPU, plan_args)
    rows = parse_plan(out)
    grids = {(r["dp"], r["tp"], r["pp"], r["zero"]) for r in rows}
    report(code == 0 and grids == HAND and len(rows) == len(HAND), "complete: the 13 grids of 4 ranks counted by hand",
           f"exit {code}; missing {sorted(HAND - grids)}, extra {sorted(grids - HAND)}, rows {len(rows)}\n{err[-500:]}",
           f"{len(rows)} grids")
    report(f"grids: {len(HAND)} valid, {len(HAND)} fit" in out, "complete: the summary line counts them", out[:600])
    code2, out2, _ = run(CPU, plan_args + ["--tensor-parallel", "2"])
    fixed = {(r["dp"], r["tp"], r["pp"], r["zero"]) for r in parse_plan(out2)}
    report(code2 == 0 and fixed == {g for g in HAND if g[1] == 2}, "complete: --tensor-parallel 2 keeps only its grids",
           f"got {sorted(fixed)}")

    # ---- memory: the planner's bytes = --estimate's busiest rank, grid by grid
    bad, N = [], None
    for r in rows:
        want, N = estimate_max_total(CPU, r["dp"], r["tp"], r["pp"], r["zero"])
        if want is None or r["bytes"] != want:
            bad.append(f"{(r['dp'], r['tp'], r['pp'], r['zero'])}: plan {r['bytes']}, estimate {want}")
    report(rows and not bad, "memory: every grid's bytes per rank = --estimate's busiest rank (CPU trainer)", "\n".join(bad),
           f"{len(rows)} grids")
    # the pipeline's stages differ, so the busiest is not always rank 0 (the control that makes the above bite)
    differs = [r for r in rows if r["busiest"] != 0]
    report(len(differs) > 0, "memory: the busiest rank of some pipeline grid is not rank 0 (a last stage)",
           "every busiest rank was 0", f"{len(differs)} grids")

    if os.path.exists(GPU):
        code, gout, gerr = run(GPU, plan_args)
        grows = parse_plan(gout)
        bad = []
        for r in grows:
            want, _ = estimate_max_total(GPU, r["dp"], r["tp"], r["pp"], r["zero"])
            if want is None or r["bytes"] != want + (512 << 20):
                bad.append(f"{(r['dp'], r['tp'], r['pp'], r['zero'])}: plan {r['bytes']}, estimate {want} + 512 MiB")
        report(code == 0 and len(grows) == len(HAND) and not bad,
               "memory: the GPU trainer's plan = its --estimate's busiest rank + the CUDA margin", f"exit {code}\n" + "\n".join(bad),
               f"{len(grows)} grids")
    else:
        print("SKIP: grid planner on the GPU trainer (build/emu/train_gpt not built: make emu)")

    # ---- time: the closed forms
    L, C = 4, 64
    compute = (6 * N + 6 * L * C * T) * TOKENS / 4 / flops * 1e3  # ms per rank
    bad = []
    for r in rows:
        bubble = compute * (r["pp"] - 1) / r["m"]
        total = compute + bubble + r["tensor"] + r["pipe"] + r["data"]
        if abs(r["compute"] - compute) > 0.06 or abs(r["bubble"] - bubble) > 0.06 or abs(r["step"] - total) > 0.2:
            bad.append(f"{r}: want compute {compute:.2f} bubble {bubble:.2f} step {total:.2f}")
    # ZeRO-0 over 4 data ranks: a ring all-reduce of N fp32 values, 2(d-1) = 6 hops of the CPU's 100 us
    ring = 2 * 3 / 4 * 4 * N / bw * 1e3 + 6 * LATENCY_MS
    pure = [r for r in rows if (r["dp"], r["zero"]) == (4, 0)][0]
    steps = [r["step"] for r in rows]
    report(not bad and abs(pure["data"] - ring) <= 0.01 * ring and steps == sorted(steps),
           "time: compute, bubble (p-1)/m, the ring all-reduce's bytes and hops, their sum, and the ranking by it",
           "\n".join(bad) + f"\ndata ms {pure['data']} against 2(d-1)/d 4N / bw + 2(d-1) alpha = {ring:.2f}; sorted {steps == sorted(steps)}",
           f"compute {compute:.1f} ms, data {pure['data']} vs {ring:.1f} ms")

    # ---- latency: a small model on 8 ranks (L=2 C=256, 8 sequences of 16 tokens a step). On bytes
    # alone dp 1 x tp 4 x pp 2 wins: the activations tensor parallelism sums are smaller than the
    # gradient data parallelism sums. Its tensor group all-reduces 4 times a layer and micro-batch: at
    # 100 us a hop (this machine's) that costs more than the bytes, and dp 2 x tp 2 x pp 2 wins. Hops
    # by hand (the busiest rank is the last stage's: 1 layer, the loss, the LM head):
    #   dp1 tp4 pp2, m = 8: tensor 8 x (4 x 1 + 3) all-reduces x 2(4-1) = 336, pipeline 8 + 1 (wte) = 345
    #   dp2 tp2 pp2, m = 4: tensor 4 x 7 x 2 = 56, pipeline 4 + 1 = 5, data ZeRO-1 2(2-1) = 2: 63
    small = ["--model", "L=2,C=256,H=8,T=16,V=501", "--batch-size", "1", "--seq-len", "16", "--total-batch-tokens", "128",
             "--plan", "8"]
    code_a, bytes_only, _ = run(CPU, small + ["--plan-latency", "0"])
    code_b, with_latency, _ = run(CPU, small)
    winner = lambda out: re.search(r"winner: (dp \d+ x tp \d+ x pp \d+)", out)  # noqa: E731
    wa, wb = winner(bytes_only), winner(with_latency)
    report(code_a == 0 and code_b == 0 and wa and wb and wa.group(1) == "dp 1 x tp 4 x pp 2" and
           wb.group(1) == "dp 2 x tp 2 x pp 2" and "(345 hops)" in bytes_only and "(63 hops)" in with_latency and
           "100 us a message hop" in with_latency,
           "latency: a small model on 8 ranks: bytes alone pick dp 1 x tp 4 x pp 2 (345 hops), 100 us a hop picks "
           "dp 2 x tp 2 x pp 2 (63 hops), as counted by hand",
           f"{wa.group(1) if wa else None} / {wb.group(1) if wb else None}\n{with_latency[-700:]}")

    # ---- the CPU trainer's nodes: unless told, this machine (a rank per core, its RAM shared by the ranks
    # on it), said in one line; --plan-node-size and --plan-node-memory-gib describe another node
    cores, ram = os.cpu_count(), os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    code, out, err = run(CPU, BASE + ["--plan", "8"])
    line = [l for l in out.splitlines() if "of memory per rank" in l]
    per_rank = re.search(r"([\d.]+) GiB of memory per rank", line[0]) if line else None
    sharing, nodes = min(cores, 8), -(-8 // cores)
    report(code == 0 and len(line) == 1 and per_rank and abs(float(per_rank[1]) - ram / sharing / 2**30) < 0.01
           and f"over its {sharing} rank" in line[0] and f"one per core of this machine's {cores}" in line[0]
           and "this machine's RAM" in line[0] and f"8 ranks = {nodes} node" in line[0],
           f"--plan 8 on the CPU trainer: nodes of this machine ({cores} cores, its RAM over {sharing} ranks), in one line",
           (line[0] if line else out[-600:]) + err[-300:])
    code, out, err = run(CPU, BASE + ["--plan", "8", "--plan-node-size", "4", "--plan-node-memory-gib", "16"])
    report(code == 0 and "4.00 GiB of memory per rank (a node's 16.00 GiB, --plan-node-memory-gib, over its 4 ranks, "
           "--plan-node-size; 8 ranks = 2 nodes)" in out,
           "--plan 8 --plan-node-size 4 --plan-node-memory-gib 16: 4 GiB per rank on 2 nodes", out[-800:] + err[-300:])

    # ---- rules: tensor parallelism inside a node; memory flags
    code, out3, _ = run(CPU, ["--model", "L=8,C=512,H=16,T=1024,V=50257", "--batch-size", "1", "--seq-len", "1024",
                              "--total-batch-tokens", str(64 * 1024), "--plan", "16", "--plan-tflops", "100",
                              "--plan-node-size", "8", "--plan-node-bandwidth", "300", "--plan-bandwidth", "3",
                              "--estimate-memory-gib", "0.5"])
    best = parse_plan(out3)
    report(code == 0 and best and best[0]["tp"] <= 8 and best[0]["tp"] > 1 and any(not r["fits"] for r in best),
           "rules: with slow links between nodes the winner's tensor group stays in one node; some grids do not fit",
           out3[-1500:], f"winner dp {best[0]['dp']} tp {best[0]['tp']} pp {best[0]['pp']}" if best else "")
    report("winner:" in out3 and "memory:" in out3 and "time:" in out3, "rules: the winner is explained", out3[-800:])
    # groups of 6 consecutive ranks on nodes of 8 straddle two nodes (ranks 6-11); groups of 4 do not
    code, out4, _ = run(CPU, ["--model", "L=2,C=96,H=12,T=64,V=512", "--batch-size", "1", "--seq-len", "64",
                              "--total-batch-tokens", str(24 * 64), "--plan", "24", "--plan-node-size", "8",
                              "--tensor-parallel", "6", "--verbose"])
    code4, out5, _ = run(CPU, ["--model", "L=2,C=96,H=12,T=64,V=512", "--batch-size", "1", "--seq-len", "64",
                               "--total-batch-tokens", str(24 * 64), "--plan", "24", "--plan-node-size", "8",
                               "--tensor-parallel", "4", "--verbose"])
    tensor_col = lambda out: [l.split()[11] for l in out.splitlines() if ROW.match(l)]
    t6, t4 = tensor_col(out4), tensor_col(out5)
    report(code == 0 and code4 == 0 and t6 and t4 and all(c.endswith("*") for c in t6) and not any(c.endswith("*") for c in t4),
           "rules: a tensor group of 6 on nodes of 8 crosses nodes, one of 4 does not", f"tp 6: {t6}, tp 4: {t4}")

    # ---- bad input: one line, exit 2, both trainers
    binaries = [CPU] + ([GPU] if os.path.exists(GPU) else [])
    for binary in binaries:
        who = os.path.basename(binary)
        one_line_error(binary, f"{who} --plan 0", BASE + ["--plan", "0"], "--plan needs at least 1 rank")
        one_line_error(binary, f"{who} --plan -3", BASE + ["--plan", "-3"], "--plan needs at least 1 rank")
        one_line_error(binary, f"{who} --plan with --estimate", BASE + ["--plan", "4", "--estimate"], "pass one of them")
        one_line_error(binary, f"{who} --plan with --eval-only", BASE + ["--plan", "4", "--eval-only"], "it does not evaluate")
        one_line_error(binary, f"{who} --plan-node-memory-gib -1", BASE + ["--plan", "4", "--plan-node-memory-gib", "-1"],
                       "--plan-node-memory-gib must be positive" if binary == CPU else "applies only to the CPU trainer")
        one_line_error(binary, f"{who} --plan-latency -2", BASE + ["--plan", "4", "--plan-latency", "-2"],
                       "--plan-latency must be -1")
        one_line_error(binary, f"{who} --plan-bandwidth -1", BASE + ["--plan", "4", "--plan-bandwidth", "-1"],
                       "--plan-bandwidth must be")
        one_line_error(binary, f"{who} 13 ranks for 12 heads, 12 layers, 8 micro-batches",
                       ["--model", "L=12,C=96,H=12,T=64,V=512", "--batch-size", "1", "--seq-len", "64",
                        "--total-batch-tokens", str(8 * 64), "--plan", "13"], "no grid of 13 ranks")
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
