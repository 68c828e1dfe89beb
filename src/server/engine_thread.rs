//! The engine thread of `kiln serve`: it loads the model the command line names, gives the
//! HTTP handlers their [`Frontend`] (tokenizer and template copies), then runs the batching
//! scheduler ([`crate::batching`]) on its jobs until shutdown.

use std::path::PathBuf;
use std::sync::mpsc::Receiver;
use std::sync::Arc;
use std::time::Duration;

use kiln_core::{LoadOptions, Result};

use super::frontend::Frontend;
use crate::batching::Metrics;
use crate::batching::{scheduler, Request, Shutdown};
use crate::engine::{Engine, Model};

/// What to load, and how the loop behaves.
pub struct EngineConfig {
    pub model: Option<PathBuf>,
    pub backend: Option<String>,
    pub plugins: Vec<PathBuf>,
    pub options: LoadOptions,
    /// Test hook: wait this long before loading (so `/health` can be seen answering 503).
    pub load_delay: Duration,
    /// After shutdown begins, running sequences may finish for this long; then the rest
    /// are cancelled.
    pub shutdown_grace: Duration,
    /// Keep finished sequences for prompts that continue them (see the module doc).
    pub prompt_cache: bool,
}

/// Starts the engine thread: it loads the model, reports through `ready`, then serves jobs
/// until shutdown.
pub fn spawn(
    config: EngineConfig,
    jobs: Receiver<Request>,
    metrics: Arc<Metrics>,
    shutdown: Arc<Shutdown>,
    ready: tokio::sync::oneshot::Sender<Result<Arc<Frontend>>>,
) -> std::io::Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("kiln-engine".into())
        .spawn(move || {
            let mut engine = match load(&config) {
                Ok(e) => e,
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            let frontend = match Frontend::new(&engine) {
                Ok(f) => Arc::new(f),
                Err(e) => {
                    let _ = ready.send(Err(e));
                    return;
                }
            };
            scheduler::record_loaded(&mut engine, &metrics);
            if ready.send(Ok(frontend)).is_err() {
                return;
            }
            scheduler::run_loop(
                &mut engine,
                &jobs,
                &metrics,
                &shutdown,
                config.shutdown_grace,
                config.prompt_cache,
            );
        })
}

fn load(config: &EngineConfig) -> Result<Engine> {
    if !config.load_delay.is_zero() {
        std::thread::sleep(config.load_delay);
    }
    let path = match &config.model {
        Some(p) => p.clone(),
        None => crate::fetch::ensure_default_model(false)?,
    };
    let model = Model::open(&path)?;
    let (registry, errors) = crate::registry_with_plugins(&config.plugins);
    for e in errors {
        tracing::warn!("plugin: {e}");
    }
    Engine::load(model, &registry, config.backend.as_deref(), &config.options)
}
