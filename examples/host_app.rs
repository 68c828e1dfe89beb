//! A host application embedding kiln: it builds the backend registry (built-ins plus
//! plugins), lists every backend and its verdict on the model, loads the model on the
//! backend it was asked for (or the best-scoring one), and streams a greedy generation.
//!
//! ```sh
//! cargo build --release -p naive-cpu-plugin
//! cargo run --release --example host_app -- \
//!     --plugin target/release/libnaive_cpu_plugin.so --backend naive-cpu "The capital of France is"
//! ```
//!
//! Options: `--model PATH` (default: SmolLM2-135M-Instruct, fetched on first use),
//! `--backend NAME`, `--plugin PATH` (repeatable; `KILN_PLUGIN_PATH` and `plugins/` beside
//! the executable are searched too), `-n TOKENS`. The remaining argument is the prompt.

use std::io::Write;
use std::path::PathBuf;

use kiln::core::{Error, LoadOptions, Result, SamplingParams};
use kiln::{registry_with_plugins, Engine, GenerateParams, Model};

struct Args {
    model: Option<PathBuf>,
    backend: Option<String>,
    plugins: Vec<PathBuf>,
    max_tokens: usize,
    prompt: String,
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        model: None,
        backend: None,
        plugins: Vec::new(),
        max_tokens: 32,
        prompt: String::new(),
    };
    let mut it = std::env::args().skip(1);
    let mut prompt = Vec::new();
    while let Some(a) = it.next() {
        let mut value = |flag: &str| {
            it.next()
                .ok_or_else(|| Error::InvalidArgument(format!("{flag} needs a value")))
        };
        match a.as_str() {
            "--model" | "-m" => args.model = Some(value(&a)?.into()),
            "--backend" => args.backend = Some(value(&a)?),
            "--plugin" => args.plugins.push(value(&a)?.into()),
            "-n" => {
                let v = value(&a)?;
                args.max_tokens = v
                    .parse()
                    .map_err(|_| Error::InvalidArgument(format!("-n {v}: not a number")))?;
            }
            _ => prompt.push(a),
        }
    }
    args.prompt = if prompt.is_empty() {
        "The capital of France is".into()
    } else {
        prompt.join(" ")
    };
    Ok(args)
}

fn main() {
    if let Err(e) = run() {
        eprintln!("host_app: {e}");
        std::process::exit(1);
    }
}

fn run() -> Result<()> {
    let args = parse_args()?;

    // 1. The registry: built-in backends plus every plugin found. A broken plugin is a
    //    warning, never a failure of the host.
    let (registry, plugin_errors) = registry_with_plugins(&args.plugins);
    for e in &plugin_errors {
        eprintln!("warning: {e}");
    }
    println!("backends:");
    for b in registry.backends() {
        let device = b
            .probe()
            .unwrap_or_else(|why| format!("unavailable: {why}"));
        println!(
            "  {:<12} {device}\n  {:<12} {}",
            b.name(),
            "",
            b.description()
        );
    }

    // 2. The model, and what each backend thinks of it.
    let path = match args.model {
        Some(p) => p,
        None => kiln::fetch::ensure_default_model(false)?,
    };
    let model = Model::open(&path)?;
    println!("\n{}:", path.display());
    for c in registry.rank(&model.ir) {
        match (c.score(), c.refusal()) {
            (Some(score), _) => println!("  {:<12} score {score}", c.name),
            (None, why) => println!("  {:<12} no: {}", c.name, why.unwrap_or_default()),
        }
    }
    let tokenizer = &model.tokenizer;
    let prompt = tokenizer.encode(&args.prompt, tokenizer.add_bos_default(), true)?;

    // 3. Load on the chosen backend and generate greedily, streaming the text.
    let mut engine = Engine::load(
        model,
        &registry,
        args.backend.as_deref(),
        &LoadOptions::default(),
    )?;
    println!("\nrunning on {}:\n", engine.backend_name());
    let params = GenerateParams {
        max_tokens: args.max_tokens,
        sampling: SamplingParams::greedy(),
        ..GenerateParams::default()
    };
    print!("{}", args.prompt);
    let mut session = engine.session()?;
    let generation = session.generate(&prompt, &params, |piece| {
        print!("{piece}");
        let _ = std::io::stdout().flush();
    })?;
    println!(
        "\n\n{} tokens at {:.1} tok/s ({})",
        generation.ids.len(),
        generation.decode_tokens_per_sec(),
        generation.finish.as_str()
    );
    Ok(())
}
