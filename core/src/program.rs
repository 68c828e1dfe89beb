//! The model program: each architecture's forward pass, described once.
//!
//! An architecture's builder turns a [`ModelIr`] into a [`ModelProgram`]: the token
//! embedding, the residual branches in order, and the head. A branch reads the residual
//! stream through a norm, runs its operations on the normed input (one for the usual
//! sequential block; attention and feed-forward side by side for a parallel one), sums
//! them, optionally norms the sum again (Gemma's sandwich norms), scales it and adds it to
//! the stream:
//!
//! ```text
//! x  = scale · embed(token)
//! x += scale · post_norm(Σ op(norm(x)))        for each branch
//! logits = logit_scale · output(norm(x))
//! ```
//!
//! Every executor (the CPU forward, the GPU one-sequence step, the batched step and the
//! prefill) walks this program and implements its operations; none of them reads the
//! architecture or its switches. A new architecture is one builder made of the shared
//! helpers below; a new kind of operation (a Mixture-of-Experts feed-forward) is one new
//! [`Op`] variant that each executor implements once. An executor that cannot run some
//! part says so from the program ([`ModelProgram::branches`] and friends), not from flags.
//!
//! The program is generic over how an executor holds weights: `M` for matrices, `V` for
//! vectors (norm weights, biases). The builders make a `ModelProgram<TensorView>`, whose
//! views are shared handles onto the file; an executor [`ModelProgram::map`]s it to its own
//! forms (a CPU matrix with its kernel, a device buffer), getting each weight with the
//! shape the builder checked it has.

use crate::error::{Error, Result};
use crate::ir::{
    Activation, Architecture, GraniteScales, LayerAttention, LayerWeights, ModelConfig, ModelIr,
    NormKind, TensorView,
};

/// One architecture's forward pass (see the module doc).
#[derive(Debug, Clone)]
pub struct ModelProgram<M, V = M> {
    pub embedding: Embedding<M>,
    /// The residual branches in the order they run: two a layer for the sequential blocks
    /// (attention, then feed-forward), one for a parallel block.
    pub branches: Vec<Branch<M, V>>,
    pub head: Head<M, V>,
    /// Per-pair RoPE frequency factors (llama 3's long-context scaling), `rotary_dims / 2`
    /// values; they divide each pair's frequency of the global RoPE base.
    pub rope_freqs: Option<V>,
}

/// The token embedding: row `t` of `table` (vocabulary rows of hidden values) times `scale`.
#[derive(Debug, Clone)]
pub struct Embedding<M> {
    pub table: M,
    pub scale: f32,
}

/// A norm over the hidden vector (or, for [`HeadNorms`], over one head).
#[derive(Debug, Clone)]
pub struct Norm<V> {
    pub kind: NormKind,
    pub weight: V,
    /// Added after the scaling (LayerNorm's β; RMSNorm models have none).
    pub bias: Option<V>,
    pub eps: f32,
}

/// `y = W·x + b`.
#[derive(Debug, Clone)]
pub struct Linear<M, V> {
    pub weight: M,
    pub bias: Option<V>,
}

/// RMSNorm of each query and key head before RoPE (Qwen3, Gemma 3), weights of head_dim.
#[derive(Debug, Clone)]
pub struct HeadNorms<V> {
    pub q: V,
    pub k: V,
    pub eps: f32,
}

/// Causal self-attention of one layer: its KV cache is the executor's layer `layer`.
#[derive(Debug, Clone)]
pub struct Attention<M, V> {
    pub layer: usize,
    pub q: Linear<M, V>,
    pub k: Linear<M, V>,
    pub v: Linear<M, V>,
    pub head_norms: Option<HeadNorms<V>>,
    /// Which positions a query sees and which RoPE base rotates it (sliding windows).
    pub span: LayerAttention,
    /// What q·k is multiplied by before the softmax.
    pub scale: f32,
    /// A logit per query head that joins each softmax's denominator with no value
    /// (gpt-oss's attention sinks): the head may attend to nothing.
    pub sinks: Option<V>,
    pub out: Linear<M, V>,
}

/// A dense feed-forward: `down(act(gate·x, up·x))` when gated (for most activations
/// `act(gate·x) ⊙ up·x`, see [`Activation::gated`]), `down(act(up·x))` when not; each
/// projection plus its bias where it has one.
#[derive(Debug, Clone)]
pub struct FeedForward<M, V = M> {
    pub gate: Option<M>,
    pub up: M,
    pub down: M,
    pub activation: Activation,
    pub biases: Option<FeedForwardBiases<V>>,
}

/// The biases of a feed-forward's projections (gpt-oss's experts have them).
#[derive(Debug, Clone)]
pub struct FeedForwardBiases<V> {
    pub gate: Option<V>,
    pub up: V,
    pub down: V,
}

/// A Mixture-of-Experts feed-forward: the router's logits (one per expert) go through a
/// softmax; the `used` most probable experts run (ties to the lower index, as
/// `torch.topk` picks), and their outputs are summed weighted by their probabilities
/// (divided by the chosen ones' sum when `normalize`).
#[derive(Debug, Clone)]
pub struct Experts<M, V = M> {
    /// `[hidden, count]`: a row of hidden values per expert (and a bias per expert where
    /// the model has one).
    pub router: Linear<M, V>,
    /// Each expert's gated feed-forward (widths of the config's `experts.ffn_size`).
    pub experts: Vec<FeedForward<M, V>>,
    pub used: usize,
    pub normalize: bool,
}

/// What a branch computes from its normed input.
#[derive(Debug, Clone)]
pub enum Op<M, V> {
    Attention(Attention<M, V>),
    FeedForward(FeedForward<M, V>),
    Experts(Experts<M, V>),
}

/// `x += scale · post_norm(Σ op(norm(x)))`.
#[derive(Debug, Clone)]
pub struct Branch<M, V> {
    pub norm: Norm<V>,
    /// One operation, or several summed (a parallel block's attention and feed-forward).
    pub ops: Vec<Op<M, V>>,
    pub post_norm: Option<Norm<V>>,
    pub scale: f32,
}

impl<M, V> Branch<M, V> {
    /// The branch's one operation, or `None` when it sums several.
    pub fn single_op(&self) -> Option<&Op<M, V>> {
        match self.ops.as_slice() {
            [op] => Some(op),
            _ => None,
        }
    }
}

/// `logits = logit_scale · output(norm(x))`.
#[derive(Debug, Clone)]
pub struct Head<M, V> {
    pub norm: Norm<V>,
    /// Vocabulary rows of hidden values (the embedding table itself when tied).
    pub output: M,
    pub logit_scale: f32,
    /// The vocabulary rows `output` holds when they are a share of the whole (a
    /// tensor-parallel rank's, see [`crate::parallel`]); `None`: every row.
    pub vocab_rows: Option<std::ops::Range<usize>>,
}

/// The shape of a matrix as a program multiplies it: `inputs` values in, `outputs` out
/// (a [`TensorView`] of dims `[inputs, outputs]`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MatrixShape {
    pub inputs: usize,
    pub outputs: usize,
}

impl<M, V> ModelProgram<M, V> {
    /// The same program over other weight forms: `matrix` turns each matrix (with the
    /// shape it is multiplied as) into `M2`, `vector` each vector (with its length) into
    /// `V2`; the first error stops the walk.
    pub fn map<M2, V2, E>(
        &self,
        c: &ModelConfig,
        mut matrix: impl FnMut(&M, MatrixShape) -> std::result::Result<M2, E>,
        mut vector: impl FnMut(&V, usize) -> std::result::Result<V2, E>,
    ) -> std::result::Result<ModelProgram<M2, V2>, E> {
        let (h, qd, kvd, hd, ffn) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim, c.ffn_size);
        let shape = |inputs, outputs| MatrixShape { inputs, outputs };
        let embedding = Embedding {
            table: matrix(&self.embedding.table, shape(h, c.vocab_size))?,
            scale: self.embedding.scale,
        };
        let mut branches = Vec::with_capacity(self.branches.len());
        for b in &self.branches {
            let mut ops = Vec::with_capacity(b.ops.len());
            for op in &b.ops {
                ops.push(match op {
                    Op::Attention(a) => Op::Attention(Attention {
                        layer: a.layer,
                        q: map_linear(&a.q, shape(h, qd), &mut matrix, &mut vector)?,
                        k: map_linear(&a.k, shape(h, kvd), &mut matrix, &mut vector)?,
                        v: map_linear(&a.v, shape(h, kvd), &mut matrix, &mut vector)?,
                        head_norms: match &a.head_norms {
                            Some(n) => Some(HeadNorms {
                                q: vector(&n.q, hd)?,
                                k: vector(&n.k, hd)?,
                                eps: n.eps,
                            }),
                            None => None,
                        },
                        span: a.span,
                        scale: a.scale,
                        sinks: match &a.sinks {
                            Some(s) => Some(vector(s, c.num_heads)?),
                            None => None,
                        },
                        out: map_linear(&a.out, shape(qd, h), &mut matrix, &mut vector)?,
                    }),
                    Op::FeedForward(f) => {
                        Op::FeedForward(map_ffn(f, h, ffn, &mut matrix, &mut vector)?)
                    }
                    Op::Experts(e) => {
                        let width = c.experts.map_or(0, |x| x.ffn_size);
                        let mut experts = Vec::with_capacity(e.experts.len());
                        for f in &e.experts {
                            experts.push(map_ffn(f, h, width, &mut matrix, &mut vector)?);
                        }
                        Op::Experts(Experts {
                            router: map_linear(
                                &e.router,
                                shape(h, e.experts.len()),
                                &mut matrix,
                                &mut vector,
                            )?,
                            experts,
                            used: e.used,
                            normalize: e.normalize,
                        })
                    }
                });
            }
            branches.push(Branch {
                norm: map_norm(&b.norm, h, &mut vector)?,
                ops,
                post_norm: match &b.post_norm {
                    Some(n) => Some(map_norm(n, h, &mut vector)?),
                    None => None,
                },
                scale: b.scale,
            });
        }
        Ok(ModelProgram {
            embedding,
            branches,
            head: Head {
                norm: map_norm(&self.head.norm, h, &mut vector)?,
                output: matrix(
                    &self.head.output,
                    shape(
                        h,
                        self.head
                            .vocab_rows
                            .as_ref()
                            .map_or(c.vocab_size, |r| r.len()),
                    ),
                )?,
                logit_scale: self.head.logit_scale,
                vocab_rows: self.head.vocab_rows.clone(),
            },
            rope_freqs: match &self.rope_freqs {
                Some(f) => Some(vector(f, c.rope.rotary_dims / 2)?),
                None => None,
            },
        })
    }

    /// Every operation of the program, in order.
    pub fn ops(&self) -> impl Iterator<Item = &Op<M, V>> {
        self.branches.iter().flat_map(|b| b.ops.iter())
    }

    /// The norm that reads the residual stream after branch `i`: the next branch's, or the
    /// head's after the last (what a fused executor folds into the launch that updates the
    /// stream).
    pub fn norm_after(&self, i: usize) -> &Norm<V> {
        self.branches
            .get(i + 1)
            .map_or(&self.head.norm, |b| &b.norm)
    }
}

fn map_ffn<M, V, M2, V2, E>(
    f: &FeedForward<M, V>,
    h: usize,
    width: usize,
    matrix: &mut impl FnMut(&M, MatrixShape) -> std::result::Result<M2, E>,
    vector: &mut impl FnMut(&V, usize) -> std::result::Result<V2, E>,
) -> std::result::Result<FeedForward<M2, V2>, E> {
    let shape = |inputs, outputs| MatrixShape { inputs, outputs };
    Ok(FeedForward {
        gate: match &f.gate {
            Some(g) => Some(matrix(g, shape(h, width))?),
            None => None,
        },
        up: matrix(&f.up, shape(h, width))?,
        down: matrix(&f.down, shape(width, h))?,
        activation: f.activation,
        biases: match &f.biases {
            Some(b) => Some(FeedForwardBiases {
                gate: match &b.gate {
                    Some(g) => Some(vector(g, width)?),
                    None => None,
                },
                up: vector(&b.up, width)?,
                down: vector(&b.down, h)?,
            }),
            None => None,
        },
    })
}

fn map_norm<V, V2, E>(
    n: &Norm<V>,
    len: usize,
    vector: &mut impl FnMut(&V, usize) -> std::result::Result<V2, E>,
) -> std::result::Result<Norm<V2>, E> {
    Ok(Norm {
        kind: n.kind,
        weight: vector(&n.weight, len)?,
        bias: match &n.bias {
            Some(b) => Some(vector(b, len)?),
            None => None,
        },
        eps: n.eps,
    })
}

fn map_linear<M, V, M2, V2, E>(
    l: &Linear<M, V>,
    shape: MatrixShape,
    matrix: &mut impl FnMut(&M, MatrixShape) -> std::result::Result<M2, E>,
    vector: &mut impl FnMut(&V, usize) -> std::result::Result<V2, E>,
) -> std::result::Result<Linear<M2, V2>, E> {
    Ok(Linear {
        weight: matrix(&l.weight, shape)?,
        bias: match &l.bias {
            Some(b) => Some(vector(b, shape.outputs)?),
            None => None,
        },
    })
}

/// The program of `ir`'s architecture, its weights checked against the config's shapes.
pub fn build(ir: &ModelIr) -> Result<ModelProgram<TensorView>> {
    let c = &ir.config;
    c.validate()?;
    if ir.weights.layers.len() != c.num_layers {
        return Err(Error::Format(format!(
            "config says {} layers, weights have {}",
            c.num_layers,
            ir.weights.layers.len()
        )));
    }
    if let Some(given) = &ir.program {
        return checked(given, c);
    }
    match c.arch {
        Architecture::Llama | Architecture::Mistral => llama(ir),
        Architecture::Qwen2 => qwen2(ir),
        Architecture::Qwen3 => qwen3(ir),
        Architecture::Gemma3 => gemma3(ir),
        Architecture::Phi3 => phi3(ir),
        Architecture::Granite(scales) => granite(ir, scales),
        Architecture::Qwen3Moe => qwen3moe(ir),
        Architecture::GptOss => gpt_oss(ir),
    }
}

/// A program given with the model (one a host described over the plugin ABI), checked as
/// a builder's output is: every weight has the shape the config gives its place, each
/// attention has its own KV layer, and each attends with the span the config gives that
/// layer (the executors size their caches and RoPE tables from the config).
fn checked(given: &ModelProgram<TensorView>, c: &ModelConfig) -> Result<ModelProgram<TensorView>> {
    let program = given.map(
        c,
        |m, s| matrix(m, s.inputs, s.outputs, "a matrix of the given program"),
        |v, len| vector(v, len, "a vector of the given program"),
    )?;
    let mut seen = vec![false; c.num_layers];
    for op in program.ops() {
        let Op::Attention(a) = op else { continue };
        match seen.get_mut(a.layer) {
            None => {
                return Err(Error::Format(format!(
                    "the given program attends in layer {} of a {}-layer model",
                    a.layer, c.num_layers
                )))
            }
            Some(true) => {
                return Err(Error::Format(format!(
                    "the given program attends twice in layer {}",
                    a.layer
                )))
            }
            Some(s) => *s = true,
        }
        if a.span != c.layer_attention(a.layer) {
            return Err(Error::Format(format!(
                "the given program's layer {} attends over {:?}; the config says {:?}",
                a.layer,
                a.span,
                c.layer_attention(a.layer)
            )));
        }
    }
    Ok(program)
}

/// Llama 1-3, Mistral, SmolLM: pre-norm blocks, attention then a gated SiLU feed-forward,
/// dense or (Mixtral: a llama file with experts) a Mixture of Experts.
fn llama(ir: &ModelIr) -> Result<ModelProgram<TensorView>> {
    let b = Builder::new(ir);
    let branches = b.layers(|i, l| {
        let ffn = match l.experts {
            Some(_) => b.experts(i, l)?,
            None => Op::FeedForward(b.feed_forward(l)?),
        };
        b.pre_norm_block(i, l, b.attention(i, l)?, ffn)
    })?;
    b.program(branches)
}

/// Qwen3-MoE: Qwen3's attention (per-head Q/K norms) and a Mixture of Experts in every
/// layer.
fn qwen3moe(ir: &ModelIr) -> Result<ModelProgram<TensorView>> {
    let b = Builder::new(ir);
    let branches = b.layers(|i, l| {
        let attention = b.requiring_head_norms(i, b.attention(i, l)?)?;
        b.pre_norm_block(i, l, attention, b.experts(i, l)?)
    })?;
    b.program(branches)
}

/// gpt-oss: pre-norm blocks of attention with biases and a sink logit per head (windowed
/// on every other layer: the config's spans), then a Mixture of Experts whose router and
/// experts have biases, gated by the config's clamped SwiGLU.
fn gpt_oss(ir: &ModelIr) -> Result<ModelProgram<TensorView>> {
    let b = Builder::new(ir);
    let branches = b.layers(|i, l| {
        let attention = b.attention(i, l)?;
        if attention.sinks.is_none() {
            return Err(Error::Format(format!(
                "layer {i}: a gpt-oss model needs attention sinks"
            )));
        }
        b.pre_norm_block(i, l, attention, b.experts(i, l)?)
    })?;
    b.program(branches)
}

/// Qwen2 / Qwen2.5: llama's blocks; their Q/K/V biases are the file's (the shared
/// attention takes whatever biases there are, and the loader checks all three are).
fn qwen2(ir: &ModelIr) -> Result<ModelProgram<TensorView>> {
    llama(ir)
}

/// Qwen3: llama's blocks with an RMSNorm on each query and key head before RoPE.
fn qwen3(ir: &ModelIr) -> Result<ModelProgram<TensorView>> {
    let b = Builder::new(ir);
    let branches = b.layers(|i, l| {
        let attention = b.requiring_head_norms(i, b.attention(i, l)?)?;
        b.pre_norm_block(i, l, attention, Op::FeedForward(b.feed_forward(l)?))
    })?;
    b.program(branches)
}

/// Gemma 3: embeddings scaled by √hidden (the config's scale), per-head Q/K norms, sliding
/// windows on most layers (the config's spans), GeGLU (the config's activation), and each
/// branch's output normed again before it joins the residual ("sandwich" norms).
fn gemma3(ir: &ModelIr) -> Result<ModelProgram<TensorView>> {
    let b = Builder::new(ir);
    let branches = b.layers(|i, l| {
        let attention = b.requiring_head_norms(i, b.attention(i, l)?)?;
        let block = b.pre_norm_block(i, l, attention, Op::FeedForward(b.feed_forward(l)?))?;
        if block.iter().any(|branch| branch.post_norm.is_none()) {
            return Err(Error::Format(format!(
                "layer {i}: a gemma3 model needs post-attention and post-MLP norms"
            )));
        }
        Ok(block)
    })?;
    b.program(branches)
}

/// Phi-3: llama's blocks. Its fused Q/K/V and gate/up tensors are split into their parts
/// at load, its NEOX rope and its sliding window (every layer) are the config's.
fn phi3(ir: &ModelIr) -> Result<ModelProgram<TensorView>> {
    llama(ir)
}

/// Granite 3: llama's blocks, each attention scaled by its own multiplier instead of
/// 1/√head_dim, each branch's output scaled before it joins the residual, the logits
/// divided by the logit scale (the embedding's multiplier is the config's scale).
fn granite(ir: &ModelIr, scales: GraniteScales) -> Result<ModelProgram<TensorView>> {
    let b = Builder::new(ir);
    let branches = b.layers(|i, l| {
        let attention = Attention {
            scale: scales.attention,
            ..b.attention(i, l)?
        };
        let mut block = b.pre_norm_block(i, l, attention, Op::FeedForward(b.feed_forward(l)?))?;
        for branch in &mut block {
            branch.scale = scales.residual;
        }
        Ok(block)
    })?;
    let mut program = b.program(branches)?;
    program.head.logit_scale = 1.0 / scales.logits;
    Ok(program)
}

/// The shared helpers the architecture builders are made of (llama.cpp's `build_norm`,
/// `build_attn`, `build_ffn`): each takes its weights from the IR and checks their shapes.
struct Builder<'a> {
    ir: &'a ModelIr,
    c: &'a ModelConfig,
}

impl<'a> Builder<'a> {
    fn new(ir: &'a ModelIr) -> Self {
        Builder { ir, c: &ir.config }
    }

    /// One layer's branches from `block` for each layer, in order.
    fn layers(
        &self,
        block: impl Fn(usize, &'a LayerWeights) -> Result<Vec<Branch<TensorView, TensorView>>>,
    ) -> Result<Vec<Branch<TensorView, TensorView>>> {
        let mut all = Vec::with_capacity(2 * self.c.num_layers);
        for (i, l) in self.ir.weights.layers.iter().enumerate() {
            all.extend(block(i, l)?);
        }
        Ok(all)
    }

    /// The embedding (scaled by the config's factor), `branches`, and the head.
    fn program(
        &self,
        branches: Vec<Branch<TensorView, TensorView>>,
    ) -> Result<ModelProgram<TensorView>> {
        let (c, w) = (self.c, &self.ir.weights);
        let h = c.hidden_size;
        matrix(&w.token_embd, h, c.vocab_size, "the token embedding")?;
        if let Some(out) = &w.output {
            matrix(out, h, c.vocab_size, "the output projection")?;
        }
        let rope_freqs = w
            .rope_freqs
            .as_ref()
            .map(|f| vector(f, c.rope.rotary_dims / 2, "the rope frequency factors"))
            .transpose()?;
        Ok(ModelProgram {
            embedding: Embedding {
                table: w.token_embd.clone(),
                scale: c.embedding_scale,
            },
            branches,
            head: Head {
                norm: self.norm(
                    &w.output_norm,
                    w.output_norm_bias.as_ref(),
                    "the output norm",
                )?,
                output: w.lm_head().clone(),
                logit_scale: 1.0,
                vocab_rows: None,
            },
            rope_freqs,
        })
    }

    fn norm(
        &self,
        weight: &TensorView,
        bias: Option<&TensorView>,
        what: &str,
    ) -> Result<Norm<TensorView>> {
        let h = self.c.hidden_size;
        Ok(Norm {
            kind: self.c.norm,
            weight: vector(weight, h, what)?,
            bias: bias.map(|b| vector(b, h, what)).transpose()?,
            eps: self.c.norm_eps,
        })
    }

    /// Layer `i`'s attention: Q, K, V (with whatever biases the file has), per-head Q/K
    /// norms if the file has them, the span and RoPE base of its layer, the output
    /// projection.
    fn attention(&self, i: usize, l: &LayerWeights) -> Result<Attention<TensorView, TensorView>> {
        let c = self.c;
        let (h, qd, kvd, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        let at = |what: &str| format!("layer {i}: {what}");
        let linear = |w: &TensorView,
                      b: &Option<TensorView>,
                      inputs,
                      outputs,
                      what: &str|
         -> Result<Linear<TensorView, TensorView>> {
            Ok(Linear {
                weight: matrix(w, inputs, outputs, &at(what))?,
                bias: b
                    .as_ref()
                    .map(|b| vector(b, outputs, &at(what)))
                    .transpose()?,
            })
        };
        let head_norms = match (&l.attn_q_norm, &l.attn_k_norm) {
            (Some(q), Some(k)) => Some(HeadNorms {
                q: vector(q, hd, &at("the Q head norm"))?,
                k: vector(k, hd, &at("the K head norm"))?,
                eps: c.norm_eps,
            }),
            (None, None) => None,
            _ => {
                return Err(Error::Format(at(
                    "one of the Q and K head norms is missing",
                )))
            }
        };
        Ok(Attention {
            layer: i,
            q: linear(&l.attn_q, &l.attn_q_bias, h, qd, "Q")?,
            k: linear(&l.attn_k, &l.attn_k_bias, h, kvd, "K")?,
            v: linear(&l.attn_v, &l.attn_v_bias, h, kvd, "V")?,
            head_norms,
            span: c.layer_attention(i),
            scale: c.attention_scale(),
            sinks: l
                .attn_sinks
                .as_ref()
                .map(|s| vector(s, c.num_heads, &at("the attention sinks")))
                .transpose()?,
            out: linear(&l.attn_out, &l.attn_out_bias, qd, h, "the attention output")?,
        })
    }

    /// `attention`, refused without per-head Q and K norms (architectures defined with them).
    fn requiring_head_norms(
        &self,
        i: usize,
        attention: Attention<TensorView, TensorView>,
    ) -> Result<Attention<TensorView, TensorView>> {
        match attention.head_norms {
            Some(_) => Ok(attention),
            None => Err(Error::Format(format!(
                "layer {i}: a {} model needs per-head Q and K norms",
                self.c.arch.name()
            ))),
        }
    }

    /// The layer's dense feed-forward: gated when the layer has a gate, with the config's
    /// activation. Refused in a layer with experts (no supported architecture has a shared
    /// expert beside them).
    fn feed_forward(&self, l: &LayerWeights) -> Result<FeedForward<TensorView>> {
        let (h, ffn) = (self.c.hidden_size, self.c.ffn_size);
        let (Some(up), Some(down), None) = (&l.ffn_up, &l.ffn_down, &l.experts) else {
            return Err(Error::Format(
                "a dense feed-forward needs up and down projections and no experts".into(),
            ));
        };
        Ok(FeedForward {
            gate: l
                .ffn_gate
                .as_ref()
                .map(|g| matrix(g, h, ffn, "the FFN gate"))
                .transpose()?,
            up: matrix(up, h, ffn, "the FFN up projection")?,
            down: matrix(down, ffn, h, "the FFN down projection")?,
            activation: self.c.activation,
            biases: None,
        })
    }

    /// Layer `i`'s Mixture of Experts: the router and each expert's gated feed-forward (a
    /// view of its matrix in each stacked tensor), with the config's counts.
    fn experts(&self, i: usize, l: &LayerWeights) -> Result<Op<TensorView, TensorView>> {
        let at = |what: &str| format!("layer {i}: {what}");
        let (Some(cfg), Some(w)) = (self.c.experts, &l.experts) else {
            return Err(Error::Format(at(
                "a Mixture-of-Experts layer needs the experts' weights and counts",
            )));
        };
        if l.ffn_gate.is_some() || l.ffn_up.is_some() || l.ffn_down.is_some() {
            return Err(Error::Unsupported(at(
                "a dense feed-forward beside the experts (a shared expert)",
            )));
        }
        let (h, width, n) = (self.c.hidden_size, cfg.ffn_size, cfg.count);
        matrix(&w.router, h, n, &at("the expert router"))?;
        for (t, dims, what) in [
            (&w.gate, [h, width], "the experts' gate projections"),
            (&w.up, [h, width], "the experts' up projections"),
            (&w.down, [width, h], "the experts' down projections"),
        ] {
            if t.shape() != Some((dims, n)) {
                return Err(Error::Format(format!(
                    "{}: expected {n} experts' matrices of dims {dims:?} and one type, found {}",
                    at(what),
                    t.tensors()
                        .iter()
                        .map(|t| format!("{} {:?} {}", t.name(), t.dims(), t.qtype().name()))
                        .collect::<Vec<_>>()
                        .join(", ")
                )));
            }
        }
        // Expert e's bias of each projection: row e of its stacked biases.
        let bias_row = |t: &TensorView, len: usize, e: usize, what: &str| {
            let row = t.slice_rows(&format!("{}[{e}]", t.name()), e, 1)?;
            vector(&row, len, &at(what))
        };
        if let Some(b) = &w.biases {
            for (t, dims, what) in [
                (&b.gate, [width, n], "the experts' gate biases"),
                (&b.up, [width, n], "the experts' up biases"),
                (&b.down, [h, n], "the experts' down biases"),
            ] {
                if t.dims() != dims {
                    return Err(Error::InvalidShape(format!(
                        "{} ({}) has dims {:?}; the model config needs {dims:?}",
                        at(what),
                        t.name(),
                        t.dims()
                    )));
                }
            }
        }
        let experts = (0..n)
            .map(|e| {
                Ok(FeedForward {
                    gate: Some(w.gate.expert(e)?),
                    up: w.up.expert(e)?,
                    down: w.down.expert(e)?,
                    activation: self.c.activation,
                    biases: match &w.biases {
                        Some(b) => Some(FeedForwardBiases {
                            gate: Some(bias_row(&b.gate, width, e, "an expert's gate bias")?),
                            up: bias_row(&b.up, width, e, "an expert's up bias")?,
                            down: bias_row(&b.down, h, e, "an expert's down bias")?,
                        }),
                        None => None,
                    },
                })
            })
            .collect::<Result<Vec<_>>>()?;
        Ok(Op::Experts(Experts {
            router: Linear {
                weight: w.router.clone(),
                bias: w
                    .biases
                    .as_ref()
                    .map(|b| vector(&b.router, n, &at("the expert router's bias")))
                    .transpose()?,
            },
            experts,
            used: cfg.used,
            normalize: cfg.normalize_weights,
        }))
    }

    /// A pre-norm block: attention, then the feed-forward, each reading the stream through
    /// its own norm. Post-norms, if the file has them, norm each output again before it is
    /// added (both or neither).
    fn pre_norm_block(
        &self,
        i: usize,
        l: &LayerWeights,
        attention: Attention<TensorView, TensorView>,
        ffn: Op<TensorView, TensorView>,
    ) -> Result<Vec<Branch<TensorView, TensorView>>> {
        let at = |what: &str| format!("layer {i}: {what}");
        let attn_norm = self.norm(
            &l.attn_norm,
            l.attn_norm_bias.as_ref(),
            &at("the attention norm"),
        )?;
        let post = |w: &TensorView, what: &str| -> Result<Norm<TensorView>> {
            Ok(Norm {
                kind: NormKind::Rms,
                weight: vector(w, self.c.hidden_size, &at(what))?,
                bias: None,
                eps: self.c.norm_eps,
            })
        };
        let (attn_post, ffn_post) = match (&l.attn_post_norm, &l.ffn_post_norm) {
            (Some(a), Some(f)) => (
                Some(post(a, "the post-attention norm")?),
                Some(post(f, "the post-MLP norm")?),
            ),
            (None, None) => (None, None),
            _ => {
                return Err(Error::Format(at(
                    "one of the post-attention and post-MLP norms is missing",
                )))
            }
        };
        let ffn_norm = match &l.ffn_norm {
            Some(w) => self.norm(w, l.ffn_norm_bias.as_ref(), &at("the FFN norm"))?,
            None => return Err(Error::Format(at("the FFN norm is missing"))),
        };
        Ok(vec![
            Branch {
                norm: attn_norm,
                ops: vec![Op::Attention(attention)],
                post_norm: attn_post,
                scale: 1.0,
            },
            Branch {
                norm: ffn_norm,
                ops: vec![ffn],
                post_norm: ffn_post,
                scale: 1.0,
            },
        ])
    }
}

/// `t`, checked to be a matrix of `outputs` rows of `inputs` values.
fn matrix(t: &TensorView, inputs: usize, outputs: usize, what: &str) -> Result<TensorView> {
    if t.dims() != [inputs, outputs] {
        return Err(Error::InvalidShape(format!(
            "{what} ({}) has dims {:?}; the model config needs [{inputs}, {outputs}]",
            t.name(),
            t.dims()
        )));
    }
    Ok(t.clone())
}

/// `t`, checked to hold `len` values.
fn vector(t: &TensorView, len: usize, what: &str) -> Result<TensorView> {
    if t.elements() != len {
        return Err(Error::InvalidShape(format!(
            "{what} ({}) has {} values; the model config needs {len}",
            t.name(),
            t.elements()
        )));
    }
    Ok(t.clone())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ir::{ModelWeights, RopeConfig, SlidingWindow};

    const H: usize = 32;
    const HD: usize = 8;
    const FFN: usize = 48;
    const VOCAB: usize = 40;

    fn config(arch: Architecture) -> ModelConfig {
        ModelConfig {
            arch,
            vocab_size: VOCAB,
            hidden_size: H,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: HD,
            ffn_size: FFN,
            rope: RopeConfig {
                rotary_dims: HD,
                ..RopeConfig::default()
            },
            context_length: 64,
            ..ModelConfig::default()
        }
    }

    fn t(name: &str, dims: Vec<usize>) -> TensorView {
        let n = dims.iter().product();
        TensorView::from_f32(name, dims, &vec![0.5; n]).unwrap()
    }

    /// A model of `c` whose layers carry head norms and post-norms as asked.
    fn model(c: ModelConfig, head_norms: bool, post_norms: bool) -> ModelIr {
        let (qd, kvd) = (c.q_dim(), c.kv_dim());
        let layers = (0..c.num_layers)
            .map(|i| {
                let n = |r: &str| format!("blk.{i}.{r}");
                LayerWeights {
                    attn_norm: t(&n("attn_norm"), vec![H]),
                    attn_norm_bias: None,
                    attn_q: t(&n("q"), vec![H, qd]),
                    attn_k: t(&n("k"), vec![H, kvd]),
                    attn_v: t(&n("v"), vec![H, kvd]),
                    attn_q_bias: None,
                    attn_k_bias: None,
                    attn_v_bias: None,
                    attn_q_norm: head_norms.then(|| t(&n("q_norm"), vec![HD])),
                    attn_k_norm: head_norms.then(|| t(&n("k_norm"), vec![HD])),
                    attn_out: t(&n("o"), vec![qd, H]),
                    attn_out_bias: None,
                    attn_sinks: None,
                    ffn_norm: Some(t(&n("ffn_norm"), vec![H])),
                    ffn_norm_bias: None,
                    ffn_gate: Some(t(&n("gate"), vec![H, FFN])),
                    ffn_up: Some(t(&n("up"), vec![H, FFN])),
                    ffn_down: Some(t(&n("down"), vec![FFN, H])),
                    experts: None,
                    attn_post_norm: post_norms.then(|| t(&n("post_attn"), vec![H])),
                    ffn_post_norm: post_norms.then(|| t(&n("post_ffn"), vec![H])),
                }
            })
            .collect();
        ModelIr {
            config: c,
            weights: ModelWeights {
                token_embd: t("token_embd", vec![H, VOCAB]),
                layers,
                output_norm: t("output_norm", vec![H]),
                output_norm_bias: None,
                output: None,
                rope_freqs: None,
            },
            source: "test".into(),
            program: None,
        }
    }

    fn error(ir: &ModelIr) -> String {
        build(ir).unwrap_err().to_string()
    }

    #[test]
    fn a_llama_is_attention_then_feed_forward_a_layer_then_the_tied_head() {
        let p = build(&model(config(Architecture::Llama), false, false)).unwrap();
        assert_eq!(p.branches.len(), 4);
        for (i, b) in p.branches.iter().enumerate() {
            match (i % 2, b.single_op()) {
                (0, Some(Op::Attention(a))) => {
                    assert_eq!(a.layer, i / 2);
                    assert!(a.head_norms.is_none() && a.span.window.is_none());
                }
                (1, Some(Op::FeedForward(f))) => {
                    assert!(f.gate.is_some());
                    assert_eq!(f.activation, Activation::Silu);
                }
                other => panic!("branch {i}: {other:?}"),
            }
            assert!(b.post_norm.is_none());
            assert_eq!(b.scale, 1.0);
        }
        assert_eq!(p.head.output.name(), "token_embd");
        assert_eq!(p.norm_after(0).weight.name(), "blk.0.ffn_norm");
        assert_eq!(p.norm_after(1).weight.name(), "blk.1.attn_norm");
        assert_eq!(p.norm_after(3).weight.name(), "output_norm");
    }

    #[test]
    fn qwen3_and_gemma3_require_what_defines_them() {
        assert!(error(&model(config(Architecture::Qwen3), false, false))
            .contains("a qwen3 model needs per-head Q and K norms"));
        assert!(build(&model(config(Architecture::Qwen3), true, false)).is_ok());
        let gemma = || ModelConfig {
            sliding_window: Some(SlidingWindow {
                window: 16,
                global_every: 2,
                local_theta: Some(10_000.0),
            }),
            ..config(Architecture::Gemma3)
        };
        assert!(error(&model(gemma(), true, false)).contains("post-attention and post-MLP norms"));
        let p = build(&model(gemma(), true, true)).unwrap();
        assert!(p.branches.iter().all(|b| b.post_norm.is_some()));
        let spans: Vec<_> = p
            .ops()
            .filter_map(|op| match op {
                Op::Attention(a) => Some(a.span.window),
                _ => None,
            })
            .collect();
        assert_eq!(spans, [Some(16), None]);
    }

    #[test]
    fn a_layer_without_a_gate_has_an_ungated_feed_forward() {
        let mut ir = model(config(Architecture::Llama), false, false);
        ir.weights.layers[1].ffn_gate = None;
        let p = build(&ir).unwrap();
        let gated: Vec<bool> = p
            .ops()
            .filter_map(|op| match op {
                Op::FeedForward(f) => Some(f.gate.is_some()),
                _ => None,
            })
            .collect();
        assert_eq!(gated, [true, false]);
        ir.weights.layers[0].ffn_norm = None;
        assert!(error(&ir).contains("layer 0: the FFN norm is missing"));
    }

    #[test]
    fn a_given_program_may_run_a_parallel_block() {
        // No builder makes one; a host may describe one over the plugin ABI, and each
        // layer's two operations then read one norm and add into one branch.
        let mut ir = model(config(Architecture::Llama), false, false);
        let mut p = build(&ir).unwrap();
        let branches = std::mem::take(&mut p.branches);
        for pair in branches.chunks(2) {
            let mut block = pair[0].clone();
            block.ops.extend(pair[1].ops.iter().cloned());
            p.branches.push(block);
        }
        ir.program = Some(std::sync::Arc::new(p));
        let p = build(&ir).unwrap();
        assert_eq!(p.branches.len(), 2);
        assert!(p
            .branches
            .iter()
            .all(|b| b.ops.len() == 2 && b.single_op().is_none()));
    }

    #[test]
    fn a_weight_of_the_wrong_shape_is_named() {
        let mut ir = model(config(Architecture::Llama), false, false);
        ir.weights.layers[1].ffn_down = Some(t("blk.1.down", vec![H, FFN]));
        let e = error(&ir);
        assert!(e.contains("blk.1.down") && e.contains("[48, 32]"), "{e}");
        let mut ir = model(config(Architecture::Llama), false, false);
        ir.weights.layers[0].attn_k_norm = None;
        ir.weights.layers[0].attn_q_norm = Some(t("q_norm", vec![HD]));
        assert!(error(&ir).contains("layer 0: one of the Q and K head norms is missing"));
    }

    #[test]
    fn map_hands_each_weight_its_shape() {
        let p = build(&model(config(Architecture::Qwen3), true, false)).unwrap();
        let c = config(Architecture::Qwen3);
        let mapped = p
            .map(
                &c,
                |w, shape| -> std::result::Result<_, ()> {
                    assert_eq!(w.dims(), [shape.inputs, shape.outputs], "{}", w.name());
                    Ok(w.name().to_string())
                },
                |w, len| {
                    assert_eq!(w.elements(), len, "{}", w.name());
                    Ok(len)
                },
            )
            .unwrap();
        assert_eq!(mapped.head.output, "token_embd");
        match &mapped.branches[2].ops[0] {
            Op::Attention(a) => {
                assert_eq!(a.q.weight, "blk.1.q");
                assert_eq!(a.head_norms.as_ref().map(|n| n.q), Some(HD));
            }
            other => panic!("{other:?}"),
        }
    }
}
