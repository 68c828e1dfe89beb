#!/usr/bin/env bash
# Coverage-guided fuzzing of kiln's untrusted-input parsers with libFuzzer (needs a nightly
# toolchain; cargo-fuzz is not required): builds the targets of fuzz/ with the sanitizer-
# coverage flags cargo-fuzz uses, then runs each for RUNS executions (default 10 million)
# on a scratch copy of its committed seed corpus. A crash leaves its input under
# fuzz/artifacts/TARGET/ and makes the script exit 1. CI runs the same targets on stable
# through formats/tests/fuzz_harness.rs and formats/tests/apr_container.rs.
#
#   scripts/check/fuzz.sh [TARGET...]    # default: gguf_reader gguf_model tokenizer chat_template apr_reader
#   RUNS=1000000 scripts/check/fuzz.sh gguf_reader
set -euo pipefail
cd "$(dirname "$0")/../.."
targets=("$@")
[ ${#targets[@]} -gt 0 ] || targets=(gguf_reader gguf_model tokenizer chat_template apr_reader)
runs=${RUNS:-10000000}
triple=$(rustc -vV | sed -n 's/^host: //p')
export RUSTFLAGS="-Cpasses=sancov-module -Cllvm-args=-sanitizer-coverage-level=4 \
-Cllvm-args=-sanitizer-coverage-inline-8bit-counters -Cllvm-args=-sanitizer-coverage-pc-table \
-Cllvm-args=-sanitizer-coverage-trace-compares --cfg fuzzing -Cdebug-assertions -Coverflow-checks"
cargo +nightly build --release --manifest-path fuzz/Cargo.toml --target "$triple" \
    $(printf -- '--bin %s ' "${targets[@]}")
status=0
for t in "${targets[@]}"; do
    work=$(mktemp -d)
    cp fuzz/corpus/"$t"/* "$work"/
    mkdir -p fuzz/artifacts/"$t"
    start=$SECONDS
    if fuzz/target/"$triple"/release/"$t" "$work" -runs="$runs" -rss_limit_mb=2048 -timeout=10 \
        -max_len=262144 -artifact_prefix=fuzz/artifacts/"$t"/ -print_final_stats=1 >"fuzz/artifacts/$t.log" 2>&1; then
        result=ok
    else
        result="CRASH (see fuzz/artifacts/$t.log)"
        status=1
    fi
    execs=$(grep -oE 'stat::number_of_executed_units: *[0-9]+' "fuzz/artifacts/$t.log" | grep -oE '[0-9]+$' || echo "?")
    rss=$(grep -oE 'stat::peak_rss_mb: *[0-9]+' "fuzz/artifacts/$t.log" | grep -oE '[0-9]+$' || echo "?")
    echo "$t: $execs executions in $((SECONDS - start)) s, peak RSS ${rss} MB, $(ls "$work" | wc -l) corpus entries: $result"
    rm -rf "$work"
done
exit $status
