//! Mixture-of-Experts models on the CPU oracle against Hugging Face transformers: a tiny
//! random Qwen3-MoE (8 experts, 3 used, renormalised) and a tiny random Mixtral (a llama
//! file with 4 experts, 2 used), laid out as llama.cpp's converter writes them (router
//! `ffn_gate_inp`, stacked `ffn_{gate,up,down}_exps`), from `fixtures/moe/`, made by
//! `scripts/fixtures/make_moe_fixture.py`. The prompt goes in as chunks (a batch's tokens
//! grouped by expert), each chunk's last logits compared (cosine ≥ 0.9999), then 32 greedy
//! steps (one token: its own experts) must give transformers' tokens.

use kiln_core::{Architecture, DecodeItem, ExpertConfig, LayerExecutor, LoadOptions};
use kiln_formats::gguf::{GgufFile, GgufValue, GgufWriter};
use kiln_formats::model::model_from_gguf;
use kiln_formats::quantize::{no_progress, Recipe};
use kiln_formats::synth::{synth_file, Preset, SynthOptions};
use kiln_tests::transformers_reference::Fixtures;

#[test]
fn qwen3moe_matches_transformers_on_the_cpu() {
    let f = Fixtures::open("moe");
    let ir = f.model("qwen3moe");
    assert_eq!(ir.config.arch, Architecture::Qwen3Moe);
    assert_eq!(
        ir.config.experts,
        Some(ExpertConfig {
            count: 8,
            used: 3,
            ffn_size: 64,
            normalize_weights: true,
        })
    );
    // Without renormalising, each chosen expert's weight is its share of all 8.
    f.check_cpu("qwen3moe", |ir| {
        if let Some(e) = &mut ir.config.experts {
            e.normalize_weights = false;
        }
    });
}

#[test]
fn mixtral_matches_transformers_on_the_cpu() {
    let f = Fixtures::open("moe");
    let ir = f.model("mixtral");
    assert_eq!(ir.config.arch, Architecture::Llama);
    assert_eq!(
        ir.config.experts.map(|e| (e.count, e.used, e.ffn_size)),
        Some((4, 2, 96))
    );
    // One expert a token instead of two.
    f.check_cpu("mixtral", |ir| {
        if let Some(e) = &mut ir.config.experts {
            e.used = 1;
        }
    });
}

/// The Qwen3-MoE fixture rewritten with metadata `set` (a `None` value drops the key) and
/// the tensors of `reshape` given other dims (bytes to match) or, with `None`, dropped.
fn edited(
    set: &[(&str, Option<GgufValue>)],
    reshape: &[(&str, Option<Vec<usize>>)],
) -> Result<kiln_core::ModelIr, kiln_core::Error> {
    let file = GgufFile::open(kiln_tests::fixture("moe/qwen3moe.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        match set.iter().find(|(key, _)| key == k) {
            Some((_, Some(v))) => w.add_kv(k.clone(), v.clone()),
            Some((_, None)) => continue,
            None => w.add_kv(k.clone(), v.clone()),
        }
        .unwrap();
    }
    for (k, v) in set {
        if file.get(k).is_none() {
            if let Some(v) = v {
                w.add_kv(*k, v.clone()).unwrap();
            }
        }
    }
    for t in file.tensors() {
        let dims = match reshape.iter().find(|(n, _)| *n == t.name) {
            Some((_, None)) => continue,
            Some((_, Some(d))) => d.clone(),
            None => t.dims.clone(),
        };
        let n = t.qtype.tensor_bytes(&dims).unwrap();
        let bytes = file
            .view(t)
            .unwrap()
            .bytes()
            .iter()
            .copied()
            .cycle()
            .take(n)
            .collect();
        w.add_tensor(t.name.clone(), t.qtype, dims, bytes).unwrap();
    }
    let bytes = w.write_to(Vec::new()).unwrap();
    let file = GgufFile::from_storage(std::sync::Arc::new(bytes)).unwrap();
    model_from_gguf(&file, "edited qwen3moe")
}

/// Expert counts and shapes that disagree are typed errors at open, before anything is
/// sized by them.
#[test]
fn bad_expert_metadata_and_tensors_are_refused() {
    let u = |v: u32| Some(GgufValue::U32(v));
    let cases: Vec<(
        Vec<(&str, Option<GgufValue>)>,
        Vec<(&str, Option<Vec<usize>>)>,
        &str,
    )> = vec![
        (
            vec![("qwen3moe.expert_count", u(0))],
            vec![],
            "expert_count' above 0",
        ),
        (
            vec![("qwen3moe.expert_count", None)],
            vec![],
            "expert_count' above 0",
        ),
        (
            vec![("qwen3moe.expert_count", u(1 << 30))],
            vec![],
            "expert count 1073741824",
        ),
        (
            vec![("qwen3moe.expert_used_count", u(9))],
            vec![],
            "9 experts used of 8",
        ),
        (
            vec![("qwen3moe.expert_used_count", u(0))],
            vec![],
            "0 experts used of 8",
        ),
        (
            vec![("qwen3moe.expert_used_count", None)],
            vec![],
            "expert_used_count' is missing",
        ),
        (
            vec![("qwen3moe.expert_feed_forward_length", u(1 << 30))],
            vec![],
            "expert feed-forward size",
        ),
        (
            vec![("qwen3moe.expert_feed_forward_length", u(32))],
            vec![],
            "blk.0.ffn_gate_exps.weight",
        ),
        (
            vec![],
            vec![("blk.1.ffn_gate_inp.weight", None)],
            "blk.1.ffn_gate_inp.weight' is missing",
        ),
        (
            vec![],
            vec![("blk.0.ffn_down_exps.weight", Some(vec![128, 64, 8]))],
            "blk.0.ffn_down_exps.weight",
        ),
        (
            vec![],
            vec![("blk.0.ffn_up_exps.weight", Some(vec![128, 64, 7]))],
            "blk.0.ffn_up_exps.weight",
        ),
        (
            vec![(
                "qwen3moe.expert_weights_norm",
                Some(GgufValue::String("yes".into())),
            )],
            vec![],
            "should be a boolean",
        ),
    ];
    for (set, reshape, needle) in cases {
        let err = edited(&set, &reshape).expect_err(needle).to_string();
        assert!(err.contains(needle), "{needle}: {err}");
    }
    // The file as made, and with the weights left as the softmax gave them.
    assert!(edited(&[], &[]).is_ok());
    let ir = edited(
        &[("qwen3moe.expert_weights_norm", Some(GgufValue::Bool(false)))],
        &[],
    )
    .unwrap();
    assert!(!ir.config.experts.unwrap().normalize_weights);
}

/// An older Mixtral file stores each expert's projections as their own tensors
/// (`blk.N.ffn_gate.E.weight`): the Mixtral fixture rewritten that way runs to the very
/// logits of the stacked file.
#[test]
fn per_expert_tensors_run_as_the_stacked_ones() {
    let file = GgufFile::open(kiln_tests::fixture("moe/mixtral.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in file.metadata() {
        w.add_kv(k.clone(), v.clone()).unwrap();
    }
    let mut split = 0;
    for t in file.tensors() {
        let view = file.view(t).unwrap();
        match t.name.strip_suffix("_exps.weight") {
            Some(stem) => {
                for e in 0..t.dims[2] {
                    let m = view.matrix(e).unwrap();
                    let name = format!("{stem}.{e}.weight");
                    w.add_tensor(name, t.qtype, m.dims().to_vec(), m.bytes().to_vec())
                        .unwrap();
                }
                split += 1;
            }
            None => {
                w.add_tensor(
                    t.name.clone(),
                    t.qtype,
                    t.dims.clone(),
                    view.bytes().to_vec(),
                )
                .unwrap();
            }
        }
    }
    assert_eq!(
        split,
        3 * 2,
        "three stacked projections in each of two layers"
    );
    let bytes = w.write_to(Vec::new()).unwrap();
    let per_expert = GgufFile::from_storage(std::sync::Arc::new(bytes)).unwrap();
    let per_expert = model_from_gguf(&per_expert, "per-expert mixtral").unwrap();
    assert!(matches!(
        per_expert.weights.layers[0].experts.as_ref().unwrap().gate,
        kiln_core::ExpertTensors::PerExpert(ref v) if v.len() == 4
    ));
    let stacked = Fixtures::open("moe").model("mixtral");
    let prompt = Fixtures::open("moe").prompt().to_vec();
    let logits = |ir: &kiln_core::ModelIr| {
        let mut exec = kiln_tests::cpu_executor(ir, 256);
        let seq = exec.new_sequence().unwrap();
        let mut out = vec![f32::NAN; ir.config.vocab_size];
        exec.prefill(seq, &prompt, &mut out).unwrap();
        out
    };
    assert_eq!(logits(&per_expert), logits(&stacked));
}

/// `kiln quantize --type mxfp4_moe` (llama.cpp's mix for gpt-oss): the stacked experts in
/// MXFP4, every other quantised tensor in Q8_0, the router and norms as they were; the
/// file runs on the CPU (f32 and 8-bit paths) near transformers' float32 logits, as far
/// from them as MXFP4's rounding puts it.
#[test]
fn mxfp4_moe_recipe_types_the_experts_and_runs() {
    use kiln_formats::quantize::{no_progress, quantize_file, QuantizeOptions, Recipe};
    let dir = std::env::temp_dir().join(format!("kiln-mxfp4-moe-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let out = dir.join("qwen3moe.mxfp4_moe.gguf");
    quantize_file(
        &kiln_tests::fixture("moe/qwen3moe.gguf"),
        &out,
        QuantizeOptions {
            recipe: Recipe::MXFP4_MOE,
            measure_error: false,
        },
        &no_progress,
    )
    .unwrap();
    let file = GgufFile::open(&out).unwrap();
    for t in file.tensors() {
        let want = if t.name.contains("_exps") {
            kiln_core::QType::MXFP4
        } else if t.dims.len() == 1 || t.name.contains("ffn_gate_inp") {
            kiln_core::QType::F32
        } else {
            kiln_core::QType::Q8_0
        };
        assert_eq!(t.qtype, want, "{}", t.name);
    }
    assert_eq!(file.get_u64("general.file_type"), Some(38));
    let ir = model_from_gguf(&file, "qwen3moe").unwrap();
    let f = Fixtures::open("moe");
    for quantized_activations in [false, true] {
        kiln::link_builtin_backends();
        let cpu = kiln_core::Registry::with_builtins().get("cpu").unwrap();
        let options = kiln_core::LoadOptions {
            max_context: 256,
            quantized_activations,
            ..Default::default()
        };
        let mut exec = cpu.load(&ir, &options).unwrap();
        let (worst, _) = f.run(exec.as_mut(), "qwen3moe");
        println!("mxfp4_moe, 8-bit activations {quantized_activations}: worst cosine {worst:.5} to transformers");
        // MXFP4's relative RMSE on these N(0, σ²) experts is 0.115 (Q8_0's 0.005): the
        // logits stay near transformers' (a broken kernel or layout falls far below).
        assert!(worst > 0.9, "{worst}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The CPU oracle and its 8-bit activation path for `ir` (256 positions), both tracing
/// their routing.
fn oracle_and_8_bit_path(
    ir: &kiln_core::ModelIr,
) -> (kiln_backend_cpu::CpuExecutor, kiln_backend_cpu::CpuExecutor) {
    let options = |quantized_activations| LoadOptions {
        max_context: 256,
        quantized_activations,
        ..LoadOptions::default()
    };
    (
        kiln_tests::cpu_oracle(ir, &options(false)),
        kiln_tests::cpu_oracle(ir, &options(true)),
    )
}

/// The CPU oracle's routing trace: every Mixture-of-Experts layer's chosen experts for every
/// row of the last pass, and how narrowly they were chosen. The oracle and its 8-bit
/// activation path (rounding like a GPU's) choose alike wherever the margin is wide: a
/// choice that differs comes with a narrow margin, which is what the GPU parity tests
/// accept a step under their bar for.
#[test]
fn the_routing_trace_shows_choices_differ_only_at_narrow_margins() {
    let f = Fixtures::open("moe");
    let ir = f.model("qwen3moe");
    let prompt = f.prompt().to_vec();
    let used = ir.config.experts.unwrap().used;
    let moe_layers = ir
        .weights
        .layers
        .iter()
        .filter(|l| l.experts.is_some())
        .count();
    let (mut oracle, mut rounded) = oracle_and_8_bit_path(&ir);
    let mut logits = vec![f32::NAN; ir.config.vocab_size];
    let (a, b) = (
        oracle.new_sequence().unwrap(),
        rounded.new_sequence().unwrap(),
    );
    oracle.prefill(a, &prompt, &mut logits).unwrap();
    rounded.prefill(b, &prompt, &mut logits).unwrap();
    let (mut compared, mut differing, mut narrowest_agreed) = (0, 0, 1.0f32);
    for step in 0..8 {
        let (want, got) = (oracle.routing().unwrap(), rounded.routing().unwrap());
        let rows = if step == 0 { prompt.len() } else { 1 };
        assert_eq!((want.rows(), want.layers()), (rows, moe_layers));
        assert_eq!((got.rows(), got.layers()), (rows, moe_layers));
        for layer in 0..moe_layers {
            for row in 0..rows {
                let chosen = want.chosen(layer, row);
                assert_eq!(chosen.len(), used);
                assert!(chosen.windows(2).all(|w| w[0] < w[1]) && chosen[used - 1] < 8);
                let margin = want.margin(layer, row);
                assert!((0.0..=1.0).contains(&margin), "{margin}");
                assert!(want.min_margin(row) <= margin);
                compared += 1;
                if chosen != got.chosen(layer, row) {
                    differing += 1;
                    assert!(
                        margin < kiln_tests::RoutingSlack::TIE_8_BIT,
                        "layer {layer} row {row}: the rounded path chose {:?} against {chosen:?} at margin {margin}",
                        got.chosen(layer, row)
                    );
                } else {
                    narrowest_agreed = narrowest_agreed.min(margin);
                }
            }
        }
        let token = kiln_core::argmax(&logits);
        oracle
            .decode(&[DecodeItem { seq: a, token }], &mut logits)
            .unwrap();
        rounded
            .decode(
                &[DecodeItem { seq: b, token }],
                &mut vec![0.0; logits.len()],
            )
            .unwrap();
    }
    println!(
        "{compared} routings compared, {differing} differing; narrowest margin chosen alike {narrowest_agreed:.1e}"
    );
    // Off, a pass records nothing.
    oracle.trace_routing(false);
    assert!(oracle.routing().is_none());
}

/// On a random 64-expert model (`kiln synth --shape qwen3moe-small`, made here: ~50 s on two
/// cores; or the file KILN_QWEN3MOE_FILE names, e.g. qwen3moe-7b-a2b), the oracle beside its
/// 8-bit activation path, teacher forced: every expert the two choose differently lies
/// under `RoutingSlack::TIE_8_BIT`, a step where they chose alike keeps the path's own
/// agreement (≥ 0.9995; 0.99984–0.99987 on qwen3moe-small, 0.9997 on the 7B), and a step
/// with a swap stays within its routing slack of that. What the slack rule of the GPU
/// parity tests rests on; a fault in the 8-bit expert kernels would show as a drop with no
/// swap.
#[test]
fn routing_swaps_on_a_random_moe_explain_the_step_cosines() {
    let made = std::env::temp_dir().join(format!("kiln-moe-routing-{}", std::process::id()));
    let path = match std::env::var_os("KILN_QWEN3MOE_FILE") {
        Some(path) => std::path::PathBuf::from(path),
        None => {
            std::fs::create_dir_all(&made).unwrap();
            let path = made.join("qwen3moe-small.q4_k_m.gguf");
            let options = SynthOptions {
                preset: Preset::Qwen3MoeSmall,
                recipe: Recipe::Q4_K_M,
                seed: 0,
            };
            synth_file(&path, options, &no_progress).unwrap();
            path
        }
    };
    let model = kiln::Model::open(&path).unwrap();
    let ir = &model.ir;
    let prompt = model
        .tokenizer
        .encode("The quick brown fox jumps over the lazy dog", true, false)
        .unwrap();
    let (mut oracle, mut rounded) = oracle_and_8_bit_path(ir);
    let vocab = ir.config.vocab_size;
    let (mut want, mut got) = (vec![f32::NAN; vocab], vec![f32::NAN; vocab]);
    let (a, b) = (
        oracle.new_sequence().unwrap(),
        rounded.new_sequence().unwrap(),
    );
    oracle.prefill(a, &prompt, &mut want).unwrap();
    rounded.prefill(b, &prompt, &mut got).unwrap();
    let tie = kiln_tests::RoutingSlack::TIE_8_BIT;
    for step in 0..24 {
        let (tw, tg) = (oracle.routing().unwrap(), rounded.routing().unwrap());
        let row = tw.rows() - 1;
        let swapped: Vec<(usize, f32)> = (0..tw.layers())
            .filter(|&l| tw.chosen(l, row) != tg.chosen(l, row))
            .map(|l| (l, tw.margin(l, row)))
            .collect();
        let slack = kiln_tests::RoutingSlack::of(&oracle, tie).unwrap();
        let cos = kiln_tests::cosine(&want, &got);
        println!(
            "step {step:>2}: cosine {cos:.7}, {} layers under the tie, slack {:.0e}; swapped (layer, margin): {swapped:?}",
            slack.near_ties,
            slack.slack()
        );
        assert!(
            swapped.iter().all(|&(_, m)| m < tie),
            "step {step}: a swap at a wide margin"
        );
        match swapped.is_empty() {
            true => assert!(cos >= 0.9995, "step {step}: {cos} with the same experts"),
            false => assert!(
                cos >= 0.9995 - slack.slack(),
                "step {step}: {cos} beyond its routing slack"
            ),
        }
        let token = kiln_core::argmax(&want);
        oracle
            .decode(&[DecodeItem { seq: a, token }], &mut want)
            .unwrap();
        rounded
            .decode(&[DecodeItem { seq: b, token }], &mut got)
            .unwrap();
    }
    std::fs::remove_dir_all(&made).ok();
}
