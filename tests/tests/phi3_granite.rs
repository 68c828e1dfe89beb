//! Phi-3 and Granite 3 on the CPU oracle against Hugging Face transformers: tiny random
//! models written as llama.cpp's converter lays them out (Phi-3's fused Q/K/V and gate/up
//! tensors, a sliding window shorter than the prompt; Granite's four multipliers far from
//! 1), from `fixtures/phi3_granite/`, made by `scripts/fixtures/make_phi3_granite_fixture.py`.
//! The prompt goes in as chunks, each chunk's last logits compared (cosine ≥ 0.9999), then
//! 32 greedy steps must give transformers' tokens.

use kiln_core::Architecture;
use kiln_tests::transformers_reference::Fixtures;

#[test]
fn phi3_matches_transformers_on_the_cpu() {
    let f = Fixtures::open("phi3_granite");
    let ir = f.model("phi3");
    assert_eq!(ir.config.arch, Architecture::Phi3);
    let window = ir
        .config
        .sliding_window
        .expect("the fixture has a window")
        .window;
    assert!(window < f.prompt().len(), "the window binds in the fixture");
    f.check_cpu("phi3", |ir| ir.config.sliding_window = None);
}

#[test]
fn granite_matches_transformers_on_the_cpu() {
    let f = Fixtures::open("phi3_granite");
    let ir = f.model("granite");
    let Architecture::Granite(scales) = ir.config.arch else {
        panic!("{:?}", ir.config.arch)
    };
    assert_eq!(
        (scales.residual, scales.attention, scales.logits),
        (0.22, 0.05, 8.0)
    );
    assert_eq!(ir.config.embedding_scale, 12.0);
    f.check_cpu("granite", |ir| {
        ir.config.arch = Architecture::Granite(kiln_core::GraniteScales {
            residual: 1.0,
            ..scales
        })
    });
}
