//! The committed include/kiln.h is what cbindgen makes of src/lib.rs now.

mod common;

#[test]
fn kiln_h_is_current() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let want = common::header::generate(dir);
    let have = std::fs::read_to_string(format!("{dir}/include/kiln.h")).expect("include/kiln.h");
    assert!(
        have == want,
        "include/kiln.h differs from src/lib.rs: run `cargo run -p kiln-capi --example write_header`"
    );
}
