//! Accepting and keeping connections: each one served by hyper's HTTP/1 server with a
//! timer, so a client has `--timeout` to send each request's head — which also closes a
//! connection that never sends one, an idle keep-alive connection, and a slowloris — under
//! a cap on open connections (`--max-connections`), with a shutdown that closes at once
//! every connection not serving a request.
//!
//! Over the cap a connection is still accepted, so `/health` always answers, but it gets
//! one request and [`OVERFLOW_TIMEOUT`] to send its head: a flood of idle connections
//! cannot keep the server's file descriptors. When the process has none left, accepting waits and says
//! so once (a log line when a limit bites, not one per connection).

use std::io;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::Router;
use hyper::server::conn::http1;
use hyper_util::rt::{TokioIo, TokioTimer};
use tokio::net::TcpListener;
use tokio::sync::Notify;

use crate::batching::Shutdown;

/// How long a connection over `--max-connections` has to send its one request's head: a
/// client that writes its request as it connects needs far less; idle ones give their
/// descriptor back quickly, so the connections waiting behind them (a `/health` probe
/// among them) are reached within about this long.
pub const OVERFLOW_TIMEOUT: Duration = Duration::from_millis(500);

/// Connections the server holds open by default: three quarters of what the process's
/// file-descriptor limit leaves after a reserve for the model, plugins and the engine (at
/// most 10,000). The last quarter is for connections over the cap, which turn over every
/// [`OVERFLOW_TIMEOUT`] when they send nothing.
pub fn default_max_connections() -> usize {
    const RESERVE: u64 = 64;
    let mut limit = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit through a valid pointer to a local.
    let soft = match unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut limit) } {
        0 => limit.rlim_cur as u64,
        _ => 1024,
    };
    (soft.saturating_sub(RESERVE) / 4 * 3).clamp(16, 10_000) as usize
}

/// The HTTP layer's limits.
#[derive(Debug, Clone, Copy)]
pub struct ConnectionLimits {
    /// Time to send a request's head (from a connection's start or the end of its last
    /// response); also the longest a request body may take to arrive.
    pub timeout: Duration,
    pub max_connections: usize,
}

/// Open connections, and a wake-up when the last one closes.
#[derive(Default)]
struct Open {
    count: AtomicUsize,
    all_closed: Notify,
}

impl Open {
    fn closed_one(&self) {
        if self.count.fetch_sub(1, Ordering::SeqCst) == 1 {
            self.all_closed.notify_waiters();
        }
    }

    async fn wait_all_closed(&self) {
        loop {
            let notified = self.all_closed.notified();
            if self.count.load(Ordering::SeqCst) == 0 {
                return;
            }
            notified.await;
        }
    }
}

/// Serves `app` on `listener` until `shutdown`, then closes idle connections and waits for
/// those serving a request to finish.
pub async fn serve(
    listener: TcpListener,
    app: Router,
    limits: ConnectionLimits,
    shutdown: Arc<Shutdown>,
) {
    let open = Arc::new(Open::default());
    // Whether the last accepted connection was over the cap / the last accept found no
    // file descriptor: each logs when it starts to bite, not per connection.
    let (mut over_logged, mut fd_logged) = (false, false);
    loop {
        let accepted = tokio::select! {
            r = listener.accept() => r,
            _ = shutdown.wait() => break,
        };
        let stream = match accepted {
            Ok((stream, _)) => {
                fd_logged = false;
                stream
            }
            Err(e) => {
                if is_out_of_descriptors(&e) {
                    if !fd_logged {
                        tracing::warn!(
                            "cannot accept connections: the process has no file descriptors left ({e}); \
                             {} are open (lower --max-connections or raise the limit)",
                            open.count.load(Ordering::SeqCst)
                        );
                        fd_logged = true;
                    }
                    // Idle connections time out meanwhile and give theirs back.
                    tokio::time::sleep(Duration::from_millis(50)).await;
                } else {
                    tracing::debug!("accept: {e}");
                }
                continue;
            }
        };
        let n = open.count.fetch_add(1, Ordering::SeqCst) + 1;
        let over = n > limits.max_connections;
        if over && !over_logged {
            tracing::warn!(
                "{n} connections open, over --max-connections {}: new ones get one request and {} ms to send it",
                limits.max_connections,
                OVERFLOW_TIMEOUT.as_millis()
            );
        }
        over_logged = over;
        let _ = stream.set_nodelay(true);
        let mut http = http1::Builder::new();
        http.timer(TokioTimer::new())
            .header_read_timeout(if over {
                OVERFLOW_TIMEOUT
            } else {
                limits.timeout
            })
            .keep_alive(!over);
        let (app, open, shutdown) = (app.clone(), open.clone(), shutdown.clone());
        tokio::spawn(async move {
            // Set when the connection's first request arrives: until then, a shutdown
            // closes it at once (hyper would wait for its head).
            let started = Arc::new(AtomicBool::new(false));
            let service = hyper::service::service_fn({
                let started = started.clone();
                move |req: hyper::Request<hyper::body::Incoming>| {
                    started.store(true, Ordering::SeqCst);
                    tower::ServiceExt::oneshot(app.clone(), req.map(Body::new))
                }
            });
            let conn = http.serve_connection(TokioIo::new(stream), service);
            tokio::pin!(conn);
            tokio::select! {
                _ = conn.as_mut() => {}
                _ = shutdown.wait() => {
                    if started.load(Ordering::SeqCst) {
                        // Idle keep-alive connections close now; a request being served
                        // (a stream within its grace) finishes first.
                        conn.as_mut().graceful_shutdown();
                        let _ = conn.as_mut().await;
                    }
                }
            }
            open.closed_one();
        });
    }
    open.wait_all_closed().await;
}

/// Whether an accept failed for want of file descriptors (the process's or the system's).
fn is_out_of_descriptors(e: &io::Error) -> bool {
    matches!(e.raw_os_error(), Some(libc::EMFILE) | Some(libc::ENFILE))
}
