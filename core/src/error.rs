//! The error type shared by kiln's crates.

/// Everything that can go wrong between opening a model and producing a token. Each variant
/// carries a message a user can act on. Hosts match on the variants they handle and keep a
/// wildcard arm: new variants may come (`#[non_exhaustive]`).
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    #[error("I/O error: {0}")]
    Io(#[from] std::io::Error),
    /// The model file is malformed, truncated or hostile.
    #[error("invalid model file: {0}")]
    Format(String),
    /// A tensor or row shape that does not fit its type or role.
    #[error("invalid shape: {0}")]
    InvalidShape(String),
    /// The model is well-formed but uses something kiln (or this backend) cannot run.
    #[error("unsupported: {0}")]
    Unsupported(String),
    /// No backend can run the model, or the named one is unknown or refused it.
    #[error("no backend: {0}")]
    NoBackend(String),
    /// The backend failed at run time (device error, lost context ...).
    #[error("backend {backend}: {message}")]
    Backend { backend: String, message: String },
    /// Device or host memory ran out; nothing was lost, a smaller request may succeed.
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    /// A plugin library could not be loaded or misbehaved.
    #[error("plugin {path}: {message}")]
    Plugin { path: String, message: String },
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// The caller passed something out of range (unknown sequence, context full ...).
    /// A saved-logits file (`kiln perplexity --save-logits`) that cannot be used: not one,
    /// another version, truncated, or corrupt.
    #[error("saved logits {path}: {message}")]
    SavedLogits { path: String, message: String },
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The paged KV cache has no free block for a sequence to grow into: the call changed
    /// nothing, and succeeds once other sequences finish (a scheduler waits, or preempts).
    #[error(
        "the KV cache is full: {needed} more block(s) needed, {free} of {total} free; finish or \
         free a sequence, or give the cache more memory (--kv-mem)"
    )]
    KvCacheFull {
        needed: usize,
        free: usize,
        total: usize,
    },
    /// A prompt as long as the context or longer: nothing was run. `tokens` is the prompt's
    /// length, `context` what one sequence holds (a longer context is a load option).
    #[error("the prompt has {tokens} tokens; the context holds {context}")]
    ContextExceeded { tokens: usize, context: usize },
    /// The model computed NaN or infinite logits: a weight or activation is not finite.
    /// `step` 0 is the prompt's logits, n the n-th generated token's.
    #[error("the model produced non-finite logits (NaN or infinity) at step {step}: a weight or activation is not finite")]
    NonFiniteLogits { step: usize },
}

pub type Result<T, E = Error> = std::result::Result<T, E>;
