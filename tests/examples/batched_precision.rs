//! Where the batched decode step's logits part from the one-sequence step's, on a real model:
//! the case `batched_decode`'s `gpu_batched_decode_real_smollm2` runs (M sequences, the same
//! seeded prompts, teacher-forced on the one-sequence run's greedy tokens), with each
//! batched matmul walk and attention kernel forced in turn, and the CPU oracle beside both
//! on the rows named. Prints, per variant and row, the worst cosine to the one-sequence
//! logits and (for the oracle's rows) the worst cosine of each GPU path to the oracle.
//!
//! `batched_precision MODEL.gguf [--m 16] [--seed 23] [--steps 16] [--rows 1,3]`
//! (MODEL: the real SmolLM2 Q4_1 file; it is requantised to q4_k_m as the test does.)

use std::sync::Arc;

use kiln::Model;
use kiln_backend_cuda_q4k::{load_executor, GpuExecutor, StepVariants};
use kiln_core::{argmax, DecodeItem, LayerExecutor, LoadOptions};
use kiln_formats::quantize::{no_progress, quantize_file, QuantizeOptions, Recipe};
use kiln_kernels::{BatchAttention, BmmPath, Device};
use kiln_tests::cosine;

fn value_of<T: std::str::FromStr>(args: &[String], flag: &str) -> Option<T> {
    args.windows(2)
        .find(|w| w[0] == flag)
        .and_then(|w| w[1].parse().ok())
}

// The test's prompt generator (tests/batched_decode.rs), kept in step by hand: the probe
// must see the prompts the test saw.
fn lcg(rng: &mut u64) -> u64 {
    *rng = rng
        .wrapping_mul(6364136223846793005)
        .wrapping_add(1442695040888963407);
    *rng
}

fn prompts(m: usize, longest: usize, vocab: usize, seed: u64) -> Vec<Vec<u32>> {
    let mut rng = seed;
    let lens: Vec<usize> = (0..m)
        .map(|i| match i {
            0 => 5,
            1 => longest,
            _ => 6 + (lcg(&mut rng) >> 33) as usize % (longest - 6),
        })
        .collect();
    lens.iter()
        .map(|&l| {
            (0..l)
                .map(|_| (10 + (lcg(&mut rng) >> 33) as usize % (vocab - 10)) as u32)
                .collect()
        })
        .collect()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let Some(source) = args.get(1).filter(|a| !a.starts_with("--")) else {
        eprintln!(
            "usage: batched_precision MODEL.gguf [--m 16] [--seed 23] [--steps 16] [--rows 1,3]"
        );
        std::process::exit(2);
    };
    let m: usize = value_of(&args, "--m").unwrap_or(16);
    let seed: u64 = value_of(&args, "--seed").unwrap_or(7 + m as u64);
    let steps: usize = value_of(&args, "--steps").unwrap_or(16);
    let longest: usize = value_of(&args, "--longest").unwrap_or(1500);
    let oracle_rows: Vec<usize> = value_of::<String>(&args, "--rows")
        .map(|v| v.split(',').filter_map(|r| r.parse().ok()).collect())
        .unwrap_or(vec![1, 3]);
    let dev: Arc<Device> = match kiln_kernels::unavailable_reason() {
        Some(why) => {
            println!("skipped: {why}");
            return;
        }
        None => Device::new(0).expect("device"),
    };
    let path = std::env::temp_dir().join("batched_precision.q4_k_m.gguf");
    quantize_file(
        std::path::Path::new(source),
        &path,
        QuantizeOptions {
            recipe: Recipe::Q4_K_M,
            measure_error: false,
        },
        &no_progress,
    )
    .expect("quantize");
    let model = Model::open(&path).expect("open");
    let ir = &model.ir;
    let vocab = ir.config.vocab_size;
    let options = LoadOptions {
        max_context: longest + steps + 8,
        max_sequences: 64,
        ..Default::default()
    };
    let prompts = prompts(m, longest, vocab, seed);
    println!(
        "M={m} seed {seed}: prompt lengths {:?}",
        prompts.iter().map(Vec::len).collect::<Vec<_>>()
    );

    // The one-sequence run: its logits per step and row, and its greedy tokens.
    let mut alone = load_executor(&dev, ir, &options).expect("load");
    let mut ref_logits = vec![vec![vec![f32::NAN; vocab]; m]; steps + 1];
    let seqs: Vec<_> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let s = alone.new_sequence().unwrap();
            alone.prefill(s, p, &mut ref_logits[0][i]).unwrap();
            s
        })
        .collect();
    let mut tokens = vec![vec![0u32; m]; steps];
    for step in 0..steps {
        for i in 0..m {
            let t = argmax(&ref_logits[step][i]);
            tokens[step][i] = t;
            let (head, tail) = ref_logits.split_at_mut(step + 1);
            let _ = head;
            alone
                .decode(
                    &[DecodeItem {
                        seq: seqs[i],
                        token: t,
                    }],
                    &mut tail[0][i],
                )
                .unwrap();
        }
    }
    drop(alone);

    // The CPU oracle on the rows named, teacher-forced on the same tokens.
    let mut cpu = kiln_tests::cpu_executor(ir, options.max_context);
    let mut oracle: Vec<Vec<Vec<f32>>> = Vec::new();
    for &r in &oracle_rows {
        let mut per_step = vec![vec![f32::NAN; vocab]; steps + 1];
        let s = cpu.new_sequence().unwrap();
        cpu.prefill(s, &prompts[r], &mut per_step[0]).unwrap();
        for step in 0..steps {
            cpu.decode(
                &[DecodeItem {
                    seq: s,
                    token: tokens[step][r],
                }],
                &mut per_step[step + 1],
            )
            .unwrap();
        }
        cpu.free_sequence(s).unwrap();
        oracle.push(per_step);
    }
    for (k, &r) in oracle_rows.iter().enumerate() {
        let worst = (1..=steps)
            .map(|s| cosine(&oracle[k][s], &ref_logits[s][r]))
            .fold(1.0f64, f64::min);
        println!("one-sequence step vs CPU oracle, row {r}: min cosine {worst:.7}");
    }

    let variants = [
        ("default", None, None),
        (
            "f16 walk, head attention",
            Some(BmmPath::PipelinedF16),
            Some(BatchAttention::Heads),
        ),
        (
            "f16 walk, group attention",
            Some(BmmPath::PipelinedF16),
            Some(BatchAttention::GroupMma),
        ),
        (
            "register walk",
            Some(BmmPath::Registers),
            Some(BatchAttention::Heads),
        ),
    ];
    for (name, path, attention) in variants {
        let mut batched: GpuExecutor = load_executor(&dev, ir, &options).expect("load");
        let defaults = batched.variants();
        batched
            .set_variants(StepVariants {
                bmm_path: path.unwrap_or(defaults.bmm_path),
                batch_attention: attention.unwrap_or(defaults.batch_attention),
                ..defaults
            })
            .expect("variants");
        let mut scratch = vec![0f32; vocab];
        let bseqs: Vec<_> = prompts
            .iter()
            .map(|p| {
                let s = batched.new_sequence().unwrap();
                batched.prefill(s, p, &mut scratch).unwrap();
                s
            })
            .collect();
        let mut worst = vec![(1.0f64, 0usize); m];
        let mut worst_oracle = vec![1.0f64; oracle_rows.len()];
        let mut rows = vec![f32::NAN; m * vocab];
        for step in 0..steps {
            let items: Vec<DecodeItem> = bseqs
                .iter()
                .zip(&tokens[step])
                .map(|(&seq, &token)| DecodeItem { seq, token })
                .collect();
            rows.fill(f32::NAN);
            batched.decode(&items, &mut rows).unwrap();
            for i in 0..m {
                let got = &rows[i * vocab..(i + 1) * vocab];
                let c = cosine(&ref_logits[step + 1][i], got);
                if c < worst[i].0 {
                    worst[i] = (c, step);
                }
            }
            for (k, &r) in oracle_rows.iter().enumerate() {
                let got = &rows[r * vocab..(r + 1) * vocab];
                worst_oracle[k] = worst_oracle[k].min(cosine(&oracle[k][step + 1], got));
            }
        }
        let (row, (c, step)) = worst
            .iter()
            .enumerate()
            .min_by(|a, b| a.1 .0.total_cmp(&b.1 .0))
            .unwrap();
        println!(
            "{name:<28} vs one-sequence: worst row {row} (prompt {}) cosine {c:.7} at step {step}",
            prompts[row].len()
        );
        let per_row: Vec<String> = worst.iter().map(|(c, _)| format!("{c:.6}")).collect();
        println!("    per row: {}", per_row.join(" "));
        for (k, &r) in oracle_rows.iter().enumerate() {
            println!(
                "    vs CPU oracle, row {r}: min cosine {:.7}",
                worst_oracle[k]
            );
        }
    }
}
