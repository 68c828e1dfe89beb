//! `kiln bench`: llama-bench style throughput of prompt processing (pp) and token
//! generation (tg) on one backend.

use std::time::Instant;

use kiln_core::{DecodeItem, LayerExecutor, Result, Rng, Sampler, SamplingParams};

/// mean and standard deviation of tokens/s over the repeats.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Throughput {
    pub test: String,
    pub tokens: usize,
    pub mean_tps: f64,
    pub sd_tps: f64,
    pub samples_tps: Vec<f64>,
}

impl Throughput {
    fn from_samples(test: String, tokens: usize, samples: Vec<f64>) -> Self {
        let n = samples.len().max(1) as f64;
        let mean = samples.iter().sum::<f64>() / n;
        let var = samples.iter().map(|s| (s - mean).powi(2)).sum::<f64>() / (n - 1.0).max(1.0);
        Throughput { test, tokens, mean_tps: mean, sd_tps: var.sqrt(), samples_tps: samples }
    }
}

fn random_tokens(n: usize, vocab: usize, rng: &mut Rng) -> Vec<u32> {
    (0..n).map(|_| (rng.next_u64() % vocab as u64) as u32).collect()
}

/// Prefill of `tokens` random tokens into a fresh sequence; one warm-up, then `repeats`.
pub fn bench_prefill(exec: &mut dyn LayerExecutor, tokens: usize, repeats: usize) -> Result<Throughput> {
    let vocab = exec.config().vocab_size;
    let mut rng = Rng::new(42);
    let mut logits = vec![0.0f32; vocab];
    let mut samples = Vec::new();
    for i in 0..=repeats {
        let prompt = random_tokens(tokens, vocab, &mut rng);
        let seq = exec.new_sequence()?;
        let start = Instant::now();
        let result = exec.prefill(seq, &prompt, &mut logits);
        let secs = start.elapsed().as_secs_f64();
        exec.free_sequence(seq)?;
        result?;
        if i > 0 {
            samples.push(tokens as f64 / secs);
        }
    }
    Ok(Throughput::from_samples(format!("pp{tokens}"), tokens, samples))
}

/// Greedy generation of `tokens` tokens after a one-token prompt, sampling on the
/// backend; one warm-up, then `repeats`.
pub fn bench_decode(exec: &mut dyn LayerExecutor, tokens: usize, repeats: usize) -> Result<Throughput> {
    let vocab = exec.config().vocab_size;
    let mut rng = Rng::new(7);
    let mut logits = vec![0.0f32; vocab];
    let mut samples = Vec::new();
    for i in 0..=repeats {
        let seq = exec.new_sequence()?;
        let run = |exec: &mut dyn LayerExecutor, logits: &mut [f32], rng: &mut Rng| -> Result<f64> {
            let first = random_tokens(1, vocab, rng);
            exec.prefill(seq, &first, logits)?;
            let mut sampler = Sampler::new(SamplingParams::greedy());
            let mut token = [first[0]];
            let start = Instant::now();
            for _ in 0..tokens {
                let item = DecodeItem { seq, token: token[0] };
                exec.decode_sample(&[item], std::slice::from_mut(&mut sampler), &mut token)?;
            }
            Ok(start.elapsed().as_secs_f64())
        };
        let result = run(exec, &mut logits, &mut rng);
        exec.free_sequence(seq)?;
        let secs = result?;
        if i > 0 {
            samples.push(tokens as f64 / secs);
        }
    }
    Ok(Throughput::from_samples(format!("tg{tokens}"), tokens, samples))
}

/// Weight bytes one decode step reads: every matrix once, plus one embedding row.
pub fn bytes_per_decode_step(model: &kiln_core::ModelIr) -> u64 {
    let w = &model.weights;
    let embd_row = w.token_embd.row_bytes() as u64;
    let all: u64 = w.tensors().iter().map(|t| t.bytes().len() as u64).sum();
    let embd = if w.output.is_some() { w.token_embd.bytes().len() as u64 - embd_row } else { 0 };
    all - embd
}
