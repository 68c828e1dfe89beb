//! The GPU-resident executor: weights, KV caches and one workspace allocated at load. A
//! one-sequence decode step is one CUDA graph replay ([`GpuExecutor::queue_step`]); a
//! batch of sequences decodes in one step of its own graph (`batch.rs`); the batched
//! prefill is in `prefill.rs`.

use std::sync::Arc;

use kiln_core::program::{self, Op};
use kiln_core::{
    check_decode, check_decode_items, Activation, DecodeItem, Error, KvType, LayerExecutor,
    LoadOptions, ModelConfig, ModelIr, NormKind, Result, RopeKind, Sampler, SeqId, SequenceSlots,
    TensorView,
};
// A child module, so the batched prefill shares the executor's private state.
#[path = "batch.rs"]
mod batch;
#[path = "experts.rs"]
mod experts;
#[path = "prefill.rs"]
mod prefill;
pub use batch::SHORT_PREFILL;
use experts::{DeviceExperts, ExpertBuffers};
pub use prefill::{PrefillTimes, CHUNK as PREFILL_CHUNK};

use kiln_kernels::{
    AttnArgs, AttnHeads, Carver, DevSlice, Device, DeviceBuffer, DeviceWeight, Epilogue, GemvInput,
    GemvPath, GemvTiling, Graph, Kernels, KvCache, KvFormat, KvLayerRows, PendingNorm, Q8Act,
    QuantOut, RopeArgs, WeightFormat, Workspace,
};

use crate::GpuPolicy;

/// Why the GPU runtime, with `policy`'s weight formats, cannot run `model`, if it cannot.
pub fn check_model(model: &ModelIr, policy: &dyn GpuPolicy) -> Result<(), String> {
    let program = program::build(model).map_err(|e| e.to_string())?;
    check_program(model, &program, policy)
}

/// [`check_model`] of a model whose program is built.
fn check_program(
    model: &ModelIr,
    program: &program::ModelProgram<TensorView>,
    policy: &dyn GpuPolicy,
) -> Result<(), String> {
    let name = policy.backend_name();
    let c = &model.config;
    if !c.head_dim.is_multiple_of(32) || c.head_dim > 256 {
        return Err(format!(
            "head_dim {} ({name} needs a multiple of 32 up to 256)",
            c.head_dim
        ));
    }
    // The kernels that update the residual stream fold the next RMSNorm into it (see
    // `queue_step`): every norm must be an RMSNorm without a bias.
    let rms = |n: &program::Norm<TensorView>| n.kind == NormKind::Rms && n.bias.is_none();
    if !rms(&program.head.norm) {
        return Err(format!(
            "{name} runs RMSNorm models (without norm biases) only"
        ));
    }
    for (i, b) in program.branches.iter().enumerate() {
        let Some(op) = b.single_op() else {
            return Err(format!(
                "{name} does not run parallel blocks (branch {i} sums {} operations)",
                b.ops.len()
            ));
        };
        if !rms(&b.norm) || b.post_norm.as_ref().is_some_and(|n| !rms(n)) {
            return Err(format!(
                "{name} runs RMSNorm models (without norm biases) only"
            ));
        }
        if b.scale != 1.0 && b.post_norm.is_some() {
            return Err(format!(
                "{name} does not scale branches with a post-norm (branch {i})"
            ));
        }
        match op {
            Op::Attention(_) => {}
            Op::FeedForward(f) => check_feed_forward(name, f)?,
            Op::Experts(e) => {
                if e.experts.len() > kiln_kernels::MAX_EXPERTS {
                    return Err(format!(
                        "{name} runs at most {} experts a layer ({} here)",
                        kiln_kernels::MAX_EXPERTS,
                        e.experts.len()
                    ));
                }
                if e.used > kiln_kernels::MAX_EXPERTS_USED {
                    return Err(format!(
                        "{name} runs at most {} experts a token ({} here)",
                        kiln_kernels::MAX_EXPERTS_USED,
                        e.used
                    ));
                }
                for f in &e.experts {
                    check_expert(name, f)?;
                }
            }
        }
    }
    let mut unsupported: Vec<String> = model
        .weights
        .tensors()
        .into_iter()
        .filter(|t| t.dims().len() >= 2 && policy.format_for(t.qtype(), t.row_len()).is_none())
        .map(|t| t.qtype().name().to_string())
        .collect();
    unsupported.sort();
    unsupported.dedup();
    if !unsupported.is_empty() {
        return Err(format!("{name} has no GEMV for {}", unsupported.join(", ")));
    }
    Ok(())
}

/// Why `name` cannot run the feed-forward `f` (a dense one or an expert), if it cannot.
fn check_feed_forward(name: &str, f: &program::FeedForward<TensorView>) -> Result<(), String> {
    if f.gate.is_none() || !matches!(f.activation, Activation::Silu | Activation::Gelu) {
        return Err(format!(
            "{name} runs gated feed-forwards (SwiGLU, GeGLU) only"
        ));
    }
    if f.biases.is_some() {
        return Err(format!("{name} runs feed-forwards without biases only"));
    }
    Ok(())
}

/// The experts' gate and up biases as the gated GEMVs and grouped matmuls read them: each
/// expert's gate rows' biases (zeros where it has none), then its up rows'; `None` when no
/// expert has biases.
fn expert_gate_up_biases(e: &program::Experts<TensorView>) -> Result<Option<Vec<f32>>> {
    if e.experts.iter().all(|f| f.biases.is_none()) {
        return Ok(None);
    }
    let mut v = Vec::new();
    for f in &e.experts {
        let width = f.up.rows();
        match &f.biases {
            Some(b) => {
                match &b.gate {
                    Some(g) => v.extend(vector(g, width, "expert gate bias")?),
                    None => v.extend(std::iter::repeat_n(0.0, width)),
                }
                v.extend(vector(&b.up, width, "expert up bias")?);
            }
            None => v.extend(std::iter::repeat_n(0.0, 2 * width)),
        }
    }
    Ok(Some(v))
}

/// The experts' down-projection biases, `hidden` an expert, expert after expert; `None`
/// when no expert has biases.
fn expert_down_biases(e: &program::Experts<TensorView>, hidden: usize) -> Result<Option<Vec<f32>>> {
    if e.experts.iter().all(|f| f.biases.is_none()) {
        return Ok(None);
    }
    let mut v = Vec::with_capacity(e.experts.len() * hidden);
    for f in &e.experts {
        match &f.biases {
            Some(b) => v.extend(vector(&b.down, hidden, "expert down bias")?),
            None => v.extend(std::iter::repeat_n(0.0, hidden)),
        }
    }
    Ok(Some(v))
}

/// Why `name` cannot run the expert `f`, if it cannot: experts are gated, and may have
/// biases and gpt-oss's clamped activation (their GEMVs and grouped matmuls take both).
fn check_expert(name: &str, f: &program::FeedForward<TensorView>) -> Result<(), String> {
    if f.gate.is_none() {
        return Err(format!("{name} runs gated experts only"));
    }
    Ok(())
}

/// The device formats `model`'s matrices take under `policy` (checked by `check_model`).
fn formats_of(model: &ModelIr, policy: &dyn GpuPolicy) -> Vec<&'static WeightFormat> {
    let mut v: Vec<&'static WeightFormat> = model
        .weights
        .tensors()
        .into_iter()
        .filter(|t| t.dims().len() >= 2)
        .filter_map(|t| policy.format_for(t.qtype(), t.row_len()))
        .collect();
    v.sort_by_key(|f| f.tag);
    v.dedup_by_key(|f| f.tag);
    v
}

fn vector(t: &TensorView, len: usize, what: &str) -> Result<Vec<f32>> {
    let v = t.to_f32()?;
    if v.len() != len {
        return Err(Error::Format(format!(
            "{what} ({}) holds {} values, {len} expected",
            t.name(),
            v.len()
        )));
    }
    Ok(v)
}

fn err(e: kiln_kernels::KernelError) -> Error {
    e.into()
}

/// Context length from which the one-sequence step computes the heads of a GQA group in
/// pairs: the point where that measured faster on an H200 (see attention.cu; below it the
/// launch's latency, not the cache read, decides).
const PAIRED_ATTENTION_FROM: usize = 16_384;

/// Context length from which the one-sequence step computes a whole GQA group a block on
/// tensor cores ([`AttnHeads::Group`], where the shape allows; pairs otherwise), each K/V
/// row read once for the group. Measured on an H200 (tg128, docs/benchmarks.md): with
/// 64-wide heads the group kernel loses 0.5% at 2,048 positions and wins 7% at 4,096; with
/// 128-wide heads it loses 10% at 2,048 and 1% at 4,096 and wins 5% at 8,192, its larger
/// tile costing more per block before the cache read dominates.
pub fn group_attention_from(head_dim: usize) -> usize {
    if head_dim <= 64 {
        4_096
    } else {
        8_192
    }
}

/// What a captured decode step's attention launches are: the least positions a split
/// block takes, the split blocks per head of their grid (a power of two, or the cache's
/// full grid; [`Kernels::attention_grid_splits`], computed from that least split) and
/// how the heads of a GQA group share blocks. A step replays the graph of the shape its
/// context needs; each shape's graph is captured when first needed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct StepShape {
    /// The same for every shape of one kind of step (one sequence, or a batch), so it
    /// takes no part in [`StepShape::index`].
    pub(crate) split: usize,
    pub(crate) splits: usize,
    pub(crate) heads: AttnHeads,
}

impl StepShape {
    /// Shapes a cache of any size can need: grids 1, 2, 4, … and the full one (at most
    /// [`Kernels::MAX_ATTENTION_SPLITS`]), each with each [`AttnHeads`].
    pub(crate) const COUNT: usize =
        3 * (Kernels::MAX_ATTENTION_SPLITS.next_power_of_two().ilog2() as usize + 1);

    /// This shape's place among [`StepShape::COUNT`] (grids are powers of two below the
    /// full grid, so ⌈log2⌉ tells them apart).
    pub(crate) fn index(self) -> usize {
        let heads = match self.heads {
            AttnHeads::One => 0,
            AttnHeads::Pairs => 1,
            AttnHeads::Group => 2,
        };
        3 * self.splits.next_power_of_two().ilog2() as usize + heads
    }
}

/// Replays `graph` `replays` times back to back, timed with events; the median in ms.
fn median_replay_ms(device: &Arc<Device>, graph: &Graph, replays: usize) -> Result<f64> {
    median_ms(device, replays, || graph.launch().map_err(err))
}

/// Runs `queue` `replays` times back to back, each timed with events; the median in ms.
fn median_ms(device: &Arc<Device>, replays: usize, queue: impl Fn() -> Result<()>) -> Result<f64> {
    let (a, b) = (
        kiln_kernels::Event::new(device).map_err(err)?,
        kiln_kernels::Event::new(device).map_err(err)?,
    );
    let mut times = Vec::with_capacity(replays.max(1));
    for _ in 0..replays.max(1) {
        a.record().map_err(err)?;
        queue()?;
        b.record().map_err(err)?;
        times.push(a.elapsed_ms(&b).map_err(err)? as f64);
    }
    times.sort_by(|x, y| x.total_cmp(y));
    Ok(times[times.len() / 2])
}

/// A projection: one weight, written at `offset` of its output vector.
struct Proj {
    w: DeviceWeight,
    offset: usize,
}

/// A program's attention on the device (see [`program::Attention`]).
struct DeviceAttention {
    /// The layer of the KV cache it reads and writes.
    layer: usize,
    /// Q, K and V: one stacked weight per run of neighbours of one type (one when all
    /// three agree).
    qkv: Vec<Proj>,
    qkv_bias: Option<DeviceBuffer<f32>>,
    q_norm: Option<DeviceBuffer<f32>>,
    k_norm: Option<DeviceBuffer<f32>>,
    o: DeviceWeight,
    /// The output projection's bias (gpt-oss), added as O joins the residual stream.
    o_bias: Option<DeviceBuffer<f32>>,
    /// A logit a query head that joins its softmax and attends to nothing (gpt-oss).
    sinks: Option<DeviceBuffer<f32>>,
    /// Positions a query attends to (0: all; a sliding-window layer's window).
    window: usize,
    /// A sliding-window layer rotates with the local RoPE base.
    local_rope: bool,
    scale: f32,
}

/// A program's gated feed-forward on the device (see [`program::FeedForward`]).
struct DeviceFeedForward {
    gate: DeviceWeight,
    up: DeviceWeight,
    down: DeviceWeight,
    gelu: bool,
}

impl DeviceFeedForward {
    /// The gated activation its GEMVs apply (dense feed-forwards are SwiGLU or GeGLU).
    fn act(&self) -> kiln_kernels::GatedAct {
        match self.gelu {
            true => kiln_kernels::GatedAct::Gelu,
            false => kiln_kernels::GatedAct::Silu,
        }
    }
}

enum DeviceOp {
    Attention(DeviceAttention),
    FeedForward(DeviceFeedForward),
    Experts(DeviceExperts),
}

/// A program's branch on the device: `x += scale · post_norm(op(norm(x)))` (every norm an
/// RMSNorm, checked by `check_model`).
struct DeviceBranch {
    norm: DeviceBuffer<f32>,
    op: DeviceOp,
    /// Gemma's sandwich norm on the op's output before it joins the residual.
    post_norm: Option<DeviceBuffer<f32>>,
    /// Granite's residual multiplier (`None`: 1); never beside a post-norm (`check_model`).
    scale: Option<f32>,
}

/// One sequence's step state (its KV cache is slot `i` of the executor's pool, `i` its
/// index among the slots).
struct Slot {
    /// [token, position, context length, uniform (f32 bits)] read by the graph.
    state: DeviceBuffer<i32>,
    /// The step's graph for each [`StepShape`] (by [`StepShape::index`]) it has needed.
    graphs: [Option<Graph>; StepShape::COUNT],
    /// The tokens at positions 0..len (what a truncation recomputes sliding-window rings
    /// from; see `truncate_sequence`).
    tokens: Vec<u32>,
}

impl Slot {
    /// Records `tokens` at positions `pos..` (forgetting any after them).
    fn record(&mut self, pos: usize, tokens: &[u32]) {
        self.tokens.truncate(pos);
        self.tokens.extend_from_slice(tokens);
    }
}

/// Activations of one step, carved from one workspace.
struct Scratch {
    /// The residual stream (f32).
    x: DevSlice<f32>,
    /// The residual stream times the next RMSNorm's weight, quantised: what the QKV,
    /// gate/up and LM-head GEMVs read, their norm finished from `sum_sq` (see PendingNorm).
    xq: Q8Act,
    /// The attention output, quantised for the output projection.
    aq: Q8Act,
    /// A block's output before its sandwich norm (models with post-norms).
    proj: DevSlice<f32>,
    /// The SwiGLU output, quantised for the down projection.
    hq: Q8Act,
    /// A Mixture of Experts' buffers (empty for dense models), for the decode step, the
    /// batched step and the prefill, which never run at once.
    moe: ExpertBuffers,
    /// For each RMSNorm of a step (two per layer, then the output norm), Σx² per 32-value
    /// group of the hidden vector, written by the kernels that write `xq`.
    norm_parts: DevSlice<f32>,
    /// The attention's per-head split counters: zeroed at load, left zero by each launch.
    attn_counters: DevSlice<u32>,
    qkv: DevSlice<f32>,
    q: DevSlice<f32>,
    attn: DevSlice<f32>,
    ffn: DevSlice<f32>,
    logits: DevSlice<f32>,
    part_o: DevSlice<f32>,
    part_ml: DevSlice<[f32; 2]>,
    keys: DevSlice<u64>,
    cand: DevSlice<u64>,
    rng: DevSlice<u64>,
    token_out: DevSlice<i32>,
}

/// The kernels a GPU step chooses between, as one value ([`GpuExecutor::variants`],
/// [`GpuExecutor::set_variants`]). The executor's own choice is the fastest measured
/// (docs/benchmarks.md); the others stay to measure and check beside it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct StepVariants {
    /// How the GEMVs read activations: `Q16` (15 bits) by default, `Q8` (llama.cpp's Q8_1)
    /// with `LoadOptions::quantized_activations`.
    pub gemv_path: GemvPath,
    /// A tiling forced on the GEMVs that quantise their output (one of
    /// `GemvTiling::quantising()`, on every weight whose format allows it); `None`: the
    /// policy's per weight.
    pub quant_tiling: Option<GemvTiling>,
    /// O / SwiGLU / down weights up to this many bytes quantise their own output; larger
    /// ones take a separate launch. Unlimited by default.
    pub fuse_limit: usize,
    /// Context from which one-sequence attention takes a GQA group a block on tensor cores
    /// ([`group_attention_from`](crate::group_attention_from) of the head size by default;
    /// `usize::MAX`: never).
    pub group_attention_from: usize,
    /// The batched matmuls' kernels over K-quant weights.
    pub bmm_path: kiln_kernels::BmmPath,
    /// The batched step's decode attention kernels.
    pub batch_attention: kiln_kernels::BatchAttention,
    /// Prompts up to this long prefill through the batched step ([`SHORT_PREFILL`] by
    /// default; 0: none; at most the rows the batched step's buffers hold).
    pub short_prefill_max: usize,
}

pub struct GpuExecutor {
    /// The GPU with this executor's own stream.
    device: Arc<Device>,
    policy: Arc<dyn GpuPolicy>,
    k: Kernels,
    config: ModelConfig,
    max_ctx: usize,
    split: usize,
    /// Context from which one-sequence steps take a GQA group a block on tensor cores
    /// (`StepVariants`), and whether this model's cache and heads allow that kernel at all.
    group_attention_from: usize,
    group_kernel_fits: bool,
    /// How every GEMV reads its activation: `GemvPath::Q16` unless the caller accepted
    /// plain Q8_1.
    path: GemvPath,
    /// The device formats of the model's matrices (the modules a path change loads).
    formats: Vec<&'static WeightFormat>,
    /// A tiling forced on the GEMVs that quantise their output (`StepVariants`; `None`:
    /// the policy's, per weight).
    quant_tiling: Option<GemvTiling>,
    /// O, SwiGLU and down weights up to this many bytes quantise their output in their own
    /// epilogue; larger ones run the plain GEMV and a separate quantising launch. Unlimited
    /// by default: fusing measured as fast or faster on every shape (decode_bench, H200:
    /// SmolLM2 1164 vs 1167 tok/s unfused, 1B 1200 vs 1162, 8B 358 vs 326).
    fuse_limit: usize,
    embd: DeviceWeight,
    lm_head: Option<DeviceWeight>,
    out_norm: DeviceBuffer<f32>,
    inv_freq: DeviceBuffer<f32>,
    /// The sliding-window layers' inverse frequencies (their own RoPE base), if any.
    local_inv_freq: Option<DeviceBuffer<f32>>,
    /// What the token embedding is multiplied by.
    embedding_scale: f32,
    /// What the logits are multiplied by (`None`: 1; Granite divides them).
    logit_scale: Option<f32>,
    /// The model program's branches, in order.
    branches: Vec<DeviceBranch>,
    /// Each KV layer's window (0: the whole context).
    windows: Vec<usize>,
    slots: SequenceSlots<Slot>,
    /// Keys and values of every slot, `[slot][kv_head][position][head_dim]` per layer.
    kv: KvCache,
    s: Scratch,
    /// The batched decode step's buffers and graphs, or why there is no batched step
    /// (then batches decode one sequence at a time and short prompts take the cuBLAS
    /// prefill).
    batch: std::result::Result<batch::BatchState, String>,
    /// Decode batches one sequence at a time even with a batched step
    /// (`LoadOptions::sequential_decode`).
    sequential_decode: bool,
    /// Prompts up to this long prefill through the batched step.
    short_prefill_max: usize,
    /// The batched prefill's cuBLAS handle and workspace, or why there is none (then
    /// prompts go through the decode graph token by token).
    prefill: std::result::Result<prefill::PrefillState, String>,
    /// One prefill chunk's rows of logits and their scores, for `prefill_logits` and
    /// `prefill_scores` (allocated by the first such call: an executor that never scores a
    /// prompt does not hold them).
    scoring: Option<(prefill::ScoringBuffers, Workspace)>,
    // Owns the memory `s` points into; declared after it so it is dropped after.
    _workspace: Workspace,
}

// SAFETY: the executor's device handles are only used through `&mut self` or `&self`
// methods, which bind the context on the calling thread first.
unsafe impl Send for GpuExecutor {}

/// The context an executor of `c` gets ([`LoadOptions::max_context`]; 0: the model's, as far
/// as memory allows) and the blocks of its paged KV pool: K and V rows per layer (a
/// sliding-window layer a ring of its window plus a prefill chunk a sequence), within the
/// device memory free now less the `weights` about to go up and a reserve for the
/// workspaces (the prefill's f16 copy of the largest matrix among them), cuBLAS and the
/// graphs. Without [`LoadOptions::kv_memory`] the pool holds every sequence's whole
/// context; with it, that many bytes, and the context is at most what the pool holds.
/// Says so on stderr when it caps the model's context.
fn fitted_context(
    device: &Arc<Device>,
    c: &ModelConfig,
    options: &LoadOptions,
    kv: KvFormat,
    weights: u64,
) -> Result<(usize, usize)> {
    let (free, total) = device.memory_info().map_err(err)?;
    let row = 2 * kv.bytes(c.kv_dim()) as u64;
    let (mut per_position, mut fixed) = (0u64, 0u64);
    for l in 0..c.num_layers {
        match c.layer_attention(l).window {
            Some(w) => fixed += (w + prefill::CHUNK - 1) as u64 * row,
            None => per_position += row,
        }
    }
    // What one block of the pool takes: K and V rows of every paged layer.
    let block_bytes = (kiln_core::KV_BLOCK_TOKENS as u64 * per_position).max(1);
    // A q8_0 cache's prefill expands one layer's rows to f16: a workspace of one sequence's
    // context, not part of the pool (counted per sequence below: an overestimate beside
    // several).
    let scratch = match kv {
        KvFormat::Q8_0 => 2 * 2 * c.kv_dim() as u64,
        KvFormat::F16 => 0,
    };
    let reserve = (1u64 << 30) + total as u64 / 50;
    let budget = (free as u64).saturating_sub(weights.saturating_add(reserve));
    if let Some(pool) = options.kv_memory {
        // The pool, the rings and a q8_0 prefill's f16 rows must fit; the context is the
        // model's, or what the pool holds.
        let holds = (pool / block_bytes) as usize * kiln_core::KV_BLOCK_TOKENS;
        let max_ctx = match options.max_context {
            0 => c.context_length.max(1).min(holds.max(1)),
            n => n,
        };
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let rings = options.sequences() as u64 * fixed;
        let scratch = scratch.saturating_mul(max_ctx as u64);
        if pool.saturating_add(rings).saturating_add(scratch) > budget {
            return Err(Error::OutOfMemory(format!(
                "a KV cache of {:.2} GiB (--kv-mem) and {:.2} GiB of sliding-window rings and prefill rows \
                 do not fit: {:.2} GiB is left for them",
                gib(pool),
                gib(rings.saturating_add(scratch)),
                gib(budget)
            )));
        }
        return Ok((max_ctx, options.kv_pool_blocks(max_ctx, block_bytes)?));
    }
    let per_position = per_position + scratch;
    let max_ctx = options.fit_context(c, per_position, fixed, budget)?;
    if options.max_context == 0 && max_ctx < c.context_length {
        let kv = options.sequences() as u64 * (max_ctx as u64 * per_position + fixed);
        eprintln!(
            "kiln: context {max_ctx} tokens of the model's {}: what a KV cache fits in free GPU memory \
             ({:.1} GiB for {} sequences); -c sets it",
            c.context_length,
            kv as f64 / (1u64 << 30) as f64,
            options.sequences()
        );
    }
    Ok((
        max_ctx,
        options.kv_pool_blocks(max_ctx, block_bytes.max(1))?,
    ))
}

impl GpuExecutor {
    /// Uploads `model` to `device` (on a stream of the executor's own) with `policy`'s
    /// weight formats and tilings.
    pub fn load(
        device: &Arc<Device>,
        model: &ModelIr,
        options: &LoadOptions,
        policy: Arc<dyn GpuPolicy>,
    ) -> Result<GpuExecutor> {
        if options.tensor_parallel > 1 {
            // The sharded program exists (kiln_core::parallel, run by the cpu backend); the
            // GPU executors have no collective to join their ranks.
            return Err(Error::Unsupported(format!(
                "{} runs a model on one GPU: splitting it over {} (tensor parallelism) is not built for the GPU executors; the cpu backend runs the split",
                policy.backend_name(),
                options.tensor_parallel
            )));
        }
        let program = program::build(model)?;
        check_program(model, &program, policy.as_ref()).map_err(Error::Unsupported)?;
        let kv_format = match options.kv_type.map(|t| (t, KvFormat::of(t))) {
            None => KvFormat::F16,
            Some((_, Some(format))) => format,
            Some((other, None)) => {
                return Err(Error::Unsupported(format!(
                    "{} keeps its KV cache in f16 or q8_0; a {other} cache is not built for the GPU (use --kv-type f16 or q8_0, or the cpu backend, which stores f32 too)",
                    policy.backend_name()
                )))
            }
        };
        let device = &device.new_stream().map_err(err)?;
        let c = model.config.clone();
        let w = &model.weights;
        let (h, qd, kvd, ffn, hd) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.ffn_size, c.head_dim);
        let total: u64 = w.tensors().iter().map(|t| t.bytes().len() as u64).sum();
        let (max_ctx, kv_blocks) = fitted_context(device, &c, options, kv_format, total)?;
        let k = Kernels::new(device);
        let formats = formats_of(model, policy.as_ref());
        // Every module the model needs in one go, so a first run compiles them in parallel:
        // the decode step's, the batched prefill's when cuBLAS is there, the batched step's
        // (batched decode and short prompts) when every format has its matmul.
        let blas = kiln_kernels::Blas::new(device);
        let batched = formats.iter().all(|f| f.batched.is_some());
        let activation_path = if options.quantized_activations {
            GemvPath::Q8
        } else {
            GemvPath::Q16
        };
        let modules = Kernels::modules_for(
            &formats,
            activation_path,
            hd,
            kv_format,
            blas.is_ok(),
            batched && blas.is_ok(),
        )
        .map_err(err)?;
        k.preload_modules(&modules).map_err(err)?;

        let mut done = 0u64;
        let mut progress = |bytes: usize| {
            done += bytes as u64;
            if let Some(p) = &options.progress {
                p(done, total);
            }
        };
        // Matrices go up in the format the policy picks for their type; `parts` are
        // matrices of one type and row length stacked into one (Q, K and V).
        let upload_stacked =
            |parts: &[&TensorView], progress: &mut dyn FnMut(usize)| -> Result<DeviceWeight> {
                let first = parts[0];
                let mut rows = 0;
                for t in parts {
                    if t.dims().len() != 2 {
                        return Err(Error::InvalidShape(format!(
                            "{} is not a matrix: dims {:?}",
                            t.name(),
                            t.dims()
                        )));
                    }
                    if t.qtype() != first.qtype() || t.row_len() != first.row_len() {
                        return Err(Error::InvalidShape(format!(
                            "{} and {} cannot be stacked",
                            first.name(),
                            t.name()
                        )));
                    }
                    rows += t.rows();
                }
                let format = policy
                    .format_for(first.qtype(), first.row_len())
                    .ok_or_else(|| Error::Unsupported(format!("no GEMV for {}", first.qtype())))?;
                let dw = if parts.len() == 1 {
                    DeviceWeight::from_ggml_as(device, format, first.row_len(), rows, first.bytes())
                } else {
                    let bytes: Vec<u8> = parts
                        .iter()
                        .flat_map(|t| t.bytes().iter().copied())
                        .collect();
                    DeviceWeight::from_ggml_as(device, format, first.row_len(), rows, &bytes)
                }
                .map_err(err)?;
                progress(parts.iter().map(|t| t.bytes().len()).sum());
                Ok(dw)
            };
        let upload =
            |t: &TensorView, progress: &mut dyn FnMut(usize)| upload_stacked(&[t], progress);
        let upload_vec = |v: &[f32]| DeviceBuffer::from_host(device, v).map_err(err);

        let embd = upload(&w.token_embd, &mut progress)?;
        if embd.row_len != h || embd.rows != c.vocab_size {
            return Err(Error::InvalidShape(format!(
                "token embedding is {}x{}, expected {}x{h}",
                embd.rows, embd.row_len, c.vocab_size
            )));
        }
        let lm_head = match &w.output {
            Some(t) => Some(upload(t, &mut progress)?),
            None => None,
        };
        let out_norm = upload_vec(&vector(&program.head.norm.weight, h, "output norm")?)?;
        let freq_factors = match &program.rope_freqs {
            Some(t) => Some(t.to_f32()?),
            None => None,
        };
        let inv_freqs =
            |rope: &kiln_core::RopeConfig, factors: Option<&[f32]>| -> Result<DeviceBuffer<f32>> {
                upload_vec(
                    &(0..rope.rotary_dims / 2)
                        .map(|i| rope.inv_freq(i, factors))
                        .collect::<Vec<_>>(),
                )
            };
        let inv_freq = inv_freqs(&c.rope, freq_factors.as_deref())?;
        // The windowed layers' own base, unscaled (see `ModelConfig::local_rope`).
        let local_inv_freq = match c.local_rope() {
            Some(r) => Some(inv_freqs(&r, None)?),
            None => None,
        };

        let mut branches = Vec::with_capacity(program.branches.len());
        let mut windows = vec![0; c.num_layers];
        for b in &program.branches {
            let norm = |t: &TensorView, len: usize, what| -> Result<DeviceBuffer<f32>> {
                upload_vec(&vector(t, len, what)?)
            };
            let op = match b.single_op().expect("checked by check_model") {
                Op::Attention(a) => {
                    // Q, K and V in as few GEMVs as their types allow: neighbours of one
                    // type are stacked into one matrix (all three when they agree; Q and K
                    // when only V differs, as in the layers where q4_k_m files keep V in
                    // q6_k).
                    let parts = [(&a.q, 0), (&a.k, qd), (&a.v, qd + kvd)];
                    let mut qkv = Vec::with_capacity(3);
                    let mut first = 0;
                    while first < parts.len() {
                        let qtype = parts[first].0.weight.qtype();
                        let end = (first + 1..parts.len())
                            .find(|&i| parts[i].0.weight.qtype() != qtype)
                            .unwrap_or(parts.len());
                        let run: Vec<&TensorView> =
                            parts[first..end].iter().map(|p| &p.0.weight).collect();
                        qkv.push(Proj {
                            w: upload_stacked(&run, &mut progress)?,
                            offset: parts[first].1,
                        });
                        first = end;
                    }
                    let qkv_bias = if parts.iter().any(|p| p.0.bias.is_some()) {
                        let mut all = vec![0f32; qd + 2 * kvd];
                        for (linear, offset) in parts {
                            if let Some(t) = &linear.bias {
                                let len = t.elements();
                                all[offset..offset + len].copy_from_slice(&vector(
                                    t,
                                    len,
                                    "Q/K/V bias",
                                )?);
                            }
                        }
                        Some(upload_vec(&all)?)
                    } else {
                        None
                    };
                    let (q_norm, k_norm) = match &a.head_norms {
                        Some(n) => (
                            Some(norm(&n.q, hd, "Q norm")?),
                            Some(norm(&n.k, hd, "K norm")?),
                        ),
                        None => (None, None),
                    };
                    // A window as long as the context never binds: a full layer.
                    let window = a.span.window.filter(|&w| w < max_ctx).unwrap_or(0);
                    windows[a.layer] = window;
                    DeviceOp::Attention(DeviceAttention {
                        layer: a.layer,
                        qkv,
                        qkv_bias,
                        q_norm,
                        k_norm,
                        o: upload(&a.out.weight, &mut progress)?,
                        o_bias: match &a.out.bias {
                            Some(t) => Some(upload_vec(&vector(t, h, "attention output bias")?)?),
                            None => None,
                        },
                        sinks: match &a.sinks {
                            Some(t) => {
                                Some(upload_vec(&vector(t, c.num_heads, "attention sinks")?)?)
                            }
                            None => None,
                        },
                        window,
                        local_rope: a.span.local_rope,
                        scale: a.scale,
                    })
                }
                Op::FeedForward(f) => DeviceOp::FeedForward(DeviceFeedForward {
                    gate: upload(
                        f.gate.as_ref().expect("checked by check_model"),
                        &mut progress,
                    )?,
                    up: upload(&f.up, &mut progress)?,
                    down: upload(&f.down, &mut progress)?,
                    gelu: f.activation == Activation::Gelu,
                }),
                Op::Experts(e) => {
                    // Each projection's experts stacked into one weight, expert order.
                    let stack = |part: fn(&program::FeedForward<TensorView>) -> &TensorView,
                                 progress: &mut dyn FnMut(usize)| {
                        let parts: Vec<&TensorView> = e.experts.iter().map(part).collect();
                        upload_stacked(&parts, progress)
                    };
                    let count = e.experts.len();
                    DeviceOp::Experts(DeviceExperts {
                        router: upload(&e.router.weight, &mut progress)?,
                        router_bias: match &e.router.bias {
                            Some(t) => Some(upload_vec(&vector(t, count, "router bias")?)?),
                            None => None,
                        },
                        gate: stack(
                            |f| f.gate.as_ref().expect("checked by check_model"),
                            &mut progress,
                        )?,
                        up: stack(|f| &f.up, &mut progress)?,
                        down: stack(|f| &f.down, &mut progress)?,
                        gate_up_bias: expert_gate_up_biases(e)?
                            .map(|b| upload_vec(&b))
                            .transpose()?,
                        down_bias: expert_down_biases(e, h)?
                            .map(|b| upload_vec(&b))
                            .transpose()?,
                        count,
                        used: e.used,
                        normalize: e.normalize,
                        act: e.experts[0].activation.into(),
                    })
                }
            };
            branches.push(DeviceBranch {
                norm: norm(&b.norm.weight, h, "norm")?,
                op,
                post_norm: match &b.post_norm {
                    Some(n) => Some(norm(&n.weight, h, "post-norm")?),
                    None => None,
                },
                scale: (b.scale != 1.0).then_some(b.scale),
            });
        }
        let head_rows = lm_head.as_ref().unwrap_or(&embd).rows;
        if head_rows != c.vocab_size {
            return Err(Error::InvalidShape(format!(
                "LM head has {head_rows} rows, vocabulary {}",
                c.vocab_size
            )));
        }

        // Splits of 64 positions keep many blocks busy at short contexts; past 64 × the
        // most splits a launch has, the kernel lengthens them (256 at 32k: what measured
        // best for long contexts on an H200, docs/architecture.md).
        let split = 64;
        let nsplit = Kernels::attention_splits(max_ctx, split);
        let vocab = c.vocab_size;
        let sample_keys = Kernels::sample_scratch(vocab, Kernels::MAX_TOP_K);
        // One norm a branch, then the head's.
        let norms = branches.len() + 1;
        let groups = h.div_ceil(32);
        // Quantised planes: int8 values and residuals padded to whole 32-blocks, a scale
        // pair per block.
        let planes = |a: &mut Carver, n: usize| {
            let padded = n.div_ceil(32) * 32;
            Q8Act {
                q: a.take(padded),
                lo: a.take(padded),
                ds: a.take(padded / 32),
            }
        };
        // A Mixture of Experts' buffers, for the most experts any layer has and uses and as
        // many rows as a prefill chunk or a batched step holds.
        let moe_shape = experts::BufferShape::of(&branches, &c, max_ctx);
        let (ws, s) = Workspace::carve(device, |a| Scratch {
            x: a.take(h),
            norm_parts: a.take(norms * groups),
            attn_counters: a.take(c.num_heads),
            qkv: a.take(qd + 2 * kvd),
            q: a.take(qd),
            attn: a.take(qd),
            ffn: a.take(ffn),
            logits: a.take(vocab),
            part_o: a.take(c.num_heads * nsplit * hd),
            part_ml: a.take(c.num_heads * nsplit),
            keys: a.take(Kernels::argmax_scratch(vocab)),
            cand: a.take(sample_keys),
            rng: a.take(1),
            token_out: a.take(1),
            xq: planes(a, h),
            aq: planes(a, qd),
            proj: a.take(h),
            hq: planes(a, ffn),
            moe: ExpertBuffers::carve(a, &moe_shape),
        })
        .map_err(err)?;
        // Poison the activations: a kernel reading what nothing wrote shows up as NaN. The
        // attention's counters start at zero.
        ws.fill_bytes(0xff).map_err(err)?;
        s.attn_counters.fill_bytes_async(device, 0).map_err(err)?;
        s.moe.clear_router_ids(device).map_err(err)?;
        let prefill = match blas {
            Ok(blas) => Ok(
                prefill::PrefillState::new(device, blas, &c, max_ctx, kv_format).map_err(err)?,
            ),
            Err(kiln_kernels::KernelError::NoCublas(why)) => Err(why),
            Err(e) => return Err(err(e)),
        };
        // GEMVs read 15-bit activations (two int8 planes, two dp4a per four weights) unless
        // the caller accepts 8-bit ones. Plain Q8_1 fails parity on real models (SmolLM2
        // q4_k_m: cosine 0.994 to the CPU reference by the second decode step): their
        // activations have outlier channels that a 32-value block scale cannot absorb in 8
        // bits; the residual plane gives 256x finer steps. (f32 activations are exact but
        // 2.5-3.5x slower per GEMV: instruction-bound; see docs/architecture.md.)
        let mut slots = Vec::with_capacity(options.sequences());
        for _ in 0..options.sequences() {
            slots.push(Slot {
                state: DeviceBuffer::zeros(device, 4).map_err(err)?,
                graphs: Default::default(),
                tokens: Vec::new(),
            });
        }
        // A sliding-window layer keeps a ring of its window plus one prefill chunk (the
        // chunk's queries need the window before each of them); the others page.
        let kv_layout: Vec<KvLayerRows> = windows
            .iter()
            .map(|&window| match window {
                0 => KvLayerRows::Paged,
                w => KvLayerRows::Ring((w + prefill::CHUNK - 1).min(max_ctx)),
            })
            .collect();
        let max_blocks = max_ctx.div_ceil(kiln_core::KV_BLOCK_TOKENS);
        let kv = KvCache::paged(
            device,
            kv_format,
            options.sequences(),
            c.num_kv_heads,
            hd,
            &kv_layout,
            kv_blocks,
            max_blocks,
        )
        .map_err(err)?;
        let group_kernel_fits =
            kv_format == KvFormat::F16 && hd <= 128 && c.num_heads / c.num_kv_heads <= 16;
        Ok(GpuExecutor {
            device: device.clone(),
            policy,
            k,
            config: c,
            max_ctx,
            split,
            group_attention_from: group_attention_from(hd),
            group_kernel_fits,
            path: activation_path,
            formats: formats.clone(),
            quant_tiling: None,
            fuse_limit: usize::MAX,
            embd,
            lm_head,
            out_norm,
            inv_freq,
            local_inv_freq,
            embedding_scale: program.embedding.scale,
            logit_scale: (program.head.logit_scale != 1.0).then_some(program.head.logit_scale),
            branches,
            windows,
            slots: SequenceSlots::new(slots, kv_blocks, max_ctx),
            kv,
            s,
            prefill,
            scoring: None,
            batch: Err(String::new()),
            sequential_decode: options.sequential_decode,
            short_prefill_max: 0,
            _workspace: ws,
        })
        .and_then(|mut exec| {
            exec.batch = batch::BatchState::new(&exec, &exec.matmul_formats(), nsplit)?;
            exec.short_prefill_max = exec.short_prefill_capacity().min(SHORT_PREFILL);
            exec.warm_up()?;
            Ok(exec)
        })
    }

    /// The formats of the matrices the batched step multiplies with its matmuls: the
    /// dense ones and the head (a Mixture of Experts' router and experts take GEMVs).
    fn matmul_formats(&self) -> Vec<&'static WeightFormat> {
        let mut v = vec![self.lm_head.as_ref().unwrap_or(&self.embd).format];
        for b in &self.branches {
            match &b.op {
                DeviceOp::Attention(a) => {
                    v.extend(a.qkv.iter().map(|p| p.w.format));
                    v.push(a.o.format);
                }
                DeviceOp::FeedForward(f) => v.extend([f.gate.format, f.up.format, f.down.format]),
                DeviceOp::Experts(_) => {}
            }
        }
        v.sort_by_key(|f| f.tag);
        v.dedup_by_key(|f| f.tag);
        v
    }

    /// The kernels this executor's steps run now: what it chose at load, or what
    /// [`GpuExecutor::set_variants`] forced.
    pub fn variants(&self) -> StepVariants {
        StepVariants {
            gemv_path: self.path,
            quant_tiling: self.quant_tiling,
            fuse_limit: self.fuse_limit,
            group_attention_from: self.group_attention_from,
            bmm_path: self.k.bmm_path(),
            batch_attention: self.k.batch_attention(),
            short_prefill_max: self.short_prefill_max,
        }
    }

    /// Runs the steps with other kernels than the executor chose (the benchmarks and
    /// parity tests measure or check each beside the default). Captured graphs are dropped;
    /// the modules a new GEMV path needs load now (a graph capture cannot load them).
    pub fn set_variants(&mut self, v: StepVariants) -> Result<()> {
        if v.gemv_path == GemvPath::Float {
            return Err(Error::Unsupported(
                "the GPU step decodes from quantised activations (GemvPath::Q8 or Q16)".into(),
            ));
        }
        if let Some(t) = v.quant_tiling {
            if !GemvTiling::quantising().any(|q| q == t) {
                return Err(Error::InvalidArgument(format!(
                    "{t:?} is not a quantising GEMV tiling"
                )));
            }
        }
        if v.gemv_path != self.path {
            let modules = Kernels::modules_for(
                &self.formats,
                v.gemv_path,
                self.config.head_dim,
                self.kv.format,
                false,
                false,
            )
            .map_err(err)?;
            self.k.preload_modules(&modules).map_err(err)?;
        }
        self.drop_graphs();
        self.path = v.gemv_path;
        self.quant_tiling = v.quant_tiling;
        self.fuse_limit = v.fuse_limit;
        self.group_attention_from = v.group_attention_from;
        self.k.set_bmm_path(v.bmm_path);
        self.k.set_batch_attention(v.batch_attention);
        self.short_prefill_max = v.short_prefill_max.min(self.short_prefill_capacity());
        Ok(())
    }

    /// The tiling of a GEMV over `w` that quantises its output.
    fn quant_tiling_of(&self, w: &DeviceWeight) -> GemvTiling {
        match self.quant_tiling {
            Some(t) if t.rows_per_warp.is_multiple_of(w.format.row_group) => t,
            _ => self.policy.quant_tiling(w, self.config.hidden_size),
        }
    }

    /// The policy behind this executor.
    pub fn policy(&self) -> &dyn GpuPolicy {
        self.policy.as_ref()
    }

    fn drop_graphs(&mut self) {
        for s in self.slots.as_mut_slice() {
            s.graphs = Default::default();
        }
        if let Ok(b) = &mut self.batch {
            b.drop_graphs();
        }
    }

    /// Decode attention's arguments for `a` in a step of `shape`, shared by the
    /// one-sequence and the batched step.
    fn attn_args(&self, a: &DeviceAttention, shape: StepShape) -> AttnArgs {
        let c = &self.config;
        AttnArgs {
            sinks: a.sinks.as_ref().map(|s| s.slice()),
            n_heads: c.num_heads,
            n_kv: c.num_kv_heads,
            head_dim: c.head_dim,
            max_ctx: self.layer_context(a.layer),
            split: shape.split,
            scale: a.scale,
            window: a.window,
            heads: match a.window {
                0 => shape.heads,
                _ => AttnHeads::One,
            },
            splits: shape.splits,
        }
    }

    /// Positions a sequence reaches in layer `li`'s cache: a sliding-window layer's ring,
    /// or the context (a paged layer).
    pub(super) fn layer_context(&self, li: usize) -> usize {
        match self.kv.is_paged(li) {
            true => self.max_ctx,
            false => self.kv.rows(li),
        }
    }

    /// Makes `slot`'s sequence hold KV blocks for positions `0..len`, writing its block
    /// table to the device when that changed (before any kernel of the step that needs it
    /// runs: the copy is on the executor's stream). `KvCacheFull` changes nothing.
    pub(super) fn reserve(&mut self, slot: usize, len: usize) -> Result<()> {
        if self.slots.reserve(slot, len)? {
            self.write_table(slot)?;
        }
        Ok(())
    }

    /// Copies `slot`'s block table to the device.
    fn write_table(&self, slot: usize) -> Result<()> {
        self.kv
            .set_table(&self.device, slot, self.slots[slot].blocks())
            .map_err(err)
    }

    /// [`GpuExecutor::reserve`] for a batch's sequences (each to its next position), all
    /// or nothing.
    pub(super) fn reserve_batch(&mut self, batch: &[DecodeItem]) -> Result<()> {
        let wants: Vec<(usize, usize)> = batch
            .iter()
            .map(|it| {
                let slot = self.slot_of(it.seq)?;
                Ok((slot, self.slots[slot].len + 1))
            })
            .collect::<Result<_>>()?;
        for slot in self.slots.reserve_all(&wants)? {
            self.write_table(slot)?;
        }
        Ok(())
    }

    /// The attention grid a step whose longest context is `len` needs: as many split
    /// blocks per head as the widest of its layers' spans works with (a sliding-window
    /// layer's span is its window), rounded up to a power of two.
    fn attention_grid(&self, len: usize, split: usize) -> usize {
        let working = self
            .windows
            .iter()
            .enumerate()
            .map(|(li, &window)| {
                let span = if window > 0 { len.min(window) } else { len };
                Kernels::attention_working_splits(span, self.layer_context(li), split)
            })
            .max()
            .unwrap_or(1);
        Kernels::attention_grid_splits(working, Kernels::attention_splits(self.max_ctx, split))
    }

    /// RoPE (+ QK-norm) arguments of `l`, shared by decode and the batched prefill.
    fn rope_args(&self, l: &DeviceAttention) -> RopeArgs {
        let c = &self.config;
        let inv_freq = match (&self.local_inv_freq, l.local_rope) {
            (Some(local), true) => local,
            _ => &self.inv_freq,
        };
        RopeArgs {
            n_heads: c.num_heads,
            n_kv: c.num_kv_heads,
            head_dim: c.head_dim,
            rot_dims: c.rope.rotary_dims,
            inv_freq: inv_freq.slice(),
            neox: c.rope.kind == RopeKind::Neox,
            q_norm: l.q_norm.as_ref().map(|b| b.slice()),
            k_norm: l.k_norm.as_ref().map(|b| b.slice()),
            eps: c.norm_eps,
        }
    }

    /// The shape of a one-sequence step reaching context `len`: its attention grid, and
    /// for GQA models the heads of a group on tensor cores from
    /// [`StepVariants::group_attention_from`] positions on ([`crate::group_attention_from`] by
    /// default) where the cache and heads allow it, else in pairs from
    /// [`PAIRED_ATTENTION_FROM`].
    fn step_shape(&self, len: usize) -> StepShape {
        let gqa = self.config.num_heads / self.config.num_kv_heads >= 2;
        let heads = if gqa && len >= self.group_attention_from && self.group_kernel_fits {
            AttnHeads::Group
        } else if gqa && len >= PAIRED_ATTENTION_FROM {
            AttnHeads::Pairs
        } else {
            AttnHeads::One
        };
        StepShape {
            split: self.split,
            splits: self.attention_grid(len, self.split),
            heads,
        }
    }

    fn tiling(&self, w: &DeviceWeight) -> GemvTiling {
        self.policy.gemv_tiling(w)
    }

    /// Queues one decode step for `slot` (what the graph holds): the program's branches in
    /// order, an attention as QKV, RoPE+KV, attention (one launch), O (+ residual), a
    /// feed-forward as gate/up+SwiGLU, down (+ residual). No launch normalises:
    /// the kernels that update the residual stream quantise it times the next norm's weight
    /// and sum its squares per group, and the GEMVs reading it finish the norm (see
    /// PendingNorm). Nothing is accumulated with atomics: every step is bit-reproducible.
    fn queue_step(&self, slot_index: usize, shape: StepShape) -> kiln_kernels::Result<()> {
        let c = &self.config;
        let (k, s) = (&self.k, &self.s);
        let state = self.slots[slot_index].state.slice();
        let (token, pos, len) = (state.sub(0, 1)?, state.sub(1, 1)?, state.sub(2, 1)?);
        let groups = c.hidden_size.div_ceil(32);
        let parts = |n: usize| s.norm_parts.sub(n * groups, groups);
        let norm = |n: usize| -> kiln_kernels::Result<PendingNorm> {
            Ok(PendingNorm {
                parts: parts(n)?,
                eps: c.norm_eps,
            })
        };
        // The residual stream, quantised times the weight `w` of norm `n`.
        let stream_out = |w: &DeviceBuffer<f32>, n: usize| -> kiln_kernels::Result<QuantOut> {
            Ok(QuantOut {
                q: s.xq,
                norm_w: Some(w.slice()),
                norm_parts: Some(parts(n)?),
            })
        };
        let from = |q: Q8Act, norm: Option<PendingNorm>| GemvInput {
            x: None,
            q8: Some(q),
            norm,
        };
        k.embed(
            &self.embd,
            token,
            self.embedding_scale,
            s.x,
            Some(stream_out(&self.branches[0].norm, 0)?),
        )?;
        for (bi, b) in self.branches.iter().enumerate() {
            let input = from(s.xq, Some(norm(bi)?));
            // The kernel that adds this branch to the stream quantises it for the next.
            let next = stream_out(self.norm_after(bi), bi + 1)?;
            match &b.op {
                DeviceOp::Attention(a) => {
                    for p in &a.qkv {
                        let bias = match &a.qkv_bias {
                            Some(b) => Some(b.slice().sub(p.offset, p.w.rows)?),
                            None => None,
                        };
                        let epi = Epilogue {
                            bias,
                            ..Default::default()
                        };
                        k.gemv(
                            &p.w,
                            &input,
                            self.path,
                            self.tiling(&p.w),
                            s.qkv.sub(p.offset, p.w.rows)?,
                            &epi,
                        )?;
                    }
                    let kv = self.kv.layer(a.layer, slot_index)?;
                    let rope = self.rope_args(a);
                    let attn = self.attn_args(a, shape);
                    k.rope_kv(&rope, s.qkv, s.q, kv, pos, self.kv.rows(a.layer))?;
                    k.attention(
                        &attn,
                        s.q,
                        kv,
                        len,
                        s.part_o,
                        s.part_ml,
                        s.attn_counters,
                        s.attn,
                        Some(s.aq),
                    )?;
                    self.residual_gemv(&a.o, a.o_bias.as_ref().map(|b| b.slice()), s.aq, b, next)?;
                }
                DeviceOp::FeedForward(f) => {
                    let hq = QuantOut {
                        q: s.hq,
                        norm_w: None,
                        norm_parts: None,
                    };
                    if f.gate.bytes() + f.up.bytes() <= self.fuse_limit {
                        let t = self.quant_tiling_of(&f.gate);
                        k.swiglu(
                            &f.gate,
                            &f.up,
                            &input,
                            self.path,
                            t,
                            s.ffn,
                            Some(hq),
                            f.act(),
                        )?;
                    } else {
                        let t = self.tiling(&f.gate);
                        k.swiglu(&f.gate, &f.up, &input, self.path, t, s.ffn, None, f.act())?;
                        k.quantize(s.ffn, c.ffn_size, &hq)?;
                    }
                    self.residual_gemv(&f.down, None, s.hq, b, next)?;
                }
                DeviceOp::Experts(e) => self.queue_experts(e, &input, b, next)?,
            }
        }
        let head = self.lm_head.as_ref().unwrap_or(&self.embd);
        let head_input = from(s.xq, Some(norm(self.branches.len())?));
        k.gemv(
            head,
            &head_input,
            self.path,
            self.tiling(head),
            s.logits,
            &self.head_epilogue(),
        )
    }

    /// The LM head GEMV's epilogue: the logit scale, if the model has one.
    pub(super) fn head_epilogue(&self) -> Epilogue {
        Epilogue {
            scale: self.logit_scale,
            ..Default::default()
        }
    }

    /// The norm that reads the residual stream after branch `i`: the next branch's, or the
    /// head's after the last.
    pub(super) fn norm_after(&self, i: usize) -> &DeviceBuffer<f32> {
        self.branches.get(i + 1).map_or(&self.out_norm, |b| &b.norm)
    }

    /// x += W·a for the residual stream `x` as branch `b` joins it (x += norm(W·a) with a
    /// sandwich norm, x += scale·W·a with a branch scale), then `out` gets x quantised for
    /// the next GEMV: in the GEMV's epilogue, or by a launch of its own for large weights
    /// (`fuse_limit`) and after a post-norm.
    fn residual_gemv(
        &self,
        w: &DeviceWeight,
        bias: Option<DevSlice<f32>>,
        a: Q8Act,
        b: &DeviceBranch,
        out: QuantOut,
    ) -> kiln_kernels::Result<()> {
        let (k, s) = (&self.k, &self.s);
        let input = GemvInput {
            x: None,
            q8: Some(a),
            norm: None,
        };
        if let Some(post) = &b.post_norm {
            let h = self.config.hidden_size;
            k.gemv(
                w,
                &input,
                self.path,
                self.tiling(w),
                s.proj,
                &Epilogue {
                    bias,
                    ..Default::default()
                },
            )?;
            k.add_rmsnorm_rows(s.proj, 1, h, post.slice(), self.config.norm_eps, s.x)?;
            return k.quantize(s.x, h, &out);
        }
        let fused = w.bytes() <= self.fuse_limit;
        let epi = Epilogue {
            bias,
            residual: Some(s.x),
            quant: fused.then_some(out),
            scale: b.scale,
            ..Default::default()
        };
        let tiling = if fused {
            self.quant_tiling_of(w)
        } else {
            self.tiling(w)
        };
        k.gemv(w, &input, self.path, tiling, s.x, &epi)?;
        if !fused {
            k.quantize(s.x, w.rows, &out)?;
        }
        Ok(())
    }

    /// Device time of one decode step: replays `seq`'s captured graph `replays` times
    /// back to back (re-running its last step) and returns the median milliseconds per
    /// replay, timed with events — the step without the host's per-token round trip.
    pub fn step_device_ms(&mut self, seq: SeqId, replays: usize) -> Result<f64> {
        median_replay_ms(&self.device, self.last_step_graph(seq)?, replays)
    }

    /// Operations in `seq`'s captured decode step (kernels and copies).
    pub fn step_graph_nodes(&self, seq: SeqId) -> Result<usize> {
        self.last_step_graph(seq)?.node_count().map_err(err)
    }

    /// The graph `seq`'s last decode step replayed.
    fn last_step_graph(&self, seq: SeqId) -> Result<&Graph> {
        let slot = self.slot_of(seq)?;
        let shape = self.step_shape(self.slots[slot].len);
        self.slots[slot].graphs[shape.index()]
            .as_ref()
            .ok_or_else(|| Error::InvalidArgument(format!("sequence {seq} has not decoded yet")))
    }

    fn slot_of(&self, seq: SeqId) -> Result<usize> {
        self.slots.index_of(seq)
    }

    /// Takes every first-use cost off a request's path, at load: each slot's decode graph
    /// and each batch bucket's graph captured, and the batched prefill run once at a few
    /// lengths, so cuBLAS loads (lazily, at first use) the GEMM kernels those shapes pick
    /// and a short prompt's first token costs only its own work. Leaves every slot empty
    /// and every KV block free (the scratch prefill runs in a sequence of its own, freed
    /// after).
    fn warm_up(&mut self) -> Result<()> {
        // The first decode steps' shape (a context of one); longer contexts capture theirs
        // when first reached (a few milliseconds, once per slot and shape).
        let shape = self.step_shape(1);
        for slot in 0..self.slots.capacity() {
            let graph = self
                .device
                .capture(|| self.queue_step(slot, shape))
                .map_err(err)?;
            self.slots[slot].graphs[shape.index()] = Some(graph);
        }
        self.capture_batch_graphs()?;
        if self.prefill.is_ok() {
            let seq = self.slots.allocate()?;
            let slot = self.slot_of(seq)?;
            for n in [1, 5, 16, 64, prefill::CHUNK] {
                if n > self.max_ctx {
                    break;
                }
                self.prefill_batched(slot, &vec![0; n], false, None)?;
                self.slots[slot].len = 0;
            }
            self.slots.free(seq)?;
        }
        self.device.synchronize().map_err(err)
    }

    /// Runs one step of `slot` for `token` at its next position, leaving the logits in
    /// the workspace. `uniform` rides along for a device-side draw.
    fn step(&mut self, slot: usize, token: u32, uniform: f32) -> Result<()> {
        let vocab = self.config.vocab_size;
        if token as usize >= vocab {
            return Err(Error::InvalidArgument(format!(
                "token {token} is outside the vocabulary of {vocab}"
            )));
        }
        let pos = self.slots[slot].len;
        if pos >= self.max_ctx {
            return Err(Error::InvalidArgument(format!(
                "sequence is full: context of {} reached",
                self.max_ctx
            )));
        }
        self.reserve(slot, pos + 1)?;
        let state = [
            token as i32,
            pos as i32,
            pos as i32 + 1,
            uniform.to_bits() as i32,
        ];
        self.slots[slot]
            .state
            .slice()
            .copy_from_host(&self.device, &state)
            .map_err(err)?;
        let shape = self.step_shape(pos + 1);
        if self.slots[slot].graphs[shape.index()].is_none() {
            let graph = self
                .device
                .capture(|| self.queue_step(slot, shape))
                .map_err(err)?;
            self.slots[slot].graphs[shape.index()] = Some(graph);
        }
        self.slots[slot].graphs[shape.index()]
            .as_ref()
            .expect("captured above")
            .launch()
            .map_err(err)?;
        self.slots[slot].len = pos + 1;
        self.slots[slot].record(pos, &[token]);
        Ok(())
    }

    /// The slot of `seq`, after checking a prefill of `tokens` into `logits` fits.
    /// A checked scoring prefill through the batched prefill (which must be available):
    /// blocks for the whole prompt first, the scoring buffers on first use.
    fn prefill_scored(
        &mut self,
        slot: usize,
        tokens: &[u32],
        first: usize,
        out: prefill::ScoredOut<'_>,
    ) -> Result<()> {
        let start = self.slots[slot].len;
        self.reserve(slot, start + tokens.len())?;
        let dev = self.scoring_buffers()?;
        let scored = prefill::ScoredRows { first, out, dev };
        self.prefill_batched(slot, tokens, false, Some(scored))?;
        Ok(())
    }

    /// The device buffers of a scoring prefill (logits, hidden states, scores of a chunk's
    /// rows), made by the first call that needs them and kept.
    fn scoring_buffers(&mut self) -> Result<prefill::ScoringBuffers> {
        if let Some((b, _)) = &self.scoring {
            return Ok(*b);
        }
        let chunk = match &self.prefill {
            Ok(p) => p.chunk_len(),
            Err(why) => return Err(Error::Unsupported(format!("batched prefill: {why}"))),
        };
        let vocab = self.config.vocab_size;
        let hidden = self.config.hidden_size;
        let (ws, b) = Workspace::carve(&self.device, |a| prefill::ScoringBuffers {
            logits: a.take(chunk * vocab),
            hidden: a.take(chunk * hidden),
            targets: a.take(chunk),
            nll: a.take(chunk),
            top: a.take(chunk),
        })
        .map_err(err)?;
        let (b, _) = self.scoring.insert((b, ws));
        Ok(*b)
    }

    fn check_prefill(&self, seq: SeqId, tokens: &[u32], logits: &[f32]) -> Result<usize> {
        let slot = self.slot_of(seq)?;
        let len = self.slots[slot].len;
        kiln_core::check_prefill(tokens, logits, self.config.vocab_size, len, self.max_ctx)?;
        Ok(slot)
    }
}

impl LayerExecutor for GpuExecutor {
    fn config(&self) -> &ModelConfig {
        &self.config
    }

    fn kv_type(&self) -> Option<KvType> {
        Some(self.kv.format.into())
    }

    fn kv_blocks(&self) -> Option<kiln_core::KvBlockUsage> {
        let (total, free) = self.slots.block_counts();
        Some(kiln_core::KvBlockUsage {
            block_tokens: kiln_core::KV_BLOCK_TOKENS,
            total,
            free,
            block_bytes: self.kv.block_bytes(),
        })
    }

    fn memory_roofline_gbs(&mut self) -> Option<f64> {
        self.device.bind().ok()?;
        kiln_kernels::roofline::copy_bandwidth_gbs(&self.device, &self.k).ok()
    }

    fn max_context(&self) -> usize {
        self.max_ctx
    }

    fn max_sequences(&self) -> usize {
        self.slots.capacity()
    }

    fn new_sequence(&mut self) -> Result<SeqId> {
        self.slots.allocate()
    }

    fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        self.slots.free(seq)
    }

    fn sequence_len(&self, seq: SeqId) -> Result<usize> {
        self.slots.len_of(seq)
    }

    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> Result<()> {
        // Attention reads only positions below the length; later ones are overwritten. A
        // sliding-window layer's ring, though, may have overwritten the window before
        // `len` with positions past it: then the kept prefix runs again from the slot's
        // tokens (what was lost depends on every position before it).
        let slot = self.slot_of(seq)?;
        let old = self.slots[slot].len;
        self.slots.truncate(seq, len)?;
        let c = &self.config;
        let lost = (0..self.windows.len()).any(|li| {
            c.layer_attention(li)
                .truncation_loses_rows(self.kv.rows(li), old, len)
        });
        if lost {
            let tokens = self.slots[slot].tokens[..len].to_vec();
            self.slots[slot].len = 0;
            if self.prefill.is_ok() {
                self.prefill_batched(slot, &tokens, false, None)?;
            } else {
                for &t in &tokens {
                    self.step(slot, t, 0.0)?;
                }
            }
        }
        Ok(())
    }

    fn prefill(&mut self, seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> Result<()> {
        let slot = self.check_prefill(seq, tokens, logits)?;
        // Blocks for the whole prompt first: a prompt the pool cannot take changes nothing.
        self.reserve(slot, self.slots[slot].len + tokens.len())?;
        let out = if self.prefills_short(tokens.len()) {
            self.prefill_short(slot, tokens)?
        } else if self.prefill.is_ok() {
            self.prefill_batched(slot, tokens, false, None)?;
            self.s.logits
        } else {
            // No cuBLAS: token by token through the decode graph (correct, GEMV speed).
            for &t in tokens {
                self.step(slot, t, 0.0)?;
            }
            self.s.logits
        };
        out.copy_to_host(&self.device, logits).map_err(err)
    }

    fn prefill_logits(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        first: usize,
        logits: &mut [f32],
    ) -> Result<()> {
        let vocab = self.config.vocab_size;
        let slot = self.slot_of(seq)?;
        let start = self.slots[slot].len;
        kiln_core::check_prefill_logits(tokens, first, logits, vocab, start, self.max_ctx)?;
        if self.prefill.is_err() {
            return kiln_core::prefill_logits_stepwise(self, seq, tokens, first, logits);
        }
        self.prefill_scored(slot, tokens, first, prefill::ScoredOut::Logits(logits))
    }

    fn prefill_scores(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        first: usize,
        targets: &[u32],
        scores: &mut [kiln_core::TokenScore],
    ) -> Result<()> {
        let vocab = self.config.vocab_size;
        let slot = self.slot_of(seq)?;
        let start = self.slots[slot].len;
        kiln_core::check_prefill_scores(
            tokens,
            first,
            targets,
            scores,
            vocab,
            start,
            self.max_ctx,
        )?;
        if self.prefill.is_err() {
            return kiln_core::prefill_scores_from_logits(
                self, seq, tokens, first, targets, scores,
            );
        }
        let out = prefill::ScoredOut::Scores { targets, scores };
        self.prefill_scored(slot, tokens, first, out)
    }

    fn prefill_hidden(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        first: usize,
        hidden: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let slot = self.slot_of(seq)?;
        let start = self.slots[slot].len;
        kiln_core::check_prefill_hidden(
            tokens,
            first,
            hidden,
            c.hidden_size,
            c.vocab_size,
            start,
            self.max_ctx,
        )?;
        if let Err(why) = &self.prefill {
            return Err(Error::Unsupported(format!(
                "hidden states need the batched prefill: {why}"
            )));
        }
        self.prefill_scored(slot, tokens, first, prefill::ScoredOut::Hidden(hidden))
    }

    /// The items' rows packed into shared prefill passes whatever sequence they belong to
    /// ([`GpuExecutor::prefill_hidden_rows`]): many short texts cost what one text of their
    /// total length does. Every item is checked and every sequence's blocks taken before
    /// any row runs, so a refused batch changes nothing.
    fn prefill_hidden_batch(
        &mut self,
        items: &[kiln_core::HiddenRequest<'_>],
        hidden: &mut [f32],
    ) -> Result<()> {
        let c = &self.config;
        let shares = kiln_core::check_hidden_batch(items, hidden.len(), c.hidden_size)?;
        let mut wants = Vec::with_capacity(items.len());
        for (item, share) in items.iter().zip(&shares) {
            let slot = self.slot_of(item.seq)?;
            let start = self.slots[slot].len;
            kiln_core::check_prefill_hidden(
                item.tokens,
                item.first,
                &hidden[..*share],
                c.hidden_size,
                c.vocab_size,
                start,
                self.max_ctx,
            )?;
            wants.push((slot, start + item.tokens.len()));
        }
        if let Err(why) = &self.prefill {
            return Err(Error::Unsupported(format!(
                "hidden states need the batched prefill: {why}"
            )));
        }
        let dev = self.scoring_buffers()?;
        for slot in self.slots.reserve_all(&wants)? {
            self.write_table(slot)?;
        }
        let runs: Vec<(usize, &[u32], usize)> = items
            .iter()
            .zip(&wants)
            .map(|(item, &(slot, _))| (slot, item.tokens, item.first))
            .collect();
        self.prefill_hidden_rows(&runs, hidden, dev)
    }

    fn decode(&mut self, batch: &[DecodeItem], logits: &mut [f32]) -> Result<()> {
        let vocab = self.config.vocab_size;
        // The whole batch is checked before any step runs: a refused batch changes nothing.
        check_decode(batch, logits, vocab, self.max_ctx, |seq| {
            self.slots.len_of(seq)
        })?;
        self.reserve_batch(batch)?;
        if self.decodes_batched(batch.len()) {
            return self.decode_batched(batch, logits);
        }
        let slots: Vec<usize> = batch
            .iter()
            .map(|it| self.slot_of(it.seq))
            .collect::<Result<_>>()?;
        for (i, (it, &slot)) in batch.iter().zip(&slots).enumerate() {
            self.step(slot, it.token, 0.0)?;
            self.s
                .logits
                .copy_to_host(&self.device, &mut logits[i * vocab..(i + 1) * vocab])
                .map_err(err)?;
        }
        Ok(())
    }

    fn decode_sample(
        &mut self,
        batch: &[DecodeItem],
        samplers: &mut [Sampler],
        tokens: &mut [u32],
    ) -> Result<()> {
        kiln_core::check_sample_slots(batch.len(), samplers.len(), tokens.len())?;
        let vocab = self.config.vocab_size;
        check_decode_items(batch, vocab, self.max_ctx, |seq| self.slots.len_of(seq))?;
        self.reserve_batch(batch)?;
        if self.decodes_batched(batch.len()) {
            return self.decode_sample_batched(batch, samplers, tokens);
        }
        let slots: Vec<usize> = batch
            .iter()
            .map(|it| self.slot_of(it.seq))
            .collect::<Result<_>>()?;
        let mut out = [0i32];
        let mut host_logits: Vec<f32> = Vec::new();
        for ((it, &slot), (sampler, token)) in batch
            .iter()
            .zip(&slots)
            .zip(samplers.iter_mut().zip(tokens.iter_mut()))
        {
            let p = &sampler.params;
            let greedy = p.is_greedy() && p.repeat_penalty == 1.0;
            // A logit bias is drawn on the host here (the one-sequence workspace keeps no
            // room for one; batched steps apply it on the device).
            let on_device = (greedy || Kernels::can_sample(vocab, p)) && p.logit_bias.is_empty();
            if !on_device {
                // Settings the device sampler lacks: logits come down, the host samples.
                self.step(slot, it.token, 0.0)?;
                host_logits.resize(vocab, 0.0);
                self.s
                    .logits
                    .copy_to_host(&self.device, &mut host_logits)
                    .map_err(err)?;
                *token = sampler.sample(&mut host_logits);
                continue;
            }
            let uniform = if greedy { 0.0 } else { sampler.rng.next_f32() };
            self.step(slot, it.token, uniform)?;
            if greedy {
                self.k
                    .argmax(self.s.logits, self.s.keys, self.s.token_out)
                    .map_err(err)?;
            } else {
                let u = self.slots[slot]
                    .state
                    .slice()
                    .sub(3, 1)
                    .and_then(|s| s.cast::<f32>())
                    .map_err(err)?;
                self.k
                    .sample(
                        self.s.logits,
                        &sampler.params,
                        self.s.cand,
                        self.s.rng,
                        Some(u),
                        self.s.token_out,
                    )
                    .map_err(err)?;
            }
            self.s
                .token_out
                .copy_to_host(&self.device, &mut out)
                .map_err(err)?;
            *token = out[0] as u32;
            sampler.accept(*token);
        }
        Ok(())
    }
}
