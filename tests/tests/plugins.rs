//! Backend plugins end to end: the example plugin built as a real `.so`, found by explicit
//! path, `KILN_PLUGIN_PATH` and the CLI; numerically checked against the built-in CPU
//! backend on a synthetic model and (when present) on SmolLM2; and one deliberately broken
//! plugin per refusal the loader promises, each of which must leave this process running.
//!
//! The plugins are built by the tests themselves with the `cargo` that runs them (a no-op
//! when fresh); the broken C plugins are compiled with `cc` from tests/plugins-fixtures/.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;
use std::time::Instant;

use kiln::conformance::{Options, RealModel};
use kiln::plugins::{
    discover_plugins, load_plugin, register_plugins, PluginBackend, PLUGIN_PATH_ENV,
};
use kiln_core::plugin_abi::{self, KilnPluginApi, UNWRITTEN_LOGITS};
use kiln_core::{
    Architecture, Backend, DecodeItem, Error, LayerExecutor, LayerWeights, LoadOptions,
    ModelConfig, ModelIr, ModelWeights, QType, Registry, RopeConfig, RopeKind, Sampler,
    SamplingParams, Support, TensorView,
};

// ---- building fixtures -------------------------------------------------------------

fn workspace_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("tests/ sits in the workspace")
        .to_path_buf()
}

/// The target directory this test binary was built into (`<target>/debug/deps/plugins-…`).
fn target_dir() -> PathBuf {
    if let Some(dir) = std::env::var_os("CARGO_TARGET_DIR") {
        let dir = PathBuf::from(dir);
        return if dir.is_absolute() {
            dir
        } else {
            workspace_root().join(dir)
        };
    }
    let exe = std::env::current_exe().expect("test executable path");
    exe.ancestors()
        .nth(3)
        .expect("<target>/<profile>/deps/<exe>")
        .to_path_buf()
}

/// A fresh scratch directory under the target dir.
fn scratch_dir(name: &str) -> PathBuf {
    let dir = target_dir()
        .join("plugin-tests")
        .join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn dylib_name(lib: &str) -> String {
    format!(
        "{}{lib}{}",
        std::env::consts::DLL_PREFIX,
        std::env::consts::DLL_SUFFIX
    )
}

/// The profile directory this test binary was built into (`debug`, `release`, ...).
fn profile_dir() -> String {
    let exe = std::env::current_exe().expect("test executable path");
    exe.ancestors()
        .nth(2)
        .and_then(|d| d.file_name())
        .expect("<target>/<profile>/deps")
        .to_string_lossy()
        .into_owned()
}

/// Runs `cargo build` with the profile of these tests (so a plugin is as optimised as the
/// built-in backend it is compared with, and a `--release` run reuses what it already
/// built) and returns `<target>/<profile dir>/<file>`.
fn cargo_build_file(args: &[&str], file: &str) -> PathBuf {
    static BUILD: Mutex<()> = Mutex::new(());
    let _one_at_a_time = BUILD.lock().unwrap_or_else(|p| p.into_inner());
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let dir = profile_dir();
    // `cargo test` builds with the `test` profile, whose output directory is `debug`.
    let profile = if dir == "debug" {
        "test".to_string()
    } else {
        dir.clone()
    };
    let out = Command::new(cargo)
        .args(["build", "--profile", &profile])
        .args(args)
        .current_dir(workspace_root())
        .output()
        .expect("run cargo");
    assert!(
        out.status.success(),
        "cargo build {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let path = target_dir().join(dir).join(file);
    assert!(path.is_file(), "{} was not produced", path.display());
    path
}

/// Builds a workspace cdylib and returns the library's path.
fn cargo_build(package: &str, lib: &str) -> PathBuf {
    cargo_build_file(&["-p", package], &dylib_name(lib))
}

fn kiln_cli() -> PathBuf {
    cargo_build_file(
        &["-p", "kiln", "--bin", "kiln"],
        &format!("kiln{}", std::env::consts::EXE_SUFFIX),
    )
}

fn naive_plugin() -> PathBuf {
    static PATH: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut p = PATH.lock().unwrap_or_else(|p| p.into_inner());
    p.get_or_insert_with(|| cargo_build("naive-cpu-plugin", "naive_cpu_plugin"))
        .clone()
}

fn fixtures() -> PathBuf {
    workspace_root().join("tests/plugins-fixtures")
}

/// Compiles tests/plugins-fixtures/c_plugin.c with `-DFIXTURE_<variant>` into its own
/// library and returns its path.
fn c_plugin(variant: &str) -> PathBuf {
    let dir = scratch_dir(&format!("c-{variant}"));
    let out = dir.join(dylib_name(&format!("fixture_{}", variant.to_lowercase())));
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(cc)
        .args(["-shared", "-fPIC", "-O1"])
        .arg(format!("-DFIXTURE_{variant}"))
        .arg("-I")
        .arg(fixtures())
        .arg("-o")
        .arg(&out)
        .arg(fixtures().join("c_plugin.c"))
        .status()
        .expect("run cc (a C compiler is needed to build the broken plugins)");
    assert!(status.success(), "compiling the {variant} fixture failed");
    out
}

// ---- a small model of real shape ------------------------------------------------------

/// Deterministic pseudo-random values in [-scale, scale).
fn values(seed: u64, n: usize, scale: f32) -> Vec<f32> {
    let mut rng = kiln_core::Rng::new(seed);
    (0..n)
        .map(|_| (rng.next_f32() * 2.0 - 1.0) * scale)
        .collect()
}

fn tensor(name: &str, qtype: QType, dims: Vec<usize>, seed: u64, scale: f32) -> TensorView {
    let n: usize = dims.iter().product();
    let v = values(seed, n, scale);
    let mut bytes = vec![0u8; qtype.tensor_bytes(&dims).unwrap()];
    kiln_core::quant::quantize(qtype, &v, &mut bytes).unwrap();
    TensorView::from_bytes(name, qtype, dims, bytes).unwrap()
}

fn ones_ish(name: &str, n: usize, seed: u64) -> TensorView {
    let v: Vec<f32> = values(seed, n, 0.1).into_iter().map(|x| 1.0 + x).collect();
    TensorView::from_f32(name, vec![n], &v).unwrap()
}

/// A two-layer llama-shaped model (GQA, SwiGLU, NORM rope, untied head) with quantised
/// matrices: enough to exercise every step of a decoder in milliseconds.
fn tiny_llama(source: &str, matrix: QType) -> ModelIr {
    let (hidden, heads, kv_heads, head_dim, ffn, vocab, layers) = (64, 4, 2, 16, 128, 96, 2);
    let config = ModelConfig {
        vocab_size: vocab,
        hidden_size: hidden,
        num_layers: layers,
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim,
        ffn_size: ffn,
        rope: RopeConfig {
            rotary_dims: head_dim,
            ..RopeConfig::default()
        },
        context_length: 64,
        ..ModelConfig::default()
    };
    let layer = |i: usize| {
        let s = 100 * (i as u64 + 1);
        LayerWeights {
            attn_norm: ones_ish(&format!("blk.{i}.attn_norm"), hidden, s),
            attn_norm_bias: None,
            attn_q: tensor(
                &format!("blk.{i}.attn_q"),
                matrix,
                vec![hidden, heads * head_dim],
                s + 1,
                0.2,
            ),
            attn_k: tensor(
                &format!("blk.{i}.attn_k"),
                matrix,
                vec![hidden, kv_heads * head_dim],
                s + 2,
                0.2,
            ),
            attn_v: tensor(
                &format!("blk.{i}.attn_v"),
                matrix,
                vec![hidden, kv_heads * head_dim],
                s + 3,
                0.2,
            ),
            attn_q_bias: None,
            attn_k_bias: None,
            attn_v_bias: None,
            attn_q_norm: None,
            attn_k_norm: None,
            attn_out: tensor(
                &format!("blk.{i}.attn_output"),
                matrix,
                vec![heads * head_dim, hidden],
                s + 4,
                0.2,
            ),
            attn_out_bias: None,
            attn_sinks: None,
            ffn_norm: Some(ones_ish(&format!("blk.{i}.ffn_norm"), hidden, s + 5)),
            ffn_norm_bias: None,
            ffn_gate: Some(tensor(
                &format!("blk.{i}.ffn_gate"),
                matrix,
                vec![hidden, ffn],
                s + 6,
                0.2,
            )),
            ffn_up: Some(tensor(
                &format!("blk.{i}.ffn_up"),
                matrix,
                vec![hidden, ffn],
                s + 7,
                0.2,
            )),
            ffn_down: Some(tensor(
                &format!("blk.{i}.ffn_down"),
                matrix,
                vec![ffn, hidden],
                s + 8,
                0.2,
            )),
            experts: None,
            attn_post_norm: None,
            ffn_post_norm: None,
        }
    };
    ModelIr {
        config,
        weights: ModelWeights {
            token_embd: tensor("token_embd", QType::Q8_0, vec![hidden, vocab], 1, 1.0),
            layers: (0..layers).map(layer).collect(),
            output_norm: ones_ish("output_norm", hidden, 2),
            output_norm_bias: None,
            output: Some(tensor("output", matrix, vec![hidden, vocab], 3, 0.5)),
            rope_freqs: None,
        },
        source: source.into(),
        program: None,
    }
}

/// `tiny_llama` shaped as Gemma 3: per-head Q/K norms, sandwich norms, a window of 4
/// positions on layer 0 (layer 1 global) with its own RoPE base, NEOX RoPE, a scaled
/// embedding and GELU. Only a program describes it to a plugin.
fn tiny_gemma3(matrix: QType) -> ModelIr {
    let mut model = tiny_llama("synthetic gemma3", matrix);
    let c = &mut model.config;
    c.arch = Architecture::Gemma3;
    c.activation = kiln_core::Activation::Gelu;
    c.rope.kind = RopeKind::Neox;
    c.rope.theta = 1e6;
    c.embedding_scale = (c.hidden_size as f32).sqrt();
    c.sliding_window = Some(kiln_core::SlidingWindow {
        window: 4,
        global_every: 2,
        local_theta: Some(1e4),
    });
    let (hd, h) = (c.head_dim, c.hidden_size);
    for (i, l) in model.weights.layers.iter_mut().enumerate() {
        let s = 1000 + 10 * i as u64;
        l.attn_q_norm = Some(ones_ish(&format!("blk.{i}.attn_q_norm"), hd, s));
        l.attn_k_norm = Some(ones_ish(&format!("blk.{i}.attn_k_norm"), hd, s + 1));
        l.attn_post_norm = Some(ones_ish(&format!("blk.{i}.post_attention_norm"), h, s + 2));
        l.ffn_post_norm = Some(ones_ish(&format!("blk.{i}.post_ffw_norm"), h, s + 3));
    }
    model
}

/// `tiny_llama` shaped as Granite 3: every multiplier away from 1.
fn tiny_granite(matrix: QType) -> ModelIr {
    let mut model = tiny_llama("synthetic granite", matrix);
    model.config.arch = Architecture::Granite(kiln_core::GraniteScales {
        residual: 0.5,
        attention: 0.09,
        logits: 4.0,
    });
    model.config.embedding_scale = 3.0;
    model
}

fn argmax(v: &[f32]) -> u32 {
    kiln_core::argmax(v)
}

/// Prefills `prompt` and decodes `steps` greedy tokens; returns the tokens and every
/// step's logits.
fn greedy(exec: &mut dyn LayerExecutor, prompt: &[u32], steps: usize) -> (Vec<u32>, Vec<Vec<f32>>) {
    let vocab = exec.config().vocab_size;
    let seq = exec.new_sequence().unwrap();
    let mut logits = vec![0.0f32; vocab];
    exec.prefill(seq, prompt, &mut logits).unwrap();
    let mut tokens = Vec::new();
    let mut all = vec![logits.clone()];
    for _ in 0..steps {
        let next = argmax(&logits);
        tokens.push(next);
        exec.decode(&[DecodeItem { seq, token: next }], &mut logits)
            .unwrap();
        all.push(logits.clone());
    }
    exec.free_sequence(seq).unwrap();
    (tokens, all)
}

fn assert_plugin_error(e: &Error, file: &Path, needles: &[&str]) {
    let Error::Plugin { path, message } = e else {
        panic!("expected a plugin error, got {e:?}")
    };
    let name = file.file_name().unwrap().to_string_lossy();
    assert!(
        path.contains(&*name),
        "error path {path:?} does not name {name}"
    );
    for n in needles {
        assert!(message.contains(n), "message {message:?} lacks {n:?}");
    }
}

// ---- the example plugin ------------------------------------------------------------

#[test]
fn c_header_matches_the_rust_layout() {
    // Compile the fixture as a program that prints its sizes (C's view of the ABI).
    let dir = scratch_dir("c-sizes");
    let main = dir.join("sizes.c");
    std::fs::write(
        &main,
        "#include <stdio.h>\n#include \"kiln_plugin.h\"\nint main(void){printf(\"%zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu %zu\",\
         sizeof(kiln_plugin_api),sizeof(kiln_backend_info),sizeof(kiln_support),sizeof(kiln_model_config),\
         sizeof(kiln_tensor_desc),sizeof(kiln_model_desc),sizeof(kiln_load_options),sizeof(kiln_executor_info),\
         sizeof(kiln_decode_item),sizeof(kiln_sampler_state),sizeof(kiln_norm_desc),sizeof(kiln_op_desc),\
         sizeof(kiln_branch_desc),sizeof(kiln_program_desc));return 0;}\n",
    )
    .unwrap();
    let exe = dir.join("sizes");
    let cc = std::env::var("CC").unwrap_or_else(|_| "cc".into());
    let status = Command::new(cc)
        .arg("-I")
        .arg(fixtures())
        .arg("-o")
        .arg(&exe)
        .arg(&main)
        .status()
        .expect("run cc");
    assert!(status.success());
    let out = String::from_utf8(Command::new(&exe).output().unwrap().stdout).unwrap();
    use std::mem::size_of;
    let rust = [
        size_of::<KilnPluginApi>(),
        size_of::<plugin_abi::KilnBackendInfo>(),
        size_of::<plugin_abi::KilnSupport>(),
        size_of::<plugin_abi::KilnModelConfig>(),
        size_of::<plugin_abi::KilnTensorDesc>(),
        size_of::<plugin_abi::KilnModelDesc>(),
        size_of::<plugin_abi::KilnLoadOptions>(),
        size_of::<plugin_abi::KilnExecutorInfo>(),
        size_of::<plugin_abi::KilnDecodeItem>(),
        size_of::<plugin_abi::KilnSamplerState>(),
        size_of::<plugin_abi::KilnNormDesc>(),
        size_of::<plugin_abi::KilnOpDesc>(),
        size_of::<plugin_abi::KilnBranchDesc>(),
        size_of::<plugin_abi::KilnProgramDesc>(),
    ]
    .map(|s| s.to_string())
    .join(" ");
    assert_eq!(
        out, rust,
        "C header sizes (left) differ from Rust's (right)"
    );
}

#[test]
fn example_plugin_loads_by_path_and_joins_selection() {
    let path = naive_plugin();
    let plugin = PluginBackend::open(&path).unwrap();
    assert_eq!(plugin.name(), "naive-cpu");
    assert_eq!(
        plugin.version(),
        env!("CARGO_PKG_VERSION"),
        "the SDK reports the plugin crate's version"
    );
    assert_eq!(
        plugin_abi::version_major(plugin.abi_version()),
        plugin_abi::ABI_MAJOR
    );
    assert!(
        plugin.description().contains("naive-cpu-plugin")
            || plugin.description().contains("naive_cpu_plugin")
    );
    assert!(plugin.qtypes().contains(&QType::Q4_1));
    assert!(plugin.probe().is_ok());

    kiln::link_builtin_backends();
    let mut registry = Registry::with_builtins();
    registry.register(load_plugin(&path).unwrap()).unwrap();
    assert!(registry.get("naive-cpu").is_some());

    let model = tiny_llama("synthetic llama", QType::Q4_1);
    let ranked = registry.rank(&model);
    let score = |name: &str| {
        ranked
            .iter()
            .find(|c| c.name == name)
            .and_then(|c| c.score())
    };
    assert_eq!(score("naive-cpu"), Some(5));
    assert_eq!(score("cpu"), Some(10));
    let (auto, _) = registry.select(&model, None).unwrap();
    assert_eq!(
        auto.name(),
        "cpu",
        "the built-in backend outscores the example"
    );
    let (named, _) = registry.select(&model, Some("naive-cpu")).unwrap();
    assert_eq!(named.name(), "naive-cpu");

    // A model only a program describes (a sliding window, as Gemma 3's) is offered to the
    // plugin, which gets the program with it (ABI 1.4); a plugin built before 1.4 is
    // neither offered it nor can load it, and says so by name.
    let mut windowed = model.clone();
    windowed.config.sliding_window = Some(kiln_core::SlidingWindow {
        window: 4,
        global_every: 2,
        local_theta: Some(1e4),
    });
    assert_eq!(plugin.supports(&windowed).score(), Some(5));
    let old = load_plugin(&c_plugin("V1_2")).unwrap();
    match old.supports(&windowed) {
        Support::No { reason } => assert!(
            reason.contains("plugin ABI 1.2 cannot describe sliding-window attention"),
            "{reason}"
        ),
        other => panic!("a 1.2 plugin was offered a model its ABI cannot describe: {other:?}"),
    }
    let err = old
        .load(&windowed, &LoadOptions::default())
        .err()
        .expect("refused");
    assert!(err.to_string().contains("cannot describe"), "{err}");

    // The ABI has no field for a KV cache type: asking for one is refused by name rather
    // than silently ignored.
    let with_kv_type = LoadOptions {
        kv_type: Some(kiln_core::KvType::F16),
        ..LoadOptions::default()
    };
    match plugin.load(&model, &with_kv_type) {
        Err(Error::Unsupported(m)) => assert!(m.contains("--kv-type f16"), "{m}"),
        Err(e) => panic!("wrong error: {e}"),
        Ok(_) => panic!("a plugin took a KV cache type the ABI cannot carry"),
    }
}

#[test]
fn example_plugin_matches_the_builtin_cpu_backend() {
    // The architectures beyond llama reach the plugin only as the host's program (ABI 1.4):
    // the plugin's code names none of them.
    let plugin = load_plugin(&naive_plugin()).unwrap();
    let models = [
        tiny_llama("synthetic llama", QType::Q4_1),
        tiny_llama("synthetic llama", QType::Q8_0),
        tiny_llama("synthetic llama", QType::F16),
        tiny_gemma3(QType::Q8_0),
        tiny_granite(QType::Q4_1),
    ];
    for model in models {
        let qtype = format!(
            "{} {}",
            model.config.arch.name(),
            model.weights.layers[0].attn_q.qtype()
        );
        let options = LoadOptions {
            max_sequences: 2,
            ..Default::default()
        };
        let mut builtin = kiln_backend_cpu::CpuBackend.load(&model, &options).unwrap();
        let mut through_abi = plugin.load(&model, &options).unwrap();
        assert_eq!(through_abi.max_sequences(), 2);
        assert_eq!(through_abi.max_context(), 64);
        let prompt = [3, 17, 42, 5, 77, 1];
        let (a, la) = greedy(builtin.as_mut(), &prompt, 12);
        let (b, lb) = greedy(through_abi.as_mut(), &prompt, 12);
        assert_eq!(a, b, "{qtype}: greedy tokens differ");
        for (x, y) in la.iter().flatten().zip(lb.iter().flatten()) {
            assert!(
                (x - y).abs() <= 1e-3 * (1.0 + x.abs()),
                "{qtype}: logits {x} vs {y}"
            );
        }
    }
}

/// ABI 1.3: the host calls a plugin's own `decode_sample` (tokens drawn inside the plugin,
/// only ids and generator states crossing), and a batch of seeded samplers draws exactly
/// what the host draws from the same plugin's logits — same tokens, same generator states
/// afterwards, repetition penalty included.
#[test]
fn a_plugins_decode_sample_draws_what_the_host_would() {
    let plugin = load_plugin(&naive_plugin()).unwrap();
    let model = tiny_llama("synthetic llama", QType::Q8_0);
    let options = LoadOptions {
        max_sequences: 3,
        ..Default::default()
    };
    let vocab = model.config.vocab_size;
    let params = |i: u64| SamplingParams {
        temperature: 0.9,
        top_k: 20,
        top_p: 0.9,
        min_p: 0.02,
        repeat_penalty: if i == 1 { 1.3 } else { 1.0 },
        repeat_last_n: 8,
        seed: 77 + i,
        logit_bias: Vec::new(),
    };
    let run = |in_plugin: bool| -> (Vec<Vec<u32>>, Vec<u64>) {
        let mut exec = plugin.load(&model, &options).unwrap();
        let mut logits = vec![0.0; vocab];
        let mut seqs = Vec::new();
        let mut samplers: Vec<Sampler> = (0..3).map(|i| Sampler::new(params(i))).collect();
        let mut last = Vec::new();
        for (i, s) in samplers.iter_mut().enumerate() {
            let seq = exec.new_sequence().unwrap();
            exec.prefill(seq, &[3, 9 + i as u32, 40], &mut logits)
                .unwrap();
            last.push(s.sample(&mut logits));
            seqs.push(seq);
        }
        let mut out = vec![Vec::new(); 3];
        for _ in 0..10 {
            let items: Vec<DecodeItem> = seqs
                .iter()
                .zip(&last)
                .map(|(&seq, &token)| DecodeItem { seq, token })
                .collect();
            let mut next = vec![0u32; 3];
            if in_plugin {
                exec.decode_sample(&items, &mut samplers, &mut next)
                    .unwrap();
            } else {
                let mut rows = vec![0.0; 3 * vocab];
                exec.decode(&items, &mut rows).unwrap();
                for ((row, s), t) in rows
                    .chunks_mut(vocab)
                    .zip(samplers.iter_mut())
                    .zip(next.iter_mut())
                {
                    *t = s.sample(row);
                }
            }
            for (o, &t) in out.iter_mut().zip(&next) {
                o.push(t);
            }
            last = next;
        }
        (out, samplers.iter().map(|s| s.rng.state()).collect())
    };
    let (host_tokens, host_states) = run(false);
    let (plugin_tokens, plugin_states) = run(true);
    assert_eq!(
        plugin_tokens, host_tokens,
        "the plugin's draws differ from the host's"
    );
    assert_eq!(
        plugin_states, host_states,
        "the generators did not advance alike"
    );
    println!(
        "decode_sample through ABI {}: 3 seeded samplers × 10 steps, identical to host sampling",
        kiln_core::plugin_abi::version_string(kiln_core::plugin_abi::ABI_VERSION)
    );
}

#[test]
fn plugin_executor_sequences_batches_and_errors_cross_the_boundary() {
    let plugin = load_plugin(&naive_plugin()).unwrap();
    let model = tiny_llama("synthetic llama", QType::Q8_0);
    let mut exec = plugin
        .load(
            &model,
            &LoadOptions {
                max_sequences: 2,
                max_context: 16,
                ..Default::default()
            },
        )
        .unwrap();
    let vocab = model.config.vocab_size;
    let (s0, s1) = (exec.new_sequence().unwrap(), exec.new_sequence().unwrap());
    assert_ne!(s0, s1);
    // A third sequence does not fit: the plugin's InvalidArgument arrives as one.
    assert!(matches!(
        exec.new_sequence(),
        Err(Error::InvalidArgument(_))
    ));

    let mut l0 = vec![0.0; vocab];
    let mut l1 = vec![0.0; vocab];
    exec.prefill(s0, &[1, 2, 3], &mut l0).unwrap();
    exec.prefill(s1, &[4, 5], &mut l1).unwrap();
    assert_eq!(
        (
            exec.sequence_len(s0).unwrap(),
            exec.sequence_len(s1).unwrap()
        ),
        (3, 2)
    );

    // A batch of two equals the two single steps.
    let mut batch_logits = vec![0.0; 2 * vocab];
    exec.decode(
        &[
            DecodeItem { seq: s0, token: 9 },
            DecodeItem { seq: s1, token: 8 },
        ],
        &mut batch_logits,
    )
    .unwrap();
    exec.truncate_sequence(s0, 3).unwrap();
    exec.truncate_sequence(s1, 2).unwrap();
    let mut single = vec![0.0; vocab];
    exec.decode(&[DecodeItem { seq: s0, token: 9 }], &mut single)
        .unwrap();
    assert_eq!(&batch_logits[..vocab], &single[..]);
    exec.decode(&[DecodeItem { seq: s1, token: 8 }], &mut single)
        .unwrap();
    assert_eq!(&batch_logits[vocab..], &single[..]);

    // Errors keep their kind across the ABI, and the executor stays usable after them.
    let dup = [
        DecodeItem { seq: s0, token: 1 },
        DecodeItem { seq: s0, token: 2 },
    ];
    assert!(
        matches!(exec.decode(&dup, &mut batch_logits), Err(Error::InvalidArgument(m)) if m.contains("twice"))
    );
    assert!(
        matches!(exec.prefill(s0, &[vocab as u32], &mut l0), Err(Error::InvalidArgument(m)) if m.contains("vocabulary"))
    );
    assert!(matches!(
        exec.sequence_len(7),
        Err(Error::InvalidArgument(_))
    ));
    assert!(
        matches!(exec.prefill(s0, &[1; 20], &mut l0), Err(Error::InvalidArgument(m)) if m.contains("context"))
    );
    exec.free_sequence(s1).unwrap();
    assert!(exec.sequence_len(s1).is_err());
    assert_eq!(exec.sequence_len(s0).unwrap(), 4);
    exec.decode(&[DecodeItem { seq: s0, token: 2 }], &mut single)
        .unwrap();
}

#[test]
fn plugins_are_discovered_from_the_plugin_path_and_explicit_paths() {
    // This is the only test that touches KILN_PLUGIN_PATH, so no other reads it meanwhile.
    let dir = scratch_dir("plugin-path");
    let lib = dir.join(dylib_name("naive_cpu_copy"));
    std::fs::copy(naive_plugin(), &lib).unwrap();
    std::fs::write(
        dir.join("README.txt"),
        "not a plugin, and not named like one",
    )
    .unwrap();
    let empty = scratch_dir("plugin-path-empty");
    std::env::set_var(
        PLUGIN_PATH_ENV,
        std::env::join_paths([&empty, &dir, &dir.join("absent")]).unwrap(),
    );
    let (found, errors) = discover_plugins(&[]);
    std::env::remove_var(PLUGIN_PATH_ENV);
    assert!(errors.is_empty(), "{errors:?}");
    let names: Vec<&str> = found.iter().map(|b| b.name()).collect();
    assert_eq!(names, ["naive-cpu"]);
    // An entry may name the library file itself (whatever its extension), not only a
    // directory.
    let renamed = empty.join("naive-cpu.plugin");
    std::fs::copy(naive_plugin(), &renamed).unwrap();
    std::env::set_var(
        PLUGIN_PATH_ENV,
        std::env::join_paths([&renamed, &dir.join("absent.so")]).unwrap(),
    );
    let (found, errors) = discover_plugins(&[]);
    std::env::remove_var(PLUGIN_PATH_ENV);
    assert!(errors.is_empty(), "{errors:?}");
    let names: Vec<&str> = found.iter().map(|b| b.name()).collect();
    assert_eq!(
        names,
        ["naive-cpu"],
        "a file in {PLUGIN_PATH_ENV} is loaded"
    );

    // Explicit: a file, the same file again (loaded once), a missing file, a broken one.
    let broken = c_plugin("ABI_MAJOR");
    let missing = dir.join("missing.so");
    let (found, errors) =
        discover_plugins(&[naive_plugin(), lib.clone(), missing.clone(), broken.clone()]);
    let names: Vec<&str> = found.iter().map(|b| b.name()).collect();
    assert_eq!(
        names,
        ["naive-cpu"],
        "a copy of the same plugin is refused by name, not loaded twice"
    );
    assert_eq!(errors.len(), 3, "{errors:?}");
    let about = |file: &Path| {
        let name = file.file_name().unwrap().to_string_lossy().into_owned();
        errors
            .iter()
            .find(|e| matches!(e, Error::Plugin { path, .. } if path.ends_with(&name)))
            .unwrap()
    };
    assert_plugin_error(
        about(&lib),
        &lib,
        &["already provides a backend named 'naive-cpu'"],
    );
    assert_plugin_error(about(&missing), &missing, &["no such file"]);
    assert_plugin_error(
        about(&broken),
        &broken,
        &["2.3", &plugin_abi::version_string(plugin_abi::ABI_VERSION)],
    );

    // Registration refuses a plugin shadowing a backend already in the registry.
    let mut registry = Registry::new();
    registry
        .register(load_plugin(&naive_plugin()).unwrap())
        .unwrap();
    let errors = register_plugins(&mut registry, &[naive_plugin()]);
    assert_eq!(errors.len(), 1);
    assert_plugin_error(&errors[0], &naive_plugin(), &["already registered"]);
}

#[test]
fn the_cli_lists_plugins_and_survives_broken_ones() {
    let kiln = kiln_cli();
    let plugin = naive_plugin();
    let listing = |cmd: &mut Command| {
        let out = cmd.output().unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        (
            String::from_utf8(out.stdout).unwrap(),
            String::from_utf8(out.stderr).unwrap(),
        )
    };

    let (stdout, _) = listing(
        Command::new(&kiln)
            .arg("backends")
            .arg("--plugin")
            .arg(&plugin)
            .env_remove(PLUGIN_PATH_ENV),
    );
    assert!(
        stdout.contains("naive-cpu") && stdout.contains("available"),
        "{stdout}"
    );
    assert!(
        stdout.contains("cpu "),
        "built-ins are still listed:\n{stdout}"
    );
    assert!(
        stdout.contains("architectures: decided per model"),
        "{stdout}"
    );
    // A plugin that declares its architectures has them listed.
    let panicky = cargo_build("kiln-fixture-panicky-plugin", "kiln_fixture_panicky_plugin");
    let (stdout, _) = listing(
        Command::new(&kiln)
            .arg("backends")
            .arg("--plugin")
            .arg(&panicky)
            .env_remove(PLUGIN_PATH_ENV),
    );
    assert!(
        stdout
            .lines()
            .any(|l| l.contains("panicky") && l.contains("architectures: llama")),
        "{stdout}"
    );

    let dir = scratch_dir("cli-plugin-path");
    std::fs::copy(&plugin, dir.join(dylib_name("naive_cpu_plugin"))).unwrap();
    let (stdout, _) = listing(
        Command::new(&kiln)
            .arg("backends")
            .env(PLUGIN_PATH_ENV, &dir),
    );
    assert!(stdout.contains("naive-cpu"), "{stdout}");

    let broken = c_plugin("TOO_SMALL");
    let (stdout, stderr) = listing(
        Command::new(&kiln)
            .arg("backends")
            .arg("--plugin")
            .arg(&broken)
            .env_remove(PLUGIN_PATH_ENV),
    );
    assert!(
        stderr.contains(&*broken.file_name().unwrap().to_string_lossy())
            && stderr.contains("function table"),
        "{stderr}"
    );
    assert!(stdout.contains("cpu "), "{stdout}");

    let Some(model) = real_model_path() else {
        println!("skipped: SmolLM2 model not found, `kiln run --backend naive-cpu` not compared");
        return;
    };
    let run = |backend: &str| {
        let out = Command::new(&kiln)
            .args(["run", "-n", "12", "--temp", "0", "--backend", backend, "-m"])
            .arg(&model)
            .arg("--plugin")
            .arg(&plugin)
            .arg("The capital of France is")
            .env_remove(PLUGIN_PATH_ENV)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{backend}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    };
    let (cpu, naive) = (run("cpu"), run("naive-cpu"));
    assert!(!cpu.trim().is_empty());
    assert_eq!(
        cpu, naive,
        "`kiln run` output differs between cpu and the naive-cpu plugin"
    );
}

// ---- refusals ----------------------------------------------------------------------

#[test]
fn a_well_formed_c_plugin_loads() {
    let path = c_plugin("VALID");
    let b = load_plugin(&path).unwrap();
    assert_eq!(b.name(), "c-null");
    assert_eq!(b.qtypes(), [QType::F32, QType::F16, QType::Q8_0]);
    assert_eq!(b.probe().unwrap(), "nothing at all");
    let model = tiny_llama("synthetic llama", QType::Q8_0);
    assert_eq!(
        b.supports(&model),
        Support::No {
            reason: "c-null runs no model".into()
        }
    );
    assert!(
        matches!(b.load(&model, &LoadOptions::default()), Err(Error::Unsupported(m)) if m == "c-null runs no model")
    );
    // The host carries `quantized_activations` in the ABI 1.1 load flags; the fixture names
    // the flag in its refusal when it sees it.
    let quantized = LoadOptions {
        quantized_activations: true,
        ..Default::default()
    };
    assert!(
        matches!(b.load(&model, &quantized), Err(Error::Unsupported(m)) if m == "c-null runs no model, quantized or not")
    );
}

/// A plugin built against ABI 1.2 (its table ends before `decode_sample`) still loads: the
/// host reads only the entries the table declares and samples that plugin's logits itself.
#[test]
fn a_plugin_from_before_decode_sample_still_loads() {
    let path = c_plugin("V1_2");
    let b = load_plugin(&path).unwrap();
    assert_eq!(b.name(), "c-null");
    assert_eq!(b.probe().unwrap(), "nothing at all");
}

/// A FIFO (or any non-regular file) is refused before the loader could block on it.
#[cfg(unix)]
#[test]
fn a_fifo_is_not_opened_as_a_plugin() {
    let dir = scratch_dir("fifo");
    let path = dir.join(dylib_name("fifo"));
    let made = Command::new("mkfifo").arg(&path).status();
    if !made.is_ok_and(|s| s.success()) {
        kiln_tests::skip(
            "a_fifo_is_not_opened_as_a_plugin",
            "mkfifo is not available",
        );
        return;
    }
    assert_plugin_error(
        &load_plugin(&path).err().unwrap(),
        &path,
        &["not a regular file"],
    );
}

#[test]
fn not_a_shared_library_is_refused() {
    let dir = scratch_dir("garbage");
    let path = dir.join(dylib_name("garbage"));
    std::fs::write(&path, "this is text, not an ELF object").unwrap();
    assert_plugin_error(
        &load_plugin(&path).err().unwrap(),
        &path,
        &["not a loadable shared library"],
    );
}

#[test]
fn each_broken_c_plugin_is_refused_with_its_cause() {
    let host_version = format!(
        "ABI version {}",
        plugin_abi::version_string(plugin_abi::ABI_VERSION)
    );
    let cases: [(&str, &[&str]); 11] = [
        ("NO_ENTRY", &["no entry symbol `kiln_plugin_entry`"]),
        ("DATA_ENTRY", &["`kiln_plugin_entry` is not a function"]),
        ("NULL_TABLE", &["null function table"]),
        ("ABI_MAJOR", &["plugin ABI version 2.3", &host_version]),
        (
            "TOO_SMALL",
            &["function table is 32 bytes", "needs at least"],
        ),
        ("NULL_FN", &["`decode` is null"]),
        (
            "INIT_FAIL",
            &["initialisation failed", "no accelerator found"],
        ),
        ("DESCRIBE_FAIL", &["describe failed", "describe exploded"]),
        ("NULL_NAME", &["malformed data", "name is null or empty"]),
        ("NON_UTF8", &["malformed data", "name is not UTF-8"]),
        (
            "LONG_NAME",
            &["malformed data", "name is 100000 bytes long"],
        ),
    ];
    for (variant, needles) in cases {
        let path = c_plugin(variant);
        match load_plugin(&path) {
            Ok(b) => panic!("{variant}: loaded as {}", b.name()),
            Err(e) => assert_plugin_error(&e, &path, needles),
        }
    }
    let path = c_plugin("BAD_QTYPE");
    assert_plugin_error(
        &load_plugin(&path).err().unwrap(),
        &path,
        &["malformed data", "unknown qtype id 999"],
    );
}

#[test]
fn panics_inside_a_plugin_become_errors_and_the_host_survives() {
    let path = cargo_build("kiln-fixture-panicky-plugin", "kiln_fixture_panicky_plugin");
    // Initialisation: an error, then a panic, both refused (env read by the constructor;
    // only this test loads this library).
    std::env::set_var("KILN_FIXTURE_INIT", "fail");
    let failed = load_plugin(&path);
    std::env::set_var("KILN_FIXTURE_INIT", "panic");
    let panicked = load_plugin(&path);
    std::env::remove_var("KILN_FIXTURE_INIT");
    assert_plugin_error(
        &failed.err().unwrap(),
        &path,
        &["initialisation failed", "the fixture was told to fail"],
    );
    assert_plugin_error(
        &panicked.err().unwrap(),
        &path,
        &["initialisation failed", "the fixture was told to panic"],
    );

    let b = load_plugin(&path).unwrap();
    assert_eq!(b.name(), "panicky");
    assert!(
        b.description().contains("architectures: llama"),
        "{}",
        b.description()
    );
    let model = tiny_llama("synthetic llama", QType::Q8_0);
    // A panic in `supports` is a refusal with the panic's message, not an abort.
    match b.supports(&model) {
        Support::No { reason } => {
            assert!(
                reason.contains("panicked in supports") && reason.contains("supports exploded"),
                "{reason}"
            )
        }
        other => panic!("{other:?}"),
    }
    // The declared architecture list is enforced by the host without asking the plugin.
    let mut qwen = model.clone();
    qwen.config.arch = Architecture::Qwen2;
    assert!(
        matches!(b.supports(&qwen), Support::No { reason } if reason.contains("runs llama, not qwen2"))
    );

    let mut refused = model.clone();
    refused.source = "please refuse".into();
    assert!(matches!(
        b.load(&refused, &LoadOptions::default()),
        Err(Error::Unsupported(_))
    ));

    let mut exec = b.load(&model, &LoadOptions::default()).unwrap();
    let seq = exec.new_sequence().unwrap();
    let mut logits = vec![0.0; model.config.vocab_size];
    exec.prefill(seq, &[1, 2], &mut logits).unwrap();
    assert!(logits.iter().all(|&v| v == 0.5));
    // decode_sample crosses the boundary itself (ABI 1.3): its panic names it.
    let mut fresh = b.load(&model, &LoadOptions::default()).unwrap();
    let s0 = fresh.new_sequence().unwrap();
    fresh.prefill(s0, &[1], &mut logits).unwrap();
    let mut samplers = [Sampler::new(SamplingParams::greedy())];
    let e = fresh
        .decode_sample(&[DecodeItem { seq: s0, token: 1 }], &mut samplers, &mut [0])
        .unwrap_err();
    assert_plugin_error(
        &e,
        &path,
        &["panicked in decode_sample: decode_sample exploded with 1 samplers"],
    );
    drop(fresh);
    let e = exec
        .decode(&[DecodeItem { seq, token: 1 }], &mut logits)
        .unwrap_err();
    assert_plugin_error(
        &e,
        &path,
        &["panicked in decode: decode exploded at length 2"],
    );
    let Error::Plugin { message, .. } = &e else {
        unreachable!()
    };
    assert_eq!(
        message, "panicked in decode: decode exploded at length 2",
        "one clean message"
    );
    // The executor is poisoned: later calls fail instead of running on half-written state.
    let e = exec.prefill(seq, &[1], &mut logits).unwrap_err();
    assert!(
        e.to_string()
            .contains("unusable after an earlier panic in decode: decode exploded"),
        "{e}"
    );
    drop(exec);
    // The backend itself is fine.
    assert!(b.probe().is_ok());
}

// ---- the boundary guard and conformance -------------------------------------------------

fn broken_plugin() -> PathBuf {
    static PATH: Mutex<Option<PathBuf>> = Mutex::new(None);
    let mut p = PATH.lock().unwrap_or_else(|p| p.into_inner());
    p.get_or_insert_with(|| cargo_build("kiln-fixture-broken-plugin", "kiln_fixture_broken_plugin"))
        .clone()
}

#[test]
fn the_host_turns_unwritten_logits_into_an_error_naming_the_plugin_and_the_call() {
    let path = broken_plugin();
    let b = load_plugin(&path).unwrap();
    let vocab = 96;
    // The fixture writes only the first half of each row for a model so named.
    let half = tiny_llama(
        "synthetic llama kiln-fixture-fault=half_logits",
        QType::Q8_0,
    );
    let mut exec = b
        .load(
            &half,
            &LoadOptions {
                max_sequences: 2,
                ..Default::default()
            },
        )
        .unwrap();
    let seq = exec.new_sequence().unwrap();
    let mut logits = vec![0.0f32; vocab];
    let e = exec.prefill(seq, &[1, 2, 3], &mut logits).unwrap_err();
    let unwritten = format!("48 of 96 {UNWRITTEN_LOGITS} (first at index 48)");
    assert_plugin_error(
        &e,
        &path,
        &[
            &format!("backend '{}'", b.name()),
            "from prefill",
            &unwritten,
        ],
    );
    assert!(logits[..48].iter().all(|v| v.is_finite()) && logits[48..].iter().all(|v| v.is_nan()));
    let other = exec.new_sequence().unwrap();
    let mut rows = vec![0.0f32; 2 * vocab];
    let items = [
        DecodeItem { seq, token: 1 },
        DecodeItem {
            seq: other,
            token: 2,
        },
    ];
    let e = exec.decode(&items, &mut rows).unwrap_err();
    assert_plugin_error(
        &e,
        &path,
        &[
            "from decode",
            &format!("96 of 192 {UNWRITTEN_LOGITS}"),
            "row 0 column 48",
        ],
    );

    // The guard costs a correct plugin nothing: the same fixture without the fault.
    let whole = tiny_llama("synthetic llama", QType::Q8_0);
    let mut exec = b.load(&whole, &LoadOptions::default()).unwrap();
    let seq = exec.new_sequence().unwrap();
    exec.prefill(seq, &[1, 2, 3], &mut logits).unwrap();
    assert!(logits.iter().all(|v| v.is_finite()));
}

/// `kiln conformance` on `plugin` (synthetic models only) with `KILN_FIXTURE_FAULT=fault`:
/// (exit status success, stdout, stderr).
fn conformance_cli(plugin: &Path, fault: Option<&str>) -> (bool, String, String) {
    let mut cmd = Command::new(kiln_cli());
    cmd.args(["conformance", "--no-real-model", "--plugin"])
        .arg(plugin)
        .env_remove(PLUGIN_PATH_ENV);
    match fault {
        Some(f) => cmd.env("KILN_FIXTURE_FAULT", f),
        None => cmd.env_remove("KILN_FIXTURE_FAULT"),
    };
    let out = cmd.output().expect("run kiln conformance");
    (
        out.status.success(),
        String::from_utf8(out.stdout).unwrap(),
        String::from_utf8(out.stderr).unwrap(),
    )
}

#[test]
fn the_example_plugin_passes_conformance() {
    // Through the library, as an author's own test would call it (real model when present).
    let plugin = PluginBackend::open(&naive_plugin()).unwrap();
    let real_model: Option<RealModel> = real_model_path()
        .map(|p| kiln::conformance::real_model_from(&p).expect("the real model opens"));
    let with_real = real_model.is_some();
    let report = kiln::conformance::run(
        &plugin,
        &Options {
            real_model,
            ..Options::default()
        },
    );
    assert!(report.passed(), "{report}");
    assert!(
        report
            .findings
            .iter()
            .filter(|f| f.outcome == kiln::conformance::Outcome::Pass)
            .count()
            >= 70,
        "{report}"
    );
    if with_real {
        assert!(report
            .findings
            .iter()
            .any(|f| f.rule == "parity.greedy"
                && f.model.as_deref().is_some_and(|m| m.contains("real"))));
    }
    // Through the command line: a report and exit status 0.
    let (ok, stdout, stderr) = conformance_cli(&naive_plugin(), None);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("backend `naive-cpu`") && stdout.contains("result: PASS"),
        "{stdout}"
    );
}

#[test]
fn each_broken_plugin_fails_conformance_naming_the_rules_it_breaks() {
    let plugin = broken_plugin();
    // The control: the fixture without a fault passes.
    let (ok, stdout, stderr) = conformance_cli(&plugin, Some("none"));
    assert!(ok && stdout.contains("result: PASS"), "{stdout}\n{stderr}");
    let cases: [(&str, &[&str]); 6] = [
        ("half_logits", &["logits.all_written_and_finite"]),
        // truncate_sequence of an unknown id "succeeds" too.
        (
            "ignore_truncate",
            &[
                "truncate.keeps_prefix",
                "truncate.past_end_is_error",
                "errors.unknown_sequence",
            ],
        ),
        // Its prompt rows are as wrong as its decode steps, so scoring fails with them.
        (
            "wrong_logits",
            &["parity.cosine", "parity.greedy", "scoring.kl_divergence"],
        ),
        ("swapped_batch", &["batch.mixed_positions"]),
        (
            "untyped_errors",
            &[
                "lifecycle.new_free_reuse",
                "lifecycle.capacity_is_typed_error",
                "truncate.past_end_is_error",
                "context.limit_is_typed_error",
                "errors.unknown_sequence",
                "errors.empty_prompt",
                "errors.token_out_of_vocab",
                "errors.duplicate_in_batch",
            ],
        ),
        ("context_overflow", &["context.limit_is_typed_error"]),
    ];
    for (fault, rules) in cases {
        let (ok, stdout, stderr) = conformance_cli(&plugin, Some(fault));
        assert!(!ok, "{fault}: conformance passed\n{stdout}");
        // The report names each broken rule on a FAIL line, and exactly those in its verdict.
        for rule in rules {
            assert!(
                stdout.contains(&format!("FAIL  {rule}")),
                "{fault}: {rule} not reported failing\n{stdout}"
            );
        }
        let verdict = stderr
            .lines()
            .find(|l| l.contains("fails conformance: "))
            .unwrap_or_else(|| panic!("{fault}: {stderr}"));
        let named: Vec<&str> = verdict
            .split("fails conformance: ")
            .nth(1)
            .unwrap()
            .split(", ")
            .collect();
        assert_eq!(
            named, rules,
            "{fault}: the rules named in the verdict\n{stdout}"
        );
        assert!(verdict.contains(&format!("broken-{fault}")), "{verdict}");
    }
}

/// A plugin crate written outside the repository against the SDK as `cargo package` ships
/// it: the packaged `kiln-plugin-sdk` and `kiln-core` unpacked into a temporary directory,
/// nothing of the kiln workspace reachable. Its source is the example plugin's under another
/// name; it must build (offline, from the local crate cache) and pass `kiln conformance`.
#[test]
fn a_plugin_crate_outside_the_repository_builds_and_passes_conformance() {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let work = std::env::temp_dir().join(format!("kiln-out-of-tree-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&work);
    let (packaged, vendor, krate) = (
        work.join("package"),
        work.join("vendor"),
        work.join("my-backend"),
    );
    std::fs::create_dir_all(&vendor).unwrap();
    std::fs::create_dir_all(krate.join("src")).unwrap();

    // 1. The two crates, packaged (not verified here: building them below is the check).
    let out = Command::new(&cargo)
        .args([
            "package",
            "-p",
            "kiln-core",
            "-p",
            "kiln-plugin-sdk",
            "--no-verify",
            "--allow-dirty",
            "--offline",
        ])
        .arg("--target-dir")
        .arg(&packaged)
        .current_dir(workspace_root())
        .output()
        .expect("run cargo package");
    assert!(
        out.status.success(),
        "cargo package failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let version = env!("CARGO_PKG_VERSION");
    for name in ["kiln-core", "kiln-plugin-sdk"] {
        let file = packaged
            .join("package")
            .join(format!("{name}-{version}.crate"));
        let status = Command::new("tar")
            .arg("xzf")
            .arg(&file)
            .arg("-C")
            .arg(&vendor)
            .status()
            .expect("run tar");
        assert!(status.success(), "unpacking {}", file.display());
    }

    // 2. A new crate, as `cargo new --lib` and the guide make it.
    let sdk = vendor.join(format!("kiln-plugin-sdk-{version}"));
    let core = vendor.join(format!("kiln-core-{version}"));
    std::fs::write(
        krate.join("Cargo.toml"),
        format!(
            "[package]\nname = \"my-backend\"\nversion = \"0.3.0\"\nedition = \"2021\"\n\n\
             [lib]\ncrate-type = [\"cdylib\"]\n\n\
             [dependencies]\nkiln-plugin-sdk = {{ path = {sdk:?} }}\n\n\
             # The SDK's kiln-core dependency names a registry version; point it at the packaged crate.\n\
             [patch.crates-io]\nkiln-core = {{ path = {core:?} }}\n\n\
             [workspace]\n"
        ),
    )
    .unwrap();
    let example =
        std::fs::read_to_string(workspace_root().join("examples/naive-cpu-plugin/src/lib.rs"))
            .unwrap();
    assert!(example.contains("\"naive-cpu\""));
    std::fs::write(
        krate.join("src/lib.rs"),
        example.replace("\"naive-cpu\"", "\"out-of-tree\""),
    )
    .unwrap();
    // The workspace's lock file pins the same dependency versions (all in the local cache).
    std::fs::copy(
        workspace_root().join("Cargo.lock"),
        krate.join("Cargo.lock"),
    )
    .unwrap();

    // 3. Build it where nothing of the workspace is (its own target dir, kept between runs).
    let build = |offline: bool| {
        let mut cmd = Command::new(&cargo);
        cmd.args(["build", "--release"])
            .current_dir(&krate)
            .env("CARGO_TARGET_DIR", target_dir().join("out-of-tree"));
        if offline {
            cmd.arg("--offline");
        }
        cmd.output().expect("run cargo build")
    };
    let mut out = build(true);
    if !out.status.success() {
        println!(
            "offline build failed, trying online:\n{}",
            String::from_utf8_lossy(&out.stderr)
        );
        out = build(false);
    }
    assert!(
        out.status.success(),
        "building the out-of-tree plugin failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let lib = target_dir()
        .join("out-of-tree/release")
        .join(dylib_name("my_backend"));
    assert!(lib.is_file(), "{} was not produced", lib.display());

    // 4. It loads, and passes the suite.
    let (ok, stdout, stderr) = conformance_cli(&lib, None);
    assert!(ok, "{stdout}\n{stderr}");
    assert!(
        stdout.contains("backend `out-of-tree`")
            && stdout.contains("[plugin 0.3.0,")
            && stdout.contains("result: PASS"),
        "{stdout}"
    );
    let _ = std::fs::remove_dir_all(&work);
}

// ---- the real model ----------------------------------------------------------------

fn real_model_path() -> Option<PathBuf> {
    let candidates = [
        std::env::var_os("KILN_TEST_MODEL").map(PathBuf::from),
        dirs_home().map(|h| h.join(".cache/kiln/models/SmolLM2-135M-Instruct.Q4_1.gguf")),
    ];
    candidates.into_iter().flatten().find(|p| p.is_file())
}

fn dirs_home() -> Option<PathBuf> {
    std::env::var_os("HOME").map(PathBuf::from)
}

fn open_real_model() -> Option<ModelIr> {
    let Some(path) = real_model_path() else {
        println!("skipped: SmolLM2 model not found (set KILN_TEST_MODEL or run `kiln pull`)");
        return None;
    };
    let gguf = kiln_formats::gguf::GgufFile::open(&path).unwrap();
    Some(
        kiln_formats::model::model_from_gguf(&gguf, &format!("GGUF file {}", path.display()))
            .unwrap(),
    )
}

/// Prompt ids of the committed reference prompts (tests/fixtures/smollm2_reference).
fn reference_prompts() -> Vec<(String, Vec<u32>)> {
    let text = std::fs::read_to_string(
        workspace_root().join("tests/fixtures/smollm2_reference/reference.json"),
    )
    .unwrap();
    let json: serde_json::Value = serde_json::from_str(&text).unwrap();
    json["prompts"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let ids = p["prompt_ids"]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect();
            (p["name"].as_str().unwrap().to_string(), ids)
        })
        .collect()
}

#[test]
fn smollm2_greedy_tokens_match_the_builtin_cpu_backend() {
    let Some(model) = open_real_model() else {
        return;
    };
    let plugin = load_plugin(&naive_plugin()).unwrap();
    assert!(plugin.supports(&model).score().is_some());
    let options = LoadOptions {
        max_context: 256,
        ..Default::default()
    };
    let mut builtin = kiln_backend_cpu::CpuBackend.load(&model, &options).unwrap();
    let mut through_abi = plugin.load(&model, &options).unwrap();
    const STEPS: usize = 16;
    for (name, prompt) in reference_prompts() {
        let (a, _) = greedy(builtin.as_mut(), &prompt, STEPS);
        let (b, _) = greedy(through_abi.as_mut(), &prompt, STEPS);
        assert_eq!(
            a, b,
            "{name}: greedy tokens of cpu (left) and naive-cpu plugin (right) differ"
        );
        println!(
            "{name}: {} prompt tokens, {STEPS} greedy tokens identical: {a:?}",
            prompt.len()
        );
    }
}

/// The real Gemma 3 270M reaches the example plugin as the host's program (ABI 1.4): the
/// plugin names no architecture, yet its greedy tokens are the built-in CPU backend's on
/// the first prompt of the transformers fixture (tests/fixtures/gemma3).
#[test]
fn gemma3_runs_through_the_example_plugin() {
    let Some(path) = kiln_tests::gemma3_or_skip("gemma3_runs_through_the_example_plugin") else {
        return;
    };
    let gguf = kiln_formats::gguf::GgufFile::open(&path).unwrap();
    let model = kiln_formats::model::model_from_gguf(&gguf, "Gemma 3 270M").unwrap();
    let first = std::fs::read_to_string(kiln_tests::fixture("gemma3/hf_greedy.jsonl")).unwrap();
    let line: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    let prompt: Vec<u32> = line["prompt"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let plugin = load_plugin(&naive_plugin()).unwrap();
    assert!(plugin.supports(&model).score().is_some());
    let options = LoadOptions {
        max_context: 64,
        ..Default::default()
    };
    let mut builtin = kiln_backend_cpu::CpuBackend.load(&model, &options).unwrap();
    let mut through_abi = plugin.load(&model, &options).unwrap();
    const STEPS: usize = 8;
    let (a, _) = greedy(builtin.as_mut(), &prompt, STEPS);
    let (b, _) = greedy(through_abi.as_mut(), &prompt, STEPS);
    assert_eq!(
        a, b,
        "greedy tokens of cpu (left) and the naive-cpu plugin (right) differ"
    );
    println!("gemma3: {STEPS} greedy tokens identical through the plugin: {a:?}");
}

/// Decode speed of the same executor linked in and behind the plugin boundary, on the tiny
/// synthetic model (a step takes microseconds, so per-call overhead would show) and on
/// SmolLM2 when present. Run with
/// `cargo test -p kiln-tests --test plugins -- --ignored --nocapture plugin_overhead`.
#[test]
#[ignore = "benchmark; prints tokens/s"]
fn plugin_overhead() {
    let plugin = load_plugin(&naive_plugin()).unwrap();
    let mut cases = vec![(
        tiny_llama("synthetic 2-layer llama (Q4_1)", QType::Q4_1),
        4000,
    )];
    cases.extend(open_real_model().map(|m| (m, 48)));
    for (model, steps) in cases {
        let options = LoadOptions {
            max_context: steps + 16,
            ..Default::default()
        };
        let mut linked: Box<dyn LayerExecutor> =
            Box::new(naive_cpu_plugin::NaiveExecutor::load(&model, &options).unwrap());
        let mut through_abi = plugin.load(&model, &options).unwrap();
        let vocab = model.config.vocab_size;
        let run = |exec: &mut dyn LayerExecutor| -> f64 {
            let seq = exec.new_sequence().unwrap();
            let mut logits = vec![0.0; vocab];
            exec.prefill(seq, &[1, 2, 3, 4], &mut logits).unwrap();
            let t = Instant::now();
            for _ in 0..steps {
                let next = argmax(&logits);
                exec.decode(&[DecodeItem { seq, token: next }], &mut logits)
                    .unwrap();
            }
            let tps = steps as f64 / t.elapsed().as_secs_f64();
            exec.free_sequence(seq).unwrap();
            tps
        };
        // Interleave rounds and keep each side's best, so drift in machine load hits both.
        let (mut best_linked, mut best_plugin) = (0.0f64, 0.0f64);
        for _ in 0..7 {
            best_linked = best_linked.max(run(linked.as_mut()));
            best_plugin = best_plugin.max(run(through_abi.as_mut()));
        }
        let overhead = (best_linked / best_plugin - 1.0) * 100.0;
        println!(
            "plugin overhead, {} ({steps} decode steps, best of 7): linked {best_linked:.1} tok/s, \
             plugin {best_plugin:.1} tok/s, overhead {overhead:+.2}%",
            model.source
        );
        assert!(
            overhead < 2.0,
            "decode through the plugin costs {overhead:.2}% more"
        );
    }
}
