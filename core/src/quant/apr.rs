//! APR's 4-bit block type ([`QType::AprQ4`](crate::QType::AprQ4), APR v2 dtype id 128).
//!
//! | type   | bytes | layout |
//! |--------|-------|--------|
//! | AprQ4  | 18    | `d: f16, qs: [u8; 16]` — x = d·(q − 8) |
//!
//! Same fields and arithmetic as ggml's Q4_0; only the nibble order differs. Value `i` of
//! the block is in byte `qs[i / 2]`: the low nibble when `i` is even, the high nibble when
//! odd (Q4_0 puts value `j` in the low nibble of `qs[j]` and value `j + 16` in its high
//! nibble). A block therefore converts to a Q4_0 block with identical values by permuting
//! nibbles alone ([`apr_q4_block_to_q4_0`]), which is how Q4_0 kernels run APR weights.
//!
//! Dequantisation is `(q − 8) as f32 · d` with `d` widened exactly from f16, the same f32
//! operations as [`super::legacy::dequantize_q4_0`], so a block and its Q4_0 permutation
//! dequantise bit for bit alike. Every bit pattern is accepted; a NaN or infinite scale
//! gives NaN / infinities, as Q4_0 does. (aprender's own reader maps NaN, infinite and
//! subnormal scales to 0 — paiml/aprender, the `AprV2DequantExt` Q4 decoder; kiln keeps
//! the plain formula so CPU and GPU (Q4_0-permuted) paths agree on every block.)
//!
//! Quantisation follows aprender's writer (paiml/aprender, `src/format/v2/writer.rs`,
//! `AprV2Writer::add_q4_tensor`): `d = max|x| / 7` (1 for an all-zero block), stored as
//! f16 rounded to nearest even; `q = clamp(round(x / d), −8, 7) + 8` with `x / d` divided
//! by the f32 `d` before its f16 rounding and `round` half away from zero. Not ggml's Q4_0
//! rule (`d = max / −8`, truncation after adding 8.5).

use super::{f16_le, put_f16_le};

const QK: usize = 32;
const HALF: usize = QK / 2;

/// The 4-bit code of value `i` (0..32) of an APR Q4 block's nibble bytes.
#[inline(always)]
fn apr_code(qs: &[u8], i: usize) -> u8 {
    let b = qs[i / 2];
    if i.is_multiple_of(2) {
        b & 0x0f
    } else {
        b >> 4
    }
}

/// The 4-bit code of value `i` (0..32) of a ggml Q4_0 block's nibble bytes.
#[inline(always)]
fn q4_0_code(qs: &[u8], i: usize) -> u8 {
    if i < HALF {
        qs[i] & 0x0f
    } else {
        qs[i - HALF] >> 4
    }
}

pub fn dequantize_apr_q4(b: &[u8; 18], y: &mut [f32; QK]) {
    let d = f16_le(b, 0);
    let qs = &b[2..18];
    for (i, y) in y.iter_mut().enumerate() {
        *y = (i32::from(apr_code(qs, i)) - 8) as f32 * d;
    }
}

pub fn quantize_apr_q4(x: &[f32; QK], b: &mut [u8; 18]) {
    // `f32::max` skips NaN, as aprender's fold does.
    let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
    let d = if amax == 0.0 { 1.0 } else { amax / 7.0 };
    put_f16_le(b, 0, d);
    for k in 0..HALF {
        // A saturating cast: NaN gives code 8 (zero), never an out-of-range nibble.
        let code = |v: f32| ((v / d).round().clamp(-8.0, 7.0) as i8 + 8) as u8;
        b[2 + k] = code(x[2 * k]) | (code(x[2 * k + 1]) << 4);
    }
}

/// The ggml Q4_0 block with the same scale and the same 32 values as the APR Q4 block
/// `src`: a pure nibble permutation, lossless (its inverse is [`q4_0_block_to_apr_q4`]).
/// Both types dequantise as `d·(q − 8)`, so the values agree bit for bit.
pub fn apr_q4_block_to_q4_0(src: &[u8; 18]) -> [u8; 18] {
    let mut dst = [0u8; 18];
    dst[..2].copy_from_slice(&src[..2]);
    let qs = &src[2..];
    for j in 0..HALF {
        dst[2 + j] = apr_code(qs, j) | (apr_code(qs, j + HALF) << 4);
    }
    dst
}

/// The APR Q4 block with the same scale and values as the ggml Q4_0 block `src`: the
/// inverse of [`apr_q4_block_to_q4_0`].
pub fn q4_0_block_to_apr_q4(src: &[u8; 18]) -> [u8; 18] {
    let mut dst = [0u8; 18];
    dst[..2].copy_from_slice(&src[..2]);
    let qs = &src[2..];
    for k in 0..HALF {
        dst[2 + k] = q4_0_code(qs, 2 * k) | (q4_0_code(qs, 2 * k + 1) << 4);
    }
    dst
}

#[cfg(test)]
mod tests {
    use super::super::legacy::{dequantize_q4_0, quantize_q4_0};
    use super::*;

    /// A small deterministic generator (xorshift), enough for block contents.
    struct Bits(u64);
    impl Bits {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 << 13;
            self.0 ^= self.0 >> 7;
            self.0 ^= self.0 << 17;
            self.0
        }
        fn block(&mut self) -> [u8; 18] {
            let mut b = [0u8; 18];
            for v in b.iter_mut() {
                *v = self.next() as u8;
            }
            b
        }
        /// Uniform in (-1, 1).
        fn unit(&mut self) -> f32 {
            (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    fn deq(b: &[u8; 18]) -> [f32; QK] {
        let mut y = [0.0; QK];
        dequantize_apr_q4(b, &mut y);
        y
    }

    #[test]
    fn nibble_order_of_a_hand_built_block() {
        // d = 0.5; byte k holds code 2k (low) for value 2k and code 2k+1 (high) for value
        // 2k+1, so value i has code i % 16 and x_i = 0.5·(i % 16 − 8).
        let mut b = [0u8; 18];
        b[..2].copy_from_slice(&half::f16::from_f32(0.5).to_le_bytes());
        for k in 0..16 {
            let (lo, hi) = ((2 * k) % 16, (2 * k + 1) % 16);
            b[2 + k] = (lo | (hi << 4)) as u8;
        }
        let y = deq(&b);
        for (i, v) in y.iter().enumerate() {
            assert_eq!(*v, 0.5 * ((i % 16) as f32 - 8.0), "value {i}");
        }
        // Byte 0 = 0x10 holds values 0 (low nibble, code 0 → −4) and 1 (high, code 1 →
        // −3.5); Q4_0 would read values 0 and 16 from it.
        assert_eq!(b[2], 0x10);
        assert_eq!((y[0], y[1]), (-4.0, -3.5));

        // One nibble set at a time lands on exactly one value.
        for i in 0..QK {
            let mut b = [0x88u8; 18];
            b[..2].copy_from_slice(&half::f16::from_f32(1.0).to_le_bytes());
            let shift = if i.is_multiple_of(2) { 0 } else { 4 };
            b[2 + i / 2] = (b[2 + i / 2] & !(0x0f << shift)) | (0x0f << shift);
            let y = deq(&b);
            for (k, v) in y.iter().enumerate() {
                assert_eq!(
                    *v,
                    if k == i { 7.0 } else { 0.0 },
                    "nibble of value {i}: value {k}"
                );
            }
        }
    }

    #[test]
    fn permutation_to_q4_0_keeps_every_value_bit_for_bit() {
        let mut bits = Bits(0x9e37_79b9_7f4a_7c15);
        for _ in 0..2000 {
            let apr = bits.block();
            let q40 = apr_q4_block_to_q4_0(&apr);
            let mut want = [0.0; QK];
            dequantize_q4_0(&q40, &mut want);
            let got = deq(&apr);
            for i in 0..QK {
                let same =
                    got[i].to_bits() == want[i].to_bits() || (got[i].is_nan() && want[i].is_nan());
                assert!(
                    same,
                    "value {i}: apr {} vs q4_0 {}; block {apr:02x?}",
                    got[i], want[i]
                );
            }
            assert_eq!(q4_0_block_to_apr_q4(&q40), apr, "inverse");
            assert_eq!(
                apr_q4_block_to_q4_0(&q4_0_block_to_apr_q4(&apr)),
                apr,
                "inverse the other way"
            );
        }
    }

    #[test]
    fn q4_0_blocks_convert_to_apr_with_the_same_values() {
        let mut bits = Bits(42);
        for _ in 0..200 {
            let mut x = [0.0f32; QK];
            x.iter_mut().for_each(|v| *v = bits.unit() * 3.0);
            let mut q40 = [0u8; 18];
            quantize_q4_0(&x, &mut q40);
            let mut want = [0.0; QK];
            dequantize_q4_0(&q40, &mut want);
            assert_eq!(deq(&q4_0_block_to_apr_q4(&q40)), want);
        }
    }

    #[test]
    fn round_trip_error_is_within_half_a_step() {
        let mut bits = Bits(7);
        for round in 0..500 {
            let scale = 10f32.powf(bits.unit() * 2.5);
            let mut x = [0.0f32; QK];
            x.iter_mut().for_each(|v| *v = bits.unit() * scale);
            if round % 5 == 0 {
                x[(round / 5) % QK] = -scale; // an exact extreme, on either side
            }
            let mut b = [0u8; 18];
            quantize_apr_q4(&x, &mut b);
            let y = deq(&b);
            let amax = x.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            let d = amax / 7.0;
            // Codes reach ±7 only, so no clamping; f16 rounding of d costs 2^-11 relative
            // times the largest code.
            let bound = d * (0.5 + 7.0 / 2048.0) + amax * 1e-6;
            for i in 0..QK {
                let (x, y) = (x[i], y[i]);
                assert!(
                    (x - y).abs() <= bound,
                    "round {round}, value {i}: {x} → {y} (bound {bound})"
                );
            }
            // The extreme maps to ±7 exactly: code 1 or 15.
            let i = x.iter().position(|v| v.abs() == amax).unwrap();
            let code = apr_code(&b[2..], i);
            assert!(
                code == 1 || code == 15,
                "extreme value {} got code {code}",
                x[i]
            );
        }
    }

    #[test]
    fn quantiser_matches_aprenders_rule_on_simple_inputs() {
        // amax 7 → d = 1: codes are round(x) + 8, halves away from zero.
        let mut x = [0.0f32; QK];
        let vals = [7.0, -7.0, 0.5, -0.5, 1.5, -1.5, 2.4, -2.6, 0.0, 3.0];
        x[..vals.len()].copy_from_slice(&vals);
        let mut b = [0u8; 18];
        quantize_apr_q4(&x, &mut b);
        assert_eq!(half::f16::from_le_bytes([b[0], b[1]]).to_f32(), 1.0);
        let codes: Vec<u8> = (0..vals.len()).map(|i| apr_code(&b[2..], i)).collect();
        assert_eq!(codes, [15, 1, 9, 7, 10, 6, 10, 5, 8, 11]);
        // An all-zero block stores d = 1 and code 8 everywhere, as aprender does.
        quantize_apr_q4(&[0.0; QK], &mut b);
        assert_eq!(&b[..2], &half::f16::from_f32(1.0).to_le_bytes());
        assert!(b[2..].iter().all(|&v| v == 0x88));
        assert_eq!(deq(&b), [0.0; QK]);
    }
}
