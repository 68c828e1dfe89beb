//! Batched prefill: a prompt goes through the model a chunk of up to [`CHUNK`] tokens at a
//! time, every matrix product a tensor-core GEMM instead of one GEMV per token.
//!
//! Per layer and chunk: each weight is dequantised to f16 into one reusable buffer (a
//! kernel per type, sharing the GEMVs' unpacking code) and multiplied by the chunk's f16
//! activations with cuBLAS (f32 accumulation, f32 output; the O and down projections
//! accumulate straight into the f32 residual stream with β = 1). Between the GEMMs:
//! RMSNorm over the rows (to f16), bias + QK-norm + RoPE with the K/V cache write for the
//! chunk's positions, causal GQA attention of the chunk's queries over the cache, SwiGLU.
//! Only the last token goes through the final norm and the LM head (the decode step's own
//! GEMV), since that is all prefill returns, unless the caller scores the prompt
//! ([`ScoredRows`]): then every scored row of a chunk is normed and multiplied by the LM
//! head as one more GEMM, the head dequantised a slice of the vocabulary at a time into
//! the weight buffer. Everything is allocated at load, sized for one chunk, but for the
//! scored rows' logits, which the first scoring call allocates (one chunk's worth).

use std::sync::Arc;

use kiln_core::{Error, ModelConfig, Result};
use kiln_kernels::{
    Blas, DevSlice, Device, Event, GemvInput, KvFormat, PrefillAttnArgs, Workspace,
};

use super::{DeviceAttention, DeviceBranch, DeviceFeedForward, DeviceOp, GpuExecutor};

/// Tokens per chunk: bounds the workspace (the activations of a chunk) while keeping the
/// GEMMs wide enough to run at tensor-core speed.
pub const CHUNK: usize = 512;

/// The prefill's activations for one chunk, carved from its workspace.
#[derive(Clone, Copy)]
struct PrefillBuffers {
    ids: DevSlice<i32>,
    /// Residual stream, `[chunk][hidden]` f32.
    x: DevSlice<f32>,
    /// The current GEMM input in f16: normed x, attention output or SwiGLU output.
    act: DevSlice<u16>,
    qkv: DevSlice<f32>,
    q: DevSlice<f32>,
    /// Gate and up outputs side by side, `[chunk][2 * ffn]`.
    gu: DevSlice<f32>,
    /// A block's output before its sandwich norm, `[chunk][hidden]`.
    proj: DevSlice<f32>,
    /// One weight matrix (or Q/K/V, or gate and up, stacked) in f16.
    wbuf: DevSlice<u16>,
    /// With a q8_0 cache: one layer's keys and values of the sequence as f16, in the f16
    /// cache's layout, which the prefill attention kernels read (empty otherwise).
    k_f16: DevSlice<u16>,
    v_f16: DevSlice<u16>,
}

/// One sequence's rows in a prefill chunk: rows `first..first + n` of the chunk are its
/// tokens from position `pos0` on, in cache slot `slot`. A chunk holds one sequence's rows
/// (a prompt), or several sequences' (a batch of hidden-state requests sharing the passes).
#[derive(Clone, Copy, Debug)]
struct ChunkRows {
    slot: usize,
    first: usize,
    n: usize,
    pos0: usize,
}

/// The prefill's cuBLAS handle and workspace.
pub(super) struct PrefillState {
    blas: Blas,
    chunk: usize,
    b: PrefillBuffers,
    // Owns the memory the slices point into.
    _ws: Workspace,
}

impl PrefillState {
    pub(super) fn new(
        device: &Arc<Device>,
        blas: Blas,
        c: &ModelConfig,
        max_ctx: usize,
        kv: KvFormat,
    ) -> kiln_kernels::Result<PrefillState> {
        let (h, qd, kvd, ffn) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.ffn_size);
        let width = qd + 2 * kvd;
        let chunk = CHUNK.min(max_ctx);
        let widest = h.max(qd).max(ffn);
        let wmax = (width * h).max(h * qd).max(2 * ffn * h).max(h * ffn);
        let kv_f16 = match kv {
            KvFormat::F16 => 0,
            KvFormat::Q8_0 => kvd * max_ctx,
        };
        let (ws, b) = Workspace::carve(device, |a| PrefillBuffers {
            ids: a.take(chunk),
            x: a.take(chunk * h),
            act: a.take(chunk * widest),
            qkv: a.take(chunk * width),
            q: a.take(chunk * qd),
            gu: a.take(chunk * 2 * ffn),
            proj: a.take(chunk * h),
            wbuf: a.take(wmax),
            k_f16: a.take(kv_f16),
            v_f16: a.take(kv_f16),
        })?;
        let s = PrefillState {
            blas,
            chunk,
            b,
            _ws: ws,
        };
        // All ones: NaN in f32 and f16, so anything read before it is written shows.
        s._ws.fill_bytes(0xff)?;
        Ok(s)
    }
}

impl PrefillState {
    /// Tokens a chunk holds at most.
    pub(super) fn chunk_len(&self) -> usize {
        self.chunk
    }
}

/// Where a profiled prefill's device time went, in milliseconds.
#[derive(Debug, Default, Clone, Copy)]
pub struct PrefillTimes {
    /// Dequantising weights to f16.
    pub dequant_ms: f64,
    /// cuBLAS GEMMs.
    pub gemm_ms: f64,
    /// Everything else: embedding, norms, RoPE, attention, SwiGLU, the LM head.
    pub other_ms: f64,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Part {
    Dequant,
    Gemm,
    Other,
}

/// Events at every change of [`Part`] on the stream (profiling only: it adds no sync, but
/// an event per switch).
struct Timer {
    device: Arc<Device>,
    marks: Vec<(Part, Event)>,
}

impl Timer {
    fn mark(t: &mut Option<Timer>, part: Part) -> Result<()> {
        let Some(t) = t else { return Ok(()) };
        if t.marks.last().is_some_and(|(p, _)| *p == part) {
            return Ok(());
        }
        let e = Event::new(&t.device)?;
        e.record()?;
        t.marks.push((part, e));
        Ok(())
    }

    fn finish(mut self) -> Result<PrefillTimes> {
        let end = Event::new(&self.device)?;
        end.record()?;
        self.marks.push((Part::Other, end));
        let mut times = PrefillTimes::default();
        for w in self.marks.windows(2) {
            let ms = w[0].1.elapsed_ms(&w[1].1)? as f64;
            match w[0].0 {
                Part::Dequant => times.dequant_ms += ms,
                Part::Gemm => times.gemm_ms += ms,
                Part::Other => times.other_ms += ms,
            }
        }
        Ok(times)
    }
}

/// What a scoring prefill returns of the rows after every token from `first` on (row `j`
/// for token `first + j`): the logits themselves
/// ([`kiln_core::LayerExecutor::prefill_logits`]) or their scores against the tokens that
/// follow ([`kiln_core::LayerExecutor::prefill_scores`]), through `dev`, one chunk's rows.
pub(super) struct ScoredRows<'a> {
    pub first: usize,
    pub out: ScoredOut<'a>,
    pub dev: ScoringBuffers,
}

pub(super) enum ScoredOut<'a> {
    Logits(&'a mut [f32]),
    /// The final hidden states (after the output norm), `hidden_size` values a row
    /// ([`kiln_core::LayerExecutor::prefill_hidden`]): no LM head.
    Hidden(&'a mut [f32]),
    Scores {
        targets: &'a [u32],
        scores: &'a mut [kiln_core::TokenScore],
    },
}

/// Device buffers of a scoring prefill, one chunk's rows each (allocated by the executor's
/// first scoring call and kept).
#[derive(Clone, Copy)]
pub(super) struct ScoringBuffers {
    pub logits: DevSlice<f32>,
    /// One chunk's normed hidden states, `[chunk][hidden]`.
    pub hidden: DevSlice<f32>,
    pub targets: DevSlice<i32>,
    pub nll: DevSlice<f32>,
    pub top: DevSlice<i32>,
}

impl GpuExecutor {
    /// Why prompts are processed token by token instead of in batches, if they are (no
    /// cuBLAS on this machine).
    pub fn batched_prefill_unavailable(&self) -> Option<&str> {
        self.prefill.as_ref().err().map(|s| s.as_str())
    }

    /// Prefills `seq` with `tokens` like [`kiln_core::LayerExecutor::prefill`], timing
    /// dequantisation, GEMMs and the rest with events (a benchmark's breakdown).
    pub fn prefill_profiled(
        &mut self,
        seq: kiln_core::SeqId,
        tokens: &[u32],
        logits: &mut [f32],
    ) -> Result<PrefillTimes> {
        let slot = self.check_prefill(seq, tokens, logits)?;
        let times = self.prefill_batched(slot, tokens, true, None)?;
        self.s.logits.copy_to_host(&self.device, logits)?;
        times.ok_or_else(|| Error::Unsupported("batched prefill is unavailable".into()))
    }

    /// Runs `tokens` through the model at the slot's next positions, chunk by chunk,
    /// leaving the last token's logits in the decode workspace, and with `scored` those
    /// of every token from its `first` on in its `out`. `None` times unless `profile`; an
    /// error when batched prefill is unavailable.
    pub(super) fn prefill_batched(
        &mut self,
        slot: usize,
        tokens: &[u32],
        profile: bool,
        mut scored: Option<ScoredRows<'_>>,
    ) -> Result<Option<PrefillTimes>> {
        if self.prefill.is_ok() {
            let end = self.slots[slot].len + tokens.len();
            self.reserve(slot, end)?;
        }
        let p = self
            .prefill
            .as_ref()
            .map_err(|why| Error::Unsupported(format!("batched prefill: {why}")))?;
        let c = &self.config;
        let k = &self.k;
        let h = c.hidden_size;
        let start = self.slots[slot].len;
        let mut timer = profile.then(|| Timer {
            device: self.device.clone(),
            marks: Vec::new(),
        });
        let mut last_x = None;
        for (ci, chunk) in tokens.chunks(p.chunk).enumerate() {
            let n = chunk.len();
            let pos0 = start + ci * p.chunk;
            let ids: Vec<i32> = chunk.iter().map(|&t| t as i32).collect();
            let rows = [ChunkRows {
                slot,
                first: 0,
                n,
                pos0,
            }];
            self.prefill_chunk(p, &ids, &rows, &mut timer)?;
            if let Some(s) = scored.as_mut() {
                // The chunk's rows from the first scored token on, if it has any.
                let g0 = ci * p.chunk;
                let r0 = s.first.saturating_sub(g0);
                if r0 < n {
                    let vocab = c.vocab_size;
                    let rows = n - r0;
                    let j = g0 + r0 - s.first..g0 + n - s.first;
                    match &mut s.out {
                        ScoredOut::Hidden(out) => {
                            let y = s.dev.hidden.sub(0, rows * h)?;
                            k.rmsnorm_q8_1(
                                p.b.x.sub(r0 * h, rows * h)?,
                                rows,
                                h,
                                Some(self.out_norm.slice()),
                                Some(c.norm_eps),
                                Some(y),
                                None,
                            )?;
                            y.copy_to_host(&self.device, &mut out[j.start * h..j.end * h])?;
                        }
                        ScoredOut::Logits(out) => {
                            let logits = s.dev.logits.sub(0, rows * vocab)?;
                            self.logits_rows(p, r0, rows, logits, &mut timer)?;
                            logits.copy_to_host(
                                &self.device,
                                &mut out[j.start * vocab..j.end * vocab],
                            )?
                        }
                        ScoredOut::Scores { targets, scores } => {
                            let logits = s.dev.logits.sub(0, rows * vocab)?;
                            self.logits_rows(p, r0, rows, logits, &mut timer)?;
                            let ids: Vec<i32> =
                                targets[j.clone()].iter().map(|&t| t as i32).collect();
                            let (t, nll, top) = (
                                s.dev.targets.sub(0, rows)?,
                                s.dev.nll.sub(0, rows)?,
                                s.dev.top.sub(0, rows)?,
                            );
                            t.copy_from_host(&self.device, &ids)?;
                            k.score_rows(logits, rows, vocab, t, nll, top)?;
                            let mut nll_host = vec![0f32; rows];
                            let mut top_host = vec![0i32; rows];
                            nll.copy_to_host(&self.device, &mut nll_host)?;
                            top.copy_to_host(&self.device, &mut top_host)?;
                            for ((out, nll), top) in
                                scores[j].iter_mut().zip(nll_host).zip(top_host)
                            {
                                *out = kiln_core::TokenScore {
                                    nll,
                                    top: top as u32,
                                };
                            }
                        }
                    }
                }
            }
            last_x = Some(p.b.x.sub((n - 1) * h, h)?);
        }
        let last_x = last_x.expect("prefill has at least one token");
        Timer::mark(&mut timer, Part::Other)?;
        let s = &self.s;
        k.rmsnorm_q8_1(
            last_x,
            1,
            h,
            Some(self.out_norm.slice()),
            Some(c.norm_eps),
            None,
            Some(s.xq),
        )?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embd);
        k.gemv(
            head,
            &GemvInput {
                x: None,
                q8: Some(s.xq),
                norm: None,
            },
            self.path,
            self.tiling(head),
            s.logits,
            &self.head_epilogue(),
        )?;
        let times = match timer {
            Some(t) => Some(t.finish()?),
            None => None,
        };
        self.slots[slot].len = start + tokens.len();
        self.slots[slot].record(start, tokens);
        Ok(times)
    }

    /// Several sequences' final hidden states (after the output norm) in shared passes:
    /// `items` are (slot, tokens, first) with every slot's blocks already reserved up to
    /// its new length, their rows packed into chunks of up to [`CHUNK`] rows whatever
    /// sequence they belong to (a sequence longer than what a chunk has left continues in
    /// the next), each sequence's rows attending within its own cache. Item `i`'s rows from
    /// `first` on go to `hidden` after the items before it's; every sequence ends appended.
    pub(super) fn prefill_hidden_rows(
        &mut self,
        items: &[(usize, &[u32], usize)],
        hidden: &mut [f32],
        dev: ScoringBuffers,
    ) -> Result<()> {
        let p = self
            .prefill
            .as_ref()
            .map_err(|why| Error::Unsupported(format!("batched prefill: {why}")))?;
        let c = &self.config;
        let k = &self.k;
        let h = c.hidden_size;
        let starts: Vec<usize> = items
            .iter()
            .map(|&(slot, _, _)| self.slots[slot].len)
            .collect();
        // Where each item's rows go in `hidden`.
        let mut out_at = Vec::with_capacity(items.len());
        let mut at = 0;
        for &(_, tokens, first) in items {
            out_at.push(at);
            at += (tokens.len() - first) * h;
        }
        let mut host = vec![0f32; p.chunk * h];
        // The next item and how many of its tokens earlier chunks took.
        let (mut item, mut done) = (0, 0);
        while item < items.len() {
            // The chunk's runs of rows and the item each belongs to.
            let (mut rows, mut owners) = (Vec::new(), Vec::new());
            let mut ids: Vec<i32> = Vec::with_capacity(p.chunk);
            while item < items.len() && ids.len() < p.chunk {
                let (slot, tokens, _) = items[item];
                let n = (tokens.len() - done).min(p.chunk - ids.len());
                owners.push(item);
                rows.push(ChunkRows {
                    slot,
                    first: ids.len(),
                    n,
                    pos0: starts[item] + done,
                });
                ids.extend(tokens[done..done + n].iter().map(|&t| t as i32));
                done += n;
                if done == tokens.len() {
                    (item, done) = (item + 1, 0);
                }
            }
            let n = ids.len();
            self.prefill_chunk(p, &ids, &rows, &mut None)?;
            let x = p.b.x.sub(0, n * h)?;
            let y = dev.hidden.sub(0, n * h)?;
            k.rmsnorm_q8_1(
                x,
                n,
                h,
                Some(self.out_norm.slice()),
                Some(c.norm_eps),
                Some(y),
                None,
            )?;
            y.copy_to_host(&self.device, &mut host[..n * h])?;
            // Each sequence's rows from its `first` on to its place in `hidden`.
            for (r, &i) in rows.iter().zip(&owners) {
                let first = items[i].2;
                // Token index in the item of the run's first row.
                let t0 = r.pos0 - starts[i];
                for j in 0..r.n {
                    let t = t0 + j;
                    if t >= first {
                        let dst = out_at[i] + (t - first) * h;
                        hidden[dst..dst + h]
                            .copy_from_slice(&host[(r.first + j) * h..(r.first + j + 1) * h]);
                    }
                }
            }
        }
        for (&(slot, tokens, _), &start) in items.iter().zip(&starts) {
            self.slots[slot].len = start + tokens.len();
            self.slots[slot].record(start, tokens);
        }
        Ok(())
    }

    /// The logits of the chunk's rows `r0..r0 + rows` (after its last layer) into `out`,
    /// `[rows][vocab]`: final norm to f16, then the LM head a slice of the vocabulary at a
    /// time, each slice dequantised into the weight buffer and multiplied by cuBLAS into
    /// its columns of `out`.
    fn logits_rows(
        &self,
        p: &PrefillState,
        r0: usize,
        rows: usize,
        out: DevSlice<f32>,
        timer: &mut Option<Timer>,
    ) -> Result<()> {
        let c = &self.config;
        let k = &self.k;
        let (h, vocab) = (c.hidden_size, c.vocab_size);
        Timer::mark(timer, Part::Other)?;
        let xn = p.b.act.sub(0, rows * h)?;
        k.rmsnorm_rows_f16(
            p.b.x.sub(r0 * h, rows * h)?,
            rows,
            h,
            self.out_norm.slice(),
            c.norm_eps,
            xn,
        )?;
        let head = self.lm_head.as_ref().unwrap_or(&self.embd);
        // The weight buffer holds the largest layer matrix: at least `hidden` rows of the
        // head, and for a large model a good share of the vocabulary a slice.
        let slice = (p.b.wbuf.len() / h).min(vocab);
        for v0 in (0..vocab).step_by(slice) {
            let vs = slice.min(vocab - v0);
            let w = p.b.wbuf.sub(0, vs * h)?;
            Timer::mark(timer, Part::Dequant)?;
            k.dequant_rows_f16(head, v0, vs, w)?;
            Timer::mark(timer, Part::Gemm)?;
            let y = out.sub(v0, (rows - 1) * vocab + vs)?;
            let alpha = self.logit_scale.unwrap_or(1.0);
            p.blas
                .gemm_f16_f32(w, vs, xn, rows, h, y, vocab, alpha, 0.0)?;
        }
        Ok(())
    }

    /// One branch over the `n` tokens of a chunk at positions `pos0..pos0 + n`: the rows
    /// normed to f16, its operation, and its output added to the stream.
    #[allow(clippy::too_many_arguments)]
    /// A chunk of token ids through every layer: embedded into the residual stream (`x`),
    /// then each branch (`rows`: whose they are).
    fn prefill_chunk(
        &self,
        p: &PrefillState,
        ids: &[i32],
        rows: &[ChunkRows],
        timer: &mut Option<Timer>,
    ) -> Result<()> {
        let n = ids.len();
        let ids_dev = p.b.ids.sub(0, n)?;
        ids_dev.copy_from_host(&self.device, ids)?;
        Timer::mark(timer, Part::Other)?;
        let x = p.b.x.sub(0, n * self.config.hidden_size)?;
        self.k
            .embed_rows(&self.embd, ids_dev, self.embedding_scale, x)?;
        for b in &self.branches {
            self.prefill_branch(p, b, rows, n, timer)?;
        }
        Ok(())
    }

    /// One branch over the chunk's `n` rows (`rows`: whose they are).
    fn prefill_branch(
        &self,
        p: &PrefillState,
        b: &DeviceBranch,
        rows: &[ChunkRows],
        n: usize,
        timer: &mut Option<Timer>,
    ) -> Result<()> {
        let c = &self.config;
        let h = c.hidden_size;
        let x = p.b.x.sub(0, n * h)?;
        Timer::mark(timer, Part::Other)?;
        // The GEMMs read the rows normed to f16 in `act`.
        let normed = || {
            let xn = p.b.act.sub(0, n * h)?;
            self.k
                .rmsnorm_rows_f16(x, n, h, b.norm.slice(), c.norm_eps, xn)
        };
        match &b.op {
            DeviceOp::Attention(a) => {
                normed()?;
                self.prefill_attention(p, a, b, rows, n, timer)
            }
            DeviceOp::FeedForward(f) => {
                normed()?;
                self.prefill_feed_forward(p, f, b, n, timer)
            }
            // The expert GEMVs norm and quantise each row themselves.
            DeviceOp::Experts(e) => Ok(self.experts_rows(e, b, x, n, p.b.proj.sub(0, n * h)?)?),
        }
    }

    /// An attention over the chunk's normed rows (in `act`): QKV, then for each sequence's
    /// rows RoPE and the rows into its cache and causal attention over its cache, and O
    /// added to the stream.
    fn prefill_attention(
        &self,
        p: &PrefillState,
        l: &DeviceAttention,
        branch: &DeviceBranch,
        rows: &[ChunkRows],
        n: usize,
        timer: &mut Option<Timer>,
    ) -> Result<()> {
        let c = &self.config;
        let k = &self.k;
        let (h, qd, kvd, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
        let width = qd + 2 * kvd;
        let li = l.layer;
        let xn = p.b.act.sub(0, n * h)?;
        Timer::mark(timer, Part::Dequant)?;
        for proj in &l.qkv {
            k.dequant_f16(&proj.w, p.b.wbuf.sub(proj.offset * h, proj.w.rows * h)?)?;
        }
        Timer::mark(timer, Part::Gemm)?;
        let qkv = p.b.qkv.sub(0, n * width)?;
        p.blas.gemm_f16_f32(
            p.b.wbuf.sub(0, width * h)?,
            width,
            xn,
            n,
            h,
            qkv,
            width,
            1.0,
            0.0,
        )?;
        Timer::mark(timer, Part::Other)?;
        let rope = self.rope_args(l);
        let bias = l.qkv_bias.as_ref().map(|b| b.slice());
        // Rows a KV head has in the cache (a ring's, or the paged pool's), and positions a
        // sequence reaches in this layer.
        let cache_rows = self.kv.rows(li);
        let span = self.layer_context(li);
        let attn = p.b.act.sub(0, n * qd)?;
        for r in rows {
            let kv = self.kv.layer(li, r.slot)?;
            let qkv = qkv.sub(r.first * width, r.n * width)?;
            let q = p.b.q.sub(r.first * qd, r.n * qd)?;
            k.rope_kv_rows(&rope, qkv, bias, r.n, r.pos0, q, kv, cache_rows, l.window)?;
            // The attention reads f16: a q8_0 cache's rows so far are expanded first (the
            // same values the decode step reads, rounded to f16) into contiguous rows,
            // position p in row p (a ring's rows in their ring order).
            let (kc, vc, table, rows_a_head) = match kv.as_f16() {
                Some((kc, vc)) => (kc, vc, kv.table().map(|(t, _)| t), cache_rows),
                None => {
                    let (kf, vf) = (p.b.k_f16.sub(0, kvd * span)?, p.b.v_f16.sub(0, kvd * span)?);
                    let seen = (r.pos0 + r.n).min(span);
                    k.kv_q8_to_f16(kv, c.num_kv_heads, hd, span, seen, kf, vf)?;
                    (kf, vf, None, span)
                }
            };
            let args = PrefillAttnArgs {
                sinks: l.sinks.as_ref().map(|s| s.slice()),
                n_heads: c.num_heads,
                n_kv: c.num_kv_heads,
                head_dim: hd,
                max_ctx: rows_a_head,
                start: r.pos0,
                scale: l.scale,
                window: l.window,
            };
            let out = attn.sub(r.first * qd, r.n * qd)?;
            k.attention_prefill(&args, r.n, q, kc, vc, table, out)?;
        }
        Timer::mark(timer, Part::Dequant)?;
        k.dequant_f16(&l.o, p.b.wbuf.sub(0, h * qd)?)?;
        Timer::mark(timer, Part::Gemm)?;
        let bias = l.o_bias.as_ref().map(|b| b.slice());
        self.residual_gemm(p, branch, attn, n, qd, bias, timer)
    }

    /// A gated feed-forward over the chunk's normed rows (in `act`), added to the stream.
    fn prefill_feed_forward(
        &self,
        p: &PrefillState,
        f: &DeviceFeedForward,
        branch: &DeviceBranch,
        n: usize,
        timer: &mut Option<Timer>,
    ) -> Result<()> {
        let c = &self.config;
        let k = &self.k;
        let (h, ffn) = (c.hidden_size, c.ffn_size);
        let xn = p.b.act.sub(0, n * h)?;
        Timer::mark(timer, Part::Dequant)?;
        k.dequant_f16(&f.gate, p.b.wbuf.sub(0, ffn * h)?)?;
        k.dequant_f16(&f.up, p.b.wbuf.sub(ffn * h, ffn * h)?)?;
        Timer::mark(timer, Part::Gemm)?;
        let gu = p.b.gu.sub(0, n * 2 * ffn)?;
        p.blas.gemm_f16_f32(
            p.b.wbuf.sub(0, 2 * ffn * h)?,
            2 * ffn,
            xn,
            n,
            h,
            gu,
            2 * ffn,
            1.0,
            0.0,
        )?;
        Timer::mark(timer, Part::Other)?;
        let act = p.b.act.sub(0, n * ffn)?;
        k.swiglu_rows_f16(gu, n, ffn, act, f.gelu)?;
        Timer::mark(timer, Part::Dequant)?;
        k.dequant_f16(&f.down, p.b.wbuf.sub(0, h * ffn)?)?;
        Timer::mark(timer, Part::Gemm)?;
        self.residual_gemm(p, branch, act, n, ffn, None, timer)
    }

    /// x += W·a (+ bias) for the chunk's `n` rows as `branch` joins the stream (W the f16
    /// weight in the weight buffer, `k` values per row, one row per hidden unit): straight into the
    /// residual stream with β = 1 (and α the branch's scale), or, with a sandwich norm,
    /// into a scratch buffer that is normed and then added.
    #[allow(clippy::too_many_arguments)]
    fn residual_gemm(
        &self,
        p: &PrefillState,
        branch: &DeviceBranch,
        a: DevSlice<u16>,
        n: usize,
        k: usize,
        bias: Option<DevSlice<f32>>,
        timer: &mut Option<Timer>,
    ) -> Result<()> {
        let h = self.config.hidden_size;
        let x = p.b.x.sub(0, n * h)?;
        let w = p.b.wbuf.sub(0, h * k)?;
        match &branch.post_norm {
            None => {
                let alpha = branch.scale.unwrap_or(1.0);
                p.blas.gemm_f16_f32(w, h, a, n, k, x, h, alpha, 1.0)?;
                if let Some(b) = bias {
                    self.k.add_bias_rows(x, n, h, b, alpha)?;
                }
            }
            Some(post) => {
                let y = p.b.proj.sub(0, n * h)?;
                p.blas.gemm_f16_f32(w, h, a, n, k, y, h, 1.0, 0.0)?;
                if let Some(b) = bias {
                    self.k.add_bias_rows(y, n, h, b, 1.0)?;
                }
                Timer::mark(timer, Part::Other)?;
                self.k
                    .add_rmsnorm_rows(y, n, h, post.slice(), self.config.norm_eps, x)?;
            }
        }
        Ok(())
    }
}
