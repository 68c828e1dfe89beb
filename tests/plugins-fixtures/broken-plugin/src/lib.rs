//! # kiln-fixture-broken-plugin
//!
//! The built-in CPU executor behind the plugin ABI with one deliberate fault, chosen by
//! `KILN_FIXTURE_FAULT` when the plugin is created (tests/tests/plugins.rs runs
//! `kiln conformance` on it once per fault, each in its own process). Each fault breaks one
//! rule of the conformance suite, which must fail naming it:
//!
//! | fault | what it does wrong | rule it breaks |
//! |---|---|---|
//! | `none` | nothing (the control: passes) | — |
//! | `half_logits` | writes only the first half of each logits row | `logits.all_written_and_finite` |
//! | `ignore_truncate` | `truncate_sequence` returns OK and does nothing | `truncate.keeps_prefix`, `truncate.past_end_is_error` |
//! | `wrong_logits` | shifts every logits row by one token | `parity.cosine`, `parity.greedy` |
//! | `swapped_batch` | writes the rows of a decode batch in reverse order | `batch.mixed_positions` |
//! | `untyped_errors` | reports every error as a generic backend error | `errors.*` |
//! | `context_overflow` | decoding a full sequence drops its last token instead of failing | `context.limit_is_typed_error` |
//!
//! The backend is named `broken-<fault>`. A model whose `source` contains
//! `kiln-fixture-fault=<fault>` is loaded with that fault instead, so one process can test
//! several (the host's logits guard test does).

use kiln_backend_cpu::CpuBackend;
use kiln_plugin_sdk::kiln_core::{
    Backend, DecodeItem, Error, LayerExecutor, LoadOptions, ModelConfig, ModelIr, QType, Result,
    SeqId, Support,
};

kiln_plugin_sdk::export_backend!(try Broken::from_env);

#[derive(Clone, Copy, PartialEq, Eq)]
enum Fault {
    None,
    HalfLogits,
    IgnoreTruncate,
    WrongLogits,
    SwappedBatch,
    UntypedErrors,
    ContextOverflow,
}

const FAULTS: [(&str, Fault); 7] = [
    ("none", Fault::None),
    ("half_logits", Fault::HalfLogits),
    ("ignore_truncate", Fault::IgnoreTruncate),
    ("wrong_logits", Fault::WrongLogits),
    ("swapped_batch", Fault::SwappedBatch),
    ("untyped_errors", Fault::UntypedErrors),
    ("context_overflow", Fault::ContextOverflow),
];

pub struct Broken {
    fault: Fault,
    name: String,
    description: String,
}

impl Broken {
    fn from_env() -> std::result::Result<Broken, String> {
        let asked = std::env::var("KILN_FIXTURE_FAULT").unwrap_or_else(|_| "none".into());
        let Some(&(name, fault)) = FAULTS.iter().find(|(n, _)| *n == asked) else {
            let known: Vec<&str> = FAULTS.iter().map(|(n, _)| *n).collect();
            return Err(format!(
                "KILN_FIXTURE_FAULT={asked} is none of {}",
                known.join(", ")
            ));
        };
        Ok(Broken {
            fault,
            name: format!("broken-{name}"),
            description: format!(
                "test fixture: the CPU executor with one deliberate fault ({name})"
            ),
        })
    }
}

impl Backend for Broken {
    fn name(&self) -> &str {
        &self.name
    }
    fn description(&self) -> &str {
        &self.description
    }
    fn qtypes(&self) -> Vec<QType> {
        CpuBackend.qtypes()
    }
    fn probe(&self) -> Result<String, String> {
        Ok("the host CPU, through the oracle's own executor".into())
    }
    fn supports(&self, model: &ModelIr) -> Support {
        match CpuBackend.supports(model) {
            Support::Yes { .. } => Support::Yes {
                score: 1,
                note: "a test fixture; never pick it".into(),
            },
            no => no,
        }
    }
    fn load(&self, model: &ModelIr, options: &LoadOptions) -> Result<Box<dyn LayerExecutor>> {
        let fault = model
            .source
            .split_once("kiln-fixture-fault=")
            .and_then(|(_, rest)| FAULTS.iter().find(|(n, _)| rest.starts_with(n)))
            .map_or(self.fault, |&(_, f)| f);
        Ok(Box::new(BrokenExecutor {
            inner: CpuBackend.load(model, options)?,
            fault,
            scratch: Vec::new(),
        }))
    }
}

struct BrokenExecutor {
    inner: Box<dyn LayerExecutor>,
    fault: Fault,
    scratch: Vec<f32>,
}

impl BrokenExecutor {
    /// The fault `untyped_errors`: every error loses its kind.
    fn typed<T>(&self, r: Result<T>) -> Result<T> {
        match (self.fault, r) {
            (Fault::UntypedErrors, Err(e)) => Err(Error::Backend {
                backend: "broken".into(),
                message: e.to_string(),
            }),
            (_, r) => r,
        }
    }

    /// Post-processes rows the inner executor computed into `scratch`, writing `out`.
    fn emit(&mut self, out: &mut [f32], rows: usize) {
        let vocab = self.inner.config().vocab_size;
        match self.fault {
            Fault::HalfLogits => {
                for (o, s) in out.chunks_mut(vocab).zip(self.scratch.chunks(vocab)) {
                    o[..vocab / 2].copy_from_slice(&s[..vocab / 2]);
                }
            }
            Fault::WrongLogits => {
                for (o, s) in out.chunks_mut(vocab).zip(self.scratch.chunks(vocab)) {
                    for (i, v) in o.iter_mut().enumerate() {
                        *v = s[(i + 1) % vocab];
                    }
                }
            }
            Fault::SwappedBatch if rows > 1 => {
                for (r, o) in out.chunks_mut(vocab).enumerate() {
                    o.copy_from_slice(&self.scratch[(rows - 1 - r) * vocab..][..vocab]);
                }
            }
            _ => out.copy_from_slice(&self.scratch),
        }
    }
}

impl LayerExecutor for BrokenExecutor {
    fn config(&self) -> &ModelConfig {
        self.inner.config()
    }
    fn max_context(&self) -> usize {
        self.inner.max_context()
    }
    fn max_sequences(&self) -> usize {
        self.inner.max_sequences()
    }
    fn new_sequence(&mut self) -> Result<SeqId> {
        let r = self.inner.new_sequence();
        self.typed(r)
    }
    fn free_sequence(&mut self, seq: SeqId) -> Result<()> {
        let r = self.inner.free_sequence(seq);
        self.typed(r)
    }
    fn sequence_len(&self, seq: SeqId) -> Result<usize> {
        self.typed(self.inner.sequence_len(seq))
    }
    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> Result<()> {
        if self.fault == Fault::IgnoreTruncate {
            return Ok(());
        }
        let r = self.inner.truncate_sequence(seq, len);
        self.typed(r)
    }
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> Result<()> {
        self.scratch.resize(logits.len(), 0.0);
        let r = self.inner.prefill(seq, tokens, &mut self.scratch);
        self.typed(r)?;
        self.emit(logits, 1);
        Ok(())
    }
    fn decode(&mut self, batch: &[DecodeItem], logits: &mut [f32]) -> Result<()> {
        if self.fault == Fault::ContextOverflow {
            // Makes room by forgetting the newest position: the step "succeeds".
            for item in batch {
                if let Ok(len) = self.inner.sequence_len(item.seq) {
                    if len >= self.inner.max_context() {
                        self.inner.truncate_sequence(item.seq, len - 1)?;
                    }
                }
            }
        }
        self.scratch.resize(logits.len(), 0.0);
        let r = self.inner.decode(batch, &mut self.scratch);
        self.typed(r)?;
        self.emit(logits, batch.len());
        Ok(())
    }
}
