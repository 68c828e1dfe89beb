//! Structured outputs: `response_format` (`json_object`, `json_schema`) as a constraint on
//! sampling, through llguidance — the constrained-decoding library llama.cpp and vLLM use
//! too. Its matcher walks the schema's grammar over the bytes of the text generated so
//! far and, before each token is drawn, says which tokens of the vocabulary can continue
//! it; the others get a logit of −∞, so whatever the sampler draws keeps the output a
//! prefix of a conforming JSON value, and end-of-sequence is allowed only once the value
//! is complete.
//!
//! The vocabulary reaches llguidance as a trie of each token's bytes
//! ([`Tokenizer::token_bytes`]); control tokens are entered under llguidance's special
//! marker, so text never matches them. Whitespace between JSON tokens is bounded (at most
//! one newline and a few spaces, as llama.cpp's JSON grammar allows) unless the schema's
//! `x-guidance` options say otherwise: with unbounded whitespace a model can fill its
//! whole budget with blanks.

//!
//! Built without the `constraints` feature (a host that wants neither, and not llguidance's
//! crates), every request for a constrained output is refused with the reason, and
//! [`Constraint`] has no values.

use serde_json::Value;

#[cfg(feature = "constraints")]
mod guidance;
#[cfg(feature = "constraints")]
pub use guidance::{Constraint, Grammars};

#[cfg(not(feature = "constraints"))]
mod unavailable;
#[cfg(not(feature = "constraints"))]
pub use unavailable::{Constraint, Grammars};

/// The longest a schema's grammar may take to prepare (its lexer, built at the first
/// mask); one that takes longer is refused as too costly.
pub const COMPILE_BUDGET: std::time::Duration = std::time::Duration::from_millis(250);

/// [`Grammars::json`] where the model may have none (no end-of-sequence token).
pub fn json_constraint(grammars: Option<&Grammars>, schema: &Value) -> Result<Constraint, String> {
    match grammars {
        Some(g) => g.json(schema),
        None => Err(
            "this model has no end-of-sequence token, so a structured output could not end".into(),
        ),
    }
}
