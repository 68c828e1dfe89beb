//! YaRN rope scaling (`RopeScaling::Yarn`) against Hugging Face `transformers`, through
//! the committed fixture `fixtures/yarn_reference.json` made by
//! `scripts/fixtures/make_yarn_fixture.py` (the inverse frequency of every rotary pair and the
//! attention factor, for Qwen's 128k setting, non-default betas, a partial rotary head and
//! gpt-oss's unrounded ramp).

use kiln_core::{RopeConfig, RopeKind, RopeScaling};
use serde_json::Value;

#[test]
fn yarn_matches_transformers() {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/yarn_reference.json"
    );
    let text = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("reading {path}: {e}"));
    let fixture: Value = serde_json::from_str(&text).expect("fixture is valid JSON");
    let cases = fixture["cases"].as_array().expect("cases");
    assert!(cases.len() >= 4);
    for case in cases {
        let num = |k: &str| case[k].as_f64().unwrap_or_else(|| panic!("{k}"));
        let factor = num("factor") as f32;
        let rope = RopeConfig {
            kind: RopeKind::Neox,
            theta: num("theta") as f32,
            rotary_dims: num("rotary_dims") as usize,
            scaling: RopeScaling::Yarn {
                factor,
                original_context: num("original_context") as usize,
                beta_fast: num("beta_fast") as f32,
                beta_slow: num("beta_slow") as f32,
                attn_factor: RopeScaling::yarn_mscale(factor),
                truncate: case["truncate"].as_bool().expect("truncate"),
            },
        };
        let expected: Vec<f64> = case["inv_freq"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        assert_eq!(expected.len(), rope.rotary_dims / 2);
        for (i, &want) in expected.iter().enumerate() {
            let got = rope.inv_freq(i, None) as f64;
            let rel = (got - want).abs() / want;
            assert!(
                rel < 2e-6,
                "pair {i} of {case}: {got} against {want} (rel {rel:e})"
            );
        }
        let af = rope.attention_factor() as f64;
        assert!(
            (af - num("attention_factor")).abs() < 1e-6,
            "attention factor {af} of {case}"
        );
        // Pairs that turn fast keep their frequency; the slowest are divided by the factor.
        let unscaled = RopeConfig {
            scaling: RopeScaling::None,
            ..rope.clone()
        };
        assert_eq!(rope.inv_freq(0, None), unscaled.inv_freq(0, None));
        let last = rope.rotary_dims / 2 - 1;
        let ratio = unscaled.inv_freq(last, None) / rope.inv_freq(last, None);
        assert!(
            (ratio - factor).abs() < 1e-4 * factor,
            "slowest pair divided by {ratio}, not {factor}"
        );
    }
}
