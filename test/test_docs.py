#!/usr/bin/env python3
"""test_docs.py — the README stays a map, and every link in the docs leads somewhere (no build needed).

  links         every relative link and image in README.md and docs/*.md names a file or folder that
                exists, and every #anchor names a heading of that file, spelled as GitHub spells it
                (lower case, punctuation dropped, spaces to '-', a repeated heading gets -1, -2, ...)
  README size   README.md has at most 2,500 words (counted as `wc -w` counts them)
  table cells   each cell of the README's technique table has at most 25 words: the file, the test,
                the doc link; the details live in docs/
  line counts   every line count that docs/reading-path.md quotes for a file (a table row
                "| `path` | N | ..." ) is that file's `wc -l` today: a reading path with stale counts
                misleads the reader it is written for; a "| **total** | N |" row is the sum of the
                counted rows above it in its table

Planted by hand and caught: a link to docs/memory.md#no-such-heading, a link to docs/missing.md, a
cell of 26 words, and a reading-path count off by one each gave one FAIL naming the file and line.
"""
import glob, os, re, sys
from checks import report, exit_code

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
MAX_README_WORDS = 2500
MAX_CELL_WORDS = 25

LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)(?:\s+\"[^\"]*\")?\)")
HEADING = re.compile(r"^(#{1,6})\s+(.*?)\s*#*\s*$")


def prose_lines(text):
    """(line number, line) outside fenced code blocks: a '#' or a link inside ``` is not markdown."""
    fenced = False
    for n, line in enumerate(text.split("\n"), 1):
        if line.lstrip().startswith("```"):
            fenced = not fenced
            continue
        if not fenced:
            yield n, line


def slug(heading):
    """GitHub's anchor for a heading: the rendered text (code spans' text kept, links' text kept),
    lower case, every character that is not a letter, digit, '_', '-' or space dropped, spaces to '-'."""
    text = re.sub(r"\[([^\]]*)\]\([^)]*\)", r"\1", heading)
    text = text.replace("`", "").replace("*", "")
    text = text.strip().lower()
    text = "".join(c for c in text if c.isalnum() or c in "_- ")
    return text.replace(" ", "-")


def anchors(path, cache={}):
    if path not in cache:
        seen, found = {}, set()
        with open(path, encoding="utf-8") as f:
            text = f.read()
        for _, line in prose_lines(text):
            m = HEADING.match(line)
            if not m:
                continue
            s = slug(m.group(2))
            k = seen.get(s, 0)
            found.add(s if k == 0 else f"{s}-{k}")
            seen[s] = k + 1
        found.update(re.findall(r"<a\s+(?:name|id)=\"([^\"]+)\"", text))
        cache[path] = found
    return cache[path]


def check_links(md_files):
    bad, count = [], 0
    for md in md_files:
        with open(md, encoding="utf-8") as f:
            text = f.read()
        for n, line in prose_lines(text):
            line = re.sub(r"`[^`]*`", "", line)  # a link written inside a code span is not a link
            for target in LINK.findall(line):
                if re.match(r"^[a-z][a-z0-9+.-]*:", target):  # https:, mailto:
                    continue
                count += 1
                where = f"{os.path.relpath(md, ROOT)}:{n}"
                file_part, _, anchor = target.partition("#")
                dest = md if not file_part else os.path.normpath(os.path.join(os.path.dirname(md), file_part))
                if not os.path.exists(dest):
                    bad.append(f"{where}: {target} (no such file)")
                elif anchor:
                    if not dest.endswith(".md"):
                        bad.append(f"{where}: {target} (an anchor into a file that is not markdown)")
                    elif anchor not in anchors(dest):
                        bad.append(f"{where}: {target} (no such heading in {os.path.relpath(dest, ROOT)})")
    return bad, count


def technique_table(readme):
    """The rows (line number, cells) of the first table after the heading that names the techniques."""
    rows, in_section, started = [], False, False
    for n, line in prose_lines(readme):
        if HEADING.match(line):
            if started:
                break
            in_section = "technique" in line.lower()
            continue
        if in_section and line.startswith("|"):
            started = True
            cells = [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]
            if all(re.fullmatch(r":?-+:?", c) for c in cells):
                continue
            rows.append((n, cells))
        elif started:
            break
    return rows


def check_reading_path(path):
    """Rows '| `file` | N |': N must be the file's line count; '| **total** | N |': the sum of the
    counted rows above it in the same table."""
    bad, count = [], 0
    with open(path, encoding="utf-8") as f:
        text = f.read()
    since_total = 0
    for n, line in prose_lines(text):
        if not line.startswith("|"):
            since_total = 0  # a total adds up its own table only
            continue
        t = re.match(r"^\|\s*\*\*total\*\*\s*\|\s*(\d+)\s*\|", line)
        if t:
            count += 1
            if int(t.group(1)) != since_total:
                bad.append(f"docs/reading-path.md:{n}: the rows above add up to {since_total}, the total says {t.group(1)}")
            since_total = 0
            continue
        m = re.match(r"^\|\s*`([^`]+)`[^|]*\|\s*(\d+)\s*\|", line)
        if not m:
            continue
        count += 1
        file, quoted = m.group(1), int(m.group(2))
        full = os.path.join(ROOT, file)
        if not os.path.isfile(full):
            bad.append(f"docs/reading-path.md:{n}: {file} (no such file)")
            continue
        with open(full, "rb") as f:
            actual = f.read().count(b"\n")
        since_total += actual
        if actual != quoted:
            bad.append(f"docs/reading-path.md:{n}: {file} has {actual} lines, the doc says {quoted}")
    return bad, count


def main():
    readme_path = os.path.join(ROOT, "README.md")
    md_files = [readme_path] + sorted(glob.glob(os.path.join(ROOT, "docs", "*.md")))
    bad, count = check_links(md_files)
    report(not bad and count > 0, "links: every relative link and #anchor in README.md and docs/*.md resolves",
           "; ".join(bad[:20]) + (f" (and {len(bad) - 20} more)" if len(bad) > 20 else "") or "no links found",
           f"{count} links in {len(md_files)} files")

    with open(readme_path, encoding="utf-8") as f:
        readme = f.read()
    words = len(readme.split())
    report(words <= MAX_README_WORDS, f"README size: at most {MAX_README_WORDS} words",
           f"{words} words", f"{words} words")

    rows = technique_table(readme)
    long_cells = [f"README.md:{n}: column {i + 1} has {len(c.split())} words"
                  for n, cells in rows for i, c in enumerate(cells) if len(c.split()) > MAX_CELL_WORDS]
    widest = max((len(c.split()) for _, cells in rows for c in cells), default=0)
    report(len(rows) > 10 and not long_cells, f"table cells: the technique table's cells at most {MAX_CELL_WORDS} words",
           "; ".join(long_cells) or f"only {len(rows)} rows found", f"{len(rows) - 1} techniques, widest cell {widest} words")

    reading = os.path.join(ROOT, "docs", "reading-path.md")
    if os.path.exists(reading):
        bad, count = check_reading_path(reading)
        report(not bad and count > 0, "line counts: docs/reading-path.md's counts are the files' wc -l",
               "; ".join(bad) or "no counted rows", f"{count} rows")
    else:
        report(False, "line counts: docs/reading-path.md exists", "missing")
    sys.exit(exit_code())


if __name__ == "__main__":
    main()
