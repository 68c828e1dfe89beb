#!/usr/bin/env python3
"""Regenerates formats/tests/fixtures/quantize_python.json.

kiln quantises a tiny Q8_0 llama model (built deterministically by the Rust test
`write_python_fixture_inputs` in formats/tests/quantize_recipes.rs) with several recipes;
this script reads each output with the `gguf` package -- an independent GGUF reader and
dequantiser -- and records, per tensor, its type, dims, the sum and sum of squares of the
dequantised values and a sample of values. The Rust test checks kiln's own reading of the
same bytes (by sha256) against them. Run from the repository root:

    python3 scripts/make_quantize_fixture.py
"""

import hashlib
import json
import os
import subprocess
import sys
import tempfile

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize

RECIPES = ["q4_k_m", "q5_k_m", "q4_1", "q4_k_s"]
OUT = os.path.join("formats", "tests", "fixtures", "quantize_python.json")
SAMPLES = 48


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        env = dict(os.environ, KILN_QUANTIZE_FIXTURE_DIR=tmp)
        subprocess.run(
            ["cargo", "test", "-p", "kiln-formats", "--test", "quantize_recipes",
             "write_python_fixture_inputs", "--", "--ignored", "--exact"],
            check=True, env=env,
        )
        fixture = {}
        for recipe in RECIPES:
            path = os.path.join(tmp, f"{recipe}.gguf")
            with open(path, "rb") as f:
                sha = hashlib.sha256(f.read()).hexdigest()
            reader = GGUFReader(path)
            tensors = []
            for t in reader.tensors:
                values = dequantize(t.data, t.tensor_type).astype(np.float64).reshape(-1)
                n = values.size
                idx = sorted(set(np.linspace(0, n - 1, SAMPLES).astype(int).tolist()))
                tensors.append({
                    "name": t.name,
                    "type": int(t.tensor_type),
                    # GGUFReader gives shape in ggml order (row length first).
                    "dims": [int(d) for d in t.shape],
                    "sum": float(values.sum()),
                    "sumsq": float((values * values).sum()),
                    "samples": [[i, float(values[i])] for i in idx],
                })
            fixture[recipe] = {"sha256": sha, "tensors": tensors}
            types = sorted({t.tensor_type.name for t in reader.tensors})
            print(f"{recipe}: {len(tensors)} tensors, types {types}", file=sys.stderr)
    with open(OUT, "w") as f:
        json.dump(fixture, f, indent=1)
        f.write("\n")
    print(f"wrote {OUT}", file=sys.stderr)


if __name__ == "__main__":
    main()
