//! Phi-3 and Granite 3 on the CPU oracle against Hugging Face transformers: tiny random
//! models written as llama.cpp's converter lays them out (Phi-3's fused Q/K/V and gate/up
//! tensors, a sliding window shorter than the prompt; Granite's four multipliers far from
//! 1), from `fixtures/phi3_granite/`, made by `scripts/fixtures/make_phi3_granite_fixture.py`.
//! The prompt goes in as chunks, each chunk's last logits compared (cosine ≥ 0.9999), then
//! 32 greedy steps must give transformers' tokens.

use kiln_core::{Architecture, DecodeItem, LayerExecutor};
use kiln_formats::gguf::GgufFile;
use kiln_formats::model::model_from_gguf;
use kiln_tests::{cosine, cpu_executor, fixture};
use serde::Deserialize;

#[derive(Deserialize)]
struct Expected {
    positions: Vec<usize>,
    greedy: Vec<u32>,
}

#[derive(Deserialize)]
struct Reference {
    prompt_ids: Vec<u32>,
    vocab: usize,
    phi3: Expected,
    granite: Expected,
}

fn reference() -> Reference {
    serde_json::from_str(&std::fs::read_to_string(fixture("phi3_granite/reference.json")).unwrap())
        .unwrap()
}

fn logits_of(name: &str) -> Vec<f32> {
    std::fs::read(fixture(&format!("phi3_granite/{name}.logits.f32")))
        .unwrap()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

fn model(name: &str) -> kiln_core::ModelIr {
    let file = GgufFile::open(fixture(&format!("phi3_granite/{name}.gguf"))).unwrap();
    model_from_gguf(&file, name).unwrap()
}

/// The worst cosine of the prompt's checked positions, and the greedy continuation.
fn run(
    exec: &mut dyn LayerExecutor,
    r: &Reference,
    expected: &Expected,
    rows: &[f32],
) -> (f64, Vec<u32>) {
    let seq = exec.new_sequence().unwrap();
    let mut logits = vec![f32::NAN; r.vocab];
    let (mut done, mut worst) = (0, 1.0f64);
    for (row, &pos) in expected.positions.iter().enumerate() {
        exec.prefill(seq, &r.prompt_ids[done..=pos], &mut logits)
            .unwrap();
        done = pos + 1;
        worst = worst.min(cosine(&logits, &rows[row * r.vocab..(row + 1) * r.vocab]));
    }
    assert_eq!(done, r.prompt_ids.len());
    let mut tokens = Vec::new();
    for _ in 0..expected.greedy.len() {
        let token = kiln_core::argmax(&logits);
        tokens.push(token);
        exec.decode(&[DecodeItem { seq, token }], &mut logits)
            .unwrap();
    }
    (worst, tokens)
}

/// The CPU on `name`'s fixture against transformers; then on the same file with `break_it`
/// applied, which must disagree (the fixture exercises what `break_it` removes).
fn check(
    name: &str,
    expected: impl Fn(&Reference) -> &Expected,
    break_it: impl Fn(&mut kiln_core::ModelIr),
) {
    let r = reference();
    let mut ir = model(name);
    let mut exec = cpu_executor(&ir, 256);
    let (worst, greedy) = run(exec.as_mut(), &r, expected(&r), &logits_of(name));
    println!("{name}: worst cosine {worst:.7} to transformers; greedy {greedy:?}");
    assert!(worst >= 0.9999, "{name}: cosine {worst}");
    assert_eq!(greedy, expected(&r).greedy, "{name}: greedy tokens");
    break_it(&mut ir);
    let mut exec = cpu_executor(&ir, 256);
    let (broken, _) = run(exec.as_mut(), &r, expected(&r), &logits_of(name));
    println!("{name}, read without what defines it: worst cosine {broken:.4}");
    assert!(
        broken < 0.999,
        "{name}: the fixture does not need what was removed"
    );
}

#[test]
fn phi3_matches_transformers_on_the_cpu() {
    let ir = model("phi3");
    assert_eq!(ir.config.arch, Architecture::Phi3);
    let window = ir
        .config
        .sliding_window
        .expect("the fixture has a window")
        .window;
    assert!(
        window < reference().prompt_ids.len(),
        "the window binds in the fixture"
    );
    check("phi3", |r| &r.phi3, |ir| ir.config.sliding_window = None);
}

#[test]
fn granite_matches_transformers_on_the_cpu() {
    let ir = model("granite");
    let Architecture::Granite(scales) = ir.config.arch else {
        panic!("{:?}", ir.config.arch)
    };
    assert_eq!(
        (scales.residual, scales.attention, scales.logits),
        (0.22, 0.05, 8.0)
    );
    assert_eq!(ir.config.embedding_scale, 12.0);
    check(
        "granite",
        |r| &r.granite,
        |ir| {
            ir.config.arch = Architecture::Granite(kiln_core::GraniteScales {
                residual: 1.0,
                ..scales
            })
        },
    );
}
