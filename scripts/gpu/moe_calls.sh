#!/usr/bin/env bash
# Mixture-of-Experts on the GPU in two device calls (after scripts/gpu/device_calls.sh pack):
#
#   scripts/gpu/moe_calls.sh start   call 1: unpacks .gpu/, starts llama.cpp's build and
#                                    `kiln synth` of qwen3-30b-a3b q4_k_m (and the 1B / 8B
#                                    q4_k_m files the A/B reads) in the background, then runs
#                                    the expert kernel tests, the MoE parity tests and the
#                                    conformance suite. Logs in $OUT.
#   scripts/gpu/moe_calls.sh bench   call 2, while the machine is warm: qwen3-30b-a3b q4_k_m
#                                    beside llama.cpp on the same file (pp512 / tg128, and
#                                    batched S_TG at NPL), then kiln_old against kiln (tg128)
#                                    on the dense files.
set -uo pipefail
cd "$(dirname "$0")/../.."
work=/tmp/w
out=${OUT:-device-logs}
mkdir -p "$work" "$out"
case "${1:-}" in
start)
    tar -xJf .gpu-pack/gpu.tar.xz
    JOBS=${JOBS:-12} setsid nohup bash scripts/bench/bench_vs_llamacpp.sh build-llamacpp >/tmp/llamacpp-build.log 2>&1 </dev/null &
    (
        for shape in qwen3-30b-a3b llama3.2-1b llama3-8b; do
            .gpu/kiln synth "$work/$shape.q4_k_m.gguf" --shape $shape --type q4_k_m --seed 0 >"$work/synth-$shape.log" 2>&1
        done
        touch "$work/synth.done"
    ) >/dev/null 2>&1 &
    export KILN_REQUIRE_GPU=1 KILN_CACHE_DIR=$work/cache
    for t in ${TESTS_RUN:-"gpu expert" "gpu_parity moe" "gpu_parity qwen3moe" "batched_decode qwen3moe" "conformance"}; do
        set -- $t
        echo "== $t"
        timeout "${LIMIT:-200}" ".gpu/$1" --include-ignored --test-threads=1 --nocapture ${2:-} >"$out/$1-${2:-all}.log" 2>&1
        echo "rc $?"
        grep -hE "^test |min cosine|worst|panicked|test result" "$out/$1-${2:-all}.log" | grep -vE "\.\.\. ignored" | tail -25
    done
    ;;
bench)
    bin=${LLAMACPP_DIR:-/tmp/llamacpp}/build/bin
    for _ in $(seq 200); do
        [ -x "$bin/llama-bench" ] && [ -f "$work/synth.done" ] && ! pgrep -f "cmake --build" >/dev/null && break
        sleep 3
    done
    tail -2 /tmp/llamacpp-build.log
    m=$work/qwen3-30b-a3b.q4_k_m.gguf
    nvidia-smi --query-gpu=name --format=csv,noheader
    KILN=.gpu/kiln OUT=$out/vs PP=512 TG=128 REPS=3 LLAMA_BENCH_ARGS="-fa 1" BATCHED=1 NPL=${NPL:-1,4,16,64} \
        bash scripts/bench/bench_vs_llamacpp.sh run "$m" 2>&1 | tail -16
    DEPTHS="0" bash scripts/gpu/ab_bench.sh tg "$out/ab" "$work/llama3.2-1b.q4_k_m.gguf" "$work/llama3-8b.q4_k_m.gguf" 2>&1 | tail -12
    ;;
*)
    sed -n '2,12p' "$0"
    exit 2
    ;;
esac
