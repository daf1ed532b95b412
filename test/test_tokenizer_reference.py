#!/usr/bin/env python3
"""Exactness of our GPT-2 tokenizer against an independent one: js-tiktoken (encoding "gpt2").

Every check runs our ./tokenize_text and node (test/tiktoken_reference.js) on the same bytes and
requires identical token ids:
  - the whole default corpus (Moby Dick) and the second corpus (State of the Union), on all threads
    and with many threads, so the parallel split is exercised;
  - test/data/unicode_stress.txt (mixed scripts, combining marks, emoji, digits next to letters,
    whitespace runs, apostrophes), and decode(encode(x)) == x on it;
  - invalid UTF-8 byte strings (the reference decodes them with the WHATWG TextDecoder);
  - random strings drawn from the characters where the regex's branches meet;
and our Unicode class table (from Debian's unicode-data) is compared with node's regex engine for
every code point assigned in both Unicode versions.

Needs: ./tokenize_text (make), data/gpt2 (scripts/get_vocab.sh), test/node_modules
(scripts/setup_node_tests.sh); corpora from scripts/get_corpus.sh. Missing pieces give SKIP lines.
"""
import os
from checks import report, exit_code
import random
import shutil
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOL = os.path.join(ROOT, "tokenize_text")
REFERENCE = os.path.join(ROOT, "test", "tiktoken_reference.js")


def skip(name, why):
    print(f"SKIP: {name} ({why})", flush=True)


def ours(paths, *flags):
    out = subprocess.run([TOOL, *flags, *paths], cwd=ROOT, capture_output=True, check=True).stdout
    lines = out.decode().split("\n")
    return [line.split() for line in lines[: len(paths)]]


def reference(paths):
    out = subprocess.run(["node", REFERENCE, "encode", *paths], cwd=ROOT, capture_output=True, check=True).stdout
    lines = out.decode().split("\n")
    return [line.split() for line in lines[: len(paths)]]


def first_difference(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return f"first difference at token {i}: ours {a[i:i + 5]} vs reference {b[i:i + 5]}"
    return f"lengths differ: ours {len(a)} tokens, reference {len(b)}"


def compare_files(name, paths, *flags):
    for path, got, ref in zip(paths, ours(paths, *flags), reference(paths)):
        if got != ref:
            report(False, name, f"{os.path.basename(path)}: {first_difference(got, ref)}")
            return
    report(True, name)


def read_ranges(text, columns):
    """Per-code-point arrays from 'first last v1 [v2]' lines (hex code points)."""
    arrays = [bytearray(0x110000) for _ in range(columns)]
    for line in text.split("\n"):
        if not line:
            continue
        fields = line.split()
        first, last = int(fields[0], 16), int(fields[1], 16)
        for c in range(columns):
            arrays[c][first:last + 1] = bytes([int(fields[2 + c])]) * (last - first + 1)
    return arrays


def assigned_in_debian_unicode():
    """Code points that /usr/share/unicode/UnicodeData.txt lists (ranges included)."""
    assigned = bytearray(0x110000)
    first = None
    with open("/usr/share/unicode/UnicodeData.txt", encoding="utf-8") as f:
        for line in f:
            fields = line.split(";")
            cp = int(fields[0], 16)
            if fields[1].endswith(", First>"):
                first = cp
            elif fields[1].endswith(", Last>"):
                assigned[first:cp + 1] = b"\x01" * (cp - first + 1)
            else:
                assigned[cp] = 1
    return assigned


def check_char_classes():
    our_class, = read_ranges(subprocess.run([TOOL, "--char-classes"], capture_output=True, check=True,
                                            text=True).stdout, 1)
    node_class, node_unassigned = read_ranges(subprocess.run(["node", REFERENCE, "char-classes"], capture_output=True,
                                                             check=True, text=True).stdout, 2)
    debian_assigned = assigned_in_debian_unicode()
    compared = differ = newer = 0
    examples = []
    for cp in range(0x110000):
        if 0xD800 <= cp <= 0xDFFF:
            continue   # surrogates are not characters; UTF-8 cannot carry them
        if debian_assigned[cp] and not node_unassigned[cp]:
            compared += 1
            if our_class[cp] != node_class[cp]:
                differ += 1
                if len(examples) < 5:
                    examples.append(f"U+{cp:04X} ours {our_class[cp]} node {node_class[cp]}")
        elif our_class[cp] != node_class[cp]:
            newer += 1   # assigned only in node's newer Unicode: expected to differ
    report(differ == 0 and compared > 280000, f"unicode classes match node's regex on {compared} assigned code points",
           f"{differ} differ: {', '.join(examples)}")
    print(f"   note: {newer} code points assigned only in node's newer Unicode are classed differently", flush=True)
    return debian_assigned, node_unassigned


INVALID_UTF8 = [
    b"\x80", b"\xbf", b"a\x80b", b"\xc0\x80", b"\xc1\xbf", b"\xc2", b"\xc2a", b"\xc3\x28",
    b"\xe0\x80\x80", b"\xe0\x9f\xbf", b"\xe2\x82", b"\xe2\x82a", b"\xe2\x28\xa1",
    b"\xed\xa0\x80", b"\xed\xbf\xbf", b"\xef\xbf", b"\xf0\x80\x80\x80", b"\xf0\x8f\xbf\xbf",
    b"\xf0\x9f\x98", b"\xf0\x9f\x98 ok", b"\xf0\x9f", b"\xf4\x90\x80\x80", b"\xf5\x80\x80\x80",
    b"\xf8\x88\x80\x80\x80", b"\xfc\x84\x80\x80\x80\x80", b"\xfe", b"\xff", b"\xff\xfe\xfd",
    b"hello \xff world", b" \xe2\x82 x", b"it\x92s", b"caf\xe9", b"\xc3\xa9\xe9\xc3\xa9",
    b"\xf0\x9f\x98\x80\xf0\x9f\x98", b"\xe0\xa0", b"a\xed\x9f\xbfb\xed\xa0\x80",
    bytes(range(0x80, 0x100)), bytes(range(0, 0x100)) * 2,
]

# The characters where the regex's branches meet: spaces of several kinds, letters with and
# without combining marks, digits of several scripts, apostrophes and contraction letters.
FUZZ_ALPHABET = [" ", " ", " ", "\n", "\t", "\r", "\u00a0", "\u3000", "\u2028", "\ufeff", "\u0085", "\u200b",
                 "'", "'", "s", "t", "re", "ve", "m", "ll", "d", "S", "a", "Z", "é", "e\u0301", "\u0301",
                 "ß", "я", "中", "ー", "ｶ", "1", "9", "٣", "½", "²", "Ⅻ", "𝟘", ".", ",", "!", "-", "_", "<|endoftext|>",
                 "😀", "👍🏽", "\u200d", "€", "$", "\x00", "\x1c", "\x7f", "\ufffd", "𝐀"]


def main():
    missing = []
    if not os.access(TOOL, os.X_OK):
        missing.append("./tokenize_text not built: run make")
    if not os.path.exists(os.path.join(ROOT, "data/gpt2/encoder.json")):
        missing.append("no data/gpt2: run scripts/get_vocab.sh")
    if not shutil.which("node"):
        missing.append("node not installed")
    elif not os.path.exists(os.path.join(ROOT, "test/node_modules/js-tiktoken")):
        missing.append("no js-tiktoken: run scripts/setup_node_tests.sh")
    if missing:
        skip("tokenizer vs js-tiktoken", "; ".join(missing))
        return 0

    debian_assigned, node_unassigned = check_char_classes()

    stress = os.path.join(ROOT, "test/data/unicode_stress.txt")
    stress_text = open(stress, encoding="utf-8").read()
    outside = [f"U+{ord(ch):04X}" for ch in set(stress_text) if not debian_assigned[ord(ch)] or node_unassigned[ord(ch)]]
    report(not outside, "stress text uses only characters assigned in both Unicode versions", ", ".join(outside))
    compare_files("unicode stress text matches js-tiktoken", [stress])
    ids = " ".join(ours([stress])[0])
    decoded = subprocess.run([TOOL, "--decode"], input=ids.encode(), capture_output=True, check=True, cwd=ROOT).stdout
    report(decoded == open(stress, "rb").read(), "decode(encode(stress text)) == stress text")

    with tempfile.TemporaryDirectory() as tmp:
        paths = []
        for i, case in enumerate(INVALID_UTF8):
            paths.append(os.path.join(tmp, f"invalid_{i}.bin"))
            open(paths[-1], "wb").write(case)
        compare_files(f"{len(INVALID_UTF8)} invalid UTF-8 inputs match js-tiktoken on TextDecoder's text", paths)

        rng = random.Random(1234)
        paths = []
        for i in range(200):
            pieces = [rng.choice(FUZZ_ALPHABET) for _ in range(rng.randint(1, 60))]
            paths.append(os.path.join(tmp, f"fuzz_{i}.txt"))
            open(paths[-1], "w", encoding="utf-8", newline="").write("".join(pieces))
        compare_files("200 random strings of regex-boundary characters match js-tiktoken", paths)

        # Any character at all: random code points assigned in both Unicode versions (letters,
        # marks, numbers, symbols, spaces of every script and plane), mixed with ASCII glue.
        candidates = [cp for cp in range(0x110000) if debian_assigned[cp] and not node_unassigned[cp]
                      and not 0xD800 <= cp <= 0xDFFF]
        paths = []
        for i in range(100):
            chars = [chr(rng.choice(candidates)) if rng.random() < 0.6 else rng.choice(" '\nsa1.")
                     for _ in range(rng.randint(1, 80))]
            paths.append(os.path.join(tmp, f"any_{i}.txt"))
            open(paths[-1], "w", encoding="utf-8", newline="").write("".join(chars))
        compare_files("100 random strings of any assigned characters match js-tiktoken", paths)

    corpora = [("moby-dick", os.path.join(ROOT, "data/downloads/moby-dick/moby-dick.txt"), "get_corpus.sh moby-dick"),
               ("sotu", os.path.join(ROOT, "data/downloads/sotu"), "get_corpus.sh sotu")]
    for name, path, fix in corpora:
        if not os.path.exists(path):
            skip(f"{name} corpus matches js-tiktoken", f"not downloaded: run scripts/{fix}")
            continue
        files = [path] if os.path.isfile(path) else sorted(os.path.join(path, f) for f in os.listdir(path))
        with tempfile.TemporaryDirectory() as tmp:
            whole = os.path.join(tmp, name + ".txt")   # one file, so one node run
            with open(whole, "wb") as out:
                for f in files:
                    out.write(open(f, "rb").read())
            size = os.path.getsize(whole)
            compare_files(f"whole {name} corpus ({size / 1e6:.1f} MB) matches js-tiktoken", [whole])
            if name == "moby-dick":
                # Many threads means many parts: every cut must leave the tokens unchanged.
                compare_files(f"{name} on 1 thread matches", [whole], "--threads", "1")
                compare_files(f"{name} on 13 threads matches", [whole], "--threads", "13")
    return exit_code()


if __name__ == "__main__":
    sys.exit(main())
