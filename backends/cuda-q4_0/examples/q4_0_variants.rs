//! Decode speed of `cuda-q4_0`'s policy choices on GGUF files, in one process: Q4_0 kept
//! plain or repacked into rows of four (`Q4_0_X4`) from a row length on, and the tiling of
//! the grouped GEMVs. Per variant: greedy tokens per second over `-n` steps sampled on the
//! device (as `kiln bench` times generation), and the device time of one captured step.
//!
//! `q4_0_variants [-n 128] MODEL.gguf...`

use std::sync::Arc;
use std::time::Instant;

use kiln_backend_cuda_q4_0::{GpuExecutor, Q40Policy};
use kiln_core::{DecodeItem, LayerExecutor, LoadOptions, Sampler, SamplingParams};
use kiln_cuda_runtime::shared_device;
use kiln_kernels::GemvTiling;

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let mut steps = 128;
    let mut files = Vec::new();
    let mut it = args.iter();
    while let Some(a) = it.next() {
        if a == "-n" {
            steps = it
                .next()
                .and_then(|v| v.parse().ok())
                .expect("-n takes a number");
        } else {
            files.push(a.clone());
        }
    }
    let dev = match shared_device() {
        Ok(d) => d,
        Err(why) => {
            println!("skipped: {why}");
            return;
        }
    };
    let variants = [
        ("default", Q40Policy::default()),
        (
            "plain everywhere",
            Q40Policy {
                grouped_from: usize::MAX,
                ..Default::default()
            },
        ),
        (
            "x4 everywhere R4S2",
            Q40Policy {
                grouped_from: 0,
                grouped_tiling: GemvTiling::new(4, 2),
            },
        ),
        (
            "x4 everywhere R4S1",
            Q40Policy {
                grouped_from: 0,
                grouped_tiling: GemvTiling::new(4, 1),
            },
        ),
        (
            "x4 everywhere R4S4",
            Q40Policy {
                grouped_from: 0,
                grouped_tiling: GemvTiling::new(4, 4),
            },
        ),
        (
            "x4 from 2048",
            Q40Policy {
                grouped_from: 2048,
                ..Default::default()
            },
        ),
    ];
    println!("| model | variant | tg{steps} tok/s | graph ms/step |");
    println!("|---|---|---|---|");
    for f in &files {
        let model = kiln::Model::open(std::path::Path::new(f)).expect("open model");
        let name = std::path::Path::new(f)
            .file_name()
            .unwrap()
            .to_string_lossy()
            .into_owned();
        for (label, policy) in variants {
            let options = LoadOptions {
                max_context: 1024,
                max_sequences: 1,
                ..Default::default()
            };
            let mut ex =
                GpuExecutor::load(&dev, &model.ir, &options, Arc::new(policy)).expect("load");
            let vocab = model.ir.config.vocab_size;
            let seq = ex.new_sequence().unwrap();
            let mut logits = vec![0f32; vocab];
            ex.prefill(seq, &[1, 2, 3, 4], &mut logits).unwrap();
            let mut sampler = [Sampler::new(SamplingParams::greedy())];
            let mut tok = [kiln_core::argmax(&logits)];
            for _ in 0..16 {
                let t = tok[0];
                ex.decode_sample(&[DecodeItem { seq, token: t }], &mut sampler, &mut tok)
                    .unwrap();
            }
            let mut best = 0f64;
            for _ in 0..3 {
                ex.truncate_sequence(seq, 4).unwrap();
                let t0 = Instant::now();
                for _ in 0..steps {
                    let t = tok[0];
                    ex.decode_sample(&[DecodeItem { seq, token: t }], &mut sampler, &mut tok)
                        .unwrap();
                }
                best = best.max(steps as f64 / t0.elapsed().as_secs_f64());
            }
            let graph_ms = ex.step_device_ms(seq, 21).unwrap();
            println!("| {name} | {label} | {best:.1} | {graph_ms:.3} |");
        }
    }
}
