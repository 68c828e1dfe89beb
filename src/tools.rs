//! Function calling: the tools a chat request offers, how the model is told about them,
//! the grammar that makes a call certain when one is required, and reading the calls back
//! out of the model's text.
//!
//! Each model family writes its calls its own way, and its chat template says which
//! ([`CallFormat::of`]): Hermes / Qwen 2.5 / Qwen 3 wrap a JSON object `{"name",
//! "arguments"}` in `<tool_call>` tags; Llama 3.1–3.3 answer with a bare JSON object
//! `{"name", "parameters"}` (after `<|python_tag|>` for its built-in tools); Mistral writes
//! `[TOOL_CALLS]` and a JSON array. A template that does not read `tools` at all gets them
//! described in the system message ([`instructions`]) and is asked for the Hermes form.
//!
//! With `tool_choice` `auto` the text is parsed after the fact and anything that is not a
//! well-formed call of an offered tool stays content (never an error). `required` and a
//! named function are enforced while sampling: [`grammar`] is a Lark grammar (llguidance,
//! as for structured outputs) whose `%json` parts are the functions' parameter schemas, so
//! the call parses and its arguments validate whatever the sampler draws.

use serde_json::{json, Map, Value};

/// A function the model may call (an OpenAI `tools` entry of type `function`).
#[derive(Debug, Clone, PartialEq)]
pub struct Tool {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON schema (`{"type": "object"}` when the request gives none).
    pub parameters: Value,
    /// OpenAI's `strict`: the arguments must match the schema exactly. kiln enforces
    /// schemas only where a call is required ([`grammar`]); with `auto` a call whose
    /// arguments do not parse as JSON stays text.
    pub strict: bool,
}

impl Tool {
    /// The OpenAI form, as chat templates read it.
    pub fn to_openai(&self) -> Value {
        let mut function = json!({"name": self.name, "parameters": self.parameters});
        if let Some(d) = &self.description {
            function["description"] = json!(d);
        }
        json!({"type": "function", "function": function})
    }
}

/// OpenAI's `tool_choice`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ToolChoice {
    /// The model decides; its text is parsed for calls.
    Auto,
    /// No calls: the tools are described but the text is only content.
    None,
    /// At least one call, of any offered tool.
    Required,
    /// A call of this function.
    Function(String),
}

/// How a model family writes a call (see the module doc).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    /// `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, one block a call.
    Hermes,
    /// `{"name": …, "parameters": {…}}`, optionally after `<|python_tag|>`; several
    /// separated by `;`.
    Llama3,
    /// `[TOOL_CALLS][{"name": …, "arguments": {…}}, …]`.
    Mistral,
}

impl CallFormat {
    /// The format a chat template teaches its model, from the template's own markup;
    /// Hermes for templates that know no tools (kiln describes them itself).
    pub fn of(template: &str) -> CallFormat {
        if template.contains("[TOOL_CALLS]") {
            CallFormat::Mistral
        } else if template.contains("<|python_tag|>")
            || (template.contains("<|start_header_id|>") && template.contains("tools"))
        {
            CallFormat::Llama3
        } else {
            CallFormat::Hermes
        }
    }
}

/// What a model's text held: its content, and the calls of offered tools in it.
#[derive(Debug, Clone, PartialEq, Default)]
pub struct ParsedOutput {
    pub content: String,
    pub calls: Vec<ParsedCall>,
}

/// One call read from the text: the function and its arguments as a JSON object.
#[derive(Debug, Clone, PartialEq)]
pub struct ParsedCall {
    pub name: String,
    pub arguments: Value,
}

/// A system-message description of `tools` for a template that does not read them, asking
/// for the Hermes form (the one [`parse`] reads for such templates).
pub fn instructions(tools: &[Tool]) -> String {
    let mut s = String::from(
        "You may call one or more functions to assist with the user query. The functions \
         are described as JSON schemas inside <tools></tools> tags:\n<tools>\n",
    );
    for t in tools {
        s.push_str(&t.to_openai().to_string());
        s.push('\n');
    }
    s.push_str(
        "</tools>\nTo call a function, answer with a JSON object of its name and arguments \
         inside <tool_call></tool_call> tags, one block per call:\n<tool_call>\n\
         {\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
    );
    s
}

/// The JSON schema of one call of any of `tools` in `format`'s object (`name` plus
/// `arguments`, or Llama 3's `parameters`).
fn call_schema(tools: &[&Tool], format: CallFormat) -> Value {
    let args = match format {
        CallFormat::Llama3 => "parameters",
        CallFormat::Hermes | CallFormat::Mistral => "arguments",
    };
    let one = |t: &Tool| {
        json!({
            "type": "object",
            "properties": {"name": {"const": t.name}, args: t.parameters},
            "required": ["name", args],
            "additionalProperties": false,
        })
    };
    match tools {
        [t] => one(t),
        many => json!({"anyOf": many.iter().map(|t| one(t)).collect::<Vec<_>>()}),
    }
}

/// The Lark grammar (llguidance) of an answer that is only calls, for `required` or a
/// named function: one call, or with `parallel` one or more. `None` for `auto` and `none`,
/// which sample freely; an error for a named function that is not offered.
pub fn grammar(
    tools: &[Tool],
    choice: &ToolChoice,
    parallel: bool,
    format: CallFormat,
) -> Result<Option<String>, String> {
    let chosen: Vec<&Tool> = match choice {
        ToolChoice::Auto | ToolChoice::None => return Ok(None),
        ToolChoice::Required => tools.iter().collect(),
        ToolChoice::Function(name) => match tools.iter().find(|t| &t.name == name) {
            Some(t) => vec![t],
            None => {
                return Err(format!(
                    "tool_choice names '{name}', which is not among the tools"
                ))
            }
        },
    };
    if chosen.is_empty() {
        return Err("tool_choice 'required' needs at least one tool".into());
    }
    // Whitespace between JSON tokens as structured outputs bound it.
    let spacing = json!({"whitespace_pattern": r"[\x20]|\x0A[\x20\x09]{0,20}"});
    let mut schema = call_schema(&chosen, format);
    schema["x-guidance"] = spacing.clone();
    let call = format!("call: %json {schema}");
    Ok(Some(match format {
        CallFormat::Hermes => {
            let repeat = if parallel { "+" } else { "" };
            format!("start: block{repeat}\nblock: \"<tool_call>\\n\" call \"\\n</tool_call>\\n\"\n{call}\n")
        }
        CallFormat::Llama3 => match parallel {
            true => format!("start: call (\"; \" call)*\n{call}\n"),
            false => format!("start: call\n{call}\n"),
        },
        // The `[TOOL_CALLS]` marker is a special token the grammar does not spell; the
        // array of calls follows it (and is read without it).
        CallFormat::Mistral => {
            let mut array = json!({
                "type": "array",
                "minItems": 1,
                "items": call_schema(&chosen, format),
                "x-guidance": spacing,
            });
            if !parallel {
                array["maxItems"] = json!(1);
            }
            format!("start: %json {array}\n")
        }
    }))
}

/// Reads `format`'s calls of offered `tools` out of `text`. What is not a well-formed call
/// of an offered tool stays in the content; so does everything around the calls.
pub fn parse(text: &str, format: CallFormat, tools: &[Tool]) -> ParsedOutput {
    let offered = |name: &str| tools.iter().any(|t| t.name == name);
    match format {
        CallFormat::Hermes => parse_hermes(text, &offered),
        CallFormat::Llama3 => parse_json_answer(text, &offered, &["<|python_tag|>"], ';'),
        CallFormat::Mistral => parse_json_answer(text, &offered, &["[TOOL_CALLS]"], '\0'),
    }
}

/// A JSON object's call: `name` and `arguments` (or `parameters`), an object or a string
/// holding one.
fn call_of(v: &Value, offered: &dyn Fn(&str) -> bool) -> Option<ParsedCall> {
    let o = v.as_object()?;
    let name = o.get("name")?.as_str()?;
    if !offered(name) {
        return None;
    }
    let arguments = match o.get("arguments").or_else(|| o.get("parameters")) {
        None => Value::Object(Map::new()),
        Some(Value::String(s)) => serde_json::from_str::<Value>(s)
            .ok()
            .filter(Value::is_object)?,
        Some(v @ Value::Object(_)) => v.clone(),
        Some(_) => return None,
    };
    Some(ParsedCall {
        name: name.to_string(),
        arguments,
    })
}

/// Hermes: every `<tool_call>…</tool_call>` block (an unclosed last one runs to the end)
/// whose body is a call; also inside a code fence the model put around it.
fn parse_hermes(text: &str, offered: &dyn Fn(&str) -> bool) -> ParsedOutput {
    const OPEN: &str = "<tool_call>";
    const CLOSE: &str = "</tool_call>";
    let mut out = ParsedOutput::default();
    let mut rest = text;
    while let Some(start) = rest.find(OPEN) {
        let body_start = start + OPEN.len();
        let (body, block_end) = match rest[body_start..].find(CLOSE) {
            Some(end) => (
                &rest[body_start..body_start + end],
                body_start + end + CLOSE.len(),
            ),
            None => (&rest[body_start..], rest.len()),
        };
        let json = strip_fence(body.trim());
        match serde_json::from_str::<Value>(json)
            .ok()
            .and_then(|v| call_of(&v, offered))
        {
            Some(call) => {
                out.content.push_str(&rest[..start]);
                out.calls.push(call);
            }
            None => out.content.push_str(&rest[..block_end]),
        }
        rest = &rest[block_end..];
    }
    out.content.push_str(rest);
    if !out.calls.is_empty() && out.content.trim().is_empty() {
        out.content.clear();
    }
    out
}

/// A bare JSON answer (Llama 3, Mistral): after an optional marker, the whole text (code
/// fence allowed) is one call, an array of calls, or calls separated by `separator`.
/// Anything else is content, whole.
fn parse_json_answer(
    text: &str,
    offered: &dyn Fn(&str) -> bool,
    markers: &[&str],
    separator: char,
) -> ParsedOutput {
    let mut body = text.trim();
    for m in markers {
        if let Some(after) = body.strip_prefix(m) {
            body = after.trim();
        }
    }
    let body = strip_fence(body);
    let calls_of = |v: &Value| -> Option<Vec<ParsedCall>> {
        match v {
            Value::Array(items) if !items.is_empty() => {
                items.iter().map(|i| call_of(i, offered)).collect()
            }
            Value::Object(_) => call_of(v, offered).map(|c| vec![c]),
            _ => None,
        }
    };
    let whole = serde_json::from_str::<Value>(body)
        .ok()
        .and_then(|v| calls_of(&v));
    let calls = whole.or_else(|| {
        (separator != '\0' && body.contains(separator))
            .then(|| {
                body.split(separator)
                    .map(|part| {
                        serde_json::from_str::<Value>(part.trim())
                            .ok()
                            .and_then(|v| call_of(&v, offered))
                    })
                    .collect::<Option<Vec<_>>>()
            })
            .flatten()
    });
    match calls {
        Some(calls) => ParsedOutput {
            content: String::new(),
            calls,
        },
        None => ParsedOutput {
            content: text.to_string(),
            calls: Vec::new(),
        },
    }
}

/// `s` without a Markdown code fence around it (```json … ```), if it has one.
fn strip_fence(s: &str) -> &str {
    let Some(inner) = s.strip_prefix("```") else {
        return s;
    };
    let inner = inner.strip_prefix("json").unwrap_or(inner);
    inner.strip_suffix("```").unwrap_or(inner).trim()
}

/// While streaming a chat answer that may hold calls: content flows until the text may
/// be starting a call, then the rest is held for [`parse`] at the end. What could still
/// become the opening of a call is held back, as a stop string's start is. The content
/// streamed plus [`CallStream::finish`]'s is the content [`parse`] reads from the whole.
#[derive(Debug)]
pub struct CallStream {
    format: CallFormat,
    text: String,
    /// Bytes of `text` already released as content.
    released: usize,
    flow: Flow,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Flow {
    /// A bare-JSON answer whose start does not yet say whether it is a call.
    Undecided,
    Content,
    /// A call may have started: nothing more is released.
    Call,
}

/// How a bare JSON answer (Llama 3, Mistral) may start.
const CALL_OPENINGS: [&str; 5] = ["{", "[", "<|python_tag|>", "[TOOL_CALLS]", "```"];

impl CallStream {
    pub fn new(format: CallFormat) -> CallStream {
        let flow = match format {
            CallFormat::Hermes => Flow::Content,
            CallFormat::Llama3 | CallFormat::Mistral => Flow::Undecided,
        };
        CallStream {
            format,
            text: String::new(),
            released: 0,
            flow,
        }
    }

    /// Takes `piece`; the content it releases.
    pub fn push(&mut self, piece: &str) -> String {
        const OPEN: &str = "<tool_call>";
        self.text.push_str(piece);
        match (self.format, self.flow) {
            (_, Flow::Call) => return String::new(),
            (CallFormat::Hermes, _) => {
                let pending = &self.text[self.released..];
                if let Some(i) = pending.find(OPEN) {
                    self.flow = Flow::Call;
                    return self.release(self.released + i);
                }
                let hold = partial_suffix(pending, OPEN);
                return self.release(self.text.len() - hold);
            }
            (_, Flow::Undecided) => {
                let lead = self.text.trim_start();
                if lead.is_empty() || CALL_OPENINGS.iter().any(|m| m.starts_with(lead)) {
                    return String::new();
                }
                if CALL_OPENINGS.iter().any(|m| lead.starts_with(m)) {
                    self.flow = Flow::Call;
                    return String::new();
                }
                self.flow = Flow::Content;
            }
            (_, Flow::Content) => {}
        }
        self.release(self.text.len())
    }

    fn release(&mut self, to: usize) -> String {
        let out = self.text[self.released..to].to_string();
        self.released = to;
        out
    }

    /// The end: the content not yet released, and the calls, read from the whole text.
    pub fn finish(&self, tools: &[Tool]) -> ParsedOutput {
        let parsed = parse(&self.text, self.format, tools);
        let sent = &self.text[..self.released];
        ParsedOutput {
            content: parsed
                .content
                .strip_prefix(sent)
                .unwrap_or_default()
                .to_string(),
            calls: parsed.calls,
        }
    }
}

/// Length of the longest suffix of `text` that begins `marker` (held back until the next
/// piece decides).
fn partial_suffix(text: &str, marker: &str) -> usize {
    (1..marker.len())
        .rev()
        .find(|&n| {
            text.len() >= n
                && text.is_char_boundary(text.len() - n)
                && marker.starts_with(&text[text.len() - n..])
        })
        .unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tools() -> Vec<Tool> {
        vec![
            Tool {
                name: "get_weather".into(),
                description: Some("Weather in a city".into()),
                parameters: json!({"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}),
                strict: false,
            },
            Tool {
                name: "add".into(),
                description: None,
                parameters: json!({"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}),
                strict: true,
            },
        ]
    }

    fn call(name: &str, arguments: Value) -> ParsedCall {
        ParsedCall {
            name: name.into(),
            arguments,
        }
    }

    #[test]
    fn formats_come_from_the_templates_markup() {
        assert_eq!(CallFormat::of("{{ '<tool_call>' }}"), CallFormat::Hermes);
        assert_eq!(
            CallFormat::of("{% if tools %}<|python_tag|>{% endif %}"),
            CallFormat::Llama3
        );
        assert_eq!(
            CallFormat::of("[AVAILABLE_TOOLS] [TOOL_CALLS]"),
            CallFormat::Mistral
        );
        assert_eq!(CallFormat::of("<|im_start|>"), CallFormat::Hermes);
    }

    /// Hermes / Qwen: the examples of Qwen 2.5's template — one call, parallel calls,
    /// text around them, a call in a code fence, malformed and unknown calls left as text.
    #[test]
    fn hermes_calls() {
        let t = tools();
        let one = "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Oslo\"}}\n</tool_call>";
        assert_eq!(
            parse(one, CallFormat::Hermes, &t),
            ParsedOutput {
                content: String::new(),
                calls: vec![call("get_weather", json!({"city": "Oslo"}))]
            }
        );
        let two = format!("Let me check.\n{one}\n<tool_call>\n{{\"name\": \"add\", \"arguments\": \"{{\\\"a\\\": 1, \\\"b\\\": 2}}\"}}\n</tool_call>");
        let p = parse(&two, CallFormat::Hermes, &t);
        assert_eq!(p.content, "Let me check.\n\n");
        assert_eq!(p.calls[1], call("add", json!({"a": 1, "b": 2})));
        let fenced = "<tool_call>\n```json\n{\"name\": \"add\", \"arguments\": {\"a\": 3}}\n```\n</tool_call>";
        assert_eq!(
            parse(fenced, CallFormat::Hermes, &t).calls,
            vec![call("add", json!({"a": 3}))]
        );
        for text in [
            "<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": }\n</tool_call>",
            "<tool_call>{\"name\": \"rm_rf\", \"arguments\": {}}</tool_call>",
            "I would call <tool_call> but no.",
            "plain text",
        ] {
            let p = parse(text, CallFormat::Hermes, &t);
            assert_eq!((p.content.as_str(), p.calls.len()), (text, 0), "{text}");
        }
        // Cut off inside the call (max_tokens): the unclosed block is read to the end.
        let cut = "<tool_call>\n{\"name\": \"add\", \"arguments\": {\"a\": 1}}";
        assert_eq!(parse(cut, CallFormat::Hermes, &t).calls.len(), 1);
    }

    /// Llama 3.1–3.3: the JSON answer of its template's instructions, `parameters` for the
    /// arguments; `<|python_tag|>`; several separated by `;`; prose is content.
    #[test]
    fn llama3_calls() {
        let t = tools();
        let p = parse(
            "{\"name\": \"add\", \"parameters\": {\"a\": 1, \"b\": 2}}",
            CallFormat::Llama3,
            &t,
        );
        assert_eq!(p.calls, vec![call("add", json!({"a": 1, "b": 2}))]);
        let p = parse(
            "<|python_tag|>{\"name\": \"get_weather\", \"parameters\": {\"city\": \"Rome\"}}; {\"name\": \"add\", \"parameters\": {}}",
            CallFormat::Llama3,
            &t,
        );
        assert_eq!(p.calls.len(), 2);
        let prose = "The answer is {not a call}.";
        assert_eq!(parse(prose, CallFormat::Llama3, &t).content, prose);
    }

    /// Mistral: `[TOOL_CALLS]` and an array.
    #[test]
    fn mistral_calls() {
        let t = tools();
        let p = parse(
            "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": {\"a\": 1}}, {\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}]",
            CallFormat::Mistral,
            &t,
        );
        assert_eq!(p.calls.len(), 2);
        assert_eq!(p.content, "");
        let bad = "[TOOL_CALLS][{\"name\": \"add\", \"arguments\": 5}]";
        assert_eq!(parse(bad, CallFormat::Mistral, &t).calls.len(), 0);
    }

    /// Streaming: content flows until a call may start; a marker split across pieces is
    /// held back; the end gives the calls and no content twice.
    #[test]
    fn streams_release_content_and_hold_calls() {
        let t = tools();
        let mut s = CallStream::new(CallFormat::Hermes);
        let pieces = [
            "Let me ",
            "check.\n<tool",
            "_call>\n{\"name\": \"add\", ",
            "\"arguments\": {\"a\": 1}}\n</tool_call>",
        ];
        let released: String = pieces.iter().map(|p| s.push(p)).collect();
        assert_eq!(released, "Let me check.\n");
        let end = s.finish(&t);
        assert_eq!(end.calls, vec![call("add", json!({"a": 1}))]);
        assert_eq!(end.content, "");
        let whole = parse(&pieces.concat(), CallFormat::Hermes, &t);
        assert_eq!(whole.content, format!("{released}{}", end.content));

        // A partial marker that turns out not to be one is released.
        let mut s = CallStream::new(CallFormat::Hermes);
        let released: String = ["a <to", "ol> b"].iter().map(|p| s.push(p)).collect();
        assert_eq!(released, "a <tool> b");
        assert_eq!(s.finish(&t).content, "");

        // Llama 3: prose streams, a JSON answer is held.
        let mut s = CallStream::new(CallFormat::Llama3);
        assert_eq!(s.push("The"), "The");
        assert_eq!(s.push(" sky"), " sky");
        let mut s = CallStream::new(CallFormat::Llama3);
        assert_eq!(s.push("{\"name\""), "");
        assert_eq!(s.push(": \"add\", \"parameters\": {}}"), "");
        assert_eq!(s.finish(&t).calls.len(), 1);
    }

    #[test]
    fn grammars_name_the_chosen_functions() {
        let t = tools();
        let g = grammar(
            &t,
            &ToolChoice::Function("add".into()),
            false,
            CallFormat::Hermes,
        )
        .unwrap()
        .unwrap();
        assert!(
            g.contains("<tool_call>")
                && g.contains("\"const\":\"add\"")
                && !g.contains("get_weather")
        );
        assert!(grammar(&t, &ToolChoice::Auto, true, CallFormat::Hermes)
            .unwrap()
            .is_none());
        assert!(grammar(
            &t,
            &ToolChoice::Function("nope".into()),
            true,
            CallFormat::Hermes
        )
        .is_err());
        assert!(grammar(&[], &ToolChoice::Required, true, CallFormat::Hermes).is_err());
    }
}
