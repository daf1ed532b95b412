#!/usr/bin/env python3
"""test_run_sh.py — scripts/run.sh on the CPU: the main job sized by time.

A stand-in trainer (TRAINER; RUN_SKIP_SETUP=1 skips set-up, build and corpus; a failing nvidia-smi
first on PATH keeps the GPU branch away) records its arguments and writes a metrics log whose
steps take FAKE_STEP_MS milliseconds, so the script's arithmetic is checked without training:

  sized       the calibration runs first (30 steps, no validation, samples or checkpoints, its own
              folder); the run gets the most steps whose time, with the validations and the fixed
              reserve, fits in what is left of the budget, and one more would not fit
  intervals   validation about 4 times (a multiple of 50), samples and checkpoints at half-way; the
              whole validation split (the trainer's default), 150 warm-up steps
  cap, floor  a fast CPU gets the full run (2900 steps, validation every 750, samples and
              checkpoints every 1450); a very slow one 300 steps and a warning
  budget      --time-budget S and RUN_TIME_BUDGET change the budget and never reach the trainer
  the user's  --steps N skips the calibration (the intervals follow N); flags the user passes come
  flags       last, so they win; --resume latest keeps the folder, a fresh run moves it aside; --more-steps K
              (the train-on hint's form) skips the calibration and passes no --steps
  last lines  the sample and "train on" commands name the last checkpoint's step; the trainer's
              output is kept in OUT/train.log and scripts/report.py's page is written, its path printed
  OpenMP      the trainer runs with GOMP_SPINCOUNT=10000 unless the user set it
"""
import math, os, re, shutil, stat, subprocess, sys, tempfile
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "scripts", "run.sh")
# run.sh's constants, restated here so that a change to either shows
VALS, VAL_BATCHES, VAL_BATCH_COST, FIXED_RESERVE, STEP_MARGIN, MAX_STEPS, MIN_STEPS = 4, 62, 0.40, 8, 1.05, 2900, 300


def executable(path, text):
    with open(path, "w") as f:
        f.write(text)
    os.chmod(path, os.stat(path).st_mode | stat.S_IEXEC)


def flag(args, name):
    """The last value of --name in args (the trainer's parser keeps the last)."""
    value = None
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            value = args[i + 1]
        elif a.startswith(name + "="):
            value = a.split("=", 1)[1]
    return value


STAND_IN = r"""#!/usr/bin/env bash
# records its arguments, then writes what the real trainer would: a metrics log of --steps steps of
# about FAKE_STEP_MS ms (steps 1-5 ten times slower: the warm-up the calibration must skip; step s
# after them (1 + (s - 18)/1000) times, so steps 6-30 have the median FAKE_STEP_MS exactly, and
# steps 1-30 a larger one), a checkpoint at the end
n=$(ls "$CALLS" | wc -l)
echo "${GOMP_SPINCOUNT-unset}" > "$CALLS.spin"
if (( n == 0 )) && [[ -n "${FAKE_CALIBRATION_SECONDS:-}" ]]; then sleep "$FAKE_CALIBRATION_SECONDS"; fi  # time spent before sizing
printf '%s\n' "$@" > "$CALLS/$n"
last() { local name=$1 v=""; shift; while (( $# )); do [[ "$1" == "$name" ]] && v=${2-}; [[ "$1" == "$name="* ]] && v=${1#*=}; shift; done; printf '%s' "$v"; }
steps=$(last --steps "$@"); out=$(last --out-dir "$@"); metrics=$(last --metrics "$@"); ckpt=$(last --checkpoint-every "$@")
resume=$(last --resume "$@"); more=$(last --more-steps "$@")
[[ -n "$metrics" ]] || metrics=$out/metrics.jsonl
mkdir -p "$out"
first=1
if [[ -n "$resume" ]]; then first=$(( 10#$(ls -d "$out"/ckpt_* | tail -n 1 | sed 's/.*ckpt_//') + 1 )); fi
if [[ -n "$more" ]]; then steps=$(( first - 1 + more )); fi  # the trainer's --more-steps K: K past the checkpoint
{
  echo '{"type":"run","trainer":"cpu","start_step":'$((first - 1))',"config":{"L":8,"C":64,"H":4,"T":64},"plan":{"B":8,"T":64,"tokens_per_step":512,"steps":'$steps'}}'
  awk -v first=$first -v steps=$steps -v base="$FAKE_STEP_MS" 'BEGIN { for (s = first; s <= steps; s++)
      printf "{\"type\":\"step\",\"step\":%d,\"tokens\":%d,\"loss\":%.3f,\"lr\":0.01,\"norm\":1,\"ms\":%.4f,\"tok_s\":1000,\"mfu\":null,\"mem_mb\":300}\n",
             s, s * 512, 10 - 5 * s / steps, s <= 5 ? 10 * base : (1 + (s - 18) / 1000) * base }'
  echo '{"type":"val","step":'$steps',"tokens":'$((steps * 512))',"val_loss":5.5}'
} >> "$metrics"
if [[ "$ckpt" != 0 ]]; then mkdir -p "$out/ckpt_$(printf %08d "$steps")"; fi
echo "stand-in: trained $steps steps"
"""


def main():
    tmp = tempfile.mkdtemp(prefix="llmc_run_sh_")
    calls = os.path.join(tmp, "calls")
    bin_dir = os.path.join(tmp, "bin")
    os.makedirs(bin_dir)
    executable(os.path.join(bin_dir, "nvidia-smi"), "#!/bin/sh\nexit 1\n")  # no GPU, whatever the machine has
    fake = os.path.join(tmp, "stand_in_trainer")
    executable(fake, STAND_IN)
    out = os.path.join(tmp, "out")
    base_env = dict(os.environ, TRAINER=fake, RUN_SKIP_SETUP="1", CALLS=calls, PATH=bin_dir + os.pathsep + os.environ["PATH"])
    base_env.pop("RUN_TIME_BUDGET", None)
    base_env.pop("GOMP_SPINCOUNT", None)

    def call(args, step_ms, extra_env=None, keep_out=False):
        shutil.rmtree(calls, ignore_errors=True)
        os.makedirs(calls)
        if not keep_out:
            shutil.rmtree(out, ignore_errors=True)
        env = dict(base_env, FAKE_STEP_MS=str(step_ms), **(extra_env or {}))
        p = subprocess.run(["bash", SCRIPT] + args, capture_output=True, text=True, env=env, cwd=tmp, timeout=300)
        recorded = [open(os.path.join(calls, str(i))).read().split("\n")[:-1] for i in range(len(os.listdir(calls)))]
        return p, recorded

    def plan(rec):
        return {k: flag(rec, "--" + k) for k in ("steps", "val-every", "sample-every", "checkpoint-every")}

    def fits(steps, step_ms, spent, budget):
        """run.sh's promise: the steps and the validations (the one before step 1 too) at the step time plus the margin, and the reserve, within the budget."""
        step_ms = math.ceil(step_ms * STEP_MARGIN)
        return spent + steps * step_ms / 1e3 + (1 + VALS) * VAL_BATCHES * VAL_BATCH_COST * step_ms / 1e3 + FIXED_RESERVE <= budget

    def spent_of(stdout):
        m = re.search(r"(\d+) s of the (\d+) s budget spent", stdout)
        return (int(m.group(1)), int(m.group(2))) if m else (None, None)

    # ---- sized by time: 120 ms steps (a Zen 4), the default budget of 240 s, 3 s spent before sizing
    user = ["--out-dir", out]
    p, rec = call(user, 120, {"FAKE_CALIBRATION_SECONDS": "3"})
    spent, budget = spent_of(p.stdout)
    ok = p.returncode == 0 and len(rec) == 2 and budget == 240
    if ok:
        cal, run = rec
        steps = int(plan(run)["steps"])
        ok = (flag(cal, "--steps") == "30" and flag(cal, "--val-every") == "0" and flag(cal, "--sample-every") == "0"
              and flag(cal, "--checkpoint-every") == "0" and flag(cal, "--out-dir") != out and flag(cal, "--resume") == ""
              and flag(cal, "--model") == "L=8,C=64,H=4,T=64" and flag(cal, "--batch-size") == "8"
              and "a step takes 120 ms here" in p.stdout and f": {steps} steps, fits" in p.stdout
              and spent >= 3 and fits(steps, 120, spent, 240) and not fits(steps + 1, 120, spent, 240) and 1675 <= steps <= 1700)
    report(ok, f"120 ms steps, budget 240 s, {spent} s spent: a 30-step calibration, then the most steps that fit "
           "(the median step time, the validations and the reserve within what is left)", p.stdout[-1500:] + p.stderr + str(rec))

    if ok:
        val_every, half = int(plan(run)["val-every"]), int(plan(run)["sample-every"])
        validations = steps // val_every + (steps % val_every != 0)
        report(val_every % 50 == 0 and VALS - 1 <= validations <= VALS and half == (steps + 1) // 2
               and plan(run)["checkpoint-every"] == str(half) and flag(run, "--out-dir") == out
               and flag(run, "--val-batches") is None and flag(run, "--val-tokens") is None and flag(run, "--lr") == "1e-2"
               and flag(run, "--warmup-steps") == "150",
               f"the intervals follow the steps: {steps} steps, validation every {val_every} ({validations} times), "
               f"samples and checkpoints every {half}", str(run))
        report(f"./train_gpt_cpu --resume {out}/ckpt_{steps:08d} --generate " in p.stdout
               and f"scripts/run.sh --out-dir {out} --resume latest --more-steps {steps} " in p.stdout,
               "the last lines name the last checkpoint (generate from it; train on to twice the steps)", p.stdout[-800:])

    spin = open(calls + ".spin").read().strip() if os.path.exists(calls + ".spin") else None
    p3, _ = call(user + ["--steps", "10"], 120, {"GOMP_SPINCOUNT": "500"})
    spin_user = open(calls + ".spin").read().strip()
    report(spin == "10000" and spin_user == "500", "OpenMP spins 10,000 times before sleeping (GOMP_SPINCOUNT), "
           f"unless the user set it: {spin}, {spin_user}", p3.stderr)

    # ---- 200 ms steps: fewer steps than at 120 ms, in the same budget
    p2, rec2 = call(user, 200)
    spent2, _ = spent_of(p2.stdout)
    steps2 = int(plan(rec2[-1])["steps"]) if p2.returncode == 0 and len(rec2) == 2 else None
    report(steps2 is not None and fits(steps2, 200, spent2, 240) and not fits(steps2 + 1, 200, spent2, 240) and 970 <= steps2 <= 995,
           f"200 ms steps: {steps2} steps, the most that fit", p2.stdout[-800:] + p2.stderr)

    # ---- a fast CPU gets today's full run, flag for flag
    p, rec = call(user, 40)
    today = {"steps": "2900", "val-every": "750", "sample-every": "1450", "checkpoint-every": "1450"}
    report(p.returncode == 0 and len(rec) == 2 and plan(rec[1]) == today and "2900 steps, the full run" in p.stdout,
           "40 ms steps: capped at 2900, validation every 750, samples and checkpoints every 1450 (the full run)",
           p.stdout[-800:] + p.stderr + str(rec[-1:]))

    # ---- a very slow CPU gets the floor, and is told
    p, rec = call(user, 3000)
    report(p.returncode == 0 and len(rec) == 2 and plan(rec[1])["steps"] == str(MIN_STEPS) and "go over the budget" in p.stdout,
           f"3 s steps: the floor of {MIN_STEPS} steps, with a warning that the run goes over the budget", p.stdout[-800:] + p.stderr)

    # ---- the budget: --time-budget and RUN_TIME_BUDGET, never passed to the trainer
    for args, extra, name in [(["--time-budget", "120"], {}, "--time-budget 120"), (["--time-budget=120"], {}, "--time-budget=120"),
                              ([], {"RUN_TIME_BUDGET": "120"}, "RUN_TIME_BUDGET=120"),
                              (["--time-budget", "120"], {"RUN_TIME_BUDGET": "600"}, "--time-budget 120 over RUN_TIME_BUDGET=600")]:
        p, rec = call(args + user, 120, extra)
        spent, budget = spent_of(p.stdout)
        steps = int(plan(rec[-1])["steps"]) if p.returncode == 0 and len(rec) == 2 else None
        report(steps is not None and budget == 120 and fits(steps, 120, spent, 120) and not fits(steps + 1, 120, spent, 120)
               and not any("time-budget" in a for r in rec for a in r),
               f"{name}: {steps} steps fit 120 s; the flag does not reach the trainer", p.stdout[-800:] + p.stderr + str(rec))
    p, rec = call(["--time-budget", "soon"] + user, 120)
    report(p.returncode == 2 and "--time-budget" in p.stderr and not rec, "--time-budget soon: refused, nothing run", p.stderr)

    # ---- the user's flags: --steps skips the calibration, later flags win
    p, rec = call(user + ["--steps", "100", "--val-every", "7"], 120)
    run = rec[0] if rec else []
    report(p.returncode == 0 and len(rec) == 1 and flag(run, "--steps") == "100" and flag(run, "--val-every") == "7"
           and run[-4:] == ["--steps", "100", "--val-every", "7"] and flag(run, "--sample-every") == "50"
           and "no calibration" in p.stdout,
           "--steps 100: no calibration; the user's flags come last (--val-every 7 wins), samples follow the 100 steps",
           p.stdout[-800:] + p.stderr + str(rec))
    p, rec = call(user + ["--steps=60"], 120)
    report(p.returncode == 0 and len(rec) == 1 and flag(rec[0], "--steps") == "60" and flag(rec[0], "--sample-every") == "30",
           "--steps=60 (the = spelling) also skips the calibration", p.stdout[-800:] + p.stderr + str(rec))

    # ---- train on: --resume latest --steps 2N keeps the folder and its checkpoint
    p, rec = call(user + ["--steps", "100"], 120)
    page = os.path.join(out, "report.html")
    report(p.returncode == 0 and f"run: the run report: {page}" in p.stdout and os.path.isfile(page)
           and "stand-in: trained 100 steps" in open(os.path.join(out, "train.log")).read(),
           "the end: the trainer's output kept in train.log, the run report written and its path printed", p.stdout[-800:] + p.stderr)
    p2, rec2 = call(user + ["--resume", "latest", "--steps", "200"], 120, keep_out=True)
    report(p2.returncode == 0 and len(rec2) == 1 and os.path.isdir(os.path.join(out, "ckpt_00000100"))
           and os.path.isdir(os.path.join(out, "ckpt_00000200")) and f"ckpt_00000200 --generate " in p2.stdout
           and "--resume latest --more-steps 200 " in p2.stdout,
           "train on (--resume latest --steps 200): the folder is kept, the last lines name step 200", p2.stdout[-800:] + p2.stderr)
    p3, rec3 = call(user + ["--resume", "latest", "--more-steps", "100"], 120, keep_out=True)
    report(p3.returncode == 0 and len(rec3) == 1 and flag(rec3[0], "--steps") is None and flag(rec3[0], "--more-steps") == "100"
           and flag(rec3[0], "--sample-every") == "50" and os.path.isdir(os.path.join(out, "ckpt_00000300"))
           and "no calibration" in p3.stdout and "--resume latest --more-steps 300 " in p3.stdout,
           "train on (--resume latest --more-steps 100, the hint's form): no calibration and no --steps passed, the "
           "intervals follow the 100 steps, the run ends at step 300", p3.stdout[-800:] + p3.stderr + str(rec3))

    # ---- the default folder: a fresh run moves the previous one aside (its later checkpoints are not this run's)
    default_out = os.path.join(tmp, "repo_copy")
    shutil.rmtree(default_out, ignore_errors=True)
    os.makedirs(os.path.join(default_out, "scripts"))
    shutil.copy(SCRIPT, os.path.join(default_out, "scripts", "run.sh"))
    shutil.copy(os.path.join(ROOT, "scripts", "plot_metrics.py"), os.path.join(default_out, "scripts", "plot_metrics.py"))
    stale = os.path.join(default_out, "out", "moby-dick-cpu", "ckpt_00002900")
    os.makedirs(stale)
    env = dict(base_env, FAKE_STEP_MS="120")
    shutil.rmtree(calls, ignore_errors=True)
    os.makedirs(calls)
    p = subprocess.run(["bash", os.path.join(default_out, "scripts", "run.sh"), "--steps", "100"], capture_output=True,
                       text=True, env=env, cwd=tmp, timeout=300)
    report(p.returncode == 0 and os.path.isdir(os.path.join(default_out, "out", "moby-dick-cpu.previous", "ckpt_00002900"))
           and not os.path.exists(stale) and "ckpt_00000100 --generate " in p.stdout,
           "a fresh run in the default folder moves the previous run to out/moby-dick-cpu.previous", p.stdout[-800:] + p.stderr)

    shutil.rmtree(tmp)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
