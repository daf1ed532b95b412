#!/usr/bin/env python3
"""measure_memory.py — the GPU trainer's memory: predicted by --estimate, measured by CUDA.

For each model, micro-batch and recompute level:
  predicted  `train_gpt ... --estimate`: the total of rank 0's size table (llmc/memory/gpu_buffers.h), computed
             on the host before anything is allocated; cuDNN's workspace is its pre-plan bound there
  table      the same table as the trainer really allocated it (cuDNN's workspace as its plans ask)
  measured   what cudaMemGetInfo says the run took: peak in use minus in use before allocation (the
             trainer's 'GPU memory bytes:' line; the peak is sampled after allocation, after the first
             step and at the end: every buffer is allocated up front, nothing is allocated later)
  error      predicted / measured - 1 (the issue's bar: within 5%)
A run that does not fit is recorded as such (the trainer refuses it before allocating).

    scripts/measure_memory.py                    on a GPU: d12 and d24, B = 1..16, recompute 0..2
    scripts/measure_memory.py --predict-only     anywhere: predictions only (no GPU needed)

Writes <out>/memory_measured.{csv,md,svg} (or memory_predicted.* with --predict-only); the plot needs
gnuplot and is skipped with a note without it (re-plot later with --plot-only CSV).
"""
import argparse, array, csv, os, re, shutil, subprocess, sys, tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GIB = 1 << 30


def run(cmd, timeout):
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
        return p.returncode, p.stdout, p.stderr
    except subprocess.TimeoutExpired:
        return 124, "", f"timed out after {timeout} s"


def predicted_bytes(trainer, flags):
    """rank 0's table total and the GPU margin, from --estimate."""
    code, out, err = run([trainer] + flags + ["--estimate"], 120)
    m = re.search(r"^\s+ranks? 0(?:-\d+)?: .*\btotal=(\d+)", out, re.M)
    if code != 0 or not m:
        raise RuntimeError(f"{' '.join([trainer] + flags)} --estimate failed ({code}): {err.strip()[-300:]}")
    margin = re.search(r"\+ ([0-9.]+) (MiB|GiB) for the CUDA context", out)
    margin_bytes = 0 if not margin else float(margin.group(1)) * (GIB if margin.group(2) == "GiB" else 1 << 20)
    return int(m.group(1)), int(margin_bytes)


def measured_bytes(trainer, flags, data, steps, timeout):
    """(table, before, peak, peak - before) from the trainer's 'GPU memory bytes:' line, or a reason."""
    cmd = [trainer] + flags + ["--train-data", data, "--val-data", "none", "--steps", str(steps),
                               "--sample-every", "0", "--checkpoint-every", "0"]
    code, out, err = run(cmd, timeout)
    m = re.search(r"GPU memory bytes: table (\d+), in use before allocation (\d+), peak in use (\d+), "
                  r"peak minus before (\d+)", out)
    if code == 0 and m:
        return tuple(int(x) for x in m.groups()), ""
    if "largest micro-batch that fits" in err or "not even --batch-size 1 fits" in err or "out of GPU memory" in err:
        return None, "does not fit"
    return None, f"failed ({code}): {(err or out).strip().splitlines()[-1][:200] if (err or out).strip() else ''}"


def write_shard(path, tokens, vocab=50257):
    """A shard of random tokens in llm.c's format (header of 256 int32, then uint16 tokens)."""
    header = array.array("i", [0] * 256)
    header[0], header[1], header[2] = 20240520, 1, tokens
    raw = os.urandom(2 * tokens)
    body = array.array("H", raw)
    for i in range(len(body)):
        body[i] %= vocab
    with open(path, "wb") as f:
        header.tofile(f)
        body.tofile(f)


def plot(csv_path, svg_path, measured):
    if not shutil.which("gnuplot"):
        print(f"note: no gnuplot here: plot later with  {sys.argv[0]} --plot-only {csv_path}")
        return False
    rows = list(csv.DictReader(open(csv_path)))
    models = sorted({r["model"] for r in rows}, key=lambda m: int(m[1:]) if m[1:].isdigit() else 0)
    work = tempfile.mkdtemp(prefix="llmc_plot_")
    series = []
    for model in models:
        for level in sorted({r["recompute"] for r in rows}):
            pts = [r for r in rows if r["model"] == model and r["recompute"] == level]
            path = os.path.join(work, f"{model}_{level}.dat")
            with open(path, "w") as f:
                for r in sorted(pts, key=lambda r: int(r["B"])):
                    meas = r.get("measured_bytes") or ""
                    f.write(f"{r['B']} {int(r['predicted_bytes']) / GIB:.4f} "
                            f"{int(meas) / GIB if meas else 'NaN'}\n")
            series.append((model, level, path))
    kind = "predicted (lines) and measured (points)" if measured else "PREDICTED by --estimate, not measured"
    script = [
        "set terminal svg size 900,560 dynamic font 'sans,12'",
        f"set output '{svg_path}'",
        f"set title 'GPU trainer memory per micro-batch, T=1024, bf16: {kind}'",
        "set xlabel 'micro-batch B'", "set ylabel 'GiB (rank 0 buffers)'", "set logscale x 2",
        "set key top left", "set grid",
    ]
    plots = []  # a colour per model, a point shape per recompute level; measured: open circles
    for model, level, path in series:
        colour, shape = models.index(model) + 1, [7, 5, 9][int(level) % 3]
        plots.append(f"'{path}' using 1:2 with linespoints lc {colour} lw 1.5 pt {shape} ps 0.8 "
                     f"title '{model} recompute {level}'")
        if measured:
            plots.append(f"'{path}' using 1:3 with points lc {colour} pt 6 ps 1.6 notitle")
    script.append("plot " + ", ".join(plots))
    subprocess.run(["gnuplot"], input="\n".join(script), text=True, check=True)
    shutil.rmtree(work, ignore_errors=True)
    return True


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trainer", default=os.path.join(ROOT, "train_gpt"))
    ap.add_argument("--models", default="d12,d24")
    ap.add_argument("--batch-sizes", default="1,2,4,8,16")
    ap.add_argument("--recompute", default="0,1,2")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--timeout", type=int, default=300, help="seconds per training run")
    ap.add_argument("--out", default=os.path.join(ROOT, "docs"))
    ap.add_argument("--predict-only", action="store_true", help="no GPU: write the predictions only")
    ap.add_argument("--plot-only", metavar="CSV", help="re-plot an existing CSV")
    a = ap.parse_args()

    if a.plot_only:
        measured = any(r.get("measured_bytes") for r in csv.DictReader(open(a.plot_only)))
        plot(a.plot_only, a.plot_only[:-4] + ".svg", measured)
        return 0
    stem = "memory_predicted" if a.predict_only else "memory_measured"
    os.makedirs(a.out, exist_ok=True)
    data_dir = tempfile.mkdtemp(prefix="llmc_memory_")
    data = os.path.join(data_dir, "synthetic_train_000000.bin")
    if not a.predict_only:
        write_shard(data, 1 << 20)

    rows = []
    for model in a.models.split(","):
        for level in a.recompute.split(","):
            for B in a.batch_sizes.split(","):
                flags = ["--model", model, "--batch-size", B, "--seq-len", str(a.seq_len), "--recompute", level]
                pred, margin = predicted_bytes(a.trainer, flags)
                row = {"model": model, "recompute": level, "B": B, "T": a.seq_len, "predicted_bytes": pred,
                       "margin_bytes": margin, "table_bytes": "", "before_bytes": "", "peak_bytes": "",
                       "measured_bytes": "", "error_percent": "", "note": "predicted only" if a.predict_only else ""}
                if not a.predict_only:
                    got, why = measured_bytes(a.trainer, flags, data, a.steps, a.timeout)
                    if got:
                        table, before, peak, delta = got
                        row.update(table_bytes=table, before_bytes=before, peak_bytes=peak, measured_bytes=delta,
                                   error_percent=f"{100.0 * (pred / delta - 1):.2f}")
                        row["note"] = "within 5%" if abs(pred / delta - 1) <= 0.05 else "OFF BY MORE THAN 5%"
                    else:
                        row["note"] = why
                print(f"{model} recompute {level} B={B}: predicted {pred / GIB:.3f} GiB"
                      + (f", measured {row['measured_bytes'] / GIB:.3f} GiB ({row['error_percent']}%)"
                         if row["measured_bytes"] != "" else f" ({row['note']})"), flush=True)
                rows.append(row)
    shutil.rmtree(data_dir, ignore_errors=True)

    csv_path = os.path.join(a.out, stem + ".csv")
    with open(csv_path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        w.writeheader()
        w.writerows(rows)
    gib = lambda v: f"{v / GIB:.3f}" if v != "" else ""
    with open(os.path.join(a.out, stem + ".md"), "w") as f:
        if a.predict_only:
            f.write("PREDICTED by `train_gpt --estimate` (rank 0's buffer table, GiB; the device also needs the "
                    "CUDA context, for which the trainer keeps a 0.5 GiB margin). Nothing here was measured.\n\n")
        else:
            f.write("Measured on the GPU with cudaMemGetInfo (peak in use minus in use before allocation) "
                    "against the prediction of `train_gpt --estimate`, GiB.\n\n")
        f.write("| model | recompute | B | T | predicted | table as allocated | measured | error | note |\n")
        f.write("| --- | --- | --- | --- | --- | --- | --- | --- | --- |\n")
        for r in rows:
            err = f"{r['error_percent']}%" if r["error_percent"] != "" else ""
            f.write(f"| {r['model']} | {r['recompute']} | {r['B']} | {r['T']} | {gib(r['predicted_bytes'])} | "
                    f"{gib(r['table_bytes'])} | {gib(r['measured_bytes'])} | {err} | {r['note']} |\n")
    plot(csv_path, os.path.join(a.out, stem + ".svg"), not a.predict_only)
    print(f"wrote {csv_path} and {stem}.md" + ("" if not shutil.which("gnuplot") else f", {stem}.svg"))
    bad = [r for r in rows if r["note"].startswith("OFF") or r["note"].startswith("failed")]
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
