//! One conversation: a KV-cache slot on the engine's executor and the generation loop.
//!
//! A session remembers which tokens its cache holds. A new prompt that starts with them
//! (the next turn of a chat) only prefills what is new; a prompt that diverges rolls the
//! cache back to the shared prefix.

use std::time::{Duration, Instant};

use kiln_core::{DecodeItem, Error, Result, Sampler, SamplingParams, SeqId};

use crate::engine::Engine;
pub use crate::generation::Finish;
use crate::generation::{SequenceGeneration, SequenceRules, TokenLogprob};

/// What to generate.
#[derive(Debug, Clone)]
pub struct GenerateParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    /// Generation ends when the text contains one of these; the text is cut before it.
    pub stop_strings: Vec<String>,
    /// Stop on the model's end-of-sequence / end-of-turn tokens.
    pub stop_on_eos: bool,
    /// Structured output: the text must be a JSON value matching this schema (a JSON
    /// schema; `{"type": "object"}` for any object). Tokens are then drawn on the host from
    /// masked logits ([`crate::structured`]), and a stop token ends the turn only once the
    /// value is complete.
    pub json_schema: Option<serde_json::Value>,
    /// OpenAI's penalties (−2 to 2): a generated token's logit less `presence_penalty` once
    /// it has appeared in the output and `frequency_penalty` for each time it has.
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// `Some(k)`: each generated token's log-probability and the `k` (at most 20) most
    /// likely tokens' at its step, under the distribution it was drawn from (after bias,
    /// penalties and the output constraint, before temperature): `Generation::logprobs`,
    /// and each Batcher `Delta`'s `logprob`.
    pub logprobs: Option<usize>,
    /// Ends the generation from any thread: checked before each token is decoded, it
    /// stops with [`Finish::Cancelled`] and what was generated so far.
    pub cancel: Option<CancelToken>,
    /// The prompt is a chat turn: a model that writes its reasoning on a channel of its own
    /// (gpt-oss's harmony `analysis`) has it kept apart, in [`Generation::reasoning`] (or
    /// each Batcher `Delta`'s `reasoning`), and its answer alone is the text. No effect on
    /// other models.
    pub split_reasoning: bool,
}

impl GenerateParams {
    /// Checks what a generation would otherwise fail on late: the sampling parameters and
    /// the penalties' range.
    pub fn validate(&self) -> Result<()> {
        self.sampling.validate()?;
        if self.logprobs.is_some_and(|k| k > 20) {
            return Err(Error::InvalidArgument(
                "logprobs asks for at most 20 alternatives".into(),
            ));
        }
        for (name, v) in [
            ("presence_penalty", self.presence_penalty),
            ("frequency_penalty", self.frequency_penalty),
        ] {
            if !(-2.0..=2.0).contains(&v) {
                return Err(Error::InvalidArgument(format!(
                    "{name} must be between -2 and 2, not {v}"
                )));
            }
        }
        Ok(())
    }
}

impl Default for GenerateParams {
    fn default() -> Self {
        GenerateParams {
            max_tokens: 128,
            sampling: SamplingParams::default(),
            stop_strings: Vec::new(),
            stop_on_eos: true,
            json_schema: None,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            logprobs: None,
            cancel: None,
            split_reasoning: false,
        }
    }
}

/// A request to stop a generation, shared between the thread that runs it and any other:
/// clones are the same token. Once cancelled it stays so (make a new one for the next
/// generation).
#[derive(Debug, Clone, Default)]
pub struct CancelToken(std::sync::Arc<std::sync::atomic::AtomicBool>);

impl CancelToken {
    pub fn new() -> CancelToken {
        CancelToken::default()
    }

    pub fn cancel(&self) {
        self.0.store(true, std::sync::atomic::Ordering::Release);
    }

    pub fn is_cancelled(&self) -> bool {
        self.0.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// The result of one [`Session::generate`] call.
#[derive(Debug, Clone)]
pub struct Generation {
    pub prompt_ids: Vec<u32>,
    /// Tokens prefilled (prompt minus the prefix already cached).
    pub prefilled: usize,
    pub ids: Vec<u32>,
    pub text: String,
    /// The reasoning written apart from the text ([`GenerateParams::split_reasoning`]).
    pub reasoning: String,
    pub finish: Finish,
    pub prefill_time: Duration,
    /// From the call to the first generated token (prefill, then its draw): what a user
    /// waits before text starts. Zero when nothing was generated.
    pub first_token_time: Duration,
    /// Time of the decode steps after the first token (which comes from the prefill).
    pub decode_time: Duration,
    pub decode_steps: usize,
    /// One a generated token, when `GenerateParams::logprobs` asked for them.
    pub logprobs: Vec<TokenLogprob>,
}

impl Generation {
    pub fn prompt_tokens_per_sec(&self) -> f64 {
        self.prefilled as f64 / self.prefill_time.as_secs_f64().max(1e-9)
    }
    pub fn decode_tokens_per_sec(&self) -> f64 {
        self.decode_steps as f64 / self.decode_time.as_secs_f64().max(1e-9)
    }
    /// Mean time between generated tokens (one decode step and its draw), if any.
    pub fn ms_per_token(&self) -> Option<f64> {
        (self.decode_steps > 0)
            .then(|| self.decode_time.as_secs_f64() * 1e3 / self.decode_steps as f64)
    }
}

pub struct Session<'e> {
    engine: &'e mut Engine,
    seq: SeqId,
    /// Exactly the tokens in this sequence's KV cache, in order.
    cached: Vec<u32>,
    logits: Vec<f32>,
}

impl<'e> Session<'e> {
    pub(crate) fn new(engine: &'e mut Engine) -> Result<Self> {
        let seq = engine.executor.new_sequence()?;
        let vocab = engine.executor.config().vocab_size;
        Ok(Session {
            engine,
            seq,
            cached: Vec::new(),
            logits: vec![0.0; vocab],
        })
    }

    pub fn engine(&self) -> &Engine {
        self.engine
    }

    /// Tokens the KV cache holds.
    pub fn cached_tokens(&self) -> &[u32] {
        &self.cached
    }

    /// Runs `prompt` (reusing the cached prefix) and generates, calling `on_text` with each
    /// piece of text as soon as it is final (never a partial UTF-8 character, never a part
    /// of a stop string).
    pub fn generate(
        &mut self,
        prompt: &[u32],
        params: &GenerateParams,
        mut on_text: impl FnMut(&str),
    ) -> Result<Generation> {
        if prompt.is_empty() {
            return Err(Error::InvalidArgument("the prompt has no tokens".into()));
        }
        params.validate()?;
        let vocab = self.engine.executor.config().vocab_size;
        if let Some(&bad) = prompt.iter().find(|&&t| t as usize >= vocab) {
            return Err(Error::InvalidArgument(format!(
                "token id {bad} is outside the vocabulary ({vocab})"
            )));
        }
        let max_context = self.engine.executor.max_context();
        if prompt.len() >= max_context {
            return Err(Error::ContextExceeded {
                tokens: prompt.len(),
                context: max_context,
            });
        }

        // Made before anything changes: a schema it refuses leaves the session as it was.
        let constraint = match &params.json_schema {
            Some(schema) => Some(self.engine.json_constraint(schema)?),
            None => None,
        };

        // Keep the longest cached prefix, but always prefill at least one token: its
        // logits start the generation.
        let mut keep = self
            .cached
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        keep = keep.min(prompt.len() - 1);
        let exec = &mut self.engine.executor;
        exec.truncate_sequence(self.seq, keep)?;
        self.cached.truncate(keep);

        let start = Instant::now();
        let new = &prompt[keep..];
        exec.prefill(self.seq, new, &mut self.logits)?;
        self.cached.extend_from_slice(new);
        let prefill_time = start.elapsed();

        let mut sampler = Sampler::new(params.sampling.clone());
        for &t in prompt {
            sampler.accept(t);
        }
        let rules = SequenceRules {
            max_tokens: params.max_tokens,
            stop_strings: params.stop_strings.clone(),
            stop_on_eos: params.stop_on_eos,
            presence_penalty: params.presence_penalty,
            frequency_penalty: params.frequency_penalty,
            split_reasoning: params.split_reasoning,
            ..SequenceRules::default()
        };
        let mut generation =
            SequenceGeneration::new(&self.engine.model.tokenizer, rules, constraint);
        let exec = &mut self.engine.executor;
        let (mut text, mut reasoning) = (String::new(), String::new());
        let mut ids = Vec::new();
        let decode_start = Instant::now();
        let mut decode_steps = 0usize;
        if params.max_tokens == 0 {
            // The prompt is processed (and cached); nothing is generated.
            return Ok(Generation {
                prompt_ids: prompt.to_vec(),
                prefilled: new.len(),
                ids: Vec::new(),
                text: String::new(),
                reasoning: String::new(),
                finish: Finish::Length,
                prefill_time,
                first_token_time: Duration::ZERO,
                decode_time: decode_start.elapsed(),
                decode_steps: 0,
                logprobs: Vec::new(),
            });
        }
        let tokenizer = &self.engine.model.tokenizer;
        let mut candidates = Vec::new();
        let name = |t: u32| tokenizer.decode(&[t], false);
        let mut logprobs = Vec::new();
        let (mut token, mut logprob) = generation.draw(
            &mut sampler,
            &mut self.logits,
            params.logprobs,
            &mut candidates,
            name,
        )?;
        let first_token_time = start.elapsed();
        let finish = loop {
            let accepted = generation.accept(token, self.cached.len(), max_context);
            if accepted.kept {
                ids.push(token);
                logprobs.extend(logprob.take());
            }
            if !accepted.text.is_empty() {
                on_text(&accepted.text);
                text.push_str(&accepted.text);
            }
            reasoning.push_str(&accepted.reasoning);
            if let Some(finish) = accepted.finish {
                break finish;
            }
            if params
                .cancel
                .as_ref()
                .is_some_and(CancelToken::is_cancelled)
            {
                let ended = generation.end(Finish::Cancelled);
                if !ended.text.is_empty() {
                    on_text(&ended.text);
                    text.push_str(&ended.text);
                }
                reasoning.push_str(&ended.reasoning);
                break Finish::Cancelled;
            }
            let step = decode_steps + 1;
            let at_step = move |e: Error| match e {
                Error::NonFiniteLogits { .. } => Error::NonFiniteLogits { step },
                other => other,
            };
            let item = DecodeItem {
                seq: self.seq,
                token,
            };
            // The executor draws the next token itself unless the host must shape the
            // logits first (a grammar).
            let host = generation.needs_host_logits() || params.logprobs.is_some();
            let mut next = [0u32];
            match host {
                true => exec.decode(&[item], &mut self.logits),
                false => exec.decode_sample(&[item], std::slice::from_mut(&mut sampler), &mut next),
            }
            .map_err(at_step)?;
            self.cached.push(token);
            decode_steps += 1;
            (token, logprob) = match host {
                true => generation
                    .draw(
                        &mut sampler,
                        &mut self.logits,
                        params.logprobs,
                        &mut candidates,
                        name,
                    )
                    .map_err(at_step)?,
                false => (next[0], None),
            };
        };
        let decode_time = decode_start.elapsed();
        Ok(Generation {
            prompt_ids: prompt.to_vec(),
            prefilled: new.len(),
            ids,
            text,
            reasoning,
            finish,
            prefill_time,
            first_token_time,
            decode_time,
            decode_steps,
            logprobs,
        })
    }
}

impl Drop for Session<'_> {
    fn drop(&mut self) {
        // Freeing can only fail for an unknown sequence, which this session owns.
        let _ = self.engine.executor.free_sequence(self.seq);
    }
}
