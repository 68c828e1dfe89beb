#!/usr/bin/env python3
"""Generate core/tests/fixtures/yarn_reference.json: YaRN rope scaling as Hugging Face
`transformers` computes it (`modeling_rope_utils._compute_yarn_parameters`, the code the
Qwen2/Qwen3 models run), for kiln's `RopeConfig::inv_freq` / `attention_factor` to be
checked against.

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install transformers torch
    /tmp/hf/bin/python scripts/make_yarn_fixture.py

Cases: Qwen2.5's and Qwen3's published 128k setting (factor 4 over 32,768), a stronger
scaling with non-default betas, and a partial rotary head (half of 128 dimensions rotate).
The attention factor is transformers' own default (1 + 0.1·ln factor): GGUF files carry
only a multiplier of it, which is 1 in every converter output we know of.
"""
import json
import os

import transformers
from transformers import Qwen2Config
from transformers import modeling_rope_utils as rope_utils

OUT = os.path.join(os.path.dirname(__file__), "..", "core", "tests", "fixtures", "yarn_reference.json")

CASES = [
    # head_dim, rotary fraction, theta, factor, original context, beta_fast, beta_slow
    (128, 1.0, 1_000_000.0, 4.0, 32_768, 32.0, 1.0),
    (64, 1.0, 10_000.0, 8.0, 4_096, 16.0, 2.0),
    (128, 0.5, 500_000.0, 16.0, 8_192, 32.0, 1.0),
]


def main():
    cases = []
    for head_dim, partial, theta, factor, original, beta_fast, beta_slow in CASES:
        heads = 8
        config = Qwen2Config(
            hidden_size=head_dim * heads,
            num_attention_heads=heads,
            num_key_value_heads=heads,
            max_position_embeddings=int(original * factor),
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": theta,
                "factor": factor,
                "original_max_position_embeddings": original,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
            },
        )
        config.partial_rotary_factor = partial
        inv_freq, attention_factor = rope_utils._compute_yarn_parameters(config)
        cases.append(
            {
                "head_dim": head_dim,
                "rotary_dims": int(head_dim * partial),
                "theta": theta,
                "factor": factor,
                "original_context": original,
                "beta_fast": beta_fast,
                "beta_slow": beta_slow,
                "attention_factor": float(attention_factor),
                "inv_freq": [float(v) for v in inv_freq.tolist()],
            }
        )
    with open(OUT, "w") as f:
        json.dump({"transformers": transformers.__version__, "cases": cases}, f, indent=1)
        f.write("\n")
    print(f"wrote {len(cases)} cases to {OUT}")


if __name__ == "__main__":
    main()
