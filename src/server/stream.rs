//! Turning a request's [`Event`]s into OpenAI responses: one JSON body (non-streaming) or
//! a server-sent-event stream of chunks, then a usage chunk with empty `choices` when
//! `stream_options.include_usage` asks for it, then `data: [DONE]`.
//!
//! Dropping either future or stream (the client went away) drops the event receiver; the
//! engine thread sees the channel closed and frees the sequence before its next step.

use std::collections::VecDeque;
use std::convert::Infallible;
use std::time::Duration;

use axum::response::sse::{Event as SseEvent, KeepAlive, Sse};
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc::UnboundedReceiver;

use super::api::{ApiError, Endpoint};
use crate::batching::{Event, Finish, TokenLogprob};
use crate::tools::{self, CallFormat, CallStream, ParsedCall, Tool};

/// What every response of one request shares.
#[derive(Debug, Clone)]
pub struct Meta {
    pub id: String,
    pub created: u64,
    pub model: String,
    pub fingerprint: String,
    pub endpoint: Endpoint,
    pub choices: usize,
    /// Choices per prompt: choice i answers prompt i / n, whose prompt tokens count once.
    pub n: usize,
    pub include_usage: bool,
    /// The tools whose calls the answers are read for (a chat with tools, unless
    /// `tool_choice` is `none`).
    pub tools: Option<OfferedTools>,
}

/// The tools a chat answer may call, and how the model writes a call.
#[derive(Debug, Clone)]
pub struct OfferedTools {
    pub tools: Vec<Tool>,
    pub format: CallFormat,
}

/// The id of call `k` of choice `i` (unique in the request, whose id is random).
fn call_id(meta: &Meta, i: usize, k: usize) -> String {
    let tail = meta.id.rsplit('-').next().unwrap_or_default();
    format!("call_{tail}{i:02x}{k:02x}")
}

/// OpenAI's `tool_calls` entries for `calls` (arguments as a string of JSON); `index`es
/// for a streamed delta.
fn tool_calls_json(meta: &Meta, i: usize, calls: &[ParsedCall], streamed: bool) -> Value {
    let entries = calls.iter().enumerate().map(|(k, c)| {
        let mut e = json!({
            "id": call_id(meta, i, k),
            "type": "function",
            "function": {"name": c.name, "arguments": c.arguments.to_string()},
        });
        if streamed {
            e["index"] = json!(k);
        }
        e
    });
    Value::Array(entries.collect())
}

#[derive(Default)]
struct Choice {
    text: String,
    reasoning: String,
    logprobs: Vec<TokenLogprob>,
    finish: Option<Finish>,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
}

/// A chat choice's message: its content, its reasoning as `reasoning_content` where the
/// model wrote some apart (llama-server's and vLLM's field), and the calls of offered
/// tools read from its text (content `null` when there is nothing else).
fn assistant_message(
    meta: &Meta,
    i: usize,
    c: &Choice,
    calls: &[ParsedCall],
    content: &str,
) -> Value {
    let mut m = json!({"role": "assistant", "content": content});
    if !calls.is_empty() {
        if content.is_empty() {
            m["content"] = Value::Null;
        }
        m["tool_calls"] = tool_calls_json(meta, i, calls, false);
    }
    if !c.reasoning.is_empty() {
        m["reasoning_content"] = json!(c.reasoning);
    }
    m
}

fn event_error(message: String, shutting_down: bool) -> ApiError {
    if shutting_down {
        ApiError::unavailable("shutting_down", message)
    } else {
        ApiError::internal(message)
    }
}

/// OpenAI's `usage`; `cached` of the `prompt` tokens came from the prompt cache.
fn usage(prompt: usize, cached: usize, completion: usize) -> Value {
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
        "prompt_tokens_details": {"cached_tokens": cached},
    })
}

/// A token's `bytes` in logprobs: the UTF-8 of its decoded text (a token that holds only
/// part of a character shows as U+FFFD, so its bytes are those of U+FFFD).
fn token_bytes(s: &str) -> Vec<u8> {
    s.as_bytes().to_vec()
}

/// Chat's `logprobs` object.
fn chat_logprobs(entries: &[TokenLogprob]) -> Value {
    let content: Vec<Value> = entries
        .iter()
        .map(|e| {
            let top: Vec<Value> =
                e.top.iter().map(|(t, lp)| json!({"token": t, "logprob": lp, "bytes": token_bytes(t)})).collect();
            json!({"token": e.token, "logprob": e.logprob, "bytes": token_bytes(&e.token), "top_logprobs": top})
        })
        .collect();
    json!({"content": content})
}

/// Completions' (legacy) `logprobs` object; `offset` is where the first token's text
/// starts in the completion.
fn completion_logprobs(entries: &[TokenLogprob], mut offset: usize) -> Value {
    let mut tokens = Vec::new();
    let mut lps = Vec::new();
    let mut tops = Vec::new();
    let mut offsets = Vec::new();
    for e in entries {
        tokens.push(json!(e.token));
        lps.push(json!(e.logprob));
        let top: serde_json::Map<String, Value> =
            e.top.iter().map(|(t, lp)| (t.clone(), json!(lp))).collect();
        tops.push(Value::Object(top));
        offsets.push(json!(offset));
        offset += e.token.len();
    }
    json!({"tokens": tokens, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets})
}

/// Waits for every choice to finish and builds the response body.
pub async fn collect(
    meta: Meta,
    mut rx: UnboundedReceiver<(usize, Event)>,
    logprobs: bool,
) -> Result<Value, ApiError> {
    let mut choices: Vec<Choice> = (0..meta.choices).map(|_| Choice::default()).collect();
    let mut open = meta.choices;
    while open > 0 {
        let Some((i, event)) = rx.recv().await else {
            return Err(ApiError::internal(
                "the engine stopped before the answer was complete",
            ));
        };
        let c = &mut choices[i];
        match event {
            Event::Delta {
                text,
                reasoning,
                logprob,
                ..
            } => {
                c.text.push_str(&text);
                c.reasoning.push_str(&reasoning);
                c.logprobs.extend(logprob);
            }
            Event::Done {
                finish,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            } => {
                c.finish = Some(finish);
                c.prompt_tokens = prompt_tokens;
                c.cached_tokens = cached_tokens;
                c.completion_tokens = completion_tokens;
                open -= 1;
            }
            Event::Error {
                message,
                shutting_down,
            } => return Err(event_error(message, shutting_down)),
        }
    }
    let firsts = || choices.iter().step_by(meta.n.max(1));
    let prompt: usize = firsts().map(|c| c.prompt_tokens).sum();
    let cached: usize = firsts().map(|c| c.cached_tokens).sum();
    let completion: usize = choices.iter().map(|c| c.completion_tokens).sum();
    let list: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let finish = c.finish.map(Finish::api_reason);
            match meta.endpoint {
                Endpoint::Chat => {
                    let parsed = match &meta.tools {
                        Some(t) => tools::parse(&c.text, t.format, &t.tools),
                        None => tools::ParsedOutput {
                            content: c.text.clone(),
                            calls: Vec::new(),
                        },
                    };
                    let finish = match parsed.calls.is_empty() {
                        true => finish,
                        false => Some("tool_calls"),
                    };
                    json!({
                        "index": i,
                        "message": assistant_message(&meta, i, c, &parsed.calls, &parsed.content),
                        "logprobs": if logprobs { chat_logprobs(&c.logprobs) } else { Value::Null },
                        "finish_reason": finish,
                    })
                }
                Endpoint::Completions => json!({
                    "index": i,
                    "text": c.text,
                    "logprobs": if logprobs { completion_logprobs(&c.logprobs, 0) } else { Value::Null },
                    "finish_reason": finish,
                }),
            }
        })
        .collect();
    let object = match meta.endpoint {
        Endpoint::Chat => "chat.completion",
        Endpoint::Completions => "text_completion",
    };
    Ok(json!({
        "id": meta.id,
        "object": object,
        "created": meta.created,
        "model": meta.model,
        "system_fingerprint": meta.fingerprint,
        "choices": list,
        "usage": usage(prompt, cached, completion),
    }))
}

struct StreamState {
    meta: Meta,
    logprobs: bool,
    rx: UnboundedReceiver<(usize, Event)>,
    out: VecDeque<String>,
    open: usize,
    prompt_tokens: usize,
    cached_tokens: usize,
    completion_tokens: usize,
    /// Bytes of text sent per choice (completions' `text_offset`).
    sent: Vec<usize>,
    /// Per choice, the text held while it may be a tool call (a chat with tools).
    calls: Vec<Option<CallStream>>,
    finished: bool,
}

impl StreamState {
    fn chunk(&self, choice: Value) -> String {
        let object = match self.meta.endpoint {
            Endpoint::Chat => "chat.completion.chunk",
            Endpoint::Completions => "text_completion",
        };
        let mut v = json!({
            "id": self.meta.id,
            "object": object,
            "created": self.meta.created,
            "model": self.meta.model,
            "system_fingerprint": self.meta.fingerprint,
            "choices": [choice],
        });
        if self.meta.include_usage {
            v["usage"] = Value::Null;
        }
        v.to_string()
    }

    /// The last chunk of choice `i`: no delta, its `finish_reason`.
    fn finish_with(&mut self, i: usize, reason: &str) {
        let choice =
            json!({"index": i, "delta": {}, "logprobs": Value::Null, "finish_reason": reason});
        let chunk = self.chunk(choice);
        self.out.push_back(chunk);
    }

    /// A chat chunk of reasoning (`delta.reasoning_content`, as llama-server and vLLM
    /// stream it).
    fn reasoning_delta(&mut self, i: usize, reasoning: String) {
        let choice = json!({
            "index": i,
            "delta": {"reasoning_content": reasoning},
            "logprobs": Value::Null,
            "finish_reason": Value::Null,
        });
        let chunk = self.chunk(choice);
        self.out.push_back(chunk);
    }

    fn delta(
        &mut self,
        i: usize,
        text: String,
        logprob: Option<TokenLogprob>,
        finish: Option<Finish>,
    ) {
        let finish = finish.map(Finish::api_reason);
        let entries: Vec<TokenLogprob> = logprob.into_iter().collect();
        let choice = match self.meta.endpoint {
            Endpoint::Chat => {
                let delta = if text.is_empty() && finish.is_some() {
                    json!({})
                } else {
                    json!({"content": text})
                };
                let lp = if self.logprobs && !entries.is_empty() {
                    chat_logprobs(&entries)
                } else {
                    Value::Null
                };
                json!({"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish})
            }
            Endpoint::Completions => {
                let lp = if self.logprobs && !entries.is_empty() {
                    completion_logprobs(&entries, self.sent[i])
                } else {
                    Value::Null
                };
                json!({"index": i, "text": text, "logprobs": lp, "finish_reason": finish})
            }
        };
        self.sent[i] += text.len();
        let chunk = self.chunk(choice);
        self.out.push_back(chunk);
    }

    fn handle(&mut self, i: usize, event: Event) {
        match event {
            Event::Delta {
                text,
                reasoning,
                logprob,
                ..
            } => {
                if !reasoning.is_empty() && self.meta.endpoint == Endpoint::Chat {
                    self.reasoning_delta(i, reasoning);
                }
                let text = match &mut self.calls[i] {
                    Some(calls) => calls.push(&text),
                    None => text,
                };
                if !text.is_empty() || (self.logprobs && logprob.is_some()) {
                    self.delta(i, text, logprob, None);
                }
            }
            Event::Done {
                finish,
                prompt_tokens,
                cached_tokens,
                completion_tokens,
            } => {
                let mut called = false;
                if let (Some(calls), Some(offered)) = (self.calls[i].take(), &self.meta.tools) {
                    let end = calls.finish(&offered.tools);
                    if !end.content.is_empty() {
                        self.delta(i, end.content, None, None);
                    }
                    if !end.calls.is_empty() {
                        called = true;
                        let delta = json!({
                            "index": i,
                            "delta": {"tool_calls": tool_calls_json(&self.meta, i, &end.calls, true)},
                            "logprobs": Value::Null,
                            "finish_reason": Value::Null,
                        });
                        let chunk = self.chunk(delta);
                        self.out.push_back(chunk);
                    }
                }
                match called {
                    true => self.finish_with(i, "tool_calls"),
                    false => self.delta(i, String::new(), None, Some(finish)),
                }
                if i % self.meta.n.max(1) == 0 {
                    // A prompt's tokens count once, however many choices it has.
                    self.prompt_tokens += prompt_tokens;
                    self.cached_tokens += cached_tokens;
                }
                self.completion_tokens += completion_tokens;
                self.open -= 1;
                if self.open == 0 {
                    self.end(true);
                }
            }
            Event::Error {
                message,
                shutting_down,
            } => {
                self.out
                    .push_back(event_error(message, shutting_down).body().to_string());
                self.end(false);
            }
        }
    }

    fn end(&mut self, with_usage: bool) {
        if with_usage && self.meta.include_usage {
            let mut v = json!({
                "id": self.meta.id,
                "object": match self.meta.endpoint { Endpoint::Chat => "chat.completion.chunk", Endpoint::Completions => "text_completion" },
                "created": self.meta.created,
                "model": self.meta.model,
                "system_fingerprint": self.meta.fingerprint,
                "choices": [],
            });
            v["usage"] = usage(
                self.prompt_tokens,
                self.cached_tokens,
                self.completion_tokens,
            );
            self.out.push_back(v.to_string());
        }
        self.out.push_back("[DONE]".into());
        self.finished = true;
    }
}

/// The SSE response of a streaming request.
pub fn sse(meta: Meta, rx: UnboundedReceiver<(usize, Event)>, logprobs: bool) -> Response {
    let choices = meta.choices;
    let format = meta.tools.as_ref().map(|t| t.format);
    let mut state = StreamState {
        meta,
        logprobs,
        rx,
        out: VecDeque::new(),
        open: choices,
        prompt_tokens: 0,
        cached_tokens: 0,
        completion_tokens: 0,
        sent: vec![0; choices],
        calls: (0..choices).map(|_| format.map(CallStream::new)).collect(),
        finished: false,
    };
    if state.meta.endpoint == Endpoint::Chat {
        // OpenAI's first chunk names the role.
        for i in 0..choices {
            let c = json!({"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": null, "finish_reason": null});
            let chunk = state.chunk(c);
            state.out.push_back(chunk);
        }
    }
    let stream = futures_util::stream::unfold(state, |mut st| async move {
        loop {
            if let Some(data) = st.out.pop_front() {
                return Some((Ok::<_, Infallible>(SseEvent::default().data(data)), st));
            }
            if st.finished {
                return None;
            }
            match st.rx.recv().await {
                Some((i, event)) => st.handle(i, event),
                None => {
                    st.out.push_back(
                        ApiError::internal("the engine stopped before the answer was complete")
                            .body()
                            .to_string(),
                    );
                    st.end(false);
                }
            }
        }
    });
    Sse::new(stream)
        .keep_alive(KeepAlive::new().interval(Duration::from_secs(5)))
        .into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn meta() -> Meta {
        Meta {
            id: "chatcmpl-1".into(),
            created: 0,
            model: "m".into(),
            fingerprint: "fp".into(),
            endpoint: Endpoint::Chat,
            choices: 1,
            n: 1,
            include_usage: false,
            tools: None,
        }
    }

    fn delta(text: &str, reasoning: &str) -> Event {
        Event::Delta {
            text: text.into(),
            reasoning: reasoning.into(),
            token: Some(0),
            logprob: None,
        }
    }

    fn done() -> Event {
        Event::Done {
            finish: Finish::Stop,
            prompt_tokens: 3,
            cached_tokens: 0,
            completion_tokens: 4,
        }
    }

    fn with_tools() -> Meta {
        Meta {
            tools: Some(OfferedTools {
                tools: vec![Tool {
                    name: "add".into(),
                    description: None,
                    parameters: json!({"type": "object"}),
                    strict: false,
                }],
                format: CallFormat::Hermes,
            }),
            ..meta()
        }
    }

    /// A Hermes call in the text: `tool_calls` with the arguments as a string, `content`
    /// null, `finish_reason` `tool_calls`, whole and streamed (where the call's text is
    /// held and sent as one `tool_calls` delta after the content before it).
    #[tokio::test]
    async fn calls_in_the_text_are_tool_calls_whole_and_streamed() {
        let pieces = [
            "<tool_",
            "call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}\n</tool_call>",
        ];
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for p in pieces {
            tx.send((0, delta(p, ""))).unwrap();
        }
        tx.send((0, done())).unwrap();
        let body = collect(with_tools(), rx, false).await.unwrap();
        let c = &body["choices"][0];
        assert_eq!(c["finish_reason"], "tool_calls");
        assert_eq!(c["message"]["content"], Value::Null);
        let call = &c["message"]["tool_calls"][0];
        assert_eq!(call["function"]["name"], "add");
        assert_eq!(call["function"]["arguments"], "{\"a\":1}");
        assert_eq!(call["type"], "function");

        let (_tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut st = StreamState {
            meta: with_tools(),
            logprobs: false,
            rx,
            out: VecDeque::new(),
            open: 1,
            prompt_tokens: 0,
            cached_tokens: 0,
            completion_tokens: 0,
            sent: vec![0],
            calls: vec![Some(CallStream::new(CallFormat::Hermes))],
            finished: false,
        };
        st.handle(0, delta("Sure. ", ""));
        for p in pieces {
            st.handle(0, delta(p, ""));
        }
        st.handle(0, done());
        let chunks: Vec<Value> = st
            .out
            .iter()
            .filter(|c| c.starts_with('{'))
            .map(|c| serde_json::from_str::<Value>(c).unwrap()["choices"][0].clone())
            .collect();
        assert_eq!(chunks[0]["delta"], json!({"content": "Sure. "}));
        let streamed = &chunks[1]["delta"]["tool_calls"][0];
        assert_eq!(
            (streamed["index"].clone(), streamed["id"].clone()),
            (json!(0), call["id"].clone())
        );
        assert_eq!(streamed["function"], call["function"]);
        assert_eq!(chunks[2]["finish_reason"], "tool_calls");
        assert_eq!(chunks.len(), 3);
    }

    /// Reasoning written apart is the message's `reasoning_content` and its own stream
    /// deltas; an answer without any has no such field.
    #[tokio::test]
    async fn reasoning_is_reasoning_content_whole_and_streamed() {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        for e in [
            delta("", "Two"),
            delta("", " and two."),
            delta("It is 4.", ""),
            done(),
        ] {
            tx.send((0, e)).unwrap();
        }
        let body = collect(meta(), rx, false).await.unwrap();
        let message = &body["choices"][0]["message"];
        assert_eq!(message["content"], "It is 4.");
        assert_eq!(message["reasoning_content"], "Two and two.");

        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        tx.send((0, delta("Hi", ""))).unwrap();
        tx.send((0, done())).unwrap();
        let body = collect(meta(), rx, false).await.unwrap();
        assert!(body["choices"][0]["message"]
            .get("reasoning_content")
            .is_none());

        let (_tx, rx) = tokio::sync::mpsc::unbounded_channel();
        let mut st = StreamState {
            meta: meta(),
            logprobs: false,
            rx,
            out: VecDeque::new(),
            open: 1,
            prompt_tokens: 0,
            cached_tokens: 0,
            completion_tokens: 0,
            sent: vec![0],
            calls: vec![None],
            finished: false,
        };
        for e in [delta("", "Two and two."), delta("It is 4.", ""), done()] {
            st.handle(0, e);
        }
        let deltas: Vec<Value> = st
            .out
            .iter()
            .filter(|c| c.starts_with('{'))
            .map(|c| serde_json::from_str::<Value>(c).unwrap()["choices"][0]["delta"].clone())
            .collect();
        assert_eq!(deltas[0], json!({"reasoning_content": "Two and two."}));
        assert_eq!(deltas[1], json!({"content": "It is 4."}));
    }
}
