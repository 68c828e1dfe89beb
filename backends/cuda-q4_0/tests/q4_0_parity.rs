//! `cuda-q4_0` against the CPU reference backend on small random models whose matmuls are
//! Q4_0 (repacked into rows of four on the GPU) beside the plain types Q4_0 files carry
//! (Q6_K / Q8_0 / F16 heads): per-step logits over teacher-forced steps, on both integer
//! activation paths and every quantising tiling the row-grouped layout allows. `#[ignore]`d
//! GPU tests; scripts/gpu/gpu_suite.sh runs them with `--include-ignored`. The selection test
//! at the bottom needs no GPU.

use kiln_backend_cpu::CpuBackend;
use std::sync::Arc;

use kiln_backend_cuda_q4_0::{CudaQ40Backend, GpuExecutor, Q40Policy, StepVariants};
use kiln_core::{
    score, Architecture, Backend, DecodeItem, LayerExecutor, LoadOptions, QType, Rng, RopeKind,
};
use kiln_kernels::testdata::fresh_seed;
use kiln_kernels::{GemvPath, GemvTiling};

#[path = "../../cuda-q4k/tests/common/mod.rs"]
mod common;
use common::{cosine, device, model, Shape};

fn q4_0_shapes() -> Vec<(&'static str, Shape)> {
    use QType::*;
    vec![
        (
            "llama, Q4_0 with a Q6_K head",
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
                types: [Q4_0, Q4_0, Q4_0, Q4_0, Q6_K],
                experts: None,
            },
        ),
        (
            "qwen2, bias, hidden 576, 9 heads, tied Q8_0 embedding",
            Shape {
                arch: Architecture::Qwen2,
                hidden: 576,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
                ffn: 1536,
                vocab: 2001,
                layers: 2,
                rope: RopeKind::Neox,
                qkv_bias: true,
                qk_norm: false,
                tied: true,
                types: [Q4_0, Q4_0, Q4_0, Q4_0, Q8_0],
                experts: None,
            },
        ),
        (
            "qwen3, QK-norm, tied Q4_0 embedding and head (vocab not a multiple of 4)",
            Shape {
                arch: Architecture::Qwen3,
                hidden: 512,
                heads: 8,
                kv_heads: 4,
                head_dim: 128,
                ffn: 1024,
                vocab: 2503,
                layers: 2,
                rope: RopeKind::Neox,
                qkv_bias: false,
                qk_norm: true,
                tied: true,
                types: [Q4_0, Q8_0, Q4_0, Q4_0, Q4_0],
                experts: None,
            },
        ),
    ]
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn q4_0_decode_logits_match_the_cpu_backend() {
    let Some(dev) = device() else { return };
    let seed = fresh_seed();
    println!("seed {seed}");
    let mut rng = Rng::new(seed);
    let steps = 40;
    let mut failures = Vec::new();
    for (label, shape) in q4_0_shapes() {
        let ir = model(&mut rng, &shape, 256);
        let options = LoadOptions {
            max_context: 256,
            max_sequences: 1,
            ..Default::default()
        };
        let mut cpu = CpuBackend.load_executor(&ir, &options).unwrap();
        // Every Q4_0 matrix in rows of four (the default keeps short rows plain).
        let grouped = Q40Policy {
            grouped_from: 0,
            ..Default::default()
        };
        let variants = [
            (
                "q16 default",
                Q40Policy::default(),
                GemvPath::Q16,
                None,
                0.99999,
            ),
            (
                "q16 all x4 R4S2",
                grouped,
                GemvPath::Q16,
                Some(GemvTiling::new(4, 2)),
                0.99999,
            ),
            (
                "q16 all x4 R4S1",
                grouped,
                GemvPath::Q16,
                Some(GemvTiling::new(4, 1)),
                0.99999,
            ),
            (
                "q16 all x4 R4S4 plain GEMVs",
                Q40Policy {
                    grouped_tiling: GemvTiling::new(4, 4),
                    ..grouped
                },
                GemvPath::Q16,
                None,
                0.99999,
            ),
            (
                "q8 default",
                Q40Policy::default(),
                GemvPath::Q8,
                None,
                0.999,
            ),
        ];
        for (name, policy, path, tiling, floor) in variants {
            let mut gpu = GpuExecutor::load(&dev, &ir, &options, Arc::new(policy)).unwrap();
            let defaults = gpu.variants();
            gpu.set_variants(StepVariants {
                gemv_path: path,
                quant_tiling: tiling.or(defaults.quant_tiling),
                ..defaults
            })
            .unwrap();
            let (cs, gs) = (cpu.new_sequence().unwrap(), gpu.new_sequence().unwrap());
            let vocab = shape.vocab;
            let (mut lc, mut lg) = (vec![0f32; vocab], vec![f32::NAN; vocab]);
            let prompt = [1u32, 7, 42, 5, 999];
            cpu.prefill(cs, &prompt, &mut lc).unwrap();
            gpu.prefill(gs, &prompt, &mut lg).unwrap();
            let mut worst = cosine(&lc, &lg);
            let mut same_top = 0;
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
            }
            println!("{label} / {name}: worst cosine {worst:.7}, same argmax {same_top}/{steps}");
            // Written so that a NaN cosine fails too.
            if worst.is_nan() || worst < floor {
                failures.push(format!("{label} / {name}: cosine {worst} < {floor}"));
            }
            cpu.free_sequence(cs).unwrap();
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
}

/// Selection by the written rule (`kiln_core::score`), on random models of one shape in
/// four weight mixes. Needs no GPU: `supports()` only inspects the model.
#[test]
fn selection_follows_the_majority_weight_family() {
    use QType::*;
    let mut rng = Rng::new(fresh_seed());
    let q4k = kiln_backend_cuda_q4k::CudaQ4kBackend;
    let cases = [
        (
            [Q4_0, Q4_0, Q4_0, Q4_0, Q6_K],
            score::GPU_SPECIALIST,
            score::GPU_GENERAL,
        ),
        (
            [Q4_K, Q6_K, Q4_K, Q6_K, Q6_K],
            score::GPU_OTHER_FAMILY,
            score::GPU_SPECIALIST,
        ),
        (
            [Q8_0, Q8_0, Q4_1, Q5_0, Q8_0],
            score::GPU_OTHER_FAMILY,
            score::GPU_GENERAL,
        ),
        // Q4_0 attention, Q4_K feed-forward (most of the bytes): K-quants win.
        (
            [Q4_0, Q4_0, Q4_K, Q4_K, Q6_K],
            score::GPU_OTHER_FAMILY,
            score::GPU_SPECIALIST,
        ),
    ];
    for (types, want_q4_0, want_q4k) in cases {
        let (_, mut shape) = q4_0_shapes().remove(0);
        shape.types = types;
        let ir = model(&mut rng, &shape, 128);
        let (a, b) = (CudaQ40Backend.supports(&ir), q4k.supports(&ir));
        println!("{types:?}: cuda-q4_0 {a:?}, cuda-q4k {b:?}");
        assert_eq!(a.score(), Some(want_q4_0), "{types:?}");
        assert_eq!(b.score(), Some(want_q4k), "{types:?}");
        assert_ne!(a.score(), b.score(), "built-in GPU backends never tie");
    }
}
