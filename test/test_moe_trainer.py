#!/usr/bin/env python3
"""test_moe_trainer.py — the mixture-of-experts layer inside the CPU trainer (issue 24; docs/moe.md).

The layer itself is proven against PyTorch in test_moe.py; this tests the wiring: the parameter
table, the step, the loss normalisation, data parallelism, the estimate. Tiny model (L=2 or 4, C=64).

  dense        --moe-experts 1, top-1, no dropping, z-loss 0 (alpha at its default: its gradient is
               exactly 0 with one expert) IS the dense model: losses, step-1 logits and gradient and
               final weights bit for bit over 6 steps of 2 accumulated micro-batches, and the router's
               gradient exactly 0. Expert 0 of a block is the dense block's MLP (llmc/model/model.h).
  learns       E = 4, top-2, capacity 1.25, 10 steps on a periodic stream: the LM loss finite and
               falling by more than 0.3 nats; the aux and z losses and the loads in the step line
               and in metrics.jsonl, the same numbers.
  aux values   step 1's auxiliary losses against the papers' equations at near-uniform routing (the
               router starts at std 0.02, so p ~ 1/E): L_aux = alpha E sum f_i P_i ~ alpha per MoE
               block (Switch), L_z = c_z mean lse^2 ~ c_z (ln E)^2 per block (ST-MoE); and both
               exactly proportional to alpha and c_z (step 1's forward does not depend on them).
  accumulate   the loss normalisation: on a stream of period B*T tokens every micro-batch is the same,
               so 2 accumulated micro-batches must give 1 micro-batch's step (aux_scale = 1/(m dp):
               the step's aux loss is the mean of its micro-batches'), with alpha = 1 and c_z = 0.1 so
               that the auxiliary gradients weigh; to fp32 rounding (test_parallelism's tolerances).
  ranks        2 MPI ranks == 1 rank accumulating the same micro-batches (E = 4, top-2, no dropping:
               with a capacity, each rank's would be of its own tokens), within test_parallelism's
               tolerances; every rank's memory and bytes sent = --estimate's.
  resume       5 steps straight == 3 steps, checkpoint (model.bin version 7 + moe_state.bin), resume,
               2 more: bit for bit (losses and weights, the MoE table's included), with a capacity
               factor (tokens dropped); resuming with other --moe-* flags, or as a dense model, refused
               in one line (exit 2), by the GPU trainer too (build/emu/train_gpt, when built; it trains
               MoE on one GPU: test_gpu_moe_trainer.py); readers that hold dense GPT-2 only refuse the
               file in one line: hf_convert export, --generate
  factored     --optimizer adafactor and sm3: Adafactor's step-1 statistics of every router and expert
               tensor (moe_state.bin version 2) = the paper's R, C, V of the dumped gradient; 3 + resume
               + 2 == 5 bit for bit for both (and in "ranks": dp2 == one rank for both; Adafactor dp3
               --zero 1 == dp3 --zero 0 bit for bit: the table's statistics kept whole on every rank)
  estimate     one rank: every buffer allocated (the MoE table, its gradient, moments and the MoE
               blocks' activations among them) = --estimate's row, to the byte; --estimate's
               parameter counts (total, active per token) = the trainer's.
Planted by hand and caught (see docs/moe.md): aux_scale without the accumulation division
("accumulate" failed); expert 0's initial weights differing from the dense MLP's ("dense" failed);
the resume not reading moe_state.bin ("resume" failed: step 5's loss 6.2287 instead of 6.2292);
Adafactor --zero 1 with AdamW's flat sharing of the MoE table (dp3 --zero 1 off by 2.45e-05).
"""
import json, os, re, shutil, subprocess, sys, tempfile
import numpy as np
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from safetensors_io import read_safetensors  # noqa: E402
from token_shards import write_shard  # noqa: E402
from test_parallelism import Runner, check_close, check_predictions, differences  # noqa: E402
from test_parallelism import TOL_LOSS_REL, TOL_GRAD_REL, TOL_PARAM_ABS  # noqa: E402
from test_estimate import parse_estimate, parse_allocations, compare  # noqa: E402
from test_bad_inputs import one_line_error, gpu_trainer  # noqa: E402
from test_optimizers import check_factored_close  # noqa: E402

BIN = os.path.join(ROOT, "train_gpt_cpu")
MODEL = "L=2,C=64,H=4,T=32,V=501"
L, C, T = 2, 64, 32


def train(tmp, name, *flags, steps=6, data="train.bin"):
    """Runs the trainer; returns (exit code, stdout + stderr, the dump or None, metrics.jsonl's step lines)."""
    dump, metrics = os.path.join(tmp, name + ".st"), os.path.join(tmp, name + ".jsonl")
    cmd = [BIN, "--model", MODEL, "--train-data", os.path.join(tmp, data), "--val-data", "none", "--seq-len", str(T),
           "--batch-size", "2", "--steps", str(steps), "--lr", "1e-3", "--threads", "1", "--out-dir", os.path.join(tmp, "out"),
           "--dump-state", dump, "--metrics", metrics] + [str(f) for f in flags]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    if p.returncode != 0 or not os.path.exists(dump):
        return p.returncode, p.stdout + p.stderr, None, []
    steps_logged = [json.loads(l) for l in open(metrics) if '"type":"step"' in l]
    return p.returncode, p.stdout, read_safetensors(dump)[0], steps_logged


def step_lines(out):
    return re.findall(r"^step +\d+/\d+ \| loss ([\d.]+) .*\| aux ([\d.]+) \| z ([\d.]+) \| dropped (\d+) \| load (\d+)\.\.(\d+)$",
                      out, re.M)


def check_dense(tmp, *extra):
    tag = " ".join(str(f) for f in extra)
    name = "dense" + (" (" + tag + ")" if extra else "")
    code, out, dense, _ = train(tmp, "dense", "--total-batch-tokens", 4 * T, *extra)
    code1, out1, moe1, _ = train(tmp, "moe1", "--total-batch-tokens", 4 * T, "--moe-experts", 1, "--moe-z-loss", 0, *extra)
    if dense is None or moe1 is None:
        report(False, f"{name}: E = 1 runs", (out + out1)[-1500:])
        return
    P = dense["params"].size
    same = [k for k in ("losses", "logits", "loss") if np.array_equal(dense[k], moe1[k])]
    same += [k for k in ("params", "grads") if np.array_equal(dense[k], moe1[k][:P])]
    router_grad = moe1["grads"][P:]
    report(len(same) == 5 and router_grad.size == L * C and not np.any(router_grad),
           f"{name}: --moe-experts 1 top-1, no dropping, z-loss 0 == the dense model bit for bit (6 steps of 2 micro-batches: "
           "losses, step-1 logits and gradient, final weights); the router's gradient exactly 0",
           f"bit-identical: {same}; router gradient max |g| {np.max(np.abs(router_grad)) if router_grad.size else 'absent'}")


def check_stash(tmp):
    """--stash-precision bf16 with MoE: the experts keep their own rows in fp32 (moe_acts); the block's ln2
    goes through the bf16 stash, and the router's gradient reads it. So with E = 1 the forward equals the
    dense model's bit for bit (a stash never changes a forward) but the gradient does not (the dense MLP
    widens a rounded fch, the expert reads its fp32 one); with E = 2 the MoE table's gradient (router and
    expert 1) moves by bf16's rounding against an fp32 stash, not more."""
    flags = ("--total-batch-tokens", 4 * T, "--stash-precision", "bf16")
    _, out, dense, _ = train(tmp, "dense_stash", *flags, steps=1)
    _, out1, moe1, _ = train(tmp, "moe1_stash", *flags, "--moe-experts", 1, "--moe-z-loss", 0, steps=1)
    two = ("--total-batch-tokens", 4 * T, "--moe-experts", 2, "--moe-capacity-factor", "none")
    _, out2, moe2_fp32, _ = train(tmp, "moe2_fp32", *two, steps=1)
    _, out3, moe2_bf16, _ = train(tmp, "moe2_bf16", *two, "--stash-precision", "bf16", steps=1)
    if dense is None or moe1 is None or moe2_fp32 is None or moe2_bf16 is None:
        report(False, "stash: MoE with --stash-precision bf16 runs", (out + out1 + out2 + out3)[-1500:])
        return

    def rel(a, b):
        a, b = a.astype(np.float64), b.astype(np.float64)
        return np.linalg.norm(a - b) / np.linalg.norm(b)
    P = dense["params"].size
    forward_same = all(np.array_equal(dense[k], moe1[k]) for k in ("logits", "loss"))
    dense_rel = rel(moe1["grads"][:P], dense["grads"])
    report(forward_same and 0 < dense_rel < 2.0 ** -7,
           "stash: --moe-experts 1 with --stash-precision bf16: step-1 logits and loss == the dense model's bit for bit; "
           "gradient within bf16's rounding of it (0 < |dg|/|g| < 2^-7: the expert reads fp32 fch, the dense MLP bf16)",
           f"forward bit-identical {forward_same}; |dg|/|g| = {dense_rel:.3g}", f"|dg|/|g| = {dense_rel:.3g}")
    forward_same = all(np.array_equal(moe2_fp32[k], moe2_bf16[k]) for k in ("logits", "loss"))
    table_rel = rel(moe2_bf16["grads"][P:], moe2_fp32["grads"][P:])
    # measured 2.2e-4; a backward that reads the wrong layer's ln2 gave 9.0e-3: 2^-9 sits between them
    report(forward_same and 0 < table_rel < 2.0 ** -9,
           "stash: --moe-experts 2 with a bf16 stash against an fp32 one: the same forward bit for bit; the MoE table's "
           "gradient (router, expert 1) within bf16's rounding (0 < |dg|/|g| < 2^-9)",
           f"forward bit-identical {forward_same}; MoE table |dg|/|g| = {table_rel:.3g}", f"|dg|/|g| = {table_rel:.3g}")


def check_learns(tmp):
    code, out, d, logged = train(tmp, "learns", "--moe-experts", 4, "--moe-top-k", 2, "--moe-capacity-factor", 1.25,
                                 steps=10, data="periodic97.bin")
    lines = step_lines(out)
    if d is None or len(lines) != 10 or len(logged) != 10:
        report(False, "learns: E = 4 top-2 trains and reports", out[-1500:])
        return
    losses = d["losses"].astype(np.float64)
    report(bool(np.all(np.isfinite(losses))) and losses[-1] < losses[0] - 0.3,
           f"learns: E = 4 top-2, capacity 1.25: the LM loss finite and falling ({losses[0]:.3f} -> {losses[-1]:.3f})",
           f"losses {losses}")
    same = all(abs(float(a) - s["loss"]) < 5e-6 and abs(float(aux) - s["moe_aux"]) < 5e-7 and abs(float(z) - s["moe_z"]) < 5e-7
               and int(dr) == s["moe_dropped"] and int(lo) == s["moe_load_min"] and int(hi) == s["moe_load_max"]
               for (a, aux, z, dr, lo, hi), s in zip(lines, logged))
    # loads: k N = 2 x 64 assignments per micro-batch over 4 experts, capacity ceil(2 * 64 * 1.25 / 4) = 40
    loads_ok = all(0 <= int(lo) <= int(hi) <= 40 for (_, _, _, _, lo, hi) in lines)
    report(same and loads_ok, "learns: the step line and metrics.jsonl carry the same LM loss, aux and z losses, drops "
           "and loads (every load within the capacity of 40)", "\n".join(out.splitlines()[-12:]))


def check_aux_values(tmp):
    def first_step(alpha, cz):
        code, out, d, logged = train(tmp, f"aux{alpha}_{cz}", "--moe-experts", 4, "--moe-aux-alpha", alpha,
                                     "--moe-z-loss", cz, steps=1)
        return logged[0] if logged else None, out
    a, out = first_step(0.01, 0.001)
    b, out2 = first_step(0.02, 0.002)
    if a is None or b is None:
        report(False, "aux values: runs", (out + out2)[-1500:])
        return
    # near-uniform routing: per MoE block L_aux ~ alpha, L_z ~ c_z (ln E)^2; 2 blocks
    want_aux, want_z = 2 * 0.01, 2 * 0.001 * np.log(4) ** 2
    near = abs(a["moe_aux"] - want_aux) < 0.02 * want_aux and abs(a["moe_z"] - want_z) < 0.05 * want_z
    report(near, f"aux values: step 1's L_aux {a['moe_aux']:.6f} ~ alpha x 2 blocks = {want_aux} (2%), L_z {a['moe_z']:.6f} "
           f"~ c_z (ln 4)^2 x 2 blocks = {want_z:.6f} (5%)", json.dumps(a))
    report(abs(b["moe_aux"] - 2 * a["moe_aux"]) <= 1e-6 * a["moe_aux"] and abs(b["moe_z"] - 2 * a["moe_z"]) <= 1e-6 * a["moe_z"]
           and b["loss"] == a["loss"],
           "aux values: doubling alpha and c_z doubles step 1's aux and z losses and leaves the LM loss alone",
           f"{json.dumps(a)}\n{json.dumps(b)}")


def check_accumulation(tmp):
    flags = ["--moe-experts", 4, "--moe-top-k", 2, "--moe-aux-alpha", 1, "--moe-z-loss", 0.1]
    _, out1, one, _ = train(tmp, "accum1", "--total-batch-tokens", 2 * T, *flags, data="periodic64.bin")
    _, out2, two, _ = train(tmp, "accum2", "--total-batch-tokens", 4 * T, *flags, data="periodic64.bin")
    if one is None or two is None:
        report(False, "accumulate: runs", (out1 + out2)[-1500:])
        return
    loss, grad, param, _ = differences(two, one)
    report(loss <= TOL_LOSS_REL and grad <= TOL_GRAD_REL and param <= TOL_PARAM_ABS,
           f"accumulate: 2 identical micro-batches == 1 (alpha 1, c_z 0.1; losses {loss:.1e}, step-1 grads {grad:.1e} of max, "
           f"weights {param:.1e}): the auxiliary losses are averaged over the micro-batches",
           f"beyond tolerance (losses {TOL_LOSS_REL}, grads {TOL_GRAD_REL}, weights {TOL_PARAM_ABS})")


def check_ranks(tmp):
    if not shutil.which("mpirun") or "libmpi" not in subprocess.run(["ldd", BIN], capture_output=True, text=True).stdout:
        print("SKIP: ranks (no mpirun, or train_gpt_cpu built without MPI)")
        return
    work = os.path.join(tmp, "ranks")
    os.makedirs(work)
    rng = np.random.default_rng(0)
    write_shard(os.path.join(work, "train_000.bin"), rng.integers(0, 501, 16384))
    r = Runner(work)
    flags = ["--moe-experts", 4, "--moe-top-k", 2]
    one, _ = r.dump("one", 1, *flags, steps=5)
    two, out = r.dump("two", 2, *flags, steps=5)
    check_close("ranks: E = 4 top-2 on dp2", two, one)
    check_predictions("ranks: E = 4 top-2 on dp2", out, 2)
    # the factored optimizers: every rank updates the whole table from the same sum. Compared as
    # test_optimizers.py compares them (1e-5, the dense key biases left out: their gradient is rounding
    # noise, which Adafactor and SM3 divide by its own size, so the summation order moves them a full step)
    for opt in ("adafactor", "sm3"):
        one, _ = r.dump(opt + "_one", 1, *flags, "--optimizer", opt, steps=5)
        two, out = r.dump(opt + "_two", 2, *flags, "--optimizer", opt, steps=5)
        if one is None or two is None:
            continue
        check_factored_close(f"ranks: E = 4 top-2, --optimizer {opt}, dp2 (weights with the MoE table), 5 steps,", two, one)
        check_predictions(f"ranks: --optimizer {opt} on dp2", out, 2)
    # --zero 1: the dense model's whole blocks per rank (factored_sharding.h), the MoE table's statistics
    # whole on every rank, updated from the same all-reduced sum: ZeRO-0's arithmetic, so its bits. On 3
    # ranks, where AdamW's flat sharing of the table would cut an expert's fcw mid-row (on 2 the cut falls
    # in the fcb vectors, whose elementwise statistics cannot show it)
    six = ["--optimizer", "adafactor", "--total-batch-tokens", 6 * T]
    z0, _ = r.dump("adafactor_zero0_3", 3, *flags, *six, steps=5)
    z1, out = r.dump("adafactor_zero1_3", 3, *flags, *six, "--zero", 1, steps=5)
    if z0 is not None and z1 is not None:
        report(np.array_equal(z1["params"], z0["params"]) and np.array_equal(z1["losses"], z0["losses"]),
               "ranks: E = 4 top-2, --optimizer adafactor, dp3 --zero 1 == dp3 --zero 0, 5 steps, bit for bit (weights with "
               "the MoE table)", f"weights differ by {np.max(np.abs(z1['params'].astype(np.float64) - z0['params'])):.2e}")
        check_predictions("ranks: --optimizer adafactor on dp3 --zero 1", out, 3)


def check_recompute(tmp, flags, straight, logged):
    """--recompute 1 and 2 with MoE == --recompute 0 bit for bit (the resume check's straight run, 5 steps of
    2 micro-batches, tokens dropped): losses, the auxiliary losses, drops and loads in metrics.jsonl, the
    final weights. The MoE layer is not run again in the backward (its routing is kept, so it routes the
    same and adds its auxiliary losses once, Megatron-LM issue 1330); level 2 rebuilds its ln2."""
    keys = ("loss", "moe_aux", "moe_z", "moe_dropped", "moe_load_min", "moe_load_max")
    for level in (1, 2):
        _, out, d, got = train(tmp, f"recompute{level}", *flags, "--recompute", level, steps=5)
        if d is None:
            report(False, f"recompute {level}: MoE with --recompute {level} runs", out[-1500:])
            continue
        stats_same = len(got) == len(logged) == 5 and all(a[k] == b[k] for a, b in zip(got, logged) for k in keys)
        same = [k for k in ("losses", "params") if np.array_equal(d[k], straight[k])]
        report(stats_same and len(same) == 2,
               f"recompute {level}: E = 4 top-2 with drops, --recompute {level} == --recompute 0 bit for bit over 5 steps "
               "(losses, aux and z losses, drops, loads, final weights with the MoE table)",
               f"bit-identical: {same}; step stats equal {stats_same}\n" +
               "\n".join(f"{a} vs {b}" for a, b in zip(got, logged)))


def check_resume(tmp):
    flags = ["--total-batch-tokens", 4 * T, "--moe-experts", 4, "--moe-top-k", 2, "--moe-capacity-factor", 1.25]
    out_dir = os.path.join(tmp, "out")  # train()'s --out-dir
    _, out, straight, straight_logged = train(tmp, "straight", *flags, "--checkpoint-every", 3, steps=5)
    ckpt = os.path.join(out_dir, "ckpt_00000003")
    _, out2, resumed, _ = train(tmp, "resumed", *flags, "--resume", ckpt, steps=5)
    if straight is None or resumed is None:
        report(False, "resume: runs", (out + out2)[-1500:])
        return
    check_recompute(tmp, flags, straight, straight_logged)
    header = np.fromfile(os.path.join(ckpt, "model.bin"), dtype=np.int32, count=11)
    dropped = sum(int(d) for (_, _, _, d, _, _) in step_lines(out))
    report(np.array_equal(straight["losses"][3:], resumed["losses"]) and np.array_equal(straight["params"], resumed["params"])
           and list(header[[1, 8, 9, 10]]) == [7, 4, 2, 1] and os.path.exists(os.path.join(ckpt, "moe_state.bin")) and dropped > 0,
           f"resume: 3 + 2 steps == 5 bit for bit (losses, weights and the MoE table; {dropped} assignments dropped); model.bin "
           "is version 7 with E, top-k, every in its header",
           f"losses {straight['losses']} vs {resumed['losses']}; header {header}")
    base = ["--model", MODEL, "--train-data", os.path.join(tmp, "train.bin"), "--seq-len", str(T), "--steps", "5",
            "--out-dir", out_dir, "--resume", ckpt]
    one_line_error("resume: with --moe-top-k 1 instead of the checkpoint's 2", base + ["--moe-experts", "4", "--moe-top-k", "1"],
                   2, "--moe-top-k 2", "--moe-top-k 1", "pass the model's --moe-* flags", seconds=10)
    one_line_error("resume: an MoE checkpoint as a dense model", base, 2, "--moe-experts 4", "a dense model", seconds=10)
    one_line_error("hf_convert export of an MoE checkpoint", ["export", ckpt, os.path.join(tmp, "hf")], 1,
                   "mixture-of-experts", "dense GPT-2 only", binary=os.path.join(ROOT, "hf_convert"), seconds=10)
    # --generate reads the checkpoint's MoE model (test_generate.py tests it closely on large random weights):
    # here the trained one, with the run's flags, the KV cache against the training forward
    gen = ["--resume", ckpt, "--generate", "4 8 15 16 23", "--sample-tokens", "20", "--temperature", "0", "--json", "--threads", "1"]
    tokens = {}
    for kv in ("1", "0"):
        p = subprocess.run([BIN, *gen, "--kv-cache", kv, *map(str, flags[2:])], capture_output=True, text=True, cwd=ROOT)
        tokens[kv] = json.loads(p.stdout)["tokens"] if p.returncode == 0 else p.stderr.strip()[-300:]
    report(isinstance(tokens["1"], list) and tokens["1"] == tokens["0"],
           "--generate from the MoE checkpoint: the KV cache's greedy tokens == the training forward's", f"{tokens}",
           f"{len(set(tokens['1']))} distinct of 20" if isinstance(tokens["1"], list) else "")
    one_line_error("--generate from an MoE checkpoint without its --moe-* flags", ["--generate", "4", "--resume", ckpt], 2,
                   "--moe-experts 4", "pass the model's --moe-* flags", seconds=10)
    gpu = gpu_trainer()
    if gpu is None:
        print("SKIP: the GPU trainer refuses an MoE checkpoint without its flags (neither build/emu/train_gpt nor train_gpt is built)")
    else:
        one_line_error(f"{os.path.relpath(gpu, ROOT)}: --resume of an MoE checkpoint without its --moe-* flags", base, 2,
                       "--moe-experts 4", "a dense model", binary=gpu, seconds=60)


def check_factored(tmp):
    """--optimizer adafactor and sm3 with MoE: every router and every expert tensor a block of its own
    (llmc/optim/optimizer_state.h's moe_param_blocks), its statistics in moe_state.bin (version 2).
    Adafactor's step 1 against the paper (Shazeer & Stern 2018, Algorithm 4: beta2_1 = 1 - 1^-0.8 = 0,
    so R_i = sum_j (g_ij^2 + eps1), C_j = sum_i (g_ij^2 + eps1) of each matrix, V_i = g_i^2 + eps1 of each
    vector), computed here from the dumped step-1 gradient of the MoE table, laid out as
    llmc/model/model.h's MoE table; then, for both optimizers, 3 steps + checkpoint + resume + 2 == 5
    straight, bit for bit (weights and the MoE table's statistics resumed)."""
    E, Lm, H = 4, L, 4 * C
    flags = ["--moe-experts", E, "--moe-top-k", 2, "--moe-capacity-factor", 1.25, "--total-batch-tokens", 4 * T]
    out_dir = os.path.join(tmp, "out_factored")
    _, out, d, _ = train(tmp, "adafactor1", *flags, "--optimizer", "adafactor", "--grad-clip", 0, "--checkpoint-every", 1,
                         "--out-dir", out_dir, steps=1)
    path = os.path.join(out_dir, "ckpt_00000001", "moe_state.bin")
    if d is None or not os.path.exists(path):
        report(False, "factored: Adafactor with MoE runs and writes moe_state.bin", out[-1500:])
        return
    header = np.fromfile(path, dtype=np.int32, count=256)
    state = np.fromfile(path, dtype=np.float32, offset=1024).astype(np.float64)
    table = Lm * (E * C + (E - 1) * (8 * C * C + 5 * C))
    g = d["grads"][-table:].astype(np.float64)
    # the MoE table: router (Lm, E, C) | fcw (Lm, E-1, H, C) | fcb (Lm, E-1, H) | fcprojw (Lm, E-1, C, H) | fcprojb (Lm, E-1, C)
    want, at = [], 0
    for count, rows, cols in ((Lm, E, C), (Lm * (E - 1), H, C), (Lm * (E - 1), H, 0), (Lm * (E - 1), C, H), (Lm * (E - 1), C, 0)):
        for _ in range(count):
            if cols:
                sq = g[at:at + rows * cols].reshape(rows, cols) ** 2 + 1e-30
                want += [sq.sum(axis=1), sq.sum(axis=0)]
                at += rows * cols
            else:
                want.append(g[at:at + rows] ** 2 + 1e-30)
                at += rows
    want = np.concatenate(want)
    rel = float(np.max(np.abs(state - want) / want)) if state.size == want.size else float("inf")
    report(header[1] == 2 and header[7] == 1 and rel <= 1e-6,
           f"factored: Adafactor's step-1 statistics of the MoE table (moe_state.bin v2, {want.size} values: per MoE block "
           f"the router's E + C, per expert its 4 tensors' rows and columns) = the paper's R, C, V from the step-1 gradient "
           f"(max rel {rel:.1e})", f"header {header[:8]}; {state.size} values vs {want.size}")
    for opt in ("adafactor", "sm3"):
        _, out, straight, _ = train(tmp, f"{opt}_straight", *flags, "--optimizer", opt, "--checkpoint-every", 3,
                                    "--out-dir", out_dir, steps=5)
        _, out2, resumed, _ = train(tmp, f"{opt}_resumed", *flags, "--optimizer", opt, "--resume",
                                    os.path.join(out_dir, "ckpt_00000003"), "--out-dir", out_dir, steps=5)
        if straight is None or resumed is None:
            report(False, f"factored: {opt} resume runs", (out + out2)[-1500:])
            continue
        report(np.array_equal(straight["losses"][3:], resumed["losses"]) and np.array_equal(straight["params"], resumed["params"]),
               f"factored: --optimizer {opt} with MoE (tokens dropped): 3 steps + resume + 2 == 5 bit for bit (losses, weights "
               "with the MoE table)", f"losses {straight['losses']} vs {resumed['losses']}")


def check_estimate(tmp):
    shape = ["--model", MODEL, "--batch-size", "2", "--seq-len", str(T), "--moe-experts", "4", "--moe-top-k", "2",
             "--moe-every", "2", "--moe-capacity-factor", "1.5"]
    p = subprocess.run([BIN] + shape + ["--estimate"], capture_output=True, text=True, cwd=tmp)
    rows, ranks = parse_estimate(p.stdout)
    q = subprocess.run([BIN] + shape + ["--train-data", os.path.join(tmp, "train.bin"), "--val-data", "none", "--steps", "2",
                        "--threads", "1", "--print-allocations", "--metrics", "none", "--out-dir", os.path.join(tmp, "out")],
                       capture_output=True, text=True)
    why = compare(rows, ranks, parse_allocations(q.stdout), 0) if q.returncode == 0 else q.stderr[-400:]
    moe_rows = [name for name in rows if name.startswith("moe_") and rows[name][1] > 0]
    report(p.returncode == 0 and not why and len(moe_rows) == 5,
           f"estimate: every buffer allocated = --estimate's, to the byte, the MoE rows among them ({', '.join(moe_rows)})", why)
    est = re.search(r"^mixture of experts: .*: ([\d,]+) parameters in all .* ([\d,]+) active per token", p.stdout, re.M)
    got = re.search(r"^mixture of experts: .*= (\d+) parameters, (\d+) active per token", q.stdout, re.M)
    # by hand: dense 134,912 (V=501 -> Vp=512); 1 MoE block (every 2 of 2): router 4 x 64, 3 more experts of
    # 8 C^2 + 5 C = 33,088 each; a token passes through the router and k - 1 = 1 more expert
    total, active = 134912 + 4 * 64 + 3 * 33088, 134912 + 4 * 64 + 33088
    report(est is not None and got is not None and int(est.group(1).replace(",", "")) == int(got.group(1)) == total
           and int(est.group(2).replace(",", "")) == int(got.group(2)) == active,
           f"estimate: {total} parameters in all, {active} active per token, in --estimate and in the trainer's header",
           f"{est.group(0) if est else p.stdout[:800]}\n{got.group(0) if got else q.stdout[:800]}")


def main():
    if not os.path.exists(BIN):
        print("FAIL: moe trainer: train_gpt_cpu is not built (run make)")
        return 1
    tmp = tempfile.mkdtemp(prefix="llmc_moe_trainer_")
    try:
        rng = np.random.default_rng(0)
        write_shard(os.path.join(tmp, "train.bin"), rng.integers(0, 501, 8192))
        # a stream of period 97 (learnable), and one of period B*T = 64 (every micro-batch the same)
        write_shard(os.path.join(tmp, "periodic97.bin"), np.tile(rng.integers(0, 501, 97), 60))
        write_shard(os.path.join(tmp, "periodic64.bin"), np.tile(rng.integers(0, 501, 64), 60))
        check_dense(tmp)
        check_stash(tmp)
        check_learns(tmp)
        check_aux_values(tmp)
        check_accumulation(tmp)
        check_ranks(tmp)
        check_resume(tmp)
        check_factored(tmp)
        check_estimate(tmp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
