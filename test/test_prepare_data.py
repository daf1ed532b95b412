#!/usr/bin/env python3
"""The data tool, ./prepare_data: shard format, document separators, the validation split,
sharding, determinism across thread counts, and one clear error for each kind of bad input.

Shards are read back here with an independent reader (the llm.c format: 256 int32 header, then
uint16 tokens); expected tokens come from ./tokenize_text. Needs ./prepare_data, ./tokenize_text
(make) and data/gpt2 (scripts/get_vocab.sh); without them it prints SKIP.
"""
import json
from checks import report, exit_code
import os
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PREPARE = os.path.join(ROOT, "prepare_data")
TOKENIZE = os.path.join(ROOT, "tokenize_text")
EOT = 50256


def run(*args):
    return subprocess.run([PREPARE, *args, "--no-progress"], cwd=ROOT, capture_output=True, text=True)


def read_shard(path):
    data = open(path, "rb").read()
    header = struct.unpack("<256i", data[:1024])
    assert header[0] == 20240520, f"{path}: bad magic {header[0]}"
    assert header[1] == 1, f"{path}: bad version {header[1]}"
    assert all(h == 0 for h in header[3:]), f"{path}: header[3:] not zero"
    count = header[2]
    assert len(data) == 1024 + 2 * count, f"{path}: size {len(data)} does not match {count} tokens"
    return list(struct.unpack(f"<{count}H", data[1024:]))


def shards(out_dir, name, split):
    files = sorted(f for f in os.listdir(out_dir) if f.startswith(f"{name}_{split}_") and f.endswith(".bin"))
    return [os.path.join(out_dir, f) for f in files]


def tokens_of(paths):
    out = subprocess.run([TOKENIZE, *paths], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [[int(x) for x in line.split()] for line in out.split("\n")[: len(paths)]]


def expect_error(name, args, *needles, code=1):
    """Bad input: exit 1 (a bad command line: exit 2), and exactly one line on stderr, 'error: ...', that
    says what and how to fix it."""
    result = run(*args)
    errors = result.stderr.strip().splitlines()
    ok = result.returncode == code and len(errors) == 1 and errors[0].startswith("error:") and all(n in errors[0] for n in needles)
    report(ok, f"bad input: {name}", f"exit {result.returncode}, stderr: {result.stderr.strip()!r}")


def main():
    if not (os.access(PREPARE, os.X_OK) and os.access(TOKENIZE, os.X_OK)):
        print("SKIP: prepare_data (./prepare_data or ./tokenize_text not built: run make)")
        return 0
    if not os.path.exists(os.path.join(ROOT, "data/gpt2/encoder.json")):
        print("SKIP: prepare_data (no GPT-2 vocabulary: run scripts/get_vocab.sh)")
        return 0

    with tempfile.TemporaryDirectory() as tmp:
        # A corpus of 25 short documents, as a folder of text files and as JSONL.
        docs = [f"Document {i}: the whale's {i * 7} tonnes.\n" + "Call me Ishmael. " * (i % 4) for i in range(25)]
        docs[3] = "Ünïcödé — 東京 😀 <|endoftext|> stays text"
        folder = os.path.join(tmp, "folder")
        os.makedirs(os.path.join(folder, "sub"))
        for i, doc in enumerate(docs):
            # Zero-padded names so sorted order is document order; one file in a subfolder.
            where = os.path.join(folder, "sub" if i == 24 else "", f"doc_{i:03d}.txt")
            open(where, "w", encoding="utf-8").write(doc)
        open(os.path.join(folder, ".hidden"), "wb").write(b"\xff not read")
        doc_paths = [os.path.join(folder, "sub" if i == 24 else "", f"doc_{i:03d}.txt") for i in range(25)]
        doc_tokens = tokens_of(doc_paths)

        out = os.path.join(tmp, "out_folder")
        result = run(folder, "--out-dir", out, "--name", "c", "--val-fraction", "0.2")
        report(result.returncode == 0, "folder of 25 text files", result.stderr)
        # Split rule: document i is validation when floor((i+1)*0.2) > floor(i*0.2): i = 4, 9, 14, 19, 24.
        val_ids = {4, 9, 14, 19, 24}
        want_train = [t for i in range(25) if i not in val_ids for t in [EOT] + doc_tokens[i]]
        want_val = [t for i in sorted(val_ids) for t in [EOT] + doc_tokens[i]]
        got_train = [t for p in shards(out, "c", "train") for t in read_shard(p)]
        got_val = [t for p in shards(out, "c", "val") for t in read_shard(p)]
        report(got_train == want_train, "train shard: <|endoftext|> + tokens of each training document, in order",
               f"{len(got_train)} tokens vs {len(want_train)} expected")
        report(got_val == want_val, "val shard: documents 4, 9, 14, 19, 24 (one in every 5)",
               f"{len(got_val)} tokens vs {len(want_val)} expected")

        jsonl = os.path.join(tmp, "corpus.jsonl")
        with open(jsonl, "w", encoding="utf-8") as f:
            for i, doc in enumerate(docs):
                f.write(json.dumps({"id": i, "body": doc, "meta": {"x": [1, 2]}}) + "\n")
                if i == 10:
                    f.write("\n")   # blank lines are not records
        out_jsonl = os.path.join(tmp, "out_jsonl")
        result = run(jsonl, "--out-dir", out_jsonl, "--name", "c", "--val-fraction", "0.2", "--text-field", "body")
        same = result.returncode == 0 and all(
            open(os.path.join(out, f), "rb").read() == open(os.path.join(out_jsonl, f), "rb").read()
            for f in ["c_train_000000.bin", "c_val_000000.bin"])
        report(same, "JSONL with --text-field gives the same shards as the folder", result.stderr)

        out_small = os.path.join(tmp, "out_small")
        result = run(folder, "--out-dir", out_small, "--name", "c", "--val-fraction", "0.2", "--shard-tokens", "100")
        paths = shards(out_small, "c", "train")
        sizes = [len(read_shard(p)) for p in paths]
        report(result.returncode == 0 and len(paths) > 2 and all(s == 100 for s in sizes[:-1]) and 0 < sizes[-1] <= 100
               and [t for p in paths for t in read_shard(p)] == want_train,
               f"--shard-tokens 100: {len(paths)} train shards of 100 tokens (the last {sizes[-1] if sizes else 0})",
               f"sizes {sizes}")

        # The rule switches at 1/F documents: with F = 0.2, 5 documents split by document (the
        # last one is validation), 4 documents split each document's tokens instead.
        for count, doc_split in [(5, True), (4, False)]:
            small = os.path.join(tmp, f"first{count}.jsonl")
            with open(small, "w", encoding="utf-8") as f:
                for doc in docs[:count]:
                    f.write(json.dumps({"text": doc}) + "\n")
            out_rule = os.path.join(tmp, f"out_rule{count}")
            result = run(small, "--out-dir", out_rule, "--val-fraction", "0.2")
            val = read_shard(os.path.join(out_rule, f"first{count}_val_000000.bin"))
            if doc_split:
                want = [EOT] + doc_tokens[4]
            else:
                want = []
                for i in range(count):
                    tokens = [EOT] + doc_tokens[i]
                    want += tokens[len(tokens) - -(-len(tokens) // 5):]
            report(result.returncode == 0 and val == want,
                   f"{count} documents with --val-fraction 0.2: {'whole-document' if doc_split else 'per-document tail'} split",
                   f"{len(val)} val tokens, expected {len(want)}; {result.stderr}")

        # One document: the last 10% of its tokens (rounded up) are validation.
        book = os.path.join(tmp, "book.txt")
        with open(book, "w", encoding="utf-8") as f:
            for i in range(3000):
                f.write(f"Chapter {i}. It was the best of times, it was the worst of times; {i * i} days.\n")
        book_tokens = [EOT] + tokens_of([book])[0]
        n_val = -(-len(book_tokens) // 10)
        outs = {}
        for threads in ["1", "2", "5"]:
            outs[threads] = os.path.join(tmp, f"out_book_{threads}")
            result = run(book, "--out-dir", outs[threads], "--threads", threads)
        train = read_shard(os.path.join(outs["1"], "book_train_000000.bin"))
        val = read_shard(os.path.join(outs["1"], "book_val_000000.bin"))
        report(train == book_tokens[:-n_val] and val == book_tokens[-n_val:],
               "one document: the last 10% of its tokens are validation", f"{len(train)} + {len(val)} tokens")
        identical = all(open(os.path.join(outs[t], f), "rb").read() == open(os.path.join(outs["1"], f), "rb").read()
                        for t in ["2", "5"] for f in ["book_train_000000.bin", "book_val_000000.bin"])
        report(identical, "shards are byte-identical with --threads 1, 2 and 5")

        result = run(book, "--out-dir", outs["1"])
        report(result.returncode != 0 and "--overwrite" in result.stderr, "existing shards are not silently replaced",
               result.stderr)
        result = run(book, "--out-dir", outs["1"], "--overwrite", "--val-fraction", "0")
        report(result.returncode == 0 and shards(outs["1"], "book", "val") == [] and
               read_shard(os.path.join(outs["1"], "book_train_000000.bin")) == book_tokens,
               "--overwrite replaces old shards; --val-fraction 0 writes no val shard", result.stderr)

        # Bad inputs: each gives one clear message and a non-zero exit.
        bad_dir = os.path.join(tmp, "bad")
        os.makedirs(bad_dir)
        invalid = os.path.join(bad_dir, "invalid.txt")
        open(invalid, "wb").write(b"fine text\nthen a bad byte \xff here")   # 0xFF at offset 10 + 16
        expect_error("missing input file", [os.path.join(tmp, "nope.txt"), "--out-dir", bad_dir],
                     "cannot read", "nope.txt")
        expect_error("invalid UTF-8 names the file and byte offset", [invalid, "--out-dir", bad_dir],
                     "invalid.txt: invalid UTF-8 at byte offset 26", "--replace-invalid-utf8")
        result = run(invalid, "--out-dir", bad_dir, "--replace-invalid-utf8")
        report(result.returncode == 0 and "replaced" in result.stdout, "--replace-invalid-utf8 accepts it", result.stderr)
        empty = os.path.join(tmp, "empty.txt")
        open(empty, "w").close()
        expect_error("empty corpus", [empty, "--out-dir", bad_dir], "corpus is empty")
        empty_dir = os.path.join(tmp, "empty_dir")
        os.makedirs(empty_dir)
        expect_error("empty folder", [empty_dir, "--out-dir", bad_dir], "has no files", "corpus is empty")
        bad_json = os.path.join(tmp, "bad.jsonl")
        open(bad_json, "w").write('{"text": "ok"}\n{"text": "no closing quote}\n')
        expect_error("malformed JSONL line", [bad_json, "--out-dir", bad_dir], "bad.jsonl:2: not valid JSON",
                     "unterminated string")
        no_field = os.path.join(tmp, "no_field.jsonl")
        open(no_field, "w").write('{"content": "hello"}\n')
        expect_error("JSONL record without the text field", [no_field, "--out-dir", bad_dir],
                     "no_field.jsonl:1", 'no "text" field', "--text-field")
        wrong_type = os.path.join(tmp, "wrong_type.jsonl")
        open(wrong_type, "w").write('{"text": 42}\n')
        expect_error("JSONL text field that is not a string", [wrong_type, "--out-dir", bad_dir],
                     'field "text" is a number, expected a string')
        bad_jsonl_utf8 = os.path.join(tmp, "bad_utf8.jsonl")
        open(bad_jsonl_utf8, "wb").write(b'{"text": "a"}\n{"text": "b\xc3"}\n')
        expect_error("invalid UTF-8 in JSONL names the offset and line", [bad_jsonl_utf8, "--out-dir", bad_dir],
                     "invalid UTF-8 at byte offset 25", "line 2")
        expect_error("missing vocabulary", [book, "--out-dir", bad_dir, "--encoder", os.path.join(tmp, "none.json")],
                     "none.json", "get_vocab.sh")
        expect_error("--val-fraction out of range -> exit 2", [book, "--out-dir", bad_dir, "--val-fraction", "1.5"],
                     "--val-fraction", code=2)
        expect_error("unknown option -> exit 2", [book, "--frobnicate"], "unknown option --frobnicate", code=2)
        expect_error("no INPUT -> exit 2", [], "no INPUT given", code=2)
        for tool, args, line in [(PREPARE, [book, "--out-dir"], "error: --out-dir needs a value (see --help)"),
                                 (TOKENIZE, ["--frobnicate"], "error: unknown option --frobnicate (see --help)")]:
            p = subprocess.run([tool] + args, capture_output=True, text=True)
            report(p.returncode == 2 and p.stderr.strip() == line, f"{os.path.basename(tool)} {' '.join(args[-1:])} -> exit 2, one line",
                   f"exit {p.returncode}, stderr {p.stderr!r}")

        # A vocabulary with ids beyond uint16: 256 byte tokens, one merge with id 70000.
        printable = [b for b in range(256) if 33 <= b <= 126 or 161 <= b <= 172 or 174 <= b <= 255]
        byte_char, extra = {}, 0
        for b in range(256):   # GPT-2's bytes_to_unicode, written independently
            if b in printable:
                byte_char[b] = chr(b)
            else:
                byte_char[b] = chr(256 + extra)
                extra += 1
        encoder = {byte_char[b]: b for b in range(256)}
        encoder["ab"] = 70000
        encoder["<|endoftext|>"] = 70001
        big_encoder = os.path.join(tmp, "big_encoder.json")
        big_vocab = os.path.join(tmp, "big_vocab.bpe")
        json.dump(encoder, open(big_encoder, "w"))
        open(big_vocab, "w").write("#version: 0.2\na b\n")
        expect_error("token ids above 65535", [book, "--out-dir", bad_dir, "--encoder", big_encoder, "--vocab", big_vocab],
                     "70001", "uint16")
        leftovers = [f for f in os.listdir(bad_dir) if f.endswith(".bin") and not f.startswith("invalid")]
        report(leftovers == [], "failed runs leave no shards behind", str(leftovers))
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
