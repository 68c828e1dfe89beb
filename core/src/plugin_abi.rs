//! The C ABI between a kiln host and a backend plugin (a `.so` / `.dylib` / `.dll`).
//!
//! A plugin exports one `extern "C"` symbol, [`ENTRY_SYMBOL`] (`kiln_plugin_entry`), of type
//! [`KilnPluginEntry`]: it returns a pointer to a static [`KilnPluginApi`], a table of
//! function pointers whose first two fields are always [`abi_version`](KilnPluginApi::abi_version)
//! (`major << 16 | minor`) and [`struct_size`](KilnPluginApi::struct_size). Everything else
//! crosses through that table: plain-old-data `#[repr(C)]` structs, opaque handles, and
//! status codes with UTF-8 messages. No Rust type (no `String`, `Vec`, trait object or
//! `Result`) crosses the boundary, so host and plugin may be built by different compilers.
//!
//! Rules both sides follow (docs/plugins.md is the full contract):
//! - **Whoever allocates frees.** Strings a plugin hands out ([`KilnOwnedStr`]) go back
//!   through `free_string`; backends through `destroy_backend`; executors through
//!   `free_executor`. Data the host passes in is borrowed for the call only, except the
//!   tensor bytes, which stay valid until the executor loaded from them is freed.
//! - **Weights are never copied:** a [`KilnTensorDesc`] points into the host's mapping.
//! - **Errors are values:** every fallible call returns a [`KilnStatus`] and, on failure,
//!   may write a message into the `err` out-parameter. A panic must never unwind into the
//!   host; it becomes [`KilnStatus::PANIC`].
//! - **Versioning:** a minor version only appends (trailing table fields guarded by
//!   `struct_size`, new enum values, new flag bits); anything else bumps the major, and a
//!   host refuses a plugin of another major.
//!
//! This module also holds the marshalling both sides share: [`ModelDescBuf`] turns a
//! [`ModelIr`] into descriptors (host side) and [`model_from_desc`] rebuilds a [`ModelIr`]
//! over the host's memory without copying (plugin side).

use std::ffi::c_void;
use std::ops::Deref;
use std::sync::Arc;

use crate::error::{Error, Result};
use crate::ir::{
    Activation, Architecture, GraniteScales, LayerAttention, LayerWeights, ModelConfig, ModelIr,
    ModelWeights, NormKind, RopeConfig, RopeKind, RopeScaling, SlidingWindow, TensorView,
};
use crate::program::{
    Attention, Branch, Embedding, FeedForward, Head, HeadNorms, Linear, ModelProgram, Norm, Op,
};
use crate::qtype::QType;

/// Major version: bumped by any change an older host or plugin could misread.
pub const ABI_MAJOR: u16 = 1;
/// Minor version: bumped by purely additive changes (see the module docs). 1.2 added qtype
/// id 128 (APR Q4): ids from 128 up are kiln's own types, outside ggml's id space. 1.3
/// appended [`KilnPluginApi::decode_sample`] (a plugin draws tokens itself). 1.4 appended
/// [`KilnModelDesc::program`]: the model's forward pass as the host's architecture builder
/// made it ([`KilnProgramDesc`]), so an architecture made of known operations reaches a
/// plugin with no new field.
pub const ABI_MINOR: u16 = 4;
/// `ABI_MAJOR << 16 | ABI_MINOR`, the value in [`KilnPluginApi::abi_version`].
pub const ABI_VERSION: u32 = pack_version(ABI_MAJOR, ABI_MINOR);
/// Name of the symbol every plugin exports.
pub const ENTRY_SYMBOL: &str = "kiln_plugin_entry";

/// Packs a version as it appears in `abi_version`.
pub const fn pack_version(major: u16, minor: u16) -> u32 {
    (major as u32) << 16 | minor as u32
}
/// The major half of a packed version.
pub const fn version_major(v: u32) -> u16 {
    (v >> 16) as u16
}
/// The minor half of a packed version.
pub const fn version_minor(v: u32) -> u16 {
    (v & 0xffff) as u16
}
/// `"major.minor"` of a packed version, for messages.
pub fn version_string(v: u32) -> String {
    format!("{}.{}", version_major(v), version_minor(v))
}

/// Result of every fallible ABI call. Values not listed here (from a newer peer) must be
/// treated as [`KilnStatus::ERROR`].
#[repr(transparent)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KilnStatus(pub i32);

impl KilnStatus {
    pub const OK: KilnStatus = KilnStatus(0);
    /// A failure with no more specific code (device error, internal error).
    pub const ERROR: KilnStatus = KilnStatus(1);
    /// The caller passed something out of range (unknown sequence, context full, bad buffer).
    pub const INVALID_ARGUMENT: KilnStatus = KilnStatus(2);
    /// Well-formed but not something this backend runs.
    pub const UNSUPPORTED: KilnStatus = KilnStatus(3);
    pub const OUT_OF_MEMORY: KilnStatus = KilnStatus(4);
    /// The plugin panicked; the message is the panic payload. An executor that panicked is
    /// poisoned by the SDK and refuses further calls.
    pub const PANIC: KilnStatus = KilnStatus(5);
    /// `probe` only: the device is not usable here; the message says why.
    pub const UNAVAILABLE: KilnStatus = KilnStatus(6);
    pub const INVALID_SHAPE: KilnStatus = KilnStatus(7);
    /// A model descriptor the plugin cannot make sense of.
    pub const FORMAT: KilnStatus = KilnStatus(8);

    pub fn is_ok(self) -> bool {
        self == KilnStatus::OK
    }
}

/// A borrowed UTF-8 string (not NUL-terminated). `ptr` may be null only when `len` is 0.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnStr {
    pub ptr: *const u8,
    pub len: usize,
}

impl KilnStr {
    pub const EMPTY: KilnStr = KilnStr {
        ptr: std::ptr::null(),
        len: 0,
    };

    /// Borrows `s` (the caller keeps `s` alive while the view is used).
    pub fn new(s: &str) -> KilnStr {
        KilnStr {
            ptr: s.as_ptr(),
            len: s.len(),
        }
    }

    /// The string, checked: null with a non-zero length, a length over `max` and invalid
    /// UTF-8 are errors naming `what`.
    ///
    /// # Safety
    /// `ptr` must point to `len` readable bytes that stay valid for `'a`.
    pub unsafe fn to_str<'a>(self, what: &str, max: usize) -> std::result::Result<&'a str, String> {
        if self.len > max {
            return Err(format!(
                "{what} is {} bytes long; at most {max} are allowed",
                self.len
            ));
        }
        if self.len == 0 {
            return Ok("");
        }
        if self.ptr.is_null() {
            return Err(format!("{what} is a null pointer with length {}", self.len));
        }
        // SAFETY: non-null (checked), and the caller promises `len` readable bytes.
        let bytes = unsafe { std::slice::from_raw_parts(self.ptr, self.len) };
        std::str::from_utf8(bytes).map_err(|e| format!("{what} is not UTF-8: {e}"))
    }
}

/// A string the plugin allocated and the host must return through
/// [`KilnPluginApi::free_string`]. The all-zero value means "no string" and needs no release.
#[repr(C)]
#[derive(Debug)]
pub struct KilnOwnedStr {
    pub ptr: *mut u8,
    pub len: usize,
}

impl KilnOwnedStr {
    pub const NONE: KilnOwnedStr = KilnOwnedStr {
        ptr: std::ptr::null_mut(),
        len: 0,
    };

    pub fn is_none(&self) -> bool {
        self.ptr.is_null()
    }
}

/// Opaque backend instance, created by `create_backend`.
#[repr(C)]
pub struct KilnBackend {
    _private: [u8; 0],
}

/// Opaque loaded model, created by `load`.
#[repr(C)]
pub struct KilnExecutor {
    _private: [u8; 0],
}

/// The first two fields of every version of [`KilnPluginApi`]: the only part a host reads
/// before it knows the plugin speaks its major version.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnPluginHeader {
    pub abi_version: u32,
    pub struct_size: u32,
}

/// The entry point: returns a pointer to a table that lives as long as the library (a
/// `static`). It must not allocate, fail or have side effects; `create_backend` is where
/// initialisation happens.
pub type KilnPluginEntry = unsafe extern "C" fn() -> *const KilnPluginApi;

/// Optional load-progress callback: (user, bytes done, bytes total).
pub type KilnProgressFn = unsafe extern "C" fn(user: *mut c_void, done: u64, total: u64);

/// The function table of ABI 1.x. Every pointer is `Option` so a table from C with a null
/// entry is detected by the host instead of being called.
///
/// Threading: `describe`, `probe`, `supports` and `load` may be called concurrently from
/// several threads on one backend. The executor functions are called for one executor
/// from one thread at a time (the executor may move between threads).
///
/// Each `err` argument points to a [`KilnOwnedStr::NONE`] the plugin may fill with a
/// message when it returns anything but [`KilnStatus::OK`].
#[repr(C)]
pub struct KilnPluginApi {
    /// [`ABI_VERSION`] the plugin was built against.
    pub abi_version: u32,
    /// `size_of::<KilnPluginApi>()` as the plugin knows it: fields appended by later minor
    /// versions lie past this size in older plugins and must not be read.
    pub struct_size: u32,

    /// Releases a string the plugin handed out.
    pub free_string: Option<unsafe extern "C" fn(s: KilnOwnedStr)>,

    /// Creates the backend (initialises the library, opens the driver ...). `host_abi` is
    /// the host's [`ABI_VERSION`].
    pub create_backend: Option<
        unsafe extern "C" fn(
            host_abi: u32,
            out: *mut *mut KilnBackend,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    /// Destroys a backend. The host frees every executor loaded from it first.
    pub destroy_backend: Option<unsafe extern "C" fn(backend: *mut KilnBackend)>,
    /// Fills `out` (whose `struct_size` the host set) with strings and arrays that stay
    /// valid until `destroy_backend`.
    pub describe: Option<
        unsafe extern "C" fn(
            backend: *mut KilnBackend,
            out: *mut KilnBackendInfo,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    /// `OK` with a device description in `device`, or `UNAVAILABLE` with the reason in `err`.
    pub probe: Option<
        unsafe extern "C" fn(
            backend: *mut KilnBackend,
            device: *mut KilnOwnedStr,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    /// Scores a model. `model` (and the tensor bytes) are borrowed for this call only.
    pub supports: Option<
        unsafe extern "C" fn(
            backend: *mut KilnBackend,
            model: *const KilnModelDesc,
            out: *mut KilnSupport,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    /// Loads a model. The descriptor is borrowed for this call; the tensor bytes it points
    /// to stay valid until `free_executor` of the executor written to `out`.
    pub load: Option<
        unsafe extern "C" fn(
            backend: *mut KilnBackend,
            model: *const KilnModelDesc,
            options: *const KilnLoadOptions,
            out: *mut *mut KilnExecutor,
            info: *mut KilnExecutorInfo,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    pub free_executor: Option<unsafe extern "C" fn(executor: *mut KilnExecutor)>,
    pub new_sequence: Option<
        unsafe extern "C" fn(
            executor: *mut KilnExecutor,
            out: *mut u32,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    pub free_sequence: Option<
        unsafe extern "C" fn(
            executor: *mut KilnExecutor,
            seq: u32,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    pub sequence_len: Option<
        unsafe extern "C" fn(
            executor: *mut KilnExecutor,
            seq: u32,
            out: *mut u64,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    pub truncate_sequence: Option<
        unsafe extern "C" fn(
            executor: *mut KilnExecutor,
            seq: u32,
            len: u64,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    /// Appends `n_tokens` tokens to `seq`; writes the last one's logits (`n_logits` ==
    /// vocab) into the host's buffer.
    pub prefill: Option<
        unsafe extern "C" fn(
            executor: *mut KilnExecutor,
            seq: u32,
            tokens: *const u32,
            n_tokens: usize,
            logits: *mut f32,
            n_logits: usize,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    /// One decode step for `n_items` distinct sequences; row `i` of `logits`
    /// (`n_logits` == `n_items * vocab`) receives item `i`'s logits.
    pub decode: Option<
        unsafe extern "C" fn(
            executor: *mut KilnExecutor,
            items: *const KilnDecodeItem,
            n_items: usize,
            logits: *mut f32,
            n_logits: usize,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
    /// (1.3) One decode step for `n_items` distinct sequences with the next token of each
    /// drawn by the plugin (on its device, if it has one): `samplers[i]` carries item `i`'s
    /// settings, its generator state and recent tokens in, the generator state after the
    /// draw out; `tokens[i]` receives the token. Only ids cross the boundary. Absent (a 1.2
    /// plugin, or null), the host calls `decode` and samples the logits itself.
    pub decode_sample: Option<
        unsafe extern "C" fn(
            executor: *mut KilnExecutor,
            items: *const KilnDecodeItem,
            n_items: usize,
            samplers: *mut KilnSamplerState,
            n_samplers: usize,
            tokens: *mut u32,
            n_tokens: usize,
            err: *mut KilnOwnedStr,
        ) -> KilnStatus,
    >,
}

/// `struct_size` of the ABI 1.0 table: the least a 1.x host accepts (1.0 to 1.2 share it).
pub const API_SIZE_V1_0: u32 = std::mem::offset_of!(KilnPluginApi, decode_sample) as u32;

/// One sequence's sampler across the boundary ([`KilnPluginApi::decode_sample`]): the
/// settings of [`crate::SamplingParams`], the SplitMix64 state of its [`crate::Rng`] (in
/// and out) and the recent tokens its repetition penalty looks at (borrowed for the call).
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnSamplerState {
    pub temperature: f32,
    pub top_p: f32,
    pub min_p: f32,
    pub repeat_penalty: f32,
    pub top_k: u64,
    pub repeat_last_n: u64,
    pub seed: u64,
    pub rng_state: u64,
    pub recent: *const u32,
    pub n_recent: u64,
}

impl KilnSamplerState {
    /// `sampler` as it stands; `recent` must hold its recent tokens and outlive the call.
    pub fn from_sampler(sampler: &crate::Sampler, recent: &[u32]) -> KilnSamplerState {
        let p = &sampler.params;
        KilnSamplerState {
            temperature: p.temperature,
            top_p: p.top_p,
            min_p: p.min_p,
            repeat_penalty: p.repeat_penalty,
            top_k: p.top_k as u64,
            repeat_last_n: p.repeat_last_n as u64,
            seed: p.seed,
            rng_state: sampler.rng.state(),
            recent: recent.as_ptr(),
            n_recent: recent.len() as u64,
        }
    }

    /// The sampler this state describes; settings out of range are an error.
    ///
    /// # Safety
    /// `recent` must point to `n_recent` readable ids (or be anything when `n_recent` is 0).
    pub unsafe fn to_sampler(&self) -> Result<crate::Sampler> {
        let size = |v: u64, what: &str| {
            usize::try_from(v).map_err(|_| {
                Error::InvalidArgument(format!("sampler {what} {v} does not fit usize"))
            })
        };
        let params = crate::SamplingParams {
            temperature: self.temperature,
            top_p: self.top_p,
            min_p: self.min_p,
            repeat_penalty: self.repeat_penalty,
            top_k: size(self.top_k, "top_k")?,
            repeat_last_n: size(self.repeat_last_n, "repeat_last_n")?,
            seed: self.seed,
            // Not carried by ABI 1.3: the host samples rows with a bias itself.
            logit_bias: Vec::new(),
        };
        params.validate()?;
        let n = size(self.n_recent, "recent tokens")?;
        if n > params.repeat_last_n {
            return Err(Error::InvalidArgument(format!(
                "{n} recent tokens for a repetition window of {}",
                params.repeat_last_n
            )));
        }
        let recent: &[u32] = match n {
            0 => &[],
            _ if self.recent.is_null() => {
                return Err(Error::InvalidArgument(
                    "recent tokens: a null pointer".into(),
                ))
            }
            // SAFETY: the caller guarantees `n_recent` readable ids at `recent`.
            _ => unsafe { std::slice::from_raw_parts(self.recent, n) },
        };
        let mut s = crate::Sampler::new(params);
        s.rng = crate::Rng::new(self.rng_state);
        for &t in recent {
            s.accept(t);
        }
        Ok(s)
    }
}

/// What a backend says about itself. The host zeroes it and sets `struct_size`; the plugin
/// fills the fields that fit. Pointers stay valid until `destroy_backend`.
#[repr(C)]
#[derive(Debug)]
pub struct KilnBackendInfo {
    pub struct_size: u32,
    pub _reserved: u32,
    /// Unique short name (`--backend NAME`): 1–64 bytes, no whitespace or control characters.
    pub name: KilnStr,
    /// The plugin's own version (free form, up to 64 bytes).
    pub version: KilnStr,
    /// One line for listings (up to 1024 bytes).
    pub description: KilnStr,
    /// Type ids ([`QType::id`]: ggml's ids, and from 128 up kiln's own types) of the weight
    /// types it multiplies with (at most [`MAX_LIST`]). List an id from 128 up only to a
    /// host of ABI 1.2 or later: older hosts refuse unknown ids here.
    pub qtypes: *const u32,
    pub n_qtypes: usize,
    /// [`arch_id`]s it runs; none means "decided per model by `supports`".
    pub architectures: *const u32,
    pub n_architectures: usize,
}

impl KilnBackendInfo {
    /// A zeroed info whose `struct_size` says what this host understands.
    pub fn empty() -> Self {
        KilnBackendInfo {
            struct_size: std::mem::size_of::<KilnBackendInfo>() as u32,
            _reserved: 0,
            name: KilnStr::EMPTY,
            version: KilnStr::EMPTY,
            description: KilnStr::EMPTY,
            qtypes: std::ptr::null(),
            n_qtypes: 0,
            architectures: std::ptr::null(),
            n_architectures: 0,
        }
    }
}

/// Limits the host enforces on what a plugin describes.
pub const MAX_NAME: usize = 64;
pub const MAX_VERSION: usize = 64;
pub const MAX_DESCRIPTION: usize = 1024;
pub const MAX_LIST: usize = 256;
/// Longest message the host accepts from a plugin (longer ones are malformed data).
pub const MAX_MESSAGE: usize = 1 << 20;

/// Words in the `Error::Plugin` the host returns when a plugin's `prefill` or `decode`
/// reports success but leaves a logit unwritten or non-finite (the host fills the buffer
/// with NaN before every call). The conformance suite keys on them.
pub const UNWRITTEN_LOGITS: &str = "unwritten or non-finite logits";

/// Answer to `supports`: `supported` 1 with `score` and an optional note, or 0 with the
/// reason. `message` is plugin-owned (release with `free_string`).
#[repr(C)]
#[derive(Debug)]
pub struct KilnSupport {
    pub supported: u32,
    pub score: u32,
    pub message: KilnOwnedStr,
}

/// Flag bits of [`KilnModelConfig::flags`]. A plugin must refuse a model with a bit it does
/// not know: new bits are how a minor version adds a model feature.
pub mod flags {
    pub const GATED_FFN: u32 = 1 << 0;
    pub const PARALLEL_RESIDUAL: u32 = 1 << 1;
    pub const QKV_BIAS: u32 = 1 << 2;
    pub const QK_NORM: u32 = 1 << 3;
    pub const TIED_EMBEDDINGS: u32 = 1 << 4;
    /// Every bit ABI 1.0 defines.
    pub const KNOWN_V1_0: u32 =
        GATED_FFN | PARALLEL_RESIDUAL | QKV_BIAS | QK_NORM | TIED_EMBEDDINGS;
}

/// [`ModelConfig`] as plain data. Enums are the ids of [`arch_id`], [`norm_id`],
/// [`activation_id`], [`rope_kind_id`] and [`rope_scaling_id`].
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnModelConfig {
    pub struct_size: u32,
    pub arch: u32,
    pub vocab_size: u64,
    pub hidden_size: u64,
    pub num_layers: u64,
    pub num_heads: u64,
    pub num_kv_heads: u64,
    pub head_dim: u64,
    pub ffn_size: u64,
    pub context_length: u64,
    pub rotary_dims: u64,
    pub norm: u32,
    pub activation: u32,
    pub rope_kind: u32,
    pub rope_scaling: u32,
    pub norm_eps: f32,
    pub rope_theta: f32,
    /// Meaningful when `rope_scaling` is linear.
    pub rope_scaling_factor: f32,
    /// [`flags`] bits.
    pub flags: u32,
}

/// Where a tensor sits in the model. Per-layer roles carry the layer index in
/// [`KilnTensorDesc::layer`]; global ones carry [`NO_LAYER`].
#[repr(u32)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TensorRole {
    TokenEmbd = 0,
    OutputNorm = 1,
    OutputNormBias = 2,
    Output = 3,
    RopeFreqs = 4,
    AttnNorm = 16,
    AttnNormBias = 17,
    AttnQ = 18,
    AttnK = 19,
    AttnV = 20,
    AttnQBias = 21,
    AttnKBias = 22,
    AttnVBias = 23,
    AttnQNorm = 24,
    AttnKNorm = 25,
    AttnOut = 26,
    AttnOutBias = 27,
    FfnNorm = 28,
    FfnNormBias = 29,
    FfnGate = 30,
    FfnUp = 31,
    FfnDown = 32,
    /// (1.4) A tensor only the program names (a post-norm, or any tensor of an
    /// architecture the roles above do not cover); only sent with a program.
    Other = 63,
}

impl TensorRole {
    const ALL: [TensorRole; 23] = [
        TensorRole::TokenEmbd,
        TensorRole::OutputNorm,
        TensorRole::OutputNormBias,
        TensorRole::Output,
        TensorRole::RopeFreqs,
        TensorRole::AttnNorm,
        TensorRole::AttnNormBias,
        TensorRole::AttnQ,
        TensorRole::AttnK,
        TensorRole::AttnV,
        TensorRole::AttnQBias,
        TensorRole::AttnKBias,
        TensorRole::AttnVBias,
        TensorRole::AttnQNorm,
        TensorRole::AttnKNorm,
        TensorRole::AttnOut,
        TensorRole::AttnOutBias,
        TensorRole::FfnNorm,
        TensorRole::FfnNormBias,
        TensorRole::FfnGate,
        TensorRole::FfnUp,
        TensorRole::FfnDown,
        TensorRole::Other,
    ];

    pub fn from_id(id: u32) -> Option<TensorRole> {
        TensorRole::ALL.iter().copied().find(|r| *r as u32 == id)
    }

    /// Roles that exist once per layer.
    pub fn per_layer(self) -> bool {
        self as u32 >= 16 && self != TensorRole::Other
    }
}

/// `layer` of a global tensor.
pub const NO_LAYER: u32 = u32::MAX;
/// Most dimensions a tensor may have (ggml's limit).
pub const MAX_DIMS: usize = 4;

/// One weight tensor, pointing into the host's memory.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnTensorDesc {
    pub name: KilnStr,
    /// A [`TensorRole`] id.
    pub role: u32,
    pub layer: u32,
    /// Type id ([`QType::id`]): ggml's id for ggml types, from 128 up for kiln's own (128:
    /// APR Q4, since ABI 1.2). A plugin refuses an id it does not know.
    pub qtype: u32,
    pub n_dims: u32,
    /// `dims[0]` is the contiguous row length; entries past `n_dims` are 0.
    pub dims: [u64; MAX_DIMS],
    pub data: *const u8,
    /// Byte length; equals what `qtype` and `dims` imply.
    pub len: u64,
}

/// A whole model: configuration plus every tensor once.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnModelDesc {
    pub struct_size: u32,
    pub _reserved: u32,
    pub config: *const KilnModelConfig,
    pub tensors: *const KilnTensorDesc,
    pub n_tensors: usize,
    /// Human-readable origin for messages.
    pub source: KilnStr,
    // ---- ABI 1.4 ----
    /// The forward pass, or null. A 1.4 host sends it to a plugin of 1.4 or later, and
    /// then may describe models `KilnModelConfig` alone cannot (Gemma 3, Granite); an older
    /// plugin is never sent such a model. It lies past a 1.3 host's `struct_size`:
    /// [`KilnModelDesc::read`] then gives null.
    pub program: *const KilnProgramDesc,
}

/// `struct_size` of ABI 1.0's [`KilnModelDesc`] (everything before `program`): the least a
/// 1.x plugin accepts.
pub const MODEL_DESC_SIZE_V1_0: u32 = std::mem::offset_of!(KilnModelDesc, program) as u32;

impl KilnModelDesc {
    /// Reads the descriptor a host of any 1.x minor passed: refuses a `struct_size` short
    /// of ABI 1.0's fields and copies only the bytes the host declared, so fields a newer
    /// minor appended read as zero (null).
    ///
    /// # Safety
    /// `desc` must be null or point to `struct_size` readable bytes (the ABI's promise).
    pub unsafe fn read(desc: *const KilnModelDesc) -> std::result::Result<KilnModelDesc, String> {
        if desc.is_null() {
            return Err("null model descriptor".into());
        }
        // SAFETY: non-null (checked); every minor's struct starts with this u32.
        let struct_size = unsafe { std::ptr::read(desc as *const u32) };
        if struct_size < MODEL_DESC_SIZE_V1_0 {
            return Err(format!(
                "struct_size {struct_size} is smaller than ABI 1.0's {MODEL_DESC_SIZE_V1_0} bytes"
            ));
        }
        // SAFETY: all-zero is a valid KilnModelDesc (null pointers, empty string).
        let mut out: KilnModelDesc = unsafe { std::mem::zeroed() };
        let n = (struct_size as usize).min(std::mem::size_of::<KilnModelDesc>());
        // SAFETY: the caller promises `struct_size` readable bytes; at most that many, and
        // no more than `out` holds, are copied.
        unsafe {
            std::ptr::copy_nonoverlapping(
                desc as *const u8,
                &mut out as *mut KilnModelDesc as *mut u8,
                n,
            )
        };
        Ok(out)
    }
}

// ---- the model program (ABI 1.4) ---------------------------------------------------
//
// [`crate::program::ModelProgram`] as plain data. Weights are indices into the model
// descriptor's tensor array ([`NO_TENSOR`] where a slot is empty); operations are
// [`KilnOpDesc`]s whose `kind` says what their slots mean, the way a ggml node's `op`
// gives meaning to its `src` and `op_params`. A new kind of operation is a new
// [`op_kind`] value (a minor version); a plugin refuses kinds it does not know, so it never
// runs a model it would misread.

/// An empty tensor slot of a program.
pub const NO_TENSOR: u32 = u32::MAX;
/// Tensor slots, numbers and integers of one [`KilnOpDesc`].
pub const OP_TENSORS: usize = 12;
pub const OP_VALUES: usize = 4;
pub const OP_INTS: usize = 4;
/// Most branches or operations a program may have (far above any model's).
pub const MAX_PROGRAM_LEN: usize = 1 << 16;

/// A norm of a program: `kind` a [`norm_id`], `weight` and `bias` tensor indices (`bias`
/// [`NO_TENSOR`] for none), and ε. As a branch's `post_norm`, `weight` [`NO_TENSOR`] means
/// the branch has none.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnNormDesc {
    pub kind: u32,
    pub weight: u32,
    pub bias: u32,
    pub eps: f32,
}

/// The kinds of [`KilnOpDesc`] and what their slots hold.
pub mod op_kind {
    /// Causal self-attention whose KV cache is the op's `layer`.
    /// - tensors: `[q, q bias, k, k bias, v, v bias, out, out bias, q head norm, k head norm]`
    ///   (biases and head norms [`super::NO_TENSOR`] when absent; head norms both or neither)
    /// - values: `[score scale, head-norm ε]`
    /// - ints: `[window, local rope]`: the positions a query sees, its own included (0: the
    ///   whole context); 1 when the layer rotates with the windowed layers' base
    ///   ([`super::KilnProgramDesc::local_rope_theta`], unscaled), 0 with the config's rope.
    pub const ATTENTION: u32 = 0;
    /// A dense feed-forward: `down(act(gate·x) ⊙ up·x)`, or `down(act(up·x))` ungated.
    /// - tensors: `[gate (NO_TENSOR: ungated), up, down]`
    /// - ints: `[activation id]` ([`super::activation_id`])
    pub const FEED_FORWARD: u32 = 1;
}

/// One operation of a branch (see [`op_kind`]). Unused slots are [`NO_TENSOR`] and 0.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnOpDesc {
    pub kind: u32,
    /// The layer whose KV cache an attention uses; [`NO_LAYER`] for other kinds.
    pub layer: u32,
    pub tensors: [u32; OP_TENSORS],
    pub values: [f32; OP_VALUES],
    pub ints: [u64; OP_INTS],
}

impl KilnOpDesc {
    fn empty(kind: u32, layer: u32) -> KilnOpDesc {
        KilnOpDesc {
            kind,
            layer,
            tensors: [NO_TENSOR; OP_TENSORS],
            values: [0.0; OP_VALUES],
            ints: [0; OP_INTS],
        }
    }
}

/// `x += scale · post_norm(Σ ops(norm(x)))` over the ops `first_op .. first_op + n_ops`.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnBranchDesc {
    pub norm: KilnNormDesc,
    pub post_norm: KilnNormDesc,
    pub scale: f32,
    pub first_op: u32,
    pub n_ops: u32,
}

/// The forward pass (see [`crate::program`]):
/// ```text
/// x  = embedding_scale · embedding[token]
/// x += branch.scale · post_norm(Σ op(norm(x)))      for each branch, in order
/// logits = logit_scale · output(head_norm(x))
/// ```
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnProgramDesc {
    pub struct_size: u32,
    pub _reserved: u32,
    /// Tensor index of the token embedding (vocabulary rows of hidden values).
    pub embedding: u32,
    pub embedding_scale: f32,
    pub head_norm: KilnNormDesc,
    /// Tensor index of the LM head (the embedding's own when tied).
    pub output: u32,
    pub logit_scale: f32,
    /// Tensor index of the per-pair RoPE frequency factors, or [`NO_TENSOR`].
    pub rope_freqs: u32,
    /// RoPE base of the attentions marked local (0 when none is).
    pub local_rope_theta: f32,
    /// The config's sliding window: positions a windowed layer sees (0: no window) and the
    /// period of the layers that see everything (layers `global_every - 1`,
    /// `2·global_every - 1`, …). Each attention's own window must agree.
    pub sliding_window: u64,
    pub sliding_global_every: u64,
    pub branches: *const KilnBranchDesc,
    pub n_branches: usize,
    pub ops: *const KilnOpDesc,
    pub n_ops: usize,
}

/// [`crate::LoadOptions`] as plain data.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnLoadOptions {
    pub struct_size: u32,
    pub _reserved: u32,
    /// 0: the model's own, capped as [`crate::LoadOptions::context_for`] does.
    pub max_context: u64,
    /// 0 means 1.
    pub max_sequences: u64,
    /// 0 means all cores.
    pub threads: u64,
    /// Valid only during the `load` call.
    pub progress: Option<KilnProgressFn>,
    pub progress_user: *mut c_void,
    // ---- ABI 1.1 ----
    /// [`load_flags`] bits. Lies past a 1.0 host's `struct_size`; [`KilnLoadOptions::read`]
    /// then gives 0, every option off.
    pub flags: u32,
    /// 0. Spelled out so the size is a multiple of 8 on every target, in C as in Rust.
    pub _reserved1: u32,
}

/// `struct_size` of ABI 1.0's [`KilnLoadOptions`] (everything before `flags`): the least a
/// 1.x plugin accepts.
pub const LOAD_OPTIONS_SIZE_V1_0: u32 = std::mem::offset_of!(KilnLoadOptions, flags) as u32;

/// Bits of [`KilnLoadOptions::flags`] (ABI 1.1).
///
/// Unlike model [`flags`], every load flag is a *permission* a backend may decline: a
/// plugin built before a bit existed never reads it (it copies only the prefix of the
/// options it knows), so no bit may carry something a backend is obliged to honour. A
/// plugin ignores bits it does not know.
pub mod load_flags {
    /// [`crate::LoadOptions::quantized_activations`]: the backend may quantise activations
    /// to 8 bits for integer dot products, trading exactness for speed.
    pub const QUANTIZED_ACTIVATIONS: u32 = 1 << 0;
}

impl KilnLoadOptions {
    /// Reads the options a host of any 1.x minor passed to `load`: refuses a `struct_size`
    /// short of ABI 1.0's fields, and copies only the `struct_size` bytes the host declared,
    /// so fields appended by a minor newer than the host read as zero (their defaults).
    ///
    /// # Safety
    /// `options` must be null or point to `struct_size` readable bytes (the ABI's promise).
    pub unsafe fn read(
        options: *const KilnLoadOptions,
    ) -> std::result::Result<KilnLoadOptions, String> {
        if options.is_null() {
            return Err("options is a null pointer".into());
        }
        // `struct_size` is the first field in every minor; it is all that may be read
        // before the size is known.
        // SAFETY: non-null (checked); every minor's struct starts with this u32.
        let struct_size = unsafe { std::ptr::read(options as *const u32) };
        if struct_size < LOAD_OPTIONS_SIZE_V1_0 {
            return Err(format!(
                "load options struct_size {struct_size} is smaller than ABI 1.0's {LOAD_OPTIONS_SIZE_V1_0} bytes"
            ));
        }
        // SAFETY: all-zero is a valid KilnLoadOptions (null pointers, `None` callback).
        let mut out: KilnLoadOptions = unsafe { std::mem::zeroed() };
        let n = (struct_size as usize).min(std::mem::size_of::<KilnLoadOptions>());
        // SAFETY: the caller promises `struct_size` readable bytes; at most that many, and
        // no more than `out` holds, are copied.
        unsafe {
            std::ptr::copy_nonoverlapping(
                options as *const u8,
                &mut out as *mut KilnLoadOptions as *mut u8,
                n,
            )
        };
        Ok(out)
    }
}

/// What the host needs to know about a loaded executor.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct KilnExecutorInfo {
    pub struct_size: u32,
    pub _reserved: u32,
    pub max_context: u64,
    pub max_sequences: u64,
}

/// [`crate::DecodeItem`] as plain data.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KilnDecodeItem {
    pub seq: u32,
    pub token: u32,
}

// ---- enum ids ------------------------------------------------------------------------
//
// The `*_id` functions match exhaustively, so adding a variant to the IR fails to compile
// until it is given an ABI id (a minor-version addition).

pub fn arch_id(a: &Architecture) -> u32 {
    match a {
        Architecture::Llama => 0,
        Architecture::Mistral => 1,
        Architecture::Qwen2 => 2,
        Architecture::Qwen3 => 3,
        // Gemma 3 and Granite are sent only with a program (ABI 1.4), which carries what
        // `KilnModelConfig` lacks: sandwich norms, scales, sliding windows
        // (`check_describable`).
        Architecture::Gemma3 => 4,
        Architecture::Phi3 => 5,
        Architecture::Granite(_) => 6,
        // Never sent: no ABI op describes their experts (`check_describable`).
        Architecture::Qwen3Moe => 7,
        Architecture::GptOss => 8,
    }
}

/// Whether a plugin of ABI `peer` can be given the model of config `c` and `program`: from
/// 1.4 every model crosses with its program; an older plugin has only `KilnModelConfig`,
/// and gets an `Unsupported` error naming what that lacks (a plugin must never run a model
/// it would misread).
pub fn check_describable(
    c: &ModelConfig,
    program: &ModelProgram<TensorView>,
    peer: u32,
) -> Result<()> {
    if program.ops().any(|op| matches!(op, Op::Experts(_))) {
        return Err(experts_undescribable(peer));
    }
    if let Some(what) = program.ops().find_map(undescribable_part) {
        return Err(Error::Unsupported(format!(
            "plugin ABI {} cannot describe {what} to a plugin",
            version_string(peer)
        )));
    }
    if version_minor(peer) >= 4 {
        return Ok(());
    }
    let parts = LayerParts::of(program);
    let lacks = if c.arch == Architecture::Gemma3 {
        Some("the gemma3 architecture")
    } else if matches!(c.arch, Architecture::Granite(_)) {
        Some("granite's residual, attention and logit multipliers")
    } else if c.embedding_scale != 1.0 {
        Some("a scaled embedding")
    } else if program.branches.iter().any(|b| b.post_norm.is_some()) {
        Some("norms after attention and the MLP")
    } else if c.sliding_window.is_some() {
        Some("sliding-window attention")
    } else if parts.every != parts.some {
        Some("layers that differ in their Q/K/V biases, head norms or gates")
    } else {
        None
    };
    match lacks {
        Some(what) => Err(Error::Unsupported(format!(
            "plugin ABI {} cannot describe {what} to a plugin (1.4 can: rebuild the plugin against it)",
            version_string(peer)
        ))),
        None => Ok(()),
    }
}

/// The `KilnModelConfig::flags` bits of a program's layers: those every layer has, and
/// those some layer has (the flags describe a model whose layers all agree).
struct LayerParts {
    every: u32,
    some: u32,
}

impl LayerParts {
    fn of(program: &ModelProgram<TensorView>) -> LayerParts {
        let mut parts = LayerParts {
            every: flags::GATED_FFN | flags::QKV_BIAS | flags::QK_NORM,
            some: 0,
        };
        let mut note = |bit: u32, every: bool, some: bool| {
            if !every {
                parts.every &= !bit;
            }
            if some {
                parts.some |= bit;
            }
        };
        for op in program.ops() {
            match op {
                Op::Attention(a) => {
                    let biases = [&a.q.bias, &a.k.bias, &a.v.bias].map(Option::is_some);
                    note(
                        flags::QKV_BIAS,
                        biases.iter().all(|&b| b),
                        biases.iter().any(|&b| b),
                    );
                    let norms = a.head_norms.is_some();
                    note(flags::QK_NORM, norms, norms);
                }
                Op::FeedForward(f) => {
                    let gated = f.gate.is_some();
                    note(flags::GATED_FFN, gated, gated);
                }
                // Refused before a model reaches a plugin (`check_describable`).
                Op::Experts(_) => {}
            }
        }
        if program.branches.iter().any(|b| b.ops.len() > 1) {
            parts.every |= flags::PARALLEL_RESIDUAL;
            parts.some |= flags::PARALLEL_RESIDUAL;
        }
        parts
    }
}

/// The `flags` a host sends with the model of `program`: its layers' parts (when all agree)
/// and a tied head. A plugin rebuilds the program and checks the host's flags against it.
fn structure_flags(program: &ModelProgram<TensorView>, tied_embeddings: bool) -> u32 {
    LayerParts::of(program).every
        | if tied_embeddings {
            flags::TIED_EMBEDDINGS
        } else {
            0
        }
}

/// The architectures `KilnModelConfig` describes on its own (without a program).
pub fn arch_from_id(id: u32) -> Option<Architecture> {
    [
        Architecture::Llama,
        Architecture::Mistral,
        Architecture::Qwen2,
        Architecture::Qwen3,
        Architecture::Phi3,
    ]
    .into_iter()
    .find(|a| arch_id(a) == id)
}

/// The architecture of id `id` given the model's `program`: Gemma 3 needs nothing more;
/// Granite's multipliers are read back from the program (its first attention's scale, its
/// first branch's scale, the inverse of its logit scale).
fn arch_with_program(id: u32, program: &ModelProgram<TensorView>) -> Option<Architecture> {
    if id == arch_id(&Architecture::Gemma3) {
        return Some(Architecture::Gemma3);
    }
    if id
        == arch_id(&Architecture::Granite(GraniteScales {
            residual: 1.0,
            attention: 1.0,
            logits: 1.0,
        }))
    {
        let attention = program.ops().find_map(|op| match op {
            Op::Attention(a) => Some(a.scale),
            _ => None,
        })?;
        return Some(Architecture::Granite(GraniteScales {
            residual: program.branches.first()?.scale,
            attention,
            logits: 1.0 / program.head.logit_scale,
        }));
    }
    arch_from_id(id)
}
pub fn norm_id(n: NormKind) -> u32 {
    match n {
        NormKind::Rms => 0,
        NormKind::Layer => 1,
    }
}
pub fn norm_from_id(id: u32) -> Option<NormKind> {
    [NormKind::Rms, NormKind::Layer]
        .into_iter()
        .find(|n| norm_id(*n) == id)
}
pub fn activation_id(a: Activation) -> u32 {
    match a {
        Activation::Silu => 0,
        Activation::Gelu => 1,
        // Never sent: only gpt-oss's experts use it (`check_describable`), and its constants
        // would not cross with an id.
        Activation::SwigluOai { .. } => 2,
    }
}
pub fn activation_from_id(id: u32) -> Option<Activation> {
    [Activation::Silu, Activation::Gelu]
        .into_iter()
        .find(|a| activation_id(*a) == id)
}
pub fn rope_kind_id(k: RopeKind) -> u32 {
    match k {
        RopeKind::Norm => 0,
        RopeKind::Neox => 2,
    }
}
pub fn rope_kind_from_id(id: u32) -> Option<RopeKind> {
    [RopeKind::Norm, RopeKind::Neox]
        .into_iter()
        .find(|k| rope_kind_id(*k) == id)
}
/// Scaling kind id and factor. YaRN is id 2, which no 1.x plugin decodes: its ramp and
/// attention factor have no fields in [`KilnModelConfig`], so a plugin refuses such a model
/// (as an unknown id) rather than run it with the wrong positions.
pub fn rope_scaling_id(s: RopeScaling) -> (u32, f32) {
    match s {
        RopeScaling::None => (0, 1.0),
        RopeScaling::Linear { factor } => (1, factor),
        RopeScaling::Yarn { factor, .. } => (2, factor),
    }
}
pub fn rope_scaling_from_id(id: u32, factor: f32) -> Option<RopeScaling> {
    match id {
        0 => Some(RopeScaling::None),
        1 => Some(RopeScaling::Linear { factor }),
        _ => None,
    }
}

// ---- config ------------------------------------------------------------------------

/// The plain-data form of `c`, with the flags of its model's `program`.
pub fn config_to_abi(c: &ModelConfig, program: &ModelProgram<TensorView>) -> KilnModelConfig {
    let (rope_scaling, rope_scaling_factor) = rope_scaling_id(c.rope.scaling);
    KilnModelConfig {
        struct_size: std::mem::size_of::<KilnModelConfig>() as u32,
        arch: arch_id(&c.arch),
        vocab_size: c.vocab_size as u64,
        hidden_size: c.hidden_size as u64,
        num_layers: c.num_layers as u64,
        num_heads: c.num_heads as u64,
        num_kv_heads: c.num_kv_heads as u64,
        head_dim: c.head_dim as u64,
        ffn_size: c.ffn_size as u64,
        context_length: c.context_length as u64,
        rotary_dims: c.rope.rotary_dims as u64,
        norm: norm_id(c.norm),
        activation: activation_id(c.activation),
        rope_kind: rope_kind_id(c.rope.kind),
        rope_scaling,
        norm_eps: c.norm_eps,
        rope_theta: c.rope.theta,
        rope_scaling_factor,
        flags: structure_flags(program, c.tied_embeddings),
    }
}

/// Rebuilds a [`ModelConfig`], refusing unknown enum ids, unknown flag bits, sizes that do
/// not fit `usize` and inconsistent shapes. The flags describe the weights, not the config:
/// [`model_from_desc`] checks them against the rebuilt model.
pub fn config_from_abi(c: &KilnModelConfig) -> Result<ModelConfig> {
    config_with_program(c, None)
}

/// [`config_from_abi`], completed from the program the host sent with it: the architectures
/// only a program describes, the embedding scale and the sliding window
/// (`desc`'s, which [`crate::program::build`] then checks each attention against).
fn config_with_program(
    c: &KilnModelConfig,
    program: Option<(&KilnProgramDesc, &ModelProgram<TensorView>)>,
) -> Result<ModelConfig> {
    let bad = |m: String| Error::Format(format!("model config from host: {m}"));
    if (c.struct_size as usize) < std::mem::size_of::<KilnModelConfig>() {
        return Err(bad(format!(
            "struct_size {} is smaller than the {} bytes of ABI {}",
            c.struct_size,
            std::mem::size_of::<KilnModelConfig>(),
            version_string(ABI_VERSION)
        )));
    }
    let unknown = c.flags & !flags::KNOWN_V1_0;
    if unknown != 0 {
        return Err(Error::Unsupported(format!(
            "the model uses features (flag bits {unknown:#x}) newer than plugin ABI {}",
            version_string(ABI_VERSION)
        )));
    }
    let size = |v: u64, what: &str| {
        usize::try_from(v).map_err(|_| bad(format!("{what} {v} does not fit usize")))
    };
    let arch = match program {
        Some((_, p)) => arch_with_program(c.arch, p),
        None => arch_from_id(c.arch),
    }
    .ok_or_else(|| Error::Unsupported(format!("unknown architecture id {}", c.arch)))?;
    let mut config = ModelConfig {
        arch,
        vocab_size: size(c.vocab_size, "vocab_size")?,
        hidden_size: size(c.hidden_size, "hidden_size")?,
        num_layers: size(c.num_layers, "num_layers")?,
        num_heads: size(c.num_heads, "num_heads")?,
        num_kv_heads: size(c.num_kv_heads, "num_kv_heads")?,
        head_dim: size(c.head_dim, "head_dim")?,
        ffn_size: size(c.ffn_size, "ffn_size")?,
        norm: norm_from_id(c.norm).ok_or_else(|| bad(format!("unknown norm id {}", c.norm)))?,
        norm_eps: c.norm_eps,
        activation: activation_from_id(c.activation)
            .ok_or_else(|| bad(format!("unknown activation id {}", c.activation)))?,
        rope: RopeConfig {
            kind: rope_kind_from_id(c.rope_kind)
                .ok_or_else(|| bad(format!("unknown rope kind id {}", c.rope_kind)))?,
            theta: c.rope_theta,
            scaling: rope_scaling_from_id(c.rope_scaling, c.rope_scaling_factor)
                .ok_or_else(|| bad(format!("unknown rope scaling id {}", c.rope_scaling)))?,
            rotary_dims: size(c.rotary_dims, "rotary_dims")?,
        },
        tied_embeddings: c.flags & flags::TIED_EMBEDDINGS != 0,
        context_length: size(c.context_length, "context_length")?,
        embedding_scale: 1.0,
        sliding_window: None,
        experts: None,
    };
    if let Some((desc, p)) = program {
        config.embedding_scale = p.embedding.scale;
        if desc.sliding_window != 0 {
            config.sliding_window = Some(SlidingWindow {
                window: size(desc.sliding_window, "sliding window")?,
                global_every: size(desc.sliding_global_every, "sliding window period")?,
                local_theta: (desc.local_rope_theta != 0.0).then_some(desc.local_rope_theta),
            });
        }
    }
    config.validate()?;
    Ok(config)
}

// ---- weights: host side ------------------------------------------------------------

/// Every tensor of `w` with its role and layer. Destructures exhaustively so a new weight
/// field cannot be forgotten here.
pub fn tensors_with_roles(w: &ModelWeights) -> Vec<(TensorRole, u32, &TensorView)> {
    let ModelWeights {
        token_embd,
        layers,
        output_norm,
        output_norm_bias,
        output,
        rope_freqs,
    } = w;
    let mut out = vec![
        (TensorRole::TokenEmbd, NO_LAYER, token_embd),
        (TensorRole::OutputNorm, NO_LAYER, output_norm),
    ];
    for (role, t) in [
        (TensorRole::OutputNormBias, output_norm_bias),
        (TensorRole::Output, output),
        (TensorRole::RopeFreqs, rope_freqs),
    ] {
        out.extend(t.as_ref().map(|t| (role, NO_LAYER, t)));
    }
    for (i, l) in layers.iter().enumerate() {
        let i = i as u32;
        let LayerWeights {
            attn_norm,
            attn_norm_bias,
            attn_q,
            attn_k,
            attn_v,
            attn_q_bias,
            attn_k_bias,
            attn_v_bias,
            attn_q_norm,
            attn_k_norm,
            attn_out,
            attn_out_bias,
            ffn_norm,
            ffn_norm_bias,
            ffn_gate,
            ffn_up,
            ffn_down,
            // Refused before a model reaches a plugin (`check_describable`).
            attn_sinks: _,
            experts: _,
            attn_post_norm: _,
            ffn_post_norm: _,
        } = l;
        out.extend([
            (TensorRole::AttnNorm, i, attn_norm),
            (TensorRole::AttnQ, i, attn_q),
            (TensorRole::AttnK, i, attn_k),
            (TensorRole::AttnV, i, attn_v),
            (TensorRole::AttnOut, i, attn_out),
        ]);
        for (role, t) in [
            (TensorRole::AttnNormBias, attn_norm_bias),
            (TensorRole::AttnQBias, attn_q_bias),
            (TensorRole::AttnKBias, attn_k_bias),
            (TensorRole::AttnVBias, attn_v_bias),
            (TensorRole::AttnQNorm, attn_q_norm),
            (TensorRole::AttnKNorm, attn_k_norm),
            (TensorRole::AttnOutBias, attn_out_bias),
            (TensorRole::FfnNorm, ffn_norm),
            (TensorRole::FfnNormBias, ffn_norm_bias),
            (TensorRole::FfnGate, ffn_gate),
            (TensorRole::FfnUp, ffn_up),
            (TensorRole::FfnDown, ffn_down),
        ] {
            out.extend(t.as_ref().map(|t| (role, i, t)));
        }
    }
    out
}

/// The descriptor of `t` in `role` of `layer`, pointing at `t`'s name and bytes.
fn tensor_desc(role: TensorRole, layer: u32, t: &TensorView) -> KilnTensorDesc {
    let mut dims = [0u64; MAX_DIMS];
    for (d, &v) in dims.iter_mut().zip(t.dims()) {
        *d = v as u64;
    }
    let bytes = t.bytes();
    KilnTensorDesc {
        name: KilnStr::new(t.name()),
        role: role as u32,
        layer,
        qtype: t.qtype().id(),
        n_dims: t.dims().len() as u32,
        dims,
        data: bytes.as_ptr(),
        len: bytes.len() as u64,
    }
}

/// The descriptors of one model, owned by the host for the duration of a call (or, for
/// `load`, alongside the executor). Holds a clone of the [`ModelIr`] (and of its program)
/// so the bytes the descriptors point to cannot be unmapped while the buffer lives.
pub struct ModelDescBuf {
    model: ModelIr,
    config: Box<KilnModelConfig>,
    tensors: Vec<KilnTensorDesc>,
    program: Option<ProgramDescBuf>,
}

/// A [`KilnProgramDesc`] and the arrays it points to.
struct ProgramDescBuf {
    /// The program described: keeps every tensor it names alive.
    _program: ModelProgram<TensorView>,
    desc: Box<KilnProgramDesc>,
    _branches: Vec<KilnBranchDesc>,
    _ops: Vec<KilnOpDesc>,
}

// SAFETY: the raw pointers inside point into `model` and the program (immutable, themselves
// Send + Sync) and into the boxes and vectors this struct owns and never mutates after
// construction.
unsafe impl Send for ModelDescBuf {}
// SAFETY: as for Send: the struct is never mutated after construction, so shared access only reads.
unsafe impl Sync for ModelDescBuf {}

impl ModelDescBuf {
    /// The descriptors of `model` for a plugin of ABI `peer`: with its program from 1.4;
    /// before, only a model `KilnModelConfig` describes ([`check_describable`]).
    pub fn new(model: &ModelIr, peer: u32) -> Result<ModelDescBuf> {
        let program = crate::program::build(model)?;
        check_describable(&model.config, &program, peer)?;
        let model = model.clone();
        let config = Box::new(config_to_abi(&model.config, &program));
        // `KilnStr::new(t.name())` and `bytes()` borrow from the TensorViews inside `model`
        // (and its program), whose `Arc`-held names and storage do not move when `model`
        // itself moves.
        let mut tensors: Vec<KilnTensorDesc> = tensors_with_roles(&model.weights)
            .into_iter()
            .map(|(role, layer, t)| tensor_desc(role, layer, t))
            .collect();
        let program = if version_minor(peer) >= 4 {
            Some(ProgramDescBuf::new(program, &model.config, &mut tensors)?)
        } else {
            None
        };
        Ok(ModelDescBuf {
            model,
            config,
            tensors,
            program,
        })
    }

    /// The descriptor, valid while `self` lives.
    pub fn desc(&self) -> KilnModelDesc {
        KilnModelDesc {
            struct_size: std::mem::size_of::<KilnModelDesc>() as u32,
            _reserved: 0,
            config: &*self.config,
            tensors: self.tensors.as_ptr(),
            n_tensors: self.tensors.len(),
            source: KilnStr::new(&self.model.source),
            program: self
                .program
                .as_ref()
                .map_or(std::ptr::null(), |p| &*p.desc as *const KilnProgramDesc),
        }
    }

    pub fn model(&self) -> &ModelIr {
        &self.model
    }
}

/// Tensor indices for a program's descriptor: a view is known by the bytes it reads (so the
/// tied head gets the embedding's index); one the roles did not list (a post-norm) is
/// appended as [`TensorRole::Other`].
struct TensorSlots<'a> {
    tensors: &'a mut Vec<KilnTensorDesc>,
    index: std::collections::HashMap<(usize, usize), u32>,
}

impl TensorSlots<'_> {
    fn of(&mut self, t: &TensorView) -> u32 {
        let key = (t.bytes().as_ptr() as usize, t.bytes().len());
        if let Some(&i) = self.index.get(&key) {
            return i;
        }
        self.tensors
            .push(tensor_desc(TensorRole::Other, NO_LAYER, t));
        let i = (self.tensors.len() - 1) as u32;
        self.index.insert(key, i);
        i
    }

    fn optional(&mut self, t: Option<&TensorView>) -> u32 {
        t.map_or(NO_TENSOR, |t| self.of(t))
    }

    fn norm(&mut self, n: Option<&Norm<TensorView>>) -> KilnNormDesc {
        match n {
            Some(n) => KilnNormDesc {
                kind: norm_id(n.kind),
                weight: self.of(&n.weight),
                bias: self.optional(n.bias.as_ref()),
                eps: n.eps,
            },
            None => KilnNormDesc {
                kind: 0,
                weight: NO_TENSOR,
                bias: NO_TENSOR,
                eps: 0.0,
            },
        }
    }

    fn op(&mut self, op: &Op<TensorView, TensorView>) -> Result<KilnOpDesc> {
        if let Some(what) = undescribable_part(op) {
            return Err(Error::Unsupported(format!(
                "plugin ABI {} cannot describe {what} to a plugin",
                version_string(ABI_VERSION)
            )));
        }
        Ok(match op {
            Op::Attention(a) => {
                let mut d = KilnOpDesc::empty(op_kind::ATTENTION, a.layer as u32);
                let heads = a.head_norms.as_ref();
                let slots = [
                    Some(&a.q.weight),
                    a.q.bias.as_ref(),
                    Some(&a.k.weight),
                    a.k.bias.as_ref(),
                    Some(&a.v.weight),
                    a.v.bias.as_ref(),
                    Some(&a.out.weight),
                    a.out.bias.as_ref(),
                    heads.map(|h| &h.q),
                    heads.map(|h| &h.k),
                ];
                for (d, t) in d.tensors.iter_mut().zip(slots) {
                    *d = self.optional(t);
                }
                d.values[0] = a.scale;
                d.values[1] = heads.map_or(0.0, |h| h.eps);
                d.ints[0] = a.span.window.map_or(0, |w| w as u64);
                d.ints[1] = a.span.local_rope as u64;
                d
            }
            Op::FeedForward(f) => {
                let mut d = KilnOpDesc::empty(op_kind::FEED_FORWARD, NO_LAYER);
                d.tensors[0] = self.optional(f.gate.as_ref());
                d.tensors[1] = self.of(&f.up);
                d.tensors[2] = self.of(&f.down);
                d.ints[0] = activation_id(f.activation) as u64;
                d
            }
            Op::Experts(_) => return Err(experts_undescribable(ABI_VERSION)),
        })
    }
}

/// What no ABI op can carry of `op` (attention sinks, feed-forward biases), if anything.
fn undescribable_part<M, V>(op: &Op<M, V>) -> Option<&'static str> {
    match op {
        Op::Attention(a) if a.sinks.is_some() => Some("attention sinks"),
        Op::FeedForward(f) if f.biases.is_some() => Some("feed-forward biases"),
        Op::FeedForward(f) if matches!(f.activation, Activation::SwigluOai { .. }) => {
            Some("gpt-oss's clamped SwiGLU")
        }
        _ => None,
    }
}

/// The error for a Mixture-of-Experts model offered to a plugin: no ABI op describes one.
fn experts_undescribable(peer: u32) -> Error {
    Error::Unsupported(format!(
        "plugin ABI {} cannot describe a Mixture-of-Experts feed-forward to a plugin",
        version_string(peer)
    ))
}

impl ProgramDescBuf {
    /// Describes `program` over `tensors` (appending the tensors only it names).
    fn new(
        program: ModelProgram<TensorView>,
        c: &ModelConfig,
        tensors: &mut Vec<KilnTensorDesc>,
    ) -> Result<ProgramDescBuf> {
        let index = tensors
            .iter()
            .enumerate()
            .map(|(i, t)| ((t.data as usize, t.len as usize), i as u32))
            .collect();
        let mut slots = TensorSlots { tensors, index };
        let mut branches = Vec::with_capacity(program.branches.len());
        let mut ops = Vec::new();
        for b in &program.branches {
            let first_op = ops.len() as u32;
            for op in &b.ops {
                ops.push(slots.op(op)?);
            }
            branches.push(KilnBranchDesc {
                norm: slots.norm(Some(&b.norm)),
                post_norm: slots.norm(b.post_norm.as_ref()),
                scale: b.scale,
                first_op,
                n_ops: b.ops.len() as u32,
            });
        }
        let window = c.sliding_window;
        let desc = Box::new(KilnProgramDesc {
            struct_size: std::mem::size_of::<KilnProgramDesc>() as u32,
            _reserved: 0,
            embedding: slots.of(&program.embedding.table),
            embedding_scale: program.embedding.scale,
            head_norm: slots.norm(Some(&program.head.norm)),
            output: slots.of(&program.head.output),
            logit_scale: program.head.logit_scale,
            rope_freqs: slots.optional(program.rope_freqs.as_ref()),
            local_rope_theta: window.and_then(|w| w.local_theta).unwrap_or(0.0),
            sliding_window: window.map_or(0, |w| w.window as u64),
            sliding_global_every: window.map_or(0, |w| w.global_every as u64),
            branches: branches.as_ptr(),
            n_branches: branches.len(),
            ops: ops.as_ptr(),
            n_ops: ops.len(),
        });
        Ok(ProgramDescBuf {
            _program: program,
            desc,
            _branches: branches,
            _ops: ops,
        })
    }
}

// ---- weights: plugin side ----------------------------------------------------------

/// Bytes owned by the host, seen from a plugin: the [`crate::Storage`] behind every
/// [`TensorView`] that [`model_from_desc`] builds.
pub struct HostBytes {
    ptr: *const u8,
    len: usize,
}

// SAFETY: the host guarantees the bytes are immutable and outlive the executor (see
// `KilnPluginApi::load`); reading them from any thread is sound.
unsafe impl Send for HostBytes {}
// SAFETY: as for Send: the bytes are immutable, so shared access only reads.
unsafe impl Sync for HostBytes {}

impl Deref for HostBytes {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        if self.len == 0 {
            return &[];
        }
        // SAFETY: see the Send/Sync impls; non-null and `len` bytes long, checked at creation.
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }
}

/// Rebuilds the [`ModelIr`] a host described, its tensors viewing the host's bytes
/// without copying, with the host's program when it sent one (ABI 1.4). Every field is
/// checked: unknown roles, qtypes or operation kinds, null pointers, lengths that disagree
/// with the dims, layers or tensor indices out of range, missing or duplicate roles, and a
/// program whose weights do not fit the config are [`Error::Format`] (or `Unsupported`).
///
/// # Safety
/// `desc` must be a valid descriptor whose pointers are readable, and the tensor bytes must
/// outlive every [`TensorView`] of the result (the ABI promises that until the executor is
/// freed; a `supports` call must drop the model before it returns).
pub unsafe fn model_from_desc(desc: *const KilnModelDesc) -> Result<ModelIr> {
    let bad = |m: String| Error::Format(format!("model descriptor from host: {m}"));
    // SAFETY: the caller promises a valid descriptor (or null, refused by `read`).
    let desc = unsafe { KilnModelDesc::read(desc) }.map_err(bad)?;
    // SAFETY: the descriptor's pointers are readable (the caller's promise) or null.
    let raw_config = unsafe { desc.config.as_ref() }.ok_or_else(|| bad("null config".into()))?;
    // SAFETY: as above, for the source string.
    let source = unsafe { desc.source.to_str("source", MAX_MESSAGE) }
        .map_err(bad)?
        .to_string();
    // SAFETY: `tensors` is readable for `n_tensors` entries (the caller's promise).
    let descs = unsafe { host_array(desc.tensors, desc.n_tensors, "tensor") }.map_err(bad)?;

    let mut views = Vec::with_capacity(descs.len());
    for (i, t) in descs.iter().enumerate() {
        // SAFETY: each descriptor's name and bytes are readable (the caller's promise).
        views.push(unsafe { tensor_from_desc(i, t) }.map_err(bad)?);
    }
    let program = if desc.program.is_null() {
        None
    } else {
        // SAFETY: non-null, and readable for its `struct_size` (the caller's promise).
        let program_desc = unsafe { read_program_desc(desc.program) }.map_err(bad)?;
        // SAFETY: its arrays are readable (the caller's promise).
        let program = unsafe { program_from_desc(&program_desc, &views) }?;
        Some((program_desc, program))
    };
    let config = config_with_program(raw_config, program.as_ref().map(|(d, p)| (d, p)))?;

    let layers = config.num_layers;
    let mut global: Vec<(TensorRole, TensorView)> = Vec::new();
    let mut per_layer: Vec<Vec<(TensorRole, TensorView)>> = vec![Vec::new(); layers];
    for ((role, view), t) in views.into_iter().zip(descs) {
        let name = view.name().to_string();
        if role == TensorRole::Other {
            // Named by the program alone.
            continue;
        }
        if role.per_layer() {
            let layer = t.layer as usize;
            if layer >= layers {
                return Err(bad(format!(
                    "tensor {name}: layer {} of a {layers}-layer model",
                    t.layer
                )));
            }
            per_layer[layer].push((role, view));
        } else {
            if t.layer != NO_LAYER {
                return Err(bad(format!(
                    "tensor {name}: global role {role:?} with layer {}",
                    t.layer
                )));
            }
            global.push((role, view));
        }
    }

    fn take(
        list: &mut Vec<(TensorRole, TensorView)>,
        role: TensorRole,
        ctx: &str,
    ) -> Result<Option<TensorView>> {
        let mut found = None;
        let mut i = 0;
        while i < list.len() {
            if list[i].0 == role {
                let (_, v) = list.swap_remove(i);
                if found.is_some() {
                    return Err(Error::Format(format!(
                        "model descriptor from host: {ctx}{role:?} appears twice"
                    )));
                }
                found = Some(v);
            } else {
                i += 1;
            }
        }
        Ok(found)
    }
    fn need(
        list: &mut Vec<(TensorRole, TensorView)>,
        role: TensorRole,
        ctx: &str,
    ) -> Result<TensorView> {
        take(list, role, ctx)?.ok_or_else(|| {
            Error::Format(format!(
                "model descriptor from host: {ctx}{role:?} is missing"
            ))
        })
    }

    let mut layer_weights = Vec::with_capacity(layers);
    for (i, mut list) in per_layer.into_iter().enumerate() {
        let ctx = format!("layer {i}: ");
        let l = &mut list;
        layer_weights.push(LayerWeights {
            attn_norm: need(l, TensorRole::AttnNorm, &ctx)?,
            attn_norm_bias: take(l, TensorRole::AttnNormBias, &ctx)?,
            attn_q: need(l, TensorRole::AttnQ, &ctx)?,
            attn_k: need(l, TensorRole::AttnK, &ctx)?,
            attn_v: need(l, TensorRole::AttnV, &ctx)?,
            attn_q_bias: take(l, TensorRole::AttnQBias, &ctx)?,
            attn_k_bias: take(l, TensorRole::AttnKBias, &ctx)?,
            attn_v_bias: take(l, TensorRole::AttnVBias, &ctx)?,
            attn_q_norm: take(l, TensorRole::AttnQNorm, &ctx)?,
            attn_k_norm: take(l, TensorRole::AttnKNorm, &ctx)?,
            attn_out: need(l, TensorRole::AttnOut, &ctx)?,
            attn_out_bias: take(l, TensorRole::AttnOutBias, &ctx)?,
            attn_sinks: None,
            ffn_norm: take(l, TensorRole::FfnNorm, &ctx)?,
            ffn_norm_bias: take(l, TensorRole::FfnNormBias, &ctx)?,
            ffn_gate: take(l, TensorRole::FfnGate, &ctx)?,
            ffn_up: Some(need(l, TensorRole::FfnUp, &ctx)?),
            ffn_down: Some(need(l, TensorRole::FfnDown, &ctx)?),
            experts: None,
            // Only a program names them; executors take them from it.
            attn_post_norm: None,
            ffn_post_norm: None,
        });
    }
    let g = &mut global;
    let weights = ModelWeights {
        token_embd: need(g, TensorRole::TokenEmbd, "")?,
        layers: layer_weights,
        output_norm: need(g, TensorRole::OutputNorm, "")?,
        output_norm_bias: take(g, TensorRole::OutputNormBias, "")?,
        output: take(g, TensorRole::Output, "")?,
        rope_freqs: take(g, TensorRole::RopeFreqs, "")?,
    };
    let model = ModelIr {
        config,
        weights,
        source,
        program: program.map(|(_, p)| Arc::new(p)),
    };
    // The checks a builder's output passes (shapes, KV layers, spans), and the host's flags
    // against the program: a plugin reading only `KilnModelConfig` must see the model the
    // weights make.
    let program = crate::program::build(&model)?;
    let made = structure_flags(&program, model.weights.output.is_none());
    if made != raw_config.flags {
        return Err(bad(format!(
            "the flags say {:#x}, the tensors and program make {made:#x}",
            raw_config.flags
        )));
    }
    Ok(model)
}

/// The `n` entries of a host array of `what`s; null is allowed only when `n` is 0.
///
/// # Safety
/// `ptr` must be readable for `n` entries, and stay so for `'a`.
unsafe fn host_array<'a, T>(
    ptr: *const T,
    n: usize,
    what: &str,
) -> std::result::Result<&'a [T], String> {
    if n == 0 {
        return Ok(&[]);
    }
    if ptr.is_null() {
        return Err(format!("null {what} array of length {n}"));
    }
    // SAFETY: non-null (checked) and `n` entries long (the caller's promise).
    Ok(unsafe { std::slice::from_raw_parts(ptr, n) })
}

/// Tensor `i` of a descriptor, checked and viewed in place.
///
/// # Safety
/// `t`'s name and data must be readable, the data for as long as the view lives.
unsafe fn tensor_from_desc(
    i: usize,
    t: &KilnTensorDesc,
) -> std::result::Result<(TensorRole, TensorView), String> {
    // SAFETY: the name is readable (the caller's promise).
    let name = unsafe { t.name.to_str("tensor name", MAX_MESSAGE) }
        .map_err(|m| format!("tensor {i}: {m}"))?;
    let role = TensorRole::from_id(t.role)
        .ok_or_else(|| format!("tensor {name}: unknown role id {}", t.role))?;
    let qtype = QType::from_id(t.qtype)
        .ok_or_else(|| format!("tensor {name}: unknown qtype id {}", t.qtype))?;
    let n_dims = t.n_dims as usize;
    if n_dims == 0 || n_dims > MAX_DIMS {
        return Err(format!(
            "tensor {name}: {n_dims} dims (1..={MAX_DIMS} allowed)"
        ));
    }
    let dims = t.dims[..n_dims]
        .iter()
        .map(|&d| {
            usize::try_from(d).map_err(|_| format!("tensor {name}: dim {d} does not fit usize"))
        })
        .collect::<std::result::Result<Vec<usize>, String>>()?;
    let len = usize::try_from(t.len)
        .map_err(|_| format!("tensor {name}: length {} does not fit usize", t.len))?;
    let expected = qtype
        .tensor_bytes(&dims)
        .map_err(|e| format!("tensor {name}: {e}"))?;
    if len != expected {
        return Err(format!(
            "tensor {name}: {len} bytes, but {qtype} {dims:?} needs {expected}"
        ));
    }
    if len > 0 && t.data.is_null() {
        return Err(format!("tensor {name}: null data pointer"));
    }
    let storage = Arc::new(HostBytes { ptr: t.data, len });
    let view = TensorView::new(name, qtype, dims, storage, 0).map_err(|e| e.to_string())?;
    Ok((role, view))
}

/// Reads a program descriptor of any 1.x minor from 1.4 on (the fields a newer minor
/// appends read as zero).
///
/// # Safety
/// `p` must be non-null and readable for its `struct_size` bytes.
unsafe fn read_program_desc(
    p: *const KilnProgramDesc,
) -> std::result::Result<KilnProgramDesc, String> {
    // SAFETY: non-null (the caller's promise); every minor's struct starts with this u32.
    let struct_size = unsafe { std::ptr::read(p as *const u32) } as usize;
    let full = std::mem::size_of::<KilnProgramDesc>();
    if struct_size < full {
        return Err(format!(
            "program struct_size {struct_size} is smaller than ABI 1.4's {full} bytes"
        ));
    }
    // SAFETY: at least `full` bytes are readable (checked against the caller's promise).
    Ok(unsafe { std::ptr::read(p) })
}

/// The [`ModelProgram`] a descriptor describes over `views` (the model's tensors in
/// descriptor order).
///
/// # Safety
/// `d`'s branch and op arrays must be readable for their lengths.
unsafe fn program_from_desc(
    d: &KilnProgramDesc,
    views: &[(TensorRole, TensorView)],
) -> Result<ModelProgram<TensorView>> {
    let bad = |m: String| Error::Format(format!("program from host: {m}"));
    for (n, what) in [(d.n_branches, "branches"), (d.n_ops, "operations")] {
        if n > MAX_PROGRAM_LEN {
            return Err(bad(format!(
                "{n} {what}; at most {MAX_PROGRAM_LEN} are allowed"
            )));
        }
    }
    // SAFETY: readable for their lengths (the caller's promise).
    let branches = unsafe { host_array(d.branches, d.n_branches, "branch") }.map_err(bad)?;
    // SAFETY: as above.
    let ops = unsafe { host_array(d.ops, d.n_ops, "operation") }.map_err(bad)?;
    let tensor = |i: u32, what: &str| -> Result<TensorView> {
        views
            .get(i as usize)
            .map(|(_, v)| v.clone())
            .ok_or_else(|| bad(format!("{what}: tensor index {i} of {}", views.len())))
    };
    let optional = |i: u32, what: &str| -> Result<Option<TensorView>> {
        match i {
            NO_TENSOR => Ok(None),
            i => tensor(i, what).map(Some),
        }
    };
    let norm = |n: &KilnNormDesc, what: &str| -> Result<Norm<TensorView>> {
        Ok(Norm {
            kind: norm_from_id(n.kind)
                .ok_or_else(|| bad(format!("{what}: unknown norm id {}", n.kind)))?,
            weight: tensor(n.weight, what)?,
            bias: optional(n.bias, what)?,
            eps: n.eps,
        })
    };
    let op = |o: &KilnOpDesc, at: &str| -> Result<Op<TensorView, TensorView>> {
        let t = |slot: usize| tensor(o.tensors[slot], at);
        let opt = |slot: usize| optional(o.tensors[slot], at);
        let linear = |w: usize| -> Result<Linear<TensorView, TensorView>> {
            Ok(Linear {
                weight: t(w)?,
                bias: opt(w + 1)?,
            })
        };
        match o.kind {
            op_kind::ATTENTION => {
                let head_norms = match (opt(8)?, opt(9)?) {
                    (Some(q), Some(k)) => Some(HeadNorms {
                        q,
                        k,
                        eps: o.values[1],
                    }),
                    (None, None) => None,
                    _ => return Err(bad(format!("{at}: one of the head norms is missing"))),
                };
                let window = match o.ints[0] {
                    0 => None,
                    w => Some(
                        usize::try_from(w)
                            .map_err(|_| bad(format!("{at}: window {w} does not fit usize")))?,
                    ),
                };
                let local_rope = match o.ints[1] {
                    0 => false,
                    1 => true,
                    v => return Err(bad(format!("{at}: local rope flag {v}"))),
                };
                Ok(Op::Attention(Attention {
                    layer: o.layer as usize,
                    q: linear(0)?,
                    k: linear(2)?,
                    v: linear(4)?,
                    head_norms,
                    span: LayerAttention { window, local_rope },
                    scale: o.values[0],
                    sinks: None,
                    out: linear(6)?,
                }))
            }
            op_kind::FEED_FORWARD => Ok(Op::FeedForward(FeedForward {
                gate: opt(0)?,
                up: t(1)?,
                down: t(2)?,
                activation: u32::try_from(o.ints[0])
                    .ok()
                    .and_then(activation_from_id)
                    .ok_or_else(|| bad(format!("{at}: unknown activation id {}", o.ints[0])))?,
                biases: None,
            })),
            k => Err(Error::Unsupported(format!(
                "{at}: operation kind {k} is newer than plugin ABI {}",
                version_string(ABI_VERSION)
            ))),
        }
    };
    let mut program_branches = Vec::with_capacity(branches.len());
    for (i, b) in branches.iter().enumerate() {
        let at = format!("branch {i}");
        let first = b.first_op as usize;
        let list = ops
            .get(first..first.saturating_add(b.n_ops as usize))
            .filter(|l| !l.is_empty())
            .ok_or_else(|| {
                bad(format!(
                    "{at}: operations {first}+{} of {}",
                    b.n_ops,
                    ops.len()
                ))
            })?;
        program_branches.push(Branch {
            norm: norm(&b.norm, &at)?,
            ops: list
                .iter()
                .enumerate()
                .map(|(j, o)| op(o, &format!("{at}, operation {j}")))
                .collect::<Result<_>>()?,
            post_norm: match b.post_norm.weight {
                NO_TENSOR => None,
                _ => Some(norm(&b.post_norm, &at)?),
            },
            scale: b.scale,
        });
    }
    Ok(ModelProgram {
        embedding: Embedding {
            table: tensor(d.embedding, "the embedding")?,
            scale: d.embedding_scale,
        },
        branches: program_branches,
        head: Head {
            norm: norm(&d.head_norm, "the head norm")?,
            output: tensor(d.output, "the output")?,
            logit_scale: d.logit_scale,
            vocab_rows: None,
        },
        rope_freqs: optional(d.rope_freqs, "the rope frequency factors")?,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tiny_model() -> ModelIr {
        let hidden = 32;
        let config = ModelConfig {
            arch: Architecture::Qwen2,
            vocab_size: 8,
            hidden_size: hidden,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 8,
            ffn_size: 64,
            norm_eps: 1e-6,
            rope: RopeConfig {
                kind: RopeKind::Neox,
                scaling: RopeScaling::Linear { factor: 2.0 },
                rotary_dims: 8,
                ..RopeConfig::default()
            },
            tied_embeddings: true,
            context_length: 128,
            ..ModelConfig::default()
        };
        let m = |name: &str, dims: Vec<usize>| {
            let n: usize = dims.iter().product();
            let v: Vec<f32> = (0..n).map(|i| i as f32 * 0.01).collect();
            TensorView::from_f32(name, dims, &v).unwrap()
        };
        let layer = |i: usize| LayerWeights {
            attn_norm: m(&format!("l{i}.attn_norm"), vec![hidden]),
            attn_norm_bias: None,
            attn_q: m(&format!("l{i}.q"), vec![hidden, 32]),
            attn_k: m(&format!("l{i}.k"), vec![hidden, 16]),
            attn_v: m(&format!("l{i}.v"), vec![hidden, 16]),
            attn_q_bias: Some(m(&format!("l{i}.qb"), vec![32])),
            attn_k_bias: Some(m(&format!("l{i}.kb"), vec![16])),
            attn_v_bias: Some(m(&format!("l{i}.vb"), vec![16])),
            attn_q_norm: None,
            attn_k_norm: None,
            attn_out: m(&format!("l{i}.o"), vec![32, hidden]),
            attn_out_bias: None,
            attn_sinks: None,
            ffn_norm: Some(m(&format!("l{i}.ffn_norm"), vec![hidden])),
            ffn_norm_bias: None,
            ffn_gate: Some(m(&format!("l{i}.gate"), vec![hidden, 64])),
            ffn_up: Some(m(&format!("l{i}.up"), vec![hidden, 64])),
            ffn_down: Some(m(&format!("l{i}.down"), vec![64, hidden])),
            experts: None,
            attn_post_norm: None,
            ffn_post_norm: None,
        };
        ModelIr {
            config,
            weights: ModelWeights {
                token_embd: m("token_embd", vec![hidden, 8]),
                layers: vec![layer(0), layer(1)],
                output_norm: m("output_norm", vec![hidden]),
                output_norm_bias: None,
                output: None,
                rope_freqs: None,
            },
            source: "synthetic".into(),
            program: None,
        }
    }

    #[test]
    fn version_packing() {
        assert_eq!(pack_version(1, 3), 0x0001_0003);
        assert_eq!(version_major(0x0002_0007), 2);
        assert_eq!(version_minor(0x0002_0007), 7);
        assert_eq!(
            version_string(ABI_VERSION),
            format!("{ABI_MAJOR}.{ABI_MINOR}")
        );
    }

    #[test]
    fn load_options_of_an_older_host_read_their_defaults() {
        let full = KilnLoadOptions {
            struct_size: std::mem::size_of::<KilnLoadOptions>() as u32,
            _reserved: 0,
            max_context: 77,
            max_sequences: 3,
            threads: 2,
            progress: None,
            progress_user: std::ptr::null_mut(),
            flags: load_flags::QUANTIZED_ACTIVATIONS,
            _reserved1: 0,
        };
        // SAFETY: `full` is a live options struct with its own struct_size.
        let read = unsafe { KilnLoadOptions::read(&full) }.unwrap();
        assert_eq!(
            (
                read.max_context,
                read.max_sequences,
                read.threads,
                read.flags
            ),
            (77, 3, 2, 1)
        );

        // A 1.0 host's options end before `flags`; whatever follows in memory is not theirs.
        let mut old = full;
        old.struct_size = LOAD_OPTIONS_SIZE_V1_0;
        old.flags = !0;
        // SAFETY: `old` is a live options struct; struct_size only shortens what is read.
        let read = unsafe { KilnLoadOptions::read(&old) }.unwrap();
        assert_eq!(
            (
                read.max_context,
                read.max_sequences,
                read.threads,
                read.flags
            ),
            (77, 3, 2, 0)
        );

        let mut short = full;
        short.struct_size = LOAD_OPTIONS_SIZE_V1_0 - 8;
        // SAFETY: `short` is a live options struct; a too-small struct_size is refused before reading past it.
        let err = unsafe { KilnLoadOptions::read(&short) }.unwrap_err();
        assert!(
            err.contains(&format!("struct_size {}", LOAD_OPTIONS_SIZE_V1_0 - 8)),
            "{err}"
        );
        // SAFETY: a null pointer is refused before any read.
        assert!(unsafe { KilnLoadOptions::read(std::ptr::null()) }.is_err());
    }

    /// `model`'s config as a host sends it.
    fn abi_config(model: &ModelIr) -> KilnModelConfig {
        config_to_abi(&model.config, &crate::program::build(model).unwrap())
    }

    #[test]
    fn config_round_trips() {
        let model = tiny_model();
        let back = config_from_abi(&abi_config(&model)).unwrap();
        assert_eq!(back, model.config);
    }

    #[test]
    fn the_flags_are_the_weights_and_are_checked_by_the_plugin() {
        let model = tiny_model();
        assert_eq!(
            abi_config(&model).flags,
            flags::GATED_FFN | flags::QKV_BIAS | flags::TIED_EMBEDDINGS
        );
        let mut no_bias = tiny_model();
        no_bias.config.arch = Architecture::Llama;
        for l in &mut no_bias.weights.layers {
            (l.attn_q_bias, l.attn_k_bias, l.attn_v_bias) = (None, None, None);
        }
        assert_eq!(
            abi_config(&no_bias).flags,
            flags::GATED_FFN | flags::TIED_EMBEDDINGS
        );
        assert_eq!(
            abi_config(&tiny_gemma()).flags,
            flags::GATED_FFN | flags::QKV_BIAS | flags::QK_NORM | flags::TIED_EMBEDDINGS
        );

        // A host whose flags disagree with its tensors is refused, with and without a program.
        for peer in [pack_version(1, 3), ABI_VERSION] {
            let buf = ModelDescBuf::new(&model, peer).unwrap();
            let mut config = abi_config(&model);
            config.flags &= !flags::QKV_BIAS;
            let mut desc = buf.desc();
            desc.config = &config;
            // SAFETY: `desc` points into `buf` and at `config`, both alive here.
            let err = unsafe { model_from_desc(&desc) }.unwrap_err().to_string();
            assert!(err.contains("the flags say 0x11"), "{err}");
        }

        // Layers that differ (a bias on one of them) cannot be told by flags: an older
        // plugin is refused the model, a 1.4 one gets its program.
        let mut mixed = no_bias;
        let biased = tiny_model().weights.layers[1].clone();
        let l = &mut mixed.weights.layers[1];
        (l.attn_q_bias, l.attn_k_bias, l.attn_v_bias) =
            (biased.attn_q_bias, biased.attn_k_bias, biased.attn_v_bias);
        let err = ModelDescBuf::new(&mixed, pack_version(1, 3)).err().unwrap();
        assert!(err.to_string().contains("layers that differ"), "{err}");
        let buf = ModelDescBuf::new(&mixed, ABI_VERSION).unwrap();
        // SAFETY: `buf` outlives `back`.
        let back = unsafe { model_from_desc(&buf.desc()) }.unwrap();
        assert_eq!(named(&back), named(&mixed));
    }

    #[test]
    fn yarn_models_are_refused_by_plugins() {
        // ABI 1.x has no fields for YaRN's ramp and attention factor: a plugin must refuse
        // the model, never run it as if it were unscaled.
        let mut config = tiny_model().config;
        config.rope.scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_context: 32,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attn_factor: RopeScaling::yarn_mscale(4.0),
            truncate: true,
        };
        let program = crate::program::build(&tiny_model()).unwrap();
        let r = config_from_abi(&config_to_abi(&config, &program));
        assert!(
            matches!(r, Err(Error::Format(ref m)) if m.contains("rope scaling id 2")),
            "{r:?}"
        );
    }

    #[test]
    fn unknown_flags_and_ids_are_refused() {
        let model = tiny_model();
        let mut c = abi_config(&model);
        c.flags |= 1 << 20;
        assert!(matches!(config_from_abi(&c), Err(Error::Unsupported(_))));
        let mut c = abi_config(&model);
        c.arch = 77;
        assert!(matches!(config_from_abi(&c), Err(Error::Unsupported(_))));
        let mut c = abi_config(&model);
        c.norm = 9;
        assert!(matches!(config_from_abi(&c), Err(Error::Format(_))));
    }

    #[test]
    fn model_round_trips_without_copying() {
        let model = tiny_model();
        let buf = ModelDescBuf::new(&model, ABI_VERSION).unwrap();
        let desc = buf.desc();
        // SAFETY: `desc` points into `buf`, which outlives the rebuilt model's use here.
        let back = unsafe { model_from_desc(&desc) }.unwrap();
        assert_eq!(back.config, model.config);
        assert_eq!(back.source, "synthetic");
        let a = tensors_with_roles(&model.weights);
        let b = tensors_with_roles(&back.weights);
        assert_eq!(a.len(), b.len());
        for ((ra, la, ta), (rb, lb, tb)) in a.iter().zip(&b) {
            assert_eq!(
                (ra, la, ta.name(), ta.qtype(), ta.dims()),
                (rb, lb, tb.name(), tb.qtype(), tb.dims())
            );
            assert_eq!(ta.bytes(), tb.bytes());
        }
        // Zero copy: the rebuilt view reads the very bytes the host's view reads.
        assert_eq!(
            back.weights.token_embd.bytes().as_ptr(),
            buf.model().weights.token_embd.bytes().as_ptr()
        );
    }

    /// Kiln's own qtypes (ids from 128 up) cross the ABI like ggml's: the plugin side
    /// rebuilds an APR Q4 tensor from id 128.
    #[test]
    fn kiln_qtype_ids_cross_the_abi() {
        let mut model = tiny_model();
        let dims = model.weights.layers[1]
            .ffn_up
            .as_ref()
            .unwrap()
            .dims()
            .to_vec();
        let bytes: Vec<u8> = (0..QType::AprQ4.tensor_bytes(&dims).unwrap())
            .map(|i| i as u8)
            .collect();
        model.weights.layers[1].ffn_up =
            Some(TensorView::from_bytes("l1.up", QType::AprQ4, dims.clone(), bytes).unwrap());
        let buf = ModelDescBuf::new(&model, ABI_VERSION).unwrap();
        // SAFETY: the names point into `buf`'s owned strings.
        let desc = buf
            .tensors
            .iter()
            .find(|t| unsafe { t.name.to_str("", 64) } == Ok("l1.up"))
            .unwrap();
        assert_eq!(desc.qtype, 128);
        // SAFETY: `buf` outlives `back`'s use in this test.
        let back = unsafe { model_from_desc(&buf.desc()) }.unwrap();
        let t = back.weights.layers[1].ffn_up.as_ref().unwrap();
        assert_eq!(
            (t.qtype(), t.dims(), t.bytes()),
            (
                QType::AprQ4,
                &dims[..],
                model.weights.layers[1].ffn_up.as_ref().unwrap().bytes()
            )
        );
    }

    /// `tiny_model` made Gemma-shaped: per-head Q/K norms, sandwich norms, a sliding window
    /// on every other layer, a scaled embedding and GELU.
    fn tiny_gemma() -> ModelIr {
        let mut model = tiny_model();
        let c = &mut model.config;
        c.arch = Architecture::Gemma3;
        c.activation = Activation::Gelu;
        c.embedding_scale = (c.hidden_size as f32).sqrt();
        c.sliding_window = Some(SlidingWindow {
            window: 4,
            global_every: 2,
            local_theta: Some(1e4),
        });
        let (hd, h) = (c.head_dim, c.hidden_size);
        for (i, l) in model.weights.layers.iter_mut().enumerate() {
            let v = |name: &str, n: usize| {
                let values: Vec<f32> = (0..n).map(|j| 1.0 + j as f32 * 0.01).collect();
                TensorView::from_f32(&format!("l{i}.{name}"), vec![n], &values).unwrap()
            };
            l.attn_q_norm = Some(v("q_norm", hd));
            l.attn_k_norm = Some(v("k_norm", hd));
            l.attn_post_norm = Some(v("post_attn", h));
            l.ffn_post_norm = Some(v("post_ffn", h));
        }
        model
    }

    /// A program with every weight replaced by its name: what two programs are compared by.
    fn named(model: &ModelIr) -> String {
        let program = crate::program::build(model).unwrap();
        let named = program
            .map(
                &model.config,
                |m, _| Ok::<_, ()>(m.name().to_string()),
                |v, _| Ok(v.name().to_string()),
            )
            .unwrap();
        format!("{named:?}")
    }

    #[test]
    fn a_program_carries_what_the_config_cannot() {
        for model in [tiny_model(), tiny_gemma()] {
            let buf = ModelDescBuf::new(&model, ABI_VERSION).unwrap();
            // SAFETY: `buf` outlives `back`'s use here.
            let back = unsafe { model_from_desc(&buf.desc()) }.unwrap();
            assert!(back.program.is_some());
            assert_eq!(back.config, model.config);
            assert_eq!(named(&back), named(&model));
        }

        // Granite's multipliers are read back from the program.
        let mut granite = tiny_model();
        let scales = GraniteScales {
            residual: 0.22,
            attention: 0.0078125,
            logits: 8.0,
        };
        granite.config.arch = Architecture::Granite(scales);
        granite.config.embedding_scale = 12.0;
        let buf = ModelDescBuf::new(&granite, ABI_VERSION).unwrap();
        // SAFETY: as above.
        let back = unsafe { model_from_desc(&buf.desc()) }.unwrap();
        assert_eq!(back.config, granite.config);
        assert_eq!(named(&back), named(&granite));
    }

    #[test]
    fn an_older_plugin_gets_no_program_and_no_model_it_would_misread() {
        let v1_3 = pack_version(1, 3);
        let buf = ModelDescBuf::new(&tiny_model(), v1_3).unwrap();
        assert!(buf.desc().program.is_null());
        // SAFETY: `buf` outlives `back`.
        let back = unsafe { model_from_desc(&buf.desc()) }.unwrap();
        assert!(back.program.is_none());

        let err = ModelDescBuf::new(&tiny_gemma(), v1_3).err().unwrap();
        assert!(
            err.to_string()
                .contains("plugin ABI 1.3 cannot describe the gemma3"),
            "{err}"
        );

        // A 1.3 host's descriptor ends before `program`: a 1.4 plugin reads it as absent,
        // whatever lies in memory after it.
        let buf = ModelDescBuf::new(&tiny_model(), ABI_VERSION).unwrap();
        let mut desc = buf.desc();
        desc.struct_size = MODEL_DESC_SIZE_V1_0;
        // SAFETY: `desc` is a live descriptor; struct_size only shortens what is read.
        let read = unsafe { KilnModelDesc::read(&desc) }.unwrap();
        assert!(read.program.is_null());
        desc.struct_size = MODEL_DESC_SIZE_V1_0 - 8;
        // SAFETY: refused before reading past struct_size.
        assert!(unsafe { model_from_desc(&desc) }.is_err());
    }

    #[test]
    fn malformed_programs_are_refused() {
        let model = tiny_gemma();
        let buf = ModelDescBuf::new(&model, ABI_VERSION).unwrap();
        // SAFETY: the program descriptor lives in `buf`.
        let program = unsafe { *buf.desc().program };
        // SAFETY: as above, for its arrays.
        let ops = unsafe { std::slice::from_raw_parts(program.ops, program.n_ops) }.to_vec();
        // SAFETY: as above.
        let branches =
            unsafe { std::slice::from_raw_parts(program.branches, program.n_branches) }.to_vec();
        type Edit = dyn Fn(&mut KilnProgramDesc, &mut Vec<KilnBranchDesc>, &mut Vec<KilnOpDesc>);
        let check = |edit: &Edit, needle: &str| {
            let (mut p, mut b, mut o) = (program, branches.clone(), ops.clone());
            p.branches = b.as_ptr();
            p.n_branches = b.len();
            p.ops = o.as_ptr();
            p.n_ops = o.len();
            // In place: the pointers above stay valid.
            edit(&mut p, &mut b, &mut o);
            let mut desc = buf.desc();
            desc.program = &p;
            // SAFETY: everything `desc` points to outlives the call; malformed on purpose.
            let err = unsafe { model_from_desc(&desc) }.unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        };
        check(&|_, _, o| o[0].kind = 9, "operation kind 9 is newer");
        check(&|_, _, o| o[0].tensors[0] = 100_000, "tensor index 100000");
        check(
            &|_, _, o| o[0].tensors[8] = NO_TENSOR,
            "one of the head norms",
        );
        check(&|_, _, o| o[1].ints[0] = 77, "unknown activation id 77");
        check(&|_, b, _| b[0].n_ops = 0, "operations 0+0");
        check(&|_, b, _| b[1].first_op = 1_000, "operations 1000+1");
        check(&|p, _, _| p.n_ops = MAX_PROGRAM_LEN + 1, "at most");
        check(&|p, _, _| p.head_norm.kind = 5, "unknown norm id 5");
        // Shapes and spans are checked as a builder's output is.
        check(
            &|_, _, o| o[0].tensors[2] = o[0].tensors[0],
            "the model config needs",
        );
        check(&|_, _, o| o[0].ints[0] = 9, "attends over");
        check(&|_, _, o| o[2].layer = 0, "attends twice in layer 0");
        check(&|_, _, o| o[0].layer = 2, "layer 2 of a 2-layer model");
        check(&|p, _, _| p.sliding_global_every = 0, "sliding window");
    }

    #[test]
    fn malformed_descriptors_are_refused() {
        // Without a program (a 1.3 plugin's descriptor), so the roles alone name tensors.
        let model = tiny_model();
        let buf = ModelDescBuf::new(&model, pack_version(1, 3)).unwrap();
        let check = |edit: &dyn Fn(&mut Vec<KilnTensorDesc>), needle: &str| {
            let mut tensors = buf.tensors.clone();
            edit(&mut tensors);
            let mut desc = buf.desc();
            desc.tensors = tensors.as_ptr();
            desc.n_tensors = tensors.len();
            // SAFETY: `tensors` and `buf` outlive the call; the descriptor is malformed on purpose.
            let err = unsafe { model_from_desc(&desc) }.unwrap_err().to_string();
            assert!(err.contains(needle), "{err:?} lacks {needle:?}");
        };
        check(&|t| t[0].qtype = 99, "unknown qtype id 99");
        check(&|t| t[0].qtype = 129, "unknown qtype id 129");
        check(&|t| t[0].role = 1000, "unknown role id 1000");
        check(&|t| t[0].len += 1, "bytes, but");
        check(&|t| t[0].data = std::ptr::null(), "null data pointer");
        check(
            &|t| {
                t[0].name = KilnStr {
                    ptr: std::ptr::null(),
                    len: 4,
                }
            },
            "null pointer",
        );
        check(
            &|t| {
                t[0].name = KilnStr {
                    ptr: b"\xff\xfe".as_ptr(),
                    len: 2,
                }
            },
            "not UTF-8",
        );
        check(&|t| t[0].n_dims = 9, "9 dims");
        check(&|t| t[2].layer = 7, "layer 7");
        check(
            &|t| {
                t.remove(0);
            },
            "TokenEmbd is missing",
        );
        check(
            &|t| {
                let d = t[3];
                t.push(d);
            },
            "appears twice",
        );
    }
}
