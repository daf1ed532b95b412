#!/usr/bin/env python3
"""test_gpu_pipeline_2bw.py — PipeDream-2BW on the GPU trainer, against the CPU trainer's.

PipeDream-2BW (llmc/parallel/pipedream_2bw.h, .cuh): two weight versions per stage, step t's gradient
taken on the older one, W(t+1) = W(t) - lr * AdamW(grad f(W(t-1))), W(-1) = W(0). Not a synchronous
run, so the GPU's own one-rank run of the rule (test_gpu_parallelism.py) shares the trainer's code with
the pipeline it checks: a wrong version swap in the GPU code that both take goes unseen there. Here the
reference is the CPU trainer (test_pipeline_2bw.py holds it to PyTorch fp64's rule and to 1F1B runs),
and the GPU trainer is the fp32 build (./train_gpt_fp32, or build/emu/train_gpt_fp32 on the CPU
emulation of CUDA): the same formulas as the CPU's, in fp32, summed in another order.

The model: L=3 C=64 H=2 T=32 V=501 (bf16-exact weights, test_gpu.write_model), 3 micro-batches of
B=1 a step (m = 3: not a multiple of p = 2), 4 AdamW steps at lr 1e-2 (large, so that W(t-2) and
W(t-1) differ a lot), every rank host-staged (test_gpu_parallelism.Runner). The checks:
  - GPU pp2 2bw-flush == CPU pp2 2bw-flush and CPU pp2 2bw, and GPU pp3 2bw == CPU pp3 2bw, within
    test_gpu's fp32 tolerances (FP32_TOL: logits, step-1 loss and every gradient tensor, the losses of
    the 4 steps, the weight change). Measured (2 cores, shared): losses 8e-8 relative, weight change
    2.8e-5 relative L2 (pp2 and pp3 alike);
  - without the flush == with it, bit for bit in the same build: pp2 2bw (checkpointed at step 2) and
    pp3 2bw against pp2 2bw-flush: the overlap changes when a pass runs, not what it computes, and the
    stages' number changes neither (the tied embedding's two gradients meet in the same order);
  - the overlap itself, from --trace: each stage's forwards and backwards of steps 1 and 4 on pp3, in
    the order drawn by hand from the paper's schedule: in step 1, stage s already runs the first
    p-1-s forwards of step 2 (on the newer version) before its last backwards of step 1; step 4, the
    run's last, drains (1F1B's cool-down);
  - resume: 2 steps + checkpoint (each rank's older version) + 2 resumed == 4 straight, bit for bit;
  - memory: rank 0 allocates what --estimate predicts for 2bw (its older_weights row), and each rank's
    parameters are twice 1F1B's.
  - on the bf16 build, what it does not serve refused in one line each, exit 2: ZeRO-3, tensor
    parallelism, CUDA graphs, optimizer offload, and fp8 (without the flush, the forwards run ahead
    would record their amax in the previous step's history).
The pp3 run takes NCCL's path on the emulation (a GPU per rank: the NCCL stand-in, which enforces
NCCL's rules), the others host staging over MPI: the overlap's groups are right for both.
Planted bugs caught (by hand, then reverted):
  - a backward reading the newer version, not its forward's (train_gpt.cu's pipedream_2bw_gpu_read for
    forwards only; test_gpu_parallelism's one-rank reference shares that code and cannot see it): every
    CPU comparison failed, losses 8.2e-2 apart and the weight change 0.33 (limits 1e-3 and 1e-2);
  - without the flush, the next step's first forwards reading the older version (pipedream_2bw_gpu_read's
    `act.version < step - 1` as `< step`): both bit-for-bit checks failed, and the pp3 CPU comparison
    (losses 6.2e-3, weight change 4.4e-2);
  - a filled step's slot map reset (pipe_slots_reset every step): the pp3 bit-for-bit check and its CPU
    comparison failed (losses 1.8e-2, weight change 0.13; on 2 stages the reset happens to hand the
    waiting micro-batch its own slot back).
CI: 4 emulated runs (2 and 3 ranks, 2-4 steps), 3 CPU runs and 5 refusals: 12 s of CPU time; 36 to 53 s
of wall time measured on 2 cores shared with 8 other builds (load 10 to 12), about 20 s on quiet cores
(an emulated pp2 run of 4 steps took 4.5 s at load 0.2).
"""
import json, os, re, shutil, sys, tempfile
from checks import report, exit_code

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_gpu import DEFAULT_ATTENTION, EMULATED, FP32_TOL, GPU, GPU32, MODE, compare_dumps, write_model  # noqa: E402
from test_gpu_parallelism import Runner as GpuRunner, check_bitwise, estimate_totals  # noqa: E402
from test_parallelism import Runner as CpuRunner, mpi_trainer_missing, write_pattern_shard  # noqa: E402
from test_pipeline_2bw import refused  # noqa: E402

STEPS, LR = 4, "1e-2"
# each stage's compute actions in steps 1 and 4 of pp3, m = 3 (pipeline_schedule.h's pipeline_2bw_steps,
# drawn by hand): stage s runs w = 2 - s forwards ahead; in step 1 the last w are step 2's micro-batches
# 0 .. w-1 (F0 F1 after B0 / B1 on stage 0); step 4 starts with them done and ends drained
EXPECTED_ORDER = {1: ["F0 F1 F2 B0 F0 B1 F1 B2", "F0 F1 B0 F2 B1 F0 B2", "F0 B0 F1 B1 F2 B2"],
                  4: ["F2 B0 B1 B2", "F1 B0 F2 B1 B2", "F0 B0 F1 B1 F2 B2"]}


def compute_order(path, step):
    """A rank's --trace file: its forwards and backwards of `step`, in order, as one string."""
    with open(path) as f:
        events = json.load(f)["traceEvents"]
    return " ".join(e["name"] for e in events if e.get("ph") == "X" and e["args"].get("step") == step and
                    re.fullmatch(r"[FB]\d+", e["name"]))


def main():
    if MODE is None or not os.path.exists(GPU32):
        print("SKIP: PipeDream-2BW on the GPU trainer (no GPU, and the fp32 build of the CUDA emulation is not built: make emu)")
        return 0
    if mpi_trainer_missing("PipeDream-2BW on the GPU trainer against the CPU's"):
        return 0
    work = tempfile.mkdtemp(prefix="llmc_gpu_2bw_")
    try:
        model_path = os.path.join(work, "model.bin")
        model = write_model(model_path, 3, 64, 2, 32, 501, 1)
        write_pattern_shard(work)
        cpu, gpu = CpuRunner(work), GpuRunner(work)

        def pipe(p, schedule):
            return ["--pipeline-parallel", p, "--pipeline-schedule", schedule, "--lr", LR]

        def on_cpu(name, p, schedule):
            return cpu.dump(name, p, *pipe(p, schedule), model=model_path, steps=STEPS)[0]

        def on_gpu(name, p, schedule, *flags, steps=STEPS, env=None):
            return gpu.dump(name, p, *pipe(p, schedule), *flags, model=model_path, steps=steps, exe=GPU32, env=env)

        # ---- the GPU's 2BW against the CPU trainer's
        flushed, _ = on_gpu("gpu_pp2_2bw_flush", 2, "2bw-flush")
        cpu_flushed, cpu_two, cpu_three = (on_cpu("cpu_pp2_2bw_flush", 2, "2bw-flush"), on_cpu("cpu_pp2_2bw", 2, "2bw"),
                                           on_cpu("cpu_pp3_2bw", 3, "2bw"))
        if flushed is not None and cpu_flushed is not None:
            compare_dumps("GPU fp32 pp2 2bw-flush vs CPU pp2 2bw-flush", flushed, cpu_flushed, model, FP32_TOL)
        if flushed is not None and cpu_two is not None:
            compare_dumps("GPU fp32 pp2 2bw-flush vs CPU pp2 2bw (no flush)", flushed, cpu_two, model, FP32_TOL)

        # ---- without the flush: the same bits as with it; the next step's forwards before this step's update
        two, out = on_gpu("gpu_pp2_2bw", 2, "2bw", "--checkpoint-every", 2)
        check_bitwise("GPU pp2 2bw (no flush, checkpointed at 2) == GPU pp2 2bw-flush bit for bit", two, flushed)
        trace = os.path.join(work, "trace.json")
        # emulated: a GPU per rank, so the pipeline's sends and receives take NCCL's path (the stand-in, with
        # NCCL's rules: test/emu/nccl_standin.cpp) where the other runs are host-staged over MPI
        three, _ = on_gpu("gpu_pp3_2bw", 3, "2bw", "--trace", trace,
                          env={"CUDA_EMU_DEVICES": "3", "LLMC_HOST_STAGED": "0"} if EMULATED else None)
        check_bitwise("GPU pp3 2bw (no flush) == GPU pp2 2bw-flush bit for bit", three, flushed)
        if three is not None and cpu_three is not None:
            compare_dumps("GPU fp32 pp3 2bw vs CPU pp3 2bw", three, cpu_three, model, FP32_TOL)
        if three is not None:
            for step, expected in EXPECTED_ORDER.items():
                got = [compute_order(os.path.join(work, f"trace.rank{s}.json"), step) for s in range(3)]
                report(got == expected, f"GPU pp3 2bw, step {step}: each stage's passes in 2BW's order ({' | '.join(got)})"
                       + (": step 2's first forwards before step 1's update" if step == 1 else ": the last step drains"),
                       f"expected {' | '.join(expected)}")

        # ---- resume from the checkpoint at step 2 (it drained there: no micro-batch in flight, two versions)
        ckpt = os.path.join(work, "out", "ckpt_00000002")
        files = sorted(f for f in os.listdir(ckpt) if f.startswith("pipedream_2bw")) if os.path.isdir(ckpt) else []
        resumed, rout = on_gpu("gpu_pp2_2bw_resumed", 2, "2bw", "--resume", ckpt)
        if two is not None and resumed is not None:
            report(files == ["pipedream_2bw_rank0.bin", "pipedream_2bw_rank1.bin"] and "resumed from" in rout and
                   (resumed["params"] == two["params"]).all() and (resumed["losses"] == two["losses"][2:]).all(),
                   "GPU pp2 2bw: 2 steps + checkpoint (each rank's older version) + resume + 2 steps == 4 straight, bit for bit",
                   f"{files} {rout[-600:]}")

        # ---- memory: the allocation is --estimate's, the older version included
        table = re.search(r"GPU memory bytes: table (\d+)", out)
        est = {k: estimate_totals(work, ["--pipeline-parallel", "2", "--pipeline-schedule", k], exe=GPU32, model=model_path)
               for k in ("2bw", "1f1b")}
        report(table is not None and len(est["2bw"]) == 2 and int(table.group(1)) == est["2bw"][0][1] and
               all(a[0] == 2 * b[0] for a, b in zip(est["2bw"], est["1f1b"])),
               f"GPU pp2 2bw: rank 0 allocates what --estimate predicts ({table.group(1) if table else '?'} bytes), each "
               f"rank's params twice 1F1B's ({[a[0] for a in est['2bw']]} bytes: the older_weights row)", f"{est} {out[-300:]}")
        # ---- what it does not serve: one line each, exit 2, before anything is allocated (the bf16 build; MoE
        # is refused on any pipeline, ZeRO-2 and tensor parallelism also by test_pipeline_2bw.py for both trainers)
        base = [GPU, "--model", model_path, "--seq-len", "32", "--batch-size", "1", "--train-data",
                os.path.join(work, "train_000.bin")] + DEFAULT_ATTENTION + [str(f) for f in pipe(2, "2bw")]
        for flags, needle in ((["--zero", "3"], "2bw with --zero 3"), (["--tensor-parallel", "2"], "2bw with --tensor-parallel"),
                              (["--cuda-graphs"], "2bw with --cuda-graphs"),
                              # (offload refuses every pipeline; 2bw on one rank is the rule without one)
                              (["--pipeline-parallel", "1", "--offload", "optimizer"], "2bw with --offload"),
                              (["--precision", "fp8"], "2bw with --precision fp8")):
            refused(base + flags, needle, f"the GPU trainer with 2bw and {' '.join(flags)}", work)
        print(f"({gpu.seconds + cpu.seconds:.0f} s in the trainers)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
