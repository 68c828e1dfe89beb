//! AVX2 forms of [`super::q8`]'s integer row dots: weight bytes times activation bytes
//! with `vpmaddubsw` (unsigned × signed, pairs summed to i16) and `vpmaddwd` (pairs to
//! i32), one int→float conversion and one FMA per 32 values. Each agrees with
//! [`super::q8::dot_portable`] to f32 rounding: the integer dots are the same exact sums,
//! only the float additions come in another order.
//!
//! Unsigned weights keep their offsets out of the products (Q4_0's −8 and Q5_0's −16 go
//! through the activation's block sums `s`, as Q4_1's and Q4_K's mins do); signed ones
//! (Q8_0) move the sign onto the activation (`|w|·sign(y, w)`). No pair sum can saturate:
//! the largest, 2·128·127, is below 2¹⁵.

use std::arch::x86_64::*;

use kiln_core::quant::{iquants, mxfp4};
use kiln_core::QType;

use super::avx2::offset;
use super::avx2::{f16_pairs8, f16x2, from_memory, hsum, k_scales_mins, Avx2};
use super::q8::{check_lengths, Q8Ref, Q8_BLOCK};

/// Σ w·y of 32 unsigned weight bytes and 32 signed activation bytes, as eight i32 lane
/// sums (each of four adjacent products).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_sums(w: __m256i, y: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(w, y), _mm256_set1_epi16(1))
}

/// Lane k of the result: the sum of the eight lanes of `p[k]`. Eight blocks' integer dots
/// into one vector, so a group of blocks takes one conversion and one FMA with its eight
/// scales side by side, instead of a conversion, a broadcast and an FMA per block (the
/// broadcasts also cost the compiler registers it then spilled).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lane_sums8(p: [__m256i; 8]) -> __m256i {
    let h01 = _mm256_hadd_epi32(p[0], p[1]);
    let h23 = _mm256_hadd_epi32(p[2], p[3]);
    let h45 = _mm256_hadd_epi32(p[4], p[5]);
    let h67 = _mm256_hadd_epi32(p[6], p[7]);
    // Lanes 0..4: blocks 0..4's low halves, lanes 4..8 their high halves (and so on).
    let h0123 = _mm256_hadd_epi32(h01, h23);
    let h4567 = _mm256_hadd_epi32(h45, h67);
    _mm256_add_epi32(
        _mm256_permute2x128_si256(h0123, h4567, 0x20),
        _mm256_permute2x128_si256(h0123, h4567, 0x31),
    )
}

/// The 32 nibbles of 16 bytes at `p` as bytes: byte i's low nibble at i, its high one at
/// 16 + i (the value order of Q4_0, Q4_1, Q5_0 and Q5_1).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees the features and 16 readable bytes at `p`.
    unsafe {
        let bytes = _mm_loadu_si128(p as *const __m128i);
        let both = _mm256_set_m128i(_mm_srli_epi16(bytes, 4), bytes);
        _mm256_and_si256(both, _mm256_set1_epi8(0x0F))
    }
}

/// Bit i of `bits` as byte i: 0x10 where set (a Q5 quant's fifth bit, ready to OR on).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits32(bits: u32) -> __m256i {
    // Byte i gets byte i / 8 of `bits` (the shuffle works within each 128-bit half, and
    // both halves hold the same four bytes), then tests bit i % 8.
    let spread = _mm256_shuffle_epi8(
        _mm256_set1_epi32(bits as i32),
        _mm256_setr_epi8(
            0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, //
            2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3, 3, 3,
        ),
    );
    let lane_bit = _mm256_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm256_cmpeq_epi8(_mm256_and_si256(spread, lane_bit), lane_bit);
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

/// Lanes 0..4 of the result: the lane sums of `a[0..4]`; lanes 4..8 those of `b[0..4]`.
/// Two rows' dots of four blocks each into one vector, as [`lane_sums8`] does for eight.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn lane_sums_2x4(a: [__m256i; 4], b: [__m256i; 4]) -> __m256i {
    let ha = _mm256_hadd_epi32(_mm256_hadd_epi32(a[0], a[1]), _mm256_hadd_epi32(a[2], a[3]));
    let hb = _mm256_hadd_epi32(_mm256_hadd_epi32(b[0], b[1]), _mm256_hadd_epi32(b[2], b[3]));
    _mm256_add_epi32(
        _mm256_permute2x128_si256(ha, hb, 0x20),
        _mm256_permute2x128_si256(ha, hb, 0x31),
    )
}

/// The loop of the 32-value types, two rows at a time: for each row, Σ_b d_b·dx_b·
/// `block`(b) plus the offset [`offset`] names (`factor·d·s` for SCALE: Q4_0's −8, Q5_0's
/// −16; `m·s` for MIN; none for NONE). `block` gives the eight i32 lane sums of a
/// block's weight bytes times its activation bytes. Four blocks of both rows a step: their
/// dots gathered into one vector ([`lane_sums_2x4`]) that meets their eight scales in one
/// FMA, their heads converted together. A row of 576 values is only 18 blocks, so what a row
/// costs beyond its blocks (the final sums, the last blocks, the loop) is shared by two;
/// and each activation vector, once loaded, serves both rows.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_pair<const STRIDE: usize, const OFFSET: u8>(
    rows: [&[u8]; 2],
    x: Q8Ref<'_>,
    factor: f32,
    block: impl Fn(*const u8, __m256i) -> __m256i,
) -> [f32; 2] {
    // SAFETY: the caller guarantees the features and `x.len() / 32` blocks of STRIDE bytes
    // in each row, with `x.d` and `x.s` one value per block; every pointer stays inside them.
    unsafe {
        let nb = x.len() / Q8_BLOCK;
        let (p0, p1, y) = (rows[0].as_ptr(), rows[1].as_ptr(), x.qs.as_ptr());
        // Lanes 0..4 row 0, lanes 4..8 row 1.
        let mut acc = _mm256_setzero_ps();
        let mut off = _mm256_setzero_ps();
        let mut b = 0;
        while b + 4 <= nb {
            let mut dots = [[_mm256_setzero_si256(); 4]; 2];
            let mut words = [0u32; 8];
            for k in 0..4 {
                let yv = _mm256_loadu_si256(y.add((b + k) * Q8_BLOCK) as *const __m256i);
                let (w0, w1) = (p0.add((b + k) * STRIDE), p1.add((b + k) * STRIDE));
                dots[0][k] = block(w0, yv);
                dots[1][k] = block(w1, yv);
                words[k] = (w0 as *const u32).read_unaligned();
                words[4 + k] = (w1 as *const u32).read_unaligned();
            }
            let (d, m) = f16_pairs8(&words);
            // The four blocks' activation scales and sums, for both rows' lanes (loaded
            // unaligned: `_mm256_broadcast_ps` would take a reference, which must be aligned).
            let dx = _mm_loadu_ps(x.d.as_ptr().add(b));
            let dx = _mm256_set_m128(dx, dx);
            let sums = _mm256_cvtepi32_ps(lane_sums_2x4(dots[0], dots[1]));
            acc = _mm256_fmadd_ps(_mm256_mul_ps(d, dx), sums, acc);
            let s = _mm_loadu_ps(x.s.as_ptr().add(b));
            let s = _mm256_set_m128(s, s);
            match OFFSET {
                offset::SCALE => off = _mm256_fmadd_ps(d, s, off),
                offset::MIN => off = _mm256_fmadd_ps(m, s, off),
                _ => {}
            }
            b += 4;
        }
        // The last blocks of the rows (rows of 576 values end in two), a block of both
        // rows a step: lanes [row 0's first four products, its last four, row 1's, row 1's].
        let mut tail = _mm_setzero_ps();
        let mut tail_off = [0.0f32; 2];
        while b < nb {
            let yv = _mm256_loadu_si256(y.add(b * Q8_BLOCK) as *const __m256i);
            let (w0, w1) = (p0.add(b * STRIDE), p1.add(b * STRIDE));
            let h = _mm256_hadd_epi32(block(w0, yv), block(w1, yv));
            let h = _mm_add_epi32(_mm256_castsi256_si128(h), _mm256_extracti128_si256(h, 1));
            let ((d0, m0), (d1, m1)) = (f16x2(w0), f16x2(w1));
            let (a0, a1) = (d0 * x.d[b], d1 * x.d[b]);
            tail = _mm_fmadd_ps(_mm_setr_ps(a0, a0, a1, a1), _mm_cvtepi32_ps(h), tail);
            match OFFSET {
                offset::SCALE => {
                    tail_off[0] += factor * d0 * x.s[b];
                    tail_off[1] += factor * d1 * x.s[b];
                }
                offset::MIN => {
                    tail_off[0] += m0 * x.s[b];
                    tail_off[1] += m1 * x.s[b];
                }
                _ => {}
            }
            b += 1;
        }
        let total = match OFFSET {
            offset::SCALE => _mm256_fmadd_ps(_mm256_set1_ps(factor), off, acc),
            offset::MIN => _mm256_add_ps(acc, off),
            _ => acc,
        };
        // [row 0, row 0, row 1, row 1] partial sums, then one sum per row.
        let halves = _mm_hadd_ps(
            _mm256_castps256_ps128(total),
            _mm256_extractf128_ps(total, 1),
        );
        let both = _mm_add_ps(halves, tail);
        let both = _mm_hadd_ps(both, both);
        [
            _mm_cvtss_f32(both) + tail_off[0],
            _mm_cvtss_f32(_mm_movehdup_ps(both)) + tail_off[1],
        ]
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_0(rows: [&[u8]; 2], x: Q8Ref<'_>) -> [f32; 2] {
    // SAFETY: the caller guarantees the features and the lengths; a block's quants are its
    // 16 bytes from byte 2.
    unsafe {
        legacy_pair::<18, { offset::SCALE }>(rows, x, -8.0, |b, y| {
            pair_sums(nibbles32(b.add(2)), y)
        })
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_1(rows: [&[u8]; 2], x: Q8Ref<'_>) -> [f32; 2] {
    // SAFETY: as for `dot_q4_0`; Q4_1's quants start at byte 4.
    unsafe {
        legacy_pair::<20, { offset::MIN }>(rows, x, 1.0, |b, y| pair_sums(nibbles32(b.add(4)), y))
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_0(rows: [&[u8]; 2], x: Q8Ref<'_>) -> [f32; 2] {
    // SAFETY: as for `dot_q4_0`; Q5_0's fifth bits are the four bytes at 2, its nibbles
    // the 16 at 6.
    unsafe {
        legacy_pair::<22, { offset::SCALE }>(rows, x, -16.0, |b, y| {
            let bits = (b.add(2) as *const u32).read_unaligned().to_le();
            pair_sums(_mm256_or_si256(nibbles32(b.add(6)), fifth_bits32(bits)), y)
        })
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_1(rows: [&[u8]; 2], x: Q8Ref<'_>) -> [f32; 2] {
    // SAFETY: as for `dot_q5_0`, two bytes further on (Q5_1's head holds d and m).
    unsafe {
        legacy_pair::<24, { offset::MIN }>(rows, x, 1.0, |b, y| {
            let bits = (b.add(4) as *const u32).read_unaligned().to_le();
            pair_sums(_mm256_or_si256(nibbles32(b.add(8)), fifth_bits32(bits)), y)
        })
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0(rows: [&[u8]; 2], x: Q8Ref<'_>) -> [f32; 2] {
    // SAFETY: as for `dot_q4_0`; Q8_0's 32 signed quants start at byte 2.
    unsafe {
        legacy_pair::<34, { offset::NONE }>(rows, x, 0.0, |b, y| {
            let w = _mm256_loadu_si256(b.add(2) as *const __m256i);
            pair_sums(_mm256_abs_epi8(w), _mm256_sign_epi8(y, w))
        })
    }
}

/// MXFP4: a block's codes become their E2M1 values (doubled: signed integers) in one byte
/// shuffle of the table, then multiply the activation bytes as Q8_0's signed quants do
/// (`|w|·sign(y, w)`), the eight lane sums scaled by the block's e8m0_half(e)·dx.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_mxfp4(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: the caller guarantees the features, `x.len() / 32` blocks of 17 bytes in
    // `row` (an exponent byte, then 16 bytes of codes) and one `d` per 32 values of `x`.
    unsafe {
        let (p, y) = (row.as_ptr(), x.qs.as_ptr());
        table_blocks::<17, 1>(levels(mxfp4::KVALUES), p, y, x, |blk| {
            mxfp4::e8m0_half(*blk)
        })
    }
}

/// IQ4_NL: [`dot_mxfp4`]'s loop over its own levels, each block scaled by its f16 `d`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq4_nl(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: as for `dot_mxfp4`, with blocks of 18 bytes (an f16, then 16 of codes).
    unsafe {
        let (p, y) = (row.as_ptr(), x.qs.as_ptr());
        table_blocks::<18, 2>(levels(iquants::KVALUES_IQ4NL), p, y, x, |blk| {
            half::f16::from_bits(u16::from_le_bytes([*blk, *blk.add(1)])).to_f32()
        })
    }
}

/// A type's 16 levels in both 128-bit halves: what a byte shuffle by 4-bit codes reads.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn levels(k: [i8; 16]) -> __m256i {
    // SAFETY: a 16-byte load from a 16-byte array.
    let half = unsafe { _mm_loadu_si128(k.as_ptr() as *const __m128i) };
    _mm256_set_m128i(half, half)
}

/// The loop of the 32-value table types: each block of `BYTES` bytes has its 16 bytes of
/// codes at `CODES`, looked up in `table` (signed levels), multiplied with the activation
/// bytes as signed quants are, and scaled by `scale(block)`·dx.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn table_blocks<const BYTES: usize, const CODES: usize>(
    table: __m256i,
    p: *const u8,
    y: *const i8,
    x: Q8Ref<'_>,
    scale: impl Fn(*const u8) -> f32,
) -> f32 {
    // SAFETY: the caller guarantees the features, `x.len() / 32` blocks of BYTES bytes at
    // `p` and 32 activation bytes a block at `y`.
    unsafe {
        let mut acc = _mm256_setzero_ps();
        for b in 0..x.len() / Q8_BLOCK {
            let blk = p.add(b * BYTES);
            let w = _mm256_shuffle_epi8(table, nibbles32(blk.add(CODES)));
            let yv = _mm256_loadu_si256(y.add(b * Q8_BLOCK) as *const __m256i);
            let dots = pair_sums(_mm256_abs_epi8(w), _mm256_sign_epi8(yv, w));
            let s = _mm256_set1_ps(scale(blk) * x.d[b]);
            acc = _mm256_fmadd_ps(s, _mm256_cvtepi32_ps(dots), acc);
        }
        hsum(acc)
    }
}

/// Q4_K: per 256-value super-block, eight 32-value sub-blocks, each d·scale_j·dx_j times
/// its nibbles' dot, minus dmin·min_j·s_j (the activation blocks line up with the
/// sub-blocks). The 32 bytes of each 64-value run hold one sub-block in their low nibbles
/// and the next in their high ones; the eight dots meet their eight scales in one FMA.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: the caller guarantees the features, `x.len() / 256` blocks of 144 bytes in
    // `row` and one `d`/`s` per 32 values of `x`; every pointer stays inside them.
    unsafe {
        let (p, y) = (row.as_ptr(), x.qs.as_ptr());
        let low = _mm256_set1_epi8(0x0F);
        let mut acc = _mm256_setzero_ps();
        let mut off = _mm256_setzero_ps();
        for sb in 0..x.len() / 256 {
            let blk = p.add(sb * 144);
            let (d, dmin) = f16x2(blk);
            let (sc, mn) = k_scales_mins(blk.add(4));
            let mut dots = [_mm256_setzero_si256(); 8];
            for j in 0..4 {
                let bytes = _mm256_loadu_si256(blk.add(16 + 32 * j) as *const __m256i);
                let ys = y.add(256 * sb + 64 * j);
                dots[2 * j] = pair_sums(
                    _mm256_and_si256(bytes, low),
                    _mm256_loadu_si256(ys as *const __m256i),
                );
                dots[2 * j + 1] = pair_sums(
                    _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low),
                    _mm256_loadu_si256(ys.add(32) as *const __m256i),
                );
            }
            let dx = _mm256_loadu_ps(x.d.as_ptr().add(8 * sb));
            let dsc = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), sc), dx);
            acc = _mm256_fmadd_ps(dsc, _mm256_cvtepi32_ps(lane_sums8(dots)), acc);
            let s = _mm256_loadu_ps(x.s.as_ptr().add(8 * sb));
            off = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), mn), s, off);
        }
        hsum(_mm256_sub_ps(acc, off))
    }
}

/// Q6_K: per 256-value super-block, its 6-bit quants assembled 32 at a time from the low
/// and high bit arrays (ggml's order: see [`super::q8::dot_portable`]), each 32 values one
/// activation block and two 16-value sub-blocks with i8 scales. The −32 offset is taken
/// off the pair sums (32·(y + y′) from a second `vpmaddubsw`), the sub-block scales applied
/// by `vpmaddwd`, and the eight blocks' d·dx in one FMA.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: the caller guarantees the features, `x.len() / 256` blocks of 210 bytes in
    // `row` and one `d` per 32 values of `x`; every pointer stays inside them.
    unsafe {
        let (p, y) = (row.as_ptr(), x.qs.as_ptr());
        let (low4, low2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03));
        let thirty_two = _mm256_set1_epi8(32);
        let mut acc = _mm256_setzero_ps();
        for sb in 0..x.len() / 256 {
            let blk = p.add(sb * 210);
            let sub_scales = _mm_loadu_si128(blk.add(192) as *const __m128i);
            let mut dots = [_mm256_setzero_si256(); 8];
            for half in 0..2 {
                let ql0 = _mm256_loadu_si256(blk.add(64 * half) as *const __m256i);
                let ql1 = _mm256_loadu_si256(blk.add(64 * half + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(blk.add(128 + 32 * half) as *const __m256i);
                // The two top bits of each quant, moved up to bits 4 and 5.
                let top = |bits: __m256i| _mm256_slli_epi16(_mm256_and_si256(bits, low2), 4);
                let quants = [
                    _mm256_or_si256(_mm256_and_si256(ql0, low4), top(qh)),
                    _mm256_or_si256(_mm256_and_si256(ql1, low4), top(_mm256_srli_epi16(qh, 2))),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                        top(_mm256_srli_epi16(qh, 4)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                        top(_mm256_srli_epi16(qh, 6)),
                    ),
                ];
                for (k, q) in quants.into_iter().enumerate() {
                    let b = 4 * half + k;
                    let yv = _mm256_loadu_si256(y.add(256 * sb + 32 * b) as *const __m256i);
                    let pairs = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(q, yv),
                        _mm256_maddubs_epi16(thirty_two, yv),
                    );
                    // Sub-block scales 8·half + 2k (values 0..16) and the next (16..32).
                    let first = (8 * half + 2 * k) as i8;
                    let second = first + 1;
                    #[rustfmt::skip]
                    let pick = _mm_setr_epi8(
                        first, first, first, first, first, first, first, first,
                        second, second, second, second, second, second, second, second,
                    );
                    let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sub_scales, pick));
                    dots[b] = _mm256_madd_epi16(pairs, sc);
                }
            }
            let d = _mm256_set1_ps(super::avx2::f16x1(blk.add(208)));
            let dx = _mm256_loadu_ps(x.d.as_ptr().add(8 * sb));
            acc = _mm256_fmadd_ps(
                _mm256_mul_ps(d, dx),
                _mm256_cvtepi32_ps(lane_sums8(dots)),
                acc,
            );
        }
        hsum(acc)
    }
}

/// `out[r] = row r · x` for the `out.len()` rows of type `q` packed in `rows`: each row
/// must hold exactly `x.len()` values of the type and `x` one scale and one sum per 32
/// values (checked once for all rows; a panic on misuse, never an out-of-bounds read).
/// `q` must be one of [`super::q8::Q8_TYPES`]. The type is matched once and the row loop
/// runs inside the kernel's instruction set, so a row costs no call of its own: at 576
/// values a row is about a hundred nanoseconds of arithmetic.
pub fn dot_rows(_: Avx2, q: QType, rows: &[u8], row_bytes: usize, x: Q8Ref<'_>, out: &mut [f32]) {
    check_lengths(q, rows, row_bytes, x, out.len());
    // SAFETY: the token proves the features; the lengths were checked above, and each
    // kernel reads whole rows of `row_bytes` bytes and the activation.
    unsafe {
        match q {
            QType::Q4_0 => row_pairs(rows, row_bytes, x, out, |r, x| dot_q4_0(r, x)),
            QType::Q4_1 => row_pairs(rows, row_bytes, x, out, |r, x| dot_q4_1(r, x)),
            QType::Q5_0 => row_pairs(rows, row_bytes, x, out, |r, x| dot_q5_0(r, x)),
            QType::Q5_1 => row_pairs(rows, row_bytes, x, out, |r, x| dot_q5_1(r, x)),
            QType::Q8_0 => row_pairs(rows, row_bytes, x, out, |r, x| dot_q8_0(r, x)),
            QType::Q4_K => each_row(rows, row_bytes, x, out, |r, x| dot_q4_k(r, x)),
            QType::Q6_K => each_row(rows, row_bytes, x, out, |r, x| dot_q6_k(r, x)),
            QType::MXFP4 => each_row(rows, row_bytes, x, out, |r, x| dot_mxfp4(r, x)),
            QType::IQ4_NL => each_row(rows, row_bytes, x, out, |r, x| dot_iq4_nl(r, x)),
            // No AVX2 form yet: the portable integer dot.
            QType::IQ4_XS => {
                for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
                    *o = super::q8::dot_portable(q, row, x);
                }
            }
            _ => panic!("no q8 kernel for {q}"),
        }
    }
}

/// The row loop of [`dot_rows`] for the kernels that take two rows at a time: an odd last
/// row goes in as both (its second result dropped). Each pair's bytes are asked for a few
/// rows ahead.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn row_pairs(
    rows: &[u8],
    row_bytes: usize,
    x: Q8Ref<'_>,
    out: &mut [f32],
    kernel: impl Fn([&[u8]; 2], Q8Ref<'_>) -> [f32; 2],
) {
    let n = out.len();
    let row = |r: usize| &rows[r * row_bytes..(r + 1) * row_bytes];
    let mut r = 0;
    while r + 2 <= n {
        super::prefetch_ahead(rows, row_bytes, r);
        super::prefetch_ahead(rows, row_bytes, r + 1);
        let [a, b] = kernel([row(r), row(r + 1)], x);
        (out[r], out[r + 1]) = (a, b);
        r += 2;
    }
    if r < n {
        out[r] = kernel([row(r), row(r)], x)[0];
    }
}

/// The row loop of [`dot_rows`], each row's bytes asked for a few rows ahead.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn each_row(
    rows: &[u8],
    row_bytes: usize,
    x: Q8Ref<'_>,
    out: &mut [f32],
    kernel: impl Fn(&[u8], Q8Ref<'_>) -> f32,
) {
    for (i, (o, row)) in out.iter_mut().zip(rows.chunks_exact(row_bytes)).enumerate() {
        super::prefetch_ahead(rows, row_bytes, i);
        *o = kernel(row, x);
    }
}

/// The few-token loop of the 32-value types: `T` activations against one row, eight blocks
/// a step. Each block's weight bytes are decoded once (`weights`) and parked in a stack
/// copy; each token then takes its eight products (`product`: the eight i32 lane sums of a
/// block's weights with its activation bytes), gathers them into one vector
/// ([`lane_sums8`]) that meets the blocks' d·dx in one FMA, and adds the offset as
/// [`legacy_pair`] does. Blocks past the last eight go one at a time.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_tokens<const STRIDE: usize, const OFFSET: u8, const T: usize>(
    row: &[u8],
    xs: [Q8Ref<'_>; T],
    factor: f32,
    weights: impl Fn(*const u8) -> __m256i,
    product: impl Fn(__m256i, __m256i) -> __m256i,
) -> [f32; T] {
    // SAFETY: the caller guarantees the features, `xs[t].len() / 32` blocks of STRIDE
    // bytes in `row` for every t (all the same length) and one `d` and `s` per block of
    // each activation; every pointer stays inside them.
    unsafe {
        let nb = xs[0].len() / Q8_BLOCK;
        let p = row.as_ptr();
        let mut acc = [_mm256_setzero_ps(); T];
        let mut off = [_mm256_setzero_ps(); T];
        let mut w = [_mm256_setzero_si256(); 8];
        let mut b = 0;
        while b + 8 <= nb {
            let mut words = [0u32; 8];
            for k in 0..8 {
                let blk = p.add((b + k) * STRIDE);
                w[k] = weights(blk);
                words[k] = (blk as *const u32).read_unaligned();
            }
            let (d, m) = f16_pairs8(&words);
            let w = from_memory(w.as_ptr());
            for t in 0..T {
                let y = xs[t].qs.as_ptr().add(b * Q8_BLOCK);
                let mut dots = [_mm256_setzero_si256(); 8];
                for k in 0..8 {
                    let yv = _mm256_loadu_si256(y.add(k * Q8_BLOCK) as *const __m256i);
                    dots[k] = product(*w.add(k), yv);
                }
                let dx = _mm256_loadu_ps(xs[t].d.as_ptr().add(b));
                acc[t] = _mm256_fmadd_ps(
                    _mm256_mul_ps(d, dx),
                    _mm256_cvtepi32_ps(lane_sums8(dots)),
                    acc[t],
                );
                let s = _mm256_loadu_ps(xs[t].s.as_ptr().add(b));
                match OFFSET {
                    offset::SCALE => off[t] = _mm256_fmadd_ps(d, s, off[t]),
                    offset::MIN => off[t] = _mm256_fmadd_ps(m, s, off[t]),
                    _ => {}
                }
            }
            b += 8;
        }
        let mut out = [0.0f32; T];
        for t in 0..T {
            let total = match OFFSET {
                offset::SCALE => _mm256_fmadd_ps(_mm256_set1_ps(factor), off[t], acc[t]),
                offset::MIN => _mm256_add_ps(acc[t], off[t]),
                _ => acc[t],
            };
            out[t] = hsum(total);
        }
        while b < nb {
            let blk = p.add(b * STRIDE);
            let wb = weights(blk);
            let (d, m) = f16x2(blk);
            for t in 0..T {
                let yv = _mm256_loadu_si256(xs[t].qs.as_ptr().add(b * Q8_BLOCK) as *const __m256i);
                let dot = hsum(_mm256_cvtepi32_ps(product(wb, yv)));
                out[t] += d * xs[t].d[b] * dot;
                match OFFSET {
                    offset::SCALE => out[t] += factor * d * xs[t].s[b],
                    offset::MIN => out[t] += m * xs[t].s[b],
                    _ => {}
                }
            }
            b += 1;
        }
        out
    }
}

/// Unsigned weight bytes times activation bytes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn unsigned_product(w: __m256i, y: __m256i) -> __m256i {
    pair_sums(w, y)
}

/// Signed weight bytes times activation bytes (the sign moved onto the activation).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_product(w: __m256i, y: __m256i) -> __m256i {
    pair_sums(_mm256_abs_epi8(w), _mm256_sign_epi8(y, w))
}

/// Q4_K for `T` activations: each super-block's nibbles split once, then per token the
/// eight sub-blocks' dots, scales and mins as [`dot_q4_k`] takes them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q4_k_tokens<const T: usize>(row: &[u8], xs: [Q8Ref<'_>; T]) -> [f32; T] {
    // SAFETY: as for `dot_q4_k`, for every activation.
    unsafe {
        let p = row.as_ptr();
        let low = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut off = [_mm256_setzero_ps(); T];
        let mut w = [_mm256_setzero_si256(); 8];
        for sb in 0..xs[0].len() / 256 {
            let blk = p.add(sb * 144);
            let (d, dmin) = f16x2(blk);
            let (sc, mn) = k_scales_mins(blk.add(4));
            let (dsc, mins) = (
                _mm256_mul_ps(_mm256_set1_ps(d), sc),
                _mm256_mul_ps(_mm256_set1_ps(dmin), mn),
            );
            for j in 0..4 {
                let bytes = _mm256_loadu_si256(blk.add(16 + 32 * j) as *const __m256i);
                w[2 * j] = _mm256_and_si256(bytes, low);
                w[2 * j + 1] = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
            }
            let w = from_memory(w.as_ptr());
            for t in 0..T {
                let y = xs[t].qs.as_ptr().add(256 * sb);
                let mut dots = [_mm256_setzero_si256(); 8];
                for k in 0..8 {
                    let yv = _mm256_loadu_si256(y.add(32 * k) as *const __m256i);
                    dots[k] = pair_sums(*w.add(k), yv);
                }
                let dx = _mm256_loadu_ps(xs[t].d.as_ptr().add(8 * sb));
                acc[t] = _mm256_fmadd_ps(
                    _mm256_mul_ps(dsc, dx),
                    _mm256_cvtepi32_ps(lane_sums8(dots)),
                    acc[t],
                );
                let s = _mm256_loadu_ps(xs[t].s.as_ptr().add(8 * sb));
                off[t] = _mm256_fmadd_ps(mins, s, off[t]);
            }
        }
        let mut out = [0.0f32; T];
        for t in 0..T {
            out[t] = hsum(_mm256_sub_ps(acc[t], off[t]));
        }
        out
    }
}

/// Q6_K for `T` activations: each super-block's quants assembled once (and its sub-block
/// scales spread once), then per token the eight blocks' scaled dots as [`dot_q6_k`] takes
/// them.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_tokens<const T: usize>(row: &[u8], xs: [Q8Ref<'_>; T]) -> [f32; T] {
    // SAFETY: as for `dot_q6_k`, for every activation.
    unsafe {
        let p = row.as_ptr();
        let (low4, low2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03));
        let thirty_two = _mm256_set1_epi8(32);
        let mut acc = [_mm256_setzero_ps(); T];
        let mut quants = [_mm256_setzero_si256(); 8];
        let mut scales = [_mm256_setzero_si256(); 8];
        for sb in 0..xs[0].len() / 256 {
            let blk = p.add(sb * 210);
            let sub_scales = _mm_loadu_si128(blk.add(192) as *const __m128i);
            for half in 0..2 {
                let ql0 = _mm256_loadu_si256(blk.add(64 * half) as *const __m256i);
                let ql1 = _mm256_loadu_si256(blk.add(64 * half + 32) as *const __m256i);
                let qh = _mm256_loadu_si256(blk.add(128 + 32 * half) as *const __m256i);
                let top = |bits: __m256i| _mm256_slli_epi16(_mm256_and_si256(bits, low2), 4);
                let q = [
                    _mm256_or_si256(_mm256_and_si256(ql0, low4), top(qh)),
                    _mm256_or_si256(_mm256_and_si256(ql1, low4), top(_mm256_srli_epi16(qh, 2))),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql0, 4), low4),
                        top(_mm256_srli_epi16(qh, 4)),
                    ),
                    _mm256_or_si256(
                        _mm256_and_si256(_mm256_srli_epi16(ql1, 4), low4),
                        top(_mm256_srli_epi16(qh, 6)),
                    ),
                ];
                for (k, q) in q.into_iter().enumerate() {
                    let b = 4 * half + k;
                    quants[b] = q;
                    let first = (8 * half + 2 * k) as i8;
                    let second = first + 1;
                    #[rustfmt::skip]
                    let pick = _mm_setr_epi8(
                        first, first, first, first, first, first, first, first,
                        second, second, second, second, second, second, second, second,
                    );
                    scales[b] = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sub_scales, pick));
                }
            }
            let (q, sc) = (from_memory(quants.as_ptr()), from_memory(scales.as_ptr()));
            let d = _mm256_set1_ps(super::avx2::f16x1(blk.add(208)));
            for t in 0..T {
                let y = xs[t].qs.as_ptr().add(256 * sb);
                let mut dots = [_mm256_setzero_si256(); 8];
                for b in 0..8 {
                    let yv = _mm256_loadu_si256(y.add(32 * b) as *const __m256i);
                    let pairs = _mm256_sub_epi16(
                        _mm256_maddubs_epi16(*q.add(b), yv),
                        _mm256_maddubs_epi16(thirty_two, yv),
                    );
                    dots[b] = _mm256_madd_epi16(pairs, *sc.add(b));
                }
                let dx = _mm256_loadu_ps(xs[t].d.as_ptr().add(8 * sb));
                acc[t] = _mm256_fmadd_ps(
                    _mm256_mul_ps(d, dx),
                    _mm256_cvtepi32_ps(lane_sums8(dots)),
                    acc[t],
                );
            }
        }
        let mut out = [0.0f32; T];
        for t in 0..T {
            out[t] = hsum(acc[t]);
        }
        out
    }
}

/// `outs[t][r] = row r · xs[t]` for two to four activations (`xs.len()` must be one of
/// them) and the rows of type `q` packed in `rows`, each row's weights decoded once for all
/// of them, when `q` has such a kernel; `false` (nothing written) when it has not. Lengths
/// as for [`dot_rows`] (checked here for every activation).
pub fn dot_rows_tokens(
    _: Avx2,
    q: QType,
    rows: &[u8],
    row_bytes: usize,
    xs: &[Q8Ref<'_>],
    outs: &mut [&mut [f32]],
) -> bool {
    if !matches!(
        q,
        QType::Q4_0
            | QType::Q4_1
            | QType::Q5_0
            | QType::Q5_1
            | QType::Q8_0
            | QType::Q4_K
            | QType::Q6_K
    ) {
        return false;
    }
    assert!(
        (2..=4).contains(&xs.len()) && outs.len() == xs.len(),
        "q8 dot_rows_tokens: {} activations for {} outputs",
        xs.len(),
        outs.len()
    );
    let n = outs[0].len();
    for (x, out) in xs.iter().zip(outs.iter()) {
        check_lengths(q, rows, row_bytes, *x, n);
        assert_eq!(
            out.len(),
            n,
            "q8 dot_rows_tokens: outputs of different lengths"
        );
    }
    // SAFETY: the token proves the features; the lengths were checked above.
    unsafe {
        match *xs {
            [a, b] => tokens_rows(q, rows, row_bytes, [a, b], outs),
            [a, b, c] => tokens_rows(q, rows, row_bytes, [a, b, c], outs),
            [a, b, c, d] => tokens_rows(q, rows, row_bytes, [a, b, c, d], outs),
            _ => unreachable!("two to four activations (checked above)"),
        }
    }
    true
}

/// The row loop of [`dot_rows_tokens`] for `T` activations, each row's bytes asked for
/// a few rows ahead.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tokens_rows<const T: usize>(
    q: QType,
    rows: &[u8],
    row_bytes: usize,
    xs: [Q8Ref<'_>; T],
    outs: &mut [&mut [f32]],
) {
    let each = |outs: &mut [&mut [f32]], kernel: &dyn Fn(&[u8]) -> [f32; T]| {
        for r in 0..outs[0].len() {
            super::prefetch_ahead(rows, row_bytes, r);
            let sums = kernel(&rows[r * row_bytes..(r + 1) * row_bytes]);
            for (out, s) in outs.iter_mut().zip(sums) {
                out[r] = s;
            }
        }
    };
    // SAFETY: every kernel called in the closures below gets whole rows of `row_bytes`
    // bytes, against which the caller checked every activation; the features are its promise.
    unsafe {
        match q {
            QType::Q4_0 => each(outs, &|r| {
                legacy_tokens::<18, { offset::SCALE }, T>(
                    r,
                    xs,
                    -8.0,
                    |b| nibbles32(b.add(2)),
                    |w, y| unsigned_product(w, y),
                )
            }),
            QType::Q4_1 => each(outs, &|r| {
                legacy_tokens::<20, { offset::MIN }, T>(
                    r,
                    xs,
                    1.0,
                    |b| nibbles32(b.add(4)),
                    |w, y| unsigned_product(w, y),
                )
            }),
            QType::Q5_0 => each(outs, &|r| {
                legacy_tokens::<22, { offset::SCALE }, T>(
                    r,
                    xs,
                    -16.0,
                    |b| {
                        let bits = (b.add(2) as *const u32).read_unaligned().to_le();
                        _mm256_or_si256(nibbles32(b.add(6)), fifth_bits32(bits))
                    },
                    |w, y| unsigned_product(w, y),
                )
            }),
            QType::Q5_1 => each(outs, &|r| {
                legacy_tokens::<24, { offset::MIN }, T>(
                    r,
                    xs,
                    1.0,
                    |b| {
                        let bits = (b.add(4) as *const u32).read_unaligned().to_le();
                        _mm256_or_si256(nibbles32(b.add(8)), fifth_bits32(bits))
                    },
                    |w, y| unsigned_product(w, y),
                )
            }),
            QType::Q8_0 => each(outs, &|r| {
                legacy_tokens::<34, { offset::NONE }, T>(
                    r,
                    xs,
                    0.0,
                    |b| _mm256_loadu_si256(b.add(2) as *const __m256i),
                    |w, y| signed_product(w, y),
                )
            }),
            QType::Q4_K => each(outs, &|r| q4_k_tokens::<T>(r, xs)),
            QType::Q6_K => each(outs, &|r| q6_k_tokens::<T>(r, xs)),
            _ => unreachable!("{q}: dot_rows_tokens checked the type"),
        }
    }
}
