//! The loaded model: weights as views of the file, per-sequence KV caches (f32 by default;
//! f16 or Q8_0 rows with `LoadOptions::kv_type`), and the forward pass shared by prefill
//! (one sequence, many positions) and batched decode (many sequences, one position each).

use std::borrow::Cow;

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use kiln_core::{
    check_decode, check_prefill, Activation, DecodeItem, Error, KvType, LayerExecutor, LoadOptions,
    ModelConfig, ModelIr, NormKind, Result, SeqId, SeqSlot, SequenceSlots, TensorView,
};
use rayon::prelude::*;
use rayon::ThreadPool;

use crate::dequant::{block_fn, dequantize_into};
use crate::kernels::{self, block_sums, Isa, Simd};
use crate::matmul::{matmul, Batch, MatJob, QMatrix, MAX_BATCH};
use crate::ops;

struct Layer {
    attn_norm: Vec<f32>,
    attn_norm_bias: Option<Vec<f32>>,
    q: QMatrix,
    k: QMatrix,
    v: QMatrix,
    q_bias: Option<Vec<f32>>,
    k_bias: Option<Vec<f32>>,
    v_bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    out: QMatrix,
    out_bias: Option<Vec<f32>>,
    ffn_norm: Option<Vec<f32>>,
    ffn_norm_bias: Option<Vec<f32>>,
    gate: Option<QMatrix>,
    up: QMatrix,
    down: QMatrix,
    /// RMSNorm of the attention and MLP outputs before the residual (Gemma).
    post_attn_norm: Option<Vec<f32>>,
    post_ffn_norm: Option<Vec<f32>>,
}

/// Immutable part of the executor: everything a forward pass reads.
struct Model {
    config: ModelConfig,
    layers: Vec<Layer>,
    embd: QMatrix,
    out_norm: Vec<f32>,
    out_norm_bias: Option<Vec<f32>>,
    lm_head: QMatrix,
    kv: KvLayout,
    /// Inverse frequency of each rotary pair.
    inv_freq: Vec<f32>,
    /// The windowed layers' (their own RoPE base), when the model has a sliding window.
    local_inv_freq: Option<Vec<f32>>,
    max_ctx: usize,
    threads: usize,
    simd: Option<Simd>,
}

/// One sequence slot: its KV cache (see [`KvLayout`]) and its tokens (a truncation of a
/// model with windowed layers may have to recompute from them).
struct Slot {
    k: KvRows,
    v: KvRows,
    tokens: Vec<u32>,
}

/// A slot's keys (or values), every layer's rows one after another ([`KvLayout`]): f32, the
/// reference, read in place; or f16 / Q8_0 rows (ggml's rounding, as the GPUs' f16 cache
/// rounds) encoded as they are written and read back one head at a time, decoded into a
/// buffer of the reader's own.
enum KvRows {
    F32(Vec<f32>),
    /// f16 bits (a `u16` vector, so a zeroed one is mapped lazily as the others are).
    F16(Vec<u16>),
    /// ggml Q8_0 blocks: value `e` lies in the block at byte [`q8_0_byte`]`(e)`.
    Q8_0(Vec<u8>),
}

/// Where the Q8_0 block of value `e` (a multiple of 32) starts: 34 bytes per 32 values.
fn q8_0_byte(e: usize) -> usize {
    e / 32 * 34
}

/// One KV head's rows for a run of positions: value `i` of row `r` at
/// `data[r * stride + offset + i]`.
struct HeadRows<'a> {
    data: Cow<'a, [f32]>,
    stride: usize,
    offset: usize,
}

impl KvRows {
    /// `elements` zeroed values (mapped by the OS only as positions are reached).
    fn new(kind: KvType, elements: usize) -> KvRows {
        match kind {
            KvType::F32 => KvRows::F32(vec![0.0; elements]),
            KvType::F16 => KvRows::F16(vec![0; elements]),
            KvType::Q8_0 => KvRows::Q8_0(vec![0; q8_0_byte(elements)]),
        }
    }

    /// Stores `values` from element `at` (for Q8_0, both multiples of 32).
    fn write(&mut self, at: usize, values: &[f32]) {
        match self {
            KvRows::F32(v) => v[at..at + values.len()].copy_from_slice(values),
            KvRows::F16(v) => v[at..at + values.len()]
                .reinterpret_cast_mut::<half::f16>()
                .convert_from_f32_slice(values),
            KvRows::Q8_0(b) => {
                let blocks = &mut b[q8_0_byte(at)..q8_0_byte(at + values.len())];
                kiln_core::quant::quantize(kiln_core::QType::Q8_0, values, blocks)
                    .expect("whole blocks (checked at load)");
            }
        }
    }

    /// Values `offset..offset + hd` of `rows` rows of `stride` values from element `at`.
    fn head_rows(
        &self,
        at: usize,
        rows: usize,
        stride: usize,
        offset: usize,
        hd: usize,
    ) -> HeadRows<'_> {
        let decoded = |decode: &dyn Fn(usize, &mut [f32])| {
            let mut out = vec![0.0f32; rows * hd];
            for (r, o) in out.chunks_exact_mut(hd.max(1)).enumerate() {
                decode(at + r * stride + offset, o);
            }
            HeadRows {
                data: Cow::Owned(out),
                stride: hd,
                offset: 0,
            }
        };
        match self {
            KvRows::F32(v) => HeadRows {
                data: Cow::Borrowed(&v[at..at + rows * stride]),
                stride,
                offset,
            },
            KvRows::F16(v) => decoded(&|first, o| {
                v[first..first + o.len()]
                    .reinterpret_cast::<half::f16>()
                    .convert_to_f32_slice(o)
            }),
            KvRows::Q8_0(b) => decoded(&|first, o| {
                let blocks = &b[q8_0_byte(first)..q8_0_byte(first + o.len())];
                kiln_core::quant::dequantize(kiln_core::QType::Q8_0, blocks, o)
                    .expect("whole blocks (checked at load)")
            }),
        }
    }
}

/// Where a layer's key and value rows for a position lie in a slot's cache: a layer that
/// attends to the whole context keeps every position; a windowed layer (Gemma 3's local
/// ones) keeps a ring of `window + MAX_BATCH - 1` rows — one forward pass writes at most
/// MAX_BATCH positions of a sequence, so it never overwrites a position one of its own
/// tokens still attends to.
struct KvLayout {
    /// Rows each layer keeps, and where its rows start (in values).
    rows: Vec<usize>,
    base: Vec<usize>,
    /// Values of one slot's keys (and as many of its values).
    elements: usize,
    kvd: usize,
    /// How the rows are stored.
    kind: KvType,
}

impl KvLayout {
    fn new(c: &ModelConfig, max_ctx: usize, kind: KvType) -> Result<KvLayout> {
        let kvd = c.kv_dim();
        // A Q8_0 row is encoded a head at a time: each head must be whole blocks.
        if kind == KvType::Q8_0 && !c.head_dim.is_multiple_of(32) {
            return Err(Error::Unsupported(format!(
                "a q8_0 KV cache needs heads of a multiple of 32 values; this model's have {} (use --kv-type f16 or f32)",
                c.head_dim
            )));
        }
        let rows: Vec<usize> = (0..c.num_layers)
            .map(|l| {
                c.layer_attention(l)
                    .window
                    .map_or(max_ctx, |w| w.saturating_add(MAX_BATCH - 1).min(max_ctx))
            })
            .collect();
        let mut base = Vec::with_capacity(rows.len());
        let mut elements = 0usize;
        for &r in &rows {
            base.push(elements);
            elements = r
                .checked_mul(kvd)
                .and_then(|n| elements.checked_add(n))
                .ok_or_else(too_big(max_ctx))?;
        }
        if elements
            .checked_mul(8)
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(too_big(max_ctx)());
        }
        Ok(KvLayout {
            rows,
            base,
            elements,
            kvd,
            kind,
        })
    }

    /// The first value of `layer`'s row for position `pos`.
    fn at(&self, layer: usize, pos: usize) -> usize {
        self.base[layer] + (pos % self.rows[layer]) * self.kvd
    }

    /// `layer`'s rows for positions `first..=last` as at most two runs (row offset in
    /// values, row count): a ring wraps once at most, as `last - first` < its rows.
    fn runs(&self, layer: usize, first: usize, last: usize) -> [(usize, usize); 2] {
        let rows = self.rows[layer];
        let (start, n) = (first % rows, last - first + 1);
        let head = n.min(rows - start);
        [
            (self.base[layer] + start * self.kvd, head),
            (self.base[layer], n - head),
        ]
    }

    /// Whether cutting a sequence from `old` positions to `len` loses rows a later token
    /// attends to (see [`kiln_core::LayerAttention::truncation_loses_rows`]).
    fn truncation_loses_rows(&self, c: &ModelConfig, old: usize, len: usize) -> bool {
        (0..c.num_layers).any(|l| {
            c.layer_attention(l)
                .truncation_loses_rows(self.rows[l], old, len)
        })
    }
}

/// One sequence's KV cache for a model of `c` at a context of `max_ctx` positions, stored
/// as `kind`: its bytes (keys and values) and the rows each layer keeps (a windowed layer
/// its ring).
pub struct KvCacheSize {
    pub bytes: usize,
    pub rows: Vec<usize>,
}

/// [`KvCacheSize`] as this backend allocates it.
pub fn kv_cache_size(c: &ModelConfig, max_ctx: usize, kind: KvType) -> Result<KvCacheSize> {
    let kv = KvLayout::new(c, max_ctx, kind)?;
    Ok(KvCacheSize {
        bytes: 2 * kind.bytes(kv.elements).ok_or_else(too_big(max_ctx))?,
        rows: kv.rows,
    })
}

fn too_big(max_ctx: usize) -> impl Fn() -> Error {
    move || {
        Error::OutOfMemory(format!(
            "a KV cache of {max_ctx} positions does not fit in memory"
        ))
    }
}

/// Buffers a forward pass writes, sized once for [`MAX_BATCH`] tokens.
struct Scratch {
    x: Vec<f32>,
    xn: Vec<f32>,
    sums: Vec<f32>,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    proj: Vec<f32>,
    ffn_out: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    cos_local: Vec<f32>,
    sin_local: Vec<f32>,
}

/// The CPU executor. See the crate docs.
pub struct CpuExecutor {
    model: Model,
    pool: ThreadPool,
    slots: SequenceSlots<Slot>,
    scratch: Scratch,
}

fn vector(view: &TensorView, len: usize, what: &str) -> Result<Vec<f32>> {
    if view.elements() != len {
        return Err(Error::InvalidShape(format!(
            "{what} ({}) has {} values; the model config needs {len}",
            view.name(),
            view.elements()
        )));
    }
    if block_fn(view.qtype()).is_none() {
        return Err(Error::Unsupported(format!(
            "{what} ({}) is stored as {}",
            view.name(),
            view.qtype()
        )));
    }
    let mut out = vec![0.0f32; len];
    dequantize_into(view.qtype(), view.bytes(), &mut out);
    Ok(out)
}

fn opt_vector(view: &Option<TensorView>, len: usize, what: &str) -> Result<Option<Vec<f32>>> {
    view.as_ref().map(|v| vector(v, len, what)).transpose()
}

/// Most worker threads per core `LoadOptions::threads` may ask for.
pub const MAX_THREADS_PER_CORE: usize = 4;

impl CpuExecutor {
    pub(crate) fn load(ir: &ModelIr, options: &LoadOptions, isa: Isa) -> Result<CpuExecutor> {
        let c = &ir.config;
        c.validate()?;
        let w = &ir.weights;
        if w.layers.len() != c.num_layers {
            return Err(Error::Format(format!(
                "config says {} layers, weights have {}",
                c.num_layers,
                w.layers.len()
            )));
        }
        let simd = Simd::detect(isa);
        let (h, qd, kvd, ffn, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.ffn_size, c.head_dim);
        let mut layers = Vec::with_capacity(c.num_layers);
        for (i, l) in w.layers.iter().enumerate() {
            let need = |present: bool, want: bool, what: &str| -> Result<()> {
                if present == want {
                    Ok(())
                } else if want {
                    Err(Error::Format(format!(
                        "layer {i}: the config needs {what}, the weights have none"
                    )))
                } else {
                    Err(Error::Format(format!(
                        "layer {i}: {what} is present but the config does not use it"
                    )))
                }
            };
            need(l.ffn_gate.is_some(), c.gated_ffn, "a gate projection")?;
            need(
                l.attn_q_norm.is_some() && l.attn_k_norm.is_some(),
                c.qk_norm,
                "Q/K norms",
            )?;
            need(
                l.attn_post_norm.is_some() && l.ffn_post_norm.is_some(),
                c.sandwich_norms,
                "post-attention/MLP norms",
            )?;
            if l.ffn_norm.is_none() && !c.parallel_residual {
                return Err(Error::Format(format!(
                    "layer {i}: no FFN norm and no parallel residual"
                )));
            }
            layers.push(Layer {
                attn_norm: vector(&l.attn_norm, h, "attention norm")?,
                attn_norm_bias: opt_vector(&l.attn_norm_bias, h, "attention norm bias")?,
                q: QMatrix::new(&l.attn_q, h, qd, isa)?,
                k: QMatrix::new(&l.attn_k, h, kvd, isa)?,
                v: QMatrix::new(&l.attn_v, h, kvd, isa)?,
                q_bias: opt_vector(&l.attn_q_bias, qd, "Q bias")?,
                k_bias: opt_vector(&l.attn_k_bias, kvd, "K bias")?,
                v_bias: opt_vector(&l.attn_v_bias, kvd, "V bias")?,
                q_norm: opt_vector(&l.attn_q_norm, hd, "Q norm")?,
                k_norm: opt_vector(&l.attn_k_norm, hd, "K norm")?,
                out: QMatrix::new(&l.attn_out, qd, h, isa)?,
                out_bias: opt_vector(&l.attn_out_bias, h, "attention output bias")?,
                ffn_norm: opt_vector(&l.ffn_norm, h, "FFN norm")?,
                ffn_norm_bias: opt_vector(&l.ffn_norm_bias, h, "FFN norm bias")?,
                gate: l
                    .ffn_gate
                    .as_ref()
                    .map(|g| QMatrix::new(g, h, ffn, isa))
                    .transpose()?,
                up: QMatrix::new(&l.ffn_up, h, ffn, isa)?,
                down: QMatrix::new(&l.ffn_down, ffn, h, isa)?,
                post_attn_norm: opt_vector(&l.attn_post_norm, h, "post-attention norm")?,
                post_ffn_norm: opt_vector(&l.ffn_post_norm, h, "post-MLP norm")?,
            });
        }
        let half = c.rope.rotary_dims / 2;
        let freq_factors = opt_vector(&w.rope_freqs, half, "rope frequency factors")?;
        let inv_freq = (0..half)
            .map(|i| c.rope.inv_freq(i, freq_factors.as_deref()))
            .collect();
        let local_inv_freq = c
            .local_rope()
            .map(|r| (0..half).map(|i| r.inv_freq(i, None)).collect());
        let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
        // 0 (or none) means every core. More than a few threads per core only adds
        // switching (and thousands fail to spawn after seconds): refused, with the limit.
        let threads = match options.threads {
            None | Some(0) => cores,
            Some(n) if n > MAX_THREADS_PER_CORE * cores => {
                return Err(Error::InvalidArgument(format!(
                    "{n} threads on a machine with {cores} cores (at most {} = {MAX_THREADS_PER_CORE} per core)",
                    MAX_THREADS_PER_CORE * cores
                )))
            }
            Some(n) => n,
        };
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .thread_name(|i| format!("kiln-cpu-{i}"))
            .build()
            .map_err(|e| Error::Backend {
                backend: "cpu".into(),
                message: format!("thread pool: {e}"),
            })?;
        let max_ctx = options.context_for(c);
        let kv = KvLayout::new(c, max_ctx, options.kv_type.unwrap_or(KvType::F32))?;
        // Zeroed allocations are mapped lazily by the OS: a slot costs memory only for the
        // positions its sequence reaches.
        let slots = SequenceSlots::new(
            (0..options.sequences()).map(|_| Slot {
                k: KvRows::new(kv.kind, kv.elements),
                v: KvRows::new(kv.kind, kv.elements),
                tokens: Vec::new(),
            }),
            options.sequences() * max_ctx.div_ceil(kiln_core::KV_BLOCK_TOKENS),
            max_ctx,
        );
        let widest = h.max(qd).max(ffn);
        let b = MAX_BATCH;
        let scratch = Scratch {
            x: vec![0.0; b * h],
            xn: vec![0.0; b * widest],
            sums: vec![0.0; b * widest.div_ceil(32)],
            q: vec![0.0; b * qd],
            k: vec![0.0; b * kvd],
            v: vec![0.0; b * kvd],
            att: vec![0.0; b * qd],
            proj: vec![0.0; b * h],
            ffn_out: vec![0.0; b * h],
            gate: vec![0.0; b * ffn],
            up: vec![0.0; b * ffn],
            cos: vec![0.0; b * half.max(1)],
            sin: vec![0.0; b * half.max(1)],
            cos_local: vec![0.0; b * half.max(1)],
            sin_local: vec![0.0; b * half.max(1)],
        };
        let model = Model {
            config: c.clone(),
            layers,
            embd: QMatrix::new(&w.token_embd, h, c.vocab_size, isa)?,
            out_norm: vector(&w.output_norm, h, "output norm")?,
            out_norm_bias: opt_vector(&w.output_norm_bias, h, "output norm bias")?,
            lm_head: QMatrix::new(w.lm_head(), h, c.vocab_size, isa)?,
            kv,
            inv_freq,
            local_inv_freq,
            max_ctx,
            threads,
            simd,
        };
        Ok(CpuExecutor {
            model,
            pool,
            slots,
            scratch,
        })
    }

    /// Worker threads of this executor's pool.
    pub fn threads(&self) -> usize {
        self.model.threads
    }

    fn slot_of(&self, seq: SeqId) -> Result<usize> {
        self.slots.index_of(seq)
    }

    /// Runs positions `rows[i] = (slot, position)` for `tokens[i]` through the model.
    /// Logits of every row go to `logits` (`rows × vocab`), or of the last row only when
    /// `last_only`.
    fn forward(
        &mut self,
        rows: &[(usize, usize)],
        tokens: &[u32],
        logits: &mut [f32],
        last_only: bool,
    ) {
        let CpuExecutor {
            model,
            pool,
            slots,
            scratch,
            ..
        } = self;
        pool.install(|| {
            forward(
                model,
                slots.as_mut_slice(),
                scratch,
                rows,
                tokens,
                logits,
                last_only,
            )
        });
    }
}

fn norm(c: &ModelConfig, x: &[f32], w: &[f32], b: Option<&Vec<f32>>, out: &mut [f32]) {
    match c.norm {
        NormKind::Rms => {
            ops::rms_norm(x, w, c.norm_eps, out);
            if let Some(b) = b {
                ops::add_in_place(out, b);
            }
        }
        NormKind::Layer => ops::layer_norm(x, w, b.map(|b| b.as_slice()), c.norm_eps, out),
    }
}

fn batch<'a>(x: &'a [f32], sums: &'a mut [f32], tokens: usize, cols: usize) -> Batch<'a> {
    let x = &x[..tokens * cols];
    let ns = cols / 32;
    if cols.is_multiple_of(32) {
        block_sums(x, &mut sums[..tokens * ns]);
    }
    Batch {
        x,
        sums: if cols.is_multiple_of(32) {
            &sums[..tokens * ns]
        } else {
            &[]
        },
        tokens,
        cols,
    }
}

/// RMSNorm of each row of `buf` (rows as long as `w`) in place.
fn norm_rows(buf: &mut [f32], w: &[f32], eps: f32) {
    for row in buf.chunks_exact_mut(w.len()) {
        ops::rms_norm_in_place(row, w, eps);
    }
}

fn add_bias(buf: &mut [f32], bias: &Option<Vec<f32>>) {
    if let Some(b) = bias {
        for row in buf.chunks_exact_mut(b.len()) {
            ops::add_in_place(row, b);
        }
    }
}

/// Tokens of one sequence a causal attention block takes: each key and value tile is read
/// once for this many tokens (times the heads of a GQA group).
const CAUSAL_BLOCK: usize = 8;

/// A full-attention layer's attention for a prefill of `rows` (their K/V already in the
/// cache): consecutive positions of one sequence in blocks of up to [`CAUSAL_BLOCK`]
/// tokens, one task per block and KV head, each through [`ops::attend_causal`] (the bits
/// one token at a time gives). `att` gets each token's heads in place.
#[allow(clippy::too_many_arguments)]
fn attend_causal_blocks(
    m: &Model,
    cache: &[SeqSlot<Slot>],
    rows: &[(usize, usize)],
    q: &[f32],
    att: &mut [f32],
    li: usize,
    simd: Option<Simd>,
    scale: f32,
) {
    let c = &m.config;
    let (qd, kvd, hd) = (c.q_dim(), c.kv_dim(), c.head_dim);
    let (kv_heads, group) = (c.num_kv_heads, c.gqa_ratio());
    // Blocks: runs of rows in one slot at consecutive positions, cut every CAUSAL_BLOCK.
    let mut blocks: Vec<std::ops::Range<usize>> = Vec::new();
    for (t, &(slot, pos)) in rows.iter().enumerate() {
        match blocks.last_mut() {
            Some(b) if b.len() < CAUSAL_BLOCK && rows[b.end - 1] == (slot, pos.wrapping_sub(1)) => {
                b.end = t + 1
            }
            _ => blocks.push(t..t + 1),
        }
    }
    // Each token's group of heads for KV head g is one piece of `att`; hand every task its
    // block's pieces (task = block · kv_heads + g).
    let mut tasks: Vec<Vec<&mut [f32]>> = (0..blocks.len() * kv_heads)
        .map(|_| Vec::with_capacity(CAUSAL_BLOCK))
        .collect();
    let mut block_of = vec![0; rows.len()];
    for (b, r) in blocks.iter().enumerate() {
        block_of[r.clone()].fill(b);
    }
    for (i, piece) in att.chunks_mut(group * hd).enumerate() {
        let (t, g) = (i / kv_heads, i % kv_heads);
        tasks[block_of[t] * kv_heads + g].push(piece);
    }
    tasks.into_par_iter().enumerate().for_each(|(task, outs)| {
        let (b, g) = (task / kv_heads, task % kv_heads);
        let block = blocks[b].clone();
        let (slot, last) = rows[block.end - 1];
        let kv = &cache[slot];
        let base = m.kv.at(li, 0);
        let (keys, values) = (
            kv.k.head_rows(base, last + 1, kvd, g * hd, hd),
            kv.v.head_rows(base, last + 1, kvd, g * hd, hd),
        );
        let mut qs = Vec::with_capacity(block.len() * group * hd);
        let mut lens = Vec::with_capacity(block.len() * group);
        for t in block.clone() {
            qs.extend_from_slice(&q[t * qd + g * group * hd..][..group * hd]);
            lens.extend(std::iter::repeat_n(rows[t].1 + 1, group));
        }
        let mut out = vec![0.0f32; qs.len()];
        ops::attend_causal(
            simd,
            &qs,
            hd,
            &lens,
            &keys.data,
            &values.data,
            keys.stride,
            keys.offset,
            scale,
            &mut out,
        );
        for (piece, o) in outs.into_iter().zip(out.chunks_exact(group * hd)) {
            piece.copy_from_slice(o);
        }
    });
}

fn forward(
    m: &Model,
    slots: &mut [SeqSlot<Slot>],
    s: &mut Scratch,
    rows: &[(usize, usize)],
    tokens: &[u32],
    logits: &mut [f32],
    last_only: bool,
) {
    let c = &m.config;
    let n = rows.len();
    let (h, qd, kvd, ffn, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.ffn_size, c.head_dim);
    let half = c.rope.rotary_dims / 2;
    let (threads, simd) = (m.threads, m.simd);
    let scale = c.attention_scale();

    for (t, &tok) in tokens.iter().enumerate() {
        let x = &mut s.x[t * h..(t + 1) * h];
        m.embd.dequant_row(tok as usize, x);
        if c.embedding_scale != 1.0 {
            x.iter_mut().for_each(|v| *v *= c.embedding_scale);
        }
    }
    for (t, &(_, pos)) in rows.iter().enumerate() {
        for i in 0..half {
            let (sin, cos) = (pos as f32 * m.inv_freq[i]).sin_cos();
            s.cos[t * half + i] = cos;
            s.sin[t * half + i] = sin;
            if let Some(local) = &m.local_inv_freq {
                let (sin, cos) = (pos as f32 * local[i]).sin_cos();
                s.cos_local[t * half + i] = cos;
                s.sin_local[t * half + i] = sin;
            }
        }
    }

    for (li, l) in m.layers.iter().enumerate() {
        let attention = c.layer_attention(li);
        let (cos_all, sin_all) = match attention.local_rope {
            true => (&s.cos_local, &s.sin_local),
            false => (&s.cos, &s.sin),
        };
        for t in 0..n {
            norm(
                c,
                &s.x[t * h..(t + 1) * h],
                &l.attn_norm,
                l.attn_norm_bias.as_ref(),
                &mut s.xn[t * h..(t + 1) * h],
            );
        }
        let input = batch(&s.xn, &mut s.sums, n, h);
        matmul(
            &mut [
                MatJob {
                    m: &l.q,
                    out: &mut s.q[..n * qd],
                },
                MatJob {
                    m: &l.k,
                    out: &mut s.k[..n * kvd],
                },
                MatJob {
                    m: &l.v,
                    out: &mut s.v[..n * kvd],
                },
            ],
            input,
            threads,
            simd,
        );
        add_bias(&mut s.q[..n * qd], &l.q_bias);
        add_bias(&mut s.k[..n * kvd], &l.k_bias);
        add_bias(&mut s.v[..n * kvd], &l.v_bias);
        for t in 0..n {
            let (cos, sin) = (
                &cos_all[t * half..(t + 1) * half],
                &sin_all[t * half..(t + 1) * half],
            );
            for head in s.q[t * qd..(t + 1) * qd].chunks_exact_mut(hd) {
                if let Some(w) = &l.q_norm {
                    ops::rms_norm_in_place(head, w, c.norm_eps);
                }
                ops::rope(c.rope.kind, head, cos, sin);
            }
            for head in s.k[t * kvd..(t + 1) * kvd].chunks_exact_mut(hd) {
                if let Some(w) = &l.k_norm {
                    ops::rms_norm_in_place(head, w, c.norm_eps);
                }
                ops::rope(c.rope.kind, head, cos, sin);
            }
            let (slot, pos) = rows[t];
            let at = m.kv.at(li, pos);
            slots[slot].k.write(at, &s.k[t * kvd..(t + 1) * kvd]);
            slots[slot].v.write(at, &s.v[t * kvd..(t + 1) * kvd]);
        }

        // One task per token and KV head: the query heads of its GQA group (consecutive
        // in q and in the output) go through the attention together, a few at a time, so
        // each key and value row is read once for them. With fewer such tasks than twice
        // the threads (a decode step), the heads go one a task instead, so every thread
        // has work.
        let kv_heads = c.num_kv_heads;
        let group = c.gqa_ratio();
        let heads_together = if n * kv_heads >= 2 * threads {
            kernels::MULTI_QUERIES
        } else {
            1
        };
        let q = &s.q;
        let cache: &[SeqSlot<Slot>] = slots;
        if attention.window.is_none() && n.div_ceil(CAUSAL_BLOCK) * kv_heads >= 2 * threads {
            // A prefill: runs of consecutive tokens of one sequence go through a full layer
            // as causal blocks (one task per block and KV head), each key and value tile
            // read once for the block's tokens and heads (see `ops::attend_causal`).
            attend_causal_blocks(m, cache, rows, q, &mut s.att[..n * qd], li, simd, scale);
        } else {
            s.att[..n * qd]
                .par_chunks_mut(group * hd)
                .enumerate()
                .for_each(|(i, out)| {
                    let (t, kvh) = (i / kv_heads, i % kv_heads);
                    let (slot, pos) = rows[t];
                    let kv = &cache[slot];
                    // A windowed layer sees only the last `window` positions.
                    let heads =
                        m.kv.runs(li, attention.first_position(pos), pos)
                            .map(|(at, n)| {
                                (
                                    kv.k.head_rows(at, n, kvd, kvh * hd, hd),
                                    kv.v.head_rows(at, n, kvd, kvh * hd, hd),
                                    n,
                                )
                            });
                    let runs = heads.each_ref().map(|(k, v, n)| ops::KvRun {
                        keys: &k.data,
                        values: &v.data,
                        len: *n,
                    });
                    let (stride, offset) = (heads[0].0.stride, heads[0].0.offset);
                    let qg = &q[t * qd + kvh * group * hd..][..group * hd];
                    let piece = heads_together * hd;
                    qg.par_chunks(piece)
                        .zip(out.par_chunks_mut(piece))
                        .for_each(|(qp, op)| {
                            ops::attend_group(simd, qp, hd, &runs, stride, offset, scale, op)
                        });
                });
        }

        let input = batch(&s.att, &mut s.sums, n, qd);
        matmul(
            &mut [MatJob {
                m: &l.out,
                out: &mut s.proj[..n * h],
            }],
            input,
            threads,
            simd,
        );
        add_bias(&mut s.proj[..n * h], &l.out_bias);
        if let Some(w) = &l.post_attn_norm {
            norm_rows(&mut s.proj[..n * h], w, c.norm_eps);
        }

        if !c.parallel_residual {
            ops::add_in_place(&mut s.x[..n * h], &s.proj[..n * h]);
        }
        if let Some(w) = &l.ffn_norm {
            for t in 0..n {
                norm(
                    c,
                    &s.x[t * h..(t + 1) * h],
                    w,
                    l.ffn_norm_bias.as_ref(),
                    &mut s.xn[t * h..(t + 1) * h],
                );
            }
        }
        let input = batch(&s.xn, &mut s.sums, n, h);
        match &l.gate {
            Some(gate) => matmul(
                &mut [
                    MatJob {
                        m: gate,
                        out: &mut s.gate[..n * ffn],
                    },
                    MatJob {
                        m: &l.up,
                        out: &mut s.up[..n * ffn],
                    },
                ],
                input,
                threads,
                simd,
            ),
            None => matmul(
                &mut [MatJob {
                    m: &l.up,
                    out: &mut s.up[..n * ffn],
                }],
                input,
                threads,
                simd,
            ),
        }
        let act = match c.activation {
            Activation::Silu => ops::silu,
            Activation::Gelu => ops::gelu,
        };
        if l.gate.is_some() {
            for (u, &g) in s.up[..n * ffn].iter_mut().zip(&s.gate[..n * ffn]) {
                *u *= act(g);
            }
        } else {
            for u in s.up[..n * ffn].iter_mut() {
                *u = act(*u);
            }
        }
        let input = batch(&s.up, &mut s.sums, n, ffn);
        matmul(
            &mut [MatJob {
                m: &l.down,
                out: &mut s.ffn_out[..n * h],
            }],
            input,
            threads,
            simd,
        );
        if let Some(w) = &l.post_ffn_norm {
            norm_rows(&mut s.ffn_out[..n * h], w, c.norm_eps);
        }
        ops::add_in_place(&mut s.x[..n * h], &s.ffn_out[..n * h]);
        if c.parallel_residual {
            ops::add_in_place(&mut s.x[..n * h], &s.proj[..n * h]);
        }
    }

    let first = if last_only { n - 1 } else { 0 };
    let count = n - first;
    for t in first..n {
        let o = t - first;
        norm(
            c,
            &s.x[t * h..(t + 1) * h],
            &m.out_norm,
            m.out_norm_bias.as_ref(),
            &mut s.xn[o * h..(o + 1) * h],
        );
    }
    let input = batch(&s.xn, &mut s.sums, count, h);
    matmul(
        &mut [MatJob {
            m: &m.lm_head,
            out: logits,
        }],
        input,
        threads,
        simd,
    );
}

impl LayerExecutor for CpuExecutor {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn kv_type(&self) -> Option<KvType> {
        Some(self.model.kv.kind)
    }

    fn max_context(&self) -> usize {
        self.model.max_ctx
    }

    fn max_sequences(&self) -> usize {
        self.slots.capacity()
    }

    fn new_sequence(&mut self) -> Result<SeqId> {
        let seq = self.slots.allocate()?;
        let slot = self.slot_of(seq)?;
        self.slots[slot].cache.tokens.clear();
        Ok(seq)
    }

    fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.slots.free(seq)
    }

    fn sequence_len(&self, seq: SeqId) -> Result<usize> {
        self.slots.len_of(seq)
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> Result<()> {
        let slot = self.slot_of(seq)?;
        let old = self.slots[slot].len;
        self.slots.truncate(seq, len)?;
        self.slots[slot].cache.tokens.truncate(len);
        if self
            .model
            .kv
            .truncation_loses_rows(&self.model.config, old, len)
        {
            // A windowed layer's ring no longer holds positions the next token attends to,
            // and those depend on earlier ones: the kept prefix is run again (a cut by at
            // most MAX_BATCH positions, or of a short sequence, never gets here).
            let tokens = std::mem::take(&mut self.slots[slot].cache.tokens);
            self.slots[slot].len = 0;
            let mut logits = vec![0.0; self.model.config.vocab_size];
            let result = self.prefill(seq, &tokens, &mut logits);
            if result.is_err() {
                self.slots[slot].cache.tokens = tokens;
            }
            result?;
        }
        Ok(())
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> Result<()> {
        let slot = self.slot_of(seq)?;
        let start = self.slots[slot].len;
        check_prefill(
            tokens,
            logits,
            self.model.config.vocab_size,
            start,
            self.model.max_ctx,
        )?;
        let mut rows = [(0usize, 0usize); MAX_BATCH];
        for (ci, chunk) in tokens.chunks(MAX_BATCH).enumerate() {
            let pos0 = start + ci * MAX_BATCH;
            for (j, r) in rows[..chunk.len()].iter_mut().enumerate() {
                *r = (slot, pos0 + j);
            }
            self.forward(&rows[..chunk.len()], chunk, logits, true);
            self.slots[slot].len = pos0 + chunk.len();
            self.slots[slot].cache.tokens.extend_from_slice(chunk);
        }
        Ok(())
    }

    fn decode(&mut self, batch: &[DecodeItem], logits: &mut [f32]) -> Result<()> {
        let vocab = self.model.config.vocab_size;
        // Validate everything before touching any cache, so an error leaves every
        // sequence as it was.
        check_decode(batch, logits, vocab, self.model.max_ctx, |seq| {
            self.slots.len_of(seq)
        })?;
        let mut rows = [(0usize, 0usize); MAX_BATCH];
        let mut toks = [0u32; MAX_BATCH];
        for (items, out) in batch
            .chunks(MAX_BATCH)
            .zip(logits.chunks_mut(MAX_BATCH * vocab))
        {
            for (i, item) in items.iter().enumerate() {
                let slot = self.slot_of(item.seq)?;
                rows[i] = (slot, self.slots[slot].len);
                toks[i] = item.token;
            }
            self.forward(&rows[..items.len()], &toks[..items.len()], out, false);
            for (&(slot, _), &token) in rows[..items.len()].iter().zip(&toks) {
                self.slots[slot].len += 1;
                self.slots[slot].cache.tokens.push(token);
            }
        }
        Ok(())
    }
}
