//! The built-in backends under the conformance suite (`kiln conformance`, crate
//! `kiln-conformance`): the CPU reference here, the CUDA backends on a GPU. Plugins — the
//! example, the deliberately broken fixtures, one built outside the repository — are in
//! tests/tests/plugins.rs.
//!
//! The CUDA cases are `#[ignore]`d, so CI lists them as ignored (never as passed);
//! scripts/gpu/gpu_suite.sh runs this binary on the GPU machine with `--include-ignored` and
//! `KILN_REQUIRE_GPU=1`, where an unavailable backend fails.

use kiln::conformance::{run, Options, Outcome, Report, RULES};
use kiln_core::Registry;
use kiln_tests::{skip, smollm2_path};

/// The suite on built-in backend `name`, with the real model when it is present; `None`
/// (skipped) when the backend is unavailable here and the GPU is not required.
fn conformance_of(name: &str) -> Option<Report> {
    kiln::link_builtin_backends();
    let registry = Registry::with_builtins();
    let backend = registry
        .get(name)
        .unwrap_or_else(|| panic!("{name} is linked in"));
    if let Err(why) = backend.probe() {
        if std::env::var_os("KILN_REQUIRE_GPU").is_some() {
            panic!("KILN_REQUIRE_GPU is set but {name} is unavailable: {why}");
        }
        skip(&format!("conformance of {name}"), &why);
        return None;
    }
    let real_model = smollm2_path()
        .map(|p| kiln::conformance::real_model_from(&p).expect("the real model opens"));
    if real_model.is_none() {
        skip(
            &format!("conformance of {name} on SmolLM2"),
            "model not found; synthetic models only",
        );
    }
    let report = run(
        backend.as_ref(),
        &Options {
            real_model,
            ..Options::default()
        },
    );
    println!("{report}");
    Some(report)
}

fn assert_passes(report: &Report) {
    assert!(
        report.passed(),
        "{} fails conformance: {:?}\n{report}",
        report.backend,
        report.failed_rules()
    );
    // Every contract rule was judged on at least one model (nothing passed by skipping).
    for rule in RULES {
        assert!(
            report
                .findings
                .iter()
                .any(|f| f.rule == rule.name && f.outcome == Outcome::Pass),
            "{}: rule {} never passed\n{report}",
            report.backend,
            rule.name
        );
    }
}

#[test]
fn the_cpu_reference_passes_conformance() {
    let report = conformance_of("cpu").expect("the CPU backend is always available");
    assert_passes(&report);
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn cuda_q4k_passes_conformance_on_a_gpu() {
    if let Some(report) = conformance_of("cuda-q4k") {
        assert_passes(&report);
    }
}

#[test]
#[ignore = "needs an NVIDIA GPU; run scripts/gpu/gpu_suite.sh on the device"]
fn cuda_q4_0_passes_conformance_on_a_gpu() {
    if let Some(report) = conformance_of("cuda-q4_0") {
        assert_passes(&report);
    }
}

#[test]
fn every_rule_has_a_unique_name_and_is_documented() {
    // Embedded at build time: this binary also runs on the GPU machine, without the tree.
    let doc = include_str!("../../docs/plugins.md");
    for (i, rule) in RULES.iter().enumerate() {
        assert!(
            RULES[..i].iter().all(|r| r.name != rule.name),
            "{} twice",
            rule.name
        );
        assert!(
            doc.contains(&format!("`{}`", rule.name)),
            "docs/plugins.md does not describe {}",
            rule.name
        );
    }
}
