//! From a GGUF file to kiln's IR, and from the IR to a backend.
//!
//! [`model_from_gguf`] reads the `{arch}.*` hyper-parameters into a [`ModelConfig`] and gives
//! every tensor a typed role in [`ModelWeights`], checking each shape against the config so a
//! backend never meets a surprise. Every tensor in the file must find a role: a tensor kiln
//! would silently ignore (an FFN bias, say) means kiln would compute a different model, so it
//! is refused instead. [`dispatch`] asks the registry which backend runs the result.

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use kiln_core::{
    Activation, Architecture, Backend, Candidate, Error, ExpertBiases, ExpertConfig, ExpertTensors,
    ExpertWeights, GraniteScales, LayerWeights, ModelConfig, ModelIr, ModelWeights, Registry,
    Result, RopeConfig, RopeKind, RopeScaling, SlidingWindow, TensorView,
};

use crate::gguf::GgufFile;

/// The architectures [`model_from_gguf`] maps, by their `general.architecture` name.
pub const SUPPORTED_ARCHITECTURES: [&str; 9] = [
    "llama", "mistral", "qwen2", "qwen3", "qwen3moe", "gemma3", "phi3", "granite", "gpt-oss",
];

/// Opens a GGUF file and maps it. The file is returned too: the tokenizer and chat
/// template live in its metadata.
pub fn load_gguf(path: impl AsRef<Path>) -> Result<(GgufFile, ModelIr)> {
    let path = path.as_ref();
    let file = GgufFile::open(path)?;
    let ir = model_from_gguf(&file, &format!("GGUF file {}", path.display()))?;
    Ok((file, ir))
}

/// Maps a parsed GGUF file into a [`ModelIr`] whose tensors borrow the file's storage.
/// `source` names the file in messages.
pub fn model_from_gguf(file: &GgufFile, source: &str) -> Result<ModelIr> {
    let config = config_from_gguf(file)?;
    let mut table = TensorTable::default();
    for info in file.tensors() {
        table.push(info.name.clone(), file.view(info)?)?;
    }
    model_from_table(table, config, source)
}

/// Gives every tensor of `table` its role in a model of `config`, refusing a tensor that
/// finds none (shared by every file format).
pub(crate) fn model_from_table(
    table: TensorTable,
    config: ModelConfig,
    source: &str,
) -> Result<ModelIr> {
    let mut t = Tensors {
        used: vec![false; table.entries.len()],
        table,
    };
    let weights = weights(&mut t, &config)?;
    if let Some(name) = t.unused().next() {
        return Err(Error::Unsupported(format!(
            "{source}: tensor '{name}' has no role in a {} model as kiln runs it",
            config.arch.name()
        )));
    }
    let model = ModelIr {
        config,
        weights,
        source: source.to_string(),
        program: None,
    };
    // What the architecture requires of its weights (Qwen3's head norms, Gemma 3's
    // post-norms) is its builder's to check: a file without them is refused here, at open,
    // rather than by whichever backend builds the program first.
    kiln_core::program::build(&model)?;
    Ok(model)
}

/// The hyper-parameters of a GGUF model (what `kiln inspect` shows), without the weights.
/// Properties only visible in the tensor table (tied embeddings, biases, QK-norm, vocab
/// when the metadata omits it) are read from it.
pub fn config_from_gguf(file: &GgufFile) -> Result<ModelConfig> {
    let arch_name = file
        .get_str("general.architecture")
        .ok_or_else(|| Error::Format("metadata has no string 'general.architecture'".into()))?;
    let meta = Meta {
        file,
        arch: arch_name,
    };
    let arch = match arch_name {
        "llama" => Architecture::Llama,
        "mistral" => Architecture::Mistral,
        "qwen2" => Architecture::Qwen2,
        "qwen3" => Architecture::Qwen3,
        "qwen3moe" => Architecture::Qwen3Moe,
        "gemma3" => Architecture::Gemma3,
        "phi3" => Architecture::Phi3,
        "gpt-oss" => Architecture::GptOss,
        // llama.cpp's keys; an absent one leaves its part unscaled (q·k by 1/√head_dim,
        // filled in below once the head size is known).
        "granite" => Architecture::Granite(GraniteScales {
            residual: meta.opt_f32("residual_scale")?.unwrap_or(1.0),
            attention: meta.opt_f32("attention.scale")?.unwrap_or(0.0),
            logits: meta.opt_f32("logit_scale")?.unwrap_or(1.0),
        }),
        other => {
            return Err(Error::Unsupported(format!(
                "architecture '{other}' (kiln runs {})",
                SUPPORTED_ARCHITECTURES.join(", ")
            )))
        }
    };

    let num_layers = meta.usize("block_count")?;
    let hidden_size = meta.usize("embedding_length")?;
    let ffn_size = meta.usize("feed_forward_length")?;
    let num_heads = meta.usize("attention.head_count")?;
    let num_kv_heads = meta
        .opt_usize("attention.head_count_kv")?
        .unwrap_or(num_heads);
    let context_length = meta.usize("context_length")?;
    let norm_eps = meta.f32("attention.layer_norm_rms_epsilon")?;
    if num_heads == 0 {
        return Err(Error::Format(format!(
            "{arch_name}.attention.head_count is 0"
        )));
    }
    let head_dim = match meta.opt_usize("attention.key_length")? {
        Some(d) => d,
        None if hidden_size % num_heads == 0 => hidden_size / num_heads,
        None => {
            return Err(Error::Format(format!(
                "hidden size {hidden_size} does not split into {num_heads} heads and {arch_name}.attention.key_length is absent"
            )))
        }
    };
    if let Some(v) = meta.opt_usize("attention.value_length")? {
        if v != head_dim {
            return Err(Error::Unsupported(format!(
                "value head size {v} differs from key head size {head_dim}"
            )));
        }
    }

    let theta = meta.opt_f32("rope.freq_base")?.unwrap_or(10_000.0);
    let rotary_dims = meta.opt_usize("rope.dimension_count")?.unwrap_or(head_dim);
    let scaling = match (
        file.get_str(&meta.key("rope.scaling.type")),
        meta.opt_f32("rope.scaling.factor")?,
    ) {
        (None | Some("none"), _) => match meta.opt_f32("rope.scale_linear")? {
            // The key older converters wrote for linear scaling.
            Some(f) if f != 1.0 => RopeScaling::Linear { factor: f },
            _ => RopeScaling::None,
        },
        (Some("linear"), Some(factor)) if factor > 0.0 => {
            if factor == 1.0 {
                RopeScaling::None
            } else {
                RopeScaling::Linear { factor }
            }
        }
        (Some("linear"), f) => {
            return Err(Error::Format(format!(
                "linear rope scaling with factor {f:?}"
            )))
        }
        // gpt-oss's reference leaves YaRN's ramp unrounded (transformers' `truncate: false`
        // in its config); the file does not say so, the family does.
        (Some("yarn"), factor) => yarn_scaling(&meta, factor, arch != Architecture::GptOss)?,
        (Some(other), _) => return Err(Error::Unsupported(format!("rope scaling '{other}'"))),
    };
    let rope_kind = gguf_rope_kind(&arch);
    let arch = match arch {
        Architecture::Granite(scales) if scales.attention == 0.0 => {
            Architecture::Granite(GraniteScales {
                attention: 1.0 / (head_dim as f32).sqrt(),
                ..scales
            })
        }
        arch => arch,
    };
    // Gemma 3 as llama.cpp reads it: five windowed layers (local RoPE base 10,000, unscaled)
    // to one global; the window is in the file, the rest is the family's definition.
    let sliding_window = match arch {
        Architecture::Gemma3 => Some(SlidingWindow {
            window: meta.usize("attention.sliding_window")?,
            global_every: 6,
            local_theta: Some(10_000.0),
        }),
        // Phi-3 files of models trained with a window say so; it binds every layer (as
        // transformers runs them: no layer is global, and all rotate with the one base).
        Architecture::Phi3 => meta
            .opt_usize("attention.sliding_window")?
            .filter(|&w| w > 0)
            .map(|window| SlidingWindow {
                window,
                global_every: num_layers + 1,
                local_theta: None,
            }),
        // gpt-oss as llama.cpp and transformers run it: the first layer of each pair
        // windowed, rotating as the global ones do.
        Architecture::GptOss => Some(SlidingWindow {
            window: meta.usize("attention.sliding_window")?,
            global_every: 2,
            local_theta: None,
        }),
        _ => None,
    };
    let experts = expert_config(&meta, arch, ffn_size)?;

    let token_embd = file
        .tensor("token_embd.weight")
        .ok_or_else(|| Error::Format("tensor 'token_embd.weight' is missing".into()))?;
    let vocab_size = match meta.opt_usize("vocab_size")? {
        Some(v) => v,
        None => match token_embd.dims.as_slice() {
            [_, v] => *v,
            _ => file
                .get_string_array("tokenizer.ggml.tokens")
                .map(|t| t.len())
                .ok_or_else(|| Error::Format("vocabulary size is not stated anywhere".into()))?,
        },
    };

    let has = |name: &str| file.tensor(name).is_some();
    let config = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        ffn_size,
        norm_eps,
        // Gemma's GeGLU uses the tanh-approximated GELU (`gelu_pytorch_tanh`).
        activation: match arch {
            Architecture::Gemma3 => Activation::Gelu,
            Architecture::GptOss => Activation::GPT_OSS,
            _ => Activation::Silu,
        },
        rope: RopeConfig {
            kind: rope_kind,
            theta,
            scaling,
            rotary_dims,
        },
        tied_embeddings: !has("output.weight"),
        context_length,
        // The scale in f32, as HF and llama.cpp compute it.
        embedding_scale: match arch {
            Architecture::Gemma3 => (hidden_size as f32).sqrt(),
            Architecture::Granite(_) => meta.opt_f32("embedding_scale")?.unwrap_or(1.0),
            _ => 1.0,
        },
        sliding_window,
        experts,
        ..ModelConfig::default()
    };
    config.validate()?;
    Ok(config)
}

/// Chooses the backend to run `model`: the one named `preferred`, or the best-scoring
/// registered backend for the model's qtypes. Returns it with every backend's verdict,
/// best first, so a caller can show why the others were not chosen.
pub fn dispatch(
    model: &ModelIr,
    registry: &Registry,
    preferred: Option<&str>,
) -> Result<(Arc<dyn Backend>, Vec<Candidate>)> {
    registry.select(model, preferred)
}

/// YaRN rope scaling from llama.cpp's keys: `rope.scaling.factor` and
/// `rope.scaling.original_context_length` (required), `yarn_beta_fast` / `yarn_beta_slow`
/// (32 and 1 when absent, llama.cpp's and transformers' defaults) and `yarn_attn_factor`
/// (1), which multiplies YaRN's own 1 + 0.1·ln(factor). The variants kiln does not run —
/// a partial extrapolation mix (`yarn_ext_factor` other than 1) and DeepSeek's
/// `yarn_log_multiplier` — are refused by name rather than run with other positions.
fn yarn_scaling(meta: &Meta<'_>, factor: Option<f32>, truncate: bool) -> Result<RopeScaling> {
    let factor = match factor {
        Some(f) if f >= 1.0 => f,
        f => {
            return Err(Error::Format(format!(
                "YaRN rope scaling with factor {f:?} (needs a number of at least 1)"
            )))
        }
    };
    let original_context = meta.usize("rope.scaling.original_context_length")?;
    for (key, neutral) in [
        ("rope.scaling.yarn_ext_factor", 1.0),
        ("rope.scaling.yarn_log_multiplier", 0.0),
    ] {
        if let Some(v) = meta.opt_f32(key)? {
            if v != neutral {
                return Err(Error::Unsupported(format!(
                    "YaRN with '{}' = {v} (kiln runs the plain YaRN of Qwen's long-context models)",
                    meta.key(key)
                )));
            }
        }
    }
    let attn = meta
        .opt_f32("rope.scaling.yarn_attn_factor")?
        .unwrap_or(1.0);
    Ok(RopeScaling::Yarn {
        factor,
        original_context,
        beta_fast: meta.opt_f32("rope.scaling.yarn_beta_fast")?.unwrap_or(32.0),
        beta_slow: meta.opt_f32("rope.scaling.yarn_beta_slow")?.unwrap_or(1.0),
        attn_factor: attn * RopeScaling::yarn_mscale(factor),
        truncate,
    })
}

/// The Mixture-of-Experts sizes of a file with `{arch}.expert_count` above 0, as llama.cpp
/// reads them: `expert_used_count` experts a token, each of `expert_feed_forward_length`
/// (Mixtral's files give only `feed_forward_length`), probabilities renormalised over the
/// chosen unless `expert_weights_norm` says otherwise (llama.cpp renormalises for both
/// Mixtral and Qwen3-MoE). Bounded by [`ModelConfig::validate`] before anything is sized
/// by them.
fn expert_config(
    meta: &Meta<'_>,
    arch: Architecture,
    ffn_size: usize,
) -> Result<Option<ExpertConfig>> {
    let count = meta.opt_usize("expert_count")?.filter(|&n| n > 0);
    match (count, arch) {
        (None, Architecture::Qwen3Moe | Architecture::GptOss) => Err(Error::Format(format!(
            "a {} model needs metadata '{}' above 0",
            arch.name(),
            meta.key("expert_count")
        ))),
        (None, _) => Ok(None),
        (
            Some(count),
            Architecture::Llama
            | Architecture::Mistral
            | Architecture::Qwen3Moe
            | Architecture::GptOss,
        ) => Ok(Some(ExpertConfig {
            count,
            used: meta.usize("expert_used_count")?,
            ffn_size: meta
                .opt_usize("expert_feed_forward_length")?
                .unwrap_or(ffn_size),
            normalize_weights: meta.opt_bool("expert_weights_norm")?.unwrap_or(true),
        })),
        (Some(_), other) => Err(Error::Unsupported(format!(
            "experts in a {} model (kiln runs them in llama, mistral, qwen3moe and gpt-oss files)",
            other.name()
        ))),
    }
}

/// The rotary layout of an architecture's GGUF files: llama.cpp's converter permutes Q/K
/// of llama-family models into adjacent-pair order; Qwen's, Gemma's and Phi's are left in
/// the HF split-halves order.
pub(crate) fn gguf_rope_kind(arch: &Architecture) -> RopeKind {
    match arch {
        Architecture::Llama | Architecture::Mistral | Architecture::Granite(_) => RopeKind::Norm,
        Architecture::Qwen2
        | Architecture::Qwen3
        | Architecture::Qwen3Moe
        | Architecture::Gemma3
        | Architecture::Phi3
        | Architecture::GptOss => RopeKind::Neox,
    }
}

/// Typed metadata lookups under the `{arch}.` prefix, with errors naming the key.
struct Meta<'a> {
    file: &'a GgufFile,
    arch: &'a str,
}

impl Meta<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn opt_usize(&self, k: &str) -> Result<Option<usize>> {
        let key = self.key(k);
        match self.file.get(&key) {
            None => Ok(None),
            Some(v) => v.as_usize().map(Some).ok_or_else(|| {
                Error::Format(format!(
                    "metadata '{key}' should be a non-negative integer, found {v}"
                ))
            }),
        }
    }
    fn usize(&self, k: &str) -> Result<usize> {
        self.opt_usize(k)?
            .ok_or_else(|| Error::Format(format!("metadata '{}' is missing", self.key(k))))
    }
    fn opt_f32(&self, k: &str) -> Result<Option<f32>> {
        let key = self.key(k);
        match self.file.get(&key) {
            None => Ok(None),
            Some(v) => match v.as_f32() {
                Some(x) if x.is_finite() => Ok(Some(x)),
                _ => Err(Error::Format(format!(
                    "metadata '{key}' should be a finite number, found {v}"
                ))),
            },
        }
    }
    fn opt_bool(&self, k: &str) -> Result<Option<bool>> {
        let key = self.key(k);
        match self.file.get(&key) {
            None => Ok(None),
            Some(v) => v.as_bool().map(Some).ok_or_else(|| {
                Error::Format(format!("metadata '{key}' should be a boolean, found {v}"))
            }),
        }
    }
    fn f32(&self, k: &str) -> Result<f32> {
        self.opt_f32(k)?
            .ok_or_else(|| Error::Format(format!("metadata '{}' is missing", self.key(k))))
    }
}

/// A model file's tensors under GGUF-style names (`blk.N.attn_q.weight`), each a view of
/// its bytes (ggml dims order), whatever the file format: what the role mapping reads.
#[derive(Default)]
pub(crate) struct TensorTable {
    entries: Vec<TensorView>,
    by_name: HashMap<String, usize>,
}

impl TensorTable {
    /// Adds `view` under `name`; a second tensor of the same name is an error.
    pub(crate) fn push(&mut self, name: String, view: TensorView) -> Result<()> {
        if self
            .by_name
            .insert(name.clone(), self.entries.len())
            .is_some()
        {
            return Err(Error::Format(format!("two tensors are named '{name}'")));
        }
        self.entries.push(view);
        Ok(())
    }

    pub(crate) fn get(&self, name: &str) -> Option<&TensorView> {
        self.by_name.get(name).map(|&i| &self.entries[i])
    }
}

/// Tensor lookups that check shapes and remember which tensors found a role.
struct Tensors {
    table: TensorTable,
    used: Vec<bool>,
}

impl Tensors {
    fn info(&mut self, name: &str) -> Option<TensorView> {
        let i = *self.table.by_name.get(name)?;
        self.used[i] = true;
        Some(self.table.entries[i].clone())
    }

    fn opt(&mut self, name: &str, dims: &[usize]) -> Result<Option<TensorView>> {
        let Some(view) = self.info(name) else {
            return Ok(None);
        };
        check_dims(name, view.dims(), dims)?;
        Ok(Some(view))
    }

    fn req(&mut self, name: &str, dims: &[usize]) -> Result<TensorView> {
        self.opt(name, dims)?
            .ok_or_else(|| Error::Format(format!("tensor '{name}' is missing")))
    }

    /// The names of the tensors that found no role.
    fn unused(&self) -> impl Iterator<Item = &str> + '_ {
        let mut names: Vec<(&usize, &str)> = self
            .table
            .by_name
            .iter()
            .map(|(n, i)| (i, n.as_str()))
            .collect();
        names.sort();
        names
            .into_iter()
            .filter(|(i, _)| !self.used[**i])
            .map(|(_, n)| n)
    }
}

fn check_dims(name: &str, actual: &[usize], expected: &[usize]) -> Result<()> {
    if actual != expected {
        return Err(Error::Format(format!(
            "tensor '{name}': expected dims {expected:?}, found {actual:?}"
        )));
    }
    Ok(())
}

/// Layer `i`'s `role` projection of every expert: the stacked `ffn_{role}_exps` tensor, or,
/// in older Mixtral files, one `ffn_{role}.E.weight` a expert (each of `dims`).
fn expert_tensors(
    t: &mut Tensors,
    i: usize,
    role: &str,
    dims: [usize; 2],
    count: usize,
) -> Result<ExpertTensors> {
    let stacked = format!("blk.{i}.ffn_{role}_exps.weight");
    let per_expert = |e: usize| format!("blk.{i}.ffn_{role}.{e}.weight");
    if t.table.get(&stacked).is_some() || t.table.get(&per_expert(0)).is_none() {
        return Ok(ExpertTensors::Stacked(
            t.req(&stacked, &[dims[0], dims[1], count])?,
        ));
    }
    (0..count)
        .map(|e| t.req(&per_expert(e), &dims))
        .collect::<Result<_>>()
        .map(ExpertTensors::PerExpert)
}

/// Layer `i`'s dense feed-forward (gate, up, down). A gate/up pair stored as one tensor of
/// twice the rows (Phi-3), gate first, is split into its halves without copying.
fn dense_feed_forward(
    t: &mut Tensors,
    i: usize,
    c: &ModelConfig,
) -> Result<(TensorView, TensorView, TensorView)> {
    let n = |role: &str| format!("blk.{i}.{role}");
    let hidden = c.hidden_size;
    let (gate, up) = match t.info(&n("ffn_gate.weight")) {
        None if t
            .info(&n("ffn_up.weight"))
            .is_some_and(|u| u.dims() == [hidden, 2 * c.ffn_size]) =>
        {
            let name = n("ffn_up.weight");
            let fused = t.req(&name, &[hidden, 2 * c.ffn_size])?;
            (
                fused.slice_rows(&n("ffn_gate.weight"), 0, c.ffn_size)?,
                fused.slice_rows(&name, c.ffn_size, c.ffn_size)?,
            )
        }
        _ => (
            t.req(&n("ffn_gate.weight"), &[hidden, c.ffn_size])?,
            t.req(&n("ffn_up.weight"), &[hidden, c.ffn_size])?,
        ),
    };
    let down = t.req(&n("ffn_down.weight"), &[c.ffn_size, hidden])?;
    Ok((gate, up, down))
}

/// The optional parts a model's layers have: a part any layer has, every layer must have
/// (a layer missing one is an error naming the tensor, never a layer run without it).
/// Which architectures need which parts is their builders' to check
/// ([`kiln_core::program`]).
struct LayerParts {
    qkv_bias: bool,
    head_norms: bool,
    post_norms: bool,
}

impl LayerParts {
    fn of(t: &Tensors, c: &ModelConfig) -> LayerParts {
        let layers = c.num_layers;
        let any = |roles: &[&str]| {
            (0..layers).any(|i| {
                roles
                    .iter()
                    .any(|r| t.table.get(&format!("blk.{i}.{r}")).is_some())
            })
        };
        LayerParts {
            qkv_bias: any(&["attn_q.bias", "attn_k.bias", "attn_v.bias", "attn_qkv.bias"]),
            head_norms: any(&["attn_q_norm.weight", "attn_k_norm.weight"]),
            // gpt-oss's `post_attention_norm` is its feed-forward's pre-norm (llama.cpp's
            // name for the norm after attention's residual add), not a post-norm.
            post_norms: c.arch != Architecture::GptOss
                && any(&["post_attention_norm.weight", "post_ffw_norm.weight"]),
        }
    }
}

fn weights(t: &mut Tensors, c: &ModelConfig) -> Result<ModelWeights> {
    let (hidden, vocab, q_dim, kv_dim) = (c.hidden_size, c.vocab_size, c.q_dim(), c.kv_dim());
    let token_embd = t.req("token_embd.weight", &[hidden, vocab])?;
    let output_norm = t.req("output_norm.weight", &[hidden])?;
    let output_norm_bias = t.opt("output_norm.bias", &[hidden])?;
    let output = t.opt("output.weight", &[hidden, vocab])?;
    let rope_freqs = t.opt("rope_freqs.weight", &[c.rope.rotary_dims / 2])?;

    let parts = LayerParts::of(t, c);
    let ffn_norm_name = match c.arch {
        Architecture::GptOss => "post_attention_norm",
        _ => "ffn_norm",
    };
    let mut layers = Vec::with_capacity(c.num_layers);
    for i in 0..c.num_layers {
        let n = |role: &str| format!("blk.{i}.{role}");
        let (attn_q, attn_k, attn_v) = match t.info(&n("attn_qkv.weight")) {
            Some(fused) => {
                let name = n("attn_qkv.weight");
                check_dims(&name, fused.dims(), &[hidden, q_dim + 2 * kv_dim])?;
                (
                    fused.slice_rows(&n("attn_q.weight"), 0, q_dim)?,
                    fused.slice_rows(&n("attn_k.weight"), q_dim, kv_dim)?,
                    fused.slice_rows(&n("attn_v.weight"), q_dim + kv_dim, kv_dim)?,
                )
            }
            None => (
                t.req(&n("attn_q.weight"), &[hidden, q_dim])?,
                t.req(&n("attn_k.weight"), &[hidden, kv_dim])?,
                t.req(&n("attn_v.weight"), &[hidden, kv_dim])?,
            ),
        };
        let (attn_q_bias, attn_k_bias, attn_v_bias) = match t.info(&n("attn_qkv.bias")) {
            Some(fused) => {
                check_dims(&n("attn_qkv.bias"), fused.dims(), &[q_dim + 2 * kv_dim])?;
                (
                    Some(fused.slice_vector(&n("attn_q.bias"), 0, q_dim)?),
                    Some(fused.slice_vector(&n("attn_k.bias"), q_dim, kv_dim)?),
                    Some(fused.slice_vector(&n("attn_v.bias"), q_dim + kv_dim, kv_dim)?),
                )
            }
            None => (
                t.opt(&n("attn_q.bias"), &[q_dim])?,
                t.opt(&n("attn_k.bias"), &[kv_dim])?,
                t.opt(&n("attn_v.bias"), &[kv_dim])?,
            ),
        };
        let biases = [&attn_q_bias, &attn_k_bias, &attn_v_bias]
            .iter()
            .filter(|b| b.is_some())
            .count();
        if biases != if parts.qkv_bias { 3 } else { 0 } {
            return Err(Error::Format(format!(
                "layer {i} has {biases} of the 3 Q/K/V biases; a model with any has all 3 in every layer"
            )));
        }
        let mut optional_pair = |present: bool, roles: [&str; 2], dim: usize| match present {
            true => Ok::<_, Error>((
                Some(t.req(&n(roles[0]), &[dim])?),
                Some(t.req(&n(roles[1]), &[dim])?),
            )),
            false => Ok((None, None)),
        };
        // llama.cpp's converter stores Gemma's `1 + weight` norms with the 1 added: plain
        // RMSNorm weights here, like every other norm.
        let (attn_post_norm, ffn_post_norm) = optional_pair(
            parts.post_norms,
            ["post_attention_norm.weight", "post_ffw_norm.weight"],
            hidden,
        )?;
        let (attn_q_norm, attn_k_norm) = optional_pair(
            parts.head_norms,
            ["attn_q_norm.weight", "attn_k_norm.weight"],
            c.head_dim,
        )?;
        let (ffn_gate, ffn_up, ffn_down, experts) = match c.experts {
            None => {
                let (gate, up, down) = dense_feed_forward(t, i, c)?;
                (Some(gate), Some(up), Some(down), None)
            }
            Some(e) => {
                let width = e.ffn_size;
                // Biases, where the router has one, on the router and every projection.
                let biases = match t.opt(&n("ffn_gate_inp.bias"), &[e.count])? {
                    Some(router) => Some(ExpertBiases {
                        router,
                        gate: t.req(&n("ffn_gate_exps.bias"), &[width, e.count])?,
                        up: t.req(&n("ffn_up_exps.bias"), &[width, e.count])?,
                        down: t.req(&n("ffn_down_exps.bias"), &[hidden, e.count])?,
                    }),
                    None => None,
                };
                let experts = ExpertWeights {
                    router: t.req(&n("ffn_gate_inp.weight"), &[hidden, e.count])?,
                    gate: expert_tensors(t, i, "gate", [hidden, width], e.count)?,
                    up: expert_tensors(t, i, "up", [hidden, width], e.count)?,
                    down: expert_tensors(t, i, "down", [width, hidden], e.count)?,
                    biases,
                };
                // A dense feed-forward beside the experts (a shared expert) is read so that
                // the builder can refuse it by name rather than the file being refused for
                // a leftover tensor.
                let gate = t.opt(&n("ffn_gate.weight"), &[hidden, c.ffn_size])?;
                let up = t.opt(&n("ffn_up.weight"), &[hidden, c.ffn_size])?;
                let down = t.opt(&n("ffn_down.weight"), &[c.ffn_size, hidden])?;
                (gate, up, down, Some(experts))
            }
        };
        layers.push(LayerWeights {
            attn_norm: t.req(&n("attn_norm.weight"), &[hidden])?,
            attn_norm_bias: t.opt(&n("attn_norm.bias"), &[hidden])?,
            attn_q,
            attn_k,
            attn_v,
            attn_q_bias,
            attn_k_bias,
            attn_v_bias,
            attn_q_norm,
            attn_k_norm,
            attn_out: t.req(&n("attn_output.weight"), &[q_dim, hidden])?,
            attn_out_bias: t.opt(&n("attn_output.bias"), &[hidden])?,
            attn_sinks: t.opt(&n("attn_sinks.weight"), &[c.num_heads])?,
            ffn_norm: Some(t.req(&n(&format!("{ffn_norm_name}.weight")), &[hidden])?),
            ffn_norm_bias: t.opt(&n(&format!("{ffn_norm_name}.bias")), &[hidden])?,
            ffn_gate,
            ffn_up,
            ffn_down,
            experts,
            attn_post_norm,
            ffn_post_norm,
        });
    }
    Ok(ModelWeights {
        token_embd,
        layers,
        output_norm,
        output_norm_bias,
        output,
        rope_freqs,
    })
}
