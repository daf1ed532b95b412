#!/usr/bin/env python3
"""test_emu_nccl.py — the NCCL stand-in of the CUDA emulation (test/emu/nccl_standin.cpp) against numpy.

The stand-in replaces NCCL, which needs a GPU, with MPI, so that the GPU trainer's NCCL path can run
under emulation. Two things must hold, and both are checked here under mpirun with 2 and 3 ranks:

1. The collectives compute what NCCL's documentation says, with the stand-in's own arithmetic
   contract (sum in rank order 0..N-1, bf16 widened to fp32 and rounded to bf16 once): the driver
   (test/emu/nccl_standin_check.cpp) runs each collective the repo uses and writes every rank's input
   and output; numpy recomputes each result from the inputs and the outputs must match BIT FOR BIT
   (IEEE addition in a fixed order is exact to specify, so there is no tolerance to hide behind),
   on the world's communicator, split ones and ones made from separate unique ids; the 3-rank run
   also cuts every array into 40-byte chunks, so the chunked path is the one tested there, and polls
   a group's sends and receives last first (LLMC_EMU_NCCL_POLL=reverse): two receives from one peer in
   one group must still get that peer's sends in issue order (their data received the other way round
   swapped the GPU trainer's activation and gradient under interleaved 1F1B on 2 stages, now and then).
   The checker is shown to fail on planted errors (a flipped bit, another rank's shard), and to
   tell rounding once from rounding every partial sum (what a real NCCL ring does).
2. NCCL's rules are enforced: ranks issuing different collectives, different counts, a send that no
   rank receives, a send and receive of different sizes, two ranks that both send before they
   receive (ungrouped: a real NCCL deadlock), a sendbuff at the wrong in-place position. Each must
   stop the run with a non-zero exit and a message saying what happened, within seconds, not hang.
   The grouped ring of (1) is the positive twin of the ungrouped deadlock.
"""
import glob, os, shutil, subprocess, sys, tempfile, time
from checks import report, exit_code
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DRIVER = os.path.join(ROOT, "build", "emu", "nccl_standin_check")
SOURCES = [os.path.join(ROOT, "test", "emu", f) for f in ("nccl_standin.cpp", "nccl_standin_check.cpp")]
TYPES = {1: np.uint8, 7: np.float32, 8: np.float64, 9: np.uint16}  # ncclDataType_t -> storage (9 = bf16)
SUM, MAX = 0, 2
STALL_TIMEOUT_S = 2  # the stand-in's deadline in the negative controls


def find_nccl_header():
    cuda = os.environ.get("CUDA_HOME", "/usr/local/cuda")
    for d in (os.path.join(cuda, "include"), "/usr/include"):
        if os.path.exists(os.path.join(d, "nccl.h")):
            return d
    return None


def build(include):
    """build/emu/nccl_standin.o by make (the rule the emulated trainer links), the driver here."""
    p = subprocess.run(["make", "-s", "build/emu/nccl_standin.o"], cwd=ROOT, capture_output=True, text=True)
    if p.returncode != 0:
        return p.stdout + p.stderr
    obj = os.path.join(ROOT, "build", "emu", "nccl_standin.o")
    if os.path.exists(DRIVER) and os.path.getmtime(DRIVER) > max(os.path.getmtime(f) for f in SOURCES + [obj]):
        return None
    p = subprocess.run(["mpicxx", "-std=c++17", "-O2", "-Wall", f"-I{include}", f"-I{ROOT}", SOURCES[1], obj, "-o", DRIVER],
                       cwd=ROOT, capture_output=True, text=True)
    return None if p.returncode == 0 else p.stdout + p.stderr


def mpirun(ranks, *args, env=None, guard=60):
    cmd = ["timeout", str(guard), "mpirun", "--allow-run-as-root", "--oversubscribe", "-np", str(ranks), DRIVER, *args]
    start = time.time()
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=dict(os.environ, **(env or {})))
    return p.returncode, p.stdout + p.stderr, time.time() - start


# ---- the references

def widen(x, t):
    """bf16 (stored as uint16) -> float32; other types as they are."""
    return (x.astype(np.uint32) << 16).view(np.float32) if t == 9 else x


def round_bf16(x):
    """float32 -> bf16 bits, to nearest, ties to even (the inputs hold no NaN)."""
    bits = x.view(np.uint32).astype(np.uint64)
    return ((bits + 0x7FFF + ((bits >> 16) & 1)) >> 16).astype(np.uint16)


def reduce(inputs, t, op, round_every_step=False):
    """The stand-in's contract: combine in rank order in fp32 (fp64 for fp64), round bf16 once."""
    combine = np.add if op == SUM else np.maximum
    acc = widen(inputs[0], t).copy()
    for x in inputs[1:]:
        acc = combine(acc, widen(x, t))
        if round_every_step and t == 9:
            acc = widen(round_bf16(acc), t)
    return round_bf16(acc) if t == 9 else acc


def load(directory):
    """{(case, group): {'kind', 'type', 'op', 'count', 'root', 'in': [...], 'out': [...], 'world': [...]}}"""
    cases = {}
    for path in glob.glob(os.path.join(directory, "manifest.*")):
        for line in open(path):
            name, kind, t, op, count, root, group, rank, ranks, world_rank, in_place = line.split()
            t, rank, ranks = int(t), int(rank), int(ranks)
            c = cases.setdefault((name, group), {"kind": kind, "type": t, "op": int(op), "count": int(count),
                                                 "root": int(root), "ranks": ranks, "in": [None] * ranks,
                                                 "out": [None] * ranks, "world": [None] * ranks})
            stem = os.path.join(directory, f"{name}.{group}.{rank}")
            c["in"][rank] = np.fromfile(stem + ".in", dtype=TYPES[t])
            c["out"][rank] = np.fromfile(stem + ".out", dtype=TYPES[t])
            c["world"][rank] = int(world_rank)
    return cases


def verify(c):
    """'' if every rank's output is what the reference says, else what is wrong."""
    n, ranks, t = c["count"], c["ranks"], c["type"]
    if any(x is None for x in c["out"]):
        return "not every rank of the communicator reported"
    for r in range(ranks):
        out = c["out"][r]
        if c["kind"] == "all_reduce":
            want = reduce(c["in"], t, c["op"])
        elif c["kind"] == "reduce":
            want = reduce(c["in"], t, c["op"]) if r == c["root"] else (c["in"][r] if len(out) else out)
        elif c["kind"] == "reduce_scatter":
            want = reduce(c["in"], t, c["op"])[r * n:(r + 1) * n]
        elif c["kind"] == "all_gather":
            want = np.concatenate(c["in"])
        elif c["kind"] == "broadcast":
            want = c["in"][c["root"]]
        else:  # shift: rank r received what rank r - root sent
            want = c["in"][(r - c["root"]) % ranks]
        if out.tobytes() != want.tobytes():
            bad = int(np.argmax(out != want)) if len(out) == len(want) else -1
            return f"rank {r}: {len(out)} elements, element {bad} is {out[bad] if bad >= 0 else '?'}, expected " \
                   f"{want[bad] if bad >= 0 else len(want)}"
    return ""


EXPECTED = ["allreduce_sum_f32", "allreduce_sum_f32_inplace", "allreduce_sum_bf16_inplace", "allreduce_sum_bf16",
            "allreduce_sum_f64", "allreduce_max_f32_inplace", "allreduce_max_bf16", "allreduce_empty",
            "reduce_sum_bf16_inplace_to_last", "reduce_sum_f32_to_0", "reducescatter_sum_bf16_inplace",
            "reducescatter_sum_f32", "allgather_f64_inplace", "allgather_bf16", "broadcast_f32_from_last", "broadcast_u8_inplace", "grouped_reduce_a", "grouped_reduce_b",
            "grouped_reduce_c", "ring_forward", "ring_backward", "pair_first", "pair_second", "split_allreduce_sum_f32", "split_allgather_f32",
            "nocolor_allreduce_sum_bf16", "byid_allgather_f64_inplace"]


def check_collectives(ranks, work, env):
    directory = os.path.join(work, f"np{ranks}")
    os.makedirs(directory)
    code, out, seconds = mpirun(ranks, "collectives", directory, env=env)
    label = f"nccl stand-in, {ranks} ranks" + (", 40-byte chunks, polled last first" if env else "")
    if code != 0 or "collectives done" not in out:
        report(False, f"{label}: the collectives run", f"exit code {code}:\n{out[-3000:]}")
        return None
    report("non-blocking init answered ncclInProgress" in out,
           f"{label}: a non-blocking communicator's init answers ncclInProgress, then settles", out[-500:])
    cases = load(directory)
    names = {name for name, _ in cases}
    report(names == set(EXPECTED), f"{label}: every case ran", f"missing {sorted(set(EXPECTED) - names)}")
    for (name, group), c in sorted(cases.items()):
        why = verify(c)
        report(not why, f"{label}: {name} on {group} ({c['ranks']} ranks) equals numpy bit for bit", why)
    # The split's key was -world rank: its ranks come in the reverse of the world's order.
    order_ok = all(c["world"] == sorted(c["world"], reverse=True) for (name, g), c in cases.items() if g.startswith("split"))
    report(order_ok, f"{label}: ncclCommSplit orders ranks by key",
           str([c["world"] for (name, g), c in cases.items() if g.startswith("split")]))
    return cases


def check_checker(cases3):
    """The comparison can fail: planted errors are caught, and rounding once is told from rounding per hop."""
    c = cases3[("allreduce_sum_bf16_inplace", "world")]
    flipped = dict(c, out=[x.copy() for x in c["out"]])
    flipped["out"][1][500] ^= 1
    c2 = cases3[("reducescatter_sum_f32", "world")]
    swapped = dict(c2, out=[c2["out"][0]] + c2["out"][1:])
    swapped["out"][1] = c2["out"][0]
    report(verify(flipped) != "" and verify(swapped) != "",
           "negative control: the checker catches a flipped bit and another rank's reduce-scatter shard",
           f"flipped: '{verify(flipped)}', swapped: '{verify(swapped)}'")
    once, per_hop = reduce(c["in"], 9, SUM), reduce(c["in"], 9, SUM, round_every_step=True)
    differ = int(np.sum(once != per_hop))
    report(differ > 0 and verify(c) == "",
           f"the 3-rank bf16 all-reduce rounds once: {differ} of {len(once)} elements differ from rounding every "
           f"partial sum (a real NCCL ring's way), so tests across rank counts need tolerances", f"{differ} differ")


# Each: the driver's mode, what the message must say.
NEGATIVE = [
    ("different-collectives", "rank 0 called ncclAllReduce(count 8, float32, sum), rank 1 called ncclAllGather"),
    ("different-counts", "rank 1 called ncclAllReduce(count 9"),
    ("unmatched-send", "ncclSend(count 64, uint8) to rank 1 was not received within"),
    ("size-mismatch", "ncclRecv(count 60, uint8) from rank 0 met rank 0's ncclSend(count 64, uint8)"),
    ("send-before-recv", "must group each send with the receive"),
    ("overlap", "sendbuff overlaps recvbuff but is not at its in-place position"),
]


def check_negative_controls():
    for mode, message in NEGATIVE:
        code, out, seconds = mpirun(2, mode, env={"LLMC_EMU_NCCL_TIMEOUT": str(STALL_TIMEOUT_S)}, guard=40)
        ok = code not in (0, 124) and message in out and seconds < 20
        report(ok, f"negative control: {mode} stops the run with a message ({seconds:.1f} s)",
               f"exit code {code} after {seconds:.1f} s, message {'found' if message in out else 'missing'}:\n{out[-2000:]}")


def main():
    missing = [tool for tool in ("mpirun", "mpicxx") if not shutil.which(tool)]
    include = find_nccl_header()
    if missing:
        print(f"SKIP: nccl stand-in ({' and '.join(missing)} not installed: apt-get install openmpi-bin libopenmpi-dev)")
        return 0
    if not include:
        print("SKIP: nccl stand-in (no nccl.h in $CUDA_HOME/include or /usr/include: install the CUDA toolkit or libnccl-dev)")
        return 0
    error = build(include)
    if error:
        report(False, "nccl stand-in builds", error[-3000:])
        return 1
    work = tempfile.mkdtemp(prefix="emu_nccl_")
    try:
        check_collectives(2, work, None)
        cases3 = check_collectives(3, work, {"LLMC_EMU_NCCL_CHUNK_BYTES": "40", "LLMC_EMU_NCCL_POLL": "reverse"})
        if cases3:
            check_checker(cases3)
        check_negative_controls()
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
