#!/usr/bin/env python3
"""report.py — one run folder as one self-contained HTML page to look at.

    scripts/report.py RUN_DIR [-o FILE] [--trainer PATH] [--log FILE] [--trace FILE ...]

Writes FILE (default RUN_DIR/report.html): a single file with nothing to fetch (no network, no CDN;
the plots are SVG drawn here, the few lines of JavaScript are its own), so it opens offline, mails
as one attachment and stays as it was. What it shows, each when the run has it:

  loss          the training loss per step (thin) and the validation loss (dots), from metrics.jsonl
                (llmc/run/metrics.h; a resumed run's repeated steps: the last record wins, as in
                scripts/plot_metrics.py, whose reader this uses); HellaSwag accuracy when logged
  speed         tokens/s per step, and MFU (the GPU trainer logs it); the CPU trainer logs no FMA
                share (only --profile prints one, to the terminal), so the page says so and shows the
                model FLOP/s the step times imply (6N + 6LCT per token: --estimate's count)
  optimizer     the learning rate and the gradient norm per step
  memory        the memory logged per step (CPU: peak resident; GPU: device memory in use) against
                the trainer's own --estimate for the run's shape, by kind (params, grads, optimizer,
                activations, ...): the estimate is run when the trainer binary is here (--trainer)
  pipeline      the --trace timeline of the last traced step, one row per rank, with a legend and
                each rank's bubble (scripts/plot_pipeline.py's reader), when trace files are found:
                --trace, else the run's own --trace flag, else RUN_DIR/trace*.json
  samples       the text the run sampled, from its printed output: RUN_DIR/train.log (scripts/run.sh
                writes it) or --log FILE
  options       the model, the plan and every flag's value, from the log's last "run" record

Hover a point for its values. The page's script checks that every plot drew and writes "report ok"
into the page (test/test_report.py reads that with a headless browser).
"""
import argparse, glob, html, json, math, os, re, subprocess, sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from plot_metrics import read_log  # noqa: E402
from plot_pipeline import COLOURS, bubbles, colour, is_compute, load_spans  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PALETTE = ["#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b2", "#937860"]
WAIT_COLOUR = "#bbbbbb"


def esc(x):
    return html.escape(str(x), quote=True)


def nice_ticks(lo, hi, count=5):
    """About `count` round numbers spanning [lo, hi] (1, 2 or 5 times a power of ten apart)."""
    if hi <= lo:
        hi = lo + (abs(lo) or 1.0)
    raw = (hi - lo) / count
    power = 10 ** math.floor(math.log10(raw))
    step = next(m * power for m in (1, 2, 5, 10) if m * power >= raw)
    first = math.ceil(lo / step) * step
    ticks, t = [], first
    while t <= hi + step * 1e-9:
        ticks.append(round(t, 12))
        t += step
    return ticks


def fmt(v):
    if v == 0:
        return "0"
    a = abs(v)
    if a >= 1e6 or a < 1e-3:
        return f"{v:.2g}"
    if a >= 100:
        return f"{v:,.0f}"
    return f"{v:.3g}"


# ----------------------------------------------------------------------------------------------
# SVG charts: a plot is an <svg class="plot"> with data-name; the page's script checks each drew marks


def line_chart(name, title, series, xlabel, ylabel, hlines=(), width=560, height=300):
    """series: [{"label", "colour", "points": [(x, y)], "dots": bool}]; hlines: [(y, label, colour)]."""
    left, right, top, bottom = 62, 14, 44, 42
    pts = [p for s in series for p in s["points"] if p[1] is not None and math.isfinite(p[1])]
    if not pts:
        return ""
    xs = [p[0] for p in pts]
    ys = [p[1] for p in pts] + [h[0] for h in hlines]
    x0, x1 = min(xs), max(xs)
    if x1 == x0:  # one point (a single HellaSwag evaluation): centred
        x0, x1 = x0 - 1, x1 + 1
    y0, y1 = min(ys), max(ys)
    pad = (y1 - y0) * 0.06 or abs(y1) * 0.1 or 1.0
    y0, y1 = y0 - pad, y1 + pad
    if min(ys) >= 0 and y0 < 0:
        y0 = 0.0
    pw, ph = width - left - right, height - top - bottom
    X = lambda x: left + (x - x0) / (x1 - x0) * pw
    Y = lambda y: top + (y1 - y) / (y1 - y0) * ph
    out = [f'<svg class="plot" data-name="{esc(name)}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="{esc(title)}">',
           f'<text x="{left}" y="18" class="title">{esc(title)}</text>',
           f'<rect x="{left}" y="{top}" width="{pw}" height="{ph}" class="frame"/>']
    for t in nice_ticks(y0, y1):
        if y0 <= t <= y1:
            out.append(f'<line x1="{left}" x2="{left + pw}" y1="{Y(t):.1f}" y2="{Y(t):.1f}" class="grid"/>'
                       f'<text x="{left - 6}" y="{Y(t) + 4:.1f}" class="tick" text-anchor="end">{esc(fmt(t))}</text>')
    for t in nice_ticks(x0, x1, 6):
        if x0 <= t <= x1:
            out.append(f'<line x1="{X(t):.1f}" x2="{X(t):.1f}" y1="{top + ph}" y2="{top + ph + 4}" class="axis"/>'
                       f'<text x="{X(t):.1f}" y="{top + ph + 16}" class="tick" text-anchor="middle">{esc(fmt(t))}</text>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{height - 6}" class="label" text-anchor="middle">{esc(xlabel)}</text>')
    out.append(f'<text x="14" y="{top + ph / 2:.0f}" class="label" text-anchor="middle" '
               f'transform="rotate(-90 14 {top + ph / 2:.0f})">{esc(ylabel)}</text>')
    for y, label, col in hlines:
        out.append(f'<line x1="{left}" x2="{left + pw}" y1="{Y(y):.1f}" y2="{Y(y):.1f}" stroke="{col}" class="hline">'
                   f'<title>{esc(label)}: {esc(fmt(y))}</title></line>')
    for s in series:
        good = [(x, y) for x, y in s["points"] if y is not None and math.isfinite(y)]
        if not good:
            continue
        if s.get("dots"):
            for x, y in good:
                out.append(f'<circle cx="{X(x):.1f}" cy="{Y(y):.1f}" r="3.5" fill="{s["colour"]}" class="mark">'
                           f'<title>{esc(s["label"])}: step {x}, {y:.4g}</title></circle>')
        else:
            d = " ".join(f'{"M" if i == 0 else "L"}{X(x):.1f},{Y(y):.1f}' for i, (x, y) in enumerate(good))
            out.append(f'<path d="{d}" stroke="{s["colour"]}" class="mark line"><title>{esc(s["label"])}</title></path>')
    # legend: one row under the title, each entry's mark as drawn (line, dot, dashed line)
    entries = [(s["label"], s["colour"], "dot" if s.get("dots") else "line") for s in series if s["points"]]
    entries += [(label, col, "dash") for _, label, col in hlines]
    lx, y = left, top - 8
    for label, col, kind in entries:
        dash = ' stroke-dasharray="5,3"' if kind == "dash" else ""
        mark = (f'<circle cx="{lx + 7}" cy="{y - 4}" r="3.5" fill="{col}"/>' if kind == "dot" else
                f'<line x1="{lx}" x2="{lx + 14}" y1="{y - 4}" y2="{y - 4}" stroke="{col}" stroke-width="2"{dash}/>')
        out.append(f'<g class="legend">{mark}<text x="{lx + 18}" y="{y}">{esc(label)}</text></g>')
        lx += 28 + 6.5 * len(label)
    out.append("</svg>")
    return "\n".join(out)


def bar_chart(name, title, bars, unit, width=560):
    """bars: [(label, [(part, value, colour)])] drawn as horizontal stacked bars on one scale, a legend below."""
    left, right, top, row = 150, 90, 30, 34
    total = max((sum(v for _, v, _ in parts) for _, parts in bars), default=0)
    if total <= 0:
        return ""
    legend = []
    for _, parts in bars:
        for part, _, col in parts:
            if (part, col) not in legend:
                legend.append((part, col))
    legend_rows = (len(legend) + 3) // 4
    height = top + row * len(bars) + 26 + 18 * legend_rows
    pw = width - left - right
    out = [f'<svg class="plot" data-name="{esc(name)}" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="{esc(title)}">', f'<text x="10" y="18" class="title">{esc(title)}</text>']
    for i, (label, parts) in enumerate(bars):
        y, x = top + row * i, left
        out.append(f'<text x="{left - 8}" y="{y + 17}" class="tick" text-anchor="end">{esc(label)}</text>')
        for part, v, col in parts:
            w = v / total * pw
            out.append(f'<rect x="{x:.1f}" y="{y + 4}" width="{max(w, 0.5):.1f}" height="20" fill="{col}" class="mark">'
                       f'<title>{esc(label)}: {esc(part)} {v:,.1f} {unit}</title></rect>')
            x += w
        out.append(f'<text x="{x + 6:.1f}" y="{y + 18}" class="tick">{sum(v for _, v, _ in parts):,.1f} {unit}</text>')
    ly = top + row * len(bars) + 16
    for i, (part, col) in enumerate(legend):
        lx, yy = left + (i % 4) * (pw + right) / 4, ly + 18 * (i // 4)
        out.append(f'<g class="legend"><rect x="{lx:.0f}" y="{yy - 9}" width="10" height="10" fill="{col}"/>'
                   f'<text x="{lx + 14:.0f}" y="{yy}">{esc(part)}</text></g>')
    out.append("</svg>")
    return "\n".join(out)


def timeline_chart(ranks, step, width=1000):
    """The pipeline timeline of one step: a row per rank, compute as boxes, waits as thin grey bars."""
    idle, t0, t1 = bubbles(ranks)
    end = max(s[1] + s[2] for spans in ranks.values() for s in spans)
    start = min(s[1] for spans in ranks.values() for s in spans)
    t0, span = min(t0, start), max(end, t1) - min(t0, start) or 1.0
    left, right, top, row = 130, 16, 30, 46
    order = sorted(ranks)
    height = top + row * len(order) + 40 + 26
    pw = width - left - right
    X = lambda t: left + (t - t0) / span * pw
    out = [f'<svg class="plot" data-name="pipeline" viewBox="0 0 {width} {height}" width="{width}" height="{height}" '
           f'role="img" aria-label="pipeline timeline">',
           f'<text x="{left}" y="18" class="title">pipeline timeline of step {step} (--trace): '
           f'{span / 1000:.1f} ms; white between boxes is idle (the bubble)</text>']
    for i, r in enumerate(order):
        y = top + row * i
        busy = sum(s[2] for s in ranks[r] if is_compute(s[0])) / 1000
        out.append(f'<text x="{left - 8}" y="{y + 12}" class="tick" text-anchor="end">rank {r}</text>'
                   f'<text x="{left - 8}" y="{y + 25}" class="tick" text-anchor="end">compute {busy:,.1f} ms</text>'
                   f'<text x="{left - 8}" y="{y + 38}" class="tick" text-anchor="end">bubble {100 * idle[r]:.1f}%</text>'
                   f'<line x1="{left}" x2="{left + pw}" y1="{y + 20}" y2="{y + 20}" class="grid"/>')
        for name, ts, dur, _ in ranks[r]:
            # at least 2 px: a stage whose compute is a sliver of the step still shows where it ran
            x, w = X(ts), max(dur / span * pw, 2.0 if is_compute(name) else 1.0)
            tip = f'<title>rank {r}: {esc(name)}, {dur / 1000:.3f} ms at +{(ts - t0) / 1000:.3f} ms</title>'
            if is_compute(name) or name in COLOURS:
                col = colour(name) if is_compute(name) else COLOURS[name]
                out.append(f'<rect x="{x:.2f}" y="{y + 4}" width="{w:.2f}" height="32" fill="{col}" stroke="white" '
                           f'stroke-width="0.5" class="mark">{tip}</rect>')
                if w > 7 * len(name) + 4:  # a label only where it fits; the tooltip names every span
                    out.append(f'<text x="{x + w / 2:.1f}" y="{y + 24}" class="inbox" text-anchor="middle">{esc(name)}</text>')
            else:  # receives, sends: waiting on a neighbour
                out.append(f'<rect x="{x:.2f}" y="{y + 16}" width="{w:.2f}" height="8" fill="{WAIT_COLOUR}" class="mark">{tip}</rect>')
    axis_y = top + row * len(order) + 4
    for t in nice_ticks(0, span / 1000, 8):
        xx = X(t0 + t * 1000)
        out.append(f'<line x1="{xx:.1f}" x2="{xx:.1f}" y1="{axis_y}" y2="{axis_y + 4}" class="axis"/>'
                   f'<text x="{xx:.1f}" y="{axis_y + 16}" class="tick" text-anchor="middle">{esc(fmt(t))}</text>')
    out.append(f'<text x="{left + pw / 2:.0f}" y="{axis_y + 32}" class="label" text-anchor="middle">ms since the step\'s first span</text>')
    legend = [("forward F", COLOURS["F"]), ("backward B", COLOURS["B"]), ("weight grad W (ZB-H1)", COLOURS["W"]),
              ("gradient sums", COLOURS["gradient sums"]), ("optimizer", COLOURS["optimizer"]), ("send / receive / wait", WAIT_COLOUR)]
    lx, ly = left, height - 8
    for label, col in legend:
        out.append(f'<g class="legend"><rect x="{lx:.0f}" y="{ly - 10}" width="12" height="12" fill="{col}"/>'
                   f'<text x="{lx + 16:.0f}" y="{ly}">{esc(label)}</text></g>')
        lx += 40 + 6.5 * len(label)
    out.append("</svg>")
    return "\n".join(out), idle, t1 - t0


# ----------------------------------------------------------------------------------------------
# What the run folder holds besides its log


def run_estimate(trainer, run):
    """The trainer's --estimate for the run's shape: ([("rank 0" or "ranks 0-3", {kind: bytes})], None) or (None, why not)."""
    if not trainer or not os.path.exists(trainer):
        return None, f"no trainer at '{trainer}' to run --estimate with (pass --trainer PATH)"
    cfg, plan, flags = run.get("config", {}), run.get("plan", {}), run.get("flags", {})
    model = ",".join(f"{k}={cfg[k]}" for k in ("L", "C", "H", "T", "V") if k in cfg)
    args = [trainer, "--estimate", "--model", model, "--batch-size", str(plan.get("B", 1)), "--seq-len", str(plan.get("T", 64))]
    # the flags that shape memory, as the run had them (not all: some name files, or ask for a run)
    shaping = ["total-batch-tokens", "recompute", "precision", "optimizer", "optimizer-state", "zero", "tensor-parallel",
               "sequence-parallel", "pipeline-parallel", "pipeline-schedule", "virtual-stages", "stash-precision", "offload",
               "moe-experts", "moe-top-k", "moe-every", "moe-capacity-factor", "expert-parallel", "attention"]
    ranks = int(plan.get("ranks", 1) or 1)
    per_replica = int(flags.get("tensor-parallel", 1) or 1) * int(flags.get("pipeline-parallel", 1) or 1)
    if ranks > 1:
        args += ["--estimate-ranks", str(max(1, ranks // max(1, per_replica)))]
    # The log holds every flag of both trainers, the other trainer's at their defaults, which this one
    # refuses by name ("--attention applies only to the GPU trainer"), and flags that only mean
    # something beside others ("--moe-top-k shapes MoE blocks, and there are none"): the first flag
    # the refusal names is dropped and the estimate run again.
    shaping = [n for n in shaping if flags.get(n) not in (None, "", False)]
    for _ in range(len(shaping) + 1):
        cmd = args + [x for n in shaping for x in ([f"--{n}"] if flags[n] is True else [f"--{n}", str(flags[n])])]
        try:
            p = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"--estimate did not run: {e}"
        named = [n for n in re.findall(r"--([a-z0-9-]+)", p.stderr) if n in shaping]
        if p.returncode == 0 or not named:
            break
        shaping.remove(named[0])
    args = cmd
    # "memory per rank": "  rank 0: params=... total=...  (dp,tp,pp)" per rank, or "  ranks 0-1: ..." for equal ones
    found = re.findall(r"^\s*(ranks? \d+(?:-\d+)?): ((?:[a-z]+=\d+ ?)+)", p.stdout, re.M)
    if p.returncode != 0 or not found:
        last = (p.stderr.strip() or p.stdout.strip()).splitlines()[-1:] or ["no output"]
        return None, f"--estimate failed ({' '.join(args[1:])}): {last[0]}"
    return [(ranks, {k: int(v) for k, v in (kv.split("=") for kv in kvs.split())}) for ranks, kvs in found], None


def find_traces(run_dir, run, given):
    if given:
        return given
    flagged = (run or {}).get("flags", {}).get("trace") or ""
    candidates = []
    if flagged:
        stem, ext = os.path.splitext(flagged)
        for base in (flagged, os.path.join(run_dir, os.path.basename(flagged))):
            s, e = os.path.splitext(base)
            candidates += [base] + sorted(glob.glob(f"{glob.escape(s)}.rank*{e or ''}"))
    candidates += sorted(glob.glob(os.path.join(glob.escape(run_dir), "*trace*.json")))
    found = [p for p in candidates if os.path.isfile(p)]
    ranked = [p for p in found if re.search(r"\.rank\d+", os.path.basename(p))]
    return sorted(set(ranked or found))


def read_samples(log_path):
    """[(step, text)] from a trainer's printed output: each "sample: TEXT" up to its "--------" line."""
    if not log_path or not os.path.isfile(log_path):
        return []
    samples, step, current = [], 0, None
    with open(log_path, encoding="utf-8", errors="replace") as f:
        for line in f:
            line = line.rstrip("\n")
            if current is not None:
                if line == "--------":
                    samples.append((step, "\n".join(current)))
                    current = None
                else:
                    current.append(line)
                continue
            m = re.match(r"\s*step\s+(\d+)", line)
            if m:
                step = int(m.group(1))
            if line.startswith("sample: "):
                current = [line[len("sample: "):]]
    return samples


# ----------------------------------------------------------------------------------------------
# The page

CSS = """
body { font: 14px/1.45 system-ui, -apple-system, "Segoe UI", sans-serif; margin: 24px auto; max-width: 1180px; color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin: 0 0 4px; } h2 { font-size: 17px; margin: 28px 0 8px; border-bottom: 1px solid #ddd; padding-bottom: 4px; }
.sub { color: #666; margin: 0 0 14px; }
.cards { display: flex; flex-wrap: wrap; gap: 10px; }
.card { border: 1px solid #ddd; border-radius: 6px; padding: 8px 12px; min-width: 120px; }
.card b { display: block; font-size: 18px; } .card span { color: #666; font-size: 12px; }
.plots { display: flex; flex-wrap: wrap; gap: 14px; }
svg.plot { background: #fff; border: 1px solid #e4e4e4; border-radius: 4px; max-width: 100%; height: auto; }
svg .title { font-size: 13px; font-weight: 600; fill: #222; } svg .tick { font-size: 11px; fill: #555; }
svg .label { font-size: 12px; fill: #333; } svg .legend text { font-size: 11px; fill: #333; }
svg .inbox { font-size: 10px; fill: #fff; pointer-events: none; }
svg .frame { fill: none; stroke: #ccc; } svg .grid { stroke: #eee; } svg .axis { stroke: #999; }
svg .line { fill: none; stroke-width: 1.3; } svg .hline { stroke-dasharray: 5,3; stroke-width: 1.5; }
table { border-collapse: collapse; font-size: 13px; } td, th { border: 1px solid #e2e2e2; padding: 3px 8px; text-align: left; vertical-align: top; }
th { background: #f6f6f6; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f7f7f7; border: 1px solid #e4e4e4; padding: 8px 10px; white-space: pre-wrap; word-break: break-word; }
.note { color: #666; font-size: 13px; } .bad { color: #b00020; }
#report-check { color: #888; font-size: 12px; margin-top: 30px; }
"""

# The page's own check (no library): every plot must hold drawn marks; the verdict goes into the page
# (#report-check), where a headless browser's --dump-dom shows it, and a script error leaves it unset.
SCRIPT = """
(function () {
  var plots = document.querySelectorAll("svg.plot"), empty = [];
  for (var i = 0; i < plots.length; i++) {
    var box = plots[i].getBBox();
    if (!plots[i].querySelector(".mark") || box.width <= 0 || box.height <= 0) empty.push(plots[i].getAttribute("data-name"));
  }
  var names = Array.prototype.map.call(plots, function (p) { return p.getAttribute("data-name"); });
  var check = document.getElementById("report-check");
  check.textContent = empty.length ? "report broken: empty plots " + empty.join(", ")
                                   : "report ok: " + plots.length + " plots (" + names.join(", ") + ")";
  check.setAttribute("data-state", empty.length ? "broken" : "ok");
})();
"""


def median(xs):
    xs = sorted(xs)
    return xs[len(xs) // 2] if xs else None


def build(run_dir, log_path, run, series, estimate, estimate_note, traces, samples):
    steps = [series["step"][s] for s in sorted(series["step"])]
    vals = [series["val"][s] for s in sorted(series["val"])]
    hs = [series["hellaswag"][s] for s in sorted(series["hellaswag"])]
    cfg, plan, flags = (run or {}).get("config", {}), (run or {}).get("plan", {}), (run or {}).get("flags", {})
    trainer = (run or {}).get("trainer", "?")
    name = os.path.basename(os.path.abspath(run_dir))
    body = [f"<h1>run report: {esc(name)}</h1>",
            f'<p class="sub">{esc(os.path.abspath(run_dir))} &middot; {esc(trainer)} trainer &middot; '
            f'{esc((run or {}).get("version", ""))} &middot; started {esc((run or {}).get("time", "?"))}'
            f'{" &middot; resumed at step " + esc(run.get("start_step")) if run and run.get("start_step") else ""}</p>']

    # ---- the numbers first
    cards = []
    if steps:
        cards.append((f"{steps[-1]['step']:,}", "steps"))
        cards.append((f"{steps[-1].get('tokens', 0):,}", "tokens seen"))
        cards.append((f"{steps[-1]['loss']:.4f}" if steps[-1].get("loss") is not None else "-", "last training loss"))
    if vals:
        best = min(vals, key=lambda r: r["val_loss"] if r.get("val_loss") is not None else math.inf)
        cards.append((f"{vals[-1]['val_loss']:.4f}", f"last val loss (step {vals[-1]['step']})"))
        cards.append((f"{best['val_loss']:.4f}", f"best val loss (step {best['step']})"))
    tok_s = median([r["tok_s"] for r in steps if r.get("tok_s") is not None])
    ms = median([r["ms"] for r in steps if r.get("ms") is not None])
    mfu = [r["mfu"] for r in steps if r.get("mfu") is not None]
    if tok_s:
        cards.append((f"{tok_s:,.0f}", "tokens/s (median step)"))
    if ms:
        cards.append((f"{ms:,.1f} ms", "per step (median)"))
    if mfu:
        cards.append((f"{median(mfu):.1f}%", "MFU (median step)"))
    if cfg.get("params"):
        cards.append((f"{cfg['params'] / 1e6:,.2f}M", "parameters"))
    body.append('<div class="cards">' + "".join(f"<div class='card'><b>{esc(v)}</b><span>{esc(k)}</span></div>"
                                                 for v, k in cards) + "</div>")

    # ---- loss
    body.append("<h2>Loss</h2><div class='plots'>")
    body.append(line_chart("loss", "loss", [
        {"label": "training", "colour": PALETTE[0], "points": [(r["step"], r.get("loss")) for r in steps]},
        {"label": "validation", "colour": PALETTE[1], "points": [(r["step"], r.get("val_loss")) for r in vals], "dots": True}],
        "step", "loss (nats per token)"))
    if hs:
        body.append(line_chart("hellaswag", "HellaSwag accuracy", [
            {"label": "acc", "colour": PALETTE[2], "points": [(r["step"], r.get("acc")) for r in hs], "dots": True},
            {"label": "acc_sum", "colour": PALETTE[4], "points": [(r["step"], r.get("acc_sum")) for r in hs], "dots": True}],
            "step", "accuracy"))
    body.append("</div>")

    # ---- speed
    if steps:
        body.append("<h2>Speed</h2><div class='plots'>")
        body.append(line_chart("throughput", "throughput", [
            {"label": "tokens/s", "colour": PALETTE[2], "points": [(r["step"], r.get("tok_s")) for r in steps]}], "step", "tokens/s"))
        notes = []
        if mfu:
            body.append(line_chart("mfu", "model FLOPs utilisation", [
                {"label": "MFU", "colour": PALETTE[3], "points": [(r["step"], r.get("mfu")) for r in steps]}], "step", "MFU (%)"))
        elif cfg.get("params") and all(k in cfg for k in ("L", "C", "T")):
            per_token = 6 * cfg["params"] + 6 * cfg["L"] * cfg["C"] * cfg["T"]
            body.append(line_chart("flops", "model FLOP/s implied by the step times", [
                {"label": "GFLOP/s", "colour": PALETTE[3],
                 "points": [(r["step"], r["tok_s"] * per_token / 1e9 if r.get("tok_s") else None) for r in steps]}],
                "step", "GFLOP/s (6N + 6LCT per token)"))
            notes.append("No MFU or FMA share in this log: the CPU trainer knows no peak to divide by (its --profile "
                         "prints each kind of work's share of a measured SGEMM ceiling, on the terminal). The plot "
                         "shows the model FLOP/s the step times imply instead.")
        body.append("</div>")
        body += [f"<p class='note'>{esc(n)}</p>" for n in notes]

        body.append("<h2>Optimizer</h2><div class='plots'>")
        body.append(line_chart("lr", "learning rate", [
            {"label": "lr", "colour": PALETTE[4], "points": [(r["step"], r.get("lr")) for r in steps]}], "step", "learning rate"))
        body.append(line_chart("norm", "gradient norm (before clipping)", [
            {"label": "norm", "colour": PALETTE[5], "points": [(r["step"], r.get("norm")) for r in steps]}], "step", "global L2 norm"))
        body.append("</div>")

    # ---- memory
    mem = [(r["step"], r.get("mem_mb")) for r in steps if r.get("mem_mb") is not None]
    if mem or estimate:
        body.append("<h2>Memory</h2><div class='plots'>")
        what = "peak resident memory" if trainer == "cpu" else "device memory in use"
        kinds = ["params", "grads", "master", "optimizer", "activations", "workspace"]
        rank0 = estimate[0][1] if estimate else {}  # (rank 0 comes first; it is the rank that logs)
        hlines = [(rank0["total"] / 2**20, "--estimate total (rank 0)", PALETTE[3])] if "total" in rank0 else []
        if mem:
            body.append(line_chart("memory", f"memory per step: {what} (rank 0)", [
                {"label": what, "colour": PALETTE[0], "points": mem}], "step", "MiB", hlines))
        if estimate:
            bars = [(f"--estimate, {r}", [(k, e[k] / 2**20, PALETTE[i % len(PALETTE)]) for i, k in enumerate(kinds) if e.get(k)])
                    for r, e in estimate]
            if mem:
                bars.append((f"measured, rank 0", [(f"measured ({'peak RSS' if trainer == 'cpu' else 'in use'})",
                                                    max(v for _, v in mem), "#999999")]))
            body.append(bar_chart("memory-by-kind", "memory by kind: the estimate against the measurement", bars, "MiB"))
        body.append("</div>")
        if estimate:
            head = "".join(f"<th>{esc(r)} (MiB)</th>" for r, _ in estimate)
            rows = "".join(f"<tr><td>{esc(k)}</td>" + "".join(f"<td class='num'>{e.get(k, 0) / 2**20:,.1f}</td>"
                                                               for _, e in estimate) + "</tr>" for k in kinds + ["total"])
            body.append(f"<table><tr><th>kind (--estimate)</th>{head}</tr>{rows}</table>")
            if trainer == "cpu":
                body.append("<p class='note'>Peak resident memory also holds the program, the data loader's buffers and "
                            "the tokenizer, which the estimate does not count.</p>")
        else:
            body.append(f"<p class='note'>No estimate: {esc(estimate_note)}</p>")

    # ---- pipeline
    if traces:
        body.append("<h2>Pipeline timeline</h2>")
        ranks = load_spans(traces)
        if ranks:
            last = max(s[3] for spans in ranks.values() for s in spans)
            ranks = {r: [s for s in spans if s[3] == last] for r, spans in ranks.items()}
            if all(any(is_compute(s[0]) for s in spans) for spans in ranks.values()):
                svg, idle, span = timeline_chart(ranks, last)
                body.append(svg)
                body.append(f"<p class='note'>From {esc(', '.join(traces))}. Hover a box for its span.</p>")
            else:
                body.append(f"<p class='note'>Step {last} is not in every trace file: no timeline drawn.</p>")
        else:
            body.append("<p class='note'>The trace files hold no spans.</p>")

    # ---- samples
    body.append("<h2>Samples</h2>")
    if samples:
        body += [f"<p><b>after step {s:,}</b></p><pre>{esc(text)}</pre>" for s, text in samples]
    else:
        body.append(f"<p class='note'>None found: samples are read from the run's printed output "
                    f"({esc(log_path or 'RUN_DIR/train.log')}; scripts/run.sh writes it, or pass --log FILE).</p>")

    # ---- options
    body.append("<h2>Options</h2>")
    if run:
        body.append("<table><tr><th>model</th><td>" + esc(run.get("model", "")) + "</td></tr>" +
                    "".join(f"<tr><th>{esc(k)}</th><td>{esc(v)}</td></tr>" for k, v in cfg.items()) + "</table><br>")
        body.append("<table><tr><th colspan=2>plan</th></tr>" +
                    "".join(f"<tr><td>{esc(k)}</td><td class='num'>{esc(v)}</td></tr>" for k, v in plan.items()) + "</table>")
        body.append(f"<details><summary>every flag ({len(flags)})</summary><table>" +
                    "".join(f"<tr><td>--{esc(k)}</td><td>{esc(json.dumps(v) if not isinstance(v, str) else v)}</td></tr>"
                            for k, v in flags.items()) + "</table></details>")
    else:
        body.append("<p class='note'>The log has no \"run\" record.</p>")

    body.append('<p id="report-check" data-state="no-script">report: the page script did not run</p>')
    return ("<!DOCTYPE html>\n<html lang=\"en\"><head><meta charset=\"utf-8\">"
            f"<title>run report: {esc(name)}</title><style>{CSS}</style></head>\n<body>\n" + "\n".join(body) +
            f"\n<script>{SCRIPT}</script>\n</body></html>\n")


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("run_dir", help="the run's --out-dir (holding metrics.jsonl)")
    ap.add_argument("-o", "--out", help="the HTML file to write (default RUN_DIR/report.html)")
    ap.add_argument("--trainer", help="the trainer binary whose --estimate the memory section compares with "
                                      "(default: ./train_gpt_cpu or ./train_gpt of this checkout, by the log's trainer)")
    ap.add_argument("--log", help="the run's printed output, for the samples (default RUN_DIR/train.log)")
    ap.add_argument("--trace", nargs="+", help="the run's --trace files (default: the run's --trace flag, else RUN_DIR/*trace*.json)")
    a = ap.parse_args()
    if not os.path.isdir(a.run_dir):
        sys.exit(f"error: '{a.run_dir}' is not a folder: pass a run's --out-dir")
    path, run, series = read_log(a.run_dir)  # (one line and exit 1 for a missing or broken log)
    trainer = a.trainer or os.path.join(ROOT, "train_gpt_cpu" if (run or {}).get("trainer") == "cpu" else "train_gpt")
    estimate, note = run_estimate(trainer, run) if run else (None, "the log has no \"run\" record")
    traces = find_traces(a.run_dir, run, a.trace)
    log_path = a.log or os.path.join(a.run_dir, "train.log")
    page = build(a.run_dir, log_path, run, series, estimate, note, traces, read_samples(log_path))
    out = a.out or os.path.join(a.run_dir, "report.html")
    tmp = out + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(page)
    os.replace(tmp, out)
    print(f"report: {out}")


if __name__ == "__main__":
    main()
