//! What the GPU tests of this crate share: the device, small random models of each
//! architecture shape (weights drawn Gaussian and quantised by the reference quantisers),
//! and the cosine they are compared by.

#![allow(dead_code)] // each test binary uses its own subset

use std::sync::Arc;

use kiln_core::{
    Activation, Architecture, LayerWeights, ModelConfig, ModelIr, ModelWeights, NormKind, QType,
    Rng, RopeConfig, RopeKind, RopeScaling, TensorView,
};
use kiln_kernels::testdata::{gaussian_weights, random_vec};
use kiln_kernels::Device;

pub fn device() -> Option<Arc<Device>> {
    match kiln_kernels::unavailable_reason() {
        Some(why) => {
            kiln_kernels::testdata::skip(&why);
            None
        }
        None => Some(Device::new(0).expect("a driver and a device are present")),
    }
}

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
}

pub fn matrix(rng: &mut Rng, name: &str, q: QType, k: usize, n: usize) -> TensorView {
    let bytes = gaussian_weights(rng, q, k, n, 1.0 / (k as f32).sqrt()).unwrap();
    TensorView::from_bytes(name, q, vec![k, n], bytes).unwrap()
}

pub fn norm(rng: &mut Rng, name: &str, n: usize) -> TensorView {
    let v: Vec<f32> = (0..n).map(|_| 1.0 + 0.2 * (rng.next_f32() - 0.5)).collect();
    TensorView::from_f32(name, vec![n], &v).unwrap()
}

pub fn model(rng: &mut Rng, s: &Shape, context_length: usize) -> ModelIr {
    let (h, qd, kvd) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let [tq, tv, tg, td, te] = s.types;
    let mut layers = Vec::new();
    for i in 0..s.layers {
        let bias = |rng: &mut Rng, n: usize| {
            s.qkv_bias
                .then(|| TensorView::from_f32("b", vec![n], &random_vec(rng, n, 0.5)).unwrap())
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
            ffn_norm: Some(norm(rng, "ffn_norm", h)),
            ffn_norm_bias: None,
            ffn_gate: Some(matrix(rng, &format!("{i}.gate"), tg, h, s.ffn)),
            ffn_up: matrix(rng, &format!("{i}.up"), tg, h, s.ffn),
            ffn_down: matrix(rng, &format!("{i}.down"), td, s.ffn, h),
        });
    }
    let token_embd = {
        // Tied: the embedding is also the LM head, so it is scaled like one.
        let std = if s.tied { 1.0 / (h as f32).sqrt() } else { 1.0 };
        let bytes = gaussian_weights(rng, te, h, s.vocab, std).unwrap();
        TensorView::from_bytes("token_embd", te, vec![h, s.vocab], bytes).unwrap()
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
        norm: NormKind::Rms,
        norm_eps: 1e-5,
        activation: Activation::Silu,
        gated_ffn: true,
        parallel_residual: false,
        qkv_bias: s.qkv_bias,
        qk_norm: s.qk_norm,
        rope: RopeConfig {
            kind: s.rope,
            theta: 10000.0,
            scaling: RopeScaling::None,
            rotary_dims: s.head_dim,
        },
        tied_embeddings: s.tied,
        context_length,
    };
    ModelIr {
        config,
        weights,
        source: "random test model".into(),
    }
}

pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let na: f64 = a.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    dot / (na * nb)
}

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
            },
        ),
    ]
}
