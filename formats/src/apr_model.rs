//! APR v2 models into kiln's IR, and conversion between GGUF and APR (`kiln convert`).
//!
//! An APR file names its tensors HF style (`model.layers.3.self_attn.q_proj.weight`) or
//! GGUF style (`blk.3.attn_q.weight`); both are mapped onto the GGUF-style names the shared
//! role mapping ([`crate::model`]) reads, with dims reversed (APR is row-major, the IR is
//! ggml-ordered). The rotary layout follows the rows: HF-ordered Q/K rows rotate split
//! halves (NEOX); llama.cpp's GGUF files permute llama Q/K rows into adjacent pairs (NORM).
//! The `rope_type` metadata key says which when present; otherwise HF names mean NEOX and
//! GGUF names mean the architecture's GGUF convention.
//!
//! Types: APR reuses ggml ids for F32/F16/BF16/Q4_0/Q8_0/K-quants, which pass through; its
//! 4-bit type is `QType::AprQ4` (backends run it; GPUs repack it at upload); its 8-bit type
//! (one f32 scale per tensor) becomes Q8_0 at load with every block scale the tensor's scale
//! rounded to f16 (quants unchanged: a relative error of at most 2⁻¹¹, 1/16 more bytes);
//! F64 vectors become F32. GGUF types APR cannot hold (Q4_1, Q5_0, Q5_1: their ggml ids are
//! APR's F64/I8/U8) are requantised to Q8_0 when converting GGUF → APR, and reported.

use std::io::Write;
use std::path::Path;

use half::f16;
use kiln_core::{
    Architecture, Error, ModelConfig, ModelIr, QType, Result, RopeKind, RopeScaling, TensorView,
};
use serde_json::{json, Map, Value};

use crate::apr::{json_kind, write_apr, AprDtype, AprFile, AprTensorSpec, Compression};
use crate::gguf::{GgufValue, GgufWriter};
use crate::model::{gguf_rope_kind, model_from_table, TensorTable};
use crate::quantize::{Progress, ProgressEvent};
use crate::tokenizer::TokenizerSpec;

/// A model read from an APR file: the IR plus what the host needs beside it.
pub struct AprModel {
    pub ir: ModelIr,
    pub tokenizer: TokenizerSpec,
    pub chat_template: Option<String>,
}

/// Maps a parsed APR file into kiln's IR. `source` names the file in messages.
pub fn model_from_apr(file: &AprFile, source: &str) -> Result<AprModel> {
    let meta = Meta(file.metadata());
    let mut table = TensorTable::default();
    let mut hf_names = false;
    for t in file.tensors() {
        let (name, hf) = gguf_name(&t.name);
        hf_names |= hf;
        let dims: Vec<usize> = t
            .dims
            .iter()
            .rev()
            .map(|&d| {
                usize::try_from(d)
                    .map_err(|_| Error::Format(format!("tensor '{}': dim {d} overflows", t.name)))
            })
            .collect::<Result<_>>()?;
        let view = match t.dtype {
            AprDtype::Ggml(q) => TensorView::new(
                name.as_str(),
                q,
                dims,
                file.storage().clone(),
                file.tensor_offset(t),
            )?,
            AprDtype::Q4 => TensorView::new(
                name.as_str(),
                QType::AprQ4,
                dims,
                file.storage().clone(),
                file.tensor_offset(t),
            )?,
            AprDtype::Q8 => TensorView::from_bytes(
                &name,
                QType::Q8_0,
                dims.clone(),
                apr_q8_to_q8_0(&t.name, file.tensor_bytes(t), &dims)?,
            )?,
            AprDtype::F64 => {
                let values: Vec<f32> = file
                    .tensor_bytes(t)
                    .chunks_exact(8)
                    .map(|b| f64::from_le_bytes(b.try_into().expect("8 bytes")) as f32)
                    .collect();
                TensorView::from_f32(&name, dims, &values)?
            }
            other => {
                return Err(Error::Unsupported(format!(
                    "{source}: tensor '{}' holds {} values, which no model weight in kiln takes",
                    t.name,
                    other.name()
                )))
            }
        };
        table.push(name, view)?;
    }
    let config = config_from_apr(&meta, &table, hf_names)?;
    let ir = model_from_table(table, config, source)?;
    Ok(AprModel {
        ir,
        tokenizer: tokenizer_from_apr(&meta)?,
        chat_template: meta.opt_str("chat_template")?.map(str::to_string),
    })
}

/// The GGUF-style name of an APR tensor, and whether it was HF style.
fn gguf_name(name: &str) -> (String, bool) {
    let fixed = match name {
        "model.embed_tokens.weight" => Some("token_embd.weight".to_string()),
        "model.norm.weight" => Some("output_norm.weight".to_string()),
        "lm_head.weight" => Some("output.weight".to_string()),
        _ => None,
    };
    if let Some(f) = fixed {
        return (f, true);
    }
    let Some(rest) = name.strip_prefix("model.layers.") else {
        return (name.to_string(), false);
    };
    let Some((layer, role)) = rest.split_once('.') else {
        return (name.to_string(), false);
    };
    if layer.parse::<usize>().is_err() {
        return (name.to_string(), false);
    }
    let role = match role {
        "input_layernorm.weight" => "attn_norm.weight",
        "post_attention_layernorm.weight" => "ffn_norm.weight",
        "self_attn.q_proj.weight" => "attn_q.weight",
        "self_attn.k_proj.weight" => "attn_k.weight",
        "self_attn.v_proj.weight" => "attn_v.weight",
        "self_attn.q_proj.bias" => "attn_q.bias",
        "self_attn.k_proj.bias" => "attn_k.bias",
        "self_attn.v_proj.bias" => "attn_v.bias",
        "self_attn.o_proj.weight" => "attn_output.weight",
        "self_attn.q_norm.weight" => "attn_q_norm.weight",
        "self_attn.k_norm.weight" => "attn_k_norm.weight",
        "mlp.gate_proj.weight" => "ffn_gate.weight",
        "mlp.up_proj.weight" => "ffn_up.weight",
        "mlp.down_proj.weight" => "ffn_down.weight",
        _ => return (name.to_string(), false),
    };
    (format!("blk.{layer}.{role}"), true)
}

/// APR's 8-bit type (an f32 scale, then one i8 per value) as Q8_0 blocks: every block's
/// scale is the tensor's, rounded to f16; the quants are unchanged. A scale outside f16's
/// normal range requantises each block from the exact values instead.
fn apr_q8_to_q8_0(name: &str, bytes: &[u8], dims: &[usize]) -> Result<Vec<u8>> {
    let n: usize = dims.iter().product();
    if bytes.len() != 4 + n || dims.first().is_none_or(|k| !k.is_multiple_of(32)) {
        return Err(Error::Format(format!(
            "tensor '{name}': 8-bit APR data of {} bytes for dims {dims:?} (rows must be whole 32-value blocks)",
            bytes.len()
        )));
    }
    let scale = f32::from_le_bytes(bytes[..4].try_into().expect("4 bytes"));
    if !scale.is_finite() {
        return Err(Error::Format(format!(
            "tensor '{name}': 8-bit scale {scale} is not finite"
        )));
    }
    let quants = &bytes[4..];
    let d = f16::from_f32(scale);
    let exact_scale = scale == 0.0 || (d.is_normal() && d.to_f32().is_finite());
    let mut out = Vec::with_capacity(n / 32 * 34);
    for block in quants.chunks_exact(32) {
        if exact_scale {
            out.extend_from_slice(&d.to_le_bytes());
            out.extend_from_slice(block);
        } else {
            let values: Vec<f32> = block.iter().map(|&q| q as i8 as f32 * scale).collect();
            let mut q8 = [0u8; 34];
            kiln_core::quant::quantize(QType::Q8_0, &values, &mut q8)?;
            out.extend_from_slice(&q8);
        }
    }
    Ok(out)
}

/// Typed lookups in APR's JSON metadata; a key of the wrong type is an error naming it.
struct Meta<'a>(&'a Map<String, Value>);

impl Meta<'_> {
    fn opt_usize(&self, key: &str) -> Result<Option<usize>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| {
                    Error::Format(format!(
                        "APR metadata '{key}' should be a non-negative integer, found {v}"
                    ))
                }),
        }
    }
    fn usize(&self, key: &str) -> Result<usize> {
        self.opt_usize(key)?
            .ok_or_else(|| Error::Format(format!("APR metadata '{key}' is missing")))
    }
    fn opt_f32(&self, key: &str) -> Result<Option<f32>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(v) => match v.as_f64() {
                Some(x) if x.is_finite() => Ok(Some(x as f32)),
                _ => Err(Error::Format(format!(
                    "APR metadata '{key}' should be a finite number, found {v}"
                ))),
            },
        }
    }
    fn opt_str(&self, key: &str) -> Result<Option<&str>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::String(s)) => Ok(Some(s)),
            Some(v) => Err(Error::Format(format!(
                "APR metadata '{key}' should be a string, found {v}"
            ))),
        }
    }
    fn opt_bool(&self, key: &str) -> Result<Option<bool>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Bool(b)) => Ok(Some(*b)),
            Some(v) => Err(Error::Format(format!(
                "APR metadata '{key}' should be true or false, found {v}"
            ))),
        }
    }
    fn opt_id(&self, key: &str) -> Result<Option<u32>> {
        self.opt_usize(key)?
            .map(|v| {
                u32::try_from(v).map_err(|_| {
                    Error::Format(format!("APR metadata '{key}' = {v} is not a token id"))
                })
            })
            .transpose()
    }
    fn opt_array<'b>(&'b self, key: &str) -> Result<Option<&'b Vec<Value>>> {
        match self.0.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(Value::Array(a)) => Ok(Some(a)),
            Some(v) => Err(Error::Format(format!(
                "APR metadata '{key}' should be an array, found {}",
                json_kind(v)
            ))),
        }
    }
    fn opt_strings(&self, key: &str) -> Result<Option<Vec<String>>> {
        let Some(a) = self.opt_array(key)? else {
            return Ok(None);
        };
        a.iter()
            .map(|v| match v {
                Value::String(s) => Ok(s.clone()),
                // Merges are sometimes stored as [left, right] pairs.
                Value::Array(pair) if pair.len() == 2 && pair.iter().all(Value::is_string) => {
                    Ok(format!(
                        "{} {}",
                        pair[0].as_str().expect("checked"),
                        pair[1].as_str().expect("checked")
                    ))
                }
                other => Err(Error::Format(format!(
                    "APR metadata '{key}' holds {}, strings expected",
                    json_kind(other)
                ))),
            })
            .collect::<Result<_>>()
            .map(Some)
    }
    fn opt_numbers<T>(
        &self,
        key: &str,
        convert: impl Fn(&Value) -> Option<T>,
    ) -> Result<Option<Vec<T>>> {
        let Some(a) = self.opt_array(key)? else {
            return Ok(None);
        };
        a.iter()
            .map(|v| {
                convert(v).ok_or_else(|| {
                    Error::Format(format!("APR metadata '{key}' holds {v}, a number expected"))
                })
            })
            .collect::<Result<_>>()
            .map(Some)
    }
}

fn architecture(name: &str) -> Result<Architecture> {
    Ok(match name {
        "llama" | "LlamaForCausalLM" => Architecture::Llama,
        "mistral" | "MistralForCausalLM" => Architecture::Mistral,
        "qwen2" | "Qwen2ForCausalLM" => Architecture::Qwen2,
        "qwen3" | "Qwen3ForCausalLM" => Architecture::Qwen3,
        other => {
            return Err(Error::Unsupported(format!(
            "APR architecture '{other}' (kiln runs llama, mistral, qwen2 and qwen3 from APR files)"
        )))
        }
    })
}

fn config_from_apr(meta: &Meta<'_>, table: &TensorTable, hf_names: bool) -> Result<ModelConfig> {
    let arch_name = meta
        .opt_str("architecture")?
        .ok_or_else(|| Error::Format("APR metadata has no 'architecture'".into()))?;
    let arch = architecture(arch_name)?;
    let hidden_size = meta.usize("hidden_size")?;
    let num_heads = meta.usize("num_heads")?;
    if num_heads == 0 {
        return Err(Error::Format("APR metadata 'num_heads' is 0".into()));
    }
    let head_dim = match meta.opt_usize("head_dim")? {
        Some(d) => d,
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => return Err(Error::Format(format!("hidden size {hidden_size} does not split into {num_heads} heads and 'head_dim' is absent"))),
    };
    let rope_kind = match meta.opt_usize("rope_type")? {
        Some(0) => RopeKind::Norm,
        Some(2) => RopeKind::Neox,
        Some(other) => {
            return Err(Error::Unsupported(format!(
                "APR rope_type {other} (0 NORM and 2 NEOX are known)"
            )))
        }
        None if hf_names => RopeKind::Neox,
        None => gguf_rope_kind(&arch),
    };
    let scaling = match meta.0.get("rope_scaling") {
        None | Some(Value::Null) => RopeScaling::None,
        Some(Value::Object(o)) => match (
            o.get("type").and_then(Value::as_str),
            o.get("factor").and_then(Value::as_f64),
        ) {
            (Some("linear"), Some(f)) if f > 0.0 && f.is_finite() => {
                RopeScaling::Linear { factor: f as f32 }
            }
            (Some("none"), _) => RopeScaling::None,
            _ => {
                return Err(Error::Unsupported(format!(
                    "APR rope_scaling {}",
                    Value::Object(o.clone())
                )))
            }
        },
        Some(v) => {
            return Err(Error::Format(format!(
                "APR metadata 'rope_scaling' should be an object, found {v}"
            )))
        }
    };
    let vocab_size = match meta.opt_usize("vocab_size")? {
        Some(v) => v,
        None => match table
            .get("token_embd.weight")
            .map(|t| t.dims().to_vec())
            .as_deref()
        {
            Some([_, v]) => *v,
            _ => {
                return Err(Error::Format(
                    "APR metadata has no 'vocab_size' and no token embedding".into(),
                ))
            }
        },
    };
    let has = |name: &str| table.get(name).is_some();
    let config = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        num_layers: meta.usize("num_layers")?,
        num_heads,
        num_kv_heads: meta.opt_usize("num_kv_heads")?.unwrap_or(num_heads),
        head_dim,
        ffn_size: meta.usize("intermediate_size")?,
        norm: kiln_core::NormKind::Rms,
        norm_eps: meta
            .opt_f32("rms_norm_eps")?
            .ok_or_else(|| Error::Format("APR metadata 'rms_norm_eps' is missing".into()))?,
        activation: kiln_core::Activation::Silu,
        rope: kiln_core::RopeConfig {
            kind: rope_kind,
            theta: meta.opt_f32("rope_theta")?.unwrap_or(10_000.0),
            scaling,
            rotary_dims: meta.opt_usize("rotary_dim")?.unwrap_or(head_dim),
        },
        tied_embeddings: !has("output.weight"),
        context_length: meta.usize("max_position_embeddings")?,
        ..ModelConfig::default()
    };
    config.validate()?;
    Ok(config)
}

fn tokenizer_from_apr(meta: &Meta<'_>) -> Result<TokenizerSpec> {
    let tokens = meta
        .opt_strings("tokenizer.vocabulary")?
        .ok_or_else(|| Error::Format("APR metadata has no 'tokenizer.vocabulary'".into()))?;
    let model = meta
        .opt_str("tokenizer.model")?
        .unwrap_or("gpt2")
        .to_string();
    let is_spm = model == "llama";
    Ok(TokenizerSpec {
        pre: meta.opt_str("tokenizer.pre")?.map(str::to_string),
        scores: meta.opt_numbers("tokenizer.scores", |v| v.as_f64().map(|x| x as f32))?,
        token_types: meta.opt_numbers("tokenizer.token_type", |v| {
            v.as_i64().and_then(|x| i32::try_from(x).ok())
        })?,
        merges: meta.opt_strings("tokenizer.merges")?.unwrap_or_default(),
        bos: meta.opt_id("tokenizer.bos_token_id")?,
        eos: meta.opt_id("tokenizer.eos_token_id")?,
        eot: meta.opt_id("tokenizer.eot_token_id")?,
        unk: meta.opt_id("tokenizer.unknown_token_id")?,
        pad: meta.opt_id("tokenizer.padding_token_id")?,
        add_bos: meta.opt_bool("tokenizer.add_bos_token")?.unwrap_or(is_spm),
        add_space_prefix: meta
            .opt_bool("tokenizer.add_space_prefix")?
            .unwrap_or(is_spm),
        model,
        tokens,
    })
}

/// APR metadata for a model: the standard keys aprender writes, plus the ones kiln needs
/// to rebuild the tokenizer and rope exactly (`tokenizer.model`, `tokenizer.pre`, scores,
/// token types, the other special ids, `rope_scaling`, `rotary_dim`).
pub fn apr_metadata(
    config: &ModelConfig,
    tokenizer: &TokenizerSpec,
    chat_template: Option<&str>,
) -> Map<String, Value> {
    let c = config;
    let mut m = Map::new();
    m.insert("architecture".into(), json!(c.arch.name()));
    m.insert("hidden_size".into(), json!(c.hidden_size));
    m.insert("num_layers".into(), json!(c.num_layers));
    m.insert("num_heads".into(), json!(c.num_heads));
    m.insert("num_kv_heads".into(), json!(c.num_kv_heads));
    m.insert("vocab_size".into(), json!(c.vocab_size));
    m.insert("intermediate_size".into(), json!(c.ffn_size));
    m.insert("max_position_embeddings".into(), json!(c.context_length));
    m.insert("rope_theta".into(), f32_json(c.rope.theta));
    m.insert(
        "rope_type".into(),
        json!(if c.rope.kind == RopeKind::Neox { 2 } else { 0 }),
    );
    m.insert("rms_norm_eps".into(), f32_json(c.norm_eps));
    m.insert("head_dim".into(), json!(c.head_dim));
    if c.rope.rotary_dims != c.head_dim {
        m.insert("rotary_dim".into(), json!(c.rope.rotary_dims));
    }
    if let RopeScaling::Linear { factor } = c.rope.scaling {
        m.insert(
            "rope_scaling".into(),
            json!({"type": "linear", "factor": f32_json(factor)}),
        );
    }
    if let Some(t) = chat_template {
        m.insert("chat_template".into(), json!(t));
    }
    let t = tokenizer;
    m.insert("tokenizer.model".into(), json!(t.model));
    if let Some(pre) = &t.pre {
        m.insert("tokenizer.pre".into(), json!(pre));
    }
    m.insert("tokenizer.vocabulary".into(), json!(t.tokens));
    m.insert("tokenizer.merges".into(), json!(t.merges));
    if let Some(s) = &t.scores {
        m.insert("tokenizer.scores".into(), json!(s));
    }
    if let Some(tt) = &t.token_types {
        m.insert("tokenizer.token_type".into(), json!(tt));
    }
    for (key, id) in [
        ("tokenizer.bos_token_id", t.bos),
        ("tokenizer.eos_token_id", t.eos),
        ("tokenizer.eot_token_id", t.eot),
        ("tokenizer.unknown_token_id", t.unk),
        ("tokenizer.padding_token_id", t.pad),
    ] {
        if let Some(id) = id {
            m.insert(key.into(), json!(id));
        }
    }
    m.insert("tokenizer.add_bos_token".into(), json!(t.add_bos));
    m.insert(
        "tokenizer.add_space_prefix".into(),
        json!(t.add_space_prefix),
    );
    m
}

/// An f32 as the JSON number of its shortest decimal form (1e-5, not 9.999999747e-6), which
/// reads back as the same f32.
fn f32_json(x: f32) -> Value {
    json!(x.to_string().parse::<f64>().unwrap_or(x as f64))
}

/// GGUF metadata for a model (what `kiln convert` writes for an APR input).
pub fn gguf_metadata(
    config: &ModelConfig,
    tokenizer: &TokenizerSpec,
    chat_template: Option<&str>,
) -> Vec<(String, GgufValue)> {
    let c = config;
    let a = c.arch.name();
    let mut v: Vec<(String, GgufValue)> = vec![
        ("general.architecture".into(), a.into()),
        (format!("{a}.block_count"), (c.num_layers as u32).into()),
        (
            format!("{a}.embedding_length"),
            (c.hidden_size as u32).into(),
        ),
        (
            format!("{a}.feed_forward_length"),
            (c.ffn_size as u32).into(),
        ),
        (
            format!("{a}.attention.head_count"),
            (c.num_heads as u32).into(),
        ),
        (
            format!("{a}.attention.head_count_kv"),
            (c.num_kv_heads as u32).into(),
        ),
        (
            format!("{a}.attention.key_length"),
            (c.head_dim as u32).into(),
        ),
        (
            format!("{a}.attention.value_length"),
            (c.head_dim as u32).into(),
        ),
        (
            format!("{a}.context_length"),
            (c.context_length as u32).into(),
        ),
        (
            format!("{a}.attention.layer_norm_rms_epsilon"),
            c.norm_eps.into(),
        ),
        (format!("{a}.rope.freq_base"), c.rope.theta.into()),
        (
            format!("{a}.rope.dimension_count"),
            (c.rope.rotary_dims as u32).into(),
        ),
        (format!("{a}.vocab_size"), (c.vocab_size as u32).into()),
    ];
    if let RopeScaling::Linear { factor } = c.rope.scaling {
        v.push((format!("{a}.rope.scaling.type"), "linear".into()));
        v.push((format!("{a}.rope.scaling.factor"), factor.into()));
    }
    let t = tokenizer;
    v.push(("tokenizer.ggml.model".into(), t.model.as_str().into()));
    if let Some(pre) = &t.pre {
        v.push(("tokenizer.ggml.pre".into(), pre.as_str().into()));
    }
    v.push((
        "tokenizer.ggml.tokens".into(),
        GgufValue::from(t.tokens.iter().map(String::as_str).collect::<Vec<_>>()),
    ));
    if !t.merges.is_empty() {
        v.push((
            "tokenizer.ggml.merges".into(),
            GgufValue::from(t.merges.iter().map(String::as_str).collect::<Vec<_>>()),
        ));
    }
    if let Some(s) = &t.scores {
        v.push(("tokenizer.ggml.scores".into(), s.clone().into()));
    }
    if let Some(tt) = &t.token_types {
        v.push(("tokenizer.ggml.token_type".into(), tt.clone().into()));
    }
    for (key, id) in [
        ("tokenizer.ggml.bos_token_id", t.bos),
        ("tokenizer.ggml.eos_token_id", t.eos),
        ("tokenizer.ggml.eot_token_id", t.eot),
        ("tokenizer.ggml.unknown_token_id", t.unk),
        ("tokenizer.ggml.padding_token_id", t.pad),
    ] {
        if let Some(id) = id {
            v.push((key.into(), id.into()));
        }
    }
    v.push(("tokenizer.ggml.add_bos_token".into(), t.add_bos.into()));
    v.push((
        "tokenizer.ggml.add_space_prefix".into(),
        t.add_space_prefix.into(),
    ));
    if let Some(tmpl) = chat_template {
        v.push(("tokenizer.chat_template".into(), tmpl.into()));
    }
    v
}

/// Reorders the rows of a Q or K projection between llama.cpp's adjacent-pair order (NORM)
/// and HF's split-halves order (NEOX): within each head of `head_dim` rows, pair row 2j is
/// half row j and pair row 2j+1 is half row j + head_dim/2. Whole rows move, so any block
/// type is permuted exactly. `to_halves` goes NORM → NEOX.
pub fn permute_rope_rows(
    rows: &[u8],
    row_bytes: usize,
    head_dim: usize,
    to_halves: bool,
) -> Result<Vec<u8>> {
    if row_bytes == 0
        || !rows.len().is_multiple_of(row_bytes)
        || head_dim == 0
        || !head_dim.is_multiple_of(2)
    {
        return Err(Error::InvalidShape(format!(
            "{} bytes in rows of {row_bytes}, head_dim {head_dim}",
            rows.len()
        )));
    }
    let n = rows.len() / row_bytes;
    if !n.is_multiple_of(head_dim) {
        return Err(Error::InvalidShape(format!(
            "{n} rows do not split into heads of {head_dim}"
        )));
    }
    let half = head_dim / 2;
    let mut out = vec![0u8; rows.len()];
    for h in 0..n / head_dim {
        for j in 0..half {
            for (pair, halves) in [(2 * j, j), (2 * j + 1, j + half)] {
                let (src, dst) = if to_halves {
                    (pair, halves)
                } else {
                    (halves, pair)
                };
                let (s, d) = (
                    (h * head_dim + src) * row_bytes,
                    (h * head_dim + dst) * row_bytes,
                );
                out[d..d + row_bytes].copy_from_slice(&rows[s..s + row_bytes]);
            }
        }
    }
    Ok(out)
}

/// What `kiln convert` does with the weights of a GGUF file it writes as APR.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AprQuantize {
    /// Keep every tensor's type (GGUF types APR cannot hold become Q8_0).
    #[default]
    Keep,
    /// Every layer matrix to APR's 4-bit type (rows must be whole 32-value blocks); the
    /// embedding and LM head keep their type.
    Int4,
    /// Every layer matrix to APR's 8-bit type (one f32 scale per tensor); the embedding and
    /// LM head keep their type.
    Int8,
}

/// One tensor's fate in a conversion.
#[derive(Debug, Clone)]
pub struct ConvertReport {
    pub name: String,
    pub from: String,
    pub to: String,
}

/// The APR dtype a GGUF tensor of `q` keeps, if APR can hold it.
fn apr_dtype_of(q: QType) -> Option<AprDtype> {
    match q {
        QType::F32
        | QType::F16
        | QType::BF16
        | QType::Q4_0
        | QType::Q8_0
        | QType::Q2_K
        | QType::Q3_K
        | QType::Q4_K
        | QType::Q5_K
        | QType::Q6_K => Some(AprDtype::Ggml(q)),
        QType::AprQ4 => Some(AprDtype::Q4),
        _ => None,
    }
}

/// Writes `ir` (with its tokenizer and chat template) as an APR file, streaming one tensor
/// at a time. Names stay GGUF style and rows keep their order; `rope_type` records the
/// layout. Returns what happened to each tensor whose type changed.
pub fn write_model_apr(
    ir: &ModelIr,
    tokenizer: &TokenizerSpec,
    chat_template: Option<&str>,
    output: &Path,
    compression: Compression,
    quantize: AprQuantize,
    progress: Progress,
) -> Result<Vec<ConvertReport>> {
    let tensors: Vec<(String, &TensorView)> = ir
        .weights
        .tensors()
        .into_iter()
        .map(|t| (t.name().to_string(), t))
        .collect();
    let mut plan: Vec<(String, &TensorView, AprDtype)> = Vec::with_capacity(tensors.len());
    let mut report = Vec::new();
    for (name, t) in &tensors {
        // The layers' matrices; the embedding and LM head keep their type, as llama.cpp's
        // recipes keep them at higher precision (one scale per tensor for the 49k–150k
        // rows of a vocabulary loses too much).
        let matrix = t.dims().len() == 2 && name.starts_with("blk.");
        let dtype = match (quantize, matrix) {
            (AprQuantize::Int4, true) => AprDtype::Q4,
            (AprQuantize::Int8, true) => AprDtype::Q8,
            _ => apr_dtype_of(t.qtype()).unwrap_or(AprDtype::Ggml(QType::Q8_0)),
        };
        if apr_dtype_of(t.qtype()) != Some(dtype) {
            report.push(ConvertReport {
                name: name.clone(),
                from: t.qtype().name().to_string(),
                to: dtype.name(),
            });
        }
        plan.push((name.clone(), *t, dtype));
    }
    plan.sort_by(|a, b| a.0.cmp(&b.0));
    let specs: Vec<AprTensorSpec> = plan
        .iter()
        .map(|(name, t, dtype)| AprTensorSpec {
            name: name.clone(),
            dtype: *dtype,
            dims: t.dims().iter().rev().map(|&d| d as u64).collect(),
        })
        .collect();
    let meta = apr_metadata(&ir.config, tokenizer, chat_template);
    let total: u64 = plan.iter().map(|(_, t, _)| t.elements() as u64).sum();
    progress(ProgressEvent::Start { total });
    let mut index = 0usize;
    let mut failure: Option<Error> = None;
    let mut write = |name: &str, out: &mut dyn Write| -> std::io::Result<()> {
        // The writer asks in index order, which is `plan`'s (both sorted by name).
        let at = plan
            .binary_search_by(|(n, _, _)| n.as_str().cmp(name))
            .expect("the writer asks for planned tensors");
        let (_, t, dtype) = &plan[at];
        progress(ProgressEvent::Tensor {
            name,
            index,
            count: plan.len(),
            qtype: t.qtype(),
        });
        index += 1;
        let bytes = match encode_as(t, *dtype) {
            Ok(b) => b,
            Err(e) => {
                let msg = e.to_string();
                failure = Some(e);
                return Err(std::io::Error::other(msg));
            }
        };
        out.write_all(&bytes)?;
        progress(ProgressEvent::Advance {
            done: t.elements() as u64,
        });
        Ok(())
    };
    let written = write_apr(output, &meta, &specs, compression, &mut write);
    if let Some(e) = failure {
        return Err(e);
    }
    written?;
    progress(ProgressEvent::Finish);
    Ok(report)
}

/// `t`'s bytes as APR `dtype`: its own bytes when the type is kept, else converted through f32.
fn encode_as(t: &TensorView, dtype: AprDtype) -> Result<std::borrow::Cow<'_, [u8]>> {
    if apr_dtype_of(t.qtype()) == Some(dtype) {
        return Ok(t.bytes().into());
    }
    let values = t.to_f32()?;
    match dtype {
        AprDtype::Ggml(q) => {
            let mut out = vec![0u8; q.row_bytes(t.row_len())? * t.rows()];
            for (src, dst) in values
                .chunks_exact(t.row_len())
                .zip(out.chunks_exact_mut(q.row_bytes(t.row_len())?))
            {
                kiln_core::quant::quantize(q, src, dst)?;
            }
            Ok(out.into())
        }
        AprDtype::Q4 => {
            let q = QType::AprQ4;
            let rb = q.row_bytes(t.row_len())?;
            let mut out = vec![0u8; rb * t.rows()];
            for (src, dst) in values
                .chunks_exact(t.row_len())
                .zip(out.chunks_exact_mut(rb))
            {
                kiln_core::quant::quantize(q, src, dst)?;
            }
            Ok(out.into())
        }
        AprDtype::Q8 => {
            let amax = values.iter().fold(0f32, |m, v| m.max(v.abs()));
            let scale = if amax > 0.0 { amax / 127.0 } else { 1.0 };
            let mut out = Vec::with_capacity(4 + values.len());
            out.extend_from_slice(&scale.to_le_bytes());
            out.extend(
                values
                    .iter()
                    .map(|v| (v / scale).round().clamp(-127.0, 127.0) as i8 as u8),
            );
            Ok(out.into())
        }
        other => Err(Error::Unsupported(format!(
            "writing {} tensors",
            other.name()
        ))),
    }
}

/// Writes `ir` as a GGUF file. APR types GGUF lacks become their nearest GGUF type: the
/// 4-bit type Q4_0 (a nibble permutation: lossless). Llama-family Q/K rows in HF order
/// (NEOX) are permuted into GGUF's adjacent-pair order, as llama.cpp's converter does.
pub fn write_model_gguf(
    ir: &ModelIr,
    tokenizer: &TokenizerSpec,
    chat_template: Option<&str>,
    output: &Path,
    progress: Progress,
) -> Result<Vec<ConvertReport>> {
    let c = &ir.config;
    let permute = c.rope.kind != gguf_rope_kind(&c.arch);
    if permute && c.rope.kind != RopeKind::Neox {
        return Err(Error::Unsupported(format!(
            "a {} model with {:?} rope cannot be written as GGUF",
            c.arch.name(),
            c.rope.kind
        )));
    }
    let mut config = c.clone();
    config.rope.kind = gguf_rope_kind(&c.arch);
    let mut writer = GgufWriter::new();
    for (k, v) in gguf_metadata(&config, tokenizer, chat_template) {
        writer.add_kv(k, v)?;
    }
    let tensors: Vec<(String, &TensorView)> = ir
        .weights
        .tensors()
        .into_iter()
        .map(|t| (t.name().to_string(), t))
        .collect();
    let mut report = Vec::new();
    for (name, t) in &tensors {
        let q = if t.qtype() == QType::AprQ4 {
            report.push(ConvertReport {
                name: name.clone(),
                from: "apr_q4".into(),
                to: "q4_0".into(),
            });
            QType::Q4_0
        } else {
            t.qtype()
        };
        writer.declare_tensor(name.clone(), q, t.dims().to_vec())?;
    }
    let total: u64 = tensors.iter().map(|(_, t)| t.elements() as u64).sum();
    progress(ProgressEvent::Start { total });
    crate::quantize::write_atomically(output, |w| -> Result<()> {
        let mut stream = writer.begin(w)?;
        for (index, (name, t)) in tensors.iter().enumerate() {
            progress(ProgressEvent::Tensor {
                name,
                index,
                count: tensors.len(),
                qtype: t.qtype(),
            });
            // Unchanged tensors are written straight from the mapping; only converted or
            // permuted ones are copied.
            let mut bytes = std::borrow::Cow::Borrowed(t.bytes());
            if t.qtype() == QType::AprQ4 {
                let mut out = t.bytes().to_vec();
                for block in out.chunks_exact_mut(18) {
                    let b: [u8; 18] = (&*block).try_into().expect("18 bytes");
                    block.copy_from_slice(&kiln_core::quant::apr_q4_block_to_q4_0(&b));
                }
                bytes = out.into();
            }
            let qk = name.ends_with("attn_q.weight") || name.ends_with("attn_k.weight");
            if permute && qk {
                bytes = permute_rope_rows(&bytes, t.row_bytes(), c.head_dim, false)?.into();
            }
            stream.write_tensor_data(&bytes)?;
            progress(ProgressEvent::Advance {
                done: t.elements() as u64,
            });
        }
        stream.finish()?;
        Ok(())
    })?;
    progress(ProgressEvent::Finish);
    Ok(report)
}
