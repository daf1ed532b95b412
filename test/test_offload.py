#!/usr/bin/env python3
"""--offload optimizer (llmc/optim/offload.cuh) on the GPU trainer, on the CPU emulation of CUDA (or a GPU).

  same as on-device   a run with the optimizer offloaded equals the on-device run, accumulating 2
                      micro-batches per step (the micro-batches after the first must reach the host:
                      DeepSpeed PR 7967 dropped them): under the emulation bit for bit (weights, last
                      gradients, losses; the checkpoints' master, m, v under "resume"), since adamw.h and adamw.cuh's kernel do the same fp32
                      operations in the same order and round to bf16 with the same random bits. On a
                      real GPU nvcc may fuse multiply-adds the host compiler does not: there the bound
                      is the losses within 1e-3 and the weights' change within 2% (relative L2; a
                      flipped stochastic rounding moves a weight by one bf16 ulp), not yet measured.
                      The accumulation-1 run must differ, or the check could not see a lost micro-batch.
  streaming           the gradient streamed down bucket by bucket during the backward (the default, 1
                      layer a bucket; 2 layers a bucket) == all of it copied after the backward
                      (--offload-bucket-layers 0), bit for bit, 2 micro-batches per step; and the
                      backward did send them (the trainer's count of buckets sent before the step
                      waited: all with K = 1, 2; none with K = 0)
  ZeRO-1/2, 2 ranks   each rank offloads its shard (ZeRO-2: of the gradient too, packed unit by unit):
                      equal to the on-device ZeRO-1 run, bit for bit, 2 micro-batches per step; ZeRO-2
                      offloaded: 3 steps == 2 + resume + 1
  --offload-delay 1   the delayed parameter update W_t = W_{t-1} - lr u(g_t(W_{t-2})), against a reference
                      fed the one-step-stale weights: the undelayed (offloaded) trainer resumed from the
                      delayed run's checkpoint t-1 (model.bin: the GPU's weights W_{t-2}; state: W_{t-1},
                      m, v) for one step writes the delayed run's checkpoint t bit for bit (state.bin),
                      t = 2, 3, 4; the GPU gets step t's weights one step late (the delayed checkpoint 3's
                      model.bin is the undelayed step 2's, not step 3's); the last step uploads (4's is
                      step 4's); 4 steps == 2 + resume + 2 with the delay (the pending upload recomputed)
  delay on 2 ranks    ZeRO-1, each rank offloading its shard, one micro-batch each: the same reference on 2
                      ranks (undelayed, resumed from the delayed checkpoint t-1, writes both state files of
                      checkpoint t, t = 2, 3); checkpoint 2's model.bin stale, 3's (the last: uploaded and
                      all-gathered) the undelayed step 3's; == 1 rank accumulating the 2 micro-batches
                      with the delay: losses of steps 1, 2 bit for bit (both on the initial weights), the
                      weight change after 3 steps within 5e-2 (measured 1.3e-2; the undelayed run is 0.34
                      away: the bf16 gradient sums differ in order, not the update); 3 == 1 + resume + 2;
                      ZeRO-2 == ZeRO-1 bit for bit
  bf16 moments        --optimizer-state bf16 offloaded (the host runs adamw_bf16.h's update, m and v in bf16):
                      == on-device bf16 AdamW bit for bit, 2 micro-batches per step, 4 steps (weights,
                      gradients, losses, state.bin); 4 == 2 + resume + 2; ZeRO-2 on 2 ranks offloaded ==
                      on-device ZeRO-1, bit for bit (the rounding keyed by the model's index)
  resume              4 steps == 2 + resume + 2 with offload, and across: an offloaded run's checkpoint
                      resumed on the device, and an on-device checkpoint resumed offloaded (same file
                      format, same arithmetic: bit for bit)
  memory cap          CUDA_EMU_DEVICE_MEMORY between the two runs' needs: refused up front without
                      offload (the trainer's out-of-memory line), trains with it
  --estimate          master and optimizer rows are 0 on the GPU; the host line holds 18 bytes per parameter
                      (20 with --offload-delay 1: the weights going up get their own bf16 array; 14 and 16
                      with --optimizer-state bf16)
  bad input           one line, exit 2: an unknown value, --zero 3, --master-weights 0, tensor
                      parallelism, the fp32 build, and the CPU trainer (its state is already on the host);
                      --offload-delay 2, --offload-delay or --offload-bucket-layers without --offload,
                      --offload-bucket-layers -1

Planted bugs this caught (by hand, then reverted): copying only half of the gradient to the host
(the on-device comparison failed); skipping the bf16 copy-back (the comparison failed); streaming
each bucket on the step's first micro-batch instead of its last, DeepSpeed PR 7967's bug (the
on-device and the unstreamed comparisons failed); the delay's CPU step awaited and uploaded at once,
no staleness (the staleness check failed: checkpoint 3's model.bin was step 3's); a resumed delayed run not recomputing its pending
upload (the delayed resume failed); ZeRO-2's updated weights uploaded to their place in the shard
instead of the flat array (the ZeRO-2 comparison failed); the backward's hook not sending its buckets,
all copied after it (the bit-for-bit checks passed, as they must; the count of buckets sent failed);
ZeRO-2's offloaded m not loaded on resume (the ZeRO-2 resume's checkpoint files differed); on 2 ranks
with the delay, the last step's upload not all-gathered (the straight run stopped: "the replicas drifted
apart" at its last checkpoint), and the delay's fresh weights uploaded and all-gathered at once (the
staleness check and the one-rank comparison failed); the host's bf16 moments rounded to nearest (the
bf16 comparisons failed), keyed by their place in the shard instead of the model (the 2-rank bf16
comparison failed).
"""
import os, re, shutil, subprocess, sys, tempfile
import numpy as np
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from checks import report, exit_code  # noqa: E402
from safetensors_io import read_safetensors  # noqa: E402
from test_gpu import CPU, GPU, GPU32, MODE, EMULATED, DEFAULT_ATTENTION, Setup, run, same_bytes, same_state_file, rel  # noqa: E402

B, T = 2, 32
STEPS = ["--batch-size", str(B), "--seq-len", str(T), "--lr", "1e-3", "--warmup-steps", "1"] + DEFAULT_ATTENTION
ACCUM2 = ["--total-batch-tokens", str(2 * B * T)]
OFF = ["--offload", "optimizer"]
DELAY = OFF + ["--offload-delay", "1"]
BF16 = ["--optimizer-state", "bf16"]


def same_dumps(a, b):
    """Which of the dumped weights, gradients, losses differ (empty: bit for bit)."""
    return [k for k in ("params", "grads", "losses") if not np.array_equal(a[k], b[k])]


def like_on_device(S, off, on, what):
    """Emulated: bit for bit. On a GPU: within the bounds of the docstring."""
    if EMULATED:
        differ = same_dumps(off, on)
        report(not differ, f"{what}, bit for bit", f"differ: {differ}; losses {off['losses']} vs {on['losses']}, "
               f"weights rel {rel(off['params'], on['params']):.2e}")
    else:
        init = S.models["tiny"]
        loss, change = float(np.max(np.abs(off["losses"] - on["losses"]))), rel(off["params"] - init, on["params"] - init)
        report(loss <= 1e-3 and change <= 2e-2, f"{what}, within bounds (losses {loss:.1e}, weight change rel {change:.1e})",
               "beyond losses 1e-3, weight change 2e-2")


def same_as_on_device(S):
    flags = STEPS + ACCUM2 + ["--steps", "3"]
    on, off = S.dump(GPU, "tiny", flags), S.dump(GPU, "tiny", flags + OFF)
    one_micro = S.dump(GPU, "tiny", STEPS + ["--steps", "3"] + OFF)
    like_on_device(S, off, on, "offloaded AdamW == on-device AdamW, 2 micro-batches per step, 3 steps")
    report(not np.array_equal(one_micro["params"], off["params"]),
           "the second micro-batch changes the result (a dropped micro-batch would be seen)", "one micro-batch == two")


def streaming(S):
    flags = STEPS + ACCUM2 + ["--steps", "3"] + OFF
    dumps = {}
    # K = 1 (the default; its dump is left in S's cache for same_as_on_device), 2 (L = 2: one bucket of
    # layers), 0 (after the backward); tiny's buckets: its 2 layers and the ends
    for k, sent in ((None, "3 of 3"), ("2", "2 of 2"), ("0", "0 of 2")):
        extra = flags + (["--offload-bucket-layers", k] if k else [])
        path = f"{S.tmp}/streaming_{k}.st"
        p = run([GPU, "--model", f"{S.tmp}/tiny.bin", "--dump-state", path] + S.data["tiny"] + extra)
        S.dumps[(GPU, "tiny", tuple(extra))] = path
        dumps[k] = read_safetensors(path)[0]
        line = f"the last step's backward sent {sent} gradient buckets"
        report(line in p.stdout, f"--offload-bucket-layers {k or '1 (default)'}: {line} as it finished them",
               "; ".join(x for x in p.stdout.splitlines() if x.startswith("offload")))
    for k, what in (("0", "copied after the backward"), ("2", "streamed in one 2-layer bucket and the ends")):
        differ = same_dumps(dumps[None], dumps[k])
        report(not differ, f"gradient streamed a layer a bucket during the backward == {what}, bit for bit, "
               "2 micro-batches per step", f"differ: {differ}")


def mpirun_cmd(np_):
    mpirun = shutil.which("mpirun")
    return mpirun and ["timeout", "300", mpirun, "--allow-run-as-root", "--oversubscribe", "--bind-to", "none", "-np", str(np_)]


def delayed_update(S):
    tmp = S.tmp
    ckpt = lambda d, t: f"{tmp}/{d}/ckpt_{t:08d}"  # noqa: E731
    # a constant LR: the reference's runs stop at step t, and the schedule must not end there
    steps = STEPS + ["--lr-schedule", "constant"]
    flags = steps + ["--steps", "4", "--checkpoint-every", "1"]
    straight = S.dump(GPU, "tiny", flags + DELAY + ["--out-dir", f"{tmp}/delay_a"])
    # the reference: one undelayed step from the delayed run's checkpoint t-1, into checkpoint t
    for t in (2, 3, 4):
        out = f"{tmp}/delay_ref{t}"
        os.makedirs(out)
        shutil.copytree(ckpt("delay_a", t - 1), ckpt(f"delay_ref{t}", t - 1))
        ref = read_safetensors(S.dump_path(GPU, "tiny", steps + ["--steps", str(t), "--checkpoint-every", "1",
                                                                   "--out-dir", out, "--resume", "latest"] + OFF))[0]
        same_state = same_state_file(f"{ckpt('delay_a', t)}/state.bin", f"{ckpt(f'delay_ref{t}', t)}/state.bin")
        same_loss = np.array_equal(ref["losses"], straight["losses"][t - 1:t])
        report(same_state and same_loss, f"--offload-delay 1, step {t}: == an undelayed step from the GPU weights of step "
               f"{t - 2} and the master weights of step {t - 1} (state.bin: master, m, v; the loss), bit for bit",
               f"state.bin same: {same_state}; loss {straight['losses'][t - 1]} vs {ref['losses']}")
    model = lambda d, t: f"{ckpt(d, t)}/model.bin"  # noqa: E731
    late = same_bytes(model("delay_a", 3), model("delay_ref2", 2)) and not same_bytes(model("delay_a", 3), model("delay_ref3", 3))
    report(late, "--offload-delay 1: the GPU holds step 2's weights after step 3 (model.bin), not step 3's: one step stale",
           "checkpoint 3's model.bin is not step 2's, or is step 3's")
    report(same_bytes(model("delay_a", 4), model("delay_ref4", 4)), "--offload-delay 1: the last step uploads its weights "
           "(checkpoint 4's model.bin == the undelayed step 4's)", "the last checkpoint's weights are stale")
    # resume: the pending upload (step 2's weights, not in model.bin) recomputed from the master weights
    out = f"{tmp}/delay_resume"
    os.makedirs(out)
    shutil.copytree(ckpt("delay_a", 2), ckpt("delay_resume", 2))
    resumed = read_safetensors(S.dump_path(GPU, "tiny", flags + DELAY + ["--out-dir", out, "--resume", "latest"]))[0]
    differ = [k for k in ("params",) if not np.array_equal(resumed[k], straight[k])]
    if not np.array_equal(resumed["losses"], straight["losses"][2:]):
        differ.append("losses")
    same_files = all(same_bytes(f"{ckpt('delay_resume', t)}/{f}", f"{ckpt('delay_a', t)}/{f}")
                     for t in (3, 4) for f in ("model.bin", "state.bin"))
    report(not differ and same_files, "--offload-delay 1: 4 steps == 2 + resume + 2, bit for bit (weights, losses, "
           "checkpoints 3 and 4)", f"differ: {differ}; checkpoints same: {same_files}")


def delayed_two_ranks(S):
    """--offload-delay 1 over 2 data-parallel ranks, each offloading its shard (see the docstring)."""
    launcher = mpirun_cmd(2)
    if not launcher:
        print("SKIP: --offload-delay 1 over 2 ranks (no mpirun)")
        return
    tmp = S.tmp
    ckpt = lambda d, t: f"{tmp}/{d}/ckpt_{t:08d}"  # noqa: E731
    steps = STEPS + ACCUM2 + ["--lr-schedule", "constant"]  # constant: the references stop at step t
    files = ("model.bin", "state_rank0.bin", "state_rank1.bin")

    def two(name, extra, out=None, copy=None):
        if copy:
            shutil.copytree(*copy)
        path = f"{tmp}/{name}.st"
        run(launcher + [GPU, "--model", f"{tmp}/tiny.bin", "--dump-state", path, "--out-dir", out or f"{tmp}/{name}"] +
            S.data["tiny"] + steps + extra)
        return read_safetensors(path)[0]

    flags = ["--zero", "1", "--steps", "3", "--checkpoint-every", "1"]
    straight = two("dp2_delay", flags + DELAY)
    # the reference: one undelayed step on 2 ranks from the delayed run's checkpoint t-1, into checkpoint t
    for t in (2, 3):
        ref = two(f"dp2_ref{t}", ["--zero", "1", "--steps", str(t), "--checkpoint-every", "1", "--resume", "latest"] + OFF,
                  copy=(ckpt("dp2_delay", t - 1), ckpt(f"dp2_ref{t}", t - 1)))
        same_state = all(same_state_file(f"{ckpt('dp2_delay', t)}/{f}", f"{ckpt(f'dp2_ref{t}', t)}/{f}") for f in files[1:])
        same_loss = np.array_equal(ref["losses"], straight["losses"][t - 1:t])
        report(same_state and same_loss, f"--offload-delay 1, ZeRO-1 on 2 ranks, step {t}: == an undelayed 2-rank step from "
               f"the GPU weights of step {t - 2} and the shards' master weights of step {t - 1} (both ranks' state files, "
               "the loss), bit for bit", f"state files same: {same_state}; loss {straight['losses'][t - 1]} vs {ref['losses']}")
    model = lambda d, t: f"{ckpt(d, t)}/model.bin"  # noqa: E731
    stale = not same_bytes(model("dp2_delay", 2), model("dp2_ref2", 2))
    report(stale and same_bytes(model("dp2_delay", 3), model("dp2_ref3", 3)), "--offload-delay 1 on 2 ranks: the all-gathered "
           "weights are a step stale (checkpoint 2's model.bin is not step 2's), and the last step uploads and all-gathers "
           "both shards (checkpoint 3's model.bin == the undelayed step 3's)",
           f"checkpoint 2 stale: {stale}; checkpoint 3's model.bin is not the undelayed step 3's")
    # one rank accumulating the same 2 micro-batches: the same delayed update; the bf16 gradient is summed in another
    # order (NCCL's sum of two rounded halves, against the backward adding into a rounded one), so close, not equal
    one = S.dump(GPU, "tiny", steps + ["--steps", "3"] + DELAY)
    init = S.models["tiny"][0]
    change, loss = rel(straight["params"] - init, one["params"] - init), float(np.max(np.abs(straight["losses"] - one["losses"])))
    report(np.array_equal(straight["losses"][:2], one["losses"][:2]) and change <= 5e-2 and loss <= 1e-3,
           f"--offload-delay 1: 2 ranks == 1 rank accumulating 2 micro-batches (steps 1, 2 both on the initial weights: "
           f"losses bit for bit; after 3 steps weight change rel {change:.1e} <= 5e-2, losses within {loss:.1e} <= 1e-3)",
           f"losses {straight['losses']} vs {one['losses']}")
    resumed = two("dp2_resume", flags + DELAY + ["--resume", "latest"], copy=(ckpt("dp2_delay", 1), ckpt("dp2_resume", 1)))
    same = np.array_equal(resumed["params"], straight["params"]) and np.array_equal(resumed["losses"], straight["losses"][1:])
    same_files = all(same_bytes(f"{ckpt('dp2_resume', t)}/{f}", f"{ckpt('dp2_delay', t)}/{f}") for t in (2, 3) for f in files)
    report(same and same_files, "--offload-delay 1 on 2 ranks: 3 steps == 1 + resume + 2, bit for bit (weights, losses, "
           "checkpoints 2 and 3)", f"weights and losses same: {same}; checkpoint files same: {same_files}")
    zero2 = two("dp2_delay_zero2", ["--zero", "2", "--steps", "3"] + DELAY)
    differ = same_dumps(zero2, straight)
    report(not differ, "--offload-delay 1 with ZeRO-2 on 2 ranks (the gradient's shards offloaded) == with ZeRO-1, bit for bit",
           f"differ: {differ}")


def bf16_moments(S):
    """--optimizer-state bf16 offloaded: the host runs the CPU trainer's bf16-moment AdamW (see the docstring)."""
    tmp = S.tmp
    flags = STEPS + ACCUM2 + BF16 + ["--steps", "4", "--checkpoint-every", "2"]
    on = S.dump(GPU, "tiny", flags + ["--out-dir", f"{tmp}/bf16_on"])
    off = S.dump(GPU, "tiny", flags + OFF + ["--out-dir", f"{tmp}/bf16_off"])
    state = lambda d, t=4: f"{tmp}/{d}/ckpt_{t:08d}/state.bin"  # noqa: E731
    differ = same_dumps(off, on)
    same_state = same_bytes(state("bf16_on"), state("bf16_off"))
    report(not differ and same_state, "--optimizer-state bf16 offloaded == on the device, 2 micro-batches per step, 4 steps, "
           "bit for bit (weights, gradients, losses, state.bin: master and the bf16 m, v)",
           f"differ: {differ}; state.bin same: {same_state}")
    out = f"{tmp}/bf16_resume"
    shutil.copytree(f"{tmp}/bf16_off/ckpt_00000002", f"{out}/ckpt_00000002")
    resumed = S.dump(GPU, "tiny", flags + OFF + ["--out-dir", out, "--resume", "latest"])
    same = np.array_equal(resumed["params"], off["params"]) and np.array_equal(resumed["losses"], off["losses"][2:])
    report(same and same_bytes(state("bf16_resume"), state("bf16_off")), "--optimizer-state bf16 offloaded: 4 steps == 2 + "
           "resume + 2, bit for bit (weights, losses, state.bin)", f"weights and losses same: {same}")
    launcher = mpirun_cmd(2)
    if not launcher:
        print("SKIP: --optimizer-state bf16 offloaded over 2 ranks (no mpirun)")
        return
    dumps = []
    for i, extra in enumerate((["--zero", "1"], ["--zero", "2"] + OFF)):
        path = f"{tmp}/bf16_zero{i}.st"
        run(launcher + [GPU, "--model", f"{tmp}/tiny.bin", "--steps", "3", "--dump-state", path, "--out-dir",
                        f"{tmp}/bf16_zero{i}"] + S.data["tiny"] + STEPS + ACCUM2 + BF16 + extra)
        dumps.append(read_safetensors(path)[0])
    differ = same_dumps(dumps[1], dumps[0])
    report(not differ, "--optimizer-state bf16: ZeRO-2 on 2 ranks, each offloading its shards == on-device ZeRO-1, bit for "
           "bit (each piece's moments round with its index in the whole model)", f"differ: {differ}")


def zero_two_ranks(S):
    launcher = mpirun_cmd(2)
    if not launcher:
        print("SKIP: ZeRO-1 over 2 ranks with offload (no mpirun)")
        return
    dumps = []
    zero2 = ["--zero", "2", "--checkpoint-every", "2"] + OFF  # its checkpoint 2 resumed below
    for i, extra in enumerate((["--zero", "1"], ["--zero", "1"] + OFF, zero2, zero2 + ["--resume", "latest"])):
        path, out = f"{S.tmp}/zero_{i}.st", f"{S.tmp}/zero_out{i}"
        if i == 3:  # ZeRO-2 offloaded, resumed from its own checkpoint 2
            shutil.copytree(f"{S.tmp}/zero_out2/ckpt_00000002", f"{out}/ckpt_00000002")
        run(launcher + [GPU, "--model", f"{S.tmp}/tiny.bin", "--steps", "3", "--dump-state", path, "--out-dir", out] +
            S.data["tiny"] + STEPS + ACCUM2 + extra)
        dumps.append(read_safetensors(path)[0])
    for stage, dump in (("1", dumps[1]), ("2", dumps[2])):
        like_on_device(S, dump, dumps[0], f"ZeRO-{stage} on 2 ranks, each offloading its shard == on-device ZeRO-1, "
                       "2 micro-batches per step")
    same = np.array_equal(dumps[3]["params"], dumps[2]["params"]) and np.array_equal(dumps[3]["losses"], dumps[2]["losses"][2:])
    files = all(same_bytes(f"{S.tmp}/zero_out3/ckpt_00000003/{f}", f"{S.tmp}/zero_out2/ckpt_00000003/{f}")
                for f in ("model.bin", "state_rank0.bin", "state_rank1.bin"))
    report(same and files, "ZeRO-2 offloaded on 2 ranks: 3 steps == 2 + resume + 1, bit for bit (weights, loss, the "
           "checkpoint's files)",
           f"weights and losses same: {same}; checkpoint files same: {files}")


def resume(S):
    tmp = S.tmp
    flags = STEPS + ACCUM2 + ["--steps", "4", "--checkpoint-every", "2"]
    straight = S.dump(GPU, "tiny", flags + OFF + ["--out-dir", f"{tmp}/off_a"])
    on_device = S.dump(GPU, "tiny", flags + ["--out-dir", f"{tmp}/on_a"])
    for i, (src, extra, name) in enumerate((("off_a", OFF, "offloaded checkpoint resumed offloaded"),
                             ("off_a", [], "offloaded checkpoint resumed on the device"),
                             ("on_a", OFF, "on-device checkpoint resumed offloaded"))):
        out = f"{tmp}/resume_{i}"
        shutil.copytree(f"{tmp}/{src}", out)
        shutil.rmtree(f"{out}/ckpt_00000004")
        resumed = read_safetensors(S.dump_path(GPU, "tiny", flags + extra + ["--out-dir", out, "--resume", "latest"]))[0]
        differ = [] if np.array_equal(resumed["params"], straight["params"]) else ["params"]
        if not np.array_equal(resumed["losses"], straight["losses"][2:]):
            differ.append("losses")
        same_files = same_bytes(f"{out}/ckpt_00000004/state.bin", f"{tmp}/{src}/ckpt_00000004/state.bin")
        report(not differ and same_files, f"resume: {name} == the straight run (4 steps == 2 + resume + 2), bit for bit",
               f"differ: {differ}; step-4 state.bin same: {same_files}")
    # the checkpoints hold master, m and v: the same bytes show the host's AdamW state equals the GPU's
    same_state = same_bytes(f"{tmp}/on_a/ckpt_00000004/state.bin", f"{tmp}/off_a/ckpt_00000004/state.bin")
    report(not same_dumps(straight, on_device) and same_state,
           "the on-device and offloaded 4-step runs agree: weights, losses, and state.bin (master, m, v) byte for byte",
           f"differ: {same_dumps(straight, on_device)}; state.bin same: {same_state}")


def table_total(exe, flags):
    p = run([exe, "--estimate"] + flags)
    return int(re.search(r"^  total +([\d,]+)", p.stdout, re.M).group(1).replace(",", ""))


def memory_cap(S):
    base = ["--model", f"{S.tmp}/tiny.bin"] + STEPS
    on, off = table_total(GPU, base), table_total(GPU, base + OFF)
    margin = 512 << 20  # GPU_MEMORY_MARGIN_BYTES: the trainer wants the table plus this free
    cap = {"CUDA_EMU_DEVICE_MEMORY": str(margin + (on + off) // 2)}
    flags = base + S.data["tiny"] + ["--steps", "2"]
    p = run([GPU] + flags, expect_ok=False, env=cap)
    report(p.returncode == 1 and "of GPU memory" in p.stderr and "step" not in p.stdout,
           f"memory cap {(on + off) // 2} B + margin: refused up front without offload (needs {on} B)",
           f"exit {p.returncode}: {p.stderr[-500:]}")
    p = run([GPU] + flags + OFF, expect_ok=False, env=cap)
    held = re.search(r"GPU memory bytes: table (\d+), .* peak minus before (\d+)", p.stdout)
    report(p.returncode == 0 and "step     2/2" in p.stdout and held is not None and int(held.group(1)) == off
           and int(held.group(2)) <= off, f"the same cap: trains with --offload optimizer, holding at most its table "
           f"({held.group(2) if held else '?'} <= {off} B on the device)", f"exit {p.returncode}: {p.stderr[-500:]}")


def estimate(S):
    d12 = ["--model", "d12", "--batch-size", "4", "--seq-len", "1024", "--estimate"]
    on, off = run([GPU] + d12).stdout, run([GPU] + d12 + OFF).stdout
    total = lambda s: int(re.search(r"^  total +([\d,]+)", s, re.M).group(1).replace(",", ""))  # noqa: E731
    host = re.search(r"host \(pinned, --offload optimizer\) ([\d,]+)", off)
    n = 124475904  # d12's parameters with the vocabulary padded to 50304: every one updated on one rank
    ok = host is not None and int(host.group(1).replace(",", "")) == 18 * n and total(on) - total(off) == 12 * n
    report(ok, "--estimate: offload moves 12 bytes/param off the GPU and puts 18 on the host (d12)",
           f"totals {total(on)} -> {total(off)}; {host.group(0) if host else 'no host line'}")
    delayed = run([GPU] + d12 + DELAY).stdout
    host = re.search(r"host \(pinned, --offload optimizer\) ([\d,]+)", delayed)
    ok = host is not None and int(host.group(1).replace(",", "")) == 20 * n and total(delayed) == total(off)
    report(ok, "--estimate: --offload-delay 1 puts 20 bytes/param on the host (a bf16 array for the weights going up), "
           "the GPU's the same", f"{host.group(0) if host else 'no host line'}")
    for flags, per in ((OFF, 14), (DELAY, 16)):  # bf16 m and v: 2 + 2 bytes instead of 4 + 4
        text = run([GPU] + d12 + flags + BF16).stdout
        host = re.search(r"host \(pinned, --offload optimizer\) ([\d,]+)", text)
        ok = host is not None and int(host.group(1).replace(",", "")) == per * n and total(text) == total(off)
        report(ok, f"--estimate: {' '.join(flags[2:] + BF16)} puts {per} bytes/param on the host (m, v in bf16), the GPU's "
               "the same", f"{host.group(0) if host else 'no host line'}")


def bad_input(S):
    base = ["--model", f"{S.tmp}/tiny.bin"] + S.data["tiny"] + STEPS + ["--steps", "1"]
    cases = [(GPU, ["--offload", "disk"], "--offload must be none or optimizer"),
             (GPU, OFF + ["--zero", "3"], "--zero 3"),
             (GPU, OFF + ["--master-weights", "0"], "--master-weights 0"),
             (GPU, OFF + ["--tensor-parallel", "2"], "tensor or pipeline"),
             (CPU, OFF, "applies only to the GPU trainer"),
             (GPU, OFF + ["--offload-delay", "2"], "--offload-delay must be 0 or 1"),
             (GPU, ["--offload-delay", "1"], "give --offload optimizer too"),
             (GPU, ["--offload-bucket-layers", "2"], "give --offload optimizer too"),
             (GPU, OFF + ["--offload-bucket-layers", "-1"], "--offload-bucket-layers must be 0 or more"),
             (CPU, DELAY, "applies only to the GPU trainer")]
    if os.path.exists(GPU32):
        cases.append((GPU32, OFF, "fp32 build"))
    for exe, flags, words in cases:
        p = run([exe] + base + flags, expect_ok=False)
        lines = p.stderr.strip().splitlines()
        report(p.returncode == 2 and len(lines) == 1 and words in lines[0],
               f"{os.path.basename(exe)} {' '.join(flags)}: one line, exit 2", f"exit {p.returncode}: {p.stderr[-400:]}")


def main():
    if MODE is None:
        print(f"SKIP: every offload check ({GPU})")
        sys.exit(exit_code())
    tmp = tempfile.mkdtemp(prefix="llmc_offload_test_")
    try:
        S = Setup(tmp)
        S.shape("tiny", 2, 128, 2, 64, 500, 1)
        for fn in (streaming, same_as_on_device, zero_two_ranks, delayed_update, delayed_two_ranks, bf16_moments, resume, memory_cap, estimate, bad_input):
            try:
                fn(S)
            except Exception as e:  # noqa: BLE001 - one failing group does not hide the others
                report(False, fn.__name__, f"{type(e).__name__}: {e}"[-3000:])
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    sys.exit(exit_code())


if __name__ == "__main__":
    main()
