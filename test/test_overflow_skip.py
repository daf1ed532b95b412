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
"""
import os, shutil, sys, tempfile
from checks import report, exit_code
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_shards import write_shard  # noqa: E402
from test_data_parallel import Runner, TRAINER, check_bitwise  # noqa: E402


def main():
    if not shutil.which("mpirun") or not os.path.exists(TRAINER):
        print("SKIP: overflow skip (needs mpirun and train_gpt_cpu)")
        return 0
    work = tempfile.mkdtemp(prefix="llmc_overflow_")
    try:
        rng = np.random.default_rng(0)
        write_shard(os.path.join(work, "train_000.bin"), rng.integers(0, 512, size=4096))
        r = Runner(work)
        for name, grid in [("2 data-parallel ranks", []), ("2 tensor-parallel ranks", ["--tensor-parallel", 2])]:
            flags = ["--batch-size", 2, "--lr-schedule", "constant"] + grid  # step 1 at the same lr in both runs
            one, _ = r.dump("one_step", 2, *flags, "--steps", 1)
            clean, _ = r.dump("clean", 2, *flags, "--steps", 2)
            os.environ["LLMC_TEST_GRAD_INF"] = "1:2"
            try:
                skipped, out = r.dump("inf_on_rank1", 2, *flags, "--steps", 2)
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
    finally:
        shutil.rmtree(work)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
