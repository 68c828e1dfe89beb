//! Prompt and decode speed of the CPU backend on a real GGUF model, with 1 and 2 threads
//! (and every core, when there are more), on each SIMD instruction set the CPU runs: one
//! sequence, then a batch of [`BATCH`] decoding together (tokens a second over the batch).
//!
//! ```text
//! cargo run --release -p kiln-backend-cpu --example cpu_decode_bench [-- MODEL.gguf [ISA [THREADS]]]
//! ```
//! Without a model the one from `KILN_TEST_MODEL` or the kiln cache
//! (`~/.cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf`) runs. ISA (`avx2`, `avx512`)
//! and THREADS keep only that instruction set and thread count (for profiling one).

use std::path::PathBuf;
use std::time::Instant;

use kiln_backend_cpu::{CpuBackend, Isa};
use kiln_core::{argmax, DecodeItem, LoadOptions};

const PROMPT_TOKENS: usize = 64;
const DECODE_TOKENS: usize = 64;
/// Sequences in the batched decode.
const BATCH: usize = 4;

fn model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::args_os().nth(1) {
        return Some(p.into());
    }
    if let Some(p) = std::env::var_os("KILN_TEST_MODEL") {
        return Some(p.into());
    }
    let home = std::env::var_os("HOME")?;
    let p = PathBuf::from(home).join(".cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let Some(path) = model_path() else {
        println!("skipped: no model (pass a path, set KILN_TEST_MODEL, or run `kiln` once to fill the cache)");
        return Ok(());
    };
    let (_file, ir) = kiln_formats::model::load_gguf(&path)?;
    let c = &ir.config;
    println!(
        "{}: {} layers, hidden {}, vocab {}, qtypes {:?}",
        path.display(),
        c.num_layers,
        c.hidden_size,
        c.vocab_size,
        ir.matrix_qtypes()
            .iter()
            .map(|q| q.name())
            .collect::<Vec<_>>()
    );
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let only_isa = std::env::args().nth(2);
    let only_threads = std::env::args()
        .nth(3)
        .map(|t| t.parse::<usize>())
        .transpose()?;
    let mut counts = vec![1, 2];
    if cores > 2 {
        counts.push(cores);
    }
    if let Some(t) = only_threads {
        counts = vec![t];
    }
    let vocab = c.vocab_size;
    let prompt: Vec<u32> = (0..PROMPT_TOKENS as u32)
        .map(|i| (i * 7919 + 13) % vocab as u32)
        .collect();
    let isas: Vec<Isa> = Isa::available()
        .into_iter()
        .filter(|&isa| isa != Isa::Portable)
        .filter(|isa| only_isa.as_deref().is_none_or(|only| only == isa.name()))
        .collect();
    for (threads, isa) in counts
        .iter()
        .flat_map(|&t| isas.iter().map(move |&isa| (t, isa)))
    {
        let opts = LoadOptions {
            max_context: 512,
            max_sequences: BATCH,
            threads: Some(threads),
            ..Default::default()
        };
        let mut ex = CpuBackend.load_executor_on(&ir, &opts, isa)?;
        let mut logits = vec![0.0f32; vocab];
        // Warm-up: page the weights in and spin the pool up.
        let seq = kiln_core::LayerExecutor::new_sequence(&mut ex)?;
        kiln_core::LayerExecutor::prefill(&mut ex, seq, &prompt[..8], &mut logits)?;
        kiln_core::LayerExecutor::truncate_sequence(&mut ex, seq, 0)?;

        let t = Instant::now();
        kiln_core::LayerExecutor::prefill(&mut ex, seq, &prompt, &mut logits)?;
        let prefill_s = t.elapsed().as_secs_f64();
        let mut token = argmax(&logits);
        let t = Instant::now();
        for _ in 0..DECODE_TOKENS {
            kiln_core::LayerExecutor::decode(&mut ex, &[DecodeItem { seq, token }], &mut logits)?;
            token = argmax(&logits);
        }
        let decode_s = t.elapsed().as_secs_f64();
        // The batch: the first sequence as it stands and BATCH − 1 more after short prompts.
        let mut items = vec![DecodeItem { seq, token }];
        for b in 1..BATCH {
            let s = kiln_core::LayerExecutor::new_sequence(&mut ex)?;
            kiln_core::LayerExecutor::prefill(&mut ex, s, &prompt[b..b + 8], &mut logits)?;
            items.push(DecodeItem {
                seq: s,
                token: argmax(&logits),
            });
        }
        let mut batch_logits = vec![0.0f32; vocab * BATCH];
        let t = Instant::now();
        for _ in 0..DECODE_TOKENS {
            kiln_core::LayerExecutor::decode(&mut ex, &items, &mut batch_logits)?;
            for (item, l) in items.iter_mut().zip(batch_logits.chunks_exact(vocab)) {
                item.token = argmax(l);
            }
        }
        let batch_s = t.elapsed().as_secs_f64();
        println!(
            "{:>8} threads {threads}: prompt {PROMPT_TOKENS} tokens {:.1} tok/s, decode {DECODE_TOKENS} tokens {:.1} tok/s ({:.2} ms/token), {BATCH} sequences {:.1} tok/s",
            isa.name(),
            PROMPT_TOKENS as f64 / prefill_s,
            DECODE_TOKENS as f64 / decode_s,
            decode_s * 1e3 / DECODE_TOKENS as f64,
            (BATCH * DECODE_TOKENS) as f64 / batch_s
        );
    }
    Ok(())
}
