//! gpt-oss on the CPU oracle against Hugging Face transformers: a tiny random gpt-oss
//! (2 layers, a window of 16 on layer 0, YaRN with an unrounded ramp, sinks, biases,
//! 8 experts with 4 used, the clamped SwiGLU binding on 12% of the experts' values) from
//! `fixtures/gpt_oss/`, made by `scripts/fixtures/make_gpt_oss_fixture.py` as llama.cpp's
//! converter lays a gpt-oss file out. The prompt (40 tokens) and the 32 greedy steps run
//! well past the window. Each of gpt-oss's parts is shown to matter: the model read without
//! it no longer matches.

use kiln_core::{
    Activation, Architecture, DecodeItem, ExpertConfig, LayerExecutor, ModelIr, RopeScaling,
    SlidingWindow, TensorView,
};
use kiln_formats::gguf::GgufFile;
use kiln_formats::model::model_from_gguf;
use kiln_tests::cpu_executor;
use kiln_tests::transformers_reference::Fixtures;

const NAME: &str = "gpt-oss";

#[test]
fn gpt_oss_reads_as_llama_cpp_writes_it() {
    let ir = Fixtures::open("gpt_oss").model(NAME);
    let c = &ir.config;
    assert_eq!(c.arch, Architecture::GptOss);
    assert_eq!(
        c.experts,
        Some(ExpertConfig {
            count: 8,
            used: 4,
            ffn_size: 64,
            normalize_weights: true,
        })
    );
    assert_eq!(
        c.sliding_window,
        Some(SlidingWindow {
            window: 16,
            global_every: 2,
            local_theta: None,
        })
    );
    assert_eq!(c.activation, Activation::GPT_OSS);
    assert!(matches!(
        c.rope.scaling,
        RopeScaling::Yarn {
            factor: 4.0,
            original_context: 256,
            truncate: false,
            ..
        }
    ));
    // Layer 0 windowed, rotating as the global one does.
    let spans: Vec<_> = (0..2).map(|i| c.layer_attention(i)).collect();
    assert_eq!(
        spans.iter().map(|s| s.window).collect::<Vec<_>>(),
        [Some(16), None]
    );
    assert!(spans.iter().all(|s| !s.local_rope));
    let l = &ir.weights.layers[0];
    assert!(l.attn_sinks.is_some() && l.attn_out_bias.is_some() && l.attn_q_bias.is_some());
    assert!(l.experts.as_ref().is_some_and(|e| e.biases.is_some()));
}

#[test]
fn gpt_oss_matches_transformers_on_the_cpu() {
    let f = Fixtures::open("gpt_oss");
    // Sinks of -10³⁰ take no share: every head's weights sum to 1 again.
    f.check_cpu(NAME, |ir| {
        let heads = ir.config.num_heads;
        for l in &mut ir.weights.layers {
            let none = vec![-1e30; heads];
            l.attn_sinks = Some(TensorView::from_f32("no sinks", vec![heads], &none).unwrap());
        }
    });
}

/// The rest of what gpt-oss defines, each removed in turn: the fixture no longer matches.
#[test]
fn gpt_oss_needs_each_of_its_parts() {
    let f = Fixtures::open("gpt_oss");
    let expected = f.expected(NAME).greedy;
    type Break = (&'static str, fn(&mut ModelIr));
    let breaks: [Break; 5] = [
        ("the clamp", |ir| {
            ir.config.activation = Activation::SwigluOai {
                alpha: 1.702,
                limit: f32::INFINITY,
            }
        }),
        ("the window", |ir| ir.config.sliding_window = None),
        ("the unrounded YaRN ramp", |ir| {
            if let RopeScaling::Yarn { truncate, .. } = &mut ir.config.rope.scaling {
                *truncate = true;
            }
        }),
        ("the experts' biases", |ir| {
            for l in &mut ir.weights.layers {
                if let Some(e) = &mut l.experts {
                    e.biases = None;
                }
            }
        }),
        ("the attention biases", |ir| {
            for l in &mut ir.weights.layers {
                (l.attn_q_bias, l.attn_k_bias, l.attn_v_bias, l.attn_out_bias) =
                    (None, None, None, None);
            }
        }),
    ];
    for (what, break_it) in breaks {
        let mut ir = f.model(NAME);
        break_it(&mut ir);
        let mut exec = cpu_executor(&ir, 256);
        let (worst, greedy) = f.run(exec.as_mut(), NAME);
        println!(
            "without {what}: worst cosine {worst:.5}, greedy equal: {}",
            greedy == expected
        );
        assert!(
            worst < 0.9999 && greedy != expected,
            "the fixture does not need {what} (cosine {worst})"
        );
    }
}

/// The prompt's logits at `positions` (fed in chunks ending there) and 32 tokens after it
/// with the logits of each: the greedy ones, or `follow`'s (so that two runs are compared
/// on the same sequence).
fn trace(
    exec: &mut dyn LayerExecutor,
    prompt: &[u32],
    positions: &[usize],
    follow: Option<&[u32]>,
) -> (Vec<Vec<f32>>, Vec<u32>) {
    let seq = exec.new_sequence().unwrap();
    let vocab = exec.config().vocab_size;
    let mut logits = vec![f32::NAN; vocab];
    let (mut done, mut rows, mut tokens) = (0, Vec::new(), Vec::new());
    for &pos in positions {
        exec.prefill(seq, &prompt[done..=pos], &mut logits).unwrap();
        done = pos + 1;
        rows.push(logits.clone());
    }
    for step in 0..32 {
        let token = follow.map_or_else(|| kiln_core::argmax(&logits), |f| f[step]);
        tokens.push(token);
        exec.decode(&[DecodeItem { seq, token }], &mut logits)
            .unwrap();
        rows.push(logits.clone());
    }
    (rows, tokens)
}

fn worst_cosine(a: &[Vec<f32>], b: &[Vec<f32>]) -> f64 {
    a.iter()
        .zip(b)
        .map(|(x, y)| kiln_tests::cosine(x, y))
        .fold(1.0, f64::min)
}

fn load(path: &std::path::Path, quantized_activations: bool) -> Box<dyn LayerExecutor> {
    let file = GgufFile::open(path).unwrap();
    let ir = model_from_gguf(&file, NAME).unwrap();
    kiln::link_builtin_backends();
    let cpu = kiln_core::Registry::with_builtins().get("cpu").unwrap();
    let options = kiln_core::LoadOptions {
        max_context: 256,
        quantized_activations,
        ..Default::default()
    };
    cpu.load(&ir, &options).unwrap()
}

/// The file quantised as gpt-oss ships (`kiln quantize --type mxfp4_moe`: experts in
/// MXFP4, their biases, the router and the sinks kept in f32, the rest Q8_0). The MXFP4
/// kernels on gpt-oss's shapes: the file against its twin with every weight dequantised
/// to f16 (the same values) on the f32 path, cosine ≥ 0.9999 and the same greedy tokens;
/// the 8-bit path near it. Against transformers' float32 logits the file is as far as
/// its rounding puts this random model, which is sensitive to its weights (0.4% noise on
/// them alone moves its logits to a cosine of 0.994).
#[test]
fn gpt_oss_in_mxfp4_runs_on_both_cpu_paths() {
    use kiln_formats::quantize::{no_progress, quantize_file, QuantizeOptions, Recipe};
    let dir = std::env::temp_dir().join(format!("kiln-gpt-oss-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (mxfp4, twin) = (
        dir.join("gpt-oss.mxfp4_moe.gguf"),
        dir.join("gpt-oss.twin.gguf"),
    );
    for (from, to, recipe) in [
        (
            kiln_tests::fixture("gpt_oss/gpt-oss.gguf"),
            &mxfp4,
            Recipe::MXFP4_MOE,
        ),
        (mxfp4.clone(), &twin, Recipe::F16),
    ] {
        let options = QuantizeOptions {
            recipe,
            measure_error: false,
        };
        quantize_file(&from, to, options, &no_progress).unwrap();
    }
    let file = GgufFile::open(&mxfp4).unwrap();
    for t in file.tensors() {
        let want = if t.name.ends_with("_exps.weight") {
            kiln_core::QType::MXFP4
        } else if t.dims.len() == 1
            || !t.name.ends_with("weight")
            || t.name.contains("ffn_gate_inp")
        {
            kiln_core::QType::F32
        } else {
            kiln_core::QType::Q8_0
        };
        assert_eq!(t.qtype, want, "{}", t.name);
    }
    let f = Fixtures::open("gpt_oss");
    let positions = f.expected(NAME).positions;
    let run = |path: &std::path::Path, q8: bool, follow: Option<&[u32]>| {
        trace(load(path, q8).as_mut(), f.prompt(), &positions, follow)
    };
    let (want, want_tokens) = run(&twin, false, None);
    let (got, got_tokens) = run(&mxfp4, false, None);
    let kernels = worst_cosine(&got, &want);
    println!("MXFP4 against its f16 twin, f32 path: worst cosine {kernels:.7}");
    assert!(kernels >= 0.9999, "{kernels}");
    assert_eq!(got_tokens, want_tokens);
    let (q8, _) = run(&mxfp4, true, Some(&got_tokens));
    let eight_bit = worst_cosine(&q8, &got);
    println!("MXFP4, 8-bit path against the f32 path: worst cosine {eight_bit:.5}");
    assert!(eight_bit >= 0.99, "{eight_bit}");
    let mut exec = load(&mxfp4, false);
    let (reference, _) = f.run(exec.as_mut(), NAME);
    println!("MXFP4 against transformers' float32: worst cosine {reference:.5}");
    assert!(reference > 0.8, "{reference}");
    std::fs::remove_dir_all(&dir).ok();
}
