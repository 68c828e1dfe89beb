//! GGUF files as models: the reader, the GGUF → IR mapping, the tokenizer and chat template
//! built from the file's metadata, and their first use (see kiln_formats::fuzz::gguf_model).
//!
//! Seeds: fuzz/corpus/gguf_model (regenerate with
//! `cargo test --release -p kiln-formats --test fuzz_harness -- --ignored regenerate`).
#![no_main]

use libfuzzer_sys::fuzz_target;

// Templates get the memory and time bound the `kiln` binary gives them.
#[global_allocator]
static ALLOC: kiln_formats::chat::memory::GuardedAlloc = kiln_formats::chat::memory::GuardedAlloc;

fuzz_target!(|data: &[u8]| kiln_formats::fuzz::gguf_model(data));
