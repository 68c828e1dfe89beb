//! # kiln
//!
//! The host-facing library: open a model file, pick a backend from the registry, and
//! generate text through sessions. The `kiln` binary (src/main.rs) is a thin CLI over it.
