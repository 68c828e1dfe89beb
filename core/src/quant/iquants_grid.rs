//! The grid-based I-quants (llama.cpp's IQ2_XXS, IQ2_XS, IQ2_S, IQ3_XXS, IQ3_S, IQ1_S,
//! IQ1_M): 256-value super-blocks whose values come in groups of 8 (or 4) read from a
//! lattice ([`super::iquant_grids`]) by index, with signs and a scale per sub-block.
//! Layouts, in each block's byte order (ggml's structs; the `gguf` package's
//! dequantisers agree, and are the fixture these are tested against):
//!
//! - IQ2_XXS (16), 66 bytes: f16 `d`, then 8 sub-blocks of 32 values, each two u32: four
//!   grid indices (bytes, 8 values each), and four 7-bit sign indices (into [`KSIGNS`])
//!   under a 4-bit scale `s` (top bits): values `d·(0.5 + s)·0.25·grid·sign`.
//! - IQ2_XS (17), 74 bytes: f16 `d`, 32 u16 (9-bit grid index, 7-bit sign index), 8 bytes
//!   of 4-bit scales, one per 16 values (low nibble first).
//! - IQ2_S (22), 82 bytes: f16 `d`, 32 low index bytes, 32 sign bytes (bit `j`: value `j`
//!   of the group is negative), 8 bytes of 2-bit index tops (four a byte), 8 bytes of
//!   scales as IQ2_XS's; 10-bit indices.
//! - IQ3_XXS (18), 98 bytes: f16 `d`, 64 index bytes (groups of 4), then a u32 a
//!   sub-block laid out as IQ2_XXS's second word; values `d·(0.5 + s)·0.5·grid·sign`.
//! - IQ3_S (21), 110 bytes: f16 `d`, 64 low index bytes, 8 bytes of index top bits (one a
//!   group of 4), 32 sign bytes, 4 bytes of scales (one a sub-block); values
//!   `d·(1 + 2s)·grid·sign`.
//! - IQ1_S (19), 50 bytes: f16 `d`, 32 low index bytes, a u16 a sub-block (four 3-bit
//!   index tops, a 3-bit scale, the delta's sign in bit 15); values
//!   `d·(2s + 1)·(grid ± 0.125)` with the grid's −1, 0, 1.
//! - IQ1_M (29), 56 bytes: 32 low index bytes, 16 bytes of nibbles (3-bit index top, the
//!   delta's sign in bit 3), four u16 of 3-bit scales (one per 16 values) whose top nibbles
//!   assemble the f16 `d`.
//!
//! Float operations run in the reference's order (scale, then times the grid value, then
//! the sign), so results are bit-identical to it. Every byte pattern decodes: indices are
//! masked to their grid's size.

use super::iquant_grids::{
    IQ1S_GRID, IQ2S_GRID, IQ2XS_GRID, IQ2XXS_GRID, IQ3S_GRID, IQ3XXS_GRID, KSIGNS,
};

/// IQ1_S's and IQ1_M's offset of every grid value.
const IQ1_DELTA: f32 = 0.125;

fn f16_at(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

fn u16_at(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes([b[at], b[at + 1], b[at + 2], b[at + 3]])
}

fn sign(bits: u8, j: usize) -> f32 {
    if (bits >> j) & 1 == 1 {
        -1.0
    } else {
        1.0
    }
}

/// Eight values `db·grid[j]·sign_j` of one group.
fn group8(db: f32, row: u64, signs: u8, y: &mut [f32]) {
    for (j, g) in row.to_le_bytes().into_iter().enumerate() {
        y[j] = db * g as f32 * sign(signs, j);
    }
}

/// 4-bit scale `k` of IQ2_XS's and IQ2_S's (low nibble first).
fn nibble_scale(scales: &[u8], k: usize) -> f32 {
    ((scales[k / 2] >> (4 * (k % 2))) & 0x0F) as f32
}

pub fn dequantize_iq2_xxs(b: &[u8; 66], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    for ib in 0..8 {
        let q = &b[2 + 8 * ib..10 + 8 * ib];
        let aux = u32_at(q, 4);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.25;
        for l in 0..4 {
            let signs = KSIGNS[((aux >> (7 * l)) & 127) as usize];
            let at = 32 * ib + 8 * l;
            group8(db, IQ2XXS_GRID[q[l] as usize], signs, &mut y[at..at + 8]);
        }
    }
}

pub fn dequantize_iq2_xs(b: &[u8; 74], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let scales = &b[66..74];
    for i in 0..32 {
        let q = u16_at(b, 2 + 2 * i);
        let db = d * (0.5 + nibble_scale(scales, i / 2)) * 0.25;
        let signs = KSIGNS[(q >> 9) as usize];
        group8(
            db,
            IQ2XS_GRID[(q & 511) as usize],
            signs,
            &mut y[8 * i..8 * i + 8],
        );
    }
}

pub fn dequantize_iq2_s(b: &[u8; 82], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let (qs, signs, qh, scales) = (&b[2..34], &b[34..66], &b[66..74], &b[74..82]);
    for i in 0..32 {
        let top = ((qh[i / 4] >> (2 * (i % 4))) & 3) as usize;
        let db = d * (0.5 + nibble_scale(scales, i / 2)) * 0.25;
        let row = IQ2S_GRID[qs[i] as usize | (top << 8)];
        group8(db, row, signs[i], &mut y[8 * i..8 * i + 8]);
    }
}

pub fn dequantize_iq3_xxs(b: &[u8; 98], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let qs = &b[2..66];
    for ib in 0..8 {
        let aux = u32_at(b, 66 + 4 * ib);
        let db = d * (0.5 + (aux >> 28) as f32) * 0.5;
        for v in 0..32 {
            let g = IQ3XXS_GRID[qs[8 * ib + v / 4] as usize].to_le_bytes()[v % 4];
            let signs = KSIGNS[((aux >> (7 * (v / 8))) & 127) as usize];
            y[32 * ib + v] = db * g as f32 * sign(signs, v % 8);
        }
    }
}

pub fn dequantize_iq3_s(b: &[u8; 110], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let (qs, qh, signs, scales) = (&b[2..66], &b[66..74], &b[74..106], &b[106..110]);
    for (v, out) in y.iter_mut().enumerate() {
        let i = v / 4;
        let top = ((qh[i / 8] >> (i % 8)) & 1) as usize;
        let g = IQ3S_GRID[qs[i] as usize | (top << 8)].to_le_bytes()[v % 4];
        let s = (scales[v / 64] >> (4 * ((v / 32) % 2))) & 0x0F;
        let db = d * (1 + 2 * s as u32) as f32;
        *out = db * g as f32 * sign(signs[v / 8], v % 8);
    }
}

pub fn dequantize_iq1_s(b: &[u8; 50], y: &mut [f32; 256]) {
    let d = f16_at(b, 0);
    let qs = &b[2..34];
    for ib in 0..8 {
        let qh = u16_at(b, 34 + 2 * ib);
        let dl = d * (2 * ((qh >> 12) & 7) + 1) as f32;
        let delta = if qh & 0x8000 == 0 {
            IQ1_DELTA
        } else {
            -IQ1_DELTA
        };
        for l in 0..4 {
            let idx = qs[4 * ib + l] as usize | ((((qh >> (3 * l)) & 7) as usize) << 8);
            let at = 32 * ib + 8 * l;
            for (j, g) in IQ1S_GRID[idx].to_le_bytes().into_iter().enumerate() {
                y[at + j] = dl * (g as i8 as f32 + delta);
            }
        }
    }
}

pub fn dequantize_iq1_m(b: &[u8; 56], y: &mut [f32; 256]) {
    let (qs, qh) = (&b[0..32], &b[32..48]);
    let s = [0, 1, 2, 3].map(|k| u16_at(b, 48 + 2 * k));
    let d_bits =
        ((s[0] & 0xF000) >> 12) | ((s[1] & 0xF000) >> 8) | ((s[2] & 0xF000) >> 4) | (s[3] & 0xF000);
    let d = half::f16::from_bits(d_bits).to_f32();
    for i in 0..32 {
        let k = (i / 4) * 2 + (i % 4) / 2;
        let sc = (s[k / 4] >> (3 * (k % 4))) & 7;
        let dl = d * (2 * sc + 1) as f32;
        let nibble = (qh[i / 2] >> (4 * (i % 2))) & 0x0F;
        let delta = if nibble & 8 == 0 {
            IQ1_DELTA
        } else {
            -IQ1_DELTA
        };
        let idx = qs[i] as usize | (((nibble & 7) as usize) << 8);
        for (j, g) in IQ1S_GRID[idx].to_le_bytes().into_iter().enumerate() {
            y[8 * i + j] = dl * (g as i8 as f32 + delta);
        }
    }
}
