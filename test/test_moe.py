#!/usr/bin/env python3
"""test_moe.py — the mixture-of-experts layer (llmc/model/moe.h) against PyTorch in float64.

The reference below is written from the papers' formulas, not from moe.h: Switch Transformers
(Fedus et al. 2021) for top-1 (y = p_e E_e(x)) and the load-balancing loss alpha E sum_i f_i P_i,
GShard (Lepikhin et al. 2020) for top-2 with the two gates renormalised, ST-MoE (Zoph et al. 2022)
for the z-loss c_z mean(logsumexp^2). The conventions the papers leave open are the ones moe.h
states: no router bias; ties to the lowest expert index; capacity ceil(k N f / E) (f = 0: none);
first choices of all tokens by position, then second choices by position; f_i counts assignments
before dropping over k N. Autograd differentiates the reference's loss
    sum(y * dy) + aux_scale * (L_aux + L_z)
with f_i a plain number (no gradient) and the routing decided by the reference's own float64
probabilities; the harness (build/test_moe_layer --dump) runs moe_forward and moe_backward in fp32
on the same fp32 inputs.

Checked, per configuration: the routing (every choice and whether it was kept, the capacity, the
dropped count, the least and most loaded expert) exactly; the logits, probabilities, gates and
output; L_aux and L_z; the input gradient and every weight gradient (router, fc, proj, biases).
Also the auxiliary losses alone (dy = 0, the language-model loss times zero): the experts'
gradients must be exactly zero there, and the router's and the input's must match the reference.

Tolerances: max |ours - ref| / max |ref| per tensor <= 1e-4 (1e-5 relative for the two scalar
losses). The sums here are short (C = 16, 4C = 64, N = 48), so fp32 against float64 differs by a
few 1e-7 (the largest seen is printed with each check); 1e-4 leaves room for any x86-64 CPU's
rounding and still catches a missing factor anywhere. Bugs planted by hand and caught (the report
lists each): top-2 gates not renormalised, the gate's gradient missing, f_i given a gradient,
capacity off by one, second choices competing with first ones token by token.
"""
import math, os, subprocess, sys, tempfile
import numpy as np
import torch
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
HARNESS = os.path.join(ROOT, "build", "test_moe_layer")
TOL, TOL_LOSS = 1e-4, 1e-5


def gelu(x):  # GPT-2's tanh approximation
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * x ** 3)))


def reference(t, E, k, f, alpha, cz, aux_scale):
    """The MoE MLP from the papers' formulas, float64, autograd for every gradient."""
    v = {name: torch.tensor(a, dtype=torch.float64, requires_grad=name != "dy") for name, a in t.items()}
    x, Wr, dy = v["x"], v["router"], v["dy"]
    N = x.shape[0]
    logits = x @ Wr.T
    p = torch.softmax(logits, dim=-1)
    pd = p.detach().numpy()
    choices = [sorted(range(E), key=lambda e: (-pd[n, e], e))[:k] for n in range(N)]  # ties: lowest index
    cap = N if f <= 0 else math.ceil(k * N * float(np.float32(f)) / E)
    kept = np.zeros((N, k), dtype=bool)
    load = [0] * E
    for j in range(k):          # every token's first choice, by position, before any second choice
        for n in range(N):
            e = choices[n][j]
            if load[e] < cap:
                kept[n, j] = True
                load[e] += 1
    rows = []
    gates = np.zeros((N, k))
    for n in range(N):
        c = choices[n]
        g = [p[n, c[0]]] if k == 1 else [p[n, c[0]] / (p[n, c[0]] + p[n, c[1]]), p[n, c[1]] / (p[n, c[0]] + p[n, c[1]])]
        gates[n] = [gi.item() for gi in g]
        yn = torch.zeros(x.shape[1], dtype=torch.float64)
        for j in range(k):
            if kept[n, j]:
                e = c[j]
                h = gelu(x[n] @ v["fcw"][e].T + v["fcb"][e])
                yn = yn + g[j] * (h @ v["projw"][e].T + v["projb"][e])
        rows.append(yn)
    y = torch.stack(rows)
    frac = torch.tensor([sum(c.count(e) for c in choices) / (k * N) for e in range(E)], dtype=torch.float64)  # no grad
    aux = alpha * E * (frac * p.mean(dim=0)).sum()
    z = cz * (torch.logsumexp(logits, dim=-1) ** 2).mean()
    loss = (y * dy).sum() + aux_scale * (aux + z)
    loss.backward()
    out = {"logits": logits.detach().numpy(), "probs": pd, "choice": np.array(choices, dtype=np.float64),
           "gate": gates, "kept": kept.astype(np.float64), "y": y.detach().numpy(), "aux": aux.item(), "z": z.item(),
           "dropped": int((~kept).sum()), "min_load": min(load), "max_load": max(load), "capacity": cap}
    for name in ["x", "router", "fcw", "fcb", "projw", "projb"]:
        out["d" + name] = v[name].grad.numpy()
    return out


def harness(t, E, k, f, alpha, cz, aux_scale, threads=None, raw=False):
    N, C = t["x"].shape
    H = t["fcw"].shape[1]
    env = dict(os.environ, OMP_NUM_THREADS=str(threads)) if threads else None
    with tempfile.TemporaryDirectory() as tmp:
        src, dst = os.path.join(tmp, "in.bin"), os.path.join(tmp, "out.bin")
        with open(src, "wb") as fh:
            fh.write(np.array([N, C, H, E, k], dtype=np.int32).tobytes())
            fh.write(np.array([f, alpha, cz, aux_scale], dtype=np.float32).tobytes())
            for name in ["x", "router", "fcw", "fcb", "projw", "projb", "dy"]:
                fh.write(t[name].astype(np.float32).tobytes())
        proc = subprocess.run([HARNESS, "--dump", src, dst], env=env, capture_output=True, text=True)
        if raw:
            return proc
        if proc.returncode != 0:
            raise RuntimeError(f"test_moe_layer --dump failed: {proc.stderr.strip()}")
        flat = np.fromfile(dst, dtype=np.float32).astype(np.float64)
    shapes = [("logits", (N, E)), ("probs", (N, E)), ("choice", (N, k)), ("gate", (N, k)), ("kept", (N, k)),
              ("y", (N, C)), ("stats", (6,)), ("dx", (N, C)), ("drouter", (E, C)), ("dfcw", (E, H, C)),
              ("dfcb", (E, H)), ("dprojw", (E, C, H)), ("dprojb", (E, C))]
    out, at = {}, 0
    for name, shape in shapes:
        n = int(np.prod(shape))
        out[name] = flat[at:at + n].reshape(shape)
        at += n
    assert at == flat.size, "harness output has the wrong size"
    s = out.pop("stats")
    out.update(aux=s[0], z=s[1], dropped=int(s[2]), min_load=int(s[3]), max_load=int(s[4]), capacity=int(s[5]))
    return out


def tensors(seed, N, C, E, dy_zero=False):
    """Random fp32 inputs, scaled so the tiny layer is clearly nonlinear and the router clearly uneven."""
    g = np.random.default_rng(seed)
    H = 4 * C
    t = {"x": g.standard_normal((N, C)), "router": 0.5 * g.standard_normal((E, C)),
         "fcw": 0.3 * g.standard_normal((E, H, C)), "fcb": 0.1 * g.standard_normal((E, H)),
         "projw": 0.2 * g.standard_normal((E, C, H)), "projb": 0.1 * g.standard_normal((E, C)),
         "dy": np.zeros((N, C)) if dy_zero else g.standard_normal((N, C))}
    return {name: a.astype(np.float32) for name, a in t.items()}


def rel(ours, ref):
    scale = np.max(np.abs(ref))
    return float(np.max(np.abs(ours - ref)) / scale) if scale > 0 else float(np.max(np.abs(ours)))


def compare(name, E, k, f, alpha=1e-2, cz=1e-3, aux_scale=0.5, seed=1, dy_zero=False, expect_drops=None):
    t = tensors(seed, 48, 16, E, dy_zero)
    ours, ref = harness(t, E, k, f, alpha, cz, aux_scale), reference(t, E, k, f, alpha, cz, aux_scale)
    routing = all(np.array_equal(ours[key], ref[key]) for key in ["choice", "kept"]) and \
        all(ours[key] == ref[key] for key in ["dropped", "min_load", "max_load", "capacity"])
    report(routing, f"{name}: routing, kept choices, capacity and loads equal the reference",
           f"ours: capacity {ours['capacity']}, dropped {ours['dropped']}, load {ours['min_load']}..{ours['max_load']}; "
           f"reference: capacity {ref['capacity']}, dropped {ref['dropped']}, load {ref['min_load']}..{ref['max_load']}",
           f"capacity {ref['capacity']}, {ref['dropped']} of {48 * k} dropped, load {ref['min_load']}..{ref['max_load']}")
    if expect_drops is not None:
        report((ref["dropped"] > 0) == expect_drops, f"{name}: the configuration " + ("drops tokens" if expect_drops else "keeps every token"),
               f"the reference dropped {ref['dropped']}")
    if not routing:
        return  # with another routing the values cannot be compared
    worst = {key: rel(ours[key], ref[key]) for key in ["logits", "probs", "gate", "y"]}
    bad = {key: e for key, e in worst.items() if not e <= TOL}
    report(not bad, f"{name}: logits, probabilities, gates and output", f"over {TOL}: {bad}",
           ", ".join(f"{key} {e:.1e}" for key, e in worst.items()))
    losses = {key: abs(ours[key] - ref[key]) / abs(ref[key]) for key in ["aux", "z"]}
    report(all(e <= TOL_LOSS for e in losses.values()), f"{name}: load-balancing loss and z-loss",
           f"relative errors {losses}", f"L_aux {ref['aux']:.6g} ({losses['aux']:.1e}), L_z {ref['z']:.6g} ({losses['z']:.1e})")
    grads = ["dx", "drouter", "dfcw", "dfcb", "dprojw", "dprojb"]
    if dy_zero:  # the LM loss times zero: only the router (and through it the input) may have a gradient
        zero = all(not np.any(ours[key]) for key in ["dfcw", "dfcb", "dprojw", "dprojb"])
        report(zero and np.any(ref["drouter"] != 0), f"{name}: the experts' gradients are exactly zero, the router's is not",
               "an expert weight moved without the LM loss, or the router got no gradient")
        grads = ["dx", "drouter"]
    worst = {key: rel(ours[key], ref[key]) for key in grads}
    bad = {key: e for key, e in worst.items() if not e <= TOL}
    report(not bad, f"{name}: every gradient", f"over {TOL}: {bad}", ", ".join(f"{key} {e:.1e}" for key, e in worst.items()))


def check_threads():
    """Each output element is computed by one thread and every sum over tokens runs in a fixed order,
    so the layer gives the same bits on 1 and 2 threads (what the trainer's determinism rests on)."""
    t = tensors(7, 48, 16, 4)
    one = harness(t, 4, 2, 1.0, 1e-2, 1e-3, 0.5, threads=1)
    two = harness(t, 4, 2, 1.0, 1e-2, 1e-3, 0.5, threads=2)
    same = all(np.array_equal(one[key], two[key]) if isinstance(one[key], np.ndarray) else one[key] == two[key] for key in one)
    report(same, "the same bits on 1 and 2 threads (top-2, capacity 1.0)", "some output differs")


def check_bad_shapes():
    """A shape the layer cannot run is refused before anything runs: one line naming the flag, exit 2."""
    for E, k, f, flag in [(0, 1, 0.0, "--moe-experts"), (4, 3, 0.0, "--moe-top-k"), (1, 2, 0.0, "--moe-top-k"),
                          (4, 1, -1.0, "--moe-capacity-factor")]:
        t = tensors(8, 8, 16, max(E, 1))
        proc = harness(t, E, k, f, 1e-2, 1e-3, 1.0, raw=True)
        lines = proc.stderr.strip().splitlines()
        ok = proc.returncode == 2 and len(lines) == 1 and flag in lines[0]
        report(ok, f"E={E} top-{k} f={f} refused with one line naming {flag}, exit 2",
               f"exit {proc.returncode}, stderr {proc.stderr.strip()!r}", lines[0] if lines else "")


def main():
    torch.set_num_threads(1)
    subprocess.run(["make", "-s", "build/test_moe_layer"], cwd=ROOT, check=True)
    compare("top-1 E=4, no dropping", 4, 1, 0.0, expect_drops=False)
    compare("top-1 E=4, capacity 1.0", 4, 1, 1.0, expect_drops=True)
    compare("top-2 E=4, capacity 1.25", 4, 2, 1.25, seed=2, expect_drops=True)
    compare("top-2 E=3, no dropping", 3, 2, 0.0, seed=3, expect_drops=False)
    compare("top-2 E=8, capacity 0.5, alpha 0.1, c_z 0.01", 8, 2, 0.5, alpha=0.1, cz=0.01, seed=4, expect_drops=True)
    compare("auxiliary losses alone (top-1, capacity 1.0)", 4, 1, 1.0, aux_scale=1.0, seed=5, dy_zero=True)
    compare("auxiliary losses alone (top-2, no dropping)", 4, 2, 0.0, aux_scale=1.0, seed=6, dy_zero=True)
    check_threads()
    check_bad_shapes()
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
