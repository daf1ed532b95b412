#!/usr/bin/env python3
"""test_bad_inputs.py — the CPU trainer on inputs that once crashed, hung, read out of bounds or left
a checkpoint that could not be resumed (issue 16). Each must now end in ONE line on stderr,
"error: ...", naming the problem, and a non-zero exit (1 bad input or failure, 2 bad usage), within
seconds; or, where the run can go on correctly, go on and say what it did.

  model headers    a header claiming V = Vp = 2^31-1, L = 2^30, or V = 20,000,000 in a 1.7 MB file:
                   refused from the header and the file's length, before anything is allocated
                   (was: std::bad_alloc, exit 134; or minutes of allocating)
  memory           --batch-size 10^9 --seq-len 16, --model L=2000,C=8192,H=64, --batch-size 100000
                   --seq-len 48: refused before allocating, with the need, the limit (MemAvailable)
                   and the largest micro-batch that fits (was: bad_alloc, or the OOM killer after 75 s)
  resume           a checkpoint resumed with a larger batch where the shard has no room left: moves
                   to the next shard and says so, and trains; on a shard smaller than its position:
                   refused; a position of 10^9, -10^6 or a step of -4 planted in state.bin: refused
                   (was: a read past the token buffer, a segfault, "step -4/5, lr -inf")
  bad steps        --lr 1e6 --lr-schedule constant --checkpoint-every 1: the steps with a non-finite
                   gradient norm are skipped, the run stops at the 3rd in a row naming the step, and
                   the latest checkpoint holds finite weights and resumes (was: a NaN checkpoint as
                   "latest"). Negative control: the finiteness check flags a planted NaN model.bin.
  checksums        a byte flipped in state.bin: --resume DIR refuses it; --resume latest skips a
                   checkpoint with a flipped byte, one without state.bin and one without model.bin,
                   saying which and why. (Header pokes remove checksums.txt, as in a checkpoint
                   written before checksums: the header's own checks must catch those.)
  pipelines        --pipeline-schedule zigzag, --virtual-stages 0, chunks for 1f1b, interleaved with
                   one chunk, zb-h1 with tensor parallelism (not written yet), 2bw with ZeRO-2 (the rest of
                   2bw's: test_pipeline_2bw.py; interleaved's layers and micro-batches under mpirun:
                   test_pipeline_interleaved.py), 2 layers cut into 2 x 2 chunks, 3 micro-batches in groups of 2:
                   each one line naming the constraint, exit 2
  model typos      --model T=64x, h=4, Q=1, C64 (a descriptor with a typo): one line naming the item and
                   the keys L, C, H, T, V, exit 2, on both trainers (the GPU one: the emulated build, else
                   the native one); a missing file, even with an '=' in its path: "neither a model file
                   nor a descriptor", exit 1 (was: that line, exit 1, for the typos too)
  precision        --precision fp16 (loss scaling means nothing in fp32), bf16 (names ./train_gpt), fp8
                   (names ./train_gpt --precision fp8) and fp4 (not a choice): one line, exit 2;
                   --precision fp32, the CPU trainer's own, trains
"""
import os, shutil, struct, subprocess, sys, tempfile, time
from checks import report, exit_code
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_shards import write_shard  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.environ.get("LLMC_CPU_TRAINER", os.path.join(ROOT, "train_gpt_cpu"))  # or a sanitizer build
MODEL = "L=2,C=64,H=4,T=64,V=512"

# training-state header offsets (llmc/io/formats.h, TrainStateHeader): step, and the loader's position
STATE_STEP, STATE_SHARD_INDEX, STATE_POSITION = 8, 72, 80


def run(args, timeout=60, binary=BIN):
    start = time.time()
    try:
        p = subprocess.run([binary] + args, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None, "", f"timed out after {timeout} s", timeout
    return p.returncode, p.stdout, p.stderr, time.time() - start


def one_line_error(name, args, code, *needles, seconds=30, binary=BIN):
    """The run ends within `seconds` with exit `code` and exactly one stderr line holding every needle."""
    rc, out, err, took = run(args, binary=binary)
    lines = err.strip().splitlines()
    ok = rc == code and len(lines) == 1 and lines[0].startswith("error: ") and all(n in lines[0] for n in needles) and took < seconds
    report(ok, f"{name} -> one line, exit {code} ({took:.1f} s)", f"exit {rc}, {took:.1f} s, stderr {err[-600:]!r}")
    return lines[0] if lines else ""


def gpu_trainer():
    """The GPU trainer the refusal checks run: the emulated build, else the native one, else None (a SKIP)."""
    return next((p for p in (os.path.join(ROOT, "build", "emu", "train_gpt"), os.path.join(ROOT, "train_gpt"))
                 if os.path.exists(p)), None)


def write_model_header(path, maxT, V, L, NH, C, Vp, total_bytes):
    header = np.zeros(256, dtype=np.int32)
    header[:8] = [20240326, 3, maxT, V, L, NH, C, Vp]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(b"\0" * (total_bytes - 1024))


def poke_state(src_dir, dst_dir, offset, value):
    """A copy of checkpoint src_dir with one int64 of state.bin's header replaced, and no checksums.txt
    (as a checkpoint written before checksums existed): the header's own checks must catch it."""
    shutil.copytree(src_dir, dst_dir)
    os.remove(os.path.join(dst_dir, "checksums.txt"))
    with open(os.path.join(dst_dir, "state.bin"), "r+b") as f:
        f.seek(offset)
        f.write(struct.pack("<q", value))


def flip_byte(path, offset):
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)[0]
        f.seek(offset)
        f.write(bytes([b ^ 0x10]))


def model_is_finite(path):
    """Every parameter of a version-3 model file is finite (read with numpy, not with our reader)."""
    params = np.fromfile(path, dtype="<f4", offset=1024)
    return params.size > 0 and bool(np.all(np.isfinite(params)))


def main():
    if not os.path.exists(BIN):
        print("SKIP: bad inputs (train_gpt_cpu not built)")
        return 0
    tmp = tempfile.mkdtemp(prefix="llmc_bad_inputs_")
    rng = np.random.default_rng(0)
    train = os.path.join(tmp, "train.bin")
    write_shard(train, rng.integers(0, 512, 1000))
    small = os.path.join(tmp, "small.bin")
    write_shard(small, rng.integers(0, 512, 500))
    base = ["--train-data", train, "--val-data", "none", "--threads", "1"]

    # ---- model headers that promise more than the file holds
    for name, shape, size in [("V = Vp = 2^31-1", (64, 2**31 - 1, 2, 4, 64, 2**31 - 1), 1 << 20),
                              ("L = 2^30", (64, 512, 2**30, 4, 64, 512), 1 << 20),
                              ("V = 20,000,000 in a 1.7 MB file", (64, 20_000_000, 2, 4, 64, 20_000_000), 1_700_000)]:
        path = os.path.join(tmp, "huge.bin")
        write_model_header(path, *shape, size)
        one_line_error(f"model header {name}", ["--model", path] + base, 1, "huge.bin", "header")
    rc, out, err, _ = run(["--model", path, "--estimate"])
    report(rc == 1 and len(err.strip().splitlines()) == 1 and "truncated" in err, "--estimate on that file: one line, exit 1",
           f"exit {rc}, {err!r}")

    # ---- model-descriptor typos (llmc/model/model.h, parse_model_descriptor): the bad item and the
    # keys, exit 2, on both trainers; a missing file stays "neither a model file nor a descriptor", exit 1
    gpu = gpu_trainer()
    keys = "L (layers), C (channels), H (heads), T (max sequence length), V (vocabulary)"
    for binary, who in [(BIN, "CPU")] + ([(gpu, "GPU")] if gpu else []):
        flags = base if binary == BIN else base[:4]  # (--threads is the CPU trainer's)
        for spec, needles in [("L=2,C=64,H=4,T=64x", ["'T=64x'", "not a whole number"]),
                              ("L=2,C=64,h=4", ["unknown key 'h'"]),
                              ("L=2,C=64,H=4,T=32,Q=1", ["unknown key 'Q'"]),
                              ("L=2,C64,H=4", ["no value in 'C64'"])]:
            one_line_error(f"{who}: --model {spec}", ["--model", spec] + flags, 2, f"--model '{spec}'", keys, *needles, binary=binary)
        for missing in ["no_such_model.bin", os.path.join("lr=0.01", "model.bin")]:
            one_line_error(f"{who}: --model TMP/{missing} (a missing file)", ["--model", os.path.join(tmp, missing)] + flags, 1,
                           "neither a model file nor a descriptor", binary=binary)
    if not gpu:
        print("SKIP: model-descriptor typos on the GPU trainer (neither build/emu/train_gpt nor train_gpt is built)")

    # ---- pipeline schedules (llmc/parallel/pipeline_schedule.h): values that name no schedule, chunks
    # for a schedule without them, interleaving that cannot cut the layers or group the micro-batches
    pipe = ["--model", "L=2,C=64,H=4,T=32,V=512", "--batch-size", "1", "--seq-len", "32", "--pipeline-parallel", "2"]
    for args, needles in [(["--pipeline-schedule", "zigzag"], ["gpipe, 1f1b, interleaved, zb-h1, 2bw or 2bw-flush", "zigzag"]),
                          (["--pipeline-schedule", "2bw", "--zero", "2"], ["2bw with --zero 2", "--zero 0 or 1"]),
                          (["--pipeline-schedule", "zb-h1", "--tensor-parallel", "2"], ["zb-h1 with --tensor-parallel",
                                                                                         "--tensor-parallel 1", "1f1b"]),
                          (["--virtual-stages", "0"], ["--virtual-stages must be at least 1"]),
                          (["--virtual-stages", "2"], ["needs --pipeline-schedule interleaved", "1f1b"]),
                          (["--pipeline-schedule", "interleaved"], ["--virtual-stages 2 or more"]),
                          (["--pipeline-schedule", "interleaved", "--virtual-stages", "2", "--total-batch-tokens", "128",
                            "--pipeline-print-schedule"], ["2 layers", "2 x 2 = 4", "a model of 4 layers"]),
                          (["--model", "L=4,C=64,H=4,T=32,V=512", "--pipeline-schedule", "interleaved", "--virtual-stages", "2",
                            "--total-batch-tokens", "96", "--pipeline-print-schedule"], ["groups of p = 2", "make it 2 or 4"])]:
        one_line_error(" ".join(args), pipe + args + base, 2, *needles)

    # ---- --offload: the CPU trainer's optimizer state is already in host memory (test/test_offload.py: the GPU's)
    one_line_error("--offload optimizer", ["--model", "L=2,C=64,H=4,T=32,V=512", "--offload", "optimizer"] + base, 2,
                   "--offload applies only to the GPU trainer", "already in host memory")
    one_line_error("--offload-delay 1", ["--model", "L=2,C=64,H=4,T=32,V=512", "--offload-delay", "1"] + base, 2,
                   "--offload-delay applies only to the GPU trainer")
    # ---- --precision (llmc/run/cli.h, validate_precision): the CPU trainer is fp32; fp16 and bf16 are
    # refused naming why and what to run, a typo naming the choices; fp32 (its own) trains
    for args, needles in [(["--precision", "fp16"], ["--precision fp16", "fp32 only", "loss scaling means nothing"]),
                          (["--precision", "bf16"], ["--precision bf16", "./train_gpt"]),
                          (["--precision", "fp8"], ["--precision fp8", "./train_gpt --precision fp8"]),
                          (["--precision", "fp4"], ["bf16, fp16, fp32 or fp8", "'fp4'"])]:
        one_line_error(" ".join(args), ["--model", MODEL, "--steps", "1"] + args + base, 2, *needles)
    rc, out, err, _ = run(["--model", MODEL, "--batch-size", "2", "--seq-len", "32", "--steps", "1", "--precision", "fp32",
                           "--out-dir", os.path.join(tmp, "fp32")] + base)
    report(rc == 0, "--precision fp32 (the CPU trainer's own) trains", f"exit {rc}, {err[-300:]!r}")

    # ---- runs that cannot fit in this machine's memory: refused before allocating
    for args in (["--batch-size", "1000000000", "--seq-len", "16"], ["--model", "L=2000,C=8192,H=64"],
                 ["--batch-size", "100000", "--seq-len", "48"]):
        line = one_line_error(" ".join(args), base + args, 2, "needs", "available memory", "--estimate")
        advice = "not even --batch-size 1 fits" if args[0] == "--model" else "the largest micro-batch that fits is --batch-size"
        report(advice in line, f"{' '.join(args)}: says '{advice}'", line)

    # ---- resume on other settings: a checkpoint at step 5 of B=4, T=32 (position 640 of 1000 tokens)
    out_dir = os.path.join(tmp, "run")
    rc, out, err, _ = run(["--model", MODEL, "--batch-size", "4", "--seq-len", "32", "--steps", "5", "--checkpoint-every", "5",
                           "--out-dir", out_dir] + base)
    ckpt = os.path.join(out_dir, "ckpt_00000005")
    if rc != 0:
        report(False, "a checkpoint to resume from", err[-800:])
        return 1
    # B=12: 640 + 12*32 + 1 > 1000 tokens: no room left in the shard, so the run continues at the next one
    rc, out, err, _ = run(["--model", MODEL, "--batch-size", "12", "--seq-len", "32", "--steps", "7", "--resume", ckpt,
                           "--out-dir", os.path.join(tmp, "b12")] + base)
    report(rc == 0 and "continuing at the start of shard 0" in out and "step     7/7" in out,
           "resume with B=12 where the shard has no room for a step: moves to the next shard, says so, trains",
           f"exit {rc}: {out[-500:]} {err[-500:]}")
    rc, out, err, _ = run(["--model", MODEL, "--batch-size", "8", "--seq-len", "32", "--steps", "7", "--resume", ckpt,
                           "--out-dir", os.path.join(tmp, "b8")] + base)
    report(rc == 0 and "continuing at the start" not in out and "step     7/7" in out,
           "resume with B=8 where the shard has room: continues at the checkpoint's token", f"exit {rc}: {out[-500:]} {err[-500:]}")
    one_line_error("resume on a shard smaller than the checkpoint's position (640 of 500 tokens)",
                   ["--model", MODEL, "--batch-size", "4", "--seq-len", "32", "--steps", "7", "--resume", ckpt,
                    "--train-data", small, "--val-data", "none", "--out-dir", os.path.join(tmp, "small")], 1,
                   "token 640", "outside that shard", "small.bin")
    for name, offset, value, needles in [("a position of 10^9", STATE_POSITION, 10**9, ("token 1000000000", "outside that shard")),
                                         ("a position of -10^6", STATE_POSITION, -10**6, ("state.bin", "negative")),
                                         ("a shard index of 7", STATE_SHARD_INDEX, 7, ("shard 7", "does not exist")),
                                         ("a step of -4", STATE_STEP, -4, ("state.bin", "step -4")),
                                         ("10^6 skipped updates", 964, 10**6, ("state.bin", "1000000 skipped updates"))]:
        bad = os.path.join(tmp, f"poked_{offset}_{value}")
        poke_state(ckpt, bad, offset, value)
        one_line_error(f"state.bin with {name}", ["--model", MODEL, "--batch-size", "4", "--seq-len", "32", "--steps", "7",
                                                  "--resume", bad, "--out-dir", os.path.join(tmp, "poked")] + base, 1, *needles)
    flipped = os.path.join(tmp, "flipped")
    shutil.copytree(ckpt, flipped)
    flip_byte(os.path.join(flipped, "state.bin"), 1024 + 4 * 100)  # one bit of AdamW's m
    one_line_error("a byte flipped inside state.bin (checksums.txt)", ["--model", MODEL, "--batch-size", "4", "--seq-len", "32",
                   "--steps", "7", "--resume", flipped, "--out-dir", os.path.join(tmp, "poked")] + base, 1,
                   "state.bin does not match its checksum")

    # ---- a learning rate that sends the gradient norm to NaN: no poisoned checkpoint
    nan_dir = os.path.join(tmp, "nan")
    rc, out, err, _ = run(["--model", MODEL, "--batch-size", "4", "--seq-len", "32", "--steps", "12", "--lr", "1e6",
                           "--lr-schedule", "constant", "--checkpoint-every", "1", "--out-dir", nan_dir] + base)
    lines = err.strip().splitlines()
    skipped = [l for l in out.splitlines() if "update skipped" in l]
    report(rc == 1 and len(lines) == 1 and "training diverged" in lines[0] and "3 steps in a row" in lines[0] and len(skipped) == 2,
           "--lr 1e6: non-finite steps are skipped, the 3rd in a row stops the run naming its step",
           f"exit {rc}, {len(skipped)} skipped, stderr {err[-500:]!r}")
    ckpts = sorted(d for d in os.listdir(nan_dir) if d.startswith("ckpt_"))
    latest = os.path.join(nan_dir, ckpts[-1]) if ckpts else ""
    finite = bool(ckpts) and all(model_is_finite(os.path.join(nan_dir, d, "model.bin")) for d in ckpts)
    report(finite, f"every checkpoint it left ({len(ckpts)}, latest {ckpts[-1] if ckpts else None}) holds finite weights")
    rc, out, err, _ = run(["--model", MODEL, "--batch-size", "4", "--seq-len", "32", "--steps", "12", "--lr", "1e-4",
                           "--resume", "latest", "--out-dir", nan_dir, "--max-bad-steps", "100"] + base)
    report(f"resumed from {latest}" in out and "error" not in err.replace("training diverged", ""),
           "--resume latest loads the newest of them", f"exit {rc}: {out[-300:]} {err[-300:]}")
    planted = os.path.join(tmp, "planted.bin")
    shutil.copy(os.path.join(latest, "model.bin"), planted)
    with open(planted, "r+b") as f:
        f.seek(1024 + 4 * 1000)
        f.write(struct.pack("<f", float("nan")))
    report(not model_is_finite(planted), "negative control: the finiteness check flags one NaN planted in model.bin")

    # ---- --resume latest: a newer checkpoint without state.bin is skipped like one without model.bin
    latest_dir = os.path.join(tmp, "latest")
    rc, out, err, _ = run(["--model", MODEL, "--batch-size", "4", "--seq-len", "32", "--steps", "4", "--checkpoint-every", "1",
                           "--out-dir", latest_dir] + base)
    flip_byte(os.path.join(latest_dir, "ckpt_00000004", "model.bin"), 1024 + 4 * 5000)
    os.remove(os.path.join(latest_dir, "ckpt_00000003", "state.bin"))
    os.remove(os.path.join(latest_dir, "ckpt_00000002", "model.bin"))
    rc, out, err, _ = run(["--model", MODEL, "--batch-size", "4", "--seq-len", "32", "--steps", "5", "--resume", "latest",
                           "--out-dir", latest_dir] + base)
    ckpt_n = lambda n: os.path.join(latest_dir, f"ckpt_{n:08d}")
    report(rc == 0 and f"skipping {ckpt_n(4)}: model.bin does not match its checksum" in out and
           f"skipping {ckpt_n(3)}: no state.bin" in out and f"skipping {ckpt_n(2)}: no model.bin" in out and
           f"resumed from {ckpt_n(1)}" in out,
           "--resume latest skips a checkpoint with a flipped byte, one without state.bin and one without model.bin, saying so",
           f"exit {rc}: {out[:700]} {err[-300:]}")
    shutil.rmtree(tmp)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
