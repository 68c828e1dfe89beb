//! # kiln-formats
//!
//! Turns weight files into kiln's IR. It reads and writes GGUF ([`gguf`]), maps each
//! architecture's tensor names and metadata onto the typed roles of a
//! [`kiln_core::ModelIr`] ([`model`]), builds the tokenizer and chat template the file
//! carries ([`tokenizer`], [`chat`]), and asks the registry which backend fits the model's
//! qtypes ([`model::dispatch`]). It also makes model files: [`quantize`] rewrites a GGUF
//! with llama.cpp's per-tensor quantisation recipes, and [`synth`] writes random-weight
//! models with the exact shapes of real ones, for benchmarks.
//!
//! It knows no backend internals: a backend sees only the IR.

pub mod apr;
pub mod apr_model;
pub mod chat;
#[doc(hidden)]
pub mod fuzz;
pub mod gguf;
pub mod model;
pub mod quantize;
pub mod synth;
pub mod tokenizer;
