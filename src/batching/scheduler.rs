//! The engine thread: continuous batching over one executor.
//!
//! A `LayerExecutor` is `Send` but not `Sync`, and every call on it is a blocking compute
//! step, so it lives on one dedicated OS thread that owns the [`Engine`]. HTTP handlers send
//! it [`Job`]s (prompt ids and generation settings) over a bounded channel; it answers each
//! job through that job's own tokio channel of [`Event`]s.
//!
//! Each turn of the loop: admit queued jobs while sequence slots and KV blocks are free
//! (each gets a sequence and waits to be prefilled), drop the sequences whose client has gone (their
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
//! Where the executor pages its KV cache ([`LayerExecutor::kv_blocks`]: a pool of blocks
//! shared by all sequences, `--kv-mem`), the pool rather than the slots bounds what runs,
//! as in vLLM:
//!
//! - Admission: the head of the queue starts only when the free blocks cover its tokens and
//!   its first generated one, beyond what the sequences already admitted will take (each
//!   running one's next step, each one being prefilled the rest of its tokens). Otherwise
//!   it waits, and so does everything behind it (first come, first served). With nothing
//!   else alive the whole pool is free, and it holds any context, so a request that fits
//!   the context always runs eventually.
//! - Preemption (recompute): before a decode step, the running sequences whose next
//!   position starts a block need one each; while the free blocks fall short, the sequence
//!   that arrived last is preempted: its KV cache is freed and it goes back to the queue,
//!   ahead of every job that arrived after it, keeping its tokens (prompt and generated),
//!   its sampler (RNG state included), its penalty counts and its text stream. Re-admitted,
//!   its tokens are prefilled again through the same chunked path, and it decodes on from
//!   its last sampled token: nothing is streamed twice, and the tokens it draws are those it
//!   would have drawn. The oldest request is never the one preempted, so it always
//!   progresses. `Error::KvCacheFull` from a prefill or a step (the executor's count and
//!   ours disagreeing) preempts the same way, and the work is retried on a later turn.
//!
//! Executors that do not page (plugins) are scheduled by slots alone.
//!
//! The prompt cache (llama-server's `cache_prompt`, on unless `--no-prompt-cache`): a
//! sequence that finishes is not freed but kept, idle, with its KV cache and the tokens in
//! it. A conversation's next turn resends the whole conversation, so its prompt starts with
//! what the kept sequence holds: the new job takes that sequence, cuts it back to the
//! shared prefix (`truncate_sequence`) and prefills only the rest. Which kept sequence a
//! prompt continues: [`choose_reuse`]. Kept sequences give way to live work at once: the
//! least recently used is freed whenever a slot or KV blocks are wanted (before any running
//! sequence is preempted), so the cache never makes a request wait. Usage reports the
//! reused tokens as `prompt_tokens_details.cached_tokens`. Nothing is shared between live
//! sequences (no block-level prefix sharing as in vLLM).

use crate::generation::{SequenceGeneration, SequenceRules};
use std::collections::VecDeque;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, RecvTimeoutError};
use std::sync::Arc;
use std::time::{Duration, Instant};

use kiln_core::{
    DecodeItem, Error, KvBlockUsage, LayerExecutor, Result, Sampler, SamplingParams, SeqId,
};
use kiln_formats::tokenizer::Tokenizer;
use tokio::sync::mpsc::UnboundedSender;

use super::Shutdown;
use crate::batching::metrics::Metrics;
use crate::engine::{Engine, Model};
use crate::structured::Constraint;

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
    /// May continue a kept sequence whose tokens start its prompt (the request's
    /// `cache_prompt`, default true). The prompt's last token is prefilled either way, but
    /// its logits then come from a shorter batch, which can differ in the last bits.
    pub cache_prompt: bool,
    /// A host's stop request ([`crate::Batcher`]): checked before each step, it ends the
    /// running sequence with `Finish::Cancelled` and the text so far.
    pub cancel: Option<crate::CancelToken>,
    /// A chat answer: reasoning the model writes on its own channel comes apart from the
    /// text (`Event::Delta::reasoning`).
    pub split_reasoning: bool,
}

impl JobParams {
    /// The rules its sequence generates under: a server's sequence always ends at the
    /// model's end-of-sequence tokens, and special tokens make no text.
    fn rules(&self) -> SequenceRules {
        SequenceRules {
            max_tokens: self.max_tokens,
            stop_strings: self.stop.clone(),
            stop_on_eos: true,
            presence_penalty: self.presence_penalty,
            frequency_penalty: self.frequency_penalty,
            skip_special: true,
            split_reasoning: self.split_reasoning,
        }
    }
}

/// One prompt to complete.
pub struct Job {
    /// The choice index this job answers (prompt-major over the request's prompts × `n`).
    pub index: usize,
    pub prompt: Vec<u32>,
    /// What the output must match (`response_format`), if anything.
    pub constraint: Option<Constraint>,
    pub params: JobParams,
    pub events: UnboundedSender<(usize, Event)>,
    /// When the request arrived (time-to-first-token counts from here).
    pub received: Instant,
}

pub use crate::generation::Finish;

/// What a client sends the engine thread: a request's generations (a job a choice), or
/// its texts to embed.
pub enum Request {
    Generate(Vec<Job>),
    Embed(EmbedJob),
}

/// A request's texts to embed (token ids each), answered all at once on `reply`. The
/// engine thread runs them between decode steps, a prompt chunk's worth of tokens a turn,
/// each in a free sequence slot (kept sequences give theirs up as for new work).
pub struct EmbedJob {
    pub inputs: Vec<Vec<u32>>,
    pub pooling: crate::Pooling,
    pub normalize: bool,
    pub reply: tokio::sync::oneshot::Sender<kiln_core::Result<Vec<Vec<f32>>>>,
}

pub use crate::generation::TokenLogprob;

/// What the scheduler tells a job's handler.
#[derive(Debug)]
pub enum Event {
    /// Text that became final (may be empty while a stop string is undecided), the token
    /// sampled at this step (`None` for text released at the end: what a stop string held
    /// back) and its logprob, when asked for.
    Delta {
        text: String,
        /// Reasoning that became final (a chat answer of a model that writes it apart).
        reasoning: String,
        token: Option<u32>,
        logprob: Option<TokenLogprob>,
    },
    Done {
        finish: Finish,
        prompt_tokens: usize,
        /// Prompt tokens taken from the prompt cache instead of prefilled.
        cached_tokens: usize,
        completion_tokens: usize,
    },
    /// The job failed; `shutting_down` says it was refused because the server is stopping.
    Error {
        message: String,
        shutting_down: bool,
    },
}

/// Answers an embedding request the engine thread will not run: it is shutting down.
fn refuse_embed_for_shutdown(e: EmbedJob) {
    let _ = e.reply.send(Err(Error::InvalidArgument(
        "the server is shutting down".into(),
    )));
}

/// Starts the engine thread on a loaded model (the library's [`super::batcher::Batcher`]
/// and `kiln serve` both run it).
pub fn spawn_loaded(
    mut engine: Engine,
    jobs: Receiver<Request>,
    metrics: Arc<Metrics>,
    shutdown: Arc<Shutdown>,
    grace: Duration,
    prompt_cache: bool,
) -> std::io::Result<std::thread::JoinHandle<Engine>> {
    std::thread::Builder::new()
        .name("kiln-engine".into())
        .spawn(move || {
            record_loaded(&mut engine, &metrics);
            run_loop(&mut engine, &jobs, &metrics, &shutdown, grace, prompt_cache);
            // Every sequence of the loop is freed or kept for the prompt cache; `run`
            // evicts the kept ones at the end, so the engine comes back empty.
            engine
        })
}

/// The gauges that a loaded model fixes: slots, the KV pool.
pub(crate) fn record_loaded(engine: &mut Engine, metrics: &Metrics) {
    metrics
        .slots_total
        .store(engine.executor.max_sequences() as i64, Ordering::Relaxed);
    if let Some(kv) = engine.executor.kv_blocks() {
        metrics
            .kv_blocks_total
            .store(kv.total as i64, Ordering::Relaxed);
        metrics
            .kv_blocks_used
            .store(kv.in_use() as i64, Ordering::Relaxed);
        metrics
            .kv_block_bytes
            .store(kv.block_bytes as i64, Ordering::Relaxed);
    }
    metrics.model_loaded.store(true, Ordering::Relaxed);
}

/// The engine thread's loop over `jobs` until shutdown.
pub(crate) fn run_loop(
    engine: &mut Engine,
    jobs: &Receiver<Request>,
    metrics: &Metrics,
    shutdown: &Shutdown,
    grace: Duration,
    prompt_cache: bool,
) {
    let Engine {
        model, executor, ..
    } = engine;
    Scheduler::new(model, executor.as_mut(), metrics, grace)
        .with_prompt_cache(prompt_cache)
        .run(jobs, shutdown);
}

/// Prompt tokens one turn of the loop prefills at most: one chunk of the GPU executors'
/// batched prefill, a few tens of milliseconds of work between two decode steps.
pub const PREFILL_CHUNK: usize = 512;

/// What a sequence slot is wanted for: a job not started yet, or a preempted sequence to
/// recompute.
enum Work<'t> {
    /// Its prompt is prefilled, then its first token sampled from the prompt's logits.
    New(Job),
    /// Preempted: its history (prompt and the tokens generated before it) is prefilled
    /// again, then it decodes on from its last token as if it had never stopped.
    Resume(Box<Suspended<'t>>),
}

/// A running sequence whose KV cache was given back: everything but the cache, so nothing
/// it has streamed is sent again and what it samples next is what it would have sampled.
struct Suspended<'t> {
    run: Running<'t>,
    /// Its sampler as it was, RNG state included (seeded sampling continues unchanged).
    sampler: Sampler,
}

impl Work<'_> {
    /// The tokens its sequence must hold before it decodes.
    fn tokens(&self) -> &[u32] {
        match self {
            Work::New(job) => &job.prompt,
            Work::Resume(s) => &s.run.history,
        }
    }

    /// Whether it may continue a kept sequence (its request's `cache_prompt`).
    fn may_reuse(&self) -> bool {
        match self {
            Work::New(job) => job.params.cache_prompt,
            Work::Resume(s) => s.run.params.cache_prompt,
        }
    }

    fn events(&self) -> &UnboundedSender<(usize, Event)> {
        match self {
            Work::New(job) => &job.events,
            Work::Resume(s) => &s.run.events,
        }
    }
}

/// Work waiting for a sequence slot and, where the executor pages its KV cache, for the
/// blocks its tokens need.
struct Waiting<'t> {
    /// Order of arrival: the queue is kept sorted by it, so a preempted sequence goes back
    /// ahead of every job that came after it.
    ticket: u64,
    work: Work<'t>,
}

/// Admitted work whose tokens are being prefilled, a chunk per turn.
struct Admitting<'t> {
    ticket: u64,
    seq: SeqId,
    /// Tokens of `work.tokens()` already in the KV cache.
    done: usize,
    /// Of those, the ones a kept sequence brought (the prompt cache).
    cached: usize,
    work: Work<'t>,
}

/// A finished sequence kept, idle, with its KV cache, for a prompt that starts with its
/// tokens (the prompt cache).
struct KeptSeq {
    seq: SeqId,
    /// The tokens in its KV cache, in order.
    tokens: Vec<u32>,
    /// When it was last used (a counter): the least recently used is freed first.
    last_used: u64,
}

/// Which kept sequence a prompt should continue, and how many of its tokens to keep: the
/// one sharing the longest prefix with `prompt` (the most recently used of equals), cut so
/// that at least the prompt's last token is prefilled again (its logits give the first
/// token). Taken when the shared prefix is at least half of what that sequence holds (the
/// same conversation one turn on, or the same prompt again) or when `slots_full` (a kept
/// sequence gives up its slot anyway); a short match against a long kept conversation
/// leaves it for its own next turn. `None`: start a fresh sequence.
///
/// `window`: the model's sliding window, if it has one. Its layers keep a ring of rows, and
/// cutting a sequence past the window back by more than a position may lose rows the next
/// token reads, which the executor recomputes by running the whole kept prefix again, in
/// one unchunked prefill that would stall every running stream: such cuts are not taken
/// (a conversation's next turn cuts nothing; a regenerated answer would).
fn choose_reuse(
    kept: &[KeptSeq],
    prompt: &[u32],
    slots_full: bool,
    window: Option<usize>,
) -> Option<(usize, usize)> {
    let limit = prompt.len().saturating_sub(1);
    let cheap_cut = |held: usize, keep: usize| match window {
        Some(w) => held <= w || held - keep <= 1,
        None => true,
    };
    let (i, shared) = kept
        .iter()
        .enumerate()
        .map(|(i, k)| {
            let shared = k
                .tokens
                .iter()
                .zip(prompt)
                .take_while(|(a, b)| a == b)
                .count()
                .min(limit);
            (i, shared)
        })
        .filter(|&(i, shared)| cheap_cut(kept[i].tokens.len(), shared))
        .max_by_key(|&(i, shared)| (shared, kept[i].last_used))?;
    let worth = shared > 0 && (2 * shared >= kept[i].tokens.len() || slots_full);
    worth.then_some((i, shared))
}

/// One running sequence.
struct Running<'t> {
    /// Order of arrival (see [`Waiting::ticket`]): the highest is preempted first.
    ticket: u64,
    index: usize,
    events: UnboundedSender<(usize, Event)>,
    params: JobParams,
    seq: SeqId,
    /// Its output's grammar and penalties, text, stop strings and limits.
    generation: SequenceGeneration<'t>,
    prompt_tokens: usize,
    /// Prompt tokens the prompt cache supplied.
    cached_tokens: usize,
    /// The tokens in the KV cache, prompt first: what a preempted sequence recomputes.
    history: Vec<u32>,
    /// The last sampled token: the input of the next decode step.
    last: u32,
    received: Instant,
    last_token_at: Option<Instant>,
    /// Its slot is freed; the entry goes at the next `remove_finished`.
    done: bool,
}

impl Running<'_> {
    /// Whether its next token is drawn on the host from the step's logits (logprobs are
    /// read from them too).
    fn needs_host_logits(&self) -> bool {
        self.params.logprobs.is_some() || self.generation.needs_host_logits()
    }

    fn send(&self, event: Event) {
        // A closed channel means the client left; the next turn frees the sequence.
        let _ = self.events.send((self.index, event));
    }

    /// Sends the text still held back, cut at a stop string; the finish reason to report
    /// (`Stop` where a stop string turned up in it).
    fn flush_held(&mut self, finish: Finish) -> Finish {
        let ended = self.generation.end(finish);
        if !ended.text.is_empty() || !ended.reasoning.is_empty() {
            self.send(Event::Delta {
                text: ended.text,
                reasoning: ended.reasoning,
                token: None,
                logprob: None,
            });
        }
        ended.finish.unwrap_or(finish)
    }

    fn send_done(&self, finish: Finish) {
        self.send(Event::Done {
            finish,
            prompt_tokens: self.prompt_tokens,
            cached_tokens: self.cached_tokens,
            completion_tokens: self.generation.generated(),
        });
    }
}

/// Blocks a sequence of `len` tokens takes for its next decode step (0 or 1).
fn next_step_blocks(kv: &KvBlockUsage, len: usize) -> usize {
    kv.blocks_for(len + 1) - kv.blocks_for(len)
}

struct Scheduler<'e> {
    tokenizer: &'e Tokenizer,
    exec: &'e mut dyn LayerExecutor,
    metrics: &'e Metrics,
    grace: Duration,
    vocab: usize,
    max_context: usize,
    max_seqs: usize,
    /// Taken from the job channel (or preempted) and not admitted yet, by ticket.
    waiting: VecDeque<Waiting<'e>>,
    next_ticket: u64,
    /// Oldest first; one chunk of the first is prefilled per turn.
    admitting: Vec<Admitting<'e>>,
    running: Vec<Running<'e>>,
    /// `samplers[i]` belongs to `running[i]` (a separate vector: `decode_sample` takes a slice).
    samplers: Vec<Sampler>,
    logits: Vec<f32>,
    tokens: Vec<u32>,
    /// Scratch for top-logprob selection.
    candidates: Vec<(u32, f32)>,
    /// Every token's text, decoded once, for logprobs.
    token_text: Vec<String>,
    /// Keep finished sequences for the prompts that continue them.
    prompt_cache: bool,
    /// Finished sequences kept with their KV cache (the prompt cache).
    kept: Vec<KeptSeq>,
    /// The clock of [`KeptSeq::last_used`].
    uses: u64,
    /// The model's sliding window (see [`choose_reuse`]).
    window: Option<usize>,
    /// Embedding requests, oldest first, with the vectors of their inputs done so far.
    embeds: VecDeque<(EmbedJob, Vec<Vec<f32>>)>,
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
        let window = exec.config().sliding_window.map(|sw| sw.window);
        let tokenizer = &model.tokenizer;
        Scheduler {
            tokenizer,
            exec,
            metrics,
            grace,
            vocab,
            max_context,
            max_seqs,
            waiting: VecDeque::new(),
            next_ticket: 0,
            admitting: Vec::new(),
            running: Vec::new(),
            samplers: Vec::new(),
            logits: Vec::new(),
            tokens: Vec::new(),
            candidates: Vec::new(),
            token_text: Vec::new(),
            prompt_cache: true,
            kept: Vec::new(),
            embeds: VecDeque::new(),
            uses: 0,
            window,
        }
    }

    fn with_prompt_cache(mut self, on: bool) -> Self {
        self.prompt_cache = on;
        self
    }

    /// Serves the requests arriving on `jobs` (each a batch of jobs, a choice each) until
    /// shutdown.
    fn run(mut self, jobs: &Receiver<Request>, shutdown: &Shutdown) {
        let mut deadline: Option<Instant> = None;
        self.update_gauges();
        // Ends when shutdown has drained everything, or when every sender is gone and
        // nothing runs; the kept sequences are freed after it either way.
        'serve: loop {
            if shutdown.is_set() {
                let deadline = *deadline.get_or_insert_with(|| Instant::now() + self.grace);
                for request in jobs.try_iter() {
                    match request {
                        Request::Generate(request) => {
                            for job in request {
                                self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                                refuse_for_shutdown(&job);
                            }
                        }
                        Request::Embed(e) => refuse_embed_for_shutdown(e),
                    }
                }
                for (e, _) in std::mem::take(&mut self.embeds) {
                    refuse_embed_for_shutdown(e);
                }
                // Jobs not started are refused as the queued ones are; preempted sequences
                // have streamed already and go on like the running ones.
                let mut kept = VecDeque::new();
                for w in std::mem::take(&mut self.waiting) {
                    match w.work {
                        Work::New(job) => {
                            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                            refuse_for_shutdown(&job);
                        }
                        work => kept.push_back(Waiting { work, ..w }),
                    }
                }
                self.waiting = kept;
                if Instant::now() >= deadline {
                    for i in (0..self.running.len()).rev() {
                        self.finish(i, Finish::Cancelled);
                        self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    }
                    self.remove_finished();
                    for a in std::mem::take(&mut self.admitting) {
                        self.drop_admitting(a, Some("the server is shutting down"));
                    }
                    for w in std::mem::take(&mut self.waiting) {
                        self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
                        self.drop_work(w.work, Some("the server is shutting down"));
                    }
                }
                if self.running.is_empty() && self.admitting.is_empty() && self.waiting.is_empty() {
                    break;
                }
                self.admit_waiting();
            } else {
                while self.alive() < self.max_seqs {
                    if !self.waiting.is_empty() {
                        if !self.admit_next() {
                            break;
                        }
                        continue;
                    }
                    let request = if self.alive() == 0 && self.embeds.is_empty() {
                        match jobs.recv_timeout(Duration::from_millis(50)) {
                            Ok(request) => request,
                            Err(RecvTimeoutError::Timeout) => break,
                            Err(RecvTimeoutError::Disconnected) => break 'serve,
                        }
                    } else {
                        match jobs.try_recv() {
                            Ok(request) => request,
                            Err(_) => break,
                        }
                    };
                    match request {
                        Request::Generate(request) => {
                            for job in request {
                                self.enqueue(job);
                            }
                        }
                        Request::Embed(e) => self.embeds.push_back((e, Vec::new())),
                    }
                }
            }
            // Clients that went away: free their slots before spending a step on them.
            for i in (0..self.running.len()).rev() {
                let r = &self.running[i];
                if r.events.is_closed() {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    self.mark_finished(i);
                } else if !r.done && r.params.cancel.as_ref().is_some_and(|c| c.is_cancelled()) {
                    self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                    self.finish(i, Finish::Cancelled);
                }
            }
            self.remove_finished();
            self.drop_closed_waiting();
            self.embed_turn();
            self.prefill_chunk();
            if !self.running.is_empty() {
                self.step();
            }
            self.update_gauges();
        }
        while self.evict_kept(None) {}
        self.update_gauges();
    }

    /// Embeds inputs of the oldest embedding requests, up to a prompt chunk's worth of
    /// tokens a turn. A request's inputs go together through shared passes
    /// ([`crate::embedding::embed_batch_on`]), as many at once as free slots, free KV
    /// blocks and the turn's budget allow, each in a sequence of its own taken and freed at
    /// once; waits (for a later turn) while no slot or no KV blocks are free. A request is
    /// answered when all its inputs are done, or with the first error.
    fn embed_turn(&mut self) {
        let mut budget = PREFILL_CHUNK;
        while budget > 0 {
            let Some((job, done)) = self.embeds.front() else {
                return;
            };
            if job.reply.is_closed() {
                self.embeds.pop_front();
                continue;
            }
            if done.len() == job.inputs.len() {
                let (job, done) = self.embeds.pop_front().expect("a front");
                let _ = job.reply.send(Ok(done));
                continue;
            }
            let tokens = job.inputs[done.len()].len();
            while !self.fits(tokens, None) {
                if !self.evict_kept(None) {
                    return;
                }
            }
            while self.alive() + self.kept.len() >= self.max_seqs && self.evict_kept(None) {}
            if self.alive() >= self.max_seqs {
                return;
            }
            // The first input fits (above); the next ones join while they fit too.
            let slots = self.max_seqs - self.alive() - self.kept.len();
            let kv = self.exec.kv_blocks();
            let spare = kv.map(|kv| kv.free.saturating_sub(self.committed_blocks(&kv)));
            let need = |len: usize| kv.map_or(0, |kv| kv.blocks_for(len + 1));
            let (job, done) = self.embeds.front_mut().expect("a front");
            let (mut count, mut used, mut blocks) = (1, tokens, need(tokens));
            for input in &job.inputs[done.len() + 1..] {
                let more = need(input.len());
                if count == slots
                    || used + input.len() > budget
                    || spare.is_some_and(|spare| blocks + more > spare)
                {
                    break;
                }
                count += 1;
                used += input.len();
                blocks += more;
            }
            let inputs: Vec<&[u32]> = job.inputs[done.len()..done.len() + count]
                .iter()
                .map(Vec::as_slice)
                .collect();
            let run = crate::embedding::embed_in_new_sequences(
                &mut *self.exec,
                &inputs,
                job.pooling,
                job.normalize,
            );
            match run {
                Ok(v) => done.extend(v),
                // Blocks taken since `fits` (cannot happen between steps): a later turn.
                Err(Error::KvCacheFull { .. }) => return,
                Err(e) => {
                    let (job, _) = self.embeds.pop_front().expect("a front");
                    let _ = job.reply.send(Err(e));
                }
            }
            budget = budget.saturating_sub(used);
        }
    }

    /// Sequences holding a slot: running or being prefilled.
    fn alive(&self) -> usize {
        self.running.iter().filter(|r| !r.done).count() + self.admitting.len()
    }

    fn update_gauges(&self) {
        let n = self.alive() as i64;
        self.metrics.running.store(n, Ordering::Relaxed);
        self.metrics.slots_used.store(n, Ordering::Relaxed);
        self.metrics
            .kept_sequences
            .store(self.kept.len() as i64, Ordering::Relaxed);
        if let Some(kv) = self.exec.kv_blocks() {
            let m = self.metrics;
            m.kv_blocks_total.store(kv.total as i64, Ordering::Relaxed);
            m.kv_blocks_used
                .store(kv.in_use() as i64, Ordering::Relaxed);
            let kept: usize = self
                .kept
                .iter()
                .map(|k| kv.blocks_for(k.tokens.len()))
                .sum();
            m.kv_blocks_kept.store(kept as i64, Ordering::Relaxed);
        }
    }

    /// A job from the channel joins the waiting queue (last: it is the newest), or is
    /// answered at once when its client has gone or its prompt cannot fit the context.
    fn enqueue(&mut self, job: Job) {
        if job.events.is_closed() {
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        }
        if job.prompt.is_empty() || job.prompt.len() >= self.max_context {
            self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
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
        let ticket = self.next_ticket;
        self.next_ticket += 1;
        self.waiting.push_back(Waiting {
            ticket,
            work: Work::New(job),
        });
    }

    /// Puts preempted work back in the queue at its ticket's place: ahead of every job that
    /// arrived after it. It waits like a queued request (the queue-depth gauge counts it).
    fn requeue(&mut self, ticket: u64, work: Work<'e>) {
        let at = self.waiting.partition_point(|w| w.ticket < ticket);
        self.waiting.insert(at, Waiting { ticket, work });
        self.metrics.queue_depth.fetch_add(1, Ordering::Relaxed);
    }

    /// Admits the waiting work at the head of the queue while slots and KV blocks allow
    /// (during shutdown: only preempted sequences are left to admit).
    fn admit_waiting(&mut self) {
        while self.alive() < self.max_seqs && !self.waiting.is_empty() {
            if !self.admit_next() {
                break;
            }
        }
    }

    /// Admits the head of the waiting queue when the KV cache has room for it; `false` when
    /// it must wait. First come, first served: a head that does not fit holds back the
    /// rest, so a long prompt is not starved by short ones.
    ///
    /// With the prompt cache, the head may continue a kept sequence ([`choose_reuse`]),
    /// which is cut back to the shared prefix first; kept sequences are freed, least
    /// recently used first, while the head lacks blocks or a slot.
    fn admit_next(&mut self) -> bool {
        let Some(head) = self.waiting.front() else {
            return false;
        };
        let tokens = head.work.tokens().len();
        let slots_full = self.alive() + self.kept.len() >= self.max_seqs;
        let reuse = match head.work.may_reuse() {
            true => choose_reuse(&self.kept, head.work.tokens(), slots_full, self.window),
            false => None,
        };
        let reuse = reuse.and_then(|(i, keep)| self.cut_kept(i, keep));
        let reused_seq = reuse.map(|(seq, _)| seq);
        while !self.fits(tokens, reuse) {
            if !self.evict_kept(reused_seq) {
                return false;
            }
        }
        if reuse.is_none() {
            while self.alive() + self.kept.len() >= self.max_seqs && self.evict_kept(None) {}
        }
        let w = self.waiting.pop_front().expect("a head");
        self.metrics.queue_depth.fetch_sub(1, Ordering::Relaxed);
        let taken = match reuse {
            Some((seq, keep)) => {
                self.kept.retain(|k| k.seq != seq);
                Ok((seq, keep))
            }
            None => self.exec.new_sequence().map(|seq| (seq, 0)),
        };
        match taken {
            Ok((seq, done)) => self.admitting.push(Admitting {
                ticket: w.ticket,
                seq,
                done,
                cached: done,
                work: w.work,
            }),
            Err(e) => self.drop_work(w.work, Some(&format!("no sequence slot: {e}"))),
        }
        self.update_gauges();
        true
    }

    /// Cuts kept sequence `i` back to its first `keep` tokens for the work about to take
    /// it: `Some((seq, keep))`, or `None` when the executor refused the cut (the sequence is
    /// freed then, and the work starts afresh).
    fn cut_kept(&mut self, i: usize, keep: usize) -> Option<(SeqId, usize)> {
        self.uses += 1;
        let k = &mut self.kept[i];
        k.last_used = self.uses;
        if keep < k.tokens.len() {
            if let Err(e) = self.exec.truncate_sequence(k.seq, keep) {
                tracing::warn!("prompt cache: cutting sequence {} failed: {e}", k.seq);
                let k = self.kept.remove(i);
                if let Err(e) = self.exec.free_sequence(k.seq) {
                    tracing::error!("freeing kept sequence {}: {e}", k.seq);
                }
                return None;
            }
            k.tokens.truncate(keep);
        }
        Some((k.seq, keep))
    }

    /// Frees the least recently used kept sequence other than `spare`; `false` when there
    /// is none.
    fn evict_kept(&mut self, spare: Option<SeqId>) -> bool {
        let Some(i) = (0..self.kept.len())
            .filter(|&i| Some(self.kept[i].seq) != spare)
            .min_by_key(|&i| self.kept[i].last_used)
        else {
            return false;
        };
        let k = self.kept.remove(i);
        if let Err(e) = self.exec.free_sequence(k.seq) {
            tracing::error!("freeing kept sequence {}: {e}", k.seq);
        }
        true
    }

    /// Keeps running sequence `i`, finished, with its KV cache for the prompts that
    /// continue it — or frees it where the prompt cache is off or the executor's count of
    /// its tokens disagrees with ours (a kept sequence is only as good as its token list).
    fn keep_or_free(&mut self, i: usize) {
        let r = &mut self.running[i];
        if r.done {
            return;
        }
        r.done = true;
        let (seq, tokens) = (r.seq, std::mem::take(&mut r.history));
        if self.prompt_cache && self.exec.sequence_len(seq).ok() == Some(tokens.len()) {
            self.uses += 1;
            self.kept.push(KeptSeq {
                seq,
                tokens,
                last_used: self.uses,
            });
        } else if let Err(e) = self.exec.free_sequence(seq) {
            tracing::error!("freeing sequence {seq}: {e}");
        }
    }

    /// Blocks the running sequences take in their next decode step (one each whose next
    /// position starts a block).
    fn next_step_need(&self, kv: &KvBlockUsage) -> usize {
        self.running
            .iter()
            .filter(|r| !r.done)
            .map(|r| next_step_blocks(kv, r.history.len()))
            .sum()
    }

    /// Whether work of `tokens` tokens may start: the free KV blocks cover them and its
    /// first decode step, beyond what the sequences already admitted will take (each running
    /// one's next step, each admitting one's rest of its tokens and its first step). With
    /// nothing else alive the whole pool is free, and it holds any context, so the head of
    /// the queue always starts then. Executors that do not page: always.
    ///
    /// `reuse`: the kept sequence it continues and the tokens it keeps (already cut), whose
    /// blocks it holds already. Kept sequences hold blocks too; the caller frees them while
    /// this says no, so "nothing else alive" also means nothing else kept.
    fn fits(&self, tokens: usize, reuse: Option<(SeqId, usize)>) -> bool {
        let Some(kv) = self.exec.kv_blocks() else {
            return true;
        };
        let other_kept = self.kept.len() - usize::from(reuse.is_some());
        if self.alive() == 0 && other_kept == 0 {
            return true;
        }
        let held = reuse.map_or(0, |(_, keep)| kv.blocks_for(keep));
        kv.blocks_for(tokens + 1) - held + self.committed_blocks(&kv) <= kv.free
    }

    /// KV blocks the running sequences' next step and the admitted prompts' remaining
    /// chunks will take.
    fn committed_blocks(&self, kv: &kiln_core::KvBlockUsage) -> usize {
        let running = self.next_step_need(kv);
        let admitting: usize = self
            .admitting
            .iter()
            .map(|a| kv.blocks_for(a.work.tokens().len() + 1) - kv.blocks_for(a.done))
            .sum();
        running + admitting
    }

    /// Waiting work whose client has gone leaves the queue (a preempted sequence holds no
    /// slot, so there is nothing to free).
    fn drop_closed_waiting(&mut self) {
        let before = self.waiting.len();
        self.waiting.retain(|w| !w.work.events().is_closed());
        let gone = (before - self.waiting.len()) as i64;
        if gone > 0 {
            self.metrics.queue_depth.fetch_sub(gone, Ordering::Relaxed);
            self.metrics
                .cancelled
                .fetch_add(gone as u64, Ordering::Relaxed);
        }
    }

    /// Frees an admitted sequence before it ran: its client left (`why` None: counted as
    /// cancelled) or it cannot go on (`why`: sent as an error).
    fn drop_admitting(&mut self, a: Admitting<'e>, why: Option<&str>) {
        if let Err(e) = self.exec.free_sequence(a.seq) {
            tracing::error!("freeing sequence {}: {e}", a.seq);
        }
        self.drop_work(a.work, why);
        self.update_gauges();
    }

    /// Answers work that holds no sequence and will not run: `why` None, its client left
    /// (counted as cancelled); else a job not started gets `why` as an error and a
    /// preempted sequence, which has streamed already, ends as cancelled on shutdown or
    /// with `why` as an error.
    fn drop_work(&mut self, work: Work<'e>, why: Option<&str>) {
        let Some(msg) = why else {
            self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let shutting_down = msg.contains("shutting down");
        match work {
            Work::Resume(mut s) if shutting_down => {
                self.metrics.cancelled.fetch_add(1, Ordering::Relaxed);
                let finish = s.run.flush_held(Finish::Cancelled);
                s.run.send_done(finish);
            }
            work => {
                let _ = work.events().send((
                    match &work {
                        Work::New(job) => job.index,
                        Work::Resume(s) => s.run.index,
                    },
                    Event::Error {
                        message: msg.to_string(),
                        shutting_down,
                    },
                ));
            }
        }
    }

    /// One chunk of the oldest admitted work; after its last chunk the sequence runs: a new
    /// job with its first token sampled from that chunk's logits, a preempted one from the
    /// token it had sampled last. A chunk refused for want of KV blocks preempts the newest
    /// sequence (maybe this one) and is tried again on a later turn.
    fn prefill_chunk(&mut self) {
        if self.admitting.is_empty() {
            return;
        }
        if self.admitting[0].work.events().is_closed() {
            let a = self.admitting.remove(0);
            return self.drop_admitting(a, None);
        }
        let a = &mut self.admitting[0];
        let tokens = a.work.tokens();
        let end = (a.done + PREFILL_CHUNK).min(tokens.len());
        self.logits.resize(self.vocab, 0.0);
        let result = self
            .exec
            .prefill(a.seq, &tokens[a.done..end], &mut self.logits[..self.vocab]);
        match result {
            Ok(()) => {}
            // Blocks given back: the same work is tried again on the next turn.
            Err(Error::KvCacheFull { .. }) if self.free_blocks() => return,
            Err(e) => {
                let a = self.admitting.remove(0);
                return self.drop_admitting(a, Some(&format!("prefill failed: {e}")));
            }
        }
        a.done = end;
        if end == tokens.len() {
            let a = self.admitting.remove(0);
            match a.work {
                Work::New(job) => self.start_running(a.ticket, job, a.seq, a.cached),
                Work::Resume(s) => {
                    let Suspended { mut run, sampler } = *s;
                    run.seq = a.seq;
                    self.running.push(run);
                    self.samplers.push(sampler);
                    self.update_gauges();
                }
            }
        }
    }

    /// A fully prefilled job joins the running sequences; its first token comes from the
    /// logits of the prefill's last chunk (in `self.logits`).
    /// `cached`: the prompt's tokens a kept sequence supplied.
    fn start_running(&mut self, ticket: u64, job: Job, seq: SeqId, cached: usize) {
        self.metrics
            .prompt_tokens
            .fetch_add(job.prompt.len() as u64, Ordering::Relaxed);
        self.metrics
            .prompt_tokens_cached
            .fetch_add(cached as u64, Ordering::Relaxed);
        let sampling = job.params.sampling.clone();
        // A repetition penalty (the library's `Batcher`; the server's requests use OpenAI's
        // penalties instead) counts the prompt, as a `Session` does.
        let mut sampler = Sampler::new(sampling);
        if job.params.sampling.repeat_penalty != 1.0 {
            for &t in &job.prompt {
                sampler.accept(t);
            }
        }
        let generation =
            SequenceGeneration::new(self.tokenizer, job.params.rules(), job.constraint);
        self.running.push(Running {
            ticket,
            index: job.index,
            events: job.events,
            params: job.params,
            seq,
            generation,
            prompt_tokens: job.prompt.len(),
            cached_tokens: cached,
            history: job.prompt,
            last: 0,
            received: job.received,
            last_token_at: None,
            done: false,
        });
        self.samplers.push(sampler);
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

    /// Preempts the sequence that arrived last (the highest ticket) among the running and
    /// the admitting ones, as vLLM's recompute preemption does: its KV cache is freed and it
    /// waits at the front of the queue with its tokens, sampler and stream, to be prefilled
    /// again when blocks are free. The oldest request is thus never the one stopped, and
    /// always progresses. `false` when no sequence is alive.
    fn preempt_newest(&mut self) -> bool {
        let run = (0..self.running.len())
            .filter(|&i| !self.running[i].done)
            .max_by_key(|&i| self.running[i].ticket);
        let adm = (0..self.admitting.len()).max_by_key(|&i| self.admitting[i].ticket);
        let (ticket, seq, work) = match (run, adm) {
            (None, None) => return false,
            (Some(r), a) if a.is_none_or(|a| self.running[r].ticket > self.admitting[a].ticket) => {
                let run = self.running.remove(r);
                let sampler = self.samplers.remove(r);
                (
                    run.ticket,
                    run.seq,
                    Work::Resume(Box::new(Suspended { run, sampler })),
                )
            }
            (_, Some(a)) => {
                let a = self.admitting.remove(a);
                (a.ticket, a.seq, a.work)
            }
            (Some(_), None) => unreachable!("taken by the arm above"),
        };
        if let Err(e) = self.exec.free_sequence(seq) {
            tracing::error!("freeing preempted sequence {seq}: {e}");
        }
        tracing::info!(
            "KV cache full: sequence {seq} preempted ({} tokens to recompute)",
            work.tokens().len()
        );
        self.metrics.preemptions.fetch_add(1, Ordering::Relaxed);
        self.requeue(ticket, work);
        self.update_gauges();
        true
    }

    /// Before a decode step: every running sequence whose next position starts a new KV
    /// block needs one; while the free blocks do not cover them, blocks are freed
    /// ([`Scheduler::free_blocks`]).
    fn make_room(&mut self) {
        while let Some(kv) = self.exec.kv_blocks() {
            if self.next_step_need(&kv) <= kv.free || !self.free_blocks() {
                return;
            }
        }
    }

    /// Gives KV blocks back for live work: a kept sequence is freed (least recently used
    /// first), or when none is left the newest live sequence is preempted. A sequence alone
    /// always fits (the pool holds a whole context), so the last one is never preempted.
    /// `false` when nothing could be freed.
    fn free_blocks(&mut self) -> bool {
        self.evict_kept(None) || (self.alive() > 1 && self.preempt_newest())
    }

    /// One decode step for every running sequence, as one batch. A step refused for want of
    /// KV blocks preempts the newest sequence; the others step on the next turn.
    fn step(&mut self) {
        self.make_room();
        let n = self.running.len();
        if n == 0 {
            return;
        }
        let batch: Vec<DecodeItem> = self
            .running
            .iter()
            .map(|r| DecodeItem {
                seq: r.seq,
                token: r.last,
            })
            .collect();
        let host = self.running.iter().any(Running::needs_host_logits);
        let mut results: Vec<Result<(u32, Option<TokenLogprob>)>> = Vec::with_capacity(n);
        let outcome = if host {
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
            r
        } else {
            self.tokens.resize(n, 0);
            let r = self
                .exec
                .decode_sample(&batch, &mut self.samplers, &mut self.tokens);
            results.extend(self.tokens.iter().map(|&t| Ok((t, None))));
            r
        };
        match outcome {
            Ok(()) => {}
            // Blocks given back: the same work is tried again on the next turn.
            Err(Error::KvCacheFull { .. }) if self.free_blocks() => return,
            Err(e) => return self.fail_all(&format!("decode step failed: {e}")),
        }
        for (i, drawn) in results.into_iter().enumerate() {
            self.running[i].history.push(batch[i].token);
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
        let logprobs = self.running[i].params.logprobs;
        if logprobs.is_some() && self.token_text.is_empty() {
            self.token_text = (0..self.vocab as u32)
                .map(|t| self.tokenizer.decode(&[t], false))
                .collect();
        }
        let names = &self.token_text;
        self.running[i].generation.draw(
            &mut self.samplers[i],
            row,
            logprobs,
            &mut self.candidates,
            |t| names.get(t as usize).cloned().unwrap_or_default(),
        )
    }

    /// Handles a sampled token: what its generation makes of it (end-of-sequence, text,
    /// stop strings, limits) goes to the client.
    fn accept_token(&mut self, i: usize, token: u32, logprob: Option<TokenLogprob>) {
        let r = &mut self.running[i];
        let accepted = r
            .generation
            .accept(token, r.history.len(), self.max_context);
        if accepted.kept {
            let now = Instant::now();
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
            self.metrics
                .generated_tokens
                .fetch_add(1, Ordering::Relaxed);
            r.last = token;
        }
        if accepted.kept || !accepted.text.is_empty() || !accepted.reasoning.is_empty() {
            r.send(Event::Delta {
                text: accepted.text,
                reasoning: accepted.reasoning,
                token: accepted.kept.then_some(token),
                logprob: logprob.filter(|_| accepted.kept),
            });
        }
        if let Some(finish) = accepted.finish {
            self.finish_now(i, finish);
        }
    }

    /// Ends sequence `i`: the text still held back is flushed (and cut at a stop string).
    fn finish(&mut self, i: usize, finish: Finish) {
        let finish = self.running[i].flush_held(finish);
        self.finish_now(i, finish);
    }

    fn finish_now(&mut self, i: usize, finish: Finish) {
        // Slot and gauges first: a client that has seen `Done` finds the metrics settled.
        self.keep_or_free(i);
        self.update_gauges();
        self.running[i].send_done(finish);
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

/// Answers a job that never started with the shutdown error (503 to its client).
fn refuse_for_shutdown(job: &Job) {
    let _ = job.events.send((
        job.index,
        Event::Error {
            message: "the server is shutting down".into(),
            shutting_down: true,
        },
    ));
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(tokens: &[u32], last_used: u64) -> KeptSeq {
        KeptSeq {
            seq: last_used as SeqId,
            tokens: tokens.to_vec(),
            last_used,
        }
    }

    #[test]
    fn reuse_takes_the_longest_shared_prefix_and_leaves_the_last_token() {
        let cache = [
            kept(&[1, 2, 3], 1),
            kept(&[1, 2, 3, 4, 5, 6], 2),
            kept(&[9], 3),
        ];
        // The next turn of conversation 1: all of it kept.
        assert_eq!(
            choose_reuse(&cache, &[1, 2, 3, 4, 5, 6, 7, 8], false, None),
            Some((1, 6))
        );
        // The same prompt again: one token short, so its logits are computed.
        assert_eq!(
            choose_reuse(&cache, &[1, 2, 3, 4, 5, 6], false, None),
            Some((1, 5))
        );
        // A one-token prompt has nothing to reuse.
        assert_eq!(choose_reuse(&cache, &[9], false, None), None);
        // Nothing shared.
        assert_eq!(choose_reuse(&cache, &[7, 7, 7], true, None), None);
        assert_eq!(choose_reuse(&[], &[1, 2], true, None), None);
    }

    #[test]
    fn reuse_spares_a_long_conversation_for_a_short_match_unless_slots_are_full() {
        let cache = [kept(&[1, 2, 3, 4, 5, 6, 7, 8], 1)];
        // Two of eight tokens shared (say, a system prompt): start afresh while a slot is
        // free, so the conversation stays for its own next turn.
        assert_eq!(choose_reuse(&cache, &[1, 2, 9, 9], false, None), None);
        // With every slot taken, some kept sequence gives way anyway: reuse what is shared.
        assert_eq!(
            choose_reuse(&cache, &[1, 2, 9, 9], true, None),
            Some((0, 2))
        );
        // Half of it shared is worth taking.
        assert_eq!(
            choose_reuse(&cache, &[1, 2, 3, 4, 0], false, None),
            Some((0, 4))
        );
    }

    #[test]
    fn reuse_with_a_sliding_window_cuts_long_sequences_by_one_position_at_most() {
        let held: Vec<u32> = (0..10).collect();
        let cache = [kept(&held, 1)];
        let next_turn: Vec<u32> = (0..14).collect();
        // The next turn cuts nothing; the same prompt again cuts one position.
        assert_eq!(
            choose_reuse(&cache, &next_turn, false, Some(4)),
            Some((0, 10))
        );
        assert_eq!(choose_reuse(&cache, &held, false, Some(4)), Some((0, 9)));
        // Back by two or more past the window: the ring may have lost rows, so afresh.
        assert_eq!(choose_reuse(&cache, &held[..9], false, Some(4)), None);
        // Within the window nothing has been overwritten yet.
        assert_eq!(
            choose_reuse(&cache, &held[..9], false, Some(16)),
            Some((0, 8))
        );
        assert_eq!(choose_reuse(&cache, &held[..9], false, None), Some((0, 8)));
    }

    #[test]
    fn reuse_prefers_the_most_recent_of_equal_matches() {
        let cache = [
            kept(&[5, 6, 7], 4),
            kept(&[5, 6, 8], 9),
            kept(&[5, 6, 9], 2),
        ];
        assert_eq!(
            choose_reuse(&cache, &[5, 6, 1, 1], false, None),
            Some((1, 2))
        );
    }

    #[test]
    fn log_sum_exp_is_stable() {
        let l = crate::generation::log_sum_exp(&[1000.0, 1000.0]);
        assert!((l - (1000.0 + 2f32.ln())).abs() < 1e-3);
        assert_eq!(
            crate::generation::log_sum_exp(&[f32::NEG_INFINITY]),
            f32::NEG_INFINITY
        );
    }
}
