//! One sequence's generation, whichever loop drives it ([`crate::Session`] one token at a
//! time, the batching scheduler behind `kiln serve` and the [`crate::Batcher`] many at once):
//! [`SequenceGeneration`] shapes the logits a token is drawn from on the host (logit bias
//! and repetition penalty, presence and frequency penalties, the output grammar) and decides
//! what each drawn token does — an end-of-sequence token, text through [`TextOutput`]
//! (decoded through the tokenizer's `DecodeStream`, never half a UTF-8 character, cut
//! before the first stop string, streamed without the tail that could still become one),
//! the length and context limits — ending with one [`Finish`]. The loops only move tokens
//! between it and an executor.

use std::collections::HashMap;

use kiln_core::{Error, Result, Sampler};
use kiln_formats::tokenizer::{DecodeStream, Tokenizer};

use crate::harmony::{Channels, Destination, HarmonyTokens};
use crate::structured::Constraint;

/// The rules one sequence generates under (besides its sampler's own settings).
#[derive(Debug, Clone, Default)]
pub(crate) struct SequenceRules {
    pub max_tokens: usize,
    /// Text ends before the first of these.
    pub stop_strings: Vec<String>,
    /// The model's end-of-sequence tokens end the sequence (always with a grammar: it
    /// allows them only once the value is complete).
    pub stop_on_eos: bool,
    /// OpenAI's penalties: subtracted from a token's logit once it was generated
    /// (`presence`) and per time it was (`frequency`).
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Special tokens (end of turn, ...) make no text.
    pub skip_special: bool,
    /// A chat answer: a model that writes its reasoning on a channel of its own (gpt-oss's
    /// harmony) has it kept apart from the answer ([`Accepted::reasoning`]).
    pub split_reasoning: bool,
}

/// What a drawn token did.
#[derive(Debug, PartialEq)]
pub(crate) struct Accepted {
    /// The token is part of the output (an end-of-sequence token is not).
    pub kept: bool,
    /// Text it made final (maybe empty).
    pub text: String,
    /// Reasoning it made final (with [`SequenceRules::split_reasoning`]; maybe empty).
    pub reasoning: String,
    /// `Some` when the sequence ended with it: the token is part of the output unless it
    /// was an end-of-sequence token (then `text` is what was held back).
    pub finish: Option<Finish>,
}

/// One sequence's generation state (see the module doc). Its [`Sampler`] lives with the
/// loop, which may hand a batch of them to an executor's own sampling.
pub(crate) struct SequenceGeneration<'t> {
    rules: SequenceRules,
    tokenizer: &'t Tokenizer,
    stop_tokens: &'t [u32],
    constraint: Option<Constraint>,
    output: TextOutput<'t>,
    /// The model's channels, when its reasoning is kept apart, and the reasoning's text.
    channels: Option<(Channels, TextOutput<'t>)>,
    /// A harmony call's arguments are being written (its opening is in the text).
    in_call: bool,
    generated: usize,
    /// Times each token was generated, for the presence and frequency penalties.
    counts: HashMap<u32, u32>,
}

impl<'t> SequenceGeneration<'t> {
    pub fn new(
        tokenizer: &'t Tokenizer,
        rules: SequenceRules,
        constraint: Option<Constraint>,
    ) -> Self {
        let output = TextOutput::new(tokenizer, rules.stop_strings.clone(), rules.skip_special);
        let channels = HarmonyTokens::of(tokenizer)
            .filter(|_| rules.split_reasoning)
            .map(|t| {
                (
                    Channels::new(t),
                    TextOutput::new(tokenizer, Vec::new(), true),
                )
            });
        SequenceGeneration {
            rules,
            tokenizer,
            stop_tokens: tokenizer.stop_tokens(),
            constraint,
            output,
            channels,
            in_call: false,
            generated: 0,
            counts: HashMap::new(),
        }
    }

    /// Tokens generated so far (an end-of-sequence token not counted).
    pub fn generated(&self) -> usize {
        self.generated
    }

    fn penalised(&self) -> bool {
        self.rules.presence_penalty != 0.0 || self.rules.frequency_penalty != 0.0
    }

    /// Whether its tokens must be drawn on the host from logits: an executor's own sampling
    /// applies the sampler's settings but not a grammar or OpenAI's penalties.
    pub fn needs_host_logits(&self) -> bool {
        self.constraint.is_some() || self.penalised()
    }

    /// Everything before the pick of a host-side draw: `row` checked finite (before any
    /// bias, which may be large), then the sampler's bias and repetition penalty, the
    /// presence and frequency penalties, and the grammar's mask.
    pub fn shape(&mut self, sampler: &Sampler, row: &mut [f32]) -> Result<()> {
        kiln_core::check_finite(row)?;
        sampler.adjust(row);
        if self.penalised() {
            for (&t, &c) in &self.counts {
                if let Some(l) = row.get_mut(t as usize) {
                    *l -= self.rules.frequency_penalty * c as f32 + self.rules.presence_penalty;
                }
            }
        }
        if let Some(c) = &mut self.constraint {
            c.mask(row, self.stop_tokens)
                .map_err(Error::InvalidArgument)?;
        }
        Ok(())
    }

    /// After the pick: the grammar takes the token.
    pub fn picked(&mut self, token: u32) -> Result<()> {
        match &mut self.constraint {
            Some(c) => c
                .advance(token, self.stop_tokens)
                .map_err(Error::InvalidArgument),
            None => Ok(()),
        }
    }

    /// A whole host-side draw from `row`: [`Self::shape`], the sampler's pick,
    /// [`Self::picked`]; with `logprobs` `Some(k)`, also the drawn token's log-probability
    /// and the `k` likeliest tokens' under the distribution it was drawn from (bias,
    /// penalties and the output constraint in, temperature not), named by `name`.
    /// `candidates` is scratch.
    pub fn draw(
        &mut self,
        sampler: &mut Sampler,
        row: &mut [f32],
        logprobs: Option<usize>,
        candidates: &mut Vec<(u32, f32)>,
        name: impl Fn(u32) -> String,
    ) -> Result<(u32, Option<TokenLogprob>)> {
        self.shape(sampler, row)?;
        let lse = logprobs.map(|_| log_sum_exp(row));
        let token = sampler.pick(row);
        self.picked(token)?;
        let logprob = logprobs
            .zip(lse)
            .map(|(k, lse)| token_logprob(row, token, k, lse, candidates, name));
        Ok((token, logprob))
    }

    /// What `token`, just drawn, does when the sequence's cache holds `cached` tokens of a
    /// context of `max_context` (the token itself not yet among them).
    pub fn accept(&mut self, token: u32, cached: usize, max_context: usize) -> Accepted {
        let eos = self.stop_tokens.contains(&token);
        if eos && (self.rules.stop_on_eos || self.constraint.is_some()) {
            return self.end(Finish::Stop);
        }
        self.generated += 1;
        if self.penalised() {
            *self.counts.entry(token).or_insert(0) += 1;
        }
        let mut reasoning = String::new();
        let released = match &mut self.channels {
            None => self.output.push(token),
            Some((channels, thoughts)) => {
                let tokenizer = self.tokenizer;
                let to = channels.route(token, || tokenizer.decode(&[token], false));
                // A harmony call goes into the text in the form kiln's call parser reads
                // (`crate::tools`, Hermes): its opening before the arguments' first token,
                // its closing once the body ends.
                let mut released = match (to, self.in_call) {
                    (Destination::Call, false) => {
                        self.in_call = true;
                        let name = channels.recipient().unwrap_or_default();
                        let name = serde_json::Value::from(name);
                        self.output
                            .push_str(&format!("<tool_call>\n{{\"name\": {name}, \"arguments\": "))
                    }
                    (Destination::Call, true) => Released::default(),
                    (_, true) => {
                        self.in_call = false;
                        self.output.push_str(CALL_CLOSE)
                    }
                    (_, false) => Released::default(),
                };
                let next = match to {
                    Destination::Content | Destination::Call => self.output.push(token),
                    Destination::Reasoning => {
                        reasoning = thoughts.push(token).text;
                        Released::default()
                    }
                    Destination::Nowhere => Released::default(),
                };
                released.text.push_str(&next.text);
                released.stopped |= next.stopped;
                released
            }
        };
        let mut text = released.text;
        let finish = if released.stopped {
            // Nothing is held back after a stop string.
            Some(Finish::Stop)
        } else if self.generated >= self.rules.max_tokens {
            Some(self.finish_held(Finish::Length, &mut text, &mut reasoning))
        } else if cached + 1 > max_context {
            // No room to decode it: the sequence ends with it.
            Some(self.finish_held(Finish::ContextFull, &mut text, &mut reasoning))
        } else {
            None
        };
        Accepted {
            kept: true,
            text,
            reasoning,
            finish,
        }
    }

    /// Ends the sequence for `finish` (a stop token, cancellation): the text still held
    /// back, and the finish to report.
    pub fn end(&mut self, finish: Finish) -> Accepted {
        let (mut text, mut reasoning) = (String::new(), String::new());
        let finish = self.finish_held(finish, &mut text, &mut reasoning);
        Accepted {
            kept: false,
            text,
            reasoning,
            finish: Some(finish),
        }
    }

    /// Appends the text still held back to `text` (and the reasoning to `reasoning`), cut
    /// at a stop string; `finish`, or `Stop` where a stop string turned up in that text (a
    /// cancellation stays one).
    fn finish_held(&mut self, finish: Finish, text: &mut String, reasoning: &mut String) -> Finish {
        if let Some((_, thoughts)) = &mut self.channels {
            reasoning.push_str(&thoughts.finish().text);
        }
        if std::mem::take(&mut self.in_call) {
            // The call's end (`<|call|>`, a stop token) closes it.
            text.push_str(&self.output.push_str(CALL_CLOSE).text);
        }
        let rest = self.output.finish();
        text.push_str(&rest.text);
        match rest.stopped && finish != Finish::Cancelled {
            true => Finish::Stop,
            false => finish,
        }
    }
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The sequence reached the executor's context limit.
    ContextFull,
    /// Cancelled: by the host ([`crate::CancelToken`]), or by the server's shutdown once
    /// its grace period ran out (not an OpenAI value).
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::ContextFull => "context_full",
            Finish::Cancelled => "cancelled",
        }
    }

    /// The OpenAI API's `finish_reason`: a full context is `length` there.
    pub fn api_reason(self) -> &'static str {
        match self {
            Finish::ContextFull => "length",
            other => other.as_str(),
        }
    }
}

/// The end of a harmony call written in the call parser's form (see `accept`).
const CALL_CLOSE: &str = "}\n</tool_call>";

/// One sequence's text (see the module doc).
pub(crate) struct TextOutput<'t> {
    stream: DecodeStream<'t>,
    stops: Vec<String>,
    /// Decoded text not released yet (a possible start of a stop string).
    pending: String,
    /// A stop string has ended the text.
    stopped: bool,
}

/// Text a token (or the end) releases, and whether a stop string ended the sequence.
#[derive(Debug, Default, PartialEq)]
pub(crate) struct Released {
    pub text: String,
    pub stopped: bool,
}

impl<'t> TextOutput<'t> {
    /// `skip_special`: special tokens (end of turn, ...) make no text.
    pub fn new(tokenizer: &'t Tokenizer, stops: Vec<String>, skip_special: bool) -> Self {
        TextOutput {
            stream: tokenizer.decode_stream(skip_special),
            stops,
            pending: String::new(),
            stopped: false,
        }
    }

    /// Decodes `token`: the text it makes final (up to a stop string, if one is now
    /// complete: then `stopped`, and later tokens release nothing).
    pub fn push(&mut self, token: u32) -> Released {
        match self.stream.push(token) {
            Some(piece) => self.push_str(&piece),
            None => self.push_str(""),
        }
    }

    /// Text that joins the output as a token's would (a call's framing, written by kiln).
    pub fn push_str(&mut self, piece: &str) -> Released {
        if self.stopped {
            return Released::default();
        }
        self.pending.push_str(piece);
        if let Some(cut) = find_stop(&self.pending, &self.stops) {
            self.pending.truncate(cut);
            self.stopped = true;
            return Released {
                text: std::mem::take(&mut self.pending),
                stopped: true,
            };
        }
        let hold = held_back(&self.pending, &self.stops);
        Released {
            text: self.pending.drain(..self.pending.len() - hold).collect(),
            stopped: false,
        }
    }

    /// The end of the sequence: the text still held back (and any bytes the decoder kept),
    /// cut at a stop string (`stopped` if one is in it). Nothing after a stop string.
    pub fn finish(&mut self) -> Released {
        if self.stopped {
            return Released::default();
        }
        if let Some(rest) = self.stream.flush() {
            self.pending.push_str(&rest);
        }
        let stopped = match find_stop(&self.pending, &self.stops) {
            Some(cut) => {
                self.pending.truncate(cut);
                true
            }
            None => false,
        };
        self.stopped = stopped;
        Released {
            text: std::mem::take(&mut self.pending),
            stopped,
        }
    }
}

/// Byte offset where the first stop string starts, if any is in `text`.
fn find_stop(text: &str, stops: &[String]) -> Option<usize> {
    stops
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min()
}

/// Length of the longest suffix of `text` that could begin a stop string: it is withheld
/// from streaming until the next token decides.
fn held_back(text: &str, stops: &[String]) -> usize {
    let mut hold = 0;
    for stop in stops {
        for (i, _) in stop.char_indices().skip(1) {
            if text.ends_with(&stop[..i]) {
                hold = hold.max(i);
            }
        }
    }
    hold
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_strings_are_found_and_partial_ones_held_back() {
        let stops = vec!["\n\n".to_string(), "User:".to_string()];
        assert_eq!(find_stop("hello\n\nthere", &stops), Some(5));
        assert_eq!(find_stop("hello", &stops), None);
        assert_eq!(held_back("hello\n", &stops), 1);
        assert_eq!(held_back("say Use", &stops), 3);
        assert_eq!(held_back("plain", &stops), 0);
        assert_eq!(held_back("héllo", &["é!".to_string()]), 0);
    }

    /// gpt-oss's vocabulary as `kiln synth` writes it (o200k's specials at their ids).
    fn harmony_tokenizer() -> Tokenizer {
        use kiln_formats::gguf::{GgufFile, GgufWriter};
        use kiln_formats::quantize::Recipe;
        use kiln_formats::synth::{metadata, Preset};
        let mut w = GgufWriter::new();
        for (k, v) in metadata(Preset::GptOss20b, Recipe::MXFP4_MOE, 0) {
            w.add_kv(k, v).unwrap();
        }
        let bytes = w.write_to(Vec::new()).unwrap();
        let file = GgufFile::from_storage(std::sync::Arc::new(bytes)).unwrap();
        Tokenizer::from_gguf(&file).unwrap()
    }

    /// A harmony answer (reasoning, then the final message) through a chat generation:
    /// `<|end|>` closes the analysis without ending the turn, `<|return|>` ends it; the
    /// reasoning and the answer come apart, markers and headers in neither. The same
    /// tokens outside a chat are one text.
    #[test]
    fn harmony_channels_split_reasoning_from_the_answer() {
        let tok = harmony_tokenizer();
        let stops = tok.stop_tokens().to_vec();
        let id = |p: &str| tok.token_id(p).unwrap();
        assert!(stops.contains(&id("<|return|>")) && stops.contains(&id("<|call|>")));
        assert!(!stops.contains(&id("<|end|>")));
        let answer = "<|channel|>analysis<|message|>Two and two.<|end|><|start|>assistant<|channel|>final<|message|>It is 4.<|return|>";
        let ids = tok.encode(answer, false, true).unwrap();
        let run = |split_reasoning: bool| {
            let rules = SequenceRules {
                max_tokens: 1000,
                stop_on_eos: true,
                skip_special: true,
                split_reasoning,
                ..SequenceRules::default()
            };
            let mut g = SequenceGeneration::new(&tok, rules, None);
            let (mut text, mut reasoning, mut finish) = (String::new(), String::new(), None);
            for (i, &t) in ids.iter().enumerate() {
                let a = g.accept(t, i, 4096);
                text.push_str(&a.text);
                reasoning.push_str(&a.reasoning);
                if a.finish.is_some() {
                    finish = a.finish.map(|f| (f, i));
                    break;
                }
            }
            (text, reasoning, finish)
        };
        let last = ids.len() - 1;
        assert_eq!(
            run(true),
            (
                "It is 4.".to_string(),
                "Two and two.".to_string(),
                Some((Finish::Stop, last))
            )
        );
        let (text, reasoning, finish) = run(false);
        assert_eq!(
            (text.as_str(), reasoning.as_str(), finish),
            (
                "analysisTwo and two.assistantfinalIt is 4.",
                "",
                Some((Finish::Stop, last))
            )
        );
        // Cut off by the length limit inside the analysis (four tokens into its body): the
        // reasoning so far, no answer.
        let body = ids.iter().position(|&t| t == id("<|message|>")).unwrap() + 1;
        let rules = SequenceRules {
            max_tokens: body + 4,
            stop_on_eos: true,
            skip_special: true,
            split_reasoning: true,
            ..SequenceRules::default()
        };
        let mut g = SequenceGeneration::new(&tok, rules, None);
        let (mut text, mut reasoning) = (String::new(), String::new());
        for (i, &t) in ids.iter().take(body + 4).enumerate() {
            let a = g.accept(t, i, 4096);
            text.push_str(&a.text);
            reasoning.push_str(&a.reasoning);
        }
        assert_eq!(text, "");
        assert!(
            "Two and two.".starts_with(&reasoning) && !reasoning.is_empty(),
            "{reasoning:?}"
        );
    }

    /// A harmony tool call (reasoning, then a commentary body to a function, ended by
    /// `<|call|>`) comes out as text the call parser reads: the server's `tool_calls`.
    #[test]
    fn a_harmony_call_reaches_the_call_parser() {
        let tok = harmony_tokenizer();
        let answer = "<|channel|>analysis<|message|>Need weather.<|end|><|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{\"city\":\"Oslo\"}<|call|>";
        let ids = tok.encode(answer, false, true).unwrap();
        let rules = SequenceRules {
            max_tokens: 1000,
            stop_on_eos: true,
            skip_special: true,
            split_reasoning: true,
            ..SequenceRules::default()
        };
        let mut g = SequenceGeneration::new(&tok, rules, None);
        let (mut text, mut reasoning, mut finish) = (String::new(), String::new(), None);
        for (i, &t) in ids.iter().enumerate() {
            let a = g.accept(t, i, 4096);
            text.push_str(&a.text);
            reasoning.push_str(&a.reasoning);
            if a.finish.is_some() {
                finish = a.finish;
                break;
            }
        }
        assert_eq!(finish, Some(Finish::Stop));
        assert_eq!(reasoning, "Need weather.");
        let tools = [crate::tools::Tool {
            name: "get_weather".into(),
            description: None,
            parameters: serde_json::json!({"type": "object"}),
            strict: false,
        }];
        let parsed = crate::tools::parse(&text, crate::tools::CallFormat::Hermes, &tools);
        assert_eq!(parsed.content, "", "{text:?}");
        assert_eq!(parsed.calls.len(), 1, "{text:?}");
        assert_eq!(
            parsed.calls[0].arguments,
            serde_json::json!({"city": "Oslo"})
        );
    }

    #[test]
    fn only_a_full_context_reads_differently_in_the_api() {
        assert_eq!(Finish::ContextFull.api_reason(), "length");
        for f in [Finish::Stop, Finish::Length, Finish::Cancelled] {
            assert_eq!(f.api_reason(), f.as_str());
        }
    }
}

/// A token's log-probability and its most likely alternatives.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// log Σ exp(row), NaNs left out, stable for large values.
pub(crate) fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return max;
    }
    let sum: f64 = row
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| ((x - max) as f64).exp())
        .sum();
    max + sum.ln() as f32
}

/// The drawn `token`'s log-probability under the shaped `row` (whose log-sum-exp is `lse`)
/// and the `k` most likely tokens with theirs (equal logits to the lower id), each named
/// by `name`; −9999 stands for minus infinity, as OpenAI's API reports it. `candidates` is
/// scratch.
pub(crate) fn token_logprob(
    row: &[f32],
    token: u32,
    k: usize,
    lse: f32,
    candidates: &mut Vec<(u32, f32)>,
    name: impl Fn(u32) -> String,
) -> TokenLogprob {
    let lp = |x: f32| {
        if x.is_finite() {
            (x - lse).max(-9999.0)
        } else {
            -9999.0
        }
    };
    let mut top = Vec::new();
    if k > 0 {
        let c = candidates;
        c.clear();
        c.extend(
            row.iter()
                .enumerate()
                .filter(|(_, l)| !l.is_nan())
                .map(|(t, &l)| (t as u32, l)),
        );
        let by_desc = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        let k = k.min(c.len());
        if k > 0 && k < c.len() {
            c.select_nth_unstable_by(k - 1, by_desc);
        }
        c.truncate(k);
        c.sort_unstable_by(by_desc);
        top = c.iter().map(|&(t, l)| (name(t), lp(l))).collect();
    }
    TokenLogprob {
        token: name(token),
        logprob: lp(row.get(token as usize).copied().unwrap_or(f32::NAN)),
        top,
    }
}
