//! # kiln-tests
//!
//! End-to-end tests across kiln's crates (real model vs. independent references, CLI,
//! plugins). This library holds what those tests share: finding the real model and the
//! committed fixtures, loading the CPU oracle, and reporting a skip so it is seen.

use std::io::Write;
use std::path::PathBuf;

pub mod transformers_reference;

/// File name of the default model in kiln's cache.
pub const SMOLLM2_FILE: &str = "SmolLM2-135M-Instruct.Q4_1.gguf";

/// The real SmolLM2 file: `$KILN_TEST_MODEL`, else kiln's model cache (where `kiln run`
/// and `scripts/test.sh` put it).
pub fn smollm2_path() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KILN_TEST_MODEL") {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    let p = kiln::fetch::default_model_path();
    p.is_file().then_some(p)
}

/// Reports a skipped test on the real stderr (libtest captures `println!`, so a plain print
/// would vanish from a passing test's output).
pub fn skip(test: &str, reason: &str) {
    let _ = writeln!(std::io::stderr().lock(), "{test}: skipped: {reason}");
}

/// The real model, or a visible skip.
pub fn smollm2_or_skip(test: &str) -> Option<PathBuf> {
    let p = smollm2_path();
    if p.is_none() {
        skip(
            test,
            &format!(
                "{SMOLLM2_FILE} not found (set KILN_TEST_MODEL or run `kiln run` once to fetch it)"
            ),
        );
    }
    p
}

/// The real Gemma 3 270M file: `$KILN_GEMMA3_MODEL`, else kiln's model cache (where
/// `kiln run -m gemma3-270m` and `scripts/test.sh` put it); or a visible skip.
pub fn gemma3_or_skip(test: &str) -> Option<PathBuf> {
    let path = match std::env::var_os("KILN_GEMMA3_MODEL") {
        Some(p) => PathBuf::from(p),
        None => kiln::fetch::model_path(&kiln::fetch::GEMMA3_270M),
    };
    if path.is_file() {
        return Some(path);
    }
    skip(
        test,
        &format!(
            "{} not found (run `kiln run -m gemma3-270m` once, or set KILN_GEMMA3_MODEL)",
            path.display()
        ),
    );
    None
}

/// A committed fixture file under tests/fixtures.
pub fn fixture(rel: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(rel)
}

/// Cosine similarity of two vectors, accumulated in f64.
pub fn cosine(a: &[f32], b: &[f32]) -> f64 {
    let (mut ab, mut aa, mut bb) = (0f64, 0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        ab += x as f64 * y as f64;
        aa += x as f64 * x as f64;
        bb += y as f64 * y as f64;
    }
    ab / (aa.sqrt() * bb.sqrt())
}

/// The `kiln` binary of the profile these tests were built with, building it if needed.
pub fn kiln_binary() -> PathBuf {
    // Integration tests run from target/<profile>/deps/.
    let exe = std::env::current_exe().expect("test executable path");
    let profile_dir = exe
        .parent()
        .and_then(|d| d.parent())
        .expect("target/<profile>/deps")
        .to_path_buf();
    let bin = profile_dir.join("kiln");
    if !bin.is_file() {
        let release = profile_dir.file_name().is_some_and(|n| n == "release");
        let mut cmd = std::process::Command::new(env!("CARGO"));
        cmd.args(["build", "--bin", "kiln"])
            .current_dir(concat!(env!("CARGO_MANIFEST_DIR"), "/.."));
        if release {
            cmd.arg("--release");
        }
        let status = cmd.status().expect("run cargo");
        assert!(status.success(), "building the kiln binary failed");
    }
    bin
}

/// The model at `path` loaded through the host library on the CPU backend, with no
/// plugin failing to load.
pub fn cpu_engine(path: &std::path::Path, options: &kiln_core::LoadOptions) -> kiln::Engine {
    let (registry, errors) = kiln::registry_with_plugins(&[]);
    assert!(errors.is_empty(), "{errors:?}");
    kiln::Engine::load(
        kiln::Model::open(path).unwrap(),
        &registry,
        Some("cpu"),
        options,
    )
    .unwrap()
}

/// The CPU oracle (the built-in `cpu` backend) loaded for `model` with room for
/// `max_context` positions: what the reference tests compare against their fixtures.
pub fn cpu_executor(
    model: &kiln_core::ModelIr,
    max_context: usize,
) -> Box<dyn kiln_core::LayerExecutor> {
    kiln::link_builtin_backends();
    let backend = kiln_core::Registry::with_builtins()
        .get("cpu")
        .expect("cpu backend registered");
    backend
        .load(
            model,
            &kiln_core::LoadOptions {
                max_context,
                ..Default::default()
            },
        )
        .expect("the CPU backend loads the model")
}

/// The CPU oracle as its concrete executor, for `options`, tracing what its Mixture-of-
/// Experts routers choose (when the model has experts): see [`RoutingSlack`].
pub fn cpu_oracle(
    model: &kiln_core::ModelIr,
    options: &kiln_core::LoadOptions,
) -> kiln_backend_cpu::CpuExecutor {
    let mut exec = kiln_backend_cpu::CpuBackend
        .load_executor(model, options)
        .expect("the CPU backend loads the model");
    exec.trace_routing(model.config.experts.is_some());
    exec
}

/// How far a Mixture-of-Experts step may fall under a parity bar because the executors
/// chose different experts. A router picks each token's experts by its largest logits;
/// where the last chosen and the first left out lie within another executor's rounding
/// of each other (the margin: their difference over the range of the row's logits), that
/// executor may swap one expert, and the token's logits then move by up to ~1e-3 in
/// cosine a swapped layer (`moe::routing_swaps_on_a_random_moe_explain_the_step_cosines`
/// holds this on the CPU; its measurements are in docs/log/2026-11-to-12.md). So a step
/// gets `SWAP_COST` of slack for each layer whose margin for its token was under the tie
/// width of the path's rounding.
pub struct RoutingSlack {
    /// Layers at a near-tie for the compared row.
    pub near_ties: usize,
    /// The row's narrowest margin.
    pub margin: f32,
}

impl RoutingSlack {
    /// A margin under which 15-bit activations (the GPU GEMVs') may swap an expert: an
    /// estimate (logits at cosine 0.999999 differ by 1.4e-3 of their norm, a router's by
    /// ~3e-4 of its range) that the device runs check, each slack step printing its margin.
    pub const TIE_15_BIT: f32 = 2e-3;
    /// The same for 8-bit activations (the batched matmuls', the CPU's 8-bit path): about
    /// twice the widest margin the CPU's 8-bit path swapped at (the log), for hosts whose
    /// kernels round otherwise.
    pub const TIE_8_BIT: f32 = 5e-2;
    /// Cosine slack a near-tie layer.
    pub const SWAP_COST: f64 = 1e-3;

    /// The oracle's last pass, for its last row (the one whose logits are compared), at
    /// the tie width `tie`; `None` for a dense model or an oracle not tracing.
    pub fn of(oracle: &kiln_backend_cpu::CpuExecutor, tie: f32) -> Option<RoutingSlack> {
        let trace = oracle.routing()?;
        let row = trace.rows().checked_sub(1)?;
        (trace.layers() > 0).then(|| RoutingSlack {
            near_ties: trace.near_ties(row, tie),
            margin: trace.min_margin(row),
        })
    }

    /// The cosine slack.
    pub fn slack(&self) -> f64 {
        self.near_ties as f64 * Self::SWAP_COST
    }
}

/// A tiny random Llama (64 hidden, 2 layers, one KV head of `head_dim` values, Q8_0
/// weights) built in memory: for tests of what an executor makes of a shape (the GPU
/// executors' attention takes heads of a multiple of 32 values).
pub fn tiny_llama(head_dim: usize) -> kiln_core::ModelIr {
    use kiln_core::{Architecture, QType, RopeKind};
    let shape = kiln::conformance::models::Shape {
        arch: Architecture::Llama,
        hidden: 64,
        heads: 2,
        kv_heads: 1,
        head_dim,
        ffn: 128,
        vocab: 200,
        layers: 2,
        rope: RopeKind::Norm,
        qkv_bias: false,
        qk_norm: false,
        tied: true,
        types: [QType::Q8_0; 5],
        experts: None,
    };
    kiln::conformance::models::model(&mut kiln_core::Rng::new(3), &shape, 128)
}

/// The synthetic model `kiln synth` makes of `preset` in `recipe` with `seed`, at `path`:
/// written once (to a temporary name, then renamed, so a test that dies mid-write leaves
/// no half file behind) and reused by later tests; one writer at a time in a process.
pub fn synthetic_model(
    path: PathBuf,
    preset: kiln_formats::synth::Preset,
    recipe: kiln_formats::quantize::Recipe,
    seed: u64,
) -> PathBuf {
    static WRITING: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _guard = WRITING.lock().unwrap_or_else(|e| e.into_inner());
    if !path.is_file() {
        // The directory may not exist where the test binary runs (a build machine's target
        // directory, carried elsewhere).
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).expect("create the synthetic model's directory");
        }
        let partial = path.with_extension(format!("partial-{}", std::process::id()));
        kiln_formats::synth::synth_file(
            &partial,
            kiln_formats::synth::SynthOptions {
                preset,
                recipe,
                seed,
            },
            &kiln_formats::quantize::no_progress,
        )
        .expect("write the synthetic model");
        std::fs::rename(&partial, &path).expect("move the synthetic model into place");
    }
    path
}
