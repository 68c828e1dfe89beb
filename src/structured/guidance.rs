//! The constraint through llguidance (the `constraints` feature).

use std::sync::Arc;

use kiln_core::Error;
use kiln_formats::tokenizer::{Tokenizer, TokenizerSpec};
use llguidance::api::TopLevelGrammar;
use llguidance::{Matcher, ParserFactory};
use serde_json::{json, Value};

use super::COMPILE_BUDGET;
use toktrie::{TokEnv, TokRxInfo, TokTrie, TokenId, TokenizerEnv};

/// Whitespace allowed between JSON tokens when the schema does not choose: one space, or a
/// newline and up to 20 spaces or tabs of indentation.
const WHITESPACE: &str = r"[\x20]|\x0A[\x20\x09]{0,20}";

/// The vocabulary as llguidance sees it.
struct Vocabulary {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for Vocabulary {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    fn tokenize_bytes(&self, s: &[u8]) -> Vec<TokenId> {
        // llguidance tokenizes grammar literals with this; lossy text only for bytes that
        // are not UTF-8, which no JSON grammar holds.
        self.tokenizer
            .encode(&String::from_utf8_lossy(s), false, false)
            .unwrap_or_default()
    }
}

/// Builds the constraint of each request: one per server, made when the model loads.
pub struct Grammars {
    factory: ParserFactory,
    /// The token llguidance allows when a value is complete; every stop token of the model
    /// is allowed with it (a chat model ends its turn with its own end-of-turn token).
    eos: TokenId,
}

impl Grammars {
    /// [`Grammars::new`] for the tokenizer a model file describes.
    pub fn from_spec(spec: &TokenizerSpec) -> kiln_core::Result<Option<Grammars>> {
        let tokenizer = Tokenizer::from_spec(spec.clone())?;
        Grammars::new(Arc::new(tokenizer))
            .map_err(|e| Error::Tokenizer(format!("structured outputs: {e}")))
    }

    /// The vocabulary trie and the parser factory for `tokenizer`; `None` for a model
    /// with no end-of-sequence token (a constrained output could never end).
    pub fn new(tokenizer: Arc<Tokenizer>) -> Result<Option<Grammars>, String> {
        let Some(eos) = tokenizer
            .eos()
            .or_else(|| tokenizer.stop_tokens().first().copied())
        else {
            return Ok(None);
        };
        let words: Vec<Vec<u8>> = (0..tokenizer.vocab_size() as u32)
            .map(|t| {
                let bytes = tokenizer.token_bytes(t).unwrap_or_default();
                if tokenizer.is_special(t) || tokenizer.stop_tokens().contains(&t) {
                    // Control tokens are never text: llguidance keeps them behind its marker.
                    let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                    w.extend_from_slice(tokenizer.piece(t).unwrap_or_default().as_bytes());
                    w
                } else {
                    bytes.to_vec()
                }
            })
            .collect();
        let info = TokRxInfo::new(words.len() as u32, eos);
        let trie = TokTrie::from(&info, &words);
        let env: TokEnv = Arc::new(Vocabulary { trie, tokenizer });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| e.to_string())?;
        factory.quiet();
        Ok(Some(Grammars { factory, eos }))
    }

    /// A fresh constraint for output that must be a JSON value conforming to `schema`, or
    /// the reason the schema cannot be used (the request's error message).
    pub fn json(&self, schema: &Value) -> Result<Constraint, String> {
        let mut schema = match schema {
            Value::Bool(true) => json!({}),
            other => other.clone(),
        };
        if let Value::Object(o) = &mut schema {
            if !o.contains_key("x-guidance") {
                o.insert(
                    "x-guidance".into(),
                    json!({"whitespace_pattern": WHITESPACE}),
                );
            }
        } else {
            return Err("'response_format' needs a JSON schema that is an object".into());
        }
        self.compile(TopLevelGrammar::from_json_schema(schema), "the JSON schema")
    }

    /// A fresh constraint for output of the Lark grammar `lark` (llguidance's dialect,
    /// whose `%json {…}` rules are JSON schemas: [`crate::tools::grammar`]'s calls), or
    /// why it cannot be used; `what` names it in messages.
    pub fn lark(&self, lark: &str, what: &str) -> Result<Constraint, String> {
        self.compile(TopLevelGrammar::from_lark(lark.to_string()), what)
    }

    /// The grammar's constraint, its first mask computed here under [`COMPILE_BUDGET`].
    fn compile(&self, grammar: TopLevelGrammar, what: &str) -> Result<Constraint, String> {
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| format!("{what} cannot be used: {e}"))?;
        let mut matcher = Matcher::new(Ok(parser)).into_cancellable();
        if let Some(e) = matcher.get_error() {
            return Err(format!("{what} cannot be used: {e}"));
        }
        // llguidance builds its lexer lazily, at the first mask: build it here, where the
        // caller compiles (the server's blocking pool), not on the engine thread at the
        // first step, and within COMPILE_BUDGET (a pattern like `^(a{1000}){1000}$` would
        // take a second; a `$ref` cycle fails only here).
        let cancel = matcher.cancellation_handle();
        let (done, finished) = std::sync::mpsc::channel::<()>();
        let watchdog = std::thread::spawn(move || {
            if let Err(std::sync::mpsc::RecvTimeoutError::Timeout) =
                finished.recv_timeout(COMPILE_BUDGET)
            {
                if let Some(c) = cancel {
                    c.cancel();
                }
            }
        });
        let first = matcher.compute_mask();
        let _ = done.send(());
        let _ = watchdog.join();
        if matcher.is_cancelled() {
            return Err(format!(
                "{what} is too costly to use: preparing its grammar took more than {} ms",
                COMPILE_BUDGET.as_millis()
            ));
        }
        if let Err(e) = first {
            return Err(format!("{what} cannot be used: {}", first_line(e)));
        }
        Ok(Constraint {
            matcher,
            eos: self.eos,
        })
    }
}

/// One sequence's constraint: its grammar's state over the tokens drawn so far. A clone
/// starts from the same state and goes on independently.
#[derive(Clone)]
pub struct Constraint {
    matcher: Matcher,
    /// The token llguidance's masks allow when a value is complete.
    eos: TokenId,
}

impl Constraint {
    /// Sets every logit the grammar does not allow next to −∞; the stop tokens are allowed
    /// exactly when the value is complete.
    pub fn mask(&mut self, logits: &mut [f32], stop_tokens: &[u32]) -> Result<(), String> {
        let mask = self.matcher.compute_mask_or_eos().map_err(failure)?;
        let may_end = mask.is_allowed(self.eos);
        for (t, l) in logits.iter_mut().enumerate() {
            let t = t as u32;
            let allowed = if stop_tokens.contains(&t) {
                may_end
            } else {
                // Logit rows may be longer than the tokenizer's vocabulary (padding).
                (t as usize) < mask.len() && mask.is_allowed(t)
            };
            if !allowed {
                *l = f32::NEG_INFINITY;
            }
        }
        Ok(())
    }

    /// Advances the grammar over a drawn token; a stop token (which [`Constraint::mask`]
    /// allows only once the value is complete) ends the output instead.
    pub fn advance(&mut self, token: u32, stop_tokens: &[u32]) -> Result<(), String> {
        if stop_tokens.contains(&token) {
            return Ok(());
        }
        self.matcher.consume_token(token).map_err(failure)
    }
}

/// llguidance's error, first line only: the rest is a dump of the parser's state.
fn failure(e: impl std::fmt::Display) -> String {
    format!("the output constraint failed: {}", first_line(e))
}

fn first_line(e: impl std::fmt::Display) -> String {
    e.to_string().lines().next().unwrap_or_default().to_string()
}
