#!/usr/bin/python3
"""plot_pipeline.py — draw the trainers' --trace files as a pipeline timeline (PNG).

    mpirun -np 2 ./train_gpt_cpu ... --pipeline-parallel 2 --trace trace.json   # trace.rank0.json, trace.rank1.json
    scripts/plot_pipeline.py trace.rank*.json -o pipeline.png [--step N]

One row per rank (stage), rank 0 on top; forwards and backwards as coloured boxes with the
micro-batch on them, waits in receives and sends as thin grey boxes, the gradient sums and the
optimizer in their own colours. Idle time is the white between boxes: that is the bubble.

Prints, per rank, the measured bubble of the step: the share of the step's span (first compute
start to last compute end over all ranks) in which that rank ran no forward or backward. With
sleep-injected compute (LLMC_TEST_PIPE_DELAY_MS) it approaches the schedule's prediction,
(p-1)/(m+p-1) for GPipe and 1F1B, (p-1)/(vm+p-1) for interleaved 1F1B (whose later chunks' spans,
F3c1, are drawn lighter).

--step: which optimizer step to draw (default: the last one traced; the first pays start-up costs).
"""
import argparse, json, re, sys

COLOURS = {"F": "#4c72b0", "B": "#dd8452", "W": "#c44e52", "gradient sums": "#55a868", "optimizer": "#8172b2"}
LATER_CHUNK = {"F": "#8fb1e0", "B": "#f0b890"}  # interleaved 1F1B: the spans of model chunks 1, 2, ... (F3c1)


def load_spans(paths):
    """{rank: [(name, start_us, dur_us, step)]} from the trace files, each sorted by start."""
    ranks = {}
    for path in paths:
        try:
            with open(path) as f:
                events = json.load(f)["traceEvents"]
        except (OSError, ValueError, KeyError) as e:
            sys.exit(f"error: cannot read the trace '{path}': {e}")
        for e in events:
            if e.get("ph") == "X":
                ranks.setdefault(e["pid"], []).append((e["name"], e["ts"], e["dur"], e.get("args", {}).get("step", 0)))
    for spans in ranks.values():
        spans.sort(key=lambda s: s[1])
    return ranks


def is_compute(name):
    # W: ZB-H1's weight-gradient passes; F3c1: interleaved's forward of micro-batch 3 on chunk 1 (pipeline_schedule.h)
    return re.fullmatch(r"[FBW]\d+(c\d+)?", name) is not None


def colour(name):
    chunk = re.search(r"c(\d+)$", name)
    return LATER_CHUNK[name[0]] if chunk and int(chunk.group(1)) > 0 else COLOURS[name[0]]


def bubbles(ranks):
    """{rank: idle share} over the span from the first compute start to the last compute end (all ranks)."""
    compute = {r: [s for s in spans if is_compute(s[0])] for r, spans in ranks.items()}
    start = min(s[1] for spans in compute.values() for s in spans)
    end = max(s[1] + s[2] for spans in compute.values() for s in spans)
    return {r: 1.0 - sum(s[2] for s in spans) / (end - start) for r, spans in compute.items()}, start, end


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("traces", nargs="+", help="the --trace files of one run (one per rank)")
    ap.add_argument("-o", "--out", required=True, help="the PNG to write")
    ap.add_argument("--step", type=int, default=0, help="the optimizer step to draw (0 = the last traced)")
    ap.add_argument("--title", default="", help="a title above the rows")
    a = ap.parse_args()

    ranks = load_spans(a.traces)
    if not ranks:
        sys.exit("error: the trace files hold no spans: was the run given --trace and did it train a step?")
    step = a.step or max(s[3] for spans in ranks.values() for s in spans)
    ranks = {r: [s for s in spans if s[3] == step] for r, spans in ranks.items()}
    if not all(any(is_compute(s[0]) for s in spans) for spans in ranks.values()):
        sys.exit(f"error: step {step} is not in every trace: choose a traced step with --step")
    idle, t0, t1 = bubbles(ranks)

    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        sys.exit(f"error: matplotlib is missing from this Python ({sys.executable}): run it with /usr/bin/python3, which "
                 "scripts/setup.sh --tests gives python3-matplotlib (`scripts/plot_pipeline.py ...` does)")
    order = sorted(ranks)
    fig, ax = plt.subplots(figsize=(10, 0.6 + 0.5 * len(order)), dpi=80)
    for row, r in enumerate(order):
        y = len(order) - 1 - row
        for name, ts, dur, _ in ranks[r]:
            x, w = (ts - t0) / 1000, dur / 1000
            if is_compute(name):
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=colour(name), edgecolors="white")
                ax.text(x + w / 2, y, name, ha="center", va="center", color="white", fontsize=8 if len(name) < 4 else 6)
            elif name in COLOURS:
                ax.broken_barh([(x, w)], (y - 0.4, 0.8), facecolors=COLOURS[name], edgecolors="white")
            else:  # receives, sends: time spent waiting on a neighbour
                ax.broken_barh([(x, w)], (y - 0.1, 0.2), facecolors="#bbbbbb")
    ax.set_yticks(range(len(order)))
    ax.set_yticklabels([f"rank {r}\nbubble {100 * idle[r]:.0f}%" for r in reversed(order)], fontsize=8)
    ax.set_xlabel(f"ms since step {step}'s first forward")
    if a.title:
        ax.set_title(a.title, fontsize=9)
    fig.tight_layout()
    fig.savefig(a.out)
    for r in order:
        print(f"rank {r}: bubble {100 * idle[r]:.1f}% of step {step}'s {(t1 - t0) / 1000:.1f} ms")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
