//! # naive-cpu-plugin
//!
//! The worked example of docs/plugins.md: a complete third-party kiln backend, built as a
//! `cdylib` that kiln loads at run time, depending on nothing but `kiln-plugin-sdk`.
//!
//! The executor is deliberately plain: one thread, f32 activations, and every matrix-vector
//! product done row by row — dequantise the row into a scratch buffer with the reference
//! `kiln_core::quant::dequantize`, then take an f32 dot product. Weights stay quantised in
//! the host's memory map (the plugin never copies a matrix); only norms and biases, a few KB,
//! are expanded to f32 at load. It runs every architecture the IR describes and every weight
//! type core can dequantise.
//!
//! It scores 5, below the built-in `cpu` backend's 10, so automatic selection keeps the
//! built-in one; run it with `--backend naive-cpu`.

use kiln_plugin_sdk::kiln_core::{
    self, quant, Activation, Backend, DecodeItem, Error, LayerExecutor, LoadOptions, ModelConfig,
    ModelIr, ModelWeights, NormKind, QType, Result, RopeKind, SeqId, Support, TensorView,
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
        // Every qtype core dequantises is runnable; the IR's features are all implemented
        // below, so the only refusal is a model that fails its own consistency check.
        match model.config.validate() {
            Ok(()) => Support::Yes {
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

/// Per-layer vectors small enough to keep as f32.
struct SmallLayer {
    attn_norm: Vec<f32>,
    attn_norm_bias: Option<Vec<f32>>,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    out_bias: Option<Vec<f32>>,
    ffn_norm: Option<Vec<f32>>,
    ffn_norm_bias: Option<Vec<f32>>,
}

/// The read-only model: quantised matrices (views into the host's mapping) plus f32 vectors.
struct Model {
    config: ModelConfig,
    weights: ModelWeights,
    small: Vec<SmallLayer>,
    output_norm: Vec<f32>,
    output_norm_bias: Option<Vec<f32>>,
    /// Inverse rotary frequency per pair, frequency factors and scaling applied.
    inv_freq: Vec<f32>,
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
    ffn_out: Vec<f32>,
    scores: Vec<f32>,
    row: Vec<f32>,
}

/// The loaded model plus its sequences.
pub struct NaiveExecutor {
    model: Model,
    max_context: usize,
    seqs: Vec<Option<Sequence>>,
    scratch: Scratch,
}

fn small(t: &TensorView) -> Result<Vec<f32>> {
    t.to_f32()
}

fn small_opt(t: &Option<TensorView>) -> Result<Option<Vec<f32>>> {
    t.as_ref().map(small).transpose()
}

/// Checks that `t` multiplies an input of `k` values into `n` outputs.
fn check_matrix(t: &TensorView, k: usize, n: usize) -> Result<()> {
    if t.dims().len() != 2 || t.row_len() != k || t.rows() != n {
        return Err(Error::InvalidShape(format!(
            "{} has dims {:?}; expected [{k}, {n}]",
            t.name(),
            t.dims()
        )));
    }
    Ok(())
}

fn check_vector(t: &Option<Vec<f32>>, n: usize, what: &str) -> Result<()> {
    match t {
        Some(v) if v.len() != n => Err(Error::InvalidShape(format!(
            "{what} has {} values; expected {n}",
            v.len()
        ))),
        _ => Ok(()),
    }
}

impl NaiveExecutor {
    pub fn load(model: &ModelIr, options: &LoadOptions) -> Result<NaiveExecutor> {
        let c = &model.config;
        c.validate()?;
        let w = &model.weights;
        let (h, qd, kvd, f) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.ffn_size);
        check_matrix(&w.token_embd, h, c.vocab_size)?;
        check_matrix(w.lm_head(), h, c.vocab_size)?;
        if w.layers.len() != c.num_layers {
            return Err(Error::InvalidShape(format!(
                "{} layers of weights for {} layers",
                w.layers.len(),
                c.num_layers
            )));
        }
        let mut small_layers = Vec::with_capacity(c.num_layers);
        for l in &w.layers {
            check_matrix(&l.attn_q, h, qd)?;
            check_matrix(&l.attn_k, h, kvd)?;
            check_matrix(&l.attn_v, h, kvd)?;
            check_matrix(&l.attn_out, qd, h)?;
            check_matrix(&l.ffn_up, h, f)?;
            check_matrix(&l.ffn_down, f, h)?;
            if let Some(g) = &l.ffn_gate {
                check_matrix(g, h, f)?;
            } else if c.gated_ffn {
                return Err(Error::Format(format!(
                    "gated FFN without a gate in {}",
                    l.ffn_up.name()
                )));
            }
            if l.ffn_norm.is_none() && !c.parallel_residual {
                return Err(Error::Format(format!(
                    "no FFN norm beside {}",
                    l.ffn_up.name()
                )));
            }
            let s = SmallLayer {
                attn_norm: small(&l.attn_norm)?,
                attn_norm_bias: small_opt(&l.attn_norm_bias)?,
                q_bias: small_opt(&l.attn_q_bias)?,
                k_bias: small_opt(&l.attn_k_bias)?,
                v_bias: small_opt(&l.attn_v_bias)?,
                q_norm: small_opt(&l.attn_q_norm)?,
                k_norm: small_opt(&l.attn_k_norm)?,
                out_bias: small_opt(&l.attn_out_bias)?,
                ffn_norm: small_opt(&l.ffn_norm)?,
                ffn_norm_bias: small_opt(&l.ffn_norm_bias)?,
            };
            for (v, n, what) in [
                (&Some(s.attn_norm.clone()), h, "attention norm"),
                (&s.attn_norm_bias, h, "attention norm bias"),
                (&s.q_bias, qd, "Q bias"),
                (&s.k_bias, kvd, "K bias"),
                (&s.v_bias, kvd, "V bias"),
                (&s.q_norm, c.head_dim, "Q norm"),
                (&s.k_norm, c.head_dim, "K norm"),
                (&s.out_bias, h, "output bias"),
                (&s.ffn_norm, h, "FFN norm"),
                (&s.ffn_norm_bias, h, "FFN norm bias"),
            ] {
                check_vector(v, n, what)?;
            }
            small_layers.push(s);
        }
        let freq_factors = w.rope_freqs.as_ref().map(|t| t.to_f32()).transpose()?;
        let inv_freq = (0..c.rope.rotary_dims / 2)
            .map(|i| c.rope.inv_freq(i, freq_factors.as_deref()))
            .collect();
        let output_norm = small(&w.output_norm)?;
        let output_norm_bias = small_opt(&w.output_norm_bias)?;
        check_vector(&Some(output_norm.clone()), h, "output norm")?;
        check_vector(&output_norm_bias, h, "output norm bias")?;
        let max_context = options.context_for(c);
        let seqs = (0..options.sequences()).map(|_| None).collect();
        Ok(NaiveExecutor {
            model: Model {
                config: c.clone(),
                weights: w.clone(),
                small: small_layers,
                output_norm,
                output_norm_bias,
                inv_freq,
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

fn norm(kind: NormKind, x: &[f32], w: &[f32], b: &Option<Vec<f32>>, eps: f32, out: &mut Vec<f32>) {
    out.resize(x.len(), 0.0);
    let n = x.len() as f32;
    match kind {
        NormKind::Rms => {
            let scale = 1.0 / (x.iter().map(|v| v * v).sum::<f32>() / n + eps).sqrt();
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = v * scale * g;
            }
        }
        NormKind::Layer => {
            let mean = x.iter().sum::<f32>() / n;
            let scale =
                1.0 / (x.iter().map(|v| (v - mean) * (v - mean)).sum::<f32>() / n + eps).sqrt();
            for ((o, &v), &g) in out.iter_mut().zip(x).zip(w) {
                *o = (v - mean) * scale * g;
            }
        }
    }
    add_bias(out, b);
}

/// Per-head RMSNorm in place (Qwen3's QK norm).
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

fn activate(kind: Activation, x: f32) -> f32 {
    match kind {
        Activation::Silu => x / (1.0 + (-x).exp()),
        Activation::Gelu => {
            const SQRT_2_OVER_PI: f32 = 0.797_884_6;
            0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh())
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
        let c = &self.config;
        let w = &self.weights;
        if token as usize >= c.vocab_size {
            return Err(Error::InvalidArgument(format!(
                "token {token} is outside the vocabulary of {}",
                c.vocab_size
            )));
        }
        let (hd, kvd) = (c.head_dim, c.kv_dim());
        let pos = seq.len;
        s.x.resize(c.hidden_size, 0.0);
        quant::dequantize(
            w.token_embd.qtype(),
            w.token_embd.row(token as usize),
            &mut s.x,
        )?;

        for (li, (lw, sl)) in w.layers.iter().zip(&self.small).enumerate() {
            norm(
                c.norm,
                &s.x,
                &sl.attn_norm,
                &sl.attn_norm_bias,
                c.norm_eps,
                &mut s.normed,
            );
            matvec(&lw.attn_q, &s.normed, &mut s.q, &mut s.row)?;
            matvec(&lw.attn_k, &s.normed, &mut s.k, &mut s.row)?;
            matvec(&lw.attn_v, &s.normed, &mut s.v, &mut s.row)?;
            add_bias(&mut s.q, &sl.q_bias);
            add_bias(&mut s.k, &sl.k_bias);
            add_bias(&mut s.v, &sl.v_bias);
            if let (Some(qn), Some(kn)) = (&sl.q_norm, &sl.k_norm) {
                head_norm(&mut s.q, hd, qn, c.norm_eps);
                head_norm(&mut s.k, hd, kn, c.norm_eps);
            }
            rope(c.rope.kind, &mut s.q, hd, &self.inv_freq, pos);
            rope(c.rope.kind, &mut s.k, hd, &self.inv_freq, pos);
            seq.keys[li].extend_from_slice(&s.k);
            seq.values[li].extend_from_slice(&s.v);

            // Attention over positions 0..=pos, two passes (scores, then weighted values).
            let (keys, values) = (&seq.keys[li], &seq.values[li]);
            let scale = 1.0 / (hd as f32).sqrt();
            let group = c.gqa_ratio();
            s.attn.resize(c.q_dim(), 0.0);
            s.scores.resize(pos + 1, 0.0);
            for (head, out) in s.attn.chunks_exact_mut(hd).enumerate() {
                let q = &s.q[head * hd..][..hd];
                let off = (head / group) * hd;
                let mut max = f32::NEG_INFINITY;
                for (t, score) in s.scores.iter_mut().enumerate() {
                    *score = dot(q, &keys[t * kvd + off..][..hd]) * scale;
                    max = max.max(*score);
                }
                let mut sum = 0.0f32;
                for score in s.scores.iter_mut() {
                    *score = (*score - max).exp();
                    sum += *score;
                }
                out.fill(0.0);
                for (t, &p) in s.scores.iter().enumerate() {
                    for (o, &v) in out.iter_mut().zip(&values[t * kvd + off..][..hd]) {
                        *o += p * v;
                    }
                }
                let inv = 1.0 / sum;
                out.iter_mut().for_each(|o| *o *= inv);
            }
            matvec(&lw.attn_out, &s.attn, &mut s.proj, &mut s.row)?;
            add_bias(&mut s.proj, &sl.out_bias);

            // The FFN reads the attention norm's output under a parallel residual, or a
            // fresh norm of the updated residual otherwise.
            if !c.parallel_residual {
                s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
                let fw = sl.ffn_norm.as_deref().expect("checked at load");
                norm(
                    c.norm,
                    &s.x,
                    fw,
                    &sl.ffn_norm_bias,
                    c.norm_eps,
                    &mut s.normed,
                );
            }
            matvec(&lw.ffn_up, &s.normed, &mut s.up, &mut s.row)?;
            if let Some(gate) = &lw.ffn_gate {
                matvec(gate, &s.normed, &mut s.gate, &mut s.row)?;
                s.up.iter_mut()
                    .zip(&s.gate)
                    .for_each(|(u, &g)| *u *= activate(c.activation, g));
            } else {
                s.up.iter_mut()
                    .for_each(|u| *u = activate(c.activation, *u));
            }
            matvec(&lw.ffn_down, &s.up, &mut s.ffn_out, &mut s.row)?;
            s.x.iter_mut().zip(&s.ffn_out).for_each(|(x, f)| *x += f);
            if c.parallel_residual {
                s.x.iter_mut().zip(&s.proj).for_each(|(x, p)| *x += p);
            }
        }
        seq.len += 1;

        if let Some(logits) = logits {
            norm(
                c.norm,
                &s.x,
                &self.output_norm,
                &self.output_norm_bias,
                c.norm_eps,
                &mut s.normed,
            );
            let mut out = std::mem::take(&mut s.proj);
            matvec(w.lm_head(), &s.normed, &mut out, &mut s.row)?;
            logits.copy_from_slice(&out);
            s.proj = out;
        }
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
