#!/usr/bin/env bash
# Installs the reference tokenizers the tests and benchmarks compare against, into test/node_modules:
#   js-tiktoken  OpenAI's tiktoken ported to plain JavaScript (the exactness reference)
#   tiktoken     the Rust tiktoken compiled to WebAssembly (the speed reference)
# Versions are pinned by test/package.json and test/package-lock.json (npm ci installs exactly those).
# Idempotent: does nothing when the pinned versions are already installed.
set -euo pipefail
cd "$(dirname "$0")/../test"

installed_version() {
    node -p "require('./node_modules/$1/package.json').version" 2>/dev/null || true
}
if [ "$(installed_version js-tiktoken)" = 1.0.21 ] && [ "$(installed_version tiktoken)" = 1.0.22 ]; then
    exit 0
fi
if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
    echo "error: node and npm are needed for the reference-tokenizer tests; install them (apt-get install nodejs npm)" >&2
    exit 1
fi
echo "installing js-tiktoken and tiktoken into test/node_modules ..."
npm ci --ignore-scripts --no-audit --no-fund --loglevel=error
