#!/usr/bin/env python3
"""test_gpu_moe_trainer.py — mixture of experts in the GPU trainer, one GPU (llmc/model/moe_gpu.cuh;
issue 24; docs/moe.md). The kernels themselves are test_gpu_moe.py's; this tests the wiring: the MoE
table in the GPU's buffers, the passes, the auxiliary losses in the optimised loss and the step line,
the checkpoint, --estimate. Runs the emulated trainer (build/emu/train_gpt, train_gpt_fp32) or, on a
machine with a GPU, the native ones, with test_gpu.py's helpers. Tiny model: L=2 C=64 H=4 T=32,
B=2 (N = 64 tokens a micro-batch), V=500; both trainers start from one bf16-exact version-7 file.

  dense        --moe-experts 1 (top-1, no dropping, z-loss 0) IS the GPU's dense model, bit for bit over
               3 steps: losses, step 1's logits and dense gradient, the final weights; the router's
               gradient exactly 0 (softmax of one logit is 1: the gate multiplies by 1 and d logits =
               1 (dp - 1 dp) = 0; the dense run at the GPU's default --recompute 1 runs GELU outside the
               matmul's epilogue, as the experts do)
  fp32 vs cpu  the fp32 build (the same kernels in fp32) against train_gpt_cpu, E = 4, over 3 steps,
               top-2 with capacity factor 1.25 and top-1 with 1.0 (both drop): step 1's logits, loss and
               every dense gradient tensor at test_gpu.py's FP32_TOL; the MoE table's gradient (its
               router's and its experts' parts apart) within 1e-3 relative; the losses within 1e-3;
               the weight change within 1e-2; the aux and z losses of every step within 1e-4 relative
               (the GPU sums them in fp32, the CPU in double); the dropped assignments and the least and
               most loaded experts of every step identical (fp32 on both sides from equal weights: the
               routing is the same unless a near-tie falls within a rounding, which these runs do not have)
  bf16 vs cpu  the bf16 build, top-2 capacity 1.25: each step's loss within test_gpu.py's 0.05; step 1's
               aux and z losses within 1% (the router's inputs are bf16 on the GPU, fp32 on the CPU) and
               its dropped count within 2 of the CPU's (a near-tie decided the other way by bf16 moves
               one assignment; later steps drift further, as bf16 weights do)
  resume       5 steps straight == 3, checkpoint (model.bin version 7 + moe_state.bin), resume, 2 more:
               the losses, the weights (the MoE table's among them) and the step-5 checkpoint's files
               byte for byte; and the CPU trainer resumes the GPU's MoE checkpoint
  estimate     --estimate's rows for the run's shape = the table the trainer printed and allocated
               from, the moe_* rows among them, byte for byte
  recompute    --recompute 1 and 2 == --recompute 0 bit for bit over 3 bf16 steps (top-2, tokens dropped):
               step 1's gradient, every loss, aux and z loss, drop count and load
  data parallel  2 GPU ranks (emulated NCCL) == 1 rank x 2 micro-batches and == the CPU trainer's 2 ranks
               (fp32 build at FP32_TOL, bf16 at the step lines' tolerances), every step's norm; a resume
               on 2 ranks bit for bit (check_data_parallel's docstring has the tolerances)
  zero         --zero 1 and --grad-compression bf16 on 2 GPU ranks, --zero 2 on 3 (the MoE table's moments
               sharded: llmc/parallel/moe_zero.cuh) == --zero 0 on as many, bit for bit; the ZeRO-1 checkpoint's moe_state.bin
               = ZeRO-0's, its resume bit-exact; its memory = --estimate --estimate-ranks 2 --zero 1 (check_zero)
  refused      one line and exit 2 each: --cuda-graphs, --precision fp8, a version-7 file without its
               --moe-* flags, --expert-parallel 2 on one GPU (expert parallelism on 2: test_gpu_expert_parallel.py),
               --zero 3, --grad-compression powersgd (--generate with an MoE model runs: test_generate.py)
Planted by hand and caught (docs/moe.md): the auxiliary losses left out of the optimised loss
(aux_scale 0: "fp32 vs cpu" failed, the router's gradient off by 0.59 and 0.91 relative); the gates'
gradient dropped (moe_backward_rows_kernel's dgate 0: off by 0.68 and 0.47); the MoE table's moments
not read on resume ("resume" failed); the ln2 rebuild skipped at MoE blocks ("recompute 2" failed).
"bf16 vs cpu" lets the first two through: bf16's tolerances.
Planted for data parallel and caught: the MoE table's gradient not summed over the ranks; its
squares added to the norm on every rank; the aux losses averaged over micro-batches but not ranks;
only rank 0 reading moe_state.bin on resume.
Planted for ZeRO-1/2 and caught (docs/moe.md): every rank updating rank 0's shard; the all-gather of the
updated weights skipped; a resume keeping the moments from the table's start, not its shard; the
checkpoint's moments not gathered; every rank counting the whole table's squares; the shards in granules
of 1 (rank 2 of 3's shard misaligned: NaN norms).
About 40 s on the shared 2-core machine (13 trainer runs; emulated, ~1 s a step of this shape), and
about 35 s more for the data-parallel check (5 runs, 4 of them 2 ranks), and for check_zero about 15 s
quiet, 81 s under a load of 15 (5 runs: 3 of 2 ranks, 2 of 3, and an --estimate).
"""
import os, re, shutil, subprocess, sys, tempfile
import numpy as np
from checks import report, exit_code
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import test_gpu as tg  # noqa: E402
from safetensors_io import read_safetensors  # noqa: E402
from token_shards import write_shard  # noqa: E402
from test_estimate import parse_estimate  # noqa: E402

L, C, H, T, V, B = 2, 64, 4, 32, 500, 2
VP = (V + 127) // 128 * 128
E = 4


def moe_table_size(experts, every=1):
    Lm = L // every
    return Lm * (experts * C + (experts - 1) * (8 * C * C + 5 * C))


def write_moe_model(path, top_k, seed=7):
    """A version-7 file (llmc/io/formats.h): test_gpu.py's bf16-exact dense table, then the MoE table
    (routers, experts 1..E-1), std 0.02 like the dense matrices; the routers at 0.3 so the routing is
    far from uniform (loads differ, capacity binds)."""
    dense, names, off = tg.write_model(path + ".dense", L, C, H, T, V, seed)
    rng = np.random.default_rng(seed + 1)
    table = 0.02 * rng.standard_normal(moe_table_size(E)).astype(np.float32)
    table[:L * E * C] *= 15.0  # the routers (the table's first tensor)
    table = tg.to_bf16_exact(table)
    header = np.zeros(256, np.int32)
    header[:11] = [20240326, 7, T, V, L, H, C, VP, E, top_k, 1]
    with open(path, "wb") as f:
        f.write(header.tobytes())
        f.write(dense.tobytes())
        f.write(table.tobytes())
    os.remove(path + ".dense")
    return np.concatenate([dense, table]), names, off


def step_lines(out):
    """[(loss, aux, z, dropped, min load, max load)] from the step lines."""
    return [tuple(float(x) for x in m) for m in re.findall(
        r"^step +\d+/\d+ \| loss ([\d.]+) .*\| aux ([\d.]+) \| z ([\d.]+) \| dropped (\d+) \| load (\d+)\.\.(\d+)$", out, re.M)]


def step_norms(out):
    """Each step's gradient norm, from the step lines."""
    return [float(x) for x in re.findall(r"^step +\d+/\d+ \| loss [\d.]+ \| lr \S+ \| norm ([\d.]+)", out, re.M)]


def check_norms(tag, out, ref, first_tol, later_tol):
    """Step 1's norm within first_tol relative (the same routing), the later steps' within later_tol (in
    bf16 a near-tie routed the other way moves a norm by about 1%)."""
    a, b = step_norms(out), step_norms(ref)
    e = [abs(x - y) / y for x, y in zip(a, b)] if a and len(a) == len(b) else [1e9]
    report(e[0] <= first_tol and max(e) <= later_tol, f"{tag}: every step's gradient norm, the MoE table's counted once (step 1 "
           f"rel {e[0]:.1e}, at most {max(e):.1e})", f"{a} vs {b} (tolerances {first_tol}, {later_tol})")


class Runs:
    def __init__(self, tmp):
        self.tmp = tmp
        self.data = ["--train-data", f"{tmp}/train.bin", "--val-data", "none", "--sample-every", "0"]
        self.n = 0

    def run(self, exe, model, flags, expect_ok=True, out_dir=None, ranks=0):
        """Runs a trainer with --dump-state (under mpirun with `ranks` ranks, the emulated GPUs one a rank:
        NCCL's path, not host staging); returns (stdout, the dump or None)."""
        self.n += 1
        dump = f"{self.tmp}/d{self.n}.st"
        mpi = ["timeout", "300", shutil.which("mpirun") or "mpirun", "--allow-run-as-root", "--oversubscribe", "--bind-to", "none",
               "-np", str(ranks)] if ranks else []
        cmd = mpi + [exe, "--model", model, "--dump-state", dump, "--out-dir", out_dir or f"{self.tmp}/out{self.n}",
               "--batch-size", str(B), "--seq-len", str(T), "--lr", "1e-3", "--warmup-steps", "1"] + self.data + flags
        if exe == tg.CPU:
            cmd += ["--threads", "1"]
        else:
            cmd += tg.DEFAULT_ATTENTION
        p = tg.run(cmd, expect_ok=expect_ok, env={"CUDA_EMU_DEVICES": str(ranks)} if ranks and tg.EMULATED else None)
        return p.stdout, (read_safetensors(dump)[0] if os.path.exists(dump) else None)


def check_dense(R):
    """E = 1 against the dense GPU run, from the same seeded weights (a descriptor: both initialise the
    dense table the same way; the E = 1 run adds a router)."""
    model = f"L={L},C={C},H={H},T={T},V={V}"
    _, dense = R.run(tg.GPU, model, ["--steps", "3"])
    out, moe1 = R.run(tg.GPU, model, ["--steps", "3", "--moe-experts", "1", "--moe-z-loss", "0"])
    P = dense["grads"].size
    router = moe1["grads"][P:]
    same = {k: np.array_equal(dense[k], moe1[k][:P] if k in ("grads", "params") else moe1[k])
            for k in ("logits", "loss", "losses", "grads", "params")}
    report(all(same.values()) and router.size == L * C and not np.any(router) and moe1["params"].size == P + L * C
           and len(step_lines(out)) == 3,
           "dense: --moe-experts 1 is the GPU's dense model bit for bit over 3 steps (logits, losses, gradient, weights); "
           "the router's gradient exactly 0",
           f"differ: {[k for k, v in same.items() if not v]}; router gradient norm {np.linalg.norm(router):.3g}; "
           f"losses {dense['losses']} vs {moe1['losses']}")


def compare_moe(tag, got, ref, model, out_gpu, out_cpu, tol, table_tol, strict_routing):
    init, names, off = model
    P = off[-1]
    dense_model = (init[:P], names, off)
    tg.compare_dumps(tag, {k: (v[:P] if k in ("grads", "params") else v) for k, v in got.items()},
                     {k: (v[:P] if k in ("grads", "params") else v) for k, v in ref.items()}, dense_model, tol)
    router = slice(0, L * E * C)
    experts = slice(L * E * C, None)
    g, r = got["grads"][P:], ref["grads"][P:]
    errs = {"router": tg.rel(g[router], r[router]), "experts 1..3": tg.rel(g[experts], r[experts])}
    report(all(e <= table_tol for e in errs.values()), f"{tag}: the MoE table's gradient",
           f"relative L2 errors {errs} > {table_tol}", ", ".join(f"{k} rel {e:.2e}" for k, e in errs.items()))
    e = tg.rel(got["params"][P:] - init[P:], ref["params"][P:] - init[P:])
    report(e <= tol["update"], f"{tag}: the MoE table after {len(ref['losses'])} steps",
           f"relative L2 error of its change {e:.2e} > {tol['update']}", f"{e:.2e}")
    sg, sc = step_lines(out_gpu), step_lines(out_cpu)
    if len(sg) != len(sc) or not sg:
        report(False, f"{tag}: the step lines' MoE numbers", f"{len(sg)} GPU step lines, {len(sc)} CPU ones")
        return
    if strict_routing:
        aux = max(abs(a[i] - b[i]) / b[i] for a, b in zip(sg, sc) for i in (1, 2))
        routing = all(a[3:] == b[3:] for a, b in zip(sg, sc))
        report(aux <= 1e-4 and routing, f"{tag}: every step's aux and z losses (rel {aux:.1e}), dropped and loads identical "
               f"({', '.join(f'{int(a[3])} dropped, {int(a[4])}..{int(a[5])}' for a in sg)})",
               f"GPU {sg}\nCPU {sc}")
    else:
        aux = max(abs(sg[0][i] - sc[0][i]) / sc[0][i] for i in (1, 2))
        dd = abs(sg[0][3] - sc[0][3])
        report(aux <= 0.01 and dd <= 2, f"{tag}: step 1's aux and z losses (rel {aux:.1e}) and dropped count "
               f"({int(sg[0][3])} vs {int(sc[0][3])})", f"GPU {sg}\nCPU {sc}")


def check_vs_cpu(R, models):
    """fp32 build vs the CPU, top-2 capacity 1.25 and top-1 capacity 1.0; the bf16 run's first 3 steps
    (the resume check's straight run) vs the CPU's."""
    flags2 = ["--moe-experts", str(E), "--moe-top-k", "2", "--moe-capacity-factor", "1.25"]
    flags1 = ["--moe-experts", str(E), "--moe-top-k", "1", "--moe-capacity-factor", "1.0"]
    cpu2 = R.run(tg.CPU, models[2], flags2 + ["--steps", "3"])
    if os.path.exists(tg.GPU32):
        g = R.run(tg.GPU32, models[2], flags2 + ["--steps", "3"])
        compare_moe("fp32 vs cpu (E=4 top-2, capacity 1.25)", g[1], cpu2[1], R.models[2], g[0], cpu2[0], tg.FP32_TOL, 1e-3, True)
        cpu1 = R.run(tg.CPU, models[1], flags1 + ["--steps", "3"])
        g = R.run(tg.GPU32, models[1], flags1 + ["--steps", "3"])
        compare_moe("fp32 vs cpu (E=4 top-1, capacity 1.0)", g[1], cpu1[1], R.models[1], g[0], cpu1[0], tg.FP32_TOL, 1e-3, True)
    else:
        tg.skip("fp32 vs cpu (MoE)", f"{tg.GPU32} not built")
    return cpu2


def check_recompute(R, models, out0, ref):
    """--recompute 1 and 2 == --recompute 0 bit for bit (bf16, E = 4 top-2, capacity 1.25: tokens dropped), over
    the first 3 of the resume check's straight steps: step 1's gradient (the MoE table's among them: the router
    and the experts read ln2, which level 2 rebuilds before the MoE backward), every step's loss, and the step
    lines' aux and z losses, drops and loads (the MoE blocks are not run again, so the auxiliary losses are
    counted once, as at level 0)."""
    flags = ["--moe-experts", str(E), "--moe-top-k", "2", "--moe-capacity-factor", "1.25", "--steps", "3"]
    for level in ("1", "2"):
        out, got = R.run(tg.GPU, models[2], flags + ["--recompute", level])
        if got is None:
            report(False, f"recompute {level}: MoE with --recompute {level} on the GPU trainer runs", out[-1500:])
            continue
        same = {"step-1 gradient": np.array_equal(got["grads"], ref["grads"]),
                "losses": np.array_equal(got["losses"], ref["losses"][:3]),
                "step lines": step_lines(out) == step_lines(out0)[:3] and len(step_lines(out)) == 3}
        report(all(same.values()), f"recompute {level}: E = 4 top-2 with drops, --recompute {level} == --recompute 0 bit for "
               "bit over 3 steps (step 1's gradient with the MoE table's, losses, aux and z losses, drops, loads)",
               f"differ: {[k for k, v in same.items() if not v]}\n{step_lines(out)}\n{step_lines(out0)[:3]}")


def check_bf16_and_resume(R, models, cpu2):
    flags = ["--moe-experts", str(E), "--moe-top-k", "2", "--moe-capacity-factor", "1.25", "--checkpoint-every", "3",
             "--recompute", "0"]  # (the reference of check_recompute)
    a, b = f"{R.tmp}/straight", f"{R.tmp}/resumed"
    out, straight = R.run(tg.GPU, models[2], flags + ["--steps", "5"], out_dir=a)
    check_recompute(R, models, out, straight)
    # bf16 vs the CPU, over the first 3 steps (the CPU's run is 3 steps long)
    lines, cpu_lines = step_lines(out), step_lines(cpu2[0])
    dl = max(abs(x[0] - y[0]) for x, y in zip(lines, cpu_lines))
    report(len(lines) == 5 and dl <= tg.BF16_TOL["losses"], f"bf16 vs cpu (E=4 top-2, capacity 1.25): each step's loss "
           f"(max diff {dl:.2e})", f"GPU {lines}\nCPU {cpu_lines}")
    aux = max(abs(lines[0][i] - cpu_lines[0][i]) / cpu_lines[0][i] for i in (1, 2))
    dd = abs(lines[0][3] - cpu_lines[0][3])
    report(aux <= 0.01 and dd <= 2, f"bf16 vs cpu: step 1's aux and z losses (rel {aux:.1e}) and dropped count "
           f"({int(lines[0][3])} vs {int(cpu_lines[0][3])})", f"GPU {lines}\nCPU {cpu_lines}")
    # resume from step 3 into another directory: 2 more steps
    out2, resumed = R.run(tg.GPU, models[2], flags + ["--steps", "5", "--resume", f"{a}/ckpt_00000003"], out_dir=b)
    header = np.fromfile(f"{a}/ckpt_00000003/model.bin", dtype=np.int32, count=11)
    files = ["model.bin", "moe_state.bin", "state.bin"]
    same_files = {f: tg.same_bytes(f"{a}/ckpt_00000005/{f}", f"{b}/ckpt_00000005/{f}") for f in files}
    dropped = sum(int(x[3]) for x in lines)
    report(np.array_equal(straight["losses"][3:], resumed["losses"]) and np.array_equal(straight["params"], resumed["params"])
           and all(same_files.values()) and list(header[[1, 8, 9, 10]]) == [7, E, 2, 1] and dropped > 0,
           f"resume: 3 + 2 steps == 5 bit for bit (losses, weights with the MoE table, the step-5 checkpoint's "
           f"{', '.join(files)}; {dropped} assignments dropped); model.bin is version 7",
           f"losses {straight['losses']} vs {resumed['losses']}; files differ: {[f for f, s in same_files.items() if not s]}; "
           f"header {header}")
    p = tg.run([tg.CPU, "--model", models[2], "--resume", f"{b}/ckpt_00000005", "--out-dir", b, "--steps", "6",
                "--batch-size", str(B), "--seq-len", str(T), "--threads", "1", "--moe-experts", str(E), "--moe-top-k", "2",
                "--moe-capacity-factor", "1.25"] + R.data, expect_ok=False)
    report(p.returncode == 0 and len(step_lines(p.stdout)) == 1, "the CPU trainer resumes the GPU's MoE checkpoint",
           p.stdout[-600:] + p.stderr[-600:])
    return out


def estimate_rows(R, models, flags, out):
    """(--estimate's rows for the run's flags, rows that differ from the table the trainer printed (rank 0's)
    and allocated from, whether the table's total is the estimate's)."""
    p = tg.run([tg.GPU, "--model", models[2], "--batch-size", str(B), "--seq-len", str(T), "--estimate"] + flags + tg.DEFAULT_ATTENTION)
    est, _ = parse_estimate(p.stdout)
    trainer = {m.group(1): int(m.group(2)) for m in re.finditer(r"^  (\S+)\s+\S+\s.*?\s(\d+)  \S+ \S+$", out, re.M)}
    diff = [f"{n}: estimated {est[n][1]}, trainer {trainer.get(n)}" for n in est if est[n][1] != trainer.get(n)]
    table = re.search(r"^GPU memory bytes: table (\d+)", out, re.M)
    total = re.search(r"^  total\s+(\d+)", p.stdout, re.M)
    return est, diff, bool(table and total and table.group(1) == total.group(1)), p.stdout


def check_estimate(R, models, out):
    """The trainer printed the table it allocated from; --estimate prints the same rows for the shape."""
    est, diff, same_total, text = estimate_rows(R, models, ["--moe-experts", str(E), "--moe-top-k", "2", "--moe-capacity-factor",
                                                           "1.25", "--recompute", "0"], out)
    moe = [n for n in est if n.startswith("moe_")]
    report(not diff and len(moe) == 7 and all(est[n][1] > 0 for n in moe) and same_total,
           f"estimate: --estimate's rows = the table the trainer allocated from, byte for byte ({', '.join(moe)})",
           "; ".join(diff) + f"\n{text[:1500]}")


def check_data_parallel(R, models):
    """--moe-experts on 2 GPU ranks (B = 2 each, --zero 0), E = 4 top-2 capacity 1.25 (drops), 3 AdamW steps:
      == 1 GPU rank accumulating 2 micro-batches of B = 2 (the same tokens). Step 1's forward is the same
         arithmetic on the same micro-batches, so its logits, loss and routing (aux and z losses, drops,
         loads: summed over the ranks as over the micro-batches) are identical; the gradients differ by
         where bf16 rounds the sum (accumulated in the table vs summed by NCCL): the dense dump at
         test_gpu.py's BF16_TOL, the MoE table's gradient within 2% relative (measured: 0.3%)
      == the CPU trainer's 2 ranks: the fp32 build (the same kernels in fp32) at FP32_TOL with every
         step's routing identical, as "fp32 vs cpu" above on one rank; the bf16 build as "bf16 vs cpu":
         each step's loss within 0.05, step 1's aux and z losses within 1%, drops within 2 (bf16 router
         inputs decide a near-tie the other way: its logits then differ beyond BF16_TOL, 5.6e-2 measured)."""
    if not shutil.which("mpirun"):
        tg.skip("MoE data parallel", "no mpirun")
        return
    flags = ["--moe-experts", str(E), "--moe-top-k", "2", "--moe-capacity-factor", "1.25", "--steps", "3"]
    out1, one = R.run(tg.GPU, models[2], flags + ["--total-batch-tokens", str(2 * B * T)])
    a, b = f"{R.tmp}/dp_straight", f"{R.tmp}/dp_resumed"
    out2, two = R.run(tg.GPU, models[2], flags + ["--checkpoint-every", "1"], ranks=2, out_dir=a)
    outr, resumed = R.run(tg.GPU, models[2], flags + ["--resume", f"{a}/ckpt_00000001"], ranks=2, out_dir=b)
    report("resumed from" in outr and np.array_equal(two["losses"][1:], resumed["losses"]) and
           np.array_equal(two["params"], resumed["params"]) and step_lines(outr) == step_lines(out2)[1:],
           "MoE data parallel: resume on 2 GPU ranks, 1 + 2 steps == 3 bit for bit (the loss, its routing line, the weights "
           "with the MoE table)", f"losses {two['losses']} vs {resumed['losses']}\n{outr[-800:]}")
    outc, cpu = R.run(tg.CPU, models[2], flags, ranks=2)
    report("2 ranks" in out2 and "1 accumulation step" in out2 and "2 accumulation steps" in out1,
           "MoE data parallel: the 2-rank GPU run has no accumulation, the 1-rank one 2 micro-batches", out2[:600] + out1[:300])
    s1, s2, sc = step_lines(out1), step_lines(out2), step_lines(outc)
    report(len(s1) == 3 and s1[0][1:] == s2[0][1:], f"MoE data parallel: step 1's routing identical on 2 ranks and on 1 "
           f"(aux {s2[0][1]}, z {s2[0][2]}, {int(s2[0][3])} dropped, loads {int(s2[0][4])}..{int(s2[0][5])})",
           f"1 rank {s1}\n2 ranks {s2}")
    compare_moe("MoE 2 GPU ranks vs 1 rank x 2 micro-batches", two, one, R.models[2], out2, out1, tg.BF16_TOL, 2e-2, False)
    check_norms("MoE 2 GPU ranks vs 1 rank x 2 micro-batches", out2, out1, 2e-3, 5e-2)
    dl = max(abs(x[0] - y[0]) for x, y in zip(s2, sc)) if len(s2) == len(sc) == 3 else 1e9
    aux = max(abs(s2[0][i] - sc[0][i]) / sc[0][i] for i in (1, 2)) if sc else 1e9
    dd = abs(s2[0][3] - sc[0][3]) if sc else 1e9
    report(dl <= tg.BF16_TOL["losses"] and aux <= 0.01 and dd <= 2, f"MoE 2 GPU ranks (bf16) vs the CPU's 2 ranks: each step's "
           f"loss (max diff {dl:.1e}), step 1's aux and z losses (rel {aux:.1e}), dropped ({int(s2[0][3])} vs {int(sc[0][3])})",
           f"GPU {s2}\nCPU {sc}")
    check_zero(R, models, flags, out2, two, a)
    if os.path.exists(tg.GPU32):
        out32, g32 = R.run(tg.GPU32, models[2], flags, ranks=2)
        compare_moe("MoE 2 GPU ranks (fp32 build) vs the CPU's 2 ranks", g32, cpu, R.models[2], out32, outc, tg.FP32_TOL, 1e-3, True)
        check_norms("MoE 2 GPU ranks (fp32 build) vs the CPU's 2 ranks", out32, outc, 1e-3, 1e-3)
    else:
        tg.skip("MoE 2 GPU ranks (fp32 build) vs the CPU's", f"{tg.GPU32} not built")


def traffic(out):
    """The data group's bytes per step, as the trainer counted them (rank 0's counters)."""
    m = re.search(r"^data-parallel traffic from rank 0 \(its counters\): (.*)$", out, re.M)
    return m.group(1) if m else None


def check_zero(R, models, flags, out0, zero0, dir0):
    """--zero 1 on 2 GPU ranks and --zero 2 on 3 (uneven shards) with MoE (llmc/parallel/moe_zero.cuh: the MoE
    table's m and v sharded, its gradient reduce-scattered, each rank updating its shard, the updated table
    all-gathered) == --zero 0 on as many ranks, bit for bit over 3 steps: the same sums (the reduce-scatter is
    ZeRO-0's all-reduce's first half), the same per-element AdamW (stochastic rounding seeded by the element's
    index), the same norm (each rank counts its shard of the table at every stage). So step 1's logits, loss
    and summed gradient (the MoE table's all-gathered for the dump), every loss, norm and routing line, the
    final weights; for ZeRO-1 also the bytes step 3 sent (the same collectives' bytes; step 1's add the
    dump's all-gather, and ZeRO-2's the dense buckets' padding) and the checkpoints' moe_state.bin (the
    shards gathered, rank 0 writing) byte for byte ZeRO-0's. --grad-compression bf16 (ZeRO-0, 2 ranks) ==
    the uncompressed run bit for bit, the bytes sent too: the GPU's sums of both tables are bf16 already
    (llmc/parallel/grad_compression.cuh), which is all the CPU's bf16 compression buys. Then: a ZeRO-1
    resume from step 1 == the straight run; --estimate --estimate-ranks 2 --zero 1 = the table the trainer
    allocated, its moe_adam_m/v rows half the table's."""
    a, b = f"{R.tmp}/z1_straight", f"{R.tmp}/z1_resumed"
    for stage in ("1", "bf16", "2"):
        what = "--grad-compression bf16" if stage == "bf16" else f"--zero {stage}"
        ranks = 3 if stage == "2" else 2
        if stage == "2":  # 3 ranks: the shards uneven (199,040 values in 64-value granules: rank 2 owns 66,304 of 66,368)
            out0, zero0 = R.run(tg.GPU, models[2], flags, ranks=3)
        out, got = R.run(tg.GPU, models[2], flags + what.split() + (["--checkpoint-every", "1"] if stage == "1" else []),
                         ranks=ranks, out_dir=a if stage == "1" else None)
        if got is None or zero0 is None:
            report(False, f"MoE data parallel, {what}: runs on {ranks} GPU ranks", out[-1500:] + out0[-1500:])
            continue
        differ = [k for k in zero0 if not np.array_equal(zero0[k], got[k])]
        if step_lines(out) != step_lines(out0) or step_norms(out) != step_norms(out0):
            differ.append("step lines")
        last = [x and x.split(", ")[-1] for x in (traffic(out), traffic(out0))]  # (step 1's has the dump's all-gather too)
        if stage == "1" and (last[0] is None or last[0] != last[1]) or stage == "bf16" and traffic(out) != traffic(out0):
            differ.append(f"traffic {traffic(out)} vs {traffic(out0)}")
        if stage == "1":
            differ += [f"ckpt {s} moe_state.bin" for s in (1, 3) if not tg.same_bytes(f"{a}/ckpt_0000000{s}/moe_state.bin",
                                                                                      f"{dir0}/ckpt_0000000{s}/moe_state.bin")]
        report(not differ, f"MoE data parallel: {what} == {'--grad-compression none' if stage == 'bf16' else '--zero 0'} on {ranks} GPU ranks bit for bit over 3 steps (logits, "
               f"summed gradient, losses, norms, routing, weights" + (f"; step 3's bytes sent ({last[0]}), the checkpoints' "
               "moe_state.bin" if stage == "1" else "; the bytes sent" if stage == "bf16" else "") + ")",
               f"differ: {differ}\n{out[-800:]}")
        if stage == "1":
            z1, out1 = got, out
    outr, resumed = R.run(tg.GPU, models[2], flags + ["--zero", "1", "--resume", f"{a}/ckpt_00000001"], ranks=2, out_dir=b)
    report(resumed is not None and "resumed from" in outr and np.array_equal(z1["losses"][1:], resumed["losses"]) and
           np.array_equal(z1["params"], resumed["params"]) and step_lines(outr) == step_lines(out1)[1:],
           "MoE data parallel: --zero 1 resume on 2 GPU ranks, 1 + 2 steps == 3 bit for bit (losses, routing, weights)",
           f"{outr[-800:]}")
    est, diff, same_total, text = estimate_rows(R, models, flags[:-2] + ["--zero", "1", "--estimate-ranks", "2"], out1)
    n = moe_table_size(E)
    rows = {r: est.get(r, (0, 0))[1] for r in ("moe_params", "moe_adam_m", "moe_adam_v")}
    report(not diff and same_total and rows == {"moe_params": 2 * n, "moe_adam_m": 2 * n, "moe_adam_v": 2 * n},
           f"MoE data parallel: --estimate --estimate-ranks 2 --zero 1 = the table the ZeRO-1 trainer allocated, byte for byte "
           f"(moe_adam_m, moe_adam_v {rows['moe_adam_m']} bytes each: half of the {4 * n} of one rank)",
           "; ".join(diff) + f" {rows}\n{text[:1500]}")


def check_refused(R, models):
    base = ["--model", models[2], "--batch-size", str(B), "--seq-len", str(T)] + R.data + tg.DEFAULT_ATTENTION
    moe = ["--moe-experts", str(E), "--moe-top-k", "2"]
    for what, flags, needles in [
            ("--cuda-graphs", moe + ["--cuda-graphs"], ["--cuda-graphs", "drop"]),
            ("--precision fp8", moe + ["--precision", "fp8"], ["--precision fp8", "drop"]),
            ("a version-7 file without its --moe-* flags", [], ["--moe-experts 4", "a dense model"]),
            ("--expert-parallel 2 on one GPU", moe + ["--expert-parallel", "2"], ["--expert-parallel 2 on 1 GPUs", "multiple of 2"]),
            ("--zero 3", moe + ["--zero", "3"], ["--zero 3", "use --zero 1 or 2"]),
            ("--grad-compression powersgd", moe + ["--grad-compression", "powersgd"], ["--grad-compression powersgd", "bf16 or none"])]:
        p = tg.run([tg.GPU] + base + flags, expect_ok=False)
        lines = p.stderr.strip().splitlines()
        report(p.returncode == 2 and len(lines) == 1 and all(n in lines[0] for n in needles),
               f"refused: --moe-experts on the GPU with {what}: one line, exit 2", f"exit {p.returncode}: {p.stderr[-500:]}")


def main():
    if tg.MODE is None:
        tg.skip("GPU MoE trainer", tg.GPU)
        return exit_code()
    print(f"running the GPU MoE checks on {'the CPU emulation of CUDA: ' + tg.GPU if tg.EMULATED else 'the GPU'}", flush=True)
    tmp = tempfile.mkdtemp(prefix="llmc_gpu_moe_trainer_")
    try:
        R = Runs(tmp)
        write_shard(f"{tmp}/train.bin", np.tile(np.random.default_rng(0).integers(0, V, 97), 60))
        models, R.models = {}, {}
        for k in (1, 2):
            models[k] = f"{tmp}/moe_top{k}.bin"
            R.models[k] = write_moe_model(models[k], k)
        tg.check("dense", check_dense, R)
        cpu2 = tg.check("vs cpu", check_vs_cpu, R, models)
        out = tg.check("bf16 and resume", check_bf16_and_resume, R, models, cpu2) if cpu2 else None
        if out:
            tg.check("estimate", check_estimate, R, models, out)
        tg.check("data parallel", check_data_parallel, R, models)
        tg.check("refused", check_refused, R, models)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
