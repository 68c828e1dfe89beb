//! The batched decode step: up to 64 sequences, each at its own position in its own cache
//! slot, through the model in one step whose matmuls read every weight once for all of
//! them (int8 tensor cores, `kernels/cuda/bmm.cu`).
//!
//! Per layer: RMSNorm + pack → QKV matmul (+ bias) → RoPE with each row's K/V written to
//! its slot → attention of each row over its own slot → pack → O matmul (+ residual) →
//! RMSNorm + pack → gate/up matmul with SwiGLU → pack → down matmul (+ residual). Then the
//! output norm, the LM head for every row, and the tokens drawn on the device (per-row
//! greedy or sampling settings); only token ids come back.
//!
//! One graph is captured per batch-size bucket (2, 4, 8, 16, 32, 64) and attention grid
//! (as wide as the batch's longest context needs; see `StepShape`): a batch runs in the
//! smallest bucket that holds it, its extra rows padding (position −1: they write no cache;
//! context 0: their attention is zero). The matmuls take rows in eights. Per step the host
//! uploads one small array (token, position, context length and slot of each row); a batch
//! of one takes the one-sequence graph, which it was already.
//!
//! The same step prefills short prompts (up to [`SHORT_PREFILL`] tokens): the prompt's
//! tokens are its rows, all in one slot at consecutive positions. Every row's K/V is
//! written before any row attends, so row i sees rows 0..=i — causal attention inside the
//! prompt — and the weights are read once, in their quantised form, where the cuBLAS
//! prefill would dequantise every matrix to f16 first (on llama3-8b: 4.6 GB read against
//! 16 GB written and read again).

use kiln_core::{DecodeItem, Error, Result, Sampler};
use kiln_kernels::{
    AttnHeads, BatchAttention, BatchEpilogue, BatchRows, DevSlice, Graph, Kernels, PackedAct,
    WeightFormat, Workspace,
};

use super::{err, DeviceBranch, DeviceOp, GpuExecutor, StepShape};

/// Batch-size buckets, one graph each per attention grid.
const BUCKETS: [usize; 6] = [2, 4, 8, 16, 32, 64];

/// Least positions a split block of the batched step's attention takes. One sequence
/// splits short contexts finely (64 positions, 16 blocks a head up to 4,096) because its
/// heads alone leave most SMs idle; a batch's rows × heads fill the GPU already, and a
/// 64-position split leaves two of a block's four warps (32 positions each) idle.
const BATCH_ATTENTION_SPLIT: usize = 128;

/// Prompts up to this many tokens prefill through the batched step (one step, the
/// prompt's tokens its rows) unless [`GpuExecutor::set_variants`] says otherwise.
/// Longer ones take the cuBLAS prefill, whose GEMMs win once the dequantisation is shared
/// by enough tokens (crossover measured with `decode_bench --short-prefill`,
/// docs/benchmarks.md).
pub const SHORT_PREFILL: usize = 32;

/// Logit-bias entries a row may bring to the device sampler; a row with more is drawn on
/// the host (the server accepts at most 1,024, as the device does).
const DEVICE_LOGIT_BIAS_PER_ROW: usize = 1024;

/// The batched step's activations for up to `rows` rows, carved from one workspace.
#[derive(Clone, Copy)]
struct BatchBuffers {
    /// [token; rows] [position; rows] [context length; rows] [slot; rows], uploaded per step.
    meta: DevSlice<i32>,
    /// Per row (temperature, top_p, min_p, top_k) and the uniform draw.
    params: DevSlice<[f32; 4]>,
    uniform: DevSlice<f32>,
    /// The rows' logit biases: flat logit indices and the values added there.
    bias_index: DevSlice<i32>,
    bias: DevSlice<f32>,
    /// The residual stream, [rows][hidden].
    x: DevSlice<f32>,
    act: PackedAct,
    qkv: DevSlice<f32>,
    q: DevSlice<f32>,
    attn: DevSlice<f32>,
    ffn: DevSlice<f32>,
    /// A block's output before its sandwich norm (Gemma), [rows][hidden].
    proj: DevSlice<f32>,
    logits: DevSlice<f32>,
    part: DevSlice<f32>,
    part_o: DevSlice<f32>,
    part_ml: DevSlice<[f32; 2]>,
    counters: DevSlice<u32>,
    keys: DevSlice<u64>,
    cand: DevSlice<u64>,
    tokens: DevSlice<i32>,
}

pub(super) struct BatchState {
    /// Rows the buffers hold (≥ 8, ≥ the largest bucket used).
    rows: usize,
    b: BatchBuffers,
    /// Each bucket's graph per attention grid ([`StepShape::index`]),
    /// captured when first needed.
    graphs: [[Option<Graph>; StepShape::COUNT]; BUCKETS.len()],
    /// The shape each bucket's last step ran with.
    last_shape: [usize; BUCKETS.len()],
    // Owns the memory `b` points into.
    _ws: Workspace,
}

impl BatchState {
    /// The batched step's buffers for `exec`, or why there is no batched step (a weight
    /// format without a batched matmul; no batched prefill kernels, whose embedding
    /// lookup the step uses).
    pub(super) fn new(
        exec: &GpuExecutor,
        formats: &[&'static WeightFormat],
        nsplit: usize,
    ) -> Result<std::result::Result<BatchState, String>> {
        let slots = exec.slots.capacity();
        if let Some(f) = formats.iter().find(|f| f.batched.is_none()) {
            return Ok(Err(format!("no batched matmul for {} weights", f.tag)));
        }
        if let Err(why) = &exec.prefill {
            return Ok(Err(format!("no batched embedding lookup: {why}")));
        }
        let c = &exec.config;
        // Loaded with the model's other modules already (one parallel compile); this only
        // makes sure, as a graph capture cannot load them.
        let matmuls: Vec<_> = formats.iter().filter_map(|f| f.batched).collect();
        exec.k.preload_modules(&matmuls).map_err(err)?;
        // The batched attention on tensor cores (`BatchAttention::Auto`, from 8 rows) rounds
        // queries and attention weights to f16: ~2e-4 of a row's largest output. It is taken
        // only where the batched matmuls round to f16 already (every layer weight on the f16
        // walk); a model with other weights (Q4_0, Q8_0, ...) keeps its int8 matmuls'
        // precision with the f32 head-a-block kernels. With the group kernel, a Q4_0 1B's
        // batch of 64 flipped a greedy pick at a top-2 gap of 1.3e-3 against one sequence at
        // a time (H200, 2026-12-04), over issue 10's 1e-3 near-tie bar; the same batch on
        // the head kernels stays under it.
        let f16_matmuls = exec.branches.iter().all(|b| match &b.op {
            DeviceOp::Attention(a) => {
                a.qkv.iter().all(|p| exec.k.bmm_rounds_to_f16(&p.w, false))
                    && exec.k.bmm_rounds_to_f16(&a.o, false)
            }
            DeviceOp::FeedForward(f) => {
                exec.k.bmm_rounds_to_f16(&f.down, false)
                    && [&f.gate, &f.up]
                        .iter()
                        .all(|w| exec.k.bmm_rounds_to_f16(w, true))
            }
            // No batched step for experts (refused above, with the prefill).
            DeviceOp::Experts(_) => false,
        });
        if !f16_matmuls {
            exec.k.set_batch_attention(BatchAttention::Heads);
        }
        // Buffers for the largest bucket the slots can fill or a short prompt needs, and at
        // least the eight rows a matmul takes.
        let rows = BUCKETS[bucket_of(slots.clamp(SHORT_PREFILL, Kernels::MAX_BATCH))].max(8);
        let (h, qd, kvd, ffn, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.ffn_size, c.head_dim);
        let vocab = c.vocab_size;
        let widest = h.max(qd).max(ffn);
        let head = exec.lm_head.as_ref().unwrap_or(&exec.embd);
        let k = &exec.k;
        // The partial sums of the widest split over every matmul and bucket (narrower
        // batches split the row length more).
        let mut part = 0;
        for bucket in BUCKETS
            .iter()
            .map(|&b| Kernels::bmm_rows(b))
            .filter(|&b| b <= rows)
        {
            part = part.max(k.bmm_part_len(head, bucket, false));
            for b in &exec.branches {
                part = match &b.op {
                    DeviceOp::Attention(a) => a
                        .qkv
                        .iter()
                        .map(|p| k.bmm_part_len(&p.w, bucket, false))
                        .fold(part, usize::max)
                        .max(k.bmm_part_len(&a.o, bucket, false)),
                    DeviceOp::FeedForward(f) => part
                        .max(k.bmm_part_len(&f.gate, bucket, true))
                        .max(k.bmm_part_len(&f.down, bucket, false)),
                    DeviceOp::Experts(_) => part,
                };
            }
        }
        let (act_x, act_s) = PackedAct::lens(rows, widest);
        let (ws, b) = Workspace::carve(&exec.device, |a| BatchBuffers {
            meta: a.take(4 * rows),
            params: a.take(rows),
            uniform: a.take(rows),
            bias_index: a.take(rows * DEVICE_LOGIT_BIAS_PER_ROW),
            bias: a.take(rows * DEVICE_LOGIT_BIAS_PER_ROW),
            x: a.take(rows * h),
            act: PackedAct {
                x: a.take(act_x),
                s: a.take(act_s),
                h: a.take(act_x),
            },
            qkv: a.take(rows * (qd + 2 * kvd)),
            q: a.take(rows * qd),
            attn: a.take(rows * qd),
            ffn: a.take(rows * ffn),
            proj: a.take(rows * h),
            logits: a.take(rows * vocab),
            part: a.take(part),
            part_o: a.take(rows * c.num_heads * nsplit * hd),
            part_ml: a.take(rows * c.num_heads * nsplit),
            counters: a.take(rows * c.num_heads),
            keys: a.take(rows * Kernels::argmax_scratch(vocab)),
            cand: a.take(rows * Kernels::sample_rows_scratch(vocab)),
            tokens: a.take(rows),
        })
        .map_err(err)?;
        // Poisoned like the decode workspace; the attention counters start at zero.
        ws.fill_bytes(0xff).map_err(err)?;
        b.counters.fill_bytes_async(&exec.device, 0).map_err(err)?;
        Ok(Ok(BatchState {
            rows,
            b,
            graphs: Default::default(),
            last_shape: [0; BUCKETS.len()],
            _ws: ws,
        }))
    }

    pub(super) fn drop_graphs(&mut self) {
        self.graphs = Default::default();
    }
}

/// One row of a batched step: `token` at position `pos` of cache slot `slot`.
struct StepRow {
    token: u32,
    pos: usize,
    slot: usize,
}

/// The bucket a batch of `n` rows runs in (a batch of one runs in the smallest).
fn bucket_of(n: usize) -> usize {
    BUCKETS
        .iter()
        .position(|&b| b >= n)
        .expect("batches are split at 64 rows")
}

/// How a decode_sample row draws its token.
enum Draw {
    /// On the device: (temperature, top_p, min_p, top_k; 1 is greedy) and the uniform.
    Device([f32; 4], f32),
    /// On the host from the row's logits (settings the device sampler lacks).
    Host,
}

impl GpuExecutor {
    /// Why batches decode one sequence at a time, if they do.
    pub fn batched_decode_unavailable(&self) -> Option<&str> {
        if self.sequential_decode {
            return Some("sequential decode was asked for (LoadOptions::sequential_decode)");
        }
        self.batch.as_ref().err().map(|s| s.as_str())
    }

    /// The shape of a batched step of `rows` rows (its bucket) whose longest row reaches
    /// context `len`. From 16 rows its attention takes the heads of a GQA group in pairs,
    /// each K/V row read once for two queries: there the grid holds rows × heads × splits
    /// blocks and the K/V reads are what it costs. Below, as for one sequence, a second
    /// head only lengthens each block's chain. Measured on the H200 (docs/log/2026-11-to-12.md,
    /// "Batched decode at 64 rows"): 1B +2.3 / +1.6 / +3.3% at 16 / 32 / 64 rows, −2.9% at 4.
    fn batch_shape(&self, rows: usize, len: usize) -> StepShape {
        let split = self.split.max(BATCH_ATTENTION_SPLIT);
        StepShape {
            split,
            splits: self.attention_grid(len, split),
            heads: match rows >= 16 && self.config.gqa_ratio() >= 2 {
                true => AttnHeads::Pairs,
                false => AttnHeads::One,
            },
        }
    }

    /// Whether a batch of `n` sequences decodes in batched steps.
    pub(super) fn decodes_batched(&self, n: usize) -> bool {
        n > 1 && !self.sequential_decode && self.batch.is_ok()
    }

    /// Whether a prompt of `n` tokens prefills through the batched step.
    pub(super) fn prefills_short(&self, n: usize) -> bool {
        // 0 without a batched step (see `GpuExecutor::set_variants`).
        n <= self.short_prefill_max
    }

    /// Prompt rows the batched step's buffers hold (0 without a batched step): the most
    /// `StepVariants::short_prefill_max` can be.
    pub(super) fn short_prefill_capacity(&self) -> usize {
        self.batch.as_ref().map_or(0, |b| b.rows)
    }

    /// Rows one batched step takes at most (the rest of a larger batch goes in further
    /// steps).
    fn batch_rows(&self) -> usize {
        self.batch.as_ref().map_or(1, |b| {
            b.rows.min(self.slots.capacity()).min(Kernels::MAX_BATCH)
        })
    }

    /// Queues the batched step for the `rows` rows of bucket `rows`, its attention in
    /// `shape`'s grid (see the module doc).
    fn queue_batch_step(&self, rows: usize, shape: StepShape) -> kiln_kernels::Result<()> {
        let st = self.batch.as_ref().expect("batched decode is available");
        let b = &st.b;
        let c = &self.config;
        let k = &self.k;
        let (h, qd, kvd, ffn) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.ffn_size);
        let width = qd + 2 * kvd;
        let bm = Kernels::bmm_rows(rows);
        let n = st.rows;
        let meta = |i: usize, len: usize| b.meta.sub(i * n, len);
        let br = BatchRows {
            rows,
            pos: meta(1, rows)?,
            len: meta(2, rows)?,
            slot: meta(3, rows)?,
        };
        let x = b.x.sub(0, bm * h)?;
        // x += W·a, or x += norm(W·a) with a sandwich norm (Gemma); then x normalised with
        // `next` (the next matmul's norm) and packed for it. That pack stays a launch of its
        // own: packing in the launch that sums the splits needs the whole row's norm first,
        // and the last block of each row packing it measured slower than act_pack
        // (docs/log/2026-11-to-12.md, "Fewer launches between the batched matmuls").
        let add_to_stream = |w: &kiln_kernels::DeviceWeight,
                             bias: Option<&kiln_kernels::DeviceBuffer<f32>>,
                             branch: &DeviceBranch,
                             next: &kiln_kernels::DeviceBuffer<f32>| {
            let bias = bias.map(|b| b.slice());
            match &branch.post_norm {
                None => {
                    let residual = BatchEpilogue {
                        bias,
                        residual: Some(x),
                        scale: branch.scale,
                        ..Default::default()
                    };
                    k.batched_matmul(w, None, &b.act, bm, b.part, x, h, &residual)?;
                }
                Some(post) => {
                    let y = b.proj.sub(0, bm * h)?;
                    let biased = BatchEpilogue {
                        bias,
                        ..Default::default()
                    };
                    k.batched_matmul(w, None, &b.act, bm, b.part, y, h, &biased)?;
                    k.add_rmsnorm_rows(y, bm, h, post.slice(), c.norm_eps, x)?;
                }
            }
            k.act_pack(x, bm, h, Some(next.slice()), Some(c.norm_eps), b.act)
        };
        k.embed_rows(&self.embd, meta(0, bm)?, self.embedding_scale, x)?;
        // The first matmul's input; every later one is packed after the launch before it
        // (or by it: the attention's output and the gated product).
        k.act_pack(
            x,
            bm,
            h,
            Some(self.branches[0].norm.slice()),
            Some(c.norm_eps),
            b.act,
        )?;
        for (bi, branch) in self.branches.iter().enumerate() {
            let next = self.norm_after(bi);
            match &branch.op {
                DeviceOp::Attention(a) => {
                    for p in &a.qkv {
                        let epi = BatchEpilogue {
                            bias: match &a.qkv_bias {
                                Some(bias) => Some(bias.slice().sub(p.offset, p.w.rows)?),
                                None => None,
                            },
                            ..Default::default()
                        };
                        let y = b.qkv.sub(p.offset, (bm - 1) * width + p.w.rows)?;
                        k.batched_matmul(&p.w, None, &b.act, bm, b.part, y, width, &epi)?;
                    }
                    let li = a.layer;
                    let kv = self.kv.layer_all(li)?;
                    let stride = self.kv.slot_stride(li);
                    let rope = self.rope_args(a);
                    k.rope_kv_batch(&rope, b.qkv, b.q, kv, stride, &br, self.kv.rows(li))?;
                    let attn = self.attn_args(a, shape);
                    let q = b.q.sub(0, rows * qd)?;
                    let out = b.attn.sub(0, rows * qd)?;
                    // The output packed for the O matmul by the attention's merge.
                    k.attention_batch(
                        &attn,
                        q,
                        kv,
                        stride,
                        &br,
                        b.part_o,
                        b.part_ml,
                        b.counters,
                        out,
                        Some(b.act),
                    )?;
                    add_to_stream(&a.o, a.o_bias.as_ref(), branch, next)?;
                }
                DeviceOp::FeedForward(f) => {
                    let y = b.ffn.sub(0, bm * ffn)?;
                    // The gated product packed for the down matmul by the launch that sums it.
                    let gated = BatchEpilogue {
                        gelu: f.gelu,
                        pack: Some(b.act),
                        ..Default::default()
                    };
                    k.batched_matmul(&f.gate, Some(&f.up), &b.act, bm, b.part, y, ffn, &gated)?;
                    add_to_stream(&f.down, None, branch, next)?;
                }
                DeviceOp::Experts(e) => {
                    self.experts_rows(e, branch, x, rows, b.proj.sub(0, rows * h)?)?;
                    k.act_pack(x, bm, h, Some(next.slice()), Some(c.norm_eps), b.act)?;
                }
            }
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embd);
        let vocab = c.vocab_size;
        let logits = b.logits.sub(0, bm * vocab)?;
        let head_epilogue = BatchEpilogue {
            scale: self.logit_scale,
            ..Default::default()
        };
        k.batched_matmul(
            head,
            None,
            &b.act,
            bm,
            b.part,
            logits,
            vocab,
            &head_epilogue,
        )
    }

    /// Runs one batched step for `items` (already checked: ≤ `batch_rows`, distinct live
    /// sequences with room for one more token), leaving row i's logits in row i of the
    /// batch logits. Returns the bucket's row count.
    fn batch_step(&mut self, items: &[DecodeItem]) -> Result<usize> {
        let rows = items
            .iter()
            .map(|it| {
                let slot = self.slot_of(it.seq)?;
                Ok(StepRow {
                    token: it.token,
                    pos: self.slots[slot].len,
                    slot,
                })
            })
            .collect::<Result<Vec<_>>>()?;
        let bucket_rows = self.launch_rows(&rows)?;
        for r in rows {
            self.slots[r.slot].len = r.pos + 1;
            self.slots[r.slot].record(r.pos, &[r.token]);
        }
        Ok(bucket_rows)
    }

    /// Runs the batched step on `rows` (at most the buffers' rows): uploads their [token;
    /// position; context length; slot] array, padding rows masked up to the bucket, and
    /// replays the bucket's graph (capturing it first if it has not been). Returns the
    /// bucket's row count.
    fn launch_rows(&mut self, rows: &[StepRow]) -> Result<usize> {
        let st = self
            .batch
            .as_ref()
            .map_err(|why| Error::Unsupported(why.clone()))?;
        let n = st.rows;
        let bucket = bucket_of(rows.len());
        let mut meta = vec![0i32; 4 * n];
        for (i, r) in rows.iter().enumerate() {
            meta[i] = r.token as i32;
            meta[n + i] = r.pos as i32;
            meta[2 * n + i] = r.pos as i32 + 1;
            meta[3 * n + i] = r.slot as i32;
        }
        for i in rows.len()..BUCKETS[bucket] {
            meta[n + i] = -1;
            meta[2 * n + i] = 0;
        }
        let longest = rows.iter().map(|r| r.pos + 1).max().unwrap_or(1);
        let rows = BUCKETS[bucket];
        let shape = self.batch_shape(rows, longest);
        st.b.meta.copy_from_host(&self.device, &meta).map_err(err)?;
        if st.graphs[bucket][shape.index()].is_none() {
            let graph = self
                .device
                .capture(|| self.queue_batch_step(rows, shape))
                .map_err(err)?;
            self.batch.as_mut().expect("checked above").graphs[bucket][shape.index()] = Some(graph);
        }
        let st = self.batch.as_mut().expect("checked above");
        st.last_shape[bucket] = shape.index();
        st.graphs[bucket][shape.index()]
            .as_ref()
            .expect("captured above")
            .launch()
            .map_err(err)?;
        Ok(rows)
    }

    /// Prefills `slot` with `tokens` (1..=the buffers' rows, already checked to fit) in one
    /// batched step, the tokens its rows at the slot's next positions (see the module
    /// doc). Returns where the last token's logits are.
    pub(super) fn prefill_short(&mut self, slot: usize, tokens: &[u32]) -> Result<DevSlice<f32>> {
        let n = tokens.len();
        let st = self
            .batch
            .as_ref()
            .map_err(|why| Error::Unsupported(why.clone()))?;
        let cap = st.rows;
        if n == 0 || n > cap {
            return Err(Error::InvalidArgument(format!(
                "a short prefill takes 1 to {cap} tokens, not {n}"
            )));
        }
        let start = self.slots[slot].len;
        self.reserve(slot, start + n)?;
        let rows: Vec<StepRow> = tokens
            .iter()
            .enumerate()
            .map(|(i, &token)| StepRow {
                token,
                pos: start + i,
                slot,
            })
            .collect();
        self.launch_rows(&rows)?;
        self.slots[slot].len = start + n;
        self.slots[slot].record(start, tokens);
        let vocab = self.config.vocab_size;
        let st = self.batch.as_ref().expect("launched above");
        st.b.logits.sub((n - 1) * vocab, vocab).map_err(err)
    }

    /// `decode` for a batch of two or more: steps of up to `batch_rows` sequences.
    pub(super) fn decode_batched(
        &mut self,
        batch: &[DecodeItem],
        logits: &mut [f32],
    ) -> Result<()> {
        let vocab = self.config.vocab_size;
        let per = self.batch_rows();
        for (items, out) in batch.chunks(per).zip(logits.chunks_mut(per * vocab)) {
            self.batch_step(items)?;
            let st = self.batch.as_ref().expect("batch_step succeeded");
            st.b.logits
                .sub(0, items.len() * vocab)
                .and_then(|l| l.copy_to_host(&self.device, out))
                .map_err(err)?;
        }
        Ok(())
    }

    /// Captures the graph of every bucket the batch buffers hold (at load: a capture on a
    /// request's path would cost it milliseconds). Nothing without a batched step.
    pub(super) fn capture_batch_graphs(&mut self) -> Result<()> {
        let Ok(st) = &self.batch else { return Ok(()) };
        let most = st.rows;
        // Short prompts' and the first decode steps' shape (contexts up to the split
        // length); longer contexts capture theirs when first reached.
        for (bucket, &rows) in BUCKETS.iter().enumerate() {
            if rows > most {
                break;
            }
            let shape = self.batch_shape(rows, 1);
            let graph = self
                .device
                .capture(|| self.queue_batch_step(rows, shape))
                .map_err(err)?;
            self.batch.as_mut().expect("checked above").graphs[bucket][shape.index()] = Some(graph);
        }
        Ok(())
    }

    /// `decode_sample` for a batch of two or more: each step's tokens drawn on the device
    /// (rows whose settings the device sampler lacks are drawn on the host from their
    /// logits), the same draws from each sampler's generator as one at a time.
    pub(super) fn decode_sample_batched(
        &mut self,
        batch: &[DecodeItem],
        samplers: &mut [Sampler],
        tokens: &mut [u32],
    ) -> Result<()> {
        let vocab = self.config.vocab_size;
        let per = self.batch_rows();
        let mut out = vec![0i32; per];
        let mut row = Vec::new();
        for ((items, samplers), tokens) in batch
            .chunks(per)
            .zip(samplers.chunks_mut(per))
            .zip(tokens.chunks_mut(per))
        {
            let rows = self.batch_step(items)?;
            let draws: Vec<Draw> = samplers
                .iter_mut()
                .map(|s| {
                    let p = &s.params;
                    if p.logit_bias.len() > DEVICE_LOGIT_BIAS_PER_ROW {
                        Draw::Host
                    } else if p.is_greedy() && p.repeat_penalty == 1.0 {
                        Draw::Device([1.0, 1.0, 0.0, 1.0], 0.0)
                    } else if Kernels::can_sample(vocab, p)
                        && Kernels::sample_rows_scratch(vocab) <= 4096
                    {
                        Draw::Device(
                            [p.temperature, p.top_p, p.min_p, p.top_k as f32],
                            s.rng.next_f32(),
                        )
                    } else {
                        Draw::Host
                    }
                })
                .collect();
            let st = self.batch.as_ref().expect("batch_step succeeded");
            let b = st.b;
            let n = items.len();
            // The device rows' logit biases, added to their logits before any draw (host
            // rows get theirs from their sampler).
            let mut bias_index = Vec::new();
            let mut bias = Vec::new();
            for (i, (d, s)) in draws.iter().zip(samplers.iter()).enumerate() {
                if let Draw::Device(..) = d {
                    for &(t, v) in s
                        .params
                        .logit_bias
                        .iter()
                        .filter(|(t, _)| (*t as usize) < vocab)
                    {
                        bias_index.push((i * vocab + t as usize) as i32);
                        bias.push(v);
                    }
                }
            }
            if !bias.is_empty() {
                let m = bias.len();
                b.bias_index
                    .sub(0, m)?
                    .copy_from_host(&self.device, &bias_index)
                    .map_err(err)?;
                b.bias
                    .sub(0, m)?
                    .copy_from_host(&self.device, &bias)
                    .map_err(err)?;
                self.k
                    .add_logit_bias(b.logits.sub(0, n * vocab)?, b.bias_index, b.bias, m)
                    .map_err(err)?;
            }
            let all_greedy = draws
                .iter()
                .all(|d| matches!(d, Draw::Device(p, _) if p[3] == 1.0));
            if all_greedy {
                // Greedy rows only: the argmax kernels (no sort), lowest index on ties.
                self.k
                    .argmax_rows(b.logits.sub(0, n * vocab)?, n, vocab, b.keys, b.tokens)
                    .map_err(err)?;
            } else if draws.iter().any(|d| matches!(d, Draw::Device(..))) {
                let mut params = vec![[1.0, 1.0, 0.0, 1.0]; rows];
                let mut uniform = vec![0.0f32; rows];
                for (i, d) in draws.iter().enumerate() {
                    if let Draw::Device(p, u) = d {
                        params[i] = *p;
                        uniform[i] = *u;
                    }
                }
                b.params
                    .sub(0, n)?
                    .copy_from_host(&self.device, &params[..n])
                    .map_err(err)?;
                b.uniform
                    .sub(0, n)?
                    .copy_from_host(&self.device, &uniform[..n])
                    .map_err(err)?;
                self.k
                    .sample_rows(
                        b.logits.sub(0, n * vocab)?,
                        n,
                        vocab,
                        b.params.sub(0, n)?,
                        b.uniform.sub(0, n)?,
                        b.cand,
                        b.tokens,
                    )
                    .map_err(err)?;
            }
            if draws.iter().any(|d| matches!(d, Draw::Device(..))) {
                b.tokens
                    .sub(0, n)?
                    .copy_to_host(&self.device, &mut out[..n])
                    .map_err(err)?;
            }
            for (i, ((d, s), t)) in draws
                .iter()
                .zip(samplers.iter_mut())
                .zip(tokens.iter_mut())
                .enumerate()
            {
                match d {
                    Draw::Device(..) => {
                        *t = out[i] as u32;
                        s.accept(*t);
                    }
                    Draw::Host => {
                        row.resize(vocab, 0.0);
                        b.logits
                            .sub(i * vocab, vocab)
                            .and_then(|l| l.copy_to_host(&self.device, &mut row))
                            .map_err(err)?;
                        *t = s.sample(&mut row);
                    }
                }
            }
        }
        Ok(())
    }

    /// Device time of one batched step of `rows` sequences (its bucket's graph replayed
    /// `replays` times after the batch's last step; median milliseconds): the step without
    /// the host's round trip. The bucket must have run once.
    pub fn batch_step_device_ms(&mut self, rows: usize, replays: usize) -> Result<f64> {
        let st = self
            .batch
            .as_ref()
            .map_err(|why| Error::Unsupported(why.clone()))?;
        let bucket = bucket_of(rows.clamp(2, Kernels::MAX_BATCH));
        let graph = st.graphs[bucket][st.last_shape[bucket]]
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument(format!("no batch of {rows} has decoded yet")))?;
        super::median_replay_ms(&self.device, graph, replays)
    }

    /// Bytes of KV cache one token takes, and the cache's total bytes.
    pub fn kv_bytes(&self) -> (usize, usize) {
        (self.kv.bytes_per_token(), self.kv.bytes())
    }
}
