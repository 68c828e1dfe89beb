//! The `kiln` command line: run, chat, inspect, backends, tokenize, bench, serve.

use std::io::{BufRead, Write};
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Args, Parser, Subcommand, ValueEnum};
use kiln::bench::{
    bench_batched, bench_decode, bench_first_token, bench_prefill, bytes_per_decode_step,
};
use kiln::{registry_with_plugins, Engine, GenerateParams, Generation, Model};
use kiln_core::{Error, LoadOptions, Registry, Result, SamplingParams};
use kiln_formats::chat::ChatMessage;

#[derive(Parser)]
#[command(
    name = "kiln",
    version,
    about = "Run GGUF language models on pluggable compute backends"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate text from a prompt (streamed to stdout).
    Run(RunArgs),
    /// Talk with the model interactively; the conversation is kept.
    Chat(ChatArgs),
    /// Show a model file's metadata, tensor types and which backend would run it.
    Inspect {
        /// Model file (default: SmolLM2-135M-Instruct).
        model: Option<PathBuf>,
        #[command(flatten)]
        backend: BackendArgs,
    },
    /// List backends: available or why not, qtypes, and their verdict on a model.
    Backends {
        #[arg(short, long)]
        model: Option<PathBuf>,
        #[command(flatten)]
        backend: BackendArgs,
    },
    /// Show the token ids and pieces of a text: `kiln tokenize [MODEL] TEXT`.
    Tokenize {
        #[arg(num_args = 1..=2, required = true, value_names = ["MODEL", "TEXT"])]
        args: Vec<String>,
        /// Do not add the BOS token even if the model asks for it.
        #[arg(long)]
        no_bos: bool,
    },
    /// The embedding of each text (one JSON array of floats a line): its final hidden
    /// states pooled and L2-normalised.
    Embed(EmbedArgs),
    /// Measure prompt processing and generation speed (llama-bench style).
    Bench(BenchArgs),
    /// Perplexity of a text, and KL-divergence from a reference's saved logits
    /// (llama-perplexity's method and numbers).
    Perplexity(PerplexityArgs),
    /// Prepare a model's first run ahead of time: load it on its backend, which compiles
    /// and caches the GPU kernels it needs, then exit (e.g. in a container build).
    Warmup {
        #[command(flatten)]
        model: ModelArgs,
    },
    /// Requantise a GGUF model with a llama.cpp-compatible recipe (q4_k_m, q4_0, ...).
    Quantize(kiln::toolkit::QuantizeArgs),
    /// Write a random-weight model of a real model's shape (for benchmarks and tests).
    Synth(kiln::toolkit::SynthArgs),
    /// Convert between GGUF and APR v2 (`kiln convert in.gguf out.apr [--quantize int4]`).
    Convert(kiln::toolkit::ConvertArgs),
    /// Check a backend or plugin against the executor contract and the CPU oracle
    /// (`kiln conformance --plugin libmy_backend.so`); fails when a rule is broken.
    Conformance(kiln::conformance::ConformanceArgs),
    /// Serve the model over an OpenAI-compatible HTTP API (`/v1/chat/completions`, ...).
    Serve(kiln::server::ServeArgs),
}

#[derive(Args, Clone)]
struct BackendArgs {
    /// Backend to use (`kiln backends` lists them); default: the best-scoring one.
    #[arg(long)]
    backend: Option<String>,
    /// Load a backend plugin (.so); repeatable.
    #[arg(long = "plugin")]
    plugins: Vec<PathBuf>,
}

#[derive(Args)]
struct EmbedArgs {
    /// The texts to embed, one vector each.
    #[arg(required = true)]
    texts: Vec<String>,
    #[command(flatten)]
    model: ModelArgs,
    /// mean, cls or last (default: the file's `pooling_type`, else last: under causal
    /// attention the last token is the one that has seen the whole text).
    #[arg(long)]
    pooling: Option<String>,
    /// Leave the vectors as pooled instead of scaling them to unit length.
    #[arg(long)]
    no_normalize: bool,
    /// Texts embedded together, their rows packed into shared passes.
    #[arg(long, default_value_t = 16)]
    batch: usize,
}

#[derive(Args, Clone)]
struct ModelArgs {
    /// GGUF or APR model file, or the name of a model kiln fetches on first use:
    /// `smollm2-135m` (the default) or `gemma3-270m`.
    #[arg(short, long)]
    model: Option<PathBuf>,
    #[command(flatten)]
    backend: BackendArgs,
    /// Context length per sequence (default: the model's; on a GPU capped to what its KV cache fits in free memory, on the CPU backend at 4096).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    ctx_size: usize,
    /// CPU threads (default: all cores).
    #[arg(short, long)]
    threads: Option<usize>,
    /// Quantise activations to 8 bits for integer dot products: on a GPU (32-value blocks)
    /// instead of the default 15 bits, on the CPU instead of the f32 reference, as llama.cpp
    /// does (32-value blocks, 256 for K-quant weights; decode about 1.5–2× faster there,
    /// prompts slower). The output drifts from the f32 reference.
    #[arg(long)]
    quantized_activations: bool,
    /// How the KV cache stores keys and values: f32, f16 or q8_0 (default: the backend's,
    /// f32 on the CPU reference, f16 on the GPUs; a backend without the type says which it has).
    #[arg(long = "kv-type")]
    kv_type: Option<kiln_core::KvType>,
    /// Memory for the paged KV cache: one pool of 32-token blocks shared by all sequences,
    /// each taking blocks as it grows (e.g. 512MiB, 4G, 1500M, or bytes; units are powers
    /// of 1024). It must hold one sequence's whole context. Default: every sequence at the
    /// full context.
    #[arg(long = "kv-mem", value_name = "SIZE", value_parser = kiln::parse_size)]
    kv_mem: Option<u64>,
    /// Split the model's matrices over N ranks (tensor parallelism: attention by heads, the
    /// feed-forward by columns, the LM head by vocabulary). The cpu backend runs the ranks
    /// as threads; the GPU backends and plugins refuse N > 1.
    #[arg(long = "tensor-parallel", value_name = "N", default_value_t = 1)]
    tensor_parallel: usize,
}

#[derive(Args, Clone)]
struct SamplingArgs {
    /// Temperature; 0 is greedy.
    #[arg(long = "temp", default_value_t = 0.0)]
    temperature: f32,
    #[arg(long, default_value_t = 40)]
    top_k: usize,
    #[arg(long, default_value_t = 0.95)]
    top_p: f32,
    #[arg(long, default_value_t = 0.05)]
    min_p: f32,
    #[arg(long, default_value_t = 1.0)]
    repeat_penalty: f32,
    #[arg(long, default_value_t = 64)]
    repeat_last_n: usize,
    /// OpenAI's presence penalty (−2 to 2): less likely, once a token has been generated.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    presence_penalty: f32,
    /// OpenAI's frequency penalty (−2 to 2): less likely for each time a token has been
    /// generated.
    #[arg(long, default_value_t = 0.0, allow_hyphen_values = true)]
    frequency_penalty: f32,
    /// Random seed (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Stop when the output contains this string; repeatable.
    #[arg(long = "stop")]
    stop: Vec<String>,
    /// Constrain the output to JSON matching this JSON schema (e.g. '{"type": "object"}'
    /// for any object), as llama.cpp's --json-schema does.
    #[arg(
        short = 'j',
        long = "json-schema",
        value_name = "SCHEMA",
        conflicts_with = "json_schema_file"
    )]
    json_schema: Option<String>,
    /// Like --json-schema, with the schema read from a file.
    #[arg(long = "json-schema-file", value_name = "PATH")]
    json_schema_file: Option<PathBuf>,
}

/// A JSON schema is text of a few kilobytes; more than this (the server's request-body
/// limit) is refused rather than read, so `/dev/zero` or a model file given by mistake
/// ends in an error instead of filling memory.
const MAX_SCHEMA_BYTES: u64 = 4 << 20;

/// The text of `--json-schema-file PATH`, at most [`MAX_SCHEMA_BYTES`].
fn read_schema_file(path: &std::path::Path) -> Result<String> {
    use std::io::Read;
    let fail = |why: String| {
        Error::InvalidArgument(format!("--json-schema-file {}: {why}", path.display()))
    };
    let mut text = String::new();
    std::fs::File::open(path)
        .and_then(|f| f.take(MAX_SCHEMA_BYTES + 1).read_to_string(&mut text))
        .map_err(|e| fail(e.to_string()))?;
    if text.len() as u64 > MAX_SCHEMA_BYTES {
        return Err(fail(format!(
            "longer than {} MiB; a JSON schema is a few kilobytes",
            MAX_SCHEMA_BYTES >> 20
        )));
    }
    Ok(text)
}

impl SamplingArgs {
    /// The JSON schema of --json-schema / --json-schema-file, checked to be JSON.
    fn json_schema(&self) -> Result<Option<serde_json::Value>> {
        let (text, source) = match (&self.json_schema, &self.json_schema_file) {
            (Some(s), _) => (s.clone(), "--json-schema".to_string()),
            (None, Some(path)) => (
                read_schema_file(path)?,
                format!("--json-schema-file {}", path.display()),
            ),
            (None, None) => return Ok(None),
        };
        serde_json::from_str(&text)
            .map(Some)
            .map_err(|e| Error::InvalidArgument(format!("{source} is not JSON: {e}")))
    }

    fn params(&self, max_tokens: usize) -> Result<GenerateParams> {
        let seed = self.seed.unwrap_or_else(|| {
            std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_nanos() as u64)
        });
        Ok(GenerateParams {
            max_tokens,
            sampling: SamplingParams {
                temperature: self.temperature,
                top_k: self.top_k,
                top_p: self.top_p,
                min_p: self.min_p,
                repeat_penalty: self.repeat_penalty,
                repeat_last_n: self.repeat_last_n,
                seed,
                logit_bias: Vec::new(),
            },
            stop_strings: self.stop.clone(),
            stop_on_eos: true,
            json_schema: self.json_schema()?,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            logprobs: None,
            cancel: None,
            split_reasoning: false,
        })
    }
}

/// The reasoning of a reply, on stderr (`--show-reasoning`).
fn show_reasoning(g: &Generation) {
    if !g.reasoning.is_empty() {
        eprintln!("[reasoning] {}", g.reasoning.trim());
    }
}

#[derive(Copy, Clone, PartialEq, Eq, ValueEnum)]
enum OutputFormat {
    Text,
    Json,
}

#[derive(Args)]
struct PerplexityArgs {
    /// Model, backend and loading options; `-c` is the chunk length (default 512).
    #[command(flatten)]
    model: ModelArgs,
    /// The text to score (UTF-8). Not needed with --kl-divergence-base, whose file holds
    /// the tokens.
    #[arg(short = 'f', long = "file")]
    file: Option<PathBuf>,
    /// Score at most this many chunks (default: every whole chunk of the text).
    #[arg(long)]
    chunks: Option<usize>,
    /// Save this run's token distributions as the reference for later KL-divergence runs.
    #[arg(long, value_name = "FILE")]
    save_logits: Option<PathBuf>,
    /// Score against the distributions saved in FILE (by --save-logits): KL-divergence,
    /// top-token agreement, Δp, and the perplexity ratio.
    #[arg(long, value_name = "FILE", conflicts_with = "save_logits")]
    kl_divergence_base: Option<PathBuf>,
    /// Output as text (llama-perplexity's) or as one JSON object.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    format: OutputFormat,
}

#[derive(Args)]
struct RunArgs {
    /// The prompt.
    prompt: String,
    #[command(flatten)]
    model: ModelArgs,
    /// Tokens to generate at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 128)]
    n_predict: usize,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// System message for --chat.
    #[arg(long)]
    system: Option<String>,
    /// With --chat: also show the reasoning a model writes apart from its answer (gpt-oss's
    /// analysis channel), on stderr; in `--format json` it is the `reasoning` field either way.
    #[arg(long)]
    show_reasoning: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
    /// `json` prints one object with prompt ids, generated ids, text and timings.
    #[arg(long, value_enum, default_value_t = OutputFormat::Text)]
    format: OutputFormat,
}

#[derive(Args)]
struct ChatArgs {
    #[command(flatten)]
    model: ModelArgs,
    #[arg(long)]
    system: Option<String>,
    /// Tokens per reply at most.
    #[arg(short = 'n', long = "n-predict", default_value_t = 512)]
    n_predict: usize,
    /// Also show the reasoning a model writes apart from its answer (gpt-oss's analysis
    /// channel), on stderr after each reply.
    #[arg(long)]
    show_reasoning: bool,
    #[command(flatten)]
    sampling: SamplingArgs,
}

#[derive(Copy, Clone, PartialEq, Eq, ValueEnum)]
enum BenchFormat {
    Md,
    Json,
}

#[derive(Args)]
struct BenchArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// Prompt tokens for the pp test (0 skips it).
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    n_prompt: usize,
    /// Generated tokens for the tg test (0 skips it).
    #[arg(short = 'n', long = "n-gen", default_value_t = 128)]
    n_gen: usize,
    /// Repetitions (after one warm-up).
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    repetitions: usize,
    /// Tokens of context already in the sequence before each test (llama-bench's -d): pp
    /// and tg measured at that depth. Without -c, the context is sized to fit.
    #[arg(short = 'd', long = "n-depth", default_value_t = 0)]
    n_depth: usize,
    #[arg(short = 'o', long = "output", value_enum, default_value_t = BenchFormat::Md)]
    output: BenchFormat,
    /// Batch sizes for a llama-batched-bench style table instead (e.g. 1,4,8,16,32,64):
    /// per B, B sequences prefilled with -p tokens each, then -n steps decoding all B in
    /// one batch.
    #[arg(long = "batch", value_delimiter = ',')]
    batch: Vec<usize>,
}

/// The system allocator with per-thread accounting, so a chat template from a model file
/// cannot build unbounded text in its variables (see kiln_formats::chat::memory).
#[global_allocator]
static ALLOC: kiln_formats::chat::memory::GuardedAlloc = kiln_formats::chat::memory::GuardedAlloc;

fn main() -> ExitCode {
    let cli = Cli::parse();
    // `kiln serve` logs one line per request unless KILN_LOG says otherwise.
    let filter = match (&cli.command, std::env::var("KILN_LOG")) {
        (Command::Serve(_), Err(_)) => tracing_subscriber::EnvFilter::new("info"),
        _ => tracing_subscriber::EnvFilter::from_env("KILN_LOG"),
    };
    let ansi = std::io::IsTerminal::is_terminal(&std::io::stderr());
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_ansi(ansi)
        .with_writer(std::io::stderr)
        .init();
    let result = match cli.command {
        Command::Run(args) => cmd_run(args),
        Command::Chat(args) => cmd_chat(args),
        Command::Inspect { model, backend } => cmd_inspect(model, backend),
        Command::Backends { model, backend } => cmd_backends(model, backend),
        Command::Tokenize { args, no_bos } => cmd_tokenize(args, no_bos),
        Command::Bench(args) => cmd_bench(args),
        Command::Perplexity(args) => cmd_perplexity(args),
        Command::Warmup { model } => cmd_warmup(model),
        Command::Embed(args) => cmd_embed(args),
        Command::Quantize(args) => kiln::toolkit::cmd_quantize(args),
        Command::Synth(args) => kiln::toolkit::cmd_synth(args),
        Command::Convert(args) => kiln::toolkit::cmd_convert(args),
        Command::Conformance(args) => kiln::conformance::cmd_conformance(args),
        Command::Serve(args) => kiln::server::run(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The library's messages speak to any host; the CLI adds its flags.
            let hint = match &e {
                kiln::core::Error::ContextExceeded { .. } => " (raise -c/--ctx-size)",
                _ => "",
            };
            eprintln!("kiln: error: {e}{hint}");
            ExitCode::FAILURE
        }
    }
}

/// The file `-m` names: a path, or a known model's name (fetched on first use; a file of
/// that name in the working directory wins).
fn model_path(path: Option<PathBuf>) -> Result<PathBuf> {
    match path {
        Some(p) if p.exists() => Ok(p),
        Some(p) => match p.to_str().and_then(kiln::fetch::known_model) {
            Some(known) => kiln::fetch::ensure_model(known, false),
            None => Ok(p),
        },
        None => kiln::fetch::ensure_default_model(false),
    }
}

fn registry(args: &BackendArgs) -> Registry {
    let (registry, errors) = registry_with_plugins(&args.plugins);
    for e in errors {
        eprintln!("kiln: warning: {e}");
    }
    registry
}

fn load_engine(args: &ModelArgs) -> Result<Engine> {
    load_engine_for(args, 1, false)
}

/// `load_engine` with room for `sequences` sequences at once, batches decoded one sequence
/// at a time on a GPU when `sequential_decode`.
fn load_engine_for(args: &ModelArgs, sequences: usize, sequential_decode: bool) -> Result<Engine> {
    let path = model_path(args.model.clone())?;
    let model = Model::open(&path)?;
    let registry = registry(&args.backend);
    let options = LoadOptions {
        max_context: args.ctx_size,
        threads: args.threads,
        quantized_activations: args.quantized_activations,
        max_sequences: sequences,
        sequential_decode,
        kv_type: args.kv_type,
        kv_memory: args.kv_mem,
        tensor_parallel: args.tensor_parallel,
        ..LoadOptions::default()
    };
    let engine = Engine::load(model, &registry, args.backend.backend.as_deref(), &options)?;
    tracing::info!(backend = engine.backend_name(), "model loaded");
    Ok(engine)
}

fn cmd_perplexity(mut args: PerplexityArgs) -> Result<()> {
    use kiln::perplexity::{self, LogitsHeader, LogitsReader, LogitsWriter, Plan, Reference};
    let mut reader = match &args.kl_divergence_base {
        Some(path) => Some(LogitsReader::open(path)?),
        None => None,
    };
    let ctx = match (&reader, args.model.ctx_size) {
        (Some(r), 0) => r.header.ctx,
        (Some(r), c) if c != r.header.ctx => {
            return Err(kiln_core::Error::InvalidArgument(format!(
                "the saved logits were made with -c {}; this run asks for -c {c}",
                r.header.ctx
            )))
        }
        (_, 0) => 512,
        (_, c) => c,
    };
    args.model.ctx_size = ctx;
    let text =
        match (&args.file, &reader) {
            (Some(path), _) => Some(std::fs::read(path).map_err(|e| {
                kiln_core::Error::Io(std::io::Error::new(
                    e.kind(),
                    format!("{}: {e}", path.display()),
                ))
            })?),
            (None, Some(_)) => None,
            (None, None) => return Err(kiln_core::Error::InvalidArgument(
                "give the text to score with -f FILE (or a reference with --kl-divergence-base)"
                    .into(),
            )),
        };
    let mut engine = load_engine(&args.model)?;
    let tokenizer = &engine.model.tokenizer;
    let fingerprint = perplexity::tokenizer_fingerprint(tokenizer);
    let bos = tokenizer
        .add_bos_default()
        .then(|| tokenizer.bos())
        .flatten();
    let plan = match &reader {
        Some(r) => {
            if r.header.tokenizer != fingerprint {
                return Err(kiln_core::Error::InvalidArgument(format!(
                    "{}: the saved logits were made with another tokenizer than this model's",
                    args.kl_divergence_base.as_ref().unwrap().display()
                )));
            }
            let plan = Plan::from_saved(&r.header, bos);
            if let Some(bytes) = &text {
                // A text given beside the reference must be the one it was made from.
                let tokens = perplexity::tokenize_text(tokenizer, bytes)?;
                if !tokens.starts_with(&plan.tokens) {
                    return Err(kiln_core::Error::InvalidArgument(
                        "the text does not tokenise to the tokens the saved logits were made over"
                            .into(),
                    ));
                }
            }
            plan
        }
        None => {
            let tokens = perplexity::tokenize_text(tokenizer, text.as_deref().unwrap_or_default())?;
            eprintln!("kiln: the text is {} tokens", tokens.len());
            Plan::new(tokens, ctx, args.chunks, bos)?
        }
    };
    let mut writer = match &args.save_logits {
        Some(path) => Some(LogitsWriter::create(
            path,
            LogitsHeader {
                vocab: engine.model.ir.config.vocab_size,
                ctx: plan.ctx,
                first: plan.first(),
                chunks: plan.chunks,
                tokenizer: fingerprint,
                tokens: plan.tokens.clone(),
            },
        )?),
        None => None,
    };
    let json = args.format == OutputFormat::Json;
    eprintln!(
        "kiln: scoring {} chunks of {} tokens ({} scored each) on {}",
        plan.chunks,
        plan.ctx,
        plan.scored_per_chunk(),
        engine.backend_name()
    );
    let bar = indicatif::ProgressBar::with_draw_target(
        Some(plan.chunks as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    bar.set_style(
        indicatif::ProgressStyle::with_template(
            "{bar:40} {pos}/{len} chunks {elapsed}<{eta} {msg}",
        )
        .expect("a valid template"),
    );
    let started = std::time::Instant::now();
    let mut line = String::new();
    let reference = match (&mut writer, &mut reader) {
        (Some(w), _) => Reference::Save(w),
        (None, Some(r)) => Reference::Compare(r),
        (None, None) => Reference::None,
    };
    let report = perplexity::score(engine.executor(), &plan, reference, |done| {
        bar.inc(1);
        bar.set_message(format!("PPL {:.4}", done.ppl));
        if !json {
            match (done.kld, done.same_top) {
                (Some(kld), Some(top)) => bar.println(format!(
                    "[{}] PPL {:.4}, mean KLD {kld:.6}, same top {:.3}%",
                    done.chunk,
                    done.ppl,
                    100.0 * top
                )),
                _ => line.push_str(&format!("[{}]{:.4},", done.chunk, done.ppl)),
            }
        }
    });
    bar.finish_and_clear();
    let report = report?;
    if let Some(w) = writer {
        w.finish()?;
    }
    let seconds = started.elapsed().as_secs_f64();
    if json {
        let value = serde_json::json!({
            "backend": engine.backend_name(),
            "seconds": seconds,
            "tokens_per_second": (plan.chunks * plan.ctx) as f64 / seconds,
            "report": report,
        });
        println!("{value}");
        return Ok(());
    }
    if !line.is_empty() {
        println!("{line}");
    }
    match &report.kl {
        Some(k) => print!("{}", perplexity::format_kl(&report, k)),
        None => println!(
            "Final estimate: PPL = {:.4} +/- {:.5}",
            report.ppl.value, report.ppl.error
        ),
    }
    eprintln!(
        "kiln: {} tokens in {seconds:.1} s ({:.0} tokens/s)",
        plan.chunks * plan.ctx,
        (plan.chunks * plan.ctx) as f64 / seconds,
    );
    Ok(())
}

fn cmd_run(args: RunArgs) -> Result<()> {
    let params = GenerateParams {
        split_reasoning: args.chat,
        ..args.sampling.params(args.n_predict)?
    };
    let load_start = std::time::Instant::now();
    let mut engine = load_engine(&args.model)?;
    let load_time = load_start.elapsed();
    if let Some(schema) = &params.json_schema {
        // A schema that cannot be used fails before anything is printed.
        engine.json_constraint(schema)?;
    }
    let model = &engine.model;
    let prompt_ids = if args.chat {
        let mut messages = Vec::new();
        if let Some(system) = &args.system {
            messages.push(ChatMessage::new("system", system));
        }
        messages.push(ChatMessage::new("user", &args.prompt));
        model.chat_prompt(&messages)?
    } else {
        model
            .tokenizer
            .encode(&args.prompt, model.tokenizer.add_bos_default(), false)?
    };
    let json = args.format == OutputFormat::Json;
    let backend = engine.backend_name().to_string();
    let mut session = engine.session()?;
    let mut stdout = std::io::stdout();
    if !json && !args.chat {
        let _ = write!(stdout, "{}", args.prompt);
    }
    let generation = session.generate(&prompt_ids, &params, |piece| {
        if !json {
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        }
    })?;
    if json {
        let value = serde_json::json!({
            "backend": backend,
            "prompt_ids": generation.prompt_ids,
            "generated_ids": generation.ids,
            "text": generation.text,
            "reasoning": generation.reasoning,
            "finish_reason": generation.finish.as_str(),
            "timings": {
                "load_ms": load_time.as_secs_f64() * 1e3,
                "time_to_first_token_ms": generation.first_token_time.as_secs_f64() * 1e3,
                "ms_per_token": generation.ms_per_token(),
                "prompt_tokens": generation.prefilled,
                "prompt_ms": generation.prefill_time.as_secs_f64() * 1e3,
                "prompt_tokens_per_sec": generation.prompt_tokens_per_sec(),
                "decode_steps": generation.decode_steps,
                "decode_ms": generation.decode_time.as_secs_f64() * 1e3,
                "decode_tokens_per_sec": generation.decode_tokens_per_sec(),
            }
        });
        println!("{value}");
    } else {
        println!();
        if args.show_reasoning {
            show_reasoning(&generation);
        }
        print_summary(&backend, &generation);
    }
    Ok(())
}

fn print_summary(backend: &str, g: &Generation) {
    eprintln!(
        "kiln: {backend}: prompt {} tokens at {:.1} tok/s, generated {} tokens at {:.1} tok/s ({})",
        g.prefilled,
        g.prompt_tokens_per_sec(),
        g.ids.len(),
        g.decode_tokens_per_sec(),
        g.finish.as_str()
    );
}

/// Longest message line `kiln chat` reads.
const MAX_CHAT_LINE: usize = 4 << 20;

fn cmd_chat(args: ChatArgs) -> Result<()> {
    let params = GenerateParams {
        split_reasoning: true,
        ..args.sampling.params(args.n_predict)?
    };
    let mut engine = load_engine(&args.model)?;
    let backend = engine.backend_name().to_string();
    let mut messages = Vec::new();
    if let Some(system) = &args.system {
        messages.push(ChatMessage::new("system", system));
    }
    let mut session = engine.session()?;
    eprintln!("kiln chat on {backend} — type a message, an empty line or Ctrl-D to quit, /reset to start over");
    let stdin = std::io::stdin();
    let mut line = String::new();
    loop {
        eprint!("> ");
        line.clear();
        // One message per line, read with a bound: input without a newline must not grow
        // without limit (the context refuses far less than this anyway).
        let n = std::io::Read::take(stdin.lock(), MAX_CHAT_LINE as u64 + 1).read_line(&mut line)?;
        if n > MAX_CHAT_LINE {
            return Err(Error::InvalidArgument(format!(
                "an input line of more than {MAX_CHAT_LINE} bytes; kiln chat reads one message per line"
            )));
        }
        if n == 0 || line.trim().is_empty() {
            break;
        }
        if line.trim() == "/reset" {
            messages.truncate(usize::from(args.system.is_some()));
            continue;
        }
        messages.push(ChatMessage::new("user", line.trim_end()));
        let model = &session.engine().model;
        let ids = model.chat_prompt(&messages)?;
        let mut stdout = std::io::stdout();
        let generation = session.generate(&ids, &params, |piece| {
            let _ = write!(stdout, "{piece}");
            let _ = stdout.flush();
        })?;
        println!();
        if args.show_reasoning {
            show_reasoning(&generation);
        }
        print_summary(&backend, &generation);
        messages.push(ChatMessage::new("assistant", generation.text.trim()));
    }
    Ok(())
}

fn describe_candidates(candidates: &[kiln_core::Candidate], chosen: Option<&str>) {
    for c in candidates {
        let mark = if Some(c.name.as_str()) == chosen {
            "*"
        } else {
            " "
        };
        match (c.score(), c.refusal()) {
            (Some(score), _) => {
                let note = match &c.support {
                    kiln_core::Support::Yes { note, .. } => note.as_str(),
                    _ => "",
                };
                println!(" {mark} {:<14} score {score:<4} {note}", c.name)
            }
            (None, Some(why)) => println!(" {mark} {:<14} refused: {why}", c.name),
            (None, None) => println!(" {mark} {:<14} refused", c.name),
        }
    }
}

fn cmd_inspect(model: Option<PathBuf>, backend: BackendArgs) -> Result<()> {
    let path = model_path(model)?;
    let model = Model::open(&path)?;
    let ir = &model.ir;
    let c = &ir.config;
    println!("file:         {}", path.display());
    let clip = |shown: String| {
        let shown = if shown.chars().count() > 100 {
            format!("{}…", shown.chars().take(100).collect::<String>())
        } else {
            shown
        };
        shown.replace('\n', "\\n")
    };
    match &model.file {
        kiln::ModelFile::Gguf(gguf) => {
            println!("format:       GGUF v{}", gguf.version());
            for (key, value) in gguf.metadata() {
                if key.starts_with("tokenizer.ggml.")
                    && !matches!(key.as_str(), "tokenizer.ggml.model" | "tokenizer.ggml.pre")
                {
                    continue;
                }
                println!("  {key} = {}", clip(value.to_string()));
            }
        }
        kiln::ModelFile::Apr(apr) => {
            let (major, minor) = apr.version();
            println!(
                "format:       APR v{major}.{minor}, flags {:#06x} ({})",
                apr.flags(),
                apr_flag_names(apr.flags()).join(", ")
            );
            for (key, value) in apr.metadata() {
                if matches!(
                    key.as_str(),
                    "tokenizer.vocabulary"
                        | "tokenizer.merges"
                        | "tokenizer.scores"
                        | "tokenizer.token_type"
                ) {
                    let n = value.as_array().map_or(0, Vec::len);
                    println!("  {key} = [{n} entries]");
                    continue;
                }
                println!("  {key} = {}", clip(value.to_string()));
            }
            println!("tensors:      {}", apr.tensors().len());
            for t in apr.tensors() {
                println!(
                    "  {:<48} {:<8} {:?} at +{} ({} bytes)",
                    t.name,
                    t.dtype.name(),
                    t.dims,
                    t.offset,
                    t.size
                );
            }
        }
    }
    println!(
        "architecture: {} — {} layers, hidden {}, ffn {}, heads {} / kv {} × {}, vocab {}, context {}",
        c.arch.name(),
        c.num_layers,
        c.hidden_size,
        c.ffn_size,
        c.num_heads,
        c.num_kv_heads,
        c.head_dim,
        c.vocab_size,
        c.context_length
    );
    println!(
        "rope:         {:?}, theta {}, {} rotary dims; tied embeddings: {}",
        c.rope.kind, c.rope.theta, c.rope.rotary_dims, c.tied_embeddings
    );
    println!("parameters:   {:.1} M", ir.parameters() as f64 / 1e6);
    if let Some(e) = c.experts {
        // What a token reads: the whole model but the experts it does not choose.
        let idle: usize = ir
            .weights
            .layers
            .iter()
            .filter_map(|l| l.experts.as_ref())
            .map(|x| x.unread_by_a_token(e.used).0)
            .sum();
        println!(
            "experts:      {} a layer, {} used a token, feed-forward {} each; weights {}; {:.1} M parameters active a token",
            e.count,
            e.used,
            e.ffn_size,
            if e.normalize_weights {
                "renormalised over the chosen"
            } else {
                "as the softmax over all gives them"
            },
            (ir.parameters() - idle) as f64 / 1e6
        );
    }
    if let Ok(kv) = kiln_backend_cpu::kv_cache_size(c, c.context_length, kiln_core::KvType::F32) {
        let windowed: Vec<usize> = (0..c.num_layers)
            .filter(|&l| c.layer_attention(l).window.is_some())
            .collect();
        let windowed = match (c.sliding_window, windowed.first()) {
            (Some(sw), Some(&l)) => format!(
                "; {} of {} layers attend over {} positions and keep {} rows",
                windowed.len(),
                c.num_layers,
                sw.window,
                kv.rows[l]
            ),
            _ => String::new(),
        };
        println!(
            "kv cache:     {:.1} MB per sequence at the full context on the cpu backend (f32){windowed}",
            kv.bytes as f64 / 1e6
        );
    }
    println!("tensors by type:");
    let mut mix: Vec<(kiln_core::QType, usize, usize)> = Vec::new();
    for t in ir.weights.tensors() {
        match mix.iter_mut().find(|(q, _, _)| *q == t.qtype()) {
            Some(m) => {
                m.1 += 1;
                m.2 += t.bytes().len();
            }
            None => mix.push((t.qtype(), 1, t.bytes().len())),
        }
    }
    mix.sort_by_key(|&(q, _, _)| q);
    for (q, count, bytes) in mix {
        println!(
            "  {:<6} {count:>4} tensors  {:>9.2} MB",
            q.name(),
            bytes as f64 / 1e6
        );
    }
    let registry = registry(&backend);
    println!("backends:");
    match kiln_formats::model::dispatch(ir, &registry, backend.backend.as_deref()) {
        Ok((chosen, candidates)) => describe_candidates(&candidates, Some(chosen.name())),
        Err(e) => {
            describe_candidates(&registry.rank(ir), None);
            println!("  → {e}");
        }
    }
    Ok(())
}

/// The names of the APR header flags set in `flags`.
fn apr_flag_names(flags: u16) -> Vec<&'static str> {
    use kiln_formats::apr::flags as f;
    [
        (f::LZ4, "lz4"),
        (f::ZSTD, "zstd"),
        (f::ENCRYPTED, "encrypted"),
        (f::SIGNED, "signed"),
        (f::SHARDED, "sharded"),
        (f::QUANTIZED, "quantized"),
        (f::HAS_FILTERBANK, "filterbank"),
        (f::HAS_MODEL_CARD, "model card"),
        (f::STREAMING, "streaming"),
        (f::HAS_VOCAB, "vocabulary"),
        (f::ROW_MAJOR, "row-major"),
        (f::COLUMN_MAJOR, "column-major"),
    ]
    .into_iter()
    .filter(|(bit, _)| flags & bit != 0)
    .map(|(_, name)| name)
    .collect()
}

fn cmd_backends(model: Option<PathBuf>, backend: BackendArgs) -> Result<()> {
    let registry = registry(&backend);
    for b in registry.backends() {
        let qtypes: Vec<&str> = b.qtypes().iter().map(|q| q.name()).collect();
        match b.probe() {
            Ok(device) => println!("{:<14} available: {device}", b.name()),
            Err(why) => println!("{:<14} unavailable: {why}", b.name()),
        }
        println!(
            "{:<14} {} — qtypes: {}",
            "",
            b.description(),
            qtypes.join(" ")
        );
    }
    if let Some(path) = model {
        let model = Model::open(&path)?;
        println!("\nfor {}:", path.display());
        match kiln_formats::model::dispatch(&model.ir, &registry, backend.backend.as_deref()) {
            Ok((chosen, candidates)) => {
                describe_candidates(&candidates, Some(chosen.name()));
                println!("→ {} would run it", chosen.name());
            }
            Err(e) => {
                describe_candidates(&registry.rank(&model.ir), None);
                println!("→ {e}");
            }
        }
    }
    Ok(())
}

fn cmd_tokenize(args: Vec<String>, no_bos: bool) -> Result<()> {
    let (path, text) = match args.as_slice() {
        [text] => (model_path(None)?, text.clone()),
        [model, text] => (model_path(Some(PathBuf::from(model)))?, text.clone()),
        _ => {
            return Err(Error::InvalidArgument(
                "usage: kiln tokenize [MODEL] TEXT".into(),
            ))
        }
    };
    let model = Model::open(Path::new(&path))?;
    let tok = &model.tokenizer;
    let ids = tok.encode(&text, tok.add_bos_default() && !no_bos, true)?;
    for id in &ids {
        let piece = tok.piece(*id).unwrap_or("?");
        println!("{id:>7} {piece:?}");
    }
    println!("{} tokens", ids.len());
    Ok(())
}

/// The prompt length of `kiln bench`'s first-token latency.
const FIRST_TOKEN_PROMPT: usize = 5;

fn cmd_bench(mut args: BenchArgs) -> Result<()> {
    if !args.batch.is_empty() {
        return cmd_bench_batched(args);
    }
    let depth = args.n_depth;
    if depth > 0 && args.model.ctx_size == 0 {
        // Saturating: a depth past any context is then refused by name, not wrapped.
        args.model.ctx_size = depth.saturating_add(args.n_prompt.max(args.n_gen.saturating_add(1)));
    }
    let loading = std::time::Instant::now();
    let mut engine = load_engine(&args.model)?;
    let load_s = loading.elapsed().as_secs_f64();
    let backend = match args.model.quantized_activations {
        true => format!("{} (8-bit activations)", engine.backend_name()),
        false => engine.backend_name().to_string(),
    };
    let bytes = bytes_per_decode_step(&engine.model.ir);
    let name = engine
        .model
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let params = engine.model.ir.parameters();
    let exec = engine.executor();
    let kv = KvReport::of(exec);
    let mut results: Vec<kiln::bench::Throughput> = Vec::new();
    if args.n_prompt > 0 {
        results.push(bench_prefill(
            exec,
            args.n_prompt,
            depth,
            args.repetitions.max(1),
        )?);
    }
    if args.n_gen > 0 {
        results.push(bench_decode(
            exec,
            args.n_gen,
            depth,
            args.repetitions.max(1),
        )?);
    }
    // A short request's latency beside the throughputs (what `kiln serve` users feel).
    let first_token = if depth == 0
        && args.n_prompt > 0
        && args.n_gen > 0
        && exec.max_context() > FIRST_TOKEN_PROMPT
    {
        Some(bench_first_token(
            exec,
            FIRST_TOKEN_PROMPT,
            args.repetitions.max(1),
        )?)
    } else {
        None
    };
    let kv = kv.with_in_use(results.iter().map(|r| r.kv_blocks_in_use));
    let roofline = exec.memory_roofline_gbs();
    let ctx = exec.max_context();
    match args.output {
        BenchFormat::Json => {
            let value = serde_json::json!({
                "model": name, "backend": backend, "parameters": params,
                "bytes_per_decode_step": bytes, "memory_roofline_gbs": roofline, "results": results,
                "first_token": first_token, "context": ctx, "load_s": load_s,
            });
            println!("{}", with_fields(value, kv.json()));
        }
        BenchFormat::Md => {
            println!("| model | params | backend | test | t/s | weight GB/s | % of roofline |");
            println!("| --- | ---: | --- | --- | ---: | ---: | ---: |");
            for r in &results {
                let (gbs, frac) = if r.test.starts_with("tg") {
                    let gbs = bytes as f64 * r.mean_tps / 1e9;
                    (
                        format!("{gbs:.1}"),
                        roofline.map_or(String::new(), |rf| format!("{:.0}%", 100.0 * gbs / rf)),
                    )
                } else {
                    (String::new(), String::new())
                };
                println!(
                    "| {name} | {:.1} M | {backend} | {} | {:.2} ± {:.2} | {gbs} | {frac} |",
                    params as f64 / 1e6,
                    r.test,
                    r.mean_tps,
                    r.sd_tps
                );
            }
            if let Some(f) = &first_token {
                println!(
                    "\nfirst token of a {}-token prompt, warm process: {:.2} ms (prefill + greedy pick), next step {:.2} ms (medians of {})",
                    f.prompt_tokens, f.first_token_ms, f.first_step_ms, f.repeats
                );
            }
            println!(
                "\nbytes read per decode step: {:.1} MB (weights; the KV cache adds a little)",
                bytes as f64 / 1e6
            );
            println!("context {ctx} tokens; {}", kv.describe());
            println!("{}", load_line(load_s));
            if let Some(rf) = roofline {
                println!("measured memory roofline (copy): {rf:.0} GB/s");
            }
        }
    }
    Ok(())
}

/// KV-cache bytes a token of context takes: keys and values of every layer stored as `kind`
/// (a sliding-window layer's ring is counted as full).
fn kv_bytes_per_token(c: &kiln_core::ModelConfig, kind: kiln_core::KvType) -> usize {
    2 * c.num_layers
        * kind
            .bytes(c.num_kv_heads * c.head_dim)
            .unwrap_or(usize::MAX)
}

/// What `kiln bench` reports of a run's KV cache: the type the executor says it keeps, its
/// bytes a token, and for a paged cache the pool's blocks and how many the tests held; the
/// type and bytes are `None` for an executor that cannot say (a plugin), the blocks for one
/// that does not page.
struct KvReport {
    kind: Option<kiln_core::KvType>,
    per_token: Option<usize>,
    sequences: usize,
    context: usize,
    blocks: Option<kiln_core::KvBlockUsage>,
    /// Most blocks the sequences of one test held at its end.
    in_use: Option<usize>,
}

impl KvReport {
    fn of(exec: &dyn kiln_core::LayerExecutor) -> KvReport {
        let kind = exec.kv_type();
        let blocks = exec.kv_blocks();
        // A paged cache's own figure where there is one: it leaves out the sliding-window
        // layers' rings, which are not in the pool, so it is what `--kv-mem` buys a token.
        let per_token = match blocks {
            Some(b) => Some(b.block_bytes / b.block_tokens.max(1)),
            None => kind.map(|k| kv_bytes_per_token(exec.config(), k)),
        };
        KvReport {
            kind,
            per_token,
            sequences: exec.max_sequences(),
            context: exec.max_context(),
            blocks,
            in_use: None,
        }
    }

    /// The report with the most blocks any test held (`None`s ignored).
    fn with_in_use(mut self, held: impl IntoIterator<Item = Option<usize>>) -> KvReport {
        self.in_use = held.into_iter().flatten().max();
        self
    }

    /// Bytes of the cache: the paged pool's, else every sequence's whole context.
    fn total(&self) -> Option<usize> {
        match self.blocks {
            Some(b) => Some(b.total * b.block_bytes),
            None => self.per_token.map(|b| b * self.context * self.sequences),
        }
    }

    /// `kv_type`, `kv_bytes_per_token`, `kv_bytes`, and the pool's `kv_block_tokens`,
    /// `kv_block_bytes`, `kv_blocks_total` and `kv_blocks_in_use` (null where unknown).
    fn json(&self) -> serde_json::Value {
        serde_json::json!({
            "kv_type": self.kind.map(|k| k.name()),
            "kv_bytes_per_token": self.per_token,
            "kv_bytes": self.total(),
            "kv_block_tokens": self.blocks.map(|b| b.block_tokens),
            "kv_block_bytes": self.blocks.map(|b| b.block_bytes),
            "kv_blocks_total": self.blocks.map(|b| b.total),
            "kv_blocks_in_use": self.in_use,
        })
    }

    fn describe(&self) -> String {
        let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
        let kind = self
            .kind
            .map_or("type not reported".to_string(), |k| k.to_string());
        match (self.per_token, self.total(), self.blocks) {
            (Some(per), Some(total), Some(b)) => format!(
                "KV cache ({kind}): {per} bytes a token; a pool of {} blocks of {} tokens, {}, \
                 shared by {} sequence(s) of up to {} tokens; {} block(s) in use at most during the tests",
                b.total,
                b.block_tokens,
                match total < 1 << 30 {
                    true => format!("{:.1} MiB", total as f64 / (1u64 << 20) as f64),
                    false => format!("{:.2} GiB", gib(total)),
                },
                self.sequences,
                self.context,
                self.in_use.map_or("no".to_string(), |n| n.to_string()),
            ),
            (Some(per), Some(total), None) if self.kind.is_some() => format!(
                "KV cache ({kind}): {per} bytes a token, {:.2} GiB for {} sequence(s) × {} tokens",
                gib(total),
                self.sequences,
                self.context
            ),
            _ => "KV cache: the backend does not say how it stores it".to_string(),
        }
    }
}

/// `value` (a JSON object) with `extra`'s fields added.
fn with_fields(mut value: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    if let (Some(v), serde_json::Value::Object(e)) = (value.as_object_mut(), extra) {
        v.extend(e);
    }
    value
}

/// `kiln bench --batch …`: the llama-batched-bench table (PP, TG, B, N_KV, T_PP, S_PP,
/// T_TG, S_TG, T, S) so the two read side by side.
fn cmd_bench_batched(args: BenchArgs) -> Result<()> {
    if args.batch.contains(&0) {
        return Err(Error::InvalidArgument("--batch sizes start at 1".into()));
    }
    let most = *args.batch.iter().max().expect("non-empty");
    let loading = std::time::Instant::now();
    let mut engine = load_engine_for(&args.model, most, false)?;
    let load_s = loading.elapsed().as_secs_f64();
    let backend = engine.backend_name().to_string();
    let name = engine
        .model
        .path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let exec = engine.executor();
    let ctx = exec.max_context();
    if args.n_prompt + args.n_gen > ctx {
        return Err(Error::InvalidArgument(format!(
            "-p {} + -n {} tokens exceed the context of {ctx} (-c)",
            args.n_prompt, args.n_gen
        )));
    }
    let mut runs = Vec::new();
    for &b in &args.batch {
        runs.push(bench_batched(exec, args.n_prompt, args.n_gen, b)?);
    }
    let kv = KvReport::of(exec).with_in_use(runs.iter().map(|r| r.kv_blocks_in_use));
    match args.output {
        BenchFormat::Json => {
            let value = serde_json::json!({
                "model": name, "backend": backend, "context": ctx, "sequences": exec.max_sequences(),
                "results": runs, "load_s": load_s,
            });
            println!("{}", with_fields(value, kv.json()));
        }
        BenchFormat::Md => {
            println!(
                "{name} on {backend}: {} sequences of up to {ctx} tokens",
                exec.max_sequences()
            );
            println!();
            println!("|    PP |     TG |    B |   N_KV |   T_PP s | S_PP t/s |   T_TG s | S_TG t/s |      T s |    S t/s |");
            println!("|-------|--------|------|--------|----------|----------|----------|----------|----------|----------|");
            for r in &runs {
                println!(
                    "| {:5} | {:6} | {:4} | {:6} | {:8.3} | {:8.2} | {:8.3} | {:8.2} | {:8.3} | {:8.2} |",
                    r.pp, r.tg, r.b, r.n_kv, r.t_pp, r.s_pp, r.t_tg, r.s_tg, r.t, r.s
                );
            }
            println!("\n{}", kv.describe());
            println!("{}", load_line(load_s));
        }
    }
    Ok(())
}

/// What `kiln bench` says of the load it timed: the file opened and checked, the weights
/// read (and on a GPU repacked and uploaded), the executor's buffers made; a GPU's kernels
/// compiled, or read from the on-disk cache.
fn load_line(seconds: f64) -> String {
    format!("model loaded in {seconds:.2} s (file opened, weights read and placed, kernels compiled or read from the cache)")
}

/// `kiln embed`: each text's final hidden states pooled into one vector, a JSON line each.
fn cmd_embed(args: EmbedArgs) -> Result<()> {
    if args.batch == 0 {
        return Err(Error::InvalidArgument("--batch must be at least 1".into()));
    }
    let mut engine = load_engine_for(&args.model, args.batch.min(args.texts.len()), false)?;
    let pooling = match &args.pooling {
        Some(name) => kiln::Pooling::parse(name)?,
        None => kiln::Pooling::of_model(&engine.model)?.unwrap_or(kiln::Pooling::Last),
    };
    let ids = args
        .texts
        .iter()
        .map(|text| {
            let tokenizer = &engine.model.tokenizer;
            tokenizer.encode(text, tokenizer.add_bos_default(), false)
        })
        .collect::<Result<Vec<_>>>()?;
    let inputs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
    let start = std::time::Instant::now();
    let vectors = engine.embed_many(&inputs, pooling, !args.no_normalize)?;
    tracing::info!(
        texts = inputs.len(),
        ms = start.elapsed().as_millis() as u64,
        "embedded"
    );
    let mut stdout = std::io::stdout().lock();
    for v in vectors {
        let line = serde_json::to_string(&v).map_err(|e| Error::InvalidArgument(e.to_string()))?;
        writeln!(stdout, "{line}")?;
    }
    Ok(())
}

/// `kiln warmup`: the model loaded once on its backend (GPU kernels compiled into the
/// on-disk cache on a first run), one token generated, the times printed.
fn cmd_warmup(args: ModelArgs) -> Result<()> {
    let start = std::time::Instant::now();
    let mut engine = load_engine(&args)?;
    let loaded = start.elapsed();
    let backend = engine.backend_name().to_string();
    let bos = engine
        .model
        .tokenizer
        .bos()
        .or(engine.model.tokenizer.eos())
        .unwrap_or(0);
    let mut session = engine.session()?;
    let params = GenerateParams {
        max_tokens: 1,
        ..GenerateParams::default()
    };
    let g = session.generate(&[bos], &params, |_| {})?;
    eprintln!(
        "kiln: ready on {backend}: loaded in {:.2} s (kernels compiled or read from the cache), first token after {:.1} ms",
        loaded.as_secs_f64(),
        g.first_token_time.as_secs_f64() * 1e3
    );
    Ok(())
}
