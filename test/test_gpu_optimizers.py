#!/usr/bin/env python3
"""test_gpu_optimizers.py — the GPU trainer's --optimizer-state bf16 (llmc/optim/adamw_bf16.cuh)
against the CPU trainer's (llmc/optim/adamw_bf16.h), on a GPU or on the CPU emulation of CUDA.

One model and batch stream, L=2 C=128 H=2 T=64 V=500 at B=4 (test_gpu.py's "tiny"), 10 AdamW steps,
checkpoints at steps 5 and 10; each run below is made once and shared by the checks:

  fp32 vs cpu        train_gpt_fp32 (the same kernels in fp32) and train_gpt_cpu, both with bf16 m and v:
                     logits, loss, gradients, the 10 losses and the weights after them within test_gpu.py's
                     fp32 tolerances (FP32_TOL). The moments' rounding bits are the CPU's exact stream
                     (adamw_bf16_step_key and adamw_bf16_store, called by both), so:
  the moments        state.bin at step 10: every m and v of the GPU's file is a bf16 value (its low 16 bits
                     zero: they rested in bf16), and at least 95% of them are bit-identical to the CPU
                     trainer's. Measured 98.4% of m and 99.7% of v: the rest are elements whose fp32 value
                     before rounding differs between the trainers' forward and backward arithmetic by
                     enough to cross a rounding boundary (m near zero, where the gradient is noise).
                     Planted (by hand, once): the GPU kernel rounding m and v to nearest instead of
                     stochastically (the rounding of issue 25 that leaves v stuck, test_adamw_bf16.cpp):
                     this check failed (bit-identical m 36.5%, v 37.7%) while "fp32 vs cpu" still passed: the
                     weights alone do not see a wrong rounding in 10 steps.
  cuda graphs        the fp32 build with --cuda-graphs: 10 graphed steps == the 10 eager ones bit for bit (weights,
                     losses, state.bin), the learning rate changing every step: the update graph, captured at
                     step 2, reads t (the rounding's key) from device memory. Planted (by hand, once): t passed
                     to the kernel by value, frozen at the captured step: the weights differed by 4.2e-5.
  resume             the fp32 build: 5 steps + resume + 5 == 10 straight, bit for bit (weights, losses,
                     state.bin): the rounding is keyed by (t, index), not by a generator's position.
  cpu resumes gpu    train_gpt_cpu resumes the GPU's step-5 checkpoint (the same state.bin format: m and v
                     widened to fp32, exact) and its last 5 losses and weights match the CPU's straight run
                     within FP32_TOL.
  bf16 build         ./train_gpt (bf16 weights, fp32 master weights, bf16 m and v) against the CPU within
                     test_gpu.py's bf16 tolerances.
  memory             --estimate: m and v 4 bytes per parameter in all (8 with fp32 moments), the adam_m row
                     exactly 2 bytes per element; the run allocates exactly the table --estimate prints.
  refusals           what is not proven yet (--moe-experts, --zero 3): one line naming it, exit 2 (with
                     --offload optimizer it runs: test_offload.py).
  grids              the fp32 build, 3 steps of 2 micro-batches (mpirun), checkpoints at step 2:
                     dp2: ZeRO-1 == ZeRO-0 bit for bit (each shard's elements round with their index in the
                     whole model, not in the shard), ZeRO-2 == ZeRO-1 bit for bit (one launch per piece of
                     the units' shards, each keyed by its index in the model), and == one rank accumulating
                     the same micro-batches within FP32_TOL. Planted (by hand, once): keyed by the index in the shard: the bit-for-bit
                     check failed, the tolerance check still passed.
                     tp2 + sequence parallel, pp2 (1F1B): == one rank within FP32_TOL; the step-2 moments,
                     assembled from the ranks' state files in the model's order, >= 95% bit-identical to
                     one rank's (measured: tp2 m 99.7%, v 99.9%; pp2 99.9%, 99.9%): every element rounds with
                     its index in the whole model (slice_global_index). 2 steps + resume + 1 == 3 straight,
                     bit for bit; rank 0 allocates the table --estimate prints. Planted (by hand, once): the
                     kernel keyed by the rank's own index: tp2 58.4% / 61.6%, pp2 62.0% / 64.9% identical,
                     the moments checks failed and every tolerance check passed.
(The kernel's rounding itself, v decaying under g = 0 at beta2 = 0.999 where round-to-nearest leaves it
stuck: test/emu_kernel_checks.cu's adamw_bf16, with its negative control in test_emu_negative_controls.py.)

Cost: 5 emulated runs of 10 (or 5) steps of the tiny model, 3 CPU runs, one 1-rank and six 2-rank
emulated runs of 3 (or 1) steps: 45 s of CPU time here (2 shared cores, 3.6 min wall while 7 others
built and tested).
"""
import os, re, shutil, subprocess, sys, tempfile
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import report, exit_code  # noqa: E402
from safetensors_io import read_safetensors  # noqa: E402
import test_gpu  # noqa: E402
from test_optimizers import grid_moments  # noqa: E402
from test_gpu import CPU, GPU, GPU32, MODE, DEFAULT_ATTENTION, FP32_TOL, BF16_TOL, run, compare_dumps, same_bytes  # noqa: E402

STEPS = ["--batch-size", "4", "--seq-len", "64", "--steps", "10", "--lr", "1e-3", "--warmup-steps", "2",
         "--optimizer-state", "bf16", "--checkpoint-every", "5"]


def dump_run(exe, tmp, name, flags):
    """One run with --dump-state; returns (its dump, its stdout)."""
    path = f"{tmp}/{name}.st"
    p = run([exe, "--model", f"{tmp}/tiny.bin", "--dump-state", path] + flags)
    return read_safetensors(path)[0], p.stdout


def grids(tmp, model):
    """The fp32 build, 3 steps of 2 micro-batches of B=2 (one rank accumulates them; data-parallel ranks
    take one each; a tensor or pipeline grid both), checkpoints at step 2:
      dp2    ZeRO-1 (each rank updates its shard of m and v, rounding each element with its index in the
             whole model) == ZeRO-0 (both ranks update everything) bit for bit, ZeRO-2 (its pieces of the
             units' shards) == ZeRO-1 bit for bit, and == one rank within FP32_TOL;
      tp2 + sequence parallel, pp2 (1F1B): == one rank within FP32_TOL; their step-2 moments, assembled from
             the ranks' state files in the model's order, bit-identical to one rank's for >= 95% of the
             elements (each element rounds with its index in the whole model, slice_global_index); and
             2 steps + resume + 1 == 3 straight on the same grid, bit for bit."""
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        print("SKIP: --optimizer-state bf16 over 2 data-, tensor- or pipeline-parallel ranks (mpirun is not installed)")
        return
    flags = ["--model", f"{tmp}/tiny.bin", "--train-data", f"{tmp}/train_*.bin", "--val-data", "none", "--sample-every", "0",
             "--batch-size", "2", "--seq-len", "64", "--total-batch-tokens", "256", "--steps", "3", "--lr", "1e-3",
             "--optimizer-state", "bf16"] + DEFAULT_ATTENTION
    grid = {"tp2": ["--tensor-parallel", "2", "--sequence-parallel", "1"], "pp2": ["--pipeline-parallel", "2"]}
    dumps = {}

    def launch(name, ranks, extra):
        path = f"{tmp}/grid_{name}.st"
        mpi = [mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(ranks)] if ranks > 1 else []
        out = run(mpi + [GPU32] + flags + extra + ["--dump-state", path], env={"LLMC_HOST_STAGED": "1"}).stdout
        dumps[name] = read_safetensors(path)[0]
        return out

    keep = ["--checkpoint-every", "2"]
    tables = {}
    for name, ranks, extra in (("one", 1, keep), ("zero0", 2, ["--zero", "0"]), ("zero1", 2, ["--zero", "1"]), ("zero2", 2, ["--zero", "2"]),
                               ("tp2", 2, grid["tp2"] + keep), ("pp2", 2, grid["pp2"] + keep)):
        tables[name] = int(launch(name, ranks, extra + ["--out-dir", f"{tmp}/grid_{name}"]).split("GPU memory bytes: table ")[1].split(",")[0])
    same = all(np.array_equal(dumps["zero1"][k], dumps["zero0"][k]) for k in ("params", "losses"))
    report(same, "--optimizer-state bf16 on 2 ranks: ZeRO-1 == ZeRO-0 bit for bit (the shards round as the whole)",
           "the weights or losses differ")
    same = all(np.array_equal(dumps["zero2"][k], dumps["zero1"][k]) for k in ("params", "losses"))
    report(same, "--optimizer-state bf16 on 2 ranks: ZeRO-2 (one launch per piece of the units' shards) == ZeRO-1 bit for bit",
           "the weights or losses differ")
    compare_dumps("--optimizer-state bf16: 2 ranks ZeRO-1 vs one rank", dumps["zero1"], dumps["one"], model, FP32_TOL)
    one_m, one_v = grid_moments(f"{tmp}/grid_one/ckpt_00000002")
    for name in ("tp2", "pp2"):
        compare_dumps(f"--optimizer-state bf16: {name} vs one rank", dumps[name], dumps["one"], model, FP32_TOL)
        est = run([GPU32] + flags + grid[name] + ["--estimate"]).stdout
        ranks = [int(b) for b in re.findall(r"^  ranks? [-\d]+: params=\d+ .* total=(\d+)", est, re.M)]  # ("ranks 0-1": equal)
        report(ranks and ranks[0] == tables[name],
               f"--optimizer-state bf16 on {name}: rank 0 allocates the table --estimate predicts ({tables[name]} bytes)",
               f"run {tables[name]}, --estimate {ranks}")
        gm, gv = grid_moments(f"{tmp}/grid_{name}/ckpt_00000002")
        same = [float(np.mean(a.view(np.uint32) == b.view(np.uint32))) for a, b in ((gm, one_m), (gv, one_v))]
        report(min(same) >= 0.95, f"--optimizer-state bf16: {name}'s moments round with one rank's bits (keyed in the whole model)",
               f"bit-identical to one rank's: m {same[0]:.1%}, v {same[1]:.1%} (< 95%)", f"m {same[0]:.1%}, v {same[1]:.1%}")
        shutil.copytree(f"{tmp}/grid_{name}", f"{tmp}/grid_{name}_again", ignore=shutil.ignore_patterns("ckpt_00000003"))
        launch(f"{name}_again", 2, grid[name] + ["--out-dir", f"{tmp}/grid_{name}_again", "--resume", "latest"])
        again, straight = dumps[f"{name}_again"], dumps[name]
        report(np.array_equal(again["params"], straight["params"]) and np.array_equal(again["losses"], straight["losses"][2:]),
               f"--optimizer-state bf16 on {name}: 2 steps + resume + 1 == 3 straight, bit for bit", "the weights or losses differ")


def main():
    test_gpu.require_trainers("every GPU optimizer check")
    tmp = tempfile.mkdtemp(prefix="llmc_gpu_optim_")
    try:
        model = test_gpu.tiny_precision_fixture(tmp)
        data = ["--train-data", f"{tmp}/train_*.bin", "--val-data", "none", "--sample-every", "0"] + STEPS
        gpu = data + DEFAULT_ATTENTION
        ref, _ = dump_run(CPU, tmp, "cpu", data + ["--out-dir", f"{tmp}/cpu"])
        got, out = dump_run(GPU32, tmp, "fp32", gpu + ["--out-dir", f"{tmp}/fp32"])
        compare_dumps("--optimizer-state bf16: fp32 build vs cpu", got, ref, model, FP32_TOL)

        gm, gv = grid_moments(f"{tmp}/fp32/ckpt_00000010")
        cm, cv = grid_moments(f"{tmp}/cpu/ckpt_00000010")
        for nm, g, c in (("m", gm, cm), ("v", gv, cv)):
            gb, cb = g.view(np.uint32), c.view(np.uint32)
            is_bf16, same = bool(np.all(gb & 0xFFFF == 0)), float(np.mean(gb == cb))
            report(is_bf16 and same >= 0.95, f"--optimizer-state bf16: the GPU's {nm} is bf16, the CPU's rounding stream",
                   f"bf16 values: {is_bf16}; bit-identical to the CPU's: {same:.1%} < 95%", f"{same:.1%} bit-identical")

        # --cuda-graphs: the update captured at step 2 and replayed, t (the rounding's key) and the learning rate
        # read from device memory at each replay (the rate changes every step: warmup, then the cosine)
        graphed, _ = dump_run(GPU32, tmp, "graphed", gpu + ["--out-dir", f"{tmp}/graphed", "--cuda-graphs"])
        same = {"weights": np.array_equal(got["params"], graphed["params"]), "losses": np.array_equal(got["losses"], graphed["losses"]),
                "state.bin": same_bytes(f"{tmp}/fp32/ckpt_00000010/state.bin", f"{tmp}/graphed/ckpt_00000010/state.bin")}
        report(all(same.values()), "--optimizer-state bf16 with --cuda-graphs: 10 graphed steps == 10 eager, bit for bit",
               f"differ: {[k for k, v in same.items() if not v]}")

        # 5 + resume + 5 == 10: the step-10 checkpoint removed, the run resumed from step 5
        shutil.copytree(f"{tmp}/fp32", f"{tmp}/again", ignore=shutil.ignore_patterns("ckpt_00000010"))
        resumed, _ = dump_run(GPU32, tmp, "resumed", gpu + ["--out-dir", f"{tmp}/again", "--resume", "latest"])
        same = {"weights": np.array_equal(got["params"], resumed["params"]),
                "losses": np.array_equal(got["losses"][5:], resumed["losses"]),
                "state.bin": same_bytes(f"{tmp}/fp32/ckpt_00000010/state.bin", f"{tmp}/again/ckpt_00000010/state.bin")}
        report(all(same.values()), "--optimizer-state bf16 on the GPU: 5 + resume + 5 == 10, bit for bit",
               f"differ: {[k for k, v in same.items() if not v]}")

        # the CPU trainer resumes the GPU's step-5 checkpoint
        shutil.copytree(f"{tmp}/fp32", f"{tmp}/to_cpu", ignore=shutil.ignore_patterns("ckpt_00000010"))
        cont, _ = dump_run(CPU, tmp, "to_cpu", data + ["--out-dir", f"{tmp}/to_cpu", "--resume", "latest"])
        dl = float(np.max(np.abs(cont["losses"] - ref["losses"][5:])))
        init = model[0]
        e = test_gpu.rel(cont["params"] - init, ref["params"] - init)
        report(dl <= FP32_TOL["losses"] and e <= FP32_TOL["update"],
               "the CPU trainer resumes the GPU's bf16-moment checkpoint and tracks its own straight run",
               f"losses {dl:.2e}, weight change {e:.2e}", f"losses {dl:.1e}, weight change {e:.1e}")

        got16, _ = dump_run(GPU, tmp, "bf16", gpu + ["--out-dir", f"{tmp}/bf16"])
        compare_dumps("--optimizer-state bf16: bf16 build vs cpu", got16, ref, model, BF16_TOL)

        # memory: the table --estimate prints is the one the run allocated
        shape = ["--model", f"{tmp}/tiny.bin", "--batch-size", "4", "--seq-len", "64"] + DEFAULT_ATTENTION
        est = {s: run([GPU32] + shape + ["--optimizer-state", s, "--estimate"]).stdout for s in ("fp32", "bf16")}

        def field(text, start, index):
            line = next(x for x in text.splitlines() if x.strip().startswith(start))
            return line.split()[index]
        per_param = {s: field(est[s], "optimizer ", 4) for s in est}
        rows = {s: int(field(est[s], "adam_m ", -3)) for s in est}
        table = int(out.split("GPU memory bytes: table ")[1].split(",")[0])
        total = int(field(est["bf16"], "total ", 1))
        n = model[2][-1]
        report(per_param == {"fp32": "8.00", "bf16": "4.00"} and rows == {"fp32": 4 * n, "bf16": 2 * n} and table == total,
               "--estimate: bf16 m and v are 4 bytes per parameter (8 in fp32), and the run allocates its table",
               f"bytes per parameter {per_param}, adam_m {rows} for {n} parameters, run's table {table} vs estimate {total}")

        base = ["--model", f"{tmp}/tiny.bin", "--optimizer-state", "bf16"]
        # (--moe-experts on a model shape, not the dense tiny.bin, which is refused for holding no experts)
        for flags, words in ((["--moe-experts", "2", "--model", "L=2,C=128,H=2,T=64,V=500"], "--moe-experts"),):
            p = run([GPU] + base + flags + data[:4], expect_ok=False)
            lines = p.stderr.strip().splitlines()
            report(p.returncode == 2 and len(lines) == 1 and words in lines[0] and "--optimizer-state bf16" in lines[0],
                   f"the GPU trainer refuses --optimizer-state bf16 with {' '.join(flags[:2])} in one line", p.stderr[-400:])
        p = run([GPU] + base + ["--zero", "3"] + data[:4], expect_ok=False)
        report(p.returncode == 2 and "--zero 3" in p.stderr and len(p.stderr.strip().splitlines()) == 1,
               "the GPU trainer refuses --optimizer-state bf16 with --zero 3 in one line", p.stderr[-400:])
        grids(tmp, model)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(exit_code())


if __name__ == "__main__":
    main()
