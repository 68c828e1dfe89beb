//! # kiln-conformance
//!
//! The conformance suite every kiln backend — built-in or plugin — is held to, runnable by
//! its author: `kiln conformance --plugin libmy_backend.so` from the command line, or
//! [`run`] from a test that links the backend directly.
//!
//! For each model it can run — synthetic ones of several shapes built in memory
//! ([`models::suite_shapes`]: llama with an untied head, qwen2 with QKV biases at hidden 576,
//! qwen3 with QK-norm, tied heads, a small Gemma 3 with sliding windows and sandwich norms, a
//! small Qwen3-MoE whose tokens each route to two of eight experts, a small plain-type llama)
//! and, when given, a real model —
//! it loads the model on the backend and on the CPU oracle (`kiln-backend-cpu`) and checks:
//!
//! - the executor contract of `kiln_core::LayerExecutor`: sequence lifecycle, capacity,
//!   truncation, batches of sequences at mixed positions, the context limit, and
//!   `InvalidArgument` for every kind of misuse, with the state left as it was;
//! - every output: each logits buffer is filled with NaN before each call and every value
//!   must come back written and finite;
//! - parity with the oracle under teacher forcing: per-step cosine of the logits, and the
//!   greedy token at every step except near-ties (the oracle's top-1/top-2 gap under a
//!   bound, counted and reported).
//!
//! Every check belongs to a rule with a stable name ([`RULES`]); the [`Report`] lists each
//! with PASS / FAIL / SKIP and a one-line reason, and [`Report::passed`] is the verdict.
//! docs/plugins.md ("Conformance rules") says what each rule requires and how to fix a
//! failure.

pub mod models;

use std::fmt;
use std::panic::{catch_unwind, AssertUnwindSafe};

use kiln_backend_cpu::CpuBackend;
use kiln_core::plugin_abi::UNWRITTEN_LOGITS;
use kiln_core::{
    argmax, Backend, DecodeItem, Error, LayerExecutor, LoadOptions, ModelIr, Rng, SeqId, Support,
};

use models::cosine;

/// One rule of the suite: its stable name and what it requires.
#[derive(Debug, Clone, Copy)]
pub struct Rule {
    pub name: &'static str,
    pub requires: &'static str,
}

/// Every rule, in report order.
pub const RULES: &[Rule] = &[
    Rule { name: "backend.identity", requires: "a name of 1–64 bytes without whitespace, a description, at least one qtype" },
    Rule { name: "backend.available", requires: "probe() succeeds on this machine (the suite runs nothing otherwise)" },
    Rule { name: "backend.supports", requires: "supports() accepts at least one of the suite's models (a refused model is skipped)" },
    Rule {
        name: "load.model",
        requires: "load() succeeds; config() equals the model's; 1 ≤ max_context ≤ requested; 1 ≤ max_sequences ≤ requested",
    },
    Rule {
        name: "lifecycle.new_free_reuse",
        requires: "a new sequence is empty; a freed id is unknown (InvalidArgument); a sequence made after a free starts clean",
    },
    Rule {
        name: "lifecycle.capacity_is_typed_error",
        requires: "max_sequences distinct live sequences; one more is InvalidArgument; freeing one makes room",
    },
    Rule {
        name: "truncate.keeps_prefix",
        requires: "after truncate_sequence(seq, n) the length is n and the sequence computes as if only its first n tokens had been appended",
    },
    Rule {
        name: "truncate.past_end_is_error",
        requires: "truncating past the end is InvalidArgument and changes nothing; to the length is a no-op; to 0 empties",
    },
    Rule {
        name: "batch.mixed_positions",
        requires: "one decode batch of sequences at different positions gives, row by row, what each gets alone, in any item order",
    },
    Rule { name: "batch.empty_is_noop", requires: "decode of an empty batch succeeds and changes nothing" },
    Rule {
        name: "context.limit_is_typed_error",
        requires: "a sequence fills up to max_context exactly; a prefill or decode past it is InvalidArgument and changes nothing",
    },
    Rule {
        name: "errors.unknown_sequence",
        requires: "every method given an id that is not alive returns InvalidArgument, also inside a batch",
    },
    Rule { name: "errors.empty_prompt", requires: "prefill of zero tokens is InvalidArgument" },
    Rule { name: "errors.token_out_of_vocab", requires: "a token id ≥ vocab in prefill or decode is InvalidArgument" },
    Rule { name: "errors.duplicate_in_batch", requires: "a decode batch naming one sequence twice is InvalidArgument" },
    Rule {
        name: "errors.buffer_length",
        requires: "a logits buffer that is not vocab (prefill) or items × vocab (decode) long is InvalidArgument",
    },
    Rule {
        name: "errors.state_unchanged",
        requires: "after every rejected call every sequence keeps its length, and the executor keeps working",
    },
    Rule {
        name: "logits.all_written_and_finite",
        requires: "every successful prefill/decode writes every value of the logits buffer, finite (the suite poisons it with NaN first)",
    },
    Rule {
        name: "parity.cosine",
        requires: "teacher-forced, each step's logits have cosine ≥ the bar (0.999) with the CPU oracle's",
    },
    Rule {
        name: "parity.greedy",
        requires: "teacher-forced, each step's argmax equals the oracle's, except at near-ties (oracle top-1/top-2 gap < 0.05)",
    },
    Rule {
        name: "scoring.kl_divergence",
        requires: "prefill_logits (every position's logits from a given one on: what kiln perplexity reads) gives distributions whose mean KL-divergence from the oracle's is ≤ the bar (0.01), with every row written and finite",
    },
];

/// Verdict of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    Pass,
    Fail,
    /// Not applicable here (a model the backend refuses, one sequence only, ...).
    Skip,
}

/// One checked rule on one model (or on the backend itself when `model` is `None`).
#[derive(Debug, Clone)]
pub struct Finding {
    pub rule: &'static str,
    pub model: Option<String>,
    pub outcome: Outcome,
    /// One line: what was measured, or why it failed or was skipped.
    pub detail: String,
}

/// What [`run`] found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub backend: String,
    /// The backend's listing line (for a plugin: its version, file and architectures).
    pub description: String,
    /// The device `probe()` reported, when available.
    pub device: Option<String>,
    /// The bars and sizes the suite ran with.
    pub settings: String,
    /// Each model the suite ran: its label (what [`Finding::model`] holds) and a description.
    pub models: Vec<(String, String)>,
    pub findings: Vec<Finding>,
}

impl Report {
    /// No rule failed and at least one passed.
    pub fn passed(&self) -> bool {
        self.failures().next().is_none() && self.findings.iter().any(|f| f.outcome == Outcome::Pass)
    }

    pub fn failures(&self) -> impl Iterator<Item = &Finding> {
        self.findings.iter().filter(|f| f.outcome == Outcome::Fail)
    }

    /// Names of the rules with at least one failure, each once, in report order.
    pub fn failed_rules(&self) -> Vec<&'static str> {
        let mut names: Vec<&'static str> = Vec::new();
        for f in self.failures() {
            if !names.contains(&f.rule) {
                names.push(f.rule);
            }
        }
        names
    }

    /// Records a failed check, or — when the failure came from an operation another rule
    /// covers and that rule fails on this model (or is the logits rule, judged last) — a
    /// skip pointing at it, so one fault is reported once, under its own rule.
    fn fail_or_defer(&mut self, rule: &'static str, model: Option<&str>, f: Fail) {
        let deferred = f.blame.filter(|&b| {
            b != rule
                && (b == LOGITS_RULE
                    || self.findings.iter().any(|x| {
                        x.rule == b && x.outcome == Outcome::Fail && x.model.as_deref() == model
                    }))
        });
        match deferred {
            Some(b) => self.push(
                rule,
                model,
                Outcome::Skip,
                format!("not judged: it needs {b}, which fails here"),
            ),
            None => self.push(rule, model, Outcome::Fail, f.why),
        }
    }

    fn count(&self, o: Outcome) -> usize {
        self.findings.iter().filter(|f| f.outcome == o).count()
    }

    fn push(
        &mut self,
        rule: &'static str,
        model: Option<&str>,
        outcome: Outcome,
        detail: impl Into<String>,
    ) {
        debug_assert!(RULES.iter().any(|r| r.name == rule), "unknown rule {rule}");
        self.findings.push(Finding {
            rule,
            model: model.map(str::to_owned),
            outcome,
            detail: detail.into(),
        });
    }
}

impl fmt::Display for Report {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let mark = |o: Outcome| match o {
            Outcome::Pass => "PASS",
            Outcome::Fail => "FAIL",
            Outcome::Skip => "skip",
        };
        writeln!(f, "kiln conformance: backend `{}`", self.backend)?;
        writeln!(f, "  {}", self.description)?;
        if let Some(d) = &self.device {
            writeln!(f, "  device: {d}")?;
        }
        writeln!(f, "  {}", self.settings)?;
        let mut model: Option<&Option<String>> = None;
        for x in &self.findings {
            if model != Some(&x.model) {
                match &x.model {
                    Some(m) => match self.models.iter().find(|(label, _)| label == m) {
                        Some((_, about)) => writeln!(f, "\nmodel: {m} — {about}")?,
                        None => writeln!(f, "\nmodel: {m}")?,
                    },
                    None => writeln!(f)?,
                }
                model = Some(&x.model);
            }
            writeln!(f, "  {}  {:<34} {}", mark(x.outcome), x.rule, x.detail)?;
        }
        let (pass, fail, skip) = (
            self.count(Outcome::Pass),
            self.count(Outcome::Fail),
            self.count(Outcome::Skip),
        );
        writeln!(f)?;
        if self.passed() {
            writeln!(f, "result: PASS — {pass} checks passed, {skip} skipped")?;
        } else {
            let rules = self.failed_rules();
            writeln!(
                f,
                "result: FAIL — {fail} of {} checks failed, breaking {} rule{}: {}",
                pass + fail,
                rules.len(),
                if rules.len() == 1 { "" } else { "s" },
                rules.join(", ")
            )?;
            for x in self.failures() {
                let on = x
                    .model
                    .as_deref()
                    .map(|m| format!(" [{m}]"))
                    .unwrap_or_default();
                writeln!(f, "  FAIL  {}{on}: {}", x.rule, x.detail)?;
            }
            if pass == 0 && fail == 0 {
                writeln!(f, "  (nothing ran)")?;
            }
            writeln!(f, "What each rule requires and how to fix it: docs/plugins.md, \"Conformance rules\".")?;
        }
        Ok(())
    }
}

/// A real model to run parity on, with the prompts (token ids) to feed it.
#[derive(Clone)]
pub struct RealModel {
    pub label: String,
    pub ir: ModelIr,
    pub prompts: Vec<Vec<u32>>,
    /// A text in the model's tokens (its BOS first where it adds one), scored in chunks of
    /// [`SCORE_CONTEXT`] tokens by `scoring.kl_divergence`; kiln passes its built-in short
    /// text. Shorter than one chunk: the rule is skipped.
    pub text: Vec<u32>,
}

/// How the suite runs. `Options::default()` is what `kiln conformance` uses.
#[derive(Clone)]
pub struct Options {
    /// Seed of the synthetic weights (fixed by default, so a report can be replayed).
    pub seed: u64,
    /// Teacher-forced decode steps per parity run.
    pub steps: usize,
    /// Least cosine between a step's logits and the oracle's.
    pub min_cosine: f64,
    /// A step whose oracle top-1/top-2 gap is below this is a near-tie: its greedy token may
    /// differ.
    pub tie_gap: f32,
    /// Run the synthetic models (the contract checks run only on them).
    pub synthetic: bool,
    /// Parity on a real model too.
    pub real_model: Option<RealModel>,
    /// Threads of the backend and the oracle (`LoadOptions::threads`).
    pub threads: Option<usize>,
    /// `LoadOptions::quantized_activations` for the backend under test (never the oracle).
    pub quantized_activations: bool,
    /// Largest mean KL-divergence (nats) of a scoring prefill's distributions from the
    /// oracle's. 0.01 is about twice what 8-bit activations cost on the real SmolLM2
    /// (0.0054 on the KJV text; 15-bit ones and f16 GEMMs stay under 0.0001), while a
    /// scoring path that shifts a position or drops a layer's output is off by whole nats.
    pub max_kld: f64,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            seed: 0x6b69_6c6e,
            steps: 24,
            min_cosine: 0.999,
            tie_gap: 0.05,
            synthetic: true,
            real_model: None,
            threads: None,
            quantized_activations: false,
            max_kld: 0.01,
        }
    }
}

/// Context and sequences the synthetic models are loaded with.
const SYNTH_CONTEXT: usize = 64;
const SYNTH_SEQUENCES: usize = 3;
/// Prompt length of a synthetic parity run.
const SYNTH_PROMPT: usize = 16;
/// Tokens a real model's text is scored in at a time (each chunk from an empty sequence, its
/// second half scored, as `kiln perplexity` does), and chunks scored at most.
pub const SCORE_CONTEXT: usize = 128;
const SCORE_CHUNKS: usize = 4;

/// (label, model, the real model's prompts and text; `None` for a synthetic model)
type Subject<'a> = (String, ModelIr, Option<&'a RealModel>);

/// Runs the whole suite on `backend`.
pub fn run(backend: &dyn Backend, options: &Options) -> Report {
    let mut report = Report {
        backend: backend.name().to_string(),
        description: backend.description().to_string(),
        settings: format!(
            "oracle: cpu; bars: cosine ≥ {}, greedy tokens equal except near-ties (oracle top-1/top-2 gap < {}); \
             {} teacher-forced steps; synthetic seed {:#x}",
            options.min_cosine, options.tie_gap, options.steps, options.seed
        ),
        ..Report::default()
    };
    identity(backend, &mut report);
    match guarded(|| backend.probe()) {
        Ok(Ok(device)) => {
            report.push("backend.available", None, Outcome::Pass, device.clone());
            report.device = Some(device);
        }
        Ok(Err(why)) => {
            report.push(
                "backend.available",
                None,
                Outcome::Fail,
                format!("probe() says unavailable: {why}"),
            );
            return report;
        }
        Err(panic) => {
            report.push(
                "backend.available",
                None,
                Outcome::Fail,
                format!("probe() panicked: {panic}"),
            );
            return report;
        }
    }

    let mut subjects: Vec<Subject> = Vec::new();
    if options.synthetic {
        let mut rng = Rng::new(options.seed);
        for (label, shape) in models::suite_shapes() {
            let ir = models::model(&mut rng, &shape, 4096);
            report
                .models
                .push((label.to_string(), models::describe(&shape)));
            subjects.push((label.to_string(), ir, None));
        }
    }
    if let Some(real) = &options.real_model {
        let c = &real.ir.config;
        let about = format!(
            "{}, {} layers, hidden {}, vocab {}; parity and scoring only, {} prompts, a text of {} tokens",
            c.arch.name(),
            c.num_layers,
            c.hidden_size,
            c.vocab_size,
            real.prompts.len(),
            real.text.len()
        );
        report.models.push((real.label.clone(), about));
        subjects.push((real.label.clone(), real.ir.clone(), Some(real)));
    }
    let mut accepted = 0;
    for (label, ir, real) in &subjects {
        match guarded(|| backend.supports(ir)) {
            Ok(Support::Yes { score, note }) => {
                accepted += 1;
                report.push(
                    "backend.supports",
                    Some(label),
                    Outcome::Pass,
                    format!("score {score}: {note}"),
                );
                let prompts = real.map(|r| r.prompts.as_slice());
                let text = real.map(|r| r.text.as_slice());
                run_model(backend, label, ir, prompts, text, options, &mut report);
            }
            Ok(Support::No { reason }) => report.push(
                "backend.supports",
                Some(label),
                Outcome::Skip,
                format!("refused, so not run: {reason}"),
            ),
            Err(panic) => report.push(
                "backend.supports",
                Some(label),
                Outcome::Fail,
                format!("supports() panicked: {panic}"),
            ),
        }
    }
    if accepted == 0 && !subjects.is_empty() {
        report.push(
            "backend.supports",
            None,
            Outcome::Fail,
            "refused every model of the suite: nothing was checked",
        );
    }
    report
}

fn identity(backend: &dyn Backend, report: &mut Report) {
    let name = backend.name();
    let problem = if name.is_empty() || name.len() > 64 {
        Some(format!("name {name:?} is not 1–64 bytes"))
    } else if name.chars().any(|c| c.is_whitespace() || c.is_control()) {
        Some(format!(
            "name {name:?} contains whitespace or control characters"
        ))
    } else if backend.description().trim().is_empty() {
        Some("the description is empty".into())
    } else if backend.qtypes().is_empty() {
        Some("qtypes() is empty: say which weight types the backend multiplies with".into())
    } else {
        None
    };
    match problem {
        Some(p) => report.push("backend.identity", None, Outcome::Fail, p),
        None => report.push(
            "backend.identity",
            None,
            Outcome::Pass,
            format!("name `{name}`, {} qtypes", backend.qtypes().len()),
        ),
    }
}

/// Runs `f`, turning a panic into its message (built-in backends are called directly;
/// a plugin's panics are already caught by its SDK).
fn guarded<T>(f: impl FnOnce() -> T) -> std::result::Result<T, String> {
    catch_unwind(AssertUnwindSafe(f)).map_err(|p| {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "non-string panic payload".into())
    })
}

/// A check's result short of failure: passed with a detail, or not applicable.
enum Done {
    Pass(String),
    Skip(String),
}

/// Why a check failed, and the rule to blame when the failure came from an operation
/// another rule covers (a truncation that did not truncate, logits left unwritten): the
/// check is then reported as not judged, and only the rule at fault fails.
struct Fail {
    why: String,
    blame: Option<&'static str>,
}

impl Fail {
    /// The same failure, said in `context`.
    fn within(self, context: impl fmt::Display) -> Fail {
        Fail {
            why: format!("{context}: {}", self.why),
            ..self
        }
    }
}

impl From<String> for Fail {
    fn from(why: String) -> Fail {
        Fail { why, blame: None }
    }
}

type Step<T> = std::result::Result<T, Fail>;

macro_rules! ensure {
    ($cond:expr, $($why:tt)+) => {
        if !$cond {
            return Err(format!($($why)+).into());
        }
    };
}

const LOGITS_RULE: &str = "logits.all_written_and_finite";
const TRUNCATE_RULE: &str = "truncate.keeps_prefix";

/// Error variant names, for messages about the wrong kind of error.
fn kind_of(e: &Error) -> &'static str {
    match e {
        Error::Io(_) => "Io",
        Error::Format(_) => "Format",
        Error::InvalidShape(_) => "InvalidShape",
        Error::Unsupported(_) => "Unsupported",
        Error::NoBackend(_) => "NoBackend",
        Error::Backend { .. } => "Backend",
        Error::OutOfMemory(_) => "OutOfMemory",
        Error::Plugin { .. } => "Plugin",
        Error::Tokenizer(_) => "Tokenizer",
        Error::SavedLogits { .. } => "SavedLogits",
        Error::InvalidArgument(_) => "InvalidArgument",
        Error::NonFiniteLogits { .. } => "NonFiniteLogits",
        Error::KvCacheFull { .. } => "KvCacheFull",
        Error::ContextExceeded { .. } => "ContextExceeded",
        _ => "another kind",
    }
}

/// Deterministic token ids spread over the vocabulary.
fn prompt(n: usize, vocab: usize, salt: u32) -> Vec<u32> {
    (0..n as u32)
        .map(|i| {
            (i.wrapping_mul(2_654_435_761)
                .wrapping_add(salt.wrapping_mul(40_503))
                >> 7)
                % vocab as u32
        })
        .collect()
}

/// The backend's executor on one model, with the bookkeeping the checks share.
struct Harness<'a> {
    backend: &'a dyn Backend,
    ir: &'a ModelIr,
    load: LoadOptions,
    exec: Box<dyn LayerExecutor>,
    vocab: usize,
    /// Sequences the suite holds on `exec`.
    alive: Vec<SeqId>,
    /// prefill/decode calls made, and those that left a logit unwritten or non-finite.
    output_calls: usize,
    unwritten: Vec<String>,
    /// Rejected calls made, and those after which a length had changed.
    rejected: usize,
    changed: Vec<String>,
}

impl Harness<'_> {
    fn reload(&mut self) -> Step<()> {
        self.alive.clear();
        // Drop the old executor first: a device may not hold two.
        self.exec = Box::new(Placeholder);
        self.exec = guarded(|| self.backend.load(self.ir, &self.load))
            .map_err(|p| format!("load() panicked: {p}"))?
            .map_err(|e| format!("load() failed: {e}"))?;
        Ok(())
    }

    fn release_all(&mut self) {
        for s in std::mem::take(&mut self.alive) {
            let _ = self.exec.free_sequence(s);
        }
    }

    fn new_seq(&mut self) -> Step<SeqId> {
        let s = self
            .exec
            .new_sequence()
            .map_err(|e| format!("new_sequence failed: {e}"))?;
        self.alive.push(s);
        Ok(s)
    }

    fn free(&mut self, s: SeqId) -> Step<()> {
        self.exec
            .free_sequence(s)
            .map_err(|e| format!("free_sequence({s}) failed: {e}"))?;
        self.alive.retain(|&a| a != s);
        Ok(())
    }

    fn len(&self, s: SeqId) -> Step<usize> {
        self.exec
            .sequence_len(s)
            .map_err(|e| format!("sequence_len({s}) failed: {e}").into())
    }

    fn expect_len(&self, s: SeqId, want: usize, after: &str) -> Step<()> {
        let got = self.len(s)?;
        ensure!(
            got == want,
            "after {after} sequence {s} holds {got} tokens; expected {want}"
        );
        Ok(())
    }

    fn truncate(&mut self, s: SeqId, len: usize) -> Step<()> {
        let done = match self.exec.truncate_sequence(s, len) {
            Ok(()) => self.expect_len(s, len, &format!("truncate_sequence({s}, {len})")),
            Err(e) => Err(format!("truncate_sequence({s}, {len}) failed: {e}").into()),
        };
        done.map_err(|f| Fail {
            blame: Some(TRUNCATE_RULE),
            ..f
        })
    }

    fn prefill(&mut self, s: SeqId, tokens: &[u32]) -> Step<Vec<f32>> {
        let mut out = vec![f32::NAN; self.vocab];
        let r = self.exec.prefill(s, tokens, &mut out);
        self.outputs(&format!("prefill of {} tokens", tokens.len()), r, out)
    }

    fn prefill_logits(&mut self, s: SeqId, tokens: &[u32], first: usize) -> Step<Vec<f32>> {
        let mut out = vec![f32::NAN; (tokens.len() - first) * self.vocab];
        let r = self.exec.prefill_logits(s, tokens, first, &mut out);
        let what = format!("prefill_logits of {} tokens from {first}", tokens.len());
        self.outputs(&what, r, out)
    }

    fn decode(&mut self, items: &[(SeqId, u32)]) -> Step<Vec<f32>> {
        let batch: Vec<DecodeItem> = items
            .iter()
            .map(|&(seq, token)| DecodeItem { seq, token })
            .collect();
        let mut out = vec![f32::NAN; items.len() * self.vocab];
        let r = self.exec.decode(&batch, &mut out);
        self.outputs(&format!("decode of {} item(s)", items.len()), r, out)
    }

    /// The output check every prefill/decode goes through: the buffer was all NaN before
    /// the call, so any value still not finite was not written (or written non-finite).
    fn outputs(&mut self, what: &str, r: kiln_core::Result<()>, out: Vec<f32>) -> Step<Vec<f32>> {
        self.output_calls += 1;
        match r {
            Ok(()) => {
                let Some(first) = out.iter().position(|v| !v.is_finite()) else {
                    return Ok(out);
                };
                let bad = out.iter().filter(|v| !v.is_finite()).count();
                let m = format!(
                    "{what} returned OK with {bad} of {} {UNWRITTEN_LOGITS} (first at index {first})",
                    out.len()
                );
                self.unwritten.push(m.clone());
                Err(Fail {
                    why: m,
                    blame: Some(LOGITS_RULE),
                })
            }
            Err(e) => {
                let m = format!("{what} failed: {e}");
                // A plugin's host turns unwritten logits into an error; count it here too.
                if e.to_string().contains(UNWRITTEN_LOGITS) {
                    self.unwritten.push(m.clone());
                    return Err(Fail {
                        why: m,
                        blame: Some(LOGITS_RULE),
                    });
                }
                Err(m.into())
            }
        }
    }

    /// Expects `f` to be refused with `InvalidArgument`, and the sequences in `watch` to
    /// keep their lengths (recorded for `errors.state_unchanged`).
    fn reject<T>(
        &mut self,
        what: &str,
        watch: &[SeqId],
        f: impl FnOnce(&mut dyn LayerExecutor) -> kiln_core::Result<T>,
    ) -> Step<()> {
        let lens = |h: &Self| {
            watch
                .iter()
                .map(|&s| h.exec.sequence_len(s).ok())
                .collect::<Vec<_>>()
        };
        let before = lens(self);
        let r = f(self.exec.as_mut());
        self.rejected += 1;
        let after = lens(self);
        if before != after {
            self.changed.push(format!(
                "{what} changed the lengths {before:?} to {after:?}"
            ));
        }
        match r {
            Err(Error::InvalidArgument(_)) => Ok(()),
            Ok(_) => Err(format!("{what} succeeded; the contract says InvalidArgument").into()),
            Err(e) => Err(format!(
                "{what} failed with {} ({e}); the contract says InvalidArgument",
                kind_of(&e)
            )
            .into()),
        }
    }

    /// Whether two logits of the same backend agree: cosine at the bar, same argmax except
    /// at near-ties of `want`.
    fn agree(&self, got: &[f32], want: &[f32], bar: f64, tie_gap: f32, what: &str) -> Step<()> {
        let c = cosine(got, want);
        ensure!(
            c.partial_cmp(&bar).is_some_and(|o| o.is_ge()),
            "{what}: cosine {c:.6} with the expected logits (bar {bar})"
        );
        let (g, w) = (argmax(got), argmax(want));
        ensure!(
            g == w || top_gap(want) < tie_gap,
            "{what}: argmax {g} instead of {w}"
        );
        Ok(())
    }
}

/// Stands in while an executor is reloaded; never called.
struct Placeholder;

impl LayerExecutor for Placeholder {
    fn config(&self) -> &kiln_core::ModelConfig {
        unreachable!("placeholder executor")
    }
    fn max_context(&self) -> usize {
        0
    }
    fn max_sequences(&self) -> usize {
        0
    }
    fn new_sequence(&mut self) -> kiln_core::Result<SeqId> {
        Err(Error::InvalidArgument("no executor loaded".into()))
    }
    fn free_sequence(&mut self, _: SeqId) -> kiln_core::Result<()> {
        Err(Error::InvalidArgument("no executor loaded".into()))
    }
    fn sequence_len(&self, _: SeqId) -> kiln_core::Result<usize> {
        Err(Error::InvalidArgument("no executor loaded".into()))
    }
    fn truncate_sequence(&mut self, _: SeqId, _: usize) -> kiln_core::Result<()> {
        Err(Error::InvalidArgument("no executor loaded".into()))
    }
    fn prefill(&mut self, _: SeqId, _: &[u32], _: &mut [f32]) -> kiln_core::Result<()> {
        Err(Error::InvalidArgument("no executor loaded".into()))
    }
    fn decode(&mut self, _: &[DecodeItem], _: &mut [f32]) -> kiln_core::Result<()> {
        Err(Error::InvalidArgument("no executor loaded".into()))
    }
}

/// Gap between the largest and the second-largest value: how close a greedy choice is to
/// a tie.
pub fn top_gap(v: &[f32]) -> f32 {
    let (mut a, mut b) = (f32::NEG_INFINITY, f32::NEG_INFINITY);
    for &x in v {
        if x > a {
            b = a;
            a = x;
        } else if x > b {
            b = x;
        }
    }
    a - b
}

type Check = fn(&mut Harness, &Options) -> Step<Done>;

/// The contract checks, each starting from an executor with no live sequence.
const CONTRACT: &[(&str, Check)] = &[
    ("lifecycle.new_free_reuse", lifecycle_new_free_reuse),
    ("lifecycle.capacity_is_typed_error", lifecycle_capacity),
    ("truncate.keeps_prefix", truncate_keeps_prefix),
    ("truncate.past_end_is_error", truncate_past_end),
    ("batch.mixed_positions", batch_mixed_positions),
    ("batch.empty_is_noop", batch_empty),
    ("context.limit_is_typed_error", context_limit),
    ("errors.unknown_sequence", errors_unknown_sequence),
    ("errors.empty_prompt", errors_empty_prompt),
    ("errors.token_out_of_vocab", errors_token_out_of_vocab),
    ("errors.duplicate_in_batch", errors_duplicate_in_batch),
    ("errors.buffer_length", errors_buffer_length),
];

#[allow(clippy::too_many_arguments)]
fn run_model(
    backend: &dyn Backend,
    label: &str,
    ir: &ModelIr,
    prompts: Option<&[Vec<u32>]>,
    text: Option<&[u32]>,
    options: &Options,
    report: &mut Report,
) {
    let m = Some(label);
    let (context, sequences) = match prompts {
        None => (SYNTH_CONTEXT, SYNTH_SEQUENCES),
        Some(p) => (
            (p.iter().map(Vec::len).max().unwrap_or(1) + options.steps + 1).max(SCORE_CONTEXT),
            1,
        ),
    };
    let load = LoadOptions {
        max_context: context,
        max_sequences: sequences,
        threads: options.threads,
        progress: None,
        quantized_activations: options.quantized_activations,
        sequential_decode: false,
        kv_type: None,
        kv_memory: None,
        tensor_parallel: 0,
    };
    let oracle_options = LoadOptions {
        max_sequences: 1,
        quantized_activations: false,
        ..load.clone()
    };
    let mut oracle = match CpuBackend.load(ir, &oracle_options) {
        Ok(o) => o,
        Err(e) => {
            return report.push(
                "load.model",
                m,
                Outcome::Skip,
                format!("the CPU oracle cannot load it: {e}"),
            )
        }
    };
    let exec = match guarded(|| backend.load(ir, &load)) {
        Ok(Ok(exec)) => exec,
        Ok(Err(e)) => {
            return report.push(
                "load.model",
                m,
                Outcome::Fail,
                format!("load() failed after supports() said yes: {e}"),
            )
        }
        Err(p) => {
            return report.push(
                "load.model",
                m,
                Outcome::Fail,
                format!("load() panicked: {p}"),
            )
        }
    };
    let (ctx, seqs) = (exec.max_context(), exec.max_sequences());
    let problem = if exec.config() != &ir.config {
        Some("config() differs from the model's configuration".to_string())
    } else if ctx == 0 || ctx > context {
        Some(format!(
            "max_context() is {ctx}; asked for {context}, so it must be 1..={context}"
        ))
    } else if seqs == 0 || seqs > sequences {
        Some(format!(
            "max_sequences() is {seqs}; asked for {sequences}, so it must be 1..={sequences}"
        ))
    } else {
        None
    };
    if let Some(p) = problem {
        return report.push("load.model", m, Outcome::Fail, p);
    }
    report.push(
        "load.model",
        m,
        Outcome::Pass,
        format!("max_context {ctx}, max_sequences {seqs}"),
    );

    let mut h = Harness {
        backend,
        ir,
        load,
        exec,
        vocab: ir.config.vocab_size,
        alive: Vec::new(),
        output_calls: 0,
        unwritten: Vec::new(),
        rejected: 0,
        changed: Vec::new(),
    };
    let mut usable: Step<()> = Ok(());
    if prompts.is_none() {
        for &(rule, check) in CONTRACT {
            if let Err(why) = &usable {
                report.push(rule, m, Outcome::Fail, format!("not run: {}", why.why));
                continue;
            }
            let verdict = guarded(|| check(&mut h, options))
                .unwrap_or_else(|p| Err(format!("panicked: {p}").into()));
            match verdict {
                Ok(Done::Pass(d)) => report.push(rule, m, Outcome::Pass, d),
                Ok(Done::Skip(d)) => report.push(rule, m, Outcome::Skip, d),
                Err(f) => report.fail_or_defer(rule, m, f),
            }
            // A failed check may leave anything behind: start the next on a fresh executor.
            match report.findings.last().map(|f| f.outcome) {
                Some(Outcome::Fail) => usable = h.reload(),
                _ => h.release_all(),
            }
        }
    }
    if usable.is_ok() {
        let all = match prompts {
            None => vec![prompt(SYNTH_PROMPT, h.vocab, 1)],
            Some(p) => p.to_vec(),
        };
        parity(&mut h, oracle.as_mut(), &all, options, label, report);
        // Chunks of the text (each from an empty sequence, BOS first as the text has it),
        // or one random prompt on a synthetic model; the second half of each is scored.
        let chunks: Vec<Vec<u32>> = match text {
            None => vec![prompt(SYNTH_CONTEXT - 1, h.vocab, 2)],
            Some(t) => {
                let bos = t.first().copied();
                t.chunks_exact(SCORE_CONTEXT)
                    .take(SCORE_CHUNKS)
                    .map(|c| {
                        let mut c = c[..SCORE_CONTEXT - 1].to_vec();
                        c[0] = bos.expect("a whole chunk has a first token");
                        c
                    })
                    .collect()
            }
        };
        scoring(&mut h, oracle.as_mut(), &chunks, options, label, report);
    }

    if prompts.is_none() {
        let state = match (h.changed.first(), h.rejected) {
            (Some(first), _) => (
                Outcome::Fail,
                format!(
                    "{} of {} rejected calls changed a length; first: {first}",
                    h.changed.len(),
                    h.rejected
                ),
            ),
            (None, 0) => (Outcome::Skip, "no call was rejected".to_string()),
            (None, n) => (
                Outcome::Pass,
                format!("{n} rejected calls, every length kept"),
            ),
        };
        report.push("errors.state_unchanged", m, state.0, state.1);
    }
    let outputs = match h.unwritten.first() {
        Some(first) => (
            Outcome::Fail,
            format!(
                "{} of {} calls left logits unwritten or non-finite; first: {first}",
                h.unwritten.len(),
                h.output_calls
            ),
        ),
        None => (
            Outcome::Pass,
            format!("{} calls, every value written and finite", h.output_calls),
        ),
    };
    report.push("logits.all_written_and_finite", m, outputs.0, outputs.1);
}

/// What one or more teacher-forced runs measured.
#[derive(Default)]
struct Parity {
    steps: usize,
    min_cos: f64,
    worst: String,
    near_ties: usize,
    near_tie_diffs: usize,
    diffs: Vec<String>,
}

fn parity(
    h: &mut Harness,
    oracle: &mut dyn LayerExecutor,
    prompts: &[Vec<u32>],
    o: &Options,
    label: &str,
    report: &mut Report,
) {
    let mut p = Parity {
        min_cos: f64::INFINITY,
        ..Parity::default()
    };
    let mut failed: Option<Fail> = None;
    for (i, prompt) in prompts.iter().enumerate() {
        let steps = o
            .steps
            .min(h.exec.max_context().saturating_sub(prompt.len()));
        let os = match oracle.new_sequence() {
            Ok(s) => s,
            Err(e) => {
                failed = Some(format!("the oracle failed: {e}").into());
                break;
            }
        };
        let r = guarded(|| parity_run(h, oracle, os, prompt, steps, i, o, &mut p))
            .unwrap_or_else(|x| Err(format!("panicked: {x}").into()));
        let _ = oracle.free_sequence(os);
        h.release_all();
        if let Err(e) = r {
            failed = Some(e);
            break;
        }
    }
    let m = Some(label);
    if let Some(f) = failed {
        for rule in ["parity.cosine", "parity.greedy"] {
            report.fail_or_defer(
                rule,
                m,
                Fail {
                    why: format!("could not run: {}", f.why),
                    blame: f.blame,
                },
            );
        }
        return;
    }
    let cos = format!(
        "min cosine {:.7} over {} steps ({}; bar {})",
        p.min_cos, p.steps, p.worst, o.min_cosine
    );
    report.push(
        "parity.cosine",
        m,
        if p.min_cos >= o.min_cosine {
            Outcome::Pass
        } else {
            Outcome::Fail
        },
        cos,
    );
    let ties = format!(
        "{} near-ties (gap < {}), {} of them differing",
        p.near_ties, o.tie_gap, p.near_tie_diffs
    );
    match p.diffs.len() {
        0 => report.push(
            "parity.greedy",
            m,
            Outcome::Pass,
            format!(
                "{} of {} greedy tokens equal; {ties}",
                p.steps - p.near_tie_diffs,
                p.steps
            ),
        ),
        n => report.push(
            "parity.greedy",
            m,
            Outcome::Fail,
            format!(
                "{n} of {} greedy tokens differ away from near-ties: {}; {ties}",
                p.steps,
                p.diffs
                    .iter()
                    .take(3)
                    .cloned()
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
        ),
    }
}

/// KL-divergence of a scoring prefill from the oracle's: each chunk through
/// `prefill_logits` on both from an empty sequence, its second half scored.
fn scoring(
    h: &mut Harness,
    oracle: &mut dyn LayerExecutor,
    chunks: &[Vec<u32>],
    o: &Options,
    label: &str,
    report: &mut Report,
) {
    let m = Some(label);
    if chunks.is_empty() {
        return report.push(
            "scoring.kl_divergence",
            m,
            Outcome::Skip,
            format!("the text is shorter than one chunk of {SCORE_CONTEXT} tokens"),
        );
    }
    let vocab = h.vocab;
    let mut run = |h: &mut Harness| -> Step<(f64, f64, usize, usize)> {
        let (mut sum, mut worst, mut rows, mut same_top) = (0f64, 0f64, 0usize, 0usize);
        for chunk in chunks {
            let first = chunk.len() / 2;
            let n = chunk.len() - first;
            let mut want = vec![0f32; n * vocab];
            let os = oracle
                .new_sequence()
                .map_err(|e| format!("the oracle failed: {e}"))?;
            let r = oracle.prefill_logits(os, chunk, first, &mut want);
            let _ = oracle.free_sequence(os);
            r.map_err(|e| format!("the oracle's prefill_logits failed: {e}"))?;
            let s = h.new_seq()?;
            let got = h.prefill_logits(s, chunk, first)?;
            h.release_all();
            for (w, g) in want.chunks_exact(vocab).zip(got.chunks_exact(vocab)) {
                let kld = kl_divergence(w, g);
                // Written so that a NaN divergence is the worst.
                if !(kld <= worst) {
                    worst = kld;
                }
                sum += kld;
                rows += 1;
                same_top += usize::from(argmax(w) == argmax(g));
            }
        }
        Ok((sum / rows as f64, worst, rows, same_top))
    };
    match guarded(|| run(h)).unwrap_or_else(|x| Err(format!("panicked: {x}").into())) {
        Ok((mean, worst, rows, same_top)) => report.push(
            "scoring.kl_divergence",
            m,
            if mean <= o.max_kld {
                Outcome::Pass
            } else {
                Outcome::Fail
            },
            format!(
                "mean KLD {mean:.6} (worst row {worst:.6}) over {rows} rows of {} chunk(s); same top token {:.2}%; bar {}",
                chunks.len(),
                100.0 * same_top as f64 / rows as f64,
                o.max_kld
            ),
        ),
        Err(f) => report.fail_or_defer(
            "scoring.kl_divergence",
            m,
            Fail {
                why: format!("could not run: {}", f.why),
                blame: f.blame,
            },
        ),
    }
}

/// KL-divergence (nats) of the distribution of logits `q` from that of logits `p`,
/// Σ p·(ln p − ln q), in f64.
pub fn kl_divergence(p: &[f32], q: &[f32]) -> f64 {
    fn log_norm(v: &[f32]) -> f64 {
        let max = v.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
        max + v.iter().map(|&x| (x as f64 - max).exp()).sum::<f64>().ln()
    }
    let (np, nq) = (log_norm(p), log_norm(q));
    p.iter()
        .zip(q)
        .map(|(&a, &b)| {
            let lp = a as f64 - np;
            lp.exp() * (lp - (b as f64 - nq))
        })
        .sum()
}

/// One teacher-forced run: prefill `prompt` on both, then `steps` decode steps feeding
/// both the oracle's greedy token; every step's logits are compared.
#[allow(clippy::too_many_arguments)]
fn parity_run(
    h: &mut Harness,
    oracle: &mut dyn LayerExecutor,
    os: SeqId,
    prompt: &[u32],
    steps: usize,
    run: usize,
    o: &Options,
    p: &mut Parity,
) -> Step<()> {
    let mut want = vec![0.0f32; h.vocab];
    oracle
        .prefill(os, prompt, &mut want)
        .map_err(|e| format!("the oracle's prefill failed: {e}"))?;
    let s = h.new_seq()?;
    let mut got = h.prefill(s, prompt)?;
    for step in 0..=steps {
        let where_ = if run == 0 {
            format!("step {step}")
        } else {
            format!("prompt {run} step {step}")
        };
        let c = cosine(&got, &want);
        if c < p.min_cos || c.is_nan() {
            p.min_cos = if c.is_nan() { f64::NEG_INFINITY } else { c };
            p.worst = format!("worst at {where_}");
        }
        let gap = top_gap(&want);
        let (g, w) = (argmax(&got), argmax(&want));
        if gap < o.tie_gap {
            p.near_ties += 1;
            p.near_tie_diffs += usize::from(g != w);
        } else if g != w {
            p.diffs
                .push(format!("{where_}: {g} instead of {w} (gap {gap:.3})"));
        }
        p.steps += 1;
        if step == steps {
            break;
        }
        oracle
            .decode(&[DecodeItem { seq: os, token: w }], &mut want)
            .map_err(|e| format!("the oracle's decode failed: {e}"))?;
        got = h.decode(&[(s, w)])?;
    }
    Ok(())
}

// ---- the contract checks ------------------------------------------------------------

fn lifecycle_new_free_reuse(h: &mut Harness, o: &Options) -> Step<Done> {
    let q = prompt(7, h.vocab, 2);
    let a = h.new_seq()?;
    h.expect_len(a, 0, "new_sequence")?;
    let fresh = h.prefill(a, &q)?;
    // Dirty positions past the prompt, so a slot reused without a reset would show.
    for t in prompt(9, h.vocab, 3) {
        h.decode(&[(a, t)])?;
    }
    h.free(a)?;
    h.reject(
        &format!("sequence_len({a}) after free_sequence({a})"),
        &[],
        |e| e.sequence_len(a),
    )?;
    h.reject(&format!("a second free_sequence({a})"), &[], |e| {
        e.free_sequence(a)
    })?;
    let b = h.new_seq()?;
    h.expect_len(b, 0, "new_sequence after a free")?;
    let again = h.prefill(b, &q)?;
    h.agree(
        &again,
        &fresh,
        o.min_cosine,
        o.tie_gap,
        "the same prompt in a sequence made after a free",
    )?;
    h.free(b)?;
    Ok(Done::Pass(format!(
        "new sequences empty, freed id {a} unknown, reuse computes like a fresh sequence"
    )))
}

fn lifecycle_capacity(h: &mut Harness, _: &Options) -> Step<Done> {
    let n = h.exec.max_sequences();
    let mut ids = Vec::new();
    for _ in 0..n {
        let s = h.new_seq()?;
        h.expect_len(s, 0, "new_sequence")?;
        ensure!(
            !ids.contains(&s),
            "new_sequence returned id {s} twice while both are alive"
        );
        ids.push(s);
    }
    let r = h.exec.new_sequence();
    if let Ok(extra) = &r {
        h.alive.push(*extra);
    }
    h.reject(
        &format!("new_sequence with all {n} sequences alive"),
        &ids,
        |_| r,
    )?;
    h.free(ids[0])?;
    let s = h.new_seq()?;
    h.expect_len(s, 0, "new_sequence after freeing one of a full set")?;
    Ok(Done::Pass(format!(
        "{n} distinct live sequences; one more is InvalidArgument; a free makes room"
    )))
}

fn truncate_keeps_prefix(h: &mut Harness, o: &Options) -> Step<Done> {
    let p = prompt(12, h.vocab, 4);
    let s = h.new_seq()?;
    let whole = h.prefill(s, &p)?;
    let (x1, x2) = (argmax(&whole), 5 % h.vocab as u32);
    let after_x1 = h.decode(&[(s, x1)])?;
    h.decode(&[(s, x2)])?;
    h.truncate(s, 12)?;
    let again = h.decode(&[(s, x1)])?;
    h.agree(
        &again,
        &after_x1,
        o.min_cosine,
        o.tie_gap,
        "decode after truncating back to the prompt",
    )?;
    h.truncate(s, 6)?;
    let rest = h.prefill(s, &p[6..])?;
    h.agree(
        &rest,
        &whole,
        o.min_cosine,
        o.tie_gap,
        "the prompt's second half prefilled after truncating to its first",
    )?;
    h.truncate(s, 0)?;
    let redo = h.prefill(s, &p)?;
    h.agree(
        &redo,
        &whole,
        o.min_cosine,
        o.tie_gap,
        "the prompt prefilled again after truncating to 0",
    )?;
    Ok(Done::Pass(
        "truncating to 12, 6 and 0 keeps exactly that prefix".into(),
    ))
}

fn truncate_past_end(h: &mut Harness, _: &Options) -> Step<Done> {
    let s = h.new_seq()?;
    h.prefill(s, &prompt(5, h.vocab, 5))?;
    h.reject(
        &format!("truncate_sequence({s}, 6) of a 5-token sequence"),
        &[s],
        |e| e.truncate_sequence(s, 6),
    )?;
    h.expect_len(s, 5, "a refused truncation")?;
    h.truncate(s, 5)?;
    h.truncate(s, 0)?;
    Ok(Done::Pass(
        "past the end is InvalidArgument; to the length is a no-op; to 0 empties".into(),
    ))
}

fn batch_mixed_positions(h: &mut Harness, o: &Options) -> Step<Done> {
    let n = h.exec.max_sequences().min(3);
    if n < 2 {
        return Ok(Done::Skip("max_sequences is 1: no batch to check".into()));
    }
    let lens = [3usize, 9, 17];
    let mut items = Vec::new();
    for (i, &len) in lens[..n].iter().enumerate() {
        let s = h.new_seq()?;
        let l = h.prefill(s, &prompt(len, h.vocab, 10 + i as u32))?;
        items.push((s, argmax(&l), len));
    }
    // Each alone, then back to where it was.
    let mut alone = Vec::new();
    for &(s, t, len) in &items {
        alone.push(h.decode(&[(s, t)])?);
        h.truncate(s, len)?;
    }
    let vocab = h.vocab;
    for order in [(0..n).collect::<Vec<_>>(), (0..n).rev().collect()] {
        let batch: Vec<(SeqId, u32)> = order.iter().map(|&i| (items[i].0, items[i].1)).collect();
        let rows = h.decode(&batch)?;
        for (row, &i) in order.iter().enumerate() {
            let what = format!(
                "row {row} of a batch (sequence {} at position {})",
                items[i].0, items[i].2
            );
            h.agree(
                &rows[row * vocab..(row + 1) * vocab],
                &alone[i],
                o.min_cosine,
                o.tie_gap,
                &what,
            )?;
        }
        for &(s, _, len) in &items {
            h.expect_len(s, len + 1, "a decode batch")?;
            h.truncate(s, len)?;
        }
    }
    Ok(Done::Pass(format!(
        "batches of {n} at positions {:?}, both orders, match each sequence alone",
        &lens[..n]
    )))
}

fn batch_empty(h: &mut Harness, _: &Options) -> Step<Done> {
    let s = h.new_seq()?;
    h.prefill(s, &prompt(4, h.vocab, 6))?;
    h.exec
        .decode(&[], &mut [])
        .map_err(|e| format!("decode of an empty batch failed: {e}"))?;
    h.expect_len(s, 4, "decode of an empty batch")?;
    Ok(Done::Pass("an empty batch is a no-op".into()))
}

fn context_limit(h: &mut Harness, _: &Options) -> Step<Done> {
    let c = h.exec.max_context();
    if c < 4 {
        return Ok(Done::Skip(format!(
            "max_context is {c}: too small to fill and check"
        )));
    }
    let s = h.new_seq()?;
    h.prefill(s, &prompt(c - 2, h.vocab, 7))?;
    let over = prompt(3, h.vocab, 8);
    h.reject(
        &format!("prefill of 3 tokens onto {} of {c}", c - 2),
        &[s],
        |e| e.prefill(s, &over, &mut vec![0.0; e.config().vocab_size]),
    )?;
    h.decode(&[(s, 1)])
        .map_err(|f| f.within(format!("position {} of {c}", c - 2)))?;
    h.decode(&[(s, 2)])
        .map_err(|f| f.within(format!("the last position, {} of {c}", c - 1)))?;
    h.expect_len(s, c, "filling the context")?;
    h.reject(
        &format!("decode on a full sequence ({c} of {c} tokens)"),
        &[s],
        |e| {
            e.decode(
                &[DecodeItem { seq: s, token: 3 }],
                &mut vec![0.0; e.config().vocab_size],
            )
        },
    )?;
    h.reject(
        &format!("prefill of 1 token on a full sequence ({c} of {c})"),
        &[s],
        |e| e.prefill(s, &[3], &mut vec![0.0; e.config().vocab_size]),
    )?;
    if h.exec.max_sequences() >= 2 {
        let t = h.new_seq()?;
        h.prefill(t, &[1, 2])?;
        h.reject(
            "a decode batch whose second item is a full sequence",
            &[t, s],
            |e| {
                let items = [
                    DecodeItem { seq: t, token: 4 },
                    DecodeItem { seq: s, token: 4 },
                ];
                e.decode(&items, &mut vec![0.0; 2 * e.config().vocab_size])
            },
        )?;
        h.expect_len(t, 2, "a refused batch")?;
    }
    h.truncate(s, c - 1)?;
    h.decode(&[(s, 5)])
        .map_err(|f| f.within("decode after truncating a full sequence by one"))?;
    Ok(Done::Pass(format!(
        "fills to exactly {c}; past it prefill and decode are InvalidArgument"
    )))
}

/// A live sequence holding 3 tokens, for the misuse checks.
fn three_tokens(h: &mut Harness) -> Step<SeqId> {
    let s = h.new_seq()?;
    h.prefill(s, &prompt(3, h.vocab, 9))?;
    Ok(s)
}

/// The executor still works after misuse: one more step on `s`.
fn still_works(h: &mut Harness, s: SeqId, len: usize) -> Step<()> {
    h.expect_len(s, len, "the refused calls")?;
    h.decode(&[(s, 1)])
        .map(|_| ())
        .map_err(|f| f.within("the executor stopped working after refused calls"))
}

fn errors_unknown_sequence(h: &mut Harness, _: &Options) -> Step<Done> {
    let s = three_tokens(h)?;
    let u = (0..)
        .map(|i: u32| s.wrapping_add(7919).wrapping_add(i))
        .find(|u| !h.alive.contains(u))
        .expect("a free id");
    let v = h.vocab;
    h.reject(&format!("sequence_len({u}) of an unknown id"), &[s], |e| {
        e.sequence_len(u)
    })?;
    h.reject(&format!("free_sequence({u}) of an unknown id"), &[s], |e| {
        e.free_sequence(u)
    })?;
    h.reject(
        &format!("truncate_sequence({u}, 0) of an unknown id"),
        &[s],
        |e| e.truncate_sequence(u, 0),
    )?;
    h.reject(&format!("prefill on unknown id {u}"), &[s], |e| {
        e.prefill(u, &[1], &mut vec![0.0; v])
    })?;
    h.reject(&format!("decode of unknown id {u}"), &[s], |e| {
        e.decode(&[DecodeItem { seq: u, token: 1 }], &mut vec![0.0; v])
    })?;
    h.reject(
        &format!("a decode batch of live {s} and unknown {u}"),
        &[s],
        |e| {
            e.decode(
                &[
                    DecodeItem { seq: s, token: 1 },
                    DecodeItem { seq: u, token: 1 },
                ],
                &mut vec![0.0; 2 * v],
            )
        },
    )?;
    still_works(h, s, 3)?;
    Ok(Done::Pass(format!(
        "id {u}: all six calls are InvalidArgument"
    )))
}

fn errors_empty_prompt(h: &mut Harness, _: &Options) -> Step<Done> {
    let s = three_tokens(h)?;
    let v = h.vocab;
    h.reject("prefill of zero tokens", &[s], |e| {
        e.prefill(s, &[], &mut vec![0.0; v])
    })?;
    still_works(h, s, 3)?;
    Ok(Done::Pass("InvalidArgument".into()))
}

fn errors_token_out_of_vocab(h: &mut Harness, _: &Options) -> Step<Done> {
    let s = three_tokens(h)?;
    let v = h.vocab;
    let big = v as u32;
    h.reject(
        &format!("prefill with token {big} (vocab {v})"),
        &[s],
        |e| e.prefill(s, &[1, big], &mut vec![0.0; v]),
    )?;
    h.reject(&format!("decode with token {big}"), &[s], |e| {
        e.decode(&[DecodeItem { seq: s, token: big }], &mut vec![0.0; v])
    })?;
    h.reject("decode with token u32::MAX", &[s], |e| {
        e.decode(
            &[DecodeItem {
                seq: s,
                token: u32::MAX,
            }],
            &mut vec![0.0; v],
        )
    })?;
    if h.exec.max_sequences() >= 2 {
        let t = three_tokens(h)?;
        h.reject(
            &format!("a decode batch whose second token is {big}"),
            &[s, t],
            |e| {
                e.decode(
                    &[
                        DecodeItem { seq: s, token: 1 },
                        DecodeItem { seq: t, token: big },
                    ],
                    &mut vec![0.0; 2 * v],
                )
            },
        )?;
    }
    still_works(h, s, 3)?;
    Ok(Done::Pass(format!(
        "ids ≥ {v} are InvalidArgument in prefill and decode"
    )))
}

fn errors_duplicate_in_batch(h: &mut Harness, _: &Options) -> Step<Done> {
    let s = three_tokens(h)?;
    let v = h.vocab;
    h.reject(
        &format!("a decode batch naming sequence {s} twice"),
        &[s],
        |e| {
            e.decode(
                &[
                    DecodeItem { seq: s, token: 1 },
                    DecodeItem { seq: s, token: 2 },
                ],
                &mut vec![0.0; 2 * v],
            )
        },
    )?;
    still_works(h, s, 3)?;
    Ok(Done::Pass("InvalidArgument".into()))
}

fn errors_buffer_length(h: &mut Harness, _: &Options) -> Step<Done> {
    let s = three_tokens(h)?;
    let v = h.vocab;
    for n in [v - 1, v + 1, 0] {
        h.reject(&format!("prefill into {n} logits (vocab {v})"), &[s], |e| {
            e.prefill(s, &[1], &mut vec![0.0; n])
        })?;
    }
    for n in [2 * v, v - 1, 0] {
        h.reject(&format!("decode of 1 item into {n} logits"), &[s], |e| {
            e.decode(&[DecodeItem { seq: s, token: 1 }], &mut vec![0.0; n])
        })?;
    }
    still_works(h, s, 3)?;
    Ok(Done::Pass(
        "short and long buffers are InvalidArgument".into(),
    ))
}
