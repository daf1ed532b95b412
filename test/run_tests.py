#!/usr/bin/env python3
"""The test runner: runs every test and prints 'N passed, N failed'.

A test is a program: every `test/test_*.py`, `test/test_*.sh`, and every `build/test_*`
binary that `make` built from `test/test_*.cpp` / `test/test_*.cu`. Each prints one line per
check it makes:

    PASS: <name>
    FAIL: <name>: <why>
    SKIP: <name> (<why>)          e.g. 'SKIP: gpu logits (no GPU)'

and exits non-zero if any check failed. A program that exits non-zero without printing a
FAIL line (a crash, an uncaught error) counts as one failure. The summary counts checks, and says
how many of them checked the GPU code (test_gpu*, test_emu*, and test_vs_pytorch's gpu/ checks: on
the CUDA emulation without a GPU).

    python3 test/run_tests.py [substring ...]   run only the tests whose name contains one

Every test runs with LLMC_POISON_BUFFERS=1 (llmc/probes/poison.h): the CPU trainer's fresh buffers
start as NaN, as the emulated GPU's device memory does, so a pass that reads what nobody wrote
fails its test instead of reading the allocator's zeros. (LLMC_POISON_BUFFERS=0 in the environment
runs the tests without it.)
"""
import os, subprocess, sys, time, glob

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
POISON = os.environ.get("LLMC_POISON_BUFFERS", "1")  # the CPU trainer's fresh buffers as NaN (see above)


def discover():
    tests = []
    for path in sorted(glob.glob(os.path.join(ROOT, "test", "test_*.py"))):
        tests.append((os.path.basename(path), [sys.executable, path]))
    for path in sorted(glob.glob(os.path.join(ROOT, "test", "test_*.sh"))):
        tests.append((os.path.basename(path), ["bash", path]))
    for path in sorted(glob.glob(os.path.join(ROOT, "build", "test_*"))):
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            tests.append((os.path.basename(path), [path]))
    return tests


def is_gpu_test(name):
    return name.startswith("test_gpu") or name.startswith("test_emu")


def have_gpu():
    try:
        return subprocess.run(["nvidia-smi", "-L"], capture_output=True, timeout=60).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


def main():
    only = sys.argv[1:]
    tests = [t for t in discover() if not only or any(s in t[0] for s in only)]
    passed = failed = skipped = 0
    failures = []
    gpu_passed, gpu_seconds = 0, 0.0  # the GPU code's checks (test_gpu*, test_emu*), emulated without a GPU
    for name, cmd in tests:
        print(f"== {name}", flush=True)
        start = time.time()
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True, errors="replace", env=dict(os.environ, PYTHONUNBUFFERED="1", LLMC_POISON_BUFFERS=POISON))
        saw_fail = False
        for line in proc.stdout:
            sys.stdout.write("   " + line)
            sys.stdout.flush()
            if line.startswith("PASS:"):
                passed += 1
                gpu_passed += is_gpu_test(name) or line.startswith("PASS: gpu/")  # test_vs_pytorch's GPU trainer
            elif line.startswith("FAIL:"):
                failed += 1
                saw_fail = True
                failures.append(f"{name}: {line[5:].strip()}")
            elif line.startswith("SKIP:"):
                skipped += 1
        code = proc.wait()
        if code != 0 and not saw_fail:
            failed += 1
            failures.append(f"{name}: exited with code {code} without reporting a failure")
        seconds = time.time() - start
        gpu_seconds += seconds if is_gpu_test(name) else 0.0
        print(f"   ({seconds:.1f} s)", flush=True)
    if failures:
        print("\nFailures:")
        for f in failures:
            print("  " + f)
    if gpu_passed:
        where = "on the GPU" if have_gpu() else "on the CPU emulation of CUDA (test/emu/)"
        print(f"GPU code: {gpu_passed} checks passed {where} (test_gpu*, test_emu*: {gpu_seconds / 60:.1f} min)")
    if skipped:
        print(f"{skipped} skipped")
    print(f"{passed} passed, {failed} failed")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
