//! Continuous batching: the engine thread that runs many sequences through one executor
//! ([`scheduler`]), driven by the library's blocking [`Batcher`] or by `kiln serve`'s HTTP
//! handlers. Each sequence's generation (sampling on the host, stop tokens and strings,
//! limits, text) is [`crate::generation`]'s, the same as a [`crate::Session`]'s.

pub mod batcher;
pub mod metrics;
pub(crate) mod scheduler;

use std::sync::atomic::{AtomicBool, Ordering};

use tokio::sync::Notify;

pub use batcher::{BatchOptions, BatchStream, Batcher};
pub use metrics::Metrics;
#[cfg(feature = "server")]
pub(crate) use scheduler::{EmbedJob, Job, JobParams, Request};
pub use scheduler::{Event, Finish, TokenLogprob};

/// Set once when the engine starts to stop (the server's signal, a dropped `Batcher`).
#[derive(Default)]
pub(crate) struct Shutdown {
    flag: AtomicBool,
    notify: Notify,
}

impl Shutdown {
    pub(crate) fn begin(&self) {
        if !self.flag.swap(true, Ordering::SeqCst) {
            self.notify.notify_waiters();
        }
    }

    pub(crate) fn is_set(&self) -> bool {
        self.flag.load(Ordering::SeqCst)
    }

    #[cfg(feature = "server")]
    pub(crate) async fn wait(&self) {
        loop {
            // A `Notified` receives `notify_waiters` from its creation on.
            let notified = self.notify.notified();
            if self.is_set() {
                return;
            }
            notified.await;
        }
    }
}
