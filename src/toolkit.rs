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
    /// Model shape: smollm2-135m, llama3.2-1b, llama3-8b, qwen2.5-0.5b, qwen2.5-1.5b,
    /// qwen2.5-7b, qwen3-0.6b, qwen3-8b.
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
            ProgressStyle::with_template("{spinner} [{elapsed_precise}] {wide_bar} {percent:>3}% eta {eta} {msg}")
                .expect("the template is valid"),
        );
        Bar { bar }
    }

    fn observe(&self, event: ProgressEvent<'_>) {
        match event {
            ProgressEvent::Start { total } => self.bar.set_length(total),
            ProgressEvent::Tensor { name, index, count, qtype } => {
                self.bar.set_message(format!("{}/{count} {name} → {qtype}", index + 1));
            }
            ProgressEvent::Advance { done } => self.bar.inc(done),
            ProgressEvent::Finish => self.bar.finish_and_clear(),
        }
    }
}

/// `kiln quantize`: prints the per-tensor mix (and errors, with `--report-error`).
pub fn cmd_quantize(args: QuantizeArgs) -> Result<()> {
    let recipe = Recipe::from_name(&args.recipe)?;
    let options = QuantizeOptions { recipe, measure_error: args.report_error };
    let bar = Bar::new();
    let start = Instant::now();
    let reports = with_threads(args.threads, || quantize_file(&args.input, &args.output, options, &|e| bar.observe(e)))?;
    let secs = start.elapsed().as_secs_f64();
    let mut mix: Vec<(kiln_core::QType, usize)> = Vec::new();
    for r in &reports {
        if args.report_error {
            let err = r.rel_rmse.map_or_else(|| "unchanged".to_string(), |e| format!("rel RMSE {e:.5}"));
            println!("{:<32} {:>16} {:>5} -> {:<5} {err}", r.name, format!("{:?}", r.dims), r.from.name(), r.to.name());
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
    let options = SynthOptions { preset, recipe, seed: args.seed };
    let bar = Bar::new();
    let start = Instant::now();
    let tensors = with_threads(args.threads, || synth_file(&args.output, options, &|e| bar.observe(e)))?;
    let secs = start.elapsed().as_secs_f64();
    let params: usize = tensors.iter().map(|t| t.dims.iter().product::<usize>()).sum();
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
