//! Reference (de)quantisation of every block type, value by value as ggml defines them.
//! Slow but obviously right: the yardstick for every optimised kernel.
//!
//! Each block type is decoded by a small function that reads the block's fields at the
//! offsets ggml's C struct puts them and produces values in the order ggml's
//! `dequantize_row_*` does, with the same float operations in the same order (scale
//! products first, no fused multiply-add), so results are bit-identical to ggml's scalar
//! reference. The quantisers follow ggml's `quantize_row_*_ref` the same way, including its
//! rounding: truncation after adding 0.5 (or 8.5 / 16.5 for the symmetric types) and
//! `roundf` (half away from zero) for the 8-bit types.
//!
//! Layouts live next to the code that reads them: [`legacy`] for the 32-value block types,
//! [`kquants`] for the 256-value super-blocks. The K-quant quantisers, which search scales
//! and mins as ggml's reference does, are in [`kquant_search`]. APR's Q4 (not a ggml type)
//! is in [`apr`], defined and quantised as aprender does.

use crate::error::{Error, Result};
use crate::qtype::QType;

pub use apr::{apr_q4_block_to_q4_0, q4_0_block_to_apr_q4};

pub mod apr;
pub mod iquant_grids;
pub mod iquants;
pub mod iquants_grid;
pub mod kquant_search;
pub mod kquants;
pub mod legacy;
pub mod mxfp4;

/// Everything core knows about one weight type: its name, block geometry, and ggml's
/// reference decoding and encoding. One record per type, found by type
/// ([`QType::record`]); [`QType`]'s geometry, [`dequantize`], [`quantize`] and
/// [`can_quantize`] all read it, so a new type is one record here.
#[derive(Debug)]
pub struct TypeRecord {
    pub qtype: QType,
    /// Lower-case name as llama.cpp prints it (`q4_k`, `f16`, ...).
    pub name: &'static str,
    /// Values in one block.
    pub block_len: usize,
    /// Bytes in one block.
    pub block_bytes: usize,
    /// Whole blocks into one f32 per value, as ggml's `dequantize_row_*` computes them.
    pub dequantize: fn(&[u8], &mut [f32]),
    /// Whole blocks of values into bytes with ggml's reference quantiser; `None` where
    /// kiln has none.
    pub quantize: Option<QuantizeBlocks>,
}

/// Whole blocks of f32 values into a type's bytes (a reference quantiser).
pub type QuantizeBlocks = fn(&[f32], &mut [u8]);

macro_rules! blocks {
    (dequant $f:path) => {
        |src: &[u8], dst: &mut [f32]| for_each_block(src, dst, $f)
    };
    (quant $f:path) => {
        Some(|src: &[f32], dst: &mut [u8]| for_each_block_mut(src, dst, $f))
    };
}

macro_rules! record {
    ($q:ident, $name:literal, $len:literal, $bytes:literal, $deq:expr, $quant:expr) => {
        TypeRecord {
            qtype: QType::$q,
            name: $name,
            block_len: $len,
            block_bytes: $bytes,
            dequantize: $deq,
            quantize: $quant,
        }
    };
}

pub(crate) static RECORDS: [TypeRecord; 26] = [
    record!(
        F32,
        "f32",
        1,
        4,
        |src, dst| {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        },
        Some(|src, dst| {
            for (b, x) in dst.chunks_exact_mut(4).zip(src) {
                b.copy_from_slice(&x.to_le_bytes());
            }
        })
    ),
    record!(
        F16,
        "f16",
        1,
        2,
        |src, dst| {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = f16_le(b, 0);
            }
        },
        Some(|src, dst| {
            for (b, x) in dst.chunks_exact_mut(2).zip(src) {
                put_f16_le(b, 0, *x);
            }
        })
    ),
    record!(
        Q4_0,
        "q4_0",
        32,
        18,
        blocks!(dequant legacy::dequantize_q4_0),
        blocks!(quant legacy::quantize_q4_0)
    ),
    record!(
        Q4_1,
        "q4_1",
        32,
        20,
        blocks!(dequant legacy::dequantize_q4_1),
        blocks!(quant legacy::quantize_q4_1)
    ),
    record!(
        Q5_0,
        "q5_0",
        32,
        22,
        blocks!(dequant legacy::dequantize_q5_0),
        blocks!(quant legacy::quantize_q5_0)
    ),
    record!(
        Q5_1,
        "q5_1",
        32,
        24,
        blocks!(dequant legacy::dequantize_q5_1),
        blocks!(quant legacy::quantize_q5_1)
    ),
    record!(
        Q8_0,
        "q8_0",
        32,
        34,
        blocks!(dequant legacy::dequantize_q8_0),
        blocks!(quant legacy::quantize_q8_0)
    ),
    record!(
        Q8_1,
        "q8_1",
        32,
        36,
        blocks!(dequant legacy::dequantize_q8_1),
        blocks!(quant legacy::quantize_q8_1)
    ),
    record!(
        Q2_K,
        "q2_k",
        256,
        84,
        blocks!(dequant kquants::dequantize_q2_k),
        None
    ),
    record!(
        Q3_K,
        "q3_k",
        256,
        110,
        blocks!(dequant kquants::dequantize_q3_k),
        None
    ),
    record!(
        Q4_K,
        "q4_k",
        256,
        144,
        blocks!(dequant kquants::dequantize_q4_k),
        blocks!(quant kquant_search::quantize_q4_k)
    ),
    record!(
        Q5_K,
        "q5_k",
        256,
        176,
        blocks!(dequant kquants::dequantize_q5_k),
        blocks!(quant kquant_search::quantize_q5_k)
    ),
    record!(
        Q6_K,
        "q6_k",
        256,
        210,
        blocks!(dequant kquants::dequantize_q6_k),
        blocks!(quant kquant_search::quantize_q6_k)
    ),
    record!(
        Q8_K,
        "q8_k",
        256,
        292,
        blocks!(dequant kquants::dequantize_q8_k),
        None
    ),
    // bf16 is the top half of an f32, so widening is a shift and exact for every pattern,
    // NaN payloads included.
    record!(
        IQ2_XXS,
        "iq2_xxs",
        256,
        66,
        blocks!(dequant iquants_grid::dequantize_iq2_xxs),
        None
    ),
    record!(
        IQ2_XS,
        "iq2_xs",
        256,
        74,
        blocks!(dequant iquants_grid::dequantize_iq2_xs),
        None
    ),
    record!(
        IQ3_XXS,
        "iq3_xxs",
        256,
        98,
        blocks!(dequant iquants_grid::dequantize_iq3_xxs),
        None
    ),
    record!(
        IQ1_S,
        "iq1_s",
        256,
        50,
        blocks!(dequant iquants_grid::dequantize_iq1_s),
        None
    ),
    record!(
        IQ4_NL,
        "iq4_nl",
        32,
        18,
        blocks!(dequant iquants::dequantize_iq4_nl),
        blocks!(quant iquants::quantize_iq4_nl)
    ),
    record!(
        IQ3_S,
        "iq3_s",
        256,
        110,
        blocks!(dequant iquants_grid::dequantize_iq3_s),
        None
    ),
    record!(
        IQ2_S,
        "iq2_s",
        256,
        82,
        blocks!(dequant iquants_grid::dequantize_iq2_s),
        None
    ),
    record!(
        IQ4_XS,
        "iq4_xs",
        256,
        136,
        blocks!(dequant iquants::dequantize_iq4_xs),
        blocks!(quant iquants::quantize_iq4_xs)
    ),
    record!(
        IQ1_M,
        "iq1_m",
        256,
        56,
        blocks!(dequant iquants_grid::dequantize_iq1_m),
        None
    ),
    record!(
        BF16,
        "bf16",
        1,
        2,
        |src, dst| {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        },
        Some(|src, dst| {
            for (b, x) in dst.chunks_exact_mut(2).zip(src) {
                b.copy_from_slice(&f32_to_bf16_bits(*x).to_le_bytes());
            }
        })
    ),
    // APR's Q4, defined and quantised as aprender does (see [`apr`]).
    record!(
        MXFP4,
        "mxfp4",
        32,
        17,
        blocks!(dequant mxfp4::dequantize_mxfp4),
        blocks!(quant mxfp4::quantize_mxfp4)
    ),
    record!(
        AprQ4,
        "apr_q4",
        32,
        18,
        blocks!(dequant apr::dequantize_apr_q4),
        blocks!(quant apr::quantize_apr_q4)
    ),
];

/// The byte offsets of a block's f16 scales for the types whose every value is linear in
/// them together (the 2- and 3-bit K-quants' d and dmin, the grid I-quants' d; IQ1_M's d is
/// spread over four scale words and handled by [`set_block_scales`] apart).
fn block_scale_offsets(qtype: QType) -> Result<&'static [usize]> {
    Ok(match qtype {
        QType::Q2_K => &[80, 82],
        QType::Q3_K => &[108],
        QType::IQ2_XXS
        | QType::IQ2_XS
        | QType::IQ2_S
        | QType::IQ3_XXS
        | QType::IQ3_S
        | QType::IQ1_S => &[0],
        QType::IQ1_M => &[],
        _ => {
            return Err(Error::Unsupported(format!(
                "setting the scales of {qtype} blocks"
            )))
        }
    })
}

/// Sets every f16 scale of one `qtype` block to `d` (the types of [`scale_block_to_rms`]).
pub fn set_block_scales(qtype: QType, block: &mut [u8], d: half::f16) -> Result<()> {
    let bits = d.to_bits();
    if qtype == QType::IQ1_M {
        // Bits 4k..4k+4 of the f16 are the top nibble of the scale word k at 48 + 2k.
        for k in 0..4 {
            let at = 48 + 2 * k + 1;
            let nibble = ((bits >> (4 * k)) & 0xF) as u8;
            block[at] = (block[at] & 0x0F) | (nibble << 4);
        }
        return Ok(());
    }
    for &at in block_scale_offsets(qtype)? {
        block[at..at + 2].copy_from_slice(&bits.to_le_bytes());
    }
    Ok(())
}

/// Sets the f16 scales of one block of random quant, index, sign and sub-scale bits so its
/// values' root mean square is `rms` (found by dequantising it at scale 1): valid blocks of
/// the types kiln reads but cannot quantise to (the 2- and 3-bit K-quants, the grid
/// I-quants), for synthetic files and test weights.
pub fn scale_block_to_rms(qtype: QType, block: &mut [u8], rms: f32) -> Result<()> {
    let mut values = vec![0.0f32; qtype.block_len()];
    set_block_scales(qtype, block, half::f16::ONE)?;
    dequantize(qtype, block, &mut values)?;
    let at_one = (values.iter().map(|v| v * v).sum::<f32>() / values.len() as f32).sqrt();
    let d = if at_one > 0.0 { rms / at_one } else { rms };
    set_block_scales(qtype, block, half::f16::from_f32(d))
}

/// Dequantises `src` (whole blocks of `qtype`) into `dst` (one f32 per value).
///
/// `dst.len()` must be a whole number of blocks and `src` exactly that many blocks' bytes;
/// anything else is [`Error::InvalidShape`]. Every bit pattern is accepted: a block whose
/// scale is NaN or infinite decodes to NaN / infinities, as in ggml.
pub fn dequantize(qtype: QType, src: &[u8], dst: &mut [f32]) -> Result<()> {
    let expected = qtype.row_bytes(dst.len())?;
    if src.len() != expected {
        return Err(Error::InvalidShape(format!(
            "{} values of {qtype} need {expected} bytes, got {}",
            dst.len(),
            src.len()
        )));
    }
    (qtype.record().dequantize)(src, dst);
    Ok(())
}

/// Quantises `src` (a whole number of blocks of values) into `dst` (exactly that many
/// blocks' bytes), with ggml's reference quantiser for `qtype`.
///
/// Supported: every type whose record has a quantiser ([`can_quantize`]): F32, F16, BF16,
/// the 32-value block types, the K-quants Q4_K, Q5_K, Q6_K (with ggml's scale search, see
/// [`kquant_search`]), and APR's Q4 (with aprender's rule, see [`apr`]). The others are
/// [`Error::Unsupported`]; shape mismatches are [`Error::InvalidShape`].
pub fn quantize(qtype: QType, src: &[f32], dst: &mut [u8]) -> Result<()> {
    let Some(quantize) = qtype.record().quantize else {
        return Err(Error::Unsupported(format!(
            "quantising to {qtype} is not supported"
        )));
    };
    let expected = qtype.row_bytes(src.len())?;
    if dst.len() != expected {
        return Err(Error::InvalidShape(format!(
            "{} values of {qtype} need {expected} bytes, got a buffer of {}",
            src.len(),
            dst.len()
        )));
    }
    quantize(src, dst);
    Ok(())
}

/// Whether [`quantize`] accepts `qtype`.
pub fn can_quantize(qtype: QType) -> bool {
    qtype.record().quantize.is_some()
}

/// ggml's `quantize_row_q4_0_ref`: symmetric 4-bit, `d = max / -8` where `max` is the
/// value of largest magnitude (so it maps exactly to `-8`).
pub fn quantize_row_q4_0(src: &[f32], dst: &mut [u8]) -> Result<()> {
    quantize(QType::Q4_0, src, dst)
}

/// ggml's `quantize_row_q4_1_ref`: 4-bit with offset, `d = (max - min) / 15`, `m = min`.
pub fn quantize_row_q4_1(src: &[f32], dst: &mut [u8]) -> Result<()> {
    quantize(QType::Q4_1, src, dst)
}

/// ggml's `quantize_row_q5_0_ref`: symmetric 5-bit, `d = max / -16`.
pub fn quantize_row_q5_0(src: &[f32], dst: &mut [u8]) -> Result<()> {
    quantize(QType::Q5_0, src, dst)
}

/// ggml's `quantize_row_q5_1_ref`: 5-bit with offset, `d = (max - min) / 31`, `m = min`.
pub fn quantize_row_q5_1(src: &[f32], dst: &mut [u8]) -> Result<()> {
    quantize(QType::Q5_1, src, dst)
}

/// ggml's `quantize_row_q8_0_ref`: `d = amax / 127`, `q = roundf(x / d)`.
pub fn quantize_row_q8_0(src: &[f32], dst: &mut [u8]) -> Result<()> {
    quantize(QType::Q8_0, src, dst)
}

/// ggml's `quantize_row_q8_1_ref`: as Q8_0, plus `s = d * Σq` (rounded to f16) so that
/// integer dot products against offset formats (Q4_1, Q5_1, K-quants' mins) need no second
/// pass over the activations.
pub fn quantize_row_q8_1(src: &[f32], dst: &mut [u8]) -> Result<()> {
    quantize(QType::Q8_1, src, dst)
}

/// aprender's APR Q4 writer: `d = max|x| / 7` (1 for an all-zero block), `q = clamp(round(x
/// / d), −8, 7) + 8`, value `i` in the low (even `i`) or high (odd `i`) nibble of byte `i / 2`.
pub fn quantize_row_apr_q4(src: &[f32], dst: &mut [u8]) -> Result<()> {
    quantize(QType::AprQ4, src, dst)
}

/// Runs `f` over matching (block bytes, block values) pairs. The caller has checked that
/// `src` and `dst` hold the same whole number of blocks.
fn for_each_block<const B: usize, const N: usize>(
    src: &[u8],
    dst: &mut [f32],
    f: fn(&[u8; B], &mut [f32; N]),
) {
    for (b, y) in src.chunks_exact(B).zip(dst.chunks_exact_mut(N)) {
        // `chunks_exact` yields exactly B and N elements, so both conversions succeed.
        let (Ok(b), Ok(y)) = (<&[u8; B]>::try_from(b), <&mut [f32; N]>::try_from(y)) else {
            unreachable!("chunks_exact yields whole blocks")
        };
        f(b, y);
    }
}

/// The quantising twin of [`for_each_block`].
fn for_each_block_mut<const N: usize, const B: usize>(
    src: &[f32],
    dst: &mut [u8],
    f: fn(&[f32; N], &mut [u8; B]),
) {
    for (x, b) in src.chunks_exact(N).zip(dst.chunks_exact_mut(B)) {
        let (Ok(x), Ok(b)) = (<&[f32; N]>::try_from(x), <&mut [u8; B]>::try_from(b)) else {
            unreachable!("chunks_exact yields whole blocks")
        };
        f(x, b);
    }
}

/// The IEEE half at `b[off..off + 2]` (little-endian), widened exactly to f32.
#[inline]
pub(crate) fn f16_le(b: &[u8], off: usize) -> f32 {
    half::f16::from_le_bytes([b[off], b[off + 1]]).to_f32()
}

/// Stores `x` rounded to the nearest IEEE half (ties to even, as ggml's FP32_TO_FP16).
#[inline]
pub(crate) fn put_f16_le(b: &mut [u8], off: usize, x: f32) {
    b[off..off + 2].copy_from_slice(&half::f16::from_f32(x).to_le_bytes());
}

/// ggml's `ggml_compute_fp32_to_bf16`: round to nearest even, and NaNs kept NaN by forcing
/// the quiet bit (plain rounding could carry a NaN's low payload bits into infinity).
pub fn f32_to_bf16_bits(x: f32) -> u16 {
    let u = x.to_bits();
    if u & 0x7fff_ffff > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    ((u + (0x7fff + ((u >> 16) & 1))) >> 16) as u16
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bf16_rounds_to_nearest_even_and_keeps_nan() {
        // 1 + 2^-8 is exactly halfway between two bf16 values; the even one is 1.0.
        assert_eq!(f32_to_bf16_bits(1.0 + 1.0 / 256.0), 0x3f80);
        // 1 + 3·2^-8 is halfway too; the even neighbour is above.
        assert_eq!(f32_to_bf16_bits(1.0 + 3.0 / 256.0), 0x3f82);
        let nan = f32::from_bits(0x7f80_0001);
        assert!(f32::from_bits(u32::from(f32_to_bf16_bits(nan)) << 16).is_nan());
        assert_eq!(f32_to_bf16_bits(f32::INFINITY), 0x7f80);
    }

    #[test]
    fn low_bit_k_quants_are_not_quantised_here() {
        let src = [0.0f32; 256];
        let mut dst = [0u8; 84];
        assert!(matches!(
            quantize(QType::Q2_K, &src, &mut dst),
            Err(Error::Unsupported(_))
        ));
        let mut dst = [0u8; 144];
        assert!(quantize(QType::Q4_K, &src, &mut dst).is_ok());
    }
}
