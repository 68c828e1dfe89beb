//! kiln's C API (`include/kiln.h`, generated from this file by cbindgen): open a model,
//! see which backends can run it and why the others cannot, load it on one, tokenize,
//! build chat prompts with the model's template, and generate with a callback that
//! receives the text as it becomes final and may stop the generation.
//!
//! Conventions, as a C host expects them:
//! - Every function returns a [`KilnStatus`]; on an error, [`kiln_last_error`] gives the
//!   message (per thread, until that thread's next kiln call). No Rust panic crosses the
//!   boundary: a panic is `KILN_STATUS_PANIC` with its message.
//! - Pointers the host passes may be null only where a function says so; a null where one
//!   is required is `KILN_STATUS_INVALID_ARGUMENT`, never a crash. Strings are UTF-8 and
//!   NUL-terminated.
//! - Objects are opaque and freed by their own function; strings kiln returns are freed
//!   with [`kiln_string_free`].
//! - A `KilnModel` may be used from one thread at a time (its generations run on the
//!   calling thread); different models are independent.
//! - [`KILN_C_API_VERSION`] is `major << 16 | minor`, as the plugin ABI's: additions bump
//!   the minor, anything else the major. Structs a host fills carry their `struct_size`.

use std::cell::RefCell;
use std::ffi::{c_char, c_void, CStr, CString};
use std::panic::{catch_unwind, AssertUnwindSafe};
use std::path::Path;

use kiln::core::{Error, LoadOptions, SamplingParams};
use kiln::formats::chat::ChatTemplate;
use kiln::formats::tokenizer::Tokenizer;
use kiln::{BatchEvent, BatchOptions, Batcher, ChatMessage, Engine, Finish, GenerateParams, Model};

/// `major << 16 | minor` of this API (see [`kiln_c_api_version`]).
pub const KILN_C_API_VERSION: u32 = 1 << 16;

/// What a call did. Hosts branch on these; [`kiln_last_error`] has the words.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KilnStatus {
    Ok = 0,
    /// A null or malformed argument, or a value out of range.
    InvalidArgument = 1,
    /// The model file is malformed.
    Format = 2,
    /// The model uses an architecture, weight type or feature kiln does not run.
    Unsupported = 3,
    /// Prompt plus generation do not fit the context.
    ContextExceeded = 4,
    /// No backend can run the model (or the one named cannot).
    NoBackend = 5,
    /// A backend failed.
    Backend = 6,
    OutOfMemory = 7,
    /// Reading a file failed.
    Io = 8,
    Tokenizer = 9,
    /// An output buffer is too small; the call said how much it needs.
    BufferTooSmall = 10,
    /// A Rust panic was caught at the boundary (a kiln bug; the message says where).
    Panic = 11,
    Other = 12,
}

/// Why a generation ended.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KilnFinish {
    /// An end-of-sequence token or a stop string.
    Stop = 0,
    /// `max_tokens` reached.
    Length = 1,
    /// The context is full.
    ContextFull = 2,
    /// The callback returned false.
    Cancelled = 3,
}

/// A model loaded on a backend (opaque).
pub struct KilnModel {
    engine: Engine,
    backend: CString,
}

/// One chat message: `role` is `system`, `user`, `assistant` (whatever the model's
/// template knows); `content` is read as text, never as control tokens.
#[repr(C)]
pub struct KilnChatMessage {
    pub role: *const c_char,
    pub content: *const c_char,
}

/// How to generate. Start from [`kiln_generate_params_default`] and change fields.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnGenerateParams {
    /// `sizeof(KilnGenerateParams)` as the host was compiled with it.
    pub struct_size: u32,
    /// Tokens to generate at most.
    pub max_tokens: u32,
    /// 0 is greedy.
    pub temperature: f32,
    /// 0 keeps every token.
    pub top_k: u32,
    pub top_p: f32,
    pub min_p: f32,
    /// 1 is none.
    pub repeat_penalty: f32,
    pub seed: u64,
    /// Stop at the model's end-of-sequence tokens (true by default).
    pub stop_on_eos: bool,
}

/// What a generation did.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnGenerationResult {
    pub prompt_tokens: u32,
    /// Prompt tokens prefilled (the rest were cached from an earlier call).
    pub prefilled_tokens: u32,
    pub generated_tokens: u32,
    pub finish: KilnFinish,
    pub prompt_tokens_per_second: f64,
    pub generated_tokens_per_second: f64,
}

/// Receives each piece of text as it becomes final (UTF-8, `len` bytes, not
/// NUL-terminated; never half a character); returns false to stop the generation.
pub type KilnTextCallback =
    Option<unsafe extern "C" fn(text: *const c_char, len: usize, user: *mut c_void) -> bool>;

thread_local! {
    static LAST_ERROR: RefCell<CString> = RefCell::new(CString::default());
}

fn set_error(message: &str) {
    let c = CString::new(message.replace('\0', " ")).unwrap_or_default();
    LAST_ERROR.with(|e| *e.borrow_mut() = c);
}

fn status_of(e: &Error) -> KilnStatus {
    match e {
        Error::Io(_) => KilnStatus::Io,
        Error::Format(_) | Error::InvalidShape(_) | Error::SavedLogits { .. } => KilnStatus::Format,
        Error::Unsupported(_) => KilnStatus::Unsupported,
        Error::NoBackend(_) => KilnStatus::NoBackend,
        Error::Backend { .. } | Error::Plugin { .. } | Error::NonFiniteLogits { .. } => {
            KilnStatus::Backend
        }
        Error::OutOfMemory(_) => KilnStatus::OutOfMemory,
        Error::Tokenizer(_) => KilnStatus::Tokenizer,
        Error::InvalidArgument(_) => KilnStatus::InvalidArgument,
        Error::ContextExceeded { .. } | Error::KvCacheFull { .. } => KilnStatus::ContextExceeded,
        _ => KilnStatus::Other,
    }
}

/// Runs `f` with panics caught and errors turned into a status and the thread's message.
fn guard(f: impl FnOnce() -> Result<(), (KilnStatus, String)>) -> KilnStatus {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(Ok(())) => {
            set_error("");
            KilnStatus::Ok
        }
        Ok(Err((status, message))) => {
            set_error(&message);
            status
        }
        Err(panic) => {
            let what = panic
                .downcast_ref::<&str>()
                .map(|s| s.to_string())
                .or_else(|| panic.downcast_ref::<String>().cloned())
                .unwrap_or_else(|| "a panic without a message".into());
            set_error(&format!("kiln panicked: {what}"));
            KilnStatus::Panic
        }
    }
}

fn kiln_err(e: Error) -> (KilnStatus, String) {
    (status_of(&e), e.to_string())
}

fn invalid(message: impl Into<String>) -> (KilnStatus, String) {
    (KilnStatus::InvalidArgument, message.into())
}

/// A required string argument.
///
/// # Safety
/// `p` is null or a NUL-terminated string that outlives the call.
unsafe fn string<'a>(p: *const c_char, what: &str) -> Result<&'a str, (KilnStatus, String)> {
    if p.is_null() {
        return Err(invalid(format!("{what} is null")));
    }
    // SAFETY: non-null, and the caller promises a NUL-terminated string that lives for
    // the call.
    unsafe { CStr::from_ptr(p) }
        .to_str()
        .map_err(|_| invalid(format!("{what} is not UTF-8")))
}

/// Writes `ids` to the host's buffer of `cap`, `*n_out` the count it needs.
///
/// # Safety
/// `out` is null or points to `cap` writable `u32`s; `n_out` is null or writable.
unsafe fn write_ids(
    ids: &[u32],
    out: *mut u32,
    cap: usize,
    n_out: *mut usize,
) -> Result<(), (KilnStatus, String)> {
    if n_out.is_null() {
        return Err(invalid("n_out is null"));
    }
    // SAFETY: checked non-null; the caller promises it is writable.
    unsafe { *n_out = ids.len() };
    if ids.len() > cap {
        return Err((
            KilnStatus::BufferTooSmall,
            format!("{} tokens do not fit a buffer of {cap}", ids.len()),
        ));
    }
    if !ids.is_empty() {
        if out.is_null() {
            return Err(invalid("the ids buffer is null"));
        }
        // SAFETY: `out` holds `cap` ≥ `ids.len()` writable u32s (the caller's promise) and
        // cannot overlap `ids`, which kiln owns.
        unsafe { std::ptr::copy_nonoverlapping(ids.as_ptr(), out, ids.len()) };
    }
    Ok(())
}

/// Tokenizes the host's `text` into its buffer (see [`kiln_tokenize`]).
///
/// # Safety
/// As [`kiln_tokenize`]'s arguments.
unsafe fn tokenize_into(
    tokenizer: &Tokenizer,
    text: *const c_char,
    add_special: bool,
    ids: *mut u32,
    cap: usize,
    n_out: *mut usize,
) -> Result<(), (KilnStatus, String)> {
    // SAFETY: the caller's promise.
    let text = unsafe { string(text, "text") }?;
    let bos = add_special && tokenizer.add_bos_default();
    let tokens = tokenizer.encode(text, bos, add_special).map_err(kiln_err)?;
    // SAFETY: the caller's promise about `ids`, `cap` and `n_out`.
    unsafe { write_ids(&tokens, ids, cap, n_out) }
}

/// A chat prompt of the host's `messages` into its buffer (see [`kiln_chat_prompt`]).
///
/// # Safety
/// As [`kiln_chat_prompt`]'s arguments.
unsafe fn chat_into(
    tokenizer: &Tokenizer,
    template: &ChatTemplate,
    messages: *const KilnChatMessage,
    n: usize,
    ids: *mut u32,
    cap: usize,
    n_out: *mut usize,
) -> Result<(), (KilnStatus, String)> {
    if messages.is_null() && n > 0 {
        return Err(invalid("messages is null"));
    }
    let list = match n {
        0 => &[][..],
        // SAFETY: `n` readable messages at `messages` (the caller's promise).
        _ => unsafe { std::slice::from_raw_parts(messages, n) },
    };
    let mut chat = Vec::with_capacity(n);
    for (i, msg) in list.iter().enumerate() {
        // SAFETY: the caller's promise about each message's strings.
        let role = unsafe { string(msg.role, &format!("messages[{i}].role")) }?;
        // SAFETY: as above.
        let content = unsafe { string(msg.content, &format!("messages[{i}].content")) }?;
        chat.push(ChatMessage::new(role, content));
    }
    let prompt = template.render_prompt(&chat, true).map_err(kiln_err)?;
    let tokens = tokenizer
        .encode_chat(&prompt.text, tokenizer.add_bos_default(), &prompt.content)
        .map_err(kiln_err)?;
    // SAFETY: the caller's promise about `ids`, `cap` and `n_out`.
    unsafe { write_ids(&tokens, ids, cap, n_out) }
}

/// This API's version, `major << 16 | minor`: a host built against another major must not
/// call the others.
#[no_mangle]
pub extern "C" fn kiln_c_api_version() -> u32 {
    KILN_C_API_VERSION
}

/// The message of this thread's last failed call ("" after a success). Valid until this
/// thread's next kiln call; do not free it.
#[no_mangle]
pub extern "C" fn kiln_last_error() -> *const c_char {
    LAST_ERROR.with(|e| e.borrow().as_ptr())
}

/// Frees a string kiln returned. Null is allowed.
///
/// # Safety
/// `s` is null or a string from a kiln function, not freed before.
#[no_mangle]
pub unsafe extern "C" fn kiln_string_free(s: *mut c_char) {
    if !s.is_null() {
        // SAFETY: it came from `CString::into_raw` in this library (the caller's promise).
        drop(unsafe { CString::from_raw(s) });
    }
}

/// Every backend's verdict on the model at `path`, best first, as a JSON array (free it
/// with [`kiln_string_free`]): `{"name", "score"}` for those that can run it, `{"name",
/// "refused"}` with the reason for the others. Plugins from `KILN_PLUGIN_PATH` count.
///
/// # Safety
/// `path` is a NUL-terminated string; `json_out` is writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_backends_json(
    path: *const c_char,
    json_out: *mut *mut c_char,
) -> KilnStatus {
    guard(|| {
        // SAFETY: the caller's promise.
        let path = unsafe { string(path, "path") }?;
        if json_out.is_null() {
            return Err(invalid("json_out is null"));
        }
        let model = Model::open(Path::new(path)).map_err(kiln_err)?;
        let (registry, _) = kiln::registry_with_plugins(&[]);
        let verdicts: Vec<serde_json::Value> = registry
            .rank(&model.ir)
            .iter()
            .map(|c| match (c.score(), c.refusal()) {
                (Some(score), _) => serde_json::json!({"name": c.name, "score": score}),
                (None, why) => {
                    serde_json::json!({"name": c.name, "refused": why.unwrap_or_default()})
                }
            })
            .collect();
        let text = serde_json::Value::Array(verdicts).to_string();
        let c = CString::new(text).map_err(|_| invalid("a verdict holds a NUL byte"))?;
        // SAFETY: checked non-null; writable by the caller's promise.
        unsafe { *json_out = c.into_raw() };
        Ok(())
    })
}

/// Opens the model at `path` (GGUF or APR) and loads it on the backend named `backend`,
/// or on the best-scoring one when `backend` is null. `context` is the longest context
/// in tokens (0: the backend's default, at most the model's own).
///
/// # Safety
/// `path` is a NUL-terminated string; `backend` is null or one; `out` is writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_model_open(
    path: *const c_char,
    backend: *const c_char,
    context: u32,
    out: *mut *mut KilnModel,
) -> KilnStatus {
    guard(|| {
        // SAFETY: the caller's promise.
        let path = unsafe { string(path, "path") }?;
        let backend = match backend.is_null() {
            true => None,
            // SAFETY: non-null; the caller's promise.
            false => Some(unsafe { string(backend, "backend") }?),
        };
        if out.is_null() {
            return Err(invalid("out is null"));
        }
        let options = LoadOptions {
            max_context: context as usize,
            ..LoadOptions::default()
        };
        let engine = Engine::open(Path::new(path), backend, &options).map_err(kiln_err)?;
        let name = CString::new(engine.backend_name()).unwrap_or_default();
        let boxed = Box::new(KilnModel {
            engine,
            backend: name,
        });
        // SAFETY: checked non-null; writable by the caller's promise.
        unsafe { *out = Box::into_raw(boxed) };
        Ok(())
    })
}

/// Frees a model (its device memory too). Null is allowed.
///
/// # Safety
/// `model` is null or from [`kiln_model_open`], not freed before.
#[no_mangle]
pub unsafe extern "C" fn kiln_model_free(model: *mut KilnModel) {
    if !model.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: from `Box::into_raw` in `kiln_model_open` (the caller's promise).
            drop(unsafe { Box::from_raw(model) })
        }));
    }
}

/// The name of the backend the model runs on (owned by the model; do not free).
///
/// # Safety
/// `model` is from [`kiln_model_open`].
#[no_mangle]
pub unsafe extern "C" fn kiln_model_backend(model: *const KilnModel) -> *const c_char {
    match model.is_null() {
        true => std::ptr::null(),
        // SAFETY: a live model (the caller's promise).
        false => unsafe { &*model }.backend.as_ptr(),
    }
}

/// The model's vocabulary size (0 for a null model).
///
/// # Safety
/// `model` is null or from [`kiln_model_open`].
#[no_mangle]
pub unsafe extern "C" fn kiln_model_vocab_size(model: *const KilnModel) -> u32 {
    match model.is_null() {
        true => 0,
        // SAFETY: a live model (the caller's promise).
        false => unsafe { &*model }.engine.model.ir.config.vocab_size as u32,
    }
}

/// Tokenizes `text` into `ids` (room for `cap`); `*n_out` is the count, also when the
/// buffer is too small (`KILN_STATUS_BUFFER_TOO_SMALL`: call again with that much).
/// `add_special`: the BOS token where the model wants one, and special-token spellings
/// read as those tokens.
///
/// # Safety
/// `model` from [`kiln_model_open`]; `text` NUL-terminated; `ids` holds `cap` `u32`s (may
/// be null when `cap` is 0); `n_out` writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_tokenize(
    model: *const KilnModel,
    text: *const c_char,
    add_special: bool,
    ids: *mut u32,
    cap: usize,
    n_out: *mut usize,
) -> KilnStatus {
    guard(|| {
        if model.is_null() {
            return Err(invalid("model is null"));
        }
        // SAFETY: a live model (the caller's promise).
        let m = &unsafe { &*model }.engine.model;
        // SAFETY: the caller's promise about `text`, `ids`, `cap` and `n_out`.
        unsafe { tokenize_into(&m.tokenizer, text, add_special, ids, cap, n_out) }
    })
}

/// The prompt of a chat (`messages`, `n` of them) ready for the assistant's turn: the
/// model's template with its markup as control tokens and every content as text. Output
/// as for [`kiln_tokenize`].
///
/// # Safety
/// `model` from [`kiln_model_open`]; `messages` holds `n` messages of NUL-terminated
/// strings; `ids`, `cap`, `n_out` as for [`kiln_tokenize`].
#[no_mangle]
pub unsafe extern "C" fn kiln_chat_prompt(
    model: *const KilnModel,
    messages: *const KilnChatMessage,
    n: usize,
    ids: *mut u32,
    cap: usize,
    n_out: *mut usize,
) -> KilnStatus {
    guard(|| {
        if model.is_null() || (messages.is_null() && n > 0) {
            return Err(invalid("model or messages is null"));
        }
        // SAFETY: a live model (the caller's promise).
        let m = &unsafe { &*model }.engine.model;
        // SAFETY: the caller's promise about `messages`, `ids`, `cap` and `n_out`.
        unsafe { chat_into(&m.tokenizer, &m.chat_template, messages, n, ids, cap, n_out) }
    })
}

/// The defaults: 128 tokens, llama.cpp's sampler (temperature 0.8, top-k 40, top-p 0.95,
/// min-p 0.05), no repetition penalty, seed 0, stop at end-of-sequence tokens.
#[no_mangle]
pub extern "C" fn kiln_generate_params_default() -> KilnGenerateParams {
    let s = SamplingParams::default();
    KilnGenerateParams {
        struct_size: std::mem::size_of::<KilnGenerateParams>() as u32,
        max_tokens: 128,
        temperature: s.temperature,
        top_k: s.top_k as u32,
        top_p: s.top_p,
        min_p: s.min_p,
        repeat_penalty: 1.0,
        seed: 0,
        stop_on_eos: true,
    }
}

/// Generates from `prompt` (`n` token ids): each piece of text goes to `callback` (which
/// may be null, and may return false to stop: then `KILN_FINISH_CANCELLED`); `result` (may
/// be null) gets the counts and the finish. Each call prefills its whole prompt (no KV
/// cache is kept between calls in this version).
///
/// # Safety
/// `model` from [`kiln_model_open`]; `prompt` holds `n` ids; `params` is null (the
/// defaults) or a [`KilnGenerateParams`]; `result` null or writable; `callback` is called
/// on this thread with `user`.
#[no_mangle]
pub unsafe extern "C" fn kiln_generate(
    model: *mut KilnModel,
    prompt: *const u32,
    n: usize,
    params: *const KilnGenerateParams,
    callback: KilnTextCallback,
    user: *mut c_void,
    result: *mut KilnGenerationResult,
) -> KilnStatus {
    guard(|| {
        if model.is_null() || (prompt.is_null() && n > 0) {
            return Err(invalid("model or prompt is null"));
        }
        // SAFETY: the caller's promise about `params`.
        let mut params = unsafe { generate_params(params) }?;
        // SAFETY: a live model, used by this thread alone (the caller's promise).
        let model = unsafe { &mut *model };
        let ids = match n {
            0 => &[][..],
            // SAFETY: `n` readable ids (the caller's promise).
            _ => unsafe { std::slice::from_raw_parts(prompt, n) },
        };
        let cancel = kiln::CancelToken::new();
        params.cancel = Some(cancel.clone());
        let mut session = model.engine.session().map_err(kiln_err)?;
        let g = session
            .generate(ids, &params, |text| {
                if let Some(f) = callback {
                    // SAFETY: the host's callback with the host's `user`; `text` lives for
                    // the call.
                    let go_on = unsafe { f(text.as_ptr().cast(), text.len(), user) };
                    if !go_on {
                        cancel.cancel();
                    }
                }
            })
            .map_err(kiln_err)?;
        if !result.is_null() {
            let r = KilnGenerationResult {
                prompt_tokens: g.prompt_ids.len() as u32,
                prefilled_tokens: g.prefilled as u32,
                generated_tokens: g.ids.len() as u32,
                finish: finish_of(g.finish),
                prompt_tokens_per_second: g.prompt_tokens_per_sec(),
                generated_tokens_per_second: g.decode_tokens_per_sec(),
            };
            // SAFETY: non-null and writable (the caller's promise).
            unsafe { *result = r };
        }
        Ok(())
    })
}

fn finish_of(f: Finish) -> KilnFinish {
    match f {
        Finish::Stop => KilnFinish::Stop,
        Finish::Length => KilnFinish::Length,
        Finish::ContextFull => KilnFinish::ContextFull,
        Finish::Cancelled => KilnFinish::Cancelled,
    }
}

/// The host's parameters (null: the defaults), checked.
///
/// # Safety
/// `params` is null or points to a `KilnGenerateParams` of at least its `struct_size`.
unsafe fn generate_params(
    params: *const KilnGenerateParams,
) -> Result<GenerateParams, (KilnStatus, String)> {
    let p = match params.is_null() {
        true => kiln_generate_params_default(),
        false => {
            // SAFETY: non-null; the host's struct, at least its `struct_size` field.
            let size = unsafe { (*params).struct_size } as usize;
            if size < std::mem::size_of::<KilnGenerateParams>() {
                return Err(invalid(format!(
                    "KilnGenerateParams of {size} bytes; this kiln needs {} (rebuild against its kiln.h)",
                    std::mem::size_of::<KilnGenerateParams>()
                )));
            }
            // SAFETY: as large as this version's struct, by the check above.
            unsafe { *params }
        }
    };
    let params = GenerateParams {
        max_tokens: p.max_tokens as usize,
        sampling: SamplingParams {
            temperature: p.temperature,
            top_k: p.top_k as usize,
            top_p: p.top_p,
            min_p: p.min_p,
            repeat_penalty: p.repeat_penalty,
            seed: p.seed,
            ..SamplingParams::default()
        },
        stop_on_eos: p.stop_on_eos,
        ..GenerateParams::default()
    };
    params.validate().map_err(kiln_err)?;
    Ok(params)
}

/// A model serving many generations at once on its own thread (kiln's continuous batch):
/// any number of host threads submit to it at the same time (opaque).
pub struct KilnBatcher {
    batcher: Batcher,
    template: ChatTemplate,
}

/// One submitted generation's text, read piece by piece by one host thread (opaque).
pub struct KilnStream {
    stream: kiln::BatchStream,
    /// The piece [`kiln_stream_next`] handed out last (valid until the next call).
    piece: CString,
}

/// Opens the model at `path` on `backend` (null: the best) for `max_sequences` generations
/// at once (more wait in a queue), each of up to `context` tokens (0: the backend's
/// default).
///
/// # Safety
/// `path` NUL-terminated; `backend` null or NUL-terminated; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_batcher_open(
    path: *const c_char,
    backend: *const c_char,
    context: u32,
    max_sequences: u32,
    out: *mut *mut KilnBatcher,
) -> KilnStatus {
    guard(|| {
        // SAFETY: the caller's promise.
        let path = unsafe { string(path, "path") }?;
        let backend = match backend.is_null() {
            true => None,
            // SAFETY: non-null; the caller's promise.
            false => Some(unsafe { string(backend, "backend") }?),
        };
        if out.is_null() {
            return Err(invalid("out is null"));
        }
        let options = LoadOptions {
            max_context: context as usize,
            max_sequences: max_sequences.max(1) as usize,
            ..LoadOptions::default()
        };
        let engine = Engine::open(Path::new(path), backend, &options).map_err(kiln_err)?;
        let template = engine.model.chat_template.clone();
        let batcher = Batcher::start(engine, BatchOptions::default()).map_err(kiln_err)?;
        let boxed = Box::new(KilnBatcher { batcher, template });
        // SAFETY: checked non-null; writable by the caller's promise.
        unsafe { *out = Box::into_raw(boxed) };
        Ok(())
    })
}

/// Stops a batcher (queued work refused, running generations cancelled) and frees it.
/// Free its streams first. Null is allowed.
///
/// # Safety
/// `batcher` null or from [`kiln_batcher_open`], not freed before, no call on it running.
#[no_mangle]
pub unsafe extern "C" fn kiln_batcher_free(batcher: *mut KilnBatcher) {
    if !batcher.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: from `Box::into_raw` in `kiln_batcher_open` (the caller's promise).
            drop(unsafe { Box::from_raw(batcher) })
        }));
    }
}

/// [`kiln_tokenize`] with the batcher's model.
///
/// # Safety
/// `batcher` from [`kiln_batcher_open`]; the rest as for [`kiln_tokenize`].
#[no_mangle]
pub unsafe extern "C" fn kiln_batcher_tokenize(
    batcher: *const KilnBatcher,
    text: *const c_char,
    add_special: bool,
    ids: *mut u32,
    cap: usize,
    n_out: *mut usize,
) -> KilnStatus {
    guard(|| {
        if batcher.is_null() {
            return Err(invalid("batcher is null"));
        }
        // SAFETY: a live batcher (the caller's promise); it is shared across threads.
        let b = unsafe { &*batcher };
        // SAFETY: the caller's promise about the rest.
        unsafe { tokenize_into(b.batcher.tokenizer(), text, add_special, ids, cap, n_out) }
    })
}

/// [`kiln_chat_prompt`] with the batcher's model.
///
/// # Safety
/// `batcher` from [`kiln_batcher_open`]; the rest as for [`kiln_chat_prompt`].
#[no_mangle]
pub unsafe extern "C" fn kiln_batcher_chat_prompt(
    batcher: *const KilnBatcher,
    messages: *const KilnChatMessage,
    n: usize,
    ids: *mut u32,
    cap: usize,
    n_out: *mut usize,
) -> KilnStatus {
    guard(|| {
        if batcher.is_null() {
            return Err(invalid("batcher is null"));
        }
        // SAFETY: a live batcher (the caller's promise).
        let b = unsafe { &*batcher };
        // SAFETY: the caller's promise about the rest.
        unsafe {
            chat_into(
                b.batcher.tokenizer(),
                &b.template,
                messages,
                n,
                ids,
                cap,
                n_out,
            )
        }
    })
}

/// Queues a generation from `prompt` (`n` ids) with `params` (null: the defaults; its
/// `stop_on_eos` must be true) and gives its stream. Callable from any number of threads
/// at once; blocks while the queue is full. A prompt that leaves no room in the context is
/// `KILN_STATUS_CONTEXT_EXCEEDED`.
///
/// # Safety
/// `batcher` from [`kiln_batcher_open`]; `prompt` holds `n` ids; `params` null or a
/// [`KilnGenerateParams`]; `out` writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_batcher_submit(
    batcher: *const KilnBatcher,
    prompt: *const u32,
    n: usize,
    params: *const KilnGenerateParams,
    out: *mut *mut KilnStream,
) -> KilnStatus {
    guard(|| {
        if batcher.is_null() || out.is_null() || (prompt.is_null() && n > 0) {
            return Err(invalid("batcher, prompt or out is null"));
        }
        // SAFETY: the caller's promise about `params`.
        let params = unsafe { generate_params(params) }?;
        // SAFETY: a live batcher (the caller's promise).
        let b = unsafe { &*batcher };
        let ids = match n {
            0 => Vec::new(),
            // SAFETY: `n` readable ids (the caller's promise).
            _ => unsafe { std::slice::from_raw_parts(prompt, n) }.to_vec(),
        };
        let stream = b.batcher.submit(ids, &params).map_err(kiln_err)?;
        let boxed = Box::new(KilnStream {
            stream,
            piece: CString::default(),
        });
        // SAFETY: checked non-null; writable by the caller's promise.
        unsafe { *out = Box::into_raw(boxed) };
        Ok(())
    })
}

/// Waits for the stream's next piece of text: `*text` and `*len` (NUL-terminated, valid
/// until the next call on this stream; never half a character) with `*done` false; at the
/// end `*done` true, `*text` null, and `result` (may be null) gets the token counts and the
/// finish (no speeds: the batch's steps are shared).
///
/// # Safety
/// `stream` from [`kiln_batcher_submit`], used by one thread at a time; `text`, `len`,
/// `done` writable; `result` null or writable.
#[no_mangle]
pub unsafe extern "C" fn kiln_stream_next(
    stream: *mut KilnStream,
    text: *mut *const c_char,
    len: *mut usize,
    done: *mut bool,
    result: *mut KilnGenerationResult,
) -> KilnStatus {
    guard(|| {
        if stream.is_null() || text.is_null() || len.is_null() || done.is_null() {
            return Err(invalid("stream, text, len or done is null"));
        }
        // SAFETY: a live stream of this thread (the caller's promise).
        let s = unsafe { &mut *stream };
        let end = |finish: Option<(KilnFinish, usize, usize)>| {
            // SAFETY: all three checked non-null and writable (the caller's promise).
            unsafe {
                *text = std::ptr::null();
                *len = 0;
                *done = true;
            }
            if let (Some((finish, prompt, generated)), false) = (finish, result.is_null()) {
                let r = KilnGenerationResult {
                    prompt_tokens: prompt as u32,
                    prefilled_tokens: prompt as u32,
                    generated_tokens: generated as u32,
                    finish,
                    prompt_tokens_per_second: 0.0,
                    generated_tokens_per_second: 0.0,
                };
                // SAFETY: non-null and writable (the caller's promise).
                unsafe { *result = r };
            }
        };
        loop {
            match s.stream.next_event() {
                Some(BatchEvent::Delta { text: t, .. }) if t.is_empty() => continue,
                Some(BatchEvent::Delta { text: t, .. }) => {
                    s.piece = CString::new(t.replace('\0', " ")).unwrap_or_default();
                    // SAFETY: checked non-null and writable (the caller's promise).
                    unsafe {
                        *text = s.piece.as_ptr();
                        *len = s.piece.as_bytes().len();
                        *done = false;
                    }
                    return Ok(());
                }
                Some(BatchEvent::Done {
                    finish,
                    prompt_tokens,
                    completion_tokens,
                    ..
                }) => {
                    end(Some((finish_of(finish), prompt_tokens, completion_tokens)));
                    return Ok(());
                }
                Some(BatchEvent::Error { message, .. }) => return Err(invalid(message)),
                None => {
                    end(None);
                    return Ok(());
                }
            }
        }
    })
}

/// Frees a stream; a generation not at its end is cancelled. Null is allowed.
///
/// # Safety
/// `stream` null or from [`kiln_batcher_submit`], not freed before.
#[no_mangle]
pub unsafe extern "C" fn kiln_stream_free(stream: *mut KilnStream) {
    if !stream.is_null() {
        let _ = catch_unwind(AssertUnwindSafe(|| {
            // SAFETY: from `Box::into_raw` in `kiln_batcher_submit` (the caller's promise).
            drop(unsafe { Box::from_raw(stream) })
        }));
    }
}

// A `KilnBatcher` is shared by the host's threads: what it holds must be `Sync`.
const _: fn() = || {
    fn shared<T: Sync + Send>() {}
    shared::<KilnBatcher>();
};
