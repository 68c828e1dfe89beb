//! Chat templates as untrusted code: compile and render within the template limits
//! (see kiln_formats::fuzz::chat_template).
//!
//! Seeds: fuzz/corpus/chat_template (regenerate with
//! `cargo test --release -p kiln-formats --test fuzz_harness -- --ignored regenerate`).
#![no_main]

use libfuzzer_sys::fuzz_target;

// Templates get the memory and time bound the `kiln` binary gives them.
#[global_allocator]
static ALLOC: kiln_formats::chat::memory::GuardedAlloc = kiln_formats::chat::memory::GuardedAlloc;

fuzz_target!(|data: &[u8]| kiln_formats::fuzz::chat_template(data));
