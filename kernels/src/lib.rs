//! # kiln-kernels
//!
//! The CUDA layer shared by kiln's GPU backends. CUDA C kernels (in `cuda/`, embedded in
//! the binary) are compiled at first use by NVRTC for the exact GPU present and cached on
//! disk ([`compile`]); [`Device`] owns a context, a stream, loaded modules, events and CUDA
//! graphs; [`DeviceBuffer`], [`Workspace`] and [`KvCache`] hold device memory; [`repack`]
//! puts ggml weights into the GEMV kernels' aligned layout; [`Kernels`] launches each kernel
//! through a typed, size-checked wrapper.
//!
//! The driver and NVRTC are loaded dynamically ([`libs`]): this crate builds with no CUDA
//! toolkit, and on a machine without a driver every entry point returns
//! [`KernelError::NoDriver`] instead of panicking.

pub mod batch;
pub mod buffer;
pub mod compile;
pub mod device;
pub mod error;
pub mod format;
pub mod gemm;
pub mod kv;
pub mod libs;
pub mod ops;
pub mod repack;
pub mod roofline;
pub mod testdata;

pub use batch::{
    BatchAttention, BatchEpilogue, BatchRows, BmmPath, ExpertGroups, PackedAct, PackedActBuffers,
    PackedActHost,
};
pub use buffer::{Carver, DevSlice, DeviceBuffer, Workspace};
pub use device::{device_count, Args, Device, Event, Function, Graph, LaunchConfig};
pub use error::{KernelError, Result};
pub use format::{gemv_qtypes, WeightFormat, APR_Q4_X4, FORMATS, Q4_0_X4};
pub use gemm::Blas;
pub use kv::{KvCache, KvFormat, KvLayerRows, KvPlanes, Q8Planes};
pub use ops::{
    AttnArgs, AttnHeads, Epilogue, ExpertSlots, GatedAct, GemvInput, GemvPath, GemvTiling, Kernels,
    PendingNorm, PrefillAttnArgs, Q8Act, QuantBuffers, QuantOut, RopeArgs, MAX_EXPERTS,
    MAX_EXPERTS_USED,
};
pub use repack::{DeviceWeight, PackedWeight};

/// Why CUDA cannot run here, or `None` when a driver and at least one device are present.
/// For a backend's `probe()`.
pub fn unavailable_reason() -> Option<String> {
    match device_count() {
        Ok(0) => Some("the CUDA driver reports no devices".into()),
        Ok(_) => None,
        Err(e) => Some(e.to_string()),
    }
}
