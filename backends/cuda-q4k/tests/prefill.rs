//! Batched prefill against the CPU reference backend on small random models of each
//! supported architecture shape (llama Q4_K/Q6_K mix, qwen2 with QKV bias at hidden 576,
//! qwen3 with QK-norm and head_dim 128): the last token's logits must agree (cosine) for
//! prompts of 1 to 600 tokens (600 crosses a chunk), a prefill appended to a sequence must
//! continue it, and greedy decode steps after a GPU prefill must match the CPU's (so the KV
//! cache the prefill wrote is right), and a scoring prefill's every row must agree with the
//! CPU's. `#[ignore]`d: they need a GPU; scripts/gpu/gpu_suite.sh
//! runs them with `--include-ignored`.

use kiln_backend_cpu::CpuBackend;
use kiln_backend_cuda_q4k::{
    load_executor, GpuExecutor, StepVariants, PREFILL_CHUNK, SHORT_PREFILL,
};
use kiln_core::{DecodeItem, LayerExecutor, LoadOptions, Rng};
use kiln_kernels::testdata::fresh_seed;

mod common;
use common::{cosine, device, model, shapes};

const FLOOR: f64 = 0.999;

fn prompt(rng: &mut Rng, n: usize, vocab: usize) -> Vec<u32> {
    (0..n)
        .map(|_| ((rng.next_f32() * vocab as f32) as usize).min(vocab - 1) as u32)
        .collect()
}

/// Decodes `steps` greedy tokens (the CPU's argmax) on both executors, returning the worst
/// per-step cosine.
fn decode_both(
    cpu: &mut dyn LayerExecutor,
    gpu: &mut GpuExecutor,
    (cs, gs): (kiln_core::SeqId, kiln_core::SeqId),
    lc: &mut [f32],
    lg: &mut [f32],
    steps: usize,
) -> f64 {
    let mut worst = f64::INFINITY;
    for _ in 0..steps {
        let next = kiln_core::argmax(lc);
        cpu.decode(
            &[DecodeItem {
                seq: cs,
                token: next,
            }],
            lc,
        )
        .unwrap();
        lg.fill(f32::NAN);
        gpu.decode(
            &[DecodeItem {
                seq: gs,
                token: next,
            }],
            lg,
        )
        .unwrap();
        worst = worst.min(cosine(lc, lg));
    }
    worst
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn batched_prefill_matches_the_cpu_backend() {
    let Some(dev) = device() else { return };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    const { assert!(600 > PREFILL_CHUNK, "the longest prompt must cross a chunk") };
    let options = LoadOptions {
        max_context: 1024,
        max_sequences: 1,
        ..Default::default()
    };
    let mut failures = Vec::new();
    for (label, shape) in shapes() {
        let ir = model(&mut rng, &shape, 1024);
        let vocab = shape.vocab;
        let mut cpu = CpuBackend.load_executor(&ir, &options).unwrap();
        let mut gpu = load_executor(&dev, &ir, &options).unwrap();
        if let Some(why) = gpu.batched_prefill_unavailable() {
            panic!("batched prefill unavailable on a GPU machine: {why}");
        }
        for n in [1usize, 7, 64, 300, 600] {
            let p = prompt(&mut rng, n, vocab);
            let cs = cpu.new_sequence().unwrap();
            let gs = gpu.new_sequence().unwrap();
            let (mut lc, mut lg) = (vec![0f32; vocab], vec![f32::NAN; vocab]);
            cpu.prefill(cs, &p, &mut lc).unwrap();
            gpu.prefill(gs, &p, &mut lg).unwrap();
            assert_eq!(gpu.sequence_len(gs).unwrap(), n);
            let pre = cosine(&lc, &lg);
            let same = kiln_core::argmax(&lc) == kiln_core::argmax(&lg);
            // A second prompt appended to the same sequence starts at its length.
            let more = prompt(&mut rng, 5, vocab);
            cpu.prefill(cs, &more, &mut lc).unwrap();
            lg.fill(f32::NAN);
            gpu.prefill(gs, &more, &mut lg).unwrap();
            let appended = cosine(&lc, &lg);
            let dec = decode_both(&mut cpu, &mut gpu, (cs, gs), &mut lc, &mut lg, 4);
            println!(
                "{label}, {n} tokens: prefill cosine {pre:.6} (same argmax {same}), appended {appended:.6}, decode after {dec:.6}"
            );
            for (what, v) in [
                ("prefill", pre),
                ("appended prefill", appended),
                ("decode", dec),
            ] {
                // Written so that a NaN cosine fails too.
                if v.is_nan() || v < FLOOR {
                    failures.push(format!("{label}, {n} tokens, {what}: cosine {v} < {FLOOR}"));
                }
            }
            cpu.free_sequence(cs).unwrap();
            gpu.free_sequence(gs).unwrap();
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Short prompts prefill through the batched decode step (the prompt's tokens its rows):
/// its last-token logits must agree with the CPU's and with the cuBLAS prefill's on the same
/// prompt, and decoding after it must match the CPU (the KV it wrote is right), at every
/// length the short path takes, including one (a padded bucket) and its largest.
#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn short_prefill_matches_the_cublas_prefill_and_the_cpu() {
    let Some(dev) = device() else { return };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    let options = LoadOptions {
        max_context: 256,
        max_sequences: 1,
        ..Default::default()
    };
    let mut failures = Vec::new();
    let mut tested = 0;
    for (label, shape) in shapes() {
        let ir = model(&mut rng, &shape, 256);
        let vocab = shape.vocab;
        let mut cpu = CpuBackend.load_executor(&ir, &options).unwrap();
        let mut gpu = load_executor(&dev, &ir, &options).unwrap();
        if let Some(why) = gpu.batched_decode_unavailable() {
            // Formats without an int8 matmul (f16 matrices) keep the cuBLAS prefill.
            println!("{label}: no batched step ({why}); short prompts take the cuBLAS prefill");
            continue;
        }
        tested += 1;
        for n in [1usize, 2, 5, 9, 16, SHORT_PREFILL] {
            let p = prompt(&mut rng, n, vocab);
            let (mut lc, mut short, mut long) = (
                vec![0f32; vocab],
                vec![f32::NAN; vocab],
                vec![f32::NAN; vocab],
            );
            let cs = cpu.new_sequence().unwrap();
            cpu.prefill(cs, &p, &mut lc).unwrap();
            let defaults = gpu.variants();
            let short_prefill = |max| StepVariants {
                short_prefill_max: max,
                ..defaults
            };
            gpu.set_variants(short_prefill(0)).unwrap();
            let gs = gpu.new_sequence().unwrap();
            gpu.prefill(gs, &p, &mut long).unwrap();
            gpu.free_sequence(gs).unwrap();
            gpu.set_variants(short_prefill(SHORT_PREFILL)).unwrap();
            let gs = gpu.new_sequence().unwrap();
            gpu.prefill(gs, &p, &mut short).unwrap();
            assert_eq!(gpu.sequence_len(gs).unwrap(), n);
            let vs_cpu = cosine(&lc, &short);
            let vs_cublas = cosine(&long, &short);
            let dec = decode_both(&mut cpu, &mut gpu, (cs, gs), &mut lc, &mut short, 4);
            println!("{label}, {n} tokens: short prefill vs CPU {vs_cpu:.6}, vs cuBLAS prefill {vs_cublas:.6}, decode after {dec:.6}");
            for (what, v) in [
                ("vs CPU", vs_cpu),
                ("vs cuBLAS prefill", vs_cublas),
                ("decode after", dec),
            ] {
                if v.is_nan() || v < FLOOR {
                    failures.push(format!(
                        "{label}, {n} tokens, short prefill {what}: cosine {v} < {FLOOR}"
                    ));
                }
            }
            cpu.free_sequence(cs).unwrap();
            gpu.free_sequence(gs).unwrap();
        }
    }
    assert!(tested >= 2, "only {tested} shapes had a batched step");
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn batched_prefill_rejects_bad_input() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(fresh_seed());
    let (_, shape) = shapes().remove(0);
    let ir = model(&mut rng, &shape, 1024);
    let options = LoadOptions {
        max_context: 64,
        max_sequences: 1,
        ..Default::default()
    };
    let mut gpu = load_executor(&dev, &ir, &options).unwrap();
    let vocab = shape.vocab;
    let s = gpu.new_sequence().unwrap();
    let mut logits = vec![0f32; vocab];
    assert!(gpu.prefill(s, &[], &mut logits).is_err(), "empty prompt");
    assert!(
        gpu.prefill(s, &[vocab as u32], &mut logits).is_err(),
        "id out of range"
    );
    assert!(
        gpu.prefill(s, &vec![1; 65], &mut logits).is_err(),
        "past the context"
    );
    assert_eq!(
        gpu.sequence_len(s).unwrap(),
        0,
        "a rejected prompt leaves no trace"
    );
    gpu.prefill(s, &vec![1; 64], &mut logits).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
    assert!(gpu.prefill(s, &[1], &mut logits).is_err(), "full sequence");
}

/// A scoring prefill (`prefill_logits`: the logits after every token from `first` on, what
/// `kiln perplexity` reads) against the CPU's, row by row: prompts that cross a chunk,
/// scored from inside the first chunk, from inside the second only and at the last token
/// alone, appended to a sequence that already holds tokens; the qwen3 shape's vocabulary is
/// wider than one slice of the LM head, so its rows are assembled from two GEMMs. The rows
/// start as NaN; decoding after the scoring prefill must match the CPU (the KV is right).
#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn prefill_logits_match_the_cpu_backend_row_by_row() {
    let Some(dev) = device() else { return };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    let options = LoadOptions {
        max_context: 1024,
        max_sequences: 1,
        ..Default::default()
    };
    let mut failures = Vec::new();
    for (label, shape) in shapes() {
        let ir = model(&mut rng, &shape, 1024);
        let vocab = shape.vocab;
        let mut cpu = CpuBackend.load_executor(&ir, &options).unwrap();
        let mut gpu = load_executor(&dev, &ir, &options).unwrap();
        for (held, n, first) in [
            (0usize, 700usize, 100usize),
            (0, 700, 600),
            (9, 600, 599),
            (3, 40, 0),
        ] {
            let before = prompt(&mut rng, held.max(1), vocab);
            let p = prompt(&mut rng, n, vocab);
            let cs = cpu.new_sequence().unwrap();
            let gs = gpu.new_sequence().unwrap();
            let mut scratch = vec![0f32; vocab];
            if held > 0 {
                cpu.prefill(cs, &before, &mut scratch).unwrap();
                gpu.prefill(gs, &before, &mut scratch).unwrap();
            }
            let rows = n - first;
            let mut lc = vec![0f32; rows * vocab];
            let mut lg = vec![f32::NAN; rows * vocab];
            cpu.prefill_logits(cs, &p, first, &mut lc).unwrap();
            gpu.prefill_logits(gs, &p, first, &mut lg).unwrap();
            assert_eq!(gpu.sequence_len(gs).unwrap(), held + n);
            let mut worst = (f64::INFINITY, 0);
            let mut argmax_differs = 0;
            for (j, (rc, rg)) in lc.chunks(vocab).zip(lg.chunks(vocab)).enumerate() {
                let c = cosine(rc, rg);
                // Written so that a NaN cosine is the worst.
                if !(c >= worst.0) {
                    worst = (c, j);
                }
                if kiln_core::argmax(rc) != kiln_core::argmax(rg) {
                    argmax_differs += 1;
                }
            }
            let (mut tc, mut tg) = (
                lc[(rows - 1) * vocab..].to_vec(),
                lg[(rows - 1) * vocab..].to_vec(),
            );
            let dec = decode_both(&mut cpu, &mut gpu, (cs, gs), &mut tc, &mut tg, 3);
            println!(
                "{label}, {held} held + {n} tokens scored from {first}: worst row cosine {:.6} (row {}), {argmax_differs}/{rows} rows with another argmax, decode after {dec:.6}",
                worst.0, worst.1
            );
            for (what, v) in [("scored row", worst.0), ("decode", dec)] {
                if v.is_nan() || v < FLOOR {
                    failures.push(format!(
                        "{label}, {held} + {n} tokens from {first}, {what}: cosine {v} < {FLOOR}"
                    ));
                }
            }
            cpu.free_sequence(cs).unwrap();
            gpu.free_sequence(gs).unwrap();
        }
        // Refused calls change nothing: `first` past the prompt, a buffer of the wrong size.
        let gs = gpu.new_sequence().unwrap();
        let p = prompt(&mut rng, 8, vocab);
        let mut out = vec![0f32; 8 * vocab];
        assert!(gpu.prefill_logits(gs, &p, 8, &mut out).is_err());
        assert!(gpu.prefill_logits(gs, &p, 1, &mut out).is_err());
        assert_eq!(gpu.sequence_len(gs).unwrap(), 0);
        gpu.free_sequence(gs).unwrap();
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
