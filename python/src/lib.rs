//! The `kiln` Python module: backends and their verdicts, a model loaded on one, and
//! generation through kiln's Batcher — so one `Model` serves many Python threads at once
//! (each call waits with the GIL released), and asyncio code awaits it with
//! `asyncio.to_thread`. Errors are `kiln.KilnError` subclasses named for what went wrong.
//! `kiln.pyi` has the signatures.

use std::path::Path;

use kiln::core::{Error, LoadOptions, SamplingParams};
use kiln::formats::chat::ChatTemplate;
use kiln::formats::tokenizer::Tokenizer;
use kiln::{
    BatchEvent, BatchOptions, Batcher, ChatMessage, Engine, GenerateParams, Model, Pooling,
};
use pyo3::exceptions::PyException;
use pyo3::prelude::*;
use pyo3::types::{PyDict, PyList};

pyo3::create_exception!(kiln, KilnError, PyException, "Any error kiln reports.");
pyo3::create_exception!(
    kiln,
    ContextExceededError,
    KilnError,
    "The prompt and the tokens asked for do not fit the model's context."
);
pyo3::create_exception!(
    kiln,
    UnsupportedError,
    KilnError,
    "The model needs an architecture, weight type or feature kiln does not run."
);
pyo3::create_exception!(kiln, FormatError, KilnError, "The model file is malformed.");
pyo3::create_exception!(
    kiln,
    NoBackendError,
    KilnError,
    "No backend can run the model (or the one named cannot)."
);
pyo3::create_exception!(
    kiln,
    InvalidArgumentError,
    KilnError,
    "An argument is out of range or malformed."
);

fn py_err(e: Error) -> PyErr {
    let message = e.to_string();
    match e {
        Error::ContextExceeded { .. } | Error::KvCacheFull { .. } => {
            ContextExceededError::new_err(message)
        }
        Error::Unsupported(_) => UnsupportedError::new_err(message),
        Error::Format(_) | Error::InvalidShape(_) => FormatError::new_err(message),
        Error::NoBackend(_) => NoBackendError::new_err(message),
        Error::InvalidArgument(_) => InvalidArgumentError::new_err(message),
        _ => KilnError::new_err(message),
    }
}

/// Every backend's verdict on the model at `path`, best first: `{"name", "score"}` for
/// those that can run it, `{"name", "refused"}` with the reason for the others.
#[pyfunction]
fn backends(py: Python<'_>, path: &str) -> PyResult<Vec<Py<PyDict>>> {
    let model = Model::open(Path::new(path)).map_err(py_err)?;
    let (registry, _) = kiln::registry_with_plugins(&[]);
    registry
        .rank(&model.ir)
        .iter()
        .map(|c| {
            let d = PyDict::new(py);
            d.set_item("name", &c.name)?;
            match (c.score(), c.refusal()) {
                (Some(score), _) => d.set_item("score", score)?,
                (None, why) => d.set_item("refused", why.unwrap_or_default())?,
            }
            Ok(d.unbind())
        })
        .collect()
}

/// The result of a generation.
#[pyclass(frozen, get_all, module = "kiln")]
struct Completion {
    /// The text (the answer alone for a chat of a model that writes its reasoning apart).
    text: String,
    /// Reasoning written apart from the answer (gpt-oss's analysis channel), or "".
    reasoning: String,
    token_ids: Vec<u32>,
    /// "stop", "length", "context_full" or "cancelled".
    finish_reason: String,
    prompt_tokens: usize,
}

#[pymethods]
impl Completion {
    fn __repr__(&self) -> String {
        format!(
            "Completion(text={:?}, finish_reason={:?}, tokens={})",
            self.text,
            self.finish_reason,
            self.token_ids.len()
        )
    }
}

/// A model loaded on a backend, generating for any number of threads at once.
#[pyclass(frozen, name = "Model", module = "kiln")]
struct PyModel {
    batcher: Batcher,
    template: ChatTemplate,
    backend: String,
    vocab_size: usize,
    context: usize,
    pooling: Option<Pooling>,
}

/// How to generate, from the keyword arguments every generating method takes.
#[allow(clippy::too_many_arguments)]
fn params(
    max_tokens: usize,
    temperature: f32,
    top_k: usize,
    top_p: f32,
    min_p: f32,
    seed: u64,
    stop: Option<Vec<String>>,
    json_schema: Option<&Bound<'_, PyAny>>,
) -> PyResult<GenerateParams> {
    let json_schema = match json_schema {
        None => None,
        Some(s) => {
            let json = s
                .py()
                .import("json")?
                .call_method1("dumps", (s,))?
                .extract::<String>()?;
            Some(
                serde_json::from_str(&json)
                    .map_err(|e| InvalidArgumentError::new_err(e.to_string()))?,
            )
        }
    };
    let p = GenerateParams {
        max_tokens,
        sampling: SamplingParams {
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            ..SamplingParams::default()
        },
        stop_strings: stop.unwrap_or_default(),
        json_schema,
        ..GenerateParams::default()
    };
    p.validate().map_err(py_err)?;
    Ok(p)
}

/// A prompt: text (tokenized with the model's BOS) or token ids.
#[derive(FromPyObject)]
enum Prompt {
    Text(String),
    Ids(Vec<u32>),
}

impl PyModel {
    fn tokenizer(&self) -> &Tokenizer {
        self.batcher.tokenizer()
    }

    fn prompt_ids(&self, prompt: Prompt) -> PyResult<Vec<u32>> {
        match prompt {
            Prompt::Ids(ids) => Ok(ids),
            Prompt::Text(text) => {
                let t = self.tokenizer();
                t.encode(&text, t.add_bos_default(), false).map_err(py_err)
            }
        }
    }

    fn chat_ids(&self, messages: &Bound<'_, PyList>) -> PyResult<Vec<u32>> {
        let mut chat = Vec::with_capacity(messages.len());
        for m in messages.iter() {
            let role: String = m.get_item("role")?.extract()?;
            let content: String = m.get_item("content")?.extract()?;
            chat.push(ChatMessage::new(role, content));
        }
        let prompt = self.template.render_prompt(&chat, true).map_err(py_err)?;
        let t = self.tokenizer();
        t.encode_chat(&prompt.text, t.add_bos_default(), &prompt.content)
            .map_err(py_err)
    }

    /// Runs one generation to its end with the GIL released.
    fn complete(
        &self,
        py: Python<'_>,
        ids: Vec<u32>,
        params: GenerateParams,
    ) -> PyResult<Completion> {
        let prompt_tokens = ids.len();
        let done = py.detach(|| -> Result<Completion, Error> {
            let mut stream = self.batcher.submit(ids, &params)?;
            let (mut text, mut reasoning, mut token_ids) =
                (String::new(), String::new(), Vec::new());
            loop {
                match stream.next_event() {
                    Some(BatchEvent::Delta {
                        text: t,
                        reasoning: r,
                        token,
                        ..
                    }) => {
                        text.push_str(&t);
                        reasoning.push_str(&r);
                        token_ids.extend(token);
                    }
                    Some(BatchEvent::Done { finish, .. }) => {
                        return Ok(Completion {
                            text,
                            reasoning,
                            token_ids,
                            finish_reason: finish.as_str().to_string(),
                            prompt_tokens,
                        })
                    }
                    Some(BatchEvent::Error { message, .. }) => {
                        return Err(Error::InvalidArgument(message))
                    }
                    None => return Err(Error::InvalidArgument("the engine stopped".into())),
                }
            }
        });
        done.map_err(py_err)
    }
}

#[pymethods]
impl PyModel {
    /// Opens the model at `path` (GGUF or APR) and loads it on `backend` (a name from
    /// `kiln.backends`, or the best-scoring one). `context`: tokens per sequence (0: the
    /// backend's default); `max_sequences`: generations that run at once (more wait).
    #[new]
    #[pyo3(signature = (path, backend = None, context = 4096, max_sequences = 4))]
    fn new(
        py: Python<'_>,
        path: &str,
        backend: Option<&str>,
        context: usize,
        max_sequences: usize,
    ) -> PyResult<Self> {
        py.detach(|| -> Result<PyModel, Error> {
            let model = Model::open(Path::new(path))?;
            let pooling = Pooling::of_model(&model)?;
            let template = model.chat_template.clone();
            let (registry, _) = kiln::registry_with_plugins(&[]);
            let context = context.min(model.ir.config.context_length);
            let options = LoadOptions {
                max_context: context,
                max_sequences: max_sequences.max(1),
                ..LoadOptions::default()
            };
            let engine = Engine::load(model, &registry, backend, &options)?;
            let backend = engine.backend_name().to_string();
            let vocab_size = engine.model.ir.config.vocab_size;
            let batcher = Batcher::start(engine, BatchOptions::default())?;
            Ok(PyModel {
                batcher,
                template,
                backend,
                vocab_size,
                context,
                pooling,
            })
        })
        .map_err(py_err)
    }

    /// The backend the model runs on.
    #[getter]
    fn backend(&self) -> &str {
        &self.backend
    }

    #[getter]
    fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// Tokens per sequence as loaded.
    #[getter]
    fn context(&self) -> usize {
        self.context
    }

    /// Token ids of `text`; `add_special`: the model's BOS, and special-token spellings
    /// read as those tokens.
    #[pyo3(signature = (text, add_special = true))]
    fn tokenize(&self, text: &str, add_special: bool) -> PyResult<Vec<u32>> {
        let t = self.tokenizer();
        t.encode(text, add_special && t.add_bos_default(), add_special)
            .map_err(py_err)
    }

    /// The text of `ids` (special tokens shown unless `skip_special`).
    #[pyo3(signature = (ids, skip_special = false))]
    fn detokenize(&self, ids: Vec<u32>, skip_special: bool) -> String {
        self.tokenizer().decode(&ids, skip_special)
    }

    /// The prompt ids of a chat (`[{"role", "content"}, …]`), ready for the assistant's
    /// turn: the model's template, its markup as control tokens, contents as text.
    fn chat_prompt(&self, messages: &Bound<'_, PyList>) -> PyResult<Vec<u32>> {
        self.chat_ids(messages)
    }

    /// Generates from `prompt` (text or token ids) to the end; waits without the GIL.
    #[pyo3(signature = (prompt, *, max_tokens = 128, temperature = 0.8, top_k = 40, top_p = 0.95, min_p = 0.05, seed = 0, stop = None, json_schema = None))]
    #[allow(clippy::too_many_arguments)]
    fn generate(
        &self,
        py: Python<'_>,
        prompt: Prompt,
        max_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        seed: u64,
        stop: Option<Vec<String>>,
        json_schema: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Completion> {
        let p = params(
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            stop,
            json_schema,
        )?;
        let ids = self.prompt_ids(prompt)?;
        self.complete(py, ids, p)
    }

    /// The assistant's answer to `messages` (`[{"role", "content"}, …]`); reasoning a model
    /// writes apart (gpt-oss) is `Completion.reasoning`.
    #[pyo3(signature = (messages, *, max_tokens = 512, temperature = 0.8, top_k = 40, top_p = 0.95, min_p = 0.05, seed = 0, stop = None, json_schema = None))]
    #[allow(clippy::too_many_arguments)]
    fn chat(
        &self,
        py: Python<'_>,
        messages: &Bound<'_, PyList>,
        max_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        seed: u64,
        stop: Option<Vec<String>>,
        json_schema: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<Completion> {
        let mut p = params(
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            stop,
            json_schema,
        )?;
        p.split_reasoning = true;
        let ids = self.chat_ids(messages)?;
        self.complete(py, ids, p)
    }

    /// An iterator over the text of a generation from `prompt`, piece by piece as it
    /// becomes final (never half a character). Dropping it stops the generation.
    #[pyo3(signature = (prompt, *, max_tokens = 128, temperature = 0.8, top_k = 40, top_p = 0.95, min_p = 0.05, seed = 0, stop = None))]
    #[allow(clippy::too_many_arguments)]
    fn stream(
        &self,
        prompt: Prompt,
        max_tokens: usize,
        temperature: f32,
        top_k: usize,
        top_p: f32,
        min_p: f32,
        seed: u64,
        stop: Option<Vec<String>>,
    ) -> PyResult<TextStream> {
        let p = params(
            max_tokens,
            temperature,
            top_k,
            top_p,
            min_p,
            seed,
            stop,
            None,
        )?;
        let ids = self.prompt_ids(prompt)?;
        let stream = self.batcher.submit(ids, &p).map_err(py_err)?;
        Ok(TextStream {
            stream: std::sync::Mutex::new(Some(stream)),
            finish_reason: std::sync::Mutex::new(None),
        })
    }

    /// Embeddings of `texts`, pooled as the model's file says (mean otherwise) and L2
    /// normalised, in one batched pass. CPU backend only for now.
    fn embed(&self, py: Python<'_>, texts: Vec<String>) -> PyResult<Vec<Vec<f32>>> {
        let t = self.tokenizer();
        let inputs = texts
            .iter()
            .map(|s| t.encode(s, t.add_bos_default(), false))
            .collect::<Result<Vec<_>, _>>()
            .map_err(py_err)?;
        let pooling = self.pooling.unwrap_or(Pooling::Mean);
        py.detach(|| self.batcher.embed(inputs, pooling, true))
            .map_err(py_err)
    }

    fn __repr__(&self) -> String {
        format!(
            "kiln.Model(backend={:?}, context={})",
            self.backend, self.context
        )
    }
}

/// The text of one generation, piece by piece (`Model.stream`).
#[pyclass(module = "kiln")]
struct TextStream {
    stream: std::sync::Mutex<Option<kiln::BatchStream>>,
    finish_reason: std::sync::Mutex<Option<String>>,
}

#[pymethods]
impl TextStream {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<String>> {
        loop {
            let event = py.detach(|| {
                let mut guard = self.stream.lock().unwrap_or_else(|p| p.into_inner());
                guard.as_mut().and_then(|s| s.next_event())
            });
            match event {
                Some(BatchEvent::Delta { text, .. }) if text.is_empty() => continue,
                Some(BatchEvent::Delta { text, .. }) => return Ok(Some(text)),
                Some(BatchEvent::Done { finish, .. }) => {
                    *self.finish_reason.lock().unwrap_or_else(|p| p.into_inner()) =
                        Some(finish.as_str().to_string());
                    return Ok(None);
                }
                Some(BatchEvent::Error { message, .. }) => {
                    return Err(py_err(Error::InvalidArgument(message)))
                }
                None => return Ok(None),
            }
        }
    }

    /// Why the generation ended, once the iterator is exhausted (else None).
    #[getter]
    fn finish_reason(&self) -> Option<String> {
        self.finish_reason
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .clone()
    }
}

#[pymodule]
#[pyo3(name = "kiln")]
fn kiln_module(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_function(wrap_pyfunction!(backends, m)?)?;
    m.add_class::<PyModel>()?;
    m.add_class::<Completion>()?;
    m.add_class::<TextStream>()?;
    for (name, ty) in [
        ("KilnError", py.get_type::<KilnError>()),
        (
            "ContextExceededError",
            py.get_type::<ContextExceededError>(),
        ),
        ("UnsupportedError", py.get_type::<UnsupportedError>()),
        ("FormatError", py.get_type::<FormatError>()),
        ("NoBackendError", py.get_type::<NoBackendError>()),
        (
            "InvalidArgumentError",
            py.get_type::<InvalidArgumentError>(),
        ),
    ] {
        m.add(name, ty)?;
    }
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
