//! A batch's counters, gauges and histograms, rendered in Prometheus' text format (version
//! 0.0.4) by hand: a dozen series do not need a metrics crate.
//!
//! Writers are the scheduler thread (tokens, running sequences, slots, latencies) and
//! whoever queues jobs (the queue depth: the [`crate::batching::Batcher`], the server's
//! handlers); the server's `/metrics` reads, after its own request counts.

use std::fmt::Write as _;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicU64, Ordering};
use std::sync::Mutex;

/// A cumulative histogram with fixed upper bounds (seconds).
pub struct Histogram {
    bounds: &'static [f64],
    inner: Mutex<HistInner>,
}

struct HistInner {
    /// counts[i]: observations <= bounds[i] and > bounds[i-1]; the last is +Inf.
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            inner: Mutex::new(HistInner {
                counts: vec![0; bounds.len() + 1],
                sum: 0.0,
                count: 0,
            }),
        }
    }

    pub fn observe(&self, value: f64) {
        let i = self
            .bounds
            .iter()
            .position(|&b| value <= b)
            .unwrap_or(self.bounds.len());
        let mut h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        h.counts[i] += 1;
        h.sum += value;
        h.count += 1;
    }

    /// Observations so far.
    pub fn count(&self) -> u64 {
        self.inner.lock().unwrap_or_else(|e| e.into_inner()).count
    }

    fn render(&self, out: &mut String, name: &str, help: &str) {
        let h = self.inner.lock().unwrap_or_else(|e| e.into_inner());
        let _ = writeln!(out, "# HELP {name} {help}");
        let _ = writeln!(out, "# TYPE {name} histogram");
        let mut cumulative = 0u64;
        for (i, b) in self.bounds.iter().enumerate() {
            cumulative += h.counts[i];
            let _ = writeln!(out, "{name}_bucket{{le=\"{b}\"}} {cumulative}");
        }
        cumulative += h.counts[self.bounds.len()];
        let _ = writeln!(out, "{name}_bucket{{le=\"+Inf\"}} {cumulative}");
        let _ = writeln!(out, "{name}_sum {}", h.sum);
        let _ = writeln!(out, "{name}_count {}", h.count);
    }
}

const TTFT_BOUNDS: &[f64] = &[
    0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0,
];
const ITL_BOUNDS: &[f64] = &[
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0,
];

/// Everything a batch reports.
pub struct Metrics {
    pub prompt_tokens: AtomicU64,
    /// Of the prompt tokens, those a kept sequence supplied (the prompt cache).
    pub prompt_tokens_cached: AtomicU64,
    pub generated_tokens: AtomicU64,
    /// Sequences freed because their client went away (or the server shut down).
    pub cancelled: AtomicU64,
    /// Jobs accepted into the queue and not yet taken by the scheduler.
    pub queue_depth: AtomicI64,
    pub running: AtomicI64,
    /// Sequence slots of the executor (set once the model is loaded).
    pub slots_total: AtomicI64,
    pub slots_used: AtomicI64,
    /// Finished sequences kept with their KV cache for prompts that continue them.
    pub kept_sequences: AtomicI64,
    /// Blocks of the paged KV cache's pool, and those sequences hold; -1 until the model
    /// is loaded, and for an executor that does not page its cache (the series are left
    /// out then).
    pub kv_blocks_total: AtomicI64,
    pub kv_blocks_used: AtomicI64,
    /// Of the used blocks, those kept sequences hold (the prompt cache).
    pub kv_blocks_kept: AtomicI64,
    /// Bytes one KV block takes (-1 until a paging executor has loaded): for the startup line.
    pub kv_block_bytes: AtomicI64,
    /// Running sequences preempted because the KV cache ran out of blocks (freed, and
    /// recomputed from their tokens when blocks are free again).
    pub preemptions: AtomicU64,
    pub model_loaded: AtomicBool,
    pub ttft: Histogram,
    pub itl: Histogram,
}

impl Default for Metrics {
    fn default() -> Self {
        Metrics {
            prompt_tokens: AtomicU64::new(0),
            prompt_tokens_cached: AtomicU64::new(0),
            generated_tokens: AtomicU64::new(0),
            cancelled: AtomicU64::new(0),
            queue_depth: AtomicI64::new(0),
            running: AtomicI64::new(0),
            slots_total: AtomicI64::new(0),
            slots_used: AtomicI64::new(0),
            kept_sequences: AtomicI64::new(0),
            kv_blocks_total: AtomicI64::new(-1),
            kv_blocks_used: AtomicI64::new(-1),
            kv_blocks_kept: AtomicI64::new(-1),
            kv_block_bytes: AtomicI64::new(-1),
            preemptions: AtomicU64::new(0),
            model_loaded: AtomicBool::new(false),
            ttft: Histogram::new(TTFT_BOUNDS),
            itl: Histogram::new(ITL_BOUNDS),
        }
    }
}

impl Metrics {
    /// Every series in Prometheus' text format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(4096);
        let load = |a: &AtomicI64| a.load(Ordering::Relaxed).max(0);
        let counter = |out: &mut String, name: &str, help: &str, v: u64| {
            let _ = writeln!(
                out,
                "# HELP {name} {help}\n# TYPE {name} counter\n{name} {v}"
            );
        };
        let gauge = |out: &mut String, name: &str, help: &str, v: i64| {
            let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} gauge\n{name} {v}");
        };
        counter(
            &mut out,
            "kiln_prompt_tokens_total",
            "Prompt tokens of the requests started (those the prompt cache supplied included).",
            self.prompt_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "kiln_prompt_tokens_cached_total",
            "Prompt tokens taken from a kept sequence's KV cache instead of prefilled.",
            self.prompt_tokens_cached.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "kiln_generation_tokens_total",
            "Tokens generated (end-of-sequence tokens not counted).",
            self.generated_tokens.load(Ordering::Relaxed),
        );
        counter(
            &mut out,
            "kiln_sequences_cancelled_total",
            "Sequences freed before they finished: client gone or server shutting down.",
            self.cancelled.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "kiln_queue_depth",
            "Requests waiting for a sequence slot.",
            load(&self.queue_depth),
        );
        gauge(
            &mut out,
            "kiln_running_sequences",
            "Sequences being generated.",
            load(&self.running),
        );
        let total = load(&self.slots_total);
        let used = load(&self.slots_used);
        gauge(
            &mut out,
            "kiln_kv_slots_total",
            "Sequence slots of the executor (--max-seqs): sequences that may be alive at once.",
            total,
        );
        gauge(
            &mut out,
            "kiln_kv_slots_used",
            "KV-cache sequence slots holding a live sequence (running or being prefilled).",
            used,
        );
        gauge(
            &mut out,
            "kiln_kv_slots_free",
            "KV-cache sequence slots free for a new sequence (kept ones are given up on demand).",
            (total - used).max(0),
        );
        let blocks_total = self.kv_blocks_total.load(Ordering::Relaxed);
        if blocks_total >= 0 {
            gauge(
                &mut out,
                "kiln_kv_blocks_total",
                "Blocks of the paged KV cache's pool (32 positions each, shared by all sequences; --kv-mem).",
                blocks_total,
            );
            gauge(
                &mut out,
                "kiln_kv_blocks_used",
                "KV-cache blocks held by sequences (kept ones included).",
                load(&self.kv_blocks_used),
            );
            gauge(
                &mut out,
                "kiln_kv_blocks_kept",
                "KV-cache blocks held by kept sequences (the prompt cache; freed on demand).",
                load(&self.kv_blocks_kept),
            );
        }
        gauge(
            &mut out,
            "kiln_prompt_cache_sequences",
            "Finished sequences kept with their KV cache for prompts that continue them.",
            load(&self.kept_sequences),
        );
        counter(
            &mut out,
            "kiln_preemptions_total",
            "Sequences preempted when the KV cache ran out of blocks: freed, then recomputed from their tokens once blocks are free.",
            self.preemptions.load(Ordering::Relaxed),
        );
        gauge(
            &mut out,
            "kiln_model_loaded",
            "1 once the model is loaded.",
            i64::from(self.model_loaded.load(Ordering::Relaxed)),
        );
        self.ttft.render(
            &mut out,
            "kiln_time_to_first_token_seconds",
            "From request arrival to the first generated token.",
        );
        self.itl.render(
            &mut out,
            "kiln_inter_token_latency_seconds",
            "Between consecutive tokens of one sequence.",
        );
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn histogram_buckets_are_cumulative() {
        let h = Histogram::new(&[0.1, 1.0]);
        h.observe(0.05);
        h.observe(0.5);
        h.observe(7.0);
        let mut s = String::new();
        h.render(&mut s, "x", "help");
        assert!(s.contains("x_bucket{le=\"0.1\"} 1\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"1\"} 2\n"), "{s}");
        assert!(s.contains("x_bucket{le=\"+Inf\"} 3\n"), "{s}");
        assert!(s.contains("x_count 3\n"), "{s}");
    }
}
