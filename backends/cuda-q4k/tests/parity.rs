//! Decode parity with the CPU reference backend on small random models of each supported
//! architecture shape: per-step logits must agree (cosine) over teacher-forced steps, on
//! both GEMV activation paths. `#[ignore]`d: CI lists them as ignored; scripts/gpu_suite.sh runs
//! them with `--include-ignored` and `KILN_REQUIRE_GPU=1`.

use std::sync::Arc;

use kiln_backend_cpu::CpuBackend;
use kiln_backend_cuda_q4k::CudaExecutor;
use kiln_core::{
    Activation, Architecture, DecodeItem, LayerExecutor, LayerWeights, LoadOptions, ModelConfig,
    ModelIr, ModelWeights, NormKind, QType, Rng, RopeConfig, RopeKind, RopeScaling, Sampler,
    SamplingParams, TensorView,
};
use kiln_kernels::testdata::{fresh_seed, gaussian_weights, random_vec};
use kiln_kernels::{Device, GemvPath};

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
        context_length: 256,
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

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu_suite.sh on the device"]
fn decode_logits_match_the_cpu_backend() {
    let Some(dev) = device() else { return };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    let steps = 40;
    let mut failures = Vec::new();
    for (label, shape) in shapes() {
        let ir = model(&mut rng, &shape);
        let options = LoadOptions {
            max_context: 256,
            max_sequences: 1,
            ..Default::default()
        };
        let mut cpu = CpuBackend.load_executor(&ir, &options).unwrap();
        let variants = [
            ("dp4a", GemvPath::Dp4a, GemvPath::Dp4a, 0.999),
            (
                "dp4a, float LM head",
                GemvPath::Dp4a,
                GemvPath::Float,
                0.999,
            ),
            ("float", GemvPath::Float, GemvPath::Float, 0.99999),
        ];
        for (name, layers, head, floor) in variants {
            let mut gpu = CudaExecutor::load(&dev, &ir, &options).unwrap();
            gpu.set_gemv_paths(layers, head);
            // The fused SwiGLU quantisation is off by default; check it on the dp4a run.
            gpu.set_fused_ffn_q8(name == "dp4a");
            let cs = cpu.new_sequence().unwrap();
            let gs = gpu.new_sequence().unwrap();
            let vocab = shape.vocab;
            let (mut lc, mut lg) = (vec![0f32; vocab], vec![f32::NAN; vocab]);
            let prompt = [1u32, 7, 42, 5];
            cpu.prefill(cs, &prompt, &mut lc).unwrap();
            gpu.prefill(gs, &prompt, &mut lg).unwrap();
            let mut worst = cosine(&lc, &lg);
            let mut same_top = 0;
            let mut max_abs = 0f32;
            for _ in 0..steps {
                let next = kiln_core::argmax(&lc);
                same_top += (kiln_core::argmax(&lg) == next) as usize;
                cpu.decode(
                    &[DecodeItem {
                        seq: cs,
                        token: next,
                    }],
                    &mut lc,
                )
                .unwrap();
                lg.fill(f32::NAN);
                gpu.decode(
                    &[DecodeItem {
                        seq: gs,
                        token: next,
                    }],
                    &mut lg,
                )
                .unwrap();
                worst = worst.min(cosine(&lc, &lg));
                max_abs = lc
                    .iter()
                    .zip(&lg)
                    .map(|(a, b)| (a - b).abs())
                    .fold(max_abs, f32::max);
            }
            println!("{label} / {name}: worst cosine {worst:.7}, max |dlogit| {max_abs:.4}, same argmax {same_top}/{steps}");
            // Written so that a NaN cosine fails too.
            if worst.is_nan() || worst < floor {
                failures.push(format!("{label} / {name}: cosine {worst} < {floor}"));
            }
            cpu.free_sequence(cs).unwrap();
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu_suite.sh on the device"]
fn device_sampling_truncation_and_sequences() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(fresh_seed());
    let (_, shape) = shapes().remove(0);
    let ir = model(&mut rng, &shape);
    let options = LoadOptions {
        max_context: 128,
        max_sequences: 2,
        ..Default::default()
    };
    let mut gpu = CudaExecutor::load(&dev, &ir, &options).unwrap();
    let vocab = shape.vocab;
    let a = gpu.new_sequence().unwrap();
    let b = gpu.new_sequence().unwrap();
    assert!(gpu.new_sequence().is_err(), "only two slots");
    let mut la = vec![0f32; vocab];
    gpu.prefill(a, &[3, 4, 5], &mut la).unwrap();
    // Greedy on the device is the argmax of the same step's logits.
    let mut logits = vec![0f32; vocab];
    gpu.decode(&[DecodeItem { seq: a, token: 9 }], &mut logits)
        .unwrap();
    gpu.truncate_sequence(a, 3).unwrap();
    let mut greedy = [Sampler::new(SamplingParams::greedy())];
    let mut tok = [0u32];
    gpu.decode_sample(&[DecodeItem { seq: a, token: 9 }], &mut greedy, &mut tok)
        .unwrap();
    assert_eq!(
        tok[0],
        kiln_core::argmax(&logits),
        "device greedy after truncation"
    );
    assert_eq!(gpu.sequence_len(a).unwrap(), 4);
    // Sequence b is independent of a's cache.
    let mut lb = vec![0f32; vocab];
    gpu.prefill(b, &[3, 4, 5], &mut lb).unwrap();
    assert_eq!(la, lb, "same prompt, same logits in another slot");
    // Device sampling draws what the host sampler would from these logits.
    let params = SamplingParams {
        temperature: 0.9,
        top_k: 20,
        top_p: 0.9,
        min_p: 0.0,
        seed: 11,
        ..Default::default()
    };
    let mut dev_sampler = [Sampler::new(params.clone())];
    let mut host_sampler = Sampler::new(params);
    for step in 0..8 {
        gpu.truncate_sequence(b, 3).unwrap();
        gpu.decode(&[DecodeItem { seq: b, token: 6 }], &mut logits)
            .unwrap();
        gpu.truncate_sequence(b, 3).unwrap();
        gpu.decode_sample(
            &[DecodeItem { seq: b, token: 6 }],
            &mut dev_sampler,
            &mut tok,
        )
        .unwrap();
        assert_eq!(
            tok[0],
            host_sampler.sample(&mut logits.clone()),
            "draw {step}"
        );
    }
    assert!(
        gpu.decode(
            &[DecodeItem {
                seq: a,
                token: vocab as u32
            }],
            &mut logits
        )
        .is_err(),
        "token out of range"
    );
}
