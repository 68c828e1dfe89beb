#!/usr/bin/env bash
# `kiln perplexity` on the GPU machine in three device calls (run from the repository root):
#
#   scripts/gpu/perplexity_calls.sh pack        here: the binaries it needs from .gpu/ (build
#                                           them with scripts/gpu/gpu_suite.sh build) and the
#                                           first 120 kB of the KJV (scripts/data/kjv_text.py)
#                                           into .gpu-probe/ppl.tar.xz; carry .gpu-probe,
#                                           .llamacpp (bench_vs_llamacpp.sh prepare) and
#                                           .gpu-model/part-a (gpu_suite.sh split).
#   scripts/gpu/perplexity_calls.sh start       call 1: unpacks into /tmp/w, starts the CUDA
#                                           llama-perplexity build and `kiln synth` of llama3-8b
#                                           q4_k_m in the background, runs the scoring GPU tests
#                                           (prefill, conformance). Logs in $OUT.
#   scripts/gpu/perplexity_calls.sh stash       call 2 (carry .gpu-model/part-b): keeps the part
#                                           in /tmp/w for the next call (every call does this).
#   scripts/gpu/perplexity_calls.sh oracle      call 3 (carry .gpu-model/part-c): the real
#                                           SmolLM2 put together; the CPU oracle's logits over
#                                           the built-in text (-c 256) saved, then every GPU
#                                           backend that runs the file (and kiln's q4_k_m and
#                                           q4_0 requantisations of it, each against its own
#                                           oracle) scored against them: KLD and top-token.
#   scripts/gpu/perplexity_calls.sh speed       call 4: waits for the build and the 8B file, then
#                                           `kiln perplexity` and `llama-perplexity` over the
#                                           same ≥100k tokens (-c 512), and `kiln bench` pp512
#                                           on the same file, alternating twice.
#
# The background jobs survive between calls only while the machine stays warm.
set -uo pipefail
cd "$(dirname "$0")/../.."
work=/tmp/w
out=${OUT:-device-logs}
mkdir -p "$out"
bin=${LLAMACPP_DIR:-/tmp/llamacpp}/build/bin
# The real SmolLM2 comes a third per call (each call carries at most 64 MiB).
mkdir -p "$work"
cp .gpu-model/part-* "$work/" 2>/dev/null

case "${1:-}" in
pack)
    mkdir -p .gpu-probe
    kjv=${KJV:-$HOME/.cache/kiln/text/kjv.txt}
    [ -f "$kjv" ] || python3 scripts/data/kjv_text.py "$kjv" || exit 1
    head -c 120000 "$kjv" >.gpu-probe/kjv-120k.txt
    tar -cJf .gpu-probe/ppl.tar.xz .gpu/kiln .gpu/prefill .gpu/conformance .gpu-probe/kjv-120k.txt
    ls -la .gpu-probe/ppl.tar.xz
    ;;
start)
    mkdir -p "$work"
    tar -xJf .gpu-probe/ppl.tar.xz -C "$work"
    TARGETS=llama-perplexity JOBS=${JOBS:-12} setsid nohup bash scripts/bench/bench_vs_llamacpp.sh build-llamacpp \
        >/tmp/llamacpp-build.log 2>&1 </dev/null &
    # setsid: a plain background job dies with the call that started it.
    setsid nohup bash -c "'$work/.gpu/kiln' synth '$work/llama3-8b.q4_k_m.gguf' --shape llama3-8b --type q4_k_m \
        --seed 0 >'$work/synth-8b.log' 2>&1 && touch '$work/synth.done'" >/dev/null 2>&1 </dev/null &
    export KILN_REQUIRE_GPU=1 KILN_CACHE_DIR=$work/cache
    (cd "$work" && timeout 300 ./.gpu/prefill --include-ignored --test-threads=1 --nocapture) >"$out/prefill.log" 2>&1
    echo "prefill rc $?"; grep -E "^test |scoring|scored from|test result" "$out/prefill.log" | tail -30
    (cd "$work" && timeout 200 ./.gpu/conformance --include-ignored --test-threads=1 --nocapture) >"$out/conformance.log" 2>&1
    echo "conformance rc $?"; grep -E "scoring|^test |test result" "$out/conformance.log" | tail -20
    ;;
stash)
    ls "$work"/part-*
    ;;
oracle)
    cat "$work"/part-a "$work"/part-b "$work"/part-c >"$work/smol.gguf" || exit 1
    sha256sum "$work/smol.gguf" | cut -c1-16
    k=$work/.gpu/kiln
    text=src/data/kjv_genesis_1-4.txt
    "$k" quantize "$work/smol.gguf" "$work/smol.q4_k_m.gguf" --type q4_k_m >/dev/null 2>&1
    "$k" quantize "$work/smol.gguf" "$work/smol.q4_0.gguf" --type q4_0 >/dev/null 2>&1
    for m in smol smol.q4_k_m smol.q4_0; do
        f=$work/$m.gguf
        "$k" perplexity -m "$f" -f "$text" -c 256 --backend cpu --save-logits "$work/$m.klog" 2>"$out/$m.cpu.err" |
            grep Final | sed "s|^|$m cpu: |"
        for b in cuda-q4k cuda-q4_0; do
            for flags in "" "--quantized-activations"; do
                log=$out/$m.$b${flags:+.q8}.txt
                "$k" perplexity -m "$f" --backend $b $flags -c 256 --kl-divergence-base "$work/$m.klog" >"$log" 2>&1 ||
                    { echo "$m $b $flags: $(tail -1 "$log")"; continue; }
                echo "$m $b ${flags:-(15-bit)}: $(grep -E 'Mean PPL\(Q\) ' "$log" | tr -s ' ') | $(grep -E 'Mean +KLD' "$log" | tr -s ' ') | $(grep -E '99.0% +KLD' "$log" | tr -s ' ') | $(grep 'Same top' "$log" | tr -s ' ')"
            done
        done
    done
    ;;
speed)
    for _ in $(seq 150); do
        [ -x "$bin/llama-perplexity" ] && [ -f "$work/synth.done" ] && ! pgrep -f "cmake --build" >/dev/null && break
        sleep 3
    done
    [ -f "$work/synth.done" ] || { echo "no 8B file: $(tail -2 "$work/synth-8b.log")"; exit 1; }
    tail -1 /tmp/llamacpp-build.log
    m=$work/llama3-8b.q4_k_m.gguf
    text=$work/.gpu-probe/kjv-120k.txt
    for round in 1 2; do
        "$work/.gpu/kiln" perplexity -m "$m" -f "$text" -c 512 >"$out/kiln-ppl.$round.txt" 2>&1
        echo "kiln round $round: $(grep -E 'text is|tokens in|Final' "$out/kiln-ppl.$round.txt" | tr '\n' ' ')"
        LD_LIBRARY_PATH=$bin "$bin/llama-perplexity" -m "$m" -f "$text" -c 512 -ngl 99 >"$out/llama-ppl.$round.txt" 2>&1
        echo "llama.cpp round $round: $(grep -E 'calculating perplexity|prompt eval time|Final' "$out/llama-ppl.$round.txt" | tr '\n' ' ')"
    done
    "$work/.gpu/kiln" bench -m "$m" -p 512 -n 0 -r 5 2>&1 | grep -E "pp512|backend" | tail -3
    (cd "$out" && tar -czf ppl-logs.tgz ./*.txt && rm -f ./*.txt)
    ;;
*)
    sed -n '2,28p' "$0"
    exit 2
    ;;
esac
