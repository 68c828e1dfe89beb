//! Device memory: owned buffers and the plain views kernels are launched with.

use std::marker::PhantomData;
use std::sync::Arc;

use bytemuck::Pod;
use cudarc::driver::{result, sys, DriverError};

use crate::device::Device;
use crate::error::{DriverContext, KernelError, Result};

/// A typed window of device memory: address and element count. Cheap to copy; it does not
/// keep the memory alive — it must not outlive the [`DeviceBuffer`] (or workspace) it came
/// from.
#[derive(Debug)]
pub struct DevSlice<T> {
    ptr: u64,
    len: usize,
    _t: PhantomData<T>,
}

impl<T> Clone for DevSlice<T> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<T> Copy for DevSlice<T> {}

impl<T> DevSlice<T> {
    pub(crate) fn from_raw(ptr: u64, len: usize) -> Self {
        DevSlice {
            ptr,
            len,
            _t: PhantomData,
        }
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
    /// Elements `start..start + len`.
    pub fn sub(&self, start: usize, len: usize) -> Result<DevSlice<T>> {
        if start.checked_add(len).is_none_or(|end| end > self.len) {
            return Err(KernelError::InvalidArgument(format!(
                "range {start}+{len} of a {}-element slice",
                self.len
            )));
        }
        Ok(DevSlice::from_raw(
            self.ptr + (start * std::mem::size_of::<T>()) as u64,
            len,
        ))
    }
    /// Checks the slice holds at least `n` elements; `what` names it in the error.
    pub fn check_len(&self, n: usize, what: &str) -> Result<()> {
        if self.len < n {
            return Err(KernelError::InvalidArgument(format!(
                "{what} holds {} elements, {n} needed",
                self.len
            )));
        }
        Ok(())
    }
}

impl<T: Pod> DevSlice<T> {
    /// The same bytes seen as `U` (sizes must divide evenly).
    pub fn cast<U: Pod>(&self) -> Result<DevSlice<U>> {
        let bytes = self.bytes();
        let size = std::mem::size_of::<U>();
        if size == 0
            || !bytes.is_multiple_of(size)
            || !self.ptr.is_multiple_of(std::mem::align_of::<U>() as u64)
        {
            return Err(KernelError::InvalidArgument(format!(
                "{bytes} bytes cannot be viewed as {}",
                std::any::type_name::<U>()
            )));
        }
        Ok(DevSlice::from_raw(self.ptr, bytes / size))
    }

    /// Waits for the device's stream, then copies the slice into `out` (same length).
    pub fn copy_to_host(&self, device: &Device, out: &mut [T]) -> Result<()> {
        if out.len() != self.len {
            return Err(KernelError::InvalidArgument(format!(
                "copying {} values into {}",
                self.len,
                out.len()
            )));
        }
        if self.len == 0 {
            return Ok(());
        }
        device.bind()?;
        // SAFETY: `out` has room for this slice's elements (checked above) and the context is bound.
        unsafe { result::memcpy_dtoh_async(out, self.ptr, device.stream()) }
            .ctx("cuMemcpyDtoHAsync")?;
        device.synchronize()
    }

    /// Queues a copy of `data` into the slice (same length). The copy is from pageable
    /// memory, which the driver stages before this returns, so `data` may be dropped after.
    pub fn copy_from_host(&self, device: &Device, data: &[T]) -> Result<()> {
        if data.len() != self.len {
            return Err(KernelError::InvalidArgument(format!(
                "copying {} values into {}",
                data.len(),
                self.len
            )));
        }
        if self.len == 0 {
            return Ok(());
        }
        device.bind()?;
        // SAFETY: `data` holds exactly this slice's elements (checked above) and the context is bound.
        unsafe { result::memcpy_htod_async(self.ptr, data, device.stream()) }
            .ctx("cuMemcpyHtoDAsync")?;
        // Pageable copies are staged, but only a synchronised stream guarantees the staging
        // happened before `data` can go away.
        device.synchronize()
    }

    /// Queues setting every byte of the slice to `byte` on the device's stream (no wait;
    /// capturable into a graph).
    pub fn fill_bytes_async(&self, device: &Device, byte: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        device.bind()?;
        // SAFETY: the slice addresses live device memory of `bytes()` bytes.
        unsafe { result::memset_d8_async(self.ptr, byte, self.bytes(), device.stream()) }
            .ctx("cuMemsetD8Async")
    }

    /// Waits for the device's stream, then copies the slice out.
    pub fn to_host(&self, device: &Device) -> Result<Vec<T>> {
        let mut out = vec![T::zeroed(); self.len];
        if self.len == 0 {
            return Ok(out);
        }
        device.bind()?;
        // SAFETY: `out` was allocated with this slice's length and the context is bound.
        unsafe { result::memcpy_dtoh_async(&mut out, self.ptr, device.stream()) }
            .ctx("cuMemcpyDtoHAsync")?;
        device.synchronize()?;
        Ok(out)
    }
}

/// Device memory owning `len` values of `T`, freed on drop.
pub struct DeviceBuffer<T: Pod> {
    device: Arc<Device>,
    ptr: u64,
    len: usize,
    _t: PhantomData<T>,
}

fn alloc_bytes(device: &Device, bytes: usize) -> Result<u64> {
    if bytes == 0 {
        return Ok(0);
    }
    device.bind()?;
    // SAFETY: plain device allocation; freed in Drop.
    match unsafe { result::malloc_sync(bytes) } {
        Ok(p) => Ok(p),
        Err(DriverError(sys::CUresult::CUDA_ERROR_OUT_OF_MEMORY)) => {
            Err(KernelError::OutOfMemory { bytes })
        }
        Err(e) => Err(KernelError::Driver {
            what: format!("cuMemAlloc({bytes})"),
            source: e,
        }),
    }
}

impl<T: Pod> DeviceBuffer<T> {
    /// `len` values with unspecified contents (any bit pattern is a valid `T`).
    pub fn alloc(device: &Arc<Device>, len: usize) -> Result<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or_else(|| KernelError::InvalidArgument(format!("{len} elements overflow")))?;
        let ptr = alloc_bytes(device, bytes)?;
        Ok(DeviceBuffer {
            device: device.clone(),
            ptr,
            len,
            _t: PhantomData,
        })
    }

    pub fn zeros(device: &Arc<Device>, len: usize) -> Result<Self> {
        let b = Self::alloc(device, len)?;
        b.fill_bytes(0)?;
        Ok(b)
    }

    pub fn from_host(device: &Arc<Device>, data: &[T]) -> Result<Self> {
        let mut b = Self::alloc(device, data.len())?;
        b.copy_from_host(data)?;
        Ok(b)
    }

    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
    pub fn bytes(&self) -> usize {
        self.len * std::mem::size_of::<T>()
    }
    pub fn ptr(&self) -> u64 {
        self.ptr
    }
    pub fn slice(&self) -> DevSlice<T> {
        DevSlice::from_raw(self.ptr, self.len)
    }

    /// Copies `data` in (waits for the copy, so `data` may be dropped right after).
    pub fn copy_from_host(&mut self, data: &[T]) -> Result<()> {
        if data.len() != self.len {
            return Err(KernelError::InvalidArgument(format!(
                "copying {} values into {}",
                data.len(),
                self.len
            )));
        }
        if self.len == 0 {
            return Ok(());
        }
        self.device.bind()?;
        // SAFETY: sizes match; the copy completes before `data` can be dropped.
        unsafe { result::memcpy_htod_async(self.ptr, data, self.device.stream()) }
            .ctx("cuMemcpyHtoDAsync")?;
        self.device.synchronize()
    }

    /// Waits for the stream, then copies the contents out.
    pub fn to_host(&self) -> Result<Vec<T>> {
        self.slice().to_host(&self.device)
    }

    /// Sets every byte to `byte` (0xff makes every f32 a NaN: the poison tests use).
    pub fn fill_bytes(&self, byte: u8) -> Result<()> {
        if self.len == 0 {
            return Ok(());
        }
        self.device.bind()?;
        // SAFETY: the range is this buffer's own allocation; the context is bound.
        unsafe { result::memset_d8_async(self.ptr, byte, self.bytes(), self.device.stream()) }
            .ctx("cuMemsetD8Async")
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if self.ptr != 0 {
            let _ = self.device.bind();
            // Work still queued may read this memory: let it finish first.
            let _ = self.device.synchronize();
            // SAFETY: this buffer allocated `ptr` and nothing queued uses it any more (synchronised above).
            let _ = unsafe { result::free_sync(self.ptr) };
        }
    }
}

/// One allocation carved into aligned scratch slices (a decode step's activations):
/// allocated once at load, so steps allocate nothing. The layout is one function that
/// builds a named struct of slices from a [`Carver`] ([`Workspace::carve`]): run once to
/// measure, once to hand out, so sizes and fields cannot drift apart.
pub struct Workspace {
    buffer: DeviceBuffer<u8>,
}

/// Hands out consecutive 256-byte-aligned slices of a workspace (or, while measuring,
/// only counts their bytes).
pub struct Carver {
    base: u64,
    used: usize,
}

impl Carver {
    /// The next `len` values of `T`.
    pub fn take<T: Pod>(&mut self, len: usize) -> DevSlice<T> {
        let bytes = len * std::mem::size_of::<T>();
        let start = self.used;
        self.used += bytes.div_ceil(Workspace::ALIGN) * Workspace::ALIGN;
        DevSlice::from_raw(self.base + start as u64, len)
    }
}

impl Workspace {
    pub const ALIGN: usize = 256;

    /// Allocates exactly what `layout` takes and returns the slices it built. `layout` must
    /// take the same sizes each time it is called (it is called twice).
    pub fn carve<S>(
        device: &Arc<Device>,
        layout: impl Fn(&mut Carver) -> S,
    ) -> Result<(Workspace, S)> {
        let mut measure = Carver { base: 0, used: 0 };
        layout(&mut measure);
        let buffer = DeviceBuffer::alloc(device, measure.used.max(Self::ALIGN))?;
        let mut carver = Carver {
            base: buffer.ptr(),
            used: 0,
        };
        let slices = layout(&mut carver);
        debug_assert_eq!(
            carver.used, measure.used,
            "a workspace layout took different sizes"
        );
        Ok((Workspace { buffer }, slices))
    }

    pub fn bytes(&self) -> usize {
        self.buffer.len()
    }

    pub fn fill_bytes(&self, byte: u8) -> Result<()> {
        self.buffer.fill_bytes(byte)
    }
}
