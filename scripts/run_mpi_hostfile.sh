#!/usr/bin/env bash
# run_mpi_hostfile.sh — data-parallel training on MANY machines with mpirun and a hostfile.
#
#   scripts/run_mpi_hostfile.sh HOSTFILE NP [trainer flags...]
#   scripts/run_mpi_hostfile.sh hosts.txt 16 --model d24 --zero 1 --out-dir /shared/runs/d24
#
# HOSTFILE lists the machines and how many ranks each takes (one per GPU for the GPU trainer):
#     node01 slots=8
#     node02 slots=8
# Requirements, checked by nothing but your run:
#   - password-less ssh from this machine to every node (mpirun starts the ranks over ssh);
#   - the same paths everywhere: the program, the data, and --out-dir on a filesystem every node
#     shares (rank 0 creates each checkpoint directory, every rank writes its shard into it);
#   - the same build of Open MPI on every node.
# Environment: TRAINER (default: ./train_gpt when it is built and this machine has a GPU, else
# ./train_gpt_cpu; GPU ranks take GPU <local rank> of their node, so give each node as many slots as
# GPUs), THREADS (CPU trainer: OpenMP threads per rank, default 1), MPIRUN, and FORWARD: extra
# variables to pass to every rank besides PATH and LD_LIBRARY_PATH (default: NCCL_DEBUG
# NCCL_SOCKET_IFNAME NCCL_IB_HCA, when set).
set -euo pipefail
if [ $# -lt 2 ] || ! [[ $2 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 HOSTFILE NP [trainer flags...]" >&2
    exit 2
fi
HOSTFILE=$1
NP=$2
shift 2
if [ -z "${TRAINER:-}" ]; then
    if [ -x ./train_gpt ] && nvidia-smi -L >/dev/null 2>&1; then TRAINER=./train_gpt; else TRAINER=./train_gpt_cpu; fi
fi
MPIRUN=${MPIRUN:-mpirun}
if [ ! -f "$HOSTFILE" ]; then
    echo "error: hostfile '$HOSTFILE' not found: write one line per node, 'NAME slots=RANKS'" >&2
    exit 1
fi
command -v "$MPIRUN" >/dev/null || { echo "error: $MPIRUN not found: install Open MPI" >&2; exit 1; }

args=(--hostfile "$HOSTFILE" -np "$NP")
[ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)
# ranks start with ssh's bare environment: pass on what they need
args+=(--bind-to none -x OMP_NUM_THREADS="${THREADS:-1}")
for var in PATH LD_LIBRARY_PATH ${FORWARD:-NCCL_DEBUG NCCL_SOCKET_IFNAME NCCL_IB_HCA}; do
    [ -n "${!var:-}" ] && args+=(-x "$var")
done

cmd=("$MPIRUN" "${args[@]}" "$TRAINER" "$@")
echo "+ ${cmd[*]}"
exec "${cmd[@]}"
