//! What the HTTP handlers know of the loaded model: its id, its context, and its own copy
//! of the tokenizer and chat template, so prompts are rendered and tokenized on the
//! handlers' threads (a blocking-pool task) and never stall the engine thread.
//!
//! The copies are rebuilt from the model's `TokenizerSpec` and template source: the
//! `Engine` (and the `Model` in it) belongs to the engine thread.

use std::collections::VecDeque;
use std::sync::Mutex;
use std::time::{SystemTime, UNIX_EPOCH};

use kiln_core::Result;
use kiln_formats::chat::ChatTemplate;
use kiln_formats::tokenizer::Tokenizer;

use super::api::{truncate_for_message, ApiError, PromptInput, ToolRequest};
use crate::engine::Engine;
use crate::structured::{json_constraint, Constraint, Grammars};
use crate::tools::{self, CallFormat, Tool};

pub struct Frontend {
    /// The model's id in the API: the file name without its extension.
    pub id: String,
    /// When the model was loaded (Unix seconds), shown by `/v1/models`.
    pub created: u64,
    pub backend: String,
    /// Longest context of one sequence.
    pub context: usize,
    pub vocab: usize,
    tokenizer: Tokenizer,
    chat: ChatTemplate,
    /// Bytes of text the longest token stands for: a text longer than
    /// `(context + 2) * max_token_bytes` bytes cannot fit the context, whatever its tokens.
    max_token_bytes: usize,
    /// Structured outputs (`response_format`); `None` for a model without an
    /// end-of-sequence token.
    grammars: Option<Grammars>,
    /// How `/v1/embeddings` pools: the file's `pooling_type`, else the last token's.
    pub pooling: crate::Pooling,
    /// The last [`SCHEMAS_KEPT`] schemas' constraints, or why each cannot be used, by the
    /// schema's text: a client repeating a schema (or a costly one) compiles it once.
    schemas: Mutex<VecDeque<(String, std::result::Result<Constraint, String>)>>,
}

/// Schemas whose compiled constraint (or refusal) a server keeps.
const SCHEMAS_KEPT: usize = 32;

impl Frontend {
    pub fn new(engine: &Engine) -> Result<Frontend> {
        let model = &engine.model;
        let spec = &model.tokenizer_spec;
        let tokenizer = Tokenizer::from_spec(spec.clone())?;
        let piece = |id: Option<u32>| {
            id.and_then(|i| spec.tokens.get(i as usize))
                .cloned()
                .unwrap_or_default()
        };
        let (bos, eos) = (piece(spec.bos), piece(spec.eos));
        let chat = match model.chat_template_source() {
            Some(src) => ChatTemplate::new(src, bos, eos)?,
            None => ChatTemplate::chatml(bos, eos),
        };
        let vocab = tokenizer.vocab_size();
        let max_token_bytes = (0..vocab as u32)
            .map(|t| tokenizer.decode(&[t], false).len())
            .max()
            .unwrap_or(1)
            .max(1);
        let id = model
            .path
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let created = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs());
        let grammars = Grammars::from_spec(spec)?;
        // A rank head (or an unknown pooling) refuses embeddings, not the model.
        let pooling = crate::Pooling::of_model(model)
            .ok()
            .flatten()
            .unwrap_or(crate::Pooling::Last);
        Ok(Frontend {
            id,
            created,
            backend: engine.backend_name().to_string(),
            context: engine.executor.max_context(),
            vocab: engine.executor.config().vocab_size,
            tokenizer,
            chat,
            max_token_bytes,
            grammars,
            pooling,
            schemas: Mutex::new(VecDeque::new()),
        })
    }

    /// The output constraint for a JSON schema (`response_format`), one per choice of the
    /// request; a 400 naming `response_format` when the schema cannot be used.
    pub fn json_constraints(
        &self,
        schema: &serde_json::Value,
        choices: usize,
    ) -> std::result::Result<Vec<Constraint>, ApiError> {
        self.constraints(
            schema.to_string(),
            || json_constraint(self.grammars.as_ref(), schema),
            "response_format",
            choices,
        )
    }

    /// `choices` constraints that make the answer the calls `tools` requires (`tool_choice`
    /// `required` or a function), or none where it requires none.
    pub fn tool_constraints(
        &self,
        tools: &ToolRequest,
        choices: usize,
    ) -> std::result::Result<Option<Vec<Constraint>>, ApiError> {
        let lark = tools::grammar(
            &tools.tools,
            &tools.choice,
            tools.parallel,
            self.tool_format(),
        )
        .map_err(|msg| ApiError::invalid("tool_choice", "invalid_value", msg))?;
        let Some(lark) = lark else {
            return Ok(None);
        };
        let compile = || match self.grammars.as_ref() {
            Some(g) => g.lark(&lark, "the tools' parameter schemas"),
            None => Err(
                "this model has no end-of-sequence token, so a required tool call could not end"
                    .into(),
            ),
        };
        self.constraints(format!("lark:{lark}"), compile, "tools", choices)
            .map(Some)
    }

    /// `choices` copies of the constraint compiled from `key`'s grammar (the last
    /// [`SCHEMAS_KEPT`] kept), or a 400 naming `param`.
    fn constraints(
        &self,
        key: String,
        compile: impl FnOnce() -> std::result::Result<Constraint, String>,
        param: &str,
        choices: usize,
    ) -> std::result::Result<Vec<Constraint>, ApiError> {
        type Compiled = std::result::Result<Constraint, String>;
        let kept = |schemas: &VecDeque<(String, Compiled)>| -> Option<Compiled> {
            schemas
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, c)| c.clone())
        };
        let lock = || self.schemas.lock().unwrap_or_else(|p| p.into_inner());
        // (The guard is a temporary of this statement: released before the match.)
        let cached = kept(&lock());
        let compiled = match cached {
            Some(c) => c,
            None => {
                // Compiled outside the lock: another schema need not wait for this one.
                let c = compile();
                let mut schemas = lock();
                if kept(&schemas).is_none() {
                    if schemas.len() == SCHEMAS_KEPT {
                        schemas.pop_front();
                    }
                    schemas.push_back((key.clone(), c.clone()));
                }
                c
            }
        };
        let constraint = compiled.map_err(|msg| ApiError::invalid(param, "invalid_value", msg))?;
        Ok(vec![constraint; choices])
    }

    /// `/tokenize`: the ids of `req.content`, with each token's text when asked (its bytes
    /// as a string where they are UTF-8, else as an array of bytes, as llama-server does).
    pub fn tokenize_text(
        &self,
        req: &super::api::TokenizeRequest,
    ) -> std::result::Result<serde_json::Value, ApiError> {
        let ids = self
            .tokenizer
            .encode(&req.content, req.add_special, req.parse_special)
            .map_err(|e| {
                ApiError::invalid(
                    "content",
                    "invalid_value",
                    format!(
                        "the text could not be tokenized: {}",
                        truncate_for_message(&e.to_string())
                    ),
                )
            })?;
        if !req.with_pieces {
            return Ok(serde_json::json!({ "tokens": ids }));
        }
        let tokens: Vec<serde_json::Value> = ids
            .iter()
            .map(|&id| {
                let bytes = self.tokenizer.token_bytes(id).unwrap_or_default();
                let piece = match std::str::from_utf8(bytes) {
                    Ok(s) => serde_json::Value::from(s),
                    Err(_) => serde_json::Value::from(bytes.to_vec()),
                };
                serde_json::json!({ "id": id, "piece": piece })
            })
            .collect();
        Ok(serde_json::json!({ "tokens": tokens }))
    }

    /// `/v1/embeddings`' inputs as token ids (texts with BOS as the model asks, special-token
    /// spellings as text), each between 1 token and the context, checked before any runs.
    pub fn embedding_inputs(
        &self,
        input: &super::api::EmbeddingInput,
    ) -> std::result::Result<Vec<Vec<u32>>, ApiError> {
        use super::api::EmbeddingInput;
        let ids: Vec<Vec<u32>> = match input {
            EmbeddingInput::Tokens(t) => t.clone(),
            EmbeddingInput::Texts(texts) => texts
                .iter()
                .enumerate()
                .map(|(i, text)| {
                    if text.len() / self.max_token_bytes > self.context + 2 {
                        return Err(self.context_exceeded(
                            &format!("input[{i}]"),
                            format!("at least {}", text.len() / self.max_token_bytes),
                        ));
                    }
                    self.tokenizer
                        .encode(text, self.tokenizer.add_bos_default(), false)
                        .map_err(|e| {
                            ApiError::invalid(
                                format!("input[{i}]"),
                                "invalid_value",
                                format!(
                                    "the text could not be tokenized: {}",
                                    truncate_for_message(&e.to_string())
                                ),
                            )
                        })
                })
                .collect::<std::result::Result<_, _>>()?,
        };
        for (i, t) in ids.iter().enumerate() {
            let param = format!("input[{i}]");
            if t.is_empty() {
                return Err(ApiError::invalid(
                    param,
                    "invalid_value",
                    "an input with no tokens",
                ));
            }
            if t.len() >= self.context {
                return Err(self.context_exceeded(&param, t.len().to_string()));
            }
            if let Some(&bad) = t.iter().find(|&&x| x as usize >= self.vocab) {
                return Err(ApiError::invalid(
                    param,
                    "invalid_value",
                    format!("token id {bad} is outside the vocabulary ({})", self.vocab),
                ));
            }
        }
        Ok(ids)
    }

    /// `/detokenize`: the text of `ids` (special tokens spelled out), each id checked.
    pub fn detokenize(&self, ids: &[u32]) -> std::result::Result<serde_json::Value, ApiError> {
        if let Some((i, bad)) = ids
            .iter()
            .enumerate()
            .find(|(_, &t)| t as usize >= self.vocab)
        {
            return Err(ApiError::invalid(
                format!("tokens[{i}]"),
                "invalid_value",
                format!("token id {bad} is outside the vocabulary ({})", self.vocab),
            ));
        }
        Ok(serde_json::json!({ "content": self.tokenizer.decode(ids, false) }))
    }

    /// `/apply-template`: the chat rendered by the model's template, ready for generation.
    pub fn apply_template(
        &self,
        messages: &[kiln_formats::chat::ChatMessage],
    ) -> std::result::Result<serde_json::Value, ApiError> {
        let prompt = self.chat.render(messages, true).map_err(|e| {
            ApiError::invalid(
                "messages",
                "invalid_value",
                format!("the chat template refused the messages: {e}"),
            )
        })?;
        Ok(serde_json::json!({ "prompt": prompt }))
    }

    /// A request's `model`, if it names one, must name this model: 404 `model_not_found`.
    pub fn check_model(&self, name: Option<&str>) -> std::result::Result<(), ApiError> {
        match name {
            Some(name) if !self.accepts_model(name) => Err(ApiError::new(
                axum::http::StatusCode::NOT_FOUND,
                "invalid_request_error",
                Some("model_not_found"),
                format!(
                    "The model '{}' does not exist; this server runs '{}'.",
                    truncate_for_message(name),
                    self.id
                ),
            )
            .with_param("model")),
            _ => Ok(()),
        }
    }

    /// Whether a request's `model` names this model: its id, its file name, or `default`.
    pub fn accepts_model(&self, name: &str) -> bool {
        name == self.id
            || name == "default"
            || name.strip_suffix(".gguf").or(name.strip_suffix(".apr")) == Some(self.id.as_str())
    }

    /// How this model writes tool calls (its chat template's format).
    pub fn tool_format(&self) -> CallFormat {
        CallFormat::of(self.chat.source())
    }

    /// The chat prompt with `tools` offered: in the template's `tools` where it reads
    /// them, else described at the end of the system message (one is added first if the
    /// conversation has none).
    fn render_chat(
        &self,
        messages: &[kiln_formats::chat::ChatMessage],
        tools: Option<&ToolRequest>,
    ) -> kiln_core::Result<kiln_formats::chat::ChatPrompt> {
        let Some(t) = tools else {
            return self.chat.render_prompt(messages, true);
        };
        if self.chat.reads_tools() {
            let described: Vec<serde_json::Value> = t.tools.iter().map(Tool::to_openai).collect();
            return self
                .chat
                .render_prompt_with_tools(messages, &described, true);
        }
        let text = tools::instructions(&t.tools);
        // The history's calls and results in the form the instructions teach.
        let mut with: Vec<kiln_formats::chat::ChatMessage> = messages
            .iter()
            .map(|m| {
                let mut m = m.clone();
                for call in std::mem::take(&mut m.tool_calls) {
                    let json = serde_json::json!({"name": call.name, "arguments": call.arguments});
                    m.content
                        .push_str(&format!("\n<tool_call>\n{json}\n</tool_call>"));
                }
                if m.tool_call_id.take().is_some() {
                    m.role = "user".into();
                    m.content = format!("<tool_response>\n{}\n</tool_response>", m.content);
                }
                m
            })
            .collect();
        match with.first_mut() {
            Some(m) if m.role == "system" => m.content = format!("{}\n\n{text}", m.content),
            _ => with.insert(0, kiln_formats::chat::ChatMessage::new("system", text)),
        }
        self.chat.render_prompt(&with, true)
    }

    /// The prompt's token ids, the chat's with `tools` offered. `param` names the request
    /// field for errors.
    pub fn tokenize(
        &self,
        prompt: &PromptInput,
        tools: Option<&ToolRequest>,
        param: &str,
    ) -> std::result::Result<Vec<u32>, ApiError> {
        // The chat's message contents, which stay text (see `Tokenizer::encode_chat`).
        let mut content = Vec::new();
        let text: std::borrow::Cow<'_, str> = match prompt {
            PromptInput::Tokens(ids) => {
                if let Some(&bad) = ids.iter().find(|&&t| t as usize >= self.vocab) {
                    return Err(ApiError::invalid(
                        param,
                        "invalid_value",
                        format!("token id {bad} is outside the vocabulary ({})", self.vocab),
                    ));
                }
                return Ok(ids.clone());
            }
            PromptInput::Text(text) => text.into(),
            PromptInput::Chat(messages) => {
                let prompt = self.render_chat(messages, tools).map_err(|e| {
                    ApiError::invalid(
                        param,
                        "invalid_value",
                        format!("the chat template refused the messages: {e}"),
                    )
                })?;
                content = prompt.content;
                prompt.text.into()
            }
        };
        let floor = text.len() / self.max_token_bytes;
        if floor > self.context + 2 {
            return Err(self.context_exceeded(param, format!("at least {floor}")));
        }
        // Special-token text in a prompt is read as the special token, as llama-server does,
        // but never inside a chat message's content: a user cannot close their turn.
        self.tokenizer
            .encode_chat(&text, self.tokenizer.add_bos_default(), &content)
            .map_err(|e| {
                ApiError::invalid(
                    param,
                    "invalid_value",
                    format!(
                        "the prompt could not be tokenized: {}",
                        truncate_for_message(&e.to_string())
                    ),
                )
            })
    }

    pub fn context_exceeded(&self, param: &str, tokens: String) -> ApiError {
        ApiError::invalid(
            param,
            "context_length_exceeded",
            format!(
                "This model's maximum context length is {} tokens; the prompt has {tokens} tokens.",
                self.context
            ),
        )
    }
}
