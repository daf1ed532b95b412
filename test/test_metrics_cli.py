#!/usr/bin/env python3
"""test_metrics_cli.py — the metrics log and the command line as a user meets them (CPU trainer).

  metrics log   OUT_DIR/metrics.jsonl: a "run" record (config, plan, every flag), one "step" record
                per step (step, tokens, loss, lr, norm, ms, tok_s, mfu, mem_mb) that matches the
                step line printed, "val" records; a resumed run appends a second "run" record and
                continues; --metrics FILE and --metrics none
  resume auto   --resume auto starts fresh in an empty --out-dir and resumes from the newest
                checkpoint when there is one
  quiet         --quiet prints only the final summary line; errors still reach stderr
  verbose       --verbose adds one line per micro-step and the buffer table
  help/version  --help opens with five examples and the common flags; --help-all adds the rest, grouped,
                with the new flags; both fit 100 columns; --version
  fits          every line of a normal run fits 100 columns
  progress      the HellaSwag progress bar is drawn on a terminal (a pty) and never into a pipe
"""
import json, os, pty, shutil, subprocess, sys, tempfile
from checks import report, exit_code
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_shards import write_shard  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "train_gpt_cpu")
MODEL = "L=2,C=64,H=4,T=64,V=512"


def run(args, **kw):
    return subprocess.run([TRAINER] + args, capture_output=True, text=True, **kw)


def read_log(path):
    return [json.loads(line) for line in open(path)]


def main():
    if not os.path.exists(TRAINER):
        print("SKIP: metrics and command line (train_gpt_cpu not built)")
        return 0
    tmp = tempfile.mkdtemp(prefix="llmc_metrics_")
    rng = np.random.default_rng(0)
    train, val = os.path.join(tmp, "train.bin"), os.path.join(tmp, "val.bin")
    write_shard(train, rng.integers(0, 512, 20000))
    write_shard(val, rng.integers(0, 512, 3000))
    out = os.path.join(tmp, "out")
    base = ["--model", MODEL, "--train-data", train, "--val-data", val, "--batch-size", "2", "--seq-len", "32",
            "--total-batch-tokens", "128", "--val-every", "2", "--val-tokens", "64", "--threads", "2", "--out-dir", out]

    # ---- a fresh run with --resume auto, 4 steps, checkpoints at 2 and 4
    p = run(base + ["--steps", "4", "--checkpoint-every", "2", "--resume", "auto"])
    report(p.returncode == 0 and "resumed from" not in p.stdout, "--resume auto starts fresh when --out-dir has no checkpoint",
           p.stderr[-500:])
    log_path = os.path.join(out, "metrics.jsonl")
    log = read_log(log_path)
    kinds = [r["type"] for r in log]
    report(kinds == ["run", "val", "step", "step", "val", "step", "step", "val"],
           "metrics.jsonl: a run record, then val and step records in order", f"{kinds}")
    head = log[0]
    report(head["trainer"] == "cpu" and head["start_step"] == 0 and head["config"]["C"] == 64 and head["plan"]["accumulation"] == 2
           and head["flags"]["lr"] == 0.0006 and head["flags"]["resume"] == "auto" and head["flags"]["quiet"] is False,
           "the run record holds the config, the plan and every flag", json.dumps(head)[:400])
    steps = [r for r in log if r["type"] == "step"]
    fields = {"step", "tokens", "loss", "lr", "norm", "ms", "tok_s", "mfu", "mem_mb", "type"}
    printed = [l for l in p.stdout.splitlines() if l.startswith("step ") and "/4 |" in l]
    match = all(f"loss {r['loss']:.6f}" in line and f"step {r['step']:5d}/4" in line for r, line in zip(steps, printed))
    report(len(steps) == 4 and all(set(r) == fields for r in steps) and [r["tokens"] for r in steps] == [128, 256, 384, 512]
           and all(r["mfu"] is None and r["mem_mb"] > 1 and r["tok_s"] > 0 for r in steps) and match and len(printed) == 4,
           "one step record per step, every field, matching the printed step line", f"{steps[:1]} {printed[:1]}")

    # ---- resume: --resume auto continues from ckpt 4 and appends
    p = run(base + ["--steps", "6", "--checkpoint-every", "2", "--resume", "auto"])
    log = read_log(log_path)
    runs = [r for r in log if r["type"] == "run"]
    later = [r["step"] for r in log[len(kinds):] if r["type"] == "step"]
    report(p.returncode == 0 and "resumed from " + os.path.join(out, "ckpt_00000004") in p.stdout and len(runs) == 2
           and runs[1]["start_step"] == 4 and later == [5, 6],
           "--resume auto resumes from the newest checkpoint; the log gets a second run record and steps 5-6",
           f"{p.stdout[-300:]} {later}")

    # ---- --metrics FILE and none
    custom = os.path.join(tmp, "elsewhere", "m.jsonl")
    p = run(base + ["--steps", "1", "--metrics", custom, "--out-dir", os.path.join(tmp, "o2")])
    report(p.returncode == 0 and os.path.exists(custom) and not os.path.exists(os.path.join(tmp, "o2", "metrics.jsonl")),
           "--metrics FILE writes the log there", p.stderr)
    p = run(base + ["--steps", "1", "--metrics", "none", "--no-checkpoint", "--out-dir", os.path.join(tmp, "o3")])
    report(p.returncode == 0 and not os.path.exists(os.path.join(tmp, "o3")), "--metrics none writes no log", p.stderr)

    # ---- quiet, verbose
    p = run(base + ["--steps", "2", "--quiet", "--out-dir", os.path.join(tmp, "o4")])
    lines = p.stdout.strip().splitlines()
    report(p.returncode == 0 and len(lines) == 1 and lines[0].startswith("done: step 2 (2 this run") and "val loss" in lines[0]
           and p.stderr == "", "--quiet prints only the final summary", repr(p.stdout) + repr(p.stderr))
    p = run(base + ["--steps", "2", "--quiet", "--out-dir", os.path.join(tmp, "o4"), "--train-data", os.path.join(tmp, "no_*.bin")])
    report(p.returncode == 1 and p.stdout == "" and p.stderr.startswith("error: no files match"),
           "--quiet still reports errors on stderr", repr(p.stdout) + repr(p.stderr))
    p = run(base + ["--steps", "1", "--verbose", "--metrics", "none"])
    report(p.returncode == 0 and "micro 1/2" in p.stdout and "micro 2/2" in p.stdout and "  buffer " in p.stdout
           and " logits " in p.stdout, "--verbose prints every micro-step and the buffer table", p.stdout[-600:])
    p = run(["--quiet", "--verbose"])
    report(p.returncode == 2 and "contradict" in p.stderr, "--quiet with --verbose -> exit 2", p.stderr)

    # ---- help and version: --help answers first (five examples, the common flags), --help-all has the rest
    p = run(["--help"])
    text = p.stdout
    examples = text[text.find("Examples:"):text.find("Common flags:")]
    common = [l.split()[0] for l in text[text.find("Common flags:"):].splitlines() if l.startswith("  --")]
    report(p.returncode == 0 and text.find("Examples:") < text.find("Common flags:") and examples.count("\n    ./train_gpt") +
           examples.count("\n    scripts/run_mpi_local.sh 8") == 5 and "--zero 1" in examples and "--resume latest" in examples
           and "--generate" in examples and "--model d12" in examples and "more flags" in text and "--help-all" in text
           and common[:2] == ["--model", "--train-data"] and {"--batch-size", "--steps", "--lr", "--out-dir", "--checkpoint-every",
                                                              "--resume", "--generate", "--precision"} <= set(common)
           and "--moe-experts" not in text and max(len(l) for l in text.splitlines()) <= 100,
           "--help opens with five examples (CPU, GPU, 8 GPUs with ZeRO-1, resume, generate), then the common flags only",
           text[:1500])
    p = run(["--help-all"])
    all_flags = [l.split()[0] for l in p.stdout.splitlines() if l.startswith("  --")]
    report(p.returncode == 0 and p.stdout.startswith(text[:text.find("Common flags:")]) and all_flags[:len(common)] == common
           and len(all_flags) == len(set(all_flags)) and "--moe-experts" in all_flags and "--help-all" in all_flags,
           "--help-all: the same examples and common flags first, then every other flag once", p.stdout[:300])
    long_lines = [l for l in p.stdout.splitlines() if len(l) > 100]
    groups = [l for l in p.stdout.splitlines() if l.endswith(":") and not l.startswith(" ")]
    report(p.returncode == 0 and not long_lines and {"Data:", "Model:", "Optimizer:", "Evaluation:", "Output:", "Info:"} <= set(groups)
           and all(f in p.stdout for f in ("--hellaswag FILE", "--eval-only", "--quiet", "--verbose", "--metrics FILE", "'auto'")),
           "--help-all is grouped by topic, has the new flags and fits 100 columns", f"{long_lines[:2]} {groups}")
    p = run(["--version"])
    report(p.returncode == 0 and p.stdout.startswith("llmc ") and "CPU trainer" in p.stdout, "--version", p.stdout)

    # ---- a normal run fits 100 columns
    # (--no-checkpoint: the done: line would name the checkpoint's path, whose length is the test folder's)
    p = run(base + ["--steps", "2", "--metrics", "none", "--no-checkpoint", "--sample-every", "1", "--sample-tokens", "4"])
    wide = [l for l in p.stdout.splitlines() if len(l) > 100 and not l.startswith("sample:") and not l.startswith("model:")]
    report(p.returncode == 0 and not wide, "the step, val and summary lines fit 100 columns", f"{wide[:2]}")

    # ---- the progress bar: on a terminal only
    hs = os.path.join(tmp, "hs.jsonl")
    with open(hs, "w") as f:
        for i in range(40):
            f.write(json.dumps({"ctx": "a b c", "endings": ["d", "e", "f", "g"], "label": i % 4}) + "\n")
    vocab = os.path.join(ROOT, "data", "gpt2")
    if os.path.exists(os.path.join(vocab, "encoder.json")):
        args = ["--eval-only", "--model", "L=2,C=64,H=4,T=64", "--hellaswag", hs, "--val-data", "none", "--metrics", "none",
                "--batch-size", "4", "--tokenizer", vocab, "--threads", "2"]
        master, slave = pty.openpty()
        proc = subprocess.Popen([TRAINER] + args, stdout=subprocess.PIPE, stderr=slave, text=True)
        os.close(slave)
        chunks = []
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:
                break
            if not data:
                break
            chunks.append(data)
        stdout = proc.stdout.read()
        proc.wait()
        os.close(master)
        tty_err = b"".join(chunks).decode(errors="replace")
        report(proc.returncode == 0 and "hellaswag [" in tty_err and "40/40" in tty_err and "hellaswag [" not in stdout,
               "HellaSwag draws a progress bar on a terminal", repr(tty_err[-300:]))
        p = run(args)
        report(p.returncode == 0 and "[" not in p.stderr and "hellaswag " in p.stdout, "no progress bar when stderr is not a terminal",
               repr(p.stderr[-300:]))
    else:
        print("SKIP: progress bar (no GPT-2 tokenizer in data/gpt2: scripts/get_vocab.sh)")
    shutil.rmtree(tmp)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
