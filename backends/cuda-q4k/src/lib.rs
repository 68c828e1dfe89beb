//! # kiln-backend-cuda-q4k
//!
//! The CUDA backend for K-quant models (Q4_K_M, Q5_K_M, Q6_K mixes, and the 32-value and
//! float types such recipes leave in place). Weights are uploaded once, in the GEMV
//! kernels' aligned layout; a decode step runs entirely on the GPU as one CUDA graph
//! (embedding lookup, per layer RMSNorm+Q8_1, QKV GEMV with bias, RoPE + KV-cache write,
//! split-K attention, output projection with the residual add fused, RMSNorm+Q8_1,
//! gate+up+SwiGLU, down projection with the residual, then the LM head), captured on a
//! sequence's first step and replayed with the token and position read from device memory.
//! Per token only the id (and position) go up and the logits or a sampled id come down.
//!
//! Kernels, device memory and graphs come from `kiln-kernels`; without a CUDA driver
//! `probe()` says why and nothing panics.

use std::sync::{Arc, OnceLock};

use kiln_core::{Backend, LayerExecutor, LoadOptions, ModelIr, QType, Result, Support};
use kiln_kernels::{Device, GEMV_QTYPES};

mod executor;

pub use executor::{quant_tiling_for, CudaExecutor, PrefillTimes, PREFILL_CHUNK};

/// The `cuda-q4k` backend.
#[derive(Debug, Default, Clone)]
pub struct CudaQ4kBackend;

/// The process's device 0, opened once.
fn shared_device() -> Result<Arc<Device>, String> {
    static DEVICE: OnceLock<Result<Arc<Device>, String>> = OnceLock::new();
    DEVICE
        .get_or_init(|| {
            if let Some(why) = kiln_kernels::unavailable_reason() {
                return Err(why);
            }
            Device::new(0).map_err(|e| e.to_string())
        })
        .clone()
}

impl Backend for CudaQ4kBackend {
    fn name(&self) -> &str {
        "cuda-q4k"
    }

    fn description(&self) -> &str {
        "NVIDIA GPU: GPU-resident decode of K-quant models (NVRTC kernels, dp4a GEMV, CUDA graphs)"
    }

    fn qtypes(&self) -> Vec<QType> {
        GEMV_QTYPES.to_vec()
    }

    fn probe(&self) -> Result<String, String> {
        let d = shared_device()?;
        Ok(format!(
            "{} (sm_{}{}, {} SMs, {:.0} GiB, driver {}.{})",
            d.name(),
            d.arch().0,
            d.arch().1,
            d.sm_count(),
            d.total_memory() as f64 / (1u64 << 30) as f64,
            d.driver_version() / 1000,
            d.driver_version() % 1000 / 10
        ))
    }

    fn supports(&self, model: &ModelIr) -> Support {
        if let Err(reason) = executor::check_model(model) {
            return Support::No { reason };
        }
        let kquant = model
            .matrix_qtypes()
            .iter()
            .any(|q| matches!(q, QType::Q4_K | QType::Q5_K | QType::Q6_K));
        if kquant {
            Support::Yes {
                score: 100,
                note: "K-quant model on the GPU".into(),
            }
        } else {
            Support::Yes {
                score: 60,
                note: "runs on the GPU, but is tuned for K-quant mixes".into(),
            }
        }
    }

    fn load(&self, model: &ModelIr, options: &LoadOptions) -> Result<Box<dyn LayerExecutor>> {
        let device = shared_device().map_err(kiln_core::Error::NoBackend)?;
        Ok(Box::new(CudaExecutor::load(&device, model, options)?))
    }
}

kiln_core::inventory::submit! {
    kiln_core::BuiltinBackend { create: || Arc::new(CudaQ4kBackend) }
}
