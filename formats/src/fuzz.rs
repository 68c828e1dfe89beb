//! Entry points for fuzzing the parsers that read untrusted input: one function per
//! target, taking arbitrary bytes, that must return (every error typed) and never panic,
//! hang or allocate without bound. The cargo-fuzz targets in `fuzz/` call these (nightly,
//! libFuzzer), and `formats/tests/fuzz_harness.rs` runs the same functions on stable in CI
//! over the committed seed corpora plus mutated inputs, so both exercise one code path.
//!
//! Not part of kiln's API: hidden from the docs, kept stable only for the fuzz crate.

use std::sync::{Arc, OnceLock};

use crate::chat::{ChatMessage, ChatTemplate};
use crate::gguf::GgufFile;
use crate::model::model_from_gguf;
use crate::tokenizer::{Tokenizer, TokenizerSpec};

/// A GGUF file's header, metadata and tensor index: parsed, every key and tensor visited.
pub fn gguf_reader(data: &[u8]) {
    let Ok(file) = GgufFile::from_storage(Arc::new(data.to_vec())) else {
        return;
    };
    for (key, value) in file.metadata() {
        assert!(file.get(key).is_some(), "a listed key is found");
        let _ = value.to_string();
    }
    for t in file.tensors() {
        let _ = t.elements();
    }
}

/// A GGUF file as a model: everything `Model::open` derives from it — the IR, the
/// tokenizer, the chat template — and a first use of each (encode, decode, render).
pub fn gguf_model(data: &[u8]) {
    let Ok(file) = GgufFile::from_storage(Arc::new(data.to_vec())) else {
        return;
    };
    if let Ok(ir) = model_from_gguf(&file, "fuzz input") {
        let _ = ir.config.validate();
        for t in ir.weights.tensors() {
            assert_eq!(
                t.bytes().len(),
                t.qtype().row_bytes(t.row_len()).unwrap() * t.rows(),
                "{}",
                t.name()
            );
        }
    }
    if let Ok(spec) = TokenizerSpec::from_gguf(&file) {
        if let Ok(tok) = Tokenizer::from_spec(spec) {
            if let Ok(ids) = tok.encode("Hello, world! 123 <|im_start|>", true, true) {
                let _ = tok.decode(&ids, false);
            }
        }
    }
    if let Ok(t) = ChatTemplate::from_gguf(&file) {
        let _ = t.render(&conversation("hi"), true);
    }
}

/// Text through tokenizers of every kind kiln reads: SentencePiece with byte fallback
/// and byte-level BPE with each named pre-tokenizer. The first byte picks the tokenizer,
/// the rest is the text (lossily UTF-8) and, read as little-endian u32s, ids to decode
/// (in range or not). Byte-level BPE must give the text back exactly.
pub fn tokenizer(data: &[u8]) {
    let Some((&pick, rest)) = data.split_first() else {
        return;
    };
    let toks = tokenizers();
    let tok = &toks[pick as usize % toks.len()];
    let text = String::from_utf8_lossy(rest);
    for parse_special in [false, true] {
        if let Ok(ids) = tok.encode(&text, false, parse_special) {
            assert!(
                ids.iter().all(|&id| (id as usize) < tok.vocab_size()),
                "an id outside the vocabulary"
            );
            let back = tok.decode(&ids, false);
            if !parse_special && tok.is_byte_level() {
                assert_eq!(back, text, "byte-level BPE must round-trip");
            }
        }
    }
    let ids: Vec<u32> = rest
        .chunks(4)
        .map(|c| c.iter().rev().fold(0u32, |a, &b| (a << 8) | b as u32))
        .collect();
    let _ = tok.decode(&ids, pick & 1 == 0);
    let mut stream = tok.decode_stream(pick & 2 == 0);
    for &id in &ids {
        let _ = stream.push(id % (tok.vocab_size() as u32 + 8));
    }
    let _ = stream.flush();
}

/// A chat template from untrusted bytes: the text before the first NUL is the template,
/// the rest a user message. Compiling and rendering must end, within the template limits
/// (`chat::limits`), in text or a typed error.
pub fn chat_template(data: &[u8]) {
    let (src, msg) = match data.iter().position(|&b| b == 0) {
        Some(i) => (&data[..i], &data[i + 1..]),
        None => (data, &b""[..]),
    };
    let Ok(t) = ChatTemplate::new(String::from_utf8_lossy(src), "<s>", "</s>") else {
        return;
    };
    let _ = t.render(&conversation(&String::from_utf8_lossy(msg)), true);
    let _ = t.render(&[], false);
}

fn conversation(user: &str) -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "You are terse."),
        ChatMessage::new("user", user),
        ChatMessage::new("assistant", "Yes."),
        ChatMessage::new("user", "And?"),
    ]
}

const NORMAL: i32 = 1;
const UNKNOWN: i32 = 2;
const CONTROL: i32 = 3;
const USER: i32 = 4;
const BYTE: i32 = 6;

/// The fuzzed tokenizers, built once: SentencePiece, then byte-level BPE per pre-tokenizer.
pub fn tokenizers() -> &'static [Tokenizer] {
    static TOKENIZERS: OnceLock<Vec<Tokenizer>> = OnceLock::new();
    TOKENIZERS.get_or_init(|| {
        let mut v =
            vec![Tokenizer::from_spec(spm_spec()).expect("the fuzz SentencePiece vocab is valid")];
        for pre in ["gpt2", "llama-bpe", "qwen2", "smollm", "default"] {
            v.push(Tokenizer::from_spec(bpe_spec(pre)).expect("the fuzz BPE vocab is valid"));
        }
        v
    })
}

/// <unk>, <s>, </s>, 256 byte pieces, then pieces with scores (merge priority).
fn spm_spec() -> TokenizerSpec {
    let mut tokens = vec!["<unk>".to_string(), "<s>".to_string(), "</s>".to_string()];
    let mut scores = vec![0.0, 0.0, 0.0];
    let mut types = vec![UNKNOWN, CONTROL, CONTROL];
    for b in 0..=255u32 {
        tokens.push(format!("<0x{b:02X}>"));
        scores.push(0.0);
        types.push(BYTE);
    }
    let pieces = [
        "▁", "▁t", "he", "▁the", "▁a", "in", "er", "on", "▁s", "at", "▁\n", "\n\n", "  ", "é",
        "日本",
    ];
    for (i, p) in pieces.iter().enumerate() {
        tokens.push(p.to_string());
        scores.push(-(i as f32));
        types.push(NORMAL);
    }
    tokens.push("<tool>".into());
    scores.push(0.0);
    types.push(USER);
    TokenizerSpec {
        model: "llama".into(),
        tokens,
        scores: Some(scores),
        token_types: Some(types),
        bos: Some(1),
        eos: Some(2),
        unk: Some(0),
        add_bos: true,
        add_space_prefix: true,
        ..Default::default()
    }
}

/// GPT-2's byte → char map (printable bytes as themselves, the rest from U+0100).
fn byte_level_char(b: u8) -> char {
    let mut next = 256u32;
    for x in 0..=255u8 {
        let printable = matches!(x, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        if x == b {
            return if printable {
                x as char
            } else {
                char::from_u32(next).expect("below U+0200")
            };
        }
        if !printable {
            next += 1;
        }
    }
    unreachable!("every byte is in 0..=255")
}

/// Specials (control and user-defined), the 256 byte chars, then merged pieces.
fn bpe_spec(pre: &str) -> TokenizerSpec {
    let mut tokens: Vec<String> = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<tool>"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    let mut types = vec![CONTROL, CONTROL, CONTROL, USER];
    for b in 0..=255u8 {
        tokens.push(byte_level_char(b).to_string());
        types.push(NORMAL);
    }
    let merges = [
        "Ġ t", "h e", "Ġt he", "i n", "Ġ a", "e r", "o n", "r e", "Ġ s", "a t", "Ċ Ċ", "Ġ Ġ", "1 2",
    ];
    for m in merges {
        tokens.push(m.replace(' ', ""));
        types.push(NORMAL);
    }
    TokenizerSpec {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        token_types: Some(types),
        merges: merges.iter().map(|s| s.to_string()).collect(),
        bos: Some(1),
        eos: Some(2),
        ..Default::default()
    }
}

/// Seed inputs for [`gguf_reader`] and [`gguf_model`]: two small complete models (a llama with byte-level BPE and a
/// qwen2 with SentencePiece, QKV biases and Q8_0 matrices), each with its tokenizer and a
/// chat template, so mutations start from files every stage accepts.
pub fn gguf_seeds() -> Vec<Vec<u8>> {
    use crate::gguf::{GgufArray, GgufValue, GgufWriter};
    use kiln_core::QType;
    let mut seeds = Vec::new();
    for (arch, spec, matrix, biases) in [
        ("llama", bpe_spec("llama-bpe"), QType::F16, false),
        ("qwen2", spm_spec(), QType::Q8_0, true),
    ] {
        let (layers, hidden, heads, kv_heads, ffn) = (1usize, 32usize, 2usize, 1usize, 64usize);
        let vocab = spec.tokens.len();
        let hd = hidden / heads;
        let mut w = GgufWriter::new();
        let kv = |w: &mut GgufWriter, k: String, v: GgufValue| {
            w.add_kv(k, v).expect("valid metadata");
        };
        kv(&mut w, "general.architecture".into(), arch.into());
        kv(
            &mut w,
            format!("{arch}.block_count"),
            (layers as u32).into(),
        );
        kv(&mut w, format!("{arch}.context_length"), 256u32.into());
        kv(
            &mut w,
            format!("{arch}.embedding_length"),
            (hidden as u32).into(),
        );
        kv(
            &mut w,
            format!("{arch}.feed_forward_length"),
            (ffn as u32).into(),
        );
        kv(
            &mut w,
            format!("{arch}.attention.head_count"),
            (heads as u32).into(),
        );
        kv(
            &mut w,
            format!("{arch}.attention.head_count_kv"),
            (kv_heads as u32).into(),
        );
        kv(
            &mut w,
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            1e-6f32.into(),
        );
        kv(&mut w, format!("{arch}.rope.freq_base"), 10000.0f32.into());
        kv(
            &mut w,
            "tokenizer.ggml.model".into(),
            spec.model.as_str().into(),
        );
        if let Some(pre) = &spec.pre {
            kv(&mut w, "tokenizer.ggml.pre".into(), pre.as_str().into());
        }
        kv(
            &mut w,
            "tokenizer.ggml.tokens".into(),
            GgufValue::Array(GgufArray::String(spec.tokens.clone())),
        );
        if let Some(types) = &spec.token_types {
            kv(
                &mut w,
                "tokenizer.ggml.token_type".into(),
                types.clone().into(),
            );
        }
        if let Some(scores) = &spec.scores {
            kv(
                &mut w,
                "tokenizer.ggml.scores".into(),
                scores.clone().into(),
            );
        }
        if !spec.merges.is_empty() {
            kv(
                &mut w,
                "tokenizer.ggml.merges".into(),
                GgufValue::Array(GgufArray::String(spec.merges.clone())),
            );
        }
        kv(&mut w, "tokenizer.ggml.bos_token_id".into(), 1u32.into());
        kv(&mut w, "tokenizer.ggml.eos_token_id".into(), 2u32.into());
        kv(
            &mut w,
            "tokenizer.ggml.add_bos_token".into(),
            spec.add_bos.into(),
        );
        kv(
            &mut w,
            "tokenizer.chat_template".into(),
            SEED_TEMPLATES[0].into(),
        );
        let mut tensors: Vec<(String, Vec<usize>, QType)> =
            vec![("token_embd.weight".into(), vec![hidden, vocab], matrix)];
        for i in 0..layers {
            let n = |r: &str| format!("blk.{i}.{r}");
            tensors.push((n("attn_norm.weight"), vec![hidden], QType::F32));
            tensors.push((n("attn_q.weight"), vec![hidden, heads * hd], matrix));
            tensors.push((n("attn_k.weight"), vec![hidden, kv_heads * hd], matrix));
            tensors.push((n("attn_v.weight"), vec![hidden, kv_heads * hd], matrix));
            if biases {
                tensors.push((n("attn_q.bias"), vec![heads * hd], QType::F32));
                tensors.push((n("attn_k.bias"), vec![kv_heads * hd], QType::F32));
                tensors.push((n("attn_v.bias"), vec![kv_heads * hd], QType::F32));
            }
            tensors.push((n("attn_output.weight"), vec![heads * hd, hidden], matrix));
            tensors.push((n("ffn_norm.weight"), vec![hidden], QType::F32));
            tensors.push((n("ffn_gate.weight"), vec![hidden, ffn], matrix));
            tensors.push((n("ffn_up.weight"), vec![hidden, ffn], matrix));
            tensors.push((n("ffn_down.weight"), vec![ffn, hidden], matrix));
        }
        tensors.push(("output_norm.weight".into(), vec![hidden], QType::F32));
        for (i, (name, dims, qtype)) in tensors.into_iter().enumerate() {
            let elements: usize = dims.iter().product();
            let values: Vec<f32> = (0..elements)
                .map(|j| (((i * 131 + j * 29) % 97) as f32 - 48.0) / 64.0)
                .collect();
            let mut data = vec![0u8; qtype.tensor_bytes(&dims).expect("whole blocks")];
            kiln_core::quant::quantize(qtype, &values, &mut data).expect("seed tensors quantise");
            w.add_tensor(name, qtype, dims, data).expect("valid tensor");
        }
        seeds.push(w.write_to(Vec::new()).expect("writes to memory"));
    }
    seeds
}

/// Seed texts for [`tokenizer`] (the first byte picks the tokenizer).
pub fn tokenizer_seeds() -> Vec<Vec<u8>> {
    let texts = [
        "Hello, world! The theater is at 12:30.",
        "<|im_start|>user\nhi<|im_end|>\n<tool> </s><s>",
        "  leading spaces\n\n\ttabs and\r\nnewlines   ",
        "日本語のテキストと emoji 🦀🔥 and é́ combining",
        "x = [1, 22, 333, 4444]; // code\n",
        "\u{0}\u{1}\u{7f}\u{ffff}",
    ];
    let mut seeds = Vec::new();
    for (i, t) in texts.iter().enumerate() {
        for pick in 0..tokenizers().len() {
            if (i + pick) % 2 == 0 {
                let mut s = vec![pick as u8];
                s.extend_from_slice(t.as_bytes());
                seeds.push(s);
            }
        }
    }
    seeds
}

/// Chat templates in the styles real files carry (ChatML, Llama 3, Mistral-like with
/// macros and `raise_exception`, a loop-heavy one), each with a user message.
pub const SEED_TEMPLATES: [&str; 4] = [
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}",
    "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\\n\\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\\n\\n' }}{% endif %}",
    "{% macro say(m) %}[{{ m.role | upper }}] {{ m.content }}{% endmacro %}{% if messages[0]['role'] != 'system' %}{{ raise_exception('system first') }}{% endif %}{% for m in messages %}{% if loop.index0 % 2 == 0 %}{{ say(m) }}{% else %}{{ m.content | tojson }}{% endif %}{% endfor %}{{ eos_token }}",
    "{% set ns = namespace(n=0) %}{% for m in messages %}{% for c in m.content %}{% set ns.n = ns.n + 1 %}{% endfor %}{% endfor %}{{ ns.n }}{{ messages | length }}{{ strftime_now('%Y') }}",
];

/// Seed inputs for [`chat_template`]: each seed template, a NUL, a message.
pub fn chat_template_seeds() -> Vec<Vec<u8>> {
    SEED_TEMPLATES
        .iter()
        .map(|t| {
            let mut s = t.as_bytes().to_vec();
            s.push(0);
            s.extend_from_slice("what is 2+2? {{ not a template }}".as_bytes());
            s
        })
        .collect()
}
