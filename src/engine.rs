//! Opening a model and binding it to a backend.
//!
//! [`Model::open`] reads a file into the IR plus its tokenizer and chat template;
//! [`Engine::load`] asks the registry which backend runs it (or takes the one named) and
//! makes it resident there. [`Engine::session`] then hands out conversations.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use kiln_core::{Backend, Candidate, Error, LayerExecutor, LoadOptions, ModelIr, Registry, Result};
use kiln_formats::chat::ChatTemplate;
use kiln_formats::gguf::GgufFile;
use kiln_formats::tokenizer::Tokenizer;

use crate::session::Session;

/// A model file opened and understood, not yet on any device.
pub struct Model {
    pub path: PathBuf,
    pub gguf: GgufFile,
    pub ir: ModelIr,
    pub tokenizer: Tokenizer,
    pub chat_template: ChatTemplate,
}

impl Model {
    /// Opens a GGUF file: header, tensors (memory-mapped, not read), tokenizer, template.
    pub fn open(path: &Path) -> Result<Model> {
        let gguf = GgufFile::open(path).map_err(|e| annotate(path, e.into()))?;
        let source = format!("GGUF file {}", path.display());
        let ir = kiln_formats::model::model_from_gguf(&gguf, &source).map_err(|e| annotate(path, e))?;
        let tokenizer = Tokenizer::from_gguf(&gguf)?;
        let chat_template = ChatTemplate::from_gguf(&gguf)?;
        Ok(Model { path: path.to_path_buf(), gguf, ir, tokenizer, chat_template })
    }
}

fn annotate(path: &Path, e: Error) -> Error {
    match e {
        Error::Io(io) => Error::Io(std::io::Error::new(io.kind(), format!("{}: {io}", path.display()))),
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
}

impl Engine {
    /// Loads `model` on the backend named `preferred`, or on the best-scoring one.
    pub fn load(model: Model, registry: &Registry, preferred: Option<&str>, options: &LoadOptions) -> Result<Engine> {
        let (backend, candidates) = kiln_formats::model::dispatch(&model.ir, registry, preferred)?;
        let executor = backend.load(&model.ir, options)?;
        Ok(Engine { model, backend, candidates, executor })
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
