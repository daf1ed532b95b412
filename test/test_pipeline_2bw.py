#!/usr/bin/env python3
"""test_pipeline_2bw.py — PipeDream-2BW trained by the CPU trainer: the one-step-delayed rule, its memory, its resume.

PipeDream-2BW (llmc/parallel/pipedream_2bw.h) keeps two weight versions per stage and takes the
gradient of step t+1 on the older one: W(t+1) = W(t) - lr * AdamW(grad f(W(t-1))), W(-1) = W(0).
It runs without the flush (pipeline_2bw_steps: stage s starts step t+1's first forwards, on the
newer version, before its last backwards of step t, on the older), drained only before a checkpoint
and at the end. The model and data are test_parallelism.py's (L=4 C=64 H=4 T=32 V=501, B=1, lr 1e-3
cosine to 0 at the last step).

It is not a synchronous run, by design, so the references are:
  - the rule itself, from runs that share no 2BW code (the synchronous 1F1B trainer): step 1 is the
    synchronous step (both versions W(0)); step 2's loss is f(W(0), batch 2), which a 1F1B run at
    --lr 0 computes; step 3's is f(W(1), batch 3), W(1) being the synchronous W(1): a 1F1B run of one
    step, checkpointed, resumed at --lr 0, computes it. All bit for bit (same grid, same arithmetic).
    And 2BW must differ from 1F1B from step 2 on (losses and weights): it is not synchronous;
  - the rule written from the paper in float64 PyTorch (pytorch_2bw: test/gpt2_reference.py's model,
    AdamW and clipping), 5 steps at lr 1e-2 on 2 stages, within the margins derived at REF_TOL_LOSS;
  - 2bw-flush (each step drained: 1F1B's list) bit for bit: the overlap changes when, not what;
  - the one-rank run of the same rule (--pipeline-schedule 2bw on one rank: no pipeline code runs,
    no message is sent), against 2 and 4 stages with m = p and 2p, and dp2 x pp2 with ZeRO-1 (each
    data-parallel rank updates its shard of W(t), then shares it), over 6 AdamW steps: the same bits
    as 1F1B's pipelines give against one rank (test_parallelism compares them within its tolerances,
    check_close, the tied embedding's gradient being added in another order), and the 4-stage run
    equals the 2-stage one bit for bit (the schedule changes when a layer computes, not what);
  - memory: every rank holds what its size table says (older_weights included, check_predictions),
    and --estimate's params per rank are exactly 1F1B's twice (the stage's weights and, on the last
    stage, its copy of the tied embedding);
  - the versions saved: checkpoint t's older version says step t and is W(t-1), checkpoint t-1's
    weights bit for bit (a one-rank run checkpointed every step);
  - resume: 3 steps + checkpoint + 3 resumed == 6 straight bit for bit (the run drains at the
    checkpoint, so it holds no micro-batch in flight: only the two versions, the older in each
    rank's pipedream_2bw_rank<r>.bin); a 2BW resume from a 1F1B checkpoint is refused.
Bad input (one line, exit 2, before anything is allocated): 2BW with ZeRO-2/3, with tensor
parallelism, with m < p, and on the GPU trainer with CUDA graphs (the emulated build, when it is built;
it trains 2bw and 2bw-flush: test_gpu_pipeline_2bw.py, test_gpu_parallelism.py).
Planted bugs caught (by hand, then reverted):
  - a backward reading the newer version, not its forward's (forward_backward's pipedream_2bw_read
    for forwards only): the PyTorch check failed (losses 3e-2, weights 5e-2 off);
  - the gradient on W(t) instead of W(t-1) (then pipedream_2bw_before_passes returning at once): the rule's
    checks of steps 2 and 3 and "differs from 1F1B" failed (the one-rank comparisons still passed:
    they share that code, which is why the rule is checked against 1F1B runs);
  - the resume losing the older version (pipedream_2bw_load returning before reading, so both
    versions restart at W(3)): the resume check failed;
  - the older version's file saying step t-1 (pipedream_2bw_save): the versions-saved check failed.
"""
import os, re, shutil, struct, subprocess, sys, tempfile
from checks import report, exit_code
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from test_parallelism import (Runner, mpi_trainer_missing, MODEL, T, TRAINER, check_bitwise, check_close,  # noqa: E402
                              check_predictions, write_pattern_shard)

STEPS = 6
GPU_TRAINER = os.path.join(ROOT, "build", "emu", "train_gpt")
REF_STEPS, REF_LR = 5, 1e-2  # the PyTorch check: a large lr, so that W(t-2) and W(t-1) differ a lot
# fp32 trainer against the fp64 reference, 5 AdamW steps at lr 1e-2 (2 stages, m = 4): measured
# 5e-8 relative on the losses and 1e-4 on the weights (of the largest: AdamW's m / sqrt(v) turns a
# rounding-level gradient into a step of lr, so a few weights with near-zero gradients carry it).
# A backward reading the newer version (the planted bug) moved them 3e-2 and 5e-2. The margins:
# 200x and 10x the measured error, 2700x and 50x below the plant.
REF_TOL_LOSS, REF_TOL_PARAM = 1e-5, 1e-3


def pipe(p, m, schedule="2bw"):
    return ["--pipeline-parallel", p, "--pipeline-schedule", schedule, "--total-batch-tokens", m * T]


def params_per_rank(work, schedule, p, m):
    """Each rank's bytes of kind params as --estimate predicts them."""
    out = subprocess.run([TRAINER, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--estimate"] +
                         [str(f) for f in pipe(p, m, schedule)], capture_output=True, text=True, cwd=work).stdout
    return [int(x) for x in re.findall(r"^  rank \d+: params=(\d+)", out, re.M)]


def pytorch_2bw(model_path, shard, steps, m, lr):
    """PipeDream-2BW written from the paper's rule in float64 PyTorch (test/gpt2_reference.py's GPT-2,
    AdamW and clipping, which test_vs_pytorch holds the trainer to): step t's gradient, over its m
    micro-batches of the shard in order, taken on W(t-2) (W(-1) = W(0)), clipped by its global norm,
    and AdamW's step applied to W(t-1). Returns the losses and the final weights in file order."""
    import copy
    import torch
    import gpt2_reference as ref
    model = ref.load_model(model_path).to(torch.float64)
    older = copy.deepcopy(model)  # W(t-2)
    tokens = ref.read_token_shard(shard).astype(np.int64)
    optimizer = ref.make_optimizer(model, lr, 0.1)
    losses = []
    for t in range(steps):
        older.zero_grad(set_to_none=True)
        loss = 0.0
        for i in range(m):
            k = (t * m + i) * T
            x, y = torch.from_numpy(tokens[k:k + T]).view(1, T), torch.from_numpy(tokens[k + 1:k + T + 1]).view(1, T)
            _, micro = older(x, y)
            (micro / m).backward()
            loss += micro.item() / m
        losses.append(loss)
        newer = copy.deepcopy(model.state_dict())  # W(t-1), the next step's older version
        for p, q in zip(model.parameters(), older.parameters()):
            p.grad = q.grad.clone()
        ref.clip_by_global_norm(list(model.parameters()), 1.0)
        optimizer.step()
        older.load_state_dict(newer)
    params = ref.flatten_in_file_order(dict(model.named_parameters()), model.config)
    return np.array(losses), np.asarray(params, dtype=np.float64)


def write_reference_model(path):
    """test_parallelism's model shape, with the reference's random weights (every tensor distinct)."""
    import gpt2_reference as ref
    model = ref.GPT2(ref.GPT2Config(max_seq_len=T, vocab_size=501, num_layers=4, num_heads=4, channels=64))
    ref.init_fixture_weights(model, 1)
    ref.save_model(path, model)


def check_saved_versions(r, work):
    """The weight versions' counter: a 3-step one-rank 2BW run checkpointed every step (one rank: the slice's
    flat array is the model file's order). Checkpoint t's pipedream_2bw_rank0.bin says step t and holds W(t-1):
    checkpoint t-1's model.bin weights, bit for bit (t = 2, 3); checkpoint 1's holds W(0), not W(1)."""
    code, _, err = r.run(1, "--pipeline-schedule", "2bw", "--checkpoint-every", 1, steps=3)
    if code != 0:
        report(False, "2BW checkpoints: the versions saved", err[-600:])
        return
    ckpt = lambda t: os.path.join(work, "out", f"ckpt_{t:08d}")
    weights = {t: np.fromfile(os.path.join(ckpt(t), "model.bin"), dtype=np.float32, offset=1024) for t in (1, 2, 3)}
    steps, same, problems = [], [], []
    for t in (1, 2, 3):
        raw = open(os.path.join(ckpt(t), "pipedream_2bw_rank0.bin"), "rb").read()
        _magic, _version, _rank, _world, step, floats = struct.unpack_from("<4i2q", raw, 0)
        older = np.frombuffer(raw, dtype=np.float32, offset=32, count=floats)[:weights[t].size]
        steps.append(step)
        same.append(np.array_equal(older, weights[t - 1]) if t > 1 else not np.array_equal(older, weights[1]))
    report(steps == [1, 2, 3] and all(same),
           "2BW checkpoints: step t's older version is W(t-1) (checkpoint t-1's weights, bit for bit; checkpoint 1's is not W(1))",
           f"saved steps {steps}, versions right {same}")


def refused(cmd, needle, name, work):
    p = subprocess.run(cmd, capture_output=True, text=True, cwd=work)
    lines = [l for l in (p.stdout + p.stderr).splitlines() if l.strip()]
    report(p.returncode == 2 and len(lines) == 1 and needle in lines[0], f"{name}: exit 2, one line naming it",
           f"exit {p.returncode}: {lines[:3]}")


def main():
    if mpi_trainer_missing("PipeDream-2BW"):
        return 0
    work = tempfile.mkdtemp(prefix="llmc_2bw_")
    try:
        write_pattern_shard(work)
        r = Runner(work)

        # ---- the rule, against runs of the synchronous trainer (no 2BW code in them)
        two, _ = r.dump("pp2_m4_2bw", 2, *pipe(2, 4), steps=STEPS)
        sync, _ = r.dump("pp2_m4_1f1b", 2, *pipe(2, 4, "1f1b"), steps=STEPS)
        frozen, _ = r.dump("pp2_m4_1f1b_lr0", 2, *pipe(2, 4, "1f1b"), "--lr", 0, steps=3)
        # (the 6-step run's W(1): the cosine schedule's lr at step 1 depends on --steps)
        r.run(2, *pipe(2, 4, "1f1b"), "--checkpoint-every", 1, steps=STEPS)
        one_step = os.path.join(work, "out", "ckpt_00000001")
        at_w1, out_w1 = r.dump("pp2_m4_1f1b_from_w1_lr0", 2, *pipe(2, 4, "1f1b"), "--resume", one_step, "--lr", 0, steps=3)
        if all(x is not None for x in (two, sync, frozen, at_w1)):
            L = two["losses"]
            report(L[0] == sync["losses"][0] and np.array_equal(two["grads"], sync["grads"]),
                   "2BW step 1 == 1F1B step 1 bit for bit (loss and gradient: W(-1) = W(0))", f"{L[0]} vs {sync['losses'][0]}")
            report(L[1] == frozen["losses"][1], f"2BW step 2's loss is f(W(0), batch 2): {L[1]:.6f} == 1F1B at --lr 0 bit for bit",
                   f"{L[1]} vs {frozen['losses'][1]}")
            report("resumed from" in out_w1 and L[2] == at_w1["losses"][1],  # (its losses: steps 2 and 3)
                   f"2BW step 3's loss is f(W(1), batch 3): {L[2]:.6f} == 1F1B's W(1) resumed at --lr 0 bit for bit",
                   f"{L[2]} vs {at_w1['losses']}")
            differ = [k for k in range(1, STEPS) if L[k] != sync["losses"][k]]
            report(differ == list(range(1, STEPS)) and not np.array_equal(two["params"], sync["params"]),
                   f"2BW is not synchronous: its losses differ from 1F1B's at steps 2..{STEPS} "
                   f"({L[1]:.6f} vs {sync['losses'][1]:.6f} at step 2), and so do the weights", f"differ at {differ}")

        # ---- the versions the checkpoints hold: at step t the older one is W(t-1), the weights of checkpoint t-1
        check_saved_versions(r, work)

        # ---- without the flush (--pipeline-schedule 2bw) against each step drained (2bw-flush): the same bits
        flushed, _ = r.dump("pp2_m4_2bw_flush", 2, *pipe(2, 4, "2bw-flush"), steps=STEPS)
        check_bitwise("pp2 2BW without the flush == 2bw-flush (each step drained) bit for bit, m = 4", two, flushed)

        # ---- against PyTorch: the rule written from the paper, float64, no trainer code
        model_path = os.path.join(work, "ref_model.bin")
        write_reference_model(model_path)
        run, _ = r.dump("pp2_m4_2bw_vs_torch", 2, *pipe(2, 4), "--lr", REF_LR, "--lr-schedule", "constant",
                        model=model_path, steps=REF_STEPS)
        if run is not None:
            losses, params = pytorch_2bw(model_path, os.path.join(work, "train_000.bin"), REF_STEPS, 4, REF_LR)
            loss_err = float(np.max(np.abs(run["losses"] - losses) / np.abs(losses)))
            param_err = float(np.max(np.abs(run["params"] - params)) / np.max(np.abs(params)))
            report(loss_err <= REF_TOL_LOSS and param_err <= REF_TOL_PARAM,
                   f"pp2 2BW without the flush == PyTorch fp64's W(t+1) = W(t) - AdamW(grad f(W(t-1))) over {REF_STEPS} steps "
                   f"at lr {REF_LR} (losses {loss_err:.1e}, weights {param_err:.1e} of the largest)",
                   f"beyond {REF_TOL_LOSS} / {REF_TOL_PARAM}")

        # ---- the one-rank run of the same rule, against 2 and 4 stages, m = p and 2p
        ones = {}
        for p, m in [(2, 2), (2, 4), (4, 4), (4, 8)]:
            if m not in ones:
                ones[m], _ = r.dump(f"one_m{m}_2bw", 1, *pipe(1, m), steps=STEPS)
            run = two if (p, m) == (2, 4) else r.dump(f"pp{p}_m{m}_2bw", p, *pipe(p, m), steps=STEPS)[0]
            check_close(f"pp{p}, m={m}: 2BW over {STEPS} AdamW steps", run, ones[m])
            if (p, m) == (4, 4):
                check_bitwise("pp4 2BW == pp2 2BW bit for bit (m = 4)", run, two)
        # data parallelism around it: dp2 x pp2, ZeRO-1, 2 micro-batches per data-parallel rank (4 in all)
        dppp, _ = r.dump("dp2pp2_2bw", 4, "--pipeline-parallel", 2, "--pipeline-schedule", "2bw", "--zero", 1, steps=STEPS)
        check_close(f"dp2 x pp2, ZeRO-1: 2BW over {STEPS} AdamW steps", dppp, ones[4])

        # ---- memory: what each rank holds, and the second version in --estimate
        _, flush_out, _ = r.run(2, *pipe(2, 4, "2bw-flush"), steps=2)
        check_predictions("pp2 2bw-flush, m=4 (older_weights included)", flush_out, 2)
        # without the flush: the same memory; the last step's sends are the step's minus the w = p-1-s
        # activations that left with the step before (stage 0: one of B T C floats, 8 KiB)
        _, out, _ = r.run(2, *pipe(2, 4), steps=2)
        row = r"^  {} \(\d+,\d+,\d+\)\s+([\d. ]+?)\s+\| \S+ \S+ / \S+ \S+ / ([\d.]+) KiB"
        rows = [[re.search(row.format(k), o, re.M) for k in (0, 1)] for o in (flush_out, out)]
        if all(all(x) for x in rows):
            mem = [[x.group(1).split() for x in rs] for rs in rows]
            kib = [[float(x.group(2)) for x in rs] for rs in rows]
            report(mem[0] == mem[1] and kib[1] == [kib[0][0] - T * 64 * 4 / 1024, kib[0][1]],
                   f"pp2 2BW without the flush: the flushed run's memory on each rank; its last step sends {kib[1]} KiB, "
                   f"the flushed one's {kib[0]} less stage 0's activation sent a step early", f"{mem} {kib}")
        else:
            report(False, "pp2 2BW without the flush: the memory and bytes table", out[-1500:])
        est = {k: params_per_rank(work, k, 2, 4) for k in ("1f1b", "2bw")}
        report(len(est["2bw"]) == 2 and est["2bw"] == [2 * b for b in est["1f1b"]],
               f"--estimate, pp2: 2BW's params per rank = twice 1F1B's ({est['2bw']} = 2 x {est['1f1b']} bytes: "
               f"W(t) and W(t-1), the last stage's wte copy included)", str(est))

        # ---- resume: 3 steps, checkpoint, 3 more == 6 straight
        straight, _ = r.dump("pp2_2bw_ckpt", 2, *pipe(2, 4), "--checkpoint-every", 3, steps=STEPS)
        ckpt = os.path.join(work, "out", "ckpt_00000003")
        files = sorted(f for f in os.listdir(ckpt) if f.startswith("pipedream_2bw")) if os.path.isdir(ckpt) else []
        report(files == ["pipedream_2bw_rank0.bin", "pipedream_2bw_rank1.bin"], "the checkpoint holds each rank's older version",
               str(files))
        resumed, out = r.dump("pp2_2bw_resumed", 2, *pipe(2, 4), "--resume", ckpt, steps=STEPS)
        if straight is not None and resumed is not None:
            report("resumed from" in out and np.array_equal(resumed["params"], straight["params"]) and
                   np.array_equal(resumed["losses"], straight["losses"][3:]),
                   "pp2 2BW: 3 steps + checkpoint + resume + 3 steps == 6 straight, bit for bit", out[-800:])
        code, out, err = r.run(2, *pipe(2, 4), "--resume", one_step, steps=3)
        report(code != 0 and "has no older weight version" in out + err,
               "2BW resuming a 1F1B checkpoint is refused (its older version is missing)", (out + err)[-500:])

        # ---- bad input: one line, exit 2, before anything is allocated (no MPI needed)
        base = [TRAINER, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--train-data",
                os.path.join(work, "train_000.bin"), "--val-data", "none"]
        refused(base + [str(f) for f in pipe(2, 4)] + ["--zero", "2"], "2bw with --zero 2", "2BW with ZeRO-2", work)
        refused(base + [str(f) for f in pipe(2, 4)] + ["--zero", "3"], "2bw with --zero 3", "2BW with ZeRO-3", work)
        refused(base + [str(f) for f in pipe(2, 4)] + ["--tensor-parallel", "2"], "2bw with --tensor-parallel",
                "2BW with tensor parallelism", work)
        code, out, err = r.run(2, *pipe(2, 1))
        report(code == 2 and "cannot fill a pipeline of 2 stages" in out + err, "2BW with m = 1 < p = 2: refused, exit 2",
               f"exit {code}: {(out + err)[-400:]}")
        if os.path.exists(GPU_TRAINER):  # (it trains 2bw: test_gpu_pipeline_2bw.py)
            refused([GPU_TRAINER] + base[1:] + [str(f) for f in pipe(2, 4)] + ["--cuda-graphs"], "2bw with --cuda-graphs",
                    "the GPU trainer with 2BW and CUDA graphs", work)
        else:
            print("SKIP: the GPU trainer's refusal of 2BW with CUDA graphs (build/emu/train_gpt is not built: make emu)")
        print(f"({r.seconds:.0f} s in the trainer)", flush=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
