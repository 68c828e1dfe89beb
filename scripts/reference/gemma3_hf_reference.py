#!/usr/bin/env python3
"""HuggingFace transformers' float32 reference for kiln's Gemma 3 tests (issue 14's bar).

Loads the real Gemma 3 270M Q4_K_M GGUF with transformers (which dequantises every tensor
to float32; needs torch, transformers, accelerate and the `gguf` package — a CPU is
enough: `python3 -m venv v && v/bin/pip install torch transformers accelerate gguf`), feeds the prompts of tests/fixtures/gemma3/llamacpp_greedy.jsonl as token ids
(kiln tokenised them, so only forward passes are compared), and writes
tests/fixtures/gemma3/hf_greedy.jsonl in the same schema: per prompt the first step's logits
at the probe ids (HF's 256 highest and every 1021st id), 32 greedy tokens and HF's top-2
logit gap at each step; beside it hf_greedy.meta.json with the versions and the model's
sha256, and tokenizer_hf.jsonl: transformers' tokenizer for the file (special tokens parsed,
BOS added) on the 40 strings of tokenizer_strings.jsonl.

    python3 scripts/reference/gemma3_hf_reference.py --model gemma-3-270m-q4_k_m.gguf \
        [--out tests/fixtures/gemma3/hf_greedy.jsonl] [--steps 32]
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

HERE = os.path.dirname(os.path.abspath(__file__))
FIXTURES = os.path.join(HERE, "..", "..", "tests", "fixtures", "gemma3")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--prompts", default=os.path.join(FIXTURES, "llamacpp_greedy.jsonl"))
    ap.add_argument("--out", default=os.path.join(FIXTURES, "hf_greedy.jsonl"))
    ap.add_argument("--steps", type=int, default=32)
    args = ap.parse_args()

    directory, name = os.path.split(os.path.abspath(args.model))
    model = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    model.eval()
    prompts = [json.loads(line)["prompt"] for line in open(args.prompts) if line.strip()]
    with open(args.out, "w") as out, torch.no_grad():
        for ids in prompts:
            input_ids = torch.tensor([ids])
            result = model(input_ids=input_ids, use_cache=True)
            past = result.past_key_values
            logits = result.logits[0, -1].float()
            top = torch.topk(logits, 256)
            probe = [(int(i), float(logits[i])) for i in top.indices]
            probe += [(i, float(logits[i])) for i in range(0, logits.numel(), 1021)]
            greedy, gaps = [], []
            for _ in range(args.steps):
                two = torch.topk(logits, 2)
                token = int(two.indices[0])
                greedy.append(token)
                gaps.append(float(two.values[0] - two.values[1]))
                result = model(input_ids=torch.tensor([[token]]), past_key_values=past, use_cache=True)
                past = result.past_key_values
                logits = result.logits[0, -1].float()
            out.write(json.dumps({"prompt": ids, "probe": probe, "greedy": greedy, "top2_gap": gaps}) + "\n")
            print(f"{len(ids)} tokens: greedy {greedy[:8]}...", flush=True)
    write_meta(args)
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    with open(os.path.join(os.path.dirname(args.out), "tokenizer_hf.jsonl"), "w") as out:
        for line in open(os.path.join(FIXTURES, "tokenizer_strings.jsonl")):
            text = json.loads(line)
            ids = tokenizer(text, add_special_tokens=True)["input_ids"]
            out.write(json.dumps({"text": text, "ids": ids}) + "\n")


def write_meta(args: argparse.Namespace) -> None:
    import gguf
    import transformers

    digest = hashlib.sha256()
    with open(args.model, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    meta = {
        "model_sha256": digest.hexdigest(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "gguf": getattr(gguf, "__version__", "?"),
        "dtype": "float32",
        "steps": args.steps,
        "made": datetime.date.today().isoformat(),
    }
    with open(os.path.splitext(args.out)[0] + ".meta.json", "w") as f:
        json.dump(meta, f, indent=1)
        f.write("\n")


if __name__ == "__main__":
    main()
