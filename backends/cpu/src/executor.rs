//! The loaded model: weights as views of the file, the KV cache (f32 by default; f16 or
//! Q8_0 rows with `LoadOptions::kv_type`), and the forward pass shared by prefill (one
//! sequence, many positions) and batched decode (many sequences, one position each).
//!
//! The KV cache is paged as the GPU backends' is: the layers that attend to the whole
//! context keep their rows in one pool of blocks of [`KV_BLOCK_TOKENS`] positions shared
//! by all sequences ([`KvPool`]), a sequence holding the blocks its length needs
//! ([`SequenceSlots::reserve`] before every write), so a pool smaller than every sequence's
//! full context (`LoadOptions::kv_memory`) serves many short sequences, and the oracle
//! checks the same bookkeeping (a refusal with `KvCacheFull` that changes nothing) the GPUs
//! run. Sliding-window layers keep a ring per sequence ([`KvLayout`]): its size is fixed
//! by the window, whatever the length.

use std::borrow::Cow;
use std::sync::Arc;

use half::slice::{HalfBitsSliceExt, HalfFloatSliceExt};
use kiln_core::{
    check_decode, check_hidden_batch, check_prefill, check_prefill_hidden, check_prefill_logits,
    Activation, DecodeItem, Error, HiddenRequest, KvBlockUsage, KvType, LayerExecutor, LoadOptions,
    ModelConfig, ModelIr, NormKind, Result, SeqId, SeqSlot, SequenceSlots, TensorView,
    KV_BLOCK_TOKENS,
};
use rayon::prelude::*;
use rayon::ThreadPool;

use crate::kernels::q8::{Q8Forms, Q8Input};
use crate::kernels::{self, block_sums, Isa, Simd};
use crate::matmul::{matmul, Batch, MatJob, QMatrix, MAX_BATCH};
use crate::ops;
use kiln_core::parallel::Collective;
use kiln_core::program::{self, Attention, Experts, FeedForward, Norm, Op};
use kiln_core::ModelProgram;

/// The program with the CPU's weights: matrices with their row-dot kernels, vectors in f32.
type CpuProgram = ModelProgram<QMatrix, Vec<f32>>;

/// Immutable part of the executor: everything a forward pass reads.
struct Model {
    config: ModelConfig,
    program: CpuProgram,
    kv: KvLayout,
    /// Inverse frequency of each rotary pair.
    inv_freq: Vec<f32>,
    /// The windowed layers' (their own RoPE base), when the model has a sliding window.
    local_inv_freq: Option<Vec<f32>>,
    max_ctx: usize,
    threads: usize,
    simd: Option<Simd>,
    /// The 8-bit activation forms the matrices with an integer kernel multiply
    /// (`LoadOptions::quantized_activations`; none in the oracle's default).
    q8_forms: Q8Forms,
    /// The 8-bit mode's GELU: ggml's CPU backend's (input and result at f16, through its
    /// table), so that mode keeps llama.cpp's arithmetic in Gemma's feed-forward too.
    f16_gelu: bool,
    /// A tensor-parallel rank's group: each branch's partial output is summed over it
    /// (see `kiln_core::parallel`). `None`: the whole model is here.
    collective: Option<Arc<dyn Collective>>,
}

/// One sequence slot: its windowed layers' rings (see [`KvLayout`]; its other rows live in
/// the blocks of the [`KvPool`] its block table names) and its tokens (a truncation of a
/// model with windowed layers may have to recompute from them).
struct Slot {
    k: KvRows,
    v: KvRows,
    tokens: Vec<u32>,
}

/// Keys (or values): a slot's rings or the pool's blocks ([`KvLayout`]): f32, the
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

    /// Decodes `out.len()` values from element `first` (for Q8_0, whole blocks).
    fn decode(&self, first: usize, out: &mut [f32]) {
        match self {
            KvRows::F32(v) => out.copy_from_slice(&v[first..first + out.len()]),
            KvRows::F16(v) => v[first..first + out.len()]
                .reinterpret_cast::<half::f16>()
                .convert_to_f32_slice(out),
            KvRows::Q8_0(b) => {
                let blocks = &b[q8_0_byte(first)..q8_0_byte(first + out.len())];
                kiln_core::quant::dequantize(kiln_core::QType::Q8_0, blocks, out)
                    .expect("whole blocks (checked at load)")
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
        match self {
            KvRows::F32(v) => HeadRows {
                data: Cow::Borrowed(&v[at..at + rows * stride]),
                stride,
                offset,
            },
            _ => self.gather(std::iter::once((at, rows)), stride, offset, hd),
        }
    }

    /// Values `offset..offset + hd` of the rows of `runs` (first element, rows of `stride`
    /// values), decoded one after another into one buffer: the rows of a paged sequence's
    /// blocks as one contiguous run, for a cache that cannot be read in place.
    fn gather(
        &self,
        runs: impl Iterator<Item = (usize, usize)> + Clone,
        stride: usize,
        offset: usize,
        hd: usize,
    ) -> HeadRows<'static> {
        let rows: usize = runs.clone().map(|(_, n)| n).sum();
        let mut out = vec![0.0f32; rows * hd];
        let mut dst = out.chunks_exact_mut(hd.max(1));
        for (at, n) in runs {
            for (r, o) in (0..n).zip(&mut dst) {
                self.decode(at + r * stride + offset, o);
            }
        }
        HeadRows {
            data: Cow::Owned(out),
            stride: hd,
            offset: 0,
        }
    }
}

/// Where a layer keeps its key and value rows.
#[derive(Debug, Clone, Copy)]
enum LayerRows {
    /// In the pool ([`KvPool`]): the `index`-th of the layers that attend to the whole
    /// context, position p in row p % 32 of block `blocks()[p / 32]` of its sequence.
    Paged { index: usize },
    /// In the slot's ring of `rows` rows from value `base`: position p in row p % rows.
    Ring { rows: usize, base: usize },
}

/// Where each layer's key and value rows lie. A layer that attends to the whole context
/// keeps every position of a sequence in the pool's blocks ([`KvPool`]): the blocks a
/// sequence holds grow with its length, so sequences of any lengths share one allocation.
/// A windowed layer (Gemma 3's local ones) keeps a ring of `window + MAX_BATCH - 1` rows
/// in the sequence's slot — one forward pass writes at most MAX_BATCH positions of a
/// sequence, so it never overwrites a position one of its own tokens still attends to; a
/// ring's size does not depend on the length, so paging it would save nothing.
struct KvLayout {
    layers: Vec<LayerRows>,
    /// Values of one slot's rings of keys (and as many of values).
    ring_elements: usize,
    /// Layers in the pool.
    paged: usize,
    /// Bytes one block of the pool takes: 32 rows of keys and of values of every paged layer.
    block_bytes: usize,
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
        let mut layers = Vec::with_capacity(c.num_layers);
        let (mut ring_elements, mut paged) = (0usize, 0usize);
        for l in 0..c.num_layers {
            match c.layer_attention(l).window {
                None => {
                    layers.push(LayerRows::Paged { index: paged });
                    paged += 1;
                }
                Some(w) => {
                    let rows = w.saturating_add(MAX_BATCH - 1).min(max_ctx);
                    layers.push(LayerRows::Ring {
                        rows,
                        base: ring_elements,
                    });
                    ring_elements = rows
                        .checked_mul(kvd)
                        .and_then(|n| ring_elements.checked_add(n))
                        .ok_or_else(too_big(max_ctx))?;
                }
            }
        }
        if ring_elements
            .checked_mul(8)
            .is_none_or(|b| b > isize::MAX as usize)
        {
            return Err(too_big(max_ctx)());
        }
        let block_bytes = (paged * KV_BLOCK_TOKENS)
            .checked_mul(kvd)
            .and_then(|n| kind.bytes(n))
            .and_then(|b| b.checked_mul(2))
            .ok_or_else(too_big(max_ctx))?;
        Ok(KvLayout {
            layers,
            ring_elements,
            paged,
            block_bytes,
            kvd,
            kind,
        })
    }

    /// Rows `layer` keeps of a sequence of `max_ctx` positions.
    fn rows(&self, layer: usize, max_ctx: usize) -> usize {
        match self.layers[layer] {
            LayerRows::Paged { .. } => max_ctx,
            LayerRows::Ring { rows, .. } => rows,
        }
    }

    /// A ring's rows for positions `first..=last` as at most two runs (row offset in
    /// values, row count): a ring wraps once at most, as `last - first` < its rows.
    fn ring_runs(
        &self,
        rows: usize,
        base: usize,
        first: usize,
        last: usize,
    ) -> [(usize, usize); 2] {
        let (start, n) = (first % rows, last - first + 1);
        let head = n.min(rows - start);
        [(base + start * self.kvd, head), (base, n - head)]
    }

    /// Whether cutting a sequence from `old` positions to `len` loses rows a later token
    /// attends to (see [`kiln_core::LayerAttention::truncation_loses_rows`]).
    fn truncation_loses_rows(
        &self,
        c: &ModelConfig,
        max_ctx: usize,
        old: usize,
        len: usize,
    ) -> bool {
        (0..c.num_layers).any(|l| {
            c.layer_attention(l)
                .truncation_loses_rows(self.rows(l, max_ctx), old, len)
        })
    }
}

/// The keys and values of the layers that attend to the whole context, for every block of
/// the pool all sequences share. Layer-major: paged layer i's rows are rows
/// `i · rows .. (i + 1) · rows` (`rows` = blocks × 32), block b's rows `b · 32 .. b · 32 +
/// 32` of them, so a block's rows of one layer are contiguous (attention reads them as one
/// run) and so are consecutive blocks' (a sequence whose blocks follow one another in the
/// pool, as one alone gets them, reads its whole context as one run). Allocated zeroed, so
/// the OS maps it only as blocks are first written.
struct KvPool {
    k: KvRows,
    v: KvRows,
    /// Rows of each layer: blocks × [`KV_BLOCK_TOKENS`].
    rows: usize,
}

impl KvPool {
    fn new(kv: &KvLayout, blocks: usize, max_ctx: usize) -> Result<KvPool> {
        let rows = blocks
            .checked_mul(KV_BLOCK_TOKENS)
            .ok_or_else(too_big(max_ctx))?;
        let elements = rows
            .checked_mul(kv.paged * kv.kvd)
            .filter(|e| e.checked_mul(4).is_some_and(|b| b <= isize::MAX as usize))
            .ok_or_else(|| {
                Error::OutOfMemory(format!(
                    "a KV cache pool of {blocks} blocks of {KV_BLOCK_TOKENS} positions does not fit in memory"
                ))
            })?;
        Ok(KvPool {
            k: KvRows::new(kv.kind, elements),
            v: KvRows::new(kv.kind, elements),
            rows,
        })
    }

    /// The first value of paged layer `index`'s pool row `row`.
    fn at(&self, kvd: usize, index: usize, row: usize) -> usize {
        (index * self.rows + row) * kvd
    }
}

/// The pool row of position `pos` of a sequence with block table `blocks`.
fn pool_row(blocks: &[u32], pos: usize) -> usize {
    blocks[pos / KV_BLOCK_TOKENS] as usize * KV_BLOCK_TOKENS + pos % KV_BLOCK_TOKENS
}

/// One sequence's KV cache for a model of `c` at a context of `max_ctx` positions, stored
/// as `kind`: its bytes (keys and values) and the rows each layer keeps (a windowed layer
/// its ring).
pub struct KvCacheSize {
    pub bytes: usize,
    pub rows: Vec<usize>,
}

/// [`KvCacheSize`] as this backend allocates it: the sequence's rings, and the pool blocks
/// its whole context takes.
pub fn kv_cache_size(c: &ModelConfig, max_ctx: usize, kind: KvType) -> Result<KvCacheSize> {
    let kv = KvLayout::new(c, max_ctx, kind)?;
    let blocks = kv
        .block_bytes
        .checked_mul(max_ctx.div_ceil(KV_BLOCK_TOKENS))
        .ok_or_else(too_big(max_ctx))?;
    Ok(KvCacheSize {
        bytes: kind
            .bytes(kv.ring_elements)
            .and_then(|b| b.checked_mul(2))
            .and_then(|b| b.checked_add(blocks))
            .ok_or_else(too_big(max_ctx))?,
        rows: (0..c.num_layers).map(|l| kv.rows(l, max_ctx)).collect(),
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
    /// The current matmul input quantised to 8 bits (with `quantized_activations`).
    q8: Q8Input,
    q: Vec<f32>,
    k: Vec<f32>,
    v: Vec<f32>,
    att: Vec<f32>,
    /// A branch's output (its operations' sum).
    branch_out: Vec<f32>,
    /// A second operation's output in a branch that sums several.
    op_out: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    /// A Mixture of Experts' router logits (rows × experts), each row's chosen experts
    /// with their weights, the normed input while the experts' groups fill `xn`, and one
    /// group's output.
    router: Vec<f32>,
    routes: Vec<Route>,
    expert_order: Vec<usize>,
    /// What the routers chose in the last forward pass, when asked for.
    routing: Option<RoutingTrace>,
    moe_x: Vec<f32>,
    moe_out: Vec<f32>,
    cos: Vec<f32>,
    sin: Vec<f32>,
    cos_local: Vec<f32>,
    sin_local: Vec<f32>,
    /// Each row's positions `0..=pos` as runs of pool rows (first row, rows), adjacent
    /// blocks merged, and where each row's runs lie in `runs`: found once a forward pass
    /// from the block tables, read by every paged layer (kept here, so a decode step
    /// allocates none).
    runs: Vec<(usize, usize)>,
    run_spans: Vec<std::ops::Range<usize>>,
}

/// The CPU executor. See the crate docs.
pub struct CpuExecutor {
    model: Model,
    pool: ThreadPool,
    slots: SequenceSlots<Slot>,
    kv: KvPool,
    scratch: Scratch,
}

/// A norm weight or bias in f32 (the program checked its length), decoded by core.
fn vector(view: &TensorView, _len: usize) -> Result<Vec<f32>> {
    view.to_f32()
}

/// Most worker threads per core `LoadOptions::threads` may ask for.
pub const MAX_THREADS_PER_CORE: usize = 4;

impl CpuExecutor {
    pub(crate) fn load(ir: &ModelIr, options: &LoadOptions, isa: Isa) -> Result<CpuExecutor> {
        Self::load_program(&ir.config, &program::build(ir)?, options, isa, None)
    }

    /// Loads `program` (the model `c` describes, or a tensor-parallel rank's share of one,
    /// which sums its branches over `collective`).
    pub(crate) fn load_program(
        c: &ModelConfig,
        program: &ModelProgram<TensorView>,
        options: &LoadOptions,
        isa: Isa,
        collective: Option<Arc<dyn Collective>>,
    ) -> Result<CpuExecutor> {
        let simd = Simd::detect(isa);
        let (h, qd, kvd, ffn) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.ffn_size);
        // The matrices a forward pass multiplies, with their integer kernels when the caller
        // asked for 8-bit activations (`kernels::q8`; the oracle's f32 path otherwise).
        let mut q8_forms = Q8Forms::default();
        let program = program.map(
            c,
            |view, shape| {
                let m = QMatrix::new(view, shape.inputs, shape.outputs, isa)?;
                if !options.quantized_activations {
                    return Ok(m);
                }
                let m = m.with_q8_activations(isa);
                if let Some(k) = m.q8 {
                    q8_forms.add(k);
                }
                Ok(m)
            },
            vector,
        )?;
        let half = c.rope.rotary_dims / 2;
        let inv_freq = (0..half)
            .map(|i| c.rope.inv_freq(i, program.rope_freqs.as_deref()))
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
        let blocks = options.kv_pool_blocks(max_ctx, kv.block_bytes as u64)?;
        // Zeroed allocations are mapped lazily by the OS: the pool costs memory only for the
        // blocks sequences reach, a slot's rings only for the positions its sequence does.
        let pool_kv = KvPool::new(&kv, blocks, max_ctx)?;
        let slots = SequenceSlots::new(
            (0..options.sequences()).map(|_| Slot {
                k: KvRows::new(kv.kind, kv.ring_elements),
                v: KvRows::new(kv.kind, kv.ring_elements),
                tokens: Vec::new(),
            }),
            blocks,
            max_ctx,
        );
        // An expert's feed-forward may be wider than the dense one (and a MoE model's dense
        // width may be unused).
        let (expert_count, expert_width) = c.experts.map_or((0, 0), |e| (e.count, e.ffn_size));
        let ffn = ffn.max(expert_width);
        let widest = h.max(qd).max(ffn);
        let b = MAX_BATCH;
        let scratch = Scratch {
            x: vec![0.0; b * h],
            xn: vec![0.0; b * widest],
            sums: vec![0.0; b * widest.div_ceil(32)],
            q8: Q8Input::default(),
            q: vec![0.0; b * qd],
            k: vec![0.0; b * kvd],
            v: vec![0.0; b * kvd],
            att: vec![0.0; b * qd],
            branch_out: vec![0.0; b * h],
            op_out: vec![0.0; b * h],
            gate: vec![0.0; b * ffn],
            up: vec![0.0; b * ffn],
            router: vec![0.0; b * expert_count],
            routes: Vec::with_capacity(b * c.experts.map_or(0, |e| e.used)),
            expert_order: Vec::with_capacity(expert_count),
            routing: None,
            moe_x: vec![0.0; if expert_count > 0 { b * widest } else { 0 }],
            moe_out: vec![0.0; if expert_count > 0 { b * h } else { 0 }],
            cos: vec![0.0; b * half.max(1)],
            sin: vec![0.0; b * half.max(1)],
            cos_local: vec![0.0; b * half.max(1)],
            sin_local: vec![0.0; b * half.max(1)],
            runs: Vec::new(),
            run_spans: Vec::with_capacity(b),
        };
        let model = Model {
            config: c.clone(),
            program,
            kv,
            inv_freq,
            local_inv_freq,
            max_ctx,
            threads,
            simd,
            q8_forms,
            f16_gelu: options.quantized_activations,
            collective,
        };
        Ok(CpuExecutor {
            model,
            pool,
            slots,
            kv: pool_kv,
            scratch,
        })
    }

    /// Worker threads of this executor's pool.
    pub fn threads(&self) -> usize {
        self.model.threads
    }

    /// Records what the Mixture-of-Experts routers choose in each forward pass from now on
    /// (`true`), or stops (`false`, the default: a pass then records nothing).
    pub fn trace_routing(&mut self, on: bool) {
        self.scratch.routing = on.then(RoutingTrace::default);
    }

    /// The routers' choices in the last forward pass (a prompt's last chunk, a decode
    /// step's rows), while [`CpuExecutor::trace_routing`] is on.
    pub fn routing(&self) -> Option<&RoutingTrace> {
        self.scratch.routing.as_ref()
    }

    fn slot_of(&self, seq: SeqId) -> Result<usize> {
        self.slots.index_of(seq)
    }

    /// Runs positions `rows[i] = (slot, position)` for `tokens[i]` through the model.
    /// The rows from `logits_from` on go to `out` (`(rows − logits_from) × width`, the
    /// width the [`Head`] says): 0 for a decode batch, the last row for a prompt, any row
    /// between for a scorer; the other rows skip the output norm and the LM head.
    fn forward(
        &mut self,
        rows: &[(usize, usize)],
        tokens: &[u32],
        logits: &mut [f32],
        logits_from: usize,
    ) {
        self.forward_to(rows, tokens, logits, logits_from, Head::Logits)
    }

    fn forward_to(
        &mut self,
        rows: &[(usize, usize)],
        tokens: &[u32],
        logits: &mut [f32],
        logits_from: usize,
        head: Head,
    ) {
        let CpuExecutor {
            model,
            pool,
            slots,
            kv,
            scratch,
        } = self;
        pool.install(|| {
            forward(
                model,
                slots.as_mut_slice(),
                kv,
                scratch,
                rows,
                tokens,
                logits,
                logits_from,
                head,
            )
        });
    }

    /// `prefill_logits` and `prefill_hidden` after their checks: `tokens` appended to the
    /// sequence in `slot`, the rows from `tokens[first]` on written to `out` as `head` says.
    fn prefill_rows(
        &mut self,
        slot: usize,
        tokens: &[u32],
        first: usize,
        out: &mut [f32],
        head: Head,
    ) -> Result<()> {
        let start = self.slots[slot].len;
        let width = match head {
            Head::Logits => self.model.config.vocab_size,
            Head::Hidden => self.model.config.hidden_size,
        };
        self.slots.reserve(slot, start + tokens.len())?;
        let mut rows = [(0usize, 0usize); MAX_BATCH];
        let mut out = out;
        let mut unscored: Option<Vec<f32>> = None;
        for (ci, chunk) in tokens.chunks(MAX_BATCH).enumerate() {
            let at = ci * MAX_BATCH;
            let pos0 = start + at;
            for (j, r) in rows[..chunk.len()].iter_mut().enumerate() {
                *r = (slot, pos0 + j);
            }
            // A chunk wholly before `first` still computes its last row's logits (the
            // forward pass always writes at least one row): into a scratch row.
            let from = first.saturating_sub(at);
            if from >= chunk.len() {
                let scratch = unscored.get_or_insert_with(|| vec![0f32; width]);
                self.forward_to(&rows[..chunk.len()], chunk, scratch, chunk.len() - 1, head);
            } else {
                let (now, rest) =
                    std::mem::take(&mut out).split_at_mut((chunk.len() - from) * width);
                self.forward_to(&rows[..chunk.len()], chunk, now, from, head);
                out = rest;
            }
            self.slots[slot].len = pos0 + chunk.len();
            self.slots[slot].cache.tokens.extend_from_slice(chunk);
        }
        Ok(())
    }
}

/// What a forward pass writes of its last rows: the logits (the LM head's output), or the
/// final hidden states (after the output norm: what embeddings pool).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Head {
    Logits,
    Hidden,
}

/// `out` = `n` applied to `x`.
fn norm(n: &Norm<Vec<f32>>, x: &[f32], out: &mut [f32]) {
    match n.kind {
        NormKind::Rms => {
            ops::rms_norm(x, &n.weight, n.eps, out);
            if let Some(b) = &n.bias {
                ops::add_in_place(out, b);
            }
        }
        NormKind::Layer => ops::layer_norm(x, &n.weight, n.bias.as_deref(), n.eps, out),
    }
}

/// The matmul input of `tokens` rows of `cols` values from `x`: their block sums, and (when
/// `quantize`) their 8-bit form, which the matrices with an integer kernel multiply.
fn batch<'a>(
    x: &'a [f32],
    sums: &'a mut [f32],
    q8: &'a mut Q8Input,
    forms: Q8Forms,
    tokens: usize,
    cols: usize,
) -> Batch<'a> {
    let x = &x[..tokens * cols];
    let ns = cols / 32;
    if cols.is_multiple_of(32) {
        block_sums(x, &mut sums[..tokens * ns]);
    }
    let q8 = match forms.any() && cols.is_multiple_of(32) {
        true => {
            q8.quantize(x, tokens, cols, forms);
            Some(&*q8)
        }
        false => None,
    };
    Batch {
        x,
        q8,
        sums: if cols.is_multiple_of(32) {
            &sums[..tokens * ns]
        } else {
            &[]
        },
        tokens,
        cols,
    }
}

fn add_bias(buf: &mut [f32], bias: &Option<Vec<f32>>) {
    if let Some(b) = bias {
        add_row_bias(buf, b);
    }
}

/// Adds `bias` to each of `buf`'s rows (rows of `bias.len()` values).
fn add_row_bias(buf: &mut [f32], bias: &[f32]) {
    for row in buf.chunks_exact_mut(bias.len()) {
        ops::add_in_place(row, bias);
    }
}

/// The query heads `qg` of one GQA group against `runs`, `heads_together` heads a task;
/// `sinks`: the group's heads' sink logits, if the layer has them.
#[allow(clippy::too_many_arguments)]
fn attend_pieces(
    simd: Option<Simd>,
    qg: &[f32],
    hd: usize,
    heads_together: usize,
    runs: &[ops::KvRun<'_>],
    stride: usize,
    offset: usize,
    scale: f32,
    sinks: Option<&[f32]>,
    out: &mut [f32],
) {
    let piece = heads_together * hd;
    qg.par_chunks(piece)
        .zip(out.par_chunks_mut(piece))
        .enumerate()
        .for_each(|(i, (qp, op))| {
            let heads = i * heads_together..i * heads_together + qp.len() / hd;
            let sinks = sinks.map(|s| &s[heads]);
            ops::attend_group(simd, qp, hd, runs, stride, offset, scale, sinks, op)
        });
}

/// Tokens of one sequence a causal attention block takes: each key and value tile is read
/// once for this many tokens (times the heads of a GQA group).
const CAUSAL_BLOCK: usize = 8;

/// A paged layer's rows for each token of a forward pass: its runs of the pool
/// ([`Scratch::runs`]) read in place (f32), or decoded a task at a time (f16, Q8_0).
struct PagedRows<'a> {
    pool: &'a KvPool,
    /// The first value of the layer's pool rows.
    base: usize,
    kvd: usize,
    hd: usize,
    runs: &'a [(usize, usize)],
    spans: &'a [std::ops::Range<usize>],
    /// Every token's runs as slices of an f32 pool (empty for other kinds).
    borrowed: Vec<ops::KvRun<'a>>,
}

impl<'a> PagedRows<'a> {
    fn new(
        pool: &'a KvPool,
        index: usize,
        kvd: usize,
        hd: usize,
        runs: &'a [(usize, usize)],
        spans: &'a [std::ops::Range<usize>],
    ) -> PagedRows<'a> {
        let base = pool.at(kvd, index, 0);
        let borrowed = match (&pool.k, &pool.v) {
            (KvRows::F32(k), KvRows::F32(v)) => runs
                .iter()
                .map(|&(row, n)| {
                    let r = base + row * kvd..base + (row + n) * kvd;
                    ops::KvRun {
                        keys: &k[r.clone()],
                        values: &v[r],
                        len: n,
                    }
                })
                .collect(),
            _ => Vec::new(),
        };
        PagedRows {
            pool,
            base,
            kvd,
            hd,
            runs,
            spans,
            borrowed,
        }
    }

    /// Runs `f(runs, stride, offset)` on token `t`'s rows of KV head `kvh`.
    fn with_runs<R>(
        &self,
        t: usize,
        kvh: usize,
        f: impl FnOnce(&[ops::KvRun<'_>], usize, usize) -> R,
    ) -> R {
        let span = self.spans[t].clone();
        if !self.borrowed.is_empty() {
            return f(&self.borrowed[span], self.kvd, kvh * self.hd);
        }
        let at = self.runs[span]
            .iter()
            .map(|&(row, n)| (self.base + row * self.kvd, n));
        let (offset, hd) = (kvh * self.hd, self.hd);
        let keys = self.pool.k.gather(at.clone(), self.kvd, offset, hd);
        let values = self.pool.v.gather(at, self.kvd, offset, hd);
        let len = keys.data.len() / hd.max(1);
        let run = [ops::KvRun {
            keys: &keys.data,
            values: &values.data,
            len,
        }];
        f(&run, keys.stride, keys.offset)
    }
}

/// A full-attention layer's attention for a prefill of `rows` (their K/V already in the
/// cache): consecutive positions of one sequence in blocks of up to [`CAUSAL_BLOCK`]
/// tokens, one task per block and KV head, each through [`ops::attend_causal`] (the bits
/// one token at a time gives). `att` gets each token's heads in place.
#[allow(clippy::too_many_arguments)]
fn attend_causal_blocks(
    m: &Model,
    paged: &PagedRows<'_>,
    rows: &[(usize, usize)],
    q: &[f32],
    att: &mut [f32],
    simd: Option<Simd>,
    scale: f32,
    sinks: Option<&[f32]>,
) {
    let c = &m.config;
    let (qd, hd) = (c.q_dim(), c.head_dim);
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
        let mut qs = Vec::with_capacity(block.len() * group * hd);
        let mut lens = Vec::with_capacity(block.len() * group);
        let mut query_sinks = Vec::new();
        for t in block.clone() {
            qs.extend_from_slice(&q[t * qd + g * group * hd..][..group * hd]);
            lens.extend(std::iter::repeat_n(rows[t].1 + 1, group));
            if let Some(s) = sinks {
                query_sinks.extend_from_slice(&s[g * group..(g + 1) * group]);
            }
        }
        let query_sinks = sinks.map(|_| query_sinks.as_slice());
        let mut out = vec![0.0f32; qs.len()];
        // The block's last token sees the rows of all the others.
        paged.with_runs(block.end - 1, g, |runs, stride, offset| {
            ops::attend_causal(
                simd,
                &qs,
                hd,
                &lens,
                runs,
                stride,
                offset,
                scale,
                query_sinks,
                &mut out,
            )
        });
        for (piece, o) in outs.into_iter().zip(out.chunks_exact(group * hd)) {
            piece.copy_from_slice(o);
        }
    });
}

#[allow(clippy::too_many_arguments)]
fn forward(
    m: &Model,
    slots: &mut [SeqSlot<Slot>],
    pool: &mut KvPool,
    s: &mut Scratch,
    rows: &[(usize, usize)],
    tokens: &[u32],
    logits: &mut [f32],
    logits_from: usize,
    head: Head,
) {
    let c = &m.config;
    let p = &m.program;
    let n = rows.len();
    let h = c.hidden_size;
    let half = c.rope.rotary_dims / 2;
    if let Some(trace) = &mut s.routing {
        trace.start(n);
    }

    for (t, &tok) in tokens.iter().enumerate() {
        let x = &mut s.x[t * h..(t + 1) * h];
        p.embedding.table.dequant_row(tok as usize, x);
        if p.embedding.scale != 1.0 {
            x.iter_mut().for_each(|v| *v *= p.embedding.scale);
        }
    }
    // Each token's rows of the paged layers, from its sequence's block table (the same for
    // every such layer): blocks that follow one another in the pool make one run.
    s.runs.clear();
    s.run_spans.clear();
    if m.kv.paged > 0 {
        for &(slot, pos) in rows {
            let first = s.runs.len();
            let mut left = pos + 1;
            for &b in slots[slot].blocks() {
                if left == 0 {
                    break;
                }
                let (row, n) = (b as usize * KV_BLOCK_TOKENS, left.min(KV_BLOCK_TOKENS));
                let fresh = s.runs.len() == first;
                match s.runs.last_mut() {
                    Some((r, len)) if !fresh && *r + *len == row => *len += n,
                    _ => s.runs.push((row, n)),
                }
                left -= n;
            }
            s.run_spans.push(first..s.runs.len());
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

    // Each branch: x += scale · post_norm(Σ op(norm(x))). The first operation writes
    // `branch_out`, a second (a parallel block's) writes `op_out`, added to it.
    for branch in &p.branches {
        for t in 0..n {
            norm(
                &branch.norm,
                &s.x[t * h..(t + 1) * h],
                &mut s.xn[t * h..(t + 1) * h],
            );
        }
        let mut sum = std::mem::take(&mut s.branch_out);
        for (j, op) in branch.ops.iter().enumerate() {
            let mut out = match j {
                0 => std::mem::take(&mut sum),
                _ => std::mem::take(&mut s.op_out),
            };
            match op {
                Op::Attention(a) => attention(m, a, slots, pool, s, rows, &mut out[..n * h]),
                Op::FeedForward(f) => {
                    feed_forward(m, f, s, n, m.config.ffn_size, &mut out[..n * h])
                }
                Op::Experts(e) => experts(m, e, s, n, &mut out[..n * h]),
            }
            match j {
                0 => sum = out,
                _ => {
                    ops::add_in_place(&mut sum[..n * h], &out[..n * h]);
                    s.op_out = out;
                }
            }
        }
        if let Some(group) = &m.collective {
            // A rank's failure ends the whole step: the driver catches the panic and
            // reports the group's error.
            if let Err(e) = group.all_reduce_sum(&mut sum[..n * h]) {
                panic!("{e}");
            }
        }
        if let Some(post) = &branch.post_norm {
            for t in 0..n {
                let row = &mut sum[t * h..(t + 1) * h];
                norm(post, row, &mut s.xn[t * h..(t + 1) * h]);
                row.copy_from_slice(&s.xn[t * h..(t + 1) * h]);
            }
        }
        if branch.scale != 1.0 {
            sum[..n * h].iter_mut().for_each(|v| *v *= branch.scale);
        }
        ops::add_in_place(&mut s.x[..n * h], &sum[..n * h]);
        s.branch_out = sum;
    }

    let first = logits_from.min(n - 1);
    let count = n - first;
    for t in first..n {
        let o = t - first;
        norm(
            &p.head.norm,
            &s.x[t * h..(t + 1) * h],
            &mut s.xn[o * h..(o + 1) * h],
        );
    }
    if head == Head::Hidden {
        logits[..count * h].copy_from_slice(&s.xn[..count * h]);
        return;
    }
    let input = batch(&s.xn, &mut s.sums, &mut s.q8, m.q8_forms, count, h);
    let Some(vocab) = &p.head.vocab_rows else {
        matmul(
            &mut [MatJob {
                m: &p.head.output,
                out: &mut *logits,
            }],
            input,
            m.threads,
            m.simd,
        );
        if p.head.logit_scale != 1.0 {
            logits.iter_mut().for_each(|v| *v *= p.head.logit_scale);
        }
        return;
    };
    // A tensor-parallel rank's rows of the vocabulary: their logits into their columns of
    // each row (the driver gathers the ranks' columns).
    let share = vocab.len();
    let mut local = vec![0f32; count * share];
    matmul(
        &mut [MatJob {
            m: &p.head.output,
            out: &mut local,
        }],
        input,
        m.threads,
        m.simd,
    );
    for (row, part) in logits
        .chunks_exact_mut(c.vocab_size)
        .zip(local.chunks_exact(share))
    {
        for (v, &l) in row[vocab.clone()].iter_mut().zip(part) {
            *v = l * p.head.logit_scale;
        }
    }
}

/// One layer's attention for the `n = rows.len()` normed rows in `s.xn`: Q/K/V, their
/// head norms and RoPE, the rows' K/V into the cache, attention over each row's span,
/// and the output projection into `out` (`n × hidden`).
fn attention(
    m: &Model,
    a: &Attention<QMatrix, Vec<f32>>,
    slots: &mut [SeqSlot<Slot>],
    pool: &mut KvPool,
    s: &mut Scratch,
    rows: &[(usize, usize)],
    out: &mut [f32],
) {
    let c = &m.config;
    let n = rows.len();
    let (h, qd, kvd, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.head_dim);
    let half = c.rope.rotary_dims / 2;
    let (threads, simd) = (m.threads, m.simd);
    let (li, span, scale) = (a.layer, a.span, a.scale);
    let (cos_all, sin_all) = match span.local_rope {
        true => (&s.cos_local, &s.sin_local),
        false => (&s.cos, &s.sin),
    };
    let input = batch(&s.xn, &mut s.sums, &mut s.q8, m.q8_forms, n, h);
    matmul(
        &mut [
            MatJob {
                m: &a.q.weight,
                out: &mut s.q[..n * qd],
            },
            MatJob {
                m: &a.k.weight,
                out: &mut s.k[..n * kvd],
            },
            MatJob {
                m: &a.v.weight,
                out: &mut s.v[..n * kvd],
            },
        ],
        input,
        threads,
        simd,
    );
    add_bias(&mut s.q[..n * qd], &a.q.bias);
    add_bias(&mut s.k[..n * kvd], &a.k.bias);
    add_bias(&mut s.v[..n * kvd], &a.v.bias);
    for t in 0..n {
        let (cos, sin) = (
            &cos_all[t * half..(t + 1) * half],
            &sin_all[t * half..(t + 1) * half],
        );
        for head in s.q[t * qd..(t + 1) * qd].chunks_exact_mut(hd) {
            if let Some(norms) = &a.head_norms {
                ops::rms_norm_in_place(head, &norms.q, norms.eps);
            }
            ops::rope(c.rope.kind, head, cos, sin);
        }
        for head in s.k[t * kvd..(t + 1) * kvd].chunks_exact_mut(hd) {
            if let Some(norms) = &a.head_norms {
                ops::rms_norm_in_place(head, &norms.k, norms.eps);
            }
            ops::rope(c.rope.kind, head, cos, sin);
        }
        let (slot, pos) = rows[t];
        let (k, v) = (&s.k[t * kvd..(t + 1) * kvd], &s.v[t * kvd..(t + 1) * kvd]);
        match m.kv.layers[li] {
            LayerRows::Paged { index } => {
                let at = pool.at(kvd, index, pool_row(slots[slot].blocks(), pos));
                pool.k.write(at, k);
                pool.v.write(at, v);
            }
            LayerRows::Ring { rows, base } => {
                let at = base + (pos % rows) * kvd;
                slots[slot].k.write(at, k);
                slots[slot].v.write(at, v);
            }
        }
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
    let att = &mut s.att[..n * qd];
    let sinks = a.sinks.as_deref();
    // KV head g's query heads' sinks.
    let group_sinks = |g: usize| sinks.map(|s| &s[g * group..(g + 1) * group]);
    match m.kv.layers[li] {
        LayerRows::Paged { index } => {
            let paged = PagedRows::new(pool, index, kvd, hd, &s.runs, &s.run_spans);
            if n.div_ceil(CAUSAL_BLOCK) * kv_heads >= 2 * threads {
                // A prefill: runs of consecutive tokens of one sequence go through a
                // full layer as causal blocks (one task per block and KV head), each key
                // and value tile read once for the block's tokens and heads (see
                // `ops::attend_causal`).
                attend_causal_blocks(m, &paged, rows, q, att, simd, scale, sinks);
            } else {
                att.par_chunks_mut(group * hd)
                    .enumerate()
                    .for_each(|(i, out)| {
                        let (t, kvh) = (i / kv_heads, i % kv_heads);
                        let qg = &q[t * qd + kvh * group * hd..][..group * hd];
                        paged.with_runs(t, kvh, |runs, stride, offset| {
                            attend_pieces(
                                simd,
                                qg,
                                hd,
                                heads_together,
                                runs,
                                stride,
                                offset,
                                scale,
                                group_sinks(kvh),
                                out,
                            )
                        });
                    });
            }
        }
        LayerRows::Ring { rows: ring, base } => {
            att.par_chunks_mut(group * hd)
                .enumerate()
                .for_each(|(i, out)| {
                    let (t, kvh) = (i / kv_heads, i % kv_heads);
                    let (slot, pos) = rows[t];
                    let kv = &cache[slot];
                    // A windowed layer sees only the last `window` positions.
                    let heads =
                        m.kv.ring_runs(ring, base, span.first_position(pos), pos)
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
                    attend_pieces(
                        simd,
                        qg,
                        hd,
                        heads_together,
                        &runs,
                        stride,
                        offset,
                        scale,
                        group_sinks(kvh),
                        out,
                    );
                });
        }
    }

    let input = batch(&s.att, &mut s.sums, &mut s.q8, m.q8_forms, n, qd);
    matmul(
        &mut [MatJob {
            m: &a.out.weight,
            out: &mut *out,
        }],
        input,
        threads,
        simd,
    );
    add_bias(out, &a.out.bias);
}

/// The feed-forward `f` of width `ffn` over the first `n` rows of `s.xn`, into `out`
/// (`n × hidden`).
fn feed_forward(
    m: &Model,
    f: &FeedForward<QMatrix, Vec<f32>>,
    s: &mut Scratch,
    n: usize,
    ffn: usize,
    out: &mut [f32],
) {
    let h = m.config.hidden_size;
    let (threads, simd) = (m.threads, m.simd);
    let input = batch(&s.xn, &mut s.sums, &mut s.q8, m.q8_forms, n, h);
    match &f.gate {
        Some(gate) => matmul(
            &mut [
                MatJob {
                    m: gate,
                    out: &mut s.gate[..n * ffn],
                },
                MatJob {
                    m: &f.up,
                    out: &mut s.up[..n * ffn],
                },
            ],
            input,
            threads,
            simd,
        ),
        None => matmul(
            &mut [MatJob {
                m: &f.up,
                out: &mut s.up[..n * ffn],
            }],
            input,
            threads,
            simd,
        ),
    }
    let biases = f.biases.as_ref();
    if let Some(b) = biases {
        add_row_bias(&mut s.up[..n * ffn], &b.up);
    }
    let act = f.activation;
    let f16_gelu = m.f16_gelu && act == Activation::Gelu;
    if f.gate.is_some() {
        if let Some(gate_bias) = biases.and_then(|b| b.gate.as_ref()) {
            add_row_bias(&mut s.gate[..n * ffn], gate_bias);
        }
        for (u, &g) in s.up[..n * ffn].iter_mut().zip(&s.gate[..n * ffn]) {
            *u = if f16_gelu {
                ops::gelu_as_ggml_cpu(g) * *u
            } else {
                act.gated(g, *u)
            };
        }
    } else {
        for u in s.up[..n * ffn].iter_mut() {
            *u = if f16_gelu {
                ops::gelu_as_ggml_cpu(*u)
            } else {
                act.ungated(*u)
            };
        }
    }
    let input = batch(&s.up, &mut s.sums, &mut s.q8, m.q8_forms, n, ffn);
    matmul(
        &mut [MatJob {
            m: &f.down,
            out: &mut *out,
        }],
        input,
        threads,
        simd,
    );
    if let Some(b) = biases {
        add_row_bias(&mut out[..n * m.config.hidden_size], &b.down);
    }
}

/// What each Mixture-of-Experts layer's router chose for each row of a forward pass, and
/// how narrowly: two executors whose numbers differ by rounding choose different experts
/// where a row's `used`-th and next logits lie that close, and the row's output then moves
/// by a whole expert's share — the parity tests read this to tell such a step from an error.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RoutingTrace {
    rows: usize,
    /// Per MoE layer and row, in order: the chosen experts, ascending.
    chosen: Vec<Vec<u32>>,
    /// Per MoE layer and row: the `used`-th largest logit less the next, over the range of
    /// the row's logits (0 for a tie; 1 when every expert is used).
    margins: Vec<f32>,
}

impl RoutingTrace {
    fn start(&mut self, rows: usize) {
        self.rows = rows;
        self.chosen.clear();
        self.margins.clear();
    }

    /// One row's router logits and their order (largest first), `used` of them chosen.
    fn record(&mut self, logits: &[f32], order: &[usize], used: usize) {
        let mut chosen: Vec<u32> = order[..used].iter().map(|&e| e as u32).collect();
        chosen.sort_unstable();
        self.chosen.push(chosen);
        self.margins.push(routing_margin(logits, order, used));
    }

    /// Rows of the pass.
    pub fn rows(&self) -> usize {
        self.rows
    }

    /// Mixture-of-Experts layers the pass ran.
    pub fn layers(&self) -> usize {
        self.margins.len().checked_div(self.rows).unwrap_or(0)
    }

    /// The experts layer `layer` chose for row `row`, ascending.
    pub fn chosen(&self, layer: usize, row: usize) -> &[u32] {
        &self.chosen[layer * self.rows + row]
    }

    /// Layer `layer`'s margin for row `row` (see [`RoutingTrace`]).
    pub fn margin(&self, layer: usize, row: usize) -> f32 {
        self.margins[layer * self.rows + row]
    }

    /// Layers whose margin for row `row` is under `tie`: where another executor's rounding
    /// could choose another expert for it.
    pub fn near_ties(&self, row: usize, tie: f32) -> usize {
        (0..self.layers())
            .filter(|&l| self.margin(l, row) < tie)
            .count()
    }

    /// The narrowest margin of row `row` over every layer (1 with no MoE layer): how close
    /// the row came to choosing another expert.
    pub fn min_margin(&self, row: usize) -> f32 {
        self.margins
            .iter()
            .skip(row)
            .step_by(self.rows.max(1))
            .fold(1.0, |a, &b| a.min(b))
    }
}

/// The gap between the `used`-th largest logit and the next as a share of the logits'
/// range: 0 for a tie at the boundary, 1 when nothing is left out (or all are equal and
/// every one is used). NaN logits give 0 (no choice is safe).
fn routing_margin(logits: &[f32], order: &[usize], used: usize) -> f32 {
    if used == 0 || used >= logits.len() {
        return 1.0;
    }
    if logits.iter().any(|l| l.is_nan()) {
        return 0.0;
    }
    let (lo, hi) = logits
        .iter()
        .fold((f32::INFINITY, f32::NEG_INFINITY), |(lo, hi), &l| {
            (lo.min(l), hi.max(l))
        });
    let (gap, range) = (logits[order[used - 1]] - logits[order[used]], hi - lo);
    if range > 0.0 && range.is_finite() {
        gap / range
    } else {
        0.0
    }
}

/// One row's use of one expert: the expert's output for that row joins the row's sum
/// multiplied by `weight`.
#[derive(Debug, Clone, Copy)]
struct Route {
    expert: usize,
    row: usize,
    weight: f32,
}

/// Row `row`'s routes from its router logits: the softmax over every expert, the `used`
/// most probable (equal probabilities to the lower index, as `torch.topk` returns them),
/// their probabilities divided by their sum when `normalize`. A NaN logit makes every
/// weight NaN, so it reaches the output rather than being routed around.
fn route(
    logits: &[f32],
    used: usize,
    normalize: bool,
    row: usize,
    order: &mut Vec<usize>,
    routes: &mut Vec<Route>,
) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, |a, b| {
        if a.is_nan() || b.is_nan() {
            f32::NAN
        } else {
            a.max(b)
        }
    });
    let total: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    order.clear();
    order.extend(0..logits.len());
    order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]).then(a.cmp(&b)));
    let chosen = &order[..used];
    let probability = |e: usize| (logits[e] - max).exp() / total;
    let norm = match normalize {
        true => chosen.iter().map(|&e| probability(e)).sum::<f32>(),
        false => 1.0,
    };
    routes.extend(chosen.iter().map(|&expert| Route {
        expert,
        row,
        weight: probability(expert) / norm,
    }));
}

/// A Mixture of Experts over the first `n` rows of `s.xn`: the router picks each row's
/// experts, then each expert runs once on all the rows that chose it (its matrices read
/// once for the batch), and its outputs join those rows weighted. Each row sums its
/// experts in expert order, as transformers' loop over experts does.
fn experts(m: &Model, e: &Experts<QMatrix, Vec<f32>>, s: &mut Scratch, n: usize, out: &mut [f32]) {
    let h = m.config.hidden_size;
    let count = e.experts.len();
    let width = m.config.experts.map_or(0, |x| x.ffn_size);
    let input = batch(&s.xn, &mut s.sums, &mut s.q8, m.q8_forms, n, h);
    matmul(
        &mut [MatJob {
            m: &e.router.weight,
            out: &mut s.router[..n * count],
        }],
        input,
        m.threads,
        m.simd,
    );
    add_bias(&mut s.router[..n * count], &e.router.bias);
    let mut routes = std::mem::take(&mut s.routes);
    routes.clear();
    for row in 0..n {
        let logits = &s.router[row * count..(row + 1) * count];
        route(
            logits,
            e.used,
            e.normalize,
            row,
            &mut s.expert_order,
            &mut routes,
        );
        if let Some(trace) = &mut s.routing {
            trace.record(logits, &s.expert_order, e.used);
        }
    }
    routes.sort_by_key(|r| (r.expert, r.row));

    out[..n * h].fill(0.0);
    // The experts' groups take `xn`'s place as the feed-forward's input; the normed rows
    // wait in `moe_x`.
    std::mem::swap(&mut s.xn, &mut s.moe_x);
    let mut group_out = std::mem::take(&mut s.moe_out);
    for group in routes.chunk_by(|a, b| a.expert == b.expert) {
        let k = group.len();
        for (j, r) in group.iter().enumerate() {
            s.xn[j * h..(j + 1) * h].copy_from_slice(&s.moe_x[r.row * h..(r.row + 1) * h]);
        }
        feed_forward(
            m,
            &e.experts[group[0].expert],
            s,
            k,
            width,
            &mut group_out[..k * h],
        );
        for (j, r) in group.iter().enumerate() {
            let dst = &mut out[r.row * h..(r.row + 1) * h];
            for (d, &v) in dst.iter_mut().zip(&group_out[j * h..(j + 1) * h]) {
                *d += r.weight * v;
            }
        }
    }
    std::mem::swap(&mut s.xn, &mut s.moe_x);
    s.moe_out = group_out;
    s.routes = routes;
}

impl LayerExecutor for CpuExecutor {
    fn config(&self) -> &ModelConfig {
        &self.model.config
    }

    fn kv_type(&self) -> Option<KvType> {
        Some(self.model.kv.kind)
    }

    fn kv_blocks(&self) -> Option<KvBlockUsage> {
        let (total, free) = self.slots.block_counts();
        Some(KvBlockUsage {
            block_tokens: KV_BLOCK_TOKENS,
            total,
            free,
            block_bytes: self.model.kv.block_bytes,
        })
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
        let m = &self.model;
        if m.kv.truncation_loses_rows(&m.config, m.max_ctx, old, len) {
            // A windowed layer's ring no longer holds positions the next token attends to,
            // and those depend on earlier ones: the kept prefix is run again (a cut by at
            // most MAX_BATCH positions, or of a short sequence, never gets here). The
            // sequence keeps the blocks of its kept positions, so this takes none.
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
        // Blocks for the whole prompt before any of it runs: a pool without room for it
        // refuses it whole (KvCacheFull), leaving the sequence as it was.
        self.slots.reserve(slot, start + tokens.len())?;
        let mut rows = [(0usize, 0usize); MAX_BATCH];
        for (ci, chunk) in tokens.chunks(MAX_BATCH).enumerate() {
            let pos0 = start + ci * MAX_BATCH;
            for (j, r) in rows[..chunk.len()].iter_mut().enumerate() {
                *r = (slot, pos0 + j);
            }
            self.forward(&rows[..chunk.len()], chunk, logits, chunk.len() - 1);
            self.slots[slot].len = pos0 + chunk.len();
            self.slots[slot].cache.tokens.extend_from_slice(chunk);
        }
        Ok(())
    }

    fn prefill_logits(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        first: usize,
        logits: &mut [f32],
    ) -> Result<()> {
        let slot = self.slot_of(seq)?;
        let start = self.slots[slot].len;
        let vocab = self.model.config.vocab_size;
        check_prefill_logits(tokens, first, logits, vocab, start, self.model.max_ctx)?;
        self.prefill_rows(slot, tokens, first, logits, Head::Logits)
    }

    fn prefill_hidden(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        first: usize,
        hidden: &mut [f32],
    ) -> Result<()> {
        let slot = self.slot_of(seq)?;
        let start = self.slots[slot].len;
        let c = &self.model.config;
        check_prefill_hidden(
            tokens,
            first,
            hidden,
            c.hidden_size,
            c.vocab_size,
            start,
            self.model.max_ctx,
        )?;
        self.prefill_rows(slot, tokens, first, hidden, Head::Hidden)
    }

    fn prefill_hidden_batch(
        &mut self,
        items: &[HiddenRequest<'_>],
        hidden: &mut [f32],
    ) -> Result<()> {
        let c = &self.model.config;
        let width = c.hidden_size;
        let shares = check_hidden_batch(items, hidden.len(), width)?;
        // Every item checked and its blocks taken before any row runs: a refused batch
        // changes nothing.
        let mut wants = Vec::with_capacity(items.len());
        let mut outs = Vec::with_capacity(items.len());
        let mut rest = &mut *hidden;
        for (item, share) in items.iter().zip(shares) {
            let slot = self.slot_of(item.seq)?;
            let start = self.slots[slot].len;
            let (out, after) = std::mem::take(&mut rest).split_at_mut(share);
            check_prefill_hidden(
                item.tokens,
                item.first,
                out,
                width,
                c.vocab_size,
                start,
                self.model.max_ctx,
            )?;
            wants.push((slot, start + item.tokens.len()));
            outs.push(out);
            rest = after;
        }
        self.slots.reserve_all(&wants)?;
        // The items' rows one after another, cut into passes of up to MAX_BATCH rows
        // whatever sequence they belong to (each row attends within its own sequence).
        // (item, its slot, the row's position, its index in the item's tokens)
        let rows: Vec<(usize, usize, usize, usize)> = items
            .iter()
            .zip(&wants)
            .enumerate()
            .flat_map(|(i, (item, &(slot, end)))| {
                let start = end - item.tokens.len();
                (0..item.tokens.len()).map(move |j| (i, slot, start + j, j))
            })
            .collect();
        let mut states = vec![0f32; MAX_BATCH * width];
        for pass in rows.chunks(MAX_BATCH) {
            let at: Vec<(usize, usize)> =
                pass.iter().map(|&(_, slot, pos, _)| (slot, pos)).collect();
            let tokens: Vec<u32> = pass
                .iter()
                .map(|&(i, _, _, j)| items[i].tokens[j])
                .collect();
            let states = &mut states[..pass.len() * width];
            self.forward_to(&at, &tokens, states, 0, Head::Hidden);
            for ((&(i, slot, pos, j), state), &token) in
                pass.iter().zip(states.chunks(width)).zip(&tokens)
            {
                if let Some(row) = j.checked_sub(items[i].first) {
                    outs[i][row * width..(row + 1) * width].copy_from_slice(state);
                }
                self.slots[slot].len = pos + 1;
                self.slots[slot].cache.tokens.push(token);
            }
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
        // Every item's next position needs room in its blocks: taken for the whole batch at
        // once, or (KvCacheFull) for none of it, before any of it runs.
        let wants = batch
            .iter()
            .map(|item| {
                let slot = self.slot_of(item.seq)?;
                Ok((slot, self.slots[slot].len + 1))
            })
            .collect::<Result<Vec<_>>>()?;
        self.slots.reserve_all(&wants)?;
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
            self.forward(&rows[..items.len()], &toks[..items.len()], out, 0);
            for (&(slot, _), &token) in rows[..items.len()].iter().zip(&toks) {
                self.slots[slot].len += 1;
                self.slots[slot].cache.tokens.push(token);
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn margin_of(logits: &[f32], used: usize) -> f32 {
        let (mut order, mut routes) = (Vec::new(), Vec::new());
        route(logits, used, true, 0, &mut order, &mut routes);
        routing_margin(logits, &order, used)
    }

    #[test]
    fn routing_margin_is_the_boundary_gap_over_the_logits_range() {
        // Order 0, 2 | 1, 3: the second chosen (2.0) less the first left out (1.0), over 3.
        assert_eq!(margin_of(&[3.0, 1.0, 2.0, 0.0], 2), 1.0 / 3.0);
        assert_eq!(margin_of(&[3.0, 1.0, 2.0, 0.0], 1), 1.0 / 3.0);
        assert_eq!(
            margin_of(&[0.5, 2.0, 2.0, -1.0], 1),
            0.0,
            "a tie at the boundary"
        );
        assert_eq!(
            margin_of(&[0.5, 2.0, 2.0, -1.0], 4),
            1.0,
            "every expert used"
        );
        assert_eq!(margin_of(&[1.0, 1.0, 1.0], 1), 0.0, "all equal");
        assert_eq!(margin_of(&[1.0, f32::NAN, 0.0], 1), 0.0, "a NaN logit");
        let wide = margin_of(&[1e30, -1e30, f32::INFINITY], 1);
        assert_eq!(wide, 0.0, "an infinite range");
    }

    #[test]
    fn a_trace_keeps_each_layers_choices_and_each_rows_narrowest_margin() {
        let mut trace = RoutingTrace::default();
        trace.start(2);
        let mut order = Vec::new();
        for logits in [
            [0.0, 4.0, 1.0, 3.0],
            [2.0, 0.0, 1.0, 1.5],
            [0.0, 1.0, 0.9, 0.5],
            [4.0, 0.0, 0.0, 0.0],
        ] {
            route(&logits, 2, true, 0, &mut order, &mut Vec::new());
            trace.record(&logits, &order, 2);
        }
        assert_eq!((trace.rows(), trace.layers()), (2, 2));
        assert_eq!(trace.chosen(0, 0), &[1, 3]);
        assert_eq!(trace.chosen(0, 1), &[0, 3]);
        assert_eq!(trace.chosen(1, 0), &[1, 2]);
        assert_eq!(trace.chosen(1, 1), &[0, 1]);
        // Row 0: 2/4 in layer 0, 0.4/1 in layer 1; row 1: 0.5/2, then a tie at 0.
        assert!((trace.min_margin(0) - 0.4).abs() < 1e-6);
        assert_eq!(trace.min_margin(1), 0.0);
        assert_eq!(
            (
                trace.near_ties(0, 0.45),
                trace.near_ties(0, 0.5),
                trace.near_ties(0, 0.6)
            ),
            (1, 1, 2)
        );
        assert_eq!((trace.near_ties(1, 1e-9), trace.near_ties(1, 0.3)), (1, 2));
        trace.start(1);
        assert_eq!((trace.layers(), trace.min_margin(0)), (0, 1.0));
    }
}
