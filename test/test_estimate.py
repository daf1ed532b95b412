#!/usr/bin/env python3
"""test_estimate.py — --estimate against what the trainers really do.

  cpu, 1 rank        `train_gpt_cpu --estimate` lists every buffer the trainer allocates; a real run
                     with --print-allocations reports the capacity of every vector it holds at the end
                     of the run. They must agree row by row, to the byte.
  cpu, 2 ranks       the same under mpirun with ZeRO-1 and ZeRO-0, rank by rank: with ZeRO-1 AdamW's
                     m and v shrink to each rank's shard (rank 1's is smaller: it owns less of a
                     model whose size is not a multiple of 2 * 64)
  control            the comparison can fail: a run with another micro-batch does not match
  recompute          --recompute 1 and 2 on one rank: every buffer allocated = its estimate, the
                     activations smaller by exactly L x fch_gelu (and L x ln1, ln2) for one layer of
                     scratch, and the losses, step-1 gradients, logits and final weights bit-identical
                     to level 0 (recompute redoes the forward's functions on the forward's inputs)
  no data, no GPU    --estimate reads no data and needs no GPU (train_gpt, when built, says so too)
  answer first       both trainers' --estimate open with three lines: fits or not in the memory named,
                     the memory per rank, the largest micro-batch; the same numbers as the tables
  measure script     scripts/measure_memory.py parses a trainer's report and writes its table
                     (driven by a stand-in trainer: the real measurement needs a GPU)
"""
import glob, os, re, shutil, subprocess, sys, tempfile
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from safetensors_io import read_safetensors  # noqa: E402
CPU = os.path.join(ROOT, "train_gpt_cpu")
GPU = os.path.join(ROOT, "train_gpt")
# N = 82,752 parameters: not a multiple of 2 * 64, so two ZeRO-1 shards differ (41,408 and 41,344)
MODEL = "L=2,C=48,H=4,T=32,V=500"
KINDS = ["params", "grads", "master", "optimizer", "activations", "workspace"]


def run(cmd, cwd=None, timeout=120):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=cwd, timeout=timeout)
    return p.returncode, p.stdout, p.stderr


def parse_estimate(out):
    """({row: (kind, bytes)} of rank 0's table, {rank: {kind: bytes, 'total': bytes}})."""
    rows = {}
    in_table = False
    for line in out.splitlines():
        if line.startswith("memory of rank 0, buffer by buffer"):
            in_table = True
            continue
        if in_table:
            m = re.match(r"^  (\S+)\s+(" + "|".join(KINDS) + r")\s.*?\s(\d+)  \S+ \S+$", line)
            if m:
                rows[m.group(1)] = (m.group(2), int(m.group(3)))
            elif line.startswith("  total"):
                in_table = False
    ranks = {}
    for m in re.finditer(r"^  ranks? (\d+)(?:-(\d+))?: (.*)$", out, re.M):
        values = {k: int(v) for k, v in re.findall(r"(\w+)=(\d+)", m.group(3))}
        for r in range(int(m.group(1)), int(m.group(2) or m.group(1)) + 1):
            ranks[r] = values
    return rows, ranks


def parse_allocations(out):
    """{rank: {row: bytes}} from --print-allocations."""
    held = {}
    for m in re.finditer(r"^allocation: rank (\d+) (\S+) (\d+)$", out, re.M):
        held.setdefault(int(m.group(1)), {})[m.group(2)] = int(m.group(3))
    return held


def compare(rows, ranks, held, rank):
    """'' if rank's allocations equal the estimate (row by row for rank 0, by kind for every rank)."""
    mine = held.get(rank)
    if not mine:
        return f"rank {rank} printed no allocations"
    problems = []
    if rank == 0:
        for name, got in mine.items():
            want = rows.get(name, (None, 0))[1]
            if name != "total" and got != want:
                problems.append(f"{name}: allocated {got}, estimated {want}")
        problems += [f"{name} estimated but not allocated" for name in rows if name not in mine]
    kind_of = {name: kind for name, (kind, _) in rows.items()}
    by_kind = {k: 0 for k in KINDS}
    for name, got in mine.items():
        if name != "total" and got:
            by_kind[kind_of.get(name, "workspace")] += got
    want = ranks.get(rank, {})
    for k in KINDS + ["total"]:
        got = mine["total"] if k == "total" else by_kind[k]
        if want.get(k) != got:
            problems.append(f"{k}: allocated {got}, estimated {want.get(k)}")
    return "; ".join(problems)


def main():
    if not os.path.exists(CPU):
        print("SKIP: estimate (train_gpt_cpu not built)")
        return 0
    tmp = tempfile.mkdtemp(prefix="llmc_estimate_")
    try:
        import numpy as np
        header = np.zeros(256, dtype=np.int32)
        header[:3] = [20240520, 1, 20000]
        with open(os.path.join(tmp, "train.bin"), "wb") as f:
            f.write(header.tobytes())
            f.write(np.random.default_rng(0).integers(0, 500, 20000).astype(np.uint16).tobytes())
        shape = ["--model", MODEL, "--batch-size", "4", "--seq-len", "32"]
        train = ["--train-data", os.path.join(tmp, "train.bin"), "--val-data", "none", "--steps", "2",
                 "--threads", "1", "--print-allocations", "--out-dir", os.path.join(tmp, "out")]

        # ---- one rank
        code, out, err = run([CPU] + shape + ["--estimate"], cwd=tmp)  # cwd has no data/: none is read
        rows, ranks = parse_estimate(out)
        report(code == 0 and "PREDICTED" in out and len(rows) >= 25 and 0 in ranks,
               "cpu --estimate prints the table without data files", (err or out)[-400:])
        code, run_out, err = run([CPU] + shape + train)
        held = parse_allocations(run_out)
        why = compare(rows, ranks, held, 0) if code == 0 else err[-400:]
        report(code == 0 and not why, "cpu, 1 rank: every buffer allocated = its estimate, to the byte "
               f"({ranks.get(0, {}).get('total')} bytes)", why)
        m = re.search(r"^memory: rank 0 holds .* \((\d+) bytes\)", run_out, re.M)
        report(m is not None and int(m.group(1)) == ranks.get(0, {}).get("total"),
               "the trainer's start-up memory line says the same total", run_out[:600])

        # ---- the comparison can fail: another micro-batch's allocations do not match B=4's estimate
        code, other, err = run([CPU, "--model", MODEL, "--batch-size", "2", "--seq-len", "32"] + train)
        why = compare(rows, ranks, parse_allocations(other), 0)
        report(code == 0 and "activations" in why and not any(k + ":" in why for k in ["params", "grads", "optimizer"]),
               "control: B=2's allocations differ from B=4's estimate (activations only)", why or err[-300:])

        # ---- --recompute on one rank: exactly the bytes the levels promise, and exactly the same results.
        # Level 1 drops fch_gelu (L, B, T, 4C) for one layer of scratch (B, T, 4C); level 2 also ln1 and
        # ln2 (L, B, T, C) each for one shared (B, T, C). fp32: 4 bytes a value. L=2, C=48, B*T=128.
        L, C, BT = 2, 48, 4 * 32
        saved = {0: (0, 0), 1: (4 * L * BT * 4 * C, 4 * BT * 4 * C),
                 2: (4 * L * BT * 4 * C + 4 * 2 * L * BT * C, 4 * BT * 4 * C + 4 * BT * C)}  # (activations, workspace)
        measured, dumps = {}, {}
        for level in (0, 1, 2):
            flags = ["--recompute", str(level)]
            code, est, err = run([CPU] + shape + flags + ["--estimate"], cwd=tmp)
            rows_l, ranks_l = parse_estimate(est)
            dump = os.path.join(tmp, f"recompute{level}.st")
            code2, out, err2 = run([CPU] + shape + train + flags + ["--steps", "4", "--dump-state", dump])
            held_l = parse_allocations(out)
            why = compare(rows_l, ranks_l, held_l, 0) if code == 0 and code2 == 0 else (err + err2)[-400:]
            kinds = {k: 0 for k in KINDS}
            for name, got in held_l.get(0, {}).items():
                if name != "total":
                    kinds[rows_l.get(name, ("workspace", 0))[0]] += got
            measured[level] = kinds
            dumps[level] = read_safetensors(dump)[0] if os.path.exists(dump) else None
            if level > 0:
                act = measured[0]["activations"] - kinds["activations"]
                ws = kinds["workspace"] - measured[0]["workspace"]
                report(not why and (act, ws) == saved[level] and f"recompute {level}" in est,
                       f"cpu --recompute {level}: every buffer allocated = its estimate; activations "
                       f"{act:,} bytes fewer, workspace {ws:,} more, as predicted {saved[level]}", why or f"{act} {ws}")
                a, b = dumps[level], dumps[0]
                bad = [k for k in ("losses", "grads", "logits", "params")
                       if a is None or b is None or not (a[k].shape == b[k].shape and a[k].tobytes() == b[k].tobytes())]
                report(not bad, f"cpu --recompute {level}: losses, step-1 gradients, logits and final weights "
                       "bit-identical to --recompute 0", "differ: " + ", ".join(bad))
        # the bitwise comparison can fail: a run from another seed does not pass it
        if dumps[0] is not None:
            code, _, err = run([CPU] + shape + train + ["--steps", "4", "--seed", "43", "--dump-state",
                                                        os.path.join(tmp, "seed43.st")])
            other = read_safetensors(os.path.join(tmp, "seed43.st"))[0] if code == 0 else None
            report(other is not None and other["params"].tobytes() != dumps[0]["params"].tobytes(),
                   "control: another seed's weights are not bit-identical (the comparison can fail)", err[-300:])
        code, _, err = run([CPU] + shape + ["--recompute", "3", "--estimate"], cwd=tmp)
        report(code == 2 and err.strip() == "error: --recompute must be 0, 1 or 2, got 3",
               "cpu --recompute 3: exit 2, one line", f"exit {code}: {err!r}")

        # ---- two ranks under mpirun: ZeRO-1 (m, v shrink to each rank's shard) and ZeRO-0
        mpirun = shutil.which("mpirun")
        built_with_mpi = "libmpi" in subprocess.run(["ldd", CPU], capture_output=True, text=True).stdout
        if not mpirun or not built_with_mpi:
            print("SKIP: cpu, 2 ranks (no mpirun, or train_gpt_cpu built without MPI)")
        else:
            optimizer = {}
            for zero in ["1", "0"]:
                code, est, err = run([CPU] + shape + ["--zero", zero, "--estimate-ranks", "2", "--estimate"], cwd=tmp)
                rows2, ranks2 = parse_estimate(est)
                # each rank's output goes to its own file: mpirun forwards the ranks' streams in chunks that
                # need not end at a newline, so two ranks reporting at once could split each other's lines
                outputs = os.path.join(tmp, f"ranks_zero{zero}")
                code, _, err2 = run(["timeout", "120", mpirun, "--allow-run-as-root", "--oversubscribe", "-np", "2",
                                     "--output-filename", outputs, CPU] + shape + train + ["--zero", zero], timeout=150)
                out2 = "".join(open(path).read() for path in sorted(glob.glob(os.path.join(outputs, "*", "rank.*", "stdout"))))
                held2 = parse_allocations(out2)
                why = "; ".join(filter(None, [compare(rows2, ranks2, held2, r) for r in (0, 1)])) if code == 0 else err2[-400:]
                report(code == 0 and not why, f"cpu, 2 ranks, ZeRO-{zero}: each rank allocates its estimate, to the byte "
                       f"(rank 0 {ranks2.get(0, {}).get('total')}, rank 1 {ranks2.get(1, {}).get('total')})", why)
                optimizer[zero] = [ranks2.get(r, {}).get("optimizer", 0) for r in (0, 1)]
            # N = 82,752: ZeRO-0 keeps 8 bytes x 82,752 per rank; ZeRO-1 8 x 41,408 and 8 x 41,344
            report(optimizer.get("0") == [662016, 662016] and optimizer.get("1") == [331264, 330752],
                   "ZeRO-1 halves m and v: 662,016 bytes per rank -> 331,264 (rank 0) and 330,752 (rank 1)",
                   str(optimizer))

        # ---- the GPU trainer's estimate needs no GPU
        if os.path.exists(GPU):
            code, out, err = run([GPU, "--model", "d12", "--batch-size", "4", "--zero", "1", "--estimate-ranks", "8",
                                  "--estimate"], cwd=tmp)
            rows, ranks = parse_estimate(out)
            # d12 on 8 ranks: master 4 x 15,559,488 and m, v 8 x 15,559,488 per rank; params 2 x 124,475,904
            report(code == 0 and ranks.get(0, {}).get("master") == 62237952 and ranks.get(7, {}).get("optimizer") == 124475904
                   and rows.get("params") == ("params", 248951808) and "Korthikanti" in out,
                   "train_gpt --estimate without a GPU: ZeRO-1 on 8 ranks shards master, m and v", (err or out)[-500:])
        else:
            print("SKIP: train_gpt --estimate (train_gpt not built: no nvcc)")

        # ---- the answer first: three lines (fits or not, memory per rank, the largest micro-batch), the
        # same numbers as the tables below them, on both trainers (the emulated GPU build needs no GPU)
        emu = os.path.join(ROOT, "build", "emu", "train_gpt")
        for name, binary in [("train_gpt_cpu", CPU), ("build/emu/train_gpt", emu)]:
            if not os.path.exists(binary):
                print(f"SKIP: {name} --estimate's answer (not built)")
                continue
            for batch, gib, fits in [("4", "20", "yes"), ("64", "20", "NO")]:
                code, out, err = run([binary, "--model", "d12", "--batch-size", batch, "--seq-len", "1024",
                                      "--estimate-memory-gib", gib, "--estimate"], cwd=tmp)
                lines = out.splitlines()
                fit = re.search(r"^  largest micro-batch that fits 20\.00 GiB \(--estimate-memory-gib\): (B=\d+ at T=1024)", out, re.M)
                need = re.search(r"the trainer wants (\S+ \S+) free", out) if "emu" in binary else \
                    re.search(r"^  total\s+[\d,]+\s+(\S+ \S+)$", out, re.M)
                largest = int(re.search(r"B=(\d+)", fit[1])[1]) if fit else -1
                ok = (code == 0 and len(lines) > 4 and lines[3] == "" and lines[4].startswith("estimate: PREDICTED")
                      and lines[0].startswith(f"fits: {fits}: B={batch} T=1024 ") and "20.00 GiB per rank (--estimate-memory-gib)" in lines[0]
                      and fit and need and lines[1].startswith(f"memory per rank: {need[1]} (rank 0")
                      and lines[2] == f"largest micro-batch that fits: {fit[1]}"
                      and (largest >= int(batch) if fits == "yes" else 0 < largest < int(batch)))
                report(bool(ok), f"{name} --estimate, d12 B={batch} in {gib} GiB: opens with fits: {fits}, the memory per rank "
                       "and the largest micro-batch, as its tables say", "\n".join(lines[:5]) + err[-300:])

        # ---- the measurement script, driven by a stand-in trainer (the real one needs a GPU)
        fake = os.path.join(tmp, "fake_trainer.py")
        with open(fake, "w") as f:
            f.write("""#!/usr/bin/env python3
import sys
a = sys.argv[1:]
B = int(a[a.index('--batch-size') + 1])
if '--estimate' in a:
    print('  + 512.0 MiB for the CUDA context and libraries (a margin, not a measurement): ...')
    print(f'  rank 0: params=1 grads=1 master=0 optimizer=0 activations=0 workspace=0 total={B * 1000000000}')
elif B == 4:
    print('error: B=4 needs more than is free: the largest micro-batch that fits is --batch-size 2', file=sys.stderr)
    sys.exit(1)
else:
    before = 600000000
    measured = {1: 1040000000, 2: 1800000000}[B]
    print(f'GPU memory bytes: table {B * 1000000000}, in use before allocation {before}, '
          f'peak in use {before + measured}, peak minus before {measured}')
""")
        os.chmod(fake, 0o755)
        code, out, err = run([sys.executable, os.path.join(ROOT, "scripts", "measure_memory.py"), "--trainer", fake,
                              "--models", "d12", "--batch-sizes", "1,2,4", "--recompute", "1", "--out", tmp])
        md = open(os.path.join(tmp, "memory_measured.md")).read() if os.path.exists(os.path.join(tmp, "memory_measured.md")) else ""
        ok = ("| d12 | 1 | 1 | 1024 | 0.931 | 0.931 | 0.969 | -3.85% | within 5% |" in md
              and "| d12 | 1 | 2 | 1024 | 1.863 | 1.863 | 1.676 | 11.11% | OFF BY MORE THAN 5% |" in md
              and "| d12 | 1 | 4 | 1024 | 3.725 |  |  |  | does not fit |" in md)
        report(ok and code == 1, "measure_memory.py: parses prediction and measurement, flags an error over 5%, "
               "records a batch that does not fit", md + err[-300:])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
