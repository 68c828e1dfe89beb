//! Quantised matrix × f32 activations, parallel over output rows.
//!
//! Work is cut into chunks of rows (never single rows) so a task streams a contiguous run
//! of weight bytes. With several tokens (prefill, batched decode) every task still reads
//! its weight rows from memory once: a few tokens share each decoded weight group in
//! registers (or, for types without such a kernel, take the fused kernel per token while
//! the rows sit in cache), and many tokens — prefill — dequantise each row once, a segment
//! at a time, and dot the segment with every token, which is what makes the oracle's
//! prefill cheaper per token than decode. 8-bit activations take the integer kernels at any
//! count, four tokens at a time sharing each row's decoded weights.

use kiln_core::{Error, QType, Result, TensorView};
use rayon::prelude::*;

use crate::kernels::q8::{Q8Input, Q8Kernel};
use crate::kernels::{dot4_f32, dot_f32, Act, Isa, Kernel, RowDot, Simd, TOKENS_AT_ONCE};

/// Most tokens one forward pass carries; longer prompts are cut into batches of this.
pub const MAX_BATCH: usize = 64;

/// From this many tokens on, rows are dequantised once into memory and dotted in f32 per
/// token (a register-blocked GEMM); below it, from two tokens, the kernels decode each
/// weight group into registers and multiply it with up to [`TOKENS_AT_ONCE`] tokens
/// ([`RowDot::dot_rows_tokens`]), and a single token takes the fused row dot. The store and
/// reload of the dequantised row cost as much as the FMAs at four tokens, and are repaid
/// only over many.
pub(crate) const DEQUANT_MIN_TOKENS: usize = 16;

/// Values of a row dequantised at once on the many-token path (a multiple of every block).
const SEGMENT: usize = 1024;

/// A weight matrix as the executor holds it: a view of the file's bytes plus its kernel.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub view: TensorView,
    pub kernel: Kernel,
    /// The integer kernel on 8-bit activations, when the executor was asked for them and
    /// the type has one ([`crate::kernels::q8`]).
    pub q8: Option<Q8Kernel>,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
}

impl QMatrix {
    /// Wraps `view`, checking it is `rows × cols` (`cols` contiguous) of a supported type;
    /// its kernel uses the widest instruction set up to `isa` that the CPU has.
    pub fn new(view: &TensorView, cols: usize, rows: usize, isa: Isa) -> Result<QMatrix> {
        let kernel = Kernel::new(view.qtype(), isa).ok_or_else(|| {
            Error::Unsupported(format!(
                "tensor {}: the cpu backend cannot multiply {} weights",
                view.name(),
                view.qtype()
            ))
        })?;
        if view.dims().len() != 2 || view.row_len() != cols || view.rows() != rows {
            return Err(Error::InvalidShape(format!(
                "tensor {} has dims {:?}; the model config needs [{cols}, {rows}]",
                view.name(),
                view.dims()
            )));
        }
        if view.qtype().is_quantized() && !cols.is_multiple_of(32) {
            return Err(Error::InvalidShape(format!(
                "tensor {}: rows of {cols} values",
                view.name()
            )));
        }
        Ok(QMatrix {
            view: view.clone(),
            kernel,
            q8: None,
            rows,
            cols,
            row_bytes: view.row_bytes(),
        })
    }

    pub fn qtype(&self) -> QType {
        self.view.qtype()
    }

    /// Few-token products of this matrix then take 8-bit activations when its type has an
    /// integer kernel (on the widest instruction set up to `isa`); others keep f32.
    pub fn with_q8_activations(mut self, isa: Isa) -> QMatrix {
        self.q8 = Q8Kernel::new(self.qtype(), isa);
        self
    }

    /// Row `r` dequantised into `out` (length `cols`).
    pub fn dequant_row(&self, r: usize, out: &mut [f32]) {
        self.kernel.dequant_row(self.view.row(r), out);
    }
}

/// A matrix and where its outputs go: `out` holds `tokens × m.rows` values.
pub struct MatJob<'a> {
    pub m: &'a QMatrix,
    pub out: &'a mut [f32],
}

/// Activations of several tokens: `x` is `tokens × cols`, `sums` is `tokens × cols/32`;
/// `q8`, when present, the same tokens quantised to 8 bits, which the matrices with an
/// integer kernel then multiply instead of `x`.
#[derive(Clone, Copy)]
pub struct Batch<'a> {
    pub x: &'a [f32],
    pub sums: &'a [f32],
    pub q8: Option<&'a Q8Input>,
    pub tokens: usize,
    pub cols: usize,
}

impl<'a> Batch<'a> {
    fn act(&self, t: usize) -> Act<'a> {
        let ns = self.cols / 32;
        Act {
            x: &self.x[t * self.cols..(t + 1) * self.cols],
            sums: if self.sums.is_empty() {
                &[]
            } else {
                &self.sums[t * ns..(t + 1) * ns]
            },
        }
    }
}

/// Raw output pointer shared by tasks that write disjoint ranges.
#[derive(Clone, Copy)]
struct OutPtr(*mut f32);
// SAFETY: tasks write disjoint element ranges of the buffer (see `matmul`), and the buffer
// outlives the parallel region that uses the pointer.
unsafe impl Send for OutPtr {}
// SAFETY: as for Send: shared copies of the pointer only ever write disjoint ranges.
unsafe impl Sync for OutPtr {}

/// Runs every job on the same input batch, all rows of all jobs in one parallel region.
/// Must run inside the executor's thread pool. Jobs must be at most 4.
pub fn matmul(jobs: &mut [MatJob<'_>], input: Batch<'_>, threads: usize, simd: Option<Simd>) {
    debug_assert!(jobs.len() <= 4 && input.tokens <= MAX_BATCH);
    let total_rows: usize = jobs.iter().map(|j| j.m.rows).sum();
    let chunk = (total_rows / (threads.max(1) * 8)).clamp(16, 1024);
    let mut firsts = [0usize; 5];
    let mut outs = [OutPtr(std::ptr::null_mut()); 4];
    for (i, j) in jobs.iter_mut().enumerate() {
        debug_assert_eq!(j.m.cols, input.cols);
        debug_assert_eq!(j.out.len(), j.m.rows * input.tokens);
        firsts[i + 1] = firsts[i] + j.m.rows.div_ceil(chunk);
        outs[i] = OutPtr(j.out.as_mut_ptr());
    }
    let n_tasks = firsts[jobs.len()];
    let mats: [Option<&QMatrix>; 4] = std::array::from_fn(|i| jobs.get(i).map(|j| j.m));
    (0..n_tasks).into_par_iter().for_each(|task| {
        let i = (0..4)
            .find(|&i| task < firsts[i + 1])
            .expect("task index below the total");
        let m = mats[i].expect("job present");
        let r0 = (task - firsts[i]) * chunk;
        let r1 = (r0 + chunk).min(m.rows);
        let out = outs[i];
        // SAFETY: this task alone writes elements t*rows + r0..r1 for every token t; the
        // ranges of different tasks are disjoint and all lie inside the job's `out`.
        let write = |t: usize| unsafe {
            std::slice::from_raw_parts_mut(out.0.add(t * m.rows + r0), r1 - r0)
        };
        let bytes = &m.view.bytes()[r0 * m.row_bytes..r1 * m.row_bytes];
        let q8 = m.q8.and_then(|k| Some((k, input.q8?.form(k.span())?)));
        match q8 {
            // 8-bit activations: every token takes the integer kernels, prompts too, so the
            // arithmetic is llama.cpp's at any batch size; up to four tokens share each
            // row's decoded weights.
            Some((k, act)) => token_groups(input.tokens, write, |t0, outs| {
                let xs: [_; TOKENS_AT_ONCE] =
                    std::array::from_fn(|i| act.token(t0 + i.min(outs.len() - 1)));
                k.dot_rows_tokens(bytes, m.row_bytes, &xs[..outs.len()], outs)
            }),
            _ if input.tokens == 1 => m
                .kernel
                .dot_rows(bytes, m.row_bytes, input.act(0), write(0)),
            _ if input.tokens < DEQUANT_MIN_TOKENS => {
                token_groups(input.tokens, write, |t0, outs| {
                    let xs: [Act<'_>; TOKENS_AT_ONCE] =
                        std::array::from_fn(|i| input.act(t0 + i.min(outs.len() - 1)));
                    m.kernel
                        .dot_rows_tokens(bytes, m.row_bytes, &xs[..outs.len()], outs)
                })
            }
            _ => many_tokens(m, bytes, r1 - r0, input, simd, write),
        }
    });
}

/// Calls `f(t0, outs)` for each run of up to [`TOKENS_AT_ONCE`] consecutive tokens from
/// `t0`, `outs` holding their outputs (`write(t)` for each).
fn token_groups<'o>(
    tokens: usize,
    write: impl Fn(usize) -> &'o mut [f32],
    mut f: impl FnMut(usize, &mut [&'o mut [f32]]),
) {
    let mut t0 = 0;
    while t0 < tokens {
        let n = TOKENS_AT_ONCE.min(tokens - t0);
        let mut outs: [&mut [f32]; TOKENS_AT_ONCE] =
            std::array::from_fn(|_| <&mut [f32]>::default());
        for (i, o) in outs.iter_mut().enumerate().take(n) {
            *o = write(t0 + i);
        }
        f(t0, &mut outs[..n]);
        t0 += n;
    }
}

/// Dequantise each row once, a segment at a time, and dot it with every token. Rows go
/// together in register blocks against four tokens at a time (a register-blocked f32
/// GEMM): four rows with the AVX-512 kernels, two with AVX2, each loaded vector used several
/// times; the portable path takes one row against four tokens.
fn many_tokens<'o>(
    m: &QMatrix,
    bytes: &[u8],
    rows: usize,
    input: Batch<'_>,
    simd: Option<Simd>,
    write: impl Fn(usize) -> &'o mut [f32],
) {
    let q = m.qtype();
    let seg_bytes = SEGMENT / q.block_len() * q.block_bytes();
    let tokens = input.tokens;
    let mut buf = [[0.0f32; SEGMENT]; 4];
    let mut acc = [[0.0f32; MAX_BATCH]; 4];
    let mut outs: [&mut [f32]; MAX_BATCH] = std::array::from_fn(|_| <&mut [f32]>::default());
    for (t, o) in outs.iter_mut().enumerate().take(tokens) {
        *o = write(t);
    }
    let group = match simd {
        Some(Simd::Avx512(_)) => 4,
        Some(Simd::Avx2(_)) => 2,
        None => 1,
    };
    let mut r0 = 0;
    while r0 < rows {
        let nr = group.min(rows - r0);
        for a in &mut acc[..nr] {
            a[..tokens].fill(0.0);
        }
        for s in 0..m.cols.div_ceil(SEGMENT) {
            let c0 = s * SEGMENT;
            let n = (m.cols - c0).min(SEGMENT);
            for (j, b) in buf.iter_mut().enumerate().take(nr) {
                if s == 0 {
                    crate::kernels::prefetch_ahead(bytes, m.row_bytes, r0 + j);
                }
                let row = &bytes[(r0 + j) * m.row_bytes..(r0 + j + 1) * m.row_bytes];
                let seg = &row[s * seg_bytes..(s * seg_bytes + seg_bytes).min(row.len())];
                m.kernel.dequant_row(seg, &mut b[..n]);
            }
            let x = |t: usize| &input.x[t * m.cols + c0..t * m.cols + c0 + n];
            let mut t = 0;
            // The register blocks: `group` rows against four tokens a call. Short groups
            // repeat their last row; the repeats' sums are not kept.
            #[cfg(target_arch = "x86_64")]
            if let Some(simd) = simd {
                let w: [&[f32]; 4] = std::array::from_fn(|j| &buf[j.min(nr - 1)][..n]);
                while t + 4 <= tokens {
                    let xs = [x(t), x(t + 1), x(t + 2), x(t + 3)];
                    let d = match simd {
                        Simd::Avx512(wide) => crate::kernels::dot4x4_f32(wide, w, xs),
                        Simd::Avx2(narrow) => {
                            let [d0, d1] = crate::kernels::dot2x4_f32(narrow, [w[0], w[1]], xs);
                            [d0, d1, [0.0; 4], [0.0; 4]]
                        }
                    };
                    for (a, d) in acc.iter_mut().zip(d).take(nr) {
                        for (a, d) in a[t..t + 4].iter_mut().zip(d) {
                            *a += d;
                        }
                    }
                    t += 4;
                }
            }
            for (j, a) in acc.iter_mut().enumerate().take(nr) {
                let w = &buf[j][..n];
                let mut t = t;
                while t + 4 <= tokens {
                    let d = dot4_f32(simd, w, [x(t), x(t + 1), x(t + 2), x(t + 3)]);
                    for (a, d) in a[t..t + 4].iter_mut().zip(d) {
                        *a += d;
                    }
                    t += 4;
                }
                for t in t..tokens {
                    a[t] += dot_f32(simd, w, x(t));
                }
            }
        }
        for (j, a) in acc.iter().enumerate().take(nr) {
            for (o, a) in outs[..tokens].iter_mut().zip(a) {
                o[r0 + j] = *a;
            }
        }
        r0 += nr;
    }
}
