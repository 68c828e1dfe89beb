//! Decode throughput of `cuda-q4k` on random models with real shapes (SmolLM2-135M,
//! Llama-3.2-1B, Llama-3-8B, vocabulary 49152 as in design.md §8) and a Q4_K_M-like type
//! mix: tokens per second over `-n` greedy steps sampled on the device, the weight bytes a
//! step reads and the bandwidth that implies. Layers share one random tensor per role (the
//! host builds each distinct tensor once); each is uploaded separately, so the GPU reads
//! as many bytes as a real model's.
//!
//! With `--batch B,B2,..`, instead: B sequences (prompts of 128 random tokens) decoding
//! together through the batched step, aggregate tok/s (`-n` steps after 4 of warm-up): the
//! default step, each batched attention forced, and the register walk for the K-quants,
//! alternating over two rounds.
//!
//! With `--profile-steps K` as well, each batch size first runs K steps of the default path
//! inside a profiler range and nothing else: `ncu --profile-from-start off` then sees only
//! the batched step's kernels, at llama-batched-bench's context (prompts of 128).
//!
//! With `--depth D,D2,..`, the one-sequence rows decode after prompts of D tokens instead
//! of 4. With `--group-ab`, only the default step, alternating (two rounds) with the group
//! attention on tensor cores off (`StepVariants::group_attention_from: usize::MAX`).
//!
//! `decode_bench [-n 128] [--model smollm2|1b|8b]... [--batch 16,64 [--profile-steps K]] [--depth D,..] [--group-ab]`

use std::sync::Arc;
use std::time::Instant;

use kiln_backend_cuda_q4k::{load_executor, GpuExecutor, StepVariants};
use kiln_core::{
    DecodeItem, LayerExecutor, LayerWeights, LoadOptions, ModelConfig, ModelIr, ModelWeights,
    QType, Rng, RopeConfig, Sampler, SamplingParams, TensorView,
};
use kiln_kernels::testdata::random_weights_scaled;
use kiln_kernels::{BatchAttention, BmmPath, Device, GemvPath, GemvTiling};

struct Spec {
    name: &'static str,
    hidden: usize,
    layers: usize,
    heads: usize,
    kv: usize,
    ffn: usize,
    vocab: usize,
    /// llama.cpp keeps 32-value types where rows are not whole 256-blocks.
    small_rows: bool,
}

const SPECS: [Spec; 3] = [
    Spec {
        name: "smollm2",
        hidden: 576,
        layers: 30,
        heads: 9,
        kv: 3,
        ffn: 1536,
        vocab: 49152,
        small_rows: true,
    },
    Spec {
        name: "1b",
        hidden: 2048,
        layers: 16,
        heads: 32,
        kv: 8,
        ffn: 8192,
        vocab: 49152,
        small_rows: false,
    },
    Spec {
        name: "8b",
        hidden: 4096,
        layers: 32,
        heads: 32,
        kv: 8,
        ffn: 14336,
        vocab: 49152,
        small_rows: false,
    },
];

fn build(s: &Spec, rng: &mut Rng) -> ModelIr {
    let hd = s.hidden / s.heads;
    let (qd, kvd) = (s.heads * hd, s.kv * hd);
    let (q4, q6) = if s.small_rows {
        (QType::Q5_0, QType::Q8_0)
    } else {
        (QType::Q4_K, QType::Q6_K)
    };
    let mut cache: Vec<(String, TensorView)> = Vec::new();
    let mut mat = |rng: &mut Rng, role: &str, q: QType, k: usize, n: usize| -> TensorView {
        let key = format!("{role}/{q}");
        if let Some((_, t)) = cache.iter().find(|(k2, _)| *k2 == key) {
            return t.clone();
        }
        let bytes = random_weights_scaled(rng, q, k, n, 2.0 / (k as f32).sqrt()).unwrap();
        let t = TensorView::from_bytes(&key, q, vec![k, n], bytes).unwrap();
        cache.push((key, t.clone()));
        t
    };
    let ones = |n: usize| TensorView::from_f32("norm", vec![n], &vec![1.0; n]).unwrap();
    let mut layers = Vec::new();
    for i in 0..s.layers {
        // Q4_K_M: V and down in Q6_K for half the layers.
        let (tv, td) = if i % 2 == 0 { (q6, q6) } else { (q4, q4) };
        layers.push(LayerWeights {
            attn_norm: ones(s.hidden),
            attn_norm_bias: None,
            attn_q: mat(rng, "q", q4, s.hidden, qd),
            attn_k: mat(rng, "k", q4, s.hidden, kvd),
            attn_v: mat(rng, "v", tv, s.hidden, kvd),
            attn_q_bias: None,
            attn_k_bias: None,
            attn_v_bias: None,
            attn_q_norm: None,
            attn_k_norm: None,
            attn_out: mat(rng, "o", q4, qd, s.hidden),
            attn_out_bias: None,
            attn_sinks: None,
            ffn_norm: Some(ones(s.hidden)),
            ffn_norm_bias: None,
            ffn_gate: Some(mat(rng, "gate", q4, s.hidden, s.ffn)),
            ffn_up: Some(mat(rng, "up", q4, s.hidden, s.ffn)),
            ffn_down: Some(mat(rng, "down", td, s.ffn, s.hidden)),
            experts: None,
            attn_post_norm: None,
            ffn_post_norm: None,
        });
    }
    let weights = ModelWeights {
        token_embd: mat(rng, "embd", q6, s.hidden, s.vocab),
        layers,
        output_norm: ones(s.hidden),
        output_norm_bias: None,
        output: None,
        rope_freqs: None,
    };
    let config = ModelConfig {
        vocab_size: s.vocab,
        hidden_size: s.hidden,
        num_layers: s.layers,
        num_heads: s.heads,
        num_kv_heads: s.kv,
        head_dim: hd,
        ffn_size: s.ffn,
        rope: RopeConfig {
            theta: 500000.0,
            rotary_dims: hd,
            ..RopeConfig::default()
        },
        tied_embeddings: true,
        context_length: 4096,
        ..ModelConfig::default()
    };
    ModelIr {
        config,
        weights,
        source: format!("random {} shape", s.name),
        program: None,
    }
}

fn step_bytes(ir: &ModelIr) -> u64 {
    let w = &ir.weights;
    let mut total = w.lm_head().bytes().len() as u64;
    for l in &w.layers {
        for t in [&l.attn_q, &l.attn_k, &l.attn_v, &l.attn_out] {
            total += t.bytes().len() as u64;
        }
        for t in [&l.ffn_gate, &l.ffn_up, &l.ffn_down].into_iter().flatten() {
            total += t.bytes().len() as u64;
        }
    }
    total
}

/// The value after `flag` in `args`, parsed (None when absent or unparsable).
fn value_of<T: std::str::FromStr>(args: &[String], flag: &str) -> Option<T> {
    let i = args.iter().position(|a| a == flag)?;
    args.get(i + 1)?.parse().ok()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let n: usize = value_of(&args, "-n").unwrap_or(128);
    let chosen: Vec<&str> = args
        .windows(2)
        .filter(|w| w[0] == "--model")
        .map(|w| w[1].as_str())
        .collect();
    // `-p N`: also measure a prefill of N tokens (ppN); `--prefill-only` skips decode.
    let pp: usize = value_of(&args, "-p").unwrap_or(0);
    let prefill_only = args.iter().any(|a| a == "--prefill-only");
    // `--short-prefill`: short prompts through the batched step against the cuBLAS prefill
    // (where one should hand over to the other).
    let short_prefill = args.iter().any(|a| a == "--short-prefill");
    // `--depth D,D2,..`: decode after prompts of D tokens instead of 4.
    let depths: Vec<usize> = value_of::<String>(&args, "--depth")
        .map(|v| v.split(',').filter_map(|d| d.parse().ok()).collect())
        .filter(|d: &Vec<usize>| !d.is_empty())
        .unwrap_or(vec![4]);
    let group_ab = args.iter().any(|a| a == "--group-ab");
    let batch: Option<Vec<usize>> = value_of::<String>(&args, "--batch")
        .map(|v| v.split(',').filter_map(|b| b.parse().ok()).collect());
    let profile_steps: usize = value_of(&args, "--profile-steps").unwrap_or(0);
    let dev: Arc<Device> = match kiln_kernels::unavailable_reason() {
        Some(why) => {
            println!("skipped: {why}");
            return;
        }
        None => Device::new(0).expect("device"),
    };
    let mut rng = Rng::new(7);
    println!("| model | activations, quantising tiling | step bytes | kernels/step | load s | tg{n} tok/s | ms/token | GB/s | % of 3950 GB/s | graph ms | graph GB/s |");
    println!("|---|---|---|---|---|---|---|---|---|---|---|");
    for s in SPECS
        .iter()
        .filter(|s| chosen.is_empty() || chosen.contains(&s.name))
    {
        let ir = build(s, &mut rng);
        if let Some(sizes) = &batch {
            batch_bench(&dev, &ir, s, sizes, n, profile_steps);
            continue;
        }
        let t0 = Instant::now();
        let options = LoadOptions {
            max_context: (depths.iter().max().unwrap() + n + 64).max(4096),
            max_sequences: 1,
            ..Default::default()
        };
        let mut ex = load_executor(&dev, &ir, &options).expect("load");
        let load_s = t0.elapsed().as_secs_f64();
        if pp > 0 {
            prefill_bench(&mut ex, s, pp);
        }
        if short_prefill {
            // Buffers for 64 rows come with 64 sequence slots.
            let options = LoadOptions {
                max_context: 512,
                max_sequences: 64,
                ..Default::default()
            };
            let mut wide = load_executor(&dev, &ir, &options).expect("load");
            short_prefill_bench(&mut wide, s);
        }
        if prefill_only {
            continue;
        }
        // Every O/SwiGLU/down GEMV quantising its output (the default), with the policy's
        // tiling per weight (`None`) and with each tiling forced; none doing so (a separate
        // launch after each); and Q8_1.
        // (the context from which attention takes a GQA group a block on tensor cores)
        type Variant = (GemvPath, Option<GemvTiling>, usize, usize);
        let defaults = ex.variants();
        let group = defaults.group_attention_from;
        let variants: Vec<Variant> = if group_ab {
            [group, usize::MAX, group, usize::MAX]
                .map(|from| (GemvPath::Q16, None, usize::MAX, from))
                .to_vec()
        } else {
            [
                (GemvPath::Q16, None, usize::MAX),
                (GemvPath::Q16, Some(GemvTiling::new(2, 1)), usize::MAX),
                (GemvPath::Q16, Some(GemvTiling::new(4, 2)), usize::MAX),
                (GemvPath::Q16, Some(GemvTiling::new(4, 1)), usize::MAX),
                (GemvPath::Q16, None, 0),
                (GemvPath::Q8, None, usize::MAX),
            ]
            .map(|(p, t, l)| (p, t, l, group))
            .to_vec()
        };
        let runs = depths
            .iter()
            .flat_map(|&d| variants.iter().map(move |v| (d, *v)));
        for (depth, (path, tiling, limit, group_from)) in runs {
            ex.set_variants(StepVariants {
                gemv_path: path,
                quant_tiling: tiling,
                fuse_limit: limit,
                group_attention_from: group_from,
                ..defaults
            })
            .unwrap();
            let seq = ex.new_sequence().unwrap();
            let mut logits = vec![0f32; s.vocab];
            let prompt: Vec<u32> = (0..depth as u32).map(|i| 1 + i % 1000).collect();
            ex.prefill(seq, &prompt, &mut logits).unwrap();
            let mut sampler = [Sampler::new(SamplingParams::greedy())];
            let mut tok = [5u32];
            // Warm-up steps (graph capture happened in prefill).
            for _ in 0..8 {
                let t = tok[0];
                ex.decode_sample(&[DecodeItem { seq, token: t }], &mut sampler, &mut tok)
                    .unwrap();
            }
            let t0 = Instant::now();
            for _ in 0..n {
                let t = tok[0];
                ex.decode_sample(&[DecodeItem { seq, token: t }], &mut sampler, &mut tok)
                    .unwrap();
            }
            let dt = t0.elapsed().as_secs_f64();
            let graph_ms = ex.step_device_ms(seq, 21).unwrap();
            let bytes = step_bytes(&ir);
            let gbps = bytes as f64 * n as f64 / dt / 1e9;
            // The step's graph, plus the two argmax launches.
            let kernels = ex.step_graph_nodes(seq).unwrap() + 2;
            let fused = match limit {
                0 => "none fused".to_string(),
                usize::MAX => "all fused".to_string(),
                l => format!("fused up to {} MB", l >> 20),
            };
            let group_note = match (group_from, group_ab) {
                (_, false) => String::new(),
                (usize::MAX, true) => ", group attention off".to_string(),
                (from, true) => format!(", group attention from {from}"),
            };
            let depth_note = match depth {
                4 => String::new(),
                d => format!(" @ d{d}"),
            };
            let variant = match tiling {
                Some(t) => format!(
                    "{path:?}, {fused}, R{}S{}",
                    t.rows_per_warp, t.warps_per_row
                ),
                None => format!("{path:?}, {fused}, per weight"),
            } + &group_note
                + &depth_note;
            println!(
            "| {} | {variant} | {:.1} MB | {kernels} | {load_s:.1} | {:.0} | {:.3} | {gbps:.0} | {:.0}% | {graph_ms:.3} | {:.0} |",
            s.name,
            bytes as f64 / 1e6,
            n as f64 / dt,
            dt * 1e3 / n as f64,
            100.0 * gbps / 3950.0,
            bytes as f64 / (graph_ms * 1e-3) / 1e9
        );
            ex.free_sequence(seq).unwrap();
        }
    }
}

/// For each batch size `b`: `b` sequences through the batched decode step together,
/// aggregate tok/s over `n` steps; with `profile_steps` > 0 only that many steps of the
/// default path, inside a profiler range.
fn batch_bench(
    dev: &Arc<Device>,
    ir: &ModelIr,
    s: &Spec,
    sizes: &[usize],
    n: usize,
    profile_steps: usize,
) {
    let most = sizes.iter().copied().max().unwrap_or(1);
    let options = LoadOptions {
        max_context: 1024,
        max_sequences: most,
        ..Default::default()
    };
    let mut ex = load_executor(dev, ir, &options).expect("load");
    let defaults = ex.variants();
    let mut rng = Rng::new(13);
    let mut logits = vec![0f32; s.vocab];
    for &b in sizes {
        let seqs: Vec<_> = (0..b)
            .map(|_| {
                let seq = ex.new_sequence().unwrap();
                let prompt: Vec<u32> = (0..128)
                    .map(|_| (rng.next_u64() % s.vocab as u64) as u32)
                    .collect();
                ex.prefill(seq, &prompt, &mut logits).unwrap();
                seq
            })
            .collect();
        let mut samplers: Vec<Sampler> = (0..b)
            .map(|_| Sampler::new(SamplingParams::greedy()))
            .collect();
        let mut toks = vec![5u32; b];
        let mut step = |ex: &mut GpuExecutor, toks: &mut Vec<u32>| {
            let items: Vec<DecodeItem> = seqs
                .iter()
                .zip(toks.iter())
                .map(|(&seq, &token)| DecodeItem { seq, token })
                .collect();
            ex.decode_sample(&items, &mut samplers, toks).unwrap();
        };
        if profile_steps > 0 {
            // Capture the bucket's graph before the range opens.
            step(&mut ex, &mut toks);
            dev.profiler_range(|| {
                for _ in 0..profile_steps {
                    step(&mut ex, &mut toks);
                }
            })
            .expect("profiler range");
            for seq in seqs {
                ex.free_sequence(seq).unwrap();
            }
            continue;
        }
        // The default step, then each batched attention forced, then the register walk,
        // alternating, two rounds.
        for round in 0..2 {
            for (path, attention) in [
                (BmmPath::PipelinedF16, BatchAttention::Auto),
                (BmmPath::PipelinedF16, BatchAttention::Heads),
                (BmmPath::PipelinedF16, BatchAttention::GroupMma),
                (BmmPath::Registers, BatchAttention::Auto),
            ] {
                ex.set_variants(StepVariants {
                    bmm_path: path,
                    batch_attention: attention,
                    ..defaults
                })
                .unwrap();
                for _ in 0..4 {
                    step(&mut ex, &mut toks);
                }
                let t0 = Instant::now();
                for _ in 0..n {
                    step(&mut ex, &mut toks);
                }
                let dt = t0.elapsed().as_secs_f64();
                println!(
                    "| {} | batch {b} | {path:?}, {attention:?}, round {} | {n} steps | {:.3} ms/step | {:.0} tok/s |",
                    s.name,
                    round + 1,
                    dt * 1e3 / n as f64,
                    (b * n) as f64 / dt
                );
            }
        }
        ex.set_variants(defaults).unwrap();
        for seq in seqs {
            ex.free_sequence(seq).unwrap();
        }
    }
}

/// ppN: median wall time of 5 prefills of `pp` random tokens into a fresh sequence (logits
/// of the last token copied back included), after one warm-up; then one profiled run's
/// device-time split between dequantisation, GEMMs and the rest.
fn prefill_bench(ex: &mut GpuExecutor, s: &Spec, pp: usize) {
    let mut rng = Rng::new(11);
    let tokens: Vec<u32> = (0..pp)
        .map(|_| ((rng.next_f32() * s.vocab as f32) as usize).min(s.vocab - 1) as u32)
        .collect();
    let mut logits = vec![0f32; s.vocab];
    let mut times = Vec::new();
    for i in 0..6 {
        let seq = ex.new_sequence().unwrap();
        let t0 = Instant::now();
        ex.prefill(seq, &tokens, &mut logits).unwrap();
        if i > 0 {
            times.push(t0.elapsed().as_secs_f64());
        }
        ex.free_sequence(seq).unwrap();
    }
    times.sort_by(|a, b| a.total_cmp(b));
    let dt = times[times.len() / 2];
    let seq = ex.new_sequence().unwrap();
    let split = ex.prefill_profiled(seq, &tokens, &mut logits);
    ex.free_sequence(seq).unwrap();
    let split = match split {
        Ok(t) => format!(
            "dequant {:.2} ms, GEMM {:.2} ms, rest {:.2} ms (profiled)",
            t.dequant_ms, t.gemm_ms, t.other_ms
        ),
        Err(e) => format!("no breakdown: {e}"),
    };
    let finite = logits.iter().all(|v| v.is_finite());
    println!(
        "prefill {}: pp{pp} {:.0} tok/s ({:.2} ms; {split}; logits finite: {finite})",
        s.name,
        pp as f64 / dt,
        dt * 1e3
    );
}

/// Median wall time (ms) of 7 prefills of `n` random tokens into a fresh sequence, logits
/// back on the host, after one warm-up.
fn prefill_ms(ex: &mut GpuExecutor, vocab: usize, n: usize, rng: &mut Rng) -> f64 {
    let mut logits = vec![0f32; vocab];
    let mut times = Vec::new();
    for i in 0..8 {
        let tokens: Vec<u32> = (0..n)
            .map(|_| ((rng.next_f32() * vocab as f32) as usize).min(vocab - 1) as u32)
            .collect();
        let seq = ex.new_sequence().unwrap();
        let t0 = Instant::now();
        ex.prefill(seq, &tokens, &mut logits).unwrap();
        if i > 0 {
            times.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        ex.free_sequence(seq).unwrap();
    }
    times.sort_by(|a, b| a.total_cmp(b));
    times[times.len() / 2]
}

/// Prompt lengths 1..64: the batched decode step as prefill against the cuBLAS prefill.
fn short_prefill_bench(ex: &mut GpuExecutor, s: &Spec) {
    let mut rng = Rng::new(13);
    println!("| model | prompt tokens | batched step ms | cuBLAS prefill ms |");
    println!("|---|---|---|---|");
    let defaults = ex.variants();
    let short_prefill = |max| StepVariants {
        short_prefill_max: max,
        ..defaults
    };
    for n in [1usize, 2, 5, 8, 16, 32, 64] {
        ex.set_variants(short_prefill(64)).unwrap();
        let short = prefill_ms(ex, s.vocab, n, &mut rng);
        ex.set_variants(short_prefill(0)).unwrap();
        let long = prefill_ms(ex, s.vocab, n, &mut rng);
        println!("| {} | {n} | {short:.3} | {long:.3} |", s.name);
    }
    ex.set_variants(defaults).unwrap();
}
