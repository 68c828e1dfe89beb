#!/usr/bin/env bash
# kiln against llama.cpp, side by side on the same GGUF files in the same run. The GPU
# machine has no network and no Rust, so a stripped llama.cpp source tarball travels with
# kiln's binaries (.gpu/, from scripts/gpu/gpu_suite.sh build) and is built there:
#
#   scripts/bench/bench_vs_llamacpp.sh prepare   here (pip, network): downloads the
#                            llama-cpp-python 0.3.36 source distribution, keeps only what
#                            vendor/llama.cpp needs to build llama-bench, llama-batched-bench,
#                            llama-perplexity, llama-quantize and llama-server (ggml CPU + CUDA
#                            backends, those tools, mtmd, no web UI)
#                            and writes .llamacpp/llama.cpp.tar.xz (git-ignored through
#                            .git/info/exclude; carry it to the GPU machine).
#   scripts/bench/bench_vs_llamacpp.sh build-llamacpp  on the GPU machine: unpacks the tarball into
#                            $LLAMACPP_DIR (default /tmp/llamacpp) and builds the three tools with
#                            CUDA (sm_90, Release, Ninja). Does nothing when all three are built; when
#                            a call's time limit cuts the build, run it again: ninja resumes.
#                            GGML_CUDA=OFF builds for the CPU (AVX2+FMA+F16C; with GGML_CPU_NATIVE=1
#                            for the build machine's own instruction set, AVX-512 included);
#                            CUDA_ARCH=90 and JOBS=<nproc> are the defaults; TARGETS="llama-bench"
#                            builds only that tool (what a CPU comparison needs).
#   scripts/bench/bench_vs_llamacpp.sh run MODEL...    on the GPU machine: for each GGUF file,
#                            `llama-bench -m M -p 512 -n 128 -r 5 -ngl 99 -o json` and
#                            `kiln bench -m M -p 512 -n 128 -r 5 --output json`, then one markdown
#                            table with the ratio kiln/llama.cpp per row (printed last). Raw
#                            outputs and the table under $OUT (or ./bench-logs). A failing model
#                            is recorded in the table and the script exits 1 at the end.
#                            KILN=.gpu/kiln picks the kiln binary, KILN_BENCH_ARGS adds flags to
#                            it (e.g. "--backend cuda-q4_0"); PP=512 TG=128 REPS=5 NGL=99 change
#                            the test; LLAMA_BENCH_ARGS adds flags to llama-bench (e.g. "-fa on");
#                            DEPTH=4096 runs both at that depth of context (-d: "pp512 @ d4096").
#                            BATCHED=1 adds `llama-batched-bench -fa on -npp 128 -ntg 128
#                            -npl 1,4,8,16,32,64 -c 16384` beside `kiln bench --batch
#                            1,4,8,16,32,64 -p 128 -n 128` (S_PP and S_TG per batch size, with
#                            the ratio); NPL= changes the batch sizes.
#   scripts/bench/bench_vs_llamacpp.sh table DIR       reprints the tables from a run's logs.
#
# e.g. on the GPU machine:
#   scripts/bench/bench_vs_llamacpp.sh build-llamacpp &&
#   KILN_BENCH_ARGS="--backend cuda-q4_0" scripts/bench/bench_vs_llamacpp.sh run /tmp/m/llama3-8b.q4_0.gguf
set -euo pipefail
cd "$(dirname "$0")/../.."
LLAMA_CPP_PYTHON_VERSION=0.3.36
TARBALL=.llamacpp/llama.cpp.tar.xz
llamacpp_dir=${LLAMACPP_DIR:-/tmp/llamacpp}
bin_dir=$llamacpp_dir/build/bin

# Reads DIR/manifest.tsv (one line a model: index, GGUF path, llama-bench rc, kiln rc,
# batched rc or "-") and the raw outputs beside it; prints the tables, the comparison last.
# Exits 1 when a tool failed or its output could not be read.
print_tables() {
    python3 - "$1" <<'PY'
import json, os, sys

out = sys.argv[1]
failed = False

def tail(path, n=1):
    try:
        with open(path, errors="replace") as f:
            lines = [l.strip() for l in f if l.strip()]
        return " / ".join(lines[-n:]).replace("|", "\\|")[:160]
    except OSError:
        return ""

def fmt(mean, sd):
    return f"{mean:.2f} ± {sd:.2f}"

def llama_rows(path):
    """llama-bench -o json: an array of tests; name them as llama-bench's markdown does."""
    with open(path) as f:
        data = json.load(f)
    rows = {}
    for t in data:
        p, g, d = t.get("n_prompt", 0), t.get("n_gen", 0), t.get("n_depth", 0)
        name = f"pp{p}" if g == 0 else f"tg{g}" if p == 0 else f"pp{p}+tg{g}"
        if d:
            name += f" @ d{d}"
        rows[name] = (float(t["avg_ts"]), float(t.get("stddev_ts", 0.0)))
    return rows, data

def kiln_rows(path):
    """kiln bench --output json: one object (the last line that parses, to skip any log)."""
    obj = None
    with open(path) as f:
        for line in f:
            line = line.strip()
            if line.startswith("{"):
                try:
                    obj = json.loads(line)
                except ValueError:
                    pass
    if obj is None:
        raise ValueError("no JSON object in the output")
    rows = {r["test"]: (float(r["mean_tps"]), float(r["sd_tps"])) for r in obj["results"]}
    return rows, obj

table = ["| file | test | llama.cpp t/s | kiln t/s | kiln backend | ratio |",
         "| --- | --- | ---: | ---: | --- | ---: |"]
batched = []
notes = []
with open(os.path.join(out, "manifest.tsv")) as f:
    manifest = [l.rstrip("\n").split("\t") for l in f if l.strip()]
for idx, model, llama_rc, kiln_rc, batched_rc in manifest:
    name = os.path.basename(model)
    tag = os.path.join(out, f"{idx}-{name}")
    llama, kiln, backend = {}, {}, ""
    llama_err = kiln_err = None
    if llama_rc != "0":
        llama_err = f"FAILED (rc {llama_rc}: {tail(tag + '.llamacpp.err')})"
    else:
        try:
            llama, data = llama_rows(tag + ".llamacpp.json")
            if data:
                d = data[0]
                notes.append(f"{name}: llama.cpp {d.get('build_commit', '?')}, "
                             f"{d.get('backends', '?')} on {d.get('gpu_info') or d.get('cpu_info', '?')}, "
                             f"{d.get('model_type', '?')}, n_gpu_layers {d.get('n_gpu_layers', '?')}, "
                             f"flash_attn {d.get('flash_attn', '?')}")
            if not llama:
                llama_err = "FAILED (no tests in the output)"
        except (OSError, ValueError, KeyError, TypeError) as e:
            llama_err = f"FAILED (unreadable output: {e})"
    if kiln_rc != "0":
        kiln_err = f"FAILED (rc {kiln_rc}: {tail(tag + '.kiln.err')})"
    else:
        try:
            kiln, obj = kiln_rows(tag + ".kiln.json")
            backend = str(obj.get("backend", ""))
            roof = obj.get("memory_roofline_gbs")
            step = obj.get("bytes_per_decode_step")
            if step:
                notes.append(f"{name}: kiln reads {step / 1e6:.1f} MB a decode step"
                             + (f", measured roofline {roof:.0f} GB/s" if roof else ""))
            if not kiln:
                kiln_err = "FAILED (no tests in the output)"
        except (OSError, ValueError, KeyError, TypeError) as e:
            kiln_err = f"FAILED (unreadable output: {e})"
    failed |= llama_err is not None or kiln_err is not None
    tests = list(llama) + [t for t in kiln if t not in llama]
    if not tests:
        table.append(f"| {name} | - | {llama_err or '-'} | {kiln_err or '-'} | {backend} | - |")
    for t in tests:
        l = llama.get(t)
        k = kiln.get(t)
        lc = fmt(*l) if l else (llama_err or "-")
        kc = fmt(*k) if k else (kiln_err or "-")
        ratio = f"{k[0] / l[0]:.2f}x" if l and k and l[0] > 0 else "-"
        table.append(f"| {name} | {t} | {lc} | {kc} | {backend} | {ratio} |")
    if batched_rc != "-":
        rows = []
        # the rows go to stdout; stderr only as a fallback (a build that logs them there)
        for path in (tag + ".batched.jsonl", tag + ".batched.err"):
            if rows:
                break
            try:
                with open(path, errors="replace") as bf:
                    for line in bf:
                        line = line.strip()
                        if line.startswith('{"n_kv_max"'):
                            try:
                                rows.append(json.loads(line))
                            except ValueError:
                                pass
            except OSError:
                pass
        kb = {}
        try:
            kobj, _ = None, None
            with open(tag + ".kiln-batched.json", errors="replace") as kf:
                for line in kf:
                    line = line.strip()
                    if line.startswith("{"):
                        kobj = json.loads(line)
            for r in (kobj or {}).get("results", []):
                kb[int(r["b"])] = r
        except (OSError, ValueError, KeyError, TypeError):
            pass
        if not kb:
            batched.append(f"| {name} | - | - | - | - | - | - | kiln FAILED ({tail(tag + '.kiln-batched.err')}) |")
        if batched_rc != "0" or not rows:
            failed = True
            batched.append(f"| {name} | - | - | - | - | - | - | FAILED (rc {batched_rc}: {tail(tag + '.batched.err')}) |")
        for r in rows:
            k = kb.get(int(r["pl"]))
            ks = f"{k['s_pp']:.2f} | {k['s_tg']:.2f}" if k else "- | -"
            ratio = f"{k['s_tg'] / r['speed_tg']:.2f}x" if k and r["speed_tg"] > 0 else "-"
            batched.append(f"| {name} | {r['pl']} | {r['pp']} | {r['tg']} | {r['speed_pp']:.2f} | {r['speed_tg']:.2f} | {ks} | {ratio} |")

if notes:
    print("\n".join(notes))
    print()
if batched:
    print("llama-batched-bench beside kiln bench --batch (S_TG = B * TG / decode time):\n")
    print("| file | B | PP | TG | llama.cpp S_PP t/s | llama.cpp S_TG t/s | kiln S_PP t/s | kiln S_TG t/s | S_TG ratio |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    print("\n".join(batched))
    print()
print("\n".join(table))
sys.exit(1 if failed else 0)
PY
}

mode=${1:-}
case "$mode" in
prepare)
    tmp=$(mktemp -d)
    trap 'rm -rf "$tmp"' EXIT
    # --no-binary for this one package only: ":all:" would also build pip's build
    # dependencies (cmake, ninja) from source just to read the metadata.
    python3 -m pip download --no-deps --no-binary llama-cpp-python \
        "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION" -d "$tmp/dl"
    sdist=$tmp/dl/llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION.tar.gz
    top=llama_cpp_python-$LLAMA_CPP_PYTHON_VERSION
    tar -xzf "$sdist" -C "$tmp" "$top/vendor/llama.cpp" "$top/.git/modules/vendor/llama.cpp/HEAD"
    src=$tmp/$top/vendor/llama.cpp
    dst=$tmp/llama.cpp
    mkdir -p "$dst/ggml/src" "$dst/tools"
    # What the tools build from; everything else (docs, models, examples, tests, app,
    # the other tools, gguf-py, .github, media, the other ggml backends) stays behind.
    # The top-level CMake adds examples/, pocs/, tests/ and app/ only when their options are
    # on, and ggml adds a backend's directory only when GGML_<BACKEND> is on.
    cp -a "$src"/{CMakeLists.txt,LICENSE,cmake,include,src,common,vendor,licenses} "$dst/"
    cp -a "$src"/ggml/{CMakeLists.txt,cmake,include} "$dst/ggml/"
    find "$src/ggml/src" -maxdepth 1 -type f -exec cp -a {} "$dst/ggml/src/" \;
    cp -a "$src"/ggml/src/{ggml-cpu,ggml-cuda} "$dst/ggml/src/"
    cp -a "$src"/tools/{llama-bench,batched-bench,perplexity,quantize} "$dst/tools/"
    # llama-server: its sources (not its Python tests or benches), the multimodal library it
    # links (mtmd) and the UI target's CMake templates; the web UI itself stays behind
    # (built with LLAMA_USE_PREBUILT_UI=OFF the server embeds an empty asset table).
    mkdir -p "$dst/tools/server" "$dst/tools/ui" "$dst/scripts"
    find "$src/tools/server" -maxdepth 1 -type f -exec cp -a {} "$dst/tools/server/" \;
    cp -a "$src"/tools/mtmd "$dst/tools/" && rm -rf "$dst/tools/mtmd/tests"
    cp -a "$src"/tools/ui/{CMakeLists.txt,sources.cmake,ui.cpp.in,ui.h.in} "$dst/tools/ui/"
    cp -a "$src"/scripts/ui-assets.cmake "$dst/scripts/"
    # tools/CMakeLists.txt adds every tool unconditionally: keep its preamble, add only ours.
    sed -n '1,/^# tools$/p' "$src/tools/CMakeLists.txt" >"$dst/tools/CMakeLists.txt"
    printf '\nadd_subdirectory(batched-bench)\nadd_subdirectory(llama-bench)\nadd_subdirectory(perplexity)\nadd_subdirectory(quantize)\nadd_subdirectory(mtmd)\nadd_subdirectory(ui)\nadd_subdirectory(server)\n' >>"$dst/tools/CMakeLists.txt"
    grep -q 'llama_add_compile_flags' "$dst/tools/CMakeLists.txt" || {
        echo "tools/CMakeLists.txt changed shape; check the preamble" >&2
        exit 1
    }
    commit=$(cat "$tmp/$top/.git/modules/vendor/llama.cpp/HEAD")
    {
        echo "llama.cpp $commit, vendored by llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (sdist sha256 $(sha256sum "$sdist" | cut -d' ' -f1))."
        echo "Stripped by kiln's scripts/bench/bench_vs_llamacpp.sh to build llama-bench, llama-batched-bench, llama-perplexity, llama-quantize and"
        echo "llama-server (ggml CPU and CUDA backends only; tools/CMakeLists.txt rewritten to add just those"
        echo "tools and the libraries they link; no web UI assets)."
    } >"$dst/KILN_PROVENANCE.txt"
    echo "$commit" >"$dst/LLAMACPP_COMMIT"
    mkdir -p .llamacpp
    XZ_OPT=-9e tar -C "$tmp" --sort=name --owner=0 --group=0 --numeric-owner \
        --mtime='2000-01-01 00:00:00 UTC' -cJf "$TARBALL" llama.cpp
    exclude=$(git rev-parse --git-path info/exclude)
    mkdir -p "$(dirname "$exclude")"
    grep -qxF '/.llamacpp/' "$exclude" 2>/dev/null || echo '/.llamacpp/' >>"$exclude"
    echo "llama.cpp $commit: $(du -sh "$dst" | cut -f1) unpacked"
    ls -la "$TARBALL"
    ;;
build-llamacpp)
    start=$SECONDS
    # TARGETS="llama-bench" builds only what a CPU comparison runs (minutes on two cores).
    read -r -a targets <<< "${TARGETS:-llama-bench llama-batched-bench llama-server}"
    built=1
    for t in "${targets[@]}"; do [ -x "$bin_dir/$t" ] || built=0; done
    if [ "$built" = 1 ]; then
        echo "${targets[*]} already built in $bin_dir"
        exit 0
    fi
    if [ ! -f "$llamacpp_dir/llama.cpp/CMakeLists.txt" ]; then
        [ -f "$TARBALL" ] || { echo "$TARBALL missing: run '$0 prepare' on a machine with network" >&2; exit 1; }
        mkdir -p "$llamacpp_dir"
        tar -xJf "$TARBALL" -C "$llamacpp_dir"
    fi
    cuda=${GGML_CUDA:-ON}
    opts=(-DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DGGML_CUDA="$cuda"
        -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TESTS=OFF
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF
        -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF
        -DLLAMA_BUILD_COMMIT="$(head -c 7 "$llamacpp_dir/llama.cpp/LLAMACPP_COMMIT")")
    if [ "$cuda" = ON ]; then
        opts+=(-DCMAKE_CUDA_ARCHITECTURES="${CUDA_ARCH:-90}" -DGGML_CUDA_NCCL=OFF)
    else
        # The CPU build kiln's CPU backend is compared with: AVX2 + FMA + F16C, not tuned
        # to the build machine; GGML_CPU_NATIVE=1 builds for this machine's own
        # instruction set instead (AVX-512 where it has it, as kiln picks at run time).
        if [ "${GGML_CPU_NATIVE:-0}" = 1 ]; then
            opts+=(-DGGML_NATIVE=ON)
        else
            opts+=(-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON)
        fi
    fi
    if command -v ninja >/dev/null; then opts+=(-G Ninja); fi
    if [ ! -f "$llamacpp_dir/build/CMakeCache.txt" ]; then
        cmake -S "$llamacpp_dir/llama.cpp" -B "$llamacpp_dir/build" "${opts[@]}"
    fi
    cmake --build "$llamacpp_dir/build" -j "${JOBS:-$(nproc)}" --target "${targets[@]}"
    for t in "${targets[@]}"; do ls -la "$bin_dir/$t"; done
    echo "built llama.cpp in $((SECONDS - start)) s"
    ;;
run)
    shift
    [ $# -gt 0 ] || { echo "usage: $0 run MODEL.gguf..." >&2; exit 2; }
    out=${OUT:-bench-logs}
    mkdir -p "$out"
    kiln=${KILN:-.gpu/kiln}
    llama_bench=${LLAMA_BENCH:-$bin_dir/llama-bench}
    batched_bench=${LLAMA_BATCHED_BENCH:-$bin_dir/llama-batched-bench}
    pp=${PP:-512} tg=${TG:-128} reps=${REPS:-5} ngl=${NGL:-99} depth=${DEPTH:-0}
    read -r -a kiln_args <<<"${KILN_BENCH_ARGS:-}"
    read -r -a llama_args <<<"${LLAMA_BENCH_ARGS:-}"
    nvidia-smi --query-gpu=name,driver_version,clocks.max.sm,clocks.max.mem --format=csv >"$out/nvidia-smi.txt" 2>&1 || true
    : >"$out/manifest.tsv"
    i=0
    for m in "$@"; do
        i=$((i + 1))
        tag=$out/$i-$(basename "$m")
        echo "== $m" >&2
        llama_rc=0
        "$llama_bench" -m "$m" -p "$pp" -n "$tg" -d "$depth" -r "$reps" -ngl "$ngl" -o json ${llama_args[@]+"${llama_args[@]}"} \
            >"$tag.llamacpp.json" 2>"$tag.llamacpp.err" || llama_rc=$?
        kiln_rc=0
        "$kiln" bench -m "$m" -p "$pp" -n "$tg" -d "$depth" -r "$reps" --output json ${kiln_args[@]+"${kiln_args[@]}"} \
            >"$tag.kiln.json" 2>"$tag.kiln.err" || kiln_rc=$?
        batched_rc=-
        if [ "${BATCHED:-0}" = 1 ]; then
            batched_rc=0
            "$batched_bench" -m "$m" -ngl "$ngl" -fa on -npp 128 -ntg 128 -npl "${NPL:-1,4,8,16,32,64}" -c 16384 \
                --output-format jsonl >"$tag.batched.jsonl" 2>"$tag.batched.err" || batched_rc=$?
            "$kiln" bench -m "$m" --batch "${NPL:-1,4,8,16,32,64}" -p 128 -n 128 -c 1024 --output json \
                ${kiln_args[@]+"${kiln_args[@]}"} >"$tag.kiln-batched.json" 2>"$tag.kiln-batched.err" || true
        fi
        echo "llama-bench rc $llama_rc, kiln rc $kiln_rc, batched rc $batched_rc" >&2
        printf '%s\t%s\t%s\t%s\t%s\n' "$i" "$m" "$llama_rc" "$kiln_rc" "$batched_rc" >>"$out/manifest.tsv"
    done
    status=0
    print_tables "$out" >"$out/table.md" || status=1
    cat "$out/table.md"
    exit $status
    ;;
table)
    print_tables "${2:?usage: $0 table DIR}"
    ;;
*)
    echo "usage: $0 prepare|build-llamacpp|run MODEL...|table DIR" >&2
    exit 2
    ;;
esac
