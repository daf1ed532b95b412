#!/usr/bin/env python3
"""test_lease.py — scripts/gpu_lease.sh, the one-call GPU lease, checked without a GPU.

The script runs on a GPU machine only a few times a year, so its logic is checked here with stand-ins
on a copy of scripts/: a fake nvidia-smi, a fake prepared .lease/ whose train_gpt offers some of the
precisions, and a fake Python that answers for the benchmark, the tests and the kernel lab.

  refusal     without a GPU, or without a prepared .lease/, one line and exit 1
  variants    the benchmark gets a train_gpt row for exactly the modes this train_gpt's --help offers
              (here --cuda-graphs and fp16, not fp8), and llm.c when its binary was prepared
  goals       issue 28's goals read off the d12 B=16 table: MFU, the ratio to PyTorch eager and to
              llm.c, each "met" or "NOT met" against its threshold
  summary     summary.md holds the GPU, the commit and every benchmark table; logs.tar.gz comes back
  budget      a phase the time left cannot hold is skipped, named, and the later ones with it
"""
import os, shutil, stat, subprocess, tarfile, tempfile
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TABLE = """GPU: NVIDIA H200, 580.00, 143771 MiB
d12 (L=12 C=768 H=12, 124.4M parameters), B=16 T=1024, 12.8 TFLOP per step

| trainer | ms/step | tokens/s | MFU | peak memory | train_gpt's speed-up |
|---|---:|---:|---:|---:|---:|
| train_gpt (this project) | 25.0 | 655,360 | {mfu}% | 8.07 GiB | 1.00x |
| train_gpt graphs | 24.0 | 682,666 | 53.9% | 8.07 GiB | 0.96x |
| PyTorch eager | 43.5 | 376,440 | 30.6% | 16.05 GiB | {eager}x |
| llm.c train_gpt2cu (cuDNN) | 31.3 | 524,036 | 42.6% | 7.60 GiB | {llmc}x |
"""


def executable(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


def setup(tmp, mfu, eager, llmc, with_llmc=True):
    """A repository copy with scripts/, a prepared .lease/ and the stand-ins; returns (root, env, calls)."""
    root = os.path.join(tmp, "repo")
    shutil.copytree(os.path.join(ROOT, "scripts"), os.path.join(root, "scripts"))
    os.makedirs(os.path.join(root, ".lease", "bin"))
    executable(os.path.join(root, ".lease", "bin", "train_gpt"),
               "#!/bin/sh\necho '  --precision NAME   bf16 | fp16 | fp32'\necho '  --cuda-graphs      capture the step'\n")
    if with_llmc:
        os.makedirs(os.path.join(root, ".lease", "llmc"))
        executable(os.path.join(root, ".lease", "llmc", "train_gpt2cu_cudnn"), "#!/bin/sh\n")
    with open(os.path.join(root, ".lease", "commit.txt"), "w") as f:
        f.write("commit abc1234, prepared 2026-11-26 17:30 UTC\n")
    bin_dir = os.path.join(tmp, "bin")
    os.makedirs(bin_dir)
    executable(os.path.join(bin_dir, "nvidia-smi"), "#!/bin/sh\necho 'NVIDIA H200, 580.00, 143771 MiB'\n")
    calls = os.path.join(tmp, "calls")
    table = os.path.join(tmp, "table")
    with open(table, "w") as f:
        f.write(TABLE.format(mfu=mfu, eager=eager, llmc=llmc))
    executable(os.path.join(tmp, "python"), f"""#!/usr/bin/env bash
case "$1" in
  scripts/bench_gpu_vs_peers.py) printf '%s\\n' "$@" >> {calls}; echo ---- >> {calls}; cat {table} ;;
  test/run_tests.py) echo "   PASS: a GPU check"; echo "1 passed, 0 failed" ;;
  *) ;;
esac
""")
    env = dict(os.environ, PATH=bin_dir + os.pathsep + os.environ["PATH"], PYTHON=os.path.join(tmp, "python"),
               OUT=os.path.join(tmp, "out"))
    os.makedirs(env["OUT"])
    return root, env, calls


def run(root, env, budget=None):
    if budget is not None:
        env = dict(env, GPU_LEASE_BUDGET=str(budget))
    return subprocess.run(["bash", "scripts/gpu_lease.sh", "run"], cwd=root, env=env, capture_output=True, text=True,
                          timeout=300)


def main():
    tmp = tempfile.mkdtemp(prefix="llmc_lease_")
    try:
        # refusals
        root, env, _ = setup(os.path.join(tmp, "a"), 55.0, 1.74, 1.25)
        no_gpu = dict(env, PATH=os.environ["PATH"])
        p = run(root, no_gpu)
        report(p.returncode == 1 and "no GPU here" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
               "without a GPU: one line, exit 1", p.stderr)
        shutil.rmtree(os.path.join(root, ".lease", "bin"))
        p = run(root, env)
        report(p.returncode == 1 and "prepare" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
               "without a prepared .lease/: one line naming 'prepare', exit 1", p.stderr)

        # goals met, variants, summary
        root, env, calls = setup(os.path.join(tmp, "b"), 55.0, 1.74, 1.25)
        p = run(root, env)
        out = p.stdout
        first = open(calls).read().split("----\n")[0].splitlines()
        variants = [first[i + 1] for i, a in enumerate(first) if a == "--ours-variant"]
        report(variants == ["gelu-epilogues=--recompute 0", "fp16=--precision fp16", "graphs=--cuda-graphs"],
               "the d12 B=16 benchmark gets a row for --recompute 0 (GELU in cuBLASLt's epilogues) and for each mode "
               "train_gpt --help offers (fp16, graphs; no fp8)", str(first))
        report("--llmc" in first and "ours,pytorch,compile,llmc" in first,
               "llm.c's prepared binary joins the d12 B=16 benchmark, with torch.compile", str(first))
        goals = [line for line in out.splitlines() if line.startswith("GOAL")]
        want = ["GOAL  d12 B=16 MFU >= 50%: 55.0% met", "GOAL  d12 B=16 >= 1.5x PyTorch eager: 1.74x met",
                "GOAL  d12 B=16 >= 1.15x llm.c: 1.25x met"]
        report(goals[:3] == want, "goals read off the table: MFU, PyTorch eager, llm.c (all met)", "\n".join(goals))
        summary = open(os.path.join(env["OUT"], "summary.md")).read()
        report("NVIDIA H200" in summary and "commit abc1234" in summary and summary.count("| train_gpt (this project)") == 3,
               "summary.md: the GPU, the commit, and the three benchmarks' tables", summary[:600])
        with tarfile.open(os.path.join(env["OUT"], "logs.tar.gz")) as t:
            names = t.getnames()
        report(any(n.endswith("bench16.log") for n in names) and any(n.endswith("tests.log") for n in names),
               "logs.tar.gz holds every phase's log", str(names))

        # goals not met, llm.c absent
        root, env, calls = setup(os.path.join(tmp, "c"), 42.1, 1.38, 0.97, with_llmc=False)
        p = run(root, env)
        goals = [line for line in p.stdout.splitlines() if line.startswith("GOAL")]
        first = open(calls).read().split("----\n")[0].splitlines()
        report(goals[:2] == ["GOAL  d12 B=16 MFU >= 50%: 42.1% NOT met", "GOAL  d12 B=16 >= 1.5x PyTorch eager: 1.38x NOT met"]
               and "--llmc" not in first and "ours,pytorch,compile" in first,
               "goals NOT met at 42.1% and 1.38x; without a prepared llm.c, no llm.c peer", "\n".join(goals) + str(first))

        # the budget: with 50 s, the first phase (needs 60) and the tests are skipped, the others run
        root, env, _ = setup(os.path.join(tmp, "d"), 55.0, 1.74, 1.25)
        p = run(root, env, budget=50)
        skipped = [line.split(":")[0] for line in p.stdout.splitlines() if line.startswith("SKIP")]
        report(skipped[:2] == ["SKIP  bench16", "SKIP  tests"] and "PASS  bench64" in p.stdout,
               "a phase the time left cannot hold is skipped and named; the next that fits still runs", p.stdout[-800:])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    raise SystemExit(main())
