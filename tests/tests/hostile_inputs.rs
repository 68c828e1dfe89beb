//! The hostile-input suite (scripts/check/hostile_inputs.py): ~130 generated cases — model files
//! with one thing wrong (truncations, absurd counts and sizes, wrong metadata types,
//! overlapping or out-of-range tensors, NaN weights, bad hyperparameters), chat templates
//! that loop, recurse or build unbounded text, FIFOs, devices and directories as models and
//! plugins, out-of-range arguments and hostile standard input — each run through the
//! `kiln` binary under a time and memory bound. Every case must end in a typed error or a
//! correct result: no panic, abort, signal or hang. Needs python3 (else a visible skip).

use std::process::Command;

#[test]
fn every_hostile_input_ends_in_a_typed_error_or_a_result() {
    if Command::new("python3").arg("--version").output().is_err() {
        kiln_tests::skip("hostile_inputs", "python3 is not available");
        return;
    }
    let script =
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/check/hostile_inputs.py");
    let out = Command::new("python3")
        .arg(&script)
        .arg("--kiln")
        .arg(kiln_tests::kiln_binary())
        .output()
        .expect("python3 runs");
    let stdout = String::from_utf8_lossy(&out.stdout);
    println!("{stdout}{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "hostile inputs failed:\n{stdout}");
    let summary: serde_json::Value =
        serde_json::from_str(stdout.lines().last().expect("a summary line"))
            .expect("the summary is JSON");
    assert_eq!(summary["failed"], 0);
    assert!(summary["cases"].as_u64().unwrap() >= 120, "{summary}");
}
