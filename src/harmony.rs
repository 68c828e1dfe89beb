//! OpenAI's harmony format (gpt-oss's chat format), as far as a generation's output is
//! concerned: the assistant answers in messages, each a header and a body,
//!
//! ```text
//! <|channel|>analysis<|message|>…reasoning…<|end|>
//! <|start|>assistant<|channel|>final<|message|>…answer…<|return|>
//! ```
//!
//! after a prompt that ends in `<|start|>assistant`. The header names the channel (and, for
//! a tool call, its recipient: `commentary to=functions.get_weather <|constrain|>json`);
//! the body is text. [`Channels`] follows the markers token by token and says where each
//! generated token's text belongs: the `analysis` channel is reasoning, `final` and
//! `commentary` are the answer (commentary without a recipient is what the model says
//! to the user between tool calls), a body addressed to a function (`to=functions.NAME`)
//! is a call whose text is its arguments, headers are neither. A marker split across
//! tokens cannot happen: each is one special token, matched by id.

use kiln_formats::tokenizer::Tokenizer;

/// The ids of harmony's markers in a vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HarmonyTokens {
    start: u32,
    end: u32,
    message: u32,
    channel: u32,
    /// Ends the last message of a turn (`<|return|>`) or a tool call (`<|call|>`): both
    /// are the tokenizer's stop tokens, so a generation ends there.
    ends: [u32; 2],
}

impl HarmonyTokens {
    /// The markers of `tokenizer`'s vocabulary, if it is a harmony one (it has them all).
    pub fn of(tokenizer: &Tokenizer) -> Option<HarmonyTokens> {
        let id = |piece: &str| tokenizer.token_id(piece);
        Some(HarmonyTokens {
            start: id("<|start|>")?,
            end: id("<|end|>")?,
            message: id("<|message|>")?,
            channel: id("<|channel|>")?,
            ends: [id("<|return|>")?, id("<|call|>")?],
        })
    }
}

/// Where a token's text goes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Destination {
    /// A marker or a header: no text.
    Nowhere,
    /// The `analysis` channel.
    Reasoning,
    /// The answer.
    Content,
    /// The arguments of a call of the function [`Channels::recipient`] names.
    Call,
}

#[derive(Debug, Clone, PartialEq)]
enum State {
    /// Reading a header; its text so far (from the last `<|start|>` or the turn's start).
    Header(String),
    /// In a message's body, writing to the destination its header chose.
    Body(Destination),
    /// After `<|end|>`, before the next `<|start|>`: nothing the model writes here is a
    /// message.
    Between,
}

/// One generation's position in the harmony framing (see the module doc).
#[derive(Debug, Clone)]
pub struct Channels {
    tokens: HarmonyTokens,
    state: State,
    /// The function the current body is addressed to, if any.
    recipient: Option<String>,
}

impl Channels {
    /// A generation that starts where the prompt left off: in the header of the
    /// assistant's message (the prompt ends in `<|start|>assistant`).
    pub fn new(tokens: HarmonyTokens) -> Channels {
        Channels {
            tokens,
            state: State::Header(String::new()),
            recipient: None,
        }
    }

    /// The function the body being written calls (`to=functions.NAME` in its header).
    pub fn recipient(&self) -> Option<&str> {
        self.recipient.as_deref()
    }

    /// Where the text of `token` goes: markers move the state and make no text; a
    /// header's text (`piece`: the token's text with specials shown, asked for only
    /// there) is kept to choose the body's destination.
    pub fn route(&mut self, token: u32, piece: impl FnOnce() -> String) -> Destination {
        let t = self.tokens;
        if token == t.start {
            self.state = State::Header(String::new());
            return Destination::Nowhere;
        }
        if token == t.end || t.ends.contains(&token) {
            self.state = State::Between;
            return Destination::Nowhere;
        }
        match &mut self.state {
            State::Header(header) if token == t.message => {
                self.recipient = recipient_of(header);
                let destination = match self.recipient {
                    Some(_) => Destination::Call,
                    None => destination_of(header),
                };
                self.state = State::Body(destination);
                Destination::Nowhere
            }
            State::Header(header) => {
                header.push_str(&piece());
                Destination::Nowhere
            }
            // `<|channel|>` or `<|message|>` inside a body: the model broke the framing;
            // the marker makes no text and the body goes on where it went.
            State::Body(_) if token == t.channel || token == t.message => Destination::Nowhere,
            State::Body(d) => *d,
            State::Between => Destination::Nowhere,
        }
    }
}

/// The function a header addresses its body to: `to=functions.NAME` anywhere in it (after
/// the role or after the channel, as harmony allows both).
fn recipient_of(header: &str) -> Option<String> {
    let (_, after) = header.split_once("to=functions.")?;
    let name: String = after
        .chars()
        .take_while(|c| c.is_ascii_alphanumeric() || matches!(c, '_' | '-' | '.'))
        .collect();
    (!name.is_empty()).then_some(name)
}

/// The destination a header (`<|channel|>analysis`, `assistant<|channel|>final`,
/// `<|channel|>commentary to=functions.f <|constrain|>json`, …) gives its body: the word
/// after the last `<|channel|>`, reasoning for `analysis`; anything else, or no channel,
/// is the answer.
fn destination_of(header: &str) -> Destination {
    let channel = header
        .rsplit_once("<|channel|>")
        .map(|(_, rest)| rest)
        .and_then(|rest| rest.split(|c: char| c.is_whitespace() || c == '<').next())
        .unwrap_or("");
    match channel {
        "analysis" => Destination::Reasoning,
        _ => Destination::Content,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const START: u32 = 1;
    const END: u32 = 2;
    const MESSAGE: u32 = 3;
    const CHANNEL: u32 = 4;
    const RETURN: u32 = 5;
    const CALL: u32 = 6;

    fn tokens() -> HarmonyTokens {
        HarmonyTokens {
            start: START,
            end: END,
            message: MESSAGE,
            channel: CHANNEL,
            ends: [RETURN, CALL],
        }
    }

    /// Runs `(token, piece)` pairs; the text that went to reasoning and to the answer.
    fn split(stream: &[(u32, &str)]) -> (String, String) {
        let mut c = Channels::new(tokens());
        let (mut reasoning, mut content) = (String::new(), String::new());
        for &(t, piece) in stream {
            match c.route(t, || piece.to_string()) {
                Destination::Reasoning => reasoning.push_str(piece),
                Destination::Content | Destination::Call => content.push_str(piece),
                Destination::Nowhere => {}
            }
        }
        (reasoning, content)
    }

    #[test]
    fn analysis_is_reasoning_and_final_is_the_answer() {
        let stream = [
            (CHANNEL, "<|channel|>"),
            (100, "analysis"),
            (MESSAGE, "<|message|>"),
            (101, "The user asks"),
            (102, " for 2+2."),
            (END, "<|end|>"),
            (START, "<|start|>"),
            (103, "assistant"),
            (CHANNEL, "<|channel|>"),
            (104, "final"),
            (MESSAGE, "<|message|>"),
            (105, "4"),
            (RETURN, "<|return|>"),
        ];
        assert_eq!(
            split(&stream),
            ("The user asks for 2+2.".into(), "4".into())
        );
    }

    #[test]
    fn a_channel_name_split_across_tokens_is_read_whole() {
        let stream = [
            (CHANNEL, "<|channel|>"),
            (100, "anal"),
            (101, "ysis"),
            (MESSAGE, "<|message|>"),
            (102, "hmm"),
            (END, "<|end|>"),
            (START, "<|start|>"),
            (103, "assistant"),
            (CHANNEL, "<|channel|>"),
            (104, "fi"),
            (105, "nal"),
            (MESSAGE, "<|message|>"),
            (106, "done"),
        ];
        assert_eq!(split(&stream), ("hmm".into(), "done".into()));
    }

    #[test]
    fn a_body_addressed_to_a_function_is_a_call() {
        let mut c = Channels::new(tokens());
        for (t, piece) in [
            (CHANNEL, "<|channel|>"),
            (100, "commentary to=functions.get_weather"),
            (101, " <|constrain|>json"),
        ] {
            assert_eq!(c.route(t, || piece.to_string()), Destination::Nowhere);
        }
        assert_eq!(c.route(MESSAGE, String::new), Destination::Nowhere);
        assert_eq!(c.recipient(), Some("get_weather"));
        assert_eq!(c.route(102, || "{}".into()), Destination::Call);
        // The recipient may follow the role instead.
        let mut c = Channels::new(tokens());
        c.route(START, String::new);
        c.route(100, || "assistant to=functions.add".into());
        c.route(CHANNEL, || "<|channel|>".into());
        c.route(101, || "commentary json".into());
        c.route(MESSAGE, String::new);
        assert_eq!(c.recipient(), Some("add"));
    }

    #[test]
    fn commentary_and_headers_with_recipients() {
        // A preamble in commentary is the answer; the recipient and constraint in a header
        // make its body a call (here read as text).
        let stream = [
            (CHANNEL, "<|channel|>"),
            (100, "commentary"),
            (101, " to=functions.get_weather"),
            (102, " <|constrain|>json"),
            (MESSAGE, "<|message|>"),
            (103, "{\"city\":\"Oslo\"}"),
            (CALL, "<|call|>"),
        ];
        assert_eq!(
            split(&stream),
            (String::new(), "{\"city\":\"Oslo\"}".into())
        );
    }

    #[test]
    fn truncated_and_unframed_output() {
        // Cut off inside the analysis: what came is reasoning, no answer.
        let cut = [
            (CHANNEL, "<|channel|>"),
            (100, "analysis"),
            (MESSAGE, "<|message|>"),
            (101, "thinking"),
        ];
        assert_eq!(split(&cut), ("thinking".into(), String::new()));
        // A model that skips the header entirely writes into the header: nothing is shown
        // until a body starts (then it is the answer: no channel named).
        let bare = [(100, "Hi"), (MESSAGE, "<|message|>"), (101, "there")];
        assert_eq!(split(&bare), (String::new(), "there".into()));
        // Text after <|end|> without a new <|start|> belongs to no message.
        let after = [
            (MESSAGE, "<|message|>"),
            (101, "a"),
            (END, "<|end|>"),
            (102, "b"),
        ];
        assert_eq!(split(&after), (String::new(), "a".into()));
    }
}
