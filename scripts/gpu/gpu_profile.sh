#!/usr/bin/env bash
# Where the batched decode step's time goes, per kernel, on the GPU machine: Nsight Compute
# (`ncu`, which the GPU image carries) over the kernels of one batched step of
# `kiln bench --batch B`, summarised per kernel name (launches, total and mean duration,
# DRAM throughput, achieved occupancy, registers). Run after `scripts/gpu/gpu_suite.sh build`
# with .gpu carried:
#
#   SHAPES="llama3-8b" BATCHES="8 64" scripts/gpu/gpu_profile.sh
#
# SHAPES may also name decode_bench's in-memory models (smollm2, 1b, 8b): then each batch
# size B runs `decode_bench --batch B --profile-steps 1` under `--profile-from-start off`, so
# ncu sees exactly one batched step after prompts of 128 tokens (llama-batched-bench's
# context), every kernel of it and nothing else.
#
# BATCHES may hold 1 (the single-sequence graph: every kernel of a `kiln bench -p 0` run)
# and dN (decode attention only, after N tokens of context: `kiln bench -p 0 -d N`).
# The batched bench prefills its B one-token prompts one at a time through the batched
# kernels first (8-row launches, ~7 a layer each); LAUNCH_SKIP=N skips N matching launches
# so the count lands on the B-row steps (e.g. B × 7 × layers + a few).
#
# ncu leaves the clocks as it finds them (--clock-control none: the card's settings are not
# ours to change). Logs under $OUT (or ./prof-logs), one CSV per shape and batch, and the
# summaries printed last.
#
# Run on the H200 in the sixth session (docs/log/2026-11-to-12.md, "Decode attention at depth").
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-prof-logs}
mkdir -p "$out"
work=${WORK:-$(mktemp -d)}
mkdir -p "$work"
kiln=.gpu/kiln
ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1 || true)
[ -n "$ncu" ] || { echo "ncu not found"; exit 1; }
metrics=gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,sm__warps_active.avg.pct_of_peak_sustained_active,launch__registers_per_thread,launch__grid_size,sm__inst_executed_pipe_tensor_op_imma.avg.pct_of_peak_sustained_active,sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active,smsp__issue_active.avg.pct_of_peak_sustained_active
for shape in ${SHAPES:-llama3-8b}; do
    f=$work/$shape.q4_k_m.gguf
    case "$shape" in smollm2 | 1b | 8b) f= ;; esac
    [ -z "$f" ] || [ -f "$f" ] || { start=$SECONDS; $kiln synth "$f" --shape "$shape" --type q4_k_m --seed 0 >/dev/null 2>&1; echo "synth $shape: $((SECONDS - start)) s"; }
    for b in ${BATCHES:-8 64}; do
        # Only the batched step's kernels, after one-token prompts (longer prompts go
        # through the batched kernels too, 16 rows at a time, and would fill the count);
        # one step of a 32-layer model is ~14 launches a layer.
        kernels='regex:^(bmm|act_pack|attn_decode_batch|rope_kv_batch|embed_rows|argmax|sample_rows)'
        launches=${LAUNCHES:-520}
        args=(--batch "$b" -p 1 -n 4 -r 1)
        case "$b" in
        1) kernels='regex:^(gemv|swigluq|swiglu_q|rope_kv$|attn_decode_[0-9]|embed_|argmax_|quantize)' launches=${LAUNCHES:-600} args=(-p 0 -n 4 -r 1) ;;
        d*) kernels='regex:^attn_decode_[0-9]' launches=${LAUNCHES:-128} args=(-p 0 -n 4 -r 1 -d "${b#d}") ;;
        esac
        if [ -z "$f" ]; then
            "$ncu" --clock-control none --profile-from-start off --metrics "$metrics" \
                -f -o "$work/ncu-$shape-b$b" .gpu/decode_bench --model "$shape" --batch "$b" --profile-steps 1 \
                >"$out/ncu-$shape-b$b.log" 2>&1
        else
            "$ncu" --clock-control none -k "$kernels" -s "${LAUNCH_SKIP:-0}" -c "$launches" --metrics "$metrics" \
                -f -o "$work/ncu-$shape-b$b" "$kiln" bench -m "$f" "${args[@]}" >"$out/ncu-$shape-b$b.log" 2>&1
        fi
        "$ncu" -i "$work/ncu-$shape-b$b.ncu-rep" --csv --page raw >"$out/ncu-$shape-b$b.csv" 2>>"$out/ncu-$shape-b$b.log"
        echo "== $shape B=$b =="
        python3 - "$out/ncu-$shape-b$b.csv" <<'PY'
import csv, sys, collections
rows = [r for r in csv.reader(open(sys.argv[1])) if r]
try:
    h = next(i for i, r in enumerate(rows) if "Kernel Name" in r)
except StopIteration:
    print("no ncu rows"); sys.exit(0)
head = rows[h]; units = rows[h + 1]; data = rows[h + 2:]
col = {n: head.index(n) for n in head}
# Durations in ns whatever unit this ncu prints them in.
scale = {"ns": 1, "nsecond": 1, "us": 1e3, "usecond": 1e3, "ms": 1e6, "msecond": 1e6}
def f(r, n):
    try: return float(r[col[n]].replace(",", "")) * (scale.get(units[col[n]], 1) if n.startswith("gpu__time") else 1)
    except (KeyError, ValueError): return float("nan")
agg = collections.defaultdict(list)
for r in data:
    agg[r[col["Kernel Name"]]].append(r)
tot = sum(f(r, "gpu__time_duration.sum") for r in data)
print(f"{len(data)} launches, {tot/1e3:.1f} us in all")
print(f"{'kernel':40} {'n':>4} {'total us':>9} {'%':>5} {'mean us':>8} {'dram%':>6} {'occ%':>5} {'issue%':>6} {'imma%':>6} {'hmma%':>6} {'regs':>4} {'grid':>6}")
for k, rs in sorted(agg.items(), key=lambda kv: -sum(f(r, "gpu__time_duration.sum") for r in kv[1])):
    t = sum(f(r, "gpu__time_duration.sum") for r in rs)
    m = lambda n: sum(f(r, n) for r in rs) / len(rs)
    print(f"{k[:40]:40} {len(rs):4d} {t/1e3:9.1f} {100*t/tot:5.1f} {t/len(rs)/1e3:8.2f} {m('dram__throughput.avg.pct_of_peak_sustained_elapsed'):6.1f} "
          f"{m('sm__warps_active.avg.pct_of_peak_sustained_active'):5.1f} {m('smsp__issue_active.avg.pct_of_peak_sustained_active'):6.1f} "
          f"{m('sm__inst_executed_pipe_tensor_op_imma.avg.pct_of_peak_sustained_active'):6.1f} {m('sm__inst_executed_pipe_tensor_op_hmma.avg.pct_of_peak_sustained_active'):6.1f} {m('launch__registers_per_thread'):4.0f} {m('launch__grid_size'):6.0f}")
PY
    done
done
# The device tool brings back at most 8 files: the logs travel as one archive.
(cd "$out" && tar -czf prof-logs.tgz --exclude prof-logs.tgz -- * && find . -maxdepth 1 -type f ! -name prof-logs.tgz -delete)
