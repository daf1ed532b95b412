#!/usr/bin/env bash
# test_emu_gpu_comm_check.sh — build/gpu_comm_check (llmc/parallel/comm_nccl.cuh's collectives must give exact
# sums) on the CPU emulation of CUDA, where a one-GPU machine cannot go: the NCCL path with 2, 3 and
# 4 ranks (CUDA_EMU_DEVICES=4: a GPU per rank, NCCL stood in for over MPI, test/emu/nccl_standin.cpp),
# and the host-staged path with 2 ranks sharing one GPU. On a GPU machine `make gpu-check` runs the
# real one. Each run's PASS/FAIL lines are rank 0's verdict over all ranks, tagged with the setting.
cd "$(dirname "$0")/.."
exe=build/emu/gpu_comm_check
if [ ! -x "$exe" ]; then
    echo "SKIP: gpu_comm_check under the CUDA emulation ($exe is not built: it needs CUDA's headers and MPI)"
    exit 0
fi
if ! command -v mpirun >/dev/null; then
    echo "SKIP: gpu_comm_check under the CUDA emulation (no mpirun)"
    exit 0
fi
status=0
run() {  # run DEVICES RANKS LABEL
    local out code
    out=$(CUDA_EMU_DEVICES=$1 timeout 300 mpirun --allow-run-as-root --oversubscribe --bind-to none -np "$2" "$exe" 2>&1)
    code=$?
    printf '%s\n' "$out" | sed -n -e "s/^\(PASS\|FAIL\): /\1: $3: /p"
    if [ $code -ne 0 ]; then
        printf '%s\n' "$out" | grep -q '^FAIL' || echo "FAIL: $3: gpu_comm_check exited with $code: $(printf '%s' "$out" | tail -c 600)"
        status=1
    fi
    printf '%s\n' "$out" | grep -q '^PASS' || { echo "FAIL: $3: no check ran"; status=1; }
}
run 4 2 "NCCL, 2 ranks"
run 4 3 "NCCL, 3 ranks"
run 4 4 "NCCL, 4 ranks"
run 1 2 "host-staged, 2 ranks on one GPU"
exit $status
