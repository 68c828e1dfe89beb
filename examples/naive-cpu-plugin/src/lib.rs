//! # naive-cpu-plugin
//!
//! The worked example of docs/plugins.md: a complete third-party kiln backend, built as a
//! `cdylib` that kiln loads at run time, depending on nothing but `kiln-plugin-sdk`.
//!
//! The executor is deliberately plain: one thread, f32 activations, and every matrix-vector
//! product done row by row — dequantise the row into a scratch buffer with the reference
//! `kiln_core::quant::dequantize`, then take an f32 dot product. Weights stay quantised in
//! the host's memory map (the plugin never copies a matrix); only norms and biases, a few KB,
//! are expanded to f32 at load. It runs the model's program (`kiln_core::program`): the host
//! sends the forward pass its architecture builder made, so every architecture kiln runs
//! reaches this plugin as the same few operations (norms, attention, feed-forward), and it
//! takes every weight type core can dequantise.
//!
//! It scores 5, below the built-in `cpu` backend's 10, so automatic selection keeps the
//! built-in one; run it with `--backend naive-cpu`.

use kiln_plugin_sdk::kiln_core::program::{self, Attention, FeedForward, ModelProgram, Norm, Op};
use kiln_plugin_sdk::kiln_core::{
    self, quant, Backend, DecodeItem, Error, LayerExecutor, LoadOptions, ModelConfig, ModelIr,
    NormKind, QType, Result, RopeKind, SeqId, Support, TensorView,
};

kiln_plugin_sdk::export_backend!(NaiveCpu::new);

/// The backend: stateless, always available.
#[derive(Debug, Default, Clone)]
pub struct NaiveCpu;

impl NaiveCpu {
    pub fn new() -> Self {
        NaiveCpu
    }
}

impl Backend for NaiveCpu {
    fn name(&self) -> &str {
        "naive-cpu"
    }

    fn description(&self) -> &str {
        "example plugin: single-threaded CPU, per-row dequantise + f32 dot"
    }

    fn qtypes(&self) -> Vec<QType> {
        QType::ALL.to_vec()
    }

    fn probe(&self) -> Result<String, String> {
        Ok(format!("{} CPU, 1 thread", std::env::consts::ARCH))
    }

    fn supports(&self, model: &ModelIr) -> Support {
        // Every qtype core dequantises is runnable and every operation a program has is
        // implemented below, so the only refusal is a model whose program cannot be made
        // (or whose program does not fit its config).
        match program::build(model) {
            Ok(_) => Support::Yes {
                score: 5,
                note: "naive reference loop; slow but independent".into(),
            },
            Err(e) => Support::No {
                reason: e.to_string(),
            },
        }
    }

    fn load(&self, model: &ModelIr, options: &LoadOptions) -> Result<Box<dyn LayerExecutor>> {
        Ok(Box::new(NaiveExecutor::load(model, options)?))
    }
}

/// The read-only model: the program with its matrices as views into the host's mapping
/// (quantised) and its vectors (norms, biases) as f32.
struct Model {
    config: ModelConfig,
    program: ModelProgram<TensorView, Vec<f32>>,
    /// Inverse rotary frequency per pair: the config's rope (frequency factors and scaling
    /// applied), and the windowed layers' own base (unscaled) for attentions marked local.
    inv_freq: Vec<f32>,
    local_inv_freq: Vec<f32>,
}

/// One sequence's KV cache: `len` positions of `kv_dim` floats per layer, grown as tokens
/// arrive so an idle slot costs nothing.
struct Sequence {
    len: usize,
    keys: Vec<Vec<f32>>,
    values: Vec<Vec<f32>>,
}

/// Buffers reused by every step (no allocation per token once warm).
#[derive(Default)]
struct Scratch {
    x: Vec<f32>,
    normed: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    attn: Vec<f32>,
    proj: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    scores: Vec<f32>,
    row: Vec<f32>,
    /// A branch's summed operations.
    branch: Vec<f32>,
}

/// The loaded model plus its sequences.
pub struct NaiveExecutor {
    model: Model,
    max_context: usize,
    seqs: Vec<Option<Sequence>>,
    scratch: Scratch,
}

impl NaiveExecutor {
    pub fn load(model: &ModelIr, options: &LoadOptions) -> Result<NaiveExecutor> {
        let c = &model.config;
        // The builder (or, across the ABI, the check of the host's program) has checked
        // every weight's shape against the config.
        let program = program::build(model)?.map(c, |m, _| Ok(m.clone()), |v, _| v.to_f32())?;
        let rope_table = |rope: &kiln_core::RopeConfig, factors: Option<&[f32]>| {
            (0..rope.rotary_dims / 2)
                .map(|i| rope.inv_freq(i, factors))
                .collect::<Vec<f32>>()
        };
        let inv_freq = rope_table(&c.rope, program.rope_freqs.as_deref());
        let local_inv_freq = c
            .local_rope()
            .map_or_else(Vec::new, |rope| rope_table(&rope, None));
        let max_context = options.context_for(c);
        let seqs = (0..options.sequences()).map(|_| None).collect();
        Ok(NaiveExecutor {
            model: Model {
                config: c.clone(),
                program,
                inv_freq,
                local_inv_freq,
            },
            max_context,
            seqs,
            scratch: Scratch::default(),
        })
    }

    fn seq_mut(&mut self, seq: SeqId) -> Result<&mut Sequence> {
        self.seqs
            .get_mut(seq as usize)
            .and_then(|s| s.as_mut())
            .ok_or_else(|| Error::InvalidArgument(format!("no live sequence {seq}")))
    }
}

/// f32 dot product with four independent accumulators (lets the compiler vectorise
/// without reassociating a single running sum).
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 4];
    let (ca, cb) = (a.chunks_exact(4), b.chunks_exact(4));
    let tail: f32 = ca
        .remainder()
        .iter()
        .zip(cb.remainder())
        .map(|(x, y)| x * y)
        .sum();
    for (x, y) in ca.zip(cb) {
        for i in 0..4 {
            acc[i] += x[i] * y[i];
        }
    }
    (acc[0] + acc[1]) + (acc[2] + acc[3]) + tail
}

/// `out[r] = row_r(w) · x`, dequantising one row at a time into `row`.
fn matvec(w: &TensorView, x: &[f32], out: &mut Vec<f32>, row: &mut Vec<f32>) -> Result<()> {
    let (k, n) = (w.row_len(), w.rows());
    debug_assert_eq!(x.len(), k);
    let rb = w.row_bytes();
    out.resize(n, 0.0);
    row.resize(k, 0.0);
    for (o, bytes) in out.iter_mut().zip(w.bytes().chunks_exact(rb)) {
        quant::dequantize(w.qtype(), bytes, row)?;
        *o = dot(row, x);
    }
    Ok(())
}

fn add_bias(x: &mut [f32], b: &Option<Vec<f32>>) {
    if let Some(b) = b {
        for (v, &bb) in x.iter_mut().zip(b) {
            *v += bb;
        }
    }
}

/// `out = norm(x)`.
fn norm(n: &Norm<Vec<f32>>, x: &[f32], out: &mut Vec<f32>) {
    let (w, eps) = (&n.weight, n.eps);
    out.resize(x.len(), 0.0);
    let len = x.len() as f32;
    match n.kind {
        NormKind::Rms => {
            let scale = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / len + eps).sqrt();
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = v * scale * g;
            }
        }
        NormKind::Layer => {
            let mean = x.iter().sum::<f32>() / len;
            let scale =
                1.0 / (x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / len + eps).sqrt();
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = (v - mean) * scale * g;
            }
        }
    }
    add_bias(out, &n.bias);
}

/// Per-head RMSNorm in place (Qwen3's and Gemma 3's Q/K norms).
fn head_norm(x: &mut [f32], head_dim: usize, w: &[f32], eps: f32) {
    for head in x.chunks_exact_mut(head_dim) {
        let scale = 1.0 / (head.iter().map(|v| v * v).sum::<f32>() / head_dim as f32 + eps).sqrt();
        for (v, &g) in head.iter_mut().zip(w) {
            *v *= scale * g;
        }
    }
}

fn rope(kind: RopeKind, x: &mut [f32], head_dim: usize, inv_freq: &[f32], pos: usize) {
    let half = inv_freq.len();
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &f) in inv_freq.iter().enumerate() {
            let (sin, cos) = (pos as f32 * f).sin_cos();
            let (a, b) = match kind {
                RopeKind::Norm => (2 * i, 2 * i + 1),
                RopeKind::Neox => (i, i + half),
            };
            let (xa, xb) = (head[a], head[b]);
            head[a] = xa * cos - xb * sin;
            head[b] = xa * sin + xb * cos;
        }
    }
}

impl Model {
    /// Runs one token at the sequence's next position; writes logits when asked. On error
    /// the sequence is left as it was.
    fn step(
        &self,
        s: &mut Scratch,
        seq: &mut Sequence,
        token: u32,
        logits: Option<&mut [f32]>,
    ) -> Result<()> {
        let len = seq.len;
        let result = self.step_inner(s, seq, token, logits);
        if result.is_err() {
            let kvd = self.config.kv_dim();
            for cache in seq.keys.iter_mut().chain(seq.values.iter_mut()) {
                cache.truncate(len * kvd);
            }
            seq.len = len;
        }
        result
    }

    fn step_inner(
        &self,
        s: &mut Scratch,
        seq: &mut Sequence,
        token: u32,
        logits: Option<&mut [f32]>,
    ) -> Result<()> {
        let (c, p) = (&self.config, &self.program);
        if token as usize >= c.vocab_size {
            return Err(Error::InvalidArgument(format!(
                "token {token} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let table = &p.embedding.table;
        s.x.resize(c.hidden_size, 0.0);
        quant::dequantize(table.qtype(), table.row(token as usize), &mut s.x)?;
        s.x.iter_mut().for_each(|x| *x *= p.embedding.scale);

        // x += scale · post_norm(Σ op(norm(x))) for each branch.
        for branch in &p.branches {
            norm(&branch.norm, &s.x, &mut s.normed);
            s.branch.clear();
            s.branch.resize(c.hidden_size, 0.0);
            for op in &branch.ops {
                match op {
                    Op::Attention(a) => self.attention(a, s, seq)?,
                    Op::FeedForward(f) => self.feed_forward(f, s)?,
                    // The plugin ABI describes no experts: a host never sends them.
                    Op::Experts(_) => {
                        return Err(Error::Unsupported(
                            "Mixture-of-Experts feed-forwards".into(),
                        ))
                    }
                }
                s.branch.iter_mut().zip(&s.proj).for_each(|(b, p)| *b += p);
            }
            let out = match &branch.post_norm {
                Some(n) => {
                    norm(n, &s.branch, &mut s.proj);
                    &s.proj
                }
                None => &s.branch,
            };
            s.x.iter_mut()
                .zip(out)
                .for_each(|(x, o)| *x += branch.scale * o);
        }
        seq.len += 1;

        if let Some(logits) = logits {
            norm(&p.head.norm, &s.x, &mut s.normed);
            let mut out = std::mem::take(&mut s.proj);
            matvec(&p.head.output, &s.normed, &mut out, &mut s.row)?;
            for (l, o) in logits.iter_mut().zip(&out) {
                *l = o * p.head.logit_scale;
            }
            s.proj = out;
        }
        Ok(())
    }

    /// `s.proj = attention(s.normed)` at the sequence's next position, whose key and value
    /// join the layer's cache.
    fn attention(
        &self,
        a: &Attention<TensorView, Vec<f32>>,
        s: &mut Scratch,
        seq: &mut Sequence,
    ) -> Result<()> {
        let c = &self.config;
        let (hd, kvd, pos) = (c.head_dim, c.kv_dim(), seq.len);
        matvec(&a.q.weight, &s.normed, &mut s.q, &mut s.row)?;
        matvec(&a.k.weight, &s.normed, &mut s.k, &mut s.row)?;
        matvec(&a.v.weight, &s.normed, &mut s.v, &mut s.row)?;
        add_bias(&mut s.q, &a.q.bias);
        add_bias(&mut s.k, &a.k.bias);
        add_bias(&mut s.v, &a.v.bias);
        if let Some(n) = &a.head_norms {
            head_norm(&mut s.q, hd, &n.q, n.eps);
            head_norm(&mut s.k, hd, &n.k, n.eps);
        }
        let inv_freq = match a.span.local_rope {
            true => &self.local_inv_freq,
            false => &self.inv_freq,
        };
        rope(c.rope.kind, &mut s.q, hd, inv_freq, pos);
        rope(c.rope.kind, &mut s.k, hd, inv_freq, pos);
        seq.keys[a.layer].extend_from_slice(&s.k);
        seq.values[a.layer].extend_from_slice(&s.v);

        // Over the positions the span lets `pos` see, two passes (scores, then weighted
        // values).
        let (keys, values) = (&seq.keys[a.layer], &seq.values[a.layer]);
        let first = a.span.first_position(pos);
        let group = c.gqa_ratio();
        s.attn.resize(c.q_dim(), 0.0);
        s.scores.resize(pos + 1 - first, 0.0);
        for (head, out) in s.attn.chunks_exact_mut(hd).enumerate() {
            let q = &s.q[head * hd..][..hd];
            let off = (head / group) * hd;
            let mut max = f32::NEG_INFINITY;
            for (t, score) in (first..).zip(s.scores.iter_mut()) {
                *score = dot(q, &keys[t * kvd + off..][..hd]) * a.scale;
                max = max.max(*score);
            }
            let mut sum = 0.0f32;
            for score in s.scores.iter_mut() {
                *score = (*score - max).exp();
                sum += *score;
            }
            out.fill(0.0);
            for (t, &p) in (first..).zip(&s.scores) {
                for (o, &v) in out.iter_mut().zip(&values[t * kvd + off..][..hd]) {
                    *o += p * v;
                }
            }
            let inv = 1.0 / sum;
            out.iter_mut().for_each(|o| *o *= inv);
        }
        matvec(&a.out.weight, &s.attn, &mut s.proj, &mut s.row)?;
        add_bias(&mut s.proj, &a.out.bias);
        Ok(())
    }

    /// `s.proj = feed_forward(s.normed)`.
    fn feed_forward(&self, f: &FeedForward<TensorView, Vec<f32>>, s: &mut Scratch) -> Result<()> {
        let biases = f.biases.as_ref();
        matvec(&f.up, &s.normed, &mut s.up, &mut s.row)?;
        add_bias(&mut s.up, &biases.map(|b| b.up.clone()));
        if let Some(gate) = &f.gate {
            matvec(gate, &s.normed, &mut s.gate, &mut s.row)?;
            add_bias(&mut s.gate, &biases.and_then(|b| b.gate.clone()));
            s.up.iter_mut()
                .zip(&s.gate)
                .for_each(|(u, &g)| *u = f.activation.gated(g, *u));
        } else {
            s.up.iter_mut().for_each(|u| *u = f.activation.ungated(*u));
        }
        matvec(&f.down, &s.up, &mut s.proj, &mut s.row)?;
        add_bias(&mut s.proj, &biases.map(|b| b.down.clone()));
        Ok(())
    }
}

impl LayerExecutor for NaiveExecutor {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn max_context(&self) -> usize {
        self.max_context
    }

    fn max_sequences(&self) -> usize {
        self.seqs.len()
    }

    fn new_sequence(&mut self) -> Result<SeqId> {
        let layers = self.model.config.num_layers;
        let slot = self.seqs.iter().position(|s| s.is_none()).ok_or_else(|| {
            Error::InvalidArgument(format!("all {} sequences are in use", self.seqs.len()))
        })?;
        self.seqs[slot] = Some(Sequence {
            len: 0,
            keys: vec![Vec::new(); layers],
            values: vec![Vec::new(); layers],
        });
        Ok(slot as SeqId)
    }

    fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.seq_mut(seq)?;
        self.seqs[seq as usize] = None;
        Ok(())
    }

    fn sequence_len(&self, seq: SeqId) -> Result<usize> {
        self.seqs
            .get(seq as usize)
            .and_then(|s| s.as_ref())
            .map(|s| s.len)
            .ok_or_else(|| Error::InvalidArgument(format!("no live sequence {seq}")))
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let kvd = self.model.config.kv_dim();
        let s = self.seq_mut(seq)?;
        if len > s.len {
            return Err(Error::InvalidArgument(format!(
                "cannot truncate sequence {seq} of {} tokens to {len}",
                s.len
            )));
        }
        for cache in s.keys.iter_mut().chain(s.values.iter_mut()) {
            cache.truncate(len * kvd);
        }
        s.len = len;
        Ok(())
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> Result<()> {
        // The contract's checks (docs/plugins.md): all of them before any state changes.
        let len = self.sequence_len(seq)?;
        kiln_core::check_prefill(
            tokens,
            logits,
            self.model.config.vocab_size,
            len,
            self.max_context,
        )?;
        let NaiveExecutor {
            model,
            seqs,
            scratch,
            ..
        } = self;
        let s = seqs[seq as usize].as_mut().expect("checked above");
        let (&last, rest) = tokens.split_last().expect("checked above");
        for &t in rest {
            model.step(scratch, s, t, None)?;
        }
        model.step(scratch, s, last, Some(logits))
    }

    fn decode(&mut self, batch: &[DecodeItem], logits: &mut [f32]) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        // Every item is checked before any runs, so a refused batch changes no sequence.
        kiln_core::check_decode(batch, logits, vocab, self.max_context, |seq| {
            self.sequence_len(seq)
        })?;
        let NaiveExecutor {
            model,
            seqs,
            scratch,
            ..
        } = self;
        for (item, row) in batch.iter().zip(logits.chunks_exact_mut(vocab)) {
            let s = seqs[item.seq as usize].as_mut().expect("checked above");
            model.step(scratch, s, item.token, Some(row))?;
        }
        Ok(())
    }
}
