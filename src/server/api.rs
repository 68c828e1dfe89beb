//! The OpenAI request and error shapes: parsing a JSON body into a [`GenRequest`] with a
//! typed 400 naming the offending parameter, and [`ApiError`], which renders as OpenAI's
//! `{"error": {"message", "type", "param", "code"}}`.
//!
//! Bodies are parsed into a `serde_json::Value` first (serde_json refuses nesting deeper
//! than 128 levels, invalid UTF-8 and numbers out of f64 range) and every field is then
//! read by hand, so each refusal can name its parameter. Unknown fields are ignored, as
//! OpenAI-compatible servers commonly do; fields kiln knows but cannot honour (`echo`,
//! `suffix`, the legacy `functions`, tools on `/v1/completions`, non-text content parts) are
//! refused rather than silently dropped.

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use kiln_formats::chat::{ChatMessage, ToolCall};
use serde_json::{json, Map, Value};

use crate::tools::{Tool, ToolChoice};

/// Most stop strings one request may carry.
pub const MAX_STOP_STRINGS: usize = 16;
/// Longest stop string, in bytes.
pub const MAX_STOP_BYTES: usize = 256;
/// Most `top_logprobs` (chat) / `logprobs` (completions) alternatives per token.
pub const MAX_TOP_LOGPROBS: usize = 20;
/// Most prompts in one `/v1/completions` request.
pub const MAX_PROMPTS: usize = 16;
/// Most choices (`n`) for one prompt, and in one request (prompts × `n`).
pub const MAX_N: usize = 16;
pub const MAX_CHOICES: usize = 64;
/// Most `logit_bias` entries.
pub const MAX_LOGIT_BIAS: usize = 1024;
/// Most tools one request may offer (OpenAI's limit).
pub const MAX_TOOLS: usize = 128;
/// Most tool calls in one assistant message of the history.
pub const MAX_TOOL_CALLS: usize = 128;

/// An error as OpenAI's API returns it.
#[derive(Debug, Clone)]
pub struct ApiError {
    pub status: StatusCode,
    pub message: String,
    pub kind: &'static str,
    pub param: Option<String>,
    pub code: Option<&'static str>,
    /// Seconds for a `Retry-After` header.
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(
        status: StatusCode,
        kind: &'static str,
        code: Option<&'static str>,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            status,
            message: message.into(),
            kind,
            param: None,
            code,
            retry_after: None,
        }
    }

    /// 400 `invalid_request_error` about `param`.
    pub fn invalid(
        param: impl Into<String>,
        code: &'static str,
        message: impl Into<String>,
    ) -> ApiError {
        ApiError {
            param: Some(param.into()),
            ..ApiError::new(
                StatusCode::BAD_REQUEST,
                "invalid_request_error",
                Some(code),
                message,
            )
        }
    }

    pub fn bad_request(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::BAD_REQUEST,
            "invalid_request_error",
            Some(code),
            message,
        )
    }

    pub fn with_param(mut self, param: impl Into<String>) -> ApiError {
        self.param = Some(param.into());
        self
    }

    pub fn with_retry_after(mut self, secs: u64) -> ApiError {
        self.retry_after = Some(secs);
        self
    }

    pub fn body(&self) -> Value {
        json!({"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}})
    }

    pub fn too_large(limit: usize) -> ApiError {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            "invalid_request_error",
            Some("request_too_large"),
            format!("the request body is larger than the server's limit of {limit} bytes"),
        )
    }

    pub fn internal(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::INTERNAL_SERVER_ERROR,
            "server_error",
            None,
            message,
        )
    }

    pub fn unavailable(code: &'static str, message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "server_error",
            Some(code),
            message,
        )
        .with_retry_after(1)
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut resp = (self.status, axum::Json(self.body())).into_response();
        if let Some(secs) = self.retry_after {
            resp.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from(secs));
        }
        resp
    }
}

/// Which endpoint a request came to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    Completions,
}

/// One prompt, before tokenization.
#[derive(Debug, Clone)]
pub enum PromptInput {
    Chat(Vec<ChatMessage>),
    Text(String),
    Tokens(Vec<u32>),
}

/// What the request asks of the sampler. `None` means the server default.
#[derive(Debug, Clone, Default)]
pub struct SamplingRequest {
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<usize>,
    pub min_p: Option<f32>,
    pub seed: Option<u64>,
}

/// A validated chat or completions request.
#[derive(Debug, Clone)]
pub struct GenRequest {
    pub endpoint: Endpoint,
    pub model: Option<String>,
    pub prompts: Vec<PromptInput>,
    pub max_tokens: Option<usize>,
    /// Which of `max_tokens` / `max_completion_tokens` set it (for error messages).
    pub max_tokens_param: &'static str,
    pub sampling: SamplingRequest,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub logit_bias: Vec<(u32, f32)>,
    pub stop: Vec<String>,
    /// `Some(k)`: report each token's logprob and its `k` most likely alternatives.
    pub logprobs: Option<usize>,
    pub stream: bool,
    pub include_usage: bool,
    /// llama-server's `cache_prompt` (default true): the prompt may continue a finished
    /// sequence kept with its KV cache; false prefills every token afresh.
    pub cache_prompt: bool,
    /// `response_format` asks for JSON: the schema the output must match (`json_object`:
    /// any object). `None`: free text.
    pub json_schema: Option<Value>,
    /// Choices per prompt (`n`).
    pub n: usize,
    /// The functions a chat request offers, if any (an empty `tools` is none).
    pub tools: Option<ToolRequest>,
}

/// A chat request's `tools`, `tool_choice` and `parallel_tool_calls`.
#[derive(Debug, Clone)]
pub struct ToolRequest {
    pub tools: Vec<Tool>,
    pub choice: ToolChoice,
    /// Several calls in one answer (default true).
    pub parallel: bool,
}

/// A function name as OpenAI allows it: 1 to 64 of `a-z A-Z 0-9 _ -`.
fn function_name(v: Option<&Value>, param: &str) -> Result<String, ApiError> {
    let Some(v) = v else {
        return Err(ApiError::invalid(
            param,
            "missing_required_parameter",
            format!("'{param}' is required"),
        ));
    };
    let Value::String(name) = v else {
        return Err(wrong_type(param, "a string", v));
    };
    let ok = (1..=64).contains(&name.len())
        && name
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || c == '_' || c == '-');
    if !ok {
        return Err(ApiError::invalid(
            param,
            "invalid_value",
            format!(
                "'{}' is not a function name (1 to 64 letters, digits, '_' or '-')",
                truncate_for_message(name)
            ),
        ));
    }
    Ok(name.clone())
}

/// `tools` (function tools), `tool_choice` and `parallel_tool_calls` of a chat body.
fn parse_tools(obj: &Map<String, Value>) -> Result<Option<ToolRequest>, ApiError> {
    let list = match field(obj, "tools") {
        None => Vec::new(),
        Some(Value::Array(a)) => a.clone(),
        Some(v) => return Err(wrong_type("tools", "an array of tools", v)),
    };
    if list.len() > MAX_TOOLS {
        return Err(out_of_range(
            "tools",
            &format!("at most {MAX_TOOLS} tools"),
            list.len(),
        ));
    }
    let mut tools: Vec<Tool> = Vec::with_capacity(list.len());
    for (i, t) in list.iter().enumerate() {
        let p = format!("tools[{i}]");
        let Value::Object(t) = t else {
            return Err(wrong_type(&p, "an object", t));
        };
        match t.get("type") {
            Some(Value::String(s)) if s == "function" => {}
            Some(v) => {
                return Err(ApiError::invalid(
                    format!("{p}.type"),
                    "invalid_value",
                    format!(
                        "only 'function' tools are supported, not {}",
                        truncate_for_message(&v.to_string())
                    ),
                ))
            }
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.type"),
                    "missing_required_parameter",
                    "a tool needs 'type': 'function'",
                ))
            }
        }
        let f = match t.get("function") {
            Some(Value::Object(f)) => f,
            Some(v) => return Err(wrong_type(&format!("{p}.function"), "an object", v)),
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.function"),
                    "missing_required_parameter",
                    "a tool needs its 'function'",
                ))
            }
        };
        let name = function_name(f.get("name"), &format!("{p}.function.name"))?;
        if tools.iter().any(|t| t.name == name) {
            return Err(ApiError::invalid(
                format!("{p}.function.name"),
                "invalid_value",
                format!("two tools are named '{name}'"),
            ));
        }
        let description = match f.get("description") {
            None | Some(Value::Null) => None,
            Some(Value::String(d)) => Some(d.clone()),
            Some(v) => {
                return Err(wrong_type(
                    &format!("{p}.function.description"),
                    "a string",
                    v,
                ))
            }
        };
        let parameters = match f.get("parameters") {
            None | Some(Value::Null) => json!({"type": "object", "properties": {}}),
            Some(v @ Value::Object(_)) => v.clone(),
            Some(v) => {
                return Err(wrong_type(
                    &format!("{p}.function.parameters"),
                    "a JSON schema object",
                    v,
                ))
            }
        };
        let strict = match f.get("strict") {
            None | Some(Value::Null) => false,
            Some(Value::Bool(b)) => *b,
            Some(v) => return Err(wrong_type(&format!("{p}.function.strict"), "a boolean", v)),
        };
        tools.push(Tool {
            name,
            description,
            parameters,
            strict,
        });
    }
    let choice = match field(obj, "tool_choice") {
        None => ToolChoice::Auto,
        Some(Value::String(s)) => match s.as_str() {
            "auto" => ToolChoice::Auto,
            "none" => ToolChoice::None,
            "required" => ToolChoice::Required,
            other => {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "invalid_value",
                    format!(
                        "'tool_choice' is 'auto', 'none', 'required' or a function, not '{}'",
                        truncate_for_message(other)
                    ),
                ))
            }
        },
        Some(Value::Object(o)) => {
            let name = match o.get("function") {
                Some(Value::Object(f)) => {
                    function_name(f.get("name"), "tool_choice.function.name")?
                }
                Some(v) => return Err(wrong_type("tool_choice.function", "an object", v)),
                None => {
                    return Err(ApiError::invalid(
                        "tool_choice.function",
                        "missing_required_parameter",
                        "a named 'tool_choice' needs its 'function'",
                    ))
                }
            };
            if !tools.iter().any(|t| t.name == name) {
                return Err(ApiError::invalid(
                    "tool_choice",
                    "invalid_value",
                    format!("'tool_choice' names '{name}', which is not among the tools"),
                ));
            }
            ToolChoice::Function(name)
        }
        Some(v) => return Err(wrong_type("tool_choice", "a string or an object", v)),
    };
    let parallel = opt_bool(obj, "parallel_tool_calls")?.unwrap_or(true);
    if tools.is_empty() {
        if choice == ToolChoice::Required {
            return Err(ApiError::invalid(
                "tool_choice",
                "invalid_value",
                "'tool_choice': 'required' needs 'tools'",
            ));
        }
        return Ok(None);
    }
    Ok(Some(ToolRequest {
        tools,
        choice,
        parallel,
    }))
}

/// An assistant message's `tool_calls` (OpenAI's shape: arguments a string of JSON).
fn parse_tool_calls(v: &Value, p: &str) -> Result<Vec<ToolCall>, ApiError> {
    let Value::Array(calls) = v else {
        return Err(wrong_type(p, "an array of tool calls", v));
    };
    if calls.len() > MAX_TOOL_CALLS {
        return Err(out_of_range(
            p,
            &format!("at most {MAX_TOOL_CALLS} calls"),
            calls.len(),
        ));
    }
    let mut out = Vec::with_capacity(calls.len());
    for (j, c) in calls.iter().enumerate() {
        let q = format!("{p}[{j}]");
        let Value::Object(c) = c else {
            return Err(wrong_type(&q, "an object", c));
        };
        let id = match c.get("id") {
            Some(Value::String(id)) if !id.is_empty() => id.clone(),
            Some(v) => return Err(wrong_type(&format!("{q}.id"), "a non-empty string", v)),
            None => {
                return Err(ApiError::invalid(
                    format!("{q}.id"),
                    "missing_required_parameter",
                    "a tool call needs its 'id'",
                ))
            }
        };
        let Some(Value::Object(f)) = c.get("function") else {
            return Err(ApiError::invalid(
                format!("{q}.function"),
                "missing_required_parameter",
                "a tool call needs its 'function' object",
            ));
        };
        let name = function_name(f.get("name"), &format!("{q}.function.name"))?;
        let arguments = match f.get("arguments") {
            None | Some(Value::Null) => json!({}),
            Some(Value::String(s)) => serde_json::from_str::<Value>(s)
                .ok()
                .filter(Value::is_object)
                .ok_or_else(|| {
                    ApiError::invalid(
                        format!("{q}.function.arguments"),
                        "invalid_value",
                        "a tool call's 'arguments' must be a JSON object, as a string",
                    )
                })?,
            Some(v @ Value::Object(_)) => v.clone(),
            Some(v) => {
                return Err(wrong_type(
                    &format!("{q}.function.arguments"),
                    "a string of JSON",
                    v,
                ))
            }
        };
        out.push(ToolCall {
            id,
            name,
            arguments,
        });
    }
    Ok(out)
}

/// `response_format`: `{"type": "text"}`, `{"type": "json_object"}` (any JSON object; with
/// llama-server's `schema` beside it, that schema) or OpenAI's
/// `{"type": "json_schema", "json_schema": {"name", "schema", "strict"}}`. Whether the schema
/// itself can be used is checked when it is compiled.
fn parse_response_format(obj: &Map<String, Value>) -> Result<Option<Value>, ApiError> {
    const P: &str = "response_format";
    let Some(v) = field(obj, P) else {
        return Ok(None);
    };
    let Value::Object(format) = v else {
        return Err(wrong_type(P, "an object", v));
    };
    let schema_at = |o: &Map<String, Value>, param: &str| match o.get("schema") {
        None | Some(Value::Null) => Ok(None),
        Some(s @ (Value::Object(_) | Value::Bool(true))) => Ok(Some(s.clone())),
        Some(s) => Err(wrong_type(param, "a JSON schema object", s)),
    };
    match format.get("type").and_then(Value::as_str) {
        Some("text") => Ok(None),
        Some("json_object") => Ok(Some(
            schema_at(format, "response_format.schema")?
                .unwrap_or_else(|| serde_json::json!({"type": "object"})),
        )),
        Some("json_schema") => {
            let Some(Value::Object(spec)) = format.get("json_schema") else {
                return Err(ApiError::invalid(
                    "response_format.json_schema",
                    "invalid_value",
                    "'response_format' of type 'json_schema' needs a 'json_schema' object with its 'schema'",
                ));
            };
            Ok(Some(
                schema_at(spec, "response_format.json_schema.schema")?.unwrap_or(Value::Bool(true)),
            ))
        }
        _ => Err(ApiError::invalid(
            P,
            "unsupported_value",
            "'response_format.type' must be 'text', 'json_object' or 'json_schema'",
        )),
    }
}

/// Parses a body into JSON, refusing what is not a JSON object.
pub fn parse_json(body: &[u8]) -> Result<Map<String, Value>, ApiError> {
    let value: Value = serde_json::from_slice(body).map_err(|e| {
        let what = match e.classify() {
            serde_json::error::Category::Eof => "the body ends before the JSON does",
            serde_json::error::Category::Syntax => "the body is not valid JSON",
            serde_json::error::Category::Data => {
                "the body's JSON holds a value that cannot be read"
            }
            serde_json::error::Category::Io => "the body could not be read",
        };
        ApiError::bad_request("invalid_json", format!("{what}: {e}"))
    })?;
    match value {
        Value::Object(map) => Ok(map),
        other => Err(ApiError::bad_request(
            "invalid_json",
            format!(
                "the body must be a JSON object, not {}",
                kiln_formats::apr::json_kind(&other)
            ),
        )),
    }
}

fn wrong_type(param: &str, expected: &str, got: &Value) -> ApiError {
    ApiError::invalid(
        param,
        "invalid_type",
        format!(
            "'{param}' must be {expected}, not {}",
            kiln_formats::apr::json_kind(got)
        ),
    )
}

fn out_of_range(param: &str, range: &str, got: impl std::fmt::Display) -> ApiError {
    ApiError::invalid(
        param,
        "invalid_value",
        format!("'{param}' must be {range}; got {got}"),
    )
}

/// A field, with JSON `null` read as absent.
fn field<'a>(obj: &'a Map<String, Value>, name: &str) -> Option<&'a Value> {
    obj.get(name).filter(|v| !v.is_null())
}

fn opt_bool(obj: &Map<String, Value>, name: &str) -> Result<Option<bool>, ApiError> {
    match field(obj, name) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(wrong_type(name, "a boolean", v)),
    }
}

/// A number in `[lo, hi]` (or `(lo, hi]` with `lo_open`).
fn opt_f32(
    obj: &Map<String, Value>,
    name: &str,
    lo: f64,
    hi: f64,
    lo_open: bool,
) -> Result<Option<f32>, ApiError> {
    let Some(v) = field(obj, name) else {
        return Ok(None);
    };
    let Some(x) = v.as_f64() else {
        return Err(wrong_type(name, "a number", v));
    };
    let low_ok = if lo_open { x > lo } else { x >= lo };
    if !low_ok || x > hi || !x.is_finite() {
        let range = if lo_open {
            format!("in ({lo}, {hi}]")
        } else {
            format!("in [{lo}, {hi}]")
        };
        return Err(out_of_range(name, &range, v));
    }
    Ok(Some(x as f32))
}

/// An integer in `[lo, hi]`. JSON numbers with a zero fraction (`3.0`) count as integers.
fn opt_int(
    obj: &Map<String, Value>,
    name: &str,
    lo: i64,
    hi: i64,
) -> Result<Option<i64>, ApiError> {
    let Some(v) = field(obj, name) else {
        return Ok(None);
    };
    let n = match v {
        Value::Number(n) => {
            if let Some(i) = n.as_i64() {
                i
            } else if n.as_u64().is_some() {
                return Err(out_of_range(
                    name,
                    &format!("an integer in [{lo}, {hi}]"),
                    v,
                ));
            } else {
                let f = n.as_f64().unwrap_or(f64::NAN);
                if f.fract() != 0.0 || !f.is_finite() {
                    return Err(wrong_type(name, "an integer", v));
                }
                if f < lo as f64 || f > hi as f64 {
                    return Err(out_of_range(
                        name,
                        &format!("an integer in [{lo}, {hi}]"),
                        v,
                    ));
                }
                f as i64
            }
        }
        _ => return Err(wrong_type(name, "an integer", v)),
    };
    if n < lo || n > hi {
        return Err(out_of_range(
            name,
            &format!("an integer in [{lo}, {hi}]"),
            n,
        ));
    }
    Ok(Some(n))
}

fn parse_stop(obj: &Map<String, Value>) -> Result<Vec<String>, ApiError> {
    let list: Vec<&Value> = match field(obj, "stop") {
        None => return Ok(Vec::new()),
        Some(v @ Value::String(_)) => vec![v],
        Some(Value::Array(a)) => a.iter().collect(),
        Some(v) => return Err(wrong_type("stop", "a string or an array of strings", v)),
    };
    if list.len() > MAX_STOP_STRINGS {
        return Err(out_of_range(
            "stop",
            &format!("at most {MAX_STOP_STRINGS} strings"),
            format!("{} strings", list.len()),
        ));
    }
    let mut out = Vec::new();
    for (i, v) in list.into_iter().enumerate() {
        let Value::String(s) = v else {
            return Err(wrong_type(&format!("stop[{i}]"), "a string", v));
        };
        if s.len() > MAX_STOP_BYTES {
            return Err(out_of_range(
                &format!("stop[{i}]"),
                &format!("at most {MAX_STOP_BYTES} bytes"),
                format!("{} bytes", s.len()),
            ));
        }
        if !s.is_empty() {
            out.push(s.clone());
        }
    }
    Ok(out)
}

fn parse_content(v: &Value, param: &str, role: &str) -> Result<String, ApiError> {
    match v {
        Value::String(s) => Ok(s.clone()),
        Value::Null if role == "assistant" => Ok(String::new()),
        Value::Array(parts) => {
            let mut text = String::new();
            for (j, part) in parts.iter().enumerate() {
                let p = format!("{param}[{j}]");
                let Value::Object(part) = part else {
                    return Err(wrong_type(&p, "an object", part));
                };
                match part.get("type") {
                    Some(Value::String(t)) if t == "text" => {}
                    Some(Value::String(t)) => {
                        return Err(ApiError::invalid(
                            format!("{p}.type"),
                            "unsupported_value",
                            format!("content parts of type '{t}' are not supported; only 'text'"),
                        ))
                    }
                    Some(v) => return Err(wrong_type(&format!("{p}.type"), "a string", v)),
                    None => {
                        return Err(ApiError::invalid(
                            format!("{p}.type"),
                            "missing_required_parameter",
                            "a content part needs a 'type'",
                        ))
                    }
                }
                match part.get("text") {
                    Some(Value::String(s)) => text.push_str(s),
                    Some(v) => return Err(wrong_type(&format!("{p}.text"), "a string", v)),
                    None => {
                        return Err(ApiError::invalid(
                            format!("{p}.text"),
                            "missing_required_parameter",
                            "a text part needs 'text'",
                        ))
                    }
                }
            }
            Ok(text)
        }
        other => Err(wrong_type(
            param,
            "a string or an array of content parts",
            other,
        )),
    }
}

fn parse_messages(obj: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    let Some(v) = field(obj, "messages") else {
        return Err(ApiError::invalid(
            "messages",
            "missing_required_parameter",
            "'messages' is required",
        ));
    };
    let Value::Array(list) = v else {
        return Err(wrong_type("messages", "an array of messages", v));
    };
    if list.is_empty() {
        return Err(ApiError::invalid(
            "messages",
            "invalid_value",
            "'messages' must hold at least one message",
        ));
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let p = format!("messages[{i}]");
        let Value::Object(m) = m else {
            return Err(wrong_type(&p, "an object", m));
        };
        let role = match m.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(v) => return Err(wrong_type(&format!("{p}.role"), "a string", v)),
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    "missing_required_parameter",
                    "a message needs a 'role'",
                ))
            }
        };
        // OpenAI's newer name for the system role.
        let role = match role {
            "system" | "developer" => "system",
            "user" => "user",
            "assistant" => "assistant",
            "tool" => "tool",
            other => {
                return Err(ApiError::invalid(
                    format!("{p}.role"),
                    "invalid_value",
                    format!(
                        "role '{}' is not supported; use system, user, assistant or tool",
                        truncate_for_message(other)
                    ),
                ))
            }
        };
        let tool_calls = match m.get("tool_calls") {
            None | Some(Value::Null) => Vec::new(),
            Some(v) if role == "assistant" => parse_tool_calls(v, &format!("{p}.tool_calls"))?,
            Some(_) => {
                return Err(ApiError::invalid(
                    format!("{p}.tool_calls"),
                    "invalid_value",
                    "only an assistant message has 'tool_calls'",
                ))
            }
        };
        let tool_call_id = match (role, m.get("tool_call_id")) {
            ("tool", Some(Value::String(id))) => {
                // A tool's answer is to a call an earlier assistant message made.
                let made = out
                    .iter()
                    .flat_map(|m: &ChatMessage| &m.tool_calls)
                    .any(|c| &c.id == id);
                if !made {
                    return Err(ApiError::invalid(
                        format!("{p}.tool_call_id"),
                        "invalid_value",
                        format!(
                            "no earlier assistant message made the tool call '{}'",
                            truncate_for_message(id)
                        ),
                    ));
                }
                Some(id.clone())
            }
            ("tool", Some(v)) => {
                return Err(wrong_type(&format!("{p}.tool_call_id"), "a string", v))
            }
            ("tool", None) => {
                return Err(ApiError::invalid(
                    format!("{p}.tool_call_id"),
                    "missing_required_parameter",
                    "a 'tool' message needs the 'tool_call_id' it answers",
                ))
            }
            _ => None,
        };
        let content = match m.get("content") {
            Some(Value::Null) if role == "assistant" => String::new(),
            Some(c) => parse_content(c, &format!("{p}.content"), role)?,
            None if role == "assistant" => String::new(),
            None => {
                return Err(ApiError::invalid(
                    format!("{p}.content"),
                    "missing_required_parameter",
                    "a message needs 'content'",
                ))
            }
        };
        out.push(ChatMessage {
            tool_calls,
            tool_call_id,
            ..ChatMessage::new(role, content)
        });
    }
    Ok(out)
}

fn token_id(v: &Value, param: &str) -> Result<u32, ApiError> {
    v.as_u64()
        .and_then(|n| u32::try_from(n).ok())
        .ok_or_else(|| {
            ApiError::invalid(
                param,
                "invalid_value",
                format!("'{param}' must hold token ids (non-negative integers)"),
            )
        })
}

fn parse_prompts(obj: &Map<String, Value>) -> Result<Vec<PromptInput>, ApiError> {
    let Some(v) = field(obj, "prompt") else {
        return Err(ApiError::invalid(
            "prompt",
            "missing_required_parameter",
            "'prompt' is required",
        ));
    };
    let prompts = match v {
        Value::String(s) => vec![PromptInput::Text(s.clone())],
        Value::Array(a) if a.is_empty() => {
            return Err(ApiError::invalid(
                "prompt",
                "invalid_value",
                "'prompt' must not be an empty array",
            ))
        }
        Value::Array(a) if a.iter().all(Value::is_number) => {
            vec![PromptInput::Tokens(
                a.iter()
                    .map(|t| token_id(t, "prompt"))
                    .collect::<Result<_, _>>()?,
            )]
        }
        Value::Array(a) => {
            if a.len() > MAX_PROMPTS {
                return Err(out_of_range(
                    "prompt",
                    &format!("at most {MAX_PROMPTS} prompts"),
                    format!("{} prompts", a.len()),
                ));
            }
            let mut out = Vec::new();
            for (i, p) in a.iter().enumerate() {
                out.push(match p {
                    Value::String(s) => PromptInput::Text(s.clone()),
                    Value::Array(ids) if !ids.is_empty() => PromptInput::Tokens(
                        ids.iter()
                            .map(|t| token_id(t, &format!("prompt[{i}]")))
                            .collect::<Result<_, _>>()?,
                    ),
                    other => {
                        return Err(wrong_type(
                            &format!("prompt[{i}]"),
                            "a string or a non-empty array of token ids",
                            other,
                        ))
                    }
                });
            }
            out
        }
        other => {
            return Err(wrong_type(
                "prompt",
                "a string, an array of strings or an array of token ids",
                other,
            ))
        }
    };
    Ok(prompts)
}

fn parse_logit_bias(obj: &Map<String, Value>) -> Result<Vec<(u32, f32)>, ApiError> {
    let Some(v) = field(obj, "logit_bias") else {
        return Ok(Vec::new());
    };
    let Value::Object(map) = v else {
        return Err(wrong_type("logit_bias", "an object of token id → bias", v));
    };
    if map.len() > MAX_LOGIT_BIAS {
        return Err(out_of_range(
            "logit_bias",
            &format!("at most {MAX_LOGIT_BIAS} entries"),
            map.len(),
        ));
    }
    let mut out = Vec::with_capacity(map.len());
    for (k, b) in map {
        let Ok(id) = k.parse::<u32>() else {
            return Err(ApiError::invalid(
                "logit_bias",
                "invalid_value",
                format!(
                    "'logit_bias' keys must be token ids; got '{}'",
                    truncate_for_message(k)
                ),
            ));
        };
        let Some(x) = b.as_f64().filter(|x| (-100.0..=100.0).contains(x)) else {
            return Err(out_of_range("logit_bias", "numbers in [-100, 100]", b));
        };
        out.push((id, x as f32));
    }
    Ok(out)
}

/// The first 64 characters of a user-supplied string, for an error message.
pub fn truncate_for_message(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((i, _)) => format!("{}…", &s[..i]),
        None => s.to_string(),
    }
}

/// Validates a chat or completions body.
pub fn parse_request(endpoint: Endpoint, obj: &Map<String, Value>) -> Result<GenRequest, ApiError> {
    let model = match field(obj, "model") {
        None => None,
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => return Err(wrong_type("model", "a string", v)),
    };
    let prompts = match endpoint {
        Endpoint::Chat => vec![PromptInput::Chat(parse_messages(obj)?)],
        Endpoint::Completions => parse_prompts(obj)?,
    };
    // OpenAI has no upper bound of its own here; the context is checked after tokenizing.
    let max_tokens = opt_int(obj, "max_tokens", 1, i64::MAX)?;
    let max_completion_tokens = opt_int(obj, "max_completion_tokens", 1, i64::MAX)?;
    let (max_tokens, max_tokens_param) = match (max_completion_tokens, max_tokens) {
        (Some(m), _) => (Some(m), "max_completion_tokens"),
        (None, m) => (m, "max_tokens"),
    };
    let max_tokens = max_tokens.map(|m| usize::try_from(m).unwrap_or(usize::MAX));
    let n = opt_int(obj, "n", 1, MAX_N as i64)?.map_or(1, |n| n as usize);
    if prompts.len() * n > MAX_CHOICES {
        return Err(ApiError::invalid(
            "n",
            "invalid_value",
            format!(
                "{} prompts × n = {n} asks for {} choices; at most {MAX_CHOICES} in one request",
                prompts.len(),
                prompts.len() * n
            ),
        ));
    }
    if endpoint == Endpoint::Completions {
        if let Some(n) = opt_int(obj, "best_of", i64::MIN, i64::MAX)? {
            if n != 1 {
                return Err(ApiError::invalid(
                    "best_of",
                    "unsupported_value",
                    format!("'best_of' must be 1; got {n}"),
                ));
            }
        }
        if opt_bool(obj, "echo")? == Some(true) {
            return Err(ApiError::invalid(
                "echo",
                "unsupported_value",
                "'echo' is not supported",
            ));
        }
        if let Some(v) = field(obj, "suffix") {
            if !matches!(v, Value::String(s) if s.is_empty()) {
                return Err(ApiError::invalid(
                    "suffix",
                    "unsupported_value",
                    "'suffix' is not supported",
                ));
            }
        }
    }
    if let Some(v) = field(obj, "functions") {
        if !matches!(v, Value::Array(a) if a.is_empty()) {
            return Err(ApiError::invalid(
                "functions",
                "unsupported_value",
                "the legacy 'functions' are not supported; use 'tools'",
            ));
        }
    }
    let tools = match endpoint {
        Endpoint::Chat => parse_tools(obj)?,
        Endpoint::Completions => match field(obj, "tools") {
            None => None,
            Some(Value::Array(a)) if a.is_empty() => None,
            Some(_) => {
                return Err(ApiError::invalid(
                    "tools",
                    "unsupported_value",
                    "'tools' are for /v1/chat/completions",
                ))
            }
        },
    };
    let json_schema = parse_response_format(obj)?;
    if json_schema.is_some()
        && tools
            .as_ref()
            .is_some_and(|t| matches!(t.choice, ToolChoice::Required | ToolChoice::Function(_)))
    {
        return Err(ApiError::invalid(
            "response_format",
            "invalid_value",
            "a JSON 'response_format' and a required tool call cannot both shape the answer",
        ));
    }
    let sampling = SamplingRequest {
        temperature: opt_f32(obj, "temperature", 0.0, 2.0, false)?,
        top_p: opt_f32(obj, "top_p", 0.0, 1.0, true)?,
        top_k: opt_int(obj, "top_k", 0, i64::from(u32::MAX))?.map(|k| k as usize),
        min_p: opt_f32(obj, "min_p", 0.0, 1.0, false)?,
        // OpenAI's seed is an int64; any 64-bit pattern works as a seed.
        seed: match field(obj, "seed") {
            None => None,
            Some(Value::Number(n)) if n.as_i64().is_some() => n.as_i64().map(|s| s as u64),
            Some(Value::Number(n)) if n.as_u64().is_some() => n.as_u64(),
            Some(v @ Value::Number(_)) => return Err(out_of_range("seed", "a 64-bit integer", v)),
            Some(v) => return Err(wrong_type("seed", "an integer", v)),
        },
    };
    let presence_penalty = opt_f32(obj, "presence_penalty", -2.0, 2.0, false)?.unwrap_or(0.0);
    let frequency_penalty = opt_f32(obj, "frequency_penalty", -2.0, 2.0, false)?.unwrap_or(0.0);
    let logit_bias = parse_logit_bias(obj)?;
    let stop = parse_stop(obj)?;
    let logprobs = match endpoint {
        Endpoint::Chat => {
            let on = opt_bool(obj, "logprobs")?.unwrap_or(false);
            let top = opt_int(obj, "top_logprobs", 0, MAX_TOP_LOGPROBS as i64)?;
            if top.is_some() && !on {
                return Err(ApiError::invalid(
                    "top_logprobs",
                    "invalid_value",
                    "'top_logprobs' needs 'logprobs': true",
                ));
            }
            on.then(|| top.unwrap_or(0) as usize)
        }
        Endpoint::Completions => {
            opt_int(obj, "logprobs", 0, MAX_TOP_LOGPROBS as i64)?.map(|k| k as usize)
        }
    };
    let stream = opt_bool(obj, "stream")?.unwrap_or(false);
    let include_usage = match field(obj, "stream_options") {
        None => false,
        Some(Value::Object(o)) => {
            if !stream {
                return Err(ApiError::invalid(
                    "stream_options",
                    "invalid_value",
                    "'stream_options' is only allowed with 'stream': true",
                ));
            }
            match o.get("include_usage") {
                None | Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(v) => return Err(wrong_type("stream_options.include_usage", "a boolean", v)),
            }
        }
        Some(v) => return Err(wrong_type("stream_options", "an object", v)),
    };
    if let Some(v) = field(obj, "user") {
        if !v.is_string() {
            return Err(wrong_type("user", "a string", v));
        }
    }
    let cache_prompt = opt_bool(obj, "cache_prompt")?.unwrap_or(true);
    Ok(GenRequest {
        endpoint,
        model,
        prompts,
        max_tokens,
        max_tokens_param,
        sampling,
        presence_penalty,
        frequency_penalty,
        logit_bias,
        stop,
        logprobs,
        stream,
        include_usage,
        cache_prompt,
        json_schema,
        n,
        tools,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse(endpoint: Endpoint, body: &str) -> Result<GenRequest, ApiError> {
        parse_request(endpoint, &parse_json(body.as_bytes())?)
    }

    #[test]
    fn valid_requests_parse() {
        let r = parse(
            Endpoint::Chat,
            r#"{"model":"m","messages":[{"role":"system","content":"be terse"},{"role":"user","content":[{"type":"text","text":"hi"}]}],
               "max_tokens":5,"temperature":0.5,"stop":"x","logprobs":true,"top_logprobs":3,"stream":true,"stream_options":{"include_usage":true},"seed":-1}"#,
        )
        .unwrap();
        assert_eq!(r.max_tokens, Some(5));
        assert_eq!(r.stop, vec!["x"]);
        assert_eq!(r.logprobs, Some(3));
        assert!(r.stream && r.include_usage);
        assert_eq!(r.sampling.seed, Some(u64::MAX));
        let PromptInput::Chat(m) = &r.prompts[0] else {
            panic!()
        };
        assert_eq!(m[1].content, "hi");
        let r = parse(
            Endpoint::Completions,
            r#"{"prompt":["a","b"],"logprobs":2,"max_tokens":3.0}"#,
        )
        .unwrap();
        assert_eq!(r.prompts.len(), 2);
        assert_eq!(r.logprobs, Some(2));
        assert_eq!(r.max_tokens, Some(3));
        let r = parse(Endpoint::Completions, r#"{"prompt":[1,2,3]}"#).unwrap();
        assert!(matches!(&r.prompts[0], PromptInput::Tokens(t) if t == &[1, 2, 3]));
        assert!(
            r.cache_prompt,
            "the prompt cache is on unless a request turns it off"
        );
        let r = parse(
            Endpoint::Completions,
            r#"{"prompt":"x","cache_prompt":false}"#,
        )
        .unwrap();
        assert!(!r.cache_prompt);
        assert_eq!(r.json_schema, None);
        // response_format: text, any object, llama-server's object with a schema, OpenAI's
        // json_schema (no schema: any JSON value).
        let format = |f: &str| {
            parse(
                Endpoint::Chat,
                &format!(
                    r#"{{"messages":[{{"role":"user","content":"x"}}],"response_format":{f}}}"#
                ),
            )
            .unwrap()
            .json_schema
        };
        assert_eq!(format(r#"{"type":"text"}"#), None);
        assert_eq!(
            format(r#"{"type":"json_object"}"#),
            Some(serde_json::json!({"type": "object"}))
        );
        assert_eq!(
            format(r#"{"type":"json_object","schema":{"type":"array"}}"#),
            Some(serde_json::json!({"type": "array"}))
        );
        assert_eq!(
            format(
                r#"{"type":"json_schema","json_schema":{"name":"n","strict":true,"schema":{"enum":[1,2]}}}"#
            ),
            Some(serde_json::json!({"enum": [1, 2]}))
        );
        assert_eq!(
            format(r#"{"type":"json_schema","json_schema":{"name":"n"}}"#),
            Some(Value::Bool(true))
        );
    }

    #[test]
    fn invalid_requests_name_their_param() {
        let cases = [
            (Endpoint::Chat, r#"{"messages":[]}"#, Some("messages")),
            (
                Endpoint::Completions,
                r#"{"prompt":"x","cache_prompt":"yes"}"#,
                Some("cache_prompt"),
            ),
            (
                Endpoint::Completions,
                r#"{"prompt":"x","response_format":{"type":"yaml"}}"#,
                Some("response_format"),
            ),
            (
                Endpoint::Completions,
                r#"{"prompt":"x","response_format":{"type":"json_schema","json_schema":{"schema":"s"}}}"#,
                Some("response_format.json_schema.schema"),
            ),
            (Endpoint::Chat, r#"{"messages":"hi"}"#, Some("messages")),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"robot","content":"x"}]}"#,
                Some("messages[0].role"),
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":5}]}"#,
                Some("messages[0].content"),
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"temperature":"hot"}"#,
                Some("temperature"),
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"temperature":2.5}"#,
                Some("temperature"),
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"top_p":0}"#,
                Some("top_p"),
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":-1}"#,
                Some("max_tokens"),
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"max_tokens":1e300}"#,
                Some("max_tokens"),
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"n":17}"#,
                Some("n"),
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"top_logprobs":2}"#,
                Some("top_logprobs"),
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"presence_penalty":-3}"#,
                Some("presence_penalty"),
            ),
            (
                Endpoint::Chat,
                r#"{"messages":[{"role":"user","content":"x"}],"stream_options":{"include_usage":true}}"#,
                Some("stream_options"),
            ),
            (Endpoint::Completions, r#"{"prompt":5}"#, Some("prompt")),
            (
                Endpoint::Completions,
                r#"{"prompt":"x","logprobs":21}"#,
                Some("logprobs"),
            ),
            (
                Endpoint::Completions,
                r#"{"prompt":"x","stop":[1]}"#,
                Some("stop[0]"),
            ),
            (Endpoint::Completions, r#"{"prompt":[-1]}"#, Some("prompt")),
            (
                Endpoint::Completions,
                r#"{"prompt":"x","top_k":-2}"#,
                Some("top_k"),
            ),
            (Endpoint::Completions, r#"[1,2]"#, None),
            (Endpoint::Completions, r#"{"prompt":"#, None),
        ];
        for (endpoint, body, param) in cases {
            let e = parse(endpoint, body).expect_err(body);
            assert_eq!(e.status, StatusCode::BAD_REQUEST, "{body}");
            assert_eq!(e.param.as_deref(), param, "{body}: {}", e.message);
        }
        let deep = "[".repeat(10_000);
        assert_eq!(
            parse(Endpoint::Chat, &deep).unwrap_err().status,
            StatusCode::BAD_REQUEST
        );
    }
}

/// llama-server's `POST /tokenize`: `content`, `add_special` (BOS; default false),
/// `parse_special` (special-token spellings become their tokens; default true) and
/// `with_pieces` (each token's text beside its id; default false).
#[derive(Debug, Clone)]
pub struct TokenizeRequest {
    pub content: String,
    pub add_special: bool,
    pub parse_special: bool,
    pub with_pieces: bool,
}

pub fn parse_tokenize(obj: &Map<String, Value>) -> Result<TokenizeRequest, ApiError> {
    let content = match field(obj, "content") {
        Some(Value::String(s)) => s.clone(),
        Some(v) => return Err(wrong_type("content", "a string", v)),
        None => {
            return Err(ApiError::invalid(
                "content",
                "missing_required_parameter",
                "'content' is required",
            ))
        }
    };
    Ok(TokenizeRequest {
        content,
        add_special: opt_bool(obj, "add_special")?.unwrap_or(false),
        parse_special: opt_bool(obj, "parse_special")?.unwrap_or(true),
        with_pieces: opt_bool(obj, "with_pieces")?.unwrap_or(false),
    })
}

/// llama-server's `POST /detokenize`: the token ids in `tokens`.
pub fn parse_detokenize(obj: &Map<String, Value>) -> Result<Vec<u32>, ApiError> {
    match field(obj, "tokens") {
        Some(Value::Array(ids)) => ids
            .iter()
            .enumerate()
            .map(|(i, v)| token_id(v, &format!("tokens[{i}]")))
            .collect(),
        Some(v) => Err(wrong_type("tokens", "an array of token ids", v)),
        None => Err(ApiError::invalid(
            "tokens",
            "missing_required_parameter",
            "'tokens' is required",
        )),
    }
}

/// llama-server's `POST /apply-template`: the chat in `messages`, as chat completions take it.
pub fn parse_apply_template(obj: &Map<String, Value>) -> Result<Vec<ChatMessage>, ApiError> {
    parse_messages(obj)
}

/// What `/v1/embeddings` embeds: texts, or token ids.
#[derive(Debug, Clone)]
pub enum EmbeddingInput {
    Texts(Vec<String>),
    Tokens(Vec<Vec<u32>>),
}

/// A `/v1/embeddings` request.
#[derive(Debug, Clone)]
pub struct EmbeddingsRequest {
    pub model: Option<String>,
    pub input: EmbeddingInput,
    /// `encoding_format: "base64"` (little-endian f32 bytes) rather than `"float"`.
    pub base64: bool,
}

/// Most inputs one embeddings request may hold (OpenAI's limit).
pub const MAX_EMBEDDING_INPUTS: usize = 2048;

/// `input` is a string, an array of strings, an array of token ids, or an array of such
/// arrays (OpenAI's four forms); `encoding_format` `float` (default) or `base64`;
/// `dimensions` is refused (the model's width is what it is); `user` is ignored.
pub fn parse_embeddings(obj: &Map<String, Value>) -> Result<EmbeddingsRequest, ApiError> {
    let model = match field(obj, "model") {
        Some(Value::String(s)) => Some(s.clone()),
        Some(v) => return Err(wrong_type("model", "a string", v)),
        None => None,
    };
    if field(obj, "dimensions").is_some() {
        return Err(ApiError::invalid(
            "dimensions",
            "unsupported_parameter",
            "'dimensions' is not supported: the embeddings have the model's width",
        ));
    }
    let base64 = match field(obj, "encoding_format") {
        None => false,
        Some(Value::String(f)) if f == "float" => false,
        Some(Value::String(f)) if f == "base64" => true,
        Some(v) => {
            return Err(ApiError::invalid(
                "encoding_format",
                "invalid_value",
                format!(
                    "'encoding_format' must be \"float\" or \"base64\", not {}",
                    truncate_for_message(&v.to_string())
                ),
            ))
        }
    };
    let Some(v) = field(obj, "input") else {
        return Err(ApiError::invalid(
            "input",
            "missing_required_parameter",
            "'input' is required",
        ));
    };
    let empty = || ApiError::invalid("input", "invalid_value", "'input' holds nothing to embed");
    let too_many = |n: usize| {
        ApiError::invalid(
            "input",
            "invalid_value",
            format!("'input' holds {n} inputs; at most {MAX_EMBEDDING_INPUTS}"),
        )
    };
    let input = match v {
        Value::String(s) => EmbeddingInput::Texts(vec![s.clone()]),
        Value::Array(list) if list.is_empty() => return Err(empty()),
        Value::Array(list) if list.len() > MAX_EMBEDDING_INPUTS && !list[0].is_number() => {
            return Err(too_many(list.len()))
        }
        Value::Array(list) => match &list[0] {
            Value::String(_) => EmbeddingInput::Texts(
                list.iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::String(s) => Ok(s.clone()),
                        other => Err(wrong_type(&format!("input[{i}]"), "a string", other)),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            Value::Number(_) => EmbeddingInput::Tokens(vec![list
                .iter()
                .enumerate()
                .map(|(i, v)| token_id(v, &format!("input[{i}]")))
                .collect::<Result<_, _>>()?]),
            Value::Array(_) => EmbeddingInput::Tokens(
                list.iter()
                    .enumerate()
                    .map(|(i, v)| match v {
                        Value::Array(ids) => ids
                            .iter()
                            .enumerate()
                            .map(|(j, t)| token_id(t, &format!("input[{i}][{j}]")))
                            .collect::<Result<Vec<u32>, _>>(),
                        other => Err(wrong_type(
                            &format!("input[{i}]"),
                            "an array of token ids",
                            other,
                        )),
                    })
                    .collect::<Result<_, _>>()?,
            ),
            other => {
                return Err(wrong_type(
                    "input",
                    "a string, strings, token ids or arrays of them",
                    other,
                ))
            }
        },
        other => {
            return Err(wrong_type(
                "input",
                "a string, strings, token ids or arrays of them",
                other,
            ))
        }
    };
    Ok(EmbeddingsRequest {
        model,
        input,
        base64,
    })
}
