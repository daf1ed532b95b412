#!/usr/bin/env bash
# Encode throughput of our tokenizer (1 thread and all threads) next to OpenAI's tiktoken (Rust,
# compiled to WebAssembly) and js-tiktoken (JavaScript), on the same text, in one run.
#
#   scripts/bench_tokenizer.sh [FILE...] [--repeat N]
#
# Default text: the two corpora (Moby Dick, 1.2 MB; the State of the Union addresses, 10.8 MB,
# joined into one file). Every time is the best of N runs (default 3); each of our runs starts
# with an empty piece cache, so the cache only helps within a run, as it would on fresh data.
# The script also checks that all three produce the same token ids.
set -euo pipefail
cd "$(dirname "$0")/.."

REPEAT=3
FILES=()
while [ $# -gt 0 ]; do
    case "$1" in
        --repeat) REPEAT=$2; shift 2 ;;
        *) FILES+=("$1"); shift ;;
    esac
done

make --quiet tokenize_text
scripts/get_vocab.sh
scripts/setup_node_tests.sh
TMP=$(mktemp -d)
trap 'rm -rf "$TMP"' EXIT
if [ ${#FILES[@]} -eq 0 ]; then
    scripts/get_corpus.sh moby-dick
    scripts/get_corpus.sh sotu
    cat data/downloads/sotu/*.txt > "$TMP/sotu-all.txt"
    FILES=(data/downloads/moby-dick/moby-dick.txt "$TMP/sotu-all.txt")
fi

THREADS=$(nproc)
echo "machine: $(nproc) cores, $(grep -m1 "model name" /proc/cpuinfo | cut -d: -f2 | sed "s/^ //"), node $(node --version), load average $(cut -d" " -f1-3 /proc/loadavg)"
for FILE in "${FILES[@]}"; do
    echo
    echo "== $(basename "$FILE"): $(stat -c %s "$FILE") bytes, best of $REPEAT"
    ./tokenize_text "$FILE" > "$TMP/ids.txt"
    {
        ./tokenize_text --bench --repeat "$REPEAT" --threads "$THREADS" "$FILE" | sed 's/^bench /bench name=ours /'
        node scripts/bench_tokenizer.js "$FILE" "$TMP/ids.txt" "$REPEAT"
    } > "$TMP/results.txt"
    awk '
        { for (i = 2; i <= NF; i++) { split($i, kv, "="); f[kv[1]] = kv[2] }
          name[NR] = f["name"]; threads[NR] = f["threads"]; speed[NR] = f["mb_per_s"];
          same[NR] = (f["name"] == "ours") ? "-" : f["same_ids_as_ours"];
          if (f["name"] == "tiktoken-wasm") wasm = f["mb_per_s"] }
        END {
          printf "%-14s %8s %10s %16s %10s\n", "tokenizer", "threads", "MB/s", "vs tiktoken-wasm", "same ids"
          for (i = 1; i <= NR; i++)
              printf "%-14s %8s %10.2f %15.2fx %10s\n", name[i], threads[i], speed[i], speed[i] / wasm, same[i]
        }' "$TMP/results.txt"
    if grep -q "same_ids_as_ours=false" "$TMP/results.txt"; then
        echo "error: the tokenizers disagree on $FILE" >&2
        exit 1
    fi
done
