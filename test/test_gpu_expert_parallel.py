#!/usr/bin/env python3
"""test_gpu_expert_parallel.py — --expert-parallel N on the GPU trainer over NCCL (issue 24 item 2;
llmc/parallel/expert_parallel.cuh, docs/moe.md). 2 emulated GPUs (one per MPI rank: the NCCL stand-in's
grouped ncclSend/ncclRecv), E = 4 experts split 2 + 2, test_gpu_moe_trainer.py's tiny model (L=2 C=64
T=32 B=2, N = 64 tokens a rank and micro-batch) and helpers; 2 or 3 AdamW steps.

  fp32 vs cpu    the fp32 build (the same kernels in fp32) on 4 emulated GPUs, EP 2 x DP 2 (two expert
                 groups: each expert's gradient summed over its 2 replicas), top-2, no dropping, against
                 the CPU trainer's same run (itself == one rank: test_expert_parallel.py): step 1's
                 logits, loss and dense gradient at test_gpu.py's FP32_TOL, the MoE table's gradient
                 (gathered on rank 0: each rank holds its experts only) within 1e-3, the weights' change
                 within 1e-2, every step's routing identical and its norm within 1e-3 (each expert
                 counted once, not once a replica)
  traffic        the bytes its all-to-alls sent (counts, then rows; the trainers' counters, every rank
                 summed) and their calls == the CPU trainer's for the same run (fp32: 4 bytes a value on
                 both)
  bf16 vs 1 rank the bf16 build at EP 2, top-2, capacity 1.25 (drops) == 1 GPU accumulating the same 2
                 micro-batches within test_gpu.py's BF16_TOL, the MoE table's gradient within 2%, every
                 step's norm (2e-3 at step 1, 5e-2 later, as test_gpu_moe_trainer's data parallel check)
  starved        top-1 with routers that send every token to experts 0 or 1 (rows 0 and 1 opposite,
                 rows 2 and 3 zero): rank 1, the owner of experts 2 and 3, receives no row; the run
                 neither hangs nor differs from the CPU trainer's one rank (fp32 build, FP32_TOL), and
                 experts 2 and 3 get a gradient of exactly 0 (their routers' is not)
  resume         EP 2, 2 steps + checkpoint + 1 step == 3 steps bit for bit (losses, weights with the
                 whole MoE table); the checkpoint is the same file at any degree (rank 0 gathers the
                 experts), so resuming it at EP 1 (data parallel on the same 2 GPUs) gives the EP 2
                 run's losses and weights within BF16_TOL
  estimate       rank 0's table (the ep_* rows: the rows an owner receives, the exchange's scratch and
                 counts) == --estimate --estimate-ranks 2's, byte for byte; the bytes sent a step and rank
                 between --estimate's counts and its bound
  refused        --expert-parallel 2 with ranks sharing one GPU (host staging), --zero 1, 3 ranks:
                 one line, exit 2
Planted by hand and caught (docs/moe.md): the experts' gradients summed over the whole data group
instead of their replicas (the NCCL stand-in stops the run: the ranks' held tables differ in size);
the combine sent back with the forward's counts (the emulator faults past the end of eout's
allocation); the norm without rank 1's experts ("fp32 vs cpu" when it ran EP 2 on 2 ranks: every
step's norm 9% low); the norm counting every replica's experts (EP 2 x DP 2: "fp32 vs cpu"'s norms
8.6% high). Cost: 1 emulated 4-rank run of 2 steps, 4 emulated 2-rank runs of 1 to 3 steps, 1
one-rank run and an --estimate, 2 short CPU runs, 3 refusals: 57 s on the busy shared 2-core machine.
"""
import os, re, shutil, subprocess, sys, tempfile
import numpy as np
from checks import report, exit_code
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_gpu as tg  # noqa: E402
import test_gpu_moe_trainer as gm  # noqa: E402
from token_shards import write_shard  # noqa: E402

E, L, C = gm.E, gm.L, gm.C
BYTES = re.compile(r"^expert parallel: the all-to-alls sent (\d+) bytes from all ranks over \d+ steps, .*?\((\d+) calls a rank", re.M)


def write_starved_model(path):
    """A top-1 version-7 file whose routers send every token to expert 0 or 1: logits (l, -l, 0, 0)."""
    init, names, off = gm.write_moe_model(path, 1)
    P = off[-1]
    router = init[P:P + L * E * C].reshape(L, E, C)
    router[:, 1] = -router[:, 0]
    router[:, 2:] = 0.0
    init[P:P + L * E * C] = router.reshape(-1)
    with open(path, "r+b") as f:
        f.seek(256 * 4 + P * 4)
        f.write(init[P:].astype(np.float32).tobytes())
    return init, names, off


def expert_slices(e):
    """Where expert e (1..E-1) sits in the whole MoE table: its fcw, fcb, fcprojw, fcprojb of every block."""
    H4 = 4 * C
    sizes = [H4 * C, H4, C * H4, C]
    at, out = L * E * C, []
    for size in sizes:
        for b in range(L):
            start = at + (b * (E - 1) + (e - 1)) * size
            out.append(slice(start, start + size))
        at += L * (E - 1) * size
    return out


def traffic(out):
    m = BYTES.search(out)
    return (int(m.group(1)), int(m.group(2))) if m else None


def check_fp32_vs_cpu(R, models):
    if not os.path.exists(tg.GPU32):
        tg.skip("EP 2 fp32 vs cpu", f"{tg.GPU32} not built")
        return
    flags = ["--moe-experts", str(E), "--moe-top-k", "2", "--steps", "2", "--expert-parallel", "2"]
    out_g, g = R.run(tg.GPU32, models[2], flags, ranks=4)
    out_c, c = R.run(tg.CPU, models[2], flags, ranks=4)
    gm.compare_moe("EP 2 x DP 2 (fp32 build) vs the CPU's", g, c, R.models[2], out_g, out_c, tg.FP32_TOL, 1e-3, True)
    gm.check_norms("EP 2 x DP 2 (fp32 build) vs the CPU's", out_g, out_c, 1e-3, 1e-3)
    tg_, tc = traffic(out_g), traffic(out_c)
    report(tg_ is not None and tg_ == tc, f"traffic: the GPU's all-to-alls sent the CPU's bytes and calls for the same run "
           f"({tg_[0] if tg_ else '?'} bytes over 2 steps, {tg_[1] if tg_ else '?'} calls a rank)", f"GPU {tg_}, CPU {tc}")


def check_bf16_and_resume(R, models):
    # (a constant learning rate: the cosine's last step has lr 0, which would leave the resumed step's weights unchecked)
    flags = ["--moe-experts", str(E), "--moe-top-k", "2", "--moe-capacity-factor", "1.25", "--steps", "3", "--lr-schedule", "constant"]
    out1, one = R.run(tg.GPU, models[2], flags + ["--total-batch-tokens", str(2 * gm.B * gm.T)])
    a = f"{R.tmp}/ep_straight"
    out2, two = R.run(tg.GPU, models[2], flags + ["--expert-parallel", "2", "--checkpoint-every", "1"], ranks=2, out_dir=a)
    s1, s2 = gm.step_lines(out1), gm.step_lines(out2)
    report(len(s1) == 3 and s1[0][1:] == s2[0][1:], f"bf16 vs 1 rank: step 1's routing identical at EP 2 and on 1 rank "
           f"({int(s2[0][3])} dropped, loads {int(s2[0][4])}..{int(s2[0][5])})" if s2 else "bf16 vs 1 rank: step lines",
           f"1 rank {s1}\nEP 2 {s2}")
    gm.compare_moe("bf16 vs 1 rank: EP 2 vs 1 GPU x 2 micro-batches", two, one, R.models[2], out2, out1, tg.BF16_TOL, 2e-2, False)
    gm.check_norms("bf16 vs 1 rank: EP 2 vs 1 GPU x 2 micro-batches", out2, out1, 2e-3, 5e-2)
    # resume at the same degree: bit for bit
    outr, resumed = R.run(tg.GPU, models[2], flags + ["--expert-parallel", "2", "--resume", f"{a}/ckpt_00000002"], ranks=2,
                          out_dir=f"{R.tmp}/ep_resumed")
    report("resumed from" in outr and np.array_equal(two["losses"][2:], resumed["losses"]) and
           np.array_equal(two["params"], resumed["params"]) and gm.step_lines(outr) == s2[2:],
           "resume: EP 2, 2 steps + checkpoint + 1 == 3 bit for bit (loss, routing line, the weights with the whole MoE table)",
           f"losses {two['losses']} vs {resumed['losses']}\n{outr[-800:]}")
    # the same checkpoint resumed at EP 1 (data parallel on the same 2 GPUs): one file layout at any degree
    outd, dp = R.run(tg.GPU, models[2], flags + ["--resume", f"{a}/ckpt_00000002"], ranks=2, out_dir=f"{R.tmp}/ep_to_dp")
    init = R.models[2][0]
    dl = float(np.max(np.abs(dp["losses"] - two["losses"][2:]))) if dp["losses"].size == 1 else 1e9
    e = tg.rel(dp["params"] - init, two["params"] - init)
    report("resumed from" in outd and dl <= tg.BF16_TOL["losses"] and e <= tg.BF16_TOL["update"],
           f"resume: the EP 2 checkpoint resumed at EP 1 on 2 GPUs == the EP 2 run (losses max diff {dl:.1e}, weights' change "
           f"rel {e:.1e})", f"losses {dp['losses']} vs {two['losses']}\n{outd[-800:]}")
    return out2


def check_estimate(R, models, out):
    """Rank 0's table, printed by the EP 2 run it allocated from, == --estimate --estimate-ranks 2's, byte for byte
    (the ep_* rows among them); the run's all-to-all bytes a step and rank between --estimate's counts and its bound."""
    p = tg.run([tg.GPU, "--model", models[2], "--batch-size", str(gm.B), "--seq-len", str(gm.T), "--moe-experts", str(E),
                "--moe-top-k", "2", "--moe-capacity-factor", "1.25", "--expert-parallel", "2", "--estimate", "--estimate-ranks",
                "2"] + tg.DEFAULT_ATTENTION)
    est, _ = gm.parse_estimate(p.stdout)
    trainer = {m.group(1): int(m.group(2)) for m in re.finditer(r"^  (\S+)\s+\S+\s.*?\s(\d+)  \S+ \S+$", out, re.M)}
    diff = [f"{n}: estimated {est[n][1]}, trainer {trainer.get(n)}" for n in est if est[n][1] != trainer.get(n)]
    ep = [n for n in est if n.startswith("ep_")]
    report(not diff and len(ep) == 3 and all(est[n][1] > 0 for n in ep),
           f"estimate: --estimate's rows for EP 2 = the table rank 0 allocated from, byte for byte ({', '.join(ep)})",
           "; ".join(diff) + f"\n{p.stdout[:1500]}")
    m = re.search(r"counts (\d+) bytes \+ rows at most (\d+) bytes", p.stdout)
    sent = re.search(r"^expert parallel: the all-to-alls sent (\d+) bytes from all ranks over 3 steps", out, re.M)
    per = int(sent.group(1)) / 3 / 2 if sent else -1
    report(m and sent and int(m.group(1)) <= per <= int(m.group(1)) + int(m.group(2)),
           f"estimate: the all-to-alls sent {per:.0f} bytes a step and rank (bf16), within --estimate's counts and bound",
           f"{m.group(0) if m else p.stdout[-800:]}; sent {sent.group(0) if sent else out[-800:]}")


def check_starved(R, tmp):
    if not os.path.exists(tg.GPU32):
        tg.skip("EP 2 starved", f"{tg.GPU32} not built")
        return
    path = f"{tmp}/starved.bin"
    model = write_starved_model(path)
    flags = ["--moe-experts", str(E), "--moe-top-k", "1", "--moe-capacity-factor", "none", "--steps", "2"]
    out_g, g = R.run(tg.GPU32, path, flags + ["--expert-parallel", "2"], ranks=2)
    out_c, c = R.run(tg.CPU, path, flags + ["--total-batch-tokens", str(2 * gm.B * gm.T)])
    gm.compare_moe("starved: EP 2 (fp32 build), rank 1 receiving no row, vs the CPU's 1 rank", g, c, model, out_g, out_c,
                   tg.FP32_TOL, 1e-3, True)
    P = model[2][-1]
    moe = g["grads"][P:]
    idle = [float(np.max(np.abs(moe[s]))) for e in (2, 3) for s in expert_slices(e)]
    routers = moe[:L * E * C].reshape(L, E, C)[:, 2:]
    lines = gm.step_lines(out_g)
    report(lines and max(idle) == 0.0 and np.any(routers) and all(x[4] == 0 for x in lines),
           "starved: experts 2 and 3 (rank 1's) got no row at any step: their gradient exactly 0, their routers' not",
           f"largest |gradient| of experts 2, 3: {max(idle) if idle else None}; loads {[x[4:] for x in lines]}")


def check_refused(R, models):
    flags = ["--model", models[2], "--batch-size", str(gm.B), "--seq-len", str(gm.T), "--moe-experts", str(E), "--moe-top-k", "2",
             "--expert-parallel", "2"] + R.data + tg.DEFAULT_ATTENTION
    mpi = ["timeout", "120", shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "--bind-to", "none"]
    for what, np_, extra, env, needles in [
            ("ranks sharing one GPU", 2, [], {"CUDA_EMU_DEVICES": "1"}, ["sharing a GPU", "own GPU"]),
            ("--zero 1", 2, ["--zero", "1"], {"CUDA_EMU_DEVICES": "2"}, ["--expert-parallel 2 with --zero 1", "use --zero 0"]),
            ("3 ranks", 3, [], {"CUDA_EMU_DEVICES": "3"}, ["--expert-parallel 2 on 3 GPUs", "divisor"])]:
        p = subprocess.run(mpi + ["-np", str(np_), tg.GPU] + flags + extra, capture_output=True, text=True, cwd=tg.ROOT,
                           env=dict(os.environ, **env))
        report(p.returncode == 2 and p.stderr.count("error:") == 1 and all(n in p.stderr for n in needles),
               f"refused: --expert-parallel 2 on the GPU with {what}: one line, exit 2", f"exit {p.returncode}: {p.stderr[-600:]}")


def main():
    if tg.MODE is None:
        tg.skip("GPU expert parallelism", tg.GPU)
        return exit_code()
    if not tg.EMULATED and not shutil.which("mpirun"):
        tg.skip("GPU expert parallelism", "no mpirun")
        return exit_code()
    print(f"running the GPU expert-parallel checks on {'the CPU emulation of CUDA: ' + tg.GPU if tg.EMULATED else 'the GPU'}",
          flush=True)
    tmp = tempfile.mkdtemp(prefix="llmc_gpu_ep_")
    try:
        R = gm.Runs(tmp)
        write_shard(f"{tmp}/train.bin", np.tile(np.random.default_rng(0).integers(0, gm.V, 97), 60))
        models, R.models = {2: f"{tmp}/moe_top2.bin"}, {}
        R.models[2] = gm.write_moe_model(models[2], 2)
        tg.check("fp32 vs cpu", check_fp32_vs_cpu, R, models)
        out = tg.check("bf16 and resume", check_bf16_and_resume, R, models)
        if out:
            tg.check("estimate", check_estimate, R, models, out)
        tg.check("starved", check_starved, R, tmp)
        if tg.EMULATED:
            tg.check("refused", check_refused, R, models)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
