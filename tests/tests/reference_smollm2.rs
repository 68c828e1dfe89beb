//! The CPU oracle against an independent reference: HuggingFace transformers loading the
//! same SmolLM2 GGUF in float32 (fixture made by scripts/fixtures/make_reference_logits.py).
//!
//! - the logits of the first decode step after each prompt: cosine ≥ 0.999;
//! - greedy generation token for token for at least 32 steps; a divergence is allowed only
//!   at a step where the reference's top-1/top-2 gap is below 0.01.

use kiln::Model;
use kiln_core::{argmax, DecodeItem};
use kiln_formats::quantize::{no_progress, quantize_file, QuantizeOptions, Recipe};
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
    let runs = against_reference(&model, &reference);
    for (prompt, run) in reference.prompts.iter().zip(&runs) {
        assert!(run.finite, "{}: non-finite logits", prompt.name);
        println!(
            "{:<16} first-step cosine {:.6}, max |Δlogit| {:.4}",
            prompt.name, run.cos, run.max_abs
        );
        assert!(
            run.cos >= 0.999,
            "{}: cosine {} < 0.999",
            prompt.name,
            run.cos
        );
        if let Some((step, gap)) = run.diverged {
            assert!(
                step >= REQUIRED_STEPS || gap < 0.01,
                "{}: step {step} differs from the reference, whose top-1/top-2 gap there is {gap} ≥ 0.01",
                prompt.name
            );
            println!(
                "{:<16} diverged at step {step} where the reference gap is {gap:.4}",
                prompt.name
            );
        }
        println!(
            "{:<16} greedy tokens agree for {} of {} steps",
            prompt.name,
            run.agreed,
            prompt.greedy.len()
        );
    }
}

/// How a model's run of one reference prompt went on the CPU oracle.
struct PromptRun {
    /// First-step logits: cosine to the reference's, largest |Δlogit|, all finite.
    cos: f64,
    max_abs: f32,
    finite: bool,
    /// Greedy tokens equal to the reference's before the first divergence, and where it
    /// diverged: the step and the reference's top-1/top-2 gap there.
    agreed: usize,
    diverged: Option<(usize, f32)>,
}

/// `model` on the CPU oracle through every reference prompt: the first-step logits, then
/// greedy decoding as long as it follows the reference's tokens.
fn against_reference(model: &Model, reference: &Reference) -> Vec<PromptRun> {
    let mut exec = cpu_executor(&model.ir, 256);
    let vocab = model.ir.config.vocab_size;
    let mut out = Vec::new();
    for prompt in &reference.prompts {
        let expected = read_f32(&fixture(&format!(
            "smollm2_reference/{}",
            prompt.logits_file
        )));
        let seq = exec.new_sequence().unwrap();
        let mut logits = vec![f32::NAN; vocab];
        exec.prefill(seq, &prompt.prompt_ids, &mut logits).unwrap();
        let finite = logits.iter().all(|l| l.is_finite());
        let cos = cosine(&logits, &expected);
        let max_abs = logits
            .iter()
            .zip(&expected)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        let (mut agreed, mut diverged) = (0, None);
        let mut token = argmax(&logits);
        for (step, reference_step) in prompt.greedy.iter().enumerate() {
            if token != reference_step.token {
                diverged = Some((step, reference_step.gap));
                break;
            }
            agreed += 1;
            exec.decode(&[DecodeItem { seq, token }], &mut logits)
                .unwrap();
            token = argmax(&logits);
        }
        exec.free_sequence(seq).unwrap();
        out.push(PromptRun {
            cos,
            max_abs,
            finite,
            agreed,
            diverged,
        });
    }
    out
}

/// The real SmolLM2 requantised to IQ4_XS and IQ4_NL (`kiln quantize`, llama.cpp's mixes)
/// beside the same file requantised to Q4_0 (llama.cpp's plain 4-bit rule) and the file as
/// published (Q4_1 matrices), each against the transformers float32 reference of the
/// published file: first-step cosine and greedy tokens before the first divergence, printed
/// per prompt. Any requantisation of this 135M model moves its greedy text within a few
/// tokens, so the bar is relative: the IQ4 files must land where their non-linear levels
/// put them, above Q4_0 on both counts (a wrong level table or scale falls far below it),
/// and no prompt's cosine under 0.8 (Q4_0's worst prompt sits just above it).
#[test]
fn requantised_iq4_smollm2_beside_q4_0_and_the_published_file() {
    let Some(source) =
        smollm2_or_skip("requantised_iq4_smollm2_beside_q4_0_and_the_published_file")
    else {
        return;
    };
    let reference: Reference = serde_json::from_str(
        &std::fs::read_to_string(fixture("smollm2_reference/reference.json")).unwrap(),
    )
    .unwrap();
    let dir = std::env::temp_dir().join(format!("kiln-iq4-smollm2-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let published = against_reference(&Model::open(&source).unwrap(), &reference);
    let summary = |r: &[PromptRun]| {
        let mean = r.iter().map(|p| p.cos).sum::<f64>() / r.len() as f64;
        (
            mean,
            r.iter()
                .map(|p| p.agreed.min(REQUIRED_STEPS))
                .sum::<usize>(),
        )
    };
    let mut q4_0 = None;
    for recipe in [Recipe::Q4_0, Recipe::IQ4_XS, Recipe::IQ4_NL] {
        let path = dir.join(format!("smollm2.{}.gguf", recipe.name()));
        quantize_file(
            &source,
            &path,
            QuantizeOptions {
                recipe,
                measure_error: false,
            },
            &no_progress,
        )
        .unwrap();
        let got = against_reference(&Model::open(&path).unwrap(), &reference);
        for ((p, run), base) in reference.prompts.iter().zip(&got).zip(&published) {
            let (cos, agreed) = (run.cos, run.agreed.min(REQUIRED_STEPS));
            let (cos_q4_1, agreed_q4_1) = (base.cos, base.agreed.min(REQUIRED_STEPS));
            println!(
                "{:<7} {:<16} cosine {cos:.5} (q4_1 {cos_q4_1:.5}), greedy {agreed:>2}/{REQUIRED_STEPS} (q4_1 {agreed_q4_1:>2})",
                recipe.name(),
                p.name
            );
            assert!(cos >= 0.8, "{} {}: cosine {cos}", recipe.name(), p.name);
        }
        let (mean, agreed) = summary(&got);
        println!(
            "{:<7} mean cosine {mean:.5}, greedy tokens agreeing {agreed} (published Q4_1: {})",
            recipe.name(),
            summary(&published).1
        );
        match q4_0 {
            None => q4_0 = Some((mean, agreed)),
            Some((base_mean, base_agreed)) => {
                assert!(
                    mean > base_mean && agreed >= base_agreed,
                    "{}: mean cosine {mean:.5} and {agreed} tokens against q4_0's {base_mean:.5} and {base_agreed}",
                    recipe.name()
                );
            }
        }
        std::fs::remove_file(&path).ok();
    }
    std::fs::remove_dir_all(&dir).ok();
}
