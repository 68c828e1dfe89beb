//! APR v2 models end to end: `kiln convert` GGUF → APR → GGUF keeps every tensor APR can
//! hold byte for byte, the APR file runs with exactly the GGUF's logits on the CPU, the
//! same model in both rotary layouts (llama.cpp's permuted rows vs HF's order) gives the
//! same logits, and APR's 4-bit type on the real SmolLM2 is measured against the
//! transformers float32 reference. (The GPU executors are checked by gpu_parity.)

use std::path::{Path, PathBuf};

use kiln::Model;
use kiln_core::{argmax, DecodeItem, LayerExecutor, LoadOptions, Registry};
use kiln_formats::apr::{write_apr, AprDtype, AprFile, AprTensorSpec, Compression};
use kiln_formats::apr_model::{
    apr_metadata, permute_rope_rows, write_model_apr, write_model_gguf, AprQuantize,
};
use kiln_formats::quantize::{no_progress, quantize_file, QuantizeOptions, Recipe};
use kiln_formats::synth::{synth_file, Preset, SynthOptions};
use kiln_tests::{cosine, fixture, smollm2_or_skip};

fn scratch(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("kiln-apr-{tag}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn cpu(model: &Model) -> Box<dyn LayerExecutor> {
    kiln::link_builtin_backends();
    let backend = Registry::with_builtins().get("cpu").expect("cpu backend");
    backend
        .load(
            &model.ir,
            &LoadOptions {
                max_context: 128,
                ..Default::default()
            },
        )
        .unwrap()
}

/// Logits after the prompt and after each of `steps` greedy steps.
fn run(model: &Model, prompt: &[u32], steps: usize) -> Vec<Vec<f32>> {
    let mut exec = cpu(model);
    let vocab = model.ir.config.vocab_size;
    let seq = exec.new_sequence().unwrap();
    let mut logits = vec![f32::NAN; vocab];
    exec.prefill(seq, prompt, &mut logits).unwrap();
    let mut all = vec![logits.clone()];
    for _ in 0..steps {
        let t = argmax(&logits);
        exec.decode(&[DecodeItem { seq, token: t }], &mut logits)
            .unwrap();
        all.push(logits.clone());
    }
    all
}

fn convert(model: &Model, out: &Path, compression: Compression, quantize: AprQuantize) {
    let tmpl = model.chat_template_source().map(str::to_string);
    if out.extension().is_some_and(|e| e == "apr") {
        write_model_apr(
            &model.ir,
            &model.tokenizer_spec,
            tmpl.as_deref(),
            out,
            compression,
            quantize,
            &no_progress,
        )
        .unwrap();
    } else {
        write_model_gguf(
            &model.ir,
            &model.tokenizer_spec,
            tmpl.as_deref(),
            out,
            &no_progress,
        )
        .unwrap();
    }
}

/// Every tensor of `a` with the same name, type, dims and bytes in `b`.
fn same_tensors(a: &Model, b: &Model) -> usize {
    let mut n = 0;
    for t in a.ir.weights.tensors() {
        let u =
            b.ir.weights
                .tensors()
                .into_iter()
                .find(|u| u.name() == t.name())
                .unwrap_or_else(|| panic!("{} lost", t.name()));
        assert_eq!((u.qtype(), u.dims()), (t.qtype(), t.dims()), "{}", t.name());
        assert!(u.bytes() == t.bytes(), "{}: bytes differ", t.name());
        n += 1;
    }
    n
}

#[test]
fn gguf_apr_gguf_round_trip_is_byte_identical_and_runs_the_same() {
    let dir = scratch("roundtrip");
    // q8_0 and q4_0 recipes leave only types APR holds (Q8_0, Q4_0, Q6_K, F32).
    for recipe in [Recipe::Q8_0, Recipe::Q4_0] {
        let gguf = dir.join(format!("m.{}.gguf", recipe.name()));
        synth_file(
            &gguf,
            SynthOptions {
                preset: Preset::SmolLm2_135m,
                recipe,
                seed: 5,
            },
            &no_progress,
        )
        .unwrap();
        let original = Model::open(&gguf).unwrap();
        for compression in [Compression::None, Compression::Lz4, Compression::Zstd] {
            let apr = dir.join(format!("m.{}.{compression:?}.apr", recipe.name()));
            convert(&original, &apr, compression, AprQuantize::Keep);
            let back = dir.join(format!("m.{}.{compression:?}.gguf", recipe.name()));
            let apr_model = Model::open(&apr).unwrap();
            convert(&apr_model, &back, Compression::None, AprQuantize::Keep);
            let round = Model::open(&back).unwrap();
            let n = same_tensors(&original, &apr_model);
            same_tensors(&original, &round);
            assert_eq!(
                apr_model
                    .tokenizer
                    .encode("Hello, world", false, true)
                    .unwrap(),
                original
                    .tokenizer
                    .encode("Hello, world", false, true)
                    .unwrap()
            );
            let prompt = original
                .tokenizer
                .encode("The capital of France is", false, false)
                .unwrap();
            let (a, b) = (run(&original, &prompt, 4), run(&apr_model, &prompt, 4));
            assert_eq!(
                a,
                b,
                "{} {compression:?}: APR logits differ from the GGUF's",
                recipe.name()
            );
            println!("{} {compression:?}: {n} tensors byte-identical through APR and back; logits identical", recipe.name());
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// The same llama model twice: llama.cpp's layout (Q/K rows permuted into adjacent pairs,
/// NORM rotation, GGUF names) and HF's (rows in split-halves order, NEOX, HF names).
#[test]
fn both_rotary_layouts_give_the_same_logits() {
    let dir = scratch("layouts");
    let gguf = dir.join("llama.gguf");
    synth_file(
        &gguf,
        SynthOptions {
            preset: Preset::SmolLm2_135m,
            recipe: Recipe::Q8_0,
            seed: 9,
        },
        &no_progress,
    )
    .unwrap();
    let m = Model::open(&gguf).unwrap();
    assert_eq!(m.ir.config.rope.kind, kiln_core::RopeKind::Norm);
    let c = &m.ir.config;
    let hf = |gguf_name: &str| -> String {
        match gguf_name {
            "token_embd.weight" => "model.embed_tokens.weight".into(),
            "output_norm.weight" => "model.norm.weight".into(),
            "output.weight" => "lm_head.weight".into(),
            n => {
                let rest = n.strip_prefix("blk.").unwrap();
                let (layer, role) = rest.split_once('.').unwrap();
                let role = match role {
                    "attn_norm.weight" => "input_layernorm.weight",
                    "ffn_norm.weight" => "post_attention_layernorm.weight",
                    "attn_q.weight" => "self_attn.q_proj.weight",
                    "attn_k.weight" => "self_attn.k_proj.weight",
                    "attn_v.weight" => "self_attn.v_proj.weight",
                    "attn_output.weight" => "self_attn.o_proj.weight",
                    "ffn_gate.weight" => "mlp.gate_proj.weight",
                    "ffn_up.weight" => "mlp.up_proj.weight",
                    "ffn_down.weight" => "mlp.down_proj.weight",
                    other => panic!("unexpected tensor {other}"),
                };
                format!("model.layers.{layer}.{role}")
            }
        }
    };
    let mut tensors: Vec<(String, &kiln_core::TensorView)> =
        m.ir.weights
            .tensors()
            .into_iter()
            .map(|t| (hf(t.name()), t))
            .collect();
    tensors.sort_by(|a, b| a.0.cmp(&b.0));
    let specs: Vec<AprTensorSpec> = tensors
        .iter()
        .map(|(name, t)| AprTensorSpec {
            name: name.clone(),
            dtype: AprDtype::Ggml(t.qtype()),
            dims: t.dims().iter().rev().map(|&d| d as u64).collect(),
        })
        .collect();
    let mut config = c.clone();
    config.rope.kind = kiln_core::RopeKind::Neox;
    let mut meta = apr_metadata(&config, &m.tokenizer_spec, m.chat_template_source());
    meta.remove("rope_type"); // HF names alone must mean NEOX.
    let apr = dir.join("llama-hf.apr");
    let mut write = |name: &str, out: &mut dyn std::io::Write| -> std::io::Result<()> {
        let (_, t) = tensors.iter().find(|(n, _)| n == name).unwrap();
        let bytes = if name.ends_with("q_proj.weight") || name.ends_with("k_proj.weight") {
            permute_rope_rows(t.bytes(), t.row_bytes(), c.head_dim, true).unwrap()
        } else {
            t.bytes().to_vec()
        };
        out.write_all(&bytes)
    };
    write_apr(&apr, &meta, &specs, Compression::None, &mut write).unwrap();
    let hf_model = Model::open(&apr).unwrap();
    assert_eq!(hf_model.ir.config.rope.kind, kiln_core::RopeKind::Neox);
    let prompt = [1u32, 100, 2000, 35, 7];
    let (a, b) = (run(&m, &prompt, 6), run(&hf_model, &prompt, 6));
    for (step, (x, y)) in a.iter().zip(&b).enumerate() {
        let cos = cosine(x, y);
        assert!(
            cos > 1.0 - 1e-6,
            "step {step}: cosine {cos} between the two layouts"
        );
        assert_eq!(argmax(x), argmax(y), "step {step}");
    }
    // And back to GGUF: the rows are permuted into llama.cpp's order again.
    let back = dir.join("llama-back.gguf");
    convert(&hf_model, &back, Compression::None, AprQuantize::Keep);
    same_tensors(&m, &Model::open(&back).unwrap());
    println!("NORM/GGUF and NEOX/HF layouts: same logits over 7 steps; HF APR → GGUF restores llama.cpp's rows");
    std::fs::remove_dir_all(&dir).ok();
}

#[derive(serde::Deserialize)]
struct Reference {
    prompts: Vec<RefPrompt>,
}

#[derive(serde::Deserialize)]
struct RefPrompt {
    name: String,
    prompt_ids: Vec<u32>,
    logits_file: String,
    greedy: Vec<RefStep>,
}

#[derive(serde::Deserialize)]
struct RefStep {
    token: u32,
}

fn read_f32(path: &Path) -> Vec<f32> {
    std::fs::read(path)
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

/// The real SmolLM2 through APR: kept types (its Q4_1 matrices become Q8_0, which APR
/// holds; the Q8_0 embedding and F32 norms stay byte-identical) and `--quantize int4` /
/// `int8`, each against the transformers float32 reference (6 prompts × 32 greedy tokens).
#[test]
fn real_smollm2_through_apr_against_the_reference() {
    let Some(source) = smollm2_or_skip("real_smollm2_through_apr_against_the_reference") else {
        return;
    };
    let reference: Reference = serde_json::from_str(
        &std::fs::read_to_string(fixture("smollm2_reference/reference.json")).unwrap(),
    )
    .unwrap();
    let dir = scratch("smollm2");
    let original = Model::open(&source).unwrap();
    // For scale: llama.cpp's own 4-bit rule (Q4_0, kiln quantize) through the same harness.
    let q4_0 = dir.join("smollm2.q4_0.gguf");
    quantize_file(
        &source,
        &q4_0,
        QuantizeOptions {
            recipe: Recipe::Q4_0,
            measure_error: false,
        },
        &no_progress,
    )
    .unwrap();
    for (label, quantize) in [
        ("kept", AprQuantize::Keep),
        ("int8", AprQuantize::Int8),
        ("int4", AprQuantize::Int4),
        ("gguf q4_0", AprQuantize::Keep),
    ] {
        let m = if label == "gguf q4_0" {
            Model::open(&q4_0).unwrap()
        } else {
            let apr = dir.join(format!("smollm2.{label}.apr"));
            convert(&original, &apr, Compression::None, quantize);
            Model::open(&apr).unwrap()
        };
        if label == "kept" {
            // Everything APR holds is byte-identical; then back to GGUF, identical again.
            for t in original.ir.weights.tensors() {
                let u =
                    m.ir.weights
                        .tensors()
                        .into_iter()
                        .find(|u| u.name() == t.name())
                        .unwrap();
                if t.qtype() == u.qtype() {
                    assert!(t.bytes() == u.bytes(), "{}", t.name());
                }
            }
            let back = dir.join("smollm2.back.gguf");
            convert(&m, &back, Compression::None, AprQuantize::Keep);
            let round = Model::open(&back).unwrap();
            same_tensors(&m, &round);
            let prompt = &reference.prompts[0].prompt_ids;
            assert_eq!(
                run(&m, prompt, 3),
                run(&round, prompt, 3),
                "APR and its GGUF run identically"
            );
        }
        let mut exec = cpu(&m);
        let vocab = m.ir.config.vocab_size;
        let (mut worst, mut agree, mut total) = (1f64, 0usize, 0usize);
        for p in &reference.prompts {
            let expected = read_f32(&fixture(&format!("smollm2_reference/{}", p.logits_file)));
            let seq = exec.new_sequence().unwrap();
            let mut logits = vec![f32::NAN; vocab];
            exec.prefill(seq, &p.prompt_ids, &mut logits).unwrap();
            let cos = cosine(&logits, &expected);
            worst = worst.min(cos);
            let mut token = argmax(&logits);
            let mut same = 0;
            for step in p.greedy.iter().take(32) {
                if token != step.token {
                    break;
                }
                same += 1;
                exec.decode(&[DecodeItem { seq, token }], &mut logits)
                    .unwrap();
                token = argmax(&logits);
            }
            println!(
                "{label:<9} {:<16} first-step cosine {cos:.6}, greedy agreement {same}/32",
                p.name
            );
            agree += same;
            total += 32;
            exec.free_sequence(seq).unwrap();
        }
        println!("{label:<9} SmolLM2 APR vs transformers f32: worst cosine {worst:.6}, greedy {agree}/{total} tokens before the first divergence");
        // Reported; only the kept types are held to the bar of the GGUF itself.
        assert!(worst.is_finite() && worst > 0.0, "{label}: cosine {worst}");
        if label == "kept" {
            assert!(worst > 0.998, "{label}: cosine {worst}");
        }
    }
    std::fs::remove_dir_all(&dir).ok();
}

/// APR files are told apart by their magic, not their name; a truncated one is a typed
/// error, never a panic.
#[test]
fn detection_by_magic_and_truncation_errors() {
    let dir = scratch("magic");
    let gguf = dir.join("m.gguf");
    synth_file(
        &gguf,
        SynthOptions {
            preset: Preset::SmolLm2_135m,
            recipe: Recipe::Q8_0,
            seed: 1,
        },
        &no_progress,
    )
    .unwrap();
    let m = Model::open(&gguf).unwrap();
    let apr = dir.join("m.apr");
    convert(&m, &apr, Compression::None, AprQuantize::Keep);
    let disguised = dir.join("model.gguf.bin");
    std::fs::copy(&apr, &disguised).unwrap();
    assert!(matches!(
        Model::open(&disguised).unwrap().file,
        kiln::ModelFile::Apr(_)
    ));
    let bytes = std::fs::read(&apr).unwrap();
    for cut in [5usize, 64, 200, bytes.len() / 2, bytes.len() - 1] {
        let p = dir.join(format!("cut{cut}.apr"));
        std::fs::write(&p, &bytes[..cut]).unwrap();
        assert!(Model::open(&p).is_err(), "truncated at {cut}");
        assert!(AprFile::open(&p).is_err());
    }
    // And the quantised GGUF of kiln quantize still converts (Q5_0 rows become Q8_0).
    let q4km = dir.join("m.q4_k_m.gguf");
    quantize_file(
        &gguf,
        &q4km,
        QuantizeOptions {
            recipe: Recipe::Q4_K_M,
            measure_error: false,
        },
        &no_progress,
    )
    .unwrap();
    let qm = Model::open(&q4km).unwrap();
    let tmpl = qm.chat_template_source().map(str::to_string);
    let report = write_model_apr(
        &qm.ir,
        &qm.tokenizer_spec,
        tmpl.as_deref(),
        &dir.join("q.apr"),
        Compression::None,
        AprQuantize::Keep,
        &no_progress,
    )
    .unwrap();
    assert!(report.iter().all(|r| r.to == "q8_0"), "{report:?}");
    assert!(!report.is_empty());
    std::fs::remove_dir_all(&dir).ok();
}
