#!/usr/bin/env bash
# A session's GPU measurements in as few device calls as its 30 minutes allow: what worked
# on 2026-12-02 (two calls of ~10 and ~2 minutes ran the GPU tests that matter, llama.cpp's
# build, the A/B against the session's starting binary and the side-by-side tables).
#
#   scripts/gpu/device_calls.sh pack REV     here: builds .gpu/ (scripts/gpu/gpu_suite.sh build), the
#                                        kiln binary of REV (the session's starting commit)
#                                        into .gpu/kiln_old through a git worktree, and packs
#                                        .gpu/ into .gpu-pack/gpu.tar.xz (~16 MB; carry
#                                        .gpu-pack and .llamacpp, from
#                                        `scripts/bench/bench_vs_llamacpp.sh prepare`).
#   scripts/gpu/device_calls.sh start    call 1 on the GPU machine: unpacks .gpu/, starts the
#                                        llama.cpp build and `kiln synth` of the 1B and 8B
#                                        q4_k_m files (/tmp/w) in the background, then runs
#                                        the GPU tests named in TESTS (default "gpu_parity
#                                        batched_decode") under a 540 s limit. Logs in $OUT.
#                                        With CPU=1 it also builds llama.cpp for the CPU
#                                        (/tmp/llamacpp-cpu) and synthesises SmolLM2 q4_1.
#   scripts/gpu/device_calls.sh compare  call 2, within the machine's 30 s idle window: waits
#                                        for the build and the files, then kiln_old against
#                                        kiln (tg128 at depth 0 and 4096) and both beside
#                                        llama.cpp (pp512/tg128, batched S_TG, tg128 @ d4096,
#                                        and tg128 @ d4096 with q8_0 KV caches in both).
#   scripts/gpu/device_calls.sh cpu      the host's CPU (after start with CPU=1): kiln_old,
#                                        kiln and llama.cpp's CPU build alternating on the
#                                        same two idle cores, SmolLM2 q4_1, tg128 and pp512.
#
# The background jobs survive between calls only while the machine stays warm.
set -uo pipefail
cd "$(dirname "$0")/../.."
work=/tmp/w
models() { echo "$work/llama3.2-1b.q4_k_m.gguf $work/llama3-8b.q4_k_m.gguf"; }

case "${1:-}" in
pack)
    rev=${2:?give the revision to compare against (e.g. the starting commit of the session)}
    bash scripts/gpu/gpu_suite.sh build >/tmp/device-calls-build.log 2>&1 || { tail -20 /tmp/device-calls-build.log; exit 1; }
    tree=$(mktemp -d)/old
    git worktree add -f "$tree" "$rev" >/dev/null
    # The old tree builds in its own target directory, seeded from this one's release
    # profile (the debug one is large and unused here) so only the workspace's crates
    # compile again.
    mkdir -p "$tree/target"
    cp -r target/release "$tree/target/release"
    (cd "$tree" && cargo build --release -p kiln --bin kiln) >/tmp/device-calls-old.log 2>&1 || { tail -20 /tmp/device-calls-old.log; exit 1; }
    cp "$tree/target/release/kiln" .gpu/kiln_old
    strip .gpu/kiln_old
    git worktree remove --force "$tree"
    mkdir -p .gpu-pack
    rm -f .gpu-pack/gpu.tar.xz
    tar -cJf .gpu-pack/gpu.tar.xz .gpu
    ls -la .gpu-pack/gpu.tar.xz
    ;;
start)
    out=${OUT:-device-logs}
    mkdir -p "$work" "$out"
    tar -xJf .gpu-pack/gpu.tar.xz
    JOBS=${JOBS:-10} setsid nohup bash scripts/bench/bench_vs_llamacpp.sh build-llamacpp >/tmp/llamacpp-build.log 2>&1 </dev/null &
    if [ "${CPU:-0}" = 1 ]; then
        GGML_CUDA=OFF LLAMACPP_DIR=/tmp/llamacpp-cpu JOBS=4 setsid nohup bash scripts/bench/bench_vs_llamacpp.sh build-llamacpp \
            >/tmp/llamacpp-cpu-build.log 2>&1 </dev/null &
        (.gpu/kiln synth "$work/smollm2-135m.q4_1.gguf" --shape smollm2-135m --type q4_1 --seed 0 >"$work/synth-smollm2.log" 2>&1 &&
            touch "$work/synth-cpu.done") >/dev/null 2>&1 &
    fi
    (
        for shape in llama3.2-1b llama3-8b; do
            .gpu/kiln synth "$work/$shape.q4_k_m.gguf" --shape $shape --type q4_k_m --seed 0 >"$work/synth-$shape.log" 2>&1
        done
        touch "$work/synth.done"
    ) >/dev/null 2>&1 &
    OUT=$out/suite TESTS=${TESTS:-gpu_parity batched_decode} BENCH=0 timeout "${LIMIT:-540}" bash scripts/gpu/gpu_suite.sh run 2>&1 | tail -30
    echo "suite rc ${PIPESTATUS[0]} (124: cut by the limit; the logs say how far it got)"
    ;;
compare)
    out=${OUT:-device-logs}
    mkdir -p "$out"
    bin=${LLAMACPP_DIR:-/tmp/llamacpp}/build/bin
    for _ in $(seq 200); do
        [ -x "$bin/llama-bench" ] && [ -x "$bin/llama-batched-bench" ] && [ -f "$work/synth.done" ] &&
            ! pgrep -f "cmake --build" >/dev/null && break
        sleep 3
    done
    tail -2 /tmp/llamacpp-build.log
    # shellcheck disable=SC2046
    DEPTHS="0 4096" bash scripts/gpu/ab_bench.sh tg "$out/ab" $(models)
    # shellcheck disable=SC2046
    KILN=.gpu/kiln OUT=$out/vs PP=512 TG=128 REPS=3 LLAMA_BENCH_ARGS="-fa 1" BATCHED=1 NPL=${NPL:-1,4,16,64} \
        bash scripts/bench/bench_vs_llamacpp.sh run $(models) 2>&1 | tail -22
    # shellcheck disable=SC2046
    KILN=.gpu/kiln OUT=$out/d4k PP=0 TG=128 REPS=3 DEPTH=4096 LLAMA_BENCH_ARGS="-fa 1" \
        bash scripts/bench/bench_vs_llamacpp.sh run $(models) 2>&1 | tail -6
    # shellcheck disable=SC2046
    KILN=.gpu/kiln OUT=$out/d4k-q8 PP=0 TG=128 REPS=3 DEPTH=4096 KILN_BENCH_ARGS="--kv-type q8_0" \
        LLAMA_BENCH_ARGS="-fa 1 -ctk q8_0 -ctv q8_0" bash scripts/bench/bench_vs_llamacpp.sh run $(models) 2>&1 | tail -6
    (cd "$out" && tar -czf compare.tgz ab vs d4k d4k-q8 && rm -rf ab vs d4k d4k-q8)
    ;;
cpu)
    out=${OUT:-device-logs}/cpu
    mkdir -p "$out"
    bin=/tmp/llamacpp-cpu/build/bin
    for _ in $(seq 200); do
        [ -x "$bin/llama-bench" ] && [ -f "$work/synth-cpu.done" ] && break
        sleep 3
    done
    m=$work/smollm2-135m.q4_1.gguf
    cores=${CORES:-2,3}
    lscpu | grep -E 'Model name|^CPU\(s\)|Flags' | cut -c1-160 >"$out/lscpu.txt"
    # Alternating, on the same two cores, nothing else running: three rounds of each tool.
    for round in 1 2 3; do
        for b in kiln_old kiln; do
            line=$(taskset -c "$cores" ".gpu/$b" bench -m "$m" --backend cpu -t 2 -p 0 -n 128 -r 3 2>>"$out/err" | grep tg128)
            echo "round $round $b t2 $line" | tee -a "$out/cpu.txt"
        done
        line=$(taskset -c "$cores" "$bin/llama-bench" -m "$m" -t 2 -ngl 0 -p 0 -n 128 -r 3 2>>"$out/err" | grep tg128)
        echo "round $round llama.cpp t2 $line" | tee -a "$out/cpu.txt"
    done
    for b in kiln_old kiln; do
        line=$(taskset -c "$cores" ".gpu/$b" bench -m "$m" --backend cpu -t 1 -p 512 -n 128 -r 3 2>>"$out/err" | grep -E 'pp512|tg128' | tr '\n' ' ')
        echo "t1 $b $line" | tee -a "$out/cpu.txt"
    done
    line=$(taskset -c "$cores" "$bin/llama-bench" -m "$m" -t 1 -ngl 0 -p 512 -n 128 -r 3 2>>"$out/err" | grep -E 'pp512|tg128' | tr '\n' ' ')
    echo "t1 llama.cpp $line" | tee -a "$out/cpu.txt"
    ;;
*)
    sed -n '2,24p' "$0"
    exit 2
    ;;
esac
