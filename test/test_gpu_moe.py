#!/usr/bin/env python3
"""test_gpu_moe.py — the GPU's mixture-of-experts kernels (llmc/kernels/moe.cuh) against the CPU
trainer's MoE layer (llmc/model/moe.h), under the CPU emulation of CUDA (test/emu/).

test/emu_moe_check.cu runs one forward and one backward of a whole MoE layer through the GPU kernels
and through cpu::moe_forward / cpu::moe_backward on the same bf16 inputs, and compares every
intermediate: the routing and the drops exactly (choices, rows, counts, the token of each row: the
inputs hold exact ties between two experts, which both must give to the lower index), the router's
fp32 outputs and both auxiliary losses within 1e-5, and the bf16 values (expert outputs, y, every
gradient) within 1e-2 relative L2 (measured ~3.6e-3: a few bf16 roundings in a row). Four scenarios:
top-1 and top-2, with no dropping and with a capacity factor that binds; an expert gets no token.
And E = 1 (top-1, no dropping, no z-loss): also the GPU's own dense MLP, bit for bit.

  1. every scenario passes under three schedules of the emulated threads and blocks (forward,
     reverse, random), with bit-identical outputs: the dispatch is a scan, not atomics, so its order
     cannot depend on which thread runs first
  2. planted bugs in copies of the real kernels, each caught (the check names the tensor):
     a tie broken towards the higher index, capacity counted token by token instead of first
     choices before second ones, the router's backward reading the wrong token's gate gradients,
     the un-permute forgetting the router's share of dx, and the gates scaled by 1.004 (within
     every tolerance against the CPU: only E = 1's bit-for-bit equality with the dense MLP sees it).
     The router's per-token gradient formula is the CPU's own function (moe.h's
     moe_router_grad_token), so a bug in it is the CPU's too: test_moe.py's float64 reference
     catches those.

Built as test_emu_negative_controls.py builds its checks (cu2cpp.py, g++ -O1, the emulator's
objects); without CUDA's headers it says why and skips. About 60 s on the shared 2-core machine
(six builds of the check program, ~7 s each, and their runs).
"""
import os, sys, tempfile, time
from checks import report, exit_code
import test_emu_negative_controls as emu

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECK = "test/emu_moe_check.cu"
KERNELS = "llmc/kernels/moe.cuh"

# (name, file, original text, mutated text, the scenario that must catch it); texts keep line counts
MUTATIONS = [
    ("a tie broken towards the higher expert index (>= for > in the router's top-1)", KERNELS,
     "for (int e = 1; e < E; e++) if (p[e] > p[best]) best = e;",
     "for (int e = 1; e < E; e++) if (p[e] >= p[best]) best = e;", "top1"),
    ("capacity counted token by token (choice j of token t at t k + j) instead of all first choices first",
     KERNELS, "{ return (a % N) * k + a / N; }", "{ return a; }", "top2_capacity"),
    ("the router's backward reading token t's gate gradients at t instead of t k (top-2)", KERNELS,
     "r.dgate + (size_t)t * k, r.routed", "r.dgate + (size_t)t, r.routed", "top2"),
    ("the un-permute without the router's share of dx (dlogits W_r)", KERNELS,
     "out[v] = from_float<floatX>(acc[v] + router_dx[v]);", "out[v] = from_float<floatX>(acc[v]);", "top1"),
    ("the gates scaled by 1.004 in the combine (inside every tolerance of the CPU; E = 1 is no longer the dense bits)",
     KERNELS, "float g = gate ? gate[(size_t)t * k + j] : 1.0f;", "float g = gate ? gate[(size_t)t * k + j] * 1.004f : 1.0f;",
     "e1_dense"),
]


def main():
    inc = emu.cuda_include()
    if not inc:
        print("SKIP: GPU MoE kernels (CUDA's headers not found: the emulation needs cuda_runtime.h; set CUDA_INCLUDE)",
              flush=True)
        return 0
    why = emu.make_objects()
    if why:
        print(f"SKIP: GPU MoE kernels ({why})", flush=True)
        return 0
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="gpu_moe_") as tmp:
        exe, why = emu.build(os.path.join(tmp, "base"), inc, checks=CHECK)
        if not exe:
            report(False, "the MoE kernel checks build against the emulator", why)
            return exit_code()
        bits = {}
        for s in emu.SCHEDULES:
            ok, out = emu.run(exe, None, s)
            report(ok, f"MoE kernels agree with llmc/model/moe.h under schedule {s}"
                   + (": " + "; ".join(l[3:].split(" bits ")[0] for l in out if l.startswith("ok ")) if ok else ""),
                   "" if ok else out)
            if ok:
                bits[s] = [l.split(" bits ")[-1] for l in out if l.startswith("ok ")]
        if len(bits) == len(emu.SCHEDULES):
            report(all(b == bits[emu.SCHEDULES[0]] for b in bits.values()),
                   "MoE kernels give the same bits under " + ", ".join(emu.SCHEDULES),
                   "outputs differ between schedules: a race " + str(bits))
        for i, m in enumerate(MUTATIONS):
            name, scenario = m[0], m[4]
            exe, why = emu.build(os.path.join(tmp, f"m{i}"), inc, m, checks=CHECK)
            if not exe:
                report(False, f"not caught: {name}", why)
                continue
            ok, how = emu.run(exe, scenario, emu.SCHEDULES[0])
            report(not ok, f"caught: {name} ({how})" if not ok else f"not caught: {name}",
                   f"scenario {scenario} still passes")
    print(f"GPU MoE kernels: {len(MUTATIONS)} planted bugs in {time.time() - start:.0f} s", flush=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
