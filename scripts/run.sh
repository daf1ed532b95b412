#!/usr/bin/env bash
# run.sh — the main job, from a fresh machine: set up, build, prepare the default corpus (Moby Dick,
# tokenized with GPT-2's vocabulary), then train a GPT on it and print samples: GPT-2 small (d12) on
# the GPU when there is one, a small GPT on the CPU otherwise. Extra flags are passed to the trainer
# and win over the job's own.
#   scripts/run.sh [--time-budget SECONDS] [trainer flags ...]
#
# On the CPU the job is sized by time, not by a fixed step count: the whole job, set-up and build
# included, is to end within a budget of 240 seconds from this script's start (--time-budget
# SECONDS, or the environment variable RUN_TIME_BUDGET, changes it). CPUs differ by 2x in speed
# (a 2900-step run took 3 min 32 s on a Zen 5 and 6 min 16 s on a Zen 4), so after the build it
# runs a short calibration: the real trainer and model, 30 steps, into a temporary folder, whose
# metrics log gives the time of a step on this machine now (the median of steps 6-30). The run then
# gets the steps that fit in what is left of the budget, after a reserve for its validations,
# samples, checkpoints and the plot, at most 2900 (the full run, which a fast CPU still gets) and at
# least 300. Validation runs about 4 times, samples and checkpoints at half-way and at the end.
# The calibration measures the machine as it is: a machine busy with other work measures slower
# steps and gets fewer (and if it gets busier later, the run still goes over).
# Passing --steps N skips the calibration and trains N steps (the intervals follow N).
# The GPU branch stays a fixed 300 steps of d12 (seconds on any GPU this project has seen).
#
# Environment (the tests use the last two to drive the arithmetic with a stand-in trainer):
#   RUN_TIME_BUDGET   seconds for the whole CPU job (default 240; --time-budget wins)
#   TRAINER           the CPU trainer (default ./train_gpt_cpu)
#   RUN_SKIP_SETUP=1  skip set-up, build and corpus (a tree already built, or a stand-in trainer)
set -euo pipefail
cd "$(dirname "$0")/.."

budget=${RUN_TIME_BUDGET:-240}
args=()  # the flags for the trainer: everything but --time-budget
while (( $# )); do
    case "$1" in
        --time-budget) budget=${2-}; shift $(( $# > 1 ? 2 : 1 )) ;;
        --time-budget=*) budget=${1#*=}; shift ;;
        *) args+=("$1"); shift ;;
    esac
done
if ! [[ "$budget" =~ ^[0-9]+$ ]] || (( budget < 1 )); then
    echo "error: --time-budget (or RUN_TIME_BUDGET) must be a whole number of seconds, not '$budget'" >&2
    exit 2
fi
set -- "${args[@]}"

# The last value given to a trainer flag, as `--NAME VALUE` or `--NAME=VALUE`, or nothing.
flag_value() {  # flag_value NAME [trainer flags ...]
    local name=$1 value=""
    shift
    while (( $# )); do
        if [[ "$1" == "--$name" ]]; then
            value=${2-}
            if (( $# > 1 )); then shift; fi
        elif [[ "$1" == "--$name="* ]]; then
            value=${1#*=}
        fi
        shift
    done
    printf '%s' "$value"
}

if [[ "${RUN_SKIP_SETUP:-0}" != 1 ]]; then
    scripts/setup.sh
    # build what the job needs: the tools and the CPU trainer, and the GPU trainer only where there is a GPU
    targets=(prepare_data train_gpt_cpu)
    if command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then targets+=(train_gpt); fi
    make -j"$(nproc)" "${targets[@]}"
    scripts/get_corpus.sh moby-dick
fi
data=(--train-data "data/moby-dick/moby-dick_train_*.bin" --val-data "data/moby-dick/moby-dick_val_*.bin")
if [[ -x ./train_gpt ]] && command -v nvidia-smi >/dev/null && nvidia-smi >/dev/null 2>&1; then
    echo "run: training GPT-2 small (d12) on the GPU"
    # a fixed step count here: no time budget (--time-budget is accepted and ignored)
    # 300 steps of 16k tokens: about 17 passes over Moby Dick's 286k training tokens
    exec ./train_gpt "${data[@]}" --model d12 --batch-size 16 --seq-len 1024 \
        --steps 300 --lr 6e-4 --warmup-steps 30 --val-every 50 --sample-every 100 --sample-tokens 128 --top-k 40 \
        --checkpoint-every 100 --out-dir out/moby-dick-d12 "$@"
fi

# The small GPT: its tied 50257-row embedding is most of its parameters, and the LM head (the
# 50257-way classifier) most of each step's compute, in proportion to the width C. So a narrow
# model with more layers learns the most per second: at C=64 the head costs half of C=128's, and
# each extra layer costs little. Measured on Moby Dick (docs/benchmarks.md, "The main job on the
# CPU"), comparing configurations at equal compute: L=8, C=64 ended lower than L=4 at C=64, 128,
# 192 or 256, and LR 1e-2 (cosine to 0) lower than 2e-2.
trainer=${TRAINER:-./train_gpt_cpu}
# The warm-up: 150 steps. With 30 the loss jumped to 15.0 at step 24 and 10.0 at step 28 (LR 8-9e-3,
# AdamW's second moments still young) and took ~100 steps to come back; with 150 it never rises
# above its start, and the 1312 steps an Intel Xeon fits end at validation loss 5.68 against 5.91
# (docs/benchmarks.md, "A warm-up without the spike"; a peak of 2e-2 was worse).
# Validation scores the whole validation split (the trainer's default, --val-tokens: 31,744 tokens
# in 496 windows of 65, 62 forward passes of 8 x 64), the same windows at every step count and B.
job=(--model L=8,C=64,H=4,T=64 --batch-size 8 --seq-len 64 --lr 1e-2 --warmup-steps 150
     --sample-tokens 64 --top-k 40)
val_batches=62          # the forward passes of a validation: 496 windows, 8 at a time
max_steps=2900          # the full run (validation loss 5.58 on a Zen 5, in 3 min 32 s)
min_steps=300           # below this the model has barely started; run over the budget instead
calibration_steps=30    # timed: steps 6-30 (the first few warm the caches and the thread pool)
vals=4                  # validations during the run, about (the one at the end counted among them)
val_batch_cost=40       # a validation batch is a forward pass only: 31-42% of a training step, measured
fixed_reserve=8         # seconds for the trainer's start-up, 2 samples, 2 checkpoints and the plot
step_margin=5           # plan each step 5% above the calibration's median (a run's mean step was 4.7% above its median)
# OpenMP's threads wait for each other at every barrier by spinning first (libgomp: 300,000 times)
# and sleeping after. Where other programs share the cores, a spinning thread burns the time slice
# its partner needs to arrive: on 2 shared cores (load average 3 to 4) median steps of 0.18 to
# 4.4 s, against 0.2 to 0.5 s spinning 10,000 times, which alone costs nothing measurable (133 ms
# against 116-143; docs/benchmarks.md). The trainer's results are the same bits either way.
export GOMP_SPINCOUNT=${GOMP_SPINCOUNT:-10000}
echo "run: no GPU found; training a small GPT on the CPU"

steps=$(flag_value steps "$@") more=$(flag_value more-steps "$@")
if [[ -n "$more" ]]; then
    # --resume ... --more-steps K: K steps past the checkpoint, the trainer stretches the schedule
    echo "run: $more more steps (--more-steps given: no calibration, no time budget)"
elif [[ -z "$steps" ]]; then
    # Calibration: the real trainer, model and flags (the user's too: --threads 1 changes the step
    # time), nothing written but a metrics log in a temporary folder.
    calibration=$(mktemp -d)
    trap 'rm -rf "$calibration"' EXIT
    echo "run: timing $calibration_steps steps to size the run to the ${budget} s budget ..."
    if ! "$trainer" "${data[@]}" "${job[@]}" "$@" --steps "$calibration_steps" --val-every 0 --sample-every 0 \
            --checkpoint-every 0 --resume "" --hellaswag "" --dump-state "" --quiet \
            --out-dir "$calibration" --metrics "$calibration/metrics.jsonl" >"$calibration/log" 2>&1; then
        cat "$calibration/log" >&2
        echo "error: the calibration run failed (above); pass --steps N to skip it" >&2
        exit 1
    fi
    # each step's "ms" from the log (llmc/metrics.h), steps 6 on, median rounded up to whole ms
    step_ms=$(grep -o '"type":"step".*"ms":[0-9.e+-]*' "$calibration/metrics.jsonl" | sed 's/.*"ms"://' |
              tail -n +6 | sort -g | awk '{ v[NR] = $1 } END { if (NR) { m = v[int((NR + 1) / 2)]; print (m == int(m)) ? int(m) : int(m) + 1 } }')
    if ! [[ "$step_ms" =~ ^[0-9]+$ ]] || (( step_ms < 1 )); then
        echo "error: the calibration run logged no step times in $calibration/metrics.jsonl; pass --steps N" >&2
        exit 1
    fi
    # what the run may spend on steps: the budget, less the time spent so far, the fixed reserve and
    # the validations (the trainer's one before the first step, and vals; val_batches batches each
    # at val_batch_cost% of a step); a planned step is the median plus step_margin%
    spent=$SECONDS
    plan_ms=$(( (step_ms * (100 + step_margin) + 99) / 100 ))
    val_ms=$(( (1 + vals) * val_batches * plan_ms * val_batch_cost / 100 ))
    train_ms=$(( (budget - spent - fixed_reserve) * 1000 - val_ms ))
    steps=$(( train_ms > 0 ? train_ms / plan_ms : 0 ))
    why="fits"
    if (( steps > max_steps )); then steps=$max_steps why="the full run (at most $max_steps)"; fi
    if (( steps < min_steps )); then steps=$min_steps why="the least worth running ($min_steps): this run will go over the budget"; fi
    echo "run: a step takes $step_ms ms here (median of calibration steps 6-$calibration_steps; planned at $plan_ms); ${spent} s of the" \
         "${budget} s budget spent on set-up, build and calibration; reserving $(( val_ms / 1000 )) s for $(( 1 + vals )) validations" \
         "and ${fixed_reserve} s for start-up, samples, checkpoints and the plot: $steps steps, $why"
else
    echo "run: $steps steps (--steps given: no calibration, no time budget)"
fi

# validation about `vals` times (every multiple of 50), samples and checkpoints at half-way and the end
# (of the steps this run trains: --more-steps K's K)
val_every=500 sample_every=1450 span=${more:-$steps}
if [[ "$span" =~ ^[0-9]+$ ]] && (( span > 0 )); then
    val_every=$(( ((span + vals - 1) / vals + 49) / 50 * 50 ))
    sample_every=$(( (span + 1) / 2 ))
fi
steps_flag=(--steps "$steps")
if [[ -n "$more" ]]; then steps_flag=(); fi  # the trainer refuses both

out=$(flag_value out-dir "$@") out_flag=""
if [[ -n "$out" ]]; then
    out_flag="--out-dir $out "
else
    out=out/moby-dick-cpu
    # a fresh run in a fresh folder: steps differ from run to run, and a previous run's later
    # checkpoints and log lines would pass for this one's (--resume latest, the plot)
    if [[ -z "$(flag_value resume "$@")" && -e "$out" ]]; then
        rm -rf "$out.previous"
        mv "$out" "$out.previous"
        echo "run: the previous run's $out moved to $out.previous"
    fi
fi
# the trainer's output is kept in $out/train.log too (appended, as the metrics log is): the report's samples
mkdir -p "$out"
"$trainer" "${data[@]}" "${job[@]}" "${steps_flag[@]}" --val-every "$val_every" --sample-every "$sample_every" \
    --checkpoint-every "$sample_every" --out-dir "$out" "$@" | tee -a "$out/train.log"
# the loss curve: on the terminal always, as a PNG when matplotlib is there (the Debian Python has it:
# the scripts' own #! lines name it, where `python3` may be another one)
scripts/plot_metrics.py "$out" --terminal
if /usr/bin/python3 -c "import matplotlib" 2>/dev/null; then scripts/plot_metrics.py "$out" -o "$out/loss.png"; fi
# everything in one page to open in a browser (no network needed): curves, speed, memory, samples, options
# (a report that fails says why and costs the job nothing: the run and its checkpoints are done)
if [[ -f scripts/report.py ]] && ! scripts/report.py "$out" | sed 's/^report: /run: the run report: /'; then
    echo "run: the run report could not be written (above)" >&2
fi
last=$(ls -d "$out"/ckpt_* 2>/dev/null | tail -n 1)
if [[ -n "$last" ]]; then
    echo "checkpoint: $last (model.bin: the weights; state.bin: AdamW and the data position)"
    step=$((10#${last##*ckpt_}))
    echo "  generate:        ./train_gpt_cpu --resume $last --generate \"Call me Ishmael.\" --sample-tokens 200 --top-k 40"
    echo "  train on:        scripts/run.sh ${out_flag}--resume latest --more-steps $step   (to step $((2 * step)), the LR schedule stretched)"
fi
if [[ -z "$(flag_value steps "$@")$more" ]]; then echo "run: done in $SECONDS s (budget $budget s)"; else echo "run: done in $SECONDS s"; fi
