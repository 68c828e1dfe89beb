#!/usr/bin/env bash
# Two kiln binaries in one device call, alternating, so that a change is measured against
# the code before it on the same machine in the same minutes (the GPU's clocks and the
# host's neighbours drift between calls). Build the old binary first, e.g.
#   git stash && cargo build --release -p kiln --bin kiln && cp target/release/kiln .gpu/kiln_old && git stash pop
#
#   scripts/gpu/ab_bench.sh tg OUT MODEL...  tg128 at each of DEPTHS (default "0 4096"), two
#                                           rounds of old then new; one line each in OUT/ab.txt
#                                           (KILN_BENCH_ARGS adds flags, e.g. "--kv-type q8_0")
#   scripts/gpu/ab_bench.sh pp OUT MODEL...  pp512 (`-p 512 -n 0 -r 5`), three rounds of old
#                                           then new; one line each in OUT/abp.txt
#   scripts/gpu/ab_bench.sh batch OUT MODEL...   `kiln bench --batch $BATCH` (default 1,4,16,64;
#                                           -p 128 -n 128 -r 2) for each binary; OUT/abb.txt
# BINS="kiln_old kiln" names the binaries under .gpu/.
set -uo pipefail
cd "$(dirname "$0")/../.."
mode=${1:-}
out=${2:-}
shift 2 || { echo "usage: $0 tg|pp|batch OUT MODEL..." >&2; exit 2; }
mkdir -p "$out"
case "$mode" in
tg)
    for m in "$@"; do
        for d in ${DEPTHS:-0 4096}; do
            for round in 1 2; do
                for b in ${BINS:-kiln_old kiln}; do
                    line=$(timeout 120 ".gpu/$b" bench -m "$m" -p 0 -n 128 -r 5 -d "$d" ${KILN_BENCH_ARGS:-} 2>>"$out/ab.err" | grep -E 'tg128' | tail -1)
                    echo "$(basename "$m") d$d round $round $b $line" | tee -a "$out/ab.txt"
                done
            done
        done
    done
    ;;
pp)
    for m in "$@"; do
        for round in 1 2 3; do
            for b in ${BINS:-kiln_old kiln}; do
                line=$(timeout 120 ".gpu/$b" bench -m "$m" -p 512 -n 0 -r 5 ${KILN_BENCH_ARGS:-} 2>>"$out/abp.err" | grep -E 'pp512' | tail -1)
                echo "$(basename "$m") round $round $b $line" | tee -a "$out/abp.txt"
            done
        done
    done
    ;;
batch)
    for m in "$@"; do
        for b in ${BINS:-kiln_old kiln}; do
            echo "== $(basename "$m") $b" >>"$out/abb.txt"
            timeout 200 ".gpu/$b" bench -m "$m" --batch "${BATCH:-1,4,16,64}" -p 128 -n 128 -r 2 2>>"$out/abb.err" |
                tee -a "$out/abb.txt" | grep -E '^\|' | tail -8
        done
    done
    ;;
*)
    echo "usage: $0 tg|pp|batch OUT MODEL..." >&2
    exit 2
    ;;
esac
