//! The 32-value block types (ggml's "legacy" quants). All fields little-endian; `f16` is
//! an IEEE half. Value `j` of a block and value `j + 16` share byte `qs[j]`: low nibble,
//! then high nibble.
//!
//! | type | bytes | layout |
//! |------|-------|--------|
//! | Q4_0 | 18 | `d: f16, qs: [u8; 16]`                 — x = d·(q − 8) |
//! | Q4_1 | 20 | `d: f16, m: f16, qs: [u8; 16]`         — x = d·q + m |
//! | Q5_0 | 22 | `d: f16, qh: u32, qs: [u8; 16]`        — x = d·(q − 16), bit 4 of value j is bit j of qh |
//! | Q5_1 | 24 | `d: f16, m: f16, qh: u32, qs: [u8; 16]` — x = d·q + m |
//! | Q8_0 | 34 | `d: f16, qs: [i8; 32]`                 — x = d·q |
//! | Q8_1 | 36 | `d: f16, s: f16, qs: [i8; 32]`         — x = d·q; s = d·Σq |

use super::{f16_le, put_f16_le};

const QK: usize = 32;
const HALF: usize = QK / 2;

pub fn dequantize_q4_0(b: &[u8; 18], y: &mut [f32; QK]) {
    let d = f16_le(b, 0);
    let qs = &b[2..18];
    for j in 0..HALF {
        let x0 = i32::from(qs[j] & 0x0f) - 8;
        let x1 = i32::from(qs[j] >> 4) - 8;
        y[j] = x0 as f32 * d;
        y[j + HALF] = x1 as f32 * d;
    }
}

pub fn dequantize_q4_1(b: &[u8; 20], y: &mut [f32; QK]) {
    let d = f16_le(b, 0);
    let m = f16_le(b, 2);
    let qs = &b[4..20];
    for j in 0..HALF {
        let x0 = qs[j] & 0x0f;
        let x1 = qs[j] >> 4;
        y[j] = f32::from(x0) * d + m;
        y[j + HALF] = f32::from(x1) * d + m;
    }
}

pub fn dequantize_q5_0(b: &[u8; 22], y: &mut [f32; QK]) {
    let d = f16_le(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..HALF {
        let (lo, hi) = fifth_bits(qh, j);
        let x0 = i32::from((qs[j] & 0x0f) | lo) - 16;
        let x1 = i32::from((qs[j] >> 4) | hi) - 16;
        y[j] = x0 as f32 * d;
        y[j + HALF] = x1 as f32 * d;
    }
}

pub fn dequantize_q5_1(b: &[u8; 24], y: &mut [f32; QK]) {
    let d = f16_le(b, 0);
    let m = f16_le(b, 2);
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..HALF {
        let (lo, hi) = fifth_bits(qh, j);
        let x0 = (qs[j] & 0x0f) | lo;
        let x1 = (qs[j] >> 4) | hi;
        y[j] = f32::from(x0) * d + m;
        y[j + HALF] = f32::from(x1) * d + m;
    }
}

pub fn dequantize_q8_0(b: &[u8; 34], y: &mut [f32; QK]) {
    let d = f16_le(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[2..34]) {
        *y = f32::from(q as i8) * d;
    }
}

/// The stored sum `s` is derived data for dot products; the values are `d·q` alone.
pub fn dequantize_q8_1(b: &[u8; 36], y: &mut [f32; QK]) {
    let d = f16_le(b, 0);
    for (y, &q) in y.iter_mut().zip(&b[4..36]) {
        *y = f32::from(q as i8) * d;
    }
}

/// Bit 4 (value 16) of values `j` and `j + 16` of a Q5 block, from its 32-bit `qh`.
fn fifth_bits(qh: u32, j: usize) -> (u8, u8) {
    let lo = ((qh >> j) & 1) << 4;
    let hi = ((qh >> (j + HALF)) & 1) << 4;
    (lo as u8, hi as u8)
}

/// The value of largest magnitude, first one on ties (ggml compares with `<`, so the sign
/// of the first extreme wins and decides the sign of `d`).
fn signed_absmax(x: &[f32; QK]) -> f32 {
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    max
}

fn min_max(x: &[f32; QK]) -> (f32, f32) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    (min, max)
}

fn reciprocal_or_zero(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// ggml's `(int8_t)(v)` for the in-range values the quantisers produce: truncation toward
/// zero. Rust's cast saturates where C's would be undefined, so odd inputs (NaN, overflow)
/// still give a valid code.
fn trunc_i8(v: f32) -> i8 {
    v as i8
}

pub fn quantize_q4_0(x: &[f32; QK], b: &mut [u8; 18]) {
    // Mapping the extreme value to -8 uses the whole [-8, 7] range on its side.
    let d = signed_absmax(x) / -8.0;
    let id = reciprocal_or_zero(d);
    put_f16_le(b, 0, d);
    for j in 0..HALF {
        let q0 = trunc_i8(x[j] * id + 8.5).min(15) as u8;
        let q1 = trunc_i8(x[j + HALF] * id + 8.5).min(15) as u8;
        b[2 + j] = q0 | (q1 << 4);
    }
}

pub fn quantize_q4_1(x: &[f32; QK], b: &mut [u8; 20]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 15.0;
    let id = reciprocal_or_zero(d);
    put_f16_le(b, 0, d);
    put_f16_le(b, 2, min);
    for j in 0..HALF {
        let q0 = trunc_i8((x[j] - min) * id + 0.5).min(15) as u8;
        let q1 = trunc_i8((x[j + HALF] - min) * id + 0.5).min(15) as u8;
        b[4 + j] = q0 | (q1 << 4);
    }
}

pub fn quantize_q5_0(x: &[f32; QK], b: &mut [u8; 22]) {
    let d = signed_absmax(x) / -16.0;
    let id = reciprocal_or_zero(d);
    put_f16_le(b, 0, d);
    let mut qh = 0u32;
    for j in 0..HALF {
        let q0 = trunc_i8(x[j] * id + 16.5).min(31) as u8;
        let q1 = trunc_i8(x[j + HALF] * id + 16.5).min(31) as u8;
        b[6 + j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
        qh |= u32::from(q0 >> 4) << j;
        qh |= u32::from(q1 >> 4) << (j + HALF);
    }
    b[2..6].copy_from_slice(&qh.to_le_bytes());
}

pub fn quantize_q5_1(x: &[f32; QK], b: &mut [u8; 24]) {
    let (min, max) = min_max(x);
    let d = (max - min) / 31.0;
    let id = reciprocal_or_zero(d);
    put_f16_le(b, 0, d);
    put_f16_le(b, 2, min);
    let mut qh = 0u32;
    for j in 0..HALF {
        // ggml does not clamp here: (max - min)·id stays below 31.5 for finite input. The
        // clamp only keeps a hostile input (overflowing range) inside 5 bits.
        let q0 = trunc_i8((x[j] - min) * id + 0.5).min(31) as u8;
        let q1 = trunc_i8((x[j + HALF] - min) * id + 0.5).min(31) as u8;
        b[8 + j] = (q0 & 0x0f) | ((q1 & 0x0f) << 4);
        qh |= u32::from(q0 >> 4) << j;
        qh |= u32::from(q1 >> 4) << (j + HALF);
    }
    b[4..8].copy_from_slice(&qh.to_le_bytes());
}

/// Shared by Q8_0 and Q8_1: returns `d` (f32, before rounding to f16) and writes the codes.
fn quantize_8bit(x: &[f32; QK], qs: &mut [u8]) -> f32 {
    let amax = x.iter().fold(0.0f32, |a, v| a.max(v.abs()));
    let d = amax / 127.0;
    let id = reciprocal_or_zero(d);
    for (q, &v) in qs.iter_mut().zip(x) {
        // f32::round is C's roundf: halves go away from zero.
        *q = (v * id).round() as i8 as u8;
    }
    d
}

pub fn quantize_q8_0(x: &[f32; QK], b: &mut [u8; 34]) {
    let d = quantize_8bit(x, &mut b[2..34]);
    put_f16_le(b, 0, d);
}

pub fn quantize_q8_1(x: &[f32; QK], b: &mut [u8; 36]) {
    let d = quantize_8bit(x, &mut b[4..36]);
    let sum: i32 = b[4..36].iter().map(|&q| i32::from(q as i8)).sum();
    put_f16_le(b, 0, d);
    // ggml multiplies by the f32 `d`, not the rounded f16 one.
    put_f16_le(b, 2, sum as f32 * d);
}
