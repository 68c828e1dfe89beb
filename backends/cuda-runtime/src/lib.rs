//! # kiln-cuda-runtime
//!
//! Everything a CUDA executor needs except its opinions. [`GpuExecutor`] is a whole
//! GPU-resident transformer: weights uploaded once, a KV cache and a decode-step CUDA graph
//! per sequence, one workspace carved at load, batched prefill through cuBLAS, attention,
//! RoPE, device-side sampling. Each executor runs on a stream of its own
//! ([`kiln_kernels::Device::new_stream`]), so two executors in one process — two models,
//! two threads, two backends — never capture or wait on each other's work.
//!
//! A backend crate (`cuda-q4k`, `cuda-q4_0`) supplies a [`GpuPolicy`]: which device format
//! each weight type is repacked into at upload, which GEMV tiling each weight gets, and the
//! activation precision; plus its `Backend` impl with its score. Nothing else.
//!
//! Knows no file format (models arrive as `kiln_core::ModelIr`) and no backend by name.

use std::sync::{Arc, OnceLock};

use kiln_core::QType;
use kiln_kernels::{Device, DeviceWeight, GemvTiling, WeightFormat};

mod executor;

pub use executor::{
    check_model, group_attention_from, GpuExecutor, PrefillTimes, StepVariants, PREFILL_CHUNK,
    SHORT_PREFILL,
};

/// What a GPU backend decides; the runtime does the rest.
pub trait GpuPolicy: Send + Sync + std::fmt::Debug {
    /// The backend's name, for messages (`cuda-q4k`).
    fn backend_name(&self) -> &'static str;

    /// The device format a matrix of `qtype` with rows of `row_len` values is repacked into
    /// at upload, or `None` when the backend has no GEMV for the type. Default: the type's
    /// plain layout.
    fn format_for(&self, qtype: QType, row_len: usize) -> Option<&'static WeightFormat> {
        let _ = row_len;
        WeightFormat::plain(qtype)
    }

    /// Tiling of a GEMV over `w` that writes plain f32 output (QKV, the LM head). Its rows
    /// per warp must be a multiple of `w.format.row_group`.
    fn gemv_tiling(&self, w: &DeviceWeight) -> GemvTiling;

    /// Tiling of a GEMV over `w` that quantises its output (O, SwiGLU, down: blocks own
    /// whole 32-row groups; one of `GemvTiling::quantising()`), for a model of `hidden`.
    fn quant_tiling(&self, w: &DeviceWeight, hidden: usize) -> GemvTiling;
}

/// The process's device 0, opened once; executors each take a stream of their own on it.
pub fn shared_device() -> Result<Arc<Device>, String> {
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

/// A backend's `probe()`: the device in one line, or why there is none.
pub fn probe() -> Result<String, String> {
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
