//! AVX2 + FMA + F16C fused dequantise-and-dot kernels for the types real models spend
//! their bytes on. Each keeps f32 activations: quantised values are widened to f32 and
//! multiplied with FMA. Offsets (`+m`, `−dmin·m`) are folded in through the activation's
//! 32-value block sums, so the inner loop is pure widen-and-FMA.
//!
//! Every function here requires AVX2, FMA and F16C (callers check at run time) and a row
//! holding exactly `x.len()` values of its type.

use std::arch::x86_64::*;

use kiln_core::quant::kquants::scale_min_k4;

#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn hsum(v: __m256) -> f32 {
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
unsafe fn f16x1(p: *const u8) -> f32 {
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

/// Σ q·x over 16 unsigned bytes `q` and `x[0..16]`, added to `acc`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fma_u8x16(q: __m128i, x: *const f32, acc: __m256) -> __m256 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let a = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
        let b = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
        let acc = _mm256_fmadd_ps(a, _mm256_loadu_ps(x), acc);
        _mm256_fmadd_ps(b, _mm256_loadu_ps(x.add(8)), acc)
    }
}

/// Σ q·x over 16 signed bytes `q` and `x[0..16]`, added to `acc`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn fma_i8x16(q: __m128i, x: *const f32, acc: __m256) -> __m256 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let a = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(q));
        let b = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_srli_si128(q, 8)));
        let acc = _mm256_fmadd_ps(a, _mm256_loadu_ps(x), acc);
        _mm256_fmadd_ps(b, _mm256_loadu_ps(x.add(8)), acc)
    }
}

/// 0x10 in each byte of `h` that has bit `u` (a one-bit mask in every lane) set, else 0.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits_masked(h: __m128i, u: __m128i) -> __m128i {
    _mm_and_si128(_mm_cmpeq_epi8(_mm_and_si128(h, u), u), _mm_set1_epi8(0x10))
}

/// Bit `i` of the 16 bits in `bits` as byte `i`: 0x10 where the bit is set, 0 where not.
/// That is the fifth bit of a Q5 quant, ready to OR onto its low nibble.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
fn fifth_bits16(bits: u32) -> __m128i {
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

/// Σ over 18-byte blocks of d·(q − 8)·x: Q4_0 and APR Q4 share fields and arithmetic and
/// differ only in where value `i`'s nibble lies. Q4_0: low nibbles are values 0..16, high
/// nibbles 16..32. APR Q4 (`interleaved`): value `i` in byte `i / 2`, low nibble for even
/// `i`; interleaving the low- and high-nibble vectors byte by byte restores value order.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_symmetric(row: &[u8], x: &[f32], interleaved: bool) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 32;
        debug_assert_eq!(row.len(), nb * 18);
        let mask = _mm_set1_epi8(0x0F);
        let eight = _mm_set1_epi8(8);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let p = row.as_ptr().add(b * 18);
            let px = x.as_ptr().add(b * 32);
            let d = f16_splat(p);
            let qs = _mm_loadu_si128(p.add(2) as *const __m128i);
            let lo = _mm_sub_epi8(_mm_and_si128(qs, mask), eight);
            let hi = _mm_sub_epi8(_mm_and_si128(_mm_srli_epi16(qs, 4), mask), eight);
            // Values 0..16, then 16..32.
            let (first, second) = if interleaved {
                (_mm_unpacklo_epi8(lo, hi), _mm_unpackhi_epi8(lo, hi))
            } else {
                (lo, hi)
            };
            let s = fma_i8x16(first, px, _mm256_setzero_ps());
            let s = fma_i8x16(second, px.add(16), s);
            acc = _mm256_fmadd_ps(d, s, acc);
        }
        hsum(acc)
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_0_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe { dot_q4_symmetric(row, x, false) }
}

/// APR Q4: Q4_0's fields and arithmetic with the nibbles in value order (see
/// [`dot_q4_symmetric`]).
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_apr_q4_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe { dot_q4_symmetric(row, x, true) }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_1_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 32;
        debug_assert_eq!(row.len(), nb * 20);
        debug_assert_eq!(sums.len(), nb);
        let mask = _mm_set1_epi8(0x0F);
        let mut acc = _mm256_setzero_ps();
        let mut offset = 0.0f32;
        for b in 0..nb {
            let p = row.as_ptr().add(b * 20);
            let px = x.as_ptr().add(b * 32);
            let (d, m) = f16x2(p);
            let qs = _mm_loadu_si128(p.add(4) as *const __m128i);
            let lo = _mm_and_si128(qs, mask);
            let hi = _mm_and_si128(_mm_srli_epi16(qs, 4), mask);
            let s = fma_u8x16(lo, px, _mm256_setzero_ps());
            let s = fma_u8x16(hi, px.add(16), s);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
            offset += m * *sums.get_unchecked(b);
        }
        hsum(acc) + offset
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_0_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 32;
        debug_assert_eq!(row.len(), nb * 22);
        let mask = _mm_set1_epi8(0x0F);
        let sixteen = _mm_set1_epi8(16);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let p = row.as_ptr().add(b * 22);
            let px = x.as_ptr().add(b * 32);
            let d = f16_splat(p);
            let qh = (p.add(2) as *const u32).read_unaligned().to_le();
            let qs = _mm_loadu_si128(p.add(6) as *const __m128i);
            // 5-bit quants are 0..=31, so after the −16 they fit an i8.
            let lo = _mm_sub_epi8(
                _mm_or_si128(_mm_and_si128(qs, mask), fifth_bits16(qh)),
                sixteen,
            );
            let hi = _mm_sub_epi8(
                _mm_or_si128(
                    _mm_and_si128(_mm_srli_epi16(qs, 4), mask),
                    fifth_bits16(qh >> 16),
                ),
                sixteen,
            );
            let s = fma_i8x16(lo, px, _mm256_setzero_ps());
            let s = fma_i8x16(hi, px.add(16), s);
            acc = _mm256_fmadd_ps(d, s, acc);
        }
        hsum(acc)
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_1_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 32;
        debug_assert_eq!(row.len(), nb * 24);
        debug_assert_eq!(sums.len(), nb);
        let mask = _mm_set1_epi8(0x0F);
        let mut acc = _mm256_setzero_ps();
        let mut offset = 0.0f32;
        for b in 0..nb {
            let p = row.as_ptr().add(b * 24);
            let px = x.as_ptr().add(b * 32);
            let (d, m) = f16x2(p);
            let qh = (p.add(4) as *const u32).read_unaligned().to_le();
            let qs = _mm_loadu_si128(p.add(8) as *const __m128i);
            let lo = _mm_or_si128(_mm_and_si128(qs, mask), fifth_bits16(qh));
            let hi = _mm_or_si128(
                _mm_and_si128(_mm_srli_epi16(qs, 4), mask),
                fifth_bits16(qh >> 16),
            );
            let s = fma_u8x16(lo, px, _mm256_setzero_ps());
            let s = fma_u8x16(hi, px.add(16), s);
            acc = _mm256_fmadd_ps(_mm256_set1_ps(d), s, acc);
            offset += m * *sums.get_unchecked(b);
        }
        hsum(acc) + offset
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q8_0_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 32;
        debug_assert_eq!(row.len(), nb * 34);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let p = row.as_ptr().add(b * 34);
            let px = x.as_ptr().add(b * 32);
            let d = f16_splat(p);
            let q0 = _mm_loadu_si128(p.add(2) as *const __m128i);
            let q1 = _mm_loadu_si128(p.add(18) as *const __m128i);
            let s = fma_i8x16(q0, px, _mm256_setzero_ps());
            let s = fma_i8x16(q1, px.add(16), s);
            acc = _mm256_fmadd_ps(d, s, acc);
        }
        hsum(acc)
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q4_k_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 256;
        debug_assert_eq!(row.len(), nb * 144);
        debug_assert_eq!(sums.len(), nb * 8);
        let mask = _mm_set1_epi8(0x0F);
        let mut acc = _mm256_setzero_ps();
        let mut offset = 0.0f32;
        for b in 0..nb {
            let blk = &row[b * 144..(b + 1) * 144];
            let (d, dmin) = f16x2(blk.as_ptr());
            let scales = &blk[4..16];
            let qs = blk.as_ptr().add(16);
            let px = x.as_ptr().add(b * 256);
            let bs = sums.as_ptr().add(b * 8);
            let mut mins = 0.0f32;
            for i in 0..4 {
                let (sc1, m1) = scale_min_k4(scales, 2 * i);
                let (sc2, m2) = scale_min_k4(scales, 2 * i + 1);
                let qa = _mm_loadu_si128(qs.add(32 * i) as *const __m128i);
                let qb = _mm_loadu_si128(qs.add(32 * i + 16) as *const __m128i);
                let x0 = px.add(64 * i);
                let s1 = fma_u8x16(_mm_and_si128(qa, mask), x0, _mm256_setzero_ps());
                let s1 = fma_u8x16(_mm_and_si128(qb, mask), x0.add(16), s1);
                let s2 = fma_u8x16(
                    _mm_and_si128(_mm_srli_epi16(qa, 4), mask),
                    x0.add(32),
                    _mm256_setzero_ps(),
                );
                let s2 = fma_u8x16(_mm_and_si128(_mm_srli_epi16(qb, 4), mask), x0.add(48), s2);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc1 as f32), s1, acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc2 as f32), s2, acc);
                mins += m1 as f32 * *bs.add(2 * i) + m2 as f32 * *bs.add(2 * i + 1);
            }
            offset += dmin * mins;
        }
        hsum(acc) - offset
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q5_k_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 256;
        debug_assert_eq!(row.len(), nb * 176);
        debug_assert_eq!(sums.len(), nb * 8);
        let mask = _mm_set1_epi8(0x0F);
        let mut acc = _mm256_setzero_ps();
        let mut offset = 0.0f32;
        for b in 0..nb {
            let blk = &row[b * 176..(b + 1) * 176];
            let (d, dmin) = f16x2(blk.as_ptr());
            let scales = &blk[4..16];
            // Byte l of `qh` carries the fifth bit of value l of every 32-value sub-block:
            // bit 2i for sub-block 2i (low nibbles), bit 2i+1 for 2i+1 (high nibbles).
            let qha = _mm_loadu_si128(blk.as_ptr().add(16) as *const __m128i);
            let qhb = _mm_loadu_si128(blk.as_ptr().add(32) as *const __m128i);
            let qs = blk.as_ptr().add(48);
            let px = x.as_ptr().add(b * 256);
            let bs = sums.as_ptr().add(b * 8);
            let mut mins = 0.0f32;
            for i in 0..4 {
                let (sc1, m1) = scale_min_k4(scales, 2 * i);
                let (sc2, m2) = scale_min_k4(scales, 2 * i + 1);
                let u1 = _mm_set1_epi8((1u8 << (2 * i)) as i8);
                let u2 = _mm_set1_epi8((2u8 << (2 * i)) as i8);
                let qa = _mm_loadu_si128(qs.add(32 * i) as *const __m128i);
                let qb = _mm_loadu_si128(qs.add(32 * i + 16) as *const __m128i);
                let x0 = px.add(64 * i);
                let la = _mm_or_si128(_mm_and_si128(qa, mask), fifth_bits_masked(qha, u1));
                let lb = _mm_or_si128(_mm_and_si128(qb, mask), fifth_bits_masked(qhb, u1));
                let ha = _mm_or_si128(
                    _mm_and_si128(_mm_srli_epi16(qa, 4), mask),
                    fifth_bits_masked(qha, u2),
                );
                let hb = _mm_or_si128(
                    _mm_and_si128(_mm_srli_epi16(qb, 4), mask),
                    fifth_bits_masked(qhb, u2),
                );
                let s1 = fma_u8x16(la, x0, _mm256_setzero_ps());
                let s1 = fma_u8x16(lb, x0.add(16), s1);
                let s2 = fma_u8x16(ha, x0.add(32), _mm256_setzero_ps());
                let s2 = fma_u8x16(hb, x0.add(48), s2);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc1 as f32), s1, acc);
                acc = _mm256_fmadd_ps(_mm256_set1_ps(d * sc2 as f32), s2, acc);
                mins += m1 as f32 * *bs.add(2 * i) + m2 as f32 * *bs.add(2 * i + 1);
            }
            offset += dmin * mins;
        }
        hsum(acc) - offset
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn dot_q6_k_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees AVX2, FMA and F16C (the safe wrappers take an
    // `Avx2` token, which only detection makes) and the slice lengths this kernel
    // reads (checked by the wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 256;
        debug_assert_eq!(row.len(), nb * 210);
        let mask = _mm_set1_epi8(0x0F);
        let three = _mm_set1_epi8(3);
        let bias = _mm_set1_epi8(32);
        let mut acc = _mm256_setzero_ps();
        for b in 0..nb {
            let blk = row.as_ptr().add(b * 210);
            let d = f16x1(blk.add(208));
            let sc = blk.add(192) as *const i8;
            let px = x.as_ptr().add(b * 256);
            for n in 0..2 {
                let ql = blk.add(64 * n);
                let qh = blk.add(128 + 32 * n);
                for half in 0..2 {
                    let l0 = 16 * half;
                    let qla = _mm_loadu_si128(ql.add(l0) as *const __m128i);
                    let qlb = _mm_loadu_si128(ql.add(32 + l0) as *const __m128i);
                    let h = _mm_loadu_si128(qh.add(l0) as *const __m128i);
                    let h0 = _mm_slli_epi16(_mm_and_si128(h, three), 4);
                    let h1 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 2), three), 4);
                    let h2 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 4), three), 4);
                    let h3 = _mm_slli_epi16(_mm_and_si128(_mm_srli_epi16(h, 6), three), 4);
                    let q1 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(qla, mask), h0), bias);
                    let q2 = _mm_sub_epi8(_mm_or_si128(_mm_and_si128(qlb, mask), h1), bias);
                    let q3 = _mm_sub_epi8(
                        _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qla, 4), mask), h2),
                        bias,
                    );
                    let q4 = _mm_sub_epi8(
                        _mm_or_si128(_mm_and_si128(_mm_srli_epi16(qlb, 4), mask), h3),
                        bias,
                    );
                    let y = px.add(128 * n + l0);
                    let s = sc.add(8 * n + half);
                    let z = _mm256_setzero_ps();
                    acc = _mm256_fmadd_ps(_mm256_set1_ps(d * *s as f32), fma_i8x16(q1, y, z), acc);
                    acc = _mm256_fmadd_ps(
                        _mm256_set1_ps(d * *s.add(2) as f32),
                        fma_i8x16(q2, y.add(32), z),
                        acc,
                    );
                    acc = _mm256_fmadd_ps(
                        _mm256_set1_ps(d * *s.add(4) as f32),
                        fma_i8x16(q3, y.add(64), z),
                        acc,
                    );
                    acc = _mm256_fmadd_ps(
                        _mm256_set1_ps(d * *s.add(6) as f32),
                        fma_i8x16(q4, y.add(96), z),
                        acc,
                    );
                }
            }
        }
        hsum(acc)
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
    dot_q4_0 => dot_q4_0_unchecked, 32, 18, false;
    dot_apr_q4 => dot_apr_q4_unchecked, 32, 18, false;
    dot_q4_1 => dot_q4_1_unchecked, 32, 20, true;
    dot_q5_0 => dot_q5_0_unchecked, 32, 22, false;
    dot_q5_1 => dot_q5_1_unchecked, 32, 24, true;
    dot_q8_0 => dot_q8_0_unchecked, 32, 34, false;
    dot_q4_k => dot_q4_k_unchecked, 256, 144, true;
    dot_q5_k => dot_q5_k_unchecked, 256, 176, true;
    dot_q6_k => dot_q6_k_unchecked, 256, 210, false;
}
