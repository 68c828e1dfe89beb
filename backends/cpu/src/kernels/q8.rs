//! Integer row dots on activations quantised to 8 bits: the fast path behind
//! [`kiln_core::LoadOptions::quantized_activations`], not the oracle.
//!
//! The f32 kernels of this crate widen every weight to a float and multiply with FMA,
//! about sixteen vector instructions per 32 weights; on cores whose vector units are 128
//! bits wide (AMD Zen 1 and 2 split every 256-bit instruction in two) that arithmetic, not
//! memory, bounds a decode step. llama.cpp's CPU build quantises each activation to int8
//! blocks once per matrix and multiplies bytes with bytes (`vpmaddubsw`, 32 products and
//! 16 pair sums in one instruction), half the instructions. This module does the same
//! when asked to, with llama.cpp's activation formats ([`ScaleSpan`]): for the 32-value
//! weight types one scale per 32 values (its Q8_0/Q8_1), for the K-quants one per 256
//! (its Q8_K). Each weight type with a kernel here is multiplied block by block in exact
//! integer arithmetic, its scales and offsets applied in f32 per block.
//!
//! The result differs from the oracle by the activation's rounding (a relative error of up
//! to 1/254 of each block's largest value), as llama.cpp's CPU results do; the executor
//! uses it only when the caller opted in. Types without a kernel here keep the f32 dot.
//! Each kernel has a portable form, which defines its result, and an AVX2 form
//! ([`super::avx2_q8`]) that agrees with it to f32 rounding.

use half::f16;
use kiln_core::quant::{iquants, kquants::scale_min_k4, mxfp4};
use kiln_core::QType;

use super::{Avx2, Isa, Simd};

#[cfg(target_arch = "x86_64")]
use super::avx2_q8;

/// Values per activation block.
pub const Q8_BLOCK: usize = 32;

/// 1.5·2²³: added to and taken from a float below 2²² in magnitude, it rounds it to the
/// nearest integer (ties to even) in two exact-or-rounded additions.
const ROUNDER: f32 = 12_582_912.0;

/// How many activation values share one 8-bit scale, as llama.cpp's CPU build quantises a
/// matrix's input for the weight type (its `vec_dot_type`). A 256-value scale is a
/// coarser grid than a 32-value one wherever a super-block mixes large and small values,
/// so the choice moves results by far more than rounding: to compute what llama.cpp
/// computes, a K-quant matrix must see the K form.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ScaleSpan {
    /// 32 values a scale (Q8_0, Q8_1): `q = round(x·127/amax)` (ties to even, as ggml's AVX2
    /// quantiser rounds), `d = amax/127` rounded to f16, and `s = d·Σq`. (Q8_1 rounds `s`
    /// to f16 as well; here it stays the product in f32, which the types whose offset is a
    /// multiple of the scale, Q4_0 and Q5_0, need exact.)
    Block,
    /// 256 values a scale (Q8_K): `q = round(x·127/amax)`, `d = 1/(127/amax)` in f32, and
    /// per 32 values `s = d·Σq`; the kernels read one scale per 32 values, so each
    /// super-block's scale is stored eight times.
    SuperBlock,
}

impl ScaleSpan {
    /// Values one scale covers.
    pub const fn values(self) -> usize {
        match self {
            ScaleSpan::Block => Q8_BLOCK,
            ScaleSpan::SuperBlock => 256,
        }
    }
}

/// An activation (one or more tokens of `cols` values each) quantised to int8 blocks of
/// [`Q8_BLOCK`] values: block `b` holds `qs[32b..32b + 32]`, scale `d[b]` and `s[b] = d[b]·Σ
/// qs` (which the types with an offset per block multiply by it); with
/// [`ScaleSpan::SuperBlock`] eight consecutive blocks share their scale. A buffer to
/// reuse: it grows to the largest activation it was given and never shrinks.
#[derive(Debug, Default, Clone)]
pub struct Q8Act {
    qs: Vec<i8>,
    d: Vec<f32>,
    s: Vec<f32>,
    cols: usize,
    tokens: usize,
}

/// One token of a [`Q8Act`].
#[derive(Debug, Clone, Copy)]
pub struct Q8Ref<'a> {
    pub qs: &'a [i8],
    pub d: &'a [f32],
    pub s: &'a [f32],
}

impl<'a> Q8Ref<'a> {
    /// Values in the activation.
    pub fn len(&self) -> usize {
        self.qs.len()
    }

    pub fn is_empty(&self) -> bool {
        self.qs.is_empty()
    }

    /// Value `i` as the integer dots see it, `d·q`.
    pub fn value(&self, i: usize) -> f32 {
        self.d[i / Q8_BLOCK] * self.qs[i] as f32
    }
}

impl Q8Act {
    /// Quantises `tokens` activations of `cols` values each (`x` holds them one after
    /// another; `cols` must be a multiple of `span`'s values).
    pub fn quantize(&mut self, x: &[f32], tokens: usize, cols: usize, span: ScaleSpan) {
        let group = span.values();
        assert!(
            cols.is_multiple_of(group) && x.len() >= tokens * cols,
            "quantize: {tokens} × {cols} values from {} (rows must be whole {group}-value groups)",
            x.len()
        );
        let (n, nb) = (tokens * cols, tokens * cols / Q8_BLOCK);
        self.qs.resize(n, 0);
        self.d.resize(nb, 0.0);
        self.s.resize(nb, 0.0);
        self.cols = cols;
        self.tokens = tokens;
        for (g, xs) in x[..n].chunks_exact(group).enumerate() {
            // The largest magnitude, NaN if any value is NaN: the scale then carries it
            // into every product of the group, so non-finite logits still show.
            let amax = xs.iter().fold(0.0f32, |m, v| {
                if v.abs() > m || v.is_nan() {
                    v.abs()
                } else {
                    m
                }
            });
            let inv = if amax == 0.0 { 0.0 } else { 127.0 / amax };
            let d = match span {
                ScaleSpan::Block => f16::from_f32(amax / 127.0).to_f32(),
                ScaleSpan::SuperBlock if amax == 0.0 => 0.0,
                ScaleSpan::SuperBlock => 1.0 / inv,
            };
            let qs = &mut self.qs[g * group..][..group];
            for (q, &v) in qs.iter_mut().zip(xs) {
                // Round to nearest, ties to even, by adding and taking away 1.5·2²³ (exact
                // for |v·inv| ≤ 127; `f32::round` is a libm call here, 1.5% of a decode
                // step). A NaN becomes 0 (`as` saturates).
                let r = ((v * inv + ROUNDER) - ROUNDER) as i32;
                *q = r.clamp(-127, 127) as i8;
            }
            let first = g * group / Q8_BLOCK;
            for (b, block) in qs.chunks_exact(Q8_BLOCK).enumerate() {
                let sum: i32 = block.iter().map(|&q| q as i32).sum();
                self.d[first + b] = d;
                self.s[first + b] = d * sum as f32;
            }
        }
    }

    /// Token `t`'s blocks.
    pub fn token(&self, t: usize) -> Q8Ref<'_> {
        assert!(
            t < self.tokens,
            "token {t} of a {}-token activation",
            self.tokens
        );
        let (c, nb) = (self.cols, self.cols / Q8_BLOCK);
        Q8Ref {
            qs: &self.qs[t * c..(t + 1) * c],
            d: &self.d[t * nb..(t + 1) * nb],
            s: &self.s[t * nb..(t + 1) * nb],
        }
    }

    /// Tokens quantised by the last [`Q8Act::quantize`].
    pub fn tokens(&self) -> usize {
        self.tokens
    }
}

/// Which activation forms a model's matrices multiply ([`Q8Kernel::span`]): the forms
/// [`Q8Input::quantize`] makes, so a model without K-quant kernels never pays for the
/// super-block one (and one of only K-quants never for the block one).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Q8Forms {
    pub block: bool,
    pub super_block: bool,
}

impl Q8Forms {
    /// Adds the form `kernel` multiplies.
    pub fn add(&mut self, kernel: Q8Kernel) {
        match kernel.span() {
            ScaleSpan::Block => self.block = true,
            ScaleSpan::SuperBlock => self.super_block = true,
        }
    }

    /// Whether any matrix takes 8-bit activations.
    pub fn any(self) -> bool {
        self.block || self.super_block
    }
}

/// One matmul input in each form its matrices may ask for ([`ScaleSpan`]): the executor
/// quantises an activation once and every matrix reads the form its type multiplies. The
/// super-block form exists only when rows are whole 256-value groups, as every K-quant
/// matrix's are.
#[derive(Debug, Default, Clone)]
pub struct Q8Input {
    block: Q8Act,
    super_block: Q8Act,
    made: Q8Forms,
}

impl Q8Input {
    /// Quantises `tokens` activations of `cols` values each (`cols` a multiple of 32) in
    /// the forms `forms` names.
    pub fn quantize(&mut self, x: &[f32], tokens: usize, cols: usize, forms: Q8Forms) {
        self.made = Q8Forms {
            block: forms.block,
            super_block: forms.super_block && cols.is_multiple_of(ScaleSpan::SuperBlock.values()),
        };
        if self.made.block {
            self.block.quantize(x, tokens, cols, ScaleSpan::Block);
        }
        if self.made.super_block {
            self.super_block
                .quantize(x, tokens, cols, ScaleSpan::SuperBlock);
        }
    }

    /// The form `span` of the last activation, if it was made.
    pub fn form(&self, span: ScaleSpan) -> Option<&Q8Act> {
        match span {
            ScaleSpan::Block => self.made.block.then_some(&self.block),
            ScaleSpan::SuperBlock => self.made.super_block.then_some(&self.super_block),
        }
    }
}

/// Weight types with an integer kernel here.
pub const Q8_TYPES: [QType; 10] = [
    QType::Q4_0,
    QType::Q4_1,
    QType::Q5_0,
    QType::Q5_1,
    QType::Q8_0,
    QType::Q4_K,
    QType::Q6_K,
    QType::MXFP4,
    QType::IQ4_NL,
    QType::IQ4_XS,
];

/// The integer row dot for one weight matrix: its type and, when the CPU has them, the
/// AVX2 kernels (the AVX-512 hosts run these too: the byte products are the same width).
#[derive(Debug, Clone, Copy)]
pub struct Q8Kernel {
    qtype: QType,
    simd: Option<Avx2>,
}

impl Q8Kernel {
    /// The kernel for `qtype` on the widest instruction set up to `max` the CPU has, or
    /// `None` for a type without one ([`Q8_TYPES`]).
    pub fn new(qtype: QType, max: Isa) -> Option<Q8Kernel> {
        Q8_TYPES.contains(&qtype).then(|| Q8Kernel {
            qtype,
            simd: Simd::detect(max).map(Simd::avx2),
        })
    }

    pub fn qtype(&self) -> QType {
        self.qtype
    }

    /// The activation form this kernel multiplies: llama.cpp's for the weight type, one
    /// scale per super-block for the K-quants, one per block for the others.
    pub fn span(&self) -> ScaleSpan {
        match self.qtype.block_len() {
            256 => ScaleSpan::SuperBlock,
            _ => ScaleSpan::Block,
        }
    }

    /// `out[r] = row r · x` for the `out.len()` rows packed in `rows` (`row_bytes` each, a
    /// whole number of blocks holding `x.len()` values). Panics when the lengths disagree.
    pub fn dot_rows(&self, rows: &[u8], row_bytes: usize, x: Q8Ref<'_>, out: &mut [f32]) {
        let q = self.qtype;
        check_lengths(q, rows, row_bytes, x, out.len());
        #[cfg(target_arch = "x86_64")]
        if let Some(t) = self.simd {
            return avx2_q8::dot_rows(t, q, rows, row_bytes, x, out);
        }
        for (o, row) in out.iter_mut().zip(rows.chunks_exact(row_bytes)) {
            *o = dot_portable(q, row, x);
        }
    }

    /// `outs[t][r] = row r · xs[t]` for one to four activations: on AVX2, the legacy
    /// 32-value types, Q4_K and Q6_K decode each row's weights once for all of them; other
    /// types and the portable path dot token by token. Panics when the lengths disagree.
    pub fn dot_rows_tokens(
        &self,
        rows: &[u8],
        row_bytes: usize,
        xs: &[Q8Ref<'_>],
        outs: &mut [&mut [f32]],
    ) {
        #[cfg(target_arch = "x86_64")]
        if let Some(t) = self.simd {
            if xs.len() > 1 && avx2_q8::dot_rows_tokens(t, self.qtype, rows, row_bytes, xs, outs) {
                return;
            }
        }
        for (x, out) in xs.iter().zip(outs.iter_mut()) {
            self.dot_rows(rows, row_bytes, *x, out);
        }
    }
}

/// Panics unless `rows` holds `n` rows of `row_bytes` bytes, each exactly `x.len()` values
/// of type `q` in whole blocks, and `x` one scale and one sum per 32 values: what every
/// kernel here relies on to stay inside its slices.
pub(super) fn check_lengths(q: QType, rows: &[u8], row_bytes: usize, x: Q8Ref<'_>, n: usize) {
    assert!(
        x.len().is_multiple_of(q.block_len())
            && row_bytes == x.len() / q.block_len() * q.block_bytes()
            && rows.len() >= n * row_bytes
            && x.d.len() * Q8_BLOCK == x.len()
            && x.s.len() == x.d.len(),
        "q8 dot ({q}): {n} rows of {row_bytes} bytes in {} for {} values",
        rows.len(),
        x.len()
    );
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Weight `i` of a 4-bit block whose value `i` sits in the low nibble of byte `i` and
/// value `16 + i` in its high nibble (Q4_0, Q4_1, Q5_0, Q5_1).
fn nibble(qs: &[u8], i: usize) -> i32 {
    ((qs[i % 16] >> (4 * (i / 16))) & 0x0F) as i32
}

/// A 32-value block of the legacy types as integers: its weights `w` (so that the block's
/// values are `d·w + m`), `d`, and `m` (0 for the types without a min).
fn legacy_block(q: QType, blk: &[u8]) -> ([i32; 32], f32, f32) {
    let d = f16_at(blk, 0);
    let fifth = |at: usize| u32::from_le_bytes(blk[at..at + 4].try_into().expect("4 bytes"));
    let mut w = [0i32; 32];
    let m = match q {
        QType::Q4_0 => {
            w.iter_mut()
                .enumerate()
                .for_each(|(i, w)| *w = nibble(&blk[2..], i) - 8);
            0.0
        }
        QType::Q4_1 => {
            w.iter_mut()
                .enumerate()
                .for_each(|(i, w)| *w = nibble(&blk[4..], i));
            f16_at(blk, 2)
        }
        QType::Q5_0 => {
            let qh = fifth(2);
            for (i, w) in w.iter_mut().enumerate() {
                *w = (nibble(&blk[6..], i) | (((qh >> i) & 1) << 4) as i32) - 16;
            }
            0.0
        }
        QType::Q5_1 => {
            let qh = fifth(4);
            for (i, w) in w.iter_mut().enumerate() {
                *w = nibble(&blk[8..], i) | (((qh >> i) & 1) << 4) as i32;
            }
            f16_at(blk, 2)
        }
        QType::Q8_0 => {
            w.iter_mut()
                .zip(&blk[2..34])
                .for_each(|(w, &b)| *w = b as i8 as i32);
            0.0
        }
        _ => unreachable!("{q} is not a 32-value block type"),
    };
    (w, d, m)
}

/// Σ_i w_i·y_i in exact integer arithmetic.
fn idot(w: impl IntoIterator<Item = i32>, y: &[i8]) -> i32 {
    w.into_iter().zip(y).map(|(w, &y)| w * y as i32).sum()
}

/// The defining (portable) form of every kernel: one row of type `q` against `x`. Each
/// block's integer dot is exact; its scales, and the min times the activation's block sum
/// `s`, are applied in f32.
pub fn dot_portable(q: QType, row: &[u8], x: Q8Ref<'_>) -> f32 {
    let bb = q.block_bytes();
    let mut sum = 0.0f32;
    match q {
        QType::Q4_0 | QType::Q4_1 | QType::Q5_0 | QType::Q5_1 | QType::Q8_0 => {
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let (w, d, m) = legacy_block(q, blk);
                let dot = idot(w, &x.qs[b * 32..][..32]);
                sum += d * x.d[b] * dot as f32 + m * x.s[b];
            }
        }
        QType::Q4_K => {
            for (sb, blk) in row.chunks_exact(bb).enumerate() {
                let (d, dmin) = (f16_at(blk, 0), f16_at(blk, 2));
                let scales = &blk[4..16];
                let qs = &blk[16..144];
                for j in 0..8 {
                    let (sc, m) = scale_min_k4(scales, j);
                    let b = sb * 8 + j;
                    let bytes = &qs[32 * (j / 2)..][..32];
                    let shift = 4 * (j % 2);
                    let w = bytes.iter().map(|&v| ((v >> shift) & 0x0F) as i32);
                    let dot = idot(w, &x.qs[b * 32..][..32]);
                    sum += d * sc as f32 * x.d[b] * dot as f32 - dmin * m as f32 * x.s[b];
                }
            }
        }
        QType::Q6_K => {
            for (sb, blk) in row.chunks_exact(bb).enumerate() {
                let (ql, qh) = (&blk[..128], &blk[128..192]);
                let scales = &blk[192..208];
                let d = f16_at(blk, 208);
                for half in 0..2 {
                    for k in 0..4 {
                        // Value 128·half + 32k + l (l < 32), in ggml's order: its low four
                        // bits in ql[64·half + 32·(k % 2) + l] (the low nibble for k < 2,
                        // the high one after), its top two bits at bit 2k of
                        // qh[32·half + l], its scale the i8 at 8·half + 2k + l / 16.
                        let lo = &ql[64 * half + 32 * (k % 2)..][..32];
                        let hi = &qh[32 * half..][..32];
                        let b = sb * 8 + 4 * half + k;
                        let y = &x.qs[b * 32..][..32];
                        let mut dot = 0i32;
                        for l in 0..32 {
                            let low = (lo[l] >> (4 * (k / 2))) & 0x0F;
                            let high = (hi[l] >> (2 * k)) & 3;
                            let w = (low | (high << 4)) as i32 - 32;
                            let sc = scales[8 * half + 2 * k + l / 16] as i8 as i32;
                            dot += sc * w * y[l] as i32;
                        }
                        sum += d * x.d[b] * dot as f32;
                    }
                }
            }
        }
        QType::MXFP4 => {
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let w = (0..32).map(|i| mxfp4::KVALUES[nibble(&blk[1..], i) as usize] as i32);
                let dot = idot(w, &x.qs[b * 32..][..32]);
                sum += mxfp4::e8m0_half(blk[0]) * x.d[b] * dot as f32;
            }
        }
        QType::IQ4_NL => {
            for (b, blk) in row.chunks_exact(bb).enumerate() {
                let w =
                    (0..32).map(|i| iquants::KVALUES_IQ4NL[nibble(&blk[2..], i) as usize] as i32);
                let dot = idot(w, &x.qs[b * 32..][..32]);
                sum += f16_at(blk, 0) * x.d[b] * dot as f32;
            }
        }
        QType::IQ4_XS => {
            for (sb, blk) in row.chunks_exact(bb).enumerate() {
                let d = f16_at(blk, 0);
                for i in 0..8 {
                    let b = sb * 8 + i;
                    let qs = &blk[8 + 16 * i..][..16];
                    let w = (0..32).map(|j| iquants::KVALUES_IQ4NL[nibble(qs, j) as usize] as i32);
                    let dot = idot(w, &x.qs[b * 32..][..32]);
                    let scale = iquants::iq4_xs_scale(blk, i) as f32;
                    sum += d * scale * x.d[b] * dot as f32;
                }
            }
        }
        _ => unreachable!("no q8 kernel for {q}: Q8Kernel::new refuses it"),
    }
    sum
}
