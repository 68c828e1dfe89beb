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
    Activation, Architecture, LayerWeights, ModelConfig, ModelIr, ModelWeights, NormKind,
    RopeConfig, RopeKind, RopeScaling, TensorView,
};
use crate::qtype::QType;

/// Major version: bumped by any change an older host or plugin could misread.
pub const ABI_MAJOR: u16 = 1;
/// Minor version: bumped by purely additive changes (see the module docs). 1.2 added qtype
/// id 128 (APR Q4): ids from 128 up are kiln's own types, outside ggml's id space. 1.3
/// appended [`KilnPluginApi::decode_sample`] (a plugin draws tokens itself).
pub const ABI_MINOR: u16 = 3;
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
}

impl TensorRole {
    const ALL: [TensorRole; 22] = [
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
    ];

    pub fn from_id(id: u32) -> Option<TensorRole> {
        TensorRole::ALL.iter().copied().find(|r| *r as u32 == id)
    }

    /// Roles that exist once per layer.
    pub fn per_layer(self) -> bool {
        self as u32 >= 16
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
        // Never sent under ABI 1.3: the host refuses models the ABI cannot describe
        // (`check_describable`), and Gemma 3's sandwich norms, embedding scale and sliding
        // window are not in `KilnModelConfig`.
        Architecture::Gemma3 => 4,
        Architecture::Phi3 => 5,
        // Never sent: its multipliers are not in `KilnModelConfig` (`check_describable`).
        Architecture::Granite(_) => 6,
    }
}

/// Whether `KilnModelConfig` can describe `c`: an `Unsupported` error naming what it lacks
/// otherwise (a plugin must never run a model it would misread).
pub fn check_describable(c: &ModelConfig) -> Result<()> {
    let lacks = if c.arch == Architecture::Gemma3 {
        Some("the gemma3 architecture")
    } else if matches!(c.arch, Architecture::Granite(_)) {
        Some("granite's residual, attention and logit multipliers")
    } else if c.embedding_scale != 1.0 {
        Some("a scaled embedding")
    } else if c.sandwich_norms {
        Some("norms after attention and the MLP")
    } else if c.sliding_window.is_some() {
        Some("sliding-window attention")
    } else {
        None
    };
    match lacks {
        Some(what) => Err(Error::Unsupported(format!(
            "plugin ABI {} cannot describe {what} to a plugin",
            version_string(ABI_VERSION)
        ))),
        None => Ok(()),
    }
}
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

/// The plain-data form of `c`.
pub fn config_to_abi(c: &ModelConfig) -> KilnModelConfig {
    let (rope_scaling, rope_scaling_factor) = rope_scaling_id(c.rope.scaling);
    let flag = |on: bool, bit: u32| if on { bit } else { 0 };
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
        flags: flag(c.gated_ffn, flags::GATED_FFN)
            | flag(c.parallel_residual, flags::PARALLEL_RESIDUAL)
            | flag(c.qkv_bias, flags::QKV_BIAS)
            | flag(c.qk_norm, flags::QK_NORM)
            | flag(c.tied_embeddings, flags::TIED_EMBEDDINGS),
    }
}

/// Rebuilds a [`ModelConfig`], refusing unknown enum ids, unknown flag bits, sizes that do
/// not fit `usize` and inconsistent shapes.
pub fn config_from_abi(c: &KilnModelConfig) -> Result<ModelConfig> {
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
    let arch = arch_from_id(c.arch)
        .ok_or_else(|| Error::Unsupported(format!("unknown architecture id {}", c.arch)))?;
    let config = ModelConfig {
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
        gated_ffn: c.flags & flags::GATED_FFN != 0,
        parallel_residual: c.flags & flags::PARALLEL_RESIDUAL != 0,
        qkv_bias: c.flags & flags::QKV_BIAS != 0,
        qk_norm: c.flags & flags::QK_NORM != 0,
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
        sandwich_norms: false,
        sliding_window: None,
    };
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
            attn_post_norm: _,
            ffn_post_norm: _,
        } = l;
        out.extend([
            (TensorRole::AttnNorm, i, attn_norm),
            (TensorRole::AttnQ, i, attn_q),
            (TensorRole::AttnK, i, attn_k),
            (TensorRole::AttnV, i, attn_v),
            (TensorRole::AttnOut, i, attn_out),
            (TensorRole::FfnUp, i, ffn_up),
            (TensorRole::FfnDown, i, ffn_down),
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
        ] {
            out.extend(t.as_ref().map(|t| (role, i, t)));
        }
    }
    out
}

/// The descriptors of one model, owned by the host for the duration of a call (or, for
/// `load`, alongside the executor). Holds a clone of the [`ModelIr`] so the bytes the
/// descriptors point to cannot be unmapped while the buffer lives.
pub struct ModelDescBuf {
    model: ModelIr,
    config: Box<KilnModelConfig>,
    tensors: Vec<KilnTensorDesc>,
}

// SAFETY: the raw pointers inside point into `model` (immutable, itself Send + Sync) and
// into `config`/`tensors`, which this struct owns and never mutates after construction.
unsafe impl Send for ModelDescBuf {}
// SAFETY: as for Send: the struct is never mutated after construction, so shared access only reads.
unsafe impl Sync for ModelDescBuf {}

impl ModelDescBuf {
    pub fn new(model: &ModelIr) -> ModelDescBuf {
        let model = model.clone();
        let config = Box::new(config_to_abi(&model.config));
        let tensors = tensors_with_roles(&model.weights)
            .into_iter()
            .map(|(role, layer, t)| {
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
            })
            .collect();
        // `KilnStr::new(t.name())` and `bytes()` borrow from the TensorViews inside `model`,
        // whose `Arc`-held names and storage do not move when `model` itself moves.
        ModelDescBuf {
            model,
            config,
            tensors,
        }
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
        }
    }

    pub fn model(&self) -> &ModelIr {
        &self.model
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
/// without copying. Every field is checked: unknown roles or qtypes, null pointers,
/// lengths that disagree with the dims, layers out of range, missing or duplicate roles
/// are [`Error::Format`].
///
/// # Safety
/// `desc` must be a valid descriptor whose pointers are readable, and the tensor bytes must
/// outlive every [`TensorView`] of the result (the ABI promises that until the executor is
/// freed; a `supports` call must drop the model before it returns).
pub unsafe fn model_from_desc(desc: *const KilnModelDesc) -> Result<ModelIr> {
    let bad = |m: String| Error::Format(format!("model descriptor from host: {m}"));
    // SAFETY: the caller promises a valid descriptor (or null, refused here).
    let desc = unsafe { desc.as_ref() }.ok_or_else(|| bad("null model descriptor".into()))?;
    if (desc.struct_size as usize) < std::mem::size_of::<KilnModelDesc>() {
        return Err(bad(format!(
            "struct_size {} is too small",
            desc.struct_size
        )));
    }
    // SAFETY: the descriptor's pointers are readable (the caller's promise) or null.
    let config = unsafe { desc.config.as_ref() }.ok_or_else(|| bad("null config".into()))?;
    let config = config_from_abi(config)?;
    // SAFETY: as above, for the source string.
    let source = unsafe { desc.source.to_str("source", MAX_MESSAGE) }
        .map_err(bad)?
        .to_string();
    if desc.n_tensors > 0 && desc.tensors.is_null() {
        return Err(bad(format!(
            "null tensor array of length {}",
            desc.n_tensors
        )));
    }
    let descs: &[KilnTensorDesc] =
        // SAFETY: non-null (checked) and `n_tensors` entries long (the caller's promise).
        if desc.n_tensors == 0 { &[] } else { unsafe { std::slice::from_raw_parts(desc.tensors, desc.n_tensors) } };

    let layers = config.num_layers;
    let mut global: Vec<(TensorRole, TensorView)> = Vec::new();
    let mut per_layer: Vec<Vec<(TensorRole, TensorView)>> = vec![Vec::new(); layers];
    for (i, t) in descs.iter().enumerate() {
        // SAFETY: each descriptor's name is readable (the caller's promise).
        let name = unsafe { t.name.to_str("tensor name", MAX_MESSAGE) }
            .map_err(|m| bad(format!("tensor {i}: {m}")))?;
        let role = TensorRole::from_id(t.role)
            .ok_or_else(|| bad(format!("tensor {name}: unknown role id {}", t.role)))?;
        let qtype = QType::from_id(t.qtype)
            .ok_or_else(|| bad(format!("tensor {name}: unknown qtype id {}", t.qtype)))?;
        let n_dims = t.n_dims as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(bad(format!(
                "tensor {name}: {n_dims} dims (1..={MAX_DIMS} allowed)"
            )));
        }
        let dims = t.dims[..n_dims]
            .iter()
            .map(|&d| {
                usize::try_from(d)
                    .map_err(|_| bad(format!("tensor {name}: dim {d} does not fit usize")))
            })
            .collect::<Result<Vec<usize>>>()?;
        let len = usize::try_from(t.len).map_err(|_| {
            bad(format!(
                "tensor {name}: length {} does not fit usize",
                t.len
            ))
        })?;
        let expected = qtype
            .tensor_bytes(&dims)
            .map_err(|e| bad(format!("tensor {name}: {e}")))?;
        if len != expected {
            return Err(bad(format!(
                "tensor {name}: {len} bytes, but {qtype} {dims:?} needs {expected}"
            )));
        }
        if len > 0 && t.data.is_null() {
            return Err(bad(format!("tensor {name}: null data pointer")));
        }
        let storage = Arc::new(HostBytes { ptr: t.data, len });
        let view = TensorView::new(name, qtype, dims, storage, 0)?;
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
            ffn_norm: take(l, TensorRole::FfnNorm, &ctx)?,
            ffn_norm_bias: take(l, TensorRole::FfnNormBias, &ctx)?,
            ffn_gate: take(l, TensorRole::FfnGate, &ctx)?,
            ffn_up: need(l, TensorRole::FfnUp, &ctx)?,
            ffn_down: need(l, TensorRole::FfnDown, &ctx)?,
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
    Ok(ModelIr {
        config,
        weights,
        source,
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
            qkv_bias: true,
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
            ffn_norm: Some(m(&format!("l{i}.ffn_norm"), vec![hidden])),
            ffn_norm_bias: None,
            ffn_gate: Some(m(&format!("l{i}.gate"), vec![hidden, 64])),
            ffn_up: m(&format!("l{i}.up"), vec![hidden, 64]),
            ffn_down: m(&format!("l{i}.down"), vec![64, hidden]),
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

    #[test]
    fn config_round_trips() {
        let model = tiny_model();
        let back = config_from_abi(&config_to_abi(&model.config)).unwrap();
        assert_eq!(back, model.config);
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
        };
        let r = config_from_abi(&config_to_abi(&config));
        assert!(
            matches!(r, Err(Error::Format(ref m)) if m.contains("rope scaling id 2")),
            "{r:?}"
        );
    }

    #[test]
    fn unknown_flags_and_ids_are_refused() {
        let model = tiny_model();
        let mut c = config_to_abi(&model.config);
        c.flags |= 1 << 20;
        assert!(matches!(config_from_abi(&c), Err(Error::Unsupported(_))));
        let mut c = config_to_abi(&model.config);
        c.arch = 77;
        assert!(matches!(config_from_abi(&c), Err(Error::Unsupported(_))));
        let mut c = config_to_abi(&model.config);
        c.norm = 9;
        assert!(matches!(config_from_abi(&c), Err(Error::Format(_))));
    }

    #[test]
    fn model_round_trips_without_copying() {
        let model = tiny_model();
        let buf = ModelDescBuf::new(&model);
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
        let dims = model.weights.layers[1].ffn_up.dims().to_vec();
        let bytes: Vec<u8> = (0..QType::AprQ4.tensor_bytes(&dims).unwrap())
            .map(|i| i as u8)
            .collect();
        model.weights.layers[1].ffn_up =
            TensorView::from_bytes("l1.up", QType::AprQ4, dims.clone(), bytes).unwrap();
        let buf = ModelDescBuf::new(&model);
        // SAFETY: the names point into `buf`'s owned strings.
        let desc = buf
            .tensors
            .iter()
            .find(|t| unsafe { t.name.to_str("", 64) } == Ok("l1.up"))
            .unwrap();
        assert_eq!(desc.qtype, 128);
        // SAFETY: `buf` outlives `back`'s use in this test.
        let back = unsafe { model_from_desc(&buf.desc()) }.unwrap();
        let t = &back.weights.layers[1].ffn_up;
        assert_eq!(
            (t.qtype(), t.dims(), t.bytes()),
            (
                QType::AprQ4,
                &dims[..],
                model.weights.layers[1].ffn_up.bytes()
            )
        );
    }

    #[test]
    fn malformed_descriptors_are_refused() {
        let model = tiny_model();
        let buf = ModelDescBuf::new(&model);
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
