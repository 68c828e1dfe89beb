//! AVX2 + FMA + F16C fused dequantise-and-dot kernels for the types real models spend
//! their bytes on. Each keeps f32 activations: quantised values are widened to f32 and
//! multiplied with FMA. Offsets (Q4_0's −8·d, Q5_0's −16·d, `+m`, `−dmin·m`) are folded in
//! through the activation's 32-value block sums, so the inner loop is pure widen-and-FMA.
//!
//! Every function here requires AVX2, FMA and F16C (callers check at run time) and a row
//! holding exactly `x.len()` values of its type.

use std::arch::x86_64::*;

use super::avx2_groups as groups;

use kiln_core::quant::{iquant_grids, iquants, mxfp4};

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn hsum(v: __m256) -> f32 {
    let s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    let s = _mm_add_ss(s, _mm_movehdup_ps(s));
    _mm_cvtss_f32(s)
}

/// Two consecutive f16 values at `p`, as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16x2(p: *const u8) -> (f32, f32) {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let v = _mm_cvtph_ps(_mm_cvtsi32_si128((p as *const i32).read_unaligned()));
        (_mm_cvtss_f32(v), _mm_cvtss_f32(_mm_movehdup_ps(v)))
    }
}

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16x1(p: *const u8) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            (p as *const u16).read_unaligned() as i32,
        )))
    }
}

/// The f16 at `p`, as f32 in all eight lanes. Broadcast as a half and converted as a
/// vector: converting one lane ([`f16x1`]) and broadcasting that lets the compiler insert
/// into a register of its choice, and when it picks a loop's accumulator every block waits
/// for the previous block's FMA (seen: Q8_0 and Q4_0 at half speed). Per-block scales use
/// this one.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn f16_splat(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees the features and two readable bytes at `p`.
    unsafe { _mm256_cvtph_ps(_mm_set1_epi16((p as *const u16).read_unaligned() as i16)) }
}

/// The eight bytes at `p` widened to 32-bit lanes and split into their nibbles, as f32:
/// lane j of the first vector holds byte j's low nibble, of the second its high nibble.
/// The 4-bit block types keep value i in one nibble and value i + 16 (Q4_0, Q4_1) or
/// i + 32 (Q4_K) in the other, so the two vectors meet two different eight-value runs of
/// the activation: no shuffle reorders anything, and the widening reads memory directly.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles8(p: *const u8) -> (__m256, __m256) {
    // SAFETY: the caller guarantees the features and eight readable bytes at `p`.
    unsafe {
        let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i));
        (
            _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(0x0F))),
            _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4)),
        )
    }
}

/// Σ q·x over a 32-value block of unsigned nibbles (16 bytes at `qs`: value i in the low
/// nibble of byte i, value 16 + i in its high nibble) and `x[0..32]`, as eight lane sums.
/// Two independent chains, so one block's multiplies need not wait for each other.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_block(qs: *const u8, x: *const f32) -> __m256 {
    // SAFETY: the caller guarantees the features, 16 bytes at `qs` and 32 values at `x`.
    unsafe {
        let (lo0, hi0) = nibbles8(qs);
        let (lo1, hi1) = nibbles8(qs.add(8));
        nibble_block_sums([lo0, hi0, lo1, hi1], x)
    }
}

/// The sums of [`nibble_block`] from its four nibble vectors (values 0..8, 16..24, 8..16,
/// 24..32).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibble_block_sums([lo0, hi0, lo1, hi1]: [__m256; 4], x: *const f32) -> __m256 {
    // SAFETY: the caller guarantees the features and 32 values at `x`.
    unsafe {
        let s = _mm256_mul_ps(lo0, _mm256_loadu_ps(x));
        let t = _mm256_mul_ps(lo1, _mm256_loadu_ps(x.add(8)));
        let s = _mm256_fmadd_ps(hi0, _mm256_loadu_ps(x.add(16)), s);
        let t = _mm256_fmadd_ps(hi1, _mm256_loadu_ps(x.add(24)), t);
        _mm256_add_ps(s, t)
    }
}

/// [`nibble_block`] for an APR Q4 block (value i in byte i / 2, low nibble for even i):
/// the same four vectors of values, so the same sums bit for bit. One in-lane byte
/// shuffle gathers, into 32-bit lane k, the bytes holding values k, 8 + k, 16 + k and
/// 24 + k; one variable shift brings the odd lanes' high nibbles down.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn apr_nibble_block(qs: *const u8, x: *const f32) -> __m256 {
    // SAFETY: the caller guarantees the features, 16 bytes at `qs` and 32 values at `x`.
    unsafe {
        let both = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
        // Lane k (k = 0..8; lanes 4..8 in the upper half): bytes k/2, 4 + k/2, 8 + k/2,
        // 12 + k/2.
        let gather = _mm256_setr_epi8(
            0, 4, 8, 12, 0, 4, 8, 12, 1, 5, 9, 13, 1, 5, 9, 13, //
            2, 6, 10, 14, 2, 6, 10, 14, 3, 7, 11, 15, 3, 7, 11, 15,
        );
        let u = _mm256_srlv_epi32(
            _mm256_shuffle_epi8(both, gather),
            _mm256_setr_epi32(0, 4, 0, 4, 0, 4, 0, 4),
        );
        let low = _mm256_set1_epi32(0x0F);
        let v0 = _mm256_and_si256(u, low);
        let v8 = _mm256_and_si256(_mm256_srli_epi32(u, 8), low);
        let v16 = _mm256_and_si256(_mm256_srli_epi32(u, 16), low);
        let v24 = _mm256_and_si256(_mm256_srli_epi32(u, 24), low);
        // Values 0..8, 16..24, 8..16, 24..32, as `nibble_block` has them.
        nibble_block_sums([v0, v16, v8, v24].map(|v| _mm256_cvtepi32_ps(v)), x)
    }
}

/// The first four bytes (two f16: `d`, then `m` or the first quants) of eight consecutive
/// blocks `stride` bytes apart from `p`, as two f32 vectors, lane j from block j: one
/// conversion for eight blocks (the compiler gathers the words with `vpinsrd`, about one
/// instruction a block), where a broadcast and conversion per block took two or three
/// instructions from the vector arithmetic the row dot is bound by (a fifth of a Q4_1
/// block's).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn block_headers8(p: *const u8, stride: usize) -> (__m256, __m256) {
    // SAFETY: the caller guarantees the features and four readable bytes at `p + j·stride`
    // for j in 0..8.
    unsafe {
        let mut words = [0u32; 8];
        for (j, w) in words.iter_mut().enumerate() {
            *w = (p.add(j * stride) as *const u32).read_unaligned();
        }
        f16_pairs8(&words)
    }
}

/// Eight words of two f16 each (`d`, then `m` or anything) as two f32 vectors, lane j
/// from word j: the conversion behind [`block_headers8`].
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn f16_pairs8(words: &[u32; 8]) -> (__m256, __m256) {
    let low_halves_first = _mm_setr_epi8(0, 1, 4, 5, 8, 9, 12, 13, 2, 3, 6, 7, 10, 11, 14, 15);
    // SAFETY: both loads read four of the eight words.
    let (a, b) = unsafe {
        (
            _mm_loadu_si128(words.as_ptr() as *const __m128i),
            _mm_loadu_si128(words.as_ptr().add(4) as *const __m128i),
        )
    };
    let a = _mm_shuffle_epi8(a, low_halves_first);
    let b = _mm_shuffle_epi8(b, low_halves_first);
    (
        _mm256_cvtph_ps(_mm_unpacklo_epi64(a, b)),
        _mm256_cvtph_ps(_mm_unpackhi_epi64(a, b)),
    )
}

/// `p`, laundered so the compiler must read what it points at from memory. The kernels
/// park per-block scales (and Q6_K's assembled quants) in small stack arrays so that the
/// loops read them with broadcast and widening loads, which take load slots only; seeing
/// through the array, the compiler would keep the values in registers and spread them
/// with shuffles instead, on the one port those kernels are short of.
#[inline(always)]
pub(super) fn from_memory<T>(p: *const T) -> *const T {
    std::hint::black_box(p)
}

/// Eight unsigned bytes at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn u8x8(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees the features and eight readable bytes at `p`.
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
}

/// Eight signed bytes at `p` as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn i8x8(p: *const u8) -> __m256 {
    // SAFETY: the caller guarantees the features and eight readable bytes at `p`.
    unsafe { _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i))) }
}

/// The eight 6-bit scales and eight 6-bit mins of a Q4_K or Q5_K super-block (the 12 bytes
/// at `q`), as f32: sub-block j's scale is the low 6 bits of byte j (j < 4) or the low
/// nibble of byte j + 4 with the top 2 bits of byte j − 4 above it; its min likewise from
/// bytes j + 4, the high nibble of byte j + 4 and the top bits of byte j. Unpacked four
/// bytes at a time instead of per sub-block.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k_scales_mins(q: *const u8) -> (__m256, __m256) {
    // SAFETY: the caller guarantees the features and 12 readable bytes at `q`.
    unsafe {
        const LOW6: u32 = 0x3f3f_3f3f;
        const LOW4: u32 = 0x0f0f_0f0f;
        const LOW2: u32 = 0x0303_0303;
        let words = q as *const u32;
        let (u0, u1, u2) = (
            words.read_unaligned().to_le(),
            words.add(1).read_unaligned().to_le(),
            words.add(2).read_unaligned().to_le(),
        );
        let scales_lo = u0 & LOW6;
        let scales_hi = (u2 & LOW4) | (((u0 >> 6) & LOW2) << 4);
        let mins_lo = u1 & LOW6;
        let mins_hi = ((u2 >> 4) & LOW4) | (((u1 >> 6) & LOW2) << 4);
        let scales = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(
            0,
            0,
            scales_hi as i32,
            scales_lo as i32,
        )));
        let mins = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_set_epi32(
            0,
            0,
            mins_hi as i32,
            mins_lo as i32,
        )));
        (scales, mins)
    }
}

/// Bit `i` of the 16 bits in `bits` as byte `i`: 0x10 where the bit is set, 0 where not.
/// That is the fifth bit of a Q5 quant, ready to OR onto its low nibble.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) fn fifth_bits16(bits: u32) -> __m128i {
    // Byte 0 of `bits` to lanes 0..8, byte 1 to lanes 8..16; lane i then tests bit i % 8.
    let spread = _mm_shuffle_epi8(
        _mm_cvtsi32_si128(bits as i32),
        _mm_setr_epi8(0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1),
    );
    let lane_bit = _mm_set1_epi64x(0x8040_2010_0804_0201u64 as i64);
    let set = _mm_cmpeq_epi8(_mm_and_si128(spread, lane_bit), lane_bit);
    _mm_and_si128(set, _mm_set1_epi8(0x10))
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f32_unchecked(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(
                _mm256_loadu_ps(pa.add(i + 8)),
                _mm256_loadu_ps(pb.add(i + 8)),
                acc1,
            );
            i += 16;
        }
        if i + 8 <= n {
            acc0 = _mm256_fmadd_ps(_mm256_loadu_ps(pa.add(i)), _mm256_loadu_ps(pb.add(i)), acc0);
            i += 8;
        }
        let mut sum = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            sum += a[i] * b[i];
            i += 1;
        }
        sum
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_f16_unchecked(row: &[u8], x: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let n = x.len().min(row.len() / 2);
        let (pr, px) = (row.as_ptr(), x.as_ptr());
        let mut acc0 = _mm256_setzero_ps();
        let mut acc1 = _mm256_setzero_ps();
        let mut i = 0;
        while i + 16 <= n {
            let w0 = _mm256_cvtph_ps(_mm_loadu_si128(pr.add(2 * i) as *const __m128i));
            let w1 = _mm256_cvtph_ps(_mm_loadu_si128(pr.add(2 * i + 16) as *const __m128i));
            acc0 = _mm256_fmadd_ps(w0, _mm256_loadu_ps(px.add(i)), acc0);
            acc1 = _mm256_fmadd_ps(w1, _mm256_loadu_ps(px.add(i + 8)), acc1);
            i += 16;
        }
        let mut sum = hsum(_mm256_add_ps(acc0, acc1));
        while i < n {
            sum += f16x1(pr.add(2 * i)) * x[i];
            i += 1;
        }
        sum
    }
}

/// Which f16 of a block's head multiplies the activation's block sum in [`offset_blocks`]
/// (and in the 8-bit kernels' `legacy_pair`).
pub(super) mod offset {
    /// The scale d itself (Q4_0's −8·d, Q5_0's −16·d).
    pub const SCALE: u8 = 0;
    /// The second f16, the min m (Q4_1, Q5_1).
    pub const MIN: u8 = 1;
    /// None: no offset, and `sums` is not read (Q8_0).
    pub const NONE: u8 = 2;
}

/// The loop of the 32-value block types: (Σ_b d_b·`block`(b), Σ_b o_b·s_b), where d_b is
/// block b's first f16, o_b the head value `OFFSET` names ([`offset`]), s_b the
/// activation's sum over the block, and `block` the eight lane sums of its quants (at byte
/// `QS` of the block) with the activation. The heads are read eight blocks at a time
/// ([`block_headers8`]), the offsets added with one FMA per eight.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn offset_blocks<const STRIDE: usize, const QS: usize, const OFFSET: u8>(
    row: &[u8],
    x: &[f32],
    sums: &[f32],
    block: impl Fn(*const u8, *const f32) -> __m256,
) -> (f32, f32) {
    // SAFETY: the caller guarantees the features, `x.len() / 32` blocks of STRIDE bytes in
    // `row` (each at least four bytes) and, unless OFFSET is NONE, one sum per block in
    // `sums`.
    unsafe {
        let nb = x.len() / 32;
        let (p, px, ps) = (row.as_ptr(), x.as_ptr(), sums.as_ptr());
        let mut acc = _mm256_setzero_ps();
        let mut offset = _mm256_setzero_ps();
        let mut scales = [0.0f32; 8];
        let mut b = 0;
        while b + 8 <= nb {
            let (d, second) = block_headers8(p.add(b * STRIDE), STRIDE);
            _mm256_storeu_ps(scales.as_mut_ptr(), d);
            if OFFSET != offset::NONE {
                let o = if OFFSET == offset::SCALE { d } else { second };
                offset = _mm256_fmadd_ps(o, _mm256_loadu_ps(ps.add(b)), offset);
            }
            let scales = from_memory(scales.as_ptr());
            for j in 0..8 {
                let dj = _mm256_broadcast_ss(&*scales.add(j));
                let s = block(p.add((b + j) * STRIDE + QS), px.add((b + j) * 32));
                acc = _mm256_fmadd_ps(dj, s, acc);
            }
            b += 8;
        }
        let mut tail = 0.0f32;
        for b in b..nb {
            // Both halves of the head: the second is only used as the min.
            let (d, second) = f16x2(p.add(b * STRIDE));
            let s = block(p.add(b * STRIDE + QS), px.add(b * 32));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
            if OFFSET != offset::NONE {
                tail += if OFFSET == offset::SCALE { d } else { second } * *ps.add(b);
            }
        }
        (hsum(acc), hsum(offset) + tail)
    }
}

/// Q4_0: Σ over 18-byte blocks of d·(q − 8)·x, computed as Σ d·(q·x) − 8·Σ d·(block sum
/// of x): the −8 costs one multiply per eight blocks instead of one subtraction per value.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_0_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller keeps `offset_blocks`'s contract (checked by the safe wrapper).
    let (dot, d_sums) = unsafe {
        offset_blocks::<18, 2, { offset::SCALE }>(row, x, sums, |q, x| nibble_block(q, x))
    };
    dot - 8.0 * d_sums
}

/// APR Q4: Q4_0's fields and arithmetic with value `i` in byte `i / 2`, low nibble for even
/// `i`. Its nibbles are gathered into the same vectors ([`apr_nibble_block`]), so it gives
/// Q4_0's sums bit for bit.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_apr_q4_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller keeps `offset_blocks`'s contract (checked by the safe wrapper).
    let (dot, d_sums) = unsafe {
        offset_blocks::<18, 2, { offset::SCALE }>(row, x, sums, |q, x| apr_nibble_block(q, x))
    };
    dot - 8.0 * d_sums
}

/// Q4_1: Σ over 20-byte blocks of (d·q + m)·x = d·Σ q·x + m·(block sum of x).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_1_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller keeps `offset_blocks`'s contract (checked by the safe wrapper).
    let (dot, m_sums) =
        unsafe { offset_blocks::<20, 4, { offset::MIN }>(row, x, sums, |q, x| nibble_block(q, x)) };
    dot + m_sums
}

/// Σ q·x over a Q5_0/Q5_1 block's 5-bit quants (`q`: the block's `qh` word, then its 16
/// nibble bytes) and `x[0..32]`, as eight lane sums: the quants assembled in value order
/// as 32 bytes (fifth bits spread onto bit 4), parked on the stack and widened from there.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_block(q: *const u8, x: *const f32) -> __m256 {
    // SAFETY: the caller guarantees the features, 20 bytes at `q` and 32 values at `x`.
    unsafe {
        let qh = (q as *const u32).read_unaligned().to_le();
        let qs = _mm_loadu_si128(q.add(4) as *const __m128i);
        let low4 = _mm_set1_epi8(0x0F);
        let values = [
            _mm_or_si128(_mm_and_si128(qs, low4), fifth_bits16(qh)),
            _mm_or_si128(
                _mm_and_si128(_mm_srli_epi16(qs, 4), low4),
                fifth_bits16(qh >> 16),
            ),
        ];
        byte_block::<false>(from_memory(values.as_ptr()) as *const u8, x)
    }
}

/// Q5_0: Σ over 22-byte blocks (d, qh, qs) of d·(q − 16)·x = Σ d·(q·x) − 16·Σ d·(block
/// sum of x).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_0_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller keeps `offset_blocks`'s contract (checked by the safe wrapper).
    let (dot, d_sums) =
        unsafe { offset_blocks::<22, 2, { offset::SCALE }>(row, x, sums, |q, x| q5_block(q, x)) };
    dot - 16.0 * d_sums
}

/// Q5_1: Σ over 24-byte blocks (d, m, qh, qs) of (d·q + m)·x = d·Σ q·x + m·(block sum of x).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_1_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller keeps `offset_blocks`'s contract (checked by the safe wrapper).
    let (dot, m_sums) =
        unsafe { offset_blocks::<24, 4, { offset::MIN }>(row, x, sums, |q, x| q5_block(q, x)) };
    dot + m_sums
}

/// Σ q·x over 32 bytes at `qs` (signed or not) and `x[0..32]`, as eight lane sums.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn byte_block<const SIGNED: bool>(qs: *const u8, x: *const f32) -> __m256 {
    // SAFETY: the caller guarantees the features, 32 bytes at `qs` and 32 values at `x`.
    unsafe {
        let w = |p: *const u8| if SIGNED { i8x8(p) } else { u8x8(p) };
        let s = _mm256_mul_ps(w(qs), _mm256_loadu_ps(x));
        let t = _mm256_mul_ps(w(qs.add(8)), _mm256_loadu_ps(x.add(8)));
        let s = _mm256_fmadd_ps(w(qs.add(16)), _mm256_loadu_ps(x.add(16)), s);
        let t = _mm256_fmadd_ps(w(qs.add(24)), _mm256_loadu_ps(x.add(24)), t);
        _mm256_add_ps(s, t)
    }
}

/// Q8_0: Σ over 34-byte blocks of d·q·x.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller keeps `offset_blocks`'s contract (checked by the safe wrapper;
    // `sums` is not read).
    let (dot, _) = unsafe {
        offset_blocks::<34, 2, { offset::NONE }>(row, x, sums, |q, x| byte_block::<true>(q, x))
    };
    dot
}

/// The head of a Q4_K or Q5_K super-block at `blk` (d, dmin, the 12 scale bytes): its
/// eight sub-block scales times d into `dsc`, and `min_acc` plus its mins times dmin times
/// the activation's eight block sums at `sums` (what the caller subtracts at the end).
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k_head(blk: *const u8, sums: *const f32, dsc: &mut [f32; 8], min_acc: __m256) -> __m256 {
    // SAFETY: the caller guarantees the features, the 16 head bytes at `blk` and eight
    // sums at `sums`.
    unsafe {
        let (scales, mins) = k_scales_mins(blk.add(4));
        _mm256_storeu_ps(dsc.as_mut_ptr(), _mm256_mul_ps(scales, f16_splat(blk)));
        _mm256_fmadd_ps(
            _mm256_mul_ps(mins, f16_splat(blk.add(2))),
            _mm256_loadu_ps(sums),
            min_acc,
        )
    }
}

/// Q4_K: 256-value super-blocks of eight 32-value sub-blocks, each with a 6-bit scale and
/// min; weights `d·sc·q − dmin·m`, the min part through the activation's block sums. The
/// scales of a super-block are unpacked together (eight at once) before its values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 256;
        let mut acc = _mm256_setzero_ps();
        let mut min_acc = _mm256_setzero_ps();
        for b in 0..nb {
            let blk = row.as_ptr().add(b * 144);
            let mut dsc = [0.0f32; 8];
            min_acc = k_head(blk, sums.as_ptr().add(b * 8), &mut dsc, min_acc);
            let dsc = from_memory(dsc.as_ptr());
            let qs = blk.add(16);
            let px = x.as_ptr().add(b * 256);
            for i in 0..4 {
                // Bytes 32i..32i+32: low nibbles are sub-block 2i, high nibbles 2i + 1.
                let q = qs.add(32 * i);
                let x0 = px.add(64 * i);
                let (l0, h0) = nibbles8(q);
                let (l1, h1) = nibbles8(q.add(8));
                let (l2, h2) = nibbles8(q.add(16));
                let (l3, h3) = nibbles8(q.add(24));
                let s1 = _mm256_mul_ps(l0, _mm256_loadu_ps(x0));
                let s2 = _mm256_mul_ps(h0, _mm256_loadu_ps(x0.add(32)));
                let s1 = _mm256_fmadd_ps(l1, _mm256_loadu_ps(x0.add(8)), s1);
                let s2 = _mm256_fmadd_ps(h1, _mm256_loadu_ps(x0.add(40)), s2);
                let s1 = _mm256_fmadd_ps(l2, _mm256_loadu_ps(x0.add(16)), s1);
                let s2 = _mm256_fmadd_ps(h2, _mm256_loadu_ps(x0.add(48)), s2);
                let s1 = _mm256_fmadd_ps(l3, _mm256_loadu_ps(x0.add(24)), s1);
                let s2 = _mm256_fmadd_ps(h3, _mm256_loadu_ps(x0.add(56)), s2);
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*dsc.add(2 * i)), s1, acc);
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*dsc.add(2 * i + 1)), s2, acc);
            }
        }
        hsum(acc) - hsum(min_acc)
    }
}

/// Q5_K: Q4_K with a fifth bit per value in `qh` (bit 2i of byte l for value 64i + l,
/// bit 2i + 1 for value 64i + 32 + l). Each 64-value group is assembled into bytes with
/// 32-byte operations (the fifth bits shifted to bit 4 and masked in), parked on the stack
/// and widened from there, as Q6_K does.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_k_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 256;
        let low4 = _mm256_set1_epi8(0x0F);
        let bit4 = _mm256_set1_epi8(0x10);
        let mut acc = _mm256_setzero_ps();
        let mut acc2 = _mm256_setzero_ps();
        let mut min_acc = _mm256_setzero_ps();
        let mut quants = [_mm256_setzero_si256(); 2];
        for b in 0..nb {
            let blk = row.as_ptr().add(b * 176);
            let mut dsc = [0.0f32; 8];
            min_acc = k_head(blk, sums.as_ptr().add(b * 8), &mut dsc, min_acc);
            let dsc = from_memory(dsc.as_ptr());
            let qh = _mm256_loadu_si256(blk.add(16) as *const __m256i);
            let px = x.as_ptr().add(b * 256);
            for i in 0..4 {
                let q = _mm256_loadu_si256(blk.add(48 + 32 * i) as *const __m256i);
                // Bits 2i and 2i + 1 of each qh byte moved to bit 4 (16-bit shifts: what
                // crosses into the neighbouring byte lands outside bit 4).
                let (fifth_lo, fifth_hi) = match i {
                    0 => (_mm256_slli_epi16(qh, 4), _mm256_slli_epi16(qh, 3)),
                    1 => (_mm256_slli_epi16(qh, 2), _mm256_slli_epi16(qh, 1)),
                    2 => (qh, _mm256_srli_epi16(qh, 1)),
                    _ => (_mm256_srli_epi16(qh, 2), _mm256_srli_epi16(qh, 3)),
                };
                quants[0] =
                    _mm256_or_si256(_mm256_and_si256(q, low4), _mm256_and_si256(fifth_lo, bit4));
                quants[1] = _mm256_or_si256(
                    _mm256_and_si256(_mm256_srli_epi16(q, 4), low4),
                    _mm256_and_si256(fifth_hi, bit4),
                );
                let qp = from_memory(quants.as_ptr()) as *const u8;
                let x0 = px.add(64 * i);
                // Sub-block 2i from the low nibbles, 2i + 1 from the high ones.
                let s1 = byte_block::<false>(qp, x0);
                let s2 = byte_block::<false>(qp.add(32), x0.add(32));
                acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*dsc.add(2 * i)), s1, acc);
                acc2 = _mm256_fmadd_ps(_mm256_broadcast_ss(&*dsc.add(2 * i + 1)), s2, acc2);
            }
        }
        hsum(_mm256_add_ps(acc, acc2)) - hsum(min_acc)
    }
}

/// Q6_K: 256-value super-blocks of sixteen 16-value sub-blocks with signed 8-bit scales;
/// each value's low four bits in `ql`, its top two in `qh`. A half super-block (128
/// values) is assembled into signed bytes with 32-byte operations, parked on the stack,
/// and widened from there eight at a time: the widening then reads memory, not a register
/// that would first have to be split (two more shuffles per eight values).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 256;
        let low4 = _mm256_set1_epi8(0x0F);
        let bits45 = _mm256_set1_epi8(0x30);
        let bias = _mm256_set1_epi8(32);
        let mut acc = _mm256_setzero_ps();
        let mut acc2 = _mm256_setzero_ps();
        let mut quants = [_mm256_setzero_si256(); 4];
        for b in 0..nb {
            let blk = row.as_ptr().add(b * 210);
            let d = f16_splat(blk.add(208));
            let sc = _mm_loadu_si128(blk.add(192) as *const __m128i);
            let sc_lo = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(sc));
            let sc_hi = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(sc, 8)));
            let mut dsc = [0.0f32; 16];
            _mm256_storeu_ps(dsc.as_mut_ptr(), _mm256_mul_ps(sc_lo, d));
            _mm256_storeu_ps(dsc.as_mut_ptr().add(8), _mm256_mul_ps(sc_hi, d));
            let dsc = from_memory(dsc.as_ptr());
            let px = x.as_ptr().add(b * 256);
            for n in 0..2 {
                let ql = blk.add(64 * n);
                let qla = _mm256_loadu_si256(ql as *const __m256i);
                let qlb = _mm256_loadu_si256(ql.add(32) as *const __m256i);
                let h = _mm256_loadu_si256(blk.add(128 + 32 * n) as *const __m256i);
                // Bits 2k, 2k+1 of qh byte l are the top bits of value 32k + l; moved to
                // bits 4 and 5, above the low nibble.
                let h0 = _mm256_and_si256(_mm256_slli_epi16(h, 4), bits45);
                let h1 = _mm256_and_si256(_mm256_slli_epi16(h, 2), bits45);
                let h2 = _mm256_and_si256(h, bits45);
                let h3 = _mm256_and_si256(_mm256_srli_epi16(h, 2), bits45);
                let nib = |v: __m256i, top: __m256i| {
                    _mm256_sub_epi8(_mm256_or_si256(_mm256_and_si256(v, low4), top), bias)
                };
                quants[0] = nib(qla, h0);
                quants[1] = nib(qlb, h1);
                quants[2] = nib(_mm256_srli_epi16(qla, 4), h2);
                quants[3] = nib(_mm256_srli_epi16(qlb, 4), h3);
                let quants = from_memory(quants.as_ptr()) as *const u8;
                for k in 0..4 {
                    // Values 128n + 32k + l; scale 8n + 2k for l < 16, the next one above.
                    let q = quants.add(32 * k);
                    let y = px.add(128 * n + 32 * k);
                    let sa = _mm256_mul_ps(i8x8(q), _mm256_loadu_ps(y));
                    let sb = _mm256_mul_ps(i8x8(q.add(16)), _mm256_loadu_ps(y.add(16)));
                    let sa = _mm256_fmadd_ps(i8x8(q.add(8)), _mm256_loadu_ps(y.add(8)), sa);
                    let sb = _mm256_fmadd_ps(i8x8(q.add(24)), _mm256_loadu_ps(y.add(24)), sb);
                    acc = _mm256_fmadd_ps(_mm256_broadcast_ss(&*dsc.add(8 * n + 2 * k)), sa, acc);
                    acc2 = _mm256_fmadd_ps(
                        _mm256_broadcast_ss(&*dsc.add(8 * n + 2 * k + 1)),
                        sb,
                        acc2,
                    );
                }
            }
        }
        hsum(_mm256_add_ps(acc, acc2))
    }
}

/// `w · x[t]` for four activations at once: each weight vector is loaded once for all
/// four, halving the loads of the many-token (prefill) path.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot4_f32_unchecked(w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
        let pw = w.as_ptr();
        let px = x.map(|x| x.as_ptr());
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut i = 0;
        while i + 8 <= n {
            let wv = _mm256_loadu_ps(pw.add(i));
            for t in 0..4 {
                acc[t] = _mm256_fmadd_ps(wv, _mm256_loadu_ps(px[t].add(i)), acc[t]);
            }
            i += 8;
        }
        let mut out = [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])];
        while i < n {
            for t in 0..4 {
                out[t] += w[i] * x[t][i];
            }
            i += 1;
        }
        out
    }
}

/// `w[r] · x[t]` for two weight rows and four activations: eight accumulators, each loaded
/// vector used two or four times, so the FMAs, not the loads, set the pace (the AVX2 form
/// of the many-token path's register block; sixteen registers hold no more).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot2x4_f32_unchecked(w: [&[f32]; 2], x: [&[f32]; 4]) -> [[f32; 4]; 2] {
    // SAFETY: the caller guarantees the features; every load lies within the common
    // length of all six slices (the tail is scalar).
    unsafe {
        let n = w
            .iter()
            .chain(x.iter())
            .fold(usize::MAX, |n, s| n.min(s.len()));
        let (w0, w1) = (w[0].as_ptr(), w[1].as_ptr());
        let px = [x[0].as_ptr(), x[1].as_ptr(), x[2].as_ptr(), x[3].as_ptr()];
        let mut acc = [[_mm256_setzero_ps(); 4]; 2];
        let mut i = 0;
        while i + 8 <= n {
            let (a, b) = (_mm256_loadu_ps(w0.add(i)), _mm256_loadu_ps(w1.add(i)));
            for t in 0..4 {
                let xv = _mm256_loadu_ps(px[t].add(i));
                acc[0][t] = _mm256_fmadd_ps(a, xv, acc[0][t]);
                acc[1][t] = _mm256_fmadd_ps(b, xv, acc[1][t]);
            }
            i += 8;
        }
        // Loops, not closures: a closure's body would not share this function's features.
        let mut out = [[0.0f32; 4]; 2];
        for r in 0..2 {
            for t in 0..4 {
                out[r][t] = hsum(acc[r][t]);
                for k in i..n {
                    out[r][t] += w[r][k] * x[t][k];
                }
            }
        }
        out
    }
}

/// `w[r] · x[t]` for two rows and four activations over their common length.
pub fn dot2x4_f32(_: Avx2, w: [&[f32]; 2], x: [&[f32]; 4]) -> [[f32; 4]; 2] {
    // SAFETY: the token proves the features; the kernel reads the common length only.
    unsafe { dot2x4_f32_unchecked(w, x) }
}

/// Proof that this CPU runs AVX2, FMA and F16C: only [`Avx2::detect`] makes one, so the
/// safe kernels below cannot be reached on a CPU without them.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx2(());

impl Avx2 {
    /// A token when the CPU has AVX2, FMA and F16C.
    pub fn detect() -> Option<Avx2> {
        let ok = is_x86_feature_detected!("avx2")
            && is_x86_feature_detected!("fma")
            && is_x86_feature_detected!("f16c");
        ok.then_some(Avx2(()))
    }
}

/// `y += a·x` over their common length.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn axpy_f32_unchecked(a: f32, x: &[f32], y: &mut [f32]) {
    // SAFETY: the caller guarantees the features; every access lies within the common
    // length of both slices (the tail is scalar).
    unsafe {
        let n = x.len().min(y.len());
        let (px, py) = (x.as_ptr(), y.as_mut_ptr());
        let av = _mm256_set1_ps(a);
        let mut i = 0;
        while i + 8 <= n {
            let v = _mm256_fmadd_ps(av, _mm256_loadu_ps(px.add(i)), _mm256_loadu_ps(py.add(i)));
            _mm256_storeu_ps(py.add(i), v);
            i += 8;
        }
        while i < n {
            *py.add(i) += a * *px.add(i);
            i += 1;
        }
    }
}

/// `y += a·x` over their common length.
pub fn axpy_f32(_: Avx2, a: f32, x: &[f32], y: &mut [f32]) {
    // SAFETY: the token proves the features; the kernel touches the common length only.
    unsafe { axpy_f32_unchecked(a, x, y) }
}

/// `a · b` over their common length.
pub fn dot_f32(_: Avx2, a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: the token proves the features; the kernel reads min(a.len(), b.len()) values.
    unsafe { dot_f32_unchecked(a, b) }
}

/// `w · x[t]` for four activations over their common length.
pub fn dot4_f32(_: Avx2, w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    // SAFETY: the token proves the features; the kernel reads the common length only.
    unsafe { dot4_f32_unchecked(w, x) }
}

/// An f16 row (`2 · x.len()` bytes) dotted with `x`.
pub fn dot_f16(_: Avx2, row: &[u8], x: &[f32]) -> f32 {
    assert_eq!(
        row.len(),
        2 * x.len(),
        "an f16 row of {} bytes for {} values",
        row.len(),
        x.len()
    );
    // SAFETY: the token proves the features; the lengths agree (checked above).
    unsafe { dot_f16_unchecked(row, x) }
}

/// Eight signed bytes widened to eight f32s.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn widen8(v: __m128i) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
}

/// Σ level[code]·x over one 4-bit table block — 16 code bytes at `q`, value `j` the low
/// nibble of byte `j` and value `16 + j` its high nibble (MXFP4's and IQ4_NL's layout) —
/// and `x[0..32]`, as eight lane sums; `levels` holds the 16 signed levels.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn table_block(q: *const u8, levels: __m128i, x: *const f32) -> __m256 {
    // SAFETY: the caller guarantees 16 bytes at `q` and 32 values at `x`.
    unsafe {
        let codes = _mm_loadu_si128(q as *const __m128i);
        let low = _mm_set1_epi8(0x0F);
        let lo = _mm_shuffle_epi8(levels, _mm_and_si128(codes, low));
        let hi = _mm_shuffle_epi8(levels, _mm_and_si128(_mm_srli_epi16(codes, 4), low));
        let mut acc = _mm256_mul_ps(widen8(lo), _mm256_loadu_ps(x));
        acc = _mm256_fmadd_ps(
            widen8(_mm_srli_si128(lo, 8)),
            _mm256_loadu_ps(x.add(8)),
            acc,
        );
        acc = _mm256_fmadd_ps(widen8(hi), _mm256_loadu_ps(x.add(16)), acc);
        _mm256_fmadd_ps(
            widen8(_mm_srli_si128(hi, 8)),
            _mm256_loadu_ps(x.add(24)),
            acc,
        )
    }
}

/// Σ over a row of `BYTES`-byte table blocks (`HEAD` bytes of scale, then 16 of codes) of
/// scale·Σ level·x, the scale read by `scale`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn table_blocks<const BYTES: usize, const HEAD: usize>(
    row: &[u8],
    levels: &[i8; 16],
    x: &[f32],
    scale: impl Fn(&[u8]) -> f32,
) -> f32 {
    // SAFETY: the caller guarantees whole blocks in `row` and 32 values of `x` for each;
    // `levels` is 16 bytes.
    unsafe {
        let levels = _mm_loadu_si128(levels.as_ptr() as *const __m128i);
        let mut acc = _mm256_setzero_ps();
        for (b, blk) in row.chunks_exact(BYTES).enumerate() {
            let sum = table_block(blk.as_ptr().add(HEAD), levels, x.as_ptr().add(32 * b));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(scale(blk)), sum, acc);
        }
        hsum(acc)
    }
}

/// MXFP4: 17-byte blocks, an E8M0 exponent then the codes of E2M1 values (doubled to
/// integers: the scale is half the exponent's power of two).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_mxfp4_unchecked(row: &[u8], x: &[f32], _: &[f32]) -> f32 {
    // SAFETY: the safe wrapper checked whole blocks and the values they need.
    unsafe { table_blocks::<17, 1>(row, &mxfp4::KVALUES, x, |b| mxfp4::e8m0_half(b[0])) }
}

/// IQ4_NL: 18-byte blocks, an f16 scale then the codes of its non-linear levels.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq4_nl_unchecked(row: &[u8], x: &[f32], _: &[f32]) -> f32 {
    // SAFETY: as for `dot_mxfp4_unchecked`, with 18-byte blocks.
    unsafe {
        table_blocks::<18, 2>(row, &iquants::KVALUES_IQ4NL, x, |b| {
            half::f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
        })
    }
}

/// The eight values of a grid group as f32: `grid` holds eight unsigned levels (bytes, all
/// below 128), negated where bit j of `signs` is set.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn signed_group8(grid: u64, signs: u8) -> __m256 {
    let levels = _mm_cvtsi64_si128(grid as i64);
    let bit = _mm_setr_epi8(1, 2, 4, 8, 16, 32, 64, -128, 0, 0, 0, 0, 0, 0, 0, 0);
    // 0xFF in byte j where bit j is set: x ^ m − m negates those bytes.
    let m = _mm_cmpeq_epi8(_mm_and_si128(_mm_set1_epi8(signs as i8), bit), bit);
    let v = _mm_sub_epi8(_mm_xor_si128(levels, m), m);
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v))
}

/// The loop of the grid I-quants: for each 256-value super-block of BYTES bytes (its f16
/// `d` first), `group(block, g)` gives group g's eight levels, their signs and the group's
/// scale in units of `d`; the levels meet the activation in one FMA and the group's sum its
/// scale in another.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn grid_blocks<const BYTES: usize>(
    row: &[u8],
    x: &[f32],
    group: impl Fn(*const u8, usize) -> (u64, u8, f32),
) -> f32 {
    // SAFETY: the caller guarantees the features and `x.len() / 256` blocks of BYTES bytes
    // in `row`; every pointer stays inside them.
    unsafe {
        let mut acc = _mm256_setzero_ps();
        for b in 0..x.len() / 256 {
            let blk = row.as_ptr().add(b * BYTES);
            let d = f16x1(blk);
            let px = x.as_ptr().add(256 * b);
            for g in 0..32 {
                let (grid, signs, scale) = group(blk, g);
                let dot = _mm256_mul_ps(signed_group8(grid, signs), _mm256_loadu_ps(px.add(8 * g)));
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * scale), dot, acc);
            }
        }
        hsum(acc)
    }
}

/// A grid I-quant's group `g` of the super-block at `blk`: its eight levels, their signs
/// and its scale in units of the block's `d`.
type GridGroup = unsafe fn(*const u8, usize) -> (u64, u8, f32);

/// IQ2_XXS: per 32 values two words, four grid indices (bytes) and four 7-bit sign indices
/// under a 4-bit scale; values `d·(0.5 + s)·0.25·grid·sign`.
#[inline]
unsafe fn iq2_xxs_group(blk: *const u8, g: usize) -> (u64, u8, f32) {
    // SAFETY: the caller guarantees a whole 66-byte block at `blk` and g < 32.
    unsafe {
        let q = blk.add(2 + 8 * (g / 4));
        let aux = (q.add(4) as *const u32).read_unaligned().to_le();
        let signs = iquant_grids::KSIGNS[((aux >> (7 * (g % 4))) & 127) as usize];
        let grid = iquant_grids::IQ2XXS_GRID[*q.add(g % 4) as usize];
        (grid, signs, (0.5 + (aux >> 28) as f32) * 0.25)
    }
}

/// IQ2_XS: a u16 a group (9-bit grid index, 7-bit sign index), a 4-bit scale per 16
/// values; values `d·(0.5 + s)·0.25·grid·sign`.
#[inline]
unsafe fn iq2_xs_group(blk: *const u8, g: usize) -> (u64, u8, f32) {
    // SAFETY: the caller guarantees a whole 74-byte block at `blk` and g < 32.
    unsafe {
        let q = (blk.add(2 + 2 * g) as *const u16).read_unaligned().to_le();
        let s = (*blk.add(66 + g / 4) >> (4 * ((g / 2) % 2))) & 0x0F;
        let grid = iquant_grids::IQ2XS_GRID[(q & 511) as usize];
        (
            grid,
            iquant_grids::KSIGNS[(q >> 9) as usize],
            (0.5 + s as f32) * 0.25,
        )
    }
}

/// IQ2_S: 10-bit grid indices (32 low bytes, 2-bit tops four a byte), explicit sign bytes,
/// scales as IQ2_XS's; values `d·(0.5 + s)·0.25·grid·sign`.
#[inline]
unsafe fn iq2_s_group(blk: *const u8, g: usize) -> (u64, u8, f32) {
    // SAFETY: the caller guarantees a whole 82-byte block at `blk` and g < 32.
    unsafe {
        let top = ((*blk.add(66 + g / 4) >> (2 * (g % 4))) & 3) as usize;
        let grid = iquant_grids::IQ2S_GRID[*blk.add(2 + g) as usize | (top << 8)];
        let s = (*blk.add(74 + g / 4) >> (4 * ((g / 2) % 2))) & 0x0F;
        (grid, *blk.add(34 + g), (0.5 + s as f32) * 0.25)
    }
}

/// IQ3_XXS: 64 grid-index bytes (four values each), then a word a 32 values as IQ2_XXS's
/// second; values `d·(0.5 + s)·0.5·grid·sign`.
#[inline]
unsafe fn iq3_xxs_group(blk: *const u8, g: usize) -> (u64, u8, f32) {
    // SAFETY: the caller guarantees a whole 98-byte block at `blk` and g < 32.
    unsafe {
        let aux = (blk.add(66 + 4 * (g / 4)) as *const u32)
            .read_unaligned()
            .to_le();
        let signs = iquant_grids::KSIGNS[((aux >> (7 * (g % 4))) & 127) as usize];
        let lo = iquant_grids::IQ3XXS_GRID[*blk.add(2 + 2 * g) as usize] as u64;
        let hi = iquant_grids::IQ3XXS_GRID[*blk.add(3 + 2 * g) as usize] as u64;
        (lo | hi << 32, signs, (0.5 + (aux >> 28) as f32) * 0.5)
    }
}

/// IQ3_S: 9-bit grid indices (64 low bytes, 8 bytes of top bits), explicit sign bytes, a
/// 4-bit scale per 32 values; values `d·(1 + 2s)·grid·sign`.
#[inline]
unsafe fn iq3_s_group(blk: *const u8, g: usize) -> (u64, u8, f32) {
    // SAFETY: the caller guarantees a whole 110-byte block at `blk` and g < 32.
    unsafe {
        let top = *blk.add(66 + g / 4);
        let index = |i: usize| *blk.add(2 + i) as usize | (((top >> (i % 8)) & 1) as usize) << 8;
        let lo = iquant_grids::IQ3S_GRID[index(2 * g)] as u64;
        let hi = iquant_grids::IQ3S_GRID[index(2 * g + 1)] as u64;
        let s = (*blk.add(106 + g / 8) >> (4 * ((g / 4) % 2))) & 0x0F;
        (lo | hi << 32, *blk.add(74 + g), (1 + 2 * s as u32) as f32)
    }
}

/// Writes the whole super-blocks of a grid I-quant (BYTES a block) that both `src` and
/// `out` hold, each value `d·scale` times its signed level: the reference's products in its
/// order (a sign is exact either side of the rounding), so bit for bit its values.
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn grid_dequant<const BYTES: usize>(src: &[u8], out: &mut [f32], group: GridGroup) {
    // SAFETY: the caller guarantees the features; block b's bytes and values lie inside
    // `src` and `out` for every b below the count both hold.
    unsafe {
        for b in 0..(out.len() / 256).min(src.len() / BYTES) {
            let blk = src.as_ptr().add(b * BYTES);
            let d = f16x1(blk);
            for g in 0..32 {
                let (grid, signs, scale) = group(blk, g);
                let v = _mm256_mul_ps(_mm256_set1_ps(d * scale), signed_group8(grid, signs));
                _mm256_storeu_ps(out.as_mut_ptr().add(256 * b + 8 * g), v);
            }
        }
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq2_xxs_unchecked(row: &[u8], x: &[f32], _: &[f32]) -> f32 {
    // SAFETY: as for `grid_blocks`, with 66-byte blocks.
    unsafe { grid_blocks::<66>(row, x, |blk, g| iq2_xxs_group(blk, g)) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq2_xs_unchecked(row: &[u8], x: &[f32], _: &[f32]) -> f32 {
    // SAFETY: as for `grid_blocks`, with 74-byte blocks.
    unsafe { grid_blocks::<74>(row, x, |blk, g| iq2_xs_group(blk, g)) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq2_s_unchecked(row: &[u8], x: &[f32], _: &[f32]) -> f32 {
    // SAFETY: as for `grid_blocks`, with 82-byte blocks.
    unsafe { grid_blocks::<82>(row, x, |blk, g| iq2_s_group(blk, g)) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq3_xxs_unchecked(row: &[u8], x: &[f32], _: &[f32]) -> f32 {
    // SAFETY: as for `grid_blocks`, with 98-byte blocks.
    unsafe { grid_blocks::<98>(row, x, |blk, g| iq3_xxs_group(blk, g)) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_iq3_s_unchecked(row: &[u8], x: &[f32], _: &[f32]) -> f32 {
    // SAFETY: as for `grid_blocks`, with 110-byte blocks.
    unsafe { grid_blocks::<110>(row, x, |blk, g| iq3_s_group(blk, g)) }
}

/// Safe dequantisers of the grid I-quants with AVX2 row dots.
macro_rules! grid_dequantiser {
    ($($name:ident => $group:ident, $bytes:expr;)*) => {$(
        pub fn $name(_: Avx2, src: &[u8], out: &mut [f32]) {
            // SAFETY: the token proves the features; `grid_dequant` stays inside both slices.
            unsafe { grid_dequant::<$bytes>(src, out, $group) }
        }
    )*};
}

grid_dequantiser! {
    dequant_iq2_xxs => iq2_xxs_group, 66;
    dequant_iq2_xs => iq2_xs_group, 74;
    dequant_iq2_s => iq2_s_group, 82;
    dequant_iq3_xxs => iq3_xxs_group, 98;
    dequant_iq3_s => iq3_s_group, 110;
}

/// Safe entry points for the block types: the row must hold exactly `x.len()` values of
/// the type (whole blocks), and `sums` one sum per 32 values for the types that use them —
/// checked on every call (a panic on misuse, never an out-of-bounds read).
macro_rules! block_dot {
    ($($name:ident => $inner:ident, $block:expr, $bytes:expr, $uses_sums:expr;)*) => {$(
        pub fn $name(_: Avx2, row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
            assert!(
                x.len() % $block == 0 && row.len() == x.len() / $block * $bytes,
                concat!(stringify!($name), ": a row of {} bytes for {} values"),
                row.len(),
                x.len()
            );
            if $uses_sums {
                assert_eq!(sums.len(), x.len() / 32, concat!(stringify!($name), ": block sums"));
            }
            // SAFETY: the token proves the features; the lengths were checked above.
            unsafe { $inner(row, x, sums) }
        }
    )*};
}

block_dot! {
    dot_q4_0 => dot_q4_0_unchecked, 32, 18, true;
    dot_apr_q4 => dot_apr_q4_unchecked, 32, 18, true;
    dot_q4_1 => dot_q4_1_unchecked, 32, 20, true;
    dot_q5_0 => dot_q5_0_unchecked, 32, 22, true;
    dot_q5_1 => dot_q5_1_unchecked, 32, 24, true;
    dot_q8_0 => dot_q8_0_unchecked, 32, 34, false;
    dot_q4_k => dot_q4_k_unchecked, 256, 144, true;
    dot_q5_k => dot_q5_k_unchecked, 256, 176, true;
    dot_q6_k => dot_q6_k_unchecked, 256, 210, false;
    dot_mxfp4 => dot_mxfp4_unchecked, 32, 17, false;
    dot_iq4_nl => dot_iq4_nl_unchecked, 32, 18, false;
    dot_iq2_xxs => dot_iq2_xxs_unchecked, 256, 66, false;
    dot_iq2_xs => dot_iq2_xs_unchecked, 256, 74, false;
    dot_iq2_s => dot_iq2_s_unchecked, 256, 82, false;
    dot_iq3_xxs => dot_iq3_xxs_unchecked, 256, 98, false;
    dot_iq3_s => dot_iq3_s_unchecked, 256, 110, false;
}

group_kernels! {
    Avx2;
    dequant_q4_0, tokens_q4_0 => groups::Q4_0;
    dequant_apr_q4, tokens_apr_q4 => groups::AprQ4;
    dequant_q4_1, tokens_q4_1 => groups::Q4_1;
    dequant_q5_0, tokens_q5_0 => groups::Q5_0;
    dequant_q5_1, tokens_q5_1 => groups::Q5_1;
    dequant_q8_0, tokens_q8_0 => groups::Q8_0;
    dequant_q4_k => groups::Q4K;
    dequant_q5_k => groups::Q5K;
    dequant_q6_k => groups::Q6K;
    dequant_q2_k, tokens_q2_k => groups::Q2K;
    dequant_q3_k, tokens_q3_k => groups::Q3K;
}
