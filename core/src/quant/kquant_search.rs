//! Quantisers for the K super-blocks Q4_K, Q5_K and Q6_K, searching scales (and mins) the
//! way ggml's reference quantisers (`quantize_row_q{4,5,6}_K_ref`, which is also what
//! `llama-quantize` runs when no importance matrix is given) do.
//!
//! A plain max-abs or min/max scale wastes levels: one outlier fixes the grid for the whole
//! sub-block. ggml instead tries a small family of candidate grids around the min/max one
//! and, for each, solves the weighted least-squares problem for the best scale (and min)
//! given the rounded codes, keeping whichever gives the smallest weighted squared error.
//! The sub-block scales found that way are then themselves quantised to 6 bits (Q4_K/Q5_K)
//! or 8 bits (Q6_K) against one f16 super-block scale, and the codes are re-rounded against
//! the scales actually stored, so the error the search saw is the error the file carries.
//!
//! Rounding is `nearest_int` (ties to even, as ggml's float trick does); sums are f32 in the
//! order ggml accumulates them. The byte layouts are documented in [`super::kquants`].

use super::f16_le;
use super::kquants::scale_min_k4;
use super::put_f16_le;

const QK_K: usize = 256;

/// ggml's `GROUP_MAX_EPS`: a sub-block whose largest magnitude is below this is all zero.
const GROUP_MAX_EPS: f32 = 1e-15;

/// ggml's `nearest_int`: round half to even. Adding 1.5·2^23 leaves the rounded integer in
/// the low mantissa bits (exactly ggml's trick, and plain SSE2 arithmetic, where
/// `round_ties_even` is a libm call on baseline x86-64 — this function is the quantisers'
/// inner loop). Outside ±2^22, where the trick stops being exact, the slow path is taken.
#[inline(always)]
fn nearest_int(x: f32) -> i32 {
    if x.abs() < 4_194_303.0 {
        let bits = (x + 12_582_912.0).to_bits();
        (bits & 0x007f_ffff) as i32 - 0x0040_0000
    } else {
        x.round_ties_even() as i32
    }
}

/// ggml's `make_qkx2_quants`: codes `l[i] ∈ 0..=nmax` with `x ≈ scale·l − min_out`, chosen to
/// minimise `Σ w·(scale·l + min − x)²` (with `min ≤ 0`). Returns `(scale, -min)`.
///
/// Starts from the min/max grid, then for `nstep + 1` candidate inverse scales
/// `(nmax + rmin + rdelta·k) / (max − min)` re-rounds and solves the 2×2 normal equations
/// for the best (scale, min) of those codes.
#[allow(clippy::too_many_arguments)]
pub fn make_qkx2_quants(
    x: &[f32],
    weights: &[f32],
    nmax: i32,
    l: &mut [u8],
    laux: &mut [u8],
    rmin: f32,
    rdelta: f32,
    nstep: i32,
) -> (f32, f32) {
    let n = x.len();
    let mut min = x[0];
    let mut max = x[0];
    let mut sum_w = weights[0];
    let mut sum_x = sum_w * x[0];
    for i in 1..n {
        min = min.min(x[i]);
        max = max.max(x[i]);
        let w = weights[i];
        sum_w += w;
        sum_x += w * x[i];
    }
    if min > 0.0 {
        min = 0.0;
    }
    if max == min {
        l[..n].fill(0);
        return (0.0, -min);
    }
    let mut iscale = nmax as f32 / (max - min);
    let mut scale = 1.0 / iscale;
    let mut best_err = 0.0f32;
    for i in 0..n {
        let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
        l[i] = q as u8;
        let diff = scale * q as f32 + min - x[i];
        best_err += weights[i] * diff * diff;
    }
    if nstep < 1 {
        return (scale, -min);
    }
    for is in 0..=nstep {
        iscale = (rmin + rdelta * is as f32 + nmax as f32) / (max - min);
        let (mut sum_l, mut sum_l2, mut sum_xl) = (0.0f32, 0.0f32, 0.0f32);
        for i in 0..n {
            let q = nearest_int(iscale * (x[i] - min)).clamp(0, nmax);
            laux[i] = q as u8;
            let w = weights[i];
            let q = q as f32;
            sum_l += w * q;
            sum_l2 += w * q * q;
            sum_xl += w * q * x[i];
        }
        let det = sum_w * sum_l2 - sum_l * sum_l;
        if det > 0.0 {
            let mut this_scale = (sum_w * sum_xl - sum_x * sum_l) / det;
            let mut this_min = (sum_l2 * sum_x - sum_l * sum_xl) / det;
            if this_min > 0.0 {
                // The format subtracts a non-negative min; refit the scale alone.
                this_min = 0.0;
                this_scale = sum_xl / sum_l2;
            }
            let mut err = 0.0f32;
            for i in 0..n {
                let diff = this_scale * laux[i] as f32 + this_min - x[i];
                err += weights[i] * diff * diff;
            }
            if err < best_err {
                l[..n].copy_from_slice(&laux[..n]);
                best_err = err;
                scale = this_scale;
                min = this_min;
            }
        }
    }
    (scale, -min)
}

/// ggml's `make_qx_quants` with `rmse_type = 1` (weights `x²`) and no importance weights:
/// symmetric codes `l[i] ∈ 0..2·nmax` (stored biased by `nmax`) for `x ≈ scale·(l − nmax)`.
/// Tries 19 grids around `-nmax / max` (where `max` is the value of largest magnitude) and
/// keeps the one whose least-squares scale explains the most of `Σ w·x²`.
pub fn make_qx_quants(x: &[f32], nmax: i32, l: &mut [i8]) -> f32 {
    let n = x.len();
    let mut max = 0.0f32;
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
            max = v;
        }
    }
    if amax < GROUP_MAX_EPS {
        l[..n].fill(0);
        return 0.0;
    }
    let codes = |iscale: f32| -> (f32, f32) {
        let (mut sumlx, mut suml2) = (0.0f32, 0.0f32);
        for &v in x {
            let q = nearest_int(iscale * v).clamp(-nmax, nmax - 1) as f32;
            let w = v * v;
            sumlx += w * v * q;
            suml2 += w * q * q;
        }
        (sumlx, suml2)
    };
    let fill = |iscale: f32, l: &mut [i8]| {
        for (li, &v) in l.iter_mut().zip(x) {
            *li = (nmax + nearest_int(iscale * v).clamp(-nmax, nmax - 1)) as i8;
        }
    };
    let iscale = -(nmax as f32) / max;
    let (sumlx, suml2) = codes(iscale);
    fill(iscale, l);
    let mut scale = if suml2 != 0.0 { sumlx / suml2 } else { 0.0 };
    let mut best = scale * sumlx;
    for is in -9..=9 {
        if is == 0 {
            continue;
        }
        let iscale = -(nmax as f32 + 0.1 * is as f32) / max;
        let (sumlx, suml2) = codes(iscale);
        if suml2 > 0.0 && sumlx * sumlx > best * suml2 {
            fill(iscale, l);
            scale = sumlx / suml2;
            best = scale * sumlx;
        }
    }
    scale
}

/// Per-value weights of ggml's Q4_K/Q5_K search: the sub-block's RMS plus each value's
/// magnitude, so large values (which dominate a dot product) are fitted more closely.
fn qkx_weights(x: &[f32; 32], w: &mut [f32; 32]) {
    let sum_x2: f32 = x.iter().fold(0.0, |acc, v| acc + v * v);
    let av_x = (sum_x2 / 32.0).sqrt();
    for (w, v) in w.iter_mut().zip(x) {
        *w = av_x + v.abs();
    }
}

/// The shared first half of Q4_K/Q5_K: search each of the 8 sub-blocks, quantise the
/// scales and mins to 6 bits, write `d`, `dmin` and `scales[12]` to `head` (16 bytes),
/// and re-round every value against the stored scales into `codes`.
fn quantize_scale_min_block(
    x: &[f32; QK_K],
    nmax: i32,
    rmin: f32,
    nstep: i32,
    head: &mut [u8],
    codes: &mut [u8; QK_K],
) {
    let mut scales = [0.0f32; 8];
    let mut mins = [0.0f32; 8];
    let mut weights = [0.0f32; 32];
    let mut laux = [0u8; 32];
    let mut max_scale = 0.0f32;
    let mut max_min = 0.0f32;
    for j in 0..8 {
        let sub: &[f32; 32] = x[32 * j..32 * j + 32].try_into().expect("32 values");
        qkx_weights(sub, &mut weights);
        let (scale, min) = make_qkx2_quants(
            sub,
            &weights,
            nmax,
            &mut codes[32 * j..32 * j + 32],
            &mut laux,
            rmin,
            0.1,
            nstep,
        );
        scales[j] = scale;
        mins[j] = min;
        max_scale = max_scale.max(scale);
        max_min = max_min.max(min);
    }
    let inv_scale = if max_scale > 0.0 {
        63.0 / max_scale
    } else {
        0.0
    };
    let inv_min = if max_min > 0.0 { 63.0 / max_min } else { 0.0 };
    let packed = &mut head[4..16];
    packed.fill(0);
    for j in 0..8 {
        let ls = nearest_int(inv_scale * scales[j]).clamp(0, 63) as u8;
        let lm = nearest_int(inv_min * mins[j]).clamp(0, 63) as u8;
        if j < 4 {
            packed[j] = ls;
            packed[j + 4] = lm;
        } else {
            packed[j + 4] = (ls & 0x0f) | ((lm & 0x0f) << 4);
            packed[j - 4] |= (ls >> 4) << 6;
            packed[j] |= (lm >> 4) << 6;
        }
    }
    put_f16_le(head, 0, max_scale / 63.0);
    put_f16_le(head, 2, max_min / 63.0);
    let d_all = f16_le(head, 0);
    let dmin_all = f16_le(head, 2);
    for j in 0..8 {
        let (sc, m) = scale_min_k4(&head[4..16], j);
        let d = d_all * f32::from(sc);
        if d == 0.0 {
            // ggml leaves the search's codes in place; with d = 0 they only multiply zero.
            continue;
        }
        let dm = dmin_all * f32::from(m);
        for i in 0..32 {
            codes[32 * j + i] = nearest_int((x[32 * j + i] + dm) / d).clamp(0, nmax) as u8;
        }
    }
}

/// ggml's `quantize_row_q4_K_ref` for one super-block.
pub fn quantize_q4_k(x: &[f32; QK_K], b: &mut [u8; 144]) {
    let mut codes = [0u8; QK_K];
    quantize_scale_min_block(x, 15, -1.0, 20, &mut b[..16], &mut codes);
    let qs = &mut b[16..144];
    // 64 values per 32 bytes: the first 32 in the low nibbles, the next 32 in the high.
    for (chunk, out) in codes.chunks_exact(64).zip(qs.chunks_exact_mut(32)) {
        for l in 0..32 {
            out[l] = chunk[l] | (chunk[l + 32] << 4);
        }
    }
}

/// ggml's `quantize_row_q5_K_ref` for one super-block.
pub fn quantize_q5_k(x: &[f32; QK_K], b: &mut [u8; 176]) {
    let mut codes = [0u8; QK_K];
    quantize_scale_min_block(x, 31, -0.5, 15, &mut b[..16], &mut codes);
    let (qh, qs) = b[16..176].split_at_mut(32);
    qh.fill(0);
    // As Q4_K for the low 4 bits; sub-block `s` puts its 5th bit in bit `s` of qh[l].
    for (pair, (chunk, out)) in codes
        .chunks_exact(64)
        .zip(qs.chunks_exact_mut(32))
        .enumerate()
    {
        let (m1, m2) = (1u8 << (2 * pair), 2u8 << (2 * pair));
        for l in 0..32 {
            let (mut l1, mut l2) = (chunk[l], chunk[l + 32]);
            if l1 > 15 {
                l1 -= 16;
                qh[l] |= m1;
            }
            if l2 > 15 {
                l2 -= 16;
                qh[l] |= m2;
            }
            out[l] = l1 | (l2 << 4);
        }
    }
}

/// ggml's `quantize_row_q6_K_ref` for one super-block.
pub fn quantize_q6_k(x: &[f32; QK_K], b: &mut [u8; 210]) {
    let mut codes = [0i8; QK_K];
    let mut scales = [0.0f32; 16];
    let mut max_scale = 0.0f32;
    let mut max_abs_scale = 0.0f32;
    for ib in 0..16 {
        let scale = make_qx_quants(
            &x[16 * ib..16 * ib + 16],
            32,
            &mut codes[16 * ib..16 * ib + 16],
        );
        scales[ib] = scale;
        if scale.abs() > max_abs_scale {
            max_abs_scale = scale.abs();
            max_scale = scale;
        }
    }
    b.fill(0);
    if max_abs_scale < GROUP_MAX_EPS {
        return;
    }
    // The largest scale maps to -128 so its sign is carried by `d`.
    let iscale = -128.0 / max_scale;
    put_f16_le(b, 208, 1.0 / iscale);
    for ib in 0..16 {
        b[192 + ib] = nearest_int(iscale * scales[ib]).clamp(-128, 127) as i8 as u8;
    }
    let d_all = f16_le(b, 208);
    let mut l = [0u8; QK_K];
    for j in 0..16 {
        let d = d_all * f32::from(b[192 + j] as i8);
        if d == 0.0 {
            // ggml keeps the search's (biased) codes here; with d = 0 they decode to zero.
            for i in 0..16 {
                l[16 * j + i] = codes[16 * j + i] as u8;
            }
            continue;
        }
        for i in 0..16 {
            l[16 * j + i] = (nearest_int(x[16 * j + i] / d).clamp(-32, 31) + 32) as u8;
        }
    }
    for half in 0..2 {
        let l = &l[128 * half..128 * half + 128];
        let (ql, rest) = b.split_at_mut(128);
        let ql = &mut ql[64 * half..64 * half + 64];
        let qh = &mut rest[32 * half..32 * half + 32];
        for i in 0..32 {
            let (q1, q2, q3, q4) = (l[i], l[i + 32], l[i + 64], l[i + 96]);
            ql[i] = (q1 & 0x0f) | ((q3 & 0x0f) << 4);
            ql[i + 32] = (q2 & 0x0f) | ((q4 & 0x0f) << 4);
            qh[i] = (q1 >> 4) | ((q2 >> 4) << 2) | ((q3 >> 4) << 4) | ((q4 >> 4) << 6);
        }
    }
}
