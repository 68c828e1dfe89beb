//! The I-quants' non-linear 4-bit types (llama.cpp's IQ4_NL and IQ4_XS): each 4-bit code
//! is an index into [`KVALUES_IQ4NL`], a table of 16 signed levels spaced for weights that
//! cluster near zero, times the block's scale.
//!
//! - IQ4_NL (ggml type 20): blocks of 32 values, an f16 scale `d` and 16 bytes of codes —
//!   value `j` the low nibble of byte `j`, value `j + 16` its high nibble.
//! - IQ4_XS (ggml type 23): super-blocks of 256 values: an f16 `d`, a u16 of high scale
//!   bits, 4 bytes of low scale nibbles, then 128 bytes of codes, 16 a 32-value sub-block
//!   laid out as IQ4_NL's. Sub-block `i`'s 6-bit scale is its low nibble (byte `i / 2`,
//!   the high half for odd `i`) with bits `2i, 2i + 1` of the u16 above it, minus 32.

/// IQ4_NL's levels (ggml's `kvalues_iq4nl`).
pub const KVALUES_IQ4NL: [i8; 16] = [
    -127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113,
];

fn f16_le(b: &[u8], at: usize) -> f32 {
    half::f16::from_bits(u16::from_le_bytes([b[at], b[at + 1]])).to_f32()
}

/// 32 values from 16 bytes of codes at `qs`, each its level times `d`.
fn levels(qs: &[u8], d: f32, y: &mut [f32]) {
    for j in 0..16 {
        y[j] = d * KVALUES_IQ4NL[(qs[j] & 0x0F) as usize] as f32;
        y[j + 16] = d * KVALUES_IQ4NL[(qs[j] >> 4) as usize] as f32;
    }
}

/// One IQ4_NL block's 32 values.
pub fn dequantize_iq4_nl(b: &[u8; 18], y: &mut [f32; 32]) {
    levels(&b[2..], f16_le(b, 0), y);
}

/// Sub-block `i`'s scale of an IQ4_XS super-block (−32 to 31).
pub fn iq4_xs_scale(b: &[u8], i: usize) -> i32 {
    let high = u16::from_le_bytes([b[2], b[3]]);
    let low = (b[4 + i / 2] >> (4 * (i % 2))) & 0x0F;
    (low as i32 | ((((high >> (2 * i)) & 3) as i32) << 4)) - 32
}

/// One IQ4_XS super-block's 256 values.
pub fn dequantize_iq4_xs(b: &[u8; 136], y: &mut [f32; 256]) {
    let d = f16_le(b, 0);
    for i in 0..8 {
        let dl = d * iq4_xs_scale(b, i) as f32;
        levels(&b[8 + 16 * i..], dl, &mut y[32 * i..32 * (i + 1)]);
    }
}
