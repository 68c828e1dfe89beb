//! Tensor parallelism's sharding math on the CPU backend (`LoadOptions::tensor_parallel`:
//! ranks as threads summing through an in-process collective) against the unsharded CPU
//! oracle: llama, qwen3 (QK-norm), gemma3 (sliding windows, sandwich norms, scaled
//! embedding) and a Qwen3-MoE, split over 2 and 4 ranks. A prompt, teacher-forced decode
//! steps and a three-sequence batched step, every logits row within 1e-5 relative.

use std::sync::Arc;

use kiln::conformance::models::{model, Shape};
use kiln_core::{
    Architecture, Backend, DecodeItem, Error, ExpertConfig, LoadOptions, ModelIr, QType, Rng,
    RopeKind,
};

fn cpu() -> Arc<dyn Backend> {
    kiln_core::Registry::with_builtins()
        .get("cpu")
        .expect("the cpu backend")
}

fn shape(arch: Architecture, experts: Option<ExpertConfig>) -> Shape {
    use QType::*;
    Shape {
        arch,
        hidden: 256,
        heads: 8,
        kv_heads: 4,
        head_dim: 32,
        ffn: 1024,
        vocab: 1000,
        layers: 2,
        rope: if arch == Architecture::Llama {
            RopeKind::Norm
        } else {
            RopeKind::Neox
        },
        qkv_bias: false,
        qk_norm: matches!(
            arch,
            Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3
        ),
        tied: arch != Architecture::Llama,
        // Q/K/O and V in 32-value blocks; the feed-forward in K-quants (256-value blocks:
        // down's columns split at them), the head in Q6_K or Q8_0.
        types: [
            Q8_0,
            Q5_0,
            Q4_K,
            Q6_K,
            if arch == Architecture::Llama {
                Q6_K
            } else {
                Q8_0
            },
        ],
        experts,
    }
}

fn shapes() -> Vec<(&'static str, Shape)> {
    let moe = ExpertConfig {
        count: 8,
        used: 2,
        ffn_size: 1024,
        normalize_weights: true,
    };
    vec![
        ("llama", shape(Architecture::Llama, None)),
        ("qwen3", shape(Architecture::Qwen3, None)),
        ("gemma3", shape(Architecture::Gemma3, None)),
        ("qwen3moe", shape(Architecture::Qwen3Moe, Some(moe))),
    ]
}

/// ‖a − b‖ / ‖a‖ over one row.
fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let diff: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| (x as f64 - y as f64).powi(2))
        .sum();
    let norm: f64 = a.iter().map(|&x| (x as f64).powi(2)).sum();
    (diff / norm).sqrt()
}

/// The bar a split model's rows must meet against the whole model's. In f32 the ranks only
/// sum the same products in another order (rounding, ~1e-7). With 8-bit activations such
/// a rounding difference can move a value across a quantisation step in the next layer,
/// so a row may drift by up to about what the 8-bit path costs against f32 (~2e-2 here);
/// a wrong share (a missing head, a transposed split) costs ~1.
fn bar(quantized: bool) -> f64 {
    if quantized {
        3e-2
    } else {
        1e-5
    }
}

fn assert_close(what: &str, whole: &[f32], split: &[f32], vocab: usize, bar: f64) -> f64 {
    assert!(
        split.iter().all(|v| v.is_finite()),
        "{what}: non-finite logits"
    );
    let mut worst = 0.0f64;
    for (a, b) in whole.chunks(vocab).zip(split.chunks(vocab)) {
        worst = worst.max(rel_err(a, b));
    }
    assert!(worst <= bar, "{what}: relative error {worst:e}");
    worst
}

/// The prompt through both, 6 teacher-forced steps, then a batched step of three
/// sequences at different lengths; the worst relative error.
fn compare(ir: &ModelIr, world: usize, quantized: bool, name: &str) -> f64 {
    let options = LoadOptions {
        max_context: 256,
        max_sequences: 4,
        quantized_activations: quantized,
        ..Default::default()
    };
    let mut whole = cpu().load(ir, &options).unwrap();
    let mut split = cpu()
        .load(
            ir,
            &LoadOptions {
                tensor_parallel: world,
                ..options.clone()
            },
        )
        .unwrap();
    let vocab = ir.config.vocab_size;
    let what = format!(
        "{name} over {world} ranks{}",
        if quantized { ", 8-bit" } else { "" }
    );
    let mut rng = Rng::new(world as u64 * 7 + quantized as u64);
    let prompt: Vec<u32> = (0..40)
        .map(|_| (rng.next_u64() % vocab as u64) as u32)
        .collect();
    let (mut a, mut b) = (vec![f32::NAN; vocab], vec![f32::NAN; vocab]);
    let (sa, sb) = (whole.new_sequence().unwrap(), split.new_sequence().unwrap());
    assert_eq!(sa, sb);
    whole.prefill(sa, &prompt, &mut a).unwrap();
    split.prefill(sb, &prompt, &mut b).unwrap();
    let mut worst = assert_close(&what, &a, &b, vocab, bar(quantized));
    for _ in 0..6 {
        let next = kiln_core::argmax(&a) as u32;
        let item = |seq| DecodeItem { seq, token: next };
        b.fill(f32::NAN);
        whole.decode(&[item(sa)], &mut a).unwrap();
        split.decode(&[item(sb)], &mut b).unwrap();
        worst = worst.max(assert_close(&what, &a, &b, vocab, bar(quantized)));
    }
    // Two more sequences (one scored over every position), then all three in one step.
    let mut seqs = vec![sa];
    for len in [5usize, 17] {
        let p = &prompt[..len];
        let (mut ra, mut rb) = (vec![0f32; len * vocab], vec![f32::NAN; len * vocab]);
        let (x, y) = (whole.new_sequence().unwrap(), split.new_sequence().unwrap());
        assert_eq!(x, y);
        whole.prefill_logits(x, p, 0, &mut ra).unwrap();
        split.prefill_logits(y, p, 0, &mut rb).unwrap();
        worst = worst.max(assert_close(&what, &ra, &rb, vocab, bar(quantized)));
        seqs.push(x);
    }
    let batch: Vec<DecodeItem> = seqs
        .iter()
        .enumerate()
        .map(|(i, &seq)| DecodeItem {
            seq,
            token: prompt[i + 1],
        })
        .collect();
    let (mut ba, mut bb) = (vec![0f32; 3 * vocab], vec![f32::NAN; 3 * vocab]);
    whole.decode(&batch, &mut ba).unwrap();
    split.decode(&batch, &mut bb).unwrap();
    worst = worst.max(assert_close(&what, &ba, &bb, vocab, bar(quantized)));
    // Hidden states (embeddings) are whole on every rank.
    let (mut ha, mut hb) = (vec![0f32; 4 * 256], vec![f32::NAN; 4 * 256]);
    let (x, y) = (whole.new_sequence().unwrap(), split.new_sequence().unwrap());
    assert_eq!(x, y);
    let (x, y) = (
        whole.new_sequence().unwrap_err(),
        split.new_sequence().unwrap_err(),
    );
    assert_eq!(
        x.to_string(),
        y.to_string(),
        "both have their four sequences"
    );
    whole.free_sequence(seqs[1]).unwrap();
    split.free_sequence(seqs[1]).unwrap();
    let (x, y) = (whole.new_sequence().unwrap(), split.new_sequence().unwrap());
    whole.prefill_hidden(x, &prompt[..4], 0, &mut ha).unwrap();
    split.prefill_hidden(y, &prompt[..4], 0, &mut hb).unwrap();
    worst = worst.max(assert_close(
        &format!("{what}, hidden"),
        &ha,
        &hb,
        256,
        bar(quantized),
    ));
    println!("{what}: worst relative error {worst:.2e}");
    worst
}

#[test]
fn split_models_give_the_unsharded_logits() {
    for (name, s) in shapes() {
        let ir = model(&mut Rng::new(11), &s, 256);
        for world in [2, 4] {
            compare(&ir, world, false, name);
        }
        compare(&ir, 2, true, name);
    }
}

#[test]
fn models_that_do_not_split_are_refused_and_bad_requests_leave_the_ranks_in_step() {
    let mut s = shape(Architecture::Llama, None);
    s.heads = 6;
    s.kv_heads = 3;
    let ir = model(&mut Rng::new(5), &s, 256);
    let split = |world| {
        cpu().load(
            &ir,
            &LoadOptions {
                max_context: 64,
                tensor_parallel: world,
                ..Default::default()
            },
        )
    };
    match split(4) {
        Err(Error::Unsupported(why)) => assert!(why.contains("divide by 4"), "{why}"),
        other => panic!("expected Unsupported, got {:?}", other.map(|_| ())),
    }
    // A rank count from the command line is refused before anything is allocated per rank.
    assert!(matches!(split(usize::MAX), Err(Error::Unsupported(_))));
    // Three ranks split six heads and three KV heads; a token out of the vocabulary is
    // refused by every rank alike, and the executor goes on.
    let mut exec = split(3).unwrap();
    let vocab = ir.config.vocab_size;
    let seq = exec.new_sequence().unwrap();
    let mut logits = vec![0f32; vocab];
    assert!(matches!(
        exec.prefill(seq, &[1, vocab as u32 + 5], &mut logits),
        Err(Error::InvalidArgument(_))
    ));
    exec.prefill(seq, &[1, 2, 3], &mut logits).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
    assert_eq!(exec.sequence_len(seq).unwrap(), 3);
}
