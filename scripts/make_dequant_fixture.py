#!/usr/bin/env python3
"""Generate core/tests/fixtures/dequant_reference.json.

The expected values come from the `gguf` Python package (`gguf.quants`), an implementation
of ggml's block formats independent of kiln's. The Rust test
core/tests/dequant_reference.rs checks kiln_core::quant against this file, so CI needs no
Python. Re-run after changing the cases (output is deterministic for a given seed and
gguf/numpy version):

    python3 scripts/make_dequant_fixture.py

Two sections:
  dequantize: for each type gguf can dequantise, a few blocks of bytes and the f32 values
              gguf.quants.dequantize gives for them. Quantised types get a mix of blocks made
              by gguf's own quantiser (realistic codes) and blocks of random bytes whose f16
              scale fields are overwritten with finite values (every code, every packed
              scale bit pattern, negative / subnormal / zero scales).
  quantize:   random and adversarial f32 rows and the bytes gguf.quants.quantize makes of
              them, for the types it quantises with ggml's reference algorithm.
All numbers are stored as little-endian bytes in hex, so the comparison can be bit-exact.
"""

import json
import os
from importlib.metadata import version
import sys

import numpy as np
import gguf
from gguf import GGMLQuantizationType as T
from gguf.quants import quantize, dequantize

SEED = 20251130
OUT = os.path.join(os.path.dirname(__file__), "..", "core", "tests", "fixtures", "dequant_reference.json")

# Offsets of the f16 scale fields inside one block (ggml struct order), which random bytes
# must not fill with NaN/inf: such blocks are legal but say nothing about the arithmetic.
F16_FIELDS = {
    T.Q4_0: [0],
    T.Q4_1: [0, 2],
    T.Q5_0: [0],
    T.Q5_1: [0, 2],
    T.Q8_0: [0],
    T.Q2_K: [80, 82],
    T.Q3_K: [108],
    T.Q4_K: [0, 2],
    T.Q5_K: [0, 2],
    T.Q6_K: [208],
}

LEGACY = [T.Q4_0, T.Q4_1, T.Q5_0, T.Q5_1, T.Q8_0]
KQUANTS = [T.Q2_K, T.Q3_K, T.Q4_K, T.Q5_K, T.Q6_K]


def hexs(a: np.ndarray) -> str:
    return np.ascontiguousarray(a).tobytes().hex()


def sane_scale(rng: np.random.Generator, i: int) -> np.float16:
    """Finite f16 scales: typical magnitudes of both signs, plus zero, subnormal and large."""
    special = [0.0, -0.0, 6.0e-8, -3.0e-6, 6.1e-5, 1.0, 16.0]
    if i % 4 == 3:
        return np.float16(special[rng.integers(len(special))])
    mag = 10.0 ** rng.uniform(-4.0, 0.5)
    return np.float16(mag if rng.random() < 0.75 else -mag)


def random_blocks(rng, qtype, n_blocks):
    block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
    raw = rng.integers(0, 256, size=(n_blocks, type_size), dtype=np.uint8)
    for b in range(n_blocks):
        for off in F16_FIELDS[qtype]:
            raw[b, off:off + 2] = np.frombuffer(sane_scale(rng, b).tobytes(), dtype=np.uint8)
    return raw


def float_rows(rng, n_blocks):
    """Rows of 32-value blocks covering what quantisers must get right."""
    blocks = []
    for i in range(n_blocks):
        kind = i % 12
        scale = 10.0 ** rng.uniform(-3.0, 3.0)
        if kind == 0:
            x = rng.standard_normal(32) * scale
        elif kind == 1:
            x = rng.uniform(-1.0, 1.0, 32) * scale
        elif kind == 2:
            x = rng.uniform(0.0, 1.0, 32) * scale + scale  # all positive: min far from 0
        elif kind == 3:
            x = np.zeros(32)  # d = 0: ggml uses id = 0, all codes at the offset
        elif kind == 4:
            x = np.full(32, -scale)  # constant: Q4_1/Q5_1 range 0
        elif kind == 5:
            x = rng.standard_normal(32) * 0.01
            x[rng.integers(32)] = 50.0 * (1 if rng.random() < 0.5 else -1)  # one outlier
        elif kind == 6:
            # Half-integers with amax 127: Q8_0's id is exactly 1, every code a rounding tie.
            x = rng.integers(-127, 127, 32) + 0.5
            x[0] = 127.0
        elif kind == 7:
            # Equal-magnitude extremes of both signs: the first one decides d's sign.
            x = rng.uniform(-1.0, 1.0, 32)
            a, b = sorted(rng.choice(32, 2, replace=False))
            x[a], x[b] = (-2.0, 2.0) if rng.random() < 0.5 else (2.0, -2.0)
        elif kind == 8:
            x = rng.standard_normal(32) * 1e-6  # d lands in f16's subnormal range
        elif kind == 9:
            x = rng.integers(-8, 8, 32).astype(np.float64)  # exactly representable in Q4_0
            x[0] = -8.0
        elif kind == 10:
            x = rng.standard_normal(32) * scale
            x[::2] = 0.0
        else:
            x = rng.laplace(0.0, scale, 32)
        blocks.append(x.astype(np.float32))
    return np.concatenate(blocks)


def main() -> int:
    rng = np.random.default_rng(SEED)
    deq = []

    # Plain float types: random bit patterns, so every exponent (incl. inf/NaN/subnormal) shows up.
    f32_bits = rng.integers(0, 2**32, size=64, dtype=np.uint64).astype(np.uint32)
    f32_bits[:6] = [0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x00000001, 0x7FC00001]
    f32 = f32_bits.view(np.float32)
    deq.append(("f32", T.F32, f32.view(np.uint8), dequantize(f32.view(np.uint8), T.F32)))

    h_bits = rng.integers(0, 2**16, size=128, dtype=np.uint16)
    h_bits[:6] = [0x0000, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x7E01]
    deq.append(("f16", T.F16, h_bits.view(np.uint8), dequantize(h_bits.view(np.uint8), T.F16)))
    bf_bits = rng.integers(0, 2**16, size=128, dtype=np.uint16)
    bf_bits[:6] = [0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x7FC1]
    deq.append(("bf16", T.BF16, bf_bits.view(np.uint8), dequantize(bf_bits.view(np.uint8), T.BF16)))

    for qtype in LEGACY:
        realistic = quantize(float_rows(rng, 8).reshape(1, -1), qtype).reshape(-1)
        raw = random_blocks(rng, qtype, 8).reshape(-1)
        data = np.concatenate([realistic, raw])
        deq.append((qtype.name.lower(), qtype, data, dequantize(data, qtype)))

    for qtype in KQUANTS:
        raw = random_blocks(rng, qtype, 6)
        # One block with every code and scale bit set, one with all clear.
        raw[0, :] = 0xFF
        raw[1, :] = 0x00
        for b in (0, 1):
            for off in F16_FIELDS[qtype]:
                raw[b, off:off + 2] = np.frombuffer(np.float16(0.0123 if b == 0 else -0.5).tobytes(), dtype=np.uint8)
        data = raw.reshape(-1)
        deq.append((qtype.name.lower(), qtype, data, dequantize(data, qtype)))

    dequant_cases = []
    for name, qtype, data, values in deq:
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        dequant_cases.append({
            "type": name,
            "ggml_id": int(qtype),
            "n_values": int(values.size),
            "bytes_hex": hexs(data.astype(np.uint8)),
            "values_f32_le_hex": hexs(values.astype("<f4")),
        })

    rows = float_rows(rng, 24)
    quant_cases = []
    for qtype in [T.F16, T.BF16] + LEGACY:
        q = quantize(rows.reshape(1, -1), qtype)
        quant_cases.append({"type": qtype.name.lower(), "ggml_id": int(qtype), "bytes_hex": hexs(q.view(np.uint8))})

    fixture = {
        "generator": "scripts/make_dequant_fixture.py",
        "reference": f"gguf {version('gguf')} (gguf.quants), numpy {np.__version__}",
        "seed": SEED,
        "note": "All numbers are little-endian bytes in hex. gguf has no Q8_1/Q8_K dequantiser, "
                "so those types are checked in Rust against Q8_0 and hand-built blocks instead.",
        "dequantize": dequant_cases,
        "quantize": {"values_f32_le_hex": hexs(rows.astype("<f4")), "cases": quant_cases},
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {os.path.normpath(OUT)} ({os.path.getsize(OUT)} bytes)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
