//! Reference (de)quantisation of every block type, value by value as ggml defines them.
//! Slow but obviously right: the yardstick for every optimised kernel.

use crate::error::{Error, Result};
use crate::qtype::QType;

/// Dequantises `src` (whole blocks of `qtype`) into `dst` (one f32 per value).
pub fn dequantize(qtype: QType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let expected = qtype.row_bytes(dst.len())?;
    if src.len() != expected {
        return Err(Error::InvalidShape(format!(
            "{} values of {qtype} need {expected} bytes, got {}",
            dst.len(),
            src.len()
        )));
    }
    match qtype {
        QType::F32 => {
            for (d, s) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *d = f32::from_le_bytes([s[0], s[1], s[2], s[3]]);
            }
        }
        other => return Err(Error::Unsupported(format!("dequantising {other} is not implemented yet"))),
    }
    Ok(())
}
