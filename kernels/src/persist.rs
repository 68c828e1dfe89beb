//! The decode step as one persistent kernel (`cuda/persist.cu`).
//!
//! A step is first *recorded*: the executor queues it exactly as it would for a CUDA graph,
//! but with [`Kernels::record_step`] active the launch wrappers that the persistent kernel
//! can run (embedding, GEMV, SwiGLU, RoPE + KV write, attention) append an instruction —
//! which operation, how many virtual blocks, the launch's own arguments — instead of
//! launching, and every other launch refuses (the step then stays on the graph path). The
//! instructions become a [`StepProgram`]: a device array the kernel walks, and a module
//! generated for the model's set of operations (one `case` each), compiled by NVRTC and
//! cached like every other. One cooperative launch of [`StepProgram::launch`] then runs the
//! whole step: all blocks resident, a grid barrier where an instruction reads what the one
//! before wrote.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use crate::buffer::DeviceBuffer;
use crate::compile::KernelModule;
use crate::device::{Args, Device};
use crate::error::{KernelError, Result};
use crate::ops::Kernels;

const PERSIST_SRC: &str = concat!(
    include_str!("../cuda/gemv.cu"),
    "\n",
    include_str!("../cuda/attention.cu"),
    "\n",
    include_str!("../cuda/rope.cu"),
    "\n",
    include_str!("../cuda/persist.cu"),
);

/// u64 words of a program's barrier counters: 16 group lines and the top one (persist.cu).
const BARRIER_WORDS: usize = 17 * 16;

/// Which grid barrier programs made from now on use (persist.cu's P_BARRIER): 0 one
/// counter, 1 group counters under a top one. An experiment's knob.
pub static BARRIER: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(1);

/// Arguments an instruction carries (`PInstr::a` in persist.cu).
const INSTR_ARGS: usize = 24;
/// Bytes of one `PInstr`: op, blocks, grid_y, wait, pf_begin, pf_end, padding, then the
/// arguments.
const INSTR_BYTES: usize = 32 + 8 * INSTR_ARGS;

/// How far ahead of the instruction running the kernel asks L2 for weights: about half the
/// H100/H200's 50 MB L2, so what was fetched ahead is still there when it is used.
pub const LOOKAHEAD_BYTES: usize = 24 << 20;
/// Weights are asked for in chunks of at most this many bytes, spread over the grid.
const CHUNK_BYTES: usize = 64 << 10;

/// What one recorded launch does, as the persistent kernel runs it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum OpKind {
    Embed,
    /// A GEMV that writes its own rows of an output from an input nobody writes meanwhile.
    /// Consecutive ones with the same input need no barrier between them (Q, K and V as
    /// separate runs of one input).
    Gemv {
        input: u64,
    },
    Other,
}

/// One recorded launch: an instruction of a persistent step.
#[derive(Debug, Clone)]
pub struct PersistOp {
    /// The `case` body in persist.cu's terms, e.g. `P_GEMV(T_Q4_K, A_Q16, 4, 1, false, true)`.
    pub(crate) call: String,
    pub(crate) kind: OpKind,
    /// Virtual blocks at the kernel's block size.
    pub(crate) blocks: u32,
    pub(crate) grid_y: u32,
    pub(crate) args: Args,
    /// The weight arrays it reads (address, bytes): what the kernel fetches ahead.
    pub(crate) weights: Vec<(u64, usize)>,
}

impl PersistOp {
    /// An instruction of `blocks` virtual blocks (its arguments are filled in when recorded).
    pub(crate) fn new(call: String, kind: OpKind, blocks: usize, grid_y: usize) -> PersistOp {
        PersistOp {
            call,
            kind,
            blocks: blocks as u32,
            grid_y: grid_y as u32,
            args: Args::new(),
            weights: Vec::new(),
        }
    }
}

/// A step being recorded: the persistent kernel's block size and what was recorded.
#[derive(Debug)]
pub(crate) struct Recording {
    pub warps: usize,
    pub ops: Vec<PersistOp>,
}

/// A recorded decode step on the device, ready to launch.
pub struct StepProgram {
    device: Arc<Device>,
    module: KernelModule,
    instrs: DeviceBuffer<u8>,
    /// The weight chunks instructions ask L2 for ahead of use (`PChunk`s).
    chunks: DeviceBuffer<u8>,
    /// The grid barrier's arrival counters (only grow; see persist.cu).
    count: DeviceBuffer<u64>,
    n: usize,
    warps: usize,
    /// Physical blocks: every block resident at once.
    grid: u32,
}

impl Kernels {
    /// Records the launches `queue` makes as a persistent step of blocks of `warps` warps
    /// (8 or 16), without launching anything. Fails (`Unsupported`, naming the launch) if
    /// `queue` launches a kernel the persistent step does not run.
    pub fn record_step(
        &self,
        warps: usize,
        queue: impl FnOnce() -> Result<()>,
    ) -> Result<Vec<PersistOp>> {
        if ![8, 16].contains(&warps) {
            return Err(KernelError::InvalidArgument(format!(
                "a persistent step runs blocks of 8 or 16 warps, not {warps}"
            )));
        }
        *self.recording.lock().expect("recording lock poisoned") = Some(Recording {
            warps,
            ops: Vec::new(),
        });
        let queued = queue();
        let rec = self
            .recording
            .lock()
            .expect("recording lock poisoned")
            .take()
            .expect("recording set above");
        queued?;
        Ok(rec.ops)
    }

    /// Whether a step is being recorded; then the persistent block size in warps.
    pub(crate) fn recording_warps(&self) -> Option<usize> {
        self.recording
            .lock()
            .expect("recording lock poisoned")
            .as_ref()
            .map(|r| r.warps)
    }

    /// Appends `op` to the step being recorded.
    pub(crate) fn record(&self, op: PersistOp) {
        if let Some(r) = self
            .recording
            .lock()
            .expect("recording lock poisoned")
            .as_mut()
        {
            r.ops.push(op);
        }
    }
}

/// The generated module for one set of operations at one block size, made once per
/// process (modules are keyed by a `'static` name, so each distinct text is kept).
fn module_for(warps: usize, barrier: usize, calls: &[String]) -> KernelModule {
    static MODULES: OnceLock<Mutex<HashMap<String, KernelModule>>> = OnceLock::new();
    let mut suffix = format!("#define P_NW {warps}\n#define P_BARRIER {barrier}\n#define P_CASES");
    for (i, c) in calls.iter().enumerate() {
        suffix.push_str(&format!(" \\\n    case {i}: {c}; break;"));
    }
    suffix.push_str("\nPERSIST_KERNEL\n");
    let table = MODULES.get_or_init(|| Mutex::new(HashMap::new()));
    let mut table = table.lock().expect("module table poisoned");
    if let Some(m) = table.get(&suffix) {
        return *m;
    }
    let n = table.len();
    let name: &'static str = Box::leak(format!("persist_{n}").into_boxed_str());
    let text: &'static str = Box::leak(suffix.clone().into_boxed_str());
    // Restrict-qualified loads may be compiled as non-coherent (read-only for the kernel's
    // lifetime) loads; here one instruction reads what another wrote in the same launch.
    let m = KernelModule::generated(name, "#define __restrict__\n", PERSIST_SRC, text);
    table.insert(suffix, m);
    m
}

/// For each instruction, the weight chunks it asks L2 for before it runs: every later
/// instruction's weights, each as soon as the bytes between the asking instruction and it
/// are under `lookahead` (so the stream of weights runs that far ahead of the
/// instruction reading it, and a chain of small, latency-bound instructions finds its
/// weights in L2); a matrix larger than the window, its first window's worth. Chunks are
/// 16-byte aligned and whole multiples of 16 bytes (the bulk
/// prefetch's rule); a tail under 16 bytes is left to the demand loads.
fn prefetch_schedule(ops: &[PersistOp], lookahead: usize) -> Vec<Vec<(u64, usize)>> {
    let sizes: Vec<usize> = ops
        .iter()
        .map(|o| o.weights.iter().map(|w| w.1).sum())
        .collect();
    // start[j]: weight bytes of the instructions before j.
    let mut start = Vec::with_capacity(ops.len() + 1);
    let mut at = 0usize;
    for s in &sizes {
        start.push(at);
        at += s;
    }
    let mut out = vec![Vec::new(); ops.len()];
    let mut asker = 0;
    for (j, op) in ops.iter().enumerate().skip(1) {
        // The earliest instruction i < j after which no more than `lookahead` bytes of
        // weights come before j's.
        if lookahead == 0 {
            break;
        }
        while asker + 1 < j && start[j] - start[asker + 1] > lookahead {
            asker += 1;
        }
        // A matrix larger than the window is asked for up to the window's worth (each
        // array in proportion): more would evict its own first bytes before they are read.
        let keep = |bytes: usize| {
            if sizes[j] <= lookahead {
                bytes
            } else {
                (bytes as u128 * lookahead as u128 / sizes[j] as u128) as usize
            }
        };
        for &(ptr, bytes) in &op.weights {
            let first = ptr.next_multiple_of(16);
            let end = (ptr + keep(bytes) as u64) & !15;
            let mut p = first;
            while p < end {
                let n = (end - p).min(CHUNK_BYTES as u64);
                out[asker].push((p, n as usize));
                p += n;
            }
        }
    }
    out
}

/// Persistent modules that between them hold every kind of operation a program can (each
/// weight format's GEMV; quantising and SwiGLU ones on both integer paths and the float
/// path; embedding; RoPE and attention over both cache formats) at both block sizes: what
/// CI compile-checks (`compile::all_modules`). A model's own module holds only its cases.
pub fn check_modules() -> Vec<KernelModule> {
    let mut small = vec![
        "P_ROPE(false)".to_string(),
        "P_ATTN(4, 1, KvF16, KV_F16_K, KV_F16_V)".to_string(),
        "P_EMBED(T_Q8_0)".to_string(),
        "P_GEMV(T_Q4_K, A_Q16, 4, 1, false, true)".to_string(),
        "P_GEMV(T_Q6_K, A_Q16, 4, 1, true, true)".to_string(),
    ];
    small.extend(
        crate::format::FORMATS
            .iter()
            .map(|f| format!("P_GEMV({}, A_Q16, 4, 2, false, false)", f.cuda_type)),
    );
    let large = [
        "P_ROPE(true)",
        "P_ATTN(2, 2, KvQ8, KV_Q8_K, KV_Q8_V)",
        "P_EMBED(T_Q4_K)",
        "P_GEMV(T_Q4_0X4, A_Q8, 4, 2, false, true)",
        "P_GEMV(T_Q5_0, A_Q8, 2, 1, true, true)",
        "P_GEMV(T_F16, A_F32, 2, 2, false, false)",
    ]
    .map(String::from);
    vec![module_for(8, 0, &small), module_for(16, 1, &large)]
}

impl StepProgram {
    /// A program of `n` instructions that do nothing but wait at the barrier: what a
    /// barrier costs (`kernel time / n`).
    pub fn barrier_chain(k: &Kernels, warps: usize, n: usize) -> Result<StepProgram> {
        let ops: Vec<PersistOp> = (0..n)
            .map(|_| PersistOp::new("P_ROPE(false)".into(), OpKind::Other, 0, 1))
            .collect();
        StepProgram::new(k, warps, 0, &ops)
    }

    /// Uploads `ops` (from [`Kernels::record_step`] with `warps`) as a program for `k`'s
    /// device, compiling its module if needed.
    /// `lookahead`: how many bytes of weights ahead the kernel asks L2 for (0: none;
    /// [`LOOKAHEAD_BYTES`] by default).
    pub fn new(
        k: &Kernels,
        warps: usize,
        lookahead: usize,
        ops: &[PersistOp],
    ) -> Result<StepProgram> {
        if ops.is_empty() {
            return Err(KernelError::InvalidArgument(
                "a persistent step of no instructions".into(),
            ));
        }
        let chunks_at = prefetch_schedule(ops, lookahead);
        let mut calls: Vec<String> = Vec::new();
        let mut bytes = Vec::with_capacity(ops.len() * INSTR_BYTES);
        let mut chunk_bytes = Vec::new();
        let mut prev: Option<OpKind> = None;
        for (op, chunks) in ops.iter().zip(&chunks_at) {
            let id = match calls.iter().position(|c| *c == op.call) {
                Some(i) => i,
                None => {
                    calls.push(op.call.clone());
                    calls.len() - 1
                }
            };
            let wait = !matches!((prev, op.kind),
                (Some(OpKind::Gemv { input: a }), OpKind::Gemv { input: b }) if a == b);
            prev = Some(op.kind);
            let pf_begin = (chunk_bytes.len() / 16) as u32;
            for &(ptr, n) in chunks {
                chunk_bytes.extend_from_slice(&ptr.to_le_bytes());
                chunk_bytes.extend_from_slice(&(n as u32).to_le_bytes());
                chunk_bytes.extend_from_slice(&0u32.to_le_bytes());
            }
            let pf_end = (chunk_bytes.len() / 16) as u32;
            for word in [
                id as u32,
                op.blocks,
                op.grid_y,
                wait as u32,
                pf_begin,
                pf_end,
                0,
                0,
            ] {
                bytes.extend_from_slice(&word.to_le_bytes());
            }
            let slots = op.args.slots();
            for i in 0..INSTR_ARGS {
                bytes.extend_from_slice(&slots.get(i).copied().unwrap_or(0).to_le_bytes());
            }
        }
        if chunk_bytes.is_empty() {
            chunk_bytes.resize(16, 0);
        }
        let device = k.device().clone();
        let module = module_for(
            warps,
            BARRIER.load(std::sync::atomic::Ordering::Relaxed),
            &calls,
        );
        device.load_modules(&[module])?;
        let f = device.function(&module, "decode_persistent")?;
        let per_sm = device.max_active_blocks(f, (warps * 32) as u32)?;
        if per_sm == 0 {
            return Err(KernelError::Unsupported(format!(
                "the persistent decode kernel of {warps} warps a block does not fit on an SM"
            )));
        }
        let grid = (per_sm * device.sm_count()) as u32;
        Ok(StepProgram {
            instrs: DeviceBuffer::from_host(&device, &bytes)?,
            chunks: DeviceBuffer::from_host(&device, &chunk_bytes)?,
            count: DeviceBuffer::zeros(&device, BARRIER_WORDS)?,
            device,
            module,
            n: ops.len(),
            warps,
            grid,
        })
    }

    /// Instructions in the program.
    pub fn len(&self) -> usize {
        self.n
    }

    pub fn is_empty(&self) -> bool {
        self.n == 0
    }

    /// Physical blocks of a launch (every one resident).
    pub fn grid(&self) -> u32 {
        self.grid
    }

    /// Queues the whole step: one cooperative launch.
    pub fn launch(&self) -> Result<()> {
        let f = self.device.function(&self.module, "decode_persistent")?;
        let mut args = Args::new()
            .ptr(self.instrs.ptr())
            .i32(self.n as i32)
            .ptr(self.chunks.ptr())
            .ptr(self.count.ptr());
        // SAFETY: the program's arguments were size-checked by the wrappers that recorded
        // them, and the buffers they name outlive the program (the executor owns both); the
        // chunks lie inside those weights; `count` is the program's own.
        unsafe {
            self.device
                .launch_cooperative(f, self.grid, (self.warps * 32) as u32, &mut args)
        }
    }
}
