//! The kernel layer's error type.

use cudarc::driver::DriverError;

/// What can go wrong below a CUDA backend. Converts into [`kiln_core::Error`].
#[derive(Debug, thiserror::Error)]
pub enum KernelError {
    /// No usable CUDA driver (libcuda) on this machine.
    #[error("no CUDA driver: {0}")]
    NoDriver(String),
    /// No NVRTC library to compile kernels with.
    #[error("no NVRTC: {0}")]
    NoNvrtc(String),
    /// NVRTC rejected a kernel source; `log` is the compiler's own output.
    #[error("NVRTC could not compile {module} for {arch}: {status}\n{log}")]
    Compile {
        module: String,
        arch: String,
        status: String,
        log: String,
    },
    /// A driver call failed; `what` says which operation.
    #[error("CUDA {what}: {source}")]
    Driver { what: String, source: DriverError },
    /// No cuBLAS library (needed by the batched prefill only).
    #[error("no cuBLAS: {0}")]
    NoCublas(String),
    /// A cuBLAS call failed.
    #[error("cuBLAS {what}: {status}")]
    Blas { what: String, status: String },
    #[error("out of device memory allocating {bytes} bytes")]
    OutOfMemory { bytes: usize },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    #[error("unsupported: {0}")]
    Unsupported(String),
}

pub type Result<T, E = KernelError> = std::result::Result<T, E>;

/// Attaches the name of the failed operation to a driver error.
pub(crate) trait DriverContext<T> {
    fn ctx(self, what: &str) -> Result<T>;
}

impl<T> DriverContext<T> for std::result::Result<T, DriverError> {
    fn ctx(self, what: &str) -> Result<T> {
        self.map_err(|source| KernelError::Driver {
            what: what.to_string(),
            source,
        })
    }
}

impl From<KernelError> for kiln_core::Error {
    fn from(e: KernelError) -> Self {
        match e {
            KernelError::OutOfMemory { .. } => kiln_core::Error::OutOfMemory(e.to_string()),
            KernelError::InvalidArgument(m) => kiln_core::Error::InvalidArgument(m),
            KernelError::Unsupported(m) => kiln_core::Error::Unsupported(m),
            other => kiln_core::Error::Backend {
                backend: "cuda".into(),
                message: other.to_string(),
            },
        }
    }
}
