//! Scalar dequantisation of one block of each supported type, written value by value as
//! ggml defines it (APR's Q4 as aprender does). The portable kernels are built on these, and they dequantise embedding
//! rows and the small norm/bias tensors at load.

use half::{bf16, f16};
use kiln_core::QType;

#[inline(always)]
pub(crate) fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Scale and min of sub-block `j` (0..8) from the 12 packed bytes of a Q4_K/Q5_K block.
#[inline(always)]
pub(crate) fn scale_min_k4(j: usize, q: &[u8]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0xF) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// The sixteen signed 6-bit scales of a Q3_K block, unpacked from its 12 bytes.
#[inline(always)]
pub(crate) fn q3k_scales(s: &[u8]) -> [i8; 16] {
    let mut out = [0i8; 16];
    for j in 0..16 {
        let low = if j < 8 { s[j] & 0xF } else { s[j - 8] >> 4 };
        let high = (s[8 + j % 4] >> (2 * (j / 4))) & 3;
        out[j] = ((low | (high << 4)) as i8).wrapping_sub(32);
    }
    out
}

pub(crate) fn block_q4_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for j in 0..16 {
        y[j] = d * ((qs[j] & 0xF) as i32 - 8) as f32;
        y[j + 16] = d * ((qs[j] >> 4) as i32 - 8) as f32;
    }
}

/// APR Q4: as Q4_0 but value `i` is the low (even `i`) or high (odd `i`) nibble of byte
/// `i / 2`.
pub(crate) fn block_apr_q4(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qs = &b[2..18];
    for k in 0..16 {
        y[2 * k] = d * ((qs[k] & 0xF) as i32 - 8) as f32;
        y[2 * k + 1] = d * ((qs[k] >> 4) as i32 - 8) as f32;
    }
}

pub(crate) fn block_q4_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qs = &b[4..20];
    for j in 0..16 {
        y[j] = d * (qs[j] & 0xF) as f32 + m;
        y[j + 16] = d * (qs[j] >> 4) as f32 + m;
    }
}

pub(crate) fn block_q5_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    let qh = u32::from_le_bytes([b[2], b[3], b[4], b[5]]);
    let qs = &b[6..22];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        y[j] = d * (((qs[j] & 0xF) as u32 | h0) as i32 - 16) as f32;
        y[j + 16] = d * (((qs[j] >> 4) as u32 | h1) as i32 - 16) as f32;
    }
}

pub(crate) fn block_q5_1(b: &[u8], y: &mut [f32]) {
    let (d, m) = (f16_at(b, 0), f16_at(b, 2));
    let qh = u32::from_le_bytes([b[4], b[5], b[6], b[7]]);
    let qs = &b[8..24];
    for j in 0..16 {
        let h0 = ((qh >> j) & 1) << 4;
        let h1 = ((qh >> (j + 16)) & 1) << 4;
        y[j] = d * ((qs[j] & 0xF) as u32 | h0) as f32 + m;
        y[j + 16] = d * ((qs[j] >> 4) as u32 | h1) as f32 + m;
    }
}

pub(crate) fn block_q8_0(b: &[u8], y: &mut [f32]) {
    let d = f16_at(b, 0);
    for (y, &q) in y[..32].iter_mut().zip(&b[2..34]) {
        *y = d * (q as i8) as f32;
    }
}

pub(crate) fn block_q2_k(b: &[u8], y: &mut [f32]) {
    let scales = &b[0..16];
    let qs = &b[16..80];
    let (d, dmin) = (f16_at(b, 80), f16_at(b, 82));
    let mut is = 0;
    for n in 0..2 {
        let q = &qs[32 * n..32 * n + 32];
        for j in 0..4 {
            let shift = 2 * j;
            for half in 0..2 {
                let sc = scales[is];
                is += 1;
                let (dl, ml) = (d * (sc & 0xF) as f32, dmin * (sc >> 4) as f32);
                let base = 128 * n + 32 * j + 16 * half;
                for l in 0..16 {
                    y[base + l] = dl * ((q[16 * half + l] >> shift) & 3) as f32 - ml;
                }
            }
        }
    }
}

pub(crate) fn block_q3_k(b: &[u8], y: &mut [f32]) {
    let hmask = &b[0..32];
    let qs = &b[32..96];
    let scales = q3k_scales(&b[96..108]);
    let d = f16_at(b, 108);
    let mut is = 0;
    let mut m = 1u8;
    for n in 0..2 {
        let q = &qs[32 * n..32 * n + 32];
        for j in 0..4 {
            let shift = 2 * j;
            for half in 0..2 {
                let dl = d * scales[is] as f32;
                is += 1;
                let base = 128 * n + 32 * j + 16 * half;
                for l in 0..16 {
                    let k = 16 * half + l;
                    let low = ((q[k] >> shift) & 3) as i32;
                    let high = if hmask[k] & m != 0 { 0 } else { 4 };
                    y[base + l] = dl * (low - high) as f32;
                }
            }
            m <<= 1;
        }
    }
}

pub(crate) fn block_q4_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qs = &b[16..144];
    for i in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * i, scales);
        let (sc2, m2) = scale_min_k4(2 * i + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let q = &qs[32 * i..32 * i + 32];
        for l in 0..32 {
            y[64 * i + l] = d1 * (q[l] & 0xF) as f32 - m1;
            y[64 * i + 32 + l] = d2 * (q[l] >> 4) as f32 - m2;
        }
    }
}

pub(crate) fn block_q5_k(b: &[u8], y: &mut [f32]) {
    let (d, dmin) = (f16_at(b, 0), f16_at(b, 2));
    let scales = &b[4..16];
    let qh = &b[16..48];
    let qs = &b[48..176];
    for i in 0..4 {
        let (sc1, m1) = scale_min_k4(2 * i, scales);
        let (sc2, m2) = scale_min_k4(2 * i + 1, scales);
        let (d1, m1) = (d * sc1 as f32, dmin * m1 as f32);
        let (d2, m2) = (d * sc2 as f32, dmin * m2 as f32);
        let (u1, u2) = (1u8 << (2 * i), 2u8 << (2 * i));
        let q = &qs[32 * i..32 * i + 32];
        for l in 0..32 {
            let h1 = if qh[l] & u1 != 0 { 16 } else { 0 };
            let h2 = if qh[l] & u2 != 0 { 16 } else { 0 };
            y[64 * i + l] = d1 * ((q[l] & 0xF) + h1) as f32 - m1;
            y[64 * i + 32 + l] = d2 * ((q[l] >> 4) + h2) as f32 - m2;
        }
    }
}

pub(crate) fn block_q6_k(b: &[u8], y: &mut [f32]) {
    let ql = &b[0..128];
    let qh = &b[128..192];
    let sc = &b[192..208];
    let d = f16_at(b, 208);
    for n in 0..2 {
        let (ql, qh, sc, y) = (
            &ql[64 * n..],
            &qh[32 * n..],
            &sc[8 * n..],
            &mut y[128 * n..],
        );
        for l in 0..32 {
            let is = l / 16;
            let q1 = ((ql[l] & 0xF) | ((qh[l] & 3) << 4)) as i32 - 32;
            let q2 = ((ql[l + 32] & 0xF) | (((qh[l] >> 2) & 3) << 4)) as i32 - 32;
            let q3 = ((ql[l] >> 4) | (((qh[l] >> 4) & 3) << 4)) as i32 - 32;
            let q4 = ((ql[l + 32] >> 4) | (((qh[l] >> 6) & 3) << 4)) as i32 - 32;
            y[l] = d * (sc[is] as i8) as f32 * q1 as f32;
            y[l + 32] = d * (sc[is + 2] as i8) as f32 * q2 as f32;
            y[l + 64] = d * (sc[is + 4] as i8) as f32 * q3 as f32;
            y[l + 96] = d * (sc[is + 6] as i8) as f32 * q4 as f32;
        }
    }
}

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
