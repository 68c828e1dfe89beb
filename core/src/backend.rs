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

/// How a KV cache stores its keys and values (`--kv-type`, as llama.cpp's `-ctk`/`-ctv`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvType {
    /// 4 bytes a value: the CPU reference's default (exact).
    F32,
    /// 2 bytes a value: the GPU backends' default.
    F16,
    /// ggml's Q8_0 blocks, 34 bytes per 32 values (1.0625 a value): half of f16's memory
    /// for a small loss (measured in docs/benchmarks.md, "KV cache types").
    Q8_0,
}

impl KvType {
    pub const ALL: [KvType; 3] = [KvType::F32, KvType::F16, KvType::Q8_0];

    /// The block type a row of this cache is encoded in.
    pub fn qtype(self) -> QType {
        match self {
            KvType::F32 => QType::F32,
            KvType::F16 => QType::F16,
            KvType::Q8_0 => QType::Q8_0,
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::Q8_0 => "q8_0",
        }
    }

    /// Bytes `n` values take (`n` a multiple of 32 for Q8_0), or `None` on overflow.
    pub fn bytes(self, n: usize) -> Option<usize> {
        match self {
            KvType::F32 => n.checked_mul(4),
            KvType::F16 => n.checked_mul(2),
            KvType::Q8_0 => (n / 32).checked_mul(34),
        }
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for KvType {
    type Err = Error;
    fn from_str(s: &str) -> Result<KvType> {
        KvType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
            .ok_or_else(|| {
                Error::InvalidArgument(format!(
                    "KV cache type {s:?}: expected one of f32, f16, q8_0"
                ))
            })
    }
}

/// How to load a model.
#[derive(Clone, Default)]
pub struct LoadOptions {
    /// Longest context per sequence; 0 means the model's own, as far as memory allows: GPU
    /// backends cap it to what their KV cache fits in free device memory
    /// ([`LoadOptions::fit_context`]), the CPU reference (and [`LoadOptions::context_for`])
    /// at [`LoadOptions::DEFAULT_MAX_CONTEXT`].
    pub max_context: usize,
    /// Sequences that may be alive at once; 0 means 1.
    pub max_sequences: usize,
    /// Worker threads for CPU work; `None` means all cores.
    pub threads: Option<usize>,
    pub progress: Option<ProgressFn>,
    /// Let a backend quantise activations to 8 bits (Q8_1; the CPU takes Q8_K, 256-value
    /// blocks, for K-quant weights, as llama.cpp does) for integer dot products:
    /// faster matrix-vector products, but logits drift from the f32 reference, on real
    /// models past what greedy decoding tolerates (see docs/architecture.md; cuda-q4k's
    /// default keeps 15 bits and stays within the parity bar). Off by default. The CPU
    /// backend then takes llama.cpp's arithmetic for its few-token (decode) matmuls; left
    /// off, it is the f32 oracle the other backends are checked against.
    pub quantized_activations: bool,
    /// Make a GPU backend decode a batch of sequences one at a time (one graph replay per
    /// sequence) instead of in one batched step that reads every weight once for the whole
    /// batch (int8 tensor-core matmuls). Off by default: the batched step matches
    /// one-at-a-time decoding (tests/tests/batched_decode.rs, run on an H200) and is faster
    /// from two sequences up; this is the comparison benchmarks make. Backends without a
    /// batched step ignore it.
    pub sequential_decode: bool,
    /// How the KV cache stores keys and values; `None`: the backend's own (f32 on the CPU
    /// reference, f16 on the GPUs). A backend that cannot store the type asked for refuses
    /// to load with [`Error::Unsupported`] naming the types it has.
    pub kv_type: Option<KvType>,
    /// Bytes for the paged KV cache's pool of blocks (`--kv-mem`), shared by all sequences;
    /// `None`: room for every sequence at the full context (on a GPU, as far as free memory
    /// allows). A smaller pool serves many sequences that stay short: a sequence takes
    /// blocks as it grows and fails with [`Error::KvCacheFull`] when none is left. It must
    /// hold at least one sequence's whole context ([`LoadOptions::kv_pool_blocks`]).
    pub kv_memory: Option<u64>,
    /// Ranks the model's matrices are split over (tensor parallelism, see
    /// [`crate::parallel`]); 0 or 1: none. The CPU backend runs the ranks as threads of one
    /// process; a backend that cannot split a model refuses to load with
    /// [`Error::Unsupported`].
    pub tensor_parallel: usize,
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

    /// Blocks of the paged KV cache for sequences of up to `max_ctx` positions, a block
    /// taking `block_bytes`: every sequence's full context without `kv_memory`, else what
    /// `kv_memory` holds, at most that. `OutOfMemory` when `kv_memory` holds less than one
    /// sequence's full context: a request that fits the context must always be able to run.
    pub fn kv_pool_blocks(&self, max_ctx: usize, block_bytes: u64) -> Result<usize> {
        let per_seq = max_ctx.div_ceil(crate::KV_BLOCK_TOKENS);
        let all = per_seq.saturating_mul(self.sequences());
        let Some(bytes) = self.kv_memory else {
            return Ok(all);
        };
        let fit = bytes.checked_div(block_bytes).unwrap_or(u64::MAX);
        if fit < per_seq as u64 {
            let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
            return Err(Error::OutOfMemory(format!(
                "a KV cache of {:.1} MiB holds {} tokens, less than one sequence's context of {max_ctx} ({:.1} MiB): \
                 raise --kv-mem or lower -c",
                mib(bytes),
                fit * crate::KV_BLOCK_TOKENS as u64,
                mib(per_seq as u64 * block_bytes)
            )));
        }
        Ok(fit.min(all as u64) as usize)
    }

    /// The context for a backend whose KV cache takes, for each sequence, `per_position`
    /// bytes per position plus `fixed` bytes (sliding-window rings, whatever the context),
    /// within `budget` bytes. An explicit `max_context` must fit (else `OutOfMemory` naming
    /// what it takes and what is free); 0 gives the model's context when it fits, else the
    /// most that fits in whole 256-token steps (`OutOfMemory` below 256).
    pub fn fit_context(
        &self,
        config: &ModelConfig,
        per_position: u64,
        fixed: u64,
        budget: u64,
    ) -> Result<usize> {
        let slots = self.sequences() as u64;
        let gib = |b: u64| b as f64 / (1u64 << 30) as f64;
        let need =
            |ctx: u64| slots.saturating_mul(ctx.saturating_mul(per_position).saturating_add(fixed));
        let fits = |ctx: u64| need(ctx) <= budget;
        if self.max_context > 0 {
            let n = self.max_context as u64;
            return match fits(n) {
                true => Ok(self.max_context),
                false => Err(Error::OutOfMemory(format!(
                    "a KV cache for {n} tokens × {slots} sequences takes {:.2} GiB; {:.2} GiB is left for it \
                     (lower the context or the number of sequences)",
                    gib(need(n)),
                    gib(budget)
                ))),
            };
        }
        let model = config.context_length.max(1) as u64;
        if fits(model) {
            return Ok(model as usize);
        }
        const STEP: u64 = 256;
        let room = (budget / slots).saturating_sub(fixed);
        let fit = room
            .checked_div(per_position)
            .unwrap_or(u64::MAX)
            .min(model)
            / STEP
            * STEP;
        if fit == 0 {
            return Err(Error::OutOfMemory(format!(
                "not even {STEP} tokens of KV cache fit for {slots} sequences: {:.2} GiB is left for it, {STEP} tokens take {:.2} GiB",
                gib(budget),
                gib(need(STEP))
            )));
        }
        Ok(fit as usize)
    }
}

impl std::fmt::Debug for LoadOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadOptions")
            .field("max_context", &self.max_context)
            .field("max_sequences", &self.max_sequences)
            .field("threads", &self.threads)
            .field("quantized_activations", &self.quantized_activations)
            .field("sequential_decode", &self.sequential_decode)
            .field("kv_type", &self.kv_type)
            .field("kv_memory", &self.kv_memory)
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
///
/// The contract every backend — built-in or plugin — follows, and `kiln conformance`
/// checks (docs/plugins.md, "The executor contract", has the full table):
///
/// - **Caller misuse is `Error::InvalidArgument`**, always: an unknown or freed sequence,
///   a sequence beyond `max_sequences`, an empty prompt, a token id outside the vocabulary,
///   a logits buffer of the wrong length, a sequence twice in one batch, a truncation past
///   the end, and a context limit that a prompt or step would cross. The host does not check
///   these for you (it checks buffer lengths before calling a plugin, but built-ins are
///   called directly): use [`check_prefill`], [`check_decode`] and
///   [`crate::SequenceSlots`].
/// - **A rejected call changes nothing**: every sequence keeps its length and cache, and
///   the executor stays usable. Validate a whole batch before running any of it.
/// - **The executor enforces the context limit**: a sequence holds at most
///   [`LayerExecutor::max_context`] tokens; the call that would cross it fails.
/// - **Every logit is written and finite** on success (the host fills plugin buffers with
///   NaN before each call and turns any left over into an error naming the plugin).
pub trait LayerExecutor: Send {
    /// The configuration of the loaded model, equal to the `ModelIr`'s.
    fn config(&self) -> &ModelConfig;
    /// Longest context one sequence may reach (≥ 1): what `LoadOptions::context_for` gave,
    /// or less if the device cannot hold that much.
    fn max_context(&self) -> usize;
    /// Sequences that may be alive at once (≥ 1): `LoadOptions::sequences()`, or less.
    fn max_sequences(&self) -> usize;

    /// A new, empty sequence (length 0). Ids of live sequences are distinct; a freed id may
    /// come back later. `InvalidArgument` when `max_sequences` are alive.
    fn new_sequence(&mut self) -> Result<SeqId>;
    /// Frees a sequence's KV cache slot; the id is unknown afterwards. `InvalidArgument` for
    /// an unknown or already freed id.
    fn free_sequence(&mut self, seq: SeqId) -> Result<()>;
    /// Tokens in the sequence's cache. `InvalidArgument` for an unknown id.
    fn sequence_len(&self, seq: SeqId) -> Result<usize>;
    /// Forgets every position from `len` on (keeps a shared prefix for the next prompt):
    /// afterwards the sequence computes exactly as if only its first `len` tokens had ever
    /// been appended. `len` equal to the length is a no-op, 0 empties it; `len` past the end
    /// is `InvalidArgument` (truncation never grows a sequence).
    fn truncate_sequence(&mut self, seq: SeqId, len: usize) -> Result<()>;

    /// Appends `tokens` (at least one) to `seq` as one batch and writes the logits of the
    /// last one into `logits` (length vocab). Positions run from the sequence's length on;
    /// a prompt that would pass `max_context` is refused whole. See [`check_prefill`].
    fn prefill(&mut self, seq: SeqId, tokens: &[u32], logits: &mut [f32]) -> Result<()>;

    /// Appends `tokens` like [`LayerExecutor::prefill`] and writes the logits after every
    /// token from `tokens[first]` on: `logits` holds `(tokens.len() - first) * vocab` values,
    /// row `j` the distribution of the token that follows `tokens[first + j]`. What a scorer
    /// (perplexity, KL-divergence) reads. See [`check_prefill_logits`].
    ///
    /// The default is [`prefill_logits_stepwise`], so every executor (a plugin too) has it;
    /// executors that compute every position of a prompt in one pass override it to run at
    /// prompt speed.
    fn prefill_logits(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        first: usize,
        logits: &mut [f32],
    ) -> Result<()> {
        prefill_logits_stepwise(self, seq, tokens, first, logits)
    }

    /// Appends `tokens` like [`LayerExecutor::prefill_logits`] but writes each row's final
    /// hidden state instead of its logits: the residual stream after the last layer and the
    /// output norm (what transformers calls the last hidden state), `hidden_size` values a
    /// row from `tokens[first]` on. What embeddings pool. See [`check_prefill_hidden`].
    ///
    /// The default refuses (`Unsupported`): an executor offers it where it can.
    fn prefill_hidden(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        first: usize,
        hidden: &mut [f32],
    ) -> Result<()> {
        let _ = (seq, tokens, first, hidden);
        Err(Error::Unsupported(
            "this backend does not give hidden states (embeddings); the cpu backend does".into(),
        ))
    }

    /// [`LayerExecutor::prefill_hidden`] for several sequences: each item's rows from its
    /// `first` on, item after item, in `hidden`. Many short texts (an embeddings request)
    /// cost what one text of their total length does where an executor packs the
    /// sequences' rows into shared passes, as the CPU's does; the default runs the items
    /// one after another. See [`check_hidden_batch`]. An item's error stops the batch: the
    /// items before it stay appended.
    fn prefill_hidden_batch(
        &mut self,
        items: &[HiddenRequest<'_>],
        hidden: &mut [f32],
    ) -> Result<()> {
        let width = self.config().hidden_size;
        let mut out = hidden;
        for (item, len) in items
            .iter()
            .zip(check_hidden_batch(items, out.len(), width)?)
        {
            let (now, rest) = std::mem::take(&mut out).split_at_mut(len);
            self.prefill_hidden(item.seq, item.tokens, item.first, now)?;
            out = rest;
        }
        Ok(())
    }

    /// Appends `tokens` like [`LayerExecutor::prefill_logits`] but keeps of each row from
    /// `tokens[first]` on only what a perplexity run reads: `scores[j]` for the row after
    /// `tokens[first + j]`, scored against `targets[j]` (the token that really follows).
    /// `targets` and `scores` hold `tokens.len() - first` entries.
    ///
    /// The default is [`prefill_scores_from_logits`] (the rows through `prefill_logits`,
    /// reduced on the host); an executor whose rows live in device memory overrides it to
    /// reduce them there and move a few bytes a row instead of the vocabulary.
    fn prefill_scores(
        &mut self,
        seq: SeqId,
        tokens: &[u32],
        first: usize,
        targets: &[u32],
        scores: &mut [TokenScore],
    ) -> Result<()> {
        prefill_scores_from_logits(self, seq, tokens, first, targets, scores)
    }

    /// One decode step for every item; `logits` receives `batch.len() * vocab` values,
    /// row `i` for item `i`. Items must name distinct live sequences, each below
    /// `max_context`, at whatever position each one is; an empty batch is a no-op. The
    /// whole batch is checked before any of it runs (see [`check_decode`]).
    fn decode(&mut self, batch: &[DecodeItem], logits: &mut [f32]) -> Result<()>;

    /// How this executor's KV cache stores keys and values, where it knows (`kiln bench`
    /// reports the bytes a token from it); `None` for an executor that cannot say (a
    /// plugin: the 1.x ABI has no field for it).
    fn kv_type(&self) -> Option<KvType> {
        None
    }

    /// How full the paged KV cache is (blocks in the pool, free, bytes a block); `None` for
    /// an executor that does not page its cache (a plugin).
    fn kv_blocks(&self) -> Option<crate::KvBlockUsage> {
        None
    }

    /// The device's measured memory bandwidth in GB/s (a plain copy's bytes read + written
    /// per second), for `kiln bench`'s roofline fraction; `None` where the backend has not
    /// measured it. May take a moment the first time.
    fn memory_roofline_gbs(&mut self) -> Option<f64> {
        None
    }

    /// One decode step that samples on the backend: `tokens[i]` receives item `i`'s next
    /// token drawn with `samplers[i]`. The default computes logits and samples on the host;
    /// GPU backends override it so only ids cross the bus.
    fn decode_sample(
        &mut self,
        batch: &[DecodeItem],
        samplers: &mut [Sampler],
        tokens: &mut [u32],
    ) -> Result<()> {
        decode_sample_on_host(self, batch, samplers, tokens)
    }
}

/// [`LayerExecutor::decode_sample`]'s default, for overrides that fall back to it: the
/// batch's logits through `decode`, each row checked finite and sampled on the host.
pub fn decode_sample_on_host<E: LayerExecutor + ?Sized>(
    exec: &mut E,
    batch: &[DecodeItem],
    samplers: &mut [Sampler],
    tokens: &mut [u32],
) -> Result<()> {
    check_sample_slots(batch.len(), samplers.len(), tokens.len())?;
    let vocab = exec.config().vocab_size;
    let mut logits = vec![0.0f32; batch.len() * vocab];
    exec.decode(batch, &mut logits)?;
    for ((row, sampler), token) in logits
        .chunks_mut(vocab)
        .zip(samplers.iter_mut())
        .zip(tokens.iter_mut())
    {
        check_finite(row)?;
        *token = sampler.sample(row);
    }
    Ok(())
}

/// `NonFiniteLogits` (step 0; callers that count steps fill it in) when a logit is NaN or
/// infinite: a broken weight must not turn into an arbitrary token and an exit status of 0.
pub fn check_finite(logits: &[f32]) -> Result<()> {
    match logits.iter().all(|l| l.is_finite()) {
        true => Ok(()),
        false => Err(Error::NonFiniteLogits { step: 0 }),
    }
}

/// Token ids inside a vocabulary of `vocab`; `InvalidArgument` naming the first that is not.
pub fn check_tokens(tokens: &[u32], vocab: usize) -> Result<()> {
    match tokens.iter().find(|&&t| t as usize >= vocab) {
        Some(t) => Err(Error::InvalidArgument(format!(
            "token id {t} is outside the vocabulary of {vocab}"
        ))),
        None => Ok(()),
    }
}

/// The checks of [`LayerExecutor::prefill`] for a sequence that holds `len` tokens of
/// `max_context`: at least one token, every id inside the vocabulary, room for all of them,
/// and a logits buffer of `vocab` values. Every failure is `InvalidArgument`; call it before
/// touching any state, so a refused prompt leaves the sequence as it was.
pub fn check_prefill(
    tokens: &[u32],
    logits: &[f32],
    vocab: usize,
    len: usize,
    max_context: usize,
) -> Result<()> {
    if tokens.is_empty() {
        return Err(Error::InvalidArgument(
            "prefill needs at least one token".into(),
        ));
    }
    if logits.len() != vocab {
        return Err(Error::InvalidArgument(format!(
            "logits buffer holds {} values, the vocabulary {vocab}",
            logits.len()
        )));
    }
    check_prompt_fits(tokens, vocab, len, max_context)
}

/// Every token of a prompt inside the vocabulary, and room for all of them in a sequence of
/// `len` tokens.
fn check_prompt_fits(tokens: &[u32], vocab: usize, len: usize, max_context: usize) -> Result<()> {
    check_tokens(tokens, vocab)?;
    if len.saturating_add(tokens.len()) > max_context {
        return Err(Error::InvalidArgument(format!(
            "the sequence holds {len} tokens; {} more exceed the context of {max_context}",
            tokens.len()
        )));
    }
    Ok(())
}

/// The rows a scoring call over `tokens` from `first` on computes (`first` must lie inside
/// them).
fn scored_rows(tokens: &[u32], first: usize) -> Result<usize> {
    if first >= tokens.len() {
        return Err(Error::InvalidArgument(format!(
            "the first scored token ({first}) is past the {} given",
            tokens.len()
        )));
    }
    Ok(tokens.len() - first)
}

/// [`LayerExecutor::prefill_logits`] from the other calls: prefills up to `tokens[first]`,
/// then decodes the rest one token at a time. On an error after the prefill the sequence
/// is cut back to its length before the call. (The default, and the fallback of an
/// executor whose one-pass path is unavailable on a machine.)
pub fn prefill_logits_stepwise<E: LayerExecutor + ?Sized>(
    exec: &mut E,
    seq: SeqId,
    tokens: &[u32],
    first: usize,
    logits: &mut [f32],
) -> Result<()> {
    let vocab = exec.config().vocab_size;
    let start = exec.sequence_len(seq)?;
    check_prefill_logits(tokens, first, logits, vocab, start, exec.max_context())?;
    let (head, rest) = tokens.split_at(first + 1);
    let (row0, rows) = logits.split_at_mut(vocab);
    exec.prefill(seq, head, row0)?;
    for (&token, out) in rest.iter().zip(rows.chunks_mut(vocab)) {
        if let Err(e) = exec.decode(&[DecodeItem { seq, token }], out) {
            // Best effort: the error that stopped the run is the one to report.
            let _ = exec.truncate_sequence(seq, start);
            return Err(e);
        }
    }
    Ok(())
}

/// What a perplexity run keeps of one scored row of logits.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TokenScore {
    /// −log p(target) in nats: the row's log-sum-exp minus the target's logit. NaN when the
    /// row held a non-finite logit.
    pub nll: f32,
    /// The row's most likely token (the first of equal maxima).
    pub top: u32,
}

impl TokenScore {
    /// The score of `row` (logits over the vocabulary) for the token `target`.
    pub fn of(row: &[f32], target: u32) -> TokenScore {
        let mut max = f32::NEG_INFINITY;
        let mut top = 0;
        let mut finite = true;
        for (i, &l) in row.iter().enumerate() {
            finite &= l.is_finite();
            if l > max {
                max = l;
                top = i;
            }
        }
        let sum: f64 = row.iter().map(|&l| ((l - max) as f64).exp()).sum();
        let nll = match (finite, row.get(target as usize)) {
            (true, Some(&t)) => (max as f64 + sum.ln() - t as f64) as f32,
            _ => f32::NAN,
        };
        TokenScore {
            nll,
            top: top as u32,
        }
    }
}

/// [`LayerExecutor::prefill_scores`] from [`LayerExecutor::prefill_logits`]: the rows on
/// the host, each reduced by [`TokenScore::of`].
pub fn prefill_scores_from_logits<E: LayerExecutor + ?Sized>(
    exec: &mut E,
    seq: SeqId,
    tokens: &[u32],
    first: usize,
    targets: &[u32],
    scores: &mut [TokenScore],
) -> Result<()> {
    let vocab = exec.config().vocab_size;
    let start = exec.sequence_len(seq)?;
    check_prefill_scores(
        tokens,
        first,
        targets,
        scores,
        vocab,
        start,
        exec.max_context(),
    )?;
    let mut logits = vec![0f32; scores.len() * vocab];
    exec.prefill_logits(seq, tokens, first, &mut logits)?;
    for ((row, &t), out) in logits.chunks_exact(vocab).zip(targets).zip(scores) {
        *out = TokenScore::of(row, t);
    }
    Ok(())
}

/// The checks of [`LayerExecutor::prefill_scores`]: `first` inside `tokens`, every token in
/// the vocabulary and room for all of them, `targets` and `scores` of `tokens.len() - first`
/// entries, every target inside the vocabulary. Every failure is `InvalidArgument`.
pub fn check_prefill_scores(
    tokens: &[u32],
    first: usize,
    targets: &[u32],
    scores: &[TokenScore],
    vocab: usize,
    len: usize,
    max_context: usize,
) -> Result<()> {
    let rows = scored_rows(tokens, first)?;
    if targets.len() != rows || scores.len() != rows {
        return Err(Error::InvalidArgument(format!(
            "{rows} rows are scored; given {} targets and room for {} scores",
            targets.len(),
            scores.len()
        )));
    }
    check_tokens(targets, vocab)?;
    check_prompt_fits(tokens, vocab, len, max_context)
}

/// The checks of [`LayerExecutor::prefill_logits`]: `first` inside `tokens`, every token in
/// the vocabulary and room for all of them, and a logits buffer of `(tokens.len() - first) * vocab`
/// values. Every failure is `InvalidArgument`.
pub fn check_prefill_logits(
    tokens: &[u32],
    first: usize,
    logits: &[f32],
    vocab: usize,
    len: usize,
    max_context: usize,
) -> Result<()> {
    check_rows_fit(
        tokens,
        first,
        logits.len(),
        vocab,
        "logits",
        "the vocabulary",
    )?;
    check_prompt_fits(tokens, vocab, len, max_context)
}

/// The rows from `first` on, `width` values each, fill a buffer of `held` values exactly;
/// `InvalidArgument` naming the buffer and the row width otherwise.
fn check_rows_fit(
    tokens: &[u32],
    first: usize,
    held: usize,
    width: usize,
    buffer: &str,
    row: &str,
) -> Result<()> {
    let rows = scored_rows(tokens, first)?;
    if held != rows * width {
        return Err(Error::InvalidArgument(format!(
            "{buffer} buffer holds {held} values; {rows} rows of {row} need {}",
            rows * width
        )));
    }
    Ok(())
}

/// One sequence's part of [`LayerExecutor::prefill_hidden_batch`]: `tokens` appended to
/// `seq`, the hidden states of its rows from `tokens[first]` on wanted.
#[derive(Debug, Clone, Copy)]
pub struct HiddenRequest<'a> {
    pub seq: SeqId,
    pub tokens: &'a [u32],
    pub first: usize,
}

/// The batch-wide checks of [`LayerExecutor::prefill_hidden_batch`]: at least one item,
/// no sequence twice, each item with a row to give (`first` inside its tokens), and
/// `hidden_len` exactly the items' rows of `width` values. Returns each item's share of
/// `hidden`, in values (each item's own checks are [`check_prefill_hidden`]'s).
pub fn check_hidden_batch(
    items: &[HiddenRequest<'_>],
    hidden_len: usize,
    width: usize,
) -> Result<Vec<usize>> {
    if items.is_empty() {
        return Err(Error::InvalidArgument(
            "a hidden-state batch needs at least one sequence".into(),
        ));
    }
    let mut shares = Vec::with_capacity(items.len());
    let mut total = 0usize;
    for (i, item) in items.iter().enumerate() {
        if items[..i].iter().any(|o| o.seq == item.seq) {
            return Err(Error::InvalidArgument(format!(
                "sequence {} appears twice in one hidden-state batch",
                item.seq
            )));
        }
        if item.first >= item.tokens.len() {
            return Err(Error::InvalidArgument(format!(
                "item {i}: first row {} of {} tokens leaves no hidden state to give",
                item.first,
                item.tokens.len()
            )));
        }
        let share = (item.tokens.len() - item.first)
            .checked_mul(width)
            .ok_or_else(|| Error::InvalidArgument("hidden-state batch too large".into()))?;
        total = total
            .checked_add(share)
            .ok_or_else(|| Error::InvalidArgument("hidden-state batch too large".into()))?;
        shares.push(share);
    }
    if total != hidden_len {
        return Err(Error::InvalidArgument(format!(
            "the batch's rows need {total} hidden values; the buffer holds {hidden_len}"
        )));
    }
    Ok(shares)
}

/// The checks of [`LayerExecutor::prefill_hidden`]: the rows from `first` on fit `hidden`
/// (`hidden_size` values each), and the prompt fits as [`check_prefill_logits`] says.
#[allow(clippy::too_many_arguments)]
pub fn check_prefill_hidden(
    tokens: &[u32],
    first: usize,
    hidden: &[f32],
    hidden_size: usize,
    vocab: usize,
    len: usize,
    max_context: usize,
) -> Result<()> {
    let row = hidden_size.to_string();
    check_rows_fit(
        tokens,
        first,
        hidden.len(),
        hidden_size,
        "hidden-state",
        &row,
    )?;
    check_prompt_fits(tokens, vocab, len, max_context)
}

/// The checks of [`LayerExecutor::decode`]: [`check_decode_batch`] (the logits buffer fits,
/// the sequences are distinct), then [`check_decode_items`]. Call it before running any
/// item, so a refused batch leaves every sequence as it was.
pub fn check_decode(
    batch: &[DecodeItem],
    logits: &[f32],
    vocab: usize,
    max_context: usize,
    len_of: impl Fn(SeqId) -> Result<usize>,
) -> Result<()> {
    check_decode_batch(batch, logits, vocab)?;
    check_decode_items(batch, vocab, max_context, len_of)
}

/// A `decode_sample` call's samplers and token slots: one of each per batch item.
pub fn check_sample_slots(items: usize, samplers: usize, tokens: usize) -> Result<()> {
    if samplers != items || tokens != items {
        return Err(Error::InvalidArgument(format!(
            "{items} items need as many samplers ({samplers}) and token slots ({tokens})"
        )));
    }
    Ok(())
}

/// For every item of a decode batch: its sequence is alive (`len_of` fails for an unknown
/// one) and named once, its token is inside the vocabulary, and its sequence has room for one
/// more position below `max_context`. For steps without a logits buffer (`decode_sample`).
pub fn check_decode_items(
    batch: &[DecodeItem],
    vocab: usize,
    max_context: usize,
    len_of: impl Fn(SeqId) -> Result<usize>,
) -> Result<()> {
    for (i, item) in batch.iter().enumerate() {
        if batch[..i].iter().any(|b| b.seq == item.seq) {
            return Err(Error::InvalidArgument(format!(
                "sequence {} appears twice in one decode batch",
                item.seq
            )));
        }
        let len = len_of(item.seq)?;
        check_tokens(&[item.token], vocab)?;
        if len >= max_context {
            return Err(Error::InvalidArgument(format!(
                "sequence {} is full: it holds the context of {max_context} tokens",
                item.seq
            )));
        }
    }
    Ok(())
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
            return Err(Error::InvalidArgument(format!(
                "sequence {} appears twice in one decode batch",
                a.seq
            )));
        }
    }
    Ok(())
}
