//! The GGUF reader: header, metadata and tensor index from arbitrary bytes
//! (see kiln_formats::fuzz::gguf_reader).
//!
//! Seeds: fuzz/corpus/gguf_reader (regenerate with
//! `cargo test --release -p kiln-formats --test fuzz_harness -- --ignored regenerate`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kiln_formats::fuzz::gguf_reader(data));
