#!/usr/bin/env bash
# kernel_lab.sh — the kernel lab's one command (also `make -C dev/cuda run`): on a GPU machine, build
# every program in dev/cuda/ for this GPU, run them one after another, and print ONE table:
# kernel, version, time, achieved GB/s or TFLOP/s, % of the roofline floor, errors, PASS/FAIL.
#
#   scripts/kernel_lab.sh              GPT-2 small (d12) training shapes, B=8 (a few minutes)
#   scripts/kernel_lab.sh --small      small shapes: a quick check
#   scripts/kernel_lab.sh --batch 16   any other flag is passed to every program
#   KERNEL_LAB_PROGRAMS="gelu matmul" scripts/kernel_lab.sh     only these programs (dev/cuda/NAME.cu)
#
# Output: the table on stdout and in out/kernel_lab/table.md (markdown, ready for docs/benchmarks.md);
# each program's full log (every check, every timing) in out/kernel_lab/<program>.log.
# Robust to a bad kernel: a program that crashes (a CUDA error aborts its process) or runs longer
# than KERNEL_LAB_TIMEOUT seconds (default 240; each should take well under a minute) does not stop
# the others, and each of its versions that had not printed a row yet is run again alone, so one
# broken version costs only its own row (ERROR). Exit status: 0 if every row is PASS or SKIP, else 1.
# (test/test_kernel_lab.sh runs this script on stand-in programs: KERNEL_LAB_SRC and KERNEL_LAB_BIN
# name other source and program folders, KERNEL_LAB_NO_BUILD=1 skips the build.)
set -uo pipefail
cd "$(dirname "$0")/.."
OUT=${KERNEL_LAB_OUT:-out/kernel_lab}
TIMEOUT=${KERNEL_LAB_TIMEOUT:-240}
SRC=${KERNEL_LAB_SRC:-dev/cuda}
BIN=${KERNEL_LAB_BIN:-build/dev}
mkdir -p "$OUT"

if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "error: no GPU here (nvidia-smi fails): the kernel lab runs on a machine with an NVIDIA GPU" >&2
    exit 1
fi
gpu=$(nvidia-smi --query-gpu=name,compute_cap,driver_version --format=csv,noheader | head -n1)
echo "== build for $gpu (log: $OUT/build.log)"
if [ -z "${KERNEL_LAB_NO_BUILD:-}" ] && ! make -C dev/cuda -j"$(nproc)" >"$OUT/build.log" 2>&1; then
    tail -40 "$OUT/build.log"
    echo "error: the build failed (see $OUT/build.log)" >&2
    exit 1
fi

ROWS="$OUT/rows.txt"
NOTES="$OUT/notes.txt"
: >"$ROWS"
: >"$NOTES"
# the rows of a log: each program prints "row: | ... |" as soon as a version is done
rows_of() { sed -n 's/^row: //p' "$1"; }
# "kernel version" of each row on stdin
row_keys() { awk -F'|' '{ gsub(/ /, "", $2); split($3, v, " "); print $2, v[1] }'; }
error_row() {  # kernel, version, name
    printf '| %-22s | %-28s | %9s | %14s | %10s | %8s | %8s | %-6s |\n' "$1" "$2 $3" - - - - - ERROR
}

for src in "$SRC"/*.cu; do
    name=$(basename "$src" .cu)
    if [ -n "${KERNEL_LAB_PROGRAMS:-}" ] && ! grep -qw "$name" <<<"$KERNEL_LAB_PROGRAMS"; then continue; fi
    bin=$BIN/$name
    log=$OUT/$name.log
    echo "== $name $*"
    start=$SECONDS
    timeout "$TIMEOUT" "$bin" "$@" >"$log" 2>&1 </dev/null
    code=$?
    rows_of "$log" | tee -a "$ROWS"
    grep '^ceilings:' "$log" | tail -n1 >>"$NOTES"
    echo "   ($((SECONDS - start)) s, exit $code)"
    if [ "$code" -ne 0 ] && [ "$code" -ne 3 ]; then  # 3: a check failed, the rows say which; else a crash
        echo "$name: exit code $code$([ "$code" -eq 124 ] && echo " (timed out after $TIMEOUT s)"); see $log" | tee -a "$NOTES"
        tail -5 "$log" | sed 's/^/   /'
        done_keys=$(rows_of "$log" | row_keys)
        # run every version that has no row yet on its own (--list needs no GPU)
        "$bin" --list | while IFS=$'\t' read -r key vname what; do
            grep -qx "$key" <<<"$done_keys" && continue
            read -r kernel id <<<"$key"
            one=$OUT/$name.$kernel.$id.log
            timeout "$TIMEOUT" "$bin" "$@" --kernel "$kernel" --version "$id" >"$one" 2>&1 </dev/null
            c1=$?
            grep '^ceilings:' "$one" | tail -n1 >>"$NOTES"
            if rows_of "$one" | grep -q .; then
                rows_of "$one" | tee -a "$ROWS"
            else
                error_row "$kernel" "$id" "$vname" | tee -a "$ROWS"
                echo "$kernel $id: exit code $c1; see $one" | tee -a "$NOTES"
            fi
        done
    fi
done

{
    echo "Kernel lab: $gpu; $(date -u '+%Y-%m-%d %H:%M UTC'); scripts/kernel_lab.sh $*"
    echo
    printf '| %-22s | %-28s | %9s | %14s | %10s | %8s | %8s | %-6s |\n' kernel version time achieved "% of ceil." \
        "rel err" "max abs" status
    echo "|------------------------|------------------------------|----------:|---------------:|-----------:|---------:|---------:|--------|"
    cat "$ROWS"
    echo
    sed 's/^/    /' "$NOTES"
} >"$OUT/table.md"
echo
cat "$OUT/table.md"
pass=$(grep -c '| PASS   |$' "$ROWS")
fail=$(grep -c '| FAIL   |$' "$ROWS")
skip=$(grep -c '| SKIP   |$' "$ROWS")
error=$(grep -c '| ERROR  |$' "$ROWS")
echo
echo "kernel lab: $pass PASS, $fail FAIL, $skip SKIP, $error ERROR (table: $OUT/table.md, logs: $OUT/)"
[ "$fail" -eq 0 ] && [ "$error" -eq 0 ] && [ "$pass" -gt 0 ]
