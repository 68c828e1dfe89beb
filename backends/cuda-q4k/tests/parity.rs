//! Decode parity with the CPU reference backend on small random models of each supported
//! architecture shape: per-step logits must agree (cosine) over teacher-forced steps, on
//! both integer activation paths (15-bit, the default, and Q8_1). `#[ignore]`d: CI lists them as ignored; scripts/gpu/gpu_suite.sh runs
//! them with `--include-ignored` and `KILN_REQUIRE_GPU=1`.

use kiln_backend_cpu::CpuBackend;
use kiln_backend_cuda_q4k::{load_executor, StepVariants};
use kiln_core::{DecodeItem, LayerExecutor, LoadOptions, Rng, Sampler, SamplingParams};
use kiln_kernels::testdata::fresh_seed;
use kiln_kernels::{GemvPath, GemvTiling};

mod common;
use common::{cosine, device, model, shapes};

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn decode_logits_match_the_cpu_backend() {
    let Some(dev) = device() else { return };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    let steps = 40;
    let mut failures = Vec::new();
    for (label, shape) in shapes() {
        let ir = model(&mut rng, &shape, 256);
        let options = LoadOptions {
            max_context: 256,
            max_sequences: 1,
            ..Default::default()
        };
        let mut cpu = CpuBackend.load_executor(&ir, &options).unwrap();
        // Every activation path the executor takes, and every tiling of the GEMVs that
        // quantise their output (each owns whole 32-row groups differently).
        // (usize::MAX: every O/SwiGLU/down GEMV quantises in its epilogue; 0: none does,
        // a separate launch quantises after each.)
        let variants = [
            (
                "q16 fused R4S2",
                GemvPath::Q16,
                GemvTiling::new(4, 2),
                usize::MAX,
                0.99999,
            ),
            (
                "q16 fused R2S1",
                GemvPath::Q16,
                GemvTiling::new(2, 1),
                usize::MAX,
                0.99999,
            ),
            (
                "q16 fused R4S1",
                GemvPath::Q16,
                GemvTiling::new(4, 1),
                usize::MAX,
                0.99999,
            ),
            (
                "q16 unfused",
                GemvPath::Q16,
                GemvTiling::new(2, 1),
                0,
                0.99999,
            ),
            (
                "q8 fused R2S1",
                GemvPath::Q8,
                GemvTiling::new(2, 1),
                usize::MAX,
                0.999,
            ),
        ];
        for (name, path, tiling, fuse_limit, floor) in variants {
            let mut gpu = load_executor(&dev, &ir, &options).unwrap();
            gpu.set_variants(StepVariants {
                gemv_path: path,
                quant_tiling: Some(tiling),
                fuse_limit,
                ..gpu.variants()
            })
            .unwrap();
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
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn device_sampling_truncation_and_sequences() {
    let Some(dev) = device() else { return };
    let mut rng = Rng::new(fresh_seed());
    let (_, shape) = shapes().remove(0);
    let ir = model(&mut rng, &shape, 256);
    let options = LoadOptions {
        max_context: 128,
        max_sequences: 2,
        ..Default::default()
    };
    let mut gpu = load_executor(&dev, &ir, &options).unwrap();
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
        logit_bias: Vec::new(),
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
