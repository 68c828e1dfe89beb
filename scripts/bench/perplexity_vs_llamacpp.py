#!/usr/bin/env python3
"""`kiln perplexity` beside llama.cpp's `llama-perplexity` on the CPU: perplexity, the tokens
both scored, and KL-divergence of quantised files, with markdown tables of the results.

    python3 scripts/bench/perplexity_vs_llamacpp.py ppl --kiln K --llamacpp DIR \\
        -m MODEL -f TEXT -c CTX [--threads 2] [--llamacpp-f32] [--cross-kld] [--cross-kld-stride N]
    python3 scripts/bench/perplexity_vs_llamacpp.py kld --kiln K --llamacpp DIR \\
        --source MODEL -f TEXT -c CTX --types q4_0,q4_k_m,... \\
        [--llamacpp-pairs q4_0,q4_k_m] [--kiln-mode llamacpp|f32] [--threads 2] [--reuse]

    both also take [--work /tmp/ppl-work] [--timeout 3600] [--llamacpp-extra '-fa off']

Standard library only. K is a `kiln` binary; DIR is llama.cpp's CPU build (the folder that
holds `llama-perplexity` and `llama-quantize`, or a checkout with them under build/bin; its
own folder goes on LD_LIBRARY_PATH). Every run goes one at a time, on `--threads` threads,
with kiln on `--backend cpu`; each tool's full output is kept in `--work DIR`
(default /tmp/ppl-work) beside the files made there. llama-perplexity runs with its defaults
(on the CPU: flash attention on, an f16 KV cache) plus `--llamacpp-extra ARGS`, e.g.
`--llamacpp-extra '-fa off'`.

Reading the numbers: with 8-bit activations the result is sensitive to any rounding
difference (each one moves later activations across 8-bit rounding boundaries), so two
implementations that are not bit-identical, or llama.cpp with flash attention on and off,
differ by about as much as either differs from f32; on a short text compare the f32 runs
(which should agree to a KLD of order 1e-6) and KLDs of quantised files, not third-decimal
perplexities of the 8-bit modes.

`ppl` runs llama-perplexity (saving its distributions with `--kl-divergence-base`), kiln's
f32 reference and kiln with `--quantized-activations --kv-type f16` (llama.cpp's CPU
arithmetic: 8-bit activations, an f16 KV cache), both with `--save-logits`. It prints one
table row per run: PPL ± error and the relative difference to llama.cpp. It reads the
tokens out of every saved-logits file and exits 1 unless they hold the same context, chunk
count and tokens. `--llamacpp-f32` adds llama.cpp without 8-bit activations: an f32 copy of
the model (`llama-quantize --allow-requantize MODEL OUT F32`, exact for the quantised types),
scored with `-ctk f32 -ctv f32 -fa off` — kiln's f32 reference's arithmetic. `--cross-kld`
reads the saved distributions back and prints the mean KL-divergence and top-token agreement
between pairs of runs: each kiln run from llama.cpp's rows, kiln f32 from llama.cpp f32 (with
`--llamacpp-f32`), and each tool's own drift from f32 to 8-bit activations — pure Python,
about 30 s a pair for a 50k-token vocabulary and 1,600 rows; `--cross-kld-stride N` scores
every Nth row for large vocabularies.

`kld` makes a q8_0 base from `--source` with `kiln quantize`; for each of `--types` both
`kiln quantize` and `llama-quantize --allow-requantize` of the same source; saves the base's
distributions once with kiln and once with llama.cpp; then scores every quantised file with
kiln against kiln's base, and the `--llamacpp-pairs` files (`TYPE` or `kiln:TYPE` for kiln's
file, `llamacpp:TYPE` for llama-quantize's) with llama.cpp against llama.cpp's base too.
Prints (i) for the same pair of files, mean KLD by kiln and by llama.cpp, and (ii) per
recipe, kiln's file and llama-quantize's, both scored by kiln (mean KLD ± error, same top,
PPL), whether kiln's is no worse, and the tensors whose types differ between the two files.
`--kiln-mode llamacpp` (the default) runs kiln with llama.cpp's arithmetic, so table (i)
compares like with like; `f32` uses kiln's f32 reference instead. `--reuse` keeps files a
previous run left in the work folder instead of making them again.

Exit status: 0, 1 when the tools scored different tokens, 2 for a usage problem or a failed
run (its output's tail is printed).
"""

import argparse
import math
import os
import re
import shlex
import struct
import subprocess
import sys
import time
from array import array

TIMEOUT_S = 3600

# ---------------------------------------------------------------------------------------------
# running the tools


class Tools:
    def __init__(self, args):
        self.kiln = os.path.abspath(args.kiln)
        if not os.access(self.kiln, os.X_OK):
            die(f"--kiln {args.kiln}: not an executable file")
        d = os.path.abspath(args.llamacpp)
        for cand in (d, os.path.join(d, "build", "bin")):
            if os.access(os.path.join(cand, "llama-perplexity"), os.X_OK):
                self.llama_bin = cand
                break
        else:
            die(f"--llamacpp {args.llamacpp}: no llama-perplexity there or under build/bin")
        self.threads = str(args.threads)
        self.work = os.path.abspath(args.work)
        self.timeout = args.timeout
        self.llama_extra = shlex.split(args.llamacpp_extra)
        os.makedirs(self.work, exist_ok=True)
        self.env = dict(os.environ)
        self.env["LD_LIBRARY_PATH"] = self.llama_bin + (
            ":" + os.environ["LD_LIBRARY_PATH"] if os.environ.get("LD_LIBRARY_PATH") else "")
        self.step = 0

    def llama(self, name):
        path = os.path.join(self.llama_bin, name)
        if not os.access(path, os.X_OK):
            die(f"{path}: missing (build llama.cpp's {name} target)")
        return path

    def run(self, label, cmd):
        """Runs cmd, its stdout and stderr into work/LABEL.log; returns (output, seconds)."""
        self.step += 1
        log = os.path.join(self.work, re.sub(r"[^A-Za-z0-9_.-]+", "_", label) + ".log")
        line = " ".join(shlex.quote(c) for c in cmd)
        print(f"[{self.step}] {label}: {line}", file=sys.stderr, flush=True)
        start = time.monotonic()
        try:
            p = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                               env=self.env, timeout=self.timeout, stdin=subprocess.DEVNULL)
            out = p.stdout.decode("utf-8", "replace")
            rc = p.returncode
        except subprocess.TimeoutExpired as e:
            out = (e.output or b"").decode("utf-8", "replace")
            rc = f"timeout after {self.timeout} s"
        except OSError as e:
            die(f"{label}: cannot run {cmd[0]}: {e}")
        seconds = time.monotonic() - start
        with open(log, "w") as f:
            f.write(f"$ {line}\n# exit {rc}, {seconds:.1f} s\n{out}")
        if rc != 0:
            tail = "\n".join(out.strip().splitlines()[-25:])
            die(f"{label} failed ({'exit ' + str(rc) if isinstance(rc, int) else rc}); "
                f"full output in {log}\n$ {line}\n{tail}")
        print(f"    done in {seconds:.1f} s", file=sys.stderr, flush=True)
        return out, seconds

    def kiln_ppl(self, label, model, ctx, mode, text=None, save=None, base=None):
        cmd = [self.kiln, "perplexity", "--backend", "cpu", "-m", model, "-c", str(ctx),
               "-t", self.threads]
        if text:
            cmd += ["-f", text]
        cmd += kiln_mode_flags(mode)
        if save:
            cmd += ["--save-logits", save]
        if base:
            cmd += ["--kl-divergence-base", base]
        return self.run(label, cmd)

    def llama_ppl(self, label, model, ctx, text=None, save=None, base=None, extra=()):
        cmd = [self.llama("llama-perplexity"), "-m", model, "-c", str(ctx), "-t", self.threads]
        cmd += self.llama_extra + list(extra)
        if save:
            cmd += ["-f", text, "--kl-divergence-base", save]
        elif base:
            cmd += ["--kl-divergence", "--kl-divergence-base", base]
        else:
            cmd += ["-f", text]
        return self.run(label, cmd)

    def kiln_quantize(self, src, dst, recipe):
        return self.run(f"kiln-quantize-{recipe}",
                        [self.kiln, "quantize", "--type", recipe, "--threads", self.threads,
                         src, dst])

    def llama_quantize(self, src, dst, recipe):
        return self.run(f"llama-quantize-{recipe}",
                        [self.llama("llama-quantize"), "--allow-requantize", src, dst,
                         recipe.upper(), self.threads])


def kiln_mode_flags(mode):
    return {"f32": [], "llamacpp": ["--quantized-activations", "--kv-type", "f16"]}[mode]


KILN_MODE_NAME = {"f32": "kiln f32", "llamacpp": "kiln --quantized-activations --kv-type f16"}


def die(msg, code=2):
    print(f"perplexity_vs_llamacpp: {msg}", file=sys.stderr)
    sys.exit(code)


# ---------------------------------------------------------------------------------------------
# parsing the tools' output (kiln prints llama-perplexity's lines)

PM = r"([-+0-9.eE]+|nan|inf)\s*(?:±|\+/-)\s*([-+0-9.eE]+|nan|inf)"


def parse_final(out, label):
    m = re.findall(r"Final estimate: PPL = " + PM, out)
    if not m:
        die(f"{label}: no 'Final estimate: PPL = x +/- y' line in its output")
    return float(m[-1][0]), float(m[-1][1])


def parse_kld(out, label):
    fields = {
        "ppl": r"Mean PPL\(Q\)\s*:\s*" + PM,
        "ppl_base": r"Mean PPL\(base\)\s*:\s*" + PM,
        "kld": r"Mean\s+KLD:\s*" + PM,
        "same_top": r"Same top p:\s*" + PM + r"\s*%",
        "rms_dp": r"RMS Δp\s*:\s*" + PM + r"\s*%",
    }
    r = {}
    for key, pat in fields.items():
        m = re.findall(pat, out)
        if not m:
            die(f"{label}: no '{pat}' line in its output")
        r[key] = (float(m[-1][0]), float(m[-1][1]))
    for key, pat in (("kld_max", r"Maximum KLD:\s*([-+0-9.eE]+)"),
                     ("kld_p99", r"99\.0%\s+KLD:\s*([-+0-9.eE]+)")):
        m = re.findall(pat, out)
        r[key] = float(m[-1]) if m else float("nan")
    return r


# ---------------------------------------------------------------------------------------------
# the saved-logits files


class LogitsFile:
    """Either tool's saved distributions: ctx, vocab, chunks, tokens, and rows read back as
    (scale, min_log_prob, u16 values) with log p = scale·q + min_log_prob in both formats."""

    def __init__(self, path):
        self.path = path
        self.size = os.path.getsize(path)
        with open(path, "rb") as f:
            magic = f.read(8)
            if magic == b"_logits_":
                self.kind = "llama.cpp"
                self.ctx, self.vocab, self.chunks = struct.unpack("<iii", f.read(12))
                self.first = self.ctx // 2
                n = self.chunks * self.ctx
                self.tokens = array("i")
                self.tokens.frombytes(f.read(4 * n))
                self.data = 20 + 4 * n
                self.row_bytes = 2 * (2 * ((self.vocab + 1) // 2) + 4)
                self.chunk_tail = 0
            elif magic == b"KILNLOGP":
                self.kind = "kiln"
                version, self.vocab, self.ctx, self.first, self.chunks = struct.unpack(
                    "<5I", f.read(20))
                if version != 1:
                    die(f"{path}: kiln logits version {version}, this script reads 1")
                f.read(16)
                n = self.chunks * self.ctx
                self.tokens = array("I")
                self.tokens.frombytes(f.read(4 * n))
                self.data = 44 + 4 * n + 4
                self.row_bytes = 8 + 2 * self.vocab
                self.chunk_tail = 4
            else:
                die(f"{path}: neither a llama.cpp nor a kiln saved-logits file")
        if len(self.tokens) != self.chunks * self.ctx:
            die(f"{path}: truncated token array")
        if sys.byteorder != "little":
            self.tokens.byteswap()
        self.rows_per_chunk = self.ctx - 1 - self.first
        want = self.data + self.chunks * (self.rows_per_chunk * self.row_bytes + self.chunk_tail)
        if self.size < want:
            die(f"{path}: {self.size} bytes, its header promises {want}")

    def rows(self, stride=1):
        """Yields (index, scale, min_log_prob, values) for every stride-th row."""
        with open(self.path, "rb") as f:
            i = 0
            for c in range(self.chunks):
                base = self.data + c * (self.rows_per_chunk * self.row_bytes + self.chunk_tail)
                for r in range(self.rows_per_chunk):
                    if i % stride == 0:
                        f.seek(base + r * self.row_bytes)
                        raw = f.read(self.row_bytes)
                        scale, mn = struct.unpack_from("<ff", raw, 0)
                        q = array("H")
                        q.frombytes(raw[8:8 + 2 * self.vocab])
                        if sys.byteorder != "little":
                            q.byteswap()
                        yield i, scale, mn, q
                    i += 1


def compare_tokens(a, b):
    """None when both files scored the same tokens, else what differs."""
    if (a.ctx, a.chunks) != (b.ctx, b.chunks):
        return (f"{a.kind}: ctx {a.ctx}, {a.chunks} chunks; "
                f"{b.kind}: ctx {b.ctx}, {b.chunks} chunks")
    if a.vocab != b.vocab:
        return f"{a.kind}: vocabulary {a.vocab}; {b.kind}: {b.vocab}"
    for i, (x, y) in enumerate(zip(a.tokens, b.tokens)):
        if x != y:
            diffs = sum(1 for p, q in zip(a.tokens, b.tokens) if p != q)
            return (f"token {i} (chunk {i // a.ctx}, position {i % a.ctx}): {a.kind} {x}, "
                    f"{b.kind} {y}; {diffs} of {len(a.tokens)} tokens differ")
    return None


def cross_kld(ref, other, stride):
    """Mean KL(ref || other) over the rows, its standard error, the top-token agreement."""
    exp = math.exp
    n = s = s2 = same = 0
    for (_, sa, ma, qa), (_, sb, mb, qb) in zip(ref.rows(stride), other.rows(stride)):
        k = 0.0
        for x, y in zip(qa, qb):
            la = sa * x + ma
            k += exp(la) * (la - sb * y - mb)
        n += 1
        s += k
        s2 += k * k
        # Both rows are quantised from the best logit (q = 65535 at the top).
        same += qa.index(max(qa)) == qb.index(max(qb))
    mean = s / n
    err = math.sqrt(max(s2 / n - mean * mean, 0.0) / (n - 1)) if n > 1 else 0.0
    return mean, err, same / n, n


# ---------------------------------------------------------------------------------------------
# GGUF tensor types, to name what two recipes did differently

GGML_TYPES = {0: "f32", 1: "f16", 2: "q4_0", 3: "q4_1", 6: "q5_0", 7: "q5_1", 8: "q8_0",
              9: "q8_1", 10: "q2_k", 11: "q3_k", 12: "q4_k", 13: "q5_k", 14: "q6_k",
              15: "q8_k", 16: "iq2_xxs", 17: "iq2_xs", 18: "iq3_xxs", 19: "iq1_s",
              20: "iq4_nl", 21: "iq3_s", 22: "iq2_s", 23: "iq4_xs", 24: "i8", 25: "i16",
              26: "i32", 27: "i64", 28: "f64", 29: "iq1_m", 30: "bf16"}
SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<B", 10: "<Q",
          11: "<q", 12: "<d"}


def gguf_tensors(path):
    """({tensor name: (type name, offset)}, start of the tensor data) from a GGUF header."""
    with open(path, "rb") as f:
        def rd(fmt):
            return struct.unpack(fmt, f.read(struct.calcsize(fmt)))[0]

        def rd_str():
            return f.read(rd("<Q")).decode("utf-8", "replace")

        def skip(t):
            if t in SCALAR:
                f.seek(struct.calcsize(SCALAR[t]), 1)
            elif t == 8:
                f.seek(rd("<Q"), 1)
            elif t == 9:
                et, n = rd("<I"), rd("<Q")
                if et in SCALAR:
                    f.seek(n * struct.calcsize(SCALAR[et]), 1)
                else:
                    for _ in range(n):
                        skip(et)
            else:
                raise ValueError(f"metadata type {t}")

        if f.read(4) != b"GGUF":
            raise ValueError("not a GGUF file")
        rd("<I")
        n_tensors, n_kv = rd("<Q"), rd("<Q")
        align = 32
        for _ in range(n_kv):
            key = rd_str()
            t = rd("<I")
            if key == "general.alignment" and t == 4:
                align = rd("<I")
            else:
                skip(t)
        tensors = {}
        for _ in range(n_tensors):
            name = rd_str()
            f.seek(8 * rd("<I"), 1)
            t = rd("<I")
            tensors[name] = (GGML_TYPES.get(t, f"type{t}"), rd("<Q"))
        return tensors, (f.tell() + align - 1) // align * align


def gguf_tensor_types(path):
    """{tensor name: type name} from a GGUF file's header."""
    return {name: t for name, (t, _) in gguf_tensors(path)[0].items()}


def tensor_bytes_differ(a_path, b_path):
    """Names of the tensors whose stored bytes differ between two GGUF files (the metadata,
    its order included, is not compared)."""
    def spans(path):
        tensors, start = gguf_tensors(path)
        order = sorted(tensors.items(), key=lambda kv: kv[1][1])
        end = os.path.getsize(path) - start
        ends = [o for _, (_, o) in order[1:]] + [end]
        return {n: (start + o, e - o) for (n, (_, o)), e in zip(order, ends)}

    sa, sb = spans(a_path), spans(b_path)
    differ = []
    with open(a_path, "rb") as fa, open(b_path, "rb") as fb:
        for name in sorted(set(sa) & set(sb)):
            (oa, na), (ob, nb) = sa[name], sb[name]
            fa.seek(oa)
            fb.seek(ob)
            n = min(na, nb)  # spans end at the next tensor, padding included
            if fa.read(n) != fb.read(n):
                differ.append(name)
    return differ


def type_differences(a_path, b_path):
    """'tensor pattern: kiln type → llama.cpp type (count)' lines, tensors grouped by name
    with the layer number taken out."""
    try:
        a, b = gguf_tensor_types(a_path), gguf_tensor_types(b_path)
    except (OSError, ValueError, struct.error) as e:
        return [f"(cannot read the tensor types: {e})"]
    groups = {}
    for name in sorted(set(a) | set(b)):
        ta, tb = a.get(name, "absent"), b.get(name, "absent")
        if ta != tb:
            key = (re.sub(r"^blk\.\d+\.", "blk.N.", name), ta, tb)
            groups[key] = groups.get(key, 0) + 1
    return [f"{k[0]}: {k[1]} vs {k[2]} ({n}×)" for k, n in sorted(groups.items())]


def type_histogram(path):
    try:
        types = gguf_tensor_types(path)
    except (OSError, ValueError, struct.error) as e:
        return f"(unreadable: {e})"
    h = {}
    for t in types.values():
        h[t] = h.get(t, 0) + 1
    return ", ".join(f"{t} {n}" for t, n in sorted(h.items(), key=lambda kv: -kv[1]))


# ---------------------------------------------------------------------------------------------
# formatting


def rel(a, b):
    return (a - b) / b if b else float("nan")


def pct(x, digits=3):
    return "—" if x is None or math.isnan(x) else f"{100 * x:+.{digits}f}%"


def small(x):
    """Six decimals, or three significant digits below 1e-4 (a near-zero KLD)."""
    return f"{x:.2e}" if 0 < abs(x) < 1e-4 else f"{x:.6f}"


def stem(path):
    s = os.path.basename(path)
    return s[:-5] if s.endswith(".gguf") else s


# ---------------------------------------------------------------------------------------------
# ppl


def cmd_ppl(args):
    t = Tools(args)
    model, text = os.path.abspath(args.model), os.path.abspath(args.file)
    for p in (model, text):
        if not os.path.isfile(p):
            die(f"{p}: no such file")
    name = stem(model)
    logits = {}  # run label → saved-logits path
    runs = []  # (label, (ppl, err), seconds)

    def add(label, out, secs, path, parse_label):
        runs.append((label, parse_final(out, parse_label), secs))
        logits[label] = path

    LLAMA, LLAMA_F32 = "llama.cpp", "llama.cpp f32 (f32 copy, `-ctk f32 -ctv f32 -fa off`)"
    path = os.path.join(t.work, f"{name}.c{args.ctx}.llamacpp.logits")
    out, secs = t.llama_ppl("llama-perplexity", model, args.ctx, text=text, save=path)
    add(LLAMA, out, secs, path, "llama-perplexity")
    if args.llamacpp_f32:
        f32_model = os.path.join(t.work, f"{name}.f32.gguf")
        t.llama_quantize(model, f32_model, "f32")
        path = os.path.join(t.work, f"{name}.c{args.ctx}.llamacpp-f32.logits")
        out, secs = t.llama_ppl("llama-perplexity-f32", f32_model, args.ctx, text=text, save=path,
                                extra=["-ctk", "f32", "-ctv", "f32", "-fa", "off"])
        add(LLAMA_F32, out, secs, path, "llama-perplexity (f32)")
        os.remove(f32_model)
    for mode in ("f32", "llamacpp"):
        path = os.path.join(t.work, f"{name}.c{args.ctx}.kiln-{mode}.logits")
        out, secs = t.kiln_ppl(f"kiln-perplexity-{mode}", model, args.ctx, mode, text=text,
                               save=path)
        add(KILN_MODE_NAME[mode], out, secs, path, KILN_MODE_NAME[mode])

    files = {label: LogitsFile(path) for label, path in logits.items()}
    ref = files[LLAMA]
    mismatch = []
    for label, f in files.items():
        why = compare_tokens(ref, f) if label != LLAMA else None
        if why:
            mismatch.append(f"{label}: {why}")

    base_ppl = runs[0][1][0]
    f32_ppl = next((r[1][0] for r in runs if r[0] == LLAMA_F32), None)
    print(f"\n**{os.path.basename(model)}**, `-c {args.ctx}`, {ref.chunks} chunks "
          f"({ref.chunks * ref.rows_per_chunk} scored tokens), {args.threads} threads, "
          f"{os.path.basename(text)}\n")
    print("| run | PPL | ± | vs llama.cpp |" + (" vs llama.cpp f32 |" if f32_ppl else "")
          + " time (s) |")
    print("|---|---:|---:|---:|" + ("---:|" if f32_ppl else "") + "---:|")
    for label, (ppl, err), secs in runs:
        row = f"| {label} | {ppl:.4f} | {err:.5f} | "
        row += "— |" if label == LLAMA else f"{pct(rel(ppl, base_ppl))} |"
        if f32_ppl:
            row += " — |" if label == LLAMA_F32 else f" {pct(rel(ppl, f32_ppl))} |"
        print(row + f" {secs:.1f} |")
    print()
    if mismatch:
        print("**Tokens differ** between the saved-logits files:")
        for m in mismatch:
            print(f"- {m}")
        return 1
    print(f"Tokens: identical in all {len(files)} saved-logits files (ctx {ref.ctx}, "
          f"{ref.chunks} chunks, {len(ref.tokens)} tokens, vocabulary {ref.vocab}).")

    if args.cross_kld:
        KF, KQ = KILN_MODE_NAME["f32"], KILN_MODE_NAME["llamacpp"]
        pairs = [(LLAMA, KQ, "same arithmetic (8-bit activations, f16 KV)"),
                 (LLAMA, KF, "")]
        if f32_ppl:
            pairs += [(LLAMA_F32, KF, "same arithmetic (f32)"),
                      (LLAMA_F32, LLAMA, "llama.cpp's own 8-bit/f16 drift")]
        pairs += [(KF, KQ, "kiln's own 8-bit/f16 drift")]
        results = []
        for a, b, note in pairs:
            print(f"    cross-KLD: {a} → {b} (every {args.cross_kld_stride}. row)",
                  file=sys.stderr, flush=True)
            results.append((a, b, note, cross_kld(files[a], files[b], args.cross_kld_stride)))
        print(f"\nKL-divergence between the saved rows (reference → compared; "
              f"{results[0][3][3]} rows{'' if args.cross_kld_stride == 1 else ', every %d. row' % args.cross_kld_stride}):\n")
        print("| reference | compared | mean KLD | same top | note |")
        print("|---|---|---:|---:|---|")
        for a, b, note, (m, e, same, n) in results:
            print(f"| {a} | {b} | {small(m)} ± {small(e)} | {100 * same:.2f}% | {note} |")
    print()
    return 0


# ---------------------------------------------------------------------------------------------
# kld


def parse_pairs(spec, types):
    pairs = []
    for item in filter(None, (s.strip() for s in spec.split(","))):
        maker, _, typ = item.rpartition(":")
        maker = maker or "kiln"
        if maker not in ("kiln", "llamacpp"):
            die(f"--llamacpp-pairs {item}: the maker is kiln or llamacpp")
        if typ not in types:
            die(f"--llamacpp-pairs {item}: {typ} is not among --types")
        pairs.append((maker, typ))
    return pairs


def cmd_kld(args):
    t = Tools(args)
    source, text = os.path.abspath(args.source), os.path.abspath(args.file)
    for p in (source, text):
        if not os.path.isfile(p):
            die(f"{p}: no such file")
    types = [s.strip().lower() for s in args.types.split(",") if s.strip()]
    if not types:
        die("--types names no recipe")
    pairs = parse_pairs(args.llamacpp_pairs, types)
    name = stem(source)

    def made(path):
        return args.reuse and os.path.isfile(path) and os.path.getsize(path) > 0

    base = os.path.join(t.work, f"{name}.kiln.q8_0.gguf")
    if not made(base):
        t.kiln_quantize(source, base, "q8_0")
    files = {}
    for typ in types:
        k = os.path.join(t.work, f"{name}.kiln.{typ}.gguf")
        l = os.path.join(t.work, f"{name}.llamacpp.{typ}.gguf")
        if not made(k):
            t.kiln_quantize(source, k, typ)
        if not made(l):
            t.llama_quantize(source, l, typ)
        files[("kiln", typ)] = k
        files[("llamacpp", typ)] = l

    mode = args.kiln_mode
    kiln_base = os.path.join(t.work, f"{name}.q8_0.c{args.ctx}.kiln-{mode}.logits")
    llama_base = os.path.join(t.work, f"{name}.q8_0.c{args.ctx}.llamacpp.logits")
    base_ppl = {}
    if not made(kiln_base):
        out, _ = t.kiln_ppl(f"kiln-base-{mode}", base, args.ctx, mode, text=text, save=kiln_base)
        base_ppl["kiln"] = parse_final(out, "kiln base")
    if pairs and not made(llama_base):
        out, _ = t.llama_ppl("llamacpp-base", base, args.ctx, text=text, save=llama_base)
        base_ppl["llamacpp"] = parse_final(out, "llama.cpp base")
    mismatch = None
    if pairs:
        mismatch = compare_tokens(LogitsFile(llama_base), LogitsFile(kiln_base))

    by_kiln = {}
    for typ in types:
        for maker in ("kiln", "llamacpp"):
            out, secs = t.kiln_ppl(f"kiln-kld-{maker}-{typ}", files[(maker, typ)], args.ctx,
                                   mode, base=kiln_base)
            by_kiln[(maker, typ)] = parse_kld(out, f"kiln KLD of {maker} {typ}")
    by_llama = {}
    if not mismatch:
        for maker, typ in pairs:
            out, _ = t.llama_ppl(f"llamacpp-kld-{maker}-{typ}", files[(maker, typ)], args.ctx,
                                 base=llama_base)
            by_llama[(maker, typ)] = parse_kld(out, f"llama.cpp KLD of {maker} {typ}")

    lf = LogitsFile(kiln_base)
    print(f"\n**KL-divergence from a q8_0 base**: source {os.path.basename(source)}, base "
          f"`kiln quantize --type q8_0` of it; `-c {args.ctx}`, {lf.chunks} chunks "
          f"({lf.chunks * lf.rows_per_chunk} scored tokens), {args.threads} threads, "
          f"{os.path.basename(text)}; kiln runs as {KILN_MODE_NAME[mode]}.\n")
    for tool, (p, e) in sorted(base_ppl.items()):
        print(f"- base PPL by {tool}: {p:.4f} ± {e:.5f}")
    if base_ppl:
        print()

    print("(i) The same pair of files, mean KLD by kiln (against kiln's base logits) and by "
          "llama.cpp (against llama.cpp's):\n")
    if mode == "f32" and pairs:
        print("(Not like for like: kiln runs in f32 here, llama.cpp with its 8-bit activations; "
              "use the default --kiln-mode llamacpp to compare the two tools' KLD.)\n")
    if mismatch:
        print(f"**Not compared: the base logits files hold different tokens** — {mismatch}\n")
    else:
        print("| file | kiln mean KLD | llama.cpp mean KLD | KLD diff | kiln same top | "
              "llama.cpp same top | kiln PPL(Q) | llama.cpp PPL(Q) | PPL diff |")
        print("|---|---:|---:|---:|---:|---:|---:|---:|---:|")
        for key in pairs:
            k, l = by_kiln[key], by_llama[key]
            print(f"| {key[1]} ({'kiln quantize' if key[0] == 'kiln' else 'llama-quantize'}) "
                  f"| {k['kld'][0]:.6f} ± {k['kld'][1]:.6f} | {l['kld'][0]:.6f} ± {l['kld'][1]:.6f} "
                  f"| {pct(rel(k['kld'][0], l['kld'][0]), 1)} "
                  f"| {k['same_top'][0]:.3f}% | {l['same_top'][0]:.3f}% "
                  f"| {k['ppl'][0]:.4f} | {l['ppl'][0]:.4f} | {pct(rel(k['ppl'][0], l['ppl'][0]))} |")
        if pairs:
            print(f"\nTokens: identical in both base logits files ({lf.chunks} chunks of {lf.ctx}).")
    print()

    print("(ii) Recipes: kiln's quantizer and llama-quantize on the same source, both scored "
          "by kiln:\n")
    print("| type | kiln quantize: mean KLD | same top | PPL | size (MB) | llama-quantize: "
          "mean KLD | same top | PPL | size (MB) | KLD diff | kiln's no worse? |")
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    notes = []
    for typ in types:
        k, l = by_kiln[("kiln", typ)], by_kiln[("llamacpp", typ)]
        (km, ke), (lm, le) = k["kld"], l["kld"]
        if km <= lm:
            verdict = "yes"
        elif km - lm <= math.hypot(ke, le):
            verdict = "within error"
        else:
            verdict = "**no**"
        ks, ls = (os.path.getsize(files[(m, typ)]) / 1e6 for m in ("kiln", "llamacpp"))
        print(f"| {typ} | {km:.6f} ± {ke:.6f} | {k['same_top'][0]:.3f}% | {k['ppl'][0]:.4f} "
              f"| {ks:.2f} | {lm:.6f} ± {le:.6f} | {l['same_top'][0]:.3f}% | {l['ppl'][0]:.4f} "
              f"| {ls:.2f} | {pct(rel(km, lm), 1)} | {verdict} |")
        diffs = type_differences(files[("kiln", typ)], files[("llamacpp", typ)])
        notes.append((typ, diffs))
    print("\nTensor types that differ between kiln's file and llama-quantize's (kiln vs "
          "llama.cpp):\n")
    for typ, diffs in notes:
        if diffs:
            print(f"- {typ}: " + "; ".join(diffs))
            continue
        try:
            differ = tensor_bytes_differ(files[("kiln", typ)], files[("llamacpp", typ)])
            same = ("and the same bytes (tensor data identical)" if not differ else
                    f"but {len(differ)} tensors hold other bytes (e.g. {differ[0]})")
        except (OSError, ValueError, struct.error) as e:
            same = f"(bytes not compared: {e})"
        print(f"- {typ}: none — every tensor has the same type "
              f"({type_histogram(files[('kiln', typ)])}) {same}")
    print()
    return 1 if mismatch else 0


# ---------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)

    def common(p):
        p.add_argument("--kiln", required=True, help="the kiln binary")
        p.add_argument("--llamacpp", required=True,
                       help="llama.cpp's CPU build: the folder with llama-perplexity")
        p.add_argument("-f", "--file", required=True, help="the text to score")
        p.add_argument("-c", "--ctx", type=int, required=True, help="context per chunk")
        p.add_argument("--threads", type=int, default=2)
        p.add_argument("--work", default="/tmp/ppl-work", help="folder for files and logs")
        p.add_argument("--timeout", type=int, default=TIMEOUT_S, help="seconds a run may take")
        p.add_argument("--llamacpp-extra", default="", metavar="ARGS",
                       help="more llama-perplexity arguments for every run, e.g. '-fa off'")

    p = sub.add_parser("ppl", help="perplexity by both tools and the tokens they scored")
    common(p)
    p.add_argument("-m", "--model", required=True)
    p.add_argument("--cross-kld", action="store_true",
                   help="also the KL-divergence of kiln's saved rows from llama.cpp's")
    p.add_argument("--cross-kld-stride", type=int, default=1, help="score every Nth row")
    p.add_argument("--llamacpp-f32", action="store_true",
                   help="also llama.cpp on an f32 copy of the model, f32 KV, flash attention off")

    p = sub.add_parser("kld", help="KL-divergence of quantised files, by both tools")
    common(p)
    p.add_argument("--source", required=True, help="the GGUF every file is quantised from")
    p.add_argument("--types", required=True, help="comma-separated recipes, e.g. q4_0,q4_k_m")
    p.add_argument("--llamacpp-pairs", default="q4_0,q4_k_m",
                   help="files llama.cpp scores too: TYPE or kiln:TYPE, llamacpp:TYPE")
    p.add_argument("--kiln-mode", choices=("llamacpp", "f32"), default="llamacpp",
                   help="kiln's arithmetic: llama.cpp's (8-bit activations, f16 KV) or f32")
    p.add_argument("--reuse", action="store_true",
                   help="keep files a previous run left in --work")

    args = ap.parse_args()
    if args.ctx < 4 or args.threads < 1:
        die("-c must be 4 or more and --threads 1 or more")
    if getattr(args, "cross_kld_stride", 1) < 1:
        die("--cross-kld-stride must be 1 or more")
    return cmd_ppl(args) if args.cmd == "ppl" else cmd_kld(args)


if __name__ == "__main__":
    sys.exit(main())
