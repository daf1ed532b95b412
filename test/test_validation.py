#!/usr/bin/env python3
"""test_validation.py — validation scores the same windows whatever the batch size (issue 40, item 5).

A validation scores the first --val-tokens / T windows of T+1 tokens of the validation split (each
window's last token the next one's first), B at a time, the last forward pass only the rows left
(llmc/io/dataloader.h, llmc/run/run.h's evaluate_loss). A tiny model (L=2 C=32 H=4 T=16 V=512) is
trained 3 steps and checkpointed; its checkpoint is then evaluated with --eval-only on a split of
600 tokens: (600 - 1) / 16 = 37 windows, so B=8 and B=3 both end on a partial batch.

  reference      the mean loss over the 37 windows by the PyTorch GPT-2 (gpt2_reference.py, float64)
                 on the checkpoint's model.bin: the CPU trainer at B=8, B=4 and B=3 within 1e-5
  any B          B=8, B=4 and B=3 give the same loss within 2e-6 (float rounding)
  cap            --val-tokens 160: the first 10 windows, the reference's mean over them
  older flag     --val-batches 2 at B=4 is --val-tokens 128; both flags at once: exit 2
  run folder     --eval-only --resume RUN/ckpt_N, without --out-dir, logs into RUN/metrics.jsonl
                 (not out/): one "val" record at step N
  GPU trainer    the emulated fp32 GPU trainer (build/emu/train_gpt_fp32, its forward always the
                 full B x T: the partial batch padded) at B=8 and B=4: the reference within 1e-4
                 (SKIP when not built)
"""
import json, os, shutil, subprocess, sys, tempfile
import numpy as np
import torch
from checks import report, exit_code
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_shards import write_shard  # noqa: E402
from gpt2_reference import load_model  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "train_gpt_cpu")
GPU_EMU = os.path.join(ROOT, "build", "emu", "train_gpt_fp32")
MODEL, T, VAL_TOKENS = "L=2,C=32,H=4,T=16,V=512", 16, 600


def run(cmd, cwd):
    return subprocess.run([str(c) for c in cmd], capture_output=True, text=True, timeout=600, cwd=cwd)


def reference_loss(model_path, tokens, windows):
    """The mean next-token loss over the first `windows` windows of T+1 tokens, in float64."""
    model = load_model(model_path).double()
    rows = np.array([tokens[w * T:w * T + T + 1] for w in range(windows)], dtype=np.int64)
    with torch.no_grad():
        _, loss = model(torch.from_numpy(rows[:, :-1]), torch.from_numpy(rows[:, 1:]))
    return loss.item()


def check(name, ok, detail):
    report(ok, name, detail, detail)


def val_records(path):
    if not os.path.exists(path):
        return []
    return [r for r in (json.loads(line) for line in open(path) if line.strip()) if r.get("type") == "val"]


def evaluate(trainer, ckpt, val, B, work, extra=()):
    """--eval-only of the checkpoint at batch size B; its validation loss from its own metrics log."""
    log = tempfile.mktemp(suffix=".jsonl", dir=work)
    cmd = [trainer, "--resume", ckpt, "--eval-only", "--val-data", val, "--batch-size", B, "--seq-len", T,
           "--metrics", log, *extra]
    if trainer == GPU_EMU:
        cmd += ["--attention", "simple"]
    p = run(cmd, work)
    records = val_records(log)
    if p.returncode != 0 or len(records) != 1:
        raise RuntimeError(f"{' '.join(map(str, cmd))} failed ({p.returncode}):\n{p.stdout[-1500:]}{p.stderr[-1500:]}")
    return records[0]["val_loss"]


def main():
    if not os.path.exists(TRAINER):
        print("SKIP: validation (train_gpt_cpu not built)")
        return 0
    work = tempfile.mkdtemp(prefix="llmc_validation_")
    rng = np.random.default_rng(0)
    train, val = os.path.join(work, "train.bin"), os.path.join(work, "val.bin")
    write_shard(train, rng.integers(0, 512, 4000))
    tokens = rng.integers(0, 512, VAL_TOKENS)
    write_shard(val, tokens)
    windows = (VAL_TOKENS - 1) // T
    run_dir = os.path.join(work, "run")
    p = run([TRAINER, "--model", MODEL, "--train-data", train, "--val-data", "none", "--batch-size", 4, "--seq-len", T,
             "--steps", 3, "--lr", "1e-2", "--checkpoint-every", 3, "--sample-every", 0, "--threads", 1,
             "--out-dir", run_dir], work)
    if p.returncode != 0:
        print(p.stdout[-2000:], p.stderr[-2000:])
        check("validation: a checkpoint to evaluate", False, f"training failed ({p.returncode})")
        return exit_code()
    ckpt = os.path.join(run_dir, "ckpt_00000003")
    ref = reference_loss(os.path.join(ckpt, "model.bin"), tokens, windows)

    losses = {B: evaluate(TRAINER, ckpt, val, B, work) for B in (8, 4, 3)}
    worst = max(abs(l - ref) / ref for l in losses.values())
    check("validation: the CPU trainer's loss over the 37 windows is the reference's, at B=8, 4 and 3", worst < 1e-5,
           f"reference {ref:.7f}, trainer {', '.join(f'B={b}: {l:.7f}' for b, l in losses.items())}; worst relative {worst:.1e}")
    spread = (max(losses.values()) - min(losses.values())) / ref
    check("validation: the same loss at any batch size", spread < 2e-6, f"spread {spread:.1e} (relative)")

    capped = evaluate(TRAINER, ckpt, val, 8, work, ["--val-tokens", 160])
    ref10 = reference_loss(os.path.join(ckpt, "model.bin"), tokens, 10)
    check("validation: --val-tokens 160 scores the first 10 windows", abs(capped - ref10) / ref10 < 1e-5 and abs(ref10 - ref) > 1e-4,
           f"trainer {capped:.7f}, reference over 10 windows {ref10:.7f} (over all 37: {ref:.7f})")

    older = evaluate(TRAINER, ckpt, val, 4, work, ["--val-batches", 2])
    tokens128 = evaluate(TRAINER, ckpt, val, 4, work, ["--val-tokens", 128])
    both = run([TRAINER, "--resume", ckpt, "--eval-only", "--val-data", val, "--val-batches", 2, "--val-tokens", 128], work)
    check("validation: --val-batches N is N x B x T tokens; with --val-tokens too, one line and exit 2",
           older == tokens128 and both.returncode == 2 and "--val-tokens" in both.stderr and len(both.stderr.strip().splitlines()) == 1,
           f"--val-batches 2: {older:.7f}, --val-tokens 128: {tokens128:.7f}; both: exit {both.returncode}, {both.stderr.strip()!r}")

    before = len(val_records(os.path.join(run_dir, "metrics.jsonl")))
    p = run([TRAINER, "--resume", ckpt, "--eval-only", "--val-data", val, "--batch-size", 8, "--seq-len", T], work)
    after = val_records(os.path.join(run_dir, "metrics.jsonl"))
    check("validation: --eval-only of a checkpoint logs into its run's folder, not out/",
           p.returncode == 0 and len(after) == before + 1 and after[-1]["step"] == 3
           and abs(after[-1]["val_loss"] - losses[8]) < 1e-6 and not os.path.exists(os.path.join(work, "out")),
           f"exit {p.returncode}; {len(after) - before} new val record(s) in run/metrics.jsonl; "
           f"out/ {'exists' if os.path.exists(os.path.join(work, 'out')) else 'not written'}")

    if not os.path.exists(GPU_EMU):
        print("SKIP: validation on the emulated GPU trainer (build/emu/train_gpt_fp32 not built)")
    else:
        gpu = {B: evaluate(GPU_EMU, ckpt, val, B, work) for B in (8, 4)}
        worst = max(abs(l - ref) / ref for l in gpu.values())
        check("validation: the emulated GPU trainer (fp32) scores the reference's loss at B=8 and B=4", worst < 1e-4,
               f"reference {ref:.7f}, {', '.join(f'B={b}: {l:.7f}' for b, l in gpu.items())}; worst relative {worst:.1e}")
    shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
