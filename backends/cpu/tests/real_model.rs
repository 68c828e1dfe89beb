//! The real SmolLM2-135M-Instruct Q4_1 against transformers' float32 reference
//! (`tests/fixtures/smollm2_reference`): first-step logits with cosine ≥ 0.999, and 32
//! greedy steps token for token, a divergence allowed only where the reference's top-1/top-2
//! gap is below 0.01. Skipped (with a visible line) when the model file is absent.

use std::path::PathBuf;

use kiln_backend_cpu::CpuBackend;
use kiln_core::{argmax, Backend, DecodeItem, LoadOptions};

fn model_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_TEST_MODEL") {
        return Some(p.into());
    }
    let p = PathBuf::from(std::env::var_os("HOME")?).join(".cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf");
    p.exists().then_some(p)
}

#[test]
fn smollm2_matches_transformers_reference() {
    let Some(path) = model_path() else {
        println!("skipped: SmolLM2 model not found (set KILN_TEST_MODEL or fill ~/.cache/kiln/models)");
        return;
    };
    let fixture = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/fixtures/smollm2_reference");
    let reference: serde_json::Value =
        serde_json::from_slice(&std::fs::read(fixture.join("reference.json")).expect("fixture")).unwrap();
    let (_file, ir) = kiln_formats::model::load_gguf(&path).expect("load model");
    let vocab = ir.config.vocab_size;
    let opts = LoadOptions { max_context: 256, max_sequences: 1, threads: None, progress: None };
    let mut ex = CpuBackend.load(&ir, &opts).unwrap();
    for p in reference["prompts"].as_array().unwrap() {
        let name = p["name"].as_str().unwrap();
        let ids: Vec<u32> = p["prompt_ids"].as_array().unwrap().iter().map(|v| v.as_u64().unwrap() as u32).collect();
        let want: Vec<f32> = std::fs::read(fixture.join(p["logits_file"].as_str().unwrap()))
            .unwrap()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        let seq = ex.new_sequence().unwrap();
        let mut logits = vec![0.0f32; vocab];
        ex.prefill(seq, &ids, &mut logits).unwrap();
        let dot: f64 = logits.iter().zip(&want).map(|(a, b)| *a as f64 * *b as f64).sum();
        let na: f64 = logits.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        let nb: f64 = want.iter().map(|a| (*a as f64).powi(2)).sum::<f64>().sqrt();
        let cosine = dot / (na * nb);
        let max_diff = logits.iter().zip(&want).map(|(a, b)| (a - b).abs()).fold(0.0f32, f32::max);
        println!("{name}: cosine {cosine:.7}, max |Δlogit| {max_diff:.4}");
        assert!(cosine >= 0.999, "{name}: cosine {cosine}");

        // Forced greedy: feed the reference's tokens, compare our argmax at each step.
        for (step, g) in p["greedy"].as_array().unwrap().iter().take(32).enumerate() {
            let token = g["token"].as_u64().unwrap() as u32;
            let ours = argmax(&logits);
            let gap = g["gap"].as_f64().unwrap();
            assert!(ours == token || gap < 0.01, "{name} step {step}: we pick {ours}, reference {token} (gap {gap})");
            ex.decode(&[DecodeItem { seq, token }], &mut logits).unwrap();
        }
        ex.free_sequence(seq).unwrap();
    }
}
