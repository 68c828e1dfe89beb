#!/usr/bin/env bash
# GPU test and benchmark suite for kiln's CUDA kernels.
#
#   scripts/gpu_suite.sh build   on a build machine (needs cargo, no GPU): builds the release
#                                test binaries and the kernel benchmark, strips them and
#                                copies them to .gpu/ (ignored by git; carry it to the GPU).
#   scripts/gpu_suite.sh run     on the GPU machine (needs no Rust): runs every test binary,
#                                the kernel benchmark (args in $BENCH_ARGS, e.g. --quick) and
#                                the decode benchmark (args in $DECODE_ARGS, e.g. "-n 64");
#                                full logs go to $OUT (or ./gpu-logs), short tables last.
set -euo pipefail
cd "$(dirname "$0")/.."
mode=${1:-}
case "$mode" in
build)
    mkdir -p .gpu
    rm -f .gpu/*
    log=$(cargo test --release -p kiln-kernels -p kiln-backend-cuda-q4k --no-run 2>&1) || { echo "$log"; exit 1; }
    echo "$log" | grep -oE '\(target/release/deps/[A-Za-z0-9_]+-[0-9a-f]+\)' | tr -d '()' | while read -r bin; do
        name=$(basename "$bin" | sed -E 's/-[0-9a-f]+$//')
        cp "$bin" ".gpu/$name"
    done
    cargo build --release -p kiln-kernels --example kernel_bench -p kiln-backend-cuda-q4k --example decode_bench 2>&1 | tail -1
    cp target/release/examples/kernel_bench target/release/examples/decode_bench .gpu/
    strip .gpu/* 2>/dev/null || true
    ls -la .gpu
    ;;
run)
    out=${OUT:-gpu-logs}
    mkdir -p "$out"
    nvidia-smi --query-gpu=name,driver_version,clocks.sm,clocks.mem,temperature.gpu --format=csv | tee "$out/nvidia-smi.txt" || true
    status=0
    summary=()
    for t in .gpu/*; do
        name=$(basename "$t")
        case "$name" in kernel_bench | decode_bench) continue ;; esac
        if KILN_REQUIRE_GPU=1 "$t" --include-ignored --test-threads=1 --nocapture >"$out/test-$name.log" 2>&1; then
            summary+=("$name: $(grep -E '^test result' "$out/test-$name.log" | tail -1)")
        else
            status=1
            summary+=("$name: FAILED (see test-$name.log)")
            grep -E "panicked|FAILED|error" "$out/test-$name.log" | head -20 || true
        fi
        grep -E "^skipped|rel err|agree|NVRTC|CUDA device|cosine" "$out/test-$name.log" | sort | uniq -c | head -40 || true
    done
    .gpu/kernel_bench ${BENCH_ARGS:-} 2>&1 | tee "$out/bench.log" >/dev/null || status=1
    .gpu/decode_bench ${DECODE_ARGS:-} 2>&1 | tee "$out/decode.log" >/dev/null || status=1
    grep -vE '^\s' "$out/bench.log" | grep -vE '^(all GEMV|\|)' || true
    echo
    sed -n '/^summary/,$p' "$out/bench.log"
    echo
    cat "$out/decode.log"
    echo
    printf '%s\n' "${summary[@]}"
    exit $status
    ;;
*)
    echo "usage: $0 build|run" >&2
    exit 2
    ;;
esac
