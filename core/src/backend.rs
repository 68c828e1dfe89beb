//! The two traits every compute backend implements.
//!
//! A [`Backend`] is a factory that knows whether its device is present and which models it
//! can run; [`Backend::load`] turns a [`ModelIr`] into a [`LayerExecutor`]: the model
//! resident on the device, ready to run sequences. The executor's interface is shaped so a
//! GPU can keep everything resident: per step the host hands in token ids and gets back
//! logits or sampled ids, nothing else.

use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ir::{ModelConfig, ModelIr};
use crate::qtype::QType;
use crate::sampling::Sampler;

/// Handle of one sequence (one conversation's KV cache) inside an executor.
pub type SeqId = u32;

/// Progress of a long load (weight upload), as (bytes done, bytes total).
pub type ProgressFn = Arc<dyn Fn(u64, u64) + Send + Sync>;

/// How to load a model.
#[derive(Clone, Default)]
pub struct LoadOptions {
    /// Longest context per sequence; 0 means the model's own, capped at
    /// [`LoadOptions::DEFAULT_MAX_CONTEXT`].
    pub max_context: usize,
    /// Sequences that may be alive at once; 0 means 1.
    pub max_sequences: usize,
    /// Worker threads for CPU work; `None` means all cores.
    pub threads: Option<usize>,
    pub progress: Option<ProgressFn>,
    /// Let a GPU backend quantise activations to 8 bits (Q8_1) for integer dot products:
    /// faster matrix-vector products, but logits drift from the f32 reference, on real
    /// models past what greedy decoding tolerates (see docs/architecture.md; cuda-q4k's
    /// default keeps 15 bits and stays within the parity bar). Off by default; the CPU
    /// reference never quantises activations and ignores it.
    pub quantized_activations: bool,
}

impl LoadOptions {
    pub const DEFAULT_MAX_CONTEXT: usize = 4096;

    /// The context length these options give for `config`.
    pub fn context_for(&self, config: &ModelConfig) -> usize {
        match self.max_context {
            0 => config.context_length.clamp(1, Self::DEFAULT_MAX_CONTEXT),
            n => n,
        }
    }

    pub fn sequences(&self) -> usize {
        self.max_sequences.max(1)
    }
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("max_context", &self.max_context)
            .field("max_sequences", &self.max_sequences)
            .field("threads", &self.threads)
            .field("quantized_activations", &self.quantized_activations)
            .finish_non_exhaustive()
    }
}

/// The scores of automatic backend selection (`Support::Yes { score }`; the highest wins)
/// and the rule that assigns them. Built-in backends use exactly these; a plugin that wants
/// to be chosen by the same rule uses them too.
///
/// The rule: a model is *mostly* of a weight family when that family holds more than
/// [`MAJORITY`] of its layers' matmul bytes ([`crate::ModelIr::matmul_share`]). A GPU
/// executor built for the model's majority family scores [`GPU_SPECIALIST`]; the GPU
/// executor with the broadest kernel set (`cuda-q4k`: every K-quant and legacy type) scores
/// [`GPU_GENERAL`] otherwise; any other GPU executor that can run the model scores
/// [`GPU_OTHER_FAMILY`]; the CPU reference scores [`REFERENCE`]. At most one family can hold
/// a majority, so two built-in backends never tie: Q4_0 files go to `cuda-q4_0`, K-quant
/// files to `cuda-q4k`, everything else on a GPU to `cuda-q4k`, and to `cpu` without one.
/// Should a plugin tie with a built-in, the registry keeps the one registered first
/// (built-ins before plugins), never the alphabetically first.
pub mod score {
    /// Share of matmul bytes above which a model is "mostly" one weight family.
    pub const MAJORITY: f64 = 0.5;
    /// A GPU executor made for the model's majority weight family.
    pub const GPU_SPECIALIST: u32 = 100;
    /// The GPU executor with the broadest kernel set, on a model it was not made for.
    pub const GPU_GENERAL: u32 = 60;
    /// Another GPU executor that can run the model, made for another family.
    pub const GPU_OTHER_FAMILY: u32 = 40;
    /// The CPU reference executor: runs anything, slowest.
    pub const REFERENCE: u32 = 10;
}

/// A backend's answer to "can you run this model?".
#[derive(Debug, Clone, PartialEq)]
pub enum Support {
    /// Yes; higher scores win automatic selection (see [`score`] for the rule built-in
    /// backends follow).
    Yes { score: u32, note: String },
    /// No, and why (shown by `kiln backends -m MODEL`).
    No { reason: String },
}

impl Support {
    pub fn score(&self) -> Option<u32> {
        match self {
            Support::Yes { score, .. } => Some(*score),
            Support::No { .. } => None,
        }
    }
}

/// A compute backend: a factory for executors.
pub trait Backend: Send + Sync {
    /// Short unique name used by `--backend` (`cpu`, `cuda-q4k`).
    fn name(&self) -> &str;
    /// One line for listings.
    fn description(&self) -> &str;
    /// Weight types the backend can multiply with.
    fn qtypes(&self) -> Vec<QType>;
    /// Is the device usable here? `Ok(device description)` or `Err(why not)`.
    fn probe(&self) -> Result<String, String>;
    /// Can it run this model, and how well?
    fn supports(&self, model: &ModelIr) -> Support;
    /// Makes the model resident on the device.
    fn load(&self, model: &ModelIr, options: &LoadOptions) -> Result<Box<dyn LayerExecutor>>;
}

/// One sequence's input for a batched decode step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DecodeItem {
    pub seq: SeqId,
    /// The token to append at the sequence's next position.
    pub token: u32,
}

/// A model loaded on a device, holding the KV caches of its sequences.
pub trait LayerExecutor: Send {
    fn config(&self) -> &ModelConfig;
    /// Longest context one sequence may reach.
    fn max_context(&self) -> usize;
    /// Sequences that may be alive at once.
    fn max_sequences(&self) -> usize;

    /// A new, empty sequence. Fails when `max_sequences` are alive.
    fn new_sequence(&mut self) -> Result<SeqId>;
    /// Frees a sequence's KV cache slot.
    fn free_sequence(&mut self, seq: SeqId) -> Result<()>;
    /// Tokens in the sequence's cache.
    fn sequence_len(&self, seq: SeqId) -> Result<usize>;
    /// Forgets every position from `len` on (keeps a shared prefix for the next prompt).
    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> Result<()>;

    /// Appends `tokens` to `seq` as one batch and writes the logits of the last one into
    /// `logits` (length vocab).
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> Result<()>;

    /// One decode step for every item; `logits` receives `batch.len() * vocab` values,
    /// row `i` for item `i`. Items must name distinct sequences.
    fn decode(&mut self, batch: &[DecodeItem], logits: &mut [f32]) -> Result<()>;

    /// The device's measured memory bandwidth in GB/s (a plain copy's bytes read + written
    /// per second), for `kiln bench`'s roofline fraction; `None` where the backend has not
    /// measured it. May take a moment the first time.
    fn memory_roofline_gbs(&mut self) -> Option<f64> {
        None
    }

    /// One decode step that samples on the backend: `tokens[i]` receives item `i`'s next
    /// token drawn with `samplers[i]`. The default computes logits and samples on the host;
    /// GPU backends override it so only ids cross the bus.
    fn decode_sample(&mut self, batch: &[DecodeItem], samplers: &mut [Sampler], tokens: &mut [u32]) -> Result<()> {
        if samplers.len() != batch.len() || tokens.len() != batch.len() {
            return Err(Error::InvalidArgument(format!(
                "{} items need as many samplers ({}) and token slots ({})",
                batch.len(),
                samplers.len(),
                tokens.len()
            )));
        }
        let vocab = self.config().vocab_size;
        let mut logits = vec![0.0f32; batch.len() * vocab];
        self.decode(batch, &mut logits)?;
        for ((row, sampler), token) in logits.chunks_mut(vocab).zip(samplers.iter_mut()).zip(tokens.iter_mut()) {
            *token = sampler.sample(row);
        }
        Ok(())
    }
}

/// Checks shared by executors: the logits buffer fits the batch and sequences are distinct.
pub fn check_decode_batch(batch: &[DecodeItem], logits: &[f32], vocab: usize) -> Result<()> {
    if logits.len() != batch.len() * vocab {
        return Err(Error::InvalidArgument(format!(
            "logits buffer holds {} values; a batch of {} needs {}",
            logits.len(),
            batch.len(),
            batch.len() * vocab
        )));
    }
    for (i, a) in batch.iter().enumerate() {
        if batch[..i].iter().any(|b| b.seq == a.seq) {
            return Err(Error::InvalidArgument(format!("sequence {} appears twice in one decode batch", a.seq)));
        }
    }
    Ok(())
}
