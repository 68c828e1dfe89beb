//! The model toolkit behind `kiln quantize` and `kiln synth`: argument structs for clap and
//! the commands themselves, with a terminal progress bar. The work is done by
//! [`kiln_formats::quantize`] and [`kiln_formats::synth`].

use std::path::PathBuf;
use std::time::Instant;

use clap::Args;
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use kiln_core::Result;
use kiln_formats::quantize::{quantize_file, with_threads, ProgressEvent, QuantizeOptions, Recipe};
use kiln_formats::synth::{synth_file, Preset, SynthOptions};

/// `kiln quantize IN.gguf OUT.gguf --type T`
#[derive(Args, Debug, Clone)]
pub struct QuantizeArgs {
    /// Input GGUF (any type kiln reads; quantised inputs are requantised through f32).
    pub input: PathBuf,
    /// Output GGUF (written under a temporary name and renamed when complete).
    pub output: PathBuf,
    /// Recipe, by llama.cpp's name: q4_0, q4_1, q8_0, q4_k_s, q4_k_m, q5_k_m, q6_k, f16.
    #[arg(short = 't', long = "type")]
    pub recipe: String,
    /// Also measure and print every tensor's relative RMSE (costs a dequantisation).
    #[arg(long)]
    pub report_error: bool,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// `kiln synth OUT.gguf --shape S --type T [--seed N]`
#[derive(Args, Debug, Clone)]
pub struct SynthArgs {
    /// Output GGUF.
    pub output: PathBuf,
    /// Model shape: smollm2-135m, llama3.2-1b, llama3-8b, llama3.1-8b, qwen2.5-0.5b,
    /// qwen2.5-1.5b, qwen2.5-7b, qwen3-0.6b, qwen3-8b, gemma3-270m, qwen3-30b-a3b,
    /// mixtral-8x7b, qwen3moe-7b-a2b, qwen3moe-small, gpt-oss-20b, gpt-oss-120b.
    #[arg(short, long)]
    pub shape: String,
    /// Recipe, as for `kiln quantize` (q4_k_m, q4_0, f16, ...).
    #[arg(short = 't', long = "type", default_value = "q4_k_m")]
    pub recipe: String,
    /// Seed of the random weights; the same seed gives the same bytes on any machine.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Worker threads (default: all cores).
    #[arg(long)]
    pub threads: Option<usize>,
}

/// A progress bar over converted values, naming the current tensor; hidden when stderr
/// is not a terminal.
struct Bar {
    bar: ProgressBar,
}

impl Bar {
    fn new() -> Bar {
        let bar = ProgressBar::with_draw_target(Some(0), ProgressDrawTarget::stderr());
        bar.set_style(
            ProgressStyle::with_template(
                "{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% eta {eta} {msg}",
            )
            .expect("the template is valid"),
        );
        Bar { bar }
    }

    fn observe(&self, event: ProgressEvent<'_>) {
        match event {
            ProgressEvent::Start { total } => self.bar.set_length(total),
            ProgressEvent::Tensor {
                name,
                index,
                count,
                qtype,
            } => {
                self.bar
                    .set_message(format!("{}/{count} {name} → {qtype}", index + 1));
            }
            ProgressEvent::Advance { done } => self.bar.inc(done),
            ProgressEvent::Finish => self.bar.finish_and_clear(),
        }
    }
}

/// `kiln quantize`: prints the per-tensor mix (and errors, with `--report-error`).
pub fn cmd_quantize(args: QuantizeArgs) -> Result<()> {
    let recipe = Recipe::from_name(&args.recipe)?;
    let options = QuantizeOptions {
        recipe,
        measure_error: args.report_error,
    };
    let bar = Bar::new();
    let start = Instant::now();
    let reports = with_threads(args.threads, || {
        quantize_file(&args.input, &args.output, options, &|e| bar.observe(e))
    })?;
    let secs = start.elapsed().as_secs_f64();
    let mut mix: Vec<(kiln_core::QType, usize)> = Vec::new();
    for r in &reports {
        if args.report_error {
            let err = r
                .rel_rmse
                .map_or_else(|| "unchanged".to_string(), |e| format!("rel RMSE {e:.5}"));
            println!(
                "{:<32} {:>16} {:>5} -> {:<5} {err}",
                r.name,
                format!("{:?}", r.dims),
                r.from.name(),
                r.to.name()
            );
        }
        match mix.iter_mut().find(|(q, _)| *q == r.to) {
            Some(m) => m.1 += 1,
            None => mix.push((r.to, 1)),
        }
    }
    let size = std::fs::metadata(&args.output)?.len();
    let mix: Vec<String> = mix.iter().map(|(q, n)| format!("{n} {q}")).collect();
    println!(
        "{} → {} ({recipe}): {} tensors [{}], {:.1} MB, {secs:.1} s",
        args.input.display(),
        args.output.display(),
        reports.len(),
        mix.join(", "),
        size as f64 / 1e6
    );
    Ok(())
}

/// `kiln synth`: writes the random model and prints its size and time.
pub fn cmd_synth(args: SynthArgs) -> Result<()> {
    let preset = Preset::from_name(&args.shape)?;
    let recipe = Recipe::from_name(&args.recipe)?;
    let options = SynthOptions {
        preset,
        recipe,
        seed: args.seed,
    };
    let bar = Bar::new();
    let start = Instant::now();
    let tensors = with_threads(args.threads, || {
        synth_file(&args.output, options, &|e| bar.observe(e))
    })?;
    let secs = start.elapsed().as_secs_f64();
    let params: usize = tensors
        .iter()
        .map(|t| t.dims.iter().product::<usize>())
        .sum();
    let size = std::fs::metadata(&args.output)?.len();
    println!(
        "{}: synthetic {} ({recipe}, seed {}): {:.2} B parameters, {} tensors, {:.1} MB, {secs:.1} s",
        args.output.display(),
        preset.name(),
        args.seed,
        params as f64 / 1e9,
        tensors.len(),
        size as f64 / 1e6
    );
    Ok(())
}

/// `kiln convert IN OUT [--compress lz4|zstd] [--quantize int4|int8]`
#[derive(Args, Debug, Clone)]
pub struct ConvertArgs {
    /// Input model (GGUF or APR; told apart by its magic bytes).
    pub input: PathBuf,
    /// Output model: `.apr` writes APR v2, `.gguf` writes GGUF.
    pub output: PathBuf,
    /// APR output only: compress everything after the header (lz4 or zstd).
    #[arg(long)]
    pub compress: Option<String>,
    /// APR output only: write every matrix in APR's 4-bit (int4) or 8-bit (int8) type.
    #[arg(long)]
    pub quantize: Option<String>,
}

/// `kiln convert`: GGUF ↔ APR, streaming one tensor at a time; prints every tensor whose
/// type had to change and why.
pub fn cmd_convert(args: ConvertArgs) -> Result<()> {
    use kiln_core::Error;
    use kiln_formats::apr::Compression;
    use kiln_formats::apr_model::{write_model_apr, write_model_gguf, AprQuantize};
    let to_apr = match args
        .output
        .extension()
        .and_then(|e| e.to_str())
        .map(str::to_ascii_lowercase)
        .as_deref()
    {
        Some("apr") => true,
        Some("gguf") => false,
        _ => {
            return Err(Error::InvalidArgument(format!(
                "{}: the output must end in .apr or .gguf",
                args.output.display()
            )))
        }
    };
    let compression = match args.compress.as_deref() {
        None | Some("none") => Compression::None,
        Some("lz4") => Compression::Lz4,
        Some("zstd") => Compression::Zstd,
        Some(other) => {
            return Err(Error::InvalidArgument(format!(
                "--compress {other}: lz4, zstd or none"
            )))
        }
    };
    let quantize = match args.quantize.as_deref() {
        None | Some("keep") => AprQuantize::Keep,
        Some("int4") => AprQuantize::Int4,
        Some("int8") => AprQuantize::Int8,
        Some(other) => {
            return Err(Error::InvalidArgument(format!(
                "--quantize {other}: int4 or int8"
            )))
        }
    };
    if !to_apr && (compression != Compression::None || quantize != AprQuantize::Keep) {
        return Err(Error::InvalidArgument(
            "--compress and --quantize apply to APR output only".into(),
        ));
    }
    let model = crate::Model::open(&args.input)?;
    let template = model.chat_template_source().map(str::to_string);
    let bar = Bar::new();
    let start = Instant::now();
    let reports = if to_apr {
        write_model_apr(
            &model.ir,
            &model.tokenizer_spec,
            template.as_deref(),
            &args.output,
            compression,
            quantize,
            &|e| bar.observe(e),
        )?
    } else {
        write_model_gguf(
            &model.ir,
            &model.tokenizer_spec,
            template.as_deref(),
            &args.output,
            &|e| bar.observe(e),
        )?
    };
    for r in &reports {
        println!("{:<40} {} → {}", r.name, r.from, r.to);
    }
    let size = std::fs::metadata(&args.output)?.len();
    println!(
        "{} → {}: {} tensors ({} converted), {:.1} MB, {:.1} s",
        args.input.display(),
        args.output.display(),
        model.ir.weights.tensors().len(),
        reports.len(),
        size as f64 / 1e6,
        start.elapsed().as_secs_f64()
    );
    Ok(())
}
