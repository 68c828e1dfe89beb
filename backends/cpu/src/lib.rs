//! # kiln-backend-cpu
//!
//! The CPU reference backend: a rayon executor for the whole decoder (embeddings, norms,
//! Q/K/V with bias and QK-norm, RoPE, f32 KV cache, GQA attention, SwiGLU/GELU FFN, LM
//! head). It is the correctness oracle every other backend is checked against, so by
//! default activations stay f32 throughout and are never quantised; weights stay quantised
//! in the caller's memory map and are dequantised block by block inside fused dot kernels
//! ([`kernels`]). A caller who wants speed over fidelity sets
//! [`LoadOptions::quantized_activations`]: the few-token matmuls then quantise their input
//! to 8 bits and multiply bytes with bytes, as llama.cpp's CPU build does
//! ([`kernels::q8`]). Prefill runs a prompt's tokens as one batch, reading each weight row once
//! for all of them.
//!
//! It knows no file format: a model arrives as a [`kiln_core::ModelIr`]. It registers
//! itself as `cpu` with the core registry through `inventory`.

use std::sync::Arc;

use kiln_core::{Backend, LayerExecutor, LoadOptions, ModelIr, QType, Result, Support};

mod dequant;
mod executor;
pub mod kernels;
mod matmul;
pub mod ops;
mod tensor_parallel;

pub use executor::{kv_cache_size, CpuExecutor, KvCacheSize, RoutingTrace};
pub use kernels::Isa;
pub use matmul::MAX_BATCH;
pub use tensor_parallel::TensorParallelExecutor;

/// The `cpu` backend: always available, score 10 for every model whose weight types it
/// can multiply with.
#[derive(Debug, Default, Clone)]
pub struct CpuBackend;

impl CpuBackend {
    /// Loads `model` as a concrete [`CpuExecutor`] (what [`Backend::load`] boxes).
    pub fn load_executor(&self, model: &ModelIr, options: &LoadOptions) -> Result<CpuExecutor> {
        CpuExecutor::load(model, options, Isa::best())
    }

    /// As [`CpuBackend::load_executor`], with kernels no wider than `isa` (to compare the
    /// instruction sets on one machine; the results agree to rounding).
    pub fn load_executor_on(
        &self,
        model: &ModelIr,
        options: &LoadOptions,
        isa: Isa,
    ) -> Result<CpuExecutor> {
        CpuExecutor::load(model, options, isa)
    }
}

fn cpu_features() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let found: Vec<&str> = [
            ("avx2", is_x86_feature_detected!("avx2")),
            ("fma", is_x86_feature_detected!("fma")),
            ("f16c", is_x86_feature_detected!("f16c")),
            ("avx512f", is_x86_feature_detected!("avx512f")),
        ]
        .into_iter()
        .filter_map(|(n, on)| on.then_some(n))
        .collect();
        let path = format!("{} kernels", Isa::best().name());
        format!("x86_64 {} ({path})", found.join(" "))
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        format!("{} (portable kernels)", std::env::consts::ARCH)
    }
}

impl Backend for CpuBackend {
    fn name(&self) -> &str {
        "cpu"
    }

    fn description(&self) -> &str {
        "reference CPU executor (rayon, f32 activations unless asked for 8-bit ones, weights dequantised on the fly)"
    }

    fn qtypes(&self) -> Vec<QType> {
        kernels::supported()
    }

    fn probe(&self) -> Result<String, String> {
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
        Ok(format!("{threads} threads, {}", cpu_features()))
    }

    fn supports(&self, model: &ModelIr) -> Support {
        let supported = kernels::supported();
        let unsupported: Vec<String> = model
            .weights
            .tensors()
            .into_iter()
            .map(|t| t.qtype())
            .filter(|q| !supported.contains(q))
            .map(|q| q.name().to_string())
            .collect::<std::collections::BTreeSet<_>>()
            .into_iter()
            .collect();
        if unsupported.is_empty() {
            Support::Yes {
                score: kiln_core::score::REFERENCE,
                note: "reference executor; any supported qtype".into(),
            }
        } else {
            Support::No {
                reason: format!("cpu backend has no kernels for {}", unsupported.join(", ")),
            }
        }
    }

    fn load(&self, model: &ModelIr, options: &LoadOptions) -> Result<Box<dyn LayerExecutor>> {
        if options.tensor_parallel > 1 {
            return Ok(Box::new(TensorParallelExecutor::load(
                model,
                options,
                Isa::best(),
            )?));
        }
        Ok(Box::new(self.load_executor(model, options)?))
    }
}

kiln_core::inventory::submit! {
    kiln_core::BuiltinBackend { create: || Arc::new(CpuBackend) }
}
