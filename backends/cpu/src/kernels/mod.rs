//! Row-dot kernels: the dot product of one quantised weight row with an f32 activation,
//! dequantising block by block on the fly. Every matrix multiply in the executor ends up
//! here, so each qtype gets its own type and `enum_dispatch` resolves the type once per
//! chunk of rows rather than once per value.
//!
//! Three implementations per hot type: AVX-512 (`avx512`, sixteen lanes, 4- and 5-bit
//! values looked up by permutes), AVX2+FMA+F16C (`avx2`) and a portable one that
//! dequantises a block into register-sized scratch and runs a plain f32 dot; the widest
//! the CPU runs is picked at load. `avx512_groups` and `avx2_groups` decode blocks 32
//! values at a time into registers for the dequantisers and the few-token products of
//! batched decode. Activations are never quantised here: this backend is the oracle. [`q8`] holds the opt-in integer kernels on 8-bit activations (llama.cpp's
//! arithmetic), which the executor uses only when the caller asks for them.

use enum_dispatch::enum_dispatch;
use kiln_core::QType;

use crate::dequant;

/// Defines, in an instruction set's module, for each type with a `Groups` decoder in its
/// `groups` module: `pub fn $dequant(token, src, out)`, which dequantises the whole blocks
/// both `src` and `out` hold (bit for bit the reference dequantiser's values), and, where
/// named, `pub fn $tokens(token, rows, row_bytes, xs, outs)`, the few-token row dot.
macro_rules! group_kernels {
    ($token:ty; $($dequant:ident $(, $tokens:ident)? => $groups:ty;)*) => {$(
        pub fn $dequant(_: $token, src: &[u8], out: &mut [f32]) {
            // SAFETY: the token proves the features; `dequantize` stays inside both slices.
            unsafe { groups::dequantize::<$groups>(src, out) }
        }
        $(
            pub fn $tokens(_: $token, rows: &[u8], row_bytes: usize, xs: &[&[f32]], outs: &mut [&mut [f32]]) {
                // SAFETY: the token proves the features; `dot_tokens` checks the lengths.
                unsafe { groups::dot_tokens::<$groups>(rows, row_bytes, xs, outs) }
            }
        )?
    )*};
}

#[cfg(target_arch = "x86_64")]
mod avx2;

#[cfg(target_arch = "x86_64")]
mod avx512;

#[cfg(target_arch = "x86_64")]
mod avx2_q8;

#[cfg(target_arch = "x86_64")]
mod avx512_groups;

#[cfg(target_arch = "x86_64")]
mod avx2_groups;

pub mod q8;

#[cfg(target_arch = "x86_64")]
pub use avx2::Avx2;
#[cfg(target_arch = "x86_64")]
pub use avx512::Avx512;

/// Stands in for the AVX2 token where the kernels do not exist: no value can be made.
#[cfg(not(target_arch = "x86_64"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Avx2 {}

#[cfg(not(target_arch = "x86_64"))]
impl Avx2 {
    pub fn detect() -> Option<Avx2> {
        None
    }
}

/// Stands in for the AVX-512 token where the kernels do not exist: no value can be made.
#[cfg(not(target_arch = "x86_64"))]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Avx512 {}

#[cfg(not(target_arch = "x86_64"))]
impl Avx512 {
    pub fn detect() -> Option<Avx512> {
        None
    }
    pub fn avx2(self) -> Avx2 {
        match self {}
    }
}

/// Whether the AVX2 kernels can run on this CPU.
pub fn simd_available() -> bool {
    Avx2::detect().is_some()
}

/// The instruction sets the block kernels come in, narrowest first.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Portable,
    Avx2,
    Avx512,
}

impl Isa {
    /// Every set this CPU runs, narrowest first.
    pub fn available() -> Vec<Isa> {
        [Isa::Portable, Isa::Avx2, Isa::Avx512]
            .into_iter()
            .filter(|&isa| isa == Isa::Portable || Simd::detect(isa).map(Simd::isa) == Some(isa))
            .collect()
    }

    /// The widest set this CPU runs.
    pub fn best() -> Isa {
        Simd::detect(Isa::Avx512).map_or(Isa::Portable, Simd::isa)
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Portable => "portable",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// Proof of the SIMD kernels a [`Kernel`] runs: made only by detection.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Simd {
    Avx2(Avx2),
    Avx512(Avx512),
}

impl Simd {
    /// The widest kernels this CPU runs, up to `max`; `None` for the portable ones.
    pub fn detect(max: Isa) -> Option<Simd> {
        match max {
            Isa::Portable => None,
            Isa::Avx2 => Avx2::detect().map(Simd::Avx2),
            Isa::Avx512 => Avx512::detect()
                .map(Simd::Avx512)
                .or_else(|| Avx2::detect().map(Simd::Avx2)),
        }
    }

    pub fn isa(self) -> Isa {
        match self {
            Simd::Avx2(_) => Isa::Avx2,
            Simd::Avx512(_) => Isa::Avx512,
        }
    }

    /// The AVX2 token (every CPU with the AVX-512 kernels has it too), for the f32 dots.
    pub fn avx2(self) -> Avx2 {
        match self {
            Simd::Avx2(t) => t,
            Simd::Avx512(t) => t.avx2(),
        }
    }
}

/// Sums of the activation over each 32-value block. Types with a per-block offset
/// (`d·q + m`) fold the offset into one multiply by this sum instead of adding it to every
/// value. Exact f32 sums: nothing about the activation is approximated.
pub fn block_sums(x: &[f32], out: &mut [f32]) {
    for (s, c) in out.iter_mut().zip(x.chunks_exact(32)) {
        *s = c.iter().sum();
    }
}

/// An activation ready for [`RowDot`]: the values and their 32-value block sums.
#[derive(Clone, Copy)]
pub struct Act<'a> {
    pub x: &'a [f32],
    /// `x.len() / 32` sums (empty for float types, which do not use them).
    pub sums: &'a [f32],
}

/// Dot products of weight rows with activations.
#[enum_dispatch]
pub trait RowDot {
    /// `out[r] = row r · x` for the `out.len()` rows packed in `rows` (`row_bytes` each).
    fn dot_rows(&self, rows: &[u8], row_bytes: usize, x: Act<'_>, out: &mut [f32]);
    /// One row, dequantised into `out` (its length is the row length).
    fn dequant_row(&self, row: &[u8], out: &mut [f32]);
    /// `outs[t][r] = row r · xs[t]` for one to [`TOKENS_AT_ONCE`] activations (a batched
    /// decode's tokens). Kernels that can decode a weight once for all of them do;
    /// the others dot token by token.
    fn dot_rows_tokens(
        &self,
        rows: &[u8],
        row_bytes: usize,
        xs: &[Act<'_>],
        outs: &mut [&mut [f32]],
    ) {
        for (x, out) in xs.iter().zip(outs.iter_mut()) {
            self.dot_rows(rows, row_bytes, *x, out);
        }
    }
}

/// Panics unless `rows` holds `outs[t].len()` whole rows of `row_bytes` bytes of `q` (the
/// same count for every t) and `xs` one to [`TOKENS_AT_ONCE`] activations of a row's values,
/// one per output: what the few-token kernels rely on to stay inside their slices.
#[cfg(target_arch = "x86_64")]
fn check_token_rows(q: QType, rows: &[u8], row_bytes: usize, xs: &[&[f32]], outs: &[&mut [f32]]) {
    let n = outs.first().map_or(0, |o| o.len());
    let cols = row_bytes / q.block_bytes() * q.block_len();
    assert!(
        (1..=TOKENS_AT_ONCE).contains(&xs.len())
            && xs.len() == outs.len()
            && row_bytes.is_multiple_of(q.block_bytes())
            && rows.len() >= n * row_bytes
            && xs.iter().all(|x| x.len() == cols)
            && outs.iter().all(|o| o.len() == n),
        "dot_tokens ({q}): {} activations of {:?} values for rows of {row_bytes} bytes",
        xs.len(),
        xs.iter().map(|x| x.len()).collect::<Vec<_>>()
    );
}

/// Activations [`RowDot::dot_rows_tokens`] takes at most.
pub const TOKENS_AT_ONCE: usize = 4;

/// f32 dot product, vectorised when given a SIMD token.
#[inline]
pub fn dot_f32(simd: Option<Simd>, a: &[f32], b: &[f32]) -> f32 {
    #[cfg(target_arch = "x86_64")]
    match simd {
        Some(Simd::Avx512(t)) => return avx512::dot_f32(t, a, b),
        Some(Simd::Avx2(t)) => return avx2::dot_f32(t, a, b),
        None => {}
    }
    let _ = simd;
    dot_f32_portable(a, b)
}

/// `out[j] = scale · (q · row j)` for `out.len()` rows of `rows`, row j at `j·stride`
/// (attention scores of one query against a tile of keys).
#[inline]
pub fn scores_f32(
    simd: Option<Simd>,
    q: &[f32],
    rows: &[f32],
    stride: usize,
    scale: f32,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(Simd::Avx512(t)) = simd {
        return avx512::scores_f32(t, q, rows, stride, scale, out);
    }
    for (j, o) in out.iter_mut().enumerate() {
        *o = dot_f32(simd, q, &rows[j * stride..][..q.len()]) * scale;
    }
}

/// `out += Σ_j w[j] · row j` for `w.len()` rows of `rows`, row j at `j·stride`, over
/// `out.len()` values of each (attention's weighted sum of a tile of values).
#[inline]
pub fn weighted_rows_f32(
    simd: Option<Simd>,
    w: &[f32],
    rows: &[f32],
    stride: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(Simd::Avx512(t)) = simd {
        return avx512::weighted_rows_f32(t, w, rows, stride, out);
    }
    let hd = out.len();
    for (j, &wj) in w.iter().enumerate() {
        axpy_f32(simd, wj, &rows[j * stride..][..hd], out);
    }
}

/// Queries a multi-query attention kernel call takes at most (four keep the accumulators of
/// a 64-value column block of each in registers).
pub const MULTI_QUERIES: usize = 4;

/// `out[k·n + j] = scale · (q_k · row j)` for the queries `q_k = q[k·hd..][..hd]` (1 to
/// [`MULTI_QUERIES`] of them) against `n` rows of `rows`, row j at `j·stride`: the heads of
/// a GQA group scored against a tile of their shared keys, each key read once.
#[inline]
#[allow(clippy::too_many_arguments)]
pub fn scores_multi_f32(
    simd: Option<Simd>,
    q: &[f32],
    hd: usize,
    rows: &[f32],
    stride: usize,
    scale: f32,
    n: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(Simd::Avx512(t)) = simd {
        return avx512::scores_multi_f32(t, q, hd, rows, stride, scale, n, out);
    }
    for (qk, ok) in q.chunks_exact(hd).zip(out.chunks_exact_mut(n)) {
        scores_f32(simd, qk, rows, stride, scale, ok);
    }
}

/// `out[k·hd..][..hd] += Σ_j w[k·n + j] · row j` for 1 to [`MULTI_QUERIES`] queries over
/// `n` rows of `rows` (row j at `j·stride`): the weighted sums of a GQA group's heads over
/// a tile of their shared values, each value row read once.
#[inline]
pub fn weighted_rows_multi_f32(
    simd: Option<Simd>,
    w: &[f32],
    n: usize,
    rows: &[f32],
    stride: usize,
    hd: usize,
    out: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if let Some(Simd::Avx512(t)) = simd {
        return avx512::weighted_rows_multi_f32(t, w, n, rows, stride, hd, out);
    }
    for (wk, ok) in w.chunks_exact(n).zip(out.chunks_exact_mut(hd)) {
        weighted_rows_f32(simd, wk, rows, stride, ok);
    }
}

/// `s[j] = e^(s[j] − max)` for every j (`max` at least every `s[j]`), returning their sum:
/// the softmax weights of an attention tile, vectorised with AVX-512 (a polynomial exp as
/// accurate as libm's to an ulp or two), libm's `expf` otherwise.
#[inline]
pub fn exp_shifted_sum(simd: Option<Simd>, s: &mut [f32], max: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    if let Some(Simd::Avx512(t)) = simd {
        return avx512::exp_shifted_sum(t, s, max);
    }
    let _ = simd;
    let mut sum = 0.0;
    for w in s.iter_mut() {
        *w = (*w - max).exp();
        sum += *w;
    }
    sum
}

/// `y += a·x` over their common length, vectorised when given a SIMD token.
#[inline]
pub fn axpy_f32(simd: Option<Simd>, a: f32, x: &[f32], y: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if let Some(s) = simd {
        return avx2::axpy_f32(s.avx2(), a, x, y);
    }
    let _ = simd;
    for (y, &x) in y.iter_mut().zip(x) {
        *y += a * x;
    }
}

/// `w · x[t]` for four activations, reading `w` once.
#[inline]
pub fn dot4_f32(simd: Option<Simd>, w: &[f32], x: [&[f32]; 4]) -> [f32; 4] {
    #[cfg(target_arch = "x86_64")]
    match simd {
        Some(Simd::Avx512(t)) => return avx512::dot4_f32(t, w, x),
        Some(Simd::Avx2(t)) => return avx2::dot4_f32(t, w, x),
        None => {}
    }
    let _ = simd;
    x.map(|x| dot_f32_portable(w, x))
}

/// `w[r] · x[t]` for four weight rows and four activations (AVX-512 only: the AVX2
/// register file cannot hold sixteen accumulators and the operands).
#[cfg(target_arch = "x86_64")]
#[inline]
pub fn dot4x4_f32(t: Avx512, w: [&[f32]; 4], x: [&[f32]; 4]) -> [[f32; 4]; 4] {
    avx512::dot4x4_f32(t, w, x)
}

/// `w[r] · x[t]` for two weight rows and four activations (the AVX2 register block).
#[cfg(target_arch = "x86_64")]
#[inline]
pub fn dot2x4_f32(t: Avx2, w: [&[f32]; 2], x: [&[f32]; 4]) -> [[f32; 4]; 2] {
    avx2::dot2x4_f32(t, w, x)
}

/// Eight independent partial sums so the compiler can keep them in one vector register.
#[inline]
pub fn dot_f32_portable(a: &[f32], b: &[f32]) -> f32 {
    let n = a.len().min(b.len());
    let (a, b) = (&a[..n], &b[..n]);
    let mut acc = [0.0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut tail = 0.0;
    for (x, y) in ra.iter().zip(rb) {
        tail += x * y;
    }
    (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]) + tail
}

/// Portable fused dot for a block type: dequantise each block into a stack buffer, dot it.
#[inline(always)]
fn blockwise_dot<const B: usize>(
    row: &[u8],
    block_bytes: usize,
    x: &[f32],
    f: fn(&[u8], &mut [f32]),
) -> f32 {
    let mut buf = [0.0f32; B];
    let mut sum = 0.0f32;
    for (blk, xs) in row.chunks_exact(block_bytes).zip(x.chunks_exact(B)) {
        f(blk, &mut buf);
        sum += dot_f32_portable(&buf, xs);
    }
    sum
}

/// How far ahead of the row being dotted its weight bytes are asked for. A decode step
/// streams each weight once, and without the hint a core computes and then waits for memory
/// in turn: on a 2-core Xeon (Emerald Rapids, KVM) one thread decoded SmolLM2 Q4_1 at
/// 4.8 GB/s, where its kernel runs at 8.8 GB/s from L2 and a plain read streams 12 GB/s.
/// 4–8 KB ahead measured best there (tg64, one thread: none 47–53 tok/s, 2 KB 62,
/// 6 KB 70–71, 16 KB 62; docs/benchmarks.md).
const PREFETCH_DISTANCE: usize = 6144;

/// Asks for the bytes `PREFETCH_DISTANCE` ahead of row `i` of `rows` while row `i` is
/// dotted: one row's worth of cache lines per row, so the stream stays that far ahead.
#[inline(always)]
pub(crate) fn prefetch_ahead(rows: &[u8], row_bytes: usize, i: usize) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let start = i * row_bytes + PREFETCH_DISTANCE;
        let end = (start + row_bytes).min(rows.len());
        let mut at = start;
        while at < end {
            // SAFETY: `at` < rows.len(), so the address lies inside `rows`; a prefetch
            // reads nothing architecturally and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(rows.as_ptr().add(at) as *const i8) };
            at += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (rows, row_bytes, i);
}

macro_rules! block_kernel {
    ($(#[$doc:meta])* $name:ident, $qtype:expr, $block:expr, $deq:path, $simd_fn:ident, $simd_deq:ident, $simd_tokens:ident, avx2_tokens: [$($avx2_tokens:ident)?]) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        pub struct $name {
            simd: Option<Simd>,
        }
        impl RowDot for $name {
            fn dot_rows(&self, rows: &[u8], row_bytes: usize, x: Act<'_>, out: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                match self.simd {
                    Some(Simd::Avx512(t)) => {
                        for (i, (o, row)) in out.iter_mut().zip(rows.chunks_exact(row_bytes)).enumerate() {
                            prefetch_ahead(rows, row_bytes, i);
                            *o = avx512::$simd_fn(t, row, x.x, x.sums);
                        }
                        return;
                    }
                    Some(Simd::Avx2(t)) => {
                        for (i, (o, row)) in out.iter_mut().zip(rows.chunks_exact(row_bytes)).enumerate() {
                            prefetch_ahead(rows, row_bytes, i);
                            *o = avx2::$simd_fn(t, row, x.x, x.sums);
                        }
                        return;
                    }
                    None => {}
                }
                let bb = $qtype.block_bytes();
                for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
                    *o = blockwise_dot::<$block>(row, bb, x.x, $deq);
                }
            }
            fn dequant_row(&self, row: &[u8], out: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                match self.simd {
                    Some(Simd::Avx512(t)) => return avx512::$simd_deq(t, row, out),
                    Some(Simd::Avx2(t)) => return avx2::$simd_deq(t, row, out),
                    None => {}
                }
                dequant::dequantize_into($qtype, row, out);
            }
            fn dot_rows_tokens(&self, rows: &[u8], row_bytes: usize, xs: &[Act<'_>], outs: &mut [&mut [f32]]) {
                #[cfg(target_arch = "x86_64")]
                if let Some(simd) = self.simd {
                    let mut x: [&[f32]; TOKENS_AT_ONCE] = [&[]; TOKENS_AT_ONCE];
                    for (x, a) in x.iter_mut().zip(xs) {
                        *x = a.x;
                    }
                    let x = &x[..xs.len()];
                    match simd {
                        Simd::Avx512(t) => return avx512::$simd_tokens(t, rows, row_bytes, x, outs),
                        $(Simd::Avx2(t) => return avx2::$avx2_tokens(t, rows, row_bytes, x, outs),)?
                        #[allow(unreachable_patterns)]
                        Simd::Avx2(_) => {}
                    }
                }
                for (x, out) in xs.iter().zip(outs.iter_mut()) {
                    self.dot_rows(rows, row_bytes, *x, out);
                }
            }
        }
    };
}

macro_rules! portable_kernel {
    ($(#[$doc:meta])* $name:ident, $qtype:expr, $block:expr, $deq:path) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        pub struct $name;
        impl RowDot for $name {
            fn dot_rows(&self, rows: &[u8], row_bytes: usize, x: Act<'_>, out: &mut [f32]) {
                let bb = $qtype.block_bytes();
                for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
                    *o = blockwise_dot::<$block>(row, bb, x.x, $deq);
                }
            }
            fn dequant_row(&self, row: &[u8], out: &mut [f32]) {
                dequant::dequantize_into($qtype, row, out);
            }
        }
    };
}

block_kernel!(
    Q4_0Kernel,
    QType::Q4_0,
    32,
    dequant::block_q4_0,
    dot_q4_0,
    dequant_q4_0,
    tokens_q4_0,
    avx2_tokens: [tokens_q4_0]
);
block_kernel!(
    Q4_1Kernel,
    QType::Q4_1,
    32,
    dequant::block_q4_1,
    dot_q4_1,
    dequant_q4_1,
    tokens_q4_1,
    avx2_tokens: [tokens_q4_1]
);
block_kernel!(
    Q5_0Kernel,
    QType::Q5_0,
    32,
    dequant::block_q5_0,
    dot_q5_0,
    dequant_q5_0,
    tokens_q5_0,
    avx2_tokens: [tokens_q5_0]
);
block_kernel!(
    Q5_1Kernel,
    QType::Q5_1,
    32,
    dequant::block_q5_1,
    dot_q5_1,
    dequant_q5_1,
    tokens_q5_1,
    avx2_tokens: [tokens_q5_1]
);
block_kernel!(
    Q8_0Kernel,
    QType::Q8_0,
    32,
    dequant::block_q8_0,
    dot_q8_0,
    dequant_q8_0,
    tokens_q8_0,
    avx2_tokens: [tokens_q8_0]
);
block_kernel!(
    Q4KKernel,
    QType::Q4_K,
    256,
    dequant::block_q4_k,
    dot_q4_k,
    dequant_q4_k,
    tokens_q4_k,
    // None with AVX2: its fused dot folds the scales and mins in through the activation's
    // sums and so decodes less per value, which measured as fast as decoding once for four
    // tokens on a q4_k_m file.
    avx2_tokens: []
);
block_kernel!(
    Q5KKernel,
    QType::Q5_K,
    256,
    dequant::block_q5_k,
    dot_q5_k,
    dequant_q5_k,
    tokens_q5_k,
    // None with AVX2: its fused dot folds the scales and mins in through the activation's
    // sums and so decodes less per value, which measured as fast as decoding once for four
    // tokens on a q4_k_m file.
    avx2_tokens: []
);
block_kernel!(
    Q6KKernel,
    QType::Q6_K,
    256,
    dequant::block_q6_k,
    dot_q6_k,
    dequant_q6_k,
    tokens_q6_k,
    // None with AVX2: its fused dot folds the scales and mins in through the activation's
    // sums and so decodes less per value, which measured as fast as decoding once for four
    // tokens on a q4_k_m file.
    avx2_tokens: []
);
block_kernel!(
    /// APR's Q4 (Q4_0's arithmetic, nibbles in value order).
    AprQ4Kernel,
    QType::AprQ4,
    32,
    dequant::block_apr_q4,
    dot_apr_q4,
    dequant_apr_q4,
    tokens_apr_q4,
    avx2_tokens: [tokens_apr_q4]
);
/// A block type whose only SIMD forms are its group decoders (AVX-512, AVX2): one token
/// takes the few-token product with a single activation.
macro_rules! group_only_kernel {
    ($(#[$doc:meta])* $name:ident, $qtype:expr, $block:expr, $deq:path, $simd_deq:ident, $simd_tokens:ident) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        pub struct $name {
            simd: Option<Simd>,
        }
        impl RowDot for $name {
            fn dot_rows(&self, rows: &[u8], row_bytes: usize, x: Act<'_>, out: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                match self.simd {
                    Some(Simd::Avx512(t)) => return avx512::$simd_tokens(t, rows, row_bytes, &[x.x], &mut [out]),
                    Some(Simd::Avx2(t)) => return avx2::$simd_tokens(t, rows, row_bytes, &[x.x], &mut [out]),
                    None => {}
                }
                let bb = $qtype.block_bytes();
                for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
                    *o = blockwise_dot::<$block>(row, bb, x.x, $deq);
                }
            }
            fn dequant_row(&self, row: &[u8], out: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                match self.simd {
                    Some(Simd::Avx512(t)) => return avx512::$simd_deq(t, row, out),
                    Some(Simd::Avx2(t)) => return avx2::$simd_deq(t, row, out),
                    None => {}
                }
                dequant::dequantize_into($qtype, row, out);
            }
            fn dot_rows_tokens(&self, rows: &[u8], row_bytes: usize, xs: &[Act<'_>], outs: &mut [&mut [f32]]) {
                #[cfg(target_arch = "x86_64")]
                if let Some(simd) = self.simd {
                    let mut x: [&[f32]; TOKENS_AT_ONCE] = [&[]; TOKENS_AT_ONCE];
                    for (x, a) in x.iter_mut().zip(xs) {
                        *x = a.x;
                    }
                    let x = &x[..xs.len()];
                    return match simd {
                        Simd::Avx512(t) => avx512::$simd_tokens(t, rows, row_bytes, x, outs),
                        Simd::Avx2(t) => avx2::$simd_tokens(t, rows, row_bytes, x, outs),
                    };
                }
                for (x, out) in xs.iter().zip(outs.iter_mut()) {
                    self.dot_rows(rows, row_bytes, *x, out);
                }
            }
        }
    };
}

group_only_kernel!(
    /// Q2_K: 2-bit quants, a 4-bit scale and min per 16 values.
    Q2KKernel,
    QType::Q2_K,
    256,
    dequant::block_q2_k,
    dequant_q2_k,
    tokens_q2_k
);
group_only_kernel!(
    /// Q3_K: 3-bit quants (two low bits and a bit plane), a 6-bit scale per 16 values.
    Q3KKernel,
    QType::Q3_K,
    256,
    dequant::block_q3_k,
    dequant_q3_k,
    tokens_q3_k
);
/// A type with an AVX2 row dot (the 4-bit table types look their 16 levels up by a byte
/// shuffle, the grid I-quants read their groups from the lattice) and the portable
/// block-by-block one elsewhere.
macro_rules! table_kernel {
    ($(#[$doc:meta])* $name:ident, $qtype:expr, $block:expr, $deq:path, $avx2_fn:ident) => {
        table_kernel!($(#[$doc])* $name, $qtype, $block, $deq, $avx2_fn, |_t, row, out| {
            dequant::dequantize_into($qtype, row, out)
        });
    };
    ($(#[$doc:meta])* $name:ident, $qtype:expr, $block:expr, $deq:path, $avx2_fn:ident, $avx2_deq:ident) => {
        table_kernel!($(#[$doc])* $name, $qtype, $block, $deq, $avx2_fn, |t, row, out| {
            avx2::$avx2_deq(t, row, out)
        });
    };
    ($(#[$doc:meta])* $name:ident, $qtype:expr, $block:expr, $deq:path, $avx2_fn:ident, |$t:ident, $row:ident, $out:ident| $avx2_deq:expr) => {
        $(#[$doc])*
        #[derive(Debug, Clone, Copy)]
        pub struct $name {
            simd: Option<Avx2>,
        }
        impl RowDot for $name {
            fn dot_rows(&self, rows: &[u8], row_bytes: usize, x: Act<'_>, out: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                if let Some(t) = self.simd {
                    for (i, (o, row)) in out.iter_mut().zip(rows.chunks_exact(row_bytes)).enumerate() {
                        prefetch_ahead(rows, row_bytes, i);
                        *o = avx2::$avx2_fn(t, row, x.x, x.sums);
                    }
                    return;
                }
                let bb = $qtype.block_bytes();
                for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
                    *o = blockwise_dot::<$block>(row, bb, x.x, $deq);
                }
            }
            fn dequant_row(&self, $row: &[u8], $out: &mut [f32]) {
                #[cfg(target_arch = "x86_64")]
                if let Some($t) = self.simd {
                    return $avx2_deq;
                }
                dequant::dequantize_into($qtype, $row, $out);
            }
        }
    };
}

table_kernel!(
    /// MXFP4 (gpt-oss's experts): E2M1 levels times each block's power of two.
    Mxfp4Kernel,
    QType::MXFP4,
    32,
    dequant::block_mxfp4,
    dot_mxfp4
);
table_kernel!(
    /// IQ4_NL: non-linear levels times each block's f16 scale.
    Iq4NlKernel,
    QType::IQ4_NL,
    32,
    dequant::block_iq4_nl,
    dot_iq4_nl
);
portable_kernel!(
    /// IQ4_XS: each super-block decoded (sub-block scales, a table lookup a value) and
    /// dotted in f32.
    Iq4XsKernel,
    QType::IQ4_XS,
    256,
    dequant::block_iq4_xs
);

table_kernel!(
    /// IQ2_XXS: groups of eight lattice values with their signs, a scale a 32 values.
    Iq2XxsKernel,
    QType::IQ2_XXS,
    256,
    dequant::block_iq2_xxs,
    dot_iq2_xxs,
    dequant_iq2_xxs
);
table_kernel!(
    Iq2XsKernel,
    QType::IQ2_XS,
    256,
    dequant::block_iq2_xs,
    dot_iq2_xs,
    dequant_iq2_xs
);
table_kernel!(
    Iq2SKernel,
    QType::IQ2_S,
    256,
    dequant::block_iq2_s,
    dot_iq2_s,
    dequant_iq2_s
);
table_kernel!(
    Iq3XxsKernel,
    QType::IQ3_XXS,
    256,
    dequant::block_iq3_xxs,
    dot_iq3_xxs,
    dequant_iq3_xxs
);
table_kernel!(
    Iq3SKernel,
    QType::IQ3_S,
    256,
    dequant::block_iq3_s,
    dot_iq3_s,
    dequant_iq3_s
);
portable_kernel!(Iq1SKernel, QType::IQ1_S, 256, dequant::block_iq1_s);
portable_kernel!(Iq1MKernel, QType::IQ1_M, 256, dequant::block_iq1_m);

/// f32 weights.
#[derive(Debug, Clone, Copy)]
pub struct F32Kernel {
    simd: Option<Simd>,
}
impl RowDot for F32Kernel {
    fn dot_rows(&self, rows: &[u8], row_bytes: usize, x: Act<'_>, out: &mut [f32]) {
        let mut buf = [0.0f32; 64];
        for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
            // Weights in a file need not be 4-byte aligned, so go through a small buffer
            // rather than casting the bytes.
            let mut sum = 0.0;
            for (bytes, xs) in row.chunks(256).zip(x.x.chunks(64)) {
                let n = xs.len();
                dequant::dequantize_into(QType::F32, bytes, &mut buf[..n]);
                sum += dot_f32(self.simd, &buf[..n], xs);
            }
            *o = sum;
        }
    }
    fn dequant_row(&self, row: &[u8], out: &mut [f32]) {
        dequant::dequantize_into(QType::F32, row, out);
    }
}

/// IEEE half weights.
#[derive(Debug, Clone, Copy)]
pub struct F16Kernel {
    simd: Option<Avx2>,
}
impl RowDot for F16Kernel {
    fn dot_rows(&self, rows: &[u8], row_bytes: usize, x: Act<'_>, out: &mut [f32]) {
        for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
            #[cfg(target_arch = "x86_64")]
            if let Some(t) = self.simd {
                *o = avx2::dot_f16(t, row, x.x);
                continue;
            }
            let mut buf = [0.0f32; 64];
            let mut sum = 0.0;
            for (bytes, xs) in row.chunks(128).zip(x.x.chunks(64)) {
                let n = xs.len();
                dequant::dequantize_into(QType::F16, bytes, &mut buf[..n]);
                sum += dot_f32_portable(&buf[..n], xs);
            }
            *o = sum;
        }
    }
    fn dequant_row(&self, row: &[u8], out: &mut [f32]) {
        dequant::dequantize_into(QType::F16, row, out);
    }
}

/// bfloat16 weights.
#[derive(Debug, Clone, Copy)]
pub struct Bf16Kernel {
    simd: Option<Simd>,
}
impl RowDot for Bf16Kernel {
    fn dot_rows(&self, rows: &[u8], row_bytes: usize, x: Act<'_>, out: &mut [f32]) {
        let mut buf = [0.0f32; 64];
        for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
            let mut sum = 0.0;
            for (bytes, xs) in row.chunks(128).zip(x.x.chunks(64)) {
                let n = xs.len();
                dequant::dequantize_into(QType::BF16, bytes, &mut buf[..n]);
                sum += dot_f32(self.simd, &buf[..n], xs);
            }
            *o = sum;
        }
    }
    fn dequant_row(&self, row: &[u8], out: &mut [f32]) {
        dequant::dequantize_into(QType::BF16, row, out);
    }
}

/// The kernel for one weight matrix, statically dispatched.
#[enum_dispatch(RowDot)]
#[derive(Debug, Clone, Copy)]
pub enum Kernel {
    F32(F32Kernel),
    F16(F16Kernel),
    Bf16(Bf16Kernel),
    Q4_0(Q4_0Kernel),
    Q4_1(Q4_1Kernel),
    Q5_0(Q5_0Kernel),
    Q5_1(Q5_1Kernel),
    Q8_0(Q8_0Kernel),
    Q2K(Q2KKernel),
    Q3K(Q3KKernel),
    Q4K(Q4KKernel),
    Q5K(Q5KKernel),
    Q6K(Q6KKernel),
    AprQ4(AprQ4Kernel),
    Mxfp4(Mxfp4Kernel),
    Iq4Nl(Iq4NlKernel),
    Iq4Xs(Iq4XsKernel),
    Iq2Xxs(Iq2XxsKernel),
    Iq2Xs(Iq2XsKernel),
    Iq2S(Iq2SKernel),
    Iq3Xxs(Iq3XxsKernel),
    Iq3S(Iq3SKernel),
    Iq1S(Iq1SKernel),
    Iq1M(Iq1MKernel),
}

/// Weight types this backend multiplies with: those [`Kernel::new`] has a kernel for (the
/// backend's claims come from its kernels, so they cannot drift apart).
pub fn supported() -> Vec<QType> {
    QType::ALL
        .into_iter()
        .filter(|&q| Kernel::new(q, Isa::Portable).is_some())
        .collect()
}

impl Kernel {
    /// The kernel for `qtype` on the widest instruction set up to `max` that the CPU has
    /// (detected here). `None` for types this backend does not multiply with.
    pub fn new(qtype: QType, max: Isa) -> Option<Kernel> {
        let simd = Simd::detect(max);
        let avx2 = simd.map(Simd::avx2);
        Some(match qtype {
            QType::F32 => F32Kernel { simd }.into(),
            QType::F16 => F16Kernel { simd: avx2 }.into(),
            QType::BF16 => Bf16Kernel { simd }.into(),
            QType::Q4_0 => Q4_0Kernel { simd }.into(),
            QType::Q4_1 => Q4_1Kernel { simd }.into(),
            QType::Q5_0 => Q5_0Kernel { simd }.into(),
            QType::Q5_1 => Q5_1Kernel { simd }.into(),
            QType::Q8_0 => Q8_0Kernel { simd }.into(),
            QType::Q2_K => Q2KKernel { simd }.into(),
            QType::Q3_K => Q3KKernel { simd }.into(),
            QType::Q4_K => Q4KKernel { simd }.into(),
            QType::Q5_K => Q5KKernel { simd }.into(),
            QType::Q6_K => Q6KKernel { simd }.into(),
            QType::AprQ4 => AprQ4Kernel { simd }.into(),
            QType::MXFP4 => Mxfp4Kernel { simd: avx2 }.into(),
            QType::IQ4_NL => Iq4NlKernel { simd: avx2 }.into(),
            QType::IQ4_XS => Iq4XsKernel.into(),
            QType::IQ2_XXS => Iq2XxsKernel { simd: avx2 }.into(),
            QType::IQ2_XS => Iq2XsKernel { simd: avx2 }.into(),
            QType::IQ2_S => Iq2SKernel { simd: avx2 }.into(),
            QType::IQ3_XXS => Iq3XxsKernel { simd: avx2 }.into(),
            QType::IQ3_S => Iq3SKernel { simd: avx2 }.into(),
            QType::IQ1_S => Iq1SKernel.into(),
            QType::IQ1_M => Iq1MKernel.into(),
            _ => return None,
        })
    }
}
