//! Chat formatting with the model's own Jinja template (`tokenizer.chat_template`).
//!
//! Templates are written for Python's jinja2 as transformers runs it, so the environment
//! here copies that setup: `trim_blocks` and `lstrip_blocks` on, loop controls, Python
//! string methods (`.strip()`, `.startswith()` ... through minijinja-contrib's pycompat),
//! `raise_exception(msg)`, `strftime_now(fmt)`, and a `tojson` that writes JSON the way
//! Python's `json.dumps` does (`", "` / `": "` separators, no HTML escaping, key order
//! kept). A file without a template gets ChatML.

use std::fmt::Write as _;
use std::sync::Arc;

use kiln_core::{Error, Result};
use minijinja::value::{Kwargs, Value, ValueKind};
use minijinja::{context, Environment, ErrorKind};
use serde::Serialize;

use crate::gguf::{GgufFile, GgufValue};

/// ChatML, used when the file carries no template.
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}";

const TEMPLATE_NAME: &str = "chat_template";

/// One turn of a conversation.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct ChatMessage {
    /// `system`, `user`, `assistant`, `tool` (whatever roles the template knows).
    pub role: String,
    pub content: String,
    /// An assistant turn's tool calls (templates read `message.tool_calls`).
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub tool_calls: Vec<ToolCall>,
    /// A `tool` turn's answer is to this call.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> ChatMessage {
        ChatMessage {
            role: role.into(),
            content: content.into(),
            tool_calls: Vec::new(),
            tool_call_id: None,
        }
    }
}

/// A call of a function tool, as chat templates read it: `{"id", "type": "function",
/// "function": {"name", "arguments"}}` with the arguments an object (templates write them
/// with `tojson`), as transformers and llama.cpp hand them over.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ToolCall {
    pub id: String,
    pub name: String,
    pub arguments: serde_json::Value,
}

impl Serialize for ToolCall {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        serde_json::json!({
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        })
        .serialize(s)
    }
}

pub mod memory;

/// A compiled chat template plus the special-token strings it may reference. Clones share
/// the compiled template (and whether a render of it was stopped at its bounds).
#[derive(Clone)]
pub struct ChatTemplate {
    /// Shared with render threads (see [`memory::bounded`]).
    env: Arc<Environment<'static>>,
    /// Why an earlier render of this template was stopped at its memory or time bound, if
    /// one was: later renders are refused at once, so a template that blows its bounds
    /// strands at most one parked render thread (and its memory) per load.
    exhausted: Arc<std::sync::Mutex<Option<String>>>,
    source: String,
    bos_token: String,
    eos_token: String,
    is_fallback: bool,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("source", &self.source)
            .field("bos_token", &self.bos_token)
            .field("eos_token", &self.eos_token)
            .field("is_fallback", &self.is_fallback)
            .finish()
    }
}

fn template_error(e: minijinja::Error) -> Error {
    // The detail carries the template's own wording (e.g. a raise_exception message).
    let mut msg = e.to_string();
    if let Some(detail) = e.detail() {
        if !msg.contains(detail) {
            let _ = write!(msg, " ({detail})");
        }
    }
    Error::Tokenizer(format!("chat template: {msg}"))
}

/// Limits on rendering a chat template. A template comes from the model file and is code
/// from an untrusted source: it may loop for ever, recurse, or build gigabytes of text.
pub mod limits {
    /// Template instructions one render may execute (a 1,000-message ChatML conversation
    /// takes about 30,000).
    pub const FUEL: u64 = 20_000_000;
    /// Nesting depth of loops, conditions, macros and includes.
    pub const RECURSION: usize = 100;
    /// Bytes of text one render may produce.
    pub const OUTPUT_BYTES: usize = 32 << 20;
    /// Live bytes one render may hold, where [`super::memory::GuardedAlloc`] is the
    /// program's allocator (the `kiln` binary's).
    pub const MEMORY_BYTES: usize = 256 << 20;
    /// Wall time one render may take, where the same allocator is installed (a 1,000-message
    /// conversation renders in milliseconds).
    pub const RENDER_TIME: std::time::Duration = std::time::Duration::from_secs(10);
}

/// A writer that refuses to grow past `limit` bytes.
struct Bounded {
    out: Vec<u8>,
    limit: usize,
}

impl std::io::Write for Bounded {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        if self.out.len() + buf.len() > self.limit {
            return Err(std::io::Error::other(format!(
                "the rendered text exceeds {} bytes",
                self.limit
            )));
        }
        self.out.extend_from_slice(buf);
        Ok(buf.len())
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

impl ChatTemplate {
    /// Compiles `source`; syntax errors come back as [`Error::Tokenizer`].
    pub fn new(
        source: impl Into<String>,
        bos_token: impl Into<String>,
        eos_token: impl Into<String>,
    ) -> Result<ChatTemplate> {
        let source = source.into();
        let mut env = Environment::new();
        env.set_trim_blocks(true);
        env.set_lstrip_blocks(true);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.set_fuel(Some(limits::FUEL));
        env.set_recursion_limit(limits::RECURSION);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_filter("tojson", tojson);
        env.add_template_owned(TEMPLATE_NAME, source.clone())
            .map_err(template_error)?;
        Ok(ChatTemplate {
            env: Arc::new(env),
            exhausted: Arc::default(),
            source,
            bos_token: bos_token.into(),
            eos_token: eos_token.into(),
            is_fallback: false,
        })
    }

    /// ChatML with the given special-token strings.
    pub fn chatml(bos_token: impl Into<String>, eos_token: impl Into<String>) -> ChatTemplate {
        let mut t = ChatTemplate::new(CHATML_TEMPLATE, bos_token, eos_token)
            .expect("the ChatML template compiles");
        t.is_fallback = true;
        t
    }

    /// The file's `tokenizer.chat_template`, or ChatML when it has none. BOS/EOS strings
    /// come from the token ids in the tokenizer metadata (empty when absent).
    pub fn from_gguf(file: &GgufFile) -> Result<ChatTemplate> {
        let tokens = file.get_string_array("tokenizer.ggml.tokens");
        let piece = |key: &str| -> String {
            file.get_u64(key)
                .and_then(|id| tokens.and_then(|t| t.get(usize::try_from(id).ok()?)))
                .cloned()
                .unwrap_or_default()
        };
        let (bos, eos) = (
            piece("tokenizer.ggml.bos_token_id"),
            piece("tokenizer.ggml.eos_token_id"),
        );
        match file.typed("tokenizer.chat_template", "string", GgufValue::as_str)? {
            Some(src) => ChatTemplate::new(src, bos, eos),
            None => Ok(ChatTemplate::chatml(bos, eos)),
        }
    }

    /// The Jinja source.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether this is the ChatML fallback rather than the file's own template.
    pub fn is_fallback(&self) -> bool {
        self.is_fallback
    }

    /// Renders the conversation. With `add_generation_prompt`, the text ends with the
    /// opening of an assistant turn, ready for the model to continue.
    ///
    /// Rendering is bounded ([`limits`]): a template that runs out of instructions, nests
    /// too deep or writes too much text is an error naming the limit, never a hang.
    pub fn render(&self, messages: &[ChatMessage], add_generation_prompt: bool) -> Result<String> {
        self.render_with_tools(messages, &[], add_generation_prompt)
    }

    /// Whether the template reads the `tools` it is given (a template that does not ignores
    /// them: the caller describes its tools in a message instead).
    pub fn reads_tools(&self) -> bool {
        self.source.contains("tools")
    }

    /// [`ChatTemplate::render`] with function `tools` (OpenAI's `tools` entries) in the
    /// template's `tools` variable; none leaves it undefined.
    pub fn render_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<String> {
        let env = self.env.clone();
        let messages = messages.to_vec();
        let tools = tools.to_vec();
        let (bos, eos) = (self.bos_token.clone(), self.eos_token.clone());
        if let Some(why) = &*self.exhausted.lock().unwrap_or_else(|p| p.into_inner()) {
            return Err(Error::Tokenizer(format!(
                "chat template: refused: an earlier render was stopped ({why})"
            )));
        }
        let bounded = memory::bounded(limits::MEMORY_BYTES, limits::RENDER_TIME, move || {
            render_with(&env, &messages, &tools, add_generation_prompt, &bos, &eos)
        });
        match bounded {
            Ok(result) => result,
            Err(memory::LimitHit(e)) => {
                *self.exhausted.lock().unwrap_or_else(|p| p.into_inner()) = Some(e.to_string());
                Err(e)
            }
        }
    }
}

/// A rendered chat prompt and where in it each message's content lies (byte ranges, in
/// order): what [`Tokenizer::encode_chat`](crate::tokenizer::Tokenizer::encode_chat) reads
/// as text whatever control-token spellings it holds.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChatPrompt {
    pub text: String,
    pub content: Vec<std::ops::Range<usize>>,
}

/// A stand-in for message `i`'s content while finding where the template puts it: private-
/// use characters no template filter changes (no case, no whitespace) around the index.
fn placeholder(i: usize) -> String {
    format!("\u{F0000}{i}\u{F0001}")
}

impl ChatTemplate {
    /// [`ChatTemplate::render`], and where the messages' contents lie in the text, so that
    /// only the template's own markup becomes control tokens. Found by rendering again
    /// with a placeholder per content and putting the contents back in: when that gives
    /// the text the template renders (as given, or trimmed, as Llama 3's template trims
    /// them), the placeholders' places are the contents'. A template that changes content
    /// otherwise, or branches on it, gets that second text (the template's markup with the
    /// contents as given): content never becomes markup.
    pub fn render_prompt(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<ChatPrompt> {
        self.render_prompt_with_tools(messages, &[], add_generation_prompt)
    }

    /// [`ChatTemplate::render_prompt`] with function `tools` (see
    /// [`ChatTemplate::render_with_tools`]). Tool calls and tool descriptions are the
    /// template's markup; only the messages' contents are read as text.
    pub fn render_prompt_with_tools(
        &self,
        messages: &[ChatMessage],
        tools: &[serde_json::Value],
        add_generation_prompt: bool,
    ) -> Result<ChatPrompt> {
        let text = self.render_with_tools(messages, tools, add_generation_prompt)?;
        let stand_ins: Vec<ChatMessage> = messages
            .iter()
            .enumerate()
            .map(|(i, m)| ChatMessage {
                content: placeholder(i),
                ..m.clone()
            })
            .collect();
        let marked = self.render_with_tools(&stand_ins, tools, add_generation_prompt)?;
        let fill = |content: &dyn Fn(&ChatMessage) -> &str| -> ChatPrompt {
            let mut out = ChatPrompt {
                text: String::with_capacity(text.len()),
                content: Vec::new(),
            };
            let (open, close) = ('\u{F0000}', '\u{F0001}');
            let mut rest = marked.as_str();
            while let Some(start) = rest.find(open) {
                let after = &rest[start + open.len_utf8()..];
                let Some(end) = after.find(close) else {
                    break;
                };
                out.text.push_str(&rest[..start]);
                let whole = start + open.len_utf8() + end + close.len_utf8();
                match after[..end]
                    .parse::<usize>()
                    .ok()
                    .and_then(|i| messages.get(i))
                {
                    Some(m) => {
                        let c = content(m);
                        out.content.push(out.text.len()..out.text.len() + c.len());
                        out.text.push_str(c);
                    }
                    None => out.text.push_str(&rest[start..whole]),
                }
                rest = &rest[whole..];
            }
            out.text.push_str(rest);
            out
        };
        let as_given = fill(&|m| m.content.as_str());
        if as_given.text == text {
            return Ok(as_given);
        }
        let trimmed = fill(&|m| m.content.trim());
        if trimmed.text == text {
            return Ok(trimmed);
        }
        Ok(as_given)
    }
}

fn render_with(
    env: &Environment<'static>,
    messages: &[ChatMessage],
    tools: &[serde_json::Value],
    add_generation_prompt: bool,
    bos_token: &str,
    eos_token: &str,
) -> Result<String> {
    {
        let tmpl = env.get_template(TEMPLATE_NAME).map_err(template_error)?;
        let mut out = Bounded {
            out: Vec::new(),
            limit: limits::OUTPUT_BYTES,
        };
        let tools = match tools {
            [] => Value::UNDEFINED,
            some => Value::from_serialize(some),
        };
        let ctx = context! {
            messages => messages,
            tools => tools,
            add_generation_prompt => add_generation_prompt,
            bos_token => bos_token,
            eos_token => eos_token,
        };
        match tmpl.render_captured_to(ctx, &mut out) {
            Ok(_) => {}
            Err(e) if e.kind() == ErrorKind::OutOfFuel => {
                return Err(Error::Tokenizer(format!(
                    "chat template: stopped after {} instructions (the limit for one render); the template loops too long",
                    limits::FUEL
                )))
            }
            Err(e) if e.kind() == ErrorKind::WriteFailure => {
                return Err(Error::Tokenizer(format!(
                    "chat template: the rendered text exceeds {} bytes (the limit for one render)",
                    limits::OUTPUT_BYTES
                )))
            }
            Err(e) => return Err(template_error(e)),
        }
        String::from_utf8(out.out)
            .map_err(|_| Error::Tokenizer("chat template: rendered text is not UTF-8".into()))
    }
}

/// `raise_exception(msg)`: templates use it to reject conversations they cannot format.
fn raise_exception(msg: String) -> std::result::Result<Value, minijinja::Error> {
    Err(minijinja::Error::new(ErrorKind::InvalidOperation, msg))
}

/// `strftime_now(fmt)`: the current UTC date/time; supports the directives chat templates
/// use (`%Y %y %m %d %e %b %B %a %A %H %M %S %j %%`).
fn strftime_now(fmt: String) -> std::result::Result<String, minijinja::Error> {
    let secs = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    strftime_utc(&fmt, secs)
}

const MONTHS: [&str; 12] = [
    "January",
    "February",
    "March",
    "April",
    "May",
    "June",
    "July",
    "August",
    "September",
    "October",
    "November",
    "December",
];
const WEEKDAYS: [&str; 7] = [
    "Monday",
    "Tuesday",
    "Wednesday",
    "Thursday",
    "Friday",
    "Saturday",
    "Sunday",
];

/// Formats a Unix time (UTC). Days-to-civil conversion from Howard Hinnant's algorithm.
fn strftime_utc(fmt: &str, unix_secs: i64) -> std::result::Result<String, minijinja::Error> {
    let days = unix_secs.div_euclid(86_400);
    let sod = unix_secs.rem_euclid(86_400);
    let z = days + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097);
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy_mar = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy_mar + 2) / 153;
    let day = doy_mar - (153 * mp + 2) / 5 + 1;
    let month = if mp < 10 { mp + 3 } else { mp - 9 };
    let year = yoe + era * 400 + i64::from(month <= 2);
    let leap = (year % 4 == 0 && year % 100 != 0) || year % 400 == 0;
    let cumulative = [0, 31, 59, 90, 120, 151, 181, 212, 243, 273, 304, 334];
    let yday = cumulative[(month - 1) as usize] + day + i64::from(leap && month > 2);
    let weekday = (days + 3).rem_euclid(7) as usize; // 1970-01-01 was a Thursday.
    let month_name = MONTHS[(month - 1) as usize];

    let mut out = String::with_capacity(fmt.len() + 16);
    let mut chars = fmt.chars();
    while let Some(c) = chars.next() {
        if c != '%' {
            out.push(c);
            continue;
        }
        let directive = chars.next();
        let _ = match directive {
            Some('Y') => write!(out, "{year}"),
            Some('y') => write!(out, "{:02}", year.rem_euclid(100)),
            Some('m') => write!(out, "{month:02}"),
            Some('d') => write!(out, "{day:02}"),
            Some('e') => write!(out, "{day:2}"),
            Some('b') => write!(out, "{}", &month_name[..3]),
            Some('B') => write!(out, "{month_name}"),
            Some('a') => write!(out, "{}", &WEEKDAYS[weekday][..3]),
            Some('A') => write!(out, "{}", WEEKDAYS[weekday]),
            Some('H') => write!(out, "{:02}", sod / 3600),
            Some('M') => write!(out, "{:02}", sod / 60 % 60),
            Some('S') => write!(out, "{:02}", sod % 60),
            Some('j') => write!(out, "{yday:03}"),
            Some('%') => write!(out, "%"),
            other => {
                return Err(minijinja::Error::new(
                    ErrorKind::InvalidOperation,
                    format!(
                        "strftime_now: unsupported directive %{}",
                        other.map(String::from).unwrap_or_default()
                    ),
                ))
            }
        };
    }
    Ok(out)
}

/// `tojson` as transformers defines it: `json.dumps(value, ensure_ascii=False,
/// indent=indent)`. minijinja's built-in escapes `<`, `>`, `&`, `'` for HTML, which would
/// change what the model sees.
fn tojson(value: Value, kwargs: Kwargs) -> std::result::Result<String, minijinja::Error> {
    let indent: Option<usize> = kwargs.get("indent")?;
    kwargs.assert_all_used()?;
    let mut out = String::new();
    write_json(&mut out, &value, indent, 0)?;
    Ok(out)
}

fn write_json(
    out: &mut String,
    v: &Value,
    indent: Option<usize>,
    depth: usize,
) -> std::result::Result<(), minijinja::Error> {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    let bad =
        |what: &str| minijinja::Error::new(ErrorKind::InvalidOperation, format!("tojson: {what}"));
    match v.kind() {
        ValueKind::Undefined | ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if let Ok(i) = i64::try_from(v.clone()) {
                let _ = write!(out, "{i}");
            } else {
                let f = f64::try_from(v.clone()).map_err(|_| bad("number out of range"))?;
                if !f.is_finite() {
                    // Python writes NaN/Infinity, which is not JSON but what the model saw.
                    out.push_str(if f.is_nan() {
                        "NaN"
                    } else if f > 0.0 {
                        "Infinity"
                    } else {
                        "-Infinity"
                    });
                } else if f.fract() == 0.0 && f.abs() < 1e16 {
                    let _ = write!(out, "{f:.1}");
                } else {
                    let _ = write!(out, "{f}");
                }
            }
        }
        ValueKind::String | ValueKind::Bytes => {
            let s = v
                .as_str()
                .map(str::to_string)
                .unwrap_or_else(|| v.to_string());
            out.push_str(&serde_json::to_string(&s).map_err(|e| bad(&e.to_string()))?);
        }
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<Value> = v.try_iter()?.collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_json(out, item, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<Value> = v.try_iter()?.collect();
            if keys.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            out.push('{');
            for (i, key) in keys.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                let name = key
                    .as_str()
                    .map(str::to_string)
                    .unwrap_or_else(|| key.to_string());
                out.push_str(&serde_json::to_string(&name).map_err(|e| bad(&e.to_string()))?);
                out.push_str(": ");
                write_json(out, &v.get_item(key)?, indent, depth + 1)?;
            }
            newline(out, depth);
            out.push('}');
        }
        _ => return Err(bad(&format!("cannot serialise {}", v.kind()))),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn civil_dates() {
        assert_eq!(
            strftime_utc("%Y-%m-%d %H:%M:%S %a %j", 0).unwrap(),
            "1970-01-01 00:00:00 Thu 001"
        );
        // 2024-02-29 12:34:56 UTC, a Thursday, day 60 of a leap year.
        assert_eq!(
            strftime_utc("%d %b %Y %A %j", 1_709_210_096).unwrap(),
            "29 Feb 2024 Thursday 060"
        );
        assert!(strftime_utc("%Q", 0).is_err());
    }
}
