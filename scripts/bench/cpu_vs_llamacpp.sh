#!/usr/bin/env bash
# kiln's CPU backend beside llama.cpp's CPU build on one GGUF file, alternating rounds on
# the same cores, so a shared or throttled host slows both alike: each round runs
# `llama-bench -t T -ngl 0 -p 0 -n N -r 1`, kiln's f32 oracle and kiln with
# --quantized-activations (8-bit activations, llama.cpp's arithmetic), one tg run each.
# Prints every round, then the means and the ratios to llama.cpp.
#
#   scripts/bench/cpu_vs_llamacpp.sh MODEL THREADS ROUNDS [N]
#
# KILN (default target/release/kiln) and LLAMA_BENCH (default
# /tmp/llamacpp-cpu-avx2/build/bin/llama-bench, built by
# `GGML_CUDA=OFF TARGETS=llama-bench LLAMACPP_DIR=/tmp/llamacpp-cpu-avx2
# scripts/bench/bench_vs_llamacpp.sh build-llamacpp`) pick the binaries; CORES=2,3 pins every run
# to those cores (taskset); F32=0 leaves the oracle out.
set -euo pipefail
model=$1 threads=$2 rounds=$3 n=${4:-128}
kiln=${KILN:-target/release/kiln}
llama_bench=${LLAMA_BENCH:-/tmp/llamacpp-cpu-avx2/build/bin/llama-bench}
pin=()
if [ -n "${CORES:-}" ]; then pin=(taskset -c "$CORES"); fi

# The tg rate of one kiln run, or "-" when it fails.
kiln_tg() {
    "${pin[@]}" "$kiln" bench -m "$model" --backend cpu -t "$threads" -p 0 -n "$n" -r 1 "$@" 2>&1 |
        awk -F'|' '/\| tg/ { split($6, f, " "); print f[1]; found = 1 } END { if (!found) print "-" }'
}

name=$(basename "$model")
results=$(mktemp)
for r in $(seq "$rounds"); do
    llama=$("${pin[@]}" "$llama_bench" -m "$model" -t "$threads" -ngl 0 -p 0 -n "$n" -r 1 -o csv 2>/dev/null |
        tail -1 | awk -F, '{ gsub(/"/, "", $(NF-1)); print $(NF-1) }')
    f32=-
    if [ "${F32:-1}" != 0 ]; then f32=$(kiln_tg); fi
    q8=$(kiln_tg --quantized-activations)
    echo "$name t=$threads round $r: llama.cpp $llama  kiln-f32 $f32  kiln-q8 $q8"
    echo "$llama $f32 $q8" >>"$results"
done
awk -v name="$name" -v t="$threads" -v n="$n" '
    { l += $1; if ($2 != "-") { f += $2; nf++ } if ($3 != "-") { q += $3; nq++ } k++ }
    END {
        l /= k
        line = sprintf("%s t=%s tg%s, means of %d rounds: llama.cpp %.1f", name, t, n, k, l)
        if (nf) line = line sprintf("  kiln f32 %.1f (%.2fx)", f / nf, f / nf / l)
        if (nq) line = line sprintf("  kiln q8 %.1f (%.2fx)", q / nq, q / nq / l)
        print line
    }' "$results"
rm -f "$results"
