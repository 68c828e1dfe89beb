//! YaRN end to end: the CPU oracle against Hugging Face transformers on a tiny random Qwen2
//! whose context is scaled by YaRN (32 positions × 8), through the committed fixture
//! `fixtures/yarn_qwen2/` made by `scripts/fixtures/make_yarn_logits_fixture.py` (the GGUF file the
//! `gguf` package wrote, and the float32 logits of a 200-token prompt at every fifth
//! position). The prompt goes in as chunks of five tokens, each chunk's last logits compared
//! (cosine ≥ 0.99999). The same file read without its scaling must disagree: the fixture
//! does exercise YaRN.

use kiln_core::RopeScaling;
use kiln_formats::gguf::GgufFile;
use kiln_formats::model::model_from_gguf;
use kiln_tests::{cosine, cpu_executor, fixture};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    prompt_ids: Vec<u32>,
    positions: Vec<usize>,
    vocab: usize,
}

/// Cosine of each checked position's logits against the reference, for `model`.
fn cosines(model: &kiln_core::ModelIr, reference: &Reference, expected: &[f32]) -> Vec<f64> {
    let mut exec = cpu_executor(model, 256);
    let seq = exec.new_sequence().unwrap();
    let mut logits = vec![f32::NAN; reference.vocab];
    let mut done = 0;
    let mut out = Vec::new();
    for (row, &pos) in reference.positions.iter().enumerate() {
        exec.prefill(seq, &reference.prompt_ids[done..=pos], &mut logits)
            .unwrap();
        done = pos + 1;
        out.push(cosine(
            &logits,
            &expected[row * reference.vocab..(row + 1) * reference.vocab],
        ));
    }
    out
}

#[test]
fn cpu_matches_transformers_with_yarn() {
    let reference: Reference = serde_json::from_str(
        &std::fs::read_to_string(fixture("yarn_qwen2/reference.json")).unwrap(),
    )
    .unwrap();
    let bytes = std::fs::read(fixture("yarn_qwen2/logits.f32")).unwrap();
    let expected: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(expected.len(), reference.positions.len() * reference.vocab);
    let gguf = GgufFile::open(fixture("yarn_qwen2/yarn-qwen2.gguf")).unwrap();
    let mut model = model_from_gguf(&gguf, "yarn-qwen2").unwrap();
    assert!(matches!(
        model.config.rope.scaling,
        RopeScaling::Yarn {
            factor: 8.0,
            original_context: 32,
            ..
        }
    ));

    let got = cosines(&model, &reference, &expected);
    let worst = got.iter().cloned().fold(f64::INFINITY, f64::min);
    println!("YaRN: worst cosine {worst:.7} over {} positions", got.len());
    for (c, &pos) in got.iter().zip(&reference.positions) {
        assert!(*c >= 0.99999, "position {pos}: cosine {c}");
    }

    model.config.rope.scaling = RopeScaling::None;
    let unscaled = cosines(&model, &reference, &expected);
    let past_window = unscaled[reference.positions.iter().position(|&p| p >= 64).unwrap()..]
        .iter()
        .cloned()
        .fold(f64::INFINITY, f64::min);
    println!("without the scaling: worst cosine {past_window:.4} past position 64");
    assert!(
        past_window < 0.999,
        "the fixture does not tell YaRN from plain RoPE"
    );
}
