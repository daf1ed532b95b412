#!/usr/bin/env python3
"""test_pipeline_trace.py — the CPU trainer's --trace timeline and scripts/plot_pipeline.py.

A 2-stage 1F1B run with 4 micro-batches (the model and data of test_parallelism.py) and compute made
of sleeps (LLMC_TEST_PIPE_DELAY_MS: 20 ms forward, 40 ms backward), 2 steps, with --trace:
  - one file per rank (trace.rank0.json, trace.rank1.json), each valid JSON with "X" events;
  - each step's forwards and backwards on a stage come in exactly the order --pipeline-print-schedule
    prints for that stage (the trainer runs the schedule it prints, and the trace says which micro-batch);
  - spans on one rank never overlap (one thread, one action at a time);
  - the ranks share a clock: stage 1's F0 starts after stage 0's F0 ends (it needs its activations),
    and stage 0's B0 after stage 1's B0;
  - the sleeps show: every F lasts >= 20 ms and every B >= 40 ms;
  - scripts/plot_pipeline.py writes a PNG and prints each stage's bubble, 20% +- 10 points ((p-1)/(m+p-1));
    a missing trace file: one line, exit 1;
  - one rank writes FILE itself (no rank inserted), F0 B0 F1 B1 ... B3, the gradient sums, the optimizer;
  - --trace into a folder that does not exist yet: created (2 ranks at once, as a metrics log's folder
    is); under a regular file, a path no folder can be made at: one line, exit 1, before training;
  - the GPU trainer (the emulated build, build/emu/train_gpt, where make emu built it; host-staged), ZB-H1 on
    2 stages, 2 steps: each file parses, each stage's F, B and W spans in the printed order, no overlaps,
    receives, gradient sums and optimizer traced, one clock (its spans are host timestamps taken after the
    compute stream is synchronised: llmc/probes/trace.h).
Planted bugs it caught: spans named by the activation slot instead of the micro-batch (the order
checks: stage 0 traced F0 F1 B0 F0 ...), each process's clock zeroed at its first span (stage 0's B0
"started" 160 us before stage 1's B0 ended).
"""
import json, os, re, shutil, subprocess, sys, tempfile
from checks import report, exit_code
import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "test"))
from test_parallelism import Runner, MODEL, T, TRAINER, SENDER_DRIVEN_MPI  # noqa: E402
from test_data_parallel import write_shard  # noqa: E402
from test_gpu import MODE as GPU_MODE  # noqa: E402
from test_gpu_parallelism import Runner as GpuRunner  # noqa: E402
PLOT = os.path.join(ROOT, "scripts", "plot_pipeline.py")


def printed_schedule(work, schedule="1f1b"):
    """{stage: ["F0", "F1", "B0", ...]}: the compute actions --pipeline-print-schedule lists (ZB-H1: and W3)."""
    p = subprocess.run([TRAINER, "--model", MODEL, "--seq-len", str(T), "--batch-size", "1", "--total-batch-tokens",
                        str(4 * T), "--train-data", "none.bin", "--pipeline-parallel", "2", "--pipeline-schedule", schedule,
                        "--pipeline-print-schedule"], capture_output=True, text=True, cwd=work)
    lines = [line.split() for line in p.stdout.splitlines() if line.startswith("stage ")]
    return {int(w[1].rstrip(":")): [a for a in w[2:] if re.fullmatch(r"[FBW]\d+", a)] for w in lines}


def read_spans(paths, who):
    """{rank: its "X" events sorted by start}, or None after reporting a file that does not parse."""
    spans = {}
    for k, p in enumerate(paths):
        try:
            events = json.load(open(p))["traceEvents"]
            spans[k] = sorted([e for e in events if e["ph"] == "X" and e["pid"] == k], key=lambda e: e["ts"])
        except (OSError, ValueError, KeyError) as e:
            report(False, f"{who}: rank {k}'s trace parses as JSON", str(e))
            return None
    return spans if all(spans.values()) else None


def check_spans(spans, want, who):
    """Both stages: each step's compute spans in the printed order, no overlaps, receives, the gradient sums and
    the optimizer traced, and one clock (stage 1's F0 starts after stage 0's ends)."""
    for k in range(2):
        for step in (1, 2):
            got = [e["name"] for e in spans[k] if e["args"]["step"] == step and re.fullmatch(r"[FBW]\d+", e["name"])]
            report(got == want.get(k), f"{who}: stage {k}, step {step}: compute spans in the printed order {want.get(k)}",
                   f"traced {got}")
        overlaps = [(a["name"], b["name"]) for a, b in zip(spans[k], spans[k][1:]) if b["ts"] < a["ts"] + a["dur"]]
        report(not overlaps, f"{who}: stage {k}: no two spans overlap", str(overlaps[:5]))
        names = {e["name"] for e in spans[k]}
        report({"optimizer", "gradient sums"} <= names and any(n.startswith("recv ") for n in names),
               f"{who}: stage {k}: receives, the gradient sums and the optimizer are traced", str(sorted(names)))
    f0, f1 = [next(e for e in spans[k] if e["name"] == "F0" and e["args"]["step"] == 1) for k in range(2)]
    report(f1["ts"] >= f0["ts"] + f0["dur"], f"{who}: one clock: stage 1's F0 starts after stage 0's F0 ends",
           f"stage 0 F0 ends {f0['ts'] + f0['dur']}, stage 1 F0 starts {f1['ts']}")


def main():
    if not shutil.which("mpirun") or not os.path.exists(TRAINER):
        print("SKIP: pipeline trace (needs mpirun and a built train_gpt_cpu)")
        return 0
    work = tempfile.mkdtemp(prefix="llmc_trace_")
    try:
        rng = np.random.default_rng(0)
        write_shard(os.path.join(work, "train_000.bin"), rng.integers(0, 501, size=16384))
        r = Runner(work)
        trace = os.path.join(work, "trace.json")
        env = {"LLMC_TEST_PIPE_DELAY_MS": "20", **SENDER_DRIVEN_MPI}
        code, out, err = r.run(2, "--pipeline-parallel", 2, "--pipeline-schedule", "1f1b", "--trace", trace,
                               steps=2, env=env)
        paths = [os.path.join(work, f"trace.rank{k}.json") for k in range(2)]
        report(code == 0 and all(os.path.exists(p) for p in paths),
               "--trace on 2 ranks writes trace.rank0.json and trace.rank1.json", f"exit {code}: {(out + err)[-1500:]}")
        spans = read_spans(paths, "CPU")
        if spans is None:
            return exit_code()
        check_spans(spans, printed_schedule(work), "CPU 1F1B")
        for k in range(2):
            short = [e["name"] for e in spans[k] if re.fullmatch(r"[FB]\d+", e["name"]) and
                     e["dur"] < (20000 if e["name"][0] == "F" else 40000)]
            report(not short, f"stage {k}: every F lasts >= 20 ms and every B >= 40 ms (the injected sleeps)", str(short))

        def first(k, name, step=1):
            return next(e for e in spans[k] if e["name"] == name and e["args"]["step"] == step)
        b0, b1 = first(0, "B0"), first(1, "B0")
        report(b0["ts"] >= b1["ts"] + b1["dur"], "one clock: stage 0's B0 starts after stage 1's B0 ends",
               f"stage 1 B0 ends {b1['ts'] + b1['dur']}, stage 0 B0 starts {b0['ts']}")

        png = os.path.join(work, "pipeline.png")
        p = subprocess.run(["/usr/bin/python3", PLOT] + paths + ["-o", png], capture_output=True, text=True)
        measured = [float(x) for x in re.findall(r"rank \d: bubble ([\d.]+)%", p.stdout)]
        is_png = os.path.exists(png) and open(png, "rb").read(8) == b"\x89PNG\r\n\x1a\n"
        report(p.returncode == 0 and is_png, "plot_pipeline.py writes a PNG", p.stdout + p.stderr)
        report(len(measured) == 2 and all(abs(x - 20.0) <= 10.0 for x in measured),
               f"plot_pipeline.py: each stage's bubble is 20% +- 10 points, (p-1)/(m+p-1) = 1/5 ({measured})", p.stdout)

        p = subprocess.run(["/usr/bin/python3", PLOT, os.path.join(work, "missing.json"), "-o", png], capture_output=True, text=True)
        report(p.returncode == 1 and p.stderr.count("\n") == 1 and "cannot read the trace" in p.stderr,
               "plot_pipeline.py on a missing trace: one line naming it, exit 1", f"exit {p.returncode}: {p.stderr[-300:]}")

        # one rank: FILE itself, no rank in the name
        one = os.path.join(work, "one.json")
        code, out, err = r.run(1, "--trace", one, steps=1)
        try:
            names = [e["name"] for e in json.load(open(one))["traceEvents"] if e["ph"] == "X"]
        except (OSError, ValueError, KeyError) as e:
            names = [str(e)]
        report(code == 0 and names == ["F0", "B0", "F1", "B1", "F2", "B2", "F3", "B3", "gradient sums", "optimizer"] and
               not os.path.exists(os.path.join(work, "one.rank0.json")),
               "one rank: --trace FILE writes FILE itself: F0 B0 ... F3 B3, the gradient sums, the optimizer", f"exit {code}: {names[:12]} {err[-300:]}")

        # a folder that does not exist yet is created, by both ranks at once (was: an error and MPI_ABORT's banner)
        code, out, err = r.run(2, "--pipeline-parallel", 2, "--trace", os.path.join(work, "new_dir", "sub", "t.json"), steps=1)
        made = [os.path.join(work, "new_dir", "sub", f"t.rank{k}.json") for k in range(2)]
        report(code == 0 and all(os.path.exists(p) for p in made) and "MPI_ABORT" not in out + err,
               "--trace into a folder that does not exist: 2 ranks create it and write their files", f"exit {code}: {(out + err)[-800:]}")
        # a path that cannot be a folder (a regular file stands where the folder would be): one line, before training
        blocker = os.path.join(work, "a_file")
        open(blocker, "w").close()
        code, out, err = r.run(1, "--trace", os.path.join(blocker, "t.json"), steps=1)
        report(code == 1 and err.count("error:") == 1 and "cannot write the trace" in err and "--trace" in err and "step 1" not in out,
               "--trace under a regular file: one line naming the path and the flag, exit 1, before training",
               f"exit {code}: {err[-500:]} {out[-300:]}")

        # the GPU trainer (the emulated build where there is no GPU), ZB-H1 on 2 stages: its F, B and W spans
        if GPU_MODE is None:
            print("SKIP: --trace on the GPU trainer (no build/emu/train_gpt: make emu)")
        else:
            gtrace = os.path.join(work, "gpu.json")
            code, out, err = GpuRunner(work).run(2, "--pipeline-parallel", 2, "--pipeline-schedule", "zb-h1", "--trace", gtrace,
                                                 steps=2)
            gpaths = [os.path.join(work, f"gpu.rank{k}.json") for k in range(2)]
            report(code == 0 and all(os.path.exists(p) for p in gpaths), "GPU trainer: --trace on 2 ranks writes a file each",
                   f"exit {code}: {(out + err)[-1500:]}")
            gspans = read_spans(gpaths, "GPU") if code == 0 else None
            if gspans is not None:
                check_spans(gspans, printed_schedule(work, "zb-h1"), "GPU ZB-H1")
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
