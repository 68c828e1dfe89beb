//! What every generation loop shares, per sequence: why it ended ([`Finish`]), and the text
//! its tokens make ([`TextOutput`]): decoded through the tokenizer's `DecodeStream` (never
//! half a UTF-8 character), cut before the first stop string, and streamed without the tail
//! that could still become one. [`crate::Session`] and the server's scheduler (and so the
//! [`crate::Batcher`]) both use them, so a stop string ends text the same way everywhere.

use kiln_formats::tokenizer::{DecodeStream, Tokenizer};

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached.
    Length,
    /// The sequence reached the executor's context limit.
    ContextFull,
    /// The server is shutting down and the grace period ran out (not an OpenAI value).
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
        if self.stopped {
            return Released::default();
        }
        if let Some(piece) = self.stream.push(token) {
            self.pending.push_str(&piece);
        }
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

    #[test]
    fn only_a_full_context_reads_differently_in_the_api() {
        assert_eq!(Finish::ContextFull.api_reason(), "length");
        for f in [Finish::Stop, Finish::Length, Finish::Cancelled] {
            assert_eq!(f.api_reason(), f.as_str());
        }
    }
}
