//! GGUF → IR mapping on small synthetic models written with `GgufWriter`: the Qwen3 shape
//! (head_dim ≠ hidden/heads, per-head QK-norm), Qwen2 biases, fused QKV, tied and untied
//! heads, and every way a file can disagree with its own config.

use std::sync::Arc;

use kiln_core::{
    Architecture, Backend, Error, LayerExecutor, LoadOptions, ModelIr, QType, Registry, RopeKind,
    RopeScaling, Support,
};
use kiln_formats::gguf::{GgufFile, GgufValue, GgufWriter};
use kiln_formats::model::{config_from_gguf, dispatch, model_from_gguf};

#[derive(Clone)]
struct Spec {
    arch: &'static str,
    layers: usize,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    /// Written as `{arch}.attention.key_length` when set.
    key_length: Option<usize>,
    ffn: usize,
    vocab: usize,
    vocab_key: bool,
    biases: bool,
    fused_bias: bool,
    qk_norm: bool,
    fused_qkv: bool,
    tied: bool,
    matrix_qtype: QType,
    extra_meta: Vec<(&'static str, GgufValue)>,
    /// Tensor names to leave out, and (name, dims) to write instead of the right shape.
    omit: Vec<String>,
    reshape: Vec<(String, Vec<usize>)>,
    extra_tensors: Vec<(String, Vec<usize>)>,
}

impl Spec {
    fn llama() -> Spec {
        Spec {
            arch: "llama",
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            key_length: None,
            ffn: 96,
            vocab: 40,
            vocab_key: true,
            biases: false,
            fused_bias: false,
            qk_norm: false,
            fused_qkv: false,
            tied: true,
            matrix_qtype: QType::F32,
            extra_meta: vec![],
            omit: vec![],
            reshape: vec![],
            extra_tensors: vec![],
        }
    }
    fn qwen3() -> Spec {
        // head_dim 32 with 4 heads: q_dim 128 is twice the hidden size, as in Qwen3.
        Spec {
            arch: "qwen3",
            key_length: Some(32),
            qk_norm: true,
            tied: false,
            vocab_key: false,
            ..Spec::llama()
        }
    }
    fn qwen2() -> Spec {
        Spec {
            arch: "qwen2",
            biases: true,
            matrix_qtype: QType::Q8_0,
            ..Spec::llama()
        }
    }
    fn head_dim(&self) -> usize {
        self.key_length.unwrap_or(self.hidden / self.heads)
    }

    /// Every tensor's name and dims, in the order llama.cpp's converter writes them.
    fn tensors(&self) -> Vec<(String, Vec<usize>, bool)> {
        let (h, q, kv, f) = (
            self.hidden,
            self.heads * self.head_dim(),
            self.kv_heads * self.head_dim(),
            self.ffn,
        );
        let mut t = vec![("token_embd.weight".to_string(), vec![h, self.vocab], true)];
        for i in 0..self.layers {
            let n = |r: &str| format!("blk.{i}.{r}");
            t.push((n("attn_norm.weight"), vec![h], false));
            if self.fused_qkv {
                t.push((n("attn_qkv.weight"), vec![h, q + 2 * kv], true));
            } else {
                t.push((n("attn_q.weight"), vec![h, q], true));
                t.push((n("attn_k.weight"), vec![h, kv], true));
                t.push((n("attn_v.weight"), vec![h, kv], true));
            }
            if self.fused_bias {
                t.push((n("attn_qkv.bias"), vec![q + 2 * kv], false));
            } else if self.biases {
                t.push((n("attn_q.bias"), vec![q], false));
                t.push((n("attn_k.bias"), vec![kv], false));
                t.push((n("attn_v.bias"), vec![kv], false));
            }
            if self.qk_norm {
                t.push((n("attn_q_norm.weight"), vec![self.head_dim()], false));
                t.push((n("attn_k_norm.weight"), vec![self.head_dim()], false));
            }
            t.push((n("attn_output.weight"), vec![q, h], true));
            t.push((n("ffn_norm.weight"), vec![h], false));
            t.push((n("ffn_gate.weight"), vec![h, f], true));
            t.push((n("ffn_up.weight"), vec![h, f], true));
            t.push((n("ffn_down.weight"), vec![f, h], true));
        }
        t.push(("output_norm.weight".to_string(), vec![h], false));
        if !self.tied {
            t.push(("output.weight".to_string(), vec![h, self.vocab], true));
        }
        t.retain(|(name, _, _)| !self.omit.contains(name));
        for (name, dims, _) in &mut t {
            if let Some((_, d)) = self.reshape.iter().find(|(n, _)| n == name) {
                *dims = d.clone();
            }
        }
        t.extend(
            self.extra_tensors
                .iter()
                .map(|(n, d)| (n.clone(), d.clone(), false)),
        );
        t
    }

    fn write(&self) -> GgufFile {
        let a = self.arch;
        let mut w = GgufWriter::new();
        w.add_kv("general.architecture", a).unwrap();
        w.add_kv(format!("{a}.block_count"), self.layers as u32)
            .unwrap();
        w.add_kv(format!("{a}.context_length"), 4096u32).unwrap();
        w.add_kv(format!("{a}.embedding_length"), self.hidden as u32)
            .unwrap();
        w.add_kv(format!("{a}.feed_forward_length"), self.ffn as u32)
            .unwrap();
        w.add_kv(format!("{a}.attention.head_count"), self.heads as u32)
            .unwrap();
        w.add_kv(format!("{a}.attention.head_count_kv"), self.kv_heads as u32)
            .unwrap();
        w.add_kv(format!("{a}.attention.layer_norm_rms_epsilon"), 1e-6f32)
            .unwrap();
        w.add_kv(format!("{a}.rope.freq_base"), 1_000_000.0f32)
            .unwrap();
        if let Some(k) = self.key_length {
            w.add_kv(format!("{a}.attention.key_length"), k as u32)
                .unwrap();
            w.add_kv(format!("{a}.attention.value_length"), k as u32)
                .unwrap();
        }
        if self.vocab_key {
            w.add_kv(format!("{a}.vocab_size"), self.vocab as u32)
                .unwrap();
        }
        let tokens: Vec<String> = (0..self.vocab).map(|i| format!("tok{i}")).collect();
        w.add_kv("tokenizer.ggml.tokens", tokens).unwrap();
        for (k, v) in &self.extra_meta {
            w.add_kv(*k, v.clone()).unwrap();
        }
        for (idx, (name, dims, matrix)) in self.tensors().into_iter().enumerate() {
            let qtype = if matrix {
                self.matrix_qtype
            } else {
                QType::F32
            };
            let n = qtype.tensor_bytes(&dims).unwrap();
            // Distinct bytes per tensor so views can be told apart.
            let data = (0..n).map(|j| (idx * 31 + j * 7) as u8).collect();
            w.add_tensor(name, qtype, dims, data).unwrap();
        }
        GgufFile::from_storage(Arc::new(w.write_to(Vec::new()).unwrap())).unwrap()
    }

    fn map(&self) -> Result<ModelIr, Error> {
        model_from_gguf(&self.write(), &format!("synthetic {}", self.arch))
    }
}

fn format_err(r: Result<ModelIr, Error>) -> String {
    match r {
        Err(Error::Format(m)) => m,
        other => panic!("expected a format error, got {other:?}"),
    }
}

#[test]
fn qwen3_has_explicit_head_dim_and_qk_norm() {
    let spec = Spec::qwen3();
    let f = spec.write();
    let ir = model_from_gguf(&f, "qwen3 test").unwrap();
    let c = &ir.config;
    assert_eq!(c.arch, Architecture::Qwen3);
    assert_eq!(
        (c.hidden_size, c.num_heads, c.num_kv_heads, c.head_dim),
        (64, 4, 2, 32)
    );
    assert_ne!(c.head_dim, c.hidden_size / c.num_heads);
    assert_eq!((c.q_dim(), c.kv_dim()), (128, 64));
    assert!(!c.tied_embeddings);
    assert!(ir
        .weights
        .layers
        .iter()
        .all(|l| l.attn_q_norm.is_some() && l.attn_q_bias.is_none()));
    assert_eq!(
        c.vocab_size, 40,
        "taken from token_embd when the key is absent"
    );
    assert_eq!(c.rope.kind, RopeKind::Neox);
    assert_eq!(c.rope.theta, 1_000_000.0);
    assert_eq!(c.rope.rotary_dims, 32);
    assert_eq!(c.norm_eps, 1e-6);
    assert_eq!(c.context_length, 4096);
    let l = &ir.weights.layers[1];
    assert_eq!(l.attn_q.dims(), [64, 128]);
    assert_eq!(l.attn_k.dims(), [64, 64]);
    assert_eq!(l.attn_out.dims(), [128, 64]);
    assert_eq!(l.attn_q_norm.as_ref().unwrap().dims(), [32]);
    assert_eq!(
        l.attn_k_norm.as_ref().unwrap().name(),
        "blk.1.attn_k_norm.weight"
    );
    assert!(ir.weights.output.is_some());
    // Each role views exactly the bytes of its tensor in the file.
    for t in ir.weights.tensors() {
        let info = f.tensor(t.name()).unwrap();
        assert_eq!(t.bytes(), f.view(info).unwrap().bytes(), "{}", t.name());
    }
    assert_eq!(ir.weights.tensors().len(), f.tensors().len());
}

#[test]
fn qwen2_maps_qkv_biases() {
    let f = Spec::qwen2().write();
    let ir = model_from_gguf(&f, "qwen2 test").unwrap();
    assert_eq!(ir.config.arch, Architecture::Qwen2);
    assert!(ir.config.tied_embeddings);
    assert!(ir.weights.layers.iter().all(|l| l.attn_q_norm.is_none()));
    assert_eq!(ir.config.rope.kind, RopeKind::Neox);
    assert_eq!(ir.config.head_dim, 16);
    for (i, l) in ir.weights.layers.iter().enumerate() {
        let qb = l.attn_q_bias.as_ref().unwrap();
        assert_eq!(qb.dims(), [64]);
        assert_eq!(
            qb.bytes(),
            f.view_by_name(&format!("blk.{i}.attn_q.bias"))
                .unwrap()
                .unwrap()
                .bytes()
        );
        assert_eq!(l.attn_k_bias.as_ref().unwrap().dims(), [32]);
        assert_eq!(l.attn_v_bias.as_ref().unwrap().dims(), [32]);
        assert_eq!(l.attn_q.qtype(), QType::Q8_0);
    }
    assert_eq!(ir.matrix_qtypes(), vec![QType::Q8_0]);
    assert!(ir.weights.output.is_none());
    assert_eq!(ir.weights.lm_head().name(), "token_embd.weight");
}

#[test]
fn fused_qkv_and_fused_bias_split_without_copying() {
    let spec = Spec {
        arch: "qwen2",
        fused_qkv: true,
        fused_bias: true,
        biases: true,
        matrix_qtype: QType::Q8_0,
        ..Spec::llama()
    };
    let f = spec.write();
    let ir = model_from_gguf(&f, "fused").unwrap();
    let fused = f.view_by_name("blk.0.attn_qkv.weight").unwrap().unwrap();
    let fused_bias = f.view_by_name("blk.0.attn_qkv.bias").unwrap().unwrap();
    let l = &ir.weights.layers[0];
    let (q, kv) = (64, 32);
    let row = fused.row_bytes();
    for (view, start, count) in [
        (&l.attn_q, 0, q),
        (&l.attn_k, q, kv),
        (&l.attn_v, q + kv, kv),
    ] {
        assert_eq!(view.dims(), [64, count]);
        assert_eq!(
            view.bytes(),
            &fused.bytes()[start * row..(start + count) * row]
        );
        assert_eq!(
            view.bytes().as_ptr(),
            fused.bytes()[start * row..].as_ptr(),
            "zero-copy"
        );
    }
    assert_eq!(l.attn_q.name(), "blk.0.attn_q.weight");
    let fb = fused_bias.to_f32().unwrap();
    assert_eq!(l.attn_q_bias.as_ref().unwrap().to_f32().unwrap(), fb[..q]);
    assert_eq!(
        l.attn_k_bias.as_ref().unwrap().to_f32().unwrap(),
        fb[q..q + kv]
    );
    assert_eq!(
        l.attn_v_bias.as_ref().unwrap().to_f32().unwrap(),
        fb[q + kv..]
    );

    let bad = Spec {
        reshape: vec![("blk.1.attn_qkv.weight".into(), vec![64, 127])],
        ..spec
    };
    let m = format_err(bad.map());
    assert!(
        m.contains("blk.1.attn_qkv.weight") && m.contains("[64, 128]") && m.contains("[64, 127]"),
        "{m}"
    );
}

#[test]
fn llama_and_mistral_use_norm_rope_and_untied_heads() {
    let ir = Spec {
        tied: false,
        ..Spec::llama()
    }
    .map()
    .unwrap();
    assert_eq!(ir.config.rope.kind, RopeKind::Norm);
    assert!(!ir.config.tied_embeddings);
    assert_eq!(ir.weights.lm_head().name(), "output.weight");
    assert_eq!(ir.config.rope.scaling, RopeScaling::None);
    let ir = Spec {
        arch: "mistral",
        ..Spec::llama()
    }
    .map()
    .unwrap();
    assert_eq!(ir.config.arch, Architecture::Mistral);
    assert_eq!(ir.config.rope.kind, RopeKind::Norm);
    assert_eq!(
        ir.parameters(),
        40 * 64 + 64 + 2 * (64 + 64 * 64 + 2 * 64 * 32 + 64 * 64 + 64 + 3 * 64 * 96)
    );
}

#[test]
fn rope_scaling_and_freq_factors() {
    let spec = Spec {
        extra_meta: vec![
            ("llama.rope.scaling.type", "linear".into()),
            ("llama.rope.scaling.factor", 4.0f32.into()),
            ("llama.rope.dimension_count", 8u32.into()),
        ],
        extra_tensors: vec![("rope_freqs.weight".into(), vec![4])],
        ..Spec::llama()
    };
    let ir = spec.map().unwrap();
    assert_eq!(ir.config.rope.scaling, RopeScaling::Linear { factor: 4.0 });
    assert_eq!(ir.config.rope.rotary_dims, 8);
    assert_eq!(ir.weights.rope_freqs.as_ref().unwrap().dims(), [4]);

    // YaRN, with llama.cpp's keys; betas and the attention multiplier default as in
    // llama.cpp and transformers.
    let yarn = |extra: Vec<(&'static str, GgufValue)>| {
        let mut meta = vec![("llama.rope.scaling.type", "yarn".into())];
        meta.extend(extra);
        Spec {
            extra_meta: meta,
            ..Spec::llama()
        }
        .map()
    };
    let ir = yarn(vec![
        ("llama.rope.scaling.factor", 4.0f32.into()),
        (
            "llama.rope.scaling.original_context_length",
            32768u32.into(),
        ),
    ])
    .unwrap();
    assert_eq!(
        ir.config.rope.scaling,
        RopeScaling::Yarn {
            factor: 4.0,
            original_context: 32768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: 1.0 + 0.1 * 4.0f32.ln(),
            truncate: true,
        }
    );
    let scale = ir.config.attention_scale() * (ir.config.head_dim as f32).sqrt();
    assert!(
        (scale - (1.0 + 0.1 * 4.0f32.ln()).powi(2)).abs() < 1e-6,
        "{scale}"
    );
    let ir = yarn(vec![
        ("llama.rope.scaling.factor", 8.0f32.into()),
        ("llama.rope.scaling.original_context_length", 4096u32.into()),
        ("llama.rope.scaling.yarn_beta_fast", 16.0f32.into()),
        ("llama.rope.scaling.yarn_beta_slow", 2.0f32.into()),
        ("llama.rope.scaling.yarn_attn_factor", 0.5f32.into()),
    ])
    .unwrap();
    assert!(matches!(
        ir.config.rope.scaling,
        RopeScaling::Yarn { beta_fast: 16.0, beta_slow: 2.0, attn_factor, .. } if (attn_factor - 0.5 * (1.0 + 0.1 * 8.0f32.ln())).abs() < 1e-6
    ));
    let m = format_err(yarn(vec![(
        "llama.rope.scaling.original_context_length",
        4096u32.into(),
    )]));
    assert!(m.contains("YaRN") && m.contains("factor"), "{m}");
    let m = format_err(yarn(vec![("llama.rope.scaling.factor", 4.0f32.into())]));
    assert!(m.contains("original_context_length"), "{m}");
    let r = yarn(vec![
        ("llama.rope.scaling.factor", 4.0f32.into()),
        ("llama.rope.scaling.original_context_length", 4096u32.into()),
        ("llama.rope.scaling.yarn_ext_factor", 0.5f32.into()),
    ]);
    assert!(
        matches!(r, Err(Error::Unsupported(ref m)) if m.contains("yarn_ext_factor")),
        "{r:?}"
    );
    let r = yarn(vec![
        ("llama.rope.scaling.factor", 4.0f32.into()),
        ("llama.rope.scaling.original_context_length", 4096u32.into()),
        ("llama.rope.scaling.yarn_beta_slow", (-1.0f32).into()),
    ]);
    assert!(r.is_err(), "a negative beta is refused");
    let r = Spec {
        extra_meta: vec![("llama.rope.scaling.type", "longrope".into())],
        ..Spec::llama()
    }
    .map();
    assert!(
        matches!(r, Err(Error::Unsupported(ref m)) if m.contains("longrope")),
        "{r:?}"
    );
    let wrong = Spec {
        extra_meta: vec![("llama.rope.dimension_count", 8u32.into())],
        extra_tensors: vec![("rope_freqs.weight".into(), vec![8])],
        ..Spec::llama()
    };
    let m = format_err(wrong.map());
    assert!(m.contains("rope_freqs.weight") && m.contains("[4]"), "{m}");
}

#[test]
fn unknown_architecture_is_unsupported_by_name() {
    let r = Spec {
        arch: "gpt-neox",
        ..Spec::llama()
    }
    .map();
    assert!(
        matches!(r, Err(Error::Unsupported(ref m)) if m.contains("gpt-neox") && m.contains("qwen3")),
        "{r:?}"
    );
}

#[test]
fn shape_mismatches_name_tensor_and_dims() {
    let cases: Vec<(&str, Vec<usize>, &str)> = vec![
        ("blk.1.attn_k.weight", vec![64, 48], "[64, 32]"),
        ("token_embd.weight", vec![64, 41], "[64, 40]"),
        ("blk.0.ffn_down.weight", vec![64, 96], "[96, 64]"),
        ("output_norm.weight", vec![64, 1], "[64]"),
        ("blk.0.attn_norm.weight", vec![32], "[64]"),
    ];
    for (name, dims, expected) in cases {
        let spec = Spec {
            reshape: vec![(name.to_string(), dims.clone())],
            ..Spec::llama()
        };
        let m = format_err(spec.map());
        assert!(
            m.contains(name) && m.contains(expected) && m.contains(&format!("{dims:?}")),
            "{m}"
        );
    }
    // Qwen3's norms are per head, not per hidden unit.
    let spec = Spec {
        reshape: vec![("blk.0.attn_q_norm.weight".into(), vec![64])],
        ..Spec::qwen3()
    };
    let m = format_err(spec.map());
    assert!(m.contains("attn_q_norm") && m.contains("[32]"), "{m}");
}

#[test]
fn missing_and_surplus_pieces_are_refused() {
    let m = format_err(
        Spec {
            omit: vec!["blk.1.ffn_up.weight".into()],
            ..Spec::llama()
        }
        .map(),
    );
    assert!(
        m.contains("blk.1.ffn_up.weight") && m.contains("missing"),
        "{m}"
    );
    let m = format_err(
        Spec {
            omit: vec!["blk.1.attn_v.bias".into()],
            ..Spec::qwen2()
        }
        .map(),
    );
    assert!(m.contains("layer 1"), "{m}");
    let m = format_err(
        Spec {
            omit: vec!["blk.0.attn_q_norm.weight".into()],
            ..Spec::qwen3()
        }
        .map(),
    );
    assert!(m.contains("attn_q_norm"), "{m}");
    // What an architecture needs is its builder's to say, and is said at open.
    let m = format_err(
        Spec {
            qk_norm: false,
            ..Spec::qwen3()
        }
        .map(),
    );
    assert!(
        m.contains("layer 0: a qwen3 model needs per-head Q and K norms"),
        "{m}"
    );
    let m = format_err(
        Spec {
            omit: vec![
                "blk.0.attn_q.bias".into(),
                "blk.0.attn_k.bias".into(),
                "blk.0.attn_v.bias".into(),
            ],
            ..Spec::qwen2()
        }
        .map(),
    );
    assert!(m.contains("layer 0 has 0 of the 3 Q/K/V biases"), "{m}");
    // A tensor kiln would ignore would change the model: refused by name.
    let r = Spec {
        extra_tensors: vec![("blk.0.ffn_up.bias".into(), vec![96])],
        ..Spec::llama()
    }
    .map();
    assert!(
        matches!(r, Err(Error::Unsupported(ref m)) if m.contains("blk.0.ffn_up.bias")),
        "{r:?}"
    );
    let r = Spec {
        extra_tensors: vec![("blk.2.attn_norm.weight".into(), vec![64])],
        ..Spec::llama()
    }
    .map();
    assert!(
        matches!(r, Err(Error::Unsupported(ref m)) if m.contains("blk.2")),
        "{r:?}"
    );
}

#[test]
fn inconsistent_metadata_is_refused() {
    // Heads that do not divide the hidden size, with no explicit head size.
    let m = format_err(
        Spec {
            heads: 5,
            kv_heads: 5,
            hidden: 64,
            ..Spec::llama()
        }
        .map(),
    );
    assert!(m.contains("5 heads"), "{m}");
    // KV heads must divide heads.
    let m = format_err(
        Spec {
            heads: 4,
            kv_heads: 3,
            key_length: Some(16),
            ..Spec::llama()
        }
        .map(),
    );
    assert!(m.contains("4 heads") && m.contains("3 KV heads"), "{m}");
    // A float where a count belongs.
    let mut f = Spec::llama();
    f.extra_meta
        .push(("llama.attention.key_length", 16.5f32.into()));
    let m = format_err(f.map());
    assert!(m.contains("llama.attention.key_length"), "{m}");
    // A required key missing.
    let mut w = GgufWriter::new();
    w.add_kv("general.architecture", "llama").unwrap();
    w.add_kv("llama.block_count", 1u32).unwrap();
    let f = GgufFile::from_storage(Arc::new(w.write_to(Vec::new()).unwrap())).unwrap();
    assert!(
        matches!(config_from_gguf(&f), Err(Error::Format(m)) if m.contains("llama.embedding_length"))
    );
    let f =
        GgufFile::from_storage(Arc::new(GgufWriter::new().write_to(Vec::new()).unwrap())).unwrap();
    assert!(
        matches!(config_from_gguf(&f), Err(Error::Format(m)) if m.contains("general.architecture"))
    );
}

/// A backend that accepts models whose matrices are all of one qtype.
struct Fake {
    name: &'static str,
    qtype: QType,
    score: u32,
    present: bool,
}

impl Backend for Fake {
    fn name(&self) -> &str {
        self.name
    }
    fn description(&self) -> &str {
        "test backend"
    }
    fn qtypes(&self) -> Vec<QType> {
        vec![self.qtype]
    }
    fn probe(&self) -> Result<String, String> {
        if self.present {
            Ok("test device".into())
        } else {
            Err("no test device".into())
        }
    }
    fn supports(&self, model: &ModelIr) -> Support {
        if model.matrix_qtypes() == [self.qtype] {
            Support::Yes {
                score: self.score,
                note: String::new(),
            }
        } else {
            Support::No {
                reason: format!("only {}", self.qtype),
            }
        }
    }
    fn load(&self, _: &ModelIr, _: &LoadOptions) -> kiln_core::Result<Box<dyn LayerExecutor>> {
        Err(Error::Unsupported("test backend does not load".into()))
    }
}

#[test]
fn dispatch_picks_the_backend_matching_the_qtype() {
    let mut reg = Registry::new();
    for b in [
        Fake {
            name: "fake-f32",
            qtype: QType::F32,
            score: 100,
            present: true,
        },
        Fake {
            name: "fake-q8",
            qtype: QType::Q8_0,
            score: 100,
            present: true,
        },
        Fake {
            name: "fake-q8-absent",
            qtype: QType::Q8_0,
            score: 500,
            present: false,
        },
    ] {
        reg.register(Arc::new(b)).unwrap();
    }
    let q8 = Spec::qwen2().map().unwrap();
    let (chosen, ranked) = dispatch(&q8, &reg, None).unwrap();
    assert_eq!(chosen.name(), "fake-q8");
    assert_eq!(ranked[0].name, "fake-q8");
    assert!(ranked
        .iter()
        .find(|c| c.name == "fake-f32")
        .unwrap()
        .refusal()
        .unwrap()
        .contains("only f32"));
    assert!(ranked
        .iter()
        .find(|c| c.name == "fake-q8-absent")
        .unwrap()
        .refusal()
        .unwrap()
        .contains("no test device"));

    let f32 = Spec::llama().map().unwrap();
    assert_eq!(dispatch(&f32, &reg, None).unwrap().0.name(), "fake-f32");
    assert!(
        matches!(dispatch(&f32, &reg, Some("fake-q8")), Err(Error::NoBackend(m)) if m.contains("only q8_0"))
    );
    assert!(matches!(
        dispatch(&f32, &reg, Some("nope")),
        Err(Error::NoBackend(_))
    ));
}
