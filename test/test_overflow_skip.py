#!/usr/bin/env python3
"""test_overflow_skip.py — an overflow on one rank makes every rank skip the step (issue 28, the loss
scaler's contract, llmc/optim/loss_scaler.h). The CPU trainer over MPI, 2 ranks, tiny model:

  LLMC_TEST_GRAD_INF=1:2 (llmc/probes/fault_injection.h) makes rank 1's first gradient inf after
  step 2's backward, as an fp16 overflow would. The trainer's overflow flag is the gradient norm,
  all-reduced over every rank that holds gradients, so rank 0 must skip too: a 2-step run with the
  inf on rank 1 must end with rank 0's weights bit-identical to the 1-step run's (step 2 untouched),
  and say it skipped. For 2 data-parallel ranks and for 2 tensor-parallel ranks (where the ranks hold
  different slices, as in ColossalAI's bug: a flag reduced over the data-parallel group only missed
  them). Control: the run without the inf moves the weights past the 1-step run's.

  The counters the checkpoints of the skipping run save (llmc/io/formats.h's state header): the
  skipped step counts as done (step 2), its batch is consumed (the loader moved as far in step 2 as in
  step 1), and AdamW's state is untouched: ckpt 2's m and v are ckpt 1's, byte for byte (a moment
  updated, or a bias correction advanced, on the skipped step would not be). Control: the clean run's
  m and v change in step 2. Planted once: a skipped step decaying m by beta1 (the weights untouched):
  the weights' check passed, the m and v check failed on both grids.

  AdamW's t leaves a skipped step out (it counts the updates applied, as PyTorch's GradScaler skips
  optimizer.step()): one rank, every batch the same (a shard whose period is one step's tokens) and a
  constant learning rate, so 3 steps with step 2 skipped (LLMC_TEST_GRAD_INF=0:2) must end with the
  weights of 2 clean steps, bit for bit; the checkpoint after the skip records it (state.bin's
  updates_skipped, byte 964), and a run resumed from it ends with the straight run's weights, bit for
  bit. Before the fix (t = the step number) step 3's update used t = 3: the first check failed.
"""
import os, shutil, struct, sys, tempfile
from checks import report, exit_code
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_shards import write_shard  # noqa: E402
from test_data_parallel import Runner, TRAINER, T, check_bitwise  # noqa: E402


def state_counters(out_dir, step):
    """(step, loader shard, loader position, the bytes after the header: the run table, m and v) of a
    checkpoint's state.bin (TrainStateHeader: step at byte 8, the train loader's position at 72)."""
    ckpt = os.path.join(out_dir, f"ckpt_{step:08d}")
    path = os.path.join(ckpt, "state.bin")  # (on a grid: rank 0's own file)
    with open(path if os.path.exists(path) else os.path.join(ckpt, "state_rank0.bin"), "rb") as f:
        raw = f.read()
    (saved_step,), (shard, position, _epoch) = struct.unpack_from("<q", raw, 8), struct.unpack_from("<3q", raw, 72)
    return saved_step, shard, position, raw[1024:]


def check_skip_counters(name, out_dir, clean_moments_moved):
    s1, s2 = state_counters(out_dir, 1), state_counters(out_dir, 2)
    report(s1[0] == 1 and s2[0] == 2, f"{name}: the skipped step counts as done (checkpoint steps {s1[0]}, {s2[0]})")
    report(s1[1] == s2[1] == 0 and s1[2] > 0 and s2[2] == 2 * s1[2],
           f"{name}: the skipped step's batch is consumed (loader at token {s1[2]}, then {s2[2]})")
    report(s1[3] == s2[3] and clean_moments_moved,
           f"{name}: AdamW's m and v after the skipped step == after step 1, byte for byte (control: the clean run's move)",
           "the skipped step changed the optimizer state" if s1[3] != s2[3] else "the control: the clean run's did not move")


def main():
    if not shutil.which("mpirun") or not os.path.exists(TRAINER):
        print("SKIP: overflow skip (needs mpirun and train_gpt_cpu)")
        return 0
    work = tempfile.mkdtemp(prefix="llmc_overflow_")
    try:
        rng = np.random.default_rng(0)
        write_shard(os.path.join(work, "train_000.bin"), rng.integers(0, 512, size=4096))
        r = Runner(work)
        out_dir = os.path.join(work, "out")  # (Runner's --out-dir)
        for name, grid in [("2 data-parallel ranks", []), ("2 tensor-parallel ranks", ["--tensor-parallel", 2])]:
            flags = ["--batch-size", 2, "--lr-schedule", "constant"] + grid  # step 1 at the same lr in both runs
            one, _ = r.dump("one_step", 2, *flags, "--steps", 1)
            clean, _ = r.dump("clean", 2, *flags, "--steps", 2, "--checkpoint-every", 1)
            clean_moved = state_counters(out_dir, 1)[3] != state_counters(out_dir, 2)[3]
            os.environ["LLMC_TEST_GRAD_INF"] = "1:2"
            try:
                skipped, out = r.dump("inf_on_rank1", 2, *flags, "--steps", 2, "--checkpoint-every", 1)
            except RuntimeError as e:  # ranks that disagree stop (or would hang): the failure to show
                report(False, f"{name}: an inf on rank 1 at step 2", str(e)[-800:])
                continue
            finally:
                del os.environ["LLMC_TEST_GRAD_INF"]
            report("step 2:" in out and "update skipped" in out, f"{name}: an inf on rank 1 at step 2: the run says it skipped",
                   out[-600:])
            check_bitwise(f"{name}: rank 0's weights after the skipped step 2 == after step 1, bit for bit", skipped, one,
                          keys=("params",))
            report(not np.array_equal(clean["params"], one["params"]), f"{name} (control): without the inf, step 2 moves the weights")
            check_skip_counters(name, out_dir, clean_moved)
        held_t(work)
    finally:
        shutil.rmtree(work)
    return exit_code()


def held_t(work):
    same = os.path.join(work, "same")
    os.makedirs(same)
    base = np.random.default_rng(3).integers(0, 512, 2 * T)  # one step's tokens: B = 2 sequences of T
    write_shard(os.path.join(same, "train_000.bin"), np.tile(base, 64))
    r = Runner(same)
    out_dir = os.path.join(same, "out")
    flags = ["--batch-size", 2, "--lr-schedule", "constant", "--warmup-steps", 0]
    clean, _ = r.dump("clean2", 1, *flags, "--steps", 2)
    os.environ["LLMC_TEST_GRAD_INF"] = "0:2"
    try:
        skipped, out = r.dump("skip3", 1, *flags, "--steps", 3, "--checkpoint-every", 1)
    finally:
        del os.environ["LLMC_TEST_GRAD_INF"]
    report("update skipped" in out and np.array_equal(skipped["params"], clean["params"]) and
           skipped["losses"][2] == clean["losses"][1],
           "AdamW's t held over a skipped step: 3 steps with step 2 skipped == 2 clean steps, bit for bit (one rank)",
           f"losses {skipped['losses']} vs {clean['losses']}; {int(np.sum(skipped['params'] != clean['params']))} weights differ")
    with open(os.path.join(out_dir, "ckpt_00000002", "state.bin"), "rb") as f:
        recorded = struct.unpack_from("<i", f.read(1024), 964)[0]
    report(recorded == 1, f"the checkpoint after the skip records 1 skipped update (state.bin byte 964: {recorded})")
    resumed, _ = r.dump("resumed3", 1, *flags, "--steps", 3, "--resume", os.path.join(out_dir, "ckpt_00000002"),
                        "--out-dir", os.path.join(same, "out_resumed"))
    report(np.array_equal(resumed["params"], skipped["params"]),
           "resumed after the skipped step: step 3's weights == the straight run's, bit for bit (the skip count carried)",
           f"{int(np.sum(resumed['params'] != skipped['params']))} weights differ")


if __name__ == "__main__":
    sys.exit(main())
