//! Perplexity and KL-divergence over a text, scored as llama.cpp's `llama-perplexity` scores
//! them, so the numbers read the same to its users.
//!
//! The text is tokenised whole (with the model's BOS where it adds one) and cut into chunks
//! of `ctx` tokens; each chunk is evaluated from an empty cache with its first token replaced
//! by BOS (where the model adds one), and the second half of it is scored: the logits at
//! positions `ctx/2 ..= ctx − 2` against the tokens that follow them. Perplexity is
//! `exp(mean nll)`, its error the standard error of the mean nll carried through `exp`.
//!
//! With a reference's saved distributions ([`logits`]), the same positions also give the
//! KL-divergence of this model's distribution from the reference's, how often the two agree
//! on the top token, and Δp (the change in the probability of the right token), with the
//! statistics llama.cpp prints. Chunks are scored through
//! [`LayerExecutor::prefill_logits`], the executor's prompt path.

pub mod logits;

use kiln_core::{Error, LayerExecutor, Result, TokenScore};
use rayon::prelude::*;

pub use logits::{tokenizer_fingerprint, LogitsHeader, LogitsReader, LogitsWriter, QuantRow};

/// A short public-domain text (the King James Version's Genesis, chapters 1–4; ~3,500
/// tokens for a 49k-vocabulary BPE) for quick checks: CI and `kiln conformance`.
pub const SHORT_TEXT: &str = include_str!("data/kjv_genesis_1-4.txt");

/// The tokens of a text cut into chunks, ready to be scored.
#[derive(Debug, Clone)]
pub struct Plan {
    /// `chunks × ctx` tokens (a tail shorter than a chunk is dropped).
    pub tokens: Vec<u32>,
    pub ctx: usize,
    pub chunks: usize,
    /// Put in place of each chunk's first token, where the model adds a BOS.
    pub bos: Option<u32>,
}

impl Plan {
    /// Cuts `tokens` into chunks of `ctx` (at most `max_chunks`). Like llama.cpp, asks for
    /// two chunks' worth of tokens at least.
    pub fn new(
        mut tokens: Vec<u32>,
        ctx: usize,
        max_chunks: Option<usize>,
        bos: Option<u32>,
    ) -> Result<Plan> {
        if ctx < 4 {
            return Err(Error::InvalidArgument(format!(
                "a perplexity context of {ctx} tokens scores nothing (use 4 or more; llama.cpp's default is 512)"
            )));
        }
        if tokens.len() < 2 * ctx {
            return Err(Error::InvalidArgument(format!(
                "the text is {} tokens; a context of {ctx} needs at least {} (two chunks)",
                tokens.len(),
                2 * ctx
            )));
        }
        if max_chunks == Some(0) {
            return Err(Error::InvalidArgument("--chunks 0 scores nothing".into()));
        }
        let chunks = (tokens.len() / ctx).min(max_chunks.unwrap_or(usize::MAX));
        tokens.truncate(chunks * ctx);
        Ok(Plan {
            tokens,
            ctx,
            chunks,
            bos,
        })
    }

    /// The plan a saved logits file was made with (its tokens, context and chunks).
    pub fn from_saved(header: &LogitsHeader, bos: Option<u32>) -> Plan {
        Plan {
            tokens: header.tokens.clone(),
            ctx: header.ctx,
            chunks: header.chunks,
            bos,
        }
    }

    /// The first scored position of a chunk.
    pub fn first(&self) -> usize {
        self.ctx / 2
    }

    /// Positions scored per chunk.
    pub fn scored_per_chunk(&self) -> usize {
        self.ctx - 1 - self.first()
    }

    fn chunk(&self, i: usize) -> &[u32] {
        &self.tokens[i * self.ctx..(i + 1) * self.ctx]
    }
}

/// Tokenises a text file's bytes for scoring: UTF-8 text, with the model's BOS where it
/// adds one. An empty, binary or non-UTF-8 file is refused with a reason.
pub fn tokenize_text(
    tokenizer: &kiln_formats::tokenizer::Tokenizer,
    bytes: &[u8],
) -> Result<Vec<u32>> {
    let text = std::str::from_utf8(bytes).map_err(|e| {
        Error::InvalidArgument(format!(
            "the text is not UTF-8 (byte {}): give a plain text file",
            e.valid_up_to()
        ))
    })?;
    if text.trim().is_empty() {
        return Err(Error::InvalidArgument("the text is empty".into()));
    }
    if text.contains('\0') {
        return Err(Error::InvalidArgument(
            "the text holds NUL bytes: a binary file, not a text".into(),
        ));
    }
    tokenizer.encode(text, tokenizer.add_bos_default(), false)
}

/// Sums of per-token values for a mean and its standard error.
#[derive(Debug, Clone, Copy, Default)]
struct Sums {
    sum: f64,
    sum2: f64,
    n: u64,
}

impl Sums {
    fn add(&mut self, v: f64) {
        self.sum += v;
        self.sum2 += v * v;
        self.n += 1;
    }

    /// Mean and standard error of the mean (llama.cpp's: 0 below 11 samples).
    fn mean_err(&self) -> (f64, f64) {
        if self.n == 0 {
            return (0.0, 0.0);
        }
        let n = self.n as f64;
        let mean = self.sum / n;
        let var = self.sum2 / n - mean * mean;
        let err = if var > 0.0 && self.n > 10 {
            (var / (n - 1.0)).sqrt()
        } else {
            0.0
        };
        (mean, err)
    }
}

/// A value and its standard error.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize)]
pub struct Estimate {
    pub value: f64,
    pub error: f64,
}

/// The distribution of a per-token quantity over every scored position.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Spread {
    pub mean: Estimate,
    pub max: f64,
    pub p99_9: f64,
    pub p99: f64,
    pub p95: f64,
    pub p90: f64,
    pub p75: f64,
    pub median: f64,
    pub p25: f64,
    pub p10: f64,
    pub p5: f64,
    pub p1: f64,
    pub p0_1: f64,
    pub min: f64,
}

impl Spread {
    fn of(mut values: Vec<f32>, sums: &Sums) -> Spread {
        values.sort_by(f32::total_cmp);
        let n = values.len();
        // Linear interpolation between the two nearest ranks (numpy's "linear"), as
        // llama.cpp reads its percentiles.
        let pct = |f: f64| -> f64 {
            let x = f * (n - 1) as f64;
            let i = x.floor() as usize;
            let w = x - i as f64;
            (1.0 - w) * values[i] as f64 + w * values[(i + 1).min(n - 1)] as f64
        };
        let median = if n % 2 == 0 {
            0.5 * (values[n / 2] as f64 + values[n / 2 - 1] as f64)
        } else {
            values[n / 2] as f64
        };
        let (value, error) = sums.mean_err();
        Spread {
            mean: Estimate { value, error },
            max: values[n - 1] as f64,
            p99_9: pct(0.999),
            p99: pct(0.99),
            p95: pct(0.95),
            p90: pct(0.90),
            p75: pct(0.75),
            median,
            p25: pct(0.25),
            p10: pct(0.10),
            p5: pct(0.05),
            p1: pct(0.01),
            p0_1: pct(0.001),
            min: values[0] as f64,
        }
    }
}

/// The scores against a reference's saved distributions.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct KlReport {
    pub ppl_base: Estimate,
    /// Correlation of the per-token nll of this model and the reference.
    pub ln_ppl_correlation: f64,
    pub ln_ppl_ratio: Estimate,
    pub ppl_ratio: Estimate,
    pub ppl_difference: Estimate,
    pub kld: Spread,
    /// This model's probability of the right token minus the reference's.
    pub delta_p: Spread,
    pub rms_delta_p: Estimate,
    /// Fraction of positions where both put the same token on top.
    pub same_top: Estimate,
}

/// What a run measured.
#[derive(Debug, Clone, PartialEq, serde::Serialize)]
pub struct Report {
    pub ctx: usize,
    pub chunks: usize,
    pub tokens_scored: u64,
    pub ppl: Estimate,
    /// The running perplexity after each chunk.
    pub running: Vec<f64>,
    pub kl: Option<KlReport>,
}

/// One chunk done: its index (from 1), the running perplexity, and with a reference the
/// running mean KLD and top-token agreement.
#[derive(Debug, Clone, Copy)]
pub struct ChunkDone {
    pub chunk: usize,
    pub chunks: usize,
    pub ppl: f64,
    pub kld: Option<f64>,
    pub same_top: Option<f64>,
}

/// Where the reference distributions go or come from.
pub enum Reference<'a> {
    None,
    /// Save this run's distributions (the reference for later runs).
    Save(&'a mut LogitsWriter),
    /// Compare with saved ones.
    Compare(&'a mut LogitsReader),
}

/// What one scored position contributes, computed on its own thread.
struct RowScore {
    nll: f64,
    /// The row as the logits file stores it, when saving.
    saved: Option<QuantRow>,
    /// The comparison with the reference's row, when comparing.
    kl: Option<KlRow>,
}

/// Max, log-sum-exp (f64 sum) and the first index of the max of one row of logits.
fn softmax_stats(row: &[f32]) -> (f32, f64, usize) {
    let mut max = f32::NEG_INFINITY;
    let mut top = 0;
    for (i, &l) in row.iter().enumerate() {
        if l > max {
            max = l;
            top = i;
        }
    }
    let sum: f64 = row.iter().map(|&l| ((l - max) as f64).exp()).sum();
    (max, sum.ln(), top)
}

#[derive(Default)]
struct KlSums {
    nll_base: Sums,
    cross: f64,
    kld: Sums,
    dp: Sums,
    dp2: Sums,
    same_top: u64,
    kld_values: Vec<f32>,
    dp_values: Vec<f32>,
}

/// One scored position compared with the reference: what [`KlSums`] adds up.
struct KlRow {
    nll: f64,
    nll_base: f64,
    kld: f64,
    same_top: bool,
}

impl KlRow {
    /// This model's logits `row` against the reference's `base`, the right token `target`
    /// at `nll` in this model.
    fn of(row: &[f32], base: &QuantRow, target: usize, nll: f64) -> KlRow {
        let (max, lse, top) = softmax_stats(row);
        let norm = max as f64 + lse;
        let nll_base = -(base.log_prob(target) as f64);
        let mut kld = 0f64;
        let mut base_top = (f32::NEG_INFINITY, 0usize);
        for (i, &l) in row.iter().enumerate() {
            let lp = base.log_prob(i);
            if lp > base_top.0 {
                base_top = (lp, i);
            }
            // Reference tokens clamped to its floor hold no information beyond "very
            // unlikely"; llama.cpp leaves them out of the sum the same way.
            if lp > -logits::CLAMP_NATS {
                kld += (lp as f64).exp() * (lp as f64 - (l as f64 - norm));
            }
        }
        KlRow {
            nll,
            nll_base,
            kld,
            same_top: top == base_top.1,
        }
    }
}

impl KlSums {
    fn add(&mut self, r: KlRow) {
        self.nll_base.add(r.nll_base);
        self.cross += r.nll * r.nll_base;
        self.kld.add(r.kld);
        self.kld_values.push(r.kld as f32);
        if r.same_top {
            self.same_top += 1;
        }
        let dp = (-r.nll).exp() - (-r.nll_base).exp();
        self.dp.add(dp);
        self.dp2.add(dp * dp);
        self.dp_values.push(dp as f32);
    }

    /// Covariance of the two mean nlls (llama.cpp's: 0 below 10 samples).
    fn covariance(&self, nll: &Sums) -> f64 {
        let n = nll.n as f64;
        if nll.n < 10 {
            return 0.0;
        }
        (self.cross / n - (nll.sum / n) * (self.nll_base.sum / n)) / (n - 1.0)
    }

    fn running(&self) -> (f64, f64) {
        let n = self.kld.n.max(1) as f64;
        (self.kld.sum / n, self.same_top as f64 / n)
    }

    fn report(self, nll: &Sums) -> KlReport {
        let (mu_q, se_q) = nll.mean_err();
        let (mu_b, se_b) = self.nll_base.mean_err();
        let cov = self.covariance(nll);
        let ratio_err = (se_q * se_q + se_b * se_b - 2.0 * cov).max(0.0).sqrt();
        let (p_q, p_b) = (mu_q.exp(), mu_b.exp());
        let (u_q, u_b) = (p_q * se_q, p_b * se_b);
        let r = mu_q - mu_b;
        let (ms, ms_err) = self.dp2.mean_err();
        let rms = ms.sqrt();
        let n = self.kld.n as f64;
        let top = self.same_top as f64 / n;
        KlReport {
            ppl_base: Estimate {
                value: p_b,
                error: u_b,
            },
            ln_ppl_correlation: if se_q > 0.0 && se_b > 0.0 {
                cov / (se_q * se_b)
            } else {
                0.0
            },
            ln_ppl_ratio: Estimate {
                value: r,
                error: ratio_err,
            },
            ppl_ratio: Estimate {
                value: r.exp(),
                error: r.exp() * ratio_err,
            },
            ppl_difference: Estimate {
                value: p_q - p_b,
                error: (u_q * u_q + u_b * u_b - 2.0 * p_q * p_b * cov)
                    .max(0.0)
                    .sqrt(),
            },
            kld: Spread::of(self.kld_values, &self.kld),
            delta_p: Spread::of(self.dp_values, &self.dp),
            rms_delta_p: Estimate {
                value: rms,
                error: if rms > 0.0 { 0.5 / rms * ms_err } else { 0.0 },
            },
            same_top: Estimate {
                value: top,
                error: (top * (1.0 - top) / (n - 1.0).max(1.0)).sqrt(),
            },
        }
    }
}

/// Scores `plan` on `exec`: perplexity, and with `reference` either saves this run's
/// distributions or compares them with saved ones. `on_chunk` hears of each chunk done.
///
/// The executor needs room for one sequence of `plan.ctx` tokens; it is left with no
/// sequence of this run's alive, also after an error.
pub fn score(
    exec: &mut dyn LayerExecutor,
    plan: &Plan,
    mut reference: Reference<'_>,
    mut on_chunk: impl FnMut(ChunkDone),
) -> Result<Report> {
    let vocab = exec.config().vocab_size;
    if plan.ctx > exec.max_context() {
        return Err(Error::InvalidArgument(format!(
            "a perplexity context of {} tokens exceeds the executor's {} (load it with -c {} or more)",
            plan.ctx,
            exec.max_context(),
            plan.ctx
        )));
    }
    match &reference {
        Reference::Compare(r) => {
            let h = &r.header;
            if h.vocab != vocab {
                return Err(Error::InvalidArgument(format!(
                    "the saved logits are over a vocabulary of {}; this model's has {vocab}",
                    h.vocab
                )));
            }
            if (h.ctx, h.first, h.chunks) != (plan.ctx, plan.first(), plan.chunks)
                || h.tokens != plan.tokens
            {
                return Err(Error::InvalidArgument(
                    "the saved logits were made over other tokens or chunks than this run's".into(),
                ));
            }
        }
        Reference::Save(_) | Reference::None => {}
    }
    kiln_core::check_tokens(&plan.tokens, vocab)?;
    let first = plan.first();
    let rows = plan.scored_per_chunk();
    let seq = exec.new_sequence()?;
    let mut run = || -> Result<Report> {
        let mut logits = match reference {
            Reference::None => Vec::new(),
            _ => vec![f32::NAN; rows * vocab],
        };
        let mut scores = vec![
            TokenScore {
                nll: f32::NAN,
                top: 0
            };
            rows
        ];
        let mut input = Vec::with_capacity(plan.ctx);
        let mut nll = Sums::default();
        let mut kl = KlSums::default();
        let mut base_rows = Vec::new();
        let mut running = Vec::with_capacity(plan.chunks);
        for c in 0..plan.chunks {
            let chunk = plan.chunk(c);
            input.clear();
            input.extend_from_slice(&chunk[..plan.ctx - 1]);
            if let Some(bos) = plan.bos {
                input[0] = bos;
            }
            exec.truncate_sequence(seq, 0)?;
            let non_finite = |j: usize| Error::NonFiniteLogits {
                step: c * plan.ctx + first + j,
            };
            let (saving, comparing) = match &mut reference {
                Reference::None => {
                    // Perplexity alone needs a score a row, not the rows: the executor
                    // reduces them where they are (on a GPU, without copying them back).
                    exec.prefill_scores(seq, &input, first, &chunk[first + 1..], &mut scores)?;
                    for (j, r) in scores.iter().enumerate() {
                        if !r.nll.is_finite() {
                            return Err(non_finite(j));
                        }
                        nll.add(r.nll as f64);
                    }
                    (false, false)
                }
                Reference::Save(_) => (true, false),
                Reference::Compare(r) => {
                    r.read_chunk(&mut base_rows)?;
                    (false, true)
                }
            };
            if saving || comparing {
                logits.fill(f32::NAN);
                exec.prefill_logits(seq, &input, first, &mut logits)?;
                // Rows are independent: each is scored on its own thread, then added up in
                // order, so the sums do not depend on the thread count.
                let rows_scored: Vec<Option<RowScore>> = logits
                    .par_chunks_exact(vocab)
                    .enumerate()
                    .map(|(j, row)| {
                        if !row.iter().all(|l| l.is_finite()) {
                            return None;
                        }
                        let target = chunk[first + j + 1] as usize;
                        let (max, lse, _) = softmax_stats(row);
                        let nll = max as f64 + lse - row[target] as f64;
                        Some(RowScore {
                            nll,
                            saved: saving.then(|| QuantRow::from_logits(row)),
                            kl: comparing.then(|| KlRow::of(row, &base_rows[j], target, nll)),
                        })
                    })
                    .collect();
                for (j, r) in rows_scored.into_iter().enumerate() {
                    let r = r.ok_or_else(|| non_finite(j))?;
                    nll.add(r.nll);
                    if let (Reference::Save(w), Some(q)) = (&mut reference, r.saved) {
                        w.push_quantized(&q)?;
                    }
                    if let Some(k) = r.kl {
                        kl.add(k);
                    }
                }
            }
            let ppl = (nll.sum / nll.n as f64).exp();
            running.push(ppl);
            let (kld, same_top) = match reference {
                Reference::Compare(_) => {
                    let (k, t) = kl.running();
                    (Some(k), Some(t))
                }
                _ => (None, None),
            };
            on_chunk(ChunkDone {
                chunk: c + 1,
                chunks: plan.chunks,
                ppl,
                kld,
                same_top,
            });
        }
        let (mean, err) = nll.mean_err();
        let ppl = mean.exp();
        let kl = match reference {
            Reference::Compare(_) => Some(kl.report(&nll)),
            _ => None,
        };
        Ok(Report {
            ctx: plan.ctx,
            chunks: plan.chunks,
            tokens_scored: nll.n,
            ppl: Estimate {
                value: ppl,
                error: ppl * err,
            },
            running,
            kl,
        })
    };
    let result = run();
    let freed = exec.free_sequence(seq);
    let report = result?;
    freed?;
    Ok(report)
}

/// llama.cpp's summary of a KL run, line for line (its labels and precision).
pub fn format_kl(report: &Report, kl: &KlReport) -> String {
    use std::fmt::Write;
    let mut s = String::new();
    let e = |x: &Estimate| format!("{:10.6} ± {:10.6}", x.value, x.error);
    let _ = writeln!(s, "====== Perplexity statistics ======");
    let _ = writeln!(s, "{:<30}: {}", "Mean PPL(Q)", e(&report.ppl));
    let _ = writeln!(s, "{:<30}: {}", "Mean PPL(base)", e(&kl.ppl_base));
    let _ = writeln!(
        s,
        "{:<30}: {:6.2}%",
        "Cor(ln(PPL(Q)), ln(PPL(base)))",
        100.0 * kl.ln_ppl_correlation
    );
    let _ = writeln!(
        s,
        "{:<30}: {}",
        "Mean ln(PPL(Q)/PPL(base))",
        e(&kl.ln_ppl_ratio)
    );
    let _ = writeln!(s, "{:<30}: {}", "Mean PPL(Q)/PPL(base)", e(&kl.ppl_ratio));
    let _ = writeln!(
        s,
        "{:<30}: {}",
        "Mean PPL(Q)-PPL(base)",
        e(&kl.ppl_difference)
    );
    let _ = writeln!(s);
    let _ = writeln!(s, "====== KL divergence statistics ======");
    let k = &kl.kld;
    let _ = writeln!(s, "Mean    KLD: {}", e(&k.mean));
    for (label, v) in [
        ("Maximum KLD", k.max),
        ("99.9%   KLD", k.p99_9),
        ("99.0%   KLD", k.p99),
        ("95.0%   KLD", k.p95),
        ("90.0%   KLD", k.p90),
        ("Median  KLD", k.median),
        ("10.0%   KLD", k.p10),
        (" 5.0%   KLD", k.p5),
        (" 1.0%   KLD", k.p1),
        (" 0.1%   KLD", k.p0_1),
        ("Minimum KLD", k.min),
    ] {
        let _ = writeln!(s, "{label}: {v:10.6}");
    }
    let _ = writeln!(s);
    let _ = writeln!(s, "====== Token probability statistics ======");
    let d = &kl.delta_p;
    let _ = writeln!(
        s,
        "Mean    Δp: {:6.3} ± {:5.3} %",
        100.0 * d.mean.value,
        100.0 * d.mean.error
    );
    for (label, v) in [
        ("Maximum Δp", d.max),
        ("99.9%   Δp", d.p99_9),
        ("99.0%   Δp", d.p99),
        ("95.0%   Δp", d.p95),
        ("90.0%   Δp", d.p90),
        ("75.0%   Δp", d.p75),
        ("Median  Δp", d.median),
        ("25.0%   Δp", d.p25),
        ("10.0%   Δp", d.p10),
        (" 5.0%   Δp", d.p5),
        (" 1.0%   Δp", d.p1),
        (" 0.1%   Δp", d.p0_1),
        ("Minimum Δp", d.min),
    ] {
        let _ = writeln!(s, "{label}: {:6.3}%", 100.0 * v);
    }
    let _ = writeln!(
        s,
        "RMS Δp    : {:6.3} ± {:5.3} %",
        100.0 * kl.rms_delta_p.value,
        100.0 * kl.rms_delta_p.error
    );
    let _ = writeln!(
        s,
        "Same top p: {:6.3} ± {:5.3} %",
        100.0 * kl.same_top.value,
        100.0 * kl.same_top.error
    );
    s
}
