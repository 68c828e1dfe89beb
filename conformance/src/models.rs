//! Small random models of each architecture shape the IR describes, built in memory:
//! weights drawn Gaussian and quantised by the reference quantisers
//! ([`kiln_core::testdata::gaussian_weights`]), norms near 1, biases small. The conformance
//! suite runs every backend on them; the GPU parity tests use them too.

use kiln_core::testdata::{gaussian_weights, random_vec};
use kiln_core::{
    Activation, Architecture, ExpertConfig, ExpertTensors, ExpertWeights, LayerWeights,
    ModelConfig, ModelIr, ModelWeights, QType, Rng, RopeConfig, RopeKind, SlidingWindow,
    TensorView,
};

/// The hyper-parameters and weight types of one synthetic model.
pub struct Shape {
    pub arch: Architecture,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub layers: usize,
    pub rope: RopeKind,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub tied: bool,
    /// (attention Q/K/O, V, FFN gate/up, down, LM head / embedding)
    pub types: [QType; 5],
    /// A Mixture of Experts in place of every layer's feed-forward (its experts' gate/up
    /// and down in the FFN types, the router in f32).
    pub experts: Option<ExpertConfig>,
}

/// A `[k, n]` matrix (n rows of k values) ~ N(0, 1/k), quantised to `q`.
pub fn matrix(rng: &mut Rng, name: &str, q: QType, k: usize, n: usize) -> TensorView {
    let bytes = gaussian_weights(rng, q, k, n, 1.0 / (k as f32).sqrt())
        .expect("a quantisable type and row length");
    TensorView::from_bytes(name, q, vec![k, n], bytes).expect("sized by the quantiser")
}

/// `count` experts' `[k, n]` matrices stacked into one `[k, n, count]` tensor, each
/// ~ N(0, 1/k) in `q`.
fn stacked(rng: &mut Rng, name: &str, q: QType, k: usize, n: usize, count: usize) -> ExpertTensors {
    let bytes = gaussian_weights(rng, q, k, n * count, 1.0 / (k as f32).sqrt())
        .expect("a quantisable type and row length");
    ExpertTensors::Stacked(
        TensorView::from_bytes(name, q, vec![k, n, count], bytes).expect("sized by the quantiser"),
    )
}

/// A norm weight vector of `n` values near 1.
pub fn norm(rng: &mut Rng, name: &str, n: usize) -> TensorView {
    let v: Vec<f32> = (0..n).map(|_| 1.0 + 0.2 * (rng.next_f32() - 0.5)).collect();
    TensorView::from_f32(name, vec![n], &v).expect("f32 vector")
}

/// The window of a Gemma 3 shape's local layers: short, so a suite's few dozen tokens
/// cross it.
pub const GEMMA3_WINDOW: usize = 8;

/// A random model of shape `s` that claims a context of `context_length`. A Gemma 3 shape
/// (which needs `qk_norm`) also gets the rest of Gemma 3: norms after attention and the
/// MLP, a window of [`GEMMA3_WINDOW`] positions on all but every second layer (those rotate
/// with their own base), GELU, and an embedding scaled by √hidden.
pub fn model(rng: &mut Rng, s: &Shape, context_length: usize) -> ModelIr {
    let gemma3 = s.arch == Architecture::Gemma3;
    let (h, qd, kvd) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let [tq, tv, tg, td, te] = s.types;
    let dense = s.experts.is_none();
    let mut layers = Vec::new();
    for i in 0..s.layers {
        let bias = |rng: &mut Rng, n: usize| {
            s.qkv_bias.then(|| {
                TensorView::from_f32("b", vec![n], &random_vec(rng, n, 0.5)).expect("f32 vector")
            })
        };
        layers.push(LayerWeights {
            attn_norm: norm(rng, "attn_norm", h),
            attn_norm_bias: None,
            attn_q: matrix(rng, &format!("{i}.q"), tq, h, qd),
            attn_k: matrix(rng, &format!("{i}.k"), tq, h, kvd),
            attn_v: matrix(rng, &format!("{i}.v"), tv, h, kvd),
            attn_q_bias: bias(rng, qd),
            attn_k_bias: bias(rng, kvd),
            attn_v_bias: bias(rng, kvd),
            attn_q_norm: s.qk_norm.then(|| norm(rng, "q_norm", s.head_dim)),
            attn_k_norm: s.qk_norm.then(|| norm(rng, "k_norm", s.head_dim)),
            attn_out: matrix(rng, &format!("{i}.o"), tq, qd, h),
            attn_out_bias: None,
            attn_sinks: None,
            ffn_norm: Some(norm(rng, "ffn_norm", h)),
            ffn_norm_bias: None,
            ffn_gate: dense.then(|| matrix(rng, &format!("{i}.gate"), tg, h, s.ffn)),
            ffn_up: dense.then(|| matrix(rng, &format!("{i}.up"), tg, h, s.ffn)),
            ffn_down: dense.then(|| matrix(rng, &format!("{i}.down"), td, s.ffn, h)),
            experts: s.experts.map(|e| ExpertWeights {
                router: matrix(rng, &format!("{i}.router"), QType::F32, h, e.count),
                gate: stacked(rng, &format!("{i}.gate_exps"), tg, h, e.ffn_size, e.count),
                up: stacked(rng, &format!("{i}.up_exps"), tg, h, e.ffn_size, e.count),
                down: stacked(rng, &format!("{i}.down_exps"), td, e.ffn_size, h, e.count),
                biases: None,
            }),
            attn_post_norm: gemma3.then(|| norm(rng, "post_attention_norm", h)),
            ffn_post_norm: gemma3.then(|| norm(rng, "post_ffw_norm", h)),
        });
    }
    let token_embd = {
        // Tied: the embedding is also the LM head, so it is scaled like one.
        let std = if s.tied { 1.0 / (h as f32).sqrt() } else { 1.0 };
        let bytes =
            gaussian_weights(rng, te, h, s.vocab, std).expect("a quantisable type and row length");
        TensorView::from_bytes("token_embd", te, vec![h, s.vocab], bytes)
            .expect("sized by the quantiser")
    };
    let weights = ModelWeights {
        token_embd,
        layers,
        output_norm: norm(rng, "output_norm", h),
        output_norm_bias: None,
        output: (!s.tied).then(|| matrix(rng, "output", te, h, s.vocab)),
        rope_freqs: None,
    };
    let config = ModelConfig {
        arch: s.arch.clone(),
        vocab_size: s.vocab,
        hidden_size: h,
        num_layers: s.layers,
        num_heads: s.heads,
        num_kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        ffn_size: s.ffn,
        rope: RopeConfig {
            kind: s.rope,
            rotary_dims: s.head_dim,
            ..RopeConfig::default()
        },
        tied_embeddings: s.tied,
        context_length,
        experts: s.experts,
        ..ModelConfig::default()
    };
    let config = match gemma3 {
        false => config,
        true => ModelConfig {
            activation: Activation::Gelu,
            embedding_scale: (h as f32).sqrt(),
            sliding_window: Some(SlidingWindow {
                window: GEMMA3_WINDOW,
                global_every: 2,
                local_theta: Some(1e4),
            }),
            rope: RopeConfig {
                theta: 1e6,
                ..config.rope
            },
            ..config
        },
    };
    ModelIr {
        config,
        weights,
        source: "random test model".into(),
        program: None,
    }
}

/// Cosine similarity of two vectors, accumulated in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let na: f64 = a.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    dot / (na * nb)
}

/// The three shapes of the GPU parity tests: llama with a K-quant mix and an untied head;
/// qwen2 with QKV biases at hidden 576 (not a multiple of 256, so legacy types) and a tied
/// head; qwen3 with QK-norm and head_dim 128 ≠ hidden / heads, tied F16 head.
pub fn shapes() -> Vec<(&'static str, Shape)> {
    use QType::*;
    vec![
        (
            "llama, Q4_K_M-like mix",
            Shape {
                arch: Architecture::Llama,
                hidden: 512,
                heads: 8,
                kv_heads: 2,
                head_dim: 64,
                ffn: 1536,
                vocab: 3000,
                layers: 3,
                rope: RopeKind::Norm,
                qkv_bias: false,
                qk_norm: false,
                tied: false,
                types: [Q4_K, Q6_K, Q4_K, Q6_K, Q6_K],
                experts: None,
            },
        ),
        (
            "qwen2, bias, hidden 576 (legacy types)",
            Shape {
                arch: Architecture::Qwen2,
                hidden: 576,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
                ffn: 1536,
                vocab: 2000,
                layers: 2,
                rope: RopeKind::Neox,
                qkv_bias: true,
                qk_norm: false,
                tied: true,
                types: [Q5_0, Q8_0, Q4_1, Q5_1, Q8_0],
                experts: None,
            },
        ),
        (
            "qwen3, QK-norm, head_dim 128 != hidden / heads",
            Shape {
                arch: Architecture::Qwen3,
                hidden: 512,
                heads: 8,
                kv_heads: 4,
                head_dim: 128,
                ffn: 1024,
                vocab: 2500,
                layers: 2,
                rope: RopeKind::Neox,
                qkv_bias: false,
                qk_norm: true,
                tied: true,
                types: [Q5_K, Q8_0, Q4_0, Q6_K, F16],
                experts: None,
            },
        ),
    ]
}

/// What the conformance suite runs: [`shapes`], a small Gemma 3 (sliding windows, sandwich
/// norms, QK-norm, GELU, a scaled embedding: the shape that reaches a plugin only as a
/// program), a small Qwen3-MoE (eight experts, two a token, K-quant experts), then a small llama of the plainest types (Q8_0 matrices, F16 embedding and
/// untied head) that a backend with only a few kernels can still take.
pub fn suite_shapes() -> Vec<(&'static str, Shape)> {
    let mut all = shapes();
    all.push((
        "gemma3, windows and sandwich norms, small",
        Shape {
            arch: Architecture::Gemma3,
            hidden: 256,
            heads: 4,
            kv_heads: 1,
            head_dim: 64,
            ffn: 512,
            vocab: 1024,
            layers: 2,
            rope: RopeKind::Neox,
            qkv_bias: false,
            qk_norm: true,
            tied: true,
            types: [
                QType::Q8_0,
                QType::Q8_0,
                QType::Q8_0,
                QType::Q8_0,
                QType::Q8_0,
            ],
            experts: None,
        },
    ));
    all.push((
        "qwen3moe, 8 experts (2 a token), small",
        Shape {
            arch: Architecture::Qwen3Moe,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ffn: 256,
            vocab: 1024,
            layers: 2,
            rope: RopeKind::Neox,
            qkv_bias: false,
            qk_norm: true,
            tied: true,
            types: [
                QType::Q8_0,
                QType::Q8_0,
                QType::Q4_K,
                QType::Q6_K,
                QType::Q8_0,
            ],
            experts: Some(ExpertConfig {
                count: 8,
                used: 2,
                ffn_size: 256,
                normalize_weights: true,
            }),
        },
    ));
    all.push((
        "llama, Q8_0 with an F16 head, small",
        Shape {
            arch: Architecture::Llama,
            hidden: 256,
            heads: 4,
            kv_heads: 2,
            head_dim: 64,
            ffn: 512,
            vocab: 1024,
            layers: 2,
            rope: RopeKind::Norm,
            qkv_bias: false,
            qk_norm: false,
            tied: false,
            types: [
                QType::Q8_0,
                QType::Q8_0,
                QType::Q8_0,
                QType::Q8_0,
                QType::F16,
            ],
            experts: None,
        },
    ));
    all
}

/// One line about a shape for reports: architecture, layers, hidden size, head and types.
pub fn describe(s: &Shape) -> String {
    let types: Vec<&str> = s.types.iter().map(|q| q.name()).collect();
    format!(
        "{}, {} layers, hidden {}, {}/{} heads × {}, vocab {}, {} head, {}{}{}",
        s.arch.name(),
        s.layers,
        s.hidden,
        s.heads,
        s.kv_heads,
        s.head_dim,
        s.vocab,
        if s.tied { "tied" } else { "untied" },
        types.join("/"),
        if s.qkv_bias { ", QKV bias" } else { "" },
        if s.qk_norm { ", QK-norm" } else { "" },
    ) + if s.arch == Architecture::Gemma3 {
        ", sliding window, sandwich norms, GELU"
    } else {
        ""
    } + &s.experts.map_or(String::new(), |e| {
        format!(
            ", {} experts of {} ({} a token)",
            e.count, e.ffn_size, e.used
        )
    })
}
