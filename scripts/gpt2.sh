#!/usr/bin/env bash
# gpt2.sh — reproduce GPT-2 (124M, 350M, 774M or 1558M) on a large corpus, on one GPU or many.
#
#   scripts/gpt2.sh SIZE [--gpus N | --hostfile FILE --np N | --slurm] [--dry-run] [trainer flags...]
#
#   scripts/gpt2.sh 124M                          one GPU
#   scripts/gpt2.sh 350M --gpus 8                 8 GPUs of this machine (scripts/run_mpi_local.sh)
#   scripts/gpt2.sh 774M --hostfile hosts --np 16 several machines (scripts/run_mpi_hostfile.sh)
#   sbatch ... scripts/gpt2.sh 1558M --slurm      inside a Slurm job (scripts/slurm.sbatch's srun)
#   scripts/gpt2.sh 124M --dry-run                print the plan and the estimate, train nothing
#
# It prints the plan, runs the trainer's --estimate with the same flags and number of GPUs (memory
# per GPU by buffer, the largest micro-batch that fits, FLOPs and the predicted step time; the
# trainer itself refuses a micro-batch that cannot fit before it allocates anything), then trains
# with --resume auto: the first run starts fresh, and running the same command again after an
# interruption continues from the newest checkpoint in OUT_DIR. Flags after the options go to the
# trainer and override the plan's.
#
# The recipe. GPT-2's paper (Radford et al., 2019) gives the shapes but little of the training; the
# standard recipe is GPT-3's (Brown et al., 2020), whose Table 2.1 lists, per model size, the batch
# size in tokens and the peak learning rate. GPT-2's four sizes borrow the row of the GPT-3 model
# closest in size (the shapes differ above 350M: GPT-3 Large and XL are 24 layers wide, GPT-2 774M
# and 1558M are 36 and 48 layers deep):
#
#   size   model  layers x width  GPT-3 row         batch (tokens)      peak LR
#   124M   d12    12 x  768       Small  (125M)     0.5M  (2^19)        6.0e-4
#   350M   d24    24 x 1024       Medium (350M)     0.5M  (2^19)        3.0e-4
#   774M   d36    36 x 1280       Large  (760M)     0.5M  (2^19)        2.5e-4
#   1558M  d48    48 x 1600       XL     (1.3B)     1M    (2^20)        2.0e-4
#
# and, for every size (GPT-3, section 2.3 and appendix B): AdamW with beta1 = 0.9, beta2 = 0.95,
# eps = 1e-8; weight decay 0.1; gradient clipping at global norm 1.0; linear warmup over the first
# 375M tokens; cosine decay to 10% of the peak. GPT-3 decays over 260B tokens and trains on 300B;
# a reproduction on a FineWeb-style corpus trains on 10B tokens (as llm.c does), so the decay here
# runs over the whole run. Sequences are GPT-2's 1024 tokens (GPT-3 used 2048).
# Steps = tokens / batch: 10B / 2^19 = 19073 steps (1558M: 9536), warmup 375M / 2^19 = 715 (357).
#
# Environment:
#   TRAIN_DATA, VAL_DATA  token shards (default data/fineweb10B/fineweb_{train,val}_*.bin; make them
#                         from your corpus with ./prepare_data CORPUS --out-dir data/fineweb10B --name fineweb)
#   TOKENS                tokens to train on (default 10000000000)
#   MICRO_BATCH           sequences per GPU per micro-batch (default: 64, 32, 32, 16 by size: a
#                         starting point for 80 GB GPUs; the estimate says whether it fits)
#   OUT_DIR               checkpoints and metrics.jsonl (default out/gpt2_SIZE)
#   HELLASWAG             a HellaSwag JSONL to evaluate every 250 steps (optional)
#   TRAINER               the trainer (default ./train_gpt)
#   CHECKPOINT_EVERY      steps between checkpoints (default 1000)
set -euo pipefail
here=$(dirname "$0")/..
[ -f "$here/Makefile" ] || here=${SLURM_SUBMIT_DIR:-.}  # sbatch runs a copy of this script from its spool folder
cd "$here"

usage() {
    echo "usage: scripts/gpt2.sh 124M|350M|774M|1558M [--gpus N | --hostfile FILE --np N | --slurm] [--dry-run] [trainer flags...]" >&2
    exit 2
}
[ $# -ge 1 ] || usage
SIZE=$1
shift
case "$SIZE" in
    124M)  MODEL=d12 BATCH_TOKENS=524288  LR=6e-4   DEFAULT_MICRO=64 ;;
    350M)  MODEL=d24 BATCH_TOKENS=524288  LR=3e-4   DEFAULT_MICRO=32 ;;
    774M)  MODEL=d36 BATCH_TOKENS=524288  LR=2.5e-4 DEFAULT_MICRO=32 ;;
    1558M) MODEL=d48 BATCH_TOKENS=1048576 LR=2e-4   DEFAULT_MICRO=16 ;;
    *) echo "error: unknown size '$SIZE'" >&2; usage ;;
esac

LAUNCH=single GPUS=1 HOSTFILE="" DRY_RUN=0
while [ $# -gt 0 ]; do
    case "$1" in
        --gpus) [ $# -ge 2 ] && [[ $2 =~ ^[1-9][0-9]*$ ]] || { echo "error: --gpus needs a number of GPUs" >&2; exit 2; }
                GPUS=$2; [ "$GPUS" -gt 1 ] && LAUNCH=local; shift 2 ;;
        --hostfile) [ $# -ge 2 ] || { echo "error: --hostfile needs a file" >&2; exit 2; }
                HOSTFILE=$2; LAUNCH=hostfile; shift 2 ;;
        --np) [ $# -ge 2 ] && [[ $2 =~ ^[1-9][0-9]*$ ]] || { echo "error: --np needs a number of ranks" >&2; exit 2; }
                GPUS=$2; shift 2 ;;
        --slurm) LAUNCH=slurm; shift ;;
        --dry-run) DRY_RUN=1; shift ;;
        *) break ;;
    esac
done
if [ "$LAUNCH" = slurm ]; then GPUS=${SLURM_NTASKS:-${SLURM_STEP_NUM_TASKS:-1}}; fi

TRAIN_DATA=${TRAIN_DATA:-data/fineweb10B/fineweb_train_*.bin}
VAL_DATA=${VAL_DATA:-data/fineweb10B/fineweb_val_*.bin}
TOKENS=${TOKENS:-10000000000}
MICRO_BATCH=${MICRO_BATCH:-$DEFAULT_MICRO}
OUT_DIR=${OUT_DIR:-out/gpt2_$SIZE}
TRAINER=${TRAINER:-./train_gpt}
CHECKPOINT_EVERY=${CHECKPOINT_EVERY:-1000}
SEQ_LEN=1024
STEPS=$(( TOKENS / BATCH_TOKENS ))
WARMUP=$(( 375000000 / BATCH_TOKENS ))
PER_MICRO_STEP=$(( MICRO_BATCH * SEQ_LEN * GPUS ))
if [ $(( BATCH_TOKENS % PER_MICRO_STEP )) -ne 0 ]; then
    echo "error: $BATCH_TOKENS tokens per step is not a multiple of MICRO_BATCH x 1024 x GPUs = $MICRO_BATCH x 1024 x $GPUS:" \
         "choose a power-of-two MICRO_BATCH and number of GPUs" >&2
    exit 2
fi
ACCUMULATION=$(( BATCH_TOKENS / PER_MICRO_STEP ))

flags=(--model "$MODEL" --train-data "$TRAIN_DATA" --val-data "$VAL_DATA"
       --batch-size "$MICRO_BATCH" --seq-len "$SEQ_LEN" --total-batch-tokens "$BATCH_TOKENS"
       --steps "$STEPS" --lr "$LR" --lr-schedule cosine --warmup-steps "$WARMUP" --final-lr-fraction 0.1
       --weight-decay 0.1 --beta1 0.9 --beta2 0.95 --adam-eps 1e-8 --grad-clip 1.0
       --val-every 250 --sample-every 1000 --sample-tokens 64 --top-k 40
       --out-dir "$OUT_DIR" --checkpoint-every "$CHECKPOINT_EVERY")
[ -n "${HELLASWAG:-}" ] && flags+=(--hellaswag "$HELLASWAG" --hellaswag-every 250)
flags+=("$@")

case "$LAUNCH" in
    single)   launch=("$TRAINER") ;;
    local)    launch=(env TRAINER="$TRAINER" scripts/run_mpi_local.sh "$GPUS") ;;
    hostfile) launch=(env TRAINER="$TRAINER" scripts/run_mpi_hostfile.sh "$HOSTFILE" "$GPUS") ;;
    slurm)    launch=(env TRAINER="$TRAINER" bash scripts/slurm.sbatch) ;;
esac

cat <<EOF
GPT-2 $SIZE ($MODEL) on $TOKENS tokens: the GPT-3 paper's recipe (see the top of scripts/gpt2.sh)
  batch       $BATCH_TOKENS tokens per step = $MICRO_BATCH sequences x $SEQ_LEN tokens x $GPUS GPU(s) x $ACCUMULATION accumulation step(s)
  steps       $STEPS, linear warmup $WARMUP steps (375M tokens), cosine decay to 10% of the peak
  optimizer   AdamW lr $LR, betas 0.9/0.95, eps 1e-8, weight decay 0.1, clip 1.0
  data        $TRAIN_DATA (validation: $VAL_DATA)
  output      $OUT_DIR: a checkpoint every $CHECKPOINT_EVERY steps, metrics.jsonl; rerun to resume
  evaluation  validation loss every 250 steps${HELLASWAG:+, HellaSwag ($HELLASWAG) every 250 steps}
  launch      ${launch[*]} (--resume auto)
EOF

if ! compgen -G "$TRAIN_DATA" >/dev/null; then
    msg="no training shards match '$TRAIN_DATA': tokenize a large corpus first, e.g. ./prepare_data CORPUS.jsonl --out-dir data/fineweb10B --name fineweb, or set TRAIN_DATA"
    if [ "$DRY_RUN" = 1 ]; then echo "warning: $msg"; else echo "error: $msg" >&2; exit 1; fi
fi
if [ ! -x "$TRAINER" ]; then
    echo "error: $TRAINER not found or not executable: build it with make (or set TRAINER)" >&2
    exit 1
fi

echo "+ $TRAINER ... --estimate --estimate-ranks $GPUS"
"$TRAINER" "${flags[@]}" --estimate --estimate-ranks "$GPUS" ||
    { echo "error: the estimate failed (above): fix the configuration before training" >&2; exit 1; }
if [ "$DRY_RUN" = 1 ]; then
    echo "dry run: not training"
    exit 0
fi
mkdir -p "$OUT_DIR"
echo "+ ${launch[*]} ${flags[*]} --resume auto"
exec "${launch[@]}" "${flags[@]}" --resume auto
