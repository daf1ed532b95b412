#!/usr/bin/env bash
# test_kernel_lab.sh — the kernel lab (dev/cuda/) as far as a machine without a GPU can check it:
#   1. every dev/cuda/*.cu was compiled (by `make`, when nvcc is present)
#   2. each program's table of versions (--list, no GPU needed): every kernel has at least three
#      versions numbered 1..n, one of them the trainer's; README.md describes every file
#   3. scripts/kernel_lab.sh on stand-in programs and a stand-in nvidia-smi: a program that passes, one
#      whose check fails, one that crashes after its first version (its other versions are rerun
#      alone: one passes, one crashes again and becomes an ERROR row); flags reach the programs; the
#      exit status is 1 then, and 0 when everything passes
#   4. on a GPU machine: the whole lab on --small shapes, every row PASS or SKIP
cd "$(dirname "$0")/.."
failures=0
pass() { echo "PASS: $1"; }
fail() { echo "FAIL: $1: $2"; failures=$((failures + 1)); }

sources=(dev/cuda/*.cu)
names=()
for src in "${sources[@]}"; do names+=("$(basename "$src" .cu)"); done

# 1. built
NVCC=$(command -v nvcc || ls /usr/local/cuda/bin/nvcc 2>/dev/null)
if [ -z "$NVCC" ]; then
    echo "SKIP: every dev/cuda program is built (no nvcc)"
else
    missing=""
    for n in "${names[@]}"; do [ -x "build/dev/$n" ] || missing+=" $n"; done
    if [ -z "$missing" ]; then pass "every dev/cuda program is built (${#names[@]} programs)"; else fail "every dev/cuda program is built" "missing:$missing (run make)"; fi
fi

# 2. versions and README
for n in "${names[@]}"; do
    [ -x "build/dev/$n" ] || continue
    list=$("build/dev/$n" --list 2>&1)
    problems=$(awk -F'\t' '
        { split($1, kv, " "); k = kv[1]; id = kv[2]; count[k]++; if (id != count[k]) bad = bad " " k ":" id "-out-of-order";
          if ($3 ~ /\[the trainer.s\]$/) trainer[k]++; if ($2 == "" || $3 == "") bad = bad " " k ":" id "-undescribed" }
        END { for (k in count) { if (count[k] < 3) bad = bad " " k "-has-" count[k] "-versions";
                                 if (!trainer[k]) bad = bad " " k "-lacks-the-trainers" }
              if (NR == 0) bad = " no-versions"; print bad }' <<<"$list")
    if [ -z "$problems" ]; then
        pass "$n: each kernel has >= 3 versions, numbered, described, one the trainer's ($(cut -f1 <<<"$list" | cut -d' ' -f1 | sort -u | tr '\n' ' '))"
    else
        fail "$n: versions" "$problems"
    fi
done
undocumented=""
for n in "${names[@]}"; do grep -q "$n.cu" dev/cuda/README.md || undocumented+=" $n.cu"; done
if [ -z "$undocumented" ]; then pass "dev/cuda/README.md describes every file"; else fail "dev/cuda/README.md describes every file" "missing:$undocumented"; fi

# 3. the one command, on stand-ins
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/src" "$tmp/bin" "$tmp/path"
cat >"$tmp/path/nvidia-smi" <<'EOF'
#!/usr/bin/env bash
case "$*" in
    *-L*) echo "GPU 0: Stand-in GPU" ;;
    *) echo "Stand-in GPU, 9.0, 0" ;;
esac
EOF
# a stand-in program: $1 = its name (and its kernel's), $2 = its behaviour; prints rows as common.h does
cat >"$tmp/standin" <<'EOF'
#!/usr/bin/env bash
name=$1 behaviour=$2
shift 2
row() { printf 'row: | %-22s | %-28s | %9s | %14s | %10s | %8s | %8s | %-6s |\n' "$name" "$1 v$1" "1.0 us" "1 GB/s" "1.0%" "1.0e-03" "1.0e-03" "$2"; }
[ "$1" = --list ] && { printf '%s 1\tv1\tfirst\n%s 2\tv2\tsecond\n%s 3\tv3\tthird [the trainer'"'"'s]\n' "$name" "$name" "$name"; exit 0; }
echo "args: $*"
case "$* $behaviour" in
    *"--version 2"*crashy) row 2 PASS ;;
    *"--version 3"*crashy) echo "error: CUDA call failed"; exit 1 ;;
    *crashy) row 1 PASS; echo "error: CUDA call failed"; exit 1 ;;
    *failing) row 1 PASS; row 2 FAIL; row 3 PASS; exit 3 ;;
    *) row 1 PASS; row 2 PASS; row 3 PASS ;;
esac
echo "ceilings: copy 1 GB/s, bf16 GEMM 1.0 TFLOP/s (Stand-in GPU, $name)"
EOF
for b in good failing crashy; do
    touch "$tmp/src/$b.cu"
    printf '#!/usr/bin/env bash\nexec bash %q %s %s "$@"\n' "$tmp/standin" "$b" "$b" >"$tmp/bin/$b"
done
chmod +x "$tmp/path/nvidia-smi" "$tmp/bin/"*
run_lab() {  # source folder, output folder, flags...
    local src=$1 out=$2
    shift 2
    PATH="$tmp/path:$PATH" KERNEL_LAB_NO_BUILD=1 KERNEL_LAB_SRC="$src" KERNEL_LAB_BIN="$tmp/bin" KERNEL_LAB_OUT="$out" \
        bash scripts/kernel_lab.sh "$@" >"$out.stdout" 2>&1
}
run_lab "$tmp/src" "$tmp/out" --small
code=$?
table="$tmp/out/table.md"
status_of() { grep -E "^\| $1 +\| $2 " "$table" | awk -F'|' '{ gsub(/ /, "", $9); print $9 }'; }
got="$(status_of good 1)$(status_of good 3) $(status_of failing 2) $(status_of crashy 1) $(status_of crashy 2) $(status_of crashy 3)"
rows=$(grep -cE '^\| [a-z].*\| (PASS|FAIL|SKIP|ERROR) +\|$' "$table")
if [ "$got" = "PASSPASS FAIL PASS PASS ERROR" ] && [ "$rows" -eq 9 ] && [ "$code" -eq 1 ]; then
    pass "kernel_lab.sh: one table; a failed check is FAIL, a crashed program's other versions rerun alone, exit 1"
else
    fail "kernel_lab.sh on stand-ins" "statuses '$got', $rows rows, exit $code; see $(cat "$tmp/out.stdout" | tail -20)"
fi
if grep -q "args: --small" "$tmp/out/good.log" && grep -q "args: --small --kernel crashy --version 2" "$tmp/out/crashy.crashy.2.log"; then
    pass "kernel_lab.sh passes its flags to every program and to the reruns"
else
    fail "kernel_lab.sh passes its flags" "$(head -3 "$tmp/out/good.log")"
fi
if grep -q "crashy: exit code 1" "$table" && grep -q "1 FAIL, 0 SKIP, 1 ERROR" "$tmp/out.stdout"; then
    pass "kernel_lab.sh names the crash in the table's notes and counts the rows"
else
    fail "kernel_lab.sh notes and counts" "$(tail -3 "$tmp/out.stdout")"
fi
mkdir -p "$tmp/good_only"
touch "$tmp/good_only/good.cu"
run_lab "$tmp/good_only" "$tmp/out2"
code=$?
if [ "$code" -eq 0 ] && grep -q "3 PASS, 0 FAIL, 0 SKIP, 0 ERROR" "$tmp/out2.stdout"; then
    pass "kernel_lab.sh exits 0 when every row passes"
else
    fail "kernel_lab.sh exits 0 when every row passes" "exit $code: $(tail -2 "$tmp/out2.stdout")"
fi

# 4. on a GPU
if nvidia-smi -L >/dev/null 2>&1 && [ -n "$NVCC" ]; then
    if KERNEL_LAB_OUT=out/kernel_lab_small bash scripts/kernel_lab.sh --small >"$tmp/gpu.stdout" 2>&1; then
        pass "the kernel lab on --small shapes: $(tail -1 "$tmp/gpu.stdout")"
    else
        fail "the kernel lab on --small shapes" "$(grep -E 'FAIL|ERROR' out/kernel_lab_small/table.md | head -10)"
    fi
else
    echo "SKIP: the kernel lab's timed run on --small shapes (timing needs a GPU; its checks run on the CUDA emulation in test_emu_kernel_lab.py)"
fi
exit $((failures > 0))
