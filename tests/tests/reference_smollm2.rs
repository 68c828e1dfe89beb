//! The CPU oracle against an independent reference: HuggingFace transformers loading the
//! same SmolLM2 GGUF in float32 (fixture made by scripts/fixtures/make_reference_logits.py).
//!
//! - the logits of the first decode step after each prompt: cosine ≥ 0.999;
//! - greedy generation token for token for at least 32 steps; a divergence is allowed only
//!   at a step where the reference's top-1/top-2 gap is below 0.01.

use kiln::Model;
use kiln_core::{argmax, DecodeItem};
use kiln_tests::{cosine, cpu_executor, fixture, smollm2_or_skip};
use serde::Deserialize;

#[derive(Deserialize)]
struct Reference {
    model_sha256: String,
    prompts: Vec<Prompt>,
}

#[derive(Deserialize)]
struct Prompt {
    name: String,
    prompt_ids: Vec<u32>,
    logits_file: String,
    greedy: Vec<Step>,
}

#[derive(Deserialize)]
struct Step {
    token: u32,
    gap: f32,
}

const REQUIRED_STEPS: usize = 32;

fn read_f32(path: &std::path::Path) -> Vec<f32> {
    let bytes = std::fs::read(path).expect("fixture logits");
    bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn cpu_matches_transformers_on_smollm2() {
    let Some(path) = smollm2_or_skip("cpu_matches_transformers_on_smollm2") else {
        return;
    };
    let reference: Reference = serde_json::from_str(
        &std::fs::read_to_string(fixture("smollm2_reference/reference.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(
        reference.model_sha256,
        kiln::fetch::SMOLLM2.sha256,
        "fixture made from another file"
    );

    let model = Model::open(&path).unwrap();
    let mut exec = cpu_executor(&model.ir, 256);
    let vocab = model.ir.config.vocab_size;

    for prompt in &reference.prompts {
        let expected = read_f32(&fixture(&format!(
            "smollm2_reference/{}",
            prompt.logits_file
        )));
        let seq = exec.new_sequence().unwrap();
        let mut logits = vec![f32::NAN; vocab];
        exec.prefill(seq, &prompt.prompt_ids, &mut logits).unwrap();
        assert!(
            logits.iter().all(|l| l.is_finite()),
            "{}: non-finite logits",
            prompt.name
        );
        let cos = cosine(&logits, &expected);
        let max_abs = logits
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        println!(
            "{:<16} first-step cosine {cos:.6}, max |Δlogit| {max_abs:.4}",
            prompt.name
        );
        assert!(cos >= 0.999, "{}: cosine {cos} < 0.999", prompt.name);

        let mut agreed = 0;
        let mut token = argmax(&logits);
        for (step, reference_step) in prompt.greedy.iter().enumerate() {
            if token != reference_step.token {
                assert!(
                    step >= REQUIRED_STEPS || reference_step.gap < 0.01,
                    "{}: step {step} gives token {token}, reference {} with top-1/top-2 gap {} ≥ 0.01",
                    prompt.name,
                    reference_step.token,
                    reference_step.gap
                );
                println!(
                    "{:<16} diverged at step {step} where the reference gap is {:.4}",
                    prompt.name, reference_step.gap
                );
                break;
            }
            agreed += 1;
            exec.decode(&[DecodeItem { seq, token }], &mut logits)
                .unwrap();
            token = argmax(&logits);
        }
        println!(
            "{:<16} greedy tokens agree for {agreed} of {} steps",
            prompt.name,
            prompt.greedy.len()
        );
        exec.free_sequence(seq).unwrap();
    }
}
