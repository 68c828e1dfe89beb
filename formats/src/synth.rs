//! `kiln synth`: random-weight models with the exact shapes, metadata and tokenizer layout
//! of real ones, for benchmarks and GPU tests that cannot ship gigabytes of weights.
//!
//! Each [`Preset`] copies a real model's hyper-parameters (vocabulary size included: the
//! LM head is a large share of a small model's bytes and time). The tokenizer is a GPT-2
//! byte-level vocabulary of the real size: the model's special tokens at their real ids,
//! the 256 byte tokens, and merge-free filler tokens, so text round-trips through kiln's
//! tokenizer even though the filler pieces are never produced by encoding.
//!
//! Weights are drawn the way a trained model's are scaled, so activations stay finite and
//! non-degenerate through every layer: norm weights ≈ 1, projections ~ N(0, 1/fan_in),
//! the token embedding ~ N(0, 1) (N(0, 1/hidden) when it is also the LM head, so logits
//! are O(1)), biases small. Each row is generated from its own seed (xoshiro256++ seeded
//! by SplitMix64 from the seed, the tensor and the row; Box–Muller normals) and quantised
//! straight to the type [`crate::quantize::plan_types`] gives it, in parallel, so the
//! f32 model never exists in memory and the bytes do not depend on the thread count.

use std::io::Write;
use std::path::Path;

use kiln_core::{quant, Architecture, Error, QType, Result};

use crate::gguf::{GgufArray, GgufValue, GgufWriter};
use crate::quantize::{
    plan_types, write_atomically, Progress, ProgressEvent, Recipe, RowSource, TensorDesc,
    TensorEncoder, FILE_TYPE_KEY, QUANTIZATION_VERSION_KEY,
};

/// A real model whose shapes [`synth_file`] reproduces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    SmolLm2_135m,
    Llama32_1b,
    Llama3_8b,
    Llama31_8b,
    Qwen25_0_5b,
    Qwen25_1_5b,
    Qwen25_7b,
    Qwen3_0_6b,
    Qwen3_8b,
    Gemma3_270m,
    Qwen3_30bA3b,
    Mixtral8x7b,
    Qwen3Moe7bA2b,
    Qwen3MoeSmall,
    GptOss20b,
    GptOss120b,
}

/// Which tokenizer family a preset imitates (special tokens, pre-tokenizer, template).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum TokenizerKind {
    SmolLm,
    Llama3,
    Qwen,
    Gemma,
    /// gpt-oss's o200k "harmony" tokenizer.
    Harmony,
}

/// The hyper-parameters of a preset, as written to the GGUF metadata.
#[derive(Debug, Clone, PartialEq)]
pub struct SynthShape {
    pub arch: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub ffn_size: usize,
    pub context_length: usize,
    pub rope_theta: f32,
    pub norm_eps: f32,
    pub tied_embeddings: bool,
    pub qkv_bias: bool,
    pub qk_norm: bool,
    /// Llama 3.1-style rope scaling `(factor, low_freq_factor, high_freq_factor,
    /// original_context)`, stored as per-pair `rope_freqs.weight` as llama.cpp does.
    pub llama3_rope: Option<(f32, f32, f32, usize)>,
    /// Gemma 3: the sliding window of its local layers (they also get post-attention and
    /// post-MLP norms, GeGLU and the scaled embedding from the architecture).
    pub sliding_window: Option<usize>,
    /// A Mixture of Experts in place of every layer's dense feed-forward.
    pub experts: Option<SynthExperts>,
    /// YaRN rope scaling `(factor, original_context)`.
    pub yarn: Option<(f32, usize)>,
}

/// A preset's Mixture of Experts: `count` experts a layer, `used` a token, each a gated
/// feed-forward of `ffn_size`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthExperts {
    pub count: usize,
    pub used: usize,
    pub ffn_size: usize,
}

impl Preset {
    pub const ALL: [Preset; 16] = [
        Preset::SmolLm2_135m,
        Preset::Llama32_1b,
        Preset::Llama3_8b,
        Preset::Llama31_8b,
        Preset::Qwen25_0_5b,
        Preset::Qwen25_1_5b,
        Preset::Qwen25_7b,
        Preset::Qwen3_0_6b,
        Preset::Qwen3_8b,
        Preset::Gemma3_270m,
        Preset::Qwen3_30bA3b,
        Preset::Mixtral8x7b,
        Preset::Qwen3Moe7bA2b,
        Preset::Qwen3MoeSmall,
        Preset::GptOss20b,
        Preset::GptOss120b,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Preset::SmolLm2_135m => "smollm2-135m",
            Preset::Llama32_1b => "llama3.2-1b",
            Preset::Llama3_8b => "llama3-8b",
            Preset::Llama31_8b => "llama3.1-8b",
            Preset::Qwen25_0_5b => "qwen2.5-0.5b",
            Preset::Qwen25_1_5b => "qwen2.5-1.5b",
            Preset::Qwen25_7b => "qwen2.5-7b",
            Preset::Qwen3_0_6b => "qwen3-0.6b",
            Preset::Qwen3_8b => "qwen3-8b",
            Preset::Gemma3_270m => "gemma3-270m",
            Preset::Qwen3_30bA3b => "qwen3-30b-a3b",
            Preset::Mixtral8x7b => "mixtral-8x7b",
            Preset::Qwen3Moe7bA2b => "qwen3moe-7b-a2b",
            Preset::Qwen3MoeSmall => "qwen3moe-small",
            Preset::GptOss20b => "gpt-oss-20b",
            Preset::GptOss120b => "gpt-oss-120b",
        }
    }

    /// Parses a preset name (case-insensitive); an unknown name lists the known ones.
    pub fn from_name(name: &str) -> Result<Preset> {
        let lower = name.to_ascii_lowercase();
        Preset::ALL
            .iter()
            .copied()
            .find(|p| p.name() == lower)
            .ok_or_else(|| {
                let known: Vec<&str> = Preset::ALL.iter().map(|p| p.name()).collect();
                Error::InvalidArgument(format!(
                    "unknown shape '{name}' (known: {})",
                    known.join(", ")
                ))
            })
    }

    fn tokenizer(self) -> TokenizerKind {
        match self {
            Preset::SmolLm2_135m => TokenizerKind::SmolLm,
            Preset::Llama32_1b | Preset::Llama3_8b | Preset::Llama31_8b => TokenizerKind::Llama3,
            Preset::Gemma3_270m => TokenizerKind::Gemma,
            // Mixtral's 32,000-token SentencePiece vocabulary has its specials at 0-2, where
            // the SmolLM family's are.
            Preset::Mixtral8x7b => TokenizerKind::SmolLm,
            Preset::GptOss20b | Preset::GptOss120b => TokenizerKind::Harmony,
            _ => TokenizerKind::Qwen,
        }
    }

    /// The real model's hyper-parameters (from each model's published `config.json`).
    pub fn shape(self) -> SynthShape {
        let llama = |vocab, hidden, layers, heads, kv, ffn, ctx, theta, tied| SynthShape {
            arch: Architecture::Llama,
            vocab_size: vocab,
            hidden_size: hidden,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: hidden / heads,
            ffn_size: ffn,
            context_length: ctx,
            rope_theta: theta,
            norm_eps: 1e-5,
            tied_embeddings: tied,
            qkv_bias: false,
            qk_norm: false,
            llama3_rope: None,
            sliding_window: None,
            experts: None,
            yarn: None,
        };
        let qwen2 = |vocab, hidden, layers, heads, kv, ffn, tied| SynthShape {
            arch: Architecture::Qwen2,
            vocab_size: vocab,
            hidden_size: hidden,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: hidden / heads,
            ffn_size: ffn,
            context_length: 32768,
            rope_theta: 1_000_000.0,
            norm_eps: 1e-6,
            tied_embeddings: tied,
            qkv_bias: true,
            qk_norm: false,
            llama3_rope: None,
            sliding_window: None,
            experts: None,
            yarn: None,
        };
        let qwen3 = |hidden, layers, heads, kv, ffn, tied| SynthShape {
            arch: Architecture::Qwen3,
            vocab_size: 151_936,
            hidden_size: hidden,
            num_layers: layers,
            num_heads: heads,
            num_kv_heads: kv,
            head_dim: 128,
            ffn_size: ffn,
            context_length: 40960,
            rope_theta: 1_000_000.0,
            norm_eps: 1e-6,
            tied_embeddings: tied,
            qkv_bias: false,
            qk_norm: true,
            llama3_rope: None,
            sliding_window: None,
            experts: None,
            yarn: None,
        };
        // gpt-oss (its config.json): 64 query heads and 8 KV heads of 64 over hidden 2,880,
        // biases, a window of 128 on every other layer, YaRN ×32 over 4,096 positions.
        let gpt_oss = |layers, experts| SynthShape {
            arch: Architecture::GptOss,
            vocab_size: 201_088,
            hidden_size: 2880,
            num_layers: layers,
            num_heads: 64,
            num_kv_heads: 8,
            head_dim: 64,
            ffn_size: 2880,
            context_length: 131_072,
            rope_theta: 150_000.0,
            norm_eps: 1e-5,
            tied_embeddings: false,
            qkv_bias: true,
            qk_norm: false,
            llama3_rope: None,
            sliding_window: Some(128),
            experts: Some(SynthExperts {
                count: experts,
                used: 4,
                ffn_size: 2880,
            }),
            yarn: Some((32.0, 4096)),
        };
        match self {
            Preset::SmolLm2_135m => llama(49_152, 576, 30, 9, 3, 1536, 8192, 100_000.0, true),
            Preset::Llama32_1b => SynthShape {
                llama3_rope: Some((32.0, 1.0, 4.0, 8192)),
                ..llama(128_256, 2048, 16, 32, 8, 8192, 131_072, 500_000.0, true)
            },
            Preset::Llama3_8b => llama(128_256, 4096, 32, 32, 8, 14_336, 8192, 500_000.0, false),
            // Llama-3.1-8B: Llama-3-8B's tensors with a 131,072-token context by rope scaling.
            Preset::Llama31_8b => SynthShape {
                llama3_rope: Some((8.0, 1.0, 4.0, 8192)),
                ..llama(128_256, 4096, 32, 32, 8, 14_336, 131_072, 500_000.0, false)
            },
            Preset::Qwen25_0_5b => qwen2(151_936, 896, 24, 14, 2, 4864, true),
            Preset::Qwen25_1_5b => qwen2(151_936, 1536, 28, 12, 2, 8960, true),
            Preset::Qwen25_7b => SynthShape {
                context_length: 131_072,
                ..qwen2(152_064, 3584, 28, 28, 4, 18_944, false)
            },
            Preset::Qwen3_0_6b => qwen3(1024, 28, 16, 8, 3072, true),
            Preset::Qwen3_8b => qwen3(4096, 36, 32, 8, 12_288, false),
            // google/gemma-3-270m: 4 heads of 256 over hidden 640, one KV head, window 512.
            Preset::Gemma3_270m => SynthShape {
                arch: Architecture::Gemma3,
                vocab_size: 262_144,
                hidden_size: 640,
                num_layers: 18,
                num_heads: 4,
                num_kv_heads: 1,
                head_dim: 256,
                ffn_size: 2048,
                context_length: 32_768,
                rope_theta: 1_000_000.0,
                norm_eps: 1e-6,
                tied_embeddings: true,
                qkv_bias: false,
                qk_norm: true,
                llama3_rope: None,
                sliding_window: Some(512),
                experts: None,
                yarn: None,
            },
            // Qwen/Qwen3-30B-A3B: Qwen3's attention, 128 experts of 768 (8 a token) in every
            // layer.
            Preset::Qwen3_30bA3b => SynthShape {
                arch: Architecture::Qwen3Moe,
                experts: Some(SynthExperts {
                    count: 128,
                    used: 8,
                    ffn_size: 768,
                }),
                ..qwen3(2048, 48, 32, 4, 6144, false)
            },
            // mistralai/Mixtral-8x7B-v0.1: a llama file with 8 experts of 14,336 (2 a token).
            Preset::Mixtral8x7b => SynthShape {
                experts: Some(SynthExperts {
                    count: 8,
                    used: 2,
                    ffn_size: 14_336,
                }),
                ..llama(32_000, 4096, 32, 32, 8, 14_336, 32_768, 1_000_000.0, false)
            },
            // Not a released model: Qwen3-MoE's layout at 4.4 GB in q4_k_m (7.2 B parameters,
            // 1.6 B of them a token), for CPU work beside llama.cpp.
            Preset::Qwen3Moe7bA2b => SynthShape {
                arch: Architecture::Qwen3Moe,
                experts: Some(SynthExperts {
                    count: 64,
                    used: 8,
                    ffn_size: 1024,
                }),
                ..qwen3(2048, 16, 16, 4, 6144, false)
            },
            // Not a released model: Qwen3-MoE's routing (64 experts, 8 a token) in 8 layers of
            // hidden 1,024, ~0.6 GB in q4_k_m: the GPU parity tests' MoE, made in seconds.
            Preset::Qwen3MoeSmall => SynthShape {
                arch: Architecture::Qwen3Moe,
                experts: Some(SynthExperts {
                    count: 64,
                    used: 8,
                    ffn_size: 512,
                }),
                ..qwen3(1024, 8, 8, 2, 3072, false)
            },
            // openai/gpt-oss-20b: 24 layers, 32 experts of 2,880 (4 a token).
            Preset::GptOss20b => gpt_oss(24, 32),
            // openai/gpt-oss-120b: 36 layers, 128 experts.
            Preset::GptOss120b => gpt_oss(36, 128),
        }
    }
}

/// How one tensor's values are drawn.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Init {
    /// N(mean, std²).
    Normal { mean: f32, std: f32 },
    /// Given values (rope frequency factors).
    Fixed,
}

struct SynthTensor {
    desc: TensorDesc,
    init: Init,
    fixed: Vec<f32>,
}

/// The tensor table of `preset` in f32 (before the recipe picks types), in the order
/// llama.cpp's converter writes them.
fn tensors(shape: &SynthShape) -> Vec<SynthTensor> {
    let s = shape;
    let (h, q_dim, kv_dim, ffn) = (
        s.hidden_size,
        s.num_heads * s.head_dim,
        s.num_kv_heads * s.head_dim,
        s.ffn_size,
    );
    let proj = |fan_in: usize| Init::Normal {
        mean: 0.0,
        std: 1.0 / (fan_in as f32).sqrt(),
    };
    let norm = Init::Normal {
        mean: 1.0,
        std: 0.02,
    };
    let bias = Init::Normal {
        mean: 0.0,
        std: 0.1,
    };
    let mut out = Vec::new();
    let mut push = |name: String, dims: Vec<usize>, init: Init| {
        out.push(SynthTensor {
            desc: TensorDesc {
                name,
                dims,
                qtype: QType::F32,
            },
            init,
            fixed: Vec::new(),
        });
    };
    let embd_std = if s.tied_embeddings {
        1.0 / (h as f32).sqrt()
    } else {
        1.0
    };
    push(
        "token_embd.weight".into(),
        vec![h, s.vocab_size],
        Init::Normal {
            mean: 0.0,
            std: embd_std,
        },
    );
    for i in 0..s.num_layers {
        let n = |role: &str| format!("blk.{i}.{role}");
        push(n("attn_norm.weight"), vec![h], norm);
        push(n("attn_q.weight"), vec![h, q_dim], proj(h));
        push(n("attn_k.weight"), vec![h, kv_dim], proj(h));
        push(n("attn_v.weight"), vec![h, kv_dim], proj(h));
        if s.qkv_bias {
            push(n("attn_q.bias"), vec![q_dim], bias);
            push(n("attn_k.bias"), vec![kv_dim], bias);
            push(n("attn_v.bias"), vec![kv_dim], bias);
        }
        if s.qk_norm {
            push(n("attn_q_norm.weight"), vec![s.head_dim], norm);
            push(n("attn_k_norm.weight"), vec![s.head_dim], norm);
        }
        push(n("attn_output.weight"), vec![q_dim, h], proj(q_dim));
        let gemma3 = s.arch == Architecture::Gemma3;
        let gpt_oss = s.arch == Architecture::GptOss;
        if gpt_oss {
            push(n("attn_output.bias"), vec![h], bias);
            push(
                n("attn_sinks.weight"),
                vec![s.num_heads],
                Init::Normal {
                    mean: 0.0,
                    std: 1.0,
                },
            );
        }
        if gemma3 {
            push(n("post_attention_norm.weight"), vec![h], norm);
        }
        // gpt-oss's feed-forward norm has llama.cpp's post-attention name.
        match gpt_oss {
            true => push(n("post_attention_norm.weight"), vec![h], norm),
            false => push(n("ffn_norm.weight"), vec![h], norm),
        }
        match s.experts {
            None => {
                push(n("ffn_gate.weight"), vec![h, ffn], proj(h));
                push(n("ffn_up.weight"), vec![h, ffn], proj(h));
                push(n("ffn_down.weight"), vec![ffn, h], proj(ffn));
            }
            Some(e) => {
                push(n("ffn_gate_inp.weight"), vec![h, e.count], proj(h));
                push(
                    n("ffn_gate_exps.weight"),
                    vec![h, e.ffn_size, e.count],
                    proj(h),
                );
                push(
                    n("ffn_up_exps.weight"),
                    vec![h, e.ffn_size, e.count],
                    proj(h),
                );
                push(
                    n("ffn_down_exps.weight"),
                    vec![e.ffn_size, h, e.count],
                    proj(e.ffn_size),
                );
                if gpt_oss {
                    push(n("ffn_gate_inp.bias"), vec![e.count], bias);
                    push(n("ffn_gate_exps.bias"), vec![e.ffn_size, e.count], bias);
                    push(n("ffn_up_exps.bias"), vec![e.ffn_size, e.count], bias);
                    push(n("ffn_down_exps.bias"), vec![h, e.count], bias);
                }
            }
        }
        if gemma3 {
            push(n("post_ffw_norm.weight"), vec![h], norm);
        }
    }
    push("output_norm.weight".into(), vec![h], norm);
    if !s.tied_embeddings {
        push("output.weight".into(), vec![h, s.vocab_size], proj(h));
    }
    if let Some((factor, low, high, original)) = s.llama3_rope {
        let factors = llama3_rope_factors(s.head_dim, s.rope_theta, factor, low, high, original);
        out.push(SynthTensor {
            desc: TensorDesc {
                name: "rope_freqs.weight".into(),
                dims: vec![factors.len()],
                qtype: QType::F32,
            },
            init: Init::Fixed,
            fixed: factors,
        });
    }
    out
}

/// Llama 3.1 rope scaling as llama.cpp's converter stores it: a divisor of each rotary
/// pair's frequency (1 for high frequencies, `factor` for low, interpolated between).
fn llama3_rope_factors(
    head_dim: usize,
    theta: f32,
    factor: f32,
    low: f32,
    high: f32,
    original: usize,
) -> Vec<f32> {
    let low_wavelen = original as f32 / low;
    let high_wavelen = original as f32 / high;
    (0..head_dim / 2)
        .map(|i| {
            let freq = 1.0 / theta.powf((2 * i) as f32 / head_dim as f32);
            let wavelen = 2.0 * std::f32::consts::PI / freq;
            if wavelen < high_wavelen {
                1.0
            } else if wavelen > low_wavelen {
                factor
            } else {
                let smooth = (original as f32 / wavelen - low) / (high - low);
                1.0 / ((1.0 - smooth) / factor + smooth)
            }
        })
        .collect()
}

/// The tensor names, dims and types `preset` gets under `recipe` (no data): what
/// [`synth_file`] will write.
pub fn plan(preset: Preset, recipe: Recipe) -> Vec<TensorDesc> {
    let shape = preset.shape();
    let descs: Vec<TensorDesc> = tensors(&shape).into_iter().map(|t| t.desc).collect();
    let types = plan_types(recipe, &descs, shape.num_layers);
    descs
        .into_iter()
        .zip(types)
        .map(|(d, qtype)| TensorDesc { qtype, ..d })
        .collect()
}

/// Bytes of the tensor data `preset` has under `recipe`.
pub fn data_bytes(preset: Preset, recipe: Recipe) -> Result<u64> {
    plan(preset, recipe).iter().try_fold(0u64, |acc, t| {
        Ok(acc + t.qtype.tensor_bytes(&t.dims)? as u64)
    })
}

/// Every metadata entry of a synthetic `preset` file: hyper-parameters, tokenizer, chat
/// template, file type.
pub fn metadata(preset: Preset, recipe: Recipe, seed: u64) -> Vec<(String, GgufValue)> {
    let s = preset.shape();
    let arch = s.arch.name();
    let mut kv: Vec<(String, GgufValue)> = Vec::new();
    let mut put = |k: &str, v: GgufValue| kv.push((k.to_string(), v));
    put("general.architecture", arch.into());
    put(
        "general.name",
        format!("kiln synthetic {} (seed {seed})", preset.name())
            .as_str()
            .into(),
    );
    put(FILE_TYPE_KEY, GgufValue::U32(recipe.file_type()));
    put(QUANTIZATION_VERSION_KEY, GgufValue::U32(2));
    let a = |k: &str| format!("{arch}.{k}");
    put(&a("vocab_size"), GgufValue::U32(s.vocab_size as u32));
    put(
        &a("context_length"),
        GgufValue::U32(s.context_length as u32),
    );
    put(&a("embedding_length"), GgufValue::U32(s.hidden_size as u32));
    put(&a("block_count"), GgufValue::U32(s.num_layers as u32));
    put(&a("feed_forward_length"), GgufValue::U32(s.ffn_size as u32));
    put(
        &a("attention.head_count"),
        GgufValue::U32(s.num_heads as u32),
    );
    put(
        &a("attention.head_count_kv"),
        GgufValue::U32(s.num_kv_heads as u32),
    );
    if s.head_dim * s.num_heads != s.hidden_size {
        put(
            &a("attention.key_length"),
            GgufValue::U32(s.head_dim as u32),
        );
        put(
            &a("attention.value_length"),
            GgufValue::U32(s.head_dim as u32),
        );
    }
    put(&a("rope.freq_base"), GgufValue::F32(s.rope_theta));
    put(
        &a("rope.dimension_count"),
        GgufValue::U32(s.head_dim as u32),
    );
    put(
        &a("attention.layer_norm_rms_epsilon"),
        GgufValue::F32(s.norm_eps),
    );
    if let Some(w) = s.sliding_window {
        put(&a("attention.sliding_window"), GgufValue::U32(w as u32));
    }
    if let Some((factor, original)) = s.yarn {
        put(&a("rope.scaling.type"), "yarn".into());
        put(&a("rope.scaling.factor"), GgufValue::F32(factor));
        put(
            &a("rope.scaling.original_context_length"),
            GgufValue::U32(original as u32),
        );
    }
    if let Some(e) = s.experts {
        put(&a("expert_count"), GgufValue::U32(e.count as u32));
        put(&a("expert_used_count"), GgufValue::U32(e.used as u32));
        // llama.cpp's converter writes the expert width for Qwen3-MoE and gpt-oss;
        // Mixtral's is its `feed_forward_length`.
        if matches!(s.arch, Architecture::Qwen3Moe | Architecture::GptOss) {
            put(
                &a("expert_feed_forward_length"),
                GgufValue::U32(e.ffn_size as u32),
            );
        }
    }
    tokenizer_metadata(preset.tokenizer(), s.vocab_size, &mut put);
    kv
}

/// GPT-2's byte ↔ printable-char map (the byte-level BPE alphabet).
fn byte_level_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return b as char;
    }
    let rank = (0..b).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + rank).expect("U+0100..U+0143 are chars")
}

const CHATML_TEMPLATE: &str = "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";
const GEMMA_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}";
/// Harmony's message framing without its system preamble or channels (a benchmark file's
/// prompts need only the tokens).
const HARMONY_TEMPLATE: &str = "{% for message in messages %}{{ '<|start|>' + message['role'] + '<|message|>' + message['content'] + '<|end|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start|>assistant' }}{% endif %}";
const LLAMA3_TEMPLATE: &str = "{{ bos_token }}{% for message in messages %}{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' }}{% endfor %}{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}";

/// A tokenizer family's special tokens `(id, piece)` at the ids the real tokenizer uses,
/// its pre-tokenizer name, BOS, EOS, EOT and chat template.
type TokenizerFamily = (
    Vec<(usize, String)>,
    &'static str,
    usize,
    usize,
    Option<usize>,
    &'static str,
);

fn tokenizer_metadata(kind: TokenizerKind, vocab: usize, put: &mut impl FnMut(&str, GgufValue)) {
    let (specials, pre, bos, eos, eot, template): TokenizerFamily = match kind {
        TokenizerKind::SmolLm => {
            let names = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
            (
                names
                    .iter()
                    .enumerate()
                    .map(|(i, n)| (i, n.to_string()))
                    .collect(),
                "smollm",
                1,
                2,
                None,
                CHATML_TEMPLATE,
            )
        }
        TokenizerKind::Llama3 => {
            let named = [
                (128_000, "<|begin_of_text|>"),
                (128_001, "<|end_of_text|>"),
                (128_006, "<|start_header_id|>"),
                (128_007, "<|end_header_id|>"),
                (128_009, "<|eot_id|>"),
            ];
            let specials = (128_000..vocab)
                .map(|id| match named.iter().find(|(i, _)| *i == id) {
                    Some((_, n)) => (id, n.to_string()),
                    None => (id, format!("<|reserved_special_token_{}|>", id - 128_000)),
                })
                .collect();
            (
                specials,
                "llama-bpe",
                128_000,
                128_001,
                Some(128_009),
                LLAMA3_TEMPLATE,
            )
        }
        TokenizerKind::Qwen => {
            let named = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];
            // Qwen's embedding is padded past the tokenizer; the GGUF names the padding.
            let specials = (151_643..vocab)
                .map(|id| match named.get(id - 151_643) {
                    Some(n) => (id, n.to_string()),
                    None => (id, format!("[PAD{id}]")),
                })
                .collect();
            (specials, "qwen2", 151_643, 151_645, None, CHATML_TEMPLATE)
        }
        TokenizerKind::Gemma => {
            // Gemma's ids for its specials; the rest of the vocabulary is byte-level filler
            // (the real one is SentencePiece, which a benchmark's random weights don't need).
            let named = [
                (0, "<pad>"),
                (1, "<eos>"),
                (2, "<bos>"),
                (3, "<unk>"),
                (105, "<start_of_turn>"),
                (106, "<end_of_turn>"),
            ];
            let specials = named.iter().map(|&(id, n)| (id, n.to_string())).collect();
            (specials, "default", 2, 1, Some(106), GEMMA_TEMPLATE)
        }
        TokenizerKind::Harmony => {
            // o200k_harmony's specials at their ids; the rest of 199,998.. reserved.
            let named = [
                (199_998, "<|startoftext|>"),
                (199_999, "<|endoftext|>"),
                (200_002, "<|return|>"),
                (200_003, "<|constrain|>"),
                (200_005, "<|channel|>"),
                (200_006, "<|start|>"),
                (200_007, "<|end|>"),
                (200_008, "<|message|>"),
                (200_012, "<|call|>"),
            ];
            let specials = (199_998..vocab)
                .map(|id| match named.iter().find(|(i, _)| *i == id) {
                    Some((_, n)) => (id, n.to_string()),
                    None => (id, format!("<|reserved_{id}|>")),
                })
                .collect();
            (specials, "gpt-4o", 199_998, 200_002, None, HARMONY_TEMPLATE)
        }
    };
    let mut tokens: Vec<Option<String>> = vec![None; vocab];
    let mut types = vec![1i32; vocab];
    for (id, piece) in specials {
        tokens[id] = Some(piece);
        types[id] = 3;
    }
    // The 256 byte tokens first among the free ids, then filler: "Ġt123" decodes to " t123".
    let mut bytes = (0..=255u8).map(|b| byte_level_char(b).to_string());
    let mut filler = 0usize;
    for t in tokens.iter_mut().filter(|t| t.is_none()) {
        *t = Some(match bytes.next() {
            Some(b) => b,
            None => {
                filler += 1;
                format!("\u{120}t{filler}")
            }
        });
    }
    let tokens: Vec<String> = tokens
        .into_iter()
        .map(|t| t.expect("every id filled"))
        .collect();
    put("tokenizer.ggml.model", "gpt2".into());
    put("tokenizer.ggml.pre", pre.into());
    put(
        "tokenizer.ggml.tokens",
        GgufValue::Array(GgufArray::String(tokens)),
    );
    put(
        "tokenizer.ggml.token_type",
        GgufValue::Array(GgufArray::I32(types)),
    );
    put(
        "tokenizer.ggml.merges",
        GgufValue::Array(GgufArray::String(Vec::new())),
    );
    put("tokenizer.ggml.bos_token_id", GgufValue::U32(bos as u32));
    put("tokenizer.ggml.eos_token_id", GgufValue::U32(eos as u32));
    if let Some(eot) = eot {
        put("tokenizer.ggml.eot_token_id", GgufValue::U32(eot as u32));
    }
    put(
        "tokenizer.ggml.add_bos_token",
        GgufValue::Bool(matches!(kind, TokenizerKind::Llama3 | TokenizerKind::Gemma)),
    );
    put("tokenizer.chat_template", template.into());
}

/// SplitMix64: turns structured seeds (seed, tensor, row) into independent ones.
fn splitmix64(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// xoshiro256++ (Blackman & Vigna): fast, and good enough for weights by a wide margin.
struct Xoshiro256pp([u64; 4]);

impl Xoshiro256pp {
    fn seeded(seed: u64) -> Self {
        let mut sm = seed;
        Xoshiro256pp([
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
            splitmix64(&mut sm),
        ])
    }

    fn next_u64(&mut self) -> u64 {
        let s = &mut self.0;
        let result = s[0].wrapping_add(s[3]).rotate_left(23).wrapping_add(s[0]);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Fills `out` with N(mean, std²) by Box–Muller, two values per pair of uniforms.
    fn fill_normal(&mut self, out: &mut [f32], mean: f32, std: f32) {
        const TWO_PI: f32 = 2.0 * std::f32::consts::PI;
        let mut pairs = out.chunks_exact_mut(2);
        for pair in &mut pairs {
            let r = self.next_u64();
            // 24-bit uniforms; u1 in (0, 1] so the log is finite.
            let u1 = ((r >> 40) as f32 + 1.0) * (1.0 / 16_777_216.0);
            let u2 = ((r >> 16) & 0xff_ffff) as f32 * (1.0 / 16_777_216.0);
            let radius = std * (-2.0 * u1.ln()).sqrt();
            let (sin, cos) = (TWO_PI * u2).sin_cos();
            pair[0] = mean + radius * cos;
            pair[1] = mean + radius * sin;
        }
        if let [last] = pairs.into_remainder() {
            let mut two = [0.0f32; 2];
            self.fill_normal(&mut two, mean, std);
            *last = two[0];
        }
    }
}

/// The seed of row `row` of tensor `tensor`: every row its own stream, so the output is
/// the same whatever the thread count and chunking.
fn row_seed(seed: u64, tensor: usize, row: usize) -> u64 {
    let mut s = seed ^ 0x6b69_6c6e_7379_6e74; // "kilnsynt"
    let a = splitmix64(&mut s);
    let mut t = a ^ (tensor as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15);
    let b = splitmix64(&mut t);
    b ^ (row as u64).wrapping_mul(0xd1b5_4a32_d192_ed03)
}

/// A row of `qtype` as random valid blocks: random quant, grid-index, sign and sub-scale
/// bits, each block's f16 scales set so that its values' root mean square is `std` (found
/// by dequantising the block at scale 1). For the types kiln reads but cannot quantise to
/// (the 2- and 3-bit K-quants, the grid I-quants): the speed of a file of them does not
/// depend on how well its weights were chosen.
fn random_blocks(qtype: QType, rng: &mut Xoshiro256pp, std: f32, out: &mut [u8]) -> Result<()> {
    for block in out.chunks_exact_mut(qtype.block_bytes()) {
        for chunk in block.chunks_mut(8) {
            let r = rng.next_u64().to_le_bytes();
            chunk.copy_from_slice(&r[..chunk.len()]);
        }
        quant::scale_block_to_rms(qtype, block, std)?;
    }
    Ok(())
}

/// Options of [`synth_gguf`].
#[derive(Debug, Clone, Copy)]
pub struct SynthOptions {
    pub preset: Preset,
    pub recipe: Recipe,
    pub seed: u64,
}

/// The header of a synthetic model: its metadata and tensor table (every tensor declared,
/// no data). [`synth_gguf`] streams the data after it; tests use it to check a preset's
/// shapes without generating gigabytes.
pub fn synth_writer(options: SynthOptions) -> Result<(GgufWriter, Vec<TensorDesc>)> {
    let plan = plan(options.preset, options.recipe);
    let mut writer = GgufWriter::new();
    for (k, v) in metadata(options.preset, options.recipe, options.seed) {
        writer.add_kv(k, v)?;
    }
    for t in &plan {
        writer.declare_tensor(t.name.clone(), t.qtype, t.dims.clone())?;
    }
    Ok((writer, plan))
}

/// Writes a synthetic model to `out`. Returns the tensor table written.
pub fn synth_gguf<W: Write + Send>(
    out: W,
    options: SynthOptions,
    progress: Progress,
) -> Result<Vec<TensorDesc>> {
    let tensors = tensors(&options.preset.shape());
    let (writer, plan) = synth_writer(options)?;
    let total: u64 = plan
        .iter()
        .map(|t| t.dims.iter().product::<usize>() as u64)
        .sum();
    progress(ProgressEvent::Start { total });
    let mut encoder = TensorEncoder::new(writer.begin(out)?);
    for (index, (t, desc)) in tensors.iter().zip(&plan).enumerate() {
        progress(ProgressEvent::Tensor {
            name: &desc.name,
            index,
            count: plan.len(),
            qtype: desc.qtype,
        });
        let row_len = desc.dims[0];
        let rows: usize = desc.dims[1..].iter().product();
        let seed = options.seed;
        let source = |row: usize, values: &mut [f32]| -> Result<()> {
            match t.init {
                Init::Normal { mean, std } => {
                    Xoshiro256pp::seeded(row_seed(seed, index, row)).fill_normal(values, mean, std)
                }
                Init::Fixed => values.copy_from_slice(&t.fixed[row * row_len..(row + 1) * row_len]),
            }
            Ok(())
        };
        let blocks = |row: usize, out: &mut [u8]| -> Result<()> {
            let std = match t.init {
                Init::Normal { std, .. } => std,
                Init::Fixed => {
                    return Err(Error::Unsupported(format!(
                        "tensor {}: fixed values in {}, which kiln cannot quantise to",
                        desc.name, desc.qtype
                    )))
                }
            };
            random_blocks(
                desc.qtype,
                &mut Xoshiro256pp::seeded(row_seed(seed, index, row)),
                std,
                out,
            )
        };
        // A type kiln cannot quantise to gets random valid blocks of the same spread.
        let rows_from = match quant::can_quantize(desc.qtype) {
            true => RowSource::Values(&source),
            false => RowSource::Bytes(&blocks),
        };
        encoder.encode(row_len, rows, desc.qtype, rows_from, false, progress)?;
    }
    encoder.finish()?;
    progress(ProgressEvent::Finish);
    Ok(plan)
}

/// [`synth_gguf`] into a new file at `path` (written under a temporary name, then renamed).
pub fn synth_file(
    path: &Path,
    options: SynthOptions,
    progress: Progress,
) -> Result<Vec<TensorDesc>> {
    write_atomically(path, |w| synth_gguf(w, options, progress))
}
