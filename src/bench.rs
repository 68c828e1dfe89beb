//! `kiln bench`: llama-bench style throughput of prompt processing (pp) and token
//! generation (tg) on one backend.

use std::time::Instant;

use kiln_core::{DecodeItem, LayerExecutor, Result, Rng, Sampler, SamplingParams, SeqId};

/// mean and standard deviation of tokens/s over the repeats.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Throughput {
    pub test: String,
    pub tokens: usize,
    pub mean_tps: f64,
    pub sd_tps: f64,
    pub samples_tps: Vec<f64>,
    /// KV-cache blocks the test's sequence held at its end (`None` for an executor that
    /// does not page): how much of the pool a run of this shape takes.
    pub kv_blocks_in_use: Option<usize>,
}

impl Throughput {
    fn from_samples(
        test: String,
        tokens: usize,
        samples: Vec<f64>,
        kv_blocks_in_use: Option<usize>,
    ) -> Self {
        let n = samples.len().max(1) as f64;
        let mean = samples.iter().sum::<f64>() / n;
        let var = samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
        Throughput {
            test,
            tokens,
            mean_tps: mean,
            sd_tps: var.sqrt(),
            samples_tps: samples,
            kv_blocks_in_use,
        }
    }
}

/// Blocks of the paged KV cache sequences hold now (`None` where the executor does not page).
fn blocks_in_use(exec: &dyn LayerExecutor) -> Option<usize> {
    exec.kv_blocks().map(|kv| kv.in_use())
}

fn random_tokens(n: usize, vocab: usize, rng: &mut Rng) -> Vec<u32> {
    (0..n)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect()
}

/// The test's name as llama-bench prints it: `pp512`, or `pp512 @ d4096` after `depth`
/// tokens of context.
fn test_name(kind: &str, tokens: usize, depth: usize) -> String {
    match depth {
        0 => format!("{kind}{tokens}"),
        d => format!("{kind}{tokens} @ d{d}"),
    }
}

/// Fills `seq` with `depth` random tokens of context (untimed; `llama-bench -d`), in
/// prefills of at most 4,096 tokens.
fn fill_context(
    exec: &mut dyn LayerExecutor,
    seq: SeqId,
    depth: usize,
    rng: &mut Rng,
    logits: &mut [f32],
) -> Result<()> {
    let vocab = exec.config().vocab_size;
    let mut left = depth;
    while left > 0 {
        let n = left.min(4096);
        exec.prefill(seq, &random_tokens(n, vocab, rng), logits)?;
        left -= n;
    }
    Ok(())
}

/// Prefill of `tokens` random tokens into a fresh sequence holding `depth` tokens of
/// context already; one warm-up, then `repeats`.
pub fn bench_prefill(
    exec: &mut dyn LayerExecutor,
    tokens: usize,
    depth: usize,
    repeats: usize,
) -> Result<Throughput> {
    let vocab = exec.config().vocab_size;
    let mut rng = Rng::new(42);
    let mut logits = vec![0.0f32; vocab];
    let mut samples = Vec::new();
    let mut in_use = None;
    for i in 0..=repeats {
        let seq = exec.new_sequence()?;
        let run =
            |exec: &mut dyn LayerExecutor, logits: &mut [f32], rng: &mut Rng| -> Result<f64> {
                fill_context(exec, seq, depth, rng, logits)?;
                let prompt = random_tokens(tokens, vocab, rng);
                let start = Instant::now();
                exec.prefill(seq, &prompt, logits)?;
                Ok(start.elapsed().as_secs_f64())
            };
        let result = run(exec, &mut logits, &mut rng);
        in_use = blocks_in_use(exec);
        exec.free_sequence(seq)?;
        let secs = result?;
        if i > 0 {
            samples.push(tokens as f64 / secs);
        }
    }
    Ok(Throughput::from_samples(
        test_name("pp", tokens, depth),
        tokens,
        samples,
        in_use,
    ))
}

/// Greedy generation of `tokens` tokens after a one-token prompt (after `depth` tokens of
/// context when set), sampling on the backend; one warm-up, then `repeats`.
pub fn bench_decode(
    exec: &mut dyn LayerExecutor,
    tokens: usize,
    depth: usize,
    repeats: usize,
) -> Result<Throughput> {
    let vocab = exec.config().vocab_size;
    let mut rng = Rng::new(7);
    let mut logits = vec![0.0f32; vocab];
    let mut samples = Vec::new();
    let mut in_use = None;
    for i in 0..=repeats {
        let seq = exec.new_sequence()?;
        let run =
            |exec: &mut dyn LayerExecutor, logits: &mut [f32], rng: &mut Rng| -> Result<f64> {
                fill_context(exec, seq, depth, rng, logits)?;
                let first = random_tokens(1, vocab, rng);
                exec.prefill(seq, &first, logits)?;
                let mut sampler = Sampler::new(SamplingParams::greedy());
                let mut token = [first[0]];
                let start = Instant::now();
                for _ in 0..tokens {
                    let item = DecodeItem {
                        seq,
                        token: token[0],
                    };
                    exec.decode_sample(&[item], std::slice::from_mut(&mut sampler), &mut token)?;
                }
                Ok(start.elapsed().as_secs_f64())
            };
        let result = run(exec, &mut logits, &mut rng);
        in_use = blocks_in_use(exec);
        exec.free_sequence(seq)?;
        let secs = result?;
        if i > 0 {
            samples.push(tokens as f64 / secs);
        }
    }
    Ok(Throughput::from_samples(
        test_name("tg", tokens, depth),
        tokens,
        samples,
        in_use,
    ))
}

/// A short request's latency in a warm process, medians over the repeats (after one
/// warm-up): `first_token_ms` from a fresh sequence to its first generated token (the
/// prompt's prefill, its logits copied back, a greedy pick), `first_step_ms` the decode
/// step after it (sampled on the backend).
#[derive(Debug, Clone, serde::Serialize)]
pub struct FirstToken {
    pub prompt_tokens: usize,
    pub first_token_ms: f64,
    pub first_step_ms: f64,
    pub repeats: usize,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// [`FirstToken`] for prompts of `prompt` random tokens.
pub fn bench_first_token(
    exec: &mut dyn LayerExecutor,
    prompt: usize,
    repeats: usize,
) -> Result<FirstToken> {
    let vocab = exec.config().vocab_size;
    let mut rng = Rng::new(5);
    let mut logits = vec![0.0f32; vocab];
    let (mut first, mut step) = (Vec::new(), Vec::new());
    for i in 0..=repeats.max(1) {
        let tokens = random_tokens(prompt, vocab, &mut rng);
        let start = Instant::now();
        let seq = exec.new_sequence()?;
        let run = |exec: &mut dyn LayerExecutor, logits: &mut [f32]| -> Result<(f64, f64)> {
            exec.prefill(seq, &tokens, logits)?;
            let mut sampler = Sampler::new(SamplingParams::greedy());
            let mut token = [sampler.sample(logits)];
            let first = start.elapsed().as_secs_f64();
            let item = DecodeItem {
                seq,
                token: token[0],
            };
            exec.decode_sample(&[item], std::slice::from_mut(&mut sampler), &mut token)?;
            Ok((first, start.elapsed().as_secs_f64() - first))
        };
        let result = run(exec, &mut logits);
        exec.free_sequence(seq)?;
        let (f, s) = result?;
        if i > 0 {
            first.push(f * 1e3);
            step.push(s * 1e3);
        }
    }
    Ok(FirstToken {
        prompt_tokens: prompt,
        repeats: first.len(),
        first_token_ms: median(first),
        first_step_ms: median(step),
    })
}

/// Weight bytes one decode step of one sequence reads: every matrix once, plus one
/// embedding row; of a Mixture of Experts only the experts a token uses.
pub fn bytes_per_decode_step(model: &kiln_core::ModelIr) -> u64 {
    let w = &model.weights;
    let embd_row = w.token_embd.row_bytes() as u64;
    let all: u64 = w.tensors().iter().map(|t| t.bytes().len() as u64).sum();
    let embd = if w.output.is_some() {
        w.token_embd.bytes().len() as u64 - embd_row
    } else {
        0
    };
    let idle_experts: u64 = match model.config.experts {
        None => 0,
        Some(e) => w
            .layers
            .iter()
            .filter_map(|l| l.experts.as_ref())
            .map(|x| x.unread_by_a_token(e.used).1 as u64)
            .sum(),
    };
    all - embd - idle_experts
}

/// One row of a `llama-batched-bench`-style table: `b` sequences each prefilled with `pp`
/// tokens, then `tg` steps generating one token for every sequence in one batch.
#[derive(Debug, Clone, serde::Serialize)]
pub struct BatchedRun {
    pub pp: usize,
    pub tg: usize,
    pub b: usize,
    /// Tokens in the KV cache at the end: b · (pp + tg).
    pub n_kv: usize,
    pub t_pp: f64,
    pub s_pp: f64,
    pub t_tg: f64,
    pub s_tg: f64,
    pub t: f64,
    pub s: f64,
    /// KV-cache blocks the `b` sequences held at the end (`None` for an executor that does
    /// not page).
    pub kv_blocks_in_use: Option<usize>,
}

/// `b` sequences: each prefilled with `pp` random tokens (one after another, as
/// llama-batched-bench), then `tg` greedy steps decoding all `b` in one batch, tokens drawn
/// on the backend. One untimed warm-up run first (graph capture, first-use compilation).
pub fn bench_batched(
    exec: &mut dyn LayerExecutor,
    pp: usize,
    tg: usize,
    b: usize,
) -> Result<BatchedRun> {
    let vocab = exec.config().vocab_size;
    let mut rng = Rng::new(11);
    let mut logits = vec![0.0f32; vocab];
    let mut in_use = None;
    let mut once = |exec: &mut dyn LayerExecutor, pp: usize, tg: usize| -> Result<(f64, f64)> {
        let mut seqs = Vec::with_capacity(b);
        let result = (|| {
            let mut last = Vec::with_capacity(b);
            let start = Instant::now();
            for _ in 0..b {
                let seq = exec.new_sequence()?;
                seqs.push(seq);
                let prompt = random_tokens(pp, vocab, &mut rng);
                exec.prefill(seq, &prompt, &mut logits)?;
                last.push(kiln_core::argmax(&logits));
            }
            let t_pp = start.elapsed().as_secs_f64();
            let mut samplers: Vec<Sampler> = (0..b)
                .map(|_| Sampler::new(SamplingParams::greedy()))
                .collect();
            let mut next = vec![0u32; b];
            let start = Instant::now();
            for _ in 0..tg {
                let items: Vec<DecodeItem> = seqs
                    .iter()
                    .zip(&last)
                    .map(|(&seq, &token)| DecodeItem { seq, token })
                    .collect();
                exec.decode_sample(&items, &mut samplers, &mut next)?;
                last.copy_from_slice(&next);
            }
            let t_tg = start.elapsed().as_secs_f64();
            in_use = blocks_in_use(exec);
            Ok((t_pp, t_tg))
        })();
        for s in seqs {
            exec.free_sequence(s)?;
        }
        result
    };
    once(exec, pp.min(16), tg.min(4))?;
    let (t_pp, t_tg) = once(exec, pp, tg)?;
    let (pp_tokens, tg_tokens) = ((b * pp) as f64, (b * tg) as f64);
    Ok(BatchedRun {
        pp,
        tg,
        b,
        n_kv: b * (pp + tg),
        t_pp,
        s_pp: pp_tokens / t_pp,
        t_tg,
        s_tg: tg_tokens / t_tg,
        t: t_pp + t_tg,
        s: (pp_tokens + tg_tokens) / (t_pp + t_tg),
        kv_blocks_in_use: in_use,
    })
}
