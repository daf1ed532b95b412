#!/usr/bin/env python3
"""test_report.py — scripts/report.py: one run folder as one self-contained HTML page, checked in a
real headless browser (Debian's chromium).

  a fake run   a run folder written here: a metrics log (a "run" record with a GPU run's MFU, a resumed
               run's repeated steps, validation and HellaSwag records), a train.log with two samples, and
               a 2-rank --trace pair. The page is written to RUN_DIR/report.html by default and where
               -o says; it holds every section's plot (loss, HellaSwag, throughput, MFU, learning rate,
               gradient norm, memory, the pipeline timeline with its legend), the samples and the flags
  a real run   the CPU trainer, 4 steps at a tiny shape with --trace into the run folder, its output kept
               as train.log: the page has the loss, model FLOP/s (the CPU logs no MFU and the page says
               so), memory against the trainer's own --estimate by kind, the timeline and the sample
  offline      nothing to fetch: no src=, href= or url() outside the page, no <link>, no external script
  browser      chromium --headless opens each page: the page's own script (which checks that every plot
               drew marks) writes "report ok: N plots (...)" with the expected N and names into the DOM
               (--dump-dom), the console logs no error, and a screenshot is written (not blank)
  controls     the same page with a planted script error never says "report ok"; with a plot emptied of
               its marks it says "report broken" naming the plot
  errors       a folder that does not exist, or holds no metrics.jsonl: one line, exit 1
SKIP (with the reason) where chromium is not installed: scripts/setup.sh --tests installs it.
"""
import json, os, re, shutil, struct, subprocess, sys, tempfile, zlib
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(ROOT, "scripts", "report.py")
TRAINER = os.path.join(ROOT, "train_gpt_cpu")
sys.path.insert(0, os.path.join(ROOT, "test"))
from token_shards import write_shard  # noqa: E402


def browser():
    return next((shutil.which(b) for b in ("chromium", "chromium-browser") if shutil.which(b)), None)


def fake_run(run_dir):
    """A GPU run of 40 steps resumed at step 30 (steps 31-35 logged twice), 2 ranks traced, 2 samples."""
    os.makedirs(run_dir)
    flags = {"model": "d12", "batch-size": 4, "seq-len": 64, "lr": 0.0006, "trace": os.path.join(run_dir, "trace.json"),
             "attention": "cudnn", "note": "<b>not markup</b>"}
    run = {"type": "run", "time": "2026-12-06T12:00:00Z", "version": "0.1.0", "trainer": "gpu", "start_step": 0,
           "model": "new d12", "config": {"L": 2, "C": 64, "H": 4, "T": 64, "V": 512, "Vp": 512, "params": 140000},
           "plan": {"B": 4, "T": 64, "ranks": 2, "accumulation": 1, "tokens_per_step": 256, "steps": 40}, "flags": flags}
    lines = [run]
    for s in range(1, 36):
        lines.append({"type": "step", "step": s, "tokens": 256 * s, "loss": 7 - 0.1 * s, "lr": 6e-4 * min(1, s / 10),
                      "norm": 1.0 + 0.01 * s, "ms": 20 + s % 3, "tok_s": 12000 + 100 * (s % 5), "mfu": 30 + s % 4, "mem_mb": 900})
        if s % 10 == 0:
            lines.append({"type": "val", "step": s, "tokens": 256 * s, "val_loss": 7 - 0.09 * s})
    lines.append(dict(run, start_step=30))
    for s in range(31, 41):
        lines.append({"type": "step", "step": s, "tokens": 256 * s, "loss": 4 - 0.01 * s, "lr": 6e-4, "norm": 0.5,
                      "ms": 21, "tok_s": 12100, "mfu": None if s == 40 else 31, "mem_mb": 910})
    lines.append({"type": "val", "step": 40, "tokens": 10240, "val_loss": 3.5})
    lines.append({"type": "hellaswag", "step": 40, "tokens": 10240, "acc": 0.27, "acc_sum": 0.26, "correct": 27, "examples": 100})
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.write("".join(json.dumps(r) + "\n" for r in lines))
    with open(os.path.join(run_dir, "train.log"), "w") as f:
        f.write("step    20/40 | loss 5.0\nsample: Call me <Ishmael> & co\nsecond line\n--------\n"
                "step    40/40 | loss 3.6\nsample: the whale\n--------\ndone: step 40\n")
    for rank in range(2):  # 1F1B on 2 stages, 2 micro-batches, step 40; stage 0 short, stage 1 long
        t, events = 1000.0, [{"name": "process_name", "ph": "M", "pid": rank, "tid": 0, "args": {"name": f"rank {rank}"}}]
        for name, dur in ([("F0", 50), ("F1", 50), ("recv grad 0", 400), ("B0", 100), ("B1", 100)] if rank == 0 else
                          [("recv act 0", 50), ("F0", 200), ("B0", 400), ("F1", 200), ("B1", 400)]) + [("gradient sums", 30), ("optimizer", 40)]:
            events.append({"name": name, "ph": "X", "ts": t, "dur": dur, "pid": rank, "tid": 0, "args": {"step": 40}})
            t += dur
        with open(os.path.join(run_dir, f"trace.rank{rank}.json"), "w") as f:
            json.dump({"traceEvents": events}, f)


def run_report(args):
    return subprocess.run([sys.executable, REPORT] + args, capture_output=True, text=True, timeout=120)


def plots_of(page):
    return re.findall(r'<svg class="plot" data-name="([^"]+)"', page)


def offline(page):
    """External references: src/href attributes, CSS url(), <link> tags, anything with a scheme."""
    refs = re.findall(r'\b(?:src|href)\s*=\s*["\']?([^"\'\s>]+)', page) + re.findall(r"url\(([^)]*)\)", page)
    return [r for r in refs if not r.startswith("#")] + re.findall(r"<link\b[^>]*>", page) + re.findall(r"https?://\S+", page)


def png_is_blank(path):
    """True when every pixel row of the PNG is one colour (what a page that failed to render looks like)."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return True
    width, height, depth, ctype = struct.unpack(">IIBB", data[16:26])
    idat, pos = b"", 8
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        if kind == b"IDAT":
            idat += data[pos + 8:pos + 8 + n]
        pos += 12 + n
    raw = zlib.decompress(idat)
    # distinct bytes in the (filtered) rows: a blank page's rows hold one value after their filter byte
    return len(set(raw[: min(len(raw), 2_000_000)])) < 4


def open_in_browser(chrome, page_path, work, tag):
    """(marker text, data-state, console errors, screenshot path) from chromium --headless."""
    common = [chrome, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars", "--no-first-run",
              f"--user-data-dir={os.path.join(work, 'chrome-' + tag)}", "--enable-logging=stderr", "--v=0"]
    url = "file://" + os.path.abspath(page_path)
    dom = subprocess.run(common + ["--dump-dom", url], capture_output=True, text=True, timeout=120)
    m = re.search(r'<p id="report-check" data-state="([^"]*)">([^<]*)</p>', dom.stdout)
    console = [l for l in dom.stderr.splitlines() if "CONSOLE" in l or "Uncaught" in l]
    shot = os.path.join(work, tag + ".png")
    subprocess.run(common + ["--window-size=1280,2400", f"--screenshot={shot}", url], capture_output=True, text=True, timeout=120)
    return (m.group(2) if m else f"no marker (exit {dom.returncode}): {dom.stderr[-300:]}", m.group(1) if m else None,
            console, shot)


def main():
    tmp = tempfile.mkdtemp(prefix="llmc_report_")
    chrome = browser()

    # ---- errors: one line, exit 1
    for args, what in [([os.path.join(tmp, "nowhere")], "a folder that does not exist"),
                       ([tmp], "a folder without metrics.jsonl")]:
        p = run_report(args)
        report(p.returncode == 1 and len(p.stderr.strip().splitlines()) == 1 and p.stderr.startswith("error: "),
               f"{what}: one line, exit 1", f"exit {p.returncode}: {p.stderr[-300:]!r}")

    # ---- the fake GPU run: every section
    fake = os.path.join(tmp, "fake")
    fake_run(fake)
    p = run_report([fake, "--trainer", os.path.join(tmp, "no_trainer")])
    page_path = os.path.join(fake, "report.html")
    page = open(page_path).read() if os.path.exists(page_path) else ""
    report(p.returncode == 0 and page and f"report: {page_path}" in p.stdout, "writes RUN_DIR/report.html by default, prints its path",
           p.stdout + p.stderr)
    want = ["loss", "hellaswag", "throughput", "mfu", "lr", "norm", "memory", "pipeline"]
    report(plots_of(page) == want, "fake run: a plot per section (loss, HellaSwag, throughput, MFU, lr, norm, memory, timeline)",
           f"plots {plots_of(page)}, wanted {want}")
    report(all(s in page for s in ("forward F", "backward B", "gradient sums", "optimizer", "send / receive / wait", "bubble ")),
           "the timeline has a legend and each rank's bubble")
    report("Call me &lt;Ishmael&gt; &amp; co\nsecond line" in page and "the whale" in page and "after step 20" in page
           and "after step 40" in page, "both samples, escaped, with their steps")
    report("--attention" in page and "&lt;b&gt;not markup&lt;/b&gt;" in page and "every flag (7)" in page,
           "the options: every flag, escaped")
    report("No estimate" in page and "no_trainer" in page, "without a trainer binary, the page says why there is no estimate")
    report("3.6000" in page, "a resumed run's repeated steps: the last record wins (last training loss 3.6)")
    report(not offline(page), "the page references nothing outside itself", str(offline(page)[:5]))
    other = os.path.join(tmp, "elsewhere", "r.html")
    os.makedirs(os.path.dirname(other))
    p = run_report([fake, "-o", other, "--trainer", os.path.join(tmp, "no_trainer")])
    report(p.returncode == 0 and os.path.exists(other), "-o FILE writes there", p.stderr)
    if os.path.exists(TRAINER):  # 2 data-parallel ranks: the estimate prints them as one line, "ranks 0-1: ..."
        p = run_report([fake, "-o", other, "--trainer", TRAINER])
        two = open(other).read() if p.returncode == 0 else ""
        report("memory-by-kind" in plots_of(two) and "--estimate, ranks 0-1" in two,
               "an estimate of 2 equal ranks ('ranks 0-1') is drawn against the measurement", p.stderr + str(plots_of(two)))

    # ---- a real CPU run, 4 steps at a tiny shape, traced into its folder
    real = os.path.join(tmp, "real")
    real_page = ""
    if not os.path.exists(TRAINER):
        print("SKIP: report of a real CPU run (train_gpt_cpu not built)")
    else:
        shard = os.path.join(tmp, "train.bin")
        write_shard(shard, [(7 * i) % 512 for i in range(4000)])
        cmd = [TRAINER, "--model", "L=2,C=32,H=4,T=16,V=512", "--train-data", shard, "--val-data", shard, "--val-tokens", "64",
               "--val-every", "2", "--batch-size", "2", "--seq-len", "16", "--steps", "4", "--sample-every", "4",
               "--sample-tokens", "8", "--threads", "1", "--out-dir", real, "--trace", os.path.join(real, "trace.json")]
        t = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        os.makedirs(real, exist_ok=True)
        with open(os.path.join(real, "train.log"), "w") as f:
            f.write(t.stdout)
        p = run_report([real])
        real_page = open(os.path.join(real, "report.html")).read() if p.returncode == 0 else ""
        want_real = ["loss", "throughput", "flops", "lr", "norm", "memory", "memory-by-kind", "pipeline"]
        report(t.returncode == 0 and plots_of(real_page) == want_real,
               "real CPU run: loss, throughput, model FLOP/s, lr, norm, memory, memory by kind, timeline",
               f"trainer exit {t.returncode} {t.stderr[-300:]}; report {p.stderr[-300:]}; plots {plots_of(real_page)}")
        report("No MFU or FMA share in this log" in real_page, "the CPU run's page says the log has no MFU or FMA share")
        est = subprocess.run([TRAINER, "--estimate", "--model", "L=2,C=32,H=4,T=16,V=512", "--batch-size", "2", "--seq-len", "16"],
                             capture_output=True, text=True, timeout=60).stdout
        m = re.search(r"rank 0: .*total=(\d+)", est)
        report(m is not None and f"{int(m.group(1)) / 2**20:,.1f}" in real_page and "activations" in real_page,
               "memory by kind is the trainer's own --estimate (its total appears, in MiB)", est[-300:])
        report(real_page.count("<pre>") == 1, "the run's one sample", str(real_page.count("<pre>")))

    # ---- the browser
    if chrome is None:
        print("SKIP: report in a headless browser (chromium is not installed: apt-get install -y chromium, "
              "or scripts/setup.sh --tests)")
        shutil.rmtree(tmp)
        return exit_code()
    pages = [("fake", page_path, want)] + ([("real", os.path.join(real, "report.html"), plots_of(real_page))] if real_page else [])
    for tag, path, names in pages:
        marker, state, console, shot = open_in_browser(chrome, path, tmp, tag)
        report(state == "ok" and marker == f"report ok: {len(names)} plots ({', '.join(names)})",
               f"{tag} run in chromium: the page's script ran and found every plot drawn", marker, marker)
        report(not console, f"{tag} run in chromium: no script error on the console", "\n".join(console[:5]))
        report(os.path.exists(shot) and not png_is_blank(shot), f"{tag} run in chromium: a screenshot, not blank",
               f"{shot} {'exists' if os.path.exists(shot) else 'missing'}")

    # ---- negative controls: a planted script error, an emptied plot
    broken = os.path.join(tmp, "broken.html")
    with open(broken, "w") as f:
        f.write(page.replace('var plots = document.querySelectorAll("svg.plot")', 'var plots = document.querySelectorAll("svg.plot"); no_such_function()', 1))
    marker, state, console, _ = open_in_browser(chrome, broken, tmp, "broken")
    report(state != "ok" and "report ok" not in marker and any("no_such_function" in c for c in console),
           "negative control: a planted script error leaves no 'report ok' and shows on the console", f"{state}: {marker} {console[:2]}")
    empty = os.path.join(tmp, "empty.html")
    first = page.index('<svg class="plot" data-name="norm"')
    end = page.index("</svg>", first)
    with open(empty, "w") as f:
        f.write(page[:first] + re.sub(r'class="mark[^"]*"', 'class="gone"', page[first:end]) + page[end:])
    marker, state, _, _ = open_in_browser(chrome, empty, tmp, "empty")
    report(state == "broken" and "norm" in marker, "negative control: a plot without marks is named as broken", f"{state}: {marker}")

    shutil.rmtree(tmp)
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
