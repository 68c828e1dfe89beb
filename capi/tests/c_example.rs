//! examples/generate.c, compiled with the system's C compiler against include/kiln.h and
//! the shared library, runs on a synthetic SmolLM2 (kiln synth's, so no download): it
//! lists the backends, loads the model on the CPU, builds a chat prompt, streams a reply
//! that its callback stops after 4 pieces, and reads errors as status codes; then
//! examples/batch.c runs four threads on one batcher.

use std::path::PathBuf;
use std::process::Command;

/// The directory cargo put this crate's shared library in: `deps/` beside the test binary
/// (a `cargo test`), or its parent (where `cargo build` copies it).
fn library_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("the test's path");
    let deps = exe
        .parent()
        .expect("target/<profile>/deps/<test>")
        .to_path_buf();
    match deps.parent() {
        Some(up) if !deps.join("libkiln_capi.so").exists() => up.to_path_buf(),
        _ => deps,
    }
}

#[test]
fn the_c_example_builds_and_runs() {
    let lib = library_dir();
    assert!(
        lib.join("libkiln_capi.so").exists(),
        "no libkiln_capi.so in {}",
        lib.display()
    );
    let dir = std::env::temp_dir().join(format!("kiln-capi-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let model = dir.join("smollm2.q4_0.gguf");
    kiln_formats::synth::synth_file(
        &model,
        kiln_formats::synth::SynthOptions {
            preset: kiln_formats::synth::Preset::SmolLm2_135m,
            recipe: kiln_formats::quantize::Recipe::Q4_0,
            seed: 1,
        },
        &kiln_formats::quantize::no_progress,
    )
    .unwrap();

    let exe = build_example(&lib, &dir, "generate", &[]);
    let out = run_example(
        &exe,
        &lib,
        &[model.as_os_str(), "Say hello.".as_ref(), "4".as_ref()],
    );
    assert!(out.contains("open a missing file: status 8 (io)"), "{out}");
    assert!(out.contains("\"name\":\"cpu\",\"score\""), "{out}");
    assert!(out.contains("loaded on cpu, vocabulary of 49152"), "{out}");
    // The callback stopped the reply after its fourth piece (or the model ended first).
    let finish = out
        .lines()
        .find_map(|l| l.strip_prefix("finish "))
        .expect("a finish line");
    assert!(
        finish.starts_with("3 ") && finish.contains("(4 pieces)") || finish.starts_with("0 "),
        "{finish}"
    );
    assert!(out.contains("null prompt: status 1"), "{out}");

    // The batcher: four threads at once, and a prompt the context cannot hold.
    let exe = build_example(&lib, &dir, "batch", &["-pthread"]);
    let out = run_example(&exe, &lib, &[model.as_os_str()]);
    assert!(out.contains("4 of 4 threads answered"), "{out}");
    assert!(out.contains("long prompt: status 4"), "{out}");
    std::fs::remove_dir_all(&dir).ok();
}

/// Compiles examples/NAME.c with the system's C compiler (`CC`, default `cc`) against
/// kiln.h and the shared library in `lib`, into `dir`.
fn build_example(
    lib: &std::path::Path,
    dir: &std::path::Path,
    name: &str,
    extra: &[&str],
) -> PathBuf {
    let root = env!("CARGO_MANIFEST_DIR");
    let exe = dir.join(name);
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let built = Command::new(&cc)
        .args(["-std=c99", "-Wall", "-Wextra", "-Werror"])
        .args(extra)
        .arg(format!("{root}/examples/{name}.c"))
        .arg(format!("-I{root}/include"))
        .arg(format!("-L{}", lib.display()))
        .arg("-lkiln_capi")
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("running the C compiler '{cc}' (set CC to another): {e}"));
    assert!(
        built.status.success(),
        "{cc} failed on {name}.c:\n{}",
        String::from_utf8_lossy(&built.stderr)
    );
    exe
}

/// Runs a built example with `args`; its stdout, the run asserted successful.
fn run_example(exe: &std::path::Path, lib: &std::path::Path, args: &[&std::ffi::OsStr]) -> String {
    let run = Command::new(exe)
        .args(args)
        .env("KILN_PLUGIN_PATH", "")
        // cargo's own library path for tests may hold an older copy of the library.
        .env("LD_LIBRARY_PATH", lib)
        .output()
        .unwrap();
    let out = String::from_utf8_lossy(&run.stdout).into_owned();
    println!("{out}{}", String::from_utf8_lossy(&run.stderr));
    assert!(run.status.success(), "{} failed", exe.display());
    out
}
