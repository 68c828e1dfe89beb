/// kiln.h as cbindgen makes it from the crate at `dir` with its cbindgen.toml.
pub fn generate(dir: &str) -> String {
    let config =
        cbindgen::Config::from_file(format!("{dir}/cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_crate(dir)
        .with_config(config)
        .generate()
        .expect("cbindgen reads src/lib.rs")
        .write(&mut out);
    String::from_utf8(out).expect("UTF-8")
}
