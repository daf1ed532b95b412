#!/usr/bin/env python3
"""A stand-in for ./train_gpt_cpu, built from the PyTorch reference, to test the test harness.

What it teaches: a harness that has only ever seen failing or missing programs is itself
untested. This program accepts the trainer's command line, trains with the reference (in float64
by default, so it is a different computation from the fp32 fixture, as a real trainer is), prints
the trainer's per-step line and writes the --dump-state file. test_vs_pytorch.py runs it through
the same path as the real trainers and expects every check to pass.

    python3 test/fake_trainer.py --model M --train-data D --batch-size B --seq-len T --steps N \\
        --lr 1e-4 --weight-decay 0.1 --grad-clip 1.0 --dump-state OUT.safetensors [...]
Flags it does not model (val, sampling, checkpoints, schedules) are accepted and ignored, except
that it refuses what it cannot imitate: gradient accumulation and a non-constant schedule. It
trains every step on the shard's first batch, which is the real loader's behaviour only on a
shard of exactly B*T+1 tokens, as the fixtures are. Its printed times are not a trainer's.
"""
import argparse
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import gpt2_reference as ref  # noqa: E402
from safetensors_io import write_safetensors  # noqa: E402


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", required=True)
    parser.add_argument("--train-data", required=True)
    parser.add_argument("--batch-size", type=int, required=True)
    parser.add_argument("--seq-len", type=int, required=True)
    parser.add_argument("--total-batch-tokens", type=int)
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--lr", type=float, required=True)
    parser.add_argument("--lr-schedule", default="constant")
    parser.add_argument("--weight-decay", type=float, default=0.1)
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--dump-state")
    parser.add_argument("--dtype", choices=("float32", "float64"), default="float64")
    for ignored in ("--val-data", "--warmup-steps", "--val-every", "--sample-every",
                    "--checkpoint-every", "--out-dir"):
        parser.add_argument(ignored)
    args = parser.parse_args()
    B, T = args.batch_size, args.seq_len
    if args.total_batch_tokens not in (None, B * T) or args.lr_schedule != "constant":
        parser.error("only one micro-batch per step and a constant schedule are imitated")

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    model = ref.load_model(args.model).to(getattr(torch, args.dtype))
    inputs, targets = ref.batch_from_tokens(ref.read_token_shard(args.train_data), B, T)
    start = time.time()
    record = ref.train(model, inputs, targets, args.steps, args.lr, args.weight_decay,
                       args.grad_clip)
    ms_per_step = 1000 * (time.time() - start) / args.steps
    for step in range(args.steps):
        print(f"step {step + 1:4d}/{args.steps} | loss {record['losses'][step]:.4f} | "
              f"lr {args.lr:.2e} | norm {record['norms'][step]:.4f} | {ms_per_step:.1f} ms | "
              f"{B * T / ms_per_step * 1000:.0f} tok/s")
    if args.dump_state:
        write_safetensors(args.dump_state, {k: record[k] for k in ("logits", "loss", "grads",
                                                                   "losses", "params")})


if __name__ == "__main__":
    main()
