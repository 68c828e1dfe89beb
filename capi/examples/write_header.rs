//! Writes include/kiln.h from src/lib.rs (cbindgen, with cbindgen.toml).
fn main() {
    let dir = env!("CARGO_MANIFEST_DIR");
    let header = kiln_capi_header::generate(dir);
    let path = std::path::Path::new(dir).join("include/kiln.h");
    std::fs::write(&path, header).expect("write include/kiln.h");
    println!("wrote {}", path.display());
}

#[path = "../tests/common/header.rs"]
mod kiln_capi_header;
