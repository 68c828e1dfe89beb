//! # kiln
//!
//! The host-facing library: open a model file ([`Model::open`]), ask the registry which
//! backend runs it ([`registry_with_plugins`], [`Engine::load`]), and generate text through
//! sessions ([`Session::generate`]). The `kiln` binary (src/main.rs) is a thin CLI over it.
//!
//! Built-in backends are linked in here and register themselves through `inventory`;
//! third-party backends are loaded from `.so` plugins ([`plugins`]).

pub mod bench;
pub mod conformance;
pub mod engine;
pub mod fetch;
pub mod plugins;
pub mod server;
pub mod session;
pub mod toolkit;

pub use engine::{registry_with_plugins, Engine, Model, ModelFile};
pub use session::{FinishReason, GenerateParams, Generation, Session};

pub use kiln_core as core;
pub use kiln_formats as formats;

/// Makes sure the built-in backend crates are linked into the final binary, so their
/// `inventory` registrations are seen. (A crate nothing refers to may be dropped by the
/// linker together with its registration.)
pub fn link_builtin_backends() {
    std::hint::black_box(std::any::type_name::<kiln_backend_cpu::CpuBackend>());
    std::hint::black_box(std::any::type_name::<kiln_backend_cuda_q4k::CudaQ4kBackend>());
    std::hint::black_box(std::any::type_name::<kiln_backend_cuda_q4_0::CudaQ40Backend>());
}
