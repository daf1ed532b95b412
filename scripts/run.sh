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
    # The small GPT: its tied 50257-row embedding is most of its parameters, and the LM head (the
    # 50257-way classifier) most of each step's compute, in proportion to the width C. So a narrow
    # model with more layers learns the most per second: at C=64 the head costs half of C=128's, and
    # each extra layer costs little. Measured on Moby Dick (docs/benchmarks.md, "The main job on the
    # CPU"), comparing configurations at equal compute: L=8, C=64 ended lower than L=4 at C=64, 128,
    # 192 or 256, and LR 1e-2 (cosine to 0) lower than 2e-2.
    out=out/moby-dick-cpu
    echo "run: no GPU found; training a small GPT on the CPU"
    ./train_gpt_cpu "${data[@]}" --model L=8,C=64,H=4,T=64 --batch-size 8 --seq-len 64 \
        --steps 2900 --lr 1e-2 --warmup-steps 30 --val-every 500 --val-batches 40 \
        --sample-every 1450 --sample-tokens 64 --top-k 40 --checkpoint-every 1450 --out-dir "$out" "$@"
    # the loss curve: on the terminal always, as a PNG when matplotlib is there
    python3 scripts/plot_metrics.py "$out" --terminal
    if python3 -c "import matplotlib" 2>/dev/null; then python3 scripts/plot_metrics.py "$out" -o "$out/loss.png"; fi
    last=$(ls -d "$out"/ckpt_* 2>/dev/null | tail -n 1)
    if [[ -n "$last" ]]; then
        echo "checkpoint: $last (model.bin: the weights; state.bin: AdamW and the data position)"
        step=$((10#${last##*ckpt_}))
        echo "  generate:        ./train_gpt_cpu --resume $last --generate \"Call me Ishmael.\" --sample-tokens 200 --top-k 40"
        echo "  train on:        scripts/run.sh --resume latest --steps $((2 * step))   (the LR schedule is stretched to the new step count)"
    fi
fi
