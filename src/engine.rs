//! Opening a model and binding it to a backend.
//!
//! [`Model::open`] reads a file into the IR plus its tokenizer and chat template;
//! [`Engine::load`] asks the registry which backend runs it (or takes the one named) and
//! makes it resident there. [`Engine::session`] then hands out conversations.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::{Backend, Candidate, Error, LayerExecutor, LoadOptions, ModelIr, Registry, Result};
use kiln_formats::apr::AprFile;
use kiln_formats::chat::{ChatMessage, ChatTemplate};
use kiln_formats::gguf::GgufFile;
use kiln_formats::tokenizer::{Tokenizer, TokenizerSpec};

use crate::session::Session;
use crate::structured::{json_constraint, Constraint, Grammars};

/// The container a model came in.
pub enum ModelFile {
    Gguf(GgufFile),
    Apr(AprFile),
}

/// A model file opened and understood, not yet on any device.
pub struct Model {
    pub path: PathBuf,
    pub file: ModelFile,
    pub ir: ModelIr,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
    /// The tokenizer as the file describes it (what `kiln convert` writes out again).
    pub tokenizer_spec: TokenizerSpec,
}

impl Model {
    /// Opens a GGUF or APR file, told apart by its magic bytes (not its name): header,
    /// tensors (memory-mapped, not read), tokenizer, template.
    pub fn open(path: &Path) -> Result<Model> {
        let mut magic = [0u8; 4];
        {
            use std::io::Read;
            let meta = std::fs::metadata(path).map_err(|e| annotate(path, e.into()))?;
            if !meta.is_file() {
                return Err(Error::InvalidArgument(format!(
                    "{}: not a regular file",
                    path.display()
                )));
            }
            let mut f = std::fs::File::open(path).map_err(|e| annotate(path, e.into()))?;
            let n = f.read(&mut magic).map_err(|e| annotate(path, e.into()))?;
            if n < 4 {
                return Err(Error::Format(format!(
                    "{}: {n} bytes is too short for a model file",
                    path.display()
                )));
            }
        }
        if kiln_formats::apr::is_apr(&magic) {
            return Self::open_apr(path);
        }
        let gguf = GgufFile::open(path).map_err(|e| annotate(path, e.into()))?;
        let source = format!("GGUF file {}", path.display());
        let ir =
            kiln_formats::model::model_from_gguf(&gguf, &source).map_err(|e| annotate(path, e))?;
        let tokenizer_spec = TokenizerSpec::from_gguf(&gguf)?;
        let tokenizer = Tokenizer::from_spec(tokenizer_spec.clone())?;
        let chat_template = ChatTemplate::from_gguf(&gguf)?;
        Ok(Model {
            path: path.to_path_buf(),
            file: ModelFile::Gguf(gguf),
            ir,
            tokenizer,
            chat_template,
            tokenizer_spec,
        })
    }

    fn open_apr(path: &Path) -> Result<Model> {
        let apr = AprFile::open(path).map_err(|e| annotate(path, e.into()))?;
        let source = format!("APR file {}", path.display());
        let m = kiln_formats::apr_model::model_from_apr(&apr, &source)
            .map_err(|e| annotate(path, e))?;
        let tokenizer = Tokenizer::from_spec(m.tokenizer.clone())?;
        let piece = |id: Option<u32>| {
            id.and_then(|i| m.tokenizer.tokens.get(i as usize))
                .cloned()
                .unwrap_or_default()
        };
        let (bos, eos) = (piece(m.tokenizer.bos), piece(m.tokenizer.eos));
        let chat_template = match &m.chat_template {
            Some(src) => ChatTemplate::new(src, bos, eos)?,
            None => ChatTemplate::chatml(bos, eos),
        };
        Ok(Model {
            path: path.to_path_buf(),
            file: ModelFile::Apr(apr),
            ir: m.ir,
            tokenizer,
            chat_template,
            tokenizer_spec: m.tokenizer,
        })
    }

    /// The chat template's source, if the file carries one (not the ChatML fallback).
    pub fn chat_template_source(&self) -> Option<&str> {
        (!self.chat_template.is_fallback()).then(|| self.chat_template.source())
    }

    /// The prompt ids of a chat, ready to generate the assistant's turn: the model's
    /// template rendered with the generation prompt, its markup tokenised with control
    /// tokens and every message's content as text (a message spelling `<|im_end|>` cannot
    /// close its turn), BOS as the model asks. What `kiln run --chat` and `kiln chat` use
    /// (`kiln serve` makes the same two calls on its handlers' copies).
    ///
    /// # Errors
    /// The template refused the messages (it raised, or hit a render limit), or the
    /// tokenizer could not encode the text (`Error::Tokenizer`).
    pub fn chat_prompt(&self, messages: &[ChatMessage]) -> Result<Vec<u32>> {
        let prompt = self.chat_template.render_prompt(messages, true)?;
        self.tokenizer.encode_chat(
            &prompt.text,
            self.tokenizer.add_bos_default(),
            &prompt.content,
        )
    }
}

fn annotate(path: &Path, e: Error) -> Error {
    match e {
        Error::Io(io) => Error::Io(std::io::Error::new(
            io.kind(),
            format!("{}: {io}", path.display()),
        )),
        other => other,
    }
}

/// The registry of this process: built-in backends plus the plugins found on
/// `--plugin` paths, `KILN_PLUGIN_PATH` and `plugins/` beside the executable. Plugins that
/// fail to load are returned as errors beside the registry, so a broken plugin never
/// takes the host down.
pub fn registry_with_plugins(explicit_plugins: &[PathBuf]) -> (Registry, Vec<Error>) {
    crate::link_builtin_backends();
    let mut registry = Registry::with_builtins();
    let errors = crate::plugins::register_plugins(&mut registry, explicit_plugins);
    (registry, errors)
}

/// A model resident on a backend.
pub struct Engine {
    pub model: Model,
    backend: Arc<dyn Backend>,
    /// Every backend's verdict, best first, as selection saw them.
    pub candidates: Vec<Candidate>,
    pub(crate) executor: Box<dyn LayerExecutor>,
    /// Structured outputs' vocabulary and parser factory, built on first use (`None`
    /// inside: the model has no end-of-sequence token).
    grammars: Option<Option<Grammars>>,
}

impl Engine {
    /// Loads `model` on the backend named `preferred`, or on the best-scoring one.
    ///
    /// A context longer than the model was trained for is refused (its positions past the
    /// trained length give garbage, and the KV cache would be sized by an arbitrary number).
    pub fn load(
        model: Model,
        registry: &Registry,
        preferred: Option<&str>,
        options: &LoadOptions,
    ) -> Result<Engine> {
        let trained = model.ir.config.context_length;
        if options.max_context > trained {
            return Err(Error::InvalidArgument(format!(
                "a context of {} tokens exceeds the {trained} this model was trained for (pass -c {trained} or less)",
                options.max_context
            )));
        }
        let (backend, candidates) = kiln_formats::model::dispatch(&model.ir, registry, preferred)?;
        let executor = backend.load(&model.ir, options)?;
        Ok(Engine {
            model,
            backend,
            candidates,
            executor,
            grammars: None,
        })
    }

    /// Opens the model file at `path` and loads it on the backend named `preferred` (or the
    /// best-scoring one), among the built-in backends and the plugins `KILN_PLUGIN_PATH`
    /// names: [`Model::open`], [`registry_with_plugins`] and [`Engine::load`] in one call.
    pub fn open(path: &Path, preferred: Option<&str>, options: &LoadOptions) -> Result<Engine> {
        let model = Model::open(path)?;
        let (registry, _) = registry_with_plugins(&[]);
        Engine::load(model, &registry, preferred, options)
    }

    /// A constraint that makes the output a JSON value matching `schema` (structured
    /// output, [`crate::structured`]); `GenerateParams::json_schema` uses it.
    pub fn json_constraint(&mut self, schema: &serde_json::Value) -> Result<Constraint> {
        if self.grammars.is_none() {
            self.grammars = Some(Grammars::from_spec(&self.model.tokenizer_spec)?);
        }
        let grammars = self.grammars.as_ref().and_then(Option::as_ref);
        json_constraint(grammars, schema).map_err(Error::InvalidArgument)
    }

    pub fn backend_name(&self) -> &str {
        self.backend.name()
    }

    pub fn executor(&mut self) -> &mut dyn LayerExecutor {
        self.executor.as_mut()
    }

    /// A new conversation with its own KV cache slot.
    pub fn session(&mut self) -> Result<Session<'_>> {
        Session::new(self)
    }
}
