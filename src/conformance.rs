//! `kiln conformance`: the conformance suite ([`kiln_conformance`], re-exported here) run
//! from the command line on a built-in backend or a plugin, printing a report an author can
//! act on and failing when a rule is broken.
//!
//! ```sh
//! kiln conformance --plugin target/release/libmy_backend.so          # the plugin's backend
//! kiln conformance --backend cpu                                      # a built-in one
//! kiln conformance --plugin DIR --backend my-backend -m model.gguf    # pick one, real model
//! ```

use std::path::PathBuf;

pub use kiln_conformance::*;
use kiln_core::{Backend, Error, Result};

use crate::plugins::PluginBackend;
use crate::{registry_with_plugins, Model};

/// Prompts of the real-model parity runs.
const REAL_PROMPTS: [&str; 3] = [
    "The capital of France is",
    "def fibonacci(n):\n    \"\"\"Return the n-th Fibonacci number.",
    "Once upon a time, in a",
];

#[derive(clap::Args, Debug, Clone)]
pub struct ConformanceArgs {
    /// Backend to check (`kiln backends` lists them); default: the backend of the one
    /// `--plugin` file given.
    #[arg(long)]
    pub backend: Option<String>,
    /// Load a backend plugin (a library file or a directory); repeatable.
    #[arg(long = "plugin")]
    pub plugins: Vec<PathBuf>,
    /// A real model for the parity rules too (default: SmolLM2-135M-Instruct if it is in
    /// kiln's cache; it is never downloaded for this).
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Run the synthetic models only, even if the default model is cached.
    #[arg(long)]
    pub no_real_model: bool,
    /// Teacher-forced decode steps per parity run.
    #[arg(long, default_value_t = 24)]
    pub steps: usize,
    /// Least cosine between a step's logits and the CPU oracle's.
    #[arg(long, default_value_t = 0.999)]
    pub min_cosine: f64,
    /// Oracle top-1/top-2 gap below which a differing greedy token is a near-tie, not a failure.
    #[arg(long, default_value_t = 0.05)]
    pub tie_gap: f32,
    /// Seed of the synthetic weights (default: fixed, so reports are reproducible).
    #[arg(long)]
    pub seed: Option<u64>,
    /// Threads for the backend and the oracle (default: all cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Load the backend with `quantized_activations` (8-bit activations: on the GPU backends
    /// instead of 15-bit ones, on the CPU backend instead of the oracle's f32).
    #[arg(long)]
    pub quantized_activations: bool,
    /// Print every rule and what it requires, then exit.
    #[arg(long)]
    pub list_rules: bool,
}

/// The backend the arguments name: `--backend NAME` from the built-ins and every plugin
/// found, or else the single `--plugin` file's. A plugin that does not load is an error
/// here, not a warning: it is the thing to be checked.
fn chosen_backend(args: &ConformanceArgs) -> Result<std::sync::Arc<dyn Backend>> {
    match (&args.backend, args.plugins.as_slice()) {
        (None, [one]) if !one.is_dir() => Ok(std::sync::Arc::new(PluginBackend::open(one)?)),
        (None, _) => Err(Error::InvalidArgument(
            "name the backend to check with --backend NAME, or give exactly one --plugin FILE"
                .into(),
        )),
        (Some(name), _) => {
            let (registry, errors) = registry_with_plugins(&args.plugins);
            for e in errors {
                let explicit = matches!(&e, Error::Plugin { path, .. }
                    if args.plugins.iter().any(|p| std::path::Path::new(path).starts_with(p)));
                if explicit {
                    return Err(e);
                }
                eprintln!("kiln: warning: {e}");
            }
            registry.get(name).ok_or_else(|| {
                let names: Vec<&str> = registry.backends().iter().map(|b| b.name()).collect();
                Error::NoBackend(format!(
                    "no backend named '{name}' (have: {})",
                    names.join(", ")
                ))
            })
        }
    }
}

/// The real model and its prompts, when one is given or the default one is cached.
fn real_model(args: &ConformanceArgs) -> Result<Option<RealModel>> {
    let path = match (&args.model, args.no_real_model) {
        (Some(p), _) => p.clone(),
        (None, true) => return Ok(None),
        (None, false) => {
            let p = crate::fetch::default_model_path();
            if !p.is_file() {
                eprintln!(
                    "kiln: note: {} is not cached; synthetic models only (give -m MODEL)",
                    p.display()
                );
                return Ok(None);
            }
            p
        }
    };
    real_model_from(&path).map(Some)
}

/// Opens `path` for the suite's real-model parity runs, with three prompts (prose, code,
/// a story) and the scoring rule's text (`kiln perplexity`'s built-in one) encoded by the
/// model's own tokenizer.
pub fn real_model_from(path: &std::path::Path) -> Result<RealModel> {
    let model = Model::open(path)?;
    let tok = &model.tokenizer;
    let prompts = REAL_PROMPTS
        .iter()
        .map(|t| tok.encode(t, tok.add_bos_default(), false))
        .collect::<Result<Vec<_>>>()?;
    let text = crate::perplexity::tokenize_text(tok, crate::perplexity::SHORT_TEXT.as_bytes())?;
    let name = path.file_name().map_or_else(
        || path.display().to_string(),
        |n| n.to_string_lossy().into_owned(),
    );
    Ok(RealModel {
        label: format!("{name} (real model)"),
        ir: model.ir.clone(),
        prompts,
        text,
    })
}

/// Runs the suite as the arguments say, prints the report, and fails when a rule is broken.
pub fn cmd_conformance(args: ConformanceArgs) -> Result<()> {
    if args.list_rules {
        for r in RULES {
            println!("{:<34} {}", r.name, r.requires);
        }
        return Ok(());
    }
    crate::link_builtin_backends();
    let backend = chosen_backend(&args)?;
    let defaults = Options::default();
    let options = Options {
        seed: args.seed.unwrap_or(defaults.seed),
        steps: args.steps,
        min_cosine: args.min_cosine,
        tie_gap: args.tie_gap,
        real_model: real_model(&args)?,
        threads: args.threads,
        quantized_activations: args.quantized_activations,
        ..defaults
    };
    let report = run(backend.as_ref(), &options);
    print!("{report}");
    if report.passed() {
        Ok(())
    } else {
        Err(Error::Backend {
            backend: report.backend.clone(),
            message: format!("fails conformance: {}", report.failed_rules().join(", ")),
        })
    }
}
