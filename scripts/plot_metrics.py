#!/usr/bin/python3
"""plot_metrics.py — training curves from one or more metrics logs, as one PNG.

    scripts/plot_metrics.py out/run1 out/run2/metrics.jsonl -o curves.png [--x tokens] [--labels a,b]

Each argument is a metrics.jsonl written by a trainer (llmc/run/metrics.h) or the --out-dir holding
one. The picture has a panel for the training loss (thin) with the validation loss (dots), one for
throughput (tokens/s), and one for HellaSwag accuracy when a log has it; the x axis is the step or,
with --x tokens, the tokens seen (what compares runs of different batch sizes). A resumed run
appends to its log and may repeat the steps after its checkpoint: the last record of a step wins,
as it is the one the final model descends from. Prints one summary line per log.

Needs matplotlib (Debian: python3-matplotlib; scripts/setup.sh --tests installs it), except
--terminal, which draws the loss of each log as characters on the terminal (what scripts/run.sh
shows at the end of the main job on any machine): the training loss as '.' (the mean of the steps
falling in each column, since one batch's loss is noisy), the validation loss as 'o'.
"""
import argparse, json, os, sys


def fail(message):
    print(f"error: {message}", file=sys.stderr)
    sys.exit(1)


def read_log(path):
    """{type: {step: record}} with later records of a step replacing earlier ones, and the last 'run' record."""
    if os.path.isdir(path):
        path = os.path.join(path, "metrics.jsonl")
    if not os.path.isfile(path):
        fail(f"no metrics log at '{path}': pass a metrics.jsonl or the --out-dir of a run")
    series, run = {"step": {}, "val": {}, "hellaswag": {}}, None
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                if number > 1 and not line.endswith("\n"):
                    break  # the last line of a log still being written (or cut by a crash)
                fail(f"{path}:{number}: not valid JSON ({e.msg} at column {e.colno})")
            kind = record.get("type") if isinstance(record, dict) else None
            if kind == "run":
                run = record
            elif kind in series:
                if not isinstance(record.get("step"), int):
                    fail(f"{path}:{number}: a '{kind}' record without an integer 'step'")
                series[kind][record["step"]] = record
    if not series["step"] and not series["val"] and not series["hellaswag"]:
        fail(f"{path} has no step, val or hellaswag records")
    return path, run, series


def terminal_plot(path, series, width=64, height=14):
    """The loss curve as text: rows are loss values (top = highest), columns are steps."""
    steps = sorted(series["step"])
    vals = sorted(series["val"])
    if not steps and not vals:
        return
    last = max(steps[-1:] + vals[-1:])
    columns = {}  # column -> training losses of the steps that fall in it
    for s in steps:
        columns.setdefault(min(width - 1, s * width // (last + 1)), []).append(series["step"][s]["loss"])
    train = {c: sum(v) / len(v) for c, v in columns.items()}
    val = {min(width - 1, s * width // (last + 1)): series["val"][s]["val_loss"] for s in vals}
    points = list(train.values()) + list(val.values())
    top, bottom = max(points), min(points)
    span = (top - bottom) or 1.0
    grid = [[" "] * width for _ in range(height)]
    for marks, char in ((train, "."), (val, "o")):
        for c, y in marks.items():
            grid[round((top - y) / span * (height - 1))][c] = char
    print(f"loss of {path} ('.' training, mean per column; 'o' validation)")
    for r, row in enumerate(grid):
        label = f"{top - r * span / (height - 1):6.2f}" if r in (0, height // 2, height - 1) else " " * 6
        print(f"{label} |{''.join(row)}")
    print(" " * 7 + "+" + "-" * width)
    print(" " * 8 + f"step 0{' ' * (width - 6 - len(str(last)) - 5)}step {last}")


def label_for(path):
    directory = os.path.dirname(os.path.abspath(path))
    return os.path.basename(directory) or path


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("logs", nargs="+", help="metrics.jsonl files or run directories")
    parser.add_argument("-o", "--output", default="metrics.png", help="the PNG to write (default metrics.png)")
    parser.add_argument("--x", choices=["step", "tokens"], default="step", help="x axis: optimizer steps or tokens seen")
    parser.add_argument("--labels", help="comma-separated legend labels, one per log (default: each log's folder name)")
    parser.add_argument("--title", default="", help="a title above the panels")
    parser.add_argument("--terminal", action="store_true", help="draw the loss curves as text instead (no matplotlib needed)")
    args = parser.parse_args()
    if args.terminal:
        for p in args.logs:
            path, _, series = read_log(p)
            terminal_plot(path, series)
        return
    labels = args.labels.split(",") if args.labels else None
    if labels and len(labels) != len(args.logs):
        fail(f"--labels has {len(labels)} labels for {len(args.logs)} logs")
    try:
        import matplotlib
        matplotlib.use("Agg")  # files only: no display needed
        import matplotlib.pyplot as plt
    except ImportError:
        fail(f"matplotlib is missing from this Python ({sys.executable}): run it with /usr/bin/python3, which "
             "scripts/setup.sh --tests gives python3-matplotlib (`scripts/plot_metrics.py ...` does), or use --terminal")

    logs = [read_log(p) for p in args.logs]
    has_hellaswag = any(series["hellaswag"] for _, _, series in logs)
    panels = 3 if has_hellaswag else 2
    fig, axes = plt.subplots(1, panels, figsize=(5.2 * panels, 3.8), dpi=100)
    xlabel = "tokens" if args.x == "tokens" else "step"
    for i, (path, run, series) in enumerate(logs):
        label = labels[i] if labels else label_for(path)
        color = f"C{i % 10}"
        x_of = lambda rec: rec.get("tokens", 0) if args.x == "tokens" else rec["step"]
        steps = [series["step"][s] for s in sorted(series["step"])]
        vals = [series["val"][s] for s in sorted(series["val"])]
        if steps:
            axes[0].plot([x_of(r) for r in steps], [r["loss"] for r in steps], color=color, lw=0.8, alpha=0.6,
                         label=f"{label} train")
            speed = [(x_of(r), r["tok_s"]) for r in steps if r.get("tok_s") is not None]
            axes[1].plot([s[0] for s in speed], [s[1] for s in speed], color=color, lw=0.8, label=label)
        if vals:
            axes[0].plot([x_of(r) for r in vals], [r["val_loss"] for r in vals], "o-", color=color, ms=3, lw=1.2,
                         label=f"{label} val")
        if has_hellaswag and series["hellaswag"]:
            hs = [series["hellaswag"][s] for s in sorted(series["hellaswag"])]
            axes[2].plot([x_of(r) for r in hs], [100 * r["acc"] for r in hs], "o-", color=color, ms=3, label=label)
        # one summary line per log
        summary = f"{label}: {len(steps)} steps"
        if steps:
            tok_s = sorted(r["tok_s"] for r in steps if r.get("tok_s") is not None)
            summary += f", loss {steps[0]['loss']:.4f} -> {steps[-1]['loss']:.4f}"
            if tok_s:
                summary += f", median {tok_s[len(tok_s) // 2]:.0f} tok/s"
        if vals:
            summary += f", val loss {vals[-1]['val_loss']:.4f} at step {vals[-1]['step']}"
        if series["hellaswag"]:
            last = series["hellaswag"][max(series["hellaswag"])]
            summary += f", hellaswag {100 * last['acc']:.2f}%"
        print(summary)
    axes[0].set(title="loss", xlabel=xlabel, ylabel="cross-entropy (nats/token)")
    axes[1].set(title="throughput", xlabel=xlabel, ylabel="tokens/s")
    axes[1].set_ylim(bottom=0)
    if has_hellaswag:
        axes[2].set(title="HellaSwag", xlabel=xlabel, ylabel="accuracy (%)")
        axes[2].axhline(25, color="gray", lw=0.8, ls="--", label="chance")
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    if args.title:
        fig.suptitle(args.title, fontsize=10)
    fig.tight_layout()
    tmp = args.output + ".tmp.png"  # written whole, then renamed: a reader never sees half a PNG
    fig.savefig(tmp)
    os.replace(tmp, args.output)
    print(f"wrote {args.output}")


if __name__ == "__main__":
    main()
