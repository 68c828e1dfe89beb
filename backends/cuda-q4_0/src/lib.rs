//! # kiln-backend-cuda-q4_0
//!
//! The CUDA backend for Q4_0 models: GGUF `Q4_0` files and APR's 4-bit type (transcoded
//! to Q4_0 blocks at upload, then the same layout and kernels). The executor is the shared GPU runtime
//! (`kiln-cuda-runtime`); this crate is its policy: Q4_0 matrices are repacked at upload
//! (rows of at least 2048 values) into rows of four (`kiln_kernels::Q4_0_X4`: per 32-chunk tile, each row's 16-byte quant
//! blocks contiguous, the four rows' scales of a chunk in one 8-byte word), read by GEMVs
//! whose warps own whole 4-row groups. The other tensors such files carry (a Q6_K or Q8_0
//! LM head, F16 or Q8_0 embeddings) keep their plain layout and the runtime's kernels.
//!
//! Without a CUDA driver `probe()` says why and nothing panics.

use std::sync::Arc;

use kiln_core::{score, Backend, LayerExecutor, LoadOptions, ModelIr, QType, Result, Support};
use kiln_cuda_runtime::{check_model, shared_device, GpuPolicy};
use kiln_kernels::{
    gemv_qtypes, Device, DeviceWeight, GemvTiling, WeightFormat, APR_Q4_X4, Q4_0_X4,
};

pub use kiln_cuda_runtime::{GpuExecutor, PrefillTimes, StepVariants, PREFILL_CHUNK};

/// The backend's name.
pub const NAME: &str = "cuda-q4_0";

/// The `cuda-q4_0` backend.
#[derive(Debug, Default, Clone)]
pub struct CudaQ40Backend;

/// `cuda-q4_0`'s choices for the shared runtime. `Default` is what the backend uses; the
/// fields are there so a benchmark can compare the alternatives in one process.
#[derive(Debug, Clone, Copy)]
pub struct Q40Policy {
    /// Q4_0 matrices whose rows hold at least this many values are repacked into
    /// `Q4_0_X4`; shorter rows keep the plain layout (`usize::MAX`: never repack).
    pub grouped_from: usize,
    /// Tiling of the plain-output GEMVs (QKV, LM head) over `Q4_0_X4` weights.
    pub grouped_tiling: GemvTiling,
}

/// Measured on an H200 (`q4_0_variants -n 128`, 2026-11-30, tg128 tok/s; synthetic q4_0
/// files of real shapes): rows of four from 2048 values on, R4S4 — SmolLM2-135M 1,712
/// (x4 everywhere: 1,584–1,623; its 576- and 1536-long rows run best plain), Llama-3.2-1B
/// 1,432 (plain everywhere: 1,045), Llama-3-8B 437 (plain: 418; R4S1: 414).
impl Default for Q40Policy {
    fn default() -> Self {
        Q40Policy {
            grouped_from: 2048,
            grouped_tiling: GemvTiling::new(4, 4),
        }
    }
}

impl GpuPolicy for Q40Policy {
    fn backend_name(&self) -> &'static str {
        NAME
    }

    fn format_for(&self, qtype: QType, row_len: usize) -> Option<&'static WeightFormat> {
        match qtype {
            QType::Q4_0 if row_len >= self.grouped_from => Some(&Q4_0_X4),
            QType::AprQ4 if row_len >= self.grouped_from => Some(&APR_Q4_X4),
            q => WeightFormat::plain(q),
        }
    }

    fn gemv_tiling(&self, w: &DeviceWeight) -> GemvTiling {
        if w.format.is_grouped() {
            self.grouped_tiling
        } else if w.qtype.is_quantized() {
            GemvTiling::new(2, 2)
        } else {
            GemvTiling::new(4, 2)
        }
    }

    fn quant_tiling(&self, w: &DeviceWeight, hidden: usize) -> GemvTiling {
        match (w.format.is_grouped(), hidden) {
            (_, h) if h >= 4096 => GemvTiling::new(4, 2),
            (true, _) => GemvTiling::new(4, 1),
            (false, h) if h >= 2048 => GemvTiling::new(4, 1),
            (false, _) => GemvTiling::new(2, 1),
        }
    }
}

/// Loads `model` on `device` with `cuda-q4_0`'s policy (what `Backend::load` does on
/// device 0; tests and benchmarks call it to keep the concrete type).
pub fn load_executor(
    device: &Arc<Device>,
    model: &ModelIr,
    options: &LoadOptions,
) -> Result<GpuExecutor> {
    GpuExecutor::load(device, model, options, Arc::new(Q40Policy::default()))
}

impl Backend for CudaQ40Backend {
    fn name(&self) -> &str {
        NAME
    }

    fn description(&self) -> &str {
        "NVIDIA GPU: GPU-resident decode of Q4_0 models (rows repacked in fours for the GEMV)"
    }

    fn qtypes(&self) -> Vec<QType> {
        gemv_qtypes()
    }

    fn probe(&self) -> Result<String, String> {
        kiln_cuda_runtime::probe()
    }

    fn supports(&self, model: &ModelIr) -> Support {
        if let Err(reason) = check_model(model, &Q40Policy::default()) {
            return Support::No { reason };
        }
        // APR's 4-bit type is Q4_0 with its nibbles in another order: the same family.
        let share = model.matmul_share(|q| matches!(q, QType::Q4_0 | QType::AprQ4));
        if share > score::MAJORITY {
            Support::Yes {
                score: score::GPU_SPECIALIST,
                note: format!(
                    "Q4_0 (or APR 4-bit) holds {:.0}% of the matmul bytes",
                    100.0 * share
                ),
            }
        } else {
            Support::Yes {
                score: score::GPU_OTHER_FAMILY,
                note: format!(
                    "can run it, but is made for Q4_0, which holds {:.0}% of the matmul bytes",
                    100.0 * share
                ),
            }
        }
    }

    fn load(&self, model: &ModelIr, options: &LoadOptions) -> Result<Box<dyn LayerExecutor>> {
        let device = shared_device().map_err(kiln_core::Error::NoBackend)?;
        Ok(Box::new(load_executor(&device, model, options)?))
    }
}

kiln_core::inventory::submit! {
    kiln_core::BuiltinBackend { create: || Arc::new(CudaQ40Backend) }
}
