//! The persistent decode step (one cooperative kernel a token, `kernels/cuda/persist.cu`)
//! against the CPU reference and the CUDA-graph step, on small random models of each
//! supported architecture shape, at both block sizes: per-step logits cosine ≥ 0.99999 to
//! the CPU, the same greedy tokens except at near-ties, and steps that are bit-reproducible
//! (the same tokens replayed after a truncation give the same bits). A long prompt makes
//! the attention run over many splits. `#[ignore]`d: CI lists them as ignored;
//! scripts/gpu/gpu_suite.sh runs them with `--include-ignored` and `KILN_REQUIRE_GPU=1`.

use kiln_backend_cpu::CpuBackend;
use kiln_backend_cuda_q4k::load_executor;
use kiln_core::{DecodeItem, LayerExecutor, LoadOptions, Rng, SeqId};
use kiln_kernels::testdata::fresh_seed;

mod common;
use common::{cosine, device, model, shapes};

/// Teacher-forced decode of `tokens` on `seq`, each step's logits (poisoned with NaN
/// before the step writes them).
fn decode_all(
    exec: &mut dyn LayerExecutor,
    seq: SeqId,
    tokens: &[u32],
    vocab: usize,
) -> Vec<Vec<f32>> {
    tokens
        .iter()
        .map(|&token| {
            let mut logits = vec![f32::NAN; vocab];
            exec.decode(&[DecodeItem { seq, token }], &mut logits)
                .unwrap();
            logits
        })
        .collect()
}

/// The top two logits' gap: below 1e-3 a greedy choice is a near-tie.
fn top2_gap(l: &[f32]) -> f32 {
    let mut v: Vec<f32> = l.to_vec();
    v.sort_by(|a, b| b.total_cmp(a));
    v[0] - v[1]
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn persistent_step_matches_the_cpu_and_replays_bit_for_bit() {
    let Some(dev) = device() else { return };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    let steps = 32;
    let mut failures = Vec::new();
    for (label, shape) in shapes() {
        let ir = model(&mut rng, &shape, 1024);
        let options = LoadOptions {
            max_context: 1024,
            max_sequences: 1,
            ..Default::default()
        };
        let vocab = shape.vocab;
        let mut cpu = CpuBackend.load_executor(&ir, &options).unwrap();
        // A short prompt (one split a head) and a long one (many splits and their merge).
        for prompt_len in [4usize, 600] {
            let prompt: Vec<u32> = (0..prompt_len)
                .map(|_| (rng.next_u64() % vocab as u64) as u32)
                .collect();
            let mut lc = vec![0f32; vocab];
            let cs = cpu.new_sequence().unwrap();
            cpu.prefill(cs, &prompt, &mut lc).unwrap();
            let mut forced = Vec::with_capacity(steps);
            let mut cpu_logits = Vec::with_capacity(steps);
            for _ in 0..steps {
                let next = kiln_core::argmax(&lc);
                forced.push(next);
                cpu.decode(
                    &[DecodeItem {
                        seq: cs,
                        token: next,
                    }],
                    &mut lc,
                )
                .unwrap();
                cpu_logits.push(lc.clone());
            }
            cpu.free_sequence(cs).unwrap();
            for warps in [8usize, 16] {
                let name = format!("{label} / {prompt_len}-token prompt / {warps} warps");
                let mut gpu = load_executor(&dev, &ir, &options).unwrap();
                if let Err(e) = gpu.set_persistent_decode(Some(warps)) {
                    failures.push(format!("{name}: refused: {e}"));
                    continue;
                }
                assert_eq!(gpu.persistent_decode(), Some(warps));
                let gs = gpu.new_sequence().unwrap();
                let mut lg = vec![f32::NAN; vocab];
                gpu.prefill(gs, &prompt, &mut lg).unwrap();
                let first = decode_all(&mut gpu, gs, &forced, vocab);
                // Replayed: the same tokens at the same positions give the same bits.
                gpu.truncate_sequence(gs, prompt_len).unwrap();
                let again = decode_all(&mut gpu, gs, &forced, vocab);
                let replay_equal = first
                    .iter()
                    .zip(&again)
                    .all(|(a, b)| a.iter().zip(b).all(|(x, y)| x.to_bits() == y.to_bits()));
                let mut worst = 1.0f64;
                let (mut differ, mut ties) = (0, 0);
                for (c, g) in cpu_logits.iter().zip(&first) {
                    worst = worst.min(cosine(c, g));
                    if kiln_core::argmax(c) != kiln_core::argmax(g) {
                        if top2_gap(c) < 1e-3 {
                            ties += 1;
                        } else {
                            differ += 1;
                        }
                    }
                }
                println!(
                    "{name}: worst cosine {worst:.7}, greedy differs {differ} (+{ties} near-ties) of {steps}, replay bit-equal {replay_equal}"
                );
                // Written so that a NaN cosine fails too.
                if !(worst >= 0.99999) {
                    failures.push(format!("{name}: cosine {worst} < 0.99999"));
                }
                if differ > 0 {
                    failures.push(format!(
                        "{name}: {differ} greedy tokens differ from the CPU's"
                    ));
                }
                if !replay_equal {
                    failures.push(format!("{name}: a replayed step gave other bits"));
                }
            }
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// The persistent step and the graph step of one executor agree, and switching back to the
/// graph path works mid-sequence.
#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn persistent_and_graph_steps_agree_and_switch() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(fresh_seed());
    let (label, shape) = shapes().remove(0);
    let ir = model(&mut rng, &shape, 256);
    let options = LoadOptions {
        max_context: 256,
        max_sequences: 1,
        ..Default::default()
    };
    let vocab = shape.vocab;
    let tokens: Vec<u32> = (0..24)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect();
    let mut gpu = load_executor(&dev, &ir, &options).unwrap();
    let s = gpu.new_sequence().unwrap();
    let graph = decode_all(&mut gpu, s, &tokens, vocab);
    gpu.truncate_sequence(s, 0).unwrap();
    gpu.set_persistent_decode(Some(8)).unwrap();
    let persistent = decode_all(&mut gpu, s, &tokens, vocab);
    gpu.truncate_sequence(s, 12).unwrap();
    gpu.set_persistent_decode(None).unwrap();
    assert_eq!(gpu.persistent_decode(), None);
    let back = decode_all(&mut gpu, s, &tokens[12..], vocab);
    let worst = graph
        .iter()
        .zip(&persistent)
        .map(|(a, b)| cosine(a, b))
        .fold(1.0f64, f64::min);
    let worst_back = graph[12..]
        .iter()
        .zip(&back)
        .map(|(a, b)| cosine(a, b))
        .fold(1.0f64, f64::min);
    println!("{label}: graph vs persistent worst cosine {worst:.7}; back on the graph path {worst_back:.7}");
    assert!(worst >= 0.99999, "graph vs persistent: {worst}");
    assert!(worst_back >= 0.99999, "after switching back: {worst_back}");
    assert!(
        gpu.set_persistent_decode(Some(12)).is_err(),
        "12 warps a block is refused"
    );
}
