//! The real SmolLM2-135M-Instruct Q4_1 file: parse, map into the IR, check every figure
//! against what the model card and the file's own header say.
//!
//! The file is not committed. It is found through `KILN_TEST_MODEL` or kiln's model cache;
//! when absent the test prints why and passes without checking anything.

use std::io::{Read, Seek, SeekFrom};
use std::path::PathBuf;

use kiln_core::{Architecture, QType, RopeKind, RopeScaling};
use kiln_formats::gguf::GgufFile;
use kiln_formats::model::{load_gguf, model_from_gguf};

const FILE_NAME: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

fn model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_TEST_MODEL") {
        return Some(PathBuf::from(p));
    }
    // Where the `kiln` binary caches its default model (the platform cache dir on Linux).
    let cache = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    let p = cache.join("kiln").join("models").join(FILE_NAME);
    p.exists().then_some(p)
}

fn open() -> Option<GgufFile> {
    let Some(path) = model_path() else {
        println!(
            "skipped: {FILE_NAME} not found (set KILN_TEST_MODEL or run `kiln` once to fetch it)"
        );
        return None;
    };
    Some(GgufFile::open(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display())))
}

#[test]
fn smollm2_header_and_metadata() {
    let Some(f) = open() else { return };
    assert_eq!(f.version(), 3);
    assert_eq!(f.file_len(), 98_362_432);
    assert_eq!(f.metadata().len(), 33);
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(f.alignment(), 32);
    // The header's size as the `gguf` Python package reports it.
    assert_eq!(f.data_offset(), 1_785_664);
    assert_eq!(f.architecture(), Some("llama"));
    assert_eq!(f.get_u64("llama.block_count"), Some(30));
    assert_eq!(f.get_f32("llama.rope.freq_base"), Some(100_000.0));
    assert_eq!(f.get_str("tokenizer.ggml.model"), Some("gpt2"));
    assert_eq!(f.get_str("tokenizer.ggml.pre"), Some("smollm"));
    let tokens = f.get_string_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(
        &tokens[..3],
        ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    );
    let merges = f.get_string_array("tokenizer.ggml.merges").unwrap();
    assert_eq!(merges.len(), 48900);
    assert_eq!(&merges[..3], ["Ġ t", "Ġ a", "i n"]);
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type").unwrap().len(),
        49152
    );
    assert_eq!(f.get_u64("tokenizer.ggml.bos_token_id"), Some(1));
    assert_eq!(f.get_u64("tokenizer.ggml.eos_token_id"), Some(2));
    assert!(f
        .get_str("tokenizer.chat_template")
        .unwrap()
        .contains("<|im_start|>"));
    // Metadata is in file order.
    assert_eq!(f.metadata()[0].0, "general.architecture");
    assert_eq!(f.metadata()[32].0, "general.quantization_version");
}

#[test]
fn smollm2_views_are_the_file_bytes() {
    let Some(f) = open() else { return };
    let path = model_path().unwrap();
    let mut raw = std::fs::File::open(path).unwrap();
    for name in [
        "token_embd.weight",
        "blk.17.attn_k.weight",
        "output_norm.weight",
    ] {
        let info = f.tensor(name).unwrap();
        let view = f.view(info).unwrap();
        let mut expected = vec![0u8; 256];
        raw.seek(SeekFrom::Start(f.data_offset() + info.offset))
            .unwrap();
        raw.read_exact(&mut expected).unwrap();
        assert_eq!(&view.bytes()[..256], expected.as_slice(), "{name}");
    }
}

#[test]
fn smollm2_maps_into_the_ir() {
    let Some(path) = model_path() else {
        println!(
            "skipped: {FILE_NAME} not found (set KILN_TEST_MODEL or run `kiln` once to fetch it)"
        );
        return;
    };
    let (f, ir) = load_gguf(&path).unwrap();
    let c = &ir.config;
    assert_eq!(c.arch, Architecture::Llama);
    assert_eq!(c.hidden_size, 576);
    assert_eq!(c.num_layers, 30);
    assert_eq!(c.num_heads, 9);
    assert_eq!(c.num_kv_heads, 3);
    assert_eq!(c.head_dim, 64);
    assert_eq!(c.vocab_size, 49152);
    assert_eq!(c.ffn_size, 1536);
    assert_eq!(c.context_length, 8192);
    assert_eq!(c.norm_eps, 1e-5);
    assert!(c.tied_embeddings);
    assert!(ir
        .weights
        .layers
        .iter()
        .all(|l| l.attn_q_bias.is_none() && l.attn_q_norm.is_none() && l.ffn_gate.is_some()));
    assert_eq!(c.rope.kind, RopeKind::Norm);
    assert_eq!(c.rope.theta, 100_000.0);
    assert_eq!(c.rope.rotary_dims, 64);
    assert_eq!(c.rope.scaling, RopeScaling::None);

    let w = &ir.weights;
    assert!(w.output.is_none() && w.rope_freqs.is_none());
    assert_eq!(w.lm_head().name(), "token_embd.weight");
    assert_eq!(w.token_embd.qtype(), QType::Q8_0);
    assert_eq!(w.token_embd.dims(), [576, 49152]);
    assert_eq!(w.layers.len(), 30);
    let l = &w.layers[29];
    assert_eq!(l.attn_q.dims(), [576, 576]);
    assert_eq!(l.attn_k.dims(), [576, 192]);
    assert_eq!(l.ffn_down.as_ref().unwrap().dims(), [1536, 576]);
    assert_eq!(l.attn_q.qtype(), QType::Q4_1);
    assert_eq!(l.attn_norm.qtype(), QType::F32);
    assert_eq!(ir.matrix_qtypes(), vec![QType::Q4_1, QType::Q8_0]);
    // Every tensor has exactly one role; parameters as the Python reader counts them.
    assert_eq!(w.tensors().len(), 272);
    assert_eq!(ir.parameters(), 134_515_008);
    assert!(ir.source.contains(FILE_NAME));

    // The RMSNorm weights are real numbers of a trained model, not garbage from a wrong offset.
    let norm = w.output_norm.to_f32().unwrap();
    assert!(norm.iter().all(|x| x.is_finite() && x.abs() < 100.0));
    assert!(norm.iter().any(|&x| x != 0.0));
    assert!(model_from_gguf(&f, "again").is_ok());
}
