#!/usr/bin/env python3
"""test_moe_flags.py — the mixture-of-experts flags (llmc/run/cli.h, issue 24 item 1) on both trainers.

The CPU trainer trains MoE models (test_moe_trainer.py), the GPU trainer on one GPU or data parallel
(test_gpu_moe_trainer.py). What the
command line owes is to refuse, before anything is allocated, with ONE line naming the flag and the
fix and exit 2:
  bad values       --moe-experts -1, --moe-every 0, --moe-capacity-factor abc (cli.h), and the
                   layer's own shape checks reached through the CPU trainer (moe_shape_problem):
                   top-3, top-2 of one expert, a negative capacity factor, alpha or c_z
  MoE flags alone  --moe-top-k 2 (or any --moe-* flag) without --moe-experts: nothing to shape
  combinations     tensor and pipeline parallelism, ZeRO-3, the factored optimizers with ZeRO or
                   expert parallelism, PowerSGD (--recompute, --zero 1|2, --optimizer adafactor|sm3 and
                   --grad-compression bf16 with MoE train: test_moe_trainer.py, test_expert_parallel.py)
  not yet on the CPU trainer: --optimizer-state bf16, --data-parallel server (checkpoints:
                   test_moe_trainer.py; --generate with an MoE model file: test_generate.py)
  good values      pass every check and train one step (so the checks above do not refuse valid
                   shapes); --moe-experts 0 is the dense model and trains
  GPU trainer      the same checks, and --recompute 1 and 2 with MoE pass them (the GPU's default is 1, MoE
                   or not), on build/emu/train_gpt or ./train_gpt, when built
"""
import os, sys, tempfile
import numpy as np
from checks import report, exit_code
from token_shards import write_shard
from test_bad_inputs import BIN, MODEL, ROOT, gpu_trainer, one_line_error, run


def main():
    if not os.path.exists(BIN):
        print("SKIP: MoE flags (train_gpt_cpu not built)")
        return exit_code()
    tmp = tempfile.mkdtemp(prefix="llmc_moe_flags_")
    train = os.path.join(tmp, "train.bin")
    write_shard(train, np.random.default_rng(0).integers(0, 512, 1000))
    base = ["--model", MODEL, "--batch-size", "2", "--seq-len", "16", "--train-data", train, "--val-data", "none",
            "--threads", "1", "--out-dir", tmp, "--metrics", "none"]
    moe = base + ["--moe-experts", "4"]

    for name, args, needles in [
        ("--moe-experts -1", base + ["--moe-experts", "-1"], ["--moe-experts", "0 (dense)"]),
        ("--moe-every 0", moe + ["--moe-every", "0"], ["--moe-every", "at least 1"]),
        ("--moe-capacity-factor abc", moe + ["--moe-capacity-factor", "abc"], ["--moe-capacity-factor", "none"]),
        ("--moe-top-k 3", moe + ["--moe-top-k", "3"], ["--moe-top-k 3", "use 1 or 2"]),
        ("--moe-top-k 2 of one expert", base + ["--moe-experts", "1", "--moe-top-k", "2"], ["--moe-top-k 2", "at least 2 experts"]),
        ("--moe-capacity-factor -1", moe + ["--moe-capacity-factor", "-1"], ["--moe-capacity-factor -1"]),
        ("--moe-aux-alpha -0.1", moe + ["--moe-aux-alpha", "-0.1"], ["--moe-aux-alpha"]),
        ("--moe-z-loss -0.1", moe + ["--moe-z-loss", "-0.1"], ["--moe-z-loss"]),
        ("--moe-top-k 2 without --moe-experts", base + ["--moe-top-k", "2"], ["--moe-top-k", "add --moe-experts"]),
        ("--moe-z-loss 0 without --moe-experts", base + ["--moe-z-loss", "0"], ["--moe-z-loss", "add --moe-experts"]),
        ("--moe-experts with --tensor-parallel 2", moe + ["--tensor-parallel", "2"], ["--tensor-parallel 2", "data parallelism"]),
        ("--moe-experts with --pipeline-parallel 2", moe + ["--pipeline-parallel", "2"], ["--pipeline-parallel 2"]),
        ("--moe-experts with --zero 3", moe + ["--zero", "3"], ["--zero 3", "--zero 1 or 2"]),
        ("--moe-experts with --optimizer adafactor --expert-parallel 2", moe + ["--optimizer", "adafactor", "--expert-parallel", "2"],
         ["--optimizer adafactor", "--expert-parallel 1", "adamw"]),
        ("--moe-experts with --grad-compression powersgd", moe + ["--grad-compression", "powersgd"],
         ["--grad-compression powersgd", "bf16 or none"]),
        ("--moe-experts with --optimizer-state bf16", moe + ["--optimizer-state", "bf16"], ["--optimizer-state fp32"]),
        ("--moe-experts with --data-parallel server", moe + ["--data-parallel", "server"], ["--data-parallel allreduce"]),
        ("--moe-experts with --offload-dir", moe + ["--offload-dir", "/tmp"], ["--offload-dir", "drop --offload-dir"]),
    ]:
        one_line_error(name, args, 2, *needles, seconds=10)

    # valid shapes pass every check above and train
    for args in (["--moe-experts", "1"], ["--moe-experts", "8", "--moe-top-k", "2", "--moe-capacity-factor", "1.25",
                                           "--moe-every", "2", "--moe-aux-alpha", "0", "--moe-z-loss", "0"],
                 ["--moe-experts", "4", "--moe-capacity-factor", "none"], ["--moe-experts", "4", "--moe-capacity-factor", "0"]):
        rc, out, err, _ = run(base + args + ["--steps", "1"])
        report(rc == 0 and "done: step 1 " in out and "| aux " in out, "valid: " + " ".join(args) + ": trains a step",
               f"exit {rc}: {err[-300:]}")
    rc, out, err, _ = run(base + ["--moe-experts", "0", "--steps", "1"])
    report(rc == 0 and "done: step 1 " in out, "--moe-experts 0 is the dense model: it trains", f"exit {rc}: {err[-300:]}")

    gpu = gpu_trainer()
    if gpu is None:
        print("SKIP: the GPU trainer's MoE flags (neither build/emu/train_gpt nor train_gpt is built)")
    else:  # it trains MoE on one GPU (test_gpu_moe_trainer.py), with the same checks
        name = os.path.relpath(gpu, ROOT)
        for level in ("1", "2"):  # (recompute with MoE trains, bit for bit as level 0: test_gpu_moe_trainer.py)
            rc, out, err, _ = run(["--model", MODEL, "--moe-experts", "4", "--recompute", level, "--estimate"], binary=gpu)
            report(rc == 0 and "mixture of experts: 2 of 2 blocks, 4 experts" in out and f"recompute {level}" in out,
                   f"{name}: --moe-experts 4 --recompute {level} passes the flag checks", f"exit {rc}: {err[-300:]}")
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
