#!/usr/bin/env python3
"""test_run_scripts.py — scripts/gpt2.sh: the GPT-2 reproduction runs (124M, 350M, 774M, 1558M).

A stand-in trainer (a shell script that records its arguments) shows what the script runs:

  plan        each size prints and passes the GPT-3 paper's numbers: model, tokens per step, peak
              LR, warmup of 375M tokens, steps for 10B tokens, cosine to 10%, AdamW settings
  order       --estimate first, with the same flags and ranks; then training with --resume auto (so the same
              command starts fresh or resumes); extra flags reach the trainer last (they win)
  many GPUs   --gpus N goes through scripts/run_mpi_local.sh (mpirun -np N) and the micro-batches
              are accumulated to the same tokens per step
  refusals    an unknown size, a micro-batch that does not divide the batch, missing data, a
              failing estimate: a clear message, and no training started
  the real    with ./train_gpt built (nvcc, no GPU needed), --dry-run prints its real estimate
  estimate
  as written  every scripts/X the docs (README.md, docs/*.md) name exists and, with a #! line, is
              executable; every script importing numpy, torch or matplotlib has #!/usr/bin/python3
"""
import glob, os, re, shutil, stat, subprocess, sys, tempfile
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "gpt2.sh")


def executable(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


def flag(args, name):
    return args[args.index(name) + 1] if name in args else None


def main():
    tmp = tempfile.mkdtemp(prefix="llmc_scripts_")
    calls = os.path.join(tmp, "calls")
    fake = os.path.join(tmp, "fake_trainer")
    executable(fake, f"""#!/usr/bin/env bash
printf '%s\\n' "$@" > {calls}.$(ls {tmp} | grep -c '^calls\\.')
for a in "$@"; do [ "$a" = --estimate ] && {{ echo "estimate: fits"; [ -n "${{FAKE_ESTIMATE_FAIL:-}}" ] && exit 1; exit 0; }}; done
echo "training"
""")
    fake_mpirun = os.path.join(tmp, "fake_mpirun")
    executable(fake_mpirun, f"""#!/usr/bin/env bash
printf '%s\\n' "$@" > {tmp}/mpirun_args
""")
    shard = os.path.join(tmp, "fineweb_train_000001.bin")
    open(shard, "wb").close()
    env = dict(os.environ, TRAINER=fake, TRAIN_DATA=os.path.join(tmp, "fineweb_train_*.bin"), OUT_DIR=os.path.join(tmp, "out"))

    def call(args, extra_env=None):
        for f in os.listdir(tmp):
            if f.startswith("calls."):
                os.remove(os.path.join(tmp, f))
        p = subprocess.run(["bash", SCRIPT] + args, capture_output=True, text=True, env=dict(env, **(extra_env or {})), cwd=tmp)
        recorded = []
        for i in range(3):
            path = f"{calls}.{i}"
            if os.path.exists(path):
                recorded.append(open(path).read().split("\n")[:-1])
        return p, recorded

    # ---- the plan of every size (GPT-3 Table 2.1's batch and LR; 10B tokens; warmup 375M tokens)
    expected = {"124M": ("d12", "524288", "6e-4", "19073", "715", "64"), "350M": ("d24", "524288", "3e-4", "19073", "715", "32"),
                "774M": ("d36", "524288", "2.5e-4", "19073", "715", "32"), "1558M": ("d48", "1048576", "2e-4", "9536", "357", "16")}
    for size, (model, batch, lr, steps, warmup, micro) in expected.items():
        p, rec = call([size, "--dry-run"])
        est = rec[0] if rec else []
        accumulation = int(batch) // (int(micro) * 1024)
        ok = (p.returncode == 0 and len(rec) == 1 and "--estimate" in est and flag(est, "--model") == model
              and flag(est, "--total-batch-tokens") == batch and flag(est, "--lr") == lr and flag(est, "--steps") == steps
              and flag(est, "--warmup-steps") == warmup and flag(est, "--batch-size") == micro and flag(est, "--seq-len") == "1024"
              and flag(est, "--final-lr-fraction") == "0.1" and flag(est, "--weight-decay") == "0.1" and flag(est, "--beta2") == "0.95"
              and flag(est, "--grad-clip") == "1.0" and flag(est, "--lr-schedule") == "cosine"
              and f"{batch} tokens per step = {micro} sequences x 1024 tokens x 1 GPU(s) x {accumulation} accumulation" in p.stdout
              and f"steps       {steps}, linear warmup {warmup} steps" in p.stdout and "estimate: fits" in p.stdout
              and "dry run: not training" in p.stdout)
        report(ok, f"{size}: the plan ({model}, {batch} tokens/step, lr {lr}, {steps} steps, warmup {warmup}) is printed and "
               "passed to --estimate; --dry-run trains nothing", p.stdout[-1200:] + p.stderr + str(rec))

    # ---- a real launch: estimate first, then training with --resume auto; extra flags last
    p, rec = call(["124M", "--steps", "10"], {"HELLASWAG": "hs.jsonl"})
    ok = (p.returncode == 0 and len(rec) == 2 and "--estimate" in rec[0] and "--estimate" not in rec[1]
          and rec[1][-2:] == ["--resume", "auto"] and rec[1][-4:-2] == ["--steps", "10"]
          and flag(rec[1], "--hellaswag") == "hs.jsonl" and flag(rec[1], "--hellaswag-every") == "250"
          and "training" in p.stdout and os.path.isdir(os.path.join(tmp, "out")))
    report(ok, "the estimate runs first, then training with --resume auto; extra flags and HELLASWAG reach the trainer",
           p.stdout[-800:] + p.stderr + str(rec))

    # ---- several GPUs through run_mpi_local.sh
    p, rec = call(["350M", "--gpus", "4"], {"MPIRUN": fake_mpirun})
    margs = open(os.path.join(tmp, "mpirun_args")).read().split("\n") if os.path.exists(os.path.join(tmp, "mpirun_args")) else []
    ok = (p.returncode == 0 and len(rec) == 1 and flag(rec[0], "--estimate-ranks") == "4" and "-np" in margs and flag(margs, "-np") == "4" and fake in margs and margs[-3:-1] == ["--resume", "auto"]
          and flag(margs, "--batch-size") == "32" and "32 sequences x 1024 tokens x 4 GPU(s) x 4 accumulation" in p.stdout)
    report(ok, "--gpus 4: the estimate for 4 ranks, then 4 ranks through scripts/run_mpi_local.sh, 4 accumulation steps",
           p.stdout[-800:] + p.stderr + str(margs))

    # ---- refusals
    for args, extra, code, needle, name in [
            (["2B"], {}, 2, "unknown size '2B'", "an unknown size"),
            (["124M", "--gpus", "3"], {}, 2, "not a multiple of MICRO_BATCH", "3 GPUs do not divide 0.5M tokens"),
            (["124M"], {"MICRO_BATCH": "48"}, 2, "not a multiple of MICRO_BATCH", "a micro-batch of 48"),
            (["124M"], {"TRAIN_DATA": os.path.join(tmp, "none_*.bin")}, 1, "no training shards match", "no training data"),
            (["124M"], {"FAKE_ESTIMATE_FAIL": "1"}, 1, "the estimate failed", "a failing estimate")]:
        p, rec = call(args, extra)
        trained = any("--estimate" not in r for r in rec)
        report(p.returncode == code and needle in p.stderr and not trained, f"refused: {name} (exit {code}, nothing trained)",
               f"exit {p.returncode}, stderr {p.stderr!r}, calls {len(rec)}")

    # ---- the real GPU trainer's estimate (arithmetic: no GPU needed)
    gpu_trainer = os.path.join(ROOT, "train_gpt")
    if os.path.exists(gpu_trainer):
        p, _ = call(["124M", "--dry-run"], {"TRAINER": gpu_trainer})
        report(p.returncode == 0 and "FLOPs per token" in p.stdout and "total" in p.stdout,
               "with ./train_gpt, --dry-run prints the trainer's real estimate", p.stdout[-800:] + p.stderr[-500:])
    else:
        print("SKIP: the real estimate (./train_gpt not built: it needs nvcc)")

    # ---- the scripts the docs run work as written: executable where they have a #! line, and those that
    # need numpy, torch or matplotlib (themselves, or through main_job's plot or test_parallelism) on the
    # Debian Python that scripts/setup.sh --tests gives them (`#!/usr/bin/env python3` may find another)
    docs = [os.path.join(ROOT, "README.md")] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    named = sorted({m for d in docs for m in re.findall(r"scripts/[A-Za-z0-9_]+\.(?:py|sh)", open(d).read())})
    missing = [n for n in named if not os.path.exists(os.path.join(ROOT, n))]
    not_x = [n for n in named if n not in missing and open(os.path.join(ROOT, n)).read(2) == "#!"
             and not os.access(os.path.join(ROOT, n), os.X_OK)]
    report(named and not missing and not not_x, f"the {len(named)} scripts the docs name exist and are executable",
           f"missing {missing}, not executable {not_x}")
    needs = re.compile(r"^\s*(?:import|from)\s+(?:numpy|torch|matplotlib|main_job|test_parallelism)\b", re.M)
    wrong = [os.path.basename(p) for p in sorted(glob.glob(os.path.join(ROOT, "scripts", "*.py")))
             if needs.search(open(p).read()) and open(p).readline().startswith("#!") and open(p).readline() != "#!/usr/bin/python3\n"]
    report(not wrong, "every script that imports numpy, torch or matplotlib runs on #!/usr/bin/python3", str(wrong))
    shutil.rmtree(tmp)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
