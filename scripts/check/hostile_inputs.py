#!/usr/bin/env python3
"""kiln's hostile-input suite: builds hostile model files, chat templates, plugin paths,
argument lists and input streams, runs the `kiln` binary on each under a time and memory
bound, and checks that every case ends in a typed error (exit 1 with `kiln: error:` on
stderr, or a usage error, exit 2) or a correct result (exit 0) - never a panic, an abort,
a signal or a hang. Standard library only.

    scripts/check/hostile_inputs.py --kiln target/release/kiln [--out DIR] [--keep] [-v]

Cases are generated fresh in DIR (a temporary directory by default) from a tiny valid
llama model written here (one layer, hidden 32, byte-level BPE, f32 weights); each
hostile file is that model with one thing wrong. Prints one line per failing case and a
summary; exits 1 when any case fails. tests/tests/hostile_inputs.rs runs it in CI.
"""

import argparse
import json
import math
import os
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import time

TIME_LIMIT_S = 30
MEMORY_LIMIT = 4 << 30  # address space per case

# GGUF value types
U8, I8, U16, I16, U32, I32, F32, BOOL, STR, ARR, U64, I64, F64 = range(13)
GGML_F32 = 0


def byte_level_char(b):
    """GPT-2's byte -> char map: printable bytes as themselves, the rest from U+0100."""
    nxt = 256
    for x in range(256):
        printable = 0x21 <= x <= 0x7E or 0xA1 <= x <= 0xAC or 0xAE <= x <= 0xFF
        if x == b:
            return chr(x) if printable else chr(nxt)
        if not printable:
            nxt += 1
    raise ValueError(b)


def enc_str(s):
    b = s.encode("utf-8", "surrogatepass") if isinstance(s, str) else s
    return struct.pack("<Q", len(b)) + b


def enc_value(t, v):
    fmt = {U8: "<B", I8: "<b", U16: "<H", I16: "<h", U32: "<I", I32: "<i", F32: "<f", BOOL: "<?", U64: "<Q",
           I64: "<q", F64: "<d"}
    if t == STR:
        return enc_str(v)
    if t == ARR:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(enc_value(et, x) for x in items)
    return struct.pack(fmt[t], v)


class Model:
    """A tiny llama in GGUF, every part editable before `bytes()`."""

    def __init__(self):
        self.hidden, self.heads, self.kv_heads, self.ffn, self.layers = 32, 2, 1, 64, 1
        specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
        self.tokens = specials + [byte_level_char(b) for b in range(256)]
        self.merges = ["Ġ t", "h e", "i n"]
        self.tokens += [m.replace(" ", "") for m in self.merges]
        template = ("{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}"
                    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
        a = "llama"
        self.kv = [
            ("general.architecture", STR, a),
            (f"{a}.block_count", U32, self.layers),
            (f"{a}.context_length", U32, 256),
            (f"{a}.embedding_length", U32, self.hidden),
            (f"{a}.feed_forward_length", U32, self.ffn),
            (f"{a}.attention.head_count", U32, self.heads),
            (f"{a}.attention.head_count_kv", U32, self.kv_heads),
            (f"{a}.attention.layer_norm_rms_epsilon", F32, 1e-5),
            (f"{a}.rope.freq_base", F32, 10000.0),
            ("tokenizer.ggml.model", STR, "gpt2"),
            ("tokenizer.ggml.pre", STR, "gpt2"),
            ("tokenizer.ggml.tokens", ARR, (STR, self.tokens)),
            ("tokenizer.ggml.token_type", ARR, (I32, [3, 3, 3] + [1] * (len(self.tokens) - 3))),
            ("tokenizer.ggml.merges", ARR, (STR, self.merges)),
            ("tokenizer.ggml.bos_token_id", U32, 1),
            ("tokenizer.ggml.eos_token_id", U32, 2),
            ("tokenizer.chat_template", STR, template),
        ]
        h, hd = self.hidden, self.hidden // self.heads
        vocab = len(self.tokens)
        shapes = [("token_embd.weight", [h, vocab])]
        for i in range(self.layers):
            shapes += [(f"blk.{i}.attn_norm.weight", [h]), (f"blk.{i}.attn_q.weight", [h, self.heads * hd]),
                       (f"blk.{i}.attn_k.weight", [h, self.kv_heads * hd]),
                       (f"blk.{i}.attn_v.weight", [h, self.kv_heads * hd]),
                       (f"blk.{i}.attn_output.weight", [self.heads * hd, h]), (f"blk.{i}.ffn_norm.weight", [h]),
                       (f"blk.{i}.ffn_gate.weight", [h, self.ffn]), (f"blk.{i}.ffn_up.weight", [h, self.ffn]),
                       (f"blk.{i}.ffn_down.weight", [self.ffn, h])]
        shapes.append(("output_norm.weight", [h]))
        self.tensors = []
        for n, (name, dims) in enumerate(shapes):
            count = math.prod(dims)
            norm = len(dims) == 1
            vals = [1.0 if norm else (((n * 131 + j * 29) % 97) - 48) / 200.0 for j in range(count)]
            self.tensors.append({"name": name, "dims": dims, "type": GGML_F32, "data": struct.pack(f"<{count}f", *vals)})
        self.alignment = 32
        # Overrides for hostile headers.
        self.n_tensors = None
        self.n_kv = None
        self.offsets = None

    def set(self, key, t, v):
        for i, (k, _, _) in enumerate(self.kv):
            if k == key:
                self.kv[i] = (key, t, v)
                return self
        self.kv.append((key, t, v))
        return self

    def drop(self, key):
        self.kv = [x for x in self.kv if x[0] != key]
        return self

    def tensor(self, name):
        return next(t for t in self.tensors if t["name"] == name)

    def bytes(self):
        out = bytearray(b"GGUF")
        out += struct.pack("<IQQ", 3, self.n_tensors if self.n_tensors is not None else len(self.tensors),
                           self.n_kv if self.n_kv is not None else len(self.kv))
        for k, t, v in self.kv:
            out += enc_str(k) + struct.pack("<I", t) + enc_value(t, v)
        offsets, off = [], 0
        for t in self.tensors:
            offsets.append(off)
            off += len(t["data"])
            off = (off + self.alignment - 1) // self.alignment * self.alignment
        if self.offsets is not None:
            offsets = self.offsets
        for t, o in zip(self.tensors, offsets):
            out += enc_str(t["name"]) + struct.pack("<I", len(t["dims"]))
            out += b"".join(struct.pack("<Q", d) for d in t["dims"]) + struct.pack("<IQ", t["type"], o)
        out += b"\0" * ((-len(out)) % self.alignment)
        data = bytearray()
        for t, o in zip(self.tensors, offsets):
            # Offsets past any sane file (hostile headers) get no data at all.
            if len(data) <= o < (1 << 24):
                data += b"\0" * (o - len(data))
                data += t["data"]
        return bytes(out + data)


class Suite:
    def __init__(self, kiln, out, verbose):
        self.kiln, self.out, self.verbose = kiln, out, verbose
        self.results = []  # (name, ok, detail, seconds)

    def path(self, name):
        return os.path.join(self.out, name)

    def write(self, name, data):
        p = self.path(name)
        with open(p, "wb") as f:
            f.write(data)
        return p

    def run(self, name, args, expect="any", stdin=None, contains=None, timeout=TIME_LIMIT_S):
        """`expect`: "ok" (exit 0), "error" (a typed error: exit 1 with `kiln: error:`, or a
        usage error, exit 2) or "any" of those. Anything else fails: a signal, an abort, a
        panic, a hang or an exit code of its own."""

        def limits():
            resource.setrlimit(resource.RLIMIT_AS, (MEMORY_LIMIT, MEMORY_LIMIT))
            resource.setrlimit(resource.RLIMIT_CORE, (0, 0))

        env = dict(os.environ, KILN_LOG="off", RUST_BACKTRACE="0")
        start = time.monotonic()
        stdin_f = open(stdin, "rb") if stdin else subprocess.DEVNULL
        try:
            p = subprocess.run([self.kiln] + args, stdin=stdin_f, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               timeout=timeout, preexec_fn=limits, env=env)
            code, err = p.returncode, p.stderr.decode("utf-8", "replace")
        except subprocess.TimeoutExpired:
            code, err = None, ""
        finally:
            if stdin:
                stdin_f.close()
        secs = time.monotonic() - start
        problem = None
        if code is None:
            problem = f"hung (killed after {timeout} s)"
        elif code < 0:
            problem = f"killed by signal {signal.Signals(-code).name}"
        elif "panicked" in err:
            problem = f"panicked: {err.strip().splitlines()[-1][:200] if err.strip() else ''}"
        elif code == 0:
            if expect == "error":
                problem = "succeeded where a typed error was expected"
        elif code == 1:
            if "kiln: error:" not in err:
                problem = f"exit 1 without a kiln error message: {err.strip()[:200]!r}"
            elif expect == "ok":
                problem = f"failed: {err.strip().splitlines()[-1][:200]}"
        elif code == 2:
            if expect == "ok":
                problem = f"usage error: {err.strip()[:200]}"
        else:
            problem = f"exit code {code}: {err.strip()[-200:]!r}"
        if problem is None and contains and contains not in err:
            problem = f"the error does not mention {contains!r}: {err.strip()[-200:]!r}"
        self.results.append((name, problem is None, problem or (err.strip().splitlines()[-1][:160] if err.strip() else f"exit {code}"), secs))
        if self.verbose or problem:
            print(f"{'ok  ' if problem is None else 'FAIL'} {name:<44} {secs:6.2f} s  {problem or self.results[-1][2]}")


def gemma3():
    """The tiny model as a gemma3: its keys, a 4-position window, QK and post norms."""
    m = Model()
    m.kv = [(k.replace("llama.", "gemma3.", 1), t, v) for k, t, v in m.kv]
    m.set("general.architecture", STR, "gemma3")
    m.set("gemma3.attention.sliding_window", U32, 4)
    hd = m.hidden // m.heads
    for i in range(m.layers):
        for name, n in [("attn_q_norm", hd), ("attn_k_norm", hd), ("post_attention_norm", m.hidden), ("post_ffw_norm", m.hidden)]:
            m.tensors.append({"name": f"blk.{i}.{name}.weight", "dims": [n], "type": GGML_F32, "data": struct.pack(f"<{n}f", *([1.0] * n))})
    return m


def qwen3moe(experts=4, used=2):
    """The tiny model as a qwen3moe: its keys, QK norms, and a router with stacked experts
    (ffn 16 each) in place of the dense feed-forward."""
    m = Model()
    m.kv = [(k.replace("llama.", "qwen3moe.", 1), t, v) for k, t, v in m.kv]
    m.set("general.architecture", STR, "qwen3moe")
    m.set("qwen3moe.expert_count", U32, experts)
    m.set("qwen3moe.expert_used_count", U32, used)
    m.set("qwen3moe.expert_feed_forward_length", U32, 16)
    hd, h, ffn = m.hidden // m.heads, m.hidden, 16
    dense = ("ffn_gate.weight", "ffn_up.weight", "ffn_down.weight")
    m.tensors = [t for t in m.tensors if not t["name"].endswith(dense)]
    for i in range(m.layers):
        for name, dims in [("attn_q_norm", [hd]), ("attn_k_norm", [hd]), ("ffn_gate_inp", [h, experts]),
                           ("ffn_gate_exps", [h, ffn, experts]), ("ffn_up_exps", [h, ffn, experts]),
                           ("ffn_down_exps", [ffn, h, experts])]:
            n = math.prod(dims)
            vals = [1.0] * n if len(dims) == 1 else [((j * 37) % 23 - 11) / 100.0 for j in range(n)]
            m.tensors.append({"name": f"blk.{i}.{name}.weight", "dims": dims, "type": GGML_F32,
                              "data": struct.pack(f"<{n}f", *vals)})
    return m


def model_cases(s, base):
    """Model files with one thing wrong, each opened by `kiln run` and `kiln inspect`."""
    cases = []

    def case(name, m_or_bytes, expect="error", contains=None, args=None):
        data = m_or_bytes.bytes() if isinstance(m_or_bytes, Model) else m_or_bytes
        cases.append((name, s.write(name + ".gguf", data), expect, contains, args or []))

    full = Model().bytes()
    for cut in [3, 10, 23, 100, 700, 3000, len(full) // 2, len(full) - 1]:
        case(f"truncated-at-{cut}", full[:cut])
    case("empty-file", b"")
    case("not-a-model", b"GGUF" + b"\xff" * 60)
    m = Model(); m.n_kv = 2**64 - 1; case("n-kv-2^64-1", m)
    m = Model(); m.n_tensors = 2**63; case("n-tensors-2^63", m)
    m = Model(); m.set("llama.block_count", U32, 10**9); case("block-count-1e9", m, contains="layer count")
    m = Model(); m.set("llama.block_count", U64, 2**64 - 1); case("block-count-2^64-1", m)
    m = Model(); m.set("llama.embedding_length", U64, 2**40); case("embedding-length-2^40", m)
    m = Model(); m.set("llama.attention.head_count", U32, 0); case("head-count-0", m)
    m = Model(); m.set("llama.attention.head_count", U32, 2**31); case("head-count-2^31", m)
    m = Model(); m.set("llama.feed_forward_length", U64, 2**62); case("ffn-2^62", m)
    m = Model(); m.set("llama.context_length", U32, 2**32 - 1)
    case("context-2^32-1-with-c-0", m, expect="any", args=["-c", "0"])
    m = Model(); m.set("llama.rope.freq_base", F32, 0.0); case("rope-base-0", m)
    m = Model(); m.set("llama.attention.layer_norm_rms_epsilon", F32, -1.0); case("norm-eps-negative", m)
    m = Model(); m.set("llama.attention.layer_norm_rms_epsilon", F32, float("nan")); case("norm-eps-nan", m)
    m = Model(); m.set("llama.block_count", STR, "one"); case("block-count-a-string", m)
    m = Model(); m.set("tokenizer.ggml.merges", ARR, (I32, [1, 2, 3])); case("merges-as-ints", m)
    m = Model(); m.set("tokenizer.ggml.token_type", ARR, (STR, ["x"] * len(m.tokens))); case("token-types-as-strings", m)
    m = Model(); m.set("tokenizer.chat_template", U32, 7); case("chat-template-a-number", m, expect="any")
    m = Model(); m.set("tokenizer.ggml.bos_token_id", U32, 10**9); case("bos-id-out-of-range", m)
    m = Model(); m.set("tokenizer.ggml.tokens", ARR, (STR, m.tokens + ["extra"] * 50)); case("vocab-beyond-embedding", m)
    m = Model(); m.set("general.alignment", U32, 0); case("alignment-0", m)
    m = Model(); m.set("general.alignment", U32, 3); case("alignment-3", m)
    m = Model(); m.kv.append(("llama.block_count", U32, 1)); case("duplicate-key", m, expect="any")
    # A key whose declared string length runs past the file.
    bad = bytearray(Model().bytes()); bad[24:32] = struct.pack("<Q", 2**62); case("key-length-2^62", bytes(bad))
    m = Model(); m.set("x.nested", ARR, (ARR, [])); case("nested-array", m, expect="any")
    m = Model(); m.set("x.huge_array", ARR, (U8, [])); raw = bytearray(m.bytes())
    i = raw.find(b"x.huge_array") + len("x.huge_array") + 4 + 4
    raw[i:i + 8] = struct.pack("<Q", 2**61); case("array-count-2^61", bytes(raw))
    m = Model(); m.tensor("output_norm.weight")["type"] = 99; case("tensor-type-99", m)
    m = Model(); m.tensor("output_norm.weight")["dims"] = [2**32, 2**32]; case("tensor-dims-overflow", m)
    m = Model(); m.tensor("output_norm.weight")["dims"] = [1] * 9; case("tensor-nine-dims", m)
    m = Model(); offs = [0] * len(m.tensors); m.offsets = offs; case("tensors-overlap", m, contains="overlap")
    m = Model(); m.offsets = [i * 4096 + 8 for i in range(len(m.tensors))]; case("tensor-offsets-misaligned", m)
    m = Model(); m.offsets = [2**60 + i for i in range(len(m.tensors))]; case("tensor-offsets-past-the-end", m)
    m = Model(); m.tensors = [t for t in m.tensors if t["name"] != "blk.0.ffn_down.weight"]; case("missing-tensor", m)
    m = Model(); t = m.tensor("output_norm.weight"); t["data"] = struct.pack("<f", float("nan")) + t["data"][4:]
    case("nan-in-a-weight", m, contains="finite")
    # Gemma 3's own keys and tensors: a well-formed one runs; broken windows and missing
    # post-norms are refused.
    case("gemma3-well-formed", gemma3(), expect="ok")
    case("gemma3-window-0", gemma3().set("gemma3.attention.sliding_window", U32, 0), contains="sliding window")
    case("gemma3-window-2^63", gemma3().set("gemma3.attention.sliding_window", U64, 2**63), contains="sliding window")
    case("gemma3-window-missing", gemma3().drop("gemma3.attention.sliding_window"), contains="sliding_window")
    m = gemma3(); m.tensors = [t for t in m.tensors if "post_ffw_norm" not in t["name"]]
    case("gemma3-no-post-norms", m)
    # Mixture of Experts: a well-formed one runs; counts and shapes that disagree are refused
    # before anything is sized by them.
    case("qwen3moe-well-formed", qwen3moe(), expect="ok")
    case("qwen3moe-experts-0", qwen3moe().set("qwen3moe.expert_count", U32, 0), contains="expert_count")
    case("qwen3moe-experts-2^40", qwen3moe().set("qwen3moe.expert_count", U64, 2**40), contains="expert count")
    case("qwen3moe-used-above-count", qwen3moe().set("qwen3moe.expert_used_count", U32, 5), contains="experts used")
    case("qwen3moe-expert-ffn-2^62", qwen3moe().set("qwen3moe.expert_feed_forward_length", U64, 2**62))
    m = qwen3moe(); m.tensors = [t for t in m.tensors if "ffn_gate_inp" not in t["name"]]
    case("qwen3moe-no-router", m, contains="ffn_gate_inp")
    m = qwen3moe(); m.tensor("blk.0.ffn_down_exps.weight")["dims"] = [16, 32, 3]
    case("qwen3moe-expert-shapes-disagree", m)
    for name, path, expect, contains, extra in cases:
        s.run(f"run {name}", ["run", "Hello", "-n", "3", "-m", path] + extra, expect, contains=contains)
        s.run(f"inspect {name}", ["inspect", path] + extra[:0], "any" if expect != "error" else "any")
    return cases


def template_cases(s):
    """Chat templates from the file as untrusted code, rendered by `kiln run --chat`."""
    hostile = {
        "template-loop-forever": "{% for i in range(1000000) %}{% for j in range(1000000) %}x{% endfor %}{% endfor %}",
        "template-huge-string": "{{ 'x' * 100000000000 }}",
        "template-string-doubling": "{% set ns = namespace(s='xxxxxxxx') %}{% for i in range(64) %}{% set ns.s = ns.s + ns.s %}{% endfor %}{{ ns.s }}",
        "template-recursion": "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}",
        "template-syntax-error": "{% for %}",
        "template-raise": "{{ raise_exception('no') }}",
        "template-undefined": "{{ messages[99]['content'].nope() }}",
    }
    for name, src in hostile.items():
        m = Model(); m.set("tokenizer.chat_template", STR, src)
        p = s.write(name + ".gguf", m.bytes())
        s.run(f"run --chat {name}", ["run", "--chat", "hi", "-n", "2", "-m", p], "error")


def argument_cases(s, base):
    run = ["run", "Hello", "-m", base]
    s.run("base model runs", run + ["-n", "3"], "ok")
    s.run("-n 0", run + ["-n", "0"], "ok")
    for flag, value in [("--temp", "-1"), ("--temp", "nan"), ("--temp", "inf"), ("--top-p", "1.5"), ("--top-p", "nan"),
                        ("--min-p", "-0.5"), ("--repeat-penalty", "-2"), ("--repeat-penalty", "0"),
                        ("--top-k", "99999999999999999999999"), ("-n", "-1"), ("-c", "99999999999999"),
                        ("-c", "100000"), ("-t", "100000"), ("--seed", "-5"), ("--kv-type", "q4_0"),
                        ("--kv-type", "")]:
        s.run(f"run {flag} {value}", run + ["-n", "2", f"{flag}={value}"], "error")
    s.run("run -t 1000", run + ["-n", "2", "-t", "1000"], "error" if (os.cpu_count() or 1) * 4 < 1000 else "any",
          contains="cores")
    s.run("run -t 0 (all cores)", run + ["-n", "2", "-t", "0"], "any")
    s.run("run --kv-type q8_0", run + ["-n", "2", "--kv-type", "q8_0"], "any")
    s.run("run --backend nonsense", run + ["--backend", "nonsense"], "error", contains="nonsense")
    s.run("bench -p 0 -n 0", ["bench", "-m", base, "-p", "0", "-n", "0"], "any")
    s.run("bench --batch 0", ["bench", "-m", base, "--batch", "0"], "error")
    s.run("unknown subcommand", ["frobnicate"], "error")


def path_cases(s, base):
    fifo = s.path("a-fifo")
    os.mkfifo(fifo)
    text = s.write("not-a-plugin.so", b"#!/bin/sh\necho hi\n")
    elf_garbage = s.write("garbage-elf.so", b"\x7fELF" + b"\x02\x01\x01" + b"\0" * 200)
    s.run("model is a FIFO", ["run", "hi", "-m", fifo], "error", timeout=15)
    s.run("model is /dev/zero", ["run", "hi", "-m", "/dev/zero"], "error", timeout=15)
    s.run("model is a directory", ["run", "hi", "-m", s.out], "error")
    s.run("model does not exist", ["run", "hi", "-m", s.path("nope.gguf")], "error", contains="nope.gguf")
    for name, p in [("FIFO", fifo), ("shell script", text), ("garbage ELF", elf_garbage), ("/dev/null", "/dev/null")]:
        # A broken plugin is reported and skipped; the host goes on with its built-ins.
        s.run(f"plugin is a {name}", ["backends", "--plugin", p], "any", timeout=15)
        s.run(f"run with plugin {name}", ["run", "hi", "-n", "1", "-m", base, "--plugin", p], "any", timeout=15)


def stream_cases(s, base):
    """`kiln chat` reading hostile standard input."""
    no_newline = s.write("stdin-64MiB-no-newline", b"a" * (64 << 20))
    s.run("chat: 64 MiB line without a newline", ["chat", "-m", base, "-n", "2"], "error", stdin=no_newline,
          contains="input line")
    binary = s.write("stdin-binary", bytes(range(256)) * 4096)
    s.run("chat: binary input", ["chat", "-m", base, "-n", "2"], "any", stdin=binary)
    s.run("chat: empty input", ["chat", "-m", base, "-n", "2"], "any", stdin=s.write("stdin-empty", b""))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--kiln", required=True)
    ap.add_argument("--out")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("-v", "--verbose", action="store_true")
    a = ap.parse_args()
    out = a.out or tempfile.mkdtemp(prefix="kiln-hostile-")
    os.makedirs(out, exist_ok=True)
    s = Suite(os.path.abspath(a.kiln), out, a.verbose)
    base = s.write("base.gguf", Model().bytes())
    argument_cases(s, base)
    model_cases(s, base)
    template_cases(s)
    path_cases(s, base)
    stream_cases(s, base)
    failed = [r for r in s.results if not r[1]]
    slowest = max(s.results, key=lambda r: r[3])
    summary = {"cases": len(s.results), "failed": len(failed), "slowest": [slowest[0], round(slowest[3], 2)]}
    print(json.dumps(summary))
    if not a.keep and not a.out:
        shutil.rmtree(out, ignore_errors=True)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
