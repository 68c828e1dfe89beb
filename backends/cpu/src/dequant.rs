//! Scalar dequantisation of one block of each supported type: core's dequantisers (ggml's
//! definitions, APR's Q4 as aprender writes it) behind the slice signature the kernel
//! tables take. The portable kernels are built on these; [`dequantize_into`] decodes the
//! rows of the f32 paths.

use half::f16;
use kiln_core::{quant, QType};

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
from_core!(block_mxfp4, quant::mxfp4::dequantize_mxfp4, 17, 32);
from_core!(block_iq4_nl, quant::iquants::dequantize_iq4_nl, 18, 32);
from_core!(block_iq4_xs, quant::iquants::dequantize_iq4_xs, 136, 256);
from_core!(
    block_iq2_xxs,
    quant::iquants_grid::dequantize_iq2_xxs,
    66,
    256
);
from_core!(
    block_iq2_xs,
    quant::iquants_grid::dequantize_iq2_xs,
    74,
    256
);
from_core!(block_iq2_s, quant::iquants_grid::dequantize_iq2_s, 82, 256);
from_core!(
    block_iq3_xxs,
    quant::iquants_grid::dequantize_iq3_xxs,
    98,
    256
);
from_core!(block_iq3_s, quant::iquants_grid::dequantize_iq3_s, 110, 256);
from_core!(block_iq1_s, quant::iquants_grid::dequantize_iq1_s, 50, 256);
from_core!(block_iq1_m, quant::iquants_grid::dequantize_iq1_m, 56, 256);

/// Dequantises whole rows/tensors: `src` holds `out.len()` values of `qtype`. Callers have
/// checked the lengths agree (core's `quant::dequantize` checks them; the kernels' rows
/// are sized by their matrix).
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
        // Core's record: the block decoders the kernels' adapters above wrap.
        q => (q.record().dequantize)(src, out),
    }
}
