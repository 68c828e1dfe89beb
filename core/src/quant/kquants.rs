//! The 256-value "K" super-blocks. Each is split into sub-blocks that carry their own
//! small integer scale (and for Q2_K/Q4_K/Q5_K a min), multiplied by the super-block's
//! f16 `d` (and `dmin`). Field order is ggml's C struct order; all little-endian.
//!
//! | type | bytes | layout |
//! |------|-------|--------|
//! | Q2_K | 84  | `scales: [u8; 16]` (lo nibble scale, hi nibble min), `qs: [u8; 64]`, `d`, `dmin` |
//! | Q3_K | 110 | `hmask: [u8; 32]`, `qs: [u8; 64]`, `scales: [u8; 12]` (16 × 6 bit), `d` |
//! | Q4_K | 144 | `d`, `dmin`, `scales: [u8; 12]` (8 × (6-bit scale, 6-bit min)), `qs: [u8; 128]` |
//! | Q5_K | 176 | `d`, `dmin`, `scales: [u8; 12]`, `qh: [u8; 32]`, `qs: [u8; 128]` |
//! | Q6_K | 210 | `ql: [u8; 128]`, `qh: [u8; 64]`, `scales: [i8; 16]`, `d` |
//! | Q8_K | 292 | `d: f32`, `qs: [i8; 256]`, `bsums: [i16; 16]` |
//!
//! The low bits of the K-quants are laid out for SIMD: a run of 32 bytes holds 32
//! consecutive values' low bits, and successive sub-blocks take successive bit fields of the
//! same 32 bytes before moving to the next run. The loops below walk that order.

use super::f16_le;

const QK_K: usize = 256;

pub fn dequantize_q2_k(b: &[u8; 84], y: &mut [f32; QK_K]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let d = f16_le(b, 80);
    let dmin = f16_le(b, 82);
    let mut out = 0;
    let mut is = 0;
    // Two halves of 128 values; each reads 32 bytes of `qs` four times, two bits at a time.
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for shift in [0, 2, 4, 6] {
            // Each 32-byte pass covers two sub-blocks of 16 values.
            for part in [&q[0..16], &q[16..32]] {
                let sc = scales[is];
                is += 1;
                let dl = d * f32::from(sc & 0x0f);
                let ml = dmin * f32::from(sc >> 4);
                for &byte in part {
                    y[out] = dl * f32::from((byte >> shift) & 3) - ml;
                    out += 1;
                }
            }
        }
    }
}

/// Scale `k` (0..16) of a Q3_K block: 6 bits, stored biased by 32. The low 4 bits are the
/// nibbles of bytes 0..8 (low nibbles for scales 0..8, high nibbles for 8..16); the high 2
/// bits are the 2-bit fields of bytes 8..12, byte `8 + k % 4`, field `k / 4`.
pub fn q3_k_scale(scales: &[u8], k: usize) -> i32 {
    let low = if k < 8 {
        scales[k] & 0x0f
    } else {
        scales[k - 8] >> 4
    };
    let high = (scales[8 + k % 4] >> (2 * (k / 4))) & 3;
    i32::from(low | (high << 4)) - 32
}

pub fn dequantize_q3_k(b: &[u8; 110], y: &mut [f32; QK_K]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let scales = &b[96..108];
    let d_all = f16_le(b, 108);
    let mut out = 0;
    let mut is = 0;
    // `m` walks the 8 bits of `hmask`: one bit plane per 32 values. A clear bit means the
    // 2-bit value is offset by -4 (the 3rd bit is stored inverted).
    let mut m = 1u8;
    for half in 0..2 {
        let q = &qs[32 * half..32 * half + 32];
        for shift in [0, 2, 4, 6] {
            for l0 in [0, 16] {
                let dl = d_all * q3_k_scale(scales, is) as f32;
                is += 1;
                for l in l0..l0 + 16 {
                    let low = i32::from((q[l] >> shift) & 3);
                    let offset = if hmask[l] & m != 0 { 0 } else { 4 };
                    y[out] = dl * (low - offset) as f32;
                    out += 1;
                }
            }
            m <<= 1;
        }
    }
}

/// Scale and min of sub-block `j` (0..8) of a Q4_K/Q5_K block (ggml's `get_scale_min_k4`):
/// 6 bits each. Sub-blocks 0..4 use the low 6 bits of bytes 0..4 (scale) and 4..8 (min);
/// sub-blocks 4..8 take their low 4 bits from the nibbles of bytes 8..12 and their high 2
/// bits from the top bits of bytes 0..8.
pub fn scale_min_k4(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        let sc = (scales[j + 4] & 0x0f) | ((scales[j - 4] >> 6) << 4);
        let m = (scales[j + 4] >> 4) | ((scales[j] >> 6) << 4);
        (sc, m)
    }
}

pub fn dequantize_q4_k(b: &[u8; 144], y: &mut [f32; QK_K]) {
    let d = f16_le(b, 0);
    let dmin = f16_le(b, 2);
    let scales = &b[4..16];
    let qs = &b[16..144];
    let mut out = 0;
    // Four runs of 32 bytes: low nibbles are sub-block 2i, high nibbles sub-block 2i + 1.
    for (i, q) in qs.chunks_exact(32).enumerate() {
        for (sub, shift) in [(2 * i, 0), (2 * i + 1, 4)] {
            let (sc, m) = scale_min_k4(scales, sub);
            let d1 = d * f32::from(sc);
            let m1 = dmin * f32::from(m);
            for &byte in q {
                y[out] = d1 * f32::from((byte >> shift) & 0x0f) - m1;
                out += 1;
            }
        }
    }
}

pub fn dequantize_q5_k(b: &[u8; 176], y: &mut [f32; QK_K]) {
    let d = f16_le(b, 0);
    let dmin = f16_le(b, 2);
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    let mut out = 0;
    // As Q4_K, plus a 5th bit: sub-block `sub` takes bit `sub` of each of the 32 qh bytes.
    for (i, q) in qs.chunks_exact(32).enumerate() {
        for (sub, shift) in [(2 * i, 0), (2 * i + 1, 4)] {
            let (sc, m) = scale_min_k4(scales, sub);
            let d1 = d * f32::from(sc);
            let m1 = dmin * f32::from(m);
            for (&byte, &high) in q.iter().zip(qh) {
                let fifth = if high & (1 << sub) != 0 { 16 } else { 0 };
                y[out] = d1 * f32::from(((byte >> shift) & 0x0f) + fifth) - m1;
                out += 1;
            }
        }
    }
}

pub fn dequantize_q6_k(b: &[u8; 210], y: &mut [f32; QK_K]) {
    let d = f16_le(b, 208);
    // Two halves of 128 values, each with 64 bytes of low nibbles, 32 bytes of 2-bit high
    // parts and 8 scales (one per 16 values).
    for half in 0..2 {
        let ql = &b[64 * half..64 * half + 64];
        let qh = &b[128 + 32 * half..128 + 32 * half + 32];
        let sc = &b[192 + 8 * half..192 + 8 * half + 8];
        let y = &mut y[128 * half..128 * half + 128];
        for l in 0..32 {
            let is = l / 16;
            let q1 = i32::from((ql[l] & 0x0f) | ((qh[l] & 3) << 4)) - 32;
            let q2 = i32::from((ql[l + 32] & 0x0f) | (((qh[l] >> 2) & 3) << 4)) - 32;
            let q3 = i32::from((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) - 32;
            let q4 = i32::from((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) - 32;
            // ggml evaluates `d * sc * q` left to right: the scale product first.
            y[l] = d * f32::from(sc[is] as i8) * q1 as f32;
            y[l + 32] = d * f32::from(sc[is + 2] as i8) * q2 as f32;
            y[l + 64] = d * f32::from(sc[is + 4] as i8) * q3 as f32;
            y[l + 96] = d * f32::from(sc[is + 6] as i8) * q4 as f32;
        }
    }
}

/// Q8_K is the activation format of ggml's K-quant dot products; `bsums` (sums of each
/// 16 codes) are derived data and do not enter the values.
pub fn dequantize_q8_k(b: &[u8; 292], y: &mut [f32; QK_K]) {
    let d = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
    for (y, &q) in y.iter_mut().zip(&b[4..260]) {
        *y = d * f32::from(q as i8);
    }
}
