#!/usr/bin/env bash
# run.sh — the main job, from a fresh machine: set up, build, prepare the default corpus (Moby Dick,
# tokenized with GPT-2's vocabulary), then train a GPT on it and print samples: GPT-2 small (d12) on
# the GPU when there is one, a small GPT on the CPU otherwise. Extra flags are passed to the trainer.
#   scripts/run.sh [trainer flags ...]
set -euo pipefail
cd "$(dirname "$0")/.."
scripts/setup.sh
# build what the job needs: the tools and the CPU trainer, and the GPU trainer only where there is a GPU
targets=(prepare_data train_gpt_cpu)
if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then targets+=(train_gpt); fi
make -j"$(nproc)" "${targets[@]}"
scripts/get_corpus.sh moby-dick
data=(--train-data "data/moby-dick/moby-dick_train_*.bin" --val-data "data/moby-dick/moby-dick_val_*.bin")
if [[ -x ./train_gpt ]] && nvidia-smi >/dev/null 2>&1; then
    echo "run: training GPT-2 small (d12) on the GPU"
    # 300 steps of 16k tokens: about 17 passes over Moby Dick's 286k training tokens
    exec ./train_gpt "${data[@]}" --model d12 --batch-size 16 --seq-len 1024 \
        --steps 300 --lr 6e-4 --warmup-steps 30 --val-every 50 --sample-every 100 --sample-tokens 128 --top-k 40 \
        --checkpoint-every 100 --out-dir out/moby-dick-d12 "$@"
else
    echo "run: no GPU found; training a small GPT on the CPU"
    exec ./train_gpt_cpu "${data[@]}" --model L=4,C=128,H=4,T=128 --batch-size 8 --seq-len 128 \
        --steps 300 --lr 3e-3 --warmup-steps 20 --val-every 50 --sample-every 100 --sample-tokens 64 --top-k 40 \
        --checkpoint-every 100 --out-dir out/moby-dick-cpu "$@"
fi
