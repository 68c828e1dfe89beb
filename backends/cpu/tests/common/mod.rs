//! Random weights and tiny random models built in memory, for the CPU backend's tests.
#![allow(dead_code)]

use half::f16;
use kiln_core::{
    Activation, Architecture, LayerWeights, ModelConfig, ModelIr, ModelWeights, NormKind, QType,
    Rng, RopeConfig, RopeKind, SlidingWindow, TensorView,
};

/// Uniform in [lo, hi).
pub fn uniform(rng: &mut Rng, lo: f32, hi: f32) -> f32 {
    lo + (hi - lo) * rng.next_f32()
}

pub fn random_vec(rng: &mut Rng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| uniform(rng, -scale, scale)).collect()
}

fn put_f16(b: &mut [u8], at: usize, v: f32) {
    b[at..at + 2].copy_from_slice(&f16::from_f32(v).to_le_bytes());
}

/// Offsets of the f16 scale fields of a block (so random bytes get sane scales) and whether
/// the field is a min (kept positive, as quantisers produce).
fn scale_fields(q: QType) -> &'static [(usize, bool)] {
    match q {
        QType::Q4_0 | QType::Q5_0 | QType::Q8_0 | QType::AprQ4 => &[(0, false)],
        QType::Q4_1 | QType::Q5_1 => &[(0, false), (2, false)],
        QType::Q2_K => &[(80, false), (82, true)],
        QType::Q3_K => &[(108, false)],
        QType::Q4_K | QType::Q5_K => &[(0, false), (2, true)],
        QType::Q6_K => &[(208, false)],
        QType::IQ4_NL | QType::IQ4_XS => &[(0, false)],
        QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S => &[(0, false)],
        _ => &[],
    }
}

/// `rows` random rows of `cols` values of `qtype`: random bit patterns for the quantised
/// fields, scales drawn so values land in about ±`scale`.
pub fn random_bytes(rng: &mut Rng, qtype: QType, rows: usize, cols: usize, scale: f32) -> Vec<u8> {
    let n = rows * cols;
    match qtype {
        QType::F32 => random_vec(rng, n, scale)
            .iter()
            .flat_map(|v| v.to_le_bytes())
            .collect(),
        QType::F16 => random_vec(rng, n, scale)
            .iter()
            .flat_map(|v| f16::from_f32(*v).to_le_bytes())
            .collect(),
        QType::BF16 => random_vec(rng, n, scale)
            .iter()
            .flat_map(|v| half::bf16::from_f32(*v).to_le_bytes())
            .collect(),
        q => {
            let bytes = q.row_bytes(cols).unwrap() * rows;
            let mut out: Vec<u8> = (0..bytes).map(|_| rng.next_u64() as u8).collect();
            // A block's largest |value| is roughly scale-field × (largest quant × largest
            // sub-scale); divide so the row stays near ±scale.
            let span = match q {
                QType::Q4_0 | QType::Q4_1 | QType::AprQ4 => 8.0,
                QType::Q5_0 | QType::Q5_1 => 16.0,
                QType::Q8_0 => 128.0,
                QType::Q2_K => 3.0 * 15.0,
                QType::Q3_K => 4.0 * 32.0,
                QType::Q4_K => 15.0 * 63.0,
                QType::Q5_K => 31.0 * 63.0,
                QType::Q6_K => 32.0 * 128.0,
                QType::IQ4_NL => 127.0,
                QType::IQ4_XS => 32.0 * 127.0,
                QType::IQ2_XXS | QType::IQ2_XS | QType::IQ2_S => 15.5 * 0.25 * 43.0,
                QType::IQ3_XXS => 15.5 * 0.5 * 62.0,
                QType::IQ3_S => 31.0 * 15.0,
                QType::IQ1_S | QType::IQ1_M => 15.0 * 1.125,
                _ => 1.0,
            };
            for block in out.chunks_exact_mut(q.block_bytes()) {
                if q == QType::MXFP4 {
                    // The E8M0 exponent: scales 2^-9 .. 2^-2 (codes up to 6), values up
                    // to about ±1.5.
                    block[0] = 118 + (rng.next_u64() % 8) as u8;
                }
                if q == QType::IQ1_M {
                    // Its f16 scale is the top nibbles of the four scale words at 48.
                    let d = f16::from_f32(uniform(rng, -scale / span, scale / span)).to_bits();
                    for k in 0..4 {
                        let at = 48 + 2 * k;
                        let w = u16::from_le_bytes([block[at], block[at + 1]]);
                        let w = (w & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12);
                        block[at..at + 2].copy_from_slice(&w.to_le_bytes());
                    }
                }
                for &(at, is_min) in scale_fields(q) {
                    let v = if is_min {
                        uniform(rng, 0.0, scale / span)
                    } else {
                        uniform(rng, -scale / span, scale / span)
                    };
                    put_f16(block, at, v);
                }
            }
            out
        }
    }
}

pub fn matrix(
    rng: &mut Rng,
    name: &str,
    qtype: QType,
    cols: usize,
    rows: usize,
    scale: f32,
) -> TensorView {
    TensorView::from_bytes(
        name,
        qtype,
        vec![cols, rows],
        random_bytes(rng, qtype, rows, cols, scale),
    )
    .unwrap()
}

pub fn vector(name: &str, values: &[f32]) -> TensorView {
    TensorView::from_f32(name, vec![values.len()], values).unwrap()
}

pub fn norm_weights(rng: &mut Rng, name: &str, n: usize) -> TensorView {
    let v: Vec<f32> = (0..n).map(|_| uniform(rng, 0.8, 1.2)).collect();
    vector(name, &v)
}

/// Shape and flavour of a tiny test model.
#[derive(Clone, Debug)]
pub struct Spec {
    pub arch: Architecture,
    pub layers: usize,
    pub hidden: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub head_dim: usize,
    pub ffn: usize,
    pub vocab: usize,
    pub rope: RopeKind,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    pub gated: bool,
    pub norm: NormKind,
    pub activation: Activation,
    /// Matrix types, cycled through the layers' projections.
    pub qtypes: Vec<QType>,
    pub embd_qtype: QType,
    pub tied: bool,
    /// Gemma's: RMSNorm after attention and the MLP, a scaled embedding, a sliding window.
    pub sandwich_norms: bool,
    pub embedding_scale: f32,
    pub sliding_window: Option<SlidingWindow>,
}

impl Spec {
    /// Llama-shaped: 2 layers, hidden 64, 4 heads sharing 2 KV heads.
    pub fn llama() -> Spec {
        Spec {
            arch: Architecture::Llama,
            layers: 2,
            hidden: 64,
            heads: 4,
            kv_heads: 2,
            head_dim: 16,
            ffn: 128,
            vocab: 96,
            rope: RopeKind::Norm,
            qkv_bias: false,
            qk_norm: false,
            gated: true,
            norm: NormKind::Rms,
            activation: Activation::Silu,
            qtypes: vec![
                QType::Q4_1,
                QType::Q8_0,
                QType::Q4_0,
                QType::F16,
                QType::Q5_0,
                QType::Q5_1,
                QType::F32,
            ],
            embd_qtype: QType::Q8_0,
            tied: true,
            sandwich_norms: false,
            embedding_scale: 1.0,
            sliding_window: None,
        }
    }

    /// Gemma 3-style: 3 layers of which the first two attend over a window of 4 positions
    /// (local RoPE base 100), the third over everything; sandwich norms, GeGLU, per-head
    /// QK-norm, head_dim 32, embedding × √hidden, one KV head.
    pub fn gemma3() -> Spec {
        Spec {
            arch: Architecture::Gemma3,
            layers: 3,
            rope: RopeKind::Neox,
            head_dim: 32,
            kv_heads: 1,
            qk_norm: true,
            activation: Activation::Gelu,
            sandwich_norms: true,
            embedding_scale: 8.0,
            sliding_window: Some(SlidingWindow {
                window: 4,
                global_every: 3,
                local_theta: Some(100.0),
            }),
            ..Spec::llama()
        }
    }

    /// Qwen2-style: QKV biases, NEOX rope, separate LM head.
    pub fn qwen2() -> Spec {
        Spec {
            arch: Architecture::Qwen2,
            rope: RopeKind::Neox,
            qkv_bias: true,
            tied: false,
            ..Spec::llama()
        }
    }

    /// Qwen3-style: head_dim 32 with hidden 64 (q_dim 128 ≠ hidden), per-head QK-norm.
    pub fn qwen3() -> Spec {
        Spec {
            arch: Architecture::Qwen3,
            rope: RopeKind::Neox,
            head_dim: 32,
            qk_norm: true,
            ..Spec::llama()
        }
    }

    /// Hidden 256 so the K-quants fit, with one of each in the projections.
    pub fn kquants() -> Spec {
        Spec {
            hidden: 256,
            ffn: 512,
            head_dim: 64,
            qtypes: vec![
                QType::Q4_K,
                QType::Q6_K,
                QType::Q5_K,
                QType::Q3_K,
                QType::Q2_K,
                QType::BF16,
                QType::Q8_0,
            ],
            embd_qtype: QType::Q6_K,
            ..Spec::llama()
        }
    }

    /// Llama-shaped with APR Q4 in most projections and in the (tied) embedding / LM head.
    pub fn apr_q4() -> Spec {
        Spec {
            qtypes: vec![
                QType::AprQ4,
                QType::Q4_0,
                QType::AprQ4,
                QType::F16,
                QType::AprQ4,
                QType::Q8_0,
            ],
            embd_qtype: QType::AprQ4,
            ..Spec::llama()
        }
    }

    pub fn config(&self) -> ModelConfig {
        ModelConfig {
            arch: self.arch.clone(),
            vocab_size: self.vocab,
            hidden_size: self.hidden,
            num_layers: self.layers,
            num_heads: self.heads,
            num_kv_heads: self.kv_heads,
            head_dim: self.head_dim,
            ffn_size: self.ffn,
            norm: self.norm,
            activation: self.activation,
            rope: RopeConfig {
                kind: self.rope,
                rotary_dims: self.head_dim,
                ..RopeConfig::default()
            },
            tied_embeddings: self.tied,
            context_length: 256,
            embedding_scale: self.embedding_scale,
            sliding_window: self.sliding_window,
            ..ModelConfig::default()
        }
    }

    pub fn build(&self, seed: u64) -> ModelIr {
        let mut rng = Rng::new(seed);
        let c = self.config();
        let (h, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.ffn_size);
        let mut qi = 0;
        let mut next_q = || {
            qi += 1;
            self.qtypes[(qi - 1) % self.qtypes.len()]
        };
        let mut layers = Vec::new();
        for i in 0..self.layers {
            let p = |n: &str| format!("blk.{i}.{n}");
            let bias = |rng: &mut Rng, n: &str, len: usize| -> Option<TensorView> {
                self.qkv_bias
                    .then(|| vector(&p(n), &random_vec(rng, len, 0.2)))
            };
            let w_scale = 1.0 / (h as f32).sqrt() * 1.7;
            layers.push(LayerWeights {
                attn_norm: norm_weights(&mut rng, &p("attn_norm"), h),
                attn_norm_bias: None,
                attn_q: matrix(&mut rng, &p("attn_q"), next_q(), h, qd, w_scale),
                attn_k: matrix(&mut rng, &p("attn_k"), next_q(), h, kvd, w_scale),
                attn_v: matrix(&mut rng, &p("attn_v"), next_q(), h, kvd, w_scale),
                attn_q_bias: bias(&mut rng, "attn_q.bias", qd),
                attn_k_bias: bias(&mut rng, "attn_k.bias", kvd),
                attn_v_bias: bias(&mut rng, "attn_v.bias", kvd),
                attn_q_norm: self
                    .qk_norm
                    .then(|| norm_weights(&mut rng, &p("attn_q_norm"), c.head_dim)),
                attn_k_norm: self
                    .qk_norm
                    .then(|| norm_weights(&mut rng, &p("attn_k_norm"), c.head_dim)),
                attn_out: matrix(
                    &mut rng,
                    &p("attn_output"),
                    next_q(),
                    qd,
                    h,
                    1.0 / (qd as f32).sqrt(),
                ),
                attn_out_bias: None,
                attn_sinks: None,
                ffn_norm: Some(norm_weights(&mut rng, &p("ffn_norm"), h)),
                ffn_norm_bias: None,
                ffn_gate: self
                    .gated
                    .then(|| matrix(&mut rng, &p("ffn_gate"), next_q(), h, f, w_scale)),
                ffn_up: Some(matrix(&mut rng, &p("ffn_up"), next_q(), h, f, w_scale)),
                ffn_down: Some(matrix(
                    &mut rng,
                    &p("ffn_down"),
                    next_q(),
                    f,
                    h,
                    1.0 / (f as f32).sqrt(),
                )),
                experts: None,
                attn_post_norm: self
                    .sandwich_norms
                    .then(|| norm_weights(&mut rng, &p("post_attention_norm"), h)),
                ffn_post_norm: self
                    .sandwich_norms
                    .then(|| norm_weights(&mut rng, &p("post_ffw_norm"), h)),
            });
        }
        let weights = ModelWeights {
            token_embd: matrix(
                &mut rng,
                "token_embd",
                self.embd_qtype,
                h,
                c.vocab_size,
                1.0,
            ),
            layers,
            output_norm: norm_weights(&mut rng, "output_norm", h),
            output_norm_bias: None,
            output: (!self.tied)
                .then(|| matrix(&mut rng, "output", QType::Q8_0, h, c.vocab_size, 0.5)),
            rope_freqs: None,
        };
        ModelIr {
            config: c,
            weights,
            source: format!("random {:?} model", self.arch),
            program: None,
        }
    }
}

/// Largest |a−b| relative to the largest |b|.
pub fn rel_err(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(0.0f32, |m, v| m.max(v.abs())).max(1e-6);
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}
