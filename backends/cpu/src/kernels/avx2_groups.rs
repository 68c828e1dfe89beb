//! The AVX2 forms of [`super::avx512_groups`]: weight blocks decoded 32 values at a time
//! into four 8-lane registers, exactly the reference dequantiser's values, for the
//! dequantisers (the many-token path) and the few-token row dots of batched decode, on the
//! hosts without AVX-512. Quant bytes are widened straight from memory (a load slot each,
//! not the shuffle port these cores are short of); a type whose bytes must be put together
//! first (APR's order, the Q5 fifth bits, Q6_K) assembles them in a 32-byte stack copy.
//!
//! Every function requires AVX2, FMA and F16C.

use std::arch::x86_64::*;

use kiln_core::QType;

use super::avx2::{f16_splat, f16x2, fifth_bits16, k_scales_mins};

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
    unsafe fn group(p: *const u8, head: &Self::Head, g: usize) -> [__m256; 4];
}

/// The eight bytes at `p` widened to 32-bit lanes.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn widen_u8(p: *const u8) -> __m256i {
    // SAFETY: the caller guarantees the features and eight readable bytes at `p`.
    unsafe { _mm256_cvtepu8_epi32(_mm_loadl_epi64(p as *const __m128i)) }
}

/// The 32 unsigned bytes at `q` (a stack copy) as four vectors of f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn bytes32(q: &[u8; 32]) -> [__m256; 4] {
    // SAFETY: the caller guarantees the features; each load reads 8 of the 32 bytes.
    unsafe {
        let p = std::hint::black_box(q.as_ptr());
        let v = |k: usize| _mm256_cvtepi32_ps(widen_u8(p.add(8 * k)));
        [v(0), v(1), v(2), v(3)]
    }
}

/// The 32 nibbles of the 16 bytes at `p` in ggml's order (byte i's low nibble is value i,
/// its high nibble value 16 + i), as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn nibbles32(p: *const u8) -> [__m256; 4] {
    // SAFETY: the caller guarantees the features and 16 readable bytes at `p`.
    unsafe {
        let (a, b) = (widen_u8(p), widen_u8(p.add(8)));
        let low = |v: __m256i| _mm256_cvtepi32_ps(_mm256_and_si256(v, _mm256_set1_epi32(15)));
        let high = |v: __m256i| _mm256_cvtepi32_ps(_mm256_srli_epi32(v, 4));
        [low(a), low(b), high(a), high(b)]
    }
}

/// The 5-bit quants of a Q5_0/Q5_1 block (fifth bits `qh`, nibbles at `qs`) as f32.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q5_quants(qh: u32, qs: *const u8) -> [__m256; 4] {
    // SAFETY: the caller guarantees the features and 16 readable bytes at `qs`.
    unsafe {
        let bytes = _mm_loadu_si128(qs as *const __m128i);
        let low4 = _mm_set1_epi8(0x0F);
        let mut q = [0u8; 32];
        _mm_storeu_si128(
            q.as_mut_ptr() as *mut __m128i,
            _mm_or_si128(_mm_and_si128(bytes, low4), fifth_bits16(qh)),
        );
        _mm_storeu_si128(
            q.as_mut_ptr().add(16) as *mut __m128i,
            _mm_or_si128(
                _mm_and_si128(_mm_srli_epi16(bytes, 4), low4),
                fifth_bits16(qh >> 16),
            ),
        );
        bytes32(&q)
    }
}

/// `f(v)` for each of four vectors.
macro_rules! each {
    ($v:expr, |$x:ident| $body:expr) => {{
        let v = $v;
        [
            {
                let $x = v[0];
                $body
            },
            {
                let $x = v[1];
                $body
            },
            {
                let $x = v[2];
                $body
            },
            {
                let $x = v[3];
                $body
            },
        ]
    }};
}

/// A K-quant super-block's eight sub-block scales `d·sc` and mins `dmin·m`.
#[derive(Clone, Copy)]
pub(super) struct KScales {
    pub(super) scale: [f32; 8],
    pub(super) min: [f32; 8],
}

/// The scales and mins of the Q4_K/Q5_K block at `p`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn k_scales(p: *const u8) -> KScales {
    // SAFETY: the caller guarantees the features and a whole block at `p`.
    unsafe {
        let (d, dmin) = f16x2(p);
        let (sc, m) = k_scales_mins(p.add(4));
        let mut out = KScales {
            scale: [0.0; 8],
            min: [0.0; 8],
        };
        _mm256_storeu_ps(out.scale.as_mut_ptr(), _mm256_mul_ps(sc, _mm256_set1_ps(d)));
        _mm256_storeu_ps(out.min.as_mut_ptr(), _mm256_mul_ps(m, _mm256_set1_ps(dmin)));
        out
    }
}

/// Group `g` of a Q4_K or Q5_K block (`qh` null for Q4_K): `d·sc·q − dmin·m`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn k4_group(head: &KScales, qh: *const u8, qs: *const u8, g: usize) -> [__m256; 4] {
    // SAFETY: the caller guarantees the features, a whole block's 32 fifth-bit bytes at `qh`
    // (when not null) and its 128 nibble bytes at `qs`.
    unsafe {
        let (scale, min) = (_mm256_set1_ps(head.scale[g]), _mm256_set1_ps(head.min[g]));
        // Sub-blocks 2i and 2i + 1 share the 32 bytes at 32i: low nibbles, then high ones.
        let bytes = qs.add(32 * (g / 2));
        let quant = |k: usize| {
            let v = widen_u8(bytes.add(8 * k));
            let mut q = if g % 2 == 0 {
                _mm256_and_si256(v, _mm256_set1_epi32(15))
            } else {
                _mm256_srli_epi32(v, 4)
            };
            if !qh.is_null() {
                // Bit g of qh byte l is the fifth bit of value l of sub-block g.
                let bit = _mm256_and_si256(
                    _mm256_srl_epi32(widen_u8(qh.add(8 * k)), _mm_cvtsi32_si128(g as i32)),
                    _mm256_set1_epi32(1),
                );
                q = _mm256_or_si256(q, _mm256_slli_epi32(bit, 4));
            }
            _mm256_sub_ps(_mm256_mul_ps(scale, _mm256_cvtepi32_ps(q)), min)
        };
        [quant(0), quant(1), quant(2), quant(3)]
    }
}

/// A Q6_K block's sixteen scales `d·sc`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_scales(p: *const u8) -> [f32; 16] {
    // SAFETY: the caller guarantees the features and a whole block at `p`.
    unsafe {
        let d = _mm256_set1_ps(
            half::f16::from_bits((p.add(208) as *const u16).read_unaligned()).to_f32(),
        );
        let sc = |k: usize| {
            _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                p.add(192 + 8 * k) as *const __m128i
            )))
        };
        let mut out = [0.0f32; 16];
        _mm256_storeu_ps(out.as_mut_ptr(), _mm256_mul_ps(sc(0), d));
        _mm256_storeu_ps(out.as_mut_ptr().add(8), _mm256_mul_ps(sc(1), d));
        out
    }
}

/// Group `g` of a Q6_K block: 6-bit quants (a nibble and two high bits) minus 32, an 8-bit
/// scale per 16 values; the 32 quants put together as bytes, then widened from a copy.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q6_k_group(p: *const u8, scales: &[f32; 16], g: usize) -> [__m256; 4] {
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
        let top = _mm256_and_si256(
            _mm256_slli_epi16(_mm256_srl_epi16(qh, _mm_cvtsi32_si128(2 * k as i32)), 4),
            _mm256_set1_epi8(0x30),
        );
        let mut q = [0u8; 32];
        _mm256_storeu_si256(
            q.as_mut_ptr() as *mut __m256i,
            _mm256_sub_epi8(_mm256_or_si256(nibble, top), _mm256_set1_epi8(32)),
        );
        let q = std::hint::black_box(q.as_ptr());
        let value = |j: usize| {
            let v = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(
                q.add(8 * j) as *const __m128i
            )));
            _mm256_mul_ps(_mm256_set1_ps(scales[8 * n + j / 2 + 2 * k]), v)
        };
        [value(0), value(1), value(2), value(3)]
    }
}

/// Group `g` of a Q2_K block: 2-bit quants (bits 2·(g % 4) of the 32 bytes at
/// 16 + 32·(g / 4)), a 4-bit scale and min per 16 values: `d·sc·q − dmin·m`.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q2_k_group(p: *const u8, g: usize) -> [__m256; 4] {
    // SAFETY: the caller guarantees the features and a whole block at `p`.
    unsafe {
        let (d, dmin) = f16x2(p.add(80));
        let bytes = p.add(16 + 32 * (g / 4));
        let shift = _mm_cvtsi32_si128(2 * (g % 4) as i32);
        let value = |k: usize| {
            let sc = *p.add(2 * g + k / 2);
            let (dl, ml) = (d * (sc & 0x0F) as f32, dmin * (sc >> 4) as f32);
            let q = _mm256_and_si256(
                _mm256_srl_epi32(widen_u8(bytes.add(8 * k)), shift),
                _mm256_set1_epi32(3),
            );
            _mm256_sub_ps(
                _mm256_mul_ps(_mm256_set1_ps(dl), _mm256_cvtepi32_ps(q)),
                _mm256_set1_ps(ml),
            )
        };
        [value(0), value(1), value(2), value(3)]
    }
}

/// Group `g` of a Q3_K block: 2-bit quants as Q2_K's (at 32 + 32·(g / 4)), less 4 where bit
/// g of the value's `hmask` byte is clear, a signed 6-bit scale per 16 values.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn q3_k_group(p: *const u8, g: usize) -> [__m256; 4] {
    // SAFETY: the caller guarantees the features and a whole block at `p`.
    unsafe {
        let d = half::f16::from_bits((p.add(108) as *const u16).read_unaligned()).to_f32();
        let scales = std::slice::from_raw_parts(p.add(96), 12);
        let bytes = p.add(32 + 32 * (g / 4));
        let (shift, plane) = (
            _mm_cvtsi32_si128(2 * (g % 4) as i32),
            _mm_cvtsi32_si128(g as i32),
        );
        let one = _mm256_set1_epi32(1);
        let value = |k: usize| {
            let dl = d * kiln_core::quant::kquants::q3_k_scale(scales, 2 * g + k / 2) as f32;
            let low = _mm256_and_si256(
                _mm256_srl_epi32(widen_u8(bytes.add(8 * k)), shift),
                _mm256_set1_epi32(3),
            );
            let high = _mm256_and_si256(_mm256_srl_epi32(widen_u8(p.add(8 * k)), plane), one);
            // low − 4 where the plane's bit is clear: low − 4 + 4·bit.
            let q = _mm256_add_epi32(
                _mm256_sub_epi32(low, _mm256_set1_epi32(4)),
                _mm256_slli_epi32(high, 2),
            );
            _mm256_mul_ps(_mm256_set1_ps(dl), _mm256_cvtepi32_ps(q))
        };
        [value(0), value(1), value(2), value(3)]
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
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn head($hp: *const u8) -> $head_ty {
                // SAFETY: the caller guarantees the features and a whole block at the pointer.
                #[allow(unused_unsafe)]
                unsafe { $head }
            }
            #[inline]
            #[target_feature(enable = "avx2,fma,f16c")]
            unsafe fn group($p: *const u8, $h: &$head_ty, $g: usize) -> [__m256; 4] {
                // SAFETY: the caller guarantees the features and a whole block at `p`.
                #[allow(unused_unsafe)]
                unsafe { $body }
            }
        }
    )*};
}

groups! {
    Q4_0, QType::Q4_0, 1, () = |_p| (), |p, _h, _g| {
        let d = f16_splat(p);
        each!(nibbles32(p.add(2)), |q| _mm256_mul_ps(_mm256_sub_ps(q, _mm256_set1_ps(8.0)), d))
    };
    /// APR's Q4: Q4_0's arithmetic, value 2k in the low nibble of byte k.
    AprQ4, QType::AprQ4, 1, () = |_p| (), |p, _h, _g| {
        let d = f16_splat(p);
        let bytes = _mm_loadu_si128(p.add(2) as *const __m128i);
        let low4 = _mm_set1_epi8(0x0F);
        let (lo, hi) = (_mm_and_si128(bytes, low4), _mm_and_si128(_mm_srli_epi16(bytes, 4), low4));
        let mut q = [0u8; 32];
        _mm_storeu_si128(q.as_mut_ptr() as *mut __m128i, _mm_unpacklo_epi8(lo, hi));
        _mm_storeu_si128(q.as_mut_ptr().add(16) as *mut __m128i, _mm_unpackhi_epi8(lo, hi));
        each!(bytes32(&q), |q| _mm256_mul_ps(_mm256_sub_ps(q, _mm256_set1_ps(8.0)), d))
    };
    Q4_1, QType::Q4_1, 1, () = |_p| (), |p, _h, _g| {
        let (d, m) = f16x2(p);
        let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
        each!(nibbles32(p.add(4)), |q| _mm256_add_ps(_mm256_mul_ps(d, q), m))
    };
    Q5_0, QType::Q5_0, 1, () = |_p| (), |p, _h, _g| {
        let d = f16_splat(p);
        let q = q5_quants((p.add(2) as *const u32).read_unaligned().to_le(), p.add(6));
        each!(q, |q| _mm256_mul_ps(d, _mm256_sub_ps(q, _mm256_set1_ps(16.0))))
    };
    Q5_1, QType::Q5_1, 1, () = |_p| (), |p, _h, _g| {
        let (d, m) = f16x2(p);
        let (d, m) = (_mm256_set1_ps(d), _mm256_set1_ps(m));
        let q = q5_quants((p.add(4) as *const u32).read_unaligned().to_le(), p.add(8));
        each!(q, |q| _mm256_add_ps(_mm256_mul_ps(d, q), m))
    };
    Q8_0, QType::Q8_0, 1, () = |_p| (), |p, _h, _g| {
        let d = f16_splat(p);
        let v = |k: usize| _mm256_mul_ps(d, _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(
            _mm_loadl_epi64(p.add(2 + 8 * k) as *const __m128i))));
        [v(0), v(1), v(2), v(3)]
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
#[target_feature(enable = "avx2,fma,f16c")]
pub(super) unsafe fn dequantize<G: Groups>(src: &[u8], out: &mut [f32]) {
    let (bytes, len) = (G::QTYPE.block_bytes(), G::QTYPE.block_len());
    for b in 0..(out.len() / len).min(src.len() / bytes) {
        // SAFETY: block b's bytes and values lie inside `src` and `out`.
        unsafe {
            let (p, y) = (src.as_ptr().add(b * bytes), out.as_mut_ptr().add(b * len));
            let head = G::head(p);
            for g in 0..G::GROUPS {
                let w = G::group(p, &head, g);
                for (k, w) in w.into_iter().enumerate() {
                    _mm256_storeu_ps(y.add(32 * g + 8 * k), w);
                }
            }
        }
    }
}

/// Rows decoded together by [`dot_tokens`].
const ROWS: usize = 2;

/// `out[r][t] = row r · x[t]` for two rows (each at `rows[r]`, `nb` blocks) and `T`
/// activations of `nb` blocks' values: each group of each row decoded once and multiplied
/// with every activation.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn rows_by_tokens<G: Groups, const T: usize>(
    rows: [*const u8; ROWS],
    x: [*const f32; T],
    nb: usize,
) -> [[f32; T]; ROWS] {
    // SAFETY: the caller guarantees the features, `nb` whole blocks at each row pointer
    // and `nb` blocks' values at each activation pointer.
    unsafe {
        let (bytes, len) = (G::QTYPE.block_bytes(), G::QTYPE.block_len());
        let mut acc = [[_mm256_setzero_ps(); T]; ROWS];
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
                        for (k, w) in w.iter().enumerate() {
                            acc[r][t] =
                                _mm256_fmadd_ps(*w, _mm256_loadu_ps(xt.add(8 * k)), acc[r][t]);
                        }
                    }
                }
            }
        }
        let mut out = [[0.0f32; T]; ROWS];
        for r in 0..ROWS {
            for t in 0..T {
                out[r][t] = super::avx2::hsum(acc[r][t]);
            }
        }
        out
    }
}

/// The row loop of [`dot_tokens`] for `T` activations: two rows a step (an odd last row
/// goes in as both; the repeat's sums are not kept), their bytes asked for ahead.
#[inline]
#[target_feature(enable = "avx2,fma,f16c")]
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
/// each) and one to four activations. Panics when the lengths disagree (never an
/// out-of-bounds read).
///
/// # Safety
/// The CPU has the module's features.
#[target_feature(enable = "avx2,fma,f16c")]
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
