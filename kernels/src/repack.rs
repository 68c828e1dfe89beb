//! Weights in the GEMV kernels' device layout.
//!
//! ggml blocks of 18, 22, 34 or 210 bytes leave the quants unaligned, which forbids the
//! 16-byte loads that keep HBM busy. Each block is split, at upload, into a `body` (the
//! quant bytes, 16-byte aligned: Q4_K/Q5_K keep their whole 144/176-byte block, Q6_K its
//! first 208 bytes), an optional `qh` word (Q5_0/Q5_1's fifth bits) and a `sc` entry (the
//! f16 scale, or scale and min) — the same bytes, so the same bandwidth, only reordered.

use std::sync::Arc;

use kiln_core::QType;

use crate::buffer::{DevSlice, DeviceBuffer};
use crate::device::Device;
use crate::error::{KernelError, Result};

/// Weight types the GEMV kernels multiply with.
pub const GEMV_QTYPES: [QType; 11] = [
    QType::F32,
    QType::F16,
    QType::BF16,
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::Q8_0,
    QType::Q4_K,
    QType::Q5_K,
    QType::Q6_K,
];

/// (body bytes, has qh, scale bytes) per block, and where in a ggml block each part lies:
/// (body offset, qh offset, scale offset).
fn layout(q: QType) -> Option<(usize, bool, usize, usize, usize, usize)> {
    Some(match q {
        QType::F32 => (4, false, 0, 0, 0, 0),
        QType::F16 | QType::BF16 => (2, false, 0, 0, 0, 0),
        QType::Q4_0 => (16, false, 2, 2, 0, 0),
        QType::Q4_1 => (16, false, 4, 4, 0, 0),
        QType::Q5_0 => (16, true, 2, 6, 2, 0),
        QType::Q5_1 => (16, true, 4, 8, 4, 0),
        QType::Q8_0 => (32, false, 2, 2, 0, 0),
        QType::Q4_K => (144, false, 0, 0, 0, 0),
        QType::Q5_K => (176, false, 0, 0, 0, 0),
        QType::Q6_K => (208, false, 2, 0, 0, 208),
        _ => return None,
    })
}

/// A weight matrix in device layout, still on the host.
#[derive(Debug, Clone, PartialEq)]
pub struct PackedWeight {
    pub qtype: QType,
    /// Values per row (the input length).
    pub row_len: usize,
    pub rows: usize,
    pub body: Vec<u8>,
    pub qh: Vec<u32>,
    pub sc: Vec<u8>,
}

impl PackedWeight {
    /// Splits `rows` rows of `row_len` ggml-encoded values.
    pub fn pack(qtype: QType, row_len: usize, rows: usize, ggml: &[u8]) -> Result<PackedWeight> {
        let (body_bytes, has_qh, sc_bytes, body_off, qh_off, sc_off) = layout(qtype)
            .ok_or_else(|| KernelError::Unsupported(format!("GEMV with {qtype} weights")))?;
        let expected = qtype
            .row_bytes(row_len)
            .ok()
            .and_then(|rb| rb.checked_mul(rows))
            .ok_or_else(|| {
                KernelError::InvalidArgument(format!("{rows} rows of {row_len} {qtype} values"))
            })?;
        if ggml.len() != expected {
            return Err(KernelError::InvalidArgument(format!(
                "{rows}x{row_len} {qtype} needs {expected} bytes, got {}",
                ggml.len()
            )));
        }
        if !qtype.is_quantized() {
            return Ok(PackedWeight {
                qtype,
                row_len,
                rows,
                body: ggml.to_vec(),
                qh: Vec::new(),
                sc: Vec::new(),
            });
        }
        let bb = qtype.block_bytes();
        let nblocks = ggml.len() / bb;
        let mut body = Vec::with_capacity(nblocks * body_bytes);
        let mut qh = Vec::with_capacity(if has_qh { nblocks } else { 0 });
        let mut sc = Vec::with_capacity(nblocks * sc_bytes);
        for blk in ggml.chunks_exact(bb) {
            body.extend_from_slice(&blk[body_off..body_off + body_bytes]);
            if has_qh {
                qh.push(u32::from_le_bytes(
                    blk[qh_off..qh_off + 4].try_into().expect("4 bytes"),
                ));
            }
            sc.extend_from_slice(&blk[sc_off..sc_off + sc_bytes]);
        }
        Ok(PackedWeight {
            qtype,
            row_len,
            rows,
            body,
            qh,
            sc,
        })
    }

    /// Bytes a GEMV reads from this weight.
    pub fn bytes(&self) -> usize {
        self.body.len() + 4 * self.qh.len() + self.sc.len()
    }
}

/// A weight matrix resident on the device.
pub struct DeviceWeight {
    pub qtype: QType,
    pub row_len: usize,
    pub rows: usize,
    body: DeviceBuffer<u8>,
    qh: DeviceBuffer<u32>,
    sc: DeviceBuffer<u8>,
}

impl DeviceWeight {
    pub fn upload(device: &Arc<Device>, w: &PackedWeight) -> Result<DeviceWeight> {
        Ok(DeviceWeight {
            qtype: w.qtype,
            row_len: w.row_len,
            rows: w.rows,
            body: DeviceBuffer::from_host(device, &w.body)?,
            qh: DeviceBuffer::from_host(device, &w.qh)?,
            sc: DeviceBuffer::from_host(device, &w.sc)?,
        })
    }

    /// Packs and uploads ggml bytes in one go.
    pub fn from_ggml(
        device: &Arc<Device>,
        qtype: QType,
        row_len: usize,
        rows: usize,
        ggml: &[u8],
    ) -> Result<DeviceWeight> {
        Self::upload(device, &PackedWeight::pack(qtype, row_len, rows, ggml)?)
    }

    /// (body, qh, sc) device addresses; absent parts are 0.
    pub fn ptrs(&self) -> (u64, u64, u64) {
        (self.body.ptr(), self.qh.ptr(), self.sc.ptr())
    }

    pub fn bytes(&self) -> usize {
        self.body.bytes() + self.qh.bytes() + self.sc.bytes()
    }

    pub fn body(&self) -> DevSlice<u8> {
        self.body.slice()
    }
}
