//! Typed launch wrappers: one function per kernel, checking sizes before anything reaches
//! the device. All work is queued on the device's stream (and so can be captured into a
//! graph); nothing here synchronises.

use std::sync::atomic::{AtomicU8, Ordering};
use std::sync::Arc;

use crate::batch::{BatchAttention, BmmPath};
use crate::buffer::{DevSlice, DeviceBuffer};
use crate::compile::{attention_module, KernelModule, MOE, NORM, ROPE, SAMPLE};
use crate::device::{Args, Device, Function, LaunchConfig};
use crate::error::{KernelError, Result};
use crate::format::WeightFormat;
use crate::kv::{KvFormat, KvPlanes};
use crate::repack::DeviceWeight;

fn opt<T>(s: Option<DevSlice<T>>) -> u64 {
    s.map_or(0, |s| s.ptr())
}

fn invalid(msg: String) -> KernelError {
    KernelError::InvalidArgument(msg)
}

/// An activation vector quantised for the integer GEMVs: Q8_1 int8 values `q` (rows
/// padded to 32) with one (d, d·Σq) pair per 32 in `ds`, and `lo`, the rounding residual of
/// each value at 1/254 of its block's step, so that d/254·(254·q + lo) holds the value to
/// 15 bits of its block's range. Writers always fill all three; `GemvPath::Q8` reads only
/// `q` and `ds`.
#[derive(Debug, Clone, Copy)]
pub struct Q8Act {
    pub q: DevSlice<i8>,
    pub lo: DevSlice<i8>,
    pub ds: DevSlice<[f32; 2]>,
}

impl Q8Act {
    /// Checks that the planes hold `n` values (padded to whole 32-value blocks).
    pub fn check_len(&self, n: usize, what: &str) -> Result<()> {
        let nblk = n.div_ceil(32);
        self.q.check_len(nblk * 32, what)?;
        self.lo.check_len(nblk * 32, what)?;
        self.ds.check_len(nblk, what)
    }
}

/// How a GEMV reads its activation. Float weights (F32, F16, BF16) multiply f32 values
/// either way: on the integer paths each lane dequantises its activation chunk first.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemvPath {
    /// f32 activations, weights dequantised in registers, f32 FMAs. Exact but
    /// instruction-bound: each weight costs a byte extract, a conversion and an FMA.
    Float,
    /// Q8_1 activations (8 bits per 32-value block) and one dp4a per 4 weights: llama.cpp's
    /// trade, which loses fidelity on activations with outlier channels.
    Q8,
    /// Q8_1 plus the residual plane: two dp4a per 4 weights, activations exact to 15 bits
    /// of their block's range (256x finer than Q8_1), combined exactly in an int32.
    Q16,
}

impl GemvPath {
    fn tag(self) -> &'static str {
        match self {
            GemvPath::Float => "f",
            GemvPath::Q8 => "q",
            GemvPath::Q16 => "w",
        }
    }
}

/// The activation a GEMV multiplies: the f32 vector (`GemvPath::Float`) or its quantised
/// planes (the integer paths), and possibly an RMSNorm still to be finished.
#[derive(Debug, Clone, Copy)]
pub struct GemvInput {
    pub x: Option<DevSlice<f32>>,
    pub q8: Option<Q8Act>,
    pub norm: Option<PendingNorm>,
}

/// An RMSNorm its producer left for the consumer to finish: the planes hold x·w (the norm
/// weight applied) and `parts[g]` is Σx² over 32-value group g, so the GEMV scales each
/// output by rsqrt(Σx²/K + eps). Block quantisation is scale-invariant and a dot product
/// linear, so this equals multiplying the normalised vector, without a normalising launch
/// between the two GEMVs. The partials are summed in a fixed order: bit-reproducible.
#[derive(Debug, Clone, Copy)]
pub struct PendingNorm {
    pub parts: DevSlice<f32>,
    pub eps: f32,
}

/// A quantised copy of a kernel's output for the next GEMV: the planes of y·`norm_w`
/// (`norm_w` optional), and with `norm_parts` the Σy² of each 32-value group (see
/// PendingNorm).
#[derive(Debug, Clone, Copy)]
pub struct QuantOut {
    pub q: Q8Act,
    pub norm_w: Option<DevSlice<f32>>,
    pub norm_parts: Option<DevSlice<f32>>,
}

impl QuantOut {
    /// Checks the planes, the weight and the partial sums hold a vector of `n` values.
    fn check(&self, n: usize, what: &str) -> Result<()> {
        self.q.check_len(n, what)?;
        if let Some(w) = self.norm_w {
            w.check_len(n, "next norm's weight")?;
        }
        if let Some(p) = self.norm_parts {
            p.check_len(n.div_ceil(32), "next norm's partial sums")?;
        }
        Ok(())
    }
}

/// Device arrays for one quantised activation of `n` values (the owning side of `Q8Act`).
pub struct QuantBuffers {
    pub q: DeviceBuffer<i8>,
    pub lo: DeviceBuffer<i8>,
    pub ds: DeviceBuffer<[f32; 2]>,
}

impl QuantBuffers {
    pub fn alloc(device: &Arc<Device>, n: usize) -> Result<QuantBuffers> {
        let nblk = n.div_ceil(32);
        Ok(QuantBuffers {
            q: DeviceBuffer::alloc(device, nblk * 32)?,
            lo: DeviceBuffer::alloc(device, nblk * 32)?,
            ds: DeviceBuffer::alloc(device, nblk)?,
        })
    }
    pub fn act(&self) -> Q8Act {
        Q8Act {
            q: self.q.slice(),
            lo: self.lo.slice(),
            ds: self.ds.slice(),
        }
    }
}

/// What a GEMV does to W·x (scale, bias, residual), and whether it quantises its output (then its blocks own whole
/// 32-row groups: the tiling must be one of `GemvTiling::quantising()`).
#[derive(Debug, Clone, Copy, Default)]
pub struct Epilogue {
    pub bias: Option<DevSlice<f32>>,
    /// May be the output itself (x += W·a).
    pub residual: Option<DevSlice<f32>>,
    pub quant: Option<QuantOut>,
    /// SwiGLU mode only: the gated activation (and `bias` then holds the gate rows' biases
    /// followed by the up rows', per matrix).
    pub act: GatedAct,
    /// Not in SwiGLU mode: y = scale·(W·x + bias) + residual (a scaled residual branch or
    /// scaled logits, Granite's multipliers); `None` is 1.
    pub scale: Option<f32>,
}

/// A gated feed-forward's activation on the device (`glu` in cuda/common.cuh), what
/// core's [`kiln_core::Activation`] says for a gated one.
#[derive(Debug, Clone, Copy, PartialEq, Default)]
pub enum GatedAct {
    /// silu(gate)·up (SwiGLU).
    #[default]
    Silu,
    /// gelu_tanh(gate)·up (GeGLU, Gemma's).
    Gelu,
    /// gpt-oss's: gate at most `limit`, up within ±`limit`, gate·σ(alpha·gate)·(up + 1).
    Clamped { alpha: f32, limit: f32 },
}

impl GatedAct {
    /// The kernels' (act, alpha, limit) arguments.
    pub(crate) fn args(self) -> (i32, f32, f32) {
        match self {
            GatedAct::Silu => (0, 0.0, 0.0),
            GatedAct::Gelu => (1, 0.0, 0.0),
            GatedAct::Clamped { alpha, limit } => (2, alpha, limit),
        }
    }
}

impl From<kiln_core::Activation> for GatedAct {
    fn from(a: kiln_core::Activation) -> GatedAct {
        match a {
            kiln_core::Activation::Silu => GatedAct::Silu,
            kiln_core::Activation::Gelu => GatedAct::Gelu,
            kiln_core::Activation::SwigluOai { alpha, limit } => GatedAct::Clamped { alpha, limit },
        }
    }
}

/// The experts a Mixture-of-Experts GEMV multiplies: its weight stacks `count` matrices of
/// equal shape (rows `e·rows/count..` are expert `e`'s), and slot `j` of the launch
/// multiplies matrix `ids[j]`, writing rows `j·rows/count..` of the output (and of its
/// quantised copy, each slot's planes padded to whole 32-value blocks). The ids are read on
/// the device, so a router's choice never returns to the host.
#[derive(Debug, Clone, Copy)]
pub struct ExpertSlots {
    pub count: usize,
    pub ids: DevSlice<i32>,
    /// Which input a slot reads: 0, the one input every slot shares (the gate and up
    /// projections at one token); `n`, input `j / n` (inputs one after another, padded to
    /// whole 32-value blocks in the quantised planes) — 1 for a slot's own (the down
    /// projection after each expert's activation), a token's expert count for that token's.
    pub slots_per_input: usize,
    /// The order the launch runs its slots in (a permutation of them, from
    /// [`Kernels::order_experts`]: sorted by expert, so the blocks running at once share an
    /// expert's rows in L2); `None`: slot order. The results do not depend on it.
    pub order: Option<DevSlice<i32>>,
}

impl ExpertSlots {
    /// (rows a slot computes, slots, inputs read) of a launch over a weight of `rows` rows
    /// stored in groups of `row_group`, or why the slots do not fit it.
    fn launch_shape(&self, rows: usize, row_group: usize) -> Result<(usize, usize, usize)> {
        if self.count == 0 || !rows.is_multiple_of(self.count) {
            return Err(invalid(format!(
                "{rows} rows do not stack {} experts' matrices",
                self.count
            )));
        }
        let per_expert = rows / self.count;
        if !per_expert.is_multiple_of(row_group) {
            return Err(invalid(format!(
                "an expert's {per_expert} rows are not whole groups of {row_group}"
            )));
        }
        let slots = self.ids.len();
        if slots == 0 || slots > u16::MAX as usize {
            return Err(invalid(format!("{slots} expert slots")));
        }
        if let Some(order) = self.order {
            order.check_len(slots, "slot order")?;
        }
        let inputs = match self.slots_per_input {
            0 => 1,
            n => slots.div_ceil(n),
        };
        Ok((per_expert, slots, inputs))
    }
}

/// The most experts a token may use ([`Kernels::route_experts`]: `moe_route` keeps pick
/// `j` in lane `j` of one warp).
pub const MAX_EXPERTS_USED: usize = 32;

/// The most experts a layer may have on the GPU ([`Kernels::order_experts`];
/// `MOE_MAX_EXPERTS` in `cuda/moe.cu`).
pub const MAX_EXPERTS: usize = 1024;

/// How a GEMV spreads work over a block's 4 warps: each warp owns `rows_per_warp` rows, and
/// `warps_per_row` warps split one row group's length between them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GemvTiling {
    pub rows_per_warp: usize,
    pub warps_per_row: usize,
}

impl GemvTiling {
    pub const fn new(rows_per_warp: usize, warps_per_row: usize) -> Self {
        GemvTiling {
            rows_per_warp,
            warps_per_row,
        }
    }
    /// Every tiling the kernels are instantiated for.
    pub fn all() -> impl Iterator<Item = GemvTiling> {
        [1, 2, 4]
            .into_iter()
            .flat_map(|r| [1, 2, 4].into_iter().map(move |s| GemvTiling::new(r, s)))
    }
    /// The tilings of the quantising kernels, whose blocks (32·S/R warps) own one 32-row
    /// group each.
    pub fn quantising() -> impl Iterator<Item = GemvTiling> {
        [(4, 2), (2, 1), (4, 1)]
            .into_iter()
            .map(|(r, s)| GemvTiling::new(r, s))
    }
    fn check(&self, quantising: bool) -> Result<()> {
        let ok = if quantising {
            Self::quantising().any(|t| t == *self)
        } else {
            [1, 2, 4].contains(&self.rows_per_warp) && [1, 2, 4].contains(&self.warps_per_row)
        };
        if ok {
            Ok(())
        } else if quantising {
            Err(invalid(format!(
                "GEMV tiling {self:?}: a quantising GEMV takes one of {:?}",
                Self::quantising().collect::<Vec<_>>()
            )))
        } else {
            Err(invalid(format!(
                "GEMV tiling {self:?}: rows per warp and warps per row must be 1, 2 or 4"
            )))
        }
    }
    /// Launch geometry over `rows` output rows.
    fn grid(&self, rows: usize, quantising: bool) -> LaunchConfig {
        if quantising {
            let warps = 32 * self.warps_per_row / self.rows_per_warp;
            LaunchConfig::linear(rows.div_ceil(32) as u32, (warps * 32) as u32)
        } else {
            let per_block = GEMV_WARPS as usize / self.warps_per_row * self.rows_per_warp;
            LaunchConfig::linear(rows.div_ceil(per_block) as u32, GEMV_WARPS * 32)
        }
    }
}

/// Warps per GEMV block (`__launch_bounds__(128)` in gemv.cu).
const GEMV_WARPS: u32 = 4;

pub struct Kernels {
    device: Arc<Device>,
    /// Which kernels the batched matmuls over K-quant weights run (a [`BmmPath`] as u8).
    bmm_path: AtomicU8,
    /// The pipelined walks' stages in flight and the blocks per SM their splits aim at
    /// (`Kernels::set_bmm_pipeline`).
    bmm_stages: AtomicU8,
    bmm_blocks_per_sm: AtomicU8,
    /// Which kernels the batched decode attention runs (a [`BatchAttention`] as u8).
    batch_attention: AtomicU8,
}

impl Kernels {
    pub fn new(device: &Arc<Device>) -> Self {
        Kernels {
            device: device.clone(),
            bmm_path: AtomicU8::new(BmmPath::PipelinedF16 as u8),
            bmm_stages: AtomicU8::new(2),
            bmm_blocks_per_sm: AtomicU8::new(2),
            batch_attention: AtomicU8::new(BatchAttention::Auto as u8),
        }
    }

    /// Chooses the kernels of the batched matmuls over K-quant weights (`cuda/bmm.cu`;
    /// [`BmmPath::PipelinedF16`] by default; the register walk to check beside it).
    /// Graphs captured before keep the kernels they were captured with.
    pub fn set_bmm_path(&self, path: BmmPath) {
        self.bmm_path.store(path as u8, Ordering::Relaxed);
    }

    /// The pipelined walks' depth (2 to 4 stages) and the blocks per SM (1 to 8) their
    /// row-length splits aim at; (2, 2) by default. For measurements: size partial-sum
    /// buffers after setting it.
    pub fn set_bmm_pipeline(&self, stages: usize, blocks_per_sm: usize) {
        self.bmm_stages
            .store(stages.clamp(2, 4) as u8, Ordering::Relaxed);
        self.bmm_blocks_per_sm
            .store(blocks_per_sm.clamp(1, 8) as u8, Ordering::Relaxed);
    }

    pub(crate) fn bmm_pipeline(&self) -> (usize, usize) {
        (
            self.bmm_stages.load(Ordering::Relaxed) as usize,
            self.bmm_blocks_per_sm.load(Ordering::Relaxed) as usize,
        )
    }

    /// Chooses the batched decode attention's kernels ([`BatchAttention::Auto`] by
    /// default). Graphs captured before keep the kernels they were captured with.
    pub fn set_batch_attention(&self, kind: BatchAttention) {
        self.batch_attention.store(kind as u8, Ordering::Relaxed);
    }

    pub fn batch_attention(&self) -> BatchAttention {
        match self.batch_attention.load(Ordering::Relaxed) {
            0 => BatchAttention::Auto,
            1 => BatchAttention::Heads,
            _ => BatchAttention::GroupMma,
        }
    }

    pub fn bmm_path(&self) -> BmmPath {
        match self.bmm_path.load(Ordering::Relaxed) {
            0 => BmmPath::Registers,
            _ => BmmPath::PipelinedF16,
        }
    }

    /// Launches `f` now.
    ///
    /// # Safety
    /// As for [`Device::launch`].
    pub(crate) unsafe fn launch(
        &self,
        f: Function,
        cfg: LaunchConfig,
        args: &mut Args,
    ) -> Result<()> {
        // SAFETY: this fn's contract is the device launch's.
        unsafe { self.device.launch(f, cfg, args) }
    }

    /// Launches kernel `name` of `module`.
    ///
    /// # Safety
    /// As for [`Device::launch`].
    unsafe fn submit(
        &self,
        module: &KernelModule,
        name: &str,
        cfg: LaunchConfig,
        mut args: Args,
    ) -> Result<()> {
        let f = self.device.function(module, name)?;
        // SAFETY: this fn's contract is the device launch's.
        unsafe { self.device.launch(f, cfg, &mut args) }
    }

    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// Compiles and loads every module now (otherwise each loads at its first launch).
    pub fn preload(&self) -> Result<()> {
        self.device.load_modules(&crate::compile::all_modules())
    }

    /// The modules a model with weights in `formats`, heads of `head_dim` values, a KV
    /// cache in `kv` and GEMVs on `path` needs: the shared ones, its attention and its formats' embedding
    /// lookups and GEMVs on that path; with `prefill` the batched prefill's
    /// (dequantisers, row kernels); with `batched` the batched decode's matmuls.
    pub fn modules_for(
        formats: &[&'static WeightFormat],
        path: GemvPath,
        head_dim: usize,
        kv: KvFormat,
        prefill: bool,
        batched: bool,
    ) -> Result<Vec<KernelModule>> {
        let mut v = vec![
            NORM,
            ROPE,
            MOE,
            SAMPLE,
            crate::compile::attention_module(head_dim, kv)?,
        ];
        for f in formats {
            v.push(f.embed);
            v.extend_from_slice(f.gemv.for_path(path));
        }
        if prefill {
            v.push(crate::compile::PREFILL);
            v.extend(formats.iter().map(|f| f.dequant));
        }
        if batched {
            v.extend(formats.iter().filter_map(|f| f.batched));
        }
        v.sort_by_key(|m| m.name);
        v.dedup();
        Ok(v)
    }

    /// Compiles (the missing ones in parallel) and loads `modules`. Call before capturing
    /// a graph: a capture cannot load modules.
    pub fn preload_modules(&self, modules: &[KernelModule]) -> Result<()> {
        self.device.load_modules(modules)
    }

    /// For each of `rows` rows of `n` values: v = x · rsqrt(mean(x²) + eps) · w, written
    /// as f32 to `y` and/or as Q8_1 to `q8`. `eps = None` skips the normalisation and
    /// `w = None` the scaling (plain quantisation).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_q8_1(
        &self,
        x: DevSlice<f32>,
        rows: usize,
        n: usize,
        w: Option<DevSlice<f32>>,
        eps: Option<f32>,
        y: Option<DevSlice<f32>>,
        q8: Option<Q8Act>,
    ) -> Result<()> {
        if n == 0 || rows == 0 {
            return Err(invalid("empty RMSNorm".into()));
        }
        x.check_len(rows * n, "RMSNorm input")?;
        if let Some(w) = w {
            w.check_len(n, "RMSNorm weight")?;
        }
        if let Some(y) = y {
            y.check_len(rows * n, "RMSNorm output")?;
        }
        let nblk = n.div_ceil(32);
        if let Some(q) = q8 {
            q.check_len(rows * nblk * 32, "quantised RMSNorm output")?;
        }
        self.norm_quant_launch(x, rows, n, w, eps.unwrap_or(-1.0), y, q8, None)
    }

    /// The quantising epilogue as a launch of its own: `out` gets the planes of x·norm_w
    /// and the per-group Σx² of the `n` values of `x` (for a producer whose blocks do not
    /// own whole 32-row groups).
    pub fn quantize(&self, x: DevSlice<f32>, n: usize, out: &QuantOut) -> Result<()> {
        if n == 0 {
            return Err(invalid("quantising an empty vector".into()));
        }
        x.check_len(n, "vector to quantise")?;
        out.check(n, "quantised vector")?;
        self.norm_quant_launch(x, 1, n, out.norm_w, -1.0, None, Some(out.q), out.norm_parts)
    }

    /// The `rmsnorm_q8_1` kernel behind `rmsnorm_q8_1` and `quantize`, sizes checked by
    /// them: one warp per 32-value block, 8 warps per block of threads, a grid row per row
    /// (`eps < 0`: no normalisation).
    #[allow(clippy::too_many_arguments)]
    fn norm_quant_launch(
        &self,
        x: DevSlice<f32>,
        rows: usize,
        n: usize,
        w: Option<DevSlice<f32>>,
        eps: f32,
        y: Option<DevSlice<f32>>,
        q8: Option<Q8Act>,
        parts: Option<DevSlice<f32>>,
    ) -> Result<()> {
        const WARPS: usize = 8;
        let f = self.device.function(&NORM, "rmsnorm_q8_1")?;
        let mut args = Args::new()
            .ptr(x.ptr())
            .ptr(opt(w))
            .f32(eps)
            .ptr(opt(y))
            .ptr(q8.map_or(0, |q| q.q.ptr()))
            .ptr(q8.map_or(0, |q| q.lo.ptr()))
            .ptr(q8.map_or(0, |q| q.ds.ptr()))
            .ptr(opt(parts))
            .i32(n as i32);
        let cfg = LaunchConfig {
            grid: (n.div_ceil(32).div_ceil(WARPS) as u32, rows as u32, 1),
            block: (32 * WARPS as u32, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: the callers checked x, y and the planes against rows * n values.
        unsafe { self.launch(f, cfg, &mut args) }
    }

    /// Checks a GEMV (or SwiGLU, with `w2`) launch and returns its kernel and arguments;
    /// with `experts`, one launch over the chosen experts' matrices (see [`ExpertSlots`]).
    #[allow(clippy::too_many_arguments)]
    fn gemv_launch(
        &self,
        kind: &str,
        w: &DeviceWeight,
        w2: Option<&DeviceWeight>,
        experts: Option<&ExpertSlots>,
        input: &GemvInput,
        path: GemvPath,
        t: GemvTiling,
        y: DevSlice<f32>,
        epi: &Epilogue,
    ) -> Result<(KernelModule, String, LaunchConfig, Args)> {
        let quantising = epi.quant.is_some();
        t.check(quantising)?;
        if !t.rows_per_warp.is_multiple_of(w.format.row_group) {
            return Err(invalid(format!(
                "GEMV tiling {t:?}: {} weights are stored in groups of {} rows, a warp must own whole groups",
                w.format.tag, w.format.row_group
            )));
        }
        if quantising && path == GemvPath::Float {
            return Err(invalid(
                "a quantising GEMV reads quantised input (GemvPath::Q8 or Q16)".into(),
            ));
        }
        // The rows one launch slot computes, the slots, and the inputs they read.
        let (rows, slots, inputs) = match experts {
            None => (w.rows, 1, 1),
            Some(e) => {
                if epi.residual.is_some() || epi.quant.is_some_and(|q| q.norm_w.is_some()) {
                    return Err(invalid(
                        "an experts' GEMV writes each slot's own output: no residual or next norm"
                            .into(),
                    ));
                }
                e.launch_shape(w.rows, w.format.row_group)?
            }
        };
        let padded = |n: usize| n.div_ceil(32) * 32;
        match path {
            GemvPath::Float => {
                let x = input
                    .x
                    .ok_or_else(|| invalid("the float GEMV needs the f32 activation".into()))?;
                x.check_len(inputs * w.row_len, "GEMV input")?;
                if input.norm.is_some() {
                    return Err(invalid(
                        "the float GEMV reads a finished activation (no pending norm)".into(),
                    ));
                }
            }
            GemvPath::Q8 | GemvPath::Q16 => input
                .q8
                .ok_or_else(|| invalid("the integer GEMV needs the quantised activation".into()))?
                .check_len(inputs * padded(w.row_len), "quantised GEMV input")?,
        }
        if let Some(n) = input.norm {
            n.parts.check_len(
                inputs * w.row_len.div_ceil(32),
                "pending norm's partial sums",
            )?;
        }
        y.check_len(slots * rows, "GEMV output")?;
        if let Some(b) = epi.bias {
            // Gated: the gate rows' biases, then the up rows'.
            let per_row = if w2.is_some() { 2 } else { 1 };
            b.check_len(per_row * w.rows, "GEMV bias")?;
        }
        if let Some(r) = epi.residual {
            r.check_len(rows, "GEMV residual")?;
        }
        if let Some(q) = epi.quant {
            q.check(
                if slots > 1 {
                    slots * padded(rows)
                } else {
                    rows
                },
                "quantised GEMV output",
            )?;
        }
        let name = format!(
            "{kind}{}_{}_{}_{}_{}",
            if quantising { "q" } else { "" },
            w.format.tag,
            path.tag(),
            t.rows_per_warp,
            t.warps_per_row
        );
        let module = w.format.gemv.module(path, quantising).ok_or_else(|| {
            invalid(format!(
                "{} GEMVs that quantise their output need an integer path",
                w.format.tag
            ))
        })?;
        let module = *module;
        let (body, qh, sc) = w.ptrs();
        let (body2, qh2, sc2) = w2.map_or((0, 0, 0), |w2| w2.ptrs());
        let q = epi.quant;
        let args = Args::new()
            .ptr(body)
            .ptr(qh)
            .ptr(sc)
            .ptr(body2)
            .ptr(qh2)
            .ptr(sc2)
            .ptr(opt(input.x))
            .ptr(input.q8.map_or(0, |q| q.q.ptr()))
            .ptr(input.q8.map_or(0, |q| q.lo.ptr()))
            .ptr(input.q8.map_or(0, |q| q.ds.ptr()))
            .ptr(input.norm.map_or(0, |n| n.parts.ptr()))
            .f32(input.norm.map_or(0.0, |n| n.eps))
            .ptr(opt(epi.bias))
            .ptr(opt(epi.residual))
            .ptr(y.ptr())
            .i32(rows as i32)
            .i32(w.row_len as i32)
            .ptr(q.map_or(0, |q| opt(q.norm_w)))
            .ptr(q.map_or(0, |q| q.q.q.ptr()))
            .ptr(q.map_or(0, |q| q.q.lo.ptr()))
            .ptr(q.map_or(0, |q| q.q.ds.ptr()))
            .ptr(q.map_or(0, |q| opt(q.norm_parts)))
            .i32(epi.act.args().0)
            .f32(epi.act.args().1)
            .f32(epi.act.args().2)
            .f32(epi.scale.unwrap_or(1.0))
            .ptr(experts.map_or(0, |e| e.ids.ptr()))
            .i32(experts.map_or(0, |e| e.slots_per_input) as i32)
            .ptr(experts.map_or(0, |e| opt(e.order)));
        let mut cfg = t.grid(rows, quantising);
        cfg.grid.1 = slots as u32;
        Ok((module, name, cfg, args))
    }

    /// y = W·x, with the epilogue's bias, residual and quantised copy.
    pub fn gemv(
        &self,
        w: &DeviceWeight,
        input: &GemvInput,
        path: GemvPath,
        tiling: GemvTiling,
        y: DevSlice<f32>,
        epi: &Epilogue,
    ) -> Result<()> {
        self.gemv_slots(w, None, input, path, tiling, y, epi)
    }

    /// [`Kernels::gemv`], or with `experts` y_j = W_{ids[j]}·x_j for each of its slots `j`
    /// (x_j the input `experts.slots_per_input` gives it), with the epilogue's bias (stacked
    /// per expert), scale and quantised copy (each slot's own planes).
    #[allow(clippy::too_many_arguments)]
    pub fn gemv_slots(
        &self,
        w: &DeviceWeight,
        experts: Option<&ExpertSlots>,
        input: &GemvInput,
        path: GemvPath,
        tiling: GemvTiling,
        y: DevSlice<f32>,
        epi: &Epilogue,
    ) -> Result<()> {
        let (module, name, cfg, args) =
            self.gemv_launch("gemv", w, None, experts, input, path, tiling, y, epi)?;
        // SAFETY: every array's length was checked against the weight's shape (and the
        // slots); expert ids index the `count` stacked matrices (written by
        // `route_experts`, which picks among `count`).
        unsafe { self.submit(&module, &name, cfg, args) }
    }

    /// y = row `*token` of `w`, dequantised and times `scale` (the embedding lookup; an id
    /// out of range writes NaN), and optionally its quantised copy.
    pub fn embed(
        &self,
        w: &DeviceWeight,
        token: DevSlice<i32>,
        scale: f32,
        y: DevSlice<f32>,
        quant: Option<QuantOut>,
    ) -> Result<()> {
        token.check_len(1, "token id")?;
        y.check_len(w.row_len, "embedding output")?;
        if let Some(q) = quant {
            q.check(w.row_len, "quantised embedding")?;
        }
        let (body, qh, sc) = w.ptrs();
        let args = Args::new()
            .ptr(body)
            .ptr(qh)
            .ptr(sc)
            .ptr(token.ptr())
            .ptr(y.ptr())
            .i32(w.rows as i32)
            .i32(w.row_len as i32)
            .ptr(quant.map_or(0, |q| opt(q.norm_w)))
            .ptr(quant.map_or(0, |q| q.q.q.ptr()))
            .ptr(quant.map_or(0, |q| q.q.lo.ptr()))
            .ptr(quant.map_or(0, |q| q.q.ds.ptr()))
            .ptr(quant.map_or(0, |q| opt(q.norm_parts)))
            .f32(scale);
        // SAFETY: the kernel reads one row (id checked on the device) and writes row_len values.
        unsafe {
            self.submit(
                &w.format.embed,
                &format!("embed_{}", w.format.tag),
                LaunchConfig::linear(w.row_len.div_ceil(128) as u32, 128),
                args,
            )
        }
    }

    /// y = act(gate·x, up·x): the fused first half of a gated feed-forward ([`GatedAct`]:
    /// SwiGLU, GeGLU or gpt-oss's clamped form), with an optional quantised copy of y for
    /// the down projection.
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu(
        &self,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        input: &GemvInput,
        path: GemvPath,
        tiling: GemvTiling,
        y: DevSlice<f32>,
        quant: Option<QuantOut>,
        act: GatedAct,
    ) -> Result<()> {
        self.swiglu_slots(gate, up, None, input, path, tiling, y, quant, None, act)
    }

    /// [`Kernels::swiglu`], or with `experts` y_j = act(gate_{ids[j]}·x_j, up_{ids[j]}·x_j)
    /// for each of its slots `j` (x_j the input `experts.slots_per_input` gives it), with
    /// each slot's quantised copy. `bias` (2·rows values) holds each matrix's gate rows'
    /// biases followed by its up rows', added before the activation.
    #[allow(clippy::too_many_arguments)]
    pub fn swiglu_slots(
        &self,
        gate: &DeviceWeight,
        up: &DeviceWeight,
        experts: Option<&ExpertSlots>,
        input: &GemvInput,
        path: GemvPath,
        tiling: GemvTiling,
        y: DevSlice<f32>,
        quant: Option<QuantOut>,
        bias: Option<DevSlice<f32>>,
        act: GatedAct,
    ) -> Result<()> {
        if gate.qtype != up.qtype || gate.rows != up.rows || gate.row_len != up.row_len {
            return Err(invalid(format!(
                "gate ({} {}x{}) and up ({} {}x{}) differ",
                gate.qtype, gate.rows, gate.row_len, up.qtype, up.rows, up.row_len
            )));
        }
        let epi = Epilogue {
            quant,
            bias,
            act,
            ..Default::default()
        };
        let (module, name, cfg, args) = self.gemv_launch(
            "swiglu",
            gate,
            Some(up),
            experts,
            input,
            path,
            tiling,
            y,
            &epi,
        )?;
        // SAFETY: as for gemv_slots; `up` has gate's shape.
        unsafe { self.submit(&module, &name, cfg, args) }
    }

    /// Routes each of `rows` tokens: row `t` of `logits` holds its `count` router logits;
    /// `ids[t·used..]` get its `used` most probable experts in ascending order (equal
    /// logits to the lower index) and `weights` their softmax probabilities, divided by
    /// the chosen ones' sum when `normalize`. A NaN logit makes the token's weights NaN.
    #[allow(clippy::too_many_arguments)]
    pub fn route_experts(
        &self,
        logits: DevSlice<f32>,
        rows: usize,
        count: usize,
        used: usize,
        normalize: bool,
        ids: DevSlice<i32>,
        weights: DevSlice<f32>,
    ) -> Result<()> {
        if rows == 0 || used == 0 || used > count || used > MAX_EXPERTS_USED || count > MAX_EXPERTS
        {
            return Err(invalid(format!(
                "routing {rows} tokens to {used} of {count} experts (at most {MAX_EXPERTS_USED} of {MAX_EXPERTS})"
            )));
        }
        logits.check_len(rows * count, "router logits")?;
        ids.check_len(rows * used, "chosen experts")?;
        weights.check_len(rows * used, "experts' weights")?;
        let args = Args::new()
            .ptr(logits.ptr())
            .i32(count as i32)
            .i32(used as i32)
            .i32(normalize as i32)
            .ptr(ids.ptr())
            .ptr(weights.ptr());
        // SAFETY: the logits, ids and weights were checked against rows, count and used.
        unsafe {
            self.submit(
                &MOE,
                "moe_route",
                // One warp a token (see cuda/moe.cu).
                LaunchConfig::linear(rows as u32, 32),
                args,
            )
        }
    }

    /// Writes into `order` the slots of `ids` (each an expert id below `count`) sorted by
    /// expert: the order an experts' GEMV over a batch runs its slots in
    /// ([`ExpertSlots::order`]); with `starts` (count + 1 values) also where each expert's
    /// slots begin in it, as a grouped matmul reads them ([`ExpertGroups`]).
    pub fn order_experts(
        &self,
        ids: DevSlice<i32>,
        count: usize,
        order: DevSlice<i32>,
        starts: Option<DevSlice<i32>>,
    ) -> Result<()> {
        if count == 0 || count > MAX_EXPERTS || ids.len() > i32::MAX as usize {
            return Err(invalid(format!(
                "ordering {} slots over {count} experts (at most {MAX_EXPERTS})",
                ids.len()
            )));
        }
        order.check_len(ids.len(), "slot order")?;
        if let Some(starts) = starts {
            starts.check_len(count + 1, "expert starts")?;
        }
        let args = Args::new()
            .ptr(ids.ptr())
            .i32(ids.len() as i32)
            .i32(count as i32)
            .ptr(order.ptr())
            .ptr(opt(starts));
        // SAFETY: `order` holds a value per id and `starts` count + 1; the ids were written
        // by `route_experts` among `count` experts, which the kernel's histogram holds.
        unsafe { self.submit(&MOE, "moe_order", LaunchConfig::linear(1, 1024), args) }
    }

    /// Joins each of `rows` tokens' experts: `out[t] = residual[t] + scale·Σ_j
    /// weights[t·used + j]·y[t·used + j]` over rows of `n` values (`residual` may be `out`;
    /// `None`: out = scale·Σ), and with `quant` the planes of out times its norm weight and
    /// their per-group Σout² for the next GEMV.
    #[allow(clippy::too_many_arguments)]
    pub fn combine_experts(
        &self,
        y: DevSlice<f32>,
        weights: DevSlice<f32>,
        rows: usize,
        used: usize,
        n: usize,
        scale: f32,
        residual: Option<DevSlice<f32>>,
        out: DevSlice<f32>,
        quant: Option<&QuantOut>,
    ) -> Result<()> {
        if rows == 0 || used == 0 || n == 0 {
            return Err(invalid(format!(
                "joining {used} experts' outputs of {n} values for {rows} tokens"
            )));
        }
        y.check_len(rows * used * n, "experts' outputs")?;
        weights.check_len(rows * used, "experts' weights")?;
        out.check_len(rows * n, "joined output")?;
        if let Some(r) = residual {
            r.check_len(rows * n, "residual")?;
        }
        if let Some(q) = quant {
            q.q.check_len(rows * n.div_ceil(32) * 32, "quantised joined output")?;
            if let Some(w) = q.norm_w {
                w.check_len(n, "next norm's weight")?;
            }
            if let Some(p) = q.norm_parts {
                p.check_len(rows * n.div_ceil(32), "next norm's partial sums")?;
            }
        }
        const WARPS: usize = 8;
        let args = Args::new()
            .ptr(y.ptr())
            .ptr(weights.ptr())
            .i32(used as i32)
            .f32(scale)
            .ptr(opt(residual))
            .ptr(out.ptr())
            .ptr(quant.map_or(0, |q| opt(q.norm_w)))
            .ptr(quant.map_or(0, |q| q.q.q.ptr()))
            .ptr(quant.map_or(0, |q| q.q.lo.ptr()))
            .ptr(quant.map_or(0, |q| q.q.ds.ptr()))
            .ptr(quant.map_or(0, |q| opt(q.norm_parts)))
            .i32(n as i32);
        let cfg = LaunchConfig {
            grid: (n.div_ceil(32).div_ceil(WARPS) as u32, rows as u32, 1),
            block: (32 * WARPS as u32, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: every array was checked against rows, used and n.
        unsafe { self.submit(&MOE, "moe_combine", cfg, args) }
    }

    /// RoPE on Q and K of a fused QKV vector, K and V written to the cache at `*pos`: in
    /// row `*pos % max_ctx` of a ring of `max_ctx` rows (a sliding-window layer's), or
    /// through `kv`'s block table in a paged pool of `max_ctx` rows a head.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv(
        &self,
        a: &RopeArgs,
        qkv: DevSlice<f32>,
        q_out: DevSlice<f32>,
        kv: KvPlanes,
        pos: DevSlice<i32>,
        max_ctx: usize,
    ) -> Result<()> {
        a.check(&kv, max_ctx)?;
        check_one_table(&kv)?;
        let hd = a.head_dim;
        qkv.check_len((a.n_heads + 2 * a.n_kv) * hd, "QKV")?;
        q_out.check_len(a.n_heads * hd, "rotated Q")?;
        pos.check_len(1, "position")?;
        let threads = ((hd / 2).div_ceil(32) * 32) as u32;
        let args = kv
            .push(Args::new().ptr(qkv.ptr()).ptr(q_out.ptr()))
            .ptr(pos.ptr())
            .rope(a)
            .i32(max_ctx as i32)
            .ptr(kv.table_ptr());
        let heads = a.n_heads + a.n_kv;
        // SAFETY: sizes checked; the position must be < max_ctx (and, paged, below what the
        // table holds, its entries blocks of the pool), which the executor owns.
        unsafe {
            self.submit(
                &ROPE,
                &format!("rope_kv{}", kv.format.kernel_suffix()),
                LaunchConfig::linear(heads as u32, threads),
                args,
            )
        }
    }

    /// Most split blocks a decode attention launch has per head: a context longer than
    /// `split` × this takes longer splits (the kernel sizes them from the length).
    pub const MAX_ATTENTION_SPLITS: usize = 128;

    /// Split blocks per head for a cache of `max_ctx` rows and splits of at least `split`
    /// positions: the grid's `y` that serves every length up to the cache's (partial-result
    /// buffers hold this many per head).
    pub fn attention_splits(max_ctx: usize, split: usize) -> usize {
        max_ctx.div_ceil(split).clamp(1, Self::MAX_ATTENTION_SPLITS)
    }

    /// Positions per split block of a decode attention over `span` positions in a grid of
    /// `grid_splits` blocks per head, splits of at least `split`: the rule the kernel
    /// applies on the device (`attn_partial_impl` in attention.cu; the two must agree).
    /// Short spans take short splits (16 of them up to 4,096 positions) so that many blocks
    /// share the work; longer spans take 256, or as many as fill the grid.
    pub fn attention_split_len(span: usize, split: usize, grid_splits: usize) -> usize {
        let even = span.div_ceil(16).div_ceil(32).saturating_mul(32).min(256);
        let most = span
            .div_ceil(grid_splits.max(1))
            .div_ceil(32)
            .saturating_mul(32);
        split.max(even).max(most)
    }

    /// Split blocks that do work in a decode attention over `span` positions of a cache of
    /// `max_ctx` rows (the rest of its grid returns at once).
    pub fn attention_working_splits(span: usize, max_ctx: usize, split: usize) -> usize {
        let grid = Self::attention_splits(max_ctx, split);
        span.div_ceil(Self::attention_split_len(span, split, grid))
            .clamp(1, grid)
    }

    /// The grid (split blocks per head) a step whose longest span needs `working` split
    /// blocks launches with ([`Kernels::attention_working_splits`], the most over a step's
    /// layers): the next power of two, at most `max_splits` (the cache's
    /// [`Kernels::attention_splits`]). Each such grid computes exactly what the full grid
    /// does (the same split lengths, bit for bit) without its empty blocks — at a context
    /// of a few tokens the full grid of a 128k cache is 128 blocks a head with one working,
    /// and scheduling the empty ones cost more than the attention — and a bounded number of
    /// grids (one captured graph each) serves every length.
    pub fn attention_grid_splits(working: usize, max_splits: usize) -> usize {
        working.max(1).next_power_of_two().min(max_splits.max(1))
    }

    /// Decode attention of one query per head over positions `0..*len` of the cache (the
    /// last `a.window` of them when set, in a ring of `a.max_ctx` rows), one launch:
    /// split-K blocks write partials (`part_o`: heads·splits·hd floats, `part_ml`:
    /// heads·splits pairs) and the last block of each group of heads merges them into
    /// `out`, counted in `counters` (one per head, zero before the first launch, left zero).
    /// `a.heads` says how the query heads of a GQA group share blocks ([`AttnHeads`]). With
    /// `out_q8` the output is also written quantised.
    #[allow(clippy::too_many_arguments)]
    pub fn attention(
        &self,
        a: &AttnArgs,
        q: DevSlice<f32>,
        kv: KvPlanes,
        len: DevSlice<i32>,
        part_o: DevSlice<f32>,
        part_ml: DevSlice<[f32; 2]>,
        counters: DevSlice<u32>,
        out: DevSlice<f32>,
        out_q8: Option<Q8Act>,
    ) -> Result<()> {
        a.check()?;
        let hd = a.head_dim;
        let nsplit = a.grid_splits();
        q.check_len(a.n_heads * hd, "attention Q")?;
        let io = AttnIo {
            len,
            part_o,
            part_ml,
            counters,
            out,
            out_q8,
        };
        let rows = io.check(a, &kv)?;
        let module = attention_module(hd, kv.format)?;
        let heads = match a.heads {
            AttnHeads::Group if !a.group_kernel_fits(kv.format) => AttnHeads::One,
            h => h,
        };
        let args = io.push(kv.push(Args::new().ptr(q.ptr())), a, &kv, rows);
        if heads == AttnHeads::Group {
            let f = self
                .device
                .function_with_shared(&module, &format!("attn_decode_group_{}", hd / 32))?;
            let cfg = LaunchConfig {
                grid: (a.n_kv as u32, nsplit as u32, 1),
                block: (128, 1, 1),
                shared_bytes: crate::batch::attn_group_smem(hd) as u32,
            };
            let mut args = args;
            // SAFETY: sizes checked; `*len` must be ≤ max_ctx, which the executor owns.
            return unsafe { self.device.launch(f, cfg, &mut args) };
        }
        let pairs = heads == AttnHeads::Pairs;
        let name = format!(
            "attn_decode{}{}_{}",
            if pairs { "_pairs" } else { "" },
            kv.format.kernel_suffix(),
            hd / 32
        );
        let cfg = LaunchConfig {
            grid: (a.n_heads as u32, nsplit as u32, 1),
            block: (128, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: sizes checked; `*len` must be ≤ max_ctx, which the executor owns.
        unsafe { self.submit(&module, &name, cfg, args) }
    }

    /// Logits per argmax block.
    pub const ARGMAX_SLICE: usize = 4096;

    /// Scratch keys `argmax` needs for `n` logits.
    pub fn argmax_scratch(n: usize) -> usize {
        n.div_ceil(Self::ARGMAX_SLICE)
    }

    /// `*out` = index of the largest of `logits` (lowest on ties, NaN never).
    pub fn argmax(
        &self,
        logits: DevSlice<f32>,
        scratch: DevSlice<u64>,
        out: DevSlice<i32>,
    ) -> Result<()> {
        let n = logits.len();
        if n == 0 || n > i32::MAX as usize {
            return Err(invalid(format!("argmax over {n} values")));
        }
        let blocks = Self::argmax_scratch(n);
        scratch.check_len(blocks, "argmax scratch")?;
        out.check_len(1, "argmax output")?;
        let f = self.device.function(&SAMPLE, "argmax_partial")?;
        let mut args = Args::new()
            .ptr(logits.ptr())
            .i32(n as i32)
            .i32(Self::ARGMAX_SLICE as i32)
            .ptr(scratch.ptr());
        // SAFETY: the logits and `scratch` hold what the kernel reads and writes (checked above).
        unsafe {
            self.device
                .launch(f, LaunchConfig::linear(blocks as u32, 512), &mut args)?
        };
        let f = self.device.function(&SAMPLE, "argmax_final")?;
        let mut args = Args::new()
            .ptr(scratch.ptr())
            .i32(blocks as i32)
            .ptr(out.ptr());
        // SAFETY: `scratch` holds `blocks` keys and `out` one id (checked above).
        unsafe {
            self.device
                .launch(f, LaunchConfig::linear(1, 256), &mut args)
        }
    }

    /// Largest top-k the device sampler handles.
    pub const MAX_TOP_K: usize = 64;
    const TOPK_SLICE: usize = 4096;

    /// Candidate keys `sample` needs for `n` logits at `top_k`.
    pub fn sample_scratch(n: usize, top_k: usize) -> usize {
        n.div_ceil(Self::TOPK_SLICE) * top_k
    }

    /// Whether the device sampler can run these settings on `n` logits (else sample on
    /// the host).
    pub fn can_sample(n: usize, p: &kiln_core::SamplingParams) -> bool {
        !p.is_greedy()
            && (1..=Self::MAX_TOP_K).contains(&p.top_k)
            && p.repeat_penalty == 1.0
            && Self::sample_scratch(n, p.top_k) <= Self::TOPK_SLICE
    }

    /// Draws `*out` from `logits` with top-k → temperature → top-p → min-p. The uniform
    /// number is `*uniform` when given (drawn by the host sampler's generator, keeping it in
    /// step), else the next of the SplitMix64 state `rng` (seeded like the host `Rng`).
    #[allow(clippy::too_many_arguments)]
    pub fn sample(
        &self,
        logits: DevSlice<f32>,
        p: &kiln_core::SamplingParams,
        scratch: DevSlice<u64>,
        rng: DevSlice<u64>,
        uniform: Option<DevSlice<f32>>,
        out: DevSlice<i32>,
    ) -> Result<()> {
        let n = logits.len();
        if !Self::can_sample(n, p) {
            return Err(KernelError::Unsupported(format!(
                "device sampling of {n} logits with top_k {} / repeat penalty {}",
                p.top_k, p.repeat_penalty
            )));
        }
        let blocks = n.div_ceil(Self::TOPK_SLICE);
        let ncand = Self::sample_scratch(n, p.top_k);
        scratch.check_len(ncand, "sampling scratch")?;
        rng.check_len(1, "sampler state")?;
        out.check_len(1, "sampled token")?;
        let f = self.device.function(&SAMPLE, "topk_partial")?;
        let mut args = Args::new()
            .ptr(logits.ptr())
            .i32(n as i32)
            .i32(p.top_k as i32)
            .ptr(scratch.ptr());
        // SAFETY: the logits and `scratch` hold what the kernel reads and writes (checked above).
        unsafe {
            self.device
                .launch(f, LaunchConfig::linear(blocks as u32, 1024), &mut args)?
        };
        let f = self.device.function(&SAMPLE, "sample_final")?;
        let mut args = Args::new()
            .ptr(scratch.ptr())
            .i32(ncand as i32)
            .i32(p.top_k as i32)
            .f32(p.temperature)
            .f32(p.top_p)
            .f32(p.min_p)
            .ptr(rng.ptr())
            .ptr(opt(uniform))
            .ptr(out.ptr());
        // SAFETY: `scratch` holds `ncand` keys; `rng`, `uniform` and `out` one value each (checked above).
        unsafe {
            self.device
                .launch(f, LaunchConfig::linear(1, 1024), &mut args)
        }
    }

    /// Copies `src` to `dst` with a 16-byte-per-thread kernel (the bandwidth yardstick).
    pub fn copy(&self, src: DevSlice<u8>, dst: DevSlice<u8>) -> Result<()> {
        if src.len() != dst.len() || !src.len().is_multiple_of(16) {
            return Err(invalid(format!(
                "copy of {} into {} bytes (multiples of 16 only)",
                src.len(),
                dst.len()
            )));
        }
        let f = self.device.function(&NORM, "copy_u128")?;
        let blocks = (self.device.sm_count() * 8) as u32;
        let mut args = Args::new()
            .ptr(src.ptr())
            .ptr(dst.ptr())
            .u64((src.len() / 16) as u64);
        // SAFETY: both slices are `len` bytes, a multiple of 16 (checked above).
        unsafe {
            self.device
                .launch(f, LaunchConfig::linear(blocks, 512), &mut args)
        }
    }
}

/// Shape and rope settings of one attention layer for [`Kernels::rope_kv`].
#[derive(Debug, Clone, Copy)]
pub struct RopeArgs {
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    pub rot_dims: usize,
    /// rot_dims / 2 inverse frequencies (`kiln_core::RopeConfig::inv_freq`).
    pub inv_freq: DevSlice<f32>,
    pub neox: bool,
    pub q_norm: Option<DevSlice<f32>>,
    pub k_norm: Option<DevSlice<f32>>,
    pub eps: f32,
}

impl Args {
    /// The decode attention kernels' shape parameters, in their order: heads, KV heads,
    /// cache rows a head (`rows`: a ring's, or a paged pool's), split, scale, window.
    pub(crate) fn attn(self, a: &AttnArgs, rows: usize) -> Args {
        self.i32(a.n_heads as i32)
            .i32(a.n_kv as i32)
            .i32(rows as i32)
            .i32(a.split as i32)
            .f32(a.scale)
            .i32(a.window as i32)
    }

    /// The rope kernels' shared parameters, in their order: heads, KV heads, head dim,
    /// rotary dims, inverse frequencies, NEOX flag, Q/K norms, epsilon.
    pub(crate) fn rope(self, a: &RopeArgs) -> Args {
        self.i32(a.n_heads as i32)
            .i32(a.n_kv as i32)
            .i32(a.head_dim as i32)
            .i32(a.rot_dims as i32)
            .ptr(a.inv_freq.ptr())
            .i32(a.neox as i32)
            .ptr(opt(a.q_norm))
            .ptr(opt(a.k_norm))
            .f32(a.eps)
    }
}

impl RopeArgs {
    /// Checks the head geometry, the per-head vectors and a K/V cache of `max_ctx`
    /// positions (shared by the decode and the batched RoPE).
    pub(crate) fn check(&self, kv: &KvPlanes, max_ctx: usize) -> Result<()> {
        let hd = self.head_dim;
        let rot = self.rot_dims;
        if hd == 0 || !hd.is_multiple_of(2) || hd > 512 || rot > hd || !rot.is_multiple_of(2) {
            return Err(invalid(format!("head_dim {hd} / rotary dims {rot}")));
        }
        // The q8_0 writer quantises whole rows of up to 256 values in shared memory.
        if kv.format == KvFormat::Q8_0 && (!hd.is_multiple_of(32) || hd > 256) {
            return Err(KernelError::Unsupported(format!(
                "a q8_0 KV cache for heads of {hd} values (multiples of 32 up to 256 only)"
            )));
        }
        if self.n_kv == 0 || !self.n_heads.is_multiple_of(self.n_kv) {
            return Err(invalid(format!(
                "{} heads over {} KV heads",
                self.n_heads, self.n_kv
            )));
        }
        kv.check_len(self.n_kv * max_ctx * hd, "KV cache")?;
        self.inv_freq
            .check_len(rot / 2, "rope inverse frequencies")?;
        if let Some(n) = self.q_norm {
            n.check_len(hd, "Q norm")?;
        }
        if let Some(n) = self.k_norm {
            n.check_len(hd, "K norm")?;
        }
        Ok(())
    }
}

/// What a one-sequence decode attention reads beside its query and cache, and writes.
struct AttnIo {
    len: DevSlice<i32>,
    part_o: DevSlice<f32>,
    part_ml: DevSlice<[f32; 2]>,
    counters: DevSlice<u32>,
    out: DevSlice<f32>,
    out_q8: Option<Q8Act>,
}

impl AttnIo {
    /// Checks every array against `a` and the cache `kv`; the cache's rows a head.
    fn check(&self, a: &AttnArgs, kv: &KvPlanes) -> Result<usize> {
        let (hd, nsplit) = (a.head_dim, a.grid_splits());
        check_one_table(kv)?;
        let rows = cache_rows(kv, a, kv.values() / (a.n_kv * hd))?;
        self.len.check_len(1, "context length")?;
        self.part_o
            .check_len(a.n_heads * nsplit * hd, "attention partial outputs")?;
        self.part_ml
            .check_len(a.n_heads * nsplit, "attention partial max/sum")?;
        self.counters
            .check_len(a.n_heads, "attention split counters")?;
        self.out.check_len(a.n_heads * hd, "attention output")?;
        if let Some(q) = self.out_q8 {
            q.check_len(a.n_heads * hd, "quantised attention output")?;
        }
        Ok(rows)
    }

    /// The parameters after the cache planes, in the kernels' order: length, block table,
    /// shape, partials, counters, output and its quantised planes.
    fn push(&self, args: Args, a: &AttnArgs, kv: &KvPlanes, rows: usize) -> Args {
        let q = self.out_q8;
        args.ptr(self.len.ptr())
            .ptr(kv.table_ptr())
            .attn(a, rows)
            .ptr(self.part_o.ptr())
            .ptr(self.part_ml.ptr())
            .ptr(self.counters.ptr())
            .ptr(self.out.ptr())
            .ptr(q.map_or(0, |q| q.q.ptr()))
            .ptr(q.map_or(0, |q| q.lo.ptr()))
            .ptr(q.map_or(0, |q| q.ds.ptr()))
            .ptr(opt(a.sinks))
    }
}

/// How a decode attention launch spreads the query heads of a GQA group over its blocks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum AttnHeads {
    /// A block per query head (`attn_decode_E`): the shortest chain per block.
    #[default]
    One,
    /// The heads of a group in pairs (`attn_decode_pairs_E`), each K/V row read once for
    /// both.
    Pairs,
    /// The whole group a block on tensor cores (`attn_decode_group_E`: the group's queries
    /// as the rows of m16n8k16 tiles, queries and weights rounded to f16), each K/V row
    /// read once for the group. f16 caches, heads of at most 128 values, groups of at most
    /// 16 ([`AttnArgs::group_kernel_fits`]); other shapes take [`AttnHeads::One`].
    Group,
}

/// Shape of one decode attention for [`Kernels::attention`].
#[derive(Debug, Clone, Copy)]
pub struct AttnArgs {
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    /// Positions a sequence reaches: the context (a paged layer's), or a sliding-window
    /// layer's ring, whose rows per KV head it also is. Sizes the split grid.
    pub max_ctx: usize,
    /// Least positions per split block; a context longer than this times
    /// [`Kernels::attention_splits`] takes longer splits.
    pub split: usize,
    /// Usually 1/sqrt(head_dim).
    pub scale: f32,
    /// Positions a query attends to, its own included (0: all; a sliding-window layer's
    /// window, which its ring of `max_ctx` rows must hold).
    pub window: usize,
    /// How the query heads of a GQA group share blocks (see [`AttnHeads`]).
    pub heads: AttnHeads,
    /// Split blocks per head the launch's grid has: 0 (or anything above
    /// [`Kernels::attention_splits`]) for the grid every length needs; fewer serve spans
    /// up to a bound exactly as the full grid does ([`Kernels::attention_grid_splits`]).
    pub splits: usize,
    /// A logit per query head that joins each softmax and attends to nothing (gpt-oss's
    /// attention sinks), `n_heads` values; `None`: no sinks.
    pub sinks: Option<DevSlice<f32>>,
}

impl AttnArgs {
    /// Split blocks per head in this launch's grid (see [`AttnArgs::splits`]).
    pub fn grid_splits(&self) -> usize {
        let all = Kernels::attention_splits(self.max_ctx, self.split);
        match self.splits {
            0 => all,
            n => n.min(all),
        }
    }

    /// Whether the tensor-core group kernel ([`AttnHeads::Group`]) takes this shape over a
    /// cache of `kv`.
    pub fn group_kernel_fits(&self, kv: KvFormat) -> bool {
        kv == KvFormat::F16
            && self.head_dim <= 128
            && self.n_kv > 0
            && self.n_heads / self.n_kv <= 16
    }

    /// The head geometry the decode attention kernels take (shared by the one-sequence and
    /// the batched launch).
    pub(crate) fn check(&self) -> Result<()> {
        let hd = self.head_dim;
        if !hd.is_multiple_of(32) || hd == 0 || hd > 256 {
            return Err(KernelError::Unsupported(format!(
                "attention with head_dim {hd} (needs a multiple of 32 up to 256)"
            )));
        }
        if self.n_kv == 0 || !self.n_heads.is_multiple_of(self.n_kv) || self.split == 0 {
            return Err(invalid(format!(
                "{} heads over {} KV heads, split {}",
                self.n_heads, self.n_kv, self.split
            )));
        }
        if self.window > self.max_ctx || self.max_ctx > i32::MAX as usize {
            return Err(invalid(format!(
                "a window of {} positions in a cache of {} rows",
                self.window, self.max_ctx
            )));
        }
        if let Some(s) = self.sinks {
            s.check_len(self.n_heads, "attention sinks")?;
        }
        Ok(())
    }
}

/// Shape of the batched prefill attention for [`Kernels::attention_prefill`].
#[derive(Debug, Clone, Copy)]
pub struct PrefillAttnArgs {
    pub n_heads: usize,
    pub n_kv: usize,
    pub head_dim: usize,
    /// Cache rows per KV head: the context, or a sliding-window layer's ring.
    pub max_ctx: usize,
    /// Position of the chunk's first token (the sequence's length before it).
    pub start: usize,
    /// Usually 1/sqrt(head_dim).
    pub scale: f32,
    /// Positions a query attends to, its own included (0: all); see [`AttnArgs::window`].
    pub window: usize,
    /// See [`AttnArgs::sinks`].
    pub sinks: Option<DevSlice<f32>>,
}

/// Checks a one-sequence view's block table, if it has one: a single row.
fn check_one_table(kv: &KvPlanes) -> Result<()> {
    match kv.table() {
        Some((t, stride)) if t.len() != stride => Err(invalid(format!(
            "a one-sequence launch given {} block tables",
            t.len() / stride
        ))),
        _ => Ok(()),
    }
}

/// The rows a KV head has in `kv` for an attention launch of `a` (`pool_rows` when `kv` is
/// paged, its pool's rows a head; else `a.max_ctx`, the ring's), after checking the planes
/// hold them. A paged view's layer attends to the whole context: a window needs a ring.
pub(crate) fn cache_rows(kv: &KvPlanes, a: &AttnArgs, pool_rows: usize) -> Result<usize> {
    let rows = match kv.table() {
        Some(_) if a.window > 0 => {
            return Err(invalid(
                "a sliding-window layer's cache is a ring, not paged".into(),
            ))
        }
        Some(_) => pool_rows,
        None => a.max_ctx,
    };
    if rows > i32::MAX as usize {
        return Err(invalid(format!("a KV cache of {rows} rows")));
    }
    kv.check_len(a.n_kv * rows * a.head_dim, "KV cache")?;
    Ok(rows)
}

/// Whether `rows` consecutive positions from `start` fit a cache of `max_ctx` rows: below
/// `max_ctx` for a full layer (`window` 0), or, for a sliding-window layer's ring, with the
/// `window - 1` positions before the first of them still in place.
fn positions_fit(rows: usize, start: usize, max_ctx: usize, window: usize) -> bool {
    rows > 0
        && match window {
            0 => start + rows <= max_ctx,
            // Positions that never wrap around the ring, or a wrap that spares the window.
            w => start + rows <= max_ctx || rows + w - 1 <= max_ctx,
        }
}

// Batched prefill: dequantisation to f16, and the per-token steps over the rows of a chunk.
impl Kernels {
    fn dequant_launch(
        &self,
        w: &DeviceWeight,
        ids: Option<DevSlice<i32>>,
        row0: usize,
        out_rows: usize,
        out_h: Option<DevSlice<u16>>,
        out_f: Option<DevSlice<f32>>,
        scale: f32,
    ) -> Result<()> {
        let f = self
            .device
            .function(&w.format.dequant, &format!("dequant_{}", w.format.tag))?;
        let chunks = out_rows * w.row_len.div_ceil(32);
        if out_rows > i32::MAX as usize
            || w.rows > i32::MAX as usize
            || chunks > u32::MAX as usize * 128
        {
            return Err(invalid(format!(
                "dequantising {out_rows} rows of {}",
                w.row_len
            )));
        }
        let (body, qh, sc) = w.ptrs();
        let mut args = Args::new()
            .ptr(body)
            .ptr(qh)
            .ptr(sc)
            .ptr(opt(ids))
            .i32(row0 as i32)
            .i32(out_rows as i32)
            .i32(w.rows as i32)
            .i32(w.row_len as i32)
            .ptr(opt(out_h))
            .ptr(opt(out_f))
            .f32(scale);
        // SAFETY: the callers checked the outputs hold out_rows * row_len values; ids are
        // range-checked on the device.
        unsafe {
            self.launch(
                f,
                LaunchConfig::linear(chunks.div_ceil(128) as u32, 128),
                &mut args,
            )
        }
    }

    /// The whole of `w` dequantised to f16, row-major `[rows][row_len]` (a GEMM operand).
    pub fn dequant_f16(&self, w: &DeviceWeight, out: DevSlice<u16>) -> Result<()> {
        out.check_len(w.rows * w.row_len, "dequantised weight")?;
        self.dequant_launch(w, None, 0, w.rows, Some(out), None, 1.0)
    }

    /// Rows `row0..row0 + rows` of `w` dequantised to f16, row-major (a slice of a matrix
    /// too large to expand at once: the LM head of a large vocabulary).
    pub fn dequant_rows_f16(
        &self,
        w: &DeviceWeight,
        row0: usize,
        rows: usize,
        out: DevSlice<u16>,
    ) -> Result<()> {
        if rows == 0 || row0.checked_add(rows).is_none_or(|end| end > w.rows) {
            return Err(invalid(format!(
                "rows {row0}..{} of a {}-row weight",
                row0.saturating_add(rows),
                w.rows
            )));
        }
        out.check_len(rows * w.row_len, "dequantised rows")?;
        self.dequant_launch(w, None, row0, rows, Some(out), None, 1.0)
    }

    /// Row `ids[r]` of `w` dequantised to f32 and times `scale` as row r of `out` (the
    /// embedding of a batch of tokens; an id out of range gives a NaN row).
    pub fn embed_rows(
        &self,
        w: &DeviceWeight,
        ids: DevSlice<i32>,
        scale: f32,
        out: DevSlice<f32>,
    ) -> Result<()> {
        out.check_len(ids.len() * w.row_len, "embedding rows")?;
        self.dequant_launch(w, Some(ids), 0, ids.len(), None, Some(out), scale)
    }

    /// For each of `rows` rows of `n` values: y (f16) = x · rsqrt(mean(x²) + eps) · w.
    pub fn rmsnorm_rows_f16(
        &self,
        x: DevSlice<f32>,
        rows: usize,
        n: usize,
        w: DevSlice<f32>,
        eps: f32,
        y: DevSlice<u16>,
    ) -> Result<()> {
        if n == 0 || rows == 0 {
            return Err(invalid("empty RMSNorm".into()));
        }
        x.check_len(rows * n, "RMSNorm input")?;
        w.check_len(n, "RMSNorm weight")?;
        y.check_len(rows * n, "RMSNorm output")?;
        let f = self
            .device
            .function(&crate::compile::PREFILL, "rmsnorm_rows_f16")?;
        let mut args = Args::new()
            .ptr(x.ptr())
            .ptr(w.ptr())
            .f32(eps)
            .ptr(y.ptr())
            .i32(n as i32);
        // SAFETY: sizes checked above.
        unsafe {
            self.device
                .launch(f, LaunchConfig::linear(rows as u32, 256), &mut args)
        }
    }

    /// RoPE (after the optional QKV `bias`, and QK-norm when set) on `rows` fused QKV rows
    /// of tokens at positions `start..start + rows`; rotated Q to `q_out` (`[rows][q_dim]`),
    /// K and V into the cache of `max_ctx` rows a head (a ring for a layer with a `window`;
    /// a paged pool's rows through `kv`'s block table).
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv_rows(
        &self,
        a: &RopeArgs,
        qkv: DevSlice<f32>,
        bias: Option<DevSlice<f32>>,
        rows: usize,
        start: usize,
        q_out: DevSlice<f32>,
        kv: KvPlanes,
        max_ctx: usize,
        window: usize,
    ) -> Result<()> {
        a.check(&kv, max_ctx)?;
        check_one_table(&kv)?;
        let hd = a.head_dim;
        if !positions_fit(rows, start, kv.positions(max_ctx), window)
            || start + rows > i32::MAX as usize
        {
            return Err(invalid(format!(
                "{rows} positions from {start} in a context of {max_ctx}"
            )));
        }
        let width = (a.n_heads + 2 * a.n_kv) * hd;
        qkv.check_len(rows * width, "QKV rows")?;
        if let Some(b) = bias {
            b.check_len(width, "QKV bias")?;
        }
        q_out.check_len(rows * a.n_heads * hd, "rotated Q rows")?;
        let f = self.device.function(
            &crate::compile::PREFILL,
            &format!("rope_kv_rows{}", kv.format.kernel_suffix()),
        )?;
        let threads = ((hd / 2).div_ceil(32) * 32) as u32;
        let mut args = kv
            .push(Args::new().ptr(qkv.ptr()).ptr(opt(bias)).ptr(q_out.ptr()))
            .i32(start as i32)
            .rope(a)
            .i32(max_ctx as i32)
            .ptr(kv.table_ptr());
        let cfg = LaunchConfig {
            grid: ((a.n_heads + a.n_kv) as u32, rows as u32, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: sizes and positions checked above.
        unsafe { self.launch(f, cfg, &mut args) }
    }

    /// Positions `0..rows` of one sequence's q8_0 cache of one layer (`kv`: its ring, or
    /// the pool with its block table; `n_kv` heads) as f16 in `k_f16`/`v_f16`, contiguous
    /// caches of `max_ctx` rows a head (position p in row p): what the prefill attention
    /// kernels, which read f16 tiles, take in place of the cache.
    #[allow(clippy::too_many_arguments)]
    pub fn kv_q8_to_f16(
        &self,
        kv: KvPlanes,
        n_kv: usize,
        head_dim: usize,
        max_ctx: usize,
        rows: usize,
        k_f16: DevSlice<u16>,
        v_f16: DevSlice<u16>,
    ) -> Result<()> {
        let Some(planes) = kv.as_q8_0() else {
            return Err(invalid("kv_q8_to_f16 takes a q8_0 cache".into()));
        };
        check_one_table(&kv)?;
        if n_kv == 0 || head_dim == 0 {
            return Err(invalid("kv_q8_to_f16 with no heads".into()));
        }
        let src_rows = kv.values() / (n_kv * head_dim);
        let n = n_kv * max_ctx * head_dim;
        if rows > max_ctx
            || rows > kv.positions(src_rows)
            || src_rows > i32::MAX as usize
            || n > i32::MAX as usize
        {
            return Err(invalid(format!(
                "{rows} rows of a {max_ctx}-row cache ({src_rows} rows a head in the source)"
            )));
        }
        k_f16.check_len(n, "f16 K rows")?;
        v_f16.check_len(n, "f16 V rows")?;
        if rows == 0 {
            return Ok(());
        }
        let f = self
            .device
            .function(&crate::compile::PREFILL, "kv_q8_to_f16")?;
        let mut args = Args::new()
            .ptr(planes.k.ptr())
            .ptr(planes.k_scales.ptr())
            .ptr(planes.v.ptr())
            .ptr(planes.v_scales.ptr())
            .ptr(k_f16.ptr())
            .ptr(v_f16.ptr())
            .i32(rows as i32)
            .i32(head_dim as i32)
            .i32(max_ctx as i32)
            .i32(src_rows as i32)
            .ptr(kv.table_ptr());
        let cfg = LaunchConfig {
            grid: ((rows * head_dim).div_ceil(256) as u32, n_kv as u32, 2),
            block: (256, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: the outputs hold n_kv · max_ctx · head_dim values and the source n_kv ·
        // src_rows · head_dim (checked); the kernel reads positions < `rows`, which the
        // source's ring or table addresses (checked; table entries are blocks of the pool).
        unsafe { self.launch(f, cfg, &mut args) }
    }

    /// Causal attention of `rows` queries (`q`: `[rows][n_heads * hd]`, token t at position
    /// `start + t`) over the cache, which must already hold positions `0..start + rows`.
    /// Output in f16, `[rows][n_heads * hd]`. Head sizes 64 and 128 run on tensor cores
    /// (flash-attention tiles, `attn_prefill_mma_*`); others take the row kernel
    /// ([`Kernels::attention_prefill_rows`]).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_prefill(
        &self,
        a: &PrefillAttnArgs,
        rows: usize,
        q: DevSlice<f32>,
        kc: DevSlice<u16>,
        vc: DevSlice<u16>,
        table: Option<DevSlice<i32>>,
        out: DevSlice<u16>,
    ) -> Result<()> {
        let tc = matches!(a.head_dim, 64 | 128);
        self.prefill_attn_launch(a, rows, q, kc, vc, table, out, tc)
    }

    /// [`Kernels::attention_prefill`] by the row kernel for every head size (a multiple of
    /// 32 up to 256): one block per (head, query), CUDA cores, f32 arithmetic. The tensor-core
    /// kernel is checked against it and against an f64 reference.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_prefill_rows(
        &self,
        a: &PrefillAttnArgs,
        rows: usize,
        q: DevSlice<f32>,
        kc: DevSlice<u16>,
        vc: DevSlice<u16>,
        table: Option<DevSlice<i32>>,
        out: DevSlice<u16>,
    ) -> Result<()> {
        self.prefill_attn_launch(a, rows, q, kc, vc, table, out, false)
    }

    #[allow(clippy::too_many_arguments)]
    fn prefill_attn_launch(
        &self,
        a: &PrefillAttnArgs,
        rows: usize,
        q: DevSlice<f32>,
        kc: DevSlice<u16>,
        vc: DevSlice<u16>,
        table: Option<DevSlice<i32>>,
        out: DevSlice<u16>,
        tensor_cores: bool,
    ) -> Result<()> {
        let hd = a.head_dim;
        if !hd.is_multiple_of(32) || hd == 0 || hd > 256 {
            return Err(KernelError::Unsupported(format!(
                "attention with head_dim {hd} (needs a multiple of 32 up to 256)"
            )));
        }
        if a.n_kv == 0 || !a.n_heads.is_multiple_of(a.n_kv) {
            return Err(invalid(format!(
                "{} heads over {} KV heads",
                a.n_heads, a.n_kv
            )));
        }
        let positions = table.map_or(a.max_ctx, |t| t.len() * kiln_core::KV_BLOCK_TOKENS);
        if table.is_some() && a.window > 0 {
            return Err(invalid(
                "a sliding-window layer's cache is a ring, not paged".into(),
            ));
        }
        if !positions_fit(rows, a.start, positions.min(a.max_ctx), a.window)
            || a.start + rows > i32::MAX as usize
        {
            return Err(invalid(format!(
                "{rows} queries from {} in a cache of {} rows (window {})",
                a.start, a.max_ctx, a.window
            )));
        }
        q.check_len(rows * a.n_heads * hd, "attention Q rows")?;
        if let Some(s) = a.sinks {
            s.check_len(a.n_heads, "attention sinks")?;
        }
        kc.check_len(a.n_kv * a.max_ctx * hd, "K cache")?;
        vc.check_len(a.n_kv * a.max_ctx * hd, "V cache")?;
        out.check_len(rows * a.n_heads * hd, "attention output rows")?;
        if tensor_cores {
            let f = self
                .device
                .function(&crate::compile::PREFILL, &format!("attn_prefill_mma_{hd}"))?;
            let mut args = Args::new()
                .ptr(q.ptr())
                .ptr(kc.ptr())
                .ptr(vc.ptr())
                .ptr(out.ptr())
                .i32(rows as i32)
                .i32(a.n_heads as i32)
                .i32(a.n_kv as i32)
                .i32(a.max_ctx as i32)
                .i32(a.start as i32)
                .f32(a.scale)
                .i32(a.window as i32)
                .ptr(opt(table))
                .ptr(opt(a.sinks));
            let cfg = LaunchConfig {
                grid: (rows.div_ceil(64) as u32, a.n_heads as u32, 1),
                block: (128, 1, 1),
                shared_bytes: 0,
            };
            // SAFETY: sizes checked; every position read is < start + rows and lies in the
            // cache (or its ring, whose rows hold the window before the chunk).
            return unsafe { self.launch(f, cfg, &mut args) };
        }
        let f = self.device.function(
            &crate::compile::PREFILL,
            &format!("attn_prefill_{}", hd / 32),
        )?;
        let mut args = Args::new()
            .ptr(q.ptr())
            .ptr(kc.ptr())
            .ptr(vc.ptr())
            .ptr(out.ptr())
            .i32(a.n_heads as i32)
            .i32(a.n_kv as i32)
            .i32(a.max_ctx as i32)
            .i32(a.start as i32)
            .f32(a.scale)
            .i32(a.window as i32)
            .ptr(opt(table))
            .ptr(opt(a.sinks));
        let cfg = LaunchConfig {
            grid: (a.n_heads as u32, rows as u32, 1),
            block: (128, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: sizes checked; every position read is < start + rows ≤ max_ctx.
        unsafe { self.launch(f, cfg, &mut args) }
    }

    /// For each of `rows` rows of `vocab` logits: `nll[r]` = −log softmax at `target[r]`
    /// (NaN for a row holding a non-finite value, or a target out of range) and `top[r]` =
    /// the first index of the row's maximum — what a perplexity run keeps of a scored row,
    /// so the rows never leave the device.
    pub fn score_rows(
        &self,
        logits: DevSlice<f32>,
        rows: usize,
        vocab: usize,
        target: DevSlice<i32>,
        nll: DevSlice<f32>,
        top: DevSlice<i32>,
    ) -> Result<()> {
        if rows == 0 || vocab == 0 || vocab > i32::MAX as usize || rows > u32::MAX as usize {
            return Err(invalid(format!("scoring {rows} rows of {vocab}")));
        }
        logits.check_len(rows * vocab, "scored logits")?;
        target.check_len(rows, "score targets")?;
        nll.check_len(rows, "score nll")?;
        top.check_len(rows, "score top")?;
        let f = self
            .device
            .function(&crate::compile::PREFILL, "score_rows")?;
        let mut args = Args::new()
            .ptr(logits.ptr())
            .i32(vocab as i32)
            .ptr(target.ptr())
            .ptr(nll.ptr())
            .ptr(top.ptr());
        // SAFETY: sizes checked above; the kernel reads row r's target and writes r's outputs.
        unsafe { self.launch(f, LaunchConfig::linear(rows as u32, 1024), &mut args) }
    }

    /// y[t][i] (f16) = act(gu[t][i]) · gu[t][ffn + i] for `rows` rows, act SiLU or (with
    /// `gelu`) tanh-approximated GELU.
    pub fn swiglu_rows_f16(
        &self,
        gu: DevSlice<f32>,
        rows: usize,
        ffn: usize,
        y: DevSlice<u16>,
        gelu: bool,
    ) -> Result<()> {
        gu.check_len(rows * 2 * ffn, "gate/up rows")?;
        y.check_len(rows * ffn, "SwiGLU rows")?;
        let n = rows * ffn;
        if n == 0 || n > i32::MAX as usize {
            return Err(invalid(format!("SwiGLU over {rows}x{ffn}")));
        }
        let f = self
            .device
            .function(&crate::compile::PREFILL, "swiglu_rows_f16")?;
        let mut args = Args::new()
            .ptr(gu.ptr())
            .ptr(y.ptr())
            .i32(rows as i32)
            .i32(ffn as i32)
            .i32(gelu as i32);
        // SAFETY: sizes checked above.
        unsafe {
            self.launch(
                f,
                LaunchConfig::linear(n.div_ceil(256) as u32, 256),
                &mut args,
            )
        }
    }

    /// For each of `rows` rows of `n` values: x += scale · bias.
    pub fn add_bias_rows(
        &self,
        x: DevSlice<f32>,
        rows: usize,
        n: usize,
        bias: DevSlice<f32>,
        scale: f32,
    ) -> Result<()> {
        if n == 0 || rows == 0 || n > i32::MAX as usize || rows > 65_535 {
            return Err(invalid(format!("a bias over {rows}x{n}")));
        }
        bias.check_len(n, "bias")?;
        x.check_len(rows * n, "biased rows")?;
        let f = self
            .device
            .function(&crate::compile::NORM, "add_bias_rows")?;
        let mut args = Args::new()
            .ptr(bias.ptr())
            .f32(scale)
            .ptr(x.ptr())
            .i32(n as i32);
        let cfg = LaunchConfig {
            grid: (n.div_ceil(256) as u32, rows as u32, 1),
            block: (256, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: sizes checked above.
        unsafe { self.device.launch(f, cfg, &mut args) }
    }

    /// For each of `rows` rows of `n` values: x += y · rsqrt(mean(y²) + eps) · w (a norm on
    /// a block's output before it joins the residual stream: Gemma's sandwich norms).
    pub fn add_rmsnorm_rows(
        &self,
        y: DevSlice<f32>,
        rows: usize,
        n: usize,
        w: DevSlice<f32>,
        eps: f32,
        x: DevSlice<f32>,
    ) -> Result<()> {
        if n == 0 || rows == 0 || n > i32::MAX as usize || rows > u32::MAX as usize {
            return Err(invalid(format!("a norm over {rows}x{n}")));
        }
        y.check_len(rows * n, "normed block output")?;
        w.check_len(n, "norm weight")?;
        x.check_len(rows * n, "residual stream")?;
        let f = self
            .device
            .function(&crate::compile::NORM, "add_rmsnorm_rows")?;
        let mut args = Args::new()
            .ptr(y.ptr())
            .ptr(w.ptr())
            .f32(eps)
            .ptr(x.ptr())
            .i32(n as i32);
        // SAFETY: sizes checked above.
        unsafe {
            self.device
                .launch(f, LaunchConfig::linear(rows as u32, 256), &mut args)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{DevSlice, ExpertSlots, Kernels};

    fn slots(count: usize, slots: usize, slots_per_input: usize) -> ExpertSlots {
        ExpertSlots {
            count,
            ids: DevSlice::from_raw(0x1000, slots),
            slots_per_input,
            order: None,
        }
    }

    /// What an experts' launch computes and reads: a slot per id, one expert's rows each,
    /// and the inputs its slots share.
    #[test]
    fn expert_launch_shapes() {
        // Decode: 8 slots over one shared input (gate/up), then their own (down).
        assert_eq!(
            slots(128, 8, 0).launch_shape(128 * 768, 1).unwrap(),
            (768, 8, 1)
        );
        assert_eq!(
            slots(128, 8, 1).launch_shape(128 * 2048, 1).unwrap(),
            (2048, 8, 8)
        );
        // A batch of 5 tokens, 8 experts each: a token's slots share its input.
        assert_eq!(
            slots(128, 40, 8).launch_shape(128 * 768, 1).unwrap(),
            (768, 40, 5)
        );
        // The router over 5 rows: one "expert", a slot a row.
        assert_eq!(slots(1, 5, 1).launch_shape(128, 1).unwrap(), (128, 5, 5));
        // Refused: rows that do not stack the experts, an expert's rows splitting a row
        // group, no slots, an order of the wrong length.
        assert!(slots(3, 8, 0).launch_shape(100, 1).is_err());
        assert!(slots(4, 8, 0).launch_shape(4 * 6, 4).is_err());
        assert!(slots(4, 0, 0).launch_shape(64, 1).is_err());
        assert!(slots(0, 8, 0).launch_shape(64, 1).is_err());
        let mut ordered = slots(4, 8, 1);
        ordered.order = Some(DevSlice::from_raw(0x2000, 7));
        assert!(ordered.launch_shape(64, 1).is_err());
        ordered.order = Some(DevSlice::from_raw(0x2000, 8));
        assert_eq!(ordered.launch_shape(64, 1).unwrap(), (16, 8, 8));
    }

    /// A grid as wide as the working splits of every span it serves computes what the full
    /// grid does: the same split length for each span (so the same blocks and the same
    /// merge, bit for bit), on every cache size the executors make, for the one-sequence
    /// step's least split (64) and the batched step's (128).
    #[test]
    fn narrow_attention_grids_split_as_the_full_grid_does() {
        for (split, max_ctx) in [64, 128].into_iter().flat_map(|split| {
            [1, 63, 64, 300, 1000, 4096, 8192, 20_000, 32_768, 131_072].map(|m| (split, m))
        }) {
            let full = Kernels::attention_splits(max_ctx, split);
            let mut grids = std::collections::BTreeSet::new();
            for span in (1..=max_ctx).step_by(1 + max_ctx / 5000) {
                let working = Kernels::attention_working_splits(span, max_ctx, split);
                let len = Kernels::attention_split_len(span, split, full);
                assert_eq!(working, span.div_ceil(len).min(full), "span {span}");
                let grid = Kernels::attention_grid_splits(working, full);
                assert!(grid >= working && grid <= full);
                assert_eq!(
                    Kernels::attention_split_len(span, split, grid),
                    len,
                    "span {span} of a {max_ctx}-row cache in a grid of {grid} (full {full})"
                );
                grids.insert(grid);
            }
            // One graph per grid: a handful serve a cache of any size.
            assert!(grids.len() <= 8, "{max_ctx} rows: {grids:?}");
        }
        // Short contexts launch few blocks: one per head up to 64 positions.
        let split = 64;
        assert_eq!(Kernels::attention_working_splits(5, 131_072, split), 1);
        assert_eq!(Kernels::attention_working_splits(100, 131_072, split), 2);
        assert_eq!(Kernels::attention_working_splits(4096, 131_072, split), 16);
        assert_eq!(Kernels::attention_working_splits(4097, 131_072, split), 17);
    }
}
