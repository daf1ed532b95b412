#!/usr/bin/env bash
# run_mpi_local.sh — data-parallel training on ONE machine: NP copies of the trainer, one per rank,
# started by mpirun. Each rank trains on its own slice of every batch; after the backward pass the
# ranks sum their gradients (llmc/parallel/comm.h, docs/parallelism.md).
#
#   scripts/run_mpi_local.sh NP [trainer flags...]
#   scripts/run_mpi_local.sh 2 --model d12 --batch-size 4 --total-batch-tokens 32768 --zero 1
#
# Environment:
#   TRAINER   the program to run (default: ./train_gpt when it is built and nvidia-smi sees a GPU,
#             else ./train_gpt_cpu). GPU trainer: rank r of this machine uses GPU r; with more ranks
#             than GPUs, ranks share GPUs and exchange gradients through host memory and MPI (a test
#             mode: 2 or 4 ranks on one GPU must train exactly like one rank; slow)
#   THREADS   CPU trainer: OpenMP threads per rank (default: this machine's cores / NP, at least 1)
#   MPIRUN    the mpirun to use (default: mpirun from PATH)
#
# The script prints the command it runs. mpirun gives each rank OMPI_COMM_WORLD_RANK/SIZE/LOCAL_RANK;
# if any rank fails, mpirun stops them all.
set -euo pipefail
if [ $# -lt 1 ] || ! [[ $1 =~ ^[1-9][0-9]*$ ]]; then
    echo "usage: $0 NP [trainer flags...]   (NP = number of ranks, e.g. 2)" >&2
    exit 2
fi
NP=$1
shift
GPUS=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU' || true)
if [ -z "${TRAINER:-}" ]; then
    if [ -x ./train_gpt ] && [ "$GPUS" -gt 0 ]; then TRAINER=./train_gpt; else TRAINER=./train_gpt_cpu; fi
fi
MPIRUN=${MPIRUN:-mpirun}
if ! command -v "$MPIRUN" >/dev/null; then
    echo "error: $MPIRUN not found. Install Open MPI (Debian: apt-get install openmpi-bin libopenmpi-dev) and rebuild with make" >&2
    exit 1
fi
if [ ! -x "$TRAINER" ]; then
    echo "error: $TRAINER not found or not executable: build it with make, or set TRAINER" >&2
    exit 1
fi
CORES=$(nproc)
THREADS=${THREADS:-$(( CORES / NP > 0 ? CORES / NP : 1 ))}

args=(-np "$NP")
[ "$(id -u)" = 0 ] && args+=(--allow-run-as-root)      # containers often run as root; Open MPI refuses by default
[ "$NP" -gt "$CORES" ] && args+=(--oversubscribe)      # more ranks than cores: allowed, but slow
# the ranks' OpenMP threads must not pile onto one core each, so no binding; OMP_NUM_THREADS splits the cores
args+=(--bind-to none -x OMP_NUM_THREADS="$THREADS")

case $(basename "$TRAINER") in
    train_gpt | train_gpt_fp32)
        if [ "$GPUS" -lt "$NP" ]; then
            echo "note: $NP ranks on $GPUS GPU(s): ranks share GPUs, so gradients go through host memory and MPI (slow)" >&2
        fi ;;
esac
cmd=("$MPIRUN" "${args[@]}" "$TRAINER" "$@")
echo "+ ${cmd[*]}"
exec "${cmd[@]}"
