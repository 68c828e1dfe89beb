//! `kiln serve`: an OpenAI-compatible HTTP server.
//!
//! Endpoints: `POST /v1/chat/completions`, `POST /v1/completions`, `POST /v1/embeddings`
//! (run by the engine thread between decode steps), `GET /v1/models`,
//! `GET /health` (503 `{"status":"loading"}` until the model is loaded, then 200),
//! `GET /metrics` (Prometheus text) and llama-server's `POST /tokenize`, `/detokenize` and
//! `/apply-template`. Built on axum and tokio; binds 127.0.0.1 by default.
//!
//! How it is put together:
//!
//! - The socket is bound first and the model loads in the background on the engine thread
//!   ([`scheduler`]), which then owns the `Engine` for the life of the server: executors
//!   are not `Sync`, and each of their calls is a blocking compute step. Handlers never
//!   touch it; they validate the body ([`api`]), render and tokenize the prompt with their
//!   own copy of the tokenizer ([`frontend`], on tokio's blocking pool), compile a
//!   `response_format` schema into a sampling constraint ([`crate::structured`]), and send the
//!   request's jobs (one per choice: prompts × `n`) as one message over a bounded channel
//!   (`--queue` requests). A full queue answers 429 with `Retry-After`.
//! - Finished sequences are kept with their KV cache for prompts that continue them (the
//!   prompt cache, see [`scheduler`]); `--no-prompt-cache` frees them instead.
//! - The engine thread runs up to `--max-seqs` sequences (the executor is loaded with that
//!   many KV slots) with continuous batching: one batched decode step for all of them per
//!   turn, sequences joining and leaving between steps. Where the executor pages its KV
//!   cache (`--kv-mem` sizes the pool), requests are admitted by free KV blocks, and the
//!   newest sequence is preempted and recomputed later when the running ones outgrow it.
//! - Answers come back per job as events on a tokio channel; [`stream`] turns them into a
//!   JSON body or server-sent events. A client that disconnects drops the receiver, and the
//!   engine thread frees its sequence before the next step.
//! - Errors are OpenAI's shape (`{"error": {"message", "type", "param", "code"}}`), also
//!   for 404/405 and anything else the router answers itself.
//! - Connections ([`connections`]): hyper's HTTP/1 server with a timer, so a client has
//!   `--timeout` (default 30 s) to send each request's head — idle and keep-alive
//!   connections and slowloris clients are closed after it — and at most
//!   `--max-connections` are held open (more get one request each, so `/health` answers).
//! - Request bodies are read by hand up to `--body-limit` (default 4 MiB); a larger one is
//!   read on and discarded (up to 64 MiB, within `--timeout`) before the 413 goes out, so
//!   the client, still sending, sees the answer instead of a reset connection.
//! - Prompt + `max_tokens` beyond the context is refused with 400
//!   `context_length_exceeded`, as OpenAI does (llama-server truncates instead); without
//!   `max_tokens` a completion may run to the end of the context.
//! - SIGINT/SIGTERM: stop accepting, close every connection not serving a request (idle,
//!   or still sending its first head), refuse queued jobs (503), let running sequences go on
//!   for `--shutdown-grace` seconds, then end the rest with a final chunk whose
//!   `finish_reason` is `"cancelled"`, join the engine thread and exit 0.
//!
//! Defaults for sampling follow llama-server (temperature 0.8, top_k 40, top_p 0.95,
//! min_p 0.05); presence/frequency penalties count generated tokens, as OpenAI defines them.

pub mod api;
mod connections;
mod engine_thread;
mod frontend;
pub mod metrics;
mod stream;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{SyncSender, TrySendError};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use futures_util::StreamExt;
use kiln_core::{Error, LoadOptions, Result, SamplingParams};
use serde_json::json;

use crate::batching::Metrics;
use crate::batching::{EmbedJob, Job, JobParams, Request as EngineRequest, Shutdown};
use crate::tools;
use api::{ApiError, Endpoint};
use engine_thread::EngineConfig;
use frontend::Frontend;
use metrics::RequestCounts;

/// Bodies up to this size are read (and discarded) past `--body-limit` so the 413 reaches
/// the client; a declared `Content-Length` above it is refused at once.
const DRAIN_LIMIT: usize = 64 << 20;

/// `kiln serve` options.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// GGUF or APR model file (default: SmolLM2-135M-Instruct, fetched on first use).
    #[arg(short, long)]
    pub model: Option<PathBuf>,
    /// Backend to use (`kiln backends` lists them); default: the best-scoring one.
    #[arg(long)]
    pub backend: Option<String>,
    /// Load a backend plugin (.so); repeatable.
    #[arg(long = "plugin")]
    pub plugins: Vec<PathBuf>,
    /// Address to listen on (loopback by default; use 0.0.0.0 to serve the network).
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one; the address is printed on stderr).
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Sequences generated at once (KV-cache slots of the executor).
    #[arg(long, default_value_t = 32)]
    pub max_seqs: usize,
    /// Requests that may wait for a slot; more are answered 429.
    #[arg(long, default_value_t = 256)]
    pub queue: usize,
    /// Require `Authorization: Bearer KEY` on /v1/* and the tokenizer helpers (not on /health and /metrics).
    #[arg(long)]
    pub api_key: Option<String>,
    /// Context length per sequence (default: the model's; on a GPU capped to what its KV cache fits in free memory, on the CPU backend at 4096).
    #[arg(short = 'c', long = "ctx-size", default_value_t = 0)]
    pub ctx_size: usize,
    /// CPU threads (default: all cores).
    #[arg(short, long)]
    pub threads: Option<usize>,
    /// Let a GPU backend quantise activations to 8 bits (faster; output drifts).
    #[arg(long)]
    pub quantized_activations: bool,
    /// How the KV cache stores keys and values: f32, f16 or q8_0 (default: the backend's).
    #[arg(long = "kv-type")]
    pub kv_type: Option<kiln_core::KvType>,
    /// Memory for the paged KV cache: one pool of 32-token blocks shared by all sequences
    /// (e.g. 512MiB, 4G, or bytes; units are powers of 1024). Requests are admitted while
    /// the pool has room and the newest is preempted (recomputed later) when it runs out;
    /// it must hold one sequence's whole context. Default: every sequence at full context.
    #[arg(long = "kv-mem", value_name = "SIZE", value_parser = crate::parse_size)]
    pub kv_mem: Option<u64>,
    /// Split the model's matrices over N ranks (tensor parallelism); the cpu backend runs
    /// the ranks as threads, the GPU backends and plugins refuse N > 1.
    #[arg(long = "tensor-parallel", value_name = "N", default_value_t = 1)]
    pub tensor_parallel: usize,
    /// GPU backends: decode the running sequences one at a time instead of in one batched
    /// step (int8 tensor-core matmuls, every weight read once for all of them).
    #[arg(long)]
    pub sequential_decode: bool,
    /// Largest request body in bytes; larger ones get 413.
    #[arg(long, default_value_t = 4 << 20)]
    pub body_limit: usize,
    /// Seconds a client has to send a request's head (from connecting, or from the end of
    /// its last response: idle connections close after it) and, after that, its body.
    #[arg(long, default_value_t = 30.0)]
    pub timeout: f64,
    /// Connections held open at once; more still get one request each, with 0.5 s to send
    /// its head (so /health always answers). Default: three quarters of what the
    /// file-descriptor limit allows.
    #[arg(long)]
    pub max_connections: Option<usize>,
    /// Seconds running sequences may go on after SIGINT/SIGTERM before they are cancelled.
    #[arg(long, default_value_t = 5.0)]
    pub shutdown_grace: f64,
    /// Free each sequence when it finishes instead of keeping its KV cache for a prompt
    /// that continues it (a conversation's next turn). With the cache, such a prompt
    /// prefills only its new tokens; its first token's logits then come from a shorter
    /// batch, which can differ from a full prefill's in the last bits.
    #[arg(long)]
    pub no_prompt_cache: bool,
    /// Test hook: milliseconds to wait before loading the model.
    #[arg(long, default_value_t = 0, hide = true)]
    pub load_delay_ms: u64,
}

struct AppState {
    model: OnceLock<Arc<Frontend>>,
    /// One message per request: its jobs (a choice each). `--queue` bounds requests.
    jobs: SyncSender<EngineRequest>,
    metrics: Arc<Metrics>,
    requests: RequestCounts,
    shutdown: Arc<Shutdown>,
    api_key: Option<String>,
    body_limit: usize,
    /// Longest a request body may take to arrive (`--timeout`).
    body_timeout: Duration,
    ids: AtomicU64,
}

impl AppState {
    fn frontend(&self) -> std::result::Result<Arc<Frontend>, ApiError> {
        if self.shutdown.is_set() {
            return Err(ApiError::unavailable(
                "shutting_down",
                "the server is shutting down",
            ));
        }
        self.model
            .get()
            .cloned()
            .ok_or_else(|| ApiError::unavailable("model_loading", "the model is still loading"))
    }

    /// A fresh pseudo-random 64-bit value (request ids, default seeds).
    fn random(&self) -> u64 {
        let nanos = SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64);
        let mut z = nanos ^ self.ids.fetch_add(0x9E37_79B9_7F4A_7C15, Ordering::Relaxed);
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
}

/// Runs the server until SIGINT/SIGTERM (or until the model fails to load: an error).
pub fn run(args: ServeArgs) -> Result<()> {
    if args.max_seqs == 0 {
        return Err(Error::InvalidArgument(
            "--max-seqs must be at least 1".into(),
        ));
    }
    if args.queue == 0 {
        return Err(Error::InvalidArgument("--queue must be at least 1".into()));
    }
    if args.api_key.as_deref().is_some_and(|k| k.trim().is_empty()) {
        return Err(Error::InvalidArgument(
            "--api-key is empty: give the key clients must send, or leave the flag out".into(),
        ));
    }
    if !(args.timeout > 0.0 && args.timeout <= 86_400.0) {
        return Err(Error::InvalidArgument(
            "--timeout must be more than 0 and at most 86400 seconds".into(),
        ));
    }
    if args.max_connections == Some(0) {
        return Err(Error::InvalidArgument(
            "--max-connections must be at least 1".into(),
        ));
    }
    if args.body_limit == 0 {
        return Err(Error::InvalidArgument(
            "--body-limit must be at least 1 byte".into(),
        ));
    }
    if !(args.shutdown_grace >= 0.0 && args.shutdown_grace < 86_400.0) {
        return Err(Error::InvalidArgument(
            "--shutdown-grace must be between 0 and 86400 seconds".into(),
        ));
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("kiln-http")
        .build()?;
    runtime.block_on(serve(args))
}

async fn serve(args: ServeArgs) -> Result<()> {
    let listener = tokio::net::TcpListener::bind((args.host.as_str(), args.port))
        .await
        .map_err(|e| {
            Error::Io(std::io::Error::new(
                e.kind(),
                format!("cannot listen on {}:{}: {e}", args.host, args.port),
            ))
        })?;
    let addr: SocketAddr = listener.local_addr()?;
    // Always printed (not a log line): scripts and tests read the port from it.
    eprintln!("kiln serve: listening on http://{addr}");

    let metrics = Arc::new(Metrics::default());
    let shutdown = Arc::new(Shutdown::default());
    let (job_tx, job_rx) = std::sync::mpsc::sync_channel(args.queue);
    let (ready_tx, ready_rx) = tokio::sync::oneshot::channel();
    let grace = Duration::from_secs_f64(args.shutdown_grace);
    let config = EngineConfig {
        model: args.model.clone(),
        backend: args.backend.clone(),
        plugins: args.plugins.clone(),
        options: LoadOptions {
            max_context: args.ctx_size,
            max_sequences: args.max_seqs,
            threads: args.threads,
            quantized_activations: args.quantized_activations,
            sequential_decode: args.sequential_decode,
            kv_type: args.kv_type,
            kv_memory: args.kv_mem,
            tensor_parallel: args.tensor_parallel,
            ..LoadOptions::default()
        },
        load_delay: Duration::from_millis(args.load_delay_ms),
        shutdown_grace: grace,
        prompt_cache: !args.no_prompt_cache,
    };
    let engine = engine_thread::spawn(config, job_rx, metrics.clone(), shutdown.clone(), ready_tx)?;
    let state = Arc::new(AppState {
        model: OnceLock::new(),
        jobs: job_tx,
        metrics: metrics.clone(),
        requests: RequestCounts::default(),
        shutdown: shutdown.clone(),
        api_key: args.api_key.clone(),
        body_limit: args.body_limit,
        body_timeout: Duration::from_secs_f64(args.timeout),
        ids: AtomicU64::new(0),
    });

    let load_error: Arc<Mutex<Option<Error>>> = Arc::default();
    tokio::spawn({
        let (state, load_error) = (state.clone(), load_error.clone());
        async move {
            let outcome = ready_rx.await.unwrap_or_else(|_| {
                Err(Error::InvalidArgument("the engine thread stopped".into()))
            });
            match outcome {
                Ok(front) => {
                    let m = &state.metrics;
                    let blocks = m.kv_blocks_total.load(Ordering::Relaxed);
                    let pool = match blocks {
                        b if b > 0 => format!(
                            ", a KV pool of {b} blocks of {} tokens ({:.2} GiB) shared by them",
                            kiln_core::KV_BLOCK_TOKENS,
                            (b * m.kv_block_bytes.load(Ordering::Relaxed).max(0)) as f64
                                / (1u64 << 30) as f64
                        ),
                        _ => String::new(),
                    };
                    eprintln!(
                        "kiln serve: model {} loaded on {} (context {}, {} sequence slots{pool})",
                        front.id,
                        front.backend,
                        front.context,
                        m.slots_total.load(Ordering::Relaxed)
                    );
                    let _ = state.model.set(front);
                }
                Err(e) => {
                    tracing::error!("loading the model failed: {e}");
                    *load_error.lock().unwrap_or_else(|p| p.into_inner()) = Some(e);
                    state.shutdown.begin();
                }
            }
        }
    });
    tokio::spawn({
        let shutdown = shutdown.clone();
        async move {
            tokio::select! {
                _ = wait_for_signal() => {
                    eprintln!("kiln serve: shutting down");
                    shutdown.begin();
                }
                _ = shutdown.wait() => {}
            }
        }
    });

    let app = router(state.clone());
    let limits = connections::ConnectionLimits {
        timeout: Duration::from_secs_f64(args.timeout),
        max_connections: args
            .max_connections
            .unwrap_or_else(connections::default_max_connections),
    };
    let server = connections::serve(listener, app, limits, shutdown.clone());
    let hard_stop = {
        let shutdown = shutdown.clone();
        async move {
            shutdown.wait().await;
            tokio::time::sleep(grace + Duration::from_secs(10)).await;
        }
    };
    tokio::select! {
        _ = server => {}
        _ = hard_stop => tracing::warn!("connections still open after the grace period; exiting"),
    }
    shutdown.begin();
    let _ = tokio::task::spawn_blocking(move || engine.join()).await;
    eprintln!("kiln serve: stopped");
    let err = load_error.lock().unwrap_or_else(|p| p.into_inner()).take();
    match err {
        Some(e) => Err(e),
        None => Ok(()),
    }
}

async fn wait_for_signal() {
    #[cfg(unix)]
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let terminate = std::future::pending::<()>();
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = terminate => {}
    }
}

fn router(state: Arc<AppState>) -> Router {
    Router::new()
        .route("/v1/chat/completions", post(chat))
        .route("/v1/completions", post(completions))
        .route("/v1/models", get(models))
        .route("/v1/embeddings", post(embeddings))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .route("/health", get(health))
        .route("/metrics", get(metrics_text))
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), auth))
        .layer(middleware::from_fn(openai_errors))
        .layer(middleware::from_fn_with_state(state.clone(), track))
        .with_state(state)
}

/// Whether `--api-key` guards `path`: the API and the tokenizer helpers, not the
/// health check and the metrics.
fn needs_key(path: &str) -> bool {
    path.starts_with("/v1/") || matches!(path, "/tokenize" | "/detokenize" | "/apply-template")
}

/// One log line and one count per request.
async fn track(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let start = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let resp = next.run(req).await;
    let status = resp.status().as_u16();
    let endpoint = metrics::endpoint_label(&path);
    st.requests.count(endpoint, status);
    let shown = if endpoint == "other" {
        api::truncate_for_message(&path)
    } else {
        path
    };
    tracing::info!(target: "kiln::server", "{method} {shown:?} {status} {:.1} ms", start.elapsed().as_secs_f64() * 1e3);
    resp
}

/// Gives every error response the router or axum produce without a JSON body (404, 405,
/// ...) OpenAI's error shape.
async fn openai_errors(req: Request, next: Next) -> Response {
    let resp = next.run(req).await;
    let status = resp.status();
    if !(status.is_client_error() || status.is_server_error()) {
        return resp;
    }
    let is_json = resp
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"));
    if is_json {
        return resp;
    }
    let (code, message) = match status {
        StatusCode::NOT_FOUND => ("not_found", "no such endpoint".to_string()),
        StatusCode::METHOD_NOT_ALLOWED => (
            "method_not_allowed",
            "this endpoint does not take that method".to_string(),
        ),
        StatusCode::PAYLOAD_TOO_LARGE => (
            "request_too_large",
            "the request body is too large".to_string(),
        ),
        s => ("error", s.canonical_reason().unwrap_or("error").to_string()),
    };
    let kind = if status.is_server_error() {
        "server_error"
    } else {
        "invalid_request_error"
    };
    let mut new = ApiError::new(status, kind, Some(code), message).into_response();
    for name in [header::ALLOW, header::RETRY_AFTER] {
        if let Some(v) = resp.headers().get(&name) {
            new.headers_mut().insert(name, v.clone());
        }
    }
    new
}

/// `--api-key`: `Authorization: Bearer KEY` on /v1/*.
async fn auth(State(st): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    if let Some(key) = &st.api_key {
        if needs_key(req.uri().path()) {
            let given = req
                .headers()
                .get(header::AUTHORIZATION)
                .and_then(|v| v.to_str().ok())
                .and_then(|v| v.strip_prefix("Bearer "));
            let ok = given.is_some_and(|g| constant_time_eq(g.trim().as_bytes(), key.as_bytes()));
            if !ok {
                let msg = if given.is_some() {
                    "Incorrect API key provided."
                } else {
                    "Missing API key: send 'Authorization: Bearer KEY'."
                };
                let mut resp = ApiError::new(
                    StatusCode::UNAUTHORIZED,
                    "invalid_request_error",
                    Some("invalid_api_key"),
                    msg,
                )
                .into_response();
                resp.headers_mut()
                    .insert(header::WWW_AUTHENTICATE, HeaderValue::from_static("Bearer"));
                return resp;
            }
        }
    }
    next.run(req).await
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn not_found() -> ApiError {
    ApiError::new(
        StatusCode::NOT_FOUND,
        "invalid_request_error",
        Some("not_found"),
        "no such endpoint",
    )
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.shutdown.is_set() {
        return (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "shutting down"})),
        )
            .into_response();
    }
    match st.model.get() {
        Some(_) => (StatusCode::OK, Json(json!({"status": "ok"}))).into_response(),
        None => (
            StatusCode::SERVICE_UNAVAILABLE,
            Json(json!({"status": "loading"})),
        )
            .into_response(),
    }
}

async fn models(
    State(st): State<Arc<AppState>>,
) -> std::result::Result<Json<serde_json::Value>, ApiError> {
    let f = st.frontend()?;
    Ok(Json(json!({
        "object": "list",
        "data": [{
            "id": f.id,
            "object": "model",
            "created": f.created,
            "owned_by": "kiln",
            "meta": {"context_length": f.context, "vocab_size": f.vocab, "backend": f.backend},
        }],
    })))
}

async fn metrics_text(State(st): State<Arc<AppState>>) -> Response {
    (
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        st.requests.render() + &st.metrics.render(),
    )
        .into_response()
}

async fn chat(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    generate(st, Endpoint::Chat, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// `POST /v1/embeddings` (OpenAI's): the inputs tokenised on the blocking pool, embedded
/// by the engine thread between decode steps, answered in order as float arrays or
/// base64 (little-endian f32, as OpenAI's `encoding_format: "base64"`).
async fn embeddings(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    let run = async {
        let bytes = read_body(&headers, body, st.body_limit, st.body_timeout).await?;
        let obj = api::parse_json(&bytes)?;
        let req = api::parse_embeddings(&obj)?;
        let front = st.frontend()?;
        front.check_model(req.model.as_deref())?;
        let inputs = {
            let (front, input) = (front.clone(), req.input.clone());
            tokio::task::spawn_blocking(move || front.embedding_inputs(&input))
                .await
                .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))??
        };
        let prompt_tokens: usize = inputs.iter().map(Vec::len).sum();
        let (reply, answer) = tokio::sync::oneshot::channel();
        let job = EmbedJob {
            inputs,
            pooling: front.pooling,
            normalize: true,
            reply,
        };
        match st.jobs.try_send(EngineRequest::Embed(job)) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                return Err(ApiError::new(
                    StatusCode::TOO_MANY_REQUESTS,
                    "rate_limit_error",
                    Some("queue_full"),
                    "the server's request queue is full; retry later",
                )
                .with_retry_after(1))
            }
            Err(TrySendError::Disconnected(_)) => {
                return Err(ApiError::unavailable(
                    "shutting_down",
                    "the server is shutting down",
                ))
            }
        }
        let vectors = match answer.await {
            Ok(Ok(v)) => v,
            Err(_) => {
                return Err(ApiError::unavailable(
                    "shutting_down",
                    "the server is shutting down",
                ))
            }
            Ok(Err(_)) if st.shutdown.is_set() => {
                return Err(ApiError::unavailable(
                    "shutting_down",
                    "the server is shutting down",
                ))
            }
            Ok(Err(Error::Unsupported(m))) => {
                return Err(ApiError::new(
                    StatusCode::NOT_IMPLEMENTED,
                    "invalid_request_error",
                    Some("embeddings_unsupported"),
                    m,
                ))
            }
            Ok(Err(e)) => return Err(ApiError::internal(format!("embedding failed: {e}"))),
        };
        let data: Vec<serde_json::Value> = vectors
            .iter()
            .enumerate()
            .map(|(index, v)| {
                let embedding = match req.base64 {
                    true => {
                        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
                        json!(base64::encode(bytes))
                    }
                    false => json!(v),
                };
                json!({"object": "embedding", "index": index, "embedding": embedding})
            })
            .collect();
        Ok(json!({
            "object": "list",
            "data": data,
            "model": front.id,
            "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
        }))
    };
    match run.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn tokenize(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    helper(st, headers, body, |front, obj| {
        front.tokenize_text(&api::parse_tokenize(&obj)?)
    })
    .await
}

async fn detokenize(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    helper(st, headers, body, |front, obj| {
        front.detokenize(&api::parse_detokenize(&obj)?)
    })
    .await
}

async fn apply_template(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Response {
    helper(st, headers, body, |front, obj| {
        front.apply_template(&api::parse_apply_template(&obj)?)
    })
    .await
}

/// One of llama-server's tokenizer helpers: the body read and parsed as the API's are,
/// then `answer` on the blocking pool (tokenizing a 4 MiB text takes a while) with the
/// handlers' copy of the tokenizer and template.
async fn helper(
    st: Arc<AppState>,
    headers: HeaderMap,
    body: Body,
    answer: impl FnOnce(
            &Frontend,
            serde_json::Map<String, serde_json::Value>,
        ) -> std::result::Result<serde_json::Value, ApiError>
        + Send
        + 'static,
) -> Response {
    let run = async {
        let bytes = read_body(&headers, body, st.body_limit, st.body_timeout).await?;
        let obj = api::parse_json(&bytes)?;
        let front = st.frontend()?;
        tokio::task::spawn_blocking(move || answer(&front, obj))
            .await
            .map_err(|e| ApiError::internal(format!("the helper failed: {e}")))?
    };
    match run.await {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn completions(State(st): State<Arc<AppState>>, headers: HeaderMap, body: Body) -> Response {
    generate(st, Endpoint::Completions, headers, body)
        .await
        .unwrap_or_else(IntoResponse::into_response)
}

/// Reads the body up to `limit` bytes; past it, reads on and discards (see [`DRAIN_LIMIT`]).
async fn read_body(
    headers: &HeaderMap,
    body: Body,
    limit: usize,
    timeout: Duration,
) -> std::result::Result<Bytes, ApiError> {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if declared.is_some_and(|n| n > DRAIN_LIMIT as u64) {
        return Err(ApiError::too_large(limit));
    }
    let mut stream = body.into_data_stream();
    let mut buf = Vec::new();
    let mut total = 0usize;
    let deadline = tokio::time::Instant::now() + timeout;
    loop {
        let next = tokio::time::timeout_at(deadline, stream.next())
            .await
            .map_err(|_| {
                ApiError::new(
                    StatusCode::REQUEST_TIMEOUT,
                    "invalid_request_error",
                    Some("timeout"),
                    "the request body took too long to arrive",
                )
            })?;
        let Some(chunk) = next else { break };
        let chunk = chunk.map_err(|e| {
            ApiError::bad_request("invalid_body", format!("the body could not be read: {e}"))
        })?;
        total = total.saturating_add(chunk.len());
        if total > limit {
            buf = Vec::new();
            if total > DRAIN_LIMIT {
                break;
            }
            continue;
        }
        buf.extend_from_slice(&chunk);
    }
    if total > limit {
        return Err(ApiError::too_large(limit));
    }
    Ok(buf.into())
}

async fn generate(
    st: Arc<AppState>,
    endpoint: Endpoint,
    headers: HeaderMap,
    body: Body,
) -> std::result::Result<Response, ApiError> {
    let received = Instant::now();
    let bytes = read_body(&headers, body, st.body_limit, st.body_timeout).await?;
    let mut req = {
        let obj = api::parse_json(&bytes)?;
        api::parse_request(endpoint, &obj)?
    };
    drop(bytes);
    let front = st.frontend()?;
    front.check_model(req.model.as_deref())?;

    if let Some(&(bad, _)) = req
        .logit_bias
        .iter()
        .find(|(t, _)| *t as usize >= front.vocab)
    {
        return Err(ApiError::invalid(
            "logit_bias",
            "invalid_value",
            format!(
                "token id {bad} in 'logit_bias' is outside the vocabulary ({})",
                front.vocab
            ),
        ));
    }

    let param = match endpoint {
        Endpoint::Chat => "messages",
        Endpoint::Completions => "prompt",
    };
    let prompts = std::mem::take(&mut req.prompts);
    let several = prompts.len() > 1;
    let tokenized = {
        let front = front.clone();
        let tools = req.tools.clone();
        tokio::task::spawn_blocking(move || {
            prompts
                .iter()
                .enumerate()
                .map(|(i, p)| {
                    if several {
                        front.tokenize(p, tools.as_ref(), &format!("{param}[{i}]"))
                    } else {
                        front.tokenize(p, tools.as_ref(), param)
                    }
                })
                .collect::<std::result::Result<Vec<_>, _>>()
        })
        .await
        .map_err(|e| ApiError::internal(format!("tokenizing failed: {e}")))??
    };

    let mut jobs = Vec::with_capacity(tokenized.len());
    for (i, ids) in tokenized.into_iter().enumerate() {
        let p = if several {
            format!("{param}[{i}]")
        } else {
            param.to_string()
        };
        if ids.is_empty() {
            return Err(ApiError::invalid(
                p,
                "invalid_value",
                "the prompt has no tokens",
            ));
        }
        if ids.len() >= front.context {
            return Err(front.context_exceeded(&p, ids.len().to_string()));
        }
        let max_tokens = match req.max_tokens {
            Some(m) => {
                if ids.len().saturating_add(m) > front.context {
                    return Err(ApiError::invalid(
                        req.max_tokens_param,
                        "context_length_exceeded",
                        format!(
                            "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {m} for the completion). Reduce the prompt or '{}'.",
                            front.context,
                            ids.len().saturating_add(m),
                            ids.len(),
                            req.max_tokens_param
                        ),
                    ));
                }
                m
            }
            None => front.context - ids.len(),
        };
        jobs.push((ids, max_tokens));
    }

    let s = &req.sampling;
    let sampling = SamplingParams {
        temperature: s.temperature.unwrap_or(0.8),
        top_k: s.top_k.unwrap_or(40),
        top_p: s.top_p.unwrap_or(0.95),
        min_p: s.min_p.unwrap_or(0.05),
        repeat_penalty: 1.0,
        repeat_last_n: 0,
        seed: s.seed.unwrap_or_else(|| st.random()),
        logit_bias: req.logit_bias.clone(),
    };
    // `n` choices per prompt: choice `p·n + k` is prompt p's k-th, drawn with the seed + k
    // (so a seeded request's choices differ from one another, and each is reproducible).
    let n = req.n;
    let choices = jobs.len() * n;
    let mut constraints = match req.json_schema.take() {
        Some(schema) => {
            let (front, n) = (front.clone(), choices);
            tokio::task::spawn_blocking(move || front.json_constraints(&schema, n))
                .await
                .map_err(|e| ApiError::internal(format!("compiling the JSON schema failed: {e}")))??
                .into_iter()
                .map(Some)
                .collect()
        }
        None => Vec::new(),
    };
    if let Some(tools) = req.tools.clone() {
        let front = front.clone();
        let required = tokio::task::spawn_blocking(move || front.tool_constraints(&tools, choices))
            .await
            .map_err(|e| {
                ApiError::internal(format!("compiling the tools' grammar failed: {e}"))
            })??;
        if let Some(required) = required {
            constraints = required.into_iter().map(Some).collect();
        }
    }
    constraints.resize_with(choices, || None);
    let mut constraints = constraints.into_iter();
    let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
    let each_choice = jobs
        .into_iter()
        .flat_map(|job| std::iter::repeat_n(job, n).enumerate());
    let mut batch = Vec::with_capacity(choices);
    for (index, (k, (prompt, max_tokens))) in each_choice.enumerate() {
        batch.push(Job {
            index,
            prompt,
            constraint: constraints.next().flatten(),
            params: JobParams {
                max_tokens,
                sampling: SamplingParams {
                    seed: sampling.seed.wrapping_add(k as u64),
                    ..sampling.clone()
                },
                presence_penalty: req.presence_penalty,
                frequency_penalty: req.frequency_penalty,
                stop: req.stop.clone(),
                logprobs: req.logprobs,
                cache_prompt: req.cache_prompt,
                // A client cancels by disconnecting.
                cancel: None,
                split_reasoning: req.endpoint == Endpoint::Chat,
            },
            events: tx.clone(),
            received,
        });
    }
    drop(tx);
    // The queue-depth gauge counts jobs (choices), the queue's bound requests.
    let queued = choices as i64;
    st.metrics.queue_depth.fetch_add(queued, Ordering::Relaxed);
    match st.jobs.try_send(EngineRequest::Generate(batch)) {
        Ok(()) => {}
        Err(TrySendError::Full(_)) => {
            st.metrics.queue_depth.fetch_sub(queued, Ordering::Relaxed);
            return Err(ApiError::new(
                StatusCode::TOO_MANY_REQUESTS,
                "rate_limit_error",
                Some("queue_full"),
                "the server's request queue is full; retry later",
            )
            .with_retry_after(1));
        }
        Err(TrySendError::Disconnected(_)) => {
            st.metrics.queue_depth.fetch_sub(queued, Ordering::Relaxed);
            return Err(ApiError::unavailable(
                "shutting_down",
                "the server is shutting down",
            ));
        }
    }

    let prefix = match endpoint {
        Endpoint::Chat => "chatcmpl",
        Endpoint::Completions => "cmpl",
    };
    let meta = stream::Meta {
        id: format!("{prefix}-{:016x}{:08x}", st.random(), st.random() as u32),
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        model: front.id.clone(),
        fingerprint: format!("kiln-{}", front.backend),
        endpoint,
        choices,
        n,
        include_usage: req.include_usage,
        // With `tool_choice: none` the answer is only content.
        tools: req
            .tools
            .take()
            .filter(|t| t.choice != tools::ToolChoice::None)
            .map(|t| stream::OfferedTools {
                tools: t.tools,
                format: front.tool_format(),
            }),
    };
    let logprobs = req.logprobs.is_some();
    if req.stream {
        Ok(stream::sse(meta, rx, logprobs))
    } else {
        Ok(Json(stream::collect(meta, rx, logprobs).await?).into_response())
    }
}
