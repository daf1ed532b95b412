#!/usr/bin/env python3
"""test_hellaswag.py — HellaSwag evaluation (--hellaswag, --hellaswag-every, --eval-only).

A tiny byte-level vocabulary (GPT-2's encoder.json/vocab.bpe format: the 256 byte tokens and
<|endoftext|>) keeps the model small. A 2-layer model is trained on a repeated text of three
sentences while evaluating HellaSwag every 50 steps; each example's context is the start of one
sentence, the right ending its continuation, the wrong endings continuations of the others. Then:

  trained         the trained model picks the right ending of every example: 100%
  not trivial     the same examples with the labels moved to a wrong ending score 0%, and the
                  untrained model does not score 100% (the score depends on the model, not on the
                  file); several ranks (mpirun -np 2) score exactly what one rank scores
  during training --hellaswag-every N logs a "hellaswag" record at steps 0, N, ... and at the end
  format          "ctx" or "ctx_a" + "ctx_b", a label given as a string, extra fields ignored
  errors          a bad JSON line, three endings, a label out of range, a missing label, no
                  context: exit 1 with one line naming the file and the line
"""
import json, os, shutil, subprocess, sys, tempfile
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from token_shards import write_shard  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINER = os.path.join(ROOT, "train_gpt_cpu")
MODEL = "L=2,C=64,H=4,T=64,V=258"
failures = 0

SENTENCES = ["the cat sat on the mat.", "the dog ran to the park.", "a bird flew over the sea."]


def report(ok, name, why=""):
    global failures
    print(f"PASS: {name}" if ok else f"FAIL: {name}: {why}", flush=True)
    failures += not ok


def bytes_to_unicode():
    """GPT-2's printable stand-ins for the 256 bytes (the keys of encoder.json)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


def write_vocab(d):
    """Byte b is token b; <|endoftext|> is 256; one merge ("q z" -> 257) that our text never uses, so
    every text here encodes to its bytes."""
    os.makedirs(d, exist_ok=True)
    table = bytes_to_unicode()
    encoder = {table[b]: b for b in range(256)}
    encoder["<|endoftext|>"] = 256
    encoder["qz"] = 257
    json.dump(encoder, open(os.path.join(d, "encoder.json"), "w"))
    open(os.path.join(d, "vocab.bpe"), "w").write("#version: 0.2\nq z\n")



def examples():
    """Contexts cut inside each sentence; endings: its continuation, the other sentences' continuations
    at the same cut, and a distractor; the right one at every position in turn."""
    words = [x.split() for x in SENTENCES]
    out = []
    for cut in (2, 3, 4):
        for i in range(len(SENTENCES)):
            continuations = [" ".join(w[cut:]) for w in words]
            others = [c for j, c in enumerate(continuations) if j != i] + ["sat to the sea."]
            label = (i + cut) % 4
            endings = others[:label] + [continuations[i]] + others[label:]
            out.append({"ctx": " ".join(words[i][:cut]), "endings": endings, "label": label, "ind": len(out),
                        "activity_label": "test"})
    # the other spellings of the format: ctx_a + ctx_b, a label as a string
    e = dict(out[0])
    del e["ctx"]
    e["ctx_a"], e["ctx_b"] = "the", "cat"
    e["label"] = str(e["label"])
    out.append(e)
    return out


def write_jsonl(path, rows):
    with open(path, "w") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")


def run(args, mpi=0):
    cmd = [TRAINER] + args
    if mpi:
        cmd = ["timeout", "300", shutil.which("mpirun"), "--allow-run-as-root", "--oversubscribe", "-np", str(mpi)] + cmd
    return subprocess.run(cmd, capture_output=True, text=True)


def accuracy(stdout):
    lines = [l for l in stdout.splitlines() if "| hellaswag " in l]
    return float(lines[-1].split("hellaswag ")[1].split("%")[0]) if lines else None


def main():
    if not os.path.exists(TRAINER):
        print("SKIP: hellaswag (train_gpt_cpu not built)")
        return 0
    tmp = tempfile.mkdtemp(prefix="llmc_hellaswag_")
    vocab = os.path.join(tmp, "vocab")
    write_vocab(vocab)
    text = (" ".join(SENTENCES) + " ") * 600
    shard = os.path.join(tmp, "train.bin")
    write_shard(shard, list(text.encode()))
    rows = examples()
    # check the construction itself: the labelled ending is the sentence's real continuation
    assert all((r.get("ctx") or r["ctx_a"] + " " + r["ctx_b"]) + " " + r["endings"][int(r["label"])] in text for r in rows)
    hs = os.path.join(tmp, "hellaswag.jsonl")
    write_jsonl(hs, rows)
    common = ["--tokenizer", vocab, "--hellaswag", hs, "--val-data", "none", "--batch-size", "4", "--seq-len", "64",
              "--threads", "2"]

    # ---- train while evaluating every 50 steps
    out = os.path.join(tmp, "run")
    p = run(["--model", MODEL, "--train-data", shard, "--steps", "150", "--lr", "1e-2", "--warmup-steps", "10",
             "--hellaswag-every", "50", "--checkpoint-every", "150", "--out-dir", out] + common)
    if p.returncode != 0:
        report(False, "training with --hellaswag-every", p.stderr[-2000:])
        return 1
    log = [json.loads(l) for l in open(os.path.join(out, "metrics.jsonl"))]
    steps = [r["step"] for r in log if r["type"] == "hellaswag"]
    losses = [r["loss"] for r in log if r["type"] == "step"]
    report(steps == [0, 50, 100, 150], "--hellaswag-every 50 evaluates at steps 0, 50, 100 and at the end (150)", f"{steps}")
    final = [r for r in log if r["type"] == "hellaswag"][-1]
    report(final["acc"] == 1.0 and final["examples"] == len(rows) and accuracy(p.stdout) == 100.0,
           f"the trained model picks the right ending of all {len(rows)} examples (loss {losses[-1]:.3f})",
           f"{final}, last loss {losses[-1]:.3f}")

    # ---- standalone: --eval-only on the checkpoint, and on an untrained model
    model = os.path.join(out, "ckpt_00000150", "model.bin")
    p = run(["--eval-only", "--model", model, "--metrics", "none"] + common)
    report(p.returncode == 0 and accuracy(p.stdout) == 100.0 and "step     1/" not in p.stdout,
           "--eval-only --model CKPT evaluates without training: 100%", p.stdout[-800:] + p.stderr[-800:])
    p = run(["--eval-only", "--resume", os.path.join(out, "ckpt_00000150"), "--metrics", "none"] + common)
    report(p.returncode == 0 and accuracy(p.stdout) == 100.0, "--eval-only --resume CKPT_DIR: 100%", p.stderr[-500:])
    wrong = os.path.join(tmp, "wrong.jsonl")
    write_jsonl(wrong, [dict(r, label=(int(r["label"]) + 1) % 4) for r in rows])
    p = run(["--eval-only", "--model", model, "--metrics", "none"] + common[:3] + [wrong] + common[4:])
    report(p.returncode == 0 and accuracy(p.stdout) == 0.0, "with every label moved to a wrong ending the same model scores 0%",
           p.stdout[-500:] + p.stderr[-500:])
    p = run(["--eval-only", "--model", MODEL, "--metrics", "none"] + common)
    untrained = accuracy(p.stdout)
    report(p.returncode == 0 and untrained is not None and untrained < 75.0,
           f"an untrained model scores near chance ({untrained}%), not 100%", p.stdout[-500:] + p.stderr[-500:])
    if shutil.which("mpirun"):
        p = run(["--eval-only", "--model", model, "--metrics", "none"] + common[:-2] + ["--threads", "1"], mpi=2)
        report(p.returncode == 0 and accuracy(p.stdout) == 100.0 and f"({len(rows)}/{len(rows)}," in p.stdout,
               "2 ranks split the examples and report the same 100% over all of them", p.stdout[-500:] + p.stderr[-800:])
    else:
        print("SKIP: hellaswag on 2 ranks (mpirun is not installed)")

    # ---- malformed files: one line naming the file and the line
    good = json.dumps(rows[0])
    cases = [([good, good, "{not json"], "line 3: not valid JSON", "a line that is not JSON"),
             ([good, json.dumps(dict(rows[0], endings=rows[0]["endings"][:3]))], "line 2: \"endings\" has 3 entries",
              "three endings"),
             ([json.dumps(dict(rows[0], label=4))], "line 1: \"label\" is 4", "a label out of range"),
             ([good, "", json.dumps(dict(rows[0], label=""))], "line 3: no \"label\"", "a hidden label (test split)"),
             ([json.dumps({"endings": rows[0]["endings"], "label": 0})], "line 1: no \"ctx\"", "no context"),
             ([json.dumps([1, 2])], "line 1: expected a JSON object", "a line that is an array")]
    bad = os.path.join(tmp, "bad.jsonl")
    for lines, needle, name in cases:
        write_jsonl(bad, lines)
        p = run(["--eval-only", "--model", MODEL, "--metrics", "none"] + common[:3] + [bad] + common[4:])
        err = p.stderr.strip().splitlines()
        report(p.returncode == 1 and len(err) == 1 and err[0].startswith("error: HellaSwag file") and needle in err[0],
               f"bad HellaSwag file: {name}", f"exit {p.returncode}, stderr {p.stderr!r}")
    p = run(["--model", MODEL, "--hellaswag-every", "10", "--val-data", "none"])
    report(p.returncode == 2 and "--hellaswag-every needs --hellaswag" in p.stderr, "--hellaswag-every without --hellaswag -> exit 2",
           p.stderr)
    p = run(["--eval-only", "--model", MODEL, "--val-data", "none"])
    report(p.returncode == 2 and "--eval-only has nothing to evaluate" in p.stderr, "--eval-only with nothing to evaluate -> exit 2",
           p.stderr)
    p = run(["--eval-only", "--model", MODEL, "--metrics", "none", "--tokenizer", os.path.join(tmp, "none")] + common[2:])
    report(p.returncode == 1 and "--hellaswag needs the tokenizer" in p.stderr, "--hellaswag without a tokenizer -> a clear error",
           p.stderr)
    shutil.rmtree(tmp)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
