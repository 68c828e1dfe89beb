//! Matrix products on tensor cores through cuBLAS (loaded at run time, like the driver):
//! f16 inputs, f32 accumulation and f32 output — the batched prefill's GEMMs.
//!
//! Layout is kiln's, row-major: activations `x[N][K]`, weights `w[R][K]` (one row per
//! output, as ggml stores them), output `y[N][R]` = x · wᵀ (+ β·y). In cuBLAS's column-major
//! terms that is yᵀ (R×N) = op(w) · xᵀ with w read transposed, so no copy is made.

use std::sync::Arc;

use cudarc::cublas::{result as blas, sys};

use crate::buffer::DevSlice;
use crate::device::Device;
use crate::error::{KernelError, Result};
use crate::libs;

fn blas_err(what: &str) -> impl Fn(blas::CublasError) -> KernelError + '_ {
    move |e| KernelError::Blas {
        what: what.to_string(),
        status: format!("{:?}", e.0),
    }
}

/// A cuBLAS handle bound to a device's stream.
pub struct Blas {
    device: Arc<Device>,
    handle: sys::cublasHandle_t,
}

impl Blas {
    /// Opens cuBLAS on `device`'s stream; [`KernelError::NoCublas`] when the library is
    /// missing (cudarc would panic on the first call otherwise).
    pub fn new(device: &Arc<Device>) -> Result<Blas> {
        libs::cublas_status().map_err(KernelError::NoCublas)?;
        device.bind()?;
        let handle = blas::create_handle().map_err(blas_err("cublasCreate"))?;
        let this = Blas {
            device: device.clone(),
            handle,
        };
        // SAFETY: a live handle and the device's live stream (same context, bound above).
        unsafe { blas::set_stream(handle, device.stream() as sys::cudaStream_t) }
            .map_err(blas_err("cublasSetStream"))?;
        Ok(this)
    }

    /// y[N][ldy] (first R columns) = alpha · x[N][K] · w[R][K]ᵀ + beta · y, f16 inputs, f32
    /// accumulation. `beta = 1` adds the product to y (a fused residual add); `alpha` is 1
    /// but for models that scale a branch or the logits.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_f16_f32(
        &self,
        w: DevSlice<u16>,
        rows: usize,
        x: DevSlice<u16>,
        n: usize,
        k: usize,
        y: DevSlice<f32>,
        ldy: usize,
        alpha: f32,
        beta: f32,
    ) -> Result<()> {
        if rows == 0 || n == 0 || k == 0 || ldy < rows {
            return Err(KernelError::InvalidArgument(format!(
                "GEMM of {n}x{k} by {rows}x{k} into rows of {ldy}"
            )));
        }
        let max = i32::MAX as usize;
        if rows > max || n > max || k > max || ldy > max {
            return Err(KernelError::InvalidArgument(format!(
                "GEMM dimensions {n}x{k}x{rows} exceed cuBLAS's int range"
            )));
        }
        w.check_len(rows * k, "GEMM weight")?;
        x.check_len(n * k, "GEMM input")?;
        y.check_len((n - 1) * ldy + rows, "GEMM output")?;
        self.device.bind()?;
        // SAFETY: every operand's extent was checked above; alpha and beta are host
        // scalars (the handle's default pointer mode); all pointers are on this device.
        unsafe {
            blas::gemm_ex(
                self.handle,
                sys::cublasOperation_t::CUBLAS_OP_T,
                sys::cublasOperation_t::CUBLAS_OP_N,
                rows as i32,
                n as i32,
                k as i32,
                &alpha as *const f32 as *const _,
                w.ptr() as *const _,
                sys::cudaDataType_t::CUDA_R_16F,
                k as i32,
                x.ptr() as *const _,
                sys::cudaDataType_t::CUDA_R_16F,
                k as i32,
                &beta as *const f32 as *const _,
                y.ptr() as *mut _,
                sys::cudaDataType_t::CUDA_R_32F,
                ldy as i32,
                sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(blas_err("cublasGemmEx"))
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        let _ = self.device.bind();
        // SAFETY: the handle is live and destroyed once.
        let _ = unsafe { blas::destroy_handle(self.handle) };
    }
}
