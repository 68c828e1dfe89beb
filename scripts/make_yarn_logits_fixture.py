#!/usr/bin/env python3
"""Generate tests/fixtures/yarn_qwen2/: a tiny random Qwen2 with YaRN rope scaling as a GGUF
file (written by the `gguf` package, f16 weights) and the logits Hugging Face
`transformers` computes for it in float32, for the CPU oracle to be checked against.

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install transformers torch gguf
    /tmp/hf/bin/python scripts/make_yarn_logits_fixture.py

The original context is 32 positions scaled by 8, and the prompt is 200 tokens long, so most
positions lie far past the unscaled window (where YaRN changes the rotation): the test
compares every fifth position's logits and the last one.
"""
import json
import os

import gguf
import numpy as np
import torch
import transformers
from transformers import Qwen2Config, Qwen2ForCausalLM

OUT = os.path.join(os.path.dirname(__file__), "..", "tests", "fixtures", "yarn_qwen2")
VOCAB, HIDDEN, FFN, LAYERS, HEADS, KV = 128, 64, 128, 2, 4, 2
THETA, FACTOR, ORIGINAL = 10_000.0, 8.0, 32
PROMPT = 200


def main():
    os.makedirs(OUT, exist_ok=True)
    torch.manual_seed(0)
    config = Qwen2Config(
        vocab_size=VOCAB,
        hidden_size=HIDDEN,
        intermediate_size=FFN,
        num_hidden_layers=LAYERS,
        num_attention_heads=HEADS,
        num_key_value_heads=KV,
        max_position_embeddings=int(ORIGINAL * FACTOR),
        rms_norm_eps=1e-6,
        tie_word_embeddings=True,
        rope_parameters={
            "rope_type": "yarn",
            "rope_theta": THETA,
            "factor": FACTOR,
            "original_max_position_embeddings": ORIGINAL,
        },
        attn_implementation="eager",
    )
    model = Qwen2ForCausalLM(config).eval()
    # Weights of a trained model's scale, rounded to f16 (what the GGUF stores).
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif name.endswith("bias"):
                p.copy_(0.1 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / np.sqrt(p.shape[-1]))
            p.copy_(p.half().float())

    path = os.path.join(OUT, "yarn-qwen2.gguf")
    w = gguf.GGUFWriter(path, "qwen2")
    w.add_context_length(int(ORIGINAL * FACTOR))
    w.add_embedding_length(HIDDEN)
    w.add_block_count(LAYERS)
    w.add_feed_forward_length(FFN)
    w.add_head_count(HEADS)
    w.add_head_count_kv(KV)
    w.add_rope_freq_base(THETA)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
    w.add_rope_scaling_factor(FACTOR)
    w.add_rope_scaling_orig_ctx_len(ORIGINAL)
    sd = {k: v.detach().numpy() for k, v in model.state_dict().items()}
    names = {
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"].astype(np.float16))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"].astype(np.float32))
    for i in range(LAYERS):
        pre = f"model.layers.{i}."
        w.add_tensor(f"blk.{i}.attn_norm.weight", sd[pre + "input_layernorm.weight"].astype(np.float32))
        w.add_tensor(f"blk.{i}.ffn_norm.weight", sd[pre + "post_attention_layernorm.weight"].astype(np.float32))
        for hf, gg in names.items():
            w.add_tensor(f"blk.{i}.{gg}.weight", sd[pre + hf + ".weight"].astype(np.float16))
            if pre + hf + ".bias" in sd:
                w.add_tensor(f"blk.{i}.{gg}.bias", sd[pre + hf + ".bias"].astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()

    ids = torch.randint(0, VOCAB, (1, PROMPT), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        logits = model(ids).logits[0].float().numpy()
    positions = sorted(set(range(4, PROMPT, 5)) | {PROMPT - 1})
    logits[positions].astype("<f4").tofile(os.path.join(OUT, "logits.f32"))
    with open(os.path.join(OUT, "reference.json"), "w") as f:
        json.dump(
            {
                "transformers": transformers.__version__,
                "prompt_ids": ids[0].tolist(),
                "positions": positions,
                "vocab": VOCAB,
            },
            f,
        )
        f.write("\n")
    print(f"wrote {path} ({os.path.getsize(path)} bytes) and {len(positions)} logit rows")


if __name__ == "__main__":
    main()
