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

use kiln_core::QType;

use super::avx2::{block_headers8, f16x2, from_memory, hsum, k_scales_mins, Avx2};
use super::q8::{Q8Ref, Q8_BLOCK};

/// Σ w·y of 32 unsigned weight bytes and 32 signed activation bytes, as eight lane sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn pair_sums(w: __m256i, y: __m256i) -> __m256 {
    let pairs = _mm256_maddubs_epi16(w, y);
    _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, _mm256_set1_epi16(1)))
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

/// How a legacy block's head enters the sum beside its scaled dot (see [`legacy_blocks`]).
mod offset {
    /// `factor · d · s` (Q4_0: −8, Q5_0: −16).
    pub const SCALE: u8 = 0;
    /// `m · s`, m the head's second f16 (Q4_1, Q5_1).
    pub const MIN: u8 = 1;
    /// Nothing (Q8_0).
    pub const NONE: u8 = 2;
}

/// The loop of the 32-value types: Σ_b d_b·dx_b·`block`(b) plus the offsets [`offset`]
/// names. `block` gives the eight lane sums of block b's weight bytes times its activation
/// bytes. The heads come eight blocks at a time ([`block_headers8`]) and their scales
/// times the activation's are parked in memory for broadcasts; four accumulators keep the
/// FMAs from waiting on one another.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn legacy_blocks<const STRIDE: usize, const OFFSET: u8>(
    row: &[u8],
    x: Q8Ref<'_>,
    factor: f32,
    block: impl Fn(*const u8, *const i8) -> __m256,
) -> f32 {
    // SAFETY: the caller guarantees the features and `x.len() / 32` blocks of STRIDE bytes
    // in `row`, with `x.d` and `x.s` one value per block; every pointer stays inside them.
    unsafe {
        let nb = x.len() / Q8_BLOCK;
        let (p, y) = (row.as_ptr(), x.qs.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut off = _mm256_setzero_ps();
        let mut scales = [0.0f32; 8];
        let mut b = 0;
        while b + 8 <= nb {
            let (d, m) = block_headers8(p.add(b * STRIDE), STRIDE);
            let dx = _mm256_loadu_ps(x.d.as_ptr().add(b));
            _mm256_storeu_ps(scales.as_mut_ptr(), _mm256_mul_ps(d, dx));
            match OFFSET {
                offset::SCALE => {
                    off = _mm256_fmadd_ps(d, _mm256_loadu_ps(x.s.as_ptr().add(b)), off)
                }
                offset::MIN => off = _mm256_fmadd_ps(m, _mm256_loadu_ps(x.s.as_ptr().add(b)), off),
                _ => {}
            }
            let sp = from_memory(scales.as_ptr());
            for k in 0..8 {
                let v = block(p.add((b + k) * STRIDE), y.add((b + k) * Q8_BLOCK));
                acc[k % 4] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*sp.add(k)), v, acc[k % 4]);
            }
            b += 8;
        }
        let mut tail = 0.0;
        while b < nb {
            let (d, m) = f16x2(p.add(b * STRIDE));
            let v = hsum(block(p.add(b * STRIDE), y.add(b * Q8_BLOCK)));
            tail += d * x.d[b] * v;
            match OFFSET {
                offset::SCALE => tail += factor * d * x.s[b],
                offset::MIN => tail += m * x.s[b],
                _ => {}
            }
            b += 1;
        }
        let sum = _mm256_add_ps(_mm256_add_ps(acc[0], acc[1]), _mm256_add_ps(acc[2], acc[3]));
        let off = match OFFSET {
            offset::SCALE => factor * hsum(off),
            offset::MIN => hsum(off),
            _ => 0.0,
        };
        hsum(sum) + off + tail
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_0(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: the caller guarantees the features and the lengths; a block's quants are its
    // 16 bytes from byte 2, its activation 32 bytes at `y`.
    unsafe {
        legacy_blocks::<18, { offset::SCALE }>(row, x, -8.0, |b, y| {
            pair_sums(nibbles32(b.add(2)), _mm256_loadu_si256(y as *const __m256i))
        })
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_1(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: as for `dot_q4_0`; Q4_1's quants start at byte 4.
    unsafe {
        legacy_blocks::<20, { offset::MIN }>(row, x, 1.0, |b, y| {
            pair_sums(nibbles32(b.add(4)), _mm256_loadu_si256(y as *const __m256i))
        })
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_0(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: as for `dot_q4_0`; Q5_0's fifth bits are the four bytes at 2, its nibbles
    // the 16 at 6.
    unsafe {
        legacy_blocks::<22, { offset::SCALE }>(row, x, -16.0, |b, y| {
            let bits = (b.add(2) as *const u32).read_unaligned().to_le();
            let w = _mm256_or_si256(nibbles32(b.add(6)), fifth_bits32(bits));
            pair_sums(w, _mm256_loadu_si256(y as *const __m256i))
        })
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_1(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: as for `dot_q5_0`, two bytes further on (Q5_1's head holds d and m).
    unsafe {
        legacy_blocks::<24, { offset::MIN }>(row, x, 1.0, |b, y| {
            let bits = (b.add(4) as *const u32).read_unaligned().to_le();
            let w = _mm256_or_si256(nibbles32(b.add(8)), fifth_bits32(bits));
            pair_sums(w, _mm256_loadu_si256(y as *const __m256i))
        })
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: as for `dot_q4_0`; Q8_0's 32 signed quants start at byte 2.
    unsafe {
        legacy_blocks::<34, { offset::NONE }>(row, x, 0.0, |b, y| {
            let w = _mm256_loadu_si256(b.add(2) as *const __m256i);
            let y = _mm256_loadu_si256(y as *const __m256i);
            pair_sums(_mm256_abs_epi8(w), _mm256_sign_epi8(y, w))
        })
    }
}

/// Q4_K: per 256-value super-block, eight 32-value sub-blocks, each d·scale_j·dx_j times
/// its nibbles' dot, minus dmin·min_j·s_j (the activation blocks line up with the
/// sub-blocks). The 32 bytes of each 64-value run hold one sub-block in their low nibbles
/// and the next in their high ones.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: the caller guarantees the features, `x.len() / 256` blocks of 144 bytes in
    // `row` and one `d`/`s` per 32 values of `x`; every pointer stays inside them.
    unsafe {
        let (p, y) = (row.as_ptr(), x.qs.as_ptr());
        let low = _mm256_set1_epi8(0x0F);
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut off = _mm256_setzero_ps();
        let mut scales = [0.0f32; 8];
        for sb in 0..x.len() / 256 {
            let blk = p.add(sb * 144);
            let (d, dmin) = f16x2(blk);
            let (sc, mn) = k_scales_mins(blk.add(4));
            let dx = _mm256_loadu_ps(x.d.as_ptr().add(8 * sb));
            let s = _mm256_loadu_ps(x.s.as_ptr().add(8 * sb));
            let dsc = _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(d), sc), dx);
            _mm256_storeu_ps(scales.as_mut_ptr(), dsc);
            off = _mm256_fmadd_ps(_mm256_mul_ps(_mm256_set1_ps(dmin), mn), s, off);
            let sp = from_memory(scales.as_ptr());
            for j in 0..4 {
                let bytes = _mm256_loadu_si256(blk.add(16 + 32 * j) as *const __m256i);
                let lo = _mm256_and_si256(bytes, low);
                let hi = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low);
                let ys = y.add(256 * sb + 64 * j);
                let y0 = _mm256_loadu_si256(ys as *const __m256i);
                let y1 = _mm256_loadu_si256(ys.add(32) as *const __m256i);
                acc[0] = _mm256_fmadd_ps(
                    _mm256_broadcast_ss(&*sp.add(2 * j)),
                    pair_sums(lo, y0),
                    acc[0],
                );
                acc[1] = _mm256_fmadd_ps(
                    _mm256_broadcast_ss(&*sp.add(2 * j + 1)),
                    pair_sums(hi, y1),
                    acc[1],
                );
            }
        }
        hsum(_mm256_add_ps(acc[0], acc[1])) - hsum(off)
    }
}

/// Q6_K: per 256-value super-block, its 6-bit quants assembled 32 at a time from the low
/// and high bit arrays (ggml's order: see [`super::q8::dot_portable`]), each 32 values one
/// activation block and two 16-value sub-blocks with i8 scales. The −32 offset is taken
/// off the pair sums (32·(y + y′) from a second `vpmaddubsw`), the sub-block scales applied
/// by `vpmaddwd`, and d·dx per activation block in f32.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k(row: &[u8], x: Q8Ref<'_>) -> f32 {
    // SAFETY: the caller guarantees the features, `x.len() / 256` blocks of 210 bytes in
    // `row` and one `d` per 32 values of `x`; every pointer stays inside them.
    unsafe {
        let (p, y) = (row.as_ptr(), x.qs.as_ptr());
        let (low4, low2) = (_mm256_set1_epi8(0x0F), _mm256_set1_epi8(0x03));
        let thirty_two = _mm256_set1_epi8(32);
        let mut acc = [_mm256_setzero_ps(); 2];
        let mut scales = [0.0f32; 8];
        for sb in 0..x.len() / 256 {
            let blk = p.add(sb * 210);
            let d = _mm256_set1_ps(super::avx2::f16x1(blk.add(208)));
            let dx = _mm256_loadu_ps(x.d.as_ptr().add(8 * sb));
            _mm256_storeu_ps(scales.as_mut_ptr(), _mm256_mul_ps(d, dx));
            let sp = from_memory(scales.as_ptr());
            let sub_scales = _mm_loadu_si128(blk.add(192) as *const __m128i);
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
                    let pick = _mm_setr_epi8(
                        first,
                        first,
                        first,
                        first,
                        first,
                        first,
                        first,
                        first,
                        first + 1,
                        first + 1,
                        first + 1,
                        first + 1,
                        first + 1,
                        first + 1,
                        first + 1,
                        first + 1,
                    );
                    let sc = _mm256_cvtepi8_epi16(_mm_shuffle_epi8(sub_scales, pick));
                    let v = _mm256_cvtepi32_ps(_mm256_madd_epi16(pairs, sc));
                    acc[k % 2] = _mm256_fmadd_ps(_mm256_broadcast_ss(&*sp.add(b)), v, acc[k % 2]);
                }
            }
        }
        hsum(_mm256_add_ps(acc[0], acc[1]))
    }
}

/// One row of type `q` against `x`: the row must hold exactly `x.len()` values of the type
/// and `x` one scale and one sum per 32 values (checked; a panic on misuse, never an
/// out-of-bounds read). `q` must be one of [`super::q8::Q8_TYPES`].
pub fn dot(_: Avx2, q: QType, row: &[u8], x: Q8Ref<'_>) -> f32 {
    assert!(
        x.len().is_multiple_of(q.block_len())
            && row.len() == x.len() / q.block_len() * q.block_bytes()
            && x.d.len() * Q8_BLOCK == x.len()
            && x.s.len() == x.d.len(),
        "q8 dot ({q}): a row of {} bytes for {} values",
        row.len(),
        x.len()
    );
    // SAFETY: the token proves the features; the lengths were checked above.
    unsafe {
        match q {
            QType::Q4_0 => dot_q4_0(row, x),
            QType::Q4_1 => dot_q4_1(row, x),
            QType::Q5_0 => dot_q5_0(row, x),
            QType::Q5_1 => dot_q5_1(row, x),
            QType::Q8_0 => dot_q8_0(row, x),
            QType::Q4_K => dot_q4_k(row, x),
            QType::Q6_K => dot_q6_k(row, x),
            _ => panic!("no q8 kernel for {q}"),
        }
    }
}
