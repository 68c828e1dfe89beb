#!/usr/bin/env bash
# Runs every `kiln synth` preset end to end on the CPU backend: synthesise the model, then
# generate a few tokens with `kiln run --backend cpu --format json` and check the logits
# path produced tokens (finite logits are checked inside the executor's tests). The small
# presets are also covered by `cargo test -p kiln-formats --test synth_presets`; this
# script is for the large ones, which take minutes and gigabytes.
#
#   scripts/bench/cpu_presets.sh [TYPE] [PRESET...]     (TYPE default q4_0: the cheapest to make)
set -euo pipefail
cd "$(dirname "$0")/../.."
type=${1:-q4_0}
shift || true
presets=${*:-smollm2-135m qwen2.5-0.5b qwen3-0.6b llama3.2-1b qwen2.5-1.5b qwen2.5-7b llama3-8b qwen3-8b}
kiln=target/release/kiln
cargo build --release --bin kiln >/dev/null 2>&1
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
printf '| preset | type | synth s | decode tok/s | tokens |\n|---|---|---|---|---|\n'
for p in $presets; do
    start=$SECONDS
    $kiln synth "$work/$p.gguf" --shape "$p" --type "$type" >/dev/null 2>&1
    synth_s=$((SECONDS - start))
    out=$($kiln run "The quick brown fox" -n 4 --backend cpu --format json -m "$work/$p.gguf" 2>/dev/null)
    tps=$(echo "$out" | python3 -c 'import json,sys; print(round(json.load(sys.stdin)["timings"]["decode_tokens_per_sec"],2))')
    ids=$(echo "$out" | python3 -c 'import json,sys; print(json.load(sys.stdin)["generated_ids"])')
    printf '| %s | %s | %s | %s | %s |\n' "$p" "$type" "$synth_s" "$tps" "$ids"
    rm -f "$work/$p.gguf"
done
