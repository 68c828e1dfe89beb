//! The HTTP layer's own series: requests answered, by endpoint and status. The batch's
//! series (tokens, sequences, slots, latencies) are [`crate::batching::metrics`]'s;
//! `/metrics` renders these first, then those.

use std::collections::BTreeMap;
use std::fmt::Write as _;
use std::sync::Mutex;

/// (endpoint, status code) → requests answered.
#[derive(Default)]
pub struct RequestCounts(Mutex<BTreeMap<(&'static str, u16), u64>>);

/// The endpoint label of a request path: the known routes by name, everything else as
/// `other` (so fuzzed paths cannot grow the series without bound).
pub fn endpoint_label(path: &str) -> &'static str {
    match path {
        "/v1/chat/completions" => "/v1/chat/completions",
        "/v1/completions" => "/v1/completions",
        "/v1/models" => "/v1/models",
        "/v1/embeddings" => "/v1/embeddings",
        "/health" => "/health",
        "/metrics" => "/metrics",
        "/tokenize" => "/tokenize",
        "/detokenize" => "/detokenize",
        "/apply-template" => "/apply-template",
        _ => "other",
    }
}

impl RequestCounts {
    pub fn count(&self, endpoint: &'static str, status: u16) {
        *self
            .0
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .entry((endpoint, status))
            .or_insert(0) += 1;
    }

    /// The `kiln_requests_total` series in Prometheus' text format.
    pub fn render(&self) -> String {
        let mut out = String::new();
        let _ = writeln!(
            out,
            "# HELP kiln_requests_total HTTP requests answered, by endpoint and status code."
        );
        let _ = writeln!(out, "# TYPE kiln_requests_total counter");
        for ((endpoint, status), n) in self.0.lock().unwrap_or_else(|e| e.into_inner()).iter() {
            let _ = writeln!(
                out,
                "kiln_requests_total{{endpoint=\"{endpoint}\",status=\"{status}\"}} {n}"
            );
        }
        out
    }
}
