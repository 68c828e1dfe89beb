//! # kiln-plugin-sdk
//!
//! Everything a third-party backend author needs to ship a kiln backend as one shared
//! library. Implement the ordinary [`kiln_core::Backend`] and [`kiln_core::LayerExecutor`]
//! traits, build the crate as a `cdylib`, and call [`export_backend!`] once:
//!
//! ```ignore
//! use kiln_plugin_sdk::kiln_core::{Backend, Architecture};
//! kiln_plugin_sdk::export_backend!(MyBackend::new);
//! // or, with a fallible constructor and a declared architecture list:
//! kiln_plugin_sdk::export_backend!(try MyBackend::open, architectures = [Architecture::Llama]);
//! ```
//!
//! The macro generates the `kiln_plugin_entry` symbol and the `#[repr(C)]` function table
//! of [`kiln_core::plugin_abi`]. The SDK side of every table entry checks its pointers,
//! rebuilds a [`kiln_core::ModelIr`] over the host's memory without copying, turns
//! [`kiln_core::Error`]s into status codes and messages, and catches panics: a panic becomes
//! [`KilnStatus::PANIC`](kiln_core::plugin_abi::KilnStatus::PANIC) and poisons the executor
//! it happened in, and never unwinds into the host.
//!
//! A plugin depends on this crate alone; [`kiln_core`] is re-exported so the plugin's IR types
//! are the very ones the SDK marshals into. It must not know the host's internals: all it
//! sees is the ABI.

pub use kiln_core;
pub use kiln_core::plugin_abi as abi;

/// Exports a [`kiln_core::Backend`] as this library's plugin entry point.
///
/// - `export_backend!(ctor)`: `ctor()` returns the backend.
/// - `export_backend!(try ctor)`: `ctor()` returns `Result<Backend, E: Display>`; an `Err`
///   makes the host refuse the plugin with that message.
/// - Either form takes `, architectures = [Architecture::Llama, ...]` to declare which
///   architectures the backend runs (the host lists them and skips other models without
///   asking); leaving it out means "decided per model by `supports`".
///
/// The plugin's version reported to the host is the crate's `CARGO_PKG_VERSION`. Use the
/// macro once per library.
#[macro_export]
macro_rules! export_backend {
    (try $ctor:expr $(, architectures = [$($arch:expr),* $(,)?])? $(,)?) => {
        $crate::__export_backend_impl!({ ($ctor)() }, [$($($arch),*)?]);
    };
    ($ctor:expr $(, architectures = [$($arch:expr),* $(,)?])? $(,)?) => {
        $crate::__export_backend_impl!(
            { ::std::result::Result::<_, ::std::convert::Infallible>::Ok(($ctor)()) },
            [$($($arch),*)?]
        );
    };
}

#[doc(hidden)]
#[macro_export]
macro_rules! __export_backend_impl {
    ($make:block, [$($arch:expr),*]) => {
        const _: () = {
            unsafe extern "C" fn __kiln_create_backend(
                host_abi: u32,
                out: *mut *mut $crate::abi::KilnBackend,
                err: *mut $crate::abi::KilnOwnedStr,
            ) -> $crate::abi::KilnStatus {
                $crate::__private::create_backend(
                    host_abi,
                    out,
                    err,
                    ::std::env!("CARGO_PKG_VERSION"),
                    || ::std::vec![$($arch),*],
                    || $make,
                )
            }
            static KILN_PLUGIN_API: $crate::abi::KilnPluginApi = $crate::__private::api(__kiln_create_backend);
            #[unsafe(no_mangle)]
            pub extern "C" fn kiln_plugin_entry() -> *const $crate::abi::KilnPluginApi {
                &KILN_PLUGIN_API
            }
        };
    };
}

#[doc(hidden)]
pub mod __private {
    //! The table entries. Not API: reached only through [`export_backend!`].

    use std::any::Any;
    use std::ffi::c_void;
    use std::fmt::Display;
    use std::panic::{catch_unwind, AssertUnwindSafe};
    use std::sync::{Arc, Mutex};

    use kiln_core::plugin_abi::*;
    use kiln_core::{
        Architecture, Backend, DecodeItem, Error, LayerExecutor, LoadOptions, Sampler, Support,
    };

    /// The table every plugin exports; only `create_backend` differs between plugins.
    pub const fn api(
        create_backend: unsafe extern "C" fn(
            u32,
            *mut *mut KilnBackend,
            *mut KilnOwnedStr,
        ) -> KilnStatus,
    ) -> KilnPluginApi {
        KilnPluginApi {
            abi_version: ABI_VERSION,
            struct_size: std::mem::size_of::<KilnPluginApi>() as u32,
            free_string: Some(free_string),
            create_backend: Some(create_backend),
            destroy_backend: Some(destroy_backend),
            describe: Some(describe),
            probe: Some(probe),
            supports: Some(supports),
            load: Some(load),
            free_executor: Some(free_executor),
            new_sequence: Some(new_sequence),
            free_sequence: Some(free_sequence),
            sequence_len: Some(sequence_len),
            truncate_sequence: Some(truncate_sequence),
            prefill: Some(prefill),
            decode: Some(decode),
            decode_sample: Some(decode_sample),
        }
    }

    struct BackendBox {
        backend: Box<dyn Backend>,
        // Copies taken once so `describe` can hand out pointers that stay put until
        // `destroy_backend`, whatever the backend's own accessors do.
        name: String,
        version: String,
        description: String,
        qtypes: Vec<u32>,
        architectures: Vec<u32>,
    }

    struct ExecBox {
        exec: Box<dyn LayerExecutor>,
        /// Reused for every decode step: the ABI's items are not `DecodeItem`s.
        items: Vec<DecodeItem>,
        /// Set when a call panicked: the executor's state (KV caches half written) can no
        /// longer be trusted, so every later call fails instead of computing garbage.
        poisoned: Option<String>,
    }

    fn owned(s: String) -> KilnOwnedStr {
        let bytes = s.into_bytes().into_boxed_slice();
        let len = bytes.len();
        KilnOwnedStr {
            ptr: Box::into_raw(bytes) as *mut u8,
            len,
        }
    }

    unsafe fn set_str(slot: *mut KilnOwnedStr, s: String) {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            if let Some(slot) = slot.as_mut() {
                *slot = owned(s);
            }
        }
    }

    unsafe extern "C" fn free_string(s: KilnOwnedStr) {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            if !s.ptr.is_null() {
                drop(Box::from_raw(std::ptr::slice_from_raw_parts_mut(
                    s.ptr, s.len,
                )));
            }
        }
    }

    fn panic_message(payload: &(dyn Any + Send)) -> String {
        if let Some(s) = payload.downcast_ref::<&str>() {
            (*s).to_string()
        } else if let Some(s) = payload.downcast_ref::<String>() {
            s.clone()
        } else {
            "non-string panic payload".to_string()
        }
    }

    /// The status a kiln error travels as, and its message without the variant's prefix
    /// (the host rebuilds the same variant from the status).
    fn status_of(e: Error) -> (KilnStatus, String) {
        match e {
            Error::InvalidArgument(m) => (KilnStatus::INVALID_ARGUMENT, m),
            Error::Unsupported(m) => (KilnStatus::UNSUPPORTED, m),
            Error::OutOfMemory(m) => (KilnStatus::OUT_OF_MEMORY, m),
            // The 1.x ABI has no status of its own for a full KV cache: the host sees
            // OutOfMemory with the message.
            e @ Error::KvCacheFull { .. } => (KilnStatus::OUT_OF_MEMORY, e.to_string()),
            Error::InvalidShape(m) => (KilnStatus::INVALID_SHAPE, m),
            Error::Format(m) => (KilnStatus::FORMAT, m),
            Error::Backend { message, .. } => (KilnStatus::ERROR, message),
            other => (KilnStatus::ERROR, other.to_string()),
        }
    }

    /// Runs `f`, turning its error or panic into a status and a message in `err`.
    unsafe fn guard(err: *mut KilnOwnedStr, f: impl FnOnce() -> Result<(), Error>) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            match catch_unwind(AssertUnwindSafe(f)) {
                Ok(Ok(())) => KilnStatus::OK,
                Ok(Err(e)) => {
                    let (status, message) = status_of(e);
                    set_str(err, message);
                    status
                }
                Err(payload) => {
                    // The payload alone: the host names the function (`panicked in decode: ...`).
                    set_str(err, panic_message(&*payload));
                    KilnStatus::PANIC
                }
            }
        }
    }

    fn null_arg(what: &str) -> Error {
        Error::InvalidArgument(format!("{what} is a null pointer"))
    }

    pub unsafe fn create_backend<B, E, M, A>(
        host_abi: u32,
        out: *mut *mut KilnBackend,
        err: *mut KilnOwnedStr,
        version: &'static str,
        architectures: A,
        make: M,
    ) -> KilnStatus
    where
        B: Backend + 'static,
        E: Display,
        M: FnOnce() -> Result<B, E>,
        A: FnOnce() -> Vec<Architecture>,
    {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            guard(err, || {
                if out.is_null() {
                    return Err(null_arg("out"));
                }
                if version_major(host_abi) != ABI_MAJOR {
                    return Err(Error::Unsupported(format!(
                        "plugin speaks ABI {}, host speaks {}",
                        version_string(ABI_VERSION),
                        version_string(host_abi)
                    )));
                }
                let backend = make().map_err(|e| Error::Backend {
                    backend: String::new(),
                    message: e.to_string(),
                })?;
                let boxed = BackendBox {
                    name: backend.name().to_string(),
                    version: version.to_string(),
                    description: backend.description().to_string(),
                    // Kiln-only ids (≥ 128, APR's types) arrived in ABI 1.2: an older host
                    // would refuse the whole plugin for one id it cannot name.
                    qtypes: backend
                        .qtypes()
                        .iter()
                        .filter(|q| q.is_ggml() || version_minor(host_abi) >= 2)
                        .map(|q| q.id())
                        .collect(),
                    architectures: architectures().iter().map(arch_id).collect(),
                    backend: Box::new(backend),
                };
                *out = Box::into_raw(Box::new(boxed)) as *mut KilnBackend;
                Ok(())
            })
        }
    }

    unsafe extern "C" fn destroy_backend(backend: *mut KilnBackend) {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            if !backend.is_null() {
                // A Drop that panics must not unwind into the host; there is no one to report to.
                let _ = catch_unwind(AssertUnwindSafe(|| {
                    drop(Box::from_raw(backend as *mut BackendBox))
                }));
            }
        }
    }

    unsafe fn backend_ref<'a>(backend: *mut KilnBackend) -> Result<&'a BackendBox, Error> {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            (backend as *const BackendBox)
                .as_ref()
                .ok_or_else(|| null_arg("backend"))
        }
    }

    unsafe extern "C" fn describe(
        backend: *mut KilnBackend,
        out: *mut KilnBackendInfo,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            guard(err, || {
                let b = backend_ref(backend)?;
                let out = out.as_mut().ok_or_else(|| null_arg("out"))?;
                if (out.struct_size as usize) < std::mem::size_of::<KilnBackendInfo>() {
                    return Err(Error::InvalidArgument(format!(
                        "backend info struct_size {} is smaller than ABI {}'s {} bytes",
                        out.struct_size,
                        version_string(ABI_VERSION),
                        std::mem::size_of::<KilnBackendInfo>()
                    )));
                }
                out.name = KilnStr::new(&b.name);
                out.version = KilnStr::new(&b.version);
                out.description = KilnStr::new(&b.description);
                out.qtypes = b.qtypes.as_ptr();
                out.n_qtypes = b.qtypes.len();
                out.architectures = b.architectures.as_ptr();
                out.n_architectures = b.architectures.len();
                Ok(())
            })
        }
    }

    unsafe extern "C" fn probe(
        backend: *mut KilnBackend,
        device: *mut KilnOwnedStr,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            let mut unavailable = false;
            let status = guard(err, || {
                let b = backend_ref(backend)?;
                if device.is_null() {
                    return Err(null_arg("device"));
                }
                match b.backend.probe() {
                    Ok(dev) => set_str(device, dev),
                    Err(why) => {
                        unavailable = true;
                        set_str(err, why);
                    }
                }
                Ok(())
            });
            if unavailable && status.is_ok() {
                KilnStatus::UNAVAILABLE
            } else {
                status
            }
        }
    }

    unsafe extern "C" fn supports(
        backend: *mut KilnBackend,
        model: *const KilnModelDesc,
        out: *mut KilnSupport,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            guard(err, || {
                let b = backend_ref(backend)?;
                let out = out.as_mut().ok_or_else(|| null_arg("out"))?;
                // The views borrow the host's bytes for this call only; `model` is dropped
                // before returning (a backend must not keep clones from `supports`).
                let model = model_from_desc(model)?;
                let (supported, score, message) = match b.backend.supports(&model) {
                    Support::Yes { score, note } => (1, score, note),
                    Support::No { reason } => (0, 0, reason),
                };
                *out = KilnSupport {
                    supported,
                    score,
                    message: owned(message),
                };
                Ok(())
            })
        }
    }

    /// The host's progress callback, callable only while `load` runs: the flag is cleared
    /// (under the lock, so no call is in flight) before `load` returns.
    struct HostProgress {
        f: KilnProgressFn,
        user: *mut c_void,
        live: Mutex<bool>,
    }
    // SAFETY: the host promises the callback may be called from any thread during `load`;
    // `live` keeps every call inside that window.
    unsafe impl Send for HostProgress {}
    // SAFETY: as for Send: calls are serialised by `live`'s lock.
    unsafe impl Sync for HostProgress {}

    unsafe extern "C" fn load(
        backend: *mut KilnBackend,
        model: *const KilnModelDesc,
        options: *const KilnLoadOptions,
        out: *mut *mut KilnExecutor,
        info: *mut KilnExecutorInfo,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            let mut host_progress: Option<Arc<HostProgress>> = None;
            let status = guard(err, || {
                let b = backend_ref(backend)?;
                // A copy of the host's prefix: options appended after the host's minor read as
                // zero, their defaults.
                let o = KilnLoadOptions::read(options).map_err(Error::InvalidArgument)?;
                let info = info.as_mut().ok_or_else(|| null_arg("info"))?;
                if out.is_null() {
                    return Err(null_arg("out"));
                }
                if (info.struct_size as usize) < std::mem::size_of::<KilnExecutorInfo>() {
                    return Err(Error::InvalidArgument(format!(
                        "executor info struct_size {} is too small",
                        info.struct_size
                    )));
                }
                let size = |v: u64, what: &str| {
                    usize::try_from(v).map_err(|_| {
                        Error::InvalidArgument(format!("{what} {v} does not fit usize"))
                    })
                };
                let progress = o.progress.map(|f| {
                    let hp = Arc::new(HostProgress {
                        f,
                        user: o.progress_user,
                        live: Mutex::new(true),
                    });
                    host_progress = Some(hp.clone());
                    Arc::new(move |done: u64, total: u64| {
                        let live = hp.live.lock().unwrap_or_else(|p| p.into_inner());
                        if *live {
                            // Sound: the host keeps `user` valid during `load`, and `live` says
                            // we are inside it (this closure is inside `load`'s unsafe block).
                            (hp.f)(hp.user, done, total)
                        }
                    }) as kiln_core::ProgressFn
                });
                let options = LoadOptions {
                    max_context: size(o.max_context, "max_context")?,
                    max_sequences: size(o.max_sequences, "max_sequences")?,
                    threads: match o.threads {
                        0 => None,
                        n => Some(size(n, "threads")?),
                    },
                    progress,
                    // Bits this SDK does not know are permissions from a newer host; declining
                    // them is always allowed (see `load_flags`).
                    quantized_activations: o.flags & load_flags::QUANTIZED_ACTIVATIONS != 0,
                    ..LoadOptions::default()
                };
                let model = model_from_desc(model)?;
                let exec = b.backend.load(&model, &options)?;
                info.max_context = exec.max_context() as u64;
                info.max_sequences = exec.max_sequences() as u64;
                let boxed = ExecBox {
                    exec,
                    items: Vec::new(),
                    poisoned: None,
                };
                *out = Box::into_raw(Box::new(boxed)) as *mut KilnExecutor;
                Ok(())
            });
            if let Some(hp) = host_progress {
                *hp.live.lock().unwrap_or_else(|p| p.into_inner()) = false;
            }
            status
        }
    }

    unsafe extern "C" fn free_executor(executor: *mut KilnExecutor) {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            if !executor.is_null() {
                let _ = catch_unwind(AssertUnwindSafe(|| {
                    drop(Box::from_raw(executor as *mut ExecBox))
                }));
            }
        }
    }

    /// Runs one executor call: checks the handle, refuses a poisoned executor, and poisons
    /// it when `f` panics.
    unsafe fn with_exec(
        executor: *mut KilnExecutor,
        err: *mut KilnOwnedStr,
        what: &str,
        f: impl FnOnce(&mut ExecBox) -> Result<(), Error>,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            let Some(e) = (executor as *mut ExecBox).as_mut() else {
                set_str(err, "executor is a null pointer".into());
                return KilnStatus::INVALID_ARGUMENT;
            };
            if let Some(why) = &e.poisoned {
                set_str(
                    err,
                    format!("executor is unusable after an earlier panic {why}"),
                );
                return KilnStatus::ERROR;
            }
            let status = guard(err, || f(&mut *e));
            if status == KilnStatus::PANIC {
                e.poisoned = Some(match err.as_ref() {
                    Some(s) if !s.is_none() => {
                        format!(
                            "in {what}: {}",
                            String::from_utf8_lossy(std::slice::from_raw_parts(s.ptr, s.len))
                        )
                    }
                    _ => format!("in {what}"),
                });
            }
            status
        }
    }

    unsafe fn slice<'a, T>(ptr: *const T, len: usize, what: &str) -> Result<&'a [T], Error> {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            match (ptr.is_null(), len) {
                (_, 0) => Ok(&[]),
                (true, _) => Err(Error::InvalidArgument(format!(
                    "{what} is a null pointer with length {len}"
                ))),
                (false, _) => Ok(std::slice::from_raw_parts(ptr, len)),
            }
        }
    }

    unsafe fn slice_mut<'a, T>(ptr: *mut T, len: usize, what: &str) -> Result<&'a mut [T], Error> {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            match (ptr.is_null(), len) {
                (_, 0) => Ok(&mut []),
                (true, _) => Err(Error::InvalidArgument(format!(
                    "{what} is a null pointer with length {len}"
                ))),
                (false, _) => Ok(std::slice::from_raw_parts_mut(ptr, len)),
            }
        }
    }

    unsafe extern "C" fn new_sequence(
        executor: *mut KilnExecutor,
        out: *mut u32,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            with_exec(executor, err, "new_sequence", |e| {
                let out = out.as_mut().ok_or_else(|| null_arg("out"))?;
                *out = e.exec.new_sequence()?;
                Ok(())
            })
        }
    }

    unsafe extern "C" fn free_sequence(
        executor: *mut KilnExecutor,
        seq: u32,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            with_exec(executor, err, "free_sequence", |e| {
                e.exec.free_sequence(seq)
            })
        }
    }

    unsafe extern "C" fn sequence_len(
        executor: *mut KilnExecutor,
        seq: u32,
        out: *mut u64,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            with_exec(executor, err, "sequence_len", |e| {
                let out = out.as_mut().ok_or_else(|| null_arg("out"))?;
                *out = e.exec.sequence_len(seq)? as u64;
                Ok(())
            })
        }
    }

    unsafe extern "C" fn truncate_sequence(
        executor: *mut KilnExecutor,
        seq: u32,
        len: u64,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            with_exec(executor, err, "truncate_sequence", |e| {
                let len = usize::try_from(len).map_err(|_| {
                    Error::InvalidArgument(format!("length {len} does not fit usize"))
                })?;
                e.exec.truncate_sequence(seq, len)
            })
        }
    }

    unsafe extern "C" fn prefill(
        executor: *mut KilnExecutor,
        seq: u32,
        tokens: *const u32,
        n_tokens: usize,
        logits: *mut f32,
        n_logits: usize,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            with_exec(executor, err, "prefill", |e| {
                let tokens = slice(tokens, n_tokens, "tokens")?;
                let logits = slice_mut(logits, n_logits, "logits")?;
                e.exec.prefill(seq, tokens, logits)
            })
        }
    }

    unsafe extern "C" fn decode(
        executor: *mut KilnExecutor,
        items: *const KilnDecodeItem,
        n_items: usize,
        logits: *mut f32,
        n_logits: usize,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            with_exec(executor, err, "decode", |e| {
                let items = slice(items, n_items, "items")?;
                let logits = slice_mut(logits, n_logits, "logits")?;
                e.items.clear();
                e.items.extend(items.iter().map(|i| DecodeItem {
                    seq: i.seq,
                    token: i.token,
                }));
                e.exec.decode(&e.items, logits)
            })
        }
    }

    unsafe extern "C" fn decode_sample(
        executor: *mut KilnExecutor,
        items: *const KilnDecodeItem,
        n_items: usize,
        samplers: *mut KilnSamplerState,
        n_samplers: usize,
        tokens: *mut u32,
        n_tokens: usize,
        err: *mut KilnOwnedStr,
    ) -> KilnStatus {
        // SAFETY: the host calls through the ABI (kiln_core::plugin_abi) with pointers that
        // are null or valid for the lengths given, and with handles this SDK created.
        unsafe {
            with_exec(executor, err, "decode_sample", |e| {
                let items = slice(items, n_items, "items")?;
                let states = slice_mut(samplers, n_samplers, "samplers")?;
                let tokens = slice_mut(tokens, n_tokens, "tokens")?;
                e.items.clear();
                e.items.extend(items.iter().map(|i| DecodeItem {
                    seq: i.seq,
                    token: i.token,
                }));
                let mut drawn: Vec<Sampler> = states
                    .iter()
                    .map(|s| s.to_sampler())
                    .collect::<Result<_, Error>>()?;
                e.exec.decode_sample(&e.items, &mut drawn, tokens)?;
                // The generators moved on; the host's samplers continue from here.
                for (state, sampler) in states.iter_mut().zip(&drawn) {
                    state.rng_state = sampler.rng.state();
                }
                Ok(())
            })
        }
    }
}
