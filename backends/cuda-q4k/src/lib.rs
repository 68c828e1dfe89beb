//! # kiln-backend-cuda-q4k
//!
//! The CUDA backend for K-quant models (Q4_K_M, Q5_K_M, Q6_K mixes, and the 32-value and
//! float types such recipes leave in place). The executor is the shared GPU runtime
//! (`kiln-cuda-runtime`: GPU-resident weights, one CUDA graph per decode step, batched
//! prefill); this crate is its policy: every weight type in its plain device layout, and the
//! GEMV tilings measured fastest for K-quant mixes. Its kernel set is the broadest of the
//! GPU backends, so it is also the GPU fallback for models no other backend is made for.
//!
//! Without a CUDA driver `probe()` says why and nothing panics.

use std::sync::Arc;

use kiln_core::{score, Backend, LayerExecutor, LoadOptions, ModelIr, QType, Result, Support};
use kiln_cuda_runtime::{check_model, shared_device, GpuPolicy};
use kiln_kernels::{gemv_qtypes, Device, DeviceWeight, GemvTiling};

pub use kiln_cuda_runtime::{
    group_attention_from, GpuExecutor, PrefillTimes, StepVariants, PREFILL_CHUNK, SHORT_PREFILL,
};

/// The backend's name.
pub const NAME: &str = "cuda-q4k";

/// The `cuda-q4k` backend.
#[derive(Debug, Default, Clone)]
pub struct CudaQ4kBackend;

/// `cuda-q4k`'s choices for the shared runtime.
#[derive(Debug, Default, Clone, Copy)]
pub struct Q4kPolicy;

/// Tiling of the GEMVs that quantise their output (their blocks own whole 32-row groups),
/// by hidden size, the weight's rows and its type. Measured on an H200 (decode_bench,
/// 2026-11-30, tg64 tok/s for R2S1 / R4S1 / R4S2): SmolLM2-135M (576) 1164 / 1025 / 1059,
/// Llama-3.2-1B (2048) 1167 / 1200 / 1183, Llama-3-8B (4096) 294 / 327 / 358. Per launch
/// (kernel_bench, 2026-12-02, 15-bit activations, R4S1 against R4S2):
/// - q4_k at hidden 4096: the 14336-row SwiGLU 26.9 against 29.1 µs (448 blocks of 8 warps
///   fill the SMs in finer steps than 448 of 16), the 4096-row O and down projections
///   5.7 / 15.5 against 5.4 / 13.5 (128 blocks need 16 warps each to occupy the GPU);
/// - q6_k: 34.8 against 16.5 µs for the 8B's down projection (few rows, long rows: the
///   proportions of the 1B's down too, the q6_k matrices that quantise their output in
///   q4_k_m files), so R4S2 from hidden 2048 (8.0 against 8.3 µs for a 2048-wide SwiGLU
///   of 8192 rows, the one shape measured where R4S1 wins, none a q4_k_m file has).
pub fn quant_tiling_for(hidden: usize, rows: usize, qtype: QType) -> GemvTiling {
    let wide = rows >= 3 * hidden;
    match hidden {
        h if h >= 4096 && wide && qtype != QType::Q6_K => GemvTiling::new(4, 1),
        h if h >= 4096 => GemvTiling::new(4, 2),
        h if h >= 2048 && qtype == QType::Q6_K => GemvTiling::new(4, 2),
        h if h >= 2048 => GemvTiling::new(4, 1),
        _ => GemvTiling::new(2, 1),
    }
}

impl GpuPolicy for Q4kPolicy {
    fn backend_name(&self) -> &'static str {
        NAME
    }

    fn gemv_tiling(&self, w: &DeviceWeight) -> GemvTiling {
        if w.qtype.is_quantized() {
            GemvTiling::new(2, 2)
        } else {
            GemvTiling::new(4, 2)
        }
    }

    fn quant_tiling(&self, w: &DeviceWeight, hidden: usize) -> GemvTiling {
        quant_tiling_for(hidden, w.rows, w.qtype)
    }
}

/// Loads `model` on `device` with `cuda-q4k`'s policy (what `Backend::load` does on device
/// 0; tests and benchmarks call it to keep the concrete type).
pub fn load_executor(
    device: &Arc<Device>,
    model: &ModelIr,
    options: &LoadOptions,
) -> Result<GpuExecutor> {
    GpuExecutor::load(device, model, options, Arc::new(Q4kPolicy))
}

fn is_kquant(q: QType) -> bool {
    matches!(
        q,
        QType::Q2_K | QType::Q3_K | QType::Q4_K | QType::Q5_K | QType::Q6_K
    )
}

impl Backend for CudaQ4kBackend {
    fn name(&self) -> &str {
        NAME
    }

    fn description(&self) -> &str {
        "NVIDIA GPU: GPU-resident decode of K-quant models (NVRTC kernels, dp4a GEMV, CUDA graphs)"
    }

    fn qtypes(&self) -> Vec<QType> {
        gemv_qtypes()
    }

    fn probe(&self) -> Result<String, String> {
        kiln_cuda_runtime::probe()
    }

    fn supports(&self, model: &ModelIr) -> Support {
        if let Err(reason) = check_model(model, &Q4kPolicy) {
            return Support::No { reason };
        }
        let share = model.matmul_share(is_kquant);
        if share > score::MAJORITY {
            Support::Yes {
                score: score::GPU_SPECIALIST,
                note: format!("K-quants hold {:.0}% of the matmul bytes", 100.0 * share),
            }
        } else {
            Support::Yes {
                score: score::GPU_GENERAL,
                note: format!(
                    "runs every GEMV type on the GPU; K-quants hold {:.0}% of the matmul bytes",
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
    kiln_core::BuiltinBackend { create: || Arc::new(CudaQ4kBackend) }
}
