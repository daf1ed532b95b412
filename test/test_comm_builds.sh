#!/usr/bin/env bash
# test_comm_builds.sh — every build of the communication layer compiles, including the ones this
# machine cannot run:
#   - the CPU trainer without MPI (a user without Open MPI must still get a single-rank trainer), and
#     the communication benchmark (dev/comm/comm_bench.cpp);
#   - llmc/parallel/comm_nccl.cuh (NCCL + CUDA) through test/gpu_comm_check.cu, with nvcc, without and with
#     MPI, and linked against NCCL when its library is present (so every NCCL call it names exists);
#   - the GPU trainer without MPI, linked (one GPU, or many under srun with NCCL alone; `make` builds
#     it with MPI when mpicxx is installed, so that build is checked by make itself).
# Running gpu_comm_check needs GPUs: see its header.
cd "$(dirname "$0")/.." || exit 1
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
failed=0

check() {  # check NAME COMMAND...: PASS if the command succeeds, else FAIL with its last lines
    local name=$1
    shift
    if "$@" >"$tmp/log" 2>&1; then
        echo "PASS: $name"
    else
        echo "FAIL: $name: $(tail -n 5 "$tmp/log" | tr '\n' ' ')"
        failed=1
    fi
}

CXX=${CXX:-g++}
check "the CPU trainer compiles without MPI (single rank)" \
    "$CXX" -std=c++17 -fopenmp -I. -Wall -Wextra -Wno-unused-parameter -Werror -fsyntax-only train_gpt_cpu.cpp
check "the communication benchmark compiles without MPI (single rank)" \
    "$CXX" -std=c++17 -I. -Wall -Wextra -Wno-unused-parameter -Werror -fsyntax-only dev/comm/comm_bench.cpp

NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
if [ -z "$NVCC" ]; then
    echo "SKIP: comm_nccl.cuh compiles with nvcc (nvcc is not installed)"
    exit $failed
fi
CUDA_HOME=$(dirname "$(dirname "$NVCC")")
if [ ! -f "$CUDA_HOME/include/nccl.h" ] && [ ! -f /usr/include/nccl.h ]; then
    echo "SKIP: comm_nccl.cuh compiles with nvcc (no nccl.h next to nvcc or in /usr/include)"
    exit $failed
fi
check "comm_nccl.cuh compiles with nvcc, without MPI (srun + rendezvous)" \
    "$NVCC" -std=c++17 -I. -Xcompiler -Wall -c test/gpu_comm_check.cu -o "$tmp/nompi.o"
if [ -e "$CUDA_HOME/lib64/libnccl.so" ] || [ -e /usr/lib/x86_64-linux-gnu/libnccl.so ]; then
    check "train_gpt compiles and links without MPI (sm_90 only)" \
        "$NVCC" -std=c++17 -I. -Xcompiler -fopenmp -arch=sm_90 train_gpt.cu -o "$tmp/train_gpt_nompi" \
        -L"$CUDA_HOME/lib64" -lcublasLt -lcublas -lcudnn -lnccl
    if [ -x "$tmp/train_gpt_nompi" ] && ldd "$tmp/train_gpt_nompi" | grep -q libmpi; then
        echo "FAIL: train_gpt without MPI does not link libmpi: it does"
        failed=1
    fi
fi
if command -v mpicxx >/dev/null; then
    if [ -e "$CUDA_HOME/lib64/libnccl.so" ] || [ -e /usr/lib/x86_64-linux-gnu/libnccl.so ]; then
        check "comm_nccl.cuh compiles with nvcc and MPI and links against NCCL" \
            "$NVCC" -std=c++17 -I. -DUSE_MPI -ccbin mpicxx test/gpu_comm_check.cu -o "$tmp/gpu_comm_check" \
            -L"$CUDA_HOME/lib64" -lnccl
    else
        check "comm_nccl.cuh compiles with nvcc and MPI (no libnccl to link)" \
            "$NVCC" -std=c++17 -I. -DUSE_MPI -ccbin mpicxx -c test/gpu_comm_check.cu -o "$tmp/mpi.o"
    fi
else
    echo "SKIP: comm_nccl.cuh compiles with nvcc and MPI (mpicxx is not installed)"
fi
exit $failed
