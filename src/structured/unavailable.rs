//! Structured outputs in a kiln built without the `constraints` feature: the same interface,
//! every constrained output refused with the reason (the request's error message), and no
//! [`Constraint`] value can exist.

use std::sync::Arc;

use kiln_formats::tokenizer::{Tokenizer, TokenizerSpec};
use serde_json::Value;

const UNAVAILABLE: &str =
    "this kiln was built without its `constraints` feature (structured outputs and required tool calls)";

/// Builds the constraint of each request; here, the refusal of each.
pub struct Grammars {
    _private: (),
}

impl Grammars {
    /// A [`Grammars`] for any model (the refusal does not depend on it).
    pub fn from_spec(_spec: &TokenizerSpec) -> kiln_core::Result<Option<Grammars>> {
        Ok(Some(Grammars { _private: () }))
    }

    /// A [`Grammars`] for any tokenizer (the refusal does not depend on it).
    pub fn new(_tokenizer: Arc<Tokenizer>) -> Result<Option<Grammars>, String> {
        Ok(Some(Grammars { _private: () }))
    }

    /// Refuses: no JSON schema can be enforced in this build.
    pub fn json(&self, _schema: &Value) -> Result<Constraint, String> {
        Err(format!("'response_format' cannot be used: {UNAVAILABLE}"))
    }

    /// Refuses: no grammar can be enforced in this build.
    pub fn lark(&self, _lark: &str, what: &str) -> Result<Constraint, String> {
        Err(format!("{what} cannot be used: {UNAVAILABLE}"))
    }
}

/// One sequence's constraint: none can be made in this build.
#[derive(Clone)]
pub enum Constraint {}

impl Constraint {
    pub fn mask(&mut self, _logits: &mut [f32], _stop_tokens: &[u32]) -> Result<(), String> {
        match *self {}
    }

    pub fn advance(&mut self, _token: u32, _stop_tokens: &[u32]) -> Result<(), String> {
        match *self {}
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Both ways to ask for a constraint are refused with a message that names the feature.
    #[test]
    fn every_constraint_is_refused_naming_the_feature() {
        let g = Grammars { _private: () };
        let json = g
            .json(&serde_json::json!({"type": "object"}))
            .err()
            .unwrap();
        let lark = g.lark("start: \"a\"", "the tool grammar").err().unwrap();
        for message in [json, lark] {
            assert!(message.contains("`constraints` feature"), "{message}");
        }
    }
}
