//! # kiln-core
//!
//! The vocabulary every other kiln crate speaks: tensor types and their block layouts with
//! reference (de)quantisation ([`qtype`], [`quant`]), the model IR ([`ir`]), the
//! [`Backend`] / [`LayerExecutor`] traits ([`backend`]), the backend [`Registry`]
//! ([`registry`]), token sampling ([`sampling`]) and the shared [`Error`].
//!
//! It must not know any file format (that is `kiln-formats`) nor any device API (that is
//! each backend's business): a model reaches a backend only as a [`ModelIr`].

pub mod backend;
pub mod error;
pub mod ir;
pub mod parallel;
pub mod plugin_abi;
pub mod program;
pub mod qtype;
pub mod quant;
pub mod registry;
pub mod sampling;
pub mod sequences;
pub mod testdata;

pub use backend::{
    check_decode, check_decode_batch, check_decode_items, check_finite, check_hidden_batch,
    check_prefill, check_prefill_hidden, check_prefill_logits, check_prefill_scores,
    check_sample_slots, check_tokens, decode_sample_on_host, prefill_logits_stepwise,
    prefill_scores_from_logits, score, Backend, DecodeItem, HiddenRequest, KvType, LayerExecutor,
    LoadOptions, ProgressFn, SeqId, Support, TokenScore,
};
pub use error::{Error, Result};
pub use ir::{
    Activation, Architecture, ExpertBiases, ExpertConfig, ExpertTensors, ExpertWeights,
    GraniteScales, LayerAttention, LayerWeights, ModelConfig, ModelIr, ModelWeights, NormKind,
    RopeConfig, RopeKind, RopeScaling, SlidingWindow, Storage, TensorView,
};
pub use program::ModelProgram;
pub use qtype::QType;
pub use registry::{BuiltinBackend, Candidate, Registry};
pub use sampling::{argmax, Rng, Sampler, SamplingParams};
pub use sequences::{KvBlockUsage, SeqSlot, SequenceSlots, KV_BLOCK_TOKENS};

// Re-exported so backends register with the same `inventory` the registry collects from.
pub use inventory;
