//! Weight blocks decoded 32 values at a time into AVX-512 registers, exactly as the
//! reference dequantiser computes them (the same products and sums in the same order).
//! Two users: the dequantisers (each group stored), and the few-token row dots of batched
//! decode ([`dot_tokens`]), which keep each decoded group in registers and multiply it
//! with every token of the batch.
//!
//! Why the few-token kernel: a decode step of B sequences multiplies each weight row with
//! B activations. Dotting token by token decodes every weight B times; dequantising a row
//! to memory first (the prefill's path) pays a store and a reload per value, as much as the
//! FMAs at four tokens. Here four rows are decoded group by group straight into registers
//! and each group meets the activations of up to four tokens: sixteen accumulators, the
//! FMA unit the limit rather than the decoding.
//!
//! Every function requires AVX-512F, BW and VL plus AVX2, FMA and F16C.

use std::arch::x86_64::*;

use kiln_core::QType;

use super::avx2::f16x2;
// The scales are eight lanes' work: the AVX2 form serves both.
use super::avx2_groups::{k_scales, KScales};
use super::avx512::{f16_splat, iota16};

/// A block weight type seen as groups of 32 values.
pub(super) trait Groups {
    const QTYPE: QType;
    /// Groups in a block.
    const GROUPS: usize;
    /// What every group of a block needs (its scales as f32), worked out once a block.
    type Head: Copy;
    /// The head of the block at `p`.
    ///
    /// # Safety
    /// The CPU has the module's features and `p` points at a whole block.
    unsafe fn head(p: *const u8) -> Self::Head;
    /// Values `32g .. 32g + 32` of the block at `p` (whose head is `head`), as f32.
    ///
    /// # Safety
    /// As for [`Groups::head`]; `g < GROUPS`.
    unsafe fn group(p: *const u8, head: &Self::Head, g: usize) -> [__m512; 2];
}

/// A Q6_K block's sixteen scales `d·sc`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q6_k_scales(p: *const u8) -> [f32; 16] {
    // SAFETY: the caller guarantees the features and a whole block at `p`.
    unsafe {
        let d = half::f16::from_bits((p.add(208) as *const u16).read_unaligned()).to_f32();
        let sc = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(_mm_loadu_si128(
            p.add(192) as *const __m128i
        )));
        let mut out = [0.0f32; 16];
        _mm512_storeu_ps(out.as_mut_ptr(), _mm512_mul_ps(sc, _mm512_set1_ps(d)));
        out
    }
}

/// The 16 bytes at `p`, each widened to a 32-bit lane.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn widen_u8(p: *const u8) -> __m512i {
    // SAFETY: the caller guarantees the features and 16 readable bytes at `p`.
    unsafe { _mm512_cvtepu8_epi32(_mm_loadu_si128(p as *const __m128i)) }
}

/// The 5-bit values `(q | fifth << 4) − offset` of a Q5_0/Q5_1 block as f32: `qh` holds the
/// fifth bits, `qs` points at the 16 nibble bytes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q5_values(qh: u32, qs: *const u8, offset: i32) -> [__m512; 2] {
    // SAFETY: the caller guarantees the features and 16 readable bytes at `qs`.
    unsafe {
        let (bit4, off) = (_mm512_set1_epi32(16), _mm512_set1_epi32(offset));
        let idx = widen_u8(qs);
        let nibbles = [
            _mm512_and_si512(idx, _mm512_set1_epi32(15)),
            _mm512_srli_epi32(idx, 4),
        ];
        let value = |h: usize| {
            let fifth = (qh >> (16 * h)) as __mmask16;
            let q = _mm512_sub_epi32(
                _mm512_mask_or_epi32(nibbles[h], fifth, nibbles[h], bit4),
                off,
            );
            _mm512_cvtepi32_ps(q)
        };
        [value(0), value(1)]
    }
}

/// `d·(q − 8)` for the 32 four-bit values of a Q4_0-style block (scale at `p`, nibbles at
/// `p + 2`); `interleaved`: APR's order (value 2k in the low nibble of byte k), else
/// ggml's (value k low, k + 16 high).
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q4_symmetric(p: *const u8, interleaved: bool) -> [__m512; 2] {
    // SAFETY: the caller guarantees the features and 18 readable bytes at `p`.
    unsafe {
        let table = _mm512_mul_ps(_mm512_sub_ps(iota16(), _mm512_set1_ps(8.0)), f16_splat(p));
        let qs = _mm_loadu_si128(p.add(2) as *const __m128i);
        let (first, second) = if interleaved {
            let mask = _mm_set1_epi8(0x0F);
            let (lo, hi) = (
                _mm_and_si128(qs, mask),
                _mm_and_si128(_mm_srli_epi16(qs, 4), mask),
            );
            (
                _mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)),
                _mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)),
            )
        } else {
            // The permute reads only the low four bits of each index.
            let idx = _mm512_cvtepu8_epi32(qs);
            (idx, _mm512_srli_epi32(idx, 4))
        };
        [
            _mm512_permutexvar_ps(first, table),
            _mm512_permutexvar_ps(second, table),
        ]
    }
}

/// Group `g` of a Q4_K or Q5_K block (`qh` null for Q4_K): `d·sc·q − dmin·m` with the
/// sub-block's scale and min from `head`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn k4_group(head: &KScales, qh: *const u8, qs: *const u8, g: usize) -> [__m512; 2] {
    // SAFETY: the caller guarantees the features and a whole block's 32 fifth-bit bytes at
    // `qh` (when not null) and 128 nibble bytes at `qs`.
    unsafe {
        let (scale, min) = (_mm512_set1_ps(head.scale[g]), _mm512_set1_ps(head.min[g]));
        // Sub-blocks 2i and 2i + 1 share the 32 bytes at 32i: low nibbles, then high ones.
        let bytes = qs.add(32 * (g / 2));
        let nibbles = |h: usize| {
            let q = widen_u8(bytes.add(16 * h));
            if g % 2 == 0 {
                q
            } else {
                _mm512_srli_epi32(q, 4)
            }
        };
        if qh.is_null() {
            // Sixteen levels `d·sc·q − dmin·m` (each as the reference computes it: a product,
            // then a difference), looked up by the nibbles (the permute reads the low four
            // bits of each lane).
            let table = _mm512_sub_ps(_mm512_mul_ps(scale, iota16()), min);
            return [
                _mm512_permutexvar_ps(nibbles(0), table),
                _mm512_permutexvar_ps(nibbles(1), table),
            ];
        }
        let half = |h: usize| {
            let q = _mm512_and_si512(nibbles(h), _mm512_set1_epi32(15));
            // Bit g of qh byte l is the fifth bit of value l of sub-block g.
            let bits = widen_u8(qh.add(16 * h));
            let fifth = _mm512_test_epi32_mask(bits, _mm512_set1_epi32(1 << g));
            let q = _mm512_mask_add_epi32(q, fifth, q, _mm512_set1_epi32(16));
            _mm512_sub_ps(_mm512_mul_ps(scale, _mm512_cvtepi32_ps(q)), min)
        };
        [half(0), half(1)]
    }
}

/// Group `g` of a Q6_K block: 6-bit quants (a nibble and two high bits) minus 32, an 8-bit
/// scale per 16 values. The 32 quants are put together as bytes (one 256-bit vector for the
/// whole group), then widened: a third of the instructions of doing it in 32-bit lanes.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q6_k_group(p: *const u8, scales: &[f32; 16], g: usize) -> [__m512; 2] {
    // SAFETY: the caller guarantees the features and a whole block at `p`.
    unsafe {
        // Values 128n + 32k + l: the low (k < 2) or high nibble of byte 32·(k % 2) + l of
        // ql's 64n.., bits 2k..2k+2 of byte l of qh's 32n..
        let (n, k) = (g / 4, g % 4);
        let low4 = _mm256_set1_epi8(0x0F);
        let ql = _mm256_loadu_si256(p.add(64 * n + 32 * (k % 2)) as *const __m256i);
        let nibble = if k < 2 {
            _mm256_and_si256(ql, low4)
        } else {
            _mm256_and_si256(_mm256_srli_epi16(ql, 4), low4)
        };
        let qh = _mm256_loadu_si256(p.add(128 + 32 * n) as *const __m256i);
        // The two bits moved to bits 4 and 5 of each byte (16-bit shifts: the bits that
        // cross from the neighbouring byte are masked off).
        let top = _mm256_and_si256(
            _mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), 4),
            _mm256_set1_epi8(0x30),
        );
        let q = _mm256_sub_epi8(_mm256_or_si256(nibble, top), _mm256_set1_epi8(32));
        let value = |h: usize, q: __m128i| {
            let scale = _mm512_set1_ps(scales[8 * n + h + 2 * k]);
            _mm512_mul_ps(scale, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)))
        };
        [
            value(0, _mm256_castsi256_si128(q)),
            value(1, _mm256_extracti128_si256(q, 1)),
        ]
    }
}

/// Group `g` of a Q2_K block: 2-bit quants (bits 2·(g % 4) of the 32 bytes at
/// 16 + 32·(g / 4)), a 4-bit scale and min per 16 values: `d·sc·q − dmin·m`.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q2_k_group(p: *const u8, g: usize) -> [__m512; 2] {
    // SAFETY: the caller guarantees the features and a whole block at `p`.
    unsafe {
        let (d, dmin) = f16x2(p.add(80));
        let bytes = p.add(16 + 32 * (g / 4));
        let shift = _mm_cvtsi32_si128(2 * (g % 4) as i32);
        let half = |h: usize| {
            let sc = *p.add(2 * g + h);
            let (dl, ml) = (d * (sc & 0x0F) as f32, dmin * (sc >> 4) as f32);
            let q = _mm512_and_si512(
                _mm512_srl_epi32(widen_u8(bytes.add(16 * h)), shift),
                _mm512_set1_epi32(3),
            );
            _mm512_sub_ps(
                _mm512_mul_ps(_mm512_set1_ps(dl), _mm512_cvtepi32_ps(q)),
                _mm512_set1_ps(ml),
            )
        };
        [half(0), half(1)]
    }
}

/// Group `g` of a Q3_K block: 2-bit quants as Q2_K's (at 32 + 32·(g / 4)), less 4 where bit
/// g of the value's `hmask` byte is clear, a signed 6-bit scale per 16 values.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn q3_k_group(p: *const u8, g: usize) -> [__m512; 2] {
    // SAFETY: the caller guarantees the features and a whole block at `p`.
    unsafe {
        let d = half::f16::from_bits((p.add(108) as *const u16).read_unaligned()).to_f32();
        let scales = std::slice::from_raw_parts(p.add(96), 12);
        let bytes = p.add(32 + 32 * (g / 4));
        let shift = _mm_cvtsi32_si128(2 * (g % 4) as i32);
        let half = |h: usize| {
            let dl = d * kiln_core::quant::kquants::q3_k_scale(scales, 2 * g + h) as f32;
            let low = _mm512_and_si512(
                _mm512_srl_epi32(widen_u8(bytes.add(16 * h)), shift),
                _mm512_set1_epi32(3),
            );
            let high = _mm512_test_epi32_mask(widen_u8(p.add(16 * h)), _mm512_set1_epi32(1 << g));
            let q = _mm512_mask_sub_epi32(
                _mm512_sub_epi32(low, _mm512_set1_epi32(4)),
                high,
                low,
                _mm512_setzero_si512(),
            );
            _mm512_mul_ps(_mm512_set1_ps(dl), _mm512_cvtepi32_ps(q))
        };
        [half(0), half(1)]
    }
}

macro_rules! groups {
    ($($(#[$doc:meta])* $name:ident, $qtype:expr, $groups:expr, $head_ty:ty = |$hp:ident| $head:expr,
        |$p:ident, $h:ident, $g:ident| $body:expr;)*) => {$(
        $(#[$doc])*
        pub(super) struct $name;
        impl Groups for $name {
            const QTYPE: QType = $qtype;
            const GROUPS: usize = $groups;
            type Head = $head_ty;
            #[inline]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            unsafe fn head($hp: *const u8) -> $head_ty {
                // SAFETY: the caller guarantees the features and a whole block at the pointer.
                #[allow(unused_unsafe)]
                unsafe { $head }
            }
            #[inline]
            #[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
            unsafe fn group($p: *const u8, $h: &$head_ty, $g: usize) -> [__m512; 2] {
                // SAFETY: the caller guarantees the features and a whole block at `p`.
                #[allow(unused_unsafe)]
                unsafe { $body }
            }
        }
    )*};
}

groups! {
    Q4_0, QType::Q4_0, 1, () = |_p| (), |p, _h, _g| q4_symmetric(p, false);
    /// APR's Q4: Q4_0's arithmetic, nibbles in value order.
    AprQ4, QType::AprQ4, 1, () = |_p| (), |p, _h, _g| q4_symmetric(p, true);
    Q4_1, QType::Q4_1, 1, () = |_p| (), |p, _h, _g| {
        let (d, m) = f16x2(p);
        let (table, m) = (_mm512_mul_ps(iota16(), _mm512_set1_ps(d)), _mm512_set1_ps(m));
        let idx = widen_u8(p.add(4));
        [
            _mm512_add_ps(_mm512_permutexvar_ps(idx, table), m),
            _mm512_add_ps(_mm512_permutexvar_ps(_mm512_srli_epi32(idx, 4), table), m),
        ]
    };
    Q5_0, QType::Q5_0, 1, () = |_p| (), |p, _h, _g| {
        let d = f16_splat(p);
        let q = q5_values((p.add(2) as *const u32).read_unaligned(), p.add(6), 16);
        [_mm512_mul_ps(d, q[0]), _mm512_mul_ps(d, q[1])]
    };
    Q5_1, QType::Q5_1, 1, () = |_p| (), |p, _h, _g| {
        let (d, m) = f16x2(p);
        let (d, m) = (_mm512_set1_ps(d), _mm512_set1_ps(m));
        let q = q5_values((p.add(4) as *const u32).read_unaligned(), p.add(8), 0);
        [_mm512_add_ps(_mm512_mul_ps(d, q[0]), m), _mm512_add_ps(_mm512_mul_ps(d, q[1]), m)]
    };
    Q8_0, QType::Q8_0, 1, () = |_p| (), |p, _h, _g| {
        let d = f16_splat(p);
        let value = |h: usize| {
            let q = _mm_loadu_si128(p.add(2 + 16 * h) as *const __m128i);
            _mm512_mul_ps(d, _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q)))
        };
        [value(0), value(1)]
    };
    Q4K, QType::Q4_K, 8, KScales = |p| k_scales(p), |p, h, g| k4_group(h, std::ptr::null(), p.add(16), g);
    Q5K, QType::Q5_K, 8, KScales = |p| k_scales(p), |p, h, g| k4_group(h, p.add(16), p.add(48), g);
    Q6K, QType::Q6_K, 8, [f32; 16] = |p| q6_k_scales(p), |p, h, g| q6_k_group(p, h, g);
    Q2K, QType::Q2_K, 8, () = |_p| (), |p, _h, g| q2_k_group(p, g);
    Q3K, QType::Q3_K, 8, () = |_p| (), |p, _h, g| q3_k_group(p, g);
}

/// Dequantises the whole blocks both `src` and `out` hold.
///
/// # Safety
/// The CPU has the module's features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dequantize<G: Groups>(src: &[u8], out: &mut [f32]) {
    let (bytes, len) = (G::QTYPE.block_bytes(), G::QTYPE.block_len());
    for b in 0..(out.len() / len).min(src.len() / bytes) {
        // SAFETY: block b's bytes and values lie inside `src` and `out`.
        unsafe {
            let (p, y) = (src.as_ptr().add(b * bytes), out.as_mut_ptr().add(b * len));
            let head = G::head(p);
            for g in 0..G::GROUPS {
                let w = G::group(p, &head, g);
                _mm512_storeu_ps(y.add(32 * g), w[0]);
                _mm512_storeu_ps(y.add(32 * g + 16), w[1]);
            }
        }
    }
}

/// Rows decoded together by [`dot_tokens`].
const ROWS: usize = 2;

/// `out[r][t] = row r · x[t]` for four rows (each at `rows[r]`, `nb` blocks) and `T`
/// activations of `nb` blocks' values: each group of each row decoded once, into registers,
/// and multiplied with every activation.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn rows_by_tokens<G: Groups, const T: usize>(
    rows: [*const u8; ROWS],
    x: [*const f32; T],
    nb: usize,
) -> [[f32; T]; ROWS] {
    // SAFETY: the caller guarantees the features, `nb` whole blocks at each row pointer
    // and `nb` blocks' values at each activation pointer.
    unsafe {
        let (bytes, len) = (G::QTYPE.block_bytes(), G::QTYPE.block_len());
        let mut acc = [[_mm512_setzero_ps(); T]; ROWS];
        for b in 0..nb {
            let mut heads = [G::head(rows[0].add(b * bytes)); ROWS];
            for r in 1..ROWS {
                heads[r] = G::head(rows[r].add(b * bytes));
            }
            for g in 0..G::GROUPS {
                let at = b * len + 32 * g;
                for r in 0..ROWS {
                    let w = G::group(rows[r].add(b * bytes), &heads[r], g);
                    for t in 0..T {
                        let xt = x[t].add(at);
                        acc[r][t] = _mm512_fmadd_ps(w[0], _mm512_loadu_ps(xt), acc[r][t]);
                        acc[r][t] = _mm512_fmadd_ps(w[1], _mm512_loadu_ps(xt.add(16)), acc[r][t]);
                    }
                }
            }
        }
        // Loops, not `map`: a closure would not inherit the target features.
        let mut out = [[0.0f32; T]; ROWS];
        for r in 0..ROWS {
            for t in 0..T {
                out[r][t] = _mm512_reduce_add_ps(acc[r][t]);
            }
        }
        out
    }
}

/// The row loop of [`dot_tokens`] for `T` activations: four rows a step (a short last
/// step repeats its last row; the repeats' sums are not kept), their bytes asked for ahead.
#[inline]
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
unsafe fn each_row_group<G: Groups, const T: usize>(
    rows: &[u8],
    row_bytes: usize,
    x: [&[f32]; T],
    outs: &mut [&mut [f32]],
) {
    let n = outs[0].len();
    let nb = row_bytes / G::QTYPE.block_bytes();
    let xp = x.map(<[f32]>::as_ptr);
    let mut r0 = 0;
    while r0 < n {
        let nr = ROWS.min(n - r0);
        for r in r0..r0 + nr {
            super::prefetch_ahead(rows, row_bytes, r);
        }
        // SAFETY: rows r0 + min(j, nr − 1) are whole rows inside `rows` (the caller checked
        // its length), each activation holds nb blocks' values.
        let sums = unsafe {
            let p = std::array::from_fn(|j| rows.as_ptr().add((r0 + j.min(nr - 1)) * row_bytes));
            rows_by_tokens::<G, T>(p, xp, nb)
        };
        for (j, row_sums) in sums.iter().enumerate().take(nr) {
            for (out, &s) in outs.iter_mut().zip(row_sums) {
                out[r0 + j] = s;
            }
        }
        r0 += nr;
    }
}

/// `outs[t][r] = row r · xs[t]` for the `outs[t].len()` rows packed in `rows` (`row_bytes`
/// each) and one to four activations: the few-token product of batched decode. Panics when
/// the lengths disagree (never an out-of-bounds read).
///
/// # Safety
/// The CPU has the module's features.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx2,fma,f16c")]
pub(super) unsafe fn dot_tokens<G: Groups>(
    rows: &[u8],
    row_bytes: usize,
    xs: &[&[f32]],
    outs: &mut [&mut [f32]],
) {
    super::check_token_rows(G::QTYPE, rows, row_bytes, xs, outs);
    // SAFETY: the features are the caller's promise; the lengths were checked above.
    unsafe {
        match *xs {
            [a] => each_row_group::<G, 1>(rows, row_bytes, [a], outs),
            [a, b] => each_row_group::<G, 2>(rows, row_bytes, [a, b], outs),
            [a, b, c] => each_row_group::<G, 3>(rows, row_bytes, [a, b, c], outs),
            [a, b, c, d] => each_row_group::<G, 4>(rows, row_bytes, [a, b, c, d], outs),
            _ => unreachable!("one to four activations (checked above)"),
        }
    }
}
