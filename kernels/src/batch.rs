//! Launch wrappers for the batched decode step: B sequences, each at its own position of
//! its own cache slot, through one step. Matmuls read each weight once for all B rows
//! (`cuda/bmm.cu`, on tensor cores); RoPE, attention and sampling take one row of the
//! batch per grid row, with positions, context lengths, slots and sampling settings read
//! from device arrays so that one captured graph serves every step of a batch size.

use crate::buffer::{DevSlice, DeviceBuffer};
use crate::compile::{attention_module, NORM, ROPE, SAMPLE};
use crate::device::{Args, Device, LaunchConfig};
use crate::error::{KernelError, Result};
use crate::kv::KvPlanes;
use crate::ops::{AttnArgs, AttnHeads, GatedAct, Kernels, RopeArgs};
use crate::repack::DeviceWeight;
use kiln_core::QType;
use std::sync::Arc;

fn invalid(msg: String) -> KernelError {
    KernelError::InvalidArgument(msg)
}

fn opt<T>(s: Option<DevSlice<T>>) -> u64 {
    s.map_or(0, |s| s.ptr())
}

/// Rows of weights one batched-matmul block owns (8 warps of 16).
const BMM_ROWS_PER_BLOCK: usize = 128;

/// Which kernels the batched matmuls over K-quant weights run (`cuda/bmm.cu`); the other
/// formats always take the register walk.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BmmPath {
    /// Each warp loads its rows' fragments into registers a few chunks ahead; int8 mma on
    /// the 15-bit activations (`bmm_*`). The walk of every other format, and of a K-quant
    /// whose stages would not fit shared memory.
    Registers,
    /// Super-block columns through shared memory by cp.async, weights dequantised to f16,
    /// f16 activations, f32 accumulators over the whole split (`bmmh_*`).
    PipelinedF16,
}

/// Which kernels the batched step's decode attention runs (`cuda/attention.cu`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum BatchAttention {
    /// [`BatchAttention::GroupMma`] for batches of 8 rows or more, else
    /// [`BatchAttention::Heads`] (the default). At 4 rows and ~130 positions of context the
    /// group kernel's grid is too narrow (14.3 against 12.3 µs a launch at the 8B's heads on
    /// the H200); from 8 rows, or at 1,024 positions, it takes about half the time
    /// (docs/benchmarks.md, "Group attention"). Executors whose batched matmuls do not
    /// round to f16 choose [`BatchAttention::Heads`] at load.
    Auto,
    /// A block per query head, or per pair of heads of a GQA group (`AttnHeads::Pairs`), on
    /// CUDA cores (`attn_decode_batch{_pairs}_E`).
    Heads,
    /// A block per GQA group on tensor cores (`attn_decode_batch_group_E`): each K/V row read
    /// once for the whole group. f16 caches, heads of at most 128 values and groups of at
    /// most 16 only; other shapes take [`BatchAttention::Heads`].
    GroupMma,
}

/// Bytes of dynamic shared memory `attn_decode_batch_group_E` takes for heads of `hd`
/// values (ATTN_GROUP_SMEM in attention.cu: 4 warps × K and V × two tiles of 16 rows of
/// hd + 8 f16).
pub(crate) fn attn_group_smem(hd: usize) -> usize {
    4 * 4 * 16 * (hd + 8) * 2
}

/// How one batched matmul walks its weights.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum BmmWalk {
    Registers,
    /// `stages` super-block columns of `stage` bytes each in flight through shared memory
    /// (and `BmmpStage::HBYTES` of scale words after them).
    Pipelined {
        stages: usize,
        stage: usize,
    },
}

impl BmmWalk {
    /// Dynamic shared memory a launch takes.
    fn shared_bytes(self, swiglu: bool) -> usize {
        match self {
            BmmWalk::Registers => 0,
            BmmWalk::Pipelined { stages, stage } => {
                // `BmmpStage::HBYTES`: 8 warps × 16 rows × 8 chunks of u32 per weight.
                let words = 8 * 16 * 8 * 4 * if swiglu { 2 } else { 1 };
                stages * stage + words
            }
        }
    }
}

/// Bytes of one stage of the pipelined walk (`BmmpStage` in cuda/bmm.cu): the block's rows
/// of one super-block column of each weight, Q6_K's scale words, and 8 chunks of packed f16
/// activations for every row of the batch.
fn bmmp_stage_bytes(w: &DeviceWeight, rows: usize, swiglu: bool) -> usize {
    let weights = if swiglu { 2 } else { 1 };
    let body = w.format.body.bytes;
    let scales = if w.qtype == QType::Q6_K { 4 } else { 0 };
    let b = Kernels::bmm_rows(rows);
    weights * BMM_ROWS_PER_BLOCK * (body + scales) + 8 * b * 64
}

/// Activations of a batch packed for the batched matmuls (see `cuda/bmm.cu`): `rows` rows
/// of `n` values, as 16-byte int8 mma fragments (`x`: rows × chunks × 4) with a (dx, sx)
/// pair per chunk and row (`s`: chunks × rows), and as f16 in the same order (`h`, as long
/// as `x`).
#[derive(Debug, Clone, Copy)]
pub struct PackedAct {
    pub x: DevSlice<[u32; 4]>,
    pub s: DevSlice<[f32; 2]>,
    pub h: DevSlice<[u32; 4]>,
}

impl PackedAct {
    /// Elements of `x` (and `h`) and of `s` for `rows` rows of `n` values.
    pub fn lens(rows: usize, n: usize) -> (usize, usize) {
        let chunks = n.div_ceil(32);
        (rows * chunks * 4, rows * chunks)
    }

    fn check(&self, rows: usize, n: usize, what: &str) -> Result<()> {
        let (x, s) = Self::lens(rows, n);
        self.x.check_len(x, what)?;
        self.h.check_len(x, what)?;
        self.s.check_len(s, what)
    }
}

/// Device buffers of their own for one [`PackedAct`] (tests and benchmarks; the executors
/// carve theirs from a workspace).
pub struct PackedActBuffers {
    x: DeviceBuffer<[u32; 4]>,
    s: DeviceBuffer<[f32; 2]>,
    h: DeviceBuffer<[u32; 4]>,
}

impl PackedActBuffers {
    pub fn alloc(device: &Arc<Device>, rows: usize, n: usize) -> Result<Self> {
        let (x, s) = PackedAct::lens(rows, n);
        Ok(PackedActBuffers {
            x: DeviceBuffer::alloc(device, x)?,
            s: DeviceBuffer::alloc(device, s)?,
            h: DeviceBuffer::alloc(device, x)?,
        })
    }

    /// Sets every byte of the three planes (tests poison them before packing).
    pub fn fill_bytes(&self, byte: u8) -> Result<()> {
        self.x.fill_bytes(byte)?;
        self.s.fill_bytes(byte)?;
        self.h.fill_bytes(byte)
    }

    /// The three planes copied back (tests compare them).
    pub fn to_host(&self) -> Result<PackedActHost> {
        Ok(PackedActHost {
            x: self.x.to_host()?,
            s: self.s.to_host()?,
            h: self.h.to_host()?,
        })
    }

    pub fn view(&self) -> PackedAct {
        PackedAct {
            x: self.x.slice(),
            s: self.s.slice(),
            h: self.h.slice(),
        }
    }
}

/// A [`PackedActBuffers`]' planes on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedActHost {
    pub x: Vec<[u32; 4]>,
    pub s: Vec<[f32; 2]>,
    pub h: Vec<[u32; 4]>,
}

/// The slots of a grouped matmul ([`Kernels::grouped_matmul`]): the routing's `order.len()`
/// slots sorted by expert and where each of the `count` experts' begin (`starts`, count + 1
/// values), both from [`Kernels::order_experts`]; slot `s` reads packed row
/// `s / slots_per_input` (1: its own row; a token's expert count: its token's).
#[derive(Debug, Clone, Copy)]
pub struct ExpertGroups {
    pub count: usize,
    pub order: DevSlice<i32>,
    pub starts: DevSlice<i32>,
    pub slots_per_input: usize,
}

/// The sequences a grouped matmul's block multiplies at once: 8·NT, NT = 1, 2, 4 or 8.
const GROUPED_TILES: [usize; 4] = [1, 2, 4, 8];

impl ExpertGroups {
    /// (an expert's rows, slots, NT) of a grouped matmul over a weight of `w_rows` rows of
    /// `row_len` values stored in groups of `row_group`, with `rows` packed input rows, or
    /// why it does not fit. NT makes a block's tile of 8·NT slots cover an expert's share
    /// of the slots when they spread evenly over the experts (larger shares take several
    /// tiles).
    fn launch_shape(
        &self,
        w_rows: usize,
        row_len: usize,
        row_group: usize,
        rows: usize,
    ) -> Result<(usize, usize, usize)> {
        let count = self.count;
        if count == 0 || count > crate::ops::MAX_EXPERTS || !w_rows.is_multiple_of(count) {
            return Err(invalid(format!(
                "{w_rows} rows do not stack {count} experts' matrices (1 to {})",
                crate::ops::MAX_EXPERTS
            )));
        }
        let width = w_rows / count;
        if !width.is_multiple_of(row_group) {
            return Err(invalid(format!(
                "an expert's {width} rows are not whole groups of {row_group}"
            )));
        }
        if !row_len.is_multiple_of(32) || row_len > i32::MAX as usize {
            return Err(invalid(format!(
                "rows of {row_len} values (a multiple of 32)"
            )));
        }
        let slots = self.order.len();
        if slots == 0 || slots > i32::MAX as usize || self.slots_per_input == 0 {
            return Err(invalid(format!(
                "{slots} slots, {} a packed row",
                self.slots_per_input
            )));
        }
        if rows < slots.div_ceil(self.slots_per_input) {
            return Err(invalid(format!(
                "{slots} slots, {} a row, read {} rows: {rows} packed",
                self.slots_per_input,
                slots.div_ceil(self.slots_per_input)
            )));
        }
        self.starts.check_len(count + 1, "expert starts")?;
        let share = slots.div_ceil(count.min(slots));
        let nt = GROUPED_TILES
            .into_iter()
            .find(|&nt| 8 * nt >= share)
            .unwrap_or(8);
        Ok((width, slots, nt))
    }
}

/// Where each row of a batched step reads and writes: `pos[z]` (the position its token
/// takes; < 0 for a padding row, which writes no cache), `len[z]` (the context attention
/// reads; 0 for padding) and `slot[z]` (its cache slot).
#[derive(Debug, Clone, Copy)]
pub struct BatchRows {
    pub rows: usize,
    pub pos: DevSlice<i32>,
    pub len: DevSlice<i32>,
    pub slot: DevSlice<i32>,
}

impl BatchRows {
    fn check(&self) -> Result<()> {
        if self.rows == 0 || self.rows > Kernels::MAX_BATCH {
            return Err(invalid(format!(
                "a batch of {} rows (1 to {})",
                self.rows,
                Kernels::MAX_BATCH
            )));
        }
        self.pos.check_len(self.rows, "batch positions")?;
        self.len.check_len(self.rows, "batch context lengths")?;
        self.slot.check_len(self.rows, "batch cache slots")
    }
}

/// The epilogue of a batched matmul: y = scale·(W·x (+ bias)) (+ residual, which may be y),
/// and optionally y packed for the next batched matmul by the same launch.
#[derive(Debug, Clone, Copy, Default)]
pub struct BatchEpilogue {
    pub bias: Option<DevSlice<f32>>,
    pub residual: Option<DevSlice<f32>>,
    /// Not for gated matmuls: `None` is 1 (Granite scales its branches and logits).
    pub scale: Option<f32>,
    /// Gated (gate/up) matmuls only: GELU instead of SiLU as the gate activation.
    pub gelu: bool,
    /// Also pack y here as [`Kernels::act_pack`] packs it without a norm (the launch that
    /// sums the splits does it, saving act_pack's launch; the output's rows must be whole
    /// 32-value chunks).
    pub pack: Option<PackedAct>,
}

impl Kernels {
    /// Most rows a batched step takes.
    pub const MAX_BATCH: usize = 64;

    /// Rows the batched matmuls compute for a batch of `rows`: a multiple of 8.
    pub fn bmm_rows(rows: usize) -> usize {
        rows.div_ceil(8) * 8
    }

    /// Whether a batched matmul over `w` (a SwiGLU half with `swiglu`) rounds its weights
    /// and activations to f16 (the default f16 walk), at whatever batch size. Executors
    /// use it to match the precision of the rest of their batched step to the matmuls'.
    pub fn bmm_rounds_to_f16(&self, w: &DeviceWeight, swiglu: bool) -> bool {
        [8, Self::MAX_BATCH]
            .into_iter()
            .all(|rows| matches!(self.bmm_walk(w, rows, swiglu), BmmWalk::Pipelined { .. }))
    }

    /// Which walk a batched matmul over `w` takes: for formats with a pipelined walk the path chosen by
    /// [`Kernels::set_bmm_path`] (a pipelined one by default: cp.async stages of whole
    /// super-blocks through shared memory), else the register walk.
    fn bmm_walk(&self, w: &DeviceWeight, rows: usize, swiglu: bool) -> BmmWalk {
        self.bmm_walk_if(w, rows, swiglu, self.bmm_path())
    }

    fn bmm_walk_if(&self, w: &DeviceWeight, rows: usize, swiglu: bool, path: BmmPath) -> BmmWalk {
        if !w.format.has_pipelined_bmm()
            || !w.row_len.is_multiple_of(256)
            || path == BmmPath::Registers
        {
            return BmmWalk::Registers;
        }
        let stage = bmmp_stage_bytes(w, rows, swiglu);
        let optin = self.device().shared_per_block_optin();
        // Two stages by default (`set_bmm_pipeline` measures others): one super-block in
        // flight while the other is used. Three (or four) measured the same or slower on
        // the H200 (thirteenth and fifteenth sessions, docs/log/2026-11-to-12.md): a smaller
        // footprint lets a second block onto each SM, whose warps cover the fragment loads' latency
        // (8B SwiGLU at 8 rows: 53.3 µs with three, 47.3 with two).
        let walk = BmmWalk::Pipelined {
            stages: self.bmm_pipeline().0,
            stage,
        };
        if walk.shared_bytes(swiglu) > optin {
            return BmmWalk::Registers;
        }
        walk
    }

    /// How many parts a batched matmul over `rows` rows of `w` taking `walk` splits its row
    /// length into.
    ///
    /// Register walk: enough blocks to fill the SMs `waves` times over, at least 4 chunks of
    /// 32 values per part. A warp keeps only a few hundred bytes of weights in flight, so
    /// the memory latency is covered by warps: 8 blocks of 8 warps per SM for 8 and 16 rows,
    /// 4 for wider batches, whose kernels hold more accumulators (fewer blocks fit an SM)
    /// and whose partial sums cost more to write. Measured on the H200 (docs/log/2026-11-to-12.md):
    /// llama3-8b q4_k_m at 4/8/16/32/64 rows, 2 waves → 8/8/8/4/4: 446 → 588, 862 → 1,128,
    /// 1,589 → 1,843, 2,429 → 2,468, 2,775 → 2,968 tok/s.
    ///
    /// Pipelined walk: parts of whole super-blocks, enough blocks for two per SM (each keeps
    /// its stages' bytes in flight itself).
    fn bmm_splits_of(&self, w: &DeviceWeight, rows: usize, walk: BmmWalk) -> usize {
        let blocks = w.rows.div_ceil(BMM_ROWS_PER_BLOCK);
        if let BmmWalk::Pipelined { .. } = walk {
            let superblocks = w.row_len / 256;
            let target = self.bmm_pipeline().1 * self.device().sm_count();
            let splits = target.div_ceil(blocks).clamp(1, superblocks);
            let per = superblocks.div_ceil(splits);
            return superblocks.div_ceil(per);
        }
        let waves = match Self::bmm_rows(rows) {
            0..=16 => 8,
            _ => 4,
        };
        let chunks = w.row_len / 32;
        let target = waves * self.device().sm_count();
        let splits = target.div_ceil(blocks).clamp(1, (chunks / 4).max(1));
        let per = chunks.div_ceil(splits);
        chunks.div_ceil(per)
    }

    /// f32 values the partial sums of a batched matmul over `w` (SwiGLU: two weights of
    /// its shape) for `rows` rows take, whichever walk it takes.
    pub fn bmm_part_len(&self, w: &DeviceWeight, rows: usize, swiglu: bool) -> usize {
        // Every path's count, so a buffer sized before `set_bmm_path` still fits.
        let splits = [BmmPath::Registers, BmmPath::PipelinedF16]
            .into_iter()
            .map(|p| self.bmm_splits_of(w, rows, self.bmm_walk_if(w, rows, swiglu, p)))
            .max()
            .expect("two paths");
        splits * Self::bmm_rows(rows) * w.rows * if swiglu { 2 } else { 1 }
    }

    /// Packs `rows` rows of `n` values of `x` for the batched matmuls: normalised (RMSNorm
    /// with `eps`) and/or scaled by `w` when given.
    pub fn act_pack(
        &self,
        x: DevSlice<f32>,
        rows: usize,
        n: usize,
        w: Option<DevSlice<f32>>,
        eps: Option<f32>,
        out: PackedAct,
    ) -> Result<()> {
        if rows == 0 || n == 0 {
            return Err(invalid("packing an empty activation".into()));
        }
        x.check_len(rows * n, "activation to pack")?;
        if let Some(w) = w {
            w.check_len(n, "norm weight")?;
        }
        out.check(rows, n, "packed activation")?;
        const WARPS: usize = 8;
        let f = self.device().function(&NORM, "act_pack")?;
        let mut args = Args::new()
            .ptr(x.ptr())
            .ptr(opt(w))
            .f32(eps.unwrap_or(-1.0))
            .i32(n as i32)
            .ptr(out.x.ptr())
            .ptr(out.s.ptr())
            .ptr(out.h.ptr());
        let cfg = LaunchConfig {
            grid: (n.div_ceil(32).div_ceil(WARPS) as u32, rows as u32, 1),
            block: (32 * WARPS as u32, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: x, w and the packed planes were checked against rows × n.
        unsafe { self.launch(f, cfg, &mut args) }
    }

    /// y = W·x for the `rows` packed rows of `x` (a multiple of 8, ≤ 64), row m of y at
    /// `y[m·ldy ..]`, then the epilogue; with `up`, SwiGLU: y = silu(W·x) ⊙ (up·x). `part`
    /// holds the partial sums (`bmm_part_len`).
    #[allow(clippy::too_many_arguments)]
    pub fn batched_matmul(
        &self,
        w: &DeviceWeight,
        up: Option<&DeviceWeight>,
        x: &PackedAct,
        rows: usize,
        part: DevSlice<f32>,
        y: DevSlice<f32>,
        ldy: usize,
        epi: &BatchEpilogue,
    ) -> Result<()> {
        if rows == 0 || !rows.is_multiple_of(8) || rows > Self::MAX_BATCH {
            return Err(invalid(format!(
                "a batched matmul over {rows} rows (a multiple of 8 up to {})",
                Self::MAX_BATCH
            )));
        }
        let module = w.format.batched.as_ref().ok_or_else(|| {
            KernelError::Unsupported(format!("no batched matmul for {} weights", w.format.tag))
        })?;
        if !w.row_len.is_multiple_of(32) {
            return Err(invalid(format!(
                "rows of {} values (a multiple of 32)",
                w.row_len
            )));
        }
        if let Some(u) = up {
            if u.format != w.format || u.rows != w.rows || u.row_len != w.row_len {
                return Err(invalid(format!(
                    "gate ({} {}x{}) and up ({} {}x{}) differ",
                    w.format.tag, w.rows, w.row_len, u.format.tag, u.rows, u.row_len
                )));
            }
        }
        let (nrows, k) = (w.rows, w.row_len);
        x.check(rows, k, "batched matmul input")?;
        if ldy < nrows {
            return Err(invalid(format!("output stride {ldy} below {nrows} rows")));
        }
        y.check_len((rows - 1) * ldy + nrows, "batched matmul output")?;
        if let Some(b) = epi.bias {
            b.check_len(nrows, "batched matmul bias")?;
        }
        if let Some(r) = epi.residual {
            r.check_len((rows - 1) * ldy + nrows, "batched matmul residual")?;
        }
        if up.is_some() && (epi.bias.is_some() || epi.residual.is_some() || epi.scale.is_some()) {
            return Err(invalid(
                "a SwiGLU matmul takes no bias, residual or scale".into(),
            ));
        }
        let walk = self.bmm_walk(w, rows, up.is_some());
        let splits = self.bmm_splits_of(w, rows, walk);
        let ldp = nrows * if up.is_some() { 2 } else { 1 };
        part.check_len(splits * rows * ldp, "batched matmul partial sums")?;
        let nt = rows / 8;
        let nt_kernel = [1, 2, 4, 8]
            .into_iter()
            .find(|&n| n >= nt)
            .expect("rows ≤ 64");
        if nt_kernel != nt {
            return Err(invalid(format!(
                "a batched matmul over {rows} rows: 8, 16, 32 or 64 only"
            )));
        }
        let (prefix, per_split) = match walk {
            BmmWalk::Registers => ("bmm", (k / 32).div_ceil(splits)),
            BmmWalk::Pipelined { .. } => ("bmmh", (k / 256).div_ceil(splits)),
        };
        let shared_bytes = walk.shared_bytes(up.is_some());
        let name = match up {
            Some(_) => format!("{prefix}_swiglu_{}_{nt}", w.format.tag),
            None => format!("{prefix}_{}_{nt}", w.format.tag),
        };
        let f = match walk {
            BmmWalk::Registers => self.device().function(module, &name)?,
            BmmWalk::Pipelined { .. } => self.device().function_with_shared(module, &name)?,
        };
        let (body, qh, sc) = w.ptrs();
        let mut args = Args::new().ptr(body).ptr(qh).ptr(sc);
        if let Some(u) = up {
            let (b2, qh2, sc2) = u.ptrs();
            args = args.ptr(b2).ptr(qh2).ptr(sc2);
        }
        let activations = match walk {
            BmmWalk::Pipelined { .. } => x.h,
            BmmWalk::Registers => x.x,
        };
        let mut args = args
            .ptr(activations.ptr())
            .ptr(x.s.ptr())
            .ptr(part.ptr())
            .i32(ldp as i32)
            .i32(nrows as i32)
            .i32(k as i32)
            .i32(per_split as i32);
        if let BmmWalk::Pipelined { stages, .. } = walk {
            args = args.i32(stages as i32);
        }
        let cfg = LaunchConfig {
            grid: (nrows.div_ceil(BMM_ROWS_PER_BLOCK) as u32, splits as u32, 1),
            block: (BMM_ROWS_PER_BLOCK as u32 / 16 * 32, 1, 1),
            shared_bytes: shared_bytes as u32,
        };
        // SAFETY: the packed input holds rows × row_len values, `part` splits × rows × ldp;
        // the pipelined walk's stages fit the shared memory the function was allowed.
        unsafe { self.launch(f, cfg, &mut args)? };

        let args = Args::new()
            .ptr(part.ptr())
            .i32(splits as i32)
            .i32(rows as i32)
            .i32(ldp as i32)
            .i32(nrows as i32)
            .i32(match (up.is_some(), epi.gelu) {
                (false, _) => 0,
                (true, false) => 1,
                (true, true) => 2,
            })
            .ptr(opt(epi.bias))
            .ptr(opt(epi.residual))
            .f32(epi.scale.unwrap_or(1.0))
            .ptr(y.ptr())
            .i32(ldy as i32);
        match &epi.pack {
            None => {
                let f = self.device().function(&NORM, "bmm_finish")?;
                let mut args = args;
                let total = rows * nrows;
                // SAFETY: y and the residual hold rows rows of stride ldy; part as above.
                unsafe {
                    self.launch(
                        f,
                        LaunchConfig::linear(total.div_ceil(256) as u32, 256),
                        &mut args,
                    )
                }
            }
            Some(p) => {
                if !nrows.is_multiple_of(32) {
                    return Err(invalid(format!(
                        "packing outputs of {nrows} values (a multiple of 32)"
                    )));
                }
                p.check(rows, nrows, "packed matmul output")?;
                let f = self.device().function(&NORM, "bmm_finish_pack")?;
                let mut args = args.ptr(p.x.ptr()).ptr(p.s.ptr()).ptr(p.h.ptr());
                let cfg = LaunchConfig {
                    grid: (nrows.div_ceil(1024) as u32, rows as u32, 1),
                    block: (1024, 1, 1),
                    shared_bytes: 0,
                };
                // SAFETY: as bmm_finish's, and the packed planes hold rows × nrows values.
                unsafe { self.launch(f, cfg, &mut args) }
            }
        }
    }

    /// A grouped matmul (Mixture of Experts): `w` stacks `groups.count` experts' matrices
    /// (expert `e`'s `width` rows from `e·width`), and each expert multiplies the slots
    /// routed to it, slot `s` reading packed row `s / slots_per_input` of the `rows` in `x`
    /// and writing `y[s·ldy ..]` (`width` values): y = W_e·x + bias (bias: `w.rows` values,
    /// expert-major), or with `up` (the same experts' up matrices) act(W_e·x + bg, U_e·x +
    /// bu) (bias: 2·`w.rows` values, each expert's gate rows' then its up rows'). Each
    /// expert's rows are read once for up to 64 of its slots, on the int8 tensor cores of
    /// the register walk (`bmm_grouped_*` in cuda/bmm.cu).
    #[allow(clippy::too_many_arguments)]
    pub fn grouped_matmul(
        &self,
        w: &DeviceWeight,
        up: Option<&DeviceWeight>,
        groups: &ExpertGroups,
        x: &PackedAct,
        rows: usize,
        y: DevSlice<f32>,
        ldy: usize,
        bias: Option<DevSlice<f32>>,
        act: GatedAct,
    ) -> Result<()> {
        let module = w.format.batched.as_ref().ok_or_else(|| {
            KernelError::Unsupported(format!("no batched matmul for {} weights", w.format.tag))
        })?;
        let (width, slots, nt) =
            groups.launch_shape(w.rows, w.row_len, w.format.row_group, rows)?;
        if let Some(u) = up {
            if u.format != w.format || u.rows != w.rows || u.row_len != w.row_len {
                return Err(invalid(format!(
                    "gate ({} {}x{}) and up ({} {}x{}) differ",
                    w.format.tag, w.rows, w.row_len, u.format.tag, u.rows, u.row_len
                )));
            }
        }
        let k = w.row_len;
        x.check(rows, k, "grouped matmul input")?;
        if ldy < width {
            return Err(invalid(format!("output stride {ldy} below {width} rows")));
        }
        y.check_len((slots - 1) * ldy + width, "grouped matmul output")?;
        if let Some(b) = bias {
            let per_row = if up.is_some() { 2 } else { 1 };
            b.check_len(per_row * w.rows, "grouped matmul bias")?;
        }
        let name = match up {
            Some(_) => format!("bmm_grouped_swiglu_{}_{nt}", w.format.tag),
            None => format!("bmm_grouped_{}_{nt}", w.format.tag),
        };
        let f = self.device().function(module, &name)?;
        let (body, qh, sc) = w.ptrs();
        let mut args = Args::new().ptr(body).ptr(qh).ptr(sc);
        if let Some(u) = up {
            let (b2, qh2, sc2) = u.ptrs();
            args = args.ptr(b2).ptr(qh2).ptr(sc2);
        }
        let args = args
            .ptr(x.x.ptr())
            .ptr(x.s.ptr())
            .i32(rows as i32)
            .ptr(groups.order.ptr())
            .ptr(groups.starts.ptr())
            .i32(groups.slots_per_input as i32)
            .ptr(y.ptr())
            .i32(ldy as i32)
            .i32(width as i32)
            .i32(k as i32);
        let mut args = args.ptr(opt(bias));
        if up.is_some() {
            let (code, alpha, limit) = act.args();
            args = args.i32(code).f32(alpha).f32(limit);
        }
        let cfg = LaunchConfig {
            grid: (
                width.div_ceil(BMM_ROWS_PER_BLOCK) as u32,
                groups.count as u32,
                1,
            ),
            block: (BMM_ROWS_PER_BLOCK as u32 / 16 * 32, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: the packed input holds `rows` rows of row_len values, and every slot's
        // row (s / slots_per_input for s < slots) is among them; `y` holds the slots'
        // outputs; `order` and `starts` come from `order_experts` over these slots and
        // `count` experts (the kernel reads starts[0..=count] and order[starts..]).
        unsafe { self.launch(f, cfg, &mut args) }
    }

    /// RoPE for each row of a batch (`qkv`: rows × fused QKV), rotated Q to `q_out`, K and
    /// V at `pos[z]` of slot `slot[z]`'s cache in `kv` (every slot's view: rings
    /// `slot_stride` values apart, or a paged pool, `slot_stride` 0, through the slots' block
    /// tables), `max_ctx` rows a KV head (a ring's, or the pool's). Padding rows write
    /// nothing.
    #[allow(clippy::too_many_arguments)]
    pub fn rope_kv_batch(
        &self,
        a: &RopeArgs,
        qkv: DevSlice<f32>,
        q_out: DevSlice<f32>,
        kv: KvPlanes,
        slot_stride: usize,
        b: &BatchRows,
        max_ctx: usize,
    ) -> Result<()> {
        b.check()?;
        let hd = a.head_dim;
        let one = check_pool(&kv, slot_stride, a.n_kv * max_ctx * hd)?;
        a.check(&one, max_ctx)?;
        let width = (a.n_heads + 2 * a.n_kv) * hd;
        qkv.check_len(b.rows * width, "QKV rows")?;
        q_out.check_len(b.rows * a.n_heads * hd, "rotated Q rows")?;
        let f = self.device().function(
            &ROPE,
            &format!("rope_kv_batch{}", kv.format.kernel_suffix()),
        )?;
        let threads = ((hd / 2).div_ceil(32) * 32) as u32;
        let mut args = kv
            .push(Args::new().ptr(qkv.ptr()).ptr(q_out.ptr()))
            .ptr(b.pos.ptr())
            .ptr(b.slot.ptr())
            .u64(slot_stride as u64)
            .rope(a)
            .i32(max_ctx as i32)
            .ptr(kv.table_ptr())
            .i32(kv.table().map_or(0, |(_, stride)| stride) as i32);
        let cfg = LaunchConfig {
            grid: ((a.n_heads + a.n_kv) as u32, b.rows as u32, 1),
            block: (threads, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: sizes checked; each row's slot must lie in the pool and its position
        // below max_ctx, which the executor guarantees for the arrays it uploads.
        unsafe { self.launch(f, cfg, &mut args) }
    }

    /// Decode attention for each row of a batch over its own slot's first `len[z]`
    /// positions (split-K with the merge in the same launch, as [`Kernels::attention`]);
    /// `part_o`, `part_ml` and `counters` hold `rows` times what one row needs. With
    /// `pack`, the output is also packed for the batched matmul that reads it (as
    /// [`Kernels::act_pack`] would pack it; the rows up to the matmul's multiple of 8 are
    /// left as they are: padding, read by no real row).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_batch(
        &self,
        a: &AttnArgs,
        q: DevSlice<f32>,
        kv: KvPlanes,
        slot_stride: usize,
        b: &BatchRows,
        part_o: DevSlice<f32>,
        part_ml: DevSlice<[f32; 2]>,
        counters: DevSlice<u32>,
        out: DevSlice<f32>,
        pack: Option<PackedAct>,
    ) -> Result<()> {
        b.check()?;
        a.check()?;
        let hd = a.head_dim;
        let rows = match kv.table() {
            Some(_) => kv.values() / (a.n_kv * hd),
            None => a.max_ctx,
        };
        let one = check_pool(&kv, slot_stride, a.n_kv * rows * hd)?;
        crate::ops::cache_rows(&one, a, rows)?;
        let nsplit = a.grid_splits();
        let qd = a.n_heads * hd;
        q.check_len(b.rows * qd, "attention Q rows")?;
        part_o.check_len(b.rows * qd * nsplit, "attention partial outputs")?;
        part_ml.check_len(b.rows * a.n_heads * nsplit, "attention partial max/sum")?;
        counters.check_len(b.rows * a.n_heads, "attention split counters")?;
        out.check_len(b.rows * qd, "attention output rows")?;
        let pack_rows = Self::bmm_rows(b.rows);
        if let Some(p) = &pack {
            p.check(pack_rows, qd, "packed attention output")?;
        }
        let module = attention_module(hd, kv.format)?;
        let group_kernel = match self.batch_attention() {
            BatchAttention::Auto => b.rows >= 8 || a.heads == AttnHeads::Group,
            BatchAttention::Heads => false,
            BatchAttention::GroupMma => true,
        };
        let by_group = group_kernel && a.group_kernel_fits(kv.format);
        let (f, grid_x, shared_bytes) = if by_group {
            let name = format!("attn_decode_batch_group_{}", hd / 32);
            let f = self.device().function_with_shared(&module, &name)?;
            (f, a.n_kv, attn_group_smem(hd))
        } else {
            let name = format!(
                "attn_decode_batch{}{}_{}",
                if a.heads == AttnHeads::Pairs {
                    "_pairs"
                } else {
                    ""
                },
                kv.format.kernel_suffix(),
                hd / 32
            );
            (self.device().function(&module, &name)?, a.n_heads, 0)
        };
        let mut args = kv
            .push(Args::new().ptr(q.ptr()))
            .ptr(b.len.ptr())
            .ptr(b.slot.ptr())
            .u64(slot_stride as u64)
            .ptr(kv.table_ptr())
            .i32(kv.table().map_or(0, |(_, stride)| stride) as i32)
            .attn(a, rows)
            .ptr(part_o.ptr())
            .ptr(part_ml.ptr())
            .ptr(counters.ptr())
            .ptr(out.ptr())
            .ptr(pack.map_or(0, |p| p.x.ptr()))
            .ptr(pack.map_or(0, |p| p.s.ptr()))
            .ptr(pack.map_or(0, |p| p.h.ptr()))
            .i32(pack_rows as i32)
            .ptr(opt(a.sinks));
        let cfg = LaunchConfig {
            grid: (grid_x as u32, nsplit as u32, b.rows as u32),
            block: (128, 1, 1),
            shared_bytes: shared_bytes as u32,
        };
        // SAFETY: sizes checked; each row's slot must lie in the pool and its length be
        // ≤ max_ctx, which the executor guarantees for the arrays it uploads.
        unsafe { self.launch(f, cfg, &mut args) }
    }

    /// `out[z]` = index of the largest of row z of `logits` (`rows` × `n`), for each row.
    pub fn argmax_rows(
        &self,
        logits: DevSlice<f32>,
        rows: usize,
        n: usize,
        scratch: DevSlice<u64>,
        out: DevSlice<i32>,
    ) -> Result<()> {
        if n == 0 || rows == 0 || n > i32::MAX as usize {
            return Err(invalid(format!("argmax over {rows} rows of {n}")));
        }
        logits.check_len(rows * n, "logit rows")?;
        let blocks = Self::argmax_scratch(n);
        scratch.check_len(rows * blocks, "argmax scratch")?;
        out.check_len(rows, "argmax outputs")?;
        let f = self.device().function(&SAMPLE, "argmax_partial")?;
        let mut args = Args::new()
            .ptr(logits.ptr())
            .i32(n as i32)
            .i32(Self::ARGMAX_SLICE as i32)
            .ptr(scratch.ptr());
        let cfg = LaunchConfig {
            grid: (blocks as u32, rows as u32, 1),
            block: (512, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: sizes checked above.
        unsafe { self.launch(f, cfg, &mut args)? };
        let f = self.device().function(&SAMPLE, "argmax_final")?;
        let mut args = Args::new()
            .ptr(scratch.ptr())
            .i32(blocks as i32)
            .ptr(out.ptr());
        let cfg = LaunchConfig {
            grid: (1, rows as u32, 1),
            block: (256, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: as above.
        unsafe { self.launch(f, cfg, &mut args) }
    }

    /// `logits[index[i]] += bias[i]` for the first `n` entries: the logit biases of a
    /// batch's rows, each index a row's offset plus a token id (indices outside `logits`
    /// are skipped on the device).
    pub fn add_logit_bias(
        &self,
        logits: DevSlice<f32>,
        index: DevSlice<i32>,
        bias: DevSlice<f32>,
        n: usize,
    ) -> Result<()> {
        if n == 0 {
            return Ok(());
        }
        if logits.len() > i32::MAX as usize || n > i32::MAX as usize {
            return Err(invalid(format!(
                "{n} logit biases over {} logits",
                logits.len()
            )));
        }
        index.check_len(n, "logit bias indices")?;
        bias.check_len(n, "logit biases")?;
        let f = self.device().function(&SAMPLE, "add_logit_bias")?;
        let mut args = Args::new()
            .ptr(logits.ptr())
            .i32(logits.len() as i32)
            .ptr(index.ptr())
            .ptr(bias.ptr())
            .i32(n as i32);
        let cfg = LaunchConfig {
            grid: (n.div_ceil(256) as u32, 1, 1),
            block: (256, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: `n` entries checked in both arrays; the kernel bounds every index.
        unsafe { self.launch(f, cfg, &mut args) }
    }

    /// Candidate keys `sample_rows` needs per row of `n` logits.
    pub fn sample_rows_scratch(n: usize) -> usize {
        Self::sample_scratch(n, Self::MAX_TOP_K)
    }

    /// Draws `out[z]` from row z of `logits` with its own settings `params[z]` =
    /// (temperature, top_p, min_p, top_k as f32; top_k 1 is greedy) and uniform `u[z]`.
    #[allow(clippy::too_many_arguments)]
    pub fn sample_rows(
        &self,
        logits: DevSlice<f32>,
        rows: usize,
        n: usize,
        params: DevSlice<[f32; 4]>,
        u: DevSlice<f32>,
        scratch: DevSlice<u64>,
        out: DevSlice<i32>,
    ) -> Result<()> {
        let ncand = Self::sample_rows_scratch(n);
        if rows == 0 || n == 0 || ncand > 4096 {
            return Err(invalid(format!(
                "device sampling of {rows} rows of {n} logits"
            )));
        }
        logits.check_len(rows * n, "logit rows")?;
        params.check_len(rows, "sampling settings")?;
        u.check_len(rows, "uniform draws")?;
        scratch.check_len(rows * ncand, "sampling scratch")?;
        out.check_len(rows, "sampled tokens")?;
        let k = Self::MAX_TOP_K;
        let f = self.device().function(&SAMPLE, "topk_partial")?;
        let mut args = Args::new()
            .ptr(logits.ptr())
            .i32(n as i32)
            .i32(k as i32)
            .ptr(scratch.ptr());
        let cfg = LaunchConfig {
            grid: ((ncand / k) as u32, rows as u32, 1),
            block: (1024, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: sizes checked above.
        unsafe { self.launch(f, cfg, &mut args)? };
        let f = self.device().function(&SAMPLE, "sample_rows")?;
        let mut args = Args::new()
            .ptr(scratch.ptr())
            .i32(ncand as i32)
            .ptr(params.ptr())
            .ptr(u.ptr())
            .ptr(out.ptr());
        let cfg = LaunchConfig {
            grid: (1, rows as u32, 1),
            block: (1024, 1, 1),
            shared_bytes: 0,
        };
        // SAFETY: as above; top_k is clamped to 1..=64 by the caller's settings check.
        unsafe { self.launch(f, cfg, &mut args) }
    }
}

/// Checks a batched step's view of a layer's cache and returns one slot's view (what the
/// one-sequence checks take): whole rings of `slot_stride` values, each the `slot_values`
/// (`n_kv · rows · head_dim`) values a slot holds; or a paged pool of `slot_values` values
/// with block tables (`slot_stride` 0).
fn check_pool(kv: &KvPlanes, slot_stride: usize, slot_values: usize) -> Result<KvPlanes> {
    match kv.table() {
        Some(_) if slot_stride == 0 && kv.values() == slot_values => Ok(*kv),
        None if slot_stride != 0
            && slot_stride == slot_values
            && kv.values().is_multiple_of(slot_stride) =>
        {
            kv.sub(0, slot_stride)
        }
        _ => Err(invalid(format!(
            "a KV pool of {} values with slots of {slot_stride} ({slot_values} values a slot{})",
            kv.values(),
            if kv.table().is_some() { ", paged" } else { "" }
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::{DevSlice, ExpertGroups};

    fn groups(count: usize, slots: usize, slots_per_input: usize) -> ExpertGroups {
        ExpertGroups {
            count,
            order: DevSlice::from_raw(0x1000, slots),
            starts: DevSlice::from_raw(0x2000, count + 1),
            slots_per_input,
        }
    }

    /// A grouped matmul's shape: an expert's rows, its slots, and the tile (8·NT slots)
    /// that covers an expert's even share; and the launches it refuses.
    #[test]
    fn grouped_launch_shapes() {
        // qwen3-30b-a3b's gate (128 experts of 768 rows): a batch of 64 tokens (4 slots an
        // expert), a 512-token prefill chunk (32); Mixtral's 8 experts of 14,336 at 64
        // tokens (16 an expert) and 512 (128: several tiles of 64).
        assert_eq!(
            groups(128, 512, 8)
                .launch_shape(128 * 768, 2048, 1, 64)
                .unwrap(),
            (768, 512, 1)
        );
        assert_eq!(
            groups(128, 4096, 8)
                .launch_shape(128 * 768, 2048, 1, 512)
                .unwrap(),
            (768, 4096, 4)
        );
        assert_eq!(
            groups(8, 128, 2)
                .launch_shape(8 * 14336, 4096, 1, 64)
                .unwrap(),
            (14336, 128, 2)
        );
        assert_eq!(
            groups(8, 1024, 2)
                .launch_shape(8 * 14336, 4096, 1, 512)
                .unwrap(),
            (14336, 1024, 8)
        );
        // The down projection: each slot its own packed row.
        assert_eq!(
            groups(128, 512, 1)
                .launch_shape(128 * 2048, 768, 1, 512)
                .unwrap(),
            (2048, 512, 1)
        );
        // Fewer slots than experts: a share of one.
        assert_eq!(
            groups(64, 10, 1).launch_shape(64 * 32, 64, 4, 10).unwrap(),
            (32, 10, 1)
        );
        // Refused: rows that do not stack the experts, an expert splitting a row group, rows
        // not whole chunks, no slots, no packed row a slot, too few packed rows, starts of
        // the wrong length, too many experts.
        assert!(groups(3, 8, 1).launch_shape(100, 64, 1, 8).is_err());
        assert!(groups(4, 8, 1).launch_shape(4 * 6, 64, 4, 8).is_err());
        assert!(groups(4, 8, 1).launch_shape(64, 48, 1, 8).is_err());
        assert!(groups(4, 0, 1).launch_shape(64, 64, 1, 8).is_err());
        assert!(groups(4, 8, 0).launch_shape(64, 64, 1, 8).is_err());
        assert!(groups(4, 16, 2).launch_shape(64, 64, 1, 7).is_err());
        let mut short = groups(4, 8, 1);
        short.starts = DevSlice::from_raw(0x2000, 4);
        assert!(short.launch_shape(64, 64, 1, 8).is_err());
        assert!(groups(1025, 8, 1).launch_shape(1025 * 4, 64, 1, 8).is_err());
    }
}
