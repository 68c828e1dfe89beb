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

/// ggml's `nearest_int`: round to nearest, ties to even (the float-magic trick).
fn nearest_int(x: f32) -> i32 {
    ((x + 12_582_912.0).to_bits() & 0x007F_FFFF) as i32 - 0x0040_0000
}

/// The index of the level nearest `x` (ggml's `best_index_int8`: the lower one of two
/// equally near).
fn best_index(x: f32) -> u8 {
    let v = &KVALUES_IQ4NL;
    if x <= v[0] as f32 {
        return 0;
    }
    if x >= v[15] as f32 {
        return 15;
    }
    let (mut lo, mut hi) = (0usize, 15usize);
    while hi - lo > 1 {
        let mid = (lo + hi) / 2;
        if x < v[mid] as f32 {
            hi = mid;
        } else {
            lo = mid;
        }
    }
    if x - (v[hi - 1] as f32) < v[hi] as f32 - x {
        (hi - 1) as u8
    } else {
        hi as u8
    }
}

/// A 32-value sub-block's scale as ggml's IQ4 quantiser searches it without importance
/// weights: each value weighted by its square, the scale from the largest magnitude, then
/// fifteen candidate scales around it, keeping the one that minimises the weighted error
/// (maximises (Σw·q·x)² / Σw·q²). 0 for an all-but-zero block.
fn iq4_sub_block_scale(xb: &[f32]) -> f32 {
    const GROUP_MAX_EPS: f32 = 1e-15;
    const NTRY: i32 = 7;
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &x in xb {
        if x.abs() > amax {
            amax = x.abs();
            max = x;
        }
    }
    if amax < GROUP_MAX_EPS {
        return 0.0;
    }
    let v0 = KVALUES_IQ4NL[0] as f32;
    let sums = |id: f32| {
        let (mut sumqx, mut sumq2) = (0.0f32, 0.0f32);
        for &x in xb {
            let q = KVALUES_IQ4NL[best_index(id * x) as usize] as f32;
            let w = x * x;
            sumqx += w * q * x;
            sumq2 += w * q * q;
        }
        (sumqx, sumq2)
    };
    let (sumqx, sumq2) = sums(1.0 / (-max / v0));
    let mut d = if sumq2 > 0.0 { sumqx / sumq2 } else { 0.0 };
    let mut best = d * sumqx;
    for itry in -NTRY..=NTRY {
        let id = (itry + KVALUES_IQ4NL[0] as i32) as f32 / max;
        let (sumqx, sumq2) = sums(id);
        if sumq2 > 0.0 && sumqx * sumqx > best * sumq2 {
            d = sumqx / sumq2;
            best = d * sumqx;
        }
    }
    d
}

/// Packs 32 level indices: value `j` in byte `j`'s low nibble, `j + 16` in its high one.
fn pack_codes(levels: &[u8], q: &mut [u8]) {
    for j in 0..16 {
        q[j] = levels[j] | (levels[j + 16] << 4);
    }
}

/// One IQ4_NL block of 32 values, as llama.cpp's quantiser makes it (`quantize_iq4_nl`,
/// which `llama-quantize` runs: the scale search above, the codes for the scale found).
pub fn quantize_iq4_nl(x: &[f32; 32], b: &mut [u8; 18]) {
    let d = iq4_sub_block_scale(x);
    b[0..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let levels: Vec<u8> = x.iter().map(|&v| best_index(id * v)).collect();
    pack_codes(&levels, &mut b[2..18]);
}

/// One IQ4_XS super-block of 256 values as llama.cpp makes it: each sub-block's scale
/// searched as for IQ4_NL, the super-block scale `d = −max/32` (the largest in magnitude),
/// each sub-block's scale rounded to a 6-bit multiple of it, and the codes for that.
pub fn quantize_iq4_xs(x: &[f32; 256], b: &mut [u8; 136]) {
    let scales: Vec<f32> = x.chunks_exact(32).map(iq4_sub_block_scale).collect();
    let (mut amax, mut max) = (0.0f32, 0.0f32);
    for &s in &scales {
        if s.abs() > amax {
            amax = s.abs();
            max = s;
        }
    }
    let d = -max / 32.0;
    b[0..2].copy_from_slice(&half::f16::from_f32(d).to_le_bytes());
    b[2..8].fill(0);
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    let mut high = 0u16;
    for (ib, xb) in x.chunks_exact(32).enumerate() {
        let l = nearest_int(id * scales[ib]).clamp(-32, 31);
        let dl = d * l as f32;
        let idl = if dl != 0.0 { 1.0 / dl } else { 0.0 };
        let levels: Vec<u8> = xb.iter().map(|&v| best_index(idl * v)).collect();
        pack_codes(&levels, &mut b[8 + 16 * ib..24 + 16 * ib]);
        let l = (l + 32) as u8;
        b[4 + ib / 2] |= (l & 0x0F) << (4 * (ib % 2));
        high |= ((l >> 4) as u16) << (2 * ib);
    }
    b[2..4].copy_from_slice(&high.to_le_bytes());
}
