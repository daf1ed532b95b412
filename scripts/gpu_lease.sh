#!/usr/bin/env bash
# gpu_lease.sh — a short GPU lease in one call: everything the project wants to learn from a GPU it
# gets rarely (15 minutes of device time, one call of at most 10), prepared beforehand so that no
# second of the lease goes to building.
#
#   scripts/gpu_lease.sh prepare LLMC_CHECKOUT CUDNN_FRONTEND_CHECKOUT
#       here, on the development machine (no GPU needed): builds the GPU trainer (bf16, fp16, fp32), the
#       GPU tests' programs, the communication check and the kernel lab for Hopper (sm_90), the CPU
#       reference for any x86-64-v3 CPU (the GPU machine's CPU is another), and llm.c's train_gpt2cu
#       (scripts/build_llmc_gpu.sh) into .lease/ (git-ignored; ~30 MiB): carry that one folder.
#       Without the two checkouts llm.c is left out and its rows are skipped.
#   scripts/gpu_lease.sh run
#       on the GPU machine, in the repository root (the device tool: command
#       "bash scripts/gpu_lease.sh run", carry [".lease"], timeout 560): installs the carried binaries,
#       then, in order of what matters most, each phase under its own timeout and skipped when the
#       time left (GPU_LEASE_BUDGET seconds, default 500) cannot hold it:
#         1. bench16   d12 B=16 T=1024: train_gpt (bf16; --recompute 0, whose GELU runs in cuBLASLt's
#                      epilogues; and each of --precision fp16 (train_gpt_fp16), --cuda-graphs,
#                      --precision fp8 that this commit's --help offers) beside PyTorch eager,
#                      torch.compile and llm.c (scripts/bench_gpu_vs_peers.py), and the goals of
#                      issue 28: >= 1.15x llm.c, >= 1.5x PyTorch eager, MFU >= 50%
#         2. tests     the one-GPU tests (scripts/gpu_check.sh's "tests" part)
#         3. bench     d12 B=64 and d48 B=8 against PyTorch eager and llm.c
#         4. lab       the kernel lab's table (scripts/kernel_lab.sh, prebuilt): every version of
#                      every kernel; not yet timed on a GPU, to read first: adamw 4,
#                      layernorm_backward 4, encoder_backward 4, softmax_backward 4 (each against
#                      the version 3 it replaced), matmul_bias_gelu 4, matmul_dgelu_bgrad 1-3
#       It writes summary.md (every table, ready for docs/benchmarks.md), and logs.tar.gz (every log)
#       to $OUT (the device tool's folder that comes back), or to out/gpu_lease_result/ without one.
# Record what comes back in docs/benchmarks.md with the GPU, the commit (in summary.md) and the command.
set -uo pipefail
cd "$(dirname "$0")/.."
LEASE=.lease

prepare() {
    local llmc=${1:-} frontend=${2:-}
    command -v nvcc >/dev/null || [ -x /usr/local/cuda/bin/nvcc ] || { echo "error: prepare needs nvcc (the CUDA toolkit)" >&2; exit 1; }
    # Build from a copy of the tracked files, so the developer's own (-march=native) binaries stay.
    local src
    src=$(mktemp -d /tmp/gpu_lease_src.XXXXXX)
    trap 'rm -rf "$src"' RETURN
    git ls-files -z | xargs -0 cp --parents -t "$src"
    local sm90="-gencode arch=compute_90,code=sm_90"
    local cpu="-O3 -march=x86-64-v3 -ffp-contract=fast -fno-math-errno -std=c++17 -Wall -Wextra -Wno-unused-parameter -fopenmp -I."
    echo "== building for sm_90 and x86-64-v3 in $src (several minutes on 2 cores)"
    make -C "$src" -j"$(nproc)" CUDA_ARCH="$sm90" CXXFLAGS="$cpu" \
        train_gpt train_gpt_fp16 train_gpt_fp32 train_gpt_cpu build/test_gpu_host build/test_gpu_buffers build/gpu_comm_check build/fp8_check \
        || { echo "error: the build failed (above)" >&2; exit 1; }
    make -C "$src/dev/cuda" -j"$(nproc)" -B CUDA_ARCH="$sm90" \
        HOST_FLAGS="-Xcompiler -march=x86-64-v3,-ffp-contract=fast,-fno-math-errno -diag-suppress 1675" \
        || { echo "error: the kernel lab's build failed (above)" >&2; exit 1; }
    rm -rf "$LEASE"
    mkdir -p "$LEASE/bin/build/dev"
    cp "$src"/train_gpt "$src"/train_gpt_fp16 "$src"/train_gpt_fp32 "$src"/train_gpt_cpu "$LEASE/bin/"
    cp "$src"/build/test_gpu_host "$src"/build/test_gpu_buffers "$src"/build/gpu_comm_check "$src"/build/fp8_check "$LEASE/bin/build/"
    cp -r "$src"/build/dev/. "$LEASE/bin/build/dev/"
    if [ -n "$llmc" ] && [ -n "$frontend" ]; then
        bash scripts/build_llmc_gpu.sh "$llmc" "$frontend" "$LEASE/llmc" 90 >"$LEASE/llmc_build.log" 2>&1 \
            || { tail -20 "$LEASE/llmc_build.log"; echo "error: llm.c's build failed" >&2; exit 1; }
    else
        echo "note: no llm.c checkout given: the lease runs without llm.c's rows"
    fi
    local dirty=""
    [ -n "$(git status --porcelain --untracked-files=no)" ] && dirty=" (with uncommitted changes)"
    echo "commit $(git rev-parse --short HEAD)$dirty, prepared $(date -u '+%Y-%m-%d %H:%M UTC')" >"$LEASE/commit.txt"
    echo "prepared: $(cat "$LEASE/commit.txt"); $(du -sh "$LEASE" | cut -f1) in $LEASE/ (carry it)"
}

# --- run: on the GPU machine ----------------------------------------------------------------------
START=$SECONDS
BUDGET=${GPU_LEASE_BUDGET:-500}
LOGS=out/gpu_lease
PYTHON=${PYTHON:-python3}
declare -a SUMMARY=()
left() { echo $((BUDGET - (SECONDS - START))); }
note() { SUMMARY+=("$*"); echo "$*"; }

phase() {  # name, seconds it needs at least, seconds it may take at most, command...
    local name=$1 least=$2 most=$3
    shift 3
    local t0=$SECONDS
    if [ "$(left)" -lt "$least" ]; then note "SKIP  $name: $(left) s left, it needs $least"; return; fi
    [ "$most" -gt "$(left)" ] && most=$(left)
    echo "== $name (at most $most s)"
    timeout --kill-after=10 "$most" "$@" 2>&1 | tee "$LOGS/$name.log"
    local rc=${PIPESTATUS[0]}
    case $rc in
        0) note "PASS  $name ($((SECONDS - t0)) s)" ;;
        124 | 137) note "FAIL  $name: stopped at its $most s limit" ;;
        *) note "FAIL  $name: exit $rc (see $name.log)" ;;
    esac
}

ours_variants() {  # the --ours-variant flags for the precisions and modes this commit's trainer offers
    local help
    help=$(./train_gpt --help 2>&1)
    # --recompute 0 is the level whose MLP runs GELU in cuBLASLt's epilogues (llmc/kernels/gelu.cuh)
    printf '%s\0' --ours-variant "gelu-epilogues=--recompute 0"
    grep -q "fp16" <<<"$help" && printf '%s\0' --ours-variant "fp16=--precision fp16"
    grep -q -- "--cuda-graphs" <<<"$help" && printf '%s\0' --ours-variant "graphs=--cuda-graphs"
    # (the flag, not the word: --stash-precision's help has said "fp8" since before fp8 matmuls existed)
    grep -q -- "--fp8-amax-history" <<<"$help" && printf '%s\0' --ours-variant "fp8=--precision fp8"
}

goals() {  # issue 28's goals, read off the d12 B=16 table
    local table=$LOGS/bench16.log
    awk -F'|' '
        /^\| train_gpt \(this project\)/ { mfu = $5; gsub(/[ %]/, "", mfu) }
        /^\| PyTorch eager/ { eager = $7; gsub(/[ x]/, "", eager) }
        /^\| llm\.c/ { if (llmc == "") { llmc = $7; gsub(/[ x]/, "", llmc) } }
        END {
            if (mfu == "") { print "GOAL  d12 B=16: no train_gpt row"; exit }
            printf "GOAL  d12 B=16 MFU >= 50%%: %s%% %s\n", mfu, (mfu >= 50 ? "met" : "NOT met")
            if (eager != "") printf "GOAL  d12 B=16 >= 1.5x PyTorch eager: %sx %s\n", eager, (eager >= 1.5 ? "met" : "NOT met")
            if (llmc != "") printf "GOAL  d12 B=16 >= 1.15x llm.c: %sx %s\n", llmc, (llmc >= 1.15 ? "met" : "NOT met")
        }' "$table"
}

run() {
    nvidia-smi -L >/dev/null 2>&1 || { echo "error: no GPU here (nvidia-smi fails): 'run' is for the GPU machine; 'prepare' is for here" >&2; exit 1; }
    [ -x "$LEASE/bin/train_gpt" ] || { echo "error: $LEASE/bin/train_gpt is missing: run 'scripts/gpu_lease.sh prepare' here first and carry $LEASE" >&2; exit 1; }
    mkdir -p "$LOGS"
    cp -r "$LEASE/bin/." .
    # The GPU machine's CUDA libraries (cuBLAS, cuDNN, NCCL, nvrtc) live in its Python's site-packages.
    local libs
    libs=$("$PYTHON" -c 'import glob, os, site; print(":".join(sorted(glob.glob(os.path.join(site.getsitepackages()[0], "nvidia", "*", "lib")))))' 2>/dev/null)
    export LD_LIBRARY_PATH=${libs}${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    note "GPU   $(nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader)"
    note "CODE  $(cat "$LEASE/commit.txt" 2>/dev/null || echo 'commit unknown')"
    local llmc=() variants=()
    [ -x "$LEASE/llmc/train_gpt2cu_cudnn" ] && llmc=(--llmc "$LEASE/llmc/train_gpt2cu_cudnn:train_gpt2cu (cuDNN)")
    while IFS= read -r -d '' v; do variants+=("$v"); done < <(ours_variants)
    local peers=ours,pytorch,compile${llmc:+,llmc}
    local bench=("$PYTHON" scripts/bench_gpu_vs_peers.py)

    phase bench16 60 200 "${bench[@]}" --model d12 --batch 16 --peers "$peers" --steps 20 --warmup 5 "${variants[@]}" "${llmc[@]}"
    [ -f "$LOGS/bench16.log" ] && while IFS= read -r line; do note "$line"; done < <(goals)
    phase tests 60 150 env GPU_CHECK_PARTS=tests GPU_CHECK_OUT="$LOGS/gpu_check" bash scripts/gpu_check.sh
    phase bench64 40 90 "${bench[@]}" --model d12 --batch 64 --peers "ours,pytorch${llmc:+,llmc}" --steps 10 --warmup 3 "${llmc[@]}"
    phase bench_d48 40 90 "${bench[@]}" --model d48 --batch 8 --peers "ours,pytorch${llmc:+,llmc}" --steps 8 --warmup 3 "${llmc[@]}"
    phase lab 40 150 env KERNEL_LAB_NO_BUILD=1 KERNEL_LAB_OUT="$LOGS/kernel_lab" KERNEL_LAB_TIMEOUT=60 bash scripts/kernel_lab.sh

    # One file of tables for the docs, and every log in one archive (the device tool returns 8 files).
    local dest=${OUT:-out/gpu_lease_result}
    mkdir -p "$dest"
    {
        echo "# GPU lease, $(date -u '+%Y-%m-%d %H:%M UTC')"
        echo; printf '    %s\n' "${SUMMARY[@]}"
        for name in bench16 bench64 bench_d48; do
            [ -f "$LOGS/$name.log" ] || continue
            echo; echo "## $name"; echo
            grep -E '^(GPU|d[0-9]+ \(|\|)' "$LOGS/$name.log"
        done
        if [ -f "$LOGS/tests.log" ]; then
            echo; echo "## tests"; echo
            grep -E "^(PASS|FAIL|SKIP) " "$LOGS/tests.log" | sed 's/^/    /'
        fi
        [ -f "$LOGS/kernel_lab/table.md" ] && { echo; echo "## kernel lab"; echo; cat "$LOGS/kernel_lab/table.md"; }
    } >"$dest/summary.md"
    tar -czf "$dest/logs.tar.gz" -C "$LOGS" . 2>/dev/null
    echo
    echo "== gpu_lease: $(($SECONDS - START)) s; $dest/summary.md and $dest/logs.tar.gz"
    printf '%s\n' "${SUMMARY[@]}"
    ! printf '%s\n' "${SUMMARY[@]}" | grep -q '^FAIL'
}

case ${1:-run} in
    prepare) shift; prepare "$@" ;;
    run) run ;;
    *) sed -n '2,27p' "$0"; exit 2 ;;
esac
