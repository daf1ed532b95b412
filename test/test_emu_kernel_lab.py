#!/usr/bin/env python3
"""The kernel lab (dev/cuda/) on the CPU emulation of CUDA (test/emu/): every version of every
kernel executed thread by thread and checked by the lab's own harness against the CPU reference.

    build/emu/dev/NAME --tiny --check-only --seed S      (built by `make emu`, or `make` where
                                                         CUDA's headers and MPI are installed)

For each program, under two schedules of the emulated threads and blocks (forward; and threads and
blocks in reverse), one line PASS/FAIL from the lab's checks: FAIL when a version fails its check
(relative L2 error, max error, NaN, unwritten elements: see dev/cuda/harness.h), when a version
has no row, when the program crashes (the emulator stops at an out-of-bounds access, a barrier or
warp collective not every thread reaches, a bad launch), or when a version other than cuDNN's is
skipped. Then, per program, the two schedules' outputs must be bit-identical (the lab prints a
digest of each output's bits), except for the versions that add with floating-point atomics, whose
order of additions is a race by design (they are listed below, each with its reason); and a
trainer's kernel rewritten with the same arithmetic must give the bits of the version it replaced
(SAME_BITS: AdamW's).

SKIP, each with its reason: cuDNN's versions (the emulation's cuDNN refuses every graph; the lab
says so and runs the other versions), and timing (an emulated time says nothing about a GPU). The
whole test is SKIP when build/emu/dev is not built.

Negative controls: mutated copies of real lab kernels, built the same way (make emu-lab-variant),
must fail: a WMMA tile read before the __syncwarp that publishes it, a lane that leaves before a
WMMA collective, and a __syncthreads deleted in the classifier (a race that the forward schedule
happens to hide and the reverse one shows: why every check runs under two).
"""
import glob, os, re, shutil, subprocess, sys, tempfile, time
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.join(ROOT, "build", "emu", "dev")
SEED = 1234  # the same inputs under both schedules, so their outputs can be compared bit for bit
SCHEDULES = [("forward", {"CUDA_EMU_THREADS": "forward", "CUDA_EMU_BLOCKS": "forward"}),
             ("reverse", {"CUDA_EMU_THREADS": "reverse", "CUDA_EMU_BLOCKS": "reverse"})]
TIMEOUT = 300
# Versions whose result depends on the order of floating-point additions, by design (their rows in
# dev/cuda/README.md say "not reproducible"): only the lab's tolerance judges them.
RACY = {
    ("encoder_backward", 1): "fp32 atomicAdd into the embedding gradients",
    ("layernorm_backward", 2): "fp32 atomicAdd of the block sums",
    ("bias_backward", 2): "fp32 atomicAdd of the block sums",
    ("global_norm", 1): "a double atomicAdd per element",
    ("global_norm", 2): "a double atomicAdd per block",
}


# Pairs of versions that must give the same bits in every output: a rewrite of a trainer's kernel that
# keeps its arithmetic (only its memory access changes), against the version it replaced.
SAME_BITS = [(("adamw", 3), ("adamw", 4), "AdamW with 4 parameters per thread, loads before stores"),
             (("encoder_backward", 3), ("encoder_backward", 4), "the encoder backward with 8 rows in flight")]


def run(cmd, env=None):
    p = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, **(env or {})), stdout=subprocess.PIPE,
                       stderr=subprocess.STDOUT, text=True, errors="replace", timeout=TIMEOUT)
    return p.returncode, p.stdout


def versions_of(program):
    """[(kernel, id, name)] from --list (tab-separated: 'kernel id', name, what)."""
    code, out = run([os.path.join(BIN, program), "--list"])
    rows = []
    for line in out.splitlines():
        key, name = line.split("\t")[:2]
        kernel, vid = key.split()
        rows.append((kernel, int(vid), name))
    return rows


def parse_log(out):
    """The rows {(kernel, id): (status, skip reason)} and the digests {(kernel, id, output): bits}."""
    rows, digests, skips = {}, {}, {}
    current = None
    for line in out.splitlines():
        m = re.match(r"== (\S+) (\d+) (.*)", line)
        if m:
            current = (m.group(1), int(m.group(2)))
            s = re.search(r": SKIP \((.*)\)$", line)
            if s:
                skips[current] = s.group(1)
            continue
        m = re.match(r"   check (\S+) .* bits ([0-9a-f]{16}) -> ", line)
        if m and current:
            digests[current + (m.group(1),)] = m.group(2)
        if line.startswith("row: |"):
            cells = [c.strip() for c in line[len("row: |"):].split("|")]
            rows[(cells[0], int(cells[1].split()[0]))] = cells[-2]
    return rows, digests, skips


def check_lab_run(program, schedule, versions, code, out):
    rows, _, skips = parse_log(out)
    name = f"emulated kernel lab: {program}, {schedule} schedule"
    problems = []
    for kernel, vid, vname in versions:
        status = rows.get((kernel, vid))
        if status is None:
            problems.append(f"{kernel} {vid} has no row")
        elif status == "FAIL":
            problems.append(f"{kernel} {vid} ({vname}) fails its check")
        elif status == "SKIP" and "cuDNN" not in vname:
            problems.append(f"{kernel} {vid} ({vname}) is skipped: {skips.get((kernel, vid), '?')}")
        elif status not in ("PASS", "SKIP"):
            problems.append(f"{kernel} {vid}: status {status}")
    if code not in (0, 3):
        problems.append(f"exit code {code} (a crash): " + " | ".join(out.strip().splitlines()[-4:]))
    elif code == 3 and not problems:
        problems.append("exit code 3 (a check failed) without a FAIL row")
    if problems:
        failed_checks = [l.strip() for l in out.splitlines() if l.startswith("   check") and "-> FAIL" in l]
        report(False, name, "; ".join(problems + failed_checks[:6]) + f" (replay: CUDA_EMU_THREADS={schedule} "
               f"CUDA_EMU_BLOCKS={schedule} build/emu/dev/{program} --tiny --seed {SEED})")
    else:
        passed = sum(1 for s in rows.values() if s == "PASS")
        report(True, f"{name} ({passed} versions checked against the CPU reference)")
    return skips


def compare_schedules(program, logs):
    (s0, out0), (s1, out1) = logs
    d0, d1 = parse_log(out0)[1], parse_log(out1)[1]
    same, racy_differ, differ = 0, [], []
    for key, bits in d0.items():
        if key not in d1:
            continue  # a crashed run: its own line has failed already
        if key[:2] in RACY:
            racy_differ += [key] if bits != d1[key] else []
        elif bits == d1[key]:
            same += 1
        else:
            differ.append(f"{key[0]} {key[1]} output {key[2]}")
    name = f"emulated kernel lab: {program}, outputs bit-identical under the {s0} and {s1} schedules"
    if differ:
        report(False, name, "a race between threads or blocks: " + ", ".join(differ))
    elif same == 0:
        report(False, name, "no output to compare (did both runs crash?)")
    else:
        note = f"; {len(racy_differ)} outputs of atomic versions differ, as they may" if racy_differ else ""
        report(True, f"{name} ({same} outputs{note})")


def compare_versions(program, out):
    digests = parse_log(out)[1]
    for old, new, what in SAME_BITS:
        outs = sorted(k[2] for k in digests if k[:2] == old)
        if not outs:
            continue  # another program's
        differ = [o for o in outs if digests.get(new + (o,)) != digests[old + (o,)]]
        report(not differ, f"emulated kernel lab: {program} {new[1]} ({what}) gives version {old[1]}'s bits in "
               f"every output ({', '.join(outs)})", "differ: " + ", ".join(differ))


# ---------------------------------------------------------------------------------------------
# Negative controls: a planted bug in a copy of a real lab program must be caught.

def build_variant(tmp, program, old, new):
    """A copy of dev/cuda/PROGRAM.cu with `old` replaced by `new` (exactly once), built as the
    emulated lab programs are. Returns the program's path, or raises."""
    src = open(os.path.join(ROOT, "dev", "cuda", program + ".cu")).read()
    if src.count(old) != 1:
        raise RuntimeError(f"dev/cuda/{program}.cu no longer holds the line to mutate: {old.strip()!r}")
    root = tempfile.mkdtemp(prefix=program + "_", dir=tmp)
    os.makedirs(os.path.join(root, "dev", "cuda"))
    with open(os.path.join(root, "dev", "cuda", program + ".cu"), "w") as f:
        f.write(src.replace(old, new))
    exe = os.path.join(root, program)
    p = subprocess.run(["make", "-s", "emu-lab-variant", f"VARIANT_ROOT={root}", f"VARIANT=dev/cuda/{program}.cu",
                        f"VARIANT_OUT={exe}"], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if p.returncode != 0:
        raise RuntimeError("building the mutated copy failed: " + p.stdout[-1500:])
    return exe


def negative_control(tmp, name, program, old, new, args, expect):
    """expect(schedule -> (code, out)) returns (caught, why). Runs the variant under both schedules."""
    try:
        exe = build_variant(tmp, program, old, new)
        results = {s: run([exe, "--tiny", "--check-only", "--seed", str(SEED)] + args, env)
                   for s, env in SCHEDULES}
        caught, why = expect(results)
        report(caught, f"negative control: {name} is caught" + (f" ({why})" if caught else ""), why)
    except Exception as e:  # noqa: BLE001 - a control that cannot run has failed
        report(False, f"negative control: {name} is caught", f"{type(e).__name__}: {e}")


def check_failed(out):
    return [l.strip() for l in out.splitlines() if l.startswith("   check") and "-> FAIL" in l]


def emulator_error(out):
    return [l.strip() for l in out.splitlines() if l.startswith("CUDA emulator:")]


def main():
    programs = sorted(os.path.basename(p)[:-3] for p in glob.glob(os.path.join(ROOT, "dev", "cuda", "*.cu")))
    if not os.path.isdir(BIN):
        print("SKIP: emulated kernel lab (build/emu/dev is not built: `make emu` builds it where CUDA's headers "
              "and MPI are installed)")
        return 0
    missing = [p for p in programs if not os.access(os.path.join(BIN, p), os.X_OK)]
    if missing:
        report(False, "emulated kernel lab: every program is built", "missing in build/emu/dev: " + " ".join(missing)
               + " (run make emu)")
    print("SKIP: emulated kernel lab: timing (an emulated time says nothing about a GPU; the lab runs --check-only "
          "under the emulator)")
    start = time.time()
    cudnn_skips = {}
    for program in programs:
        if program in missing:
            continue
        versions = versions_of(program)
        logs = []
        for schedule, env in SCHEDULES:
            try:
                code, out = run([os.path.join(BIN, program), "--tiny", "--check-only", "--seed", str(SEED)], env)
            except subprocess.TimeoutExpired:
                code, out = 124, f"timed out after {TIMEOUT} s"
            skips = check_lab_run(program, schedule, versions, code, out)
            for key, why in skips.items():
                cudnn_skips.setdefault((program,) + key, why)
            logs.append((schedule, out))
        compare_schedules(program, logs)
        compare_versions(program, logs[0][1])
    lab_seconds = time.time() - start
    for (program, kernel, vid), why in sorted(cudnn_skips.items()):
        vname = next((n for k, i, n in versions_of(program) if (k, i) == (kernel, vid)), "")
        if "cuDNN" in vname:
            print(f"SKIP: emulated kernel lab: {kernel} {vid} {vname} ({why})")

    start_controls = time.time()
    tmp = tempfile.mkdtemp(prefix="emu_lab_")
    try:
        # matmul_wmma reads its warp's stored 16x16 tile after a __syncwarp; without it a lane reads
        # elements the other lanes have not stored yet (each element is stored by one lane).
        negative_control(
            tmp, "matmul_forward 4 (WMMA) reading the stored tile without __syncwarp", "matmul",
            "            wmma::store_matrix_sync(s, acc[i][j], 16, wmma::mem_row_major);\n            __syncwarp();\n",
            "            wmma::store_matrix_sync(s, acc[i][j], 16, wmma::mem_row_major);\n",
            ["--kernel", "matmul_forward", "--version", "4"],
            lambda r: (all(check_failed(out) for code, out in r.values()),
                       "the lab's check fails: " + "; ".join(check_failed(r["forward"][1])[:1])
                       if all(check_failed(out) for code, out in r.values()) else
                       "not caught under every schedule: " + str({s: c for s, (c, o) in r.items()})))
        # a lane that leaves before the WMMA loads: every lane of a warp must call them
        negative_control(
            tmp, "matmul_forward 4 (WMMA) with lane 31 leaving before the warp collectives", "matmul",
            "    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];\n",
            "    if (lane == 31) return;\n    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[2][4];\n",
            ["--kernel", "matmul_forward", "--version", "4"],
            lambda r: (all(code == 1 and any("exited" in e for e in emulator_error(out)) for code, out in r.values()),
                       "the emulator stops the run: " + "; ".join(emulator_error(r["forward"][1])[:1])))
        # classifier version 2: thread 0 reads z[target] for the loss, then every thread overwrites
        # the row with the gradient; without the barrier between, a thread that runs before thread 0
        # overwrites z[target] first. Forward order runs thread 0 first and hides it.
        negative_control(
            tmp, "fused_classifier 2 without the __syncthreads before the row is overwritten", "classifier",
            "    __syncthreads();  // z[target] is read before anyone overwrites it\n", "",
            ["--version", "2"],
            lambda r: (bool(check_failed(r["reverse"][1])),
                       f"the reverse schedule fails the lab's check ({'; '.join(check_failed(r['reverse'][1])[:1])}); "
                       f"the forward schedule {'fails too' if check_failed(r['forward'][1]) else 'passes: it hides the race'}"))
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    print(f"emulated kernel lab: {len(programs) - len(missing)} programs x {len(SCHEDULES)} schedules in "
          f"{lab_seconds:.1f} s wall, negative controls (builds included) in {time.time() - start_controls:.1f} s")
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
