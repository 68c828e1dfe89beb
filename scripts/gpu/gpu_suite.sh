#!/usr/bin/env bash
# kiln's GPU test suite and benchmarks, in two halves because the GPU machine has no Rust:
#
#   scripts/gpu/gpu_suite.sh build   here (cargo, no GPU): builds the GPU test binaries, the
#                                benchmarks and the kiln binary, strips them into .gpu/
#                                (git-ignored; carry it to the GPU machine).
#   scripts/gpu/gpu_suite.sh split   here: splits the real SmolLM2 file into .gpu-model/part-a, -b
#                                and -c (one call to the GPU machine carries at most 64 MiB,
#                                the repository's tracked files included: carry one part a call).
#   scripts/gpu/gpu_suite.sh run     on the GPU machine: joins .gpu-model/part-* (in name order) into the real model
#                                once all three are present (checking its sha256), runs every GPU test (and the
#                                conformance suite on cuda-q4k / cuda-q4_0) with
#                                --include-ignored and KILN_REQUIRE_GPU=1 (no silent skips),
#                                then `kiln bench` on SmolLM2 q4_k_m and synthetic llama3.2-1b /
#                                llama3-8b q4_k_m. Logs under $OUT (or ./gpu-logs); a short
#                                table last. KERNEL_BENCH=1 adds the per-kernel benchmark,
#                                DECODE_BENCH=1 the decode variants (decode_bench);
#                                TESTS="gpu parity ..." runs a subset of the test binaries;
#                                BENCH=0 skips the benchmarks (then `bench` may follow in a
#                                second call: one call runs at most 10 minutes).
#   scripts/gpu/gpu_suite.sh bench   on the GPU machine: the side-by-side benchmark against
#                                llama.cpp (scripts/bench/bench_vs_llamacpp.sh) on SmolLM2 q4_0 and
#                                q4_k_m and synthetic llama3.2-1b / llama3-8b in q4_0 and q4_k_m.
set -euo pipefail
cd "$(dirname "$0")/../.."
SMOLLM2_SHA256=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mode=${1:-}

# The device tool brings back at most 8 files from $OUT: the logs travel as one archive.
bundle_logs() {
    [ -n "${OUT:-}" ] || return 0
    (cd "$1" && tar -czf gpu-logs.tgz --exclude gpu-logs.tgz -- * && find . -maxdepth 1 -type f ! -name gpu-logs.tgz -delete)
}

case "$mode" in
build)
    mkdir -p .gpu
    rm -f .gpu/*
    log=$(cargo test --release -p kiln-kernels -p kiln-backend-cuda-q4k -p kiln-backend-cuda-q4_0 -p kiln-tests --no-run 2>&1) || { echo "$log"; exit 1; }
    # Only the test binaries that touch the GPU; the rest run in CI.
    echo "$log" | grep -oE '\(target/release/deps/[A-Za-z0-9_]+-[0-9a-f]+\)' | tr -d '()' | while read -r bin; do
        name=$(basename "$bin" | sed -E 's/-[0-9a-f]+$//')
        case "$name" in gpu | parity | prefill | q4_0_parity | gpu_parity | conformance | batched_decode | kv_types) cp "$bin" ".gpu/$name" ;; esac
    done
    cargo build --release -p kiln --bin kiln
    cargo build --release -p kiln-kernels --example kernel_bench
    cargo build --release -p kiln-backend-cuda-q4k --example decode_bench
    cp target/release/kiln target/release/examples/kernel_bench target/release/examples/decode_bench .gpu/
    strip .gpu/* 2>/dev/null || true
    ls -la .gpu
    ;;
split)
    src=${KILN_TEST_MODEL:-$HOME/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf}
    mkdir -p .gpu-model
    rm -f .gpu-model/part-*
    split -n 3 -a 1 "$src" .gpu-model/part-
    ls -la .gpu-model
    ;;
run)
    out=${OUT:-gpu-logs}
    mkdir -p "$out"
    work=$(mktemp -d)
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv | tee "$out/nvidia-smi.txt" || true
    # The parts arrive one call each; until the last one (part-c) is here, the tests that
    # need the real model skip visibly rather than failing on a half file.
    if [ -f .gpu-model/part-c ]; then
        cat .gpu-model/part-* >"$work/SmolLM2-135M-Instruct.Q4_1.gguf"
        if echo "$SMOLLM2_SHA256  $work/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet; then
            export KILN_TEST_MODEL="$work/SmolLM2-135M-Instruct.Q4_1.gguf"
        else
            echo "the joined SmolLM2 file has the wrong sha256"; exit 1
        fi
    fi
    export KILN_REQUIRE_GPU=1 KILN_CACHE_DIR="$work/cache"
    status=0
    summary=()
    # TESTS picks a subset (e.g. TESTS="parity gpu_parity") when device time is short.
    for name in ${TESTS:-gpu parity prefill q4_0_parity gpu_parity conformance batched_decode kv_types}; do
        t=.gpu/$name
        [ -x "$t" ] || continue
        if "$t" --include-ignored --test-threads=1 --nocapture >"$out/test-$name.log" 2>&1; then
            summary+=("$name: $(grep -E '^test result' "$out/test-$name.log" | tail -1)")
        else
            status=1
            summary+=("$name: FAILED (see test-$name.log)")
            grep -E -A4 "panicked" "$out/test-$name.log" | head -40 || true
        fi
    done
    grep -hE "min cosine|cosine|rel err|agree|sequences drew" "$out"/test-*.log | head -80 || true
    if [ "${KERNEL_BENCH:-0}" = 1 ]; then
        .gpu/kernel_bench --quick >"$out/kernel-bench.log" 2>&1 || status=1
        sed -n '/^summary/,$p' "$out/kernel-bench.log"
    fi
    if [ "${DECODE_BENCH:-0}" = 1 ]; then
        .gpu/decode_bench -n 128 >"$out/decode-bench.md" 2>&1 || status=1
    fi
    if [ -n "${KILN_TEST_MODEL:-}" ]; then
        .gpu/kiln backends -m "$KILN_TEST_MODEL" >"$out/backends.txt" 2>&1 || status=1
        .gpu/kiln run "The capital of France is" -n 24 -m "$KILN_TEST_MODEL" >"$out/run.txt" 2>&1 || status=1
        tail -n 3 "$out/backends.txt" "$out/run.txt"
    fi
    if [ "${BENCH:-1}" = 0 ]; then
        echo
        echo "== summary =="
        grep -hE "min cosine|worst cosine|two executors" "$out"/test-*.log 2>/dev/null | sed -E 's/ +/ /g' || true
        printf '%s\n' "${summary[@]}"
        rm -rf "$work"
        bundle_logs "$out"
        exit $status
    fi
    # Benchmark models, made here by kiln itself.
    kiln=.gpu/kiln
    models=()
    if [ -n "${KILN_TEST_MODEL:-}" ]; then
        $kiln quantize "$KILN_TEST_MODEL" "$work/smollm2-135m.q4_k_m.gguf" --type q4_k_m >"$out/quantize.log" 2>&1 && models+=("$work/smollm2-135m.q4_k_m.gguf")
    fi
    for shape in llama3.2-1b llama3-8b; do
        start=$SECONDS
        if $kiln synth "$work/$shape.q4_k_m.gguf" --shape $shape --type q4_k_m >>"$out/synth.log" 2>&1; then
            models+=("$work/$shape.q4_k_m.gguf")
        fi
        echo "synth $shape q4_k_m: $((SECONDS - start)) s" >>"$out/synth.log"
    done
    tail -n 4 "$out/synth.log" || true
    : >"$out/bench.md"
    for m in "${models[@]}"; do
        $kiln bench -m "$m" -p 512 -n 128 -r 5 2>>"$out/bench.err" | tee -a "$out/bench.md" || status=1
        $kiln bench -m "$m" -p 0 -n 128 -r 5 --quantized-activations 2>>"$out/bench.err" | tee -a "$out/bench.md" || status=1
    done
    echo
    echo "== summary =="
    grep -hE "min cosine" "$out"/test-gpu_parity.log 2>/dev/null | sed -E 's/ +/ /g' || true
    if [ -f "$out/decode-bench.md" ]; then grep -E '^\|' "$out/decode-bench.md" | grep -v -- '---' || true; fi
    grep -E '^\| [^-m]' "$out/bench.md" | grep -v '^| model' || true
    grep -E 'roofline' "$out/bench.md" | head -1 || true
    printf '%s\n' "${summary[@]}"
    rm -rf "$work"
    bundle_logs "$out"
    exit $status
    ;;
bench)
    out=${OUT:-gpu-logs}
    mkdir -p "$out"
    work=${BENCH_MODELS:-/tmp/kiln-bench-models}
    mkdir -p "$work"
    kiln=.gpu/kiln
    models=()
    # The parts arrive one call each; until the last one (part-c) is here, the tests that
    # need the real model skip visibly rather than failing on a half file.
    if [ -f .gpu-model/part-c ]; then
        cat .gpu-model/part-* >"$work/SmolLM2-135M-Instruct.Q4_1.gguf"
        echo "$SMOLLM2_SHA256  $work/SmolLM2-135M-Instruct.Q4_1.gguf" | sha256sum -c --quiet
        for t in q4_0 q4_k_m; do
            $kiln quantize "$work/SmolLM2-135M-Instruct.Q4_1.gguf" "$work/smollm2-135m.$t.gguf" --type $t >>"$out/quantize.log" 2>&1
            models+=("$work/smollm2-135m.$t.gguf")
        done
    fi
    for shape in ${SHAPES:-llama3.2-1b llama3-8b}; do
        for t in q4_0 q4_k_m; do
            f="$work/$shape.$t.gguf"
            [ -f "$f" ] || $kiln synth "$f" --shape "$shape" --type $t --seed 0 >>"$out/synth.log" 2>&1
            models+=("$f")
        done
    done
    bash scripts/bench/bench_vs_llamacpp.sh build-llamacpp
    bash scripts/bench/bench_vs_llamacpp.sh run "${models[@]}"
    ;;
*)
    echo "usage: $0 build|split|run|bench" >&2
    exit 2
    ;;
esac
