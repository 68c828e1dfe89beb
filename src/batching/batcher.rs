//! Continuous batching for host applications, without HTTP: the engine thread `kiln serve`
//! runs ([`super::scheduler`]), driven through a small blocking API.
//!
//! ```no_run
//! # fn main() -> kiln_core::Result<()> {
//! use kiln::{registry_with_plugins, BatchEvent, Batcher, BatchOptions, Engine, GenerateParams, Model};
//! let (registry, _) = registry_with_plugins(&[]);
//! let model = Model::open(std::path::Path::new("model.gguf"))?;
//! let options = kiln_core::LoadOptions { max_sequences: 8, ..Default::default() };
//! let batcher = Batcher::start(Engine::load(model, &registry, None, &options)?, BatchOptions::default())?;
//! let prompt = batcher.tokenizer().encode("Once upon a time", true, false)?;
//! let mut stream = batcher.submit(prompt, &GenerateParams::default())?;
//! for event in &mut stream {
//!     match event {
//!         BatchEvent::Delta { text, .. } => print!("{text}"),
//!         BatchEvent::Done { finish, .. } => println!(" [{}]", finish.as_str()),
//!         BatchEvent::Error { message, .. } => eprintln!("{message}"),
//!     }
//! }
//! # Ok(())
//! # }
//! ```
//!
//! Every submitted prompt becomes a sequence of the engine thread's continuous batch: it
//! waits for a slot and KV blocks, is prefilled in chunks between decode steps, then runs
//! in one batched decode step with every other running sequence; the KV pool is shared,
//! the newest sequence is preempted (and recomputed later) when the running ones outgrow
//! it, and finished sequences are kept for prompts that continue them (the prompt cache).
//! Dropping a [`BatchStream`] cancels its sequence, from any thread; its slot and blocks
//! are free before the next step.

use std::sync::atomic::Ordering;
use std::sync::mpsc::SyncSender;
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};

use kiln_core::{Error, Result};
use kiln_formats::tokenizer::{Tokenizer, TokenizerSpec};
use tokio::sync::mpsc::UnboundedReceiver;

pub use super::scheduler::{Event, Finish, TokenLogprob};

use super::scheduler::{self, Job, JobParams, Request};
use super::Shutdown;
use crate::batching::metrics::Metrics;
use crate::engine::Engine;
use crate::session::GenerateParams;
use crate::structured::{json_constraint, Constraint, Grammars};

/// How a [`Batcher`] runs.
#[derive(Debug, Clone)]
pub struct BatchOptions {
    /// Submissions that may wait for the engine thread before [`Batcher::submit`] blocks.
    pub queue: usize,
    /// Keep finished sequences for prompts that continue them (a conversation's next turn
    /// prefills only its new tokens).
    pub prompt_cache: bool,
    /// When the batcher is dropped, running sequences may go on this long before they are
    /// cancelled.
    pub shutdown_grace: Duration,
}

impl Default for BatchOptions {
    fn default() -> Self {
        BatchOptions {
            queue: 256,
            prompt_cache: true,
            shutdown_grace: Duration::ZERO,
        }
    }
}

/// A loaded model serving many generations at once on its engine thread.
pub struct Batcher {
    jobs: Option<SyncSender<Request>>,
    shutdown: Arc<Shutdown>,
    metrics: Arc<Metrics>,
    thread: Option<std::thread::JoinHandle<Engine>>,
    tokenizer: Arc<Tokenizer>,
    tokenizer_spec: TokenizerSpec,
    /// Tokens a sequence may hold (the engine's context).
    max_context: usize,
    /// Structured outputs, built at the first `json_schema` (`None` inside: the model has
    /// no end-of-sequence token).
    grammars: OnceLock<Option<Grammars>>,
}

impl Batcher {
    /// Moves `engine` onto its own thread (the executor is used from there alone) and starts
    /// the batch loop. `LoadOptions::max_sequences` of the engine is how many run at once.
    pub fn start(engine: Engine, options: BatchOptions) -> Result<Batcher> {
        if options.queue == 0 {
            return Err(Error::InvalidArgument(
                "BatchOptions::queue must be at least 1".into(),
            ));
        }
        let tokenizer_spec = engine.model.tokenizer_spec.clone();
        let max_context = engine.executor.max_context();
        let tokenizer = Arc::new(Tokenizer::from_spec(tokenizer_spec.clone())?);
        let (jobs, receiver) = std::sync::mpsc::sync_channel(options.queue);
        let (shutdown, metrics) = (Arc::new(Shutdown::default()), Arc::new(Metrics::default()));
        let thread = scheduler::spawn_loaded(
            engine,
            receiver,
            metrics.clone(),
            shutdown.clone(),
            options.shutdown_grace,
            options.prompt_cache,
        )?;
        Ok(Batcher {
            jobs: Some(jobs),
            shutdown,
            metrics,
            thread: Some(thread),
            tokenizer,
            tokenizer_spec,
            max_context,
            grammars: OnceLock::new(),
        })
    }

    /// The model's tokenizer, for prompts and for reading token ids.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The counters and gauges of the batch (the server's `/metrics`): running sequences,
    /// queue depth, KV blocks, prompt-cache hits, time to first token … `render()` gives
    /// them in Prometheus text.
    pub fn metrics(&self) -> &Metrics {
        &self.metrics
    }

    /// Queues one generation and returns its stream of events. Blocks while the queue is
    /// full. `params.stop_on_eos` must be true (the batch always ends a sequence at its
    /// end-of-sequence tokens).
    ///
    /// # Errors
    /// `ContextExceeded` for a prompt that leaves no room in the context to generate,
    /// `InvalidArgument` for an empty prompt or bad parameters; tokens outside the
    /// vocabulary come back as an [`Event::Error`] on the stream.
    pub fn submit(&self, prompt: Vec<u32>, params: &GenerateParams) -> Result<BatchStream> {
        params.validate()?;
        if prompt.is_empty() {
            return Err(Error::InvalidArgument("the prompt has no tokens".into()));
        }
        // The prompt and at least one generated token must fit.
        if prompt.len() >= self.max_context {
            return Err(Error::ContextExceeded {
                tokens: prompt.len() + 1,
                context: self.max_context,
            });
        }
        if !params.stop_on_eos {
            return Err(Error::InvalidArgument(
                "a Batcher always stops at end-of-sequence tokens (stop_on_eos must be true)"
                    .into(),
            ));
        }
        let constraint = match &params.json_schema {
            Some(schema) => Some(self.json_constraint(schema)?),
            None => None,
        };
        let (events, rx) = tokio::sync::mpsc::unbounded_channel();
        let job = Job {
            index: 0,
            prompt,
            constraint,
            params: JobParams {
                max_tokens: params.max_tokens,
                sampling: params.sampling.clone(),
                presence_penalty: params.presence_penalty,
                frequency_penalty: params.frequency_penalty,
                stop: params.stop_strings.clone(),
                logprobs: params.logprobs,
                cache_prompt: true,
                cancel: params.cancel.clone(),
                split_reasoning: params.split_reasoning,
            },
            events,
            received: Instant::now(),
        };
        let jobs = self.jobs.as_ref().expect("present until drop");
        self.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
        if jobs.send(Request::Generate(vec![job])).is_err() {
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            return Err(Error::InvalidArgument(
                "the batcher's engine thread has stopped".into(),
            ));
        }
        Ok(BatchStream { rx, ended: false })
    }

    /// The embeddings of `inputs` (token ids each), computed by the engine thread between
    /// the running generations' decode steps, in order; blocks until they are done.
    ///
    /// # Errors
    /// The first input's error: no tokens or ids outside the vocabulary
    /// (`InvalidArgument`), as long as the context (`ContextExceeded`), a backend without
    /// hidden states (`Unsupported`), or a stopped engine thread.
    pub fn embed(
        &self,
        inputs: Vec<Vec<u32>>,
        pooling: crate::Pooling,
        normalize: bool,
    ) -> Result<Vec<Vec<f32>>> {
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = scheduler::EmbedJob {
            inputs,
            pooling,
            normalize,
            reply,
        };
        let stopped = || Error::InvalidArgument("the batcher's engine thread has stopped".into());
        let jobs = self.jobs.as_ref().expect("present until drop");
        jobs.send(Request::Embed(job)).map_err(|_| stopped())?;
        answer.blocking_recv().map_err(|_| stopped())?
    }

    fn json_constraint(&self, schema: &serde_json::Value) -> Result<Constraint> {
        if self.grammars.get().is_none() {
            // Two first submissions at once may both build them; one is kept.
            let _ = self
                .grammars
                .set(Grammars::from_spec(&self.tokenizer_spec)?);
        }
        let grammars = self.grammars.get().and_then(Option::as_ref);
        json_constraint(grammars, schema).map_err(Error::InvalidArgument)
    }

    /// Stops taking work and waits until everything submitted has finished.
    /// and hands the engine back (its sequences all freed) for sessions, embeddings or
    /// another Batcher.
    ///
    /// # Errors
    /// `Backend` when the engine thread panicked (the engine is lost with it).
    pub fn finish(mut self) -> Result<Engine> {
        // Without a sender the engine thread ends once nothing is left to run.
        self.jobs = None;
        let thread = self.thread.take().expect("present until finish or drop");
        thread.join().map_err(|_| Error::Backend {
            backend: "batcher".into(),
            message: "the engine thread panicked".into(),
        })
    }
}

impl Drop for Batcher {
    /// Refuses what is still queued, lets running sequences go on for
    /// `BatchOptions::shutdown_grace`, cancels the rest (`Finish::Cancelled`) and joins the
    /// engine thread.
    fn drop(&mut self) {
        if let Some(t) = self.thread.take() {
            self.shutdown.begin();
            self.jobs = None;
            let _ = t.join();
        }
    }
}

/// The events of one submitted generation: text as it becomes final, then `Done` (or
/// `Error`). Dropping it cancels the generation.
pub struct BatchStream {
    rx: UnboundedReceiver<(usize, Event)>,
    ended: bool,
}

impl BatchStream {
    /// The next event, waiting for it (from async code: [`BatchStream::recv`]); `None` after
    /// `Done` or `Error`.
    pub fn next_event(&mut self) -> Option<Event> {
        if self.ended {
            return None;
        }
        let event = self.rx.blocking_recv().map(|(_, e)| e);
        self.note(&event);
        event
    }

    /// [`BatchStream::next_event`] for async code.
    pub async fn recv(&mut self) -> Option<Event> {
        if self.ended {
            return None;
        }
        let event = self.rx.recv().await.map(|(_, e)| e);
        self.note(&event);
        event
    }

    fn note(&mut self, event: &Option<Event>) {
        self.ended = !matches!(event, Some(Event::Delta { .. }));
    }
}

impl Iterator for BatchStream {
    type Item = Event;

    fn next(&mut self) -> Option<Event> {
        self.next_event()
    }
}
