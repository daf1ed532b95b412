#!/usr/bin/env bash
# test.sh — the one command that runs every test on a fresh machine: set-up, build, tests.
# Its last line is always 'N passed, N failed'; it exits non-zero if anything failed.
#   scripts/test.sh [substring ...]    run only the tests whose file name contains a substring
cd "$(dirname "$0")/.."
give_up() { echo "$1"; echo "0 passed, 1 failed"; exit 1; }
scripts/setup.sh --tests || give_up "set-up failed"
make -j"$(nproc)" all || give_up "build failed"
# The corpora the tokenizer and training tests use (idempotent: prepared once).
for corpus in moby-dick sotu; do
    scripts/get_corpus.sh "$corpus" || give_up "preparing the $corpus corpus failed"
done
exec /usr/bin/python3 test/run_tests.py "$@"
