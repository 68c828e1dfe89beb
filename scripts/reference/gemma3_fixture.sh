#!/usr/bin/env bash
# Makes tests/fixtures/gemma3/llamacpp_greedy.jsonl: llama.cpp's first-step logits (at probe
# ids) and 32-step greedy continuations on the real Gemma 3 270M Q4_K_M, for prompts that
# kiln tokenised (so the fixture compares forward passes only; one prompt is longer than
# the 512-position sliding window); and tokenizer_llamacpp.jsonl: llama.cpp's token ids for
# the 40 strings of tokenizer_strings.jsonl.
#
#   LLAMACPP_DIR=/path/to/llama.cpp-cpu-build bash scripts/reference/gemma3_fixture.sh
#
# LLAMACPP_DIR holds `llama.cpp/` (sources) and `build/` (a CPU build with static libraries,
# e.g. `GGML_CUDA=OFF LLAMACPP_DIR=… scripts/bench_vs_llamacpp.sh build-llamacpp`).
# HuggingFace `transformers` references (float32) are the issue's bar and need torch; this
# is the llama.cpp side, made on a machine without it.
set -euo pipefail
cd "$(dirname "$0")/../.."
dir=${LLAMACPP_DIR:?set LLAMACPP_DIR to a llama.cpp CPU build}
kiln=${KILN:-target/release/kiln}
out=tests/fixtures/gemma3
mkdir -p "$out"
bin=$(mktemp -d)/llamacpp_reference
b=$dir/build
g++ -O2 -std=c++17 -fopenmp -I "$dir/llama.cpp/include" -I "$dir/llama.cpp/ggml/include" \
    scripts/reference/llamacpp_reference.cpp "$b/src/libllama.a" "$b/ggml/src/libggml.a" \
    "$b/ggml/src/libggml-cpu.a" "$b/ggml/src/libggml-base.a" -lpthread -ldl -lm -o "$bin"
model=$($kiln run -m gemma3-270m "x" -n 1 --format json >/dev/null && echo "${KILN_CACHE_DIR:-$HOME/.cache/kiln}/models/gemma-3-270m-q4_k_m.gguf")
long=$(for i in $(seq 1 20); do printf 'Section %d. The river runs past the old mill, where the miller keeps a ledger of every sack of grain, every visitor and every storm. ' "$i"; done)
prompts=(
    "The capital of France is"
    "def fibonacci(n):"
    "Translate to German: The weather is nice today."
    "1, 1, 2, 3, 5, 8, 13,"
    "$long In which section does the river first appear? Answer:"
)
ids=$(mktemp)
for p in "${prompts[@]}"; do
    $kiln tokenize "$model" "$p" | awk '$1 ~ /^[0-9]+$/ && NF >= 2 { printf "%s ", $1 } END { print "" }'
done >"$ids"
awk '{ print NF " tokens" }' "$ids"
"$bin" greedy "$model" 32 <"$ids" >"$out/llamacpp_greedy.jsonl"
"$bin" tokenize "$model" <"$out/tokenizer_strings.jsonl" >"$out/tokenizer_llamacpp.jsonl"
echo "wrote $out/llamacpp_greedy.jsonl ($(wc -c <"$out/llamacpp_greedy.jsonl") bytes)"
