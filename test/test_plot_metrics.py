#!/usr/bin/env python3
"""test_plot_metrics.py — scripts/plot_metrics.py turns metrics logs into one PNG.

  picture    two logs (one a run directory, one a file) -> a PNG of the size the panels imply:
             two panels (loss, throughput), three when a log has HellaSwag records
  resume     a step logged twice (a resumed run repeats the steps after its checkpoint) counts once,
             with the later value; a half-written last line is ignored
  errors     a broken line names the file and the line; a missing log and a bad --labels exit 1
  as written `scripts/plot_metrics.py` runs (executable; its #! line is the Python with matplotlib);
             a Python without matplotlib is told in one line to use /usr/bin/python3
"""
import json, os, shutil, struct, subprocess, sys, tempfile
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLOT = os.path.join(ROOT, "scripts", "plot_metrics.py")


def write_log(path, records, tail=""):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
        f.write(tail)


def steps(first, last, loss0, tokens_per_step=1024):
    return [{"type": "step", "step": s, "tokens": s * tokens_per_step, "loss": loss0 / s, "lr": 1e-3, "norm": 1.0,
             "ms": 10.0, "tok_s": 1000.0 + s, "mfu": None, "mem_mb": 100.0} for s in range(first, last + 1)]


def png_size(path):
    data = open(path, "rb").read(24)
    return (struct.unpack(">II", data[16:24]) if data[:8] == b"\x89PNG\r\n\x1a\n" else None)


def run(args):
    return subprocess.run(["/usr/bin/python3", PLOT] + args, capture_output=True, text=True)


def main():
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("SKIP: plot_metrics (python3-matplotlib is not installed: scripts/setup.sh --tests)")
        return 0
    tmp = tempfile.mkdtemp(prefix="llmc_plot_")
    run_a = os.path.join(tmp, "run_a", "metrics.jsonl")
    # run_a: 10 steps, interrupted after 8 with a checkpoint at 6, resumed: steps 7-10 logged again
    first = steps(1, 8, 10.0)
    resumed = [dict(r, loss=r["loss"] - 0.5) for r in steps(7, 10, 10.0)]
    write_log(run_a, [{"type": "run", "start_step": 0}] + first + [{"type": "val", "step": 5, "val_loss": 3.0}]
              + [{"type": "run", "start_step": 6}] + resumed + [{"type": "val", "step": 10, "val_loss": 2.0}],
              tail='{"type": "step", "st')
    run_b = os.path.join(tmp, "b.jsonl")
    write_log(run_b, steps(1, 5, 8.0, 2048))
    png = os.path.join(tmp, "out.png")
    p = run([os.path.dirname(run_a), run_b, "-o", png, "--x", "tokens"])
    lines = p.stdout.splitlines()
    report(p.returncode == 0 and png_size(png) == (1040, 380), "two logs -> a two-panel PNG (1040x380)",
           f"{p.returncode} {png_size(png)} {p.stderr}")
    report(len(lines) == 3 and lines[0] == f"run_a: 10 steps, loss 10.0000 -> 0.5000, median 1006 tok/s, val loss 2.0000 at step 10",
           "a repeated step counts once, with the resumed run's value; a half-written last line is ignored", f"{lines}")
    write_log(run_b, steps(1, 5, 8.0) + [{"type": "hellaswag", "step": 5, "acc": 0.3, "acc_sum": 0.28, "correct": 3, "examples": 10}])
    p = run([run_b, "-o", png, "--labels", "mine", "--title", "test"])
    report(p.returncode == 0 and png_size(png) == (1560, 380) and "mine: 5 steps" in p.stdout and "hellaswag 30.00%" in p.stdout,
           "a log with HellaSwag records adds a third panel", f"{png_size(png)} {p.stdout} {p.stderr}")

    broken = os.path.join(tmp, "broken.jsonl")
    write_log(broken, steps(1, 2, 5.0), tail="{oops}\n" + json.dumps(steps(3, 3, 5.0)[0]) + "\n")
    for args, needle, name in [([broken], f"{broken}:3: not valid JSON", "a broken line names the file and line"),
                               ([os.path.join(tmp, "nowhere")], "no metrics log at", "a missing log"),
                               ([run_b, "--labels", "a,b"], "--labels has 2 labels for 1 logs", "--labels of the wrong length")]:
        p = run(args + ["-o", os.path.join(tmp, "x.png")])
        report(p.returncode == 1 and p.stderr.startswith("error: ") and needle in p.stderr and not os.path.exists(os.path.join(tmp, "x.png")),
               f"bad input: {name}", p.stderr)

    # ---- run as the docs write it: `scripts/plot_metrics.py ...` (its #! line names the Python with
    # matplotlib); a Python without it (here: -S, no site-packages) is told in one line which to use
    p = subprocess.run([PLOT, run_b, "-o", png], capture_output=True, text=True)
    report(p.returncode == 0 and png_size(png) is not None, "scripts/plot_metrics.py runs as written (executable, #! finds matplotlib)",
           f"exit {p.returncode}: {p.stderr[-300:]}")
    p = subprocess.run(["/usr/bin/python3", "-S", PLOT, run_b, "-o", os.path.join(tmp, "y.png")], capture_output=True, text=True)
    report(p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and "matplotlib is missing" in p.stderr
           and "/usr/bin/python3" in p.stderr, "a Python without matplotlib: one line naming the Python to use", p.stderr)
    shutil.rmtree(tmp)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
