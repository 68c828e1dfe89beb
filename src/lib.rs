//! # kiln
//!
//! The host-facing library: open a model file ([`Model::open`]), ask the registry which
//! backend runs it ([`registry_with_plugins`], [`Engine::load`]), and generate text through
//! sessions ([`Session::generate`]) or, for many generations at once, through the
//! continuous batch `kiln serve` runs ([`Batcher`]). The `kiln` binary (src/main.rs) is a
//! thin CLI over it.
//!
//! Built-in backends are linked in here and register themselves through `inventory`;
//! third-party backends are loaded from `.so` plugins ([`plugins`]).

pub mod batching;
pub mod bench;
#[cfg(feature = "cli")]
pub mod conformance;
pub mod embedding;
pub mod engine;
#[cfg(feature = "fetch")]
pub mod fetch;
pub mod generation;
pub mod harmony;
pub mod perplexity;
pub mod plugins;
#[cfg(feature = "server")]
pub mod server;
pub mod session;
pub mod structured;
#[cfg(feature = "cli")]
pub mod toolkit;
pub mod tools;

pub use batching::{BatchOptions, BatchStream, Batcher, Event as BatchEvent};
pub use embedding::Pooling;
pub use engine::{registry_with_plugins, Engine, Model, ModelFile};
pub use generation::Finish;
pub use kiln_formats::chat::ChatMessage;
pub use session::{CancelToken, GenerateParams, Generation, Session};

pub use kiln_core as core;

/// Parses a memory size as `--kv-mem` takes it: a number of bytes, or a number (a decimal
/// fraction allowed) with a unit K, M, G or T, each optionally followed by `B` or `iB`
/// and in any case (`512MiB`, `4G`, `1.5gb`, `1500M`). Every unit is a power of 1024, as
/// Docker's and the JVM's memory flags read them: a KV pool is sized against memory,
/// which comes in binary units. Zero is refused (a pool must hold at least one context).
/// The error is a sentence clap prints after the flag's name.
pub fn parse_size(s: &str) -> std::result::Result<u64, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (number, unit) = t.split_at(split);
    let bad = || {
        format!(
            "{s:?} is not a size: expected bytes or a number with K, M, G or T (e.g. 512MiB, 4G)"
        )
    };
    let shift = match unit.trim_start().to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => return Err(bad()),
    };
    let bytes = if number.contains('.') {
        let x: f64 = number.parse().map_err(|_| bad())?;
        let b = (x * (1u64 << shift) as f64).round();
        if !(b.is_finite() && b < u64::MAX as f64) {
            return Err(format!("{s:?} is too large"));
        }
        b as u64
    } else {
        let n: u64 = number.parse().map_err(|_| bad())?;
        n.checked_mul(1u64 << shift)
            .ok_or_else(|| format!("{s:?} is too large"))?
    };
    if bytes == 0 {
        return Err("the size must be more than 0 bytes".into());
    }
    Ok(bytes)
}

pub use kiln_formats as formats;

/// Makes sure the built-in backend crates are linked into the final binary, so their
/// `inventory` registrations are seen. (A crate nothing refers to may be dropped by the
/// linker together with its registration.)
pub fn link_builtin_backends() {
    std::hint::black_box(std::any::type_name::<kiln_backend_cpu::CpuBackend>());
    #[cfg(feature = "cuda")]
    {
        std::hint::black_box(std::any::type_name::<kiln_backend_cuda_q4k::CudaQ4kBackend>());
        std::hint::black_box(std::any::type_name::<kiln_backend_cuda_q4_0::CudaQ40Backend>());
    }
}

#[cfg(test)]
mod tests {
    use super::parse_size;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("512MiB"), Ok(512 << 20));
        assert_eq!(parse_size("4GiB"), Ok(4 << 30));
        assert_eq!(parse_size("4G"), Ok(4 << 30));
        assert_eq!(parse_size("4gb"), Ok(4 << 30));
        assert_eq!(parse_size("1500M"), Ok(1500 << 20));
        assert_eq!(parse_size("1.5K"), Ok(1536));
        assert_eq!(parse_size("123456"), Ok(123456));
        assert_eq!(parse_size("64 KiB"), Ok(64 << 10));
        for bad in [
            "",
            "0",
            "0G",
            "G",
            "-1G",
            "4X",
            "1..5M",
            "4GiBs",
            "99999999999T",
        ] {
            assert!(parse_size(bad).is_err(), "{bad:?}");
        }
    }
}
