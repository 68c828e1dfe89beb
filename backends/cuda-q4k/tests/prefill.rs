//! Batched prefill against the CPU reference backend on small random models of each
//! supported architecture shape (llama Q4_K/Q6_K mix, qwen2 with QKV bias at hidden 576,
//! qwen3 with QK-norm and head_dim 128): the last token's logits must agree (cosine) for
//! prompts of 1 to 600 tokens (600 crosses a chunk), a prefill appended to a sequence must
//! continue it, and greedy decode steps after a GPU prefill must match the CPU's (so the KV
//! cache the prefill wrote is right). `#[ignore]`d: they need a GPU; scripts/gpu_suite.sh
//! runs them with `--include-ignored`.

use std::sync::Arc;

use kiln_backend_cpu::CpuBackend;
use kiln_backend_cuda_q4k::{CudaExecutor, PREFILL_CHUNK};
use kiln_core::{
    Activation, Architecture, DecodeItem, LayerExecutor, LayerWeights, LoadOptions, ModelConfig,
    ModelIr, ModelWeights, NormKind, QType, Rng, RopeConfig, RopeKind, RopeScaling, TensorView,
};
use kiln_kernels::testdata::{fresh_seed, gaussian_weights, random_vec};
use kiln_kernels::Device;

fn device() -> Option<Arc<Device>> {
    match kiln_kernels::unavailable_reason() {
        Some(why) => {
            kiln_kernels::testdata::skip(&why);
            None
        }
        None => Some(Device::new(0).expect("a driver and a device are present")),
    }
}

struct Shape {
    arch: Architecture,
    hidden: usize,
    heads: usize,
    kv_heads: usize,
    head_dim: usize,
    ffn: usize,
    vocab: usize,
    layers: usize,
    rope: RopeKind,
    qkv_bias: bool,
    qk_norm: bool,
    tied: bool,
    /// (attention Q/K/O, V, FFN gate/up, down, LM head / embedding)
    types: [QType; 5],
}

fn matrix(rng: &mut Rng, name: &str, q: QType, k: usize, n: usize) -> TensorView {
    let bytes = gaussian_weights(rng, q, k, n, 1.0 / (k as f32).sqrt()).unwrap();
    TensorView::from_bytes(name, q, vec![k, n], bytes).unwrap()
}

fn norm(rng: &mut Rng, name: &str, n: usize) -> TensorView {
    let v: Vec<f32> = (0..n).map(|_| 1.0 + 0.2 * (rng.next_f32() - 0.5)).collect();
    TensorView::from_f32(name, vec![n], &v).unwrap()
}

fn model(rng: &mut Rng, s: &Shape) -> ModelIr {
    let (h, qd, kvd) = (s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim);
    let [tq, tv, tg, td, te] = s.types;
    let mut layers = Vec::new();
    for i in 0..s.layers {
        let bias = |rng: &mut Rng, n: usize| {
            s.qkv_bias
                .then(|| TensorView::from_f32("b", vec![n], &random_vec(rng, n, 0.5)).unwrap())
        };
        layers.push(LayerWeights {
            attn_norm: norm(rng, "attn_norm", h),
            attn_norm_bias: None,
            attn_q: matrix(rng, &format!("{i}.q"), tq, h, qd),
            attn_k: matrix(rng, &format!("{i}.k"), tq, h, kvd),
            attn_v: matrix(rng, &format!("{i}.v"), tv, h, kvd),
            attn_q_bias: bias(rng, qd),
            attn_k_bias: bias(rng, kvd),
            attn_v_bias: bias(rng, kvd),
            attn_q_norm: s.qk_norm.then(|| norm(rng, "q_norm", s.head_dim)),
            attn_k_norm: s.qk_norm.then(|| norm(rng, "k_norm", s.head_dim)),
            attn_out: matrix(rng, &format!("{i}.o"), tq, qd, h),
            attn_out_bias: None,
            ffn_norm: Some(norm(rng, "ffn_norm", h)),
            ffn_norm_bias: None,
            ffn_gate: Some(matrix(rng, &format!("{i}.gate"), tg, h, s.ffn)),
            ffn_up: matrix(rng, &format!("{i}.up"), tg, h, s.ffn),
            ffn_down: matrix(rng, &format!("{i}.down"), td, s.ffn, h),
        });
    }
    let token_embd = {
        // Tied: the embedding is also the LM head, so it is scaled like one.
        let std = if s.tied { 1.0 / (h as f32).sqrt() } else { 1.0 };
        let bytes = gaussian_weights(rng, te, h, s.vocab, std).unwrap();
        TensorView::from_bytes("token_embd", te, vec![h, s.vocab], bytes).unwrap()
    };
    let weights = ModelWeights {
        token_embd,
        layers,
        output_norm: norm(rng, "output_norm", h),
        output_norm_bias: None,
        output: (!s.tied).then(|| matrix(rng, "output", te, h, s.vocab)),
        rope_freqs: None,
    };
    let config = ModelConfig {
        arch: s.arch.clone(),
        vocab_size: s.vocab,
        hidden_size: h,
        num_layers: s.layers,
        num_heads: s.heads,
        num_kv_heads: s.kv_heads,
        head_dim: s.head_dim,
        ffn_size: s.ffn,
        norm: NormKind::Rms,
        norm_eps: 1e-5,
        activation: Activation::Silu,
        gated_ffn: true,
        parallel_residual: false,
        qkv_bias: s.qkv_bias,
        qk_norm: s.qk_norm,
        rope: RopeConfig {
            kind: s.rope,
            theta: 10000.0,
            scaling: RopeScaling::None,
            rotary_dims: s.head_dim,
        },
        tied_embeddings: s.tied,
        context_length: 1024,
    };
    ModelIr {
        config,
        weights,
        source: "random test model".into(),
    }
}

fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let dot: f64 = a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum();
    let na: f64 = a.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    let nb: f64 = b.iter().map(|&x| x as f64 * x as f64).sum::<f64>().sqrt();
    dot / (na * nb)
}

fn shapes() -> Vec<(&'static str, Shape)> {
    use QType::*;
    vec![
        (
            "llama, Q4_K_M-like mix",
            Shape {
                arch: Architecture::Llama,
                hidden: 512,
                heads: 8,
                kv_heads: 2,
                head_dim: 64,
                ffn: 1536,
                vocab: 3000,
                layers: 3,
                rope: RopeKind::Norm,
                qkv_bias: false,
                qk_norm: false,
                tied: false,
                types: [Q4_K, Q6_K, Q4_K, Q6_K, Q6_K],
            },
        ),
        (
            "qwen2, bias, hidden 576 (legacy types)",
            Shape {
                arch: Architecture::Qwen2,
                hidden: 576,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
                ffn: 1536,
                vocab: 2000,
                layers: 2,
                rope: RopeKind::Neox,
                qkv_bias: true,
                qk_norm: false,
                tied: true,
                types: [Q5_0, Q8_0, Q4_1, Q5_1, Q8_0],
            },
        ),
        (
            "qwen3, QK-norm, head_dim 128 != hidden / heads",
            Shape {
                arch: Architecture::Qwen3,
                hidden: 512,
                heads: 8,
                kv_heads: 4,
                head_dim: 128,
                ffn: 1024,
                vocab: 2500,
                layers: 2,
                rope: RopeKind::Neox,
                qkv_bias: false,
                qk_norm: true,
                tied: true,
                types: [Q5_K, Q8_0, Q4_0, Q6_K, F16],
            },
        ),
    ]
}

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
    gpu: &mut CudaExecutor,
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
#[ignore = "needs an NVIDIA GPU; run scripts/gpu_suite.sh on the device"]
fn batched_prefill_matches_the_cpu_backend() {
    let Some(dev) = device() else { return };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    assert!(600 > PREFILL_CHUNK, "the longest prompt must cross a chunk");
    let options = LoadOptions {
        max_context: 1024,
        max_sequences: 1,
        ..Default::default()
    };
    let mut failures = Vec::new();
    for (label, shape) in shapes() {
        let ir = model(&mut rng, &shape);
        let vocab = shape.vocab;
        let mut cpu = CpuBackend.load_executor(&ir, &options).unwrap();
        let mut gpu = CudaExecutor::load(&dev, &ir, &options).unwrap();
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

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu_suite.sh on the device"]
fn batched_prefill_rejects_bad_input() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(fresh_seed());
    let (_, shape) = shapes().remove(0);
    let ir = model(&mut rng, &shape);
    let options = LoadOptions {
        max_context: 64,
        max_sequences: 1,
        ..Default::default()
    };
    let mut gpu = CudaExecutor::load(&dev, &ir, &options).unwrap();
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
