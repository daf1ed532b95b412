#!/usr/bin/env python3
"""test_emu_negative_controls.py — the CPU emulation of CUDA (test/emu/) can fail: planted bugs in
copies of the REAL kernels of llmc/ are each caught.

An emulator under which every test passes proves nothing unless it is shown to fail on broken code.
Each control below copies llmc/ and test/emu_kernel_checks.cu (real kernels against float64
references) to a temporary folder, changes one small piece of text (the text must occur exactly once,
so a control cannot silently stop mutating when the kernel changes: it fails and says so), builds the
checks against the emulator as test/emu/emu.mk builds the trainer (cu2cpp.py, g++ -O1, the runtime
and the cuBLASLt stand-in from build/emu/), and runs the check that should catch it under three
schedules of the threads and blocks: forward, reverse and random:SEED (CUDA_EMU_THREADS and
CUDA_EMU_BLOCKS). A control passes when the unmutated build passes every check under every schedule
and the mutated one is caught as stated:

  caught under every schedule   a bug that does not depend on timing must not depend on luck
  caught under some, not all    a race: it passes under one order of the threads and fails under
                                another, which is why every emulated test runs under two (issue 14,
                                item 4); the control asserts both halves
Caught means: a value out of the check's tolerance (NaN included: new device and shared memory is
filled with NaN), or the emulator stopping the run with its message (guard page, launch checks,
shuffle masks), or a CUDA call failing on the error the emulator returned. The PASS line names which.

Also checked: the unmutated build's outputs are bit-identical under all three schedules (the kernels
are deterministic; a difference would be a race).

Needs CUDA's headers and the emulator's objects (`make build/emu/cuda_emu_runtime.o
build/emu/cublas_standin.o`, which this test runs); without them it says why and skips. About 30 s.
"""
import os, re, shutil, subprocess, sys, tempfile, time
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CHECKS = "test/emu_kernel_checks.cu"
EMU_OBJECTS = ["build/emu/cuda_emu_runtime.o", "build/emu/cublas_standin.o"]
SCHEDULES = ["forward", "reverse", "random:20251123"]


def cuda_include():
    for d in [os.environ.get("CUDA_INCLUDE"), os.path.join(os.environ.get("CUDA_HOME", "/nonexistent"), "include"),
              "/usr/local/cuda/include"]:
        if d and os.path.exists(os.path.join(d, "cuda_runtime.h")):
            return d
    return None


# ---------------------------------------------------------------------------------------------- mutations
# (name, file, original text, mutated text, the check that runs it, which schedules must catch it).
# A mutated text keeps the original's line count, so the emulator's file:line point at the original.
# `catch` is "all", or a dict {schedule: True/False} for the races (random's outcome is reported).

MUTATIONS = [
    ("a deleted __syncthreads in block_sum (llmc/kernels/cuda_common.cuh)", "llmc/kernels/cuda_common.cuh",
     "    __syncthreads();\n    v = lane < warps ? shared[lane] : T(0);",
     "    \n    v = lane < warps ? shared[lane] : T(0);", "classifier", "all"),
    ("a wrong shuffle offset in warp_sum's butterfly (16 -> 8: half the warp summed)", "llmc/kernels/cuda_common.cuh",
     "for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync",
     "for (int offset = 8; offset > 0; offset >>= 1) v += __shfl_xor_sync", "layernorm_forward", "all"),
    ("an off-by-one loop bound c <= C in the LayerNorm forward's output loop (C=768: reads past the weight)",
     "llmc/kernels/layernorm.cuh",
     "    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {\n"
     "        x128 x8 = load128(x + c), w8 = load128(weight + c)",
     "    for (int c = lane * x128::size; c <= C; c += 32 * x128::size) {\n"
     "        x128 x8 = load128(x + c), w8 = load128(weight + c)", "layernorm_forward_768", "all"),
    ("an off-by-one loop bound c <= C within an allocation's padding to 256 bytes (C=64: the weight is 128 "
     "bytes; the last row's output lands past the end of its buffer)", "llmc/kernels/layernorm.cuh",
     "    for (int c = lane * x128::size; c < C; c += 32 * x128::size) {\n"
     "        x128 x8 = load128(x + c), w8 = load128(weight + c)",
     "    for (int c = lane * x128::size; c <= C; c += 32 * x128::size) {\n"
     "        x128 x8 = load128(x + c), w8 = load128(weight + c)", "layernorm_forward_64", "all"),
    ("an off-by-one c + k <= V in the classifier (the first padding logit joins the softmax)",
     "llmc/kernels/fused_classifier.cuh", "k < x128::size && c + k < V; k++) {", "k < x128::size && c + k <= V; k++) {",
     "classifier", "all"),
    ("a missing shared-memory opt-in (cudaFuncSetAttribute deleted; LayerNorm backward at C=6400 needs 50 KiB)",
     "llmc/kernels/layernorm.cuh",
     "        CUDA_CHECK(cudaFuncSetAttribute(layernorm_backward_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)shared));",
     "        (void)0;", "layernorm_backward_6400", "all"),
    ("a wrong cuBLASLt transpose (matmul_forward's transa flipped)", "llmc/kernels/matmul.cuh",
     "bias, nullptr, OC, N,\n                    IC, true, false, false, stream);",
     "bias, nullptr, OC, N,\n                    IC, false, false, false, stream);", "matmul", "all"),
    ("exited lanes named in a shuffle mask (LayerNorm forward's lanes without channels return early; C=64)",
     "llmc/kernels/layernorm.cuh", "    if (row >= N) return;", "    if (row >= N || lane * x128::size >= C) return;",
     "layernorm_forward_64", "all"),
    ("a block of 2048 threads (CLASSIFIER_THREADS = 2048)", "llmc/kernels/fused_classifier.cuh",
     "constexpr int CLASSIFIER_THREADS = 512;", "constexpr int CLASSIFIER_THREADS = 2048;", "classifier", "all"),
    ("a launch over the kernel's __launch_bounds__(512) (the classifier launched with 1024 threads)",
     "llmc/kernels/fused_classifier.cuh", "fused_classifier_kernel<<<N, CLASSIFIER_THREADS, 0, stream>>>",
     "fused_classifier_kernel<<<N, 1024, 0, stream>>>", "classifier", "all"),
    ("uninitialised shared memory (the LayerNorm backward's group 0 adds to the column sums instead of "
     "starting them)", "llmc/kernels/layernorm.cuh",
     "                out[c + k] = g == 0 ? dw[k] : acc[c + k] + dw[k];",
     "                out[c + k] = acc[c + k] + dw[k];", "layernorm_backward", "all"),
    ("uninitialised device memory (the residual never stored, then read back for the statistics)",
     "llmc/kernels/layernorm.cuh", "            store128(r + c, r8);", "            ;", "layernorm_forward", "all"),
    ("a race: the classifier's __syncthreads before the in-place gradient deleted (z[target] overwritten "
     "before thread 0 reads it)", "llmc/kernels/fused_classifier.cuh",
     "    __syncthreads();  // thread 0 read z[target] above; it is about to be overwritten", "    ;",
     "classifier", {"forward": False, "reverse": True}),
    ("a race: the bias gradient's __syncthreads deleted (row 0 of the block sums the others' partials)",
     "llmc/kernels/matmul.cuh", "    __syncthreads();\n    if (threadIdx.y == 0 && c < OC) {",
     "    \n    if (threadIdx.y == 0 && c < OC) {", "matmul", {"forward": True, "reverse": False}),
    ("bf16 moments rounded to nearest, not stochastically (issue 25: v stuck at 1 under beta2 = 0.999, g = 0)",
     "llmc/optim/adamw_bf16.cuh", "adamw_bf16_store(&m4.v[k], &v4.v[k], mk, vk, step_key, slice_global_index(keys, index + k));",
     "m4.v[k] = float_to_bf16_round_nearest(mk), v4.v[k] = float_to_bf16_round_nearest(vk);", "adamw_bf16", "all"),
]


# ---------------------------------------------------------------------------------------------- build, run

def sources(checks=CHECKS):
    """The files the checks program includes, relative to ROOT."""
    llmc = sorted(os.path.relpath(os.path.join(d, f), ROOT) for d, _, files in os.walk(os.path.join(ROOT, "llmc"))
                  for f in files if f.endswith((".cuh", ".h")))
    return [checks] + llmc


def build(work, inc, mutation=None, checks=CHECKS):
    """Copy the sources to work/orig (mutated), rewrite them with cu2cpp into work/src, compile.
    Returns (the program, None) or (None, why). `checks`: the program (test/test_gpu_moe.py builds
    test/emu_moe_check.cu the same way)."""
    orig, src = os.path.join(work, "orig"), os.path.join(work, "src")
    for rel in sources(checks):
        os.makedirs(os.path.dirname(os.path.join(orig, rel)), exist_ok=True)
        shutil.copyfile(os.path.join(ROOT, rel), os.path.join(orig, rel))
    if mutation:
        _, rel, old, new = mutation[:4]
        path = os.path.join(orig, rel)
        text = open(path).read()
        count = text.count(old)
        if count != 1:
            return None, (f"the text to mutate occurs {count} times in {rel}, not once: the kernel changed, "
                          f"update this control to mutate it again ({old.strip()[:60]!r})")
        assert old.count("\n") == new.count("\n")
        open(path, "w").write(text.replace(old, new))
    # run from orig, so the #line directives (and the emulator's messages) say llmc/..., not a temp path
    subprocess.run([sys.executable, os.path.join(ROOT, "test/emu/cu2cpp.py"), ".", src] + sources(checks), cwd=orig,
                   check=True)
    exe = os.path.join(work, os.path.splitext(os.path.basename(checks))[0])
    # the flags of test/emu/emu.mk's EMU_FLAGS and EMU_KERNEL (no MPI: these checks make no NCCL call)
    cmd = ["g++", "-std=c++17", "-O1", "-g0", "-fno-strict-aliasing", "-Wno-attributes", "-I" + src, "-I" + ROOT,
           "-I" + inc, "-x", "c++", "-include", os.path.join(ROOT, "test/emu/cuda_emu.h"),
           os.path.join(src, checks), "-x", "none"] + [os.path.join(ROOT, o) for o in EMU_OBJECTS] + ["-o", exe]
    p = subprocess.run(cmd, cwd=orig, capture_output=True, text=True)
    if p.returncode != 0:
        return None, "does not compile: " + " | ".join(p.stderr.strip().splitlines()[:3])
    return exe, None


def run(exe, check, schedule):
    """(passed, how): how is the first line that says what went wrong, or the passing lines."""
    env = dict(os.environ, CUDA_EMU_THREADS=schedule, CUDA_EMU_BLOCKS=schedule)
    args = [exe] + ([check] if check else [])
    try:
        p = subprocess.run(args, capture_output=True, text=True, env=env, timeout=120)
    except subprocess.TimeoutExpired:
        return False, "timed out after 120 s (a hang)"
    lines = (p.stdout + p.stderr).splitlines()
    if p.returncode == 0 and not any(l.startswith("wrong ") for l in lines):
        return True, lines
    # the emulator's own message first (with the kernel and thread it names), then a wrong value,
    # then a CUDA call that failed; a crash with none of them says its exit code
    for prefix in ("CUDA emulator:", "wrong ", "error:"):
        for i, l in enumerate(lines):
            if l.startswith(prefix):
                how = l
                if prefix == "CUDA emulator:" and i + 1 < len(lines) and lines[i + 1].startswith("  in "):
                    how += ";" + lines[i + 1][4:]
                return False, how
    return False, f"exit code {p.returncode}, no message"


def make_objects():
    """Builds the emulator's objects; None, or why they do not build (the caller skips)."""
    mk = subprocess.run(["make", "-s"] + EMU_OBJECTS, cwd=ROOT, capture_output=True, text=True)
    if mk.returncode == 0:
        return None
    return "the emulator's objects do not build: " + (mk.stderr.strip().splitlines() or ["make failed"])[-1]


def main():
    inc = cuda_include()
    if not inc:
        print("SKIP: emulator negative controls (CUDA's headers not found: the emulation needs cuda_runtime.h; "
              "set CUDA_INCLUDE)", flush=True)
        return 0
    why = make_objects()
    if why:
        print(f"SKIP: emulator negative controls ({why})", flush=True)
        return 0
    start = time.time()
    with tempfile.TemporaryDirectory(prefix="emu_negctl_") as tmp:
        exe, why = build(os.path.join(tmp, "base"), inc)
        if not exe:
            report(False, "unmutated kernel checks build against the emulator", why)
            return 1
        bits, base_ok = {}, True
        for s in SCHEDULES:
            ok, out = run(exe, None, s)
            if not ok:
                report(False, f"unmutated kernels pass under {s}", out)
                base_ok = False
                continue
            bits[s] = [l.split(" bits ")[-1] for l in out if l.startswith("ok ")]
            report(True, f"unmutated kernels pass under {s} ({len(bits[s])} checks; "
                         + "; ".join(l[3:].split(" bits ")[0] for l in out if l.startswith("ok ")) + ")")
        if base_ok:
            same = all(bits[s] == bits[SCHEDULES[0]] for s in SCHEDULES)
            report(same, "unmutated kernels give the same bits under " + ", ".join(SCHEDULES),
                   "outputs differ between schedules: a race in an unmutated kernel " + str(bits))
        if not base_ok:
            print("FAIL: negative controls: not run, the unmutated kernels do not pass", flush=True)
            return 1

        for i, m in enumerate(MUTATIONS):
            name, _, _, _, check, catch = m
            exe, why = build(os.path.join(tmp, f"m{i}"), inc, m)
            if not exe:
                report(False, f"not caught: {name}", why)
                continue
            results = {s: run(exe, check, s) for s in SCHEDULES}
            caught = {s: not results[s][0] for s in SCHEDULES}
            hows = {s: results[s][1] for s in SCHEDULES if caught[s]}
            if catch == "all":
                missed = [s for s in SCHEDULES if not caught[s]]
                how = hows[SCHEDULES[0]] if caught[SCHEDULES[0]] else next(iter(hows.values()), "")
                if missed:
                    report(False, f"not caught: {name}", f"passes under {', '.join(missed)}"
                           + (f" (caught under the others: {how})" if hows else ""))
                else:
                    report(True, f"caught: {name} (under every schedule: {how})")
                continue
            wrong = [s for s, want in catch.items() if caught[s] != want]
            by = [s for s in SCHEDULES if caught[s]]
            passes = [s for s in SCHEDULES if not caught[s]]
            if wrong or not by:
                report(False, f"not caught: {name}",
                       f"expected caught under {[s for s, w in catch.items() if w]} and passing under "
                       f"{[s for s, w in catch.items() if not w]}; caught under {by or 'none'}"
                       + (" (caught under every schedule now: if the emulator got stricter, that is progress, "
                          "update this control)" if not passes else ""))
            else:
                report(True, f"caught: {name} (passes under {', '.join(passes)}; caught under {', '.join(by)}: "
                             f"{hows[by[0]]})")
    print(f"negative controls: {len(MUTATIONS)} mutations in {time.time() - start:.0f} s", flush=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
