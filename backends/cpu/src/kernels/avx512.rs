//! AVX-512 fused dequantise-and-dot kernels for the block types real models spend their
//! bytes on. Same contract as the AVX2 kernels (f32 activations, exact dequantised values,
//! offsets folded in through the activation's block sums), twice the lanes.
//!
//! The 4- and 5-bit types skip the integer-to-float conversion: a block's sixteen possible
//! values per nibble, already multiplied by the block's scale, sit in a register, and
//! `vpermps` picks each weight's value by its quant (a 5-bit type has two such tables and
//! its fifth bits, as a lane mask, choose between them). The permute reads only the low
//! 4 bits of each 32-bit lane, so no nibble needs masking. Each table entry is `d · q` in f32, exact (an 11-bit mantissa times a 5-bit
//! integer), so the weights equal the reference dequantiser's bit for bit.
//!
//! Every function here requires AVX-512F, BW and VL plus AVX2, FMA and F16C (the token's
//! detection checks them all) and a row holding exactly `x.len()` values of its type.

use std::arch::x86_64::*;

use super::avx2::{f16x2, k_scales_mins};
use super::avx512_groups as groups;
use super::Avx2;

/// Proof that this CPU runs AVX-512F, BW and VL as well as AVX2, FMA and F16C: only
/// [`Avx512::detect`] makes one.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Avx512(Avx2);

impl Avx512 {
    /// A token when the CPU has AVX-512F, BW and VL, AVX2, FMA and F16C.
    pub fn detect() -> Option<Avx512> {
        let avx2 = Avx2::detect()?;
        let wide = is_x86_feature_detected!("avx512f")
            && is_x86_feature_detected!("avx512bw")
            && is_x86_feature_detected!("avx512vl");
        wide.then_some(Avx512(avx2))
    }

    /// The AVX2 token this CPU also has (for kernels without an AVX-512 version).
    pub fn avx2(self) -> Avx2 {
        self.0
    }
}

/// 0, 1, …, 15 as f32.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) fn iota16() -> __m512 {
    _mm512_setr_ps(
        0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
    )
}

/// The f16 at `p`, as f32 in all sixteen lanes. Broadcast as a half and converted as a
/// vector: converting one lane and broadcasting that lets the compiler insert into a
/// register of its choice, and when it picks a loop's accumulator every block waits for
/// the previous block's FMA (seen: Q4_0 at half the speed of Q4_1).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn f16_splat(p: *const u8) -> __m512 {
    // SAFETY: the caller guarantees the features and two readable bytes at `p`.
    unsafe { _mm512_cvtph_ps(_mm256_set1_epi16((p as *const u16).read_unaligned() as i16)) }
}

/// Σ table[q & 15] · x over 16 bytes `q` and `x[0..16]`, added to `acc`; only the low four
/// bits of each byte choose.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn fma_lut16(q: __m128i, table: __m512, x: *const f32, acc: __m512) -> __m512 {
    // SAFETY: the caller guarantees the features (the safe wrappers take a token only
    // detection makes) and that `x` points at 16 readable values.
    unsafe {
        _mm512_fmadd_ps(
            _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(q), table),
            _mm512_loadu_ps(x),
            acc,
        )
    }
}

/// Σ w·x over 16 lanes `q` (each 0..=15 in its low four bits, anything above) and
/// `x[0..16]`, added to `acc`, where w is `hi[q & 15]` in the lanes set in `fifth` and
/// `lo[q & 15]` in the others: a 5-bit quant's value from two 16-entry tables, in one
/// two-table permute once the fifth bit is in bit 4 of the index.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn fma_lut5(
    q: __m512i,
    fifth: __mmask16,
    lo: __m512,
    hi: __m512,
    x: *const f32,
    acc: __m512,
) -> __m512 {
    // SAFETY: as for `fma_lut16`.
    unsafe {
        let nibble = _mm512_and_si512(q, _mm512_set1_epi32(15));
        let idx = _mm512_mask_or_epi32(nibble, fifth, nibble, _mm512_set1_epi32(16));
        _mm512_fmadd_ps(_mm512_permutex2var_ps(lo, idx, hi), _mm512_loadu_ps(x), acc)
    }
}

/// Σ q·x over 16 signed bytes `q` and `x[0..16]`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_i8x16(q: __m128i, x: *const f32) -> __m512 {
    // SAFETY: as for `fma_lut16`.
    unsafe {
        _mm512_mul_ps(
            _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)),
            _mm512_loadu_ps(x),
        )
    }
}

/// Runs `$body` over blocks `0..$nb` with `$b` the block index, `$acc` a pair of
/// accumulators and `$half` 0 or 1 for the pair in use (for scalar sums kept per pair), alternating between two pairs so that consecutive blocks' FMAs do not wait
/// for each other (one pair left a block every FMA latency: 34 weights/ns for Q4_0, 41
/// with two). Evaluates to the sum of all four accumulators.
macro_rules! two_chains {
    ($nb:expr, |$b:ident, $acc:ident, $half:ident| $body:expr) => {{
        let z = _mm512_setzero_ps();
        let (mut even, mut odd) = ((z, z), (z, z));
        let mut next = 0;
        while next + 2 <= $nb {
            {
                let ($b, $acc, $half) = (next, even, 0);
                even = $body;
            }
            {
                let ($b, $acc, $half) = (next + 1, odd, 1);
                odd = $body;
            }
            next += 2;
        }
        if next < $nb {
            let ($b, $acc, $half) = (next, even, 0);
            even = $body;
        }
        _mm512_add_ps(_mm512_add_ps(even.0, even.1), _mm512_add_ps(odd.0, odd.1))
    }};
}

/// Q4_0 and APR Q4 (see the AVX2 kernel for the two nibble orders): weights `d·(q − 8)`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_q4_symmetric(row: &[u8], x: &[f32], interleaved: bool) -> f32 {
    // SAFETY: the caller guarantees the features and the slice lengths (checked by the
    // safe wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 32;
        let values = _mm512_sub_ps(iota16(), _mm512_set1_ps(8.0));
        let mask = _mm_set1_epi8(0x0F);
        let sum = two_chains!(nb, |b, acc, _half| {
            let p = row.as_ptr().add(b * 18);
            let px = x.as_ptr().add(b * 32);
            let table = _mm512_mul_ps(values, f16_splat(p));
            let qs = _mm_loadu_si128(p.add(2) as *const __m128i);
            if interleaved {
                let (lo, hi) = (
                    _mm_and_si128(qs, mask),
                    _mm_and_si128(_mm_srli_epi16(qs, 4), mask),
                );
                (
                    fma_lut16(_mm_unpacklo_epi8(lo, hi), table, px, acc.0),
                    fma_lut16(_mm_unpackhi_epi8(lo, hi), table, px.add(16), acc.1),
                )
            } else {
                // Both nibbles from one widening: the low one as is (the permute reads
                // only the low four bits), the high one shifted down.
                let idx = _mm512_cvtepu8_epi32(qs);
                (
                    _mm512_fmadd_ps(
                        _mm512_permutexvar_ps(idx, table),
                        _mm512_loadu_ps(px),
                        acc.0,
                    ),
                    _mm512_fmadd_ps(
                        _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table),
                        _mm512_loadu_ps(px.add(16)),
                        acc.1,
                    ),
                )
            }
        });
        _mm512_reduce_add_ps(sum)
    }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_q4_0_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: as for `dot_q4_symmetric`.
    unsafe { dot_q4_symmetric(row, x, false) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_apr_q4_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: as for `dot_q4_symmetric`.
    unsafe { dot_q4_symmetric(row, x, true) }
}

/// Q4_1: weights `d·q + m`; the `m` part is `m · Σx` per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_q4_1_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees the features and the slice lengths (checked by the
    // safe wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 32;
        let mut offset = [0.0f32; 2];
        let sum = two_chains!(nb, |b, acc, half| {
            let p = row.as_ptr().add(b * 20);
            let px = x.as_ptr().add(b * 32);
            let (d, m) = f16x2(p);
            let table = _mm512_mul_ps(iota16(), _mm512_set1_ps(d));
            let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(4) as *const __m128i));
            offset[half] += m * *sums.get_unchecked(b);
            (
                _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(idx, table),
                    _mm512_loadu_ps(px),
                    acc.0,
                ),
                _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table),
                    _mm512_loadu_ps(px.add(16)),
                    acc.1,
                ),
            )
        });
        _mm512_reduce_add_ps(sum) + (offset[0] + offset[1])
    }
}

/// Q5_0: weights `d·(q − 16)` with 5-bit `q`: two tables, the fifth bits choose.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_q5_0_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees the features and the slice lengths (checked by the
    // safe wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 32;
        let low_values = _mm512_sub_ps(iota16(), _mm512_set1_ps(16.0));
        let sum = two_chains!(nb, |b, acc, _half| {
            let p = row.as_ptr().add(b * 22);
            let px = x.as_ptr().add(b * 32);
            let d = f16_splat(p);
            let (low, high) = (_mm512_mul_ps(low_values, d), _mm512_mul_ps(iota16(), d));
            let qh = (p.add(2) as *const u32).read_unaligned().to_le();
            let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(6) as *const __m128i));
            (
                fma_lut5(idx, qh as __mmask16, low, high, px, acc.0),
                fma_lut5(
                    _mm512_srli_epi32(idx, 4),
                    (qh >> 16) as __mmask16,
                    low,
                    high,
                    px.add(16),
                    acc.1,
                ),
            )
        });
        _mm512_reduce_add_ps(sum)
    }
}

/// Q5_1: weights `d·q + m` with 5-bit `q`; the `m` part is `m · Σx` per block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_q5_1_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees the features and the slice lengths (checked by the
    // safe wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 32;
        let high_values = _mm512_add_ps(iota16(), _mm512_set1_ps(16.0));
        let mut offset = [0.0f32; 2];
        let sum = two_chains!(nb, |b, acc, half| {
            let p = row.as_ptr().add(b * 24);
            let px = x.as_ptr().add(b * 32);
            let (d, m) = f16x2(p);
            let d = _mm512_set1_ps(d);
            let (low, high) = (_mm512_mul_ps(iota16(), d), _mm512_mul_ps(high_values, d));
            let qh = (p.add(4) as *const u32).read_unaligned().to_le();
            let idx = _mm512_cvtepu8_epi32(_mm_loadu_si128(p.add(8) as *const __m128i));
            offset[half] += m * *sums.get_unchecked(b);
            (
                fma_lut5(idx, qh as __mmask16, low, high, px, acc.0),
                fma_lut5(
                    _mm512_srli_epi32(idx, 4),
                    (qh >> 16) as __mmask16,
                    low,
                    high,
                    px.add(16),
                    acc.1,
                ),
            )
        });
        _mm512_reduce_add_ps(sum) + (offset[0] + offset[1])
    }
}

/// Q8_0: weights `d·q` with signed 8-bit `q`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_q8_0_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees the features and the slice lengths (checked by the
    // safe wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 32;
        let sum = two_chains!(nb, |b, acc, _half| {
            let p = row.as_ptr().add(b * 34);
            let px = x.as_ptr().add(b * 32);
            let d = f16_splat(p);
            let q0 = _mm_loadu_si128(p.add(2) as *const __m128i);
            let q1 = _mm_loadu_si128(p.add(18) as *const __m128i);
            (
                _mm512_fmadd_ps(d, dot_i8x16(q0, px), acc.0),
                _mm512_fmadd_ps(d, dot_i8x16(q1, px.add(16)), acc.1),
            )
        });
        _mm512_reduce_add_ps(sum)
    }
}

/// Q4_K: 256-value super-blocks of eight 32-value sub-blocks, each with a 6-bit scale and
/// min; weights `d·sc·q − dmin·m`, the min part through the activation's block sums.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_q4_k_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees the features and the slice lengths (checked by the
    // safe wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 256;
        let (mut acc0, mut acc1, mut acc2, mut acc3) = (
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        );
        let mut min_acc = _mm256_setzero_ps();
        let mut dsc = [0.0f32; 8];
        for b in 0..nb {
            let blk = row.as_ptr().add(b * 144);
            let (d, dmin) = f16x2(blk);
            let (scales, mins) = k_scales_mins(blk.add(4));
            // d·sc is exact in f32 (11-bit mantissa times 6 bits), and so is each entry.
            _mm256_storeu_ps(dsc.as_mut_ptr(), _mm256_mul_ps(scales, _mm256_set1_ps(d)));
            min_acc = _mm256_fmadd_ps(
                _mm256_mul_ps(mins, _mm256_set1_ps(dmin)),
                _mm256_loadu_ps(sums.as_ptr().add(b * 8)),
                min_acc,
            );
            let qs = blk.add(16);
            let px = x.as_ptr().add(b * 256);
            for i in 0..4 {
                let t1 = _mm512_mul_ps(iota16(), _mm512_set1_ps(dsc[2 * i]));
                let t2 = _mm512_mul_ps(iota16(), _mm512_set1_ps(dsc[2 * i + 1]));
                let qa = _mm_loadu_si128(qs.add(32 * i) as *const __m128i);
                let qb = _mm_loadu_si128(qs.add(32 * i + 16) as *const __m128i);
                let x0 = px.add(64 * i);
                let (ia, ib) = (_mm512_cvtepu8_epi32(qa), _mm512_cvtepu8_epi32(qb));
                acc0 = _mm512_fmadd_ps(_mm512_permutexvar_ps(ia, t1), _mm512_loadu_ps(x0), acc0);
                acc1 = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(ib, t1),
                    _mm512_loadu_ps(x0.add(16)),
                    acc1,
                );
                acc2 = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(_mm512_srli_epi32(ia, 4), t2),
                    _mm512_loadu_ps(x0.add(32)),
                    acc2,
                );
                acc3 = _mm512_fmadd_ps(
                    _mm512_permutexvar_ps(_mm512_srli_epi32(ib, 4), t2),
                    _mm512_loadu_ps(x0.add(48)),
                    acc3,
                );
            }
        }
        let offset = _mm512_reduce_add_ps(_mm512_zextps256_ps512(min_acc));
        _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(acc0, acc1),
            _mm512_add_ps(acc2, acc3),
        )) - offset
    }
}

/// Q5_K: Q4_K with a fifth bit per value; a two-register table per sub-block.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_q5_k_unchecked(row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees the features and the slice lengths (checked by the
    // safe wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 256;
        let (mut acc0, mut acc1, mut acc2, mut acc3) = (
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        );
        let sixteen = _mm512_set1_ps(16.0);
        let mut min_acc = _mm256_setzero_ps();
        let mut dsc = [0.0f32; 8];
        for b in 0..nb {
            let blk = &row[b * 176..(b + 1) * 176];
            let (d, dmin) = f16x2(blk.as_ptr());
            let (scales, mins) = k_scales_mins(blk.as_ptr().add(4));
            _mm256_storeu_ps(dsc.as_mut_ptr(), _mm256_mul_ps(scales, _mm256_set1_ps(d)));
            min_acc = _mm256_fmadd_ps(
                _mm256_mul_ps(mins, _mm256_set1_ps(dmin)),
                _mm256_loadu_ps(sums.as_ptr().add(b * 8)),
                min_acc,
            );
            let qha = _mm_loadu_si128(blk.as_ptr().add(16) as *const __m128i);
            let qhb = _mm_loadu_si128(blk.as_ptr().add(32) as *const __m128i);
            let qs = blk.as_ptr().add(48);
            let px = x.as_ptr().add(b * 256);
            for i in 0..4 {
                let (s1, s2) = (_mm512_set1_ps(dsc[2 * i]), _mm512_set1_ps(dsc[2 * i + 1]));
                let (lo1, hi1) = (
                    _mm512_mul_ps(iota16(), s1),
                    _mm512_mul_ps(_mm512_add_ps(iota16(), sixteen), s1),
                );
                let (lo2, hi2) = (
                    _mm512_mul_ps(iota16(), s2),
                    _mm512_mul_ps(_mm512_add_ps(iota16(), sixteen), s2),
                );
                let u1 = _mm_set1_epi8((1u8 << (2 * i)) as i8);
                let u2 = _mm_set1_epi8((2u8 << (2 * i)) as i8);
                let qa = _mm_loadu_si128(qs.add(32 * i) as *const __m128i);
                let qb = _mm_loadu_si128(qs.add(32 * i + 16) as *const __m128i);
                let x0 = px.add(64 * i);
                let (ka1, kb1) = (_mm_test_epi8_mask(qha, u1), _mm_test_epi8_mask(qhb, u1));
                let (ka2, kb2) = (_mm_test_epi8_mask(qha, u2), _mm_test_epi8_mask(qhb, u2));
                let (ia, ib) = (_mm512_cvtepu8_epi32(qa), _mm512_cvtepu8_epi32(qb));
                acc0 = fma_lut5(ia, ka1, lo1, hi1, x0, acc0);
                acc1 = fma_lut5(ib, kb1, lo1, hi1, x0.add(16), acc1);
                acc2 = fma_lut5(_mm512_srli_epi32(ia, 4), ka2, lo2, hi2, x0.add(32), acc2);
                acc3 = fma_lut5(_mm512_srli_epi32(ib, 4), kb2, lo2, hi2, x0.add(48), acc3);
            }
        }
        let offset = _mm512_reduce_add_ps(_mm512_zextps256_ps512(min_acc));
        _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(acc0, acc1),
            _mm512_add_ps(acc2, acc3),
        )) - offset
    }
}

/// Q6_K: 6-bit quants (low nibble + two high bits) minus 32, an 8-bit scale per 16 values.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_q6_k_unchecked(row: &[u8], x: &[f32], _sums: &[f32]) -> f32 {
    // SAFETY: the caller guarantees the features and the slice lengths (checked by the
    // safe wrappers); every pointer stays inside those slices.
    unsafe {
        let nb = x.len() / 256;
        let mask = _mm_set1_epi8(0x0F);
        let three = _mm_set1_epi8(3);
        let bias = _mm_set1_epi8(32);
        let (mut acc0, mut acc1, mut acc2, mut acc3) = (
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
            _mm512_setzero_ps(),
        );
        for b in 0..nb {
            let blk = row.as_ptr().add(b * 210);
            // The sixteen 8-bit scales times d, once per super-block.
            let mut dsc = [0.0f32; 16];
            let sc8 = _mm_loadu_si128(blk.add(192) as *const __m128i);
            _mm512_storeu_ps(
                dsc.as_mut_ptr(),
                _mm512_mul_ps(
                    _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(sc8)),
                    f16_splat(blk.add(208)),
                ),
            );
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
                    let s = 8 * n + half;
                    acc0 = _mm512_fmadd_ps(_mm512_set1_ps(dsc[s]), dot_i8x16(q1, y), acc0);
                    acc1 =
                        _mm512_fmadd_ps(_mm512_set1_ps(dsc[s + 2]), dot_i8x16(q2, y.add(32)), acc1);
                    acc2 =
                        _mm512_fmadd_ps(_mm512_set1_ps(dsc[s + 4]), dot_i8x16(q3, y.add(64)), acc2);
                    acc3 =
                        _mm512_fmadd_ps(_mm512_set1_ps(dsc[s + 6]), dot_i8x16(q4, y.add(96)), acc3);
                }
            }
        }
        _mm512_reduce_add_ps(_mm512_add_ps(
            _mm512_add_ps(acc0, acc1),
            _mm512_add_ps(acc2, acc3),
        ))
    }
}

/// `a · b` over their common length; the tail through a lane mask.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot_f32_unchecked(a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: the caller guarantees the features; every load lies within the first
    // min(a.len(), b.len()) values of each slice (the last one masked to them).
    unsafe {
        let n = a.len().min(b.len());
        let (pa, pb) = (a.as_ptr(), b.as_ptr());
        let (mut acc0, mut acc1) = (_mm512_setzero_ps(), _mm512_setzero_ps());
        let mut i = 0;
        while i + 32 <= n {
            acc0 = _mm512_fmadd_ps(_mm512_loadu_ps(pa.add(i)), _mm512_loadu_ps(pb.add(i)), acc0);
            acc1 = _mm512_fmadd_ps(
                _mm512_loadu_ps(pa.add(i + 16)),
                _mm512_loadu_ps(pb.add(i + 16)),
                acc1,
            );
            i += 32;
        }
        while i < n {
            let k: __mmask16 = if n - i >= 16 {
                0xFFFF
            } else {
                (1u16 << (n - i)) - 1
            };
            acc0 = _mm512_fmadd_ps(
                _mm512_maskz_loadu_ps(k, pa.add(i)),
                _mm512_maskz_loadu_ps(k, pb.add(i)),
                acc0,
            );
            i += 16;
        }
        _mm512_reduce_add_ps(_mm512_add_ps(acc0, acc1))
    }
}

/// `w · x[t]` for four activations, each weight vector loaded once for all four.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot4_f32_unchecked(w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    // SAFETY: as for `dot_f32_unchecked`, over the common length of all five slices.
    unsafe {
        let n = x.iter().fold(w.len(), |n, x| n.min(x.len()));
        let pw = w.as_ptr();
        let px = x.map(|x| x.as_ptr());
        let mut acc = [_mm512_setzero_ps(); 4];
        let mut i = 0;
        while i < n {
            let k: __mmask16 = if n - i >= 16 {
                0xFFFF
            } else {
                (1u16 << (n - i)) - 1
            };
            let wv = _mm512_maskz_loadu_ps(k, pw.add(i));
            for t in 0..4 {
                acc[t] = _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(k, px[t].add(i)), acc[t]);
            }
            i += 16;
        }
        // A loop, not `acc.map(..)`: a closure does not inherit the function's target
        // features, so each reduction became a call with its vector spilled to memory
        // (half the prefill's time in `perf`, 2026-12-01).
        let mut out = [0.0f32; 4];
        for t in 0..4 {
            out[t] = _mm512_reduce_add_ps(acc[t]);
        }
        out
    }
}

/// `w[r] · x[t]` for four weight rows and four activations: sixteen accumulators, each
/// loaded vector used four times (the many-token path's inner product).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn dot4x4_f32_unchecked(w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
    // SAFETY: the caller guarantees the features; every load lies within the common
    // length of all eight slices (the last one masked to it).
    unsafe {
        let n = w
            .iter()
            .chain(x.iter())
            .fold(usize::MAX, |n, s| n.min(s.len()));
        let pw = w.map(|w| w.as_ptr());
        let px = x.map(|x| x.as_ptr());
        let mut acc = [[_mm512_setzero_ps(); 4]; 4];
        let mut i = 0;
        while i < n {
            let k: __mmask16 = if n - i >= 16 {
                0xFFFF
            } else {
                (1u16 << (n - i)) - 1
            };
            let mut wv = [_mm512_setzero_ps(); 4];
            for r in 0..4 {
                wv[r] = _mm512_maskz_loadu_ps(k, pw[r].add(i));
            }
            for t in 0..4 {
                let xv = _mm512_maskz_loadu_ps(k, px[t].add(i));
                for r in 0..4 {
                    acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
                }
            }
            i += 16;
        }
        // Loops, not closures (see `dot4_f32_unchecked`).
        let mut out = [[0.0f32; 4]; 4];
        for r in 0..4 {
            for t in 0..4 {
                out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
            }
        }
        out
    }
}

/// `w[r] · x[t]` for four rows and four activations over their common length.
pub fn dot4x4_f32(_: Avx512, w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
    // SAFETY: the token proves the features; the kernel reads the common length only.
    unsafe { dot4x4_f32_unchecked(w, x) }
}

group_kernels! {
    Avx512;
    dequant_q4_0, tokens_q4_0 => groups::Q4_0;
    dequant_apr_q4, tokens_apr_q4 => groups::AprQ4;
    dequant_q4_1, tokens_q4_1 => groups::Q4_1;
    dequant_q5_0, tokens_q5_0 => groups::Q5_0;
    dequant_q5_1, tokens_q5_1 => groups::Q5_1;
    dequant_q8_0, tokens_q8_0 => groups::Q8_0;
    dequant_q4_k, tokens_q4_k => groups::Q4K;
    dequant_q5_k, tokens_q5_k => groups::Q5K;
    dequant_q6_k, tokens_q6_k => groups::Q6K;
    dequant_q2_k, tokens_q2_k => groups::Q2K;
    dequant_q3_k, tokens_q3_k => groups::Q3K;
}

/// `out[j] = scale · (q · row j)` for `out.len()` rows, row j starting at `rows[j·stride]`.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scores_f32_unchecked(
    q: &[f32],
    rows: &[f32],
    stride: usize,
    scale: f32,
    out: &mut [f32],
) {
    // SAFETY: the caller guarantees the features and that each of the `out.len()` rows
    // lies inside `rows`; the dot (inlined: the same features) reads `q.len()` values.
    unsafe {
        let hd = q.len();
        for (j, o) in out.iter_mut().enumerate() {
            *o = dot_f32_unchecked(q, rows.get_unchecked(j * stride..j * stride + hd)) * scale;
        }
    }
}

/// `out[j] = scale · (q · row j)` for `out.len()` rows of `rows`, row j at `j·stride`.
pub fn scores_f32(_: Avx512, q: &[f32], rows: &[f32], stride: usize, scale: f32, out: &mut [f32]) {
    if let Some(last) = out.len().checked_sub(1) {
        assert!(
            last * stride + q.len() <= rows.len(),
            "{} rows of stride {stride} and {} values exceed {}",
            out.len(),
            q.len(),
            rows.len()
        );
    }
    // SAFETY: the token proves the features; the assertion bounds every row read.
    unsafe { scores_f32_unchecked(q, rows, stride, scale, out) }
}

/// `out += Σ_j w[j] · row j` over `out.len()` values of each row.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn weighted_rows_f32_unchecked(w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    // SAFETY: the caller guarantees the features and that each of the `w.len()` rows lies
    // inside `rows` with `out.len()` values; partial vectors are masked.
    unsafe {
        let (hd, rows) = (out.len(), rows.as_ptr());
        let po = out.as_mut_ptr();
        // Four 16-value column blocks at a time: four independent FMA chains, the sums in
        // registers over all rows.
        let mut c0 = 0;
        while c0 < hd {
            let blocks = (hd - c0).div_ceil(16).min(4);
            let mut m = [0 as __mmask16; 4];
            let mut acc = [_mm512_setzero_ps(); 4];
            for b in 0..blocks {
                let left = hd - c0 - 16 * b;
                m[b] = if left >= 16 {
                    0xFFFF
                } else {
                    (1u16 << left) - 1
                };
                acc[b] = _mm512_maskz_loadu_ps(m[b], po.add(c0 + 16 * b));
            }
            for (j, &wj) in w.iter().enumerate() {
                let wv = _mm512_set1_ps(wj);
                let row = rows.add(j * stride + c0);
                for b in 0..blocks {
                    acc[b] =
                        _mm512_fmadd_ps(wv, _mm512_maskz_loadu_ps(m[b], row.add(16 * b)), acc[b]);
                }
            }
            for b in 0..blocks {
                _mm512_mask_storeu_ps(po.add(c0 + 16 * b), m[b], acc[b]);
            }
            c0 += 16 * blocks;
        }
    }
}

/// `out += Σ_j w[j] · row j` for `w.len()` rows of `rows`, row j at `j·stride`, over
/// `out.len()` values of each.
pub fn weighted_rows_f32(_: Avx512, w: &[f32], rows: &[f32], stride: usize, out: &mut [f32]) {
    if let Some(last) = w.len().checked_sub(1) {
        assert!(
            last * stride + out.len() <= rows.len(),
            "{} rows of stride {stride} and {} values exceed {}",
            w.len(),
            out.len(),
            rows.len()
        );
    }
    // SAFETY: the token proves the features; the assertion bounds every row read.
    unsafe { weighted_rows_f32_unchecked(w, rows, stride, out) }
}

/// `out[k·n + j] = scale · (q_k · row j)` for the `Q` queries `q_k = q[k·hd..]` and `n` rows,
/// row j starting at `rows[j·stride]`: each row is loaded once for all the queries (the
/// heads of a GQA group), where one call per query would stream it from cache `Q` times.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scores_multi_f32_unchecked<const Q: usize>(
    q: &[f32],
    hd: usize,
    rows: &[f32],
    stride: usize,
    scale: f32,
    n: usize,
    out: &mut [f32],
) {
    // SAFETY: the caller guarantees the features, `q` holds Q·hd values, `out` Q·n, and
    // each of the n rows lies inside `rows` with hd values; partial vectors are masked.
    unsafe {
        let (pq, pr, po) = (q.as_ptr(), rows.as_ptr(), out.as_mut_ptr());
        for j in 0..n {
            let row = pr.add(j * stride);
            let mut acc = [_mm512_setzero_ps(); Q];
            let mut i = 0;
            while i < hd {
                let m: __mmask16 = if hd - i >= 16 {
                    0xFFFF
                } else {
                    (1u16 << (hd - i)) - 1
                };
                let v = _mm512_maskz_loadu_ps(m, row.add(i));
                for k in 0..Q {
                    acc[k] =
                        _mm512_fmadd_ps(_mm512_maskz_loadu_ps(m, pq.add(k * hd + i)), v, acc[k]);
                }
                i += 16;
            }
            for k in 0..Q {
                *po.add(k * n + j) = _mm512_reduce_add_ps(acc[k]) * scale;
            }
        }
    }
}

/// The horizontal sums of 16 vectors as one vector (lane i = the sum of `v[i]`'s lanes): a
/// transposing tree of 30 shuffles and 15 adds, where sixteen `_mm512_reduce_add_ps` take
/// ~60 of each.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
fn sum16(v: &[__m512; 16]) -> __m512 {
    // Within each 128-bit lane: pairs, then quads, so vector q of `quads` holds, in lane l,
    // the partial sums over lane l of v[4q], v[4q+1], v[4q+2], v[4q+3] in that order.
    let mut quads = [_mm512_setzero_ps(); 4];
    for (q, out) in quads.iter_mut().enumerate() {
        let b = 4 * q;
        let s01 = _mm512_add_ps(
            _mm512_unpacklo_ps(v[b], v[b + 1]),
            _mm512_unpackhi_ps(v[b], v[b + 1]),
        );
        let s23 = _mm512_add_ps(
            _mm512_unpacklo_ps(v[b + 2], v[b + 3]),
            _mm512_unpackhi_ps(v[b + 2], v[b + 3]),
        );
        *out = _mm512_add_ps(
            _mm512_shuffle_ps::<0x44>(s01, s23),
            _mm512_shuffle_ps::<0xEE>(s01, s23),
        );
    }
    // Across the four 128-bit lanes: lanes (0, 2) plus lanes (1, 3), twice.
    let t01 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(quads[0], quads[1]),
        _mm512_shuffle_f32x4::<0xDD>(quads[0], quads[1]),
    );
    let t23 = _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(quads[2], quads[3]),
        _mm512_shuffle_f32x4::<0xDD>(quads[2], quads[3]),
    );
    _mm512_add_ps(
        _mm512_shuffle_f32x4::<0x88>(t01, t23),
        _mm512_shuffle_f32x4::<0xDD>(t01, t23),
    )
}

/// One row's partial-sum vector against each of `Q` queries of `16·V` values (lane-wise
/// products summed over the head). A function, not a closure: closures do not inherit
/// `target_feature`s (see `sum16`'s caller).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
#[inline]
unsafe fn row_partials<const Q: usize, const V: usize>(
    qv: &[[__m512; V]; Q],
    row: *const f32,
) -> [__m512; Q] {
    // SAFETY: the caller guarantees the features and 16·V readable values at `row`.
    unsafe {
        let r: [__m512; V] = std::array::from_fn(|v| _mm512_loadu_ps(row.add(16 * v)));
        let mut acc = [_mm512_setzero_ps(); Q];
        for (a, qk) in acc.iter_mut().zip(qv) {
            *a = _mm512_mul_ps(qk[0], r[0]);
            for v in 1..V {
                *a = _mm512_fmadd_ps(qk[v], r[v], *a);
            }
        }
        acc
    }
}

/// [`scores_multi_f32_unchecked`] for heads of `16·V` values (V ≤ 4): the `Q` queries stay
/// in registers (at most 16 vectors), and rows go sixteen at a time, their partial sums
/// reduced together by [`sum16`] — one reduction per row and query was most of the
/// general kernel's time once a causal block keeps the rows in cache.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scores_multi_f32_vectors<const Q: usize, const V: usize>(
    q: &[f32],
    rows: &[f32],
    stride: usize,
    scale: f32,
    n: usize,
    out: &mut [f32],
) {
    // SAFETY: the caller guarantees the features, `q` holds Q·16·V values, `out` Q·n, and
    // each of the n rows lies inside `rows` with 16·V values.
    unsafe {
        let (pq, pr, po) = (q.as_ptr(), rows.as_ptr(), out.as_mut_ptr());
        let hd = 16 * V;
        let mut qv = [[_mm512_setzero_ps(); V]; Q];
        for (k, qk) in qv.iter_mut().enumerate() {
            for (v, x) in qk.iter_mut().enumerate() {
                *x = _mm512_loadu_ps(pq.add(k * hd + 16 * v));
            }
        }
        // A short last group pads with zero vectors: every row's score goes through the
        // same tree whatever `n` is, so a row scores the same bits in any tile.
        let vscale = _mm512_set1_ps(scale);
        let mut block = [[_mm512_setzero_ps(); 16]; Q];
        for j in (0..n).step_by(16) {
            let take = (n - j).min(16);
            if take < 16 {
                for b in &mut block {
                    b[take..].fill(_mm512_setzero_ps());
                }
            }
            for r in 0..take {
                let partials = row_partials::<Q, V>(&qv, pr.add((j + r) * stride));
                for (b, p) in block.iter_mut().zip(partials) {
                    b[r] = p;
                }
            }
            let m: __mmask16 = if take == 16 {
                0xFFFF
            } else {
                (1u16 << take) - 1
            };
            for (k, b) in block.iter().enumerate() {
                _mm512_mask_storeu_ps(po.add(k * n + j), m, _mm512_mul_ps(sum16(b), vscale));
            }
        }
    }
}

/// `out[k·hd..][..hd] += Σ_j w[k·n + j] · row j` for `Q` queries and `n` rows (row j at
/// `rows[j·stride]`), each row loaded once for all the queries.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn weighted_rows_multi_f32_unchecked<const Q: usize>(
    w: &[f32],
    n: usize,
    rows: &[f32],
    stride: usize,
    hd: usize,
    out: &mut [f32],
) {
    // SAFETY: the caller guarantees the features, `w` holds Q·n weights, `out` Q·hd values
    // and each of the n rows lies inside `rows` with hd values; partial vectors are masked.
    unsafe {
        let (pw, pr, po) = (w.as_ptr(), rows.as_ptr(), out.as_mut_ptr());
        // Column blocks of 64 values: Q × 4 accumulators stay in registers over all rows.
        let mut c0 = 0;
        while c0 < hd {
            let blocks = (hd - c0).div_ceil(16).min(4);
            let mut m = [0 as __mmask16; 4];
            for (b, mb) in m.iter_mut().enumerate().take(blocks) {
                let left = hd - c0 - 16 * b;
                *mb = if left >= 16 {
                    0xFFFF
                } else {
                    (1u16 << left) - 1
                };
            }
            let mut acc = [[_mm512_setzero_ps(); 4]; Q];
            for j in 0..n {
                let row = pr.add(j * stride + c0);
                let mut v = [_mm512_setzero_ps(); 4];
                for b in 0..blocks {
                    v[b] = _mm512_maskz_loadu_ps(m[b], row.add(16 * b));
                }
                for k in 0..Q {
                    let wk = _mm512_set1_ps(*pw.add(k * n + j));
                    for b in 0..blocks {
                        acc[k][b] = _mm512_fmadd_ps(wk, v[b], acc[k][b]);
                    }
                }
            }
            for k in 0..Q {
                for b in 0..blocks {
                    let o = po.add(k * hd + c0 + 16 * b);
                    _mm512_mask_storeu_ps(
                        o,
                        m[b],
                        _mm512_add_ps(_mm512_maskz_loadu_ps(m[b], o), acc[k][b]),
                    );
                }
            }
            c0 += 64;
        }
    }
}

/// `e^x` for 16 lanes of `x ≤ 0` (attention's shifted scores): Cody–Waite range reduction
/// by ln 2 and Cephes' degree-6 polynomial for `e^r` on |r| ≤ ln 2 / 2 (relative error
/// ~1e-7, what libm's `expf` gives to within an ulp or two), scaled by 2^n with `scalef`,
/// which underflows gracefully (to subnormals, then 0) below −87.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn exp_neg_ps(x: __m512) -> __m512 {
    let x = _mm512_max_ps(x, _mm512_set1_ps(-104.0));
    let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
        _mm512_mul_ps(x, _mm512_set1_ps(std::f32::consts::LOG2_E)),
    );
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693_359_4), x);
    let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.121_944_4e-4), r);
    let mut p = _mm512_set1_ps(1.987_569_1e-4);
    for c in [
        1.398_199_9e-3,
        8.333_452e-3,
        4.166_579_6e-2,
        0.166_666_65,
        0.5,
    ] {
        p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
    }
    let p = _mm512_fmadd_ps(
        p,
        _mm512_mul_ps(r, r),
        _mm512_add_ps(r, _mm512_set1_ps(1.0)),
    );
    _mm512_scalef_ps(p, n)
}

/// `s[j] = e^(s[j] − max)` for every j (`max` at least every `s[j]`), returning their sum:
/// a tile's softmax weights.
pub fn exp_shifted_sum(_: Avx512, s: &mut [f32], max: f32) -> f32 {
    #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
    unsafe fn run(s: &mut [f32], max: f32) -> f32 {
        // SAFETY: the caller guarantees the features; every access is masked to `s`.
        unsafe {
            let (p, n) = (s.as_mut_ptr(), s.len());
            let m = _mm512_set1_ps(max);
            let mut sum = _mm512_setzero_ps();
            let mut i = 0;
            while i < n {
                let k: __mmask16 = if n - i >= 16 {
                    0xFFFF
                } else {
                    (1u16 << (n - i)) - 1
                };
                let w = exp_neg_ps(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, p.add(i)), m));
                _mm512_mask_storeu_ps(p.add(i), k, w);
                sum = _mm512_mask_add_ps(sum, k, sum, w);
                i += 16;
            }
            _mm512_reduce_add_ps(sum)
        }
    }
    // SAFETY: the token proves the features.
    unsafe { run(s, max) }
}

/// `$kernel::<Q>(args)` for the query count `$q` (checked to be 1 to 4 before).
macro_rules! by_queries {
    ($q:expr, $kernel:ident($($arg:expr),*)) => {
        match $q {
            1 => $kernel::<1>($($arg),*),
            2 => $kernel::<2>($($arg),*),
            3 => $kernel::<3>($($arg),*),
            _ => $kernel::<4>($($arg),*),
        }
    };
}

/// The query count of a multi-query kernel call, checked: `vectors` holds 1 to
/// [`super::MULTI_QUERIES`] vectors of `hd` values (queries or outputs), `per_row` that many
/// runs of `n` (scores or weights), and the `n` rows of `stride` lie inside `rows`.
fn multi_queries(
    hd: usize,
    vectors: usize,
    per_row: usize,
    n: usize,
    rows: &[f32],
    stride: usize,
) -> usize {
    let queries = vectors.checked_div(hd).unwrap_or(0);
    assert!(
        (1..=super::MULTI_QUERIES).contains(&queries)
            && vectors == queries * hd
            && per_row == queries * n,
        "{queries} queries of {hd} values over {n} rows, given {vectors} and {per_row} values"
    );
    if let Some(last) = n.checked_sub(1) {
        assert!(
            last * stride + hd <= rows.len(),
            "{n} rows of stride {stride} and {hd} values exceed {}",
            rows.len()
        );
    }
    queries
}

/// [`scores_multi_f32_vectors`] for heads of 64 and 32 values (what `by_queries!` takes:
/// one const parameter).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scores_v4<const Q: usize>(
    q: &[f32],
    r: &[f32],
    s: usize,
    c: f32,
    n: usize,
    o: &mut [f32],
) {
    // SAFETY: as for scores_multi_f32_vectors, which the caller's checks satisfy.
    unsafe { scores_multi_f32_vectors::<Q, 4>(q, r, s, c, n, o) }
}

#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn scores_v2<const Q: usize>(
    q: &[f32],
    r: &[f32],
    s: usize,
    c: f32,
    n: usize,
    o: &mut [f32],
) {
    // SAFETY: as for scores_multi_f32_vectors, which the caller's checks satisfy.
    unsafe { scores_multi_f32_vectors::<Q, 2>(q, r, s, c, n, o) }
}

/// [`scores_multi_f32_unchecked`] for `q.len() / hd` queries (1 to
/// [`super::MULTI_QUERIES`]).
#[allow(clippy::too_many_arguments)]
pub fn scores_multi_f32(
    _: Avx512,
    q: &[f32],
    hd: usize,
    rows: &[f32],
    stride: usize,
    scale: f32,
    n: usize,
    out: &mut [f32],
) {
    let queries = multi_queries(hd, q.len(), out.len(), n, rows, stride);
    // SAFETY: the token proves the features; the checks bound every read and write (a
    // head of 16·V values is what the V-vector kernels read of q and of each row).
    unsafe {
        match hd {
            64 => by_queries!(queries, scores_v4(q, rows, stride, scale, n, out)),
            32 => by_queries!(queries, scores_v2(q, rows, stride, scale, n, out)),
            _ => by_queries!(
                queries,
                scores_multi_f32_unchecked(q, hd, rows, stride, scale, n, out)
            ),
        }
    }
}

/// [`weighted_rows_multi_f32_unchecked`] for `out.len() / hd` queries (1 to
/// [`super::MULTI_QUERIES`]).
pub fn weighted_rows_multi_f32(
    _: Avx512,
    w: &[f32],
    n: usize,
    rows: &[f32],
    stride: usize,
    hd: usize,
    out: &mut [f32],
) {
    let queries = multi_queries(hd, out.len(), w.len(), n, rows, stride);
    // SAFETY: the token proves the features; the checks bound every read and write.
    unsafe {
        by_queries!(
            queries,
            weighted_rows_multi_f32_unchecked(w, n, rows, stride, hd, out)
        )
    }
}

/// `a · b` over their common length.
pub fn dot_f32(_: Avx512, a: &[f32], b: &[f32]) -> f32 {
    // SAFETY: the token proves the features; the kernel reads the common length only.
    unsafe { dot_f32_unchecked(a, b) }
}

/// `w · x[t]` for four activations over their common length.
pub fn dot4_f32(_: Avx512, w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    // SAFETY: the token proves the features; the kernel reads the common length only.
    unsafe { dot4_f32_unchecked(w, x) }
}

/// Safe entry points, checked on every call exactly as the AVX2 ones are.
macro_rules! block_dot {
    ($($name:ident => $inner:ident, $block:expr, $bytes:expr, $uses_sums:expr;)*) => {$(
        pub fn $name(_: Avx512, row: &[u8], x: &[f32], sums: &[f32]) -> f32 {
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
