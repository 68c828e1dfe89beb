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

/// Arguments an instruction carries (`PInstr::a` in persist.cu).
const INSTR_ARGS: usize = 24;
/// Bytes of one `PInstr`: op, blocks, grid_y, wait, then the arguments.
const INSTR_BYTES: usize = 16 + 8 * INSTR_ARGS;

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
    /// The grid barrier's arrival counter (only grows; see persist.cu).
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
fn module_for(warps: usize, calls: &[String]) -> KernelModule {
    static MODULES: OnceLock<Mutex<HashMap<String, KernelModule>>> = OnceLock::new();
    let mut suffix = format!("#define P_NW {warps}\n#define P_CASES");
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
    vec![module_for(8, &small), module_for(16, &large)]
}

impl StepProgram {
    /// A program of `n` instructions that do nothing but wait at the barrier: what a
    /// barrier costs (`kernel time / n`).
    pub fn barrier_chain(k: &Kernels, warps: usize, n: usize) -> Result<StepProgram> {
        let ops: Vec<PersistOp> = (0..n)
            .map(|_| PersistOp::new("P_ROPE(false)".into(), OpKind::Other, 0, 1))
            .collect();
        StepProgram::new(k, warps, &ops)
    }

    /// Uploads `ops` (from [`Kernels::record_step`] with `warps`) as a program for `k`'s
    /// device, compiling its module if needed.
    pub fn new(k: &Kernels, warps: usize, ops: &[PersistOp]) -> Result<StepProgram> {
        if ops.is_empty() {
            return Err(KernelError::InvalidArgument(
                "a persistent step of no instructions".into(),
            ));
        }
        let mut calls: Vec<String> = Vec::new();
        let mut bytes = Vec::with_capacity(ops.len() * INSTR_BYTES);
        let mut prev: Option<OpKind> = None;
        for op in ops {
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
            for word in [id as u32, op.blocks, op.grid_y, wait as u32] {
                bytes.extend_from_slice(&word.to_le_bytes());
            }
            let slots = op.args.slots();
            if slots.len() > INSTR_ARGS {
                return Err(KernelError::InvalidArgument(format!(
                    "{}: {} arguments, more than an instruction holds ({INSTR_ARGS})",
                    op.call,
                    slots.len()
                )));
            }
            for i in 0..INSTR_ARGS {
                bytes.extend_from_slice(&slots.get(i).copied().unwrap_or(0).to_le_bytes());
            }
        }
        let device = k.device().clone();
        let module = module_for(warps, &calls);
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
            count: DeviceBuffer::zeros(&device, 1)?,
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
            .ptr(self.count.ptr());
        // SAFETY: the program's arguments were size-checked by the wrappers that recorded
        // them, and the buffers they name outlive the program (the executor owns both);
        // `count` is the program's own.
        unsafe {
            self.device
                .launch_cooperative(f, self.grid, (self.warps * 32) as u32, &mut args)
        }
    }
}
