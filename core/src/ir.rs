//! The model IR: what a model *is*, independent of the file it came from.
//!
//! A file reader (kiln-formats) fills a [`ModelIr`]: a [`ModelConfig`] with every
//! hyper-parameter a decoder needs, and [`ModelWeights`] whose tensors are [`TensorView`]s
//! into the memory-mapped file. Roles are typed fields, so a backend never looks a weight up
//! by name after load.

use std::ops::Deref;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::qtype::QType;

/// Bytes that outlive every view of them: a memory-mapped file, or an owned buffer.
pub trait Storage: Deref<Target = [u8]> + Send + Sync + 'static {}
impl<T: Deref<Target = [u8]> + Send + Sync + 'static> Storage for T {}

/// One tensor: type, shape and a zero-copy window into its storage.
///
/// `dims[0]` is the contiguous row length (ggml order); a 2-D weight of `dims = [k, n]`
/// has `n` rows of `k` values, and multiplies an input of length `k`.
#[derive(Clone)]
pub struct TensorView {
    name: Arc<str>,
    qtype: QType,
    dims: Vec<usize>,
    storage: Arc<dyn Storage>,
    offset: usize,
    len: usize,
}

impl TensorView {
    /// A view of `storage[offset..offset + len]`; checks that the byte length matches
    /// the type and dims.
    pub fn new(
        name: impl Into<Arc<str>>,
        qtype: QType,
        dims: Vec<usize>,
        storage: Arc<dyn Storage>,
        offset: usize,
    ) -> Result<Self> {
        let name = name.into();
        let len = qtype
            .tensor_bytes(&dims)
            .map_err(|e| Error::Format(format!("tensor {name}: {e}")))?;
        let end = offset
            .checked_add(len)
            .filter(|&end| end <= storage.len())
            .ok_or_else(|| {
                Error::Format(format!(
                    "tensor {name}: bytes {offset}..{offset}+{len} lie past the end of the data ({} bytes)",
                    storage.len()
                ))
            })?;
        debug_assert!(end <= storage.len());
        Ok(TensorView {
            name,
            qtype,
            dims,
            storage,
            offset,
            len,
        })
    }

    /// A tensor holding its own copy of `bytes` (tests, synthesised weights).
    pub fn from_bytes(name: &str, qtype: QType, dims: Vec<usize>, bytes: Vec<u8>) -> Result<Self> {
        TensorView::new(name, qtype, dims, Arc::new(bytes), 0)
    }

    /// An f32 tensor holding `values`.
    pub fn from_f32(name: &str, dims: Vec<usize>, values: &[f32]) -> Result<Self> {
        TensorView::from_bytes(
            name,
            QType::F32,
            dims,
            bytemuck::cast_slice(values).to_vec(),
        )
    }

    pub fn name(&self) -> &str {
        &self.name
    }
    pub fn qtype(&self) -> QType {
        self.qtype
    }
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }
    pub fn bytes(&self) -> &[u8] {
        &self.storage[self.offset..self.offset + self.len]
    }
    /// Values per row (`dims[0]`).
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(1)
    }
    /// Number of rows (product of `dims[1..]`).
    pub fn rows(&self) -> usize {
        self.dims.iter().skip(1).product()
    }
    pub fn elements(&self) -> usize {
        self.dims.iter().product()
    }
    /// Bytes of one row.
    pub fn row_bytes(&self) -> usize {
        self.qtype
            .row_bytes(self.row_len())
            .expect("checked in TensorView::new")
    }
    /// The bytes of row `i`.
    pub fn row(&self, i: usize) -> &[u8] {
        let rb = self.row_bytes();
        &self.bytes()[i * rb..(i + 1) * rb]
    }

    /// Rows `start..start + count` as their own view (zero-copy). Used to split a fused
    /// QKV tensor into its Q, K and V parts.
    pub fn slice_rows(&self, name: &str, start: usize, count: usize) -> Result<TensorView> {
        if self.dims.len() != 2 || start + count > self.rows() {
            return Err(Error::InvalidShape(format!(
                "cannot take rows {start}..{} of {} with dims {:?}",
                start + count,
                self.name,
                self.dims
            )));
        }
        let rb = self.row_bytes();
        TensorView::new(
            name,
            self.qtype,
            vec![self.row_len(), count],
            self.storage.clone(),
            self.offset + start * rb,
        )
    }

    /// Columns (input values) `start..start + count` of every row of a 2-D tensor, copied
    /// into a tensor of their own (a tensor-parallel rank's share of a matrix it multiplies
    /// a slice of the input with). Both must fall on block boundaries.
    pub fn slice_columns(&self, name: &str, start: usize, count: usize) -> Result<TensorView> {
        let block = self.qtype.block_len();
        let fits = start
            .checked_add(count)
            .is_some_and(|end| end <= self.row_len());
        if self.dims.len() != 2 || !fits || start % block != 0 || count % block != 0 {
            return Err(Error::InvalidShape(format!(
                "cannot take columns {start}+{count} of {} with dims {:?} in {}-value blocks",
                self.name, self.dims, block
            )));
        }
        let skip = self.qtype.row_bytes(start)?;
        let take = self.qtype.row_bytes(count)?;
        let mut bytes = Vec::with_capacity(take * self.rows());
        for r in 0..self.rows() {
            bytes.extend_from_slice(&self.row(r)[skip..skip + take]);
        }
        TensorView::from_bytes(name, self.qtype, vec![count, self.rows()], bytes)
    }

    /// Matrix `i` of a stack of matrices (dims `[row_len, rows, n]`: Mixture-of-Experts
    /// weights, one matrix per expert) as its own 2-D view (zero-copy).
    pub fn matrix(&self, i: usize) -> Result<TensorView> {
        match self.dims[..] {
            [row_len, rows, n] if i < n => {
                let bytes = rows * self.row_bytes();
                TensorView::new(
                    format!("{}[{i}]", self.name).as_str(),
                    self.qtype,
                    vec![row_len, rows],
                    self.storage.clone(),
                    self.offset + i * bytes,
                )
            }
            _ => Err(Error::InvalidShape(format!(
                "cannot take matrix {i} of {} with dims {:?}",
                self.name, self.dims
            ))),
        }
    }

    /// Elements `start..start + count` of a 1-D tensor as their own view (zero-copy): a
    /// fused Q/K/V bias split into its parts. `start` must fall on a block boundary.
    pub fn slice_vector(&self, name: &str, start: usize, count: usize) -> Result<TensorView> {
        let aligned = start.is_multiple_of(self.qtype.block_len());
        if self.dims.len() != 1
            || !aligned
            || start
                .checked_add(count)
                .is_none_or(|end| end > self.dims[0])
        {
            return Err(Error::InvalidShape(format!(
                "cannot take elements {start}+{count} of {} with dims {:?}",
                self.name, self.dims
            )));
        }
        let skip = self.qtype.row_bytes(start)?;
        TensorView::new(
            name,
            self.qtype,
            vec![count],
            self.storage.clone(),
            self.offset + skip,
        )
    }

    /// Dequantised copy of the whole tensor (small tensors: norms, biases).
    pub fn to_f32(&self) -> Result<Vec<f32>> {
        let mut out = vec![0.0f32; self.elements()];
        crate::quant::dequantize(self.qtype, self.bytes(), &mut out)?;
        Ok(out)
    }
}

impl std::fmt::Debug for TensorView {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TensorView({} {} {:?})",
            self.name, self.qtype, self.dims
        )
    }
}

/// Model family. Decides defaults that the file does not spell out (rope layout ...), and
/// carries the hyper-parameters only its family has.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Architecture {
    /// Llama 1/2/3, SmolLM, and other llama-shaped models.
    Llama,
    Mistral,
    /// Qwen2 / Qwen2.5: llama shape with Q/K/V biases and NEOX rope.
    Qwen2,
    /// Qwen3: explicit head_dim and per-head RMSNorm on Q and K.
    Qwen3,
    /// Gemma 3: embeddings scaled by √hidden, RMSNorm before and after attention and the
    /// MLP, per-head Q/K norms, GeGLU, sliding-window attention on most layers.
    Gemma3,
    /// Phi-3: llama's blocks with NEOX rope, Q/K/V and gate/up each stored as one fused
    /// tensor (split at load), and a sliding window on every layer in some files.
    Phi3,
    /// IBM Granite 3: llama's blocks with the multipliers of its `GraniteConfig`.
    Granite(GraniteScales),
    /// Qwen3-MoE (Qwen3-30B-A3B): Qwen3's attention, a Mixture-of-Experts feed-forward in
    /// every layer (no shared expert).
    Qwen3Moe,
    /// OpenAI's gpt-oss: attention with biases and a learned sink logit per head, windowed
    /// on every other layer (the first of each pair) with the same YaRN rotation as the
    /// rest, and a Mixture of Experts whose router and experts have biases and whose gated
    /// activation is clamped ([`Activation::SwigluOai`]).
    GptOss,
}

/// Granite's multipliers (the embedding's is [`ModelConfig::embedding_scale`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct GraniteScales {
    /// Multiplies each attention and MLP output before it joins the residual.
    pub residual: f32,
    /// Multiplies q·k (in place of 1/√head_dim).
    pub attention: f32,
    /// Divides the logits.
    pub logits: f32,
}

impl Architecture {
    pub fn name(&self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma3 => "gemma3",
            Architecture::Phi3 => "phi3",
            Architecture::Granite(_) => "granite",
            Architecture::Qwen3Moe => "qwen3moe",
            Architecture::GptOss => "gpt-oss",
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NormKind {
    Rms,
    Layer,
}

/// The activation of a feed-forward. A gated feed-forward multiplies `act(gate)` by `up`
/// (gpt-oss's variant takes both, see [`Activation::gated`]).
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Activation {
    Silu,
    Gelu,
    /// gpt-oss's SwiGLU: the gate clamped to at most `limit` and the up projection to
    /// ±`limit`, then `gate · σ(alpha · gate) · (up + 1)`.
    SwigluOai {
        alpha: f32,
        limit: f32,
    },
}

impl Activation {
    /// gpt-oss's constants, which its files do not carry (transformers' `swiglu_alpha`
    /// and `swiglu_limit`; llama.cpp fixes them too).
    pub const GPT_OSS: Activation = Activation::SwigluOai {
        alpha: 1.702,
        limit: 7.0,
    };

    /// A gated feed-forward's value for one gate and up pair.
    #[inline]
    pub fn gated(self, gate: f32, up: f32) -> f32 {
        match self {
            Activation::Silu => up * silu(gate),
            Activation::Gelu => up * gelu_tanh(gate),
            Activation::SwigluOai { alpha, limit } => {
                // `min`/`clamp` would turn a NaN into the limit; it must reach the output.
                let g = if gate > limit { limit } else { gate };
                let u = if up > limit {
                    limit
                } else if up < -limit {
                    -limit
                } else {
                    up
                };
                g / (1.0 + (-alpha * g).exp()) * (u + 1.0)
            }
        }
    }

    /// An ungated feed-forward's activation of one value.
    #[inline]
    pub fn ungated(self, x: f32) -> f32 {
        match self {
            Activation::Silu => silu(x),
            Activation::Gelu => gelu_tanh(x),
            // Defined gated only; the builders never make it ungated.
            Activation::SwigluOai { .. } => Activation::gated(self, x, 0.0),
        }
    }
}

/// `x · σ(x)`.
#[inline]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

/// GELU with the tanh approximation (`gelu_pytorch_tanh`, what Gemma uses).
#[inline]
pub fn gelu_tanh(x: f32) -> f32 {
    const SQRT_2_OVER_PI: f32 = 0.797_884_6;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044_715 * x * x * x)).tanh())
}

/// How rotary embeddings pair up dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RopeKind {
    /// Adjacent pairs (x[2i], x[2i+1]) — ggml's "normal" mode, llama GGUFs.
    Norm,
    /// Split halves (x[i], x[i + d/2]) — GPT-NeoX / HF layout, Qwen.
    Neox,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum RopeScaling {
    None,
    /// Positions divided by `factor`.
    Linear {
        factor: f32,
    },
    /// YaRN ("NTK-by-parts" interpolation with an attention temperature), as Qwen's
    /// long-context configurations use it: rotary pairs that turn fewer than `beta_slow`
    /// times over the `original_context` take the frequency divided by `factor`, those that
    /// turn more than `beta_fast` times keep theirs, a linear ramp blends the pairs between;
    /// and both q and k are scaled by `attn_factor` (the rotated vectors' magnitude; YaRN's
    /// 1 + 0.1·ln(factor) times the file's own factor), so scores by its square.
    Yarn {
        factor: f32,
        original_context: usize,
        beta_fast: f32,
        beta_slow: f32,
        attn_factor: f32,
        /// Whether the ramp's ends are rounded outwards to whole pairs (llama.cpp and
        /// transformers' default); gpt-oss's reference leaves them where they fall
        /// (transformers' `truncate: false`).
        truncate: bool,
    },
}

impl RopeScaling {
    /// YaRN's attention temperature for a context scaled by `factor`: 1 + 0.1·ln(factor)
    /// (1 for no scaling).
    pub fn yarn_mscale(factor: f32) -> f32 {
        if factor <= 1.0 {
            1.0
        } else {
            1.0 + 0.1 * factor.ln()
        }
    }
}

#[derive(Debug, Clone, PartialEq)]
pub struct RopeConfig {
    pub kind: RopeKind,
    pub theta: f32,
    pub scaling: RopeScaling,
    /// Leading dimensions of each head that rotate (== head_dim unless partial rotary).
    pub rotary_dims: usize,
}

impl RopeConfig {
    /// Inverse frequency of rotary pair `i` (0 ≤ i < rotary_dims/2), with per-pair
    /// `freq_factors` (llama-3 rope scaling stores them as `rope_freqs`) applied.
    pub fn inv_freq(&self, i: usize, freq_factors: Option<&[f32]>) -> f32 {
        let base = self.theta.powf(-2.0 * i as f32 / self.rotary_dims as f32);
        let factor = freq_factors.and_then(|f| f.get(i).copied()).unwrap_or(1.0);
        let scale = match self.scaling {
            RopeScaling::None => 1.0,
            RopeScaling::Linear { factor } => 1.0 / factor,
            RopeScaling::Yarn {
                factor: yarn,
                original_context,
                beta_fast,
                beta_slow,
                truncate,
                ..
            } => {
                // The pair index at which a frequency turns `rotations` times over the
                // original context; the ramp runs between those of beta_fast and beta_slow
                // (rounded outwards, within the pairs), and its share of extrapolation (the
                // unscaled frequency) falls from 1 to 0 across it.
                let dims = self.rotary_dims as f64;
                let ln_base = (self.theta as f64).ln();
                let pair_at = |rotations: f32| {
                    dims * (original_context as f64
                        / (rotations as f64 * 2.0 * std::f64::consts::PI))
                        .ln()
                        / (2.0 * ln_base)
                };
                let (low, high) = match truncate {
                    true => (pair_at(beta_fast).floor(), pair_at(beta_slow).ceil()),
                    false => (pair_at(beta_fast), pair_at(beta_slow)),
                };
                let (low, high) = (low.max(0.0), high.min(dims - 1.0));
                let ramp = ((i as f64 - low) / (high - low).max(0.001)).clamp(0.0, 1.0);
                let extrapolated = 1.0 - ramp;
                (extrapolated + (1.0 - extrapolated) / yarn as f64) as f32
            }
        };
        base * scale / factor
    }

    /// What RoPE scales q and k by (YaRN's attention temperature; 1 otherwise).
    pub fn attention_factor(&self) -> f32 {
        match self.scaling {
            RopeScaling::Yarn { attn_factor, .. } => attn_factor,
            _ => 1.0,
        }
    }
}

/// Every hyper-parameter a decoder needs. Nothing here is derived at run time from names.
///
/// Sizes and numbers only: which optional weights a layer has (Q/K/V biases, per-head Q/K
/// norms, post-norms, a gate) is the weights' to say, and how the blocks are wired is the
/// architecture's builder's ([`crate::program`]), so no switch here describes structure.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub vocab_size: usize,
    pub hidden_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    /// Per-head dimension; explicit because Qwen3 and Gemma have heads*head_dim != hidden.
    pub head_dim: usize,
    pub ffn_size: usize,
    pub norm: NormKind,
    pub norm_eps: f32,
    pub activation: Activation,
    pub rope: RopeConfig,
    /// The LM head reuses the token embedding.
    pub tied_embeddings: bool,
    /// Longest context the model was trained for.
    pub context_length: usize,
    /// Multiplies the token embedding before the first layer (Gemma: √hidden; else 1).
    pub embedding_scale: f32,
    /// Sliding-window attention on some layers, if the model has it.
    pub sliding_window: Option<SlidingWindow>,
    /// The Mixture-of-Experts feed-forward's sizes, if the model has one.
    pub experts: Option<ExpertConfig>,
}

/// A Mixture-of-Experts feed-forward (Mixtral, Qwen3-MoE): a router scores every expert for
/// each token, the `used` best run (each a gated FFN of `ffn_size`), and their outputs are
/// summed weighted by the router's softmax probabilities.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct ExpertConfig {
    /// Experts in each layer.
    pub count: usize,
    /// Experts each token runs.
    pub used: usize,
    /// Each expert's feed-forward width.
    pub ffn_size: usize,
    /// Whether the chosen experts' probabilities are divided by their sum (Mixtral and
    /// Qwen3-MoE: yes) or used as the softmax over all experts left them.
    pub normalize_weights: bool,
}

impl ExpertConfig {
    /// Most experts a layer may have (DeepSeek-V3 has 256).
    pub const MAX_EXPERTS: usize = 1024;
}

/// Attention over a window of recent positions on most layers and over the whole context on
/// every `global_every`-th (Gemma 3: 512 positions, every sixth layer global).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SlidingWindow {
    /// Positions a windowed layer attends to, its own included.
    pub window: usize,
    /// Layers `global_every - 1`, `2·global_every - 1`, … attend to the whole context.
    pub global_every: usize,
    /// RoPE base of the windowed layers (unscaled; `rope.theta` is the global layers'), or
    /// `None` where they rotate as the global ones do (gpt-oss, Phi-3).
    pub local_theta: Option<f32>,
}

/// How one layer attends: over the last `window` positions (or all of them) with its
/// RoPE base.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct LayerAttention {
    pub window: Option<usize>,
    pub local_rope: bool,
}

impl LayerAttention {
    /// The first position a query at `pos` attends to.
    pub fn first_position(&self, pos: usize) -> usize {
        self.window.map_or(0, |w| (pos + 1).saturating_sub(w))
    }

    /// Whether cutting a sequence from `old` positions back to `len` loses cache rows the
    /// next token attends to, when this layer keeps its positions in a ring of `rows` rows
    /// (position p in row p % rows): the ring has overwritten position q once
    /// q + rows < old, and the next token reads the window before `len`. A layer that keeps
    /// every position never loses one. What was lost depends on every earlier position
    /// through the layers below, so a backend runs the kept prefix again.
    pub fn truncation_loses_rows(&self, rows: usize, old: usize, len: usize) -> bool {
        match self.window {
            Some(w) => {
                let needed = (len + 1).saturating_sub(w);
                len > needed && needed + rows < old
            }
            None => false,
        }
    }
}

/// A llama-shaped starting point without sizes: the sizes are 0 (a config left so fails
/// [`ModelConfig::validate`]), RMSNorm with ε 1e-5, SiLU, adjacent-pair
/// RoPE at base 10,000 over 0 dimensions (set `rope.rotary_dims` to the head size; 0 fails
/// `validate`), separate embedding and LM head, no window and an unscaled embedding.
/// Literals name what differs and take the rest with `..ModelConfig::default()`, so a new
/// field touches only its own readers.
impl Default for ModelConfig {
    fn default() -> Self {
        ModelConfig {
            arch: Architecture::Llama,
            vocab_size: 0,
            hidden_size: 0,
            num_layers: 0,
            num_heads: 0,
            num_kv_heads: 0,
            head_dim: 0,
            ffn_size: 0,
            norm: NormKind::Rms,
            norm_eps: 1e-5,
            activation: Activation::Silu,
            rope: RopeConfig::default(),
            tied_embeddings: false,
            context_length: 0,
            embedding_scale: 1.0,
            sliding_window: None,
            experts: None,
        }
    }
}

/// Adjacent pairs, base 10,000, no scaling, 0 rotary dimensions (set them).
impl Default for RopeConfig {
    fn default() -> Self {
        RopeConfig {
            kind: RopeKind::Norm,
            theta: 10_000.0,
            scaling: RopeScaling::None,
            rotary_dims: 0,
        }
    }
}

impl ModelConfig {
    /// How layer `layer` attends (see [`SlidingWindow`]).
    pub fn layer_attention(&self, layer: usize) -> LayerAttention {
        match self.sliding_window {
            Some(sw) if !(layer + 1).is_multiple_of(sw.global_every) => LayerAttention {
                window: Some(sw.window),
                local_rope: sw.local_theta.is_some(),
            },
            _ => LayerAttention {
                window: None,
                local_rope: false,
            },
        }
    }

    /// The RoPE settings of the windowed layers that have their own: the local base, no
    /// scaling.
    pub fn local_rope(&self) -> Option<RopeConfig> {
        let theta = self.sliding_window?.local_theta?;
        Some(RopeConfig {
            theta,
            scaling: RopeScaling::None,
            ..self.rope
        })
    }

    /// Limits [`ModelConfig::validate`] holds metadata to (far above any released model).
    pub const MAX_LAYERS: usize = 1024;
    pub const MAX_WIDTH: usize = 1 << 20;
    pub const MAX_HEADS: usize = 1024;
    pub const MAX_HEAD_DIM: usize = 1024;
    pub const MAX_VOCAB: usize = 1 << 22;
    pub const MAX_CONTEXT: usize = 1 << 24;

    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// What attention scores q·k are multiplied by before the softmax: 1/√head_dim, times
    /// the square of RoPE's attention factor (YaRN scales both q and k; the executors apply
    /// it here once instead of to every rotated value).
    pub fn attention_scale(&self) -> f32 {
        let f = self.rope.attention_factor();
        f * f / (self.head_dim as f32).sqrt()
    }
    /// Query heads sharing one KV head.
    pub fn gqa_ratio(&self) -> usize {
        self.num_heads / self.num_kv_heads.max(1)
    }

    /// Checks the internal consistency a decoder relies on.
    pub fn validate(&self) -> Result<()> {
        let bad = |m: String| Err(Error::Format(m));
        // Sizes come from untrusted metadata and drive allocations: bound each before
        // anything is sized by it.
        for (what, value, limit) in [
            ("layer count", self.num_layers, Self::MAX_LAYERS),
            ("hidden size", self.hidden_size, Self::MAX_WIDTH),
            ("feed-forward size", self.ffn_size, Self::MAX_WIDTH),
            ("head count", self.num_heads, Self::MAX_HEADS),
            ("head_dim", self.head_dim, Self::MAX_HEAD_DIM),
            ("vocabulary", self.vocab_size, Self::MAX_VOCAB),
            ("context length", self.context_length, Self::MAX_CONTEXT),
        ] {
            if value > limit {
                return bad(format!("{what} {value} is beyond kiln's limit of {limit}"));
            }
        }
        if !self.norm_eps.is_finite() || self.norm_eps <= 0.0 {
            return bad(format!(
                "norm epsilon {} must be a positive number",
                self.norm_eps
            ));
        }
        if !self.rope.theta.is_finite() || self.rope.theta <= 0.0 {
            return bad(format!(
                "rope base {} must be a positive number",
                self.rope.theta
            ));
        }
        match self.rope.scaling {
            RopeScaling::None => {}
            RopeScaling::Linear { factor } => {
                if !factor.is_finite() || factor <= 0.0 {
                    return bad(format!(
                        "rope scaling factor {factor} must be a positive number"
                    ));
                }
            }
            RopeScaling::Yarn {
                factor,
                original_context,
                beta_fast,
                beta_slow,
                attn_factor,
                truncate: _,
            } => {
                let positive = |v: f32| v.is_finite() && v > 0.0;
                if !positive(factor)
                    || !positive(beta_fast)
                    || !positive(beta_slow)
                    || !positive(attn_factor)
                {
                    return bad(format!(
                        "YaRN rope scaling needs positive numbers: factor {factor}, beta_fast {beta_fast}, \
                         beta_slow {beta_slow}, attention factor {attn_factor}"
                    ));
                }
                if original_context == 0 {
                    return bad("YaRN rope scaling with an original context of 0".into());
                }
            }
        }
        if self.context_length == 0 {
            return bad("context length 0".into());
        }
        if self.num_layers == 0 || self.hidden_size == 0 || self.vocab_size == 0 {
            return bad(format!(
                "empty model: {} layers, hidden {}, vocab {}",
                self.num_layers, self.hidden_size, self.vocab_size
            ));
        }
        if self.num_heads == 0
            || self.num_kv_heads == 0
            || !self.num_heads.is_multiple_of(self.num_kv_heads)
        {
            return bad(format!(
                "{} heads cannot share {} KV heads",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.head_dim == 0 || !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head_dim {} must be even and non-zero",
                self.head_dim
            ));
        }
        if self.rope.rotary_dims == 0
            || self.rope.rotary_dims > self.head_dim
            || !self.rope.rotary_dims.is_multiple_of(2)
        {
            return bad(format!(
                "rotary dims {} do not fit head_dim {}",
                self.rope.rotary_dims, self.head_dim
            ));
        }
        if let Architecture::Granite(g) = self.arch {
            let positive = |v: f32| v.is_finite() && v > 0.0;
            if !(positive(g.residual) && positive(g.attention) && positive(g.logits)) {
                return bad(format!(
                    "granite multipliers must be positive numbers: residual {}, attention {}, logits {}",
                    g.residual, g.attention, g.logits
                ));
            }
        }
        if !self.embedding_scale.is_finite() || self.embedding_scale <= 0.0 {
            return bad(format!(
                "embedding scale {} must be a positive number",
                self.embedding_scale
            ));
        }
        if let Some(sw) = self.sliding_window {
            if sw.window == 0
                || sw.global_every == 0
                || sw.window > Self::MAX_CONTEXT
                || sw.global_every > Self::MAX_LAYERS
            {
                return bad(format!(
                    "sliding window of {} positions, every {} layers global",
                    sw.window, sw.global_every
                ));
            }
            if let Some(theta) = sw.local_theta.filter(|t| !t.is_finite() || *t <= 0.0) {
                return bad(format!("local rope base {theta} must be a positive number"));
            }
        }
        if let Some(e) = self.experts {
            if e.count == 0 || e.count > ExpertConfig::MAX_EXPERTS {
                return bad(format!(
                    "expert count {} is not in 1..={}",
                    e.count,
                    ExpertConfig::MAX_EXPERTS
                ));
            }
            if e.used == 0 || e.used > e.count {
                return bad(format!(
                    "{} experts used of {}: must be at least 1 and at most the count",
                    e.used, e.count
                ));
            }
            if e.ffn_size == 0 || e.ffn_size > Self::MAX_WIDTH {
                return bad(format!(
                    "expert feed-forward size {} is not in 1..={}",
                    e.ffn_size,
                    Self::MAX_WIDTH
                ));
            }
        }
        Ok(())
    }
}

/// One transformer block's weights. Q/K/V are always separate views (a fused QKV tensor is
/// split into row ranges at load, without copying).
#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: TensorView,
    pub attn_norm_bias: Option<TensorView>,
    pub attn_q: TensorView,
    pub attn_k: TensorView,
    pub attn_v: TensorView,
    pub attn_q_bias: Option<TensorView>,
    pub attn_k_bias: Option<TensorView>,
    pub attn_v_bias: Option<TensorView>,
    /// Per-head RMSNorm weights (length head_dim), Qwen3.
    pub attn_q_norm: Option<TensorView>,
    pub attn_k_norm: Option<TensorView>,
    pub attn_out: TensorView,
    pub attn_out_bias: Option<TensorView>,
    /// A learned logit per query head that joins the softmax's denominator and attends
    /// to nothing (gpt-oss's `attn_sinks`).
    pub attn_sinks: Option<TensorView>,
    /// Absent only where attention and FFN read one norm (a parallel block, which a host
    /// may describe in a program over the plugin ABI; no built-in architecture has one).
    pub ffn_norm: Option<TensorView>,
    pub ffn_norm_bias: Option<TensorView>,
    /// The dense feed-forward (absent in a Mixture-of-Experts layer without a shared
    /// expert); the gate is absent when it is not gated.
    pub ffn_gate: Option<TensorView>,
    pub ffn_up: Option<TensorView>,
    pub ffn_down: Option<TensorView>,
    /// The Mixture-of-Experts feed-forward, if the layer has one.
    pub experts: Option<ExpertWeights>,
    /// RMSNorm weights of the attention and MLP outputs (Gemma's "sandwich" norms).
    pub attn_post_norm: Option<TensorView>,
    pub ffn_post_norm: Option<TensorView>,
}

/// A layer's Mixture-of-Experts weights: the router and each projection of every expert.
#[derive(Debug, Clone)]
pub struct ExpertWeights {
    /// `[hidden, count]` (`ffn_gate_inp`).
    pub router: TensorView,
    /// Each expert's `[hidden, ffn]` gate and up projections (`ffn_gate_exps`, `ffn_up_exps`).
    pub gate: ExpertTensors,
    pub up: ExpertTensors,
    /// Each expert's `[ffn, hidden]` down projection (`ffn_down_exps`).
    pub down: ExpertTensors,
    /// The router's and the experts' biases, if the model has them (gpt-oss).
    pub biases: Option<ExpertBiases>,
}

/// A layer's Mixture-of-Experts biases, each stacked a row per expert as llama.cpp's
/// converter writes them: the router's `[count]` (`ffn_gate_inp.bias`), the gate and up
/// projections' `[ffn, count]` and the down projection's `[hidden, count]`.
#[derive(Debug, Clone)]
pub struct ExpertBiases {
    pub router: TensorView,
    pub gate: TensorView,
    pub up: TensorView,
    pub down: TensorView,
}

impl ExpertWeights {
    /// Values and bytes of the experts' matrices that a token choosing `used` of them does
    /// not read (what a Mixture of Experts saves a decode step).
    pub fn unread_by_a_token(&self, used: usize) -> (usize, usize) {
        let count = self.router.rows().max(1);
        let idle = count.saturating_sub(used);
        let projections = [&self.gate, &self.up, &self.down];
        let elements: usize = projections.iter().map(|p| p.elements()).sum();
        let bytes: usize = projections.iter().map(|p| p.bytes()).sum();
        (elements / count * idle, bytes / count * idle)
    }
}

/// One projection of every expert, as the file stores it.
#[derive(Debug, Clone)]
pub enum ExpertTensors {
    /// One tensor of dims `[row_len, rows, count]` (matrix `e` is expert `e`'s): what
    /// llama.cpp's converter writes.
    Stacked(TensorView),
    /// A tensor per expert (`blk.N.ffn_gate.E.weight`): older Mixtral files.
    PerExpert(Vec<TensorView>),
}

impl ExpertTensors {
    /// Expert `e`'s matrix (a zero-copy view).
    pub fn expert(&self, e: usize) -> Result<TensorView> {
        match self {
            ExpertTensors::Stacked(t) => t.matrix(e),
            ExpertTensors::PerExpert(v) => v
                .get(e)
                .cloned()
                .ok_or_else(|| Error::InvalidShape(format!("expert {e} of {} experts", v.len()))),
        }
    }

    /// The tensors as the file has them.
    pub fn tensors(&self) -> Vec<&TensorView> {
        match self {
            ExpertTensors::Stacked(t) => vec![t],
            ExpertTensors::PerExpert(v) => v.iter().collect(),
        }
    }

    /// Every expert's matrix dims `[row_len, rows]` and the expert count, or `None` if the
    /// experts' matrices differ in shape or type.
    pub fn shape(&self) -> Option<([usize; 2], usize)> {
        match self {
            ExpertTensors::Stacked(t) => match t.dims() {
                &[a, b, n] => Some(([a, b], n)),
                _ => None,
            },
            ExpertTensors::PerExpert(v) => {
                let first = v.first()?;
                let same = v
                    .iter()
                    .all(|t| t.dims() == first.dims() && t.qtype() == first.qtype());
                match (first.dims(), same) {
                    (&[a, b], true) => Some(([a, b], v.len())),
                    _ => None,
                }
            }
        }
    }

    /// Bytes of all the experts' matrices.
    pub fn bytes(&self) -> usize {
        self.tensors().iter().map(|t| t.bytes().len()).sum()
    }

    /// Values of all the experts' matrices.
    pub fn elements(&self) -> usize {
        self.tensors().iter().map(|t| t.elements()).sum()
    }
}

#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub token_embd: TensorView,
    pub layers: Vec<LayerWeights>,
    pub output_norm: TensorView,
    pub output_norm_bias: Option<TensorView>,
    /// LM head; `None` when tied to `token_embd`.
    pub output: Option<TensorView>,
    /// Per-pair rope frequency factors (llama-3 style scaling).
    pub rope_freqs: Option<TensorView>,
}

impl ModelWeights {
    /// The LM head: `output`, or the token embedding when tied.
    pub fn lm_head(&self) -> &TensorView {
        self.output.as_ref().unwrap_or(&self.token_embd)
    }

    /// Every weight tensor, each once.
    pub fn tensors(&self) -> Vec<&TensorView> {
        let mut all = vec![&self.token_embd, &self.output_norm];
        all.extend(self.output_norm_bias.iter());
        all.extend(self.output.iter());
        all.extend(self.rope_freqs.iter());
        for l in &self.layers {
            all.extend([&l.attn_norm, &l.attn_q, &l.attn_k, &l.attn_v, &l.attn_out]);
            if let Some(e) = &l.experts {
                all.push(&e.router);
                for p in [&e.gate, &e.up, &e.down] {
                    all.extend(p.tensors());
                }
                if let Some(b) = &e.biases {
                    all.extend([&b.router, &b.gate, &b.up, &b.down]);
                }
            }
            for t in [
                &l.attn_norm_bias,
                &l.attn_q_bias,
                &l.attn_k_bias,
                &l.attn_v_bias,
                &l.attn_q_norm,
                &l.attn_k_norm,
                &l.attn_out_bias,
                &l.attn_sinks,
                &l.ffn_norm,
                &l.ffn_norm_bias,
                &l.ffn_gate,
                &l.ffn_up,
                &l.ffn_down,
                &l.attn_post_norm,
                &l.ffn_post_norm,
            ] {
                all.extend(t.iter());
            }
        }
        all
    }
}

/// A model ready to hand to a backend.
#[derive(Debug, Clone)]
pub struct ModelIr {
    pub config: ModelConfig,
    pub weights: ModelWeights,
    /// Human-readable origin ("GGUF file /path/x.gguf") for messages.
    pub source: String,
    /// The forward pass the model came with, if it came with one: a model a host described
    /// to a plugin carries the host's program (ABI 1.4), which [`crate::program::build`]
    /// checks and returns instead of running an architecture builder. `None` for a model
    /// read from a file.
    pub program: Option<std::sync::Arc<crate::program::ModelProgram<TensorView>>>,
}

impl ModelIr {
    /// Distinct weight qtypes of the matrices (what decides which backend fits).
    pub fn matrix_qtypes(&self) -> Vec<QType> {
        let mut q: Vec<QType> = self
            .weights
            .tensors()
            .into_iter()
            .filter(|t| t.dims().len() >= 2)
            .map(|t| t.qtype())
            .collect();
        q.sort();
        q.dedup();
        q
    }

    /// Share of the layers' matmul bytes (Q/K/V/O, gate/up/down, experts') held in types for which
    /// `family` is true: what backend selection keys on ("mostly Q4_0", "mostly K-quants";
    /// see [`crate::score`]).
    pub fn matmul_share(&self, family: impl Fn(QType) -> bool) -> f64 {
        let (mut hit, mut all) = (0usize, 0usize);
        for l in &self.weights.layers {
            let mut mats: Vec<&TensorView> = [
                Some(&l.attn_q),
                Some(&l.attn_k),
                Some(&l.attn_v),
                Some(&l.attn_out),
                l.ffn_gate.as_ref(),
                l.ffn_up.as_ref(),
                l.ffn_down.as_ref(),
            ]
            .into_iter()
            .flatten()
            .collect();
            if let Some(e) = &l.experts {
                for p in [&e.gate, &e.up, &e.down] {
                    mats.extend(p.tensors());
                }
            }
            for t in mats {
                all += t.bytes().len();
                if family(t.qtype()) {
                    hit += t.bytes().len();
                }
            }
        }
        if all == 0 {
            0.0
        } else {
            hit as f64 / all as f64
        }
    }

    /// Total parameter count.
    pub fn parameters(&self) -> usize {
        self.weights.tensors().iter().map(|t| t.elements()).sum()
    }
}

#[cfg(test)]
mod validate_tests {
    use super::*;

    fn config() -> ModelConfig {
        ModelConfig {
            vocab_size: 1000,
            hidden_size: 64,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            ffn_size: 128,
            rope: RopeConfig {
                rotary_dims: 16,
                ..RopeConfig::default()
            },
            tied_embeddings: true,
            context_length: 2048,
            ..ModelConfig::default()
        }
    }

    /// `LoadOptions::fit_context`: the model's context when its KV cache fits, else the most
    /// that fits in 256-token steps; an explicit context that does not fit is refused.
    #[test]
    fn default_context_is_the_models_as_far_as_memory_allows() {
        let c = config(); // 2,048 positions
        let opts = |max_context, max_sequences| crate::LoadOptions {
            max_context,
            max_sequences,
            ..Default::default()
        };
        // 1 KiB a position and 4 KiB of rings per sequence.
        let (per, fixed) = (1024u64, 4096u64);
        assert_eq!(
            opts(0, 1).fit_context(&c, per, fixed, 1 << 30).unwrap(),
            2048
        );
        assert_eq!(
            opts(0, 1)
                .fit_context(&c, per, fixed, 2048 * 1024 + 4096)
                .unwrap(),
            2048
        );
        // Four sequences in 4 MiB: (1 MiB − 4 KiB) / 1 KiB = 1,020 positions → 768.
        assert_eq!(
            opts(0, 4).fit_context(&c, per, fixed, 4 << 20).unwrap(),
            768
        );
        let err = opts(0, 4)
            .fit_context(&c, per, fixed, 100 << 10)
            .unwrap_err();
        assert!(matches!(err, crate::Error::OutOfMemory(_)), "{err}");
        assert!(err.to_string().contains("not even 256 tokens"), "{err}");
        // Explicit contexts: taken when they fit (even past the model's), refused otherwise.
        assert_eq!(
            opts(4096, 1).fit_context(&c, per, fixed, 1 << 30).unwrap(),
            4096
        );
        let err = opts(4096, 2)
            .fit_context(&c, per, fixed, 4 << 20)
            .unwrap_err();
        assert!(
            err.to_string().contains("4096 tokens × 2 sequences"),
            "{err}"
        );
        // No overflow on absurd sizes.
        assert!(opts(usize::MAX, 64)
            .fit_context(&c, u64::MAX, u64::MAX, u64::MAX / 2)
            .is_err());
        assert!(opts(0, 64)
            .fit_context(&c, u64::MAX, 0, u64::MAX / 2)
            .is_err());
    }

    /// Hostile metadata is refused before anything is sized by it.
    #[test]
    fn out_of_range_hyperparameters_are_refused() {
        assert!(config().validate().is_ok());
        let cases: Vec<(&str, ModelConfig)> = vec![
            (
                "layer count",
                ModelConfig {
                    num_layers: 1_000_000_000,
                    ..config()
                },
            ),
            (
                "layer count",
                ModelConfig {
                    num_layers: usize::MAX,
                    ..config()
                },
            ),
            (
                "context length",
                ModelConfig {
                    context_length: u32::MAX as usize,
                    ..config()
                },
            ),
            (
                "vocabulary",
                ModelConfig {
                    vocab_size: 1 << 40,
                    ..config()
                },
            ),
            (
                "hidden size",
                ModelConfig {
                    hidden_size: 1 << 30,
                    ..config()
                },
            ),
            (
                "norm epsilon",
                ModelConfig {
                    norm_eps: -1e-5,
                    ..config()
                },
            ),
            (
                "norm epsilon",
                ModelConfig {
                    norm_eps: f32::NAN,
                    ..config()
                },
            ),
            (
                "rope base",
                ModelConfig {
                    rope: RopeConfig {
                        theta: 0.0,
                        ..config().rope
                    },
                    ..config()
                },
            ),
            (
                "scaling factor",
                ModelConfig {
                    rope: RopeConfig {
                        scaling: RopeScaling::Linear { factor: -2.0 },
                        ..config().rope
                    },
                    ..config()
                },
            ),
            (
                "sliding window",
                ModelConfig {
                    sliding_window: Some(SlidingWindow {
                        window: usize::MAX,
                        global_every: 6,
                        local_theta: Some(1e4),
                    }),
                    ..config()
                },
            ),
            (
                "sliding window",
                ModelConfig {
                    sliding_window: Some(SlidingWindow {
                        window: 512,
                        global_every: 0,
                        local_theta: Some(1e4),
                    }),
                    ..config()
                },
            ),
            (
                "local rope base",
                ModelConfig {
                    sliding_window: Some(SlidingWindow {
                        window: 512,
                        global_every: 6,
                        local_theta: Some(f32::NAN),
                    }),
                    ..config()
                },
            ),
            (
                "embedding scale",
                ModelConfig {
                    embedding_scale: f32::INFINITY,
                    ..config()
                },
            ),
        ];
        for (what, c) in cases {
            let err = c.validate().expect_err(what).to_string();
            assert!(err.contains(what), "{err}");
        }
    }
}
