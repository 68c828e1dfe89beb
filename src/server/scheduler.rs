//! The engine thread: continuous batching over one executor.
//!
//! A `LayerExecutor` is `Send` but not `Sync`, and every call on it is a blocking compute
//! step, so it lives on one dedicated OS thread that owns the [`Engine`]. HTTP handlers send
//! it [`Job`]s (prompt ids and generation settings) over a bounded channel; it answers each
//! job through that job's own tokio channel of [`Event`]s.
//!
//! Each turn of the loop: take queued jobs while sequence slots are free (each gets a
//! sequence and waits to be prefilled), drop the sequences whose client has gone (their
//! event channel is closed: the HTTP layer dropped the receiver when the connection
//! closed), prefill ONE chunk of at most [`PREFILL_CHUNK`] tokens of the oldest admitted
//! prompt (when its last chunk is in, its first token is sampled from that chunk's logits
//! and it joins the running sequences), then run ONE decode step for every running
//! sequence as a single batch. A long prompt is thus prefilled between decode steps, and
//! the streams already running keep their pace. Sequences join and leave between steps. A step calls
//! `decode_sample` (the backend samples; only ids cross) unless some sequence needs its
//! logits on the host — log-probabilities, presence/frequency penalties, logit bias — in
//! which case it calls `decode` and samples every row on the host with the same
//! [`Sampler`], so results do not depend on which path ran.
//!
//! Text is produced per sequence through the tokenizer's `DecodeStream` (never half a
//! UTF-8 character; special tokens are not shown, as llama-server does by default). Stop
//! strings are matched on the text not yet sent; a tail that could still grow into a stop
//! string is held back until the next token decides. EOS/EOT tokens end a sequence and are
//! not counted as completion tokens.
//!
//! Not done yet: nothing is shared between sequences (no prefix cache).

use crate::session::{find_stop, held_back};
use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_core::{
    DecodeItem, Error, LayerExecutor, LoadOptions, Result, Sampler, SamplingParams, SeqId,
};
use kiln_formats::tokenizer::{DecodeStream, Tokenizer};
use tokio::sync::mpsc::UnboundedSender;

use super::frontend::Frontend;
use super::metrics::Metrics;
use super::Shutdown;
use crate::engine::{Engine, Model};

/// How to generate for one job.
#[derive(Debug, Clone)]
pub struct JobParams {
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    pub stop: Vec<String>,
    /// `Some(k)`: each token's logprob and its `k` most likely alternatives.
    pub logprobs: Option<usize>,
}

impl JobParams {
    fn needs_host_logits(&self) -> bool {
        // A logit bias is part of the sampling settings: device samplers apply it too.
        self.logprobs.is_some() || self.presence_penalty != 0.0 || self.frequency_penalty != 0.0
    }
}

/// One prompt to complete.
pub struct Job {
    /// The choice index this job answers (several prompts in one completions request).
    pub index: usize,
    pub prompt: Vec<u32>,
    pub params: JobParams,
    pub events: UnboundedSender<(usize, Event)>,
    /// When the HTTP request arrived (time-to-first-token counts from here).
    pub received: Instant,
}

/// Why a sequence ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Finish {
    /// An end-of-sequence token or a stop string.
    Stop,
    /// `max_tokens`, or the context is full.
    Length,
    /// The server is shutting down and the grace period ran out (not an OpenAI value).
    Cancelled,
}

impl Finish {
    pub fn as_str(self) -> &'static str {
        match self {
            Finish::Stop => "stop",
            Finish::Length => "length",
            Finish::Cancelled => "cancelled",
        }
    }
}

/// A token's log-probability and its most likely alternatives.
#[derive(Debug, Clone)]
pub struct TokenLogprob {
    pub token: String,
    pub logprob: f32,
    pub top: Vec<(String, f32)>,
}

/// What the scheduler tells a job's handler.
#[derive(Debug)]
pub enum Event {
    /// Text that became final (may be empty while a stop string is undecided) and the
    /// logprob of the token sampled at this step, when asked for.
    Delta {
        text: String,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish: Finish,
        prompt_tokens: usize,
        completion_tokens: usize,
    },
    /// The job failed; `shutting_down` says it was refused because the server is stopping.
    Error {
        message: String,
        shutting_down: bool,
    },
}

/// What to load, and how the loop behaves.
pub struct SchedulerConfig {
    pub model: Option<PathBuf>,
    pub backend: Option<String>,
    pub plugins: Vec<PathBuf>,
    pub options: LoadOptions,
    /// Test hook: wait this long before loading (so `/health` can be seen answering 503).
    pub load_delay: Duration,
    /// After shutdown begins, running sequences may finish for this long; then the rest
    /// are cancelled.
    pub shutdown_grace: Duration,
}

/// Starts the engine thread: it loads the model, reports through `ready`, then serves jobs
/// until shutdown.
pub fn spawn(
    config: SchedulerConfig,
    jobs: Receiver<Job>,
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
            metrics
                .slots_total
                .store(engine.executor.max_sequences() as i64, Ordering::Relaxed);
            metrics.model_loaded.store(true, Ordering::Relaxed);
            if ready.send(Ok(frontend)).is_err() {
                return;
            }
            let Engine {
                model, executor, ..
            } = &mut engine;
            Scheduler::new(model, executor.as_mut(), &metrics, config.shutdown_grace)
                .run(&jobs, &shutdown);
        })
}

fn load(config: &SchedulerConfig) -> Result<Engine> {
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

/// Prompt tokens one turn of the loop prefills at most: one chunk of the GPU executors'
/// batched prefill, a few tens of milliseconds of work between two decode steps.
pub const PREFILL_CHUNK: usize = 512;

/// An admitted job whose prompt is being prefilled, a chunk per turn.
struct Admitting {
    job: Job,
    seq: SeqId,
    /// Prompt tokens already in the KV cache.
    done: usize,
}

/// One running sequence.
struct Running<'t> {
    index: usize,
    events: UnboundedSender<(usize, Event)>,
    params: JobParams,
    seq: SeqId,
    prompt_tokens: usize,
    /// Tokens in the KV cache.
    len: usize,
    /// The last sampled token: the input of the next decode step.
    last: u32,
    generated: usize,
    /// Generated-token counts, for presence/frequency penalties.
    counts: HashMap<u32, u32>,
    stream: DecodeStream<'t>,
    /// Decoded text not sent yet (a possible start of a stop string).
    pending: String,
    received: Instant,
    last_token_at: Option<Instant>,
    /// Its slot is freed; the entry goes at the next `remove_finished`.
    done: bool,
}

impl Running<'_> {
    fn send(&self, event: Event) {
        // A closed channel means the client left; the next turn frees the sequence.
        let _ = self.events.send((self.index, event));
    }
}

struct Scheduler<'e> {
    tokenizer: &'e Tokenizer,
    exec: &'e mut dyn LayerExecutor,
    metrics: &'e Metrics,
    grace: Duration,
    vocab: usize,
    max_context: usize,
    max_seqs: usize,
    stop_tokens: Vec<u32>,
    /// Oldest first; one chunk of the first is prefilled per turn.
    admitting: Vec<Admitting>,
    running: Vec<Running<'e>>,
    /// `samplers[i]` belongs to `running[i]` (a separate vector: `decode_sample` takes a slice).
    samplers: Vec<Sampler>,
    logits: Vec<f32>,
    tokens: Vec<u32>,
    /// Scratch for top-logprob selection.
    candidates: Vec<(u32, f32)>,
    /// Every token's text, decoded once, for logprobs.
    token_text: Vec<String>,
}

impl<'e> Scheduler<'e> {
    fn new(
        model: &'e Model,
        exec: &'e mut dyn LayerExecutor,
        metrics: &'e Metrics,
        grace: Duration,
    ) -> Self {
        let vocab = exec.config().vocab_size;
        let max_context = exec.max_context();
        let max_seqs = exec.max_sequences().max(1);
        let tokenizer = &model.tokenizer;
        Scheduler {
            tokenizer,
            exec,
            metrics,
            grace,
            vocab,
            max_context,
            max_seqs,
            stop_tokens: tokenizer.stop_tokens().to_vec(),
            admitting: Vec::new(),
            running: Vec::new(),
            samplers: Vec::new(),
            logits: Vec::new(),
            tokens: Vec::new(),
            candidates: Vec::new(),
            token_text: Vec::new(),
        }
    }

    fn run(mut self, jobs: &Receiver<Job>, shutdown: &Shutdown) {
        let mut deadline: Option<Instant> = None;
        loop {
            if shutdown.is_set() {
                let deadline = *deadline.get_or_insert_with(|| Instant::now() + self.grace);
                while let Ok(job) = jobs.try_recv() {
                    self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                    let _ = job.events.send((
                        job.index,
                        Event::Error {
                            message: "the server is shutting down".into(),
                            shutting_down: true,
                        },
                    ));
                }
                if Instant::now() >= deadline {
                    for i in (0..self.running.len()).rev() {
                        self.finish(i, Finish::Cancelled);
                        self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                    self.remove_finished();
                    for a in std::mem::take(&mut self.admitting) {
                        self.drop_admitting(a, Some("the server is shutting down"));
                    }
                }
                if self.running.is_empty() && self.admitting.is_empty() {
                    break;
                }
            } else {
                while self.running.len() + self.admitting.len() < self.max_seqs {
                    let job = if self.running.is_empty() && self.admitting.is_empty() {
                        match jobs.recv_timeout(Duration::from_millis(50)) {
                            Ok(job) => job,
                            Err(RecvTimeoutError::Timeout) => break,
                            Err(RecvTimeoutError::Disconnected) => return,
                        }
                    } else {
                        match jobs.try_recv() {
                            Ok(job) => job,
                            Err(_) => break,
                        }
                    };
                    self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                    if job.events.is_closed() {
                        self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                        continue;
                    }
                    self.admit(job);
                    self.update_gauges();
                }
            }
            // Clients that went away: free their slots before spending a step on them.
            for i in (0..self.running.len()).rev() {
                if self.running[i].events.is_closed() {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    self.mark_finished(i);
                }
            }
            self.remove_finished();
            self.prefill_chunk();
            if !self.running.is_empty() {
                self.step();
            }
            self.update_gauges();
        }
        self.update_gauges();
    }

    fn update_gauges(&self) {
        let n = (self.running.iter().filter(|r| !r.done).count() + self.admitting.len()) as i64;
        self.metrics.running.store(n, Ordering::Relaxed);
        self.metrics.slots_used.store(n, Ordering::Relaxed);
    }

    /// Allocates a sequence for the job; its prompt is prefilled over the next turns.
    fn admit(&mut self, job: Job) {
        if job.prompt.is_empty() || job.prompt.len() >= self.max_context {
            let msg = format!(
                "the prompt has {} tokens; it must have 1 to {}",
                job.prompt.len(),
                self.max_context - 1
            );
            let _ = job.events.send((
                job.index,
                Event::Error {
                    message: msg,
                    shutting_down: false,
                },
            ));
            return;
        }
        match self.exec.new_sequence() {
            Ok(seq) => self.admitting.push(Admitting { job, seq, done: 0 }),
            Err(e) => {
                let msg = format!("no sequence slot: {e}");
                let _ = job.events.send((
                    job.index,
                    Event::Error {
                        message: msg,
                        shutting_down: false,
                    },
                ));
            }
        }
    }

    /// Frees an admitted sequence before it ran: its client left (`why` None: counted as
    /// cancelled) or it cannot go on (`why`: sent as an error).
    fn drop_admitting(&mut self, a: Admitting, why: Option<&str>) {
        if let Err(e) = self.exec.free_sequence(a.seq) {
            tracing::error!("freeing sequence {}: {e}", a.seq);
        }
        match why {
            None => {
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            }
            Some(msg) => {
                let shutting_down = msg.contains("shutting down");
                let _ = a.job.events.send((
                    a.job.index,
                    Event::Error {
                        message: msg.to_string(),
                        shutting_down,
                    },
                ));
            }
        }
        self.update_gauges();
    }

    /// One chunk of the oldest admitted prompt; after its last chunk the sequence starts
    /// running with its first token sampled from that chunk's logits.
    fn prefill_chunk(&mut self) {
        if self.admitting.is_empty() {
            return;
        }
        if self.admitting[0].job.events.is_closed() {
            let a = self.admitting.remove(0);
            return self.drop_admitting(a, None);
        }
        let a = &mut self.admitting[0];
        let end = (a.done + PREFILL_CHUNK).min(a.job.prompt.len());
        self.logits.resize(self.vocab, 0.0);
        if let Err(e) = self.exec.prefill(
            a.seq,
            &a.job.prompt[a.done..end],
            &mut self.logits[..self.vocab],
        ) {
            let a = self.admitting.remove(0);
            return self.drop_admitting(a, Some(&format!("prefill failed: {e}")));
        }
        a.done = end;
        if end == a.job.prompt.len() {
            let a = self.admitting.remove(0);
            self.start_running(a.job, a.seq);
        }
    }

    /// A fully prefilled job joins the running sequences; its first token comes from the
    /// logits of the prefill's last chunk (in `self.logits`).
    fn start_running(&mut self, job: Job, seq: SeqId) {
        self.metrics
            .prompt_tokens
            .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        let mut sampling = job.params.sampling.clone();
        // OpenAI's penalties replace llama.cpp's repetition penalty; the sampler needs no history.
        sampling.repeat_penalty = 1.0;
        sampling.repeat_last_n = 0;
        self.running.push(Running {
            index: job.index,
            events: job.events,
            params: job.params,
            seq,
            prompt_tokens: job.prompt.len(),
            len: job.prompt.len(),
            last: 0,
            generated: 0,
            counts: HashMap::new(),
            stream: self.tokenizer.decode_stream(true),
            pending: String::new(),
            received: job.received,
            last_token_at: None,
            done: false,
        });
        self.samplers.push(Sampler::new(sampling));
        // The gauges count this sequence before its client can see a token.
        self.update_gauges();
        let i = self.running.len() - 1;
        let mut row = std::mem::take(&mut self.logits);
        let drawn = self.sample_host(i, &mut row[..self.vocab]);
        self.logits = row;
        match drawn {
            Ok((token, logprob)) => self.accept_token(i, token, logprob),
            Err(e) => self.fail_one(i, &e),
        }
        self.remove_finished();
    }

    /// One decode step for every running sequence, as one batch.
    fn step(&mut self) {
        let n = self.running.len();
        let batch: Vec<DecodeItem> = self
            .running
            .iter()
            .map(|r| DecodeItem {
                seq: r.seq,
                token: r.last,
            })
            .collect();
        let host = self.running.iter().any(|r| r.params.needs_host_logits());
        let mut results: Vec<Result<(u32, Option<TokenLogprob>)>> = Vec::with_capacity(n);
        if host {
            let mut logits = std::mem::take(&mut self.logits);
            logits.resize(n * self.vocab, 0.0);
            let r = self.exec.decode(&batch, &mut logits);
            if r.is_ok() {
                for i in 0..n {
                    let row = &mut logits[i * self.vocab..(i + 1) * self.vocab];
                    results.push(self.sample_host(i, row));
                }
            }
            self.logits = logits;
            if let Err(e) = r {
                return self.fail_all(&format!("decode step failed: {e}"));
            }
        } else {
            self.tokens.resize(n, 0);
            if let Err(e) = self
                .exec
                .decode_sample(&batch, &mut self.samplers, &mut self.tokens)
            {
                return self.fail_all(&format!("decode step failed: {e}"));
            }
            results.extend(self.tokens.iter().map(|&t| Ok((t, None))));
        }
        for (i, drawn) in results.into_iter().enumerate() {
            self.running[i].len += 1;
            match drawn {
                Ok((token, logprob)) => self.accept_token(i, token, logprob),
                Err(e) => self.fail_one(i, &e),
            }
        }
        self.remove_finished();
    }

    /// Ends sequence `i` with an error event (the others run on).
    fn fail_one(&mut self, i: usize, e: &Error) {
        let message = format!("generation stopped: {e}");
        tracing::error!("sequence {}: {message}", self.running[i].seq);
        self.running[i].send(Event::Error {
            message,
            shutting_down: false,
        });
        self.mark_finished(i);
    }

    fn fail_all(&mut self, msg: &str) {
        tracing::error!("{msg}");
        for i in 0..self.running.len() {
            self.running[i].send(Event::Error {
                message: msg.to_string(),
                shutting_down: false,
            });
            self.mark_finished(i);
        }
        self.remove_finished();
    }

    /// Penalties and bias on `row`, logprobs of the post-penalty (pre-temperature)
    /// distribution, then the sequence's sampler draws. `NonFiniteLogits` when the model's
    /// row holds a NaN or an infinity (checked before the bias, which may be large).
    fn sample_host(&mut self, i: usize, row: &mut [f32]) -> Result<(u32, Option<TokenLogprob>)> {
        kiln_core::check_finite(row)?;
        let r = &self.running[i];
        let p = &r.params;
        self.samplers[i].adjust(row);
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            for (&t, &c) in &r.counts {
                if let Some(l) = row.get_mut(t as usize) {
                    *l -= p.frequency_penalty * c as f32 + p.presence_penalty;
                }
            }
        }
        let top_n = p.logprobs;
        let lse = top_n.map(|_| log_sum_exp(row));
        // `row` is final (bias and penalties in): the logprobs above and the draw read the
        // same distribution.
        let token = self.samplers[i].pick(row);
        let logprob = match (top_n, lse) {
            (Some(k), Some(lse)) => {
                if self.token_text.is_empty() {
                    self.token_text = (0..self.vocab as u32)
                        .map(|t| self.tokenizer.decode(&[t], false))
                        .collect();
                }
                let lp = |x: f32| {
                    if x.is_finite() {
                        (x - lse).max(-9999.0)
                    } else {
                        -9999.0
                    }
                };
                let mut top = Vec::new();
                if k > 0 {
                    let c = &mut self.candidates;
                    c.clear();
                    c.extend(
                        row.iter()
                            .enumerate()
                            .filter(|(_, l)| !l.is_nan())
                            .map(|(t, &l)| (t as u32, l)),
                    );
                    let by_desc =
                        |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
                    let k = k.min(c.len());
                    if k > 0 && k < c.len() {
                        c.select_nth_unstable_by(k - 1, by_desc);
                    }
                    c.truncate(k);
                    c.sort_unstable_by(by_desc);
                    top = c
                        .iter()
                        .map(|&(t, l)| (self.token_text[t as usize].clone(), lp(l)))
                        .collect();
                }
                let text = self
                    .token_text
                    .get(token as usize)
                    .cloned()
                    .unwrap_or_default();
                Some(TokenLogprob {
                    token: text,
                    logprob: lp(row.get(token as usize).copied().unwrap_or(f32::NAN)),
                    top,
                })
            }
            _ => None,
        };
        Ok((token, logprob))
    }

    /// Handles a sampled token: end-of-sequence, text, stop strings, limits.
    fn accept_token(&mut self, i: usize, token: u32, logprob: Option<TokenLogprob>) {
        if self.stop_tokens.contains(&token) {
            return self.finish(i, Finish::Stop);
        }
        let now = Instant::now();
        let r = &mut self.running[i];
        match r.last_token_at {
            None => self
                .metrics
                .ttft
                .observe(now.duration_since(r.received).as_secs_f64()),
            Some(t) => self
                .metrics
                .itl
                .observe(now.duration_since(t).as_secs_f64()),
        }
        r.last_token_at = Some(now);
        r.generated += 1;
        self.metrics
            .generated_tokens
            .fetch_add(1, Ordering::Relaxed);
        if r.params.presence_penalty != 0.0 || r.params.frequency_penalty != 0.0 {
            *r.counts.entry(token).or_insert(0) += 1;
        }
        r.last = token;
        if let Some(piece) = r.stream.push(token) {
            r.pending.push_str(&piece);
        }
        if let Some(cut) = find_stop(&r.pending, &r.params.stop) {
            r.pending.truncate(cut);
            let text = std::mem::take(&mut r.pending);
            r.send(Event::Delta { text, logprob });
            return self.finish_now(i, Finish::Stop);
        }
        let hold = held_back(&r.pending, &r.params.stop);
        let text: String = r.pending.drain(..r.pending.len() - hold).collect();
        r.send(Event::Delta { text, logprob });
        if r.generated >= r.params.max_tokens || r.len >= self.max_context {
            self.finish(i, Finish::Length);
        }
    }

    /// Ends sequence `i`: the text still held back is flushed (and cut at a stop string).
    fn finish(&mut self, i: usize, mut finish: Finish) {
        let r = &mut self.running[i];
        if let Some(rest) = r.stream.flush() {
            r.pending.push_str(&rest);
        }
        if let Some(cut) = find_stop(&r.pending, &r.params.stop) {
            r.pending.truncate(cut);
            if finish != Finish::Cancelled {
                finish = Finish::Stop;
            }
        }
        if !r.pending.is_empty() {
            let text = std::mem::take(&mut r.pending);
            r.send(Event::Delta {
                text,
                logprob: None,
            });
        }
        self.finish_now(i, finish);
    }

    fn finish_now(&mut self, i: usize, finish: Finish) {
        // Slot and gauges first: a client that has seen `Done` finds the metrics settled.
        self.mark_finished(i);
        self.update_gauges();
        let r = &self.running[i];
        r.send(Event::Done {
            finish,
            prompt_tokens: r.prompt_tokens,
            completion_tokens: r.generated,
        });
    }

    /// Frees the sequence's slot now; the entry is removed by `remove_finished`.
    fn mark_finished(&mut self, i: usize) {
        let r = &mut self.running[i];
        if !r.done {
            if let Err(e) = self.exec.free_sequence(r.seq) {
                tracing::error!("freeing sequence {}: {e}", r.seq);
            }
            r.done = true;
        }
    }

    fn remove_finished(&mut self) {
        let mut i = 0;
        while i < self.running.len() {
            if self.running[i].done {
                self.running.remove(i);
                self.samplers.remove(i);
            } else {
                i += 1;
            }
        }
    }
}

fn log_sum_exp(row: &[f32]) -> f32 {
    let max = row
        .iter()
        .copied()
        .filter(|x| !x.is_nan())
        .fold(f32::NEG_INFINITY, f32::max);
    if !max.is_finite() {
        return max;
    }
    let sum: f64 = row
        .iter()
        .filter(|x| !x.is_nan())
        .map(|&x| ((x - max) as f64).exp())
        .sum();
    max + sum.ln() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_helpers() {
        let stops = vec!["\n\n".to_string(), "User:".to_string()];
        assert_eq!(find_stop("hello\n\nthere", &stops), Some(5));
        assert_eq!(held_back("say Use", &stops), 3);
        assert_eq!(held_back("plain", &stops), 0);
    }

    #[test]
    fn log_sum_exp_is_stable() {
        let l = log_sum_exp(&[1000.0, 1000.0]);
        assert!((l - (1000.0 + 2f32.ln())).abs() < 1e-3);
        assert_eq!(log_sum_exp(&[f32::NEG_INFINITY]), f32::NEG_INFINITY);
    }
}
