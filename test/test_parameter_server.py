#!/usr/bin/env python3
"""test_parameter_server.py — --data-parallel server on the CPU trainer over MPI (llmc/parallel/parameter_server.h).

The model is L=2 C=64 H=4 T=64 V=501 at --seq-len 32, one micro-batch of 32 tokens per rank and step.

1. The server's run equals the all-reduce's bit for bit (every step's loss, the step-1 gradient on
   rank 0, the final weights) at 2 ranks (any order of two additions gives the same bits) and at 3
   ranks, where the server adds in rank order ((g0 + g1) + g2), the order this Open MPI's
   reduce-scatter adds in (llmc/parallel/parameter_server.h says why this is a fact about the MPI
   and not a promise; if another MPI sums otherwise, this check says so).
2. The traffic, from the counters: through the server (rank 0) 2 (N-1) x P x 4 bytes per step
   (received + sent), each worker sends P x 4; the all-reduce's rank sends 2 (N-1)/N x P x 4; every
   rank's bytes are what the run's prediction says, and what --estimate prints without running.
3. A checkpoint at step 3 resumed to step 6 equals the straight 6-step server run bit for bit.
4. Bad values and combinations: one line, exit 2 (unknown value; with --zero 1, --tensor-parallel 2,
   --grad-compression bf16; on the GPU trainer when build/emu/train_gpt is built).

Planted bugs the checks caught (by hand, once): the server receiving the last rank's gradient but
not adding it (1 fails at 2 and 3 ranks); adding in another order, ((g1 + g2) + g0) (1 fails at 3
ranks; at 2 ranks a + b == b + a). Not caught, and harmless: the norm's squares summed over the
whole array at once instead of shard by shard (accumulated in fp64, the fp32 norm rounds the same).
"""
import os, re, shutil, subprocess, sys, tempfile
import numpy as np
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from test_parallelism import Runner, check_bitwise, check_predictions  # noqa: E402
from test_bad_inputs import gpu_trainer, one_line_error  # noqa: E402
from token_shards import write_shard  # noqa: E402

MODEL = "L=2,C=64,H=4,T=64,V=501"
L, C, MAXT, V = 2, 64, 64, 501
VP = (V + 127) // 128 * 128
# GPT-2's parameter count at this shape (llmc/model/model.h: param_layout)
GRANULE = 64  # llmc/parallel/sharding.h: SHARD_GRANULE, the reduce-scatter's shards are multiples of it
P = VP * C + MAXT * C + L * (2 * C + 3 * C * C + 3 * C + C * C + C + 2 * C + 4 * C * C + 4 * C + 4 * C * C + C) + 2 * C


def traffic(out):
    """(received, sent) by the server, or (sent, sent) for the all-reduce, from the trainer's last line on it."""
    m = re.search(r"the server \(rank 0\): received (\d+) bytes of gradients \+ sent (\d+) bytes", out)
    if m:
        return int(m.group(1)), int(m.group(2))
    m = re.search(r"each rank alike\): sent (\d+) bytes", out)
    return (int(m.group(1)), int(m.group(1))) if m else (None, None)


def main():
    runner = Runner(None)
    if not runner.mpirun:
        print("SKIP: parameter server (mpirun is not installed)")
        return 0
    work = tempfile.mkdtemp(prefix="llmc_ps_")
    try:
        rng = np.random.default_rng(0)
        write_shard(os.path.join(work, "train_000.bin"), rng.integers(0, V, size=16384))
        r = Runner(work)
        server = ["--data-parallel", "server"]

        # ---- 1, 2. server == all-reduce bit for bit; the bytes
        runs = {}
        for N in (2, 3):
            batch = ["--total-batch-tokens", str(32 * N)]
            ring, ring_out = r.dump(f"allreduce{N}", N, *batch, model=MODEL, steps=4)
            ps, ps_out = r.dump(f"server{N}", N, *batch, *server, model=MODEL, steps=4)
            runs[N] = ps
            check_bitwise(f"{N} ranks: --data-parallel server == allreduce, bit for bit (4 steps' losses, step-1 "
                          f"gradient, final weights)", ps, ring, keys=("losses", "params", "grads"))
            received, sent = traffic(ps_out)
            want = (N - 1) * P * 4
            report(received == want and sent == want,
                   f"{N} ranks: through the server {received} + {sent} bytes per step = 2 (N-1) x P x 4 = {2 * want}",
                   f"received {received}, sent {sent}, want {want} each: {ps_out[-800:]}")
            check_predictions(f"{N} ranks, server", ps_out, N)
            ring_sent, _ = traffic(ring_out)
            shard = -(-P // (N * GRANULE)) * GRANULE
            report(ring_sent == 2 * (N - 1) * shard * 4,
                   f"{N} ranks: an all-reduce rank sends 2 (N-1) x shard x 4 = {ring_sent} bytes ({ring_sent / (P * 4):.3f} x "
                   f"the weights; the shard is P/N padded to {GRANULE} floats)", f"sent {ring_sent}: {ring_out[-800:]}")

        # --estimate (no run) predicts what the run counts: rank 0 sends the weights to N-1 workers,
        # each worker its gradient once. (It printed the all-reduce's bytes until --estimate and the run
        # took their techniques from the one translation, estimate.h's estimate_take_techniques.)
        est = subprocess.run([os.path.join(ROOT, "train_gpt_cpu"), "--estimate", "--estimate-ranks", "3", *server,
                              "--model", MODEL, "--batch-size", "1", "--seq-len", "32", "--total-batch-tokens", "96"],
                             capture_output=True, text=True).stdout
        sends = {int(a): int(b) for a, b in re.findall(r"rank (\d+) sends: data=(\d+)", est)}
        report(sends.get(0) == 2 * P * 4 and sends.get(1) == P * 4 and sends.get(2) == P * 4,
               f"--estimate, 3 ranks, server: rank 0 sends 2 x P x 4 = {2 * P * 4} bytes, each worker P x 4 = {P * 4}",
               f"sends {sends}: {est[-800:]}")

        # ---- 3. checkpoint and resume
        batch = ["--total-batch-tokens", "64"]
        straight, _ = r.dump("straight", 2, *batch, *server, "--checkpoint-every", 3, model=MODEL, steps=6)
        ckpt = os.path.join(work, "out", "ckpt_00000003")
        resumed, out = r.dump("resumed", 2, *batch, *server, "--resume", ckpt, model=MODEL, steps=6)
        if straight is not None and resumed is not None:
            report("resumed from" in out and np.array_equal(resumed["params"], straight["params"]) and
                   np.array_equal(resumed["losses"], straight["losses"][3:]),
                   "server: 3 steps + checkpoint + resume + 3 steps == 6 straight, bit for bit", out[-800:])

        # ---- 4. bad values and combinations
        base = ["--model", MODEL, "--train-data", os.path.join(work, "train_*.bin"), "--val-data", "none", "--seq-len", "32"]
        one_line_error("--data-parallel ring", base + ["--data-parallel", "ring"], 2, "must be allreduce or server")
        for flags, needle in [(["--zero", "1"], "use --zero 0 or --data-parallel allreduce"),
                              (["--tensor-parallel", "2"], "drop --tensor-parallel/--pipeline-parallel"),
                              (["--grad-compression", "bf16"], "use --grad-compression none")]:
            code, out, err = r.run(2, "--total-batch-tokens", "64", *server, *flags, model=MODEL, steps=1)
            report(code == 2 and err.count("error:") == 1 and needle in err,
                   f"server with {' '.join(flags)} on 2 ranks -> one line, exit 2", f"exit {code}: {err[-500:]}")
        gpu = gpu_trainer()
        if gpu:
            one_line_error("the GPU trainer: --data-parallel server", ["--data-parallel", "server"], 2, "NCCL's all-reduce",
                           binary=gpu)
        else:
            print("SKIP: the GPU trainer's refusal (no build/emu/train_gpt or train_gpt: make emu)")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
