#!/usr/bin/env python3
"""test_resume_options.py — runs that save by default and resumes that continue the run (issue 40, items 1-2).

On the CPU trainer and the GPU trainer (./train_gpt on a GPU, else the CUDA emulation build/emu/train_gpt),
tiny model (L=2, C=32, H=2, V=512), random-token shards, each run a few steps:

  saved by default   a run without --checkpoint-every ends with a checkpoint, and its done: line names it;
                     --no-checkpoint and an explicit --checkpoint-every 0 write none and say so
  retention          --keep-checkpoints 2 leaves the newest two; a damaged newer checkpoint never counts
                     for a sound one; --resume latest then finds the newest sound one (CPU)
  continues the run  a run with lr 0.01, B=8, a linear schedule and warmup, checkpointed at step 3 and
                     resumed with no flags, ends bit for bit where the uninterrupted run ends (losses of
                     steps 4-6 and final weights from --dump-state, the final state.bin): the options come
                     from the checkpoint. A flag given with another value is printed as one override line
  the step count     --steps at or below the checkpoint's step: exit 2, one line naming --more-steps;
                     --more-steps K == --steps STEP+K (what scripts/run.sh --resume passed), bit for bit,
                     the schedule stretched (the lr of the step after the old end is not the old end's 0)
  --resume RUN_DIR   takes the folder's newest sound checkpoint and trains on in that folder
  a no-op            resuming a finished run (or a refused --steps) leaves metrics.jsonl byte-identical
  format versions    a checkpoint without recorded options (version 0: its header bytes zeroed) still
                     resumes on the flags given, bit for bit; a newer version is refused in one line (CPU:
                     the header's reader is shared host code)
"""
import os, shutil, struct, subprocess, sys, tempfile
import numpy as np
from checks import report, exit_code
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_shards import write_shard  # noqa: E402
from test_cpu_trainer import read_dump  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MODEL = "L=2,C=32,H=2,T=32,V=512"
OPTIONS_AT, OPTIONS_BYTES = 160, 4 + 800  # TrainStateHeader: options_version, then the record (llmc/io/formats.h)


def gpu_binary():
    real = os.path.join(ROOT, "train_gpt")
    try:
        if os.path.exists(real) and subprocess.run(["nvidia-smi", "-L"], capture_output=True).returncode == 0:
            return real
    except OSError:
        pass
    emu = os.path.join(ROOT, "build", "emu", "train_gpt")
    return emu if os.path.exists(emu) else None


class Trainer:
    def __init__(self, name, binary, tmp):
        self.name, self.binary, self.tmp = name, binary, tmp
        self.data = ["--train-data", os.path.join(tmp, "train.bin"), "--val-data", os.path.join(tmp, "val.bin"),
                     "--val-every", "0"] + (["--threads", "1"] if "cpu" in name else [])

    def path(self, *parts):
        return os.path.join(self.tmp, self.name, *parts)

    def run(self, *args):
        p = subprocess.run([self.binary, *self.data, *map(str, args)], capture_output=True, text=True, cwd=ROOT)
        return p.returncode, p.stdout, p.stderr

    def fresh(self, out, *args):
        return self.run("--model", MODEL, "--seq-len", 32, "--out-dir", self.path(out), *args)


def done_line(out):
    return ([ln for ln in out.splitlines() if ln.startswith("done:")] or [""])[-1]


def errors(err):
    return [ln for ln in err.splitlines() if ln.startswith("error:")]


def ckpts(folder):
    return sorted(n for n in os.listdir(folder) if n.startswith("ckpt_")) if os.path.isdir(folder) else []


def same_dump(a, b, first):
    """the final weights, and the losses of the steps after `first` (b resumed there)"""
    try:
        x, y = read_dump(a), read_dump(b)
    except (OSError, ValueError):
        return False
    return np.array_equal(x["params"], y["params"]) and np.array_equal(x["losses"][first:], y["losses"])


def same_bytes(a, b):
    return os.path.exists(a) and os.path.exists(b) and open(a, "rb").read() == open(b, "rb").read()


def check_saved_by_default(t):
    code, out, _ = t.fresh("plain", "--steps", 2)
    ck = t.path("plain", "ckpt_00000002")
    report(code == 0 and ckpts(t.path("plain")) == ["ckpt_00000002"] and done_line(out).endswith(f"| checkpoint {ck}"),
           f"{t.name}: a run without --checkpoint-every ends with a checkpoint, named on its done: line", done_line(out))
    for flags, why in ((["--no-checkpoint"], "--no-checkpoint"), (["--checkpoint-every", 0], "--checkpoint-every 0")):
        code, out, _ = t.fresh("none", "--steps", 2, *flags)
        report(code == 0 and ckpts(t.path("none")) == [] and done_line(out).endswith("| no checkpoint"),
               f"{t.name}: {why} writes no checkpoint and the done: line says so", f"exit {code}: {done_line(out)}")
    code, out, err = t.fresh("none", "--steps", 2, "--no-checkpoint", "--checkpoint-every", 1)
    report(code == 2 and len(errors(err)) == 1, f"{t.name}: --no-checkpoint with --checkpoint-every 1 is refused (exit 2)",
           f"exit {code}: {err[-300:]}")


def check_retention(t, full):
    code, out, _ = t.fresh("keep", "--steps", 8, "--checkpoint-every", 2, "--keep-checkpoints", 2)
    report(code == 0 and ckpts(t.path("keep")) == ["ckpt_00000006", "ckpt_00000008"],
           f"{t.name}: --keep-checkpoints 2 leaves the newest two of four", str(ckpts(t.path("keep"))))
    if not full:
        return
    # a damaged newer checkpoint is not counted as one of the N: the older sound one stays
    t.fresh("damaged", "--steps", 4, "--checkpoint-every", 2)
    with open(t.path("damaged", "ckpt_00000004", "model.bin"), "r+b") as f:
        f.seek(2000)
        byte = f.read(1)
        f.seek(2000)
        f.write(bytes([byte[0] ^ 1]))
    code, _, _ = t.fresh("damaged", "--steps", 6, "--checkpoint-every", 6, "--keep-checkpoints", 2)
    report(code == 0 and ckpts(t.path("damaged")) == ["ckpt_00000002", "ckpt_00000004", "ckpt_00000006"],
           f"{t.name}: --keep-checkpoints 2 keeps the newest sound older checkpoint (ckpt 2) past a damaged one (ckpt 4, "
           "left as it is)", str(ckpts(t.path("damaged"))))
    # the newest by name damaged: --resume latest takes the newest sound one, and keep 1 leaves it
    shutil.rmtree(t.path("damaged", "ckpt_00000006"))
    code, out, _ = t.run("--resume", "latest", "--out-dir", t.path("damaged"), "--more-steps", 1, "--keep-checkpoints", 1)
    code2, out2, _ = t.run("--resume", "latest", "--out-dir", t.path("damaged"), "--eval-only")
    report(code == 0 and ckpts(t.path("damaged")) == ["ckpt_00000003", "ckpt_00000004"] and code2 == 0 and
           "resumed from " + t.path("damaged", "ckpt_00000003") in out2,
           f"{t.name}: with the newest (ckpt 4) damaged, --resume latest --more-steps 1 --keep-checkpoints 1 leaves ckpt 3, "
           "the newest sound one, which --resume latest then takes", f"{ckpts(t.path('damaged'))}; exit {code}, {code2}")


def check_continues(t, full):
    shaped = ["--batch-size", 8, "--lr", 0.01, "--lr-schedule", "linear", "--warmup-steps", 2, "--seed", 7]
    t.fresh("straight", "--steps", 6, "--checkpoint-every", 3, "--dump-state", t.path("straight.st"), *shaped)
    ck = t.path("straight", "ckpt_00000003")
    code, out, err = t.run("--resume", ck, "--out-dir", t.path("resumed"), "--dump-state", t.path("resumed.st"))
    notes = [ln for ln in out.splitlines() if ln.startswith("resume:")]
    report(code == 0 and same_dump(t.path("straight.st"), t.path("resumed.st"), 3) and notes == [] and
           same_bytes(t.path("straight", "ckpt_00000006", "state.bin"), t.path("resumed", "ckpt_00000006", "state.bin")),
           f"{t.name}: resumed at step 3 with no flags, a run of lr 0.01, B=8, linear schedule, warmup 2, seed 7 ends as "
           "the uninterrupted one, bit for bit (losses, weights, state.bin)", f"exit {code}: {err[-300:]} {notes}")
    code, out, _ = t.run("--resume", ck, "--out-dir", t.path("override"), "--lr", "0.02", "--batch-size", 8)
    notes = [ln for ln in out.splitlines() if ln.startswith("resume:")]
    report(code == 0 and notes == ["resume: --lr 0.02 overrides the checkpoint's 0.01"],
           f"{t.name}: --lr 0.02 on resume prints one override line (--batch-size 8, the recorded value, none)", str(notes))
    if not full:
        return
    # planted in the record's other fields: the checkpoint's B=8 and lr against a resume that drops them
    code, out, err = t.run("--resume", ck, "--out-dir", t.path("defaults"), "--batch-size", 4, "--lr", 6e-4,
                           "--dump-state", t.path("defaults.st"))
    report(code == 0 and not same_dump(t.path("straight.st"), t.path("defaults.st"), 3),
           f"{t.name}: the control: resumed with B=4 and lr 6e-4 (the defaults) it does not end as the run", err[-300:])


def check_steps(t):
    run_dir = t.path("finished")
    t.fresh("finished", "--steps", 4, "--lr", 0.01)
    log = t.path("finished", "metrics.jsonl")
    before = open(log, "rb").read()
    code, out, err = t.run("--resume", run_dir, "--steps", 3)
    report(code == 2 and len(errors(err)) == 1 and "--more-steps" in errors(err)[0] and open(log, "rb").read() == before,
           f"{t.name}: --steps 3 on a checkpoint at step 4 is refused in one line naming --more-steps (exit 2), the log "
           "untouched", f"exit {code}: {err[-300:]}")
    code, out, err = t.run("--resume", run_dir)
    report(code == 0 and "nothing to train" in out and open(log, "rb").read() == before and
           ckpts(run_dir) == ["ckpt_00000004"],
           f"{t.name}: --resume RUN_DIR of a finished run trains nothing and leaves metrics.jsonl byte-identical",
           f"exit {code}: {out[-300:]} {err[-300:]}")
    code, out, err = t.run("--resume", run_dir, "--more-steps", 2, "--out-dir", t.path("more"), "--dump-state", t.path("more.st"))
    code2, _, _ = t.run("--resume", os.path.join(run_dir, "ckpt_00000004"), "--steps", 6, "--out-dir", t.path("stretch"),
                        "--dump-state", t.path("stretch.st"))
    try:
        lr5 = read_dump(t.path("more.st"))["losses"].size == 2 and float(out.split("step     5/6")[1].split("lr ")[1].split()[0])
    except (IndexError, ValueError, OSError):
        lr5 = 0
    report(code == 0 and code2 == 0 and same_dump(t.path("stretch.st"), t.path("more.st"), 0) and lr5 > 0 and
           "resumed from " + os.path.join(run_dir, "ckpt_00000004") in out,
           f"{t.name}: --resume RUN_DIR --more-steps 2 == --resume its ckpt 4 --steps 6 (run.sh's stretch), bit for bit, "
           f"step 5's lr {lr5:g} (the 4-step schedule had ended at 0)", f"exit {code}, {code2}: {err[-300:]}")
    code, out, _ = t.run("--resume", run_dir, "--more-steps", 1)
    report(code == 0 and ckpts(run_dir) == ["ckpt_00000004", "ckpt_00000005"] and b'"step":5' in open(log, "rb").read(),
           f"{t.name}: --resume RUN_DIR trains on in that folder (ckpt 5 and its log lines there)", str(ckpts(run_dir)))


def header_copy(src, dst, version):
    """a copy of checkpoint src with the recorded options' version set (0: none, the bytes zeroed), no checksums"""
    shutil.copytree(src, dst)
    os.remove(os.path.join(dst, "checksums.txt"))
    with open(os.path.join(dst, "state.bin"), "r+b") as f:
        f.seek(OPTIONS_AT)
        f.write(struct.pack("<i", version) + (bytes(800) if version == 0 else b""))


def check_versions(t):
    ck = t.path("straight", "ckpt_00000003")
    header_copy(ck, t.path("old", "ckpt_00000003"), 0)
    shaped = ["--batch-size", 8, "--lr", 0.01, "--lr-schedule", "linear", "--warmup-steps", 2, "--seed", 7, "--steps", 6]
    code, out, err = t.run("--resume", t.path("old", "ckpt_00000003"), *shaped, "--out-dir", t.path("old_resumed"),
                           "--dump-state", t.path("old.st"))
    report(code == 0 and same_dump(t.path("straight.st"), t.path("old.st"), 3) and "without recorded options" in out,
           f"{t.name}: a checkpoint without recorded options (version 0) resumes on the flags given, bit for bit",
           f"exit {code}: {err[-300:]}")
    code, out, err = t.run("--resume", t.path("old", "ckpt_00000003"), "--steps", 6, "--out-dir", t.path("old_defaults"))
    report(code == 0 and "different batch geometry" in err,
           f"{t.name}: without the flags it resumes as before, on the defaults (B=4: the batch-geometry warning)", err[-300:])
    header_copy(ck, t.path("future", "ckpt_00000003"), 2)
    code, out, err = t.run("--resume", t.path("future", "ckpt_00000003"), "--out-dir", t.path("future_resumed"))
    report(code == 1 and len(errors(err)) == 1 and "version 2" in errors(err)[0] and not os.path.exists(t.path("future_resumed")),
           f"{t.name}: recorded options of a newer version (2) are refused in one line (exit 1)", f"exit {code}: {err[-300:]}")


def main():
    tmp = tempfile.mkdtemp(prefix="llmc_resume_options_")
    rng = np.random.default_rng(0)
    write_shard(os.path.join(tmp, "train.bin"), rng.integers(0, 512, 20000))
    write_shard(os.path.join(tmp, "val.bin"), rng.integers(0, 512, 3000))
    trainers = []
    cpu = os.path.join(ROOT, "train_gpt_cpu")
    if os.path.exists(cpu):
        trainers.append((Trainer("cpu", cpu, tmp), True))
    else:
        print("SKIP: the CPU trainer's checks (train_gpt_cpu not built)")
    gpu = gpu_binary()
    if gpu:
        trainers.append((Trainer("gpu" if "emu" not in gpu else "gpu-emulated", gpu, tmp), False))
    else:
        print("SKIP: the GPU trainer's checks (neither ./train_gpt with a GPU nor build/emu/train_gpt)")
    for t, full in trainers:
        os.makedirs(t.path(), exist_ok=True)
        check_saved_by_default(t)
        check_retention(t, full)
        check_continues(t, full)
        check_steps(t)
        if full:
            check_versions(t)
    shutil.rmtree(tmp, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
