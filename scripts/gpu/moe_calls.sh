#!/usr/bin/env bash
# Mixture of Experts, gpt-oss and the low-bit types on the GPU, a device call each (after
# scripts/gpu/device_calls.sh pack):
#
#   scripts/gpu/moe_calls.sh start   call 1: unpacks .gpu/, starts llama.cpp's build and
#                                    `kiln synth` of qwen3-30b-a3b q4_k_m (and the 1B / 8B
#                                    q4_k_m files the A/B reads) in the background, then runs
#                                    the expert kernel tests, the MoE and gpt-oss parity
#                                    tests and the conformance suite. Logs in $OUT. (The
#                                    18 GB MoE file took over 8 minutes beside the build on
#                                    2026-12-08: `bench` waits for it, 10 minutes at most.)
#   scripts/gpu/moe_calls.sh bench   call 2, while the machine is warm: qwen3-30b-a3b q4_k_m
#                                    beside llama.cpp on the same file (pp512 / tg128, and
#                                    batched S_TG at NPL), then kiln_old against kiln (tg128)
#                                    on the dense files, and .gpu/kiln_head (if packed)
#                                    against kiln on the MoE file (pp512, S_TG).
#   scripts/gpu/moe_calls.sh gpt-oss  a call while warm: the rest of gpt-oss's GPU parts
#                                    (MXFP4's exponents, attention sinks, MXFP4 experts on
#                                    qwen3moe-small; `start` runs the kernels' biases and
#                                    clamp and the transformers fixture).
#   scripts/gpu/moe_calls.sh gpt-oss-bench  gpt-oss-20b (synthetic, llama.cpp's MXFP4_MOE
#                                    mix) beside llama.cpp: pp512 / tg128 and S_TG at NPL
#                                    (after `start`, whose llama.cpp build it uses).
#   scripts/gpu/moe_calls.sh quant-bench  llama3-8b in each of TYPES (default iq4_xs iq3_s
#                                    iq2_xxs q3_k_m q2_k) beside llama.cpp: pp512 / tg128 and
#                                    S_TG at B = 16 (#45's table; a call holds about three).
#   scripts/gpu/moe_calls.sh low-bit  a call while warm: the grid I-quants' kernels, their
#                                    mixes against the CPU (one and batched), the shared
#                                    hidden-state passes.
#   scripts/gpu/moe_calls.sh tests   TESTS_RUN only (its default: start's tests).
set -uo pipefail
cd "$(dirname "$0")/../.."
work=/tmp/w
out=${OUT:-device-logs}
# llama.cpp's build, started by `start`, done (or 10 minutes gone).
wait_for_llamacpp() {
    local bin=${LLAMACPP_DIR:-/tmp/llamacpp}/build/bin
    for _ in $(seq 200); do
        [ -x "$bin/llama-bench" ] && ! pgrep -f "cmake --build" >/dev/null && return
        sleep 3
    done
}
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
    bash "$0" tests
    ;;
tests)
    # TESTS_RUN: "binary filter seconds" entries separated by commas (filter "all": every
    # test). The default is the Mixture-of-Experts set.
    [ -x .gpu/gpu ] || tar -xJf .gpu-pack/gpu.tar.xz
    export KILN_REQUIRE_GPU=1 KILN_CACHE_DIR=$work/cache
    # Limits from the H100 run of 2026-12-08, which shared the machine with llama.cpp's
    # build: the expert and grouped kernel tests ~65 s, the fixtures ~30 s with the first
    # kernel compile, the shared hidden-state passes ~25 s.
    IFS=, read -r -a runs <<<"${TESTS_RUN:-gpu expert 120,gpu_parity moe_fixtures 60,gpu_parity gpt_oss 30,gpu_parity qwen3moe 150,batched_decode qwen3moe 150,conformance all 90,gpu_parity llama32_1b_synthetic_matches 60}"
    for t in "${runs[@]}"; do
        set -- $t
        echo "== $t"
        filter=$2
        [ "$filter" = all ] && filter=
        timeout "$3" ".gpu/$1" --include-ignored --test-threads=1 --nocapture $filter >"$out/$1-$2.log" 2>&1
        echo "rc $?"
        grep -hE "^test |min cosine|worst|panicked|test result" "$out/$1-$2.log" | grep -vE "\.\.\. ignored" | tail -25
    done
    ;;
low-bit)
    TESTS_RUN=${TESTS_RUN:-"gpu_parity grid_iquant 300,batched_decode grid 200,gpu_parity hidden_state 60"} \
        bash "$0" tests
    ;;
gpt-oss)
    TESTS_RUN=${TESTS_RUN:-"gpu mxfp4 30,gpu attention_matches 150,gpu prefill_attention 60,gpu_parity mxfp4 150"} \
        bash "$0" tests
    ;;
gpt-oss-bench)
    [ -x .gpu/kiln ] || tar -xJf .gpu-pack/gpu.tar.xz
    m=$work/gpt-oss-20b.mxfp4_moe.gguf
    [ -s "$m" ] || .gpu/kiln synth "$m" --shape gpt-oss-20b --type mxfp4_moe --seed 0 2>&1 | tail -1
    wait_for_llamacpp
    nvidia-smi --query-gpu=name --format=csv,noheader
    KILN=.gpu/kiln OUT=$out/vs-gpt-oss PP=512 TG=128 REPS=3 LLAMA_BENCH_ARGS="-fa 1" BATCHED=1 NPL=${NPL:-1,4,16,64} \
        bash scripts/bench/bench_vs_llamacpp.sh run "$m" 2>&1 | tail -16
    ;;
quant-bench)
    [ -x .gpu/kiln ] || tar -xJf .gpu-pack/gpu.tar.xz
    wait_for_llamacpp
    nvidia-smi --query-gpu=name --format=csv,noheader
    for t in ${TYPES:-iq4_xs iq3_s iq2_xxs q3_k_m q2_k}; do
        m=$work/llama3-8b.$t.gguf
        [ -s "$m" ] || .gpu/kiln synth "$m" --shape llama3-8b --type "$t" --seed 0 2>&1 | tail -1
        echo "== llama3-8b $t"
        KILN=.gpu/kiln OUT=$out/vs-$t PP=512 TG=128 REPS=3 LLAMA_BENCH_ARGS="-fa 1" BATCHED=1 NPL=16 \
            bash scripts/bench/bench_vs_llamacpp.sh run "$m" 2>&1 | tail -8
        rm -f "$m"
    done
    ;;
one)
    # Both in one call when device time is short: the tests of `start` (TESTS_RUN), then
    # qwen3-30b-a3b pp512 / tg128 beside llama-bench as far as DEADLINE seconds allow.
    begin=$SECONDS
    bash "$0" start
    bin=${LLAMACPP_DIR:-/tmp/llamacpp}/build/bin
    m=$work/qwen3-30b-a3b.q4_k_m.gguf
    while [ ! -s "$work/synth-qwen3-30b-a3b.log" ] || pgrep -f "synth $m" >/dev/null; do
        [ $((SECONDS - begin)) -lt "${DEADLINE:-500}" ] || break
        sleep 2
    done
    nvidia-smi --query-gpu=name --format=csv,noheader
    timeout 60 .gpu/kiln bench -m "$m" -p 512 -n 128 -r 3 2>&1 | grep -E "pp512|tg128|GB|model"
    while [ ! -x "$bin/llama-bench" ] && [ $((SECONDS - begin)) -lt "${DEADLINE:-500}" ]; do sleep 2; done
    [ -x "$bin/llama-bench" ] && timeout 60 "$bin/llama-bench" -m "$m" -p 512 -n 128 -r 3 -fa 1 2>&1 | grep -E "pp512|tg128"
    tail -1 /tmp/llamacpp-build.log
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
    # A second build to compare on the MoE file (e.g. the commit before a kernel change,
    # packed as .gpu/kiln_head): pp512 and S_TG, alternating.
    if [ -x .gpu/kiln_head ]; then
        BINS="kiln_head kiln" bash scripts/gpu/ab_bench.sh pp "$out/ab" "$m" 2>&1 | tail -6
        BINS="kiln_head kiln" BATCH=${NPL:-1,4,16,64} bash scripts/gpu/ab_bench.sh batch "$out/ab" "$m" 2>&1 | tail -20
    fi
    ;;
*)
    sed -n '2,28p' "$0"
    exit 2
    ;;
esac
