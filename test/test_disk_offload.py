#!/usr/bin/env python3
"""test_disk_offload.py — --offload-dir DIR on the CPU trainer (llmc/optim/disk_offload.h): AdamW's m
and v in files, streamed through the step in chunks, a helper thread reading chunk k+1 while chunk k
is updated and written back.

The model is test_parallelism's (L=4 C=64 T=32 V=501: 234,880 parameters) with --offload-chunk-kib 1:
chunks of 256 floats, smaller than every weight matrix, so chunks cut tensors (and weight decay's
boundaries) everywhere, and 234,880 = 917 x 256 + 128, so the last chunk is a partial one.

  bit for bit      the offloaded run == the run with m and v in RAM, 5 steps: losses, final weights
                   (--dump-state) and the state.bin of both checkpoints (written from the files,
                   through the chunks); also with one chunk bigger than the whole state (the default
                   4096 KiB). The reference is the in-memory run: the same adamw_update, so any
                   difference is the streaming's (a chunk read from the wrong place, one not written).
  bf16 moments     --optimizer-state bf16: m and v rest in bf16 in the files (adamw_update_bf16 on each chunk,
                   its rounding keyed by the element's index in the model): 5 steps == bf16 moments in RAM,
                   bit for bit (losses, weights, state.bin), 1 KiB chunks of 512 moments cutting the
                   model; its checkpoint resumes bit for bit; --estimate's disk line 4 bytes per
                   parameter; the free-space check counts that (1,000,000 bytes free: bf16 trains, fp32
                   is refused; 900,000: bf16 refused naming its 917.5 KiB need).
  resume           3 steps + checkpoint + 2 == 5 straight, bit for bit, crossing both ways: an
                   in-memory checkpoint resumed with --offload-dir and an offloaded one without it.
  memory           --print-allocations holds what --estimate's table says, to the byte (adam_m and
                   adam_v: two chunks each, 2,048 bytes), and --estimate's disk line is 8 bytes per
                   parameter; the files are gone after a finished run (scratch: the checkpoints hold
                   the state).
  ZeRO over MPI    2 ranks ZeRO-1 and ZeRO-0 (each rank its own files, rank<r>_m.bin) == the same grid
                   in RAM, bit for bit, with every rank's memory and traffic as --estimate predicts.
  refusals         one line each: DIR missing, a file, not writable, too little free space (the test
                   hook LLMC_TEST_OFFLOAD_FREE_BYTES; the need and the space named), on 2 ranks the
                   need of both (exit 2, before anything is allocated); Adafactor, ZeRO-2,
                   tensor parallelism, a zero chunk, a chunk without DIR (exit 2); the GPU trainer.
  vanishing file   LLMC_TEST_OFFLOAD_REMOVE=0:4 deletes rank 0's m file at the start of step 4 of a run
                   checkpointing every 2 steps: exit 1, one line; ckpt 2 is the last checkpoint, whole
                   (its checksums verify when resumed) and resuming it gives the straight run's bits.

Planted bugs these checks caught (by hand, once): the helper reading chunk k+2 in place of k+1 (10
checks failed: bit for bit, both checkpoints, resume, ZeRO; weights 3e-3 off); the last, partial chunk
not written back (9 failed, weights 1.6e-3 off).
"""
import os, re, shutil, subprocess, sys, tempfile
import numpy as np
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from safetensors_io import read_safetensors  # noqa: E402
from token_shards import write_shard  # noqa: E402
from test_parallelism import MODEL, T, Runner, check_predictions  # noqa: E402
from test_bad_inputs import one_line_error, gpu_trainer  # noqa: E402

BIN = os.path.join(ROOT, "train_gpt_cpu")
PARAMS = 234880
CHUNK = ["--offload-chunk-kib", "1"]  # 256 floats


class Single:
    """One process, no mpirun: the runs whose stderr must be one line."""
    def __init__(self, work):
        self.work = work

    def args(self, out, steps=5, *flags):
        return ["--model", MODEL, "--train-data", os.path.join(self.work, "train_*.bin"), "--val-data", "none",
                "--seq-len", str(T), "--steps", str(steps), "--lr", "1e-3", "--threads", "1", "--batch-size", "1",
                "--total-batch-tokens", str(4 * T), "--out-dir", os.path.join(self.work, out)] + [str(f) for f in flags]

    def run(self, out, steps, *flags, env=None):
        p = subprocess.run([BIN] + self.args(out, steps, *flags), capture_output=True, text=True, timeout=120,
                           env=dict(os.environ, **(env or {})))
        return p

    def dump(self, name, steps, *flags):
        path = os.path.join(self.work, name + ".st")
        p = self.run(name, steps, *flags, "--dump-state", path)
        if p.returncode != 0 or not os.path.exists(path):
            report(False, name, f"exit {p.returncode}: {(p.stdout + p.stderr)[-2000:]}")
            return None, p.stdout
        return read_safetensors(path, names=["params", "losses"])[0], p.stdout


def same(a, b):
    return a is not None and b is not None and np.array_equal(a["params"], b["params"]) and np.array_equal(a["losses"], b["losses"])


def differ(a, b):
    if a is None or b is None:
        return "a run failed"
    return f"weights differ by up to {np.max(np.abs(a['params'].astype(np.float64) - b['params'])):.2e}"


def file_bytes(path):
    with open(path, "rb") as f:
        return f.read()


def main():
    if not os.path.exists(BIN):
        print("FAIL: disk offload: train_gpt_cpu is not built (run make)")
        return 1
    work = tempfile.mkdtemp(prefix="llmc_disk_offload_")
    try:
        write_shard(os.path.join(work, "train_000.bin"), np.random.default_rng(0).integers(0, 501, size=16384))
        s = Single(work)
        disk = os.path.join(work, "disk")
        os.makedirs(disk)
        off = ["--offload-dir", disk] + CHUNK
        report(PARAMS % 256 != 0 and PARAMS > 256 * 500, "the layout: 256-float chunks cut the model, the last one partial",
               f"{PARAMS} parameters")

        # ---- bit for bit against m and v in RAM, checkpoints included
        ram, _ = s.dump("ram", 5, "--checkpoint-every", 3)
        offl, out = s.dump("offl", 5, "--checkpoint-every", 3, *off, "--print-allocations")
        report(same(offl, ram), "--offload-dir, 256-float chunks: 5 steps == m and v in RAM, bit for bit (losses, weights)",
               differ(offl, ram))
        for step in (3, 5):
            a = os.path.join(work, "ram", f"ckpt_{step:08d}", "state.bin")
            b = os.path.join(work, "offl", f"ckpt_{step:08d}", "state.bin")
            ok = os.path.exists(a) and os.path.exists(b) and file_bytes(a) == file_bytes(b)
            report(ok, f"--offload-dir: the checkpoint's state.bin at step {step} (m and v streamed from the files) == "
                   "the in-memory run's, byte for byte")
        big, _ = s.dump("big", 5, "--offload-dir", disk)
        report(same(big, ram), "--offload-dir, one 4096 KiB chunk holding all of m and v == in RAM, bit for bit", differ(big, ram))
        report(os.listdir(disk) == [], "--offload-dir: the files are removed at the end of a finished run", str(os.listdir(disk)))

        # ---- memory: held == --estimate's table, disk 8 bytes per parameter
        held = dict(re.findall(r"^allocation: rank 0 (\w+) (\d+)$", out, re.M))
        est = subprocess.run([BIN, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--estimate"] + off,
                             capture_output=True, text=True).stdout
        rows = {m.group(1): m.group(2) for m in re.finditer(r"^  (\w+)\s+\w+\s+.*?\s(\d+)  \S+ ?\S*$", est, re.M)}
        total = re.search(r"^  total\s+(\d+)  ", est, re.M)
        rows["total"] = total.group(1) if total else None
        want_slots = str(2 * 256 * 4)
        report(held.get("adam_m") == want_slots and held.get("adam_v") == want_slots and rows.get("adam_m") == want_slots,
               f"--offload-dir: adam_m and adam_v hold two chunks each ({want_slots} bytes), as --estimate's table says",
               f"held {held.get('adam_m')}, {held.get('adam_v')}; estimated {rows.get('adam_m')}")
        mismatched = [k for k, v in held.items() if rows.get(k, "0") != v]
        report(held and not mismatched, "--offload-dir: every buffer held == --estimate's row, to the byte",
               f"differ: {[(k, held[k], rows.get(k)) for k in mismatched]}")
        m = re.search(r"disk \(--offload-dir\)\s+([\d,]+)", est)
        report(m and int(m.group(1).replace(",", "")) == 8 * PARAMS, f"--estimate: {8 * PARAMS} bytes on disk, 8 per parameter",
               m.group(0) if m else est[-1500:])

        # ---- --optimizer-state bf16: m and v rest in bf16 on disk (4 bytes per parameter); 1 KiB chunks of 512
        # moments cut the model as above (234,880 = 458 x 512 + 384: the last one partial)
        bf16 = ["--optimizer-state", "bf16"]
        ram16, _ = s.dump("ram16", 5, "--checkpoint-every", 3, *bf16)
        offl16, out16 = s.dump("offl16", 5, "--checkpoint-every", 3, *bf16, *off, "--print-allocations")
        states = [file_bytes(os.path.join(work, d, "ckpt_00000005", "state.bin")) for d in ("ram16", "offl16")]
        report(same(offl16, ram16) and states[0] == states[1], "--offload-dir with bf16 moments, 512-moment chunks: 5 steps == "
               "bf16 m and v in RAM, bit for bit (losses, weights, state.bin)", differ(offl16, ram16))
        resumed16, _ = s.dump("offl16_resumed", 5, "--resume", os.path.join(work, "offl16", "ckpt_00000003"), *bf16, *off)
        tail16 = dict(ram16, losses=ram16["losses"][3:]) if ram16 is not None else None
        report(same(resumed16, tail16), "--offload-dir with bf16 moments: its checkpoint at step 3 resumed + 2 steps == 5 "
               "straight, bit for bit", differ(resumed16, tail16))
        held16 = dict(re.findall(r"^allocation: rank 0 (\w+) (\d+)$", out16, re.M))
        est16 = subprocess.run([BIN, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--estimate"] + off + bf16,
                               capture_output=True, text=True).stdout
        m = re.search(r"disk \(--offload-dir\)\s+([\d,]+)", est16)
        report(m and int(m.group(1).replace(",", "")) == 4 * PARAMS and held16.get("adam_m") == str(2 * 1024),
               f"--offload-dir with bf16 moments: --estimate's disk line {4 * PARAMS} bytes, 4 per parameter; adam_m holds "
               "two 1 KiB chunks", f"{m.group(0) if m else est16[-800:]}; adam_m {held16.get('adam_m')}")
        # 1,000,000 bytes free: fp32's 1.8 MiB is refused (below), bf16's 917.5 KiB fits
        p = s.run("bf16_fits", 1, *bf16, *off, env={"LLMC_TEST_OFFLOAD_FREE_BYTES": "1000000"})
        report(p.returncode == 0, "--offload-dir with bf16 moments: the free-space check counts 4 bytes per parameter "
               "(917.5 KiB fits in 976.6 KiB free, where fp32's 1.8 MiB is refused)", f"exit {p.returncode}: {p.stderr[-600:]}")
        p = s.run("bf16_small", 1, *bf16, *off, env={"LLMC_TEST_OFFLOAD_FREE_BYTES": "900000"})
        report(p.returncode == 2 and "need 917.5 KiB" in p.stderr and "4 bytes for each" in p.stderr,
               "--offload-dir with bf16 moments and 878.9 KiB free: refused, naming the bf16 need", f"exit {p.returncode}: "
               f"{p.stderr[-600:]}")

        # ---- resume, crossing: in RAM -> offloaded and offloaded -> in RAM
        a, _ = s.dump("ram_to_offl", 5, "--resume", os.path.join(work, "ram", "ckpt_00000003"), *off)
        b, _ = s.dump("offl_to_ram", 5, "--resume", os.path.join(work, "offl", "ckpt_00000003"))
        tail = dict(ram, losses=ram["losses"][3:]) if ram is not None else None
        report(same(a, tail), "an in-memory checkpoint at step 3 resumed with --offload-dir + 2 steps == 5 straight, bit for bit",
               differ(a, tail))
        report(same(b, tail), "an --offload-dir checkpoint at step 3 resumed in RAM + 2 steps == 5 straight, bit for bit",
               differ(b, tail))

        # ---- ZeRO-0 and ZeRO-1 over 2 ranks: each rank its own files
        if not shutil.which("mpirun"):
            print("SKIP: disk offload over MPI (mpirun is not installed)")
        else:
            r = Runner(work)
            for zero in (1, 0):
                base, _ = r.dump(f"z{zero}_ram", 2, "--zero", zero, steps=5)
                got, out = r.dump(f"z{zero}_offl", 2, "--zero", zero, "--offload-dir", disk, *CHUNK, steps=5)
                report(same(got, base), f"--offload-dir, 2 ranks ZeRO-{zero}: == the same grid in RAM, bit for bit", differ(got, base))
                check_predictions(f"--offload-dir 2 ranks ZeRO-{zero}", out, 2)
            code, _, err = r.run(2, "--zero", 1, "--offload-dir", disk, *CHUNK, steps=1,
                                 env={"LLMC_TEST_OFFLOAD_FREE_BYTES": str(12 * PARAMS // 2)})
            report(code == 2 and "need 1.8 MiB" in err and "2 ranks" in err,
                   "--offload-dir, 2 ranks ZeRO-1: the need is both ranks' files (1.8 MiB), refused with 1.3 MiB free, exit 2",
                   f"exit {code}: {err[-600:]}")

        # ---- refusals before anything is allocated: exit 2, one line
        flags = s.args("bad", 1)
        one_line_error("--offload-dir that does not exist", flags + ["--offload-dir", os.path.join(work, "nope")], 2,
                       "is not a directory", "nope")
        one_line_error("--offload-dir naming a file", flags + ["--offload-dir", os.path.join(work, "train_000.bin")], 2,
                       "is not a directory")
        locked = os.path.join(work, "locked")
        os.makedirs(locked)
        os.chmod(locked, 0o555)
        if os.access(locked, os.W_OK):  # root writes anywhere: a directory on a read-only mount instead
            locked = "/proc/sys" if not os.access("/proc/sys", os.W_OK) else None
        if locked:
            one_line_error(f"--offload-dir not writable ({locked})", flags + ["--offload-dir", locked], 2, "is not writable")
        else:
            print("SKIP: --offload-dir not writable (running as root with no read-only directory to name)")
        env = dict(os.environ, LLMC_TEST_OFFLOAD_FREE_BYTES="1000000")
        p = subprocess.run([BIN] + flags + off, capture_output=True, text=True, env=env)
        lines = p.stderr.strip().splitlines()
        report(p.returncode == 2 and len(lines) == 1 and "976.6 KiB free" in lines[0] and "need 1.8 MiB" in lines[0]
               and str(PARAMS) in lines[0], "--offload-dir with too little free space: the need and the space in one line, exit 2",
               f"exit {p.returncode}: {p.stderr[-600:]}")
        for bad, words in ((["--optimizer", "adafactor"], ["--optimizer adafactor", "stay in RAM"]),
                           (["--zero", "2"], ["--zero 2", "--zero 0 or 1"]),
                           (["--tensor-parallel", "2"], ["--tensor-parallel 2"])):
            one_line_error(f"--offload-dir with {' '.join(bad)}", flags + off + bad, 2, *words)
        one_line_error("--offload-chunk-kib 0", flags + ["--offload-dir", disk, "--offload-chunk-kib", "0"], 2,
                       "--offload-chunk-kib")
        one_line_error("--offload-chunk-kib without --offload-dir", flags + CHUNK, 2, "give --offload-dir")
        gpu = gpu_trainer()
        if gpu:
            one_line_error("the GPU trainer refuses --offload-dir", ["--model", MODEL, "--offload-dir", disk], 2,
                           "--offload-dir applies only to the CPU trainer", "--offload optimizer", binary=gpu)
        else:
            print("SKIP: the GPU trainer's refusal of --offload-dir (build/emu/train_gpt is not built: make emu)")

        # ---- the file vanishes mid-run: one line, exit 1, the last checkpoint whole and resumable
        p = s.run("vanish", 6, "--checkpoint-every", 2, *off, env={"LLMC_TEST_OFFLOAD_REMOVE": "0:4"})
        lines = p.stderr.strip().splitlines()
        report(p.returncode == 1 and len(lines) == 1 and "rank0_m.bin' was removed" in lines[0] and "resume" in lines[0],
               "--offload-dir: the m file removed before step 4 -> one line, exit 1", f"exit {p.returncode}: {p.stderr[-600:]}")
        ckpts = sorted(d for d in os.listdir(os.path.join(work, "vanish")) if d.startswith("ckpt_"))
        report(ckpts == ["ckpt_00000002"], "after it, the last checkpoint is step 2's, and nothing half-written", str(ckpts))
        straight, _ = s.dump("straight6", 6)
        resumed, out = s.dump("vanish_resumed", 6, "--resume", os.path.join(work, "vanish", "ckpt_00000002"), *off)
        tail = dict(straight, losses=straight["losses"][2:]) if straight is not None else None
        report(same(resumed, tail) and "resumed from" in out,
               "the last checkpoint (step 2) resumed with --offload-dir + 4 steps == 6 straight, bit for bit", differ(resumed, tail))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
