#!/usr/bin/env python3
"""test_cuda_graphs.py — --cuda-graphs (llmc/run/cuda_graphs.cuh) and the emulation's stream capture.

  emulation        build/emu/capture_check (test/emu/capture_check.cu): work on a capturing stream is
                   recorded, not run; a graph replays it twice; a kernel's argument keeps its value at
                   capture while memory is read at the replay; cudaMalloc, a synchronous cudaMemcpy,
                   cudaStreamSynchronize and cudaDeviceSynchronize during a capture return
                   cudaErrorStreamCaptureUnsupported and invalidate it, as the real runtime documents
  graphed = eager  30 steps with --cuda-graphs against 30 without, the learning rate changing at every
                   step (5 steps of warmup, then the cosine decay to 10%), a sample drawn every 10
                   steps (eager forwards between the replays): losses and final weights
                   (--dump-state) bit for bit. The graphs replay the captured AdamW launch, so a learning
                   rate, step count or bias correction passed to it by value would stay at step 2's, and
                   a data-dependent launch shape (the encoder backward's grid) would stay at step 2's
                   batch: both were seen to fail this check (planted by hand; docs/benchmarks.md)
  fp16             train_gpt_fp16 (dynamic loss scaling, llmc/optim/loss_scaler.h): 30 graphed steps == 30
                   eager, with an overflow injected at step 7 (LLMC_TEST_GRAD_INF) that both skip, and a
                   window of 10 clean steps: S goes 2^16 -> 2^15 (step 7) -> 2^16 (17) -> 2^17 (27), each
                   change after the capture at step 2. Losses, weights and every step's S bit for bit:
                   the loss kernel reads S and AdamW 1/S from device memory (S passed by value to the
                   loss kernel was planted by hand: the graphed weights differ from step 7 on)
  fp8              --precision fp8 (llmc/kernels/fp8.cuh): 10 graphed steps == 10 eager bit for bit (losses,
                   weights, the step-10 checkpoint's fp8_state.bin): the replays quantize with the scales
                   and roll the amax histories in device memory as they change
  resume           12 graphed steps == 6 graphed + checkpoint + resume + 6 graphed, and == 12 eager:
                   weights, losses, model.bin and state.bin bit for bit
  accumulation     m micro-batches a step, each replayed from a graph (first, middle, last) with its
                   tokens copied into the graphs' input buffers before it: 4 graphed steps == 4 eager,
                   the learning rate changing at each, on 1 rank (m = 2, 3) and, emulated, over NCCL:
                   2 ranks, m = 3, ZeRO-1, --precision fp8 (its amax max-reduced over the ranks inside
                   the last graph; the step-4 checkpoint's fp8_state.bin compared too); 3 ranks, m = 4,
                   ZeRO-2 (its buckets reduce-scattered inside
                   every micro-batch's graph; rank 2's shards end in padding, so its norm is summed
                   in pieces after the graph, ranks 0-1's inside it): weights, every step's loss,
                   learning rate and norm and every micro-batch's loss as printed, bit for bit, and
                   the data-parallel traffic counted (the host counts a collective at its call, so
                   the capture step counts the middle graph's again for each later replay).
                   Planted by hand, each caught here: the inputs uploaded only before the first
                   micro-batch of a replayed step (the losses differ from step 3); the gradient zeroed
                   by every micro-batch's graph (from step 2); every micro-batch's losses copied into
                   slot 0 (NaN loss: the run stops); ZeRO-2's all-gather of the updated weights left
                   out of the update's graph (the replicas drift: the run stops); rank 2's norm summed
                   over its first piece only (the norms differ); fp8's amax all-reduce left out of the
                   graph (only fp8_state.bin differs: the scales still come from step 1's calibration);
                   the middle graph's later replays not counted (the traffic line differs)
  refused          --cuda-graphs on 2 ranks sharing a GPU, --offload optimizer, --zero 3, and on the CPU
                   trainer: one line naming the problem, exit 2 (on 2 ranks with a GPU each it runs:
                   test_gpu_data_parallel.py)

Runs on the CPU emulation of CUDA (test/emu/), or on a GPU where ./train_gpt is built and one is there.
"""
import os, shutil, subprocess, sys, tempfile
from checks import report, exit_code
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_gpu import GPU, CPU, MODE, EMULATED, DEFAULT_ATTENTION, Setup, check, run, same_bytes, skip  # noqa: E402
from safetensors_io import read_safetensors  # noqa: E402
from test_bad_inputs import one_line_error  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CAPTURE_CHECK = os.path.join(ROOT, "build", "emu", "capture_check")
# tiny: 2 layers, C=64; the learning rate changes at every one of the 30 steps
STEPS = ["--batch-size", "2", "--seq-len", "32", "--lr", "1e-3", "--warmup-steps", "5", "--final-lr-fraction", "0.1"]


def emulation():
    if not os.path.exists(CAPTURE_CHECK):
        skip("stream capture under the emulation", "build/emu/capture_check is not built (make emu)")
        return
    p = subprocess.run([CAPTURE_CHECK], capture_output=True, text=True, timeout=120)
    lines = [line for line in p.stdout.splitlines() if line.startswith(("PASS:", "FAIL:"))]
    for line in lines:
        report(line.startswith("PASS:"), "emulation: " + line.split(": ", 1)[1], line)
    report(p.returncode == 0 and len(lines) >= 10, "emulation: capture_check ran every check and exited 0",
           f"exit {p.returncode}, {len(lines)} checks: {p.stderr[-500:]}")


def graphed_equals_eager(S):
    # sampling every 10 steps: eager forwards between the replays, on the buffers the graphs use
    flags = STEPS + ["--steps", "30", "--sample-every", "10", "--sample-tokens", "4"] + DEFAULT_ATTENTION
    eager = S.dump(GPU, "tiny", flags)
    graphed_path = S.dump_path(GPU, "tiny", flags + ["--cuda-graphs"])
    graphed = S.dump(GPU, "tiny", flags + ["--cuda-graphs"])
    p = run([GPU, "--model", f"{S.tmp}/tiny.bin"] + S.data["tiny"] + STEPS + ["--steps", "4", "--cuda-graphs",
                                                                              "--out-dir", f"{S.tmp}/lines"] + DEFAULT_ATTENTION)
    lrs = {line.split("| lr ")[1].split()[0] for line in p.stdout.splitlines() if line.startswith("step ")}
    report("cuda graphs: step 2 captured the passes" in p.stdout and len(lrs) == 4,
           "--cuda-graphs: step 2 captures, the later steps replay, each at its own learning rate",
           f"learning rates {sorted(lrs)}: {p.stdout[-1500:]}")
    same_losses = np.array_equal(eager["losses"], graphed["losses"])
    same_weights = np.array_equal(eager["params"], graphed["params"])
    first = next((i for i in range(len(eager["losses"])) if eager["losses"][i] != graphed["losses"][i]), None)
    report(same_losses and same_weights and len(eager["losses"]) == 30 and os.path.exists(graphed_path),
           "30 graphed steps == 30 eager steps bit for bit (losses and weights; the learning rate changing every step)",
           f"losses equal {same_losses} (first difference at step {None if first is None else first + 1}), "
           f"weights equal {same_weights}")


def fp16_graphed(S):
    fp16 = os.path.join(os.path.dirname(GPU), "train_gpt_fp16")
    flags = STEPS + ["--steps", "30", "--loss-scale-init", "65536", "--loss-scale-window", "10"] + DEFAULT_ATTENTION
    runs = {}
    for name, extra in [("eager", []), ("graphed", ["--cuda-graphs"])]:
        path = f"{S.tmp}/fp16_{name}.st"
        p = run([fp16, "--model", f"{S.tmp}/tiny.bin"] + S.data["tiny"] + flags + extra + ["--dump-state", path,
                "--out-dir", f"{S.tmp}/fp16_{name}"], env={"LLMC_TEST_GRAD_INF": "0:7"})
        scales = [int(line.split("| scale ")[1].split()[0]) for line in p.stdout.splitlines()
                  if line.startswith("step ") and "| scale " in line]
        runs[name] = (read_safetensors(path)[0], p.stdout, scales)
    (eager, out_e, s_e), (graphed, out_g, s_g) = runs["eager"], runs["graphed"]
    skipped = "step 7: the fp16 gradients overflowed at loss scale 65536: update skipped, the scale halved to 32768"
    want = [65536] * 7 + [32768] * 10 + [65536] * 10 + [131072] * 3  # the scale each step ran at
    same = {"losses": np.array_equal(eager["losses"], graphed["losses"]),
            "weights": np.array_equal(eager["params"], graphed["params"]), "scales": s_e == s_g == want,
            "step 7 skipped in both": skipped in out_e and skipped in out_g,
            "graphs captured": "cuda graphs: step 2 captured the passes" in out_g}
    report(all(same.values()), "fp16: 30 graphed steps == 30 eager bit for bit (losses, weights), the overflow injected "
           "at step 7 skipped in both, S 2^16 -> 2^15 -> 2^16 -> 2^17 read from device memory by the replays",
           f"not the same: {[k for k, v in same.items() if not v]}; scales eager {s_e}, graphed {s_g}")


def fp8_graphed(S):
    flags = STEPS + ["--steps", "10", "--checkpoint-every", "10", "--precision", "fp8"] + DEFAULT_ATTENTION
    dumps, state = {}, {}
    for name, extra in [("eager", []), ("graphed", ["--cuda-graphs"])]:
        dumps[name] = S.dump(GPU, "tiny", flags + extra + ["--out-dir", f"{S.tmp}/fp8_{name}"])
        path = f"{S.tmp}/fp8_{name}/ckpt_00000010/fp8_state.bin"
        state[name] = open(path, "rb").read() if os.path.exists(path) else None
    eager, graphed = dumps["eager"], dumps["graphed"]
    same = {"losses": np.array_equal(eager["losses"], graphed["losses"]),
            "weights": np.array_equal(eager["params"], graphed["params"]),
            "fp8_state.bin": state["eager"] is not None and state["eager"] == state["graphed"]}
    report(all(same.values()), "fp8: 10 graphed steps == 10 eager bit for bit (losses, weights, the amax histories and "
           "scales of fp8_state.bin)", f"not the same: {[k for k, v in same.items() if not v]}")


def resume(S):
    tmp, data = S.tmp, S.data["tiny"]
    flags = STEPS + ["--steps", "12", "--checkpoint-every", "6"] + DEFAULT_ATTENTION
    eager = S.dump(GPU, "tiny", flags + ["--out-dir", f"{tmp}/eager"])
    straight = S.dump(GPU, "tiny", flags + ["--cuda-graphs", "--out-dir", f"{tmp}/graphed"])
    # a second graphed run loses its step-12 checkpoint and resumes from step 6, with graphs again
    run([GPU, "--model", f"{tmp}/tiny.bin"] + data + flags + ["--cuda-graphs", "--out-dir", f"{tmp}/resumed"])
    shutil.rmtree(f"{tmp}/resumed/ckpt_00000012")
    resumed = S.dump(GPU, "tiny", flags + ["--cuda-graphs", "--out-dir", f"{tmp}/resumed", "--resume", "latest"])
    same = {"weights": np.array_equal(straight["params"], resumed["params"]) and
            np.array_equal(eager["params"], resumed["params"]),
            "losses": np.array_equal(straight["losses"][6:], resumed["losses"]) and
            np.array_equal(eager["losses"][6:], resumed["losses"])}
    for f in ("model.bin", "state.bin"):
        same[f] = all(same_bytes(f"{tmp}/{run_dir}/ckpt_00000012/{f}", f"{tmp}/resumed/ckpt_00000012/{f}")
                      for run_dir in ("eager", "graphed"))
    report(all(same.values()), "resume with graphs is bit-exact: 6 + resume + 6 graphed == 12 graphed == 12 eager",
           f"differ: {[k for k, v in same.items() if not v]}")


# gradient accumulation: 32 tokens a micro-batch, 4 steps (1 eager, 2 captures, 3-4 replay), the learning rate
# changing at each (warm-up); --verbose prints every micro-batch's loss
ACCUMULATION = ["--batch-size", "1", "--seq-len", "32", "--lr", "1e-3", "--warmup-steps", "5", "--steps", "4", "--verbose"]


def printed(stdout):
    """Each step's loss, learning rate and norm, and each micro-batch's loss, as printed (not the times), and
    the data-parallel traffic of the first and last step (rank 0's counters)."""
    steps = [line.split(" ms")[0].rsplit("|", 1)[0] for line in stdout.splitlines() if line.startswith("step ")]
    micros = [line.rsplit("|", 1)[0] for line in stdout.splitlines() if line.startswith("      step ") and " micro " in line]
    traffic = [line for line in stdout.splitlines() if line.startswith("data-parallel traffic")]
    return steps, micros, traffic


def accumulation(S):
    mpirun = shutil.which("mpirun")
    configs = [(1, 2, 0, []), (1, 3, 0, [])]
    if EMULATED and mpirun:  # a GPU per emulated rank: NCCL (the stand-in), not host staging
        # fp8 on 2 ranks: the amax all-reduce (max) captured; ZeRO-2 on 3 ranks: rank 2's shards end in
        # padding (its part of the norm in pieces)
        configs += [(2, 3, 1, ["--precision", "fp8", "--checkpoint-every", "4"]), (3, 4, 2, [])]
    else:
        skip("--cuda-graphs with accumulation on 2 and 3 NCCL ranks", "needs the emulation (a GPU per rank) and mpirun")
    for ranks, micro, zero, more in configs:
        flags = ACCUMULATION + ["--total-batch-tokens", str(ranks * micro * 32), "--zero", str(zero)] + more + DEFAULT_ATTENTION
        runs = {}
        for name, extra in [("eager", []), ("graphed", ["--cuda-graphs"])]:
            tag = f"acc_{ranks}x{micro}_{name}"
            cmd = [GPU, "--model", f"{S.tmp}/tiny.bin"] + S.data["tiny"] + flags + extra + \
                  ["--dump-state", f"{S.tmp}/{tag}.st", "--out-dir", f"{S.tmp}/{tag}"]
            if ranks > 1:
                cmd = ["timeout", "300", mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np",
                       str(ranks)] + cmd
            p = run(cmd, env={"CUDA_EMU_DEVICES": "4"} if ranks > 1 else None)
            runs[name] = (read_safetensors(f"{S.tmp}/{tag}.st")[0], printed(p.stdout), p.stdout)
            fp8_state = f"{S.tmp}/{tag}/ckpt_00000004/fp8_state.bin"
            runs[name] += (open(fp8_state, "rb").read() if os.path.exists(fp8_state) else None,)
        (eager, (steps_e, micros_e, sent_e), _, fp8_e), (graphed, (steps_g, micros_g, sent_g), out, fp8_g) = \
            runs["eager"], runs["graphed"]
        lrs = {line.split("| lr ")[1].split()[0] for line in steps_g}
        graphs = ["first micro-batch", "last micro-batch"] + (["middle micro-batches"] if micro > 2 else [])
        same = {"weights": np.array_equal(eager["params"], graphed["params"]),
                "losses": np.array_equal(eager["losses"], graphed["losses"]),
                "printed steps (loss, lr, norm)": steps_e == steps_g and len(steps_e) == 4 and len(lrs) == 4,
                "printed micro-batch losses": micros_e == micros_g and len(micros_e) == 4 * micro,
                "traffic counted": sent_e == sent_g and len(sent_e) == (ranks > 1),
                "captured graphs": "step 2 captured the passes: " in out and all(g in out for g in graphs) and
                                   ("middle" in out) == (micro > 2) and f"{micro + 1} graph launches" in out}
        if "fp8" in more:  # the amax histories: a rank's own amax instead of the max over the ranks would show here
            same["fp8_state.bin (amax histories, scales)"] = fp8_e is not None and fp8_e == fp8_g
        first = next((i + 1 for i in range(min(len(steps_e), len(steps_g))) if steps_e[i] != steps_g[i]), None)
        report(all(same.values()), f"accumulation: {ranks} rank{'s' if ranks > 1 else ''}"
               f"{f', ZeRO-{zero}' if ranks > 1 else ''}{', ' + ' '.join(more[:2]) if more else ''}, {micro} micro-batches "
               f"a step: 4 graphed steps == 4 eager bit "
               f"for bit (weights, losses, norms, each micro-batch's loss; the learning rate changing at each step)",
               f"differ: {[k for k, v in same.items() if not v]} (first differing step {first})\n"
               f"eager {steps_e}\ngraphed {steps_g}\n{out[-1200:]}")


def refused(S):
    base = ["--model", f"{S.tmp}/tiny.bin"] + S.data["tiny"] + ["--batch-size", "2", "--seq-len", "32", "--steps", "2",
                                                               "--cuda-graphs", "--out-dir", f"{S.tmp}/refused"]
    for extra, needle in [(["--offload", "optimizer"], "--offload optimizer"), (["--zero", "3"], "--zero 3")]:
        one_line_error(f"train_gpt --cuda-graphs {' '.join(extra)}", base + extra, 2, "--cuda-graphs", needle, binary=GPU)
    one_line_error("train_gpt_cpu --cuda-graphs", ["--model", "L=2,C=64,H=4,T=64", "--cuda-graphs"], 2,
                   "--cuda-graphs applies only to the GPU trainer", "launches no kernels", binary=CPU)
    mpirun = shutil.which("mpirun")
    if not mpirun:
        skip("train_gpt --cuda-graphs on 2 ranks", "no mpirun")
        return
    p = subprocess.run(["timeout", "120", mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", "2",
                        GPU] + base, capture_output=True, text=True, cwd=ROOT)
    # one emulated GPU for both ranks: host-staged sums, which a graph cannot hold (2 NCCL ranks run graphed:
    # test_gpu_data_parallel.py)
    report(p.returncode == 2 and p.stderr.count("error:") == 1 and "--cuda-graphs with 2 ranks sharing a GPU" in p.stderr,
           "train_gpt --cuda-graphs on 2 ranks sharing a GPU: exit 2, one line naming it", f"exit {p.returncode}: {p.stderr[-600:]}")


def main():
    check("emulation", emulation)
    if MODE is None:
        skip("--cuda-graphs on the trainer", GPU)
        sys.exit(exit_code())
    for exe in (GPU, CPU):
        if not os.path.exists(exe):
            report(False, "binaries", f"{exe} is missing: run make")
            sys.exit(1)
    tmp = tempfile.mkdtemp(prefix="llmc_graphs_test_")
    try:
        S = Setup(tmp)
        S.shape("tiny", 2, 64, 4, 64, 500, 1)
        check("graphed == eager", graphed_equals_eager, S)
        check("fp16 with graphs", fp16_graphed, S)
        check("fp8 with graphs", fp8_graphed, S)
        check("resume with graphs", resume, S)
        check("graphs with accumulation", accumulation, S)
        check("refused", refused, S)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(exit_code())


if __name__ == "__main__":
    main()
