//! Text through SentencePiece and every byte-level BPE pre-tokenizer, and arbitrary ids
//! through the decoders (see kiln_formats::fuzz::tokenizer).
//!
//! Seeds: fuzz/corpus/tokenizer (regenerate with
//! `cargo test --release -p kiln-formats --test fuzz_harness -- --ignored regenerate`).
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| kiln_formats::fuzz::tokenizer(data));
