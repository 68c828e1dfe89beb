//! Scalar dequantisation of one block of each supported type: core's dequantisers (ggml's
//! definitions, APR's Q4 as aprender writes it) behind the slice signature the kernel
//! tables take. The portable kernels are built on these, and they dequantise embedding
//! rows and the small norm/bias tensors at load.

use half::{bf16, f16};
use kiln_core::{quant, QType};

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

// The block dequantisers are core's (ggml's definitions, APR's as aprender writes it): one
// implementation for every backend and for the tests that check them. These adapters give
// them the slice signature the kernel tables take.
macro_rules! from_core {
    ($name:ident, $f:path, $bytes:literal, $values:literal) => {
        pub(crate) fn $name(b: &[u8], y: &mut [f32]) {
            let b: &[u8; $bytes] = b[..$bytes].try_into().expect("one block");
            let y: &mut [f32; $values] = (&mut y[..$values]).try_into().expect("one block out");
            $f(b, y)
        }
    };
}

from_core!(block_q4_0, quant::legacy::dequantize_q4_0, 18, 32);
from_core!(block_apr_q4, quant::apr::dequantize_apr_q4, 18, 32);
from_core!(block_q4_1, quant::legacy::dequantize_q4_1, 20, 32);
from_core!(block_q5_0, quant::legacy::dequantize_q5_0, 22, 32);
from_core!(block_q5_1, quant::legacy::dequantize_q5_1, 24, 32);
from_core!(block_q8_0, quant::legacy::dequantize_q8_0, 34, 32);
from_core!(block_q2_k, quant::kquants::dequantize_q2_k, 84, 256);
from_core!(block_q3_k, quant::kquants::dequantize_q3_k, 110, 256);
from_core!(block_q4_k, quant::kquants::dequantize_q4_k, 144, 256);
from_core!(block_q5_k, quant::kquants::dequantize_q5_k, 176, 256);
from_core!(block_q6_k, quant::kquants::dequantize_q6_k, 210, 256);

/// Dequantises one block into the first `block_len` values of its output.
pub(crate) type BlockFn = fn(&[u8], &mut [f32]);

/// The block dequantiser of `qtype`, when it is one this backend multiplies with.
pub(crate) fn block_fn(qtype: QType) -> Option<BlockFn> {
    Some(match qtype {
        QType::F32 => |b, y| y[0] = f32::from_le_bytes([b[0], b[1], b[2], b[3]]),
        QType::F16 => |b, y| y[0] = f16_at(b, 0),
        QType::BF16 => |b, y| y[0] = bf16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32(),
        QType::Q4_0 => block_q4_0,
        QType::Q4_1 => block_q4_1,
        QType::Q5_0 => block_q5_0,
        QType::Q5_1 => block_q5_1,
        QType::Q8_0 => block_q8_0,
        QType::Q2_K => block_q2_k,
        QType::Q3_K => block_q3_k,
        QType::Q4_K => block_q4_k,
        QType::Q5_K => block_q5_k,
        QType::Q6_K => block_q6_k,
        QType::AprQ4 => block_apr_q4,
        _ => return None,
    })
}

/// Dequantises whole rows/tensors: `src` holds `out.len()` values of `qtype`.
/// Callers have checked the type is supported and the lengths agree.
pub(crate) fn dequantize_into(qtype: QType, src: &[u8], out: &mut [f32]) {
    match qtype {
        QType::F32 => {
            for (y, b) in out.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        QType::F16 => {
            for (y, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *y = f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32();
            }
        }
        QType::BF16 => {
            for (y, b) in out.iter_mut().zip(src.chunks_exact(2)) {
                *y = f32::from_bits((u16::from_le_bytes([b[0], b[1]]) as u32) << 16);
            }
        }
        q => {
            let f = block_fn(q).expect("caller checked the qtype is supported");
            for (y, b) in out
                .chunks_exact_mut(q.block_len())
                .zip(src.chunks_exact(q.block_bytes()))
            {
                f(b, y);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    /// Every type the backend claims (it has a row-dot kernel) also has the block decoder
    /// its norms, biases and embeddings are read with.
    #[test]
    fn every_claimed_type_has_a_block_decoder() {
        for q in crate::kernels::supported() {
            assert!(super::block_fn(q).is_some(), "{q}");
        }
    }
}
